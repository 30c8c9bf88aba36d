"""Triton kernels for the gated linear units GEGLU and SwiGLU (optionally biased or row-weighted).

The input y = [y1 | y2] is the output of one linear layer of width 2h; the unit gates one
half by an activation of the other (``y1, y2 = torch.chunk(y, 2, -1)``):

    x1, x2 = y1 + b1, y2 + b2                         (bias optional)
    out    = act(x1) · x2 · w                          (w: one weight per row, optional)

    act = silu:       silu(x)  = x·σ(x)                                     (SwiGLU)
    act = gelu_tanh:  gelu(x)  = 0.5·x·(1 + tanh(c0·x·(1 + c1·x²)))         (GEGLU)

Clamped (``HAS_CLAMP``, Megatron-core's ``clamp_value`` c > 0), after the bias:

    x1 <- min(x1, c),   x2 <- min(max(x2, -c), c)          (NaN stays NaN, as torch.clamp)

Backward (derived with sympy in chapter 3), with g the gradient of out:

    dx1 = g·w·x2·act'(x1)        silu'(x) = σ(x)·(1 + x·(1 - σ(x)))
    dx2 = g·w·act(x1)            gelu'(x) = 0.5·x·(1 - t²)·(c0 + c2·x²) + 0.5·(1 + t)
    db  = sum over rows of [dx1 | dx2]                                  (float32, two stages)
    dw  = sum over the h columns of act(x1)·x2·g                        (float32, two stages)

with x1, x2 the clamped values when clamped; then dx1 = 0 where x1 > c and dx2 = 0 where
|x2| > c (the clamp's derivative; at |x| = c exactly the gradient passes, as torch.clamp's
autograd and Megatron's masks ``y_1 <= c``, ``-c <= y_2 <= c`` have it).

Two backward kernels: ``_glu_bwd_kernel`` (no bias: elementwise, one tile per program, with
the optional row weights) and ``_bias_glu_bwd_kernel`` (programs walk many rows to sum the
bias gradient in registers; Megatron has no weighted GLU with a bias).

Memory traffic (the minimum, and what these kernels move): forward reads y (2h per row)
and writes out (h per row); backward reads g (h) and y (2h) and writes dy (2h). act(x1)
is recomputed in the backward from y instead of being stored, which costs arithmetic, not
bytes. The kernels address y through its two strides, y1 at columns [0, h) and y2 at
[h, 2h), so a non-contiguous y needs no copy.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so gradcheck checks the
kernels), store in y's dtype; bias and weight gradients accumulated in float32. The clamp
bound c is a float32 kernel argument (a Python float passed to Triton), as in Megatron's
float32 arithmetic; ``HAS_CLAMP=False`` compiles no clamp at all.

Sources: Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202; Megatron-LM
``megatron/core/fusions/fused_bias_swiglu.py`` and ``fused_bias_geglu.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import launch_planned, plan_cache, planned, remember_plan, spec_key, tensor_key
from .launch import (
    FOLD_TILES, HUGE, TL_DTYPE, Tile, TileTable, acc_dtype, as_rows, cdiv, empty_contiguous_like,
    persistent_grid, pick,
)
from .math import gelu_tanh_derivative, tanh
from .reduce import finish_partials, partials_buffer

__all__ = ["glu_fwd", "glu_bwd", "TILES", "BIAS_BWD_TILES"]

# Constants of the tanh approximation of GeLU (derived with sympy in chapters 1 and 3). Kernels
# may read module globals only as tl.constexpr: a plain float compiles in the interpreter alone.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # c0 = sqrt(2/pi)
GELU_COEF = tl.constexpr(0.044715)  # c1, the cubic coefficient fitted by Hendrycks & Gimpel
GELU_DERIV_COEF = tl.constexpr(0.10703222440890037)  # c2 = 3·c0·c1 = sqrt(2/pi) * 3 * 0.044715


@triton.jit
def _sigmoid(x):
    """σ(x) = 1/(1 + e^{-x}) with one division: e^{-|x|} <= 1 never overflows (interpreter-safe)."""
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def _act_fwd(x, ACTIVATION: tl.constexpr):
    """act(x) for ACTIVATION "silu" or "gelu_tanh"."""
    if ACTIVATION == "silu":
        a = x * _sigmoid(x)
    else:
        t = tanh(x * SQRT_2_OVER_PI * (1.0 + x * x * GELU_COEF))
        a = 0.5 * x * (1.0 + t)
    return a


@triton.jit
def _act_fwd_and_grad(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)), sharing σ(x) or tanh between the two."""
    if ACTIVATION == "silu":
        s = _sigmoid(x)
        a = x * s
        da = s * (1.0 + x * (1.0 - s))  # silu'(x) = σ(x)·(1 + x·(1 - σ(x)))
    else:
        x2 = x * x
        t = tanh(x * SQRT_2_OVER_PI * (1.0 + x2 * GELU_COEF))
        a = 0.5 * x * (1.0 + t)
        da = gelu_tanh_derivative(x, x2, t, SQRT_2_OVER_PI, GELU_DERIV_COEF)  # no NaN past |x| = 1.8e19
    return a, da


