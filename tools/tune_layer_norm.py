"""Try launch settings for the LayerNorm / RMSNorm kernels on a GPU; print GB/s per candidate.

Usage (GPU):
    python tools/tune_layer_norm.py                       # h = 4096, both norms (about 3 min)
    python tools/tune_layer_norm.py --h 768 2048 8192 16384 --op layer_norm

For each norm, pass (fwd, bwd) and hidden size h (rows = 2^27 / h, bf16) it times each
candidate NormConfig with the benchmark's timer, then prints the best as rows to paste
into fusedlib/kernels/layer_norm.py's _FWD_CONFIGS / _BWD_CONFIGS (keyed by BLOCK_N, the
next power of two >= h; LayerNorm and RMSNorm share a table, so pick the row best for both).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fusedlib.bench.core import copy_record, time_ms
from fusedlib.bench.ops.layer_norm import layer_norm_bytes, rms_norm_bytes
from fusedlib.kernels.layer_norm import NormConfig, norm_bwd, norm_config, norm_fwd


def fwd_candidates(block_n: int) -> list[NormConfig]:
    out = []
    for block_m, warps in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16, 32)):
        per_thread = block_m * block_n // (32 * warps)
        if block_m * block_n > 16384 or not 4 <= per_thread <= 64:
            continue
        out.append(NormConfig(block_m, warps, 0, 1))  # one tile per program
        out.append(NormConfig(block_m, warps, 4, 2))  # persistent, next tile prefetched
    return out


def bwd_candidates(block_n: int) -> list[NormConfig]:
    out = []
    for block_m, warps in itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32)):
        per_thread = block_m * block_n // (32 * warps)
        if block_m * block_n > 8192 and block_m > 1 or not 4 <= per_thread <= 32:
            continue
        stages_options = (1, 2, 3) if block_m * block_n <= 8192 else (1, 2)
        for programs_per_sm, stages in itertools.product((1, 2, 4) if warps <= 8 else (1, 2), stages_options):
            out.append(NormConfig(block_m, warps, programs_per_sm, stages))
    if block_n >= 8192:  # the split backward: row sums first, then programs of split_block columns
        for split, block_m, warps, programs_per_sm in itertools.product((1024, 2048, 4096), (1, 2), (4, 8), (4, 8)):
            if 8 <= block_m * split // (32 * warps) <= 32:
                out.append(NormConfig(block_m, warps, programs_per_sm, 2, split_block=split))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--h", type=int, nargs="+", default=[4096])
    parser.add_argument("--op", nargs="+", default=["layer_norm", "rms_norm"], choices=["layer_norm", "rms_norm"])
    parser.add_argument("--pass", dest="passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--rep", type=int, default=100, help="do_bench's repetition budget per candidate, ms")
    args = parser.parse_args()
    copy = copy_record()
    print(f"copy {copy['GBps']:.0f} GB/s", flush=True)
    best = {}
    for op, h in itertools.product(args.op, args.h):
        rms = op == "rms_norm"
        n_rows = (1 << 27) // h
        x = torch.randn(n_rows, h, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16()
        b = None if rms else (0.1 * torch.randn(h, device="cuda")).bfloat16()
        dy = torch.randn_like(x)
        nbytes = (rms_norm_bytes if rms else layer_norm_bytes)(n_rows, h, 2)
        nbytes["bwd"] = nbytes["fwd+bwd"] - nbytes["fwd"]
        y, mean, rstd = norm_fwd(x, w, b, 1e-5, rms_norm=rms)
        block_n = triton.next_power_of_2(h)
        for pas, cands in (("fwd", fwd_candidates(block_n)), ("bwd", bwd_candidates(block_n))):
            if pas not in args.passes:
                continue
            default = norm_config(h, pas, rms)[1]
            results = []
            for cfg in cands:
                if pas == "fwd":
                    fn = lambda: norm_fwd(x, w, b, 1e-5, rms_norm=rms, config=cfg)  # noqa: E731
                else:
                    fn = lambda: norm_bwd(dy, x, w, b, mean, rstd, rms_norm=rms, config=cfg)  # noqa: E731
                try:
                    ms = time_ms(fn, warmup=10, rep=args.rep)
                except Exception as exc:  # e.g. out of shared memory for this tile
                    print(f"{op} h={h} {pas} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                gbps = nbytes[pas] / ms / 1e6
                mark = "  <- current table" if cfg == default else ""
                print(f"{op:10s} h={h:5d} {pas} {cfg}  {ms:.4f} ms {gbps:6.0f} GB/s "
                      f"{100 * gbps / copy['GBps']:5.1f}% of copy{mark}", flush=True)
                results.append((ms, cfg))
            results.sort(key=lambda r: r[0])
            best[(op, h, pas)] = results[:3]
    print("\nbest per op, h, pass (ms, config); table rows are keyed by BLOCK_N = next_power_of_2(h):")
    for (op, h, pas), top in best.items():
        print(f"{op:10s} h={h:5d} {pas}: " + "; ".join(f"{ms:.4f} {cfg}" for ms, cfg in top))
    for op, h in itertools.product(args.op, args.h):
        if (op, h, "fwd") in best and (op, h, "bwd") in best:
            f, b_ = best[(op, h, "fwd")][0][0], best[(op, h, "bwd")][0][0]
            print(f"{op:10s} h={h:5d}: best fwd {f:.4f} ms + best bwd {b_:.4f} ms = {f + b_:.4f} ms")


if __name__ == "__main__":
    main()
