"""``apply``: a fused op's ``autograd.Function``, skipped when autograd has nothing to record.

``Function.apply`` costs about 9 us of host time per call on the H200 machine (binding,
functorch checks, building the graph node), paid even under ``torch.no_grad()`` or when no
input requires grad, where the node is thrown away. :func:`apply` calls the Function's
``forward`` directly in those cases, with a stand-in ``ctx`` that keeps attributes and
ignores ``save_for_backward`` and the other ``ctx`` calls (nothing will run a backward),
and ``Function.apply`` otherwise. The result is the same tensor either way (one forward
launch); only the bookkeeping differs.

The Function path is kept whenever autograd may need it:

* grad mode is on and a tensor argument requires grad;
* ``torch.compile`` is tracing (Dynamo turns the Function into its own graph node: keep what
  it sees unchanged);
* a forward-mode AD level is active (``torch.autograd.forward_ad.dual_level``): the Functions
  define no ``jvp``; an argument with a tangent is refused before the forward runs (nothing
  launched, no random numbers drawn) instead of the tangents being dropped;
* a ``torch.func`` transform is active (``vmap``, ``grad``, ``jacrev``...): the Functions do not
  support them, and ``Function.apply`` says so (the kernels would get batched tensors, which have
  no storage).

Source: PyTorch ``torch/autograd/function.py`` (``Function.apply``, ``FunctionCtx``).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.function import once_differentiable as _torch_once_differentiable

from ..checks import check_dense

__all__ = ["apply", "needs_autograd", "in_transform", "InferenceCtx", "once_differentiable", "keep_graph_anchor"]

Tensor = torch.Tensor

# Function.apply itself (a classmethod of torch.autograd.Function): called as _FUNCTION_APPLY(cls,
# *args), it is what cls.apply is unless cls overrides apply (the softmax Functions do, to take
# this module's fast path when called as Megatron calls them, ``Cls.apply(...)``).
_FUNCTION_APPLY = torch.autograd.Function.apply.__func__

# The innermost active torch.func transform's level, None outside any (a C call, ~0.1 us).
_functorch_level = torch._C._functorch.maybe_current_level


class InferenceCtx:
    """Stands in for the ``ctx`` of a Function's ``forward`` when no backward will run: it
    keeps the attributes ``forward`` sets (some forwards read them back) and ignores the
    ``ctx`` calls. ``needs_input_grad`` is all False."""

    def __init__(self, n_inputs: int) -> None:
        self.needs_input_grad = (False,) * n_inputs

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def in_transform() -> bool:
    """Whether a forward-mode AD level or a ``torch.func`` transform is active (where the
    Functions raise torch's error before their own argument checks could run)."""
    return _forward_ad._current_level >= 0 or _functorch_level() is not None


def needs_autograd(*args: Any) -> bool:
    """Whether a fused op called with ``args`` must go through its ``autograd.Function``.

    Args:
        *args: the Function's arguments (tensors, None, numbers...; only tensors count).

    Returns:
        True when grad mode is on and a tensor argument requires grad, when ``torch.compile``
        is tracing, when a forward-mode AD level is active, or inside a ``torch.func``
        transform; else False.
    """
    if torch.compiler.is_compiling() or in_transform():
        return True
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, Tensor) and a.requires_grad:
            return True
    return False


def apply(fn_cls: type, *args: Any) -> Any:
    """``fn_cls.apply(*args)``, or ``fn_cls.forward(ctx, *args)`` with an :class:`InferenceCtx`
    when :func:`needs_autograd` says no Function is needed.

    Args:
        fn_cls: a ``torch.autograd.Function`` subclass with a ``forward(ctx, *args)``.
        *args: its arguments, positionally.

    Returns:
        What the forward returns.

    Raises:
        Whatever the forward raises (the ops' argument checks run in it, on both paths).
        TypeError: for a nested tensor among ``args``, where the forward raised a RuntimeError
            (a nested tensor has no ``shape``: the checks' cheap happy-case test reads it first).
        NotImplementedError: a tensor argument carries a forward-mode AD tangent (the Functions
            define no ``jvp``): raised before the forward runs, so nothing is launched and no
            random numbers are drawn (``Function.apply`` would say so only after the forward).
    """
    try:
        if needs_autograd(*args):
            if torch.compiler.is_compiling():
                return fn_cls.apply(*args)  # Dynamo's own handling of Function.apply
            if _forward_ad._current_level >= 0:
                _refuse_tangents(fn_cls, args)  # before the forward: it would launch, and draw random numbers
            return _FUNCTION_APPLY(fn_cls, *args)
        return fn_cls.forward(InferenceCtx(len(args)), *args)
    except RuntimeError:
        _refuse_nested(fn_cls, args)
        raise


