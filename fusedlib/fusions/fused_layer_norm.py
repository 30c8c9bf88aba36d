"""Fused LayerNorm and RMSNorm: Megatron-core's ``FusedLayerNorm`` on fusedlib's Triton kernels.

Layers, as everywhere in fusedlib:

* functional: :func:`fused_layer_norm`, :func:`fused_rms_norm` (autograd through
  :class:`FusedLayerNormAffineFunction` / :class:`FusedRMSNormAffineFunction`, Apex's names);
* modules: :class:`FusedLayerNorm` (Megatron-core's class and arguments) and its sibling
  :class:`FusedRMSNorm`; :class:`FusedNorm` builds whichever ``config.normalization``
  names, as Megatron's ``TENorm`` does.

Why two modules and not one: a module's parameters are fixed by its class (LayerNorm has
weight and bias, RMSNorm a weight only), so a checkpoint's keys never depend on a config
field, and ``FusedLayerNorm`` keeps Megatron-core's contract (it refuses anything but
``"LayerNorm"``). Layer specs that should follow ``config.normalization`` use
:class:`FusedNorm`.

What the ``TransformerConfig`` switches do here:

* ``normalization``: which module :class:`FusedNorm` builds; each class checks it.
* ``layernorm_zero_centered_gamma``: the weight is stored around 0 (initialized to 0) and
  the kernels use ``gamma = weight + 1``, added in float32 inside the kernel (Megatron
  computes ``self.weight + 1`` in the weight's dtype, which rounds a bf16 weight).
* ``persist_layer_norm``: Apex's persistent kernel exists for the hidden sizes in
  :data:`fusedlib.backends.apex.PERSIST_LN_HIDDEN_SIZES` only. fusedlib's kernels hold the
  row in registers for every hidden size 1..65536 (Triton compiles one kernel per
  power-of-two block and masks the rest), so with ``backend="fusedlib"`` the switch is
  accepted and changes nothing; with ``backend="apex"`` it picks Apex's kernel as
  Megatron-core does.
* ``memory_efficient_layer_norm``: save the output y instead of the input x and recover
  ``x_hat = (y - beta) / gamma`` in the backward. Needs every gamma != 0: where a gamma is
  exactly 0, x_hat is lost (y = beta there), and the backward gives NaN (that column's
  dgamma, and dx), never a wrong finite value; a subnormal gamma (|gamma| < 1.18e-38) is
  treated as 0 (1 / gamma overflows float32). The forward kernel checks gamma on the
  device (:data:`LAYER_NORM_GAMMA_CHECK`, :data:`RMS_NORM_GAMMA_CHECK`) without a host
  sync: a ValueError at once on the CPU (and with ``FUSEDLIB_SYNC_CHECKS=1``); on CUDA at a
  later fusedlib call or :func:`fusedlib.runtime.check_errors`; under ``torch.compile`` the
  NaN is the signal. Only a forward that autograd records is checked: under
  ``torch.no_grad()`` / ``torch.inference_mode()``, or with no input requiring grad, no
  backward will run, nothing is divided by gamma, and a gamma of 0 is fine. The recovered
  x_hat carries y's rounding divided by |gamma|: where a gamma is tiny next to beta
  (LayerNorm), its dgamma and dx lose accuracy (chapter 4 measures it).
* ``sequence_parallel``: set as an attribute on weight and bias, for the gradient
  all-reduce across the tensor-parallel group (:func:`fusedlib.parallel.finalize_model_grads`,
  Megatron's ``finalize_model_grads``).

The output is never a view (its ``_base`` is None), so Megatron's pipeline schedule can
free it with ``deallocate_output_tensor``; Apex's persistent kernel returns a view and
Megatron wraps it with :func:`fusedlib.utils.make_viewless_tensor`.

Hidden sizes above 65536 raise a ValueError: the kernels hold one row in registers.

Source: Megatron-LM ``megatron/core/fusions/fused_layer_norm.py``; Apex
``apex/normalization/fused_layer_norm.py`` (``memory_efficient``); Triton tutorial
``05-layer-norm.py``; Ba et al. 2016 (arXiv:1607.06450); Zhang & Sennrich 2019
(arXiv:1910.07467).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import torch
from torch.nn import init
from torch.nn.parameter import Parameter

from ..backends import apex as apex_backend
from ..checks import (
    FLOAT32_MAX,
    FLOAT_DTYPES,
    ArgumentTypeError,
    check_bool,
    check_same_device,
    check_tensor,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
    short_repr,
    type_name,
)
from ..kernels.bias_dropout_add import bias_dropout_add_bwd, dropout_key
from ..kernels.layer_norm import (
    MAX_HIDDEN_SIZE, bias_dropout_add_norm_bwd, bias_dropout_add_norm_fwd, _norm_fwd, norm_bwd,
)
from ..runtime import DeviceCheck
from ..utils import KeepParameterAttributes
from ._apply import InferenceCtx, apply, once_differentiable
from .fused_bias_dropout import _check as _check_bda
from .fused_bias_dropout import _check_prob
from .fused_bias_dropout import get_bias_dropout_add

__all__ = [
    "FusedLayerNormAffineFunction",
    "FusedRMSNormAffineFunction",
    "fused_layer_norm",
    "fused_rms_norm",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "FusedNorm",
    "norm_with_residual",
    "BiasDropoutAddNormFunction",
    "bias_dropout_add_norm",
    "BACKENDS",
    "LAYER_NORM_GAMMA_CHECK",
    "RMS_NORM_GAMMA_CHECK",
]

#: Values of the modules' ``backend`` argument.
BACKENDS: tuple[str, ...] = ("fusedlib", "apex")


# ----------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------


def _check_param(name: str, p: Optional[torch.Tensor], x: torch.Tensor, x_name: str) -> Optional[torch.Tensor]:
    if p is None:
        return None
    check_tensor(name, p, ndim=1)
    if p.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} must have shape [h] with h = {x_name}.shape[-1] = {x.shape[-1]}, got {list(p.shape)}"
        )
    if p.dtype != x.dtype:
        raise TypeError(f"{name} dtype {p.dtype} must match {x_name} dtype {x.dtype} (the kernels read both in "
                        f"one dtype: cast one of them; a FusedLayerNorm / FusedRMSNorm module takes dtype= for its "
                        f"parameters, or .to({x.dtype}))")
    return p.contiguous()  # [h]: a copy only for a strided parameter (h elements)


Tensor = torch.Tensor


def _param_ok(p: object, x: torch.Tensor) -> bool:
    return isinstance(p, Tensor) and p.dtype == x.dtype and p.dim() == 1 and p.shape[0] == x.shape[-1]


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                  x_name: str = "input") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # the happy case in one test; the checks below name what is wrong otherwise
    if (isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1 and 1 <= x.shape[-1] <= MAX_HIDDEN_SIZE
            and _param_ok(weight, x) and type(eps) is float and 0.0 <= eps <= FLOAT32_MAX):
        if bias is None:
            if on_one_kernel_device(x, weight):
                return weight.contiguous(), None
        elif _param_ok(bias, x) and on_one_kernel_device(x, weight, bias):
            return weight.contiguous(), bias.contiguous()
    check_tensor(x_name, x, min_ndim=1)
    if not 1 <= x.shape[-1] <= MAX_HIDDEN_SIZE:
        raise ValueError(
            f"the hidden size {x_name}.shape[-1] must be in 1..{MAX_HIDDEN_SIZE} (fusedlib's norm kernels hold "
            f"one row in registers), got {x.shape[-1]}"
        )
    if weight is None:
        raise TypeError("weight must be a torch.Tensor, got NoneType")
    weight = _check_param("weight", weight, x, x_name)
    bias = _check_param("bias", bias, x, x_name)
    _check_eps(eps)
    check_same_device(**{x_name: x, "weight": weight, "bias": bias})
    return weight, bias


def _check_eps(eps: object) -> None:
    """eps: a real number >= 0 whose float32 is finite (the kernels add it in float32: 1e39
    would be inf there, and every output 0 or NaN). A value of another type (a str, None, a
    bool, a tensor) raises an :class:`~fusedlib.checks.ArgumentTypeError`: a TypeError, as the
    house rule has it, that is also the ValueError this check has always raised."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        why = (" (reading a tensor's value would synchronise with its device: pass float(eps))"
               if isinstance(eps, torch.Tensor) else "")
        raise ArgumentTypeError(f"eps must be a finite number >= 0 (a Python float), got {type_name(eps)} "
                                f"{short_repr(eps)}{why}")
    if not math.isfinite(real_to_float("eps", eps, "a finite number >= 0")) or eps < 0 or eps > FLOAT32_MAX:
        raise ValueError(f"eps must be a finite number >= 0, at most float32's max ({FLOAT32_MAX:.4g}: the "
                         f"kernels add it in float32), got {eps!r}")


