"""Triton kernels for LayerNorm and RMSNorm, forward and backward.

One row of ``n_cols`` elements is normalized at a time, held whole in registers
(``BLOCK_N`` = the next power of two >= n_cols, up to 64 Ki elements), so each element
of x is read from memory once and each element of y written once. (The backward holds
whole rows too, except the split backward for long rows, below.)

Forward (per row; LayerNorm, then RMSNorm where it differs)::

    mean  = sum(x) / N                                  (RMSNorm: no mean)
    var   = sum((x - mean)^2) / N                       (RMSNorm: sum(x^2) / N)
    rstd  = 1 / sqrt(var + eps)
    x_hat = (x - mean) * rstd                           (RMSNorm: x * rstd)
    y     = gamma * x_hat + beta                        (RMSNorm: no beta)

with ``gamma = w``, or ``gamma = w + 1`` for a zero-centered weight, added in the
compute dtype. ``mean`` and ``rstd`` are written per row (8 bytes against the row's
2·N bytes in bf16) so the backward need not recompute them.

Backward, with ``g = gamma * dy`` (derived in chapter 4)::

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N                                     (RMSNorm: c2 = 0)
    dx = (g - (x_hat * c1 + c2)) * rstd
    dgamma = sum over rows of dy * x_hat                (= dw, also with w + 1)
    dbeta  = sum over rows of dy

Rows of zero variance (a constant row, and every row for h = 1) have rstd = 1/sqrt(eps),
which multiplies any rounding in x_hat or in ``g - c2`` by 316 (eps = 1e-5). The forward
therefore sums the row shifted by its first element, mean = k + sum(x - k) / N with k = x[0]
(the shifted-data mean), which gives a constant row its value exactly (x - k = 0): x_hat = 0,
y = beta, and the backward's x - mean = 0 too. The variance is then summed about that mean
(two passes over the registers, two reductions, no cancellation). For h = 1 the
LayerNorm backward stores dx = 0, the exact gradient (y = beta does not depend on x).
For h > 1 such a row's dx = rstd * (g - c2) is not 0, and its rounding error is that of
``g - c2`` times rstd.

``memory_efficient``: the backward reads the saved *output* y instead of x and recovers
``x_hat = (y - beta) / gamma``; y is usually kept alive by the next layer anyway, so x
need not be saved (Apex's ``memory_efficient=True``). It needs every gamma != 0: where a
gamma is exactly 0, y = beta there and x_hat is lost, so the backward gives NaN (dgamma of
that column, and dx, whose row sums take in every column), never a wrong finite value; the
forward kernel reports such a column (``CHECK_GAMMA``) without a host sync.
y is rounded to its dtype, so the recovered x_hat errs by about 0.5 ulp(y) / |gamma| more than
x_hat from x (chapter 4 derives the bound on dgamma and dx).

Long rows (BLOCK_N above 8 Ki, LayerNorm; above 16 Ki, RMSNorm) take a *split* backward:
:func:`_norm_bwd_row_stats_kernel` first reads dy and x and writes c1 and c2 per row, then
the backward kernel runs a 2-D grid whose programs each take BLOCK_N columns of
their rows and read c1, c2 instead of summing the row. That is 5 passes over the
activations instead of 3, but a program holds 1 Ki columns instead of a whole row, so
eight share an SM; one program per SM holding a 16 Ki row was slower (H200, h = 16384:
0.367 ms split against 0.484 ms, BWD_TILES). A backward tile whose BLOCK_N is less than the
row's next power of two takes the split backward.

dgamma and dbeta are reduced in two deterministic stages, without atomics: each backward
program loops over ``rows_per_program`` rows and keeps its own partial sums in
registers (float32), stores them as row ``pid`` of a ``[2, n_programs, n_cols]`` buffer
(dgamma, dbeta), and :func:`_norm_bwd_reduce_kernel` sums its columns in a fixed order.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so
``torch.autograd.gradcheck`` checks these kernels), store y and dx in x's dtype; row
statistics and the dgamma/dbeta partials in float32, the final dgamma/dbeta in w's dtype.

Sources: Triton's layer-norm tutorial ``python/tutorials/05-layer-norm.py`` (the
dx formula and the two-stage dgamma/dbeta); Apex ``apex/contrib/csrc/layer_norm``
(persistent row-in-registers kernels, ``memory_efficient``); Megatron-LM
``megatron/core/fusions/fused_layer_norm.py``; Ba et al. 2016, "Layer Normalization",
arXiv:1607.06450; Zhang & Sennrich 2019, "Root Mean Square Layer Normalization",
arXiv:1910.07467.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..runtime import (
    DeviceCheck, Planned, find_plan, launch_planned, param_key, plan_cache, planned, remember_plan, spec_key,
    tensor_key,
)
from .bias_dropout_add import _keep_mask, bias_dropout_add_bwd, drop_threshold, dropout_scale
from .launch import (
    FOLD_TILES,
    MAX_FUSED_SIZE,
    TL_DTYPE,
    Tile,
    TileTable,
    acc_dtype,
    as_rows,
    cdiv,
    empty_contiguous_like,
    next_power_of_2,
    persistent_grid,
    pick,
)

__all__ = [
    "norm_fwd",
    "norm_bwd",
    "bias_dropout_add_norm_fwd",
    "bias_dropout_add_norm_bwd",
    "BDA_FWD_TILES",
    "BDA_BWD_IN_NORM",
    "FWD_TILES",
    "BWD_TILES",
    "RMS_BWD_TILES",
    "MAX_HIDDEN_SIZE",
]

#: Largest hidden size the kernels take: one row must fit in one program's registers.
MAX_HIDDEN_SIZE: int = MAX_FUSED_SIZE


#: The smallest |gamma| the memory-efficient backward takes: float32's smallest normal number
#: (1 / gamma is then finite in float32; below it the forward's check reports the column).
GAMMA_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _div_n(total, n, ACC: tl.constexpr):
    """``total / n`` rounded as IEEE division does. A GPU's default float32 division is an
    approximation (within 2 ulp): for h = 1 it left ``g - sum(g) / 1`` a few ulp from 0,
    which ``rstd = 1 / sqrt(eps)`` then scaled to 1e-5 (seen on the H200)."""
    if ACC == tl.float64:
        q = total / n  # float64 division is IEEE already (div_rn takes float32 only)
    else:
        q = tl.math.div_rn(total, tl.zeros_like(total) + n)
    return q


@triton.jit(do_not_specialize=["T"])
def _norm_fwd_kernel(
    X_ptr,  # input x, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    Y_ptr,  # output y, [n_rows, n_cols], contiguous, x's dtype
    W_ptr,  # weight w, [n_cols], contiguous: gamma = w, or w + 1 if ZERO_CENTERED_GAMMA
    B_ptr,  # bias beta, [n_cols], contiguous (read only if HAS_BIAS)
    MEAN_ptr,  # ACC [n_rows]: row means (written only for LayerNorm, with STORE_STATS)
    RSTD_ptr,  # ACC [n_rows]: row 1 / sqrt(var + eps) (written only with STORE_STATS)
    ERR_ptr,  # int64 [1], only with CHECK_GAMMA: 1 + the index of a column whose |gamma| < GAMMA_MIN
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    eps,
    rows_per_program,  # rows this program normalizes, a multiple of BLOCK_M
    LB_ptr,  # ADD_IN: the sublayer's bias, [n_cols], contiguous (read only if HAS_LB)
    R_ptr,  # ADD_IN: the residual, [n_rows, n_cols], strides (R_row_stride, R_col_stride)
    H_ptr,  # ADD_IN: out, h = residual + dropout(x + lb), [n_rows, n_cols], contiguous, the residual's dtype
    SEED_ptr,  # ADD_IN and DROPOUT: int64 [1], the Philox key
    R_row_stride,
    R_col_stride,
    T,  # ADD_IN and DROPOUT: drop threshold round(p·2^16)
    scale,  # ADD_IN and DROPOUT: 1/(1 - p'), float32
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row
    IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED_GAMMA: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the row loop (1: none)
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
    CHECK_GAMMA: tl.constexpr,  # memory-efficient backward ahead: report a gamma that is 0 or subnormal
    ADD_IN: tl.constexpr,  # x is a sublayer's output: normalize h = residual + dropout(x + lb), and store h
    HAS_LB: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_STATS: tl.constexpr,  # a backward will run: store mean and rstd for it
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if CHECK_GAMMA:
        # The memory-efficient backward divides by gamma (x_hat = (y - beta) / gamma): a gamma
        # of 0 gives NaN there, and so does a subnormal one (1 / gamma overflows float32; a GPU
        # flushes it to 0). Program 0 reports such a column (as 1 + its index, never 0).
        g0 = tl.load(W_ptr + cols, mask=col_mask, other=1.0).to(ACC)
        if ZERO_CENTERED_GAMMA:
            g0 = g0 + 1.0
        first = (tl.zeros_like(cols) + pid) == 0  # program 0, as a [BLOCK_N] mask
        tl.store(ERR_ptr + tl.zeros_like(cols), cols.to(tl.int64) + 1, mask=(tl.abs(g0) < GAMMA_MIN) & col_mask & first)
    row_start = pid.to(tl.int64) * rows_per_program  # int64: n_rows * n_cols may pass 2^31
    for m in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride,
                    mask=mask, other=0.0).to(ACC)
        if ADD_IN:
            # the bias-dropout-add kernel's arithmetic, in its order: v = x + lb, dropped or scaled,
            # h = residual + v rounded to the residual's dtype, stored (the same bits interpreted;
            # compiled, that kernel's v·scale + residual may be one fused multiply-add); the norm
            # then takes h as it was stored, as the next kernel would have read it
            res = tl.load(R_ptr + rows[:, None] * R_row_stride + cols[None, :] * R_col_stride, mask=mask, other=0.0)
            if HAS_LB:
                x += tl.load(LB_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
            if DROPOUT:
                keep = _keep_mask(tl.load(SEED_ptr), rows, 0, T, BLOCK_M, BLOCK_N)
                # dropped: x - x, 0 for a finite x and NaN for a NaN or inf one (torch: x·mask); the
                # form that timed like a select of 0 in this kernel. ACC even for a float64 scale (Inductor)
                x = tl.where(keep, x * scale, x - x).to(ACC)
            h = (res.to(ACC) + x).to(H_ptr.dtype.element_ty)
            tl.store(H_ptr + rows[:, None] * n_cols + cols[None, :], h, mask=mask)
            x = h.to(ACC)  # 0 in the padding columns (every load there gave 0); padding rows are never stored
        # row statistics, [BLOCK_M]
        if IS_RMS_NORM:
            x_c = x
        else:
            # the shifted-data mean (module docstring): k = x[row, 0], a second load of one
            # cached element (with ADD_IN h's first column, taken from the registers); a
            # constant row gets mean = k exactly, so x - mean = 0 below
            if ADD_IN:
                k = tl.sum(tl.where(cols[None, :] == 0, x, 0.0), axis=1)
            else:
                k = tl.load(X_ptr + rows * X_row_stride, mask=row_mask, other=0.0).to(ACC)
            mean = k + _div_n(tl.sum(tl.where(mask, x - k[:, None], 0.0), axis=1), n_cols, ACC)
            if STORE_STATS:
                tl.store(MEAN_ptr + rows, mean, mask=row_mask)
            x_c = tl.where(mask, x - mean[:, None], 0.0)  # padding columns must add 0 to var
        var = _div_n(tl.sum(x_c * x_c, axis=1), n_cols, ACC)
        rstd = 1.0 / tl.sqrt(var + eps)
        if STORE_STATS:
            tl.store(RSTD_ptr + rows, rstd, mask=row_mask)
        # normalize, scale, shift. gamma and beta are loaded here, not before the loop: kept
        # in registers through the reductions they would cost occupancy; reloads hit the cache
        gamma = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(ACC)
        if ZERO_CENTERED_GAMMA:
            gamma = gamma + 1.0  # in ACC: a weight near 0 keeps its precision
        x_hat = x_c * rstd[:, None]
        y = x_hat * gamma[None, :]
        if HAS_BIAS:
            y = y + tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        tl.store(Y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gamma_terms(W_ptr, B_ptr, cols, col_mask, HAS_BIAS: tl.constexpr, ZERO_CENTERED_GAMMA: tl.constexpr,
                 MEMORY_EFFICIENT: tl.constexpr, ACC: tl.constexpr):
    """(gamma, 1 / gamma, beta) at ``cols`` for the backward; the last two are only formed
    with MEMORY_EFFICIENT (else gamma stands in for them, unused). Padding columns get
    gamma = 1 in the reciprocal, so that 0 / 0 never happens."""
    gamma = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(ACC)
    if ZERO_CENTERED_GAMMA:
        gamma = gamma + 1.0  # in ACC: a weight near 0 keeps its precision
    rgamma = gamma
    beta = gamma
    if MEMORY_EFFICIENT:
        rgamma = 1.0 / tl.where(col_mask, gamma, 1.0)
        if HAS_BIAS:
            beta = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)
    return gamma, rgamma, beta


@triton.jit
def _x_hat(x, mask, rows, row_mask, rgamma, beta, MEAN_ptr, rstd,
           IS_RMS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, MEMORY_EFFICIENT: tl.constexpr):
    """x_hat of a [BLOCK_M, BLOCK_N] tile, 0 outside ``mask``: from x and the saved row
    statistics, or with MEMORY_EFFICIENT from y as (y - beta) / gamma (``rgamma`` = 1 / gamma)."""
    if MEMORY_EFFICIENT:
        if HAS_BIAS:
            x_hat = tl.where(mask, (x - beta[None, :]) * rgamma[None, :], 0.0)
        else:
            x_hat = tl.where(mask, x * rgamma[None, :], 0.0)
    elif IS_RMS_NORM:
        x_hat = x * rstd[:, None]
    else:
        mean = tl.load(MEAN_ptr + rows, mask=row_mask, other=0.0)
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return x_hat


@triton.jit
def _norm_bwd_row_stats_kernel(
    DY_ptr,  # grad of the output dy, [n_rows, n_cols], strides (DY_row_stride, DY_col_stride)
    X_ptr,  # saved input x, or saved output y if MEMORY_EFFICIENT, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    W_ptr,  # weight w, [n_cols], contiguous: gamma = w, or w + 1 if ZERO_CENTERED_GAMMA
    B_ptr,  # bias beta, [n_cols], contiguous (read only if MEMORY_EFFICIENT and HAS_BIAS)
    MEAN_ptr,  # ACC [n_rows]: row means (read only for LayerNorm, not MEMORY_EFFICIENT)
    RSTD_ptr,  # ACC [n_rows]: row 1 / sqrt(var + eps)
    C_ptr,  # ACC [2, n_rows] out: c1 = sum(x_hat * g) / N ([0]) and c2 = sum(g) / N ([1], LayerNorm only)
    n_rows,
    n_cols,
    DY_row_stride,
    DY_col_stride,
    X_row_stride,
    X_col_stride,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per loop step
    IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED_GAMMA: tl.constexpr,
    MEMORY_EFFICIENT: tl.constexpr,
    ACC: tl.constexpr,
):
    # Long rows, first of two kernels: the two row sums of dx's formula, one read of dy and x.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
    c1_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    c2_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * DY_row_stride + cols[None, :] * DY_col_stride,
                     mask=mask, other=0.0).to(ACC)
        x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride,
                    mask=mask, other=0.0).to(ACC)
        gamma, rgamma, beta = _gamma_terms(W_ptr, B_ptr, cols, col_mask, HAS_BIAS, ZERO_CENTERED_GAMMA,
                                           MEMORY_EFFICIENT, ACC)
        x_hat = _x_hat(x, mask, rows, row_mask, rgamma, beta, MEAN_ptr, rstd,
                       IS_RMS_NORM, HAS_BIAS, MEMORY_EFFICIENT)
        g = gamma[None, :] * dy
        c1_acc += x_hat * g
        if not IS_RMS_NORM:
            c2_acc += g
    tl.store(C_ptr + rows, _div_n(tl.sum(c1_acc, axis=1), n_cols, ACC), mask=row_mask)
    if not IS_RMS_NORM:
        tl.store(C_ptr + n_rows + rows, _div_n(tl.sum(c2_acc, axis=1), n_cols, ACC), mask=row_mask)


@triton.jit(do_not_specialize=["T"])
def _norm_bwd_kernel(
    DY_ptr,  # grad of the output dy, [n_rows, n_cols], strides (DY_row_stride, DY_col_stride)
    X_ptr,  # saved input x, or saved output y if MEMORY_EFFICIENT, [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    W_ptr,  # weight w, [n_cols], contiguous: gamma = w, or w + 1 if ZERO_CENTERED_GAMMA
    B_ptr,  # bias beta, [n_cols], contiguous (read only if MEMORY_EFFICIENT and HAS_BIAS)
    MEAN_ptr,  # ACC [n_rows]: row means (read only for LayerNorm, not MEMORY_EFFICIENT)
    RSTD_ptr,  # ACC [n_rows]: row 1 / sqrt(var + eps)
    C_ptr,  # ACC [2, n_rows]: c1 and c2 per row from _norm_bwd_row_stats_kernel (read only if SPLIT)
    DX_ptr,  # grad of x, [n_rows, n_cols], contiguous, x's dtype
    PARTIAL_ptr,  # ACC [1-3, n_programs, n_cols]: per program, its rows' sums of dy * x_hat ([0]), dy ([1], HAS_BIAS) and x_in's gradient ([DLB_ROW], HAS_DLB) (one program: the sums, in w's dtype)
    DRES_ptr,  # x's other gradient (the residual's), [n_rows, n_cols], strides (DRES_row_stride, DRES_col_stride); read only if HAS_DRES
    n_rows,
    n_cols,
    DY_row_stride,
    DY_col_stride,
    X_row_stride,
    X_col_stride,
    DRES_row_stride,
    DRES_col_stride,
    rows_per_program,  # rows this program handles, a multiple of BLOCK_M
    DXIN_ptr,  # DROPOUT: grad of the sublayer output, dx·keep·scale, [n_rows, n_cols], contiguous, its dtype
    SEED_ptr,  # DROPOUT: int64 [1], the forward's Philox key
    T,  # DROPOUT: drop threshold, as in the forward
    scale,  # DROPOUT: 1/(1 - p'), float32
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # the whole row (next power of two >= n_cols), or with SPLIT this program's columns
    IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED_GAMMA: tl.constexpr,
    MEMORY_EFFICIENT: tl.constexpr,  # X_ptr holds y: recover x_hat = (y - beta) / gamma
    SPLIT: tl.constexpr,  # long rows: program (i, j) takes columns j·BLOCK_N.. of its rows; c1, c2 are read
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the row loop (1: none)
    ACC: tl.constexpr,  # compute and accumulation dtype: float32, or float64 for float64 inputs
    HAS_DRES: tl.constexpr,  # add the residual's gradient to dx (x also feeds a residual connection)
    HAS_DLB: tl.constexpr,  # x was h = residual + dropout(x_in + lb): sum x_in's gradient over rows (lb's)
    DLB_ROW: tl.constexpr,  # HAS_DLB: the index of lb's partial sums in PARTIAL_ptr (after dgamma, dbeta)
    DROPOUT: tl.constexpr,  # x_in's gradient is dx·keep·scale, the forward's mask regenerated
    STORE_DXIN: tl.constexpr,  # store x_in's gradient (with DROPOUT; without, it is dx itself)
):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # program_id(1) is 0 without SPLIT
    col_mask = cols < n_cols
    # gamma (and for MEMORY_EFFICIENT 1 / gamma and beta), once per program
    gamma, rgamma, beta = _gamma_terms(W_ptr, B_ptr, cols, col_mask, HAS_BIAS, ZERO_CENTERED_GAMMA,
                                       MEMORY_EFFICIENT, ACC)
    # per-program partial sums of dgamma and dbeta, kept per row of the tile and summed
    # over the tile's rows once, after the loop
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    if HAS_BIAS:
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    if HAS_DLB:
        dlb_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    if DROPOUT:
        seed = tl.load(SEED_ptr)
    row_start = pid.to(tl.int64) * rows_per_program
    for m in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * DY_row_stride + cols[None, :] * DY_col_stride,
                     mask=mask, other=0.0).to(ACC)  # padding: dy = 0, so it adds nothing below
        x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :] * X_col_stride,
                    mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
        x_hat = _x_hat(x, mask, rows, row_mask, rgamma, beta, MEAN_ptr, rstd,
                       IS_RMS_NORM, HAS_BIAS, MEMORY_EFFICIENT)  # [BLOCK_M, BLOCK_N], 0 in the padding
        # dx = (g - (x_hat * c1 + c2)) * rstd, g = gamma * dy
        g = gamma[None, :] * dy
        if SPLIT:
            c1 = tl.load(C_ptr + rows, mask=row_mask, other=0.0)
        else:
            c1 = _div_n(tl.sum(x_hat * g, axis=1), n_cols, ACC)
        if IS_RMS_NORM:
            dx = (g - x_hat * c1[:, None]) * rstd[:, None]
        else:
            if SPLIT:
                c2 = tl.load(C_ptr + n_rows + rows, mask=row_mask, other=0.0)
            else:
                c2 = _div_n(tl.sum(g, axis=1), n_cols, ACC)
            dx = (g - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if n_cols == 1:
                # one element: x_hat = 0 and y = beta whatever x, so dx = 0 exactly. The
                # formula gives g - c2 = 0 only if g is rounded once: compiled, gamma * dy may
                # be contracted into the subtraction (fma(gamma, dy, -c2), the exact product
                # minus the rounded one), and rstd = 1 / sqrt(eps) magnified that rounding
                # error (seen on the H200). Times 0, not zeros: a NaN or inf in x or dy (or
                # eps = 0, rstd = inf) stays NaN, as torch's layer_norm gives
                dx = dx * 0.0
        if HAS_DRES:  # x's two gradients summed in ACC, rounded once (autograd would round twice)
            dx += tl.load(DRES_ptr + rows[:, None] * DRES_row_stride + cols[None, :] * DRES_col_stride,
                          mask=mask, other=0.0).to(ACC)
        dx = dx.to(DX_ptr.dtype.element_ty)
        tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx, mask=mask)
        if HAS_DLB or STORE_DXIN:
            # the bias-dropout-add backward on the stored dx (its gradient g, the same bits):
            # x_in's gradient is g·keep·scale, or g itself without dropout, and lb's its column sum
            dxin = dx.to(ACC)
            if DROPOUT:
                keep = _keep_mask(seed, rows, tl.program_id(1), T, BLOCK_M, BLOCK_N)  # the forward's mask
                # .to(ACC): Inductor passes scale as a float64 constant, which would make dxin, and
                # the loop-carried dlb_acc, float64
                # dropped: dxin·0 (NaN for a NaN or inf dxin, as torch's dropout); of the forms
                # timed, the one that cost this kernel least against a select of 0
                dxin = (tl.where(keep, dxin, dxin * 0.0) * scale).to(ACC)
            if STORE_DXIN:
                tl.store(DXIN_ptr + rows[:, None] * n_cols + cols[None, :], dxin.to(DXIN_ptr.dtype.element_ty),
                         mask=mask)
            if HAS_DLB:
                dlb_acc += dxin  # masked lanes hold 0
        # first stage of dgamma / dbeta: accumulate over this program's rows
        dw_acc += dy * x_hat
        if HAS_BIAS:
            db_acc += dy
    tl.store(PARTIAL_ptr + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(PARTIAL_ptr + (tl.num_programs(0) + pid) * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    if HAS_DLB:
        tl.store(PARTIAL_ptr + (DLB_ROW * tl.num_programs(0) + pid) * n_cols + cols, tl.sum(dlb_acc, axis=0),
                 mask=col_mask)


@triton.jit
def _norm_bwd_reduce_kernel(
    PARTIAL_ptr,  # ACC [1-3, n_partials, n_cols]: per-program partial sums of dgamma ([0]), dbeta ([1]), dlb ([DLB_ROW])
    DW_ptr,  # dgamma, [n_cols], w's dtype
    DB_ptr,  # dbeta, [n_cols], b's dtype (written only if HAS_BIAS)
    DLB_ptr,  # HAS_DLB: the sublayer bias's gradient, [n_cols], its dtype
    n_partials,
    n_cols,
    BLOCK_P: tl.constexpr,  # partial rows summed per step
    BLOCK_N: tl.constexpr,  # columns per program
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    HAS_DLB: tl.constexpr,
    DLB_ROW: tl.constexpr,  # HAS_DLB: the index of its partials
):
    # second stage: sum the [n_partials, n_cols] partials over their rows, in a fixed order
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_P, BLOCK_N), dtype=ACC)
    db = tl.zeros((BLOCK_P, BLOCK_N), dtype=ACC)
    dlb = tl.zeros((BLOCK_P, BLOCK_N), dtype=ACC)
    for p in range(0, n_partials, BLOCK_P):
        prow = p + tl.arange(0, BLOCK_P)
        mask = (prow < n_partials)[:, None] & col_mask[None, :]
        offs = prow[:, None].to(tl.int64) * n_cols + cols[None, :]
        dw += tl.load(PARTIAL_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(PARTIAL_ptr + n_partials * n_cols + offs, mask=mask, other=0.0)
        if HAS_DLB:
            dlb += tl.load(PARTIAL_ptr + DLB_ROW * n_partials * n_cols + offs, mask=mask, other=0.0)
    tl.store(DW_ptr + cols, tl.sum(dw, axis=0).to(DW_ptr.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_ptr + cols, tl.sum(db, axis=0).to(DB_ptr.dtype.element_ty), mask=col_mask)
    if HAS_DLB:
        tl.store(DLB_ptr + cols, tl.sum(dlb, axis=0).to(DLB_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------
# Launch settings
# ----------------------------------------------------------------------------------------


# Tiles (fusedlib.kernels.launch.Tile) as the norms read them:
#   BLOCK_M          rows per tile (several for short rows, so a program moves enough bytes);
#   BLOCK_N          0: the whole row (the next power of two >= h); the backward's tiles for
#                    long rows give fewer columns, which runs the split backward (above);
#   num_warps        warps per program;
#   num_stages       software-pipelining depth of the row loop (1: none);
#   programs_per_sm  0: one program per tile of BLOCK_M rows; k > 0: a persistent grid of k
#                    programs per SM, each looping over rows (the backward always loops: its
#                    dgamma/dbeta partials are one row per program). A split backward's
#                    k · SMs programs are shared among the ceil(h / BLOCK_N) column blocks.
#
# Forward settings per row length, as (upper bound of h, Tile); the bounds are powers of two,
# so a row length and its BLOCK_N take the same row. Aim: about 16-32 elements per thread (two
# to four 16-byte bf16 vectors), one tile per program so the hardware scheduler keeps several
# rows in flight per SM (h = 4096: 40 registers per thread at 8 warps, 6 programs per SM);
# short rows take several rows per tile. Compiled for sm_90 with no register spills
# (tools/check_norm_registers.py).
FWD_TILES: TileTable = (
    (128, Tile(BLOCK_M=32, BLOCK_N=0, num_warps=4, num_stages=1, programs_per_sm=0)),
    (512, Tile(BLOCK_M=8, BLOCK_N=0, num_warps=4, num_stages=1, programs_per_sm=0)),
    (1024, Tile(BLOCK_M=4, BLOCK_N=0, num_warps=4, num_stages=1, programs_per_sm=0)),
    (2048, Tile(BLOCK_M=2, BLOCK_N=0, num_warps=4, num_stages=1, programs_per_sm=0)),
    (4096, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=8, num_stages=1, programs_per_sm=0)),
    (8192, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=8, num_stages=1, programs_per_sm=0)),
    # h = 12288 and 16384, bf16 on the H200: 0.164 / 0.142 ms at 8 warps, one row per
    # program, against 0.172 / 0.152 for a persistent grid of 16 warps (measured with the
    # tuner that `python -m fusedlib.bench.tune --op layer_norm` replaced)
    (16384, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=8, num_stages=1, programs_per_sm=0)),
    # 32 Ki: a persistent grid that loads the next row (192 KiB of shared memory) while
    # reducing this one keeps the memory busy with one program per SM
    (32768, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=32, num_stages=2, programs_per_sm=1)),
    (MAX_HIDDEN_SIZE, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=32, num_stages=1, programs_per_sm=0)),
)

# Backward settings per row length, as (upper bound of h, Tile). A persistent grid: each
# program holds gamma and its float32 partial sums (dgamma, dbeta) in registers across all
# its rows, so registers, not bandwidth, bound the tile: about 16 elements per thread per
# array. Pipelining (num_stages) loads the next rows of x and dy into shared memory while
# the current ones are reduced. Rows of more than 8 Ki elements do not fit a program's
# registers with room for the pipeline (5 arrays of 16 Ki values at 16 Ki), so LayerNorm's
# take the split backward (BLOCK_N = 1024 columns per program).
BWD_TILES: TileTable = (
    (128, Tile(BLOCK_M=16, BLOCK_N=0, num_warps=4, num_stages=2, programs_per_sm=4)),
    # h = 384, 32768 rows, bf16, LayerNorm with the residual's gradient added (as in a transformer
    # layer), CUDA-graph replays on the H200: 0.0388 ms at 2 warps and 3 stages, against 0.0564
    # for 4 warps and 3 stages and 0.042 for [8 rows, 4 warps] at 2 per SM
    (512, Tile(BLOCK_M=4, BLOCK_N=0, num_warps=2, num_stages=3, programs_per_sm=4)),
    # measured, bf16 on the H200, kernel alone (the tuner that `python -m fusedlib.bench.tune
    # --op layer_norm` replaced), LayerNorm / RMSNorm:
    # h = 1024: 0.230 / 0.213 ms (2 stages: 0.265 / 0.241)
    (1024, Tile(BLOCK_M=2, BLOCK_N=0, num_warps=4, num_stages=3, programs_per_sm=4)),
    # h = 2048: 0.213 / 0.214 ms (2 stages: 0.260 / 0.240)
    (2048, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=4, num_stages=3, programs_per_sm=4)),
    # h = 4096: 0.212 / 0.210 ms (1 row x 8 warps at 2 per SM, 2 stages: 0.271 / 0.255)
    (4096, Tile(BLOCK_M=2, BLOCK_N=0, num_warps=8, num_stages=3, programs_per_sm=1)),
    # h = 8192: 0.215 / 0.210 ms (16 warps, 2 stages: 0.313 / 0.275)
    (8192, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=8, num_stages=3, programs_per_sm=1)),
    # h = 16384, LayerNorm: split, 1 Ki columns per program: 0.367 ms, against 0.484 for the
    # best one-kernel setting (16 warps, 1 per SM, 2 stages) and 0.628 for 32 warps
    (16384, Tile(BLOCK_M=1, BLOCK_N=1024, num_warps=4, num_stages=2, programs_per_sm=8)),
    (MAX_HIDDEN_SIZE, Tile(BLOCK_M=1, BLOCK_N=1024, num_warps=4, num_stages=2, programs_per_sm=8)),
)

# RMSNorm's backward: LayerNorm's, except for rows of 8 Ki to 16 Ki. It holds one array less
# per program (no dbeta partials), so a whole row of 16 Ki still fits one program per SM:
# 0.302 ms at h = 16384, against 0.338 split.
RMS_BWD_TILES: TileTable = tuple(
    (bound, Tile(BLOCK_M=1, BLOCK_N=0, num_warps=16, num_stages=1, programs_per_sm=1) if bound == 16384 else tile)
    for bound, tile in BWD_TILES
)

# bias_dropout_add_norm_fwd: FWD_TILES, except for rows of 257-512 (its kernel holds the
# residual and the sublayer's output too): [32768, 384] bf16 on the H200, CUDA-graph replays,
# 0.0316 ms for [4 rows, 2 warps] against 0.0357 for FWD_TILES's [8, 4 warps] (the two kernels
# apart: 0.0465); the best of 15 tiles of 2-32 rows at 1-8 warps.
# Rows of 16 Ki-32 Ki: FWD_TILES's pipelined persistent grid would stage the residual too, past
# an SM's shared memory (bf16 LayerNorm compiled for sm_90: 327,816 bytes against 232,448); one
# stage there.
BDA_FWD_TILES: TileTable = tuple(
    (bound, Tile(BLOCK_M=4, BLOCK_N=0, num_warps=2, num_stages=1, programs_per_sm=0) if bound == 512
     else replace(tile, num_stages=1) if tile.num_stages > 1 else tile)
    for bound, tile in FWD_TILES
)

# bias_dropout_add_norm_bwd: whether the norm's backward kernel also writes x's gradient and sums
# the sublayer bias's (True), or the bias-dropout-add backward kernel reads the norm's dx back
# (False), as (upper bound of h, bool); longer rows: False. The partial sums hold another float32
# array per program, which costs the norm's kernel occupancy; worth it only where the read it
# saves is the larger cost. bf16 on the H200, CUDA-graph replays, in the norm / apart: [32768, 384]
# 0.0504 / 0.0493 ms at p = 0 (0.0616 / 0.0578 at p = 0.1); [32768, 4096] 0.3215 / 0.3447 (0.4181 /
# 0.4228); at [32768, 1024] and [16384, 8192] the whole fwd+bwd with the column sum in the norm
# was 0.2255 / 0.2232 and 0.8357 / 0.7542 (the op's benchmark before this table, NOTES.md). Rows between
# these lengths are not measured: 1025-2048 follow 1024, 2049-4096 follow 4096.
BDA_BWD_IN_NORM: tuple[tuple[int, bool], ...] = (
    (2048, False),
    (4096, True),
)


# Second stage, per device type: a [BLOCK_M, BLOCK_N] float32 tile of partials per loop step.
# GPU: 32 columns per program (128 programs for h = 4096) and 128 partial rows per step (16
# KiB per buffer), so the 132 partial rows of h = 4096 take 2 steps: the kernel is a few
# microseconds of latency, not bandwidth. CPU interpreter: programs run one by one, so few
# wide ones. BLOCK_N is capped at the backward's column block.
_REDUCE_TILES: dict[str, Tile] = {"cuda": Tile(BLOCK_M=128, BLOCK_N=32, num_warps=4),
                                  "cpu": Tile(BLOCK_M=8, BLOCK_N=4096, num_warps=4)}

# Row sums of the split backward, per device type: one row per program, 4 Ki columns per step
# at 8 warps (16 elements per thread per array); BLOCK_N capped at the row's next power of two.
_ROW_STATS_TILES: dict[str, Tile] = {"cuda": Tile(BLOCK_M=1, BLOCK_N=4096, num_warps=8),
                                     "cpu": Tile(BLOCK_M=1, BLOCK_N=4096, num_warps=1)}


# ----------------------------------------------------------------------------------------
# Host functions (no autograd, no argument checks beyond what the kernels need)
# ----------------------------------------------------------------------------------------


def norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *,
             rms_norm: bool, zero_centered_gamma: bool = False, tile: Optional[Tile] = None,
             gamma_check: Optional[DeviceCheck] = None, stats: bool = True
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch the forward kernel over the last dim of ``x``.

    Args:
        x: [..., h], float32/float16/bfloat16/float64, any strides; 1 <= h <= MAX_HIDDEN_SIZE.
        weight: [h], x's dtype, contiguous.
        bias: [h], x's dtype, contiguous, or None (always None for RMSNorm).
        eps: added to the variance (RMSNorm: to the mean square).
        rms_norm: RMSNorm instead of LayerNorm.
        zero_centered_gamma: gamma = weight + 1.
        tile: launch settings (None: ``pick(FWD_TILES, h)``); BLOCK_N must be 0 or cover
            the whole row.
        gamma_check: for a memory-efficient backward ahead, the op's
            :class:`~fusedlib.runtime.DeviceCheck`: the kernel stores 1 + the index of a
            column whose gamma is exactly 0 (reported at once on the CPU, lazily on CUDA).
        stats: store the row statistics for a backward (False: no backward will run, e.g.
            under ``torch.no_grad()``; mean and rstd are neither allocated nor written).

    Returns:
        ``(y, mean, rstd)``: y a new contiguous tensor of x's shape and dtype (not a view:
        its ``_base`` is None); mean (None for RMSNorm) and rstd float32 [rows] (float64
        for float64 x), rows = x.numel() // h; both None with ``stats=False``.

    Raises:
        ValueError: for h past MAX_HIDDEN_SIZE, or a tile narrower than the row; from
            ``gamma_check``, for a gamma of 0.

    Source: Triton's layer-norm tutorial ``python/tutorials/05-layer-norm.py``; Megatron-LM
    ``megatron/core/fusions/fused_layer_norm.py``; Ba et al. (2016); Zhang & Sennrich (2019).
    """
    y, mean, rstd, _, _, _ = _norm_fwd(x, weight, bias, eps, rms_norm, zero_centered_gamma, tile, gamma_check, stats)
    return y, mean, rstd


