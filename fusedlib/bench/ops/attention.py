"""Benchmark cases for the whole attention, softmax(Q·Kᵀ·scale)·V: fusedlib's FlashAttention
kernel against every backend of PyTorch's ``scaled_dot_product_attention`` and the
materialised paths, in one run.

Inputs: q, k, v [b, s, h, d] ("bshd", the layout of fusedlib's ``flash_attention``), bf16,
random normal, scale 1/sqrt(d), no dropout, as many key/value heads as query heads. Cases
(:data:`CASES`), shape recorded as [b, h, s, d] (:data:`SHAPE_NAMES`) with ``"variant"``
``"causal"`` or ``"non-causal"``:

* [4, 16, 2048, 128] causal (the headline) and non-causal;
* [2, 16, 8192, 128] causal (long sequences);
* [8, 32, 1024, 64] causal (head dim 64).

Implementations (record ``impl``; :data:`IMPLS` says the same):

==========================  ==================================================================
``fusedlib``                ``fusedlib.fusions.fused_attention.flash_attention``: the Triton
                            FlashAttention-2 kernels, the scores never in memory (its default
                            backward: dQ by atomic adds where that is faster)
``fusedlib-deterministic``  the same with ``deterministic=True``, fwd+bwd only (the forward is
                            the same kernel): the backward without atomics
``sdpa-flash``              ``F.scaled_dot_product_attention`` under ``sdpa_kernel`` with one
``sdpa-cudnn``              backend allowed: FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION
``sdpa-efficient``          (cuDNN's fused attention), EFFICIENT_ATTENTION (xFormers'
``sdpa-math``               memory-efficient kernel), MATH (PyTorch's composite, materialised)
``fusedlib-materialised``   chapter 5's path: scores by ``torch.matmul`` (bf16), fusedlib's fused
                            scale + causal mask + softmax kernel, ``torch.matmul`` with V
``eager``                   Megatron-core's unfused path: ``torch.matmul``, the softmax in
                            float32 step by step (``fusedlib.unfused.scale_mask_softmax``: scale,
                            mask with -10000, softmax, cast), ``torch.matmul``
``torch.compile``           the same function, ``torch.compile(dynamic=False)``d once per case
==========================  ==================================================================

SDPA gets the bshd tensors as [b, h, s, d] views (``transpose(1, 2)``, no copy: every
backend takes strided inputs with a contiguous last dim); the materialised paths multiply
the same views, which ``torch.matmul`` copies to contiguous [b·h, s, d] first (a d/s fraction
of the scores' size). SDPA's ``is_causal`` is top-left aligned, fusedlib's bottom-right; with
sq = sk, as here, they are the same mask.

A backend that refuses a case (its kernel does not take that head dim, dtype or GPU) is
probed before the timings, on the GPU, at the case's shape, forward and forward + backward;
a refusal is left out of the timings and recorded with the reason torch gave (its
exception, and the warning that says why the backend was not used). The materialised paths
(``sdpa-math``, ``fusedlib-materialised``, ``eager``, ``torch.compile``) are left out where
their scores could not fit: where :func:`materialised_peak_bytes` exceeds
:data:`MEMORY_FRACTION` of the GPU's memory. Both kinds of omission are in every record of
the case, as ``"not_timed": {impl: reason}``, and in the case's ``skipped``.

Records: the benchmark records' fields (:mod:`fusedlib.bench.core`), with ``"bytes"`` and ``"GBps"`` None (attention is
compute-bound: its fewest bytes, q, k, v and o once, grow as s while its arithmetic grows as
s²), plus ``"flops"`` and ``"TFLOPs"`` (:func:`attention_flops`, the same count for every
implementation; ``"TFLOPs_eager"`` from the plain-launch time), ``"peak_bytes"`` (the most
memory one call allocates beyond its inputs: outputs, saved tensors, gradients, workspaces),
``"variant"``, ``"causal"``, ``"shape_names"``, ``"scale"``, ``"layout": "bshd"``, and
``"backend"`` on SDPA's records.

FLOPs (:func:`attention_flops`): the forward's two products, Q·Kᵀ and P·V, 2·sq·sk·d
multiply-adds each per head: 4·b·h·sq·sk·d; causal attention counts half (FlashAttention's
convention, Dao 2023: exactly (s + 1)/(2s) of the scores are kept).
Forward + backward counts 3.5x the forward: the backward's five products (recomputing S,
dV, dP, dQ, dK) are 2.5x the forward's two. The softmax's exponentials are not counted.

Source: FlashAttention-2's benchmark (``benchmarks/benchmark_flash_attention.py``, its FLOP
count); PyTorch's ``torch.nn.attention.sdpa_kernel``.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ... import unfused
from ..core import BenchCase, Impl
from .baselines import compile_impl

__all__ = [
    "SHAPE_NAMES", "DEFAULT_SHAPE", "CASES", "IMPLS", "SDPA_BACKENDS", "MATERIALISED_IMPLS",
    "BYTES_PER_SCORE", "MEMORY_FRACTION", "GOAL_FLASH", "GOAL_CUDNN", "attention_flops",
    "materialised_peak_bytes", "kernel_calls", "screen", "case", "cases", "table", "goal_lines", "PLOT_COLORS",
    "plot",
]

#: Record shape: batch, heads, sequence (sq = sk), head dim.
SHAPE_NAMES = ("b", "h", "s", "d")
#: The headline: 4 sequences of 2048 tokens, 16 heads of 128, causal.
DEFAULT_SHAPE = (4, 16, 2048, 128)
#: (shape [b, h, s, d], causal), the headline first.
CASES: tuple[tuple[tuple[int, int, int, int], bool], ...] = (
    (DEFAULT_SHAPE, True),
    (DEFAULT_SHAPE, False),
    ((2, 16, 8192, 128), True),
    ((8, 32, 1024, 64), True),
)

IMPLS: dict[str, str] = {
    "fusedlib": "fusedlib's flash_attention: Triton FlashAttention-2 forward and backward",
    "fusedlib-deterministic": "the same, deterministic=True (backward without atomics; fwd+bwd only)",
    "sdpa-cudnn": "scaled_dot_product_attention, CUDNN_ATTENTION only",
    "sdpa-flash": "scaled_dot_product_attention, FLASH_ATTENTION only",
    "sdpa-efficient": "scaled_dot_product_attention, EFFICIENT_ATTENTION only",
    "sdpa-math": "scaled_dot_product_attention, MATH only (materialised)",
    "fusedlib-materialised": "chapter 5's path: matmul, fusedlib's fused scale+mask+softmax, matmul",
    "eager": "Megatron-core's unfused path: matmul, float32 scale/mask/softmax, matmul",
    "torch.compile": "the eager path, torch.compile(dynamic=False) per case",
}

#: impl name -> the one backend ``sdpa_kernel`` allows (a name of ``torch.nn.attention.SDPBackend``).
SDPA_BACKENDS: dict[str, str] = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}

#: The implementations that hold [b, h, sq, sk] tensors in memory.
MATERIALISED_IMPLS = ("sdpa-math", "fusedlib-materialised", "eager", "torch.compile")

#: Bytes per score element a materialised forward + backward may hold at its peak (an upper
#: bound: the eager path's bf16 scores, float32 copies for scale, mask and softmax, the saved
#: float32 probabilities and bf16 probabilities, and the backward's gradients of each).
BYTES_PER_SCORE = 32
#: A materialised path is left out where :func:`materialised_peak_bytes` exceeds this share
#: of the GPU's memory.
MEMORY_FRACTION = 0.75

#: Goals, checked by :func:`goal_lines`: fusedlib faster than SDPA's FLASH_ATTENTION backend in
#: both passes at every case, and its forward + backward within this factor of cuDNN's.
GOAL_FLASH = 1.0
GOAL_CUDNN = 1.3


# ---------------------------------------------------------------------------------------------
# Counts
# ---------------------------------------------------------------------------------------------

def _check_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """``shape`` as [b, h, s, d], four ints >= 1.

    Raises:
        ValueError: naming ``shape``.
    """
    try:
        shape = tuple(int(x) for x in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be [b, h, s, d] of ints, got {shape!r}") from None
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"shape must be [b, h, s, d], four ints >= 1, got {list(shape)}")
    return shape


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> dict[str, int]:
    """FLOPs of attention per pass, the same for every implementation (module docstring).

    Args:
        b, h: batch and heads; sq, sk: queries and keys per sequence; d: head dim.
        causal: count half of the score matrix (FlashAttention's convention).

    Returns:
        ``{"fwd": 4·b·h·sq·sk·d (halved if causal), "fwd+bwd": 3.5 x that}``, exact ints.

    Raises:
        ValueError: a size < 1.
    """
    if min(b, h, sq, sk, d) < 1:
        raise ValueError(f"sizes must be >= 1, got b={b}, h={h}, sq={sq}, sk={sk}, d={d}")
    fwd2 = 4 * b * h * sq * sk * d * (1 if causal else 2)  # twice the forward's count, an exact int
    return {"fwd": fwd2 // 2, "fwd+bwd": 7 * fwd2 // 4}


def materialised_peak_bytes(b: int, h: int, sq: int, sk: int) -> int:
    """An upper bound of a materialised path's peak memory: :data:`BYTES_PER_SCORE` bytes per
    element of the [b, h, sq, sk] scores."""
    return BYTES_PER_SCORE * b * h * sq * sk


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------

def _heads_first(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[b, s, h, d] -> [b, h, s, d] views."""
    return tuple(t.transpose(1, 2) for t in ts)


def kernel_calls(shape: Sequence[int], causal: bool, forms: Sequence[tuple[str, float, bool]],
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16
                 ) -> list[tuple[str, float, bool, Callable]]:
    """FlashAttention's kernel launchers alone (no autograd) at one case of :data:`CASES`, once
    per form: the calls that ``tools/attention_loads.py`` and ``tools/attention_order.py`` time.

    Args:
        shape: [b, h, s, d] (sq = sk = s); q, k, v and dO are [b, s, h, d] random normal
            (``torch.manual_seed(0)``), scale 1/sqrt(d).
        causal: the causal band, else none.
        forms: (form, dropout_p, deterministic) each; a form named ``forward...`` launches
            ``flash_attn_fwd``, any other ``flash_attn_bwd`` on the output and LSE of one
            forward with the same dropout (0: none; else one Philox seed for the case).
        device, dtype: of the inputs.

    Returns:
        ``(form, dropout_p, deterministic, call)`` per form; ``call()`` returns the launcher's
        outputs. The launchers are looked up in their module at every call, so a tool that
        swaps a module-level setting of ``fusedlib.kernels.flash_attention`` times its effect.

    Raises:
        ValueError: ``shape`` not four ints >= 1.
    """
    from ...kernels import flash_attention as kfa
    from ...kernels.bias_dropout_add import philox_seed

    b, h, s, d = _check_shape(shape)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(4))
    scale = d ** -0.5
    band = kfa.attention_band(s, s, causal, None)
    seed = philox_seed(q.device)
    calls = []
    for form, p, deterministic in forms:
        drop = dict(seed=seed, dropout_p=p) if p > 0 else {}
        if form.startswith("forward"):
            def call(drop=drop):
                return kfa.flash_attn_fwd(q, k, v, scale, band, **drop)
        else:
            o, lse = kfa.flash_attn_fwd(q, k, v, scale, band, **drop)

            def call(drop=drop, o=o, lse=lse, deterministic=deterministic):
                return kfa.flash_attn_bwd(do, q, k, v, o, lse, scale, band, deterministic=deterministic, **drop)
        calls.append((form, p, deterministic, call))
    return calls


