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

import logging
import os
import sys
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "CUDA_AVAILABLE",
    "INTERPRET_ON_CPU",
    "default_device",
    "device_banner",
    "launch",
    "kernel_mode",
    "SYNC_CHECKS",
    "DeviceCheck",
    "check_errors",
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
INTERPRET_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def _env_flag(name: str) -> bool:
    """True when the environment variable ``name`` is set to anything but "", "0", "false", "no"."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


#: ``FUSEDLIB_SYNC_CHECKS=1`` (read at import; tests may set the attribute): debug mode. Ops
#: with a device-side check (:class:`DeviceCheck`) wait for their kernel and raise at once on
#: CUDA too, as on the CPU: one stream synchronisation per checked call.
SYNC_CHECKS: bool = _env_flag("FUSEDLIB_SYNC_CHECKS")

import triton  # noqa: E402  (after TRITON_INTERPRET is settled)


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


if INTERPRET_ON_CPU:
    _fix_interpreter_index()


def default_device() -> torch.device:
    """The device the book runs on: ``cuda`` when a GPU is present, else ``cpu``.

    Returns:
        ``torch.device("cuda")`` or ``torch.device("cpu")``.
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
    """
    dev = torch.device(device)
    if dev.type in ("cuda", "cpu"):
        return "interpreted" if INTERPRET_ON_CPU else "compiled"
    raise ValueError(f"fusedlib kernels run on 'cuda' or 'cpu' tensors, got device {dev}")


def launch(kernel: Any, grid: Sequence[int], tensors_device: torch.device, *args: Any, **kwargs: Any) -> None:
    """Launch a ``@triton.jit`` kernel for tensors on ``tensors_device``.

    Args:
        kernel: the ``@triton.jit`` function.
        grid: the launch grid, a tuple of 1 to 3 ints (program counts).
        tensors_device: the device of the kernel's tensor arguments (all on one device;
            callers check that with :func:`fusedlib.utils.check_same_device`).
        *args, **kwargs: the kernel's arguments, constexprs and ``num_warps`` included.

    Raises:
        ValueError: for a device that is neither CUDA nor CPU, or for CPU tensors in a
            process whose kernels are compiled for CUDA (see the module docstring).
        RuntimeError: on a machine without CUDA where Triton was imported before fusedlib
            (see :data:`LATE_INTERPRET`).

    On CUDA the kernel is compiled (once per signature, then cached by Triton); in a
    process with ``TRITON_INTERPRET=1`` it runs in Triton's interpreter. Tensors on a
    GPU are copied to the host and back by the interpreter.

    Once a device-side check has been launched lazily (:class:`DeviceCheck`), every launch
    first reads the check words and raises the ValueError of any that is set.
    """
    if _ARMED and not torch.compiler.is_compiling():
        _poll()  # a device-side check of an earlier call found bad input: raise it now
    kernel_mode(tensors_device)  # raises for devices other than cuda / cpu
    if LATE_INTERPRET:
        raise RuntimeError(
            "Triton was imported before fusedlib on this machine without a CUDA GPU, so its library "
            "functions were built for the compiler and fusedlib's kernels cannot run in Triton's "
            "interpreter. Import fusedlib first (before triton and before any torch.compile call), "
            "or set TRITON_INTERPRET=1 in the environment before starting Python."
        )
    if INTERPRET_ON_CPU:
        kernel[tuple(grid)](*args, **kwargs)
        return
    if tensors_device.type != "cuda":
        raise ValueError(
            f"got tensors on {tensors_device}, but fusedlib's Triton kernels in this process are compiled "
            "for CUDA: move the tensors to a CUDA device, or set TRITON_INTERPRET=1 before importing "
            "fusedlib to run every kernel in Triton's (slow) CPU interpreter"
        )
    if tensors_device.index is not None and tensors_device.index != torch.cuda.current_device():
        with torch.cuda.device(tensors_device):  # Triton launches on the current device
            kernel[tuple(grid)](*args, **kwargs)
    else:
        kernel[tuple(grid)](*args, **kwargs)


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
        ``"CPU (no CUDA GPU) | torch 2.13.0 | triton 3.9.0 | kernels interpreted"``.
    """
    if CUDA_AVAILABLE:
        name = torch.cuda.get_device_name()
        mode = "compiled"
    else:
        name = "CPU (no CUDA GPU)"
        mode = "interpreted by Triton's interpreter"
    return f"{name} | torch {torch.__version__} | triton {triton.__version__} | kernels {mode}"
