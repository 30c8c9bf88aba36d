"""Baselines a user would pick instead of fusedlib, imported only where installed, and the
one way every benchmark case compiles its ``torch.compile`` baseline.

Honest compiled baselines: in a training run a function sees one shape, so Inductor
specializes on it. A function compiled once and called at several shapes does not: on
the second shape Dynamo's "automatic dynamic shapes" recompiles it with symbolic sizes,
and that kernel can be much slower (bias-GeLU at [8192, 16384] bf16 on the H200: 0.358 ms
against 0.176 ms compiled statically), which would flatter fusedlib. Every case therefore
gets a fresh ``torch.compile(fn, dynamic=False)`` (:func:`compiled`), built by
:func:`compile_impl`, which also records the choice in each record (``"compile":
"static"``). A sweep may opt in to one dynamic compile shared by its shapes
(``dynamic=True``, recorded as ``"compile": "dynamic"``) where compiling every shape is
too slow to be worth it; it must say so where it does (the softmax sweeps).
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..core import Impl

#: Dynamo's recompile limit per code object is raised to this: each shape of a sweep is one
#: more static compile of the same code object (a lambda built in a loop shares its code),
#: and past the limit (8 by default) Dynamo silently runs the function eagerly.
RECOMPILE_LIMIT = 64


def try_import(module: str, attr: str) -> tuple[Callable | None, str]:
    """``(getattr(import_module(module), attr), "")``, or ``(None, reason)`` if that fails.

    Baselines (megatron-core, Liger-Kernel, Apex) are never fusedlib dependencies: the
    benchmark times them when they import, and records why when they do not.
    """
    try:
        return getattr(importlib.import_module(module), attr), ""
    except Exception as exc:  # ImportError, or a baseline whose own imports break
        return None, f"{module}.{attr} unavailable: {type(exc).__name__}: {exc}"


def compiled(fn: Callable, *, dynamic: bool = False, backend: str | Callable = "inductor") -> Callable:
    """A fresh ``torch.compile(fn, dynamic=dynamic)``: what Megatron's ``jit_fuser`` gives on
    torch >= 2.2, compiled for the shape it is first called at.

    Args:
        fn: the function to compile (plain PyTorch).
        dynamic: False (default): Inductor specializes on every shape it sees, one compile
            per shape, as in a training run whose shapes never change. True: one compile
            with symbolic sizes for every shape (an explicit opt-in; see the module docstring).
        backend: ``torch.compile``'s backend (the default, Inductor, is what users get; tests
            pass a recording backend).

    Returns:
        The compiled callable (compiles lazily, at its first call). Raises Dynamo's recompile
        limit to :data:`RECOMPILE_LIMIT` in this process, so a sweep's shapes never fall back
        to eager.
    """
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6 / older name
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=dynamic, backend=backend)


def compile_impl(fn: Callable, *, dynamic: bool = False, adapt: Callable[[Callable], Callable] | None = None,
                 backend: str | Callable = "inductor") -> Impl:
    """The ``"torch.compile"`` implementation of a case: :func:`compiled` of ``fn``, marked
    ``compile="static"`` (or ``"dynamic"``) so every record says how it was compiled.

    Args:
        fn: the unfused PyTorch function to compile.
        dynamic: see :func:`compiled`; True only for a sweep that means it.
        adapt: wraps the compiled function to the case's input signature (e.g. drop extra
            inputs other implementations need), or None.
        backend: see :func:`compiled`.
    """
    fn_c = compiled(fn, dynamic=dynamic, backend=backend)
    return Impl("torch.compile", adapt(fn_c) if adapt else fn_c, compile="dynamic" if dynamic else "static")
