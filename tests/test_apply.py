"""The fused ops skip their autograd.Function when autograd has nothing to record (fusions/_apply.py).

For every op of ``python -m fusedlib.bench --host`` (the whole transformer block aside): under
``torch.no_grad()``, and with grad mode on but no input requiring grad, the forward gives
bitwise what the Function path gives, and ``Function.apply`` is not called; with an input
that requires grad it is, and the output carries a grad_fn. Also: bad input still raises the
op's clear error on the fast path, and a forward-mode AD level keeps the Function path.
"""
from __future__ import annotations

import pytest
import torch

import fusedlib  # noqa: F401  (first)
from fusedlib.bench.host import HOST_SHAPES
from fusedlib.bench.ops import get_case
from fusedlib.fusions import _apply

from conftest import DEVICE, generator_state  # noqa: I001

OPS = ["bias_gelu", "bias_dropout_add", "geglu", "swiglu", "weighted_swiglu", "layer_norm", "rms_norm",
       "causal_softmax", "masked_softmax", "softmax_one", "softmax_dropout", "cross_entropy", "rope"]


@pytest.fixture
def applies(monkeypatch):
    """Counts the calls of Function.apply made through fusions/_apply.py."""
    calls = []
    real = _apply._FUNCTION_APPLY

    def counting(cls, *args):
        calls.append(cls.__name__)
        return real(cls, *args)

    monkeypatch.setattr(_apply, "_FUNCTION_APPLY", counting)
    return calls


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("op", OPS)
def test_no_grad_skips_the_function_and_gives_the_same_result(op, applies):
    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    fn = next(i for i in case.impls if i.name == "fusedlib").fn
    inputs = case.make_inputs(DEVICE, True)
    torch.manual_seed(5)
    want = _first(fn(*inputs))  # the Function path (inputs require grad)
    assert applies and want.grad_fn is not None
    applies.clear()
    torch.manual_seed(5)
    with torch.no_grad():
        got = _first(fn(*inputs))
    assert applies == [] and got.grad_fn is None
    assert torch.equal(got, want.detach())
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
    torch.manual_seed(5)
    got = _first(fn(*detached))  # grad mode on, nothing requires grad
    assert applies == [] and torch.equal(got, want.detach())


def test_bad_input_raises_the_clear_error_on_the_fast_path():
    from fusedlib import ScaledUpperTriangMaskedSoftmax, bias_gelu_impl

    y = torch.randn(4, 8, device=DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bias must have shape"):
            bias_gelu_impl(y, torch.randn(7, device=DEVICE))
        with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
            bias_gelu_impl(y, [1.0] * 8)
        with pytest.raises(ValueError, match="inputs must be 3-D"):
            ScaledUpperTriangMaskedSoftmax.apply(y, 0.5)


def test_needs_autograd():
    x = torch.zeros(2)
    w = torch.zeros(2, requires_grad=True)
    assert not _apply.needs_autograd(x, None, 1.0)
    assert _apply.needs_autograd(x, w)
    with torch.no_grad():
        assert not _apply.needs_autograd(x, w)
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():  # the Functions define no jvp: Function.apply says so
        assert _apply.needs_autograd(x)


@pytest.mark.parametrize("op", ["bias_gelu", "layer_norm", "cross_entropy", "causal_softmax"])
def test_torch_func_transforms_keep_the_function_path_and_its_clear_error(op):
    # inside vmap the fast path would hand the kernels batched tensors (no storage: "Cannot access
    # data pointer"); the Function path raises torch's error naming what the Functions lack
    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    fn = next(i for i in case.impls if i.name == "fusedlib").fn
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in case.make_inputs(DEVICE, True)]
    x = inputs[0]
    batched = x.unsqueeze(0).expand(2, *x.shape).contiguous()
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.vmap(lambda xb: _first(fn(xb, *inputs[1:])))(batched)
    seen = []
    torch.func.vmap(lambda xb: seen.append(_apply.needs_autograd(xb)) or xb)(batched)
    assert seen == [True] and not _apply.needs_autograd(x)


@pytest.mark.parametrize("op", OPS)
def test_forward_mode_tangents_are_refused_before_the_forward_runs(op, applies):
    # the Functions define no jvp: an input with a tangent is refused, naming it, before the
    # forward launches anything or draws a dropout key (torch's own refusal comes only after
    # the forward); inside a dual level, inputs without tangents still run
    import torch.autograd.forward_ad as fwad

    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    fn = next(i for i in case.impls if i.name == "fusedlib").fn
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in case.make_inputs(DEVICE, True)]
    tangent = torch.randn_like(inputs[0])
    state = generator_state
    torch.manual_seed(0)  # (the dropout ops draw their key from the generator)
    want = _first(fn(*inputs))
    with fwad.dual_level():
        before = state()
        with pytest.raises(NotImplementedError, match="carries a forward-mode AD tangent"):
            fn(fwad.make_dual(inputs[0], tangent), *inputs[1:])
        assert torch.equal(state(), before) and applies == []
        torch.manual_seed(0)
        assert torch.equal(_first(fn(*inputs)), want)  # no tangents: the op runs, as outside the level
