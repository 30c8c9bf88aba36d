"""Megatron-core's ``megatron/core/transformer`` package, as fusedlib needs it.

So far: :mod:`fusedlib.transformer.enums` (``AttnMaskType``) and
:mod:`fusedlib.transformer.transformer_config` (``TransformerConfig``, the switches the
fused modules read).
"""
from .enums import AttnMaskType  # noqa: F401
from .transformer_config import TransformerConfig  # noqa: F401

__all__ = ["AttnMaskType", "TransformerConfig"]
