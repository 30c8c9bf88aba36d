"""Triton kernels for bias + dropout + residual add, forward and backward.

Forward, one read of x and residual and one write of out per element (bias read once
per column block), no mask written:

    v    = x + b
    m    = keep(seed, row, col)                 Bernoulli(1 - p), from Philox
    out  = residual + m·v·s                     s = 1 / (1 - p)

Backward, one read of g = d out, one write of dx per element, plus a per-program
partial sum of dx over rows for the bias gradient (two stages: deterministic, no
atomics). The mask is *regenerated* from the seed, not loaded:

    dx   = g·m·s          db = sum over rows of dx (float32)        d residual = g

The random bits: Philox-4x32-10 (Salmon et al., SC'11), the counter-based generator of
cuRAND, of torch's CUDA dropout and of ``tl.rand``. One Philox call maps a 128-bit
counter and a 64-bit key (the seed) to four 32-bit words. ``tl.rand(seed, offsets)``
keeps one word per element; here every call's four words are used, for four elements:
a tile of BLOCK_N = 4·QUARTER columns is split into four contiguous quarters, and
element (row, pid_n·BLOCK_N + k·QUARTER + q) takes word k of the call with counter
(c0, c1) = (pid_n·QUARTER + q, row). A quarter of the integer work of ``tl.rand``, and
each quarter is still a contiguous run of columns (vector loads).

Keep test, exact in integers: an element is kept when its word's top 24 bits are
>= T = round(p·2^24), so P(keep) = 1 - T/2^24 (|error in p| <= 2^-25), p = 0 keeps all
and p = 1 drops all. The mask is a function of (seed, row, column, QUARTER) only:
forward and backward use the same QUARTER (:func:`dropout_tile`) and agree, whatever
their BLOCK_M or grid; so does :func:`dropout_mask`, which materialises it for tests.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so gradcheck checks
the kernels), store out in the residual's dtype and dx in x's dtype; db in float32.

Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``; Triton's
``triton/language/random.py`` and its low-memory-dropout tutorial; Salmon, Moraes,
Dror & Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import kernel_mode, launch
from ..utils import num_programs_hint

__all__ = [
    "KEEP_BITS",
    "drop_threshold",
    "dropout_scale",
    "dropout_tile",
    "philox_seed",
    "bias_dropout_add_fwd",
    "bias_dropout_add_bwd",
    "dropout_mask",
]

#: Bits of each Philox word compared against the threshold: 24, so T = round(p·2^24)
#: fits an int32 for every p in [0, 1] (2^32 would not fit for p = 1).
KEEP_BITS: int = 24


def drop_threshold(p: float) -> int:
    """T = round(p·2^24): an element is dropped when its 24 random bits are < T.

    Args:
        p: dropout probability in [0, 1].

    Returns:
        An int in [0, 2^24]; P(drop) = T / 2^24, within 2^-25 of ``p``.
    """
    return int(round(p * (1 << KEEP_BITS)))


def dropout_scale(p: float) -> float:
    """s = 1/(1 - p), the factor kept elements are scaled by so that E[out] = residual + x + b
    (0 for p = 1, where nothing is kept). Passed to the kernels as a float32 scalar, as
    torch's own dropout computes it for float32, float16 and bfloat16."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


# Tile shapes, as (upper bound of n_cols, QUARTER, BLOCK_M, num_warps); BLOCK_N = 4·QUARTER.
# A quarter tile [BLOCK_M, QUARTER] holds 8 elements per thread at the widest tiles (a 16-byte
# vector of bf16 per load), the whole tile 4 quarters: 32 elements per thread, 4 Ki per program.
# QUARTER is part of the mask's definition (the Philox counter), so the table is device-
# independent: the CPU interpreter and the GPU draw the same mask for the same seed.
_DROPOUT_TILES: tuple[tuple[int, int, int, int], ...] = (
    (64, 16, 128, 4),  # short rows: BLOCK_N <= 64, many rows per program (<= 8 Ki elements)
    (512, 128, 16, 4),  # BLOCK_N <= 512, 16 rows
    (1 << 62, 512, 2, 4),  # long rows: BLOCK_N = 2048, 2 rows: quarters of [2, 512], 8 per thread
)


#: Elements per program in Triton's CPU interpreter, which runs programs one at a time at
#: a fixed cost per operation: few large programs are far faster there (measured: 16x
#: from 2 to 64 rows of 2 Ki). Only BLOCK_M grows, so the mask is the GPU's.
_INTERPRETER_TILE_ELEMENTS: int = 1 << 18


