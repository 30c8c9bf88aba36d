"""Input checks shared by every fused op: one clear error, naming the argument, for bad input.

:func:`check_tensor` checks one argument (type, dtype, dims, shape) and
:func:`check_same_device` that the tensors share one device a kernel can run on. They build
their messages only when something is wrong, but even their happy path costs microseconds of
Python per call, paid on every step of an eager training loop. So each op tests its happy
case first with one cheap combined condition (:data:`FLOAT_DTYPES` membership,
:func:`on_one_kernel_device`, a few dims and sizes) and calls these detailed checks only
when that condition fails: the error is the same, the common case pays a fraction.
"""
from __future__ import annotations

import functools
import numbers
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = [
    "SUPPORTED_FLOAT_DTYPES",
    "file_on_the_way",
    "FLOAT_DTYPES",
    "KERNEL_DEVICE_TYPES",
    "FLOAT32_MAX",
    "ArgumentTypeError",
    "check_tensor",
    "check_dense",
    "is_dense",
    "resolve_neg_grads",
    "check_same_device",
    "check_bool",
    "check_bools",
    "check_ids_below_on_cpu",
    "short_repr",
    "is_numpy_bool",
    "on_one_kernel_device",
    "real_to_float",
    "nearest_float32",
    "type_name",
]

#: The dtypes fusedlib's kernels take: loaded, computed in float32, stored back. float64
#: is computed in float64: it is there so gradcheck can check the kernels, not for speed.
SUPPORTED_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: :data:`SUPPORTED_FLOAT_DTYPES` as a set, for the fast path's membership test.
FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(SUPPORTED_FLOAT_DTYPES)

#: Device types fusedlib's kernels run on (compiled on CUDA, interpreted on the CPU).
KERNEL_DEVICE_TYPES: frozenset[str] = frozenset(("cuda", "cpu"))

#: The largest finite float32 (3.4028e38). The kernels take Python floats (scales, eps, clamps)
#: as float32 arguments: a larger value becomes inf there, so checks reject it.
FLOAT32_MAX: float = torch.finfo(torch.float32).max
#: The smallest normal float32 (1.1755e-38): below it a kernel's float32 argument is
#: subnormal (flushed to 0 where the GPU flushes) or 0.
FLOAT32_TINY: float = torch.finfo(torch.float32).tiny

_STRIDED = torch.strided
_is_compiling = torch.compiler.is_compiling


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type, where fusedlib raised a ValueError before.

    fusedlib's rule is a TypeError for a wrong type; a few checks (``TransformerConfig``'s fields,
    bias-dropout-add's ``prob``) said ValueError for every bad value, types included, and callers
    may catch that. This is both: ``except TypeError`` and ``except ValueError`` catch it.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """


def type_name(value: object) -> str:
    """The name of ``value``'s type for an error message: bare for builtins (``str``), else
    qualified by its module (``numpy.bool``, ``torch.Tensor``), so that numpy's ``bool`` is
    never reported as Python's.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    t = type(value)
    module = t.__module__
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def is_numpy_bool(value: object) -> bool:
    """True for numpy's bool scalar (``numpy.bool_``, named ``numpy.bool`` since numpy 2), without importing numpy.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    t = type(value)
    return t.__module__ == "numpy" and t.__name__ in ("bool", "bool_")


def check_bool(name: str, value: object) -> bool:
    """Check a boolean switch and return it as a Python bool.

    Callers test the happy case first (``value is True or value is False``) and call this only
    otherwise. numpy's bool is accepted (converted); anything else, truthy or not (a str
    ``"False"``, 1, None), is refused rather than read as its truth value.

    Raises:
        TypeError: ``value`` is neither a bool nor a numpy bool; the message names its type.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if value is True or value is False:
        return value
    if is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type_name(value)} {short_repr(value)}")


