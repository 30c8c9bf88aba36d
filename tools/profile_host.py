"""Where the host time of a fused op goes (GPU machine): per-call costs and cProfile tables.

Usage: python tools/profile_host.py [--profile OP ...] [--compile] [--paths]

Prints, at tiny shapes (the GPU work is negligible, so the numbers are host time):
* the host cost per call (us, median of 5 x 300 calls, one synchronize at the end) of
  fusedlib's ops, forward and forward+backward, beside the eager unfused op, and per op the
  kernel launches one call makes and how they went (direct: the cached compiled kernel of
  fusedlib/kernels/launch.py; miss or fallback: through Triton's ``kernel[grid]``);
* with --paths: fusedlib's cost per call again with direct launches off (every launch
  through ``kernel[grid]``), so the two launch paths are compared in one run;
* the cost of the pieces a call is made of (a bare Triton launch, fusedlib's direct
  launch, torch.empty, an autograd.Function.apply, the input checks);
* cProfile tables (by own time) of the ops named with --profile;
* with --compile: whether each op runs in torch.compile(fullgraph=True) and under CUDA-graph
  capture of fwd+bwd, with the first lines of any error.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import traceback

import torch

import fusedlib  # noqa: F401  (first)
import triton
import triton.language as tl
from fusedlib import unfused
from fusedlib.kernels import launch as launch_layer
from fusedlib.fusions.fused_bias_dropout import bias_dropout_add_fused_train
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.fusions.fused_bias_swiglu import bias_swiglu_impl
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from fusedlib.fusions.fused_softmax import ScaledUpperTriangMaskedSoftmax

DEV = torch.device("cuda")
DT = torch.bfloat16


def _group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def ops():
    """name -> (make_inputs() -> tuple, fused(*inputs), eager(*inputs))"""
    n, h = 16, 64

    def x2(*extra):
        return lambda: (torch.randn(n, h, device=DEV, dtype=DT, requires_grad=True),
                        *[torch.randn(s, device=DEV, dtype=DT, requires_grad=True) for s in extra])

    def bda_in():
        return (torch.randn(n, h, device=DEV, dtype=DT, requires_grad=True),
                torch.randn(h, device=DEV, dtype=DT, requires_grad=True),
                torch.randn(n, h, device=DEV, dtype=DT, requires_grad=True))

    def ce_in():
        return (torch.randn(n, 128, device=DEV, dtype=DT, requires_grad=True),
                torch.randint(0, 128, (n,), device=DEV))

    def sm_in():
        return (torch.randn(4, 32, 32, device=DEV, dtype=DT, requires_grad=True),)

    def swi_in():
        return (torch.randn(n, 2 * h, device=DEV, dtype=DT, requires_grad=True),
                torch.randn(2 * h, device=DEV, dtype=DT, requires_grad=True))

    return {
        "bias_gelu": (x2(h), lambda y, b: bias_gelu_impl(y, b),
                      lambda y, b: torch.nn.functional.gelu(y + b, approximate="tanh")),
        "layer_norm": (x2(h, h), lambda x, w, b: fused_layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: torch.nn.functional.layer_norm(x, (h,), w, b, 1e-5)),
        "rms_norm": (x2(h), lambda x, w: fused_rms_norm(x, w, 1e-5),
                     lambda x, w: torch.nn.functional.rms_norm(x, (h,), w, 1e-5)),
        "swiglu": (swi_in, lambda y, b: bias_swiglu_impl(y, b),
                   lambda y, b: unfused.bias_swiglu(y, b)),
        "bias_dropout_add": (bda_in, lambda x, b, r: bias_dropout_add_fused_train((x, b), r, 0.1),
                             lambda x, b, r: r + torch.nn.functional.dropout(x + b, 0.1)),
        "causal_softmax": (sm_in, lambda s: ScaledUpperTriangMaskedSoftmax.apply(s, 0.125),
                           lambda s: torch.softmax(
                               (s.float() * 0.125).masked_fill(
                                   torch.ones(32, 32, device=DEV, dtype=torch.bool).triu(1), float("-inf")), -1).to(DT)),
        "cross_entropy": (ce_in, lambda x, t: fused_vocab_parallel_cross_entropy(x, t),
                          lambda x, t: torch.nn.functional.cross_entropy(x.float(), t, reduction="none")),
    }


def per_call_us(fn, reps=5, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def fwd_bwd(f, inputs):
    def step():
        for t in inputs:
            if t.is_floating_point():
                t.grad = None
        f(*inputs).float().sum().backward()
    return step


def launches(step):
    """Launches of one call of ``step`` (after warm-up): "direct hits / misses / fallbacks"."""
    if not launch_layer.DIRECT_LAUNCH:
        return "-"
    stats = launch_layer.launch_stats()
    stats.reset()
    step()
    torch.cuda.synchronize()
    s = stats.snapshot()
    why = f" ({'; '.join(f'{k}: {v}' for k, v in stats.reasons.items())})" if stats.reasons else ""
    return f"{s['hits']}/{s['misses']}/{s['fallbacks']}{why}"


def table(paths=False):
    direct = launch_layer.DIRECT_LAUNCH
    print(f"direct launches: {'on' if direct else 'off'} (triton {triton.__version__}; "
          f"verified for {', '.join(launch_layer.DIRECT_LAUNCH_VERSIONS)})")
    head = "op | fusedlib fwd | eager fwd | fusedlib fwd+bwd | eager fwd+bwd   (us per call)"
    if paths:
        head += " | fusedlib fwd, fwd+bwd via kernel[grid]"
    print(head + " | launches per call fwd, fwd+bwd (direct/miss/fallback)")
    for name, (mk, fused, eager) in ops().items():
        try:
            inp = mk()
            with torch.no_grad():
                ff = per_call_us(lambda: fused(*inp))
                ef = per_call_us(lambda: eager(*inp))
                lf = launches(lambda: fused(*inp))
            fb = per_call_us(fwd_bwd(fused, inp))
            eb = per_call_us(fwd_bwd(eager, inp))
            lb = launches(fwd_bwd(fused, inp))
            line = f"{name} | {ff:.1f} | {ef:.1f} | {fb:.1f} | {eb:.1f}"
            if paths:
                launch_layer.DIRECT_LAUNCH = False
                try:
                    with torch.no_grad():
                        gf = per_call_us(lambda: fused(*inp))
                    gb = per_call_us(fwd_bwd(fused, inp))
                finally:
                    launch_layer.DIRECT_LAUNCH = direct
                line += f" | {gf:.1f}, {gb:.1f}"
            print(f"{line} | {lf}, {lb}", flush=True)
        except Exception as exc:  # report and go on
            print(f"{name} | FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


@triton.jit
def _noop(X_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X_ptr + offs, tl.load(X_ptr + offs, mask=offs < n), mask=offs < n)


class _Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def pieces():
    x = torch.zeros(16, device=DEV)
    ck = _noop[(1,)](x, 16, BLOCK=16)
    index = torch.cuda.current_device()
    args = {
        "bare triton launch (JIT)": lambda: _noop[(1,)](x, 16, BLOCK=16),
        "compiled kernel runner": lambda: ck[(1, 1, 1)](x, 16),
        "fusedlib direct_launch": lambda: launch_layer.direct_launch(_noop, (1,), index, (x, 16), {"BLOCK": 16}),
        "fusedlib launch_key": lambda: launch_layer.launch_key(_noop, index, False, "", (x, 16), {"BLOCK": 16}),
        "fusedlib runtime.launch": lambda: fusedlib.runtime.launch(_noop, (1,), x.device, x, 16, BLOCK=16),
        "torch.empty 16x64": lambda: torch.empty((16, 64), device=DEV, dtype=DT),
        "x.add_(1)": lambda: x.add_(1),
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "Function.apply identity": lambda: _Ident.apply(x),
        "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
        "torch.compiler.is_compiling": lambda: torch.compiler.is_compiling(),
    }
    for k, f in args.items():
        try:
            print(f"{k}: {per_call_us(f):.2f} us", flush=True)
        except Exception as exc:
            print(f"{k}: FAILED {type(exc).__name__}: {str(exc)[:300]}")


def profile(names):
    table_ops = ops()
    for name in names:
      mk, fused, eager = table_ops[name]
      for which, f in (("fusedlib", fused), ("eager", eager)):
        inp = mk()
        step = fwd_bwd(f, inp)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            step()
        pr.disable()
        torch.cuda.synchronize()
        print(f"===== cProfile {name} {which} fwd+bwd, 300 calls, by own time")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def compile_check():
    for name, (mk, fused, _) in ops().items():
        for mode in ("compile-fwd", "compile-step", "graph"):
            try:
                inp = mk()
                if mode == "compile-fwd":
                    f = torch.compile(fused, fullgraph=True)
                    with torch.no_grad():
                        out = f(*inp)
                    ref = fused(*inp)
                    ok = torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2) if name != "bias_dropout_add" else True
                elif mode == "compile-step":
                    def step(*a):
                        out = fused(*a)
                        out.float().sum().backward()
                        return out
                    torch.compile(step)(*inp)
                    ok = all(t.grad is not None for t in inp if t.is_floating_point())
                else:
                    step = fwd_bwd(fused, inp)
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            step()
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        step()
                    g.replay()
                    torch.cuda.synchronize()
                    ok = True
                print(f"{name} {mode}: {'ok' if ok else 'WRONG RESULT'}", flush=True)
            except Exception as exc:
                msg = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
                print(f"{name} {mode}: FAILED {' | '.join(m[:300] for m in msg[:6])}", flush=True)
            torch._dynamo.reset()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", nargs="*", default=[])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--paths", action="store_true", help="also time fusedlib with direct launches off")
    a = ap.parse_args()
    print(fusedlib.runtime.device_banner())
    pieces()
    table(a.paths)
    profile(a.profile)
    if a.compile:
        compile_check()


if __name__ == "__main__":
    main()
