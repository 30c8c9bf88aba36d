"""Plain launches against CUDA-graph replays for the norms' fwd+bwd, and the host time per step.

Usage (GPU): python tools/diag_norm_timing.py [--h 4096 16384]

For LayerNorm and RMSNorm at [2^27 / h, h] bf16 it runs the benchmark cases (fusedlib,
eager, torch.compile, Liger where it imports; every case times CUDA graphs) and prints each
record's graph-replay time, plain-launch time and bandwidth; then, for fusedlib, the
host's time to launch one fwd+bwd step (perf_counter over 200 steps, no synchronization),
and the kernels alone (forward kernel; backward kernel + second-stage reduction).
"""
from __future__ import annotations

import argparse
import time

import torch

from fusedlib.bench.core import copy_record, measure_case, time_ms
from fusedlib.bench.ops.layer_norm import norm_case
from fusedlib.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from fusedlib.kernels.layer_norm import norm_bwd, norm_fwd


def host_us_per_step(op: str, h: int) -> float:
    n_rows = (1 << 27) // h
    x = torch.randn(n_rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(h, device="cuda")).bfloat16().requires_grad_()
    dy = torch.randn_like(x)

    def step():
        x.grad = w.grad = b.grad = None
        y = fused_rms_norm(x, w, 1e-5) if op == "rms_norm" else fused_layer_norm(x, w, b, 1e-5)
        y.backward(dy)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        step()
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    rms = op == "rms_norm"
    with torch.no_grad():
        y, mean, rstd = norm_fwd(x, w, None if rms else b, 1e-5, rms_norm=rms)
        fwd = time_ms(lambda: norm_fwd(x, w, None if rms else b, 1e-5, rms_norm=rms))
        bwd = time_ms(lambda: norm_bwd(dy, x, w, None if rms else b, mean, rstd, rms_norm=rms))
    print(f"{op} h={h}: host {host:.0f} us per fwd+bwd step; kernels alone: fwd {fwd:.4f} ms, "
          f"bwd (+ reduction) {bwd:.4f} ms, sum {fwd + bwd:.4f} ms", flush=True)
    return host


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--h", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    print(f"copy {copy_record()['GBps']:.0f} GB/s", flush=True)
    for h in args.h:
        for op in ("layer_norm", "rms_norm"):
            host_us_per_step(op, h)
            case = norm_case(op, ((1 << 27) // h, h), torch.bfloat16, baselines=True)
            for r in measure_case(case, torch.device("cuda"), passes=("fwd+bwd",)):
                print(f"  {r['op']} {r['shape']} {r['pass']:8s} {r['impl']:14s} graph {r['ms']:.4f} ms "
                      f"({r['GBps']:.0f} GB/s, {r.get('timer')})  plain launches {r.get('ms_eager', float('nan')):.4f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
