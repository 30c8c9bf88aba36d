"""Triton kernels for bias + tanh-GeLU, forward and backward.

Forward, one read of y and one write of out per element (bias read once per column block):

    x   = y + b
    out = 0.5·x·(1 + tanh(c0·x·(1 + c1·x²)))         c0 = sqrt(2/pi), c1 = 0.044715

Backward, one read of g and y, one write of dy per element, plus a per-program partial
sum of dy over rows for the bias gradient (a two-stage reduction: deterministic, no atomics):

    t    = tanh(c0·x·(1 + c1·x²))
    dout/dx = 0.5·x·(1 - t²)·(c0 + c2·x²) + 0.5·(1 + t)  c2 = 3·c0·c1 = 0.1070322243
    dy   = dout/dx · g
    db   = sum over rows of dy                            (float32)

Dtype policy: load, compute in float32, store in y's dtype; db accumulated in float32.
float64 inputs are computed in float64 (ACC), so ``torch.autograd.gradcheck`` can check
the kernels themselves. tanh comes from :mod:`fusedlib.kernels.math`, written with
``exp`` alone so the same kernel runs in Triton's interpreter, which has no libdevice.

Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import find_plan, launch_planned, param_key, plan_cache, planned, remember_plan, spec_key, tensor_key
from .launch import (
    FOLD_TILES, HUGE, TL_DTYPE, Tile, TileTable, acc_dtype, as_rows, cdiv, empty_contiguous_like,
    persistent_grid, pick,
)
from .math import gelu_tanh_derivative, tanh
from .reduce import finish_partials, partials_buffer

__all__ = ["bias_gelu_fwd", "bias_gelu_bwd", "FWD_TILES", "BWD_TILES"]

# Constants of the tanh approximation (derived with sympy in chapter 1). Kernels may read
# module globals only as tl.constexpr: a plain float compiles in the interpreter alone.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
GELU_COEF = tl.constexpr(0.044715)  # cubic coefficient fitted by Hendrycks & Gimpel
GELU_DERIV_COEF = tl.constexpr(0.10703222440890037)  # sqrt(2/pi) * 3 * 0.044715


@triton.jit
def _bias_gelu_fwd_kernel(
    Y_ptr,  # input y, [n_rows, n_cols], strides (Y_row_stride, Y_col_stride)
    B_ptr,  # bias, [n_cols], contiguous
    OUT_ptr,  # output, [n_rows, n_cols], contiguous, y's dtype
    n_rows,
    n_cols,
    Y_row_stride,
    Y_col_stride,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: n_rows·n_cols may pass 2^31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)
    y = tl.load(Y_ptr + rows[:, None] * Y_row_stride + cols[None, :] * Y_col_stride, mask=mask, other=0.0)
    x = y.to(ACC) + b[None, :]
    t = tanh(x * SQRT_2_OVER_PI * (1.0 + x * x * GELU_COEF))
    out = 0.5 * x * (1.0 + t)
    tl.store(OUT_ptr + rows[:, None] * n_cols + cols[None, :], out.to(OUT_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    G_ptr,  # grad of the output g, [n_rows, n_cols], strides (G_row_stride, G_col_stride)
    Y_ptr,  # saved input y, [n_rows, n_cols], strides (Y_row_stride, Y_col_stride)
    B_ptr,  # bias, [n_cols], contiguous
    DY_ptr,  # grad of y, [n_rows, n_cols], contiguous, y's dtype
    DB_PARTIAL_ptr,  # ACC [n_row_programs, n_cols]: this program's sum of dy over its rows (one program: db, bias's dtype)
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    G_row_stride,
    G_col_stride,
    Y_row_stride,
    Y_col_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,  # compute and accumulation dtype: float32, or float64 for float64 inputs
    NUM_STAGES: tl.constexpr,  # the row loop's software pipelining: the next tiles' loads in flight
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(ACC)
    # A [BLOCK_M, BLOCK_N] running sum: adding tile by tile needs no communication between
    # threads; the one reduction over rows (through shared memory) happens after the loop.
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    row_start = pid_m.to(tl.int64) * rows_per_program
    for m in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
        rows = row_start + m + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        y = tl.load(Y_ptr + rows[:, None] * Y_row_stride + cols[None, :] * Y_col_stride, mask=mask, other=0.0)
        g = tl.load(G_ptr + rows[:, None] * G_row_stride + cols[None, :] * G_col_stride, mask=mask, other=0.0)
        x = y.to(ACC) + b[None, :]
        x2 = x * x
        t = tanh(x * SQRT_2_OVER_PI * (1.0 + x2 * GELU_COEF))
        dgelu = gelu_tanh_derivative(x, x2, t, SQRT_2_OVER_PI, GELU_DERIV_COEF)  # no NaN past |x| = 1.8e19
        dy = dgelu * g.to(ACC)  # masked lanes: g = 0 so dy = 0 and adds nothing to db
        tl.store(DY_ptr + rows[:, None] * n_cols + cols[None, :], dy.to(DY_ptr.dtype.element_ty), mask=mask)
        db_acc += dy
    tl.store(DB_PARTIAL_ptr + pid_m * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# Tile shapes of the forward, as (upper bound of n_cols, Tile); BLOCK_N is capped at the
# row's next power of two. About 4 Ki elements per program (16 per thread at 8 warps... 32
# at 4): enough bytes in flight per SM to saturate HBM, few enough registers for full occupancy.
FWD_TILES: TileTable = (
    (16, Tile(BLOCK_M=256, BLOCK_N=16, num_warps=4)),  # tiny rows: many rows per program
    (128, Tile(BLOCK_M=32, BLOCK_N=128, num_warps=4)),
    (1024, Tile(BLOCK_M=4, BLOCK_N=1024, num_warps=4)),
    # 1 Ki to 1.5 Ki: 512-column tiles, which 3·2^k rows (1536: ffn 4h of h = 384) fill whole
    # where a 2048-column tile leaves a quarter of its lanes masked. bf16, H200 (tune):
    # [32768, 1536] 0.0597 ms for [4, 512] at 4 warps against 0.0671 for [2, 2048] at 8; a full
    # 2 Ki row keeps the 2048-column tile ([16384, 2048]: 0.0391 ms against 0.0418 for [4, 512])
    (1536, Tile(BLOCK_M=4, BLOCK_N=512, num_warps=4)),
    (HUGE, Tile(BLOCK_M=2, BLOCK_N=2048, num_warps=8)),  # long rows: 2 Ki columns x 2 rows
)


# The backward's tiles: its programs loop over rows_per_program rows to keep a running
# bias-gradient sum, so each step holds more rows than a forward tile. Long rows, timed with the
# row loop not pipelined (1 stage): [4, 2048] at 8 warps, 0.245 ms for [8192, 16384] bf16 on
# the H200 against 0.250 for [2, 2048] and 0.338 for [2, 4096] (kernel only, 4 programs per SM;
# `python -m fusedlib.bench.tune --op bias_gelu --pass bwd` times such candidates). A persistent
# grid of 4 programs per SM, each writing one float32 partial row of the bias gradient: 0.245 ms
# at 4 per SM against 0.273 at 16 (kernel only, 1 stage, H200). (The pipelining run below timed
# the same 1-stage tile at 0.2398 ms.)
BWD_TILES: TileTable = (
    (16, Tile(BLOCK_M=256, BLOCK_N=16, num_warps=4, programs_per_sm=4)),
    (128, Tile(BLOCK_M=32, BLOCK_N=128, num_warps=4, programs_per_sm=4)),
    (512, Tile(BLOCK_M=4, BLOCK_N=1024, num_warps=4, programs_per_sm=4)),  # (BLOCK_N capped at the row's)
    # 513 to 1 Ki, pipelined (3 stages). Kernel and bias-gradient second stage, bf16, H200, CUDA-graph
    # replays (8-12 settings per shape): [32768, 768] 0.0530 ms for [8, 256] x 4
    # warps at 3 stages (three 256-column blocks fill the row) against 0.0656 for [4, 1024] at 1
    # stage and 0.0584 at 3; [131072, 1024] 0.2168 for [2, 1024] x 4 warps at 3
    # stages (3714 GB/s) against 0.2551 for [4, 1024] at 1 stage (0.2753 at 3, 0.2272 at 2) and
    # 0.2222 for [8, 256]. Rows of up to 512 columns: not measured pipelined, kept at 1 stage.
    (768, Tile(BLOCK_M=8, BLOCK_N=256, num_warps=4, num_stages=3, programs_per_sm=4)),
    (1024, Tile(BLOCK_M=2, BLOCK_N=1024, num_warps=4, num_stages=3, programs_per_sm=4)),
    # 1 Ki to 1.5 Ki, as in the forward: three 512-column blocks fill a row of 1536 where one
    # 2048-column block leaves a quarter of its lanes masked. [32768, 1536] bf16, H200, CUDA-graph
    # replays: 0.1052 ms for [4, 512] at 4 warps against 0.1196 for [4, 2048] at 8 (torch.compile's
    # GeLU backward and bias sum: 0.1163); the best of 72 tiles of 256-2048 columns, 2-16 rows,
    # 4 or 8 warps, 2-8 programs per SM.
    # Above 1 Ki too, the row loop is software-pipelined (num_stages 3: the next two tiles' loads
    # in flight while one is computed). Kernel only, bf16, H200, CUDA-graph replays, stages 1 / 3:
    # [32768, 1536] at [4, 512] x 4 warps 0.1101 / 0.0801 ms (3768 GB/s, 88 % of copy; 4 stages
    # 0.0834); [8192, 16384] at [4, 2048] x 8 warps 0.2398 / 0.2167 (4 stages 0.2121); [8192, 3072]
    # at [4, 2048] 0.0590 / 0.0502 and at [2, 1024] x 4 warps 0.0575 / 0.0407 (3711 GB/s), the best
    # of 9 tiles there, hence its own row (measured at 3072 only).
    (1536, Tile(BLOCK_M=4, BLOCK_N=512, num_warps=4, num_stages=3, programs_per_sm=4)),
    (3072, Tile(BLOCK_M=2, BLOCK_N=1024, num_warps=4, num_stages=3, programs_per_sm=4)),
    (HUGE, Tile(BLOCK_M=4, BLOCK_N=2048, num_warps=8, num_stages=3, programs_per_sm=4)),
)


def bias_gelu_fwd(y: torch.Tensor, bias: torch.Tensor, tile: Tile | None = None) -> torch.Tensor:
    """Launch the forward kernel.

    Args:
        y: [..., n_cols] ([n_rows, n_cols] in the kernel), float32/float16/bfloat16/float64,
            any strides (leading dims merged by :func:`~fusedlib.kernels.launch.as_rows`).
        bias: [n_cols], same dtype and device, contiguous.
        tile: launch settings (None: ``pick(FWD_TILES, n_cols)``).

    Returns:
        ``gelutanh(y + bias)``: a new contiguous tensor of y's shape and dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu``).
    """
    return _bias_gelu_fwd(y, bias, tile, None)[0]


def _fwd_key(y, bias, tile, check) -> tuple:
    """:func:`_bias_gelu_fwd`'s plan key (for :func:`~fusedlib.runtime.find_plan`). The check
    itself is in it: a plan made by an unchecked call (:func:`bias_gelu_fwd`) never lets a
    checked one skip it."""
    return param_key(y), param_key(bias), tile, check


def _bias_gelu_fwd(y, bias, tile, check):
    """:func:`bias_gelu_fwd` with the op's argument check: ``(out, bias)``, bias as the kernel
    read it.

    The launch settings are a plan made once per input signature (both tensors' class, shape,
    strides, dtype, device and address modulo 16: everything that decides them, Triton's
    specialization of the launch, and what the check reads). ``check(y, bias) -> bias`` (the
    bias as the kernel takes it: contiguous), raising for bad input, runs only when no plan
    matches the call's signature, and a plan is remembered only for a signature that passed it:
    a call whose signature matches skips it. A strided bias (the check copies it) is keyed by the
    copy's signature, and every such call checks again.
    """
    key, p = find_plan(_FWD_PLANS, _fwd_key, y, bias, tile, check)
    if p is None and check is not None:
        checked = check(y, bias)
        if key is None or checked is not bias:
            bias = checked  # a copy's own signature, or none (a trace)
            key, p = find_plan(_FWD_PLANS, _fwd_key, y, bias, tile, check)
    device = y.device
    out = empty_contiguous_like(y)  # written as [n_rows, n_cols]
    if out.numel() == 0:
        return out, bias
    y2d = as_rows(y)  # [..., n_cols] -> [n_rows, n_cols]
    n_rows, n_cols = y2d.shape
    if p is None:
        if tile is None:
            tile = pick(FWD_TILES, n_cols)
        p = remember_plan(_FWD_PLANS, key, planned(
            _bias_gelu_fwd_kernel, (cdiv(n_rows, tile.BLOCK_M), cdiv(n_cols, tile.BLOCK_N)), device,
            dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc_dtype(y.dtype)],
                 num_warps=tile.num_warps)))
    launch_planned(_bias_gelu_fwd_kernel, p, device, y2d, bias, out, n_rows, n_cols, *y2d.stride())
    return out, bias


def bias_gelu_bwd(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor,
                  tile: Tile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel, then reduce the per-program bias partials.

    Args:
        g: grad of the output, y's shape and dtype, any strides.
        y: the forward input, [..., n_cols], any strides.
        bias: [n_cols], contiguous.
        tile: launch settings (None: ``pick(BWD_TILES, n_cols)``); its ``programs_per_sm``
            sizes the persistent grid.

    Returns:
        ``(dy, dbias)``: dy a new contiguous tensor of y's shape and dtype; dbias [n_cols]
        of bias's dtype, summed over rows in float32.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu_back``).
    """
    device = y.device
    dy = empty_contiguous_like(y)  # written as [n_rows, n_cols]
    if dy.numel() == 0:
        return dy, torch.zeros_like(bias)
    g2d, y2d = as_rows(g), as_rows(y)  # [..., n_cols] -> [n_rows, n_cols]
    n_rows, n_cols = y2d.shape
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(y2d), device, tensor_key(g2d), spec_key(bias), tile)
    p = _BWD_PLANS.get(key) if key is not None else None
    if p is None:
        if tile is None:
            tile = pick(BWD_TILES, n_cols)
        col_programs = cdiv(n_cols, tile.BLOCK_N)
        # Enough row programs to fill the device; each loops over its rows and keeps one
        # float32 partial of the bias gradient per column: [row_programs, n_cols] floats.
        row_programs, rows_per_program = persistent_grid(n_rows, tile.BLOCK_M, tile.programs_per_sm, device,
                                                         col_programs, fold_tiles=FOLD_TILES)
        p = remember_plan(_BWD_PLANS, key, planned(
            _bias_gelu_bwd_kernel, (row_programs, col_programs), device,
            dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc_dtype(y.dtype)],
                 NUM_STAGES=tile.num_stages, num_warps=tile.num_warps),
            data=(rows_per_program,)))
    db_partial = partials_buffer(p.grid[0], n_cols, acc_dtype(y.dtype), bias.dtype, device)  # one program: db itself
    launch_planned(_bias_gelu_bwd_kernel, p, device, g2d, y2d, bias, dy, db_partial, n_rows, n_cols, p.data[0],
                   *g2d.stride(), *y2d.stride())
    return dy, finish_partials(db_partial, bias.dtype)


# Launch plans by input signature (fusedlib.runtime.LaunchPlan): the tile, grid and bound launch
# of a call are made once per shape, strides, dtypes and addresses modulo 16.
_FWD_PLANS: dict = plan_cache()
_BWD_PLANS: dict = plan_cache()
