"""Where does bias-GeLU's fwd+bwd time go? Repeats, kernel-only timings, a profile (GPU)."""
import torch

from fusedlib import unfused
from fusedlib.bench.core import time_ms
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.kernels.bias_gelu import bias_gelu_bwd, bias_gelu_fwd

n, h = 8192, 16384
y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
comp = torch.compile(lambda y, b: unfused.bias_gelu(b, y))


def step():
    bias_gelu_impl(y, b).backward(g)


def step_c():
    comp(y, b).backward(g)


print("fwd kernel   ", [round(time_ms(lambda: bias_gelu_fwd(y.detach(), b.detach())), 4) for _ in range(4)])
print("bwd kernel   ", [round(time_ms(lambda: bias_gelu_bwd(g, y.detach(), b.detach())), 4) for _ in range(4)])
print("fwd+bwd      ", [round(time_ms(step, grad_to_none=[y, b]), 4) for _ in range(4)])
print("compile f+b  ", [round(time_ms(step_c, grad_to_none=[y, b]), 4) for _ in range(4)])
for _ in range(3):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        y.grad = b.grad = None
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
