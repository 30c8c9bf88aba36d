"""Fused bias + dropout + residual add, Megatron-core's ``fused_bias_dropout`` on Triton kernels.

``out = residual + dropout(x + bias, p)`` in one pass over memory: the forward reads x
and residual and writes out; the dropout mask is drawn inside the kernel with Philox and
is never written, because the backward regenerates it from the same seed.

Same names, signatures and semantics as Megatron-core:

* ``get_bias_dropout_add(training, fused)`` returns ``f(x_with_bias, residual, prob)``,
  with ``x_with_bias = (x, bias)`` (bias may be None), as a linear layer returns them.
* ``bias_dropout_add_fused_train`` / ``bias_dropout_add_fused_inference``: Megatron's two
  ``jit_fuser`` functions, here two settings of one Triton kernel (with and without the
  random numbers: ``training`` selects a compile-time constant).
* ``bias_dropout_add_unfused(training)``: plain PyTorch, :func:`_bias_dropout_add_func`
  (Megatron's name for the unfused function, which its unit tests import).

Semantics, as Megatron-core's ``_bias_dropout_add_func``:

* dtypes: the output has the residual's dtype (``fp32_residual_connection``: x bf16,
  residual fp32 -> out fp32); x.grad keeps x's dtype, residual.grad the residual's.
* inference (``training=False``) with no input requiring grad and x of the residual's
  dtype: the result is written into x and *is* x (same tensor, same storage).

Beyond Megatron-core: the bias gradient is reduced over every leading dim in float32 in
the backward kernel (two stages, deterministic), and inputs are checked with clear errors.

Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``; Srivastava et al.,
"Dropout: a simple way to prevent neural networks from overfitting" (JMLR 2014).
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .. import unfused
from ..checks import (
    ArgumentTypeError,
    FLOAT_DTYPES,
    check_bool,
    check_same_device,
    check_tensor,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
    type_name,
)
from ..kernels.bias_dropout_add import _bias_dropout_add_fwd_checked, bias_dropout_add_bwd, bias_dropout_add_fwd
from ._apply import apply, in_transform

__all__ = [
    "BiasDropoutAddFunction",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_unfused",
    "get_bias_dropout_add",
]

XWithBias = Tuple[torch.Tensor, Optional[torch.Tensor]]
Tensor = torch.Tensor


def _check_prob(prob: object) -> float:
    if isinstance(prob, bool) or not isinstance(prob, numbers.Real):
        # a TypeError that is also the ValueError this check has always raised
        why = (" (reading a tensor's value would synchronise with its device: pass float(prob) once, outside "
               "the step)" if isinstance(prob, torch.Tensor) else "")
        raise ArgumentTypeError(f"prob must be a dropout probability in [0, 1] given as a Python float, got "
                                f"{type_name(prob)}{why}")
    p = real_to_float("prob", prob, "a dropout probability in [0, 1]")
    if not 0.0 <= p <= 1.0:  # NaN fails this too
        raise ValueError(f"prob must be a dropout probability in [0, 1], got {prob!r}")
    return p


def _happy(x_with_bias: object, residual: object, prob: object) -> bool:
    """The common case of :func:`_check` in one cheap test (no message, no raise)."""
    if not (isinstance(x_with_bias, (tuple, list)) and len(x_with_bias) == 2):
        return False
    x, bias = x_with_bias
    if not (isinstance(x, Tensor) and isinstance(residual, Tensor) and x.dtype in FLOAT_DTYPES
            and residual.dtype in FLOAT_DTYPES and x.dim() >= 1 and residual.shape == x.shape
            and type(prob) is float and 0.0 <= prob <= 1.0):
        return False
    if bias is None:
        return on_one_kernel_device(x, residual)
    return (isinstance(bias, Tensor) and bias.dtype in FLOAT_DTYPES and bias.dim() == 1
            and bias.shape[0] == x.shape[-1] and on_one_kernel_device(x, bias, residual))


def _check(x_with_bias: object, residual: object, prob: object, bias_name: str = "bias"
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, float]:
    """Unpack and check Megatron's arguments; returns (x, bias, residual, p). ``bias_name``: what
    the errors call the bias (another op may have a second bias of its own)."""
    if _happy(x_with_bias, residual, prob):
        return x_with_bias[0], x_with_bias[1], residual, prob
    if not isinstance(x_with_bias, (tuple, list)) or len(x_with_bias) != 2:
        raise TypeError(f"x_with_bias must be a pair (x, bias) with bias a tensor or None, got {type(x_with_bias).__name__}"
                        + (f" of length {len(x_with_bias)}" if isinstance(x_with_bias, (tuple, list)) else ""))
    x, bias = x_with_bias
    check_tensor("x", x, min_ndim=1)
    check_tensor("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    if bias is not None:
        check_tensor(bias_name, bias, ndim=1)
        if bias.shape[0] != x.shape[-1]:
            raise ValueError(f"{bias_name} must have shape [h] with h = x.shape[-1] = {x.shape[-1]}, "
                             f"got {list(bias.shape)}")
    check_same_device(**{"x": x, bias_name: bias, "residual": residual})
    return x, bias, residual, _check_prob(prob)


class BiasDropoutAddFunction(torch.autograd.Function):
    """Autograd wiring of fused ``residual + dropout(x + bias, p)``.

    ``forward(ctx, x, bias, residual, prob, training)`` checks its arguments (as
    :func:`bias_dropout_add_fused_train`, for a call signature that has not passed the check
    before: the launch plan's key holds all it reads), draws a Philox seed from torch's
    generator (only when ``training`` and p > 0, for a non-empty x whose elements are not all
    dropped; after the check, so a refused call draws no random numbers), launches one kernel,
    and saves the seed: 8 bytes, where torch's dropout saves a mask of one byte per element.
    ``backward`` regenerates the mask from the seed and returns ``(dx, dbias, dresidual, None,
    None)``: dx = g·mask/(1-p') in x's dtype (p' the applied probability, see below), dbias its
    float32 sum over leading dims in bias's dtype (None when bias is None or needs no grad),
    dresidual = g itself (the residual's dtype, as out's).

    Shapes: x, residual [..., h] (e.g. [s, b, h], h = 0 allowed: empty results); bias [h] or None.
    prob is applied as p' = round(prob·2^16)/2^16 and kept values scaled by 1/(1 - p').

    Raises:
        TypeError, ValueError: as :func:`bias_dropout_add_fused_train`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                training: bool) -> torch.Tensor:
        # _check runs unless this call's signature passed it before (the plan's key); then the
        # seed is drawn (training and p > 0) and one kernel writes out [..., h], the residual's dtype
        if training is not True and training is not False:
            training = check_bool("training", training)
        out, seed, _, p = _bias_dropout_add_fwd_checked(x, bias, residual, prob, training, _check)
        if seed is not None:
            ctx.save_for_backward(seed)
        ctx.dropout, ctx.prob, ctx.x_dtype = seed is not None, p, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        seed = ctx.saved_tensors[0] if ctx.dropout else None
        need_dx, need_db, need_dr = ctx.needs_input_grad[:3]
        # dx: [..., h] of x's dtype, or grad_output itself when nothing was dropped and x has
        # out's dtype (as for a plain add); db: [h] of bias's dtype, summed in float32
        dx, db = bias_dropout_add_bwd(grad_output, ctx.x_dtype, seed, ctx.prob, need_dx=need_dx, need_dbias=need_db,
                                      db_dtype=ctx.bias_dtype)
        return dx, db, (grad_output if need_dr else None), None, None


def _writable_in_place(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> bool:
    """Whether inference may write the sum into x itself: not inside a ``torch.func`` transform
    or a forward-AD level (a write through the kernel would drop the tangents), not an
    inference tensor outside inference mode (torch forbids writing it), and no read operand in
    x's memory but the residual as the very same view (elementwise, each element read before
    it is written; a bias row of x, or x's transpose as the residual, would be read after the
    kernel overwrote it)."""
    if in_transform():
        return False
    if x.numel() == 0 or torch.compiler.is_compiling():
        # (under torch.compile the kernel's write to x is functionalized: the graph computes
        # from its inputs' values and copies the result into x after; Dynamo can trace
        # neither is_inference nor storage pointers)
        return True
    if x.is_inference() and not torch.is_inference_mode_enabled():
        return False
    x_mem = x.untyped_storage().data_ptr()
    if bias is not None and bias.numel() and bias.untyped_storage().data_ptr() == x_mem:
        return False
    if residual.untyped_storage().data_ptr() != x_mem:
        return True
    return (residual.data_ptr() == x.data_ptr() and residual.shape == x.shape
            and residual.stride() == x.stride())


def _elements_share_memory(x: torch.Tensor) -> bool:
    """Whether two of x's elements lie at one address (an expanded tensor, stride 0, or an
    ``as_strided`` view whose rows overlap), so that x cannot hold a result per element.

    Strides sorted ascending, each beyond the furthest offset the smaller ones reach, prove
    every element distinct (every layout torch makes by slicing, transposing or permuting);
    otherwise the offsets themselves are compared (one int64 per element)."""
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    span = 1 + sum(st * (n - 1) for st, n in zip(x.stride(), x.shape))
    offsets = torch.arange(span, device="cpu", dtype=torch.int64).as_strided(x.shape, x.stride())
    return offsets.unique().numel() < x.numel()


def _fused(x_with_bias: XWithBias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    if training and isinstance(x_with_bias, (tuple, list)) and len(x_with_bias) == 2 and not in_transform():
        # never in place: the Function's forward checks the arguments (once per signature); inside
        # a torch.func transform or forward AD torch refuses the Function first, so check here then
        return apply(BiasDropoutAddFunction, x_with_bias[0], x_with_bias[1], residual, prob, True)
    x, bias, residual, p = _check(x_with_bias, residual, prob)
    inplace = (not training and not x.requires_grad and not residual.requires_grad
               and (bias is None or not bias.requires_grad) and x.dtype == residual.dtype
               and _writable_in_place(x, bias, residual))
    if not inplace:
        return apply(BiasDropoutAddFunction, x, bias, residual, p, training)
    # Inference, nothing needs grad: write the result into x and return x itself, as
    # Megatron's x.add_(bias); out.add_(residual). No seed, no random numbers.
    if not x.is_contiguous() and _elements_share_memory(x):
        raise ValueError(f"x is written in place in inference, but its strides {x.stride()} make several "
                         "elements share memory (an expanded or overlapping view): pass x.contiguous()")
    b = bias.contiguous() if bias is not None else None
    try:
        x2d = x.view(math.prod(x.shape[:-1]), x.shape[-1])  # [..., h] -> [rows, h] without a copy, or raise
    except RuntimeError:
        x.copy_(bias_dropout_add_fwd(x, b, residual, None, p))
        return x
    bias_dropout_add_fwd(x2d, b, residual, None, p, out=x2d)
    # x changed in place: let autograd's checks see it (inference tensors keep no version counter
    # in some torch versions). Not while torch.compile traces: it records the kernel's write to x
    # itself, and cannot trace is_inference().
    if not torch.compiler.is_compiling() and not x.is_inference():
        torch.autograd.graph.increment_version(x)
    return x


def bias_dropout_add_fused_train(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    """Fused ``residual + dropout(x + bias, prob)`` in training mode, with autograd.

    Args:
        x_with_bias: ``(x, bias)``: x [..., h] (e.g. [s, b, h]) float32/float16/bfloat16
            (float64 too, for gradcheck), any strides; bias [h] or None, any float dtype.
        residual: [..., h], x's shape, any float dtype (float32 with ``fp32_residual_connection``).
        prob: dropout probability in [0, 1] (Megatron's ``hidden_dropout``).

    Returns:
        A new tensor of x's shape and the residual's dtype. The mask comes from Philox
        seeded by torch's generator on x's device: ``torch.manual_seed`` reproduces it.

    Dropout resolution: the drop probability is applied with 16-bit resolution, p' =
    round(p·2^16)/2^16 (exact for p = 0, 0.5, 1; within 2^-17 = 7.6e-6 of p otherwise;
    every p > 1 - 2^-17 drops everything), and kept values are scaled by 1/(1 - p'), so
    that E[out] = residual + x + bias exactly (torch's dropout: p and 1/(1 - p)). As in
    torch's dropout the value is multiplied by the mask, so a dropped element is 0 where
    x + bias is finite and NaN where it is NaN or ±inf (0·inf = NaN), and a NaN grad_output
    gives a NaN gradient whether the element was kept or dropped: a NaN is never hidden.

    Raises:
        TypeError: non-tensor, unsupported dtype, or x_with_bias not a pair; prob not a real
            number (a str, a bool, a tensor: a Python float is expected), raised as
            :class:`~fusedlib.checks.ArgumentTypeError`, which is a ValueError too.
        ValueError: prob outside [0, 1]; residual shape != x shape; bias not [h];
            tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``bias_dropout_add_fused_train``).
    """
    return _fused(x_with_bias, residual, prob, training=True)


def bias_dropout_add_fused_inference(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    """Fused ``residual + x + bias`` in inference mode (dropout is the identity).

    Args:
        x_with_bias, residual, prob: as :func:`bias_dropout_add_fused_train` (prob is
            still checked, as ``torch.nn.functional.dropout`` checks it).

    Returns:
        When no input requires grad and x has the residual's dtype: **x itself**, overwritten
        with the result (no new memory; Megatron's in-place inference path). Otherwise a new
        tensor of x's shape and the residual's dtype, with autograd; also, x left unchanged,
        where x cannot be written in place: inside a ``torch.func`` transform or a forward-AD
        level, for an inference tensor outside ``torch.inference_mode``, and when the bias
        lies in x's memory or the residual does as anything but x's very view.

    Raises:
        TypeError, ValueError: as :func:`bias_dropout_add_fused_train`, and ValueError for an
            in-place x whose elements share memory (stride 0, or an ``as_strided`` view whose
            rows overlap).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``bias_dropout_add_fused_inference``).
    """
    return _fused(x_with_bias, residual, prob, training=False)


def _bias_dropout_add_func(x_with_bias: XWithBias, residual: torch.Tensor, prob: float,
                           training: bool) -> torch.Tensor:
    """Megatron-core's unfused bias-dropout-add, ``residual + dropout(x + bias, prob)``: three eager kernels.

    The function behind :func:`bias_dropout_add_unfused` (and, in Megatron-core, behind the
    ``jit_fuser``-compiled train and inference functions), with Megatron's name and
    signature; it computes :func:`fusedlib.unfused.bias_dropout_add`.

    Args:
        x_with_bias: ``(x, bias)`` as a linear layer returns them: x [..., h] (e.g. [s, b, h]),
            any float dtype; bias [h] (broadcast against x) or None.
        residual: [..., h] (broadcastable with x), any float dtype.
        prob: dropout probability in [0, 1] (Megatron's ``hidden_dropout``).
        training: dropout on (``torch.nn.functional.dropout`` with torch's generator: its mask
            is saved for the backward), or the identity.

    Returns:
        ``residual + dropout(x + bias)`` in the residual's dtype: when x (or bias) has another
        dtype (``fp32_residual_connection``: x bf16, residual fp32) it is cast to the
        residual's first, so the residual stream keeps its precision, as current Megatron-core
        does (megatron-core 0.16 and earlier cast the residual to x's dtype instead). In
        inference (``training=False``) with no input requiring grad and x of the residual's
        dtype, the sum is computed in place: the result *is* x, overwritten.

    Raises:
        TypeError: x_with_bias not a pair, x or residual not a tensor, training not a bool;
            prob not a real number (as :func:`bias_dropout_add_fused_train`).
        ValueError: prob outside [0, 1].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``_bias_dropout_add_func``).
    """
    if not isinstance(x_with_bias, (tuple, list)) or len(x_with_bias) != 2:
        raise TypeError("x_with_bias must be a pair (x, bias) with bias a tensor or None, "
                        f"got {type(x_with_bias).__name__}")
    x, bias = x_with_bias
    for name, t in (("x", x), ("residual", residual)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if training is not True and training is not False:
        training = check_bool("training", training)  # (numpy's bool accepted, as get_bias_dropout_add)
    return unfused.bias_dropout_add((x, bias), residual, _check_prob(prob), training)


def bias_dropout_add_unfused(training: bool) -> Callable[[XWithBias, torch.Tensor, float], torch.Tensor]:
    """Plain-PyTorch bias-dropout-add for ``training`` mode: three eager kernels.

    Args:
        training: dropout on (True) or the identity (False); a bool (numpy's bool accepted).

    Returns:
        ``f(x_with_bias, residual, prob)`` calling :func:`_bias_dropout_add_func` (in place in
        inference without grads).

    Raises:
        TypeError: training not a bool, here rather than at the returned function's first call.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``bias_dropout_add_unfused``).
    """
    if training is not True and training is not False:
        training = check_bool("training", training)

    def _bias_dropout_add(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        return _bias_dropout_add_func(x_with_bias, residual, prob, training)

    return _bias_dropout_add


def get_bias_dropout_add(training: bool, fused: bool) -> Callable[[XWithBias, torch.Tensor, float], torch.Tensor]:
    """Megatron's selector: the bias-dropout-add function for a mode and a fusion switch.

    Args:
        training: the module's ``self.training``.
        fused: ``TransformerConfig.bias_dropout_fusion``.

    Returns:
        :func:`bias_dropout_add_fused_train` or :func:`bias_dropout_add_fused_inference` when
        ``fused``, else ``bias_dropout_add_unfused(training)``. In inference, where no input
        requires grad and x has the residual's dtype, both the fused and the unfused function
        write the result into ``x`` and return it (Megatron's in-place inference path): pass a
        copy of x to keep it.

    The fused functions apply the drop probability with 16-bit resolution (p rounded to a
    multiple of 1/65536, exact for 0, 0.5, 1) and scale kept values by 1/(1 - p_rounded),
    so the expectation is exact: see :func:`bias_dropout_add_fused_train`.

    Raises:
        TypeError: training or fused not a bool (numpy's bool is accepted); a str ``"False"``
            was read as True.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``get_bias_dropout_add``).
    """
    if training is not True and training is not False:
        training = check_bool("training", training)
    if fused is not True and fused is not False:
        fused = check_bool("fused", fused)
    if fused:
        # Two functions, not one with a flag: Megatron's torch.jit.script fuser did not fuse
        # an nn.Module's dropout, and the mode must be a compile-time constant for the fused
        # kernel (here: DROPOUT, a tl.constexpr; inference compiles no random numbers).
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)
