"""Benchmark cases for SwiGLU, y [8192, 32768] -> [8192, 16384] bf16: fusedlib against eager,
torch.compile, megatron-core and Liger-Kernel (no bias: Llama-style MLPs have none, and Liger takes none)."""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_bias_swiglu import bias_swiglu_impl
from ..core import BenchCase
from ._glu import DEFAULT_SHAPE, SWEEP_H, glu_bytes, glu_case, glu_cases  # noqa: F401  (re-exported for the chapter)

MEGATRON = ("megatron.core.fusions.fused_bias_swiglu", "bias_swiglu_impl")
LIGER = ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 32768] with every baseline; with ``sweep``, other widths at 2^28 elements."""
    return glu_cases("swiglu", bias_swiglu_impl, unfused.swiglu, MEGATRON, LIGER, sweep, dtype)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, 2h] with every baseline (the headline's, and ``--host``'s)."""
    return glu_case("swiglu", tuple(shape), dtype, bias_swiglu_impl, unfused.swiglu, MEGATRON, LIGER, baselines=True)
