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

from typing import Dict, Mapping, NamedTuple, Sequence

import torch

__all__ = ["PartitionSpec", "get_tensor_parallel_layout", "shard_state_dict", "unshard_state_dict",
           "shard_tensor", "unshard_tensors"]


class PartitionSpec(NamedTuple):
    """How one entry is split: along ``dim``, in ``stride`` interleaved parts."""

    dim: int
    stride: int = 1


Layout = Mapping[str, PartitionSpec]


def get_tensor_parallel_layout(model: torch.nn.Module) -> Dict[str, PartitionSpec]:
    """The split entries of ``model``'s state dict: name -> :class:`PartitionSpec`, from the
    parameters' ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.

    Args:
        model: a model built from fusedlib's parallel layers, with any tensor-parallel size.

    Returns:
        A dict over the split parameters' names (the others are replicated).
    """
    return {name: PartitionSpec(int(p.partition_dim), int(getattr(p, "partition_stride", 1)))
            for name, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}


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
    chunks = torch.chunk(full, world_size * stride, dim=dim)
    return torch.cat(chunks[rank::world_size], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], spec: PartitionSpec, name: str = "tensor") -> torch.Tensor:
    """The full tensor from the ranks' shards, in rank order (inverse of :func:`shard_tensor`).

    Raises:
        ValueError: a shard that is not a tensor, shards of different shapes or dtypes, a dim out
            of range, a stride < 1, or a dim not divisible by the stride.
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
        ValueError: a bad rank, a layout entry missing from ``state_dict``, or a size not divisible.
    """
    _check_rank(rank, world_size)
    missing = sorted(set(layout) - set(state_dict))
    if missing:
        raise ValueError(f"shard_state_dict: the layout's entries {missing} are not in the state dict")
    return {k: shard_tensor(v, layout[k], rank, world_size, k) if k in layout else v for k, v in state_dict.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN where the other is NaN), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def unshard_state_dict(shards: Sequence[Mapping[str, object]], layout: Layout, check_replicas: bool = True
                       ) -> Dict[str, object]:
    """The full state dict from the p ranks' state dicts (or gradient dicts), in rank order.

    Args:
        shards: p dicts with the same keys, rank 0 first.
        layout: from :func:`get_tensor_parallel_layout`.
        check_replicas: require replicated tensors to be equal on every rank (bitwise; NaN
            equals NaN). A difference means a missing gradient all-reduce
            (:func:`fusedlib.parallel.finalize_model_grads`) or ranks that drifted apart.

    Returns:
        A new dict: split entries joined, replicated ones taken from rank 0.

    Raises:
        ValueError: no shards, different keys, a layout entry missing from the state dicts, split
            entries that do not join (:func:`unshard_tensors`), or (``check_replicas``) replicas
            that differ (in value, shape, dtype, or a tensor on one rank and not on another),
            naming the entry and the difference.
    """
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
                if not isinstance(first, torch.Tensor) or _same(v, first):
                    continue
                if v.shape != first.shape:
                    diff = f"shape {list(first.shape)} against {list(v.shape)}"
                elif v.dtype != first.dtype:
                    diff = f"dtype {first.dtype} against {v.dtype}"
                else:
                    diff = f"max |difference| {(v.double() - first.double()).abs().max().item()}"
                raise ValueError(f"unshard_state_dict: the replicated entry {k!r} differs between rank 0 and "
                                 f"rank {r} ({diff}); were its gradients all-reduced "
                                 "(fusedlib.parallel.finalize_model_grads)?")
        out[k] = first
    return out
