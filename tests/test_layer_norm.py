"""LayerNorm and RMSNorm: fusedlib's Triton kernels against float64 PyTorch references."""
from __future__ import annotations

import warnings

import pytest
import torch

import fusedlib
from fusedlib import unfused
from fusedlib.backends import apex as apex_backend
from fusedlib.fusions.fused_layer_norm import (
    FusedLayerNorm,
    FusedLayerNormAffineFunction,
    FusedNorm,
    FusedRMSNorm,
    FusedRMSNormAffineFunction,
    fused_layer_norm,
    fused_rms_norm,
)
from fusedlib.kernels.launch import Tile, next_power_of_2, pick
from fusedlib.kernels.layer_norm import FWD_TILES, MAX_HIDDEN_SIZE, norm_bwd, norm_fwd
from fusedlib.transformer import TransformerConfig

from conftest import DEVICE, FLOAT_DTYPES, TOL, assert_close, generator_state  # noqa: I001

NORMS = ("layer", "rms")
HIDDEN = (1, 7, 768, 1000, 4096, 5120, 14336, 65536)
EPS = 1e-5


def _params(h, dtype, norm, *, zero_centered=False, requires_grad=True):
    if zero_centered:
        w = 0.1 * torch.randn(h, device=DEVICE)  # stored around 0: gamma = 1 + w
    else:
        w = torch.randn(h, device=DEVICE)
    w = w.to(dtype).requires_grad_(requires_grad)
    b = torch.randn(h, device=DEVICE).to(dtype).requires_grad_(requires_grad) if norm == "layer" else None
    return w, b


def _x(shape, dtype):
    # a nonzero mean, so LayerNorm's centering matters
    return (2 * torch.randn(shape, device=DEVICE) + 0.5).to(dtype).requires_grad_(True)


def _apply(norm, x, w, b, **kw):
    if norm == "layer":
        return fused_layer_norm(x, w, b, EPS, **kw)
    return fused_rms_norm(x, w, EPS, **kw)


def _reference(norm, x64, w64, b64, dy64, zero_centered=False):
    """(y, dx, dw, db) in float64; db None for RMSNorm."""
    if norm == "layer":
        y = unfused.layer_norm(x64, w64, b64, EPS, zero_centered)
        dx, dw, db = unfused.layer_norm_back(dy64, x64, w64, EPS, zero_centered)
        return y, dx, dw, db
    y = unfused.rms_norm(x64, w64, EPS, zero_centered)
    dx, dw = unfused.rms_norm_back(dy64, x64, w64, EPS, zero_centered)
    return y, dx, dw, None


# ---------------------------------------------------------------------------------------
# Error bounds, first order in the unit roundoff U of the kernels' float32 arithmetic
# (chapter 4, "memory_efficient_layer_norm", states the memory-efficient one). Storing a
# float32 value in the dtype d moves it by at most half an ulp of d (round to nearest).
# ---------------------------------------------------------------------------------------

U = 2.0**-24


def _half_ulp(t):
    """Half the spacing of ``t``'s dtype at |t|, elementwise, float64: the most that rounding
    to that dtype moved a value that rounded to ``t`` (normal numbers; below the smallest
    normal, half the subnormal spacing)."""
    fi = torch.finfo(t.dtype)
    _, e = torch.frexp(t.detach().double().abs())  # |t| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.full(t.shape, fi.eps, dtype=torch.float64, device=t.device), e - 1)
    return 0.5 * torch.clamp(ulp, min=fi.smallest_normal * fi.eps)


def _stats64(norm, x64, w64, dy64, zero_centered):
    """(gamma, rstd, x_hat, g, c1, c2) of the float64 reference, shaped to broadcast with x."""
    gamma = w64 + 1 if zero_centered else w64
    mean = x64.mean(-1, keepdim=True) if norm == "layer" else torch.zeros_like(x64[..., :1])
    rstd = (((x64 - mean) ** 2).mean(-1, keepdim=True) + EPS).rsqrt()
    x_hat = (x64 - mean) * rstd
    g = gamma * dy64
    c1 = (x_hat * g).mean(-1, keepdim=True)
    c2 = g.mean(-1, keepdim=True) if norm == "layer" else torch.zeros_like(c1)
    return gamma, rstd, x_hat, g, c1, c2


def _memory_efficient_bounds(norm, y, x64, w64, dy64, zero_centered):
    """(B_dx, B_dgamma): how much more the memory-efficient backward may err than the one
    that reads x, per element of dx [..., h] and of dgamma [h], float64.

    The forward computes y_c = gamma * x_hat + beta in float32 (|error| <= U (|gamma x_hat| + |y|):
    a product and a sum, each rounded once) and stores y = round_d(y_c) (|error| <= half an
    ulp of y in d; nothing more for float32). The backward recovers x_hat~ = (y - beta) * (1 / gamma):
    the subtraction rounds (U |gamma x_hat|, divided by |gamma|: U |x_hat|), the reciprocal errs
    by up to 2 ulp = 4U compiled (div.full.f32), the product rounds once (U). So

        e_x = (half_ulp_d(y) + U |y|) / |gamma| + 7 U |x_hat|      (the first term 0 for float32)

    bounds |x_hat~ - x_hat| per element. dgamma_j = sum_i dy_ij x_hat_ij then errs by at most
    sum_i |dy_ij| e_x(i, j). dx = rstd (g - x_hat c1 - c2) with g = gamma dy: x_hat enters
    directly and through c1 = mean_k(x_hat_k g_k), so |error of dx_ij| <= rstd_i (|c1_i| e_x(i, j)
    + |x_hat_ij| mean_k(|g_ik| e_x(i, k))); c2 and g do not involve x_hat. A tiny |gamma_j|
    makes e_x large, but in c1 it is multiplied by g = gamma dy, which cancels it.
    """
    _, rstd, x_hat, g, c1, _ = _stats64(norm, x64, w64, dy64, zero_centered)
    gamma = (w64 + 1 if zero_centered else w64).abs()
    stored = _half_ulp(y) if y.dtype != torch.float32 else torch.zeros_like(x64)
    e_x = (stored + U * y.double().abs()) / gamma + 7 * U * x_hat.abs()
    b_dx = rstd * (c1.abs() * e_x + x_hat.abs() * (g.abs() * e_x).mean(-1, keepdim=True))
    b_dw = (dy64.abs() * e_x).reshape(-1, x64.shape[-1]).sum(0)
    return b_dx, b_dw


def _assert_within(name, actual, expected64, tol64):
    """|actual - expected| <= tol elementwise, in float64; the message names the worst element."""
    assert actual.shape == expected64.shape, (name, actual.shape, expected64.shape)
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    err = (actual.double() - expected64.double()).abs().cpu()
    tol = torch.as_tensor(tol64, dtype=torch.float64).cpu().expand_as(err)
    bad = err > tol
    if bad.any():
        i = int((err - tol).flatten().argmax())
        raise AssertionError(f"{name}: {int(bad.sum())} of {err.numel()} elements outside the bound; worst: "
                             f"|error| {err.flatten()[i]:.3g} > {tol.flatten()[i]:.3g} (reference "
                             f"{expected64.flatten()[i].item():.6g})")


def _tol(expected64, dtype, scale=1.0):
    """conftest's tolerance for ``dtype`` as a tensor: atol * scale + rtol * |expected|."""
    atol, rtol = TOL[dtype]
    return atol * scale + rtol * expected64.abs()


def _dx_tol(norm, x64, w64, dy64, dx64, dtype, zero_centered=False):
    """The tolerance of dx (backward from x), elementwise, float64.

    dx = rstd (g - (x_hat c1 + c2)) is a difference: its float32 error is a few ulps of the
    terms, not of the result, times rstd, which is large where a row's variance is small
    (h = 2 with two close values: rstd = 77 was seen). To first order it is k U S with

        S = rstd (|g| + |x_hat| mean|x_hat g| + mean|g|)        the terms, and the sums behind c1, c2
          + rstd^2 |mean| (|c1| + |x_hat| mean|g|)              the mean's last bit, which rstd
                                                                carries into x_hat, then into c1
    (RMSNorm: no mean and no c2). conftest's float32 rtol (1e-5, about 170 U) stands for k U,
    and its atol covers S up to about 1, as before; so |error| <= max(atol, rtol_32 S), plus
    rtol |dx| for the rounding to ``dtype``.
    """
    _, rstd, x_hat, g, c1, _ = _stats64(norm, x64, w64, dy64, zero_centered)
    mean_g = g.abs().mean(-1, keepdim=True)
    scale = rstd * (g.abs() + x_hat.abs() * (x_hat * g).abs().mean(-1, keepdim=True))
    if norm == "layer":
        mean = x64.mean(-1, keepdim=True)
        scale = scale + rstd * mean_g + rstd**2 * mean.abs() * (c1.abs() + x_hat.abs() * mean_g)
    atol, rtol = TOL[dtype]
    return torch.clamp(TOL[torch.float32][1] * scale, min=atol) + rtol * dx64.abs()


