"""Benchmark cases for row-weighted SwiGLU (MoE experts), y [8192, 32768] bf16 and float32 router
weights [8192, 1] -> [8192, 16384] bf16: fusedlib against eager, torch.compile and megatron-core."""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from ..core import BenchCase, Impl
from ._glu import DEFAULT_SHAPE, SWEEP_H, weighted_glu_bytes
from .baselines import compile_impl, try_import

MEGATRON = ("megatron.core.fusions.fused_bias_swiglu", "weighted_bias_swiglu_impl")


def _case(shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    n_rows, two_h = shape
    w_dtype = torch.float32  # router probabilities stay in float32 in Megatron's MoE

    def make_inputs(device, requires_grad):
        y = torch.randn(n_rows, two_h, device=device, dtype=dtype, requires_grad=requires_grad)
        w = torch.rand(n_rows, 1, device=device, dtype=w_dtype, requires_grad=requires_grad)
        return y, w

    impls = [Impl("fusedlib", lambda y, w: weighted_bias_swiglu_impl(y, None, w)),
             compile_impl(unfused.weighted_swiglu)]
    skipped = {}
    if baselines:
        impls.insert(1, Impl("eager", unfused.weighted_swiglu))
        mcore, why = try_import(*MEGATRON)
        if mcore is not None:
            impls.append(Impl("megatron-core", lambda y, w: mcore(y, None, w)))
        else:
            skipped["megatron-core"] = why
        skipped["liger"] = "Liger-Kernel has no row-weighted SwiGLU"
    nbytes = weighted_glu_bytes(n_rows, two_h // 2, torch.finfo(dtype).bits // 8, torch.finfo(w_dtype).bits // 8)
    return BenchCase("weighted_swiglu", shape, dtype, make_inputs, nbytes, impls, skipped)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, 2h] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 32768] with every baseline; with ``sweep``, other widths at 2^28
    elements against torch.compile (compiled statically for each shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        n = DEFAULT_SHAPE[0] * DEFAULT_SHAPE[1]
        out += [_case((n // (2 * h), 2 * h), dtype, baselines=False) for h in SWEEP_H if 2 * h != DEFAULT_SHAPE[1]]
    return out
