"""The benchmark harness's CPU-testable parts and the book helpers."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

from fusedlib.bench import core
from fusedlib.bench.__main__ import main, summary
from fusedlib.bench.ops import OP_MODULES, get_cases
from fusedlib.bench.ops.bias_gelu import bias_gelu_bytes
from fusedlib.book import backward_table, check, sweep_table, eager_traffic, plot_bandwidth, plot_sweep, speedup_table
from fusedlib import unfused

from conftest import DEVICE  # noqa: I001

SCHEMA = {"op", "pass", "impl", "shape", "dtype", "ms", "bytes", "GBps", "device", "torch", "triton", "direct_launch"}


def _records():
    rec = lambda impl, pas, ms: core._record("bias_gelu", pas, impl, (8192, 16384), torch.bfloat16, ms,
                                             bias_gelu_bytes(8192, 16384, 2)[pas])
    copy = core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)
    return [copy, rec("fusedlib", "fwd", 0.14), rec("torch.compile", "fwd", 0.175),
            rec("fusedlib", "fwd+bwd", 0.4), rec("torch.compile", "fwd+bwd", 0.6)]


def test_record_schema_and_bandwidth():
    r = _records()[1]
    assert set(r) == SCHEMA
    assert r["GBps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel=1e-3)


def test_bias_gelu_bytes_are_the_floor():
    b = bias_gelu_bytes(10, 7, 2)
    assert b["fwd"] == (2 * 70 + 7) * 2
    assert b["fwd+bwd"] == b["fwd"] + (3 * 70 + 2 * 7) * 2


def test_every_registered_op_has_cases():
    for op in OP_MODULES:
        cases = get_cases(op)(torch.device("cpu"))
        assert cases and cases[0].op == op and {"fwd", "fwd+bwd"} & set(cases[0].bytes)
    with pytest.raises(KeyError, match="known ops"):
        get_cases("no_such_op")


def test_measure_case_runs_implementations_and_records_failures(monkeypatch):
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 1.0)[1])
    y = torch.randn(4, 8)

    def broken(*_):
        raise RuntimeError("baseline broke")

    case = core.BenchCase("bias_gelu", (4, 8), torch.float32, lambda d, rg: (y.clone().requires_grad_(rg),),
                          {"fwd": 64, "fwd+bwd": 160},
                          [core.Impl("eager", lambda t: unfused.gelu_tanh(t)), core.Impl("liger", broken)])
    recs = core.measure_case(case, torch.device("cpu"))
    assert [(r["impl"], r["pass"]) for r in recs] == [("eager", "fwd"), ("eager", "fwd+bwd")]
    assert "baseline broke" in case.skipped["liger"]


def _round_case(plain_rounds, tokens=None, nbytes=None, replay_rounds=False):
    impls = [core.Impl(n, lambda t: t) for n in ("a", "b", "c")]
    return core.BenchCase("bias_gelu", (4, 8), torch.float32, lambda d, rg: (), {"fwd+bwd": nbytes}, impls,
                          tokens=tokens, plain_rounds=plain_rounds, replay_rounds=replay_rounds)


def test_plain_rounds_take_turns_and_keep_each_median(monkeypatch):
    calls = []
    plain_ms = {"a": iter([30.0, 10.0, 20.0]), "b": iter([5.0, 50.0, 6.0]), "c": iter([7.0, 8.0])}

    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        calls.append((impl.name, "graph" if cuda_graph else "plain"))
        if cuda_graph:
            if impl.name == "b":
                raise RuntimeError("operation not permitted when stream is capturing")
            return 1.0, None
        if impl.name == "c" and len([c for c in calls if c == ("c", "plain")]) == 3:
            raise RuntimeError("out of memory")  # c's third round fails: its first two are kept
        return next(plain_ms[impl.name]), None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    recs = {r["impl"]: r for r in core.measure_case(_round_case(3, tokens=1000), torch.device("cuda"), ["fwd+bwd"])}
    assert calls == [("a", "plain"), ("a", "graph"), ("b", "plain"), ("b", "graph"), ("c", "plain"), ("c", "graph"),
                     ("a", "plain"), ("b", "plain"), ("c", "plain"), ("a", "plain"), ("b", "plain"), ("c", "plain")]
    a, b, c = recs["a"], recs["b"], recs["c"]
    assert a["ms_plain_rounds"] == [30.0, 10.0, 20.0] and a["ms_eager"] == 20.0 and a["ms"] == 1.0
    assert a["tokens_per_s_eager"] == round(1000 / 20e-3) and a["tokens_per_s"] == round(1000 / 1e-3)
    # no graph: its "ms" is the median of its plain launches too
    assert b["timer"] == "do_bench" and b["ms"] == b["ms_eager"] == 6.0 and b["tokens_per_s"] == round(1000 / 6e-3)
    assert c["ms_plain_rounds"] == [7.0, 8.0] and c["ms_eager"] == 7.5


def test_replay_rounds_take_turns_with_the_plain_launches_and_keep_each_median(monkeypatch, caplog):
    """With replay_rounds each captured implementation's replay is timed right after its plain
    launches in every round; "ms" (and the bandwidth and token rates from it) is the replays'
    median; one that cannot be captured keeps its plain time; a replay failing in a later round
    keeps the rounds before it and is not timed again, while its plain launches go on (and a
    failing plain round stops only the plain rounds); the progress bar ticks once per
    implementation and round, as the CLI counts."""
    calls = []
    plain_ms = {"a": iter([30.0, 10.0, 20.0]), "b": iter([5.0, 50.0, 6.0, 7.0]), "c": iter([7.0, 8.0, 9.0, 10.0])}
    graph_ms = {"a": iter([1.0, 4.0, 2.0, 3.0]), "c": iter([3.0, 5.0])}

    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        calls.append((impl.name, "graph" if cuda_graph else "plain"))
        if not cuda_graph:
            if impl.name == "a" and calls.count(("a", "plain")) == 4:
                raise RuntimeError("host out of memory")  # a's fourth plain round fails: its replays go on
            return next(plain_ms[impl.name]), None
        if impl.name == "b":
            raise RuntimeError("operation not permitted when stream is capturing")
        if impl.name == "c" and calls.count(("c", "graph")) == 3:
            raise RuntimeError("out of memory")  # c's third replay fails: its first two are kept
        return next(graph_ms[impl.name]), None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    case = _round_case(4, tokens=1000, nbytes=10**9, replay_rounds=True)
    ticks = []
    with caplog.at_level("WARNING", logger=core.logger.name):
        recs = {r["impl"]: r for r in core.measure_case(case, torch.device("cuda"), ["fwd+bwd"], progress=ticks.append)}
    assert calls == [("a", "plain"), ("a", "graph"), ("b", "plain"), ("b", "graph"), ("c", "plain"), ("c", "graph"),
                     ("a", "plain"), ("a", "graph"), ("b", "plain"), ("c", "plain"), ("c", "graph"),
                     ("a", "plain"), ("a", "graph"), ("b", "plain"), ("c", "plain"), ("c", "graph"),  # c's fails
                     ("a", "plain"), ("a", "graph"), ("b", "plain"), ("c", "plain")]  # a's plain fails, its replay on
    assert len(ticks) == 3 * 4
    a, b, c = recs["a"], recs["b"], recs["c"]
    assert a["ms_replay_rounds"] == [1.0, 4.0, 2.0, 3.0] and a["ms"] == 2.5 and a["timer"] == "cuda_graph"
    assert a["ms_plain_rounds"] == [30.0, 10.0, 20.0] and a["ms_eager"] == 20.0
    assert "host out of memory" in a["plain_rounds_error"] and "replay_rounds_error" not in a
    assert a["GBps"] == round(10**9 / 2.5e-3 / 1e9, 1) and a["tokens_per_s"] == round(1000 / 2.5e-3)
    assert a["tokens_per_s_eager"] == round(1000 / 20e-3)
    assert b["timer"] == "do_bench" and "ms_replay_rounds" not in b and b["ms"] == b["ms_eager"] == 6.5
    assert c["ms_replay_rounds"] == [3.0, 5.0] and c["ms"] == 4.0 and "out of memory" in c["replay_rounds_error"]
    assert c["ms_plain_rounds"] == [7.0, 8.0, 9.0, 10.0] and "plain_rounds_error" not in c
    warned = [r.getMessage() for r in caplog.records]
    assert any("replay round failed" in m and "out of memory" in m for m in warned)
    assert any("a round failed" in m and "host out of memory" in m for m in warned)


def test_replay_rounds_without_plain_rounds_time_each_replay_once(monkeypatch):
    calls = []

    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        calls.append(cuda_graph)
        return (1.0 if cuda_graph else 2.0), None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    recs = core.measure_case(_round_case(1, replay_rounds=True), torch.device("cuda"), ["fwd+bwd"])
    assert calls == [False, True] * 3
    assert all(r["ms"] == 1.0 and "ms_replay_rounds" not in r and "ms_plain_rounds" not in r for r in recs)


@pytest.mark.parametrize("bad", [1, 0, "yes", None, np.bool_(True)])
def test_replay_rounds_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="replay_rounds must be a bool"):
        _round_case(2, replay_rounds=bad)
    case = _round_case(2)
    case.replay_rounds = bad  # set after the case was made: the harness checks it again
    with pytest.raises(ValueError, match="replay_rounds must be a bool"):
        core.measure_case(case, torch.device("cpu"))


def test_plain_rounds_on_a_device_without_graphs_set_ms_and_bandwidth(monkeypatch):
    times = iter([4.0, 2.0, 3.0, 9.0, 9.0, 1.0, 5.0, 5.0, 5.0])
    monkeypatch.setattr(core, "_time_pass", lambda case, impl, pas, device, peak=False, cuda_graph=False:
                        (next(times), None))
    recs = core.measure_case(_round_case(3, nbytes=10**9), torch.device("cpu"), ["fwd+bwd"])
    # rounds in turns: a 4, b 2, c 3 | a 9, b 9, c 1 | a 5, b 5, c 5
    assert [r["ms_plain_rounds"] for r in recs] == [[4.0, 9.0, 5.0], [2.0, 9.0, 5.0], [3.0, 1.0, 5.0]]
    assert [r["ms"] for r in recs] == [5.0, 5.0, 3.0] and "ms_eager" not in recs[0]
    assert recs[2]["GBps"] == round(10**9 / 3e-3 / 1e9, 1)


def test_one_plain_round_keeps_the_records_as_they_were(monkeypatch):
    monkeypatch.setattr(core, "_time_pass", lambda case, impl, pas, device, peak=False, cuda_graph=False: (2.0, None))
    recs = core.measure_case(_round_case(1), torch.device("cpu"), ["fwd+bwd"])
    assert all("ms_plain_rounds" not in r and r["ms"] == 2.0 for r in recs)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3", None])
def test_plain_rounds_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="plain_rounds must be an int >= 1"):
        _round_case(bad)
    case = _round_case(2)
    case.plain_rounds = bad  # set after the case was made: the harness checks it again
    with pytest.raises(ValueError, match="plain_rounds must be an int >= 1"):
        core.measure_case(case, torch.device("cpu"))


def test_plain_rounds_take_numpy_ints():
    case = _round_case(np.int64(3))
    assert case.plain_rounds == 3 and type(case.plain_rounds) is int


def test_progress_ticks_once_per_round_whatever_fails(monkeypatch):
    seen = {"b": 0}

    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        if impl.name == "a":
            raise RuntimeError("broken from the start")
        if impl.name == "b" and not cuda_graph:
            seen["b"] += 1
            if seen["b"] == 2:
                raise RuntimeError("out of memory in round 2")
        return 3.0, None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    case = _round_case(4)
    ticks = []
    recs = {r["impl"]: r for r in core.measure_case(case, torch.device("cuda"), ["fwd+bwd"], progress=ticks.append)}
    assert len(ticks) == 3 * 4  # the CLI's bar counts every implementation's passes times the rounds
    assert "a" not in recs and "broken from the start" in case.skipped["a"]
    assert recs["b"]["ms_plain_rounds"] == [3.0] and "out of memory in round 2" in recs["b"]["plain_rounds_error"]
    assert recs["c"]["ms_plain_rounds"] == [3.0] * 4 and "plain_rounds_error" not in recs["c"]


def test_write_and_load_records(tmp_path):
    recs = _records()
    path = core.write_records(recs, tmp_path / "a" / "bias_gelu.json")
    assert core.load_records(path) == json.loads(json.dumps(recs))


def test_cli_refuses_to_time_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--op", "bias_gelu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_summary_and_speedup_table_print_ratios_from_records():
    recs = _records()
    table = speedup_table(recs)
    assert "1.50x" in table and "1.25x" in table  # 0.6 / 0.4 and 0.175 / 0.14
    assert "fused x" in summary(recs)


def test_backward_table_splits_fwd_bwd_into_its_passes():
    recs = _records()
    table = backward_table(recs)
    fused = next(line for line in table.splitlines() if line.startswith("fusedlib"))
    # fwd 0.14 ms, fwd+bwd 0.4 ms: the backward took 0.26 ms for bytes[fwd+bwd] - bytes[fwd]
    b = bias_gelu_bytes(8192, 16384, 2)
    gbps = (b["fwd+bwd"] - b["fwd"]) / 0.26e-3 / 1e9
    assert fused.split() == ["fusedlib", "0.1400", "0.4000", "0.2600", f"{gbps:.0f}", f"{100 * gbps / 4294.967296:.1f}"]
    assert any(line.startswith("torch.compile") for line in table.splitlines())
    with pytest.raises(ValueError, match="no copy record"):
        backward_table([r for r in recs if r["impl"] != "copy"])


def _sweep_records():
    """Two impls over three widths of the same element count, fwd and fwd+bwd, and the copy."""
    out = [core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)]
    for impl, ms in (("fusedlib", 0.15), ("torch.compile", 0.3)):
        for h in (1024, 4096, 16384):
            for pas, k in (("fwd", 1), ("fwd+bwd", 2.5)):
                out.append(core._record("bias_gelu", pas, impl, ((1 << 27) // h, h), torch.bfloat16, ms * k,
                                        bias_gelu_bytes((1 << 27) // h, h, 2)[pas]))
    return out


def test_sweep_table_prints_percent_of_copy_per_shape_and_pass():
    table = sweep_table(_sweep_records(), impls=("torch.compile", "fusedlib")).splitlines()
    assert len(table) == 3 + 3  # title, two header lines, three widths
    assert table[2].split() == ["shape", "compile", "fusedlib", "compile", "fusedlib"]
    first = table[3].split("]")  # [131072, 1024] then the four columns
    assert first[0] == "[131072, 1024"
    b = bias_gelu_bytes(131072, 1024, 2)
    expect = [b["fwd"] / 0.3e-3, b["fwd"] / 0.15e-3, b["fwd+bwd"] / 0.75e-3, b["fwd+bwd"] / 0.375e-3]
    assert first[1].split() == [f"{100 * v / 1e9 / 4294.967296:.1f}" for v in expect]
    with pytest.raises(ValueError, match="no copy record"):
        sweep_table(_records()[1:])


def _overlaps(a, b) -> bool:
    """Whether two display-space boxes share an area (touching edges do not count)."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_bandwidth_draws_every_impl():
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_bandwidth(_records(), "bias + GeLU")
    labels = ax.get_legend_handles_labels()[1]
    assert "fusedlib" in labels and "torch.compile" in labels and any("copy" in s for s in labels)


