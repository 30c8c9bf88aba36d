"""Triton kernels for the attention softmax family, forward and backward.

One forward and one backward kernel serve every variant Megatron-core has a CUDA kernel for
(scaled, scaled + bool mask, scaled + causal), plus a causal band with a sliding window and
the off-by-one softmax with a per-head sink logit. Compile-time flags pick the variant, so
each specialisation carries only the loads it needs.

Forward, for each row r of scores x (the row of query q in head h of batch b), with the
kept set K_r = {j : mask[b, h, q, j] is False, and j is inside the band of row q}:

    s_j = scale·x_j                  for j in K_r, else -inf
    M   = max(max_j s_j, o_h)        (o_h: the sink logit of head h, only with an offset)
    D   = sum_j e^{s_j - M} + e^{o_h - M}
    p_j = e^{s_j - M} / D            p_sink = e^{o_h - M} / D   (saved, float32, per row)

A row with nothing kept and no sink has D = 0: it is written as zeros, never NaN. A NaN in
a kept score or in the sink logit makes D NaN and the whole row NaN, as torch.softmax does.

Backward, with g the gradient of p:

    c    = sum_j g_j·p_j
    dx_j = scale·p_j·(g_j - c)       dx_j = 0 wherever p_j = 0 (masked, outside the band)
    do_h = - sum over the head's rows of p_sink·c      (per-row partials, summed on the host)

Causal band: row q keeps columns q + band_lo <= j <= q + band_hi. Plain causal is
band_lo = -sq (no lower edge), band_hi = sk - sq: the diagonal aligned bottom-right, so the
query q of the last sq positions of an sk-long sequence sees keys 0 .. q + sk - sq. A sliding
window (left, right) is band_lo = sk - sq - left, band_hi = sk - sq + right. Columns outside the band are never
read: the load mask stops at the band, rounded out to whole 16-byte vectors (the rounding
reads at most VEC - 1 extra elements per row, and keeps every load a full vector). They are
written as zeros, because the output is a dense tensor.

Two kernel shapes:

* rows that fit in registers (next power of two <= MAX_REGISTER_BLOCK): one program holds
  BLOCK_M whole rows, reads x once and writes p once;
* longer rows: a looping kernel, one row per program, that walks the row in tiles twice:
  first keeping a running max M and a running denominator D (the "online softmax" of
  Milakov & Gimelshein, 2018: D <- D·e^{M_old - M_new} + sum e^{s - M_new}), then writing p.
  It reads x twice; the second read of a 64 KB row usually comes from L2.

Attention dropout, fused (the DROPOUT switch; Megatron-core applies ``torch.nn.Dropout`` to
the probabilities right after this softmax). The output is z_j = k_j·p_j/(1 - p') with the
keep mask k from chapter 2's Philox (:mod:`fusedlib.kernels.bias_dropout_add`: element
(row, column) of the [b·np·sq, sk] rows, so the mask does not depend on the tiles, and rows of
different heads and batches draw different bits). The backward needs p at *every* position,
also where it was dropped: with g = dL/dz, the gradient of p is g'_j = g_j·k_j/(1 - p'), and

    dx_j = scale·p_j·(g'_j - c),     c = sum_j g'_j·p_j = sum_j g_j·z_j

is -scale·p_j·c where k_j = 0. So the forward saves, per row, m (the max it subtracted) and
1/D (float32, 8 bytes a row) instead of p, and the backward reads x again, recomputes
p = e^{scale·x - m}·(1/D) (with the forward's own arithmetic), regenerates k from
the seed and reads g: the [b, np, sq, sk] tensor moves forward 1R + 1W (x in, z out) and
backward 2R + 1W (x and g in, dx out), the fewest possible (the forward must read x and write
z; dx needs g and p everywhere). Unfused (softmax, then torch's dropout): forward 1R + 1W and
1R + 1W plus a byte-per-element mask written; backward 1R + 1W plus the mask read, then
2R + 1W. Saving p from the forward instead would cost a second write there for the same
backward traffic. Memory kept for the backward: x (the input) and the stats, against p and
the mask. DROPOUT = False compiles none of this: the kernels are the plain softmax's.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so gradcheck checks the
kernels), store p (or z) and dx in x's dtype; p_sink, the row statistics and the
offset-gradient partials in float32.

Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` and Apex's
``csrc/megatron/scaled_*_softmax.h`` (the CUDA kernels it calls); Triton's fused-softmax
tutorial (02-fused-softmax.py); Milakov & Gimelshein, "Online normalizer calculation for
softmax", arXiv:1805.02867; Miller, "Attention is off by one" (2023); Megatron-LM
``megatron/core/transformer/dot_product_attention.py`` (softmax, then attention dropout);
Srivastava et al., "Dropout" (JMLR 2014); Dao, "FlashAttention-2" (2023), whose backward
likewise regenerates the dropout mask from the seed.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..runtime import launch
from .bias_dropout_add import ELEMENTS_PER_PHILOX, _keep_mask, drop_threshold, dropout_mask, dropout_scale
from .launch import (
    MAX_FUSED_SIZE, TL_DTYPE, Tile, TileTable, acc_dtype, cdiv, empty_contiguous_like,
    next_power_of_2, pick,
)

__all__ = [
    "softmax_fwd",
    "softmax_bwd",
    "softmax_dropout_fwd",
    "softmax_dropout_bwd",
    "softmax_dropout_mask",
    "softmax_tile",
    "TILES",
    "ONLINE_TILE",
    "causal_band",
    "window_band",
    "MAX_REGISTER_BLOCK",
]

# ---------------------------------------------------------------------------------------------
# Launch settings: every tile choice is here, in tables.
# ---------------------------------------------------------------------------------------------

#: Longest row, as its next power of two, that one program holds in registers. 16 Ki
#: elements at 16 warps is 32 float32 values per thread; longer rows would spill or cut
#: occupancy, so they take the looping kernel.
MAX_REGISTER_BLOCK: int = 16384

# Tiles of the register kernel, as (upper bound of sk, Tile) with BLOCK_N = 0: the whole row
# (the next power of two >= sk); the bounds are powers of two. Short rows are packed so that
# a program holds about 1-2 Ki elements (8-16 per thread at 4 warps); rows of 2 Ki and more
# get a program each. Warps by the tile's elements: up to 2 Ki, 4 warps (<= 16 elements per
# thread); up to 8 Ki, 8 (<= 32 per thread); up to 32 Ki, 16; up to 64 Ki, 32 (the most a
# program can have); the same steps as the Triton layer-norm tutorial and Liger.
TILES: TileTable = (
    (32, Tile(BLOCK_M=32, BLOCK_N=0, num_warps=4)),  # up to 32 columns: 32 rows x 32 = 1 Ki elements
    (128, Tile(BLOCK_M=16, BLOCK_N=0, num_warps=4)),  # up to 128: 16 rows (2 Ki)
    (512, Tile(BLOCK_M=4, BLOCK_N=0, num_warps=4)),  # up to 512: 4 rows (2 Ki)
    (1024, Tile(BLOCK_M=2, BLOCK_N=0, num_warps=4)),  # up to 1 Ki: 2 rows (2 Ki)
    (2048, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=4)),  # 2 Ki and longer: one row per program
    (8192, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=8)),
    (32768, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=16)),
    (MAX_FUSED_SIZE, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=32)),
)

# Looping kernel (rows longer than MAX_REGISTER_BLOCK): one row per program, in column tiles
# of 4 Ki at 8 warps: 16 elements per thread, two 16-byte loads of bf16.
ONLINE_TILE: Tile = Tile(BLOCK_M=1, BLOCK_N=4096, num_warps=8)

#: Bytes of one vector load; VEC = elements per vector, the granule the band is rounded to.
VECTOR_BYTES: int = 16

# (n_cols, max_register_block) -> Tile: softmax_tile's memory (plain ints as keys).
_TILE_PICKS: dict[tuple[int, int], Tile] = {}


def softmax_tile(n_cols: int, max_register_block: Optional[int] = None) -> Tile:
    """The tile a row of ``n_cols`` elements gets; a BLOCK_N below the row's next power of two
    means the looping kernel.

    Args:
        n_cols: the row length sk (>= 1).
        max_register_block: the longest row (as its next power of two) held in registers
            (None: ``MAX_REGISTER_BLOCK``, read at call time).

    Returns:
        ``pick(TILES, n_cols)`` for rows that fit in registers, else :data:`ONLINE_TILE` (its
        BLOCK_N capped at ``max_register_block``).

    Raises:
        ValueError: ``max_register_block`` not a power of two (an int >= 1): Triton's ranges
            are powers of two, so another BLOCK_N could not launch.

    Source: fusedlib's own tile table; Triton's fused-softmax tutorial (02-fused-softmax.py).
    """
    if max_register_block is None:  # (the ops' path: the module's limit, a power of two)
        max_register_block = MAX_REGISTER_BLOCK
    elif type(max_register_block) is not int or max_register_block < 1 or max_register_block & (max_register_block - 1):
        raise ValueError(f"max_register_block must be a power of two (an int >= 1), got {max_register_block!r}")
    key = (n_cols, max_register_block)
    tile = _TILE_PICKS.get(key)
    if tile is None:
        if next_power_of_2(n_cols) > max_register_block:
            tile = Tile(BLOCK_M=1, BLOCK_N=min(ONLINE_TILE.BLOCK_N, max_register_block),
                        num_warps=ONLINE_TILE.num_warps)
        else:
            tile = pick(TILES, n_cols)
        if not torch.compiler.is_compiling():  # (as pick's memory: no writes inside a compile)
            _TILE_PICKS[key] = tile
    return tile


def causal_band(sq: int, sk: int) -> tuple[int, int]:
    """(band_lo, band_hi) of the causal mask, diagonal aligned bottom-right.

    Row q keeps columns j <= q + sk - sq; for sq == sk that is the usual lower triangle
    (j <= q). For sq > sk the first sq - sk rows keep nothing and come out as zeros.
    band_lo = -sq puts every row's lower edge q - sq below column 0: no lower limit.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_default_causal_mask``),
    aligned bottom-right for sq != sk.
    """
    return -sq, sk - sq


def window_band(sq: int, sk: int, window_size: tuple[int, int]) -> tuple[int, int]:
    """(band_lo, band_hi) of a sliding window ``(left, right)``, as Megatron-core's
    ``get_sliding_window_causal_mask``: row q keeps sk - sq - left <= j - q <= sk - sq + right.
    ``-1`` on either side means unbounded (FlashAttention's convention).

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_sliding_window_causal_mask``).
    """
    left, right = window_size
    lo = -sq if left < 0 else sk - sq - left  # -sq: below column 0 for every row
    hi = sk if right < 0 else sk - sq + right
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Device functions shared by the kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_layout(rows, n_heads, sq):
    """Split row indices r = (b·n_heads + h)·sq + q into (b, h, q)."""
    q = rows % sq
    bh = rows // sq
    return bh // n_heads, bh % n_heads, q


@triton.jit
def _band_masks(q, cols, in_range, band_lo, band_hi, VEC: tl.constexpr):
    """Kept columns of the band of each row q, and the (wider) load mask: the band rounded
    out to whole vectors of VEC elements, so that every load is a full 16-byte vector."""
    lo = tl.maximum(q + band_lo, 0)  # first kept column (clamped: no negative division)
    hi = tl.maximum(q + band_hi + 1, 0)  # one past the last kept column
    keep = in_range & (cols >= lo) & (cols < hi)
    lo_vec = (lo // VEC) * VEC
    hi_vec = ((hi + VEC - 1) // VEC) * VEC
    load_ok = in_range & (cols >= lo_vec) & (cols < hi_vec)
    return keep, load_ok


@triton.jit
def _scores(X_ptr, x_offs, MASK_ptr, mask_row_offs, M_k_stride, cols, scale, keep, load_ok,
            HAS_MASK: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr):
    """s = scale·x where kept and not masked, else -inf (loads nothing outside load_ok)."""
    x = tl.load(X_ptr + x_offs, mask=load_ok, other=0.0)
    if HAS_MASK:
        # The same columns, written so that Triton's alignment analysis sees runs of VEC
        # (not 16): the mask bytes then load VEC at a time into the same registers layout as
        # x, instead of 16 at a time and a shuffle through shared memory to match x.
        cols_vec = (cols // VEC) * VEC + cols % VEC
        masked = tl.load(MASK_ptr + mask_row_offs + cols_vec * M_k_stride, mask=load_ok, other=1)  # 1 = masked
        keep = keep & (masked == 0)
    return tl.where(keep, x.to(ACC) * scale, float("-inf"))


@triton.jit
def _safe_reciprocal(d):
    """1/d, or 0 where d == 0 (a row that kept nothing), without ever dividing by zero.

    d is a sum of exponentials, so d >= 0 or NaN. A NaN d (a NaN score in a kept column, or
    a NaN sink logit) gives a NaN reciprocal: the whole row becomes NaN, as in torch.softmax,
    instead of the NaN being hidden behind zeros.

    Correctly rounded (``div_rn``; Triton's float32 ``/`` is a 2-ulp approximation on NVIDIA
    GPUs), so a row of k equal scores gives exactly float32(1/k), as PyTorch does.
    """
    empty = d == 0
    d_safe = tl.where(empty, 1.0, d)
    if d.dtype == tl.float32:
        r = tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d_safe)
    else:  # float64: '/' is IEEE division already
        r = 1.0 / d_safe
    return tl.where(empty, 0.0, r)


@triton.jit
def _finite_or_zero(m):
    """The row max to subtract: m, or 0 where the row kept nothing (m = -inf), so that
    s - m never computes -inf - (-inf)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _finite_sink(o):
    """The sink logit, a +inf held at the compute dtype's largest value.

    The row's max includes the sink, so a sink of +inf (or a float64 one beyond float32's range,
    inf once in float32) made e^{o - M} = e^{inf - inf} = NaN for the whole row, where the
    softmax's limit is p_sink = 1 and p = 0 with zero gradients. At the largest finite value the
    kernels compute exactly that: M = o, e^{s - M} = 0 for every finite score. NaN stays NaN;
    -inf stays no sink."""
    if o.dtype == tl.float32:
        big = 3.4028234663852886e38  # float32's max
    else:
        big = 1.7976931348623157e308  # float64's max
    return tl.where(o == float("inf"), big, o)


