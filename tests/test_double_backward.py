"""Every fused op's backward runs Triton kernels that autograd cannot differentiate again.

A second derivative through them (``create_graph=True``, e.g. for a gradient penalty) must
raise, not return a gradient that silently does not depend on the inputs.
"""
from __future__ import annotations

import pytest
import torch

from fusedlib.fusions.fused_bias_dropout import get_bias_dropout_add
from fusedlib.fusions.fused_bias_geglu import bias_geglu_impl
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from fusedlib.fusions.fused_rope import fused_apply_rotary_pos_emb
from fusedlib.fusions.fused_softmax import ScaledSoftmax
from fusedlib.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from fusedlib.parallel.cross_entropy import vocab_parallel_cross_entropy

from conftest import DEVICE  # noqa: I001


def _r(*shape):
    return torch.randn(*shape, device=DEVICE)


def _t(n, v):
    return torch.randint(0, v, (n,), device=DEVICE)


# name -> (x, other inputs, fn(x, *others)); x is the tensor differentiated twice
OPS = {
    "bias_gelu_impl": lambda: (_r(4, 16), (_r(16),), bias_gelu_impl),
    "bias_dropout_add": lambda: (_r(4, 16), (_r(16), _r(4, 16)),
                                 lambda x, b, res: get_bias_dropout_add(True, True)((x, b), res, 0.1)),
    "bias_geglu_impl": lambda: (_r(4, 16), (_r(16),), bias_geglu_impl),
    "bias_swiglu_impl": lambda: (_r(4, 16), (_r(16),), bias_swiglu_impl),
    "weighted_bias_swiglu_impl": lambda: (_r(4, 16), (torch.rand(4, 1, device=DEVICE),),
                                          lambda x, w: weighted_bias_swiglu_impl(x, None, w)),
    "weighted_squared_relu_impl": lambda: (_r(4, 16), (torch.rand(4, 1, device=DEVICE),), weighted_squared_relu_impl),
    "fused_layer_norm": lambda: (_r(4, 16), (_r(16), _r(16)), fused_layer_norm),
    "fused_rms_norm": lambda: (_r(4, 16), (_r(16),), fused_rms_norm),
    "fused_apply_rotary_pos_emb": lambda: (_r(3, 2, 2, 8), (_r(3, 1, 1, 8),), fused_apply_rotary_pos_emb),
    "ScaledSoftmax": lambda: (_r(2, 2, 4, 8), (), lambda x: ScaledSoftmax.apply(x, 1.0)),
    "fused_vocab_parallel_cross_entropy": lambda: (_r(3, 2, 10), (_t(6, 10).view(3, 2),),
                                                   lambda x, t: fused_vocab_parallel_cross_entropy(x, t)),
    "vocab_parallel_cross_entropy": lambda: (_r(3, 2, 10), (_t(6, 10).view(3, 2),),
                                             lambda x, t: vocab_parallel_cross_entropy(x, t)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_second_derivative_raises(name):
    x, others, fn = OPS[name]()
    x.requires_grad_(True)
    out = fn(x, *others)
    (gx,) = torch.autograd.grad(out.float().pow(2).sum(), x, create_graph=True)
    # the first derivative is right and usable ...
    assert gx.shape == x.shape and torch.isfinite(gx).all()
    # ... but differentiating it again (as a gradient penalty's backward does) must fail loudly
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()
