"""The second stage of the two-stage reductions (``fusedlib.kernels.reduce.sum_partials``).

Against a float64 sum of the same partials, for every tile of ``SUM_PARTIALS_TILES`` and
widths that are not multiples of any tile (1, odd, just past a table bound), partial counts
from 1 to a persistent grid's, and every output dtype. The bound is derived, not tuned: a
float32 sum of n terms in any order is within (n - 1)·2^-24·sum|x| of the exact sum (float64:
2^-53), and the cast to the output dtype rounds once more, by at most half an ulp of the
result (finfo.eps·|sum|/2, to nearest).
"""
from __future__ import annotations

import pytest
import torch

from fusedlib.kernels.launch import pick
from fusedlib.kernels.reduce import SUM_PARTIALS_TILES, sum_partials

from conftest import DEVICE  # noqa: I001

SHAPES = [(1, 1), (1, 7), (3, 5), (528, 384), (17, 513), (100, 2049), (33, 8193), (5, 20000)]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(out: torch.Tensor, partials: torch.Tensor) -> None:
    p64 = partials.double()
    exact = p64.sum(0)
    unit = 2.0 ** -53 if partials.dtype == torch.float64 else 2.0 ** -24
    bound = (partials.shape[0] - 1) * unit * p64.abs().sum(0) + torch.finfo(out.dtype).eps / 2 * exact.abs()
    err = (out.double() - exact).abs()
    assert out.shape == exact.shape and out.device == partials.device
    assert bool((err <= bound * (1 + 1e-12) + torch.finfo(out.dtype).tiny).all()), (
        f"max error {float((err - bound).max()):.3g} over the bound, {list(partials.shape)} -> {out.dtype}")


@pytest.mark.parametrize("n_partials, n_cols", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_sum_partials_against_float64(n_partials, n_cols, out_dtype):
    partials = torch.randn(n_partials, n_cols, device=DEVICE, dtype=torch.float32) * 3
    before = partials.clone()
    out = sum_partials(partials, out_dtype)
    assert out.dtype == out_dtype
    check(out, partials)
    assert torch.equal(partials, before), "the partials are not modified"
    assert torch.equal(sum_partials(partials, out_dtype), out), "the same bits on a second call"


@pytest.mark.parametrize("i", range(len(SUM_PARTIALS_TILES)))
def test_every_tile_of_the_table(i):
    """Each tile, given explicitly, at a width just past the previous bound (which the table
    picks it for) and at a width of 3 (the kernel masks both)."""
    tile = SUM_PARTIALS_TILES[i][1]
    width = (SUM_PARTIALS_TILES[i - 1][0] if i else 2) + 3
    assert pick(SUM_PARTIALS_TILES, width).BLOCK_M == tile.BLOCK_M
    for n_partials, n_cols in ((131, width), (9, 3)):
        partials = torch.randn(n_partials, n_cols, device=DEVICE, dtype=torch.float32)
        check(sum_partials(partials, torch.float32, tile=tile), partials)


def test_float64_partials():
    partials = torch.randn(40, 77, device=DEVICE, dtype=torch.float64)
    check(sum_partials(partials, torch.float64), partials)


def test_each_call_launches_the_tile_it_is_given(spy_launches):
    """The same partials summed with each tile of the table in turn: every call launches the
    tile it is given (BLOCK_M partial rows by BLOCK_N columns), within the float64 sum's bound."""
    partials = torch.randn(40, 50, device=DEVICE, dtype=torch.float32)
    for _, tile in SUM_PARTIALS_TILES:
        check(sum_partials(partials, torch.float32, tile=tile), partials)
    seen = [(c.kwargs["BLOCK_R"], c.kwargs["BLOCK_C"]) for c in spy_launches]
    assert seen == [(tile.BLOCK_M, tile.BLOCK_N) for _, tile in SUM_PARTIALS_TILES]