def test_plot_bandwidth_starts_at_zero_and_its_legend_covers_no_bar():
    import matplotlib

    matplotlib.use("Agg")
    recs = _records()
    ax = plot_bandwidth(recs, "bias + GeLU")
    fig = ax.figure
    fig.canvas.draw()
    bottom, top = ax.get_ylim()
    ceiling = next(r["GBps"] for r in recs if r["impl"] == "copy")
    assert bottom == 0 and top > ceiling
    legend = ax.get_legend().get_window_extent()
    bars = [p.get_window_extent() for p in ax.patches]
    assert len(bars) == 4  # 2 impls x 2 passes
    assert not any(_overlaps(legend, b) for b in bars)
    assert not _overlaps(legend, ax.get_window_extent()), "the legend lies inside the axes"
    assert legend.y0 >= 0, "the legend is cut off at the figure's bottom"


def test_plot_sweep_starts_at_zero_and_its_legend_is_outside_the_panels():
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_sweep(_sweep_records(), "bias + GeLU")
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == 2 and [a.get_title() for a in axes] == ["bias + GeLU, fwd", "bias + GeLU, fwd+bwd"]
    for ax in axes:
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > 4294.967296  # the copy ceiling, GB/s
        lines = {l.get_label(): l for l in ax.get_lines()}
        assert list(lines["fusedlib"].get_xdata()) == [1024, 4096, 16384]
        assert "torch.compile" in lines
    legend = fig.legends[0]
    assert {t.get_text() for t in legend.get_texts()} >= {"fusedlib", "torch.compile"}
    box = legend.get_window_extent()
    assert box.y0 >= 0 and not any(_overlaps(box, a.get_window_extent()) for a in axes)


def test_plot_sweep_refuses_records_without_a_sweep():
    with pytest.raises(ValueError, match="no sweep"):
        plot_sweep(_records(), "bias + GeLU")
    with pytest.raises(ValueError, match="no copy record"):
        plot_sweep([r for r in _sweep_records() if r["impl"] != "copy"], "bias + GeLU")


def test_check_prints_a_device_independent_verdict(capsys):
    assert check("x", torch.ones(3), torch.ones(3, dtype=torch.float64), atol=1e-6)
    assert not check("y", torch.tensor([float("nan")]), torch.zeros(1), atol=1.0)
    out = capsys.readouterr().out.splitlines()
    assert out == ["x: max |fused - reference| <= 1e-06: True", "y: max |fused - reference| <= 1: False"]


def test_eager_traffic_counts_operands_and_results():
    a = torch.empty(10, 20, device="meta")
    b = torch.empty(20, device="meta")
    rows = eager_traffic(lambda a, b: (a + b) * a, a, b)
    assert rows == [{"op": "add", "read_bytes": 800 + 80, "write_bytes": 800},
                    {"op": "mul", "read_bytes": 1600, "write_bytes": 800}]