@triton.jit
def _clamp_halves(x1, x2, clamp_value):
    """Megatron's clamps: the gate x1 from above at c, the linear half x2 to [-c, c].

    Written with ``tl.where`` on ``>`` and ``<`` so that a NaN stays NaN, as torch.clamp.
    """
    x1 = tl.where(x1 > clamp_value, clamp_value, x1)
    x2 = tl.where(x2 > clamp_value, clamp_value, tl.where(x2 < -clamp_value, -clamp_value, x2))
    return x1, x2


@triton.jit
def _glu_fwd_kernel(
    Y_ptr,  # input y = [y1 | y2], [n_rows, 2·n_cols], strides (Y_row_stride, Y_col_stride)
    B_ptr,  # bias = [b1 | b2], [2·n_cols], contiguous (unused unless HAS_BIAS)
    W_ptr,  # row weights w, [n_rows, 1], stride W_row_stride (unused unless HAS_WEIGHTS)
    OUT_ptr,  # output, [n_rows, n_cols], contiguous, y's dtype
    n_rows,
    n_cols,  # h: the width of each half of y, and of the output
    Y_row_stride,
    Y_col_stride,
    W_row_stride,
    clamp_value,  # c of Megatron's clamp, float32 (unused unless HAS_CLAMP)
    ACTIVATION: tl.constexpr,  # "silu" (SwiGLU) or "gelu_tanh" (GEGLU)
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_CLAMP: tl.constexpr,  # clamp x1 <= c and -c <= x2 <= c (after the bias)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # output columns per program
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 offsets: n_rows·2h (and, transposed, col·col_stride) may pass 2^31
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    # -- load the tile from both halves, y1 = y[:, :h] and y2 = y[:, h:] (the only reads of y)
    y_rows = Y_ptr + rows[:, None] * Y_row_stride
    x1 = tl.load(y_rows + cols[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(y_rows + (n_cols + cols)[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC)
    if HAS_BIAS:
        x1 += tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        x2 += tl.load(B_ptr + n_cols + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    if HAS_CLAMP:
        x1, x2 = _clamp_halves(x1, x2, clamp_value)

    # -- gate: out = act(x1)·x2 (·w)
    out = _act_fwd(x1, ACTIVATION) * x2
    if HAS_WEIGHTS:
        w = tl.load(W_ptr + rows * W_row_stride, mask=row_mask, other=0.0).to(ACC)
        out = out * w[:, None]

    # -- one write of the output, rounded once to y's dtype
    tl.store(OUT_ptr + rows[:, None] * n_cols + cols[None, :], out.to(OUT_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_grads(x1, x2, g, ACTIVATION: tl.constexpr):
    """(act(x1), dx1, dx2) for one tile: dx1 = g·x2·act'(x1), dx2 = g·act(x1)."""
    a, da = _act_fwd_and_grad(x1, ACTIVATION)
    return a, g * x2 * da, g * a


@triton.jit
def _glu_bwd_kernel(
    G_ptr,  # grad of the output g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    Y_ptr,  # the forward input y = [y1 | y2], [n_rows, 2·n_cols], strides (Y_row_stride, Y_col_stride)
    W_ptr,  # row weights w, [n_rows, 1], stride W_row_stride (unused unless HAS_WEIGHTS)
    DY_ptr,  # grad of y = [dy1 | dy2], [n_rows, 2·n_cols], contiguous, y's dtype
    DW_PARTIAL_ptr,  # ACC [n_rows, n_col_programs]: each tile's sum of act(x1)·x2·g (HAS_WEIGHTS)
    n_rows,
    n_cols,
    G_row_stride,
    G_col_stride,
    Y_row_stride,
    Y_col_stride,
    W_row_stride,
    clamp_value,  # c of Megatron's clamp, float32 (unused unless HAS_CLAMP)
    ACTIVATION: tl.constexpr,  # "silu" (SwiGLU) or "gelu_tanh" (GEGLU)
    HAS_WEIGHTS: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,  # compute and accumulation dtype
):
    # Without a bias the backward is elementwise (plus a row sum for dw): one tile per program.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]

    # -- the backward's reads: g once, y once (act(x1) is recomputed, not loaded)
    y_rows = Y_ptr + rows[:, None] * Y_row_stride
    x1 = tl.load(y_rows + cols[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(y_rows + (n_cols + cols)[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC)
    g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride,
                mask=mask, other=0.0).to(ACC)  # masked lanes: g = 0, so they add nothing to dw
    if HAS_CLAMP:
        # where a clamp is active the output does not depend on that input: zero gradient
        keep1 = x1 <= clamp_value
        keep2 = (x2 >= -clamp_value) & (x2 <= clamp_value)
        x1, x2 = _clamp_halves(x1, x2, clamp_value)
    a, dy1, dy2 = _glu_grads(x1, x2, g, ACTIVATION)
    if HAS_WEIGHTS:
        # d out/d w = act(x1)·x2, so this tile's part of dw is Σ_cols act(x1)·x2·g = Σ dy2·x2;
        # then every input gradient carries the factor w.
        tl.store(DW_PARTIAL_ptr + rows * tl.num_programs(1) + pid_n, tl.sum(dy2 * x2, axis=1), mask=row_mask)
        w = tl.load(W_ptr + rows * W_row_stride, mask=row_mask, other=0.0).to(ACC)
        dy1 = dy1 * w[:, None]
        dy2 = dy2 * w[:, None]
    if HAS_CLAMP:
        dy1 = tl.where(keep1, dy1, 0.0)
        dy2 = tl.where(keep2, dy2, 0.0)

    # -- one write each into the two halves of dy
    dy1_ptrs = DY_ptr + rows[:, None] * (2 * n_cols) + cols[None, :]
    tl.store(dy1_ptrs, dy1.to(DY_ptr.dtype.element_ty), mask=mask)
    tl.store(dy1_ptrs + n_cols, dy2.to(DY_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_glu_bwd_kernel(
    G_ptr,  # grad of the output g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    Y_ptr,  # the forward input y = [y1 | y2], [n_rows, 2·n_cols], strides (Y_row_stride, Y_col_stride)
    B_ptr,  # bias = [b1 | b2], [2·n_cols], contiguous
    DY_ptr,  # grad of y = [dy1 | dy2], [n_rows, 2·n_cols], contiguous, y's dtype
    DB_PARTIAL_ptr,  # ACC [n_row_programs, 2·n_cols]: this program's sum of dy over its rows (one program: db, bias's dtype)
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    G_row_stride,
    G_col_stride,
    Y_row_stride,
    Y_col_stride,
    clamp_value,  # c of Megatron's clamp, float32 (unused unless HAS_CLAMP)
    ACTIVATION: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the row loop's software pipelining: the next tiles' loads in flight
):
    # With a bias, db = Σ_rows dy: each program walks rows_per_program rows of one column
    # block and keeps running sums in registers (stage 1 of a deterministic reduction).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    b1 = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)
    b2 = tl.load(B_ptr + n_cols + cols, mask=col_mask, other=0.0).to(ACC)
    # [BLOCK_M, BLOCK_N] running sums: adding tile by tile needs no communication between
    # threads; the one reduction over rows (through shared memory) happens after the loop.
    db1_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    db2_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    row_start = pid_m.to(tl.int64) * rows_per_program
    for m in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        y_rows = Y_ptr + rows[:, None] * Y_row_stride
        x1 = tl.load(y_rows + cols[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC) + b1[None, :]
        x2 = tl.load(y_rows + (n_cols + cols)[None, :] * Y_col_stride, mask=mask, other=0.0).to(ACC) + b2[None, :]
        g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride,
                    mask=mask, other=0.0).to(ACC)  # masked lanes: g = 0, so dy = 0 there
        if HAS_CLAMP:
            keep1 = x1 <= clamp_value
            keep2 = (x2 >= -clamp_value) & (x2 <= clamp_value)
            x1, x2 = _clamp_halves(x1, x2, clamp_value)
        a, dy1, dy2 = _glu_grads(x1, x2, g, ACTIVATION)
        if HAS_CLAMP:
            dy1 = tl.where(keep1, dy1, 0.0)
            dy2 = tl.where(keep2, dy2, 0.0)
        dy1_ptrs = DY_ptr + rows[:, None] * (2 * n_cols) + cols[None, :]
        tl.store(dy1_ptrs, dy1.to(DY_ptr.dtype.element_ty), mask=mask)
        tl.store(dy1_ptrs + n_cols, dy2.to(DY_ptr.dtype.element_ty), mask=mask)
        db1_acc += dy1
        db2_acc += dy2
    db_row = DB_PARTIAL_ptr + pid_m.to(tl.int64) * (2 * n_cols)
    tl.store(db_row + cols, tl.sum(db1_acc, axis=0), mask=col_mask)
    tl.store(db_row + n_cols + cols, tl.sum(db2_acc, axis=0), mask=col_mask)


# Tile shapes of the GLU kernels, as (upper bound of h, Tile), where h is the output width
# (half of y's); BLOCK_N is capped at h's next power of two. A tile of BLOCK_M x BLOCK_N
# outputs reads 2 tiles of y (3 tensors per tile in the forward, 5 in the backward). ~4 Ki
# outputs per program = 16 per thread at 8 warps: two 16-byte vectors per thread per bf16
# stream, enough bytes in flight per SM to saturate HBM, few enough registers for full
# occupancy. To tune on a GPU: python -m fusedlib.bench.tune --op swiglu (BLOCK_M·BLOCK_N
# between 2 Ki and 8 Ki, warps 4 or 8).
TILES: TileTable = (
    (16, Tile(BLOCK_M=256, BLOCK_N=16, num_warps=4)),  # tiny rows (h <= 16): many rows per program
    (128, Tile(BLOCK_M=32, BLOCK_N=128, num_warps=4)),  # h <= 128
    (1024, Tile(BLOCK_M=4, BLOCK_N=1024, num_warps=4)),  # h <= 1 Ki: 4 rows of up to 1 Ki
    (HUGE, Tile(BLOCK_M=2, BLOCK_N=2048, num_warps=8)),  # long rows: 2 Ki columns x 2 rows
)

# The backward with a bias: a persistent grid of 4 programs per SM, whose programs walk many
# rows and keep one float32 partial row of the bias gradient each (as bias-GeLU's backward,
# where 4 per SM beat 16); up to h = 1 Ki the forward's tiles. Longer rows: [4, 512]
# at 4 warps with the row loop pipelined (3 stages). SwiGLU, bf16, H200, CUDA-graph replays,
# kernel and bias-gradient second stage, against the forward's [2, 2048] x 8 warps at 1 stage:
# y [8192, 16384] 0.1853 / 0.2017 ms, [32768, 3072] 0.1439 / 0.1744, [32768, 8192] 0.3478 /
# 0.3855 (3859 GB/s); the best or within 1 % of the best of 12 settings at each.
BIAS_BWD_TILES: TileTable = tuple(
    (bound, Tile(tile.BLOCK_M, tile.BLOCK_N, tile.num_warps, programs_per_sm=4)) for bound, tile in TILES
    if bound <= 1024
) + ((HUGE, Tile(BLOCK_M=4, BLOCK_N=512, num_warps=4, num_stages=3, programs_per_sm=4)),)


def _out_shape(y: torch.Tensor) -> tuple[int, ...]:
    # [..., 2h] -> [..., h]
    shape = y.shape
    return (*shape[:-1], shape[-1] // 2)


def glu_fwd(y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None,
            activation: str, clamp_value: float | None = None, tile: Tile | None = None) -> torch.Tensor:
    """Launch the forward kernel: ``act(y1 + b1)·(y2 + b2)·w``.

    Args:
        y: [..., 2h] ([n_rows, 2h] in the kernel), float32/float16/bfloat16/float64, any strides.
        bias: [2h] of y's dtype, contiguous, or None.
        weights: [n_rows, 1] (any float dtype, any stride), or None.
        activation: "silu" or "gelu_tanh".
        clamp_value: c > 0 (checked by the caller): clamp x1 = y1 + b1 to (-inf, c] and
            x2 = y2 + b2 to [-c, c] first, as Megatron's clamped SwiGLU; None: no clamp.
        tile: launch settings (None: ``pick(TILES, h)``).

    Returns:
        A new contiguous [..., h] tensor of y's dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` and ``fused_bias_geglu.py``;
    Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202.
    """
    device = y.device
    out = torch.empty(_out_shape(y), dtype=y.dtype, device=device)  # written as [n_rows, h]
    if out.numel() == 0:
        return out
    y2d = as_rows(y)  # [..., 2h] -> [n_rows, 2h]
    n_rows, h = y2d.shape[0], y2d.shape[1] // 2
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(y2d), device, spec_key(bias), None if weights is None else (spec_key(weights), weights.stride(0)),
        activation, clamp_value is not None, tile)
    p = _FWD_PLANS.get(key) if key is not None else None
    if p is None:
        if tile is None:
            tile = pick(TILES, h)
        p = remember_plan(_FWD_PLANS, key, planned(
            _glu_fwd_kernel, (cdiv(n_rows, tile.BLOCK_M), cdiv(h, tile.BLOCK_N)), device,
            dict(ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_WEIGHTS=weights is not None,
                 HAS_CLAMP=clamp_value is not None, BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N,
                 ACC=TL_DTYPE[acc_dtype(y.dtype)], num_warps=tile.num_warps)))
    launch_planned(
        _glu_fwd_kernel, p, device,
        y2d, y2d if bias is None else bias, y2d if weights is None else weights, out,  # y2d: unused dummies
        n_rows, h, *y2d.stride(), 0 if weights is None else weights.stride(0),
        0.0 if clamp_value is None else float(clamp_value),
    )
    return out


def glu_bwd(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None,
            activation: str, clamp_value: float | None = None, tile: Tile | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch a backward kernel, then reduce the bias / weight partial sums.

    Args:
        g: grad of the output, [..., h], any strides.
        y: the forward input, [..., 2h], any strides.
        bias: [2h], contiguous, or None.
        weights: [n_rows, 1], or None (not both: Megatron has no weighted GLU with a bias).
        activation: "silu" or "gelu_tanh".
        clamp_value: the forward's c, or None. Clamped: the gradient is zero where x1 > c
            or |x2| > c, and computed at the clamped values elsewhere.
        tile: launch settings (None: ``pick(TILES, h)``, or with a bias ``pick(BIAS_BWD_TILES,
            h)``, whose ``programs_per_sm`` sizes the persistent grid).

    Returns:
        ``(dy, dbias, dweights)``: dy a new contiguous tensor of y's shape and dtype;
        dbias [2h] in bias's dtype (None without bias), summed over rows in float32;
        dweights [n_rows, 1] in weights' dtype (None without weights), summed over h in float32.

    Raises:
        NotImplementedError: for both a bias and weights.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu_back``) and
    ``fused_bias_geglu.py`` (``bias_geglu_back``).
    """
    if bias is not None and weights is not None:
        raise NotImplementedError("a GLU with both a bias and row weights has no backward kernel")
    device = y.device
    dy = empty_contiguous_like(y)  # written as [n_rows, 2h]
    if dy.numel() == 0:
        db = torch.zeros_like(bias) if bias is not None else None
        dw = torch.zeros_like(weights) if weights is not None else None
        return dy, db, dw
    g2d, y2d = as_rows(g), as_rows(y)  # [..., h] -> [n_rows, h]; [..., 2h] -> [n_rows, 2h]
    n_rows, h = y2d.shape[0], y2d.shape[1] // 2
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(y2d), device, tensor_key(g2d), spec_key(bias),
        None if weights is None else (spec_key(weights), weights.stride(0)), activation, clamp_value is not None,
        tile)
    p = _BWD_PLANS.get(key) if key is not None else None
    acc = acc_dtype(y.dtype)
    if p is None:
        if tile is None:
            tile = pick(TILES if bias is None else BIAS_BWD_TILES, h)
        col_programs = cdiv(h, tile.BLOCK_N)
        if bias is None:
            p = planned(_glu_bwd_kernel, (cdiv(n_rows, tile.BLOCK_M), col_programs), device,
                        dict(ACTIVATION=activation, HAS_WEIGHTS=weights is not None, HAS_CLAMP=clamp_value is not None,
                             BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc], num_warps=tile.num_warps))
        else:
            # Enough row programs to fill the device (the tile's programs_per_sm); each loops over its
            # rows and keeps one partial of the bias gradient per column: [row_programs, 2h] floats,
            # summed by a second small kernel (kernels/reduce.py).
            row_programs, rows_per_program = persistent_grid(n_rows, tile.BLOCK_M, tile.programs_per_sm, device,
                                                             col_programs, fold_tiles=FOLD_TILES)
            p = planned(_bias_glu_bwd_kernel, (row_programs, col_programs), device,
                        dict(ACTIVATION=activation, HAS_CLAMP=clamp_value is not None, BLOCK_M=tile.BLOCK_M,
                             BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc], NUM_STAGES=tile.num_stages,
                             num_warps=tile.num_warps),
                        data=(rows_per_program,))
        remember_plan(_BWD_PLANS, key, p)
    clamp = 0.0 if clamp_value is None else float(clamp_value)
    if bias is None:
        col_programs = p.grid[1]
        dw_partial = dy if weights is None else torch.empty((n_rows, col_programs), dtype=acc, device=device)
        launch_planned(
            _glu_bwd_kernel, p, device,
            g2d, y2d, y2d if weights is None else weights, dy, dw_partial,  # y2d, dy: unused dummies
            n_rows, h, *g2d.stride(), *y2d.stride(), 0 if weights is None else weights.stride(0), clamp,
        )
        if weights is None:
            return dy, None, None
        # [n_rows, col_programs] partials -> [n_rows, 1]: no reduction left for one column tile
        dw = dw_partial if col_programs == 1 else dw_partial.sum(1, keepdim=True)
        return dy, None, dw.to(weights.dtype)
    db_partial = partials_buffer(p.grid[0], 2 * h, acc, bias.dtype, device)  # one program: db itself
    launch_planned(
        _bias_glu_bwd_kernel, p, device,
        g2d, y2d, bias, dy, db_partial, n_rows, h, p.data[0], *g2d.stride(), *y2d.stride(), clamp,
    )
    return dy, finish_partials(db_partial, bias.dtype), None


# Launch plans by input signature (fusedlib.runtime.LaunchPlan): the tile, grid and bound launch
# of a call are made once per shape, strides, dtypes, addresses modulo 16 and switches.
_FWD_PLANS: dict = plan_cache()
_BWD_PLANS: dict = plan_cache()