def _check_flags(memory_efficient: object, zero_centered_gamma: object,
                 residual_out: object = False) -> tuple[bool, bool, bool]:
    """The switches, as bools: a str ("no") or an int was read as its truth value."""
    flags = (memory_efficient, zero_centered_gamma, residual_out)
    if all(f is True or f is False for f in flags):
        return flags
    return (check_bool("memory_efficient", memory_efficient), check_bool("zero_centered_gamma", zero_centered_gamma),
            check_bool("residual_out", residual_out))


def _gamma_check_message(op: str):
    def message(code: int, zero_centered_gamma) -> str:
        col = code - 1
        gamma = f"weight[{col}] + 1" if zero_centered_gamma else f"weight[{col}]"
        x_hat = "y / gamma" if op == "fused_rms_norm" else "(y - beta) / gamma"  # RMSNorm has no beta
        return (f"{op}: memory_efficient=True needs every gamma != 0 (x_hat = {x_hat}), got gamma = "
                f"{gamma} = 0 or subnormal (|gamma| < 1.18e-38, float32's smallest normal: 1 / gamma is not "
                "finite): its dgamma and dx are NaN; use memory_efficient=False (the config's "
                "memory_efficient_layer_norm=False) with this weight")

    return message


#: Device-side checks of the memory-efficient norms: the forward kernel stores 1 + the index
#: of a column whose gamma (in the compute dtype, + 1 when zero-centered) is exactly 0.
LAYER_NORM_GAMMA_CHECK = DeviceCheck("fused_layer_norm", _gamma_check_message("fused_layer_norm"))
RMS_NORM_GAMMA_CHECK = DeviceCheck("fused_rms_norm", _gamma_check_message("fused_rms_norm"))


