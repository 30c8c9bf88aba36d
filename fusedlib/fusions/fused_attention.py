"""The whole attention as one kernel: FlashAttention-2 on Triton, with autograd.

:func:`flash_attention` computes softmax(scale·q·kᵀ + masks)·v for every head without
writing the [b, hq, sq, sk] scores or probabilities anywhere: the forward keeps a running
max and sum per query row (the online softmax) and saves only the rows' log-sum-exp
(float32, [b, hq, sq]); the backward recomputes the probabilities from it, tile by tile
(kernels and derivation: :mod:`fusedlib.kernels.flash_attention`). It is the kernel behind
``AttnBackend.flash`` in :class:`~fusedlib.transformer.dot_product_attention.DotProductAttention`.

Semantics, as Megatron-core's core-attention backends (Transformer Engine's
``DotProductAttention`` with FlashAttention):

* layout bshd: q [b, sq, hq, d], k and v [b, sk, hkv, d]; Megatron's [s, b, h, d] tensors
  are passed as ``t.transpose(0, 1)`` (a view: no copy);
* grouped-query attention: hq a multiple of hkv, query head h reads key/value head
  h // (hq/hkv); nothing is repeated in memory;
* causal: key j is visible to query i iff j <= i + sk - sq (the diagonal aligned
  bottom-right, as chapter 5: the queries are the last sq positions);
* ``window_size = (left, right)``: keys sk - sq - left <= j - i <= sk - sq + right, -1 for an
  unbounded side (Megatron-core's ``get_sliding_window_causal_mask``); with ``causal`` the
  two intersect (FlashAttention's rule);
* ``attention_mask``: bool, True = masked: [b, sk] (key padding, read as one row of bytes per
  key tile) or 4-D broadcastable to [b, hq, sq, sk] (Megatron's [b, 1, sq, sk] or
  [b, 1, 1, sk]), read through its strides, never expanded in memory;
* ``sinks``: the off-by-one softmax of chapter 5, one learnable logit per query head in
  every row's denominator, with its gradient;
* ``dropout_p``: attention dropout on the probabilities, chapter 2's Philox mask drawn in the
  kernel and regenerated in the backward, never stored.

A row that sees no key (every key masked, or outside the band) gives zeros and zero
gradients, never NaN; with a sink it gives zeros too (the sink has no value).

Source: Dao, "FlashAttention-2" (2023); Megatron-LM
``megatron/core/transformer/dot_product_attention.py`` and
``megatron/core/extensions/transformer_engine.py`` (``TEDotProductAttention``: the
attention backends, mask types, window sizes, softmax_scale); Dao-AILab ``flash_attn``'s
``flash_attn_func`` for the argument conventions (causal, window_size, deterministic).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ..checks import (
    FLOAT32_MAX,
    check_bool,
    check_same_device,
    check_tensor,
    check_window_size,
    is_dense,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
)
from ..kernels.bias_dropout_add import philox_seed
from ..kernels.flash_attention import LOG2E, MAX_HEAD_DIM, attention_band, flash_attn_bwd, flash_attn_fwd
from .fused_softmax import _check_dropout_p  # the softmax's argument rules, shared
from ._apply import once_differentiable

__all__ = ["FlashAttentionFunction", "flash_attention", "ATTENTION_DTYPES"]

Tensor = torch.Tensor

#: dtypes of q, k and v: the tensor cores' 16-bit types, and float32 for tests and the CPU.
ATTENTION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES = frozenset(ATTENTION_DTYPES)
_SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd Function of :func:`flash_attention` (which checks the arguments: call that).

    ``apply(q, k, v, sinks, mask, softmax_scale, band, dropout_p, deterministic)``: q [b, sq, hq, d], k and v
    [b, sk, hkv, d] with unit last strides; sinks float32 [hq] or None; mask bool ([b, sk] or
    4-D broadcastable to [b, hq, sq, sk]) or None; softmax_scale a float; band
    ``(band_lo, band_hi)`` (:func:`~fusedlib.kernels.flash_attention.attention_band`);
    dropout_p in [0, 1); deterministic a bool.

    Forward: draws a Philox key from torch's generator on q's device when dropout_p > 0 and
    neither q nor k is empty, launches one kernel, saves q, k, v, o, the LSE (float32
    [b, hq, sq]), the mask, the sinks and the key. Backward: two or three kernels, returning (dq, dk, dv,
    dsinks) in the inputs' dtypes: without atomics when ``deterministic`` (two without sinks where
    :func:`~fusedlib.kernels.flash_attention.delta_in_dq_kernel` has the dQ kernel compute Delta),
    else dQ by atomic adds where that is faster
    (:func:`~fusedlib.kernels.flash_attention.use_atomic_dq`). Differentiable once (a double
    backward raises).

    Source: Dao, "FlashAttention-2" (2023), Algorithms 1 and 2.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, softmax_scale, band, dropout_p, deterministic=True):
        sink32 = None
        if sinks is not None:  # (no graph here: forward runs without grad)
            sink32 = sinks.to(torch.float32).contiguous()
        # no queries or no keys: nothing to drop, no random numbers drawn (as torch's dropout
        # for an empty input)
        seed = philox_seed(q.device) if dropout_p > 0.0 and q.numel() and k.numel() else None
        o, lse = flash_attn_fwd(q, k, v, softmax_scale, band, mask, sink32, seed, dropout_p)
        ctx.save_for_backward(q, k, v, o, lse, mask, sink32, seed)
        ctx.softmax_scale, ctx.band, ctx.dropout_p, ctx.deterministic = softmax_scale, band, dropout_p, deterministic
        ctx.sink_dtype = sinks.dtype if sinks is not None else None
        return o

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output):
        q, k, v, o, lse, mask, sink32, seed = ctx.saved_tensors
        do = grad_output if grad_output.stride(-1) == 1 else grad_output.contiguous()
        want_sink = sink32 is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsink = flash_attn_bwd(do, q, k, v, o, lse, ctx.softmax_scale, ctx.band, mask,
                                           sink32 if want_sink else None, seed, ctx.dropout_p,
                                           deterministic=ctx.deterministic)
        if dsink is not None:
            dsink = dsink.to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Input checks (the happy path is one cheap condition; the detailed checks name the argument)
# ---------------------------------------------------------------------------------------------


def _check_qkv(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=ATTENTION_DTYPES, ndim=4)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q {_name(q.dtype)}, k {_name(k.dtype)}, "
                        f"v {_name(v.dtype)}")
    check_same_device(q=q, k=k, v=v)
    b, sq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape [b, sk, hkv, d], got k {list(k.shape)}, v {list(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"k and v must have q's batch size {b} (layout [b, s, heads, d]), got {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"k and v must have q's head dim {d}, got {k.shape[3]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"the head dim (q's last dim) must be in [1, {MAX_HEAD_DIM}], got {d}")
    hkv = k.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hkv}) (grouped-query attention)")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_scale(softmax_scale: object, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = real_to_float("softmax_scale", softmax_scale, "a finite real number or None")
    # the kernels multiply the scores by softmax_scale·log2(e) in float32: a scale whose product
    # overflows float32 (|scale| > ~2.4e38) would make every score ±inf and the output NaN
    if not (math.isfinite(scale) and abs(scale) * LOG2E <= FLOAT32_MAX):
        raise ValueError(f"softmax_scale must be finite, with |softmax_scale|·log2(e) <= float32's max "
                         f"({FLOAT32_MAX:.4g}), got {softmax_scale}")
    return scale


def _check_mask(mask: object, q: Tensor, sk: int) -> None:
    if not (isinstance(mask, Tensor) and mask.dtype == torch.bool and is_dense(mask)):
        check_tensor("attention_mask", mask, dtypes=(torch.bool,))  # (sparse: check_dense's TypeError)
    b, sq, hq, _ = q.shape
    if mask.dim() == 2:
        if tuple(mask.shape) != (b, sk):
            raise ValueError(f"a 2-D attention_mask is a key-padding mask [b, sk] = [{b}, {sk}], "
                             f"got {list(mask.shape)}")
    elif mask.dim() == 4:
        if not all(m in (1, n) for m, n in zip(mask.shape, (b, hq, sq, sk))):
            raise ValueError(f"a 4-D attention_mask must broadcast to [b, hq, sq, sk] = {[b, hq, sq, sk]}, "
                             f"got {list(mask.shape)}")
    else:
        raise ValueError(f"attention_mask must be [b, sk] (key padding) or 4-D [b or 1, hq or 1, sq or 1, sk or 1], "
                         f"got shape {list(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"attention_mask must be on q's device ({q.device}), got {mask.device}")


def _check_sinks(sinks: object, q: Tensor) -> None:
    check_tensor("sinks", sinks, dtypes=_SINK_DTYPES)
    hq = q.shape[2]
    if tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have shape [hq] = [{hq}] (one logit per query head), got {list(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")


def _unit_last_stride(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy when its last dim is strided (the kernels' loads need a unit stride)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    attention_mask: Optional[Tensor] = None,
    window_size: Optional[tuple[int, int]] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
) -> Tensor:
    """softmax(softmax_scale·q·kᵀ, masked)·v for every head, in one kernel (FlashAttention-2).

    Args:
        q: queries [b, sq, hq, d], float16/bfloat16 (float32 for tests: IEEE products, slow
            on a GPU), CUDA or CPU (interpreted); any strides (a last dim with a stride other
            than 1 is copied once).
        k, v: keys and values [b, sk, hkv, d], q's dtype and device; hq a multiple of hkv
            (grouped-query attention, never repeated in memory). d in [1, 256]; a d that is
            not a power of two is padded inside the kernel (masked loads), never in memory.
        causal: key j visible to query i only if j <= i + sk - sq (bottom-right aligned).
        softmax_scale: multiplies q·kᵀ (None: 1/sqrt(d)). The backward recomputes the
            probabilities from the forward's float32 log-sum-exp, so their relative error is
            about |score|·2^-24 (FlashAttention's, any float32-LSE kernel's): scores
            softmax_scale·q·k beyond ~1e3 in magnitude cost the gradients accuracy (1e4: ~3e-3
            relative in dv), around 1e7 the gradients are wrong by O(1), and from ~1e9 on the
            error of the recomputed exponent (|score|·2^-24) overflows: gradients far off, inf
            or NaN. The forward stays exact. Checked only for a finite scale·log2(e) in float32
            (the scores are not read: that would synchronise with the device).
        attention_mask: bool, True = masked: [b, sk] (key padding) or 4-D broadcastable to
            [b, hq, sq, sk]; or None. Applied on top of causal and window.
        window_size: ``(left, right)`` sliding window, -1 = unbounded side, or None; with
            ``causal`` the two intersect.
        sinks: sink logits [hq] (any float dtype; computed in float32), or None: every row's
            softmax denominator gains e^{sinks[h]} (chapter 5's off-by-one softmax). A
            tensor that requires grad receives d sinks. -inf is no sink; a logit above
            ~2.35e38 (float32's max / log2(e): the kernel works in base 2) or +inf gives NaN,
            unchecked (reading the values would synchronise with the device).
        dropout_p: attention dropout in [0, 1) on the probabilities (0 outside training),
            applied with 16-bit resolution p' = round(p·2^16)/2^16 and kept values scaled by
            1/(1 - p') (chapter 2); a p >= 1 - 2^-17 rounds to p' = 1 and is refused, as 1
            is. The mask comes from Philox keyed by one draw of torch's generator on q's
            device per call (``torch.manual_seed`` reproduces it;
            :func:`~fusedlib.kernels.flash_attention.flash_attn_dropout_mask` of the replayed
            key gives it as a tensor). A dropped probability counts as exactly 0 even in a
            row of NaN scores (torch's dropout, multiplying by the mask, keeps the NaN; the
            row's output is NaN either way unless every key is dropped).
        deterministic: True: a bitwise reproducible backward (dK/dV and dQ in separate
            kernels, the GQA sum in registers, no atomics). False (FlashAttention's default):
            where it is faster (head dims 65-128, or any head dim up to 64 with dropout:
            :func:`~fusedlib.kernels.flash_attention.use_atomic_dq`) dQ is summed by float32
            atomic adds (on Hopper GPUs one TMA bulk reduction per tile:
            :func:`~fusedlib.kernels.flash_attention.dq_by_tma`), whose order varies from run
            to run, so dq may differ between runs in its last bits (dk, dv and d sinks stay
            reproducible); elsewhere the deterministic kernels run.

    Returns:
        The attention output [b, sq, hq, d] in q's dtype (``torch.empty_like(q)``: q's
        memory order where q is dense, so an [s, b, h, d] tensor passed transposed gets its
        output in [s, b, h, d] memory order). Rows that see no key are zeros (zero gradients).
        A NaN or inf in k or v reaches every output row of each query tile that reads its key
        tile, masked or outside the causal band or not (0·NaN is NaN inside a product), as in
        FlashAttention's kernels (torch's SDPA on the CPU gives NaN for a NaN under a padding
        mask too); a NaN in a row of q stays in that row's output and dq, and reaches the dk
        and dv of every key tile that row reads.

    Raises:
        TypeError: q, k, v not tensors of one dtype in float16/bfloat16/float32; a non-bool
            mask; sinks not a float tensor; softmax_scale or dropout_p not real; causal or
            deterministic not a bool (numpy's bool is accepted).
        ValueError: q, k, v not 4-D or of mismatched shapes (batch, head dim, hq % hkv), a
            head dim above 256, tensors on different devices, a mask that is not [b, sk] or
            does not broadcast, sinks not [hq], a bad window, dropout_p outside [0, 1) or
            >= 1 - 2^-17 (it would round to 1 at the kernels' 16-bit resolution),
            softmax_scale not finite or with |softmax_scale|·log2(e) beyond float32's range.

    Source: Dao, "FlashAttention-2" (2023); Megatron-LM
    ``megatron/core/transformer/dot_product_attention.py`` (core attention) and
    ``megatron/core/extensions/transformer_engine.py`` (its flash backend's arguments).
    """
    ok = (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and q.dtype in _DTYPES
          and k.dtype == q.dtype and v.dtype == q.dtype and q.dim() == 4 and k.dim() == 4)
    if ok:  # the shapes read once: each .shape is a new torch.Size
        try:
            qs, ks = q.shape, k.shape
            ok = (ks == v.shape and ks[0] == qs[0] and ks[3] == qs[3] and 1 <= qs[3] <= MAX_HEAD_DIM
                  and ks[2] >= 1 and qs[2] % ks[2] == 0 and on_one_kernel_device(q, k, v))
        except RuntimeError:  # a nested tensor has no shape: _check_qkv names it
            ok = False
    if not ok:
        _check_qkv(q, k, v)
    if causal is not True and causal is not False:  # numpy's bool is accepted; a str or 1 is not
        causal = check_bool("causal", causal)
    if deterministic is not True and deterministic is not False:
        deterministic = check_bool("deterministic", deterministic)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = _check_scale(softmax_scale, d)
    window = check_window_size(window_size)
    p = 0.0 if (type(dropout_p) is float and dropout_p == 0.0) else _check_dropout_p(dropout_p)
    if attention_mask is not None:
        _check_mask(attention_mask, q, sk)
    if sinks is not None:
        _check_sinks(sinks, q)
    band = attention_band(sq, sk, causal, window)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    return FlashAttentionFunction.apply(q, k, v, sinks, attention_mask, scale, band, p, deterministic)
