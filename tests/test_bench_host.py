"""The benchmark harness's host-cost mode, its compiled baselines, graph/plain records, and the
tuning entry point: everything that runs without a GPU (fake clocks and timers, Triton's
interpreter at tiny shapes, a recording torch.compile backend)."""
from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

from fusedlib.bench import core
from fusedlib.bench import host as host_mod
from fusedlib.bench import tune as tune_mod
from fusedlib.bench.__main__ import main, main_host, parse_args, summary
from fusedlib.bench.ops import OP_MODULES, baselines, get_case, get_cases
from fusedlib.book import host_table as book_host_table
from fusedlib.book import speedup_table

from conftest import DEVICE  # noqa: I001

HOST_SCHEMA = {"op", "measured_op", "pass", "impl", "shape", "dtype", "us", "enqueue_us", "cpu_us",
               "us_repeats", "calls", "repeats", "warmup", "device", "torch", "triton", "direct_launch"}


# ------------------------------------------------------------------------------------------
# torch.compile baselines: static per shape, one helper, the opt-in recorded
# ------------------------------------------------------------------------------------------

def _static(example_inputs) -> bool:
    return all(isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape) for t in example_inputs)


def test_compile_helper_compiles_each_shape_statically_past_the_default_limit():
    seen = []

    def backend(gm, example_inputs):
        seen.append(example_inputs)
        return gm.forward

    def make():  # a lambda built per case shares its code object, as in the op modules
        return lambda y, b: torch.nn.functional.gelu(y + b, approximate="tanh")

    torch._dynamo.reset()
    try:
        fns = []
        for h in range(4, 14):  # 10 shapes: more than Dynamo's default recompile limit of 8
            impl = baselines.compile_impl(make(), backend=backend)
            assert impl.name == "torch.compile" and impl.compile == "static"
            y, b = torch.randn(3, h), torch.randn(h)
            torch.testing.assert_close(impl.fn(y, b), torch.nn.functional.gelu(y + b, approximate="tanh"))
            fns.append(impl.fn)
        assert len(set(map(id, fns))) == 10, "a fresh compiled function per shape"
        assert len(seen) == 10 and all(_static(ex) for ex in seen), "one static compile per shape"
        # the explicit opt-in: one dynamic compile serves several shapes, with symbolic sizes
        seen.clear()
        dyn = baselines.compile_impl(make(), dynamic=True, backend=backend)
        assert dyn.compile == "dynamic"
        for h in (20, 24, 28):
            dyn.fn(torch.randn(3, h), torch.randn(h))
        assert len(seen) == 1 and not _static(seen[0])
    finally:
        torch._dynamo.reset()


def test_every_torch_compile_baseline_is_static_but_the_softmax_sweeps(monkeypatch):
    calls = []

    def fake_compile(fn, dynamic=None, backend="inductor", **kw):
        # fusedlib's calls only: where megatron-core imports (the GPU machine), its modules'
        # decorators call torch.compile as the baselines' cases import them
        if sys._getframe(1).f_globals.get("__name__", "").startswith("fusedlib."):
            calls.append(dynamic)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    dynamic_ops = set()
    for op in OP_MODULES:
        for i, case in enumerate(get_cases(op)(torch.device("cpu"), sweep=True)):
            assert case.cuda_graph, f"{op} {case.shape}: every case times CUDA graphs and plain launches"
            comp = [impl for impl in case.impls if impl.name == "torch.compile"]
            assert len(comp) == 1, f"{op} {case.shape}: one torch.compile baseline"
            assert comp[0].compile == "static" if i == 0 else comp[0].compile in ("static", "dynamic")
            if comp[0].compile == "dynamic":
                dynamic_ops.add(op)
    assert dynamic_ops == {"causal_softmax", "masked_softmax"}
    assert calls and set(calls) == {False, True} and calls.count(True) == 2, calls


def test_every_op_has_a_case_at_its_host_shape_with_the_three_host_impls():
    for op in OP_MODULES:
        case = get_case(op)(host_mod.HOST_SHAPES[op])
        assert case.op == op and case.shape == host_mod.HOST_SHAPES[op]
        assert set(host_mod.HOST_IMPLS) <= {i.name for i in case.impls}, op
    with pytest.raises(KeyError, match="known ops"):
        get_case("no_such_op")


# ------------------------------------------------------------------------------------------
# Graph and plain-launch records
# ------------------------------------------------------------------------------------------

def _copy():
    return core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)


def test_records_mark_the_compile_and_a_failed_capture(monkeypatch):
    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        if cuda_graph and impl.name == "fusedlib" and pas == "fwd+bwd":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return {"fusedlib": 0.4, "torch.compile": 0.6}[impl.name] / (2 if cuda_graph else 1), None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    case = core.BenchCase("cross_entropy", (4, 8), torch.float32, lambda d, rg: (), {"fwd": 10**9, "fwd+bwd": 3 * 10**9},
                          [core.Impl("fusedlib", None), core.Impl("torch.compile", None, compile="static")])
    recs = {(r["impl"], r["pass"]): r for r in core.measure_case(case, torch.device("cuda"))}
    fused, comp = recs[("fusedlib", "fwd+bwd")], recs[("torch.compile", "fwd+bwd")]
    assert (fused["ms"], fused["ms_eager"], fused["timer"]) == (0.4, 0.4, "do_bench")
    assert "stream is capturing" in fused["graph_error"]
    assert (comp["ms"], comp["ms_eager"], comp["timer"], comp["compile"]) == (0.3, 0.6, "cuda_graph", "static")
    assert "graph_error" not in comp and "compile" not in fused
    assert recs[("fusedlib", "fwd")]["timer"] == "cuda_graph"
    # the tables: a plain-launch ms is never divided by a graph ms; plain launches compare
    table = speedup_table([_copy()] + list(recs.values()))
    assert "plain-launch ms" in table and "0.4000*" in table and "1.50x" in table  # 0.6 / 0.4 plain
    text = summary([_copy()] + list(recs.values()))
    fwd_bwd_compile = next(line for line in text.splitlines() if "fwd+bwd" in line and "torch.compile" in line)
    assert fwd_bwd_compile.split()[-2:] == ["-", "1.50"], fwd_bwd_compile


def test_tables_label_plain_only_records_and_dynamic_compiles():
    rec = lambda impl, ms, **kw: {**core._record("bias_gelu", "fwd", impl, (8, 16), torch.bfloat16, ms, 10**6), **kw}
    recs = [_copy(), rec("fusedlib", 0.1), rec("torch.compile", 0.2, compile="dynamic")]
    table = speedup_table(recs)
    assert "(ms: plain launches)" in table and "plain-launch ms" not in table
    assert "torch.compile (dynamic)" in table and "2.00x" in table
    assert "torch.compile (dyn)" in summary(recs)


