"""Host cost per call: ``python -m fusedlib.bench --host``.

The kernels can be near the copy ceiling while the Python around them is not: an eager
training step pays, for every op, the host's time to check arguments, pick launch settings,
run ``autograd.Function`` and launch the kernels. Below a few hundred microseconds of GPU
work per op, that time, not the kernels, decides the step's speed. This module measures it.

Method (the protocol of :mod:`fusedlib.bench.core`): each op at a tiny shape (:data:`HOST_SHAPES`: a few thousand
elements, so the GPU work per call is a few microseconds and the GPU waits on the host),
for fusedlib, eager unfused PyTorch and ``torch.compile`` of it (compiled statically for that
shape, :func:`fusedlib.bench.ops.baselines.compile_impl`), in two passes:

* ``"fwd"``: the op's forward on inputs that need no gradient, under ``torch.no_grad()``
  (as the throughput benchmark's forward pass);
* ``"fwd+bwd"``: the forward on inputs that need gradients, then
  ``out.float().sum().backward()``, the same for all three; every call first sets the
  inputs' ``.grad`` to None (as ``zero_grad(set_to_none=True)``), so no call pays for
  accumulating into the last one's gradients.

After :data:`WARMUP` calls of every implementation (Triton compiles its kernels, Inductor its
graph), the implementations take turns: :data:`REPEATS` rounds, in each one repeat of
:data:`CALLS` back-to-back calls per implementation with one ``torch.cuda.synchronize()`` at the
end, so all three are timed in the same state of the process (Inductor's worker threads, once
it has compiled, slow every Python-side call). Per repeat, microseconds per call:

* ``us``: wall time of the calls and the final synchronize (the enqueue rate the GPU sees);
* ``enqueue_us``: wall time of the calls alone (``time.perf_counter`` before the synchronize);
* ``cpu_us``: CPU time of the process during the calls (``time.process_time``: every thread,
  the autograd engine's device thread that runs the backward included).

Each record holds the medians over the repeats, and the repeats of ``us``. Records
(``chapters/data/bench/host.json``, a JSON list)::

    {"op": "host", "measured_op": "bias_gelu", "pass": "fwd+bwd", "impl": "fusedlib",
     "shape": [32, 256], "dtype": "bfloat16", "us": 835.1, "enqueue_us": 801.3,
     "cpu_us": 820.7, "us_repeats": [...], "calls": 300, "repeats": 5, "warmup": 20,
     "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}

with ``"compile": "static"`` on torch.compile's records.

Without a GPU, ``python -m fusedlib.bench --host`` refuses (exit status 2): on the CPU
Triton's interpreter runs every kernel in Python, so the numbers would mean nothing, and
writing them would overwrite the H200's file. :func:`measure_host` itself runs on any
device (the tests use it on the CPU with a few calls).

The floor (:func:`measure_floor`, in the same file as ``"op": "host_floor"`` records, one per
part and pass, timed after the ops in the same process): what an op built like fusedlib's costs
the host per call at the least, with LayerNorm's host work. :class:`SkeletonLayerNorm` is an
``autograd.Function``, called through fusedlib's ``apply`` as the ops are, that does that work
and nothing else: the forward allocates y and the row statistics, launches one kernel that does
nothing (:func:`_noop_kernel`) through fusedlib's launch layer and saves its tensors; the
backward allocates the three gradients and launches the no-op kernel once. No argument checks,
no tile lookup, no arithmetic. Beside it, in turns with it: the eager ``F.layer_norm``,
fusedlib's ``fused_layer_norm``, the skeleton without its launches, one ``torch.empty_like``,
and a launch of the no-op kernel through fusedlib's launch layer, through Triton's
``kernel[grid]`` and through Triton's C launcher alone. :func:`floor_table` prints them.

Source: the CUDA C++ Programming Guide, "Asynchronous Concurrent Execution" (a kernel launch
returns to the host before the kernel runs, so back-to-back launches measure the host).
"""
from __future__ import annotations

