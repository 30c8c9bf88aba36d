"""fusedlib.jit (Megatron's jit_fuser switch) and fusedlib.runtime (where kernels run)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fusedlib import jit, runtime


def test_jit_fuser_is_torch_compile_and_switches():
    try:
        assert jit.jit_fuser is torch.compile
        assert jit.disable_jit_fuser() is jit.noop_decorator
        assert jit.jit_fuser is jit.noop_decorator

        @jit.jit_fuser
        def f(x):
            return x * 2

        assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        assert jit.enable_jit_fuser() is torch.compile
    assert jit.jit_fuser is torch.compile


def test_noop_decorator_returns_the_function():
    def g():
        return 1

    assert jit.noop_decorator(g) is g


def test_kernel_mode_matches_the_machine():
    expected = "interpreted" if not torch.cuda.is_available() else "compiled"
    assert runtime.kernel_mode("cpu" if expected == "interpreted" else "cuda") == expected
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        runtime.kernel_mode("meta")


def test_banner_names_torch_and_triton():
    banner = runtime.device_banner()
    assert f"torch {torch.__version__}" in banner and "triton" in banner


def test_interpreter_is_set_before_kernels_on_a_cpu_only_machine():
    # A fresh process: importing fusedlib must settle TRITON_INTERPRET before any kernel is defined.
    code = ("import os, torch, fusedlib; "
            "print(os.environ.get('TRITON_INTERPRET'), fusedlib.runtime.INTERPRET_ON_CPU, torch.cuda.is_available())")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}  # as a fresh shell
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    if out[2] == "False":
        assert out[:2] == ["1", "True"]
    else:
        assert out[1] == "False"


def test_compiled_mode_refuses_cpu_tensors_clearly():
    # With TRITON_INTERPRET=0 the kernels are compiled (for CUDA); CPU tensors get a clear error.
    code = ("import torch, fusedlib\n"
            "try:\n"
            "    fusedlib.bias_gelu_impl(torch.randn(2, 4), torch.randn(4))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "TRITON_INTERPRET": "0"}).stdout
    assert "compiled for CUDA" in out and "TRITON_INTERPRET=1" in out


def test_triton_imported_before_fusedlib_gives_a_clear_error_on_a_cpu_only_machine():
    code = ("import triton, torch\n"
            "import fusedlib\n"
            "if torch.cuda.is_available():\n"
            "    print('has a GPU')\n"
            "else:\n"
            "    try:\n"
            "        fusedlib.bias_gelu_impl(torch.randn(2, 4), torch.randn(4))\n"
            "    except RuntimeError as e:\n"
            "        print('RuntimeError:', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.startswith("has a GPU") or ("imported before fusedlib" in out and "Import fusedlib first" in out)


def test_collector_paused_for_capture_collects_first_and_restores_the_collector(monkeypatch):
    """A collection before the block, none inside it, the collector's state as it was after it
    (also when the block raises, and when the caller had turned the collector off)."""
    import gc

    from fusedlib.runtime import collector_paused_for_capture

    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(gc.isenabled()) or collect(*a))
    assert gc.isenabled()
    with collector_paused_for_capture():
        assert calls == [True] and not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collector_paused_for_capture():
            raise KeyError("inside the capture")
    assert gc.isenabled() and len(calls) == 2
    gc.disable()
    try:
        with collector_paused_for_capture():
            assert not gc.isenabled()
        assert not gc.isenabled() and len(calls) == 3
    finally:
        gc.enable()
    with collector_paused_for_capture(collect=False):  # the collector off, no collection
        assert not gc.isenabled()
    assert gc.isenabled() and len(calls) == 3