def _param_name(fn_cls: type, i: int) -> str:
    names = list(inspect.signature(fn_cls.forward).parameters)[1:]  # after ctx
    return names[i] if i < len(names) else f"argument {i}"


def _refuse_tangents(fn_cls: type, args: tuple) -> None:
    """Raise NotImplementedError, naming the argument, for the first tensor in ``args`` that is a
    forward-mode AD dual tensor (one with a tangent at the current level)."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and _forward_ad.unpack_dual(a).tangent is not None:
            raise NotImplementedError(
                f"{fn_cls.__name__}: {_param_name(fn_cls, i)} carries a forward-mode AD tangent, but fusedlib's "
                "fused ops have no forward-mode derivative (jvp), only the reverse mode: call the op outside "
                "torch.autograd.forward_ad.dual_level, or on tensors without tangents (nothing was computed)")


def _refuse_nested(fn_cls: type, args: tuple) -> None:
    """Raise check_dense's TypeError for the first nested tensor in ``args``, named as
    ``fn_cls.forward`` names its parameter."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.is_nested:
            check_dense(_param_name(fn_cls, i), a)


class _SavedCtx:
    """A backward's ``ctx`` whose ``saved_tensors`` were unpacked already: attribute reads and
    writes go to the real ``ctx``."""

    __slots__ = ("_ctx", "saved_tensors")

    def __init__(self, ctx: Any, saved: tuple) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", saved)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_ctx"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_ctx"), name, value)


def keep_graph_anchor(ctx: Any, t: Tensor, saved: Tensor) -> None:
    """In a Function's ``forward`` that saves ``saved`` for its input ``t``: where ``saved`` is a
    copy of a non-leaf ``t`` that requires grad (not ``t`` and no view), keep as
    ``ctx.graph_anchor`` a tensor of no elements whose node leads to ``t``'s, so that
    :func:`once_differentiable`'s raising node is reachable from tensors before ``t``. A leaf
    needs none (``ctx.next_functions`` reaches it); nothing is made inside a ``torch.compile``
    trace. The anchor holds none of ``t``'s memory (``as_strided``'s backward keeps the
    geometry, not the data).

    Source: fusedlib (for :func:`once_differentiable`'s raising node).
    """
    if saved is t or torch.compiler.is_compiling():  # (the common case first: one identity test)
        return
    if saved._base is None and t.requires_grad and t.grad_fn is not None:
        with torch.enable_grad():  # (a Function's forward runs without grad)
            ctx.graph_anchor = t.as_strided((0,), (1,)).clone()


def _graph_tensors(ctx: Any, saved: tuple) -> list:
    """Tensors through which a backward node ``ctx`` is reachable from its op's inputs: the saved
    tensors in the graph (inputs, or outputs, whose node is ``ctx``), the bases of saved views (a
    view made in the forward, ``x.reshape(...)`` under its no_grad, has no node of its own), and
    the leaf inputs (``ctx.next_functions``' AccumulateGrad nodes)."""
    found: dict[int, Tensor] = {}
    for t in saved:
        if isinstance(t, Tensor) and t.requires_grad:
            base = t._base
            if base is None or t.grad_fn is not None:  # a leaf, or a tensor with its node
                found.setdefault(id(t), t)
            if base is not None and base.requires_grad:  # (a view made under no_grad has no node)
                found.setdefault(id(base), base)
    anchor = getattr(ctx, "graph_anchor", None)  # (keep_graph_anchor's, for an input saved as a copy)
    if isinstance(anchor, Tensor):
        found.setdefault(id(anchor), anchor)
    for node, _ in getattr(ctx, "next_functions", ()):
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf tensor
        if isinstance(leaf, Tensor):
            found.setdefault(id(leaf), leaf)
    return list(found.values())