def _check_fwd_bwd(norm, x, w, b, dy=None, *, zero_centered=False, memory_efficient=False):
    dtype = x.dtype
    x_before = x.detach().clone()
    y = _apply(norm, x, w, b, zero_centered_gamma=zero_centered, memory_efficient=memory_efficient)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert y._base is None, "output must not be a view (Megatron's deallocate_output_tensor)"
    assert y.data_ptr() != x.data_ptr()
    from_y = y.grad_fn.saved_tensors[0].data_ptr() == y.data_ptr()  # memory-efficient, and no gamma = 0
    assert from_y == (memory_efficient and bool((w.detach() + (1 if zero_centered else 0) != 0).all()))
    dy = torch.randn_like(y) if dy is None else dy
    dy_before = dy.clone()
    y.backward(dy)
    assert torch.equal(dy, dy_before), "grad_output was modified"
    assert torch.equal(x.detach(), x_before), "input was modified"
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    b64 = b.detach().double() if b is not None else None
    y64, dx64, dw64, db64 = _reference(norm, x64, w64, b64, dy64, zero_centered)
    assert_close(y, y64, dtype)
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    rows = max(1, x.numel() // x.shape[-1])
    # x_hat from x: dx as _dx_tol derives, dgamma and dbeta at conftest's tolerances (they sum
    # over rows: sqrt(rows) wider); x_hat recovered from y: plus the derived bound of what that adds
    b_dx, b_dw = (_memory_efficient_bounds(norm, y.detach(), x64, w64, dy64, zero_centered) if from_y
                  else (0.0, 0.0))
    _assert_within("dx", x.grad, dx64, _dx_tol(norm, x64, w64, dy64, dx64, dtype, zero_centered) + b_dx)
    _assert_within("dgamma", w.grad, dw64, _tol(dw64, dtype, rows**0.5) + b_dw)
    if b is not None:
        assert b.grad.dtype == dtype
        assert_close(b.grad, db64, dtype, scale=rows**0.5)
    return y


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", HIDDEN)
def test_forward_backward_against_float64(norm, dtype, h):
    rows = 2 if h > 8192 else (3 if h > 1000 else 9)
    w, b = _params(h, dtype, norm)
    _check_fwd_bwd(norm, _x((rows, h), dtype), w, b)


@pytest.mark.parametrize("norm", NORMS)
def test_every_block_size_from_1_to_65536(norm):
    # Triton compiles one kernel per power-of-two BLOCK_N and masks the rest of the row, so
    # one size inside each of the 17 blocks (and both ends) covers every hidden size 1..65536.
    sizes = [1, 2, 3] + [2**k + 1 for k in range(2, 16)] + [MAX_HIDDEN_SIZE - 1, MAX_HIDDEN_SIZE]
    assert {next_power_of_2(h) for h in range(1, MAX_HIDDEN_SIZE + 1, 7)} <= {next_power_of_2(h) for h in sizes}
    assert all(pick(FWD_TILES, h).BLOCK_N == next_power_of_2(h) for h in sizes)  # the forward holds whole rows
    for h in sizes:
        w, b = _params(h, torch.float32, norm)
        _check_fwd_bwd(norm, _x((2, h), torch.float32), w, b)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_zero_centered_gamma(norm, dtype):
    w, b = _params(640, dtype, norm, zero_centered=True)
    _check_fwd_bwd(norm, _x((5, 3, 640), dtype), w, b, zero_centered=True)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_memory_efficient_equals_normal_mode(norm, dtype):
    h = 1000
    # gamma near 1 and a small beta, as in a trained model: x_hat = (y - beta) / gamma is
    # recovered from y rounded to `dtype`, an error of about ulp(y) / gamma.
    w = (1 + 0.2 * torch.randn(h, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(h, device=DEVICE)).to(dtype) if norm == "layer" else None
    x = _x((7, h), dtype)
    dy = torch.randn(7, h, device=DEVICE).to(dtype)
    grads = {}
    for me in (False, True):
        xi = x.detach().clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        bi = b.clone().requires_grad_(True) if b is not None else None
        y = _apply(norm, xi, wi, bi, memory_efficient=me)
        saved = y.grad_fn.saved_tensors[0]
        assert saved.data_ptr() == (y.data_ptr() if me else xi.data_ptr()), "memory_efficient decides what is saved"
        # against float64: conftest's tolerances, plus for x_hat recovered from y the derived bound
        y = _check_fwd_bwd(norm, xi, wi, bi, dy, memory_efficient=me)
        grads[me] = [xi.grad, wi.grad] + ([bi.grad] if bi is not None else [])
    # against each other: each is within the tolerance T of float64 and the efficient one also
    # within the bound B, so they differ by at most 2 T + B (dbeta: 2 T, it needs no x_hat)
    x64, w64, dy64 = x.detach().double(), w.double(), dy.double()
    b64 = b.double() if b is not None else None
    _, dx64, dw64, db64 = _reference(norm, x64, w64, b64, dy64)
    b_dx, b_dw = _memory_efficient_bounds(norm, y.detach(), x64, w64, dy64, False)
    _assert_within("dx", grads[True][0], grads[False][0], 2 * _dx_tol(norm, x64, w64, dy64, dx64, dtype) + b_dx)
    _assert_within("dgamma", grads[True][1], grads[False][1], 2 * _tol(dw64, dtype, 7**0.5) + b_dw)
    if b is not None:
        _assert_within("dbeta", grads[True][2], grads[False][2], 2 * _tol(db64, dtype, 7**0.5))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zero_centered", (False, True))
def test_memory_efficient_with_a_zero_gamma_raises(norm, zero_centered):
    # where gamma = 0, x_hat cannot be recovered from y (its dgamma and dx would be NaN): the
    # forward kernel reports it, without a host sync. On the CPU the call raises; on CUDA
    # check_errors() does (tests/test_compile_graph.py tests each mode, and the NaN, on its own).
    w, b = _params(33, torch.float32, norm, zero_centered=zero_centered)
    with torch.no_grad():
        w[5] = -1.0 if zero_centered else 0.0
    x = _x((4, 33), torch.float32)
    op = "fused_layer_norm" if norm == "layer" else "fused_rms_norm"
    gamma = r"weight\[5\] \+ 1" if zero_centered else r"weight\[5\]"
    x_hat = r"\(y - beta\) / gamma" if norm == "layer" else r"y / gamma"  # (RMSNorm has no beta)
    with pytest.raises(ValueError, match=rf"^{op}: memory_efficient=True needs every gamma != 0 \(x_hat = {x_hat}\), "
                                         rf"got gamma = {gamma} = 0 or subnormal .*: its dgamma and dx are NaN"):
        _apply(norm, x, w, b, memory_efficient=True, zero_centered_gamma=zero_centered)
        fusedlib.runtime.check_errors()
    fusedlib.runtime.check_errors()  # reported once
    # the same weight without memory_efficient: x is saved, exact gradients
    _check_fwd_bwd(norm, x, w, b, zero_centered=zero_centered)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zero_centered", (False, True))
def test_memory_efficient_with_a_zero_gamma_is_fine_where_no_backward_runs(norm, zero_centered):
    # the check exists for the backward's division by gamma: a forward autograd does not record
    # (torch.no_grad(), inference_mode, no input requiring grad: an evaluation with the config's
    # memory_efficient_layer_norm on) saves nothing and divides by nothing. It raised there, for
    # a valid input whose y is right.
    w, b = _params(33, torch.float32, norm, zero_centered=zero_centered, requires_grad=False)
    w[5] = -1.0 if zero_centered else 0.0
    x = _x((4, 33), torch.float32).detach()
    want = _apply(norm, x, w, b, zero_centered_gamma=zero_centered)  # the normal mode: no check, same kernel
    ref = _reference(norm, x.double(), w.double(), None if b is None else b.double(), torch.zeros(4, 33, device=DEVICE).double(),
                     zero_centered)[0]
    assert_close(want, ref, torch.float32)
    leaf = x.clone().requires_grad_(True)
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context():
            got = _apply(norm, leaf if context is not torch.enable_grad else x, w, b, memory_efficient=True,
                         zero_centered_gamma=zero_centered)
        fusedlib.runtime.check_errors()  # nothing stored for a later call either
        assert torch.equal(got, want), context.__name__
    # a recorded forward still raises (test_memory_efficient_with_a_zero_gamma_raises)
    with pytest.raises(ValueError, match="memory_efficient=True needs every gamma != 0"):
        _apply(norm, leaf, w, b, memory_efficient=True, zero_centered_gamma=zero_centered)
        fusedlib.runtime.check_errors()
    fusedlib.runtime.check_errors()


def test_norm_calls_of_one_signature_each_compute_their_own():
    # calls on inputs of one shape, dtype and layout that differ only in the norm, the bias's
    # presence or a switch, one after the other (LayerNorm without a bias and RMSNorm take the
    # same tensors; memory-efficient, neither saves a mean): each computes its own forward and
    # backward
    h = 48
    for norm, bias, zero_centered, memory_efficient in (
            ("layer", True, False, False), ("layer", False, False, False), ("rms", False, False, False),
            ("layer", True, True, False), ("rms", False, True, False), ("layer", True, False, True),
            ("layer", False, False, True), ("rms", False, False, True), ("rms", False, True, True),
            ("layer", True, False, False)):
        w, b = _params(h, torch.float32, norm, zero_centered=zero_centered)
        if not zero_centered:  # |gamma| away from 0: the memory-efficient bound stays small
            w = (1 + 0.2 * torch.randn(h, device=DEVICE)).requires_grad_(True)
        _check_fwd_bwd(norm, _x((6, h), torch.float32), w, b if bias else None, zero_centered=zero_centered,
                       memory_efficient=memory_efficient)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_input_and_grad(norm, dtype):
    x = (2 * torch.randn(48, 20, device=DEVICE)).to(dtype).t().requires_grad_(True)  # [20, 48], strides (1, 20)
    assert not x.is_contiguous()
    dy = torch.randn(48, 20, device=DEVICE).to(dtype).t()
    w, b = _params(48, dtype, norm)
    _check_fwd_bwd(norm, x, w, b, dy)


@pytest.mark.parametrize("norm", NORMS)
def test_non_contiguous_3d_and_strided_weight(norm):
    x = torch.randn(4, 6, 40, device=DEVICE).permute(1, 0, 2).requires_grad_(True)  # [6, 4, 40]
    w = torch.randn(80, device=DEVICE)[::2].requires_grad_(True)
    b = torch.randn(80, device=DEVICE)[1::2].requires_grad_(True) if norm == "layer" else None
    _check_fwd_bwd(norm, x, w, b)


@pytest.mark.parametrize("memory_efficient", (False, True))
def test_strided_bias_beside_a_contiguous_weight(memory_efficient):
    # only the bias strided (every other element of a longer tensor): the kernels read the
    # contiguous copy the check makes of it, forward and backward
    h = 40
    w = torch.randn(h, device=DEVICE).requires_grad_(True)
    b = torch.randn(2 * h, device=DEVICE)[1::2].requires_grad_(True)
    assert w.is_contiguous() and not b.is_contiguous()
    _check_fwd_bwd("layer", _x((6, h), torch.float32), w, b, memory_efficient=memory_efficient)


@pytest.mark.parametrize("norm", NORMS)
def test_strided_parameters_with_an_eps_that_is_not_a_float(norm):
    # an eps of another real type (an int, a numpy float) takes the full argument check on every
    # call: strided parameters are read as their contiguous copies on that path too
    import numpy as np

    h = 24
    x = _x((5, h), torch.float32).detach()
    w = torch.randn(2 * h, device=DEVICE)[::2]
    b = torch.randn(2 * h, device=DEVICE)[1::2] if norm == "layer" else None

    def run(eps, weight=w, bias=b):
        return fused_layer_norm(x, weight, bias, eps) if norm == "layer" else fused_rms_norm(x, weight, eps)

    want = run(1.0, w.contiguous(), None if b is None else b.contiguous())
    for eps in (1, np.float64(1.0)):
        assert torch.equal(run(eps), want), type(eps).__name__


@pytest.mark.parametrize("norm", NORMS)
def test_many_rows_exercise_the_two_stage_reduction(norm):
    # several backward programs, each looping over many tiles, plus ragged last tiles
    for h in (24, 300):
        w, b = _params(h, torch.float32, norm)
        _check_fwd_bwd(norm, _x((517, h), torch.float32), w, b)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("memory_efficient", (False, True))
@pytest.mark.parametrize("zero_centered", (False, True))
def test_split_backward_against_float64(norm, memory_efficient, zero_centered):
    # The long-row backward (row sums, then programs of BLOCK_N columns), forced at a
    # small h: ragged last column block (300 = 4 x 64 + 44), several row programs, ragged
    # last row tile, dy transposed (non-contiguous).
    h, rows = 300, 37
    w, b = _params(h, torch.float32, norm, zero_centered=zero_centered, requires_grad=False)
    x = _x((rows, h), torch.float32).detach()
    dy = torch.randn(h, rows, device=DEVICE).t()
    rms = norm == "rms"
    y, mean, rstd = norm_fwd(x, w, b, EPS, rms_norm=rms, zero_centered_gamma=zero_centered)
    tile = Tile(BLOCK_M=2, BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=2)  # 64 < 512: split
    dx, dw, db = norm_bwd(dy, y if memory_efficient else x, w, b, mean, rstd, rms_norm=rms,
                          zero_centered_gamma=zero_centered, memory_efficient=memory_efficient, tile=tile)
    b64 = b.double() if b is not None else None
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    _, dx64, dw64, db64 = _reference(norm, x64, w64, b64, dy64, zero_centered)
    # the float32 tolerances of _check_fwd_bwd; x_hat recovered from y adds the derived bound
    # (gamma is randn here, so some |gamma| may be tiny: the bound grows as 1 / |gamma|)
    b_dx, b_dw = (_memory_efficient_bounds(norm, y, x64, w64, dy64, zero_centered) if memory_efficient
                  else (0.0, 0.0))
    _assert_within("dx", dx, dx64, _dx_tol(norm, x64, w64, dy64, dx64, torch.float32, zero_centered) + b_dx)
    _assert_within("dgamma", dw, dw64, _tol(dw64, torch.float32, rows**0.5) + b_dw)
    if b is not None:
        assert_close(db, db64, torch.float32, scale=rows**0.5)
    # the same bits as the one-kernel backward's dgamma need not hold (other partial
    # order), but the split path must agree with it to float32 rounding
    dx1, dw1, _ = norm_bwd(dy, y if memory_efficient else x, w, b, mean, rstd, rms_norm=rms,
                           zero_centered_gamma=zero_centered, memory_efficient=memory_efficient)
    torch.testing.assert_close(dx, dx1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, dw1, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_split_backward_in_float64(norm):
    # float64 inputs compute in float64 on every path (what gradcheck relies on), the split
    # backward's per-row sums c1 and c2 included: a float32 copy of them would cost 8 digits
    h, rows = 300, 7
    x = (2 * torch.randn(rows, h, device=DEVICE, dtype=torch.float64) + 0.5)
    w = torch.randn(h, device=DEVICE, dtype=torch.float64)
    b = torch.randn(h, device=DEVICE, dtype=torch.float64) if norm == "layer" else None
    dy = torch.randn(rows, h, device=DEVICE, dtype=torch.float64)
    rms = norm == "rms"
    _, mean, rstd = norm_fwd(x, w, b, EPS, rms_norm=rms)
    tile = Tile(BLOCK_M=2, BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=2)  # 64 < 512: split
    dx, dw, db = norm_bwd(dy, x, w, b, mean, rstd, rms_norm=rms, tile=tile)
    _, dx64, dw64, db64 = _reference(norm, x, w, b, dy)
    assert dx.dtype == dw.dtype == torch.float64
    assert_close(dx, dx64, torch.float64)
    assert_close(dw, dw64, torch.float64, scale=rows**0.5)
    if b is not None:
        assert_close(db, db64, torch.float64, scale=rows**0.5)


@pytest.mark.parametrize("norm", NORMS)
def test_forward_persistent_grid_against_float64(norm):
    # A forward tile with programs_per_sm > 0 (FWD_TILES' row for 16 Ki-32 Ki) runs fewer programs
    # than row tiles, each looping over several tiles of BLOCK_M rows; forced here at a small h,
    # with a ragged last tile (37 rows in tiles of 2). Every row's y, mean and rstd are checked.
    h, rows = 300, 37
    w, b = _params(h, torch.float32, norm, requires_grad=False)
    x = _x((rows, h), torch.float32).detach()
    rms = norm == "rms"
    tile = Tile(BLOCK_M=2, BLOCK_N=0, num_warps=4, num_stages=2, programs_per_sm=1)
    y, mean, rstd = norm_fwd(x, w, b, EPS, rms_norm=rms, tile=tile)
    x64 = x.double()
    y64 = _reference(norm, x64, w.double(), None if b is None else b.double(), torch.zeros_like(x64))[0]
    assert_close(y, y64, torch.float32)
    mean64 = x64.mean(-1) if not rms else torch.zeros(rows, dtype=torch.float64, device=DEVICE)
    assert_close(rstd, ((x64 - mean64[:, None]) ** 2).mean(-1).add(EPS).rsqrt(), torch.float32)
    if not rms:
        assert_close(mean, mean64, torch.float32)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("zero_centered", (False, True))
def test_zero_variance_rows(norm, dtype, zero_centered):
    # Rows of equal values (LayerNorm; one of them 0) or of zeros (RMSNorm) have variance 0,
    # so rstd = 1/sqrt(eps) = 316 multiplies any rounding in x_hat or in g - c2. The forward
    # sums the row shifted by its first element (mean = k + sum(x - k) / N), so x - mean is
    # exactly 0 there: x_hat = 0, y = beta (RMSNorm: 0) and dgamma = 0 exactly, on every
    # backward path (one kernel, split, memory-efficient, where x_hat = (beta - beta) / gamma
    # = 0 too). For h = 1 LayerNorm's dx = 0 exactly
    # (y = beta whatever x). For h > 1, dx = rstd (g - c2) (RMSNorm: rstd g) is not 0; its
    # error bound, first order in U (x_hat = 0 and c1 = 0 are exact here):
    #   g = gamma dy rounds once, and gamma = w + 1 once more:       2 U |g|
    #   c2 = sum(g) / N: the sum of N rounded terms, in any order,
    #   errs by <= N U mean|g|; the division rounds once:            N U mean|g| + U |c2|
    #   g - c2 rounds once:                                          U |g - c2|
    #   times rstd, which errs by <= 8 U (eps rounded to float32; sqrt and reciprocal
    #   within 2 ulp each, compiled), and the product rounds once:  9 U |dx|
    #   dx stored in x's dtype: conftest's tolerance for that dtype (as every test here)
    rms = norm == "rms"
    rows = 5
    for h in (1, 7, 1000):
        if rms:
            value = torch.zeros(rows, 1, device=DEVICE)
        else:
            value = torch.cat([torch.zeros(1, 1, device=DEVICE), 3 * torch.randn(rows - 1, 1, device=DEVICE)])
        x = value.expand(rows, h).to(dtype).contiguous()
        w, b = _params(h, dtype, norm, zero_centered=zero_centered, requires_grad=False)
        kw = dict(rms_norm=rms, zero_centered_gamma=zero_centered)
        y, mean, rstd = norm_fwd(x, w, b, EPS, **kw)
        assert torch.equal(y, torch.zeros_like(y) if rms else b.expand_as(y)), f"h={h}: y != beta"
        if not rms:
            assert torch.equal(mean, x[:, 0].float()), f"h={h}: the row mean is not the row's value"
        dy = torch.randn(rows, h, device=DEVICE).to(dtype)
        split = Tile(BLOCK_M=2, BLOCK_N=4 if h < 64 else 64, num_warps=4, programs_per_sm=2, num_stages=2)
        paths = {"one kernel": norm_bwd(dy, x, w, b, mean, rstd, **kw),
                 "split": norm_bwd(dy, x, w, b, mean, rstd, tile=split, **kw),
                 "memory-efficient": norm_bwd(dy, y, w, b, mean, rstd, memory_efficient=True, **kw)}
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        b64 = b.double() if b is not None else None
        _, dx64, dw64, db64 = _reference(norm, x64, w64, b64, dy64, zero_centered)
        _, rstd64, _, g, _, c2 = _stats64(norm, x64, w64, dy64, zero_centered)
        bound = rstd64 * U * (2 * g.abs() + (0 if rms else h * g.abs().mean(-1, keepdim=True) + c2.abs()
                                             + (g - c2).abs())) + 9 * U * dx64.abs() + _tol(dx64, dtype)
        for path, (dx, dw, db) in paths.items():
            where = f"h={h} {path}"
            if h == 1 and not rms:
                assert torch.equal(dx, torch.zeros_like(dx)), f"{where}: dx != 0 for h = 1"
            _assert_within(f"{where} dx", dx, dx64, bound)
            assert torch.equal(dw, torch.zeros_like(dw)), f"{where}: dgamma != 0 with x_hat = 0"
            if b is not None:
                assert_close(db, db64, dtype, scale=rows**0.5)
        assert torch.equal(paths["memory-efficient"][0], paths["one kernel"][0]), f"h={h}: x_hat from y is not 0"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf on purpose (numpy's, in the interpreter)
def test_layer_norm_of_one_element_keeps_nan_in_its_input_gradient(dtype):
    # h = 1: dx is 0 for a finite row, and the kernel wrote zeros for every row, so a NaN or inf
    # in x or dy (or eps = 0: 0 / 0) gave dx = 0 where torch's layer_norm gives NaN
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0], [nan], [inf], [-2.0], [3.0]], device=DEVICE).to(dtype)
    dy = torch.tensor([[0.5], [1.0], [1.0], [nan], [2.0]], device=DEVICE).to(dtype)
    w, b = torch.full((1,), 1.5, device=DEVICE, dtype=dtype), torch.full((1,), -0.25, device=DEVICE, dtype=dtype)
    other_tile = Tile(BLOCK_M=2, BLOCK_N=4, num_warps=4, programs_per_sm=2, num_stages=2)  # (h = 1 never splits)
    for eps in (EPS, 0.0):
        kw = dict(rms_norm=False, zero_centered_gamma=False)
        y, mean, rstd = norm_fwd(x, w, b, eps, **kw)
        want = torch.tensor([0.0, nan, nan, nan, 0.0] if eps else [nan] * 5, device=DEVICE)
        paths = {"one kernel": norm_bwd(dy, x, w, b, mean, rstd, **kw)[0],
                 "another tile": norm_bwd(dy, x, w, b, mean, rstd, tile=other_tile, **kw)[0],
                 "memory-efficient": norm_bwd(dy, y, w, b, mean, rstd, memory_efficient=True, **kw)[0]}
        for path, dx in paths.items():
            got = dx.float().flatten()
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
                (eps, path, got)
        # torch's layer_norm agrees, row for row
        xt = x.double().requires_grad_(True)
        torch.nn.functional.layer_norm(xt, (1,), w.double(), b.double(), eps).backward(dy.double())
        assert torch.equal(xt.grad.isnan().flatten(), want.isnan()), (eps, xt.grad)
    # through the autograd Function
    xl = x.clone().requires_grad_(True)
    fusedlib.fused_layer_norm(xl, w, b, EPS).backward(dy)
    assert torch.equal(xl.grad.float().flatten().isnan(), torch.tensor([False, True, True, True, False], device=DEVICE))


def test_tile_block_n_must_be_a_power_of_two_and_the_forward_whole_rows():
    x, w = torch.randn(3, 100, device=DEVICE), torch.randn(100, device=DEVICE)
    y, mean, rstd = norm_fwd(x, w, None, 1e-5, rms_norm=True)
    norm_bwd(torch.randn(3, 100, device=DEVICE), x, w, None, None, rstd, rms_norm=True)  # refused after it too
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
        norm_bwd(torch.randn(3, 100, device=DEVICE), x, w, None, None, rstd, rms_norm=True,
                 tile=Tile(BLOCK_M=1, BLOCK_N=48, num_warps=4, num_stages=1, programs_per_sm=2))
    with pytest.raises(ValueError, match="the norms' forward holds whole rows"):
        norm_fwd(x, w, None, 1e-5, rms_norm=True, tile=Tile(BLOCK_M=1, BLOCK_N=64, num_warps=4))


@pytest.mark.parametrize("norm", NORMS)
def test_single_row_and_1d_input(norm):
    w, b = _params(300, torch.float32, norm)
    _check_fwd_bwd(norm, _x((1, 300), torch.float32), w, b)
    w, b = _params(300, torch.float32, norm)
    _check_fwd_bwd(norm, _x((300,), torch.float32), w, b)


@pytest.mark.parametrize("norm", NORMS)
def test_empty_input(norm):
    w, b = _params(16, torch.float32, norm)
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    y = _apply(norm, x, w, b)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_unfused_norm_gradients_of_zero_width_rows():
    # the unfused references take rows of width h = 0 forward (empty rows of nothing) and give
    # the empty gradients backward: dx [rows, 0] and dweight / dbias [0]
    x, dy, w = torch.randn(3, 2, 0, device=DEVICE), torch.randn(3, 2, 0, device=DEVICE), torch.ones(0, device=DEVICE)
    assert unfused.layer_norm(x, w, torch.zeros(0, device=DEVICE)).shape == unfused.rms_norm(x, w).shape == (3, 2, 0)
    grads = (*unfused.layer_norm_back(dy, x, w), *unfused.rms_norm_back(dy, x, w))
    assert [tuple(g.shape) for g in grads] == [(3, 2, 0), (0,), (0,), (3, 2, 0), (0,)]


@pytest.mark.parametrize("norm", NORMS)
def test_empty_input_memory_efficient_with_a_zero_gamma(norm):
    # no rows: the backward divides nothing by gamma, so a gamma of 0 is nothing to report (as
    # where no backward runs); the gradients are zeros
    w, b = _params(16, torch.float32, norm)
    with torch.no_grad():
        w[3] = 0.0
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    y = _apply(norm, x, w, b, memory_efficient=True)
    fusedlib.runtime.check_errors()
    y.sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("norm", NORMS)
def test_parameter_gradients_are_deterministic(norm):
    w, b = _params(300, torch.float32, norm)
    x = _x((131, 300), torch.float32)
    dy = torch.randn(131, 300, device=DEVICE)
    first = torch.autograd.grad(_apply(norm, x, w, b), [w], dy)[0]
    second = torch.autograd.grad(_apply(norm, x, w, b), [w], dy)[0]
    assert torch.equal(first, second), "two-stage reduction: no atomics, same bits every run"


def test_gradcheck_float64():
    # float64 inputs run the same kernels computing in float64, so gradcheck checks them.
    x = torch.randn(3, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: fused_layer_norm(x, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: fused_rms_norm(x, w), (x, w))
    # the switches, on a [2, 2, 4] input; fast mode checks one random projection of the Jacobian
    x3 = torch.randn(2, 2, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w3 = torch.randn(4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b3 = torch.randn(4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    for kw in ({"zero_centered_gamma": True}, {"memory_efficient": True}):
        assert torch.autograd.gradcheck(lambda x, w, b: fused_layer_norm(x, w, b, **kw), (x3, w3, b3), fast_mode=True)
        assert torch.autograd.gradcheck(lambda x, w: fused_rms_norm(x, w, **kw), (x3, w3), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, w: fused_layer_norm(x, w, None), (x3, w3), fast_mode=True)


def test_closed_form_backward_is_autograd_backward():
    # the references' closed forms (derived in chapter 4) against autograd, float64
    x = torch.randn(4, 3, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 3, 9, dtype=torch.float64)
    for zc in (False, True):
        got = unfused.layer_norm_back(dy, x.detach(), w.detach(), EPS, zc)
        want = torch.autograd.grad(unfused.layer_norm(x, w, b, EPS, zc), (x, w, b), dy)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)
        got = unfused.rms_norm_back(dy, x.detach(), w.detach(), EPS, zc)
        want = torch.autograd.grad(unfused.rms_norm(x, w, EPS, zc), (x, w), dy)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(unfused.layer_norm(x, w, b, EPS), torch.nn.functional.layer_norm(x, (9,), w, b, EPS))
    torch.testing.assert_close(unfused.rms_norm(x, w, EPS), torch.nn.functional.rms_norm(x, (9,), w, EPS))


# ---------------------------------------------------------------------------------------
# Modules and the TransformerConfig switches
# ---------------------------------------------------------------------------------------


def test_transformer_config_defaults_are_megatrons():
    cfg = TransformerConfig()
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.layernorm_zero_centered_gamma, cfg.persist_layer_norm,
            cfg.memory_efficient_layer_norm, cfg.sequence_parallel) == ("LayerNorm", 1e-5, False, False, False, False)
    with pytest.raises(ValueError, match="normalization must be one of 'LayerNorm', 'RMSNorm', got 'BatchNorm'"):
        TransformerConfig(normalization="BatchNorm")
    with pytest.raises(ValueError, match="layernorm_epsilon must be a finite number > 0"):
        TransformerConfig(layernorm_epsilon=-1.0)


@pytest.mark.parametrize("zero_centered", (False, True))
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_fused_layer_norm_module(zero_centered, sequence_parallel):
    cfg = TransformerConfig(layernorm_zero_centered_gamma=zero_centered, sequence_parallel=sequence_parallel,
                            persist_layer_norm=True)  # 1000 is not in Apex's persistent list: no matter
    ln = FusedLayerNorm(config=cfg, hidden_size=1000, eps=1e-5, persist_layer_norm=True, zero_centered_gamma=False,
                        normalization="LayerNorm").to(DEVICE)
    assert torch.equal(ln.weight, torch.zeros(1000, device=DEVICE) if zero_centered else torch.ones(1000, device=DEVICE))
    assert torch.equal(ln.bias, torch.zeros(1000, device=DEVICE))
    assert ln.weight.sequence_parallel is sequence_parallel and ln.bias.sequence_parallel is sequence_parallel
    assert ln.persist_layer_norm is True and ln.zero_centered_gamma is zero_centered
    with torch.no_grad():
        ln.weight.normal_(0.0, 0.1)
        ln.bias.normal_()
    x = _x((3, 2, 1000), torch.float32)  # [s, b, h]
    y = ln(x)
    assert y._base is None
    y64 = unfused.layer_norm(x.detach().double(), ln.weight.detach().double(), ln.bias.detach().double(), 1e-5,
                             zero_centered)
    assert_close(y, y64, torch.float32)
    y.sum().backward()
    assert ln.weight.grad.shape == (1000,) and ln.bias.grad.shape == (1000,)
    assert sorted(ln.state_dict()) == ["bias", "weight"]


def test_deallocate_output_tensor_accepts_the_output():
    # Megatron's pipeline schedule frees a stage's output with out.data = torch.empty((1,)),
    # after asserting out._base is None (a view would keep the whole storage alive).
    def deallocate_output_tensor(out):
        assert out._base is None, "counter-productive to free a view of another tensor."
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)

    ln = FusedLayerNorm(TransformerConfig(), 64).to(DEVICE)
    x = _x((4, 2, 64), torch.float32)
    y = ln(x)
    deallocate_output_tensor(y)
    assert y.numel() == 1 and y.grad_fn is not None
    view = torch.randn(8, 64).view(4, 2, 64)
    with pytest.raises(AssertionError, match="view"):
        deallocate_output_tensor(view)


def test_make_viewless_tensor():
    from fusedlib.utils import make_viewless_tensor

    base = torch.randn(8, 6, requires_grad=True)
    view = (base * 2).view(4, 2, 6)
    assert view._base is not None
    out = make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert out._base is None and out.data_ptr() == view.data_ptr() and torch.equal(out, view)
    out.sum().backward()
    assert torch.equal(base.grad, torch.full_like(base, 2.0))
    plain = torch.randn(3)
    assert make_viewless_tensor(plain, requires_grad=False, keep_graph=False) is plain


def test_memory_efficient_switch_is_read_at_forward():
    cfg = TransformerConfig(memory_efficient_layer_norm=False)
    ln = FusedLayerNorm(cfg, 32).to(DEVICE)
    x = _x((5, 32), torch.float32)
    y = ln(x)  # kept: torch 2.11 frees a temporary's saved tensors
    assert y.grad_fn.saved_tensors[0].data_ptr() == x.data_ptr()
    cfg.memory_efficient_layer_norm = True
    y = ln(x)
    assert y.grad_fn.saved_tensors[0].data_ptr() == y.data_ptr()


@pytest.mark.parametrize("zero_centered", (False, True))
def test_fused_rms_norm_module_and_factory(zero_centered):
    cfg = TransformerConfig(normalization="RMSNorm", layernorm_zero_centered_gamma=zero_centered, sequence_parallel=True)
    rms = FusedNorm(cfg, 96, eps=1e-6)
    assert isinstance(rms, FusedRMSNorm) and rms.bias is None and rms.weight.sequence_parallel is True
    assert sorted(rms.state_dict()) == ["weight"]
    rms = rms.to(DEVICE)
    x = _x((2, 3, 96), torch.float32)
    y = rms(x)
    y64 = unfused.rms_norm(x.detach().double(), rms.weight.detach().double(), 1e-6, zero_centered)
    assert_close(y, y64, torch.float32)
    assert isinstance(FusedNorm(TransformerConfig(), 96), FusedLayerNorm)


def test_module_parameters_follow_the_input_dtype():
    ln = FusedLayerNorm(TransformerConfig(), 256).to(DEVICE, torch.bfloat16)
    x = _x((4, 256), torch.bfloat16)
    y = ln(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert ln.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: FusedLayerNorm(TransformerConfig(normalization="RMSNorm"), 64), ValueError,
         "FusedLayerNorm implements normalization='LayerNorm', but config.normalization='RMSNorm': use FusedRMSNorm"),
        (lambda: FusedRMSNorm(TransformerConfig(), 64), ValueError, "use FusedLayerNorm, or FusedNorm"),
        (lambda: FusedLayerNorm(TransformerConfig(), 65537), ValueError, r"hidden_size must be in 1..65536"),
        (lambda: FusedLayerNorm(TransformerConfig(), 0), ValueError, r"hidden_size must be in 1..65536"),
        (lambda: FusedLayerNorm(TransformerConfig(), (4, 8)), ValueError, "hidden_size must be an int"),
        (lambda: FusedLayerNorm(TransformerConfig(), 64, backend="cuda"), ValueError, "backend must be one of"),
        (lambda: FusedLayerNorm(TransformerConfig(), 64, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
        (lambda: FusedRMSNorm(TransformerConfig(normalization="RMSNorm"), 64, eps=1e39), ValueError,
         "eps must be a finite number >= 0, at most float32's max"),
    ],
)
def test_module_bad_arguments_raise_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("hidden_size, got", [([8.7], r"float 8.7 in \[8.7\]"), (("8",), r"str '8' in \('8',\)"),
                                              ([True], r"bool True in \[True\]"), ([None], "NoneType None"),
                                              (8.0, "float 8.0"), (True, "bool True")])
def test_module_hidden_size_must_be_an_int(hidden_size, got):
    # a 1-element shape's element went through int(): [8.7] made a module of 8 columns, ("8",)
    # one of 8, [True] one of 1; [None] raised int()'s unnamed TypeError
    with pytest.raises(TypeError, match=f"hidden_size must be an int .*got {got}"):
        FusedLayerNorm(TransformerConfig(), hidden_size)
    with pytest.raises(ValueError):  # an ArgumentTypeError: still the ValueError it raised before
        FusedRMSNorm(TransformerConfig(normalization="RMSNorm"), hidden_size)
    import numpy as np

    for ok in (8, np.int64(8), [8], (np.int32(8),), torch.Size([8])):
        assert FusedLayerNorm(TransformerConfig(), ok).weight.shape == (8,)


@pytest.mark.parametrize("field", ["layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                                   "memory_efficient_layer_norm"])
def test_config_switches_must_be_bools(field):
    # an object with the config's fields need not validate them, and bool() read a str "False"
    # as True: layernorm_zero_centered_gamma="False" made gamma = weight + 1 (a checkpoint's
    # weight of ~1 then scaled by ~2)
    from types import SimpleNamespace

    import numpy as np

    fields = dict(normalization="LayerNorm", layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                  sequence_parallel=False, memory_efficient_layer_norm=False)
    x = torch.randn(3, 8, device=DEVICE)
    want = FusedLayerNorm(SimpleNamespace(**fields), 8).to(DEVICE)(x)
    for cls, norm in ((FusedLayerNorm, "LayerNorm"), (FusedRMSNorm, "RMSNorm")):
        if cls is FusedRMSNorm and field == "persist_layer_norm":
            continue  # FusedRMSNorm does not read it
        for bad, got in (("False", "str"), (0, "int"), (None, "NoneType")):
            cfg = SimpleNamespace(**{**fields, "normalization": norm, field: bad})
            with pytest.raises(TypeError, match=f"config.{field} must be a bool, got {got}"):
                m = cls(cfg, 8).to(DEVICE)
                m(x)  # memory_efficient_layer_norm: read at each forward
            if field == "memory_efficient_layer_norm":
                with pytest.raises(TypeError, match=f"config.{field} must be a bool, got {got}"):
                    fusedlib.norm_with_residual(m, x)
        m = cls(SimpleNamespace(**{**fields, "normalization": norm, field: np.bool_(False)}), 8).to(DEVICE)
        if cls is FusedLayerNorm:
            assert torch.equal(m(x), want)
        assert m.zero_centered_gamma is False


def test_unknown_normalization_is_named_as_such():
    # an object with the config's fields need not validate them: "rmsnorm" was told to use
    # FusedLayerNorm by FusedLayerNorm itself
    from types import SimpleNamespace

    cfg = SimpleNamespace(normalization="rmsnorm", layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                          sequence_parallel=False, memory_efficient_layer_norm=False)
    for cls in (FusedLayerNorm, FusedRMSNorm, FusedNorm):
        with pytest.raises(ValueError, match="config.normalization must be 'LayerNorm' or 'RMSNorm', got 'rmsnorm'"):
            cls(cfg, 8)


@pytest.mark.parametrize("config", (None, {"normalization": "LayerNorm"}))
def test_a_config_without_the_fields_is_named(config):
    # None reached config.normalization: an AttributeError that named no argument
    for cls in (FusedLayerNorm, FusedRMSNorm, FusedNorm):
        with pytest.raises(TypeError, match=r"^config must be a TransformerConfig .* got (NoneType|dict)"):
            cls(config, 8)


def test_a_parameter_of_another_dtype_says_how_to_match_it():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"weight dtype torch.float32 must match input dtype torch.bfloat16 .*cast"):
        fused_layer_norm(x, torch.ones(8), torch.zeros(8, dtype=torch.bfloat16), 1e-5)


# ---------------------------------------------------------------------------------------
# The optional Apex backend
# ---------------------------------------------------------------------------------------

_APEX_PARTS = ("FastLayerNormFN", "FusedLayerNormAffineFunction", "FusedRMSNormAffineFunction")


def test_apex_missing_gives_install_instructions(monkeypatch):
    # runs everywhere: Apex's absence is simulated, so the message is checked even where Apex exists
    monkeypatch.setattr(apex_backend, "apex_status",
                        lambda: {name: "ModuleNotFoundError: No module named 'apex'" for name in _APEX_PARTS})
    for make in (lambda: FusedLayerNorm(TransformerConfig(persist_layer_norm=True), 4096, backend="apex"),
                 lambda: FusedRMSNorm(TransformerConfig(normalization="RMSNorm"), 4096, backend="apex")):
        with pytest.raises(apex_backend.ApexNotAvailableError) as info:
            make()
        msg = str(info.value)
        assert "No module named 'apex'" in msg
        assert "conda install -c conda-forge nvidia-apex" in msg and "https://github.com/NVIDIA/apex" in msg
        assert "not on PyPI" in msg and "backend='fusedlib'" in msg
    assert isinstance(info.value, ImportError)


def test_apex_status_reports_each_part():
    status = apex_backend.apex_status()
    assert set(status) == set(_APEX_PARTS)
    assert apex_backend.apex_available() == any(why == "" for why in status.values())


@pytest.mark.skipif(not apex_backend.apex_available() or DEVICE.type != "cuda",
                    reason="Apex is not available here: " + apex_backend.APEX_INSTALL_HINT)
def test_apex_backend_matches_fusedlib():  # pragma: no cover (needs Apex and a GPU)
    for h in (4096, 1000):  # in Apex's persistent list, and not
        cfg = TransformerConfig(persist_layer_norm=True)
        if not (apex_backend.apex_available("FusedLayerNormAffineFunction")
                or h in apex_backend.PERSIST_LN_HIDDEN_SIZES and apex_backend.apex_available("FastLayerNormFN")):
            continue
        ours = FusedLayerNorm(cfg, h).to(DEVICE, torch.bfloat16)
        theirs = FusedLayerNorm(cfg, h, backend="apex").to(DEVICE, torch.bfloat16)
        with torch.no_grad():
            ours.weight.normal_()
            ours.bias.normal_()
        theirs.load_state_dict(ours.state_dict())
        x = _x((64, h), torch.bfloat16)
        y_ours, y_theirs = ours(x), theirs(x)
        assert y_theirs._base is None
        torch.testing.assert_close(y_theirs.float(), y_ours.float(), atol=2e-2, rtol=2e-2)
        dy = torch.randn_like(y_ours)
        g_ours = torch.autograd.grad(y_ours, [x, ours.weight, ours.bias], dy)
        g_theirs = torch.autograd.grad(y_theirs, [x, theirs.weight, theirs.bias], dy)
        for a, e in zip(g_theirs, g_ours):
            torch.testing.assert_close(a.float(), e.float(), atol=0.1, rtol=2e-2)


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (torch.randn(4, 8), torch.randn(7), torch.randn(8)), ValueError,
         r"weight must have shape \[h\] with h = input.shape\[-1\] = 8, got \[7\]"),
        (lambda: (torch.randn(4, 8), torch.randn(8), torch.randn(9)), ValueError, r"bias must have shape \[h\]"),
        (lambda: (torch.randn(4, 8), torch.randn(8).half(), torch.randn(8)), TypeError, "weight dtype"),
        (lambda: (torch.randn(4, 8), torch.randn(8), torch.randn(8).double()), TypeError, "bias dtype"),
        (lambda: (torch.randn(4, 8).int(), torch.randn(8).int(), torch.randn(8).int()), TypeError,
         "input must have dtype"),
        (lambda: (torch.randn(4, 8), torch.randn(1, 8), torch.randn(8)), ValueError, "weight must be 1-D"),
        (lambda: ([1.0, 2.0], torch.randn(2), torch.randn(2)), TypeError, "input must be a torch.Tensor"),
        (lambda: (torch.randn(2, MAX_HIDDEN_SIZE + 1), torch.randn(MAX_HIDDEN_SIZE + 1), None), ValueError,
         r"hidden size input.shape\[-1\] must be in 1..65536 .* got 65537"),
        (lambda: (torch.randn(4, 0), torch.randn(0), torch.randn(0)), ValueError, r"must be in 1..65536"),
        # no weight: unchecked, the kernel launch would fail on None's missing .dtype, naming no argument
        (lambda: (torch.randn(4, 8), None, torch.randn(8)), TypeError, "weight must be a torch.Tensor, got NoneType"),
        (lambda: (torch.randn(4, 8), None, None), TypeError, "weight must be a torch.Tensor, got NoneType"),
    ],
)
def test_bad_input_raises_clear_error(make, error, match):
    x, w, b = make()
    x = x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    with pytest.raises(error, match=match):
        fused_layer_norm(x, w.to(DEVICE) if w is not None else None, b.to(DEVICE) if b is not None else None)
    if w is None:  # RMSNorm shares the check
        with pytest.raises(error, match=match):
            fused_rms_norm(x, None)


