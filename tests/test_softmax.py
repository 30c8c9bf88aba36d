"""The attention softmax family: fusedlib's Triton kernels against a float64 PyTorch reference.

The reference (``fusedlib.unfused.masked_softmax_reference``) is the definition written with
differentiable torch ops, run in float64; its autograd gradients are the oracle for every
backward, the sink-logit gradient included. Masks for the reference are built with
``triu``/``tril`` (``fusedlib.unfused.causal_mask``...), independently of the kernels' band
arithmetic.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton

import fusedlib.kernels.softmax as ksoftmax
from fusedlib import unfused
from fusedlib.fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
    attention_mask_func,
    fused_scale_mask_softmax,
    get_batch_per_block,
    get_default_causal_mask,
    get_sliding_window_causal_mask,
    megatron_kernel_availability,
)
from fusedlib.kernels.bias_dropout_add import philox_seed
from fusedlib.kernels.launch import Tile
from fusedlib.transformer.enums import AttnMaskType

from conftest import DEVICE, FLOAT_DTYPES, TOL, assert_close  # noqa: I001

SCALE = 1.0 / math.sqrt(128)  # 1/sqrt(head dim), as in the benchmark


def _scores(shape, dtype, requires_grad=True):
    # |scores| of a few units: softmax rows far from uniform, far from one-hot
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    return x.requires_grad_(requires_grad)


def _reference(x, mask, scale, g, offset=None):
    """(p, dx, d_offset) of the float64 reference; mask is the full bool mask (True = masked)."""
    x64 = x.detach().double().requires_grad_(True)
    off64 = offset.detach().double().requires_grad_(True) if isinstance(offset, torch.Tensor) else offset
    p = unfused.masked_softmax_reference(x64, mask, scale, off64)
    p.backward(g.detach().double())
    return p.detach(), x64.grad, (off64.grad if isinstance(offset, torch.Tensor) else None)


def _grad_like(p):
    return torch.randn(p.shape, device=DEVICE).to(p.dtype)


def _run(fn, x, g):
    """Forward and backward; checks that neither the input nor grad_output was modified."""
    x_before, g_before = x.detach().clone(), g.clone()
    p = fn(x)
    assert p.dtype == x.dtype and p.shape == x.shape and p.is_contiguous()
    assert p.data_ptr() != x.data_ptr()
    p.backward(g)
    assert torch.equal(g, g_before), "grad_output was modified"
    assert torch.equal(x.detach(), x_before), "input was modified"
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    return p


ONLINE_TILE = 4


@pytest.fixture
def online_kernel(monkeypatch):
    """Route rows longer than 4 columns to the looping (online) kernel, with 4-column tiles,
    so that its tile boundaries, band and masks are exercised on small CPU-sized rows (the
    interpreter runs its programs one after another: few, short rows keep this fast)."""
    monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_TILE)


# --------------------------------------------------------------------------------------------
# Megatron-core's analytic checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", [True, False])
def test_megatron_causal_equal_scores_give_one_over_i_plus_1(fusion):
    # Megatron-core's TestTorchSoftmax.test_causal_mask_equal_scores, on both paths
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, fusion, attention_mask_func, True, None)
    y = sm(torch.zeros(8, 2, 32, 32, device=DEVICE), None)
    expected = torch.tril(torch.ones(8, 2, 32, 32, device=DEVICE)) / torch.arange(1, 33, device=DEVICE).reshape(-1, 1)
    assert torch.allclose(y, expected, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("fusion", [True, False])
def test_megatron_off_by_one_equal_scores_give_one_over_i_plus_2(fusion):
    # Megatron-core's TestSoftmaxOne.test_causal_mask_equal_scores: zero sink logit adds e^0 = 1
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, fusion, attention_mask_func, True, None)
    y = sm(torch.zeros(8, 2, 32, 32, device=DEVICE), None, torch.zeros(2, device=DEVICE))
    expected = torch.tril(torch.ones(8, 2, 32, 32, device=DEVICE)) / torch.arange(2, 34, device=DEVICE).reshape(-1, 1)
    assert torch.allclose(y, expected, rtol=1e-7, atol=1e-8)


def test_softmax_one_matches_megatron_sink_concatenation_and_is_stable():
    # Megatron-core's TestSoftmaxOne: softmax(cat([x, sink]))[..., :-1]; finite for |x| = 1e10
    x = torch.tensor([[[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]]], device=DEVICE)
    off = torch.full((1,), 0.3, device=DEVICE)
    qk = torch.cat([x, off.reshape(1, -1, 1, 1).expand(1, -1, 3, -1)], dim=-1)
    assert torch.allclose(SoftmaxOne(-1, off)(x), torch.softmax(qk, dim=-1)[..., :-1], rtol=1e-6, atol=1e-7)
    big = torch.tensor([[[[1e10, -1e10, 1e10], [-1e10, 1e10, -1e10], [1e10, -1e10, 1e10]]]], device=DEVICE)
    y = SoftmaxOne(None, torch.zeros(1, device=DEVICE))(big)
    assert torch.isfinite(y).all() and ((y >= 0) & (y <= 1)).all()


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (6, 5), (5,)])
def test_softmax_one_takes_the_last_dim_by_either_index_and_refuses_the_others(shape):
    # dim=-1, None and dim = x.dim() - 1 name the same (last) dim; any other dim, x.dim()
    # included (out of range), is refused rather than taken as the last
    x = _scores(shape, torch.float32, requires_grad=False)
    want = SoftmaxOne(-1)(x)
    assert torch.equal(SoftmaxOne(None)(x), want) and torch.equal(SoftmaxOne(x.dim() - 1)(x), want)
    for dim in [d for d in (0, x.dim() - 2, x.dim(), -2) if d not in (-1, x.dim() - 1)]:
        with pytest.raises(ValueError, match=f"SoftmaxOne works over the last dim; got dim={dim}"):
            SoftmaxOne(dim)(x)


def test_softmax_one_default_sink_is_miller_s_softmax_1():
    # SoftmaxOne() adds e^0 = 1 to every denominator: p_j = e^{x_j} / (1 + sum_k e^{x_k})
    x = _scores((2, 3, 4, 5), torch.float32, requires_grad=False)
    want = torch.exp(x.double()) / (1 + torch.exp(x.double()).sum(-1, keepdim=True))
    assert_close(SoftmaxOne()(x), want, torch.float32)
    assert_close(SoftmaxOne()(x[0, 0]), want[0, 0], torch.float32)


# --------------------------------------------------------------------------------------------
# Forward and backward against the float64 reference, every dtype
# --------------------------------------------------------------------------------------------

# (attn_batches, sq, sk): square; one query (a KV-cache step: sees every key); sq < sk;
# sq > sk (the first sq - sk rows see nothing); rows of 5000 (register kernel, 8 Ki block).
# Rows of 32768 (the looping kernel at its default tile): test_long_rows.
CAUSAL_SHAPES = [(3, 17, 17), (2, 1, 9), (2, 5, 9), (2, 9, 5), (1, 2, 5000)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", CAUSAL_SHAPES)
def test_causal_forward_backward(dtype, shape):
    ab, sq, sk = shape
    x = _scores(shape, dtype)
    g = _grad_like(x)
    p = _run(lambda t: ScaledUpperTriangMaskedSoftmax.apply(t, SCALE), x, g)
    p64, dx64, _ = _reference(x, unfused.causal_mask(sq, sk, device=DEVICE), SCALE, g)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    # never read, written as zeros: the upper triangle (bottom-right aligned)
    above = p.detach()[:, unfused.causal_mask(sq, sk, device=DEVICE)]
    assert torch.equal(above, torch.zeros_like(above))


# (b, np, sq, sk, mask batch): sk = 1, odd sizes, a mask shared by the batch, rows of 5000
MASKED_SHAPES = [(2, 3, 4, 1, 2), (2, 3, 7, 13, 2), (2, 2, 6, 64, 1), (1, 2, 3, 300, 1), (1, 1, 2, 5000, 1)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", MASKED_SHAPES)
def test_masked_forward_backward(dtype, shape):
    b, np_, sq, sk, mb = shape
    x = _scores((b, np_, sq, sk), dtype)
    mask = torch.rand(mb, 1, sq, sk, device=DEVICE) < 0.3
    mask[..., 0] = False  # keep one key per row here; fully masked rows have their own tests
    g = _grad_like(x)
    p = _run(lambda t: ScaledMaskedSoftmax.apply(t, mask, SCALE), x, g)
    p64, dx64, _ = _reference(x, mask, SCALE, g)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    masked = p.detach().masked_select(mask.expand_as(p))
    assert torch.equal(masked, torch.zeros_like(masked))


@pytest.mark.parametrize("online", [False, True])
def test_masked_and_out_of_band_scores_never_leak(online, monkeypatch):
    # whatever sits above the diagonal or under the mask (NaN, inf) cannot reach the output
    if online:
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_TILE)
    x = torch.randn(1, 2, 6, 11, device=DEVICE)
    mask = torch.rand(1, 1, 6, 11, device=DEVICE) < 0.3
    hidden = mask | unfused.causal_mask(6, 11, device=DEVICE)
    poisoned = x.masked_fill(hidden & (torch.rand(1, 2, 6, 11, device=DEVICE) < 0.5), float("nan"))
    poisoned = poisoned.masked_fill(hidden & poisoned.isfinite(), float("inf"))
    p = fused_scale_mask_softmax(poisoned, mask, SCALE, causal=True)
    assert_close(p, unfused.masked_softmax_reference(x.double(), hidden, SCALE), torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 100), (2, 2, 3, 1), (1, 257)])
def test_scaled_softmax_forward_backward(dtype, shape):
    x = _scores(shape, dtype)
    g = _grad_like(x)
    p = _run(lambda t: ScaledSoftmax.apply(t, SCALE), x, g)
    p64, dx64, _ = _reference(x, None, SCALE, g)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_window_padding_and_learnable_offset_together(dtype):
    b, np_, sq, sk = 2, 3, 9, 12
    x = _scores((b, np_, sq, sk), dtype)
    pad = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.2
    off = torch.randn(np_, device=DEVICE, requires_grad=True)
    g = _grad_like(x)
    p = _run(lambda t: fused_scale_mask_softmax(t, pad, SCALE, window_size=(3, 1), softmax_offset=off), x, g)
    full = pad | unfused.sliding_window_causal_mask(sq, sk, (3, 1), device=DEVICE)
    p64, dx64, doff64 = _reference(x, full, SCALE, g, off)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    assert_close(off.grad, doff64, torch.float32 if dtype == torch.float32 else dtype, scale=math.sqrt(b * sq))


@pytest.mark.parametrize("case", [
    ("causal", torch.bfloat16, (1, 1, 2, 32768)),
    ("masked", torch.float16, (1, 1, 2, 32768)),
    ("offset", torch.float32, (1, 2, 1, 32768)),
])
def test_long_rows(case):
    # rows of 32768: the looping kernel at its default 4 Ki tile, as the benchmark sweep runs it
    kind, dtype, (b, np_, sq, sk) = case
    x = _scores((b, np_, sq, sk), dtype)
    mask = (torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3) if kind == "masked" else None
    off = torch.randn(np_, device=DEVICE, requires_grad=True) if kind == "offset" else None
    g = _grad_like(x)
    p = _run(lambda t: fused_scale_mask_softmax(t, mask, SCALE, causal=kind == "causal", softmax_offset=off), x, g)
    full = unfused.causal_mask(sq, sk, device=DEVICE) if kind == "causal" else mask
    p64, dx64, doff64 = _reference(x, full, SCALE, g, off)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    if off is not None:
        assert_close(off.grad, doff64, dtype)


def test_online_kernel_every_feature(online_kernel):
    # rows of 10 in tiles of 4: band edges inside and across tiles, mask, sink, sq > sk rows
    for sq, sk, causal in [(3, 10, True), (7, 5, True), (3, 10, False), (2, 7, False)]:
        x = _scores((1, 2, sq, sk), torch.float32)
        pad = torch.rand(1, 1, sq, sk, device=DEVICE) < 0.25
        off = torch.randn(2, device=DEVICE, requires_grad=True)
        g = _grad_like(x)
        p = _run(lambda t: fused_scale_mask_softmax(t, pad, SCALE, causal=causal, softmax_offset=off), x, g)
        full = pad | unfused.causal_mask(sq, sk, device=DEVICE) if causal else pad
        p64, dx64, doff64 = _reference(x, full, SCALE, g, off)
        assert_close(p, p64, torch.float32)
        assert_close(x.grad, dx64, torch.float32)
        assert_close(off.grad, doff64, torch.float32, scale=math.sqrt(sq))


def test_online_kernel_window_and_bf16(online_kernel):
    x = _scores((2, 1, 3, 14), torch.bfloat16)
    g = _grad_like(x)
    p = _run(lambda t: fused_scale_mask_softmax(t, None, SCALE, window_size=(5, 0)), x, g)
    p64, dx64, _ = _reference(x, unfused.sliding_window_causal_mask(3, 14, (5, 0), device=DEVICE), SCALE, g)
    assert_close(p, p64, torch.bfloat16)
    assert_close(x.grad, dx64, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Fully masked rows: zeros and zero gradient, on every path
# --------------------------------------------------------------------------------------------


def _assert_zero_rows(p, grad, rows):
    assert not torch.isnan(p).any() and not torch.isnan(grad).any()
    assert torch.equal(p.detach()[rows], torch.zeros_like(p.detach()[rows])), "a fully masked row is not zero"
    assert torch.equal(grad[rows], torch.zeros_like(grad[rows])), "a fully masked row has a gradient"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("path", ["ScaledMaskedSoftmax", "fused", "fallback", "fused+offset", "fallback+offset",
                                  "online", "online+offset"])
def test_fully_masked_row_gives_zeros_and_zero_gradient(dtype, path, monkeypatch):
    if path.startswith("online"):
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_TILE)
    b, np_, sq, sk = 2, 2, 5, 24
    if path.startswith("online"):
        np_, sq, sk = 1, 3, 10  # the interpreter runs one program per row here: keep few
    x = _scores((b, np_, sq, sk), dtype)
    mask = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3
    mask[0, 0, 1] = True  # batch 0, query 1: every key masked
    mask[1, 0, sq - 1] = True
    rows = mask.expand(b, np_, sq, sk).all(-1)  # [b, np, sq]
    off = torch.randn(np_, device=DEVICE, requires_grad=True) if path.endswith("offset") else None
    if path == "ScaledMaskedSoftmax":
        p = ScaledMaskedSoftmax.apply(x, mask, SCALE)
    else:
        fusion = not path.startswith("fallback")
        in16, inb16 = dtype == torch.float16, dtype == torch.bfloat16
        sm = FusedScaleMaskSoftmax(in16, inb16, AttnMaskType.padding, fusion, attention_mask_func, True, SCALE)
        p = sm(x, mask, off)
    p.backward(_grad_like(p))
    _assert_zero_rows(p, x.grad, rows)
    p64, _, _ = _reference(x, mask, SCALE, torch.zeros_like(p), off)
    assert_close(p, p64, dtype)
    if off is not None:
        assert off.grad is not None and torch.isfinite(off.grad).all()


def test_causal_rows_before_the_keys_are_zero():
    # sq > sk: with the diagonal bottom-right, queries 0 .. sq-sk-1 see no key
    x = _scores((2, 7, 4), torch.float32)
    p = ScaledUpperTriangMaskedSoftmax.apply(x, 1.0)
    p.backward(torch.randn_like(p))
    _assert_zero_rows(p, x.grad, (slice(None), slice(0, 3)))
    assert torch.allclose(p.detach()[:, 3:].sum(-1), torch.ones(2, 4, device=DEVICE), atol=1e-6)


# --------------------------------------------------------------------------------------------
# sq != sk under the causal mask (documented: diagonal aligned bottom-right)
# --------------------------------------------------------------------------------------------


def test_causal_sq_not_sk_is_bottom_right_on_every_path():
    for sq, sk in [(1, 6), (3, 8), (8, 3)]:
        x = torch.randn(2, 2, sq, sk, device=DEVICE)
        want = unfused.masked_softmax_reference(x.double(), unfused.causal_mask(sq, sk, device=DEVICE), 1.0)
        for fusion in (True, False):
            sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, fusion, attention_mask_func, True, None)
            assert_close(sm(x, None), want, torch.float32)
        assert_close(ScaledUpperTriangMaskedSoftmax.apply(x.reshape(4, sq, sk), 1.0).view(2, 2, sq, sk), want,
                     torch.float32)
    # one query (a KV-cache step) sees every key, as Megatron-core's fallback does (mask None)
    x = torch.randn(1, 1, 1, 6, device=DEVICE)
    assert_close(ScaledUpperTriangMaskedSoftmax.apply(x[0], 1.0), torch.softmax(x[0].double(), -1), torch.float32)


def test_masks_match_megatron_definitions():
    assert torch.equal(get_default_causal_mask(5, device=DEVICE), torch.triu(torch.ones(5, 5, device=DEVICE), 1).bool())
    for sq, skv, w in [(8, 8, (3, 0)), (4, 9, (2, 1)), (9, 4, (0, 0))]:
        # Megatron-core's get_sliding_window_causal_mask, written out
        m = torch.ones(sq, skv, dtype=torch.bool, device=DEVICE)
        want = ~torch.tril(torch.triu(m, diagonal=skv - sq - w[0]), diagonal=skv - sq + w[1])
        assert torch.equal(get_sliding_window_causal_mask(sq, skv, w, device=DEVICE), want)
    # -1: unbounded on that side
    assert torch.equal(get_sliding_window_causal_mask(5, 5, (-1, 0), device=DEVICE), get_default_causal_mask(5, device=DEVICE))


# --------------------------------------------------------------------------------------------
# The fallback and the kernel agree on every mask type
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_type", list(AttnMaskType))
@pytest.mark.parametrize("variant", ["mask", "no mask", "window", "offset"])
def test_fallback_and_kernel_agree(dtype, mask_type, variant):
    b, np_, sq, sk = 2, 2, 6, 10
    x = _scores((b, np_, sq, sk), dtype)
    x2 = x.detach().clone().requires_grad_(True)
    mask = None
    if variant != "no mask":
        mask = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3
        mask[1, 0, 2] = True  # one fully masked row
    window = (2, 0) if variant == "window" else None
    off = torch.randn(np_, device=DEVICE, requires_grad=True) if variant == "offset" else None
    off2 = off.detach().clone().requires_grad_(True) if off is not None else None
    in16, inb16 = dtype == torch.float16, dtype == torch.bfloat16
    fused = FusedScaleMaskSoftmax(in16, inb16, mask_type, True, attention_mask_func, True, SCALE, window)
    torch_path = FusedScaleMaskSoftmax(in16, inb16, mask_type, False, attention_mask_func, True, SCALE, window)
    g = _grad_like(x)
    p1, p2 = fused(x, mask, off), torch_path(x2, mask, off2)
    p1.backward(g)
    p2.backward(g)
    assert_close(p1, p2.double(), dtype)
    assert_close(x.grad, x2.grad.double(), dtype)
    if off is not None:
        assert_close(off.grad, off2.grad.double(), dtype, scale=math.sqrt(b * sq))
    # and both are right
    full = mask
    causal = mask_type.name in ("causal", "padding_causal", "causal_bottom_right")
    structural = (unfused.sliding_window_causal_mask(sq, sk, window, device=DEVICE) if window
                  else unfused.causal_mask(sq, sk, device=DEVICE) if causal else None)
    if structural is not None:
        full = structural if full is None else full | structural
    p64, _, _ = _reference(x, full, SCALE, g, off)
    assert_close(p1, p64, dtype)


def test_fallback_never_modifies_input_with_megatrons_in_place_mask_func():
    def in_place_mask_func(scores, mask):  # Megatron-core's attention_mask_func fills in place
        scores.masked_fill_(mask, -10000.0)
        return scores

    x = torch.randn(1, 2, 4, 4, device=DEVICE)
    before = x.clone()
    mask = torch.rand(1, 1, 4, 4, device=DEVICE) < 0.5
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, False, in_place_mask_func, False, None)
    sm(x, mask)
    assert torch.equal(x, before)


def test_megatron_attn_mask_type_accepted_by_name():
    import enum

    class OtherAttnMaskType(enum.Enum):  # stands in for megatron.core.transformer.enums.AttnMaskType
        causal = 2

    sm = FusedScaleMaskSoftmax(False, False, OtherAttnMaskType.causal, True, attention_mask_func, True, None)
    y = sm(torch.zeros(1, 1, 3, 3, device=DEVICE), None)
    assert torch.equal(y[0, 0, 0], torch.tensor([1.0, 0.0, 0.0], device=DEVICE))


# --------------------------------------------------------------------------------------------
# The learnable offset's gradient
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_learnable_offset_gradient(dtype):
    b, np_, sq, sk = 3, 4, 5, 33
    x = _scores((b, np_, sq, sk), dtype)
    off = torch.nn.Parameter(torch.randn(np_, device=DEVICE))
    g = _grad_like(x)
    p = _run(SoftmaxOne(-1, off), x, g)
    p64, dx64, doff64 = _reference(x, None, 1.0, g, off)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    assert off.grad.dtype == torch.float32 and off.grad.shape == (np_,)
    # summed over b·sq rows in float32 from p_sink saved in float32: error of a sum of rows
    atol = TOL[torch.float32][0] if dtype == torch.float32 else TOL[dtype][0]
    torch.testing.assert_close(off.grad.double(), doff64, atol=atol * math.sqrt(b * sq), rtol=TOL[dtype][1])


@pytest.mark.parametrize("causal", [False, True])
def test_learnable_offset_gets_its_gradient_when_the_scores_need_none(causal):
    # sink logits trained on frozen scores: d offset all the same, per head and shared
    b, np_, sq, sk = 2, 3, 4, 9
    x = _scores((b, np_, sq, sk), torch.float32, requires_grad=False)
    mask = unfused.causal_mask(sq, sk, device=DEVICE) if causal else None
    for n in (np_, 1):
        off = torch.randn(n, device=DEVICE, requires_grad=True)
        p = fused_scale_mask_softmax(x, None, SCALE, causal=causal, softmax_offset=off)
        g = _grad_like(p)
        p.backward(g)
        _, _, doff64 = _reference(x, mask, SCALE, g, off)
        assert off.grad is not None and off.grad.shape == (n,)
        torch.testing.assert_close(off.grad.double(), doff64, atol=TOL[torch.float32][0] * math.sqrt(b * np_ * sq),
                                   rtol=TOL[torch.float32][1])


def _poison_allocations(monkeypatch):
    """torch.empty and torch.empty_like hand out NaN-filled floating buffers for the rest of the
    test: a result left unwritten shows as NaN, not as whatever memory the allocator returns."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned)


