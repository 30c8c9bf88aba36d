"""FlashAttention's deterministic backward with Delta from the preprocess kernel against Delta
computed in the dQ kernel, on a GPU.

Usage: python tools/attention_delta.py [--out PATH]    (default: attention_delta.json here)

The deterministic backward without sinks needs Delta = rowsum(dO·O) per query row before its
dK/dV kernel runs. It can come from FlashAttention-2's preprocess kernel (three launches:
preprocess, dK/dV, dQ) or from the dQ kernel, which loads the dO rows of its query tile anyway
and, run first, stores Delta for the dK/dV kernel (two launches: dQ, dK/dV;
``fusedlib.kernels.flash_attention.delta_in_dq_kernel`` chooses by head dim and dropout). For
each case (the attention benchmark's ``CASES``, then chapter 9's training model's attention
[64, 6, 512, 64] and a head dim of 256) and each form (``backward``: no dropout;
``backward_dropout``: 0.1), it times ``flash_attn_bwd(deterministic=True)`` (the kernels alone,
no autograd) both ways, each forced whatever the module would choose: ``preprocess``
(``DELTA_IN_DQ_MAX_HEAD_DIM`` set to 0) and ``delta_in_dq`` (``DELTA_IN_DQ_MAX_HEAD_DIM`` set to
``MAX_HEAD_DIM`` and ``DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM`` to 0).

Timer: ``fusedlib.bench.core.time_ms(..., cuda_graph=True)``, the benchmark's: the median of
CUDA-graph replays of one call, with triton's do_bench flushing the L2 cache between calls.
Each record says which kernels the call launched and whether the two routes gave the same bits
(they must: the same sums in the same order).

Records (a JSON list): ``{"op": "attention_delta", "form", "route": "preprocess" |
"delta_in_dq", "shape": [b, h, s, d], "shape_names", "causal", "dropout_p", "dtype", "ms",
"timer": "cuda_graph", "kernels" (the launched kernels' names, in launch order), "same_bits"}``
plus the benchmark's environment fields (device, torch, triton, direct_launch).
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Optional, Sequence

import torch

import fusedlib.kernels.flash_attention as kfa
import fusedlib.runtime
from fusedlib.bench.core import environment, time_ms, write_records
from fusedlib.bench.ops.attention import CASES, SHAPE_NAMES, kernel_calls

DROPOUT_P = 0.1
ROUTES = ("preprocess", "delta_in_dq")
#: Besides the benchmark's cases: chapter 9's training model's attention (6 heads of 64, causal)
#: and the largest head dim the kernels take.
EXTRA_CASES: tuple[tuple[tuple[int, int, int, int], bool], ...] = (((64, 6, 512, 64), True),
                                                                  ((2, 8, 2048, 256), True))
FORMS: tuple[tuple[str, float, bool], ...] = (("backward", 0.0, True), ("backward_dropout", DROPOUT_P, True))


def compare(shape: Sequence[int], causal: bool, timer: Optional[Callable[[Callable], float]] = None,
            device: str = "cuda") -> list[dict]:
    """Both routes of each form of :data:`FORMS` at one case: their outputs compared and, with a
    ``timer``, timed.

    Args:
        shape: [b, h, s, d].
        causal: the causal band, else none.
        timer: ``timer(call) -> ms``; None: not timed (``"ms"`` None).
        device: of the inputs (the CPU runs Triton's interpreter).

    Returns:
        One dict per form and route (the record's fields but the environment's).

    The module's two limits and its plans are put back as they were, also when a call raises.
    """
    b, h, s, d = shape
    limits, launch = (kfa.DELTA_IN_DQ_MAX_HEAD_DIM, kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM), fusedlib.runtime.launch
    rows = []
    try:
        for form, p, deterministic, call in kernel_calls(shape, causal, FORMS, device=device):
            outs, ms, kernels = {}, {}, {}
            for route in ROUTES:
                forced = route == "delta_in_dq"
                kfa.DELTA_IN_DQ_MAX_HEAD_DIM = kfa.MAX_HEAD_DIM if forced else 0
                kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM = 0 if forced else limits[1]
                fusedlib.runtime.clear_plans()  # plans keep the settings they were made with
                seen: list[str] = []

                def spy(kernel, *args, **kwargs):
                    seen.append(kernel.__name__)
                    return launch(kernel, *args, **kwargs)

                # a new plan's first launch goes through fusedlib.runtime.launch
                fusedlib.runtime.launch = spy
                outs[route] = [t for t in call() if t is not None]
                fusedlib.runtime.launch = launch
                kernels[route] = seen
                ms[route] = timer(call) if timer is not None else None
            same = all(torch.equal(x, y) for x, y in zip(outs["preprocess"], outs["delta_in_dq"]))
            for route in ROUTES:
                rows.append({"op": "attention_delta", "form": form, "route": route, "shape": [b, h, s, d],
                             "shape_names": list(SHAPE_NAMES), "causal": causal, "dropout_p": p,
                             "dtype": str(outs[route][0].dtype).removeprefix("torch."),
                             "ms": None if ms[route] is None else round(ms[route], 5), "timer": "cuda_graph",
                             "kernels": kernels[route], "same_bits": same})
    finally:
        (kfa.DELTA_IN_DQ_MAX_HEAD_DIM, kfa.DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM), fusedlib.runtime.launch = limits, launch
        fusedlib.runtime.clear_plans()
    return rows


def measure() -> list[dict]:
    """Every case of ``CASES + EXTRA_CASES`` timed both ways (see the module docstring)."""
    if not torch.cuda.is_available():
        raise SystemExit("attention_delta: needs a CUDA GPU")
    env = environment()
    records = []
    for shape, causal in CASES + EXTRA_CASES:
        rows = compare(shape, causal, timer=lambda call: time_ms(call, cuda_graph=True))
        for row in rows:
            records.append({**row, **env})
        for form in dict.fromkeys(r["form"] for r in rows):
            pre, dq = (next(r for r in rows if r["form"] == form and r["route"] == route) for route in ROUTES)
            print(f"{shape} {'causal' if causal else 'non-causal':10s} {form:16s} preprocess {pre['ms']:.4f} ms  "
                  f"delta_in_dq {dq['ms']:.4f} ms  {pre['ms'] / dq['ms']:.3f}x  same bits {pre['same_bits']}",
                  flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", default="attention_delta.json", help="where to write the records (JSON)")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder):  # found before the timing, not after
        parser.error(f"--out must be a file's path in an existing folder, got {args.out!r}")
    write_records(measure(), args.out)


if __name__ == "__main__":
    main()
