"""The attention-mask helpers of Megatron-core's ``megatron/core/transformer/utils.py``.

Megatron-core's softmax unit tests import ``attention_mask_func`` from this module; the
masks are the ones :class:`fusedlib.fusions.fused_softmax.FusedScaleMaskSoftmax` builds.
Two deliberate differences from Megatron-core (chapter 5): ``attention_mask_func`` returns a
new tensor instead of filling the scores in place, and ``get_default_causal_mask(sq, sk)``
also takes sq != sk (aligned bottom-right).

Source: Megatron-LM ``megatron/core/transformer/utils.py``.
"""
from __future__ import annotations

from ..fusions.fused_softmax import get_default_causal_mask, get_sliding_window_causal_mask
from ..unfused import attention_mask_func

__all__ = ["attention_mask_func", "get_default_causal_mask", "get_sliding_window_causal_mask"]
