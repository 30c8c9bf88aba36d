"""``python -m fusedlib.train --bench``: train the same model several ways in one process and
record the throughput, the memory and the loss of every step: ``<out>/train.json``.

The runs (:data:`BENCH_RUNS`, record ``impl``), each from the same initial weights, on the same
batches in the same order, with the same optimizer and schedule (the command line's flags):

====================  =======================================================================
``fusedlib``          fusedlib's GPTModel, every fusion on, the attention backend of the flags
                      (fusedlib's FlashAttention by default), eager
``fusedlib-unfused``  fusedlib's GPTModel from the unfused spec: torch's norms, softmax,
                      dropout, the materialised attention, the unfused cross entropy; eager
``torch.compile``     the nanoGPT-style plain PyTorch GPT (SDPA), ``torch.compile``d as a whole
``fusedlib-local``    (only when asked for) fusedlib's fused GPTModel with the materialised
                      attention and its softmax kernels: the same attention algorithm as
                      ``fusedlib-unfused``, so the two differ by the fusions alone
``fusedlib-fused-layer``  (only when asked for) ``fusedlib``'s model with each layer a
                      ``FusedTransformerLayer`` (``fused_layer``): the same kernels (the same
                      losses bit for bit where they are deterministic: not SDPA's CUDA kernels),
                      each layer's training forward and backward one autograd node (less host
                      time per layer); eager; any attention backend
``fusedlib-compile``  (only when asked for) ``fusedlib``'s model, ``torch.compile``d as a whole
                      (Inductor fuses what fusedlib leaves unfused and traces fusedlib's
                      kernels into its graph)
``fusedlib-graphs``   (only when asked for) ``fusedlib``'s model with ``cuda_graph_impl="local"``:
                      the layers' and the final norm's forward and backward replayed as two
                      CUDA graphs (CUDA only)
``torch.compile-graphs``  (only when asked for) the plain GPT, ``torch.compile(mode=
                      "reduce-overhead")``: Inductor's code replayed as CUDA graphs (CUDA only);
                      it captures the whole forward and backward, embeddings and loss
                      included, where ``fusedlib-graphs`` captures the block (layers and
                      final norm) only
``fusedlib-full-iteration``  (only when asked for) ``fusedlib``'s model, the whole training step
                      (forward, backward, clipping, AdamW) captured as one CUDA graph
                      (``full_iteration_graph``; CUDA only)
``torch.compile-full-iteration``  (only when asked for) the plain GPT, ``torch.compile``d
                      (default mode) inside the same full-iteration graph: the baseline
                      with the same capture (CUDA only)
====================  =======================================================================

``--bench-profile`` (:func:`profile_steps`) records instead where a step's time goes: the
kernels of a few steps of each run under ``torch.profiler``, per step and by category, in
``<out>/train_profile.json``.

Timing: wall time of logging windows (the device synchronised at their ends, evaluations
outside them); the first ``bench_warmup`` steps (compilation, Triton's autotuning, the
allocator's growth) are left out. ``tokens_per_s`` = timed steps x b x s / timed seconds.

A record (the fields of :mod:`fusedlib.bench.core`'s records where they apply): ``op`` "train", ``impl``, ``label``,
``device``, ``torch``, ``triton``, ``python``, ``corpus`` (:meth:`Corpus.info`), ``config``
(the run's :class:`TrainConfig`), ``params``, ``tokens_per_step``, ``warmup_steps``,
``timed_steps``, ``timed_s``, ``tokens_per_s``, ``ms_per_step``, ``window_tokens_per_s`` (each
timed window's), ``peak_bytes`` (``torch.cuda.max_memory_allocated`` over the run: weights,
master weights, optimizer state, activations, the GEMMs' workspaces; None on a CPU),
``left_bytes`` (``torch.cuda.memory_allocated`` once the earlier runs' objects are collected:
what they left allocated, on an H200 mostly the GEMM libraries' workspaces, one per cuBLAS
handle and stream (32 MiB each there), which live for the process's life; None on a CPU),
``start_bytes`` (the same after those workspaces are released, as the run starts: what
``peak_bytes`` counts that is not the run's own; None on a CPU), ``losses`` (every
step's training loss), ``val`` ([step, loss] pairs), ``wall_s`` (the whole run, compilation and
evaluation included), ``sample`` (text the trained model wrote after :data:`SAMPLE_PROMPT`) and
``sample_settings`` (prompt, tokens, temperature, top_k, seed).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import platform
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..backends import cublaslt
from ..bench.core import environment
from .data import Corpus, load_corpus
from .loop import TrainConfig, Trainer
from .model import count_parameters

__all__ = ["BENCH_RUNS", "DEFAULT_BENCH_RUNS", "run_config", "GRAPH_RUNS", "BENCH_FILE", "SAMPLE_PROMPT", "run_bench", "bench_table",
           "window_median",
           "PROFILE_FILE", "DEFAULT_PROFILE_RUNS", "PROFILE_STEPS", "PROFILE_WARMUP", "profile_steps",
           "profile_steps_table",
           "run_tp_bench", "tp_bench_file",
           "load_train_bench", "smooth", "plot_losses"]

#: impl -> the TrainConfig fields that make it.
_PLAIN_RUN = dict(compile_mode=None, cuda_graph=False, full_iteration_graph=False, fused_layer=False)
BENCH_RUNS: dict[str, dict] = {
    "fusedlib": dict(model="gpt", spec="fused", compile=False, **_PLAIN_RUN),
    "fusedlib-unfused": dict(model="gpt", spec="unfused", compile=False, **_PLAIN_RUN),
    "torch.compile": dict(model="plain", compile=True, **_PLAIN_RUN),
    "fusedlib-local": dict(model="gpt", spec="fused", compile=False, attention_backend="local", **_PLAIN_RUN),
    "fusedlib-fused-layer": dict(model="gpt", spec="fused", compile=False, **{**_PLAIN_RUN, "fused_layer": True}),
    "fusedlib-compile": dict(model="gpt", spec="fused", compile=True, **_PLAIN_RUN),
    "fusedlib-graphs": dict(model="gpt", spec="fused", compile=False, **{**_PLAIN_RUN, "cuda_graph": True}),
    "torch.compile-graphs": dict(model="plain", compile=True, **{**_PLAIN_RUN, "compile_mode": "reduce-overhead"}),
    "fusedlib-full-iteration": dict(model="gpt", spec="fused", compile=False,
                                    **{**_PLAIN_RUN, "full_iteration_graph": True}),
    "torch.compile-full-iteration": dict(model="plain", compile=True, **{**_PLAIN_RUN, "full_iteration_graph": True}),
}
#: The runs that replay CUDA graphs (CUDA only).
GRAPH_RUNS = ("fusedlib-graphs", "torch.compile-graphs", "fusedlib-full-iteration", "torch.compile-full-iteration")
#: The runs of ``--bench`` without ``--bench-runs``.
DEFAULT_BENCH_RUNS = ("fusedlib", "fusedlib-unfused", "torch.compile")
BENCH_FILE = "train.json"
#: The sample's prompt: the start of a function definition.
SAMPLE_PROMPT = "def "
#: The sample's temperature and top-k (a CPU generator seeded with 0 draws it).
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40


def run_config(base: TrainConfig, name: str, **overrides) -> TrainConfig:
    """The configuration of the run ``name`` (:data:`BENCH_RUNS`) on ``base``: the run's fields,
    no output, checkpoint or resume (a benchmark trains from scratch), then ``overrides``.

    Raises:
        KeyError: an unknown run.
        ValueError: the run's configuration refused by :class:`TrainConfig` or
            :meth:`TrainConfig.check_model`, naming the field.

    Source: fusedlib's own (the training benchmark, ``python -m fusedlib.train --bench``).
    """
    cfg = dataclasses.replace(base, **{**BENCH_RUNS[name], "out": None, "resume": False, "stop_at": None,
                                       "save_interval": 0, **overrides})
    cfg.check_model()
    return cfg


def _release_gemm_workspaces() -> None:
    """Release the cuBLAS workspaces torch keeps and cuBLASLt's that fusedlib keeps (CUDA).

    Each (cuBLAS handle, stream) pair a process has run a GEMM on keeps a workspace for the
    process's life (32 MiB each on an H200; a handle per thread, so the autograd engine's thread
    has its own, and a CUDA graph's capture stream its own): without this, a run would find the
    earlier runs' workspaces allocated, and its peak would count them. Only between runs, when
    no graph of an earlier run can be replayed again (its trainer is gone).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    cublaslt.clear_workspaces()


