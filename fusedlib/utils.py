"""Shared helpers for every fused op: input checks and Triton launch settings.

One input-checking helper (:func:`check_tensor`, :func:`check_same_device`) and one
launch-settings helper (:func:`calculate_settings`) serve every op, so every op fails
the same clear way on bad input and picks block sizes by the same written rules.

Source: the launch-settings idea follows Liger-Kernel's ``calculate_settings``
(``src/liger_kernel/ops/utils.py``), with its thresholds written as a table.
"""
from __future__ import annotations

from typing import Iterable

import torch
import triton

__all__ = [
    "SUPPORTED_FLOAT_DTYPES",
    "check_tensor",
    "check_same_device",
    "calculate_settings",
    "MAX_FUSED_SIZE",
    "num_programs_hint",
    "sm_count",
]

#: The dtypes fusedlib's kernels take: loaded, computed in float32, stored back. float64
#: is computed in float64: it is there so gradcheck can check the kernels, not for speed.
SUPPORTED_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Longest row one program may hold in registers, in elements (64 Ki). A row longer
#: than this needs a looping (online) kernel; :func:`calculate_settings` refuses it.
MAX_FUSED_SIZE: int = 65536

# Warps for a program that holds a whole row of BLOCK_SIZE elements, as (upper bound
# of BLOCK_SIZE, num_warps). More warps for longer rows keep the per-thread register
# count near 16-32 elements; the same steps as the Triton layer-norm tutorial and Liger.
_WARPS_BY_BLOCK: tuple[tuple[int, int], ...] = (
    (2048, 4),     # up to 2 Ki elements: 4 warps (<= 16 elements per thread)
    (8192, 8),     # up to 8 Ki: 8 warps (<= 32 per thread)
    (32768, 16),   # up to 32 Ki: 16 warps
    (MAX_FUSED_SIZE, 32),  # up to 64 Ki: 32 warps, the most a program can have
)


def calculate_settings(n_cols: int) -> tuple[int, int]:
    """Block size and warp count for a kernel that holds one row of ``n_cols`` in registers.

    Args:
        n_cols: the row length, in elements (>= 1).

    Returns:
        ``(BLOCK_SIZE, num_warps)``: BLOCK_SIZE is the next power of two >= n_cols.

    Raises:
        ValueError: if ``n_cols`` < 1 or its block would exceed :data:`MAX_FUSED_SIZE`.
    """
    if n_cols < 1:
        raise ValueError(f"n_cols must be >= 1, got {n_cols}")
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(
            f"a row of {n_cols} elements needs a block of {block} > MAX_FUSED_SIZE={MAX_FUSED_SIZE}; "
            "use the op's looping kernel for rows this long"
        )
    for bound, warps in _WARPS_BY_BLOCK:
        if block <= bound:
            return block, warps
    raise AssertionError("unreachable: MAX_FUSED_SIZE is the last bound")


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = SUPPORTED_FLOAT_DTYPES,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """Check one argument of a fused op and return it.

    Args:
        name: the argument's name, used in the error message.
        t: the value passed.
        dtypes: allowed dtypes (None: any).
        ndim: required number of dims, or a tuple of allowed numbers.
        min_ndim: least number of dims.
        shape: required shape; ``None`` entries match any size.

    Returns:
        ``t``, unchanged.

    Raises:
        TypeError: ``t`` is not a tensor, or has a dtype not in ``dtypes``.
        ValueError: wrong number of dims or shape.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_nd:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed_nd))} dims, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Check that every given tensor (None entries skipped) is on one device.

    Args:
        **tensors: name=tensor pairs.

    Returns:
        The common device.

    Raises:
        ValueError: naming each argument and its device when they differ, or when the
            device is neither CUDA nor CPU.
    """
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    dev = devices.pop()
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"fusedlib kernels run on 'cuda' or 'cpu' tensors, got {dev}")
    return dev