# ----------------------------------------------------------------------------------------
# Autograd wiring
# ----------------------------------------------------------------------------------------


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """Autograd wiring of fused LayerNorm over the last dim.

    ``forward(ctx, input, weight, bias, eps, memory_efficient=False, zero_centered_gamma=False,
    residual_out=False)`` runs one kernel that writes y and the row statistics (mean, rstd: float32, 8 bytes
    per row; neither is allocated or written when :func:`~fusedlib.fusions._apply.apply` runs the
    forward without autograd, with an ``InferenceCtx``: no backward will read them) and saves
    ``(input, weight, bias, mean, rstd)``, or with ``memory_efficient``
    ``(y, weight, bias, rstd)``. ``backward`` runs one kernel for dx and the per-program
    partial sums of dgamma/dbeta, and one small kernel that sums the partials (for small
    inputs none: one program takes every row and its sums are the gradients).

    With ``residual_out=True`` it returns ``(y, residual)``, residual being the input itself
    as this node's second output (autograd makes it a view of the input, which requires grad
    when the input does: with only the parameters requiring grad it is a constant): code that uses it for the residual connection hands the
    residual's gradient to this backward, whose kernel adds it to dx (one pass over the
    gradient instead of a separate add of three). See :func:`norm_with_residual`.

    Shapes: input [..., h] (e.g. [s, b, h]), weight and bias [h] (bias may be None).
    Returns y of input's shape and dtype, a new tensor that is not a view (with
    ``residual_out``, ``(y, residual)``).

    Raises:
        TypeError, ValueError: as :func:`fused_layer_norm`; TypeError for a ``residual_out``
        that is not a bool.

    Source: Apex ``apex/normalization/fused_layer_norm.py`` (same name, same saved
    tensors); Megatron-LM ``megatron/core/fusions/fused_layer_norm.py``.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: A002
                eps: float, memory_efficient: bool = False, zero_centered_gamma: bool = False,
                residual_out: bool = False):
        memory_efficient, zero_centered_gamma, residual_out = _check_flags(memory_efficient, zero_centered_gamma,
                                                                           residual_out)
        # _check_inputs runs unless this call's signature passed it before (the plan's key)
        backward_ahead = type(ctx) is not InferenceCtx  # InferenceCtx: no backward will run
        # gamma is checked only where a backward may divide by it: with no backward ahead, a gamma
        # of 0 makes no NaN (y is right), and refusing the call would refuse a valid inference
        y, mean, rstd, _, weight_c, bias_c = _norm_fwd(
            input, weight, bias, eps, False, zero_centered_gamma, None,
            LAYER_NORM_GAMMA_CHECK if memory_efficient and backward_ahead else None,
            backward_ahead, check=_check_inputs)
        ctx.memory_efficient = memory_efficient
        ctx.zero_centered_gamma = zero_centered_gamma
        if ctx.memory_efficient:
            ctx.save_for_backward(y, weight_c, bias_c, None, rstd)
        else:
            ctx.save_for_backward(input, weight_c, bias_c, mean, rstd)
        if residual_out:
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None, never zeros
            if not ctx.needs_input_grad[0]:
                ctx.mark_non_differentiable(input)  # the residual is the input: constant if it needs no grad
            return y, input
        return y

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: Optional[torch.Tensor], grad_residual: Optional[torch.Tensor] = None):
        # grad_output needs no check: autograd's engine has matched it to y's shape, dtype and
        # device (strides may differ: the kernel takes them)
        if grad_output is None:  # (residual_out) y unused: x's gradient is the residual's alone
            return grad_residual, None, None, None, None, None, None
        x_or_y, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = norm_bwd(grad_output, x_or_y, weight, bias, mean, rstd, rms_norm=False,
                                      zero_centered_gamma=ctx.zero_centered_gamma,
                                      memory_efficient=ctx.memory_efficient, dresidual=grad_residual)
        return dx, dweight, dbias, None, None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """Autograd wiring of fused RMSNorm over the last dim.

    ``forward(ctx, input, weight, eps, memory_efficient=False, zero_centered_gamma=False,
    residual_out=False)`` saves ``(input, weight, rstd)``, or with ``memory_efficient``
    ``(y, weight, rstd)``; ``backward`` returns ``(dx, dweight, None, None, None, None)``.
    ``residual_out``: as :class:`FusedLayerNormAffineFunction`'s.

    Shapes: input [..., h], weight [h]. Returns y of input's shape and dtype, not a view.

    Source: Apex ``apex/normalization/fused_layer_norm.py`` (``FusedRMSNormAffineFunction``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, eps: float,  # noqa: A002
                memory_efficient: bool = False, zero_centered_gamma: bool = False, residual_out: bool = False):
        memory_efficient, zero_centered_gamma, residual_out = _check_flags(memory_efficient, zero_centered_gamma,
                                                                           residual_out)
        backward_ahead = type(ctx) is not InferenceCtx  # gamma checked only then: see the LayerNorm's
        y, _, rstd, _, weight_c, _ = _norm_fwd(input, weight, None, eps, True, zero_centered_gamma, None,
                                               RMS_NORM_GAMMA_CHECK if memory_efficient and backward_ahead else None,
                                               backward_ahead, check=_check_inputs)
        ctx.memory_efficient = memory_efficient
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.save_for_backward(y if ctx.memory_efficient else input, weight_c, rstd)
        if residual_out:
            ctx.set_materialize_grads(False)
            if not ctx.needs_input_grad[0]:
                ctx.mark_non_differentiable(input)
            return y, input
        return y

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: Optional[torch.Tensor], grad_residual: Optional[torch.Tensor] = None):
        if grad_output is None:  # (residual_out) y unused
            return grad_residual, None, None, None, None, None
        x_or_y, weight, rstd = ctx.saved_tensors  # grad_output: matched to y by autograd
        dx, dweight, _ = norm_bwd(grad_output, x_or_y, weight, None, None, rstd, rms_norm=True,
                                  zero_centered_gamma=ctx.zero_centered_gamma, memory_efficient=ctx.memory_efficient,
                                  dresidual=grad_residual)
        return dx, dweight, None, None, None, None


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float = 1e-5, *,
                     zero_centered_gamma: bool = False, memory_efficient: bool = False) -> torch.Tensor:
    """Fused LayerNorm over the last dim, with autograd.

    ``y = gamma · (x - mean) / sqrt(var + eps) + beta`` per row, biased variance,
    ``gamma = weight`` (``weight + 1`` with ``zero_centered_gamma``), ``beta = bias``.

    Args:
        x: [..., h], float32 / float16 / bfloat16 (float64 for gradcheck), CUDA or CPU,
            any strides; 1 <= h <= 65536.
        weight: [h], x's dtype and device.
        bias: [h], x's dtype and device, or None.
        eps: added to the variance, >= 0 and finite in float32 (<= 3.4e38). With eps = 0 a
            row of equal values (every row when h = 1) is 0 / 0: its y and dx are NaN, as
            torch's layer_norm gives (an eps under float32's smallest subnormal, 1.4e-45, is 0
            in the kernels' float32 too).
        zero_centered_gamma: gamma = weight + 1 (Megatron's ``layernorm_zero_centered_gamma``).
        memory_efficient: save y instead of x for the backward (Megatron's
            ``memory_efficient_layer_norm``); x_hat = (y - beta) / gamma then carries an
            extra error of about 0.5 ulp(y) / |gamma| per element, large where a gamma is
            tiny next to its beta (chapter 4 derives the bounds on dgamma and dx). Every gamma must be nonzero: see Raises.

    Returns:
        y: a new contiguous tensor of x's shape and dtype (``y._base is None``). Its
        backward is not differentiable again: a second derivative raises. The statistics are
        float32 sums of x² (float64 for float64 inputs): rows with |x| of ~1e19 or more overflow
        them and come out as zeros or wrong values, as with torch's float32 layer_norm.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, or weight/bias dtype != x dtype;
            zero_centered_gamma or memory_efficient not a bool (numpy's bool is accepted);
            eps not a real number (a str, None, a bool, a tensor: an
            :class:`~fusedlib.checks.ArgumentTypeError`, also a ValueError).
        ValueError: weight/bias not of shape [h], h outside 1..65536, eps < 0, not finite or
            above float32's max, tensors on different devices. With ``memory_efficient``, a gamma of
            exactly 0 (its dgamma and dx would be NaN): checked by the forward kernel, so
            raised at once on the CPU (and with ``FUSEDLIB_SYNC_CHECKS=1``), on CUDA at a
            later fusedlib call or :func:`fusedlib.runtime.check_errors` (no host sync); only
            when autograd records the call (not under ``torch.no_grad()``, nor with no input
            requiring grad: no backward will divide by gamma then).

    Source: Megatron-LM ``megatron/core/fusions/fused_layer_norm.py``.
    """
    return apply(FusedLayerNormAffineFunction, x, weight, bias, eps, memory_efficient, zero_centered_gamma)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
                   zero_centered_gamma: bool = False, memory_efficient: bool = False) -> torch.Tensor:
    """Fused RMSNorm over the last dim, with autograd: ``y = gamma · x / sqrt(mean(x²) + eps)``.

    Args:
        x: [..., h], as :func:`fused_layer_norm`.
        weight: [h], x's dtype and device.
        eps: added to the mean square, >= 0 and finite in float32. With eps = 0 an all-zero
            row is 0 / 0: its y and dx are NaN, as torch's rms_norm gives.
        zero_centered_gamma, memory_efficient: as :func:`fused_layer_norm`.

    Returns:
        y: a new contiguous tensor of x's shape and dtype (``y._base is None``).

    Raises:
        TypeError, ValueError: as :func:`fused_layer_norm`.

    Source: Zhang & Sennrich 2019, arXiv:1910.07467; Apex ``FusedRMSNormAffineFunction``.
    """
    return apply(FusedRMSNormAffineFunction, x, weight, eps, memory_efficient, zero_centered_gamma)


