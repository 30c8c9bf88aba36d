"""Every @triton.jit function reads only globals the Triton *compiler* accepts.

Triton's interpreter (CPU) runs a kernel that reads a plain Python float global; the
compiler (GPU) refuses it with a NameError. CI has no GPU, so this test is what catches
it: a kernel may read ``tl.constexpr`` globals, other ``@triton.jit`` functions, modules,
and the builtins the compiler knows (``range``, ``min``...), nothing else.
"""
from __future__ import annotations

import builtins
import importlib
import pkgutil
import types

import triton.language as tl

import fusedlib.kernels


def _jit_functions():
    for info in pkgutil.iter_modules(fusedlib.kernels.__path__):
        mod = importlib.import_module(f"fusedlib.kernels.{info.name}")
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if isinstance(fn, types.FunctionType) and fn.__module__ == mod.__name__ and hasattr(obj, "run"):
                yield f"{mod.__name__}.{name}", fn


def _names(code):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def test_there_are_kernels_to_check():
    assert any(True for _ in _jit_functions())


def test_kernels_read_only_constexpr_globals():
    bad = []
    for qualname, fn in _jit_functions():
        for name in set(_names(fn.__code__)):
            if name not in fn.__globals__:
                continue  # an attribute name (tl.load -> "load") or a builtin
            value = fn.__globals__[name]
            ok = (isinstance(value, (tl.constexpr, types.ModuleType)) or hasattr(value, "fn")
                  or name in vars(builtins) or isinstance(value, tl.dtype))
            if not ok:
                bad.append(f"{qualname} reads global {name}={value!r} ({type(value).__name__}); "
                           f"make it tl.constexpr(...)")
    assert not bad, "\n".join(bad)