def check_bools(owner: str, **flags: object) -> tuple[bool, ...]:
    """:func:`check_bool` for each keyword, named ``"{owner}: {keyword}"``; returns the flags
    as Python bools, in the order given (a constructor's on/off arguments in one call).

    Raises:
        TypeError: a flag that is neither a bool nor a numpy bool (a str "False" was read as True).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return tuple(v if v is True or v is False else check_bool(f"{owner}: {k}", v) for k, v in flags.items())


def check_ids_below_on_cpu(name: str, ids: torch.Tensor, bound: int, bound_name: str) -> None:
    """Raise ValueError when CPU ``ids`` (an int tensor) hold a value outside [0, ``bound``).

    A host check costs no synchronisation on the CPU (``F.embedding``'s own IndexError there
    names nothing); on CUDA it would, so nothing is checked there (a table lookup's device-side
    check applies), nor inside a ``torch.compile`` trace, nor for an empty tensor.

    Raises:
        ValueError: ``"{name} must lie in [0, {bound_name} = {bound}), got values in [low, high]"``.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= bound:
            raise ValueError(f"{name} must lie in [0, {bound_name} = {bound}), got values in [{low}, {high}]")


def real_to_float(name: str, value: numbers.Real, expected: str) -> float:
    """``float(value)`` for a real number that passed its type check.

    A Python int beyond a float's range (``10**400``) makes ``float()`` and ``math.isfinite``
    raise an OverflowError that names nothing; here it is a ValueError naming the argument.

    Args:
        name: the argument's name, for the message.
        value: an int, a float or another ``numbers.Real`` (not a bool: callers refuse those first).
        expected: what the argument must be ("a finite number >= 0"), for the message.

    Raises:
        ValueError: ``value`` is too large for a Python float.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {expected}, got an int too large for a float: "
                         f"{short_repr(value)}") from None


def nearest_float32(value: float) -> float:
    """The float32 number nearest to ``value`` (round to nearest even), as a Python float.

    A Python float reaches a Triton kernel on the GPU as a float32 argument, while Triton's
    interpreter keeps it in float64: an op that rounds its scalar arguments with this first
    computes with the same number on both. ``value`` must lie within float32's range (callers
    check it): beyond it ``struct`` raises an OverflowError.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


#: packs a Python float as the nearest float32, and back
_FLOAT32 = struct.Struct("f")


def short_repr(value: object) -> str:
    """``repr(value)`` for a message, cut at 40 characters (a tensor's repr has no end).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if isinstance(value, torch.Tensor):
        return f"of shape {list(value.shape)}"
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def on_one_kernel_device(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on one device of a type in :data:`KERNEL_DEVICE_TYPES`, dense
    and without the negative bit (:func:`check_dense`): the happy case of
    :func:`check_same_device`, as one cheap test (no message, no raise).

    Args:
        *tensors: one or more tensors (no None).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    device = tensors[0].device
    if device.type not in KERNEL_DEVICE_TYPES:
        return False
    dense = not _is_compiling()  # (Dynamo cannot trace is_neg, nor layout in a Function's backward)
    for t in tensors:
        if t.device != device or (dense and (t.layout is not _STRIDED or t.is_nested or t.is_neg())):
            return False
    return True


def is_dense(t: torch.Tensor) -> bool:
    """The happy case of :func:`check_dense` as one cheap test: strided, not nested, and
    without the negative bit (nothing is tested while ``torch.compile`` traces).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return _is_compiling() or (t.layout is _STRIDED and not t.is_nested and not t.is_neg())


