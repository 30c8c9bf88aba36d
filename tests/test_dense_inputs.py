"""Tensors a Triton kernel cannot read as their values: negative-bit views and sparse layouts.

A lazy negation view (``c.conj().imag``, ``torch._neg_view``) shares the memory of the tensor it
negates; a kernel reading that memory computes with the negated values. Every op of
``python -m fusedlib.bench --host`` refuses such an input with an error naming the argument
(also for a signature whose plan it remembers: the plan keys hold the negative bit), resolves
such a gradient in its backward (the same gradients, bit for bit, as from the plain gradient),
and refuses a sparse input by name. The launch layer refuses a negative-bit tensor handed to a
kernel directly, naming the kernel's parameter.
"""
from __future__ import annotations

import pytest
import torch

import fusedlib  # noqa: F401  (first)
from fusedlib.bench.host import HOST_SHAPES
from fusedlib.bench.ops import get_case
from fusedlib.checks import check_dense, check_same_device, check_tensor, is_dense, on_one_kernel_device

from conftest import DEVICE  # noqa: I001

OPS = ["bias_gelu", "bias_dropout_add", "geglu", "swiglu", "weighted_swiglu", "layer_norm", "rms_norm",
       "causal_softmax", "masked_softmax", "softmax_one", "softmax_dropout", "cross_entropy", "rope",
       "attention", "bias_dropout_add_norm"]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _fusedlib(op):
    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    return next(i for i in case.impls if i.name == "fusedlib").fn, case


def _used(fn, case) -> list[int]:
    """Indices of the float tensors among the case's inputs that fusedlib's op reads (a case may
    carry inputs for a baseline alone): those the case makes without a gradient (freqs), and
    those with one that get a gradient."""
    inputs = case.make_inputs(DEVICE, True)
    floats = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    diff = [i for i in floats if inputs[i].requires_grad]
    torch.manual_seed(0)
    grads = torch.autograd.grad(_first(fn(*inputs)).float().sum(), [inputs[i] for i in diff], allow_unused=True)
    unused = {i for i, g in zip(diff, grads) if g is None}
    return [i for i in floats if i not in unused]


