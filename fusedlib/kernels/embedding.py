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
rounding. :func:`embedding_backward` sorts the ids stably (``torch.argsort(stable=True)``,
deterministic) and adds in two stages, each in a fixed order: the first cuts every run of equal
ids into pieces of ``BLOCK_R`` rows and sums each piece (one program per piece, one reduction
tree); the second adds each run's pieces in order (one program per run). Two stages, because
ids are far from uniform: in Python source the space byte alone is about a fifth of the tokens,
a run of thousands of rows that one program could only add one piece after another. The runs
and pieces are found on the device (a binary search of the sorted ids for each run's first
position, a running sum of integers for the pieces' indices, both exact), so nothing waits for
the host; each kernel's program list is as long as a bound known on the host (n / BLOCK_R + V + 1
pieces, V + 1 runs), padded with programs that return at once. The same bits on every call.

A small vocabulary takes another route (:data:`ONEHOT_MAX_VOCAB`, the byte vocabulary of
chapter 9 among them): the gradient is a matrix product, ``dW = onehot(ids)^T · grad``, where
``onehot(ids)`` [n, V] holds a 1 where token t has id v. No sort and no search: each program
builds its [BLOCK_V, BLOCK_T] block of the one-hot matrix in registers from BLOCK_T ids and
multiplies it by the [BLOCK_T, BLOCK_H] block of ``grad`` on the tensor cores, accumulating in
float32 over its chunk of tokens; the chunks' sums are added in a fixed order by the reduction
module's second stage (:func:`fusedlib.kernels.reduce.finish_partials`). A product by 0 or 1
is exact and the sums are float32, as the sort's, so the result is the same sum added in
another (but fixed) order: the same bits on every call again. Not for inf or NaN, since
0 · inf is NaN: a step of tokens whose gradient tile holds one is added token by token instead,
each row taking only its own tokens' values, as the sort does. The work grows with V (every
token meets every row of the block), so only small vocabularies take it. Timed on an H100 (CUDA
graphs of 20 calls, bf16, a fifth of the ids one id; before each step checked its tile for
non-finite values): 32,768 tokens of width 384, V = 256 (chapter 9's step): 29 us against the
sort's 172 (PyTorch's atomic kernel: 115); 8,192 x 768, V = 256: 19 against 153; 32,768 x 768,
V = 512: 104 against 204; V = 1024: 244 against 212, where the sort is the faster.

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``VocabParallelEmbedding``);
PyTorch ``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import SUPPORTED_FLOAT_DTYPES, check_same_device, check_tensor
from ..runtime import INTERPRET_ON_CPU, DeviceCheck, launch
from .launch import FOLD_TILES, TL_DTYPE, acc_dtype, cdiv, dot_settings, next_power_of_2, persistent_grid
from .reduce import finish_partials, partials_buffer

