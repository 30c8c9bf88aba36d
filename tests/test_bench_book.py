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


def _round_case(plain_rounds, tokens=None, nbytes=None):
    impls = [core.Impl(n, lambda t: t) for n in ("a", "b", "c")]
    return core.BenchCase("bias_gelu", (4, 8), torch.float32, lambda d, rg: (), {"fwd+bwd": nbytes}, impls,
                          tokens=tokens, plain_rounds=plain_rounds)


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
def test_a_failed_capture_leaves_random_numbers_working():
    # a baseline that syncs the host cannot be captured; the harness must leave the process's CUDA
    # generators usable for every later case (they stayed in capture mode, and every later
    # random draw failed, before the reset)
    from fusedlib.bench import core as bench_core

    x = torch.ones(64, device="cuda")
    with pytest.raises(RuntimeError):
        bench_core.time_ms(lambda: x.sum().item(), warmup=1, rep=1, cuda_graph=True)
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
