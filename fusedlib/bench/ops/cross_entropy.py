"""Benchmark cases for cross entropy: fusedlib against eager, torch.compile, Liger, megatron-core.

Every implementation returns the MEAN loss over tokens (a scalar): ``F.cross_entropy``'s
default, Liger's default, and ``.mean()`` of the per-token losses of fusedlib and
megatron-core (a [rows] vector: negligible). The harness backpropagates a random scalar,
so no implementation gets the "grad_output == 1" shortcut Liger takes when it can.

Liger writes the gradient into the logits during its forward pass (its inputs change
between timing iterations; the values stay finite, the timing is unaffected).
megatron-core's ``fused_vocab_parallel_cross_entropy`` needs a process group: a
single-rank group is created (NCCL, a HashStore: no network) at its first call, when none
exists.

Tuning the kernels' tiles: ``python -m fusedlib.bench.tune --op cross_entropy``
(``python -m fusedlib.bench.ops.cross_entropy --tune`` runs the same).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from ...fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

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
             compile_impl(lambda x, t: F.cross_entropy(x, t))]
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
            impls.append(Impl("megatron-core", _megatron_ce(mcore)))
        else:
            skipped["megatron-core"] = why
    return BenchCase("cross_entropy", shape, dtype, make_inputs,
                     cross_entropy_bytes(n_rows, vocab, torch.finfo(dtype).bits // 8), impls, skipped,
                     peak_memory=True)


def _megatron_ce(mcore):
    """megatron-core's loss, mean over tokens, on a single-rank group made at the first call
    (building a case makes no process group: ``--host`` never calls it). A failure there (no
    NCCL, a group of another size) is recorded as this baseline's reason for not running."""
    group = []

    def fn(x, t):
        if not group:
            group.append(_single_rank_group())
        return mcore(x, t, group[0]).mean()

    return fn


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, V] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [8192, 128256] with every baseline; with ``sweep``, other vocabularies
    (SWEEP_V, 8192 rows) against torch.compile (compiled statically for each shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        out += [_case((DEFAULT_SHAPE[0], v), dtype, baselines=False) for v in SWEEP_V if v != DEFAULT_SHAPE[1]]
    return out


def main(argv: list[str] | None = None) -> int:
    """``--tune``: the same as ``python -m fusedlib.bench.tune --op cross_entropy``."""
    parser = argparse.ArgumentParser(prog="python -m fusedlib.bench.ops.cross_entropy")
    parser.add_argument("--tune", action="store_true",
                        help="time the kernels' tile candidates (python -m fusedlib.bench.tune --op cross_entropy)")
    args = parser.parse_args(argv)
    if not args.tune:
        parser.print_help()
        return 0
    from ..tune import main as tune_main

    return tune_main(["--op", "cross_entropy"])


if __name__ == "__main__":
    sys.exit(main())
