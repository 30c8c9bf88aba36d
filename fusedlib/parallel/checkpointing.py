"""Shard a one-rank (p = 1) state dict for tensor-parallel rank r of p, and gather shards back.

Which entries are split, along which dim and how, is the model's *layout*, read from the
attributes the parallel layers set on their parameters (Megatron's names, set on one rank
too): ``tensor_model_parallel`` (split or not), ``partition_dim`` and ``partition_stride``.

=================================================  ==============  ======
parameter                                          partition_dim   stride
=================================================  ==============  ======
ColumnParallelLinear weight [out, in], bias [out]  0               1 (2 for a gated MLP's fc1)
RowParallelLinear weight [out, in]                 1               1
VocabParallelEmbedding weight [V, h]               0               1
everything else (norms, row-parallel bias, ...)    replicated
=================================================  ==============  ======

With stride k the dim is cut into p·k equal chunks and rank r keeps chunks r, r + p, ...
(a gated MLP's fc1 [2·ffn, h] holds the halves [x1; x2]; rank r keeps [x1_r; x2_r]).

* :func:`get_tensor_parallel_layout` reads the layout off a model (of any p);
* :func:`shard_state_dict` cuts a full state dict into rank r's;
* :func:`unshard_state_dict` joins the p ranks' state dicts (or gradients) into the full one,
  checking that replicated entries agree.

Loading rank r's shard into a model built with p ranks gives the one-rank model split over the
ranks: ``model.load_state_dict(shard_state_dict(full, layout, r, p))``.

Megatron-core's distributed checkpoints (``sharded_state_dict``, ``dist_checkpointing``) store
the same split with global offsets; these helpers are the plain-dict version.

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``_initialize_affine_weight_cpu``:
the strided split) and ``megatron/core/transformer/utils.py`` (``make_sharded_tensors_for_checkpoint``).
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, NamedTuple, Sequence

import torch

__all__ = ["PartitionSpec", "get_tensor_parallel_layout", "shard_state_dict", "unshard_state_dict",
           "shard_tensor", "unshard_tensors"]


class PartitionSpec(NamedTuple):
    """How one entry is split: along ``dim``, in ``stride`` interleaved parts.

    Source: the parameter attributes ``partition_dim`` and ``partition_stride`` of Megatron-LM
    ``megatron/core/tensor_parallel/layers.py`` (``set_tensor_model_parallel_attributes``).
    """

    dim: int
    stride: int = 1


Layout = Mapping[str, PartitionSpec]


def get_tensor_parallel_layout(model: torch.nn.Module) -> Dict[str, PartitionSpec]:
    """The split entries of ``model``'s state dict: name -> :class:`PartitionSpec`, from the
    parameters' ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.

    Args:
        model: a model built from fusedlib's parallel layers, with any tensor-parallel size.

    Returns:
        A dict over the split parameters' names (the others are replicated), named as in
        ``model.state_dict()``: a tied parameter under each of its names, a Float16Module's
        without ``module.`` (``named_parameters`` lists a tied parameter once and names the
        wrapped module's with ``module.``: their shards did not match the state dict).

    Source: the parameter attributes of Megatron-LM ``megatron/core/tensor_parallel/layers.py``
    (``set_tensor_model_parallel_attributes``); the function is fusedlib's own.
    """
    return {name: PartitionSpec(int(p.partition_dim), int(getattr(p, "partition_stride", 1)))
            for name, p in model.state_dict(keep_vars=True).items()
            if isinstance(p, torch.Tensor) and getattr(p, "tensor_model_parallel", False)}


def _check_spec(spec: object, name: str) -> tuple[int, int]:
    """``spec`` as (dim, stride), checked: a pair of ints with stride >= 1."""
    try:
        dim, stride = spec  # a PartitionSpec, or any pair
    except (TypeError, ValueError):
        raise ValueError(f"{name}: the layout's entry must be a PartitionSpec(dim, stride), got {spec!r}") from None
    for what, v in (("dim", dim), ("stride", stride)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: the partition {what} must be an int, got {v!r}")
    if stride < 1:
        raise ValueError(f"{name}: the partition stride must be >= 1, got {stride}")
    return dim, stride


def _check_tensor(t: object, name: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {what} must be a tensor (the layout splits it), got {type(t).__name__}")
    return t


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def shard_tensor(full: torch.Tensor, spec: PartitionSpec, rank: int, world_size: int, name: str = "tensor"
                 ) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a new contiguous tensor; ``full`` is not modified).

    Raises:
        ValueError: the dim's size not divisible by world_size·stride, a dim out of range, or a
            bad rank.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``
    (``_initialize_affine_weight_cpu``: the strided split).
    """
    _check_rank(rank, world_size)
    dim, stride = _check_spec(spec, name)
    full = _check_tensor(full, name, "the full entry")
    if not -full.dim() <= dim < full.dim():
        raise ValueError(f"{name}: partition_dim {dim} out of range for shape {list(full.shape)}")
    n = full.shape[dim]
    if n % (world_size * stride):
        raise ValueError(f"{name}: dim {dim} of shape {list(full.shape)} ({n}) must be divisible by "
                         f"world_size·stride = {world_size}·{stride}")
    chunks = torch.chunk(full.detach(), world_size * stride, dim=dim)  # (a Parameter's shard kept a grad_fn)
    return torch.cat(chunks[rank::world_size], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], spec: PartitionSpec, name: str = "tensor") -> torch.Tensor:
    """The full tensor from the ranks' shards, in rank order (inverse of :func:`shard_tensor`).

    Raises:
        ValueError: a shard that is not a tensor, shards of different shapes, dtypes or devices, a
            dim out of range, a stride < 1, or a dim not divisible by the stride.

    Source: fusedlib's own (the inverse of :func:`shard_tensor`); Megatron-core has no counterpart.
    """
    dim, stride = _check_spec(spec, name)
    p = len(shards)
    if p == 0:
        raise ValueError(f"{name}: no shards")
    for r, s in enumerate(shards):
        _check_tensor(s, name, f"rank {r}'s shard")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"{name}: the shards' shapes differ: {[list(s.shape) for s in shards]}")
    if any(s.dtype != shards[0].dtype for s in shards):
        raise ValueError(f"{name}: the shards' dtypes differ: {[str(s.dtype) for s in shards]}")
    if any(s.device != shards[0].device for s in shards):  # (else torch's "not on the expected device")
        raise ValueError(f"{name}: the shards' devices differ: {[str(s.device) for s in shards]} (move the state "
                         f"dicts to one device, e.g. the CPU, first)")
    if not -shards[0].dim() <= dim < shards[0].dim():
        raise ValueError(f"{name}: partition_dim {dim} out of range for the shards' shape {list(shards[0].shape)}")
    if shards[0].shape[dim] % stride:
        raise ValueError(f"{name}: shard dim {dim} ({shards[0].shape[dim]}) is not divisible by stride {stride}")
    parts = [torch.chunk(s, stride, dim=dim) for s in shards]  # parts[r][j]: chunk j·p + r of the full dim
    return torch.cat([parts[r][j] for j in range(stride) for r in range(p)], dim=dim)