def test_bad_eps_and_mixed_devices_raise():
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    # 1e39: finite in float64, inf in the kernels' float32 (the output was silently 0)
    for eps in (-1e-5, float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            fused_rms_norm(x, w, eps)
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            fused_layer_norm(x, w, None, eps)
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match="one device, got input on"):
        fused_layer_norm(x, torch.randn(8, device=other), None)
    with pytest.raises(ValueError, match="past the tile table's last bound, 65536"):
        pick(FWD_TILES, 70000)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's padding rows (all 0) are 0 / 0 at eps = 0
def test_eps_zero_is_accepted_everywhere():
    # eps >= 0 is the documented range (0 is torch's own layer_norm's too): a check that refused
    # eps = 0 in the module's constructor, or an int 0 (which takes the slow check), would break it
    x = (2 * torch.randn(6, 16, device=DEVICE) + 0.5)  # rows of nonzero variance: finite at eps = 0
    x64 = x.double()
    ln = FusedLayerNorm(TransformerConfig(), 16, eps=0.0, device=DEVICE)
    rms = FusedRMSNorm(TransformerConfig(normalization="RMSNorm"), 16, eps=0, device=DEVICE)
    # kept as a Python float, an int 0 too: the ops remember a launch plan only for a float eps (any
    # other number is checked again on every call)
    assert type(ln.eps) is float and type(rms.eps) is float and ln.eps == rms.eps == 0.0
    # float64 references at eps = 0 (fusedlib.unfused's norms refuse eps = 0), gamma = 1, beta = 0
    want_ln = torch.nn.functional.layer_norm(x64, (16,), eps=0.0)
    want_rms = x64 * x64.square().mean(-1, keepdim=True).rsqrt()
    assert_close(ln(x), want_ln, torch.float32)
    assert_close(rms(x), want_rms, torch.float32)
    w, b = ln.weight.detach(), ln.bias.detach()
    for eps in (0.0, 0):
        assert_close(fused_layer_norm(x, w, b, eps), want_ln, torch.float32)
        assert_close(fused_rms_norm(x, w, eps), want_rms, torch.float32)


