"""Tune the softmax kernels on a GPU: kernel-only timings per tile, twice each.

Usage (GPU): python tools/tune_softmax.py
Prints, per candidate tile, the forward and backward host launchers' median times (no autograd)
and effective GB/s by the benchmark's byte counts, each timed twice (the spread is the noise);
then the CPU enqueue time of one autograd fwd+bwd step. Winners go into the tables at the top
of fusedlib/kernels/softmax.py (_ROWS_PER_PROGRAM, calculate_settings' warps, MAX_REGISTER_BLOCK,
ONLINE_BLOCK_N, ONLINE_NUM_WARPS).
"""
import itertools
import time

import torch

from fusedlib.bench.core import copy_record, time_ms
from fusedlib.bench.ops._softmax_common import SCALE, causal_bytes, masked_bytes
from fusedlib.bench.ops.masked_softmax import padding_mask
from fusedlib.fusions.fused_softmax import ScaledUpperTriangMaskedSoftmax
from fusedlib.kernels import softmax as ks

settings = ks.softmax_settings
print(f"copy {copy_record()['GBps']:.0f} GB/s", flush=True)


def run(name, x4, mask, band, nbytes, candidates):
    g4 = torch.randn_like(x4)
    p4, _ = ks.softmax_fwd(x4, SCALE, mask, band)
    for cfg in candidates:
        ks.softmax_settings = lambda n_cols, mrb=None, cfg=cfg: dict(cfg)
        try:
            f = [time_ms(lambda: ks.softmax_fwd(x4, SCALE, mask, band)) for _ in range(2)]
            b = [time_ms(lambda: ks.softmax_bwd(g4, p4, SCALE, band)) for _ in range(2)]
        except Exception as exc:  # a tile that does not compile (registers, shared memory)
            print(f"{name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        finally:
            ks.softmax_settings = settings
        fb = nbytes["fwd"]
        bb = nbytes["fwd+bwd"] - fb
        print(f"{name} {cfg}  fwd {f[0]:.4f} {f[1]:.4f} ms {fb / min(f) / 1e6:5.0f} GB/s | "
              f"bwd {b[0]:.4f} {b[1]:.4f} ms {bb / min(b) / 1e6:5.0f} GB/s", flush=True)


def reg(block_m, block_n, warps):
    return {"online": False, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps}


def online(block_n, warps):
    return {"online": True, "BLOCK_M": 1, "BLOCK_N": block_n, "num_warps": warps}


row_2048 = [reg(m, 2048, w) for m, w in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]]
x = torch.randn(128, 1, 2048, 2048, device="cuda", dtype=torch.bfloat16)
run("causal [128, 2048, 2048]", x, None, ks.causal_band(2048, 2048), causal_bytes(128, 2048, 2048, 2), row_2048)
x = torch.randn(4, 32, 2048, 2048, device="cuda", dtype=torch.bfloat16)
mask = padding_mask(4, 2048, 2048, "cuda")
run("masked [4, 32, 2048, 2048]", x, mask, None, masked_bytes(4, 32, 2048, 2048, 4, 2), row_2048)
del x, mask

x = torch.randn(4, 32, 128, 32768, device="cuda", dtype=torch.bfloat16)
mask = padding_mask(4, 128, 32768, "cuda")
long_rows = ([online(n, w) for n, w in itertools.product((2048, 4096, 8192), (4, 8, 16))]
             + [reg(1, 32768, 16), reg(1, 32768, 32)])
run("masked [4, 32, 128, 32768]", x, mask, None, masked_bytes(4, 32, 128, 32768, 4, 2), long_rows)
x = torch.randn(4, 32, 256, 16384, device="cuda", dtype=torch.bfloat16)
mask = padding_mask(4, 256, 16384, "cuda")
run("masked [4, 32, 256, 16384]", x, mask, None, masked_bytes(4, 32, 256, 16384, 4, 2),
    [reg(1, 16384, 8), reg(1, 16384, 16), reg(1, 16384, 32), online(4096, 8), online(8192, 16)])
del x, mask

x = torch.randn(128, 2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn_like(x)


def step():
    ScaledUpperTriangMaskedSoftmax.apply(x, SCALE).backward(g)


for _ in range(3):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    x.grad = None
    step()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"causal autograd fwd+bwd: CPU enqueue {1e3 * (t1 - t0) / 20:.3f} ms/step, wall {1e3 * (t2 - t0) / 20:.3f} ms/step")