# ----------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------


def _config_flag(config, name: str) -> bool:
    """``config.<name>`` as a bool. ``bool()`` read a str "False" as True (an object with the
    config's fields need not validate them): ``layernorm_zero_centered_gamma="False"`` made gamma
    = weight + 1. numpy's bool is accepted.

    Raises:
        TypeError: the field is not a bool.
    """
    value = getattr(config, name)
    if value is True or value is False:
        return value
    return check_bool(f"config.{name}", value)


def _hidden_size(hidden_size: Union[int, Sequence[int], torch.Size], kernels: bool = True) -> int:
    """h from an int or a 1-element shape whose element is an int (numpy's too). Anything else
    raises: a float (8.7) or a str ("8") in a shape was converted by ``int()`` (8.7 silently
    became 8), a bool was read as 1. ``kernels``: h also at most :data:`MAX_HIDDEN_SIZE`
    (False: torch's norms, any h >= 1)."""
    value = hidden_size
    if isinstance(hidden_size, (tuple, list, torch.Size)) and len(hidden_size) == 1:
        value = hidden_size[0]
    elif isinstance(hidden_size, (tuple, list, torch.Size)):
        raise ValueError(f"hidden_size must be an int (or a 1-element shape), got {short_repr(hidden_size)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"hidden_size must be an int (or a 1-element shape of one), got "
                                f"{type_name(value)} {short_repr(value)}"
                                + (f" in {short_repr(hidden_size)}" if value is not hidden_size else ""))
    h = int(value)
    if not kernels and h < 1:
        raise ValueError(f"hidden_size must be >= 1, got {h}")
    if kernels and not 1 <= h <= MAX_HIDDEN_SIZE:
        raise ValueError(
            f"hidden_size must be in 1..{MAX_HIDDEN_SIZE} (fusedlib's norm kernels hold one row in registers), got {h}"
        )
    return h


