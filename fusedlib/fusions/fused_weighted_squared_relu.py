"""Fused row-weighted squared ReLU, Megatron-core's ``fused_weighted_squared_relu`` on Triton kernels.

``weighted_squared_relu_impl(input, weights)`` computes ``relu(input)²·weights`` (one weight
per row: the router probability of a token in a mixture-of-experts layer) in one pass over
memory, and its backward the input and weight gradients in one more. With ``clamp_scale``
s, the input is first soft-clamped, ``c = s·tanh(relu(x)/s)``, bounding the output by s².

Same names, argument order and semantics as Megatron-core, except: any strides (no
``.view``), clear errors on bad input, and the clamped forward keeps c in float32
instead of rounding it to the input's dtype before squaring (Megatron rounds it to match
its unfused path bit for bit).

Sources: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``; So et al.,
"Primer: Searching for Efficient Transformers for Language Modeling", arXiv:2109.08668.
"""
from __future__ import annotations

import numbers

import torch

from ..checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    nearest_float32,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
    type_name,
)
from ..kernels.squared_relu import weighted_squared_relu_bwd, weighted_squared_relu_fwd
from ._glu import check_row_weights
from ._apply import apply, once_differentiable

__all__ = [
    "weighted_squared_relu",
    "weighted_squared_relu_back",
    "weighted_clamped_squared_relu",
    "weighted_clamped_squared_relu_back",
    "WeightedSquaredReLUFunction",
    "weighted_squared_relu_impl",
]


Tensor = torch.Tensor

def _check(x: object, weights: object, clamp_scale: object, x_name: str = "input",
           allow_none: bool = True) -> tuple[torch.Tensor, float | None]:
    """Check the arguments; returns ``(weights, s or None)`` with s = clamp_scale rounded to the
    nearest float32 (as a Python float: the number the GPU kernels receive as their float32
    argument, so the interpreter computes float64 inputs with the same s). clamp_scale: None
    (where ``allow_none``) or a real number (numpy's too; not a bool) in float32's normal range."""
    if not (isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1):
        check_tensor(x_name, x, min_ndim=1)
    weights = check_row_weights(weights, x, x_name)
    if clamp_scale is None:
        if not allow_none:  # the clamped functions: float(None) raised an unnamed TypeError
            raise TypeError("clamp_scale must be a float > 0 (the soft clamp's scale s), got NoneType None")
        return weights, None
    if isinstance(clamp_scale, bool) or not isinstance(clamp_scale, numbers.Real):
        kind = "a float or None" if allow_none else "a float > 0"
        raise TypeError(f"clamp_scale must be {kind}, got {type_name(clamp_scale)}")
    s = real_to_float("clamp_scale", clamp_scale, "a number in float32's normal range")
    if not (FLOAT32_TINY <= s <= FLOAT32_MAX):  # also False for nan
        raise ValueError(f"clamp_scale must be a number in float32's normal range "
                         f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (the kernels divide by it in float32), "
                         f"got {clamp_scale}")
    return weights, nearest_float32(s)



def _check_grad(g: object, x: torch.Tensor) -> None:
    if isinstance(g, Tensor) and g.dtype == x.dtype and g.shape == x.shape and on_one_kernel_device(g, x):
        return
    check_tensor("grad_output", g, shape=tuple(x.shape))
    if g.dtype != x.dtype:
        raise TypeError(f"grad_output dtype {g.dtype} must match input dtype {x.dtype}")
    check_same_device(grad_output=g, input=x)


def _fwd(x: torch.Tensor, weights: torch.Tensor, clamp_scale: float | None) -> torch.Tensor:
    return weighted_squared_relu_fwd(x, weights, clamp_scale)  # [..., h] -> [..., h]


