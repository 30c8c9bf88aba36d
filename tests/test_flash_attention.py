"""FlashAttention-2 (fusedlib.fusions.fused_attention.flash_attention) against float64 references.

The oracle is ``unfused.attention_reference`` in float64 on the *same* inputs (rounded to the
dtype under test first): scores materialised with torch ops, masks built with triu/tril
(independently of the kernels' band arithmetic), autograd for dq, dk, dv and d sinks. Dropout
is compared exactly: the op's Philox key is replayed (``torch.manual_seed(SEED)`` before the op
and before ``philox_seed``) and ``flash_attn_dropout_mask`` gives the keep mask the kernels drew;
the statistics test reads the dropped probabilities from the op's own output instead.

Tolerances, elementwise, derived from where the kernels round (module docstring of
fusedlib.kernels.flash_attention). Every output is a sum of products accumulated in float32:

* o = sum_j P_ij·v_j: P is rounded to the dtype before the product (relative u), o once
  when stored (u·|o| <= u·sum_j P_ij·|v_j|): |error| <= 2u·(|P|·|v|)_ij;
* dv = Pᵀ·dO: the same, 2u·(|P|ᵀ·|dO|);
* dq = scale·dS·k and dk = scale·dSᵀ·q, dS = P∘(dP - D): dS rounded (u·|dS|), D = rowsum(dO∘O)
  from the stored o (error <= u·sum_d |dO∘O|, times P_ij in dS), the result rounded:
  2u·scale·(|dS| + u_D)·|k| with u_D = u·P∘rowsum(|dO∘O|);
* d sinks = -sum_i P_sink,i·D_i: u·sum_i P_sink,i·rowsum(|dO∘O|) plus the float32 sum.
* float16's subnormals (below 2^-14) round with an absolute error, at most eta = 2^-25 (half
  their spacing): every nonzero entry of the rounded P (dropped and rescaled) or dS that a
  result adds up, times the other operand's magnitude, and the result's own rounding:
  4·eta·(1 + (|P̃| != 0)·|v|) for o, and likewise for dv, dq and dk (negligible in bfloat16
  and float32, whose subnormals lie below 1e-38).

u is the unit roundoff of the dtype (2^-11 float16, 2^-8 bfloat16). float32 (u = 2^-24) adds
the float32 arithmetic itself: each value passes through at most d + sk + 8 roundings
(the score's sum over d, the output's over sk, exp2 and the rescalings), each <= 2^-24
relative to the same magnitudes, so u_32 = (d + sk + 8)·2^-24. The test asserts |got - ref|
<= 4·(u + u_32)·R: a 2x margin on the sum of the two rounding bounds, with R the magnitudes
above computed in float64 from the reference's own P and dS.

Sizes are tiny (Triton's interpreter runs the kernels on the CPU); tiles are lowered to 16 and
32 (``INTERPRETER_TILE``) so that every case crosses several tiles, partial ones and the band's
edges. GPU-only cases (``needs_cuda``) run realistic head dims and lengths.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fusedlib.kernels.flash_attention as kfa
import fusedlib.runtime as rt
from fusedlib import unfused
from fusedlib.fusions.fused_attention import flash_attention
from fusedlib.kernels.bias_dropout_add import KEEP_BITS, drop_threshold, philox_seed
from fusedlib.kernels.flash_attention import Tile, attention_band, flash_attn_dropout_mask, flash_attn_fwd

from conftest import DEVICE  # noqa: I001

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
SEED = 4321  # replayed seed of the op under test (inputs are drawn before it, fresh per test)
U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 0.0}


@pytest.fixture
def tiles(monkeypatch):
    """Set every kernel's tile in the interpreter (on a GPU the tables' tiles run)."""
    def set_tile(block_m: int, block_n: int) -> None:
        monkeypatch.setattr(kfa, "INTERPRETER_TILE", Tile(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4))
        rt.clear_plans()  # plans keep the tile they were made with
    return set_tile


def _p_used(p: float) -> float:
    """The probability the kernels apply: 16-bit resolution (chapter 2)."""
    return drop_threshold(p) / 2**KEEP_BITS


def _inputs(b, sq, sk, hq, hkv, d, dtype, scale=1.0):
    mk = lambda *s: (scale * torch.randn(*s, device=DEVICE)).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)


def _reference_parts(q64, k64, v64, o64, do64, kw, keep, p_used):
    """Float64 P (dropped, as the output uses it), dS and the magnitudes R of the tolerance."""
    b, sq, hq, d = q64.shape
    sk, hkv = k64.shape[1], k64.shape[2]
    scale = kw.get("softmax_scale") or 1.0 / math.sqrt(d)
    group = hq // hkv
    k_r, v_r = k64.repeat_interleave(group, 2), v64.repeat_interleave(group, 2)
    masked = unfused.attention_mask_bshd(sq, sk, causal=kw.get("causal", False), attention_mask=kw.get("attention_mask"),
                                         window_size=kw.get("window_size"), device=q64.device)
    sinks = kw.get("sinks")
    x = torch.einsum("bqhd,bkhd->bhqk", q64, k_r)
    p = unfused.masked_softmax_reference(x, masked, scale, None if sinks is None else sinks.double())
    z = torch.ones_like(p) if keep is None else keep.double() / (1 - p_used)  # dropout factor
    dp = torch.einsum("bqhd,bkhd->bhqk", do64, v_r) * z
    delta = (do64 * o64).sum(-1).transpose(1, 2)[..., None]  # [b, hq, sq, 1]
    ds = p * (dp - delta)
    od = (do64 * o64).abs().sum(-1).transpose(1, 2)[..., None]  # rowsum |dO∘O|
    pz = (p * z).abs()
    r_o = torch.einsum("bhqk,bkhd->bqhd", pz, v_r.abs())
    r_dv = torch.einsum("bhqk,bqhd->bkhd", pz, do64.abs()).unflatten(2, (hkv, group)).sum(3)
    ds_mag = ds.abs() + p * od  # |dS| plus the D term (times u below, with the same u)
    r_dq = scale * torch.einsum("bhqk,bkhd->bqhd", ds_mag, k_r.abs())
    r_dk = (scale * torch.einsum("bhqk,bqhd->bkhd", ds_mag, q64.abs())).unflatten(2, (hkv, group)).sum(3)
    # absolute terms (float16's subnormals): the number of rounded P̃ or dS entries each result
    # adds up, weighted by the other operand's magnitude (entries that are exactly 0 round exactly)
    seen = (p != 0).double() * z.abs()
    a_o = torch.einsum("bhqk,bkhd->bqhd", seen, v_r.abs())
    a_dv = torch.einsum("bhqk,bqhd->bkhd", seen, do64.abs()).unflatten(2, (hkv, group)).sum(3)
    seen_ds = (p != 0).double()
    a_dq = scale * torch.einsum("bhqk,bkhd->bqhd", seen_ds, k_r.abs())
    a_dk = (scale * torch.einsum("bhqk,bqhd->bkhd", seen_ds, q64.abs())).unflatten(2, (hkv, group)).sum(3)
    r_ds = None
    if sinks is not None:
        lse = torch.logsumexp(torch.cat([(x * scale).masked_fill(masked, float("-inf")) if masked is not None
                                         else x * scale, sinks.double().view(1, -1, 1, 1).expand(b, hq, sq, 1)], -1),
                              -1, keepdim=True)
        p_sink = torch.exp(sinks.double().view(1, -1, 1, 1) - lse)
        r_ds = (p_sink * (od + delta.abs())).sum(dim=(0, 2, 3))
    return {"o": r_o, "dq": r_dq, "dk": r_dk, "dv": r_dv, "dsinks": r_ds,
            "abs": {"o": a_o, "dq": a_dq, "dk": a_dk, "dv": a_dv}}


def _eta(dtype: torch.dtype) -> float:
    """The absolute rounding error of a subnormal of ``dtype``: half their spacing,
    smallest_normal·eps/2 (2^-25 for float16; below 1e-39 for bfloat16 and float32)."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


def _assert_within(name, got, want, r, dtype, n_terms, extra_u=0.0, a=None):
    u = U[dtype] + n_terms * 2.0 ** -24 + extra_u
    tol = 4 * u * r + 1e-12
    if a is not None:  # the subnormals' absolute errors: each rounded operand entry and the result
        tol = tol + 4 * _eta(dtype) * (a + 1)
    err = (got.double() - want).abs()
    assert not torch.isnan(got).any(), f"{name}: NaN"
    bad = err > tol
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements out of tolerance, worst err {err.max().item():.3e}, "
                           f"tol there {tol.flatten()[err.argmax()].item():.3e}")