class _FusedNormBase(KeepParameterAttributes, torch.nn.Module):
    """What FusedLayerNorm and FusedRMSNorm share: config switches, weight, backend."""

    _normalization = ""  # the config.normalization this class implements

    def __init__(self, config, hidden_size, eps: float, backend: str, has_bias: bool,
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if not hasattr(config, "normalization"):  # None, a dict...: an AttributeError naming no argument before
            raise TypeError(f"config must be a TransformerConfig (or an object with its normalization fields), got "
                            f"{type_name(config)}")
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"config.normalization must be 'LayerNorm' or 'RMSNorm', got "
                             f"{short_repr(config.normalization)}")
        if config.normalization != self._normalization:
            other = "FusedRMSNorm" if config.normalization == "RMSNorm" else "FusedLayerNorm"
            raise ValueError(
                f"{type(self).__name__} implements normalization={self._normalization!r}, but "
                f"config.normalization={config.normalization!r}: use {other}, or FusedNorm, which builds the "
                "module config.normalization names"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        _check_eps(eps)
        self.config = config
        self.backend = backend
        self.zero_centered_gamma = _config_flag(config, "layernorm_zero_centered_gamma")
        h = _hidden_size(hidden_size)
        self.hidden_size = torch.Size((h,))
        self.eps = float(eps)
        # torch.empty, not torch.Tensor, for correct device placement (as in Megatron-core), with
        # PyTorch's factory arguments: None is torch's default device / dtype, as in torch.nn.LayerNorm
        self.weight = Parameter(torch.empty(h, device=device, dtype=dtype))
        self.bias = Parameter(torch.empty(h, device=device, dtype=dtype)) if has_bias else None
        self.reset_parameters()
        self.sequence_parallel = _config_flag(config, "sequence_parallel")
        # Megatron all-reduces the gradients of parameters marked sequence_parallel across
        # the tensor-parallel group: each rank saw only its slice of the sequence.
        setattr(self.weight, "sequence_parallel", self.sequence_parallel)
        if self.bias is not None:
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)

    def reset_parameters(self) -> None:
        """gamma = 1, beta = 0: the weight is 1, or 0 when stored zero-centered."""
        if self.zero_centered_gamma:
            init.zeros_(self.weight)
        else:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{tuple(self.hidden_size)}, eps={self.eps}, backend={self.backend!r}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class FusedLayerNorm(_FusedNormBase):
    """LayerNorm over the last dim on fusedlib's fused Triton kernels (or Apex's).

    Args:
        config: a :class:`fusedlib.transformer.TransformerConfig` (or any object with its
            fields): reads ``normalization`` (must be ``"LayerNorm"``),
            ``layernorm_zero_centered_gamma``, ``persist_layer_norm``,
            ``memory_efficient_layer_norm`` (at each forward) and ``sequence_parallel``.
        hidden_size: h, 1..65536 (an int or a 1-element shape).
        eps: added to the variance.
        persist_layer_norm, zero_centered_gamma, normalization: accepted for Megatron-core's
            interface and ignored, as in Megatron-core: the config's fields decide.
        backend: ``"fusedlib"`` (default) or ``"apex"`` (Apex's kernels, chosen as
            Megatron-core does; raises :class:`fusedlib.backends.apex.ApexNotAvailableError`
            with install instructions where Apex does not import).
        device, dtype: where and in which dtype the parameters are created (PyTorch's factory
            arguments, as ``torch.nn.LayerNorm``'s); None: torch's default device and dtype
            (``torch.set_default_device`` / ``torch.set_default_dtype``, float32 unless set).

    Attributes:
        weight: [h] gamma (zero-centered: gamma - 1), ``sequence_parallel`` attribute set.
        bias: [h] beta, ``sequence_parallel`` attribute set.
        persist_layer_norm: with ``backend="apex"``, whether Apex's persistent kernel is
            used (config asks, h is in its list, it imports); with ``"fusedlib"``,
            ``config.persist_layer_norm`` as given (no effect).

    Shapes: input [..., h] (Megatron: [s, b, h]) -> output of the same shape and dtype;
    parameters must have the input's dtype (``dtype=``, or ``module.to(torch.bfloat16)``).

    Raises:
        ValueError: config.normalization != "LayerNorm" (or neither "LayerNorm" nor "RMSNorm"),
            hidden_size outside 1..65536 or a shape of more than one element, eps < 0, not
            finite or above float32's max, an unknown backend.
        TypeError: config without a normalization field (None, a dict); hidden_size (or its one
            element) not an int (a float, a str, a bool), eps not
            a real number (each an :class:`~fusedlib.checks.ArgumentTypeError`, also a ValueError);
            one of the config's switches it reads (``layernorm_zero_centered_gamma``,
            ``persist_layer_norm``, ``sequence_parallel``; ``memory_efficient_layer_norm`` at
            each forward) not a bool (numpy's bool is accepted).

    Source: Megatron-LM ``megatron/core/fusions/fused_layer_norm.py`` (``FusedLayerNorm``).
    """

    _normalization = "LayerNorm"

    def __init__(self, config, hidden_size: Union[int, Sequence[int]], eps: float = 1e-5,
                 persist_layer_norm: bool = True, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm", *, backend: str = "fusedlib",
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, hidden_size, eps, backend, has_bias=True, device=device, dtype=dtype)
        persist = _config_flag(config, "persist_layer_norm")
        if backend == "apex":
            persist = (persist and self.hidden_size[0] in apex_backend.PERSIST_LN_HIDDEN_SIZES
                       and apex_backend.apex_available("FastLayerNormFN"))
            if not persist:
                apex_backend.require("FusedLayerNormAffineFunction")  # a clear error now, not at forward
        self.persist_layer_norm = persist

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """y = LayerNorm(input): [..., h] -> [..., h], never a view."""
        memory_efficient = _config_flag(self.config, "memory_efficient_layer_norm")
        if self.backend == "apex":
            weight = self.weight + 1 if self.zero_centered_gamma else self.weight
            return apex_backend.apex_layer_norm(input, weight, self.bias, self.eps,
                                                persist=self.persist_layer_norm, memory_efficient=memory_efficient)
        return apply(FusedLayerNormAffineFunction, input, self.weight, self.bias, self.eps, memory_efficient,
                                                  self.zero_centered_gamma)

    def forward_with_residual(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        """``(LayerNorm(input), residual)``: see :func:`norm_with_residual`, which calls this
        method only for a module without hooks (this method itself runs none). With
        ``backend="apex"`` the residual is ``input`` itself (Apex's kernels take no second gradient)."""
        if self.backend == "apex":
            return self.forward(input), input
        return apply(FusedLayerNormAffineFunction, input, self.weight, self.bias, self.eps,
                     _config_flag(self.config, "memory_efficient_layer_norm"), self.zero_centered_gamma, True)


class FusedRMSNorm(_FusedNormBase):
    """RMSNorm over the last dim on fusedlib's fused Triton kernels (or Apex's).

    Args:
        config: reads ``normalization`` (must be ``"RMSNorm"``),
            ``layernorm_zero_centered_gamma``, ``memory_efficient_layer_norm`` (at each
            forward) and ``sequence_parallel``.
        hidden_size: h, 1..65536.
        eps: added to the mean square.
        zero_centered_gamma, normalization: accepted for interface symmetry, ignored (the
            config decides).
        backend: ``"fusedlib"`` or ``"apex"`` (``FusedRMSNormAffineFunction``).
        device, dtype: of the parameters, as :class:`FusedLayerNorm`'s (None: torch's defaults).

    Attributes:
        weight: [h] gamma (zero-centered: gamma - 1), ``sequence_parallel`` attribute set.
        bias: None (RMSNorm has no shift).

    Raises:
        ValueError: config.normalization != "RMSNorm", and as :class:`FusedLayerNorm`.
        TypeError: as :class:`FusedLayerNorm`.

    Source: Zhang & Sennrich 2019, arXiv:1910.07467; Megatron-core's RMSNorm through
    ``TENorm`` (``megatron/core/extensions/transformer_engine.py``).
    """

    _normalization = "RMSNorm"

    def __init__(self, config, hidden_size: Union[int, Sequence[int]], eps: float = 1e-5,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm", *,
                 backend: str = "fusedlib", device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, hidden_size, eps, backend, has_bias=False, device=device, dtype=dtype)
        if backend == "apex":
            apex_backend.require("FusedRMSNormAffineFunction")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """y = RMSNorm(input): [..., h] -> [..., h], never a view."""
        memory_efficient = _config_flag(self.config, "memory_efficient_layer_norm")
        if self.backend == "apex":
            weight = self.weight + 1 if self.zero_centered_gamma else self.weight
            return apex_backend.apex_rms_norm(input, weight, self.eps, memory_efficient=memory_efficient)
        return apply(FusedRMSNormAffineFunction, input, self.weight, self.eps, memory_efficient,
                                                self.zero_centered_gamma)

    def forward_with_residual(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        """``(RMSNorm(input), residual)``: see :func:`norm_with_residual`, which calls this method
        only for a module without hooks (this method itself runs none; Apex: ``input`` itself)."""
        if self.backend == "apex":
            return self.forward(input), input
        return apply(FusedRMSNormAffineFunction, input, self.weight, self.eps,
                     _config_flag(self.config, "memory_efficient_layer_norm"), self.zero_centered_gamma, True)


def norm_with_residual(norm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x), residual)`` for a pre-norm layer, whose x feeds both the norm and the residual
    connection: ``residual = x; y = norm(x)``.

    Autograd would sum x's two gradients with a separate add (read both, write the sum: three
    passes over [s, b, h]). With fusedlib's norms (``FusedLayerNorm``, ``FusedRMSNorm``,
    ``backend="fusedlib"``) the residual comes back as a second output of the norm's autograd
    node, a view of x with the same values, so its gradient reaches the norm's backward, whose
    kernel adds it to dx while dx is in registers (one more read, no add) and rounds the sum
    once. Any other module (torch's LayerNorm, Apex's, an identity) returns ``(norm(x), x)``:
    the same values and gradients, summed by autograd.

    A module with forward or backward hooks (its own, or PyTorch's global module hooks), and a
    subclass of fusedlib's norms that overrides ``forward``, is called as ``norm(x)``, so that
    its hooks and its forward run as they would without fusedlib, and the residual is ``x``
    (autograd adds the gradients).

    The residual is a view of x made by the norm's node: modifying it, or x, in place
    afterwards raises autograd's error. Second derivatives are not available through either
    output (the norm's backward is ``once_differentiable``), through the residual alone
    included.

    Args:
        norm: the norm module ([..., h] -> [..., h]).
        x: [..., h] (a layer's [s, b, h]). If its dtype differs from the norm's weight (an fp32
            residual stream, ``fp32_residual_connection``), the norm gets ``x`` cast to the
            weight's dtype and the residual is ``x`` itself, autograd adding the gradients.

    Returns:
        ``(y, residual)``: y = norm(x); residual equal to x (x itself, or a view of it).

    Raises:
        As the norm's forward.

    Source: fusedlib; the residual's gradient taken inside the norm's backward as FlashAttention's
    ``layer_norm_fn(..., residual=..., prenorm=True)`` (``flash_attn/ops/triton/layer_norm.py``)
    and Transformer Engine's fused norms take theirs.
    """
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype != x.dtype:
        return norm(x.to(weight.dtype)), x
    forward_with_residual = getattr(norm, "forward_with_residual", None)
    if forward_with_residual is not None and not _has_hooks(norm) and type(norm).forward in _FUSED_FORWARDS:
        return forward_with_residual(x)
    return norm(x), x


#: The norm modules whose kernels bias_dropout_add_norm may call in place of their forward: a
#: subclass that overrides ``forward`` is called as written.
_FUSED_FORWARDS = (FusedLayerNorm.forward, FusedRMSNorm.forward)


def bias_dropout_add_norm(norm: torch.nn.Module, x_with_bias: tuple, residual: torch.Tensor, prob: float,
                          training: bool, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = residual + dropout(x + bias, prob)``: a sublayer's
    bias-dropout-add and the next pre-norm, which in a pre-norm layer always follow each other
    (the attention's output, then the MLP's norm), as one kernel forward and one backward.

    The two kernels one after the other read x and the residual, write h, read h again and
    write norm(h); fused, h is normalised while it is in registers (one read of h less, one
    launch less). The backward kernel of the norm, which already adds h's second gradient
    (the next residual connection's) to its own, also writes x's gradient (the same tensor
    without dropout) and sums it over rows for the bias's gradient, the work of the
    bias-dropout-add backward kernel (one read of the gradient less), at the row lengths where
    that measured faster (``BDA_BWD_IN_NORM`` in :mod:`fusedlib.kernels.layer_norm`; elsewhere
    that kernel reads the gradient back). The arithmetic is the two kernels', in their order: h
    is rounded to its dtype and normalised as rounded. In Triton's interpreter the results are
    their bits, except sums over rows taken in another order (the bias's, in the norm's kernel;
    and the norm's parameter gradients of rows under 8 columns, which take an 8-column block);
    compiled, the two forms may also differ by the placement of a fused multiply-add (a float32
    rounding).

    Fused when ``fused`` is True and ``norm`` is fusedlib's ``FusedLayerNorm`` or ``FusedRMSNorm``
    itself (not a subclass that overrides ``forward``; ``backend="fusedlib"``, without
    ``memory_efficient_layer_norm``, without hooks) and x and the residual have the norm's dtype;
    then the arguments go through :class:`BiasDropoutAddNormFunction`, whose checks raise for bad
    ones. Otherwise the bias-dropout-add of ``get_bias_dropout_add(training, fused)``, then
    :func:`norm_with_residual` (the same values), except that out of training x is never
    overwritten (the bias-dropout-add's in-place inference path is not taken: x is the caller's).
    Neither path modifies an input. Second derivatives raise (the norm's backward is
    ``once_differentiable``).

    Args:
        norm: the norm module ([..., h] -> [..., h]).
        x_with_bias: ``(x, bias)`` as a linear layer returns them: x [..., h] (e.g. [s, b, h]),
            float32/float16/bfloat16 (float64 for gradcheck), any strides; bias [h] of any float
            dtype, or None.
        residual: x's shape, any float dtype (fused only with x's, the norm's).
        prob: dropout probability in [0, 1] (Megatron's ``hidden_dropout``), a real number.
        training: dropout on (a Philox mask from torch's generator, as the bias-dropout-add
            kernel draws it) or off; a bool.
        fused: the config's ``bias_dropout_fusion``, a bool; False takes the unfused
            bias-dropout-add.

    Returns:
        ``(y, h)``: h, the next residual, a new tensor in the residual's dtype; y = norm(h) in
        the norm's dtype (the residual's when fused).

    Raises:
        TypeError, ValueError: from :class:`BiasDropoutAddNormFunction` when fused; otherwise as
        ``get_bias_dropout_add(training, fused)``'s function and the norm's forward; TypeError
        for ``norm`` not a ``torch.nn.Module``, ``training`` or ``fused`` not a bool.

    Source: fusedlib, after FlashAttention's ``dropout_add_layer_norm`` (``flash_attn/ops/
    layer_norm.py``, ``prenorm=True``) and its Triton ``layer_norm_fn(x, weight, bias,
    residual=..., dropout_p=..., prenorm=True)``, here with the linear layer's bias added first
    as in Megatron-LM's ``megatron/core/fusions/fused_bias_dropout.py``.
    """
    if not isinstance(norm, torch.nn.Module):
        raise TypeError(f"norm must be a torch.nn.Module (the norm module, e.g. FusedLayerNorm), got "
                        f"{type(norm).__name__}")
    if not (type(training) is bool and type(fused) is bool):
        get_bias_dropout_add(training, fused)  # raises for what it refuses (a str "False", None...)
        training, fused = bool(training), bool(fused)  # numpy bools
    if (fused and type(norm).forward in _FUSED_FORWARDS and norm.backend == "fusedlib"
            and not norm.config.memory_efficient_layer_norm and not _has_hooks(norm)
            and isinstance(x_with_bias, (tuple, list)) and len(x_with_bias) == 2
            and isinstance(x_with_bias[0], Tensor) and isinstance(residual, Tensor)
            and x_with_bias[0].dtype == residual.dtype == norm.weight.dtype):
        x, linear_bias = x_with_bias
        return apply(BiasDropoutAddNormFunction, x, linear_bias, residual, norm.weight, norm.bias, norm.eps, prob,
                     training, isinstance(norm, FusedRMSNorm), norm.zero_centered_gamma)
    if training:
        hidden_states = get_bias_dropout_add(True, fused)(x_with_bias, residual, prob)
    else:  # no dropout; prob still checked, and training mode's function never writes into x
        _check_prob(prob)
        hidden_states = get_bias_dropout_add(True, fused)(x_with_bias, residual, 0.0)
    return norm_with_residual(norm, hidden_states)


class BiasDropoutAddNormFunction(torch.autograd.Function):
    """Autograd wiring of :func:`bias_dropout_add_norm`'s fused path.

    ``forward(ctx, x, linear_bias, residual, weight, bias, eps, prob, training, rms_norm,
    zero_centered_gamma)`` draws a Philox seed (training with prob > 0, a non-empty x, not
    every element dropped), runs one kernel that writes h = residual + dropout(x + linear_bias)
    and y = norm(h) with its row statistics, and returns ``(y, h)``; it saves h (the next
    residual, alive anyway), the norm's parameters, the statistics and the seed.
    ``backward(dy, dh)`` runs the norm's
    backward kernel with h's second gradient ``dh`` added and x's gradient and its column sum
    computed in the same pass; returns ``(dx, dlinear_bias, dresidual, dweight, dbias, None x5)``,
    dx being dresidual itself when nothing was dropped. With y unused (dy None) the
    bias-dropout-add backward kernel runs alone.

    Shapes: x, residual [..., h] of one float dtype; linear_bias [h] (any float dtype) or
    None; weight, bias [h] of x's dtype (bias None for RMSNorm). Returns y and h of x's shape
    and dtype, new tensors.

    Raises:
        TypeError: a non-tensor or unsupported dtype, residual or parameters of another dtype
            than x, prob not a real number (a tensor, a str, a bool), training not a bool.
        ValueError: residual's shape not x's, linear_bias not [h], h outside 1..65536, prob
            outside [0, 1], eps as the norms', tensors on different devices.

    Source: fusedlib (see :func:`bias_dropout_add_norm`).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear_bias: Optional[torch.Tensor], residual: torch.Tensor,
                weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, prob: float, training: bool,
                rms_norm: bool, zero_centered_gamma: bool):
        # the bias-dropout-add's checks (shapes, dtypes, devices, prob; its bias named as such:
        # the norm has a bias too), then the norm's
        x, linear_bias, residual, prob = _check_bda((x, linear_bias), residual, prob, bias_name="linear_bias")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have x's dtype {x.dtype} (h is normalised in it), got {residual.dtype}")
        if not (rms_norm is True or rms_norm is False):
            rms_norm = check_bool("rms_norm", rms_norm)
        if rms_norm and bias is not None:
            raise ValueError("bias must be None for RMSNorm (rms_norm=True): RMSNorm has no shift")
        weight_c, bias_c = _check_inputs(x, weight, bias, eps, x_name="x")  # x's device too
        if not (training is True or training is False):
            training = check_bool("training", training)
        if not (zero_centered_gamma is True or zero_centered_gamma is False):
            zero_centered_gamma = check_bool("zero_centered_gamma", zero_centered_gamma)
        dropout = training and prob > 0.0 and x.numel() > 0  # empty: no seed, as torch's dropout draws none
        seed = dropout_key(x.device, prob) if dropout else None  # (none drawn when everything is dropped)
        lb = linear_bias.contiguous() if linear_bias is not None else None  # [h]: a copy only if strided
        y, h, mean, rstd = bias_dropout_add_norm_fwd(x, lb, residual, seed, prob, weight_c, bias_c, eps,
                                                     rms_norm=rms_norm, zero_centered_gamma=zero_centered_gamma,
                                                     stats=type(ctx) is not InferenceCtx)
        ctx.save_for_backward(h, weight_c, bias_c, mean, rstd, seed)
        ctx.prob, ctx.rms_norm, ctx.zero_centered_gamma = prob, rms_norm, zero_centered_gamma
        ctx.linear_bias_dtype = linear_bias.dtype if linear_bias is not None else None
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            # h depends on x, the sublayer bias and the residual alone: with none of them requiring
            # grad (only the norm's parameters do), h is a constant as torch's ops would make it
            ctx.mark_non_differentiable(h)
        return y, h

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_y: Optional[torch.Tensor], grad_h: Optional[torch.Tensor]):
        h, weight, bias, mean, rstd, seed = ctx.saved_tensors
        lb_dtype = ctx.linear_bias_dtype if ctx.needs_input_grad[1] else None
        none5 = (None,) * 5
        if grad_y is None:  # y unused: the bias-dropout-add's backward of h's gradient alone
            if grad_h is None:
                return (None,) * 10
            dx, dlb = bias_dropout_add_bwd(grad_h, h.dtype, seed, ctx.prob, need_dx=ctx.needs_input_grad[0],
                                           need_dbias=lb_dtype is not None, db_dtype=lb_dtype)
            return dx, dlb, grad_h, None, None, *none5
        dx, dres, dweight, dbias, dlb = bias_dropout_add_norm_bwd(
            grad_y, grad_h, h, weight, bias, mean, rstd, seed, ctx.prob, lb_dtype, rms_norm=ctx.rms_norm,
            zero_centered_gamma=ctx.zero_centered_gamma, need_dx=ctx.needs_input_grad[0])
        return dx, dlb, dres, dweight, dbias, *none5


def _has_own_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks or backward (pre-)hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _global_module_hooks() -> bool:
    """Whether PyTorch's global module hooks are registered (they run around every module's call)."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would run hooks: its own forward (pre-)hooks or backward
    (pre-)hooks, or PyTorch's global module hooks."""
    return _has_own_hooks(module) or _global_module_hooks()


class FusedNorm:
    """Build the norm ``config.normalization`` names: :class:`FusedLayerNorm` or :class:`FusedRMSNorm`.

    ``FusedNorm(config, hidden_size, eps=1e-5, backend="fusedlib", device=None, dtype=None)`` returns an instance of
    one of the two classes, as Megatron's ``TENorm`` returns Transformer Engine's
    ``LayerNorm`` or ``RMSNorm``; put it in a layer spec's norm slot.

    Raises:
        ValueError, TypeError: as the class it builds (a config without a normalization field:
            a TypeError naming config).

    Source: Megatron-LM ``megatron/core/extensions/transformer_engine.py`` (``TENorm``).
    """

    def __new__(cls, config, hidden_size: Union[int, Sequence[int]], eps: float = 1e-5, *,
                backend: str = "fusedlib", device: Optional[Union[torch.device, str]] = None,
                dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
        if getattr(config, "normalization", None) == "RMSNorm":  # (no field: FusedLayerNorm names config)
            return FusedRMSNorm(config, hidden_size, eps, backend=backend, device=device, dtype=dtype)
        return FusedLayerNorm(config, hidden_size, eps, backend=backend, device=device, dtype=dtype)
