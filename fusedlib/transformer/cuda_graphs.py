"""CUDA graphs of a block's layers: the layers and the final norm replayed as two captured graphs
(``cuda_graph_impl="local"``).

A fused layer launches a few dozen kernels per training step, and in eager PyTorch each launch
costs host time: the Python of the op, the autograd node, the launch itself. When the GPU work
per step is small (GPT-2-small-sized layers, short sequences) the host is slower than the GPU
and sets the step time. A CUDA graph records the kernels of one call once and replays them all
with a single launch, so the host cost of the layers' forward (and of their backward) becomes
one graph launch, whatever the layers do.

:class:`CudaGraphManager` does this for the layers of a
:class:`~fusedlib.transformer.transformer_block.TransformerBlock` with PyTorch's
``torch.cuda.make_graphed_callables``: at the block's first training call for an input
signature, the forward of every layer and of the final norm is captured as one graph and their
backward as another, in one memory pool; later calls with that signature replay them. The
captured stack is one ``autograd.Function`` whose backward replays the backward graph, so the
block's gradients reach its parameters and its input as in eager mode.

Why one graph pair for the whole stack rather than one per layer: each graphed call is a Python
``autograd.Function`` with every parameter of what it holds as an input, a copy of its input
into the graph's buffer, a graph launch and (here) a hook that copies its gradients, once in
the forward and once in the backward. On the H200 machine of the book, for the 4-layer stack
[s, b, h] = [512, 8, 512] (bf16, SDPA), the host time of a training step's forward and backward
calls was 1.35 and 2.17 ms with a graph pair per layer (and the final norm eager), 0.51 and
1.23 ms with one pair, and the plain-launch step took 3.34 and 1.84 ms (two processes on one
machine, the rest of the code the same).
Nothing in a training step of one forward and one backward needs the layer boundaries.

What a graph fixes at capture, and what the manager does about it:

* the input signature: the shape, dtype, device and ``requires_grad`` of the hidden states and
  of each given mask, rotary-angle and attention-bias tensor, autocast's state and the training
  flag of each layer and of the final norm form the cache key; a new one is captured once, and
  at most :data:`MAX_SIGNATURES` are kept (each keeps its own memory pool: one step's
  activations and the static buffers), the least recently used dropped first;
* the modules and their parameters: each call checks that the layers and the final norm are
  the module objects captured, and that every captured parameter is still the same
  ``Parameter`` object under its name, at the same storage, with the same ``requires_grad``; a
  layer or the final norm replaced, parameters moved (``.to()``), replaced
  (``load_state_dict(..., assign=True)``), frozen or unfrozen, the stack is captured again.
  Optimizers and ``load_state_dict`` write in place, which the graphs see. A parameter or
  submodule *added* inside a layer or the final norm after the capture is not seen: call
  :meth:`~fusedlib.transformer.transformer_block.TransformerBlock.reset_cuda_graphs` after it;
* Python: a graph replays kernels only, so module hooks on a layer, the final norm or their
  submodules (or global module hooks) would run only during the capture, and a tensor hook on
  a parameter (``register_hook``) would be held in the backward graph and applied by autograd
  once more; the manager refuses both at every call (NotImplementedError; hooks on the block
  itself are fine, as are ``register_post_accumulate_grad_hook`` hooks). Settings a
  layer reads from Python at each call are fixed at the capture as well (a config field
  changed afterwards, an SDPA backend choice): reset the graphs after changing one;
* random numbers: dropout draws its Philox seeds with ``torch.randint`` on the device, which a
  graph replays with a fresh offset of the CUDA generator each time, so every replay draws new
  masks (the forward's seeds are saved for its backward, as in eager mode); the capture's
  warm-up iterations run under ``torch.random.fork_rng``, so a graphed block consumes the
  generator exactly as the eager block does and draws the same masks;
* static buffers: a replay overwrites the previous call's activations and output (the block
  returns a copy of the output), so a second training
  forward before the first one's backward would leave that backward reading the wrong step.
  The manager refuses it (RuntimeError) instead of returning wrong gradients, unless the first
  forward's autograd graph is gone (its output dropped: no backward can come). Call
  ``backward()`` first, or run the forward without autograd (``torch.no_grad()``, ``eval()``),
  which takes the eager path. A backward of an earlier forward after a later one (a graph kept
  with ``retain_graph``) is refused in the backward (a pre-hook on the stack's node);
* the gradients a backward graph returns live in its static buffers too, and autograd would
  keep them as the parameters' ``.grad`` as they are, so the next replay would overwrite them
  (or, with gradient accumulation, add a step's gradient to itself). A hook on the captured
  stack's autograd node hands autograd copies instead (one multi-tensor kernel), as an eager
  backward's gradients are new tensors;
* the device: a capture belongs to the current CUDA device, so the manager captures and
  replays with the hidden states' device current;
* a failed capture leaves PyTorch's CUDA generators in capture mode, after which every random
  draw of the process fails, the capture's side stream as the current stream, and the caching
  allocator routing to the capture's memory pool (``empty_cache`` then frees none of the
  default pools' memory): the manager takes the generators out of capture mode, makes the
  caller's stream current again and ends the routing
  (:func:`fusedlib.runtime.restore_after_failed_capture`) before raising.
* Python's garbage collector: ``make_graphed_callables`` holds the graphs in an
  ``autograd.Function`` class it defines per call, and a class is part of a reference cycle,
  so an earlier capture's graphs are freed only by the cyclic collector, whenever it next
  runs, which could be inside a later capture (a likely, not proven, cause of rare capture
  failures under the GPU tests). ``torch.cuda.graph`` used to collect before every capture and
  now does so only with ``torch.compiler.config.force_cudagraph_gc``; the manager runs
  ``gc.collect()`` before each capture and keeps the collector off during it
  (:func:`fusedlib.runtime.collector_paused_for_capture`). The collection costs host time once
  per capture (per signature), not per step.

On torch 2.11 autograd warns, at the first backward after a capture, that "the
AccumulateGrad node's stream does not match the stream of the node that produced the incoming
gradient": the parameters' gradient accumulators were made during the capture, on its side
stream, and the captured graphs keep them alive, so a later backward "may incur unnecessary
synchronization" between the two streams (autograd's words). The results are unaffected (the
tests compare them bit for bit with the eager block's); making the accumulators on the caller's
stream before the capture instead makes the capture itself fail, since the capture's backward
would then wait on the caller's stream.

The eager layers run instead of the graphs in evaluation mode, without grad, on a CUDA device
when nothing in the layers, the final norm or their input requires grad (there is no backward
to capture), while ``torch.compile`` traces (a compiled block has no layer graphs: use
``torch.compile``'s own, ``mode="reduce-overhead"``), and while the device's current stream is
already being captured (a graph of the whole step captures the same kernels directly).

Differences from Megatron-core: its "local" implementation (``CudaGraphManager`` in
``megatron/core/transformer/cuda_graphs.py``) records graphs per layer with its own runner
classes (pipeline schedules interleave the layers of several micro-batches, so a layer is its
unit there), warms up for ``cuda_graph_warmup_steps`` training steps and supports pipeline
micro-batches; fusedlib captures the layers and the final norm as one graph pair with PyTorch's
``make_graphed_callables`` (its warm-up iterations are ``cuda_graph_warmup_steps``), one
forward-backward pair at a time, tensor parallel size 1, no recomputation, no cross-attention
context.

Sources: Megatron-LM ``megatron/core/transformer/cuda_graphs.py``; PyTorch
``torch/cuda/graphs.py`` (``make_graphed_callables``) and its CUDA-graphs notes.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple, Optional, Sequence

import torch

from ..runtime import collector_paused_for_capture, restore_after_failed_capture
from .transformer_layer import _norm

__all__ = ["CudaGraphManager", "GRAPHABLE_KWARGS", "MAX_SIGNATURES"]

#: The layer-forward keyword arguments the captured layers take (tensors or None).
GRAPHABLE_KWARGS: tuple[str, ...] = ("attention_mask", "rotary_pos_emb", "attention_bias")
#: Input signatures whose graphs a manager keeps; a new one beyond this drops the least recently
#: used (each signature's graphs hold a memory pool of one step's activations).
MAX_SIGNATURES: int = 8


class _StackCall(torch.nn.Module):
    """The layers and the final norm as one function of tensors, for ``make_graphed_callables``:
    ``forward(hidden_states, *tensors) -> hidden_states``, the tensors being the keyword
    arguments ``names`` in order. Each layer's output is its hidden states (the first item where
    it returns a tuple, as a TransformerLayer returns ``(hidden_states, context)``); the final
    norm (if any) gets them through the block's eager ``_norm`` (cast to its weight's dtype). Holds
    the modules as submodules, so their parameters are the graph's parameters;
    ``make_graphed_callables`` replaces this module's ``forward``, not the layers' (they keep
    their eager forwards)."""

    def __init__(self, layers: Sequence[torch.nn.Module], final_norm: Optional[torch.nn.Module],
                 names: Sequence[str]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.final_norm = final_norm
        self.names = tuple(names)

    def forward(self, hidden_states: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        kw = dict(zip(self.names, tensors))
        for layer in self.layers:
            out = layer(hidden_states, **kw)
            hidden_states = out[0] if isinstance(out, tuple) else out
        if self.final_norm is not None:
            hidden_states = _norm(self.final_norm, hidden_states)  # (cast to its weight's dtype)
        return hidden_states


class _Token:
    """An object only a graphed forward's autograd graph holds (see ``CudaGraphManager._pending``)."""