def _one_run(name: str, cfg: TrainConfig, corpus: Corpus, warmup: int, sample_tokens: int,
             log: Callable[[str], object]) -> dict:
    device, left_bytes, start_bytes = cfg.resolved_device(), None, None
    if device.type == "cuda":
        gc.collect()
        left_bytes = torch.cuda.memory_allocated(device)
        _release_gemm_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    trainer = Trainer(cfg, corpus=corpus, log=log)
    trainer.run()
    wall = time.perf_counter() - start
    timed = [(a, b, s) for a, b, s in trainer.windows if a > warmup]
    steps = sum(b - a + 1 for a, b, _ in timed)
    seconds = sum(s for _, _, s in timed)
    tokens = cfg.batch * cfg.seq
    peak = trainer._peak_bytes()
    settings = {"prompt": SAMPLE_PROMPT, "tokens": sample_tokens, "temperature": SAMPLE_TEMPERATURE,
                "top_k": SAMPLE_TOP_K, "seed": 0}
    text = None
    if sample_tokens:
        text = trainer.sample(SAMPLE_PROMPT, sample_tokens, SAMPLE_TEMPERATURE, SAMPLE_TOP_K, seed=0)
    return {"op": "train", "impl": name, "label": cfg.label(), "dtype": "bfloat16" if trainer.bf16 else "float32",
            **environment(), "python": platform.python_version(),
            "corpus": corpus.info(), "config": cfg.record(), "params": count_parameters(trainer.model),
            "tokens_per_step": tokens, "warmup_steps": warmup, "timed_steps": steps, "timed_s": seconds,
            "tokens_per_s": steps * tokens / seconds if seconds else None,
            "ms_per_step": 1e3 * seconds / steps if steps else None,
            "window_tokens_per_s": [(b - a + 1) * tokens / s for a, b, s in timed],
            "peak_bytes": peak, "left_bytes": left_bytes, "start_bytes": start_bytes, "losses": trainer.losses(),
            "val": [[r["step"], r["val_loss"]] for r in trainer.history if "val_loss" in r],
            "wall_s": wall, "sample": text, "sample_settings": settings}


