"""``python -m fusedlib.bench``: time fusedlib's ops and their baselines on the GPU.

Usage::

    python -m fusedlib.bench                          # every op, default shapes
    python -m fusedlib.bench --op bias_gelu --out chapters/data/bench
    python -m fusedlib.bench --op bias_gelu --sweep   # plus the op's sweep shapes
    python -m fusedlib.bench --host                   # host cost per call -> DIR/host.json

Writes ``DIR/<op>.json`` (a list of records, the benchmark protocol of :mod:`fusedlib.bench.core`) and prints a table of
ms (CUDA-graph replays), plain-launch ms, GB/s, the fraction of the copy ceiling, and
fusedlib's speed-up over each baseline. An op module may add its own outputs: a ``table``
function (records -> text, printed after that table) and an ``extra_files`` function
(device, DIR, log -> written paths), e.g. ``transformer_layer``'s tokens/s table, its kernel
profile ``DIR/transformer_layer_profile.json`` and, on a GPU, the clock under load
``DIR/transformer_layer_power.json``. ``--host`` writes ``DIR/host.json`` instead
(:mod:`fusedlib.bench.host`): microseconds per call at tiny shapes, fusedlib against eager
PyTorch and torch.compile, and the floor of that cost (``"host_floor"`` records: LayerNorm's host
work without LayerNorm, :func:`fusedlib.bench.host.measure_floor`); with ``--op`` it replaces
those ops' records (and the floor's) in the file and keeps the others'. Files are rewritten
after every case (``--host``: every op), so a run cut short by a time limit keeps what it
measured. Both need a CUDA GPU and exit with status 2
without one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..checks import file_on_the_way
from . import OP_MODULES, copy_record, get_cases, measure_case, write_records
from .ops import get_op_module
from .core import load_records, matmul_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); ``--sweep`` with ``--host``, and an ``--out``
    that is a file or lies under one, are errors."""
    parser = argparse.ArgumentParser(prog="python -m fusedlib.bench", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--op", nargs="+", action="extend", choices=sorted(OP_MODULES), default=None, metavar="OP",
                        help=f"ops to time (default: all): {', '.join(sorted(OP_MODULES))} "
                             f"(a second --op adds to the first)")
    parser.add_argument("--out", default="chapters/data/bench",
                        help="folder for <op>.json / host.json (default chapters/data/bench)")
    parser.add_argument("--sweep", action="store_true", help="also time each op's sweep shapes")
    parser.add_argument("--host", action="store_true",
                        help="host cost per call at tiny shapes (fusedlib, eager, torch.compile) into host.json")
    parser.add_argument("--calls", type=int, default=None, help="--host: calls per repeat (default 300)")
    parser.add_argument("--repeats", type=int, default=None, help="--host: repeats, median kept (default 5)")
    args = parser.parse_args(argv)
    if args.host and args.sweep:
        parser.error("--sweep does not apply to --host (tiny shapes only)")
    if not args.host and (args.calls is not None or args.repeats is not None):
        parser.error("--calls and --repeats apply to --host only")
    for name in ("calls", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.out:  # f"{args.out}/{op}.json" would be /<op>.json, at the file system's root
        parser.error("--out must be a folder's path, got '' (for the current folder: --out .)")
    out = Path(args.out)  # refused before any timing: a file there would stop the run at its first write
    blocked = file_on_the_way(out, include_self=True)
    if blocked is not None:
        parser.error(f"--out must be a folder, got {args.out!r}: {str(blocked)!r} is a file")
    if args.op is not None:
        args.op = list(dict.fromkeys(args.op))  # an op named twice is timed once (not two sets of records)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        why = ("--host measures the host's cost of launching GPU work; in Triton's CPU interpreter every "
               "kernel runs in Python, so the numbers would mean nothing" if args.host
               else "timings in Triton's CPU interpreter mean nothing")
        print(f"fusedlib.bench needs a CUDA GPU: {why}.", file=sys.stderr)
        return 2
    ops = args.op or list(OP_MODULES)
    if args.host:
        return main_host(ops, args.out, args.calls, args.repeats)
    device = torch.device("cuda")
    copy = copy_record(device="cuda")
    print(f"copy ceiling: {copy['GBps']:.0f} GB/s ({copy['device']}, torch {copy['torch']}, "
          f"triton {copy['triton']})")
    matmul = matmul_record(device="cuda")
    print(f"bf16 matmul ceiling: {matmul['TFLOPs']:.0f} TFLOP/s")
    write_records([copy, matmul], f"{args.out}/ceilings.json")
    all_cases = [(op, get_cases(op)(device, sweep=args.sweep)) for op in ops]
    total = sum(len(i.passes) * c.plain_rounds for _, cs in all_cases for c in cs for i in c.impls)
    with tqdm(total=total, desc="bench", unit="timing") as bar:
        for op, cases in all_cases:
            records = [copy]
            for case in cases:
                records += measure_case(case, device, progress=lambda label: (bar.set_postfix_str(label),
                                                                              bar.update(1)))
                for name, why in case.skipped.items():
                    tqdm.write(f"  {op}: {name} not timed: {why}")
                # after every case, so that a run cut short (a time limit) keeps what it measured
                path = write_records(records, f"{args.out}/{op}.json")
            tqdm.write(f"wrote {path}")
            tqdm.write(summary(records))
            module = get_op_module(op)
            if hasattr(module, "table"):
                tqdm.write(module.table(records))
            if hasattr(module, "extra_files"):
                for extra in module.extra_files(device, args.out, log=tqdm.write):
                    tqdm.write(f"wrote {extra}")
    return 0


