"""Enums of the Transformer package, with Megatron-core's names and values.

Left out: ``LayerType`` and ``CudaGraphScope`` (pipeline layouts and CUDA-graph scopes,
features fusedlib does not have).

Source: Megatron-LM ``megatron/core/transformer/enums.py``.
"""
from __future__ import annotations

import enum

__all__ = ["ModelType", "AttnType", "AttnMaskType", "AttnBackend"]


class ModelType(enum.Enum):
    """The model's type, as Megatron-core's pipeline schedules read it.

    Member: ``encoder_or_decoder`` (1), GPT, BERT and the like: one stack of layers.

    Source: Megatron-LM ``megatron/core/transformer/enums.py``.
    """

    encoder_or_decoder = 1


class AttnType(enum.Enum):
    """Self-attention (1) or cross-attention (2).

    Source: Megatron-LM ``megatron/core/transformer/enums.py``.
    """

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Which mask the attention softmax applies.

    Members (Megatron-core's values):

    * ``padding`` (1): the caller's bool mask [b or 1, 1, sq, sk] (True = masked), e.g. padded keys.
    * ``causal`` (2): query q sees keys j <= q (for sq != sk fusedlib aligns the diagonal
      bottom-right: j <= q + sk - sq); a caller's mask, if given, is applied as well.
    * ``no_mask`` (3): nothing is masked (Megatron: "only used for TE").
    * ``padding_causal`` (4): causal and the caller's mask (Megatron: "only used for thd attention").
    * ``arbitrary`` (5): any caller-given bool mask.

    * ``causal_bottom_right`` (6): Megatron-core's name for the bottom-right alignment
      ("only used for TE"); in fusedlib the same as ``causal``.

    Source: Megatron-LM ``megatron/core/transformer/enums.py``.
    """

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    """Which attention kernel ``TransformerConfig.attention_backend`` asks for.

    Megatron-core hands the choice to Transformer Engine: ``flash`` = the FlashAttention
    kernels (Dao's), ``fused`` = cuDNN's fused attention, ``unfused`` = TE's materialised
    attention, ``auto`` = TE picks (Megatron's default); ``local`` builds Megatron's own
    materialised ``DotProductAttention``. fusedlib's
    :class:`~fusedlib.transformer.dot_product_attention.DotProductAttention` maps them, in the
    same spirit, onto three paths:

    * ``flash`` (1): fusedlib's own FlashAttention-2 kernel in Triton (chapter 8,
      :func:`~fusedlib.fusions.fused_attention.flash_attention`): one kernel forward, two or three
      backward, the scores never in memory; masks, windows, grouped queries and the
      attention dropout inside the kernel.
    * ``fused`` (2), ``auto`` (5): torch's ``scaled_dot_product_attention``, which picks its
      flash, cuDNN, memory-efficient or math kernel (``fused`` stands for cuDNN's fused
      attention in Megatron-core; SDPA is the library path that reaches it).
    * ``local`` (4), ``unfused`` (3): the materialised path: scores [b·np, sq, sk] by baddbmm,
      ``FusedScaleMaskSoftmax`` (fused or not by ``masked_softmax_fusion``), dropout, bmm.

    Source: Megatron-LM ``megatron/core/transformer/enums.py``.
    """

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
