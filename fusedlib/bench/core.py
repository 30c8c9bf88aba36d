"""fusedlib's benchmark protocol, as a small library.

A benchmark *case* is one op at one shape and dtype: a function that makes fresh random
inputs, the fewest bytes each pass must move, and a set of implementations. Each
implementation is timed with ``triton.testing.do_bench`` (median, after warm-up) in the
same process as the others and as a device-to-device copy, which is the bandwidth
ceiling. Results are plain dict records, written as one JSON list per op.

Effective bandwidth = the case's byte count (each input read once, each output written
once) / median time. Every implementation of an op is charged the same bytes.

Model-level cases (a whole transformer block's training step, ``transformer_layer``) are not
memory-bound and have no such byte count: their ``bytes`` values are None, so are their
records' ``"bytes"`` and ``"GBps"``, and every table and plot of the harness and of
:mod:`fusedlib.book` shows ``-`` for them (or says that it cannot plot them). They count
tokens instead (:attr:`BenchCase.tokens`): records then carry ``"tokens"``,
``"tokens_per_s"`` (from ``"ms"``) and, with a CUDA graph, ``"tokens_per_s_eager"`` (from
``"ms_eager"``).

Compute-bound cases (attention, whose arithmetic grows as s² while its fewest bytes grow as s)
have no byte count either; they count floating-point operations (:attr:`BenchCase.flops`):
records then carry ``"flops"`` (the pass's count, the same for every implementation),
``"TFLOPs"`` (from ``"ms"``) and, with a CUDA graph, ``"TFLOPs_eager"`` (from ``"ms_eager"``).

Source: Triton's ``triton.testing.do_bench`` and ``perf_report``; quack's byte counts.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import triton

from ..kernels import launch as _launch
from ..runtime import collector_paused_for_capture, restore_after_failed_capture

__all__ = [
    "Impl",
    "BenchCase",
    "time_ms",
    "measure_case",
    "copy_record",
    "matmul_record",
    "write_records",
    "load_records",
    "environment",
    "peak_extra_bytes",
]

logger = logging.getLogger("fusedlib.bench")

#: Passes a case can be timed in: forward only (no autograd graph kept), and forward
#: plus backward of the whole output against a fixed random upstream gradient.
PASSES = ("fwd", "fwd+bwd")


@dataclass
class Impl:
    """One implementation of an op, as the benchmark sees it.

    Attributes:
        name: one of the benchmark's impl names ("fusedlib", "eager", "torch.compile",
            "megatron-core", "liger", "apex").
        fn: called with the case's inputs, returns the output tensor (or a tuple whose
            first item is timed in backward); must support autograd for "fwd+bwd".
        passes: which passes this implementation takes part in.
        compile: for a ``torch.compile`` baseline, how it was compiled: ``"static"`` (one
            compile per shape) or ``"dynamic"`` (one compile shared by several shapes);
            copied into its records. Build it with
            :func:`fusedlib.bench.ops.baselines.compile_impl`.
        params: for an implementation that owns parameters (a module), a function returning
            them (after ``fn``'s first call, which may build the module): their ``.grad`` is
            set to None before every timed call and before the peak-memory step, as
            ``zero_grad(set_to_none=True)`` does in training, so no call pays for
            accumulating into the last one's gradients. None: no parameters.
        info: extra fields copied into every record of this implementation (e.g. which
            fusions a baseline could turn on).
        generators: for an implementation that draws random numbers from CUDA generators
            other than the default one's current state, a function returning them (after
            ``fn``'s first call), for its CUDA graph to register (:func:`time_ms`). None: none.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    passes: Sequence[str] = PASSES
    compile: str | None = None
    params: Callable[[], Iterable[torch.Tensor]] | None = None
    info: dict = field(default_factory=dict)
    generators: Callable[[], Iterable[torch.Generator]] | None = None


@dataclass
class BenchCase:
    """One op at one shape and dtype.

    Attributes:
        op: the op's record file name ("bias_gelu", ...).
        shape: the headline shape, as recorded.
        dtype: the input dtype.
        make_inputs: ``(device, requires_grad) -> tuple of tensors``; random data, never zeros.
        bytes: fewest bytes per pass, e.g. ``{"fwd": ..., "fwd+bwd": ...}``; None as a pass's
            value for a case that is not memory-bound (see the module docstring): its records
            get ``"bytes": None`` and ``"GBps": None``.
        impls: implementations; those whose import failed are simply absent.
        skipped: impl name -> reason, for the log and the chapter.
        peak_memory: also record ``peak_bytes`` (CUDA only): the most memory one call of the
            pass allocates beyond what was allocated before it (outputs and gradients
            included, inputs not), from ``torch.cuda.max_memory_allocated``.
        cuda_graph: (default True) time each call both as the replay of a CUDA graph that
            captured it (CUDA only; ``"ms"``, with ``"timer": "cuda_graph"`` in the record)
            and as plain launches (``"ms_eager"``). Graph replays time the kernels; plain
            launches are what an eager training step pays, host included: for ops whose
            GPU work per call is a fraction of a millisecond, the host's time to launch a
            Python autograd step (several hundred microseconds on the H200 machine) is
            what plain launches measure. An implementation that cannot be captured keeps
            its plain-launch time in ``"ms"`` too, marked ``"timer": "do_bench"`` with the
            reason in ``"graph_error"``. False: plain launches only (no timer fields).
        tokens: tokens one call processes (a model's step: sequence length x micro-batch);
            records then get ``"tokens"``, ``"tokens_per_s"`` and ``"tokens_per_s_eager"``.
            None (default): no token counts.
        flops: floating-point operations per pass, e.g. ``{"fwd": ..., "fwd+bwd": ...}``
            (the same count for every implementation); records then get ``"flops"``,
            ``"TFLOPs"`` and ``"TFLOPs_eager"``. None (default): no FLOP counts.
        info: extra fields copied into every record of the case.
        all_outputs: the "fwd+bwd" pass sends a random gradient into every output of a tuple
            (an op whose two outputs both feed the model, as a norm's output and the next
            residual), not only the first (default False).
        plain_rounds: time the plain launches in this many rounds, the implementations taking
            turns (each timed once per round, in the case's order), and keep each one's median
            (default 1: one timing). For cases whose plain-launch time is the host's (a small
            model's training step): the host's speed moves over seconds, so one timing per
            implementation would give each a different host. Records then also carry
            ``"ms_plain_rounds"``, the rounds' times in order.
        replay_rounds: (default False) with ``plain_rounds`` > 1, time each captured
            implementation's CUDA-graph replay in the same rounds, right after its plain
            launches, and keep the median in ``"ms"`` (the rounds in ``"ms_replay_rounds"``).
            For comparisons of a few percent between implementations: one replay each, taken
            minutes apart, may meet the GPU at different clocks (a sustained load reaches the
            board's power limit), and the rounds' range says how far the replays of one
            implementation move within the run. An implementation whose replay fails in a later
            round keeps the rounds it finished, and ``"replay_rounds_error"`` says why.

    Raises:
        ValueError: ``plain_rounds`` not an int >= 1; ``replay_rounds`` not a bool.
    """

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make_inputs: Callable[[torch.device, bool], tuple[torch.Tensor, ...]]
    bytes: dict[str, int]
    impls: list[Impl]
    skipped: dict[str, str] = field(default_factory=dict)
    peak_memory: bool = False
    cuda_graph: bool = True
    tokens: int | None = None
    flops: dict[str, int] | None = None
    info: dict = field(default_factory=dict)
    all_outputs: bool = False
    plain_rounds: int = 1
    replay_rounds: bool = False

    def __post_init__(self) -> None:
        self.plain_rounds = _checked_rounds(self.plain_rounds)
        _check_replay_rounds(self.replay_rounds)

    def backward_outputs(self, out: object) -> tuple[torch.Tensor, ...]:
        """The outputs the "fwd+bwd" pass sends gradients into: the first item of a tuple
        output (or the output itself), or with :attr:`all_outputs` every item of the tuple."""
        if not isinstance(out, tuple):
            return (out,)
        return tuple(out) if self.all_outputs else (out[0],)


def _check_replay_rounds(value: object) -> None:
    """A ValueError naming replay_rounds unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"replay_rounds must be a bool, got {value!r}")


def _checked_rounds(value: object) -> int:
    """``value`` as an int >= 1 (numpy's ints taken), else a ValueError naming plain_rounds."""
    try:  # not a bool, a float or a string
        rounds = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        rounds = None
    if rounds is None or rounds < 1:
        raise ValueError(f"plain_rounds must be an int >= 1, got {value!r}")
    return rounds


def environment() -> dict[str, str | bool]:
    """Device name, torch and triton versions, and whether fusedlib launched its compiled
    kernels directly (:data:`fusedlib.kernels.launch.DIRECT_LAUNCH`), recorded with every
    measurement."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
            "direct_launch": bool(_launch.DIRECT_LAUNCH)}


def time_ms(fn: Callable[[], object], grad_to_none: Iterable[torch.Tensor] | None = None,
            warmup: int = 25, rep: int = 200, cuda_graph: bool = False,
            generators: Iterable[torch.Generator] = ()) -> float:
    """Median time of ``fn()`` in milliseconds, by ``triton.testing.do_bench``.

    Args:
        fn: the work to time; called many times.
        grad_to_none: tensors whose ``.grad`` is reset before each call (backward timing).
        warmup, rep: do_bench's warm-up and repetition budgets, in milliseconds.
        cuda_graph: (CUDA only) capture one call of ``fn`` in a CUDA graph (after three
            warm-up calls on a side stream, as ``torch.cuda.graph`` asks) and time the
            graph's replays: the device time of the kernels without the host's launch gaps.
            ``fn`` must not synchronize with the host. ``grad_to_none`` is then cleared
            before the warm-up calls and the capture, so the captured backward writes fresh
            gradient buffers, which every replay overwrites (no accumulation), and once more
            at the end. Python's garbage collector stays off during the capture
            (:func:`fusedlib.runtime.collector_paused_for_capture`, without the collection
            before it: the timer's own graph is freed when it returns).
        generators: (with ``cuda_graph``) CUDA generators ``fn`` draws from besides the default
            one's current state, iterated after the warm-up calls (a module built at its first
            call may create them) and registered with the graph before the capture
            (``CUDAGraph.register_generator_state``), so that each replay draws new random
            numbers from them too; e.g. the states of Megatron-core's graph-safe RNG tracker,
            which its attention dropout swaps into the default generator.

    Returns:
        The median, in ms. do_bench flushes the L2 cache between calls.

    Raises:
        RuntimeError: from ``torch.cuda.graph`` when ``fn`` cannot be captured, after the
            current stream, the caching allocator and the default CUDA generators are put back
            as they were (:func:`fusedlib.runtime.restore_after_failed_capture`) and
            ``generators`` taken out of capture mode; any exception of ``fn`` itself, from the
            warm-up calls.
    """
    if not cuda_graph:
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                             return_mode="median"))
    leaves = list(grad_to_none or [])

    def call() -> None:
        for t in leaves:  # a fresh gradient in every call, as with plain launches
            t.grad = None
        fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    registered = list(generators)
    graph = torch.cuda.CUDAGraph()
    for generator in registered:
        graph.register_generator_state(generator)
    try:
        # a failed capture leaves its side stream current, the allocator routing to its pool and
        # the generators (the registered ones too) in capture mode: all put back before the error
        with restore_after_failed_capture(generators=registered) as pool, \
                collector_paused_for_capture(collect=False), torch.cuda.graph(graph, pool=pool):
            call()
        return float(triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median"))
    finally:
        for t in leaves:
            t.grad = None
        del graph


def _record(op: str, pas: str, impl: str, shape: Sequence[int], dtype: torch.dtype, ms: float,
            nbytes: int | None) -> dict:
    """One record: op, pass, impl, shape, dtype, ms, bytes, GBps and :func:`environment`; ``nbytes`` None (a model-level case) gives
    ``"bytes": None`` and ``"GBps": None``."""
    return {
        "op": op, "pass": pas, "impl": impl, "shape": list(shape),
        "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 5),
        "bytes": None if nbytes is None else int(nbytes),
        "GBps": None if nbytes is None else round(nbytes / (ms * 1e-3) / 1e9, 1), **environment(),
    }


def copy_record(numel: int = 1 << 30, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict:
    """Time a device-to-device copy: the bandwidth ceiling of every memory-bound op.

    Args:
        numel: elements copied (default 2^30 bf16 = 2 GiB, far past the 60 MB L2).
        dtype: element type.
        device: where.

    Returns:
        A record with op "copy", pass "copy", impl "copy"; bytes = read + write.
    """
    src = torch.randn(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    nbytes = 2 * numel * src.element_size()
    return _record("copy", "copy", "copy", (numel,), dtype, ms, nbytes)


def matmul_record(n: int = 8192, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict:
    """Time an n x n x n matrix product on random data: the arithmetic ceiling.

    Returns:
        A record with op "matmul", pass "fwd", impl "torch" (cuBLAS), plus ``"TFLOPs"``
        (2·n³ / median time); ``bytes`` counts reading A, B and writing C once.
    """
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = time_ms(lambda: a @ b)
    rec = _record("matmul", "fwd", "torch", (n, n, n), dtype, ms, 3 * n * n * a.element_size())
    rec["TFLOPs"] = round(2 * n**3 / (ms * 1e-3) / 1e12, 1)
    return rec


def measure_case(case: BenchCase, device: torch.device, passes: Sequence[str] = PASSES,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time every implementation of a case in every requested pass.

    Args:
        case: the op, shape, inputs, bytes and implementations.
        device: where to run (a CUDA device for real numbers).
        passes: subset of ("fwd", "fwd+bwd").
        progress: called with a label after each timing (the CLI's progress bar): once per
            implementation and pass, and once more per later round of plain launches
            (:attr:`BenchCase.plain_rounds`), for an implementation that failed too.

    Returns:
        One record per (impl, pass) that ran: the fields of :func:`_record`, plus ``"compile"`` for a
        ``torch.compile`` baseline (:attr:`Impl.compile`) and, for a ``cuda_graph`` case on
        CUDA, ``"timer"``, ``"ms_eager"`` and (when the capture failed) ``"graph_error"``
        (:class:`BenchCase`); the token counts of a case with ``tokens``, the FLOP counts of
        a case with ``flops``; the case's and the
        implementation's ``info`` fields. An implementation that raises is logged with its error and
        left out, so one broken baseline does not lose the others. With
        :attr:`BenchCase.plain_rounds` > 1 the later rounds' plain-launch timings follow the
        first pass over the implementations: the records' plain-launch time is then the median
        of the rounds (``"ms_eager"``, and ``"ms"`` and ``"GBps"`` where no graph was timed), the
        rounds in ``"ms_plain_rounds"``; an implementation whose later round raises keeps the
        rounds it finished, and its record says why in ``"plain_rounds_error"``. With
        :attr:`BenchCase.replay_rounds` the captured implementations' replays are timed in the
        same rounds: ``"ms"`` is then their median, the rounds in ``"ms_replay_rounds"``
        (``"replay_rounds_error"`` for one that failed in a later round).

    Raises:
        ValueError: ``case.plain_rounds`` not an int >= 1; ``case.replay_rounds`` not a bool.
    """
    case.plain_rounds = _checked_rounds(case.plain_rounds)  # also when set after the case was made
    _check_replay_rounds(case.replay_rounds)
    records = []
    for pas in passes:
        plain = []  # (impl, its record, its plain-launch times, its replay times or None), in the case's order
        for impl in case.impls:
            if pas not in impl.passes:
                continue
            label = f"{case.op} {pas} {impl.name}"
            graph = case.cuda_graph and device.type == "cuda"
            try:
                ms, peak = _time_pass(case, impl, pas, device, peak=case.peak_memory and device.type == "cuda")
                timer, ms_graph, graph_error = "do_bench", None, None
                if graph:
                    try:
                        ms_graph, _ = _time_pass(case, impl, pas, device, cuda_graph=True)
                        timer = "cuda_graph"
                    except Exception as exc:  # not capturable: keep the plain-launch time
                        graph_error = f"{type(exc).__name__}: {exc}"[:300]
                        logger.warning("%s: no CUDA graph (%s); timed with plain launches", label, graph_error)
            except Exception as exc:  # a baseline that fails must not stop the run
                logger.warning("%s failed: %s: %s", label, type(exc).__name__, exc)
                case.skipped[impl.name] = f"{type(exc).__name__}: {exc}"
                if progress:  # the rounds it will not take
                    for _ in range(case.plain_rounds - 1):
                        progress(label)
            else:
                records.append(_record(case.op, pas, impl.name, case.shape, case.dtype,
                                       ms_graph if ms_graph is not None else ms, case.bytes[pas]))
                if impl.compile is not None:
                    records[-1]["compile"] = impl.compile
                if graph:
                    records[-1]["timer"] = timer
                    records[-1]["ms_eager"] = round(ms, 5)
                    if graph_error is not None:
                        records[-1]["graph_error"] = graph_error
                replays = [ms_graph] if case.replay_rounds and ms_graph is not None else None
                plain.append((impl, records[-1], [ms], replays))
                if peak is not None:
                    records[-1]["peak_bytes"] = int(peak)
                _rate_fields(case, pas, records[-1])
                records[-1].update({**case.info, **impl.info})
            if progress:
                progress(label)
        if case.plain_rounds > 1 and plain:
            _plain_rounds(case, pas, device, plain, progress)
    return records


def _plain_rounds(case: BenchCase, pas: str, device: torch.device, plain: list,
                  progress: Callable[[str], None] | None) -> None:
    """Rounds 2 to :attr:`BenchCase.plain_rounds` of a pass's plain-launch timings, the
    implementations in turns (``plain``: (impl, its record, [its first timing], [its first
    replay] or None) in the case's order), each one's replay timed right after its plain
    launches where a first replay is given (:attr:`BenchCase.replay_rounds`); then each
    record's plain-launch time set to the median of its rounds: ``"ms_eager"``, and ``"ms"``
    and ``"GBps"`` where no CUDA graph was timed, or the replays' median in ``"ms"`` and
    ``"GBps"`` where they were timed in rounds, with the token and FLOP fields that follow from
    them. An implementation whose round raises takes no further rounds of that timer, keeps
    those it finished and gets ``"plain_rounds_error"`` or ``"replay_rounds_error"``;
    ``progress`` is called once per implementation and round all the same."""
    errors, replay_errors = {}, {}
    for _ in range(case.plain_rounds - 1):
        for key, (impl, _, times, replays) in enumerate(plain):
            label = f"{case.op} {pas} {impl.name} (plain launches, in turns)"
            if key not in errors:
                try:
                    times.append(_time_pass(case, impl, pas, device)[0])
                except Exception as exc:  # keep the rounds it finished
                    errors[key] = f"{type(exc).__name__}: {exc}"[:300]
                    logger.warning("%s: a round failed (%s); its %d earlier kept", label, errors[key], len(times))
            if replays is not None and key not in replay_errors:
                try:
                    replays.append(_time_pass(case, impl, pas, device, cuda_graph=True)[0])
                except Exception as exc:  # keep the rounds it finished
                    replay_errors[key] = f"{type(exc).__name__}: {exc}"[:300]
                    logger.warning("%s: a replay round failed (%s); its %d earlier kept", label,
                                   replay_errors[key], len(replays))
            if progress:
                progress(label)
    for key, (impl, rec, times, replays) in enumerate(plain):
        ms = statistics.median(times)
        rec["ms_plain_rounds"] = [round(t, 5) for t in times]
        if key in errors:
            rec["plain_rounds_error"] = errors[key]
        if "ms_eager" in rec:
            rec["ms_eager"] = round(ms, 5)
        if replays is not None:  # the replays' median is "ms"
            ms = statistics.median(replays)
            rec["ms_replay_rounds"] = [round(t, 5) for t in replays]
            if key in replay_errors:
                rec["replay_rounds_error"] = replay_errors[key]
        if replays is not None or rec.get("timer", "do_bench") == "do_bench":  # (no graph: the plain time)
            timed = _record(case.op, pas, impl.name, case.shape, case.dtype, ms, case.bytes[pas])
            rec["ms"], rec["GBps"] = timed["ms"], timed["GBps"]
        _rate_fields(case, pas, rec)


def _rate_fields(case: BenchCase, pas: str, record: dict) -> None:
    """Add a case's token fields (with :attr:`BenchCase.tokens`) and FLOP fields (with
    :attr:`BenchCase.flops` for the pass) to ``record``, from its ``"ms"`` and ``"ms_eager"``."""
    if case.tokens is not None:
        record.update(_token_fields(case.tokens, record))
    if case.flops is not None and case.flops.get(pas) is not None:
        record.update(_flop_fields(case.flops[pas], record))


def _token_fields(tokens: int, record: dict) -> dict:
    """``tokens``, tokens per second from ``ms`` and (when timed) from ``ms_eager``."""
    out = {"tokens": int(tokens), "tokens_per_s": round(tokens / (record["ms"] * 1e-3))}
    if record.get("ms_eager"):
        out["tokens_per_s_eager"] = round(tokens / (record["ms_eager"] * 1e-3))
    return out


def _flop_fields(flops: int, record: dict) -> dict:
    """``flops``, TFLOP/s from ``ms`` and (when timed) from ``ms_eager``."""
    out = {"flops": int(flops), "TFLOPs": round(flops / (record["ms"] * 1e-3) / 1e12, 1)}
    if record.get("ms_eager"):
        out["TFLOPs_eager"] = round(flops / (record["ms_eager"] * 1e-3) / 1e12, 1)
    return out


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes one call of ``fn`` allocates at its peak beyond what was allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _time_pass(case: BenchCase, impl: Impl, pas: str, device: torch.device,
               peak: bool = False, cuda_graph: bool = False) -> tuple[float, int | None]:
    def generators() -> Iterator[torch.Generator]:  # (asked for when time_ms iterates: after its warm-up)
        if cuda_graph and impl.generators is not None:
            yield from impl.generators()

    if pas == "fwd":
        inputs = case.make_inputs(device, False)
        with torch.no_grad():
            ms = time_ms(lambda: impl.fn(*inputs), cuda_graph=cuda_graph, generators=generators())
            return ms, (peak_extra_bytes(lambda: impl.fn(*inputs), device) if peak else None)
    inputs = case.make_inputs(device, True)
    grads = [torch.randn_like(o) for o in case.backward_outputs(impl.fn(*inputs))]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if impl.params is not None:  # after the first call, which may have built the module
        leaves += list(impl.params())

    def step():
        torch.autograd.backward(case.backward_outputs(impl.fn(*inputs)), grads)

    ms = time_ms(step, grad_to_none=leaves, cuda_graph=cuda_graph, generators=generators())
    for t in leaves:  # no gradients kept past the timing, while the other implementations run
        t.grad = None
    if not peak:
        return ms, None
    return ms, peak_extra_bytes(step, device)


def write_records(records: list[dict], path: str | os.PathLike) -> Path:
    """Write records as a JSON list (one file per op), creating folders as needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def load_records(path: str | os.PathLike) -> list[dict]:
    """Read a JSON list of records written by :func:`write_records`."""
    return json.loads(Path(path).read_text())


def require_fields(func: str, records: object, fields: Sequence[str] = (), where: str = "records",
                   when: Callable[[dict], bool] | None = None) -> None:
    """Check that ``records`` is a list of dicts (bench records), each with every key in ``fields``.

    The tables and plots of :mod:`fusedlib.book` call it before reading a record, so a malformed
    record raises one clear error instead of a ``KeyError`` from deep inside a table.

    Args:
        func: the calling function's name, put first in the message.
        records: what the caller was given (a list or tuple of dicts).
        fields: the keys every record must have.
        where: what ``records`` is, for the message (e.g. the JSON file it came from).
        when: only the records for which it is true need ``fields`` (default: all); it may
            read the keys an earlier call required.

    Raises:
        ValueError: ``"<func>: <where>[i] (<its op, impl, pass, shape>) has no 'key'"``, or
            ``"<func>: <where> ..., expected ..."`` for something that is not a list of dicts.

    Source: fusedlib (the benchmark's record schema, :func:`_record`).
    """
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Sequence):
        raise ValueError(f"{func}: {where} is a {type(records).__name__}, expected a list of bench records (dicts)")
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"{func}: {where}[{i}] is a {type(r).__name__}, expected a bench record (a dict)")
        if when is not None and not when(r):
            continue
        missing = [k for k in fields if k not in r]
        if missing:
            label = ", ".join(f"{k} {r[k]!r}" for k in ("op", "measured_op", "impl", "pass", "shape") if k in r)
            raise ValueError(f"{func}: {where}[{i}] ({label or 'no op, impl, pass or shape'}) has no "
                             + ", ".join(repr(k) for k in missing))
