"""The transformer block's training-step benchmark (``fusedlib.bench.ops.transformer_layer``) on a
CPU: the case builds lazily at tiny odd sizes and every implementation that runs here returns
finite outputs and gradients; its records (no byte count, token counts), its tables, its profile
summary, the CLI's hooks, and the harness and book helpers that must tolerate records without bytes.
"""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fusedlib.bench import __main__ as cli
from fusedlib.bench import core
from fusedlib.bench import host as host_mod
from fusedlib.bench.ops import get_op_module
from fusedlib.bench.ops import transformer_layer as tl
from fusedlib.book import backward_table, plot_bandwidth, plot_throughput, speedup_table, sweep_table, throughput_table

from conftest import DEVICE, megatron_why_not  # noqa: I001

#: [s, b, h, heads, ffn, layers]: odd sequence and ffn, heads of 6 channels, 2 layers
TINY = (7, 2, 24, 4, 20, 2)
#: what runs without megatron-core (it needs CUDA and Python >= 3.12)
LOCAL_IMPLS = ["fusedlib-unfused", "fusedlib", "fusedlib-sdpa", "fusedlib-flash", "fusedlib-fused-layer",
               "fusedlib-fused-layer-local", "fusedlib-fused-layer-sdpa", "eager", "torch.compile"]


def _cpu_case(dtype=torch.float32):
    # the compiled block is traced by Dynamo but run by its "eager" backend: Inductor's CPU
    # compile would take a minute; the GPU run uses Inductor
    return tl.case(TINY, dtype, compile_backend="eager")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_implementation_builds_lazily_and_gives_finite_outputs_and_gradients(dtype):
    c = _cpu_case(dtype)
    names = [i.name for i in c.impls]
    assert [n for n in names if n in LOCAL_IMPLS] == LOCAL_IMPLS and names[-1] == "torch.compile"
    assert set(names) | set(c.skipped) == set(tl.IMPLS)
    graphs = [n for n in names if n in tl.GRAPH_IMPLS]
    assert graphs == (list(tl.GRAPH_IMPLS) if DEVICE.type == "cuda" else []), "the graphed blocks run on CUDA only"
    assert all(i.passes == ("fwd+bwd",) and i.params() == [] for i in c.impls), "nothing built before a call"
    assert c.bytes == {"fwd+bwd": None} and c.tokens == TINY[0] * TINY[1] and c.peak_memory and c.cuda_graph
    (x,) = c.make_inputs(DEVICE, True)
    x_before = x.detach().clone()
    g = torch.randn(x.shape, device=DEVICE, dtype=torch.float32).to(dtype)
    for impl in c.impls:
        x.grad = None
        y = impl.fn(x)
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all(), impl.name
        y.backward(g)
        params = impl.params()
        assert sum(p.numel() for p in params) == tl.param_count(TINY), impl.name
        assert all(p.dtype == dtype and p.device.type == DEVICE.type for p in params), impl.name
        assert torch.isfinite(x.grad).all() and all(p.grad is not None and torch.isfinite(p.grad).all()
                                                    for p in params), impl.name
        assert torch.equal(x.detach(), x_before), f"{impl.name} modified its input"


def test_the_step_trains_with_dropout():
    # dropout as configured (0.1 and 0.1, training mode): two steps on the same input differ
    c = _cpu_case()
    (x,) = c.make_inputs(DEVICE, False)
    for impl in c.impls:
        with torch.no_grad():
            a, b = impl.fn(x), impl.fn(x)
        assert not torch.equal(a, b), f"{impl.name}: no dropout in the step"
    assert tl.fusedlib_block(TINY, True).config.hidden_dropout == tl.HIDDEN_DROPOUT == 0.1
    assert tl.fusedlib_block(TINY, True).config.attention_dropout == tl.ATTENTION_DROPOUT == 0.1


def test_the_three_fusedlib_blocks_have_the_documented_switches():
    unfused = tl.fusedlib_block(TINY, False)
    fused = tl.fusedlib_block(TINY, True)
    sdpa = tl.fusedlib_block(TINY, True, tl.AttnBackend.auto)
    flash = tl.fusedlib_block(TINY, True, tl.AttnBackend.flash)
    for name in tl.FUSIONS_ON:
        assert getattr(fused.config, name) and getattr(sdpa.config, name) and getattr(flash.config, name), name
        assert not getattr(unfused.config, name), name
    assert fused.config.attention_backend is tl.AttnBackend.local
    assert sdpa.config.attention_backend is tl.AttnBackend.auto
    assert flash.config.attention_backend is tl.AttnBackend.flash
    assert unfused.config.attention_backend is tl.AttnBackend.unfused
    assert type(unfused.layers[0].input_layernorm).__name__ == "LayerNorm"  # torch's
    assert type(fused.layers[0].input_layernorm).__name__ == "FusedLayerNorm"
    assert fused.training and len(fused.layers) == TINY[-1]
    one_node = tl.fusedlib_block(TINY, True, tl.AttnBackend.flash, fused_layer=True)
    assert [type(layer).__name__ for layer in one_node.layers] == ["FusedTransformerLayer"] * TINY[-1]
    assert {type(layer).__name__ for layer in flash.layers} == {"TransformerLayer"}
    assert one_node.state_dict().keys() == flash.state_dict().keys()
    local_node = tl.fusedlib_block(TINY, True, tl.AttnBackend.local, fused_layer=True)
    assert [type(layer).__name__ for layer in local_node.layers] == ["FusedTransformerLayer"] * TINY[-1]
    assert local_node.config.attention_backend is tl.AttnBackend.local
    with pytest.raises(ValueError, match="fused_layer"):
        tl.fusedlib_block(TINY, False, fused_layer=True)


