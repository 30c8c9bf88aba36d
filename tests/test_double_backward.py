"""Every fused op's backward runs Triton kernels that autograd cannot differentiate again.

A second derivative through them (``create_graph=True``, e.g. for a gradient penalty) must
raise, not return a gradient that silently does not depend on the inputs.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from fusedlib.fusions.fused_attention import flash_attention
from fusedlib.fusions.fused_bias_dropout import get_bias_dropout_add
from fusedlib.fusions.fused_bias_geglu import bias_geglu_impl
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.fusions.fused_dense import fused_dense_gelu_dense
from fusedlib.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from fusedlib.fusions.fused_rope import fused_apply_rotary_pos_emb
from fusedlib.fusions.fused_softmax import ScaledSoftmax, fused_scale_mask_softmax
from fusedlib.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from fusedlib.parallel.cross_entropy import vocab_parallel_cross_entropy
from fusedlib.parallel.layers import _EmbeddingDeterministicGrad

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
    # the input saved as a float8 copy (Megatron's fp8_input_store), no tensor of the graph
    "bias_swiglu_impl_fp8_input_store": lambda: (_r(4, 16), (_r(16),), lambda x, b: bias_swiglu_impl(x, b, True)),
    "weighted_bias_swiglu_impl": lambda: (_r(4, 16), (torch.rand(4, 1, device=DEVICE),),
                                          lambda x, w: weighted_bias_swiglu_impl(x, None, w)),
    "weighted_squared_relu_impl": lambda: (_r(4, 16), (torch.rand(4, 1, device=DEVICE),), weighted_squared_relu_impl),
    "fused_dense_gelu_dense": lambda: (_r(4, 16), (_r(24, 16), _r(24), _r(8, 24), _r(8)), fused_dense_gelu_dense),
    "fused_layer_norm": lambda: (_r(4, 16), (_r(16), _r(16)), fused_layer_norm),
    "fused_rms_norm": lambda: (_r(4, 16), (_r(16),), fused_rms_norm),
    "fused_apply_rotary_pos_emb": lambda: (_r(3, 2, 2, 8), (_r(3, 1, 1, 8),), fused_apply_rotary_pos_emb),
    "ScaledSoftmax": lambda: (_r(2, 2, 4, 8), (), lambda x: ScaledSoftmax.apply(x, 1.0)),
    "fused_scale_mask_softmax": lambda: (_r(2, 2, 4, 8), (),
                                         lambda x: fused_scale_mask_softmax(x, None, 1.0, causal=True)),
    "flash_attention": lambda: (_r(1, 8, 2, 16), (_r(1, 8, 2, 16), _r(1, 8, 2, 16)),
                                lambda q, k, v: flash_attention(q, k, v, causal=True)),
    "fused_vocab_parallel_cross_entropy": lambda: (_r(3, 2, 10), (_t(6, 10).view(3, 2),),
                                                   lambda x, t: fused_vocab_parallel_cross_entropy(x, t)),
    "vocab_parallel_cross_entropy": lambda: (_r(3, 2, 10), (_t(6, 10).view(3, 2),),
                                             lambda x, t: vocab_parallel_cross_entropy(x, t)),
    # the deterministic embedding gradient: x is the weight, the ids repeat
    "embedding_deterministic_grad": lambda: (_r(5, 8), (torch.tensor([[1, 2, 1], [4, 1, 0]], device=DEVICE),),
                                             lambda w, ids: _EmbeddingDeterministicGrad.apply(ids, w)),
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


# ops linear in the differentiated input: their second derivative is zero, so a gradient that
# does not depend on x is the right one (torch's once_differentiable is kept for them)
LINEAR = {"bias_dropout_add", "fused_apply_rotary_pos_emb", "embedding_deterministic_grad"}


@pytest.mark.parametrize("through", ["leaf", "non-leaf", "non-contiguous non-leaf"])
@pytest.mark.parametrize("allow_unused", [False, True])
@pytest.mark.parametrize("name", sorted(set(OPS) - LINEAR))
def test_second_derivative_by_autograd_grad_raises(name, allow_unused, through):
    # torch.autograd.grad(penalty, x) runs only the nodes on a path to x: the raising node, whose
    # inputs were stand-in leaves, was skipped (x "not used in the graph", or None with
    # allow_unused: a silent zero second derivative). "non-leaf": the op gets x·1, a tensor
    # with a node of its own between the op and x; "non-contiguous": a copy of its rows is what
    # fused_dense_gelu_dense and the cross entropies save (no tensor of the graph)
    torch.manual_seed(zlib.crc32(name.encode()))
    x, others, fn = OPS[name]()
    x.requires_grad_(True)
    arg = {"leaf": x, "non-leaf": x * 1.0,
           "non-contiguous non-leaf": (x * 1.0).transpose(-2, -1).contiguous().transpose(-2, -1)}[through]
    assert arg.is_contiguous() == (through != "non-contiguous non-leaf")
    (gx,) = torch.autograd.grad(fn(arg, *others).float().pow(2).sum(), x, create_graph=True)
    assert gx.shape == x.shape and torch.isfinite(gx).all()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(gx.pow(2).sum(), x, allow_unused=allow_unused)


@pytest.mark.parametrize("name", sorted(set(OPS) - LINEAR))
def test_second_derivative_raises_with_a_constant_incoming_gradient(name):
    # torch's once_differentiable only guards a backward whose incoming gradient requires grad:
    # with (out * w).sum() for a constant w the gradient came back without a graph, and a
    # penalty on it silently added nothing to the second backward
    torch.manual_seed(zlib.crc32(name.encode()))
    x, others, fn = OPS[name]()
    x.requires_grad_(True)
    out = fn(x, *others)
    w = torch.randn(out.shape, device=DEVICE)  # constant: requires no grad
    (gx,) = torch.autograd.grad((out.float() * w).sum(), x, create_graph=True)
    assert gx.shape == x.shape and torch.isfinite(gx).all()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        ((out.float() * w).sum() + gx.pow(2).sum()).backward()


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_linear_op_constant_incoming_gradient_second_backward_is_the_first(name):
    # for an op linear in x the gradient penalty's second derivative through the op is zero:
    # the combined backward equals the first term's alone
    torch.manual_seed(zlib.crc32(name.encode()))
    x, others, fn = OPS[name]()
    x.requires_grad_(True)
    w = torch.randn(fn(x, *others).shape, device=DEVICE)
    seed = torch.seed()
    torch.manual_seed(seed)
    out = fn(x, *others)
    (gx,) = torch.autograd.grad((out.float() * w).sum(), x, create_graph=True)
    ((out.float() * w).sum() + gx.pow(2).sum()).backward()
    combined, x.grad = x.grad.clone(), None
    torch.manual_seed(seed)
    (fn(x, *others).float() * w).sum().backward()
    assert torch.equal(combined, x.grad)
