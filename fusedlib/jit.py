"""``jit_fuser``: PyTorch's own fuser, as Megatron-core uses it for its "fused" ops.

Megatron-core decorates its elementwise fusions (``bias_gelu``, ``bias_swiglu``,
``bias_dropout_add``...) with ``jit_fuser``: ``torch.compile`` on torch >= 2.2 (nvFuser
under ``torch.jit.script`` was deprecated then), else ``torch.jit.script``.
``disable_jit_fuser()`` turns it into a no-op decorator, for debugging or for machines
where compilation is unwanted; ``enable_jit_fuser()`` turns it back on.

Like Megatron's, the switch rebinds the module attribute ``fusedlib.jit.jit_fuser``:
functions decorated earlier keep the decorator they got. Read it through the module
(``from fusedlib import jit; @jit.jit_fuser``) to see the current choice.

Source: Megatron-LM, ``megatron/core/jit.py``.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

__all__ = ["jit_fuser", "enable_jit_fuser", "disable_jit_fuser", "noop_decorator"]

F = TypeVar("F", bound=Callable)


def noop_decorator(func: F) -> F:
    """Return ``func`` unchanged: the decorator ``jit_fuser`` becomes when disabled.

    Source: Megatron-LM ``megatron/core/jit.py`` (``noop_decorator``).
    """
    return func


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def enable_jit_fuser() -> Callable:
    """Set ``jit_fuser`` to ``torch.compile`` (torch >= 2.2) or ``torch.jit.script``.

    Returns:
        The decorator now bound to ``fusedlib.jit.jit_fuser``.

    Source: Megatron-LM ``megatron/core/jit.py`` (``enable_jit_fuser``, which returns nothing).
    """
    global jit_fuser
    jit_fuser = torch.compile if _torch_at_least(2, 2) else torch.jit.script
    return jit_fuser


def disable_jit_fuser() -> Callable:
    """Set ``jit_fuser`` to :func:`noop_decorator`: decorated functions run eagerly.

    Returns:
        The decorator now bound to ``fusedlib.jit.jit_fuser``.

    Source: Megatron-LM ``megatron/core/jit.py`` (``disable_jit_fuser``, which returns nothing).
    """
    global jit_fuser
    jit_fuser = noop_decorator
    return jit_fuser


jit_fuser: Callable = torch.compile
enable_jit_fuser()