def test_param_count_and_gemm_flops_against_the_built_blocks():
    # FLOPs of one fwd+bwd of the materialised block, counted by PyTorch's FlopCounterMode (every
    # matmul, baddbmm and bmm, forward and backward), equal the formula; the block is float32 on the
    # test device (CPU tensors cannot run fusedlib's kernels where they are compiled for a GPU)
    block = tl.fusedlib_block(TINY, False, dtype=torch.float32, device=DEVICE)
    assert sum(p.numel() for p in block.parameters()) == tl.param_count(TINY)
    x = torch.randn(TINY[0], TINY[1], TINY[2], device=DEVICE, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x, None).sum().backward()
    assert counter.get_total_flops() == tl.gemm_flops(TINY)


@pytest.mark.parametrize("shape, match", [((7, 2, 24, 5, 20, 2), "divisible by heads"),
                                          ((7, 2, 24, 4, 20), "six ints"), ((7, 0, 24, 4, 20, 2), "six ints"),
                                          ("abc", "of ints")])
def test_bad_shapes_are_named(shape, match):
    with pytest.raises(ValueError, match=f"shape.*{match}"):
        tl.case(shape)


def test_cases_are_the_two_headline_shapes_and_the_sweep_adds_the_small_stack():
    cs = tl.cases(torch.device("cpu"))
    assert [c.shape for c in cs] == [tl.DEFAULT_SHAPE, tl.GPT2_SMALL_SHAPE]
    assert [c.shape for c in tl.cases(torch.device("cpu"), sweep=True)] == [
        tl.DEFAULT_SHAPE, tl.GPT2_SMALL_SHAPE, tl.SMALL_SHAPE]
    assert tl.SMALL_SHAPE == (512, 8, 512, 8, 2048, 4)
    assert tl.DEFAULT_SHAPE == (2048, 4, 2048, 16, 8192, 4) and tl.GPT2_SMALL_SHAPE == (1024, 8, 768, 12, 3072, 6)
    assert all(c.dtype is torch.bfloat16 for c in cs)
    assert [i.name for i in cs[0].impls if i.name == "torch.compile"] == ["torch.compile"]
    assert cs[0].impls[-1].compile == "static"


# ------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------

def test_records_have_tokens_and_no_bytes(monkeypatch):
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None, **kw: (fn(), 2.0)[1])
    c = _cpu_case()
    assert c.plain_rounds == tl.PLAIN_ROUNDS > 1 and c.replay_rounds is True
    c.plain_rounds = 2  # the rounds themselves: tests/test_bench_book.py
    recs = core.measure_case(c, DEVICE)
    assert [r["impl"] for r in recs] == [i.name for i in c.impls]
    tokens = TINY[0] * TINY[1]
    for r in recs:
        assert r["ms_plain_rounds"] == [2.0, 2.0]
        assert r["op"] == "transformer_layer" and r["pass"] == "fwd+bwd" and r["shape"] == list(TINY)
        assert r["bytes"] is None and r["GBps"] is None
        assert r["tokens"] == tokens and r["tokens_per_s"] == round(tokens / 2e-3)
        assert r["shape_names"] == list(tl.SHAPE_NAMES) and r["params"] == tl.param_count(TINY)
        assert r["weight_bytes"] == 4 * tl.param_count(TINY)
        assert r["hidden_dropout"] == r["attention_dropout"] == 0.1
        assert r["attention"] in ("materialised", "sdpa", "flash") and isinstance(r["fusions"], list)
    by = {r["impl"]: r for r in recs}
    assert by["fusedlib"]["fusions"] == list(tl.FUSIONS_ON) and by["fusedlib-unfused"]["fusions"] == []
    assert by["fusedlib-sdpa"]["attention"] == "sdpa" and by["torch.compile"]["compile"] == "static"
    assert by["fusedlib-flash"]["attention"] == "flash"
    assert by["fusedlib-fused-layer"]["attention"] == "flash" and by["fusedlib-fused-layer"]["layer"] == "FusedTransformerLayer"
    local = by["fusedlib-fused-layer-local"]
    assert local["attention"] == "materialised" and local["layer"] == "FusedTransformerLayer"
    node_sdpa = by["fusedlib-fused-layer-sdpa"]
    assert node_sdpa["attention"] == "sdpa" and node_sdpa["layer"] == "FusedTransformerLayer"
    json.dumps(recs)  # plain JSON


def test_graph_records_get_plain_launch_tokens_and_the_tables_read_them(monkeypatch):
    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        if cuda_graph and impl.name == "eager":
            raise RuntimeError("operation not permitted when stream is capturing")
        ms = {"fusedlib": 20.0, "fusedlib-unfused": 40.0}.get(impl.name, 30.0)
        return (ms / 2 if cuda_graph else ms), (None if cuda_graph else 5 * 10**9)

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    c = _cpu_case()
    recs = core.measure_case(c, torch.device("cuda"))
    by = {r["impl"]: r for r in recs}
    tokens = TINY[0] * TINY[1]
    f = by["fusedlib"]
    assert (f["ms"], f["ms_eager"], f["timer"], f["peak_bytes"]) == (10.0, 20.0, "cuda_graph", 5 * 10**9)
    assert f["tokens_per_s"] == round(tokens / 10e-3) and f["tokens_per_s_eager"] == round(tokens / 20e-3)
    e = by["eager"]
    assert e["timer"] == "do_bench" and e["tokens_per_s"] == e["tokens_per_s_eager"] and "capturing" in e["graph_error"]

    copy = core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)
    text = throughput_table([copy] + recs)
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in tl.IMPLS}
    assert lines["fusedlib-unfused"].split()[-1] == "2.00x"  # 40 / 20 ms, plain launches
    assert lines["fusedlib"].split()[1:3] == ["20.00", "10.00"] and lines["fusedlib"].split()[-1] == "5.00"
    assert lines["eager"].split()[2] == "-" and "eager: no CUDA graph" in text
    # the columns line up under their headers whatever the names' lengths (the longest is 26)
    header = next(line for line in text.splitlines() if line.startswith("impl"))
    end = header.index("plain ms") + len("plain ms")
    assert max(map(len, lines)) > 23 and all(line[end - 5:end] == f"{by[n]['ms_eager']:.2f}"[-5:]
                                             for n, line in lines.items())
    # the harness's and the book's bandwidth tables show "-" for records without bytes
    summ = cli.summary([copy] + recs)
    row = next(line for line in summ.splitlines() if " fusedlib-unfused " in line)
    assert row.split()[-4:-2] == ["-", "-"]
    table = speedup_table([copy] + recs)
    assert "fusedlib-unfused" in table and "2.00x" in table  # 40 / 20 with plain launches
    assert len(backward_table([copy] + recs).splitlines()) == 2, "no fwd pass: only the header"
    assert sweep_table([copy] + recs, impls=("fusedlib",)).splitlines()[-1].split()[-1] == "-"
    with pytest.raises(ValueError, match="plot_throughput"):
        plot_bandwidth([copy] + recs, "block")