# ------------------------------------------------------------------------------------------
# Host timing: the arithmetic, the step, the records
# ------------------------------------------------------------------------------------------

class FakeClocks:
    """Wall and CPU clocks that advance only when the fake step or sync runs."""

    def __init__(self, step_wall, step_cpu, pre_sync, post_syncs):
        self.wall = self.cpu = 0.0
        self.step_wall, self.step_cpu = step_wall, step_cpu
        self.pre_sync, self.post_syncs = pre_sync, list(post_syncs)
        self.syncs = 0

    def step(self):
        self.wall += self.step_wall
        self.cpu += self.step_cpu

    def sync(self):
        # host_timing syncs before each repeat (untimed) and after it (timed)
        self.wall += self.pre_sync if self.syncs % 2 == 0 else self.post_syncs[self.syncs // 2]
        self.syncs += 1


def test_host_timing_arithmetic_with_fake_clocks():
    post = [30e-6, 0.0, 600e-6, 300e-6, 90e-6]  # the final sync's wait, per repeat
    clk = FakeClocks(step_wall=10e-6, step_cpu=8e-6, pre_sync=1.0, post_syncs=post)
    t = host_mod.host_timing(clk.step, calls=300, repeats=5, sync=clk.sync,
                             clock=lambda: clk.wall, cpu_clock=lambda: clk.cpu)
    # per repeat: (300 calls x 10 us + the final sync) / 300; the untimed 1 s sync before is not charged
    expect = [10 + p * 1e6 / 300 for p in post]  # 10.1, 10.0, 12.0, 11.0, 10.3
    assert t["us_repeats"] == pytest.approx(expect)
    assert t["us"] == pytest.approx(10.3)  # the median
    assert t["enqueue_us"] == pytest.approx(10.0) and t["cpu_us"] == pytest.approx(8.0)
    assert clk.syncs == 10
    with pytest.raises(ValueError, match="calls"):
        host_mod.host_timing(clk.step, calls=0)


def test_host_step_resets_gradients_and_forward_keeps_no_graph():
    x0 = torch.randn(3, 5, dtype=torch.float64)
    x = x0.clone().requires_grad_(True)
    case = core.BenchCase("bias_gelu", (3, 5), torch.float64, lambda d, rg: (x,) if rg else (x0.clone(),), {}, [])
    impl = core.Impl("eager", lambda t: (t * 3.0, None))  # a tuple: the first item is used
    step, ctx = host_mod.host_step(case, impl, "fwd+bwd", torch.device("cpu"))
    step()
    step()
    torch.testing.assert_close(x.grad, torch.full_like(x0, 3.0))  # not 6: no accumulation
    fwd, ctx = host_mod.host_step(case, impl, "fwd", torch.device("cpu"))
    with ctx:
        out, _ = fwd()
    assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(ValueError, match="pass_"):
        host_mod.host_step(case, impl, "bwd", torch.device("cpu"))


def test_measure_host_records_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(baselines, "compiled", lambda fn, dynamic=False, backend="inductor": fn)  # no Inductor on CI
    recs, skipped = host_mod.measure_host("bias_gelu", DEVICE, calls=2, repeats=2, warmup=1, shape=(4, 16),
                                          dtype=torch.float32)
    assert skipped == {}
    assert [(r["pass"], r["impl"]) for r in recs] == [(p, i) for p in ("fwd", "fwd+bwd") for i in host_mod.HOST_IMPLS]
    for r in recs:
        assert set(r) == HOST_SCHEMA | ({"compile"} if r["impl"] == "torch.compile" else set())
        assert (r["op"], r["measured_op"], r["shape"], r["dtype"], r["calls"], r["repeats"]) == \
            ("host", "bias_gelu", [4, 16], "float32", 2, 2)
        assert r["us"] > 0 and len(r["us_repeats"]) == 2 and r["device"] == core.environment()["device"]
    assert next(r for r in recs if r["impl"] == "torch.compile")["compile"] == "static"
    path = core.write_records(recs, tmp_path / "host.json")
    assert core.load_records(path) == json.loads(json.dumps(recs))
    with pytest.raises(KeyError, match="known ops"):
        host_mod.measure_host("no_such_op", "cpu")


def test_measure_host_refuses_arguments_that_would_time_nothing():
    # calls = 0 returned no records (every implementation "skipped"), repeats = 0 raised
    # statistics' StatisticsError, an unknown pass or implementation name timed nothing
    for kw, match in ((dict(calls=0), "calls and repeats"), (dict(repeats=0), "calls and repeats"),
                      (dict(warmup=-1), "warmup"), (dict(passes=("bwd",)), "passes must be"),
                      (dict(passes="fwd"), "passes must be"), (dict(impls=("no_such_impl",)), "impls must be"),
                      (dict(impls="eager"), "impls must be"), (dict(calls=1.5), "calls must be an int"),
                      (dict(repeats=True), "repeats must be an int")):
        args = dict(calls=1, repeats=1, warmup=0, impls=("eager",), shape=(2, 8), dtype=torch.float32) | kw
        with pytest.raises(ValueError, match=match):
            host_mod.measure_host("bias_gelu", "cpu", **args)


def test_measure_host_takes_names_and_passes_from_a_generator():
    # the checks used a generator up, and set(impls) was then empty: nothing timed, no error
    records, skipped = host_mod.measure_host("bias_gelu", "cpu", calls=1, repeats=1, warmup=0,
                                             impls=(n for n in ["eager"]), passes=(p for p in ["fwd"]),
                                             shape=(2, 8), dtype=torch.float32)
    assert skipped == {} and [(r["impl"], r["pass"]) for r in records] == [("eager", "fwd")]


def test_measure_host_keeps_going_when_an_impl_fails(monkeypatch):
    def broken(*_):
        raise RuntimeError("baseline broke")

    real = get_case("rms_norm")

    def case_with_broken_eager(shape, dtype=torch.bfloat16):
        case = real(shape, dtype)
        case.impls = [core.Impl("eager", broken) if i.name == "eager" else i for i in case.impls]
        return case

    monkeypatch.setattr(host_mod, "get_case", lambda op: case_with_broken_eager)
    recs, skipped = host_mod.measure_host("rms_norm", "cpu", calls=1, repeats=1, warmup=0, impls=("eager",),
                                          shape=(2, 8), dtype=torch.float32, passes=("fwd",))
    assert recs == [] and "baseline broke" in skipped["eager"]


def test_measure_host_warms_every_impl_then_takes_repeats_in_turns(monkeypatch):
    # every warm-up before the first timed repeat, then one repeat per implementation per round:
    # the implementations are timed in the same process state (after Inductor's compile)
    events = []
    real = get_case("bias_gelu")

    def traced_case(shape, dtype=torch.bfloat16):
        case = real(shape, dtype)
        case.impls = [core.Impl(i.name, (lambda name: lambda *a: events.append(name))(i.name), passes=i.passes)
                      for i in case.impls]
        return case

    def fake_timing(step, calls, repeats, sync):
        events.append("timed")
        step()
        return {"us": 1.0, "enqueue_us": 1.0, "cpu_us": 1.0, "us_repeats": [1.0]}

    monkeypatch.setattr(host_mod, "get_case", lambda op: traced_case)
    monkeypatch.setattr(host_mod, "host_timing", fake_timing)
    recs, skipped = host_mod.measure_host("bias_gelu", "cpu", calls=1, repeats=2, warmup=1, shape=(2, 8),
                                          dtype=torch.float32, passes=("fwd",))
    impls = list(host_mod.HOST_IMPLS)
    assert skipped == {} and [r["impl"] for r in recs] == impls
    assert events == impls + [e for _ in range(2) for i in impls for e in ("timed", i)]
    assert all(r["us_repeats"] == [1.0, 1.0] for r in recs)


def test_time_in_turns_drops_a_step_that_raises_in_a_repeat_and_keeps_the_others():
    calls = {"a": 0, "b": 0}

    def counting(name, fail_after=None):
        def step():
            calls[name] += 1
            if fail_after is not None and calls[name] > fail_after:
                raise RuntimeError(f"{name} broke")
        return step

    skipped = []
    timings = host_mod.time_in_turns({"a": (counting("a"), torch.no_grad()), "b": (counting("b", 3), torch.no_grad())},
                                     calls=2, repeats=3, warmup=1, sync=lambda: None,
                                     skip=lambda name, exc: skipped.append((name, str(exc))))
    # b: 1 warm-up call, then the first repeat's 2 calls pass and the second repeat's first raises
    assert skipped == [("b", "b broke")] and list(timings) == ["a"]
    assert calls == {"a": 1 + 3 * 2, "b": 4}
    assert set(timings["a"]) == {"us", "enqueue_us", "cpu_us", "us_repeats"} and len(timings["a"]["us_repeats"]) == 3

def test_host_record_keeps_each_timing_in_its_field_and_the_median_of_the_repeats(monkeypatch):
    # each repeat's times (us, then enqueue_us = us - 0.5, cpu_us = us - 1) given by a fake host_timing:
    # the record holds each field's median, the repeats' us, and the calls, repeats and warm-up asked
    us = iter([5.0, 1.0, 3.0])

    def fake_timing(step, calls, repeats, sync):
        u = next(us)
        return {"us": u, "enqueue_us": u - 0.5, "cpu_us": u - 1.0, "us_repeats": [u]}

    monkeypatch.setattr(host_mod, "host_timing", fake_timing)
    (rec,), skipped = host_mod.measure_host("bias_gelu", "cpu", calls=4, repeats=3, warmup=2, impls=("eager",),
                                            shape=(2, 8), dtype=torch.float32, passes=("fwd",))
    assert skipped == {} and (rec["us"], rec["enqueue_us"], rec["cpu_us"]) == (3.0, 2.5, 2.0)
    assert rec["us_repeats"] == [5.0, 1.0, 3.0]
    assert (rec["calls"], rec["repeats"], rec["warmup"]) == (4, 3, 2)


def test_time_in_turns_takes_every_warm_up_call_and_repeats_run_in_the_step_s_context():
    # warm-up: all `warmup` calls before the first repeat; the repeats, like the warm-up, inside the
    # step's context (torch.no_grad() for the forward pass)
    seen = []
    step = lambda: seen.append(torch.is_grad_enabled())  # noqa: E731
    timings = host_mod.time_in_turns({"a": (step, torch.no_grad())}, calls=2, repeats=3, warmup=5,
                                     sync=lambda: None, skip=lambda name, exc: pytest.fail(str(exc)))
    assert len(seen) == 5 + 3 * 2 and not any(seen)
    assert len(timings["a"]["us_repeats"]) == 3


def test_host_step_resets_the_impl_params_gradients():
    # a module's parameters get .grad = None before each call too (zero_grad(set_to_none=True))
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3, dtype=torch.float64)
    x0 = torch.randn(2, 5, dtype=torch.float64)
    case = core.BenchCase("bias_gelu", (2, 5), torch.float64, lambda d, rg: (x0.clone().requires_grad_(rg),), {}, [])
    impl = core.Impl("eager", lambda t: lin(t), params=lambda: lin.parameters())
    step, _ = host_mod.host_step(case, impl, "fwd+bwd", torch.device("cpu"))
    step()
    once = lin.weight.grad.clone()
    step()
    torch.testing.assert_close(lin.weight.grad, once)  # not twice: no accumulation