import contextlib
import logging
import numbers
import statistics
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..fusions._apply import InferenceCtx
from ..fusions._apply import apply as _fused_apply
from ..fusions.fused_layer_norm import fused_layer_norm
from ..runtime import launch
from .core import PASSES, BenchCase, Impl, environment, require_fields
from .ops import OP_MODULES, get_case

__all__ = [
    "HOST_SHAPES",
    "HOST_IMPLS",
    "HOST_EXTRA_IMPLS",
    "CALLS",
    "REPEATS",
    "WARMUP",
    "host_timing",
    "time_in_turns",
    "host_step",
    "host_record",
    "measure_host",
    "merge_host_records",
    "host_table",
    "FLOOR_SHAPE",
    "FLOOR_PARTS",
    "SkeletonLayerNorm",
    "measure_floor",
    "floor_table",
]

logger = logging.getLogger("fusedlib.bench")

#: Tiny shape per op (the op's own layout: [rows, h], GLUs [rows, 2h], causal softmax
#: [b·np, sq, sk], the other softmaxes [b, np, sq, sk], cross entropy [rows, V], RoPE [s, b, np, d],
#: attention [b, h, s, d] (causal), a transformer block [s, b, h, heads, ffn, layers]: a training
#: step of its 4 layers). A few thousand elements: each kernel is a few microseconds of GPU time,
#: so the host decides.
HOST_SHAPES: dict[str, tuple[int, ...]] = {
    "bias_gelu": (32, 256),
    "fused_dense": (32, 64, 256),
    "bias_dropout_add": (32, 256),
    "geglu": (32, 512),
    "swiglu": (32, 512),
    "weighted_swiglu": (32, 512),
    "layer_norm": (32, 256),
    "rms_norm": (32, 256),
    "bias_dropout_add_norm": (32, 256),
    "causal_softmax": (4, 32, 32),
    "masked_softmax": (1, 4, 32, 32),
    "softmax_one": (1, 4, 32, 32),
    "softmax_dropout": (1, 4, 32, 32),
    "cross_entropy": (32, 512),
    "rope": (16, 2, 4, 64),
    "attention": (1, 2, 32, 64),
    "transformer_layer": (32, 2, 64, 4, 256, 4),
}

#: The implementations timed: fusedlib and what a user writes without it.
HOST_IMPLS: tuple[str, ...] = ("fusedlib", "eager", "torch.compile")

#: More implementations ``python -m fusedlib.bench --host`` times for an op: where fusedlib's
#: choice at the tiny host shape is not the path it takes at training sizes (``fused_dense``
#: takes cuBLASLt's epilogues from 2^24 activation elements up, through ``ctypes``).
HOST_EXTRA_IMPLS: dict[str, tuple[str, ...]] = {"fused_dense": ("fusedlib-epilogue",)}

CALLS = 300  #: back-to-back calls per repeat
REPEATS = 5  #: repeats; records hold the medians
WARMUP = 20  #: untimed calls first (compiles, caches, allocator)


