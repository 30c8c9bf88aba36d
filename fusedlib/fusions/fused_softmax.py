"""The attention softmax family, Megatron-core's ``fused_softmax`` on Triton kernels.

Megatron-core's names and call signatures:

* ``ScaledUpperTriangMaskedSoftmax.apply(x[attn_batches, sq, sk], scale)``: causal;
* ``ScaledMaskedSoftmax.apply(x[b, np, sq, sk], mask, scale)``: a bool mask, True = masked,
  of shape [b or 1, 1, sq, sk] (any shape that broadcasts to x works);
* ``ScaledSoftmax.apply(x, scale)``: no mask;
* ``SoftmaxOne(dim, denominator_offset)``: the off-by-one softmax, fixed or learnable offset;
* ``FusedScaleMaskSoftmax(...)`` with ``forward(input, mask, softmax_offset=None)``, its
  ``is_kernel_available`` and its torch fallback ``forward_torch_softmax``.

What differs from Megatron-core, and why:

* fusedlib's kernels take any sq and sk (1, 5000, 32768...), float32/float16/bfloat16 (and
  float64), any batch and head count: ``is_kernel_available`` is just the user's switch.
  Megatron-core's CUDA kernels (from Apex) need 16 < sk <= 4096, sq and sk multiples of 4,
  fp16/bf16 and a batch-per-block divisibility; otherwise it silently runs the torch path.
  That rule is kept, explained, in :func:`megatron_kernel_availability`.
* A row whose every key is masked gives zeros and a zero gradient, in the kernels and in the
  fallback, never NaN and never the uniform row 1/sk that filling -10000 would give.
* Causal with sq != sk: the diagonal is aligned bottom-right (query q sees keys
  j <= q + sk - sq: the queries are the last sq positions, as with a KV cache). For
  sq == sk this is the usual mask; Megatron-core asserts sq == sk (except sq = 1).
* With a causal type and a mask, both apply (the union of the masked sets); Megatron-core's
  fused causal path ignores the mask while its fallback uses the mask instead of causal.
* ``softmax_offset`` runs in the fused kernel too (Megatron-core falls back to torch), with
  its gradient; a sliding window runs in the kernel as a band.

Beyond Megatron-core's file: :func:`fused_scale_mask_softmax_dropout` (autograd Function
:class:`ScaledMaskedSoftmaxDropout`) fuses the attention dropout that Megatron-core's
``DotProductAttention`` applies to these probabilities into the same kernel, with chapter 2's
Philox mask, regenerated in the backward instead of stored.

Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py``,
``megatron/core/transformer/utils.py`` (``get_default_causal_mask``,
``get_sliding_window_causal_mask``, ``attention_mask_func``); Apex ``csrc/megatron``
(``get_batch_per_block``); Miller, "Attention is off by one" (2023);
``megatron/core/transformer/dot_product_attention.py`` (the attention dropout).
"""
from __future__ import annotations

import enum
import math
import numbers
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from .. import unfused
from ..checks import (
    FLOAT32_MAX,
    FLOAT_DTYPES,
    check_bool,
    check_same_device,
    check_tensor,
    check_window_size,
    is_dense,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
    type_name,
)
from ..kernels.bias_dropout_add import KEEP_BITS, philox_seed
from ..kernels.launch import acc_dtype
from ..kernels.softmax import (
    causal_band,
    softmax_bwd,
    softmax_dropout_bwd,
    softmax_dropout_fwd,
    softmax_fwd,
    window_band,
)
from ..runtime import default_device
from ..transformer.enums import AttnMaskType
from ._apply import apply, once_differentiable

__all__ = [
    "ScaledUpperTriangMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "SoftmaxOne",
    "FusedScaleMaskSoftmax",
    "fused_scale_mask_softmax",
    "ScaledMaskedSoftmaxDropout",
    "fused_scale_mask_softmax_dropout",
    "get_default_causal_mask",
    "get_sliding_window_causal_mask",
    "attention_mask_func",
    "get_batch_per_block",
    "megatron_kernel_availability",
]

#: Megatron-core's ``attention_mask_func`` (out of place here): masked scores -> -10000.
attention_mask_func = unfused.attention_mask_func

_CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right")


# ---------------------------------------------------------------------------------------------
# Masks (Megatron-core: megatron/core/transformer/utils.py)
# ---------------------------------------------------------------------------------------------