@pytest.mark.parametrize("eps, got", [("1e-5", "str"), (None, "NoneType"), (True, "bool"),
                                      (torch.tensor(1e-5), "torch.Tensor"), ([1e-5], "list")])
def test_eps_of_another_type_raises_a_type_error_naming_it(eps, got):
    # the house rule: a TypeError for a wrong type (an ArgumentTypeError: also the ValueError
    # raised before, which callers may catch); a str eps was "must be a finite number" alone
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    for call in (lambda: fused_layer_norm(x, w, None, eps), lambda: fused_rms_norm(x, w, eps),
                 lambda: FusedLayerNorm(TransformerConfig(), 8, eps)):
        with pytest.raises(TypeError, match=f"eps must be a finite number >= 0 .*got {got}"):
            call()
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            call()


@pytest.mark.parametrize("norm", NORMS)
def test_a_signature_that_passed_the_checks_skips_them_and_a_bad_one_never_does(norm, count_calls):
    # The forward's argument check runs when no plan matches the call's signature; a plan is
    # remembered only for a signature that passed it, under a key holding all the check reads.
    import fusedlib.fusions.fused_layer_norm as fln

    checks = count_calls(fln, "_check_inputs")
    gen = torch.Generator(device="cpu").manual_seed(7)
    h = 24
    w = torch.randn(h, generator=gen).to(DEVICE)
    b = torch.randn(h, generator=gen).to(DEVICE) if norm == "layer" else None

    def run(x, weight=w, bias=b, eps=1.0):
        return fused_layer_norm(x, weight, bias, eps) if norm == "layer" else fused_rms_norm(x, weight, eps)

    x = torch.randn(6, h, generator=gen).to(DEVICE)
    y = run(x)
    assert len(checks) == 1
    assert torch.equal(run(x), y) and len(checks) == 1  # the same signature: no check
    x2 = torch.randn(6, h, generator=gen).to(DEVICE)
    run(x2)
    assert len(checks) == 1  # new values, the same signature
    run(x2[:5])
    assert len(checks) == 2  # a new shape: checked once
    # bad arguments beside a remembered signature are still refused, every time
    for _ in range(2):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            run(x, eps=True)  # equal to 1.0 as a key, but a bool
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            run(x, eps=float("nan"))
        with pytest.raises(ValueError, match=r"weight must have shape \[h\]"):
            run(x, weight=torch.randn(h + 1, device=DEVICE))
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            run(x.tolist())
        with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
            run(x, weight=w.tolist())
    # a strided weight: the check copies it, every call checks again, the result is the same
    wide = torch.zeros(2 * h, device=DEVICE)
    wide[::2] = w
    n = len(checks)
    for _ in range(2):
        assert torch.equal(run(x, weight=wide[::2]), y)
    assert len(checks) == n + 2
    # the unchecked kernel-layer call's plans never stand for a check: after norm_fwd on the same
    # arguments, the op still refuses bad ones and still copies a strided weight
    bad_w = torch.randn(h + 3, device=DEVICE)
    with warnings.catch_warnings():  # what the unchecked calls compute (NaN for eps < 0) is not the point
        warnings.simplefilter("ignore", RuntimeWarning)
        for stats in (False, True):  # as the op's call without and with autograd
            kw = dict(rms_norm=norm == "rms", stats=stats)
            norm_fwd(x, bad_w, None if b is None else torch.randn(h + 3, device=DEVICE), 1.0, **kw)
            norm_fwd(x, w, b, -1.0, **kw)
            norm_fwd(x, wide[::2], b, 1.0, **kw)
    with pytest.raises(ValueError, match=r"weight must have shape \[h\]"):
        run(x, weight=bad_w, bias=None if b is None else torch.randn(h + 3, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        run(x, eps=-1.0)
    assert torch.equal(run(x, weight=wide[::2]), y)
    # an unhashable eps is the check's to refuse, not the key's
    for eps in ([1.0], {}):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            run(x, eps=eps)

    class Eps(float):  # a Real that is not a float: not keyed (its value may change), checked every call
        pass

    n = len(checks)
    for _ in range(2):
        assert torch.equal(run(x, eps=Eps(1.0)), y)
    assert len(checks) == n + 2


@pytest.mark.parametrize("norm", ("layer", "rms"))
@pytest.mark.parametrize("flag", ("zero_centered_gamma", "memory_efficient"))
@pytest.mark.parametrize("value, got", [("no", "str"), (1, "int"), (None, "NoneType"), (0.0, "float")])
def test_non_bool_flags_raise_naming_them(norm, flag, value, got):
    # each was read as its truth value: "no" turned the switch on
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got {got}"):
        if norm == "layer":
            fused_layer_norm(x, w, None, **{flag: value})
        else:
            fused_rms_norm(x, w, **{flag: value})


def test_numpy_bool_flags_are_accepted():
    import numpy as np

    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    ref = fused_rms_norm(x, w, zero_centered_gamma=True)
    assert torch.equal(fused_rms_norm(x, w, zero_centered_gamma=np.bool_(True), memory_efficient=np.bool_(False)), ref)


def test_autograd_functions_are_the_entry_points():
    x = _x((3, 16), torch.float32)
    w, b = _params(16, torch.float32, "layer")
    assert torch.equal(FusedLayerNormAffineFunction.apply(x, w, b, EPS), fused_layer_norm(x, w, b, EPS))
    assert torch.equal(FusedRMSNormAffineFunction.apply(x, w, EPS), fused_rms_norm(x, w, EPS))


# ---------------------------------------------------------------------------------------
# The residual's gradient taken by the norm's backward (norm_with_residual)
# ---------------------------------------------------------------------------------------


def _module(norm, h, dtype, **config):
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                            normalization="LayerNorm" if norm == "layer" else "RMSNorm", **config)
    cls = FusedLayerNorm if norm == "layer" else FusedRMSNorm
    m = cls(cfg, h, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():  # not the initial ones and zeros, so gamma and beta matter
        m.weight.copy_(torch.randn(h, device=DEVICE))
        if m.bias is not None:
            m.bias.copy_(torch.randn(h, device=DEVICE))
    return m


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", (1, 7, 300, 4096))
def test_residual_gradient_added_in_the_backward_kernel(norm, dtype, h):
    # x feeds the norm and the residual: dx = norm's dx + the residual's gradient, summed in
    # float32 by the kernel and rounded once
    m = _module(norm, h, dtype)
    x = _x((3, 5, h), dtype)
    x_before = x.detach().clone()
    y, residual = fusedlib.norm_with_residual(m, x)
    assert torch.equal(residual, x) and residual._base is x  # the same values, a view, not a copy
    assert residual.grad_fn is y.grad_fn  # one node: its backward gets both gradients
    dy = torch.randn_like(y)
    dres = torch.randn(h, 5, 3, device=DEVICE).to(dtype).permute(2, 1, 0)  # non-contiguous
    torch.autograd.backward((y, residual), (dy, dres))
    assert torch.equal(x.detach(), x_before)
    x64, w64, dy64 = x.detach().double(), m.weight.detach().double(), dy.double()
    b64 = m.bias.detach().double() if m.bias is not None else None
    _, dx64, dw64, db64 = _reference(norm, x64, w64, b64, dy64)
    total64 = dx64 + dres.double()
    tol = _dx_tol(norm, x64, w64, dy64, total64, dtype)
    _assert_within("dx + dresidual", x.grad, total64, tol)
    assert_close(m.weight.grad, dw64, dtype, scale=15**0.5)
    # the same as autograd adding the gradient of the residual used directly
    x2 = x.detach().clone().requires_grad_(True)
    y2 = m(x2)
    torch.autograd.backward((y2, x2), (dy, dres))
    assert torch.equal(y, y2)
    if dtype == torch.float32:  # the two sums round differently in bf16/fp16 (once against twice)
        torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_residual_gradient_in_the_split_backward(norm):
    # the long-row backward (programs of BLOCK_N columns) adds the residual's gradient too
    h, rows = 300, 37
    w, b = _params(h, torch.float32, norm, requires_grad=False)
    x = _x((rows, h), torch.float32).detach()
    dy = torch.randn(rows, h, device=DEVICE)
    dres = torch.randn(h, rows, device=DEVICE).t()
    rms = norm == "rms"
    _, mean, rstd = norm_fwd(x, w, b, EPS, rms_norm=rms)
    tile = Tile(BLOCK_M=2, BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=2)
    dx, _, _ = norm_bwd(dy, x, w, b, mean, rstd, rms_norm=rms, tile=tile, dresidual=dres)
    dx0, _, _ = norm_bwd(dy, x, w, b, mean, rstd, rms_norm=rms, tile=tile)
    torch.testing.assert_close(dx, dx0 + dres, atol=1e-6, rtol=1e-6)
    x64, dy64 = x.double(), dy.double()
    _, dx64, _, _ = _reference(norm, x64, w.double(), b.double() if b is not None else None, dy64)
    _assert_within("dx", dx, dx64 + dres.double(),
                   _dx_tol(norm, x64, w.double(), dy64, dx64 + dres.double(), torch.float32))


@pytest.mark.parametrize("norm", NORMS)
def test_residual_output_alone_or_norm_output_alone(norm):
    # only one of the two outputs used: the other's gradient is None, never a tensor of zeros
    m = _module(norm, 33, torch.float32)
    x = _x((4, 33), torch.float32)
    _, residual = m.forward_with_residual(x)
    g = torch.randn_like(x)
    residual.backward(g)
    assert torch.equal(x.grad, g) and m.weight.grad is None
    x.grad = None
    y, _ = m.forward_with_residual(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_(True)
    m(x2).backward(dy)
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("switch", ("layernorm_zero_centered_gamma", "memory_efficient_layer_norm"))
def test_norm_with_residual_follows_the_config_switches(norm, switch):
    # the norm's node that also returns the residual computes what the module's forward computes,
    # with the config's switches: gamma = weight + 1, or y saved in place of x
    m = _module(norm, 33, torch.float32, **{switch: True})
    x = _x((4, 33), torch.float32)
    y, residual = fusedlib.norm_with_residual(m, x)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = m(x2)
    assert torch.equal(y, y2)
    me = switch == "memory_efficient_layer_norm"
    assert y.grad_fn.saved_tensors[0].data_ptr() == (y.data_ptr() if me else x.data_ptr())
    dy, dres = torch.randn_like(y), torch.randn_like(x)
    dx, dw = torch.autograd.grad((y, residual), (x, m.weight), (dy, dres))
    dx2, dw2 = torch.autograd.grad((y2, x2), (x2, m.weight), (dy, dres))
    torch.testing.assert_close(dx, dx2, atol=1e-5, rtol=1e-5)  # the sum rounded once against twice
    torch.testing.assert_close(dw, dw2, atol=1e-5, rtol=1e-5)


def test_residual_output_gradcheck_float64():
    x = torch.randn(3, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: FusedLayerNormAffineFunction.apply(x, w, b, EPS, False, False, True), (x, w, b))
    assert torch.autograd.gradcheck(
        lambda x, w: FusedRMSNormAffineFunction.apply(x, w, EPS, False, False, True), (x, w))
    assert torch.autograd.gradcheck(  # memory-efficient: x_hat from y, the residual's gradient added
        lambda x, w, b: FusedLayerNormAffineFunction.apply(x, w, b, EPS, True, True, True), (x, w, b))


def test_norm_with_residual_other_modules_and_an_fp32_stream():
    x = _x((2, 3, 16), torch.float32)
    ln = torch.nn.LayerNorm(16, device=DEVICE)
    y, residual = fusedlib.norm_with_residual(ln, x)
    assert residual is x and torch.equal(y, ln(x))  # torch's module: the residual is x itself
    ident = fusedlib.transformer.IdentityOp()
    y, residual = fusedlib.norm_with_residual(ident, x)
    assert y is x and residual is x
    m = _module("layer", 16, torch.bfloat16)  # bf16 norm, fp32 residual stream
    y, residual = fusedlib.norm_with_residual(m, x)
    assert residual is x and y.dtype == torch.bfloat16 and torch.equal(y, m(x.to(torch.bfloat16)))
    with torch.no_grad():  # no autograd: the same values, the input itself as the residual
        y, residual = m.forward_with_residual(x.detach().to(torch.bfloat16))
        assert residual.dtype == torch.bfloat16


def test_residual_output_rejects_what_the_norm_rejects():
    m = _module("layer", 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        FusedLayerNormAffineFunction.apply(_x((2, 8), torch.float32), m.weight, m.bias, EPS, False, False, True)


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "global_forward"])
def test_norm_with_residual_runs_the_modules_hooks(hook):
    # a module with hooks is called as norm(x), so they run as without fusedlib (the residual is
    # then x itself, autograd adding its gradient); without hooks, the fused path
    m = _module("layer", 16, torch.float32)
    x = _x((2, 3, 16), torch.float32)
    calls = []
    if hook == "forward":
        handle = m.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 0)
    elif hook == "forward_pre":
        handle = m.register_forward_pre_hook(lambda mod, i: calls.append(1))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: calls.append(1))
    try:
        y, residual = fusedlib.norm_with_residual(m, x)
    finally:
        handle.remove()
    assert calls and residual is x
    if hook == "forward":
        assert torch.equal(y, torch.zeros_like(y))  # the hook's output replaced the norm's
    y, residual = fusedlib.norm_with_residual(m, x)  # hooks removed: the residual from the norm's node
    assert residual is not x and residual._base is x and residual.grad_fn is y.grad_fn


