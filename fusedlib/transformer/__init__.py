"""Megatron-core's ``megatron/core/transformer`` package, as fusedlib needs it.

So far: :mod:`fusedlib.transformer.enums` (``AttnMaskType``).
"""
from .enums import AttnMaskType  # noqa: F401

__all__ = ["AttnMaskType"]
