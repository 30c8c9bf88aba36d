"""Enums of the Transformer package, with Megatron-core's names and values.

Source: Megatron-LM ``megatron/core/transformer/enums.py``.
"""
from __future__ import annotations

import enum

__all__ = ["AttnMaskType"]


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