def _check(dtype, b, sq, sk, hq, hkv, d, dropout_p=0.0, grad_layout=None, inputs=None, extra_u=0.0, **kw):
    """flash_attention forward and backward against the float64 reference; returns (o, grads).
    ``extra_u``: a relative error to add to every bound (a test's own derived term)."""
    q, k, v = inputs if inputs is not None else _inputs(b, sq, sk, hq, hkv, d, dtype)
    sinks = kw.get("sinks")
    before = [t.detach().clone() for t in (q, k, v)]
    torch.manual_seed(SEED)
    o = flash_attention(q, k, v, dropout_p=dropout_p, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    keep = None
    p_used = _p_used(dropout_p)
    if dropout_p > 0:
        torch.manual_seed(SEED)
        keep = flash_attn_dropout_mask(philox_seed(DEVICE), (b, hq, sq, sk), dropout_p)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    kw64 = dict(kw)
    if sinks is not None:
        kw64["sinks"] = sinks.detach().double().requires_grad_(True)
    o64 = unfused.attention_reference(q64, k64, v64, dropout_p=p_used, dropout_mask=keep, **kw64)
    g = torch.randn(o.shape, device=DEVICE).to(dtype)
    if grad_layout == "transposed":  # a non-contiguous gradient: [sq, b, hq, d] memory, seen as bshd
        g = g.transpose(0, 1).contiguous().transpose(0, 1)
    g_before = g.clone()
    o.backward(g)
    o64.backward(g.double())
    assert torch.equal(g, g_before), "grad_output was modified"
    assert all(torch.equal(t.detach(), t0) for t, t0 in zip((q, k, v), before)), "an input was modified"
    r = _reference_parts(q64.detach(), k64.detach(), v64.detach(), o.detach().double(), g.double(), kw, keep, p_used)
    n = d + sk + 8
    _assert_within("o", o, o64.detach(), r["o"], dtype, n, extra_u, r["abs"]["o"])
    for name, t, t64 in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        _assert_within(name, t.grad, t64.grad, r[name], dtype, n, extra_u, r["abs"][name])
    if sinks is not None and sinks.requires_grad:
        _assert_within("dsinks", sinks.grad, kw64["sinks"].grad, r["dsinks"], dtype, n + b * sq, extra_u)
    return o.detach(), [t.grad for t in (q, k, v)]


# (b, sq, sk, hq, hkv, d) and the masks; tiles (BLOCK_M, BLOCK_N) in the interpreter
CASES = {
    "causal-square-gqa-d40": dict(shape=(2, 37, 37, 4, 2, 40), causal=True, tile=(16, 32)),
    "causal-sq<sk-mqa-d64": dict(shape=(1, 20, 45, 2, 1, 64), causal=True, tile=(16, 16)),
    "causal-sq>sk-empty-rows": dict(shape=(2, 33, 17, 2, 2, 16), causal=True, tile=(16, 16)),
    "decode-sq1": dict(shape=(2, 1, 50, 4, 1, 64), causal=True, tile=(16, 16)),
    "key-padding-all-masked-sample": dict(shape=(2, 29, 41, 2, 2, 32), padding="keys", tile=(32, 16)),
    "window-noncausal": dict(shape=(1, 40, 40, 2, 1, 24), window_size=(5, 3), tile=(16, 16)),
    "window-and-causal-sq<sk": dict(shape=(1, 30, 50, 2, 2, 16), causal=True, window_size=(7, -1), tile=(16, 16)),
    "4d-mask-empty-row": dict(shape=(2, 21, 35, 2, 1, 32), padding="4d", tile=(16, 16)),
    "sinks-gqa-causal": dict(shape=(1, 27, 27, 4, 1, 40), causal=True, sinks=True, tile=(16, 16)),
    "sinks-key-padding-empty": dict(shape=(2, 9, 20, 2, 2, 16), padding="keys", sinks=True, tile=(64, 64)),
    "scale-no-mask-one-tile": dict(shape=(1, 13, 11, 2, 2, 64), softmax_scale=0.3, tile=(64, 64)),
}


def _masks(case, b, sq, sk, hq):
    kw = {k: case[k] for k in ("causal", "window_size", "softmax_scale") if k in case}
    if case.get("padding") == "keys":
        m = torch.rand(b, sk, device=DEVICE) < 0.3
        m[-1] = True  # the last sample: every key masked, every row empty
        kw["attention_mask"] = m
    elif case.get("padding") == "4d":
        m = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3
        m[0, 0, 3] = True  # one query row with every key masked
        kw["attention_mask"] = m
    if case.get("sinks"):
        kw["sinks"] = torch.randn(hq, device=DEVICE, requires_grad=True)
    return kw


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_against_float64(name, tiles):
    case = CASES[name]
    b, sq, sk, hq, hkv, d = case["shape"]
    tiles(*case["tile"])
    kw = _masks(case, b, sq, sk, hq)
    o, grads = _check(torch.float32, b, sq, sk, hq, hkv, d, **kw)
    if case.get("padding") == "keys":  # the sample with every key masked: zeros, zero gradients
        if not case.get("sinks"):
            assert torch.all(o[-1] == 0) and all(torch.all(g[-1] == 0) for g in grads)
        else:
            assert torch.all(o[-1] == 0)
    if name == "causal-sq>sk-empty-rows":  # rows i < sq - sk see no key
        assert torch.all(o[:, : sq - sk] == 0) and torch.all(grads[0][:, : sq - sk] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal-square-gqa-d40", "sinks-key-padding-empty", "window-and-causal-sq<sk"])
def test_half_precision_forward_backward(name, dtype, tiles):
    case = CASES[name]
    b, sq, sk, hq, hkv, d = case["shape"]
    tiles(*case["tile"])
    _check(dtype, b, sq, sk, hq, hkv, d, **_masks(case, b, sq, sk, hq))


@pytest.mark.parametrize("case", ["large-scale", "large-scale-dropout", "sink-dominates"])
def test_float16_subnormal_probabilities_against_float64(case, tiles):
    # float16 rounds P and dS below 2^-14 to subnormals, with an absolute error: a large softmax
    # scale (scores spread over tens of units) or a sink that takes nearly all of each row's
    # probability leaves most entries of P there; the bound's absolute term (_eta) covers them
    tiles(16, 16)
    kw = dict(causal=True, softmax_scale=3.0, dropout_p=0.1 if case.endswith("dropout") else 0.0)
    if case == "sink-dominates":
        kw = dict(causal=True, sinks=(10.0 + torch.randn(2, device=DEVICE)).requires_grad_(True))
    _check(torch.float16, 1, 24, 24, 2, 2, 16, **kw)


@pytest.mark.parametrize("sq, sk", [(0, 5), (4, 0), (0, 0)])
def test_empty_inputs_draw_no_random_numbers(sq, sk):
    # no queries or no keys: nothing to drop, so, as torch's dropout for an empty input, the
    # generator does not move; the output and gradients keep their shapes (no keys: zeros)
    state = (lambda: torch.cuda.get_rng_state(DEVICE)) if torch.device(DEVICE).type == "cuda" else torch.get_rng_state
    q = torch.randn(2, sq, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, sk, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(2, sk, 2, 16, device=DEVICE, requires_grad=True)
    before = state()
    o = flash_attention(q, k, v, dropout_p=0.2)
    assert torch.equal(state(), before)
    assert o.shape == q.shape and torch.equal(o, torch.zeros_like(o))
    o.backward(torch.randn_like(o))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert not q.grad.isnan().any()
    flash_attention(torch.randn(2, 3, 2, 16, device=DEVICE), torch.randn(2, 3, 2, 16, device=DEVICE),
                    torch.randn(2, 3, 2, 16, device=DEVICE), dropout_p=0.2)
    assert not torch.equal(state(), before)  # queries and keys: the key is drawn


def test_kernel_refuses_a_head_dim_of_zero_and_takes_no_rows():
    # the kernel layer: rows without a head dim would leave lse unwritten (the op refuses d = 0
    # too); no rows (b = 0 or sq = 0) give an empty output and an empty lse
    z = torch.randn(1, 2, 3, 0, device=DEVICE)
    with pytest.raises(ValueError, match=r"head dim \(q's last dim\) must be >= 1, got 0"):
        flash_attn_fwd(z, z, z, 1.0, attention_band(2, 2, False, None))
    for b, sq in ((0, 2), (1, 0)):
        q, kv = torch.randn(b, sq, 3, 16, device=DEVICE), torch.randn(b, 2, 3, 16, device=DEVICE)
        o, lse = flash_attn_fwd(q, kv, kv, 0.25, attention_band(sq, 2, False, None))
        assert o.shape == q.shape and lse.shape == (b, 3, sq)


def test_lse_is_the_rows_logsumexp_and_minus_inf_for_empty_rows(tiles):
    tiles(16, 16)
    b, sq, sk, hq, hkv, d = 2, 20, 12, 2, 1, 16
    q, k, v = (t.detach() for t in _inputs(b, sq, sk, hq, hkv, d, torch.float32))
    scale = 0.25
    band = attention_band(sq, sk, True, None)
    _, lse = flash_attn_fwd(q, k, v, scale, band)
    x = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(hq // hkv, 2)) * scale
    want = torch.logsumexp(x.masked_fill(unfused.causal_mask(sq, sk, device=DEVICE), float("-inf")), -1)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq) and lse.is_contiguous()
    assert torch.all(lse[:, :, : sq - sk] == float("-inf"))  # rows that see nothing
    torch.testing.assert_close(lse[:, :, sq - sk:].double(), want[:, :, sq - sk:], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("empty_by", ["causal sq>sk", "key padding"])
def test_minus_inf_sink_on_rows_that_see_no_key(tiles, empty_by):
    # -inf is no sink: a row that sees no key then has LSE -inf as well, and its P_sink =
    # e^(sink - LSE) was e^(-inf + inf) = NaN, which made d sinks NaN although every row's
    # share of it is 0 (P_sink = 0 on every row); the outputs and dq, dk, dv were clean
    tiles(16, 16)
    torch.manual_seed(4242)
    b, sq, sk, hq, hkv, d = 2, 20, 12, 2, 1, 16
    q, k, v = (t.requires_grad_(True) for t in _inputs(b, sq, sk, hq, hkv, d, torch.float32))
    sinks = torch.tensor([float("-inf"), 0.5], device=DEVICE, requires_grad=True)
    kw = dict(causal=True) if empty_by == "causal sq>sk" else dict(attention_mask=torch.tensor(
        [[True] * sk, [False] * (sk - 3) + [True] * 3], device=DEVICE))  # batch 0: every key masked
    out = flash_attention(q, k, v, sinks=sinks, **kw)
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert sinks.grad[0].item() == 0.0  # no sink: no probability, no gradient
    # the finite sink's gradient against float64: -sum over (b, rows) of P_sink·rowsum(dO∘O)
    ref = sinks.detach().double().requires_grad_(True)
    x = torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), k.detach().double().repeat_interleave(hq // hkv, 2))
    x = x / math.sqrt(d)
    masked = (unfused.causal_mask(sq, sk, device=DEVICE) if empty_by == "causal sq>sk"
              else kw["attention_mask"][:, None, None, :])
    x = x.masked_fill(masked, float("-inf"))
    s_col = ref.view(1, hq, 1, 1).expand(b, hq, sq, 1)
    p = torch.softmax(torch.cat([x, s_col], -1), -1)[..., :sk]
    o = torch.einsum("bhqk,bkhd->bqhd", p, v.detach().double().repeat_interleave(hq // hkv, 2))
    (o * g.double()).sum().backward()
    torch.testing.assert_close(sinks.grad[1].double(), ref.grad[1], atol=1e-5, rtol=1e-5)


def test_learnable_sinks_get_their_gradient_when_q_k_v_need_none(tiles):
    # sink logits trained on a frozen model (q, k and v need no gradient): d sinks all the same
    tiles(16, 16)
    b, sq, sk, hq, hkv, d = 2, 19, 23, 4, 2, 16
    q, k, v = (t.detach() for t in _inputs(b, sq, sk, hq, hkv, d, torch.float32))
    sinks = torch.randn(hq, device=DEVICE, requires_grad=True)
    o = flash_attention(q, k, v, causal=True, sinks=sinks)
    g = torch.randn(o.shape, device=DEVICE)
    o.backward(g)
    sinks64 = sinks.detach().double().requires_grad_(True)
    o64 = unfused.attention_reference(q.double(), k.double(), v.double(), causal=True, sinks=sinks64)
    o64.backward(g.double())
    assert sinks.grad is not None and sinks.grad.dtype == sinks.dtype
    r = _reference_parts(q.double(), k.double(), v.double(), o.double(), g.double(), dict(causal=True, sinks=sinks),
                         None, 0.0)
    _assert_within("dsinks", sinks.grad, sinks64.grad, r["dsinks"], torch.float32, d + sk + 8 + b * sq)


def test_non_contiguous_inputs_megatron_layout(tiles):
    # q, k, v as Megatron's [s, b, heads, d] tensors seen through transpose(0, 1); k with a
    # strided last dim (copied once by the op); the gradient non-contiguous too
    tiles(16, 16)
    b, sq, sk, hq, hkv, d = 2, 19, 23, 4, 2, 24
    q = torch.randn(sq, b, hq, d, device=DEVICE).transpose(0, 1).requires_grad_(True)
    k = torch.randn(b, sk, hkv, 2 * d, device=DEVICE)[..., ::2].requires_grad_(True)
    v = torch.randn(sk, b, hkv, d, device=DEVICE).transpose(0, 1).requires_grad_(True)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    o, grads = _check(torch.float32, b, sq, sk, hq, hkv, d, inputs=(q, k, v), grad_layout="transposed", causal=True)
    assert o.transpose(0, 1).is_contiguous()  # o follows q's memory order: [s, b, h, d] for Megatron
    assert grads[0].transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("strided", ["q", "k", "v"])
def test_a_strided_head_dim_is_read_by_its_strides(strided, tiles):
    # q, k or v whose last dim is strided (every other element of a wider buffer): read as
    # the values it holds, not as a contiguous row
    tiles(16, 16)
    b, sq, sk, hq, hkv, d = 1, 9, 13, 2, 1, 8
    q, k, v = (t.detach() for t in _inputs(b, sq, sk, hq, hkv, d, torch.float32))
    wide = {"q": q, "k": k, "v": v}[strided]
    buf = torch.zeros(*wide.shape[:-1], 2 * d, device=DEVICE)
    buf[..., ::2] = wide
    inputs = [buf[..., ::2] if t is wide else t for t in (q, k, v)]
    assert inputs["qkv".index(strided)].stride(-1) == 2
    _check(torch.float32, b, sq, sk, hq, hkv, d, inputs=[t.requires_grad_(True) for t in inputs], causal=True)


def test_dropout_against_float64_with_the_replayed_mask(tiles):
    tiles(16, 16)
    b, sq, sk, hq, hkv, d = 2, 21, 26, 4, 2, 16
    mask = torch.rand(b, sk, device=DEVICE) < 0.2
    sinks = torch.randn(hq, device=DEVICE, requires_grad=True)
    _check(torch.float32, b, sq, sk, hq, hkv, d, dropout_p=0.3, causal=True, attention_mask=mask, sinks=sinks)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32)])
def test_dropout_with_tiles_of_unequal_sides(block_m, block_n, deterministic, tiles):
    # every other dropout test runs square tiles, where a key tile's index taken as
    # start_n // BLOCK_M instead of start_n // BLOCK_N gives the same mask; the GPU's dropout
    # forward runs [64, 32] (FWD_DROPOUT_TILES). The mask must be the replayed one whatever the
    # tiles: in the forward, the deterministic dQ kernel and the atomic backward (d = 16 with
    # dropout takes the atomic dQ when not deterministic)
    tiles(block_m, block_n)
    _check(torch.float32, 1, 37, 45, 2, 1, 16, dropout_p=0.3, causal=True, deterministic=deterministic)


@pytest.mark.parametrize("shape", [(1, 2, 37, 45), (2, 1, 19, 70), (1, 1, 1, 1)])
def test_dropout_mask_is_philox_as_documented(shape):
    # query i, key j of the head whose rows start at r0 = (b·hq + h)·sq: Philox call
    # (j & ~8, r0 + (i & ~9), 0, 0) of the seed, word 2·bit3(i) + bit3(j), its low half for even
    # i and high half for odd i, kept iff >= round(p·2^16); against a pure-Python Philox
    from test_bias_dropout_add import _philox_4x32_10

    b, hq, sq, sk = shape
    p = 0.37
    seed = philox_seed(DEVICE)
    mask = flash_attn_dropout_mask(seed, shape, p).cpu()
    s, t = int(seed.item()), drop_threshold(p)
    calls: dict = {}
    expected = torch.zeros(shape, dtype=torch.bool)
    for bh in range(b * hq):
        for i in range(sq):
            for j in range(sk):
                counter = (j & ~8, bh * sq + (i & ~9))
                if counter not in calls:
                    calls[counter] = _philox_4x32_10(*counter, 0, 0, s & 0xFFFFFFFF, s >> 32)
                word = calls[counter][2 * ((i >> 3) & 1) + ((j >> 3) & 1)]
                expected[bh // hq, bh % hq, i, j] = ((word >> 16) if i % 2 else (word & 0xFFFF)) >= t
    assert torch.equal(mask, expected)
    if expected.numel() > 100:  # p' = 0.37: neither all kept nor all dropped
        assert 0.5 < expected.float().mean() < 0.75


@pytest.mark.parametrize("shape, match", [((1, 2, 3), "shape"), ((1, 2, -3, 4), "shape"), ((1, 2, 3.0, 4), "shape"),
                                          (4, "shape"), ((True, 1, 2, 2), "shape"), (None, "shape")])
def test_dropout_mask_bad_input(shape, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_dropout_mask(philox_seed(DEVICE), shape, 0.1)
    for seed in (torch.zeros(2, dtype=torch.int64, device=DEVICE), None, 7):
        with pytest.raises(ValueError, match="seed must be an int64 tensor"):
            flash_attn_dropout_mask(seed, (1, 1, 2, 2), 0.1)
    for p in (1.5, -0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="p must be"):
            flash_attn_dropout_mask(philox_seed(DEVICE), (1, 1, 2, 2), p)


@pytest.mark.parametrize("head_dim", [0, -1, 257, 1000, 64.0, True])
def test_attention_tile_refuses_a_head_dim_off_its_table(head_dim):
    # on the CPU it returned the interpreter's tile for any head dim
    with pytest.raises(ValueError, match="head_dim must be an int in \\[1, 256\\]"):
        kfa.attention_tile(kfa.FWD_TILES, head_dim)


def test_dropout_statistics_from_the_output(tiles):
    # v = one-hot rows (d >= sk): o[b, i, h, :sk] is the dropped probability row itself. Where a
    # probability is dropped o is exactly 0, where kept it is P/(1 - p'); the dropped fraction
    # of the n visible probabilities is p' within 5 standard deviations.
    tiles(32, 32)
    b, sq, sk, hq, d, p = 2, 40, 30, 2, 32, 0.25
    q = torch.randn(b, sq, hq, d, device=DEVICE)
    k = torch.randn(b, sk, 1, d, device=DEVICE)
    v = torch.eye(sk, d, device=DEVICE).expand(b, sk, d).unsqueeze(2).contiguous()  # [b, sk, 1, d]
    o = flash_attention(q, k, v, causal=True, dropout_p=p)
    probs = o[..., :sk].transpose(1, 2)  # [b, hq, sq, sk]
    ref = unfused.attention_reference(q.double(), k.double(), v.double(), causal=True)[..., :sk].transpose(1, 2)
    visible = ~unfused.causal_mask(sq, sk, device=DEVICE).expand_as(probs)
    dropped = (probs == 0) & visible
    kept = (probs != 0) & visible
    p_used = _p_used(p)
    torch.testing.assert_close(probs[kept].double(), ref[kept] / (1 - p_used), atol=1e-6, rtol=1e-5)
    n = int(visible.sum())
    assert abs(int(dropped.sum()) / n - p_used) <= 5 * math.sqrt(p_used * (1 - p_used) / n)
    # the same seed, the same mask; the next call another one
    torch.manual_seed(7)
    a = flash_attention(q, k, v, causal=True, dropout_p=p)
    torch.manual_seed(7)
    assert torch.equal(a, flash_attention(q, k, v, causal=True, dropout_p=p))
    assert not torch.equal(a, flash_attention(q, k, v, causal=True, dropout_p=p))


@pytest.mark.parametrize("deterministic", [True, False])
def test_float16_dv_stays_finite_at_the_largest_dropout(deterministic, tiles):
    # p' = 1 - 2^-16, the largest the op takes: kept probabilities are scaled by 2^16, so a
    # kept P near 1 gives P·2^16 > 65504, past float16's range, if the scale is applied before
    # P is rounded for the dV product; dV itself (2^16·P·1e-3 = 65.5) fits. The seed is the
    # first from SEED whose mask keeps an element; the query of that row is set to its key
    # (scores 50 against at most 50·cos of the other keys), so P there is near 1.
    tiles(32, 32)
    p = 1 - 2**-16
    b, s, h, d = 1, 64, 4, 16
    gen = torch.Generator(device="cpu").manual_seed(11)
    k = torch.nn.functional.normalize(torch.randn(b, s, h, d, generator=gen), dim=-1).to(DEVICE)
    q = torch.randn(b, s, h, d, generator=gen).to(DEVICE)
    v = torch.full((b, s, h, d), 1e-3, device=DEVICE)
    do = torch.full_like(v, 1e-3)
    for seed in range(SEED, SEED + 200):
        torch.manual_seed(seed)
        keep = flash_attn_dropout_mask(philox_seed(DEVICE), (b, h, s, s), p)
        if keep.any():
            break
    bi, hi, i, j = (int(x) for x in keep.nonzero()[0])
    q[bi, i, hi] = k[bi, j, hi]
    scale, p_used = 50.0, _p_used(p)
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale, -1)
    assert probs[bi, hi, i, j] > 0.999  # the case the test is about: P·2^16 > 65504
    pd = probs * keep / (1 - p_used)
    dv_ref = torch.einsum("bhqk,bqhd->bkhd", pd, do.double())
    qq, kk, vv = (t.half().requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(seed)
    o = flash_attention(qq, kk, vv, softmax_scale=scale, dropout_p=p, deterministic=deterministic)
    o.backward(do.half())
    assert all(torch.isfinite(g).all() for g in (qq.grad, kk.grad, vv.grad))
    # float16 rounding of P (2^-11 relative) and of dv (2^-11): a derived bound of 2^-9
    torch.testing.assert_close(vv.grad.double(), dv_ref, rtol=2**-9, atol=2**-9 * dv_ref.abs().max().item())


def test_kernel_launchers_check_seed_and_dropout_p():
    """The kernels' launchers check what they draw with: a seed's dtype, size and device and,
    with a seed, dropout_p in [0, 1) with p' < 1 (without a seed nothing is drawn, whatever p)."""
    q, k, v = (t.detach() for t in _inputs(1, 5, 7, 2, 2, 16, torch.float32))
    band = attention_band(5, 7, False, None)
    seed = philox_seed(DEVICE)
    for bad in (-0.1, 1.0, 1.5, float("nan"), float("inf"), 1 - 2**-18, True, "0.1"):
        with pytest.raises(ValueError, match="dropout_p"):
            flash_attn_fwd(q, k, v, 0.25, band, seed=seed, dropout_p=bad)
    for bad_seed in (seed.float(), seed.expand(2), 3):
        with pytest.raises(ValueError, match="seed must be an int64 tensor of one element"):
            flash_attn_fwd(q, k, v, 0.25, band, seed=bad_seed, dropout_p=0.1)
    o, lse = flash_attn_fwd(q, k, v, 0.25, band, seed=seed, dropout_p=0.1)
    do = torch.randn_like(o)
    with pytest.raises(ValueError, match="dropout_p"):
        kfa.flash_attn_bwd(do, q, k, v, o, lse, 0.25, band, seed=seed, dropout_p=-0.5)
    assert torch.equal(flash_attn_fwd(q, k, v, 0.25, band, dropout_p=0.5)[0], flash_attn_fwd(q, k, v, 0.25, band)[0])
    # a value equal to an accepted one (False == 0.0) is still checked when a plan
    # exists for the accepted one: the plans are keyed by dropout_p's type too
    flash_attn_fwd(q, k, v, 0.25, band, seed=seed, dropout_p=0.0)
    kfa.flash_attn_bwd(do, q, k, v, o, lse, 0.25, band, seed=seed, dropout_p=0.0)
    for bad in (False, np.False_):
        with pytest.raises(ValueError, match="dropout_p"):
            flash_attn_fwd(q, k, v, 0.25, band, seed=seed, dropout_p=bad)
        with pytest.raises(ValueError, match="dropout_p"):
            kfa.flash_attn_bwd(do, q, k, v, o, lse, 0.25, band, seed=seed, dropout_p=bad)


def test_dropout_p0_draws_no_random_numbers():
    q, k, v = (t.detach() for t in _inputs(1, 5, 7, 2, 2, 16, torch.float32))
    state = torch.get_rng_state()
    flash_attention(q, k, v, dropout_p=0.0)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_is_bitwise_reproducible(deterministic, tiles):
    # deterministic: every gradient bitwise. Otherwise (here the atomic dQ: dropout is on) dk,
    # dv and d sinks still are; dq's float32 atomic sum may be ordered differently on a GPU
    # (the interpreter runs programs in order), so it is checked against float64 elsewhere
    tiles(32, 16)
    q, k, v = _inputs(2, 30, 30, 4, 1, 16, torch.bfloat16)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    g = torch.randn(q.shape, device=DEVICE).to(q.dtype)
    runs = []
    for _ in range(2):
        for t in (q, k, v, sinks):
            t.grad = None
        torch.manual_seed(SEED)
        flash_attention(q, k, v, causal=True, sinks=sinks, dropout_p=0.1, deterministic=deterministic).backward(g)
        runs.append([t.grad.clone() for t in (q, k, v, sinks)])
    first = 0 if deterministic else 1
    assert all(torch.equal(a, b) for a, b in list(zip(*runs))[first:])


def _launched_kernels(monkeypatch):
    """Names of the kernels the FlashAttention launchers start, in order."""
    names = []
    real = rt.launch

    def spy(kernel, *args, **kwargs):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", spy)  # a new plan's first launch comes here
    return names


ATOMIC_CASES = {  # the atomic dQ's reach: head dims 65-128, or dropout at any head dim up to 64
    "d80-gqa-causal-sq<sk-sinks": dict(shape=(2, 19, 33, 4, 2, 80), causal=True, sinks=True),
    "d16-dropout-key-padding": dict(shape=(2, 21, 26, 4, 2, 16), dropout_p=0.3, padding="keys"),
    "d128-window-4d-mask": dict(shape=(1, 23, 23, 2, 1, 128), window_size=(6, 2), padding="4d"),
    # a head dim above 64 with dropout, as the block runs it (d = 128, dropout 0.1): its atomic kernel
    "d96-dropout-gqa-causal-sq<sk": dict(shape=(2, 19, 30, 4, 2, 96), dropout_p=0.2, causal=True),
}


def test_delta_in_dq_kernel_takes_the_preprocess_with_dropout_at_small_head_dims(monkeypatch, request):
    # the rule (padded head dims): Delta in the dQ kernel up to DELTA_IN_DQ_MAX_HEAD_DIM, with
    # dropout only from DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM (at 64 it timed slower with dropout);
    # and flash_attn_bwd follows it: the preprocess kernel with dropout at d = 24, not without
    assert kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM == 128 and kfa.DELTA_IN_DQ_MAX_HEAD_DIM == 256
    for d, dropout, want in ((24, False, True), (24, True, False), (64, True, False), (65, True, True),
                             (128, True, True), (256, True, True), (256, False, True)):
        assert kfa.delta_in_dq_kernel(d, dropout) is want, (d, dropout)
    assert kfa.delta_in_dq_kernel(64) is True  # dropout defaults to off
    monkeypatch.setattr(kfa, "DELTA_IN_DQ_MAX_HEAD_DIM", 32)
    assert not kfa.delta_in_dq_kernel(40) and kfa.delta_in_dq_kernel(32)
    monkeypatch.undo()
    request.addfinalizer(rt.clear_plans)
    torch.manual_seed(12)
    b, s, h, d = 1, 21, 2, 24
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    band = kfa.attention_band(s, s, True, None)
    launched = {}
    for p in (0.0, 0.25):
        seed = philox_seed(DEVICE) if p else None
        o, lse = kfa.flash_attn_fwd(q, k, v, d ** -0.5, band, seed=seed, dropout_p=p)[:2]
        names = _launched_kernels(monkeypatch)
        rt.clear_plans()
        kfa.flash_attn_bwd(torch.randn_like(o), q, k, v, o, lse, d ** -0.5, band, seed=seed, dropout_p=p,
                           deterministic=True)
        launched[p] = [n for n in names if n in BWD_KERNELS]
        monkeypatch.undo()
    assert launched == {0.0: ["_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"],
                        0.25: ["_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"]}


BWD_KERNELS = ("_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel",
               "_flash_bwd_dq_convert_kernel")


@pytest.mark.parametrize("form", ["deterministic, Delta in dQ", "deterministic, preprocess", "atomic"])
@pytest.mark.parametrize("name", list(ATOMIC_CASES))
def test_both_backwards_against_float64_and_their_kernels(name, form, tiles, monkeypatch, request):
    # each backward form against float64, and the kernels it launches: the deterministic one
    # with Delta = rowsum(dO·O) from the dQ kernel (run first), or from the preprocess kernel
    # (sinks, or a head dim above DELTA_IN_DQ_MAX_HEAD_DIM, set to 0 here to force it)
    case = ATOMIC_CASES[name]
    b, sq, sk, hq, hkv, d = case["shape"]
    tiles(16, 16)
    deterministic = form != "atomic"
    monkeypatch.setattr(kfa, "DELTA_IN_DQ_MAX_HEAD_DIM", 256 if form == "deterministic, Delta in dQ" else 0)
    monkeypatch.setattr(kfa, "DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM", 0)  # the dQ kernel's route with dropout too
    request.addfinalizer(rt.clear_plans)  # no plan made under the patched choice outlives the test
    kw = _masks(case, b, sq, sk, hq)
    names = _launched_kernels(monkeypatch)
    _check(torch.float32, b, sq, sk, hq, hkv, d, dropout_p=case.get("dropout_p", 0.0), deterministic=deterministic,
           **kw)
    backward = [n for n in names if n in BWD_KERNELS]
    if form == "atomic":
        assert backward == ["_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_convert_kernel"]
    elif form == "deterministic, Delta in dQ" and not case.get("sinks"):
        assert backward == ["_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"]
    else:
        assert backward == ["_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype, scale", [(torch.float16, None), (torch.float32, 100 / 80)])
def test_partial_key_tile_with_very_negative_scores(dtype, scale, deterministic, tiles):
    # sk = 40 leaves the last key tile partial and nothing masks its padded keys (no causal band,
    # no mask), and every score is very negative: about -20 (float16) or -100 (float32), spread
    # by a few units so that the softmax is not one-hot. A padded key's 2^(0 - LSE) overflows
    # there (float16's dS, float32's exp2): the atomic dQ summed it as inf·0 = NaN into every
    # row, and the deterministic kernels computed it before masking it (an overflow)
    tiles(16, 16)
    torch.manual_seed(0)
    b, sq, sk, h, d = 1, 4, 40, 1, 80
    shift, noise = (1.5, 1.0) if dtype == torch.float16 else (1.0, 0.1)
    q = (noise * torch.randn(b, sq, h, d, device=DEVICE) - shift).to(dtype).requires_grad_()
    k = (noise * torch.randn(b, sk, h, d, device=DEVICE) + shift).to(dtype).requires_grad_()
    v = torch.randn(b, sk, h, d, device=DEVICE).to(dtype).requires_grad_()
    kw = {} if scale is None else {"softmax_scale": scale}
    # the backward recomputes P = 2^(s·log2 e - LSE·log2 e) from float32 operands of magnitude up
    # to max|s| and |LSE| <= max|s| + ln(sk): each rounded (2^-24 relative), their difference is
    # off by up to (max|s| + |LSE|)·log2(e)·2^-24 in the exponent, P by ln 2 times that relative
    s_max = float(torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), k.detach().double()).abs().max()) * (scale or d ** -0.5)
    extra_u = (2 * s_max + math.log(sk)) * 2.0 ** -24
    _, grads = _check(dtype, b, sq, sk, h, h, d, inputs=(q, k, v), deterministic=deterministic, extra_u=extra_u,
                      **kw)
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("deterministic", [False, True])
def test_key_padding_mask_with_a_partial_key_tile_and_very_negative_scores(deterministic, tiles):
    # as above (float32, scores about -100), with a key padding mask ([b, sk], one row of bytes
    # per head): the keys past sk in the last, partial key tile stay masked whatever the mask
    # reads there, so no padded key's overflowing 2^(0 - LSE) reaches dS (the atomic dQ would
    # sum it as inf·0 = NaN into every row)
    tiles(16, 16)
    b, sq, sk, h, d = 1, 5, 40, 1, 80
    scale = 100 / 80
    q = (0.1 * torch.randn(b, sq, h, d, device=DEVICE) - 1.0).requires_grad_()
    k = (0.1 * torch.randn(b, sk, h, d, device=DEVICE) + 1.0).requires_grad_()
    v = torch.randn(b, sk, h, d, device=DEVICE).requires_grad_()
    mask = torch.zeros(b, sk, dtype=torch.bool, device=DEVICE)
    mask[:, 3] = mask[:, 17] = True
    s_max = float(torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), k.detach().double()).abs().max()) * scale
    extra_u = (2 * s_max + math.log(sk)) * 2.0 ** -24  # the recomputed P's exponent (see above)
    _, grads = _check(torch.float32, b, sq, sk, h, h, d, inputs=(q, k, v), deterministic=deterministic,
                      extra_u=extra_u, softmax_scale=scale, attention_mask=mask)
    assert all(torch.isfinite(t).all() for t in grads)


def test_atomic_dq_only_where_it_measured_faster():
    """The nondeterministic backward takes the atomic dQ for head dims 65-128, and for head dims
    up to 64 only with dropout (the H200 sweep in BWD_ATOMIC_TILES); never above 128."""
    assert [kfa.use_atomic_dq(d, False) for d in (1, 16, 64, 65, 80, 128, 129, 256)] == \
        [False, False, False, True, True, True, False, False]
    assert [kfa.use_atomic_dq(d, True) for d in (1, 16, 64, 65, 128, 129, 256)] == \
        [True, True, True, True, True, False, False]


def test_dq_by_tma_where_the_bulk_reduction_can_run(monkeypatch):
    """The atomic dQ takes TMA bulk reductions on a compiled Hopper-or-newer GPU, for head dims
    that are powers of two of at least 16, outside torch.compile traces, unless DQ_BY_TMA is off;
    never in the interpreter (no bulk reduction there)."""
    q = torch.empty(1, 4, 2, 128, device=DEVICE)
    hopper = q.is_cuda and not kfa.INTERPRET_ON_CPU and torch.cuda.get_device_capability(q.device)[0] >= 9
    assert [kfa.dq_by_tma(q, d) for d in (8, 16, 64, 80, 96, 128, 256)] == \
        [False, hopper, hopper, False, False, hopper, hopper]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kfa.dq_by_tma(q, 128)
    monkeypatch.undo()
    monkeypatch.setattr(kfa, "DQ_BY_TMA", False)
    assert not kfa.dq_by_tma(q, 128)
    monkeypatch.setattr(kfa, "DQ_BY_TMA", True)
    monkeypatch.setattr(kfa, "_TensorDescriptor", None)  # a Triton without descriptor reductions
    assert not kfa.dq_by_tma(q, 128)
    assert not kfa.dq_by_tma(torch.empty(1, 4, 2, 128), 128)  # a CPU tensor


def test_double_backward_raises():
    q, k, v = _inputs(1, 4, 4, 1, 1, 16, torch.float32)
    o = flash_attention(q, k, v)
    (gq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


# ---------------------------------------------------------------------------------------------
# One packed QKV tensor: the three gradients written into one buffer laid out as it
# ---------------------------------------------------------------------------------------------


def _packed_views(layout, b, s, h, d, dtype):
    """q, k, v [b, s, h, d] as views of one contiguous base (requires grad), in two layouts:
    Megatron-core's [s, b, h, 3·d] (per head q, k, v) and [b, s, 3, h, d]."""
    if layout == "megatron":
        base = torch.randn(s, b, h * 3 * d, device=DEVICE).to(dtype).requires_grad_(True)
        q, k, v = base.view(s, b, h, 3 * d).split(d, dim=-1)
        return base, [t.transpose(0, 1) for t in (q, k, v)]
    base = torch.randn(b, s, 3 * h * d, device=DEVICE).to(dtype).requires_grad_(True)
    return base, list(base.view(b, s, 3, h, d).unbind(2))


@pytest.mark.parametrize("layout", ["megatron", "bs3hd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_qkv_gradients_land_in_one_buffer(layout, dtype, deterministic, tiles, monkeypatch):
    # the gradients of the packed views: the same bits as of separate copies, and in one
    # buffer laid out as the base (so that the split's backward has nothing to concatenate)
    tiles(16, 16)
    torch.manual_seed(11)
    b, s, h, d = 2, 21, 3, 24
    base, views = _packed_views(layout, b, s, h, d, dtype)
    made = []
    real = kfa.packed_grads
    monkeypatch.setattr(kfa, "packed_grads", lambda q, k, v: made.append(real(q, k, v)) or made[-1])
    o = flash_attention(*views, causal=True, deterministic=deterministic)
    g = torch.randn(o.shape, device=DEVICE).to(dtype)
    grads = torch.autograd.grad(o, views, g)
    assert made[-1] is not None, "the packed layout was not recognised"
    assert getattr(grads[0]._base, kfa.PACKED_GRADS_ATTR, False)  # marked as the backward's own buffer
    ptr = grads[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == ptr for t in grads)
    for t, view in zip(grads, views):
        assert t.stride() == view.stride() and t.storage_offset() == view.storage_offset()
    separate = [t.detach().clone().requires_grad_(True) for t in views]
    o2 = flash_attention(*separate, causal=True, deterministic=deterministic)
    want = torch.autograd.grad(o2, separate, g)
    assert made[-1] is None  # separate tensors: separate gradients
    assert torch.equal(o, o2)
    if deterministic:
        assert all(torch.equal(a, w) for a, w in zip(grads, want))
    else:  # atomic dQ: the order of the float32 sums may differ
        for a, w in zip(grads, want):
            torch.testing.assert_close(a, w, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_packed_and_separate_views_of_one_signature_get_their_own_plans(tiles):
    # q, k and v with the packed views' shapes, strides, offsets and alignment, but cut from three
    # buffers: their gradients are new dense tensors, not views laid out as a base, so the
    # backward's plan (its dq, dk, dv strides) must not be the packed call's
    tiles(16, 16)
    torch.manual_seed(12)
    b, s, h, d = 2, 21, 3, 24
    base, views = _packed_views("megatron", b, s, h, d, torch.float32)
    # the same values in three copies of the base, one piece taken from each
    apart = [base.detach().clone().view(s, b, h, 3 * d)[..., i * d:(i + 1) * d].transpose(0, 1).requires_grad_(True)
             for i in range(3)]
    assert all(a.stride() == v.stride() and a.storage_offset() == v.storage_offset() for a, v in zip(apart, views))
    g = torch.randn(b, s, h, d, device=DEVICE)

    def grads(qkv):
        return torch.autograd.grad(flash_attention(*qkv, causal=True, deterministic=True), qkv, g)

    rt.clear_plans()
    want = grads(apart)  # made with its own plans
    rt.clear_plans()
    packed = grads(views)
    assert getattr(packed[0]._base, kfa.PACKED_GRADS_ATTR, False)
    got = grads(apart)  # after the packed call's plans
    assert got[0]._base is None and all(torch.equal(a, w) for a, w in zip(got, want))
    assert all(torch.equal(a, w) for a, w in zip(packed, want))


def test_packed_grads_only_for_views_that_tile_their_base():
    b, s, h, d = 2, 5, 2, 16
    base, (q, k, v) = _packed_views("megatron", b, s, h, d, torch.float32)
    assert kfa.packed_grads(q, k, v) is not None
    assert kfa.packed_grads(v, q, k) is not None  # any order of the three pieces
    assert kfa.packed_grads(q, q, q) is None  # one view three times (self-attention on x, x, x)
    assert kfa.packed_grads(q, k, k) is None  # overlapping pieces
    wide = torch.randn(s, b, h * 4 * d, device=DEVICE).view(s, b, h, 4 * d)  # a fourth piece left over
    q4, k4, v4, _ = wide.split(d, dim=-1)
    assert kfa.packed_grads(*(t.transpose(0, 1) for t in (q4, k4, v4))) is None
    gqa = torch.randn(s, b, 4 * d, device=DEVICE).view(s, b, 1, 4 * d)  # two query heads, one k/v head
    qg, kg, vg = gqa.split([2 * d, d, d], dim=-1)
    assert kfa.packed_grads(qg.reshape(s, b, 2, d).transpose(0, 1), *(t.transpose(0, 1) for t in (kg, vg))) is None
    x = torch.randn(b, s, h, d, device=DEVICE)
    assert kfa.packed_grads(x, x.clone(), x.clone()) is None  # not views


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument
# ---------------------------------------------------------------------------------------------


def _good():
    return dict(q=torch.randn(2, 5, 4, 16, device=DEVICE), k=torch.randn(2, 7, 2, 16, device=DEVICE),
                v=torch.randn(2, 7, 2, 16, device=DEVICE))


BAD = {
    "q not a tensor": (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    "int dtype": (dict(q=torch.ones(2, 5, 4, 16, dtype=torch.int32)), TypeError, "q must have dtype"),
    "float64": (dict(q=torch.randn(2, 5, 4, 16, dtype=torch.float64)), TypeError, "q must have dtype"),
    "mixed dtypes": (dict(k=torch.randn(2, 7, 2, 16).half()), TypeError, "one dtype"),
    "3-D q": (dict(q=torch.randn(5, 4, 16)), ValueError, "q must be 4-D"),
    "k v shapes differ": (dict(v=torch.randn(2, 8, 2, 16)), ValueError, "k and v must have one shape"),
    "batch differs": (dict(k=torch.randn(3, 7, 2, 16), v=torch.randn(3, 7, 2, 16)), ValueError, "batch size"),
    "head dim differs": (dict(k=torch.randn(2, 7, 2, 8), v=torch.randn(2, 7, 2, 8)), ValueError, "head dim"),
    "heads not a multiple": (dict(k=torch.randn(2, 7, 3, 16), v=torch.randn(2, 7, 3, 16)), ValueError,
                             "multiple of k's and v's heads"),
    "head dim too large": (dict(q=torch.randn(1, 2, 1, 300), k=torch.randn(1, 2, 1, 300), v=torch.randn(1, 2, 1, 300)),
                           ValueError, "head dim"),
    "head dim one past the limit": (dict(q=torch.randn(1, 2, 1, 257), k=torch.randn(1, 2, 1, 257),
                                         v=torch.randn(1, 2, 1, 257)),
                                    ValueError, "the head dim (q's last dim) must be in [1, 256], got 257"),
    "causal not bool": (dict(causal=1), TypeError, "causal must be a bool"),
    "scale inf": (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    "scale str": (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    "scale bool": (dict(softmax_scale=True), TypeError, "softmax_scale must be a real number or None, got bool"),
    # finite in float64 but not in the kernels' float32 scale·log2(e): the output was all NaN
    "scale beyond float32": (dict(softmax_scale=1e300), ValueError, "softmax_scale must be finite"),
    "scale*log2(e) beyond float32": (dict(softmax_scale=-3e38), ValueError, "softmax_scale must be finite"),
    "mask not bool": (dict(attention_mask=torch.zeros(2, 7)), TypeError, "attention_mask must have dtype"),
    "mask 2-D wrong": (dict(attention_mask=torch.zeros(2, 5, dtype=torch.bool)), ValueError, "key-padding mask [b, sk]"),
    "mask 4-D wrong": (dict(attention_mask=torch.zeros(2, 3, 5, 7, dtype=torch.bool)), ValueError, "broadcast"),
    "mask 3-D": (dict(attention_mask=torch.zeros(2, 5, 7, dtype=torch.bool)), ValueError, "attention_mask must be"),
    "window bad": (dict(window_size=(3,)), ValueError, "window_size"),
    "window -2": (dict(window_size=(-2, 0)), ValueError, "window_size"),
    "sinks shape": (dict(sinks=torch.zeros(2)), ValueError, "sinks must have shape [hq]"),
    "sinks int": (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks must have dtype"),
    "dropout 1": (dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
    "dropout str": (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    "deterministic not bool": (dict(deterministic=None), TypeError, "deterministic must be a bool"),
    "causal str": (dict(causal="no"), TypeError, "causal must be a bool, got str"),
    # numpy's bool is not a subclass of bool; the message said "got bool" for an int-like type
    "causal numpy int": (dict(causal=np.int64(1)), TypeError, "causal must be a bool, got numpy.int64"),
    # below 1, but round(p·2^16) = 2^16 at the kernels' resolution: everything dropped, all zeros
    "dropout rounds to 1": (dict(dropout_p=1 - 2 ** -(KEEP_BITS + 1)), ValueError, "rounds to 1"),
    "dropout 0.9999999": (dict(dropout_p=0.9999999), ValueError, "dropout_p must be in [0, 1) and below"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name):
    change, err, msg = BAD[name]
    # the table is built at import, on the CPU: move its tensors to the tested device, so that
    # only the named fault differs from a good call (a copy: the table itself stays as built)
    change = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()}
    args = _good()
    for key in ("q", "k", "v"):
        if key in change:
            args[key] = change.pop(key)
    with pytest.raises(err, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        flash_attention(args["q"], args["k"], args["v"], **change)


def test_numpy_bool_flags_are_accepted():
    args = _good()
    ref = flash_attention(**args, causal=True)
    assert torch.equal(flash_attention(**args, causal=np.bool_(True), deterministic=np.bool_(False)), ref)


def test_tensors_on_different_devices():
    args = _good()
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match="one device"):
        flash_attention(args["q"], args["k"].to(other), args["v"])
    with pytest.raises(ValueError, match="attention_mask must be on q's device"):
        flash_attention(**args, attention_mask=torch.zeros(2, 7, dtype=torch.bool, device=other))


def test_sinks_on_another_device_are_refused_naming_them():
    args = _good()
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match=f"sinks must be on q's device \\({DEVICE}.*\\), got {other}"):
        flash_attention(**args, sinks=torch.zeros(4, device=other))


# ---------------------------------------------------------------------------------------------
# GPU only: realistic head dims and lengths
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims_causal_gqa(d, dtype):
    _check(dtype, 2, 300, 300, 8, 2, d, causal=True)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_long_rows_every_feature(dtype):
    b, sq, sk, hq, hkv, d = 2, 257, 1000, 4, 2, 128
    mask = torch.rand(b, sk, device=DEVICE) < 0.1
    sinks = torch.randn(hq, device=DEVICE, requires_grad=True)
    _check(dtype, b, sq, sk, hq, hkv, d, dropout_p=0.1, causal=True, window_size=(300, -1), attention_mask=mask,
           sinks=sinks)


@needs_cuda
@pytest.mark.parametrize("by_tma", [True, False], ids=["bulk-reductions", "element-atomics"])
@pytest.mark.parametrize("d, dropout_p", [(128, 0.0), (64, 0.1)])
def test_gpu_atomic_dq_both_ways(by_tma, d, dropout_p, monkeypatch):
    # both ways of adding dQ tiles against float64: sq = 333 leaves the last 64-query tile
    # partial (its rows past sq must not reach the next head's rows), sq != sk, GQA; and the
    # dK/dV launch takes the way asked for (TMA only on compute capability 9.0 or newer)
    monkeypatch.setattr(kfa, "DQ_BY_TMA", by_tma)
    seen = []
    real = rt.launch

    def spy(kernel, *args, **kwargs):
        if "DQ_TMA" in kwargs:
            seen.append((kwargs["ATOMIC_DQ"], kwargs["DQ_TMA"]))
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", spy)  # a new plan's first launch comes here
    _check(torch.bfloat16, 2, 333, 400, 8, 2, d, dropout_p=dropout_p, causal=True, deterministic=False)
    assert seen == [(True, by_tma and torch.cuda.get_device_capability()[0] >= 9)]


@needs_cuda
@pytest.mark.parametrize("by_tma", [True, False], ids=["tma-loads", "pointer-loads"])
@pytest.mark.parametrize("deterministic, dropout_p", [(True, 0.0), (False, 0.0), (True, 0.1)])
def test_gpu_tile_loads_both_ways(by_tma, deterministic, dropout_p, monkeypatch):
    # both ways of reading the streamed tiles against float64: sq = 333 and sk = 400 leave the
    # last tiles partial (rows past the end must read as zeros, not the next head's rows), GQA;
    # and every launch takes the loads asked for: TMA on compute capability 9.0 or newer, in
    # every form at d = 128 and 64 (the table set so; TMA_LOADS's own rows: the next test)
    monkeypatch.setattr(kfa, "LOADS_BY_TMA", by_tma)
    monkeypatch.setattr(kfa, "TMA_LOADS", {form: (64, 128) for form in kfa.TMA_LOADS})
    seen = []
    real = rt.launch

    def spy(kernel, *args, **kwargs):
        for flag in ("KV_TMA", "QDO_TMA"):
            if flag in kwargs:
                seen.append((kernel.__name__, flag, kwargs[flag]))
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", spy)  # a new plan's first launch comes here
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for d in (128, 64):
        seen.clear()
        _check(torch.bfloat16, 2, 333, 400, 8, 2, d, dropout_p=dropout_p, causal=True, deterministic=deterministic)
        on = by_tma and hopper
        pair = deterministic or not kfa.use_atomic_dq(d, dropout_p > 0)  # the dK/dV and dQ kernels
        dkdv, dq = ("_flash_bwd_dkdv_kernel", "QDO_TMA", on), ("_flash_bwd_dq_kernel", "KV_TMA", on)
        # the dQ kernel first where it computes Delta (no sinks here), else after dK/dV
        backward = ([dq, dkdv] if kfa.delta_in_dq_kernel(d, dropout_p > 0) else [dkdv, dq]) if pair else [dkdv]
        assert seen == [("_flash_fwd_kernel", "KV_TMA", on), *backward], (d, seen)


@needs_cuda
def test_gpu_tma_loads_follow_the_table():
    # TMA_LOADS as stored: at d = 128 the forward without dropout and the deterministic
    # backward, nothing else (the forms measured slower: the forward with dropout, atomic dQ,
    # d = 64)
    q = torch.zeros(1, 8, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    got = {form: [kfa.tma_loads(q[..., :d], d, form) for d in (64, 128)] for form in kfa.TMA_LOADS}
    assert got == {"forward": [False, hopper], "forward_dropout": [False, False], "backward": [False, hopper],
                   "backward_dropout": [False, hopper], "backward_atomic": [False, False]}, got


@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_tile_loads_read_the_block_s_packed_views(causal, monkeypatch):
    # q, k and v as the attention layer passes them: [b, s, heads, d] views of one [s, b, groups,
    # (heads/groups + 2)·d] projection (GQA), so the batch stride is below the sequence's and a
    # head's rows are not adjacent (q, which the reshape of the GQA split copies, is dense); and
    # the projection one element off 16-byte alignment, where K and V (views of it) cannot be
    # addressed by the copy engine: pointer loads for them, TMA for q and dO. TMA and pointer
    # loads must give the same bits (the deterministic backward: every sum in the same order)
    s_, b_, groups, per, d = 300, 2, 2, 4, 128
    base = torch.randn(s_ * b_ * groups * (per + 2) * d + 1, device=DEVICE).to(torch.bfloat16)
    out = {}
    for offset in (0, 1):
        mixed = base[offset:offset + s_ * b_ * groups * (per + 2) * d].view(s_, b_, groups, (per + 2) * d)
        q = mixed[..., :per * d].reshape(s_, b_, groups * per, d).transpose(0, 1)
        k = mixed[..., per * d:(per + 1) * d].transpose(0, 1)
        v = mixed[..., (per + 1) * d:].transpose(0, 1)
        assert (kfa._desc_box(k, 64) is None) == (offset == 1)
        g = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
        for by_tma in (True, False):
            monkeypatch.setattr(kfa, "LOADS_BY_TMA", by_tma)
            rt.clear_plans()  # plans keep the loads they were made with
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            o = flash_attention(qq, kk, vv, causal=causal, deterministic=True)
            o.backward(g)
            out[offset, by_tma] = [o.detach()] + [t.grad for t in (qq, kk, vv)]
        assert all(torch.equal(a, b) for a, b in zip(out[offset, True], out[offset, False])), offset
    _check(torch.bfloat16, b_, s_, s_, groups * per, groups, d, causal=causal,
           inputs=[t.detach().requires_grad_(True) for t in (q, k, v)])


def test_tile_descriptors_only_where_the_copy_engine_can_read(monkeypatch):
    """_desc_box describes [b, s, h, d] as [1, rows, 1, d] boxes with the tensor's strides (a
    dim of length 1 given 16 bytes), and refuses a base or a stride the copy engine cannot
    address; _desc_boxes describes both tensors or neither, and _descs makes the descriptors of
    its boxes. Host-side only (no kernel runs)."""
    if kfa._HostDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    x = torch.zeros(2, 40, 6, 64, dtype=torch.bfloat16)
    shape, strides, box = kfa._desc_box(x, 32)
    assert shape == [2, 40, 6, 64] and strides == list(x.stride()) and box == [1, 32, 1, 64]
    view = x.transpose(0, 1).contiguous().transpose(0, 1)  # [s, b] memory: a batch stride below the sequence's
    assert kfa._desc_box(view, 64)[1] == list(view.stride())
    one = torch.zeros(1, 40, 1, 64, dtype=torch.bfloat16)[:, :, :, :]
    assert kfa._desc_box(one.as_strided(one.shape, (7, 64, 3, 1)), 16)[1] == [8, 64, 8, 1]
    flat = torch.zeros(2 * 40 * 6 * 64 + 8, dtype=torch.bfloat16)
    assert kfa._desc_box(flat[1:1 + x.numel()].view(x.shape), 32) is None  # base 2 bytes off
    assert kfa._desc_box(flat[8:8 + x.numel()].view(x.shape), 32) is not None  # 16 bytes off
    odd = torch.zeros(2, 40, 6 * 72, dtype=torch.bfloat16)[..., :6 * 68].unflatten(-1, (6, 68))[..., :64]
    assert kfa._desc_box(odd, 32) is None  # head stride 68 elements = 136 bytes
    assert kfa._desc_box(x[:1].expand(2, 40, 6, 64), 32) is None  # a zero batch stride
    assert kfa._desc_box(x[:, :0], 32) is None  # no rows: a descriptor needs every dim >= 1
    assert kfa._desc_box(torch.zeros(2, 40, 6, 128, dtype=torch.bfloat16)[..., ::2], 32) is None  # last stride 2
    with pytest.raises(ValueError, match="form must be one of"):
        kfa.tma_loads(x, 64, "fwd")
    assert kfa._desc_boxes(x, odd, 32) is None and kfa._desc_boxes(odd, x, 32) is None
    assert kfa._descs(x, odd, None) == (x, odd)
    a, b = kfa._descs(x, view, kfa._desc_boxes(x, view, 16))
    assert a.base is x and b.base is view
    assert list(a.block_shape) == [1, 16, 1, 64] and list(b.strides) == list(view.stride())


def test_launchers_pass_tile_descriptors_where_tma_loads_allow(monkeypatch):
    """Where tma_loads allows (here: the forms "forward" and "backward"), the forward passes K
    and V, the dK/dV kernel q and dO, and the dQ kernel K and V as descriptors whose boxes are
    [1, rows, 1, d] with the launch's tile rows (keys for K and V, queries for q and dO), and
    sets the kernels' flags; elsewhere the tensors themselves with the flags off: with it
    false, in the forms it refuses (here: with dropout, with dQ by atomics), and for a pair of
    tensors the copy engine cannot address (each kernel's flag follows its own pair). d = 32 and
    tiles with BLOCK_M != BLOCK_N, so a box of the wrong rows or width fails. The launches are
    recorded, not run."""
    if kfa._HostDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    monkeypatch.setattr(kfa, "INTERPRET_ON_CPU", False)
    seen = []

    def record(kernel, grid, device, *args, **kwargs):
        seen.append((kernel.__name__, args, kwargs))

    monkeypatch.setattr(rt, "launch", record)  # each new plan's first launch
    fwd_t = Tile(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
    bwd_t = Tile(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
    dq_t = Tile(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
    flat = torch.randn(2 * 50 * 4 * 32 + 1).to(torch.bfloat16)
    aligned = flat[:-1].view(2, 50, 4, 32)
    off = flat[1:].view(2, 50, 4, 32)  # 2 bytes past a 16-byte boundary: no descriptor
    lse = torch.zeros(2, 4, 50)

    def launches(q, kv, on):
        monkeypatch.setattr(kfa, "tma_loads", lambda t, d, form: on and form in ("forward", "backward"))
        rt.clear_plans()  # plans keep the loads they were made with
        k, v = kv[:, :, :2], kv[:, :, 2:]
        seen.clear()
        kfa.flash_attn_fwd(q, k, v, 1.0, (-50, 0), tile=fwd_t)
        kfa.flash_attn_bwd(q, q, k, v, q, lse, 1.0, (-50, 0), tile=bwd_t, dq_tile=dq_t, deterministic=True)
        by_name = {name: (args, kwargs) for name, args, kwargs in seen}
        return k, v, [(by_name["_flash_fwd_kernel"], "KV_TMA", (1, 2), (k, v), fwd_t.BLOCK_N),
                      (by_name["_flash_bwd_dkdv_kernel"], "QDO_TMA", (0, 3), (q, q), bwd_t.BLOCK_M),
                      (by_name["_flash_bwd_dq_kernel"], "KV_TMA", (1, 2), (k, v), dq_t.BLOCK_N)]

    for q, kv, on, expect in ((aligned, aligned, True, [True, True, True]),
                              (aligned, aligned, False, [False, False, False]),
                              (aligned, off, True, [False, True, False]),  # K and V unaligned
                              (off, aligned, True, [True, False, True])):  # q and dO unaligned
        k, v, got = launches(q, kv, on)
        for ((args, kw), flag, idx, tensors, rows), want in zip(got, expect):
            assert kw[flag] is want, (flag, want)
            for i, t in zip(idx, tensors):
                if want:
                    assert args[i].base is t and list(args[i].block_shape) == [1, rows, 1, 32]
                else:
                    assert args[i] is t
    monkeypatch.setattr(kfa, "tma_loads", lambda t, d, form: form in ("forward", "backward"))
    rt.clear_plans()
    q, k, v = aligned, aligned[:, :, :2], aligned[:, :, 2:]
    seen.clear()
    seed = torch.zeros(1, dtype=torch.int64)
    kfa.flash_attn_fwd(q, k, v, 1.0, (-50, 0), seed=seed, dropout_p=0.1)
    kfa.flash_attn_bwd(q, q, k, v, q, lse, 1.0, (-50, 0), seed=seed, dropout_p=0.1, deterministic=True)
    q2 = torch.randn(2, 50, 4, 128).to(torch.bfloat16)  # d = 128: dQ by atomics without determinism
    kfa.flash_attn_bwd(q2, q2, q2[:, :, :2], q2[:, :, 2:], q2, lse, 1.0, (-50, 0), deterministic=False)
    flags = [(name, kw.get("KV_TMA", kw.get("QDO_TMA")), kw.get("ATOMIC_DQ")) for name, _, kw in seen
             if "KV_TMA" in kw or "QDO_TMA" in kw]
    # the deterministic backward at d = 32 with dropout: Delta from the preprocess kernel
    # (delta_in_dq_kernel), then dK/dV, then dQ
    assert flags == [("_flash_fwd_kernel", False, None), ("_flash_bwd_dkdv_kernel", False, False),
                     ("_flash_bwd_dq_kernel", False, None), ("_flash_bwd_dkdv_kernel", False, True)], flags


def test_float32_tiles_are_small_and_run_one_pipeline_stage_fewer(monkeypatch):
    """float32 launches (a reference dtype) take blocks of at most FLOAT32_MAX_BLOCK at 4 warps,
    whose unrolled IEEE FMA products compile in seconds instead of minutes, and one stage fewer
    (twice the bytes per stage); 16-bit tiles, and every tile in the interpreter, unchanged."""
    monkeypatch.setattr(kfa, "INTERPRET_ON_CPU", False)
    t = Tile(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3)
    assert kfa.FLOAT32_MAX_BLOCK == 32
    assert kfa._float32_tile(t, torch.float32) == Tile(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    assert kfa._float32_tile(t, torch.bfloat16) is t and kfa._float32_tile(t, torch.float16) is t
    one = Tile(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    assert kfa._float32_tile(one, torch.float32) == one
    for table in (kfa.FWD_TILES, kfa.FWD_DROPOUT_TILES, kfa.BWD_DKDV_TILES, kfa.BWD_ATOMIC_TILES, kfa.BWD_DQ_TILES):
        for _, tile in table:
            small = kfa._float32_tile(tile, torch.float32)
            assert small.BLOCK_M <= 32 and small.BLOCK_N <= 32 and small.num_warps <= 4
    monkeypatch.setattr(kfa, "INTERPRET_ON_CPU", True)
    assert kfa._float32_tile(t, torch.float32) is t


def test_forward_takes_the_dropout_table_with_a_seed(monkeypatch):
    """The forward's tile comes from FWD_DROPOUT_TILES where it draws a mask (a seed is given),
    else from FWD_TILES, at every head dim of the tables (compiled kernels: the interpreter
    has one tile). The launch is recorded, not run."""
    monkeypatch.setattr(kfa, "INTERPRET_ON_CPU", False)
    seen = []

    def record(kernel, grid, device, *args, **kwargs):
        seen.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]))

    monkeypatch.setattr(rt, "launch", record)  # each new plan's first launch
    for d in (40, 64, 96, 128, 256):
        q = torch.zeros(1, 5, 2, d, dtype=torch.bfloat16)
        for seed, table in ((None, kfa.FWD_TILES), (torch.zeros(1, dtype=torch.int64), kfa.FWD_DROPOUT_TILES)):
            seen.clear()
            kfa.flash_attn_fwd(q, q, q, 1.0, (-5, 0), seed=seed, dropout_p=0.0 if seed is None else 0.1)
            t = next(t for bound, t in table if d <= bound)
            assert seen == [(t.BLOCK_M, t.BLOCK_N, t.num_warps, t.num_stages)], (d, seed, seen)
    assert kfa.FWD_DROPOUT_TILES != kfa.FWD_TILES  # a test that could not fail otherwise


def test_attention_tables_keep_their_key_blocks():
    """FlashAttention's tables are keyed by head dim and their BLOCK_N counts keys: the shared
    pick() returns it as the table gives it, where a row table's BLOCK_N is capped at the row."""
    from fusedlib.kernels.launch import pick

    for table in (kfa.FWD_TILES, kfa.FWD_DROPOUT_TILES, kfa.BWD_DKDV_TILES, kfa.BWD_DQ_TILES):
        for d in (1, 40, 64, 65, 128, 200, 256):
            want = next(t for bound, t in table if d <= bound)
            assert pick(table, d, resolve_block_n=False) == want
    row_table = ((64, Tile(BLOCK_M=32, BLOCK_N=128, num_warps=4)),)
    assert pick(row_table, 40).BLOCK_N == 64  # a row of 40 fits a block of 64
    assert pick(row_table, 40, resolve_block_n=False).BLOCK_N == 128
    with pytest.raises(ValueError, match="past the tile table's last bound"):
        pick(kfa.FWD_TILES, kfa.MAX_HEAD_DIM + 1, resolve_block_n=False)


def test_attention_loads_tool_times_every_form_of_the_table():
    """tools/attention_loads.py (which measured TMA_LOADS) times each form the table names, at
    the head dims of the attention benchmark, with the dropout and determinism that select it."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "attention_loads.py"
    spec = importlib.util.spec_from_file_location("attention_loads", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for d in (64, 128):
        forms = tool._forms(d)
        assert {f for f, _, _ in forms} == set(kfa.TMA_LOADS), d
        for form, p, deterministic in forms:
            assert (p > 0) == form.endswith("dropout") or form == "backward_atomic"
            assert deterministic == (form != "backward_atomic")
            if form == "backward_atomic":
                assert kfa.use_atomic_dq(d, p > 0)
    assert [p for f, p, _ in tool._forms(128) if f == "backward_atomic"] == [0.0, tool.DROPOUT_P]
    assert [p for f, p, _ in tool._forms(64) if f == "backward_atomic"] == [tool.DROPOUT_P]


def test_attention_delta_tool_runs_each_route_and_puts_the_limit_back(tmp_path):
    """tools/attention_delta.py (which measured the two limits of delta_in_dq_kernel) runs the
    preprocess route and the Delta-in-dQ route of each deterministic form, each forced whatever
    the module would choose, sees which kernels each launched and that they gave the same bits,
    and leaves the module's limits as it found them; a bad --out is refused before anything
    runs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "attention_delta.py"
    spec = importlib.util.spec_from_file_location("attention_delta", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    limits = (kfa.DELTA_IN_DQ_MAX_HEAD_DIM, kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM)
    assert not kfa.delta_in_dq_kernel(16, dropout=True)  # so the Delta-in-dQ route with dropout is forced
    rows = tool.compare((1, 2, 37, 16), True, timer=lambda call: 1.5, device=DEVICE)
    assert (kfa.DELTA_IN_DQ_MAX_HEAD_DIM, kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM) == limits
    assert [(r["form"], r["route"], r["dropout_p"]) for r in rows] == [
        ("backward", "preprocess", 0.0), ("backward", "delta_in_dq", 0.0),
        ("backward_dropout", "preprocess", tool.DROPOUT_P), ("backward_dropout", "delta_in_dq", tool.DROPOUT_P)]
    for r in rows:
        assert r["same_bits"] is True and r["ms"] == 1.5 and r["shape"] == [1, 2, 37, 16] and r["causal"]
        assert r["kernels"] == (["_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"]
                                if r["route"] == "preprocess" else ["_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"])
    with pytest.raises(SystemExit):
        tool.main(["--out", str(tmp_path)])  # a folder
    with pytest.raises(SystemExit):
        tool.main(["--out", str(tmp_path / "missing" / "x.json")])


# ---------------------------------------------------------------------------------------------
# The programs' order (_scheduled_tile, program_order)
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusedlib.kernels.flash_attention import _scheduled_tile  # noqa: E402


@triton.jit
def _order_probe_kernel(OUT_ptr, GROUP_HEADS: tl.constexpr, REVERSE_BLOCKS: tl.constexpr):
    # each program writes the tile it was given at its linear index (the order the GPU starts it)
    blk, h, b = _scheduled_tile(GROUP_HEADS, REVERSE_BLOCKS)
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(OUT_ptr + pid * 3, blk)
    tl.store(OUT_ptr + pid * 3 + 1, h)
    tl.store(OUT_ptr + pid * 3 + 2, b)


@pytest.mark.parametrize("group, reverse", [(1, False), (1, True), (4, True), (4, False), (6, True), (8, True)])
def test_scheduled_tile_visits_every_tile_once_heaviest_first(group, reverse):
    # grid (5 blocks, 3 heads, 2 batch): 6 (head, batch) pairs, so groups of 4 leave a last
    # group of 2 and groups of 8 take every pair; the expected order is written independently
    # of the kernel's arithmetic: group by group, block by block (the heaviest first), pair by
    # pair
    nb, nh, nbatch = 5, 3, 2
    out = torch.full((nb * nh * nbatch, 3), -1, dtype=torch.int32, device=DEVICE)
    _order_probe_kernel[(nb, nh, nbatch)](out, GROUP_HEADS=group, REVERSE_BLOCKS=reverse)
    expect = []
    pairs = list(range(nh * nbatch))
    for g0 in range(0, len(pairs), group):
        for r in range(nb):
            for hb in pairs[g0:g0 + group]:
                expect.append((nb - 1 - r if reverse else r, hb % nh, hb // nh))
    got = [tuple(row) for row in out.tolist()]
    assert got == expect
    assert sorted(got) == sorted((m, h, b) for m in range(nb) for h in range(nh) for b in range(nbatch))


def test_program_order_by_band(monkeypatch):
    # the table's group where the band makes the blocks' costs differ, heaviest block first;
    # the grid's order where they cost the same or the table says 1
    monkeypatch.setattr(kfa, "SCHEDULE_HEADS", ((64, 1), (128, 8), (256, 1)))
    order = kfa.program_order
    causal = attention_band(2048, 2048, True, None)
    assert order(causal, 2048, 2048, 128, False) == (8, True)  # the last query block sees every key
    assert order(causal, 2048, 2048, 128, True) == (8, False)  # the first key block is seen by every query
    assert order(causal, 2048, 2048, 80, False) == (8, True)  # padded to 128
    assert order(causal, 2048, 2048, 64, False) == (1, False)
    assert order(causal, 2048, 2048, 256, True) == (1, False)
    full = attention_band(2048, 2048, False, None)
    assert order(full, 2048, 2048, 128, False) == order(full, 2048, 2048, 128, True) == (1, False)
    window = attention_band(512, 512, False, (100, 100))  # rows in the middle see 201 keys, the ends 101
    assert order(window, 512, 512, 128, False) == (1, False)  # first and last rows alike
    sliding = attention_band(512, 512, True, (16, -1))  # causal window: the first row sees 1 key, the last 17
    assert order(sliding, 512, 512, 128, False) == (8, True)
    assert order(sliding, 512, 512, 128, True) == (8, False)
    later = attention_band(512, 512, False, (0, -1))  # keys j >= i only: the first row sees every key
    assert order(later, 512, 512, 128, False) == (8, False)
    assert order(later, 512, 512, 128, True) == (8, True)
    short = attention_band(5, 9, True, None)  # bottom-right aligned: row 0 sees 5 keys, row 4 all 9
    assert order(short, 5, 9, 128, False) == (8, True)
    assert order(short, 5, 9, 128, True) == (8, False)  # keys 0-4 seen by all 5 rows, key 8 by one


ORDERS = [(1, True), (3, False), (3, True), (64, True)]


@pytest.mark.parametrize("group, reverse", ORDERS)
def test_program_order_changes_no_bits(group, reverse, tiles, monkeypatch):
    # every program computes the same tile in any order: the forward and the deterministic
    # backward give the grid order's bits, and the atomic form its dK, dV (its dQ's float32
    # additions come in another order: against float64 in the next test). GQA (6 query heads, 3
    # key/value heads) and 3 samples give 18 and 9 (head, batch) pairs: groups of 3 divide
    # them, and with the grid of blocks ragged (partial tiles, sq != sk) every program counts
    tiles(16, 16)
    b, hq, hkv = 3, 6, 3
    sq, sk, d = (37, 45, 80) if not CUDA else (333, 400, 128)
    torch.manual_seed(0)
    q = torch.randn(b, sq, hq, d, device=DEVICE).to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    sinks = torch.randn(hq, device=DEVICE)
    scale = d ** -0.5
    band = attention_band(sq, sk, True, None)

    def run(order):
        monkeypatch.setattr(kfa, "program_order", order)
        rt.clear_plans()  # plans keep the order they were made with
        o, lse = kfa.flash_attn_fwd(q, k, v, scale, band, sinks=sinks)
        det = kfa.flash_attn_bwd(do, q, k, v, o, lse, scale, band, sinks=sinks, deterministic=True)
        atomic = kfa.flash_attn_bwd(do, q, k, v, o, lse, scale, band, sinks=sinks, deterministic=False)
        return [o, lse, *det], atomic

    seen = []
    grid_order, other = (lambda *a: (1, False)), (lambda *a: (seen.append(a[-1]) or (group, reverse)))
    ref, ref_atomic = run(grid_order)
    got, got_atomic = run(other)
    assert seen.count(False) == 2 and seen.count(True) == 2  # forward, dQ; dK/dV twice
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
    assert torch.equal(ref_atomic[1], got_atomic[1]) and torch.equal(ref_atomic[2], got_atomic[2])
    assert kfa.use_atomic_dq(d, False)  # the atomic form ran (d = 80 pads to 128, its reach)


def test_atomic_dq_in_another_order_against_float64(tiles, monkeypatch):
    # the atomic dQ with the programs in groups of 3 (head, batch) pairs, the query blocks
    # reversed, against float64: 18 pairs, sq != sk, partial tiles
    tiles(16, 16)
    monkeypatch.setattr(kfa, "program_order", lambda band, sq, sk, d, by_keys: (3, not by_keys))
    _check(torch.float32, 3, 37, 45, 6, 3, 80, causal=True, deterministic=False)


def test_attention_order_tool_puts_the_programs_in_each_order():
    """tools/attention_order.py (which measured SCHEDULE_HEADS) times the grid's order and groups
    of 8, 16 and every pair, heaviest block first whichever end it is at, and the order the
    table takes at d = 128 is among them."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "attention_order.py"
    spec = importlib.util.spec_from_file_location("attention_order", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    causal = attention_band(2048, 2048, True, None)
    later = attention_band(2048, 2048, False, (0, -1))  # the heaviest query block is the first
    got = {name: [tool._order(name, 64)(band, 2048, 2048, 128, by_keys) for band in (causal, later)
                  for by_keys in (False, True)] for name in tool.ORDERS}
    assert got == {"grid": [(1, False)] * 4, "8": [(8, True), (8, False), (8, False), (8, True)],
                   "16": [(16, True), (16, False), (16, False), (16, True)],
                   "all": [(64, True), (64, False), (64, False), (64, True)]}
    table = [kfa.program_order(causal, 2048, 2048, 128, by_keys) for by_keys in (False, True)]
    assert table in [got[name][:2] for name in tool.ORDERS]
    forms = {f: (p, det) for f, p, det in tool._forms(128)}
    assert forms == {"forward": (0.0, True), "forward_dropout": (tool.DROPOUT_P, True), "backward": (0.0, True),
                     "backward_atomic": (0.0, False), "backward_atomic_dropout": (tool.DROPOUT_P, False)}
    assert "backward_atomic" not in {f for f, _, _ in tool._forms(64)}  # no atomic dQ at d = 64 without dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_delta_in_dq_gives_the_preprocess_routes_bits(dtype, dropout_p, monkeypatch, request):
    # the deterministic backward without sinks, Delta = rowsum(dO·O) from the dQ kernel (run
    # first) against Delta from the preprocess kernel: the same float32 sums of the same tiles'
    # products, then the same kernels, so the same bits in dq, dk and dv (interpreter and GPU).
    # Odd sizes, GQA, a causal band with sq < sk, d = 24 (padded to 32)
    torch.manual_seed(11)
    b, sq, sk, hq, hkv, d = 2, 37, 45, 4, 2, 24
    q = torch.randn(b, sq, hq, d, device=DEVICE).to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, device=DEVICE).to(dtype) for _ in range(2))
    band = kfa.attention_band(sq, sk, True, None)
    seed = philox_seed(DEVICE) if dropout_p else None
    o, lse = kfa.flash_attn_fwd(q, k, v, d ** -0.5, band, seed=seed, dropout_p=dropout_p)[:2]
    do = torch.randn_like(o)
    request.addfinalizer(rt.clear_plans)  # no plan made under a patched limit outlives the test
    grads, launched = {}, {}
    monkeypatch.setattr(kfa, "DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM", 0)  # d = 24 with dropout: force the dQ kernel's
    for limit in (0, 256):
        monkeypatch.setattr(kfa, "DELTA_IN_DQ_MAX_HEAD_DIM", limit)
        rt.clear_plans()  # plans keep the route they were made with
        names = _launched_kernels(monkeypatch)
        grads[limit] = kfa.flash_attn_bwd(do, q, k, v, o, lse, d ** -0.5, band, seed=seed, dropout_p=dropout_p,
                                          deterministic=True)[:3]
        launched[limit] = [n for n in names if n in BWD_KERNELS]
    assert launched == {0: ["_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"],
                        256: ["_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"]}, launched
    for x, y in zip(grads[0], grads[256]):
        assert torch.equal(x, y)
