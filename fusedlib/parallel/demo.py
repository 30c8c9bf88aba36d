"""Run tensor-parallel code in several processes: the chapter's live demo and the tests' launcher.

``torch.multiprocessing.spawn`` starts fresh Python processes and sends them the function to
run by name, so that function must live in an importable module (this one, or a test
module), never in a notebook cell. :func:`run_tp` starts ``world_size`` processes, joins them
in one process group (a file rendezvous in a temporary folder: no network port), runs
``fn(rank, world_size, device, *args)`` in each, and returns what each rank returned.

Backends: ``"gloo"`` runs on CPU tensors (Triton's interpreter in every process: slow, for
small sizes); ``"nccl"`` needs one CUDA GPU per rank and runs the compiled kernels.

:func:`compare_paths` is the chapter's worker: on every rank it shards one set of global
logits, runs the unfused and the fused vocab-parallel cross entropy, checks both against
``torch.nn.functional.cross_entropy`` on the full logits in float64, logs the collectives,
and times both.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..runtime import INTERPRET_ON_CPU

__all__ = ["run_tp", "compare_paths", "make_global_inputs", "shard"]


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, result_dir: str, backend: str,
           args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the CPU; one intra-op thread each (and fork-safe)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    # device_id binds the NCCL group to this rank's GPU (without it barrier() warns that it guesses the device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120),
                            **({"device_id": device} if backend == "nccl" else {}))
    try:
        result = fn(rank, world_size, device, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tp(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, device, *args)`` in ``world_size`` processes, one process group.

    Args:
        fn: a function defined at module level in an importable module (pickled by name).
        world_size: number of processes (ranks).
        *args: picklable arguments passed to every rank.
        backend: "gloo" (CPU tensors; kernels in Triton's interpreter) or "nccl" (one GPU per rank).
        start_method: "fork" or "spawn". Default: "fork" for gloo in a process whose kernels are
            already interpreted (a CPU-only machine: the ranks inherit the imported torch and
            fusedlib and start in milliseconds instead of seconds), else "spawn" (a fresh
            interpreter per rank, required for CUDA, and to interpret kernels in the ranks of a
            process that compiles them).

    Returns:
        The return values of ranks 0 .. world_size - 1 (saved with ``torch.save``: tensors,
        numbers, strings, lists and dicts of them).

    Raises:
        ValueError: world_size not an int >= 1, an unknown backend, or "nccl" with fewer than
            ``world_size`` GPUs.
        torch.multiprocessing.ProcessRaisedException: when a rank raises; the other ranks are
            terminated, so a failing rank never leaves the others waiting in a collective.

    Source: fusedlib's own, on ``torch.multiprocessing.spawn``; Megatron-core has no counterpart.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' needs {world_size} GPUs, found {torch.cuda.device_count()}")
    # gloo: CPU tensors, so every rank interprets the kernels (set before the child imports fusedlib).
    env = {"TRITON_INTERPRET": "1"} if backend == "gloo" else {}
    if start_method is None:
        start_method = "fork" if backend == "gloo" and INTERPRET_ON_CPU else "spawn"
    with tempfile.TemporaryDirectory(prefix="fusedlib-tp-") as tmp, _env(**env):
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_entry, args=(fn, world_size, init_file, tmp, backend, args), nprocs=world_size,
                           join=True, start_method=start_method)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def make_global_inputs(n_rows: int, vocab_size: int, dtype: torch.dtype, seed: int, device: torch.device,
                       n_ignored: int = 0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same random full-vocabulary logits [n_rows, V] of ``dtype``, int64 targets [n_rows] and
    float64 upstream gradient [n_rows] on every rank, on ``device`` (drawn on the CPU from one
    seed, whatever torch's default device); the first ``n_ignored`` targets are ``ignore_index``.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = (2 * torch.randn(n_rows, vocab_size, generator=gen, dtype=torch.float64, device="cpu")).to(dtype)
    target = torch.randint(0, vocab_size, (n_rows,), generator=gen, dtype=torch.int64, device="cpu")
    target[:n_ignored] = ignore_index
    grad = torch.randn(n_rows, generator=gen, dtype=torch.float64, device="cpu")
    return logits.to(device), target.to(device), grad.to(device)


def shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s columns of ``full`` [..., V]: [..., V/p] (a contiguous copy), Megatron's split.

    Source: Megatron-LM ``megatron/core/tensor_parallel/utils.py`` (``VocabUtility``: the vocabulary
    split).
    """
    n = full.shape[-1] // world_size
    return full[..., rank * n:(rank + 1) * n].contiguous()


def compare_paths(rank: int, world_size: int, device: torch.device, n_rows: int, vocab_size: int,
                  dtype: torch.dtype, label_smoothing: float, seed: int, repeats: int = 3) -> dict:
    """The chapter's worker: unfused and fused vocab-parallel cross entropy on this rank's shard.

    Returns:
        A dict of plain values: for each path ("unfused", "fused"), whether the loss and this
        rank's gradient shard match ``F.cross_entropy`` on the full logits in float64 (at
        float32 tolerances when ``dtype`` is float32), the collectives it issued
        (``CollectiveLog.summary()``), and the median wall time of ``repeats`` forward +
        backward passes in ms (synchronized on CUDA; the gloo/CPU times are the
        interpreter's and the collectives', not a GPU's).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    from .. import unfused
    from ..fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from .cross_entropy import vocab_parallel_cross_entropy
    from .utils import count_collectives

    full, target, grad = make_global_inputs(n_rows, vocab_size, dtype, seed, device, n_ignored=1)
    ref_logits = full.double().requires_grad_(True)
    ref_loss = unfused.cross_entropy(ref_logits, target, label_smoothing)
    ref_loss.backward(grad)
    ref_grad = shard(ref_logits.grad, rank, world_size)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)

    paths = {
        "unfused": lambda x: vocab_parallel_cross_entropy(x, target, label_smoothing),
        "fused": lambda x: fused_vocab_parallel_cross_entropy(x, target, label_smoothing=label_smoothing),
    }
    out = {}
    for name, fn in paths.items():
        x = shard(full, rank, world_size).requires_grad_(True)
        with count_collectives() as log:
            loss = fn(x)
            loss.backward(grad.to(loss.dtype))
        times = []
        for _ in range(repeats):
            x.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            fn(x).backward(grad.to(loss.dtype))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = {
            "loss_ok": bool(torch.allclose(loss.double(), ref_loss.detach(), atol=tol, rtol=tol)),
            "grad_ok": bool(torch.allclose(x.grad.double(), ref_grad, atol=tol, rtol=tol)),
            "grad_dtype": str(x.grad.dtype).replace("torch.", ""),
            "collectives": log.summary(),
            "n_collectives": len(log),
            "ms": statistics.median(times),
        }
    return out
