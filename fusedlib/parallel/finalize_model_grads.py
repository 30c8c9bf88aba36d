"""``finalize_model_grads``: the gradient reductions a tensor-parallel model needs after ``backward``.

A parameter replicated on every tensor-parallel rank must receive the same update on every
rank, so its gradient must be the full one. Most replicated parameters get it for free: they
act on replicated activations (the norms and the row-parallel biases without sequence
parallelism, the position table). Two kinds see only a part of the data on each rank and get a
partial sum instead:

* under sequence parallelism, the norms' weights and biases and the row-parallel linears'
  biases (each rank saw its s/p tokens): marked ``param.sequence_parallel = True`` by
  :class:`~fusedlib.fusions.fused_layer_norm.FusedNorm`, ``WrappedTorchNorm`` and
  :class:`~fusedlib.parallel.layers.RowParallelLinear`;
* with ``qk_layernorm``, the query and key norms (applied per head: each rank saw its heads),
  found by name (``q_layernorm`` / ``k_layernorm``), as Megatron-core does.

:func:`finalize_model_grads` sums those over the tensor-parallel group (one all-reduce per
dtype, of the gradients flattened into one buffer), then, with data parallelism (world size
> p), averages every gradient over the data-parallel group. Call it after ``loss.backward()``
and before the optimizer step, on every rank. Split parameters (``tensor_model_parallel``)
need nothing: each rank owns its shard and its shard's gradient.

Differences from Megatron-core: no distributed-data-parallel wrapper (no bucketing or overlap
with the backward: the data-parallel average is one flat all-reduce per dtype after it),
``.grad`` only (no ``main_grad``), no pipeline (embedding) or MoE reductions, no loss scaling
by the number of tokens.

Source: Megatron-LM ``megatron/core/distributed/finalize_model_grads.py``
(``finalize_model_grads``, ``_allreduce_non_tensor_model_parallel_grads``).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import parallel_state
from .utils import _record

__all__ = ["finalize_model_grads", "grads_to_sum_over_tensor_parallel_ranks"]


def _modules(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def _config_of(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        config = getattr(getattr(model, "module", None), "config", None)  # Float16Module holds one too
    return config


def grads_to_sum_over_tensor_parallel_ranks(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]
                                            ) -> List[tuple[str, torch.nn.Parameter]]:
    """The ``(name, parameter)`` pairs whose gradients :func:`finalize_model_grads` sums over
    the tensor-parallel group: marked ``sequence_parallel`` (when the model's
    ``config.sequence_parallel``), or a q/k layernorm's (when ``config.qk_layernorm``); only
    those that require grad.

    Args:
        model: a module with a ``config`` (a :class:`~fusedlib.transformer.TransformerConfig`),
            or a list of them.

    Raises:
        ValueError: a module without a config.

    Source: Megatron-LM ``megatron/core/distributed/finalize_model_grads.py``
    (``_allreduce_non_tensor_model_parallel_grads``: its choice of the grads to sum).
    """
    out = []
    for module in _modules(model):
        config = _config_of(module)
        if config is None:
            raise ValueError(f"finalize_model_grads: {type(module).__name__} has no .config (a TransformerConfig)")
        for name, param in module.named_parameters():
            if not param.requires_grad or getattr(param, "tensor_model_parallel", False):
                continue
            if (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                out.append((name, param))
    return out


def _all_reduce_flat(grads: List[torch.Tensor], group, average: bool) -> None:
    """Sum (or average) ``grads`` over ``group`` in place: one all-reduce per dtype and device of a
    flat buffer (gloo has no AVG: divide after the SUM)."""
    by_kind: dict[tuple, List[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for bucket in by_kind.values():
        flat = _flatten_dense_tensors(bucket)
        _record("all_reduce", "SUM", flat)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if average:
            flat.div_(group.size())
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)


def finalize_model_grads(model: Union[torch.nn.Module, Iterable[torch.nn.Module]],
                         tp_group: Optional[dist.ProcessGroup] = None,
                         dp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Complete the gradients after ``backward``, in place, on every rank (see the module docstring).

    1. Sum over the tensor-parallel group the gradients of
       :func:`grads_to_sum_over_tensor_parallel_ranks` (parameters with ``grad`` None are skipped,
       the same on every rank).
    2. With a data-parallel group of more than one rank, average every gradient over it.

    Nothing happens on one rank (a model with ``config.tensor_model_parallel_size = 1``, no data
    parallelism): no collective.

    Args:
        model: a module with a ``config``, or a list of them (Megatron-core takes a list of
            model chunks).
        tp_group: the tensor-parallel group (None: :mod:`parallel_state`'s; unused for a model of
            tensor-parallel size 1).
        dp_group: the data-parallel group (None: :mod:`parallel_state`'s).

    Raises:
        ValueError: a module without a config where the run is tensor-parallel (``tp_group`` of
            more than one rank, or parallel_state's tensor-parallel size above 1).

    Source: Megatron-LM ``megatron/core/distributed/finalize_model_grads.py``.
    """
    initialized = parallel_state.model_parallel_is_initialized()
    modules = _modules(model)
    tensor_parallel_run = (tp_group is not None and tp_group.size() > 1) or (
        initialized and parallel_state.get_tensor_model_parallel_world_size() > 1)
    if tensor_parallel_run and any(_config_of(m) is None for m in modules):
        # (a model of parallel layers without a config got no tensor-parallel all-reduce, silently)
        bad = next(m for m in modules if _config_of(m) is None)
        raise ValueError(f"finalize_model_grads: a module without a config ({type(bad).__name__}) in a "
                         f"tensor-parallel run: its tensor_model_parallel_size decides which gradients are summed "
                         f"over the ranks (give the model a TransformerConfig as .config)")
    split = any(_config_of(m) is not None and _config_of(m).tensor_model_parallel_size > 1 for m in modules)
    if tp_group is None and initialized and split:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if dp_group is None and initialized:
        dp_group = parallel_state.get_data_parallel_group()
    if split and tp_group is not None and tp_group.size() > 1:
        grads = [p.grad for _, p in grads_to_sum_over_tensor_parallel_ranks(model) if p.grad is not None]
        if grads:
            _all_reduce_flat(grads, tp_group, average=False)
    if dp_group is not None and dp_group.size() > 1:
        grads = [p.grad for m in _modules(model) for p in m.parameters() if p.grad is not None]
        if grads:
            _all_reduce_flat(grads, dp_group, average=True)
