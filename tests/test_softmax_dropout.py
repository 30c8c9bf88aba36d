"""The attention softmax with its dropout fused: fusedlib's kernels against float64 references.

The fused op draws its Philox key from torch's generator. To compare values, a test replays
it: ``torch.manual_seed(SEED)`` before the op, then ``torch.manual_seed(SEED);
philox_seed(device)`` gives the same key, and ``softmax_dropout_mask`` the keep mask the kernels
drew with it (chapter 2's mask, checked there against a pure-Python Philox). The reference,
``unfused.masked_softmax_dropout_reference``, is keep·softmax/(1 - p') written with torch ops
in float64 (masks built with triu/tril, independently of the kernels' band arithmetic); its
autograd gradients are the oracle for the backward.

Tolerances. The kernels compute in float32 and round the output once to its dtype; the
reference uses the same mask and the same applied probability p' = round(p·2^16)/2^16, so the
differences are float32 arithmetic (exp, a tree sum of at most 1024 terms: ~10 float32 ulps of
the largest term, 6e-7 relative) plus one rounding of the output (2^-24, 2^-11, 2^-8 relative)
and of 1/(1 - p') to float32 (2^-24). conftest's TOL (1e-5, 2e-3, 1.6e-2 relative) bounds these
with a 4x margin or more. Every value is multiplied by 1/(1 - p'), so absolute errors are too:
atol is scaled by it (``assert_close(..., scale=keep_scale)``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fusedlib.kernels.softmax as ksoftmax
from fusedlib import unfused
from fusedlib.bench.ops import softmax_dropout as bench_op
from fusedlib.fusions.fused_softmax import (
    ScaledMaskedSoftmaxDropout,
    fused_scale_mask_softmax,
    fused_scale_mask_softmax_dropout,
)
from fusedlib.kernels.bias_dropout_add import KEEP_BITS, drop_threshold, dropout_scale, philox_seed
from fusedlib.kernels.launch import Tile
from fusedlib.kernels.softmax import softmax_dropout_mask
from fusedlib.transformer.enums import AttnMaskType

from conftest import DEVICE, FLOAT_DTYPES, assert_close, generator_state  # noqa: I001

SEED = 1234  # replayed seed of the op under test (inputs are drawn before it, fresh per test)
SCALE = 1.0 / math.sqrt(128)
ONLINE_BLOCK = 8  # MAX_REGISTER_BLOCK for the looping kernel's tests: tiles of 8 columns


def _p_used(p: float) -> float:
    """The probability the kernels apply: 16-bit resolution (chapter 2)."""
    return drop_threshold(p) / 2**KEEP_BITS


def _scores(shape, dtype, requires_grad=True):
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)  # rows far from uniform and from one-hot
    return x.requires_grad_(requires_grad)


def _structural(kind, sq, sk, window=None):
    """The bool mask [sq, sk] (True = masked) the mask type or window stands for, or None."""
    if window is not None:
        return unfused.sliding_window_causal_mask(sq, sk, window, device=DEVICE)
    if kind in ("causal", "padding_causal", "causal_bottom_right"):
        return unfused.causal_mask(sq, sk, device=DEVICE)
    return None


def _union(a, b):
    return b if a is None else (a if b is None else a | b)


def _check(x, mask, mask_type, p, window=None, g=None, offset=None):
    """Fused forward and backward against the float64 reference with the replayed mask.
    Returns (z, keep)."""
    x_before = x.detach().clone()
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, mask, mask_type, SCALE, p, window_size=window, softmax_offset=offset)
    assert z.dtype == x.dtype and z.shape == x.shape and z.is_contiguous() and z.data_ptr() != x.data_ptr()
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), tuple(x.shape), p)
    sq, sk = x.shape[-2:]
    full = _union(mask, _structural(mask_type.name, sq, sk, window))
    x64 = x.detach().double().requires_grad_(True)
    off64 = offset.detach().double().requires_grad_(True) if isinstance(offset, torch.Tensor) else None
    z64 = unfused.masked_softmax_dropout_reference(x64, full, SCALE, keep, _p_used(p), off64)
    ks = dropout_scale(p)
    assert_close(z, z64, x.dtype, scale=ks)
    g = torch.randn(z.shape, device=DEVICE).to(z.dtype) if g is None else g
    g_before = g.clone()
    z.backward(g)
    z64.backward(g.double())
    assert torch.equal(g, g_before), "grad_output was modified"
    assert torch.equal(x.detach(), x_before), "input was modified"
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    assert_close(x.grad, x64.grad, x.dtype, scale=ks)
    if off64 is not None:  # a sum over the b·sq rows of each head: sqrt(rows) more rounding
        assert_close(offset.grad, off64.grad, torch.float32 if x.dtype == torch.float32 else x.dtype,
                     scale=ks * math.sqrt(x.shape[0] * sq))
    return z.detach(), keep


@pytest.fixture
def online_kernel(monkeypatch):
    """Route rows longer than 8 columns to the looping kernel, in tiles of 8 (Philox's group):
    rows of 33 then span five tiles, the last one partial."""
    monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_BLOCK)


# --------------------------------------------------------------------------------------------
# Forward and backward against float64, every mask type and dtype
# --------------------------------------------------------------------------------------------

# (mask type, [b, np, sq, sk], padding mask?, window): causal square and odd; causal with
# sq < sk and sq > sk (bottom-right: the first sq - sk rows see nothing); padding; no mask with
# sk = 1 and sk = 7; a sliding window; rows of 1000 (register kernel, 1 Ki block).
CASES = [
    ("causal", (2, 3, 7, 7), False, None),
    ("causal", (1, 2, 5, 33), False, None),
    ("causal", (1, 2, 9, 7), False, None),
    ("padding", (2, 2, 7, 33), True, None),
    ("no_mask", (1, 2, 3, 1), False, None),
    ("no_mask", (2, 1, 3, 7), False, None),
    ("no_mask", (1, 2, 5, 33), False, (3, 0)),
    ("padding", (1, 1, 2, 1000), True, None),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-w{c[3]}")
def test_forward_backward_against_float64(dtype, case):
    kind, shape, padded, window = case
    b, _, sq, sk = shape
    x = _scores(shape, dtype)
    mask = None
    if padded:
        mask = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3
        mask[..., 0] = False  # every row keeps a key here; fully masked rows: their own test
    _check(x, mask, AttnMaskType[kind], 0.1, window)


@pytest.mark.parametrize("case", [
    (torch.float32, "causal", (1, 1, 3, 33), False, None),  # band edges inside and across tiles
    (torch.bfloat16, "causal", (1, 1, 4, 20), False, None),  # sq < sk
    (torch.float16, "padding", (1, 1, 2, 33), True, None),
    (torch.bfloat16, "no_mask", (1, 1, 3, 20), False, (5, 2)),
    # the same window in float32: row q's band starts at column 12 + q, inside the tile of
    # columns 8..15, so the backward's walk must start at that tile's first column for its keep
    # mask (Philox of the tile) to line up with the columns (bf16's tolerance would hide it)
    (torch.float32, "no_mask", (1, 2, 3, 20), False, (5, 2)),
], ids=lambda c: f"{str(c[0])[6:]}-{c[1]}-{'x'.join(map(str, c[2]))}-w{c[4]}")
def test_online_kernel_forward_backward(case, online_kernel):
    dtype, kind, shape, padded, window = case
    b, _, sq, sk = shape
    x = _scores(shape, dtype)
    mask = (torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3) if padded else None
    if mask is not None:
        mask[..., 5] = False
    _check(x, mask, AttnMaskType[kind], 0.3, window)


def test_softmax_offset_and_padding_causal_together():
    # the off-by-one softmax's sink logits, learnable, with a padding mask and the causal band
    b, np_, sq, sk = 2, 3, 5, 9
    x = _scores((b, np_, sq, sk), torch.float32)
    pad = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.2
    off = torch.randn(np_, device=DEVICE, requires_grad=True)
    _check(x, pad, AttnMaskType.padding_causal, 0.2, offset=off)


def test_online_kernel_softmax_offset(online_kernel):
    x = _scores((1, 2, 2, 19), torch.float32)
    off = torch.randn(2, device=DEVICE, requires_grad=True)
    _check(x, None, AttnMaskType.causal, 0.25, offset=off)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_inputs_and_grad(dtype):
    base = _scores((2, 3, 5, 26), dtype, requires_grad=False)
    x = base[..., ::2].requires_grad_(True)  # [2, 3, 5, 13], column stride 2
    assert not x.is_contiguous()
    mask = (torch.rand(2, 1, 1, 13, device=DEVICE) < 0.3).expand(2, 1, 5, 13)  # stride-0 query dim
    g = torch.randn(2, 3, 13, 5, device=DEVICE).to(dtype).transpose(-1, -2)  # non-contiguous grad
    _check(x, mask, AttnMaskType.causal, 0.1, g=g)


def test_gradcheck_float64():
    # the same key in every call of the function (gradcheck calls it many times), p = 0.5 so
    # that 1/(1 - p') = 2 is exact in the float32 scalar the kernels take
    x = torch.randn(1, 2, 3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 3, 7, device=DEVICE) < 0.3

    def fn(t):
        torch.manual_seed(SEED)
        return fused_scale_mask_softmax_dropout(t, mask, AttnMaskType.causal, 0.7, 0.5)

    assert torch.autograd.gradcheck(fn, (x,), fast_mode=True)


# --------------------------------------------------------------------------------------------
# p = 0 is the softmax; the dropout's statistics; the mask regenerated in the backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_p0_is_the_plain_fused_softmax_bitwise_and_draws_nothing(dtype):
    shape = (2, 2, 5, 12)
    x = _scores(shape, dtype)
    x_ref = x.detach().clone().requires_grad_(True)
    mask = torch.rand(2, 1, 5, 12, device=DEVICE) < 0.3
    g = torch.randn(shape, device=DEVICE).to(dtype)
    state = torch.get_rng_state()
    z = fused_scale_mask_softmax_dropout(x, mask, AttnMaskType.causal, SCALE, 0.0, window_size=(3, 0))
    assert torch.equal(torch.get_rng_state(), state), "p = 0 must draw no random numbers"
    p = fused_scale_mask_softmax(x_ref, mask, SCALE, window_size=(3, 0))
    z.backward(g)
    p.backward(g)
    assert torch.equal(z, p) and torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("zero", [0, np.float64(0.0), np.float32(0.0), -0.0], ids=["int", "np64", "np32", "neg"])
def test_a_zero_dropout_p_of_any_real_type_is_the_plain_softmax(zero):
    # dropout_p = 0 written as an int (attention_dropout=0 in a config), a numpy scalar or
    # -0.0 is 0: accepted and the plain softmax, as 0.0 is
    x = _scores((1, 2, 4, 6), torch.float32, requires_grad=False)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, zero)
    assert torch.equal(z, fused_scale_mask_softmax(x, None, SCALE, causal=True))


def test_a_learnable_sink_gets_its_gradient_when_the_scores_need_none():
    # sink logits trained on frozen scores: d sinks must come back all the same
    b, np_, sq, sk = 2, 3, 4, 9
    x = _scores((b, np_, sq, sk), torch.float32, requires_grad=False)
    off = torch.randn(np_, device=DEVICE, requires_grad=True)
    p = 0.25
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, p, softmax_offset=off)
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), tuple(x.shape), p)
    off64 = off.detach().double().requires_grad_(True)
    z64 = unfused.masked_softmax_dropout_reference(x.double(), _structural("causal", sq, sk), SCALE, keep,
                                                   _p_used(p), off64)
    g = torch.randn(z.shape, device=DEVICE)
    z.backward(g)
    z64.backward(g.double())
    assert off.grad is not None
    assert_close(off.grad, off64.grad, torch.float32, scale=dropout_scale(p) * math.sqrt(b * sq))


@pytest.mark.parametrize("p", (0.1, 0.5))
def test_kept_fraction_and_independence_across_rows_heads_batches(p):
    # x = 0, no mask: every probability is 1/sk > 0, so an output is 0 exactly where dropped
    b, np_, sq, sk = 2, 4, 16, 128
    x = torch.zeros(b, np_, sq, sk, device=DEVICE)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.no_mask, 1.0, p)
    kept = z != 0
    # kept values are exactly fp32(1/sk)·fp32(1/(1 - p')): 1/128 is exact, the scale one rounding
    ks32 = torch.tensor(dropout_scale(p), dtype=torch.float32)
    assert torch.equal(z[kept].cpu(), (ks32 / sk).expand(int(kept.sum())))
    # the kept count ~ Binomial(n, 1 - p'): within 4 sigma (a false alarm once in ~16000 seeds)
    q = 1.0 - _p_used(p)
    n = kept.numel()
    assert abs(int(kept.sum()) - n * q) <= 4 * math.sqrt(n * q * (1 - q))
    # no row is special: each keeps within 6 sigma of its share (128 rows: ~3e-7 false alarms)
    per_row = kept.sum(-1).double()
    assert (per_row - sk * q).abs().max() <= 6 * math.sqrt(sk * q * (1 - q))
    # distinct rows: the counter holds the row of [b·np·sq], so heads, batches and queries each
    # draw their own bits (two equal rows of 128 independent draws: chance < 128²·(q² + (1-q)²)^128)
    rows = kept.reshape(-1, sk)
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    # pairwise agreement between two independent masks is q² + (1 - q)² per element: across
    # heads, batches and neighbouring queries, each ~ Binomial(m, a) within 4 sigma
    a = q * q + (1 - q) * (1 - q)
    for u, v in ((kept[:, 0], kept[:, 1]), (kept[0], kept[1]), (kept[:, :, :-1], kept[:, :, 1:])):
        m = u.numel()
        assert abs(int((u == v).sum()) - m * a) <= 4 * math.sqrt(m * a * (1 - a)), (u.shape, p)


@pytest.mark.parametrize("path", ["register", "online"])
def test_backward_regenerates_the_forwards_mask(path, monkeypatch):
    # x = 0 (every p_j = 1/sk) and g = 1: the gradient of the undropped probabilities is
    # g'_j = k_j/(1 - p'), and dx_j = scale·(1/sk)·(g'_j - c) takes two values per row, high where
    # the backward kept j and low where it dropped it (gap scale/sk/(1 - p')). The backward's
    # kept set must be exactly the forward's (z != 0), read from outputs only.
    if path == "online":
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_BLOCK)
    shape = (2, 2, 3, 40) if path == "register" else (1, 1, 3, 40)
    x = torch.zeros(shape, device=DEVICE, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.no_mask, 2.0, 0.5)
    z.backward(torch.ones_like(z))
    kept_fwd = z.detach() != 0
    dx = x.grad
    mid = (dx.amax(-1, keepdim=True) + dx.amin(-1, keepdim=True)) / 2  # between the two levels
    kept_bwd = dx > mid
    assert kept_fwd.any(-1).all() and (~kept_fwd).any(-1).all(), "each row needs both levels (p = 0.5, 40 keys)"
    assert torch.equal(kept_fwd, kept_bwd)
    sk, ks = shape[-1], 2.0  # ks = 1/(1 - p') = 2 at p = 0.5
    gap = (dx.amax(-1) - dx.amin(-1)) * sk / 2.0
    assert torch.allclose(gap, torch.full_like(gap, ks), rtol=1e-5)
    # and the low level is -scale·(1/sk)·c with c = sum_j g'_j·p_j = ks·(kept count)/sk: the
    # backward's row sum used the forward's mask too (every tile of the looping kernel's pass 1)
    c = ks * kept_fwd.sum(-1) / sk
    assert torch.allclose(dx.amin(-1), -2.0 / sk * c, rtol=1e-5)


def test_manual_seed_reproduces_and_each_call_draws_a_new_mask():
    x = _scores((1, 2, 6, 24), torch.float32, requires_grad=False)
    torch.manual_seed(7)
    z1 = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.5)
    z2 = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.5)  # the generator moved on
    torch.manual_seed(7)
    z3 = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.5)
    assert torch.equal(z1, z3)
    assert not torch.equal(z1 != 0, z2 != 0)


@pytest.mark.parametrize("path", ["register", "online"])
def test_nan_stays_nan_through_the_dropout_as_in_torch(path, monkeypatch):
    # torch's dropout multiplies by the mask (0·NaN = NaN): a NaN score makes its whole row NaN,
    # dropped positions included (a select of 0 for dropped elements would put zeros in it);
    # and (the next test) a NaN gradient at a dropped position reaches its row of dx.
    if path == "online":
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_BLOCK)
    shape = (1, 2, 6, 40)
    x = _scores(shape, torch.float32, requires_grad=False)
    x[0, 1, 4, 0] = float("nan")  # key 0 is visible to every row under the causal mask
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.5)
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), shape, 0.5)
    assert (~keep[0, 1, 4]).any(), "the NaN row has dropped positions (p = 0.5, 40 keys)"
    assert z[0, 1, 4].isnan().all()
    others = torch.ones(shape, dtype=torch.bool, device=DEVICE)
    others[0, 1, 4] = False
    assert not z[others].isnan().any()


@pytest.mark.parametrize("path", ["register", "online"])
def test_a_nan_gradient_at_a_dropped_position_reaches_dx_as_in_torch(path, monkeypatch):
    if path == "online":
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_BLOCK)
    shape = (1, 2, 6, 40)
    x = _scores(shape, torch.float32)
    g = torch.randn(shape, device=DEVICE)  # fresh inputs first, then the replayed key
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), shape, 0.5)
    row, col = next((q, int((~keep[0, 0, q, :q + 1]).nonzero()[0])) for q in range(6)
                    if (~keep[0, 0, q, :q + 1]).any())  # rows of 1-6 visible keys: some drop at p = 0.5
    g[0, 0, row, col] = float("nan")
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.5)
    z.backward(g)
    assert x.grad[0, 0, row].isnan().all()
    others = torch.ones(shape, dtype=torch.bool, device=DEVICE)
    others[0, 0, row] = False
    assert not x.grad[others].isnan().any()


@pytest.mark.parametrize("path", ["register", "online"])
def test_fully_masked_rows_give_zeros_and_zero_gradient(path, monkeypatch):
    if path == "online":
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_BLOCK)
    sq, sk = 9, 11  # causal, bottom-right: every row sees keys; rows 0..4 lose them all to padding
    x = torch.randn(1, 1, sq, sk, device=DEVICE, requires_grad=True)
    mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=DEVICE)
    mask[..., :5, :] = True
    z = fused_scale_mask_softmax_dropout(x, mask, AttnMaskType.causal, SCALE, 0.3)
    z.backward(torch.randn_like(z))
    assert not z.isnan().any() and not x.grad.isnan().any()
    empty = z[..., :5, :], x.grad[..., :5, :]
    assert all(torch.equal(t, torch.zeros_like(t)) for t in empty)
    assert (z[..., 5:, :] != 0).any(-1).all(), "the other rows keep something (p = 0.3, >= 3 keys)"
    # sq > sk: the first sq - sk rows see no key by causality alone
    x = torch.randn(1, 1, 7, 4, device=DEVICE, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, SCALE, 0.3)
    z.backward(torch.randn_like(z))
    assert not z.isnan().any() and not x.grad.isnan().any()
    empty = z[..., :3, :], x.grad[..., :3, :]
    assert all(torch.equal(t, torch.zeros_like(t)) for t in empty)


def test_empty_inputs():
    # as torch's dropout, an empty input draws no random numbers (the generator stays where it
    # was, so later masks are the ones they would have been)
    for shape in [(0, 2, 3, 4), (2, 2, 0, 4), (1, 2, 3, 0)]:
        x = torch.randn(shape, device=DEVICE, requires_grad=True)
        before = generator_state()
        z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 1.0, 0.1)
        assert torch.equal(generator_state(), before)
        assert z.shape == shape
        z.sum().backward()
        assert x.grad.shape == shape
    before = generator_state()
    fused_scale_mask_softmax_dropout(torch.randn(1, 2, 3, 4, device=DEVICE), None, AttnMaskType.causal, 1.0, 0.1)
    assert not torch.equal(generator_state(), before)  # a non-empty input draws its key


def test_offset_gradient_with_no_heads():
    # np = 0 heads and a softmax_offset of 0 elements (one per head): the backward summed it to
    # one scalar and failed to reshape it ("shape '[0]' is invalid for input of size 1")
    x = torch.randn(2, 0, 3, 4, device=DEVICE, requires_grad=True)
    off = torch.zeros(0, device=DEVICE, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 1.0, 0.1, softmax_offset=off)
    z.sum().backward()
    assert z.shape == x.shape and x.grad.shape == x.shape and off.grad.shape == (0,)


def test_saves_the_scores_and_row_statistics_not_probabilities_or_a_mask():
    # what autograd keeps for the backward: x itself, the seed and 2 floats a row
    x = torch.randn(1, 2, 3, 16, device=DEVICE, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 1.0, 0.1)
    saved = z.grad_fn.saved_tensors
    assert any(t is x or (t.data_ptr() == x.data_ptr() and t.shape == x.shape) for t in saved if t is not None)
    big = [t for t in saved if t is not None and t.numel() >= x.numel() and t.data_ptr() != x.data_ptr()]
    assert not big, "no probabilities and no per-element mask are saved"
    stats = [t for t in saved if t is not None and t.shape == (2, 6)]
    assert len(stats) == 1 and stats[0].dtype == torch.float32


# --------------------------------------------------------------------------------------------
# The unfused path, the Function, bad input
# --------------------------------------------------------------------------------------------


def test_unfused_path_is_softmax_then_torch_dropout():
    x = _scores((2, 2, 4, 9), torch.bfloat16, requires_grad=False)
    mask = unfused.causal_mask(4, 9, device=DEVICE)
    torch.manual_seed(3)
    z = unfused.scale_mask_softmax_dropout(x, mask, SCALE, 0.2)
    torch.manual_seed(3)
    expected = torch.nn.functional.dropout(unfused.scale_mask_softmax(x, mask, SCALE), 0.2)
    assert torch.equal(z, expected)
    assert torch.equal(unfused.scale_mask_softmax_dropout(x, mask, SCALE, 0.2, training=False),
                       unfused.scale_mask_softmax(x, mask, SCALE))


def test_function_apply_matches_the_entry_point():
    x = _scores((1, 2, 4, 10), torch.float32, requires_grad=False)
    band = ksoftmax.causal_band(4, 10)
    torch.manual_seed(SEED)
    a = ScaledMaskedSoftmaxDropout.apply(x, None, SCALE, band, None, 0.3)
    torch.manual_seed(SEED)
    b = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal_bottom_right, SCALE, 0.3)
    assert torch.equal(a, b)


def test_largest_dropout_p_below_the_rounding_limit_is_accepted():
    # the last p whose threshold is below 2^16: accepted, and it keeps some probabilities' scale finite
    p = math.nextafter(1 - 2 ** -(KEEP_BITS + 1), 0.0)
    assert drop_threshold(p) == 2 ** KEEP_BITS - 1 and drop_threshold(math.nextafter(p, 1.0)) == 2 ** KEEP_BITS
    out = fused_scale_mask_softmax_dropout(torch.randn(1, 1, 3, 4, device=DEVICE), None, AttnMaskType.causal, 1.0, p)
    assert torch.isfinite(out).all()


def test_double_backward_raises_instead_of_a_wrong_answer():
    x = torch.randn(1, 1, 3, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 1.0, 0.2)
    g = torch.randn_like(z, requires_grad=True)
    (gx,) = torch.autograd.grad(z, x, g, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


@pytest.mark.parametrize("p, error, match", [
    (-0.1, ValueError, r"dropout_p must be in \[0, 1\)"),
    (1.0, ValueError, r"dropout_p must be in \[0, 1\)"),
    (1.5, ValueError, r"dropout_p must be in \[0, 1\)"),
    (float("nan"), ValueError, r"dropout_p must be in \[0, 1\)"),
    ("0.1", TypeError, "dropout_p must be a real number"),
    (None, TypeError, "dropout_p must be a real number"),
    (True, TypeError, "dropout_p must be a real number"),
    (torch.tensor(0.1), TypeError, "dropout_p must be a real number"),
    # below 1, but round(p·2^16) = 2^16: every probability was dropped, the output all zeros
    (1 - 2 ** -(KEEP_BITS + 1), ValueError, r"dropout_p must be in \[0, 1\) and below 1 - 2\^-17 .* rounds to 1"),
    (1 - 2 ** -(KEEP_BITS + 3), ValueError, "rounds to 1"),
    (0.9999999, ValueError, "rounds to 1"),
])
def test_bad_dropout_p_raises_naming_it(p, error, match):
    x = torch.randn(1, 1, 3, 4, device=DEVICE)
    with pytest.raises(error, match=match):
        fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 1.0, p)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(attn_mask_type="causal"), TypeError, "attn_mask_type must be an AttnMaskType"),
    (dict(input=torch.randn(2, 3, 4, device=DEVICE)), ValueError, "input must be 4-D"),
    (dict(mask=torch.zeros(1, 1, 3, 4, dtype=torch.uint8, device=DEVICE)), TypeError, "mask must have dtype"),
    (dict(scale="2"), TypeError, "scale must be a real number"),
    (dict(softmax_in_fp32=1), TypeError, "softmax_in_fp32 must be a bool"),
    (dict(scale=1e39), ValueError, "scale must be finite"),
    (dict(window_size=(2,)), ValueError, "window_size must be None or a pair"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    args = dict(input=torch.randn(1, 1, 3, 4, device=DEVICE), mask=None, attn_mask_type=AttnMaskType.causal,
                scale=1.0, dropout_p=0.1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fused_scale_mask_softmax_dropout(**args)


# --------------------------------------------------------------------------------------------
# The benchmark case builds and runs at a tiny shape
# --------------------------------------------------------------------------------------------


def test_bench_case_builds_and_its_implementations_agree_in_distribution():
    shape = (1, 2, 8, 8)
    case = bench_op.case(shape)
    assert case.op == "softmax_dropout" and case.shape == shape and case.dtype == torch.bfloat16
    assert {"fusedlib", "eager", "torch.compile"} <= {i.name for i in case.impls}
    assert [i.compile for i in case.impls if i.name == "torch.compile"] == ["static"]
    kept = 8 * 9 // 2  # causal band of [8, 8]
    assert case.bytes == {"fwd": (kept + 64) * 2 * 2, "fwd+bwd": (kept + 64) * 2 * 2 + (2 * kept + 64) * 2 * 2}
    x, mask = case.make_inputs(DEVICE, True)
    for impl in case.impls:
        if impl.name in ("fusedlib", "eager"):  # torch.compile: not on this CPU-only machine
            z = impl.fn(x, mask)
            assert z.shape == shape and z.dtype == torch.bfloat16
            z.float().sum().backward()
            assert x.grad.shape == shape
            x.grad = None
    assert bench_op.cases(torch.device("cpu"), sweep=True)[-1].shape == (1, 1, 32768, 32768)


def test_an_infinite_sink_logit_takes_the_whole_row():
    # as the plain softmax's (tests/test_softmax.py): a +inf sink gave NaN rows (inf - inf)
    x = torch.randn(2, 2, 3, 5, device=DEVICE, requires_grad=True)
    off = torch.tensor([math.inf, 0.3], device=DEVICE, requires_grad=True)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.padding, 1.0, 0.25, softmax_offset=off)
    z.backward(torch.randn_like(z))
    assert torch.equal(z[:, 0], torch.zeros_like(z[:, 0])) and torch.equal(x.grad[:, 0], torch.zeros_like(z[:, 0]))
    assert off.grad[0].item() == 0.0
    assert torch.isfinite(z).all() and torch.isfinite(x.grad).all() and torch.isfinite(off.grad).all()


# --------------------------------------------------------------------------------------------
# The applied probability, float64 statistics, a given tile
# --------------------------------------------------------------------------------------------


def test_kept_values_are_scaled_by_the_applied_probability():
    # p = 0.9 is applied as p' = round(0.9·2^16)/2^16 = 58982/65536, and kept values (forward)
    # and their gradients (backward) are scaled by 1/(1 - p'), which is 6.1e-5 relative above
    # 1/(1 - p). A scale taken from p instead of p' would multiply every kept value and every
    # gradient by the same 1 + 6.1e-5, so the norm-wise relative error would be 6.1e-5, where
    # float32's rounding over a row of 7 (a few roundings of 2^-24 each per element) stays
    # below 1e-6: the bound 2e-5 separates the two whatever values the random draws give.
    p, scale, (sq, sk) = 0.9, 1.0, (7, 7)
    ks = dropout_scale(p)
    assert abs(ks * (1 - p) - 1) > 6e-5
    x = _scores((2, 2, sq, sk), torch.float32)
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, scale, p)
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), tuple(x.shape), p)
    x64 = x.detach().double().requires_grad_(True)
    z64 = unfused.masked_softmax_dropout_reference(x64, unfused.causal_mask(sq, sk, device=DEVICE), scale, keep,
                                                   _p_used(p))
    g = torch.randn(z.shape, device=DEVICE)
    z.backward(g)
    z64.backward(g.double())
    for got, want in ((z, z64), (x.grad, x64.grad)):
        assert_close(got, want, torch.float32, scale=ks)
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-5


def test_float64_scores_keep_float64_row_statistics():
    # float64 scores are computed in float64 end to end: the row statistics the backward
    # recomputes p from (m and 1/D) are saved in float64 too (in float32 they would cost p and
    # dx ~1e-7 relative error, 1000x the float64 tolerance). scale = 0.25 and 1/(1 - p') = 2 are
    # exact in the float32 scalars the kernels take, so the only error is float64 arithmetic.
    scale, p, (sq, sk) = 0.25, 0.5, (5, 9)
    x = _scores((1, 2, sq, sk), torch.float64)
    torch.manual_seed(SEED)
    z = fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, scale, p)
    stats = [t for t in z.grad_fn.saved_tensors if t is not None and t.shape == (2, 2 * sq)]
    assert len(stats) == 1 and stats[0].dtype == torch.float64
    torch.manual_seed(SEED)
    keep = softmax_dropout_mask(philox_seed(DEVICE), tuple(x.shape), p)
    x64 = x.detach().clone().requires_grad_(True)
    z64 = unfused.masked_softmax_dropout_reference(x64, unfused.causal_mask(sq, sk, device=DEVICE), scale, keep,
                                                   _p_used(p))
    g = torch.randn(z.shape, device=DEVICE, dtype=torch.float64)
    z.backward(g)
    z64.backward(g)
    assert_close(z, z64, torch.float64)
    assert_close(x.grad, x64.grad, torch.float64)


def test_a_given_tile_reaches_both_dropout_kernels(spy_launches):
    # The kernel layer's tile argument, forward and backward: a tile of 4 rows and 8 columns on
    # rows of 20 runs the looping kernels, one row per program, on every one of the 10 rows; the
    # keep mask does not depend on the tile, so the values are the reference's with the mask of
    # the same key.
    shape, p = (1, 2, 5, 20), 0.25
    tile = Tile(BLOCK_M=4, BLOCK_N=8, num_warps=4)
    band = ksoftmax.causal_band(5, 20)
    x = _scores(shape, torch.float32, requires_grad=False)
    g = torch.randn(shape, device=DEVICE)
    seed = philox_seed(DEVICE)
    z, _, stats = ksoftmax.softmax_dropout_fwd(x, seed, p, SCALE, band=band, tile=tile)
    dx, _ = ksoftmax.softmax_dropout_bwd(g, x, stats, seed, p, SCALE, band=band, tile=tile)
    assert [c.kernel for c in spy_launches] == ["_softmax_fwd_online_kernel", "_softmax_bwd_online_kernel"]
    keep = softmax_dropout_mask(seed, shape, p)
    x64 = x.double().requires_grad_(True)
    z64 = unfused.masked_softmax_dropout_reference(x64, unfused.causal_mask(5, 20, device=DEVICE), SCALE, keep,
                                                   _p_used(p))
    z64.backward(g.double())
    ks = dropout_scale(p)
    assert_close(z, z64, torch.float32, scale=ks)
    assert_close(dx, x64.grad, torch.float32, scale=ks)