def _fusedlib(causal: bool, scale: float, deterministic: bool = False) -> Callable:
    def fn(q, k, v):
        from ...fusions.fused_attention import flash_attention  # at the first call: see case()

        return flash_attention(q, k, v, causal=causal, softmax_scale=scale, deterministic=deterministic)

    return fn


def _sdpa(backend: str, causal: bool, scale: float) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, backend)

    def fn(q, k, v):
        qh, kh, vh = _heads_first(q, k, v)
        with sdpa_kernel([which]):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
        return o.transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]

    return fn


def _materialised(causal: bool, scale: float) -> Callable:
    def fn(q, k, v):
        from ...fusions.fused_softmax import fused_scale_mask_softmax

        qh, kh, vh = _heads_first(q, k, v)
        scores = torch.matmul(qh, kh.transpose(-1, -2))  # [b, h, sq, sk], q's dtype
        p = fused_scale_mask_softmax(scores, None, scale, causal=causal)
        return torch.matmul(p, vh).transpose(1, 2)

    return fn


def _eager_attention(q, k, v, mask, scale):
    """Megatron-core's unfused attention on bshd tensors: matmul, float32 scale + mask (-10000)
    + softmax + cast (:func:`fusedlib.unfused.scale_mask_softmax`), matmul."""
    qh, kh, vh = _heads_first(q, k, v)
    scores = torch.matmul(qh, kh.transpose(-1, -2))
    p = unfused.scale_mask_softmax(scores, mask, scale)
    return torch.matmul(p, vh).transpose(1, 2)