def check_dense(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor a Triton kernel cannot read as its values.

    A kernel reads a tensor's memory through its data pointer and strides. That memory is the
    tensor's values only for a strided (dense) layout, not nested, and only without the *negative bit*:
    PyTorch's lazy negation views (``c.conj().imag`` of a complex tensor, ``torch._neg_view``)
    share the memory of the tensor they negate and flip the sign only when an operator reads
    them, so a kernel would compute with the negated values. PyTorch's own raw-memory exits
    refuse them the same way (``Tensor.numpy()``). Not checked while ``torch.compile`` traces
    (Dynamo cannot trace ``is_neg``, nor ``layout`` inside a Function's backward).

    Args:
        name: the argument's name, used in the error message.
        t: a tensor.

    Raises:
        TypeError: ``t`` is sparse or of another non-strided layout, or a nested tensor.
        ValueError: ``t`` has the negative bit set (the message says to pass
            ``t.resolve_neg()``).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if _is_compiling():
        return
    if t.layout is not _STRIDED:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: pass {name}.to_dense()")
    if t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor: pass its components "
                        f"one at a time, or {name}.to_padded_tensor(0.0)")
    if t.is_neg():
        raise ValueError(
            f"{name} has its negative bit set (a lazy negation view, e.g. the imaginary part of a conjugated "
            f"complex tensor), whose memory holds the negated values that fusedlib's kernels would read: "
            f"pass {name}.resolve_neg()"
        )


def _dense_grad(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if g is None:
        return None
    if g._is_zerotensor():  # autograd's lazy zeros: no memory at all
        return torch.zeros(g.shape, dtype=g.dtype, device=g.device)
    if g.layout is not _STRIDED:
        g = g.to_dense()
    return g.resolve_neg()


def resolve_neg_grads(backward: Callable) -> Callable:
    """Decorator for an ``autograd.Function``'s ``backward``: the gradients it receives with the
    negative bit set (autograd hands on lazy negation views, see :func:`check_dense`) reach
    it resolved (``g.resolve_neg()``, a copy), so its kernels read the gradients' values; a
    sparse gradient reaches it dense, autograd's storage-less zero tensor as zeros. The
    others pass unchanged (three cheap tests each); nothing is tested while ``torch.compile``
    traces.

    Source: fusedlib (PyTorch's negative-bit views: ``torch.Tensor.resolve_neg``).
    """

    @functools.wraps(backward)
    def resolving(ctx: Any, *grads: Any) -> Any:
        if not _is_compiling():
            for g in grads:
                if g is not None and (g.is_neg() or g.layout is not _STRIDED or g._is_zerotensor()):
                    grads = tuple(_dense_grad(h) for h in grads)
                    break
        return backward(ctx, *grads)

    return resolving


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
        TypeError: ``t`` is not a tensor, is not dense (:func:`check_dense`), or has a dtype
            not in ``dtypes``.
        ValueError: ``t`` has the negative bit set (:func:`check_dense`); wrong number of
            dims or shape.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = [str(d).replace("torch.", "") for d in dtypes]
            allowed = names[0] if len(names) == 1 else f"in ({', '.join(names)})"
            raise TypeError(f"{name} must have dtype {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_nd:
            raise ValueError(f"{name} must be {' or '.join(f'{n}-D' for n in allowed_nd)}, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension{'s' if min_ndim > 1 else ''}, got shape "
                         f"{tuple(t.shape)}")
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
        TypeError, ValueError: as :func:`check_dense`, for a tensor that is not dense or has
            the negative bit set.
        ValueError: naming each argument and its device when they differ, or when the
            device is neither CUDA nor CPU.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    present = {k: v for k, v in tensors.items() if v is not None}
    for k, v in present.items():
        check_dense(k, v)
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    dev = devices.pop()
    if dev.type not in KERNEL_DEVICE_TYPES:
        raise ValueError(f"fusedlib kernels run on 'cuda' or 'cpu' tensors, got {dev}")
    return dev


def check_window_size(window_size: object, allow_none: bool = True) -> Optional[tuple[int, int]]:
    """Check a sliding window ``(left, right)``: ints >= -1, -1 meaning unbounded on that side.

    Args:
        window_size: the pair, or None (no window) where ``allow_none``.
        allow_none: whether None is accepted.

    Returns:
        ``(left, right)`` as Python ints, or None.

    Raises:
        ValueError: anything else (another negative value is not "unbounded"; a bool is no int).

    Source: Megatron-core's ``TransformerConfig.window_size`` (``(-1, -1)``: no window).
    """
    if window_size is None and allow_none:
        return None
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        kind = "None or a pair" if allow_none else "a pair"
        raise ValueError(f"window_size must be {kind} (left, right) of ints >= -1 (-1: unbounded side), "
                         f"got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def file_on_the_way(path: "str | Path", include_self: bool = False) -> Optional[Path]:
    """The first existing file (not a folder) among ``path``'s parents (and ``path`` itself with
    ``include_self``), or None: where one is, no folder can be made at ``path``, so an output
    folder there would fail at its first write, after the work that was to be written.

    Args:
        path: a file system path (nothing is created).
        include_self: also look at ``path`` itself.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    path = Path(path)
    return next((p for p in ((path,) if include_self else ()) + tuple(path.parents)
                 if p.exists() and not p.is_dir()), None)
