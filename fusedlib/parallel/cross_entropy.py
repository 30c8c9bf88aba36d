"""Vocab-parallel cross entropy, the unfused way: three all-reduces (four with label smoothing).

With tensor parallelism the output layer's logits are split along the vocabulary: rank r of
p holds ``logits[s, b, V/p]``, columns ``[r·V/p, (r+1)·V/p)`` of the full vocabulary (every
rank's shard of one width, as the vocab-parallel output layer makes them: each rank derives its
columns from its own width, and shards of different widths are not detected, as in Megatron-core;
checking them would cost a host synchronisation or one more collective per call). The
loss of a token with target t is ``lse - x_t`` with ``lse = M + log sum_j e^{x_j - M}`` over
ALL V columns, M the global max. Each rank computes statistics of its own shard; collectives
combine them:

    1. local max m_r                       -> all-reduce(MAX)  -> M
    2. e^{m_r - M}·sum_{j in r} e^{x_j - m_r}  -> all-reduce(SUM)  -> sum-exp over V
    3. x_t if t is in rank r's shard else 0 -> all-reduce(SUM)  -> x_t
    (label smoothing) sum_{j in r} x_j      -> all-reduce(SUM)  -> the mean over V

This module issues them one by one, as Megatron-core's
``megatron/core/tensor_parallel/cross_entropy.py`` does. :mod:`fusedlib.fusions.fused_cross_entropy`
sends 2 and 3 (and the sum of logits) in ONE all-reduce: two collectives in all.

The local work is fusedlib's Triton kernels (:mod:`fusedlib.kernels.cross_entropy`): one read
of the shard computes its max, sum of exponentials, target logit and sum in one pass
(``calculate_logits_max``), and the backward needs no communication at all
(``calculate_gradients``). Megatron's step names are kept; where Megatron's steps move
logits-sized float32 tensors (``exp_logits``, ``softmax``), fusedlib's move per-row statistics.

Fixed with respect to Megatron-core (each has a test in ``tests/test_cross_entropy.py``):

* the logits are never modified (Megatron subtracts the max in place, which for float32
  logits, where ``.float()`` is no copy, changes the caller's tensor);
* the gradient has the logits' dtype (Megatron's fused path always returned bfloat16);
* label smoothing uses the global vocabulary size and the all-reduced mean of the logits
  (Megatron uses the shard's size and the shard's mean, so ranks disagree with one device);
* ``ignore_index`` rows get zero loss and zero gradient (Megatron has no ignore_index);
* target ids outside [0, V) give a NaN loss (and gradient) for their rows and a ValueError
  (Megatron silently returns a wrong loss), without a host sync: see below;
* offsets are int64, so logits with more than 2^31 elements are indexed correctly.

Target ids are checked on the device, by the forward kernel that reads them anyway
(:data:`TARGET_CHECK`, a :class:`fusedlib.runtime.DeviceCheck`): a bad id makes its row's
loss, lse and gradient NaN and is stored in pinned host memory. On the CPU the op raises at
once, before any collective. On CUDA nothing waits for the GPU (a read-back would stall the
host on every call and break ``torch.compile(fullgraph=True)`` and CUDA-graph capture): the
ValueError comes at a later fusedlib kernel launch or at :func:`fusedlib.runtime.check_errors`;
``FUSEDLIB_SYNC_CHECKS=1`` makes CUDA raise at once too. Under ``torch.compile`` the NaN alone
is the signal. With tensor parallelism every rank holds the same target, so every rank finds
it; call ``check_errors()`` at the same point on every rank (e.g. once per step) for every
rank to raise together.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..fusions._apply import keep_graph_anchor, once_differentiable
from ..checks import (FLOAT_DTYPES, ArgumentTypeError, check_same_device, check_tensor, on_one_kernel_device,
                      resolve_neg_grads)
from ..kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from ..kernels.launch import as_rows
from ..runtime import DeviceCheck
from .utils import VocabUtility, all_reduce, resolve_tp_group, tp_rank_and_size

__all__ = [
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy",
    "prepare_inputs",
    "check_label_smoothing",
    "target_check_message",
    "widen_target",
    "TARGET_CHECK",
]

TARGET_DTYPES = (torch.int64, torch.int32)


#: 2^63: ignore_index is an int64 in the kernels (a larger Python int cannot be passed to them).
_INT64_LIMIT = 2 ** 63

#: 2^31: an int32 target holds ids in [-2^31, 2^31).
_INT32_LIMIT = 2 ** 31


def widen_target(target: Any, ignore_index: Any) -> Any:
    """``target`` as int64 when it is an int32 tensor and ``ignore_index`` an int outside int32's
    range, else ``target`` itself (anything else: the argument checks judge it).

    No int32 id equals such an ignore_index, but two places would make one: a comparison of an
    int32 tensor with a Python int wraps the int to int32 (``t != 2**32`` is ``t != 0``: the
    loss of every target 0 was zeroed, silently), and the kernels load the target with
    ``other=ignore_index``, cast to int32 too, so the padding rows of the last program became
    active and read logits past the tensor's end (a segmentation fault in the CPU interpreter).
    As int64 (a copy of [rows] ids), ignore_index is held exactly everywhere.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if (isinstance(target, torch.Tensor) and target.dtype == torch.int32 and isinstance(ignore_index, int)
            and not -_INT32_LIMIT <= ignore_index < _INT32_LIMIT):
        return target.long()
    return target


