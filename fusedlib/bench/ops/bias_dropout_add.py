"""Benchmark cases for bias + dropout + residual add: fusedlib against eager, torch.compile,
megatron-core, in training mode (dropout on) at p = 0.1."""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_bias_dropout import bias_dropout_add_fused_train
from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

DEFAULT_SHAPE = (32768, 4096)  # [s*b, h] of a GPT layer's output, bf16: 268 MB per tensor
SWEEP_H = (1024, 4096, 8192, 16384)  # hidden sizes at a constant 2^27 elements
PROB = 0.1  # Megatron's default hidden_dropout


def bias_dropout_add_bytes(n_rows: int, h: int, x_elem: int, r_elem: int | None = None) -> dict[str, int]:
    """Fewest bytes, no mask: fwd reads x, bias, residual and writes out; bwd reads g and
    writes dx and dbias (d residual is g itself: no traffic).

    Args:
        n_rows, h: the input is [n_rows, h].
        x_elem: bytes per element of x and bias.
        r_elem: bytes per element of the residual and out (default: x_elem).
    """
    r_elem = x_elem if r_elem is None else r_elem
    n = n_rows * h
    fwd = n * x_elem + h * x_elem + n * r_elem + n * r_elem
    bwd = n * r_elem + n * x_elem + h * x_elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _unfused_train(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return unfused.bias_dropout_add((x, b), r, PROB, True)


def _case(shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    n_rows, h = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        b = torch.randn(h, device=device, dtype=dtype, requires_grad=requires_grad)
        r = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        return x, b, r

    impls = [Impl("fusedlib", lambda x, b, r: bias_dropout_add_fused_train((x, b), r, PROB)),
             compile_impl(_unfused_train)]
    skipped = {}
    if baselines:
        impls.insert(1, Impl("eager", _unfused_train))
        mcore, why = try_import("megatron.core.fusions.fused_bias_dropout", "bias_dropout_add_fused_train")
        if mcore is not None:
            impls.append(Impl("megatron-core", lambda x, b, r: mcore((x, b), r, PROB)))
        else:
            skipped["megatron-core"] = why
    elem = torch.finfo(dtype).bits // 8
    return BenchCase("bias_dropout_add", shape, dtype, make_inputs, bias_dropout_add_bytes(n_rows, h, elem),
                     impls, skipped)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, h] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [32768, 4096] with every baseline; with ``sweep``, h in SWEEP_H at
    2^27 elements against torch.compile (compiled statically for each shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        n = DEFAULT_SHAPE[0] * DEFAULT_SHAPE[1]
        out += [_case((n // h, h), dtype, baselines=False) for h in SWEEP_H if h != DEFAULT_SHAPE[1]]
    return out
