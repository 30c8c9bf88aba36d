"""Plain PyTorch references: the "unfused" path and the tests' oracle.

Each function here computes an op the way an eager PyTorch program would, one
elementwise kernel per operator. Called on float64 tensors they are the reference
that fusedlib's Triton kernels are tested against; called on the training dtype they
are the "eager" baseline of the benchmark.

Sources: Megatron-LM (``megatron/core/fusions/``, ``megatron/core/transformer/``,
``megatron/core/tensor_parallel/cross_entropy.py``, ``megatron/core/models/common/embeddings/
rope_utils.py``) and the papers each function names in its docstring's ``Source:`` line.

Argument checks are cheap host-side Python tests of shapes and Python scalars (no tensor op,
no device sync), so the functions the benchmark times as eager baselines run Megatron's ops
unchanged. A function documents a dtype of its inputs without checking it.
"""
from __future__ import annotations

import math
import numbers

import torch

from .checks import check_window_size

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
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own (torch's errors for a non-float tensor).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu``); Hendrycks &
    Gimpel, "Gaussian Error Linear Units" (2016), arXiv:1606.08415.
    """
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF * x * x)))


def gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx of :func:`gelu_tanh`, written as Megatron-core's ``bias_gelu_back`` writes it:
    0.5·x·(1 - tanh²)·(0.79788456 + 0.1070322243·x²) + 0.5·(1 + tanh).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu_back``).
    """
    t = torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF * x * x))
    return 0.5 * x * ((1.0 - t * t) * (SQRT_2_OVER_PI + GELU_DERIV_COEF * x * x)) + 0.5 * (1.0 + t)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU, x·Φ(x) = 0.5·x·(1 + erf(x/sqrt(2))).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016), arXiv:1606.08415 (the exact
    form; ``torch.nn.functional.gelu(approximate="none")``).
    """
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_erf_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx of :func:`gelu_erf`: Φ(x) + x·φ(x), with φ(x) = exp(-x²/2)/sqrt(2·pi).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: Hendrycks & Gimpel (2016), arXiv:1606.08415, differentiated.
    """
    return 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0)))) + x * torch.exp(-0.5 * x * x) * (
        1.0 / math.sqrt(2.0 * math.pi)
    )


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unfused bias + tanh-GeLU: ``gelu_tanh(bias + y)``, Megatron-core's argument order.

    Args:
        bias: [h], any float dtype.
        y: [..., h], any float dtype.

    Returns:
        [..., h], dtype of ``bias + y`` (torch's promotion).

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu``).
    """
    return gelu_tanh(bias + y)


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unfused gradient of :func:`bias_gelu` w.r.t. its input: ``gelu_tanh_grad(bias + y) * g``.

    Args:
        g: grad of the output, [..., h].
        bias: [h].
        y: [..., h]; all three any float dtype.

    Returns:
        [..., h] of the promoted dtype of ``g``, ``bias`` and ``y``: the gradient w.r.t. ``y``;
        the bias gradient is its sum over leading dims.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (``bias_gelu_back``).
    """
    return gelu_tanh_grad(bias + y) * g


# --- cross entropy (chapter 6) -------------------------------------------------------------
# Sources: Megatron-LM megatron/core/tensor_parallel/cross_entropy.py (label smoothing spread
# over the V - 1 wrong ids); PyTorch torch.nn.functional.cross_entropy.

__all__ += ["megatron_smoothing_to_torch", "cross_entropy", "cross_entropy_grad"]


def _check_label_smoothing(label_smoothing: float, vocab_size: int) -> None:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a real number in [0, 1), got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing < 1.0:  # NaN fails this too
        raise ValueError(f"label_smoothing must be in [0, 1) (Megatron asserts 0 < eps < 1 when smoothing), "
                         f"got {label_smoothing!r}")
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError(f"label_smoothing > 0 needs a vocabulary of at least 2 ids (eps is spread over the "
                         f"V - 1 wrong ids), got V = {vocab_size}")