def test_pre_norm_hooks_run_in_a_transformer_layer():
    from fusedlib.models.gpt import get_gpt_layer_local_spec
    from fusedlib.transformer.transformer_block import TransformerBlock

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec()).to(DEVICE)
    seen = []
    for name, module in block.named_modules():
        if name.endswith("input_layernorm") or name.endswith("pre_mlp_layernorm"):
            module.register_forward_hook(lambda mod, i, o, name=name: seen.append(name))
    block(torch.randn(4, 2, 16, device=DEVICE), None)
    assert sorted(seen) == ["layers.0.input_layernorm", "layers.0.pre_mlp_layernorm"]


@pytest.mark.parametrize("value", ["no", 2.5, None, 1])
def test_residual_out_must_be_a_bool(value):
    x = _x((2, 8), torch.float32)
    w, b = _params(8, torch.float32, "layer")
    with pytest.raises(TypeError, match="residual_out"):
        FusedLayerNormAffineFunction.apply(x, w, b, EPS, False, False, value)
    with pytest.raises(TypeError, match="residual_out"):
        FusedRMSNormAffineFunction.apply(x, w, EPS, False, False, value)


# ---------------------------------------------------------------------------------------
# A sublayer's bias-dropout-add in the next norm (bias_dropout_add_norm)
# ---------------------------------------------------------------------------------------