def test_measure_case_records_graph_and_plain_launch_times(monkeypatch):
    # CUDA-graph cases: "ms" is the graph replay, "ms_eager" the plain launches; an
    # implementation that cannot be captured keeps its plain-launch time, marked "do_bench"
    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        if cuda_graph and impl.name == "liger":
            raise RuntimeError("operation not permitted when stream is capturing")
        return (0.25 if cuda_graph else 0.5), None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    case = core.BenchCase("layer_norm", (4, 8), torch.float32, lambda d, rg: (), {"fwd": 10**9, "fwd+bwd": 4 * 10**9},
                          [core.Impl("fusedlib", None), core.Impl("liger", None)], cuda_graph=True)
    recs = {(r["impl"], r["pass"]): r for r in core.measure_case(case, torch.device("cuda"))}
    fused, liger = recs[("fusedlib", "fwd+bwd")], recs[("liger", "fwd+bwd")]
    assert (fused["ms"], fused["ms_eager"], fused["timer"]) == (0.25, 0.5, "cuda_graph")
    assert fused["GBps"] == pytest.approx(4e9 / 0.25e-3 / 1e9, rel=1e-3)
    assert (liger["ms"], liger["ms_eager"], liger["timer"]) == (0.5, 0.5, "do_bench")
    table = speedup_table([core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)]
                          + list(recs.values()))
    assert "plain-launch ms" in table and "1.00x" in table  # liger / fusedlib with plain launches: 0.5 / 0.5
    assert "2.00x" not in table, "a plain-launch time must not be divided by a graph time"
    assert "0.5000*" in table and "* no CUDA graph" in table
    # on a CPU device the graph timer is not used: plain records without the extra fields
    plain = core.measure_case(case, torch.device("cpu"))
    assert all("timer" not in r and "ms_eager" not in r and r["ms"] == 0.5 for r in plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")
def test_time_ms_registers_the_generators_it_is_given():
    """A function that draws from a generator of its own cannot be captured unless the generator
    is registered with the graph (its state is not in capture mode); registered, each replay
    draws new numbers from it: its offset moves by one call's increment per replay. The bound:
    the three warm-up calls and the capture move it by at most 4 calls; do_bench replays at least
    8 times (1, 5 for its estimate, >= 1 warm-up, >= 1 timed), so at least 11 with the replays
    drawing; 10 lies between."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    out = torch.empty(4096, device="cuda")

    def draw():
        torch.rand(4096, device="cuda", generator=gen, out=out)

    with pytest.raises(RuntimeError):
        core.time_ms(draw, warmup=1, rep=1, cuda_graph=True)
    start = gen.get_offset()
    draw()
    per_call = gen.get_offset() - start
    assert per_call > 0
    start = gen.get_offset()
    assert core.time_ms(draw, warmup=1, rep=5, cuda_graph=True, generators=iter([gen])) > 0
    assert gen.get_offset() - start >= 10 * per_call, (gen.get_offset() - start, per_call)


def test_time_pass_hands_the_implementations_generators_to_a_graph_timer_only(monkeypatch):
    """An implementation's generators are asked for only when the CUDA-graph timer iterates
    them (after its warm-up calls, which may build the module that makes them), and only for a
    graph timing; plain launches get none."""
    events = []

    def fake_time_ms(fn, grad_to_none=None, warmup=25, rep=200, cuda_graph=False, generators=()):
        fn()
        events.append(("timed", cuda_graph, list(generators)))
        return 1.0

    monkeypatch.setattr(core, "time_ms", fake_time_ms)
    impl = core.Impl("megatron-core", lambda x: events.append("fn") or x * 2,
                     generators=lambda: events.append("asked") or ["g1", "g2"])
    case = core.BenchCase(op="t", shape=(4,), dtype=torch.float32,
                          make_inputs=lambda d, g: (torch.ones(4, requires_grad=g),), bytes={}, impls=[impl])
    for pas in ("fwd", "fwd+bwd"):
        for cuda_graph in (False, True):
            events.clear()
            core._time_pass(case, impl, pas, torch.device("cpu"), cuda_graph=cuda_graph)
            # the timer's own call of fn, then (graph timer only) the generators, asked for once
            want = ["fn", "asked", ("timed", True, ["g1", "g2"])] if cuda_graph else ["fn", ("timed", False, [])]
            assert events[-len(want):] == want and events.count("asked") == int(cuda_graph), (pas, events)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")
def test_a_failed_capture_leaves_its_registered_generators_usable():
    """A capture that registered a generator of the function's own and then failed (a host
    sync) leaves that generator's state in capture mode, where every later draw fails ("Offset
    increment outside graph capture encountered unexpectedly"); the timer takes it out, keeping
    its seed and offset: it draws eagerly afterwards, where it left off."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    x = torch.ones(8, device="cuda")

    def fn():
        torch.rand(64, device="cuda", generator=gen)
        return x.sum().item()

    with pytest.raises(RuntimeError):
        core.time_ms(fn, warmup=1, rep=1, cuda_graph=True, generators=[gen])
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    offset = gen.get_offset()
    torch.rand(64, device="cuda", generator=gen)
    assert gen.get_offset() > offset


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")
def test_a_failed_capture_leaves_random_numbers_working():
    # a baseline that syncs the host cannot be captured; the harness must leave the process's CUDA
    # generators usable for every later case (they stayed in capture mode, and every later
    # random draw failed, before the reset), and the stream that was current current again
    # (torch.cuda.graph's exit raises before it leaves its stream context: every later case, and
    # every later test of the worker, ran on the capture's side stream)
    # (and the allocator no longer routing to the capture's pool: empty_cache frees memory again,
    # what the capture allocated included)
    import gc

    from conftest import empty_cache_frees
    from fusedlib.bench import core as bench_core

    x = torch.ones(64, device="cuda")
    big = 1 << 29

    def syncs():  # allocates 512 MiB (inside the capture: from the capture's pool), then syncs the host
        return torch.empty(big, dtype=torch.uint8, device="cuda")[:64].sum().item() + x.sum().item()

    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # (conftest: every test starts on it)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(RuntimeError):
        bench_core.time_ms(syncs, warmup=1, rep=1, cuda_graph=True)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.cuda.synchronize()
    gc.collect()  # (the error's traceback held the capture's tensor in a cycle of frames)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved + big // 2, (reserved, torch.cuda.memory_reserved())
    assert empty_cache_frees()
    y = torch.nn.functional.dropout(torch.randn(64, device="cuda"), 0.5)
    assert y.shape == (64,) and bool((y == 0).any())
    assert bench_core.time_ms(lambda: torch.rand(64, device="cuda"), warmup=1, rep=2, cuda_graph=True) > 0


@pytest.mark.parametrize("all_outputs", [False, True])
def test_fwd_bwd_pass_sends_gradients_into_the_outputs_it_names(monkeypatch, all_outputs):
    # an op with two outputs that both feed the model (bias_dropout_add_norm: y and the next
    # residual) is timed with a gradient into each; by default only the first output's
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 1.0)[1])
    x = torch.randn(4, 8)
    seen = []

    def two(t):
        a, b = 2 * t, 3 * t
        b.register_hook(lambda g: seen.append("b") or g)
        return a, b

    case = core.BenchCase("bias_dropout_add_norm", (4, 8), torch.float32,
                          lambda d, rg: (x.clone().requires_grad_(rg),), {"fwd": 64, "fwd+bwd": 160},
                          [core.Impl("fusedlib", two, passes=("fwd+bwd",))], all_outputs=all_outputs)
    core.measure_case(case, torch.device("cpu"))
    assert bool(seen) is all_outputs


# ---------------------------------------------------------------------------------------------
# eager_traffic: operands in lists, views, several results
# ---------------------------------------------------------------------------------------------

def test_eager_traffic_reads_the_tensors_of_list_operands():
    a, b = torch.empty(4, 8, device="meta"), torch.empty(2, 8, device="meta")
    assert eager_traffic(lambda a, b: torch.cat([a, b]), a, b) == [{"op": "cat", "read_bytes": 192, "write_bytes": 192}]


def test_eager_traffic_charges_no_view_and_no_attribute_read():
    x = torch.empty(10, 20, device="meta")
    views = lambda x: (x.view(200).reshape(10, 20).unsqueeze(0).squeeze(0).transpose(0, 1).permute(1, 0).t().t()
                       .expand(10, 20).narrow(0, 0, 10).flatten().unflatten(0, (10, 20)).contiguous()) + x.shape[0]
    assert eager_traffic(views, x) == [{"op": "add", "read_bytes": 800, "write_bytes": 800}]
    assert eager_traffic(lambda x: getattr(x, "shape"), x) == []
    assert eager_traffic(lambda x: x.float().to(torch.float32).detach(), x) == []  # already float32
    # a reshape that must copy (of a transposed tensor) is a kernel
    assert eager_traffic(lambda x: x.t().reshape(200), x) == [{"op": "reshape", "read_bytes": 800, "write_bytes": 800}]
    # an expanded operand is read once per distinct element
    b = torch.empty(20, device="meta")
    assert eager_traffic(lambda x, b: x + b.expand(10, 20), x, b) == [{"op": "add", "read_bytes": 880, "write_bytes": 800}]


def test_eager_traffic_counts_ops_with_several_results_and_their_views():
    y = torch.randn(2, 8)
    rows = eager_traffic(lambda y: unfused.swiglu(y), y)  # chunk -> two views, then silu and the product
    assert rows == [{"op": "silu", "read_bytes": 32, "write_bytes": 32}, {"op": "mul", "read_bytes": 64, "write_bytes": 32}]
    x = torch.empty(10, 20, device="meta")
    assert eager_traffic(lambda x: torch.split(x, [5, 15], -1)[1].sum(), x) == [
        {"op": "sum", "read_bytes": 600, "write_bytes": 4}]
    assert eager_traffic(lambda x: x.max(dim=-1), x) == [{"op": "max", "read_bytes": 800, "write_bytes": 40 + 80}]


def test_eager_traffic_names_reflected_and_in_place_operators():
    def fn(x):
        y = 0.5 * x + 1.0
        y += x
        return y
    x = torch.empty(4, 8, device="meta")
    assert [r["op"] for r in eager_traffic(fn, x)] == ["mul", "add", "add_"]


def test_eager_traffic_runs_functions_that_check_shapes():
    def checked(x, w):
        if x.shape[-1] != w.shape[0]:  # Python control flow on a shape
            raise ValueError("shapes")
        return x * w
    x, w = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    assert eager_traffic(checked, x, w) == [{"op": "mul", "read_bytes": 128 + 32, "write_bytes": 128}]


# ---------------------------------------------------------------------------------------------
# clear errors on malformed records
# ---------------------------------------------------------------------------------------------

def test_bandwidth_tables_refuse_empty_or_copy_only_records():
    copy_only = [{"impl": "copy", "GBps": 100}]
    for fn in (speedup_table, backward_table):
        with pytest.raises(ValueError, match=f"{fn.__name__}: no records"):
            fn([])
        with pytest.raises(ValueError, match=f"{fn.__name__}: no fusedlib record"):
            fn(copy_only)
    with pytest.raises(ValueError, match="speedup_table: records: no copy record"):
        speedup_table(_records()[1:])
    with pytest.raises(ValueError, match="plot_bandwidth: no records"):
        plot_bandwidth([], "t")
    with pytest.raises(ValueError, match="sweep_table: no implementation to show"):
        sweep_table(copy_only)
    with pytest.raises(ValueError, match="sweep_table: no implementation to show"):
        sweep_table(_sweep_records(), impls=[])