def _host_rec(op, pas, impl, us, device="NVIDIA H200"):
    return {"op": "host", "measured_op": op, "pass": pas, "impl": impl, "us": us, "enqueue_us": us - 1,
            "cpu_us": us - 2, "device": device, "torch": "2.11", "triton": "3.6"}


def test_host_table_and_merge():
    recs = [_host_rec("bias_gelu", p, i, u) for p, vals in (("fwd", (83, 17, 66)), ("fwd+bwd", (835, 302, 612)))
            for i, u in zip(host_mod.HOST_IMPLS, vals)][:-1]  # torch.compile fwd+bwd missing
    table = host_mod.host_table(recs)
    assert book_host_table is host_mod.host_table
    row = next(line for line in table.splitlines() if line.startswith("bias_gelu"))
    assert row.split()[1:] == ["83", "17", "66", "4.88x", "835", "302", "-", "2.76x"]
    assert "NVIDIA H200" in table
    row = next(line for line in host_mod.host_table(recs, "cpu_us").splitlines() if line.startswith("bias_gelu"))
    assert row.split()[1:4] == ["81", "15", "64"]
    with pytest.raises(ValueError, match="field"):
        host_mod.host_table(recs, "ms")
    # an op name longer than the default column keeps every row's numbers in the same columns
    long = recs + [_host_rec("bias_dropout_add_norm", p, i, 100) for p in ("fwd", "fwd+bwd") for i in host_mod.HOST_IMPLS]
    lines = host_mod.host_table(long).splitlines()
    rows = [line for line in lines if line.startswith(("bias_gelu", "bias_dropout_add_norm"))]
    assert len(rows) == 2 and len({line.index(line.split()[1]) + len(line.split()[1]) for line in rows}) == 1
    assert lines[2].startswith("op ") and lines[2].index("fusedlib") + len("fusedlib") == rows[0].index("83") + 2
    old = [_host_rec("bias_gelu", "fwd", "fusedlib", 999), _host_rec("layer_norm", "fwd", "fusedlib", 69)]
    merged = host_mod.merge_host_records(recs, old)
    assert merged[:len(recs)] == recs and merged[len(recs):] == [old[1]]


