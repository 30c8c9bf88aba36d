"""Benchmark cases for cross entropy: fusedlib against eager, torch.compile, Liger, megatron-core.

Every implementation returns the MEAN loss over tokens (a scalar): ``F.cross_entropy``'s
default, Liger's default, and ``.mean()`` of the per-token losses of fusedlib and
megatron-core (a [rows] vector: negligible). The harness backpropagates a random scalar,
so no implementation gets the "grad_output == 1" shortcut Liger takes when it can.

Liger writes the gradient into the logits during its forward pass (its inputs change
between timing iterations; the values stay finite, the timing is unaffected).
megatron-core's ``fused_vocab_parallel_cross_entropy`` needs a process group: a
single-rank group is created here (NCCL, a HashStore: no network) when none exists.

Also: ``python -m fusedlib.bench.ops.cross_entropy --tune`` times fusedlib's forward and
backward kernels alone for a few (BLOCK_N, num_warps) settings, to fill the tile tables in
:mod:`fusedlib.kernels.cross_entropy`.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from ...fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from ..core import BenchCase, Impl, time_ms
from .baselines import compiled, try_import

DEFAULT_SHAPE = (8192, 128256)  # [s*b, V]: 8 K tokens, Llama 3's 128,256-id vocabulary, bf16: 2.1 GB
SWEEP_V = (32000, 50304, 151936, 256000)  # Llama 2, GPT-2 (padded), Qwen 2, Gemma vocabularies


def cross_entropy_bytes(n_rows: int, vocab: int, elem: int, target_elem: int = 8) -> dict[str, int]:
    """Fewest bytes: fwd reads the logits and targets, writes a float32 loss per row; bwd reads
    the logits, targets and a float32 upstream gradient per row, and writes the logits' gradient.

    So 3 logits-sized tensors for fwd+bwd (the per-row terms are 0.01% at the default shape).
    """
    n = n_rows * vocab
    fwd = n * elem + n_rows * (target_elem + 4)
    bwd = 2 * n * elem + n_rows * (target_elem + 4)
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _single_rank_group():
    """The default process group, creating a single-rank one (NCCL on CUDA) if there is none."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _case(shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    n_rows, vocab = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(n_rows, vocab, device=device, dtype=dtype, requires_grad=requires_grad)
        t = torch.randint(0, vocab, (n_rows,), device=device)
        return x, t

    impls = [Impl("fusedlib", lambda x, t: fused_vocab_parallel_cross_entropy(x, t).mean()),
             Impl("torch.compile", compiled(lambda x, t: F.cross_entropy(x, t)))]
    skipped = {}
    if baselines:
        impls.insert(1, Impl("eager", lambda x, t: F.cross_entropy(x, t)))
        liger, why = try_import("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
        if liger is not None:
            impls.append(Impl("liger", lambda x, t: liger.apply(x, t, None)))  # (input, target, weight)
        else:
            skipped["liger"] = why
        mcore, why = try_import("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy")
        if mcore is not None:
            try:
                group = _single_rank_group()
            except Exception as exc:  # no NCCL, or a group of another size already exists
                skipped["megatron-core"] = f"no single-rank process group: {type(exc).__name__}: {exc}"
            else:
                impls.append(Impl("megatron-core", lambda x, t: mcore(x, t, group).mean()))
        else:
            skipped["megatron-core"] = why
    return BenchCase("cross_entropy", shape, dtype, make_inputs,
                     cross_entropy_bytes(n_rows, vocab, torch.finfo(dtype).bits // 8), impls, skipped,
                     peak_memory=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 128256] with every baseline; with ``sweep``, other vocabularies
    (SWEEP_V, 8192 rows) against torch.compile."""
    out = [_case(DEFAULT_SHAPE, dtype, baselines=True)]
    if sweep:
        out += [_case((DEFAULT_SHAPE[0], v), dtype, baselines=False) for v in SWEEP_V if v != DEFAULT_SHAPE[1]]
    return out


#: (BLOCK_N, num_warps) settings :func:`tune` tries for each kernel.
TUNE_SETTINGS = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))


def tune(shape: tuple[int, int] = DEFAULT_SHAPE, dtype: torch.dtype = torch.bfloat16) -> str:
    """Time the forward and backward kernels alone for each of :data:`TUNE_SETTINGS` (CUDA).

    Returns:
        A text table: setting, forward ms and GB/s, backward ms and GB/s.
    """
    from ...kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd

    n_rows, vocab = shape
    x = torch.randn(n_rows, vocab, device="cuda", dtype=dtype)
    t = torch.randint(0, vocab, (n_rows,), device="cuda")
    g = torch.randn(n_rows, device="cuda")
    _, lse = cross_entropy_fwd(x, t, finalize=True)
    nbytes = x.numel() * x.element_size()
    lines = [f"{list(shape)} {dtype}: fwd reads {nbytes / 1e9:.2f} GB, bwd moves {2 * nbytes / 1e9:.2f} GB",
             f"{'BLOCK_N':>8}{'warps':>6}{'fwd ms':>9}{'GB/s':>7}{'bwd ms':>9}{'GB/s':>7}"]
    for block_n, warps in TUNE_SETTINGS:
        fwd = time_ms(lambda: cross_entropy_fwd(x, t, finalize=True, block_n=block_n, num_warps=warps))
        bwd = time_ms(lambda: cross_entropy_bwd(x, t, lse, g, block_n=block_n, num_warps=warps))
        lines.append(f"{block_n:>8}{warps:>6}{fwd:>9.4f}{nbytes / fwd / 1e6:>7.0f}{bwd:>9.4f}"
                     f"{2 * nbytes / bwd / 1e6:>7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedlib.bench.ops.cross_entropy")
    parser.add_argument("--tune", action="store_true", help="time the kernels for TUNE_SETTINGS")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tune:
        print(tune())
    return 0


if __name__ == "__main__":
    sys.exit(main())