def _check_target(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() < 1:
        raise ValueError("logits must be [..., V] with at least one dim, got a 0-d tensor")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer vocabulary ids (an integer dtype), got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have shape {list(logits.shape[:-1])} (the logits' shape without the "
                         f"vocabulary dim), got {list(target.shape)}")


def megatron_smoothing_to_torch(label_smoothing: float, vocab_size: int) -> float:
    """PyTorch's ``label_smoothing`` equal to Megatron's: s = eps·V/(V - 1).

    Megatron spreads probability eps over the V - 1 wrong ids; PyTorch spreads s over all V
    ids (the target included), so eps·V/(V-1) in PyTorch is eps in Megatron. For
    eps > (V - 1)/V, s > 1: Megatron's formula ``(1 - s)·nll - s·mean(log p)`` still holds (its
    loss then rewards the wrong ids), but ``torch.nn.functional.cross_entropy`` refuses s > 1;
    :func:`cross_entropy` computes that case itself.

    Args:
        label_smoothing: Megatron's epsilon, a real number in [0, 1).
        vocab_size: V, the full vocabulary size.

    Returns:
        s as a Python float (0.0 for eps = 0).

    Raises:
        TypeError: label_smoothing not a real number (or a bool).
        ValueError: label_smoothing outside [0, 1), or > 0 with vocab_size < 2.

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``VocabParallelCrossEntropy``: ``smoothing = label_smoothing * vocab_size / (vocab_size - 1)``).
    """
    _check_label_smoothing(label_smoothing, vocab_size)
    return label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy of full-vocabulary logits, with Megatron's label smoothing.

    ``(1 - s)·(-log p_target) - s·mean_j(log p_j)`` with s = :func:`megatron_smoothing_to_torch`
    of eps: ``torch.nn.functional.cross_entropy(reduction="none")`` for s <= 1, the same formula
    written out (log_softmax, gather, mean) for s > 1, which torch refuses.

    Args:
        logits: [..., V], any float dtype (computed in it; float64 for the tests' oracle).
        target: [...] (the logits' shape without V), an integer dtype: ids in [0, V) or
            ``ignore_index``.
        label_smoothing: Megatron's epsilon in [0, 1).
        ignore_index: ids whose loss is 0.

    Returns:
        [...] losses (target's shape), in the logits' dtype.

    Raises:
        TypeError: target of a float, complex or bool dtype; label_smoothing not a real number.
        ValueError: target's shape not the logits' leading dims; label_smoothing outside [0, 1),
            or > 0 with V < 2. (torch's errors for a target id outside [0, V).)

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py`` (label smoothing spread
    over the V - 1 wrong ids); PyTorch ``torch.nn.functional.cross_entropy``.
    """
    _check_target(logits, target)
    v = logits.shape[-1]
    s = megatron_smoothing_to_torch(label_smoothing, v)
    if s <= 1.0:
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, v), target.reshape(-1).long(), reduction="none", ignore_index=ignore_index,
            label_smoothing=s)
    else:  # eps > (V - 1)/V: torch refuses s > 1, Megatron's formula does not
        t = target.reshape(-1).long()
        active = t != ignore_index
        logp = torch.log_softmax(logits.reshape(-1, v), dim=-1)  # [rows, V]
        nll = -logp.gather(-1, torch.where(active, t, 0).unsqueeze(-1)).squeeze(-1)  # [rows]
        loss = torch.where(active, (1.0 - s) * nll - s * logp.mean(dim=-1), 0.0)
    return loss.view(target.shape)


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, grad_output: torch.Tensor,
                       label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """The gradient of :func:`cross_entropy` written out: ``(softmax(x) - (1 - s)·onehot - s/V)·g``.

    Args:
        logits: [..., V], any float dtype.
        target: [...] (the logits' shape without V), an integer dtype.
        grad_output: [...] (g per token; broadcast against target).
        label_smoothing: Megatron's epsilon in [0, 1) (s = eps·V/(V-1)).
        ignore_index: rows with zero gradient.

    Returns:
        [..., V] in the logits' dtype.

    Raises:
        TypeError, ValueError: as :func:`cross_entropy`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
    (``VocabParallelCrossEntropy.backward``).
    """
    _check_target(logits, target)
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


def _check_prob(name: str, p: float) -> None:
    """A dropout probability in [0, 1] (as ``torch.nn.functional.dropout`` requires)."""
    if not 0.0 <= p <= 1.0:  # NaN fails this too
        raise ValueError(f"{name} must be a dropout probability in [0, 1], got {p!r}")


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
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``_bias_dropout_add_func``).
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
        [..., h], dtype of ``x + residual`` (and bias, promoted).

    Raises:
        ValueError: prob outside [0, 1] (or NaN).
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``_bias_dropout_add_func``,
    with the dropout mask given).
    """
    _check_prob("prob", prob)
    v = x + bias if bias is not None else x
    scale = 0.0 if prob >= 1.0 else 1.0 / (1.0 - prob)
    return residual + torch.where(keep, v * scale, torch.zeros_like(v))


__all__ += ["bias_dropout_add", "bias_dropout_add_masked"]


# ---------------------------------------------------------------------------------------------
# Gated linear units (chapter 3). Sources: Shazeer, "GLU Variants Improve Transformer" (2020);
# Megatron-LM megatron/core/fusions/fused_bias_swiglu.py, fused_bias_geglu.py,
# fused_weighted_squared_relu.py. y = [y1 | y2] of width 2h; y1, y2 = torch.chunk(y, 2, -1).
# ---------------------------------------------------------------------------------------------

__all__ += [
    "silu",
    "silu_grad",
    "swiglu",
    "bias_swiglu",
    "swiglu_back",
    "bias_swiglu_back",
    "weighted_swiglu",
    "weighted_swiglu_back",
    "clamped_swiglu",
    "bias_clamped_swiglu",
    "clamped_swiglu_back",
    "bias_clamped_swiglu_back",
    "clamped_weighted_swiglu",
    "clamped_weighted_swiglu_back",
    "geglu",
    "bias_geglu",
    "geglu_back",
    "bias_geglu_back",
    "squared_relu",
    "weighted_squared_relu",
    "weighted_squared_relu_back",
]


def _check_row_weights(weights: torch.Tensor, y: torch.Tensor, y_name: str) -> None:
    """weights [n, 1] for y [n, k] (n rows), Megatron's per-token router weights. A host-side
    shape test: weights [n] would broadcast along y's columns instead of its rows."""
    if weights.dim() != 2 or weights.shape[1] != 1 or y.dim() != 2 or weights.shape[0] != y.shape[0]:
        raise ValueError(f"weights must have shape [n, 1] for {y_name} [n, k] (one weight per row), got weights "
                         f"{list(weights.shape)} and {y_name} {list(y.shape)}")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number > 0, got {type(value).__name__}")
    if not value > 0:  # NaN fails this too
        raise ValueError(f"{name} must be > 0, got {value!r}")


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish), x·σ(x), written out (torch.nn.functional.silu is the same function).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: Elfwing et al., "Sigmoid-Weighted Linear Units" (2017), arXiv:1702.03118; Megatron-LM
    ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu``, via ``F.silu``).
    """
    return x * torch.sigmoid(x)


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx of :func:`silu`: σ(x)·(1 + x·(1 - σ(x))), as Megatron's ``swiglu_back`` writes it.

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu_back``).
    """
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(y1)·y2 with y1, y2 = chunk(y, 2, -1), as Megatron's ``swiglu`` writes it
    (``F.silu``: two eager kernels, silu and the product).

    Args:
        y: [..., 2h], any float dtype; computed in that dtype.

    Returns:
        [..., h], y's dtype.

    Raises:
        Nothing of its own (an odd last dim gives torch.chunk's unequal halves and torch's
        broadcast error).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu``); Shazeer, "GLU
    Variants Improve Transformer" (2020), arXiv:2002.05202.
    """
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(y1) * y2


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Unfused bias + SwiGLU: ``swiglu(y + bias)`` (Megatron's argument order: y, bias).

    Args:
        y: [..., 2h], any float dtype.
        bias: [2h], any float dtype.

    Returns:
        [..., h], dtype of ``y + bias``.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu``).
    """
    return swiglu(y + bias)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` w.r.t. y: [g·y2·silu'(y1) | g·silu(y1)].

    Args:
        g: grad of the output, [..., h].
        y: [..., 2h]; both any float dtype.

    Returns:
        [..., 2h], dtype of ``g * y``.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``swiglu_back``).
    """
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.cat((g * y2 * silu_grad(y1), g * silu(y1)), -1)


def bias_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`bias_swiglu` w.r.t. y (the bias gradient is its sum over leading dims).

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h]. Any float dtypes.

    Returns:
        [..., 2h], the promoted dtype.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_swiglu_back``).
    """
    return swiglu_back(g, y + bias)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Row-weighted SwiGLU of MoE experts: ``(swiglu(y)·weights).to(y.dtype)``.

    Args:
        y: [n, 2h], any float dtype.
        weights: [n, 1], e.g. the router probability of each token (often float32).

    Returns:
        [n, h], y's dtype (the product is formed in the promoted dtype, as in Megatron).

    Raises:
        ValueError: y not 2-D or weights not of shape [n, 1] (a [n] vector would scale columns).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``weighted_swiglu``).
    """
    _check_row_weights(weights, y, "y")
    return (swiglu(y) * weights).to(y.dtype)


def weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor,
                         weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_swiglu`: ``(swiglu_back(g·w, y), sum_h swiglu(y)·g)``.

    Args:
        g: [n, h]. y: [n, 2h]. weights: [n, 1]. Any float dtypes.

    Returns:
        ``(dy, dweights)``: dy [n, 2h] in y's dtype, dweights [n, 1] in weights' dtype.

    Raises:
        ValueError: y not 2-D or weights not of shape [n, 1].

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``weighted_swiglu_back``).
    """
    _check_row_weights(weights, y, "y")
    dy = swiglu_back(g * weights, y).to(y.dtype)
    dw = (swiglu(y) * g.to(weights.dtype)).sum(-1, keepdim=True)
    return dy, dw.to(weights.dtype)


def _clamp_dtype(dtype: torch.dtype) -> torch.dtype:
    # Megatron's clamped units compute in float32; float64 stays float64 here (the reference).
    return torch.promote_types(dtype, torch.float32)


def clamped_swiglu(y: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Clamped SwiGLU, ``silu(min(y1, c))·clamp(y2, -c, c)``, as Megatron-core's ``clamped_swiglu``.

    The gate half is clamped from above only, the linear half on both sides (gpt-oss's
    ``swiglu_limit`` is such a c, with c = 7). Computed in float32 (float64 for float64 input:
    Megatron casts every dtype to float32) and cast back to y's dtype. Autograd through
    ``torch.clamp`` gives the clamp's gradient: 1 for y1 <= c (and -c <= y2 <= c), else 0.

    Args:
        y: [..., 2h], any float dtype.
        clamp_value: c > 0, a real number.

    Returns:
        [..., h], y's dtype.

    Raises:
        TypeError: clamp_value not a real number (or a bool).
        ValueError: clamp_value <= 0 or NaN (clamp(y2, -c, c) with c <= 0 is no clamp to [-c, c]).

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_swiglu``).
    """
    _check_positive("clamp_value", clamp_value)
    y1, y2 = torch.chunk(y.to(_clamp_dtype(y.dtype)), 2, -1)
    out = torch.nn.functional.silu(y1.clamp(max=clamp_value)) * y2.clamp(min=-clamp_value, max=clamp_value)
    return out.to(y.dtype)


def bias_clamped_swiglu(y: torch.Tensor, bias: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Unfused ``clamped_swiglu(y + bias, c)``: the clamps act after the bias (Megatron's order).

    Args:
        y: [..., 2h]. bias: [2h]. clamp_value: c > 0.

    Returns:
        [..., h], dtype of ``y + bias``.

    Raises:
        TypeError, ValueError: as :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_clamped_swiglu``).
    """
    return clamped_swiglu(y + bias, clamp_value)


def clamped_swiglu_back(g: torch.Tensor, y: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Gradient of :func:`clamped_swiglu` w.r.t. the unclamped y, as Megatron's ``clamped_swiglu_back``.

    With x1 = min(y1, c), x2 = clamp(y2, -c, c):
    ``[g·x2·silu'(x1)·[y1 <= c] | g·silu(x1)·[-c <= y2 <= c]]``: zero where a clamp is
    active, passing at the boundary itself (as torch.clamp's autograd).

    Args:
        g: [..., h]. y: [..., 2h]. clamp_value: c > 0.

    Returns:
        [..., 2h], y's dtype (computed in float32, float64 for float64).

    Raises:
        TypeError, ValueError: as :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_swiglu_back``).
    """
    _check_positive("clamp_value", clamp_value)
    acc = _clamp_dtype(y.dtype)
    y1, y2 = torch.chunk(y.to(acc), 2, -1)
    x1, x2 = y1.clamp(max=clamp_value), y2.clamp(min=-clamp_value, max=clamp_value)
    g = g.to(torch.promote_types(g.dtype, acc))
    keep1 = y1 <= clamp_value
    keep2 = (y2 >= -clamp_value) & (y2 <= clamp_value)
    dy1 = torch.where(keep1, g * x2 * silu_grad(x1), 0.0)
    dy2 = torch.where(keep2, g * silu(x1), 0.0)
    return torch.cat((dy1, dy2), -1).to(y.dtype)


def bias_clamped_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor,
                             clamp_value: float) -> torch.Tensor:
    """Gradient of :func:`bias_clamped_swiglu` w.r.t. y (the bias gradient is its sum over leading dims).

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h]. clamp_value: c > 0.

    Returns:
        [..., 2h], dtype of ``y + bias``.

    Raises:
        TypeError, ValueError: as :func:`clamped_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``bias_clamped_swiglu_back``).
    """
    return clamped_swiglu_back(g, y + bias, clamp_value)


def clamped_weighted_swiglu(y: torch.Tensor, weights: torch.Tensor, clamp_value: float) -> torch.Tensor:
    """Row-weighted clamped SwiGLU: ``(clamped_swiglu(y, c)·weights).to(y.dtype)``, as Megatron
    writes it (the clamped unit is rounded to y's dtype before the product).

    Args:
        y: [n, 2h]. weights: [n, 1]. clamp_value: c > 0.

    Returns:
        [n, h], y's dtype.

    Raises:
        TypeError: clamp_value not a real number.
        ValueError: y not 2-D, weights not of shape [n, 1], or clamp_value <= 0.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_weighted_swiglu``).
    """
    _check_row_weights(weights, y, "y")
    return (clamped_swiglu(y, clamp_value) * weights).to(y.dtype)


def clamped_weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                                 clamp_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`clamped_weighted_swiglu`:
    ``(clamped_swiglu_back(g·w, y, c), sum_h clamped_swiglu(y, c)·g)``.

    Args:
        g: [n, h]. y: [n, 2h]. weights: [n, 1]. clamp_value: c > 0.

    Returns:
        ``(dy, dweights)``: dy [n, 2h] in y's dtype, dweights [n, 1] in weights' dtype.

    Raises:
        TypeError, ValueError: as :func:`clamped_weighted_swiglu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_swiglu.py`` (``clamped_weighted_swiglu_back``).
    """
    _check_row_weights(weights, y, "y")
    dy = clamped_swiglu_back(g * weights, y, clamp_value).to(y.dtype)
    dw = (clamped_swiglu(y, clamp_value) * g.to(weights.dtype)).sum(-1, keepdim=True)
    return dy, dw.to(weights.dtype)


def geglu(y: torch.Tensor) -> torch.Tensor:
    """GEGLU: gelu_tanh(y1)·y2 with y1, y2 = chunk(y, 2, -1), written as a PyTorch user would
    (``F.gelu(approximate="tanh")``, the same function as :func:`gelu_tanh`: two eager kernels).

    Args:
        y: [..., 2h], any float dtype; computed in that dtype.

    Returns:
        [..., h], y's dtype.

    Raises:
        Nothing of its own.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``geglu``); Shazeer (2020),
    arXiv:2002.05202.
    """
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.gelu(y1, approximate="tanh") * y2


def bias_geglu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unfused bias + GEGLU: ``geglu(y + bias)`` (Megatron's argument order: bias, y).

    Args:
        bias: [2h].
        y: [..., 2h].

    Returns:
        [..., h], dtype of ``y + bias``.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``bias_geglu``).
    """
    return geglu(y + bias)


def geglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`geglu` w.r.t. y: [g·y2·gelu_tanh'(y1) | g·gelu_tanh(y1)].

    Args:
        g: [..., h]. y: [..., 2h].

    Returns:
        [..., 2h], dtype of ``g * y``.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``geglu_back``).
    """
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.cat((g * y2 * gelu_tanh_grad(y1), g * gelu_tanh(y1)), -1)


def bias_geglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`bias_geglu` w.r.t. y (Megatron's argument order: g, y, bias).

    Args:
        g: [..., h]. y: [..., 2h]. bias: [2h].

    Returns:
        [..., 2h], the promoted dtype.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_geglu.py`` (``bias_geglu_back``).
    """
    return geglu_back(g, y + bias)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, relu(x)² (So et al., "Primer", 2021).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        Nothing of its own.

    Source: So et al., "Primer: Searching for Efficient Transformers" (2021), arXiv:2109.08668;
    Megatron-LM ``megatron/core/activations.py`` (``squared_relu``).
    """
    return torch.relu(x) ** 2


def _soft_clamped_relu(x: torch.Tensor, clamp_scale: float | None) -> torch.Tensor:
    r = torch.relu(x)
    return r if clamp_scale is None else clamp_scale * torch.tanh(r / clamp_scale)


def weighted_squared_relu(x: torch.Tensor, weights: torch.Tensor, clamp_scale: float | None = None) -> torch.Tensor:
    """Row-weighted squared ReLU: ``(c²·weights).to(x.dtype)`` with c = relu(x), or, with
    ``clamp_scale`` s, the soft-clamped c = s·tanh(relu(x)/s) (computed without Megatron's
    intermediate rounding of c).

    Args:
        x: [n, h], any float dtype; computed in the dtype of ``x * weights``.
        weights: [n, 1].
        clamp_scale: s > 0, or None.

    Returns:
        [n, h], x's dtype.

    Raises:
        TypeError: clamp_scale neither None nor a real number.
        ValueError: x not 2-D, weights not of shape [n, 1], or clamp_scale <= 0 or NaN (s = 0
            would divide by 0).

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``
    (``weighted_squared_relu``).
    """
    _check_row_weights(weights, x, "x")
    if clamp_scale is not None:
        _check_positive("clamp_scale", clamp_scale)
    c = _soft_clamped_relu(x, clamp_scale)
    return (c * c * weights).to(x.dtype)


def weighted_squared_relu_back(g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                               clamp_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_squared_relu`: dx = 2·c·c'(x)·g·w, dw = sum_h c²·g.

    Args:
        g: [n, h]. x: [n, h]. weights: [n, 1]. clamp_scale: s > 0, or None.

    Returns:
        ``(dx, dweights)``: dx [n, h] in x's dtype, dweights [n, 1] in weights' dtype.

    Raises:
        TypeError, ValueError: as :func:`weighted_squared_relu`.

    Source: Megatron-LM ``megatron/core/fusions/fused_weighted_squared_relu.py``
    (``weighted_squared_relu_back``).
    """
    _check_row_weights(weights, x, "x")
    if clamp_scale is not None:
        _check_positive("clamp_scale", clamp_scale)
    c = _soft_clamped_relu(x, clamp_scale)
    dc = 2.0 * c if clamp_scale is None else 2.0 * c * (1.0 - (c / clamp_scale) ** 2)
    dx = (dc * g * weights).to(x.dtype)
    dw = (c * c * g.to(weights.dtype)).sum(-1, keepdim=True)
    return dx, dw.to(weights.dtype)


# ---------------------------------------------------------------------------------------------
# Attention softmax (chapter 5)
# ---------------------------------------------------------------------------------------------


def _check_size(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")


def causal_mask(sq: int, sk: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Causal mask [sq, sk], bool, True = masked: query q sees keys j <= q + sk - sq.

    The diagonal is aligned bottom-right, so the sq queries are the *last* sq positions of an
    sk-long sequence (a KV cache: sq = 1 sees every key). For sq == sk it is Megatron-core's
    ``get_default_causal_mask(sq)``, ``triu(ones(sq, sq), diagonal=1)``; for sq > sk the first
    sq - sk rows are fully masked.

    Args:
        sq: queries; sk: keys (default sq); ints >= 0. device: where to build it (None: torch's
            default device, as for ``torch.ones``).

    Returns:
        A new bool tensor [sq, sk] on ``device``, True = masked.

    Raises:
        ValueError: sq or sk not an int >= 0.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_default_causal_mask``).
    """
    sk = sq if sk is None else sk
    _check_size("sq", sq)
    _check_size("sk", sk)
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=sk - sq + 1)


def sliding_window_causal_mask(sq: int, sk: int, window_size: tuple[int, int],
                               device: torch.device | str | None = None) -> torch.Tensor:
    """Sliding-window mask [sq, sk], bool, True = masked, as Megatron-core's
    ``get_sliding_window_causal_mask``: query q sees sk - sq - left <= j - q <= sk - sq + right.

    Args:
        sq, sk: queries and keys, ints >= 0.
        window_size: ``(left, right)``, ints >= -1; -1 on a side means unbounded on that side.
        device: where to build it (None: torch's default device).

    Returns:
        A new bool tensor [sq, sk] on ``device``, True = masked.

    Raises:
        ValueError: sq or sk not an int >= 0; window_size not a pair of ints >= -1 (another
            negative value is not "unbounded").

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_sliding_window_causal_mask``).
    """
    _check_size("sq", sq)
    _check_size("sk", sk)
    left, right = check_window_size(window_size, allow_none=False)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep = keep.triu(diagonal=sk - sq - left)
    if right >= 0:
        keep = keep.tril(diagonal=sk - sq + right)
    return ~keep


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron-core's ``attention_mask_func``: scores with masked entries set to -10000.

    Unlike Megatron-core's, which fills in place (``masked_fill_``), this returns a new tensor.

    Args:
        attention_scores: [b, np, sq, sk], any float dtype.
        attention_mask: bool, broadcastable to the scores, True = masked.

    Returns:
        A new tensor of the scores' shape and dtype.

    Raises:
        RuntimeError: from torch, for a mask that is not bool or does not broadcast.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``attention_mask_func``).
    """
    return attention_scores.masked_fill(attention_mask, -10000.0)


def _as_offset(offset: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """The sink logit(s) as a tensor of x's dtype and device (differentiable for a tensor)."""
    if isinstance(offset, torch.Tensor):
        return offset.to(dtype=x.dtype, device=x.device)
    return torch.full((), float(offset), dtype=x.dtype, device=x.device)  # a fill: no host-to-device copy