def prepare_inputs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                   ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments of a vocab-parallel cross entropy and flatten them to rows.

    Args:
        vocab_parallel_logits: [..., V/p] (Megatron: [s, b, V/p]), float32/16/bf16/64.
        target: [...] (Megatron: [s, b]), int64 or int32, same device.
        label_smoothing: in [0, 1).
        ignore_index: an int.

    Returns:
        ``(x2d, t1d)``: logits as [rows, V/p] (a view where the leading dims merge, else one
        copy made by ``reshape``) and target as [rows].

    Raises:
        TypeError: non-tensors, a logits dtype not in fusedlib's float dtypes, a target dtype
            other than int64/int32, or a non-int ignore_index. A label_smoothing that is not a
            real number (a bool, a str, a list) raises :class:`fusedlib.checks.ArgumentTypeError`,
            a TypeError and a ValueError both.
        ValueError: target's shape is not the logits' shape without the last dim, an empty
            vocabulary shard, label_smoothing outside [0, 1), ignore_index outside the int64
            range, or tensors on two devices.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    logits = vocab_parallel_logits
    # the happy case in one test; the checks below name what is wrong otherwise
    if (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor) and logits.dtype in FLOAT_DTYPES
            and target.dtype in TARGET_DTYPES and logits.dim() >= 1 and logits.shape[-1] >= 1
            and target.shape == logits.shape[:-1] and type(label_smoothing) is float and 0.0 <= label_smoothing < 1.0
            and type(ignore_index) is int and -_INT64_LIMIT <= ignore_index < _INT64_LIMIT
            and on_one_kernel_device(logits, target)):
        # [s, b, V/p] -> [s*b, V/p] and [s, b] -> [s*b]
        return as_rows(logits), (target if target.dim() == 1 else target.reshape(-1))
    check_tensor("vocab_parallel_logits", vocab_parallel_logits, min_ndim=1)
    check_tensor("target", target, dtypes=TARGET_DTYPES)
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"target must have shape {list(vocab_parallel_logits.shape[:-1])} (the logits' shape "
                         f"without the vocabulary dim), got {list(target.shape)}")
    if vocab_parallel_logits.shape[-1] < 1:
        raise ValueError("vocab_parallel_logits must have a vocabulary shard of at least 1 column, "
                         f"got shape {list(vocab_parallel_logits.shape)}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        # (False was read as 0, True refused as >= 1); a wrong type is a TypeError, and a
        # ValueError as it was before
        raise ArgumentTypeError(f"label_smoothing must be a float in [0, 1), got "
                                f"{type(label_smoothing).__name__} {label_smoothing!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1), got {label_smoothing!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -_INT64_LIMIT <= ignore_index < _INT64_LIMIT:  # the kernels take it as an int64
        raise ValueError(f"ignore_index must be an int in [-2^63, 2^63) (an int64), got {ignore_index}")
    check_same_device(vocab_parallel_logits=vocab_parallel_logits, target=target)
    # [s, b, V/p] -> [s*b, V/p] and [s, b] -> [s*b]
    return as_rows(vocab_parallel_logits), target.reshape(-1)


def check_label_smoothing(vocab_size: int, label_smoothing: float) -> None:
    """Raise for label smoothing with a vocabulary of one id (s = eps·V/(V-1) is undefined).

    Raises:
        ValueError: label_smoothing > 0 and vocab_size < 2.

    Source: fusedlib's own check of Megatron-LM's ``label_smoothing * vocab_size / (vocab_size -
    1)`` (``megatron/core/tensor_parallel/cross_entropy.py``,
    ``VocabParallelCrossEntropy.forward``).
    """
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError(f"label_smoothing needs a vocabulary of at least 2 ids, got vocab_size={vocab_size}")


def target_check_message(op: str) -> Callable[[int, Any], str]:
    """The message function of a target-id :class:`~fusedlib.runtime.DeviceCheck` for ``op``:
    ``message(bad_id, (vocab_size, ignore_index))``. On CUDA (reported lazily) the vocabulary
    size and ignore_index named are those of the op's latest call.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """

    def message(bad: int, context: Any) -> str:
        vocab_size, ignore_index = context if context is not None else ("V", "ignore_index")
        return (f"{op}: target must hold vocabulary ids in [0, {vocab_size}) or ignore_index={ignore_index}, "
                f"got {bad} (its loss and gradient are NaN)")

    return message


#: The device-side target check of :func:`vocab_parallel_cross_entropy` (its kernel stores a
#: bad id; see the module docstring).
TARGET_CHECK = DeviceCheck("vocab_parallel_cross_entropy", target_check_message("vocab_parallel_cross_entropy"))


#: The vocabulary size assumed when none is given: no target id reaches it.
_NO_UPPER_BOUND = 1 << 62


class VocabParallelCrossEntropy:
    """The steps of a vocab-parallel cross entropy, shared by the unfused and fused paths.

    Same step names as Megatron-core's class of this name; fusedlib's steps work on per-row
    statistics ([4, rows] float32) instead of a float32 copy of the logits.

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``.
    """

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
                             ignore_index: int = -100, label_smoothing: float = 0.0,
                             vocab_size: int | None = None, check: DeviceCheck | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One read of the shard (Triton): its max, sum of exponentials, target logit and sum.

        Args:
            vocab_parallel_logits: [rows, V/p], any strides. Not modified.
            target: [rows] global vocabulary ids.
            vocab_start_index: global id of the shard's first column.
            ignore_index: rows with this target are skipped.
            label_smoothing: > 0 also sums the logits.
            vocab_size: the GLOBAL vocabulary size V that target ids are checked against
                (default None: V unknown, only negative ids other than ignore_index are bad).
            check: the op's target :class:`~fusedlib.runtime.DeviceCheck`, or None.

        Returns:
            ``(stats, logits_max)``: stats [4, rows] float32 (float64 for float64 logits) with
            rows (local max m_r, sum e^{x - m_r}, target logit or 0, sum of logits); and a
            copy of its first row, [rows], to be all-reduced with MAX. Ignored rows: m_r = -inf.
            A row whose target is outside [0, V) and not ignore_index: NaN sum and target logit.

        Raises:
            ValueError: from ``check`` (at once on the CPU), for a target id outside [0, V).
        """
        stats = cross_entropy_fwd(vocab_parallel_logits, target, vocab_start_index, ignore_index, label_smoothing,
                                  _NO_UPPER_BOUND if vocab_size is None else vocab_size, check=check)
        return stats, stats[0].clone()

    @staticmethod
    def calculate_predicted_logits(stats: torch.Tensor, logits_max: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rescale the shard's sum of exponentials from its own max to the global one.

        ``sum_j e^{x_j - M} = e^{m_r - M} · sum_j e^{x_j - m_r}``, written into ``stats[1]``.

        Args:
            stats: from :meth:`calculate_logits_max`; row 1 is updated in place.
            logits_max: [rows], the global max M (after the MAX all-reduce).

        Returns:
            ``(predicted_logits, sum_exp_logits, sum_logits)``: views of stats rows 2, 1, 3,
            [rows] each, still per shard: to be all-reduced with SUM.
        """
        local_max = stats[0]
        # A shard whose logits are all -inf (or an ignored row) adds nothing: scale 0, not NaN.
        scale = torch.where(local_max == float("-inf"), 0.0, torch.exp(local_max - logits_max))
        stats[1].mul_(scale)
        return stats[2], stats[1], stats[3]

    @staticmethod
    def calculate_cross_entropy_loss(predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor,
                                     sum_logits: torch.Tensor, logits_max: torch.Tensor, target: torch.Tensor,
                                     vocab_size: int, ignore_index: int = -100, label_smoothing: float = 0.0
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and log-sum-exp from the global statistics (after the SUM all-reduces).

        ``lse = M + log(sum_exp)``; ``loss = lse - (1 - s)·x_t - (s / V)·sum_j x_j`` with
        ``s = label_smoothing·V/(V-1)`` (Megatron's smoothing: epsilon spread over the V - 1
        wrong ids; s = 0 without smoothing), V the GLOBAL vocabulary size.

        Args:
            predicted_logits, sum_exp_logits, sum_logits, logits_max: [rows], global.
            target: [rows]; rows equal to ``ignore_index`` get loss 0 and lse 0.
            vocab_size: global V.
            ignore_index, label_smoothing: as the entry points.

        Returns:
            ``(loss, lse)``, [rows] each, float32 (float64 for float64 logits).
        """
        active = target != ignore_index
        log_sum_exp = torch.log(sum_exp_logits)
        lse = torch.where(active, log_sum_exp + logits_max, 0.0)
        # log(sum) + (M - x_t) rather than lse - x_t: large logits do not cancel in float32.
        if label_smoothing > 0:
            s = label_smoothing * vocab_size / (vocab_size - 1)
            loss = log_sum_exp + (1.0 - s) * (logits_max - predicted_logits) + s * logits_max \
                - (s / vocab_size) * sum_logits
        else:
            loss = log_sum_exp + (logits_max - predicted_logits)
        return torch.where(active, loss, 0.0), lse

    @staticmethod
    def calculate_gradients(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                            grad_output: torch.Tensor, vocab_start_index: int, vocab_size: int,
                            ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
        """The shard's gradient, ``(softmax - (1 - s)·onehot - s/V) · grad_output`` (Triton).

        No communication: every rank has the global lse from the forward pass.

        Args:
            vocab_parallel_logits: [rows, V/p], the forward logits.
            target: [rows] global ids.
            lse: [rows] global log-sum-exp (0 for ignored rows).
            grad_output: [rows] gradient of the per-token loss (any stride).
            vocab_start_index, vocab_size, ignore_index, label_smoothing: as above.

        Returns:
            A new contiguous [rows, V/p] tensor of the logits' dtype.
        """
        return cross_entropy_bwd(vocab_parallel_logits, target, lse, grad_output, vocab_start_index, ignore_index,
                                 label_smoothing, vocab_size)


def shard_range(x2d: torch.Tensor, tp_group: dist.ProcessGroup | None,
                rank_and_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(vocab_start_index, vocab_size)`` of this rank's shard of ``x2d`` [rows, V/p] in ``tp_group``
    (``rank_and_size``: :func:`tp_rank_and_size` of it, where the caller has it already)."""
    rank, size = rank_and_size if rank_and_size is not None else tp_rank_and_size(tp_group)
    partition_vocab_size = x2d.shape[1]
    start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab_size, rank, size)
    return start, partition_vocab_size * size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Autograd wiring of the unfused vocab-parallel cross entropy (3 or 4 all-reduces).

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None, ignore_index=-100):
        target = widen_target(target, ignore_index)  # an int32 target and an ignore_index beyond int32
        x2d, t1d = prepare_inputs(vocab_parallel_logits, target, label_smoothing, ignore_index)
        vocab_start_index, vocab_size = shard_range(x2d, tp_group)
        check_label_smoothing(vocab_size, label_smoothing)
        vpce = VocabParallelCrossEntropy

        # the kernel checks the target ids (bad rows: NaN; on the CPU it raises here, before
        # any collective; on CUDA later, without a host sync: TARGET_CHECK)
        stats, logits_max = vpce.calculate_logits_max(x2d, t1d, vocab_start_index, ignore_index, label_smoothing,
                                                      vocab_size, check=TARGET_CHECK)
        all_reduce(logits_max, "MAX", tp_group)  # collective 1: the global max M
        predicted_logits, sum_exp_logits, sum_logits = vpce.calculate_predicted_logits(stats, logits_max)
        all_reduce(predicted_logits, "SUM", tp_group)  # collective 2: x_t from the rank that holds t
        all_reduce(sum_exp_logits, "SUM", tp_group)  # collective 3: sum of e^{x - M} over V
        if label_smoothing > 0:
            all_reduce(sum_logits, "SUM", tp_group)  # collective 4: the sum of logits over V
        loss, lse = vpce.calculate_cross_entropy_loss(predicted_logits, sum_exp_logits, sum_logits, logits_max,
                                                      t1d, vocab_size, ignore_index, label_smoothing)

        ctx.save_for_backward(x2d, t1d, lse)
        keep_graph_anchor(ctx, vocab_parallel_logits, x2d)  # (x2d: a copy where the logits were not one view)
        ctx.args = (vocab_start_index, vocab_size, ignore_index, label_smoothing, vocab_parallel_logits.shape)
        return loss.view(target.shape)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output):
        x2d, t1d, lse = ctx.saved_tensors
        vocab_start_index, vocab_size, ignore_index, label_smoothing, shape = ctx.args
        grad = VocabParallelCrossEntropy.calculate_gradients(
            x2d, t1d, lse, grad_output.reshape(-1), vocab_start_index, vocab_size, ignore_index, label_smoothing)
        return grad.view(shape), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross entropy of logits split along the vocabulary over ``tp_group`` (unfused collectives).

    Args:
        vocab_parallel_logits: this rank's shard, [s, b, V/p] (any [..., V/p]), float32 / float16 /
            bfloat16 / float64, CUDA or CPU, any strides. Never modified. Every rank's shard must
            have the same width V/p (not checked: see the module docstring).
        target: [s, b] int64/int32 ids in the GLOBAL vocabulary [0, V), V = p·V/p; the same on
            every rank.
        label_smoothing: Megatron's epsilon in [0, 1): probability epsilon spread over the V - 1
            wrong ids, i.e. ``F.cross_entropy(label_smoothing=epsilon·V/(V-1))``.
        tp_group: the tensor-parallel group; None: :mod:`parallel_state`'s when model parallelism
            is initialized (Megatron-core's group), else the default group if torch.distributed
            is initialized, else a single rank (no communication).
        ignore_index: targets equal to it give zero loss and zero gradient (PyTorch's -100).
            Any int64: one outside int32's range with an int32 target ignores nothing.

    Returns:
        The per-token loss, [s, b], float32 (float64 for float64 logits); its gradient w.r.t.
        the logits has the logits' dtype.

    Raises:
        TypeError, ValueError: see :func:`prepare_inputs`; TypeError for a tp_group that is
            neither None nor a torch.distributed ProcessGroup; ValueError for label smoothing
            with V < 2, and for target ids outside [0, V) other than ignore_index: at once on
            the CPU (and with ``FUSEDLIB_SYNC_CHECKS=1``), else at a later fusedlib call or
            :func:`fusedlib.runtime.check_errors`, without a host sync. Their rows' loss and
            gradient are NaN in every mode (the only signal inside ``torch.compile``).

    Collectives: all-reduce MAX [rows], SUM [rows], SUM [rows] (and SUM [rows] for the mean
    with label smoothing), each a separate call. Backward: none.

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``vocab_parallel_cross_entropy``); the fixes are listed in this module's docstring.
    """
    tp_group = resolve_tp_group(tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group, ignore_index)
