"""Shared pieces of the GLU benchmark cases (geglu, swiglu, weighted_swiglu): byte counts and
the case builder. The GLUs take y [n, 2h] and return [n, h]."""
from __future__ import annotations

from typing import Callable

import torch

from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

DEFAULT_SHAPE = (8192, 32768)  # y = [s*b, 2*ffn] of a GPT MLP with gated units, bf16: 537 MB in, 268 MB out
SWEEP_H = (1024, 4096, 16384, 65536)  # output widths h at a constant 2^28 input elements


def glu_bytes(n_rows: int, h: int, elem: int, bias: bool = False) -> dict[str, int]:
    """Fewest bytes of a GLU y [n, 2h] -> out [n, h], elements of ``elem`` bytes.

    fwd reads y (2h per row) and the bias (2h, if any), writes out (h per row);
    bwd reads g (h per row) and y (2h per row), writes dy (2h per row), and with a bias
    reads it and writes its gradient (2h each). The activation act(y1) is not stored.
    """
    n = n_rows * h
    fwd = (2 * n + n) * elem + (2 * h * elem if bias else 0)
    bwd = (n + 2 * n + 2 * n) * elem + (2 * 2 * h * elem if bias else 0)
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def weighted_glu_bytes(n_rows: int, h: int, elem: int, w_elem: int) -> dict[str, int]:
    """Fewest bytes of a row-weighted GLU: :func:`glu_bytes` plus the weights [n, 1]
    (``w_elem`` bytes each): read once in fwd; read once and their gradient written in bwd."""
    b = glu_bytes(n_rows, h, elem)
    fwd = b["fwd"] + n_rows * w_elem
    bwd = b["fwd+bwd"] - b["fwd"] + 2 * n_rows * w_elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def glu_case(op: str, shape: tuple[int, int], dtype: torch.dtype, fused: Callable, reference: Callable,
             megatron: tuple[str, str] | None, liger: tuple[str, str] | None, baselines: bool) -> BenchCase:
    """One GLU case without bias: fusedlib, torch.compile of the unfused reference (static, for
    this shape), liger; with ``baselines`` also eager and megatron-core.

    Liger's ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` take the two halves as two
    tensors (as Liger's LlamaMLP makes them with two linears), and copy a non-contiguous
    half: so Liger gets its own contiguous a, b [n, h] (the same bytes as y), not chunks of y.
    Its backward writes the gradients over a and b in place, as Liger does in training.
    """
    n_rows, two_h = shape
    h = two_h // 2
    liger_fn, liger_why = try_import(*liger) if liger else (None, "")

    def make_inputs(device, requires_grad):
        y = torch.randn(n_rows, two_h, device=device, dtype=dtype, requires_grad=requires_grad)
        if liger_fn is None:
            return (y,)
        a = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        b = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        return y, a, b

    impls = [Impl("fusedlib", lambda y, *ab: fused(y, None)),
             compile_impl(reference, adapt=_first)]
    skipped = {}
    if liger_fn is not None:
        impls.append(Impl("liger", lambda y, a, b: liger_fn.apply(a, b)))
    else:
        skipped["liger"] = liger_why
    if baselines:
        impls.insert(1, Impl("eager", _first(reference)))
        if megatron:
            mcore, why = try_import(*megatron)
            if mcore is not None:
                impls.append(Impl("megatron-core", lambda y, *ab: mcore(y, None)))
            else:
                skipped["megatron-core"] = why
    return BenchCase(op, shape, dtype, make_inputs, glu_bytes(n_rows, h, torch.finfo(dtype).bits // 8),
                     impls, skipped)


def _first(fn: Callable) -> Callable:
    """``fn`` applied to the first input only (y), ignoring Liger's a, b."""
    return lambda y, *rest: fn(y)


def glu_cases(op: str, fused: Callable, reference: Callable, megatron: tuple[str, str] | None,
              liger: tuple[str, str] | None, sweep: bool, dtype: torch.dtype) -> list[BenchCase]:
    """The headline case at DEFAULT_SHAPE with every baseline; with ``sweep``, h in SWEEP_H at
    2^28 input elements against torch.compile (compiled statically for each shape) and Liger."""
    out = [glu_case(op, DEFAULT_SHAPE, dtype, fused, reference, megatron, liger, baselines=True)]
    if sweep:
        n = DEFAULT_SHAPE[0] * DEFAULT_SHAPE[1]
        out += [glu_case(op, (n // (2 * h), 2 * h), dtype, fused, reference, None, liger, baselines=False)
                for h in SWEEP_H if 2 * h != DEFAULT_SHAPE[1]]
    return out