def host_timing(step: Callable[[], object], calls: int = CALLS, repeats: int = REPEATS,
                sync: Callable[[], object] = lambda: None,
                clock: Callable[[], float] = time.perf_counter,
                cpu_clock: Callable[[], float] = time.process_time) -> dict:
    """Time ``repeats`` x ``calls`` back-to-back calls of ``step``, one ``sync()`` per repeat.

    Args:
        step: one call of the op (enqueues GPU work and returns).
        calls: calls per repeat (>= 1).
        repeats: repeats (>= 1).
        sync: waits for the device (``torch.cuda.synchronize``); called before each repeat
            (untimed, so no earlier work is charged) and at its end (timed).
        clock: wall clock in seconds (``time.perf_counter``; tests pass a fake).
        cpu_clock: the process's CPU time in seconds (``time.process_time``).

    Returns:
        ``{"us", "enqueue_us", "cpu_us"}``: medians over the repeats of microseconds per call
        of wall time with the final sync, wall time of the calls alone, and CPU time of the
        calls alone; and ``"us_repeats"``, the repeats' ``us`` in order.

    Raises:
        ValueError: for ``calls`` or ``repeats`` below 1.
    """
    if calls < 1 or repeats < 1:
        raise ValueError(f"calls and repeats must be >= 1, got calls={calls}, repeats={repeats}")
    wall, enqueue, cpu = [], [], []
    for _ in range(repeats):
        sync()
        t0, c0 = clock(), cpu_clock()
        for _ in range(calls):
            step()
        c1, t1 = cpu_clock(), clock()
        sync()
        t2 = clock()
        wall.append((t2 - t0) / calls * 1e6)
        enqueue.append((t1 - t0) / calls * 1e6)
        cpu.append((c1 - c0) / calls * 1e6)
    return {"us": statistics.median(wall), "enqueue_us": statistics.median(enqueue),
            "cpu_us": statistics.median(cpu), "us_repeats": wall}


def host_step(case: BenchCase, impl: Impl, pass_: str, device: torch.device
              ) -> tuple[Callable[[], object], contextlib.AbstractContextManager]:
    """One call of ``impl`` in ``pass_``, on fresh inputs of ``case``, and the context to run it in.

    Args:
        case: the op at its (tiny) shape.
        impl: the implementation.
        pass_: ``"fwd"`` (no gradients; run it in the returned ``torch.no_grad()``) or
            ``"fwd+bwd"`` (``.grad = None`` on every input leaf, the forward, then
            ``out.float().sum().backward()``; of a tuple output the first item, or every item
            with :attr:`~fusedlib.bench.core.BenchCase.all_outputs`;
            an implementation's own parameters (:attr:`Impl.params`) get ``.grad = None`` too).
        device: where the inputs live.

    Returns:
        ``(step, context)``.

    Raises:
        ValueError: for another pass.
    """
    if pass_ == "fwd":
        inputs = case.make_inputs(device, False)
        return (lambda: impl.fn(*inputs)), torch.no_grad()
    if pass_ != "fwd+bwd":
        raise ValueError(f"pass_ must be 'fwd' or 'fwd+bwd', got {pass_!r}")
    inputs = case.make_inputs(device, True)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in leaves + (list(impl.params()) if impl.params is not None else []):
            t.grad = None
        outs = case.backward_outputs(impl.fn(*inputs))
        torch.autograd.backward([o.float().sum() for o in outs])

    return step, contextlib.nullcontext()


