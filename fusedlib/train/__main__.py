"""``python -m fusedlib.train``: train a small GPT on the Python standard library's source.

Usage::

    python -m fusedlib.train --steps 2000 --out runs/fused            # fusedlib's fused GPT
    python -m fusedlib.train --spec unfused --out runs/unfused        # the unfused spec
    python -m fusedlib.train --model plain --compile --out runs/plain # nanoGPT-style, compiled
    python -m fusedlib.train --fused-layer --out runs/one-node        # each layer one autograd node
    python -m fusedlib.train --out runs/fused --resume                # continue from the checkpoint
    python -m fusedlib.train --sample 300 --prompt "class "           # print a sample at the end
    python -m fusedlib.train --bench --out chapters/data/bench        # three runs -> train.json
    torchrun --nproc-per-node 2 -m fusedlib.train --tp 2 --out runs/tp2   # tensor parallel, 2 GPUs
    torchrun --nproc-per-node 2 -m fusedlib.train --bench-tp --steps 300 --out chapters/data/bench
                                                         # tp = 2 and tp = 1 -> train_tp2.json

Every flag is a field of :class:`fusedlib.train.TrainConfig` (``--help`` lists them with their
defaults). Metrics go to ``<out>/metrics.jsonl`` (one JSON object per line), the checkpoint to
``<out>/checkpoint.pt`` (with ``--tp``, one ``checkpoint-tp<rank>.pt`` per rank). ``--bench`` runs
:data:`fusedlib.train.bench.DEFAULT_BENCH_RUNS` with the other flags and writes ``<out>/train.json``
(default out: chapters/data/bench); ``--bench-tp``, under ``torchrun`` with p processes, trains the
fused GPTModel with tp = p and, on rank 0, with tp = 1, and writes ``<out>/train_tp<p>.json``
(:func:`fusedlib.train.bench.run_tp_bench`).

Exit status: 0; 1 when a ``--bench`` or ``--bench-profile`` run failed (the others are still
measured and written), or when the training loss became non-finite (the run diverged) or a
step did not fit in memory (one ``error:`` line; the metrics before it are written, the last
checkpoint is kept);
2 for a bad flag (argparse's, with a message naming the flag), and for a run that cannot start: a
``--resume`` without a checkpoint, or with one of another configuration, another corpus or not a
checkpoint at all; a corpus split shorter than ``--seq`` + 1 (one ``error:`` line, no traceback).
A run without ``--resume`` into a directory that holds a checkpoint starts it over: the
earlier checkpoint is removed with the metrics.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Optional

import torch

from ..transformer.enums import AttnBackend
from .model import MODELS, SPECS


#: The program name in usage and error lines.
PROG = "python -m fusedlib.train"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in ``--help``, except None (the option's help says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    from .loop import TrainConfig

    d = TrainConfig()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].replace("``", ""),
                                formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=MODELS, default=d.model, help="gpt: fusedlib's GPTModel; plain: nanoGPT-style")
    m.add_argument("--spec", choices=SPECS, default=argparse.SUPPRESS,
                   help=f"fusedlib's layer spec (--model gpt; default {d.spec})")
    m.add_argument("--attention-backend", choices=list(AttnBackend.__members__), default=argparse.SUPPRESS,
                   help="the fused spec's attention: flash = fusedlib's FlashAttention, auto and fused = "
                        "scaled_dot_product_attention, local and unfused = materialised "
                        f"(--model gpt --spec fused; default {d.attention_backend})")
    m.add_argument("--layers", type=int, default=d.layers, help="transformer layers")
    m.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    m.add_argument("--heads", type=int, default=d.heads, help="attention heads (dividing --hidden)")
    m.add_argument("--ffn", type=int, default=d.ffn, help="MLP width (default 4 x hidden)")
    m.add_argument("--seq", type=int, default=d.seq, help="tokens (bytes) per sequence")
    m.add_argument("--dropout", type=float, default=d.dropout, help="hidden and attention dropout")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    o.add_argument("--steps", type=int, default=d.steps, help="training steps")
    o.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    o.add_argument("--min-lr", type=float, default=d.min_lr,
                   help="the rate the half cosine falls to at step index --steps, one past the last step "
                        "(default lr/10)")
    o.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps (fewer than --steps)")
    o.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's, on the matrices")
    o.add_argument("--beta1", type=float, default=d.beta1, help="AdamW's first-moment decay")
    o.add_argument("--beta2", type=float, default=d.beta2, help="AdamW's second-moment decay")
    o.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max global gradient norm (0: none)")
    e = p.add_argument_group("execution")
    e.add_argument("--device", default=d.device, help="default: cuda when present, else cpu")
    e.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=d.bf16,
                   help="bf16 weights with float32 master weights (default: on CUDA)")
    e.add_argument("--compile", action="store_true", help="torch.compile the model")
    e.add_argument("--compile-mode", default=d.compile_mode,
                   help="torch.compile's mode, e.g. reduce-overhead (with --compile)")
    e.add_argument("--cuda-graph", action="store_true",
                   help="fusedlib's GPTModel with its layers and final norm as CUDA graphs "
                        "(cuda_graph_impl='local'; CUDA only)")
    e.add_argument("--full-iteration-graph", action="store_true",
                   help="the whole training step (forward, backward, clipping, AdamW) as one CUDA graph, "
                        "captured after a few eager steps (CUDA only)")
    e.add_argument("--fused-layer", action="store_true",
                   help="each layer a FusedTransformerLayer: its training forward and backward one autograd "
                        "node (the same kernels, the same results where they are deterministic, less host "
                        "time; --model gpt --spec fused, --tp 1; not with --compile, --cuda-graph, "
                        "--full-iteration-graph; --bench and --bench-profile take it as the run "
                        "fusedlib-fused-layer)")
    e.add_argument("--tp", type=int, default=d.tp,
                   help="tensor-parallel ranks (start with torchrun --nproc-per-node TP)")
    e.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (with --tp > 1)")
    e.add_argument("--seed", type=int, default=d.seed, help="weights, batches and dropout")
    e.add_argument("--cache-dir", default=d.cache_dir,
                   help="corpus cache (default $FUSEDLIB_CACHE or ~/.cache/fusedlib)")
    w = p.add_argument_group("output")
    w.add_argument("--out", default=None, help="directory for metrics.jsonl and checkpoint.pt (with --tp > 1, "
                                              "checkpoint-tp<rank>.pt per rank; --bench: train.json)")
    w.add_argument("--log-interval", type=int, default=d.log_interval, help="steps per metrics window")
    w.add_argument("--eval-interval", type=int, default=d.eval_interval, help="0: only at the end")
    w.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation")
    w.add_argument("--save-interval", type=int, default=d.save_interval, help="0: only at the end (else needs --out)")
    w.add_argument("--stop-at", type=int, default=d.stop_at, help="stop (and save) after this step")
    w.add_argument("--resume", action="store_true",
                   help="continue from <out>/checkpoint.pt (a run with --tp > 1: from its "
                        "<out>/checkpoint-tp<rank>.pt, with the same --tp)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = p.add_argument_group("sampling")
    s.add_argument("--sample", type=int, default=0, metavar="N",
                   help="print N sampled tokens after training (with --bench: each run's sample, default 300; "
                        "0: none)")
    s.add_argument("--prompt", default="def ", help="the text the samples continue (with --sample)")
    s.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (with --sample)")
    s.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens (with --sample)")
    b = p.add_argument_group("benchmark")
    b.add_argument("--bench", action="store_true", help="train each of --bench-runs, write <out>/train.json")
    b.add_argument("--bench-runs", nargs="+", default=None,
                   help="default: fusedlib fusedlib-unfused torch.compile (also: fusedlib-local, "
                        "fusedlib-fused-layer, fusedlib-compile, "
                        "fusedlib-graphs, torch.compile-graphs, fusedlib-full-iteration, "
                        "torch.compile-full-iteration)")
    b.add_argument("--bench-warmup", type=int, default=None,
                   help="steps left out of the timing (default 20; --bench-profile: 15, before its 5 profiled)")
    b.add_argument("--bench-profile", action="store_true",
                   help="profile the kernels of 5 steps of each of --bench-runs (default: fusedlib torch.compile), "
                        "write <out>/train_profile.json")
    b.add_argument("--bench-tp", action="store_true",
                   help="under torchrun with p processes: tp = p and tp = 1, write <out>/train_tp<p>.json")
    return p


def _given(argv: Optional[list[str]], names: tuple[str, ...]) -> set[str]:
    """Which of the destinations ``names`` the command line set itself (not by their defaults):
    the parser again, every default suppressed (abbreviated flags count, as argparse reads them)."""
    quiet = _parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv))) & set(names)


def _refuse_runs_that_cannot_start(parser: argparse.ArgumentParser, config, runs: list[str]) -> None:
    """A benchmark run whose configuration (:func:`~fusedlib.train.bench.run_config`: ``config``
    with the run's fields) is refused is an error of the command line, before any run trains
    (e.g. ``fusedlib-compile`` on the CPU), not a failure found when
    its turn comes."""
    from .bench import run_config

    for name in runs:
        try:
            run_config(config, name)
        except ValueError as err:  # (ArgumentTypeError is one too)
            parser.error(f"--bench-runs: {name} cannot run with these flags: {err}")


def parse_args(argv: Optional[list[str]] = None):
    """The command line -> ``(TrainConfig, argparse.Namespace)``; a bad value exits with status 2
    and a message naming the flag."""
    from .bench import BENCH_RUNS, DEFAULT_BENCH_RUNS, GRAPH_RUNS
    from .loop import TrainConfig

    parser = _parser()
    args = parser.parse_args(argv)
    # flags that would be ignored are refused (with --bench / --bench-profile they set the fused runs');
    # left out, they are absent from args and TrainConfig takes its defaults
    spec, backend = getattr(args, "spec", None), getattr(args, "attention_backend", None)
    if not (args.bench or args.bench_profile):
        if args.model == "plain" and (spec is not None or backend is not None):
            parser.error(f"--{'spec' if spec is not None else 'attention-backend'} applies to --model gpt "
                         f"(fusedlib's GPTModel), not to the plain model")
        if spec == "unfused" and backend is not None:
            parser.error("--attention-backend applies to --spec fused: the unfused spec runs the materialised "
                         "attention with torch's softmax")
    bench = next((flag for flag, on in (("--bench", args.bench), ("--bench-tp", args.bench_tp),
                                         ("--bench-profile", args.bench_profile)) if on), None)
    if bench is None and args.bench_warmup is not None:
        parser.error("--bench-warmup needs --bench, --bench-tp or --bench-profile: it sets the steps they leave out "
                     "of their timing")
    if bench is not None and args.save_interval:  # (its runs train with out=None: it would be ignored)
        parser.error(f"--save-interval: {bench} trains from scratch and writes no checkpoint: leave it out")
    # the sampling flags given on the command line (their defaults stay in --help): the settings
    # shape the samples of a training run's --sample only (--bench samples with fixed settings,
    # --bench-tp and --bench-profile write none)
    given = _given(argv, ("sample", "prompt", "temperature", "top_k"))
    settings = [f"--{name.replace('_', '-')}" for name in ("prompt", "temperature", "top_k") if name in given]
    it = "them" if len(settings) > 1 else "it"
    if settings and bench is not None:
        parser.error(f"{', '.join(settings)}: {bench} samples with fixed settings, or not at all: leave {it} out")
    if settings and not args.sample:
        parser.error(f"{', '.join(settings)}: {'set' if len(settings) > 1 else 'sets'} the samples of --sample N "
                     f"(N > 0), and none is asked for: add --sample N or leave {it} out")
    args.bench_sample = args.sample if "sample" in given else 300  # --bench's sample length: 0 writes none
    if "sample" in given and (args.bench_tp or args.bench_profile):
        parser.error(f"--sample: {'--bench-tp' if args.bench_tp else '--bench-profile'} writes no sample: leave it out")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["progress"] = not args.no_progress
    try:
        config = TrainConfig(**values)
        if not (args.bench or args.bench_profile):  # (their runs are checked one by one below)
            config.check_model()
    except ValueError as err:
        parser.error(f"--{str(err).split(' ', 1)[0].rstrip(':').replace('_', '-')}: {err}")
    if args.sample < 0:
        parser.error(f"--sample must be >= 0, got {args.sample}")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        parser.error(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.sample:
        from .data import encode

        try:
            if encode(args.prompt).numel() == 0:
                parser.error("--prompt must be non-empty (the text the samples continue)")
        except ValueError as err:  # bytes of the command line that are not UTF-8
            parser.error(f"--prompt: {err}")
    if not 1 <= args.top_k <= 256:
        parser.error(f"--top-k must be in [1, 256], got {args.top_k}")
    if sum((args.bench, args.bench_tp, args.bench_profile)) > 1:
        parser.error("--bench, --bench-tp and --bench-profile are different runs: choose one")
    if args.bench or args.bench_profile:
        what = "--bench" if args.bench else "--bench-profile"
        if args.resume or args.stop_at is not None:
            parser.error(f"{what} trains from scratch: --resume and --stop-at do not apply")
        if args.cuda_graph or args.full_iteration_graph or args.compile_mode is not None or args.fused_layer:
            parser.error(f"--cuda-graph, --full-iteration-graph, --compile-mode, --fused-layer: {what} sets them per "
                         f"run (choose the runs with --bench-runs, e.g. fusedlib-graphs, torch.compile-graphs, "
                         f"fusedlib-fused-layer): leave them out")
    if args.bench_profile:
        from .bench import DEFAULT_PROFILE_RUNS, PROFILE_STEPS, PROFILE_WARMUP

        runs = args.bench_runs or list(DEFAULT_PROFILE_RUNS)
        bad = [r for r in runs if r not in BENCH_RUNS or r in GRAPH_RUNS]
        if bad:
            parser.error(f"--bench-runs: {bad} cannot be profiled; choices: "
                         f"{', '.join(r for r in BENCH_RUNS if r not in GRAPH_RUNS)} (a graph run replays the "
                         f"same kernels)")
        _refuse_runs_that_cannot_start(parser, config, runs)
        if args.bench_warmup is None:
            args.bench_warmup = PROFILE_WARMUP
        if not 0 <= args.bench_warmup <= config.steps - PROFILE_STEPS:
            parser.error(f"--bench-warmup must be in [0, steps - {PROFILE_STEPS} = {config.steps - PROFILE_STEPS}] "
                         f"(--bench-profile profiles {PROFILE_STEPS} steps after it), got {args.bench_warmup}")
    if args.bench_warmup is None and not args.bench_profile:
        args.bench_warmup = 20
    if (args.bench or args.bench_tp) and config.steps <= config.log_interval:
        parser.error(f"--steps ({config.steps}) must be more than --log-interval ({config.log_interval}) for "
                     f"{'--bench' if args.bench else '--bench-tp'}: the timing takes whole logging windows after "
                     f"the warm-up steps")
    if args.bench_tp:
        if args.resume or args.stop_at is not None:
            parser.error("--bench-tp trains from scratch: --resume and --stop-at do not apply")
        for flag, on in (("--cuda-graph", config.cuda_graph), ("--full-iteration-graph", config.full_iteration_graph),
                         ("--fused-layer", config.fused_layer)):
            if on:
                parser.error(f"--bench-tp trains with tp > 1, which {flag} does not support: leave {flag} out")
        if config.tp != 1 or config.model != "gpt":
            parser.error("--bench-tp sets the tensor-parallel size itself (the number of processes) and trains "
                         "--model gpt: leave --tp and --model out")
        if not 0 <= args.bench_warmup <= config.steps - config.log_interval:
            parser.error(f"--bench-warmup must be in [0, steps - log_interval = {config.steps - config.log_interval}], "
                         f"got {args.bench_warmup}")
        world_size = os.environ.get("WORLD_SIZE", "1")
        if not (world_size.isdigit() and int(world_size) >= 2):
            parser.error(f"--bench-tp runs under torchrun with p >= 2 processes (torchrun --nproc-per-node 2 -m "
                         f"fusedlib.train --bench-tp ...), got WORLD_SIZE={world_size}")
    world = os.environ.get("WORLD_SIZE")  # set by torchrun
    if world is not None and not args.bench_tp and world.isdigit() and int(world) != config.tp:
        # no data parallelism: the other tensor-parallel groups would repeat the same run and
        # write the same metrics and checkpoint files at once
        parser.error(f"--tp: tp ({config.tp}) must equal the number of processes torchrun started "
                     f"(WORLD_SIZE={world}): fusedlib.train has tensor parallelism only, no data parallelism")
    if args.bench:
        runs = args.bench_runs or list(DEFAULT_BENCH_RUNS)
        bad = [r for r in runs if r not in BENCH_RUNS]
        if bad:
            parser.error(f"--bench-runs: unknown {bad}; choices: {', '.join(BENCH_RUNS)}")
        graphs = [r for r in runs if r in GRAPH_RUNS]
        if graphs and config.resolved_device().type != "cuda":
            parser.error(f"--bench-runs: {graphs} replay CUDA graphs and need a CUDA device, got "
                         f"{config.resolved_device()}")
        _refuse_runs_that_cannot_start(parser, config, runs)
        if not 0 <= args.bench_warmup <= config.steps - config.log_interval:
            parser.error(f"--bench-warmup must be in [0, steps - log_interval = {config.steps - config.log_interval}], "
                         f"got {args.bench_warmup}")
    elif args.bench_runs is not None and not args.bench_profile:
        parser.error("--bench-runs needs --bench or --bench-profile")
    return config, args


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    config, args = parse_args(argv)
    if args.bench_tp or config.tp > 1:
        from ..parallel import parallel_state

        # torchrun's processes join one group; tp = the number of processes for --bench-tp
        try:
            parallel_state.initialize_model_parallel(int(os.environ.get("WORLD_SIZE", "1")) if args.bench_tp
                                                     else config.tp)
        except (RuntimeError, ValueError) as err:  # started without torchrun: one process, no group
            print(f"{PROG}: error: {'--bench-tp' if args.bench_tp else '--tp'}: {err}", file=sys.stderr)
            return 2
        try:
            return _main(config, args)
        finally:
            parallel_state.destroy_model_parallel()
    return _main(config, args)


def _main(config, args) -> int:
    if args.bench_tp:
        from .bench import run_tp_bench

        out = args.out if args.out is not None else "chapters/data/bench"
        run_tp_bench(dataclasses.replace(config, out=None), out, args.bench_warmup)
        return 0
    if args.bench_profile:
        from .bench import DEFAULT_PROFILE_RUNS, PROFILE_FILE, profile_steps

        out = args.out if args.out is not None else "chapters/data/bench"
        prof = profile_steps(dataclasses.replace(config, out=None), args.bench_runs or DEFAULT_PROFILE_RUNS,
                             warmup=args.bench_warmup, out_dir=out)
        print(f"wrote {out}/{PROFILE_FILE}")
        return 1 if prof["skipped"] else 0
    if args.bench:
        from .bench import DEFAULT_BENCH_RUNS, bench_table, run_bench

        out = args.out if args.out is not None else "chapters/data/bench"
        base = dataclasses.replace(config, out=None)
        records = run_bench(base, out, args.bench_runs or DEFAULT_BENCH_RUNS, args.bench_warmup, args.bench_sample)
        print(bench_table(records))
        print(f"wrote {out}/train.json")
        asked = args.bench_runs or DEFAULT_BENCH_RUNS
        return 0 if len(records) == len(asked) else 1
    from .loop import Trainer, _out_of_memory

    try:
        trainer = Trainer(config)
    except (FileNotFoundError, ValueError) as err:  # a resume that cannot go on, a corpus too short for seq
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    info = trainer.corpus.info()  # the whole record (file lists included) goes with every checkpoint
    trainer.log(f"{config.label()}: {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f} M parameters"
                f"{' on this rank' if config.tp > 1 else ''}; corpus {info['corpus']} (Python {info['python']}, "
                f"{info['files_train']} files, {info['tokens_train']:,} tokens for training, {info['files_val']} files, "
                f"{info['tokens_val']:,} for validation, {info['tokenizer']}, sha256 {info['sha256'][:12]})")
    try:
        trainer.run()
    except FloatingPointError as err:  # diverged: the metrics up to it are written, the last checkpoint kept
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        text = _out_of_memory(err)
        if text is None:
            raise
        print(f"{PROG}: error: step {trainer.step_count + 1} does not fit in the {trainer.device.type} memory "
              f"(--batch {config.batch}, --seq {config.seq}; a smaller --batch may fit): {text}", file=sys.stderr)
        return 1
    if args.sample:
        text = trainer.sample(args.prompt, args.sample, args.temperature, args.top_k)  # (every rank draws)
        trainer.log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
