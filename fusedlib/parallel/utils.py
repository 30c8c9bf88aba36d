"""Tensor-parallel helpers: vocabulary shard ranges, the group in use, counted all-reduces.

``VocabUtility`` is Megatron-core's (``megatron/core/tensor_parallel/utils.py``): rank r of
p holds the vocabulary ids ``[r·V/p, (r+1)·V/p)``.

Every collective fusedlib issues goes through :func:`all_reduce`, :func:`all_gather` or
:func:`reduce_scatter`, which record it in the logs opened by :func:`count_collectives`; that
is how the tests and chapter 6 show the unfused cross entropy's three all-reduces against the
fused one's two, and chapter 9 the collectives of a tensor-parallel layer. A group of one rank
needs no communication: :func:`all_reduce` returns at once and records nothing.
"""
from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..checks import short_repr, type_name

__all__ = [
    "VocabUtility",
    "CollectiveCall",
    "CollectiveLog",
    "count_collectives",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "tp_rank_and_size",
    "SINGLE_RANK",
]


def _vocab_int(name: str, value: object) -> int:
    """An int argument of :class:`VocabUtility` (numpy ints too; a bool or a float refused: a
    float vocabulary gave float bounds, ``(5.0, 10.0)``)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"VocabUtility: {name} must be an int, got {type_name(value)} {short_repr(value)}")
    return int(value)


class VocabUtility:
    """Split the vocabulary into ``world_size`` equal shards: rank r holds ids [first, last).

    Raises (both methods):
        TypeError: an argument that is not an int (a bool or a float neither).
        ValueError: see each method.

    Source: Megatron-LM ``megatron/core/tensor_parallel/utils.py`` (``VocabUtility``).
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        """``(rank·n, (rank+1)·n)`` for shards of ``n = per_partition_vocab_size`` ids.

        Raises:
            TypeError: an argument that is not an int.
            ValueError: for a shard size < 1, a world_size < 1 or a rank outside [0, world_size).
        """
        n = _vocab_int("per_partition_vocab_size", per_partition_vocab_size)
        rank, world_size = _vocab_int("rank", rank), _vocab_int("world_size", world_size)
        if n < 1:
            raise ValueError(f"per_partition_vocab_size must be >= 1, got {n}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        first = rank * n
        return first, first + n

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        """The shard of ``rank`` when ``global_vocab_size`` ids are split over ``world_size`` ranks.

        Raises:
            TypeError: an argument that is not an int.
            ValueError: if ``global_vocab_size`` is not divisible by ``world_size`` (Megatron
                pads the vocabulary to a multiple of the tensor-parallel size), world_size < 1,
                or as :meth:`vocab_range_from_per_partition_vocab_size`.
        """
        v = _vocab_int("global_vocab_size", global_vocab_size)
        world_size = _vocab_int("world_size", world_size)
        if world_size < 1 or v % world_size:
            raise ValueError(f"global_vocab_size={v} must be divisible by world_size={world_size} (>= 1)")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(v // world_size, rank, world_size)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective issued by fusedlib: its name ("all_reduce", "all_gather",
    "reduce_scatter"), reduce op ("MAX", "SUM"; "-" for all_gather), the shape and dtype of
    the tensor this rank sends, and its payload in bytes.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def __str__(self) -> str:
        op = f"({self.op})" if self.op != "-" else ""  # all_gather has no reduce op
        return f"{self.name}{op} {list(self.shape)} {self.dtype}"


class CollectiveLog(list):
    """The :class:`CollectiveCall` records of one :func:`count_collectives` block, in order.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """

    def summary(self) -> str:
        """e.g. ``"2 collectives: all_reduce(MAX) [8] float32, all_reduce(SUM) [2, 8] float32"``."""
        return f"{len(self)} collectives: " + ", ".join(str(c) for c in self)


_OPEN_LOGS: list[CollectiveLog] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every collective fusedlib issues inside the ``with`` block (this process only).

    Yields:
        A :class:`CollectiveLog` (a list of :class:`CollectiveCall`) filled as calls happen.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    log = CollectiveLog()
    _OPEN_LOGS.append(log)
    try:
        yield log
    finally:
        _OPEN_LOGS.remove(log)


_OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX}


def _is_process_group(tp_group: object) -> bool:
    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    return group_type is not None and isinstance(tp_group, group_type)


def _has_rank_and_size(tp_group: object) -> bool:
    return callable(getattr(tp_group, "rank", None)) and callable(getattr(tp_group, "size", None))


def check_tp_group(tp_group: object) -> None:
    """Raise TypeError unless ``tp_group`` is None, a ``torch.distributed.ProcessGroup``, or an
    object with ``rank()`` and ``size()`` methods (what Megatron-core's
    ``fused_vocab_parallel_cross_entropy`` calls on it; its unit test passes such a stand-in
    for a one-rank group, with ``torch.distributed.all_reduce`` patched).

    Without it, a wrong object (a group name as a str...) reaches torch.distributed, whose
    error ("Default process group has not been initialized") names no argument.
    """
    if tp_group is None or _is_process_group(tp_group) or _has_rank_and_size(tp_group):
        return
    raise TypeError("tp_group must be None or a torch.distributed.ProcessGroup (e.g. from "
                    "torch.distributed.new_group; or an object with rank() and size() methods), "
                    f"got {type(tp_group).__name__} {tp_group!r}")