def _check_length(name: str, value: object) -> int:
    """A sequence length of a mask helper: an int >= 0 (numpy's ints too, as an int)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0 (a sequence length), got {type_name(value)} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0 (a sequence length), got {value}")
    return int(value)


def get_default_causal_mask(sq: int, sk: Optional[int] = None,
                            device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """The causal mask, bool [sq, sk], True = masked (above the diagonal).

    Args:
        sq: query length. ``get_default_causal_mask(sq)`` is Megatron-core's call: [sq, sq],
            ``triu(ones(sq, sq), diagonal=1)``.
        sk: key length (default sq). For sq != sk the diagonal is aligned bottom-right: query q
            sees keys j <= q + sk - sq.
        device: default: CUDA when present, else the CPU (Megatron-core always builds on CUDA).

    Returns:
        A new bool tensor [sq, sk].

    Raises:
        TypeError: sq or sk not an int (a float, a bool, a str).
        ValueError: sq or sk < 0.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_default_causal_mask``).
    """
    sq = _check_length("sq", sq)
    sk = None if sk is None else _check_length("sk", sk)
    return unfused.causal_mask(sq, sk, device=default_device() if device is None else device)


def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int],
                                   device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """The sliding-window mask, bool [sq, skv], True = masked.

    Query q sees keys j with skv - sq - left <= j - q <= skv - sq + right.

    Args:
        sq, skv: query and key lengths.
        window_size: ``(left, right)``; -1 means unbounded on that side. Any int >= -1 (a
            side at least as wide as the sequence is unbounded: ``2**70`` too).
        device: default: CUDA when present, else the CPU.

    Returns:
        A new bool tensor [sq, skv].

    Raises:
        TypeError: sq or skv not an int.
        ValueError: sq or skv < 0; window_size not a pair of ints >= -1 (None included: this
            mask is a window's).

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_sliding_window_causal_mask``).
    """
    sq, skv = _check_length("sq", sq), _check_length("skv", skv)
    if window_size is None:
        raise ValueError("window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), got None "
                         "(for no window, use get_default_causal_mask)")
    window_size = _window_for(check_window_size(window_size), sq, skv)
    return unfused.sliding_window_causal_mask(sq, skv, window_size,
                                              device=default_device() if device is None else device)


# ---------------------------------------------------------------------------------------------
# Megatron-core's kernel-availability rule, kept for readers comparing the two
# ---------------------------------------------------------------------------------------------


def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Rows one CUDA block of Megatron-core's (Apex's) softmax kernels handles.

    The kernel gives each row to one warp (or to part of one, for short rows) and keeps it in
    registers: a block is 128 threads; a warp spans min(next_pow2(sk), 32) threads; rows of
    up to 128 elements are packed two per warp. So

        warp_size       = min(next_pow2(sk), 32)
        batches_per_warp = 2 if next_pow2(sk) <= 128 else 1
        batch_per_block = (128 // warp_size) · batches_per_warp

    (sq, b, np are unused, as in Apex). Computed here in Python; Megatron-core asks the CUDA
    extension ``scaled_masked_softmax_cuda.get_batch_per_block``.

    Source: Apex ``csrc/megatron/scaled_masked_softmax.h`` (``get_batch_per_block``).
    """
    np2 = 1 << max(0, math.ceil(math.log2(max(1, sk))))
    warp_size = min(np2, 32)
    batches_per_warp = 2 if np2 <= 128 else 1
    return (128 // warp_size) * batches_per_warp


def megatron_kernel_availability(
    attn_mask_type: AttnMaskType,
    input_in_float16: bool,
    scaled_masked_softmax_fusion: bool,
    b: int,
    np: int,
    sq: int,
    sk: int,
    softmax_offset: Optional[torch.Tensor] = None,
    window_size: Optional[tuple[int, int]] = None,
) -> tuple[bool, str]:
    """Would Megatron-core run its fused CUDA softmax here, and if not, why?

    Megatron-core's ``FusedScaleMaskSoftmax.is_kernel_available`` returns a bare bool and falls
    back to PyTorch without a word, which is how ``masked_softmax_fusion=True`` ends up unused.
    The rule, condition by condition, with the reason each exists:

    1. the user asked (``scaled_masked_softmax_fusion``);
    2. fp16 or bf16 input: the kernels are compiled for half types only;
    3. 16 < sk <= 4096: one warp holds a row in registers, the kernel is templated on
       log2(next_pow2(sk)) up to 4096; above that the row does not fit;
    4. sq % 4 == 0 and sk % 4 == 0: rows are loaded 4 elements (8 bytes) at a time;
    5. b·np % 4 == 0;
    6. batch-per-block (:func:`get_batch_per_block`) divides b·np (causal: the grid is
       (sq, b·np / batch_per_block)) or sq (masked: (sq / batch_per_block, np, b)): the grid
       has no tail block;
    7. no ``softmax_offset`` (``forward`` takes the torch path for it), and, in Megatron-core
       versions with the fix of its issue #7847, no sliding window (the kernels have none).

    fusedlib's kernels have none of these limits: see :class:`FusedScaleMaskSoftmax`.

    Args:
        attn_mask_type: the mask type; b, np, sq, sk: the scores' shape [b, np, sq, sk].
        input_in_float16: the input is fp16 or bf16.
        scaled_masked_softmax_fusion: the user's switch (``config.masked_softmax_fusion``).
        softmax_offset, window_size: as :class:`FusedScaleMaskSoftmax`.

    Returns:
        ``(available, reason)``: reason says which condition failed ("" when available).

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``is_kernel_available``).
    """
    attn_batches = b * np
    if not scaled_masked_softmax_fusion:
        return False, "scaled_masked_softmax_fusion is False"
    if not input_in_float16:
        return False, "input is not fp16/bf16: the CUDA kernels take half precision only"
    if not 16 < sk <= 4096:
        return False, f"sk = {sk} is outside 16 < sk <= 4096: a row must fit one warp's registers"
    if sq % 4 != 0 or sk % 4 != 0:
        return False, f"sq = {sq} and sk = {sk} must be multiples of 4 (4-element vector loads)"
    if attn_batches % 4 != 0:
        return False, f"b·np = {attn_batches} must be a multiple of 4"
    bpb = get_batch_per_block(sq, sk, b, np)
    if _mask_type_name(attn_mask_type) == "causal":
        if attn_batches % bpb != 0:
            return False, f"b·np = {attn_batches} is not a multiple of batch_per_block = {bpb}"
    elif sq % bpb != 0:
        return False, f"sq = {sq} is not a multiple of batch_per_block = {bpb}"
    if softmax_offset is not None:
        return False, "softmax_offset is given: Megatron-core computes it in PyTorch"
    if window_size is not None:
        return False, "a sliding window is set: the CUDA kernels have no window"
    return True, ""


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------


#: AttnMaskType's member names: a plain frozenset, which torch.compile traces (Dynamo cannot
#: look into ``Enum.__members__``, a property of the enum's class).
_MASK_TYPE_NAMES: frozenset[str] = frozenset(m.name for m in AttnMaskType)


def _mask_type_name(attn_mask_type: object) -> str:
    """The member name of an AttnMaskType (fusedlib's, or Megatron-core's enum by name)."""
    name = getattr(attn_mask_type, "name", None)
    if not isinstance(attn_mask_type, enum.Enum) or name not in _MASK_TYPE_NAMES:
        allowed = ", ".join(m.name for m in AttnMaskType)
        raise TypeError(f"attn_mask_type must be an AttnMaskType ({allowed}), got {attn_mask_type!r}")
    return name


Tensor = torch.Tensor


def _is_float_tensor(t: object, ndim: int) -> bool:
    """The happy case of ``check_tensor(name, t, ndim=ndim)`` (ndim 0: any), as one cheap test."""
    return isinstance(t, Tensor) and t.dtype in FLOAT_DTYPES and (ndim == 0 or t.dim() == ndim) and is_dense(t)


def _check_scale(scale: object) -> float:
    # the kernels multiply the scores by scale in float32: a scale beyond float32's range is inf
    # there, and every score ±inf, the output NaN. (NaN fails the comparisons too.)
    if type(scale) is float and -FLOAT32_MAX <= scale <= FLOAT32_MAX:
        return scale
    if scale is None:
        return 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type_name(scale)}")
    s = real_to_float("scale", scale, "a finite real number or None")
    if not (math.isfinite(s) and abs(s) <= FLOAT32_MAX):
        raise ValueError(f"scale must be finite, with |scale| <= float32's max ({FLOAT32_MAX:.4g}: the kernels "
                         f"multiply the scores by it in float32), got {scale}")
    return s


