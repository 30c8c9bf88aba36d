"""Gradient-norm clipping of a tensor-parallel model: the norm of the whole model, not of a shard.

Clipping by the total norm ``||g|| = sqrt(sum over parameters of ||g_p||²)`` must see every
gradient entry of the model once. With tensor parallelism each rank holds a shard of every split
parameter and a full copy of every replicated one, so the sum of squares is

    (sum over this rank's split shards + [rank 0 only] sum over replicated parameters)

summed over the tensor-parallel group (one all-reduce of one number): replicated parameters
(``param_is_not_tensor_parallel_duplicate`` False on ranks > 0) count once, as in
Megatron-core. Every rank gets the same norm, hence the same clipping coefficient, and the
p-rank model takes the one-rank model's step.

Differences from Megatron-core: the norm stays a tensor on the gradients' device (no ``.item()``,
so no host synchronisation; Megatron returns a Python float), computed with
``torch.linalg.vector_norm`` instead of Apex's multi-tensor kernel; no distributed optimizer
(data-parallel shards of the gradients are not supported: after
:func:`~fusedlib.parallel.finalize_model_grads` every data-parallel rank holds the same
gradients).

Source: Megatron-LM ``megatron/core/optimizer/clip_grads.py`` (``get_grad_norm_fp32``,
``clip_grad_by_total_norm_fp32``) and ``megatron/core/optimizer/optimizer.py`` (``clip_grad_norm``).
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from . import parallel_state
from .layers import param_is_not_tensor_parallel_duplicate
from ..checks import real_to_float, short_repr, type_name
from .utils import _record

__all__ = ["get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "clip_grad_norm"]


def get_grad_norm_fp32(grads_for_norm: Union[List[torch.Tensor], torch.Tensor], norm_type: float = 2.0,
                       grad_stats_parallel_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads_for_norm`` seen as one vector, reduced over a group.

    Args:
        grads_for_norm: this rank's gradients to count (each entry once over the group).
        norm_type: p of the p-norm (> 0), or ``math.inf`` for the largest magnitude.
        grad_stats_parallel_group: the group whose ranks hold the other parts (None or one
            rank: no communication).

    Returns:
        A 0-dim tensor on the gradients' device (the CPU for none), float32 (float64 if a
        gradient is float64: fusedlib's float64 checks).

    Raises:
        TypeError: norm_type not a real number (a bool or a str neither; a one-element floating
            tensor is read as its value).
        ValueError: norm_type <= 0 or NaN.

    Source: Megatron-LM ``megatron/core/optimizer/clip_grads.py`` (``get_grad_norm_fp32``).
    """
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    if isinstance(norm_type, torch.Tensor) and norm_type.numel() == 1 and norm_type.is_floating_point():
        norm_type = float(norm_type)  # (Megatron-core's float(norm_type) takes a one-element tensor)
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):  # (True was the 1-norm, "2" the 2-norm)
        raise TypeError(f"norm_type must be a real number > 0 (or math.inf), got {type_name(norm_type)} "
                        f"{short_repr(norm_type)}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or math.inf), got {norm_type}")
    device = grads[0].device if grads else torch.device("cpu")
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    zero = torch.zeros((), dtype=acc, device=device)
    if norm_type == math.inf:
        maxima = [g.detach().abs().max().to(acc) for g in grads if g.numel()]
        total = torch.stack(maxima).max() if maxima else zero
        op = dist.ReduceOp.MAX
    else:  # sum of |g|^p over this rank's entries
        parts = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=acc) for g in grads if g.numel()]
        total = (torch.stack(parts) ** norm_type).sum() if parts else zero
        op = dist.ReduceOp.SUM
    if grad_stats_parallel_group is not None and grad_stats_parallel_group.size() > 1:
        total = total.reshape(1).contiguous()
        _record("all_reduce", "MAX" if op == dist.ReduceOp.MAX else "SUM", total)
        dist.all_reduce(total, op=op, group=grad_stats_parallel_group)
        total = total[0]
    return total if norm_type == math.inf else total ** (1.0 / norm_type)


