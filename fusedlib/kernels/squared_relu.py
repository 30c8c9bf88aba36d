"""Triton kernels for the row-weighted squared ReLU of MoE experts, forward and backward.

Forward, one read of x and one write of out per element, one weight per row:

    r   = relu(x)
    c   = r                          or, soft-clamped, c = s·tanh(r/s)   (s = clamp_scale)
    out = c²·w

Backward, one read of g and x and one write of dx per element:

    dx  = 2·c·g·w                    or, soft-clamped, dx = 2·c·(1 - tanh²(r/s))·g·w
    dw  = sum over the h columns of c²·g                           (float32, two stages)

(relu'(x) is taken as 0 at x = 0, as torch's relu does; the clamped ordering relu-then-tanh
equals tanh-then-relu, Megatron's note on ``_tanh_relu_over_scale``.)

Dtype policy: load, compute in float32 (float64 for float64 inputs), store in x's dtype;
the weight gradient is summed in float32 and cast to the weights' dtype. Megatron's
clamped forward rounds c to x's dtype before squaring (to match its unfused path bit for
bit); this kernel keeps c in float32, which is at least as accurate.

Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``; So et al.,
"Primer: Searching for Efficient Transformers" (squared ReLU), arXiv:2109.08668.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import launch
from .glu import TILES as GLU_TILES
from .launch import TL_DTYPE, Tile, TileTable, acc_dtype, as_rows, cdiv, empty_contiguous_like, pick
from .math import soft_clamp

__all__ = ["weighted_squared_relu_fwd", "weighted_squared_relu_bwd", "TILES"]

# Tile shapes, as (upper bound of n_cols, Tile): the GLU kernels' table (an elementwise
# kernel with one weight per row, as the weighted SwiGLU's), for both passes.
TILES: TileTable = GLU_TILES


@triton.jit
def _weighted_squared_relu_fwd_kernel(
    X_ptr,  # input x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    W_ptr,  # row weights w, [n_rows, 1], stride W_row_stride
    OUT_ptr,  # output, [n_rows, n_cols], contiguous, x's dtype
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    W_row_stride,
    clamp_scale,  # s of the soft clamp (unused unless CLAMP)
    CLAMP: tl.constexpr,  # soft-clamp relu(x) to s·tanh(relu(x)/s)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]

    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride, mask=mask, other=0.0).to(ACC)
    w = tl.load(W_ptr + rows * W_row_stride, mask=row_mask, other=0.0).to(ACC)
    c = tl.where(x < 0.0, 0.0, x)  # relu, NaN kept (tl.maximum(NaN, 0) is 0; torch.relu(NaN) is NaN)
    if CLAMP:
        c, _ = soft_clamp(c, clamp_scale)  # s·tanh(c/s), accurate for c/s near 0 too
    out = c * c * w[:, None]
    tl.store(OUT_ptr + rows[:, None] * n_cols + cols[None, :], out.to(OUT_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_squared_relu_bwd_kernel(
    G_ptr,  # grad of the output g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    X_ptr,  # the forward input x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    W_ptr,  # row weights w, [n_rows, 1], stride W_row_stride
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous, x's dtype
    DW_PARTIAL_ptr,  # ACC [n_rows, n_col_programs]: this tile's sum of c²·g over its columns
    n_rows,
    n_cols,
    G_row_stride,
    G_col_stride,
    X_row_stride,
    X_col_stride,
    W_row_stride,
    clamp_scale,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]

    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride, mask=mask, other=0.0).to(ACC)
    g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride, mask=mask, other=0.0).to(ACC)
    w = tl.load(W_ptr + rows * W_row_stride, mask=row_mask, other=0.0).to(ACC)
    c = tl.where(x < 0.0, 0.0, x)  # NaN kept, as the forward
    if CLAMP:
        c, t = soft_clamp(c, clamp_scale)
        dc = 2.0 * c * (1.0 - t * t)  # d(c²)/dx for x > 0; c = 0 (so dc = 0) for x <= 0
    else:
        dc = 2.0 * c
    tl.store(DW_PARTIAL_ptr + rows * tl.num_programs(1) + pid_n, tl.sum(c * c * g, axis=1), mask=row_mask)
    dx = dc * g * w[:, None]
    tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)


def weighted_squared_relu_fwd(x: torch.Tensor, weights: torch.Tensor, clamp_scale: float | None,
                              tile: Tile | None = None) -> torch.Tensor:
    """Launch the forward kernel: ``relu(x)²·w`` (or the soft-clamped form).

    Args:
        x: [..., h] ([n_rows, h] in the kernel), float32/float16/bfloat16/float64, any strides.
        weights: [n_rows, 1], any float dtype, any stride.
        clamp_scale: s > 0 of the soft clamp, or None.
        tile: launch settings (None: ``pick(TILES, h)``).

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``
    (``weighted_squared_relu``).
    """
    device = x.device
    out = empty_contiguous_like(x)  # written as [n_rows, h]
    if out.numel() == 0:
        return out
    x2d = as_rows(x)  # [..., h] -> [n_rows, h]
    n_rows, n_cols = x2d.shape
    if tile is None:
        tile = pick(TILES, n_cols)
    grid = (cdiv(n_rows, tile.BLOCK_M), cdiv(n_cols, tile.BLOCK_N))
    launch(
        _weighted_squared_relu_fwd_kernel, grid, device,
        x2d, weights, out, n_rows, n_cols, *x2d.stride(), weights.stride(0),
        float(clamp_scale) if clamp_scale is not None else 1.0,
        CLAMP=clamp_scale is not None, BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N,
        ACC=TL_DTYPE[acc_dtype(x.dtype)], num_warps=tile.num_warps,
    )
    return out


def weighted_squared_relu_bwd(g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                              clamp_scale: float | None, tile: Tile | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel, then sum the weight-gradient partials over column tiles.

    Args:
        g: grad of the output, x's shape, any strides.
        x: the forward input, [..., h], any strides.
        weights: [n_rows, 1].
        clamp_scale: as in the forward.
        tile: launch settings (None: ``pick(TILES, h)``).

    Returns:
        ``(dx, dweights)``: dx a new contiguous tensor of x's shape and dtype; dweights
        [n_rows, 1] in weights' dtype, summed over h in float32.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``
    (``weighted_squared_relu_back``).
    """
    device = x.device
    dx = empty_contiguous_like(x)  # written as [n_rows, h]
    if dx.numel() == 0:
        return dx, torch.zeros_like(weights)
    g2d, x2d = as_rows(g), as_rows(x)  # [..., h] -> [n_rows, h]
    n_rows, n_cols = x2d.shape
    if tile is None:
        tile = pick(TILES, n_cols)
    grid = (cdiv(n_rows, tile.BLOCK_M), cdiv(n_cols, tile.BLOCK_N))
    acc = acc_dtype(x.dtype)
    dw_partial = torch.empty((n_rows, grid[1]), dtype=acc, device=device)
    launch(
        _weighted_squared_relu_bwd_kernel, grid, device,
        g2d, x2d, weights, dx, dw_partial, n_rows, n_cols,
        *g2d.stride(), *x2d.stride(), weights.stride(0),
        float(clamp_scale) if clamp_scale is not None else 1.0,
        CLAMP=clamp_scale is not None, BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc],
        num_warps=tile.num_warps,
    )
    return dx, dw_partial.sum(1, keepdim=True).to(weights.dtype)