def _copy_gradients(grads: tuple) -> tuple:
    """``grads`` with each tensor replaced by a copy, None kept: what the autograd-node hook on
    the graphed stack returns, so that autograd keeps new tensors rather than the backward
    graph's static buffers. One ``torch._foreach_mul`` by 1 (exact in every float dtype) for all
    of them.

    Args:
        grads: a node's gradients (tensors of any shape and float dtype, or None).

    Returns:
        A tuple of the same length: copies, and None where ``grads`` has None.
    """
    present = [g for g in grads if g is not None]
    copies = iter(torch._foreach_mul(present, 1.0)) if present else iter(())
    return tuple(None if g is None else next(copies) for g in grads)


class _Slot(NamedTuple):
    """Where a captured graph's parameter lives: ``params[name] is param`` as at the capture,
    with its storage and ``requires_grad`` then; ``path`` names it in errors."""
    params: dict
    name: str
    param: torch.nn.Parameter
    data_ptr: int
    requires_grad: bool
    path: str


def _named(layers: Sequence[torch.nn.Module], final_norm: Optional[torch.nn.Module]
           ) -> list[tuple[str, torch.nn.Module]]:
    """The captured modules with the block's attribute paths (``layers.0``, ..., ``final_layernorm``)."""
    named = [(f"layers.{i}", layer) for i, layer in enumerate(layers)]
    if final_norm is not None:
        named.append(("final_layernorm", final_norm))
    return named


