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


def _python_with(code: str, **env: str) -> str:
    """The standard output of a fresh Python process running ``code`` with ``env`` added."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**__import__("os").environ, **env}).stdout


@pytest.mark.parametrize("value", ["true", "Yes", "on"])
def test_triton_interpret_is_read_as_triton_reads_it(value):
    # "true" made Triton interpret the kernels while fusedlib (which took only "1") treated them
    # as compiled: CPU tensors were refused with "TRITON_INTERPRET is set to a false value", and
    # on a GPU machine the interpreter's bf16 rounding fix would have been skipped
    code = ("import torch, fusedlib, triton\n"
            "from fusedlib.kernels import launch\n"
            "y = fusedlib.bias_gelu_impl(torch.ones(2, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))\n"
            "print(fusedlib.runtime.INTERPRET_ON_CPU, launch.DIRECT_LAUNCH, fusedlib.runtime.kernel_mode('cpu'), "
            "float(y[0, 0]))\n")
    out = _python_with(code, TRITON_INTERPRET=value).split()
    # gelu_tanh(1) in float64: 0.5·(1 + tanh(sqrt(2/pi)·(1 + 0.044715)))
    assert out[:3] == ["True", "False", "interpreted"] and abs(float(out[3]) - 0.8411919906082768) < 1e-12, out


def test_compiled_mode_refuses_cpu_tensors_clearly():
    # With TRITON_INTERPRET=0 the kernels are compiled (for CUDA); CPU tensors get a clear error.
    code = ("import torch, fusedlib\n"
            "try:\n"
            "    fusedlib.bias_gelu_impl(torch.randn(2, 4), torch.randn(4))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    out = _python_with(code, TRITON_INTERPRET="0")
    assert "compiled for CUDA" in out and "TRITON_INTERPRET=1" in out
    # without a GPU, moving the tensors to one is no advice: the message says there is none
    if torch.cuda.is_available():
        assert "move the tensors to a CUDA device" in out
    else:
        assert "this machine has no CUDA device" in out and "move the tensors" not in out


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


def test_restore_after_failed_capture_puts_back_the_stream_and_the_generators(monkeypatch):
    """torch.cuda.graph's exit raises from capture_end before it leaves its stream context, so a
    failed capture leaves its side stream current, and its device (and the CUDA generators in
    capture mode). When its block raises having changed the current device or the current stream
    of the current device or of the device named, the context manager makes the streams and the
    device of its entry current again, ends the allocator's routing to the pool it handed the
    block (on the capture's device: the one current when the error arrives) and resets the
    generators (a KeyboardInterrupt included); an error that changed neither (a warm-up call's)
    only has the routing ended (the allocator refuses a pool it does not route to), success
    nothing, and nothing is looked at for a CPU device or without CUDA. An error in ending the
    routing becomes a warning: the block's error is raised and the generators are reset. Stand-ins for torch.cuda's device and
    stream functions here (a stream: (device, name)); the real failure: the GPU tests of the
    bench timer, the layers' graphs and the trainer's whole-step graph."""
    import fusedlib.runtime as rt

    state = {"device": 0, "streams": {0: (0, "s0"), 1: (1, "s1")}}
    events = []

    def set_stream(stream):  # as torch.cuda.set_stream: the stream's device becomes current too
        events.append(("set", stream))
        state["streams"][stream[0]] = stream
        state["device"] = stream[0]

    def set_device(index):
        events.append(("device", index))
        state["device"] = index

    def capture_fails_on(index):  # what a failed torch.cuda.graph exit leaves: its stream and device current
        state["device"] = index
        state["streams"][index] = (index, "capture")
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(rt, "CUDA_AVAILABLE", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: state["streams"][index])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(rt, "reset_generators_after_failed_capture", lambda: events.append("reset"))
    pools = iter(range(1, 100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(rt, "end_pool_of_failed_capture", lambda index, pool: events.append(("end", index, pool)))
    start = {"device": 0, "streams": dict(state["streams"])}

    with pytest.raises(RuntimeError, match="during capture"):
        with rt.restore_after_failed_capture() as pool:
            assert pool == (0, 1)
            capture_fails_on(0)
    assert state == start and events == [("set", (0, "s0")), ("device", 0), ("end", 0, (0, 1)), "reset"]
    events.clear()
    with pytest.raises(KeyboardInterrupt):
        with rt.restore_after_failed_capture(0) as pool:
            state["streams"][0] = (0, "capture")
            raise KeyboardInterrupt
    assert state == start and events == [("set", (0, "s0")), ("device", 0), ("end", 0, pool), "reset"]
    events.clear()
    for device in (1, "cuda:1", torch.device("cuda", 1)):  # the capture on another device than the current one
        with pytest.raises(RuntimeError):
            with rt.restore_after_failed_capture(device) as pool:
                capture_fails_on(1)
        assert state == start and events == [("set", (0, "s0")), ("set", (1, "s1")), ("device", 0),
                                             ("end", 1, pool), "reset"]
        events.clear()
    with pytest.raises(RuntimeError):  # "cuda" without an index: the current device's capture
        with rt.restore_after_failed_capture("cuda") as pool:
            capture_fails_on(0)
    assert state == start and events == [("set", (0, "s0")), ("device", 0), ("end", 0, pool), "reset"]
    events.clear()
    with pytest.raises(ValueError, match="warm-up"):  # nothing changed: nothing restored, no reset
        with rt.restore_after_failed_capture() as pool:
            raise ValueError("a warm-up call's error, before the capture")
    assert state == start and events == [("end", 0, pool)]
    events.clear()
    # generators registered with the capture: taken out of capture mode before the default ones' reset
    monkeypatch.setattr(rt, "_end_capture_mode", lambda gens: events.append(("end mode", list(gens))))
    with pytest.raises(RuntimeError):
        with rt.restore_after_failed_capture(generators=["g1", "g2"]) as pool:
            capture_fails_on(0)
    assert state == start and events == [("set", (0, "s0")), ("device", 0), ("end", 0, pool),
                                         ("end mode", ["g1", "g2"]), "reset"]
    events.clear()
    with pytest.raises(ValueError):
        with rt.restore_after_failed_capture(generators=["g1"]) as pool:
            raise ValueError("a warm-up call's error, before the capture")
    assert events == [("end", 0, pool)]
    events.clear()
    with rt.restore_after_failed_capture() as pool:
        assert pool is not None
    assert state == start and events == []

    def end_fails(index, pool):
        events.append(("end", index, pool))
        raise RuntimeError("INTERNAL ASSERT FAILED")

    monkeypatch.setattr(rt, "end_pool_of_failed_capture", end_fails)
    with pytest.raises(RuntimeError, match="during capture"), \
            pytest.warns(RuntimeWarning, match="ending the caching allocator's routing .* INTERNAL ASSERT FAILED"):
        with rt.restore_after_failed_capture() as pool:
            capture_fails_on(0)
    assert state == start and events == [("set", (0, "s0")), ("device", 0), ("end", 0, pool), "reset"]
    events.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("looked at a CUDA device"))
    for device, cuda in ((torch.device("cpu"), True), ("cpu", True), (None, False)):
        monkeypatch.setattr(rt, "CUDA_AVAILABLE", cuda)
        with pytest.raises(ValueError):
            with rt.restore_after_failed_capture(device) as pool:
                assert pool is None
                raise ValueError("a stand-in capture's failure")
        assert events == []


def test_end_capture_mode_runs_an_empty_capture_registering_the_generators(monkeypatch):
    """On stand-ins of torch's graph classes: a new graph registers every generator, an empty
    capture runs (its "empty graph" warning silenced), and a failure of that becomes a
    RuntimeWarning instead of replacing the capture's own error. The real effect (a generator
    that draws again after a failed capture): test_bench_book's GPU test of the timer."""
    import contextlib
    import warnings

    import fusedlib.runtime as rt

    events = []

    class Graph:
        def register_generator_state(self, g):
            events.append(("register", g))

    @contextlib.contextmanager
    def graph(g):
        events.append("begin")
        yield
        warnings.warn("The CUDA Graph is empty.")
        events.append("end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt._end_capture_mode(["g1", "g2"])
    assert events == [("register", "g1"), ("register", "g2"), "begin", "end"]

    def fails(g):
        raise RuntimeError("capture_begin failed")

    monkeypatch.setattr(torch.cuda, "graph", fails)
    with pytest.warns(RuntimeWarning, match="taking its registered generators out of capture mode failed: "
                                            "RuntimeError: capture_begin failed"):
        rt._end_capture_mode(["g1"])


def test_end_pool_of_failed_capture_ends_the_routing_and_releases_the_pool_only_when_it_was_left_on(monkeypatch):
    """After a capture whose exit stopped before ending the allocator's routing to its pool, the
    routing is ended and the pool's reference (taken when the capture began) released, on the
    device named; when the allocator has no routing to the pool (the exit ended it, or no capture
    used the pool) it refuses, and nothing is released. Stand-ins for torch's allocator calls
    here; the real failure: the GPU tests of the bench timer, the layers' graphs and the
    trainer's whole-step graph, which ask that empty_cache frees memory afterwards."""
    import fusedlib.runtime as rt

    routing, calls = {(1, (0, 7))}, []

    def end(index, pool):
        calls.append(("end", index, pool))
        if pool == (0, 9):
            raise RuntimeError("INTERNAL ASSERT FAILED")
        if (index, pool) not in routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        routing.discard((index, pool))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda index, pool: calls.append(("release", index, pool)),
                        raising=False)
    assert rt.end_pool_of_failed_capture(1, (0, 7)) is True
    assert calls == [("end", 1, (0, 7)), ("release", 1, (0, 7))] and not routing
    calls.clear()
    assert rt.end_pool_of_failed_capture(1, (0, 7)) is False  # (ended already: the exit's reference)
    assert rt.end_pool_of_failed_capture(0, (0, 8)) is False
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):  # another allocator error is not a refusal
        rt.end_pool_of_failed_capture(0, (0, 9))
    assert calls == [("end", 1, (0, 7)), ("end", 0, (0, 8)), ("end", 0, (0, 9))]
    # PyTorch before 2.8 names the call _cuda_endAllocateCurrentStreamToPool; without either, nothing is done
    calls.clear()
    routing.add((0, (0, 5)))
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", end, raising=False)
    assert rt.end_pool_of_failed_capture(0, (0, 5)) is True
    assert calls == [("end", 0, (0, 5)), ("release", 0, (0, 5))]
    monkeypatch.delattr(torch._C, "_cuda_endAllocateCurrentStreamToPool")
    assert rt.end_pool_of_failed_capture(0, (0, 5)) is False and len(calls) == 2


