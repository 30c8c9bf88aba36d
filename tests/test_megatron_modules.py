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


def test_fast_gelu_keeps_megatrons_ten_digit_constant_in_float64():
    # fast_gelu's 0.7978845608 is Megatron's literal, not sqrt(2/pi): in float64 the two differ by
    # ~1e-12 relative, far above the few roundings (~1e-15) that separate fast_gelu from the same
    # formula evaluated exactly (mpmath, 50 digits)
    import mpmath  # torch's dependency, through sympy

    xs = [-5.0, -2.5, -1.0, -0.3, 0.2, 0.7, 1.0, 1.5, 3.0, 4.0]
    with mpmath.workdps(50):
        c, a = mpmath.mpf("0.7978845608"), mpmath.mpf("0.044715")
        exact = [float(0.5 * x * (1 + mpmath.tanh(c * x * (1 + a * x * x)))) for x in map(mpmath.mpf, xs)]
    got = activations.fast_gelu(torch.tensor(xs, dtype=torch.float64, device=DEVICE))
    torch.testing.assert_close(got, torch.tensor(exact, dtype=torch.float64, device=DEVICE), atol=1e-15, rtol=1e-14)


def test_init_helpers_scale_by_the_layer_count_and_get_linear_layer_zeroes_its_bias():
    # N(0, sigma²) and N(0, sigma² / (2·num_layers)): the sample std of n = 40000 draws is within
    # 5/sqrt(2n) (1.8 %) of sigma with overwhelming probability; the multiplier is 2 by default
    w = torch.empty(200, 200, dtype=torch.float64, device=DEVICE)
    for init, sigma in ((tutils.init_method_normal(0.3), 0.3),
                        (tutils.scaled_init_method_normal(0.3, 8), 0.3 / 4.0),
                        (tutils.scaled_init_method_normal(0.3, 8, multiplier=0.5), 0.3 / 2.0)):
        init(w)
        assert abs(w.std().item() / sigma - 1) < 5 / (2 * w.numel()) ** 0.5
        assert abs(w.mean().item()) < 5 * sigma / w.numel() ** 0.5
    calls = []
    layer = tutils.get_linear_layer(3, 5, lambda t: calls.append(t) or t.fill_(0.5))
    assert len(calls) == 1 and calls[0] is layer.weight
    assert torch.all(layer.weight == 0.5) and torch.all(layer.bias == 0)
    # without perform_initialization, the init method is not called; the bias is zeroed all the same
    layer = tutils.get_linear_layer(3, 5, lambda t: calls.append(t), perform_initialization=False)
    assert len(calls) == 1 and torch.all(layer.bias == 0)


def test_param_device_and_heads_per_partition(monkeypatch):
    import types

    monkeypatch.setattr(tutils, "default_device", lambda: torch.device("meta"))
    assert tutils.param_device(types.SimpleNamespace(use_cpu_initialization=True)) == torch.device("cpu")
    assert tutils.param_device(types.SimpleNamespace(use_cpu_initialization=False)) == torch.device("meta")

    def cfg(p, np_, ng):
        return types.SimpleNamespace(tensor_model_parallel_size=p, num_attention_heads=np_, num_query_groups=ng)

    assert tutils.heads_per_partition(cfg(2, 8, 4)) == (4, 2)
    for p, np_, ng in ((2, 8, 1), (2, 8, 3), (4, 6, 2)):  # key/value groups (or heads) not divisible by p
        with pytest.raises(ValueError, match="must both be divisible by tensor_model_parallel_size"):
            tutils.heads_per_partition(cfg(p, np_, ng))