def main_host(ops: list[str], out: str, calls: int | None, repeats: int | None) -> int:
    """``--host``: measure ``ops`` on the current CUDA device, merge into ``out/host.json``.

    Returns 0, or 2 (one line on stderr, nothing timed) when an existing ``out/host.json`` cannot
    be read as a JSON list of records."""
    from .host import (CALLS, HOST_EXTRA_IMPLS, HOST_IMPLS, REPEATS, floor_table, host_table, measure_floor,
                       measure_host, merge_host_records)

    calls, repeats = calls or CALLS, repeats or REPEATS
    records = []
    path = Path(out) / "host.json"
    try:  # read before any timing: a file that cannot be merged into would stop the run after it
        old = load_records(path) if path.exists() else []
    except (OSError, ValueError) as err:  # JSON errors are ValueErrors
        print(f"fusedlib.bench: cannot read {path} to merge the new records into: {err}", file=sys.stderr)
        return 2
    if not (isinstance(old, list) and all(isinstance(r, dict) for r in old)):
        print(f"fusedlib.bench: {path} is not a JSON list of records; move it away or fix it", file=sys.stderr)
        return 2
    impls = {op: HOST_IMPLS + HOST_EXTRA_IMPLS.get(op, ()) for op in ops}
    with tqdm(total=2 * sum(len(i) for i in impls.values()), desc="host", unit="timing") as bar:
        for op in ops:
            recs, skipped = measure_host(op, "cuda", calls=calls, repeats=repeats, impls=impls[op],
                                         progress=lambda label: (bar.set_postfix_str(label), bar.update(1)))
            records += recs
            for name, why in skipped.items():
                tqdm.write(f"  {op}: {name} not timed: {why}")
            write_records(merge_host_records(records, old), path)  # after every op: a cut run keeps its part
    floor, skipped = measure_floor("cuda", calls=calls, repeats=repeats)  # after the ops, in the same process
    records += floor
    for name, why in skipped.items():
        tqdm.write(f"  host floor: {name} not timed: {why}")
    merged = merge_host_records(records, old)
    if len(merged) > len(records):
        print(f"kept {len(merged) - len(records)} records of other ops from {path}")
    write_records(merged, path)
    print(f"wrote {path}")
    print(host_table(merged))
    print(host_table(merged, "cpu_us"))
    if any(r.get("op") == "host_floor" for r in merged):
        print(floor_table(merged))
    return 0


def summary(records: list[dict]) -> str:
    """A text table: op, pass, shape, impl, ms, plain-launch ms, GB/s, % of copy, fusedlib speed-up.

    ``ms`` is the CUDA-graph replay where the record has one (``"timer": "cuda_graph"``; a
    ``*`` marks an implementation that could not be captured, whose ms is plain launches),
    ``plain`` the plain-launch time (``"ms_eager"``); ``fused x`` divides each by fusedlib's
    of the same kind. A torch.compile compiled once for several shapes is marked ``(dyn)``.
    Records without a byte count (``"GBps": None``: a model-level op) show ``-`` for GB/s
    and % copy. Records of one shape that differ in a ``"variant"`` field (attention: causal
    or not) are compared within their variant only, which the shape column names.
    """
    copy = next(r for r in records if r["impl"] == "copy")
    rows = [r for r in records if r["impl"] != "copy"]
    key = lambda r: (r["pass"], tuple(r["shape"]), r.get("variant"))
    label = lambda r: str(r["shape"]) + (f" {r['variant']}" if r.get("variant") else "")
    fused = {key(r): r for r in rows if r["impl"] == "fusedlib"}
    sw = max([18] + [len(label(r)) + 2 for r in rows])  # the shape column's width
    iw = max([20] + [len(r["impl"]) + 8 for r in rows])  # the impl's, with room for " (dyn)"
    lines = [f"{'op':<18}{'pass':<9}{'shape':<{sw}}{'impl':<{iw}}{'ms':>9}{'plain':>9}{'GB/s':>9}{'%copy':>7}"
             f"{'fused x':>9}{'plain x':>9}"]
    for r in rows:
        f = fused.get(key(r))
        graph_r, graph_f = r.get("timer") == "cuda_graph", f is not None and f.get("timer") == "cuda_graph"
        sp = f"{r['ms'] / f['ms']:.2f}" if f and graph_r == graph_f else "-"
        pe, fe = r.get("ms_eager"), f.get("ms_eager") if f else None
        sp_e = f"{pe / fe:.2f}" if pe and fe else "-"
        impl = r["impl"] + (" (dyn)" if r.get("compile") == "dynamic" else "")
        ms = f"{r['ms']:.4f}" + ("*" if r.get("timer") == "do_bench" else "")
        plain = f"{pe:.4f}" if pe else "-"
        gbps, pct = ((f"{r['GBps']:.0f}", f"{100 * r['GBps'] / copy['GBps']:.1f}") if r.get("GBps") is not None
                     else ("-", "-"))
        lines.append(f"{r['op']:<18}{r['pass']:<9}{label(r):<{sw}}{impl:<{iw}}{ms:>9}{plain:>9}"
                     f"{gbps:>9}{pct:>7}{sp:>9}{sp_e:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
