"""Triton kernels for bias + dropout + residual add, forward and backward.

Forward, one read of x and residual and one write of out per element (bias read once
per column block), no mask written:

    v    = x + b
    m    = keep(seed, row, col)                 Bernoulli(1 - p), from Philox
    out  = residual + m·v·s                     s = 1 / (1 - p'), p' = P(drop) below

Backward, one read of g = d out, one write of dx per element, plus a per-program
partial sum of dx over rows for the bias gradient (two stages: deterministic, no
atomics). The mask is *regenerated* from the seed, not loaded:

    dx   = g·m·s          db = sum over rows of dx (float32)        d residual = g

The random bits: Philox-4x32-10 (Salmon et al., SC'11), the counter-based generator of
cuRAND, of torch's CUDA dropout and of ``tl.rand``. One Philox call maps a 128-bit
counter and a 64-bit key (the seed) to four 32-bit words: 128 random bits.
``tl.rand(seed, offsets)`` spends one call per element and keeps 32 of those bits
(torch.compile's dropout does this). Here one call serves eight neighbouring elements,
16 bits each, as FlashAttention's dropout serves sixteen with 8 bits each:

    element (row, col) <- Philox(counter = (col // 8, row, 0, 0), key = seed)
                          word (col % 8) // 2, its low half for even col, high half for odd
    kept  <=>  those 16 bits >= T = round(p·2^16)

So P(drop) = p' = T/2^16 exactly: within 2^-17 of p (7.6e-6), p = 0 keeps all and p = 1
drops all, exact for p = 0.5. Kept values are scaled by 1/(1 - p'), not 1/(1 - p), so that
E[out] = residual + x + b whatever the rounding (:func:`dropout_scale`). An eighth of ``tl.rand``'s integer work, which keeps the kernel memory-bound. The
mask depends on (seed, row, col) only, not on the tiling, the grid or the device: the
forward, the backward and :func:`dropout_mask` draw the same one, compiled or interpreted.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so gradcheck checks
the kernels), store out in the residual's dtype and dx in x's dtype; db in float32.

Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``; Triton's
``triton/language/random.py`` and its low-memory-dropout tutorial; Salmon, Moraes,
Dror & Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); Dao,
"FlashAttention-2" (2023) for the 8-bit-per-element dropout it uses.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ..runtime import (
    INTERPRET_ON_CPU, Planned, find_plan, launch, launch_planned, param_key, plan_cache, planned, remember_plan,
    spec_key, tensor_key,
)
from .launch import (
    FOLD_TILES, HUGE, TL_DTYPE, Tile, TileTable, acc_dtype, as_rows, cdiv, empty_contiguous_like,
    next_power_of_2, persistent_grid, pick,
)
from .reduce import finish_partials, partials_buffer

__all__ = [
    "KEEP_BITS",
    "ELEMENTS_PER_PHILOX",
    "FWD_TILES",
    "BWD_TILES",
    "COLUMN_SUM_TILES",
    "drop_threshold",
    "dropout_scale",
    "philox_seed",
    "dropout_key",
    "bias_dropout_add_fwd",
    "bias_dropout_add_bwd",
    "dropout_mask",
]

#: Random bits per element: the 128 bits of one Philox call serve 128 / 16 = 8 elements.
KEEP_BITS: int = 16
#: Elements decided by one Philox call.
ELEMENTS_PER_PHILOX: int = 128 // KEEP_BITS


def drop_threshold(p: float) -> int:
    """T = round(p·2^16): an element is dropped when its 16 random bits are < T.

    Args:
        p: dropout probability in [0, 1].

    Returns:
        An int in [0, 2^16]; P(drop) = T / 2^16, within 2^-17 of ``p``.

    Source: fusedlib's own keep rule (see the module docstring), after FlashAttention-2's threshold
    on a few random bits per element (Dao, 2023).
    """
    return int(round(p * (1 << KEEP_BITS)))


def dropout_scale(p: float) -> float:
    """s = 1/(1 - p'), the factor kept elements are scaled by, where p' = T/2^16 is the drop
    probability the kernels actually apply (T = :func:`drop_threshold`): with it
    E[out] = residual + x + b exactly. (1/(1 - p) with the rounded p' would be biased by
    (1 - p')/(1 - p): 1.53x at p = 0.99999.) Equal to 1/(1 - p) for every p that is a
    multiple of 2^-16 (0, 0.5, 0.25...); within 2^-17/(1 - p) relative of it otherwise.
    0 when nothing is kept (T = 2^16: p = 1, or p > 1 - 2^-17). Passed to the kernels as a
    float32 scalar.

    Source: inverted dropout (Srivastava et al., JMLR 2014), with the drop probability p' the
    kernels apply.
    """
    t = drop_threshold(p)
    full = 1 << KEEP_BITS
    return 0.0 if t >= full else full / (full - t)


# Tile shapes of the forward (and of dropout_mask), as (upper bound of n_cols, Tile). Long
# rows: tiles of [4, 1024], 4 warps: 32 elements per thread, as four 16-byte vectors of bf16
# per tensor, and 4 Philox calls per thread. BLOCK_N is a multiple of 8 (one Philox call per
# 8 columns): at least 8, else the row's next power of two, capped as below. H200, [32768,
# 4096] bf16, kernel only (NOTES.md): forward 0.197 ms for [4, 1024] and 0.199 for [2, 2048].
FWD_TILES: TileTable = (
    # short rows: BLOCK_N = next power of two >= max(n_cols, 8), 64 rows
    (64, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4)),
    (512, Tile(BLOCK_M=8, BLOCK_N=512, num_warps=4)),  # BLOCK_N <= 512, 8 rows (4 Ki elements)
    (HUGE, Tile(BLOCK_M=4, BLOCK_N=1024, num_warps=4)),  # long rows: [4, 1024] tiles (4 Ki elements)
)

# The backward's tiles. Its grid is small (a persistent grid of a few programs per SM, each
# looping over rows and keeping one float32 partial of db), so each program needs many loads
# in flight: for short rows twice the forward's rows and warps; for rows of 65 to 512 columns
# 128-column tiles (measured faster); for long rows the forward's tile with the row loop
# pipelined (the next tiles' loads issued while one is computed), which replaced twice the
# forward's rows and warps ([8, 1024] at 8 warps: 0.163 ms kernel only at [32768, 4096] bf16
# on the H200, against 0.210 for [4, 2048] and 0.211 at 16 programs per SM; NOTES.md).
BWD_TILES: TileTable = (
    (64, Tile(BLOCK_M=128, BLOCK_N=64, num_warps=8, programs_per_sm=4)),
    # rows of 3·2^k (h = 384) fill 128-column tiles whole. [32768, 384] bf16 on the H200, with
    # dropout and dx stored (this table's calls; without them COLUMN_SUM_TILES below), CUDA-graph
    # replays, kernel and second stage: 0.0233 ms for [32, 128] at 4 warps against 0.0259 for
    # [64, 128] at 8 (the best of 10 settings: 4 or 8 programs per SM, 1-4 stages; NOTES.md)
    (512, Tile(BLOCK_M=32, BLOCK_N=128, num_warps=4, programs_per_sm=4)),
    # long rows: [4, 1024] at 4 warps with the row loop pipelined (3 stages), against [8, 1024]
    # at 8 warps and 1 stage: [8192, 2048] 0.0285 / 0.0309 ms, [32768, 4096] 0.1527 / 0.1520
    # (same run, as above; 2 or 4 stages and [4, 2048] tiles slower)
    (HUGE, Tile(BLOCK_M=4, BLOCK_N=1024, num_warps=4, num_stages=3, programs_per_sm=4)),
)

# The backward with nothing to store but the bias gradient (no dropout and g already in x's
# dtype: dx is g itself), the column sums of a linear layer's output gradient among them
# (fusedlib.parallel.layers): only loads and float32 adds, so narrow column blocks of many rows
# keep enough loads in flight at the widths measured (384 to 6144), where BWD_TILES's
# 1024-column tiles cover a row of 1152 with two, the second holding 128 columns (896 of the
# row's 2048 lanes masked).
# H200, bf16, CUDA-graph replays (ms; tools: a sweep of 16-128 rows, 64-512 columns, 4 or 8
# warps, 2-8 programs per SM), this tile against BWD_TILES's and torch's g.sum(0):
# [32768, 1152] 0.0327 / 0.0356 / 0.0504; [32768, 384] 0.0168 / 0.0194 / 0.0463;
# [8192, 6144] 0.0383 / 0.0418 / 0.0456; [8192, 768] 0.0129 / 0.0183 / 0.0202. The best or
# within 3 % of the best of the sweep at each of seven shapes (NOTES.md).
COLUMN_SUM_TILES: TileTable = (
    (HUGE, Tile(BLOCK_M=128, BLOCK_N=64, num_warps=8, programs_per_sm=4)),
)

#: Elements per program in Triton's CPU interpreter, which runs programs one at a time at
#: a fixed cost per operation: few large programs are far faster there (measured: 16x
#: from 2 to 64 rows of 2 Ki). The mask does not depend on the tile.
_INTERPRETER_TILE_ELEMENTS: int = 1 << 18


def _tile(table: TileTable, tile: Tile | None, n_rows: int, n_cols: int) -> tuple[Tile, int]:
    """(tile, BLOCK_M) for rows of ``n_cols``: ``tile`` as given, else the table's pick with
    BLOCK_N >= 8 and, in Triton's interpreter, BLOCK_M enlarged up to ``n_rows`` (the mask is
    the same for every tiling)."""
    if tile is not None:
        return tile, tile.BLOCK_M
    tile = pick(table, n_cols)
    if tile.BLOCK_N < ELEMENTS_PER_PHILOX:  # rows of fewer than 8 columns: one Philox call per row
        tile = replace(tile, BLOCK_N=ELEMENTS_PER_PHILOX)
    block_m = tile.BLOCK_M
    if INTERPRET_ON_CPU:
        block_m = max(block_m, min(_INTERPRETER_TILE_ELEMENTS // tile.BLOCK_N, next_power_of_2(n_rows)))
    return tile, block_m


def philox_seed(device: torch.device) -> torch.Tensor:
    """Draw a Philox key from torch's generator of ``device``: a one-element int64 tensor.

    Drawn on the device itself (no host sync, CUDA-graph capturable), so
    ``torch.manual_seed`` reproduces it and a forked generator state (Megatron's
    ``get_cuda_rng_tracker().fork()``) is respected, as for ``torch.nn.functional.dropout``.

    Args:
        device: where the kernels run.

    Returns:
        int64 tensor of shape [1] on ``device``, in [0, 2^62).

    Source: fusedlib's own; the key of Philox-4x32-10 (Salmon et al., SC 2011), drawn from torch's
    generator.
    """
    return torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=device)


def dropout_key(device: torch.device, p: float) -> torch.Tensor:
    """The Philox key of a dropout of probability ``p`` (> 0) on ``device``: :func:`philox_seed`,
    except where every element is dropped (p' = round(p·2^16)/2^16 = 1, i.e. p >= 1 - 2^-17),
    whose mask does not depend on the random bits: then a zero key, and no random numbers are
    drawn, as torch's dropout draws none for p = 1.

    Returns:
        int64 tensor of shape [1] on ``device``.

    Source: fusedlib's own (see :func:`philox_seed`).
    """
    if drop_threshold(p) >= 1 << KEEP_BITS:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return philox_seed(device)


@triton.jit
def _philox_words(seed, rows, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The four Philox-4x32-10 words, each uint32 [BLOCK_M, BLOCK_N/8], of the calls for
    columns pid_n·BLOCK_N + [0, BLOCK_N) of ``rows``: call (row, g) has counter (g, row, 0, 0),
    g = column // 8, and key ``seed``."""
    g = tl.arange(0, BLOCK_N // 8)  # call index in the tile: column // 8
    c0 = (pid_n * (BLOCK_N // 8) + g)[None, :] + tl.zeros_like(rows)[:, None].to(tl.int32)  # [BM, BN/8]
    c1 = rows.to(tl.int32)[:, None] + tl.zeros_like(g)[None, :]  # [BM, BN/8]: the row
    zero = tl.zeros_like(c0)
    return tl.philox(seed, c0, c1, zero, zero)


@triton.jit
def _keep_mask(seed, rows, pid_n, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask [BLOCK_M, BLOCK_N] of columns pid_n·BLOCK_N + [0, BLOCK_N) of ``rows``:
    one Philox call per 8 columns, 16 bits per element, kept where the bits are >= T.
    Column 8·g + j takes the low (j even) or high (j odd) half of word j // 2 of call g."""
    w0, w1, w2, w3 = _philox_words(seed, rows, pid_n, BLOCK_M, BLOCK_N)
    j = tl.arange(0, 8)[None, None, :]  # column % 8
    w = tl.where(j < 2, w0[:, :, None], tl.where(j < 4, w1[:, :, None], tl.where(j < 6, w2[:, :, None], w3[:, :, None])))
    bits16 = tl.where(j % 2 == 0, w & 0xFFFF, w >> 16)  # [BM, BN/8, 8]: low half for even columns
    # Compared as int32 (values 0..2^16, exact in both types), with T as given: no method is
    # called on T, which torch.compile's Inductor may pass as a plain Python int.
    keep = bits16.to(tl.int32) >= T
    return tl.reshape(keep, [BLOCK_M, BLOCK_N])  # [BM, BN/8, 8] -> [BM, BN]: column = 8·g + j


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
    T,  # drop threshold round(p·2^16)
    scale,  # 1/(1 - p') with p' = T/2^16 (dropout_scale), float32
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,  # training with p > 0; else no random numbers at all
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program, a multiple of 8
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: n_rows·stride may pass 2^31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    # 1. Issue the loads first: Philox's integer arithmetic below runs while they are in flight.
    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride, mask=mask, other=0.0)
    res = tl.load(R_ptr + rows[:, None] * R_row_stride + cols[None, :] * R_col_stride, mask=mask, other=0.0)
    v = x.to(ACC)
    if HAS_BIAS:
        v += tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    # 2. Dropout: the keep mask from Philox, in registers; kept values scaled by 1/(1-p). A dropped
    #    v is multiplied by 0, as torch's v·mask: 0 for a finite v, NaN for a NaN or inf one. Forms
    #    equal in arithmetic compile differently (here a select of v·scale or v - v timed slower
    #    than a select of 0; this one did not).
    if DROPOUT:
        keep = _keep_mask(tl.load(SEED_ptr), rows, pid_n, T, BLOCK_M, BLOCK_N)
        v = tl.where(keep, v, v * 0.0) * scale
    # 3. The residual add, stored in the residual's dtype.
    out = res.to(ACC) + v
    tl.store(OUT_ptr + rows[:, None] * OUT_row_stride + cols[None, :] * OUT_col_stride,
             out.to(OUT_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _bias_dropout_add_bwd_kernel(
    G_ptr,  # grad of out g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous, x's dtype (unused without STORE_DX)
    DB_PARTIAL_ptr,  # ACC [n_row_programs, n_cols]: this program's sum of dx over its rows (one program: db itself)
    SEED_ptr,  # int64 [1]: the forward's Philox key (unused without DROPOUT)
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    G_row_stride,
    G_col_stride,
    T,  # drop threshold, as in the forward
    scale,  # 1/(1 - p'), float32, as in the forward
    DROPOUT: tl.constexpr,
    STORE_DX: tl.constexpr,  # write dx (off when dx is g itself and only db is wanted)
    HAS_DBIAS: tl.constexpr,  # write the bias-gradient partials
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the row loop's software pipelining: the next tiles' loads in flight
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)  # summed over rows once, after the loop
    if DROPOUT:
        seed = tl.load(SEED_ptr)
    row_start = pid_m.to(tl.int64) * rows_per_program
    for m in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride, mask=mask, other=0.0)
        dx = g.to(ACC)
        if DROPOUT:
            keep = _keep_mask(seed, rows, pid_n, T, BLOCK_M, BLOCK_N)  # the forward's mask, regenerated
            # dropped: dx - dx, 0 for a finite dx and NaN for a NaN or inf one (torch: dx·mask); here
            # it timed like a select of 0, as did the forward's form (v·where(keep, scale, 0) did not)
            dx = tl.where(keep, dx * scale, dx - dx).to(ACC)  # ACC even where scale comes as a float64 constant (Inductor)
        if STORE_DX:
            tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)
        if HAS_DBIAS:
            db_acc += dx  # masked lanes hold g = 0: they add nothing
    if HAS_DBIAS:
        db = tl.sum(db_acc, axis=0)  # [BLOCK_N]: this program's rows, in a fixed order
        tl.store(DB_PARTIAL_ptr + pid_m.to(tl.int64) * n_cols + cols, db, mask=col_mask)


@triton.jit(do_not_specialize=["T"])
def _dropout_mask_kernel(
    SEED_ptr,  # int64 [1]: the Philox key
    MASK_ptr,  # int8 [n_rows, n_cols], contiguous: 1 where kept
    n_rows,
    n_cols,
    T,  # drop threshold round(p·2^16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _keep_mask(tl.load(SEED_ptr), rows, pid_n, T, BLOCK_M, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(MASK_ptr + rows[:, None] * n_cols + cols[None, :], keep.to(tl.int8), mask=mask)


# Launch plans by input signature (fusedlib.runtime.LaunchPlan): the tile, grid and bound launch
# of a call are made once per shape, strides, dtypes, addresses modulo 16 and dropout probability.
_FWD_PLANS: dict = plan_cache()
_BWD_PLANS: dict = plan_cache()


def bias_dropout_add_fwd(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                         seed: torch.Tensor | None, p: float, out: torch.Tensor | None = None,
                         tile: Tile | None = None) -> torch.Tensor:
    """Launch the forward kernel: ``out = residual + dropout(x + bias, p)``.

    Args:
        x: [..., n_cols] ([n_rows, n_cols] in the kernel), a float dtype, any strides.
        bias: [n_cols] contiguous, or None.
        residual: x's shape, any float dtype, any strides.
        seed: int64 [1] Philox key (:func:`philox_seed`), or None for no dropout.
        p: dropout probability in [0, 1] (ignored when ``seed`` is None).
        out: where to write, the residual's dtype: [n_rows, n_cols] with any strides (it may
            be ``x`` itself, for the in-place inference path), or None for a new contiguous
            tensor of x's shape.
        tile: launch settings (None: ``pick(FWD_TILES, n_cols)``, BLOCK_N >= 8, BLOCK_M
            enlarged in Triton's interpreter).

    Returns:
        ``out``: the residual's dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``
    (``_bias_dropout_add_func``); the mask from Philox-4x32-10 (Salmon et al., SC 2011).
    """
    device = x.device
    fresh = out is None
    if fresh:
        out = empty_contiguous_like(residual)  # x's shape, the residual's dtype; written as [n_rows, n_cols]
    if out.numel() == 0:
        return out
    x2d, r2d = as_rows(x), as_rows(residual)  # [..., n_cols] -> [n_rows, n_cols]
    n_rows, n_cols = x2d.shape
    out_strides = (n_cols, 1) if fresh else out.stride()
    dropout = seed is not None
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(x2d), device, spec_key(bias), tensor_key(r2d), None if fresh else (out_strides, spec_key(out)),
        (spec_key(seed), p) if dropout else None, tile)
    pl = _FWD_PLANS.get(key) if key is not None else None
    if pl is None:
        pl = remember_plan(_FWD_PLANS, key, _fwd_plan(x2d, bias is not None, residual.dtype, dropout, p, tile))
    launch_planned(_bias_dropout_add_fwd_kernel, pl, device,
                   x2d, bias if bias is not None else x2d, r2d, out, seed if dropout else x2d,
                   n_rows, n_cols, *x2d.stride(), *r2d.stride(), *out_strides, *pl.data)
    return out


def _fwd_plan(x2d: torch.Tensor, has_bias: bool, residual_dtype: torch.dtype, dropout: bool, p: float,
              tile: Tile | None) -> Planned:
    """The forward's launch for inputs like ``x2d`` (data: the dropout mask's threshold and scale,
    or (0, 1.0))."""
    n_rows, n_cols = x2d.shape
    tile, block_m = _tile(FWD_TILES, tile, n_rows, n_cols)
    return planned(
        _bias_dropout_add_fwd_kernel, (cdiv(n_rows, block_m), cdiv(n_cols, tile.BLOCK_N)), x2d.device,
        dict(HAS_BIAS=has_bias, DROPOUT=dropout, BLOCK_M=block_m, BLOCK_N=tile.BLOCK_N,
             ACC=TL_DTYPE[acc_dtype(x2d.dtype, residual_dtype)], num_warps=tile.num_warps),
        data=(drop_threshold(p), dropout_scale(p)) if dropout else (0, 1.0))


def _checked_key(x, bias, residual, prob, training, check) -> tuple | None:
    """:func:`_bias_dropout_add_fwd_checked`'s plan key (for :func:`~fusedlib.runtime.find_plan`),
    or None for a prob that is not a Python float (only a float's value is fixed: another Real
    may change under the same identity; the check runs every call for it)."""
    if type(prob) is not float:
        return None
    return param_key(x), param_key(bias), param_key(residual), prob, training, check


def _bias_dropout_add_fwd_checked(x: Any, bias: Any, residual: Any, prob: Any, training: bool,
                                 check: Callable) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                           float]:
    """:func:`bias_dropout_add_fwd` into a new tensor, with the op's argument check and the seed:
    ``(out, seed, bias, p)``: seed the Philox key drawn (:func:`philox_seed`, after the check;
    None when ``training`` is False, p is 0 or the input is empty; a zero key, drawing nothing,
    when everything is dropped: :func:`dropout_key`), bias as the kernel read it (contiguous),
    p the probability as a float.

    ``check((x, bias), residual, prob) -> (x, bias, residual, p)`` raises for bad input. It runs
    only when no plan matches the call's signature (each tensor's class, shape, strides, dtype,
    device and address modulo 16; prob, a Python float; training, a bool; the check itself), and a plan is
    remembered only for a signature that passed it, so a call whose signature matches skips it.
    A strided bias (copied here) is keyed by its copy's signature, and every such call checks
    again.

    Raises:
        What ``check`` raises.
    """
    key, pl = find_plan(_FWD_PLANS, _checked_key, x, bias, residual, prob, training, check)
    if pl is None:
        x, bias, residual, p = check((x, bias), residual, prob)
        b = bias.contiguous() if bias is not None else None  # [h]: a copy only for a strided bias
        if b is not bias:
            key, pl = find_plan(_FWD_PLANS, _checked_key, x, b, residual, prob, training, check)
    else:
        b, p = bias, float(prob)
    out = empty_contiguous_like(residual)  # x's shape, the residual's dtype; written as [n_rows, n_cols]
    if out.numel() == 0:  # nothing to drop: no seed drawn, as torch's dropout draws none for an empty input
        return out, None, b, p
    dropout = training and p > 0.0
    seed = dropout_key(x.device, p) if dropout else None  # (none drawn when everything is dropped)
    x2d, r2d = as_rows(x), as_rows(residual)  # [..., n_cols] -> [n_rows, n_cols]
    n_rows, n_cols = x2d.shape
    if pl is None:
        pl = remember_plan(_FWD_PLANS, key, _fwd_plan(x2d, b is not None, residual.dtype, dropout, p, None))
    launch_planned(_bias_dropout_add_fwd_kernel, pl, x.device,
                   x2d, b if b is not None else x2d, r2d, out, seed if dropout else x2d,
                   n_rows, n_cols, *x2d.stride(), *r2d.stride(), n_cols, 1, *pl.data)
    return out, seed, b, p


def bias_dropout_add_bwd(g: torch.Tensor, x_dtype: torch.dtype, seed: torch.Tensor | None, p: float,
                         need_dx: bool = True, need_dbias: bool = False, tile: Tile | None = None,
                         db_dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: ``dx = g·mask/(1 - p')`` (p' = T/2^16) and, if asked, its float32 sum over rows.

    Args:
        g: grad of out, [..., n_cols] ([n_rows, n_cols] in the kernel), the residual's
            dtype, any strides.
        x_dtype: dtype of dx.
        seed: the forward's Philox key, or None if the forward dropped nothing.
        p: the forward's dropout probability.
        need_dx, need_dbias: which gradients to compute.
        tile: launch settings (None: ``pick(BWD_TILES, n_cols)``, as in the forward, or
            ``pick(COLUMN_SUM_TILES, n_cols)`` when dx is not stored: need_dx False, or
            nothing dropped and g already in x_dtype, so that dx is g); its
            ``programs_per_sm`` sizes the persistent grid.
        db_dtype: the dtype of db (the bias's: rounded once from the float32 sum, with no
            separate cast); None: the accumulation dtype (float32, float64 for float64).

    Returns:
        ``(dx, db)``: dx of g's shape and ``x_dtype`` (``g`` itself when nothing was dropped
        and dtypes match), or None; db [n_cols] of ``db_dtype``, summed in float32 (float64
        for float64 inputs) in two deterministic stages (one for small inputs), or None.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``_bias_dropout_add_func``,
    differentiated); the mask regenerated from the seed, as FlashAttention-2 (Dao, 2023) does.
    """
    dropout = seed is not None
    dx = db = None
    store_dx = need_dx and (dropout or g.dtype != x_dtype)
    if need_dx and not store_dx:
        dx = g  # nothing dropped, same dtype: dx is g, no kernel needed for it
    acc = acc_dtype(x_dtype, g.dtype)
    db_dtype = acc if db_dtype is None else db_dtype
    device = g.device
    if store_dx:
        dx = empty_contiguous_like(g, x_dtype)  # written as [n_rows, n_cols]
    if g.numel() == 0:
        return dx, (torch.zeros(g.shape[-1], dtype=db_dtype, device=device) if need_dbias else None)
    if not (store_dx or need_dbias):
        return dx, None
    g2d = as_rows(g)  # [..., n_cols] -> [n_rows, n_cols]
    n_rows, n_cols = g2d.shape
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(g2d), device, x_dtype, (spec_key(seed), p) if dropout else None, need_dx, need_dbias, db_dtype,
        tile)
    pl = _BWD_PLANS.get(key) if key is not None else None
    if pl is None:
        tile, block_m = _tile(BWD_TILES if store_dx else COLUMN_SUM_TILES, tile, n_rows, n_cols)
        col_programs = cdiv(n_cols, tile.BLOCK_N)
        # Enough row programs to fill the device; each loops over its rows and keeps one float32
        # partial of the bias gradient per column: [row_programs, n_cols] floats.
        row_programs, rows_per_program = persistent_grid(n_rows, block_m, tile.programs_per_sm, device, col_programs,
                                                         fold_tiles=FOLD_TILES if need_dbias else 0)
        pl = remember_plan(_BWD_PLANS, key, planned(
            _bias_dropout_add_bwd_kernel, (row_programs, col_programs), device,
            dict(DROPOUT=dropout, STORE_DX=store_dx, HAS_DBIAS=need_dbias, BLOCK_M=block_m, BLOCK_N=tile.BLOCK_N,
                 ACC=TL_DTYPE[acc], NUM_STAGES=tile.num_stages, num_warps=tile.num_warps),
            data=(rows_per_program, *((drop_threshold(p), dropout_scale(p)) if dropout else (0, 1.0)))))
    # one row program: the kernel stores db itself (db_dtype)
    db_partial = partials_buffer(pl.grid[0], n_cols, acc, db_dtype, device) if need_dbias else g2d
    launch_planned(_bias_dropout_add_bwd_kernel, pl, device,
                   g2d, dx if store_dx else g2d, db_partial, seed if dropout else g2d,
                   n_rows, n_cols, pl.data[0], *g2d.stride(), *pl.data[1:])
    if need_dbias:
        db = finish_partials(db_partial, db_dtype)  # stage 2: [row_programs, n_cols] -> [n_cols], fixed order
    return dx, db


def dropout_mask(seed: torch.Tensor, n_rows: int, n_cols: int, p: float, tile: Tile | None = None) -> torch.Tensor:
    """The keep mask the kernels draw for ``seed`` on an [n_rows, n_cols] input: for tests
    and the book (the fused op itself never writes it).

    Args:
        seed: int64 [1] Philox key on the device to run on.
        n_rows, n_cols: the 2-D shape of the op's input ([..., h] -> [prod(...), h]).
        p: dropout probability in [0, 1].
        tile: launch settings (None: the forward's); the mask does not depend on them.

    Returns:
        bool [n_rows, n_cols] on ``seed``'s device: True where the element is kept.

    Source: fusedlib's own (the kernels' Philox-4x32-10 draw, Salmon et al., SC 2011).
    """
    mask = torch.empty((n_rows, n_cols), dtype=torch.int8, device=seed.device)
    if mask.numel() == 0:
        return mask.bool()
    tile, block_m = _tile(FWD_TILES, tile, n_rows, n_cols)
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, tile.BLOCK_N))
    launch(_dropout_mask_kernel, grid, seed.device, seed, mask, n_rows, n_cols, drop_threshold(p),
           BLOCK_M=block_m, BLOCK_N=tile.BLOCK_N, num_warps=tile.num_warps)
    return mask.bool()
