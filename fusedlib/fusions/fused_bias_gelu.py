"""Fused bias + tanh-GeLU, Megatron-core's ``fused_bias_gelu`` on Triton kernels.

``bias_gelu_impl(input, bias)`` computes ``gelu_tanh(input + bias)`` in one pass over
memory, and its backward computes the input gradient and the bias gradient in one more.
Same names, argument order and semantics as Megatron-core; unlike Megatron-core's
``backward`` (which returns the full-size input gradient for the bias too and lets
autograd reduce it, in the input's dtype), fusedlib reduces the bias gradient over
every leading dim in float32 inside the backward kernel (two stages, deterministic).

Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py``;
Hendrycks & Gimpel, "Gaussian Error Linear Units (GELUs)", arXiv:1606.08415.
"""
from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_same_device, check_tensor, on_one_kernel_device, resolve_neg_grads
from ..kernels.bias_gelu import _bias_gelu_fwd, bias_gelu_bwd, bias_gelu_fwd
from ._apply import apply, once_differentiable

__all__ = ["bias_gelu", "bias_gelu_back", "GeLUFunction", "bias_gelu_impl"]

Tensor = torch.Tensor


def _check(y: torch.Tensor, bias: torch.Tensor, y_name: str = "input") -> torch.Tensor:
    # the happy case in one test; the checks below name what is wrong otherwise
    if (isinstance(y, Tensor) and isinstance(bias, Tensor) and y.dtype in FLOAT_DTYPES and bias.dtype == y.dtype
            and bias.dim() == 1 and y.dim() >= 1 and bias.shape[0] == y.shape[-1] and on_one_kernel_device(y, bias)):
        return bias.contiguous()  # [h]: a copy only for a strided bias (h elements)
    check_tensor(y_name, y, min_ndim=1)
    check_tensor("bias", bias, ndim=1)
    if bias.shape[0] != y.shape[-1]:
        raise ValueError(
            f"bias must have shape [h] with h = {y_name}.shape[-1] = {y.shape[-1]}, got {list(bias.shape)}"
        )
    if bias.dtype != y.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must match {y_name} dtype {y.dtype}")
    check_same_device(**{y_name: y, "bias": bias})
    return bias.contiguous()  # [h]: a copy only for a strided bias (h elements)


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused forward: ``gelu_tanh(y + bias)`` in one kernel, without autograd.

    Args:
        bias: [h], same dtype and device as ``y``.
        y: [..., h], float32 / float16 / bfloat16 (float64 too, for gradcheck), CUDA or CPU, any
            strides.

    Returns:
        A new contiguous tensor of ``y``'s shape and dtype.

    Raises:
        TypeError: non-tensor argument, unsupported dtype, or bias dtype != y dtype.
        ValueError: bias not of shape [y.shape[-1]], or tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu``).
    """
    bias = _check(y, bias, "y")
    return bias_gelu_fwd(y, bias)


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused backward: gradient of :func:`bias_gelu` w.r.t. ``y``, without autograd.

    Args:
        g: gradient of the output, [..., h], ``y``'s shape, dtype and device, any strides.
        bias: [h].
        y: [..., h], the forward input.

    Returns:
        ``gelu_tanh'(y + bias) * g``, a new contiguous tensor of ``y``'s shape and dtype.
        (The bias gradient is its sum over leading dims; :class:`GeLUFunction` gets both
        from one kernel.)

    Raises:
        TypeError, ValueError: as :func:`bias_gelu`, and for ``g`` of another shape or dtype.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu_back``).
    """
    bias = _check(y, bias, "y")
    _check_grad(g, y)
    dy, _ = bias_gelu_bwd(g, y, bias)
    return dy


def _check_grad(g: torch.Tensor, y: torch.Tensor) -> None:
    if isinstance(g, Tensor) and g.dtype == y.dtype and g.shape == y.shape and on_one_kernel_device(g, y):
        return
    check_tensor("grad_output", g, shape=tuple(y.shape))
    if g.dtype != y.dtype:
        raise TypeError(f"grad_output dtype {g.dtype} must match input dtype {y.dtype}")
    check_same_device(grad_output=g, input=y)


class GeLUFunction(torch.autograd.Function):
    """Autograd wiring of fused bias + tanh-GeLU.

    ``forward(ctx, input, bias)`` saves ``input`` and ``bias`` (not the output: the
    backward recomputes ``tanh`` from them, which costs arithmetic, not memory traffic) and
    returns ``gelu_tanh(input + bias)``. ``backward`` returns ``(d input, d bias)``: d input
    in ``input``'s dtype, d bias summed over all leading dims in float32, then cast to
    ``bias``'s dtype.

    Shapes: input [..., h] (e.g. [s, b, 4h] in a Transformer MLP), bias [h].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``GeLUFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # noqa: A002 (Megatron's name)
        # _check runs unless this call's signature passed it before (the plan's key)
        out, bias_c = _bias_gelu_fwd(input, bias, None, _check)  # [..., h] -> [..., h]
        ctx.save_for_backward(input, bias_c)
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input, bias = ctx.saved_tensors  # noqa: A001
        # autograd has already checked grad_output's shape and dtype against the output
        return bias_gelu_bwd(grad_output, input, bias)  # (d input [..., h], d bias [h])


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """``GeLUFunction.apply``: fused ``gelu_tanh(input + bias)`` with autograd.

    Args:
        input: [..., h], float32 / float16 / bfloat16 (float64 too, for gradcheck), CUDA or CPU,
            any strides.
        bias: [h], same dtype and device.

    Returns:
        A new tensor of ``input``'s shape and dtype. Its gradient keeps its limits, 1 and 0,
        up to each dtype's largest value (:func:`fusedlib.kernels.math.gelu_tanh_derivative`
        holds x² finite), where torch's tanh GeLU gives NaN past |input + bias| = ~2e19.

    Raises:
        TypeError: non-tensor argument, unsupported dtype, or mismatched dtypes.
        ValueError: bias shape not [input.shape[-1]], or tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu_impl``).
    """
    return apply(GeLUFunction, input, bias)
