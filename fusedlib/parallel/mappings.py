"""The communication of tensor parallelism as autograd functions: each collective and its adjoint.

A tensor-parallel layer splits a GEMM over the p ranks of a group; what crosses the group
boundary is one of seven maps, each a ``torch.autograd.Function`` whose backward is the
adjoint of its forward (Megatron-core's names; "region" = the part of the network that runs
split over the ranks):

==========================================  ==========================  ==========================
function                                    forward                     backward
==========================================  ==========================  ==========================
copy_to_tensor_model_parallel_region        identity                    all-reduce
reduce_from_tensor_model_parallel_region    all-reduce                  identity
scatter_to_tensor_model_parallel_region     keep own slice of last dim  all-gather last dim
gather_from_tensor_model_parallel_region    all-gather last dim         keep own slice of last dim
scatter_to_sequence_parallel_region         keep own slice of dim 0     all-gather dim 0
gather_from_sequence_parallel_region        all-gather dim 0            reduce-scatter dim 0 (or
                                                                        keep own slice)
reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0        all-gather dim 0
==========================================  ==========================  ==========================

Why the pairs: if ``y = x`` on every rank and each rank's copy feeds a different part of the
loss, then dL/dx is the *sum* of the ranks' dL/dy: identity forward, all-reduce backward; and
the transpose of "sum over ranks" is "copy to every rank". Split and gather are transposes
of each other likewise. Sequence-parallel tensors ([s, b, h]) are split along the sequence,
dim 0 (Korthikanti et al. 2022, arXiv:2205.05198).

With a group of one rank every map returns its input: no collective, no copy, no autograd node.

Differences from Megatron-core, each deliberate:

* no input and no incoming gradient is modified: Megatron all-reduces the tensor it is given
  in place, which for the backward of ``copy_to`` is a gradient autograd may share with another
  branch (e.g. a residual connection's). Here the all-reduce runs on a copy (the layers of
  :mod:`fusedlib.parallel.layers` reduce their own fresh GEMM outputs in place instead);
* tensors may live on the CPU (gloo) as well as on a GPU (NCCL): buffers are allocated on the
  input's device, not on ``torch.cuda.current_device()``;
* a first or last dim not divisible by the group size is a ValueError naming both; an input
  that is not a tensor, or a group that is not a process group, a TypeError naming it (each
  map's ``Raises`` says "as copy_to_tensor_model_parallel_region" for these);
* as in Megatron-core, every rank of the group must pass a tensor of the same shape and dtype:
  a mismatch is not detected (it would take one more collective per call); the all-gathers
  then fail inside the backend, the all-reduce waits until the group's timeout;
* every collective is recorded for :func:`fusedlib.parallel.count_collectives`.

Left out: uneven splits (``output_split_sizes``, ``input_split_sizes``), the global memory
buffer, all-to-all.

Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state
from ..checks import short_repr, type_name
from .utils import all_gather, all_reduce, check_tp_group, reduce_scatter

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]

Group = Optional[dist.ProcessGroup]


def _group_or_default(group: Group) -> Group:
    """``group``, or the tensor-parallel group of :mod:`parallel_state` when it is None."""
    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


def _checked(what: str, input_: object, group: object, min_ndim: int = 0) -> Group:
    """The group a map runs over, after checking its arguments: ``input_`` a tensor (of at least
    ``min_ndim`` dims where the group has more than one rank: on one rank every map returns its
    input), ``group`` None or a process group (a list, a group's name or a 0-dim tensor to split
    failed inside with an AttributeError or an IndexError naming neither)."""
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{what}: input_ must be a torch.Tensor, got {type_name(input_)}")
    try:
        check_tp_group(group)
    except TypeError:
        raise TypeError(f"{what}: group must be None (parallel_state's tensor-parallel group) or a "
                        f"torch.distributed.ProcessGroup, got {type_name(group)} {short_repr(group)}") from None
    group = _group_or_default(group)
    if _size(group) > 1 and input_.dim() < min_ndim:
        raise ValueError(f"{what}: input_ must have at least {min_ndim} dim(s) (the one it splits or gathers), got "
                         f"shape {list(input_.shape)}")
    return group


def _size(group: Group) -> int:
    return 1 if group is None else group.size()


def _check_divisible(input_: torch.Tensor, dim: int, p: int, what: str) -> int:
    n = input_.shape[dim]
    if n % p:
        name = "first (sequence)" if dim == 0 else "last"
        raise ValueError(f"{what}: the {name} dim of a tensor of shape {list(input_.shape)} must be divisible by "
                         f"the tensor-parallel size {p}, got {n}")
    return n // p


# ------------------------------------------------------------------ the collectives themselves
def _reduce(input_: torch.Tensor, group: Group, inplace: bool = False) -> torch.Tensor:
    """All-reduce (SUM) over ``group``: a new tensor, or ``input_`` itself reduced in place if
    ``inplace`` (the caller owns it). A one-rank group returns ``input_``."""
    if _size(group) == 1:
        return input_
    out = input_ if inplace and input_.is_contiguous() else input_.clone(memory_format=torch.contiguous_format)
    return all_reduce(out, "SUM", group)


def _split_along_last_dim(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the last dim, [..., n] -> [..., n/p] (a contiguous copy)."""
    p = _size(group)
    if p == 1:
        return input_
    n = _check_divisible(input_, -1, p, "split along the last dim")
    r = group.rank()
    return input_[..., r * n:(r + 1) * n].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of dim 0, [s, ...] -> [s/p, ...] (a contiguous copy)."""
    p = _size(group)
    if p == 1:
        return input_
    n = _check_divisible(input_, 0, p, "split along the first dim")
    r = group.rank()
    return input_[r * n:(r + 1) * n].contiguous()


def _gather_along_first_dim(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's tensor, concatenated along dim 0: [s/p, ...] -> [s, ...]."""
    p = _size(group)
    if p == 1:
        return input_
    x = input_.contiguous()
    out = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return all_gather(out, x, group)