# ------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------

def test_cli_parsing():
    a = parse_args(["--host", "--op", "bias_gelu", "layer_norm", "--out", "x/y", "--calls", "7"])
    assert (a.host, a.op, a.out, a.calls, a.repeats, a.sweep) == (True, ["bias_gelu", "layer_norm"], "x/y", 7, None, False)
    a = parse_args([])
    assert (a.host, a.op, a.out) == (False, None, "chapters/data/bench")
    # --op given twice adds up (the second replaced the first: only rope was timed)
    assert parse_args(["--op", "attention", "--op", "rope", "attention"]).op == ["attention", "rope"]
    for bad in (["--host", "--sweep"], ["--calls", "5"], ["--host", "--repeats", "0"], ["--op", "no_such_op"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_cli_help_gives_every_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: all)" in text and "(default chapters/data/bench)" in text
    assert f"(default {host_mod.CALLS})" in text and f"(default {host_mod.REPEATS})" in text
    assert "``" not in text  # (the docstring's markup stays in the docstring)
    # every op named once in --op's help, none in the usage line (it listed all 17 twice)
    usage = text[:text.index("options:")]
    assert "--op OP [OP ...]" in usage and "bias_gelu" not in usage
    assert "(default: all): " + ", ".join(sorted(OP_MODULES)) in text


def test_cli_out_that_is_a_file_is_refused_before_any_timing(tmp_path, capsys, monkeypatch):
    # it was found at the first write, after the copy and matmul ceilings were measured on the GPU
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bench_main = sys.modules["fusedlib.bench.__main__"]
    monkeypatch.setattr(bench_main, "copy_record", lambda **kw: pytest.fail("timed before --out was checked"))
    monkeypatch.setattr(host_mod, "measure_host", lambda *a, **kw: pytest.fail("timed before --out was checked"))
    for out in ("f", "f/bench"):
        for host in ([], ["--host"]):
            with pytest.raises(SystemExit):
                main(["--out", str(tmp_path / out), "--op", "bias_gelu"] + host)
            err = capsys.readouterr().err
            assert "--out must be a folder" in err and "is a file" in err


def test_cli_empty_out_is_refused(capsys):
    # the records went to f"{out}/{op}.json": /bias_gelu.json, at the file system's root
    with pytest.raises(SystemExit):
        parse_args(["--out", "", "--op", "bias_gelu"])
    assert "--out must be a folder's path, got ''" in capsys.readouterr().err


def test_cli_an_op_named_twice_is_timed_once():
    # it was timed twice: --host wrote two sets of its records into host.json
    assert parse_args(["--op", "swiglu", "bias_gelu", "swiglu", "--host"]).op == ["swiglu", "bias_gelu"]


def test_cli_host_refuses_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--host"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "host" in err


def test_cli_host_writes_and_merges_host_json(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_measure_host(op, device, calls=0, repeats=0, progress=None, **kw):
        seen.append((op, device, calls, repeats))
        if progress:
            progress(op)
        return [_host_rec(op, p, i, 10.0) for p in ("fwd", "fwd+bwd") for i in host_mod.HOST_IMPLS], {}

    def fake_measure_floor(device, calls=0, repeats=0, **kw):
        seen.append(("floor", device, calls, repeats))
        return [_floor_rec(pas, part, 20.0) for pas, parts in host_mod.FLOOR_PARTS.items() for part in parts], \
            {"fwd: launch (C launcher)": "not here"}

    monkeypatch.setattr(host_mod, "measure_host", fake_measure_host)
    monkeypatch.setattr(host_mod, "measure_floor", fake_measure_floor)
    core.write_records([_host_rec("layer_norm", "fwd", "fusedlib", 69), _host_rec("swiglu", "fwd", "eager", 5),
                        _floor_rec("fwd", "eager", 99.0)], tmp_path / "host.json")
    assert main_host(["swiglu"], str(tmp_path), 3, 2) == 0
    assert seen == [("swiglu", "cuda", 3, 2), ("floor", "cuda", 3, 2)]  # the floor in every run, after the ops
    written = core.load_records(tmp_path / "host.json")
    n_floor = sum(len(parts) for parts in host_mod.FLOOR_PARTS.values())
    assert [(r["measured_op"], r["us"]) for r in written] == \
        [("swiglu", 10.0)] * 6 + [("host_floor", 20.0)] * n_floor + [("layer_norm", 69)]  # the old floor replaced
    out = capsys.readouterr().out
    assert "kept 1 records" in out and "swiglu" in out and "skeleton" in out
    assert "host floor: fwd: launch (C launcher) not timed: not here" in out


@pytest.mark.parametrize("content", ["", "[{\"op\": ", "{\"op\": \"host\"}", "[1, 2]", None])
def test_cli_host_a_host_json_it_cannot_merge_into_is_one_error_before_any_timing(content, tmp_path, monkeypatch,
                                                                                   capsys):
    # a truncated file raised JSONDecodeError, a directory IsADirectoryError, a JSON object or a list
    # of non-records an AttributeError after every op had been timed
    monkeypatch.setattr(host_mod, "measure_host", lambda *a, **kw: pytest.fail("timed before host.json was read"))
    if content is None:
        (tmp_path / "host.json").mkdir()
    else:
        (tmp_path / "host.json").write_text(content)
    assert main_host(["swiglu"], str(tmp_path), 3, 2) == 2
    err = capsys.readouterr().err
    assert "host.json" in err and err.count("\n") == 1


def test_cli_host_times_an_op_s_extra_implementations(tmp_path, monkeypatch):
    # fused_dense's host shape takes its kernel path; the epilogue path (cuBLASLt through ctypes,
    # what training sizes take) is timed beside it
    asked = {}

    def fake_measure_host(op, device, calls=0, repeats=0, progress=None, impls=(), **kw):
        asked[op] = tuple(impls)
        return [_host_rec(op, p, i, 10.0) for p in ("fwd", "fwd+bwd") for i in impls], {}

    monkeypatch.setattr(host_mod, "measure_host", fake_measure_host)
    monkeypatch.setattr(host_mod, "measure_floor", lambda *a, **k: ([], {}))
    assert main_host(["fused_dense", "swiglu"], str(tmp_path), 3, 2) == 0
    assert asked == {"fused_dense": host_mod.HOST_IMPLS + ("fusedlib-epilogue",), "swiglu": host_mod.HOST_IMPLS}
    written = core.load_records(tmp_path / "host.json")
    assert sum(r["impl"] == "fusedlib-epilogue" for r in written) == 2
    for op, extra in host_mod.HOST_EXTRA_IMPLS.items():
        case = get_case(op)(host_mod.HOST_SHAPES[op], torch.bfloat16)
        assert set(extra) <= {i.name for i in case.impls}, op


def _floor_rec(pas, part, us):
    return {"op": "host_floor", "measured_op": "host_floor", "part": part, "pass": pas, "shape": [32, 256],
            "dtype": "bfloat16", "us": us, "enqueue_us": us, "cpu_us": us, "device": "NVIDIA H200", "torch": "2.11",
            "triton": "3.6"}


# ------------------------------------------------------------------------------------------
# The floor: LayerNorm's host work without LayerNorm
# ------------------------------------------------------------------------------------------

def test_skeleton_layer_norm_does_the_host_work_and_launches_once_per_pass(monkeypatch):
    launched = []
    monkeypatch.setattr(host_mod, "launch", lambda kernel, grid, device, *args, **kw: launched.append(args))
    x = torch.randn(5, 12, device=DEVICE, requires_grad=True)
    w = torch.randn(12, device=DEVICE, requires_grad=True)
    b = torch.randn(12, device=DEVICE, requires_grad=True)
    y = host_mod.SkeletonLayerNorm.apply(x, w, b, True)
    assert y.shape == x.shape and y.dtype == x.dtype and y.grad_fn is not None and len(launched) == 1
    assert launched[0][0] is x and launched[0][1] == 12
    saved = y.grad_fn.saved_tensors
    assert saved[0] is x and saved[3].shape == (2, 5) and saved[3].dtype == torch.float32, "y and the row stats"
    y.float().sum().backward()
    assert len(launched) == 2, "one launch in the backward"
    assert x.grad is not None and w.grad is not None and b.grad is not None
    host_mod.SkeletonLayerNorm.apply(x, w, b, False).sum().backward()
    assert len(launched) == 2, "no launch without launches"
    # [..., h]: one row of statistics per row of x
    y3 = host_mod.SkeletonLayerNorm.apply(torch.randn(2, 3, 12, device=DEVICE, requires_grad=True), w, b, False)
    assert y3.grad_fn.saved_tensors[3].shape == (2, 6)
    # the forward pass's steps: no autograd node (fusedlib's apply takes the forward directly)
    # and, as fusedlib's norms there, no statistics: y is the one allocation
    allocated = []
    real_empty, real_empty_like = torch.empty, torch.empty_like
    with torch.no_grad():
        steps = host_mod._floor_steps("fwd", torch.device(DEVICE), torch.float32)
        monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append("empty") or real_empty(*a, **k))
        monkeypatch.setattr(torch, "empty_like", lambda *a, **k: allocated.append("like") or real_empty_like(*a, **k))
        out = steps["skeleton"]()
        monkeypatch.undo()
        assert out.grad_fn is None and len(launched) == 3 and allocated == ["like"]
        assert steps["launch (C launcher)"] is None or DEVICE.type == "cuda", "the C launcher alone: CUDA only"


def test_measure_floor_records_every_part_of_each_pass():
    recs, skipped = host_mod.measure_floor(DEVICE, calls=1, repeats=2, warmup=1, dtype=torch.float32)
    have = [(r["pass"], r["part"]) for r in recs]
    want = [(p, part) for p in ("fwd", "fwd+bwd") for part in host_mod.FLOOR_PARTS[p]]
    if DEVICE.type == "cpu":  # Triton's interpreter: no compiled kernel, no C launcher
        assert skipped == {"fwd: launch (C launcher)": "no such launch on cpu here"}
        want.remove(("fwd", "launch (C launcher)"))
    assert have == want
    for r in recs:
        assert (r["op"], r["measured_op"], r["shape"], r["dtype"], r["calls"], r["repeats"]) == \
            ("host_floor", "host_floor", list(host_mod.FLOOR_SHAPE), "float32", 1, 2)
        assert r["us"] > 0 and len(r["us_repeats"]) == 2 and r["device"] == core.environment()["device"]
    recs, _ = host_mod.measure_floor(DEVICE, calls=1, repeats=1, warmup=0, passes=("fwd+bwd",))
    assert {r["pass"] for r in recs} == {"fwd+bwd"}


def test_measure_floor_refuses_bad_arguments_and_skips_a_failing_part(monkeypatch):
    for kw in (dict(calls=0), dict(repeats=0), dict(warmup=-1), dict(passes=("bogus",)), dict(passes="fwd")):
        with pytest.raises(ValueError, match="calls and repeats|passes must be"):
            host_mod.measure_floor("cpu", **kw)
    real = host_mod._floor_steps

    def broken_eager(pas, device, dtype):
        steps = real(pas, device, dtype)
        steps["eager"] = lambda: (_ for _ in ()).throw(RuntimeError("eager broke"))
        return steps

    monkeypatch.setattr(host_mod, "_floor_steps", broken_eager)
    recs, skipped = host_mod.measure_floor(DEVICE, calls=1, repeats=1, warmup=1, dtype=torch.float32,
                                           passes=("fwd",))
    assert "eager broke" in skipped["fwd: eager"] and "eager" not in {r["part"] for r in recs}
    assert {r["part"] for r in recs} >= {"fusedlib", "skeleton"}, "the other parts still ran"


def test_floor_table_rows_and_ratios_to_eager():
    recs = [_floor_rec("fwd", "eager", 12.0), _floor_rec("fwd", "fusedlib", 42.0), _floor_rec("fwd", "skeleton", 15.0),
            _floor_rec("fwd+bwd", "eager", 200.0), _floor_rec("fwd+bwd", "skeleton", 150.0),
            _floor_rec("fwd", "no such part", 1.0), _host_rec("layer_norm", "fwd", "fusedlib", 69)]
    recs[2]["us_repeats"] = [17.0, 15.0, 14.5]
    lines = host_mod.floor_table(recs).splitlines()
    assert "NVIDIA H200" in lines[0] and "[32, 256]" in lines[0]
    assert lines[1].split() == ["pass", "part", "median", "least", "most", "/", "eager"]
    body = [line.split() for line in lines[2:]]
    assert body[0] == ["fwd", "eager", "12.0", "12.0", "12.0", "1.00x"]
    assert body[1] == ["fwd", "fusedlib", "42.0", "42.0", "42.0", "3.50x"]
    assert body[2] == ["fwd", "skeleton", "15.0", "14.5", "17.0", "1.25x"], "the repeats' spread"
    assert body[4] == ["fwd+bwd", "skeleton", "150.0", "150.0", "150.0", "0.75x"]
    assert len(body) == 5, "only the floor's known parts, in FLOOR_PARTS order"
    cpu = host_mod.floor_table(recs, "cpu_us").splitlines()
    assert "least" not in cpu[1] and cpu[2].split() == ["fwd", "eager", "12.0", "1.00x"]
    no_eager = host_mod.floor_table([_floor_rec("fwd", "skeleton", 15.0)]).splitlines()
    assert no_eager[2].split()[-1] == "-"
    with pytest.raises(ValueError, match="no host_floor record"):
        host_mod.floor_table([_host_rec("layer_norm", "fwd", "fusedlib", 69)])
    with pytest.raises(ValueError, match="field"):
        host_mod.floor_table(recs, "ms")


def test_bound_launch_is_none_without_direct_launches(monkeypatch):
    from fusedlib.kernels import launch as launch_mod

    monkeypatch.setattr(launch_mod, "DIRECT_LAUNCH", False)
    x = torch.zeros(4, 16, device=DEVICE)
    assert launch_mod.bound_launch(host_mod._noop_kernel, (1,), 0, (x, 16), {"BLOCK": 16}) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a compiled kernel's C launcher needs a CUDA device")
def test_bound_launch_launches_the_cached_kernel():
    from fusedlib.kernels import launch as launch_mod

    x = torch.zeros(4, 16, device=DEVICE)
    fn = launch_mod.bound_launch(host_mod._noop_kernel, (1,), torch.cuda.current_device(), (x, 16), {"BLOCK": 16})
    assert fn is not None
    before = launch_mod.launch_stats().hits
    fn()
    torch.cuda.synchronize()
    assert launch_mod.launch_stats().hits == before, "no key, no lookup: the C launcher alone"


# ------------------------------------------------------------------------------------------
# Tuning: python -m fusedlib.bench.tune
# ------------------------------------------------------------------------------------------

def test_tune_cli_parsing():
    a = tune_mod.parse_args(["--op", "layer_norm", "--shape", "8192,16384", "--shape", "16,8", "--pass", "bwd"])
    assert (a.op, a.shape, a.passes, a.repeat, a.rep, a.limit, a.list) == \
        ("layer_norm", [(8192, 16384), (16, 8)], ["bwd"], 2, 100, None, False)
    assert a.dtype == "bfloat16" and tune_mod.parse_args(["--op", "swiglu", "--dtype", "float16"]).dtype == "float16"
    for bad in ([], ["--op", "no_such_op"], ["--op", "bias_gelu", "--shape", "8192x16384"],
                ["--op", "bias_gelu", "--shape", "0,4"], ["--op", "bias_gelu", "--limit", "0"]):
        with pytest.raises(SystemExit):
            tune_mod.parse_args(bad)


def test_tune_check_shape_takes_numpy_ints():
    import numpy as np

    got = tune_mod.check_shape("bias_gelu", (np.int64(8), np.int32(64)))
    assert got == (8, 64) and all(type(n) is int for n in got)


@pytest.mark.parametrize("shape", [(0, 64), (8, 0), (True, 64), (8, 64.0)], ids=["0-rows", "0-width", "bool", "float"])
def test_tune_check_shape_refuses_sizes_that_are_not_ints_of_at_least_one(shape):
    # tune() takes its shapes through check_shape alone (the command line's --shape parser is
    # not on that way): a size of 0 or a bool (an Integral, equal to 1) must not reach the timings
    with pytest.raises(ValueError, match=r"a bias_gelu shape is \[rows, h\]: 2 ints >= 1"):
        tune_mod.check_shape("bias_gelu", shape)


@pytest.mark.parametrize("argv, match", [
    (["--op", "bias_gelu", "--shape", "4"], r"a bias_gelu shape is \[rows, h\]: 2 ints"),
    (["--op", "masked_softmax", "--shape", "4,8"], r"\[b, np, sq, sk\]: 4 ints"),
    (["--op", "attention", "--shape", "1,2,64"], r"an attention shape is \[b, heads, s, head dim\]: 4 ints"),
    (["--op", "cross_entropy", "--shape", "1,2,3"], r"\[rows, V\]"),
    (["--op", "swiglu", "--shape", "4,7"], "must be even"),
    (["--op", "layer_norm", "--shape", "8,1000000"], "past the tile table's last bound"),
    (["--op", "attention", "--shape", "1,2,64,1000"], "head dim 1000 is past the attention tile table"),
])
def test_tune_refuses_a_shape_the_op_cannot_be_tuned_at(argv, match, capsys, monkeypatch):
    # --list printed candidates for a [4] bias_gelu; on a GPU the shape failed in _setup after the
    # copy ceiling, with a traceback (an unpacking error, a StopIteration for attention)
    with pytest.raises(SystemExit):
        tune_mod.parse_args(argv + ["--list"])
    assert re.search(match, capsys.readouterr().err)
    with pytest.raises(ValueError, match=match):
        tune_mod.tune(argv[1], [tuple(int(n) for n in argv[3].split(","))], device="cpu", timer=lambda *a, **k: 1.0,
                      emit=lambda line: None)


def test_tune_help_documents_every_flag_and_its_default(capsys):
    with pytest.raises(SystemExit):
        tune_mod.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--op", "--shape", "--pass", "--dtype", "--repeat", "--rep", "--limit", "--list", "--out"):
        line = text[text.index(f"  {flag} "):].split("\n  -")[0]
        assert len(" ".join(line.split()).split(" ")) > 3, f"{flag} has no help: {line!r}"
    text = " ".join(text.split())
    for default in ("default: the op's)", "(default: fwd bwd)", "(default bfloat16)", "(default 2)", "(default 100)"):
        assert default in text


def test_tune_out_that_cannot_be_written_is_refused_before_any_timing(tmp_path, capsys):
    # a folder or a file on the way failed at the write, after every candidate had been timed
    (tmp_path / "f").write_text("x")
    for out, match in ((tmp_path, "a folder"), (tmp_path / "f" / "t.json", "on its way is a file")):
        with pytest.raises(SystemExit):
            tune_mod.parse_args(["--op", "bias_gelu", "--out", str(out)])
        err = capsys.readouterr().err
        assert "--out must be a JSON file's path" in err and match in err
    assert tune_mod.parse_args(["--op", "bias_gelu", "--out", str(tmp_path / "new" / "t.json")]).out


@pytest.mark.parametrize("flags", [["--repeat", "3"], ["--rep", "50"], ["--limit", "2"], ["--out", "t.json"]])
def test_tune_list_refuses_the_timing_flags(flags, capsys):
    # --list ignored them: --out wrote no file, --limit did not shorten the list
    with pytest.raises(SystemExit):
        tune_mod.parse_args(["--op", "bias_gelu", "--list"] + flags)
    assert f"{flags[0]}: --list prints the candidates and times nothing" in capsys.readouterr().err
    a = tune_mod.parse_args(["--op", "bias_gelu"] + flags)
    assert (a.repeat, a.rep) == (3 if flags[0] == "--repeat" else 2, 50 if flags[0] == "--rep" else 100)


def test_tune_a_shape_or_pass_named_twice_is_timed_once():
    a = tune_mod.parse_args(["--op", "bias_gelu", "--shape", "16,8", "--shape", "4,4", "--shape", "16,8",
                             "--pass", "bwd", "fwd", "bwd"])
    assert (a.shape, a.passes) == ([(16, 8), (4, 4)], ["bwd", "fwd"])


def test_tune_candidates_cover_the_current_tables():
    for op, spec in tune_mod.TUNE_OPS.items():
        for shape in spec.shapes:
            for pass_ in ("fwd", "bwd"):
                cands = tune_mod.candidates(op, pass_, shape)
                assert cands and all(c == json.loads(json.dumps(c)) for c in cands), (op, pass_)
                assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands), "no duplicates"
                assert tune_mod.current_tile(op, pass_, shape) in cands, (op, pass_, shape)
    # the launchers cap BLOCK_N at the row's next power of two; so do the candidates
    assert {c["BLOCK_N"] for c in tune_mod.candidates("bias_gelu", "fwd", (4, 100))} == {128}
    with pytest.raises(KeyError, match="known"):
        tune_mod.candidates("no_such_op", "fwd", (4, 4))
    with pytest.raises(ValueError, match="pass_"):
        tune_mod.candidates("bias_gelu", "fwd+bwd", (4, 4))


