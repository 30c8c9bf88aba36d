"""Benchmark cases for a sublayer's bias-dropout-add followed by the next LayerNorm
(:func:`fusedlib.bias_dropout_add_norm`), in training mode at p = 0.1: the fused op against
fusedlib's two ops one after the other, eager PyTorch and ``torch.compile`` of it.

Both outputs feed the model (the norm's output the next sublayer, h the next residual), so
the "fwd+bwd" pass sends a gradient into each (``BenchCase.all_outputs``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import unfused
from ...fusions._apply import apply
from ...fusions.fused_bias_dropout import bias_dropout_add_fused_train
from ...fusions.fused_layer_norm import BiasDropoutAddNormFunction, FusedLayerNormAffineFunction
from ..core import BenchCase, Impl
from .baselines import compile_impl

DEFAULT_SHAPE = (32768, 4096)  # [s*b, h], bf16, as the bias-dropout-add and LayerNorm headlines
SWEEP_SHAPES = ((32768, 384), (32768, 1024), (16384, 8192))  # 384: the training chapter's model
PROB = 0.1  # Megatron's default hidden_dropout
EPS = 1e-5


def bias_dropout_add_norm_bytes(n_rows: int, h: int, elem: int) -> dict[str, int]:
    """Fewest bytes, no mask stored: fwd reads x and the residual (and the three [h] vectors)
    and writes y and h; bwd reads dy, dh and h, writes h's gradient (the residual's) and x's
    (dropped elements zeroed), and the three [h] gradients. 9 passes over [n_rows, h] in all
    (the two ops apart: 11, h written and read back, its gradient written and read back)."""
    n = n_rows * h
    fwd = (4 * n + 3 * h) * elem
    bwd = (5 * n + 3 * h) * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _fused(x, lb, r, w, b):
    return apply(BiasDropoutAddNormFunction, x, lb, r, w, b, EPS, PROB, True, False, False)


def _two_ops(x, lb, r, w, b):
    h = bias_dropout_add_fused_train((x, lb), r, PROB)
    return apply(FusedLayerNormAffineFunction, h, w, b, EPS, False, False, True)  # (y, h): norm_with_residual's


def _eager(x, lb, r, w, b):
    h = unfused.bias_dropout_add((x, lb), r, PROB, True)
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h


def _case(shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    n_rows, h = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        lb = (0.1 * torch.randn(h, device=device, dtype=torch.float32)).to(dtype).requires_grad_(requires_grad)
        r = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        w = (1 + 0.1 * torch.randn(h, device=device, dtype=torch.float32)).to(dtype).requires_grad_(requires_grad)
        b = (0.1 * torch.randn(h, device=device, dtype=torch.float32)).to(dtype).requires_grad_(requires_grad)
        return x, lb, r, w, b

    impls = [Impl("fusedlib", _fused), Impl("fusedlib-two-ops", _two_ops)]
    if baselines:
        impls.append(Impl("eager", _eager))
    impls.append(compile_impl(_eager))  # static: Inductor specializes on this shape
    elem = torch.finfo(dtype).bits // 8
    return BenchCase("bias_dropout_add_norm", shape, dtype, make_inputs, bias_dropout_add_norm_bytes(n_rows, h, elem),
                     impls, all_outputs=True)


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, h] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [32768, 4096] with every baseline; with ``sweep``, the shapes of
    :data:`SWEEP_SHAPES` against fusedlib's two ops and torch.compile (static per shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        out += [_case(s, dtype, baselines=False) for s in SWEEP_SHAPES]
    return out