def test_params_gradients_are_reset_before_every_timed_step(monkeypatch):
    # the harness clears an implementation's parameter gradients like its inputs': two timed steps
    # give the one-step gradient, not twice it
    calls = []

    def fake_time_ms(fn, grad_to_none=None, **kw):
        for _ in range(2):
            for t in grad_to_none or []:
                t.grad = None
            fn()
        calls.append(list(grad_to_none or []))
        return 1.0

    monkeypatch.setattr(core, "time_ms", fake_time_ms)
    c = _cpu_case()
    impl = next(i for i in c.impls if i.name == "eager")
    core._time_pass(c, impl, "fwd+bwd", DEVICE)
    params = impl.params()
    assert len(calls[0]) == 1 + len(params), "the input and every parameter"
    assert all(any(t is p for t in calls[0]) for p in params)


# ------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------

def _fake_records():
    out = [core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)]
    for shape, tokens in ((tl.DEFAULT_SHAPE, 8192), (tl.GPT2_SMALL_SHAPE, 8192)):
        for impl, ms in (("fusedlib", 25.0), ("eager", 22.0), ("megatron-core", 50.0)):
            r = core._record("transformer_layer", "fwd+bwd", impl, shape, torch.bfloat16, ms / 2, None)
            r.update(timer="cuda_graph", ms_eager=ms, **core._token_fields(tokens, {"ms": ms / 2, "ms_eager": ms}))
            out.append(r)
    out[-1].update(timer="do_bench", ms=50.0, tokens_per_s=out[-1]["tokens_per_s_eager"])
    return out


def test_plot_throughput_draws_each_shape_from_zero_with_its_legend_below():
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_throughput(_fake_records())
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == 2
    for ax in axes:
        assert ax.get_xlim()[0] == 0
        assert [t.get_text() for t in ax.get_yticklabels()] == ["eager", "megatron-core", "fusedlib"]
    # 3 plain bars + 3 graph bars in the first panel; the second has no graph bar for megatron-core
    assert len(axes[0].patches) == 6 and len(axes[1].patches) == 5
    widths = sorted(round(p.get_width(), 3) for p in axes[0].patches)
    assert widths[-1] == round(8192 / 11e-3 / 1e3, 3)  # eager's graph replay: 11 ms
    box = fig.legends[0].get_window_extent()
    assert box.y0 >= 0 and not any(a.get_window_extent().overlaps(box) for a in axes)
    with pytest.raises(ValueError, match="tokens_per_s"):
        plot_throughput(_fake_records()[:1])


def test_plot_throughput_draws_records_timed_with_plain_launches_only():
    # records of a device without CUDA graphs have no timer and no tokens_per_s_eager: their
    # tokens_per_s is the plain-launch bar, and there is no graph bar
    import matplotlib

    matplotlib.use("Agg")
    recs = [_fake_records()[0]]
    for impl, ms in (("fusedlib", 25.0), ("eager", 22.0)):
        r = core._record("transformer_layer", "fwd+bwd", impl, tl.DEFAULT_SHAPE, torch.bfloat16, ms, None)
        r.update(core._token_fields(8192, r))
        assert "tokens_per_s_eager" not in r and "timer" not in r
        recs.append(r)
    (ax,) = plot_throughput(recs).axes
    assert sorted(round(p.get_width(), 6) for p in ax.patches) == \
        sorted(round(r["tokens_per_s"] / 1e3, 6) for r in recs[1:])


# ------------------------------------------------------------------------------------------
# The profile
# ------------------------------------------------------------------------------------------

def test_the_profile_covers_fusedlibs_blocks_and_the_goals_compiled_baseline():
    # the chapter sets fusedlib-sdpa's kernels against torch.compile's: both must be profiled by default, and
    # every name must be an implementation (profile() refuses unknown names, on the GPU after the whole sweep)
    assert set(tl.PROFILE_IMPLS) <= set(tl.IMPLS)
    assert {"fusedlib-unfused", "fusedlib", "fusedlib-sdpa", "fusedlib-flash", "torch.compile"} <= set(tl.PROFILE_IMPLS)
    assert inspect.signature(tl.profile).parameters["impls"].default == tl.PROFILE_IMPLS