#: The kernels drop with 16-bit resolution, p' = round(p·2^16)/2^16: from this p on, p' = 1
#: (:func:`~fusedlib.kernels.bias_dropout_add.drop_threshold` = 2^16), every probability is
#: dropped and the output is all zeros. Exact: p·2^16 is computed without rounding.
_DROPOUT_P_LIMIT: float = 1.0 - 2.0 ** -(KEEP_BITS + 1)


def _check_dropout_p(dropout_p: object) -> float:
    if type(dropout_p) is float and 0.0 <= dropout_p < _DROPOUT_P_LIMIT:  # the happy case in one test
        return dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type_name(dropout_p)}")
    p = real_to_float("dropout_p", dropout_p, "a real number in [0, 1)")
    if not 0.0 <= p < 1.0:  # NaN fails this too
        raise ValueError(f"dropout_p must be in [0, 1) (1 would drop every probability), got {dropout_p}")
    if p >= _DROPOUT_P_LIMIT:
        raise ValueError(f"dropout_p must be in [0, 1) and below 1 - 2^-{KEEP_BITS + 1} = {_DROPOUT_P_LIMIT!r}: the "
                         f"kernels apply it with 16-bit resolution, round(p·2^{KEEP_BITS})/2^{KEEP_BITS}, and "
                         f"{dropout_p!r} rounds to 1 (every probability dropped, an all-zero output)")
    return p


def _window_for(window: tuple[int, int], sq: int, sk: int) -> tuple[int, int]:
    """A checked window for scores [.., sq, sk], with a side that spans the whole sequence as -1.

    Query q keeps keys with sk - sq - left <= j - q <= sk - sq + right: from left >= sk - 1 on, the
    lower limit keeps every key of every row, from right >= sq - 1 on, the upper one. So a wider
    side is unbounded (-1) and gives the same mask; as -1, a side beyond int64 (``2**70``) never
    reaches the kernels' int64 band arithmetic (Triton's OverflowError, naming nothing) or
    ``torch.triu``'s diagonal (an OverflowError too).
    """
    left, right = window
    return (-1 if left >= sk else left), (-1 if right >= sq else right)


