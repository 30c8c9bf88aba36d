"""Baselines a user would pick instead of fusedlib, imported only where installed."""
from __future__ import annotations

import importlib
from typing import Callable

import torch


def try_import(module: str, attr: str) -> tuple[Callable | None, str]:
    """``(getattr(import_module(module), attr), "")``, or ``(None, reason)`` if that fails.

    Baselines (megatron-core, Liger-Kernel, Apex) are never fusedlib dependencies: the
    benchmark times them when they import, and records why when they do not.
    """
    try:
        return getattr(importlib.import_module(module), attr), ""
    except Exception as exc:  # ImportError, or a baseline whose own imports break
        return None, f"{module}.{attr} unavailable: {type(exc).__name__}: {exc}"


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``: what Megatron's ``jit_fuser`` gives on torch >= 2.2."""
    return torch.compile(fn)