def host_record(op: str, pass_: str, impl: Impl, shape: Sequence[int], dtype: torch.dtype, timing: dict,
                calls: int, repeats: int, warmup: int) -> dict:
    """One ``host.json`` record (module docstring) from :func:`host_timing`'s result."""
    rec = {
        "op": "host", "measured_op": op, "pass": pass_, "impl": impl.name, "shape": list(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "us": round(timing["us"], 2), "enqueue_us": round(timing["enqueue_us"], 2),
        "cpu_us": round(timing["cpu_us"], 2), "us_repeats": [round(u, 2) for u in timing["us_repeats"]],
        "calls": calls, "repeats": repeats, "warmup": warmup, **environment(),
    }
    if impl.compile is not None:
        rec["compile"] = impl.compile
    return rec


def measure_host(op: str, device: torch.device | str = "cuda", calls: int = CALLS, repeats: int = REPEATS,
                 warmup: int = WARMUP, impls: Iterable[str] = HOST_IMPLS, shape: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.bfloat16, passes: Sequence[str] = PASSES,
                 progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict[str, str]]:
    """Host cost per call of ``op`` for each implementation in ``impls`` and each pass.

    Args:
        op: an op name (:data:`fusedlib.bench.ops.OP_MODULES`).
        device: a CUDA device for meaningful numbers (on the CPU the sync is a no-op and the
            kernels run in Triton's interpreter: for tests only).
        calls, repeats, warmup: see :func:`host_timing` and the module docstring.
        impls: implementation names to time, of those the op's case has.
        shape: the op's shape (default :data:`HOST_SHAPES`).
        dtype: the inputs' dtype.
        passes: subset of ("fwd", "fwd+bwd").
        progress: called with a label after each implementation and pass.

    Returns:
        ``(records, skipped)``: one record per (impl, pass) that ran; an implementation that
        raises is logged and named in ``skipped`` with its error, the others still run.

    Raises:
        KeyError: for an unknown op.
        ValueError: calls, repeats or warmup not an int; calls or repeats below 1, warmup below 0,
            an unknown pass, or an implementation name the op's case does not have (each would
            time nothing).
    """
    if op not in OP_MODULES:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(OP_MODULES)}")
    for name, v in (("calls", calls), ("repeats", repeats), ("warmup", warmup)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls and repeats must be >= 1 and warmup >= 0, got calls={calls}, repeats={repeats}, "
                         f"warmup={warmup}")
    if not isinstance(passes, str):
        passes = list(passes)  # (a generator would be used up by the check)
    if not isinstance(impls, str):
        impls = list(impls)
    if isinstance(passes, str) or any(p not in PASSES for p in passes):
        raise ValueError(f"passes must be a sequence of {PASSES}, got {passes!r}")
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    case = get_case(op)(tuple(shape or HOST_SHAPES[op]), dtype)
    known = [i.name for i in case.impls]
    if isinstance(impls, str) or any(name not in known for name in impls):
        raise ValueError(f"impls must be a sequence of {op}'s implementation names {known}, got {impls!r}")
    wanted = set(impls)
    records, skipped = [], {}
    for pas in passes:
        # every implementation warmed up first, then the repeats taken in turns (fusedlib, eager,
        # torch.compile, fusedlib, ...): all are timed in the same process state. Once Inductor has
        # compiled, its worker threads stay, and every call that runs Python (a backward node's
        # most of all) costs more than before: timing one implementation before the compile and
        # another after would compare two states, not two implementations.
        impls_by_name, steps = {}, {}
        for impl in case.impls:
            if impl.name not in wanted or pas not in impl.passes:
                continue
            try:
                steps[impl.name] = host_step(case, impl, pas, device)
            except Exception as exc:  # one failing implementation must not lose the others
                _skip(skipped, op, pas, impl.name, exc)
                continue
            impls_by_name[impl.name] = impl
        timings = time_in_turns(steps, calls, repeats, warmup, sync,
                                lambda name, exc: _skip(skipped, op, pas, name, exc))
        for name, timing in timings.items():
            records.append(host_record(op, pas, impls_by_name[name], case.shape, dtype, timing, calls, repeats,
                                       warmup))
            if progress:
                progress(f"host {op} {pas} {name}")
    return records, skipped


