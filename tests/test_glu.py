"""Gated linear units (GEGLU, SwiGLU, row-weighted SwiGLU) and the row-weighted squared ReLU:
fusedlib's Triton kernels against float64 PyTorch references (autograd of the unfused forward)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusedlib import unfused
from fusedlib.fusions import fused_bias_geglu as geglu_mod
from fusedlib.fusions import fused_bias_swiglu as swiglu_mod
from fusedlib.fusions.fused_bias_geglu import BiasGeGLUFunction, GeGLUFunction, bias_geglu_impl
from fusedlib.fusions.fused_bias_swiglu import (
    BiasSwiGLUFunction,
    SwiGLUFunction,
    WeightedSwiGLUFunction,
    bias_swiglu_impl,
    weighted_bias_swiglu_impl,
)
from fusedlib.fusions.fused_weighted_squared_relu import (
    WeightedSquaredReLUFunction,
    weighted_clamped_squared_relu,
    weighted_clamped_squared_relu_back,
    weighted_squared_relu,
    weighted_squared_relu_back,
    weighted_squared_relu_impl,
)

from fusedlib.kernels.glu import BIAS_BWD_TILES
from fusedlib.kernels.launch import FOLD_TILES, cdiv, persistent_grid, pick

from conftest import DEVICE, FLOAT_DTYPES, assert_close  # noqa: I001

#: name -> (fused entry point taking (input, bias), float64 reference of the unbiased unit)
GLUS = {
    "swiglu": (bias_swiglu_impl, unfused.swiglu),
    "geglu": (bias_geglu_impl, unfused.geglu),
}
#: output widths h (input 2h): 1, odd, non-power-of-two, just past one 2 Ki column tile
HIDDEN = (1, 7, 300, 2049)


def _randn(shape, dtype, scale=2.0):
    return (scale * torch.randn(shape, device=DEVICE, dtype=torch.float32)).to(dtype)


def _reference(glu: str, y, bias, weights, g, clamp_value=None):
    """Float64 forward and autograd gradients (d y, d bias, d weights) of the unfused unit
    (for SwiGLU with ``clamp_value``: of the clamped unit, autograd through torch.clamp)."""
    ref = GLUS[glu][1] if clamp_value is None else (lambda x: unfused.clamped_swiglu(x, clamp_value))
    y64 = y.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    w64 = weights.detach().double().requires_grad_(True) if weights is not None else None
    x = y64 + b64 if b64 is not None else y64
    out = ref(x)
    if w64 is not None:
        out = out * w64.reshape(*out.shape[:-1], 1)
    out.backward(g.double())
    return (out.detach(), y64.grad, b64.grad if b64 is not None else None,
            w64.grad if w64 is not None else None)


def _check_glu(glu: str, y, bias=None, g=None, weights=None, clamp_value=None):
    """Fused forward and backward against the float64 reference; inputs and g never modified."""
    dtype = y.dtype
    y_before = y.detach().clone()
    kw = {} if clamp_value is None else {"clamp_value": clamp_value}  # only SwiGLU takes a clamp
    if weights is None:
        out = GLUS[glu][0](y, bias, **kw)
    else:
        out = weighted_bias_swiglu_impl(y, None, weights, **kw)
    h = y.shape[-1] // 2
    assert out.shape == (*y.shape[:-1], h) and out.dtype == dtype and out.is_contiguous()
    g = _randn(out.shape, dtype, 1.0) if g is None else g
    g_before = g.clone()
    out64, dy64, db64, dw64 = _reference(glu, y, bias, weights, g, clamp_value)
    assert_close(out, out64, dtype)
    out.backward(g)
    assert torch.equal(g, g_before), "grad_output was modified"
    assert torch.equal(y.detach(), y_before), "input was modified"
    assert y.grad.dtype == dtype and y.grad.shape == y.shape
    # float32: dy multiplies g·x2·act'(x1) with |g·x2| up to ~30 and x1 = y + b rounded in
    # float32 (the reference adds exactly): a few 1e-5 absolute; the others: one output rounding.
    assert_close(y.grad, dy64, dtype, scale=4.0 if dtype == torch.float32 else 1.0)
    if clamp_value is not None:
        # where a clamp is active (x1 = y1 + b1 > c, or |x2| > c) the gradient is exactly 0
        x = y.detach().double() + (bias.detach().double() if bias is not None else 0.0)
        x1, x2 = torch.chunk(x, 2, -1)
        active = torch.cat((x1 > clamp_value, x2.abs() > clamp_value), -1)
        assert torch.all(y.grad[active] == 0), "non-zero gradient where a clamp is active"
    rows = max(1, y.numel() // y.shape[-1])
    if bias is not None:
        assert bias.grad.dtype == bias.dtype and bias.grad.shape == bias.shape
        assert_close(bias.grad, db64, dtype, scale=rows**0.5)
    if weights is not None:
        assert weights.grad.dtype == weights.dtype and weights.grad.shape == weights.shape
        # dw sums h products in float32 (formed from y's values exactly), then rounds to w's dtype
        assert_close(weights.grad, dw64, weights.dtype, scale=max(1.0, h**0.5))


# ------------------------------------------------------------------ GEGLU / SwiGLU


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_glu_forward_backward_2d(glu, dtype, h, with_bias):
    rows = 3 if h > 1000 else 17
    y = _randn((rows, 2 * h), dtype).requires_grad_(True)
    b = _randn((2 * h,), dtype, 1.0).requires_grad_(True) if with_bias else None
    _check_glu(glu, y, b)


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_glu_forward_backward_float64(glu, with_bias):
    # float64 inputs compute in float64 (both backward kernels), so the activation and its
    # derivative, constants included (GEGLU's c0, c1, c2 = 3·c0·c1), must hold float64's accuracy:
    # a c2 off by 2e-6 relative moves dy by ~1e-7, hidden under float32's tolerance
    y = _randn((17, 2 * 300), torch.float64).requires_grad_(True)
    b = _randn((2 * 300,), torch.float64, 1.0).requires_grad_(True) if with_bias else None
    _check_glu(glu, y, b)


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_glu_3d_bias_grad_over_s_and_b(glu, dtype):
    y = _randn((5, 3, 2 * 48), dtype).requires_grad_(True)  # [s, b, 2h]
    b = _randn((2 * 48,), dtype, 1.0).requires_grad_(True)
    _check_glu(glu, y, b)


@pytest.mark.parametrize("glu", GLUS)
def test_glu_single_row_and_empty(glu):
    _check_glu(glu, _randn((1, 2 * 130), torch.float32).requires_grad_(True))
    y = _randn((0, 2 * 16), torch.float32).requires_grad_(True)
    b = _randn((32,), torch.float32).requires_grad_(True)
    out = GLUS[glu][0](y, b)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert y.grad.shape == (0, 32) and torch.equal(b.grad, torch.zeros_like(b))
    y3 = _randn((0, 4, 2 * 8), torch.float32).requires_grad_(True)
    assert GLUS[glu][0](y3, None).shape == (0, 4, 8)
    # zero width: y [rows, 0] is h = 0, an output of [rows, 0] (no tile table covers h = 0)
    for b0 in (None, _randn((0,), torch.float32).requires_grad_(True)):
        y0 = _randn((3, 0), torch.float32).requires_grad_(True)
        out = GLUS[glu][0](y0, b0)
        assert out.shape == (3, 0)
        out.sum().backward()
        assert y0.grad.shape == (3, 0) and (b0 is None or b0.grad.shape == (0,))


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_glu_non_contiguous_transposed_input_and_grad(glu, dtype):
    y = _randn((2 * 40, 21), dtype).t().requires_grad_(True)  # [21, 80], strides (1, 21)
    assert not y.is_contiguous()
    g = _randn((40, 21), dtype, 1.0).t()  # [21, 40], transposed too
    b = _randn((80,), dtype, 1.0).requires_grad_(True)
    _check_glu(glu, y, b, g)


@pytest.mark.parametrize("glu", GLUS)
def test_glu_non_contiguous_sliced_rows_3d_permuted_and_strided_bias(glu):
    # a column slice of a wider matrix: row stride 3·h, not 2·h (Megatron's .view would fail)
    base = _randn((9, 3 * 24), torch.float32)
    y = base[:, : 2 * 24].requires_grad_(True)
    assert not y.is_contiguous()
    _check_glu(glu, y, _randn((2 * 24,) * 1, torch.float32).requires_grad_(True))
    # [b, s, 2h] permuted to [s, b, 2h]: leading dims not mergeable, reshape copies once
    y3 = _randn((4, 6, 2 * 20), torch.float32).permute(1, 0, 2).requires_grad_(True)
    assert not y3.is_contiguous()
    _check_glu(glu, y3)
    # a strided bias
    b = _randn((2 * 2 * 20,), torch.float32)[::2].requires_grad_(True)
    _check_glu(glu, _randn((6, 40), torch.float32).requires_grad_(True), b)


@pytest.mark.parametrize("glu", GLUS)
def test_glu_multi_program_bias_reduction(glu):
    # many more rows than one backward program holds: the two-stage bias reduction is exercised
    y = _randn((1031, 2 * 12), torch.float32).requires_grad_(True)
    _check_glu(glu, y, _randn((24,), torch.float32).requires_grad_(True))


@pytest.mark.parametrize("glu", GLUS)
def test_glu_bias_backward_on_several_row_programs(glu, spy_launches):
    # h = 20 (tiles of 32 rows): 1031 rows are 33 tiles, more than FOLD_TILES, so the persistent
    # grid has several row programs on the CPU too (7 of 160 rows; h = 12's tiles of 256 rows
    # fold into one): each program's first row and the second stage (sum_partials) are exercised
    h, n_rows = 20, 1031
    tile = pick(BIAS_BWD_TILES, h)
    row_programs, _ = persistent_grid(n_rows, tile.BLOCK_M, tile.programs_per_sm, torch.device(DEVICE),
                                      cdiv(h, tile.BLOCK_N), fold_tiles=FOLD_TILES)
    assert row_programs > 1
    y = _randn((n_rows, 2 * h), torch.float32).requires_grad_(True)
    _check_glu(glu, y, _randn((2 * h,), torch.float32).requires_grad_(True))
    # the backward with a bias launched that persistent grid of BIAS_BWD_TILES' tile (not the
    # forward table's tile, whose grid has one program per tile)
    bwd = [c for c in spy_launches if c.kernel == "_bias_glu_bwd_kernel"]
    assert [(c.grid, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in bwd] == \
        [((row_programs, cdiv(h, tile.BLOCK_N)), tile.BLOCK_M, tile.BLOCK_N)]


def test_a_tile_passed_to_the_launchers_is_the_one_launched(spy_launches):
    # fusedlib.bench.tune times every candidate tile on the same inputs: each call launches its own
    # tile (not the plan of an earlier call of the same signature with another tile) and computes
    # the unit's values with it, plain, with a bias and with row weights (whose gradient sums the
    # partial sums of h = 24's two column tiles of 16)
    from fusedlib.kernels.glu import TILES, glu_bwd, glu_fwd
    from fusedlib.kernels.launch import Tile

    h = 24
    y = _randn((9, 2 * h), torch.float32)
    g = _randn((9, h), torch.float32, 1.0)
    b = _randn((2 * h,), torch.float32, 1.0)
    w = torch.rand(9, 1, device=DEVICE).to(torch.bfloat16)  # router weights of another dtype than y's
    for bias, weights in ((None, None), (b, None), (None, w)):
        out64, dy64, db64, dw64 = _reference("swiglu", y, bias, weights, g)
        for tile in (Tile(BLOCK_M=2, BLOCK_N=16, num_warps=4), Tile(BLOCK_M=4, BLOCK_N=64, num_warps=4), None):
            spy_launches.clear()
            out = glu_fwd(y, bias, weights, "silu", tile=tile)
            dy, db, dw = glu_bwd(g, y, bias, weights, "silu", tile=tile)
            fwd_tile = tile or pick(TILES, h)
            bwd_tile = tile or pick(TILES if bias is None else BIAS_BWD_TILES, h)
            launched = [(c.kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in spy_launches if "glu" in c.kernel]
            assert launched == [
                ("_glu_fwd_kernel", fwd_tile.BLOCK_M, fwd_tile.BLOCK_N),
                ("_glu_bwd_kernel" if bias is None else "_bias_glu_bwd_kernel", bwd_tile.BLOCK_M, bwd_tile.BLOCK_N)]
            assert_close(out, out64, torch.float32)
            assert_close(dy, dy64, torch.float32, scale=4.0)
            if bias is not None:
                assert_close(db, db64, torch.float32, scale=9**0.5)
            if weights is not None:
                assert dw.dtype == weights.dtype  # summed in float32, rounded once to w's dtype
                assert_close(dw, dw64, weights.dtype, scale=h**0.5)


def test_glu_backward_kernel_refuses_a_bias_with_row_weights():
    # the bias backward kernel has no row weights: it would return the unweighted gradient
    from fusedlib.kernels.glu import glu_bwd

    y, g = _randn((4, 2 * 8), torch.float32), _randn((4, 8), torch.float32, 1.0)
    with pytest.raises(NotImplementedError, match="both a bias and row weights"):
        glu_bwd(g, y, _randn((2 * 8,), torch.float32), torch.rand(4, 1, device=DEVICE), "silu")


def test_glu_large_values_do_not_overflow():
    # |y| up to 1e4: sigmoid/tanh saturate without inf or NaN (and without interpreter warnings)
    y = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE).requires_grad_(True)
    for glu in GLUS:
        y.grad = None
        _check_glu(glu, y)


# Triton's interpreter runs the kernels in NumPy, which warns of the float32 overflow of x² that a
# GPU performs silently (inf, as IEEE): the kernels take that inf into account.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_glu_saturated_values_give_the_limits(dtype):
    # Past |x| = 1.8e19 x² overflows in float32: GeGLU's gradient (1 - t²)·(c0 + c2·x²) was
    # 0·inf = NaN where its limit is 1 (x > 0) or 0.
    # y2 = 1 and g = 0.5 keep every product finite; the float64 reference needs no overflow.
    big = torch.finfo(dtype).max
    x1 = [-big, -1e30, -2e19, -1e5, 1e5, 2e19, 1e30, big]
    y = torch.tensor([x1 + [1.0] * len(x1)] * 3, dtype=torch.float64).to(dtype).to(DEVICE).requires_grad_(True)
    for glu in GLUS:
        y.grad = None
        _check_glu(glu, y, g=torch.full((3, len(x1)), 0.5, device=DEVICE, dtype=dtype))
        pos = y.detach()[:, : len(x1)] > 0
        assert torch.equal(y.grad[:, : len(x1)], torch.where(pos, 0.5, 0.0).to(dtype)), glu


# ------------------------------------------------------------------ weighted SwiGLU (MoE)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("w_dtype", [torch.float32, "same"])
@pytest.mark.parametrize("h", (1, 37, 2500))
def test_weighted_swiglu(dtype, w_dtype, h):
    w_dtype = dtype if w_dtype == "same" else w_dtype
    rows = 3 if h > 1000 else 19
    y = _randn((rows, 2 * h), dtype).requires_grad_(True)
    w = torch.rand(rows, 1, device=DEVICE).to(w_dtype).requires_grad_(True)
    _check_glu("swiglu", y, weights=w)


def test_weighted_swiglu_3d_and_non_contiguous():
    y = _randn((3, 5, 2 * 33), torch.float32).requires_grad_(True)  # [s, b, 2h], weights [s·b, 1]
    w = torch.rand(15, 1, device=DEVICE).requires_grad_(True)
    _check_glu("swiglu", y, weights=w)
    yt = _randn((2 * 33, 10), torch.bfloat16).t().requires_grad_(True)  # transposed
    wt = torch.rand(10, 2, device=DEVICE)[:, :1].requires_grad_(True)  # strided weights [10, 1]
    assert not wt.is_contiguous()
    _check_glu("swiglu", yt, g=_randn((33, 10), torch.bfloat16, 1.0).t(), weights=wt)


def test_weighted_swiglu_empty():
    y = _randn((0, 8), torch.float32).requires_grad_(True)
    w = torch.rand(0, 1, device=DEVICE).requires_grad_(True)
    out = weighted_bias_swiglu_impl(y, None, w)
    out.sum().backward()
    assert out.shape == (0, 4) and y.grad.shape == (0, 8) and w.grad.shape == (0, 1)


def test_weighted_swiglu_bias_not_implemented():
    y = _randn((4, 8), torch.float32)
    with pytest.raises(NotImplementedError, match="Bias is not supported for weighted swiglu fusion"):
        weighted_bias_swiglu_impl(y, _randn((8,), torch.float32), torch.rand(4, 1, device=DEVICE))


# ------------------------------------------------------------------ clamped SwiGLU (clamp_value)

#: c, exactly representable in every dtype, with its neighbours c ± eps too (1 <= c < 2)
CLAMP = 1.5


def _boundary_values(dtype):
    """Values at, just inside and just outside ±c in ``dtype`` (c in [1, 2): one ulp = eps)."""
    eps = torch.finfo(dtype).eps
    c = CLAMP
    return [c, c + eps, c - eps, -c, -c - eps, -c + eps]


def _straddling(shape, dtype, boundary=True):
    """Random [..., 2h] inputs about half of which lie beyond ±c; with ``boundary``, exact
    boundary values are written into both halves of the first rows (leave it off when a bias
    is added, since y + b would move them, or when the tensor is transposed afterwards)."""
    y = _randn(shape, dtype, scale=1.5 * CLAMP)  # |N(0, 1.5c)| > c with probability ~1/2
    if boundary:
        h = shape[-1] // 2
        rows = y.view(-1, shape[-1])
        for k, v in enumerate(_boundary_values(dtype)):
            r, j = divmod(k, h)
            if r < rows.shape[0]:
                rows[r, j] = v  # gate half
                rows[r, h + j] = v  # linear half
    return y


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,))
@pytest.mark.parametrize("h", (1, 7, 2049))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_clamped_swiglu_forward_backward(dtype, h, with_bias):
    # Tolerances as for the unclamped unit (_check_glu): the kernel clamps the same values the
    # reference clamps (c and the inputs are exact in every dtype; x1 = y + b is exact in float32
    # for 16-bit inputs, and lands within one float32 rounding of c for float32 with
    # probability ~1e-7), then computes the same unit on bounded values.
    rows = 3 if h > 1000 else 17
    y = _straddling((rows, 2 * h), dtype, boundary=not with_bias).requires_grad_(True)
    b = _randn((2 * h,), dtype, 1.0).requires_grad_(True) if with_bias else None
    _check_glu("swiglu", y, b, clamp_value=CLAMP)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,))
@pytest.mark.parametrize("w_dtype", [torch.float32, "same"])
@pytest.mark.parametrize("h", (1, 37))
def test_clamped_weighted_swiglu(dtype, w_dtype, h):
    w_dtype = dtype if w_dtype == "same" else w_dtype
    y = _straddling((19, 2 * h), dtype).requires_grad_(True)
    w = torch.rand(19, 1, device=DEVICE).to(w_dtype).requires_grad_(True)
    _check_glu("swiglu", y, weights=w, clamp_value=CLAMP)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,))
def test_clamped_swiglu_boundary(dtype):
    # Megatron's rule: the gradient passes at x1 = c and |x2| = c exactly, and is 0 one ulp
    # beyond (masks y_1 <= c and -c <= y_2 <= c); torch.clamp's autograd agrees.
    c, eps = CLAMP, torch.finfo(dtype).eps
    y1 = [c, c + eps, c - eps, 10 * c, -10 * c, 0.25, -c]
    y2 = [c, -c, c + eps, -c - eps, c - eps, 0.5, -10 * c]
    zero1 = [False, True, False, True, False, False, False]
    zero2 = [False, False, True, True, False, False, True]
    y = torch.tensor([y1 + y2], device=DEVICE, dtype=torch.float64).to(dtype).requires_grad_(True)
    g = torch.full((1, len(y1)), 0.75, device=DEVICE, dtype=dtype)
    _check_glu("swiglu", y, g=g, clamp_value=c)
    assert (y.grad[0] == 0).tolist() == zero1 + zero2
    # the same through a bias: x = y + b with y = 1.0 and b = 0.5 lands exactly on c
    yb = torch.tensor([[1.0, 1.0 + 2 * eps, 1.0, 1.0]], device=DEVICE, dtype=dtype).requires_grad_(True)
    b = torch.tensor([0.5, 0.5, 0.5, -2.5], device=DEVICE, dtype=dtype).requires_grad_(True)  # x2 = 1.5, -1.5
    out = bias_swiglu_impl(yb, b, clamp_value=c)
    out.backward(torch.ones_like(out))
    assert (yb.grad[0] == 0).tolist() == [False, True, False, False]
    assert torch.equal(b.grad, yb.grad[0])  # one row: d bias = d y


def test_clamp_value_is_applied_as_a_float32_number():
    # c = 0.1 is 0.100000001490116... in float32, as Megatron's float32 clamp sees it: the
    # float32 input 0.1 (the same float32 number) sits exactly on the bound, so its gradient passes.
    y = torch.tensor([[0.1, 1.0]], device=DEVICE).requires_grad_(True)
    out = bias_swiglu_impl(y, None, clamp_value=0.1)
    out.backward(torch.ones_like(out))
    assert y.grad[0, 0] != 0 and y.grad[0, 1] == 0  # y2 = 1.0 > 0.1 is clamped
    assert out.item() == pytest.approx(unfused.silu(torch.tensor(0.1)).item() * 0.1, rel=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_clamped_swiglu_non_contiguous(dtype):
    y = _straddling((2 * 40, 21), dtype, boundary=False).t().requires_grad_(True)  # [21, 80], strides (1, 21)
    assert not y.is_contiguous()
    g = _randn((40, 21), dtype, 1.0).t()
    b = _randn((2 * 80,), dtype, 1.0)[::2].requires_grad_(True)  # a strided bias
    _check_glu("swiglu", y, b, g, clamp_value=CLAMP)
    base = _straddling((9, 3 * 24), dtype, boundary=False)
    y = base[:, : 2 * 24].requires_grad_(True)  # row stride 3h
    _check_glu("swiglu", y, clamp_value=CLAMP)
    y3 = _straddling((4, 6, 2 * 20), dtype, boundary=False).permute(1, 0, 2).requires_grad_(True)  # [s, b, 2h]
    w = torch.rand(24, 1, device=DEVICE).requires_grad_(True)
    _check_glu("swiglu", y3, weights=w, clamp_value=CLAMP)


def test_clamped_swiglu_multi_program_bias_reduction():
    y = _straddling((1031, 2 * 12), torch.float32, boundary=False).requires_grad_(True)
    _check_glu("swiglu", y, _randn((24,), torch.float32).requires_grad_(True), clamp_value=CLAMP)


def test_clamp_value_none_is_the_unclamped_kernel(spy_launches):
    # clamp_value=None launches the kernels without the clamp (HAS_CLAMP=False, the very same
    # specialization as before clamp_value existed), so the results are bitwise the unclamped
    # ones; a clamp that no input reaches launches HAS_CLAMP=True and gives the same bits.
    def clamps():  # HAS_CLAMP of each GLU kernel launch so far
        return [c.kwargs["HAS_CLAMP"] for c in spy_launches if "HAS_CLAMP" in c.kwargs]

    def run(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        out = fn(*leaves)
        out.backward(torch.linspace(-2, 2, out.numel(), device=DEVICE).view(out.shape).to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    y = _randn((33, 2 * 50), torch.bfloat16)
    b = _randn((100,), torch.bfloat16, 1.0)
    w = torch.rand(33, 1, device=DEVICE)
    cases = [
        (lambda y, b: bias_swiglu_impl(y, b), lambda y, b: bias_swiglu_impl(y, b, clamp_value=None),
         lambda y, b: BiasSwiGLUFunction.apply(y, b, False, False, None), (y, b)),
        (lambda y: bias_swiglu_impl(y, None), lambda y: bias_swiglu_impl(y, None, False, False, None),
         lambda y: SwiGLUFunction.apply(y, False, False, None), (y,)),
        (lambda y, w: weighted_bias_swiglu_impl(y, None, w), lambda y, w: weighted_bias_swiglu_impl(y, None, w, False, None),
         lambda y, w: WeightedSwiGLUFunction.apply(y, w, False, None), (y, w)),
    ]
    for plain, *with_none, tensors in cases:
        expected = run(plain, *tensors)
        for fn in with_none:
            assert all(torch.equal(a, e) for a, e in zip(run(fn, *tensors), expected))
    assert clamps() and not any(clamps())
    spy_launches.clear()
    far = 1e30  # finite, > 0, beyond every input: the clamped kernels change nothing
    for plain, clamped, tensors in (
        (lambda y, b: bias_swiglu_impl(y, b), lambda y, b: bias_swiglu_impl(y, b, clamp_value=far), (y, b)),
        (lambda y: bias_swiglu_impl(y, None), lambda y: bias_swiglu_impl(y, None, clamp_value=far), (y,)),
        (lambda y, w: weighted_bias_swiglu_impl(y, None, w), lambda y, w: weighted_bias_swiglu_impl(y, None, w, clamp_value=far),
         (y, w)),
    ):
        assert all(torch.equal(a, e) for a, e in zip(run(clamped, *tensors), run(plain, *tensors)))
    assert clamps().count(True) == 6 and clamps().count(False) == 6


def _bad_clamp_cases():
    t = lambda *s: torch.randn(*s, device=DEVICE)  # noqa: E731
    calls = {
        "bias_swiglu_impl": lambda c: bias_swiglu_impl(t(4, 8), t(8), clamp_value=c),
        "bias_swiglu_impl nobias": lambda c: bias_swiglu_impl(t(4, 8), None, False, False, c),
        "weighted": lambda c: weighted_bias_swiglu_impl(t(4, 8), None, torch.rand(4, 1, device=DEVICE), clamp_value=c),
        "Function": lambda c: SwiGLUFunction.apply(t(4, 8), False, False, c),
        "clamped_swiglu": lambda c: swiglu_mod.clamped_swiglu(t(4, 8), c),
    }
    values = [
        (0.0, ValueError, "clamp_value must be a finite number > 0"),
        (-1.0, ValueError, "clamp_value must be a finite number > 0"),
        (math.inf, ValueError, "clamp_value must be a finite number > 0"),
        (math.nan, ValueError, "clamp_value must be a finite number > 0"),
        # finite in float64, inf in the kernels' float32: the clamp was silently no clamp
        (1e39, ValueError, r"clamp_value must be a finite number > 0 in float32's normal range .* is inf"),
        # > 0 in float64, 0 in the kernels' float32: everything was clamped to 0
        (1e-46, ValueError, r"clamp_value must be a finite number > 0 in float32's normal range .* subnormal or 0"),
        (-1e39, ValueError, "clamp_value must be a finite number > 0"),
        ("7", TypeError, "clamp_value must be a float > 0"),
        (True, TypeError, "clamp_value must be a float > 0"),
        (torch.tensor(7.0), TypeError, "clamp_value must be a float > 0"),
    ]
    cases = [(f"{name}-{v!r}", call, v, err, match) for name, call in calls.items() for v, err, match in values]
    cases.append(("clamped_swiglu-None", calls["clamped_swiglu"], None, TypeError, "clamp_value must be a float > 0"))
    return cases


@pytest.mark.parametrize("case", _bad_clamp_cases(), ids=lambda c: c[0])
def test_bad_clamp_value_raises(case):
    _, call, value, error, match = case
    with pytest.raises(error, match=match):
        call(value)


def test_clamped_plain_functions_refuse_a_missing_clamp_value():
    # the clamped functions take c as a required argument: a check that read None as "no clamp"
    # (allow_none) would run the unclamped kernel without a word
    y, g, b = _randn((4, 8), torch.float32), _randn((4, 4), torch.float32, 1.0), _randn((8,), torch.float32)
    w = torch.rand(4, 1, device=DEVICE)
    for call in (lambda c: swiglu_mod.clamped_swiglu(y, c),
                 lambda c: swiglu_mod.bias_clamped_swiglu(y, b, c),
                 lambda c: swiglu_mod.clamped_weighted_swiglu(y, w, c),
                 lambda c: swiglu_mod.clamped_swiglu_back(g, y, c),
                 lambda c: swiglu_mod.bias_clamped_swiglu_back(g, y, b, c),
                 lambda c: swiglu_mod.clamped_weighted_swiglu_back(g, y, w, c)):
        with pytest.raises(TypeError, match="clamp_value must be a float > 0, got NoneType"):
            call(None)
        with pytest.raises(ValueError, match="clamp_value must be a finite number > 0"):
            call(0.0)


def test_clamp_value_accepts_an_int_and_numpy_float():
    y = _straddling((5, 2 * 9), torch.float32)
    ref = bias_swiglu_impl(y, None, clamp_value=2.0)
    assert torch.equal(bias_swiglu_impl(y, None, clamp_value=2), ref)
    assert torch.equal(bias_swiglu_impl(y, None, clamp_value=np.float32(2.0)), ref)


def test_clamp_value_is_the_float32_number_on_every_backend():
    # the GPU passes c as a float32 argument; the interpreter once kept the float64 0.1, so a
    # float64 input was clamped at 0.1 there and at float32(0.1) on the GPU
    from fusedlib.fusions._glu import check_clamp_value
    c32 = float(np.float32(0.1))
    assert check_clamp_value(0.1) == c32 and check_clamp_value(np.float64(0.1)) == c32 and check_clamp_value(1) == 1.0
    y = torch.full((2, 4), 5.0, device=DEVICE, dtype=torch.float64)  # both halves above c: clamped to c
    out = bias_swiglu_impl(y, None, clamp_value=0.1)
    expected = torch.nn.functional.silu(torch.tensor(c32, dtype=torch.float64)) * c32
    assert torch.allclose(out, torch.full_like(out, expected.item()), rtol=1e-14, atol=0.0)


def test_clamped_plain_functions_match_reference():
    y = _straddling((5, 2, 2 * 65), torch.float32)
    b = _randn((130,), torch.float32, 1.0)
    g = _randn((5, 2, 65), torch.float32, 1.0)
    w = torch.rand(10, 1, device=DEVICE)
    y64, b64, g64, w64 = y.double(), b.double(), g.double(), w.double()
    c = CLAMP
    assert_close(swiglu_mod.clamped_swiglu(y, c), unfused.clamped_swiglu(y64, c), torch.float32)
    assert_close(swiglu_mod.bias_clamped_swiglu(y, b, c), unfused.bias_clamped_swiglu(y64, b64, c), torch.float32)
    assert_close(swiglu_mod.clamped_swiglu_back(g, y, c), unfused.clamped_swiglu_back(g64, y64, c), torch.float32)
    assert_close(swiglu_mod.bias_clamped_swiglu_back(g, y, b, c), unfused.bias_clamped_swiglu_back(g64, y64, b64, c),
                 torch.float32)
    y2, g2 = y.reshape(10, -1), g.reshape(10, -1)
    assert_close(swiglu_mod.clamped_weighted_swiglu(y2, w, c),
                 unfused.clamped_weighted_swiglu(y2.double(), w64, c), torch.float32)
    dy, dw = swiglu_mod.clamped_weighted_swiglu_back(g2, y2, w, c)
    dy64, dw64 = unfused.clamped_weighted_swiglu_back(g2.double(), y2.double(), w64, c)
    assert_close(dy, dy64, torch.float32)
    assert_close(dw, dw64, torch.float32, scale=65**0.5)


def test_clamped_backward_formulas_are_autograd_gradients():
    # unfused.clamped_swiglu_back (Megatron's masks) against autograd through torch.clamp, with
    # values on the boundaries: they agree there too (the gradient passes at ±c).
    c = 0.75
    y = torch.randn(6, 2 * 9, dtype=torch.float64)
    y[0, :4] = torch.tensor([c, -c, 2 * c, -2 * c], dtype=torch.float64)
    y[0, 9:13] = torch.tensor([c, -c, 2 * c, -2 * c], dtype=torch.float64)
    y.requires_grad_(True)
    g = torch.randn(6, 9, dtype=torch.float64)
    unfused.clamped_swiglu(y, c).backward(g)
    torch.testing.assert_close(y.grad, unfused.clamped_swiglu_back(g, y.detach(), c), atol=1e-12, rtol=1e-12)
    assert (y.grad[0, [0, 1, 9, 10]] != 0).all() and (y.grad[0, [2, 11, 12]] == 0).all()
    w = torch.rand(6, 1, dtype=torch.float64, requires_grad=True)
    y.grad = None
    unfused.clamped_weighted_swiglu(y, w, c).backward(g)
    dy, dw = unfused.clamped_weighted_swiglu_back(g, y.detach(), w.detach(), c)
    torch.testing.assert_close(y.grad, dy, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(w.grad, dw, atol=1e-12, rtol=1e-12)
    # a clamp no input reaches is the unclamped unit
    torch.testing.assert_close(unfused.clamped_swiglu(y.detach(), 1e6), unfused.swiglu(y.detach()), atol=1e-15, rtol=1e-15)


def test_clamped_gradcheck_float64():
    # float64 kernels compute in float64; inputs are kept 1e-2 away from ±c, where the
    # clamped unit is smooth, so finite differences (eps = 1e-6) see no kink.
    c = CLAMP

    def away(*shape):  # N(0, 2c) values moved out of the 1e-2 bands around ±c
        x = 2 * c * torch.randn(*shape, device=DEVICE, dtype=torch.float64)
        return torch.where(((x.abs() - c).abs() < 1e-2), x * 0.9, x)

    y, y3 = away(3, 10).requires_grad_(True), away(2, 3, 8).requires_grad_(True)
    w = torch.rand(3, 1, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, device=DEVICE, dtype=torch.float64, requires_grad=True)
    yb = (away(3, 10) - b.detach()).requires_grad_(True)  # x = yb + b lies away from ±c too
    assert ((((y.detach().abs() - c).abs()) >= 1e-2).all() and (((yb + b).detach().abs() - c).abs() >= 1e-2).all())
    assert (y.detach().abs() > c).any() and (y.detach().abs() < c).any()  # both sides of the clamp
    gc = torch.autograd.gradcheck
    assert gc(lambda y: SwiGLUFunction.apply(y, False, False, c), (y,))
    assert gc(lambda y, w: WeightedSwiGLUFunction.apply(y, w, False, c), (y, w))
    assert gc(lambda y: bias_swiglu_impl(y, None, clamp_value=c), (y3,))
    assert gc(lambda y, b: BiasSwiGLUFunction.apply(y, b, False, False, c), (yb, b))


# ------------------------------------------------------------------ weighted squared ReLU


def _check_squared_relu(x, w, clamp_scale=None, g=None):
    dtype = x.dtype
    x_before = x.detach().clone()
    out = weighted_squared_relu_impl(x, w, clamp_scale)
    assert out.shape == x.shape and out.dtype == dtype
    g = _randn(out.shape, dtype, 1.0) if g is None else g
    g_before = g.clone()
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    c = torch.relu(x64) if clamp_scale is None else clamp_scale * torch.tanh(torch.relu(x64) / clamp_scale)
    out64 = c * c * w64.reshape(*x.shape[:-1], 1)
    out64.backward(g.double())
    assert_close(out, out64.detach(), dtype)
    out.backward(g)
    assert torch.equal(g, g_before) and torch.equal(x.detach(), x_before)
    assert x.grad.dtype == dtype and w.grad.dtype == w.dtype and w.grad.shape == w.shape
    assert_close(x.grad, x64.grad, dtype)
    assert_close(w.grad, w64.grad, w.dtype, scale=max(1.0, x.shape[-1] ** 0.5))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", (1, 7, 2100))
@pytest.mark.parametrize("clamp_scale", [None, 1.5])
def test_weighted_squared_relu(dtype, h, clamp_scale):
    rows = 3 if h > 1000 else 21
    x = _randn((rows, h), dtype).requires_grad_(True)
    w = torch.rand(rows, 1, device=DEVICE).requires_grad_(True)  # float32, as MoE router probs
    _check_squared_relu(x, w, clamp_scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("clamp_scale", [1e2, 1e4, 1e8, 1e30])
def test_weighted_squared_relu_clamp_scale_large_against_the_input(dtype, clamp_scale):
    # relu(x)/s near 0: tanh's 1 - e^{-2z} form cancelled there (3 % off at s = 1e4, 0 for
    # s = 1e8); the clamp must tend to the unclamped square, at the dtype's accuracy
    x = _randn((5, 33), dtype).requires_grad_(True)
    w = torch.rand(5, 1, device=DEVICE).requires_grad_(True)
    _check_squared_relu(x, w, clamp_scale)


@pytest.mark.parametrize("clamp_scale", [1.5, 4.0])  # outputs O(1): float64 tolerances are absolute too
def test_weighted_squared_relu_soft_clamp_float64_both_branches(clamp_scale):
    # float64 inputs compute in float64, so the soft clamp must hold float64's accuracy on both
    # sides of its switch at r/s = SOFT_CLAMP_SERIES_BELOW = 0.125: the Taylor series of
    # tanh(z)/z below (every coefficient matters: its z^6 term alone is ~2e-7 at z = 0.125,
    # under float32's tolerance) and tanh above. Inputs z = x/s in [-0.05, 0.25).
    x = (clamp_scale * (0.3 * torch.rand(9, 40, device=DEVICE, dtype=torch.float64) - 0.05)).requires_grad_(True)
    z = x.detach() / clamp_scale
    assert ((z > 0.06) & (z < 0.125)).any() and (z > 0.125).any() and (z < 0).any()
    w = torch.rand(9, 1, device=DEVICE, dtype=torch.float64).requires_grad_(True)
    _check_squared_relu(x, w, clamp_scale)


def test_weighted_squared_relu_clamp_keeps_inf_inputs_at_the_clamp():
    x = torch.tensor([[-1.0, 0.0, 0.5, float("inf")]], device=DEVICE)
    out = weighted_squared_relu_impl(x, torch.ones(1, 1, device=DEVICE), 3.0)
    expected = (3.0 * torch.tanh(torch.relu(x.double()) / 3.0)) ** 2  # inf -> s·tanh(inf) = s
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("clamp_scale", [None, 3.0])
def test_weighted_squared_relu_keeps_nan_inputs(clamp_scale):
    # torch.relu(NaN) is NaN; tl.maximum(NaN, 0) is 0 (fmax), so the kernels once returned 0
    # output and gradients where the reference gives NaN
    x = torch.tensor([[float("nan"), 1.0, -2.0], [0.5, float("nan"), 0.0]], device=DEVICE, requires_grad=True)
    w = torch.tensor([[1.0], [2.0]], device=DEVICE, requires_grad=True)
    out = weighted_squared_relu_impl(x, w, clamp_scale)
    out.sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    c = torch.relu(x64) if clamp_scale is None else clamp_scale * torch.tanh(torch.relu(x64) / clamp_scale)
    (c * c * w64).sum().backward()
    nan = torch.isnan(x.detach())
    assert torch.equal(torch.isnan(out), nan) and torch.equal(torch.isnan(x.grad), nan)
    assert torch.isnan(w.grad).all()  # every row holds a NaN, so every row weight's gradient is NaN
    assert torch.allclose(out[~nan].double(), (c * c * w64)[~nan].detach(), rtol=1e-6, atol=0.0)
    assert torch.allclose(x.grad[~nan].double(), x64.grad[~nan], rtol=1e-6, atol=0.0)


def test_weighted_squared_relu_3d_non_contiguous_and_empty():
    x = _randn((4, 3, 30), torch.bfloat16).permute(1, 0, 2).requires_grad_(True)  # [3, 4, 30]
    w = torch.rand(12, 1, device=DEVICE).to(torch.bfloat16).requires_grad_(True)
    _check_squared_relu(x, w)
    xt = _randn((30, 8), torch.float32).t().requires_grad_(True)
    _check_squared_relu(xt, torch.rand(8, 1, device=DEVICE).requires_grad_(True), 3.0,
                        g=_randn((30, 8), torch.float32, 1.0).t())
    x0 = _randn((0, 5), torch.float32).requires_grad_(True)
    w0 = torch.rand(0, 1, device=DEVICE).requires_grad_(True)
    weighted_squared_relu_impl(x0, w0).sum().backward()
    assert w0.grad.shape == (0, 1)


@pytest.mark.parametrize("clamp_scale", [None, 1.5])
def test_weighted_squared_relu_strided_weights_and_grad_of_other_strides(clamp_scale):
    # weights [n, 1] with row stride 2 (a column of [n, 2]), and an input whose row stride (a
    # column slice of a wider matrix) differs from the contiguous gradient's: each tensor is
    # read with its own strides, forward and backward
    x = _randn((6, 2 * 20), torch.float32)[:, :20].requires_grad_(True)
    w = torch.rand(6, 2, device=DEVICE)[:, :1].requires_grad_(True)
    assert not x.is_contiguous() and w.stride(0) == 2
    g = _randn((6, 20), torch.float32, 1.0)
    assert g.stride() != x.stride()
    _check_squared_relu(x, w, clamp_scale, g=g)


def test_weighted_squared_relu_zero_width_gives_zero_weight_gradients():
    # h = 0: each row's weight gradient is the empty sum over its columns, 0 (not uninitialised memory)
    for clamp_scale in (None, 2.0):
        x = torch.empty(4, 0, device=DEVICE).requires_grad_(True)
        w = torch.rand(4, 1, device=DEVICE).requires_grad_(True)
        out = weighted_squared_relu_impl(x, w, clamp_scale)
        assert out.shape == (4, 0)
        out.sum().backward()
        assert x.grad.shape == (4, 0) and torch.equal(w.grad, torch.zeros_like(w))
        g = torch.empty(4, 0, device=DEVICE)
        w_nan = torch.full((4, 1), float("nan"), device=DEVICE)  # dweights does not involve w: still 0
        dx, dw = weighted_squared_relu_back(g, x.detach(), w_nan)
        assert dx.shape == (4, 0) and torch.equal(dw, torch.zeros_like(dw))


def test_clamp_scale_is_the_float32_number_on_every_backend():
    # the GPU kernels receive s as a float32 argument; float64 inputs compute in float64, so s
    # must be that float32 number in the interpreter too (s = 0.1 is 0.100000001490116... in
    # float32): outputs and gradients are those of the float64 unit at s = float32(0.1)
    s32 = float(np.float32(0.1))
    x = (0.3 * torch.rand(4, 9, device=DEVICE, dtype=torch.float64) - 0.05).requires_grad_(True)
    x.data[0, :2] = torch.tensor([100.0, math.inf], dtype=torch.float64)  # saturated: c = s exactly
    w = torch.rand(4, 1, device=DEVICE, dtype=torch.float64).requires_grad_(True)
    g = torch.randn(4, 9, device=DEVICE, dtype=torch.float64)
    out = weighted_squared_relu_impl(x, w, 0.1)
    out.backward(g)
    x64 = x.detach().clone().requires_grad_(True)
    w64 = w.detach().clone().requires_grad_(True)
    c = s32 * torch.tanh(torch.relu(x64) / s32)
    out64 = c * c * w64
    out64.backward(g)
    assert out[0, 0].item() == pytest.approx(s32 * s32 * w[0, 0].item(), rel=1e-14, abs=0.0)
    assert_close(out, out64.detach(), torch.float64)
    assert_close(x.grad, x64.grad, torch.float64)
    assert_close(w.grad, w64.grad, torch.float64)
    assert torch.equal(weighted_clamped_squared_relu(x.detach(), w.detach(), 0.1), out.detach())
    dx, dw = weighted_clamped_squared_relu_back(g, x.detach(), w.detach(), 0.1)
    assert torch.equal(dx, x.grad) and torch.equal(dw, w.grad)


def test_squared_relu_clamp_scale_takes_numpy_numbers_and_the_clamped_functions_refuse_none():
    # numpy's float32 and int64 are real numbers (clamp_value, eps and mscale take them): the
    # check took only Python's int and float; the clamped plain functions passed None to float(),
    # an unnamed TypeError
    x = _randn((5, 12), torch.float32)
    w = torch.rand(5, 1, device=DEVICE)
    g = _randn((5, 12), torch.float32, 1.0)
    want = weighted_squared_relu_impl(x, w, 2.0)
    for s in (np.float32(2.0), np.int64(2), np.float64(2.0), 2):
        assert torch.equal(weighted_squared_relu_impl(x, w, s), want), type(s)
        assert torch.equal(weighted_clamped_squared_relu(x, w, s), want), type(s)
        dx, dw = weighted_clamped_squared_relu_back(g, x, w, s)
        want_dx, want_dw = weighted_clamped_squared_relu_back(g, x, w, 2.0)
        assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    for call in (lambda: weighted_clamped_squared_relu(x, w, None),
                 lambda: weighted_clamped_squared_relu_back(g, x, w, None)):
        with pytest.raises(TypeError, match="clamp_scale must be a float > 0 .*got NoneType"):
            call()
    for bad, err, match in (("2", TypeError, "clamp_scale must be a float > 0, got str"),
                            (np.bool_(True), TypeError, "clamp_scale must be a float > 0, got numpy.bool"),
                            (np.float32("nan"), ValueError, "clamp_scale must be a number in float32's normal range"),
                            (10**400, ValueError, "clamp_scale must be a number in float32's normal range")):
        with pytest.raises(err, match=match):
            weighted_clamped_squared_relu(x, w, bad)
    with pytest.raises(TypeError, match="clamp_scale must be a float or None, got numpy.bool"):
        weighted_squared_relu_impl(x, w, np.bool_(False))


def test_squared_relu_plain_functions_match_reference():
    x = _randn((6, 50), torch.float32)
    w = torch.rand(6, 1, device=DEVICE)
    g = _randn((6, 50), torch.float32, 1.0)
    x64, w64, g64 = x.double(), w.double(), g.double()
    assert_close(weighted_squared_relu(x, w), unfused.weighted_squared_relu(x64, w64), torch.float32)
    assert_close(weighted_clamped_squared_relu(x, w, 2.0), unfused.weighted_squared_relu(x64, w64, 2.0),
                 torch.float32)
    for fused, ref in ((weighted_squared_relu_back(g, x, w), unfused.weighted_squared_relu_back(g64, x64, w64)),
                       (weighted_clamped_squared_relu_back(g, x, w, 2.0),
                        unfused.weighted_squared_relu_back(g64, x64, w64, 2.0))):
        assert_close(fused[0], ref[0], torch.float32)
        assert_close(fused[1], ref[1], torch.float32, scale=50**0.5)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float64])
def test_squared_relu_plain_backward_gives_the_weight_gradient_in_weights_dtype(w_dtype):
    # without autograd (which would cast it) dweights is summed in float32 and returned in the
    # weights' dtype, as the docstring says; dx in x's dtype
    x = _randn((6, 20), torch.float32)
    w = torch.rand(6, 1, device=DEVICE).to(w_dtype)
    g = _randn((6, 20), torch.float32, 1.0)
    for clamp_scale in (None, 2.0):
        if clamp_scale is None:
            dx, dw = weighted_squared_relu_back(g, x, w)
        else:
            dx, dw = weighted_clamped_squared_relu_back(g, x, w, clamp_scale)
        dx64, dw64 = unfused.weighted_squared_relu_back(g.double(), x.double(), w.double(), clamp_scale)
        assert dx.dtype == torch.float32 and dw.dtype == w_dtype and dw.shape == (6, 1)
        assert_close(dx, dx64, torch.float32)
        assert_close(dw, dw64, torch.float32 if w_dtype == torch.float64 else w_dtype, scale=20**0.5)


# ------------------------------------------------------------------ plain (no autograd) functions


@pytest.mark.parametrize("glu", GLUS)
def test_glu_plain_functions_match_reference(glu):
    mod = swiglu_mod if glu == "swiglu" else geglu_mod
    ref = GLUS[glu][1]
    back = unfused.swiglu_back if glu == "swiglu" else unfused.geglu_back
    y = _randn((5, 2, 2 * 65), torch.float32)
    b = _randn((130,), torch.float32, 1.0)
    g = _randn((5, 2, 65), torch.float32, 1.0)
    y64, b64, g64 = y.double(), b.double(), g.double()
    fwd, bias_fwd = getattr(mod, glu), getattr(mod, f"bias_{glu}")
    fwd_back, bias_back = getattr(mod, f"{glu}_back"), getattr(mod, f"bias_{glu}_back")
    assert_close(fwd(y), ref(y64), torch.float32)
    # Megatron's argument orders: bias_swiglu(y, bias) but bias_geglu(bias, y)
    biased = bias_fwd(y, b) if glu == "swiglu" else bias_fwd(b, y)
    assert_close(biased, ref(y64 + b64), torch.float32)
    # dy1 = g·y2·act'(y1). Compiled, exp is ex2.approx (relative error ~2^-22), so t = tanh or
    # sigma errs by <= 5e-7 absolute, and act' (which cancels: (1 - t²)·... against (1 + t)/2
    # for |y1| of a few units) by <= 3e-6 absolute for |y1| <= 4.5; times |g·y2| that can pass
    # conftest's float32 atol of 1e-5: scale it by 0.3·max|g·y2| (3e-6 / 1e-5) where larger than 1.
    amp = max(1.0, 0.3 * float((g64.abs() * (y64[..., 65:] + b64[65:]).abs().maximum(y64[..., 65:].abs())).max()))
    assert_close(fwd_back(g, y), back(g64, y64), torch.float32, scale=amp)
    assert_close(bias_back(g, y, b), back(g64, y64 + b64), torch.float32, scale=amp)


@pytest.mark.parametrize("glu", GLUS)
def test_bias_backward_plain_functions_check_the_bias(glu):
    # bias_*_back takes the bias like bias_*: unchecked, a strided bias would reach the kernel,
    # which reads it as contiguous (every other element of its storage), and a bias of the wrong
    # shape or dtype would be read past its end or reinterpreted, without an error
    mod = swiglu_mod if glu == "swiglu" else geglu_mod
    back = unfused.swiglu_back if glu == "swiglu" else unfused.geglu_back
    bias_back = getattr(mod, f"bias_{glu}_back")
    y = _randn((5, 2 * 9), torch.float32)
    g = _randn((5, 9), torch.float32, 1.0)
    b = _randn((2 * 18,), torch.float32, 1.0)[::2]  # [18], stride 2
    assert not b.is_contiguous()
    got = bias_back(g, y, b)
    assert torch.equal(got, bias_back(g, y, b.contiguous()))
    y64, b64 = y.double(), b.double()
    amp = max(1.0, 0.3 * float((g.double().abs() * (y64[..., 9:] + b64[9:]).abs()).max()))
    assert_close(got, back(g.double(), y64 + b64), torch.float32, scale=amp)
    for bad, err, match in ((_randn((9,), torch.float32), ValueError, r"bias must have shape \[2h\] with 2h = y"),
                            (b.double(), TypeError, "bias dtype torch.float64 must match y dtype"),
                            (_randn((1, 18), torch.float32), ValueError, "bias must be 1-D")):
        with pytest.raises(err, match=match):
            bias_back(g, y, bad)


def test_bias_plain_functions_take_a_strided_bias():
    # bias_swiglu, bias_geglu and the clamped SwiGLU with a bias read a strided bias as its
    # values (a contiguous copy), not as every element of its storage; forward and backward
    y = _straddling((5, 2 * 9), torch.float32, boundary=False)
    g = _randn((5, 9), torch.float32, 1.0)
    b = _randn((2 * 18,), torch.float32, 1.0)[::2]  # [18], stride 2
    assert not b.is_contiguous()
    y64, b64, g64 = y.double(), b.double(), g.double()
    assert_close(swiglu_mod.bias_swiglu(y, b), unfused.swiglu(y64 + b64), torch.float32)
    assert_close(geglu_mod.bias_geglu(b, y), unfused.geglu(y64 + b64), torch.float32)
    assert_close(swiglu_mod.bias_clamped_swiglu(y, b, CLAMP), unfused.bias_clamped_swiglu(y64, b64, CLAMP),
                 torch.float32)
    got = swiglu_mod.bias_clamped_swiglu_back(g, y, b, CLAMP)
    assert torch.equal(got, swiglu_mod.bias_clamped_swiglu_back(g, y, b.contiguous(), CLAMP))
    assert_close(got, unfused.bias_clamped_swiglu_back(g64, y64, b64, CLAMP), torch.float32, scale=4.0)


def test_clamped_plain_functions_apply_the_float32_clamp_value():
    # float64 inputs compute in float64, but c is the float32 number nearest clamp_value (as on
    # the GPU and in bias_swiglu_impl): y = 5 lies above c = 0.1 in both halves, so every output
    # is silu(c)·c and the weighted one silu(c)·c·w, with c = float32(0.1), not 0.1
    c32 = float(np.float32(0.1))
    y = torch.full((3, 2 * 4), 5.0, device=DEVICE, dtype=torch.float64)
    w = torch.rand(3, 1, device=DEVICE, dtype=torch.float64)
    unit = (torch.nn.functional.silu(torch.tensor(c32, dtype=torch.float64)) * c32).item()
    want = torch.full((3, 4), unit, device=DEVICE, dtype=torch.float64)
    for got, expected in ((swiglu_mod.clamped_swiglu(y, 0.1), want),
                          (swiglu_mod.bias_clamped_swiglu(y, torch.zeros(8, device=DEVICE, dtype=torch.float64), 0.1),
                           want),
                          (swiglu_mod.clamped_weighted_swiglu(y, w, 0.1), want * w)):
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0.0)
    # the backward: y1 = y2 = float32(0.1), above 0.1 but on c, so both gradients pass (at 0.1
    # itself as the bound both would be 0)
    y = torch.full((1, 2), c32, device=DEVICE, dtype=torch.float64)
    g = torch.ones(1, 1, device=DEVICE, dtype=torch.float64)
    assert (swiglu_mod.clamped_swiglu_back(g, y, 0.1) != 0).all()
    zero_bias = torch.zeros(2, device=DEVICE, dtype=torch.float64)
    assert (swiglu_mod.bias_clamped_swiglu_back(g, y, zero_bias, 0.1) != 0).all()
    dy, _ = swiglu_mod.clamped_weighted_swiglu_back(g, y, torch.ones(1, 1, device=DEVICE, dtype=torch.float64), 0.1)
    assert (dy != 0).all()


def test_weighted_swiglu_plain_functions_match_reference():
    y = _randn((7, 2 * 40), torch.bfloat16)
    w = torch.rand(7, 1, device=DEVICE)
    g = _randn((7, 40), torch.bfloat16, 1.0)
    assert_close(swiglu_mod.weighted_swiglu(y, w), unfused.weighted_swiglu(y.double(), w.double()), torch.bfloat16)
    dy, dw = swiglu_mod.weighted_swiglu_back(g, y, w)
    dy64, dw64 = unfused.weighted_swiglu_back(g.double(), y.double(), w.double())
    assert dy.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_close(dy, dy64, torch.bfloat16)
    assert_close(dw, dw64, torch.float32, scale=40**0.5)


# ------------------------------------------------------------------ the math: formulas and gradcheck


def test_backward_formulas_are_autograd_gradients():
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    unfused.silu(x).sum().backward()
    torch.testing.assert_close(x.grad, unfused.silu_grad(x.detach()), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(unfused.silu(x.detach()), torch.nn.functional.silu(x.detach()), atol=1e-15, rtol=0)
    y = torch.randn(6, 2 * 9, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 9, dtype=torch.float64)
    for fwd, back in ((unfused.swiglu, unfused.swiglu_back), (unfused.geglu, unfused.geglu_back)):
        y.grad = None
        fwd(y).backward(g)
        torch.testing.assert_close(y.grad, back(g, y.detach()), atol=1e-12, rtol=1e-12)
    w = torch.rand(6, 1, dtype=torch.float64, requires_grad=True)
    y.grad = None
    unfused.weighted_swiglu(y, w).backward(g)
    dy, dw = unfused.weighted_swiglu_back(g, y.detach(), w.detach())
    torch.testing.assert_close(y.grad, dy, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(w.grad, dw, atol=1e-12, rtol=1e-12)
    for cs in (None, 1.5):
        x2 = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
        w.grad = None
        unfused.weighted_squared_relu(x2, w, cs).backward(g)
        dx, dw = unfused.weighted_squared_relu_back(g, x2.detach(), w.detach(), cs)
        torch.testing.assert_close(x2.grad, dx, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(w.grad, dw, atol=1e-12, rtol=1e-12)


def test_gradcheck_float64():
    # float64 inputs run the same kernels computing in float64, so gradcheck checks the kernels.
    def f64(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    y, b, y3 = f64(3, 10), f64(10), f64(2, 3, 8)
    w = torch.rand(3, 1, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w6 = torch.rand(6, 1, device=DEVICE, dtype=torch.float64, requires_grad=True)
    gc = torch.autograd.gradcheck
    assert gc(lambda y, b: BiasSwiGLUFunction.apply(y, b, False, False), (y, b))
    assert gc(lambda y: SwiGLUFunction.apply(y, False, False), (y,))
    assert gc(BiasGeGLUFunction.apply, (y, b))
    assert gc(GeGLUFunction.apply, (y,))
    assert gc(bias_swiglu_impl, (y3, None)) and gc(bias_geglu_impl, (y3, f64(8)))
    assert gc(lambda y, w: WeightedSwiGLUFunction.apply(y, w, False), (y, w))
    assert gc(lambda y, w: weighted_bias_swiglu_impl(y, None, w), (y3, w6))
    x = f64(3, 7)
    x = (x + 0.2 * torch.sign(x)).detach().requires_grad_(True)  # keep away from relu's kink at 0
    assert gc(lambda x, w: WeightedSquaredReLUFunction.apply(x, w, None), (x, w))
    assert gc(lambda x, w: weighted_squared_relu_impl(x, w, 0.8), (x, w))


# ------------------------------------------------------------------ Megatron's flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_input_store_saves_a_rounded_input(dtype):
    # Megatron's semantics: the forward uses the input as given; the backward sees it rounded
    # to float8_e4m3fn, so the gradient is exactly the gradient at the rounded input.
    y = _randn((9, 2 * 24), dtype, 1.0).requires_grad_(True)
    out = bias_swiglu_impl(y, None, fp8_input_store=True)
    assert_close(out, unfused.swiglu(y.detach().double()), dtype)
    g = _randn(out.shape, dtype, 1.0)
    out.backward(g)
    y8 = y.detach().to(torch.float8_e4m3fn).to(dtype)
    assert_close(y.grad, unfused.swiglu_back(g.double(), y8.double()), dtype)
    w = torch.rand(9, 1, device=DEVICE).requires_grad_(True)
    y.grad = None
    weighted_bias_swiglu_impl(y, None, w, fp8_input_store=True).backward(g)
    dy64, dw64 = unfused.weighted_swiglu_back(g.double(), y8.double(), w.detach().double())
    assert_close(y.grad, dy64, dtype)
    assert_close(w.grad, dw64, torch.float32, scale=24**0.5)


def test_cpu_offload_input_tags_saved_tensors():
    y = _randn((4, 8), torch.float32).requires_grad_(True)
    b = _randn((8,), torch.float32).requires_grad_(True)
    bias_swiglu_impl(y, b, cpu_offload_input=True).sum().backward()
    assert getattr(y, "activation_offloading", False) and getattr(b, "activation_offloading", False)
    assert y.grad is not None


# ------------------------------------------------------------------ bad input


def _bad_cases():
    t = lambda *s: torch.randn(*s, device=DEVICE)  # noqa: E731
    return [
        ("odd last dim", lambda: bias_swiglu_impl(t(4, 7), None), ValueError, r"input.shape\[-1\] must be even"),
        ("1-D", lambda: bias_geglu_impl(t(8), None), ValueError, "input must be 2-D or 3-D"),
        ("4-D", lambda: bias_swiglu_impl(t(2, 2, 2, 8), None), ValueError, "input must be 2-D or 3-D"),
        ("int", lambda: bias_swiglu_impl(t(4, 8).int(), None), TypeError, "input must have dtype"),
        ("list", lambda: bias_geglu_impl([[1.0, 2.0]], None), TypeError, "input must be a torch.Tensor"),
        ("bias shape", lambda: bias_swiglu_impl(t(4, 8), t(4)), ValueError,
         r"bias must have shape \[2h\] with 2h = input.shape\[-1\] = 8"),
        ("bias dtype", lambda: bias_geglu_impl(t(4, 8), t(8).half()), TypeError, "bias dtype"),
        ("bias 2-D", lambda: bias_geglu_impl(t(4, 8), t(1, 8)), ValueError, "bias must be 1-D"),
        ("weights shape", lambda: weighted_bias_swiglu_impl(t(4, 8), None, t(4)), ValueError,
         r"weights must have shape \[n, 1\] with n = 4"),
        ("weights rows", lambda: weighted_bias_swiglu_impl(t(2, 3, 8), None, t(3, 1)), ValueError,
         r"weights must have shape \[n, 1\] with n = 6"),
        ("weights int", lambda: weighted_bias_swiglu_impl(t(4, 8), None, t(4, 1).int()), TypeError,
         "weights must have dtype"),
        ("flag", lambda: bias_swiglu_impl(t(4, 8), None, fp8_input_store="yes"), TypeError,
         "fp8_input_store must be a bool"),
        ("flag numpy int", lambda: bias_swiglu_impl(t(4, 8), None, fp8_input_store=np.int64(1)), TypeError,
         "fp8_input_store must be a bool, got numpy.int64"),
        ("sqrelu weights", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 2)), ValueError,
         r"weights must have shape \[n, 1\]"),
        ("sqrelu 1-D", lambda: weighted_squared_relu_impl(t(8), t(1, 1)), ValueError, "input must be 2-D or 3-D"),
        ("clamp <= 0", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), 0.0), ValueError,
         "clamp_scale must be a number in float32's normal range"),
        ("clamp inf in float32", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), 1e39), ValueError,
         "clamp_scale must be a number in float32's normal range"),
        ("clamp 0 in float32", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), 1e-46), ValueError,
         "clamp_scale must be a number in float32's normal range"),
        ("clamp nan", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), float("nan")), ValueError,
         "clamp_scale must be a number in float32's normal range"),
        ("clamp type", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), "2"), TypeError,
         "clamp_scale must be a float or None"),
        ("grad shape", lambda: swiglu_mod.swiglu_back(t(4, 8), t(4, 8)), ValueError,
         r"grad_output must have shape \[4, 4\]"),
        ("grad dtype", lambda: geglu_mod.geglu_back(t(4, 4).double(), t(4, 8)), TypeError, "grad_output dtype"),
        # the right width but fewer rows: unchecked, the kernel would read past g's end
        ("grad rows", lambda: swiglu_mod.swiglu_back(t(3, 4), t(4, 8)), ValueError,
         r"grad_output must have shape \[4, 4\], got \[3, 4\]"),
        ("grad leading dims", lambda: geglu_mod.geglu_back(t(2, 2, 4), t(2, 3, 8)), ValueError,
         r"grad_output must have shape \[2, 3, 4\]"),
        ("flag cpu_offload_input", lambda: bias_swiglu_impl(t(4, 8), t(8), cpu_offload_input="no"), TypeError,
         "cpu_offload_input must be a bool"),
        ("flag cpu_offload_input nobias", lambda: bias_swiglu_impl(t(4, 8), None, cpu_offload_input=1), TypeError,
         "cpu_offload_input must be a bool"),
        ("clamp bool", lambda: weighted_squared_relu_impl(t(4, 8), t(4, 1), True), TypeError,
         "clamp_scale must be a float or None, got bool"),
        ("sqrelu grad shape", lambda: weighted_squared_relu_back(t(3, 8), t(4, 8), t(4, 1)), ValueError,
         r"grad_output must have shape \[4, 8\], got \[3, 8\]"),
        ("sqrelu clamped grad shape", lambda: weighted_clamped_squared_relu_back(t(4, 7), t(4, 8), t(4, 1), 2.0),
         ValueError, r"grad_output must have shape \[4, 8\], got \[4, 7\]"),
        ("sqrelu clamped grad dtype",
         lambda: weighted_clamped_squared_relu_back(t(4, 8).double(), t(4, 8), t(4, 1), 2.0), TypeError,
         "grad_output dtype"),
        ("flag weighted", lambda: weighted_bias_swiglu_impl(t(4, 8), None, torch.rand(4, 1, device=DEVICE),
                                                            fp8_input_store="yes"), TypeError,
         "fp8_input_store must be a bool"),
        # the plain (no autograd) functions check their arguments as the entry points do
        ("swiglu odd", lambda: swiglu_mod.swiglu(t(4, 7)), ValueError, r"y.shape\[-1\] must be even"),
        ("geglu odd", lambda: geglu_mod.geglu(t(4, 7)), ValueError, r"y.shape\[-1\] must be even"),
        ("geglu int", lambda: geglu_mod.geglu(t(4, 8).int()), TypeError, "y must have dtype"),
        ("bias_swiglu bias shape", lambda: swiglu_mod.bias_swiglu(t(4, 8), t(4)), ValueError,
         r"bias must have shape \[2h\] with 2h = y.shape\[-1\] = 8"),
        ("bias_geglu bias shape", lambda: geglu_mod.bias_geglu(t(4), t(4, 8)), ValueError,
         r"bias must have shape \[2h\] with 2h = y.shape\[-1\] = 8"),
        ("bias_geglu bias dtype", lambda: geglu_mod.bias_geglu(t(8).double(), t(4, 8)), TypeError,
         "bias dtype torch.float64 must match y dtype"),
        ("bias_clamped_swiglu bias shape", lambda: swiglu_mod.bias_clamped_swiglu(t(4, 8), t(4), 1.5), ValueError,
         r"bias must have shape \[2h\] with 2h = y.shape\[-1\] = 8"),
        ("weighted_swiglu weights shape", lambda: swiglu_mod.weighted_swiglu(t(4, 8), t(4)), ValueError,
         r"weights must have shape \[n, 1\] with n = 4 rows of y"),
        ("clamped_weighted_swiglu weights rows", lambda: swiglu_mod.clamped_weighted_swiglu(t(4, 8), t(3, 1), 1.5),
         ValueError, r"weights must have shape \[n, 1\] with n = 4 rows of y"),
        ("weighted_swiglu_back weights rows", lambda: swiglu_mod.weighted_swiglu_back(t(4, 4), t(4, 8), t(3, 1)),
         ValueError, r"weights must have shape \[n, 1\] with n = 4 rows of y"),
        ("weighted_swiglu_back grad rows", lambda: swiglu_mod.weighted_swiglu_back(t(3, 4), t(4, 8), t(4, 1)),
         ValueError, r"grad_output must have shape \[4, 4\], got \[3, 4\]"),
        ("clamped_swiglu_back grad rows", lambda: swiglu_mod.clamped_swiglu_back(t(3, 4), t(4, 8), 1.5),
         ValueError, r"grad_output must have shape \[4, 4\], got \[3, 4\]"),
        ("clamped_weighted_swiglu_back grad rows",
         lambda: swiglu_mod.clamped_weighted_swiglu_back(t(3, 4), t(4, 8), t(4, 1), 1.5),
         ValueError, r"grad_output must have shape \[4, 4\], got \[3, 4\]"),
        ("bias_geglu_back grad rows", lambda: geglu_mod.bias_geglu_back(t(3, 4), t(4, 8), t(8)),
         ValueError, r"grad_output must have shape \[4, 4\], got \[3, 4\]"),
        ("sqrelu plain weights", lambda: weighted_squared_relu(t(4, 8), t(4, 2)), ValueError,
         r"weights must have shape \[n, 1\] with n = 4 rows of x"),
        ("sqrelu plain clamped weights", lambda: weighted_clamped_squared_relu(t(4, 8), t(3, 1), 2.0), ValueError,
         r"weights must have shape \[n, 1\] with n = 4 rows of x"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_clear_error(case):
    _, call, error, match = case
    with pytest.raises(error, match=match):
        call()


def test_mixed_devices_raise():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match="one device, got input on"):
        bias_swiglu_impl(torch.randn(4, 8, device=DEVICE), torch.randn(8, device=other))
    with pytest.raises(ValueError, match="one device, got input on"):
        weighted_bias_swiglu_impl(torch.randn(4, 8, device=DEVICE), None, torch.rand(4, 1, device=other))


def test_bench_byte_counts_are_the_floor():
    from fusedlib.bench.ops._glu import glu_bytes, weighted_glu_bytes

    n, h = 10, 7
    b = glu_bytes(n, h, 2)
    assert b["fwd"] == (2 * n * h + n * h) * 2  # read y [n, 2h], write out [n, h]
    assert b["fwd+bwd"] - b["fwd"] == (n * h + 2 * n * h + 2 * n * h) * 2  # read g, y; write dy
    assert glu_bytes(n, h, 2, bias=True)["fwd"] == b["fwd"] + 2 * h * 2
    wb = weighted_glu_bytes(n, h, 2, 4)
    assert wb["fwd"] == b["fwd"] + 4 * n and wb["fwd+bwd"] == b["fwd+bwd"] + 3 * 4 * n
