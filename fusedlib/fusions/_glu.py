"""Input checks and autograd plumbing shared by the GEGLU and SwiGLU fusions.

``fused_bias_geglu`` and ``fused_bias_swiglu`` differ only in the activation of the gate
(``"gelu_tanh"`` or ``"silu"``), so their ``torch.autograd.Function`` classes share
:func:`glu_forward` and :func:`glu_backward` here. Not public API.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_DTYPES,
    SUPPORTED_FLOAT_DTYPES,
    check_bool,
    check_same_device,
    check_tensor,
    is_dense,
    nearest_float32,
    on_one_kernel_device,
    real_to_float,
)
from ..kernels.glu import glu_bwd, glu_fwd
from ._apply import keep_graph_anchor

__all__ = ["check_glu_input", "check_glu_bias", "check_row_weights", "check_glu_grad", "check_flag",
           "check_clamp_value", "glu_apply", "glu_backward_apply", "glu_forward", "glu_backward", "FP8_STORE_DTYPE"]

#: The dtype Megatron's ``fp8_input_store`` keeps the saved input in between forward and backward.
FP8_STORE_DTYPE = torch.float8_e4m3fn

Tensor = torch.Tensor


def check_glu_input(y: object, name: str = "input", ndim: tuple[int, ...] | None = None) -> torch.Tensor:
    """Check a GLU input [..., 2h]: a float tensor whose last dim is even.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: wrong number of dims, or an odd last dim.
    """
    # the happy case in one test; the checks below name what is wrong otherwise
    if (isinstance(y, Tensor) and y.dtype in FLOAT_DTYPES and y.dim() >= 1 and (ndim is None or y.dim() in ndim)
            and y.shape[-1] % 2 == 0 and is_dense(y)):
        return y
    check_tensor(name, y, min_ndim=1, ndim=ndim)
    if y.shape[-1] % 2 != 0:
        raise ValueError(
            f"{name}.shape[-1] must be even (the two halves y1, y2 = chunk({name}, 2, -1) have one width), "
            f"got shape {list(y.shape)}"
        )
    return y


def check_glu_bias(bias: object, y: torch.Tensor, y_name: str = "input") -> torch.Tensor:
    """Check a bias [2h] against the input [..., 2h]; return it contiguous (a copy only if strided).

    Raises:
        TypeError: not a tensor, or a dtype other than y's.
        ValueError: shape not [y.shape[-1]], or another device.
    """
    if (isinstance(bias, Tensor) and bias.dtype == y.dtype and bias.dim() == 1 and bias.shape[0] == y.shape[-1]
            and on_one_kernel_device(y, bias)):
        return bias.contiguous()
    check_tensor("bias", bias, ndim=1)
    if bias.shape[0] != y.shape[-1]:
        raise ValueError(
            f"bias must have shape [2h] with 2h = {y_name}.shape[-1] = {y.shape[-1]}, got {list(bias.shape)}"
        )
    if bias.dtype != y.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must match {y_name} dtype {y.dtype}")
    check_same_device(**{y_name: y, "bias": bias})
    return bias.contiguous()


def check_row_weights(weights: object, y: torch.Tensor, y_name: str = "input") -> torch.Tensor:
    """Check per-row weights [n, 1] against the input [..., k], n = the number of rows of y
    (the product of its leading dims).

    Raises:
        TypeError: not a tensor, or not a float dtype.
        ValueError: shape not [n, 1], or another device.
    """
    n_rows = math.prod(y.shape[:-1])
    if (isinstance(weights, Tensor) and weights.dtype in FLOAT_DTYPES and weights.dim() == 2
            and weights.shape[0] == n_rows and weights.shape[1] == 1 and on_one_kernel_device(y, weights)):
        return weights
    check_tensor("weights", weights, dtypes=SUPPORTED_FLOAT_DTYPES)
    if weights.dim() != 2 or weights.shape[0] != n_rows or weights.shape[1] != 1:
        raise ValueError(
            f"weights must have shape [n, 1] with n = {n_rows} rows of {y_name} (shape {list(y.shape)}), "
            f"got {list(weights.shape)}"
        )
    check_same_device(**{y_name: y, "weights": weights})
    return weights


def check_glu_grad(g: object, y: torch.Tensor, out_cols: int) -> torch.Tensor:
    """Check grad_output [..., out_cols] against the input [..., k]: same leading dims, dtype, device."""
    if (isinstance(g, Tensor) and g.dtype == y.dtype and g.dim() == y.dim() and g.shape[-1] == out_cols
            and g.shape[:-1] == y.shape[:-1] and on_one_kernel_device(g, y)):
        return g
    check_tensor("grad_output", g, shape=tuple(y.shape[:-1]) + (out_cols,))
    if g.dtype != y.dtype:
        raise TypeError(f"grad_output dtype {g.dtype} must match input dtype {y.dtype}")
    check_same_device(grad_output=g, input=y)
    return g


def check_flag(name: str, value: object) -> bool:
    """Check a boolean switch such as ``fp8_input_store``; numpy's bool is accepted (as a bool).

    Raises:
        TypeError: ``value`` is not a bool; the message names its type (``numpy.int64``, not ``int``).
    """
    return check_bool(name, value)


def check_clamp_value(value: object, allow_none: bool = True) -> float | None:
    """Check Megatron's ``clamp_value``: None (no clamp) or a finite number c > 0 that is a
    normal float32 number once rounded (the kernels clamp in float32: a c above float32's max
    would be inf there, one below 1.2e-38 subnormal or 0, a clamp of everything to 0).

    Returns:
        c rounded to the nearest float32 (as a Python float), or None: the kernels receive
        exactly that number on the GPU and in the interpreter alike.

    Raises:
        TypeError: not a real number (a bool, a str, a tensor), or None where a clamp is required.
        ValueError: not finite, <= 0, or outside float32's normal range [1.2e-38, 3.4e38].
            (Megatron-core treats ``clamp_value <= 0`` silently as no clamp; here it is an
            error, since no clamp is ``None``.)
    """
    if value is None and allow_none:
        return None
    if type(value) is float and FLOAT32_TINY <= value <= FLOAT32_MAX:  # the happy case in one test
        return nearest_float32(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a float > 0 or None" if allow_none else "a float > 0"
        raise TypeError(f"clamp_value must be {kind}, got {type(value).__name__} {value!r}")
    value = real_to_float("clamp_value", value, "a finite number > 0")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"clamp_value must be a finite number > 0 (None for no clamp), got {value!r}")
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(f"clamp_value must be a finite number > 0 in float32's normal range [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX:.4g}] (the kernels clamp in float32, where {value!r} is "
                         f"{'inf' if value > FLOAT32_MAX else 'subnormal or 0'}), got {value!r}")
    return nearest_float32(value)



def glu_apply(y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None,
              activation: str, clamp_value: float | None = None) -> torch.Tensor:
    """Forward kernel on [..., 2h] -> [..., h], no autograd. Inputs (and clamp_value) already checked."""
    return glu_fwd(y, bias, weights, activation, clamp_value)


def glu_backward_apply(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None,
                       activation: str, clamp_value: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward kernel: (dy [..., 2h], dbias or None, dweights or None). Inputs already checked."""
    return glu_bwd(g, y, bias, weights, activation, clamp_value)