def test_bandwidth_tables_name_the_record_and_its_missing_key():
    recs = _records()
    del recs[2]["ms"]  # torch.compile fwd
    with pytest.raises(ValueError, match=r"speedup_table: records\[2\] \(op 'bias_gelu', impl 'torch.compile', "
                                         r"pass 'fwd', shape \[8192, 16384\]\) has no 'ms'"):
        speedup_table(recs)
    with pytest.raises(ValueError, match=r"backward_table: records\[0\] .* has no 'impl'"):
        backward_table([{"GBps": 1.0}])
    with pytest.raises(ValueError, match=r"speedup_table: records is a dict, expected a list"):
        speedup_table({"impl": "copy"})


@pytest.fixture
def bench_files(tmp_path, monkeypatch):
    import fusedlib.book as book

    monkeypatch.setattr(book, "bench_dir", lambda: tmp_path)
    monkeypatch.setattr(book, "CUDA_AVAILABLE", False)
    return tmp_path


@pytest.mark.parametrize("content, match", [
    ("[]", "holds an empty list"),
    ('{"a": 1}', "holds one dict"),
    ('[{"op": "x", "torch": "2", "triton": "3"}]', r"\[0\] \(op 'x'\) has no 'device'"),
    ("[1, 2]", r"\[0\] is a int, expected a bench record"),
    ('"text"', "is a str, expected a list"),
    ("[{", "is not valid JSON"),
])
def test_bench_or_stored_names_the_file_of_bad_records(bench_files, content, match):
    from fusedlib.book import bench_or_stored

    (bench_files / "op.json").write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        bench_or_stored("op")
    assert str(bench_files / "op.json") in str(err.value)


def test_a_live_measurement_says_that_the_prose_quotes_the_stored_run(monkeypatch, capsys):
    # on a GPU a chapter's cell measures live, but its prose quotes the stored records: the cell
    # says so, naming the stored file and how to show it
    import fusedlib.bench as bench
    import fusedlib.book as book

    monkeypatch.setattr(book, "measure_live", lambda: True)
    monkeypatch.setattr(bench, "run_op", lambda op, sweep=False: ([{"device": "Some GPU", "impl": "copy"}],
                                                                   {"apex": "not installed"}))
    assert book.bench_or_stored("bias_gelu") == [{"device": "Some GPU", "impl": "copy"}]
    out = capsys.readouterr().out.splitlines()
    assert out == [book.live_note("Some GPU", "measured", "bias_gelu.json"), "  apex not measured: not installed"]
    assert out[0].startswith("measured now on Some GPU; the text around this cell quotes the stored run")
    assert "chapters/data/bench/bias_gelu.json" in out[0] and "FUSEDLIB_BENCH_STORED=1" in out[0]


def test_loaded_records_say_why_and_where_they_were_measured(bench_files, capsys):
    # bench_or_stored prints stored_note's line, which names the reason (no GPU here) and the
    # device and versions of the stored run
    import fusedlib.book as book

    rec = {"op": "x", "device": "Some GPU", "torch": "2.0", "triton": "3.0"}
    (bench_files / "op.json").write_text(json.dumps([rec]))
    assert book.bench_or_stored("op") == [rec]
    line = "no GPU here: loaded the stored results measured on Some GPU (torch 2.0, triton 3.0)"
    assert book.stored_note(rec) == line and capsys.readouterr().out.splitlines() == [line]


def test_load_bench_keeps_lists_of_records_and_profile_dicts(bench_files):
    from fusedlib.book import load_bench

    (bench_files / "a.json").write_text('[{"impl": "copy"}]')
    (bench_files / "b_profile.json").write_text('{"shape": [1]}')
    assert load_bench("a") == [{"impl": "copy"}] and load_bench("b_profile") == {"shape": [1]}


def test_every_record_reader_notes_the_records_it_read(bench_files, monkeypatch):
    # what tools/execute_notebooks.py stores in a chapter's metadata for the staleness test below
    import hashlib

    import fusedlib.book as book
    from fusedlib.bench.ops import transformer_layer as tl
    from fusedlib.train.bench import load_train_bench

    monkeypatch.setattr(book, "RECORDS_READ", {})
    (bench_files / "a.json").write_text('[{"impl": "copy"}]')
    (bench_files / "t.json").write_text("[]")
    (bench_files / tl.PROFILE_FILE).write_text('{"impls": {}}')
    book.load_bench("a")
    load_train_bench("t.json")
    tl.load_profile()
    digest = {name: hashlib.sha256((bench_files / f"{name}.json").read_bytes()).hexdigest()
              for name in ("a", "t", tl.PROFILE_FILE.removesuffix(".json"))}
    assert book.RECORDS_READ == digest
    with pytest.raises(FileNotFoundError):
        book.load_bench("missing")
    (bench_files / "elsewhere").mkdir()
    (bench_files / "elsewhere" / "u.json").write_text("[]")
    load_train_bench("u.json", directory=bench_files / "elsewhere")  # not the book's records: not noted
    assert book.RECORDS_READ == digest
    (bench_files / "a.json").write_text('[{"impl": "copy2"}]')  # read again after a change: the new digest
    book.load_bench("a")
    assert book.RECORDS_READ["a"] == hashlib.sha256(b'[{"impl": "copy2"}]').hexdigest()


def test_execute_notebooks_reads_the_records_cell_or_says_what_it_printed():
    import importlib.util
    from pathlib import Path

    import nbformat

    path = Path(__file__).resolve().parent.parent / "tools" / "execute_notebooks.py"
    spec = importlib.util.spec_from_file_location("execute_notebooks", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cell = nbformat.v4.new_code_cell(tool.RECORDS_CELL)
    # the cell itself, run here: a JSON object of what this process read
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(tool.RECORDS_CELL, {})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed.getvalue())]
    got = tool.records_read(cell)
    assert set(got) == {"records_read", "measured_live"} and isinstance(got["measured_live"], bool)
    good = '{"records_read": {"ceilings": "ab12"}, "measured_live": false}\n'
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=good)]
    assert tool.records_read(cell) == {"records_read": {"ceilings": "ab12"}, "measured_live": False}
    for outputs in ([], [nbformat.v4.new_output("error", ename="NameError", evalue="x", traceback=[])],
                    [nbformat.v4.new_output("stream", name="stdout", text='["ceilings"]\n')],
                    [nbformat.v4.new_output("stream", name="stdout", text='{"records_read": {}}\n')],
                    [nbformat.v4.new_output("stream", name="stdout", text="a warning\n")]):
        cell.outputs = outputs
        with pytest.raises(ValueError, match="not its JSON object of records read"):
            tool.records_read(cell)


def test_host_and_throughput_tables_name_the_missing_key():
    import matplotlib

    from fusedlib.book import host_table, plot_host, plot_throughput, profile_table, throughput_table

    matplotlib.use("Agg")
    host = [{"op": "host", "pass": "fwd+bwd", "impl": "fusedlib", "us": 3.0, "device": "d"}]
    with pytest.raises(ValueError, match=r"plot_host: records\[0\] \(op 'host', impl 'fusedlib', pass 'fwd\+bwd'\) "
                                         r"has no 'measured_op'"):
        plot_host(host)
    with pytest.raises(ValueError, match=r"host_table: records\[0\] .* has no 'measured_op'"):
        host_table(host)
    host[0]["measured_op"] = "bias_gelu"
    del host[0]["us"]
    with pytest.raises(ValueError, match=r"host_table: .* has no 'us'"):
        host_table(host)
    layer = [{"op": "transformer_layer", "impl": "fusedlib", "dtype": "bf16", "device": "d", "tokens_per_s": 1}]
    with pytest.raises(ValueError, match=r"throughput_table: records\[0\] .* has no 'shape', 'ms'"):
        throughput_table(layer)
    with pytest.raises(ValueError, match=r"plot_throughput: records\[0\] .* has no 'shape'"):
        plot_throughput([{"op": "transformer_layer", "device": "d", "tokens_per_s": 1}])
    with pytest.raises(ValueError, match=r"profile_table: the profile has no 'shape', 'steps', 'dtype', 'device', 'impls'"):
        profile_table({})
    with pytest.raises(ValueError, match=r"profile_table: the profile's impls\['fusedlib'\] has no 'top'"):
        profile_table({"shape": [1], "steps": 1, "dtype": "bf16", "device": "d",
                       "impls": {"fusedlib": {"kernel_ms": 1.0, "launches": 1, "categories": {}}}})


# ---------------------------------------------------------------------------------------------
# check: infinities, shapes, arguments
# ---------------------------------------------------------------------------------------------