def test_kernel_categories_and_summary():
    assert tl.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM"
    assert tl.kernel_category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "GEMM"
    assert tl.kernel_category("pytorch_flash::flash_fwd_kernel<...>") == "attention (SDPA)"
    assert tl.kernel_category("pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<...>") == "attention (SDPA)"
    assert tl.kernel_category("_flash_fwd_kernel") == tl.kernel_category("_flash_bwd_dq_kernel") == "attention (fusedlib flash)"
    assert tl.kernel_category("_softmax_fwd_kernel") == "softmax (+dropout)"
    assert tl.kernel_category("_norm_bwd_kernel") == "norm"
    assert tl.kernel_category("void at::native::vectorized_layer_norm_kernel<...>") == "norm"
    assert tl.kernel_category("_bias_dropout_add_fwd_kernel") == "elementwise & other"
    events = [("gemm_a", 300.0), ("gemm_a", 500.0), ("_softmax_fwd_kernel", 200.0), ("_bias_gelu_fwd_kernel", 100.0),
              ("_bias_gelu_fwd_kernel", 100.0), ("_norm_fwd_kernel", 400.0)]
    s = tl.kernel_summary(events, steps=2, top=2)
    assert s["kernel_ms"] == 0.8 and s["launches"] == 3.0
    assert s["categories"] == {"GEMM": 0.4, "norm": 0.2, "elementwise & other": 0.1, "softmax (+dropout)": 0.1}
    assert s["top"] == [{"name": "gemm_a", "category": "GEMM", "calls": 1.0, "ms": 0.4, "share": 0.5},
                        {"name": "_norm_fwd_kernel", "category": "norm", "calls": 0.5, "ms": 0.2, "share": 0.25}]
    with pytest.raises(ValueError, match="steps"):
        tl.kernel_summary(events, steps=0)
    timed = tl.kernel_summary(events, steps=2, top=2, span=(2000.0, 1500.0))
    assert timed["span_ms"] == 1.0 and timed["idle_ms"] == 0.25
    assert "first kernel to last 1.00 ms, no kernel running 0.25 ms" in tl.kernel_summary_lines("x", timed)[0]
    assert "span_ms" not in s and "first kernel" not in tl.kernel_summary_lines("x", s)[0]
    for bad in ((1000.0, 1500.0), (float("nan"), 0.0), (2000.0,), (100.0, -1.0), [2000.0, 1500.0], (True, 0)):
        with pytest.raises(ValueError, match="span must be"):
            tl.kernel_summary(events, steps=2, span=bad)
    for bad in (1.5, True, "2"):
        with pytest.raises(ValueError, match="steps must be an int"):
            tl.kernel_summary(events, steps=bad)


def test_device_span_counts_overlaps_once_and_gaps_as_idle():
    from types import SimpleNamespace as NS

    def ev(start, end, device="cuda", user=False):
        return NS(time_range=NS(start=start, end=end), device_type=device, is_user_annotation=user)

    # kernels [0, 10], [5, 12] (overlapping: busy 12), a gap, [20, 25] and [21, 23] inside it, [30, 40];
    # a CPU event and a user range outside them are not counted
    prof = NS(events=lambda: [ev(20, 25), ev(0, 10), ev(30, 40), ev(5, 12), ev(21, 23),
                              ev(-50, 100, device="cpu"), ev(-5, 45, user=True)])
    assert tl.device_span(prof, "cuda") == (40.0, 27.0)
    assert tl.device_span(NS(events=lambda: []), "cuda") == (0.0, 0.0)


def test_profile_runs_and_its_table_and_files(tmp_path, monkeypatch):
    # on the CPU the profiler records CPU operators instead of kernels: the plumbing, not the numbers
    # (on a GPU, its kernels)
    prof = tl.profile(DEVICE, TINY, impls=("fusedlib-unfused",), steps=1, warmup=1, dtype=torch.float32)
    assert list(prof["impls"]) == ["fusedlib-unfused"] and prof["skipped"] == {}
    p = prof["impls"]["fusedlib-unfused"]
    assert p["kernel_ms"] > 0 and p["top"] and abs(sum(p["categories"].values()) - p["kernel_ms"]) < 1e-2
    text = tl.profile_table(prof)
    assert "fusedlib-unfused:" in text and "top" in text
    with pytest.raises(ValueError, match="unknown"):
        tl.profile("cpu", TINY, impls=("nope",))
    # extra_files writes the profile where the chapter loads it from; load_profile: None when missing
    monkeypatch.setattr(tl, "profile", lambda device: prof)
    logged = []
    (path,) = tl.extra_files(torch.device("cpu"), tmp_path, log=logged.append)
    assert logged == [tl.profile_table(prof)]
    assert path == tmp_path / tl.PROFILE_FILE and tl.load_profile(path) == json.loads(json.dumps(prof))
    assert tl.load_profile(tmp_path / "missing.json") is None