def glu_forward(ctx, y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None, activation: str,
                fp8_input_store: bool = False, cpu_offload_input: bool = False,
                clamp_value: float | None = None) -> torch.Tensor:
    """The body of every GLU ``Function.forward``: run the kernel, save what backward needs.

    Saves y (as float8_e4m3fn when ``fp8_input_store``, as Megatron does: half the saved
    bytes, at the cost of a lossy copy), bias and weights; not the output, which the
    backward recomputes from y. ``cpu_offload_input`` tags the saved tensors with
    ``activation_offloading = True`` for Megatron's activation-offloading context.
    ``clamp_value`` (already checked: a float > 0, or None) is kept on ctx for the backward.
    """
    out = glu_apply(y, bias, weights, activation, clamp_value)
    saved = y.to(FP8_STORE_DTYPE) if fp8_input_store else y
    if cpu_offload_input:
        saved.activation_offloading = True
        if bias is not None:
            bias.activation_offloading = True
    ctx.save_for_backward(saved, bias, weights)
    keep_graph_anchor(ctx, y, saved)  # (the fp8 copy is no tensor of the graph)
    ctx.ori_input_dtype = y.dtype
    ctx.fp8_input_store = fp8_input_store
    ctx.activation = activation
    ctx.clamp_value = clamp_value
    return out


def glu_backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The body of every GLU ``Function.backward``: (d input, d bias or None, d weights or None)."""
    y, bias, weights = ctx.saved_tensors
    if ctx.fp8_input_store:
        y = y.to(ctx.ori_input_dtype)
    check_glu_grad(grad_output, y, y.shape[-1] // 2)
    return glu_backward_apply(grad_output, y, bias, weights, ctx.activation, ctx.clamp_value)