def test_offset_gradient_without_keys_is_zero(monkeypatch):
    # sk = 0: each row's whole probability sits on the sink, so nothing flows back to the offset
    # (nor to the empty scores)
    _poison_allocations(monkeypatch)
    for n in (3, 1):  # per head, shared
        x = torch.randn(2, 3, 4, 0, device=DEVICE, requires_grad=True)
        off = torch.randn(n, device=DEVICE, requires_grad=True)
        p = fused_scale_mask_softmax(x, None, SCALE, softmax_offset=off)
        assert p.shape == x.shape
        p.backward(torch.ones_like(p))
        assert x.grad.shape == x.shape and torch.equal(off.grad, torch.zeros_like(off))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_without_keys_return_what_fully_masked_rows_do(dtype, monkeypatch):
    # sk = 0 launches no kernel, yet softmax_fwd returns p_sink and softmax_dropout_fwd also the
    # row statistics for each of the b·np·sq rows: they equal the kernels' for rows of 2 keys
    # that are both masked (p_sink 1 for a finite or +inf sink logit, 0 for -inf, NaN for NaN),
    # per head and shared, with and without a sink
    _poison_allocations(monkeypatch)
    off = torch.tensor([0.5, -math.inf, math.nan, math.inf], device=DEVICE, dtype=dtype)
    masked = torch.ones(2, device=DEVICE, dtype=torch.bool)  # (True: masked) broadcast over the rows
    seed = philox_seed(DEVICE)
    for shape, o in (((2, 4, 3), off), ((2, 4, 3), off[:1]), ((2, 4, 3), None)):
        empty = torch.randn(*shape, 0, device=DEVICE, dtype=dtype)
        full = torch.randn(*shape, 2, device=DEVICE, dtype=dtype)
        runs = [(ksoftmax.softmax_fwd(empty, offset=o), ksoftmax.softmax_fwd(full, mask=masked, offset=o)),
                (ksoftmax.softmax_dropout_fwd(empty, seed, 0.1, offset=o),
                 ksoftmax.softmax_dropout_fwd(full, seed, 0.1, mask=masked, offset=o))]
        for got, want in runs:
            assert got[0].shape == empty.shape
            for a, b in zip(got[1:], want[1:]):  # p_sink (None without a sink), stats
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (o, a, b)


