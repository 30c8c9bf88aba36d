"""Fused (bias +) GEGLU, Megatron-core's ``fused_bias_geglu`` on Triton kernels.

``bias_geglu_impl(input, bias)`` computes ``gelu_tanh(y1)·y2`` with ``y1, y2 = chunk(input +
bias, 2, -1)`` in one pass over memory (bias may be None), and its backward computes the
input gradient (and the bias gradient) in one more.

Same names, argument order and semantics as Megatron-core (note ``bias_geglu(bias, y)``
takes the bias first, as Megatron's does), with the differences listed in
:mod:`fusedlib.fusions.fused_bias_swiglu`: any strides, the bias gradient reduced in
float32 inside the backward kernel, clear errors. Megatron's ``bias_geglu_impl`` has no
``fp8_input_store`` flag, and neither has this one.

Sources: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py``; Shazeer, "GLU Variants
Improve Transformer", arXiv:2002.05202; Hendrycks & Gimpel, "Gaussian Error Linear Units",
arXiv:1606.08415.
"""
from __future__ import annotations

import torch

from ._glu import (
    check_glu_bias,
    check_glu_grad,
    check_glu_input,
    glu_apply,
    glu_backward,
    glu_backward_apply,
    glu_forward,
)
from ..checks import resolve_neg_grads
from ._apply import apply, once_differentiable

__all__ = [
    "geglu",
    "bias_geglu",
    "geglu_back",
    "bias_geglu_back",
    "BiasGeGLUFunction",
    "GeGLUFunction",
    "bias_geglu_impl",
]

_ACT = "gelu_tanh"


def geglu(y: torch.Tensor) -> torch.Tensor:
    """Fused GEGLU forward, ``gelu_tanh(y1)·y2`` with ``y1, y2 = chunk(y, 2, -1)``, without autograd.

    Args:
        y: [..., 2h], float32 / float16 / bfloat16 / float64, CUDA or CPU, any strides.

    Returns:
        A new contiguous tensor [..., h] of y's dtype.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: an odd last dim.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``geglu``).
    """
    check_glu_input(y, "y")
    return glu_apply(y, None, None, _ACT)


def bias_geglu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused ``geglu(y + bias)`` without autograd (Megatron's argument order: bias, y).

    Args:
        bias: [2h], y's dtype and device.
        y: [..., 2h], any strides.

    Returns:
        A new contiguous tensor [..., h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`geglu`, and for a bias of another shape, dtype or device.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``bias_geglu``).
    """
    check_glu_input(y, "y")
    return glu_apply(y, check_glu_bias(bias, y, "y"), None, _ACT)


def geglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused GEGLU backward without autograd: ``[g·y2·gelu_tanh'(y1) | g·gelu_tanh(y1)]``.

    Args:
        g: gradient of the output, [..., h], y's dtype and device, any strides.
        y: [..., 2h], the forward input.

    Returns:
        dy, a new contiguous tensor [..., 2h] of y's dtype.

    Raises:
        TypeError, ValueError: as :func:`geglu`, and for g of another shape, dtype or device.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``geglu_back``).
    """
    check_glu_input(y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, None, None, _ACT)[0]


def bias_geglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused backward of :func:`bias_geglu` w.r.t. y, without autograd (argument order g, y, bias).

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h].

    Returns:
        dy [..., 2h] of y's dtype (the bias gradient is its sum over the leading dims).

    Raises:
        TypeError, ValueError: as :func:`bias_geglu` and :func:`geglu_back`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``bias_geglu_back``).
    """
    check_glu_input(y, "y")
    bias = check_glu_bias(bias, y, "y")
    check_glu_grad(g, y, y.shape[-1] // 2)
    return glu_backward_apply(g, y, bias, None, _ACT)[0]


class BiasGeGLUFunction(torch.autograd.Function):
    """Autograd wiring of fused bias + GEGLU.

    ``forward(ctx, input, bias)``: input [..., 2h], bias [2h] -> [..., h]; saves input and
    bias, not the output (the backward recomputes tanh). ``backward`` returns ``(d input,
    d bias)``, d bias summed over every leading dim in float32 and cast to bias's dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``BiasGeGLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # noqa: A002
        check_glu_input(input)
        return glu_forward(ctx, input, check_glu_bias(bias, input), None, _ACT)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        dy, db, _ = glu_backward(ctx, grad_output)
        return dy, db


class GeGLUFunction(torch.autograd.Function):
    """Autograd wiring of fused GEGLU without bias: ``forward(ctx, input)`` [..., 2h] -> [..., h].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``GeGLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        check_glu_input(input)
        return glu_forward(ctx, input, None, None, _ACT)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        return glu_backward(ctx, grad_output)[0]


def bias_geglu_impl(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: A002
    """Fused ``geglu(input + bias)`` with autograd; the bias-free variant when ``bias`` is None.

    Args:
        input: [s·b, 2h] or [s, b, 2h], float32 / float16 / bfloat16 / float64, CUDA or CPU,
            any strides.
        bias: [2h] of input's dtype and device, or None.

    Returns:
        [s·b, h] or [s, b, h], a new tensor of input's dtype.

    Raises:
        TypeError: non-tensor argument, unsupported dtype, or mismatched dtypes.
        ValueError: input not 2-D or 3-D, odd last dim, bias not [2h], tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``bias_geglu_impl``).
    """
    check_glu_input(input, ndim=(2, 3))
    if bias is not None:
        return apply(BiasGeGLUFunction, input, bias)
    return apply(GeGLUFunction, input)
