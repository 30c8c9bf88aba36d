"""Second stage of the deterministic two-stage reductions (bias, gamma, beta gradients).

A backward kernel writes one float32 partial sum per program and column,
``partials[n_programs, n_cols]``; :func:`sum_partials` adds them over programs in a fixed
order and casts to the parameter's dtype in the same pass. No atomics, so the result is
bit-identical from run to run. With one row program (small inputs, see
``launch.FOLD_TILES``) there is nothing to add: :func:`partials_buffer` then hands the kernel
the result itself, in the parameter's dtype (the kernel's store rounds once, as the second
stage would), and :func:`finish_partials` skips the second launch. (``partials.sum(0)`` in PyTorch does the same work but
reads the [R, C] matrix column-strided and ran at under 1 TB/s for R = 264, C = 16384 on
the H200, 24 µs against the ~6 µs this kernel needs.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import launch_planned, plan_cache, planned, remember_plan, tensor_key
from .launch import HUGE, TL_DTYPE, Tile, TileTable, acc_dtype, cdiv, pick

__all__ = ["sum_partials", "partials_buffer", "finish_partials"]


@triton.jit
def _sum_partials_kernel(
    P_ptr,  # partial sums, [n_partials, n_cols], contiguous, ACC
    OUT_ptr,  # result, [n_cols], the parameter's dtype
    n_partials,
    n_cols,
    BLOCK_R: tl.constexpr,  # partial rows per step
    BLOCK_C: tl.constexpr,  # columns per program
    ACC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
    for r in range(0, n_partials, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(P_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT_ptr + cols, tl.sum(acc, axis=0).to(OUT_ptr.dtype.element_ty), mask=col_mask)


# Tiles by width, as (upper bound of n_cols, Tile): BLOCK_M partial rows per step by BLOCK_N
# columns per program. A program's loop over the partial rows is serial, so a narrow row needs
# narrow column blocks (more programs) and tall row blocks (fewer steps): at n_cols = 384 and
# 528 partial rows (a bias gradient of a persistent backward grid on 132 SMs) the former single
# tile, 16 x 256, ran 2 programs of 33 steps each.
SUM_PARTIALS_TILES: TileTable = (
    (512, Tile(BLOCK_M=128, BLOCK_N=16, num_warps=4)),
    (2048, Tile(BLOCK_M=64, BLOCK_N=32, num_warps=4)),
    (8192, Tile(BLOCK_M=32, BLOCK_N=64, num_warps=4)),
    (HUGE, Tile(BLOCK_M=16, BLOCK_N=256, num_warps=4)),
)


def sum_partials(partials: torch.Tensor, out_dtype: torch.dtype, tile: Tile | None = None) -> torch.Tensor:
    """Sum ``partials`` [n_partials, n_cols] over dim 0 and cast to ``out_dtype``.

    Args:
        partials: contiguous float32 (or float64) tensor [n_partials, n_cols], n_partials >= 1.
        out_dtype: dtype of the result.
        tile: launch settings (None: ``pick(SUM_PARTIALS_TILES, n_cols)``): BLOCK_M partial
            rows per step, BLOCK_N columns per program.

    Returns:
        A new [n_cols] tensor: the sum in ``partials``' dtype, added in a fixed order (the same
        bits on every run for a given tile), rounded once to ``out_dtype``.

    Source: the second stage of Triton's layer-norm tutorial
    (``python/tutorials/05-layer-norm.py``).
    """
    n_partials, n_cols = partials.shape
    device = partials.device
    out = torch.empty(n_cols, dtype=out_dtype, device=device)
    key = None if torch.compiler.is_compiling() else (  # no plan in a compile trace (fake tensors: no data pointer)
        tensor_key(partials), device, out_dtype, tile)
    p = _PLANS.get(key) if key is not None else None
    if p is None:
        if tile is None:
            tile = pick(SUM_PARTIALS_TILES, n_cols)
        p = remember_plan(_PLANS, key, planned(
            _sum_partials_kernel, (cdiv(n_cols, tile.BLOCK_N),), device,
            dict(BLOCK_R=tile.BLOCK_M, BLOCK_C=tile.BLOCK_N, ACC=TL_DTYPE[acc_dtype(partials.dtype)],
                 num_warps=tile.num_warps)))
    launch_planned(_sum_partials_kernel, p, device, partials, out, n_partials, n_cols)
    return out


# sum_partials' launch plans by input signature (fusedlib.runtime.LaunchPlan)
_PLANS: dict = plan_cache()


def partials_buffer(row_programs: int, n_cols: int, acc: torch.dtype, out_dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The buffer a backward kernel stores its per-program column sums in.

    Args:
        row_programs: programs along the rows (each stores one row of partial sums).
        n_cols: columns.
        acc: the accumulation dtype (float32, or float64).
        out_dtype: the dtype of the final sum (the parameter's).

    Returns:
        ``[row_programs, n_cols]`` of ``acc``; with one row program, ``[1, n_cols]`` of
        ``out_dtype``: the final result itself (:func:`finish_partials` returns it as is).

    Source: fusedlib's own.
    """
    if row_programs == 1:
        return torch.empty((1, n_cols), dtype=out_dtype, device=device)
    return torch.empty((row_programs, n_cols), dtype=acc, device=device)


def finish_partials(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The column sums of ``partials`` (from :func:`partials_buffer`) in ``out_dtype``, [n_cols]:
    the one row itself when there is one row of ``out_dtype``, else :func:`sum_partials`.

    Source: fusedlib's own.
    """
    if partials.shape[0] == 1 and partials.dtype == out_dtype:
        return partials.view(partials.shape[1])
    return sum_partials(partials, out_dtype)
