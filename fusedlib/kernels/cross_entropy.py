"""Triton kernels for (vocab-parallel) cross entropy, forward and backward.

A row of logits x (one token; a shard of the vocabulary on each tensor-parallel rank,
columns ``vocab_start_index .. vocab_start_index + n_cols - 1`` of the full vocabulary
of V ids) and its target id t give

    loss = lse - (1 - s)·x_t - s·mean(x)        lse = log sum_j e^{x_j}
    dloss/dx_j = p_j - (1 - s)·[j = t] - s / V   p_j = e^{x_j - lse}

with s = 0 without label smoothing (chapter 6 derives both, and s from Megatron's
``label_smoothing``).

Forward, :func:`cross_entropy_fwd`: ONE read of the logits. One program per row (BLOCK_M
rows for short rows) walks the row in blocks of BLOCK_N with the online softmax of Milakov & Gimelshein (2018): a running
maximum m and a running sum of e^{x - m}, rescaled by e^{m_old - m_new} whenever the maximum
grows. It also loads the target's logit (one element) and, with label smoothing, sums the
logits. It writes four float32 statistics per row (the shard's max, its sum of
exponentials relative to that max, the target's logit or 0 when the target is not in this
shard, and the shard's sum of logits): 16 bytes per row instead of a float32 copy of the
logits. Tensor parallelism combines the statistics of the shards (a MAX and a SUM
all-reduce, :mod:`fusedlib.parallel`). On one device, ``FINALIZE`` makes the kernel finish
the job itself and write the loss and lse directly.

Backward, :func:`cross_entropy_bwd`: ONE read of the logits and ONE write of the gradient
per element, in the logits' dtype; nothing logits-sized is kept from the forward pass
(only lse, 4 bytes per row). A 2-D grid (row block, column block): each program recomputes
p = e^{x - lse} for its block and writes (p - (1 - s)·onehot - s/V)·g.

Tradeoff (documented in chapter 6): Liger-Kernel writes the gradient during the forward
pass (into the logits' own storage), so its backward only scales it by g. That moves
fewer bytes when g is one scalar equal to 1 (reduction="mean", no loss scaling) but needs
a second read of each row in the forward, modifies the input, and must re-read and
re-write the whole gradient for any other g (per-token losses, loss masks, loss scaling:
Megatron's case). fusedlib keeps the input intact and always moves 3 logits-sized
tensors: read (fwd), read + write (bwd).

Dtype policy: load, compute in float32 (float64 for float64 logits, so gradcheck checks
the kernels), statistics in float32, store the gradient in the logits' dtype. Offsets are
int64: the logits of a large-vocabulary model pass 2^31 elements (8192 x 128256 is just
under 2^30; 16745 rows of 128256 pass 2^31).

Sources: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py`` and
``megatron/core/fusions/fused_cross_entropy.py``; Milakov & Gimelshein, "Online normalizer
calculation for softmax", arXiv:1805.02867; Liger-Kernel ``ops/cross_entropy.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import (
    DeviceCheck, find_plan, launch_planned, param_key, plan_cache, planned, remember_plan, spec_key, tensor_key,
)
from .launch import HUGE, TL_DTYPE, Tile, TileTable, acc_dtype, as_rows, cdiv, empty_contiguous_like, pick

__all__ = ["cross_entropy_fwd", "cross_entropy_bwd", "smoothing_coefs", "FWD_TILES", "BWD_TILES", "TILE_ELEMENTS",
           "STAT_ROWS"]

#: Rows of the forward statistics tensor [4, n_rows]: shard max, shard sum of e^{x - max},
#: target logit (0 where the target is in another shard), shard sum of logits.
STAT_ROWS = ("logits_max", "sum_exp_logits", "predicted_logits", "sum_logits")


@triton.jit
def _cross_entropy_fwd_kernel(
    X_ptr,  # logits (a vocabulary shard), [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    TARGET_ptr,  # target ids in the GLOBAL vocabulary, [n_rows], int32/int64, stride target_stride
    STATS_ptr,  # ACC [4, n_rows] out, contiguous: the STAT_ROWS statistics of this shard
    LOSS_ptr,  # ACC [n_rows] out, only with FINALIZE: the loss (0 for ignored rows)
    LSE_ptr,  # ACC [n_rows] out, only with FINALIZE: log-sum-exp (0 for ignored rows)
    COEF_ptr,  # ACC [2], only with SMOOTHING and FINALIZE: 1 - s and s / V (V: GLOBAL vocabulary size)
    ERR_ptr,  # int64 [1], only with CHECK: a target id outside [0, V) is stored here (never 0)
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    target_stride,
    vocab_start_index,  # global id of this shard's first column
    vocab_size,  # V, the GLOBAL vocabulary size: valid targets are 0 .. V - 1 (and ignore_index)
    ignore_index,  # target id whose rows get zero loss and zero gradient
    BLOCK_M: tl.constexpr,  # rows per program (1 for long rows)
    BLOCK_N: tl.constexpr,  # columns per loop step
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 logits
    SMOOTHING: tl.constexpr,  # label smoothing: also sum the logits
    FINALIZE: tl.constexpr,  # one device (the shard is the whole vocabulary): write loss and lse
    CHECK: tl.constexpr,  # report a bad target id through ERR_ptr (its rows get NaN either way)
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride may pass 2^31
    row_mask = rows < n_rows
    x_rows_ptr = X_ptr + rows * X_row_stride  # [BLOCK_M] pointers to the rows
    target = tl.load(TARGET_ptr + rows * target_stride, mask=row_mask, other=ignore_index).to(tl.int64)
    active = target != ignore_index  # (rows past n_rows count as ignored)
    cols = tl.arange(0, BLOCK_N)

    # Online softmax, per row: m is the running max, s_vec[:, i] the running sum of e^{x - m}
    # over the columns lane i has seen. When a block raises the max from m to m_new, the
    # partial sums are rescaled by alpha = e^{m - m_new} (one FMA per element).
    m = tl.full((BLOCK_M,), float("-inf"), ACC)
    s_vec = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    sum_vec = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = (c < n_cols)[None, :] & active[:, None]  # ignored rows read no logits at all
        x = tl.load(x_rows_ptr[:, None] + c.to(tl.int64)[None, :] * X_col_stride, mask=mask,
                    other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # Until a finite logit has been seen m_new is -inf: subtract 0 instead, so that
        # e^{-inf - 0} = 0 and no -inf - (-inf) = NaN is formed.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        s_vec = s_vec * alpha[:, None] + tl.exp(x - m_ref[:, None])
        m = m_new
        if SMOOTHING:
            sum_vec += tl.where(mask, x, 0.0)
    s = tl.sum(s_vec, axis=1)
    sum_x = tl.sum(sum_vec, axis=1)

    # The target's logit: one element per row, loaded only by the shard that holds it.
    local_t = target - vocab_start_index
    in_shard = active & (local_t >= 0) & (local_t < n_cols)
    x_t = tl.load(x_rows_ptr + local_t * X_col_stride, mask=in_shard, other=0.0).to(ACC)

    # A target id outside [0, V) (other than ignore_index) is in no shard: its row's loss
    # would silently be lse - 0. Make it NaN instead (the loss, lse and so the gradient,
    # through the sum of exponentials on every rank) and report the id (nonzero: 0 is valid).
    bad = active & ((target < 0) | (target >= vocab_size))
    if CHECK:
        tl.store(ERR_ptr + tl.zeros_like(target), target, mask=bad & row_mask)
    s = tl.where(bad, float("nan"), s)
    x_t = tl.where(bad, float("nan"), x_t)

    if FINALIZE:
        # The whole vocabulary is here: lse = m + log(s), loss = lse - (1-s)·x_t - (s/V)·sum x,
        # written as log(s) + (m - x_t) + ... so that large logits do not cancel in float32.
        log_s = tl.log(tl.where(active, s, 1.0))
        lse = tl.where(active, m + log_s, 0.0)
        if SMOOTHING:
            target_coef = tl.load(COEF_ptr)
            uniform_coef = tl.load(COEF_ptr + 1)
            loss = log_s + target_coef * (m - x_t) + (1.0 - target_coef) * m - uniform_coef * sum_x
        else:
            loss = log_s + (m - x_t)
        tl.store(LOSS_ptr + rows, tl.where(active, loss, 0.0), mask=row_mask)
        tl.store(LSE_ptr + rows, lse, mask=row_mask)
    else:
        tl.store(STATS_ptr + rows, m, mask=row_mask)
        tl.store(STATS_ptr + n_rows + rows, s, mask=row_mask)
        tl.store(STATS_ptr + 2 * n_rows + rows, x_t, mask=row_mask)
        tl.store(STATS_ptr + 3 * n_rows + rows, sum_x, mask=row_mask)


@triton.jit
def _cross_entropy_bwd_kernel(
    X_ptr,  # logits (a vocabulary shard), [n_rows, n_cols], strides (X_row_stride, X_col_stride)
    TARGET_ptr,  # target ids in the GLOBAL vocabulary, [n_rows], stride target_stride
    LSE_ptr,  # ACC [n_rows]: global log-sum-exp per row (0 for ignored rows; NaN for a bad target: dx NaN)
    G_ptr,  # grad of the loss, [n_rows], stride g_stride (0 for a broadcast scalar)
    DX_ptr,  # out: grad of the logits, [n_rows, n_cols], contiguous, the logits' dtype
    COEF_ptr,  # ACC [2], only with SMOOTHING: 1 - s (the one-hot weight) and s / V (V: GLOBAL vocabulary size)
    n_rows,
    n_cols,
    X_row_stride,
    X_col_stride,
    target_stride,
    g_stride,
    vocab_start_index,  # global id of this shard's first column
    ignore_index,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
    ACC: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    target = tl.load(TARGET_ptr + rows * target_stride, mask=row_mask, other=ignore_index).to(tl.int64)
    active = target != ignore_index
    lse = tl.load(LSE_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(G_ptr + rows * g_stride, mask=active, other=0.0).to(ACC)  # ignored rows: g = 0
    x_ptrs = X_ptr + rows[:, None] * X_row_stride + cols.to(tl.int64)[None, :] * X_col_stride
    x = tl.load(x_ptrs, mask=(cols < n_cols)[None, :] & active[:, None], other=0.0).to(ACC)  # ignored rows: no read
    p = tl.exp(x - lse[:, None])  # softmax, recomputed from the saved lse
    is_target = cols[None, :] == (target - vocab_start_index)[:, None]
    if SMOOTHING:
        target_coef = tl.load(COEF_ptr)
        uniform_coef = tl.load(COEF_ptr + 1)
        dx = (p - tl.where(is_target, target_coef, 0.0) - uniform_coef) * g[:, None]
    else:
        dx = (p - tl.where(is_target, 1.0, 0.0)) * g[:, None]
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    tl.store(DX_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)


# Launch settings, as (upper bound of n_cols, Tile); a BLOCK_N of 0 means "the next power of
# two >= n_cols" (the whole row in one step). Short rows are packed BLOCK_M = TILE_ELEMENTS //
# BLOCK_N to a program (many rows per program: fewer, larger programs, which also suits
# Triton's CPU interpreter): one table row per power of two; long rows get one row per program
# (the backward: TILE_ELEMENTS // BLOCK_N rows of one column block).
TILE_ELEMENTS = 4096


def _packed(first: int, last: int, num_warps: int) -> TileTable:
    """Table rows for the bounds first, 2·first, ..., last (powers of two): the whole row in one
    step (BLOCK_N = 0), TILE_ELEMENTS // bound rows per program."""
    bounds = [first << k for k in range((last // first).bit_length())]
    return tuple((b, Tile(BLOCK_M=max(1, TILE_ELEMENTS // b), BLOCK_N=0, num_warps=num_warps)) for b in bounds)


# Forward: one program per row loops over its row. A step of 4096 elements at 8 warps is
# 16 elements per thread: two 16-byte loads in flight per thread for bf16, and with ~8
# programs resident per SM, ~64 KB in flight per SM, enough to cover HBM latency.
FWD_TILES: TileTable = (
    *_packed(1, 1024, num_warps=4),  # short rows: one step, several rows per program, 4 warps
    *_packed(2048, 4096, num_warps=8),  # one step of up to 4 Ki elements (2 rows of 2 Ki, or one row)
    (HUGE, Tile(BLOCK_M=1, BLOCK_N=4096, num_warps=4)),  # long rows (a 128 Ki vocabulary: 32 steps of 4 Ki);
    # 4 warps measured 0.558 ms against 0.597 at 8 warps on the H200 ([8192, 128256] bf16)
)
# Backward: purely elementwise, a 2-D grid of (row block, column block) programs; 4 Ki
# columns at 8 warps = 16 elements per thread (two 16-byte loads and stores for bf16).
BWD_TILES: TileTable = (
    *_packed(1, 1024, num_warps=4),
    (HUGE, Tile(BLOCK_M=TILE_ELEMENTS // 2048, BLOCK_N=2048, num_warps=4)),  # 2 Ki columns at 4 warps:
    # 1.063 ms against 1.088 for 4 Ki at 8 (H200)
)


def smoothing_coefs(label_smoothing: float, vocab_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """``[1 - s, s / V]`` with s = eps·V/(V - 1) (Megatron's smoothing), computed in Python
    float64 and handed to the kernels as a 2-element tensor of ``dtype``: a float kernel
    argument would be rounded to float32, which float64 logits must not suffer.

    Args:
        label_smoothing: Megatron's epsilon (0: the coefficients are [1, 0]).
        vocab_size: the GLOBAL vocabulary size V (>= 2 when smoothing).
        dtype, device: of the result.

    Returns:
        A new [2] tensor (filled on the device, no host-device synchronization).

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``VocabParallelCrossEntropy.forward``: ``smoothing = label_smoothing * vocab_size / (vocab_size
    - 1)``).
    """
    s = label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0
    coefs = torch.full((2,), 1.0 - s, dtype=dtype, device=device)
    coefs[1:].fill_(s / vocab_size)
    return coefs


def cross_entropy_fwd(
    x2d: torch.Tensor,
    target1d: torch.Tensor,
    vocab_start_index: int = 0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    finalize: bool = False,
    tile: Tile | None = None,
    check: DeviceCheck | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: one read of the logits.

    Args:
        x2d: logits of one vocabulary shard, [n_rows, n_cols], float32/16/bf16/64, any strides.
        target1d: [n_rows] int32/int64 target ids in the global vocabulary (any stride).
        vocab_start_index: global id of column 0 of ``x2d``.
        ignore_index: target id of rows to skip.
        label_smoothing: Megatron's epsilon; > 0 also sums the logits (for the mean).
        vocab_size: the global vocabulary size V (default: ``n_cols``).
        finalize: ``x2d`` holds the whole vocabulary: the kernel writes the loss and lse
            itself. False: it writes the shard statistics.
        tile: launch settings (None: ``pick(FWD_TILES, n_cols)``).
        check: the calling op's :class:`fusedlib.runtime.DeviceCheck` for target ids, or None.

    Returns:
        Without ``finalize``: ``stats``, a new contiguous [4, n_rows] float32 (float64 for
        float64 logits) tensor whose rows are :data:`STAT_ROWS`. With it: ``(loss, lse)``,
        two new [n_rows] tensors of that dtype (0 for ignored rows).

    A row whose target is neither in [0, vocab_size) nor ``ignore_index`` gets NaN: its
    sum of exponentials and target logit (so its loss and lse, after any all-reduce), or with
    ``finalize`` its loss and lse. With a ``check``, the kernel also stores the bad id for it,
    and :meth:`~fusedlib.runtime.DeviceCheck.launched` reports it (at once on the CPU, lazily
    on CUDA: no host sync).

    Raises:
        ValueError: from ``check``, for a bad target id (see above).

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``calculate_logits_max``, ``calculate_predicted_logits``); Milakov & Gimelshein,
    arXiv:1805.02867 (the online softmax).
    """
    out, _, _ = _cross_entropy_fwd(x2d, target1d, vocab_start_index, ignore_index, label_smoothing, vocab_size,
                                   finalize, tile, check)
    return out


def _fwd_key(x, target, vocab_start_index, ignore_index, label_smoothing, vocab_size, finalize, tile, err,
             validate) -> tuple | None:
    """:func:`_cross_entropy_fwd`'s plan key (for :func:`~fusedlib.runtime.find_plan`), or None
    for scalars other than a Python float label_smoothing and int ignore_index (only their values
    are fixed: another Real may change under the same identity). The ints by value, as Triton
    specializes them (1, multiples of 16, int32 range); validate too: an unchecked call's plan
    never stands for the check."""
    if type(label_smoothing) is not float or type(ignore_index) is not int:
        return None
    return (param_key(x), param_key(target), vocab_start_index, vocab_size, ignore_index, label_smoothing,
            bool(finalize), err is not None, tile, validate)


def _cross_entropy_fwd(x, target, vocab_start_index, ignore_index, label_smoothing, vocab_size, finalize, tile,
                       check, validate=None):
    """:func:`cross_entropy_fwd` on ``x`` [..., n_cols] and ``target`` [...]: ``(out, x2d, target1d)``,
    out as :func:`cross_entropy_fwd` returns it, x2d and target1d the rows the kernel read.

    The launch settings are a plan made once per input signature (shapes, strides, dtypes,
    devices, addresses modulo 16, the ints Triton specializes, the switches, label_smoothing
    and ignore_index: a Python float and int, or no plan is remembered). ``validate``: the op's argument check,
    ``validate(x, target, label_smoothing, ignore_index) -> (x2d, target1d)``, raising for bad
    input; it runs only when no plan matches the call's signature, and a plan is remembered only
    for a signature that passed it (it reads nothing the key does not hold), so a call whose
    signature matches skips it. Without it, x and target must be what the kernel takes.
    """
    # the check's word, or None: no check compiled in (while torch.compile traces, or during a
    # CUDA-graph capture before any check buffer exists); the key says which
    try:
        err = check.word(x) if check is not None else None
    except AttributeError:  # not a tensor: the argument check says so
        err = None
    key, p = find_plan(_FWD_PLANS, _fwd_key, x, target, vocab_start_index, ignore_index, label_smoothing, vocab_size,
                       finalize, tile, err, validate)
    if p is None and validate is not None:
        x2d, target1d = validate(x, target, label_smoothing, ignore_index)
        if err is None and check is not None:
            err = check.word(x2d)
    else:
        x2d, target1d = as_rows(x), (target if target.dim() == 1 else target.reshape(-1))
    n_rows, n_cols = x2d.shape
    device = x2d.device
    sdt = acc_dtype(x2d.dtype)  # statistics, loss and lse: float32 (float64 for float64 logits)
    if finalize:
        loss = torch.empty(n_rows, dtype=sdt, device=device)
        lse = torch.empty(n_rows, dtype=sdt, device=device)
        stats = loss  # unused pointer
    else:
        stats = torch.empty((4, n_rows), dtype=sdt, device=device)
        loss = lse = stats  # unused pointers
    if n_rows > 0:
        vocab_size = vocab_size or n_cols
        smoothing = label_smoothing > 0
        if p is None:
            if tile is None:
                tile = pick(FWD_TILES, n_cols)
            p = remember_plan(_FWD_PLANS, key, planned(
                _cross_entropy_fwd_kernel, (cdiv(n_rows, tile.BLOCK_M),), device,
                dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[sdt], SMOOTHING=smoothing,
                     FINALIZE=bool(finalize), CHECK=err is not None, num_warps=tile.num_warps)))
        launch_planned(
            _cross_entropy_fwd_kernel, p, device,
            x2d, target1d, stats, loss, lse,
            smoothing_coefs(label_smoothing, vocab_size, sdt, device) if smoothing else lse,
            err if err is not None else target1d,
            n_rows, n_cols, *x2d.stride(), target1d.stride(0), vocab_start_index, vocab_size, ignore_index,
        )
        if err is not None:
            check.launched(x2d, (vocab_size, ignore_index))
    return ((loss, lse) if finalize else stats), x2d, target1d


def cross_entropy_bwd(
    x2d: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    grad1d: torch.Tensor,
    vocab_start_index: int = 0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Launch the backward kernel: one read of the logits, one write of the gradient.

    Args:
        x2d: the forward logits, [n_rows, n_cols], any strides.
        target1d: [n_rows] target ids in the global vocabulary.
        lse: [n_rows] contiguous float32 (float64) global log-sum-exp (0 for ignored rows; NaN
            for a row with a bad target id, whose gradient is then NaN).
        grad1d: [n_rows] gradient of the per-row loss, any stride (0 for a broadcast scalar).
        vocab_start_index: global id of column 0 of ``x2d``.
        ignore_index: rows with this target get a zero gradient.
        label_smoothing: Megatron's epsilon (s = eps·V/(V-1)).
        vocab_size: the global vocabulary size V (default: ``n_cols``).
        tile: launch settings (None: ``pick(BWD_TILES, n_cols)``).

    Returns:
        ``(softmax(x) - (1 - s)·onehot - s/V) · grad``, a new contiguous [n_rows, n_cols]
        tensor of the logits' dtype.

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``calculate_gradients``).
    """
    n_rows, n_cols = x2d.shape
    device = x2d.device
    dx = empty_contiguous_like(x2d)
    if dx.numel() == 0:
        return dx
    smoothing = label_smoothing > 0
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(x2d), device, spec_key(target1d), target1d.stride(0), spec_key(lse), spec_key(grad1d),
        grad1d.stride(0), vocab_start_index, ignore_index, smoothing, tile)
    p = _BWD_PLANS.get(key) if key is not None else None
    if p is None:
        if tile is None:
            tile = pick(BWD_TILES, n_cols)
        p = remember_plan(_BWD_PLANS, key, planned(
            _cross_entropy_bwd_kernel, (cdiv(n_rows, tile.BLOCK_M), cdiv(n_cols, tile.BLOCK_N)), device,
            dict(BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, ACC=TL_DTYPE[acc_dtype(x2d.dtype)], SMOOTHING=smoothing,
                 num_warps=tile.num_warps)))
    launch_planned(
        _cross_entropy_bwd_kernel, p, device,
        x2d, target1d, lse, grad1d, dx,
        smoothing_coefs(label_smoothing, vocab_size or n_cols, lse.dtype, device) if smoothing else lse,
        n_rows, n_cols, *x2d.stride(), target1d.stride(0), grad1d.stride(0), vocab_start_index, ignore_index,
    )
    return dx


# Launch plans by input signature (fusedlib.runtime.LaunchPlan): the tile, grid and bound launch
# of a call are made once per shape, strides, dtypes, addresses modulo 16, ids and switches.
_FWD_PLANS: dict = plan_cache()
_BWD_PLANS: dict = plan_cache()
