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

Source: Triton's interpreter, ``triton/runtime/interpreter.py``.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

import torch

__all__ = [
    "CUDA_AVAILABLE",
    "INTERPRET_ON_CPU",
    "default_device",
    "device_banner",
    "launch",
    "kernel_mode",
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

    On CUDA the kernel is compiled (once per signature, then cached by Triton); in a
    process with ``TRITON_INTERPRET=1`` it runs in Triton's interpreter. Tensors on a
    GPU are copied to the host and back by the interpreter.
    """
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
