"""Layerwise CUDA graphs: a block's layers replayed as captured graphs (``cuda_graph_impl="local"``).

A fused layer launches a few dozen kernels per training step, and in eager PyTorch each launch
costs host time: the Python of the op, the autograd node, the launch itself. When the GPU work
per step is small (GPT-2-small-sized layers, short sequences) the host is slower than the GPU
and sets the step time. A CUDA graph records the kernels of one call once and replays them all
with a single launch, so the host cost of a layer's forward (and of its backward) becomes one
graph launch, whatever the layer does.

:class:`CudaGraphManager` does this for the layers of a
:class:`~fusedlib.transformer.transformer_block.TransformerBlock` with PyTorch's
``torch.cuda.make_graphed_callables``: at the block's first training call for an input
signature (shapes, dtypes, which optional tensors are given), every layer's forward and
backward are captured, in the order they run (forward 1..N, backward N..1) into one memory
pool; later calls with that signature replay them. Each captured layer is an
``autograd.Function`` whose backward replays the layer's backward graph, so the block's
gradients reach its parameters and its input as in eager mode.

What a graph fixes at capture, and what the manager does about it:

* shapes and dtypes: the signature is the cache key; a new one is captured once (each keeps
  its own memory pool: activations of one step, and the static buffers);
* the parameters' storage: each call checks their ``data_ptr`` against the capture's (moving
  the block with ``.to()`` recaptures; optimizers and ``load_state_dict`` write in place, which
  the graphs see). A parameter replaced by a new ``Parameter`` object is not seen: call
  :meth:`~fusedlib.transformer.transformer_block.TransformerBlock.reset_cuda_graphs` after it;
* random numbers: dropout draws its Philox seeds with ``torch.randint`` on the device, which a
  graph replays with a fresh offset of the CUDA generator each time, so every replay draws new
  masks (the forward's seeds are saved for its backward, as in eager mode); the capture's
  warm-up iterations run under ``torch.random.fork_rng``, so a graphed block consumes the
  generator exactly as the eager block does and draws the same masks;
* static buffers: a replay overwrites the previous call's activations, so a second training
  forward before the first one's backward would leave that backward reading the wrong step.
  The manager refuses it (RuntimeError) instead of returning wrong gradients, unless the first
  forward's autograd graph is gone (its output dropped: no backward can come). Call
  ``backward()`` first, or run the forward without autograd (``torch.no_grad()``, ``eval()``),
  which takes the eager path;
* the gradients a backward graph returns live in its static buffers too, and autograd would
  keep them as the parameters' ``.grad`` as they are, so the next replay would overwrite them
  (or, with gradient accumulation, add a step's gradient to itself). A hook on each captured
  layer's autograd node hands autograd copies instead (one multi-tensor kernel per layer),
  as an eager backward's gradients are new tensors.

On torch 2.11 autograd warns, at the first backward after a capture, that "the
AccumulateGrad node's stream does not match the stream of the node that produced the incoming
gradient": the parameters' gradient accumulators were made during the capture, on its side
stream, and the captured graphs keep them alive, so each later backward synchronises the two
streams for them. The results are unaffected (the tests compare them bit for bit with the eager
block's); making the accumulators on the caller's stream before the capture instead makes the
capture itself fail, since the capture's backward would then wait on the caller's stream.

The eager layers run instead of the graphs in evaluation mode, without grad, while
``torch.compile`` traces, and while the current stream is already being captured (a graph of
the whole step captures the same kernels directly).

Differences from Megatron-core: its "local" implementation (``CudaGraphManager`` in
``megatron/core/transformer/cuda_graphs.py``) records graphs per layer with its own runner
classes, warms up for ``cuda_graph_warmup_steps`` training steps and supports pipeline
micro-batches; fusedlib uses PyTorch's ``make_graphed_callables`` (its warm-up iterations
are ``cuda_graph_warmup_steps``), one forward-backward pair at a time, tensor parallel size 1,
no recomputation, no cross-attention context.

Sources: Megatron-LM ``megatron/core/transformer/cuda_graphs.py``; PyTorch
``torch/cuda/graphs.py`` (``make_graphed_callables``) and its CUDA-graphs notes.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

__all__ = ["CudaGraphManager", "GRAPHABLE_KWARGS", "copy_gradients"]

#: The layer-forward keyword arguments a captured layer takes (tensors or None).
GRAPHABLE_KWARGS: tuple[str, ...] = ("attention_mask", "rotary_pos_emb", "attention_bias")


class _LayerCall(torch.nn.Module):
    """A layer as a function of tensors only, for ``make_graphed_callables``:
    ``forward(hidden_states, *tensors) -> hidden_states``, the tensors being the keyword
    arguments ``names`` in order. Holds the layer as a submodule, so its parameters are the
    graph's parameters; ``make_graphed_callables`` replaces this module's ``forward``, not the
    layer's (the layer keeps its eager forward)."""

    def __init__(self, layer: torch.nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.layer = layer
        self.names = tuple(names)

    def forward(self, hidden_states: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        out, _ = self.layer(hidden_states, **dict(zip(self.names, tensors)))
        return out


class _Token:
    """An object only a graphed forward's autograd graph holds (see ``CudaGraphManager._pending``)."""


def copy_gradients(grads: tuple) -> tuple:
    """``grads`` with each tensor replaced by a copy, None kept: what an autograd-node hook on a
    graphed layer returns, so that autograd keeps new tensors rather than the backward graph's
    static buffers. One ``torch._foreach_mul`` by 1 (exact in every float dtype) for all of them.

    Args:
        grads: a node's gradients (tensors of any shape and float dtype, or None).

    Returns:
        A tuple of the same length: copies, and None where ``grads`` has None.
    """
    present = [g for g in grads if g is not None]
    copies = iter(torch._foreach_mul(present, 1.0)) if present else iter(())
    return tuple(None if g is None else next(copies) for g in grads)


class CudaGraphManager:
    """Captures and replays a block's layers as CUDA graphs (see the module docstring).

    Args:
        warmup_steps: eager iterations ``make_graphed_callables`` runs on a side stream before
            each capture (``config.cuda_graph_warmup_steps``; >= 0).

    Call :meth:`run` from the block's forward; :meth:`reset` drops every captured graph.

    Source: Megatron-LM ``megatron/core/transformer/cuda_graphs.py`` (the role); PyTorch
    ``torch.cuda.make_graphed_callables`` (the capture).
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = int(warmup_steps)
        # input signature -> (the graphed layers, the parameters they read, their data_ptrs then)
        self._graphs: dict[tuple, tuple[list[_LayerCall], list[torch.nn.Parameter], list[int]]] = {}
        # the last graphed forward whose backward has not started: a weak reference to a token
        # that only that forward's autograd graph holds (dead once the graph is freed)
        self._pending: Optional[weakref.ref] = None
        self.captures = 0  # how many signatures were captured (tests and the book read it)

    def reset(self) -> None:
        """Drop every captured graph (and their memory pools, once nothing else holds them)."""
        self._graphs.clear()
        self._pending = None

    @staticmethod
    def applies(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
        """Whether a call takes the graphed path: training mode, grad enabled, not tracing with
        ``torch.compile``, the current stream not already capturing."""
        return (module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()))

    def run(self, layers: Sequence[torch.nn.Module], hidden_states: torch.Tensor,
            kwargs: dict[str, Optional[torch.Tensor]]) -> torch.Tensor:
        """The layers' output [s, b, h] for ``hidden_states`` [s, b, h], through the graphs of
        this signature (captured first if new).

        Args:
            layers: the block's layers, in order (each ``layer(hidden_states, **kwargs)``
                returns ``(hidden_states, context)``).
            hidden_states: the first layer's input, on a CUDA device.
            kwargs: :data:`GRAPHABLE_KWARGS` -> a tensor or None; other layer arguments must be
                None (the caller checks).

        Returns:
            The last layer's output [s, b, h], hidden_states' dtype: the last graph's static
            output buffer, which the next replay overwrites (the block's final norm reads it
            within the step, or the block returns a copy).

        Raises:
            ValueError: ``hidden_states`` not on a CUDA device.
            RuntimeError: a second graphed forward while the first one's autograd graph is
                alive and its backward has not started, or the capture failed (with PyTorch's
                reason).
        """
        if not hidden_states.is_cuda:
            raise ValueError("cuda_graph_impl='local' captures CUDA graphs: hidden_states must be on a CUDA device, "
                             f"got {hidden_states.device}")
        if self._pending is not None and self._pending() is not None:
            raise RuntimeError("cuda_graph_impl='local': the block ran a training forward again before the backward of "
                               "the previous one; its graphs keep one step's activations, so call backward() on the "
                               "previous output first, or run forwards without a backward under torch.no_grad() or "
                               "in eval(); after an interrupted step, call block.reset_cuda_graphs()")
        names = tuple(n for n in GRAPHABLE_KWARGS if kwargs.get(n) is not None)
        tensors = tuple(kwargs[n] for n in names)
        key = (tuple(hidden_states.shape), hidden_states.dtype, hidden_states.device, hidden_states.requires_grad,
               tuple((n, tuple(t.shape), t.dtype, t.device, t.requires_grad) for n, t in zip(names, tensors)))
        entry = self._graphs.get(key)
        # the graphs read the parameters where they were at the capture: moved (``.to()``), the
        # parameters need new graphs (all of them: every signature's graphs read the old place)
        if entry is not None and [p.data_ptr() for p in entry[1]] != entry[2]:
            self._graphs.clear()
            entry = None
        if entry is None:
            params = [p for layer in layers for p in layer.parameters()]
            if not (hidden_states.requires_grad or any(p.requires_grad for p in params)):
                return self._eager(layers, hidden_states, names, tensors)  # no backward graph to capture
            calls = self._capture(layers, hidden_states, names, tensors)
            entry = self._graphs[key] = (calls, params, [p.data_ptr() for p in params])
        calls = entry[0]
        token = _Token()

        def own_gradients(grad_inputs, grad_outputs, token=token):  # the graph holds the token
            return copy_gradients(grad_inputs)

        for call in calls:
            hidden_states = call.forward(hidden_states, *tensors)  # make_graphed_callables' replaying forward
            hidden_states.grad_fn.register_hook(own_gradients)
        self._pending = weakref.ref(token)
        hidden_states.register_hook(self._backward_started)
        return hidden_states

    def _backward_started(self, grad: torch.Tensor) -> None:
        self._pending = None

    @staticmethod
    def _eager(layers, hidden_states, names, tensors):
        kw = dict(zip(names, tensors))
        for layer in layers:
            hidden_states, _ = layer(hidden_states, **kw)
        return hidden_states

    def _capture(self, layers, hidden_states, names, tensors) -> list[_LayerCall]:
        """Every layer's forward and backward graph, sharing one memory pool."""
        calls = tuple(_LayerCall(layer, names) for layer in layers)
        # inputs of the samples are copies: make_graphed_callables later copies each call's
        # inputs into its samples, which must not be the caller's tensors
        extra = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        first = hidden_states.detach().clone().requires_grad_(hidden_states.requires_grad)
        samples = [(first, *extra)]
        for _ in calls[1:]:  # a later layer's input is the previous output, which requires grad
            samples.append((hidden_states.detach().clone().requires_grad_(True), *extra))
        try:
            # the warm-up iterations draw dropout seeds: restore the generator afterwards, so a
            # graphed run draws the same random numbers as an eager one (and a resumed run as
            # an uninterrupted one)
            with torch.random.fork_rng(devices=[hidden_states.device]):
                graphed = torch.cuda.make_graphed_callables(calls, tuple(samples),
                                                            num_warmup_iters=self.warmup_steps)
        except Exception as exc:  # a kernel that cannot be captured, out of memory...
            raise RuntimeError(f"cuda_graph_impl='local': capturing the layers as CUDA graphs failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        self.captures += 1
        return list(graphed)
