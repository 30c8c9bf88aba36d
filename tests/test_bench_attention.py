"""The attention benchmark (``fusedlib.bench.ops.attention``) on a CPU: its FLOP count against
torch's FLOP counter, the case's implementations against a float64 reference at a tiny odd
size, the screening of what cannot run (SDPA backends the device refuses, materialised paths
too large for its memory), the records' layout (FLOPs, TFLOP/s, variant, what was not timed),
and the tables, sentences and plot made from them.
"""
from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fusedlib.bench import __main__ as cli
from fusedlib.bench import core
from fusedlib.bench import host as host_mod
from fusedlib.bench.ops import attention as at
from fusedlib.bench.ops import get_op_module

from conftest import DEVICE  # noqa: I001

#: [b, h, s, d]: an odd sequence, a head dim that is not a power of two
TINY = (2, 3, 13, 12)
#: the implementations that run on a CPU (SDPA's CPU flash and math kernels; the materialised
#: paths; fusedlib's kernels in Triton's interpreter)
CPU_IMPLS = ("fusedlib", "fusedlib-deterministic", "sdpa-flash", "sdpa-math", "fusedlib-materialised", "eager", "torch.compile")


def _reference(q, k, v, causal, scale):
    """softmax(scale·q·kᵀ, -inf above the diagonal)·v in float64, on [b, s, h, d] tensors."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    s = scale * qh @ kh.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return (torch.softmax(s, -1) @ vh).transpose(1, 2)


# ------------------------------------------------------------------------------------------
# Counts
# ------------------------------------------------------------------------------------------

def test_flops_are_four_bhssd_halved_when_causal_and_three_and_a_half_times_with_the_backward():
    b, h, s, d = 4, 16, 2048, 128
    full = at.attention_flops(b, h, s, s, d, causal=False)
    causal = at.attention_flops(b, h, s, s, d, causal=True)
    assert full["fwd"] == 4 * b * h * s * s * d and causal["fwd"] * 2 == full["fwd"]
    assert full["fwd+bwd"] * 2 == 7 * full["fwd"] and causal["fwd+bwd"] * 2 == 7 * causal["fwd"]
    odd = at.attention_flops(1, 1, 3, 5, 7, causal=True)  # exact ints, also for odd sizes
    assert odd == {"fwd": 2 * 3 * 5 * 7, "fwd+bwd": 7 * 3 * 5 * 7} and all(isinstance(v, int) for v in odd.values())
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        at.attention_flops(1, 0, 3, 3, 8, causal=False)


def test_flops_agree_with_torch_flop_counter_on_the_materialised_products():
    # the forward's two products are what torch counts; the backward's four gradient products
    # are 2x the forward, and a flash backward recomputes Q·Kᵀ once more: 3.5x in all
    b, h, s, d = TINY
    q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as fwd_counter:
        o = at._eager_attention(q, k, v, None, 0.5)
    with FlopCounterMode(display=False) as bwd_counter:
        o.backward(torch.randn_like(o))
    ours = at.attention_flops(b, h, s, s, d, causal=False)
    recompute = 2 * b * h * s * s * d
    assert fwd_counter.get_total_flops() == ours["fwd"]
    assert fwd_counter.get_total_flops() + bwd_counter.get_total_flops() + recompute == ours["fwd+bwd"]


def test_materialised_peak_bound_and_bad_shapes():
    assert at.materialised_peak_bytes(2, 16, 8192, 8192) == at.BYTES_PER_SCORE * 2 * 16 * 8192 ** 2
    for shape, match in (((1, 2, 3), "four ints"), ((1, 2, 0, 4), "four ints"), (("a", 1, 1, 1), "of ints")):
        with pytest.raises(ValueError, match=match):
            at.case(shape)


# ------------------------------------------------------------------------------------------
# The case
# ------------------------------------------------------------------------------------------

def test_cases_are_the_four_documented_shapes_with_every_implementation():
    cs = at.cases(torch.device("cpu"))
    assert [(c.shape, c.info["causal"]) for c in cs] == list(at.CASES)
    assert cs[0].shape == at.DEFAULT_SHAPE == (4, 16, 2048, 128) and cs[0].info["variant"] == "causal"
    assert cs[1].info["variant"] == "non-causal"
    assert [c.shape for c in cs[2:]] == [(2, 16, 8192, 128), (8, 32, 1024, 64)]
    for c in cs:
        assert c.op == "attention" and c.dtype == torch.bfloat16
        assert [i.name for i in c.impls] == ["fusedlib", "fusedlib-deterministic", "sdpa-flash", "sdpa-cudnn",
                                             "sdpa-efficient", "sdpa-math", "fusedlib-materialised", "eager",
                                             "torch.compile"]
        assert set(i.name for i in c.impls) == set(at.IMPLS)
        assert c.bytes == {"fwd": None, "fwd+bwd": None} and c.peak_memory and c.cuda_graph
        b, h, s, d = c.shape
        assert c.flops == at.attention_flops(b, h, s, s, d, c.info["causal"])
        assert c.info["not_timed"] == {} and c.skipped == {}, "nothing is probed on a CPU"
        assert c.info["scale"] == 1 / math.sqrt(d) and c.info["layout"] == "bshd"
        sdpa = {i.name: i.info["backend"] for i in c.impls if i.name.startswith("sdpa-")}
        assert sdpa == at.SDPA_BACKENDS
    assert "attention" in host_mod.HOST_SHAPES and get_op_module("attention") is at


@pytest.mark.parametrize("causal", [True, False])
def test_the_implementations_that_run_here_compute_attention_forward_and_backward(causal):
    # float32 against float64: each output is a softmax-weighted mean of 13 values and each
    # gradient a few sums of 13 products of order-1 numbers, all in float32 (u = 6e-8);
    # 1e-5 is ~170 u, and a wrong mask or scale moves entries by a fraction of their size
    c = at.case(TINY, torch.float32, causal=causal, compile_backend="eager")
    q, k, v = c.make_inputs(DEVICE, True)
    assert q.shape == (TINY[0], TINY[2], TINY[1], TINY[3]) and q.dtype == torch.float32
    before = [t.detach().clone() for t in (q, k, v)]
    g = torch.randn(q.shape, device=DEVICE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, causal, c.info["scale"])
    want.backward(g.double())
    impls = {i.name: i for i in c.impls}
    # on a GPU, SDPA's flash kernel takes 16-bit inputs only (the float32 case is the CPU's)
    for name in CPU_IMPLS if DEVICE.type == "cpu" else [n for n in CPU_IMPLS if n != "sdpa-flash"]:
        for t in (q, k, v):
            t.grad = None
        o = impls[name].fn(q, k, v)
        torch.testing.assert_close(o.double(), want.detach(), atol=1e-5, rtol=0, msg=name)
        o.backward(g)
        for t, w in zip((q, k, v), leaves):
            torch.testing.assert_close(t.grad.double(), w.grad, atol=1e-5, rtol=0, msg=name)
        assert all(torch.equal(t.detach(), b) for t, b in zip((q, k, v), before)), f"{name} modified its input"


def test_screen_leaves_out_refused_backends_and_materialised_paths_too_large(recwarn):
    c = at.case((1, 2, 8, 16), torch.float32, compile_backend="eager")
    names = [i.name for i in c.impls]
    # a CPU runs SDPA's flash and math kernels, never cuDNN's or the memory-efficient one
    kept, why = at.screen(list(c.impls), c.make_inputs, torch.device("cpu"), c.shape, total_memory=1 << 40)
    assert [i.name for i in kept] == [n for n in names if n not in ("sdpa-cudnn", "sdpa-efficient")]
    assert set(why) == {"sdpa-cudnn", "sdpa-efficient"}
    assert all(w.startswith("fwd unsupported: RuntimeError") and "fwd+bwd unsupported" in w for w in why.values())
    # a device whose memory the scores would fill: the materialised paths are left out, saying why
    small = at.materialised_peak_bytes(1, 2, 8, 8)
    c = at.case((1, 2, 8, 16), torch.float32, compile_backend="eager")
    kept, why = at.screen(list(c.impls), c.make_inputs, torch.device("cpu"), c.shape, total_memory=small)
    assert set(at.MATERIALISED_IMPLS) <= set(why) and not set(at.MATERIALISED_IMPLS) & {i.name for i in kept}
    assert "B per score" in why["eager"] and "fusedlib" in [i.name for i in kept]


def test_screen_keeps_the_passes_a_backend_runs():
    calls = []

    def forward_only(q, k, v):
        calls.append(q.requires_grad)
        if q.requires_grad:
            raise RuntimeError("no backward for this shape")
        return q + k + v

    impl = core.Impl("sdpa-flash", forward_only)
    c = at.case((1, 1, 4, 8), torch.float32, compile_backend="eager")
    kept, why = at.screen([impl], c.make_inputs, torch.device("cpu"), c.shape, total_memory=1 << 40)
    assert kept == [impl] and impl.passes == ("fwd",) and calls == [False, True]
    assert why == {"sdpa-flash": "fwd+bwd unsupported: RuntimeError: no backward for this shape"}


# ------------------------------------------------------------------------------------------
# Records, tables, sentences, plot
# ------------------------------------------------------------------------------------------

#: fake median times (ms), graph replays; plain launches take 10% longer
FAKE_MS = {"fusedlib": 0.25, "sdpa-flash": 0.3, "sdpa-cudnn": 0.2, "sdpa-efficient": 0.5, "sdpa-math": 3.0,
           "fusedlib-materialised": 1.5, "eager": 4.0, "torch.compile": 2.0}


def _fake_records(monkeypatch):
    def fake_time_pass(case, impl, pas, device, peak=False, cuda_graph=False):
        ms = FAKE_MS[impl.name] * (3 if pas == "fwd+bwd" else 1) * (1.0 if cuda_graph else 1.1)
        return ms, (10**6 if impl.name == "fusedlib" else 10**9) if peak else None

    monkeypatch.setattr(core, "_time_pass", fake_time_pass)
    recs = [core._record("copy", "copy", "copy", (1 << 30,), torch.bfloat16, 1.0, 1 << 32)]
    for causal in (True, False):
        c = at.case(at.DEFAULT_SHAPE, causal=causal, compile_backend="eager")
        c.impls = [i for i in c.impls if i.name != "sdpa-efficient"]
        c.info["not_timed"] = {"sdpa-efficient": "fwd unsupported: RuntimeError: refused"}
        recs += core.measure_case(c, torch.device("cuda"))
    return recs


def test_records_carry_flops_tflops_variant_and_what_was_not_timed(monkeypatch, tmp_path):
    recs = _fake_records(monkeypatch)
    rows = [r for r in recs if r["op"] == "attention"]
    assert len(rows) == 2 * 7 * 2  # variants x implementations x passes
    b, h, s, d = at.DEFAULT_SHAPE
    for r in rows:
        flops = at.attention_flops(b, h, s, s, d, r["causal"])[r["pass"]]
        assert r["flops"] == flops and r["bytes"] is None and r["GBps"] is None
        assert r["TFLOPs"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, abs=0.05)
        assert r["TFLOPs_eager"] == pytest.approx(flops / (r["ms_eager"] * 1e-3) / 1e12, abs=0.05)
        assert r["variant"] == ("causal" if r["causal"] else "non-causal") and r["shape"] == list(at.DEFAULT_SHAPE)
        assert r["not_timed"] == {"sdpa-efficient": "fwd unsupported: RuntimeError: refused"}
        assert r["timer"] == "cuda_graph" and r["peak_bytes"] in (10**6, 10**9)
        assert ("backend" in r) == r["impl"].startswith("sdpa-")
    headline = next(r for r in rows if r["impl"] == "sdpa-flash" and r["pass"] == "fwd" and r["causal"])
    assert headline["TFLOPs"] == pytest.approx(4 * b * h * s * s * d / 2 / 0.3e-3 / 1e12, abs=0.05)
    path = core.write_records(recs, tmp_path / "attention.json")
    assert core.load_records(path) == json.loads(json.dumps(recs))


def test_cli_summary_compares_within_a_variant(monkeypatch):
    recs = _fake_records(monkeypatch)
    for r in [r for r in recs if r["op"] == "attention" and not r["causal"] and r["impl"] == "fusedlib"]:
        r["ms"] /= 2  # the non-causal fusedlib twice as fast: its ratios must differ from the causal ones
    text = cli.summary(recs)
    flash = [line for line in text.splitlines() if "sdpa-flash" in line and "fwd+bwd" not in line]
    assert len(flash) == 2 and "causal" in flash[0] and "non-causal" in flash[1]
    assert flash[0].split()[-2] == "1.20" and flash[1].split()[-2] == "2.40"  # 0.3 / 0.25, 0.3 / 0.125


def test_table_and_goal_lines_print_the_numbers_from_the_records(monkeypatch):
    recs = _fake_records(monkeypatch)
    text = at.table(recs)
    assert text.count("attention [b 4, h 16, s 2048, d 128]") == 2 and "non-causal" in text
    assert "sdpa-efficient: not timed: fwd unsupported" in text
    flash = next(line for line in text.splitlines() if line.startswith("sdpa-flash"))
    assert flash.split()[1:] == ["0.300", "229", "1000", "0.900", "267", "1000", "1.20x,", "1.20x"]  # 68.7 GFLOP / 0.3 ms
    assert at.table([]) == "no attention records"
    lines = at.goal_lines(recs)
    assert "fusedlib 1.20x as fast (graph); goal faster than sdpa-flash: True" in lines[0]
    cudnn = next(line for line in lines if "cuDNN" in line)
    assert "1.25x cuDNN's time (graph); goal within 1.3x of cuDNN: True" in cudnn  # 0.75 / 0.6
    memory = next(line for line in lines if "peak extra memory" in line)
    assert "1 MB" in memory and f"({2 * 4 * 16 * 2048 ** 2 / 1e6:.0f} MB)" in memory
    # a missing record is said, not guessed
    no_flash = [r for r in recs if r.get("impl") != "sdpa-flash"]
    assert any("no sdpa-flash record to compare" in line for line in at.goal_lines(no_flash))


def test_plot_draws_tflops_from_zero_with_the_ceiling(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = _fake_records(monkeypatch)
    ceiling = {"op": "matmul", "TFLOPs": 700.0}
    fig = at.plot(recs, ceiling)
    try:
        ax = fig.axes[0]
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 700
        assert len(ax.patches) == 7 * 2  # implementations x cases
        assert any("matmul ceiling 700" in t.get_text() for t in fig.legends[0].get_texts())
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="no attention record"):
        at.plot([recs[0]])


def test_plot_gives_every_implementation_its_own_colour_and_a_legend_entry(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    assert len(set(at.PLOT_COLORS.values())) == len(at.PLOT_COLORS)
    assert set(at.IMPLS) <= set(at.PLOT_COLORS)
    recs = _fake_records(monkeypatch)
    # a series drawn in one panel only (fusedlib-deterministic times fwd+bwd alone)
    recs += [dict(r, impl="fusedlib-deterministic", ms=r["ms"] * 1.2, TFLOPs=r["TFLOPs"] / 1.2)
             for r in recs if r.get("op") == "attention" and r["impl"] == "fusedlib" and r["pass"] == "fwd+bwd"]
    fig = at.plot(recs, {"op": "matmul", "TFLOPs": 700.0})
    try:
        drawn = {}  # impl -> the colour of its bars, over both panels
        for ax in fig.axes[:2]:
            for bars in ax.containers:
                colours = {mcolors.to_hex(p.get_facecolor()) for p in bars.patches}
                assert len(colours) == 1  # one colour for a series' bars
                colour = colours.pop()
                assert drawn.setdefault(bars.get_label(), colour) == colour  # the same in both panels
        impls = {r["impl"] for r in recs if r.get("op") == "attention"}
        assert set(drawn) == impls and "fusedlib-deterministic" in drawn
        assert not any(c.get_label() == "fusedlib-deterministic" for c in fig.axes[0].containers)
        assert len(set(drawn.values())) == len(drawn)  # one colour per implementation
        legend = fig.legends[0]
        entries = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
        for impl, colour in drawn.items():  # every series in the legend, its swatch its bars' colour
            assert mcolors.to_hex(entries[impl].get_facecolor()) == colour
        assert any(text.startswith("bf16 matmul ceiling 700") for text in entries)
    finally:
        plt.close(fig)


def test_kernel_calls_launch_each_form_on_the_case_inputs():
    # the calls tools/attention_loads.py and tools/attention_order.py time (they built these
    # inputs and launches each, line for line)
    import fusedlib.kernels.flash_attention as kfa
    from fusedlib.kernels.bias_dropout_add import philox_seed

    shape, causal = (1, 2, 24, 16), True
    forms = [("forward", 0.0, True), ("forward_dropout", 0.25, True), ("backward", 0.0, True),
             ("backward_dropout", 0.25, False)]
    calls = at.kernel_calls(shape, causal, forms, device=DEVICE, dtype=torch.float32)
    assert [c[:3] for c in calls] == forms
    b, h, s, d = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device=DEVICE) for _ in range(4))
    seed = philox_seed(q.device)
    band = kfa.attention_band(s, s, causal, None)
    for form, p, deterministic, call in calls:
        drop = dict(seed=seed, dropout_p=p) if p else {}
        o, lse = kfa.flash_attn_fwd(q, k, v, d ** -0.5, band, **drop)
        expected = (o, lse) if form.startswith("forward") else \
            kfa.flash_attn_bwd(do, q, k, v, o, lse, d ** -0.5, band, deterministic=deterministic, **drop)
        got = call()
        assert len(got) == len(expected)
        # bit for bit, the atomic dQ too: s = 24 spans at most two key tiles, and a sum of two
        # float32 terms added into zero is the same in either order
        for x, y in zip(got, expected):
            assert (x is None and y is None) or torch.equal(x, y), form
    with pytest.raises(ValueError, match="shape must be"):
        at.kernel_calls((1, 2, 24), causal, forms, device=DEVICE)


def test_each_sdpa_implementation_allows_its_own_backend_alone_on_views_of_the_inputs(monkeypatch):
    # the backends a CPU refuses (cuDNN's, the memory-efficient one) are not run above: what each
    # SDPA implementation asks torch for is checked here with stand-ins for sdpa_kernel and SDPA
    import torch.nn.attention as tna

    calls = []

    @contextlib.contextmanager
    def allowed(backends):
        calls.append({"allowed": list(backends)})
        yield

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        calls[-1].update(q=q, k=k, v=v, mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
        return q.clone()

    monkeypatch.setattr(tna, "sdpa_kernel", allowed)
    monkeypatch.setattr(at.F, "scaled_dot_product_attention", sdpa)
    assert at.SDPA_BACKENDS == {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                                "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
    for causal in (True, False):
        c = at.case(TINY, torch.float32, causal=causal, compile_backend="eager")
        q, k, v = c.make_inputs(DEVICE, False)
        for impl in c.impls:
            if impl.name not in at.SDPA_BACKENDS:
                continue
            calls.clear()
            impl.fn(q, k, v)
            (call,) = calls
            assert call["allowed"] == [getattr(tna.SDPBackend, at.SDPA_BACKENDS[impl.name])], impl.name
            assert call["is_causal"] is causal and call["mask"] is None and call["dropout_p"] == 0.0
            assert call["scale"] in (None, c.info["scale"])  # None: SDPA's default, 1/sqrt(d)
            for got, given in zip((call["q"], call["k"], call["v"]), (q, k, v)):
                # the [b, h, s, d] view of the bshd input itself: no copy, no cast
                assert got.dtype == given.dtype and got.data_ptr() == given.data_ptr(), impl.name
                assert got.shape == given.transpose(1, 2).shape and got.stride() == given.transpose(1, 2).stride()


def test_the_fusedlib_implementations_call_flash_attention_as_their_names_say(monkeypatch):
    import fusedlib.fusions.fused_attention as fa

    seen = []
    monkeypatch.setattr(fa, "flash_attention", lambda q, k, v, **kw: seen.append(kw) or q)
    for causal in (True, False):
        c = at.case(TINY, torch.float32, causal=causal, compile_backend="eager")
        q, k, v = c.make_inputs(DEVICE, False)
        impls = {i.name: i for i in c.impls}
        seen.clear()
        impls["fusedlib"].fn(q, k, v)
        impls["fusedlib-deterministic"].fn(q, k, v)
        scale = c.info["scale"]
        assert seen == [dict(causal=causal, softmax_scale=scale, deterministic=False),
                        dict(causal=causal, softmax_scale=scale, deterministic=True)]
        assert impls["fusedlib-deterministic"].passes == ("fwd+bwd",) and impls["fusedlib"].passes == core.PASSES


def test_a_gpu_case_records_what_the_screen_left_out(monkeypatch):
    # on a GPU the case screens its implementations; what it leaves out is in skipped and in the
    # info every record carries (stand-ins for the device's properties and the screen)
    from types import SimpleNamespace

    got = {}

    def fake_screen(impls, make_inputs, device, shape, total_memory):
        got.update(device=device, shape=tuple(shape), total_memory=total_memory)
        return [i for i in impls if i.name != "sdpa-cudnn"], {"sdpa-cudnn": "fwd unsupported: refused"}

    monkeypatch.setattr(at, "screen", fake_screen)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 10**9))
    c = at.case(TINY, torch.float32, device="cuda", compile_backend="eager")
    assert got == {"device": torch.device("cuda"), "shape": TINY, "total_memory": 80 * 10**9}
    assert "sdpa-cudnn" not in [i.name for i in c.impls] and len(c.impls) == len(at.IMPLS) - 1
    assert c.skipped == c.info["not_timed"] == {"sdpa-cudnn": "fwd unsupported: refused"}
