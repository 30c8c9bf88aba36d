"""Plain PyTorch references: the "unfused" path and the tests' oracle.

Each function here computes an op the way an eager PyTorch program would, one
elementwise kernel per operator. Called on float64 tensors they are the reference
that fusedlib's Triton kernels are tested against; called on the training dtype they
are the "eager" baseline of the benchmark.

Sources: Megatron-LM ``megatron/core/fusions/fused_bias_gelu.py`` (the tanh GeLU and
its derivative), Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016);
``megatron/core/fusions/fused_softmax.py`` and ``megatron/core/transformer/utils.py`` (the
attention softmax's unfused path and its masks).
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
    "causal_mask",
    "sliding_window_causal_mask",
    "attention_mask_func",
    "softmax_one",
    "scale_mask_softmax",
    "masked_softmax_reference",
    "softmax_backward",
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


# ---------------------------------------------------------------------------------------------
# Attention softmax (chapter 5)
# ---------------------------------------------------------------------------------------------


def causal_mask(sq: int, sk: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Causal mask [sq, sk], bool, True = masked: query q sees keys j <= q + sk - sq.

    The diagonal is aligned bottom-right, so the sq queries are the *last* sq positions of an
    sk-long sequence (a KV cache: sq = 1 sees every key). For sq == sk it is Megatron-core's
    ``get_default_causal_mask(sq)``, ``triu(ones(sq, sq), diagonal=1)``; for sq > sk the first
    sq - sk rows are fully masked.

    Args:
        sq: queries; sk: keys (default sq); device: where to build it.
    """
    sk = sq if sk is None else sk
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=sk - sq + 1)


def sliding_window_causal_mask(sq: int, sk: int, window_size: tuple[int, int],
                               device: torch.device | str | None = None) -> torch.Tensor:
    """Sliding-window mask [sq, sk], bool, True = masked, as Megatron-core's
    ``get_sliding_window_causal_mask``: query q sees sk - sq - left <= j - q <= sk - sq + right.

    Args:
        sq, sk: queries and keys.
        window_size: ``(left, right)``; -1 on a side means unbounded on that side.
        device: where to build it.
    """
    left, right = window_size
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
        attention_scores: [b, np, sq, sk].
        attention_mask: bool, broadcastable, True = masked.
    """
    return attention_scores.masked_fill(attention_mask, -10000.0)


def _as_offset(offset: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """The sink logit(s) as a tensor of x's dtype and device (differentiable for a tensor)."""
    if isinstance(offset, torch.Tensor):
        return offset.to(dtype=x.dtype, device=x.device)
    return torch.tensor(float(offset), dtype=x.dtype, device=x.device)


def softmax_one(x: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """Megatron-core's ``SoftmaxOne.forward``: softmax over the row plus one sink logit.

    p_j = e^{x_j} / (e^{offset} + sum_k e^{x_k}): the sink column is appended, the softmax
    taken, the sink column dropped.

    Args:
        x: [b, np, sq, sk] (or any [..., sk] with a scalar offset).
        offset: the sink logit: a float, a 0-d/[1] tensor, or [np] (one per head).

    Returns:
        Tensor like ``x``.
    """
    off = _as_offset(offset, x)
    if off.numel() > 1:
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
        x: scores [b, np, sq, sk]; never modified (it is copied before an in-place mask_func).
        mask: bool, broadcastable to x, True = masked; None for none.
        scale: multiplies x, or None.
        softmax_in_fp32: compute in float32 for fp16/bf16 inputs.
        softmax_offset: sink logit(s) for the off-by-one softmax, or None.
        mask_func: ``(scores, mask) -> scores``, Megatron-core's signature.

    Returns:
        Probabilities, x's shape and dtype.
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
        x: [b, np, sq, sk] (or [..., sk] without a per-head offset).
        mask: bool, broadcastable to x, True = masked.
        scale: multiplies x.
        softmax_offset: None, a float, or a tensor [np] or [1] of sink logits.
    """
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    sink = None
    if softmax_offset is not None:
        off = _as_offset(softmax_offset, x)
        sink = off.reshape(1, -1, 1, 1) if off.numel() > 1 else off.reshape(-1)[:1]
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
        g: gradient of p; p: the softmax output (same shape); scale: the forward's scale.
    """
    return scale * p * (g - (g * p).sum(dim=-1, keepdim=True))
