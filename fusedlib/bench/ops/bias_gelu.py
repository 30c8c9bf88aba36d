"""Benchmark cases for bias + GeLU: fusedlib against eager, torch.compile, megatron-core."""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_bias_gelu import bias_gelu_impl
from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

DEFAULT_SHAPE = (8192, 16384)  # [s*b, 4h] of a GPT MLP, bf16: 268 MB per tensor
SWEEP_H = (1024, 4096, 16384, 65536)  # hidden sizes at a constant 2^27 elements


def bias_gelu_bytes(n_rows: int, h: int, elem: int) -> dict[str, int]:
    """Fewest bytes: fwd reads y and bias, writes out; bwd reads g, y, bias, writes dy, dbias."""
    n = n_rows * h
    fwd = (2 * n + h) * elem
    bwd = (3 * n + 2 * h) * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _case(shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    n_rows, h = shape

    def make_inputs(device, requires_grad):
        y = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        b = torch.randn(h, device=device, dtype=dtype, requires_grad=requires_grad)
        return y, b

    impls = [Impl("fusedlib", lambda y, b: bias_gelu_impl(y, b)),
             compile_impl(lambda y, b: unfused.bias_gelu(b, y))]
    skipped = {}
    if baselines:
        # eager: what a user writes in PyTorch, two kernels (add, then F.gelu's tanh form)
        impls.insert(1, Impl("eager", lambda y, b: torch.nn.functional.gelu(y + b, approximate="tanh")))
        mcore, why = try_import("megatron.core.fusions.fused_bias_gelu", "bias_gelu_impl")
        if mcore is not None:
            impls.append(Impl("megatron-core", mcore))
        else:
            skipped["megatron-core"] = why
    return BenchCase("bias_gelu", shape, dtype, make_inputs,
                     bias_gelu_bytes(n_rows, h, torch.finfo(dtype).bits // 8), impls, skipped)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, h] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 16384] with every baseline; with ``sweep``, h in SWEEP_H
    at 2^27 elements against torch.compile (compiled statically for each shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        n = DEFAULT_SHAPE[0] * DEFAULT_SHAPE[1]
        out += [_case((n // h, h), dtype, baselines=False) for h in SWEEP_H if h != DEFAULT_SHAPE[1]]
    return out
