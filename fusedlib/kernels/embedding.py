"""Two kernels of the token embedding: the device-side range check of token ids for the
vocabulary-parallel embedding, and a deterministic weight gradient.

With the vocabulary split over p > 1 ranks, each rank looks up the ids it holds and writes
zeros for the others, so an id outside [0, V) would be a zero row on every rank: a silent wrong
answer (Megatron-core's ``VocabParallelEmbedding`` accepts it; one rank's ``F.embedding``
raises). Checking on the host would wait for the GPU at every step; this kernel reads the ids
and stores a bad one into the :class:`~fusedlib.runtime.DeviceCheck` word instead, which fusedlib
reports as a ValueError (at once on the CPU, lazily on CUDA, as the cross entropy's target
check does). Every rank sees the same ids, so every rank reports it.

The weight gradient (:func:`embedding_backward`). The gradient of row v of the weight is the
sum of the output gradients of every token whose id is v. PyTorch's CUDA kernel for it
(``embedding_dense_backward``) sorts the ids and then, by default, adds each run of equal ids
into the row with atomic additions (``compute_grad_weight_atomic_accumulate``), in whatever
order the thread blocks finish: the float32 sums, and now and then their bf16 rounding, differ
from run to run. With a byte vocabulary of 256 and 32,768 tokens a step, every id recurs about
128 times, and two trainings that agree bit for bit for hundreds of steps part at one such
rounding. This kernel sorts the ids stably (``torch.argsort(stable=True)``, deterministic) and
gives each run of equal ids to one program, which adds its rows in sorted order, ``BLOCK_R``
rows at a time in a fixed reduction tree: the same bits on every run, with no host
synchronisation (a program per token; those that do not start a run return at once).

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``VocabParallelEmbedding``);
PyTorch ``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import DeviceCheck, launch
from .launch import TL_DTYPE, acc_dtype, cdiv, next_power_of_2

__all__ = ["IDS_CHECK", "check_ids_in_range", "embedding_backward"]

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


@triton.jit
def _embedding_bwd_kernel(
    SORTED_ptr,  # the ids, sorted (stably), [n], int64
    ORDER_ptr,  # the rows of G in that order, [n], int64
    STARTS_ptr,  # (GIVEN_STARTS) the first position of every run of equal ids, [programs], int64
    G_ptr,  # output gradient, [n, n_cols], unit column stride
    OUT_ptr,  # weight gradient, [vocab_size, n_cols], contiguous, zeros where no token is
    n,
    n_cols,
    stride_g,
    vocab_size,
    BLOCK_R: tl.constexpr,  # rows added per step
    BLOCK_H: tl.constexpr,  # columns per program
    ACC: tl.constexpr,
    GIVEN_STARTS: tl.constexpr,  # the host found the runs (CPU); else one program per position
):
    if GIVEN_STARTS:
        i = tl.load(STARTS_ptr + tl.program_id(0))
    else:
        i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    tok = tl.load(SORTED_ptr + i)
    prev = tl.load(SORTED_ptr + i - 1, mask=i > 0, other=-1)
    # one program per run of equal ids: the one at its first position (ids out of range are the
    # forward's error; they are never written)
    if (tok != prev) & (tok >= 0) & (tok < vocab_size):
        acc = tl.zeros((BLOCK_H,), dtype=ACC)
        j = i
        more = tok == tok
        while more:
            rows = j + tl.arange(0, BLOCK_R)
            same = tl.load(SORTED_ptr + rows, mask=rows < n, other=-1) == tok
            src = tl.load(ORDER_ptr + rows, mask=same, other=0)
            g = tl.load(G_ptr + src[:, None] * stride_g + cols[None, :], mask=same[:, None] & col_mask[None, :],
                        other=0.0)
            acc += tl.sum(g.to(ACC), axis=0)
            j += BLOCK_R
            more = tl.load(SORTED_ptr + j, mask=j < n, other=-1) == tok
        tl.store(OUT_ptr + tok * n_cols + cols, acc.to(OUT_ptr.dtype.element_ty), mask=col_mask)


#: Rows a program adds per step, and the widest column block.
EMBEDDING_BWD_BLOCK_R, EMBEDDING_BWD_MAX_BLOCK_H = 32, 128


def embedding_backward(ids: torch.Tensor, grad: torch.Tensor, num_embeddings: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gradient of an embedding's weight, deterministic: row v = the sum of ``grad``'s rows
    of the tokens whose id is v (zeros for ids that do not occur), added in a fixed order.

    Args:
        ids: token ids, any shape [*], int32 or int64, each in [0, num_embeddings) (the forward's
            lookup has checked them; rows of ids outside are not written).
        grad: the output gradient, [*, h] (``ids``' shape plus the embedding width), float16,
            bfloat16, float32 or float64, any strides.
        num_embeddings: V, the weight's rows.
        dtype: the result's dtype (default ``grad``'s).

    Returns:
        [V, h] of ``dtype``, summed in float32 (float64 for float64 ``grad``) and rounded once.

    Raises:
        ValueError: ``grad``'s shape is not ``ids``' plus one dimension, ``ids`` not an integer
            tensor, or V < 1.

    Source: the module docstring; PyTorch's ``embedding_dense_backward`` (the same sum, with atomics).
    """
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an int32 or int64 tensor, got {ids.dtype}")
    if grad.dim() != ids.dim() + 1 or grad.shape[:-1] != ids.shape:
        raise ValueError(f"grad must have ids' shape {list(ids.shape)} plus the embedding width, got "
                         f"{list(grad.shape)}")
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 1:
        raise ValueError(f"num_embeddings must be an int >= 1, got {num_embeddings!r}")
    n, h = ids.numel(), grad.shape[-1]
    out = torch.zeros(num_embeddings, h, dtype=dtype or grad.dtype, device=grad.device)
    if n == 0 or h == 0:
        return out
    flat = ids.reshape(n).to(torch.int64)
    order = torch.argsort(flat, stable=True)  # deterministic, and equal ids keep the tokens' order
    g2d = grad.reshape(n, h)
    if g2d.stride(1) != 1:
        g2d = g2d.contiguous()
    given = grad.device.type == "cpu"
    # (the interpreter runs programs one by one: there, a column block as wide as the row)
    block_h = min(next_power_of_2(h), 1024 if given else EMBEDDING_BWD_MAX_BLOCK_H)
    sorted_ids = flat[order]
    # On a GPU the number of runs is not known without waiting for the device: one program per
    # position, and those inside a run return. On the CPU (Triton's interpreter, where every
    # program costs) the host finds the runs' starts first, for free.
    if given:
        starts = torch.nonzero(torch.cat([sorted_ids[:1] != sorted_ids[:1] - 1, sorted_ids[1:] != sorted_ids[:-1]]))
        starts = starts.reshape(-1)
    else:
        starts = sorted_ids  # (unread)
    launch(_embedding_bwd_kernel, (starts.numel() if given else n, cdiv(h, block_h)), grad.device, sorted_ids,
           order, starts, g2d, out, n, h, g2d.stride(0), num_embeddings, BLOCK_R=EMBEDDING_BWD_BLOCK_R,
           BLOCK_H=block_h, ACC=TL_DTYPE[acc_dtype(grad.dtype)], GIVEN_STARTS=given, num_warps=4)
    return out