def _bda_norm_inputs(norm, h, dtype, lb=True, shape=(3, 5)):
    m = _module(norm, h, dtype)
    x = torch.randn(h, *shape, device=DEVICE).to(dtype).permute(*range(1, len(shape) + 1), 0)  # non-contiguous
    x.requires_grad_(True)
    residual = (2 * torch.randn(*shape, h, device=DEVICE) + 0.5).to(dtype).requires_grad_(True)
    linear_bias = torch.randn(h, device=DEVICE).to(dtype).requires_grad_(True) if lb else None
    return m, x, residual, linear_bias


def _bda_norm_chain(m, x_with_bias, residual, p, training):
    """The same computation as two fusedlib ops: the fused bias-dropout-add, then the norm with
    its residual (the path without the fusion)."""
    hidden = fusedlib.get_bias_dropout_add(training, True)(x_with_bias, residual, p)
    return fusedlib.norm_with_residual(m, hidden)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", (1, 7, 300, 4096))
@pytest.mark.parametrize("p", (0.0, 0.3))
def test_bias_dropout_add_norm_against_float64(norm, dtype, h, p, seed):
    from fusedlib.kernels.bias_dropout_add import dropout_mask, dropout_scale, philox_seed

    m, x, residual, lb = _bda_norm_inputs(norm, h, dtype)
    before = [t.detach().clone() for t in (x, residual, lb)]
    torch.manual_seed(seed)
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, p, True)
    assert y.grad_fn is hidden.grad_fn  # one node for both outputs
    dy, dh = torch.randn_like(y), torch.randn_like(hidden)
    torch.autograd.backward((y, hidden), (dy, dh))
    for t, b in zip((x, residual, lb), before):
        assert torch.equal(t.detach(), b)  # inputs never modified
    torch.manual_seed(seed)  # the op's seed, drawn again: its mask and scale
    rows = residual.numel() // h
    keep = dropout_mask(philox_seed(DEVICE), rows, h, p).view(residual.shape).double() if p > 0 else 1.0
    scale = dropout_scale(p)
    # h = residual + dropout(x + lb): two float32 additions and a product, one rounding to dtype
    v64 = (x.detach().double() + lb.detach().double()) * keep * scale
    h64 = residual.detach().double() + v64
    terms = residual.detach().double().abs() + 2 * v64.abs()
    _assert_within("h", hidden, h64, _half_ulp(hidden) + 3 * U * terms)
    # y and the gradients of h as it was stored: the norm's own tolerances
    hs64, w64 = hidden.detach().double(), m.weight.detach().double()
    b64 = m.bias.detach().double() if m.bias is not None else None
    y64, dn64, dw64, db64 = _reference(norm, hs64, w64, b64, dy.double())
    assert_close(y, y64, dtype)
    dres64 = dn64 + dh.double()
    _assert_within("d residual", residual.grad, dres64, _dx_tol(norm, hs64, w64, dy.double(), dres64, dtype))
    assert_close(m.weight.grad, dw64, dtype, scale=15**0.5)
    if db64 is not None:
        assert_close(m.bias.grad, db64, dtype, scale=15**0.5)
    # x's gradient and lb's, from the stored residual gradient as the bias-dropout-add backward takes it
    dx64 = residual.grad.double() * keep * scale
    _assert_within("dx", x.grad, dx64, _half_ulp(x.grad) + U * dx64.abs())
    assert (x.grad.double()[keep == 0] == 0).all() if p > 0 else True
    dlb64 = dx64.reshape(rows, h).sum(0)
    _assert_within("d linear bias", lb.grad, dlb64,
                   _half_ulp(lb.grad) + rows * U * dx64.abs().reshape(rows, h).sum(0))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", (1, 7, 300, 1000))
@pytest.mark.parametrize("p", (0.0, 0.3))
def test_bias_dropout_add_norm_equals_the_two_ops(norm, dtype, h, p, seed):
    # the fused op computes what fusedlib's bias-dropout-add then norm compute, bit for bit
    # (the same mask, h rounded once and normalised as rounded); the linear bias's gradient is
    # summed in float32 in another order
    m, x, residual, lb = _bda_norm_inputs(norm, h, dtype, shape=(37,))
    dy = torch.randn(37, h, device=DEVICE).to(dtype)
    dh = torch.randn(h, 37, device=DEVICE).to(dtype).t()  # non-contiguous
    results = []
    for op in (fusedlib.bias_dropout_add_norm, _bda_norm_chain):
        for t in (x, residual, lb, m.weight, m.bias):
            if t is not None:
                t.grad = None
        torch.manual_seed(seed)
        y, hidden = op(m, (x, lb), residual, p, True)
        torch.autograd.backward((y, hidden), (dy, dh))
        grads = [t.grad for t in (x, residual) if t is not None]
        results.append(((y, hidden, *grads), [t.grad for t in (m.weight, m.bias) if t is not None], lb.grad))
    (fused, params, dlb), (chain, params_chain, dlb_chain) = results
    # interpreted, the same bits; compiled, the two kernels may contract a product and a sum into
    # one FMA in different places (a float32 rounding apart, seen on the H200): within the norm's
    # tolerance there (test_bias_dropout_add_norm_against_float64 bounds each against float64)
    exact = DEVICE.type == "cpu"
    for a, b in zip(fused, chain):
        if exact:
            assert torch.equal(a, b)
        else:
            assert_close(a, b.double(), dtype)
    for a, b in zip(params, params_chain):
        if exact and h >= 8:
            assert torch.equal(a, b)
        elif exact:  # rows under 8 columns take an 8-column block (the mask's), which sums in another order
            _assert_within("d norm parameter", a, b.double(), 2 * 37 * U * b.double().abs() + 2 * _half_ulp(b))
        else:
            assert_close(a, b.double(), dtype, scale=37**0.5)
    # two float32 sums of the same 37 terms (x's gradient), each within 37 U of their absolute
    # sum, each rounded once to the bias's dtype
    abs_sum = fused[2].double().abs().reshape(37, h).sum(0)
    _assert_within("d linear bias", dlb, dlb_chain.double(),
                   2 * 37 * U * abs_sum + _half_ulp(dlb) + _half_ulp(dlb_chain))


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_with_a_zero_centered_gamma(norm):
    # a norm whose weight is stored zero-centred (config.layernorm_zero_centered_gamma: gamma =
    # weight + 1): the fused op normalises with that gamma, forward and backward, as the two ops do
    m = _module(norm, 24, torch.float32, layernorm_zero_centered_gamma=True)
    x = torch.randn(15, 24, device=DEVICE, requires_grad=True)
    residual = torch.randn(15, 24, device=DEVICE, requires_grad=True)
    lb = torch.randn(24, device=DEVICE, requires_grad=True)
    dy, dh = torch.randn(15, 24, device=DEVICE), torch.randn(15, 24, device=DEVICE)
    results = []
    for op in (fusedlib.bias_dropout_add_norm, _bda_norm_chain):
        torch.manual_seed(3)  # the same mask
        y, hidden = op(m, (x, lb), residual, 0.2, True)
        params = [m.weight] + ([m.bias] if m.bias is not None else [])
        results.append((y, hidden, *torch.autograd.grad((y, hidden), [x, residual, lb, *params], (dy, dh))))
    exact = DEVICE.type == "cpu"  # compiled: an FMA apart at most, as in the tests above
    for name, a, b in zip(("y", "h", "dx", "dresidual", "dlb", "dweight", "dbias"), *results):
        if exact and name != "dlb":
            assert torch.equal(a, b), name
        else:  # (the bias's column sum is taken in another order)
            assert_close(a, b.double(), torch.float32, scale=15**0.5)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_forward_without_a_backward_stores_no_statistics(norm, dtype, monkeypatch):
    # Without autograd (no_grad, or no input that requires grad) the ops run their forward with
    # an InferenceCtx: the kernel neither allocates nor writes mean and rstd, and y has the
    # bits of the forward that stores them for a backward. With autograd they are stored (the
    # backward tests check what it does with them).
    import fusedlib.fusions.fused_layer_norm as fln

    seen = []

    def spy(fn, stats):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.append(out[stats])  # (mean, rstd)
            return out
        return wrapper

    monkeypatch.setattr(fln, "_norm_fwd", spy(fln._norm_fwd, slice(1, 3)))  # (y, mean, rstd, h, w, b)
    monkeypatch.setattr(fln, "bias_dropout_add_norm_fwd", spy(fln.bias_dropout_add_norm_fwd, slice(2, 4)))
    h = 37
    w, b = _params(h, dtype, norm)
    x = _x((5, 3, h), dtype).transpose(0, 1)  # [3, 5, h], strided rows
    with torch.no_grad():
        y_ng = _apply(norm, x, w, b)
    y_frozen = _apply(norm, x.detach(), w.detach(), b.detach() if b is not None else None)
    y = _apply(norm, x, w, b)
    assert seen[0] == (None, None) and seen[1] == (None, None)
    mean, rstd = seen[2]
    assert rstd is not None and rstd.shape == (15,) and (mean is None) == (norm == "rms")
    assert torch.equal(y_ng, y.detach()) and torch.equal(y_frozen, y.detach())
    # the bias-dropout-add in the norm
    m, x, residual, lb = _bda_norm_inputs(norm, h, dtype)
    seen.clear()
    with torch.no_grad():
        y_ng, h_ng = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.0, False)
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.0, False)
    assert seen[0] == (None, None) and seen[1][1] is not None
    assert torch.equal(y_ng, y.detach()) and torch.equal(h_ng, hidden.detach())