def bias_dropout_add_norm_fwd(x: torch.Tensor, linear_bias: Optional[torch.Tensor], residual: torch.Tensor,
                              seed: Optional[torch.Tensor], p: float, weight: torch.Tensor,
                              bias: Optional[torch.Tensor], eps: float, *, rms_norm: bool,
                              zero_centered_gamma: bool = False, tile: Optional[Tile] = None, stats: bool = True
                              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch the forward kernel on ``h = residual + dropout(x + linear_bias, p)``: one pass
    that writes h and its norm (the bias-dropout-add kernel's arithmetic and mask, then the norm
    of h as rounded to its dtype: the same bits as the two kernels one after the other).

    Args:
        x: a sublayer's output [..., h], any strides.
        linear_bias: its bias [h], contiguous, or None.
        residual: x's shape and dtype, any strides.
        seed: int64 [1] Philox key (:func:`~fusedlib.kernels.bias_dropout_add.philox_seed`),
            or None for no dropout.
        p: dropout probability in [0, 1] (ignored when ``seed`` is None).
        weight, bias, eps, rms_norm, zero_centered_gamma, tile, stats: as :func:`norm_fwd`
            (weight and bias of x's dtype).

    Returns:
        ``(y, h, mean, rstd)``: y = norm(h) and h, new contiguous tensors of x's shape and
        dtype; mean and rstd as :func:`norm_fwd`'s.

    Raises:
        ValueError: as :func:`norm_fwd`.

    Source: fusedlib's own fusion of Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``
    (``_bias_dropout_add_func``) with the norm of :func:`norm_fwd`.
    """
    y, mean, rstd, h, _, _ = _norm_fwd(x, weight, bias, eps, rms_norm, zero_centered_gamma, tile, None, stats,
                                       add_in=(linear_bias, residual, seed, p))
    return y, h, mean, rstd


# _norm_fwd's plans by input signature (:func:`_norm_fwd`; fusedlib.runtime.remember_plan)
_FWD_PLANS: dict[tuple, Planned] = plan_cache()


def _fwd_plan(x2d: torch.Tensor, rms_norm: bool, has_bias: bool, zero_centered_gamma: bool, tile: Optional[Tile],
              check_gamma: bool, stats: bool, add_in: Optional[tuple]) -> Planned:
    """The forward's launch for inputs like ``x2d`` (data: rows per program, and the dropout
    mask's threshold and scale, or (0, 1.0))."""
    n_rows, h = x2d.shape
    if tile is None:
        tile = pick(FWD_TILES if add_in is None else BDA_FWD_TILES, h)
    block_n = next_power_of_2(h)
    if 0 < tile.BLOCK_N < block_n:
        raise ValueError(f"the norms' forward holds whole rows: tile.BLOCK_N must be 0 or >= {block_n} "
                         f"for h = {h}, got {tile.BLOCK_N}")
    programs, rows_per_program = persistent_grid(n_rows, tile.BLOCK_M, tile.programs_per_sm, x2d.device)
    drop = (0, 1.0)
    if add_in is not None:
        linear_bias, _, seed, p = add_in
        dropout = seed is not None
        block_n = max(block_n, 8)  # the dropout mask takes columns 8 at a time (one Philox call)
        if dropout:
            drop = (drop_threshold(p), dropout_scale(p))
        flags = dict(ADD_IN=True, HAS_LB=linear_bias is not None, DROPOUT=dropout)
    else:
        flags = dict(ADD_IN=False, HAS_LB=False, DROPOUT=False)
    kwargs = dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=block_n, IS_RMS_NORM=rms_norm, HAS_BIAS=has_bias,
                  ZERO_CENTERED_GAMMA=zero_centered_gamma, NUM_STAGES=tile.num_stages,
                  ACC=TL_DTYPE[acc_dtype(x2d.dtype)], CHECK_GAMMA=check_gamma, **flags, STORE_STATS=stats,
                  num_warps=tile.num_warps)
    return planned(_norm_fwd_kernel, (programs,), x2d.device, kwargs, data=(rows_per_program, *drop))


def _fwd_key(x, weight, bias, eps, rms_norm, zero_centered_gamma, tile, err, stats, add_in, check
             ) -> Optional[tuple]:
    """:func:`_norm_fwd`'s plan key (for :func:`~fusedlib.runtime.find_plan`), or None for an eps
    that is not a Python float (only a float's value is fixed: another Real may change under the
    same identity; the check runs every call for it). The check itself is in the key: a plan
    made by an unchecked call (:func:`norm_fwd`) never lets a checked one skip its check."""
    if type(eps) is not float:
        return None
    key = (param_key(x), param_key(weight), param_key(bias), eps, rms_norm, zero_centered_gamma, tile,
           err is not None, stats, check)
    if add_in is not None:
        linear_bias, residual, seed, p = add_in
        key += (spec_key(linear_bias), tensor_key(residual), None if seed is None else (spec_key(seed), p))
    return key


def _norm_fwd(x, weight, bias, eps, rms_norm, zero_centered_gamma, tile, gamma_check, stats, add_in=None,
              check=None):
    """:func:`norm_fwd`, or with ``add_in = (linear_bias, residual, seed, p)``
    :func:`bias_dropout_add_norm_fwd`: ``(y, mean, rstd, h, weight, bias)`` (h None without
    ``add_in``; weight and bias as the kernel read them).

    The launch settings (tile, grid, constexprs, the bound launch) are a plan made once per
    input signature: everything that decides them and Triton's specialization of the launch
    (shapes, strides, dtypes, addresses modulo 16, the switches, the dropout probability), and
    everything an argument check reads (the parameters' shapes, strides and devices, eps: a
    Python float, or no plan is remembered).

    ``check``: the op's argument check, ``check(x, weight, bias, eps) -> (weight, bias)`` (the
    parameters as the kernel takes them: contiguous), raising for bad input. It runs only when
    no plan matches the call's signature, and a plan is remembered only for a signature that
    passed it: the check reads nothing the key does not hold, so a call whose signature
    matches passes it too, and skips it (a few microseconds of host time per call). Where the
    check copies a parameter (a non-contiguous weight) the plan is keyed by the copy's
    signature, and every such call checks again.
    """
    # the check's word, or None: no check compiled in (during a CUDA-graph capture before any
    # check buffer exists, or while torch.compile traces); the key says which
    try:
        err = gamma_check.word(x) if gamma_check is not None else None
    except AttributeError:  # not a tensor: the check says so
        err = None
    key_args = (x, weight, bias, eps, rms_norm, zero_centered_gamma, tile, err, stats, add_in, check)
    key, plan = find_plan(_FWD_PLANS, _fwd_key, *key_args)
    if plan is None and check is not None:
        checked = check(x, weight, bias, eps)
        if key is None or checked[0] is not weight or checked[1] is not bias:
            weight, bias = checked  # a copy's own signature, or none (a trace)
            key, plan = find_plan(_FWD_PLANS, _fwd_key, x, weight, bias, *key_args[3:])
    device = x.device
    x2d = as_rows(x)  # [..., h] -> [rows, h]
    n_rows = x2d.shape[0]
    y = empty_contiguous_like(x)  # written as [rows, h]
    h_out = empty_contiguous_like(x) if add_in is not None else None
    # two allocations, not one [2, rows] split in two: each view costs host time too; none
    # when no backward will run (each costs about as much host time as a launch's key)
    mean = rstd = None
    if stats:
        acc = acc_dtype(x.dtype)
        mean = None if rms_norm else torch.empty(n_rows, dtype=acc, device=device)
        rstd = torch.empty(n_rows, dtype=acc, device=device)
    spare = y if rstd is None else rstd  # stands in for the pointer arguments a launch leaves unread
    if n_rows == 0:
        return y, mean, rstd, h_out, weight, bias
    if add_in is not None:
        linear_bias, residual, seed, p = add_in
        r2d = as_rows(residual)
    if plan is None:
        plan = remember_plan(_FWD_PLANS, key, _fwd_plan(x2d, rms_norm, bias is not None, zero_centered_gamma, tile,
                                                        err is not None, stats, add_in))
    rows_per_program, threshold, scale = plan.data
    if add_in is not None:
        extra = (linear_bias if linear_bias is not None else weight, r2d, h_out, seed if seed is not None else spare,
                 *r2d.stride(), threshold, scale)
    else:
        extra = (weight, x2d, y, spare, 0, 0, 0, 1.0)
    launch_planned(_norm_fwd_kernel, plan, device,
                   x2d, y, weight, bias if bias is not None else weight, mean if mean is not None else spare, spare,
                   err if err is not None else spare, n_rows, x2d.shape[1], *x2d.stride(), float(eps), rows_per_program,
                   *extra)
    if err is not None:
        gamma_check.launched(x, zero_centered_gamma)
    return y, mean, rstd, h_out, weight, bias


def norm_bwd(dy: torch.Tensor, x_or_y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             mean: Optional[torch.Tensor], rstd: torch.Tensor, *, rms_norm: bool,
             zero_centered_gamma: bool = False, memory_efficient: bool = False,
             tile: Optional[Tile] = None, dresidual: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward kernel, then the second-stage reduction of dgamma and dbeta (none
    when one program takes every row: small inputs, ``launch.FOLD_TILES``).

    With a tile narrower than the row (long rows: BLOCK_N < the next power of two >= h), the
    row-sums kernel runs first and the backward kernel runs on a 2-D grid of (row programs,
    column blocks of BLOCK_N).

    Args:
        dy: gradient of y, [..., h], x's dtype, any strides.
        x_or_y: the forward input x, or with ``memory_efficient`` its output y; [..., h].
        weight: [h], contiguous.
        bias: [h], contiguous, or None. Read only with ``memory_efficient``.
        mean: [rows] from the forward, float32 (float64 for float64 x); LayerNorm only,
            unused with ``memory_efficient``.
        rstd: [rows] from the forward, float32 (float64 for float64 x).
        rms_norm, zero_centered_gamma: as in the forward.
        memory_efficient: ``x_or_y`` is y; x_hat = (y - beta) / gamma (needs gamma != 0).
        tile: launch settings (None: ``pick(BWD_TILES, h)``, RMSNorm ``pick(RMS_BWD_TILES, h)``).
        dresidual: a second gradient of x (x also fed a residual connection), x's shape and
            dtype, any strides, or None: added to dx in the kernel, in float32 (float64 for
            float64 x), and rounded once; it saves a separate add's three passes.

    Returns:
        ``(dx, dweight, dbias)``: dx (plus ``dresidual``) a new contiguous tensor of x's shape and dtype; dweight
        [h] and dbias [h] (None without bias) in the parameters' dtype, summed over every
        row in float32 (float64 for float64 x) in a fixed order.

    Raises:
        ValueError: for h past MAX_HIDDEN_SIZE, or a ``tile.BLOCK_N`` that is not a power of two.

    Source: Triton's layer-norm tutorial ``python/tutorials/05-layer-norm.py`` (dx, two-stage
    dgamma/dbeta); Apex ``apex/contrib/csrc/layer_norm`` (``memory_efficient``).
    """
    dx, dweight, dbias, _, _ = _norm_bwd(dy, x_or_y, weight, bias, mean, rstd, rms_norm, zero_centered_gamma,
                                         memory_efficient, tile, dresidual)
    return dx, dweight, dbias


def bias_dropout_add_norm_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor], mean: Optional[torch.Tensor], rstd: torch.Tensor,
                              seed: Optional[torch.Tensor], p: float, linear_bias_dtype: Optional[torch.dtype], *,
                              rms_norm: bool, zero_centered_gamma: bool = False, tile: Optional[Tile] = None,
                              in_norm: Optional[bool] = None, need_dx: bool = True
                              ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                         Optional[torch.Tensor]]:
    """The backward of :func:`bias_dropout_add_norm_fwd`: h's gradient ``dres = norm's dx + dh``
    (the residual's), x's gradient ``dres·keep·scale`` (``dres`` itself without dropout) and the
    sublayer bias's, its sum over rows, taken from the rounded ``dres`` as the bias-dropout-add
    backward kernel takes it.

    With ``in_norm`` the norm's backward kernel does it all (x's gradient and the bias's partial
    sums while dres is in registers: one read of dres less); otherwise it writes dres and the
    bias-dropout-add backward kernel reads it back (the partial sums' registers cost the norm's
    kernel occupancy, which at some row lengths costs more than the read: :data:`BDA_BWD_IN_NORM`).

    Args:
        dy: gradient of y, [..., h'], any strides.
        dh: gradient of the h output (the next residual connection's), or None.
        h: the forward's h output (the norm's input).
        weight, bias, mean, rstd, rms_norm, zero_centered_gamma, tile: as :func:`norm_bwd`.
        seed, p: the forward's Philox key (None: nothing was dropped) and probability.
        linear_bias_dtype: the sublayer bias's dtype, or None for no bias gradient.
        in_norm: see above; None: as :data:`BDA_BWD_IN_NORM` says for rows of h'.
        need_dx: compute x's gradient (False: dx is None).

    Returns:
        ``(dx, dresidual, dweight, dbias, dlinear_bias)``: dresidual a new contiguous tensor of
        h's shape and dtype; dx ``dresidual`` itself without dropout, else a new tensor (None
        without ``need_dx``); dweight, dbias as :func:`norm_bwd`'s; dlinear_bias [h'] of
        ``linear_bias_dtype`` or None.

    Raises:
        ValueError: as :func:`norm_bwd`.

    Source: fusedlib's own (the backward of :func:`bias_dropout_add_norm_fwd`).
    """
    if in_norm is None:
        in_norm = next((fused for bound, fused in BDA_BWD_IN_NORM if h.shape[-1] <= bound), False)
    if in_norm:
        dres, dweight, dbias, dx, dlb = _norm_bwd(dy, h, weight, bias, mean, rstd, rms_norm, zero_centered_gamma,
                                                  False, tile, dh, add_in=(seed, p, linear_bias_dtype, need_dx))
        return dx, dres, dweight, dbias, dlb
    dres, dweight, dbias, _, _ = _norm_bwd(dy, h, weight, bias, mean, rstd, rms_norm, zero_centered_gamma, False,
                                           tile, dh)
    dx, dlb = bias_dropout_add_bwd(dres, h.dtype, seed, p, need_dx=need_dx, need_dbias=linear_bias_dtype is not None,
                                   db_dtype=linear_bias_dtype)
    return dx, dres, dweight, dbias, dlb


class _BwdPlan(NamedTuple):
    """What a backward's launches take from their inputs' signature (:func:`_norm_bwd`)."""

    split: bool  # long rows: the row-sums kernel first, then programs of block_n columns
    final: bool  # one program: its partial sums are the gradients (no second stage)
    dlb_row: int  # the sublayer bias's row in the partial sums
    partial_dtype: torch.dtype
    stats: Optional[Planned]  # the row-sums kernel (split only)
    main: Planned  # the backward kernel; data: rows per program, the dropout mask's threshold and scale
    reduce: Optional[Planned]  # the second stage (not final only)


# _norm_bwd's plans by input signature (fusedlib.runtime.remember_plan)
_BWD_PLANS: dict[tuple, _BwdPlan] = plan_cache()


def _bwd_plan(x2d: torch.Tensor, rms_norm: bool, bias: Optional[torch.Tensor], weight: torch.Tensor,
              zero_centered_gamma: bool, memory_efficient: bool, tile: Optional[Tile], has_dres: bool,
              add_in: Optional[tuple]) -> _BwdPlan:
    n_rows, h = x2d.shape
    device = x2d.device
    seed, p, lb_dtype, need_dx_in = add_in if add_in is not None else (None, 0.0, None, False)
    has_dlb = lb_dtype is not None
    store_dx_in = seed is not None and need_dx_in
    dropout = seed is not None and (store_dx_in or has_dlb)  # the mask is needed
    if tile is None:
        tile = pick(RMS_BWD_TILES if rms_norm else BWD_TILES, h)
    elif tile.BLOCK_N & (tile.BLOCK_N - 1):
        raise ValueError(f"tile.BLOCK_N must be a power of two (a Triton block), got {tile.BLOCK_N}")
    row_block = next_power_of_2(h)
    block_n = min(tile.BLOCK_N or row_block, row_block)
    if add_in is not None:  # the dropout mask takes columns 8 at a time (one Philox call)
        row_block, block_n = max(row_block, 8), max(block_n, 8)
    split = block_n < row_block  # long rows: programs of block_n columns read the row sums c1, c2
    acc = acc_dtype(x2d.dtype)
    common = dict(IS_RMS_NORM=rms_norm, HAS_BIAS=bias is not None, ZERO_CENTERED_GAMMA=zero_centered_gamma,
                  MEMORY_EFFICIENT=memory_efficient, ACC=TL_DTYPE[acc])
    column_blocks = 1
    stats = None
    if split:
        column_blocks = cdiv(h, block_n)
        s_tile = _ROW_STATS_TILES[device.type]
        stats = planned(_norm_bwd_row_stats_kernel, (cdiv(n_rows, s_tile.BLOCK_M),), device,
                        dict(BLOCK_M=s_tile.BLOCK_M, BLOCK_N=min(s_tile.BLOCK_N, row_block), **common,
                             num_warps=s_tile.num_warps))
    programs, rows_per_program = persistent_grid(n_rows, tile.BLOCK_M, max(1, tile.programs_per_sm), device,
                                                 column_blocks, fold_tiles=FOLD_TILES)
    # [1 to 3, programs, h]: first-stage partial sums of dgamma ([0]), dbeta ([1], only with a bias) and
    # the sublayer bias's gradient ([dlb_row], only with add_in and its bias);
    # with one program they are the sums themselves: stored in the parameters' dtype, no second stage
    dlb_row = 2 if bias is not None else 1  # [dgamma, (dbeta,) (dlinear_bias)]
    final = (programs == 1 and (bias is None or bias.dtype == weight.dtype)
             and (not has_dlb or lb_dtype == weight.dtype))
    kwargs = dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=block_n, SPLIT=split, NUM_STAGES=tile.num_stages, HAS_DRES=has_dres,
                  HAS_DLB=has_dlb, DLB_ROW=dlb_row, DROPOUT=dropout, STORE_DXIN=store_dx_in, **common,
                  num_warps=tile.num_warps)
    main = planned(_norm_bwd_kernel, (programs, column_blocks), device, kwargs,
                   data=(rows_per_program, *((drop_threshold(p), dropout_scale(p)) if dropout else (0, 1.0))))
    reduce = None
    if not final:
        r_tile = _REDUCE_TILES[device.type]
        reduce_block_n = min(r_tile.BLOCK_N, block_n)
        reduce = planned(_norm_bwd_reduce_kernel, (cdiv(h, reduce_block_n),), device,
                         dict(BLOCK_P=min(r_tile.BLOCK_M, next_power_of_2(programs)), BLOCK_N=reduce_block_n,
                              HAS_BIAS=bias is not None, ACC=TL_DTYPE[acc], HAS_DLB=has_dlb, DLB_ROW=dlb_row,
                              num_warps=r_tile.num_warps))
    return _BwdPlan(split, final, dlb_row, weight.dtype if final else acc, stats, main, reduce)


def _norm_bwd(dy, x_or_y, weight, bias, mean, rstd, rms_norm, zero_centered_gamma, memory_efficient, tile,
              dresidual, add_in=None):
    """:func:`norm_bwd`, or with ``add_in = (seed, p, linear_bias_dtype, need_dx_in)`` the backward of
    :func:`bias_dropout_add_norm_fwd`: ``(dx, dweight, dbias, dx_in, dlinear_bias)`` (the last
    two None without ``add_in``; dx_in is dx itself without dropout, None without need_dx_in).

    The launch settings are a plan made once per input signature, as :func:`_norm_fwd`'s."""
    device = x_or_y.device
    x2d = as_rows(x_or_y)  # [..., h] -> [rows, h]
    dy2d = as_rows(dy)
    n_rows, h = x2d.shape
    dx = empty_contiguous_like(x_or_y)  # written as [rows, h]
    seed, p, lb_dtype, need_dx_in = add_in if add_in is not None else (None, 0.0, None, False)
    has_dlb = lb_dtype is not None
    store_dx_in = seed is not None and need_dx_in
    dx_in = empty_contiguous_like(x_or_y) if store_dx_in else (dx if need_dx_in and seed is None else None)
    if n_rows == 0:
        return (dx, torch.zeros_like(weight), (torch.zeros_like(bias) if bias is not None else None), dx_in,
                torch.zeros(h, dtype=lb_dtype, device=device) if has_dlb else None)
    dres2d = as_rows(dresidual) if dresidual is not None else dy2d
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(x2d), device, tensor_key(dy2d), spec_key(weight), spec_key(bias), spec_key(mean), spec_key(rstd),
        rms_norm, zero_centered_gamma, memory_efficient, tile, None if dresidual is None else tensor_key(dres2d),
        None if add_in is None else (spec_key(seed), p if seed is not None else None, lb_dtype, need_dx_in))
    plan = _BWD_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = remember_plan(_BWD_PLANS, key, _bwd_plan(x2d, rms_norm, bias, weight, zero_centered_gamma,
                                                        memory_efficient, tile, dresidual is not None, add_in))
    w_b = (weight, bias if bias is not None else weight)
    stats = (mean if mean is not None else rstd, rstd)
    strides = (*dy2d.stride(), *x2d.stride())
    row_sums = rstd  # unused pointer without a split
    if plan.split:
        row_sums = torch.empty((2, n_rows), dtype=acc_dtype(x2d.dtype), device=device)  # c1, c2 per row
        launch_planned(_norm_bwd_row_stats_kernel, plan.stats, device, dy2d, x2d, *w_b, *stats, row_sums, n_rows, h,
                       *strides)
    programs = plan.main.grid[0]
    # [1 to 3, programs, h] as the kernels index it, allocated 2-D so that the one-program
    # results below are one index each (a 3-D partial[r, 0] is two views: twice the host time)
    partial = torch.empty(((plan.dlb_row + has_dlb) * programs, h), dtype=plan.partial_dtype, device=device)
    rows_per_program, threshold, scale = plan.main.data
    dropout = plan.main.kwargs["DROPOUT"]
    launch_planned(_norm_bwd_kernel, plan.main, device,
                   dy2d, x2d, *w_b, *stats, row_sums, dx, partial, dres2d, n_rows, h, *strides, *dres2d.stride(),
                   rows_per_program, dx_in if store_dx_in else dx, seed if dropout else rstd, threshold, scale)
    if plan.final:  # one program: row r of the partial sums is the r-th gradient itself
        return (dx, partial[0], (partial[1] if bias is not None else None), dx_in,
                partial[plan.dlb_row] if has_dlb else None)
    dweight = torch.empty_like(weight)
    dbias = torch.empty_like(bias) if bias is not None else None
    dlb = torch.empty(h, dtype=lb_dtype, device=device) if has_dlb else None
    launch_planned(_norm_bwd_reduce_kernel, plan.reduce, device,
                   partial, dweight, dbias if dbias is not None else dweight, dlb if dlb is not None else dweight,
                   programs, h)
    return dx, dweight, dbias, dx_in, dlb