def _with_mask(causal: bool, scale: float) -> Callable[[Callable], Callable]:
    """Adapt ``f(q, k, v, mask, scale)`` to ``(q, k, v)``: the causal mask is built once per
    device and size, as Megatron-core caches it, outside the timed (and compiled) function."""
    masks: dict = {}

    def adapt(f):
        def fn(q, k, v):
            if not causal:
                return f(q, k, v, None, scale)
            key = (q.device, q.shape[1], k.shape[1])
            if key not in masks:
                masks[key] = unfused.causal_mask(q.shape[1], k.shape[1], device=q.device)
            return f(q, k, v, masks[key], scale)

        return fn

    return adapt


def _why(exc: BaseException, caught: Sequence[warnings.WarningMessage]) -> str:
    """The exception and the warnings torch raised with it (SDPA says there why it refused)."""
    said = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught))
    return (f"{type(exc).__name__}: {exc}".strip() + (f" ({said})" if said else ""))[:600]


def _probe(fn: Callable, make_inputs: Callable, device: torch.device) -> dict[str, str]:
    """Run ``fn`` once per pass at the case's size; returns pass -> why it failed (empty: both ran)."""
    failed = {}
    for pas in ("fwd", "fwd+bwd"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                inputs = make_inputs(device, pas == "fwd+bwd")
                if pas == "fwd":
                    with torch.no_grad():
                        fn(*inputs)
                else:
                    out = fn(*inputs)
                    out.backward(torch.randn_like(out))
                    del out
            except Exception as exc:  # a refusal: recorded, never raised
                failed[pas] = _why(exc, caught)
            finally:
                inputs = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return failed


def screen(impls: list[Impl], make_inputs: Callable, device: torch.device, shape: Sequence[int],
           total_memory: int) -> tuple[list[Impl], dict[str, str]]:
    """Leave out what cannot run: the materialised paths where :func:`materialised_peak_bytes`
    exceeds :data:`MEMORY_FRACTION` of ``total_memory``, and each SDPA backend in the passes
    where one call at this size on ``device`` raises (an SDPA implementation keeps the passes
    that ran).

    Returns:
        ``(kept implementations, {impl: why it was left out, or which pass and why})``.
    """
    b, h, s, _ = _check_shape(shape)
    need = materialised_peak_bytes(b, h, s, s)
    kept, not_timed = [], {}
    for impl in impls:
        if impl.name in MATERIALISED_IMPLS and need > MEMORY_FRACTION * total_memory:
            not_timed[impl.name] = (f"not run: its [b, h, sq, sk] tensors may need up to {need / 1e9:.0f} GB "
                                    f"({BYTES_PER_SCORE} B per score), over {MEMORY_FRACTION:.0%} of the "
                                    f"device's {total_memory / 1e9:.0f} GB")
            continue
        if impl.name in SDPA_BACKENDS:
            failed = _probe(impl.fn, make_inputs, device)
            if failed:
                not_timed[impl.name] = "; ".join(f"{p} unsupported: {why}" for p, why in failed.items())
                impl.passes = tuple(p for p in impl.passes if p not in failed)
                if not impl.passes:
                    continue
        kept.append(impl)
    return kept, not_timed


def case(shape: Sequence[int] = DEFAULT_SHAPE, dtype: torch.dtype = torch.bfloat16, *, causal: bool = True,
         device: Optional[torch.device] = None, compile_backend: str | Callable = "inductor") -> BenchCase:
    """Attention at ``shape`` = [b, h, s, d] (sq = sk = s) with every implementation of :data:`IMPLS`.

    Nothing is allocated or compiled here unless ``device`` is a CUDA device: then each SDPA
    backend is probed at this shape (forward, and forward + backward) and the materialised
    paths are checked against the GPU's memory (module docstring); what cannot run is left out
    and recorded in ``skipped`` and in the records' ``"not_timed"``. fusedlib's kernel is
    imported at its first call, so a build without it records why in ``skipped`` instead of
    failing here.

    Args:
        shape: [b, h, s, d].
        dtype: of q, k, v (bf16 for the numbers; tests use float32 too).
        causal: causal attention (the records' ``"variant"``: ``"causal"``, else ``"non-causal"``).
        device: where the case will run, for the probes; None (``--host``, tests): no probes.
        compile_backend: ``torch.compile``'s backend (tests pass "eager").

    Returns:
        The case: inputs ``(q, k, v)`` [b, s, h, d]; both passes; ``bytes`` None; ``flops``;
        ``peak_memory`` on.

    Raises:
        ValueError: a bad ``shape``.
    """
    b, h, s, d = _check_shape(shape)
    scale = 1.0 / math.sqrt(d)

    def make_inputs(dev, requires_grad):
        return tuple(torch.randn(b, s, h, d, device=dev, dtype=dtype, requires_grad=requires_grad) for _ in range(3))

    impls = [Impl("fusedlib", _fusedlib(causal, scale)),
             Impl("fusedlib-deterministic", _fusedlib(causal, scale, deterministic=True), passes=("fwd+bwd",))]
    for name, backend in SDPA_BACKENDS.items():
        impls.append(Impl(name, _sdpa(backend, causal, scale), info={"backend": backend}))
    impls.append(Impl("fusedlib-materialised", _materialised(causal, scale)))
    impls.append(Impl("eager", _with_mask(causal, scale)(_eager_attention)))
    impls.append(compile_impl(_eager_attention, adapt=_with_mask(causal, scale), backend=compile_backend))

    not_timed: dict[str, str] = {}
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device(device)
        impls, not_timed = screen(impls, make_inputs, device, (b, h, s, d),
                                  torch.cuda.get_device_properties(device).total_memory)

    variant = "causal" if causal else "non-causal"
    info = {"variant": variant, "causal": causal, "shape_names": list(SHAPE_NAMES), "scale": scale,
            "layout": "bshd", "not_timed": dict(not_timed)}
    return BenchCase("attention", (b, h, s, d), dtype, make_inputs, {"fwd": None, "fwd+bwd": None}, impls,
                     skipped=dict(not_timed), peak_memory=True, flops=attention_flops(b, h, s, s, d, causal),
                     info=info)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The four cases of :data:`CASES`, the headline first, each with its own static compile and,
    on a GPU, its own probes; ``sweep`` adds nothing (all four are headlines)."""
    return [case(shape, dtype, causal=causal, device=device) for shape, causal in CASES]


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------

def _rows(records: Sequence[dict]) -> list[dict]:
    return [r for r in records if r.get("op") == "attention"]


def _cases_of(rows: Sequence[dict]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, variant) of every case, in the records' order."""
    return list(dict.fromkeys((tuple(r["shape"]), r.get("variant", "")) for r in rows))


def _order(impl: str) -> int:
    names = list(IMPLS)
    return names.index(impl) if impl in names else len(names)


def _case_label(shape: Sequence[int], variant: str, names: Sequence[str] = SHAPE_NAMES) -> str:
    return f"[{', '.join(f'{n} {v}' for n, v in zip(names, shape))}] {variant}".strip()


def _find(rows: Sequence[dict], shape, variant, impl, pas) -> Optional[dict]:
    return next((r for r in rows if tuple(r["shape"]) == tuple(shape) and r.get("variant", "") == variant
                 and r["impl"] == impl and r["pass"] == pas), None)


def _ratio(slow: dict, fast: dict) -> tuple[float, str]:
    """slow's time / fast's, like with like: CUDA-graph replays when both have one, else plain launches."""
    if slow.get("timer") == "cuda_graph" and fast.get("timer") == "cuda_graph":
        return slow["ms"] / fast["ms"], "graph"
    s, f = slow.get("ms_eager", slow["ms"]), fast.get("ms_eager", fast["ms"])
    return s / f, "plain"


def table(records: Sequence[dict]) -> str:
    """Text table of ``attention`` records, one block per case: for each implementation the
    forward's and the forward + backward's time (CUDA-graph replays where captured, ``*``
    where only plain launches ran), TFLOP/s, peak extra memory (MB), and how many times faster
    fusedlib is; then what was not timed and why. Other records (the copy ceiling) are ignored.
    """
    rows = _rows(records)
    if not rows:
        return "no attention records"
    out = []
    for shape, variant in _cases_of(rows):
        at = [r for r in rows if tuple(r["shape"]) == shape and r.get("variant", "") == variant]
        first = at[0]
        out.append(f"attention {_case_label(shape, variant, first.get('shape_names', SHAPE_NAMES))}, "
                   f"{first['dtype']}, {first['device']} (ms: CUDA-graph replays; * plain launches)")
        out.append(f"{'impl':<23}{'fwd ms':>9}{'TFLOP/s':>9}{'peak MB':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}"
                   f"{'peak MB':>9}{'fusedlib is (fwd, fwd+bwd)':>29}")
        for impl in sorted({r["impl"] for r in at}, key=_order):
            line = f"{impl:<23}"
            ratios = []
            for pas in ("fwd", "fwd+bwd"):
                r = _find(at, shape, variant, impl, pas)
                w = 12 if pas == "fwd+bwd" else 9
                if r is None:
                    line += f"{'-':>{w}}{'-':>9}{'-':>9}"
                    ratios.append("-")
                    continue
                star = "*" if r.get("timer") == "do_bench" else ""
                tf = f"{r['TFLOPs']:.0f}" if r.get("TFLOPs") is not None else "-"
                peak = f"{r['peak_bytes'] / 1e6:.0f}" if r.get("peak_bytes") is not None else "-"
                line += f"{r['ms']:>{w - 1}.3f}{star or ' '}{tf:>9}{peak:>9}"
                f = _find(at, shape, variant, "fusedlib", pas)
                ratios.append(f"{_ratio(r, f)[0]:.2f}x" if f is not None and impl != "fusedlib" else "-")
            out.append(line + f"{', '.join(ratios) if impl != 'fusedlib' else '':>29}")
        for impl, why in first.get("not_timed", {}).items():
            out.append(f"  {impl}: not timed: {why[:300]}")
        out.append("")
    return "\n".join(out).rstrip()


def goal_lines(records: Sequence[dict]) -> list[str]:
    """One sentence per case and goal, with its numbers, from the records: fusedlib against SDPA's
    flash backend (faster in each pass: :data:`GOAL_FLASH`) and against cuDNN (forward + backward
    within :data:`GOAL_CUDNN`), each ratio like with like (CUDA-graph replays where both have one,
    else plain launches); then fusedlib's peak memory in forward + backward against the size of one
    bf16 [b, h, s, s] score tensor. A comparison whose records are missing says so."""
    rows = _rows(records)
    lines = []
    for shape, variant in _cases_of(rows):
        label = _case_label(shape, variant)
        for pas in ("fwd", "fwd+bwd"):
            f = _find(rows, shape, variant, "fusedlib", pas)
            fl = _find(rows, shape, variant, "sdpa-flash", pas)
            if f is None or fl is None:
                lines.append(f"{label} {pas}: no {'fusedlib' if f is None else 'sdpa-flash'} record to compare")
                continue
            ratio, how = _ratio(fl, f)
            lines.append(f"{label} {pas}: fusedlib {f['ms']:.3f} ms ({f.get('TFLOPs', float('nan')):.0f} TFLOP/s), "
                         f"sdpa-flash {fl['ms']:.3f} ms: fusedlib {ratio:.2f}x as fast ({how}); "
                         f"goal faster than sdpa-flash: {ratio > GOAL_FLASH}")
        f = _find(rows, shape, variant, "fusedlib", "fwd+bwd")
        cu = _find(rows, shape, variant, "sdpa-cudnn", "fwd+bwd")
        if f is not None and cu is not None:
            ratio, how = _ratio(f, cu)
            lines.append(f"{label} fwd+bwd: fusedlib takes {ratio:.2f}x cuDNN's time ({how}); "
                         f"goal within {GOAL_CUDNN}x of cuDNN: {ratio <= GOAL_CUDNN}")
        if f is not None and f.get("peak_bytes") is not None:
            b, h, s, _ = shape
            scores = 2 * b * h * s * s
            lines.append(f"{label} fwd+bwd: fusedlib's peak extra memory {f['peak_bytes'] / 1e6:.0f} MB, "
                         f"{f['peak_bytes'] / scores:.3f} of one bf16 [b, h, s, s] score tensor "
                         f"({scores / 1e6:.0f} MB)")
    return lines


#: The plot's colour of each implementation, one colour each (fusedlib's red as in every chapter).
PLOT_COLORS: dict[str, str] = {
    "fusedlib": "#d62728",
    "fusedlib-deterministic": "#8c1c1c",
    "sdpa-cudnn": "#1f77b4",
    "sdpa-flash": "#17becf",
    "sdpa-efficient": "#9575cd",
    "sdpa-math": "#bcaaa4",
    "fusedlib-materialised": "#f4a6a6",
    "eager": "#9e9e9e",
    "torch.compile": "#5c6bc0",
}


def _color(impl: str) -> str:
    """``impl``'s colour in :func:`plot` (an implementation not in :data:`PLOT_COLORS`: slate)."""
    return PLOT_COLORS.get(impl, "#607d8b")


def plot(records: Sequence[dict], ceiling: Optional[dict] = None, axes=None):
    """Bar chart of TFLOP/s per implementation, one group of bars per case, one panel per pass
    (fwd, fwd+bwd), with the bf16 matmul ceiling (``ceiling``: the ``"matmul"`` record of
    ``ceilings.json``) as a dashed line where given.

    Returns:
        The matplotlib Figure. The y axes start at 0; the legend sits under the panels.

    Raises:
        ValueError: when no attention record has ``TFLOPs``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = [r for r in _rows(records) if r.get("TFLOPs") is not None]
    if not rows:
        raise ValueError("records: no attention record with TFLOPs")
    groups = _cases_of(rows)
    impls = sorted({r["impl"] for r in rows}, key=_order)
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    fig = axes[0].figure
    width = 0.8 / len(impls)
    top = 0.0
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for j, (shape, variant) in enumerate(groups):
                r = _find(rows, shape, variant, impl, pas)
                if r is not None:
                    xs.append(j + (k - (len(impls) - 1) / 2) * width)
                    ys.append(r["TFLOPs"])
            if xs:  # fusedlib-deterministic has no forward of its own
                ax.bar(xs, ys, width, label=impl, color=_color(impl))
            top = max([top] + ys)
        if ceiling is not None and ceiling.get("TFLOPs"):
            ax.axhline(ceiling["TFLOPs"], color="k", ls="--", lw=1)
            top = max(top, ceiling["TFLOPs"])
        ax.set_xticks(range(len(groups)), [f"{list(s)}\n{v}" for s, v in groups], fontsize=8)
        ax.set_title(f"attention {pas}, {rows[0]['dtype']}, {rows[0]['device']}", fontsize=10)
        ax.set_xlabel("[b, h, s, d]")
    axes[0].set_ylim(0, 1.08 * top)
    axes[0].set_ylabel("TFLOP/s (higher is better)")
    # the legend from proxies, one per implementation drawn in either panel (a panel's own
    # handles would miss an implementation it has no bars of), and the ceiling's line
    handles = [Patch(facecolor=_color(impl), label=impl) for impl in impls]
    if ceiling is not None and ceiling.get("TFLOPs"):
        handles.append(Line2D([], [], color="k", ls="--", lw=1,
                              label=f"bf16 matmul ceiling {ceiling['TFLOPs']:.0f} TFLOP/s"))
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=min(5, len(handles)), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the bottom strip holds the legend
    return fig