def dropout_tile(n_cols: int, device: torch.device | None = None, n_rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_M, QUARTER, num_warps) for rows of ``n_cols``; BLOCK_N = 4·QUARTER.

    Args:
        n_cols: row length (>= 1).
        device: where the kernel runs; in Triton's interpreter BLOCK_M is enlarged, up to
            ``n_rows`` (QUARTER, which defines the mask, never depends on the device).
        n_rows: number of rows (only used in the interpreter).

    Returns:
        Rows per tile, columns per quarter tile (powers of two), warps per program.
    """
    for bound, quarter, block_m, warps in _DROPOUT_TILES:
        if n_cols <= bound:
            quarter = min(quarter, triton.next_power_of_2(triton.cdiv(n_cols, 4)))
            if device is not None and kernel_mode(device) == "interpreted":
                block_m = max(block_m, min(_INTERPRETER_TILE_ELEMENTS // (4 * quarter), triton.next_power_of_2(n_rows)))
            return block_m, quarter, warps
    raise AssertionError("unreachable")


def philox_seed(device: torch.device) -> torch.Tensor:
    """Draw a Philox key from torch's generator of ``device``: a one-element int64 tensor.

    Drawn on the device itself (no host sync, CUDA-graph capturable), so
    ``torch.manual_seed`` reproduces it and a forked generator state (Megatron's
    ``get_cuda_rng_tracker().fork()``) is respected, as for ``torch.nn.functional.dropout``.

    Args:
        device: where the kernels run.

    Returns:
        int64 tensor of shape [1] on ``device``, in [0, 2^62).
    """
    return torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=device)


@triton.jit
def _keep_quarters(seed, rows, pid_n, T, QUARTER: tl.constexpr):
    """Keep masks of the four quarters of a [BLOCK_M, 4·QUARTER] tile, from one Philox call
    per (row, q): word k decides column pid_n·4·QUARTER + k·QUARTER + q of that row."""
    q = tl.arange(0, QUARTER)
    c0 = (pid_n * QUARTER + q)[None, :] + tl.zeros_like(rows)[:, None].to(tl.int32)  # [BM, Q]
    c1 = rows.to(tl.int32)[:, None] + tl.zeros_like(q)[None, :]  # [BM, Q]: the row
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)  # 4 x uint32 [BM, Q], Philox-4x32-10
    t = T.to(tl.uint32)
    return (w0 >> 8) >= t, (w1 >> 8) >= t, (w2 >> 8) >= t, (w3 >> 8) >= t  # top 24 bits vs T


@triton.jit
def _bda_fwd_quarter(x_rows, B_ptr, r_rows, out_rows, cols, row_mask, n_cols,
                     X_col_stride, R_col_stride, OUT_col_stride, keep, scale,
                     HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr):
    """out = residual + keep·(x + b)·scale on one quarter tile [BLOCK_M, QUARTER].

    ``x_rows``, ``r_rows``, ``out_rows`` are [BLOCK_M, 1] pointers to the tile's rows."""
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    c2 = cols[None, :]
    v = tl.load(x_rows + c2 * X_col_stride, mask=mask, other=0.0).to(ACC)
    if HAS_BIAS:
        v += tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    if DROPOUT:
        v = tl.where(keep, v * scale, 0.0)  # kept: scaled by 1/(1-p); dropped: exactly 0
    res = tl.load(r_rows + c2 * R_col_stride, mask=mask, other=0.0).to(ACC)
    tl.store(out_rows + c2 * OUT_col_stride, (res + v).to(out_rows.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _bias_dropout_add_fwd_kernel(
    X_ptr,  # x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    B_ptr,  # bias, [n_cols], contiguous (unused without HAS_BIAS)
    R_ptr,  # residual, [n_rows, n_cols], strides (R_row_stride, R_col_stride)
    OUT_ptr,  # out, [n_rows, n_cols], residual's dtype; may be X_ptr itself (in-place inference)
    SEED_ptr,  # int64 [1]: the Philox key (unused without DROPOUT)
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    R_row_stride,
    R_col_stride,
    OUT_row_stride,
    OUT_col_stride,
    T,  # drop threshold round(p·2^24)
    scale,  # 1/(1 - p), float32
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,  # training with p > 0; else no random numbers at all
    BLOCK_M: tl.constexpr,  # rows per program
    QUARTER: tl.constexpr,  # columns per quarter; a program covers 4·QUARTER columns
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: n_rows·stride may pass 2^31
    row_mask = rows < n_rows
    x_rows = X_ptr + rows[:, None] * X_row_stride  # [BLOCK_M, 1] row pointers
    r_rows = R_ptr + rows[:, None] * R_row_stride
    out_rows = OUT_ptr + rows[:, None] * OUT_row_stride
    c0 = pid_n * (4 * QUARTER) + tl.arange(0, QUARTER)  # columns of quarter 0
    if DROPOUT:
        k0, k1, k2, k3 = _keep_quarters(tl.load(SEED_ptr), rows, pid_n, T, QUARTER)
    else:
        k0 = None
        k1 = None
        k2 = None
        k3 = None
    _bda_fwd_quarter(x_rows, B_ptr, r_rows, out_rows, c0, row_mask, n_cols,
                     X_col_stride, R_col_stride, OUT_col_stride, k0, scale, HAS_BIAS, DROPOUT, ACC)
    _bda_fwd_quarter(x_rows, B_ptr, r_rows, out_rows, c0 + QUARTER, row_mask, n_cols,
                     X_col_stride, R_col_stride, OUT_col_stride, k1, scale, HAS_BIAS, DROPOUT, ACC)
    _bda_fwd_quarter(x_rows, B_ptr, r_rows, out_rows, c0 + 2 * QUARTER, row_mask, n_cols,
                     X_col_stride, R_col_stride, OUT_col_stride, k2, scale, HAS_BIAS, DROPOUT, ACC)
    _bda_fwd_quarter(x_rows, B_ptr, r_rows, out_rows, c0 + 3 * QUARTER, row_mask, n_cols,
                     X_col_stride, R_col_stride, OUT_col_stride, k3, scale, HAS_BIAS, DROPOUT, ACC)


@triton.jit
def _bda_bwd_quarter(G_ptr, DX_ptr, rows, cols, row_mask, n_cols, G_row_stride, G_col_stride, keep, scale,
                     DROPOUT: tl.constexpr, STORE_DX: tl.constexpr, ACC: tl.constexpr):
    """dx = g·keep·scale on one quarter tile; returns its column sums (for the bias gradient)."""
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride, mask=mask, other=0.0)
    dx = g.to(ACC)
    if DROPOUT:
        dx = tl.where(keep, dx * scale, 0.0)
    if STORE_DX:
        tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)
    return tl.sum(dx, axis=0)  # masked lanes hold g = 0: they add nothing


@triton.jit(do_not_specialize=["T"])
def _bias_dropout_add_bwd_kernel(
    G_ptr,  # grad of out g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous, x's dtype (unused without STORE_DX)
    DB_PARTIAL_ptr,  # ACC [n_row_programs, n_cols]: this program's sum of dx over its rows
    SEED_ptr,  # int64 [1]: the forward's Philox key (unused without DROPOUT)
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    G_row_stride,
    G_col_stride,
    T,  # drop threshold, as in the forward
    scale,  # 1/(1 - p), float32, as in the forward
    DROPOUT: tl.constexpr,
    STORE_DX: tl.constexpr,  # write dx (off when dx is g itself and only db is wanted)
    HAS_DBIAS: tl.constexpr,  # write the bias-gradient partials
    BLOCK_M: tl.constexpr,
    QUARTER: tl.constexpr,  # must equal the forward's: it defines the mask
    ACC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    col0 = pid_n * (4 * QUARTER) + tl.arange(0, QUARTER)
    db0 = tl.zeros((QUARTER,), dtype=ACC)
    db1 = tl.zeros((QUARTER,), dtype=ACC)
    db2 = tl.zeros((QUARTER,), dtype=ACC)
    db3 = tl.zeros((QUARTER,), dtype=ACC)
    if DROPOUT:
        seed = tl.load(SEED_ptr)
    row_start = pid_m.to(tl.int64) * rows_per_program
    for m in range(0, rows_per_program, BLOCK_M):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        if DROPOUT:
            k0, k1, k2, k3 = _keep_quarters(seed, rows, pid_n, T, QUARTER)  # the forward's mask, regenerated
        else:
            k0 = None
            k1 = None
            k2 = None
            k3 = None
        db0 += _bda_bwd_quarter(G_ptr, DX_ptr, rows, col0, row_mask, n_cols, G_row_stride, G_col_stride,
                                k0, scale, DROPOUT, STORE_DX, ACC)
        db1 += _bda_bwd_quarter(G_ptr, DX_ptr, rows, col0 + QUARTER, row_mask, n_cols, G_row_stride,
                                G_col_stride, k1, scale, DROPOUT, STORE_DX, ACC)
        db2 += _bda_bwd_quarter(G_ptr, DX_ptr, rows, col0 + 2 * QUARTER, row_mask, n_cols, G_row_stride,
                                G_col_stride, k2, scale, DROPOUT, STORE_DX, ACC)
        db3 += _bda_bwd_quarter(G_ptr, DX_ptr, rows, col0 + 3 * QUARTER, row_mask, n_cols, G_row_stride,
                                G_col_stride, k3, scale, DROPOUT, STORE_DX, ACC)
    if HAS_DBIAS:
        base = DB_PARTIAL_ptr + pid_m.to(tl.int64) * n_cols
        tl.store(base + col0, db0, mask=col0 < n_cols)
        tl.store(base + col0 + QUARTER, db1, mask=col0 + QUARTER < n_cols)
        tl.store(base + col0 + 2 * QUARTER, db2, mask=col0 + 2 * QUARTER < n_cols)
        tl.store(base + col0 + 3 * QUARTER, db3, mask=col0 + 3 * QUARTER < n_cols)


@triton.jit(do_not_specialize=["T"])
def _dropout_mask_kernel(
    SEED_ptr,  # int64 [1]: the Philox key
    MASK_ptr,  # int8 [n_rows, n_cols], contiguous: 1 where kept
    n_rows,
    n_cols,
    T,  # drop threshold round(p·2^24)
    BLOCK_M: tl.constexpr,
    QUARTER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    col0 = pid_n * (4 * QUARTER) + tl.arange(0, QUARTER)
    k0, k1, k2, k3 = _keep_quarters(tl.load(SEED_ptr), rows, pid_n, T, QUARTER)
    base = MASK_ptr + rows[:, None] * n_cols
    tl.store(base + col0[None, :], k0.to(tl.int8), mask=row_mask[:, None] & (col0 < n_cols)[None, :])
    c1 = col0 + QUARTER
    tl.store(base + c1[None, :], k1.to(tl.int8), mask=row_mask[:, None] & (c1 < n_cols)[None, :])
    c2 = col0 + 2 * QUARTER
    tl.store(base + c2[None, :], k2.to(tl.int8), mask=row_mask[:, None] & (c2 < n_cols)[None, :])
    c3 = col0 + 3 * QUARTER
    tl.store(base + c3[None, :], k3.to(tl.int8), mask=row_mask[:, None] & (c3 < n_cols)[None, :])


def _acc(*dtypes: torch.dtype):
    return tl.float64 if torch.float64 in dtypes else tl.float32


def bias_dropout_add_fwd(x2d: torch.Tensor, bias: torch.Tensor | None, r2d: torch.Tensor,
                         seed: torch.Tensor | None, p: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward kernel: ``out = r2d + dropout(x2d + bias, p)``.

    Args:
        x2d: [n_rows, n_cols], a float dtype, any strides.
        bias: [n_cols] contiguous, or None.
        r2d: the residual, [n_rows, n_cols], any float dtype, any strides.
        seed: int64 [1] Philox key (:func:`philox_seed`), or None for no dropout.
        p: dropout probability in [0, 1] (ignored when ``seed`` is None).
        out: where to write ([n_rows, n_cols], r2d's dtype; may be ``x2d`` itself for the
            in-place inference path), or None for a new contiguous tensor.

    Returns:
        ``out``: r2d's dtype.
    """
    n_rows, n_cols = x2d.shape
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=r2d.dtype, device=r2d.device)
    if out.numel() == 0:
        return out
    block_m, quarter, warps = dropout_tile(n_cols, x2d.device, n_rows)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, 4 * quarter))
    dropout = seed is not None
    launch(
        _bias_dropout_add_fwd_kernel, grid, x2d.device,
        x2d, bias if bias is not None else x2d, r2d, out, seed if dropout else x2d,
        n_rows, n_cols, x2d.stride(0), x2d.stride(1), r2d.stride(0), r2d.stride(1), out.stride(0), out.stride(1),
        drop_threshold(p) if dropout else 0, dropout_scale(p) if dropout else 1.0,
        HAS_BIAS=bias is not None, DROPOUT=dropout, BLOCK_M=block_m, QUARTER=quarter,
        ACC=_acc(x2d.dtype, r2d.dtype), num_warps=warps,
    )
    return out


def bias_dropout_add_bwd(g2d: torch.Tensor, x_dtype: torch.dtype, seed: torch.Tensor | None, p: float,
                         need_dx: bool = True, need_dbias: bool = False
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: ``dx = g·mask/(1 - p)`` and, if asked, its float32 sum over rows.

    Args:
        g2d: grad of out, [n_rows, n_cols], the residual's dtype, any strides.
        x_dtype: dtype of dx.
        seed: the forward's Philox key, or None if the forward dropped nothing.
        p: the forward's dropout probability.
        need_dx, need_dbias: which gradients to compute.

    Returns:
        ``(dx, db)``: dx [n_rows, n_cols] of ``x_dtype`` (``g2d`` itself when nothing was
        dropped and dtypes match), or None; db [n_cols] float32 (float64 for float64
        inputs), summed in two deterministic stages, or None.
    """
    n_rows, n_cols = g2d.shape
    dropout = seed is not None
    dx = db = None
    store_dx = need_dx and (dropout or g2d.dtype != x_dtype)
    if need_dx and not store_dx:
        dx = g2d  # nothing dropped, same dtype: dx is g, no kernel needed for it
    acc_torch = torch.float64 if torch.float64 in (x_dtype, g2d.dtype) else torch.float32
    if store_dx:
        dx = torch.empty((n_rows, n_cols), dtype=x_dtype, device=g2d.device)
    if g2d.numel() == 0:
        return dx, (torch.zeros(n_cols, dtype=acc_torch, device=g2d.device) if need_dbias else None)
    if not (store_dx or need_dbias):
        return dx, None
    block_m, quarter, warps = dropout_tile(n_cols, g2d.device, n_rows)
    col_programs = triton.cdiv(n_cols, 4 * quarter)
    # Enough row programs to fill the device; each loops over its rows and keeps one
    # float32 partial of the bias gradient per column: [row_programs, n_cols] floats.
    row_programs = max(1, min(triton.cdiv(n_rows, block_m), num_programs_hint(g2d.device) // col_programs))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, row_programs), block_m) * block_m
    row_programs = triton.cdiv(n_rows, rows_per_program)
    db_partial = torch.empty((row_programs, n_cols), dtype=acc_torch, device=g2d.device) if need_dbias else g2d
    launch(
        _bias_dropout_add_bwd_kernel, (row_programs, col_programs), g2d.device,
        g2d, dx if store_dx else g2d, db_partial, seed if dropout else g2d,
        n_rows, n_cols, rows_per_program, g2d.stride(0), g2d.stride(1),
        drop_threshold(p) if dropout else 0, dropout_scale(p) if dropout else 1.0,
        DROPOUT=dropout, STORE_DX=store_dx, HAS_DBIAS=need_dbias, BLOCK_M=block_m, QUARTER=quarter,
        ACC=_acc(x_dtype, g2d.dtype), num_warps=warps,
    )
    if need_dbias:
        db = db_partial.sum(0)  # stage 2: [row_programs, n_cols] -> [n_cols], fixed order
    return dx, db


def dropout_mask(seed: torch.Tensor, n_rows: int, n_cols: int, p: float) -> torch.Tensor:
    """The keep mask the kernels draw for ``seed`` on an [n_rows, n_cols] input: for tests
    and the book (the fused op itself never writes it).

    Args:
        seed: int64 [1] Philox key on the device to run on.
        n_rows, n_cols: the 2-D shape of the op's input ([..., h] -> [prod(...), h]).
        p: dropout probability in [0, 1].

    Returns:
        bool [n_rows, n_cols] on ``seed``'s device: True where the element is kept.
    """
    mask = torch.empty((n_rows, n_cols), dtype=torch.int8, device=seed.device)
    if mask.numel() == 0:
        return mask.bool()
    block_m, quarter, warps = dropout_tile(n_cols, seed.device, n_rows)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, 4 * quarter))
    launch(_dropout_mask_kernel, grid, seed.device, seed, mask, n_rows, n_cols, drop_threshold(p),
           BLOCK_M=block_m, QUARTER=quarter, num_warps=warps)
    return mask.bool()