def _bwd(g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
         clamp_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return weighted_squared_relu_bwd(g, x, weights, clamp_scale)  # (dx [..., h], dw [rows, 1])


def weighted_squared_relu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Fused ``relu(x)²·weights`` in x's dtype, without autograd.

    Args:
        x: [n, h] (or [..., h] with n rows in all), float32 / float16 / bfloat16 / float64,
            CUDA or CPU, any strides.
        weights: [n, 1], any float dtype.

    Returns:
        A new contiguous tensor of x's shape and dtype; the product is formed in float32.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: weights not of shape [n, 1], or tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``.
    """
    return _fwd(x, _check(x, weights, None, "x")[0], None)


def weighted_squared_relu_back(g: torch.Tensor, x: torch.Tensor,
                               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward of :func:`weighted_squared_relu`, without autograd.

    Args:
        g: gradient of the output, x's shape, dtype and device, any strides.
        x: the forward input [..., h] with n rows. weights: [n, 1].

    Returns:
        ``(dx, dweights)``: dx = 2·relu(x)·g·w in x's dtype; dweights = the sum over h of
        relu(x)²·g, [n, 1] in weights' dtype, summed in float32.

    Raises:
        TypeError, ValueError: as :func:`weighted_squared_relu`, and for g of another shape or dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``.
    """
    weights, _ = _check(x, weights, None, "x")
    _check_grad(g, x)
    return _bwd(g, x, weights, None)


def weighted_clamped_squared_relu(x: torch.Tensor, weights: torch.Tensor, clamp_scale: float) -> torch.Tensor:
    """Fused ``(s·tanh(relu(x)/s))²·weights`` (s = ``clamp_scale`` > 0), without autograd.

    Args, Returns, Raises: as :func:`weighted_squared_relu`; clamp_scale s a real number
    (numpy's too) in float32's normal range [1.18e-38, 3.40e38], applied as the nearest float32
    number. Also TypeError for an s that is not a real number (None, a str, a bool), ValueError
    for one outside that range (nan, <= 0).

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``.
    """
    weights, s = _check(x, weights, clamp_scale, "x", allow_none=False)
    return _fwd(x, weights, s)


def weighted_clamped_squared_relu_back(g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                                       clamp_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward of :func:`weighted_clamped_squared_relu`, without autograd.

    Returns:
        ``(dx, dweights)``: dx = 2·c·(1 - tanh²(relu(x)/s))·g·w, dweights = the sum over h of c²·g.

    Raises:
        TypeError, ValueError: as :func:`weighted_squared_relu_back` and
        :func:`weighted_clamped_squared_relu` (clamp_scale).

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``.
    """
    weights, s = _check(x, weights, clamp_scale, "x", allow_none=False)
    _check_grad(g, x)
    return _bwd(g, x, weights, s)


class WeightedSquaredReLUFunction(torch.autograd.Function):
    """Autograd wiring of the fused row-weighted squared ReLU.

    ``forward(ctx, input, weights, clamp_scale)``: input [n, h] (or [..., h] with n rows),
    weights [n, 1], clamp_scale a float > 0 or None -> input's shape and dtype. Saves input
    and weights. ``backward`` returns ``(d input, d weights, None)``.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weights: torch.Tensor,  # noqa: A002
                clamp_scale: float | None) -> torch.Tensor:
        weights, clamp_scale = _check(input, weights, clamp_scale)
        ctx.save_for_backward(input, weights)
        ctx.clamp_scale = clamp_scale
        return _fwd(input, weights, clamp_scale)

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor):
        x, weights = ctx.saved_tensors
        _check_grad(grad_output, x)
        dx, dw = _bwd(grad_output, x, weights, ctx.clamp_scale)
        return dx, dw, None


def weighted_squared_relu_impl(input: torch.Tensor, weights: torch.Tensor,  # noqa: A002
                               clamp_scale: float | None = None) -> torch.Tensor:
    """Token-wise weighted squared ReLU of MoE experts, with autograd.

    Args:
        input: [n, h] or [s, b, h] with n = s·b, float32 / float16 / bfloat16 / float64,
            CUDA or CPU, any strides.
        weights: [n, 1], the router probability of each token, any float dtype.
        clamp_scale: if set (s > 0), soft-clamp first: ``c = s·tanh(relu(input)/s)``, with s
            the nearest float32 number (the GPU kernels take it as a float32 argument).

    Returns:
        ``c²·weights`` with c = relu(input) (or the clamped c), input's shape and dtype.
        Backward: d input = 2·c·c'·grad·w in input's dtype, d weights = sum over h of
        c²·grad, [n, 1] in weights' dtype (summed in float32).

    Raises:
        TypeError: non-tensor argument, unsupported dtype, clamp_scale neither None nor a real
            number (a str, a bool; numpy's numbers are accepted).
        ValueError: input not 2-D or 3-D, weights not [n, 1], clamp_scale not in float32's
            normal range [1.18e-38, 3.40e38] (nan, <= 0, or 0 / inf once in float32), tensors
            on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``
    (``weighted_squared_relu_impl``).
    """
    check_tensor("input", input, ndim=(2, 3))
    return apply(WeightedSquaredReLUFunction, input, weights, clamp_scale)