def softmax_one(x: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """Megatron-core's ``SoftmaxOne.forward``: softmax over the row plus one sink logit.

    p_j = e^{x_j} / (e^{offset} + sum_k e^{x_k}): the sink column is appended, the softmax
    taken, the sink column dropped.

    Args:
        x: [b, np, sq, sk] (or any [..., sk] with a scalar offset), any float dtype; computed in it.
        offset: the sink logit: a float, a 0-d/[1] tensor, or [np] (one per head).

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        RuntimeError, IndexError: from torch, for a per-head offset with x not 4-D or not [np]
            heads.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``SoftmaxOne``); the
    "off-by-one" softmax of gpt-oss's attention sinks.
    """
    off = _as_offset(offset, x)
    if off.numel() != 1:  # (per head; at np = 0 an empty [np] too)
        sink = off.reshape(1, -1, 1, 1).expand(x.size(0), -1, x.size(2), 1)  # [np] -> [b, np, sq, 1]
    else:
        sink = off.reshape(-1)[:1].expand(*x.shape[:-1], 1)  # [..., 1]
    return torch.softmax(torch.cat([x, sink], dim=-1), dim=-1)[..., :-1]  # [..., sk+1] -> [..., sk]


def scale_mask_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    softmax_in_fp32: bool = True,
    softmax_offset: torch.Tensor | None = None,
    mask_func=attention_mask_func,
) -> torch.Tensor:
    """The unfused attention softmax, step by step as Megatron-core's
    ``FusedScaleMaskSoftmax.forward_torch_softmax`` computes it, plus one fix.

    [1] upcast fp16/bf16 to fp32 (``softmax_in_fp32``); [2] multiply by ``scale``; [3]
    ``mask_func`` (-10000 where masked); [4] softmax (or :func:`softmax_one` with an offset);
    [5] rows whose every key is masked are set to zero (the fix: -10000 everywhere would give a
    uniform row 1/sk; some Megatron-core versions zero them the same way); [6] cast back.

    Args:
        x: scores [b, np, sq, sk], any float dtype; never modified (it is copied before an
            in-place mask_func).
        mask: bool, broadcastable to x, True = masked; None for none.
        scale: multiplies x, or None.
        softmax_in_fp32: compute in float32 for fp16/bf16 inputs.
        softmax_offset: sink logit(s) for the off-by-one softmax, or None.
        mask_func: ``(scores, mask) -> scores``, Megatron-core's signature.

    Returns:
        Probabilities, x's shape and dtype (empty for sk = 0).

    Raises:
        RuntimeError: from torch, for a mask that is not bool or does not broadcast to x.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py``
    (``FusedScaleMaskSoftmax.forward_torch_softmax``).
    """
    orig_dtype = x.dtype
    s = x.float() if (softmax_in_fp32 and x.dtype in (torch.float16, torch.bfloat16)) else x
    if scale is not None:
        s = s * scale
    if mask is not None:
        s = mask_func(s.clone() if s is x else s, mask)  # Megatron's mask_func fills in place
    probs = torch.softmax(s, dim=-1) if softmax_offset is None else softmax_one(s, softmax_offset)
    if mask is not None:
        probs = probs * (~mask.all(dim=-1, keepdim=True)).to(probs.dtype)  # fully masked rows -> 0
    return probs.to(orig_dtype)


