"""``python -m fusedlib.bench``: time fusedlib's ops and their baselines on the GPU.

Usage::

    python -m fusedlib.bench                          # every op, default shapes
    python -m fusedlib.bench --op bias_gelu --out chapters/data/bench
    python -m fusedlib.bench --op bias_gelu --sweep   # plus the op's sweep shapes

Writes ``DIR/<op>.json`` (a list of records, DESIGN.md section 4) and prints a table of
ms, GB/s, the fraction of the copy ceiling, and fusedlib's speed-up over each baseline.
"""
from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from . import OP_MODULES, copy_record, get_cases, measure_case, write_records
from .core import matmul_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedlib.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--op", nargs="+", choices=sorted(OP_MODULES), default=None,
                        help="ops to time (default: all)")
    parser.add_argument("--out", default="chapters/data/bench", help="folder for <op>.json")
    parser.add_argument("--sweep", action="store_true", help="also time each op's sweep shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fusedlib.bench needs a CUDA GPU: timings in Triton's CPU interpreter mean nothing.",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ops = args.op or list(OP_MODULES)
    copy = copy_record(device="cuda")
    print(f"copy ceiling: {copy['GBps']:.0f} GB/s ({copy['device']}, torch {copy['torch']}, "
          f"triton {copy['triton']})")
    matmul = matmul_record(device="cuda")
    print(f"bf16 matmul ceiling: {matmul['TFLOPs']:.0f} TFLOP/s")
    write_records([copy, matmul], f"{args.out}/ceilings.json")
    all_cases = [(op, get_cases(op)(device, sweep=args.sweep)) for op in ops]
    total = sum(len(c.impls) * 2 for _, cs in all_cases for c in cs)
    with tqdm(total=total, desc="bench", unit="timing") as bar:
        for op, cases in all_cases:
            records = [copy]
            for case in cases:
                records += measure_case(case, device, progress=lambda label: (bar.set_postfix_str(label),
                                                                              bar.update(1)))
                for name, why in case.skipped.items():
                    tqdm.write(f"  {op}: {name} not timed: {why}")
            path = write_records(records, f"{args.out}/{op}.json")
            tqdm.write(f"wrote {path}")
            tqdm.write(summary(records))
    return 0


def summary(records: list[dict]) -> str:
    """A text table: op, pass, shape, impl, ms, GB/s, % of copy, fusedlib speed-up."""
    copy = next(r for r in records if r["impl"] == "copy")
    rows = [r for r in records if r["impl"] != "copy"]
    fused = {(r["pass"], tuple(r["shape"])): r["ms"] for r in rows if r["impl"] == "fusedlib"}
    lines = [f"{'op':<16}{'pass':<9}{'shape':<18}{'impl':<15}{'ms':>9}{'GB/s':>9}{'%copy':>7}{'fused x':>9}"]
    for r in rows:
        f = fused.get((r["pass"], tuple(r["shape"])))
        sp = f"{r['ms'] / f:.2f}" if f else "-"
        lines.append(f"{r['op']:<16}{r['pass']:<9}{str(r['shape']):<18}{r['impl']:<15}{r['ms']:>9.4f}"
                     f"{r['GBps']:>9.0f}{100 * r['GBps'] / copy['GBps']:>7.1f}{sp:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