def shard_state_dict(state_dict: Mapping[str, object], layout: Layout, rank: int, world_size: int
                     ) -> Dict[str, object]:
    """Rank ``rank``'s state dict, from the full (one-rank) ``state_dict``.

    Args:
        state_dict: name -> tensor (other values, e.g. ``_extra_state`` None, pass as they are).
        layout: from :func:`get_tensor_parallel_layout` (of a model of any size).
        rank, world_size: r and p.

    Returns:
        A new dict: split entries are new contiguous tensors, replicated ones the same objects as
        in ``state_dict`` (nothing is modified).

    Raises:
        TypeError: state_dict or layout not a dict (a Mapping).
        ValueError: a bad rank, a layout entry missing from ``state_dict``, or a size not divisible.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``
    (``_initialize_affine_weight_cpu``: the strided split); the function is fusedlib's own.
    """
    _check_rank(rank, world_size)
    for arg, value in (("state_dict", state_dict), ("layout", layout)):
        if not isinstance(value, Mapping):
            raise TypeError(f"shard_state_dict: {arg} must be a dict, got {type(value).__name__}")
    missing = sorted(set(layout) - set(state_dict))
    if missing:
        raise ValueError(f"shard_state_dict: the layout's entries {missing} are not in the state dict")
    return {k: shard_tensor(v, layout[k], rank, world_size, k) if k in layout else v for k, v in state_dict.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN where the other is NaN; complex numbers part by part), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():  # (torch.equal called two equal complex NaNs different)
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two replicas of one shape and dtype differ, for the message."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():  # exact in int64 (a float64 difference rounded ints above 2^53 to 0)
        return f"max |difference| {(b.to(torch.int64) - a.to(torch.int64)).abs().max().item()}"
    nan = a.isnan() ^ b.isnan()
    if nan.any():
        return f"NaN on one rank at {int(nan.sum())} element(s)"
    both = a.isnan() & b.isnan()  # (equal there: left out of the maximum)
    return f"max |difference| {(b.double() - a.double()).abs().masked_fill(both, 0).max().item()}"


