"""fusedlib.unfused: the references' argument checks, low-precision statistics and edge cases.

Each test pins one defect of a break-it pass: a wrong shape that broadcast silently, a scalar
that gave NaN or garbage, a float16 statistic that overflowed, an empty dim that raised from
deep inside torch. Numbers are compared with float64 computations written out here. The
references are plain PyTorch and device-agnostic, so these tests build CPU tensors on purpose
(also on a GPU machine: no fusedlib kernel runs here).
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from fusedlib import unfused as U

from conftest import assert_close  # noqa: I001

F64 = torch.float64


# --- 1. norms: statistics in float32 for float16/bfloat16 --------------------------------


def _rms64(x, w, eps=1e-5):
    x = x.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _ln64(x, w, b, eps=1e-5):
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    return xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps) * w.double() + b.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_large_values_in_half_precision(dtype):
    x = torch.tensor([[300.0, 1, 2, 3], [1000.0, -700, 5, 0.5]]).to(dtype)
    w = torch.tensor([1.0, 0.5, 2.0, -1.0]).to(dtype)
    y = U.rms_norm(x, w)
    assert y.dtype == dtype
    assert_close(y, _rms64(x, w), dtype)
    # the closed-form backward: against float64 autograd of the float64 formula
    dy = torch.tensor([[1.0, -2, 0.5, 3], [0.25, 1, -1, 2]]).to(dtype)
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    want = torch.autograd.grad(_rms64(x64, w64), (x64, w64), dy.double())
    dx, dw = U.rms_norm_back(dy, x, w)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, want[0], dtype)
    assert_close(dw, want[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_large_deviation_in_half_precision(dtype):
    x = torch.tensor([[600.0, 0, 0, 0], [-400.0, 100, 3, 9]]).to(dtype)  # deviations > 256
    w = torch.tensor([1.0, 0.5, 2.0, -1.0]).to(dtype)
    b = torch.tensor([0.1, 0.2, -0.3, 0.0]).to(dtype)
    y = U.layer_norm(x, w, b)
    assert y.dtype == dtype
    assert_close(y, _ln64(x, w, b), dtype)
    dy = torch.tensor([[1.0, -2, 0.5, 3], [0.25, 1, -1, 2]]).to(dtype)
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    want = torch.autograd.grad(_ln64(x64, w64, b64), (x64, w64, b64), dy.double())
    got = U.layer_norm_back(dy, x, w)
    for g, e in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, e, dtype)


def test_norm_result_dtype_is_the_promoted_dtype():
    x = torch.randn(3, 8).bfloat16()
    w32 = torch.randn(8)
    assert U.rms_norm(x, w32).dtype == torch.float32  # as documented: promote(x, weight)
    assert U.layer_norm(x, w32, None).dtype == torch.float32
    assert U.layer_norm(x, w32.bfloat16(), w32.bfloat16()).dtype == torch.bfloat16
    assert U.rms_norm(x.half(), w32.half()).dtype == torch.float16


@pytest.mark.parametrize("eps", [0.0, -1e-5, math.nan, math.inf])
def test_norm_eps_must_be_positive(eps):
    x, w = torch.ones(2, 4), torch.ones(4)
    for call in (lambda: U.layer_norm(x, w, None, eps), lambda: U.rms_norm(x, w, eps),
                 lambda: U.layer_norm_back(x, x, w, eps), lambda: U.rms_norm_back(x, x, w, eps)):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            call()


def test_norm_weight_shape_checked():
    with pytest.raises(ValueError, match=r"weight must have shape \[h\]"):
        U.rms_norm(torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):
        U.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(3))


# --- 2. per-row weights must be [n, 1] ----------------------------------------------------


def test_row_weights_of_shape_n_refused():
    y, x, w_bad = torch.randn(3, 6), torch.randn(3, 3), torch.rand(3)  # n == h: [n] would broadcast
    calls = [
        lambda: U.weighted_swiglu(y, w_bad),
        lambda: U.weighted_swiglu_back(torch.randn(3, 3), y, w_bad),
        lambda: U.clamped_weighted_swiglu(y, w_bad, 7.0),
        lambda: U.clamped_weighted_swiglu_back(torch.randn(3, 3), y, w_bad, 7.0),
        lambda: U.weighted_squared_relu(x, w_bad),
        lambda: U.weighted_squared_relu_back(torch.randn(3, 3), x, w_bad),
        lambda: U.weighted_swiglu(y, torch.rand(1, 3)),
        lambda: U.weighted_swiglu(y, torch.rand(2, 1)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"weights must have shape \[n, 1\]"):
            call()


def test_row_weights_scale_rows():
    y, w = torch.randn(3, 6, dtype=F64), torch.rand(3, 1, dtype=F64)
    y1, y2 = y[:, :3], y[:, 3:]
    torch.testing.assert_close(U.weighted_swiglu(y, w), y1 * torch.sigmoid(y1) * y2 * w)
    x = torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(U.weighted_squared_relu(x, w), torch.relu(x) ** 2 * w)


# --- 3. rotary width must be even ---------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_odd_rotary_width_refused(interleaved):
    with pytest.raises(ValueError, match="x's last dim.*must be even"):
        U.rotate_half(torch.randn(2, 5), interleaved)
    t, freqs = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 1, 8)
    with pytest.raises(ValueError, match="freqs' last dim.*must be even"):
        U.apply_rotary_pos_emb_bshd(t, freqs[..., :5], interleaved)
    with pytest.raises(ValueError, match="freqs' last dim"):
        U.apply_rotary_pos_emb_bshd(t[..., :4], freqs, interleaved)  # rot_dim > d
    out = U.apply_rotary_pos_emb_bshd(t, freqs[..., :4], interleaved)  # even partial width still fine
    assert out.shape == t.shape
    torch.testing.assert_close(out[..., 4:], t[..., 4:])


# --- 4. attention masks and dropout probabilities ----------------------------------------


def _qkv(b=2, sq=3, sk=4, h=2, d=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=g, dtype=F64), torch.randn(b, sk, h, d, generator=g, dtype=F64),
            torch.randn(b, sk, h, d, generator=g, dtype=F64))


def test_attention_mask_shapes_as_flash_attention():
    q, k, v = _qkv()  # b = hq = 2: a 3-D mask would pair its batch dim with the heads
    with pytest.raises(ValueError, match="attention_mask must be"):
        U.attention_reference(q, k, v, attention_mask=torch.zeros(2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D attention_mask"):
        U.attention_reference(q, k, v, attention_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="4-D attention_mask"):
        U.attention_reference(q, k, v, attention_mask=torch.zeros(3, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        U.attention_reference(q, k, v, attention_mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="attention_mask must be"):
        U.attention_mask_bshd(3, 4, attention_mask=torch.zeros(2, 3, 4, dtype=torch.bool))


def test_attention_per_batch_mask_is_per_batch():
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    mask[0, 0, :, 0] = True  # batch 0 cannot see key 0
    out = U.attention_reference(q, k, v, attention_mask=mask)
    for bi in range(2):
        s = torch.einsum("qhd,khd->hqk", q[bi], k[bi]) / 2.0  # d = 4
        s = s.masked_fill(mask[bi], -math.inf)
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[bi])
        torch.testing.assert_close(out[bi], want)


@pytest.mark.parametrize("p", [-0.1, 1.5, math.nan])
def test_dropout_probability_range(p):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be a dropout probability in \[0, 1\]"):
        U.attention_reference(q, k, v, dropout_p=p)
    x = torch.randn(1, 1, 2, 3, dtype=F64)
    keep = torch.ones_like(x, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"dropout_p must be a dropout probability in \[0, 1\]"):
        U.masked_softmax_dropout_reference(x, None, 1.0, keep, p)
    with pytest.raises(ValueError, match=r"prob must be a dropout probability in \[0, 1\]"):
        U.bias_dropout_add_masked(x, None, x, keep, p)


def test_attention_dropout_p_one_keeps_nothing():
    q, k, v = _qkv()
    out = U.attention_reference(q, k, v, dropout_p=1.0, dropout_mask=torch.ones(2, 2, 3, 4, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


# --- 5. cross entropy ---------------------------------------------------------------------


def _megatron_ce64(logits, target, eps):
    v = logits.shape[-1]
    s = eps * v / (v - 1) if eps > 0 else 0.0
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)
    return (1 - s) * nll - s * logp.mean(-1)


def test_cross_entropy_target_checks():
    logits = torch.randn(2, 3, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"target must have shape \[2, 3\]"):
        U.cross_entropy(logits, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="target must have shape"):
        U.cross_entropy_grad(logits, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=F64))
    with pytest.raises(TypeError, match="target must hold integer vocabulary ids"):
        U.cross_entropy(logits, torch.ones(2, 3) * 1.7)
    with pytest.raises(TypeError, match="target must hold integer vocabulary ids"):
        U.cross_entropy_grad(logits, torch.ones(2, 3), torch.ones(2, 3, dtype=F64))


def test_label_smoothing_range():
    logits, t = torch.randn(4, 5, dtype=F64), torch.tensor([0, 1, 2, 3])
    for eps in (-0.1, 1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            U.cross_entropy(logits, t, eps)
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            U.cross_entropy_grad(logits, t, torch.ones(4, dtype=F64), eps)
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            U.megatron_smoothing_to_torch(eps, 5)
    with pytest.raises(ValueError, match="label_smoothing.*at least 2"):
        U.cross_entropy(torch.randn(3, 1, dtype=F64), torch.zeros(3, dtype=torch.long), 0.1)
    with pytest.raises(ValueError, match="label_smoothing.*at least 2"):
        U.megatron_smoothing_to_torch(0.1, 1)
    assert U.cross_entropy(torch.randn(3, 1, dtype=F64), torch.zeros(3, dtype=torch.long)).abs().max() == 0


@pytest.mark.parametrize("eps", [0.1, 0.85, 0.95])  # V = 5: 0.85 and 0.95 > (V - 1)/V, s > 1
def test_cross_entropy_megatron_smoothing(eps):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    t = torch.tensor([[0, 4, -100], [2, 1, 3]])
    loss = U.cross_entropy(logits, t, eps)
    active = t != -100
    want = torch.where(active, _megatron_ce64(logits.detach(), torch.where(active, t, 0), eps), 0.0)
    torch.testing.assert_close(loss, want)
    go = torch.rand(2, 3, generator=g, dtype=F64)
    (grad,) = torch.autograd.grad(loss, logits, go)
    torch.testing.assert_close(U.cross_entropy_grad(logits.detach(), t, go, eps), grad)


# --- 6-8. softmax reference shapes, window bounds, zero keys ------------------------------


def test_masked_softmax_reference_3d_with_per_head_offset():
    x, off = torch.randn(3, 2, 4, dtype=F64), torch.randn(3, dtype=F64)
    p = U.masked_softmax_reference(x, None, 0.5, off)
    assert p.shape == x.shape
    e = torch.exp(0.5 * x)
    torch.testing.assert_close(p, e / (e.sum(-1, keepdim=True) + torch.exp(off).view(3, 1, 1)))
    torch.testing.assert_close(U.masked_softmax_reference(x[None], None, 0.5, off)[0], p)
    with pytest.raises(ValueError, match="softmax_offset"):
        U.masked_softmax_reference(torch.randn(2, 4, dtype=F64), None, 1.0, torch.randn(2, dtype=F64))


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), "ab", (1.0, 2)])
def test_sliding_window_negative_other_than_minus_one_refused(window):
    with pytest.raises(ValueError, match="window_size"):
        U.sliding_window_causal_mask(3, 3, window)
    with pytest.raises(ValueError, match="window_size"):
        U.attention_mask_bshd(3, 3, window_size=window)


def test_sliding_window_minus_one_is_unbounded():
    assert not U.sliding_window_causal_mask(3, 5, (-1, -1)).any()
    torch.testing.assert_close(U.sliding_window_causal_mask(4, 4, (-1, 0)), U.causal_mask(4))


def test_zero_keys():
    x = torch.randn(2, 3, 4, 0, dtype=F64)
    assert U.masked_softmax_reference(x, None, 1.0).shape == x.shape
    assert U.masked_softmax_reference(x, None, 1.0, torch.randn(3, dtype=F64)).shape == x.shape
    q, k, v = _qkv(sk=0)
    out = U.attention_reference(q, k, v, causal=False, sinks=torch.randn(2, dtype=F64))
    assert out.shape == q.shape and not out.any()
    assert U.scale_mask_softmax(x.float()).shape == x.shape


# --- 9. scalars that gave NaN or garbage ---------------------------------------------------


@pytest.mark.parametrize("s", [0.0, -1.0, math.nan])
def test_clamp_scalars_must_be_positive(s):
    x, w, y = torch.randn(2, 3), torch.rand(2, 1), torch.randn(2, 6)
    with pytest.raises(ValueError, match="clamp_scale"):
        U.weighted_squared_relu(x, w, s)
    with pytest.raises(ValueError, match="clamp_scale"):
        U.weighted_squared_relu_back(torch.randn(2, 3), x, w, s)
    for call in (lambda: U.clamped_swiglu(y, s), lambda: U.clamped_swiglu_back(x, y, s),
                 lambda: U.bias_clamped_swiglu(y, torch.zeros(6), s),
                 lambda: U.clamped_weighted_swiglu(y, w, s)):
        with pytest.raises(ValueError, match="clamp_value"):
            call()


def test_soft_clamp_matches_float64():
    x, w = torch.randn(3, 4, dtype=F64) * 5, torch.rand(3, 1, dtype=F64)
    c = 2.0 * torch.tanh(torch.relu(x) / 2.0)
    torch.testing.assert_close(U.weighted_squared_relu(x, w, 2.0), c * c * w)


# --- 10. docstrings -------------------------------------------------------------------------


def test_public_functions_document_shapes_raises_and_source():
    for name in U.__all__:
        f = getattr(U, name)
        if not callable(f):
            continue
        doc = inspect.getdoc(f) or ""
        for section in ("Args:", "Returns:", "Raises:", "Source:"):
            assert section in doc, f"{name}: no {section}"


# --- the references against independent float64 formulas ------------------------------------

_GELU_XS = [-5.0, -2.5, -1.0, -0.3, 0.2, 0.7, 1.0, 1.5, 3.0, 4.0]


def test_gelu_references_against_the_formulas_in_50_digits():
    # gelu_tanh (with the full double sqrt(2/pi)) and gelu_erf, and their derivatives, against
    # mpmath at 50 digits: a few float64 roundings (~1e-15 relative) apart; Megatron's 10-digit
    # sqrt(2/pi) would be ~1e-12 apart, erf(x) for erf(x/sqrt(2)) ~1e-1
    import mpmath  # torch's dependency, through sympy

    def tanh_gelu(t):
        return 0.5 * t * (1 + mpmath.tanh(mpmath.sqrt(2 / mpmath.pi) * (t + mpmath.mpf("0.044715") * t ** 3)))

    def erf_gelu(t):
        return 0.5 * t * (1 + mpmath.erf(t / mpmath.sqrt(2)))

    x = torch.tensor(_GELU_XS, dtype=F64)
    for ref, fn, grad in ((tanh_gelu, U.gelu_tanh, U.gelu_tanh_grad), (erf_gelu, U.gelu_erf, U.gelu_erf_grad)):
        with mpmath.workdps(50):
            value = torch.tensor([float(ref(mpmath.mpf(v))) for v in _GELU_XS], dtype=F64)
            slope = torch.tensor([float(mpmath.diff(ref, mpmath.mpf(v))) for v in _GELU_XS], dtype=F64)
        torch.testing.assert_close(fn(x), value, atol=1e-15, rtol=1e-14)
        torch.testing.assert_close(grad(x), slope, atol=1e-15, rtol=1e-14)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_softmax_backward_is_the_vjp_of_the_scaled_softmax(scale):
    # d/dx of softmax(scale·x), by torch.func.vjp in float64 (not the reference's closed form)
    x, g = torch.randn(3, 5, 7, dtype=F64), torch.randn(3, 5, 7, dtype=F64)
    p, vjp = torch.func.vjp(lambda t: torch.softmax(scale * t, dim=-1), x)
    (dx,) = vjp(g)
    torch.testing.assert_close(U.softmax_backward(g, p, scale), dx, atol=1e-15, rtol=1e-13)


def test_norm_default_eps_is_megatrons_1e_5():
    # rows of variance ~1e-6: the default eps (Megatron-core's layernorm_epsilon, 1e-5) dominates;
    # the same float64 formula in another order: a few ulps of |y| < 10 apart
    x = 1e-3 * torch.randn(4, 16, dtype=F64)
    w, b = torch.randn(16, dtype=F64), torch.randn(16, dtype=F64)
    torch.testing.assert_close(U.layer_norm(x, w, b), _ln64(x, w, b, eps=1e-5), atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(U.rms_norm(x, w), _rms64(x, w, eps=1e-5), atol=1e-13, rtol=1e-13)


def test_half_precision_norms_round_x_hat_before_gamma_and_beta():
    # Megatron's local norms: normalise in float32, cast x_hat back to x's dtype, then gamma
    # (and beta) in that dtype: each step one bfloat16 rounding, as written out here from the
    # float64 x_hat (a float32 x_hat rounds to the same bfloat16 but at a tie, which these
    # seeded inputs do not hit)
    bf = torch.bfloat16
    x, w, b = (torch.randn(8, 64) * 3).to(bf), (1 + 0.3 * torch.randn(64)).to(bf), torch.randn(64).to(bf)
    xd = x.double()
    xc = xd - xd.mean(-1, keepdim=True)
    ln_hat = (xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5)).to(bf)
    rms_hat = (xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + 1e-5)).to(bf)
    assert torch.equal(U.layer_norm(x, w, b), ln_hat * w + b)
    assert torch.equal(U.rms_norm(x, w), rms_hat * w)


@pytest.mark.parametrize("sq, sk", [(3, 6), (6, 3), (5, 5)])
def test_causal_and_window_masks_follow_the_index_rule(sq, sk):
    # bottom-right alignment, True = masked: query q sees key j iff j - q <= sk - sq (causal) and
    # sk - sq - left <= j - q <= sk - sq + right (window); causal with a window masks the union
    d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]  # j - q
    assert torch.equal(U.causal_mask(sq, sk), d > sk - sq)
    for left, right in ((2, 1), (0, 0), (1, -1), (-1, 2)):
        below = (d < sk - sq - left) if left >= 0 else torch.zeros_like(d, dtype=torch.bool)
        above = (d > sk - sq + right) if right >= 0 else torch.zeros_like(d, dtype=torch.bool)
        assert torch.equal(U.sliding_window_causal_mask(sq, sk, (left, right)), below | above)
        both = U.attention_mask_bshd(sq, sk, causal=True, window_size=(left, right))
        assert torch.equal(both, below | above | (d > sk - sq))


def test_attention_reference_pairs_each_query_head_with_its_group():
    # grouped-query attention: query head h reads key/value head h // (hq / hkv), written as a loop
    q, k, v = torch.randn(2, 3, 4, 5, dtype=F64), torch.randn(2, 6, 2, 5, dtype=F64), torch.randn(2, 6, 2, 5, dtype=F64)
    out = U.attention_reference(q, k, v, causal=True)
    masked = torch.arange(6)[None, :] - torch.arange(3)[:, None] > 3  # j - q > sk - sq
    for bi in range(2):
        for h in range(4):
            s = (q[bi, :, h] @ k[bi, :, h // 2].T / math.sqrt(5)).masked_fill(masked, -math.inf)
            torch.testing.assert_close(out[bi, :, h], torch.softmax(s, -1) @ v[bi, :, h // 2], atol=1e-14, rtol=1e-13)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_rotates_each_channel_pair_by_its_angle(interleaved):
    # pairs (k, k + n/2), or (2k, 2k + 1) interleaved, rotated by +theta_k: (a, b) -> (a·cos - b·sin,
    # b·cos + a·sin); the channels beyond rot_dim pass unchanged
    s, n, d = 3, 4, 6
    t, theta = torch.randn(s, 1, 2, d, dtype=F64), torch.randn(s, n // 2, dtype=F64)
    ang = theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1)
    out = U.apply_rotary_pos_emb_bshd(t, ang[:, None, None, :], rotary_interleaved=interleaved)
    want = t.clone()
    for i in range(n // 2):
        ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + n // 2)
        c, sn = theta[:, i, None, None].cos(), theta[:, i, None, None].sin()
        want[..., ia] = t[..., ia] * c - t[..., ib] * sn
        want[..., ib] = t[..., ib] * c + t[..., ia] * sn
    torch.testing.assert_close(out, want, atol=1e-15, rtol=1e-14)


def test_bias_dropout_add_references_scale_the_kept_values_and_are_the_identity_in_eval():
    x, b, r = torch.randn(4, 8, dtype=F64), torch.randn(8, dtype=F64), torch.randn(4, 8, dtype=F64)
    keep = torch.rand(4, 8) >= 0.25
    want = r + torch.where(keep, (x + b) / 0.75, 0.0)
    torch.testing.assert_close(U.bias_dropout_add_masked(x, b, r, keep, 0.25), want, atol=1e-15, rtol=1e-15)
    assert torch.equal(U.bias_dropout_add((x.clone(), b), r, 0.5, training=False), r + (x + b))


def test_zero_centered_gamma_norms_scale_by_weight_plus_one():
    x, w, b = torch.randn(4, 16, dtype=F64), 0.1 * torch.randn(16, dtype=F64), torch.randn(16, dtype=F64)
    torch.testing.assert_close(U.layer_norm(x, w, b, zero_centered_gamma=True), _ln64(x, w + 1, b),
                               atol=1e-14, rtol=1e-13)
    torch.testing.assert_close(U.rms_norm(x, w, zero_centered_gamma=True), _rms64(x, w + 1), atol=1e-14, rtol=1e-13)


def test_clamped_swiglu_clamps_the_gate_from_above_only_and_passes_the_boundary_gradient():
    # silu(min(y1, c))·clamp(y2, -c, c); torch.clamp's gradient is 1 at the bound itself
    c = 2.0
    y = torch.tensor([[c, -3.5, c, -c], [c + 0.25, 0.3, 1.0, c + 0.5]], dtype=F64)  # [y1 | y2], h = 2
    g = torch.tensor([[1.5, -0.7], [0.4, 2.0]], dtype=F64)
    y1, y2 = y[:, :2], y[:, 2:]
    x1, x2 = y1.clamp(max=c), y2.clamp(-c, c)
    s = torch.sigmoid(x1)
    torch.testing.assert_close(U.clamped_swiglu(y, c), x1 * s * x2, atol=1e-15, rtol=1e-15)
    dy1 = torch.where(y1 <= c, g * x2 * s * (1 + x1 * (1 - s)), 0.0)
    dy2 = torch.where((y2 >= -c) & (y2 <= c), g * x1 * s, 0.0)
    assert dy1[0, 0] != 0 and dy2[0, 0] != 0 and dy2[0, 1] != 0  # the boundary cases
    torch.testing.assert_close(U.clamped_swiglu_back(g, y, c), torch.cat((dy1, dy2), -1), atol=1e-15, rtol=1e-14)


def test_scale_mask_softmax_gives_zeros_for_a_fully_masked_row():
    x = torch.randn(1, 1, 3, 4, dtype=F64)
    mask = torch.tensor([[False, True, False, True], [True] * 4, [False] * 4])
    p = U.scale_mask_softmax(x, mask, scale=0.5)
    e = torch.exp(0.5 * x[0, 0]) * ~mask
    want = torch.where(mask.all(-1, keepdim=True), 0.0, e / e.sum(-1, keepdim=True).clamp_min(1e-300))
    torch.testing.assert_close(p[0, 0], want, atol=1e-15, rtol=1e-14)