def test_check_treats_equal_infinities_as_equal_and_nan_as_a_failure(capsys):
    inf = float("inf")
    assert check("inf", torch.tensor([inf, -inf, 1.0]), torch.tensor([inf, -inf, 1.0]), atol=0.0)
    assert not check("sign", torch.tensor([inf]), torch.tensor([-inf]), atol=1.0)
    assert not check("finite vs inf", torch.tensor([1e30]), torch.tensor([inf]), atol=1.0, rtol=1.0)
    assert not check("nan", torch.tensor([float("nan")]), torch.tensor([float("nan")]), atol=1.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "inf: max |fused - reference| <= 0: True"


def test_check_says_shape_on_a_shape_mismatch_and_refuses_non_tensors(capsys):
    assert not check("x", torch.ones(2, 3), torch.ones(3, 2), atol=1.0)
    assert capsys.readouterr().out == "x: shape [2, 3] vs reference [3, 2]: False\n"
    with pytest.raises(TypeError, match="check: actual must be a torch.Tensor, got list"):
        check("x", [1.0], torch.ones(1), atol=1.0)
    with pytest.raises(TypeError, match="check: expected must be a torch.Tensor, got float"):
        check("x", torch.ones(1), 1.0, atol=1.0)


def test_book_functions_document_args_returns_and_raises():
    import fusedlib.book as book

    for name in book.__all__:
        doc = getattr(book, name).__doc__ or ""
        if name == "device_banner":
            continue  # fusedlib.runtime's, re-exported
        assert "Returns:" in doc or "Yields:" in doc, name
        assert "Args:" in doc or not inspect.signature(getattr(book, name)).parameters, name
        assert "Raises:" in doc or name in ("show_source", "bench_dir"), name


def test_each_chapter_was_executed_after_the_records_it_reads():
    """A chapter's stored outputs and prose come from the records it reads (the cells that
    print them are tagged ``nbval-ignore-output``, since a GPU measures afresh, so nbval cannot
    tell stale ones). The records its last execution read (``metadata.fusedlib.records_read``,
    which ``tools/execute_notebooks.py`` stores from ``fusedlib.book.RECORDS_READ``: reads
    through helpers and loops included) must be the stored files byte for byte (their SHA-256),
    and that execution must not have measured live. Any other quoted ``"name"`` or
    ``"name.json"`` of a file in chapters/data/bench in its code cells (a branch that run did
    not take): the commit that last changed that record must be an ancestor of the commit that
    last changed the chapter. Chapters read records only through the loaders (no
    ``bench_dir()`` of their own)."""
    import hashlib
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    bench = root / "chapters" / "data" / "bench"

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: the records' and chapters' commits are unknown")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: every file's last commit may be the same one")
    # changed in the working tree, not yet committed: a changed record needs its chapters changed too
    dirty = {line[3:].strip() for line in git("status", "--porcelain").stdout.splitlines()}

    def last_commit(path: Path) -> str:
        return git("log", "-1", "--format=%H", "--", str(path.relative_to(root))).stdout.strip()

    names = sorted(p.stem for p in bench.glob("*.json"))
    assert names, bench
    stale, checked = [], 0
    for chapter in sorted((root / "chapters").glob("*.ipynb")):
        chapter_commit = last_commit(chapter)
        if not chapter_commit:
            pytest.skip(f"{chapter.name} has no commit in this checkout's history (a shallow clone?)")
        nb = json.loads(chapter.read_text())
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        meta = nb["metadata"].get("fusedlib", {})
        read = meta.get("records_read")
        assert isinstance(read, dict), (f"{chapter.name} has no metadata.fusedlib.records_read: execute it with "
                                        f"tools/execute_notebooks.py")
        assert meta.get("measured_live") is False, (
            f"{chapter.name} was executed measuring live (a GPU without FUSEDLIB_BENCH_STORED=1): its outputs are "
            f"not the stored records'")
        assert "bench_dir()" not in code, (f"{chapter.name} reads bench_dir() itself: read records through the "
                                           f"loaders (fusedlib.book.load_bench...), which note them")
        unknown = set(read) - set(names)
        assert not unknown, f"{chapter.name} read records that chapters/data/bench does not hold: {sorted(unknown)}"
        for name, digest in read.items():  # the records its last execution read, as they were then
            checked += 1
            if hashlib.sha256((bench / f"{name}.json").read_bytes()).hexdigest() != digest:
                stale.append(f"{chapter.name} was executed on another {name}.json than the stored one")
        for name in names:  # and those its code names that the execution did not read (a branch not taken)
            if name in read or not re.search(rf"[\"']{re.escape(name)}(\.json)?[\"']", code):
                continue
            record_commit = last_commit(bench / f"{name}.json")
            checked += 1
            record_path = f"chapters/data/bench/{name}.json"
            if f"chapters/{chapter.name}" in dirty:  # re-executed since its last commit
                continue
            if record_path in dirty:
                stale.append(f"{chapter.name} reads {name}.json, changed in the working tree")
                continue
            if record_commit and git("merge-base", "--is-ancestor", record_commit, chapter_commit).returncode != 0:
                stale.append(f"{chapter.name} (last committed {chapter_commit[:9]}) reads {name}.json, "
                             f"re-stored after it ({record_commit[:9]})")
    assert checked > 0
    assert not stale, "re-execute these chapters on the stored records: " + "; ".join(stale)


# ---------------------------------------------------------------------------------------------
# load_bench's refusals and bench_dir's lookup (each was a mutation no test caught)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', '[{"impl": "copy"}, 3]'])
def test_load_bench_refuses_json_that_is_not_records(bench_files, content):
    from fusedlib.book import load_bench

    (bench_files / "bad.json").write_text(content)
    with pytest.raises(ValueError, match="load_bench"):
        load_bench("bad")


def test_load_bench_of_a_missing_file_names_the_command_that_makes_it(bench_files):
    from fusedlib.book import load_bench

    with pytest.raises(FileNotFoundError, match=r"missing\.json not found: run `python -m fusedlib\.bench --op missing`"):
        load_bench("missing")


def test_bench_dir_is_data_bench_under_the_working_directory_when_there(tmp_path, monkeypatch):
    from fusedlib.book import bench_dir

    (tmp_path / "data" / "bench").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert bench_dir() == tmp_path / "data" / "bench"


# ---------------------------------------------------------------------------------------------
# The ceilings' bytes and flops, the rates of replays and plain launches, the times' decimals (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def test_copy_and_matmul_records_count_their_bytes_and_flops(monkeypatch):
    # the copy reads and writes every element; the product is 2·n³ flops (a multiply and an add)
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 1e-6)[1])
    rec = core.copy_record(numel=1000, dtype=torch.float32, device="cpu")
    assert rec["bytes"] == 2 * 1000 * 4 and rec["ms"] == 0.0  # (1e-6 ms rounds to 0 at 5 decimals)
    rec = core.matmul_record(n=10, dtype=torch.float32, device="cpu")
    assert rec["TFLOPs"] == round(2 * 10**3 / 1e-9 / 1e12, 1) == 2.0 and rec["bytes"] == 3 * 100 * 4


@pytest.mark.parametrize("rounds", [1, 3])
def test_flop_rates_of_graph_replays_and_plain_launches_each_from_their_own_time(monkeypatch, rounds):
    # graph replays 1 ms, plain launches 4 ms: TFLOPs from "ms", TFLOPs_eager from "ms_eager"
    monkeypatch.setattr(core, "_time_pass", lambda case, impl, pas, device, peak=False, cuda_graph=False:
                        (1.0 if cuda_graph else 4.0, None))
    case = _round_case(rounds)
    case.flops = {"fwd+bwd": 4 * 10**9}
    recs = core.measure_case(case, torch.device("cuda"), ["fwd+bwd"])
    for r in recs:
        assert r["ms"] == 1.0 and r["ms_eager"] == 4.0
        assert r["TFLOPs"] == 4.0 and r["TFLOPs_eager"] == 1.0


def test_times_keep_five_decimals_of_a_millisecond(monkeypatch):
    # a microsecond kernel's time is not rounded away: 12.3456 us is 0.01235 ms
    monkeypatch.setattr(core, "_time_pass", lambda case, impl, pas, device, peak=False, cuda_graph=False:
                        (0.0123456, None))
    recs = core.measure_case(_round_case(1, nbytes=10**6), torch.device("cpu"), ["fwd+bwd"])
    assert all(r["ms"] == 0.01235 for r in recs)
    assert recs[0]["GBps"] == round(10**6 / (0.0123456 * 1e-3) / 1e9, 1)

def test_time_ms_asks_do_bench_for_the_median_after_warm_up(monkeypatch):
    # plain launches: do_bench's median with the warm-up and repetitions asked, the gradients reset;
    # graph replays (CUDA stood in for): three warm-up calls and the capture, then the replays' median
    import contextlib

    asked = []

    def fake_do_bench(fn, **kw):
        asked.append((fn, kw))
        return 1.5

    monkeypatch.setattr(core.triton.testing, "do_bench", fake_do_bench)
    t = torch.ones(2, requires_grad=True)
    calls = []
    fn = lambda: calls.append(t.grad)  # noqa: E731
    assert core.time_ms(fn, grad_to_none=[t], warmup=7, rep=70) == 1.5
    assert asked == [(fn, dict(warmup=7, rep=70, grad_to_none=[t], return_mode="median"))]

    class FakeStream:
        def wait_stream(self, other):
            pass

    class FakeGraph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: contextlib.nullcontext())
    asked.clear()
    t.grad = torch.ones(2)
    assert core.time_ms(fn, grad_to_none=[t], warmup=7, rep=70, cuda_graph=True) == 1.5
    assert calls == [None] * 4 and t.grad is None  # 3 warm-up calls and the capture, each on fresh gradients
    (replay, kw), = asked
    assert replay.__name__ == "replay" and kw == dict(warmup=7, rep=70, return_mode="median")


def test_peak_memory_is_what_one_call_adds_and_is_measured_on_cuda(monkeypatch):
    # a case with peak_memory on CUDA asks _time_pass for the peak and records it
    asked = []

    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        asked.append(peak)
        return 1.0, (123 if peak else None)

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    case = _round_case(1)
    case.peak_memory, case.cuda_graph = True, False
    recs = core.measure_case(case, torch.device("cuda"), ["fwd+bwd"])
    assert asked == [True] * 3 and [r["peak_bytes"] for r in recs] == [123] * 3
    # peak_extra_bytes: the peak during the call (reset before it) less what was allocated before it
    mem = {"now": 1000, "peak": 9000}

    def reset(device=None):
        mem["peak"] = mem["now"]

    def call():
        mem["now"] += 80
        mem["peak"] = max(mem["peak"], mem["now"])
        mem["now"] -= 30

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    assert core.peak_extra_bytes(call, torch.device("cuda")) == 80


def test_a_case_without_cuda_graph_is_timed_only_with_plain_launches(monkeypatch):
    graphs = []
    monkeypatch.setattr(core, "_time_pass", lambda case, impl, pas, device, peak=False, cuda_graph=False:
                        (graphs.append(cuda_graph), (2.0, None))[1])
    case = _round_case(1)
    case.cuda_graph = False
    recs = core.measure_case(case, torch.device("cuda"), ["fwd+bwd"])
    assert graphs == [False] * 3 and all("timer" not in r and "ms_eager" not in r and r["ms"] == 2.0 for r in recs)


