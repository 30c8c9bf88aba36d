"""FlashAttention's streamed tiles by TMA loads against pointer loads, kernel by kernel, on a GPU.

Usage: python tools/attention_loads.py [--out PATH]    (default: attention_loads.json here)

For each case of the attention benchmark (``fusedlib.bench.ops.attention.CASES``, bf16, q, k, v
[b, s, h, d] random normal, scale 1/sqrt(d)) and each form of launch that
``fusedlib.kernels.flash_attention.TMA_LOADS`` names, it times the kernel launchers
(``flash_attn_fwd``, ``flash_attn_bwd``: the kernels alone, no autograd) twice: with pointer
loads (``LOADS_BY_TMA = False``) and with TMA loads (``TMA_LOADS[form]`` set to the case's
head dim for that timing). The forms:

* ``forward``: ``flash_attn_fwd`` without dropout; ``forward_dropout``: with dropout 0.1;
* ``backward``: ``flash_attn_bwd(deterministic=True)`` without dropout (dK/dV, then dQ);
  ``backward_dropout``: the same with dropout 0.1;
* ``backward_atomic``: ``deterministic=False`` where ``use_atomic_dq`` takes the atomic dQ,
  without dropout (d = 128) and with dropout 0.1 (every head dim).

Timer: ``fusedlib.bench.core.time_ms(..., cuda_graph=True)``, the benchmark's: the median of
CUDA-graph replays of one call, with triton's do_bench flushing the L2 cache between calls.
Each record also says whether the two loads gave the same bits (every output of the forward
and of the deterministic backward must: the same products in the same order) or, for the
atomic dQ, the relative difference of dq (its float32 additions come in a varying order).

Records (a JSON list): ``{"op": "attention_loads", "form", "loads": "pointer" | "tma",
"shape": [b, h, s, d], "shape_names", "causal", "dropout_p", "dtype", "ms", "timer":
"cuda_graph", "same_bits" (or "dq_rel_diff"), "tma_taken"}`` plus the benchmark's
environment fields (device, torch, triton, direct_launch). ``tma_taken``: whether the
launches really passed descriptors (a GPU older than Hopper, or a Triton without host
descriptors, runs pointer loads in both timings).
"""
from __future__ import annotations

import argparse
import json

import torch

import fusedlib.kernels.flash_attention as kfa
import fusedlib.runtime
from fusedlib.bench.core import environment, time_ms
from fusedlib.bench.ops.attention import CASES, SHAPE_NAMES, kernel_calls

DROPOUT_P = 0.1


def _forms(d: int) -> list[tuple[str, float, bool]]:
    """(form, dropout_p, deterministic) of every launch timed at head dim d."""
    forms = [("forward", 0.0, True), ("forward_dropout", DROPOUT_P, True), ("backward", 0.0, True),
             ("backward_dropout", DROPOUT_P, True)]
    if kfa.use_atomic_dq(d, False):
        forms.append(("backward_atomic", 0.0, False))
    if kfa.use_atomic_dq(d, True):
        forms.append(("backward_atomic", DROPOUT_P, False))
    return forms


def measure() -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("attention_loads: needs a CUDA GPU")
    env = environment()
    records = []
    table, flag, launch = dict(kfa.TMA_LOADS), kfa.LOADS_BY_TMA, fusedlib.runtime.launch
    try:
        for (b, h, s, d), causal in CASES:
            for form, p, deterministic, call in kernel_calls((b, h, s, d), causal, _forms(d)):
                outs, ms, taken = {}, {}, {}
                for loads in ("pointer", "tma"):
                    kfa.LOADS_BY_TMA = loads == "tma"
                    kfa.TMA_LOADS = {**table, form: (d,)}
                    fusedlib.runtime.clear_plans()  # plans keep the settings they were made with
                    seen = []

                    def spy(kernel, *args, **kwargs):
                        seen.append(bool(kwargs.get("KV_TMA") or kwargs.get("QDO_TMA")))
                        return launch(kernel, *args, **kwargs)

                    # a new plan's first launch goes through fusedlib.runtime.launch, with its keywords
                    fusedlib.runtime.launch = spy
                    outs[loads] = [t for t in call() if t is not None]
                    fusedlib.runtime.launch = launch
                    taken[loads] = any(seen)
                    ms[loads] = time_ms(call, cuda_graph=True)
                if deterministic:
                    check = {"same_bits": all(torch.equal(x, y) for x, y in zip(outs["pointer"], outs["tma"]))}
                else:
                    x, y = outs["tma"][0].double(), outs["pointer"][0].double()
                    check = {"dq_rel_diff": float((x - y).norm() / y.norm())}
                for loads in ("pointer", "tma"):
                    records.append({"op": "attention_loads", "form": form, "loads": loads, "shape": [b, h, s, d],
                                    "shape_names": list(SHAPE_NAMES), "causal": causal, "dropout_p": p,
                                    "dtype": "bfloat16", "ms": round(ms[loads], 5), "timer": "cuda_graph",
                                    "tma_taken": taken[loads], **check, **env})
                print(f"[{b}, {h}, {s}, {d}] {'causal' if causal else 'non-causal':10s} {form:17s} p={p:<4} "
                      f"pointer {ms['pointer']:.4f} ms  tma {ms['tma']:.4f} ms  {check}", flush=True)
    finally:
        kfa.TMA_LOADS, kfa.LOADS_BY_TMA, fusedlib.runtime.launch = table, flag, launch
        fusedlib.runtime.clear_plans()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention_loads.json", help="where to write the records (JSON)")
    args = parser.parse_args()
    records = measure()
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