_TWICE = (b"trying to differentiate twice a function that was marked with @once_differentiable: a fusedlib "
          b"op, whose backward runs Triton kernels that autograd cannot differentiate (a second derivative "
          b"through it is not implemented)")


def once_differentiable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.function.once_differentiable``, strict: a second derivative through the
    op raises, whatever the incoming gradient.

    Torch's decorator attaches the raising node to the returned gradients only when an incoming
    gradient requires grad. With ``create_graph=True`` and an incoming gradient that does not
    (``torch.autograd.grad((out * w).sum(), x, create_graph=True)`` for a constant ``w``), the
    gradient it returns has no graph at all, and a penalty on it then silently contributes
    nothing to the second backward, although the op's second derivative is not zero. And the
    node's inputs are stand-in leaves, so ``torch.autograd.grad(penalty, x)``, which runs only
    the nodes on a path to x, never reaches it (x "unused", or None with ``allow_unused``).
    This version attaches the node whenever grad mode is on during the backward (that is,
    ``create_graph=True``), with tensors of the graph that lead to the op among its inputs (the
    saved inputs or outputs, the inputs of saved views, the leaf inputs, an anchor kept for an
    input saved as a copy), so that a use of the
    gradient in a later backward raises ``RuntimeError: trying to differentiate twice a
    function that was marked with @once_differentiable: a fusedlib op ...``: through
    ``.backward()`` always, and through ``torch.autograd.grad(..., inputs)`` wherever the node
    is on a path to ``inputs``: inputs the op saved or saved a view of, the op's own leaf
    inputs, and what leads to those. An op that saves only a copy it made of a non-leaf input (a
    non-contiguous input of ``fused_dense_gelu_dense`` or of the cross entropies, the GLUs'
    ``fp8_input_store``) keeps an anchor of it for the node (:func:`keep_graph_anchor`). A
    gradient that is only read keeps working. Under ``torch.compile`` tracing it is torch's
    decorator, unchanged.

    For the nonlinear ops (activations, norms, softmaxes, attention, cross entropy); the
    linear ones (bias-dropout-add, RoPE), whose second derivative is zero, keep torch's.

    Source: PyTorch ``torch/autograd/function.py`` (``once_differentiable``).
    """
    torch_wrapped = _torch_once_differentiable(fn)

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            # a plain backward: torch's decorator would run fn under no_grad() (already the mode;
            # the context costs about 3 us of host time) and return its outputs as they are
            return fn(ctx, *args)
        if torch.compiler.is_compiling():
            return torch_wrapped(ctx, *args)
        # the saved tensors, unpacked once (a checkpoint's unpack hook refuses a second
        # unpack) and handed to fn through a stand-in ctx
        saved = ctx.saved_tensors
        with torch.no_grad():
            outputs = fn(_SavedCtx(ctx, saved), *args)
        outs = outputs if isinstance(outputs, tuple) else (outputs,)

        def fake_requires_grad(var: Any) -> Any:  # as torch's: an alias that requires grad
            if var is not None:
                var = var.detach()
                var.requires_grad = True
            return var

        # tensors that lead to the op join the raising node's inputs: torch.autograd.grad(...,
        # inputs) runs only the nodes on a path to its inputs, and without these edges it
        # skipped the raising node (an "unused" input, or None with allow_unused=True)
        linked = _graph_tensors(ctx, saved)
        err_fn = torch._C._functions.DelayedError(_TWICE, len(outs) + len(linked))
        results = err_fn(*[fake_requires_grad(v) for v in outs], *linked)
        if not isinstance(results, tuple):
            results = (results,)
        return results[:len(outs)] if isinstance(outputs, tuple) else results[0]

    return wrapper