def test_the_forward_pass_is_timed_without_autograd(monkeypatch):
    # "fwd": inputs that need no gradient, under no_grad (no graph kept); "fwd+bwd": inputs that need one
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 1.0)[1])
    seen = []

    def fn(t):
        seen.append((t.requires_grad, torch.is_grad_enabled()))
        return 2 * t

    x = torch.randn(4, 8)
    case = core.BenchCase("bias_gelu", (4, 8), torch.float32, lambda d, rg: (x.clone().requires_grad_(rg),),
                          {"fwd": 64, "fwd+bwd": 160}, [core.Impl("fusedlib", fn)], cuda_graph=False)
    core.measure_case(case, torch.device("cpu"), ["fwd"])
    assert seen and set(seen) == {(False, False)}
    seen.clear()
    core.measure_case(case, torch.device("cpu"), ["fwd+bwd"])
    assert seen and set(seen) == {(True, True)}


# ---------------------------------------------------------------------------------------------
# The op cases: every implementation computes what fusedlib computes, dropout on in each, the
# documented byte and FLOP counts (a baseline that computes something else, or a count that is
# wrong, makes a wrong record that no timing shows)
# ---------------------------------------------------------------------------------------------

#: ops whose every implementation runs on the tests' device, a CPU too (fusedlib's kernels in
#: Triton's interpreter there; on a GPU machine they are compiled for CUDA and take CUDA tensors)
CPU_OPS = ["bias_gelu", "bias_dropout_add", "bias_dropout_add_norm", "geglu", "swiglu", "weighted_swiglu",
           "layer_norm", "rms_norm", "causal_softmax", "masked_softmax", "softmax_one", "softmax_dropout",
           "cross_entropy", "rope", "fused_dense"]
#: dropout ops: module with PROB, and how to find the dropped elements of an output
DROPOUT_OPS = ["bias_dropout_add", "bias_dropout_add_norm", "softmax_dropout"]


def _identity_compile(monkeypatch):
    """torch.compile returns the function: the compiled baseline runs what it would compile; and
    megatron-core's functions, which need a GPU, are stand-ins with megatron-core's signatures
    computing fusedlib.unfused's reference, that check that they get the case's own tensors (or
    views of them), not copies or casts. Returns the megatron-core softmax's constructor kwargs."""
    import torch.nn.functional as F

    from fusedlib.bench.ops import OP_MODULES, _glu, _softmax_common, get_op_module
    from fusedlib.fusions.fused_softmax import FusedScaleMaskSoftmax, attention_mask_func
    from fusedlib.transformer.enums import AttnMaskType

    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, backend=None, **kw: fn)
    given, softmax_kwargs = [], []

    def own(*tensors):
        for t in tensors:  # a case input or a view of one, in its dtype
            assert any(t.data_ptr() == g.data_ptr() and t.dtype == g.dtype for g in given), "a copy or a cast"

    class Softmax(FusedScaleMaskSoftmax):
        def __init__(self, *args, **kwargs):
            softmax_kwargs.append(kwargs)
            super().__init__(*args, **{**kwargs, "input_in_bf16": False})  # float32 cases too

        def forward(self, x, mask, softmax_offset=None):
            own(x, *(t for t in (mask, softmax_offset) if t is not None))
            return super().forward(x, mask, softmax_offset)

    def rope(t, freqs, config, cp_group=None):
        assert config.apply_rope_fusion is False and cp_group.size() == 1
        own(t, freqs)
        return unfused.apply_rotary_pos_emb_bshd(t, freqs)

    fakes = {
        "bias_gelu_impl": lambda y, b: own(y, b) or unfused.bias_gelu(b, y),
        "bias_dropout_add_fused_train": lambda xb, r, p: own(*xb, r) or unfused.bias_dropout_add(xb, r, p, True),
        "bias_geglu_impl": lambda y, b: own(y) or b or unfused.geglu(y),
        "bias_swiglu_impl": lambda y, b: own(y) or b or unfused.swiglu(y),
        "weighted_bias_swiglu_impl": lambda y, b, w: own(y, w) or b or unfused.weighted_swiglu(y, w),
        "fused_vocab_parallel_cross_entropy": lambda x, t, g: own(x, t) or F.cross_entropy(x.float(), t, reduction="none"),
        "apply_rotary_pos_emb": rope, "FusedScaleMaskSoftmax": Softmax, "AttnMaskType": AttnMaskType,
        "attention_mask_func": attention_mask_func}

    def try_import(module, attr):
        if module.startswith("megatron.") and attr in fakes:
            return fakes[attr], ""
        return None, f"{module}.{attr} unavailable: a CPU test"

    for mod in [_glu, _softmax_common] + [get_op_module(op) for op in OP_MODULES]:
        if hasattr(mod, "try_import"):
            monkeypatch.setattr(mod, "try_import", try_import)
    from fusedlib.bench.ops import cross_entropy

    monkeypatch.setattr(cross_entropy, "_single_rank_group", lambda: None)
    return given, softmax_kwargs


def _run(case, impl, inputs, grads=None):
    """Outputs (a tuple) and, with ``grads``, the input gradients of one fwd(+bwd) of ``impl``."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    out = impl.fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    if grads is None:
        return [o.detach() for o in outs], None
    torch.autograd.backward(case.backward_outputs(out), grads)
    return [o.detach() for o in outs], [t.grad.clone() for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def _headline(op, dtype, monkeypatch):
    """The op's headline case as ``cases()`` builds it, at a tiny shape (its DEFAULT_SHAPE patched)."""
    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import _glu, get_op_module, layer_norm

    # masked_softmax: two sequences, the second padded (the host shape's one sequence masks nothing)
    shape = (2, 2, 32, 32) if op == "masked_softmax" else HOST_SHAPES[op]
    for mod in (get_op_module(op), _glu, layer_norm):
        monkeypatch.setattr(mod, "DEFAULT_SHAPE", shape)
    case = get_cases(op)(DEVICE, dtype=dtype)[0]
    assert case.shape == shape
    return case


