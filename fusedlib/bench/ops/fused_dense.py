"""Benchmark cases for the GeLU MLP, fc1 -> bias-GeLU -> fc2, with and without GEMM epilogues.

Shape [M, h, F]: M tokens (s·b), hidden h, MLP width F; input [M, h], weights [F, h] and
[h, F], fc1's bias [F] (fc2's bias is left to the layer's bias-dropout-add, as in the MLP with
``skip_bias_add``), bf16. Implementations:

=====================  ==============================================================================
fusedlib               ``fused_dense_gelu_dense`` as it chooses (``epilogue=None``: cuBLASLt's
                       epilogues from M·F = EPILOGUE_MIN_ELEMENTS up)
fusedlib-epilogue      ``epilogue=True``: bias and GeLU in fc1's GEMM, GeLU's derivative in fc2's
                       input-gradient GEMM (cuBLASLt), fc1's bias gradient by fusedlib's column sum
fusedlib-kernel        ``epilogue=False``: fc1's GEMM, fusedlib's bias-GeLU kernels, fc2's GEMM
                       (the MLP with ``bias_activation_fusion`` alone)
eager                  ``linear(gelu_tanh(linear(x, W1, b1)), W2)`` in PyTorch (fc1's bias in
                       cuBLAS's bias epilogue, then the GeLU kernel)
torch.compile          the same, compiled statically for the shape
=====================  ==============================================================================

The GEMMs dominate: records carry FLOPs (``4·M·h·F`` forward, 3x that forward and backward)
and TFLOP/s, not bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...fusions.fused_dense import fused_dense_gelu_dense
from ..core import BenchCase, Impl
from .baselines import compile_impl

DEFAULT_SHAPE = (8192, 2048, 8192)  # chapter 7's block: s·b = 2048·4 tokens, h 2048, ffn 8192
#: chapter 9's model, chapter 7's small and GPT-2-small blocks, and widths between and above
SWEEP_SHAPES = ((32768, 384, 1536), (4096, 512, 2048), (8192, 768, 3072), (8192, 1024, 4096),
                (8192, 4096, 16384))
SHAPE_NAMES = ("M", "h", "F")


def mlp_flops(m: int, h: int, f: int) -> dict[str, int]:
    """Two GEMMs of 2·M·h·F each forward; the backward's four (two input, two weight gradients) twice that."""
    fwd = 4 * m * h * f
    return {"fwd": fwd, "fwd+bwd": 3 * fwd}


def _eager(x, w1, b1, w2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def _case(shape, dtype: torch.dtype) -> BenchCase:
    m, h, f = shape

    def make_inputs(device, requires_grad):
        def r(*size, scale=1.0):
            return (scale * torch.randn(size, device=device, dtype=torch.float32)).to(dtype).requires_grad_(
                requires_grad)
        return r(m, h), r(f, h, scale=h ** -0.5), r(f), r(h, f, scale=f ** -0.5)

    impls = [Impl("fusedlib", lambda x, w1, b1, w2: fused_dense_gelu_dense(x, w1, b1, w2)),
             Impl("fusedlib-epilogue", lambda x, w1, b1, w2: fused_dense_gelu_dense(x, w1, b1, w2, epilogue=True)),
             Impl("fusedlib-kernel", lambda x, w1, b1, w2: fused_dense_gelu_dense(x, w1, b1, w2, epilogue=False)),
             Impl("eager", _eager),
             compile_impl(_eager)]
    return BenchCase("fused_dense", tuple(shape), dtype, make_inputs, {"fwd": None, "fwd+bwd": None}, impls,
                     peak_memory=True, flops=mlp_flops(m, h, f), info={"shape_names": list(SHAPE_NAMES)})


def case(shape: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [M, h, F] with every implementation."""
    return _case(tuple(shape), dtype)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline [8192, 2048, 8192]; with ``sweep`` also :data:`SWEEP_SHAPES`, each with its own
    static compile."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        out += [case(s, dtype) for s in SWEEP_SHAPES]
    return out


def table(records) -> str:
    """Text table of ``fused_dense`` records, one block per shape: each implementation's forward and
    forward + backward time (CUDA-graph replays; ``*`` where only plain launches ran), TFLOP/s,
    and how many times faster ``fusedlib`` is. Other records (the copy ceiling) are ignored.
    """
    rows = [r for r in records if r.get("op") == "fused_dense"]
    if not rows:
        return "no fused_dense records"
    out = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        at = {(r["impl"], r["pass"]): r for r in rows if tuple(r["shape"]) == shape}
        first = next(iter(at.values()))
        out.append(f"fused_dense [M, h, F] = {list(shape)}, {first['dtype']}, {first['device']} "
                   f"(ms: CUDA-graph replays; * plain launches)")
        out.append(f"{'impl':<20}{'fwd ms':>9}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}{'fusedlib is':>14}")
        for impl in dict.fromkeys(i for i, _ in at):
            line, ratios = f"{impl:<20}", []
            for pas, w in (("fwd", 9), ("fwd+bwd", 12)):
                r, f = at.get((impl, pas)), at.get(("fusedlib", pas))
                if r is None:
                    line += f"{'-':>{w}}{'-':>9}"
                    ratios.append("-")
                    continue
                star = "*" if r.get("timer") == "do_bench" else " "
                tf = f"{r['TFLOPs']:.0f}" if r.get("TFLOPs") is not None else "-"
                line += f"{r['ms']:>{w - 1}.4f}{star}{tf:>9}"
                ratios.append(f"{r['ms'] / f['ms']:.2f}x" if f is not None else "-")
            out.append(line + (f"{', '.join(ratios):>14}" if impl != "fusedlib" else ""))
        out.append("")
    return "\n".join(out).rstrip()