def test_cli_prints_the_op_table_and_writes_its_extra_files(tmp_path, monkeypatch, capsys):
    recs = _fake_records()
    fake_case = core.BenchCase("transformer_layer", tl.DEFAULT_SHAPE, torch.bfloat16, lambda d, rg: (),
                               {"fwd+bwd": None}, [core.Impl("fusedlib", None, passes=("fwd+bwd",))])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "copy_record", lambda device: recs[0])
    monkeypatch.setattr(cli, "matmul_record", lambda device: {**recs[0], "TFLOPs": 700.0})
    monkeypatch.setattr(cli, "get_cases", lambda op: lambda device, sweep=False: [fake_case])
    monkeypatch.setattr(cli, "measure_case", lambda case, device, progress=None: recs[1:])
    written = []
    monkeypatch.setattr(tl, "extra_files", lambda device, out, log: written.append(out) or [tmp_path / "p.json"])
    assert cli.main(["--op", "transformer_layer", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "fusedlib is" in out.out + out.err and written == [str(tmp_path)]
    assert json.loads((tmp_path / "transformer_layer.json").read_text())[1]["tokens"] == 8192
    assert hasattr(get_op_module("transformer_layer"), "table")


def test_host_mode_has_a_tiny_block():
    shape = host_mod.HOST_SHAPES["transformer_layer"]
    assert len(shape) == 6 and shape[-1] == 4
    c = tl.case(shape)
    assert set(host_mod.HOST_IMPLS) <= {i.name for i in c.impls}


# ------------------------------------------------------------------------------------------
# count_calls, the chapter's dispatch counter
# ------------------------------------------------------------------------------------------

def test_count_calls_counts_and_restores_module_functions_and_inherited_classmethods():
    import types

    from fusedlib.book import count_calls

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    mod = types.SimpleNamespace(f=lambda x: x + 1)
    original_f, original_apply = mod.f, Double.apply
    x = torch.ones(3)
    with count_calls({"f": (mod, "f"), "double": (Double, "apply")}) as counts:
        assert torch.equal(mod.f(Double.apply(x)), torch.full((3,), 3.0))
        mod.f(x)
    assert counts == {"f": 2, "double": 1}
    assert mod.f is original_f and "apply" not in vars(Double) and Double.apply == original_apply
    with pytest.raises(RuntimeError):
        with count_calls({"f": (mod, "f")}):
            raise RuntimeError("inside")
    assert mod.f is original_f, "restored after an error"
    with pytest.raises(AttributeError):
        with count_calls({"f": (mod, "f"), "g": (mod, "no_such_name")}):
            pass
    assert mod.f is original_f


def test_the_compiled_block_compiles_one_layer_graph_per_shape():
    # the layers are identical: Dynamo traces one layer's forward and reuses it for the other three;
    # a second shape gets its own static graph (a recording backend stands in for Inductor)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    try:
        for s in (7, 9):
            shape = (s, 2, 24, 4, 20, 4)
            comp = tl.case(shape, torch.float32, compile_backend=backend).impls[-1]
            assert comp.name == "torch.compile" and comp.info["compile_scope"] == "layer"
            (x,) = tl.case(shape, torch.float32).make_inputs(DEVICE, True)
            for _ in range(2):
                comp.fn(x).sum().backward()
        assert len(graphs) == 2, f"{len(graphs)} graphs for 2 shapes of 4 layers"
        assert all(isinstance(d, int) for ex in graphs for t in ex if isinstance(t, torch.Tensor) for d in t.shape)
    finally:
        torch._dynamo.reset()


def test_power_state_needs_cuda_and_its_table_reads_a_stored_state(tmp_path):
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="device must be CUDA"):
            tl.power_state("cpu", TINY)
    state = {"device": "NVIDIA H200", "shape": list(TINY), "dtype": "bfloat16",
             "sampler": {"fields": None, "error": "nvidia-smi not found"}, "skipped": {"torch.compile": "boom"},
             "phases": [
                 {"impl": "fusedlib-sdpa", "round": 0, "timer": "do_bench", "window_ms": 200, "ms": 19.52,
                  "samples": 17, "sm_mhz": 1680.0, "power_w": 593.9, "reasons": {"power cap": 0.8}},
                 {"impl": "fusedlib-sdpa", "round": 0, "timer": "do_bench", "window_ms": 3000, "ms": 19.81,
                  "samples": 0},
                 {"impl": "fusedlib-sdpa", "timer": "profile", "steps": 3, "kernel_ms": 17.92, "span_ms": 19.1,
                  "samples": 38, "sm_mhz": 1965.0, "power_w": 215.1, "reasons": {}}]}
    text = tl.power_table(state).splitlines()
    assert "no clock samples: nvidia-smi not found" in text[1] and "medians" in text[2]
    assert text[4].split()[-6:] == ["19.52", "1680", "594", "power", "cap", "80%"]
    assert text[5].split()[-3:] == ["19.81", "-", "-"]
    assert text[6].split()[-3:] == ["17.92", "1965", "215"] and "profile, 3 steps" in text[6]
    assert text[7] == "  torch.compile: not timed: boom"
    state2 = dict(state, sampler={"fields": ["timestamp"], "error": None, "interval_ms": 20, "power_limit_w": 700.0,
                                  "sm_max_mhz": 1980.0}, skipped={})
    assert tl.power_table(state2).splitlines()[1] == ("  the board's power limit 700 W, its top SM clock 1980 MHz; "
                                                      "a sample every 20 ms")
    (tmp_path / tl.POWER_FILE).write_text(json.dumps(state))
    assert tl.load_power_state(tmp_path / tl.POWER_FILE) == state
    assert tl.load_power_state(tmp_path / "missing.json") is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="power_state times CUDA kernels")
