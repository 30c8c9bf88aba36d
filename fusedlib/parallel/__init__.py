"""torch.distributed pieces: vocab-parallel cross entropy (unfused and fused), shard ranges,
and a log of the collectives fusedlib issues.

* :func:`vocab_parallel_cross_entropy`: Megatron-core's unfused path, 3 all-reduces
  (4 with label smoothing), on fusedlib's Triton kernels.
* :func:`fused_vocab_parallel_cross_entropy`: 2 all-reduces (MAX, then one SUM of the
  concatenated statistics), with or without label smoothing.
* :class:`VocabUtility`, :class:`VocabParallelCrossEntropy` (the step functions),
  :func:`count_collectives`.

Source: Megatron-LM ``megatron/core/tensor_parallel/`` and ``megatron/core/fusions/fused_cross_entropy.py``.
"""
from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .utils import CollectiveCall, CollectiveLog, VocabUtility, all_reduce, count_collectives, tp_rank_and_size

__all__ = [
    "vocab_parallel_cross_entropy",
    "fused_vocab_parallel_cross_entropy",
    "VocabParallelCrossEntropy",
    "VocabUtility",
    "CollectiveCall",
    "CollectiveLog",
    "count_collectives",
    "all_reduce",
    "tp_rank_and_size",
]


def __getattr__(name: str):
    # fusedlib.fusions.fused_cross_entropy imports this package's modules, so its entry point
    # is re-exported lazily (an eager import here would be circular).
    if name == "fused_vocab_parallel_cross_entropy":
        from ..fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        return fused_vocab_parallel_cross_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
