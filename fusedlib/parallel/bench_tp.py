"""``python -m fusedlib.parallel.bench_tp --tp 2 --out DIR``: vocab-parallel cross entropy on p GPUs.

Splits [8192, 128256] bf16 logits (the full vocabulary, the bench op's default shape) over
``--tp`` GPUs (NCCL, one process per GPU) and times, in every rank, a forward + backward of:

* ``fusedlib-tp<p>``: :func:`fusedlib.parallel.fused_vocab_parallel_cross_entropy` (2 all-reduces);
* ``unfused-tp<p>``: :func:`fusedlib.parallel.vocab_parallel_cross_entropy` (3 all-reduces),
  the same Triton kernels: the difference is the collectives alone;
* ``megatron-core-tp<p>``: megatron-core's ``fused_vocab_parallel_cross_entropy`` where it imports.

Each rank runs the same fixed number of iterations (do_bench picks its own count, which would
leave ranks waiting in different collectives), each after flushing the L2 cache and a barrier,
timed with CUDA events; a record's ``ms`` is the largest of the ranks' medians. Records follow
``cross_entropy.json`` (:mod:`fusedlib.bench.core`) with ``"tp": p``; ``bytes`` is the same count as the
single-GPU op (the whole [8192, 128256] problem), so ``GBps`` is the aggregate over the p GPUs;
``peak_bytes`` is rank 0's. Writes ``DIR/cross_entropy_tp<p>.json``; merge it into
``cross_entropy.json`` if the chapter should plot it with the single-GPU records.

Needs ``--tp`` CUDA GPUs. (The whole GPT at tp = p against tp = 1, loss and gradients:
``torchrun --nproc-per-node 2 -m fusedlib.parallel.check_tp``.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["bench_worker", "main"]


def _time_steps(step, reps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of ``reps`` calls of ``step``, each after an L2 flush and a barrier (CUDA
    events; wall clock on CPU, where this only smoke-tests the script)."""
    cuda = device.type == "cuda"
    cache = torch.empty(256 * 1024 * 1024 if cuda else 1, dtype=torch.int8, device=device)  # > the 60 MB L2
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        cache.zero_()
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_worker(rank: int, world_size: int, device: torch.device, shape: tuple[int, int], dtype: torch.dtype,
                 reps: int, warmup: int) -> list[dict]:
    """Runs in every rank (via :func:`fusedlib.parallel.demo.run_tp`): returns rank 0's records.

    Source: fusedlib's own (see the module docstring); the records of :mod:`fusedlib.bench.core`.
    """
    from ..bench.core import environment, peak_extra_bytes
    from ..bench.ops.baselines import try_import
    from ..bench.ops.cross_entropy import cross_entropy_bytes
    from ..fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from .cross_entropy import vocab_parallel_cross_entropy
    from .demo import shard

    n_rows, vocab = shape
    gen = torch.Generator(device=device).manual_seed(0)  # the same full logits on every rank
    full = torch.randn(n_rows, vocab, device=device, dtype=dtype, generator=gen)
    target = torch.randint(0, vocab, (n_rows,), device=device, dtype=torch.int64, generator=gen)
    x = shard(full, rank, world_size).requires_grad_(True)
    del full
    grad = torch.randn(n_rows, device=device, dtype=torch.float32, generator=gen)  # the loss's dtype
    group = dist.group.WORLD

    impls = {
        f"fusedlib-tp{world_size}": lambda: fused_vocab_parallel_cross_entropy(x, target, group),
        f"unfused-tp{world_size}": lambda: vocab_parallel_cross_entropy(x, target, 0.0, group),
    }
    mcore, why = try_import("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy")
    if mcore is not None:
        impls[f"megatron-core-tp{world_size}"] = lambda: mcore(x, target, group)
    elif rank == 0:
        print(f"megatron-core-tp{world_size} not timed: {why}")

    # sanity: the two fusedlib paths agree
    a, b = impls[f"fusedlib-tp{world_size}"](), impls[f"unfused-tp{world_size}"]()
    if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
        raise AssertionError("fused and unfused losses differ")

    nbytes = cross_entropy_bytes(n_rows, vocab, torch.finfo(dtype).bits // 8)
    records = []
    for name, fn in impls.items():
        for pas in ("fwd", "fwd+bwd"):
            if pas == "fwd":
                def step(fn=fn):
                    with torch.no_grad():
                        fn()
            else:
                def step(fn=fn):
                    x.grad = None
                    fn().backward(grad)
            try:
                med = statistics.median(_time_steps(step, reps, warmup, device))
            except Exception as exc:  # a baseline that fails must not stop the others
                if rank == 0:
                    print(f"{name} {pas} failed: {type(exc).__name__}: {exc}")
                continue
            worst = torch.tensor([med], dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            x.grad = None
            peak = peak_extra_bytes(step, device) if device.type == "cuda" else 0
            ms = float(worst.item())
            records.append({
                "op": "cross_entropy", "pass": pas, "impl": name, "shape": [n_rows, vocab],
                "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 5), "bytes": nbytes[pas],
                "GBps": round(nbytes[pas] / (ms * 1e-3) / 1e9, 1), **environment(), "tp": world_size,
                "peak_bytes": int(peak),
            })
    return records


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 (after a message on stderr) with fewer than ``--tp`` CUDA GPUs
        or a vocabulary not divisible by ``--tp``.

    Raises:
        SystemExit: from ``argparse``, for bad arguments or ``--help``.

    Source: fusedlib's own; the records of :mod:`fusedlib.bench.core`.
    """
    from ..bench.core import write_records
    from ..bench.ops.cross_entropy import DEFAULT_SHAPE
    from .demo import run_tp

    parser = argparse.ArgumentParser(prog="python -m fusedlib.parallel.bench_tp", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size: GPUs (default 2)")
    parser.add_argument("--out", default="chapters/data/bench", help="folder for cross_entropy_tp<p>.json")
    parser.add_argument("--shape", type=int, nargs=2, default=list(DEFAULT_SHAPE), help="rows and global vocabulary")
    parser.add_argument("--reps", type=int, default=50, help="timed iterations per implementation and pass")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        print(f"bench_tp needs {args.tp} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.shape[1] % args.tp:
        print(f"the vocabulary {args.shape[1]} must be divisible by --tp {args.tp}", file=sys.stderr)
        return 2
    records = run_tp(bench_worker, args.tp, tuple(args.shape), torch.bfloat16, args.reps, args.warmup,
                     backend="nccl")[0]
    path = write_records(records, f"{args.out}/cross_entropy_tp{args.tp}.json")
    print(f"wrote {path}")
    for r in records:
        print(f"{r['impl']:<22}{r['pass']:<9}{r['ms']:>9.4f} ms{r['GBps']:>8.0f} GB/s (aggregate)"
              f"{r['peak_bytes'] / 1e9:>7.2f} GB peak (rank 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