@pytest.mark.parametrize("op", CPU_OPS)
def test_every_implementation_computes_what_fusedlib_computes(op, monkeypatch):
    # float32 at the host shape, dropout probability 0 (dropout itself: the next test). Each
    # output element is a few float32 operations on order-1 values (u = 6e-8), each gradient a
    # sum of at most 256 such products: implementations differ by a few ulps (observed <= 8e-6);
    # 5e-5 / 1e-4 leave that margin, while a wrong formula (erf GeLU for tanh, no scale, no bias,
    # no mask, a sum for a mean, the other GLU) moves elements by 1e-4 or (mostly) far more
    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import get_case, get_op_module

    given, softmax_kwargs = _identity_compile(monkeypatch)
    mod = get_op_module(op)
    if hasattr(mod, "PROB"):
        monkeypatch.setattr(mod, "PROB", 0.0)
    case = _headline(op, torch.float32, monkeypatch)
    inputs = case.make_inputs(DEVICE, True)
    given[:] = [t for t in inputs if isinstance(t, torch.Tensor)]
    if op not in ("bias_dropout_add_norm", "fused_dense", "layer_norm", "rms_norm"):  # (norms: Apex's, as "apex")
        assert "megatron-core" in [i.name for i in case.impls], case.skipped
    if "softmax" in op:  # megatron-core's FusedScaleMaskSoftmax as Megatron builds it, its fusion on
        assert softmax_kwargs == [dict(input_in_fp16=False, input_in_bf16=True, attn_mask_type=softmax_kwargs[0][
            "attn_mask_type"], scaled_masked_softmax_fusion=True, mask_func=softmax_kwargs[0]["mask_func"],
            softmax_in_fp32=True, scale=mod.SCALE)]
    first, _ = _run(case, case.impls[0], inputs)
    grads = [torch.randn(o.shape, device=DEVICE) for o in case.backward_outputs(tuple(first) if len(first) > 1 else first[0])]
    want, want_grads = _run(case, case.impls[0], inputs, grads)
    assert case.impls[0].name == "fusedlib" and len(case.impls) >= 3
    for impl in case.impls[1:]:
        got, got_grads = _run(case, impl, inputs, grads)
        assert len(got) == len(want), impl.name
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5, msg=f"{op} {impl.name}")
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5, msg=f"{op} {impl.name} gradient")
    # bf16: every implementation returns the case's dtype (no baseline computes in another),
    # but cross entropy's, whose mean loss is float32 in fusedlib and megatron-core (float32 losses
    # per token) and the logits' dtype in F.cross_entropy
    case = get_case(op)(HOST_SHAPES[op], torch.bfloat16)
    inputs = case.make_inputs(DEVICE, False)
    given[:] = [t for t in inputs if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        dtypes = {impl.name: _run(case, impl, inputs)[0][0].dtype for impl in case.impls}
    if op == "cross_entropy":
        assert dtypes.pop("fusedlib") == dtypes.pop("megatron-core") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_every_implementation_of_a_dropout_op_drops_at_the_op_probability(op, monkeypatch):
    # training mode at p = PROB = 0.1 in fusedlib and every baseline: the dropped elements are
    # those equal to the residual (bias-dropout-add, h of bias-dropout-add-norm) or zero inside
    # the causal band (softmax-dropout). n = 8192 (2112 for the band) Bernoulli(0.1) draws: the
    # fraction's standard deviation is 0.0033 (0.0065); 0.1 +- 0.04 is over 6 of them, and p = 0
    # (dropout off) is far outside
    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import get_case, get_op_module

    given, _ = _identity_compile(monkeypatch)
    mod = get_op_module(op)
    assert mod.PROB == 0.1
    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    inputs = case.make_inputs(DEVICE, True)
    given[:] = [t for t in inputs if isinstance(t, torch.Tensor)]
    for impl in case.impls:
        out, _ = _run(case, impl, inputs)
        if op == "softmax_dropout":
            sq, sk = out[0].shape[-2:]
            band = ~unfused.causal_mask(sq, sk).to(DEVICE).expand(out[0].shape)
            dropped = (out[0][band] == 0).double().mean()
        else:
            h = out[-1]  # bias-dropout-add's output, or h of bias-dropout-add-norm's (y, h)
            dropped = (h == inputs[2].detach()).double().mean()
        assert abs(float(dropped) - 0.1) < 0.04, f"{op} {impl.name}: dropped {float(dropped):.3f}"


def _documented_bytes(op, shape, e):
    """The fewest bytes of each op's module docstrings, ``e`` bytes an element: (fwd, bwd)."""
    if op in ("causal_softmax", "softmax_one", "softmax_dropout"):
        ab, sq, sk = (shape[0], *shape[1:]) if op == "causal_softmax" else (shape[0] * shape[1], *shape[2:])
        kept, full = ab * sum(min(sk, q + 1 + sk - sq) for q in range(sq)), ab * sq * sk
        sink = (4 * shape[1], 4 * shape[1]) if op == "softmax_one" else (0, 0)
        return (kept + full) * e + sink[0], (2 * kept + full) * e + sink[1]
    if op == "masked_softmax":
        b, np_, sq, sk = shape
        n = b * np_ * sq * sk
        return 2 * n * e + b * sq * sk, 3 * n * e  # the bool mask [b, 1, sq, sk] read once
    if op == "rope":
        s, b, np_, d = shape
        n = s * b * np_ * d
        return 2 * n * e + 4 * s * d, 2 * n * e + 4 * s * d  # float32 angles [s, 1, 1, d] in each pass
    if op == "cross_entropy":
        r, v = shape
        return r * v * e + 12 * r, 2 * r * v * e + 12 * r  # int64 targets, float32 loss / its gradient
    rows, w = shape
    if op in ("geglu", "swiglu", "weighted_swiglu"):
        n = rows * w // 2
        wb = (4 * rows, 8 * rows) if op == "weighted_swiglu" else (0, 0)  # float32 router weights [rows, 1]
        return 3 * n * e + wb[0], 5 * n * e + wb[1]
    n, h = rows * w, w
    return {"bias_gelu": ((2 * n + h) * e, (3 * n + 2 * h) * e),
            "bias_dropout_add": ((3 * n + h) * e, (2 * n + h) * e),
            "bias_dropout_add_norm": ((4 * n + 3 * h) * e, (5 * n + 3 * h) * e),
            "layer_norm": ((2 * n + 2 * h) * e, (3 * n + 3 * h) * e),
            "rms_norm": ((2 * n + h) * e, (3 * n + 2 * h) * e)}[op]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_case_counts_the_documented_bytes(dtype, monkeypatch):
    # every case, the headline and the sweep shapes, at both dtypes: the bytes the records' GB/s
    # divide are the docstrings' fewest bytes (each input read once, each output written once)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, backend=None, **kw: fn)
    e = torch.finfo(dtype).bits // 8
    for op in OP_MODULES:
        if op in ("fused_dense", "attention", "transformer_layer"):
            continue  # FLOPs or tokens, not bytes
        for case in get_cases(op)(torch.device("cpu"), sweep=True, dtype=dtype):
            fwd, bwd = _documented_bytes(op, case.shape, e)
            assert case.bytes == {"fwd": fwd, "fwd+bwd": fwd + bwd}, (op, case.shape)
            # both outputs of bias-dropout-add-norm feed the model: the backward takes a gradient of each
            assert case.all_outputs is (op == "bias_dropout_add_norm"), op


def test_the_sweeps_keep_their_documented_element_counts(monkeypatch):
    # the sweep shapes are labelled [rows, h] (GLUs [rows, 2h]) at a constant element count (rounded down)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, backend=None, **kw: fn)
    want = {"bias_gelu": (1 << 27, "SWEEP_H", 1), "bias_dropout_add": (1 << 27, "SWEEP_H", 1),
            "layer_norm": (1 << 27, "SWEEP_H", 1), "rms_norm": (1 << 27, "SWEEP_H", 1),
            "geglu": (1 << 28, "SWEEP_H", 2), "swiglu": (1 << 28, "SWEEP_H", 2), "weighted_swiglu": (1 << 28, "SWEEP_H", 2)}
    for op, (elements, sweep, width) in want.items():
        from fusedlib.bench.ops import get_op_module

        hs = getattr(get_op_module(op), sweep)
        cases = get_cases(op)(torch.device("cpu"), sweep=True)
        for case in cases:
            rows, w = case.shape
            assert rows == elements // w, (op, case.shape)  # 2^27 / 768 rounds down
        assert {c.shape[1] for c in cases[1:]} <= {width * h for h in hs}, op


def test_the_mlp_flops_are_what_torch_counts():
    # fused_dense records TFLOP/s from mlp_flops: the forward's two GEMMs, and the backward's four
    from torch.utils.flop_counter import FlopCounterMode

    from fusedlib.bench.ops import fused_dense as fd

    m, h, f = 6, 10, 14
    x, w1, b1, w2 = (torch.randn(*s, requires_grad=True) for s in ((m, h), (f, h), (f,), (h, f)))
    with FlopCounterMode(display=False) as fwd:
        y = fd._eager(x, w1, b1, w2)
    with FlopCounterMode(display=False) as bwd:
        y.backward(torch.randn_like(y))
    flops = fd.mlp_flops(m, h, f)
    assert fwd.get_total_flops() == flops["fwd"] == 4 * m * h * f
    assert fwd.get_total_flops() + bwd.get_total_flops() == flops["fwd+bwd"]
    case = fd.case((m, h, f), torch.float32)
    assert case.flops == flops and case.peak_memory and case.info["shape_names"] == ["M", "h", "F"]


def test_fused_dense_implementations_take_the_epilogue_their_names_say(monkeypatch):
    from fusedlib.bench.ops import fused_dense as fd

    seen = []
    monkeypatch.setattr(fd, "fused_dense_gelu_dense", lambda *a, **kw: seen.append(kw.get("epilogue")))
    case = fd.case((4, 8, 16), torch.float32)
    for impl in case.impls[:3]:
        impl.fn(None, None, None, None)
    assert [i.name for i in case.impls[:3]] == ["fusedlib", "fusedlib-epilogue", "fusedlib-kernel"]
    assert seen == [None, True, False]


def test_the_norms_apex_and_liger_baselines_are_called_as_their_fast_paths(monkeypatch):
    # Apex and Liger need a GPU: stand-ins record how the norm cases call them. Apex's LayerNorm
    # may take its persistent kernel (megatron-core's FusedLayerNorm choice); Liger's RMSNorm gets
    # in_place=False (its default writes dx into the gradient the harness reuses)
    from fusedlib.bench.ops import layer_norm as ln

    calls = []

    class LigerRMS:
        @staticmethod
        def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
            pass

        @staticmethod
        def apply(*args):
            calls.append(("liger", args))

    class LigerLN:
        @staticmethod
        def apply(*args):
            calls.append(("liger", args))

    fakes = {"LigerRMSNormFunction": LigerRMS, "LigerLayerNormFunction": LigerLN}
    monkeypatch.setattr(ln, "try_import", lambda module, attr: (fakes[attr], ""))
    monkeypatch.setattr(ln.apex_backend, "apex_available", lambda name=None: True)
    monkeypatch.setattr(ln.apex_backend, "apex_layer_norm", lambda *a, **kw: calls.append(("apex", a, kw)))
    monkeypatch.setattr(ln.apex_backend, "apex_rms_norm", lambda *a, **kw: calls.append(("apex", a, kw)))
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    impls = {i.name: i for i in ln.case((4, 8)).impls}
    impls["liger"].fn(x, w, b)
    impls["apex"].fn(x, w, b)
    assert calls == [("liger", (x, w, b, ln.EPS)), ("apex", (x, w, b, ln.EPS), {"persist": True})]
    calls.clear()
    impls = {i.name: i for i in ln.norm_case("rms_norm", (4, 8), torch.bfloat16, baselines=True).impls}
    impls["liger"].fn(x, w)
    impls["apex"].fn(x, w)
    assert calls == [("liger", (x, w, ln.EPS, 0.0, "llama", False)), ("apex", (x, w, ln.EPS), {})]


#: op -> the documented function its eager (and compiled) baseline hands the case's inputs to
BASELINE_CALLS = {
    "bias_gelu": (torch.nn.functional, "gelu"), "bias_dropout_add": (unfused, "bias_dropout_add"),
    "bias_dropout_add_norm": (unfused, "bias_dropout_add"), "geglu": (unfused, "geglu"),
    "swiglu": (unfused, "swiglu"), "weighted_swiglu": (unfused, "weighted_swiglu"),
    "layer_norm": (torch.nn.functional, "layer_norm"), "rms_norm": (torch.nn.functional, "rms_norm"),
    "causal_softmax": (unfused, "scale_mask_softmax"), "masked_softmax": (unfused, "scale_mask_softmax"),
    "softmax_one": (unfused, "scale_mask_softmax"), "softmax_dropout": (unfused, "scale_mask_softmax_dropout"),
    "cross_entropy": (torch.nn.functional, "cross_entropy"), "rope": (unfused, "apply_rotary_pos_emb_bshd"),
    "fused_dense": (torch.nn.functional, "linear")}


@pytest.mark.parametrize("op", CPU_OPS)
def test_the_eager_and_compiled_baselines_take_the_inputs_as_given(op, monkeypatch):
    # bf16: the first call an eager or compiled baseline makes gets the case's tensors themselves
    # (bias-GeLU's y + b aside), or views of them: no copy, no cast to another dtype before it
    _identity_compile(monkeypatch)
    seen = []
    spied = [BASELINE_CALLS[op]] + ([(unfused, "bias_gelu")] if op == "bias_gelu" else [])  # torch.compile's
    for owner, name in spied:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **kw: seen.append(a + tuple(kw.values())) or real(*a, **kw))
    name = " or ".join(n for _, n in spied)
    case = _headline(op, torch.bfloat16, monkeypatch)
    inputs = [t for t in case.make_inputs(torch.device("cpu"), False) if isinstance(t, torch.Tensor)]
    for impl in case.impls:
        if impl.name not in ("eager", "torch.compile"):
            continue
        seen.clear()
        with torch.no_grad():
            impl.fn(*inputs)
        assert seen, f"{op} {impl.name} does not call {name}"
        args = [t for t in seen[0] if isinstance(t, torch.Tensor)]
        if op == "bias_gelu" and impl.name == "eager":
            args = args[1:]  # F.gelu(y + b): the sum is the op
        for t in args:
            assert any(t.data_ptr() == i.data_ptr() and t.dtype == i.dtype for i in inputs), \
                f"{op} {impl.name}: {name} got a copy or a cast ({t.dtype}, {tuple(t.shape)})"


