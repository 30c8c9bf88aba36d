"""Megatron-core's activation functions (``megatron/core/activations.py``), in plain PyTorch.

Megatron-core's unit tests import ``squared_relu`` from here (its weighted squared-ReLU
test builds its reference with it). Megatron decorates each function with ``jit_fuser``
(``torch.compile``); these are the same formulas, eager (wrap them with
:data:`fusedlib.jit.jit_fuser` to compile them).

Source: Megatron-LM ``megatron/core/activations.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["squared_relu", "quick_gelu", "fast_gelu"]


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, ``relu(x)²`` (So et al., "Primer", arXiv:2109.08668).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        A new tensor like ``x``.

    Raises:
        TypeError: from torch, for a non-tensor.

    Source: Megatron-LM ``megatron/core/activations.py`` (``squared_relu``).
    """
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Quick GeLU, ``x·σ(1.702·x)`` (the sigmoid approximation of Hendrycks & Gimpel, arXiv:1606.08415).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        A new tensor like ``x``.

    Raises:
        TypeError: from torch, for a non-tensor.

    Source: Megatron-LM ``megatron/core/activations.py`` (``quick_gelu``).
    """
    return x * torch.sigmoid(1.702 * x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """Fast GeLU, the tanh approximation ``0.5·x·(1 + tanh(0.7978845608·x·(1 + 0.044715·x²)))``.

    Megatron's constant 0.7978845608 is sqrt(2/pi) to 10 digits (chapter 1's
    :func:`fusedlib.unfused.gelu_tanh` uses the full double).

    Args:
        x: any shape, any float dtype; computed in that dtype.

    Returns:
        A new tensor like ``x``.

    Raises:
        TypeError: from torch, for a non-tensor.

    Source: Megatron-LM ``megatron/core/activations.py`` (``fast_gelu``).
    """
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
