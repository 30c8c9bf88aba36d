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
  :func:`empty_contiguous_like`: an output of the input's shape, contiguous;
* :func:`direct_launch`: the launch itself on the compiled path, without Triton's per-call
  Python (``JITFunction.run``: about 19 us per launch on the H200), through a cache of the
  compiled kernels that Triton's own path returned (see its docstring and
  :data:`DIRECT_LAUNCH`, on by default, off with ``FUSEDLIB_DIRECT_LAUNCH=0``);
  :func:`fusedlib.runtime.launch` calls it; :func:`bind_launch`, what it launches for a
  call, looked up once (:class:`fusedlib.runtime.LaunchPlan`, the ops' launches after the
  first one for an input signature, call Triton's C launcher with it); :func:`bound_launch`,
  the same launch with everything but Triton's C launcher done once (what the benchmark's
  host floor times).

The host side is part of the op (the benchmark counts it: the plain-launch ``ms_eager`` of its
records): an eager training step pays for every line
here on every call, so everything that depends only on the row length or the dtype is a
dict lookup after the first call, and nothing here imports inside a function or syncs.

Sources: Liger-Kernel's ``calculate_settings`` (``src/liger_kernel/ops/utils.py``) and
quack's tile tables, for settings written as commented tables; Triton's layer-norm and
fused-softmax tutorials for the persistent grid.
"""
from __future__ import annotations

import math

import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

try:  # Triton's host-side TMA descriptor (Triton >= 3.4); FlashAttention's backward imports it from here
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # a Triton without host-side descriptors: no argument is one
    _TensorDescriptor = None

__all__ = [
    "Tile",
    "TileTable",
    "MAX_NUM_STAGES",
    "pick",
    "persistent_grid",
    "FOLD_TILES",
    "sm_count",
    "INTERPRETER_SMS",
    "cdiv",
    "next_power_of_2",
    "acc_dtype",
    "TL_DTYPE",
    "dot_settings",
    "as_rows",
    "empty_contiguous_like",
    "MAX_FUSED_SIZE",
    "HUGE",
    "DIRECT_LAUNCH",
    "DIRECT_LAUNCH_VERSIONS",
    "TRITON_TRUE_VALUES",
    "FALSE_VALUES",
    "env_flag",
    "CHECK_LAUNCH",
    "LaunchStats",
    "launch_stats",
    "direct_launch",
    "launch_key",
    "refuse_neg_arguments",
    "bind_launch",
    "bound_launch",
    "clear_launch_cache",
]

#: Longest row one program may hold in registers, in elements (64 Ki). Kernels that hold a
#: whole row (the norms, the softmax's register kernel) stop here; longer rows loop.
MAX_FUSED_SIZE: int = 65536

#: An upper bound every row length is under: the last row of a table that covers any length.
HUGE: int = 1 << 62


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints a >= 0, b >= 1, in plain Python.

    Source: Triton's ``triton.cdiv``, in plain Python.
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n, for n >= 1 (1 for n = 1).

    Source: Triton's ``triton.next_power_of_2``, in plain Python.
    """
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

    Raises:
        TypeError: a field that is not an int (a bool is not one).
        ValueError: BLOCK_M < 1, BLOCK_N < 0, num_warps not a power of two from 1 to 32,
            num_stages outside 1 to :data:`MAX_NUM_STAGES`, programs_per_sm < 0. (Whether
            BLOCK_N must be a power of two, and which tiles fit a kernel, the launchers check.)

    Source: Liger-Kernel's ``calculate_settings`` (``src/liger_kernel/ops/utils.py``) and quack's
    tile tables.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int = 1
    programs_per_sm: int = 0

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "programs_per_sm"):
            v = getattr(self, name)
            if type(v) is not int:
                raise TypeError(f"Tile.{name} must be an int, got {v!r} ({type(v).__name__})")
        if self.BLOCK_M < 1:
            raise ValueError(f"Tile.BLOCK_M must be >= 1 (rows per tile), got {self.BLOCK_M}")
        if self.BLOCK_N < 0:
            raise ValueError(f"Tile.BLOCK_N must be >= 0 (columns per tile; 0: the whole row), got {self.BLOCK_N}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"Tile.num_warps must be a power of two from 1 to 32, got {self.num_warps}")
        if not 1 <= self.num_stages <= MAX_NUM_STAGES:
            raise ValueError(f"Tile.num_stages must be from 1 (no pipelining) to {MAX_NUM_STAGES}, got "
                             f"{self.num_stages}")
        if self.programs_per_sm < 0:
            raise ValueError(f"Tile.programs_per_sm must be >= 0 (0: one program per tile), got {self.programs_per_sm}")


#: The deepest software pipelining a :class:`Tile` may ask for: each stage holds one more
#: tile's loads in shared memory (the tables use 1 to 3; FlashAttention's 2 or 3).
MAX_NUM_STAGES: int = 8


#: A tile table: ``(upper bound of n_cols, Tile)`` rows in increasing bound order; a row
#: length takes the first row whose bound it does not pass.
TileTable = tuple[tuple[int, Tile], ...]

# pick()'s memory: (id(table), n_cols, resolve_block_n) -> Tile. Tables are module constants; each table
# seen is also kept in _PINNED, so that its id cannot be reused by another object while
# its picks are remembered. Plain dicts keyed by ints, which torch.compile (Dynamo) traces;
# they are filled only outside a compile: Dynamo refuses a write to a global inside an
# autograd.Function it traces ("unsafe side effect"), and a compiled graph needs no cache.
_PICKS: dict[tuple[int, int, bool], Tile] = {}
_PINNED: dict[int, TileTable] = {}


def _lookup(table: TileTable, n_cols: int, resolve_block_n: bool) -> Tile:
    if n_cols < 1:
        raise ValueError(f"n_cols must be >= 1, got {n_cols}")
    whole = next_power_of_2(n_cols)
    for bound, tile in table:
        if n_cols <= bound:
            if not resolve_block_n or 0 < tile.BLOCK_N <= whole:
                return tile
            return replace(tile, BLOCK_N=whole)
    raise ValueError(f"a row of {n_cols} elements is past the tile table's last bound, {table[-1][0]}")


def pick(table: TileTable, n_cols: int, *, resolve_block_n: bool = True) -> Tile:
    """The tile of ``table`` for rows of ``n_cols`` elements (remembered: a dict lookup after
    the first call for each row length).

    Args:
        table: ``(upper bound of n_cols, Tile)`` rows, bounds increasing.
        n_cols: the row length (>= 1); for tables keyed by something else (FlashAttention's,
            by head dim), that key.
        resolve_block_n: BLOCK_N is a block of the row (True): resolve it as below. False:
            BLOCK_N counts something else (FlashAttention's keys) and is returned as the
            table gives it.

    Returns:
        The first row's Tile whose bound is >= n_cols, with BLOCK_N resolved: the next power
        of two >= n_cols where the table says 0 (the whole row) or more.

    Raises:
        ValueError: for n_cols < 1, or past the table's last bound.

    Source: Liger-Kernel's ``calculate_settings`` (``src/liger_kernel/ops/utils.py``) and quack's
    tile tables.
    """
    if torch.compiler.is_compiling():
        # Dynamo traces neither id() nor a write to a global here; a compiled graph calls
        # this once, at trace time, so the table's walk costs nothing there
        return _lookup(table, n_cols, resolve_block_n)
    key = (id(table), n_cols, resolve_block_n)
    tile = _PICKS.get(key)
    if tile is None:
        tile = _lookup(table, n_cols, resolve_block_n)
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
    queried once per device (remembered outside a compile, as :func:`pick`'s tiles).

    Source: fusedlib's own.
    """
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


#: :func:`persistent_grid`'s ``fold_tiles`` for kernels that reduce over rows: with at most
#: this many tiles of rows, one program per column block loops over all of them, so that its
#: partial sums are the result and the second stage (a launch and a buffer, ~10 us of host
#: time per call) is skipped. 8 tiles are a few thousand elements per program at the tiny
#: shapes where the host, not the GPU, decides the time: 8 steps of one program's loop.
FOLD_TILES: int = 8


def persistent_grid(n_rows: int, block_m: int, programs_per_sm: int, device: torch.device,
                    column_blocks: int = 1, fold_tiles: int = 0) -> tuple[int, int]:
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
        fold_tiles: with at most this many tiles, one row program (a kernel that reduces
            over rows then needs no second stage; :data:`FOLD_TILES`). 0: no folding.

    Returns:
        The number of row programs and the rows each one handles.

    Source: Triton's layer-norm and fused-softmax tutorials (the persistent grid).
    """
    tiles = cdiv(n_rows, block_m)
    if tiles <= fold_tiles:
        return 1, tiles * block_m
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

    Source: fusedlib's own dtype policy.
    """
    for d in dtypes:
        if d in _ACC:
            return torch.float64
    return torch.float32


_DOT_DTYPE: dict[torch.dtype, tl.dtype] = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                                           torch.float32: tl.float32}


def dot_settings(dtype: torch.dtype, interpreted: bool) -> tuple[tl.dtype, str]:
    """(DOT, PRECISION) for ``tl.dot`` on operands loaded as ``dtype``: the dtype to cast them
    to and the ``input_precision``.

    bfloat16 products run in float32 in Triton's interpreter (``interpreted``), which cannot
    multiply bfloat16 (the operands are bfloat16 values already, so the products are the
    GPU's); float32 operands multiply in IEEE float32, not TF32 (10-bit mantissas), so that
    float32 is a reference dtype.

    Args:
        dtype: float16, bfloat16 or float32.
        interpreted: whether the kernel runs in Triton's interpreter.

    Returns:
        A Triton dtype and ``"ieee"`` or ``"tf32"`` (which 16-bit operands ignore).

    Source: fusedlib's own; Triton's ``tl.dot`` (``input_precision``).
    """
    if dtype == torch.bfloat16 and interpreted:
        return tl.float32, "ieee"
    return _DOT_DTYPE[dtype], ("ieee" if dtype == torch.float32 else "tf32")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` of shape [..., n] as a 2-D matrix of rows: [..., n] -> [prod(...), n].

    Kernels take the result's two strides, so a transposed or sliced 2-D input needs no
    copy. ``reshape`` copies only when the leading dims of a non-contiguous N-D input
    cannot be merged into one stride; the input itself is never modified.

    Args:
        t: a tensor with at least 1 dim.

    Returns:
        A 2-D tensor [rows, n] (``t`` itself when it is 2-D; a view where strides allow), for
        any sizes: 0 rows or 0 columns too (where ``reshape(-1, 0)`` could not infer the -1).

    Source: fusedlib's own.
    """
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


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

    Source: fusedlib's own.
    """
    if dtype is None or dtype == t.dtype:
        if t.is_contiguous():
            return torch.empty_like(t)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


# ----------------------------------------------------------------------------------------
# Direct launches: the compiled kernel, without Triton's per-call Python
# ----------------------------------------------------------------------------------------
#
# ``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run`` on every call: it binds the
# arguments, computes Triton's specialization key (each argument's type and whether a
# pointer or int is divisible by 16, or an int is 1), turns the options into a string,
# looks the compiled kernel up, checks the kernel's globals, builds launch metadata, and
# only then calls the compiled kernel's launcher. On the H200 that is about 19 us per
# launch, several times the GPU time of a small kernel. A fused op's arguments change
# little from call to call: the same dtypes, the same constexprs, the same alignments.
# So direct_launch keys a dict on exactly what selects the compiled binary, fills it
# with the CompiledKernel that Triton's own path returns on the first call, and launches
# that kernel's launcher directly afterwards.
#
# What Triton 3.6 does, read in its source (``triton/runtime/jit.py`` ``JITFunction.run``,
# ``create_function_from_signature``, ``compute_cache_key``; ``python/src/specialize.cc``;
# ``triton/compiler/compiler.py`` ``CompiledKernel``; ``triton/backends/nvidia/driver.py``
# ``make_launcher``, ``CudaLauncher``):
#
# * the cache is per device (``device_caches[current device]``); its key is the list of
#   (type, specialization) pairs of every parameter plus ``str(options)``, where options are
#   the keyword arguments that are not parameters (``num_warps``, ``num_stages``...) plus
#   ``debug`` (``kernel.debug or knobs.runtime.debug``) and ``instrumentation_mode``
#   (``knobs.compilation.instrumentation_mode``);
# * a tensor: its dtype, and "D" when ``data_ptr() % 16 == 0``; an int: "constexpr" when it
#   equals 1, else i32 / i64 / u64 by range, and "D" when divisible by 16; a float: fp32,
#   never specialized; a bool: u1; None: constexpr; a constexpr parameter: its value;
# * the launch is ``kernel.run(grid0, grid1, grid2, stream, kernel.function,
#   kernel.packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook,
#   *bound_args.values())``: every parameter in signature order, constexprs and ints
#   specialized to 1 included (the generated C launcher parses them as objects and drops
#   them); ``launch_metadata`` is None when no enter hook is set; the stream is
#   ``driver.active.get_current_stream(device)``;
# * ``kernel.run`` is a ``CudaLauncher``: its ``__call__`` allocates the global and profile
#   scratch (None when their sizes are 0) and calls the C ``launch(gridX, gridY, gridZ,
#   stream, function, launch_cooperative_grid, launch_pdl, global_scratch,
#   profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *args)``.
#
# fusedlib's key holds, per positional argument, the same facts as Triton's (tensor: dtype
# and 16-byte alignment; int: equal to 1, i32 range or not, divisible by 16; float; bool;
# None), every keyword argument with its value, the device, and the two knobs: it is at
# least as fine as Triton's key, so every call that finds an entry would have found the same
# CompiledKernel through ``kernel[grid]``. ``FUSEDLIB_CHECK_LAUNCH=1`` (or setting
# :data:`CHECK_LAUNCH`) asks Triton for its kernel on every direct launch and raises if it
# is not the cached one. Anything else goes through ``kernel[grid]``: another Triton version,
# the interpreter, a launch hook (profilers), a pre-run hook, a constexpr passed
# positionally, a runtime argument passed by keyword, an argument of another type.
# Skipped on the direct path, as ``CompiledKernel[grid]`` (Triton's own cached-kernel
# runner) skips it: the check that the kernel's globals did not change since it was
# compiled (fusedlib's kernels read only ``tl.constexpr`` module constants).

#: Triton versions (major.minor) whose launch protocol the direct launcher follows, read in
#: their source; with any other version every launch goes through ``kernel[grid]``.
DIRECT_LAUNCH_VERSIONS: tuple[str, ...] = ("3.6",)


#: What Triton reads as true in a boolean environment variable (``triton.knobs``' env_bool):
#: ``TRITON_INTERPRET`` is read here as Triton reads it ("true" made Triton interpret the
#: kernels while fusedlib, which took only "1", treated them as compiled).
TRITON_TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on", "y")

#: What fusedlib's own switches (``FUSEDLIB_*``) read as false; unset or empty is the
#: switch's default, and any value in neither this nor :data:`TRITON_TRUE_VALUES` is an error.
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "n")


def env_flag(name: str, default: bool) -> bool:
    """A fusedlib switch from the environment variable ``name``: ``default`` when it is unset or
    empty, True for one of :data:`TRITON_TRUE_VALUES`, False for one of :data:`FALSE_VALUES`
    (either case, surrounding spaces ignored).

    Args:
        name: the variable, e.g. ``FUSEDLIB_DIRECT_LAUNCH``.
        default: the switch when the variable is unset or empty.

    Returns:
        The switch, a bool.

    Raises:
        ValueError: any other value, naming the variable and the values it takes (a typo such
            as ``FUSEDLIB_DIRECT_LAUNCH=of`` must not silently leave the switch on).

    Source: fusedlib's own; the true values as Triton reads a boolean variable (``triton.knobs``).
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in TRITON_TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected one of "
                     f"{', '.join(TRITON_TRUE_VALUES)} (on) or {', '.join(FALSE_VALUES)} (off), or unset")


#: Whether Triton interprets the kernels in this process (``TRITON_INTERPRET`` true as Triton
#: reads it, at import; :mod:`fusedlib.runtime` settles the variable before importing this).
TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_TRUE_VALUES


def _direct_launch_possible(version: str, interpret: bool) -> bool:
    """Whether direct launches can be used: compiled kernels and a verified Triton version."""
    return not interpret and ".".join(version.split(".")[:2]) in DIRECT_LAUNCH_VERSIONS


#: True when :func:`fusedlib.runtime.launch` launches compiled kernels through
#: :func:`direct_launch`: kernels are compiled (``TRITON_INTERPRET`` is not true), the
#: Triton version is in :data:`DIRECT_LAUNCH_VERSIONS`, and ``FUSEDLIB_DIRECT_LAUNCH`` is not
#: off (``0``: the switch back to ``kernel[grid]`` for every launch; read by :func:`env_flag`).
#: On the H200 the direct path's own tests (``tests/test_launch.py``: every public op's
#: outputs and gradients bitwise equal to ``kernel[grid]``'s, checked against Triton's own
#: kernel choice) pass. Read on every launch, so tests may set it to compare both paths.
DIRECT_LAUNCH: bool = (env_flag("FUSEDLIB_DIRECT_LAUNCH", True)  # (read first: a bad value is refused anywhere)
                       and _direct_launch_possible(triton.__version__, TRITON_INTERPRET))

#: ``FUSEDLIB_CHECK_LAUNCH=1`` (a debug mode; tests may set the attribute): every direct
#: launch also asks Triton (``kernel.run(..., warmup=True)``: binding, key, lookup, no
#: launch) for the compiled kernel it would launch, and raises RuntimeError if it is not the
#: one fusedlib's cache holds.
CHECK_LAUNCH: bool = env_flag("FUSEDLIB_CHECK_LAUNCH", False)


class LaunchStats:
    """Counters of :func:`direct_launch` (process-wide; :func:`launch_stats` returns them).

    Attributes:
        hits: launches of a cached compiled kernel (the direct path).
        misses: launches through ``kernel[grid]`` that filled the cache (first call per key).
        fallbacks: launches through ``kernel[grid]`` for a call the direct path does not
            take; :attr:`reasons` says why, per kernel name.
        checks: launches compared with Triton's own choice (:data:`CHECK_LAUNCH`).

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """

    __slots__ = ("hits", "misses", "fallbacks", "checks", "reasons")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Set every counter to 0 and forget the reasons."""
        self.hits = 0
        self.misses = 0
        self.fallbacks = 0
        self.checks = 0
        self.reasons: dict[str, str] = {}

    def snapshot(self) -> dict[str, int]:
        """The counters as a dict: ``{"hits", "misses", "fallbacks", "checks"}``."""
        return {"hits": self.hits, "misses": self.misses, "fallbacks": self.fallbacks, "checks": self.checks}

    def __repr__(self) -> str:
        return f"LaunchStats({self.snapshot()})"


_STATS = LaunchStats()


def launch_stats() -> LaunchStats:
    """The process-wide :class:`LaunchStats` of direct launches (``.reset()`` to start over).

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    return _STATS


# key -> (launch function, CUfunction handle, head args, tail args, CompiledKernel), or
# _NO_DIRECT for a call pattern that always goes through kernel[grid].
_CACHE: dict[tuple, Any] = {}
_NO_DIRECT = object()
# Kernels seen, kept alive so that their id() in the keys is never reused.
_KERNELS: dict[int, Any] = {}
_get_stream = None  # triton's driver.active.get_current_stream, bound at the first fill
_KNOBS = getattr(triton, "knobs", None)
_TL_DTYPE = tl.dtype
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter


def clear_launch_cache() -> None:
    """Forget every cached compiled kernel (the next launch of each goes through ``kernel[grid]``).

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    _CACHE.clear()


def refuse_neg_arguments(kernel: Any, args: tuple) -> None:
    """Raise ValueError, naming the kernel's parameter, for the first tensor in ``args`` with the
    negative bit set (a lazy negation view, :func:`fusedlib.checks.check_dense`): a kernel
    reads its memory, which holds the negated values. The ops refuse such inputs in their
    checks and resolve such gradients (:func:`fusedlib.checks.resolve_neg_grads`); this is the
    launch layer's net for callers of the kernel layer.

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_neg():
            names = getattr(kernel, "arg_names", None) or ()
            name = names[i] if i < len(names) else f"#{i}"
            raise ValueError(
                f"{getattr(kernel, '__name__', kernel)}: argument {name} is a tensor with its negative bit set (a lazy "
                "negation view, whose memory holds the negated values the kernel would read): pass it through "
                ".resolve_neg() first"
            )


def _other_spec(a: Any) -> Any:
    """The key item of an argument that is not an int, float, bool, None or plain tensor,
    or None when the direct path does not take it."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, a.data_ptr() & 15 == 0)
    if a.__class__ is _TensorDescriptor:
        # Triton's host-side TMA descriptor: specialized on the base's dtype, the block shape
        # and the padding (shape and strides are runtime arguments; the base is 16-byte aligned,
        # which the descriptor asserts); its launcher builds the CUtensorMap on each call
        return ("tensordesc", a.base.dtype, tuple(a.block_shape), a.padding, len(a.shape))
    return None


def _int_spec(a: int) -> Any:
    # ints outside int32: Triton's i64 or u64 (u64 from 2**63), "D" when divisible by 16
    return ("int", a & 15 == 0, a >= 0x8000000000000000)


def _why_not_direct(kernel: Any, n_args: int, kwargs: dict) -> str | None:
    """None when a call with ``n_args`` positional arguments and ``kwargs`` can be launched
    directly, else why not."""
    params = getattr(kernel, "params", None)
    if params is None or not hasattr(kernel, "run"):
        return f"not a triton.jit JITFunction ({type(kernel).__name__})"
    if getattr(kernel, "pre_run_hooks", None):
        return "the kernel has pre-run hooks"
    if n_args > len(params):
        return f"{n_args} positional arguments for {len(params)} parameters"
    for p in params[:n_args]:
        if p.is_constexpr:
            return f"constexpr {p.name} passed positionally"
    by_name = {p.name: p for p in params}
    for name in kwargs:
        p = by_name.get(name)
        if p is not None and not p.is_constexpr:
            return f"runtime argument {name} passed by keyword"
    for p in params[n_args:]:
        if p.name not in kwargs and not p.has_default:
            return f"argument {p.name} missing"  # kernel[grid] raises Triton's error
    return None


def _entry(kernel: Any, compiled: Any, n_args: int, kwargs: dict) -> Any:
    """The cache entry for ``compiled``, the CompiledKernel ``kernel[grid]`` returned."""
    if compiled is not None and hasattr(compiled, "result"):
        compiled = compiled.result()  # an async compile's future
    run = getattr(compiled, "run", None)  # the CudaLauncher (after the first launch, loaded)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    if run is None or function is None or packed is None:
        return None
    # every parameter after the positional ones, in signature order: keyword constexprs and defaults
    tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[n_args:])
    c_launch = getattr(run, "launch", None)
    if (c_launch is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        # CudaLauncher.__call__ only allocates scratch (none here) and calls its C launch
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None)
        return (c_launch, function, head, tail, compiled)
    return (run, function, (packed, None, None, None), tail, compiled)


def _fallback(kernel: Any, grid: Sequence[int], args: tuple, kwargs: dict, why: str) -> None:
    _STATS.fallbacks += 1
    _STATS.reasons[getattr(kernel, "__name__", repr(kernel))] = why
    kernel[tuple(grid)](*args, **kwargs)


def _fill(kernel: Any, grid: Sequence[int], key: tuple, args: tuple, kwargs: dict) -> None:
    global _get_stream
    why = _why_not_direct(kernel, len(args), kwargs)
    compiled = kernel[tuple(grid)](*args, **kwargs)  # Triton's own path: compiles, launches
    _STATS.misses += 1
    entry = None
    if why is None:
        entry = _entry(kernel, compiled, len(args), kwargs)
        if entry is None:
            why = f"kernel[grid] returned {type(compiled).__name__}, not a loaded CompiledKernel"
    if entry is None:
        _STATS.reasons[getattr(kernel, "__name__", repr(kernel))] = why
        _CACHE[key] = _NO_DIRECT
        return
    if _get_stream is None:
        from triton.runtime import driver

        _get_stream = driver.active.get_current_stream
    _KERNELS[id(kernel)] = kernel
    _CACHE[key] = entry


def _check(kernel: Any, grid: Sequence[int], args: tuple, kwargs: dict, compiled: Any) -> None:
    ref = kernel.run(*args, grid=tuple(grid), warmup=True, **kwargs)  # Triton's choice, no launch
    if ref is not None and hasattr(ref, "result"):
        ref = ref.result()
    _STATS.checks += 1
    if ref is not compiled:
        raise RuntimeError(
            f"fusedlib direct launch of {getattr(kernel, '__name__', kernel)}: the cached compiled kernel is not "
            f"the one Triton selects for these arguments (fusedlib's cache key misses something Triton "
            f"specializes on); set FUSEDLIB_DIRECT_LAUNCH=0 to launch through kernel[grid]"
        )


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook would run: Triton 3.6's knobs hold a ``HookChain`` (a list
    of callables in ``.calls``, empty unless a profiler adds one) where older versions hold
    None or one callable. An empty chain calls nothing, so the direct path, which passes no
    hook and no launch metadata, launches exactly what Triton's would."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def launch_key(kernel: Any, device_index: int, debug: Any, instrumentation_mode: Any, args: tuple,
               kwargs: dict) -> tuple | str:
    """:func:`direct_launch`'s cache key for a call, or (a str) why the call is not taken.

    The key: ``id(kernel)``, the device, the two Triton knobs, one or two items per
    positional argument (a tensor: its dtype and whether ``data_ptr() % 16 == 0``; an int:
    ``"one"`` for 1, else ``"i32"`` or ``"i32/16"`` in int32 range, else ``("int",
    divisible by 16, >= 2**63)``; a float ``"fp32"``; a bool ``"u1"``; None), and the keyword
    arguments as their names and values (a ``tl.dtype`` value as ``("tl.dtype", name)``).
    Every item type is told apart from the others (dtypes, bools, strs, None, tuples), so the
    key names the argument types too.

    Raises:
        ValueError: for a tensor argument with the negative bit set
            (:func:`refuse_neg_arguments`).

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    key = [id(kernel), device_index, debug, instrumentation_mode]
    append = key.append
    tensor, parameter, tl_dtype = _TENSOR, _PARAMETER, _TL_DTYPE  # locals: the loop is the hot path
    for a in args:
        t = a.__class__
        if t is tensor or t is parameter:
            if a.is_neg():
                refuse_neg_arguments(kernel, args)
            append(a.dtype)
            append(a.data_ptr() & 15 == 0)
        elif t is int:
            if a == 1:
                append("one")
            elif -0x80000000 <= a <= 0x7FFFFFFF:
                append("i32" if a & 15 else "i32/16")
            else:
                append(_int_spec(a))
        elif t is float:
            append("fp32")
        elif a is None:
            append(None)
        elif t is bool:
            append("u1")
        else:
            if isinstance(a, torch.Tensor) and a.is_neg():
                refuse_neg_arguments(kernel, args)
            s = _other_spec(a)
            if s is None:
                return f"an argument of type {t.__name__}"
            append(s)
    for name, v in kwargs.items():
        append(name)
        # a tl.dtype (the kernels' ACC) hashes in Python, slowly: key it by its name
        append(v if v.__class__ is not tl_dtype else ("tl.dtype", v.name))
    return tuple(key)


def direct_launch(kernel: Any, grid: Sequence[int], device_index: int, args: tuple, kwargs: dict) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on CUDA device ``device_index`` (the current
    device) on the current stream, through the cached compiled kernel when there is one.

    The first call for a key (below) goes through ``kernel[grid](*args, **kwargs)``, which
    compiles when needed and launches, and caches the CompiledKernel it returns; later calls
    with the same key call that kernel's launcher directly (see the comment above this
    function in the source for the protocol, read in Triton 3.6). The key: the kernel, the
    device, ``knobs.runtime.debug`` and ``knobs.compilation.instrumentation_mode``, for each
    positional argument its type and what Triton specializes on (a tensor's dtype and
    whether ``data_ptr()`` is a multiple of 16; an int's equality to 1, int32 range and
    divisibility by 16), and every keyword argument with its value (constexprs, ``num_warps``,
    ``num_stages``). Calls the direct path does not take (launch hooks set, arguments of
    other types, constexprs passed positionally...) go through ``kernel[grid]`` and are
    counted as fallbacks (:func:`launch_stats`).

    Args:
        kernel: a ``@triton.jit`` function (``JITFunction``).
        grid: 1 to 3 program counts (a tuple or list of ints).
        device_index: the CUDA device the tensors are on; must be the current device.
        args: the kernel's runtime arguments, positional, in signature order.
        kwargs: constexprs by keyword, and launch options (``num_warps``, ``num_stages``).

    Raises:
        RuntimeError: with :data:`CHECK_LAUNCH`, when Triton would launch another compiled
            kernel than the cached one (a defect of the key: report it).
        Whatever ``kernel[grid]`` raises on a first call (compile errors, bad arguments).

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    rt = _KNOBS.runtime
    if _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook):
        return _fallback(kernel, grid, args, kwargs, "a Triton launch hook is set")
    key = launch_key(kernel, device_index, rt.debug, _KNOBS.compilation.instrumentation_mode, args, kwargs)
    if key.__class__ is str:
        return _fallback(kernel, grid, args, kwargs, key)
    try:
        entry = _CACHE.get(key)
    except TypeError:  # an unhashable keyword value
        return _fallback(kernel, grid, args, kwargs, "an unhashable keyword argument")
    if entry is None:
        return _fill(kernel, grid, key, args, kwargs)
    if entry is _NO_DIRECT:
        _STATS.fallbacks += 1
        kernel[tuple(grid)](*args, **kwargs)
        return
    fn, function, head, tail, compiled = entry
    if CHECK_LAUNCH:
        _check(kernel, grid, args, kwargs, compiled)
    n = len(grid)
    fn(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device_index), function,
       *head, *args, *tail)
    _STATS.hits += 1