def _gather_along_last_dim(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's tensor, concatenated along the last dim: [..., n/p] -> [..., n]."""
    p = _size(group)
    if p == 1:
        return input_
    x = input_.contiguous()
    if x.dim() == 0:
        raise ValueError("gather along the last dim: the tensor has no dims")
    stacked = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # ranks along dim 0
    all_gather(stacked, x, group)
    return torch.cat(stacked.chunk(p, dim=0), dim=-1)  # p x [n0, ..., n/p] -> [n0, ..., n]


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over ranks, this rank's slice of dim 0: [s, ...] -> [s/p, ...]."""
    p = _size(group)
    if p == 1:
        return input_
    n = _check_divisible(input_, 0, p, "reduce-scatter along the first dim")
    x = input_.contiguous()
    out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return reduce_scatter(out, x, group)


# ------------------------------------------------------------------ autograd functions
class _CopyToModelParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (in place if ``inplace``: the caller owns the tensor). Backward: identity."""

    @staticmethod
    def forward(ctx, input_, group, inplace=False):
        out = _reduce(input_, group, inplace)
        if out is input_:
            if _size(group) > 1:
                ctx.mark_dirty(input_)
                return input_
            return input_.view_as(input_)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        out = _split_along_last_dim(input_, group)
        return out if out is not input_ else input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice of the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        out = _gather_along_last_dim(input_, group)
        return out if out is not input_ else input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        out = _split_along_first_dim(input_, group)
        return out if out is not input_ else input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0 when what follows runs split over
    the ranks (``tensor_parallel_output_grad``: each rank's gradient is a partial sum), else keep
    this rank's slice (what follows is duplicated: every rank has the whole gradient)."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        out = _gather_along_first_dim(input_, group)
        return out if out is not input_ else input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        out = _reduce_scatter_along_first_dim(input_, group)
        return out if out is not input_ else input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


# ------------------------------------------------------------------ entry points
def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Enter a tensor-parallel region: forward identity, backward all-reduce of the gradient.

    Args:
        input_: any shape and dtype; the same on every rank of ``group``.
        group: the tensor-parallel group (None: :func:`parallel_state.get_tensor_model_parallel_group`).

    Returns:
        ``input_``'s values (a view; ``input_`` itself on one rank), whose gradient is summed over the ranks.

    Raises:
        RuntimeError: ``group`` None and model parallelism not initialized.
        TypeError: input_ not a tensor; group neither None nor a ProcessGroup.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("copy_to_tensor_model_parallel_region", input_, group)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Leave a tensor-parallel region: forward all-reduce (SUM) of the ranks' partial results,
    backward identity.

    Args:
        input_: any shape; this rank's partial sum. Not modified.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Returns:
        A new tensor, the sum over ranks (``input_`` itself on one rank).

    Raises:
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("reduce_from_tensor_model_parallel_region", input_, group)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _ReduceFromModelParallelRegion.apply(input_, group, False)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: this rank's slice of the last dim, [..., n] -> [..., n/p]; backward: all-gather.

    Args:
        input_: [..., n], the same on every rank.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Raises:
        ValueError: n not divisible by p; input_ 0-dim (more than one rank).
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("scatter_to_tensor_model_parallel_region", input_, group, 1)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: all-gather the last dim, [..., n/p] -> [..., n] (rank order); backward: keep this
    rank's slice of the gradient.

    Args:
        input_: [..., n/p], this rank's part; the same shape on every rank.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Raises:
        ValueError: input_ 0-dim (more than one rank).
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("gather_from_tensor_model_parallel_region", input_, group, 1)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: this rank's slice of the sequence, [s, b, h] -> [s/p, b, h]; backward: all-gather.

    Args:
        input_: [s, ...], the same on every rank.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Raises:
        ValueError: s not divisible by p; input_ 0-dim (more than one rank).
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("scatter_to_sequence_parallel_region", input_, group, 1)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, tensor_parallel_output_grad: bool = True,
                                         group: Group = None) -> torch.Tensor:
    """Forward: all-gather the sequence, [s/p, b, h] -> [s, b, h]; backward: reduce-scatter
    (``tensor_parallel_output_grad=True``: the consumer runs split over the ranks) or keep this
    rank's slice (False: the consumer is duplicated on every rank).

    Args:
        input_: [s/p, ...], this rank's part of the sequence.
        tensor_parallel_output_grad: see above.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Raises:
        ValueError: input_ 0-dim (more than one rank).
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("gather_from_sequence_parallel_region", input_, group, 1)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: sum over ranks, keep this rank's slice of the sequence, [s, b, h] -> [s/p, b, h];
    backward: all-gather.

    Args:
        input_: [s, ...], this rank's partial sum. Not modified.
        group: as :func:`copy_to_tensor_model_parallel_region`.

    Raises:
        ValueError: s not divisible by p; input_ 0-dim (more than one rank).
        RuntimeError, TypeError: as :func:`copy_to_tensor_model_parallel_region`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
    """
    group = _checked("reduce_scatter_to_sequence_parallel_region", input_, group, 1)
    if _size(group) == 1:
        return input_  # one rank: the identity, forward and backward
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)
