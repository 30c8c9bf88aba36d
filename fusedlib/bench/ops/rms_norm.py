"""Benchmark cases for RMSNorm: fusedlib against eager ``F.rms_norm``, ``torch.compile`` of
it, Liger-Kernel and Apex (where they import), plus a sweep over hidden sizes. Byte
counts: :func:`fusedlib.bench.ops.layer_norm.rms_norm_bytes`."""
from __future__ import annotations

import torch

from ..core import BenchCase
from .layer_norm import DEFAULT_SHAPE, SWEEP_H, norm_case, norm_cases, rms_norm_bytes  # noqa: F401


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, h] with every baseline (the headline's, and ``--host``'s)."""
    return norm_case("rms_norm", tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [32768, 4096] bf16 with every baseline; with ``sweep``, h in
    SWEEP_H (768..16384) at 2^27 elements against torch.compile, Liger and Apex."""
    return norm_cases("rms_norm", sweep, dtype)