def masked_softmax_reference(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    softmax_offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The definition, for the tests: p = softmax(scale·x) over the kept keys, with -inf where
    masked, an optional sink logit per head, and zeros for a row with nothing kept.

    Written with differentiable torch ops (the row max is detached: softmax does not depend on
    it), so in float64 its autograd gradients are the oracle for the kernels' backward.

    Args:
        x: [b, np, sq, sk] or [np, sq, sk] (or any [..., sk] without a per-head offset), any
            float dtype; computed in it (pass float64 for the oracle).
        mask: bool, broadcastable to x, True = masked.
        scale: multiplies x.
        softmax_offset: None, a float, or a tensor of one sink logit ([] or [1]) or one per
            head ([np], paired with x's dim -3).

    Returns:
        Probabilities, x's shape and dtype (an empty tensor for sk = 0).

    Raises:
        ValueError: a per-head softmax_offset with x of fewer than 3 dims or whose dim -3 is not
            its length.
        RuntimeError: from torch, for a mask that is not bool or does not broadcast to x.

    Source: the softmax's definition (with the sink logit of Megatron-LM
    ``megatron/core/fusions/fused_softmax.py``'s ``SoftmaxOne``).
    """
    sink = None
    if softmax_offset is not None:
        off = _as_offset(softmax_offset, x)
        if off.numel() != 1:  # (per head; at np = 0 an empty [np] too)
            if x.dim() < 3 or x.shape[-3] != off.numel():
                raise ValueError(f"a per-head softmax_offset ([np] = [{off.numel()}]) pairs with x's dim -3 "
                                 f"(x [b, np, sq, sk] or [np, sq, sk]), got x {list(x.shape)}")
            sink = off.reshape(-1, 1, 1)  # [np] -> [np, 1, 1]: broadcasts along x's dim -3
        else:
            sink = off.reshape(-1)[:1]
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if s.shape[-1] == 0:  # no keys: nothing to normalise (amax of an empty dim raises)
        return s
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    d = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        d = d + torch.exp(sink - m)
    return e / torch.where(d > 0, d, torch.ones_like(d))


def softmax_backward(g: torch.Tensor, p: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Gradient of ``p = softmax(scale·x)`` w.r.t. x: scale·p·(g - sum(g·p)) over the last dim.

    Args:
        g: gradient of p, [..., sk]; p: the softmax output, [..., sk] (g's shape); both any float
            dtype. scale: the forward's scale.

    Returns:
        dx, [..., sk], dtype of ``g * p``.

    Raises:
        RuntimeError: from torch, for shapes that do not broadcast.

    Source: the softmax's Jacobian, diag(p) - p·pᵀ (as Megatron-LM's ``scaled_masked_softmax``
    CUDA backward computes it).
    """
    return scale * p * (g - (g * p).sum(dim=-1, keepdim=True))


def scale_mask_softmax_dropout(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    softmax_in_fp32: bool = True,
    softmax_offset: torch.Tensor | None = None,
    mask_func=attention_mask_func,
) -> torch.Tensor:
    """The unfused attention probabilities of Megatron-core's ``DotProductAttention``:
    :func:`scale_mask_softmax`, then ``torch.nn.functional.dropout``.

    The softmax writes p, the dropout reads it and writes the output and a one-byte-per-element
    mask, which autograd keeps (with p) for the backward.

    Args:
        x, mask, scale, softmax_in_fp32, softmax_offset, mask_func: as :func:`scale_mask_softmax`.
        dropout_p: dropout probability in [0, 1].
        training: dropout on, or the identity.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        ValueError: from ``torch.nn.functional.dropout`` for dropout_p outside [0, 1].
        RuntimeError: as :func:`scale_mask_softmax`.

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py``
    (``DotProductAttention.forward``: ``scale_mask_softmax``, then ``attention_dropout``).
    """
    probs = scale_mask_softmax(x, mask, scale, softmax_in_fp32, softmax_offset, mask_func)
    return torch.nn.functional.dropout(probs, p=dropout_p, training=training)


def masked_softmax_dropout_reference(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    keep: torch.Tensor,
    dropout_p: float,
    softmax_offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The definition with a given keep mask, for the tests: keep·p/(1 - dropout_p), p the
    :func:`masked_softmax_reference`. Differentiable: in float64 its autograd gradients are
    the oracle for the fused backward.

    Args:
        x, mask, scale, softmax_offset: as :func:`masked_softmax_reference`.
        keep: bool, x's shape: True where a probability is kept.
        dropout_p: the probability in [0, 1] the mask was drawn with (the fused kernels apply
            p' = round(p·2^16)/2^16: pass that); kept values are scaled by 1/(1 - dropout_p),
            by 0 for dropout_p = 1.

    Returns:
        Tensor like ``x`` (shape and dtype).

    Raises:
        ValueError: dropout_p outside [0, 1] (or NaN); as :func:`masked_softmax_reference`.

    Source: the definition of inverted dropout (Srivastava et al., JMLR 2014) on the softmax.
    """
    _check_prob("dropout_p", dropout_p)
    p = masked_softmax_reference(x, mask, scale, softmax_offset)
    keep_scale = 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)
    return torch.where(keep, p * keep_scale, torch.zeros_like(p))


__all__ += [
    "causal_mask",
    "sliding_window_causal_mask",
    "attention_mask_func",
    "softmax_one",
    "scale_mask_softmax",
    "masked_softmax_reference",
    "softmax_backward",
    "scale_mask_softmax_dropout",
    "masked_softmax_dropout_reference",
]


# ----------------------------------------------------------------------------------------
# The whole attention (chapter 8): the materialised reference of flash_attention
# ----------------------------------------------------------------------------------------


def attention_mask_bshd(sq: int, sk: int, *, causal: bool = False, attention_mask: torch.Tensor | None = None,
                        window_size: tuple[int, int] | None = None,
                        device: torch.device | str | None = None, b: int | None = None,
                        hq: int | None = None) -> torch.Tensor | None:
    """Everything :func:`attention_reference` masks, as one bool mask (True = masked),
    broadcastable to [b, hq, sq, sk], or None when nothing is masked.

    The union of :func:`causal_mask` (with ``causal``), :func:`sliding_window_causal_mask`
    (with a window: so causal and window intersect what stays visible) and the caller's mask
    ([b, sk] key padding, read as [b, 1, 1, sk], or 4-D). Built with triu/tril, independently
    of the kernels' band arithmetic.

    Args:
        sq, sk: queries and keys.
        causal: add the bottom-right aligned causal mask.
        attention_mask: bool, True = masked: [b, sk] (key padding) or 4-D broadcastable to
            [b, hq, sq, sk], as ``flash_attention`` accepts (a 3-D mask is refused: it would
            broadcast its batch dim against the heads).
        window_size: ``(left, right)``, ints >= -1, or None.
        device: where to build the causal and window masks.
        b, hq: batch size and query heads, when known: a 2-D mask must then be exactly [b, sk]
            (a [1, sk] one is refused, as ``flash_attention`` refuses it) and a 4-D one's first
            dims 1 or b, 1 or hq.

    Returns:
        A bool tensor [sq, sk], [b, 1, 1, sk], 4-D, or None.

    Raises:
        TypeError: attention_mask not a bool tensor.
        ValueError: attention_mask not 2-D or 4-D, or of a shape that does not match
            [b, sk] / [b or 1, hq or 1, sq or 1, sk or 1]; a bad window_size (as
            :func:`sliding_window_causal_mask`).

    Source: ``fusedlib.fusions.fused_attention.flash_attention``'s mask conventions; Megatron-LM
    ``megatron/core/transformer/utils.py`` (the causal and sliding-window masks).
    """
    masked = None
    if causal:
        masked = causal_mask(sq, sk, device=device)
    if window_size is not None:
        w = sliding_window_causal_mask(sq, sk, window_size, device=device)
        masked = w if masked is None else (masked | w)
    if attention_mask is not None:
        m = attention_mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise TypeError(f"attention_mask must be a bool tensor (True = masked), got "
                            f"{m.dtype if isinstance(m, torch.Tensor) else type(m).__name__}")
        if m.dim() == 2:
            if m.shape[1] != sk or (b is not None and m.shape[0] != b):
                raise ValueError(f"a 2-D attention_mask is a key-padding mask [b, sk] = [{'b' if b is None else b}, "
                                 f"{sk}], got {list(m.shape)}")
            m = m[:, None, None, :]
        elif m.dim() == 4:
            want = (b, hq, sq, sk)
            if not all(n is None or k in (1, n) for k, n in zip(m.shape, want)):
                shown = ["b" if b is None else b, "hq" if hq is None else hq, sq, sk]
                raise ValueError(f"a 4-D attention_mask must broadcast to [b, hq, sq, sk] = {shown}, "
                                 f"got {list(m.shape)}")
        else:
            raise ValueError(f"attention_mask must be [b, sk] (key padding) or 4-D [b or 1, hq or 1, sq or 1, "
                             f"sk or 1], got shape {list(m.shape)}")
        masked = m if masked is None else (m | masked)
    return masked


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention :func:`fusedlib.fusions.fused_attention.flash_attention` computes,
    materialised: scores [b, hq, sq, sk] in q's dtype (pass float64 tensors for the tests'
    oracle), -inf where masked, the softmax (with a sink per head), dropout, times v.

    Differentiable with torch ops (the row max is detached), so in float64 its autograd
    gradients are the oracle for the kernels' backward, d sinks included.

    Args:
        q: [b, sq, hq, d]; k, v: [b, sk, hkv, d] with hq % hkv == 0 (each key/value head is
            repeated for its hq/hkv query heads, here only). Any float dtype, one for all.
        causal, softmax_scale, attention_mask, window_size, sinks: as ``flash_attention``
            (masks: :func:`attention_mask_bshd`, with ``flash_attention``'s shape rules: [b, sk]
            or 4-D; a row with nothing visible and no sink is 0). sinks: [hq].
        dropout_p: the dropout probability in [0, 1]; kept probabilities are scaled by
            1/(1 - dropout_p), by 0 for 1 (pass the applied p' = round(p·2^16)/2^16 to match
            the kernels).
        deterministic: ignored (the reference has no atomics).
        dropout_mask: bool [b, hq, sq, sk], True = kept: the mask to apply (e.g.
            :func:`~fusedlib.kernels.flash_attention.flash_attn_dropout_mask` of the kernels'
            key); None with dropout_p > 0 draws one from torch's generator (then the result
            is a sample, not the kernels' one).

    Returns:
        [b, sq, hq, d] in q's dtype (zeros for sk = 0).

    Raises:
        ValueError: q, k, v not 4-D, hq not a multiple of hkv; dropout_p outside [0, 1];
            attention_mask or window_size as :func:`attention_mask_bshd`; sinks not [hq] (as
            :func:`masked_softmax_reference`).
        TypeError: attention_mask not bool.

    Source: Vaswani et al., "Attention Is All You Need" (2017), arXiv:1706.03762; Megatron-LM
    ``megatron/core/transformer/dot_product_attention.py`` (the unfused path materialises the same
    scores); ``fusedlib.fusions.fused_attention.flash_attention`` (its argument conventions).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [b, s, heads, d], got q {list(q.shape)}, k {list(k.shape)}, "
                         f"v {list(v.shape)}")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hkv})")
    _check_prob("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    group = hq // hkv
    k = k.repeat_interleave(group, dim=2)  # [b, sk, hkv, d] -> [b, sk, hq, d]
    v = v.repeat_interleave(group, dim=2)
    x = torch.einsum("bqhd,bkhd->bhqk", q, k)  # [b, hq, sq, sk]
    masked = attention_mask_bshd(sq, sk, causal=causal, attention_mask=attention_mask, window_size=window_size,
                                 device=q.device, b=b, hq=hq)
    p = masked_softmax_reference(x, masked, scale, sinks)
    if dropout_p > 0.0:
        keep = dropout_mask if dropout_mask is not None else \
            torch.rand(p.shape, device=p.device, dtype=torch.float32) >= dropout_p
        kept = p / (1.0 - dropout_p) if dropout_p < 1.0 else p * 0.0  # p = 1 keeps nothing
        p = torch.where(keep, kept, torch.zeros_like(p))
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


__all__ += ["attention_mask_bshd", "attention_reference"]


# ----------------------------------------------------------------------------------------
# LayerNorm and RMSNorm (chapter 4). Sources: Ba et al., "Layer Normalization" (2016),
# arXiv:1607.06450; Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019),
# arXiv:1910.07467; Megatron-LM megatron/core/fusions/fused_layer_norm.py (zero-centered gamma).
# ----------------------------------------------------------------------------------------

__all__ += ["layer_norm", "layer_norm_back", "rms_norm", "rms_norm_back"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight + 1 if zero_centered_gamma else weight


def _up(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32 (the statistics' dtype, as torch's and Megatron's norms); others as they are."""
    return t.float() if t.dtype in _HALF_DTYPES else t


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number > 0, got {type(eps).__name__}")
    if not 0.0 < eps < math.inf:  # NaN fails this too
        raise ValueError(f"eps must be a finite number > 0 (with eps = 0 a constant row gives 0/0 = NaN), got {eps!r}")
    h = x.shape[-1] if x.dim() else None
    if h is None or tuple(weight.shape) != (h,):
        raise ValueError(f"weight must have shape [h] for x [..., h], got weight {list(weight.shape)} and x "
                         f"{list(x.shape)}")
    if bias is not None and tuple(bias.shape) != (h,):
        raise ValueError(f"bias must have shape [h] = [{h}] or be None, got {list(bias.shape)}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5,
               zero_centered_gamma: bool = False) -> torch.Tensor:
    """Unfused LayerNorm over the last dim, one PyTorch op per line.

    ``y = gamma · (x - mean) / sqrt(var + eps) + beta``, biased variance (divided by h),
    ``gamma = weight`` or ``weight + 1`` with ``zero_centered_gamma``. A float16 or bfloat16 x
    is upcast to float32 for the statistics and the normalisation, and ``x_hat`` is cast back to
    x's dtype before gamma and beta (upcast, normalise, cast back, as Megatron's local norms; in
    fp16, (x - mean)² would overflow from |x - mean| > 256 on). float32 and float64 x run in
    their dtype throughout. gamma and beta act in their promoted dtype with x's.

    Args:
        x: [..., h], any float dtype.
        weight: [h], any float dtype.
        bias: [h] or None.
        eps: added to the variance, a finite number > 0.
        zero_centered_gamma: the weight is stored around 0 (Megatron's
            ``layernorm_zero_centered_gamma``).

    Returns:
        [..., h] of ``torch.promote_types`` of x's, weight's (and bias's) dtypes: x's dtype when
        they match; e.g. bfloat16 x with a float32 weight gives float32.

    Raises:
        TypeError: eps not a real number.
        ValueError: eps <= 0, infinite or NaN; weight or bias not of shape [h].

    Source: Ba et al., "Layer Normalization" (2016), arXiv:1607.06450; Megatron-LM
    ``megatron/core/fusions/fused_layer_norm.py`` (zero-centered gamma).
    """
    _check_norm_args(x, weight, bias, eps)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if bias is not None:
        out_dtype = torch.promote_types(out_dtype, bias.dtype)
    xf = _up(x)  # float16/bfloat16 -> float32; float32, float64: x itself
    mean = xf.mean(dim=-1, keepdim=True)  # [..., 1]
    x_c = xf - mean
    var = (x_c * x_c).mean(dim=-1, keepdim=True)  # [..., 1]
    rstd = torch.rsqrt(var + eps)
    x_hat = (x_c * rstd).to(x.dtype)  # cast back (a no-op for float32/float64 x)
    y = x_hat * _gamma(weight, zero_centered_gamma)
    y = y + bias if bias is not None else y
    return y.to(out_dtype)  # a no-op: y already has the promoted dtype


def layer_norm_back(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                    zero_centered_gamma: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`layer_norm`, by the closed form derived in chapter 4.

    With ``x_hat = (x - mean)·rstd`` and ``g = gamma·dy``::

        dx     = rstd · (g - mean(g) - x_hat · mean(g · x_hat))     (means over the row)
        dgamma = sum over rows of dy · x_hat                          (= d weight)
        dbeta  = sum over rows of dy

    Computed in float32 for float16/bfloat16 tensors (as :func:`layer_norm`), else in their dtype.

    Args:
        dy: [..., h], the output's gradient.
        x: [..., h], the forward input.
        weight: [h].
        eps, zero_centered_gamma: as in :func:`layer_norm`.

    Returns:
        ``(dx [..., h], dweight [h], dbias [h])``: dx in the promoted dtype of dy, x and weight,
        dweight in that of dy and x, dbias in dy's dtype.

    Raises:
        TypeError, ValueError: as :func:`layer_norm`.

    Source: Ba et al. (2016), arXiv:1607.06450, differentiated (chapter 4).
    """
    _check_norm_args(x, weight, None, eps)
    dx_dtype = torch.promote_types(torch.promote_types(dy.dtype, x.dtype), weight.dtype)
    dw_dtype = torch.promote_types(dy.dtype, x.dtype)
    dy_f, xf = _up(dy), _up(x)
    mean = xf.mean(dim=-1, keepdim=True)
    x_c = xf - mean
    rstd = torch.rsqrt((x_c * x_c).mean(dim=-1, keepdim=True) + eps)
    x_hat = x_c * rstd
    g = _gamma(_up(weight), zero_centered_gamma) * dy_f
    dx = rstd * (g - g.mean(dim=-1, keepdim=True) - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    rows, h = math.prod(x.shape[:-1]), x.shape[-1]  # (rows given: -1 is ambiguous at h = 0)
    dweight = (dy_f * x_hat).reshape(rows, h).sum(0)  # [..., h] -> [rows, h] -> [h]
    dbias = dy_f.reshape(rows, h).sum(0)
    return dx.to(dx_dtype), dweight.to(dw_dtype), dbias.to(dy.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
             zero_centered_gamma: bool = False) -> torch.Tensor:
    """Unfused RMSNorm over the last dim: ``y = gamma · x / sqrt(mean(x²) + eps)``.

    A float16 or bfloat16 x is upcast to float32 for the mean square and the normalisation, and
    ``x_hat`` is cast back to x's dtype before gamma, as Megatron's local ``RMSNorm``
    (``self._norm(x.float()).type_as(x) * self.weight``; in fp16, x² would overflow from |x| > 256
    on). float32 and float64 x run in their dtype throughout.

    Args:
        x: [..., h], any float dtype.
        weight: [h], any float dtype.
        eps: added to the mean square, a finite number > 0.
        zero_centered_gamma: gamma = weight + 1.

    Returns:
        [..., h] of ``torch.promote_types(x.dtype, weight.dtype)``: x's dtype when they match;
        e.g. bfloat16 x with a float32 weight gives float32.

    Raises:
        TypeError: eps not a real number.
        ValueError: eps <= 0, infinite or NaN; weight not of shape [h].

    Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), arXiv:1910.07467;
    Megatron-LM ``megatron/legacy/model/rms_norm.py`` (the upcast) and
    ``megatron/core/fusions/fused_layer_norm.py`` (zero-centered gamma).
    """
    _check_norm_args(x, weight, None, eps)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    xf = _up(x)  # float16/bfloat16 -> float32; float32, float64: x itself
    rstd = torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)  # [..., 1]
    x_hat = (xf * rstd).to(x.dtype)  # cast back (a no-op for float32/float64 x)
    return (x_hat * _gamma(weight, zero_centered_gamma)).to(out_dtype)  # .to: a no-op, as above


def rms_norm_back(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                  zero_centered_gamma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm`: with ``x_hat = x·rstd`` and ``g = gamma·dy``::

        dx     = rstd · (g - x_hat · mean(g · x_hat))
        dgamma = sum over rows of dy · x_hat

    Computed in float32 for float16/bfloat16 tensors (as :func:`rms_norm`), else in their dtype.

    Args:
        dy: [..., h]; x: [..., h]; weight: [h]; eps, zero_centered_gamma: as in :func:`rms_norm`.

    Returns:
        ``(dx [..., h], dweight [h])``: dx in the promoted dtype of dy, x and weight, dweight in
        that of dy and x.

    Raises:
        TypeError, ValueError: as :func:`rms_norm`.

    Source: Zhang & Sennrich (2019), arXiv:1910.07467, differentiated (chapter 4).
    """
    _check_norm_args(x, weight, None, eps)
    dx_dtype = torch.promote_types(torch.promote_types(dy.dtype, x.dtype), weight.dtype)
    dw_dtype = torch.promote_types(dy.dtype, x.dtype)
    dy_f, xf = _up(dy), _up(x)
    rstd = torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    x_hat = xf * rstd
    g = _gamma(_up(weight), zero_centered_gamma) * dy_f
    dx = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    dweight = (dy_f * x_hat).reshape(math.prod(x.shape[:-1]), x.shape[-1]).sum(0)  # (-1 is ambiguous at h = 0)
    return dx.to(dx_dtype), dweight.to(dw_dtype)


# ----------------------------------------------------------------------------------------
# Rotary position embeddings (chapter 7): Megatron-core's unfused RoPE
# ----------------------------------------------------------------------------------------

__all__ += ["rotate_half", "apply_rotary_pos_emb_bshd"]


def rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    """Megatron's ``_rotate_half``: pairs ``(x1, x2) -> (-x2, x1)`` along the last dim.

    Half-split (``rotary_interleaved=False``): the pairs are ``(k, k + n/2)``, so
    ``[x1 | x2] -> [-x2 | x1]``. Interleaved: the pairs are ``(2k, 2k + 1)``, so
    ``[a0, b0, a1, b1, ...] -> [-b0, a0, -b1, a1, ...]``.

    Args:
        x: [..., n], n even, any float dtype.
        rotary_interleaved: which pairing.

    Returns:
        A new tensor like ``x`` (shape and dtype).

    Raises:
        ValueError: x 0-d or its last dim odd (a pairing needs an even width).

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
    (``_rotate_half``, which indexes 4-D tensors; ``...`` here serves any rank alike).
    """
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim (the rotated width) must be even: channels rotate in pairs, "
                         f"got x {list(x.shape)}")
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)  # [..., n/2, 2]
    return x_new.view(*x_new.shape[:-2], x.shape[-1])  # [..., n/2, 2] -> [..., n] (n given: -1 is ambiguous at 0 rows)


def apply_rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                              multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """Megatron's unfused RoPE, ``_apply_rotary_pos_emb_bshd``, line for line.

    ``out = t * cos(freqs) + rotate_half(t) * sin(freqs)`` on the first ``rot_dim =
    freqs.shape[-1]`` channels, the rest concatenated unchanged. ``cos`` and ``sin`` are
    computed in freqs's dtype, scaled by ``mscale`` and cast to t's dtype before the
    products, which then run in t's dtype (so for bf16 t: three bf16 roundings per element,
    and cos/sin rounded to bf16 first). Called with float64 ``t`` and ``freqs`` it is the
    tests' float64 reference; with bf16 ``t`` and float32 ``freqs``, the eager baseline.

    Args:
        t: [s, b, np, d] (any leading dims), any float dtype.
        freqs: angles in radians, [s, 1, 1, rot_dim] or [s, b, 1, rot_dim] (broadcast
            against t), rot_dim even and <= d; as ``RotaryEmbedding`` makes them.
        rotary_interleaved: pairs (2k, 2k+1) if True, else (k, k + rot_dim/2).
        multi_latent_attention: first reorder the rotated channels as [even | odd] (MLA's
            layout), then rotate half-split pairs.
        mscale: scale of cos and sin (YaRN's attention scaling; 1.0 = plain RoPE).

    Returns:
        A new [s, b, np, d] tensor of t's dtype (contiguous).

    Raises:
        ValueError: freqs' last dim (rot_dim) odd, or larger than t's last dim d.
        RuntimeError: from torch, for freqs that do not broadcast against t.

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
    (``_apply_rotary_pos_emb_bshd``); Su et al. 2021, arXiv:2104.09864.
    """
    rot_dim = freqs.shape[-1] if freqs.dim() else 1
    if rot_dim % 2 or t.dim() == 0 or rot_dim > t.shape[-1]:
        raise ValueError(f"freqs' last dim (rot_dim) must be even and <= t's last dim: channels rotate in "
                         f"pairs, got freqs {list(freqs.shape)} and t {list(t.shape)}")
    # ideally t_pass is empty so rotary pos embedding is applied to all tensor t
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if multi_latent_attention:
        x1 = t[..., 0::2]
        x2 = t[..., 1::2]
        t = torch.cat((x1, x2), dim=-1)
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    t = (t * cos_) + (rotate_half(t, rotary_interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)
