"""Fused vocab-parallel cross entropy: two all-reduces instead of three, on Triton kernels.

The unfused path (:mod:`fusedlib.parallel.cross_entropy`) all-reduces the global max (MAX),
then the target logit (SUM) and the sum of exponentials (SUM) separately. The max must be
known before the sums can be rescaled to it, so it needs its own collective; but the two
sums are independent SUM reductions of the same shape, so they can travel together:
concatenate, reduce once, split. Megatron-core does that with ``torch.cat``; fusedlib's
forward kernel writes the statistics of a row next to each other (a [4, rows] tensor), so
the "concatenation" is the contiguous slice ``stats[1:3]`` (``stats[1:4]`` with label
smoothing, whose mean of logits rides along in the same collective), and costs nothing.

On a single device (a group of one rank) nothing needs combining: the forward kernel
finishes the loss itself (``FINALIZE``), one kernel per pass, the fastest path.

Source: Megatron-LM ``megatron/core/fusions/fused_cross_entropy.py``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.cross_entropy import _cross_entropy_fwd, cross_entropy_fwd
from ..parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    _VocabParallelCrossEntropy as _UnfusedVocabParallelCrossEntropy,
    check_label_smoothing,
    prepare_inputs,
    shard_range,
    target_check_message,
    widen_target,
)
from ..runtime import DeviceCheck
from ..parallel.utils import all_reduce, resolve_tp_group, tp_rank_and_size
from ._apply import apply, keep_graph_anchor

__all__ = [
    "calculate_logits_max",
    "calculate_predicted_logits",
    "calculate_cross_entropy_loss",
    "calculate_gradients",
    "fused_vocab_parallel_cross_entropy",
    "TARGET_CHECK",
]

calculate_logits_max = VocabParallelCrossEntropy.calculate_logits_max
calculate_gradients = VocabParallelCrossEntropy.calculate_gradients

#: The device-side target check of :func:`fused_vocab_parallel_cross_entropy` (as the unfused
#: path's, :data:`fusedlib.parallel.cross_entropy.TARGET_CHECK`, under this op's name).
TARGET_CHECK = DeviceCheck("fused_vocab_parallel_cross_entropy",
                           target_check_message("fused_vocab_parallel_cross_entropy"))


def calculate_predicted_logits(stats: torch.Tensor, logits_max: torch.Tensor, label_smoothing: float = 0.0
                               ) -> torch.Tensor:
    """Rescale the shard's sum-exp to the global max and return the block to SUM-reduce.

    Args:
        stats: [4, rows] from :func:`calculate_logits_max` (updated in place).
        logits_max: [rows], the global max (after the MAX all-reduce).
        label_smoothing: > 0 also sends the sum of logits.

    Returns:
        ``predicted_logits_sum_exp_logits``: the contiguous view ``stats[1:3]`` = [sum-exp,
        target logit] ([2, rows]), or ``stats[1:4]`` with the sum of logits ([3, rows]).

    Source: Megatron-LM ``megatron/core/fusions/fused_cross_entropy.py``
    (``calculate_predicted_logits``).
    """
    VocabParallelCrossEntropy.calculate_predicted_logits(stats, logits_max)
    return stats[1:4] if label_smoothing > 0 else stats[1:3]


def calculate_cross_entropy_loss(predicted_logits_sum_exp_logits: torch.Tensor, logits_max: torch.Tensor,
                                 target: torch.Tensor, vocab_size: int, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the reduced block and compute ``(loss, lse)`` ([rows] each), as
    :meth:`VocabParallelCrossEntropy.calculate_cross_entropy_loss`.

    Source: Megatron-LM ``megatron/core/fusions/fused_cross_entropy.py``
    (``calculate_cross_entropy_loss``).
    """
    sum_exp_logits, predicted_logits = predicted_logits_sum_exp_logits[0], predicted_logits_sum_exp_logits[1]
    sum_logits = predicted_logits_sum_exp_logits[2] if label_smoothing > 0 else None
    return VocabParallelCrossEntropy.calculate_cross_entropy_loss(
        predicted_logits, sum_exp_logits, sum_logits, logits_max, target, vocab_size, ignore_index, label_smoothing)