def resolve_tp_group(tp_group: object) -> object:
    """The group an op given ``tp_group`` runs over: ``tp_group`` itself, or for None
    :mod:`~fusedlib.parallel.parallel_state`'s tensor-parallel group when model parallelism is
    initialized (Megatron-core's group), else None (the default group if torch.distributed is
    initialized, else one rank: :func:`tp_rank_and_size`).

    Without it a None reduced over the whole world: with tensor and data parallelism both
    initialized (world 2, tp 1) the cross entropy's loss came out log 2 off.

    Raises:
        TypeError: tp_group neither None, a ProcessGroup nor an object with rank() and size()
            (:func:`check_tp_group`).
    """
    check_tp_group(tp_group)
    if tp_group is None:
        from . import parallel_state  # (parallel_state does not import this module; imported late all the same)

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    return tp_group


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``tp_group`` and the group's size.

    ``tp_group=None`` means the default (world) group when ``torch.distributed`` is
    initialized, and a single rank (0 of 1, no communication) when it is not.
    Megatron-core instead takes its tensor-parallel group from ``parallel_state``.
    A group that is not a ProcessGroup but has ``rank()`` and ``size()`` is asked those, as
    Megatron-core's fused cross entropy does.

    Raises:
        TypeError: tp_group none of these (:func:`check_tp_group`).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    check_tp_group(tp_group)
    if tp_group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if tp_group is not None and not _is_process_group(tp_group):
        return int(tp_group.rank()), int(tp_group.size())
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def all_reduce(tensor: torch.Tensor, op: str, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``torch.distributed.all_reduce(tensor, op, tp_group)`` in place, recorded for
    :func:`count_collectives`; a no-op (not recorded) for a group of one rank.

    Args:
        tensor: a contiguous tensor, reduced in place.
        op: "SUM" or "MAX".
        tp_group: the group (None: see :func:`tp_rank_and_size`).

    Returns:
        ``tensor``.

    Raises:
        ValueError: for another op or a non-contiguous tensor.

    Source: fusedlib's own, on ``torch.distributed.all_reduce``.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("all_reduce needs a contiguous tensor")
    _, size = tp_rank_and_size(tp_group)
    if size == 1:
        return tensor
    _record("all_reduce", op, tensor)
    dist.all_reduce(tensor, op=_OPS[op], group=tp_group)
    return tensor


def _record(name: str, op: str, tensor: torch.Tensor) -> None:
    """Append a :class:`CollectiveCall` for ``tensor`` (the payload one rank sends) to every open log."""
    if _OPEN_LOGS:
        call = CollectiveCall(name, op, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                              tensor.numel() * tensor.element_size())
        for log in _OPEN_LOGS:
            log.append(call)


# torch >= 2.12 names them *_single (and deprecates the old names); torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """All-gather along the first dim: ``output`` [p·n, ...] receives every rank's ``tensor``
    [n, ...], rank order; recorded for :func:`count_collectives` (payload: ``tensor``).

    Args:
        output: a new contiguous tensor of p times ``tensor``'s first dim, same dtype and device.
        tensor: contiguous, this rank's part. Not modified.
        group: a process group of p > 1 ranks.
        async_op: return at once with torch.distributed's work handle (``.wait()`` before
            reading ``output``).

    Returns:
        ``output``, or the work handle with ``async_op``.

    Source: fusedlib's own, on torch.distributed's one-tensor all-gather
    (``all_gather_into_tensor``).
    """
    _record("all_gather", "-", tensor)
    work = _ALL_GATHER(output, tensor, group=group, async_op=async_op)
    return work if async_op else output


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Reduce-scatter (SUM) along the first dim: ``output`` [n, ...] receives rank r's block
    ``[r·n, (r+1)·n)`` of the sum over ranks of ``tensor`` [p·n, ...]; recorded for
    :func:`count_collectives` (payload: ``tensor``).

    Args:
        output: a new contiguous tensor, ``tensor``'s first dim divided by p.
        tensor: contiguous. Not modified.
        group: a process group of p > 1 ranks.
        async_op: as :func:`all_gather`.

    Returns:
        ``output``, or the work handle with ``async_op``.

    Source: fusedlib's own, on torch.distributed's one-tensor reduce-scatter
    (``reduce_scatter_tensor``).
    """
    _record("reduce_scatter", "SUM", tensor)
    work = _REDUCE_SCATTER(output, tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work if async_op else output


class _OneRank:
    """A stand-in for a process group of one rank (``rank()`` 0, ``size()`` 1): what a
    tensor-parallel size of 1 passes to the cross entropy, so that an initialized
    ``torch.distributed`` (data parallelism, the ranks of a test) is never taken for the
    tensor-parallel group."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "SINGLE_RANK"


#: The one-rank group stand-in (see :class:`_OneRank`).
SINGLE_RANK = _OneRank()