def test_sink_softmax_with_no_heads_on_every_path():
    # np = 0 with a per-head offset of no element: an empty result on the fused and both unfused
    # paths (Megatron's SoftmaxOne and the masked reference), as any other np gives its own
    x = torch.randn(2, 0, 4, 5, device=DEVICE)
    off = torch.zeros(0, device=DEVICE)
    for out in (fused_scale_mask_softmax(x, None, SCALE, softmax_offset=off), unfused.softmax_one(x, off),
                unfused.scale_mask_softmax(x, None, SCALE, softmax_offset=off)):
        assert out.shape == x.shape


def test_offset_gradient_is_minus_sink_probability_times_sum_gp():
    # d o = -sum_rows p_sink·sum_j g_j p_j, with p_sink = e^o / D: checked by hand on one row
    x = torch.tensor([[[[0.5, -1.0, 2.0]]]], device=DEVICE, dtype=torch.float64, requires_grad=True)
    o = torch.tensor([0.7], device=DEVICE, dtype=torch.float64, requires_grad=True)
    g = torch.tensor([[[[1.0, -2.0, 0.5]]]], device=DEVICE, dtype=torch.float64)
    p = fused_scale_mask_softmax(x, softmax_offset=o)
    p.backward(g)
    e = torch.exp(torch.tensor([0.5, -1.0, 2.0, 0.7], dtype=torch.float64))
    p_all = e / e.sum()
    c = (g.flatten().cpu() * p_all[:3]).sum()
    assert abs(o.grad.item() - (-p_all[3] * c).item()) < 1e-12


