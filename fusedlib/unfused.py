"""Plain PyTorch references: the "unfused" path and the tests' oracle.

Each function here computes an op the way an eager PyTorch program would, one
elementwise kernel per operator. Called on float64 tensors they are the reference
that fusedlib's Triton kernels are tested against; called on the training dtype they
are the "eager" baseline of the benchmark.

Sources: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (the tanh GeLU and
its derivative), Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016).
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "SQRT_2_OVER_PI",
    "GELU_COEF",
    "GELU_DERIV_COEF",
    "gelu_tanh",
    "gelu_tanh_grad",
    "gelu_erf",
    "gelu_erf_grad",
    "bias_gelu",
    "bias_gelu_back",
]

#: sqrt(2/pi) = 0.7978845608..., the slope of the tanh argument (Hendrycks & Gimpel).
SQRT_2_OVER_PI: float = math.sqrt(2.0 / math.pi)
#: 0.044715, the cubic coefficient of the tanh approximation (fitted in the GeLU paper).
GELU_COEF: float = 0.044715
#: sqrt(2/pi) * 3 * 0.044715 = 0.1070322243..., from d/dx of sqrt(2/pi)*(x + 0.044715 x^3).
GELU_DERIV_COEF: float = SQRT_2_OVER_PI * 3.0 * GELU_COEF


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GeLU, 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³))).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x``.
    """
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF * x * x)))


def gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx of :func:`gelu_tanh`, written as Megatron-core's ``bias_gelu_back`` writes it:
    0.5·x·(1 - tanh²)·(0.79788456 + 0.1070322243·x²) + 0.5·(1 + tanh).

    Args:
        x: any shape, any float dtype.

    Returns:
        Tensor like ``x``.
    """
    t = torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF * x * x))
    return 0.5 * x * ((1.0 - t * t) * (SQRT_2_OVER_PI + GELU_DERIV_COEF * x * x)) + 0.5 * (1.0 + t)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU, x·Φ(x) = 0.5·x·(1 + erf(x/sqrt(2))).

    Args:
        x: any shape, any float dtype.

    Returns:
        Tensor like ``x``.
    """
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_erf_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx of :func:`gelu_erf`: Φ(x) + x·φ(x), with φ(x) = exp(-x²/2)/sqrt(2·pi).

    Args:
        x: any shape, any float dtype.

    Returns:
        Tensor like ``x``.
    """
    return 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0)))) + x * torch.exp(-0.5 * x * x) * (
        1.0 / math.sqrt(2.0 * math.pi)
    )


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unfused bias + tanh-GeLU: ``gelu_tanh(bias + y)``, Megatron-core's argument order.

    Args:
        bias: [h].
        y: [..., h].

    Returns:
        [..., h], dtype of ``bias + y``.
    """
    return gelu_tanh(bias + y)


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unfused gradient of :func:`bias_gelu` w.r.t. its input: ``gelu_tanh_grad(bias + y) * g``.

    Args:
        g: grad of the output, [..., h].
        bias: [h].
        y: [..., h].

    Returns:
        [..., h]: the gradient w.r.t. ``y``; the bias gradient is its sum over leading dims.
    """
    return gelu_tanh_grad(bias + y) * g


# --- cross entropy (chapter 6) -------------------------------------------------------------
# Sources: Megatron-LM megatron/core/tensor_parallel/cross_entropy.py (label smoothing spread
# over the V - 1 wrong ids); PyTorch torch.nn.functional.cross_entropy.

__all__ += ["megatron_smoothing_to_torch", "cross_entropy", "cross_entropy_grad"]


def megatron_smoothing_to_torch(label_smoothing: float, vocab_size: int) -> float:
    """PyTorch's ``label_smoothing`` equal to Megatron's: s = eps·V/(V - 1).

    Megatron spreads probability eps over the V - 1 wrong ids; PyTorch spreads s over all V
    ids (the target included), so eps·V/(V-1) in PyTorch is eps in Megatron.
    """
    return label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy of full-vocabulary logits, with Megatron's label smoothing.

    Args:
        logits: [..., V], any float dtype (computed in it; float64 for the tests' oracle).
        target: [...] int ids in [0, V) or ``ignore_index``.
        label_smoothing: Megatron's epsilon.
        ignore_index: ids whose loss is 0.

    Returns:
        [...] losses, ``F.cross_entropy(reduction="none")`` with the converted smoothing.
    """
    v = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, v), target.reshape(-1).long(), reduction="none", ignore_index=ignore_index,
        label_smoothing=megatron_smoothing_to_torch(label_smoothing, v))
    return loss.view(target.shape)


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, grad_output: torch.Tensor,
                       label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """The gradient of :func:`cross_entropy` written out: ``(softmax(x) - (1 - s)·onehot - s/V)·g``.

    Args:
        logits: [..., V]; target: [...]; grad_output: [...] (g per token).
        label_smoothing: Megatron's epsilon (s = eps·V/(V-1)); ignore_index: rows with zero gradient.

    Returns:
        [..., V] in the logits' dtype.
    """
    v = logits.shape[-1]
    s = megatron_smoothing_to_torch(label_smoothing, v)
    active = target != ignore_index
    onehot = torch.nn.functional.one_hot(torch.where(active, target, 0).long(), v).to(logits.dtype)
    g = torch.where(active, grad_output, 0).to(logits.dtype).unsqueeze(-1)
    return (torch.softmax(logits, dim=-1) - (1 - s) * onehot - s / v) * g


