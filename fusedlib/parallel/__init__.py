"""Tensor parallelism on torch.distributed: process groups, communication, layers, loss, checkpoints.

* process groups (:mod:`.parallel_state`): :func:`initialize_model_parallel`,
  :func:`destroy_model_parallel`, :func:`get_tensor_model_parallel_group` / ``_rank`` /
  ``_world_size`` (and the data-parallel ones), :func:`spawn` (N processes from Python; or
  ``torchrun``);
* communication as autograd functions (:mod:`.mappings`): :func:`copy_to_tensor_model_parallel_region`,
  :func:`reduce_from_tensor_model_parallel_region`, :func:`scatter_to_tensor_model_parallel_region`,
  :func:`gather_from_tensor_model_parallel_region`, :func:`scatter_to_sequence_parallel_region`,
  :func:`gather_from_sequence_parallel_region`, :func:`reduce_scatter_to_sequence_parallel_region`;
* layers (:mod:`.layers`): :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`;
* random numbers (:mod:`.random`): :func:`model_parallel_cuda_manual_seed`,
  :func:`get_cuda_rng_tracker`, :func:`checkpoint`;
* gradients (:mod:`.finalize_model_grads`, :mod:`.clip_grads`): :func:`finalize_model_grads`,
  :func:`clip_grad_norm` (the norm of the whole model, over the ranks);
* checkpoints (:mod:`.checkpointing`): :func:`get_tensor_parallel_layout`,
  :func:`shard_state_dict`, :func:`unshard_state_dict`;
* the loss (:mod:`.cross_entropy`): :func:`vocab_parallel_cross_entropy` (Megatron-core's unfused
  path, 3 all-reduces, 4 with label smoothing) and :func:`fused_vocab_parallel_cross_entropy`
  (2 all-reduces), :class:`VocabUtility`, :class:`VocabParallelCrossEntropy`;
* bookkeeping (:mod:`.utils`): :func:`count_collectives` logs every collective fusedlib issues.

Source: Megatron-LM ``megatron/core/tensor_parallel/``, ``megatron/core/parallel_state.py``,
``megatron/core/distributed/finalize_model_grads.py``, ``megatron/core/optimizer/clip_grads.py`` and
``megatron/core/fusions/fused_cross_entropy.py``.
"""
from .checkpointing import PartitionSpec, get_tensor_parallel_layout, shard_state_dict, unshard_state_dict
from .clip_grads import clip_grad_norm
from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .finalize_model_grads import finalize_model_grads
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .parallel_state import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
    spawn,
)
from .random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from .utils import CollectiveCall, CollectiveLog, VocabUtility, all_reduce, count_collectives, tp_rank_and_size

__all__ = [
    # process groups
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "spawn",
    # communication
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    # layers
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    # random numbers
    "model_parallel_cuda_manual_seed",
    "get_cuda_rng_tracker",
    "checkpoint",
    # gradients and checkpoints
    "finalize_model_grads",
    "clip_grad_norm",
    "PartitionSpec",
    "get_tensor_parallel_layout",
    "shard_state_dict",
    "unshard_state_dict",
    # the loss
    "vocab_parallel_cross_entropy",
    "fused_vocab_parallel_cross_entropy",
    "VocabParallelCrossEntropy",
    "VocabUtility",
    # bookkeeping
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