def test_tune_list_runs_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune_mod.main(["--op", "cross_entropy", "--list"]) == 0
    out = capsys.readouterr().out
    assert "cross_entropy fwd [8192, 128256]: 6 candidates" in out and "<- current" in out
    assert "cross_entropy.py FWD_TILES" in out
    assert tune_mod.main(["--op", "cross_entropy"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    from fusedlib.bench.ops import cross_entropy

    assert cross_entropy.main(["--tune"]) == 2  # the old entry point runs the same


def test_candidates_are_tiles_and_the_current_tile_is_the_tables_pick():
    from fusedlib.kernels import bias_dropout_add as kd
    from fusedlib.kernels import layer_norm as kln
    from fusedlib.kernels.launch import Tile, pick

    for op, spec in tune_mod.TUNE_OPS.items():
        for pass_ in ("fwd", "bwd"):
            for cand in tune_mod.candidates(op, pass_, spec.shapes[0]):
                assert Tile(**cand) is not None  # every candidate is a Tile's fields
    assert tune_mod.current_tile("bias_dropout_add", "bwd", (64, 4096)) == dataclasses.asdict(pick(kd.BWD_TILES, 4096))
    # RMSNorm's backward has its own row at 16 Ki (a whole row in one program), LayerNorm's splits
    rms, ln = (tune_mod.current_tile(op, "bwd", (8, 16384)) for op in ("rms_norm", "layer_norm"))
    assert rms["BLOCK_N"] == 16384 and ln["BLOCK_N"] == 1024 < 16384
    assert ln == dataclasses.asdict(pick(kln.BWD_TILES, 16384))


def test_tune_candidates_follow_the_tables_rules_at_short_rows():
    from fusedlib.kernels import cross_entropy as kce
    from fusedlib.kernels import glu as kglu
    from fusedlib.kernels.launch import pick

    # GLUs: the shape is [rows, 2h] and the kernels' tiles are picked by the output width h,
    # BLOCK_N capped at h's next power of two; tiles of 2 Ki to 8 Ki outputs, both ends included
    # (the range glu.TILES' comment gives)
    for op in ("geglu", "swiglu"):
        for pass_ in ("fwd", "bwd"):
            assert tune_mod.current_tile(op, pass_, (4, 128)) == dataclasses.asdict(pick(kglu.TILES, 64))
            assert {c["BLOCK_N"] for c in tune_mod.candidates(op, pass_, (4, 128))} == {64}
        sizes = {c["BLOCK_M"] * c["BLOCK_N"] for c in tune_mod.candidates(op, "fwd", (8192, 32768))}
        assert min(sizes) == 2048 and max(sizes) == 8192
    # cross entropy: the current tiles are the tables' picks by V, and a forward candidate packs
    # TILE_ELEMENTS // BLOCK_N rows to a program where one step holds the whole row (BLOCK_N >= V)
    for v in (64, 2048, 128256):
        for pass_, table in (("fwd", kce.FWD_TILES), ("bwd", kce.BWD_TILES)):
            assert tune_mod.current_tile("cross_entropy", pass_, (8, v)) == dataclasses.asdict(pick(table, v))
    for v in (2048, 4096):
        for c in tune_mod.candidates("cross_entropy", "fwd", (8, v)):
            packed = c["BLOCK_N"] >= v
            assert c["BLOCK_M"] == (max(1, kce.TILE_ELEMENTS // c["BLOCK_N"]) if packed else 1), (v, c)
    assert any(c["BLOCK_M"] == 2 for c in tune_mod.candidates("cross_entropy", "fwd", (8, 2048)))
    assert all(c["BLOCK_M"] == 1 for c in tune_mod.candidates("cross_entropy", "fwd", (8, 128256)))


def test_tune_bytes_are_each_kernels_share_of_the_benchmarks_floor():
    # a GLU y [n, 2h] -> out [n, h]: the forward reads y and writes out, the backward reads g and
    # y and writes dy; the elements are the dtype's bytes (2 for bfloat16, 4 for float32)
    n, h = 10, 7
    for dtype, e in ((torch.bfloat16, 2), (torch.float32, 4)):
        for op in ("geglu", "swiglu"):
            assert tune_mod.kernel_bytes(op, "fwd", (n, 2 * h), dtype) == (2 * n * h + n * h) * e
            assert tune_mod.kernel_bytes(op, "bwd", (n, 2 * h), dtype) == (n * h + 2 * n * h + 2 * n * h) * e


def test_tune_list_marks_the_current_tile_once_or_says_it_is_not_a_candidate():
    assert tune_mod.tile_label({"BLOCK_N": 2048, "BLOCK_M": 2, "num_warps": 8}) == "BLOCK_N=2048 BLOCK_M=2 num_warps=8"
    cur = tune_mod.current_tile("swiglu", "fwd", (8192, 32768))
    lines = tune_mod.list_candidates("swiglu", [(8192, 32768)], ["fwd"]).splitlines()
    assert lines[0].endswith(f"current: {tune_mod.tile_label(cur)}")  # among the candidates: no remark
    assert [ln for ln in lines if "<- current" in ln] == [f"  {tune_mod.tile_label(cur)}  <- current"]
    # at V = 64 the tables' tile (the whole row, 64 rows per program) is none of the candidates
    lines = tune_mod.list_candidates("cross_entropy", [(4, 64)], ["fwd"]).splitlines()
    assert lines[0].endswith(" (not among them)") and not any("<- current" in ln for ln in lines)


def test_tune_records_the_fastest_repeat_and_marks_the_current_tile():
    # a timer that does not run the kernels: each candidate's repeats come from a fixed list, so
    # the record's "ms" must be the least of them and the summary line must rank by it
    shape = (4, 4096)  # h = 2048: the current swiglu tile is among the candidates
    times = iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0, 0.5, 0.75, 9.0])
    lines = []
    recs = tune_mod.tune("swiglu", [shape], passes=("fwd",), dtype=torch.float32, device=DEVICE, repeat=3, limit=3,
                         timer=lambda fn, warmup=0, rep=0: next(times), emit=lines.append)
    assert [r["ms_repeats"] for r in recs] == [[3.0, 1.0, 2.0], [5.0, 4.0, 6.0], [0.5, 0.75, 9.0]]
    assert [r["ms"] for r in recs] == [1.0, 4.0, 0.5]
    best = next(ln for ln in lines if "best:" in ln)
    assert [float(t.split(" ms")[0]) for t in best.split("best: ")[1].split("; ")] == [0.5, 1.0, 4.0]
    cur = tune_mod.current_tile("swiglu", "fwd", shape)
    recs = tune_mod.tune("swiglu", [shape], passes=("fwd",), dtype=torch.float32, device=DEVICE, repeat=1,
                         timer=lambda fn, warmup=0, rep=0: 1.0, emit=lambda line: None)
    assert [r["tile"] for r in recs if r["current"]] == [cur]
    assert len(recs) == len(tune_mod.candidates("swiglu", "fwd", shape)) > 1


TINY = {"bias_gelu": (4, 64), "bias_dropout_add": (4, 64), "geglu": (4, 128), "swiglu": (4, 128),
        "layer_norm": (4, 64), "rms_norm": (4, 64), "causal_softmax": (2, 16, 16),
        "masked_softmax": (1, 2, 16, 16), "cross_entropy": (4, 64), "attention": (1, 2, 16, 16)}


@pytest.mark.parametrize("op", sorted(tune_mod.TUNE_OPS))
def test_tune_launches_each_kernel_with_the_candidate_tile(op, spy_launches):
    assert set(TINY) == set(tune_mod.TUNE_OPS)
    shape = TINY[op]
    seen = []

    def fake_timer(fn, warmup=0, rep=0):
        launches.clear()
        out = fn()  # the real launcher, in Triton's interpreter, with the candidate tile passed
        assert out is not None
        seen.append([c.kwargs for c in launches])
        return 1e-5  # ms: GB/s of a tiny shape still shows in the record's one decimal

    launches = spy_launches

    lines = []
    recs = tune_mod.tune(op, [shape], dtype=torch.float32, device=DEVICE, repeat=2, limit=1,
                         copy_gbps=1000.0, timer=fake_timer, emit=lines.append)
    assert [r["pass"] for r in recs] == ["fwd", "bwd"]
    for r, pass_ in zip(recs, ("fwd", "bwd")):
        assert r["tile"] == tune_mod.candidates(op, pass_, shape)[0] and r["ms_repeats"] == [1e-5, 1e-5]
        assert r["bytes"] == tune_mod.kernel_bytes(op, pass_, shape, torch.float32) > 0
        assert r["GBps"] == pytest.approx(r["bytes"] / 1e-8 / 1e9, rel=1e-3)
    # every timed call launched a kernel with the candidate's tile (its block, warps, rows)
    for calls, tile in zip((seen[:2], seen[2:]), (recs[0]["tile"], recs[1]["tile"])):
        for kwargs_list in calls:
            assert any(kw.get("BLOCK_N") == tile["BLOCK_N"] and kw.get("num_warps") == tile["num_warps"]
                       and kw.get("BLOCK_M", tile["BLOCK_M"]) == tile["BLOCK_M"] for kw in kwargs_list), \
                (op, tile, kwargs_list)
    assert any("best:" in line for line in lines) and "winners go into" in lines[-1]


def _host_records():
    rows = []
    for op, base in (("bias_gelu", 20.0), ("layer_norm", 30.0)):
        for k, impl in enumerate(("fusedlib", "eager", "torch.compile")):
            for p in ("fwd", "fwd+bwd"):
                us = base * (k + 1) * (3 if p == "fwd+bwd" else 1)
                rows.append({"op": "host", "measured_op": op, "pass": p, "impl": impl, "us": us,
                             "enqueue_us": us / 2, "cpu_us": us / 2, "device": "test", "torch": "t", "triton": "t",
                             "shape": [32, 256], "dtype": "bfloat16"})
    return rows


def test_plot_host_draws_every_op_and_impl_from_zero():
    import matplotlib

    matplotlib.use("Agg")
    from fusedlib.book import plot_host

    ax = plot_host(_host_records(), "fwd+bwd")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bias_gelu", "layer_norm"]
    assert ax.get_xlim()[0] == 0
    widths = sorted(p.get_width() for p in ax.patches)
    # 2 ops x 3 impls, fwd+bwd: base * (k + 1) * 3
    assert widths == sorted(b * (k + 1) * 3 for b in (20.0, 30.0) for k in range(3))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(labels) == {"fusedlib", "eager", "torch.compile"}


def test_plot_host_scales_its_x_axis_to_the_field_it_draws():
    # the longest bar of the field drawn fits on the axis and fills most of it, also where that
    # field exceeds the wall time (CPU time of several threads) or stays far below it (enqueue)
    import matplotlib

    matplotlib.use("Agg")
    from fusedlib.book import plot_host

    recs = [dict(r, cpu_us=r["us"] * 2) for r in _host_records()]
    for field in ("cpu_us", "enqueue_us", "us"):
        ax = plot_host(recs, "fwd+bwd", field=field)
        longest = max(r[field] for r in recs if r["pass"] == "fwd+bwd")
        assert max(p.get_width() for p in ax.patches) == longest
        assert longest < ax.get_xlim()[1] <= 1.1 * longest, field


@pytest.mark.parametrize("kwargs, match", [({"pass_": "bwd"}, "pass_"), ({"field": "ms"}, "field")])
def test_plot_host_rejects_bad_arguments(kwargs, match):
    from fusedlib.book import plot_host

    with pytest.raises(ValueError, match=match):
        plot_host(_host_records(), **kwargs)


def test_plot_host_leaves_out_the_excluded_ops():
    import matplotlib

    matplotlib.use("Agg")
    from fusedlib.book import plot_host

    recs = _host_records()
    ax = plot_host(recs, "fwd+bwd", exclude=("layer_norm",))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bias_gelu"]
    assert len(ax.patches) == 3
    # the default leaves out the whole transformer block only
    block = [dict(r, measured_op="transformer_layer", us=r["us"] * 100) for r in recs if r["measured_op"] == "bias_gelu"]
    ax = plot_host(recs + block, "fwd+bwd")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bias_gelu", "layer_norm"]
    with pytest.raises(ValueError, match="no host record"):
        plot_host(recs, "fwd+bwd", exclude=("bias_gelu", "layer_norm"))