# ---------------------------------------------------------------------------------------
# bias + dropout + residual add (chapter 2)
# Source: Megatron-LM megatron/core/fusions/fused_bias_dropout.py (_bias_dropout_add_func).
# ---------------------------------------------------------------------------------------


def bias_dropout_add(
    x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """Unfused ``residual + dropout(x + bias, prob)``, as Megatron-core's ``_bias_dropout_add_func``.

    Three eager kernels (add bias, dropout, add residual); ``torch.nn.functional.dropout``
    draws its mask from torch's generator and, with autograd, keeps it for the backward.

    Args:
        x_with_bias: ``(x, bias)``: x [..., h]; bias [h] or None.
        residual: [..., h]. When its dtype differs from x's (``fp32_residual_connection``:
            x bf16, residual fp32), x and bias are cast to it, so the sum stays in its dtype.
        prob: dropout probability in [0, 1].
        training: dropout on, or the identity.

    Returns:
        ``residual + dropout(x + bias)`` in the residual's dtype. In inference with no input
        requiring grad and x of the residual's dtype, computed in place: the result is x.

    Raises:
        ValueError: from ``torch.nn.functional.dropout`` for prob outside [0, 1].
    """
    x, bias = x_with_bias
    # In place in eval mode when nothing needs a gradient (Megatron's inference path)
    inplace = (not training and not x.requires_grad and not residual.requires_grad
               and (bias is None or not bias.requires_grad))
    if x.dtype != residual.dtype:
        x = x.to(residual.dtype)  # a new tensor: the in-place ops below then leave x alone
    if bias is not None and bias.dtype != residual.dtype:
        bias = bias.to(residual.dtype)
    if bias is not None:
        x = x.add_(bias) if inplace else x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training, inplace=inplace)
    return out.add_(residual) if inplace else residual + out


def bias_dropout_add_masked(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, keep: torch.Tensor, prob: float
) -> torch.Tensor:
    """``residual + keep·(x + bias)/(1 - prob)`` for a given keep mask: the tests' oracle.

    Args:
        x: [..., h]; call with float64 tensors for a reference.
        bias: [h] or None.
        residual: [..., h].
        keep: bool, x's shape: True where an element is kept.
        prob: the dropout probability the mask was drawn with (1/(1 - prob) scales kept values;
            prob = 1 keeps nothing).

    Returns:
        [..., h], dtype of ``x + residual``.
    """
    v = x + bias if bias is not None else x
    scale = 0.0 if prob >= 1.0 else 1.0 / (1.0 - prob)
    return residual + torch.where(keep, v * scale, torch.zeros_like(v))


__all__ += ["bias_dropout_add", "bias_dropout_add_masked"]
