"""Placeholders for the slots of a layer spec that a model does not use.

A ``TransformerLayerSubmodules`` slot left at its default builds one of these, so the
layer's ``forward`` can call every slot unconditionally: an ``IdentityOp`` norm returns its
input, an ``IdentityFuncOp`` bias-dropout-add slot returns a function that returns its
first argument.

Source: Megatron-LM ``megatron/core/transformer/identity_op.py``.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

__all__ = ["IdentityOp", "IdentityFuncOp"]

T = TypeVar("T")


class IdentityOp(torch.nn.Module):
    """``IdentityOp(*args, **kwargs)(x, *args, **kwargs) -> x``: any constructor arguments are ignored.

    Source: Megatron-LM ``megatron/core/transformer/identity_op.py``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def forward(self, x: T, *args: object, **kwargs: object) -> T:
        """Return ``x`` itself (the same object, not a copy)."""
        return x


class IdentityFuncOp(IdentityOp):
    """``IdentityFuncOp()(...)`` returns ``f`` with ``f(x, *args) -> x``.

    It stands in for a function *selector*, such as ``get_bias_dropout_add(training, fused)``,
    which returns the function to call: ``IdentityFuncOp()(training, fused)(x_with_bias,
    residual, prob)`` returns ``x_with_bias`` unchanged.

    Source: Megatron-LM ``megatron/core/transformer/identity_op.py``.
    """

    def forward(self, *args: object, **kwargs: object) -> Callable[..., object]:
        """Return a function that returns its first argument and ignores the others."""
        return super().forward