class _VocabParallelCrossEntropy(_UnfusedVocabParallelCrossEntropy):
    """Autograd wiring of the fused vocab-parallel cross entropy (2 all-reduces, 0 on one rank).

    Saves the logits (a reference, no copy), the target and lse ([rows] float32), as the
    unfused Function does, whose backward it inherits: one Triton kernel, no communication.

    Source: Megatron-LM ``megatron/core/fusions/fused_cross_entropy.py``.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp_group=None, label_smoothing=0.0, ignore_index=-100):
        target = widen_target(target, ignore_index)
        # The forward kernel checks the target ids: a bad id's row gets NaN and, on the CPU,
        # a ValueError here, before any collective; on CUDA later, with no host sync (TARGET_CHECK).
        if tp_group is None and not (dist.is_available() and dist.is_initialized()):
            # One rank, the whole vocabulary: one kernel writes loss and lse, no collectives. The
            # argument checks (_check_one_rank) run unless this call's signature passed them before.
            (loss, lse), x2d, t1d = _cross_entropy_fwd(vocab_parallel_logits, target, 0, ignore_index,
                                                       label_smoothing, None, True, None, TARGET_CHECK,
                                                       validate=_check_one_rank)
            vocab_start_index, vocab_size = 0, x2d.shape[1]
        else:
            x2d, t1d = prepare_inputs(vocab_parallel_logits, target, label_smoothing, ignore_index)
            rank_and_size = tp_rank_and_size(tp_group)
            vocab_start_index, vocab_size = shard_range(x2d, tp_group, rank_and_size)
            check_label_smoothing(vocab_size, label_smoothing)
            if rank_and_size[1] == 1:  # a group of one rank
                loss, lse = cross_entropy_fwd(x2d, t1d, 0, ignore_index, label_smoothing, vocab_size, finalize=True,
                                              check=TARGET_CHECK)
            else:
                stats, logits_max = calculate_logits_max(x2d, t1d, vocab_start_index, ignore_index, label_smoothing,
                                                         vocab_size, check=TARGET_CHECK)
                all_reduce(logits_max, "MAX", tp_group)  # collective 1: the global max
                block = calculate_predicted_logits(stats, logits_max, label_smoothing)
                all_reduce(block, "SUM", tp_group)  # collective 2: sum-exp, x_t (and sum of logits) at once
                loss, lse = calculate_cross_entropy_loss(block, logits_max, t1d, vocab_size, ignore_index,
                                                         label_smoothing)

        ctx.save_for_backward(x2d, t1d, lse)
        keep_graph_anchor(ctx, vocab_parallel_logits, x2d)  # (x2d: a copy where the logits were not one view)
        ctx.args = (vocab_start_index, vocab_size, ignore_index, label_smoothing, vocab_parallel_logits.shape)
        return loss if target.dim() == 1 else loss.view(target.shape)  # [rows] is target's shape already


def _check_one_rank(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float, ignore_index: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-rank forward's argument checks (:func:`prepare_inputs`, :func:`check_label_smoothing`
    with the whole vocabulary here): ``(x2d, t1d)``."""
    x2d, t1d = prepare_inputs(logits, target, label_smoothing, ignore_index)
    check_label_smoothing(x2d.shape[1], label_smoothing)
    return x2d, t1d


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross entropy of logits split along the vocabulary, with two all-reduces.

    Args:
        vocab_parallel_logits: this rank's shard, [s, b, V/p] (any [..., V/p]), float32 /
            float16 / bfloat16 / float64, CUDA or CPU, any strides. Never modified. Every
            rank's shard must have the same width V/p (not checked: see
            :mod:`fusedlib.parallel.cross_entropy`).
        target: [s, b] int64/int32 ids in the global vocabulary [0, V); the same on every rank.
        tp_group: the tensor-parallel group (Megatron requires it; here None means
            :mod:`~fusedlib.parallel.parallel_state`'s when model parallelism is initialized,
            else the default group if torch.distributed is initialized, else one rank and no
            communication).
        label_smoothing: Megatron's epsilon in [0, 1) (Megatron's fused path has none):
            probability epsilon spread over the V - 1 wrong ids, i.e.
            ``F.cross_entropy(label_smoothing=epsilon·V/(V-1))``, not torch's
            ``label_smoothing=epsilon`` (torch spreads it over all V ids). The mean of the
            logits rides in the same SUM all-reduce.
        ignore_index: targets equal to it give zero loss and zero gradient. Any int64: one
            outside int32's range with an int32 target ignores nothing (that target is read
            as an int64 copy, [s, b]).

    Returns:
        The per-token loss, [s, b], float32 (float64 for float64 logits). Its gradient w.r.t.
        the logits has the logits' dtype (Megatron's fused path always returned bfloat16).

    Raises:
        TypeError, ValueError: as :func:`fusedlib.parallel.vocab_parallel_cross_entropy`
            (TypeError for a tp_group neither None nor a torch.distributed ProcessGroup). A
            target id outside [0, V) other than ignore_index makes its row's loss and gradient
            NaN and raises a ValueError: at once on the CPU (and with
            ``FUSEDLIB_SYNC_CHECKS=1``); on CUDA at a later fusedlib call or at
            :func:`fusedlib.runtime.check_errors`, so that no host sync is needed (this op
            compiles with ``torch.compile(fullgraph=True)`` and captures in CUDA graphs).

    Collectives: all-reduce MAX [rows], then one all-reduce SUM [2, rows] ([3, rows] with
    label smoothing). None on a single rank, none in backward.

    Source: Megatron-LM ``megatron/core/fusions/fused_cross_entropy.py``
    (``fused_vocab_parallel_cross_entropy``).
    """
    tp_group = resolve_tp_group(tp_group)
    return apply(_VocabParallelCrossEntropy, vocab_parallel_logits, target, tp_group, label_smoothing, ignore_index)