def time_in_turns(steps: dict[str, tuple[Callable[[], object], contextlib.AbstractContextManager]], calls: int,
                  repeats: int, warmup: int, sync: Callable[[], object],
                  skip: Callable[[str, Exception], object]) -> dict[str, dict]:
    """The timing protocol of :func:`measure_host` and :func:`measure_floor`: every step warmed
    up first (``warmup`` calls and a ``sync``), then ``repeats`` rounds, each timing one repeat
    of ``calls`` calls of every step in turn (:func:`host_timing`), so that all are timed in the
    same state of the process.

    Args:
        steps: name -> ``(step, context)``: the call, and the context it runs in (entered for
            the warm-up and for each repeat; ``torch.no_grad()`` or a null context).
        calls, repeats, warmup: as :func:`measure_host`.
        sync: waits for the device.
        skip: called with a step's name and the exception when it raises (in the warm-up or a
            repeat); that step is dropped, the others go on.

    Returns:
        name -> ``{"us", "enqueue_us", "cpu_us"}`` (medians over the repeats, microseconds per
        call) and ``"us_repeats"``, for every step that did not raise, in ``steps``' order.
    """
    timings: dict[str, list[dict]] = {}
    for name, (step, ctx) in steps.items():
        try:
            with ctx:
                for _ in range(warmup):
                    step()
                sync()
        except Exception as exc:
            skip(name, exc)
            continue
        timings[name] = []
    for _ in range(repeats):
        for name in list(timings):
            step, ctx = steps[name]
            try:
                with ctx:
                    timings[name].append(host_timing(step, calls, 1, sync))
            except Exception as exc:
                skip(name, exc)
                del timings[name]
    out = {}
    for name, ts in timings.items():
        out[name] = {key: statistics.median(t[key] for t in ts) for key in ("us", "enqueue_us", "cpu_us")}
        out[name]["us_repeats"] = [t["us"] for t in ts]
    return out


def _skip(skipped: dict, op: str, pas: str, name: str, exc: Exception) -> None:
    """Log an implementation that failed and name it in ``skipped`` (the others still run)."""
    logger.warning("host %s %s %s failed: %s: %s", op, pas, name, type(exc).__name__, exc)
    skipped[name] = f"{pas}: {type(exc).__name__}: {exc}"


def merge_host_records(new: list[dict], old: list[dict]) -> list[dict]:
    """``new``, then the records of ``old`` whose op was not measured in ``new``: a run of a
    few ops (``--op``) keeps the others' records in ``host.json``; each record names its
    device and versions, and the three implementations of one op always come from one run."""
    measured = {r["measured_op"] for r in new}
    return list(new) + [r for r in old if r.get("measured_op") not in measured]


def host_table(records: Sequence[dict], field: str = "us") -> str:
    """Text table of ``host.json`` records: per op and pass, microseconds per call of fusedlib,
    eager and torch.compile, and fusedlib's time over eager's.

    Args:
        records: host records (other records are ignored).
        field: ``"us"`` (wall time with the final sync), ``"enqueue_us"`` or ``"cpu_us"``.

    Returns:
        The table; a missing measurement shows as ``-``.

    Raises:
        ValueError: for another field, or naming the record, when a host record lacks
            ``measured_op``, ``pass``, ``impl`` or ``field`` (or the first one ``device``,
            ``torch`` or ``triton``).

    Source: fusedlib's host protocol (:func:`measure_host`).
    """
    if field not in ("us", "enqueue_us", "cpu_us"):
        raise ValueError(f"field must be 'us', 'enqueue_us' or 'cpu_us', got {field!r}")
    require_fields("host_table", records, ("measured_op", "pass", "impl", field), when=lambda r: r.get("op") == "host")
    rows = [r for r in records if r.get("op") == "host"]
    require_fields("host_table", rows[:1], ("device", "torch", "triton"), where="host records")
    value = {(r["measured_op"], r["pass"], r["impl"]): r[field] for r in rows}
    ops = [op for op in OP_MODULES if any(r["measured_op"] == op for r in rows)]
    ops += sorted({r["measured_op"] for r in rows} - set(ops))
    what = {"us": "wall time per call with one sync at the end", "enqueue_us": "wall time per call, enqueue only",
            "cpu_us": "CPU time per call, enqueue only"}[field]
    env = f" ({rows[0]['device']}, torch {rows[0]['torch']}, triton {rows[0]['triton']})" if rows else ""
    cols = ("fusedlib", "eager", "compile", "f/eager")
    w = max([18] + [len(op) + 1 for op in ops])  # the op column: the longest name and a space
    out = [f"{field}: {what}, microseconds{env}",
           f"{'':<{w}}" + "".join(f"{p + ' (us)':<38}" for p in PASSES).rstrip(),
           f"{'op':<{w}}" + "".join("".join(f"{c:>9}" for c in cols) + "  " for _ in PASSES).rstrip()]
    for op in ops:
        line = f"{op:<{w}}"
        for p in PASSES:
            vals = [value.get((op, p, i)) for i in HOST_IMPLS]
            line += "".join(f"{'-' if v is None else f'{v:.0f}':>9}" for v in vals)
            f, e = vals[0], vals[1]
            line += f"{f'{f / e:.2f}x' if f is not None and e else '-':>9}  "
        out.append(line.rstrip())
    return "\n".join(out)


