"""Benchmark cases for GEGLU, y [8192, 32768] -> [8192, 16384] bf16: fusedlib against eager,
torch.compile, megatron-core and Liger-Kernel (no bias, as Liger takes none)."""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_bias_geglu import bias_geglu_impl
from ..core import BenchCase
from ._glu import DEFAULT_SHAPE, SWEEP_H, glu_bytes, glu_case, glu_cases  # noqa: F401  (re-exported for the chapter)

MEGATRON = ("megatron.core.fusions.fused_bias_geglu", "bias_geglu_impl")
LIGER = ("liger_kernel.ops.geglu", "LigerGELUMulFunction")


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 32768] with every baseline; with ``sweep``, other widths at 2^28 elements."""
    return glu_cases("geglu", bias_geglu_impl, unfused.geglu, MEGATRON, LIGER, sweep, dtype)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, 2h] with every baseline (the headline's, and ``--host``'s)."""
    return glu_case("geglu", tuple(shape), dtype, bias_geglu_impl, unfused.geglu, MEGATRON, LIGER, baselines=True)