def test_power_state_on_the_gpu(tmp_path, monkeypatch):
    from fusedlib.bench import clocks

    for kw, match in ((dict(impls=("nope",)), "unknown"), (dict(rounds=0), "rounds"),
                      (dict(windows_ms=(200, 0)), "windows_ms"), (dict(rest_s=-1.0), "rest_s")):
        with pytest.raises(ValueError, match=match):
            tl.power_state(DEVICE, TINY, **kw)
    state = tl.power_state(DEVICE, TINY, impls=("fusedlib-sdpa", "fusedlib"), rounds=2, windows_ms=(5, 20),
                           rest_s=0.0, profile_steps=2, warmup=1, dtype=torch.float32)
    assert state["skipped"] == {} and state["op"] == "transformer_layer_power"
    assert (state["rounds"], state["windows_ms"], state["rest_s"], state["profile_steps"]) == (2, [5, 20], 0.0, 2)
    timed = [p for p in state["phases"] if p["timer"] == "do_bench"]
    assert [(p["impl"], p["round"], p["window_ms"]) for p in timed] == [
        (i, r, w) for r in (0, 1) for i in ("fusedlib", "fusedlib-sdpa") for w in (5, 20)]
    assert all(p["ms"] > 0 for p in timed)
    profiled = [p for p in state["phases"] if p["timer"] == "profile"]
    assert [p["impl"] for p in profiled] == ["fusedlib", "fusedlib-sdpa"]
    assert all(p["kernel_ms"] > 0 and p["launches"] > 0 for p in profiled)
    if state["sampler"]["error"] is None:  # nvidia-smi there: the long windows hold samples
        assert any(p["samples"] > 0 and 100 < p["sm_mhz"] < 5000 for p in timed)
    # a sampler that records nothing leaves the timings whole
    class Silent:
        fields, error = None, "stand-in"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def samples(self):
            return []

    state = tl.power_state(DEVICE, TINY, impls=("fusedlib-sdpa",), rounds=1, windows_ms=(5,), rest_s=0.0,
                           profile_steps=1, warmup=1, dtype=torch.float32, sampler=Silent)
    assert state["sampler"] == {"fields": None, "error": "stand-in", "interval_ms": None}
    assert [p["samples"] for p in state["phases"]] == [0, 0] and "no clock samples" in tl.power_table(state)
    assert isinstance(clocks.summarize([], 0.0, 1.0), dict)
    # a timing that fails leaves that implementation out from there on, the others whole
    from fusedlib.bench import core

    real_time_ms = core.time_ms

    def failing_long_windows(fn, *args, rep=200, **kw):
        if rep == 20 and calls.append(rep) is None and len(calls) == 1:
            raise RuntimeError("out of memory (stand-in)")
        return real_time_ms(fn, *args, rep=rep, **kw)

    calls = []
    monkeypatch.setattr(core, "time_ms", failing_long_windows)
    state = tl.power_state(DEVICE, TINY, impls=("fusedlib-sdpa", "fusedlib"), rounds=2, windows_ms=(5, 20),
                           rest_s=0.0, profile_steps=1, warmup=1, dtype=torch.float32, sampler=Silent)
    assert state["skipped"] == {"fusedlib": "RuntimeError: out of memory (stand-in)"}
    assert [(p["impl"], p["timer"]) for p in state["phases"]] == [
        ("fusedlib", "do_bench"), ("fusedlib-sdpa", "do_bench"), ("fusedlib-sdpa", "do_bench"),
        ("fusedlib-sdpa", "do_bench"), ("fusedlib-sdpa", "do_bench"), ("fusedlib-sdpa", "profile")]
    monkeypatch.setattr(core, "time_ms", real_time_ms)
    path = tl.write_power_state(DEVICE, tmp_path, log=lambda s: None, shape=TINY, impls=("fusedlib-sdpa",),
                                rounds=1, windows_ms=(5,), rest_s=0.0, profile_steps=1, warmup=1,
                                dtype=torch.float32)
    assert path == tmp_path / tl.POWER_FILE and tl.load_power_state(path)["phases"]


def test_the_plain_block_runs_causal_attention_and_every_dropout_in_training(monkeypatch):
    # the eager, eager-graphs and torch.compile baselines' layer: causal SDPA with the attention
    # dropout, and both hidden dropouts, on in training and off in eval (spies around torch's calls)
    import torch.nn.functional as F

    sdpa, drops = [], []
    real_sdpa, real_dropout = F.scaled_dot_product_attention, F.dropout
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa.append(kw) or real_sdpa(*a, **kw))
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, **kw: drops.append((p, training))
                        or real_dropout(x, p, training, **kw))
    layer = tl.PlainGPTLayer(24, 4, 20)
    x = torch.randn(7, 2, 24)
    layer(x)
    assert sdpa == [dict(dropout_p=tl.ATTENTION_DROPOUT, is_causal=True)]
    assert drops == [(tl.HIDDEN_DROPOUT, True)] * 2
    sdpa.clear(), drops.clear()
    layer.eval()(x)
    assert sdpa == [dict(dropout_p=0.0, is_causal=True)] and drops == [(tl.HIDDEN_DROPOUT, False)] * 2


def test_each_fusedlib_implementation_builds_the_block_its_record_describes():
    # the records' "attention", "fusions" and "layer" come from the case's info: the blocks the
    # implementations build (without running them) must be those
    c = _cpu_case()
    (x,) = c.make_inputs(DEVICE, False)
    backend = {"materialised": tl.AttnBackend.local, "sdpa": tl.AttnBackend.auto, "flash": tl.AttnBackend.flash}
    for impl in c.impls:
        if not impl.name.startswith("fusedlib"):
            continue
        block = impl.fn.ensure(x)
        info = impl.info
        assert block.training, impl.name
        if impl.name == "fusedlib-unfused":
            assert info["fusions"] == [] and block.config.attention_backend is tl.AttnBackend.unfused
            continue
        assert block.config.attention_backend is backend[info["attention"]], impl.name
        assert all(getattr(block.config, f) for f in info["fusions"]) and info["fusions"] == list(tl.FUSIONS_ON)
        layers = {type(layer).__name__ for layer in block.layers}
        assert layers == {info.get("layer", "TransformerLayer")}, impl.name