def _slots(named: Sequence[tuple[str, torch.nn.Module]]) -> list[_Slot]:
    return [_Slot(m._parameters, n, p, p.data_ptr(), p.requires_grad, ".".join(filter(None, (prefix, path, n))))
            for prefix, module in named for path, m in module.named_modules() for n, p in m._parameters.items()
            if p is not None]


def _same_parameters(slots: Sequence[_Slot]) -> bool:
    """Whether every captured parameter is still in its place, at the same storage, with the same
    ``requires_grad``.

    Raises:
        NotImplementedError: a parameter has a tensor hook (``register_hook``): the backward
            graph would hold its effect and autograd would apply it once more.
    """
    for s in slots:
        p = s.params.get(s.name)
        if p is not s.param or p.data_ptr() != s.data_ptr or p.requires_grad != s.requires_grad:
            return False
        if p._backward_hooks:
            raise NotImplementedError(f"cuda_graph_impl='local': the captured parameter {s.path} has a tensor hook "
                                      "(register_hook); a captured backward would apply it and autograd again: "
                                      "remove it (register_post_accumulate_grad_hook is fine), or use "
                                      "cuda_graph_impl='none'")
    return True


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hook_dicts(layers: Sequence[torch.nn.Module], final_norm: Optional[torch.nn.Module] = None
                ) -> list[tuple[str, str, tuple]]:
    """(path, class name, the module's four hook dicts) of every module of ``layers`` and of
    ``final_norm``: the dicts stay the same objects while hooks come and go, so a later check
    reads them directly."""
    return [(prefix + (f".{path}" if path else ""), type(m).__name__,
             tuple(getattr(m, h) for h in _MODULE_HOOKS if hasattr(m, h)))
            for prefix, module in _named(layers, final_norm) for path, m in module.named_modules()]