# ---------------------------------------------------------------------------------------------
# Rows held in registers
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _softmax_fwd_kernel(
    X_ptr,  # scores x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    Y_ptr,  # probabilities p (with DROPOUT: z = k·p/(1 - p')), [n_rows, n_cols], contiguous, x's dtype
    MASK_ptr,  # uint8 view of the bool mask (1 = masked), element (b, h, q, j) at the M_* strides
    OFFSET_ptr,  # ACC sink logits, one per head at OFFSET_head_stride (0: one for all heads)
    SINK_ptr,  # ACC [n_rows]: p_sink of each row, written for the backward
    STATS_ptr,  # ACC [2, n_rows]: each row's m, then its 1/D, written for the backward (with DROPOUT)
    SEED_ptr,  # int64 [1]: the Philox key of the dropout mask (with DROPOUT)
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    n_heads,  # rows are (b, h, q) with q fastest: r = (b·n_heads + h)·sq + q
    sq,
    M_b_stride,
    M_h_stride,
    M_q_stride,
    M_k_stride,
    OFFSET_head_stride,
    scale,
    band_lo,  # row q keeps q + band_lo <= j <= q + band_hi (with BAND)
    band_hi,
    T,  # drop threshold round(p·2^16) (with DROPOUT)
    keep_scale,  # 1/(1 - p'), p' = T/2^16, float32 (with DROPOUT)
    HAS_MASK: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BAND: tl.constexpr,
    DROPOUT: tl.constexpr,  # attention dropout on the probabilities; False: the plain softmax
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns: the whole row, padded to a power of two (>= 8 with DROPOUT)
    VEC: tl.constexpr,  # elements per 16-byte vector
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64 offsets
    cols = tl.arange(0, BLOCK_N)[None, :]
    row_ok = rows < n_rows
    in_range = row_ok[:, None] & (cols < n_cols)
    b, h, q = _row_layout(rows, n_heads, sq)

    # [1] which columns to read: the band (causal / window) or the whole row
    keep = in_range
    load_ok = in_range
    if BAND:
        keep, load_ok = _band_masks(q[:, None], cols, in_range, band_lo, band_hi, VEC)

    # [2] s = scale·x, -inf where masked; the mask is read as bytes
    x_offs = rows[:, None] * X_row_stride + cols * X_col_stride
    mask_row_offs = (b * M_b_stride + h * M_h_stride + q * M_q_stride)[:, None]
    s = _scores(X_ptr, x_offs, MASK_ptr, mask_row_offs, M_k_stride, cols, scale, keep, load_ok, HAS_MASK, VEC, ACC)

    # [3] max, exponentials, denominator (plus the sink's e^{o - M})
    row_max = tl.max(s, axis=1)
    if HAS_OFFSET:
        o = _finite_sink(tl.load(OFFSET_ptr + h * OFFSET_head_stride, mask=row_ok, other=0.0).to(ACC))
        row_max = tl.maximum(row_max, o)
    m = _finite_or_zero(row_max)
    e = tl.exp(s - m[:, None])
    denom = tl.sum(e, axis=1)
    if HAS_OFFSET:
        e_sink = tl.exp(o - m)
        denom += e_sink
    inv = _safe_reciprocal(denom)

    # with DROPOUT (the attention dropout): keep each p_j = e_j/D with probability 1 - p',
    # scaled by 1/(1 - p'); the mask is Philox of (row, column), never stored: the backward
    # recomputes p from x and (m, 1/D), saved here
    if DROPOUT:
        kept = _keep_mask(tl.load(SEED_ptr), rows, 0, T, BLOCK_M, BLOCK_N)
        # dropped: e - e, 0 for a finite e and NaN for a NaN one (torch's dropout multiplies by the mask)
        e = tl.where(kept, e * keep_scale, e - e)
        tl.store(STATS_ptr + rows, m, mask=row_ok)
        tl.store(STATS_ptr + n_rows + rows, inv, mask=row_ok)

    # [4] write the whole row: p (or z) inside, zeros outside (never read there)
    tl.store(Y_ptr + rows[:, None] * n_cols + cols, (e * inv[:, None]).to(Y_ptr.dtype.element_ty), mask=in_range)
    if HAS_OFFSET:
        tl.store(SINK_ptr + rows, e_sink * inv, mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _softmax_bwd_kernel(
    G_ptr,  # grad of the output, [n_rows, n_cols], strides (G_row_stride, G_col_stride); never written
    P_ptr,  # saved probabilities p, [n_rows, n_cols], contiguous (unused with DROPOUT)
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous, p's dtype
    SINK_ptr,  # ACC [n_rows]: p_sink saved by the forward (with HAS_OFFSET)
    DOFF_ptr,  # ACC [n_rows]: this row's share of the sink-logit gradient, -p_sink·c
    X_ptr,  # with DROPOUT: the forward's scores x, strides (X_row_stride, X_col_stride)
    MASK_ptr,  # with DROPOUT: the forward's uint8 mask, as in _softmax_fwd_kernel
    STATS_ptr,  # with DROPOUT: ACC [2, n_rows], the forward's m and 1/D of each row
    SEED_ptr,  # with DROPOUT: int64 [1], the forward's Philox key
    n_rows,
    n_cols,
    G_row_stride,
    G_col_stride,
    X_row_stride,
    X_col_stride,
    n_heads,
    sq,
    M_b_stride,
    M_h_stride,
    M_q_stride,
    M_k_stride,
    scale,
    band_lo,
    band_hi,
    T,  # the forward's drop threshold (with DROPOUT)
    keep_scale,  # the forward's 1/(1 - p'), float32 (with DROPOUT)
    HAS_MASK: tl.constexpr,  # (with DROPOUT: re-apply the mask to the recomputed scores)
    HAS_OFFSET: tl.constexpr,
    BAND: tl.constexpr,
    DROPOUT: tl.constexpr,  # recompute p from x and the stats, regenerate the keep mask
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    row_ok = rows < n_rows
    in_range = row_ok[:, None] & (cols < n_cols)
    keep = in_range
    load_ok = in_range
    if BAND:  # p = 0 outside the band: read neither g nor p (nor x) there
        keep, load_ok = _band_masks((rows % sq)[:, None], cols, in_range, band_lo, band_hi, VEC)

    g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols * G_col_stride, mask=load_ok, other=0.0).to(ACC)
    if DROPOUT:
        # p = e^{s - m}·(1/D): the forward's scores, masks and arithmetic, so the same p
        b, h, q = _row_layout(rows, n_heads, sq)
        x_offs = rows[:, None] * X_row_stride + cols * X_col_stride
        mask_row_offs = (b * M_b_stride + h * M_h_stride + q * M_q_stride)[:, None]
        s = _scores(X_ptr, x_offs, MASK_ptr, mask_row_offs, M_k_stride, cols, scale, keep, load_ok, HAS_MASK, VEC, ACC)
        m = tl.load(STATS_ptr + rows, mask=row_ok, other=0.0)
        inv = tl.load(STATS_ptr + n_rows + rows, mask=row_ok, other=0.0)
        p = tl.exp(s - m[:, None]) * inv[:, None]
        # g becomes the gradient of p: g·k/(1 - p'), with the forward's mask k regenerated
        kept = _keep_mask(tl.load(SEED_ptr), rows, 0, T, BLOCK_M, BLOCK_N)
        g = tl.where(kept, g * keep_scale, g - g)
    else:
        p = tl.load(P_ptr + rows[:, None] * n_cols + cols, mask=load_ok, other=0.0).to(ACC)
    gp = g * p
    c = tl.sum(gp, axis=1)  # c = sum_j g_j·p_j
    dx = scale * (gp - p * c[:, None])  # scale·p·(g - c); 0 where p = 0
    tl.store(DX_ptr + rows[:, None] * n_cols + cols, dx.to(DX_ptr.dtype.element_ty), mask=in_range)
    if HAS_OFFSET:
        sink = tl.load(SINK_ptr + rows, mask=row_ok, other=0.0)
        tl.store(DOFF_ptr + rows, -sink * c, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Rows longer than registers hold: loop over column tiles
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _softmax_fwd_online_kernel(
    X_ptr,  # scores x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    Y_ptr,  # probabilities p (with DROPOUT: z = k·p/(1 - p')), [n_rows, n_cols], contiguous
    MASK_ptr,  # uint8 mask, as in _softmax_fwd_kernel
    OFFSET_ptr,  # ACC sink logits, as in _softmax_fwd_kernel
    SINK_ptr,  # ACC [n_rows]: p_sink of each row
    STATS_ptr,  # ACC [2, n_rows]: m and 1/D of each row (with DROPOUT)
    SEED_ptr,  # int64 [1]: the Philox key (with DROPOUT)
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    n_heads,
    sq,
    M_b_stride,
    M_h_stride,
    M_q_stride,
    M_k_stride,
    OFFSET_head_stride,
    scale,
    band_lo,
    band_hi,
    T,  # drop threshold (with DROPOUT)
    keep_scale,  # 1/(1 - p'), float32 (with DROPOUT)
    HAS_MASK: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BAND: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per tile (a multiple of 8 with DROPOUT)
    VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    # This kernel spells out _row_layout, _band_masks, _scores, _finite_or_zero, _finite_sink
    # and _safe_reciprocal inline: the same arithmetic, but Triton's CPU interpreter pays
    # milliseconds for each call of a nested @triton.jit function.
    row = tl.program_id(0).to(tl.int64)  # one row per program
    q = row % sq
    h = (row // sq) % n_heads
    b = (row // sq) // n_heads
    lane = tl.arange(0, BLOCK_N)
    # kept columns [lo, hi); loads cover [lo_vec, hi_vec), the same rounded out to vectors
    lo = 0
    hi = n_cols
    if BAND:
        lo = tl.maximum(q + band_lo, 0)
        hi = tl.minimum(tl.maximum(q + band_hi + 1, 0), n_cols)
    lo_vec = (lo // VEC) * VEC
    hi_vec = ((hi + VEC - 1) // VEC) * VEC
    first = (lo // BLOCK_N) * BLOCK_N  # the first tile holding a kept column
    x_row = X_ptr + row * X_row_stride
    m_row = MASK_ptr + b * M_b_stride + h * M_h_stride + q * M_q_stride

    # pass 1: running max M and denominator D over the tiles in the band
    # (started from a reduction so that they carry the ACC dtype through the loop)
    M = tl.max(tl.full([BLOCK_N], float("-inf"), ACC), axis=0)
    D = tl.sum(tl.zeros([BLOCK_N], ACC), axis=0)
    for start in range(first, hi, BLOCK_N):
        cols = start + lane
        keep = (cols >= lo) & (cols < hi)
        load_ok = (cols < n_cols) & (cols >= lo_vec) & (cols < hi_vec)
        x = tl.load(x_row + cols * X_col_stride, mask=load_ok, other=0.0)
        if HAS_MASK:
            masked = tl.load(m_row + ((cols // VEC) * VEC + cols % VEC) * M_k_stride, mask=load_ok, other=1)
            keep = keep & (masked == 0)
        s = tl.where(keep, x.to(ACC) * scale, float("-inf"))
        M_new = tl.maximum(M, tl.max(s, axis=0))
        m = tl.where(M_new == float("-inf"), 0.0, M_new)  # _finite_or_zero
        D = D * tl.exp(M - m) + tl.sum(tl.exp(s - m), axis=0)  # rescale the old sum to the new max
        M = M_new
    if HAS_OFFSET:  # the sink is one more logit in the row
        o = tl.load(OFFSET_ptr + h * OFFSET_head_stride).to(ACC)
        if ACC == tl.float32:  # _finite_sink: +inf held at the dtype's max
            o = tl.where(o == float("inf"), 3.4028234663852886e38, o)
        else:
            o = tl.where(o == float("inf"), 1.7976931348623157e308, o)
        M_new = tl.maximum(M, o)
        m = tl.where(M_new == float("-inf"), 0.0, M_new)
        D = D * tl.exp(M - m) + tl.exp(o - m)
        M = M_new
    m = tl.where(M == float("-inf"), 0.0, M)
    D_safe = tl.where(D == 0, 1.0, D)
    if ACC == tl.float32:
        inv = tl.div_rn(tl.full(D.shape, 1.0, tl.float32), D_safe)  # correctly rounded 1/D
    else:
        inv = 1.0 / D_safe
    inv = tl.where(D == 0, 0.0, inv)  # a row that kept nothing: zeros; a NaN D stays NaN
    if DROPOUT:  # the row statistics the backward recomputes p from; the Philox key
        tl.store(STATS_ptr + row, m)
        tl.store(STATS_ptr + n_rows + row, inv)
        seed = tl.load(SEED_ptr)
        row_1 = tl.zeros([1], tl.int64) + row  # [1]: the row, as _keep_mask takes rows

    # pass 2: p = e^{s - M}/D inside the band (with DROPOUT: z = k·p/(1 - p')); plain zeros in
    # tiles wholly outside it
    y_row = Y_ptr + row * n_cols
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lane
        in_range = cols < n_cols
        if (start + BLOCK_N <= lo) | (start >= hi):
            tl.store(y_row + cols, tl.zeros([BLOCK_N], ACC).to(Y_ptr.dtype.element_ty), mask=in_range)
        else:
            keep = (cols >= lo) & (cols < hi)
            load_ok = in_range & (cols >= lo_vec) & (cols < hi_vec)
            x = tl.load(x_row + cols * X_col_stride, mask=load_ok, other=0.0)
            if HAS_MASK:
                masked = tl.load(m_row + ((cols // VEC) * VEC + cols % VEC) * M_k_stride, mask=load_ok, other=1)
                keep = keep & (masked == 0)
            s = tl.where(keep, x.to(ACC) * scale, float("-inf"))
            p = tl.exp(s - m) * inv
            if DROPOUT:  # the tile's mask: Philox of (row, column), as in the register kernel
                kept = tl.reshape(_keep_mask(seed, row_1, start // BLOCK_N, T, 1, BLOCK_N), [BLOCK_N])
                p = tl.where(kept, p * keep_scale, p - p)
            tl.store(y_row + cols, p.to(Y_ptr.dtype.element_ty), mask=in_range)
    if HAS_OFFSET:
        tl.store(SINK_ptr + row, tl.exp(o - m) * inv)


@triton.jit(do_not_specialize=["T"])
def _softmax_bwd_online_kernel(
    G_ptr,  # grad of the output, [n_rows, n_cols], strides (G_row_stride, G_col_stride); never written
    P_ptr,  # saved p, [n_rows, n_cols], contiguous (unused with DROPOUT)
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous
    SINK_ptr,  # ACC [n_rows]: p_sink (with HAS_OFFSET)
    DOFF_ptr,  # ACC [n_rows]: -p_sink·c per row (with HAS_OFFSET)
    X_ptr,  # with DROPOUT: the forward's scores x, strides (X_row_stride, X_col_stride)
    MASK_ptr,  # with DROPOUT: the forward's uint8 mask
    STATS_ptr,  # with DROPOUT: ACC [2, n_rows], m and 1/D of each row
    SEED_ptr,  # with DROPOUT: int64 [1], the forward's Philox key
    n_rows,
    n_cols,
    G_row_stride,
    G_col_stride,
    X_row_stride,
    X_col_stride,
    n_heads,
    sq,
    M_b_stride,
    M_h_stride,
    M_q_stride,
    M_k_stride,
    scale,
    band_lo,
    band_hi,
    T,  # the forward's drop threshold (with DROPOUT)
    keep_scale,  # the forward's 1/(1 - p'), float32 (with DROPOUT)
    HAS_MASK: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BAND: tl.constexpr,
    DROPOUT: tl.constexpr,  # recompute p from x and the stats, regenerate the keep mask
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    # Inline code, as in the forward online kernel: nested calls are slow in the interpreter.
    row = tl.program_id(0).to(tl.int64)
    q = row % sq
    lane = tl.arange(0, BLOCK_N)
    lo = 0
    hi = n_cols
    if BAND:
        lo = tl.maximum(q + band_lo, 0)
        hi = tl.minimum(tl.maximum(q + band_hi + 1, 0), n_cols)
    lo_vec = (lo // VEC) * VEC  # p = 0 outside [lo, hi): read neither g nor p there
    hi_vec = ((hi + VEC - 1) // VEC) * VEC
    first = (lo // BLOCK_N) * BLOCK_N
    g_row = G_ptr + row * G_row_stride
    p_row = P_ptr + row * n_cols
    dx_row = DX_ptr + row * n_cols
    if DROPOUT:  # p = e^{s - m}·(1/D) from x, the masks and the forward's row statistics
        x_row = X_ptr + row * X_row_stride
        m_row = MASK_ptr + (row // sq) // n_heads * M_b_stride + (row // sq) % n_heads * M_h_stride + q * M_q_stride
        m = tl.load(STATS_ptr + row)
        inv = tl.load(STATS_ptr + n_rows + row)
        seed = tl.load(SEED_ptr)
        row_1 = tl.zeros([1], tl.int64) + row

    # pass 1: c = sum_j g_j·p_j over the band (with DROPOUT, g the gradient of p: g·k/(1 - p'))
    c = tl.sum(tl.zeros([BLOCK_N], ACC), axis=0)
    for start in range(first, hi, BLOCK_N):
        cols = start + lane
        load_ok = (cols < n_cols) & (cols >= lo_vec) & (cols < hi_vec)
        g = tl.load(g_row + cols * G_col_stride, mask=load_ok, other=0.0).to(ACC)
        if DROPOUT:
            keep = (cols >= lo) & (cols < hi)
            x = tl.load(x_row + cols * X_col_stride, mask=load_ok, other=0.0)
            if HAS_MASK:
                masked = tl.load(m_row + ((cols // VEC) * VEC + cols % VEC) * M_k_stride, mask=load_ok, other=1)
                keep = keep & (masked == 0)
            p = tl.exp(tl.where(keep, x.to(ACC) * scale, float("-inf")) - m) * inv
            tile = tl.cast(start // BLOCK_N, tl.int32)  # int32: Philox's counters are 32-bit (start is int64 here)
            kept = tl.reshape(_keep_mask(seed, row_1, tile, T, 1, BLOCK_N), [BLOCK_N])
            g = tl.where(kept, g * keep_scale, g - g)
        else:
            p = tl.load(p_row + cols, mask=load_ok, other=0.0).to(ACC)
        c += tl.sum(g * p, axis=0)

    # pass 2: dx = scale·p·(g - c), zeros in tiles wholly outside the band
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lane
        in_range = cols < n_cols
        if (start + BLOCK_N <= lo) | (start >= hi):
            tl.store(dx_row + cols, tl.zeros([BLOCK_N], ACC).to(DX_ptr.dtype.element_ty), mask=in_range)
        else:
            load_ok = in_range & (cols >= lo_vec) & (cols < hi_vec)
            g = tl.load(g_row + cols * G_col_stride, mask=load_ok, other=0.0).to(ACC)
            if DROPOUT:  # as in pass 1
                keep = (cols >= lo) & (cols < hi)
                x = tl.load(x_row + cols * X_col_stride, mask=load_ok, other=0.0)
                if HAS_MASK:
                    masked = tl.load(m_row + ((cols // VEC) * VEC + cols % VEC) * M_k_stride, mask=load_ok, other=1)
                    keep = keep & (masked == 0)
                p = tl.exp(tl.where(keep, x.to(ACC) * scale, float("-inf")) - m) * inv
                kept = tl.reshape(_keep_mask(seed, row_1, start // BLOCK_N, T, 1, BLOCK_N), [BLOCK_N])
                g = tl.where(kept, g * keep_scale, g - g)
            else:
                p = tl.load(p_row + cols, mask=load_ok, other=0.0).to(ACC)
            tl.store(dx_row + cols, (scale * (g * p - p * c)).to(DX_ptr.dtype.element_ty), mask=in_range)
    if HAS_OFFSET:
        tl.store(DOFF_ptr + row, -tl.load(SINK_ptr + row) * c)


# ---------------------------------------------------------------------------------------------
# Host launchers (no autograd, no user-input checks: fusedlib.fusions.fused_softmax does those)
# ---------------------------------------------------------------------------------------------


# Elements per 16-byte vector, by dtype
_VEC: dict[torch.dtype, int] = {d: VECTOR_BYTES // d.itemsize
                                for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def _vec(dtype: torch.dtype) -> int:
    vec = _VEC.get(dtype)
    return vec if vec is not None else VECTOR_BYTES // dtype.itemsize


def _dims(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(b, np, sq, sk) of scores [b, np, sq, sk], or of [b, sq, sk] as one head (np = 1)."""
    if t.dim() == 3:
        B, SQ, SK = t.shape
        return B, 1, SQ, SK
    return t.shape


def _resolve(tile: Optional[Tile], n_cols: int, max_register_block: Optional[int]) -> tuple[Tile, bool]:
    """(tile, online): the table's tile unless one is given; online (the looping kernel) when
    its BLOCK_N is below the row's next power of two."""
    if tile is None:
        tile = softmax_tile(n_cols, max_register_block)
    block_n = next_power_of_2(n_cols)
    if tile.BLOCK_N == 0 or tile.BLOCK_N > block_n:  # 0: the whole row; a wider tile is capped to it
        return Tile(tile.BLOCK_M, block_n, tile.num_warps, tile.num_stages, tile.programs_per_sm), False
    return tile, tile.BLOCK_N < block_n


def _mask_strides(mask: Optional[torch.Tensor], shape: tuple[int, int, int, int],
                  dummy: torch.Tensor, scores_dim: int = 4) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The bool mask as bytes expanded to ``shape`` (same memory, zero strides where it is
    broadcast) and its four strides; ``(dummy, zeros)`` without a mask. With 3-D scores
    ([b, sq, sk], one head: ``shape`` is [b, 1, sq, sk]) a mask of up to 3 dims broadcasts
    against the scores' own shape, its leading dim being b, not the head's."""
    if mask is None:
        return dummy, (0, 0, 0, 0)  # unused pointer (HAS_MASK=False)
    if scores_dim == 3 and mask.dim() < 4:
        mask = mask.expand(shape[0], shape[2], shape[3]).unsqueeze(1)
    m4 = mask.expand(*shape)
    if not torch.compiler.is_compiling():
        # bool -> bytes, same strides (Inductor cannot lower a bool -> uint8 view: traced, the
        # kernel takes the bool tensor itself, 1 byte per element too, loaded as int1)
        m4 = m4.view(torch.uint8)
    return m4, m4.stride()


def _rows_without_keys(offset, rows, sink, stats):
    """Write what the kernels write for a row that keeps no column into ``sink`` and ``stats``
    (``rows`` = (b, np, sq), each row with no key: sk = 0): p_sink 1 with a sink logit o, 0
    for o = -inf (no sink), NaN for a NaN one; stats (m, 1/D) = (o, 1) with +inf held at the
    dtype's largest value, (0, 0) for -inf or no sink, (0, NaN) for a NaN o."""
    if offset is None:
        stats.zero_()
        return
    o = offset.reshape(1, -1, 1)  # [1] or [np] -> broadcast over (b, np, sq)
    has = o > float("-inf")  # (False for NaN)
    p_sink = torch.where(o.isnan(), o, has.to(o.dtype)).expand(rows).reshape(-1)
    sink.copy_(p_sink)  # (given with the offset)
    if stats is not None:
        m = torch.where(has, o.clamp(max=torch.finfo(o.dtype).max), 0.0)
        stats[0].copy_(m.expand(rows).reshape(-1))
        stats[1].copy_(p_sink)


def _fwd(x4, scale, mask, band, offset, max_register_block, seed, p, tile):
    """Launch the forward (register or looping kernel); returns (y, p_sink, stats)."""
    B, H, SQ, SK = _dims(x4)
    device = x4.device
    n_rows, n_cols = B * H * SQ, SK
    y = empty_contiguous_like(x4)
    acc = acc_dtype(x4.dtype)
    sink = torch.empty(n_rows, dtype=acc, device=device) if offset is not None else None
    dropout = seed is not None
    stats = torch.empty((2, n_rows), dtype=acc, device=device) if dropout else None
    if y.numel() == 0:
        if n_rows and (sink is not None or stats is not None):  # sk = 0: rows with no key
            _rows_without_keys(offset, (B, H, SQ), sink, stats)
        return y, sink, stats
    x2d = x4.reshape(n_rows, n_cols)  # [b, np, sq, sk] -> [b·np·sq, sk]
    m4, m_strides = _mask_strides(mask, (B, H, SQ, SK), x2d, x4.dim())
    band_lo, band_hi = band if band is not None else (0, 0)
    tile, online = _resolve(tile, n_cols, max_register_block)
    # Philox decides 8 columns per call: with dropout a tile holds at least 8 (the mask does
    # not depend on the tile, so this changes nothing else)
    block_n = max(tile.BLOCK_N, ELEMENTS_PER_PHILOX) if dropout else tile.BLOCK_N
    common = (
        x2d, y, m4, offset if offset is not None else x2d, sink if sink is not None else x2d,
        stats if dropout else x2d, seed if dropout else x2d,
        n_rows, n_cols, *x2d.stride(), H, SQ, *m_strides,
        (1 if offset is not None and offset.numel() > 1 else 0), float(scale), band_lo, band_hi,
        drop_threshold(p) if dropout else 0, dropout_scale(p) if dropout else 1.0,
    )
    flags = dict(HAS_MASK=mask is not None, HAS_OFFSET=offset is not None, BAND=band is not None,
                 DROPOUT=dropout, BLOCK_N=block_n, VEC=_vec(x4.dtype), ACC=TL_DTYPE[acc],
                 num_warps=tile.num_warps)
    if online:
        launch(_softmax_fwd_online_kernel, (n_rows,), device, *common, **flags)
    else:
        launch(_softmax_fwd_kernel, (cdiv(n_rows, tile.BLOCK_M),), device, *common,
               BLOCK_M=tile.BLOCK_M, **flags)
    return y, sink, stats


def _bwd(g4, p4, x4, mask, stats, seed, p, scale, band, sink, max_register_block, tile):
    """Launch the backward; with ``seed`` (dropout) p is recomputed from x4 and stats, and
    ``p4`` is unused. Returns (dx, d_offset_rows)."""
    ref = x4 if seed is not None else p4  # the tensor of the forward's shape
    B, H, SQ, SK = _dims(ref)
    device = ref.device
    dx = empty_contiguous_like(ref)
    doff = torch.empty_like(sink) if sink is not None else None
    if dx.numel() == 0:  # (rows with no key, sk = 0: the sink holds all the probability, its gradient is 0)
        return dx, (doff.zero_() if doff is not None else None)
    n_rows, n_cols = B * H * SQ, SK
    g2d = g4.reshape(n_rows, n_cols)  # [b, np, sq, sk] -> [b·np·sq, sk]
    dropout = seed is not None
    if dropout:
        x2d = x4.reshape(n_rows, n_cols)  # as in the forward
        m4, m_strides = _mask_strides(mask, (B, H, SQ, SK), x2d, x4.dim())
    else:
        x2d, m4, m_strides = g2d, g2d, (0, 0, 0, 0)  # unused pointers
    band_lo, band_hi = band if band is not None else (0, 0)
    tile, online = _resolve(tile, n_cols, max_register_block)
    block_n = max(tile.BLOCK_N, ELEMENTS_PER_PHILOX) if dropout else tile.BLOCK_N
    args = (g2d, p4 if not dropout else g2d, dx, sink if sink is not None else dx, doff if doff is not None else dx,
            x2d, m4, stats if dropout else dx, seed if dropout else dx,
            n_rows, n_cols, *g2d.stride(), *x2d.stride(), H, SQ, *m_strides,
            float(scale), band_lo, band_hi,
            drop_threshold(p) if dropout else 0, dropout_scale(p) if dropout else 1.0)
    flags = dict(HAS_MASK=dropout and mask is not None, HAS_OFFSET=sink is not None, BAND=band is not None,
                 DROPOUT=dropout, BLOCK_N=block_n, VEC=_vec(ref.dtype), ACC=TL_DTYPE[acc_dtype(ref.dtype)],
                 num_warps=tile.num_warps)
    if online:
        launch(_softmax_bwd_online_kernel, (n_rows,), device, *args, **flags)
    else:
        launch(_softmax_bwd_kernel, (cdiv(n_rows, tile.BLOCK_M),), device, *args,
               BLOCK_M=tile.BLOCK_M, **flags)
    return dx, doff


def softmax_fwd(
    x4: torch.Tensor,
    scale: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    band: Optional[tuple[int, int]] = None,
    offset: Optional[torch.Tensor] = None,
    max_register_block: Optional[int] = None,
    tile: Optional[Tile] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch the forward kernel over every row of ``x4``.

    Args:
        x4: scores [b, np, sq, sk] (or [b, sq, sk]: one head), float32/float16/bfloat16/float64,
            any strides (the leading dims are merged into rows by ``reshape``, a copy only where
            strides forbid).
        scale: multiplies x before the mask.
        mask: bool, broadcastable to x4's shape, True = masked; read as bytes through its
            (expanded, possibly zero) strides, never copied.
        band: ``(band_lo, band_hi)``: row q keeps q + band_lo <= j <= q + band_hi (see
            :func:`causal_band`, :func:`window_band`); None keeps every column.
        offset: sink logits in the compute dtype, [np] (one per head) or [1] (shared).
        max_register_block: longest row (next power of two) held in registers; longer rows
            use the looping kernel. None: the module's ``MAX_REGISTER_BLOCK``, read at call
            time (tests lower it to run the looping kernel on short rows).
        tile: launch settings (None: :func:`softmax_tile`); a BLOCK_N below the row's next
            power of two runs the looping kernel in column tiles of BLOCK_N, one row per program.

    Returns:
        ``(p, p_sink)``: p a new contiguous tensor of x4's shape and dtype; p_sink [b·np·sq] in
        the compute dtype when ``offset`` is given, else None.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` and Apex's
    ``csrc/megatron/scaled_*_softmax.h``; Triton's fused-softmax tutorial; Milakov & Gimelshein,
    arXiv:1805.02867.
    """
    y, sink, _ = _fwd(x4, scale, mask, band, offset, max_register_block, None, 0.0, tile)
    return y, sink


def softmax_bwd(
    g4: torch.Tensor,
    p4: torch.Tensor,
    scale: float = 1.0,
    band: Optional[tuple[int, int]] = None,
    sink: Optional[torch.Tensor] = None,
    max_register_block: Optional[int] = None,
    tile: Optional[Tile] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernel: dx = scale·p·(g - sum(g·p)) row by row.

    Args:
        g4: gradient of p, p's shape and dtype, any strides; read, never written.
        p4: the forward's output, [b, np, sq, sk] (or [b, sq, sk]: one head), contiguous.
        scale: the forward's scale.
        band: the forward's band (g and p are not read outside it), or None.
        sink: the forward's p_sink [b·np·sq] when it had an offset, else None.
        max_register_block, tile: as :func:`softmax_fwd`.

    Returns:
        ``(dx, d_offset_rows)``: dx a new contiguous tensor of p's shape and dtype;
        d_offset_rows [b·np·sq] (each row's -p_sink·sum(g·p), compute dtype) when ``sink`` is
        given, else None. Summing it over the rows of a head gives that head's gradient.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` and Apex's
    ``csrc/megatron/scaled_*_softmax.h``.
    """
    return _bwd(g4, p4, None, None, None, None, 0.0, scale, band, sink, max_register_block, tile)


def softmax_dropout_fwd(
    x4: torch.Tensor,
    seed: torch.Tensor,
    p: float,
    scale: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    band: Optional[tuple[int, int]] = None,
    offset: Optional[torch.Tensor] = None,
    max_register_block: Optional[int] = None,
    tile: Optional[Tile] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Launch the forward kernel with the attention dropout fused: z = k·softmax/(1 - p').

    Args:
        x4, scale, mask, band, offset, max_register_block, tile: as :func:`softmax_fwd`.
        seed: int64 [1] Philox key on x4's device (:func:`~fusedlib.kernels.bias_dropout_add.philox_seed`).
        p: dropout probability in [0, 1); applied as p' = round(p·2^16)/2^16, kept values
            scaled by 1/(1 - p') (chapter 2's :func:`~fusedlib.kernels.bias_dropout_add.drop_threshold`
            and :func:`~fusedlib.kernels.bias_dropout_add.dropout_scale`).

    Returns:
        ``(z, p_sink, stats)``: z a new contiguous tensor of x4's shape and dtype (dropped
        probabilities are exactly 0); p_sink as :func:`softmax_fwd` (undropped: the sink's
        probability is not an output); stats [2, b·np·sq] in the compute dtype: each row's
        subtracted max m, then its 1/D (0 for a row that kept nothing), for
        :func:`softmax_dropout_bwd`. The keep mask is :func:`softmax_dropout_mask` of the seed.

    Source: fusedlib's own fusion of the softmax with the attention dropout that Megatron-LM
    ``megatron/core/transformer/dot_product_attention.py`` applies after it.
    """
    return _fwd(x4, scale, mask, band, offset, max_register_block, seed, p, tile)


def softmax_dropout_bwd(
    g4: torch.Tensor,
    x4: torch.Tensor,
    stats: torch.Tensor,
    seed: torch.Tensor,
    p: float,
    scale: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    band: Optional[tuple[int, int]] = None,
    sink: Optional[torch.Tensor] = None,
    max_register_block: Optional[int] = None,
    tile: Optional[Tile] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward of :func:`softmax_dropout_fwd`: the softmax p recomputed from x4
    and stats, the keep mask k regenerated from the seed, then with g' = g·k/(1 - p'):
    dx = scale·p·(g' - sum(g'·p)).

    Args:
        g4: gradient of z, [b, np, sq, sk], any strides; read, never written.
        x4: the forward's scores (same tensor, same strides), read again.
        stats: the forward's [2, b·np·sq] row statistics.
        seed, p, scale, mask, band: the forward's.
        sink: the forward's p_sink when it had an offset, else None.
        max_register_block, tile: as :func:`softmax_fwd`.

    Returns:
        ``(dx, d_offset_rows)`` as :func:`softmax_bwd`; dx in x4's dtype.

    Source: fusedlib's own; the mask regenerated from the seed as in Dao, "FlashAttention-2" (2023).
    """
    return _bwd(g4, None, x4, mask, stats, seed, p, scale, band, sink, max_register_block, tile)


def softmax_dropout_mask(seed: torch.Tensor, shape: tuple[int, int, int, int], p: float) -> torch.Tensor:
    """The keep mask :func:`softmax_dropout_fwd` draws for ``seed`` on scores of ``shape``: for
    tests and the book (the fused op never writes it).

    Element (b, h, q, j) is row r = (b·np + h)·sq + q, column j of chapter 2's mask
    (:func:`~fusedlib.kernels.bias_dropout_add.dropout_mask`), a function of (seed, r, j) only.

    Args:
        seed: int64 [1] Philox key on the device to run on.
        shape: the scores' shape [b, np, sq, sk].
        p: dropout probability in [0, 1].

    Returns:
        bool [b, np, sq, sk] on ``seed``'s device: True where the probability is kept.

    Source: fusedlib's own (the kernels' Philox-4x32-10 draw, Salmon et al., SC 2011).
    """
    B, H, SQ, SK = shape
    return dropout_mask(seed, B * H * SQ, SK, p).view(B, H, SQ, SK)  # [b·np·sq, sk] -> [b, np, sq, sk]