def test_scalar_fixed_offset_and_shared_learnable_offset():
    x = _scores((2, 3, 4, 9), torch.float32)
    g = _grad_like(x)
    p = SoftmaxOne(None, 0.0)(x)  # fixed: Miller's softmax_1
    assert_close(p, unfused.masked_softmax_reference(x.detach().double(), None, 1.0, 0.0), torch.float32)
    shared = torch.nn.Parameter(torch.tensor([0.4], device=DEVICE))
    p = _run(SoftmaxOne(-1, shared), x, g)
    p64, dx64, doff64 = _reference(x, None, 1.0, g, shared)
    assert_close(p, p64, torch.float32)
    assert_close(shared.grad, doff64, torch.float32, scale=math.sqrt(24))
    y = SoftmaxOne(-1, 0.0)(torch.randn(5, 7, device=DEVICE))  # any [..., sk] with a scalar offset
    assert y.shape == (5, 7)


def test_sink_lets_a_head_attend_to_nothing():
    # scores far below the sink logit: the row sums to ~0 rather than being forced to 1
    x = torch.full((1, 1, 2, 8), -20.0, device=DEVICE)
    p = SoftmaxOne(-1, torch.zeros(1, device=DEVICE))(x)
    assert (p.sum(-1) < 1e-6).all()
    assert torch.allclose(torch.softmax(x, -1).sum(-1), torch.ones(1, 1, 2, device=DEVICE))


# --------------------------------------------------------------------------------------------
# gradcheck in float64 (the kernels compute in float64 for float64 inputs)
# --------------------------------------------------------------------------------------------


def test_gradcheck_float64():
    kw = dict(device=DEVICE, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 2, 3, 4, **kw)
    off = torch.randn(2, **kw)
    mask = torch.rand(1, 1, 3, 4, device=DEVICE) < 0.3
    assert torch.autograd.gradcheck(lambda t, o: fused_scale_mask_softmax(t, mask, 0.7, causal=True, softmax_offset=o),
                                    (x, off))
    # fast mode (a random projection of the Jacobian): fewer interpreted launches, same kernels
    assert torch.autograd.gradcheck(lambda t: ScaledUpperTriangMaskedSoftmax.apply(t, 0.5), (torch.randn(2, 4, 6, **kw),),
                                    fast_mode=True)
    assert torch.autograd.gradcheck(lambda t: ScaledMaskedSoftmax.apply(t, mask, 1.3), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda t: ScaledSoftmax.apply(t, 2.0), (torch.randn(3, 4, **kw),), fast_mode=True)


def test_gradcheck_float64_online(online_kernel):
    kw = dict(device=DEVICE, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 2, 2, 7, **kw)
    off = torch.randn(2, **kw)
    assert torch.autograd.gradcheck(lambda t, o: fused_scale_mask_softmax(t, None, 0.7, causal=True, softmax_offset=o),
                                    (x, off), fast_mode=True)


# --------------------------------------------------------------------------------------------
# Properties, layouts, edge sizes
# --------------------------------------------------------------------------------------------


def test_rows_sum_to_one_and_shift_invariance():
    x = _scores((3, 5, 70), torch.float32, requires_grad=False)
    p = ScaledSoftmax.apply(x, 1.0)
    assert torch.allclose(p.sum(-1), torch.ones(3, 5, device=DEVICE), atol=1e-6)
    shift = 50 * torch.randn(3, 5, 1, device=DEVICE)
    assert torch.allclose(ScaledSoftmax.apply(x + shift, 1.0), p, atol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_inputs_and_grads(dtype):
    base = _scores((2, 3, 7, 24), dtype, requires_grad=False)
    x = base[..., ::2].requires_grad_(True)  # [2, 3, 7, 12], column stride 2
    assert not x.is_contiguous()
    mask = (torch.rand(2, 1, 1, 12, device=DEVICE) < 0.3).expand(2, 1, 7, 12)  # stride-0 query dim
    g = torch.randn(2, 3, 12, 7, device=DEVICE).to(dtype).transpose(-1, -2)  # non-contiguous grad
    p = _run(lambda t: fused_scale_mask_softmax(t, mask, SCALE, causal=True), x, g)
    full = mask | unfused.causal_mask(7, 12, device=DEVICE)
    p64, dx64, _ = _reference(x, full, SCALE, g)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)
    # a transposed 3-D input, and an expanded gradient (what .sum().backward() sends)
    xt = _scores((2, 9, 9), dtype, requires_grad=False).transpose(-1, -2).requires_grad_(True)
    pt = ScaledUpperTriangMaskedSoftmax.apply(xt, SCALE)
    pt.sum().backward()
    p64, dx64, _ = _reference(xt, unfused.causal_mask(9, 9, device=DEVICE), SCALE, torch.ones(2, 9, 9, device=DEVICE))
    assert_close(pt, p64, dtype)
    assert_close(xt.grad, dx64, dtype)


def test_empty_inputs():
    for shape in [(0, 2, 3, 4), (2, 2, 0, 4), (1, 2, 3, 0)]:
        x = torch.randn(shape, device=DEVICE, requires_grad=True)
        p = fused_scale_mask_softmax(x, None, 1.0, causal=True)
        assert p.shape == shape
        p.sum().backward()
        assert x.grad.shape == shape
    x = torch.randn(2, 3, 0, device=DEVICE, requires_grad=True)
    assert ScaledSoftmax.apply(x, 1.0).shape == (2, 3, 0)


