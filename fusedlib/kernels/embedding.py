"""The device-side range check of token ids for the vocabulary-parallel embedding.

With the vocabulary split over p > 1 ranks, each rank looks up the ids it holds and writes
zeros for the others, so an id outside [0, V) would be a zero row on every rank: a silent wrong
answer (Megatron-core's ``VocabParallelEmbedding`` accepts it; one rank's ``F.embedding``
raises). Checking on the host would wait for the GPU at every step; this kernel reads the ids
and stores a bad one into the :class:`~fusedlib.runtime.DeviceCheck` word instead, which fusedlib
reports as a ValueError (at once on the CPU, lazily on CUDA, as the cross entropy's target
check does). Every rank sees the same ids, so every rank reports it.

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``VocabParallelEmbedding``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import DeviceCheck, launch
from .launch import cdiv

__all__ = ["IDS_CHECK", "check_ids_in_range"]

#: Ids per program: the check is a read of b·s integers, so one tile shape serves every size.
BLOCK: int = 1024


def _message(bad: int, context) -> str:
    vocab_size = context if context is not None else "V"
    return (f"VocabParallelEmbedding: input_ids must hold vocabulary ids in [0, {vocab_size}), got {bad} "
            f"(with the vocabulary split over ranks its row would be zeros on every rank)")


#: The check's word and message (one per process, see :class:`~fusedlib.runtime.DeviceCheck`).
IDS_CHECK = DeviceCheck("VocabParallelEmbedding", _message)


@triton.jit
def _ids_in_range_kernel(
    IDS_ptr,  # token ids [n], contiguous, int32 or int64
    ERR_ptr,  # int64 [1]: an id outside [0, vocab_size) is stored here (never 0: 0 is in range)
    n,
    vocab_size,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    ids = tl.load(IDS_ptr + offs, mask=inside, other=0).to(tl.int64)
    bad = inside & ((ids < 0) | (ids >= vocab_size))
    tl.store(ERR_ptr + tl.zeros_like(offs), ids, mask=bad)


def check_ids_in_range(ids: torch.Tensor, vocab_size: int) -> None:
    """Check that every id of ``ids`` lies in [0, ``vocab_size``), without a host sync on CUDA.

    Args:
        ids: token ids, any shape, int32 or int64 (a non-contiguous tensor is copied once).
        vocab_size: V, the whole vocabulary (not one rank's part).

    Raises:
        ValueError: on the CPU, and on CUDA with ``FUSEDLIB_SYNC_CHECKS=1``, when an id is out
            of range (naming it and V); on CUDA otherwise, at a later fusedlib call or at
            :func:`fusedlib.runtime.check_errors`. Nothing is checked while ``torch.compile``
            traces (the word is then None).
    """
    n = ids.numel()
    if n == 0:
        return
    err = IDS_CHECK.word(ids)
    if err is None:
        return
    flat = ids.reshape(n)
    launch(_ids_in_range_kernel, (cdiv(n, BLOCK),), ids.device, flat, err, n, vocab_size, BLOCK=BLOCK, num_warps=4)
    IDS_CHECK.launched(ids, vocab_size)
