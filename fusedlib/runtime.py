"""Where fusedlib's Triton kernels run: compiled on a CUDA GPU, interpreted on the CPU.

fusedlib has one code path for every device. A kernel is launched through
:func:`launch`, which looks at the device of the tensors it is given:

* CUDA tensors: the ``@triton.jit`` kernel is compiled for the GPU and launched.
* CPU tensors: the *same* kernel runs in Triton's interpreter, which executes the
  kernel body with NumPy, one program instance at a time. It is slow, and meant for
  small inputs: the book's checks and CI, which have no GPU.

Triton's interpreter is all-or-nothing per process: ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is defined, and Triton's own library functions
(``tl.sigmoid``, ``tl.sum``...) are defined either compiled or interpreted. So on a
machine with a GPU, fusedlib's kernels take CUDA tensors, and CPU tensors raise a
clear error (set ``TRITON_INTERPRET=1`` before importing fusedlib to interpret
everything there); on a machine without one, they take CPU tensors.

On a machine without CUDA this module sets ``TRITON_INTERPRET=1`` before any
``@triton.jit`` decorator in fusedlib runs (``fusedlib/__init__.py`` imports it
first), which is how Triton's own tutorials run on a CPU. It says so once, on the
``fusedlib`` logger, not on stderr.

Triton's interpreter (3.6 and 3.9) truncates float32 -> bfloat16 where the GPU rounds to
nearest even (and mishandles float64 -> bfloat16 and bfloat16 subnormals); when kernels are
interpreted, this module patches its conversions so that every kernel's bfloat16 results are
correctly rounded on the CPU too (:data:`BF16_ROUNDING` says whether it could).

Device-side input checks (:class:`DeviceCheck`, :func:`check_errors`). Some bad input can
only be seen in the data: a cross-entropy target id outside the vocabulary, a gamma of
exactly 0 where the memory-efficient norm must divide by it. Reading a flag back to the host
in the forward would synchronise the host with the GPU on every call, which also breaks
``torch.compile(fullgraph=True)`` (a data-dependent branch) and CUDA-graph capture. Instead
the kernel that meets the bad value makes the outputs it affects NaN (never a wrong finite
number) and writes the value into a word of pinned host memory that it can address directly
(zero-copy: no extra launch, no copy, no event). The host then learns of it without waiting:

* eager mode on CUDA: every later fusedlib kernel launch reads the words (a few loads from
  host memory, no call into CUDA) and raises a ValueError naming the op, the argument
  and what was expected, as soon as one is set; :func:`check_errors` waits for the GPU and
  raises, for a definite answer at a point the caller chooses (e.g. once per training step,
  the same point on every rank);
* CPU tensors (Triton's interpreter) and ``FUSEDLIB_SYNC_CHECKS=1`` (a debug mode: one
  stream synchronisation per checked call): the op raises at once, before it returns;
* while ``torch.compile`` traces, the check is not compiled in: NaN in the affected outputs
  is the signal. A CUDA graph captured in eager mode keeps the check (its replays write the
  same word), reported at the next fusedlib call or by :func:`check_errors`.

Source: Triton's interpreter, ``triton/runtime/interpreter.py``; zero-copy host memory:
the CUDA C++ Programming Guide, "Mapped Memory" (every page-locked allocation is
device-addressable under unified virtual addressing); Triton accepts such pointers since
triton-lang/triton#1197.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch.autograd import forward_ad as _forward_ad

__all__ = [
    "CUDA_AVAILABLE",
    "INTERPRET_ON_CPU",
    "default_device",
    "device_banner",
    "launch",
    "LaunchPlan",
    "Planned",
    "planned",
    "launch_planned",
    "spec_key",
    "tensor_key",
    "plan_cache",
    "remember_plan",
    "find_plan",
    "clear_plans",
    "PLAN_CACHE_SIZE",
    "kernel_mode",
    "SYNC_CHECKS",
    "DeviceCheck",
    "check_errors",
    "reset_generators_after_failed_capture",
    "restore_after_failed_capture",
    "end_pool_of_failed_capture",
    "collector_paused_for_capture",
    "optional_function_ok",
]

logger = logging.getLogger("fusedlib")

#: True when PyTorch sees a CUDA GPU.
CUDA_AVAILABLE: bool = torch.cuda.is_available()

#: True when Triton was set (by us or the user) to interpret every kernel.
INTERPRET_ON_CPU: bool
#: Set when fusedlib had to switch Triton to its interpreter *after* Triton was imported
#: (``import triton``, or ``torch.compile``, ran before ``import fusedlib`` on a machine
#: without CUDA): Triton's own library functions (``tl.sigmoid``, ``tl.sum``...) were then
#: already defined for the compiler, and kernels that call them cannot run. :func:`launch`
#: raises a clear error instead of Triton's "Cannot call @triton.jit'd outside of the scope
#: of a kernel".
LATE_INTERPRET: bool = False
if not CUDA_AVAILABLE and os.environ.get("TRITON_INTERPRET") is None:
    LATE_INTERPRET = "triton" in sys.modules
    # Must happen before `import triton` decorates any kernel: triton.jit reads it then.
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info(
        "fusedlib: no CUDA GPU found; Triton kernels run in Triton's interpreter on the CPU "
        "(correct but slow: use small inputs)."
    )


import triton  # noqa: E402  (after TRITON_INTERPRET is settled)

from .kernels import launch as _launch_layer  # noqa: E402  (direct launches; imports no fusedlib module)

#: ``FUSEDLIB_SYNC_CHECKS=1`` (read at import by :func:`fusedlib.kernels.launch.env_flag`, which
#: refuses a value it cannot read; tests may set the attribute): debug mode. Ops with a
#: device-side check (:class:`DeviceCheck`) wait for their kernel and raise at once on CUDA
#: too, as on the CPU: one stream synchronisation per checked call.
SYNC_CHECKS: bool = _launch_layer.env_flag("FUSEDLIB_SYNC_CHECKS", False)

#: Whether Triton interprets the kernels: ``TRITON_INTERPRET`` true as Triton reads it ("1",
#: "true", "yes", "on", "y"; see :data:`fusedlib.kernels.launch.TRITON_TRUE_VALUES`).
INTERPRET_ON_CPU: bool = _launch_layer.TRITON_INTERPRET


def _fix_interpreter_index() -> None:
    """Make Triton 3.6's interpreter accept a runtime int as a loop bound under NumPy 2.x.

    The interpreter passes an int argument (``n_cols``) as a 1-element 1-D array, and Triton
    <= 3.6 turns it back into an int with ``int(array)``, which NumPy 2.x refuses ("only
    0-dimensional arrays can be converted to Python scalars"): every ``range(0, n_cols,
    BLOCK_N)`` in a kernel failed. Triton 3.9 uses ``int(array.squeeze())``; this wraps the
    interpreter's tensor patching to do the same (a no-op where Triton already does).
    Compiled kernels are not affected.
    """
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover (no interpreter in this Triton)
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fusedlib_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fusedlib_index_fix = True
    _interp._patch_lang_tensor = _patch_lang_tensor


# ---------------------------------------------------------------------------------------------
# bfloat16 rounding in Triton's interpreter
# ---------------------------------------------------------------------------------------------
#
# Triton's interpreter keeps bfloat16 values as their uint16 bit patterns and converts them in
# ``InterpreterBuilder.cast_impl`` (which ``create_fp_trunc``, ``create_fp_ext`` and the int <->
# float casts call) and ``create_fp_to_fp``. In Triton 3.6 and 3.9 (``triton/runtime/
# interpreter.py``) these are wrong for bfloat16, where the compiled kernels are right:
#
# * float32 -> bfloat16 (``x.to(tl.bfloat16)``, and ``tl.store`` of a float32 value through a
#   bfloat16 pointer, which casts the same way) calls ``_convert_float(..., rounding_mode=None)``,
#   which *truncates* the mantissa: results are up to one ulp low in magnitude (about half of
#   them one ulp off), values past the largest finite bfloat16 give the largest finite one
#   instead of inf, and float32 subnormals come out wrong. Its RTNE branch (used for explicit
#   rounding modes) rounds half up, with no carry into the exponent.
# * float64 -> bfloat16 falls into ``src.data.astype(np.uint16)``: the *value* is converted to
#   an integer and stored as bits, which is garbage (``.to(tl.bfloat16, fp_downcast_rounding=
#   "rtz")`` from float64 raises). int -> bfloat16 and bfloat16 -> int likewise.
# * float16 -> bfloat16 goes through float32 and is truncated as above.
# * bfloat16 -> float32 flushes bfloat16 subnormals to zero (it should be exact).
#
# (Source: ``triton/runtime/interpreter.py`` of Triton 3.6.0 and 3.9.0, ``InterpreterBuilder``
# and ``_convert_float``.) The compiled kernels (PTX ``cvt.rn.bf16.f32``) round to nearest
# even. The wrappers below replace every conversion that produces or consumes bfloat16 bits
# with exact NumPy bit arithmetic and leave every other conversion to Triton. bfloat16
# *arithmetic* in the interpreter (``x + y`` on two bfloat16 tensors) still operates on the
# bit patterns as integers in Triton 3.6 and 3.9; fusedlib's kernels never do it (they load,
# convert to float32 or float64, compute, and convert once when storing).
# tests/test_bf16_rounding.py checks all of it, on the CPU and on the GPU.


def _f32_to_bf16_bits(x32: "np.ndarray", rtz: bool = False) -> "np.ndarray":
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even (or toward zero).

    bfloat16 is the upper half of float32 (same sign and exponent fields, 7 of the 23 mantissa
    bits), so rounding is integer arithmetic on the bits u: add 0x7FFF plus the lowest kept bit
    (ties go to the even neighbour), then drop the low 16 bits. A carry out of the mantissa
    increments the exponent, which is the correctly rounded result, also for subnormals and for
    values that round past the largest finite bfloat16 (they become inf, as IEEE 754 requires).
    NaN stays NaN (sign kept, quiet bit set). Toward zero: just drop the low bits.
    """
    u = np.asarray(x32, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if rtz:
        r = u >> np.uint32(16)
    else:
        finite_or_inf = np.where(nan, np.uint32(0), u)  # keep NaNs away from the add (it could wrap)
        r = (finite_or_inf + (np.uint32(0x7FFF) + ((finite_or_inf >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    r = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), r)
    return r.astype(np.uint16)


def _f64_to_f32(x64: "np.ndarray", round_to_odd: bool) -> "np.ndarray":
    """float64 -> float32 rounded toward zero, or to odd (toward zero, then the last bit set if inexact).

    Rounding to odd first and then to nearest even at bfloat16 is the correctly rounded
    float64 -> bfloat16 conversion (one rounding), because float32 keeps at least two more
    bits than bfloat16 (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
    proved algorithms using rounding to odd", IEEE Trans. Computers 57(4), 2008); rounding
    to nearest twice could round a value just above a tie the wrong way. Overflow gives the
    largest finite float32, which then rounds to inf at bfloat16.
    """
    x64 = np.asarray(x64, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x64.astype(np.float32)  # to nearest even
    back = f.astype(np.float64)
    inexact = np.isfinite(x64) & (back != x64)
    f = np.where(inexact & (np.abs(back) > np.abs(x64)), np.nextafter(f, np.float32(0)), f).astype(np.float32)
    if round_to_odd:
        f = np.where(inexact, f.view(np.uint32) | np.uint32(1), f.view(np.uint32)).astype(np.uint32).view(np.float32)
    return f


def _bf16_bits_to_f32(bits: "np.ndarray") -> "np.ndarray":
    """bfloat16 bit patterns (uint16) -> float32, exactly (subnormals, inf and NaN included)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _to_bf16_bits(data: "np.ndarray", rtz: bool) -> "np.ndarray | None":
    """float16/32/64, int or bool values -> bfloat16 bits, with one rounding; None for other data."""
    data = np.asarray(data)
    if data.dtype == np.float32:
        x32 = data
    elif data.dtype == np.float16:
        x32 = data.astype(np.float32)  # exact
    elif data.dtype == np.float64 or data.dtype.kind in "iub":
        # ints: exact in float64 up to 2^53 in magnitude (beyond that, rounded twice)
        x32 = _f64_to_f32(data.astype(np.float64), round_to_odd=not rtz)
    else:
        return None
    return _f32_to_bf16_bits(x32, rtz=rtz).reshape(data.shape)


#: Whether Triton's interpreter rounds bfloat16 correctly in this process: ``"patched"`` (fusedlib
#: fixed its conversions, below), ``"compiled"`` (kernels are compiled; the GPU rounds correctly),
#: or ``"unavailable: <why>"`` (this Triton lacks the hooks; bfloat16 results may be truncated).
BF16_ROUNDING: str = "compiled"


def _fix_interpreter_bf16() -> str:
    """Make Triton's interpreter convert to and from bfloat16 like the GPU: correctly rounded.

    Wraps ``InterpreterBuilder.cast_impl``, ``create_fp_trunc``, ``create_fp_ext``, the int <->
    float casts and ``create_fp_to_fp`` (Triton 3.6 and 3.9, ``triton/runtime/interpreter.py``;
    see the comment above for what each got wrong). A conversion to bfloat16 from float16,
    float32, float64 or an integer rounds once, to nearest even (toward zero where the kernel
    asks ``fp_downcast_rounding="rtz"``); a conversion from bfloat16 first widens the bits to
    float32 exactly and hands that to Triton's own code. Everything else is Triton's. Applying it
    twice changes nothing; compiled kernels are not affected.

    Returns:
        The new value of :data:`BF16_ROUNDING`: ``"patched"``, or ``"unavailable: <why>"`` (also
        logged as a warning on the ``fusedlib`` logger) when this Triton has no such hooks.
    """
    try:
        from triton.runtime import interpreter as _interp
        import triton.language as tl
    except ImportError as e:  # pragma: no cover (no interpreter in this Triton)
        return _bf16_unavailable(f"cannot import triton.runtime.interpreter ({e})")
    builder_cls = getattr(_interp, "InterpreterBuilder", None)
    handle_cls = getattr(_interp, "TensorHandle", None)
    if builder_cls is None or handle_cls is None or not callable(getattr(builder_cls, "cast_impl", None)) \
            or not callable(getattr(builder_cls, "create_fp_to_fp", None)):
        return _bf16_unavailable("its interpreter has no InterpreterBuilder.cast_impl / create_fp_to_fp")
    if getattr(builder_cls.cast_impl, "_fusedlib_bf16_fix", False):
        return "patched"
    rounding_modes = getattr(getattr(_interp, "_ir", None), "ROUNDING_MODE", None)
    rtne_mode = getattr(rounding_modes, "RTNE", None)
    rtz_mode = getattr(rounding_modes, "RTZ", None)
    bf16 = tl.bfloat16

    def convert(src, dst_type, rounding_mode=None):
        """The bfloat16 conversion of ``src`` to ``dst_type``, or None to leave it to Triton."""
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if (src_ty == bf16) == (dst_ty == bf16):
            return None  # no bfloat16 involved (or bfloat16 to itself): Triton's
        if src_ty == bf16:
            if np.asarray(src.data).dtype != np.uint16:
                return None
            x32 = _bf16_bits_to_f32(src.data)
            if dst_ty == tl.float32:
                return handle_cls(x32, dst_ty)
            if dst_ty == tl.float64 or (dst_ty == tl.float16 and rounding_mode in (None, rtne_mode)):
                return handle_cls(x32.astype(np.float64 if dst_ty == tl.float64 else np.float16), dst_ty)
            return ("widened", handle_cls(x32, tl.float32))  # ints, fp8, other rounding: Triton's, from float32
        if rounding_mode is not None and rounding_mode not in (rtne_mode, rtz_mode):
            return None
        if not (src_ty.is_floating() or src_ty.is_int()) or getattr(src_ty, "is_fp8", lambda: False)():
            return None  # fp8 and anything else: Triton's
        bits = _to_bf16_bits(src.data, rtz=rounding_mode is not None and rounding_mode == rtz_mode)
        return None if bits is None else handle_cls(bits, dst_ty)

    def wrap(name, takes_rounding):
        orig = getattr(builder_cls, name)

        def wrapped(self, src, dst_type, *args):
            out = convert(src, dst_type, args[0] if takes_rounding and args else None)
            if out is None:
                return orig(self, src, dst_type, *args)
            if isinstance(out, tuple):  # from bfloat16: Triton's own conversion of the exact float32
                return orig(self, out[1], dst_type, *args)
            return out

        wrapped.__name__ = wrapped.__qualname__ = name
        wrapped.__doc__ = f"Triton's ``{name}``, with bfloat16 conversions rounded correctly (fusedlib.runtime)."
        wrapped._fusedlib_bf16_fix = True
        wrapped._fusedlib_orig = orig
        setattr(builder_cls, name, wrapped)

    for name in ("create_fp_trunc", "create_fp_ext", "create_si_to_fp", "create_ui_to_fp", "create_fp_to_si",
                 "create_fp_to_ui"):
        if callable(getattr(builder_cls, name, None)):
            wrap(name, takes_rounding=False)
    wrap("create_fp_to_fp", takes_rounding=True)
    wrap("cast_impl", takes_rounding=False)  # last: its marker says the whole patch is in place
    return "patched"


def _bf16_unavailable(why: str) -> str:
    msg = (f"fusedlib: cannot fix bfloat16 rounding in Triton {triton.__version__}'s interpreter: {why}; "
           "bfloat16 results of kernels run on the CPU may be truncated instead of rounded")
    logger.warning(msg)
    return f"unavailable: {why}"


if INTERPRET_ON_CPU:
    _fix_interpreter_index()
    BF16_ROUNDING = _fix_interpreter_bf16()


def default_device() -> torch.device:
    """The device the book runs on: ``cuda`` when a GPU is present, else ``cpu``.

    Returns:
        ``torch.device("cuda")`` or ``torch.device("cpu")``.

    Source: fusedlib's own.
    """
    return torch.device("cuda" if CUDA_AVAILABLE else "cpu")


def kernel_mode(device: torch.device | str) -> str:
    """How a fusedlib kernel runs for tensors on ``device`` in this process.

    Args:
        device: a torch device or its name.

    Returns:
        ``"interpreted"`` when ``TRITON_INTERPRET=1`` (Triton's interpreter runs the
        kernel with NumPy), else ``"compiled"`` (Triton compiles it for the GPU).

    Raises:
        ValueError: for a device type fusedlib's kernels cannot run on (mps, xpu, ...).

    Source: fusedlib's own; Triton's interpreter (``TRITON_INTERPRET``,
    ``triton/runtime/interpreter.py``).
    """
    dev = torch.device(device)
    if dev.type in ("cuda", "cpu"):
        return "interpreted" if INTERPRET_ON_CPU else "compiled"
    raise ValueError(f"fusedlib kernels run on 'cuda' or 'cpu' tensors, got device {dev}")


_KERNEL_DEVICE_TYPES = ("cuda", "cpu")


def launch(kernel: Any, grid: Sequence[int], tensors_device: torch.device, *args: Any, **kwargs: Any) -> None:
    """Launch a ``@triton.jit`` kernel for tensors on ``tensors_device``.

    Args:
        kernel: the ``@triton.jit`` function.
        grid: the launch grid, a tuple of 1 to 3 ints (program counts).
        tensors_device: the device of the kernel's tensor arguments (all on one device;
            callers check that with :func:`fusedlib.checks.check_same_device`).
        *args, **kwargs: the kernel's arguments, constexprs and ``num_warps`` included.

    Raises:
        ValueError: for a device that is neither CUDA nor CPU, or for CPU tensors in a
            process whose kernels are compiled for CUDA (see the module docstring).
        RuntimeError: on a machine without CUDA where Triton was imported before fusedlib
            (see :data:`LATE_INTERPRET`).

    On CUDA the kernel is compiled (once per signature, then cached by Triton) and, outside
    a ``torch.compile`` trace, launched through
    :func:`fusedlib.kernels.launch.direct_launch` (the cached compiled kernel, without
    Triton's per-call Python) where :data:`fusedlib.kernels.launch.DIRECT_LAUNCH` allows,
    else through ``kernel[grid]``; inside a trace always ``kernel[grid]``, so that Dynamo
    sees the Triton kernel. In a process with ``TRITON_INTERPRET=1`` it runs in Triton's
    interpreter. Tensors on a GPU are copied to the host and back by the interpreter.

    Once a device-side check has been launched lazily (:class:`DeviceCheck`), every launch
    first reads the check words and raises the ValueError of any that is set.

    Source: fusedlib's own; Triton's interpreter (``triton/runtime/interpreter.py``) on the CPU.
    """
    if _ARMED and not torch.compiler.is_compiling():
        _poll()  # a device-side check of an earlier call found bad input: raise it now
    if tensors_device.type not in _KERNEL_DEVICE_TYPES:
        kernel_mode(tensors_device)  # raises for devices other than cuda / cpu
    if LATE_INTERPRET:
        raise RuntimeError(
            "Triton was imported before fusedlib on this machine without a CUDA GPU, so its library "
            "functions were built for the compiler and fusedlib's kernels cannot run in Triton's "
            "interpreter. Import fusedlib first (before triton and before any torch.compile call), "
            "or set TRITON_INTERPRET=1 in the environment before starting Python."
        )
    if INTERPRET_ON_CPU:
        _launch_layer.refuse_neg_arguments(kernel, args)
        kernel[tuple(grid)](*args, **kwargs)
        return
    if tensors_device.type != "cuda":
        if not CUDA_AVAILABLE:  # (TRITON_INTERPRET=0 set on a machine without a GPU)
            raise ValueError(
                f"got tensors on {tensors_device}, but fusedlib's Triton kernels in this process are compiled "
                "for CUDA (TRITON_INTERPRET is set to a false value) and this machine has no CUDA device: "
                "unset TRITON_INTERPRET, or set TRITON_INTERPRET=1, before starting Python, to run every kernel in "
                "Triton's (slow) CPU interpreter"
            )
        raise ValueError(
            f"got tensors on {tensors_device}, but fusedlib's Triton kernels in this process are compiled "
            "for CUDA: move the tensors to a CUDA device, or set TRITON_INTERPRET=1 before importing "
            "fusedlib to run every kernel in Triton's (slow) CPU interpreter"
        )
    index = tensors_device.index
    if not torch.compiler.is_compiling():
        current = _cuda_get_device()  # torch.cuda.current_device() without its lazy-init call
        if index is None or index == current:
            if _launch_layer.DIRECT_LAUNCH:
                # the cached compiled kernel, without Triton's per-call Python (kernels/launch.py;
                # its key refuses a tensor with the negative bit)
                _launch_layer.direct_launch(kernel, grid, current, args, kwargs)
            else:
                _launch_layer.refuse_neg_arguments(kernel, args)
                kernel[tuple(grid)](*args, **kwargs)
            return
    elif index is None or index == torch.cuda.current_device():
        kernel[tuple(grid)](*args, **kwargs)  # inside a compile: Dynamo must see the Triton kernel
        return
    _launch_layer.refuse_neg_arguments(kernel, args)
    with torch.cuda.device(tensors_device):  # Triton launches on the current device
        kernel[tuple(grid)](*args, **kwargs)


_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


#: Plans an op keeps per cache (:func:`plan_cache`, one plan per input signature,
#: :func:`remember_plan`): past this
#: many, the cache starts over (a model has a handful of signatures per op; a sweep of
#: shapes has more, and each plan is a few hundred bytes).
PLAN_CACHE_SIZE: int = 1024


_PLAN_CACHES: list[dict] = []


def plan_cache() -> dict:
    """A new, empty cache of an op's plans (key: the op's input signature), known to
    :func:`clear_plans`.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    cache: dict = {}
    _PLAN_CACHES.append(cache)
    return cache


def clear_plans() -> None:
    """Forget every op's plans: the next call of each op makes its plan again from the launch
    settings as they are then (needed after changing a launch setting at run time: a module's
    tile table, ``FOLD_TILES``, FlashAttention's ``INTERPRETER_TILE``, ``LOADS_BY_TMA``,
    ``TMA_LOADS``, ``DQ_BY_TMA``, ``DELTA_IN_DQ_MAX_HEAD_DIM``, ``DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM`` or
    ``program_order``; a plan keeps the settings it was made with). Each setting is read from the module that uses it: ``FOLD_TILES`` is imported by
    each kernel module (``fusedlib.kernels.layer_norm.FOLD_TILES``...), so set it there;
    ``fusedlib.kernels.launch.FOLD_TILES`` is only their default.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    for cache in _PLAN_CACHES:
        cache.clear()


def find_plan(cache: dict, key_of: Callable[..., Optional[tuple]], *args: Any) -> tuple[Optional[tuple], Any]:
    """``(key, plan)``: the plan key ``key_of(*args)`` of an op's call and the plan ``cache``
    remembers under it (None when it has none). Both None while ``torch.compile`` traces (no
    plans there: Dynamo refuses reads of a global cache, fake tensors have no data pointer),
    where ``key_of`` returns None (arguments it will not key, e.g. a scalar that is not a plain
    float), and where the key cannot be built or hashed (arguments that are not tensors, a
    tensor without strides, an unhashable scalar): the op's argument check then says what is
    wrong. An op whose check reads nothing its key does not hold runs the check only when this
    finds no plan, and remembers a plan (:func:`remember_plan`) only after the check passed.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    if torch.compiler.is_compiling():
        return None, None
    try:
        key = key_of(*args)
        return key, (cache.get(key) if key is not None else None)
    except (AttributeError, RuntimeError, TypeError):
        return None, None


def remember_plan(cache: dict, key: Optional[tuple], plan: Any) -> Any:
    """``cache[key] = plan``, emptying ``cache`` first when it holds :data:`PLAN_CACHE_SIZE`
    plans; nothing for a key of None (ops key nothing inside a ``torch.compile`` trace: Dynamo
    refuses writes to a global there, fake tensors have no data pointer, and a compiled graph
    needs no plan). Returns ``plan``.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    if key is not None and not torch.compiler.is_compiling():
        if len(cache) >= PLAN_CACHE_SIZE:
            cache.clear()
        cache[key] = plan
    return plan


class Planned(NamedTuple):
    """One launch of an op as its plan holds it (:func:`planned`): the grid, the keyword
    arguments, the :class:`LaunchPlan` (None while ``torch.compile`` traces), and whatever
    else the op derives from the same signature (``data``: rows per program, ...).

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """

    grid: tuple
    kwargs: dict
    launch: Optional["LaunchPlan"]
    data: tuple = ()


def planned(kernel: Any, grid: Sequence[int], device: torch.device, kwargs: dict, data: tuple = ()) -> Planned:
    """A :class:`Planned` launch of ``kernel`` (its :class:`LaunchPlan` only outside a
    ``torch.compile`` trace); :func:`launch_planned` launches it.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    plan = None if torch.compiler.is_compiling() else LaunchPlan(kernel, grid, device, kwargs)
    return Planned(tuple(grid), kwargs, plan, data)


def launch_planned(kernel: Any, p: Planned, device: torch.device, *args: Any) -> None:
    """Launch ``kernel`` as ``p`` says, with positional ``args``: through its
    :class:`LaunchPlan`, or :func:`launch` (inside a ``torch.compile`` trace).

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    if p.launch is not None:
        p.launch(*args)
    else:
        launch(kernel, p.grid, device, *args, **p.kwargs)


def spec_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """A tensor argument's part of a plan key when its shape and strides are known from
    others': dtype and address modulo 16 (what Triton specializes a pointer on), and the
    class (the launch layer's key tells a tensor subclass from a tensor) and the negative bit
    (:func:`fusedlib.checks.check_dense`: such a tensor has no plan); None for None.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    return None if t is None else (t.__class__, t.dtype, t.data_ptr() & 15, t.is_neg())


def param_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """A tensor argument's part of a plan key that also stands for an argument check:
    class, shape, strides, dtype, device, address modulo 16 and the negative bit; None for None."""
    return None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15,
                                   t.is_neg())


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor argument's part of a plan key: class, shape, strides, dtype, address modulo 16,
    the negative bit.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """
    return (t.__class__, t.shape, t.stride(), t.dtype, t.data_ptr() & 15, t.is_neg())


class LaunchPlan:
    """One kernel launch with its kernel, grid, device and keyword arguments fixed: the part of
    a launch that a fused op derives from its inputs' signature (shapes, strides, dtypes,
    addresses modulo 16, switches), made once per signature, so that a call pays only for
    its positional arguments.

    ``plan(*args)`` launches as ``launch(kernel, grid, device, *args, **kwargs)`` does. On
    CUDA with direct launches (:data:`fusedlib.kernels.launch.DIRECT_LAUNCH`), the first call
    goes through :func:`launch` and then binds the compiled kernel it launched
    (:func:`fusedlib.kernels.launch.bind_launch`); every later call hands its arguments to
    Triton's C launcher with the bound kernel, grid and keywords: no key over the arguments,
    no cache lookup (about 8 us of host time per launch on the H200 machine, where the
    whole launch through the launch layer's key cost 13.7 us and the C launcher 5.7).

    The caller's part: every call of one plan passes positional arguments that Triton
    specializes as the first call's were (each tensor's dtype and whether its address is a
    multiple of 16; each int's equality to 1, divisibility by 16 and int32 range; the
    argument types), so the caller keys its plans by everything that decides those (an op:
    its inputs' shapes, strides, dtypes and ``data_ptr() % 16``; outputs it allocates are
    aligned alike for one signature). ``FUSEDLIB_CHECK_LAUNCH=1`` (or
    :data:`fusedlib.kernels.launch.CHECK_LAUNCH`) checks that contract on every call: a call
    whose arguments Triton would specialize otherwise raises RuntimeError.

    Like :func:`launch`, a call first raises the error a device-side check of an earlier call
    stored (:class:`DeviceCheck`). Every call goes through :func:`launch` instead (and so
    checks as it does) while direct launches are off, the check mode is on, a Triton
    launch hook is set, Triton's debug or instrumentation knobs differ from the bound ones,
    another CUDA device is current, or ``torch.compile`` traces (ops call :func:`launch`
    directly there: Dynamo must see the Triton kernel); on the CPU (Triton's interpreter)
    always.

    Args:
        kernel: the ``@triton.jit`` function.
        grid: 1 to 3 program counts.
        device: the device of the kernel's tensor arguments.
        kwargs: constexprs by keyword and launch options (``num_warps``...), as :func:`launch`'s.

    Source: fusedlib (Triton's launch protocol as :mod:`fusedlib.kernels.launch` reads it).
    """

    __slots__ = ("kernel", "grid", "device", "kwargs", "_bound")

    def __init__(self, kernel: Any, grid: Sequence[int], device: torch.device, kwargs: dict) -> None:
        self.kernel = kernel
        self.grid = tuple(grid)
        self.device = device
        self.kwargs = kwargs
        # (c_launch, gx, gy, gz, function, head, tail, key, device index, debug, instrumentation mode)
        self._bound: tuple | None = None

    def __call__(self, *args: Any) -> None:
        b = self._bound
        if b is not None:
            layer = _launch_layer
            if layer.DIRECT_LAUNCH and not layer.CHECK_LAUNCH:
                knobs = layer._KNOBS
                rt = knobs.runtime
                if (rt.debug == b[9] and knobs.compilation.instrumentation_mode == b[10]
                        and not layer._hook_set(rt.launch_enter_hook) and not layer._hook_set(rt.launch_exit_hook)
                        and _cuda_get_device() == b[8] and not torch.compiler.is_compiling()):
                    if _ARMED:
                        _poll()  # as launch(): a device-side check of an earlier call found bad input
                    b[0](b[1], b[2], b[3], layer._get_stream(b[8]), b[4], *b[5], *args, *b[6])
                    layer._STATS.hits += 1
                    return
        launch(self.kernel, self.grid, self.device, *args, **self.kwargs)
        if b is None:
            self._bind(args)
        elif _launch_layer.CHECK_LAUNCH:
            self._check(args, b)

    def _bind(self, args: tuple) -> None:
        layer = _launch_layer
        if (INTERPRET_ON_CPU or self.device.type != "cuda" or not layer.DIRECT_LAUNCH or layer._KNOBS is None
                or torch.compiler.is_compiling()):
            return
        index = self.device.index if self.device.index is not None else _cuda_get_device()
        if index != _cuda_get_device():
            return  # launched through kernel[grid] on another device: nothing cached to bind
        bound = layer.bind_launch(self.kernel, self.grid, index, args, self.kwargs)
        if bound is not None:
            knobs = layer._KNOBS
            self._bound = (*bound, index, knobs.runtime.debug, knobs.compilation.instrumentation_mode)

    def _check(self, args: tuple, b: tuple) -> None:
        key = _launch_layer.launch_key(self.kernel, b[8], b[9], b[10], args, self.kwargs)  # as bound: the args decide
        if key != b[7]:
            raise RuntimeError(
                f"fusedlib LaunchPlan of {getattr(self.kernel, '__name__', self.kernel)}: called with arguments that "
                "Triton specializes otherwise than those it was bound to (the caller's plan key misses a shape, "
                "stride, dtype or address alignment); set FUSEDLIB_DIRECT_LAUNCH=0 to launch through kernel[grid]"
            )


# ----------------------------------------------------------------------------------------
# Device-side checks, reported without a host sync
# ----------------------------------------------------------------------------------------

#: Most checks a process can register (each owns one word of the check buffer).
MAX_CHECKS: int = 8
#: Words between two checks' words: 2 int64 = 16 bytes, so every word is 16-byte aligned and
#: Triton compiles one variant of a kernel whatever the check it writes to.
_WORD_STRIDE: int = 2

_CHECKS: list["DeviceCheck"] = []
#: kernels on CUDA tensors (True: pinned host memory, shared by every GPU) or CPU tensors
#: (False: plain memory) -> (the int64 buffer, a memoryview of it: reads and writes without a
#: torch call).
_BUFFERS: dict[bool, tuple[torch.Tensor, memoryview]] = {}
#: Indices of the registered checks' words.
_INDICES: tuple[int, ...] = ()
#: Indices of the CUDA devices that ran a lazily reported check (check_errors synchronises them).
_PENDING_DEVICES: set[int] = set()
#: True once a lazily reported check was launched: from then on :func:`launch` polls.
_ARMED: bool = False


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _buffer(cuda: bool) -> tuple[torch.Tensor, memoryview] | None:
    """The check buffer for kernels on CUDA (or CPU) tensors, made on first use (None while a
    CUDA graph is being captured and it does not exist yet: pinned memory is not allocated then)."""
    entry = _BUFFERS.get(cuda)
    if entry is None:
        if cuda:
            if _capturing():
                return None
            buf = torch.zeros(MAX_CHECKS * _WORD_STRIDE, dtype=torch.int64, device="cpu", pin_memory=True)
        else:
            buf = torch.zeros(MAX_CHECKS * _WORD_STRIDE, dtype=torch.int64, device="cpu")
        entry = _BUFFERS[cuda] = (buf, memoryview(buf.numpy()))
    return entry


class DeviceCheck:
    """A check of an op's input that the op's kernel makes on the device, reported without a sync.

    The kernel gets :meth:`word` (an int64 [1] tensor in host memory that it can address, or
    None: then it checks nothing) and, when it meets a bad value, stores a nonzero int64 code
    into it (e.g. the bad id itself, which is never 0) and makes the affected outputs NaN.
    After the launch the op calls :meth:`launched`: on the CPU (Triton's interpreter), and
    on CUDA with :data:`SYNC_CHECKS`, it raises at once; otherwise (CUDA, eager) the next
    fusedlib launch or :func:`check_errors` raises. Several programs may store different codes
    into the word; any one of them is reported.

    Args:
        op: the public op's name, the start of the error message.
        message: ``message(code, context) -> str``: what was expected and what was found,
            from the stored code and the context the op passed to :meth:`launched`.

    Raises:
        ValueError: at construction, when more than :data:`MAX_CHECKS` checks exist.

    Source: fusedlib's own; zero-copy host memory: the CUDA C++ Programming Guide, "Mapped Memory".
    """

    __slots__ = ("op", "message", "index", "context", "_words")

    def __init__(self, op: str, message: Callable[[int, Any], str]) -> None:
        global _INDICES
        if len(_CHECKS) >= MAX_CHECKS:
            raise ValueError(f"at most {MAX_CHECKS} DeviceChecks can exist (fusedlib.runtime.MAX_CHECKS)")
        self.op = op
        self.message = message
        self.index = len(_CHECKS) * _WORD_STRIDE
        self.context: Any = None
        self._words: dict[bool, torch.Tensor] = {}
        _CHECKS.append(self)
        _INDICES = tuple(c.index for c in _CHECKS)

    def __repr__(self) -> str:
        return f"DeviceCheck({self.op!r})"

    def word(self, like: torch.Tensor) -> torch.Tensor | None:
        """The int64 [1] word that a kernel on ``like``'s device stores its finding in, or None
        when the check is not to be compiled in (``torch.compile`` is tracing: NaN is the signal).

        Args:
            like: a tensor the kernel reads (its device picks the buffer; ``tensor.is_cuda`` is
                cheaper than ``tensor.device.type``).
        """
        if torch.compiler.is_compiling():
            return None
        cuda = like.is_cuda
        w = self._words.get(cuda)
        if w is None:
            entry = _buffer(cuda)
            if entry is None:
                return None
            w = self._words[cuda] = entry[0][self.index:self.index + 1]
        return w

    def launched(self, like: torch.Tensor, context: Any = None) -> None:
        """Call right after launching the kernel that got :meth:`word`.

        Args:
            like: the tensor given to :meth:`word`.
            context: what :attr:`message` needs to name the expectation (e.g. the vocabulary
                size); kept as the latest call's (a lazily reported error names it).

        Raises:
            ValueError: on the CPU (or with ``TRITON_INTERPRET=1``), and on CUDA with
                :data:`SYNC_CHECKS`, when the kernel stored a code: the op's input was bad.
        """
        global _ARMED
        self.context = context
        cuda = like.is_cuda
        if cuda and not INTERPRET_ON_CPU:
            if not SYNC_CHECKS or _capturing():
                _PENDING_DEVICES.add(like.get_device())
                _ARMED = True
                return
            torch.cuda.current_stream(like.device).synchronize()
        entry = _BUFFERS.get(cuda)
        if entry is not None and entry[1][self.index]:
            self._raise(entry[1])

    def _raise(self, view: memoryview) -> None:
        code = view[self.index]
        view[self.index] = 0  # reported: the next call starts clean
        err = ValueError(self.message(code, self.context))
        if hasattr(err, "add_note"):  # Python >= 3.11: shown in the traceback, not in str(err)
            err.add_note(f"fusedlib.runtime: found on the device by {self.op}'s kernel; on CUDA it is reported "
                         "at a later fusedlib call or by fusedlib.runtime.check_errors() (set "
                         "FUSEDLIB_SYNC_CHECKS=1 to raise inside the call itself)")
        raise err


def _sync_pending() -> None:
    if _PENDING_DEVICES and not _capturing():
        for device in tuple(_PENDING_DEVICES):
            torch.cuda.synchronize(device)


def _poll() -> None:
    """Raise the first error a lazily reported check has stored (no wait, unless one is set)."""
    view = _BUFFERS[True][1]
    for i in _INDICES:
        if view[i]:
            _sync_pending()  # the error path only: let the kernel finish, so its word is final
            _CHECKS[i // _WORD_STRIDE]._raise(view)


def check_errors() -> None:
    """Wait for the GPU work of fusedlib's device-side checks and raise what they found.

    On CUDA, eager ops with a device-side check (cross-entropy target ids, the memory-efficient
    norms' gamma) report bad input lazily: the affected outputs are NaN at once, and the
    ValueError comes at a later fusedlib kernel launch. Call this where a definite answer is
    wanted: e.g. at the end of a training step (with tensor parallelism, at the same point on
    every rank, so that every rank raises together and no collective is left waiting).
    A no-op while ``torch.compile`` traces and before any check ran lazily on a GPU; it
    does not wait while a CUDA graph is being captured.

    Raises:
        ValueError: naming the op, the argument and what was expected, for the first check
            whose word is set (the word is cleared; call again for the next).

    Source: fusedlib's own (see :class:`DeviceCheck`).
    """
    if torch.compiler.is_compiling():
        return
    _sync_pending()
    for _, view in _BUFFERS.values():
        for check in _CHECKS:
            if view[check.index]:
                check._raise(view)


def device_banner() -> str:
    """One line naming the device, torch and triton versions, and how kernels run.

    Returns:
        e.g. ``"NVIDIA H200 | torch 2.11.0 | triton 3.6.0 | kernels compiled"`` or
        ``"CPU (no CUDA GPU) | torch 2.13.0 | triton 3.9.0 | kernels interpreted by Triton's interpreter"``.

    Source: fusedlib's own.
    """
    if CUDA_AVAILABLE:
        name = torch.cuda.get_device_name()
        mode = "compiled"
    else:
        name = "CPU (no CUDA GPU)"
        mode = "interpreted by Triton's interpreter"
    return f"{name} | torch {torch.__version__} | triton {triton.__version__} | kernels {mode}"


def reset_generators_after_failed_capture() -> None:
    """Take every CUDA generator out of graph-capture mode after a capture that failed.

    ``torch.cuda.graph`` puts the default CUDA generators into capture mode when a capture
    begins and takes them out in ``capture_end``; when the capture fails (a host sync inside
    it, say), ``capture_end`` raises first and the generators stay in capture mode, so every
    later random draw in the process fails with "Offset increment outside graph capture
    encountered unexpectedly" (seen on the H200: one baseline that could not be captured
    stopped every later case of the run). Each generator gets a fresh state with the same
    seed and offset (``clone_state``), which is not in capture mode.

    Source: PyTorch ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp`` (``capture_prologue``,
    ``capture_epilogue``, ``CUDAGeneratorState::clone``).
    """
    for gen in torch.cuda.default_generators:
        gen.graphsafe_set_state(gen.clone_state())


def end_pool_of_failed_capture(index: int, pool: tuple[int, int]) -> bool:
    """End the caching allocator's routing to a failed capture's memory pool and release the
    pool's reference that the capture took, when the capture's exit did neither.

    ``CUDAGraph::capture_begin`` starts the allocator's routing to the graph's pool
    (``beginAllocateToPool``, which also takes a reference to the pool); ``capture_end`` ends the
    routing only after ``cudaStreamEndCapture`` succeeded, and ``reset()`` (the graph's
    destructor) releases the reference only after a capture that ended. After a capture that
    failed there (PyTorch 2.11, measured on an H100), the allocator stays as if a capture were
    under way: ``torch.cuda.empty_cache()`` returns none of the default pools' cached memory to
    the driver (a 1 GiB tensor freed after a failed capture stayed reserved: 1030 MiB), and
    ``malloc`` neither processes pending events nor frees the cache and retries when memory runs
    out; and what the capture allocated stays in a pool nothing releases. This ends the routing
    and releases that reference (the two calls ``torch.cuda.use_mem_pool`` makes on exit).

    When the allocator has no routing to ``pool`` (the capture's exit ended it, or no capture
    began with it) it refuses, and nothing is released: a capture whose exit ended the routing
    and then failed without marking the capture ended (in PyTorch 2.11, a failure after
    ``endAllocateToPool`` in ``capture_end``) leaves its reference unreleased, and its memory
    with it. Pool handles are never reused, so the refusal is harmless.

    Args:
        index: the CUDA device index the capture ran on.
        pool: the memory pool handle the capture was given (``torch.cuda.graph(..., pool=pool)``,
            ``torch.cuda.make_graphed_callables(..., pool=pool)``).

    Returns:
        True when the routing was ended here and the reference released; False when the
        allocator had no routing to ``pool``, or this PyTorch has no Python call to end it
        (nothing changed).

    Raises:
        RuntimeError: from the allocator, other than its refusal of a pool it does not route to
            (an internal assertion).

    Source: PyTorch ``aten/src/ATen/cuda/CUDAGraph.cpp`` (``capture_begin``, ``capture_end``,
    ``reset``), ``c10/cuda/CUDACachingAllocator.cpp`` (``endAllocateToPool``, ``releasePool``)
    and ``torch/cuda/memory.py`` (``use_mem_pool``; the call is
    ``_cuda_endAllocateCurrentStreamToPool`` before PyTorch 2.8).
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
    if end is None:
        return False
    try:
        end(index, pool)
    except RuntimeError as exc:
        if "not currently recording" in str(exc):  # ("endAllocatePool: not currently recording to mempool_id")
            return False
        raise
    torch._C._cuda_releasePool(index, pool)
    return True


def _end_capture_mode(generators: Sequence[torch.Generator]) -> None:
    """Take generators registered with a capture that failed out of capture mode, in place.

    A capture puts each registered generator state into capture mode when it begins and takes
    it out in ``capture_end``, which raises first when the capture failed: every later random
    draw from such a state then fails ("Offset increment outside graph capture encountered
    unexpectedly"). The default generators get new states
    (:func:`reset_generators_after_failed_capture`), but other states may be
    held elsewhere (Megatron-core's RNG tracker keeps them, and its ``fork()`` hands out new
    wrappers of the same states), so these are ended in place: an empty capture that registers
    them runs a capture's prologue and epilogue on each (seed and offset kept). Its failure
    becomes a warning: the capture's own error is the one to raise.

    Source: PyTorch ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp`` (``capture_prologue``,
    ``capture_epilogue``, ``increase``).
    """
    try:
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("The CUDA Graph is empty")
            with torch.cuda.graph(graph):
                pass
    except Exception as exc:
        warnings.warn(f"after a failed CUDA graph capture, taking its registered generators out of capture "
                      f"mode failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def restore_after_failed_capture(
        device: Optional[torch.device | str | int] = None,
        generators: Sequence[torch.Generator] = ()) -> Iterator[Optional[tuple[int, int]]]:
    """Around a CUDA graph capture (``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``):
    when the capture failed, make the caller's stream and device current again, end the
    allocator's routing to the capture's memory pool and take the CUDA generators out of
    capture mode, then let the error through.

    ``torch.cuda.graph``'s exit calls ``capture_end`` before it leaves its stream context; when
    the capture failed (a host sync inside it, say), ``capture_end`` raises, the stream context
    is never left, and the capture's side stream stays the calling thread's current stream (and
    its device the current device): every later operation of the thread runs on it, and code
    that launches on the device's legacy default stream (handle 0) is no longer ordered with
    the tensors' own work (torch's side streams do not synchronize with it). The same failure
    leaves the caching allocator routing to the capture's pool
    (:func:`end_pool_of_failed_capture`) and the CUDA generators in capture mode, where every
    later random draw fails (:func:`reset_generators_after_failed_capture`).

    The block is given a new memory pool handle (``torch.cuda.graph_pool_handle()``; None
    without CUDA) to pass to the capture as its ``pool``, so that the pool can be named after
    a failure. When the block raises:

    * the routing to that pool is ended, on the device current when the error arrives (a failed
      exit leaves the capture stream's device current). The allocator refuses when the routing
      had ended or never began (an error in a warm-up call, or one inside a capture that still
      ended), and nothing changes; an error of the allocator itself is turned into a warning,
      so that the block's error is the one raised;
    * when the current device, or the current stream of the current device or of ``device``,
      is no longer what it was on entry (the mark of an exit that stopped at ``capture_end``),
      those streams and the device are set back, ``generators`` (those registered with the
      capture) taken out of capture mode in place (:func:`_end_capture_mode`) and the default
      generators reset. An error that leaves
      them as they were is let through with them untouched: resetting the generators gives
      them a new state object, which graphs captured earlier no longer share.

    On success it does nothing.

    Not restored: the pinned host allocator's routing to the pool, which ``capture_end`` ends
    next to the device allocator's (PyTorch has no Python call for it): its reference to the
    pool stays, and pinned allocations (``pin_memory()``) take its slower path that checks for
    captures under way, for the rest of the process; a pool other than the one given; a capture
    stream on a third device, neither the current one nor ``device``; and a caller whose
    current stream already was the capture's stream (nothing changes that marks the failure:
    the routing is ended, the generators stay in capture mode).

    Args:
        device: the CUDA device the capture runs on, as a ``torch.device``, a str or an index
            (None: the current device). Another device type, or a process without CUDA:
            nothing is saved or restored, and the block gets None.
        generators: generators registered with the capture's graph besides the default
            generator's current state (``CUDAGraph.register_generator_state``).

    Yields:
        The memory pool handle for the capture (a ``(int, int)`` tuple), or None (no CUDA, or
        another device type).

    Raises:
        Whatever the block raises, after the restoring; on entry, torch's errors for a device
        that is not one (``torch.device``, ``torch.cuda.current_stream``).

    Source: PyTorch ``torch/cuda/graphs.py`` (``graph.__exit__``: ``capture_end``, then the
    stream context's exit) and ``aten/src/ATen/cuda/CUDAGraph.cpp`` (``capture_end``).
    """
    if device is not None:  # (an int is a CUDA device index, as torch.cuda's functions take it)
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if not (CUDA_AVAILABLE and (device is None or device.type == "cuda")):
        yield None
        return
    index = torch.cuda.current_device()
    saved = {index: torch.cuda.current_stream(index)}
    if device is not None and device.index is not None and device.index != index:
        saved[device.index] = torch.cuda.current_stream(device.index)
    pool = torch.cuda.graph_pool_handle()
    try:
        yield pool
    except BaseException:
        capture_index = torch.cuda.current_device()  # (the capture stream's, if its exit failed)
        changed = capture_index != index or any(torch.cuda.current_stream(i) != s for i, s in saved.items())
        if changed:
            for stream in saved.values():
                torch.cuda.set_stream(stream)  # (it also makes the stream's device current)
            torch.cuda.set_device(index)
        try:
            end_pool_of_failed_capture(capture_index, pool)
        except Exception as exc:  # (the block's error is the one to raise)
            warnings.warn(f"after a failed CUDA graph capture, ending the caching allocator's routing to its "
                          f"memory pool failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
        if changed:
            if generators:
                _end_capture_mode(generators)
            reset_generators_after_failed_capture()
        raise


#: How many :func:`collector_paused_for_capture` blocks are open (nested ones do nothing).
_PAUSE_DEPTH: int = 0


@contextlib.contextmanager
def collector_paused_for_capture(collect: bool = True) -> Iterator[None]:
    """Run Python's garbage collector now (unless ``collect`` is False), and keep it off inside
    the ``with`` block (a CUDA graph capture); on exit it is enabled again if it was enabled
    before. A block nested in another does nothing (the outer one collected and restores).

    ``torch.cuda.make_graphed_callables`` defines a new ``torch.autograd.Function`` class per
    call, whose methods hold the captured graphs; a class is always part of a reference cycle,
    so those graphs, and their memory pools, are freed only when the cyclic collector runs,
    which could be in the middle of a later capture. Destroying a CUDA graph during a capture
    is a likely (not proven) cause of captures that failed, rarely, under the GPU tests.
    ``torch.cuda.graph`` used to collect before every capture (to free memory), and now does so
    only with ``torch.compiler.config.force_cudagraph_gc``; Megatron-core collects before its
    captures begin. The collection costs host time (tens of ms with torch loaded); keeping the
    collector off is what keeps it out of the capture, so a caller that captures often and
    leaves no ``make_graphed_callables`` results behind (a benchmark timer) can pass
    ``collect=False``.

    Args:
        collect: run ``gc.collect()`` before the block (frees what earlier captures left in
            reference cycles).

    Raises:
        Nothing of its own; an exception from the block propagates after the collector's
        state is restored.

    Source: PyTorch ``torch/cuda/graphs.py`` (``graph.__enter__``, ``make_graphed_callables``);
    Megatron-LM ``megatron/core/transformer/cuda_graphs.py`` (``_start_capturing``).
    """
    global _PAUSE_DEPTH
    if _PAUSE_DEPTH:
        yield
        return
    if collect:
        gc.collect()
    enabled = gc.isenabled()
    _PAUSE_DEPTH += 1
    try:
        gc.disable()  # inside the try: an interrupt right after it still restores the collector
        yield
    finally:
        _PAUSE_DEPTH -= 1
        if enabled:
            gc.enable()


def optional_function_ok() -> bool:
    """Whether an optional fusedlib ``torch.autograd.Function`` may stand in for plain torch ops.

    Some layers take a fusedlib Function only to do the same work faster (the QKV split whose
    backward takes a packed gradient whole, the one-rank linear layer whose bias gradient is
    fusedlib's column sum). Those Functions define neither ``setup_context`` nor ``jvp``, so
    they cannot run under ``torch.func`` transforms (grad, vmap, jacrev...) or forward-mode AD,
    and under torch.compile Inductor plans the same work itself. There the layers keep the
    plain ops.

    Returns:
        False while torch.compile traces, a ``torch.func`` transform is active, or a
        forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``); else True.

    Source: fusedlib's own.
    """
    if torch.compiler.is_compiling():
        return False
    return not torch._C._are_functorch_transforms_active() and _forward_ad._current_level < 0
