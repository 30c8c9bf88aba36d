"""``DotProductAttention``: softmax(Q·Kᵀ·scale + mask)·V for every head, the "core attention".

Three paths, chosen by ``config.attention_backend`` at each forward (see
:class:`~fusedlib.transformer.enums.AttnBackend`):

* materialised (``local``, ``unfused``), Megatron-core's steps:

  1. scores [b·np, sq, sk] = softmax_scale · Q·Kᵀ by one ``torch.baddbmm``;
  2. probabilities = ``FusedScaleMaskSoftmax`` (``config.masked_softmax_fusion``: fusedlib's
     kernel, else PyTorch), then the attention dropout (``torch.nn.Dropout``). In training with
     ``masked_softmax_fusion`` and attention_dropout > 0 the two are one kernel,
     ``fused_scale_mask_softmax_dropout``: the dropout mask is drawn from Philox inside the
     softmax kernel and regenerated in the backward, so the [b, np, sq, sk] tensor is read and
     written once instead of three times;
  3. context [sq, b, np·hn] = probabilities·V by ``torch.bmm``.

* FlashAttention (``flash``): fusedlib's Triton kernel,
  :func:`~fusedlib.fusions.fused_attention.flash_attention` (chapter 8), on the [s, b, heads,
  hn] tensors seen as [b, s, heads, hn] through ``transpose(0, 1)`` (views: no copy; the
  output comes back in [s, b, np, hn] memory order, so the final reshape is a view too). The
  causal mask, the sliding window, the caller's bool mask, grouped queries (never repeated)
  and the attention dropout all run inside the kernel; the scores never exist in memory. As on
  the other paths, a window replaces the causal mask, and a row with every key masked gives
  zeros.

* SDPA (``fused``, ``auto``): ``torch.nn.functional.scaled_dot_product_attention``,
  which never writes the scores to memory with its flash or memory-efficient kernels. Causal
  attention with sq == sk and no other mask passes ``is_causal=True``; a caller's mask, a
  sliding window or sq != sk passes an explicit mask (and torch then picks a kernel that takes
  one). Rows whose every key is masked give zeros, as on the materialised path.

Grouped-query attention: the materialised path repeats each key/value head for the np/ng
query heads it serves (``repeat_interleave``, as Megatron-core); SDPA gets ``enable_gqa=True``;
the flash kernel reads key/value head h // (np/ng) for query head h.
Causal masks with sq != sk are aligned bottom-right (query q sees keys j <= q + sk - sq).

Left out: context parallelism, packed sequences (``packed_seq_params``), ``attention_bias``,
the off-by-one softmax types, inference KV caches; Megatron-core's global memory buffer for the
scores (one is allocated per call).

Tensor parallelism: each rank holds np/p query heads and ng/p key/value groups
(:func:`~fusedlib.transformer.utils.heads_per_partition`). Its heads are its own, so their
dropout masks must be too: with p > 1 the attention dropout draws from the tracker's
model-parallel state (:mod:`fusedlib.parallel.random`). :class:`~fusedlib.transformer.attention.Attention`
enters it around its core attention, whatever the backend (Megatron-core forks inside this
module, around the dropout of the materialised path); under sequence parallelism the whole
block runs on that state. On one rank: torch's generator, no fork.

Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import unfused
from ..checks import FLOAT_DTYPES, check_tensor, is_dense
from ..fusions import fused_attention, fused_softmax
from ..fusions.fused_softmax import FusedScaleMaskSoftmax, _window_for
from .enums import AttnBackend, AttnMaskType
from .module import MegatronModule
from .transformer_config import TransformerConfig
from .utils import (attention_mask_func, check_dropout_override, check_layer_number, heads_per_partition,
                    is_layer_window_attention)

__all__ = ["DotProductAttention", "SDPA_BACKENDS", "FLASH_BACKENDS", "MATERIALISED_BACKENDS"]

#: attention_backend values that run torch's scaled_dot_product_attention.
SDPA_BACKENDS = (AttnBackend.fused, AttnBackend.auto)
#: attention_backend values that run fusedlib's FlashAttention kernel (chapter 8).
FLASH_BACKENDS = (AttnBackend.flash,)
#: attention_backend values that run the materialised path (the scores and probabilities in memory).
MATERIALISED_BACKENDS = (AttnBackend.local, AttnBackend.unfused)
_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def _broadcasts(shape: torch.Size, target: tuple[int, int, int, int]) -> bool:
    """Does a tensor of ``shape`` broadcast to ``target`` (numpy's rule, at most 4 dims)?"""
    offset = 4 - len(shape)
    if offset < 0:
        return False
    for i, m in enumerate(shape):
        if m != 1 and m != target[offset + i]:
            return False
    return True


def _check_attention_mask(mask: object, query: torch.Tensor, key: torch.Tensor, np_: int) -> None:
    """The caller's mask, checked once for every backend, as the caller passed it: a bool tensor
    broadcastable to the scores [b, np, sq, sk], on query's device. (Otherwise the SDPA path
    failed inside ``mask | causal`` or a broadcast, and the flash path reported the 4-D view it
    had made of a 2-D mask.)"""
    q_shape = query.shape
    sq, b, sk = q_shape[0], q_shape[1], key.shape[0]
    # the happy case in one test: a 4-D mask (Megatron's [b or 1, 1, sq, sk]) dim by dim, inline
    # (a generator over the dims costs ~1.5 us a call), other broadcastable shapes by _broadcasts
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.device == query.device and is_dense(mask):
        m_shape = mask.shape
        if len(m_shape) == 4:
            m0, m1, m2, m3 = m_shape
            if ((m0 == b or m0 == 1) and (m1 == 1 or m1 == np_) and (m2 == sq or m2 == 1)
                    and (m3 == sk or m3 == 1)):
                return
        elif _broadcasts(m_shape, (b, np_, sq, sk)):
            return
    check_tensor("attention_mask", mask, dtypes=(torch.bool,))  # (sparse: check_dense's TypeError)
    if not _broadcasts(mask.shape, (b, np_, sq, sk)):
        raise ValueError(f"attention_mask must broadcast to the scores' shape [b, np, sq, sk] = {[b, np_, sq, sk]} "
                         f"(Megatron-core's layout [b or 1, 1, sq, sk], True = masked; a 2-D mask is read as [sq, sk], "
                         f"so a key-padding mask [b, sk] is passed as mask[:, None, None, :]), got shape "
                         f"{list(mask.shape)}")
    raise ValueError(f"attention_mask must be on query's device ({query.device}), got {mask.device}")


def _check_qkv(query: object, key: object, value: object, np_: int, ng: int, hn: int) -> None:
    """query [sq, b, np, hn], key and value [sk, b, ng, hn], for every backend alike (the
    materialised path failed in a reshape, the SDPA and flash paths returned a context of
    another width). Called only when the one-test happy case in ``forward`` fails.

    Raises:
        TypeError: one of them not a tensor.
        TypeError: dtypes that differ or are not floating point.
        ValueError: a rank other than 4, or a shape off the module's np, ng, hn (their
            values given), or key and value of different shapes, or another b, or tensors on
            different devices."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"DotProductAttention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"DotProductAttention: {name} must be 4-D ([s, b, heads, hn]), got shape {list(t.shape)}")
    if query.shape[2] != np_ or query.shape[3] != hn:
        raise ValueError(f"DotProductAttention: query must be [sq, b, np, hn] with np = {np_} query heads (this "
                         f"rank's) and hn = kv_channels = {hn}, got shape {list(query.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"DotProductAttention: key and value must have one shape [sk, b, ng, hn], got "
                         f"{list(key.shape)} and {list(value.shape)}")
    if key.shape[2] != ng or key.shape[3] != hn:
        raise ValueError(f"DotProductAttention: key and value must be [sk, b, ng, hn] with ng = {ng} key/value "
                         f"groups (this rank's) and hn = kv_channels = {hn}, got shape {list(key.shape)}")
    if key.shape[1] != query.shape[1]:
        raise ValueError(f"DotProductAttention: query, key and value must have one batch size b (dim 1), got "
                         f"{query.shape[1]} and {key.shape[1]}")
    # every backend alike: the materialised paths read a key of another dtype in a matmul
    # ("expected scalar type Float but found Half"), and one on another device (meta) as
    # unwritten memory, returning a context of garbage without an error
    dtypes = (query.dtype, key.dtype, value.dtype)
    if dtypes[0] not in FLOAT_DTYPES or len(set(dtypes)) > 1:
        raise TypeError(f"DotProductAttention: query, key and value must have one floating dtype (float16, "
                        f"bfloat16, float32 or float64), got {', '.join(str(d).replace('torch.', '') for d in dtypes)}")
    if not query.device == key.device == value.device:
        raise ValueError(f"DotProductAttention: query, key and value must be on one device, got {query.device}, "
                         f"{key.device} and {value.device}")


def materialised_scores(query: torch.Tensor, key: torch.Tensor,
                        alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The materialised path's scores, Megatron-core's steps: query [sq, b, np, hn] and key
    [sk, b, np, hn] (one key head per query head) -> ``(q2, k2, scores)``, q2 [b·np, sq, hn] and
    k2 [b·np, sk, hn] the views the GEMM reads (their strides are the ones autograd's gradients
    of ``torch.baddbmm`` see), scores [b, np, sq, sk] = alpha · q·kᵀ by one ``torch.baddbmm``
    into an empty buffer (beta 0: never read, NaN-safe; freed before the softmax runs). Any float
    dtype, query's device.

    Raises:
        RuntimeError: from ``torch.baddbmm``, for shapes that do not multiply.

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py`` (the raw scores).
    """
    sq, b, np_, hn = query.shape
    sk = key.size(0)
    q2 = query.reshape(sq, b * np_, hn).transpose(0, 1)  # [sq, b, np, hn] -> [b·np, sq, hn]
    k2 = key.reshape(sk, b * np_, hn).transpose(0, 1)  # [sk, b, np, hn] -> [b·np, sk, hn]
    buffer = torch.empty((b * np_, sq, sk), device=query.device, dtype=query.dtype)
    scores = torch.baddbmm(buffer, q2, k2.transpose(1, 2), beta=0.0, alpha=alpha)  # [b·np, sq, sk]
    return q2, k2, scores.view(b, np_, sq, sk)


def materialised_context(probs: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The materialised path's context: probabilities [b, np, sq, sk] and value [sk, b, np, hn]
    -> ``(p3, v2, context)``, p3 [b·np, sq, sk] and v2 [b·np, sk, hn] the views ``torch.bmm``
    reads, context [sq, b, np·hn] (contiguous), probs' dtype.

    Raises:
        RuntimeError: from ``torch.bmm``, for shapes that do not multiply.

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py`` (the context).
    """
    b, np_, sq, sk = probs.shape
    hn = value.size(-1)
    p3 = probs.view(b * np_, sq, sk)
    v2 = value.reshape(sk, b * np_, hn).transpose(0, 1)  # [sk, b, np, hn] -> [b·np, sk, hn]
    context = torch.bmm(p3, v2)  # [b·np, sq, hn] -> [b, np, sq, hn] -> [sq, b, np, hn]
    return p3, v2, context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous().view(sq, b, np_ * hn)


def sdpa_is_causal_call(causal: bool, sq: int, sk: int, scale: float) -> bool:
    """Whether the SDPA path's call without a mask or window takes ``is_causal`` (or no mask at all,
    for non-causal attention) rather than an explicit mask: causal attention only for a square
    score matrix and a scale > 0 (``is_causal`` with a scale <= 0 gave NaN in torch's SDPA, seen
    on the CPU with torch 2.13; the explicit mask gives the same probabilities without it)."""
    return not causal or (sq == sk and scale > 0)


def sdpa_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, causal: bool,
                 scale: float, gqa: bool) -> torch.Tensor:
    """The SDPA path's call without a mask or window (:func:`sdpa_is_causal_call` true): query
    [sq, b, np, hn], key and value [sk, b, ng, hn] seen as [b, heads, s, hn] (views: SDPA takes
    strided inputs) -> ``scaled_dot_product_attention(q, k, v, dropout_p, is_causal=causal,
    scale, enable_gqa=gqa)`` -> the context [sq, b, np·hn] (a copy where the output's layout asks
    for one). Any float dtype, query's device.

    Raises:
        RuntimeError, TypeError: torch's, for arguments its SDPA refuses.

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py`` (the context's
    layout); ``torch.nn.functional.scaled_dot_product_attention``.
    """
    sq, b, np_, hn = query.shape
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), dropout_p=dropout_p,
                                         is_causal=causal, scale=scale, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [b, np, sq, hn] -> [sq, b, np·hn]


class DotProductAttention(MegatronModule):
    """Core attention of one layer: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np·hn].

    Args:
        config: reads kv_channels, num_attention_heads, num_query_groups, fp16/bf16,
            masked_softmax_fusion, attention_softmax_in_fp32, apply_query_key_layer_scaling,
            attention_dropout, window_size, window_attn_skip_freq and (at each forward)
            attention_backend.
        layer_number: 1-based (an int >= 1); the query-key layer scaling divides by it.
            (Megatron-core takes ``max(1, layer_number)``, so 0 and negatives pass there; here
            they are refused, as is a layer number beyond a ``window_attn_skip_freq`` list.)
        attn_mask_type: an :class:`AttnMaskType` (causal types add the causal mask).
        attention_type: "self" or "cross" (unused, as in Megatron-core).
        attention_dropout: overrides config.attention_dropout; None or a probability in [0, 1)
            (as the config's field; numpy floats accepted).
        softmax_scale: the scores' scale; None: 1/sqrt(hn).
        cp_comm_type, pg_collection: must be None (context parallelism, process groups: left out).

    ``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)``: attention_mask bool, broadcastable to [b, np, sq, sk], True =
    masked, or None. ``attn_mask_type`` is accepted and unused, as in Megatron-core (the mask
    type is fixed at construction). Returns the context, [sq, b, np·hn], query's dtype.

    Raises:
        NotImplementedError: cp_comm_type, pg_collection, attention_bias or packed_seq_params given.
        TypeError / ValueError: layer_number not an int / < 1 (:func:`check_layer_number`);
            attention_dropout neither None nor a real number, a bool included
            (:class:`~fusedlib.checks.ArgumentTypeError`, a TypeError) / outside [0, 1), NaN included.
        ValueError: config.num_attention_heads 0 (a norms-only config), or num_attention_heads or
            num_query_groups not divisible by config.tensor_model_parallel_size
            (:func:`~fusedlib.transformer.utils.heads_per_partition`).
        TypeError: attention_mask not a bool tensor (e.g. an additive float mask); query, key and
            value not of one floating dtype; whatever the backend.
        ValueError: query, key and value on different devices; query, key or value not 4-D or off [sq, b, np, hn] / [sk, b, ng, hn] with
            this module's np, ng and hn = kv_channels (the message gives them), whatever the
            backend; attention_mask not broadcastable to [b, np, sq, sk] (the message gives the
            shape passed) or not on query's device, whatever the backend; with the
            materialised backends (local, unfused), in training and evaluation alike, as
            FusedScaleMaskSoftmax (e.g. config.bf16 with float32 scores).
        TypeError / ValueError: softmax_scale not a real number (a tensor neither: pass
            ``float(t)``) / not finite or with
            |softmax_scale|·log2(e) beyond float32's range, whatever the backend (as
            :func:`~fusedlib.fusions.fused_attention.flash_attention` checks it); attention_mask
            sparse (TypeError: pass ``attention_mask.to_dense()``).
        TypeError / ValueError: with ``attention_backend`` flash, as
            :func:`~fusedlib.fusions.fused_attention.flash_attention` (e.g. float64 tensors, or a
            head dim above 256).

    Source: Megatron-LM ``megatron/core/transformer/dot_product_attention.py``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: object = None) -> None:
        super().__init__(config=config)
        if cp_comm_type is not None or pg_collection is not None:
            raise NotImplementedError("DotProductAttention: context parallelism (cp_comm_type) and process-group "
                                      "collections (pg_collection) are left out of fusedlib")
        self.layer_number = check_layer_number("DotProductAttention", layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in Megatron-core
        self.hidden_size_per_attention_head = config.kv_channels  # hn
        # tensor parallelism: this rank's np/p query heads and ng/p key/value groups
        self.num_attention_heads_per_partition, self.num_query_groups_per_partition = heads_per_partition(config)
        self.hidden_size_per_partition = config.kv_channels * self.num_attention_heads_per_partition  # np/p·hn

        coeff = None
        # checked as flash_attention checks it, whatever the backend (the materialised and SDPA
        # paths multiplied by a NaN or inf scale without a word)
        self.softmax_scale = fused_attention._check_scale(softmax_scale, self.hidden_size_per_attention_head)
        if config.apply_query_key_layer_scaling:
            # scores are computed at scale/layer_number and multiplied back by layer_number inside
            # the fp32 softmax: the same probabilities, a smaller fp16 range for the GEMM's output
            coeff = self.layer_number
            self.softmax_scale /= coeff
        self.window_size = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number) else None
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=config.fp16,
            input_in_bf16=config.bf16,
            attn_mask_type=attn_mask_type,
            scaled_masked_softmax_fusion=config.masked_softmax_fusion,
            mask_func=attention_mask_func,
            softmax_in_fp32=config.attention_softmax_in_fp32,
            scale=coeff,
            window_size=self.window_size,
        )
        attention_dropout = check_dropout_override(
            "DotProductAttention", "attention_dropout", attention_dropout, below_one=True,
            why=" (1 would drop every attention probability: the context would be zeros; the flash and fused "
                "softmax+dropout kernels refuse it)")
        self.attention_dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None
                                                  else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: object = None) -> torch.Tensor:
        """Context [sq, b, np·hn] (see the class docstring)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("DotProductAttention: attention_bias and packed_seq_params are left out")
        np_, ng, hn = self.num_attention_heads_per_partition, self.num_query_groups_per_partition, \
            self.hidden_size_per_attention_head
        # the happy case in one test (comparisons, no loop, no try: traced by torch.compile as is)
        ok = (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
              and query.dim() == 4 and key.dim() == 4 and key.shape == value.shape and query.shape[2] == np_
              and key.shape[2] == ng and query.shape[3] == hn and key.shape[3] == hn
              and key.shape[1] == query.shape[1] and query.dtype == key.dtype == value.dtype
              and query.dtype in FLOAT_DTYPES and query.device == key.device == value.device)
        if not ok:
            _check_qkv(query, key, value, np_, ng, hn)
        if attention_mask is not None:
            _check_attention_mask(attention_mask, query, key, self.num_attention_heads_per_partition)
        backend = self.config.attention_backend
        if backend in FLASH_BACKENDS:
            return self._forward_flash(query, key, value, attention_mask)
        if backend in SDPA_BACKENDS:
            return self._forward_sdpa(query, key, value, attention_mask)
        return self._forward_materialised(query, key, value, attention_mask)

    # ------------------------------------------------------------------ materialised
    def _forward_materialised(self, query, key, value, attention_mask):
        np_, ng = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if np_ // ng > 1:
            # [sk, b, ng, hn] -> [sk, b, np, hn]: each key/value head once per query head it serves
            key = key.repeat_interleave(np_ // ng, dim=2)
            value = value.repeat_interleave(np_ // ng, dim=2)
        scores = materialised_scores(query, key, self.softmax_scale)[2]
        probs = self._softmax_dropout(scores, attention_mask)
        return materialised_context(probs, value)[2]

    def kernel_scale(self) -> float:
        """The scale of q·kᵀ where one kernel computes the whole attention (FlashAttention, SDPA):
        ``softmax_scale`` times the softmax module's ``scale`` (query-key layer scaling splits the
        scale between the two; None counts as 1), unchecked: each kernel's op checks it."""
        return self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def softmax_function(self, dropout_p: float) -> Optional[type]:
        """The autograd Function the materialised path's softmax runs as, on causal scores without a
        caller's mask, in training with attention dropout ``dropout_p`` (a float checked by the
        caller): :class:`~fusedlib.fusions.fused_softmax.ScaledMaskedSoftmaxDropout` (the softmax
        and its dropout in one kernel) or, with dropout 0, the fused softmax's own Function; None
        where the module would run torch's softmax or dropout instead, or another mask or window
        (``_softmax_dropout`` and ``FusedScaleMaskSoftmax.forward`` decide the same way).
        :class:`~fusedlib.transformer.fused_layer.FusedTransformerLayer` calls it to run the
        same Function. Raises nothing."""
        softmax = self.scale_mask_softmax
        if type(softmax) is not FusedScaleMaskSoftmax or type(self.attention_dropout) is not torch.nn.Dropout:
            return None
        if dropout_p > 0:
            if not (self.config.masked_softmax_fusion and self.attn_mask_type in _CAUSAL and self.window_size is None
                    and getattr(fused_softmax, "fused_scale_mask_softmax_dropout", None) is not None):
                return None
            return fused_softmax.ScaledMaskedSoftmaxDropout
        if not (softmax.scaled_masked_softmax_fusion and softmax._is_causal() and softmax.window_size is None):
            return None
        return fused_softmax._ScaleMaskSoftmaxFunction

    def _softmax_dropout(self, scores: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        p = self.attention_dropout.p
        fused_dropout = getattr(fused_softmax, "fused_scale_mask_softmax_dropout", None)
        if self.training and p > 0 and self.config.masked_softmax_fusion:
            if fused_dropout is not None:  # one kernel: scale, mask, softmax, dropout
                self.scale_mask_softmax.check_input_dtype(scores)  # as the softmax's own forward
                return fused_dropout(scores, attention_mask, self.attn_mask_type, self.scale_mask_softmax.scale, p,
                                     softmax_in_fp32=self.config.attention_softmax_in_fp32,
                                     window_size=self.window_size)
            # without the fused softmax+dropout kernel: the fused softmax, then torch's dropout
        return self.attention_dropout(self.scale_mask_softmax(scores, attention_mask))

    # ------------------------------------------------------------------ FlashAttention
    def _forward_flash(self, query, key, value, attention_mask):
        sq, b, np_, hn = query.shape
        # [s, b, heads, hn] -> [b, s, heads, hn]: views, which the kernel reads through their strides
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        causal = self.attn_mask_type in _CAUSAL and self.window_size is None  # a window replaces causal
        scale = self.kernel_scale()
        dropout_p = self.attention_dropout.p if self.training else 0.0
        mask = attention_mask
        if mask is not None and mask.dim() < 4:  # broadcastable to [b, np, sq, sk]: as 4-D (a view)
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        out = fused_attention.flash_attention(q, k, v, causal=causal, softmax_scale=scale, attention_mask=mask,
                                              window_size=self.window_size, dropout_p=dropout_p,
                                              deterministic=self.config.deterministic_mode)
        # [b, sq, np, hn] in [sq, b, np, hn] memory order (the output follows q's): both steps are views
        return out.transpose(0, 1).reshape(sq, b, np_ * hn)

    # ------------------------------------------------------------------ SDPA
    def _forward_sdpa(self, query, key, value, attention_mask):
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        causal = self.attn_mask_type in _CAUSAL
        scale = self.kernel_scale()
        dropout_p = self.attention_dropout.p if self.training else 0.0
        gqa = np_ != self.num_query_groups_per_partition
        if attention_mask is None and self.window_size is None and sdpa_is_causal_call(causal, sq, sk, scale):
            return sdpa_context(query, key, value, dropout_p, causal, scale, gqa)
        # [s, b, heads, hn] -> [b, heads, s, hn] (views: SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # an explicit mask: the structural one, the caller's, or both
        masked = self._structural_mask(sq, sk, causal, query.device)
        if attention_mask is not None:
            masked = attention_mask if masked is None else (attention_mask | masked)
        empty = masked.all(dim=-1, keepdim=True)  # rows with nothing to attend to: SDPA would give NaN
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~(masked & ~empty), dropout_p=dropout_p, scale=scale,
                                             enable_gqa=gqa)
        out = out.masked_fill(empty, 0.0)  # ... they give zeros, as FusedScaleMaskSoftmax does
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [b, np, sq, hn] -> [sq, b, np·hn]

    def _structural_mask(self, sq: int, sk: int, causal: bool, device: torch.device) -> Optional[torch.Tensor]:
        """The causal or sliding-window mask [sq, sk] (True = masked), as FusedScaleMaskSoftmax builds it."""
        if self.window_size is not None:  # (a side past the sequence as -1: 2**70 passes torch.triu)
            return unfused.sliding_window_causal_mask(sq, sk, _window_for(self.window_size, sq, sk), device=device)
        return unfused.causal_mask(sq, sk, device=device) if causal else None