# ----------------------------------------------------------------------------------------
# The floor: LayerNorm's host work without LayerNorm
# ----------------------------------------------------------------------------------------

#: The floor's shape, [rows, h] (LayerNorm's host shape).
FLOOR_SHAPE: tuple[int, int] = (32, 256)


@triton.jit
def _noop_kernel(X_ptr, n_cols, BLOCK: tl.constexpr):
    """Does nothing: its launch costs the host a launch of a kernel with two arguments and a
    constexpr, and the GPU next to nothing."""
    pass


def _noop_launch(t: torch.Tensor) -> None:
    launch(_noop_kernel, (1,), t.device, t, t.shape[-1], BLOCK=16)


class SkeletonLayerNorm(torch.autograd.Function):
    """LayerNorm's host work and nothing else, built as fusedlib's ops are built: the least an
    op like fusedlib's LayerNorm (an ``autograd.Function`` called through fusedlib's ``apply``,
    launching through fusedlib's launch layer) can cost the host per call.

    ``forward(ctx, x, weight, bias, launches=True)``: allocates y (x's shape and dtype) and one
    float32 [2, rows] buffer for the row statistics (rows = x.numel() // h), launches
    :func:`_noop_kernel` once (with ``launches``), saves ``(x, weight, bias, stats)``, returns y.
    Through fusedlib's ``apply`` without autograd (a stand-in ``ctx`` that saves nothing), as the
    ops do: no statistics (no backward will read them). ``backward``: allocates dx, dweight, dbias, launches the no-op kernel once
    (with ``launches``), returns them. Every output is uninitialised memory: for timing only.

    Shapes: x [..., h] (h >= 1), weight and bias [h], tensors (any dtype and device the no-op
    kernel runs on).

    Raises:
        IndexError: a 0-d x. TypeError: weight or bias not a tensor (in the backward).

    Source: fusedlib (a measurement device, not an op).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, launches: bool = True):
        y = torch.empty_like(x)
        stats = None
        if type(ctx) is not InferenceCtx:  # a backward will run: the row statistics (mean, rstd)
            stats = torch.empty((2, x.numel() // x.shape[-1]), dtype=torch.float32, device=x.device)
        if launches:
            _noop_launch(x)
        ctx.save_for_backward(x, weight, bias, stats)
        ctx.launches = launches
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias, _ = ctx.saved_tensors
        dx, dweight, dbias = torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)
        if ctx.launches:
            _noop_launch(dy)
        return dx, dweight, dbias, None


#: The floor's parts per pass, in table order; ``"eager"`` is ``F.layer_norm``. The launch
#: parts launch :func:`_noop_kernel`: through fusedlib's launch layer, through Triton's
#: ``kernel[grid]``, and through Triton's C launcher alone
#: (:func:`fusedlib.kernels.launch.bound_launch`: CUDA with direct launches only).
FLOOR_PARTS: dict[str, tuple[str, ...]] = {
    "fwd": ("eager", "fusedlib", "skeleton", "skeleton, no launch", "torch.empty_like",
            "launch (fusedlib)", "launch (kernel[grid])", "launch (C launcher)"),
    "fwd+bwd": ("eager", "fusedlib", "skeleton", "skeleton, no launch"),
}


def _floor_steps(pass_: str, device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], object] | None]:
    """The calls :func:`measure_floor` times, by part, for ``pass_`` (None: the part does not
    exist on this device)."""
    rows, h = FLOOR_SHAPE
    grad = pass_ == "fwd+bwd"
    gen = torch.Generator(device="cpu").manual_seed(0)
    cpu32 = dict(generator=gen, device="cpu", dtype=torch.float32)  # drawn on the CPU, then moved
    x = torch.randn(rows, h, **cpu32).to(device=device, dtype=dtype).requires_grad_(grad)
    w = torch.randn(h, **cpu32).to(device=device, dtype=dtype).requires_grad_(grad)
    b = torch.randn(h, **cpu32).to(device=device, dtype=dtype).requires_grad_(grad)
    c_launch = None
    if not grad and device.type == "cuda":
        from ..kernels.launch import bound_launch

        c_launch = bound_launch(_noop_kernel, (1,), device.index if device.index is not None
                                else torch.cuda.current_device(), (x, h), {"BLOCK": 16})
    forwards = {
        "eager": lambda: F.layer_norm(x, (h,), w, b),
        "fusedlib": lambda: fused_layer_norm(x, w, b),
        "skeleton": lambda: _fused_apply(SkeletonLayerNorm, x, w, b, True),
        "skeleton, no launch": lambda: _fused_apply(SkeletonLayerNorm, x, w, b, False),
        "torch.empty_like": lambda: torch.empty_like(x),
        "launch (fusedlib)": lambda: _noop_launch(x),
        "launch (kernel[grid])": lambda: _noop_kernel[(1,)](x, h, BLOCK=16),
        "launch (C launcher)": c_launch,
    }
    if not grad:
        return {part: forwards[part] for part in FLOOR_PARTS[pass_]}

    def fwd_bwd(fwd):
        def step():
            x.grad = w.grad = b.grad = None
            fwd().float().sum().backward()
        return step

    return {part: fwd_bwd(forwards[part]) for part in FLOOR_PARTS[pass_]}


def measure_floor(device: torch.device | str = "cuda", calls: int = CALLS, repeats: int = REPEATS,
                  warmup: int = WARMUP, dtype: torch.dtype = torch.bfloat16,
                  passes: Sequence[str] = PASSES) -> tuple[list[dict], dict[str, str]]:
    """Host cost per call, in microseconds, of each part of :data:`FLOOR_PARTS` at
    :data:`FLOOR_SHAPE`, timed as :func:`measure_host` times the ops: every part warmed up,
    then the repeats taken in turns (the parts of a pass share the process's state); "fwd"
    under ``torch.no_grad()``, "fwd+bwd" with ``.grad = None`` on x, weight and bias and
    ``out.float().sum().backward()``.

    Args:
        device: a CUDA device for meaningful numbers (on the CPU, for tests: the launches
            run in Triton's interpreter and the C launcher part does not exist).
        calls, repeats, warmup: as :func:`measure_host` (calls and repeats >= 1, warmup >= 0).
        dtype: the inputs' dtype, a floating-point dtype F.layer_norm takes.
        passes: a sequence of "fwd" and "fwd+bwd".

    Returns:
        ``(records, skipped)``: one record per part and pass that ran, ``{"op": "host_floor",
        "measured_op": "host_floor", "part", "pass", "shape", "dtype", "us", "enqueue_us",
        "cpu_us", "us_repeats", "calls", "repeats", "warmup", device and versions}`` (times in
        microseconds per call); ``skipped`` maps ``"pass: part"`` to why a part did not run
        (it raised, or does not exist on the device), the other parts still run.

    Raises:
        ValueError: calls or repeats below 1, warmup below 0, an unknown pass.

    Source: fusedlib; the method of :func:`measure_host`.
    """
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls and repeats must be >= 1 and warmup >= 0, got calls={calls}, repeats={repeats}, "
                         f"warmup={warmup}")
    if isinstance(passes, str) or any(p not in PASSES for p in passes):
        raise ValueError(f"passes must be a sequence of {PASSES}, got {passes!r}")
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    records, skipped = [], {}
    for pas in passes:
        ctx = torch.no_grad() if pas == "fwd" else contextlib.nullcontext()
        try:
            steps = _floor_steps(pas, device, dtype)
        except Exception as exc:
            skipped[pas] = f"{type(exc).__name__}: {exc}"
            logger.warning("host floor %s: %s: %s", pas, type(exc).__name__, exc)
            continue
        for part in [part for part, step in steps.items() if step is None]:
            skipped[f"{pas}: {part}"] = f"no such launch on {device.type} here"
            del steps[part]

        def skip(part, exc, pas=pas):
            skipped[f"{pas}: {part}"] = f"{type(exc).__name__}: {exc}"
            logger.warning("host floor %s %s: %s: %s", pas, part, type(exc).__name__, exc)

        timings = time_in_turns({part: (step, ctx) for part, step in steps.items()}, calls, repeats, warmup, sync,
                                skip)
        for part, t in timings.items():
            rec = {"op": "host_floor", "measured_op": "host_floor", "part": part, "pass": pas,
                   "shape": list(FLOOR_SHAPE), "dtype": str(dtype).replace("torch.", "")}
            rec.update({key: round(t[key], 2) for key in ("us", "enqueue_us", "cpu_us")})
            rec.update({"us_repeats": [round(u, 2) for u in t["us_repeats"]], "calls": calls, "repeats": repeats,
                        "warmup": warmup, **environment()})
            records.append(rec)
    return records, skipped


def floor_table(records: Sequence[dict], field: str = "us") -> str:
    """Text table of the ``host_floor`` records: per pass, each part's microseconds per call
    (the median over the repeats, and with ``field="us"`` the repeats' least and greatest),
    and its median over the eager ``F.layer_norm``'s.

    Args:
        records: any records (only ``"op": "host_floor"`` ones are read; parts and passes not
            in :data:`FLOOR_PARTS` are left out).
        field: ``"us"``, ``"enqueue_us"`` or ``"cpu_us"``.

    Returns:
        The table (``-`` for a ratio without an eager record).

    Raises:
        ValueError: for another field, or when there is no floor record.
        KeyError: a floor record without the fields :func:`measure_floor` writes.

    Source: fusedlib.
    """
    if field not in ("us", "enqueue_us", "cpu_us"):
        raise ValueError(f"field must be 'us', 'enqueue_us' or 'cpu_us', got {field!r}")
    rows = [r for r in records if r.get("op") == "host_floor"]
    if not rows:
        raise ValueError("records: no host_floor record (python -m fusedlib.bench --host writes them)")
    r0 = rows[0]
    what = {"us": "wall time with one sync at the end", "enqueue_us": "wall time, enqueue only",
            "cpu_us": "CPU time, enqueue only"}[field]
    spread = field == "us"
    out = [f"LayerNorm's host work at {r0['shape']} {r0['dtype']}, {field}: {what}, microseconds per call "
           f"({r0['device']}, torch {r0['torch']}, triton {r0['triton']})",
           f"{'pass':<9}{'part':<24}{'median':>9}" + (f"{'least':>9}{'most':>9}" if spread else "") + f"{'/ eager':>9}"]
    for pas in PASSES:
        by_part = {r["part"]: r for r in rows if r["pass"] == pas}
        eager = by_part["eager"][field] if "eager" in by_part else None
        for part in FLOOR_PARTS[pas]:
            if part not in by_part:
                continue
            r = by_part[part]
            line = f"{pas:<9}{part:<24}{r[field]:>9.1f}"
            if spread:
                reps = r.get("us_repeats") or [r[field]]
                line += f"{min(reps):>9.1f}{max(reps):>9.1f}"
            out.append(line + f"{f'{r[field] / eager:.2f}x' if eager else '-':>9}")
    return "\n".join(out)