def _check_max_norm(max_norm: object) -> float:
    """max_norm as a float > 0 (``math.inf`` allowed); a scale of 0, a negative one or NaN would
    zero, flip or poison every gradient without a word."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a real number > 0 (math.inf: measure only), got {type_name(max_norm)}")
    value = real_to_float("max_norm", max_norm, "a real number > 0 (math.inf: measure only)")
    if not value > 0:  # NaN fails this too
        raise ValueError(f"max_norm must be > 0 (math.inf: measure only), got {max_norm!r}")
    return value


def clip_grad_by_total_norm_fp32(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                                 total_norm: torch.Tensor) -> None:
    """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))`` (no host sync).

    Args:
        parameters: the parameters whose ``.grad`` to scale (None gradients are skipped).
        max_norm: the largest norm allowed (> 0).
        total_norm: from :func:`get_grad_norm_fp32`.

    Raises:
        TypeError / ValueError: max_norm not a real number / not > 0 (NaN included).

    Source: Megatron-LM ``megatron/core/optimizer/clip_grads.py`` (``clip_grad_by_total_norm_fp32``).
    """
    max_norm = _check_max_norm(max_norm)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    coeff = torch.clamp(max_norm / (total_norm + 1.0e-6), max=1.0)  # 1e-6: Megatron's (and torch's) guard
    for g in grads:
        g.mul_(coeff.to(device=g.device, dtype=g.dtype))


def clip_grad_norm(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                   tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Clip the gradients of ``model`` (in place) by the total norm over the tensor-parallel ranks.

    Call it after :func:`~fusedlib.parallel.finalize_model_grads`, on every rank.

    Args:
        model: a module; the norm is reduced over ``tp_group`` when one is given, else over
            :mod:`parallel_state`'s tensor-parallel group when the model's
            ``config.tensor_model_parallel_size`` is above 1 or, for a model without a config,
            when one of its parameters is marked tensor-parallel (``tensor_model_parallel``, as
            fusedlib's and Megatron-core's parallel layers mark theirs) and that group has more
            than one rank.
        max_norm: the largest total norm allowed (``math.inf``: measure only).
        norm_type: as :func:`get_grad_norm_fp32`.
        tp_group: see ``model``.

    Returns:
        The total norm before clipping, a 0-dim tensor (float32; float64 for float64
        gradients), the same on every rank.

    Raises:
        TypeError: model not a ``torch.nn.Module``; max_norm or norm_type not a real number.
        ValueError: max_norm not > 0 (NaN included: a negative one flipped every gradient, NaN
            made them NaN); norm_type <= 0 (:func:`get_grad_norm_fp32`).

    Source: Megatron-LM ``megatron/core/optimizer/optimizer.py`` (``MegatronOptimizer.clip_grad_norm``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (its parameters' gradients are clipped), got "
                        f"{type_name(model)}")
    max_norm = _check_max_norm(max_norm)
    config = getattr(model, "config", None)
    params = [p for p in model.parameters() if p.grad is not None]
    if tp_group is None:
        if config is not None:
            split = config.tensor_model_parallel_size > 1
        else:  # (an explicit tp_group, or a model of parallel layers without a config, was ignored:
            # every rank returned its own shards' norm)
            split = (any(getattr(p, "tensor_model_parallel", False) for p in params)
                     and parallel_state.model_parallel_is_initialized()
                     and parallel_state.get_tensor_model_parallel_world_size() > 1)
        if split:
            tp_group = parallel_state.get_tensor_model_parallel_group()
    split = tp_group is not None and dist.get_world_size(tp_group) > 1
    group = tp_group if split else None
    # replicated parameters are counted on rank 0 of the group only
    grads_for_norm = [p.grad for p in params if not split or param_is_not_tensor_parallel_duplicate(p, group)]
    total_norm = get_grad_norm_fp32(grads_for_norm, norm_type, group)
    if max_norm != math.inf:
        clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
    return total_norm