@pytest.mark.parametrize("norm", NORMS)
def test_a_forward_without_a_backward_over_many_row_tiles(norm):
    # the forward that stores no statistics, over several row tiles (200 rows of 37 columns: the
    # forward takes 32 rows per tile): every row of y (and of h) has the bits of the forward that
    # stores them, the first rows included; and a recording forward of the same signature after it
    # stores them for its backward
    h, rows = 37, 200
    w, b = _params(h, torch.float32, norm)
    x = _x((rows, h), torch.float32)
    with torch.no_grad():
        y_ng = _apply(norm, x, w, b)
    assert torch.equal(y_ng, _check_fwd_bwd(norm, x, w, b).detach())
    m, x, residual, lb = _bda_norm_inputs(norm, h, torch.float32, shape=(rows,))
    with torch.no_grad():
        y_ng, h_ng = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.0, False)
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.0, False)
    assert torch.equal(y_ng, y.detach()) and torch.equal(h_ng, hidden.detach())
    dy = torch.randn_like(y)
    y.backward(dy)
    r2 = residual.detach().clone().requires_grad_(True)
    _bda_norm_chain(m, (x.detach().clone(), lb.detach()), r2, 0.0, True)[0].backward(dy)  # p = 0: the same h
    torch.testing.assert_close(residual.grad, r2.grad, **({} if DEVICE.type == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_empty_input_draws_no_random_numbers(norm):
    # as torch's dropout (and fusedlib's bias-dropout-add): nothing to drop, the generator stays
    state = generator_state
    m, _, _, _ = _bda_norm_inputs(norm, 16, torch.float32)
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    lb = torch.randn(16, device=DEVICE, requires_grad=True)
    residual = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    before = state()
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.2, True)
    assert torch.equal(state(), before)
    (y.sum() + hidden.sum()).backward()
    assert y.shape == hidden.shape == (0, 16) and x.grad.shape == (0, 16)
    assert torch.equal(lb.grad, torch.zeros_like(lb))
    x1, r1 = torch.randn(2, 16, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    fusedlib.bias_dropout_add_norm(m, (x1, lb), r1, 0.2, True)
    assert not torch.equal(state(), before)  # a non-empty input draws its seed


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_dropping_everything_draws_no_random_numbers(norm):
    # p = 1: the mask drops every element whatever the random bits; no key is drawn and h is
    # the residual (as torch's dropout for p = 1), the same as the two ops give
    state = generator_state
    m, x, residual, lb = _bda_norm_inputs(norm, 16, torch.float32)
    before = state()
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 1.0, True)
    assert torch.equal(state(), before)
    assert torch.equal(hidden, residual.detach())
    y2, h2 = _bda_norm_chain(m, (x, lb), residual, 1.0, True)
    assert torch.equal(h2, hidden)
    # interpreted, the same bits; compiled, within the norm's tolerance (as in
    # test_bias_dropout_add_norm_equals_the_two_ops)
    if DEVICE.type == "cpu":
        assert torch.equal(y2, y)
    else:
        assert_close(y, y2.double(), torch.float32)
    (y.sum() + hidden.sum()).backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(lb.grad, torch.zeros_like(lb))


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_at_p_zero_draws_no_random_numbers(norm):
    # p = 0 in training drops nothing: as torch's dropout, no random numbers are drawn, and x's
    # gradient is h's gradient itself
    state = generator_state
    m, x, residual, lb = _bda_norm_inputs(norm, 16, torch.float32)
    before = state()
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.0, True)
    assert torch.equal(state(), before)
    torch.autograd.backward((y, hidden), (torch.randn_like(y), torch.randn_like(hidden)))
    assert torch.equal(x.grad, residual.grad)


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_takes_a_strided_linear_bias(norm):
    # the linear bias as a strided view (every other element of a longer tensor): the values and
    # gradients of the same bias held contiguous
    m, x, residual, lb = _bda_norm_inputs(norm, 24, torch.float32)
    wide = torch.randn(48, device=DEVICE)
    wide[::2] = lb.detach()
    wide.requires_grad_(True)
    dy, dh = torch.randn_like(residual), torch.randn_like(residual)
    out = []
    for bias in (lb, wide[::2]):
        torch.manual_seed(5)  # the same mask
        y, hidden = fusedlib.bias_dropout_add_norm(m, (x, bias), residual, 0.2, True)
        out.append((y, hidden, *torch.autograd.grad((y, hidden), (x, lb if bias is lb else wide), (dy, dh))))
    (y, hidden, dx, dlb), (y_s, hidden_s, dx_s, dwide) = out
    assert torch.equal(y_s, y) and torch.equal(hidden_s, hidden) and torch.equal(dx_s, dx)
    assert torch.equal(dwide[::2], dlb) and torch.equal(dwide[1::2], torch.zeros_like(dlb))


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_takes_a_non_contiguous_residual(norm):
    # the residual as a permuted view (column stride 15): the values and gradients of the same
    # residual held contiguous
    m, x, residual, lb = _bda_norm_inputs(norm, 23, torch.float32)
    permuted = residual.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0).requires_grad_(True)
    assert not permuted.is_contiguous() and torch.equal(permuted, residual)
    dy, dh = torch.randn_like(residual), torch.randn_like(residual)
    out = []
    for res in (residual, permuted):
        torch.manual_seed(5)  # the same mask
        y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), res, 0.2, True)
        out.append((y, hidden, *torch.autograd.grad((y, hidden), (x, res), (dy, dh))))
    # interpreted, the same bits; compiled, the residual's strides make another specialization of
    # the kernels, which may contract a product and a sum into one FMA in other places (a float32
    # rounding apart, as in test_bias_dropout_add_norm_equals_the_two_ops): within the norm's
    # tolerance there (the H100 gave other bits for y)
    exact = DEVICE.type == "cpu"
    for name, a, b in zip(("y", "h", "dx", "dresidual"), out[1], out[0]):
        if exact:
            assert torch.equal(a, b), name
        else:
            assert_close(a, b.double(), torch.float32)


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_linear_bias_alone_requiring_grad(norm):
    # a sublayer whose input and residual are frozen but whose bias trains: h depends on the bias,
    # so it requires grad and its gradient reaches the bias, as on the path without the fusion
    m, x, residual, lb = _bda_norm_inputs(norm, 24, torch.float32)
    x, residual = x.detach(), residual.detach()
    torch.manual_seed(9)
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, 0.2, True)
    assert y.requires_grad and hidden.requires_grad
    gy, gh = torch.randn_like(y), torch.randn_like(hidden)
    (dlb,) = torch.autograd.grad((y, hidden), (lb,), (gy, gh))
    lb2 = lb.detach().clone().requires_grad_(True)
    torch.manual_seed(9)
    y2, h2 = _bda_norm_chain(m, (x, lb2), residual, 0.2, True)
    (dlb2,) = torch.autograd.grad((y2, h2), (lb2,), (gy, gh))
    torch.testing.assert_close(dlb, dlb2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_one_output_and_no_bias(norm):
    # y alone, h alone, no linear bias, an input that needs no gradient, evaluation mode
    from fusedlib.kernels.bias_dropout_add import dropout_scale

    m, x, residual, _ = _bda_norm_inputs(norm, 24, torch.float32, lb=False)
    for which in ("y", "h"):
        x.grad = residual.grad = None
        y, hidden = fusedlib.bias_dropout_add_norm(m, (x, None), residual, 0.2, True)
        out = y if which == "y" else hidden
        g = torch.randn_like(out)
        out.backward(g)
        if which == "h":
            assert torch.equal(residual.grad, g)  # h's gradient alone reaches the residual unchanged
            kept = x.grad != 0
            assert 0.6 < kept.float().mean() < 0.95  # about 80 % kept (288 elements)
            torch.testing.assert_close(x.grad[kept], (g * dropout_scale(0.2))[kept], rtol=U, atol=0)
    frozen = residual.detach()  # needs no gradient: only x's is computed
    x.grad = None
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, None), frozen, 0.0, False)  # eval: no dropout
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    _bda_norm_chain(m, (x2, None), frozen, 0.0, False)[0].sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **({} if DEVICE.type == "cuda" else dict(rtol=0, atol=0)))
    with torch.no_grad():
        y_ng, h_ng = fusedlib.bias_dropout_add_norm(m, (x, None), frozen, 0.5, False)
    assert torch.equal(h_ng, frozen + x.detach()) and torch.equal(y_ng, y.detach())
    # only the norm's parameters need gradients: h depends on none of them, so it requires no
    # grad (as the two torch ops would give); y does, and its weight gradient is the chain's
    m.weight.grad = None
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x.detach(), None), frozen, 0.0, False)
    assert y.requires_grad and not hidden.requires_grad
    # the same on the path without the fusion, and for the norm with its residual alone
    assert not fusedlib.bias_dropout_add_norm(m, (x.detach(), None), frozen, 0.0, False, False)[1].requires_grad
    assert not fusedlib.norm_with_residual(m, frozen)[1].requires_grad
    y.sum().backward()
    dw = m.weight.grad
    m.weight.grad = None
    _bda_norm_chain(m, (x.detach(), None), frozen, 0.0, False)[0].sum().backward()
    torch.testing.assert_close(dw, m.weight.grad, **({} if DEVICE.type == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_residual_alone_requiring_grad(norm):
    # h = residual + dropout(x + bias) depends on the residual: with x and the linear bias frozen
    # (a frozen sublayer) and the residual requiring grad, h must require grad and pass its
    # gradient to the residual, as the two ops without the fusion do
    m, x, residual, lb = _bda_norm_inputs(norm, 24, torch.float32)
    x, lb = x.detach(), lb.detach()
    for p in (0.2, 0.0):
        y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), residual, p, True)
        assert y.requires_grad and hidden.requires_grad, p
    gy, gh = torch.randn_like(y), torch.randn_like(hidden)
    torch.autograd.backward((y, hidden), (gy, gh))
    # the same through the path without the fusion (p = 0: the same h), h's gradient included
    r2 = residual.detach().clone().requires_grad_(True)
    y2, h2 = _bda_norm_chain(m, (x, lb), r2, 0.0, True)
    torch.autograd.backward((y2, h2), (gy, gh))
    torch.testing.assert_close(residual.grad, r2.grad)


