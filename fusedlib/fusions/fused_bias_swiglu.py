"""Fused (bias +) SwiGLU and row-weighted SwiGLU, Megatron-core's ``fused_bias_swiglu`` on Triton kernels.

``bias_swiglu_impl(input, bias)`` computes ``silu(y1)·y2`` with ``y1, y2 = chunk(input + bias,
2, -1)`` in one pass over memory (bias may be None), and its backward computes the input
gradient (and the bias gradient) in one more. ``weighted_bias_swiglu_impl(input, None,
weights)`` multiplies each row by its weight (the router probability of a token routed to an
expert in a mixture-of-experts layer) and also returns the weights' gradient.

Both take Megatron-core's ``clamp_value=c``: the two halves (after the bias) are clamped
before the unit, the gate from above, ``x1 = min(x1, c)``, and the linear half to
``[-c, c]``, in float32; the gradient is zero where a clamp is active (it passes at
``|x| = c`` exactly, as Megatron's masks ``y_1 <= c`` and ``-c <= y_2 <= c`` have it). The
clamp runs inside the same kernels, a compile-time switch: ``clamp_value=None`` launches
exactly the unclamped kernels.

Same names, argument order and semantics as Megatron-core, with these differences:

* any strides: a non-contiguous input works (Megatron's ``input.view(-1, H)`` raises on
  one); 3-D inputs whose leading dims cannot be merged are copied once by ``reshape``;
* the bias gradient is reduced over rows in float32 inside the backward kernel (Megatron
  returns the full-size input gradient for the bias and lets autograd reduce it in the
  input's dtype);
* ``fp8_input_store`` is implemented as Megatron does it: the input is saved for backward
  as ``float8_e4m3fn`` (lossy; the backward then sees the rounded input) and cast back;
* bad input raises a clear error (Megatron asserts on the number of dims and fails inside
  broadcasting on a wrong shape); ``clamp_value`` must be None or a finite number > 0,
  finite in float32 (<= 3.4e38) (Megatron silently skips the clamp for ``clamp_value <= 0``);
* the clamped units compute in float32 and round once: Megatron's clamped weighted unit
  rounds ``clamped_swiglu(y)`` to y's dtype before multiplying by the weights, and casts
  float64 inputs to float32 (here float64 stays float64, with c a float32 number).

Sources: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py``; Shazeer, "GLU Variants
Improve Transformer", arXiv:2002.05202; Ramachandran et al., "Searching for Activation
Functions" (swish/SiLU), arXiv:1710.05941.
"""
from __future__ import annotations

import torch

from ._glu import (
    check_flag,
    check_glu_bias,
    check_glu_grad,
    check_clamp_value,
    check_glu_input,
    check_row_weights,
    glu_apply,
    glu_backward,
    glu_backward_apply,
    glu_forward,
)
from ..checks import resolve_neg_grads
from ._apply import apply, once_differentiable

__all__ = [
    "swiglu",
    "bias_swiglu",
    "weighted_swiglu",
    "swiglu_back",
    "bias_swiglu_back",
    "weighted_swiglu_back",
    "clamped_swiglu",
    "bias_clamped_swiglu",
    "clamped_weighted_swiglu",
    "clamped_swiglu_back",
    "bias_clamped_swiglu_back",
    "clamped_weighted_swiglu_back",
    "BiasSwiGLUFunction",
    "SwiGLUFunction",
    "WeightedSwiGLUFunction",
    "bias_swiglu_impl",
    "weighted_bias_swiglu_impl",
]

_ACT = "silu"


