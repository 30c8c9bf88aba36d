"""Megatron-core's ``megatron/core/transformer`` package, as fusedlib needs it.

So far: :mod:`fusedlib.transformer.enums` (``AttnMaskType``),
:mod:`fusedlib.transformer.transformer_config` (``TransformerConfig``, the switches the
fused modules read) and :mod:`fusedlib.transformer.utils` (``attention_mask_func`` and the
causal and sliding-window mask builders).
"""
from .enums import AttnMaskType  # noqa: F401
from .transformer_config import TransformerConfig  # noqa: F401

__all__ = ["AttnMaskType", "TransformerConfig"]
