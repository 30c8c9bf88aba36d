"""The order FlashAttention's programs start in, kernel by kernel, on a GPU.

Usage: python tools/attention_order.py [--out PATH] [--warm CASE]
(default: attention_order.json here; ``--warm i`` only compiles case i's kernels, no timing, so
that a script can compile the cases in parallel processes before one process times them)

For each case of the attention benchmark (``fusedlib.bench.ops.attention.CASES``, bf16, q, k, v
[b, s, h, d] random normal, scale 1/sqrt(d)) and each form of launch, it times the kernel
launchers (``flash_attn_fwd``, ``flash_attn_bwd``: the kernels alone, no autograd) with the
programs in four orders (``fusedlib.kernels.flash_attention._scheduled_tile``):

* ``grid``: the grid's own order (``GROUP_HEADS = 1``, blocks in index order);
* ``8``, ``16``, ``all``: the (head, batch) pairs walked 8, 16 or all at a time, the heaviest
  block of each first (``REVERSE_BLOCKS`` as ``program_order`` sets it from the band).

The forms: ``forward`` (no dropout), ``forward_dropout`` (0.1), ``backward``
(``deterministic=True``: dK/dV, then dQ), ``backward_atomic`` (``deterministic=False`` where
``use_atomic_dq`` takes the atomic dQ without dropout) and ``backward_atomic_dropout`` (0.1).

Timer: ``fusedlib.bench.core.time_ms(..., cuda_graph=True)``, the benchmark's: the median of
CUDA-graph replays of one call, with triton's do_bench flushing the L2 cache between calls.
Each record also says whether the order changed the bits of a deterministic form (it must not:
every program computes the same tile) or, for the atomic dQ, the relative difference of dq from
the grid order's (its float32 additions come in an order that varies).

Records (a JSON list): ``{"op": "attention_order", "form", "order", "group_heads", "shape":
[b, h, s, d], "shape_names", "causal", "dropout_p", "dtype", "ms", "timer": "cuda_graph",
"same_bits" (or "dq_rel_diff")}`` plus the benchmark's environment
fields (device, torch, triton, direct_launch).
"""
from __future__ import annotations

import argparse
import json
from typing import Optional

import torch

import fusedlib.kernels.flash_attention as kfa
import fusedlib.runtime
from fusedlib.bench.core import environment, time_ms
from fusedlib.bench.ops.attention import CASES, SHAPE_NAMES, kernel_calls

DROPOUT_P = 0.1
ORDERS = ("grid", "8", "16", "all")


def _forms(d: int) -> list[tuple[str, float, bool]]:
    """(form, dropout_p, deterministic) of every launch timed at head dim d."""
    forms = [("forward", 0.0, True), ("forward_dropout", DROPOUT_P, True), ("backward", 0.0, True)]
    if kfa.use_atomic_dq(d, False):
        forms.append(("backward_atomic", 0.0, False))
    if kfa.use_atomic_dq(d, True):
        forms.append(("backward_atomic_dropout", DROPOUT_P, False))
    return forms


def _order(name: str, pairs: int):
    """A stand-in for ``program_order`` that puts the programs in order ``name``."""
    def order(band, sq, sk, head_dim, by_keys):
        if name == "grid":
            return 1, False
        first, last = kfa._end_costs(band, sq, sk, by_keys)  # heaviest block first, whichever end it is at
        return (pairs if name == "all" else int(name)), last > first

    return order


def measure(warm: Optional[int] = None) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("attention_order: needs a CUDA GPU")
    env = environment()
    records = []
    program_order = kfa.program_order
    try:
        for i, ((b, h, s, d), causal) in enumerate(CASES):
            if warm is not None and i != warm:
                continue
            band = kfa.attention_band(s, s, causal, None)  # (the group the table would take, recorded)
            for form, p, deterministic, call in kernel_calls((b, h, s, d), causal, _forms(d)):
                ref, line = None, []
                for name in ORDERS:
                    kfa.program_order = _order(name, b * h)
                    fusedlib.runtime.clear_plans()  # plans keep the order they were made with
                    group = kfa.program_order(band, s, s, d, False)[0]
                    out = [t for t in call() if t is not None]
                    if warm is not None:
                        continue
                    ref = out if ref is None else ref
                    if deterministic:
                        check = {"same_bits": all(torch.equal(x, y) for x, y in zip(ref, out))}
                    else:
                        x, y = out[0].double(), ref[0].double()
                        check = {"dq_rel_diff": float((x - y).norm() / y.norm())}
                    ms = time_ms(call, cuda_graph=True)
                    kfa.program_order = program_order
                    records.append({"op": "attention_order", "form": form, "order": name, "group_heads": group,
                                    "shape": [b, h, s, d],
                                    "shape_names": list(SHAPE_NAMES), "causal": causal, "dropout_p": p,
                                    "dtype": "bfloat16", "ms": round(ms, 5), "timer": "cuda_graph", **check, **env})
                    line.append(f"{name} {ms:.4f}")
                kfa.program_order = program_order
                if warm is None:
                    print(f"[{b}, {h}, {s}, {d}] {'causal' if causal else 'non-causal':10s} {form:23s} "
                          + "  ".join(line), flush=True)
    finally:
        kfa.program_order = program_order
        fusedlib.runtime.clear_plans()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention_order.json", help="where to write the records (JSON)")
    parser.add_argument("--warm", type=int, default=None, help="only compile the kernels of case WARM")
    args = parser.parse_args()
    records = measure(args.warm)
    if args.warm is None:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