def test_kernel_settings_table():
    # the structure of the tables, not their tuned values
    # (a tile narrower than the row's next power of two runs the looping kernel)
    for sk in (1, 7, 100, 2048, 5000, 16384):
        tile = ksoftmax.softmax_tile(sk)
        assert tile.BLOCK_N == triton.next_power_of_2(sk) and tile.BLOCK_M >= 1
    for sk in (16385, 32768):
        tile = ksoftmax.softmax_tile(sk)
        assert tile.BLOCK_N < triton.next_power_of_2(sk) and tile.BLOCK_M == 1
    assert ksoftmax.softmax_tile(21, max_register_block=8).BLOCK_N == 8
    assert ksoftmax.causal_band(4, 4) == (-4, 0)
    assert ksoftmax.causal_band(9, 5) == (-9, -4)  # every row's lower edge below column 0
    assert ksoftmax.window_band(4, 6, (2, 1)) == (0, 3)


# --------------------------------------------------------------------------------------------
# Megatron-core's availability rule, and fusedlib's
# --------------------------------------------------------------------------------------------


def test_megatron_batch_per_block_and_availability_rule():
    assert get_batch_per_block(2048, 2048, 4, 32) == 4  # one warp a row, 4 warps a block
    assert get_batch_per_block(64, 64, 1, 1) == 8  # rows <= 128 are packed two per warp
    assert get_batch_per_block(8, 8, 1, 1) == 32  # an 8-wide row uses 8 lanes: 16 warps' worth
    causal, pad = AttnMaskType.causal, AttnMaskType.padding
    assert megatron_kernel_availability(causal, True, True, 4, 32, 2048, 2048) == (True, "")
    cases = [
        ((causal, True, False, 4, 32, 2048, 2048), "scaled_masked_softmax_fusion is False"),
        ((causal, False, True, 4, 32, 2048, 2048), "not fp16/bf16"),
        ((causal, True, True, 4, 32, 8192, 8192), "outside 16 < sk <= 4096"),
        ((causal, True, True, 4, 32, 16, 16), "outside 16 < sk <= 4096"),
        ((pad, True, True, 4, 32, 2046, 2048), "multiples of 4"),
        ((causal, True, True, 3, 1, 2048, 2048), "b·np = 3 must be a multiple of 4"),
        ((pad, True, True, 4, 32, 36, 64), "sq = 36 is not a multiple of batch_per_block = 8"),
    ]
    for args, why in cases:
        ok, reason = megatron_kernel_availability(*args)
        assert not ok and why in reason, (args, reason)
    ok, reason = megatron_kernel_availability(causal, True, True, 4, 32, 2048, 2048, softmax_offset=torch.zeros(32))
    assert not ok and "softmax_offset" in reason


def test_fusedlib_kernel_available_for_any_shape_and_dtype():
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
    for b, np_, sq, sk in [(1, 1, 1, 1), (3, 5, 7, 5000), (1, 1, 2, 32768)]:
        assert sm.is_kernel_available(None, b, np_, sq, sk)
    off = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, None)
    assert not off.is_kernel_available(None, 4, 32, 2048, 2048)


