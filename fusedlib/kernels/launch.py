"""The launch layer every kernel launcher of :mod:`fusedlib.kernels` shares.

A launcher turns tensors into a kernel launch: it picks a tile (how many rows and columns
one program handles, with how many warps), sizes the grid, and chooses the compute dtype.
This module holds each of those once:

* :class:`Tile`: one tile type for every kernel;
* :func:`pick`: the one lookup in a tile table, a tuple of ``(upper bound of n_cols, Tile)``
  rows; each op keeps its own tuned table in its kernel file, and every launcher takes an
  optional ``tile=`` that replaces the table's pick (how ``python -m fusedlib.bench.tune``
  tries candidates);
* :func:`persistent_grid`: programs and rows per program for kernels whose programs loop
  over rows (the backward kernels that keep running bias or gamma gradients);
* :func:`cdiv`, :func:`next_power_of_2`: plain Python ints (``triton.cdiv`` and
  ``triton.next_power_of_2`` are ``constexpr_function`` objects in recent Triton, whose call
  wrapper costs several microseconds of Python each);
* :func:`acc_dtype` and :data:`TL_DTYPE`: the dtype policy (load, compute in float32, store
  in the output dtype; float64 stays float64, so ``gradcheck`` can check the kernels);
* :func:`as_rows`: [..., n] -> [rows, n] without a copy where strides allow;
  :func:`empty_contiguous_like`: an output of the input's shape, contiguous.

The host side is part of the op (DESIGN.md): an eager training step pays for every line
here on every call, so everything that depends only on the row length or the dtype is a
dict lookup after the first call, and nothing here imports inside a function or syncs.

Sources: Liger-Kernel's ``calculate_settings`` (``src/liger_kernel/ops/utils.py``) and
quack's tile tables, for settings written as commented tables; Triton's layer-norm and
fused-softmax tutorials for the persistent grid.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton.language as tl

__all__ = [
    "Tile",
    "TileTable",
    "pick",
    "persistent_grid",
    "sm_count",
    "INTERPRETER_SMS",
    "cdiv",
    "next_power_of_2",
    "acc_dtype",
    "TL_DTYPE",
    "as_rows",
    "empty_contiguous_like",
    "MAX_FUSED_SIZE",
    "HUGE",
]

#: Longest row one program may hold in registers, in elements (64 Ki). Kernels that hold a
#: whole row (the norms, the softmax's register kernel) stop here; longer rows loop.
MAX_FUSED_SIZE: int = 65536

#: An upper bound every row length is under: the last row of a table that covers any length.
HUGE: int = 1 << 62


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints a >= 0, b >= 1, in plain Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n, for n >= 1 (1 for n = 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Tile:
    """How one kernel is launched: the tile a program handles, its warps and pipelining.

    Attributes:
        BLOCK_M: rows per tile (several for short rows, so a program moves enough bytes).
        BLOCK_N: columns per tile, a power of two. 0 in a table means "the whole row" (the
            next power of two >= n_cols); :func:`pick` resolves it, and caps every BLOCK_N at
            the row's next power of two. A kernel that can hold whole rows or loop over them
            (softmax, the norms' backward) loops exactly when BLOCK_N is less than the row's
            next power of two.
        num_warps: warps per program (4 or 8 for most; up to 32 for rows of 64 Ki).
        num_stages: software-pipelining depth of a row loop (``tl.range(num_stages=)``):
            k > 1 loads the next k - 1 tiles while the current one is reduced; 1 does not
            pipeline. Read only by kernels with such a loop.
        programs_per_sm: for kernels whose programs loop over rows (a persistent grid): k
            programs per streaming multiprocessor (:func:`persistent_grid`); 0: one program
            per tile of BLOCK_M rows.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int = 1
    programs_per_sm: int = 0


#: A tile table: ``(upper bound of n_cols, Tile)`` rows in increasing bound order; a row
#: length takes the first row whose bound it does not pass.
TileTable = tuple[tuple[int, Tile], ...]

# pick()'s memory: (id(table), n_cols) -> Tile. Tables are module constants; each table
# seen is also kept in _PINNED, so that its id cannot be reused by another object while
# its picks are remembered. Plain dicts keyed by ints, which torch.compile (Dynamo) traces;
# they are filled only outside a compile: Dynamo refuses a write to a global inside an
# autograd.Function it traces ("unsafe side effect"), and a compiled graph needs no cache.
_PICKS: dict[tuple[int, int], Tile] = {}
_PINNED: dict[int, TileTable] = {}


def _lookup(table: TileTable, n_cols: int) -> Tile:
    if n_cols < 1:
        raise ValueError(f"n_cols must be >= 1, got {n_cols}")
    whole = next_power_of_2(n_cols)
    for bound, tile in table:
        if n_cols <= bound:
            if 0 < tile.BLOCK_N <= whole:
                return tile
            return replace(tile, BLOCK_N=whole)
    raise ValueError(f"a row of {n_cols} elements is past the tile table's last bound, {table[-1][0]}")


def pick(table: TileTable, n_cols: int) -> Tile:
    """The tile of ``table`` for rows of ``n_cols`` elements (remembered: a dict lookup after
    the first call for each row length).

    Args:
        table: ``(upper bound of n_cols, Tile)`` rows, bounds increasing.
        n_cols: the row length (>= 1).

    Returns:
        The first row's Tile whose bound is >= n_cols, with BLOCK_N resolved: the next power
        of two >= n_cols where the table says 0 (the whole row) or more.

    Raises:
        ValueError: for n_cols < 1, or past the table's last bound.
    """
    if torch.compiler.is_compiling():
        # Dynamo traces neither id() nor a write to a global here; a compiled graph calls
        # this once, at trace time, so the table's walk costs nothing there
        return _lookup(table, n_cols)
    key = (id(table), n_cols)
    tile = _PICKS.get(key)
    if tile is None:
        tile = _lookup(table, n_cols)
        _PINNED[id(table)] = table
        _PICKS[key] = tile
    return tile


#: Streaming multiprocessors of the "device" Triton's CPU interpreter is: it runs program
#: instances one at a time, at a fixed cost per operation, so fewer, larger programs are
#: faster there; the grid changes only the order of partial sums, never the result's meaning.
INTERPRETER_SMS: int = 2

_SMS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (CUDA), or :data:`INTERPRETER_SMS` (CPU);
    queried once per device (remembered outside a compile, as :func:`pick`'s tiles)."""
    n = _SMS.get(device)
    if n is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            n = torch.cuda.get_device_properties(index).multi_processor_count
        else:
            n = INTERPRETER_SMS
        if not torch.compiler.is_compiling():
            _SMS[device] = n
    return n


def persistent_grid(n_rows: int, block_m: int, programs_per_sm: int, device: torch.device,
                    column_blocks: int = 1) -> tuple[int, int]:
    """``(row_programs, rows_per_program)`` covering ``n_rows`` >= 1 rows in tiles of ``block_m``.

    With ``programs_per_sm`` = k > 0, a persistent grid: enough programs to fill the device
    (k per streaming multiprocessor, shared among ``column_blocks`` column blocks), each
    looping over ``rows_per_program`` rows (a multiple of ``block_m``) and keeping one partial
    sum per column (a bias or gamma gradient): fewer programs, fewer partials to add. With
    k = 0, one program per tile. The last program may get fewer rows; none gets none.

    Args:
        n_rows: rows (>= 1).
        block_m: rows per tile.
        programs_per_sm: k (see above).
        device: where the kernel runs (:func:`sm_count`).
        column_blocks: programs along the row, sharing the device's programs.

    Returns:
        The number of row programs and the rows each one handles.
    """
    tiles = cdiv(n_rows, block_m)
    if programs_per_sm == 0:
        return tiles, block_m
    programs = max(1, min(tiles, programs_per_sm * sm_count(device) // column_blocks))
    rows_per_program = cdiv(tiles, programs) * block_m
    return cdiv(n_rows, rows_per_program), rows_per_program


# The dtype policy, as dict lookups: inputs of every float dtype compute and accumulate in
# float32, except float64 (kept, so that gradcheck can check the kernels themselves).
_ACC: dict[torch.dtype, torch.dtype] = {torch.float64: torch.float64}

#: A torch compute dtype as the Triton dtype a kernel's ``ACC`` constexpr takes.
TL_DTYPE: dict[torch.dtype, tl.dtype] = {torch.float32: tl.float32, torch.float64: tl.float64}


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype fusedlib's kernels compute and accumulate in for inputs of ``dtypes``:
    float64 if any is float64, else float32 (statistics, partial sums and losses are kept
    in it too). ``TL_DTYPE[acc_dtype(...)]`` is the kernels' ``ACC`` constexpr.

    Args:
        *dtypes: the input dtypes (one or more).

    Returns:
        ``torch.float64`` or ``torch.float32``.
    """
    for d in dtypes:
        if d in _ACC:
            return torch.float64
    return torch.float32


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` of shape [..., n] as a 2-D matrix of rows: [..., n] -> [prod(...), n].

    Kernels take the result's two strides, so a transposed or sliced 2-D input needs no
    copy. ``reshape`` copies only when the leading dims of a non-contiguous N-D input
    cannot be merged into one stride; the input itself is never modified.

    Args:
        t: a tensor with at least 1 dim.

    Returns:
        A 2-D tensor [rows, n] (``t`` itself when it is 2-D; a view where strides allow).
    """
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def empty_contiguous_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new uninitialised contiguous tensor of ``t``'s shape, device and dtype (or ``dtype``).

    ``torch.empty_like(t)`` where ``t`` is contiguous (it keeps the strides, and parses no
    arguments: about half the host time of ``torch.empty(shape, dtype=..., device=...)``),
    else ``torch.empty`` with ``t``'s shape, dtype and device.

    Args:
        t: any tensor.
        dtype: the result's dtype (None: ``t``'s).

    Returns:
        A contiguous tensor (``is_contiguous()``) of ``t``'s shape on ``t``'s device.
    """
    if dtype is None or dtype == t.dtype:
        if t.is_contiguous():
            return torch.empty_like(t)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty(t.shape, dtype=dtype, device=t.device)