def test_collector_paused_for_capture_collects_first_and_restores_the_collector(monkeypatch):
    """A collection before the block, none inside it, the collector's state as it was after it
    (also when the block raises, a KeyboardInterrupt included, and when the caller had turned
    the collector off); a nested block neither collects nor restores."""
    import gc

    from fusedlib.runtime import collector_paused_for_capture

    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(gc.isenabled()) or collect(*a))
    assert gc.isenabled()
    with collector_paused_for_capture():
        assert calls == [True] and not gc.isenabled()
        with collector_paused_for_capture():  # nested: no collection inside the outer block
            assert not gc.isenabled()
        assert calls == [True] and not gc.isenabled()
    assert gc.isenabled()
    for exc in (KeyError("inside the capture"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with collector_paused_for_capture():
                raise exc
        assert gc.isenabled()
    assert len(calls) == 3
    gc.disable()
    try:
        with collector_paused_for_capture():
            assert not gc.isenabled()
        assert not gc.isenabled() and len(calls) == 4
    finally:
        gc.enable()
    with collector_paused_for_capture(collect=False):  # the collector off, no collection
        assert not gc.isenabled()
    assert gc.isenabled() and len(calls) == 4


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


def _fake_cuda_graphs(monkeypatch, events: list) -> None:
    """torch.cuda's streams and graphs as no-ops that record the collector's state at capture
    (CPU: the captures' host code runs, the work runs eagerly)."""
    import contextlib
    import gc

    import triton

    class FakeGraph:
        def replay(self) -> None:
            events.append("replay")

    @contextlib.contextmanager
    def graph(g, **kw):
        events.append(("capture", gc.isenabled()))
        yield

    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect") or collect(*a))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: fn() or 1.0)


def test_the_trainers_and_the_bench_timers_captures_run_with_the_collector_off(monkeypatch):
    """The full-iteration graph of the trainer collects and captures with the collector off;
    the bench's graph timer captures with it off without collecting; both leave it on."""
    import gc

    from fusedlib.bench.core import time_ms
    from fusedlib.train.loop import _FullIterationGraph

    events = []
    _fake_cuda_graphs(monkeypatch, events)
    step = _FullIterationGraph(lambda x, y: (x.float() - y.float()).sum(), warmup=0)
    window = torch.arange(8).reshape(2, 4)  # x and y as get_batch makes them: y is x shifted by one
    x, y = window[:, :-1], window[:, 1:]
    assert float(step(x, y)) == -6.0 and float(step(x, y)) == -6.0
    assert events == ["collect", ("capture", False), "replay", "replay"] and gc.isenabled()
    events.clear()
    assert time_ms(lambda: None, cuda_graph=True) == 1.0
    assert events == [("capture", False), "replay"] and gc.isenabled()


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "cross_entropy"])
def test_a_remembered_plan_never_stands_for_tensors_on_another_device(op):
    """An op's plan key holds each input's device: after a call on the kernel device, the same
    shapes, strides and dtypes with one input, or all, on another device (meta here; another GPU
    on a machine with several) are still checked, and refused naming the devices, instead of
    launching the remembered plan."""
    from fusedlib import bias_gelu_impl, fused_layer_norm, fused_vocab_parallel_cross_entropy

    device = runtime.default_device()
    gen = torch.Generator().manual_seed(2)
    if op == "layer_norm":
        args = (torch.randn(4, 8, generator=gen), torch.ones(8), torch.zeros(8))

        def fn(x, w, b):
            return fused_layer_norm(x, w, b, 1e-5)
    elif op == "bias_gelu":
        args, fn = (torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen)), bias_gelu_impl
    else:
        args, fn = (torch.randn(4, 8, generator=gen), torch.tensor([1, 2, 3, 4])), fused_vocab_parallel_cross_entropy
    args = tuple(a.to(device) for a in args)
    fn(*args)
    fn(*args)  # the plan is remembered
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        fn(args[0], args[1].to("meta"), *args[2:])
    with pytest.raises(ValueError, match="fusedlib kernels run on 'cuda' or 'cpu' tensors, got meta"):
        fn(*(a.to("meta") for a in args))


def test_launch_refuses_a_device_no_kernel_runs_on_by_name():
    """launch() itself (the kernel layer's net, under the ops' checks) refuses tensors on a
    device type that is neither CUDA nor CPU with the ValueError naming it, before Triton sees
    the kernel or its arguments."""
    from fusedlib.kernels.reduce import _sum_partials_kernel

    with pytest.raises(ValueError, match="fusedlib kernels run on 'cuda' or 'cpu' tensors, got device meta"):
        runtime.launch(_sum_partials_kernel, (1,), torch.device("meta"), torch.zeros(4, device="meta"))