def _check_no_hooks(hook_dicts: Sequence[tuple[str, str, tuple]]) -> None:
    """Module hooks are Python, which a graph does not replay: they would run only during the
    capture. Checked at every call (a hook added after the capture would be skipped silently).

    Args:
        hook_dicts: :func:`_hook_dicts` of the layers and the final norm.

    Raises:
        NotImplementedError: a global module hook, or a hook on a module of the layers or the
            final norm (named by its path, e.g. ``layers.1.mlp.linear_fc1``).
    """
    from torch.nn.modules import module as module_mod

    for name in _GLOBAL_HOOKS:
        if getattr(module_mod, name, None):
            raise NotImplementedError(f"cuda_graph_impl='local': a global module hook is registered "
                                      f"(torch.nn.modules.module.{name}); the graphed layers would run it only "
                                      "during the capture: remove it, or use cuda_graph_impl='none'")
    for where, cls, hooks in hook_dicts:
        if any(hooks):
            raise NotImplementedError(f"cuda_graph_impl='local': {where} ({cls}) has a module hook; a CUDA graph "
                                      "replays kernels, not Python, so the hook would run only during the capture: "
                                      "remove it, or use cuda_graph_impl='none'")


def _on(device: torch.device):
    """``torch.cuda.device(device)`` where it is not the current device already (a capture and
    its streams belong to the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class _Entry(NamedTuple):
    call: _StackCall
    modules: tuple  # the layers and the final norm captured, in order
    slots: list[_Slot]
    hooks: list


class CudaGraphManager:
    """Captures and replays a block's layers as CUDA graphs (see the module docstring).

    Args:
        warmup_steps: eager iterations ``make_graphed_callables`` runs on a side stream before
            each capture (``config.cuda_graph_warmup_steps``; >= 1).
        capture: a stand-in for ``torch.cuda.make_graphed_callables`` (same arguments, the
            ``pool`` keyword included; same kind of result), None for the real one. With a
            stand-in the manager runs on any device: the tests check its bookkeeping on a CPU
            with one that replays eagerly.

    Call :meth:`run` from the block's forward; :meth:`reset` drops every captured graph.
    ``captures`` counts the signatures captured so far.

    Source: Megatron-LM ``megatron/core/transformer/cuda_graphs.py`` (the role); PyTorch
    ``torch.cuda.make_graphed_callables`` (the capture).
    """

    def __init__(self, warmup_steps: int = 3, capture=None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self._capture_fn = capture
        # input signature -> the graphed layers and where their parameters were at the capture,
        # least recently used first
        self._graphs: dict[tuple, _Entry] = {}
        # the last graphed forward whose backward has not started: a weak reference to a token
        # that only that forward's autograd graph holds (dead once the graph is freed)
        self._pending: Optional[weakref.ref] = None
        # forwards so far: a backward replays the graphs only for the latest one
        self._generation = 0
        self.captures = 0

    def reset(self) -> None:
        """Drop every captured graph (and their memory pools, once nothing else holds them)."""
        self._graphs.clear()
        self._pending = None

    @staticmethod
    def applies(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
        """Whether a call takes the graphed path: training mode, grad enabled, not tracing with
        ``torch.compile``, the stream of ``hidden_states``' device not already capturing."""
        if not (module.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return False
        if hidden_states.is_cuda:
            with _on(hidden_states.device):
                return not torch.cuda.is_current_stream_capturing()
        return True

    def run(self, layers: Sequence[torch.nn.Module], hidden_states: torch.Tensor,
            kwargs: dict[str, Optional[torch.Tensor]], final_norm: Optional[torch.nn.Module] = None
            ) -> torch.Tensor:
        """``final_norm(layers(hidden_states))`` [s, b, h] for ``hidden_states`` [s, b, h],
        through the graphs of this signature (captured first if new).

        The signature: the shape, dtype, device and ``requires_grad`` of ``hidden_states`` and
        of each given tensor of ``kwargs``, autocast's state, and the training flag of each
        layer and of the final norm. The graphs of a signature are used only while every
        parameter they captured is still in its place (the same ``Parameter`` object under the
        same name), at the same storage, with the same ``requires_grad``; otherwise every
        signature is captured again.

        Args:
            layers: the block's layers, in order (each ``layer(hidden_states, **kwargs)``
                returns ``(hidden_states, context)``, or the hidden states alone).
            hidden_states: the first layer's input, on a CUDA device.
            kwargs: :data:`GRAPHABLE_KWARGS` -> a tensor or None; other layer arguments must be
                None (the caller checks).
            final_norm: applied to the last layer's output (cast to its weight's dtype first)
                inside the same graphs; None for none.

        Returns:
            A new tensor [s, b, h] (a copy of the forward graph's static output buffer, which
            the next replay overwrites), in the final norm's dtype (without one,
            hidden_states').

        Raises:
            ValueError: ``hidden_states`` not on a CUDA device.
            NotImplementedError: a module hook on a layer, on the final norm or on one of their
                submodules, a global module hook, or a tensor hook on one of their parameters
                (the graphs would not run them as eager mode does).
            RuntimeError: a second graphed forward while the first one's autograd graph is
                alive and its backward has not started; (in the backward) a backward of an
                earlier forward than the latest one (``retain_graph``); the capture failed
                (with PyTorch's reason; the caller's stream is current again, the allocator's
                routing to the capture's pool is ended and the CUDA generators are taken out of
                capture mode).
        """
        if self._capture_fn is None and not hidden_states.is_cuda:
            raise ValueError("cuda_graph_impl='local' captures CUDA graphs: hidden_states must be on a CUDA device, "
                             f"got {hidden_states.device}")
        if self._pending is not None and self._pending() is not None:
            raise RuntimeError("cuda_graph_impl='local': the block ran a training forward again before the backward of "
                               "the previous one; its graphs keep one step's activations, so call backward() on the "
                               "previous output first, or run forwards without a backward under torch.no_grad() or "
                               "in eval(); after an interrupted step, call block.reset_cuda_graphs(). (A graphed "
                               "block cannot run inside torch.utils.checkpoint, which runs its forward again during "
                               "the backward.)")
        names = tuple(n for n in GRAPHABLE_KWARGS if kwargs.get(n) is not None)
        tensors = tuple(kwargs[n] for n in names)
        modules = tuple(layers) if final_norm is None else (*layers, final_norm)
        dev = hidden_states.device
        key = (tuple(hidden_states.shape), hidden_states.dtype, dev, hidden_states.requires_grad,
               tuple((n, tuple(t.shape), t.dtype, t.device, t.requires_grad) for n, t in zip(names, tensors)),
               torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type),
               tuple(m.training for m in modules), final_norm is not None)
        entry = self._graphs.get(key)
        # the graphs run the modules and read the parameters they captured: a layer or the final
        # norm replaced, or parameters moved (``.to()``), replaced or (un)frozen, need new graphs
        # (all of them: each signature's hold the old ones)
        if entry is not None:
            _check_no_hooks(entry.hooks)
            if (len(entry.modules) != len(modules) or any(a is not b for a, b in zip(entry.modules, modules))
                    or not _same_parameters(entry.slots)):
                self._graphs.clear()
                entry = None
        if entry is None:
            slots = _slots(_named(layers, final_norm))
            if not (hidden_states.requires_grad or any(s.requires_grad for s in slots)):
                # no backward graph to capture
                return _StackCall(layers, final_norm, names)(hidden_states, *tensors)
            hooks = _hook_dicts(layers, final_norm)
            _check_no_hooks(hooks)
            _same_parameters(slots)  # (refuses tensor hooks on the parameters)
            with _on(dev):
                call = self._capture(_StackCall(layers, final_norm, names), hidden_states, tensors)
            while len(self._graphs) >= MAX_SIGNATURES:
                self._graphs.pop(next(iter(self._graphs)))  # the least recently used
            entry = _Entry(call, modules, slots, hooks)
        self._graphs.pop(key, None)
        self._graphs[key] = entry  # (re)inserted last: the most recently used
        self._generation += 1
        generation, token = self._generation, _Token()

        def latest_only(grad_outputs, generation=generation):
            if generation != self._generation:
                raise RuntimeError("cuda_graph_impl='local': a backward through the block's graphs for an earlier "
                                   "forward than the latest one (retain_graph?): the later forward's replay has "
                                   "overwritten the activations it needs")

        def copies(grad_inputs, grad_outputs, token=token):  # the autograd graph holds the token
            return _copy_gradients(grad_inputs)

        with _on(dev):
            out = entry.call.forward(hidden_states, *tensors)  # make_graphed_callables' replaying forward
        node = out.grad_fn
        if node is None:  # (nothing in the stack or its input requires grad: no backward to guard)
            return out.clone()
        node.register_prehook(latest_only)
        node.register_hook(copies)
        self._pending = weakref.ref(token)
        out.register_hook(self._backward_started)
        return out.clone()  # (the buffer is the graph's: the next replay overwrites it)

    def _backward_started(self, grad: torch.Tensor) -> None:
        self._pending = None

    def _capture(self, call: _StackCall, hidden_states: torch.Tensor, tensors: tuple) -> _StackCall:
        """The stack's forward and backward graphs (one memory pool), ``call`` with its forward
        replaced by the replaying one."""
        # the sample inputs are copies: make_graphed_callables later copies each call's inputs
        # into its samples, which must not be the caller's tensors
        sample = (hidden_states.detach().clone().requires_grad_(hidden_states.requires_grad),
                  *(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors))
        # the warm-up iterations draw dropout seeds: restore the generator afterwards, so a
        # graphed run draws the same random numbers as an eager one (and a resumed run as an
        # uninterrupted one)
        capture = self._capture_fn or torch.cuda.make_graphed_callables
        # earlier captures' graphs are freed by the cyclic collector: now, not inside the capture
        with collector_paused_for_capture(), \
                torch.random.fork_rng(devices=[hidden_states.device] if hidden_states.is_cuda else []):
            try:
                # a failed capture leaves its side stream current, the allocator routing to its
                # pool and the generators in capture mode (every later random draw would fail):
                # all put back before the error
                with restore_after_failed_capture(hidden_states.device) as pool:
                    graphed = capture((call,), (sample,), num_warmup_iters=self.warmup_steps, pool=pool)
            except Exception as exc:  # a kernel that cannot be captured, out of memory...
                # a failed capture's exit raises its own error ("operation failed due to a previous
                # error during capture"), the layer's (a host sync, say) only its context: name both
                cause = exc.__context__
                inside = f" (inside the capture: {type(cause).__name__}: {cause})" if cause is not None else ""
                raise RuntimeError(f"cuda_graph_impl='local': capturing the layers as CUDA graphs failed: "
                                   f"{type(exc).__name__}: {exc}{inside}") from exc
        self.captures += 1
        return graphed[0]
