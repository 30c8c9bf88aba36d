"""Tune the bias-GeLU kernels on a GPU: kernel-only timings per tile, twice each.

Usage (GPU): python tools/tune_bias_gelu.py
Prints, per candidate, the forward kernel's and the backward kernel's (host launcher,
no autograd) median times and effective GB/s; each is timed twice, the spread is the
noise. Then the CPU time of one autograd fwd+bwd step (enqueue only), which bounds how
fast a step can be timed by do_bench. Winners go into the tile tables in
fusedlib/kernels/bias_gelu.py and fusedlib.utils.PROGRAMS_PER_SM, numbers into NOTES.md.
"""
import itertools
import time

import torch

from fusedlib import utils
from fusedlib.bench.core import copy_record, time_ms
from fusedlib.bench.ops.bias_gelu import bias_gelu_bytes
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.kernels import bias_gelu as k

n, h = 8192, 16384
y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
yd, bd = y.detach(), b.detach()
fwd_bytes = bias_gelu_bytes(n, h, 2)["fwd"]
bwd_bytes = bias_gelu_bytes(n, h, 2)["fwd+bwd"] - fwd_bytes
print(f"copy {copy_record()['GBps']:.0f} GB/s")


def step():
    bias_gelu_impl(y, b).backward(g)


for _ in range(5):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(50):
    y.grad = b.grad = None
    step()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"autograd fwd+bwd step: CPU enqueue {1e3 * (t1 - t0) / 50:.3f} ms/step, wall {1e3 * (t2 - t0) / 50:.3f} ms/step")
print("fwd+bwd do_bench", [round(time_ms(step, grad_to_none=[y, b]), 4) for _ in range(3)])

fwd_tiles = [(1024, 2, 4), (2048, 2, 8), (4096, 1, 8)]
for block_n, block_m, warps in fwd_tiles:
    k._ELEMENTWISE_TILES = ((1 << 62, block_n, block_m, warps),)
    f = [time_ms(lambda: k.bias_gelu_fwd(yd, bd)) for _ in range(2)]
    print(f"fwd BLOCK_N={block_n:5d} BLOCK_M={block_m:2d} warps={warps:2d}  {f[0]:.4f} {f[1]:.4f} ms "
          f"{fwd_bytes / min(f) / 1e6:6.0f} GB/s", flush=True)

bwd_tiles = [(2048, 4, 8), (1024, 4, 4), (2048, 2, 8), (4096, 2, 8), (1024, 8, 8), (4096, 4, 16)]
for (block_n, block_m, warps), per_sm in itertools.product(bwd_tiles, (4, 8, 16)):
    k._BWD_TILES = ((1 << 62, block_n, block_m, warps),)
    utils.PROGRAMS_PER_SM = per_sm
    t = [time_ms(lambda: k.bias_gelu_bwd(g, yd, bd)) for _ in range(2)]
    print(f"bwd BLOCK_N={block_n:5d} BLOCK_M={block_m:2d} warps={warps:2d} per_sm={per_sm:3d}  "
          f"{t[0]:.4f} {t[1]:.4f} ms {bwd_bytes / min(t) / 1e6:6.0f} GB/s", flush=True)