def _check_mask(mask: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if not (isinstance(mask, Tensor) and mask.dtype == torch.bool):
        check_tensor("mask", mask, dtypes=(torch.bool,))
    ok = mask.dim() <= x.dim() and all(m in (1, n) for m, n in zip(reversed(mask.shape), reversed(x.shape)))
    if not ok:
        raise ValueError(f"mask of shape {list(mask.shape)} does not broadcast to the scores' shape {list(x.shape)} "
                         "(Megatron-core's layout: [b or 1, 1, sq, sk], True = masked)")
    return mask


def _check_offset(offset: object, x4: torch.Tensor, name: str = "softmax_offset") -> Optional[torch.Tensor]:
    """The sink logit(s) as a tensor [1] or [np]; a float becomes a constant tensor. ``name``:
    the argument's name in the caller's signature, for the messages."""
    if offset is None:
        return None
    if isinstance(offset, numbers.Real) and not isinstance(offset, bool):
        value = real_to_float(name, offset, "a finite number, -inf (no sink) or a tensor")
        dtype = torch.promote_types(x4.dtype, torch.float32)
        limit = FLOAT32_MAX if dtype == torch.float32 else math.inf
        if not (value == -math.inf or (math.isfinite(value) and abs(value) <= limit)):
            raise ValueError(f"{name} must be a finite number within {dtype}'s range (the sink logit is "
                             f"held in it), or -inf for no sink, got {offset!r}")
        # torch.full, not torch.tensor([offset], device=...): a host-to-device copy of a Python
        # list synchronises the host, which a CUDA graph capture cannot contain
        return torch.full((1,), value, device=x4.device, dtype=dtype)
    if not _is_float_tensor(offset, 0):
        if not isinstance(offset, Tensor):  # (check_tensor would say "a torch.Tensor": a number is fine too)
            raise TypeError(f"{name} must be a real number, a floating tensor or None, got {type_name(offset)}")
        check_tensor(name, offset, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    if offset.numel() not in (1, x4.shape[1]):
        raise ValueError(f"{name} must have 1 or np = {x4.shape[1]} elements (one sink logit per head), "
                         f"got shape {list(offset.shape)}")
    return offset


def _sink_logits(offset: torch.Tensor, x4: torch.Tensor) -> torch.Tensor:
    """The sink logits for the kernels: [1] or [np], contiguous, in the compute dtype.

    A sink of +inf (or one beyond the compute dtype, a float64 1e300 for float32 scores, inf
    once converted) takes the whole row: the kernels hold it at the dtype's largest value
    (``_finite_sink`` in :mod:`fusedlib.kernels.softmax`), where they compute the limit,
    p = 0 with zero gradients. No device op when the logits are already [np] in the compute
    dtype, contiguous.
    """
    acc = acc_dtype(x4.dtype)
    off = offset.to(acc)
    off = off if off.dim() == 1 else off.reshape(-1)
    return off.contiguous()


def _as_4d(x: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[attn_batches, sq, sk] -> [attn_batches, 1, sq, sk] (a view), and the mask to match."""
    if x.dim() == 4:
        return x, mask
    x4 = x.unsqueeze(1)
    if mask is not None:
        mask = mask.reshape((1,) * (3 - mask.dim()) + tuple(mask.shape)).unsqueeze(1)
    return x4, mask


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class _ScaleMaskSoftmaxFunction(torch.autograd.Function):
    """Every variant in one Function: x4 [b, np, sq, sk], bool mask or None, a band or None,
    sink logits [1] or [np] or None. Saves p (and p_sink), not x: dx needs only p and g.
    Differentiable once (a double backward raises)."""

    @staticmethod
    def forward(ctx, x4, mask, scale, band, offset):
        off = None
        if offset is not None:  # sink logits in the compute dtype, [1] or [np] (no graph: forward runs without grad)
            off = _sink_logits(offset, x4)
        p, sink = softmax_fwd(x4, scale, mask, band, off)
        ctx.save_for_backward(p, sink)
        ctx.scale, ctx.band = scale, band
        ctx.offset_meta = (offset.shape, offset.dtype, offset.numel()) if offset is not None else None
        return p

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output):
        p, sink = ctx.saved_tensors
        want_offset = ctx.offset_meta is not None and ctx.needs_input_grad[4]
        dx, doff_rows = softmax_bwd(grad_output, p, ctx.scale, ctx.band, sink if want_offset else None)
        d_offset = None
        if want_offset:
            shape, dtype, numel = ctx.offset_meta
            B, H, SQ, _ = p.shape
            rows = doff_rows.view(B, H, SQ)  # [b·np·sq] -> [b, np, sq]
            # one per head ([np], np = 0 included), or one shared
            d_offset = (rows.sum(dim=(0, 2)) if numel != 1 else rows.sum()).reshape(shape).to(dtype)
        return dx, None, None, None, d_offset


def fused_scale_mask_softmax(
    input: torch.Tensor,  # noqa: A002 (Megatron's name)
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size: Optional[tuple[int, int]] = None,
    softmax_offset: Optional[Union[torch.Tensor, float]] = None,
) -> torch.Tensor:
    """softmax(scale·input) over the last dim, with masks and an optional sink, in one kernel.

    Args:
        input: scores [b, np, sq, sk] or [attn_batches, sq, sk]; float32/float16/bfloat16
            (float64 for gradcheck); CUDA or CPU; any strides.
        mask: bool, broadcastable to ``input`` ([b or 1, 1, sq, sk] in Megatron-core), True =
            masked; or None.
        scale: multiplies the scores before masking (None: 1).
        causal: mask keys j > q + sk - sq (bottom-right diagonal).
        window_size: ``(left, right)`` sliding window (replaces ``causal``'s band), or None.
        softmax_offset: sink logit o, a float or a tensor [1] or [np] (4-D input): the row's
            denominator gains e^o. A tensor that requires grad receives its gradient.

    Returns:
        Probabilities of ``input``'s shape and dtype (contiguous). A row with every key
        masked (and no sink) is all zeros, with zero gradient. A NaN score in a kept column,
        or a NaN sink logit, makes its whole row NaN (and its gradients), as torch.softmax. A
        sink logit of +inf (or beyond the compute dtype's range) takes the whole row: zeros,
        with zero gradients (the limit; torch.softmax over the row and the sink gives NaN).

    Raises:
        TypeError: non-tensor input, unsupported dtype, non-bool mask, non-real scale, causal
            not a bool (numpy's bool is accepted), a softmax_offset that is neither a real
            number, a floating tensor nor None.
        ValueError: input not 3-D/4-D, a scale that is not finite or beyond float32's range,
            a mask that does not broadcast, an offset of the wrong size, a bad window, or
            tensors on different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py``.
    """
    if not (_is_float_tensor(input, 4) or _is_float_tensor(input, 3)):
        check_tensor("input", input, ndim=(3, 4))
    if causal is not True and causal is not False:  # a str "no" or None was read as its truth value
        causal = check_bool("causal", causal)
    scale_f = _check_scale(scale)
    mask = _check_mask(mask, input)
    window = check_window_size(window_size)
    x4, mask4 = _as_4d(input, mask)
    offset = _check_offset(softmax_offset, x4)
    if offset is not None and offset.numel() > 1 and input.dim() != 4:
        raise ValueError("a per-head softmax_offset needs 4-D scores [b, np, sq, sk]")
    present = [t for t in (input, mask, offset) if t is not None]
    if not on_one_kernel_device(*present):
        check_same_device(input=input, mask=mask, softmax_offset=offset)
    sq, sk = x4.shape[-2:]
    band = (window_band(sq, sk, _window_for(window, sq, sk)) if window is not None
            else (causal_band(sq, sk) if causal else None))
    p4 = apply(_ScaleMaskSoftmaxFunction, x4, mask4, scale_f, band, offset)
    return p4 if input.dim() == 4 else p4.view(input.shape)  # [b, 1, sq, sk] -> [b, sq, sk]


class ScaledMaskedSoftmaxDropout(torch.autograd.Function):
    """Fused scale + masks + softmax + attention dropout, with autograd (the Function behind
    :func:`fused_scale_mask_softmax_dropout`, which checks the arguments; call that).

    ``apply(x4, mask, scale, band, offset, dropout_p)``: x4 [b, np, sq, sk] (any strides), mask
    bool broadcastable to x4 (True = masked) or None, scale a float, band ``(band_lo,
    band_hi)`` or None (:func:`~fusedlib.kernels.softmax.causal_band`,
    :func:`~fusedlib.kernels.softmax.window_band`), offset sink logits [1] or [np] or None,
    dropout_p in (0, 1) (``fused_scale_mask_softmax_dropout`` sends dropout_p = 0 to the plain
    softmax's Function instead; here it would run the dropout kernels keeping everything).

    Forward: draws a Philox key from torch's generator on x4's device (8 bytes; so
    ``torch.manual_seed`` reproduces the mask; none for an empty x4), launches one kernel,
    and saves x4, the mask, the seed and the row statistics (m and 1/D, float32 [2, b·np·sq]): no probabilities and no
    dropout mask. Backward: one kernel recomputes p from x4, regenerates the keep mask k and
    returns dx = scale·p·(g' - sum(g'·p)) with g' = g·k/(1 - p'), in x4's dtype, and the
    sink-logit gradient. Differentiable once (a double backward raises).

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (the Function pattern) and
    ``megatron/core/transformer/dot_product_attention.py`` (softmax, then attention dropout).
    """

    @staticmethod
    def forward(ctx, x4, mask, scale, band, offset, dropout_p):
        off = None
        if offset is not None:  # sink logits in the compute dtype, [1] or [np] (no graph: forward runs without grad)
            off = _sink_logits(offset, x4)
        # an empty x4 drops nothing and launches nothing: a placeholder key, no random numbers
        # drawn (as torch's dropout for an empty input)
        seed = philox_seed(x4.device) if x4.numel() else torch.zeros(1, dtype=torch.int64, device=x4.device)
        z, sink, stats = softmax_dropout_fwd(x4, seed, dropout_p, scale, mask, band, off)
        ctx.save_for_backward(x4, mask, stats, seed, sink)
        ctx.scale, ctx.band, ctx.dropout_p = scale, band, dropout_p
        ctx.offset_meta = (offset.shape, offset.dtype, offset.numel()) if offset is not None else None
        return z

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output):
        x4, mask, stats, seed, sink = ctx.saved_tensors
        want_offset = ctx.offset_meta is not None and ctx.needs_input_grad[4]
        dx, doff_rows = softmax_dropout_bwd(grad_output, x4, stats, seed, ctx.dropout_p, ctx.scale, mask,
                                            ctx.band, sink if want_offset else None)
        d_offset = None
        if want_offset:
            shape, dtype, numel = ctx.offset_meta
            B, H, SQ, _ = x4.shape
            rows = doff_rows.view(B, H, SQ)  # [b·np·sq] -> [b, np, sq]
            # one per head ([np], np = 0 included), or one shared
            d_offset = (rows.sum(dim=(0, 2)) if numel != 1 else rows.sum()).reshape(shape).to(dtype)
        return dx, None, None, None, d_offset, None


def fused_scale_mask_softmax_dropout(
    input: torch.Tensor,  # noqa: A002 (Megatron's name)
    mask: Optional[torch.Tensor],
    attn_mask_type: AttnMaskType,
    scale: Optional[float],
    dropout_p: float,
    *,
    softmax_in_fp32: bool = True,
    window_size: Optional[tuple[int, int]] = None,
    softmax_offset: Optional[Union[torch.Tensor, float]] = None,
) -> torch.Tensor:
    """dropout(softmax(mask(scale·input)), dropout_p) in one kernel: the attention
    probabilities of Megatron-core's ``DotProductAttention``, dropped out.

    The [b, np, sq, sk] tensor is read once and written once in the forward; the dropout
    mask is drawn inside the kernel with chapter 2's Philox and never stored: the backward
    regenerates it from the seed and recomputes the softmax from ``input`` and 8 bytes of row
    statistics (derivation: :mod:`fusedlib.kernels.softmax`).

    Args:
        input: scores [b, np, sq, sk], float32/float16/bfloat16 (float64 for gradcheck), any
            strides, CUDA or CPU.
        mask: bool, broadcastable to ``input`` ([b or 1, 1, sq, sk] in Megatron-core), True =
            masked; or None. Applied with every mask type.
        attn_mask_type: an :class:`~fusedlib.transformer.enums.AttnMaskType` (Megatron-core's
            enum accepted by member name): causal, padding_causal and causal_bottom_right mask
            keys j > q + sk - sq (bottom-right diagonal), never reading them; padding,
            no_mask and arbitrary add nothing to ``mask``.
        scale: multiplies the scores first (None: 1), e.g. 1/sqrt(head dim).
        dropout_p: probability of dropping each probability, in [0, 1). Pass 0 outside
            training (``torch.nn.Dropout`` in eval mode). 0 runs exactly
            :func:`fused_scale_mask_softmax`'s kernels (same results bit for bit, no random
            numbers drawn). Otherwise applied with 16-bit resolution, p' = round(p·2^16)/2^16
            (within 2^-17 of p), and kept probabilities are scaled by 1/(1 - p'), so the
            expectation is the softmax exactly (chapter 2). A p >= 1 - 2^-17 rounds to p' = 1
            and is refused, as 1 is. The probabilities and their gradient are multiplied
            by the mask, as torch's dropout does: a NaN row stays NaN in every element, and
            a NaN gradient at a dropped position reaches dx.
        softmax_in_fp32: Megatron-core's flag; the kernel computes in float32 whatever it says.
        window_size: ``(left, right)`` sliding window (-1: unbounded side), replacing the
            causal band; or None.
        softmax_offset: sink logits (the off-by-one softmax), a float or a tensor [1] or [np];
            a tensor that requires grad receives its gradient. The sink's own probability is
            not an output, so it is never dropped.

    Returns:
        A new contiguous tensor of ``input``'s shape and dtype. Its dropout mask comes from
        Philox seeded by torch's generator on ``input``'s device (one draw per call with
        dropout_p > 0): ``torch.manual_seed`` reproduces it, and
        :func:`~fusedlib.kernels.softmax.softmax_dropout_mask` of the replayed seed gives it. A
        row with every key masked is zeros (zero gradient), never NaN; a NaN score in a kept
        column makes its row NaN where kept.

    Raises:
        TypeError: input not a float tensor, a non-bool mask, attn_mask_type not an
            AttnMaskType, scale or dropout_p not a real number, softmax_in_fp32 not a bool, a
            softmax_offset that is neither a real number, a floating tensor nor None.
        ValueError: input not 4-D, dropout_p outside [0, 1) or >= 1 - 2^-17 (it would round
            to 1 at the kernels' 16-bit resolution), a scale that is not finite or beyond
            float32's range, a mask that does not broadcast, a bad window or offset, tensors
            on different devices.

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py``
    (``scale_mask_softmax``, then ``attention_dropout``) and
    ``megatron/core/fusions/fused_softmax.py``.
    """
    if not _is_float_tensor(input, 4):
        check_tensor("input", input, ndim=4)
    mask_type = _mask_type_name(attn_mask_type)
    scale_f = _check_scale(scale)
    p = _check_dropout_p(dropout_p)
    if softmax_in_fp32 is not True and softmax_in_fp32 is not False:
        check_bool("softmax_in_fp32", softmax_in_fp32)
    mask = _check_mask(mask, input)
    window = check_window_size(window_size)
    offset = _check_offset(softmax_offset, input)
    if not on_one_kernel_device(*[t for t in (input, mask, offset) if t is not None]):
        check_same_device(input=input, mask=mask, softmax_offset=offset)
    sq, sk = input.shape[-2:]
    if window is not None:
        band = window_band(sq, sk, _window_for(window, sq, sk))
    else:
        band = causal_band(sq, sk) if mask_type in _CAUSAL_TYPES else None
    if p == 0.0:  # exactly the softmax: its Function, its kernels (DROPOUT off), no seed drawn
        return apply(_ScaleMaskSoftmaxFunction, input, mask, scale_f, band, offset)
    return apply(ScaledMaskedSoftmaxDropout, input, mask, scale_f, band, offset, p)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Fused scale + causal mask + softmax: ``apply(inputs, scale)``.

    inputs: [attn_batches, sq, sk] (Megatron-core: ``b·np`` attention batches), float32/16/bf16.
    Row q keeps keys j <= q + sk - sq; the other columns are never read and come out as
    zeros. Returns probabilities of the same shape and dtype. backward returns
    ``(d inputs, None)``: scale·p·(g - sum(g·p)), zeros above the diagonal.

    ``scale`` None is taken as 1.

    Raises:
        TypeError / ValueError: not a 3-D floating tensor, or a scale (other than None) that is
        not a real number, not finite, or beyond float32's range.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``ScaledUpperTriangMaskedSoftmax``).
    """

    @classmethod
    def apply(cls, inputs, scale):
        """``Function.apply``, or the forward alone when autograd has nothing to record
        (no grad mode, or no input requiring grad): see ``fusedlib/fusions/_apply.py``."""
        return apply(cls, inputs, scale)

    @staticmethod
    def forward(ctx, inputs, scale):
        if not _is_float_tensor(inputs, 3):
            check_tensor("inputs", inputs, ndim=3)
        ctx.scale = _check_scale(scale)
        sq, sk = inputs.shape[-2:]
        ctx.band = causal_band(sq, sk)
        out, _ = softmax_fwd(inputs, ctx.scale, band=ctx.band)  # [ab, sq, sk]: one head per attention batch
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, output_grads):
        (p,) = ctx.saved_tensors
        dx, _ = softmax_bwd(output_grads, p, ctx.scale, ctx.band)
        return dx, None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Fused scale + bool mask + softmax: ``apply(inputs, mask, scale)``.

    inputs: [b, np, sq, sk], float32/16/bf16; mask: bool, [b or 1, 1, sq, sk] (or anything that
    broadcasts), True = masked, read as bytes; None means no mask. Returns probabilities of
    inputs' shape and dtype; a fully masked row is zeros. backward returns
    ``(d inputs, None, None)``.

    Raises:
        TypeError / ValueError: not a 4-D floating tensor, a non-bool or non-broadcasting mask,
        a scale that is not a real number, not finite or beyond float32's range, or tensors on
        different devices.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``ScaledMaskedSoftmax``).
    """

    @classmethod
    def apply(cls, inputs, mask, scale):
        """``Function.apply``, or the forward alone when autograd has nothing to record
        (no grad mode, or no input requiring grad): see ``fusedlib/fusions/_apply.py``."""
        return apply(cls, inputs, mask, scale)

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        if not _is_float_tensor(inputs, 4):
            check_tensor("inputs", inputs, ndim=4)
        ctx.scale = _check_scale(scale)
        mask = _check_mask(mask, inputs)
        if not on_one_kernel_device(inputs, *([] if mask is None else [mask])):
            check_same_device(inputs=inputs, mask=mask)
        p, _ = softmax_fwd(inputs, ctx.scale, mask=mask)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, output_grads):
        (p,) = ctx.saved_tensors
        dx, _ = softmax_bwd(output_grads, p, ctx.scale)
        return dx, None, None


class ScaledSoftmax(torch.autograd.Function):
    """Fused scale + softmax (no mask): ``apply(inputs, scale)``.

    inputs: [b, np, sq, sk] or [attn_batches, sq, sk] (any [..., sk] works), float32/16/bf16.
    Returns probabilities of inputs' shape and dtype; backward returns ``(d inputs, None)``.

    Raises:
        TypeError / ValueError: not a floating tensor with at least 1 dim, or a scale that is
        not a real number, not finite, or beyond float32's range.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``ScaledSoftmax``).
    """

    @classmethod
    def apply(cls, inputs, scale):
        """``Function.apply``, or the forward alone when autograd has nothing to record
        (no grad mode, or no input requiring grad): see ``fusedlib/fusions/_apply.py``."""
        return apply(cls, inputs, scale)

    @staticmethod
    def forward(ctx, inputs, scale):
        check_tensor("inputs", inputs, min_ndim=1)
        ctx.scale = _check_scale(scale)
        x4 = inputs.reshape(1, 1, math.prod(inputs.shape[:-1]), inputs.shape[-1])  # [..., sk] -> [1, 1, rows, sk]
        p, _ = softmax_fwd(x4, ctx.scale)
        out = p.view(inputs.shape)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, output_grads):
        (p,) = ctx.saved_tensors
        sk = p.shape[-1]
        rows = math.prod(p.shape[:-1])
        dx, _ = softmax_bwd(output_grads.reshape(1, 1, rows, sk), p.reshape(1, 1, rows, sk), ctx.scale)
        return dx.view(p.shape), None


class SoftmaxOne(nn.Module):
    r"""The off-by-one softmax, p_j = e^{x_j} / (e^{o} + \sum_k e^{x_k}), in one kernel.

    It is a softmax over the row plus one extra "sink" logit o whose probability is dropped, so
    a head can put weight on nothing: when every x_j << o the row sums to ~0 instead of 1.

    Args:
        dim: the softmax dim; must be the last (None or -1), as in Megatron-core.
        denominator_offset: the sink logit o: a float (fixed), or a tensor [np] (one per head;
            an ``nn.Parameter`` makes it learnable and receives its gradient) or [1].
            Default 0.0: the denominator gains e^0 = 1, Miller's softmax_1. (Megatron-core's
            default is 1.0, which its code reads as a logit, adding e^1; and with a float it
            cannot run, since it calls ``.reshape`` on the offset.)

    ``forward(x)``: x [b, np, sq, sk] (per-head offset) or any [..., sk] (scalar offset),
    float32/float16/bfloat16. Returns a tensor like x.

    Raises:
        ValueError: dim not the last, a denominator_offset of the wrong size (or a number that
            is NaN, +inf or beyond the compute dtype's range), x not 4-D with a per-head
            offset. TypeError: dim not an int or None (a bool, a float); denominator_offset not
            a real number, a floating tensor or None; x as :func:`fused_scale_mask_softmax`'s
            input. The messages name ``dim``, ``denominator_offset`` and ``x``.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``SoftmaxOne``); Miller,
    "Attention is off by one" (2023), https://www.evanmiller.org/attention-is-off-by-one.html.
    """

    def __init__(self, dim: Optional[int] = None, denominator_offset: Union[torch.Tensor, float] = 0.0) -> None:
        super().__init__()
        # an int (numpy's too) or None: True passed for dim=1 on a 2-D input, 1.0 as well
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral)):
            raise TypeError(f"dim must be an int (the last dim: -1) or None, got {type_name(dim)} {dim!r}")
        self.dim = dim
        self.denominator_offset = denominator_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, min_ndim=1)
        if self.dim is not None and self.dim not in (-1, x.dim() - 1):
            raise ValueError(f"SoftmaxOne works over the last dim; got dim={self.dim} for a {x.dim()}-D input")
        off = self.denominator_offset
        per_head = isinstance(off, torch.Tensor) and off.numel() > 1
        if per_head or x.dim() == 4:
            if x.dim() != 4:
                raise ValueError(f"a per-head denominator_offset needs x of shape [b, np, sq, sk], got {list(x.shape)}")
            # checked here under its own name (fused_scale_mask_softmax would say softmax_offset)
            return fused_scale_mask_softmax(x, softmax_offset=_check_offset(off, x, "denominator_offset"))
        x4 = x.reshape(1, 1, math.prod(x.shape[:-1]), x.shape[-1])  # [..., sk] -> [1, 1, rows, sk]
        off = _check_offset(off, x4, "denominator_offset")
        return fused_scale_mask_softmax(x4, softmax_offset=off).view(x.shape)


# ---------------------------------------------------------------------------------------------
# The module Megatron-core's attention uses
# ---------------------------------------------------------------------------------------------


class FusedScaleMaskSoftmax(nn.Module):
    """Scale + mask + softmax for attention scores, fused, with a PyTorch fallback.

    Args:
        input_in_fp16, input_in_bf16: the scores' dtype flags (at most one True); with
            ``softmax_in_fp32`` the fallback upcasts such inputs to float32 and casts back.
        attn_mask_type: :class:`~fusedlib.transformer.enums.AttnMaskType` (Megatron-core's enum
            is accepted by member name). Causal types (causal, padding_causal,
            causal_bottom_right) mask keys j > q + sk - sq; every type also applies the mask
            passed to ``forward``, if any.
        scaled_masked_softmax_fusion: use fusedlib's kernel (True) or the PyTorch path.
        mask_func: ``(scores, mask) -> scores`` for the PyTorch path (Megatron-core's
            ``attention_mask_func`` fills -10000); the kernel masks with -inf instead.
        softmax_in_fp32: compute the PyTorch path in float32 (the kernel always does).
        scale: multiplies the scores first, or None (Megatron-core passes the layer number
            for ``apply_query_key_layer_scaling``).
        window_size: ``(left, right)`` sliding window, or None; it replaces the causal band.

    ``forward(input, mask, softmax_offset=None)``: input [b, np, sq, sk]; mask bool,
    broadcastable, True = masked, or None; softmax_offset: sink logits [np] (the off-by-one
    softmax, fixed or learnable). Returns probabilities of input's shape and dtype.

    Raises:
        ValueError: both fp16 and bf16 flags; a scale without softmax_in_fp32 (Megatron-core's
            rule); a scale not finite or beyond float32's range; a bad window; input not 4-D;
            dtype flags that contradict the input's dtype; a mask or softmax_offset on another
            device than input (both paths).
        TypeError: attn_mask_type not an AttnMaskType, mask_func not callable, a flag
            (input_in_fp16, input_in_bf16, scaled_masked_softmax_fusion, softmax_in_fp32) not
            a bool (numpy's bool is accepted), a non-real scale.

    ``attn_mask_type``, ``scale`` and ``window_size`` may be assigned after construction, as in
    Megatron-core (whose forward reads them at every call): the next call uses the new value,
    checked on assignment with the errors above.

    Source: Megatron-LM ``megatron/core/fusions/fused_softmax.py`` (``FusedScaleMaskSoftmax``).
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        softmax_in_fp32: bool,
        scale: Optional[float],
        window_size: Optional[tuple[int, int]] = None,
    ) -> None:
        super().__init__()
        input_in_fp16 = check_bool("input_in_fp16", input_in_fp16)
        input_in_bf16 = check_bool("input_in_bf16", input_in_bf16)
        scaled_masked_softmax_fusion = check_bool("scaled_masked_softmax_fusion", scaled_masked_softmax_fusion)
        softmax_in_fp32 = check_bool("softmax_in_fp32", softmax_in_fp32)
        if input_in_fp16 and input_in_bf16:
            raise ValueError("both fp16 and bf16 flags cannot be active at the same time")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type  # (checked: the property's setter)
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        if not callable(mask_func):
            raise TypeError(f"mask_func must be callable, got {type(mask_func).__name__}")
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        if scale is not None and not softmax_in_fp32:
            raise ValueError("softmax should be in fp32 when scaled (scale given, softmax_in_fp32=False)")
        self.scale = scale  # (checked: the property's setter)
        self.window_size = window_size

    # attn_mask_type, scale and window_size are Megatron-core's public attributes, which its
    # forward reads at every call: one assigned after construction takes effect (and is checked)
    # here too; the mask type's name was cached at construction, and a later causal type ignored.

    @property
    def attn_mask_type(self) -> AttnMaskType:
        """The mask type; assigning one checks it (TypeError) and applies it from the next call."""
        return self._attn_mask_type

    @attn_mask_type.setter
    def attn_mask_type(self, value: AttnMaskType) -> None:
        self._mask_type = _mask_type_name(value)
        self._attn_mask_type = value

    @property
    def scale(self) -> Optional[float]:
        """The scores' scale or None; assigning one checks it as the constructor does (the
        fallback would multiply by a NaN or inf scale without a word)."""
        return self._scale

    @scale.setter
    def scale(self, value: Optional[float]) -> None:
        _check_scale(value)
        self._scale = value

    @property
    def window_size(self) -> Optional[tuple[int, int]]:
        """The sliding window ``(left, right)`` or None; assigning one checks it (ValueError)."""
        return self._window_size

    @window_size.setter
    def window_size(self, value: Optional[tuple[int, int]]) -> None:
        self._window_size = check_window_size(value)

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor],  # noqa: A002
                softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Probabilities [b, np, sq, sk]: the fused kernel when available, else PyTorch."""
        if not _is_float_tensor(input, 4):
            check_tensor("input", input, ndim=4)
        self.check_input_dtype(input)
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask, softmax_offset)
        return self.forward_torch_softmax(input, mask, softmax_offset)

    def check_input_dtype(self, input: torch.Tensor) -> None:  # noqa: A002
        """Raise ValueError when ``input_in_fp16`` / ``input_in_bf16`` names a dtype other than
        ``input``'s (the flags say what the scores are; fusedlib refuses a mismatch rather than
        compute in another precision than the one asked for)."""
        for flag, dtype in (("input_in_fp16", torch.float16), ("input_in_bf16", torch.bfloat16)):
            if getattr(self, flag) and input.dtype != dtype:
                raise ValueError(f"{flag}=True but input has dtype {str(input.dtype).replace('torch.', '')}")

    def is_kernel_available(self, mask: Optional[torch.Tensor], b: int, np: int, sq: int, sk: int) -> bool:
        """fusedlib's rule: the fused kernel runs whenever ``scaled_masked_softmax_fusion`` is on.

        It takes any b, np, sq, sk, any float dtype, masks, windows and offsets, so there is
        no shape condition; Megatron-core's is in :func:`megatron_kernel_availability`.
        """
        return self.scaled_masked_softmax_fusion

    def _is_causal(self) -> bool:
        return self._mask_type in _CAUSAL_TYPES

    def forward_fused_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor],  # noqa: A002
                              softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fused kernel: causal / window as a band (never read outside it), the caller's
        mask read as bytes, the sink logit in the denominator."""
        return fused_scale_mask_softmax(input, mask, self.scale, causal=self._is_causal(),
                                        window_size=self.window_size, softmax_offset=softmax_offset)

    def forward_torch_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor],  # noqa: A002
                              softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The PyTorch path (:func:`fusedlib.unfused.scale_mask_softmax`): upcast, scale,
        ``mask_func``, softmax (or the sink softmax), zero the fully masked rows, cast back.
        The masks: the caller's, or-ed with the causal or sliding-window mask."""
        mask = _check_mask(mask, input)
        if softmax_offset is not None:
            _check_offset(softmax_offset, input)
        # devices first, before the caller's mask meets the causal one: torch's own error for a
        # mismatch names no argument ("Tensor on device cpu is not on the expected device meta!"
        # from mask | structural; "Cannot copy out of meta tensor" for a 'meta' offset)
        for name, t in (("mask", mask), ("softmax_offset", softmax_offset)):
            if isinstance(t, torch.Tensor) and t.device != input.device:
                raise ValueError(f"{name} must be on input's device ({input.device}), got {name} on {t.device}")
        sq, sk = input.shape[-2:]
        structural = None
        if self.window_size is not None:
            structural = unfused.sliding_window_causal_mask(sq, sk, _window_for(self.window_size, sq, sk),
                                                            device=input.device)
        elif self._is_causal():
            structural = unfused.causal_mask(sq, sk, device=input.device)
        if structural is not None:
            mask = structural if mask is None else (mask | structural)
        return unfused.scale_mask_softmax(input, mask, self.scale, self.softmax_in_fp32, softmax_offset,
                                          mask_func=self.mask_func)

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Megatron-core's batch-per-block, computed in Python: see :func:`get_batch_per_block`."""
        return get_batch_per_block(sq, sk, b, np)