def test_bias_dropout_add_norm_gradcheck_float64():
    from fusedlib.fusions.fused_layer_norm import BiasDropoutAddNormFunction

    x, r = (torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lb, w, b = (torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for rms in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, lb, r, w, b: BiasDropoutAddNormFunction.apply(x, lb, r, w, None if rms else b, EPS, 0.0, True,
                                                                     rms, False), (x, lb, r, w, b))
    assert torch.autograd.gradcheck(  # zero-centred gamma, dropout off in evaluation mode
        lambda x, lb, r, w, b: BiasDropoutAddNormFunction.apply(x, lb, r, w, b, EPS, 0.4, False, False, True),
        (x, lb, r, w, b))


def test_bias_dropout_add_norm_falls_back_to_the_two_ops():
    # torch's LayerNorm, a module with hooks, an fp32 residual stream, memory-efficient norms and
    # bias_dropout_fusion off take bias-dropout-add then norm_with_residual: the same values
    x = torch.randn(3, 2, 16, device=DEVICE, requires_grad=True)
    lb, r = torch.randn(16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    ln = torch.nn.LayerNorm(16, device=DEVICE)
    y, hidden = fusedlib.bias_dropout_add_norm(ln, (x, lb), r, 0.0, True)
    assert torch.equal(hidden, r + (x + lb)) and torch.equal(y, ln(hidden))
    m = _module("layer", 16, torch.float32)
    fused = fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.0, True)
    handle = m.register_forward_hook(lambda mod, i, o: o)
    try:
        hooked = fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.0, True)
    finally:
        handle.remove()
    assert type(fused[0].grad_fn).__name__ == "BiasDropoutAddNormFunctionBackward"
    assert type(hooked[0].grad_fn).__name__ != "BiasDropoutAddNormFunctionBackward"
    torch.testing.assert_close(hooked[0], fused[0], rtol=1e-6, atol=1e-6)
    unfused_bda = fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.0, True, fused=False)
    torch.testing.assert_close(unfused_bda[0], fused[0], rtol=1e-6, atol=1e-6)
    m16 = _module("layer", 16, torch.bfloat16)  # bf16 norm, fp32 stream: the residual stays fp32
    y, hidden = fusedlib.bias_dropout_add_norm(m16, (x, lb), r, 0.0, True)
    assert hidden.dtype == torch.float32 and y.dtype == torch.bfloat16
    me = _module("layer", 16, torch.float32, memory_efficient_layer_norm=True)
    me.load_state_dict(m.state_dict())
    y, hidden = fusedlib.bias_dropout_add_norm(me, (x, lb), r, 0.0, True)
    assert type(y.grad_fn).__name__ == "FusedLayerNormAffineFunctionBackward"
    torch.testing.assert_close(y, fused[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["shape", "dtype", "bias", "prob", "training", "device", "rms_norm",
                                  "zero_centered_gamma", "rms with bias"])
def test_bias_dropout_add_norm_rejects_bad_input(case):
    from fusedlib.fusions.fused_layer_norm import BiasDropoutAddNormFunction

    m = _module("layer", 16, torch.float32)
    x, r, lb = torch.randn(4, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    args = dict(x=x, lb=lb, r=r, prob=0.1, training=True, rms=False, zc=False, b=m.bias)
    expect = {"shape": (ValueError, "residual"), "dtype": (TypeError, "residual"),
              "bias": (ValueError, "linear_bias"), "prob": (ValueError, "prob"), "training": (TypeError, "training"),
              "device": (ValueError, "device"), "rms_norm": (TypeError, "rms_norm"),
              "zero_centered_gamma": (TypeError, "zero_centered_gamma"), "rms with bias": (ValueError, "RMSNorm")}
    if case == "shape":
        args["r"] = torch.randn(4, 17, device=DEVICE)
    elif case == "dtype":
        args["r"] = r.double()
    elif case == "bias":
        args["lb"] = torch.randn(15, device=DEVICE)
    elif case == "prob":
        args["prob"] = 1.5
    elif case == "training":
        args["training"] = "yes"
    elif case == "rms_norm":
        args["rms"] = "no"  # a str is not read as its truth value
    elif case == "zero_centered_gamma":
        args["zc"] = "False"
    elif case == "rms with bias":
        args["rms"] = True
    else:
        args["r"] = r.to("meta")
    err, word = expect[case]
    with pytest.raises(err, match=word):
        BiasDropoutAddNormFunction.apply(args["x"], args["lb"], args["r"], m.weight, args["b"], EPS, args["prob"],
                                         args["training"], args["rms"], args["zc"])
    if case in ("shape", "bias", "prob"):  # the public function raises as the bias-dropout-add does
        with pytest.raises((ValueError, TypeError)):
            fusedlib.bias_dropout_add_norm(m, (args["x"], args["lb"]), args["r"], args["prob"], True)


@pytest.mark.parametrize("h", (3, 7, 300, 1000))  # 3: a row shorter than the dropout mask's 8-column block
@pytest.mark.parametrize("p", (0.0, 0.3))
@pytest.mark.parametrize("wants", ["dx and d bias", "dx alone", "d bias alone"])
def test_bias_dropout_add_norm_backward_in_the_norm_or_apart(h, p, wants):
    # x's gradient and the bias's column sum taken by the norm's backward kernel, or by the
    # bias-dropout-add backward kernel reading dres back: the same results, whichever of the
    # two gradients is asked for
    from fusedlib.kernels.bias_dropout_add import dropout_scale, philox_seed
    from fusedlib.kernels.layer_norm import bias_dropout_add_norm_bwd, bias_dropout_add_norm_fwd

    rows = 37
    x, r, dy = (torch.randn(rows, h, device=DEVICE) for _ in range(3))
    dh = torch.randn(h, rows, device=DEVICE).t()
    lb, w, b = (torch.randn(h, device=DEVICE) for _ in range(3))
    seed = philox_seed(DEVICE) if p > 0 else None
    _, hh, mean, rstd = bias_dropout_add_norm_fwd(x, lb, r, seed, p, w, b, EPS, rms_norm=False)
    need_dx, lb_dtype = wants != "d bias alone", (torch.float32 if wants != "dx alone" else None)
    a, c = (bias_dropout_add_norm_bwd(dy, dh, hh, w, b, mean, rstd, seed, p, lb_dtype, rms_norm=False,
                                      in_norm=in_norm, need_dx=need_dx) for in_norm in (True, False))
    ref = bias_dropout_add_norm_bwd(dy, dh, hh, w, b, mean, rstd, seed, p, torch.float32, rms_norm=False,
                                    in_norm=False)  # every gradient, apart
    for r in (a, c):
        if need_dx:  # without dropout dx is dres itself
            assert (r[0] is r[1]) is (p == 0)
        else:
            assert r[0] is None
        assert (r[4] is None) is (lb_dtype is None)
    exact = DEVICE.type == "cpu"  # compiled: an FMA apart at most, as above
    for name, u, v in zip(("dx", "dres", "dweight", "dbias"), a[:4], ref[:4]):
        if u is None:
            continue
        if exact:
            assert torch.equal(u, v), name
        else:
            assert_close(u, v.double(), torch.float32, scale=rows**0.5 if name.startswith("dw") else 1.0)
    assert c[0] is None or torch.equal(c[0], ref[0])
    if lb_dtype is not None:
        # two float32 sums over rows, each within rows·U of the absolute sum, of x's gradients that
        # differ elementwise by what the comparison above allowed
        # (without dx, dx as the kernel formed it: dres·keep·scale, one float32 rounding away)
        abs_sum = ref[0].double().abs().sum(0)
        if a[0] is not None:
            dx_a, formed = a[0].double(), 0.0
        else:
            dx_a = a[1].double() * (ref[0] != 0) * (1.0 if p == 0 else dropout_scale(p))
            formed = U * abs_sum
        apart = (dx_a - ref[0].double()).abs().sum(0)
        _assert_within("d linear bias", a[4], ref[4].double(), 2 * rows * U * abs_sum + apart + formed)
        if exact or need_dx:
            assert torch.equal(c[4], ref[4])
        else:  # compiled, the bias-only form forms dx in registers: an FMA apart, as above
            _assert_within("d linear bias", c[4], ref[4].double(), 2 * rows * U * abs_sum + formed)


@pytest.mark.parametrize("norm", NORMS)
def test_bias_dropout_add_norm_split_backward_regenerates_each_column_blocks_mask(norm):
    # rows taken 32 columns per program (the split backward) with dropout in the norm's kernel:
    # each column block regenerates its own columns of the forward's mask, so x's gradient and
    # the bias's column sum equal those of the bias-dropout-add backward kernel applied to dres
    from fusedlib.kernels.bias_dropout_add import philox_seed
    from fusedlib.kernels.layer_norm import bias_dropout_add_norm_bwd, bias_dropout_add_norm_fwd

    rows, h, p = 5, 100, 0.3
    rms = norm == "rms"
    x, r, dy = (torch.randn(rows, h, device=DEVICE) for _ in range(3))
    lb, w = torch.randn(h, device=DEVICE), torch.randn(h, device=DEVICE)
    b = None if rms else torch.randn(h, device=DEVICE)
    seed = philox_seed(DEVICE)
    _, hh, mean, rstd = bias_dropout_add_norm_fwd(x, lb, r, seed, p, w, b, EPS, rms_norm=rms)
    split = Tile(BLOCK_M=1, BLOCK_N=32, num_warps=4, num_stages=1, programs_per_sm=1)
    a, c = (bias_dropout_add_norm_bwd(dy, None, hh, w, b, mean, rstd, seed, p, torch.float32, rms_norm=rms,
                                      tile=split, in_norm=in_norm) for in_norm in (True, False))
    assert torch.equal(a[1], c[1])  # dres: the same kernel and tile
    assert (a[0] == 0).any() and (a[0] != 0).any()
    exact = DEVICE.type == "cpu"  # compiled: an FMA apart at most, as above
    if exact:
        assert torch.equal(a[0], c[0])
    else:
        assert_close(a[0], c[0].double(), torch.float32)
    abs_sum = c[0].double().abs().sum(0)
    _assert_within("d linear bias", a[4], c[4].double(), 2 * rows * U * abs_sum)


def test_bias_dropout_add_norm_calls_alike_but_for_p_the_linear_bias_or_need_dx():
    # calls alike in every tensor but the dropout probability, the presence of the linear bias or
    # whether x's gradient is asked for, one after the other: each drops and scales as its own p,
    # adds its own bias, and returns what it was asked for. Against the bias-dropout-add kernels
    # (h; x's gradient and the bias's from the norm's dx) as in the test above.
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_fwd, dropout_scale, philox_seed
    from fusedlib.kernels.layer_norm import bias_dropout_add_norm_bwd, bias_dropout_add_norm_fwd

    rows, h = 37, 300
    x, r, dy = (torch.randn(rows, h, device=DEVICE) for _ in range(3))
    lb, w, b = (torch.randn(h, device=DEVICE) for _ in range(3))
    seed = philox_seed(DEVICE)
    exact = DEVICE.type == "cpu"  # compiled: an FMA apart at most, as above
    for bias, p, need_dx in ((lb, 0.2, True), (lb, 0.6, True), (None, 0.6, True), (lb, 0.6, False), (lb, 0.2, True)):
        case = (bias is not None, p, need_dx)
        _, hh, mean, rstd = bias_dropout_add_norm_fwd(x, bias, r, seed, p, w, b, EPS, rms_norm=False)
        want_h = bias_dropout_add_fwd(x, bias, r, seed, p)
        lb_dtype = None if bias is None else torch.float32
        got, ref = (bias_dropout_add_norm_bwd(dy, None, hh, w, b, mean, rstd, seed, p, lb_dtype, rms_norm=False,
                                              in_norm=in_norm, need_dx=need_dx) for in_norm in (True, False))
        assert (got[0] is None) is not need_dx and (got[4] is None) is (bias is None), case
        for name, u, v in zip(("h", "dx", "dres", "dweight", "dbias"), (hh, *got[:4]), (want_h, *ref[:4])):
            if v is None:
                continue
            if exact:
                assert torch.equal(u, v), (case, name)
            else:
                assert_close(u, v.double(), torch.float32, scale=rows**0.5 if name.startswith("dw") else 1.0)
        if bias is not None:  # two float32 sums of x's gradient over the rows, in different orders
            abs_sum = ref[1].double().abs().sum(0) * dropout_scale(p)  # >= the sum of |x's gradient|
            _assert_within("d linear bias", got[4], ref[4].double(), 2 * rows * U * abs_sum)


@pytest.mark.parametrize("rows", (3, 300))  # one backward program (its sums are the result), and several
def test_bias_dropout_add_norm_linear_bias_gradient_in_its_own_dtype(rows):
    # a float32 sublayer bias beside bf16 activations and norm: its gradient, summed over rows in
    # the norm's backward kernel, comes back in float32, rounded once from the float32 sum (as the
    # bias-dropout-add backward kernel gives it): within rows U of the absolute sum
    from fusedlib.kernels.layer_norm import bias_dropout_add_norm_bwd, bias_dropout_add_norm_fwd

    h, dtype = 40, torch.bfloat16
    x, r, dy = (torch.randn(rows, h, device=DEVICE).to(dtype) for _ in range(3))
    w, b = (torch.randn(h, device=DEVICE).to(dtype) for _ in range(2))
    lb = torch.randn(h, device=DEVICE)
    _, hh, mean, rstd = bias_dropout_add_norm_fwd(x, lb, r, None, 0.0, w, b, EPS, rms_norm=False)
    a, c = (bias_dropout_add_norm_bwd(dy, None, hh, w, b, mean, rstd, None, 0.0, torch.float32, rms_norm=False,
                                      in_norm=in_norm) for in_norm in (True, False))
    for got in (a, c):
        assert got[4].dtype == torch.float32 and got[2].dtype == got[3].dtype == dtype
        # x's gradient: h's itself (no dropout), summed over the rows
        dx = got[0].double()
        _assert_within("d linear bias", got[4], dx.sum(0), rows * U * dx.abs().sum(0))


@pytest.mark.parametrize("bias", ["none", "frozen"])
def test_bias_dropout_add_norm_without_a_bias_gradient_at_every_row_length(bias):
    # rows of 300 take x's gradient from the bias-dropout-add backward kernel, rows of 4096 from
    # the norm's (BDA_BWD_IN_NORM); with dropout and no bias gradient to sum, x's still comes out
    from fusedlib.kernels.bias_dropout_add import dropout_mask, philox_seed

    for h in (300, 4096):
        m = _module("layer", h, torch.float32)
        x = torch.randn(3, h, device=DEVICE, requires_grad=True)
        r = torch.randn(3, h, device=DEVICE)
        lb = None if bias == "none" else torch.randn(h, device=DEVICE)  # frozen: no grad
        torch.manual_seed(11)
        y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.3, True)
        g = torch.randn_like(y)
        torch.autograd.backward((y, hidden), (g, g))
        torch.manual_seed(11)
        keep = dropout_mask(philox_seed(DEVICE), 3, h, 0.3)
        x2 = x.detach().clone().requires_grad_(True)
        torch.manual_seed(11)
        y2, h2 = _bda_norm_chain(m, (x2, lb), r, 0.3, True)
        torch.autograd.backward((y2, h2), (g, g))
        assert (x.grad[~keep] == 0).all() and (x.grad[keep] != 0).all()
        torch.testing.assert_close(x.grad, x2.grad, **({} if DEVICE.type == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("h", (300, 4096))  # x's gradient from the bias-dropout-add kernel, then from the norm's
def test_bias_dropout_add_norm_keeps_nan_through_the_dropout_as_in_torch(h, seed):
    # torch's dropout multiplies by the mask (0·NaN = NaN): a NaN in x + bias is NaN in h where
    # it was dropped too, and a NaN gradient of h reaches x's gradient at dropped elements too
    from fusedlib.kernels.bias_dropout_add import dropout_mask, philox_seed

    m = _module("layer", h, torch.float32)
    rows = 64
    x_nan, r, x = (torch.randn(rows, h, device=DEVICE) for _ in range(3))  # fresh inputs first
    x_nan[:, 0] = float("nan")
    x.requires_grad_(True)
    lb = torch.randn(h, device=DEVICE, requires_grad=True)
    torch.manual_seed(seed)  # the op's key, replayed below
    _, hidden = fusedlib.bias_dropout_add_norm(m, (x_nan, None), r, 0.5, True)
    torch.manual_seed(seed)
    keep = dropout_mask(philox_seed(DEVICE), rows, h, 0.5)
    assert (~keep[:, 0]).any(), "64 rows at p = 0.5: some drop column 0"
    assert hidden[:, 0].isnan().all() and not hidden[:, 1:].isnan().any()
    # the backward: finite x, h's gradient NaN in column 0, y's zero (the norm adds nothing)
    torch.manual_seed(seed)  # the same mask
    y, hidden = fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.5, True)
    dh = torch.ones_like(hidden)
    dh[:, 0] = float("nan")
    torch.autograd.backward((y, hidden), (torch.zeros_like(y), dh))
    assert x.grad[:, 0].isnan().all()
    assert torch.equal(x.grad[:, 1:] == 0, ~keep[:, 1:]) and not x.grad[:, 1:].isnan().any()
    assert lb.grad[0].isnan() and not lb.grad[1:].isnan().any()


def test_bias_dropout_add_norm_leaves_its_inputs_alone_and_takes_only_bools():
    # out of training, with nothing needing a gradient, neither path writes into x (the
    # bias-dropout-add's own inference path would); fused must be a bool, as get_bias_dropout_add's
    m = _module("layer", 16, torch.float32)
    x, lb, r = torch.randn(3, 16, device=DEVICE), torch.randn(16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    before = x.clone()
    for norm in (m, torch.nn.LayerNorm(16, device=DEVICE)):
        for fused in (True, False):
            with torch.no_grad():
                y, h = fusedlib.bias_dropout_add_norm(norm, (x, lb), r, 0.1, False, fused)
            assert torch.equal(x, before) and h is not x
            torch.testing.assert_close(h, r + (x + lb), rtol=1e-6, atol=1e-6)
    for bad in ("False", None, 1):
        with pytest.raises(TypeError, match="fused"):
            fusedlib.bias_dropout_add_norm(m, (x, lb), r, 0.1, True, bad)
    with pytest.raises(ValueError, match="prob"):  # checked out of training too
        fusedlib.bias_dropout_add_norm(torch.nn.LayerNorm(16, device=DEVICE), (x, lb), r, 1.5, False)
    for bad in (None, torch.nn.functional.layer_norm, "layer"):  # the norm is a module
        with pytest.raises(TypeError, match="norm must be a torch.nn.Module"):
            fusedlib.bias_dropout_add_norm(bad, (x, lb), r, 0.1, True)


def test_a_norm_subclass_that_overrides_forward_is_called_as_written():
    class Doubled(FusedLayerNorm):
        def forward(self, input):  # noqa: A002
            return 2 * super().forward(input)

    m = _module("layer", 16, torch.float32)
    d = Doubled(m.config, 16, EPS, device=DEVICE)
    d.load_state_dict(m.state_dict())
    x, r = torch.randn(3, 16, device=DEVICE, requires_grad=True), torch.randn(3, 16, device=DEVICE)
    y, h = fusedlib.bias_dropout_add_norm(d, (x, None), r, 0.0, True)
    torch.testing.assert_close(y, 2 * m(h), rtol=0, atol=0)
    y, residual = fusedlib.norm_with_residual(d, x)
    assert residual is x and torch.equal(y, 2 * m(x))
