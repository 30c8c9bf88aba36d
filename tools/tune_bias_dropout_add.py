"""Tune the bias-dropout-add kernels on a GPU: kernel-only timings per tile, twice each.

Usage (GPU): python tools/tune_bias_dropout_add.py
Prints the copy ceiling; the forward through the public API (seed drawn each call) and
kernel-only with a fixed seed, so the cost of drawing the seed shows; the forward without
dropout (p = 0: no Philox), which bounds what the random numbers cost; torch.compile of the
unfused function; then the forward kernel per tile and the backward kernel per tile and
programs per SM. The mask depends on (seed, row, col) only, so every tile computes the same
result. Winners go into _DROPOUT_TILES / _BWD_SCALE in fusedlib/kernels/bias_dropout_add.py,
numbers into NOTES.md.
"""
import itertools

import torch

from fusedlib import unfused, utils
from fusedlib.bench.core import copy_record, time_ms
from fusedlib.bench.ops.bias_dropout_add import PROB, bias_dropout_add_bytes
from fusedlib.fusions.fused_bias_dropout import bias_dropout_add_fused_train
from fusedlib.kernels import bias_dropout_add as k

n, h = 32768, 4096
x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
b = torch.randn(h, device="cuda", dtype=torch.bfloat16)
r = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
seed = k.philox_seed(x.device)
fwd_bytes = bias_dropout_add_bytes(n, h, 2)["fwd"]
bwd_bytes = bias_dropout_add_bytes(n, h, 2)["fwd+bwd"] - fwd_bytes
copy = copy_record()["GBps"]
print(f"copy {copy:.0f} GB/s; goal: fwd >= {0.85 * copy:.0f} GB/s = {fwd_bytes / (0.85 * copy) / 1e6:.4f} ms")


def report(label, ms, nbytes):
    print(f"{label:<48} {' '.join(f'{t:.4f}' for t in ms)} ms {nbytes / min(ms) / 1e6:6.0f} GB/s "
          f"({100 * nbytes / min(ms) / 1e6 / copy:.1f}% of copy)", flush=True)


with torch.no_grad():
    report("fwd, public API (draws a seed per call)",
           [time_ms(lambda: bias_dropout_add_fused_train((x, b), r, PROB)) for _ in range(2)], fwd_bytes)
    report("fwd kernel, fixed seed",
           [time_ms(lambda: k.bias_dropout_add_fwd(x, b, r, seed, PROB)) for _ in range(2)], fwd_bytes)
    report("fwd kernel, no dropout (no Philox)",
           [time_ms(lambda: k.bias_dropout_add_fwd(x, b, r, None, 0.0)) for _ in range(2)], fwd_bytes)
    comp = torch.compile(lambda x, b, r: unfused.bias_dropout_add((x, b), r, PROB, True))
    report("torch.compile of the unfused function", [time_ms(lambda: comp(x, b, r)) for _ in range(2)], fwd_bytes)

    # (BLOCK_N, BLOCK_M, num_warps) for long rows
    fwd_tiles = [(2048, 2, 4), (1024, 4, 4), (4096, 1, 4), (1024, 2, 2), (2048, 4, 8), (4096, 2, 8), (1024, 8, 8)]
    for block_n, block_m, warps in fwd_tiles:
        k._DROPOUT_TILES = ((1 << 62, block_n, block_m, warps),)
        report(f"fwd BLOCK_N={block_n:5d} BLOCK_M={block_m:2d} warps={warps:2d}",
               [time_ms(lambda: k.bias_dropout_add_fwd(x, b, r, seed, PROB)) for _ in range(2)], fwd_bytes)

    bwd_tiles = [(2048, 2, 4), (1024, 4, 4), (4096, 1, 4), (2048, 4, 8)]
    for (block_n, block_m, warps), bwd_scale, per_sm in itertools.product(bwd_tiles, (1, 2), (8, 16, 32)):
        k._DROPOUT_TILES = ((1 << 62, block_n, block_m, warps),)
        k._BWD_SCALE = bwd_scale
        utils.PROGRAMS_PER_SM = per_sm
        report(f"bwd BLOCK_N={block_n:5d} BLOCK_M={block_m * bwd_scale:2d} warps={warps * bwd_scale:2d} "
               f"per_sm={per_sm // bwd_scale:2d}",
               [time_ms(lambda: k.bias_dropout_add_bwd(g, torch.bfloat16, seed, PROB, True, True)) for _ in range(2)],
               bwd_bytes)