# ---------------------------------------------------------------- plain functions, no autograd


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU forward, ``silu(y1)·y2`` with ``y1, y2 = chunk(y, 2, -1)``, without autograd.

    Args:
        y: [..., 2h], float32 / float16 / bfloat16 / float64, CUDA or CPU, any strides.

    Returns:
        A new contiguous tensor [..., h] of y's dtype.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: an odd last dim.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu``).
    """
    check_glu_input(y, "y")
    return glu_apply(y, None, None, _ACT)


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused ``swiglu(y + bias)`` without autograd (Megatron's argument order: y, bias).

    Args:
        y: [..., 2h], float32 / float16 / bfloat16 / float64, any strides.
        bias: [2h], y's dtype and device.

    Returns:
        A new contiguous tensor [..., h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`swiglu`, and for a bias of another shape, dtype or device.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu``).
    """
    check_glu_input(y, "y")
    return glu_apply(y, check_glu_bias(bias, y, "y"), None, _ACT)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Fused row-weighted SwiGLU, ``swiglu(y)·weights`` in y's dtype, without autograd.

    Args:
        y: [n, 2h] (or [..., 2h] with n rows in all), any strides.
        weights: [n, 1], any float dtype (float32 router probabilities in Megatron's MoE).

    Returns:
        A new contiguous tensor [..., h] of y's dtype; the product is formed in float32.

    Raises:
        TypeError, ValueError: as :func:`swiglu`, and for weights not of shape [n, 1].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``weighted_swiglu``).
    """
    check_glu_input(y, "y")
    return glu_apply(y, None, check_row_weights(weights, y, "y"), _ACT)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU backward without autograd: ``[g·y2·silu'(y1) | g·silu(y1)]``.

    Args:
        g: gradient of the output, [..., h], y's dtype and device, any strides.
        y: [..., 2h], the forward input.

    Returns:
        dy, a new contiguous tensor [..., 2h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`swiglu`, and for g of another shape, dtype or device.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu_back``).
    """
    check_glu_input(y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, None, None, _ACT)[0]