def test_attn_mask_type_values_match_megatron():
    assert [(m.name, m.value) for m in AttnMaskType] == [
        ("padding", 1), ("causal", 2), ("no_mask", 3), ("padding_causal", 4), ("arbitrary", 5),
        ("causal_bottom_right", 6)]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _fsm(**kw):
    args = dict(input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.padding,
                scaled_masked_softmax_fusion=True, mask_func=attention_mask_func, softmax_in_fp32=True, scale=None)
    args.update(kw)
    return FusedScaleMaskSoftmax(**args)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ScaledUpperTriangMaskedSoftmax.apply(torch.randn(2, 3, 3, 3, device=DEVICE), 1.0), ValueError,
         "inputs must be 3-D"),
        (lambda: ScaledMaskedSoftmax.apply(torch.randn(2, 3, 3, device=DEVICE), None, 1.0), ValueError,
         "inputs must be 4-D"),
        (lambda: ScaledSoftmax.apply(torch.ones(2, 3, dtype=torch.int32, device=DEVICE), 1.0), TypeError,
         "inputs must have dtype"),
        (lambda: ScaledSoftmax.apply([1.0, 2.0], 1.0), TypeError, "inputs must be a torch.Tensor"),
        (lambda: ScaledSoftmax.apply(torch.randn(2, 3, device=DEVICE), "1"), TypeError, "scale must be a real number"),
        # a bool is no scale (True would read as 1): refused, as torch refuses it for a float argument
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), scale=True), TypeError,
         "scale must be a real number or None, got bool"),
        (lambda: _fsm(scale=True), TypeError, "scale must be a real number or None, got bool"),
        (lambda: ScaledSoftmax.apply(torch.randn(2, 3, device=DEVICE), float("nan")), ValueError, "scale must be finite"),
        (lambda: ScaledMaskedSoftmax.apply(torch.randn(1, 2, 3, 4, device=DEVICE),
                                           torch.zeros(1, 1, 3, 4, dtype=torch.uint8, device=DEVICE), 1.0),
         TypeError, r"mask must have dtype bool"),
        (lambda: ScaledMaskedSoftmax.apply(torch.randn(2, 2, 3, 4, device=DEVICE),
                                           torch.zeros(3, 1, 3, 4, dtype=torch.bool, device=DEVICE), 1.0),
         ValueError, r"does not broadcast to the scores' shape \[2, 2, 3, 4\]"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 3, 2, 2, device=DEVICE), softmax_offset=torch.zeros(2, device=DEVICE)),
         ValueError, "softmax_offset must have 1 or np = 3 elements"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 3, 2, 2, device=DEVICE), window_size=(2,)), ValueError,
         "window_size must be None or a pair"),
        (lambda: _fsm(input_in_fp16=True, input_in_bf16=True), ValueError, "both fp16 and bf16"),
        (lambda: _fsm(softmax_in_fp32=False, scale=2.0), ValueError, "softmax should be in fp32 when scaled"),
        (lambda: _fsm(attn_mask_type="causal"), TypeError, "attn_mask_type must be an AttnMaskType"),
        (lambda: _fsm(mask_func=None), TypeError, "mask_func must be callable"),
        (lambda: _fsm()(torch.randn(2, 3, 3, device=DEVICE), None), ValueError, "input must be 4-D"),
        (lambda: _fsm(input_in_bf16=True)(torch.randn(1, 1, 3, 3, device=DEVICE), None), ValueError,
         "input_in_bf16=True but input has dtype float32"),
        (lambda: SoftmaxOne(1, 0.0)(torch.randn(2, 3, 4, device=DEVICE)), ValueError, "works over the last dim"),
        (lambda: SoftmaxOne(-1, torch.zeros(3, device=DEVICE))(torch.randn(3, 4, device=DEVICE)), ValueError,
         "per-head denominator_offset needs x of shape"),
        # SoftmaxOne's offset is named as SoftmaxOne names it (the messages said softmax_offset)
        (lambda: SoftmaxOne(-1, torch.zeros(3, device=DEVICE))(torch.randn(1, 2, 3, 4, device=DEVICE)), ValueError,
         r"^denominator_offset must have 1 or np = 2 elements"),
        (lambda: SoftmaxOne(-1, torch.zeros(0, device=DEVICE))(torch.randn(3, 4, device=DEVICE)), ValueError,
         r"^denominator_offset must have 1 or np = 1 elements"),
        (lambda: SoftmaxOne(-1, torch.zeros(2, dtype=torch.long, device=DEVICE))(
            torch.randn(1, 2, 3, 4, device=DEVICE)), TypeError, r"^denominator_offset must have dtype in"),
        (lambda: SoftmaxOne(-1, "0.5")(torch.randn(3, 4, device=DEVICE)), TypeError,
         r"^denominator_offset must be a real number, a floating tensor or None, got str"),
        (lambda: SoftmaxOne(-1, math.nan)(torch.randn(3, 4, device=DEVICE)), ValueError,
         r"^denominator_offset must be a finite number"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 4, device=DEVICE), softmax_offset=True), TypeError,
         r"^softmax_offset must be a real number, a floating tensor or None, got bool"),
        # SoftmaxOne's dim: True passed as dim 1 of a 2-D input, 1.0 as well
        (lambda: SoftmaxOne(True), TypeError, r"^dim must be an int \(the last dim: -1\) or None, got bool True"),
        (lambda: SoftmaxOne(1.0), TypeError, r"^dim must be an int \(the last dim: -1\) or None, got float 1.0"),
        # causal: a non-bool was read as its truth value ("no" as True, None as False)
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), causal="no"), TypeError,
         "causal must be a bool, got str"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), causal=None), TypeError,
         "causal must be a bool, got NoneType"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), causal=1), TypeError,
         "causal must be a bool, got int"),
        # a scale finite in float64 but inf in the kernels' float32: the output was all NaN
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), scale=1e39), ValueError,
         "scale must be finite, with |scale| <= float32's max"),
        (lambda: fused_scale_mask_softmax(torch.randn(1, 2, 3, 3, device=DEVICE), scale=-1e39), ValueError,
         "scale must be finite"),
        (lambda: ScaledSoftmax.apply(torch.randn(2, 3, device=DEVICE), 1e39), ValueError, "scale must be finite"),
        (lambda: _fsm(scale=1e39), ValueError, "scale must be finite"),
        (lambda: _fsm(scaled_masked_softmax_fusion="yes"), TypeError, "scaled_masked_softmax_fusion must be a bool"),
        (lambda: _fsm(input_in_fp16=None), TypeError, "input_in_fp16 must be a bool"),
        (lambda: _fsm(softmax_in_fp32="False"), TypeError, "softmax_in_fp32 must be a bool"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_bool_causal_is_accepted():
    import numpy as np

    x = torch.randn(1, 2, 3, 4, device=DEVICE)
    assert torch.equal(fused_scale_mask_softmax(x, causal=np.bool_(True)), fused_scale_mask_softmax(x, causal=True))
    assert torch.equal(fused_scale_mask_softmax(x, causal=np.bool_(False)), fused_scale_mask_softmax(x))


def test_double_backward_raises_instead_of_a_wrong_answer():
    x = torch.randn(1, 1, 3, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    p = fused_scale_mask_softmax(x, None, 1.0, causal=True)
    g = torch.randn_like(p, requires_grad=True)  # e.g. a gradient penalty differentiates through g
    (gx,) = torch.autograd.grad(p, x, g, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_scaled_masked_softmax_refuses_a_mask_on_another_device():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    x = torch.randn(1, 1, 3, 4, device=DEVICE)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool, device=other)
    with pytest.raises(ValueError, match=f"one device, got inputs on .*, mask on {other}"):
        ScaledMaskedSoftmax.apply(x, mask, 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_float_offset_is_held_in_float32_for_half_scores(dtype):
    # scores near 300 (exact in both dtypes) and a sink logit of 301.1, which neither half
    # dtype holds (float16: 301.0, bfloat16: 302.0): the logit is held in float32, the kernels'
    # compute dtype, so the sink keeps its weight e^1.1 against each key's e^0
    x = (300 + 2 * torch.randint(-2, 3, (2, 3, 4, 7), device=DEVICE)).to(dtype)
    g = _grad_like(x)
    p64, dx64, _ = _reference(x, None, 1.0, g, 301.1)
    x.requires_grad_(True)
    p = fused_scale_mask_softmax(x, softmax_offset=301.1)
    p.backward(g)
    assert_close(p, p64, dtype)
    assert_close(x.grad, dx64, dtype)


def test_mixed_devices_raise():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    x = torch.randn(1, 1, 3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="one device, got input on"):
        fused_scale_mask_softmax(x, torch.zeros(1, 1, 3, 4, dtype=torch.bool, device=other))


@pytest.mark.parametrize("path", ["register", "online"])
@pytest.mark.parametrize("case", ["nan_offset", "nan_score", "nan_score_masked"])
def test_nan_propagates_like_torch(path, case, monkeypatch):
    # A NaN must never be hidden behind zeros: the fused kernels give what the fallback (and
    # torch.softmax) give, NaN for NaN, forward and backward, offset gradient included.
    if path == "online":
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_TILE)
    x0 = torch.randn(1, 2, 2, 6, device=DEVICE)
    mask = None
    off0 = torch.randn(2, device=DEVICE)
    if case == "nan_offset":
        off0[1] = float("nan")  # head 1: every row NaN; head 0 finite
    else:
        x0[0, 0, 1, 3] = float("nan")  # one row NaN, the others finite
        if case == "nan_score_masked":  # masked: the NaN is never read, the row stays finite
            mask = torch.zeros(1, 1, 2, 6, dtype=torch.bool, device=DEVICE)
            mask[0, 0, 1, 3] = True
    g = torch.randn(1, 2, 2, 6, device=DEVICE)
    out = {}
    for fusion in (True, False):
        x = x0.clone().requires_grad_(True)
        off = off0.clone().requires_grad_(True) if "offset" in case else None
        p = _fsm(scaled_masked_softmax_fusion=fusion)(x, mask, off)
        p.backward(g)
        out[fusion] = (p.detach(), x.grad, off.grad if off is not None else None)
    if case == "nan_score":
        expected = torch.softmax(x0, dim=-1)
        assert expected[0, 0, 1].isnan().all() and not expected[0, 0, 0].isnan().any()
        torch.testing.assert_close(out[True][0], expected, equal_nan=True)
    for fused, ref in zip(out[True], out[False]):
        if ref is not None:
            assert torch.equal(fused.isnan(), ref.isnan()), (fused, ref)
            torch.testing.assert_close(fused, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
    if case == "nan_offset":
        assert out[True][0][0, 1].isnan().all() and out[True][1][0, 1].isnan().all()
        assert torch.isfinite(out[True][0][0, 0]).all() and torch.isfinite(out[True][1][0, 0]).all()
    if case == "nan_score_masked":
        assert torch.isfinite(out[True][0]).all() and torch.isfinite(out[True][1]).all()


def test_fallback_offset_on_another_device_raises_naming_it():
    x = torch.randn(1, 1, 3, 4, device=DEVICE)
    off = torch.zeros(1, device="meta")
    with pytest.raises(ValueError, match="softmax_offset must be on input's device"):
        _fsm(scaled_masked_softmax_fusion=False)(x, None, off)
    with pytest.raises(ValueError, match="softmax_offset on meta"):
        _fsm(scaled_masked_softmax_fusion=True)(x, None, off)


@pytest.mark.parametrize("offset, match", [
    (1e39, "softmax_offset must be a finite number within torch.float32's range"),  # torch.full's RuntimeError before
    (math.nan, "softmax_offset must be a finite number within"), (math.inf, "softmax_offset must be a finite number"),
    (10 ** 400, r"softmax_offset must be a finite number, -inf \(no sink\) or a tensor, got an int too large"),
], ids=["1e39", "nan", "inf", "10**400"])
def test_a_float_offset_out_of_range_is_named(offset, match):
    x = torch.randn(1, 1, 2, 3, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fused_scale_mask_softmax(x, None, softmax_offset=offset)
    if offset != 1e39:  # float64 scores hold the sink in float64: only 1e39 fits there
        with pytest.raises(ValueError, match=match.replace("torch.float32", "torch.float64")):
            fused_scale_mask_softmax(x.double(), None, softmax_offset=offset)
    # -inf is no sink: the plain softmax
    assert_close(fused_scale_mask_softmax(x, None, softmax_offset=-math.inf), torch.softmax(x.double(), -1),
                 torch.float32)


@pytest.mark.parametrize("window", [(2 ** 70, 0), (1, 2 ** 64 - 1), (2 ** 63 - 1, 2 ** 70)],
                         ids=["left", "right", "both"])
def test_a_window_wider_than_int64_is_unbounded_on_that_side(window):
    # A side at least as wide as the sequence keeps every key on that side, whatever the int:
    # before, a side beyond int64 raised Triton's OverflowError ("integer to be specialized too
    # large to represent") from the kernels and torch's ("Overflow when unpacking long long")
    # from the fallback and get_sliding_window_causal_mask, naming nothing; 2**63 - 1 with
    # sq > sk overflowed the kernels' band (sk - sq - left < -2**63).
    sq, sk = 7, 5
    capped = tuple(w if w < sq + sk else -1 for w in window)
    expected_mask = unfused.sliding_window_causal_mask(sq, sk, capped, device=DEVICE)
    assert torch.equal(get_sliding_window_causal_mask(sq, sk, window, device=DEVICE), expected_mask)
    x = _scores((1, 2, sq, sk), torch.float32)
    g = _grad_like(x)
    p64, dx64, _ = _reference(x, expected_mask, SCALE, g)
    for fusion in (True, False):
        x.grad = None
        sm = _fsm(attn_mask_type=AttnMaskType.causal, scaled_masked_softmax_fusion=fusion, scale=SCALE,
                  window_size=window)
        p = sm(x, None)
        p.backward(g)
        assert_close(p, p64, torch.float32)
        assert_close(x.grad, dx64, torch.float32)
    assert_close(fused_scale_mask_softmax(x, None, SCALE, window_size=window), p64, torch.float32)


@pytest.mark.parametrize("sq, sk", [(5, 8), (8, 5), (6, 6)])
def test_window_sides_at_the_edge_of_the_sequence(sq, sk):
    # A side narrower than the sequence still masks: left = sk - 2 drops key 0 of the last row,
    # right = sq - 2 the last key of the first row; from left = sk - 1 and right = sq - 1 on a
    # side keeps every key. Each window against Megatron-core's definition written out with
    # triu/tril, on the kernel, the fallback and get_sliding_window_causal_mask.
    x = _scores((1, 2, sq, sk), torch.float32)
    g = _grad_like(x)
    ones = torch.ones(sq, sk, dtype=torch.bool, device=DEVICE)
    for left in (sk - 3, sk - 2, sk - 1, sk):
        for right in (sq - 3, sq - 2, sq - 1, sq):
            window = (left, right)
            want = ~torch.tril(torch.triu(ones, diagonal=sk - sq - left), diagonal=sk - sq + right)
            assert torch.equal(get_sliding_window_causal_mask(sq, sk, window, device=DEVICE), want), window
            p64, dx64, _ = _reference(x, want, SCALE, g)
            for fusion in (True, False):
                x.grad = None
                p = _fsm(scaled_masked_softmax_fusion=fusion, scale=SCALE, window_size=window)(x, None)
                p.backward(g)
                assert_close(p, p64, torch.float32)
                assert_close(x.grad, dx64, torch.float32)


@pytest.mark.parametrize("fusion", [True, False])
def test_a_mask_with_more_dims_than_the_scores_is_refused(fusion):
    # a [1, 1, 1, sq, sk] mask broadcasts with [b, np, sq, sk] scores to 5 dims: the fallback
    # would return probabilities of another shape, the kernel raise torch's expand error
    x = torch.randn(2, 1, 3, 4, device=DEVICE)
    mask = torch.zeros(1, 1, 1, 3, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match=r"mask of shape \[1, 1, 1, 3, 4\] does not broadcast"):
        _fsm(attn_mask_type=AttnMaskType.padding, scaled_masked_softmax_fusion=fusion)(x, mask)
    with pytest.raises(ValueError, match="does not broadcast"):
        fused_scale_mask_softmax(x, mask)


@pytest.mark.parametrize("mask_type, window", [(AttnMaskType.causal, None), (AttnMaskType.padding, (1, 0))])
def test_fallback_mask_on_another_device_raises_naming_it(mask_type, window):
    # the fallback or-ed the caller's mask with the causal / window mask first: torch's
    # "Tensor on device cpu is not on the expected device meta!", naming no argument
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    x = torch.randn(1, 1, 3, 4, device=DEVICE)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool, device=other)
    with pytest.raises(ValueError, match=f"^mask must be on input's device .*, got mask on {other}"):
        _fsm(attn_mask_type=mask_type, window_size=window, scaled_masked_softmax_fusion=False)(x, mask)


@pytest.mark.parametrize("fusion", [True, False])
def test_attributes_assigned_after_construction_apply_and_are_checked(fusion):
    # Megatron-core's forward reads attn_mask_type, scale and window_size at every call; here
    # the mask type's name was cached at construction, so a causal type assigned later was
    # ignored (no causal mask, silently), and a NaN scale assigned later made the fallback NaN.
    x = _scores((1, 2, 4, 4), torch.float32, requires_grad=False)
    sm = _fsm(scaled_masked_softmax_fusion=fusion)
    sm.attn_mask_type = AttnMaskType.causal
    causal = unfused.causal_mask(4, 4, device=DEVICE)
    assert sm.attn_mask_type is AttnMaskType.causal
    assert_close(sm(x, None), unfused.masked_softmax_reference(x.double(), causal), torch.float32)
    sm.scale, sm.window_size = 0.5, (1, 0)
    assert (sm.scale, sm.window_size) == (0.5, (1, 0))
    window = unfused.sliding_window_causal_mask(4, 4, (1, 0), device=DEVICE)
    assert_close(sm(x, None), unfused.masked_softmax_reference(x.double(), window, 0.5), torch.float32)
    with pytest.raises(TypeError, match="attn_mask_type must be an AttnMaskType"):
        sm.attn_mask_type = "causal"
    with pytest.raises(ValueError, match="scale must be finite"):
        sm.scale = math.nan
    with pytest.raises(TypeError, match="scale must be a real number or None"):
        sm.scale = "2"
    with pytest.raises(ValueError, match="window_size must be None or a pair"):
        sm.window_size = (-5, 0)
    assert (sm.attn_mask_type, sm.scale, sm.window_size) == (AttnMaskType.causal, 0.5, (1, 0))  # unchanged


def test_offset_gradient_with_no_heads():
    # np = 0 heads and a softmax_offset of 0 elements (one per head): the backward summed it to
    # one scalar and failed to reshape it ("shape '[0]' is invalid for input of size 1")
    x = torch.randn(2, 0, 3, 4, device=DEVICE, requires_grad=True)
    off = torch.zeros(0, device=DEVICE, requires_grad=True)
    p = fused_scale_mask_softmax(x, None, 1.0, softmax_offset=off)
    p.sum().backward()
    assert p.shape == x.shape and x.grad.shape == x.shape and off.grad.shape == (0,)


@pytest.mark.parametrize("sink", ["inf", "float64_beyond_float32"])
def test_an_infinite_sink_logit_takes_the_whole_row(sink):
    # p_j = e^{x_j} / (e^o + sum_k e^{x_k}) -> 0 as o -> +inf, with zero gradients. The kernels
    # subtracted the row's max, the sink's included, and computed inf - inf: the head's rows
    # were NaN, forward and backward (a float64 sink of 1e300 for float32 scores too, inf once
    # in the compute dtype). The other head is unaffected.
    x = _scores((2, 2, 3, 5), torch.float32)
    big = math.inf if sink == "inf" else 1e300
    off = torch.tensor([big, 0.3], device=DEVICE, dtype=torch.float64).requires_grad_(True)
    g = _grad_like(x)
    p = fused_scale_mask_softmax(x, None, SCALE, softmax_offset=off)
    p.backward(g)
    assert torch.equal(p[:, 0], torch.zeros_like(p[:, 0])) and torch.equal(x.grad[:, 0], torch.zeros_like(p[:, 0]))
    assert off.grad[0].item() == 0.0
    p64, dx64, doff64 = _reference(x[:, 1:], None, SCALE, g[:, 1:], off[1:])
    assert_close(p[:, 1:], p64, torch.float32)
    assert_close(x.grad[:, 1:], dx64, torch.float32)
    assert_close(off.grad[1:], doff64, torch.float32, scale=10.0)  # a sum over 2·3 rows


# ---------------------------------------------------------------------------------------------
# Megatron's availability rule at its edges (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def test_megatron_availability_rule_at_its_edges():
    causal, pad = AttnMaskType.causal, AttnMaskType.padding
    # the ends of each condition: sk = 4096 is in (16 < sk <= 4096); 128-wide rows are still packed two a warp
    assert megatron_kernel_availability(causal, True, True, 4, 32, 4096, 4096) == (True, "")
    assert get_batch_per_block(128, 128, 1, 1) == 8 and get_batch_per_block(256, 256, 1, 1) == 4
    cases = [
        # sk, not only sq, must be a multiple of 4
        ((pad, True, True, 4, 32, 2048, 2046), "multiples of 4"),
        # causal: batch_per_block must divide b·np (the grid is (sq, b·np / batch_per_block)), whatever sq
        ((causal, True, True, 1, 4, 64, 64), "b·np = 4 is not a multiple of batch_per_block = 8"),
    ]
    for args, why in cases:
        ok, reason = megatron_kernel_availability(*args)
        assert not ok and why in reason, (args, reason)
    # and causal with b·np a multiple of batch_per_block takes any sq the other conditions allow
    assert megatron_kernel_availability(causal, True, True, 2, 4, 20, 20) == (True, "")


def test_megatron_availability_rule_says_no_for_a_sliding_window():
    ok, reason = megatron_kernel_availability(AttnMaskType.causal, True, True, 4, 32, 2048, 2048, window_size=(128, 0))
    assert not ok and "sliding window" in reason


# --------------------------------------------------------------------------------------------
# Which kernel runs: the row length, max_register_block, a given tile
# --------------------------------------------------------------------------------------------

_FWD, _FWD_ONLINE = "_softmax_fwd_kernel", "_softmax_fwd_online_kernel"
_BWD, _BWD_ONLINE = "_softmax_bwd_kernel", "_softmax_bwd_online_kernel"


def _names(launches):
    """The kernel names of the launches ``spy_launches`` recorded, in order."""
    return [c.kernel for c in launches]


def test_softmax_tile_remembers_each_register_limit_apart(monkeypatch):
    # softmax_tile keeps its picks by (row length, register limit): a row asked for under two
    # limits gets each limit's tile, in either order. Rows of 37 and 45 are 64 wide: they fit
    # the default limit and a limit of 64, not a limit of 8 (the looping kernel's 8-column tiles).
    for n, limits in [(37, (None, 8, 64)), (45, (8, None, 64))]:
        tiles = {limit: ksoftmax.softmax_tile(n, max_register_block=limit) for limit in limits}
        assert tiles[None].BLOCK_N == 64 and tiles[64].BLOCK_N == 64 and tiles[8].BLOCK_N == 8
        assert ksoftmax.softmax_tile(n) == tiles[None] and ksoftmax.softmax_tile(n, 8) == tiles[8]
    # None reads the module's MAX_REGISTER_BLOCK at call time
    monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", 8)
    assert ksoftmax.softmax_tile(37).BLOCK_N == 8 and ksoftmax.softmax_tile(37, max_register_block=None).BLOCK_N == 8


def _causal_kernels(sq, sk, launches):
    """``run(want, **settings)`` for causal scores [1, 2, sq, sk]: clears ``launches`` (the
    ``spy_launches`` list), runs the kernel layer's forward and backward with the settings
    (``max_register_block``, ``tile``), asserts that the kernels ``want`` ran, in order, and that
    p and dx are the float64 reference's."""
    x = _scores((1, 2, sq, sk), torch.float32, requires_grad=False)
    g = _grad_like(x)
    band = ksoftmax.causal_band(sq, sk)
    p64, dx64, _ = _reference(x, unfused.causal_mask(sq, sk, device=DEVICE), SCALE, g)

    def run(want, **settings):
        launches.clear()
        p, _ = ksoftmax.softmax_fwd(x, SCALE, band=band, **settings)
        dx, _ = ksoftmax.softmax_bwd(g, p, SCALE, band=band, **settings)
        assert _names(launches) == want, (settings, _names(launches))
        assert_close(p, p64, torch.float32)
        assert_close(dx, dx64, torch.float32)

    return run


def test_the_row_length_picks_the_register_or_the_looping_kernel(monkeypatch, spy_launches):
    # A row of 16 is held in registers under the default limit and under a limit of exactly 16;
    # under a limit of 8 (an argument, or the module's MAX_REGISTER_BLOCK read at call time) the
    # looping kernels walk it in two tiles. Every path gives the float64 reference's values.
    run = _causal_kernels(3, 16, spy_launches)
    run([_FWD, _BWD], max_register_block=None)
    run([_FWD, _BWD], max_register_block=16)
    run([_FWD_ONLINE, _BWD_ONLINE], max_register_block=8)
    monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", 8)
    run([_FWD_ONLINE, _BWD_ONLINE], max_register_block=None)


def test_a_given_tile_covers_every_row(spy_launches):
    # A tile narrower than the row runs the looping kernels, one row per program whatever the
    # tile's BLOCK_M; a tile as wide as the row, the register kernels with BLOCK_M rows a program.
    # 10 rows of 20 (32 wide) with tiles of 4 rows: the last register program holds 2 rows.
    run = _causal_kernels(5, 20, spy_launches)
    run([_FWD_ONLINE, _BWD_ONLINE], tile=Tile(BLOCK_M=4, BLOCK_N=8, num_warps=4))
    run([_FWD, _BWD], tile=Tile(BLOCK_M=4, BLOCK_N=32, num_warps=4))


@pytest.mark.parametrize("sq, sk", [(4, 4), (3, 6)])
def test_a_window_with_no_keys_on_the_left_keeps_none(sq, sk):
    # window (0, right): row q keeps keys q + sk - sq through q + sk - sq + right. A left side of
    # 0 is a width, not FlashAttention's "unbounded" (-1): nothing left of the diagonal is kept.
    x = _scores((1, 2, sq, sk), torch.float32)
    g = _grad_like(x)
    ones = torch.ones(sq, sk, dtype=torch.bool, device=DEVICE)
    for right in (0, 1):
        window = (0, right)
        assert ksoftmax.window_band(sq, sk, window) == (sk - sq, sk - sq + right)
        want = ~torch.tril(torch.triu(ones, diagonal=sk - sq), diagonal=sk - sq + right)
        assert torch.equal(get_sliding_window_causal_mask(sq, sk, window, device=DEVICE), want)
        p64, dx64, _ = _reference(x, want, SCALE, g)
        x.grad = None
        p = fused_scale_mask_softmax(x, None, SCALE, window_size=window)
        p.backward(g)
        assert_close(p, p64, torch.float32)
        assert_close(x.grad, dx64, torch.float32)


@pytest.mark.parametrize("mask_shape", [(3, 5, 7), (1, 5, 7), (5, 7), (7,), (3, 1, 5, 7)])
def test_kernel_three_dim_scores_take_a_mask_of_their_own_shape(mask_shape):
    # [b, sq, sk] scores are one head each: a mask broadcastable to them by torch's rules (its
    # leading dim is b) masks each b's own rows, as torch.masked_fill would; the 4-D [b, 1, sq, sk]
    # form too
    x = _scores((3, 5, 7), torch.float32, requires_grad=False)
    mask = torch.rand(mask_shape, device=DEVICE) < 0.3
    full = mask[:, 0] if mask.dim() == 4 else mask.expand(3, 5, 7)
    p, _ = ksoftmax.softmax_fwd(x, SCALE, mask)
    want = unfused.masked_softmax_reference(x.double(), full, SCALE)
    assert p.shape == x.shape
    assert_close(p, want, torch.float32)


@pytest.mark.parametrize("bad", [6, 0, -4, True, 2.0])
def test_max_register_block_must_be_a_power_of_two(bad):
    # a BLOCK_N that is not a power of two cannot launch (Triton's ranges): refused by name
    # before any launch
    x = _scores((2, 1, 3, 5), torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=rf"max_register_block must be a power of two \(an int >= 1\), got {bad!r}$"):
        ksoftmax.softmax_fwd(x, 1.0, max_register_block=bad)
    with pytest.raises(ValueError, match="max_register_block must be a power of two"):
        ksoftmax.softmax_tile(5, bad)
    assert ksoftmax.softmax_tile(5, 4).BLOCK_N == 4  # 8 > 4: the looping kernel in tiles of 4