def test_the_megatron_block_is_configured_as_fusedlib_s(monkeypatch):
    # megatron-core needs CUDA and a process group: its block is built here from stand-ins of its
    # three classes, to check what the benchmark asks it for (dropouts, sizes, biases, dtype, and
    # the fusions it can run)
    import importlib.util
    import sys
    import types

    made = {}

    class Config:
        def __init__(self, **kw):
            made["config"] = kw

    class Block(torch.nn.Module):
        def __init__(self, cfg, spec):
            super().__init__()
            made["spec"] = spec
            self.w = torch.nn.Parameter(torch.zeros(2))

        def to(self, *a, **kw):
            made["to"] = kw
            return super().to(*a, **kw)

    modules = {"megatron.core.models.gpt.gpt_layer_specs": dict(get_gpt_layer_local_spec=lambda: "local spec"),
               "megatron.core.transformer.transformer_block": dict(TransformerBlock=Block),
               "megatron.core.transformer.transformer_config": dict(TransformerConfig=Config)}
    for name in ("megatron", "megatron.core", "megatron.core.models", "megatron.core.models.gpt",
                 "megatron.core.transformer") + tuple(modules):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**modules.get(name, {})))
    monkeypatch.setattr(tl, "init_megatron", lambda seed=1234: None)
    real_find_spec = importlib.util.find_spec
    for installed in (False, True):  # Apex's extensions absent, then present
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if installed else None)
                            if name in ("apex", "scaled_upper_triang_masked_softmax_cuda") else real_find_spec(name, *a))
        for fused in (False, True):
            made.clear()
            block = tl.megatron_block(TINY, fused, torch.bfloat16, "cpu")
            cfg = made["config"]
            assert block.training and made["spec"] == "local spec"
            assert made["to"] == {"device": "cpu", "dtype": torch.bfloat16}
            _, _, h, heads, ffn, layers = TINY
            assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["ffn_hidden_size"]) == \
                (layers, h, heads, ffn)
            assert cfg["hidden_dropout"] == tl.HIDDEN_DROPOUT and cfg["attention_dropout"] == tl.ATTENTION_DROPOUT
            assert cfg["params_dtype"] is torch.bfloat16 and cfg["bf16"] and not cfg["fp16"]
            assert cfg["add_bias_linear"] is True and cfg["activation_func"] is torch.nn.functional.gelu
            fusions = {k for k, v in cfg.items() if k.endswith("_fusion") or k == "persist_layer_norm"}
            assert all(cfg[k] is True for k in fusions)
            on, off = tl._megatron_fusions(fused)
            assert fusions == set(on)
            if fused:
                want = {"bias_activation_fusion", "bias_dropout_fusion"} | (
                    {"masked_softmax_fusion", "persist_layer_norm"} if installed else set())
                assert fusions == want and set(off) == ({"masked_softmax_fusion", "persist_layer_norm"} - want)
            else:
                assert fusions == set() and off == {}



@pytest.mark.skipif(megatron_why_not() is not None, reason=megatron_why_not() or "")
def test_megatron_blocks_are_timed_as_cuda_graph_replays_that_draw_new_dropout_masks():
    """megatron-core's blocks (graph-safe RNG tracker, its states registered with the timer's
    graph) are captured and replayed like the others: no graph error, and the two states their
    dropouts draw from move by one forward's increment per replay: the tracker's
    tensor-parallel state (attention dropout) and the default generator's own (hidden dropout).
    The bound: the timer's eager calls (the first call for the gradients' shapes, three warm-up
    calls, the capture) move them by at most 5 forwards' increments; triton's do_bench replays
    at least 8 times (1, 5 for its estimate, >= 1 warm-up, >= 1 timed), so at least 12 with the
    replays drawing; 10 lies between."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    c = tl.case(TINY, torch.bfloat16)
    impls = {i.name: i for i in c.impls if i.name.startswith("megatron-core")}
    assert set(impls) == {"megatron-core-unfused", "megatron-core"}
    for name, im in impls.items():
        assert im.generators is tl.megatron_generators and im.info["rng_tracker"] == "graph-safe", name
        x = c.make_inputs(DEVICE, True)
        im.fn(*x)  # (builds the block: the tracker exists from here)
        gens = tl.megatron_generators()
        assert len(gens) == 3 and all(isinstance(g, torch.Generator) for g in gens), gens
        states = {"tensor-parallel": get_cuda_rng_tracker().get_states()["model-parallel-rng"],
                  "default": torch.cuda.default_generators[torch.cuda.current_device()]}
        start = {k: g.get_offset() for k, g in states.items()}
        im.fn(*x)
        per_forward = {k: g.get_offset() - start[k] for k, g in states.items()}
        assert all(v > 0 for v in per_forward.values()), (name, per_forward)  # (both dropouts draw)
        start = {k: g.get_offset() for k, g in states.items()}
        assert core._time_pass(c, im, "fwd+bwd", DEVICE, cuda_graph=True)[0] > 0
        moved = {k: g.get_offset() - start[k] for k, g in states.items()}
        assert all(moved[k] >= 10 * per_forward[k] for k in states), (name, moved, per_forward)


def test_megatron_generators_and_init_megatron_make_and_read_the_graph_safe_tracker(monkeypatch):
    """On stand-ins of megatron-core's modules: no tracker, no generators (and none made); a plain
    tracker is refused by name, and init_megatron replaces it with the graph-safe one (seeded,
    force_reset_rng); a graph-safe tracker is read, and init_megatron leaves it alone."""
    import sys
    import types

    import torch.distributed as dist

    calls = []

    class Tracker:
        def __init__(self, safe):
            self.safe = safe

        def get_states(self):
            return {"data-parallel-rng": "g1", "model-parallel-rng": "g2"}

    random_mod = types.SimpleNamespace(_CUDA_RNG_STATE_TRACKER=None,
                                       is_graph_safe_cuda_rng_tracker=lambda t: t.safe)

    def seed(s, **kw):
        calls.append(("seed", s, kw))
        random_mod._CUDA_RNG_STATE_TRACKER = Tracker(kw.get("use_cudagraphable_rng", False))

    random_mod.model_parallel_cuda_manual_seed = seed
    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: True,
                                  initialize_model_parallel=lambda **kw: calls.append("initialize"))
    tp = types.SimpleNamespace(random=random_mod)
    for name, mod in {"megatron": types.SimpleNamespace(), "megatron.core": types.SimpleNamespace(
            parallel_state=state, tensor_parallel=tp), "megatron.core.parallel_state": state,
            "megatron.core.tensor_parallel": tp, "megatron.core.tensor_parallel.random": random_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert tl.megatron_generators() == [] and random_mod._CUDA_RNG_STATE_TRACKER is None
    random_mod._CUDA_RNG_STATE_TRACKER = Tracker(False)
    with pytest.raises(RuntimeError, match="not its graph-safe one: call .*init_megatron"):
        tl.megatron_generators()
    tl.init_megatron(7)
    assert calls == [("seed", 7, {"use_cudagraphable_rng": True, "force_reset_rng": True})]
    assert tl.megatron_generators() == ["g1", "g2"]
    tl.init_megatron(7)  # (the graph-safe tracker in use: nothing changes)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------
# tools/attention_block.py: the block with SDPA held to each backend
# ------------------------------------------------------------------------------------------

def _attention_block_tool():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "attention_block.py"
    spec = importlib.util.spec_from_file_location("attention_block", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _sdpa_flags():
    b = torch.backends.cuda
    return {"FLASH_ATTENTION": b.flash_sdp_enabled(), "CUDNN_ATTENTION": b.cudnn_sdp_enabled(),
            "EFFICIENT_ATTENTION": b.mem_efficient_sdp_enabled(), "MATH": b.math_sdp_enabled()}


def test_attention_block_tool_holds_each_sdpa_block_to_its_backend_and_no_other(monkeypatch):
    """Each held block's SDPA calls see only their backend enabled (the flags SDPA picks by),
    the backward runs outside the context, and afterwards the flags are as before; the free
    blocks run as chapter 7's benchmark runs them (flash: no SDPA call; sdpa: the default
    flags); no two implementations share a parameter."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tool = _attention_block_tool()
    assert tool.HELD == {"fusedlib-sdpa-flash": "FLASH_ATTENTION", "fusedlib-sdpa-cudnn": "CUDNN_ATTENTION",
                         "fusedlib-sdpa-efficient": "EFFICIENT_ATTENTION"}
    seen, real = [], F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):  # what SDPA would see, then torch's math kernel (this CPU has no fused one with dropout)
        seen.append(_sdpa_flags())
        with sdpa_kernel(SDPBackend.MATH):
            return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    before = _sdpa_flags()
    c = tool.block_case(TINY, torch.float32)
    assert [i.name for i in c.impls] == ["fusedlib-sdpa", "fusedlib-flash", *tool.HELD] and c.skipped == {}
    (x,) = c.make_inputs(DEVICE, True)
    owners = {}
    for impl in c.impls:
        seen.clear()
        impl.fn(x).sum().backward()
        assert impl.info["sdpa_backend"] == tool.HELD.get(impl.name), impl.name
        if impl.name == "fusedlib-flash":
            assert seen == [], "the flash block calls no SDPA"
        else:
            want = ({k: k == tool.HELD[impl.name] for k in before} if impl.name in tool.HELD else before)
            assert seen == [want] * TINY[5], (impl.name, seen)  # one call per layer's forward
        assert _sdpa_flags() == before, impl.name
        for p in impl.params():
            assert owners.setdefault(id(p), impl.name) == impl.name, f"{impl.name} shares a parameter"
    assert len(owners) == len(c.impls) * len(c.impls[0].params())