def acc_dtype(dtype: torch.dtype):
    """The kernels' compute dtype for inputs of ``dtype``: ``tl.float64`` for float64
    (gradcheck), else ``tl.float32`` (the dtype policy: load, compute in fp32, store)."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` of shape [..., n] as a 2-D matrix of rows: [..., n] -> [prod(...), n].

    Kernels take the result's two strides, so a transposed or sliced 2-D input needs no
    copy. ``reshape`` copies only when the leading dims of a non-contiguous N-D input
    cannot be merged into one stride; the input itself is never modified.

    Args:
        t: a tensor with at least 1 dim.

    Returns:
        A 2-D tensor [rows, n] (a view of ``t`` where strides allow).
    """
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


#: Programs per streaming multiprocessor for kernels whose programs loop over rows and
#: keep a running reduction (bias / gamma gradients): each writes one float32 partial row,
#: so fewer programs mean fewer partials to add. Kernel-only timings on the H200 (NOTES.md):
#: bias-GeLU's backward 0.245 ms at 4 per SM against 0.273 at 16; bias-dropout-add's
#: backward 0.163 ms at 4 against 0.211 at 16.
PROGRAMS_PER_SM: int = 4


def num_programs_hint(device: torch.device) -> int:
    """How many programs keep the device busy: :data:`PROGRAMS_PER_SM` per streaming
    multiprocessor on CUDA; 8 in the CPU interpreter, where each program instance runs in
    turn and fewer, larger programs are faster.
    """
    if device.type == "cuda":
        return PROGRAMS_PER_SM * sm_count(device)
    return 8


#: CUDA device index -> streaming multiprocessors. A plain dict, not ``functools.lru_cache``:
#: torch.compile's Dynamo traces a dict lookup silently, but warns at every lru_cache'd call
#: (it ignores the cache and traces the wrapped function). Not written while Dynamo traces: a
#: side effect inside an autograd.Function's traced backward breaks the trace.
_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (index None: the current device), cached.

    Args:
        device: a CUDA device.

    Returns:
        ``torch.cuda.get_device_properties(device).multi_processor_count`` (132 on an H200).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = torch.cuda.get_device_properties(index).multi_processor_count
        if not torch.compiler.is_compiling():
            _SM_COUNT[index] = n
    return n


# ----------------------------------------------------------------------------------------
# Viewless tensors (Megatron-core megatron/core/utils.py), used by the norms' Apex backend.
# ----------------------------------------------------------------------------------------

__all__ += ["make_viewless_tensor"]


def _kernel_make_viewless_tensor(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    # A new tensor object whose .data is inp's storage, shape and strides, with no _base.
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class _MakeViewlessTensor(torch.autograd.Function):
    """Identity in autograd; its output shares ``inp``'s memory but is not a view."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return ``inp``, or a tensor sharing its memory whose ``_base`` is None.

    Megatron's pipeline schedule frees an activation once the next stage has it, with
    ``deallocate_output_tensor(out)``: ``out.data = torch.empty((1,))`` keeps the autograd
    graph but drops the memory. For a *view* that frees nothing (its ``_base`` still
    holds the whole storage), so the schedule asserts ``out._base is None``. Apex's
    persistent LayerNorm returns ``ymat.view(x.shape)``, a view; Megatron wraps it with
    this function. fusedlib's own kernels allocate their outputs in the input's shape and
    never need it.

    Args:
        inp: any tensor.
        requires_grad: for the new tensor.
        keep_graph: True: go through an identity autograd Function, so gradients flow to
            ``inp``'s graph; False: a plain new tensor (no graph).

    Returns:
        ``inp`` itself if it is not a view, else a viewless tensor with the same data.

    Source: Megatron-LM ``megatron/core/utils.py`` (``make_viewless_tensor``).
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return _MakeViewlessTensor.apply(inp, requires_grad)
    return _kernel_make_viewless_tensor(inp, requires_grad)