def run_bench(base: TrainConfig, out_dir: Optional[str | Path], runs: Sequence[str] = DEFAULT_BENCH_RUNS,
              warmup: int = 20, sample_tokens: int = 300, log: Callable[[str], object] = print) -> list[dict]:
    """Train ``base`` once per run of ``runs`` (:data:`BENCH_RUNS`) and write the records to
    ``out_dir/train.json`` (when ``out_dir`` is given).

    Args:
        base: the shared configuration; each run overrides the fields of its :data:`BENCH_RUNS`
            entry, and writes no metrics or checkpoint.
        out_dir: where train.json goes, or None.
        runs: names of :data:`BENCH_RUNS`.
        warmup: steps left out of the timing (>= 0, < steps - log_interval so some are timed).
        sample_tokens: length of each run's sample (0: none).
        log: where progress lines go.

    Returns:
        The records, in the order of ``runs``, of the runs that finished. A run that raises is
        logged (its error's first line) and left out, and the others still run: one optional
        configuration that fails must not cost the measurements of the rest.

    Raises:
        ValueError: an unknown run name, or a warmup that leaves no timed window.

    Source: fusedlib's own (the training benchmark, ``python -m fusedlib.train --bench``).
    """
    unknown = [r for r in runs if r not in BENCH_RUNS]
    if unknown or not runs:
        raise ValueError(f"runs must name some of {list(BENCH_RUNS)}, got {list(runs)}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= base.steps - base.log_interval:
        raise ValueError(f"warmup must be an int in [0, steps - log_interval = {base.steps - base.log_interval}] "
                         f"so that some steps are timed, got {warmup!r}")
    corpus = load_corpus(base.cache_dir)
    records = []
    for name in runs:
        try:
            cfg = run_config(base, name)
            record = _one_run(name, cfg, corpus, warmup, sample_tokens, log)
        except Exception as exc:  # noqa: BLE001  (reported, and the other runs go on)
            log(f"{name}: FAILED, left out: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        log(f"{name}: {record['tokens_per_s']:,.0f} tokens/s, {record['ms_per_step']:.2f} ms/step, final loss "
            f"{record['losses'][-1]:.4f}, val {record['val'][-1][1] if record['val'] else float('nan'):.4f}, "
            f"{record['wall_s']:.0f} s in all")
        records.append(record)
        if out_dir is not None:  # after every run, so a run cut short keeps the finished ones
            path = Path(out_dir) / BENCH_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(records, indent=1) + "\n")
    return records