def bias_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused backward of :func:`bias_swiglu` w.r.t. y, without autograd.

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h].

    Returns:
        dy [..., 2h] of y's dtype. (The bias gradient is its sum over the leading dims;
        :class:`BiasSwiGLUFunction` gets both from one kernel.)

    Raises:
        TypeError, ValueError: as :func:`bias_swiglu` and :func:`swiglu_back`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu_back``).
    """
    check_glu_input(y, "y")
    bias = check_glu_bias(bias, y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, bias, None, _ACT)[0]


def weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward of :func:`weighted_swiglu`, without autograd.

    Args:
        g: [..., h]. y: [..., 2h] with n rows. weights: [n, 1].

    Returns:
        ``(dy, dweights)``: dy = swiglu_back(g·w, y), [..., 2h] in y's dtype; dweights =
        the sum over h of swiglu(y)·g, [n, 1] in weights' dtype, summed in float32.

    Raises:
        TypeError, ValueError: as :func:`weighted_swiglu` and :func:`swiglu_back`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``weighted_swiglu_back``).
    """
    check_glu_input(y, "y")
    weights = check_row_weights(weights, y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    dy, _, dw = glu_backward_apply(g, y, None, weights, _ACT)
    return dy, dw


def clamped_swiglu(y: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Fused clamped SwiGLU, ``silu(min(y1, c))·clamp(y2, -c, c)``, without autograd.

    Args:
        y: [..., 2h], float32 / float16 / bfloat16 / float64, any strides.
        clamp_value: c, a finite number > 0 (applied as a float32 number).

    Returns:
        A new contiguous tensor [..., h] of y's dtype, computed in float32 (float64 for
        float64) and rounded once.

    Raises:
        TypeError, ValueError: as :func:`swiglu`, and for a clamp_value that is not a finite number > 0
            (at most float32's max).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_swiglu``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    return glu_apply(y, None, None, _ACT, c)


def bias_clamped_swiglu(y: torch.Tensor, bias: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Fused ``clamped_swiglu(y + bias, clamp_value)`` (the clamps act after the bias), without autograd.

    Args:
        y: [..., 2h]. bias: [2h], y's dtype and device. clamp_value: c > 0, finite.

    Returns:
        A new contiguous tensor [..., h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`bias_swiglu` and :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_clamped_swiglu``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    return glu_apply(y, check_glu_bias(bias, y, "y"), None, _ACT, c)


def clamped_weighted_swiglu(y: torch.Tensor, weights: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Fused ``clamped_swiglu(y, clamp_value)·weights`` in y's dtype, without autograd.

    Args:
        y: [n, 2h] (or [..., 2h] with n rows). weights: [n, 1], any float dtype.
        clamp_value: c > 0, finite.

    Returns:
        A new contiguous tensor [..., h] of y's dtype; the product is formed in float32 and
        rounded once (Megatron rounds the clamped unit to y's dtype first).

    Raises:
        TypeError, ValueError: as :func:`weighted_swiglu` and :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_weighted_swiglu``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    return glu_apply(y, None, check_row_weights(weights, y, "y"), _ACT, c)


def clamped_swiglu_back(g: torch.Tensor, y: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Fused backward of :func:`clamped_swiglu` w.r.t. the unclamped y, without autograd.

    With x1 = min(y1, c) and x2 = clamp(y2, -c, c): ``dy1 = g·x2·silu'(x1)`` where y1 <= c, else
    0; ``dy2 = g·silu(x1)`` where -c <= y2 <= c, else 0.

    Args:
        g: [..., h], y's dtype and device. y: [..., 2h]. clamp_value: c > 0, finite.

    Returns:
        dy, a new contiguous tensor [..., 2h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`swiglu_back` and :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_swiglu_back``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, None, None, _ACT, c)[0]


def bias_clamped_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Fused backward of :func:`bias_clamped_swiglu` w.r.t. y, without autograd.

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h]. clamp_value: c > 0, finite.

    Returns:
        dy [..., 2h] of y's dtype (the bias gradient is its sum over the leading dims).

    Raises:
        TypeError, ValueError: as :func:`bias_swiglu_back` and :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_clamped_swiglu_back``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    bias = check_glu_bias(bias, y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, bias, None, _ACT, c)[0]


def clamped_weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                                 clamp_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward of :func:`clamped_weighted_swiglu`, without autograd.

    Args:
        g: [..., h]. y: [..., 2h] with n rows. weights: [n, 1]. clamp_value: c > 0, finite.

    Returns:
        ``(dy, dweights)``: dy = clamped_swiglu_back(g·w, y, c), [..., 2h] in y's dtype;
        dweights = the sum over h of clamped_swiglu(y, c)·g, [n, 1] in weights' dtype,
        summed in float32.

    Raises:
        TypeError, ValueError: as :func:`weighted_swiglu_back` and :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_weighted_swiglu_back``).
    """
    c = check_clamp_value(clamp_value, allow_none=False)
    check_glu_input(y, "y")
    weights = check_row_weights(weights, y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    dy, _, dw = glu_backward_apply(g, y, None, weights, _ACT, c)
    return dy, dw


# ---------------------------------------------------------------- autograd


class BiasSwiGLUFunction(torch.autograd.Function):
    """Autograd wiring of fused bias + SwiGLU (clamped with ``clamp_value``).

    ``forward(ctx, input, bias, fp8_input_store, cpu_offload_input, clamp_value=None)``:
    input [..., 2h], bias [2h] -> [..., h]; saves input (float8_e4m3fn if ``fp8_input_store``)
    and bias, not the output. ``clamp_value``: None, or c > 0 for Megatron's clamps of the two
    halves of ``input + bias`` (see :func:`bias_swiglu_impl`); it may be left out, as older
    Megatron versions call ``apply`` with four arguments. ``backward`` returns ``(d input,
    d bias, None, None, None)``: d input in input's dtype, d bias summed over every leading
    dim in float32 and cast to bias's dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``BiasSwiGLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: torch.Tensor, fp8_input_store: bool,  # noqa: A002
                cpu_offload_input: bool, clamp_value: float | None = None) -> torch.Tensor:
        c = check_clamp_value(clamp_value)
        check_glu_input(input)
        bias = check_glu_bias(bias, input)
        return glu_forward(ctx, input, bias, None, _ACT, check_flag("fp8_input_store", fp8_input_store),
                           check_flag("cpu_offload_input", cpu_offload_input), c)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        dy, db, _ = glu_backward(ctx, grad_output)
        return dy, db, None, None, None  # (a trailing None for an omitted clamp_value is ignored)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wiring of fused SwiGLU without bias (clamped with ``clamp_value``).

    ``forward(ctx, input, fp8_input_store, cpu_offload_input, clamp_value=None)``: input
    [..., 2h] -> [..., h]; ``backward`` returns ``(d input, None, None, None)``.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``SwiGLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, fp8_input_store: bool, cpu_offload_input: bool,  # noqa: A002
                clamp_value: float | None = None) -> torch.Tensor:
        c = check_clamp_value(clamp_value)
        check_glu_input(input)
        return glu_forward(ctx, input, None, None, _ACT, check_flag("fp8_input_store", fp8_input_store),
                           check_flag("cpu_offload_input", cpu_offload_input), c)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        dy, _, _ = glu_backward(ctx, grad_output)
        return dy, None, None, None


class WeightedSwiGLUFunction(torch.autograd.Function):
    """Autograd wiring of fused row-weighted SwiGLU (MoE experts).

    ``forward(ctx, input, weights, fp8_input_store, clamp_value=None)``: input [n, 2h] (or
    [..., 2h] with n rows), weights [n, 1] -> [..., h] in input's dtype. ``backward`` returns
    ``(d input, d weights, None, None)``: d weights = sum over h of swiglu(input)·grad_output
    (of the clamped unit when clamped), in weights' dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``WeightedSwiGLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weights: torch.Tensor, fp8_input_store: bool,  # noqa: A002
                clamp_value: float | None = None) -> torch.Tensor:
        c = check_clamp_value(clamp_value)
        check_glu_input(input)
        weights = check_row_weights(weights, input)
        return glu_forward(ctx, input, None, weights, _ACT, check_flag("fp8_input_store", fp8_input_store),
                           clamp_value=c)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        dy, _, dw = glu_backward(ctx, grad_output)
        return dy, dw, None, None


# ---------------------------------------------------------------- entry points


def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,  # noqa: A002
                     cpu_offload_input: bool = False, clamp_value: float | None = None) -> torch.Tensor:
    """Fused ``swiglu(input + bias)`` with autograd; the bias-free variant when ``bias`` is None.

    Args:
        input: [s·b, 2h] or [s, b, 2h] (e.g. the output of an MLP's fc1 with gated linear
            units), float32 / float16 / bfloat16 / float64, CUDA or CPU, any strides.
        bias: [2h] of input's dtype and device, or None.
        fp8_input_store: save the input for backward as float8_e4m3fn (half the activation
            memory, a lossy copy: the backward sees the rounded input), as in Megatron.
        cpu_offload_input: tag the saved tensors ``activation_offloading = True``, as in Megatron.
        clamp_value: None (no clamp: exactly the unclamped kernels), or c > 0 (a finite
            number, applied as float32): with x = input + bias split into x1, x2, compute
            ``silu(min(x1, c))·clamp(x2, -c, c)``; the gradient is zero where x1 > c or
            |x2| > c (it passes at x1 = c and |x2| = c). Megatron's
            ``TransformerConfig.activation_func_clamp_value``.

    Returns:
        [s·b, h] or [s, b, h], a new tensor of input's dtype.

    Raises:
        TypeError: non-tensor argument, unsupported dtype, mismatched dtypes, non-bool flag,
            clamp_value not a number.
        ValueError: input not 2-D or 3-D, odd last dim, bias not [2h], tensors on different
            devices, clamp_value not finite, <= 0 or above float32's max (inf in the kernels'
            float32).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu_impl``).
    """
    check_glu_input(input, ndim=(2, 3))
    clamp_value = check_clamp_value(clamp_value)
    if bias is not None:
        return apply(BiasSwiGLUFunction, input, bias, fp8_input_store, cpu_offload_input, clamp_value)
    return apply(SwiGLUFunction, input, fp8_input_store, cpu_offload_input, clamp_value)


def weighted_bias_swiglu_impl(input: torch.Tensor, bias: None, weights: torch.Tensor,  # noqa: A002
                              fp8_input_store: bool = False, clamp_value: float | None = None) -> torch.Tensor:
    """Token-wise weighted SwiGLU of MoE experts, ``swiglu(input)·weights``, with autograd.

    Args:
        input: [n, 2h] or [s, b, 2h] with n = s·b (tokens routed to this expert), any strides.
        bias: must be None (as in Megatron: no bias for the weighted fusion).
        weights: [n, 1], the router probability of each token, any float dtype.
        fp8_input_store: as in :func:`bias_swiglu_impl`.
        clamp_value: as in :func:`bias_swiglu_impl`: None, or c > 0 to clamp the two halves
            of input before the unit (the weights are not clamped).

    Returns:
        [n, h] or [s, b, h] in input's dtype. Its backward gives d weights = sum over h of
        swiglu(input)·grad_output (the clamped unit when clamped), [n, 1] in weights' dtype
        (summed in float32).

    Raises:
        NotImplementedError: ``bias`` is not None (Megatron's message).
        TypeError, ValueError: as :func:`bias_swiglu_impl`, and for weights not of shape [n, 1].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``weighted_bias_swiglu_impl``).
    """
    check_glu_input(input, ndim=(2, 3))
    if bias is not None:
        raise NotImplementedError("Bias is not supported for weighted swiglu fusion")
    return apply(WeightedSwiGLUFunction, input, weights, fp8_input_store, check_clamp_value(clamp_value))