__all__ = ["IDS_CHECK", "ONEHOT_MAX_VOCAB", "check_ids_in_range", "embedding_backward"]

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
        ids: token ids, any shape, int32 or int64 (a non-contiguous tensor, an expanded or
            strided view included, is copied once: the kernel reads one contiguous row).
        vocab_size: V, the whole vocabulary (not one rank's part).

    Raises:
        TypeError: ids not a tensor of int32 or int64.
        ValueError: on the CPU, and on CUDA with ``FUSEDLIB_SYNC_CHECKS=1``, when an id is out
            of range (naming it and V); on CUDA otherwise, at a later fusedlib call or at
            :func:`fusedlib.runtime.check_errors`. Nothing is checked while ``torch.compile``
            traces (the word is then None).

    Source: fusedlib's own check; Megatron-LM ``megatron/core/tensor_parallel/layers.py``
    (``VocabParallelEmbedding``) has none.
    """
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64))
    n = ids.numel()
    if n == 0:
        return
    err = IDS_CHECK.word(ids)
    if err is None:
        return
    flat = ids.contiguous().reshape(n)  # reshape alone keeps a strided view: the kernel would read between its elements
    launch(_ids_in_range_kernel, (cdiv(n, BLOCK),), ids.device, flat, err, n, vocab_size, BLOCK=BLOCK, num_warps=4)
    IDS_CHECK.launched(ids, vocab_size)




@triton.jit
def _position_and_columns(STARTS_ptr, n_cols, BLOCK_H: tl.constexpr):
    """The sorted position this program starts at (n: none, the list's padding) and its block
    of columns with their mask."""
    p = tl.load(STARTS_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return p, cols, cols < n_cols


@triton.jit
def _embedding_bwd_pieces_kernel(
    SORTED_ptr,  # the ids, sorted (stably), [n], int64
    ORDER_ptr,  # the rows of G in that order, [n], int64
    PIECE_ptr,  # the index of the piece each position would begin, [n], int64
    STARTS_ptr,  # the positions that begin a piece, in order, then n (padding), [programs], int64
    G_ptr,  # output gradient, [n, n_cols], unit column stride
    PIECES_ptr,  # the pieces' sums, [pieces, n_cols], ACC
    n,
    n_cols,
    stride_g,
    BLOCK_R: tl.constexpr,  # rows per piece
    BLOCK_H: tl.constexpr,  # columns per program
    ACC: tl.constexpr,
):
    p, cols, col_mask = _position_and_columns(STARTS_ptr, n_cols, BLOCK_H)
    if p < n:  # p begins a piece of its run
        tok = tl.load(SORTED_ptr + p)
        rows = p + tl.arange(0, BLOCK_R)
        same = (rows < n) & (tl.load(SORTED_ptr + rows, mask=rows < n, other=-1) == tok)  # (runs are contiguous)
        src = tl.load(ORDER_ptr + rows, mask=same, other=0)
        g = tl.load(G_ptr + src[:, None] * stride_g + cols[None, :], mask=same[:, None] & col_mask[None, :],
                    other=0.0)
        piece = tl.load(PIECE_ptr + p)
        tl.store(PIECES_ptr + piece * n_cols + cols, tl.sum(g.to(ACC), axis=0), mask=col_mask)


@triton.jit
def _embedding_bwd_runs_kernel(
    SORTED_ptr,  # the ids, sorted, [n], int64
    PIECE_ptr,  # [n], int64
    STARTS_ptr,  # the positions that begin a run, in order, then n (padding), [programs], int64
    PIECES_ptr,  # [pieces, n_cols], ACC
    OUT_ptr,  # weight gradient, [vocab_size, n_cols], contiguous, zeros where no token is
    n,
    n_cols,
    vocab_size,
    BLOCK_R: tl.constexpr,  # rows per piece
    BLOCK_K: tl.constexpr,  # pieces added per step
    BLOCK_H: tl.constexpr,
    ACC: tl.constexpr,
):
    p, cols, col_mask = _position_and_columns(STARTS_ptr, n_cols, BLOCK_H)
    tok = tl.load(SORTED_ptr + p, mask=p < n, other=-1)
    # one program per run, from its first position; ids out of range (the forward's error,
    # mapped to V) are never written
    if (p < n) & (tok >= 0) & (tok < vocab_size):
        first = tl.load(PIECE_ptr + p)  # the run's pieces are first, first + 1, ...
        acc = tl.zeros((BLOCK_H,), dtype=ACC)
        k = 0
        more = tok == tok
        while more:
            j = k + tl.arange(0, BLOCK_K)
            at = p + j * BLOCK_R  # where piece j of the run begins
            inside = (at < n) & (tl.load(SORTED_ptr + at, mask=at < n, other=-1) == tok)
            part = tl.load(PIECES_ptr + (first + j)[:, None] * n_cols + cols[None, :],
                           mask=inside[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(part, axis=0)
            k += BLOCK_K
            nxt = p + k * BLOCK_R
            more = (nxt < n) & (tl.load(SORTED_ptr + nxt, mask=nxt < n, other=-1) == tok)
        tl.store(OUT_ptr + tok * n_cols + cols, acc.to(OUT_ptr.dtype.element_ty), mask=col_mask)


def _starts(begins: torch.Tensor, index: torch.Tensor, bound: int, positions: torch.Tensor) -> torch.Tensor:
    """The positions where ``begins`` holds, in order, then n (``positions.numel()``) up to
    ``bound`` entries, without a host sync: position i goes to entry ``index[i]`` (the count of
    begins up to i, minus 1) and the others to a spare entry past the end, dropped."""
    n = positions.numel()
    out = torch.full((bound + 1,), n, dtype=torch.int64, device=positions.device)
    out.index_put_((torch.where(begins, index, bound),), positions)  # distinct entries, but the spare's
    return out[:bound]


#: Rows per piece, pieces a run's program adds per step, the widest column block.
EMBEDDING_BWD_BLOCK_R, EMBEDDING_BWD_BLOCK_K, EMBEDDING_BWD_MAX_BLOCK_H = 32, 32, 128

#: Vocabularies of at most this many rows take the one-hot product (module docstring), larger
#: ones the sort; float64 gradients always the sort.
ONEHOT_MAX_VOCAB: int = 512
#: The one-hot product's tiles: vocabulary rows, columns, tokens per step (the widest; at most
#: the next power of two of V and h, at least 16, the tensor cores' smallest side), warps. The
#: best of 28 forms timed at [32768, 384] and [8192, 768] with V = 256 (H100): one program per
#: SM, each a chunk of the tokens (:func:`~fusedlib.kernels.launch.persistent_grid`).
ONEHOT_BLOCK_V, ONEHOT_BLOCK_H, ONEHOT_BLOCK_T, ONEHOT_WARPS = 128, 128, 64, 8


@triton.jit
def _embedding_bwd_onehot_kernel(
    IDS_ptr,  # token ids, [n], int32 or int64
    G_ptr,  # output gradient, [n, n_cols], unit column stride
    PART_ptr,  # [chunks, vocab_size, n_cols]: each chunk's sums (ACC), or with one chunk the result
    n,
    n_cols,
    vocab_size,
    stride_g,
    tokens_per_chunk,  # a multiple of BLOCK_T
    BLOCK_V: tl.constexpr,  # vocabulary rows per program
    BLOCK_H: tl.constexpr,  # columns per program
    BLOCK_T: tl.constexpr,  # tokens per step
    DOT: tl.constexpr,  # the products' operand dtype (launch.dot_settings)
    PRECISION: tl.constexpr,  # their input_precision: "ieee" for float32 (tf32 would round the gradient)
):
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    chunk = tl.program_id(2)
    vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    start = chunk.to(tl.int64) * tokens_per_chunk
    end = tl.minimum(start + tokens_per_chunk, n)
    for t in range(start, end, BLOCK_T):
        toks = t + tl.arange(0, BLOCK_T)
        tok_mask = toks < end
        ids = tl.load(IDS_ptr + toks, mask=tok_mask, other=-1)  # -1 (and any id outside [0, V)) matches no row
        g = tl.load(G_ptr + toks[:, None] * stride_g + cols[None, :], mask=tok_mask[:, None] & col_mask[None, :],
                    other=0.0)
        # an inf or NaN in the tile would enter every row through 0 * inf = NaN: such a tile (never
        # in a finite step) is added token by token instead, each row taking its own tokens only
        finite = tl.abs(g.to(tl.float32)) < float("inf")  # false for NaN too
        if tl.min(tl.min(finite.to(tl.int32), axis=1), axis=0) == 1:
            onehot = (ids[None, :] == vs[:, None]).to(DOT)  # [BLOCK_V, BLOCK_T]: 1 where the token's id is the row
            acc = tl.dot(onehot, g.to(DOT), acc, input_precision=PRECISION)  # exact products, float32 sums
        else:
            for j in range(0, BLOCK_T):
                tok = t + j
                if tok < end:
                    row = tl.load(G_ptr + tok * stride_g + cols, mask=col_mask, other=0.0).to(tl.float32)
                    acc = tl.where((vs == tl.load(IDS_ptr + tok))[:, None], acc + row[None, :], acc)
    out = PART_ptr + chunk.to(tl.int64) * vocab_size * n_cols + vs[:, None].to(tl.int64) * n_cols + cols[None, :]
    tl.store(out, acc.to(PART_ptr.dtype.element_ty), mask=(vs < vocab_size)[:, None] & col_mask[None, :])


def _onehot_tile(size: int, widest: int) -> int:
    """A tile side for ``size`` rows or columns: the next power of two, within [16, widest]."""
    return max(16, min(widest, next_power_of_2(size)))


def _embedding_backward_onehot(ids: torch.Tensor, g2d: torch.Tensor, num_embeddings: int,
                               out_dtype: torch.dtype) -> torch.Tensor:
    """The one-hot product (module docstring): ``ids`` [n], ``g2d`` [n, h] with unit column
    stride, float16, bfloat16 or float32 -> [V, h] of ``out_dtype``."""
    n, h = g2d.shape
    device = g2d.device
    block_v, block_h = _onehot_tile(num_embeddings, ONEHOT_BLOCK_V), _onehot_tile(h, ONEHOT_BLOCK_H)
    v_blocks, h_blocks = cdiv(num_embeddings, block_v), cdiv(h, block_h)
    # one program per SM in all: chunks of the tokens for each block of the result; with at most
    # FOLD_TILES steps of tokens one chunk, which stores the result itself (no second stage)
    chunks, tokens_per_chunk = persistent_grid(n, ONEHOT_BLOCK_T, 1, device, v_blocks * h_blocks,
                                               fold_tiles=FOLD_TILES)
    partials = partials_buffer(chunks, num_embeddings * h, torch.float32, out_dtype, device)
    dot, precision = dot_settings(g2d.dtype, INTERPRET_ON_CPU)
    launch(_embedding_bwd_onehot_kernel, (v_blocks, h_blocks, chunks), device,
           ids, g2d, partials, n, h, num_embeddings, g2d.stride(0), tokens_per_chunk,
           BLOCK_V=block_v, BLOCK_H=block_h, BLOCK_T=ONEHOT_BLOCK_T, DOT=dot, PRECISION=precision,
           num_warps=ONEHOT_WARPS)
    return finish_partials(partials, out_dtype).view(num_embeddings, h)


def embedding_backward(ids: torch.Tensor, grad: torch.Tensor, num_embeddings: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gradient of an embedding's weight, deterministic: row v = the sum of ``grad``'s rows
    of the tokens whose id is v (zeros for ids that do not occur), added in a fixed order: a
    one-hot matrix product for V <= :data:`ONEHOT_MAX_VOCAB` (float16, bfloat16, float32), else
    the ids sorted and each id's rows added in two stages (module docstring).

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
        TypeError: ``ids`` or ``grad`` not a tensor, or of another dtype than above.
        ValueError: ``grad``'s shape is not ``ids``' plus one dimension, the two on different
            devices or on one without fusedlib's kernels, V not an int in [1, 2^31), or
            ``dtype`` not None or one of the float dtypes above.

    Source: the module docstring; PyTorch's ``embedding_dense_backward`` (the same sum, with atomics);
    the one-hot product as the gradient of a one-hot matrix multiplication, the embedding's definition.
    """
    return _embedding_backward(ids, grad, num_embeddings, dtype)


def _embedding_backward(ids, grad, num_embeddings, dtype, host_runs: bool | None = None,
                        onehot: bool | None = None) -> torch.Tensor:
    """:func:`embedding_backward` with its route chosen: ``onehot`` True the one-hot product,
    False the sort (``host_runs``: the runs found by the host; None: on the CPU), None as the
    docstring says (the product for V <= :data:`ONEHOT_MAX_VOCAB` and 16- or 32-bit gradients)."""
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64))
    check_tensor("grad", grad, dtypes=SUPPORTED_FLOAT_DTYPES)
    check_same_device(ids=ids, grad=grad)
    if grad.dim() != ids.dim() + 1 or grad.shape[:-1] != ids.shape:
        raise ValueError(f"grad must have ids' shape {list(ids.shape)} plus the embedding width, got "
                         f"{list(grad.shape)}")
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or not 1 <= num_embeddings < 2 ** 31:
        raise ValueError(f"num_embeddings must be an int in [1, 2^31), got {num_embeddings!r}")
    if dtype is not None and dtype not in SUPPORTED_FLOAT_DTYPES:
        raise ValueError(f"dtype must be None or one of "
                         f"{[str(d).replace('torch.', '') for d in SUPPORTED_FLOAT_DTYPES]}, got {dtype!r}")
    n, h = ids.numel(), grad.shape[-1]
    device = grad.device
    if host_runs is None:
        host_runs = device.type == "cpu"
    if onehot is None:
        onehot = num_embeddings <= ONEHOT_MAX_VOCAB and grad.dtype != torch.float64
    elif onehot and grad.dtype == torch.float64:
        raise ValueError("the one-hot route takes float16, bfloat16 or float32 gradients, got float64")
    if n == 0 or h == 0:
        return torch.zeros(num_embeddings, h, dtype=dtype or grad.dtype, device=device)
    g2d = grad.reshape(n, h)
    if g2d.stride(1) != 1:
        g2d = g2d.contiguous()
    if onehot:  # (the kernel reads the ids as n consecutive integers: a strided or expanded view is copied)
        return _embedding_backward_onehot(ids.reshape(n).contiguous(), g2d, num_embeddings, dtype or grad.dtype)
    out = torch.zeros(num_embeddings, h, dtype=dtype or grad.dtype, device=device)
    # ids out of range all become V (never written): then at most V + 1 runs
    flat = ids.reshape(n).to(torch.int64)
    flat = torch.where((flat < 0) | (flat >= num_embeddings), num_embeddings, flat)
    order = torch.argsort(flat, stable=True)  # deterministic; equal ids keep the tokens' order
    sorted_ids = flat[order]
    positions = torch.arange(n, device=device, dtype=torch.int64)
    # each position's run begins at the first position of its id: a binary search of the sorted
    # ids (exact, one kernel; a running maximum over one long row is a slow scan in PyTorch)
    run_start = torch.searchsorted(sorted_ids, sorted_ids)
    begins = run_start == positions
    piece_begins = (positions - run_start) % EMBEDDING_BWD_BLOCK_R == 0
    piece = torch.cumsum(piece_begins.to(torch.int64), dim=0) - 1  # exact
    # bounds on the pieces and runs, known without a sync: every run has a partial piece at most
    n_runs = min(n, num_embeddings + 1)
    n_pieces = min(n, n // EMBEDDING_BWD_BLOCK_R + n_runs)
    acc = acc_dtype(grad.dtype)
    pieces = torch.empty(n_pieces, h, dtype=acc, device=device)
    # (the interpreter runs programs one by one: there, column blocks as wide as the row)
    block_h = min(next_power_of_2(h), 1024 if host_runs else EMBEDDING_BWD_MAX_BLOCK_H)
    col_blocks = cdiv(h, block_h)
    if host_runs:  # on the CPU the host finds the pieces and the runs first, for free
        piece_starts = torch.nonzero(piece_begins).reshape(-1)
        run_starts = torch.nonzero(begins).reshape(-1)
    else:  # on a GPU that would wait for the device: lists as long as the bounds, padded with n
        piece_starts = _starts(piece_begins, piece, n_pieces, positions)
        run_starts = _starts(begins, torch.cumsum(begins.to(torch.int64), dim=0) - 1, n_runs, positions)
    launch(_embedding_bwd_pieces_kernel, (piece_starts.numel(), col_blocks), device,
           sorted_ids, order, piece, piece_starts, g2d, pieces, n, h, g2d.stride(0),
           BLOCK_R=EMBEDDING_BWD_BLOCK_R, BLOCK_H=block_h, ACC=TL_DTYPE[acc], num_warps=4)
    launch(_embedding_bwd_runs_kernel, (run_starts.numel(), col_blocks), device,
           sorted_ids, piece, run_starts, pieces, out, n, h, num_embeddings,
           BLOCK_R=EMBEDDING_BWD_BLOCK_R, BLOCK_K=EMBEDDING_BWD_BLOCK_K, BLOCK_H=block_h, ACC=TL_DTYPE[acc],
           num_warps=4)
    return out