def _neg_twin(t: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``t`` whose memory holds ``-t`` (the negative bit set)."""
    twin = torch._neg_view(-t.detach())
    assert twin.is_neg() and torch.equal(twin, t.detach())
    return twin


@pytest.mark.parametrize("op", OPS)
def test_a_negative_bit_input_is_refused_by_name_also_beside_a_remembered_plan(op):
    fn, case = _fusedlib(op)
    torch.manual_seed(1)
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in case.make_inputs(DEVICE, False)]
    used = _used(fn, case)
    assert used
    for i in used:
        with torch.no_grad():
            fn(*inputs)  # the plain signature's plan, where the op keeps one
        args = list(inputs)
        args[i] = _neg_twin(inputs[i])
        before = args[i].clone()
        with pytest.raises(ValueError, match=r"has its negative bit set .* pass \w+\.resolve_neg\(\)"):
            fn(*args)
        assert torch.equal(args[i], before) and args[i].is_neg()  # not modified, not resolved in place
        args[i] = args[i].resolve_neg()
        with torch.no_grad():
            torch.manual_seed(2)
            got = _first(fn(*args))
            torch.manual_seed(2)
            want = _first(fn(*inputs))
        assert torch.equal(got, want)  # resolved as the message says: the plain input's result


@pytest.mark.parametrize("op", OPS)
def test_a_negative_bit_gradient_gives_the_plain_gradients(op):
    fn, case = _fusedlib(op)
    torch.manual_seed(3)
    inputs = case.make_inputs(DEVICE, True)
    tensors = [inputs[i] for i in _used(fn, case) if inputs[i].requires_grad]
    torch.manual_seed(4)
    out = _first(fn(*inputs))
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, tensors, g)
    torch.manual_seed(4)
    out = _first(fn(*inputs))
    twin = _neg_twin(g)
    got = torch.autograd.grad(out, tensors, twin)
    assert twin.is_neg()  # the caller's gradient is not resolved in place
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["bias_gelu", "layer_norm", "causal_softmax", "cross_entropy", "geglu"])
def test_a_sparse_input_is_refused_by_name(op):
    fn, case = _fusedlib(op)
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in case.make_inputs(DEVICE, False)]
    args = list(inputs)
    args[0] = inputs[0].to_sparse()
    with pytest.raises(TypeError, match=r"must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        fn(*args)


def test_the_launch_layer_refuses_a_negative_bit_tensor_by_the_kernels_parameter():
    from fusedlib.kernels.bias_gelu import bias_gelu_fwd

    y = torch.randn(4, 8, device=DEVICE)
    bias = torch.randn(8, device=DEVICE)
    bias_gelu_fwd(y, bias)  # the plain signature's plan
    with pytest.raises(ValueError, match=r"_bias_gelu_fwd_kernel: argument \w+ is a tensor with its negative bit"):
        bias_gelu_fwd(_neg_twin(y), bias)


def test_the_checks():
    t = torch.randn(3, 2)
    neg = _neg_twin(t)
    sparse = t.to_sparse()
    assert is_dense(t) and is_dense(t.t()) and not is_dense(neg) and not is_dense(sparse)
    assert on_one_kernel_device(t, t) and not on_one_kernel_device(t, neg) and not on_one_kernel_device(sparse, t)
    check_dense("x", t)
    with pytest.raises(ValueError, match=r"^x has its negative bit set .* pass x\.resolve_neg\(\)$"):
        check_dense("x", neg)
    with pytest.raises(ValueError, match="^w has its negative bit set"):
        check_tensor("w", neg)
    with pytest.raises(ValueError, match="^b has its negative bit set"):
        check_same_device(a=t, b=neg)
    with pytest.raises(TypeError, match=r"^x must be a dense \(strided\) tensor, got layout torch.sparse_coo: "
                                         r"pass x.to_dense\(\)$"):
        check_tensor("x", sparse)
    imag = torch.complex(t, t).conj().imag  # how such a view arises
    assert imag.is_neg() and not is_dense(imag)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # (a prototype, torch says)
def test_a_nested_tensor_is_refused_by_name():
    x = torch.randn(2, 4, 8, device=DEVICE)
    nested = torch.nested.as_nested_tensor([x, x])
    assert nested.layout is torch.strided and not is_dense(nested) and not on_one_kernel_device(nested)
    w, b = torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    with pytest.raises(TypeError, match=r"^input must be a dense \(strided\) tensor, got a nested tensor"):
        fusedlib.fused_layer_norm(nested, w, b)
    with pytest.raises(TypeError, match=r"^input must be a dense \(strided\) tensor, got a nested tensor"):
        fusedlib.bias_gelu_impl(nested, b)
    with torch.no_grad(), pytest.raises(TypeError, match=r"^input must be a dense \(strided\) tensor, got a nested"):
        fusedlib.fused_rms_norm(nested, w)
    q = torch.randn(1, 4, 2, 8, device=DEVICE)
    nested_q = torch.nested.as_nested_tensor([q[0], q[0]])
    with pytest.raises(TypeError, match=r"^k must be a dense \(strided\) tensor, got a nested tensor"):
        fusedlib.flash_attention(q, nested_q, q)


def test_zero_tensor_and_sparse_gradients_give_the_dense_gradients():
    torch.manual_seed(6)
    y = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    b = torch.randn(8, device=DEVICE, requires_grad=True)
    zeros = torch.autograd.grad(fusedlib.bias_gelu_impl(y, b), [y, b], torch._efficientzerotensor(4, 8, device=DEVICE))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in zeros)
    g = torch.randn(4, 8, device=DEVICE)
    g[1] = 0.0
    want = torch.autograd.grad(fusedlib.bias_gelu_impl(y, b), [y, b], g)
    got = torch.autograd.grad(fusedlib.bias_gelu_impl(y, b), [y, b], g.to_sparse())
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def test_the_parallel_layers_take_negative_bit_gradients_and_ids():
    from fusedlib.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
    from fusedlib.transformer import TransformerConfig

    torch.manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, deterministic_mode=True)
    lin = ColumnParallelLinear(16, 8, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                               gather_output=False).to(DEVICE)
    x = torch.randn(4, 2, 16, device=DEVICE, requires_grad=True)
    g = torch.randn(4, 2, 8, device=DEVICE)
    params = [x, lin.weight, lin.bias]
    want = torch.autograd.grad(lin(x)[0], params, g)
    got = torch.autograd.grad(lin(x)[0], params, _neg_twin(g))  # the bias gradient is a kernel's column sum
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    emb = VocabParallelEmbedding(32, 16, init_method=torch.nn.init.normal_, config=cfg).to(DEVICE)
    ids = torch.randint(0, 32, (2, 5), device=DEVICE)
    want = torch.autograd.grad(emb(ids).square().sum(), emb.weight)[0]  # the deterministic kernel's gradient
    out = emb(_neg_twin(ids))
    assert torch.equal(out, emb(ids))
    assert torch.equal(torch.autograd.grad(out.square().sum(), emb.weight)[0], want)