#: The file of :func:`profile_steps` (``--bench-profile``).
PROFILE_FILE = "train_profile.json"
#: The runs :func:`profile_steps` takes by default: the fused model and the compiled plain one.
DEFAULT_PROFILE_RUNS = ("fusedlib", "torch.compile")
#: :func:`profile_steps`' default steps profiled and untimed steps before them.
PROFILE_STEPS, PROFILE_WARMUP = 5, 15


def profile_steps(base: TrainConfig, runs: Sequence[str] = DEFAULT_PROFILE_RUNS, steps: int = PROFILE_STEPS,
                  warmup: int = PROFILE_WARMUP,
                  top: int = 30, out_dir: Optional[str | Path] = None,
                  log: Callable[[str], object] = print) -> dict:
    """Where a training step's time goes: the kernels ``torch.profiler`` records in ``steps``
    steps of each run (after ``warmup`` untimed steps: compilation, autotuning, AdamW's state),
    per step, as chapter 7's block profile (``kernel_summary``: total, launches, categories,
    the ``top`` kernels). The steps are launched kernel by kernel: a run with CUDA graphs
    replays the same kernels, so the graph runs of :data:`BENCH_RUNS` are not offered.
    Profiler ranges (``Optimizer.step#AdamW.step``) are left out (``device_events``).

    Args:
        base: the configuration (each run overrides its :data:`BENCH_RUNS` fields); the trainer
            takes ``warmup + steps`` steps of it, so ``base.steps`` must allow them.
        runs: names of :data:`BENCH_RUNS` outside :data:`GRAPH_RUNS`.
        steps, warmup, top: steps profiled (>= 1), steps before them (>= 0), kernels listed.
        out_dir: the directory :data:`PROFILE_FILE` goes to (None: not written; created if missing).
        log: where the table goes.

    Returns:
        ``{"op": "train_profile", device and versions, "config", "tokens_per_step", "steps",
        "warmup", "impls": {run: kernel_summary}, "skipped": {run: error}}``. On a CPU the CPU
        operators are recorded instead (for tests).

    Raises:
        ValueError: an unknown or graph run, ``steps`` < 1, ``warmup`` < 0, ``top`` < 1,
            ``warmup + steps`` > ``base.steps``, or an ``out_dir`` that is '' or a file.

    Source: fusedlib's own, on ``torch.profiler`` and chapter 7's ``kernel_summary``.
    """
    from torch.profiler import profile as torch_profile

    from ..bench.ops.transformer_layer import device_events, device_span, kernel_summary, profiler_setup

    runs = tuple(runs) if isinstance(runs, (list, tuple)) else runs
    bad = ([r for r in runs if r not in BENCH_RUNS or r in GRAPH_RUNS] if isinstance(runs, tuple)
           else [f"{type(runs).__name__} (not a list or tuple of names)"])
    if bad or not runs:
        raise ValueError(f"runs must name some of {[r for r in BENCH_RUNS if r not in GRAPH_RUNS]} (the graph runs "
                         f"replay the same kernels), got {list(runs) if isinstance(runs, tuple) else bad[0]}")
    for name, v, low in (("steps", steps, 1), ("warmup", warmup, 0), ("top", top, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if warmup + steps > base.steps:
        raise ValueError(f"warmup + steps ({warmup + steps}) must be at most the configuration's steps ({base.steps})")
    if out_dir is not None and (str(out_dir) == "" or Path(out_dir).is_file()):
        raise ValueError(f"out_dir must be a directory (or None), got {str(out_dir)!r}"
                         + (" (a file)" if str(out_dir) else " (which would mean the current directory)"))
    device = base.resolved_device()
    cuda = device.type == "cuda"
    activities, kind, sync = profiler_setup(device)
    corpus = load_corpus(base.cache_dir)
    out = {"op": "train_profile", **environment(), "python": platform.python_version(),
           "config": base.record(), "tokens_per_step": base.batch * base.seq, "steps": steps,
           "warmup": warmup, "impls": {}, "skipped": {}}
    for name in runs:
        trainer = None
        try:
            cfg = run_config(base, name, progress=False)
            trainer = Trainer(cfg, corpus=corpus, log=lambda line: None)
            for _ in range(warmup):
                trainer.step()
            sync()
            with torch_profile(activities=activities) as prof:
                for _ in range(steps):
                    trainer.step()
                sync()
            out["impls"][name] = kernel_summary(device_events(prof, kind), steps, top, device_span(prof, kind))
        except Exception as exc:  # noqa: BLE001  (one failing run must not lose the others)
            out["skipped"][name] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            del trainer
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
    if out_dir is not None:
        path = Path(out_dir) / PROFILE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    log(profile_steps_table(out))
    return out


def profile_steps_table(prof: dict, top: int = 12) -> str:
    """Text table of a :func:`profile_steps` result: per run, the kernel time per step, its
    categories, then its ``top`` kernels (chapter 7's ``kernel_summary_lines``).

    Source: fusedlib's own (chapter 7's ``kernel_summary_lines``).
    """
    from ..bench.ops.transformer_layer import kernel_summary_lines

    c = prof["config"]
    lines = [f"kernels of one training step ({prof['steps']} steps profiled, launched one by one), {c['layers']} "
             f"layers, hidden {c['hidden']}, batch {c['batch']} x seq {c['seq']}, {prof['device']}"]
    for name, p in prof["impls"].items():
        lines += kernel_summary_lines(name, p, top)
    for name, why in prof.get("skipped", {}).items():
        lines.append(f"{name}: not profiled ({why})")
    return "\n".join(lines)


def tp_bench_file(world_size: int) -> str:
    """``train_tp<p>.json``: the file of :func:`run_tp_bench` with ``p`` ranks.

    Source: fusedlib's own (the training benchmark, ``python -m fusedlib.train --bench``).
    """
    return f"train_tp{world_size}.json"


def run_tp_bench(base: TrainConfig, out_dir: Optional[str | Path], warmup: int = 20,
                 log: Callable[[str], object] = print) -> list[dict]:
    """Train ``base`` with tensor parallelism over every rank of the world (tp = p) and, on rank 0
    alone, without (tp = 1), from the same weights on the same batches; rank 0 writes both records to
    ``out_dir/train_tp<p>.json`` (:func:`tp_bench_file`). Every rank must call it, in a world of p
    ranks with ``fusedlib.parallel.initialize_model_parallel(p)`` done (``torchrun --nproc-per-node p
    -m fusedlib.train --bench-tp``); the other ranks wait at a barrier while rank 0 trains tp = 1.

    Records: as :func:`run_bench`'s (``op`` "train_tp", no sample), plus ``tp``, ``sequence_parallel``
    and ``backend`` (NCCL or gloo). Returns them on rank 0, an empty list on the others.

    Raises:
        ValueError: p < 2, a warmup that leaves no timed window, or a ``base`` that cannot run with
            tp = p (e.g. ``fused_layer``, ``cuda_graph`` or ``full_iteration_graph``: one rank
            only), naming the field.

    Source: fusedlib's own (the training benchmark, ``torchrun ... -m fusedlib.train --bench-tp``).
    """
    import torch.distributed as dist

    from ..parallel import parallel_state

    p = parallel_state.get_tensor_model_parallel_world_size()
    if p < 2 or dist.get_world_size() != p:
        raise ValueError(f"run_tp_bench needs a world of p >= 2 ranks in one tensor-parallel group, got tp {p} of "
                         f"{dist.get_world_size() if dist.is_initialized() else 1} ranks")
    if not 0 <= warmup <= base.steps - base.log_interval:
        raise ValueError(f"warmup must be in [0, steps - log_interval = {base.steps - base.log_interval}], "
                         f"got {warmup!r}")
    rank = dist.get_rank()
    if rank != 0:
        log = lambda line: None  # noqa: E731  (rank 0 speaks for all)
    corpus = load_corpus(base.cache_dir)
    records = []
    for tp in (p, 1):
        cfg = dataclasses.replace(base, model="gpt", tp=tp, out=None, resume=False, stop_at=None, save_interval=0,
                                  sequence_parallel=base.sequence_parallel and tp > 1)
        if tp == 1 and rank != 0:
            dist.barrier()
            continue
        record = _one_run("fusedlib" if cfg.spec == "fused" else "fusedlib-unfused", cfg, corpus, warmup, 0, log)
        record.update(op="train_tp", tp=tp, sequence_parallel=cfg.sequence_parallel, backend=dist.get_backend())
        log(f"tp = {tp}: {record['tokens_per_s']:,.0f} tokens/s, final loss {record['losses'][-1]:.4f}")
        records.append(record)
        if tp == 1:
            dist.barrier()
    if rank == 0 and out_dir is not None:
        path = Path(out_dir) / tp_bench_file(p)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
    return records if rank == 0 else []


def window_median(record: dict) -> Optional[float]:
    """The median of a run's per-window tokens/s (windows of ``log_interval`` steps; the upper
    median for an even count: the middle of the sorted windows), or None for a record without
    windows. Robust to the few slow windows that drag a run's mean, as the kernel benchmarks'
    median timings are to slow repetitions.

    Source: fusedlib's own (the training benchmark, ``python -m fusedlib.train --bench``).
    """
    windows = sorted(record.get("window_tokens_per_s") or ())
    return windows[len(windows) // 2] if windows else None


def bench_table(records: Sequence[dict]) -> str:
    """Text table of train.json's records: tokens/s over all timed steps and the median of the
    windows' (:func:`window_median`), ms per step, peak memory (GB), where a record has it the
    memory the earlier runs left allocated (``left_bytes``, GB; released before the run), the
    final training loss (mean of the last 5% of steps) and validation loss, and, where the records
    hold a run named ``fusedlib`` (the eager fused model), how many times that run's throughput
    each other run's is (by tokens/s over all timed steps); without one, no such column.

    Source: fusedlib's own (the training benchmark, ``python -m fusedlib.train --bench``).
    """
    rows = [r for r in records if r.get("op") == "train"]
    if not rows:
        return "no train records"
    first = rows[0]
    c = first["config"]
    fused = next((r for r in rows if r["impl"] == "fusedlib"), None)
    bf16 = c["bf16"] or (c["bf16"] is None and first["device"] != "cpu")
    width = max(22, 2 + max(len(r["impl"]) for r in rows))
    left = any(r.get("left_bytes") is not None for r in rows)
    out = [f"{first['params'] / 1e6:.2f} M parameters ({c['layers']} layers, hidden {c['hidden']}, "
           f"{c['heads']} heads), batch {c['batch']} x seq {c['seq']} = {first['tokens_per_step']} tokens per step, "
           f"{c['steps']} steps, {'bf16' if bf16 else 'float32'}, {first['device']}",
           f"{'impl':<{width}}{'tokens/s':>12}{'median':>12}{'ms/step':>9}{'peak GB':>9}"
           + (f"{'left GB':>9}" if left else "") + f"{'train loss':>12}{'val loss':>10}"
           + (f"{'fusedlib is':>13}" if fused is not None else "")]
    for r in rows:
        tail = r["losses"][-max(1, len(r["losses"]) // 20):]
        peak = f"{r['peak_bytes'] / 1e9:.2f}" if r.get("peak_bytes") is not None else "-"
        val = f"{r['val'][-1][1]:.4f}" if r["val"] else "-"
        ratio = f"{fused['tokens_per_s'] / r['tokens_per_s']:.2f}x" if fused is not None and r is not fused else ""
        med = window_median(r)
        med = f"{med:,.0f}" if med is not None else "-"
        left_cell = ((f"{r['left_bytes'] / 1e9:.2f}" if r.get("left_bytes") is not None else "-").rjust(9)
                     if left else "")
        out.append(f"{r['impl']:<{width}}{r['tokens_per_s']:>12,.0f}{med:>12}{r['ms_per_step']:>9.2f}{peak:>9}"
                   f"{left_cell}{sum(tail) / len(tail):>12.4f}{val:>10}"
                   + (f"{ratio:>13}" if fused is not None else ""))
    return "\n".join(out)


def load_train_bench(name: str = BENCH_FILE, directory: Optional[str | Path] = None) -> list[dict]:
    """The stored records of ``python -m fusedlib.train --bench`` (``chapters/data/bench/<name>``,
    or ``directory/<name>``).

    Raises:
        FileNotFoundError: naming the file and the command that writes it.

    Source: the JSON files of ``python -m fusedlib.train --bench``.
    """
    if directory is None:
        from ..book import bench_dir

        directory = bench_dir()
    path = Path(directory) / name
    if not path.exists():
        how = (f": `python -m fusedlib.train --bench --out {Path(directory)}` writes it on a GPU"
               if name == BENCH_FILE else "")
        raise FileNotFoundError(f"{path} not found{how}")
    from ..book import read_record

    return read_record(path)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start): the same length as ``values``.

    Raises:
        ValueError: window < 1.

    Source: fusedlib's own.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


#: Line colours of the runs (fusedlib's chapters' colours).
RUN_COLORS = {"fusedlib": "#d62728", "fusedlib-unfused": "#f4a6a6", "torch.compile": "#5c6bc0",
              "fusedlib-local": "#8c1c1c", "fusedlib-fused-layer": "#ffbb78", "fusedlib-compile": "#ff7f0e",
              "fusedlib-graphs": "#2ca02c",
              "torch.compile-graphs": "#17becf", "fusedlib-full-iteration": "#9467bd",
              "torch.compile-full-iteration": "#1f3a93"}
#: Line styles (matplotlib's ``linestyle``), so that curves lying on each other stay visible.
RUN_STYLES = {"fusedlib": "-", "fusedlib-unfused": "--", "torch.compile": ":", "fusedlib-local": "-.",
              "fusedlib-fused-layer": (0, (1, 3)),
              "fusedlib-compile": "-", "fusedlib-graphs": "-", "torch.compile-graphs": ":",
              "fusedlib-full-iteration": "-", "torch.compile-full-iteration": ":"}


def plot_losses(records: Sequence[dict], window: int = 25, ax=None, skip: int = 0):
    """Training loss against step for each record (a trailing mean over ``window`` steps, the
    raw losses faint behind it) and the validation losses as markers.

    Args:
        records: train.json's records. window: the smoothing. ax: an Axes (default: a new figure).
        skip: leave out the first ``skip`` steps (the fast initial drop hides the rest).

    Returns:
        The Axes.

    Source: the records of ``python -m fusedlib.train --bench``; drawn with matplotlib.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for r in records:
        color = RUN_COLORS.get(r["impl"])
        steps = list(range(1, len(r["losses"]) + 1))[skip:]
        ax.plot(steps, r["losses"][skip:], color=color, alpha=0.15, linewidth=0.6)
        ax.plot(steps, smooth(r["losses"], window)[skip:], linestyle=RUN_STYLES.get(r["impl"], "-"), color=color,
                linewidth=1.6, label=f"{r['impl']} ({r['label']})")
        val = [(s, v) for s, v in r["val"] if s > skip]
        if val:
            ax.plot(*zip(*val), "o", color=color, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats per byte)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax
