"""CPU cost of one bias-GeLU autograd step on the GPU machine: cProfile, and a bare Triton launch."""
import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl

from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl

n, h = 8192, 16384
y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)


@triton.jit
def _noop(X_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X_ptr + offs, tl.load(X_ptr + offs, mask=offs < n), mask=offs < n)


x = torch.zeros(16, device="cuda")
for _ in range(10):
    _noop[(1,)](x, 16, BLOCK=16)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(1000):
    _noop[(1,)](x, 16, BLOCK=16)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"bare triton launch: {1e6 * (t1 - t0) / 1000:.1f} us CPU")
t0 = time.perf_counter()
for _ in range(1000):
    x.add_(1)
t1 = time.perf_counter()
print(f"bare torch add_: {1e6 * (t1 - t0) / 1000:.1f} us CPU")
torch.cuda.synchronize()


def step():
    y.grad = b.grad = None
    bias_gelu_impl(y, b).backward(g)


for _ in range(5):
    step()
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    step()
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