_PLAIN = (type(None), bool, int, float, str, bytes)  # non-tensor values compared by ==


def unshard_state_dict(shards: Sequence[Mapping[str, object]], layout: Layout, check_replicas: bool = True
                       ) -> Dict[str, object]:
    """The full state dict from the p ranks' state dicts (or gradient dicts), in rank order.

    Args:
        shards: p dicts with the same keys, rank 0 first (a list, a tuple, or any iterable of them).
        layout: from :func:`get_tensor_parallel_layout`.
        check_replicas: require replicated tensors to be equal on every rank (by value: NaN
            equals NaN, -0.0 equals 0.0; complex numbers part by part). A difference means a missing gradient all-reduce
            (:func:`fusedlib.parallel.finalize_model_grads`) or ranks that drifted apart.

    Returns:
        A new dict: split entries joined, replicated ones taken from rank 0.

    Raises:
        TypeError: shards not a list of dicts, or layout not a dict.
        ValueError: no shards, different keys, a layout entry missing from the state dicts, split
            entries that do not join (:func:`unshard_tensors`), or (``check_replicas``) replicas
            that differ (in value, shape, dtype, device, or a tensor on one rank and not on
            another; non-tensor values of plain types by ``==``), naming the entry and the
            difference.

    Source: fusedlib's own (the inverse of :func:`shard_state_dict`); Megatron-core has no
    counterpart.
    """
    if not isinstance(shards, (Mapping, str, bytes)) and isinstance(shards, Iterable) and not isinstance(shards, Sequence):
        shards = list(shards)  # a generator of the ranks' dicts (the check below consumed it, then indexing failed)
    if isinstance(shards, Mapping) or not all(isinstance(sd, Mapping) for sd in shards):
        raise TypeError("unshard_state_dict: shards must be a list of the ranks' state dicts (one dict per rank), got "
                        + (type(shards).__name__ if isinstance(shards, Mapping) else
                           f"a list holding {sorted({type(sd).__name__ for sd in shards})}"))
    if not isinstance(layout, Mapping):
        raise TypeError(f"unshard_state_dict: layout must be a dict of name -> PartitionSpec, got "
                        f"{type(layout).__name__}")
    if not shards:
        raise ValueError("unshard_state_dict: no shards")
    keys = list(shards[0])
    for r, sd in enumerate(shards[1:], 1):
        if set(sd) != set(keys):
            raise ValueError(f"unshard_state_dict: rank {r}'s keys differ from rank 0's: "
                             f"{sorted(set(sd) ^ set(keys))}")
    missing = sorted(set(layout) - set(keys))
    if missing:
        raise ValueError(f"unshard_state_dict: the layout's entries {missing} are not in the state dicts")
    out: Dict[str, object] = {}
    for k in keys:
        values = [sd[k] for sd in shards]
        if k in layout:
            out[k] = unshard_tensors(values, layout[k], k)
            continue
        first = values[0]
        if check_replicas:
            for r, v in enumerate(values[1:], 1):
                if isinstance(v, torch.Tensor) != isinstance(first, torch.Tensor):
                    raise ValueError(f"unshard_state_dict: the replicated entry {k!r} is "
                                     f"{type(first).__name__} on rank 0 and {type(v).__name__} on rank {r}")
                if not isinstance(first, torch.Tensor):
                    if isinstance(first, _PLAIN) and isinstance(v, _PLAIN) and v != first:
                        raise ValueError(f"unshard_state_dict: the replicated entry {k!r} is {first!r} on rank 0 "
                                         f"and {v!r} on rank {r}")
                    continue
                if v.device != first.device:  # (torch's "not on the expected device" otherwise)
                    raise ValueError(f"unshard_state_dict: the replicated entry {k!r} is on {first.device} on rank 0 "
                                     f"and on {v.device} on rank {r} (move the state dicts to one device first)")
                if _same(v, first):
                    continue
                if v.shape != first.shape:
                    diff = f"shape {list(first.shape)} against {list(v.shape)}"
                elif v.dtype != first.dtype:
                    diff = f"dtype {first.dtype} against {v.dtype}"
                else:
                    diff = _difference(first, v)
                raise ValueError(f"unshard_state_dict: the replicated entry {k!r} differs between rank 0 and "
                                 f"rank {r} ({diff}); were its gradients all-reduced "
                                 "(fusedlib.parallel.finalize_model_grads)?")
        out[k] = first
    return out