def test_run_op_puts_the_copy_record_of_the_run_first(monkeypatch):
    import fusedlib.bench as bench
    from fusedlib.bench.ops.baselines import try_import

    copy = core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)
    monkeypatch.setattr(bench, "measure_case", lambda case, device, progress=None: [{"op": case.op}])
    records, skipped = bench.run_op("bias_gelu", device="cpu", copy=copy)
    assert records[0] is copy and records[1:] == [{"op": "bias_gelu"}]
    # the skipped implementations come back too: megatron-core's where it does not import (a
    # CPU-only machine; the GPU machine's staged wheel imports)
    mcore, _ = try_import("megatron.core.fusions.fused_bias_gelu", "bias_gelu_impl")
    assert set(skipped) == (set() if mcore is not None else {"megatron-core"})


def test_the_backward_gets_a_random_upstream_gradient(monkeypatch):
    # not ones: Liger's cross entropy skips its gradient scaling when grad_output == 1, which
    # would time less work for it than for the others
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 1.0)[1])
    seen = []

    def op(t):
        out = 2 * t
        out.register_hook(lambda g: seen.append(g.clone()))
        return out

    case = core.BenchCase("bias_gelu", (4, 8), torch.float32, lambda d, rg: (torch.randn(4, 8, requires_grad=rg),),
                          {"fwd": 1, "fwd+bwd": 1}, [core.Impl("fusedlib", op)])
    core._time_pass(case, case.impls[0], "fwd+bwd", torch.device("cpu"))
    assert seen and all(g.std() > 0.5 for g in seen) and torch.equal(seen[0], seen[-1])


def test_megatron_s_softmax_dropout_drops_its_softmax_output_as_returned(monkeypatch):
    # megatron-core's softmax-dropout baseline is its FusedScaleMaskSoftmax, then torch's dropout
    # on that output itself (bf16, no cast around it): a float32 dropout with casts either side
    # would time two more passes over the [b, np, sq, sk] scores than Megatron runs
    import torch.nn.functional as F

    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import get_case

    given, _ = _identity_compile(monkeypatch)
    returned, dropped = [], []
    real_dropout = F.dropout
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, *a, **kw: dropped.append((x, p)) or real_dropout(x, p, *a, **kw))
    case = get_case("softmax_dropout")(HOST_SHAPES["softmax_dropout"], torch.bfloat16)
    mcore = {i.name: i for i in case.impls}["megatron-core"]
    inputs = case.make_inputs(DEVICE, False)
    given[:] = [t for t in inputs if isinstance(t, torch.Tensor)]
    from fusedlib.fusions.fused_softmax import FusedScaleMaskSoftmax

    real_forward = FusedScaleMaskSoftmax.forward
    monkeypatch.setattr(FusedScaleMaskSoftmax, "forward",
                        lambda self, *a, **kw: returned.append(real_forward(self, *a, **kw)) or returned[-1])
    with torch.no_grad():
        out = mcore.fn(*inputs)
    (softmax_out,) = returned
    ((x, p),) = dropped
    assert x is softmax_out and x.dtype == torch.bfloat16 and p == 0.1 and out.dtype == torch.bfloat16


@pytest.mark.parametrize("op", ["geglu", "swiglu"])
def test_liger_s_glu_gets_the_case_s_own_halves(op, monkeypatch):
    # Liger's GLU takes the two halves as two tensors: the case makes them contiguous once, in
    # make_inputs, so the timed call gets those tensors themselves (no copy, no transpose, no cast)
    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import _glu, get_case, get_op_module

    seen = []

    class Liger:
        @staticmethod
        def apply(a, b):
            seen.append((a, b))
            return a * b

    assert get_op_module(op).LIGER[0].startswith("liger_kernel.")
    monkeypatch.setattr(_glu, "try_import", lambda module, attr: (Liger, "") if module.startswith("liger_kernel.")
                        else (None, "a CPU test"))
    case = get_case(op)(HOST_SHAPES[op], torch.bfloat16)
    inputs = case.make_inputs(torch.device("cpu"), False)
    assert len(inputs) == 3 and all(t.is_contiguous() for t in inputs[1:])
    {i.name: i for i in case.impls}["liger"].fn(*inputs)
    ((a, b),) = seen
    assert a is inputs[1] and b is inputs[2]


def test_apex_s_causal_softmax_gets_the_case_s_scores_and_scale(monkeypatch):
    from fusedlib.bench.host import HOST_SHAPES
    from fusedlib.bench.ops import _softmax_common, causal_softmax

    seen = []
    monkeypatch.setattr(causal_softmax, "apex_causal", lambda: (lambda x, scale: seen.append((x, scale)) or x, ""))
    case = causal_softmax.case(HOST_SHAPES["causal_softmax"], torch.bfloat16)
    inputs = case.make_inputs(torch.device("cpu"), False)
    {i.name: i for i in case.impls}["apex"].fn(*inputs)
    ((x, scale),) = seen
    assert x is inputs[0] and scale == _softmax_common.SCALE


# ---------------------------------------------------------------------------------------------
# The book helpers: check's relative tolerance, the records' folder outside chapters/, a live
# sweep, the tables' default shape, row order and edge cases, the sweep's axes
# ---------------------------------------------------------------------------------------------


def test_check_scales_the_relative_tolerance_by_the_reference():
    # atol + rtol·|expected|: 1.5 against 1.0 is off by 0.5 > 0.4·1.0 = 0.4, and 1.0 against 1.5
    # is off by 0.5 <= 0.4·1.5 = 0.6 (both far from the boundary); scaling by |actual| instead
    # swaps the two verdicts
    assert check("x", torch.tensor([1.5]), torch.tensor([1.0]), atol=0.0, rtol=0.4) is False
    assert check("x", torch.tensor([1.0]), torch.tensor([1.5]), atol=0.0, rtol=0.4) is True


def test_bench_dir_is_the_checkouts_chapters_data_bench_from_anywhere_else(tmp_path, monkeypatch):
    # a notebook run outside chapters/ (no data/bench under the working directory) reads the
    # records of the source checkout: <root>/chapters/data/bench, root the folder above fusedlib/
    from pathlib import Path

    import fusedlib
    from fusedlib.book import bench_dir

    monkeypatch.chdir(tmp_path)
    root = Path(fusedlib.__file__).resolve().parents[1]
    assert bench_dir() == root / "chapters" / "data" / "bench"
    assert (bench_dir() / "bias_gelu.json").is_file()


def test_a_live_measurement_measures_the_sweep_only_when_asked(monkeypatch, capsys):
    import fusedlib.bench as bench
    import fusedlib.book as book

    asked = []
    monkeypatch.setattr(book, "measure_live", lambda: True)
    monkeypatch.setattr(bench, "run_op", lambda op, sweep=False: (asked.append((op, sweep)) or
                                                                   ([{"device": "Some GPU", "impl": "copy"}], {})))
    book.bench_or_stored("bias_gelu", sweep=True)
    book.bench_or_stored("layer_norm")
    assert asked == [("bias_gelu", True), ("layer_norm", False)]


def test_speedup_table_defaults_to_the_shape_of_the_first_fusedlib_record():
    recs = _records()
    small = [dict(r, shape=[1024, 1024]) for r in recs[1:]]
    assert speedup_table(recs + small).splitlines()[0].startswith("shape [8192, 16384] ")
    assert speedup_table(recs[:1] + small + recs[1:]).splitlines()[0].startswith("shape [1024, 1024] ")


def test_tables_read_ms_and_pass_only_at_their_shape():
    # a record at another shape without the fields a table reads (a sweep point left unfinished)
    # is not the table's business: the table at the headline shape is the same as without it
    recs = _records()
    partial = {k: v for k, v in recs[1].items() if k not in ("ms", "pass", "dtype")}
    partial["shape"] = [1024, 1024]
    assert speedup_table(recs + [partial]) == speedup_table(recs)
    assert backward_table(recs + [partial]) == backward_table(recs)


def test_speedup_table_lists_each_pass_together_in_the_books_order():
    lines = speedup_table(_records()).splitlines()[2:]
    assert [line.split()[:2] for line in lines] == [["fwd", "torch.compile"], ["fwd", "fusedlib"],
                                                    ["fwd+bwd", "torch.compile"], ["fwd+bwd", "fusedlib"]]


def test_backward_table_of_a_backward_that_took_no_time_says_inf():
    # fwd+bwd timed as fast as fwd (timing noise on a tiny op): bwd ms 0, its GB/s unbounded
    recs = _records()
    recs[4]["ms"] = recs[2]["ms"]  # torch.compile's fwd+bwd, its fwd
    line = next(line for line in backward_table(recs).splitlines() if line.startswith("torch.compile"))
    assert line.split()[3:] == ["0.0000", "inf", "inf"]


def test_sweep_table_shows_a_swept_implementation_outside_the_books_order_last():
    extra = [dict(r, impl="triton-ref") for r in _sweep_records() if r["impl"] == "fusedlib"]
    table = sweep_table(_sweep_records() + extra).splitlines()
    assert table[2].split() == ["shape", "compile", "fusedlib", "triton-ref", "compile", "fusedlib", "triton-ref"]


def test_plot_sweep_s_y_axis_holds_a_point_above_the_copy_ceiling():
    # a width whose data stays in L2 may beat the DRAM copy ceiling (4295 GB/s here): its point
    # must stay on the panels, which share their y axis
    import matplotlib

    matplotlib.use("Agg")
    recs = _sweep_records()
    assert (recs[1]["impl"], recs[1]["pass"], recs[1]["shape"][1]) == ("fusedlib", "fwd", 1024)
    recs[1] = dict(recs[1], GBps=6000.0)
    fig = plot_sweep(recs, "bias + GeLU")
    assert all(ax.get_ylim()[1] > 6000.0 for ax in fig.axes)