def test_attention_block_tool_refuses_an_unknown_backend_and_keeps_the_source_impl():
    tool = _attention_block_tool()
    src = next(i for i in tl.case(TINY, torch.float32).impls if i.name == "fusedlib-sdpa")
    info = dict(src.info)
    for bad in ("FLASH", "flash_attention", "ERROR", "OVERRIDEABLE", None):
        with pytest.raises(ValueError, match="backend must be one of .*FLASH_ATTENTION"):
            tool.held(src, "x", bad)
    h = tool.held(src, "fusedlib-sdpa-flash", "FLASH_ATTENTION")
    assert (h.passes, h.params, h.generators, h.compile) == (src.passes, src.params, src.generators, src.compile)
    assert h.info == {**info, "sdpa_backend": "FLASH_ATTENTION"} and src.info == info, "the source's info kept"
    for backends in ({"fusedlib-sdpa": "FLASH_ATTENTION"}, {"fusedlib-flash": "MATH"}, [("x", "MATH")], {1: "MATH"}):
        with pytest.raises(ValueError, match="backends must be a dict of new impl names"):
            tool.block_case(TINY, torch.float32, backends)
    for dtype in ("bf16", torch.int32):
        with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
            tool.block_case(TINY, dtype)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the refusals of a machine without CUDA")
def test_attention_block_tool_refuses_a_bad_out_before_timing_and_needs_cuda(tmp_path, monkeypatch, capsys):
    tool = _attention_block_tool()
    timed = []
    monkeypatch.setattr(tool, "measure", lambda shapes: timed.append(shapes) or [])
    for out in (str(tmp_path), str(tmp_path / "no_such_folder" / "x.json")):
        with pytest.raises(SystemExit):
            tool.main(["--out", out])
        assert "--out must be a file's path in an existing folder" in capsys.readouterr().err
    assert timed == [], "a bad --out is refused before any timing"
    monkeypatch.undo()
    tool = _attention_block_tool()
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tool.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="SDPA's fused backends with dropout and the timer need CUDA")
def test_attention_block_tool_times_every_block_as_replays_and_plain_launches():
    """At a small shape (head dim 32, which every fused backend takes) the tool's run gives one
    record per block, each replayed in every round, with its backend named."""
    tool = _attention_block_tool()
    shape = (64, 2, 64, 2, 96, 1)
    records = tool.measure([shape], rounds=2)
    assert [r["impl"] for r in records] == ["fusedlib-sdpa", "fusedlib-flash", *tool.HELD]
    for r in records:
        assert r["op"] == "transformer_layer" and r["shape"] == list(shape) and r["timer"] == "cuda_graph", r
        assert len(r["ms_replay_rounds"]) == len(r["ms_plain_rounds"]) == 2 and r["ms"] > 0, r
        assert r["sdpa_backend"] == tool.HELD.get(r["impl"]) and r["attention_dropout"] == tl.ATTENTION_DROPOUT