def bind_launch(kernel: Any, grid: Sequence[int], device_index: int, args: tuple, kwargs: dict) -> tuple | None:
    """What :func:`direct_launch` would launch for these arguments, looked up once: ``(c_launch,
    grid_x, grid_y, grid_z, function, head, tail, key)``, so that
    ``c_launch(grid_x, grid_y, grid_z, stream, function, *head, *args, *tail)`` launches
    ``kernel`` (Triton's C launcher and nothing else), for these ``args`` or any others that
    Triton specializes the same way (``key``, :func:`launch_key`'s, says how). None where no
    direct launch is cached for the call (launch it through :func:`direct_launch` first), or
    possible (another Triton version, the interpreter, a pattern the direct path does not take).

    Args:
        kernel, grid, device_index, args, kwargs: as :func:`direct_launch`.

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    if not DIRECT_LAUNCH or _KNOBS is None:
        return None
    rt = _KNOBS.runtime
    key = launch_key(kernel, device_index, rt.debug, _KNOBS.compilation.instrumentation_mode, args, kwargs)
    if key.__class__ is str:
        return None
    try:
        entry = _CACHE.get(key)
    except TypeError:  # an unhashable keyword value
        return None
    if entry is None or entry is _NO_DIRECT:
        return None
    fn, function, head, tail, _ = entry
    n = len(grid)
    return (fn, grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, function, head, tail, key)


def bound_launch(kernel: Any, grid: Sequence[int], device_index: int, args: tuple, kwargs: dict):
    """The launch :func:`direct_launch` makes for these arguments, with everything but the call
    of Triton's C launcher done once: a zero-argument callable that launches ``kernel`` on the
    stream that is current now, or None where no direct launch exists for the call (another
    Triton version, the interpreter, a pattern the direct path does not take).

    Calling it costs the host what launching a Triton kernel from Python costs at the least
    (no key, no lookup, no stream query): the benchmark's floor measures it
    (:func:`fusedlib.bench.host.measure_floor`). It is not an op's launch path: it skips the
    checks of :func:`direct_launch` (launch hooks, the knobs), and launches with the arguments
    it was bound to, tensors included, whatever happens to them later
    (:class:`fusedlib.runtime.LaunchPlan` is the ops' path with the same C launcher).

    Args:
        kernel, grid, device_index, args, kwargs: as :func:`direct_launch` (the first call
            goes through it, compiling where needed and filling the cache).

    Returns:
        The callable, or None.

    Source: fusedlib (Triton's launch protocol, ``JITFunction.run``, as read in Triton 3.6).
    """
    if not DIRECT_LAUNCH or _KNOBS is None:
        return None
    direct_launch(kernel, grid, device_index, args, kwargs)
    bound = bind_launch(kernel, grid, device_index, args, kwargs)
    if bound is None:
        return None
    fn, g0, g1, g2, function, head, tail, _ = bound
    call_args = (g0, g1, g2, _get_stream(device_index), function, *head, *args, *tail)
    return lambda: fn(*call_args)
