"""Megatron-core module paths that its own unit tests import, beyond the fusions:
``megatron.core.activations`` and ``megatron.core.transformer.utils``, checked in float64
against their formulas and against the fused ops they serve."""
from __future__ import annotations

import pytest
import torch

from fusedlib import activations, unfused
from fusedlib.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from fusedlib.transformer import utils as tutils

from conftest import DEVICE, FLOAT_DTYPES, assert_close  # noqa: I001


def test_activations_are_megatrons_formulas():
    x = torch.linspace(-6, 6, 1201, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(activations.squared_relu(x), torch.where(x > 0, x * x, 0.0), atol=0, rtol=0)
    torch.testing.assert_close(activations.quick_gelu(x), x / (1 + torch.exp(-1.702 * x)), atol=1e-15, rtol=1e-13)
    # fast_gelu is the tanh GeLU with sqrt(2/pi) rounded to 10 digits: within 2e-11 of the exact one
    torch.testing.assert_close(activations.fast_gelu(x), unfused.gelu_tanh(x), atol=1e-10, rtol=0)
    assert activations.squared_relu(x).dtype == torch.float64


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_squared_relu_reference_of_megatrons_weighted_test(dtype):
    # Megatron's test: squared_relu(x) * weights (float32), cast to x's dtype, and its autograd,
    # against weighted_squared_relu_impl; here both against float64.
    x = (2 * torch.randn(16, 64, device=DEVICE)).to(dtype).requires_grad_(True)
    w = torch.randn(16, 1, device=DEVICE, requires_grad=True)
    g = torch.randn(16, 64, device=DEVICE).to(dtype)
    ref = (activations.squared_relu(x) * w).to(dtype)
    ref.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = weighted_squared_relu_impl(x2, w2)
    out.backward(g)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref64 = activations.squared_relu(x64) * w64
    ref64.backward(g.double())
    # eager: squared_relu rounds relu(x)² to dtype, then ·w in float32 and a second rounding
    assert_close(ref, ref64.detach(), dtype, scale=2.0)
    assert_close(out, ref64.detach(), dtype)
    assert out.dtype == ref.dtype and x2.grad.dtype == x.grad.dtype and w2.grad.dtype == w.grad.dtype
    assert_close(x2.grad, x64.grad, dtype)
    assert_close(w2.grad, w64.grad, torch.float32, scale=64**0.5)


def test_transformer_utils_masks_and_mask_func():
    scores = torch.randn(2, 3, 4, 6, device=DEVICE)
    before = scores.clone()
    mask = tutils.get_default_causal_mask(4, 6, device=DEVICE)
    assert torch.equal(mask, unfused.causal_mask(4, 6, device=DEVICE))
    assert torch.equal(tutils.get_default_causal_mask(5, device=DEVICE),
                       torch.triu(torch.ones(5, 5, dtype=torch.bool, device=DEVICE), diagonal=1))
    masked = tutils.attention_mask_func(scores, mask)
    assert torch.equal(scores, before)  # a new tensor: the caller's scores are never written
    assert torch.equal(masked, torch.where(mask, torch.full_like(scores, -10000.0), scores))
    window = tutils.get_sliding_window_causal_mask(4, 6, (1, 0), device=DEVICE)
    assert torch.equal(window, unfused.sliding_window_causal_mask(4, 6, (1, 0), device=DEVICE))
    assert (~window).sum(-1).tolist() == [2, 2, 2, 2]  # each query: itself and one key to its left
