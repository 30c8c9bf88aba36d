"""Helpers for the chapters: show a kernel's source, a device banner, benchmark plots.

Everything the notebooks need beyond fusedlib's ops lives here, so a chapter shows
fusedlib's real code (``show_source``) and plots the benchmark's real records
(``load_bench``, ``plot_bandwidth``), and prints speed claims from those records
(``speedup_table``; ``host_table`` for the host cost per call, ``floor_table`` for its floor;
``throughput_table`` and ``plot_throughput`` for a whole block's training step) instead of
typing numbers by hand.

Records of a model-level op (``transformer_layer``) have no byte count (``"GBps": None``): the
bandwidth tables show ``-`` for them and :func:`plot_bandwidth` refuses them, saying to plot
tokens/s with :func:`plot_throughput`.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..bench.core import require_fields
from ..bench.host import floor_table, host_table  # noqa: F401  (re-exported for chapters: host.json's tables)
from ..bench.ops.transformer_layer import profile_table  # noqa: F401  (re-exported: the block's kernel profile)
from ..bench.ops.transformer_layer import table as throughput_table  # noqa: F401  (the block's tokens/s)
from ..kernels.launch import env_flag
from ..runtime import CUDA_AVAILABLE, device_banner  # noqa: F401  (re-exported for chapters)

__all__ = [
    "show_source",
    "device_banner",
    "bench_dir",
    "load_bench",
    "bench_or_stored",
    "measure_live",
    "live_note",
    "stored_note",
    "plot_bandwidth",
    "plot_sweep",
    "speedup_table",
    "host_table",
    "floor_table",
    "plot_host",
    "backward_table",
    "sweep_table",
    "check",
    "eager_traffic",
    "throughput_table",
    "plot_throughput",
    "profile_table",
    "count_calls",
]

IMPL_ORDER = ("eager", "torch.compile", "megatron-core-unfused", "megatron-core", "liger", "apex",
              "fusedlib-unfused", "fusedlib-sdpa", "fusedlib-sdpa-flash", "fusedlib-sdpa-cudnn",
              "fusedlib-sdpa-efficient", "fusedlib-flash", "fusedlib-fused-layer", "fusedlib",
              "fusedlib-fused-layer-local", "fusedlib-fused-layer-sdpa")
IMPL_COLORS = {"eager": "#9e9e9e", "torch.compile": "#5c6bc0", "megatron-core-unfused": "#c5e1a5",
               "megatron-core": "#76b900", "liger": "#ff9800", "apex": "#8d6e63", "fusedlib-unfused": "#f4a6a6",
               "fusedlib-sdpa": "#8c1c1c", "fusedlib-flash": "#ff7f0e",
               # chapter 8's SDPA blocks held to one backend (tools/attention_block.py)
               "fusedlib-sdpa-flash": "#1f77b4", "fusedlib-sdpa-cudnn": "#17becf", "fusedlib-sdpa-efficient": "#bcbd22",
               "fusedlib-fused-layer": "#ffbb78", "fusedlib": "#d62728",
               "fusedlib-fused-layer-local": "#e377c2", "fusedlib-fused-layer-sdpa": "#c49c94"}


def show_source(obj: Any):
    """Display the source of a fusedlib function or kernel, syntax-highlighted.

    Args:
        obj: a function, class, or ``@triton.jit`` kernel (its ``.fn`` is shown).

    Returns:
        An ``IPython.display.Markdown`` object holding the source in a ``python`` code
        fence: Jupyter and Jupyter Book highlight it, and its outputs (text/markdown, and
        text/plain) are the same on every machine, so nbval compares the code the reader
        sees. (``IPython.display.Code`` would add Pygments' HTML, which changes between
        Pygments versions.)

    Raises:
        TypeError, OSError: from ``inspect.getsource``, for an object without Python source
            (a builtin, a C extension).

    Source: fusedlib's own, on ``inspect.getsource`` and IPython's ``Markdown`` display.
    """
    from IPython.display import Markdown

    fn = getattr(obj, "fn", obj)  # a triton JITFunction wraps the Python function
    return Markdown(f"```python\n{inspect.getsource(fn).rstrip()}\n```")


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> bool:
    """Print one device-independent line: ``name: max |fused - reference| <= tol: True``.

    The error itself is not printed (it differs between GPU and CPU); whether every element
    is within ``atol + rtol·|expected|`` is. An infinity passes only against the same
    infinity (``inf`` vs ``inf``; ``inf`` vs a finite number fails whatever the tolerance); a
    NaN in either tensor fails, also NaN against NaN. Tensors of different shapes fail, and
    the line says so: ``name: shape [2, 3] vs reference [3, 2]: False`` (no broadcasting).

    Args:
        name: what is checked, printed first.
        actual: the fused result (any device and float or int dtype; compared in float64).
        expected: the reference, of the same shape.
        atol: the absolute tolerance.
        rtol: the relative tolerance, times ``|expected|`` (default 0).

    Returns:
        The verdict.

    Raises:
        TypeError: ``actual`` or ``expected`` is not a ``torch.Tensor`` (named in the message).

    Source: fusedlib's own.
    """
    for arg, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"check: {arg} must be a torch.Tensor, got {type(value).__name__}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        print(f"{name}: shape {list(a.shape)} vs reference {list(e.shape)}: False")
        return False
    finite = torch.isfinite(a) & torch.isfinite(e)
    close = torch.where(finite, (a - e).abs() <= atol + rtol * e.abs(), a == e)  # NaN == NaN is False
    ok = bool(close.all())
    tol = f"{atol:g}" + (f" + {rtol:g}·|ref|" if rtol else "")
    print(f"{name}: max |fused - reference| <= {tol}: {ok}")
    return ok


def bench_dir() -> Path:
    """The folder of the stored records.

    Returns:
        ``data/bench`` under the working directory when it exists (a notebook running in
        ``chapters/``), else ``chapters/data/bench`` of the source checkout.

    Source: fusedlib's own.
    """
    here = Path.cwd() / "data" / "bench"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "chapters" / "data" / "bench"


#: The stored records this process has read from :func:`bench_dir`: name (the file's stem) ->
#: the SHA-256 of the bytes read. ``tools/execute_notebooks.py`` keeps them in each executed
#: chapter's metadata (``fusedlib.records_read``), so that a test can tell that a chapter's
#: outputs come from the records as they are now, those read through a helper or a loop
#: included. The chapters read records only through the loaders, which read them with
#: :func:`read_record` (:func:`load_bench`, ``fusedlib.train.bench.load_train_bench``, the
#: block benchmark's ``load_profile`` / ``load_power_state``).
RECORDS_READ: dict[str, str] = {}


def read_record(path: str | Path) -> Any:
    """The JSON of the file ``path``, read once; a file of :func:`bench_dir` is noted in
    :data:`RECORDS_READ` with the SHA-256 of those bytes (a record read from another folder is
    not the book's).

    Raises:
        FileNotFoundError: no such file.
        json.JSONDecodeError: not JSON.
    """
    path = Path(path)
    data = path.read_bytes()
    if path.parent.resolve() == bench_dir().resolve():
        RECORDS_READ[path.stem] = hashlib.sha256(data).hexdigest()
    return json.loads(data)


def load_bench(op: str) -> list[dict]:
    """The stored H200 records of ``op`` (``chapters/data/bench/<op>.json``).

    Args:
        op: the file's name without ``.json`` (an op of ``python -m fusedlib.bench``, or a
            stored file such as ``ceilings`` or ``transformer_layer_profile``).

    Returns:
        The records: a list of dicts, as ``python -m fusedlib.bench`` writes them. A profile
        or power file (``*_profile.json``, ``*_power.json``) holds one dict, returned as it is.

    Raises:
        FileNotFoundError: naming the file and the command that makes it.
        ValueError: naming the file, when it is not JSON, or its JSON is neither a list of
            dicts nor one dict.

    Source: the JSON files of ``python -m fusedlib.bench`` (:func:`fusedlib.bench.write_records`).
    """
    path = bench_dir() / f"{op}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `python -m fusedlib.bench --op {op}` on a GPU")
    try:
        data = read_record(path)
    except json.JSONDecodeError as err:
        raise ValueError(f"load_bench: {path} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        require_fields("load_bench", data, where=str(path))
    return data


def measure_live() -> bool:
    """Whether a chapter's benchmark cells measure now: on a CUDA GPU, unless the environment
    variable ``FUSEDLIB_BENCH_STORED`` is on (``1``, ``true``, ...), which loads the stored
    records instead (how the committed outputs are made on the H200).

    Returns:
        True to measure, False to load the stored records.

    Raises:
        ValueError: ``FUSEDLIB_BENCH_STORED`` set to a value that is neither on nor off
            (:func:`fusedlib.kernels.launch.env_flag`).

    Source: fusedlib's own (the benchmark protocol of :mod:`fusedlib.bench`).
    """
    stored = env_flag("FUSEDLIB_BENCH_STORED", False)  # (read on any machine: a bad value is refused anywhere)
    return CUDA_AVAILABLE and not stored


def live_note(device: str, what: str, stored: str) -> str:
    """The line a chapter's benchmark cell prints when it measured live: what it measured, on
    which device, and that the chapter's prose quotes the stored records instead (their numbers,
    and the verdicts drawn from them, need not hold for the live run).

    Args:
        device: the device the live numbers come from (a record's ``device``).
        what: what was measured ("measured", "profiled", ...).
        stored: the stored file(s) the prose quotes, relative to :func:`bench_dir`.

    Returns:
        One line of text.

    Raises:
        Nothing: it formats its arguments as they are.

    Source: fusedlib's own (the benchmark protocol of :mod:`fusedlib.bench`).
    """
    return (f"{what} now on {device}; the text around this cell quotes the stored run "
            f"(chapters/data/bench/{stored}, shown with FUSEDLIB_BENCH_STORED=1), whose numbers and "
            f"verdicts need not hold here")


def stored_note(record: dict) -> str:
    """The line a chapter's benchmark cell prints when it loaded stored records: why (no GPU here,
    or ``FUSEDLIB_BENCH_STORED=1``) and where they were measured; the counterpart of
    :func:`live_note`.

    Args:
        record: one of the loaded records (its ``device``, ``torch`` and ``triton``).

    Returns:
        One line of text.

    Raises:
        KeyError: a record without ``device``, ``torch`` or ``triton``.

    Source: fusedlib's own (the benchmark protocol of :mod:`fusedlib.bench`).
    """
    where = "no GPU here" if not CUDA_AVAILABLE else "FUSEDLIB_BENCH_STORED=1"
    return (f"{where}: loaded the stored results measured on {record['device']} "
            f"(torch {record['torch']}, triton {record['triton']})")


def bench_or_stored(op: str, sweep: bool = False) -> list[dict]:
    """Measure ``op`` live on this machine's GPU, or load the stored H200 records on a CPU.

    On a GPU, setting ``FUSEDLIB_BENCH_STORED=1`` loads the stored records instead: that is
    how the committed outputs are made, right after ``python -m fusedlib.bench`` wrote them
    in the same session on the H200, so the book shows the numbers of the JSON files and
    the device time is not spent twice. Prints which it did, and the device the numbers
    come from.

    Args:
        op: an op of ``python -m fusedlib.bench`` (``bias_gelu``, ``layer_norm``, ...).
        sweep: measure the op's sweep of shapes too (live measurements only; the stored
            file holds whatever was measured).

    Returns:
        The records (a list of dicts).

    Raises:
        FileNotFoundError: when the records are to be loaded and do not exist.
        ValueError: naming the file (or the live run), when there are no records, the file
            holds no list of records, or its first record lacks ``device``, ``torch`` or
            ``triton``.

    Source: the benchmark protocol of :mod:`fusedlib.bench` (``python -m fusedlib.bench``).
    """
    if measure_live():
        from ..bench import run_op

        records, skipped = run_op(op, sweep=sweep)
        if not records:
            raise ValueError(f"bench_or_stored: measuring {op!r} gave no records (skipped: {skipped})")
        require_fields("bench_or_stored", records[:1], ("device",), where=f"the measured {op!r} records")
        print(live_note(records[0]["device"], "measured", f"{op}.json"))
        for name, why in skipped.items():
            print(f"  {name} not measured: {why}")
        return records
    records = load_bench(op)
    path = bench_dir() / f"{op}.json"
    if isinstance(records, dict) or not records:
        raise ValueError(f"bench_or_stored: {path} holds "
                         f"{'one dict' if isinstance(records, dict) else 'an empty list'}, expected a list of bench records")
    require_fields("bench_or_stored", records[:1], ("device", "torch", "triton"), where=str(path))
    print(stored_note(records[0]))
    return records


def _headline(records: Sequence[dict]) -> tuple[int, ...] | None:
    rows = [r for r in records if r.get("impl") == "fusedlib"]
    return tuple(rows[0]["shape"]) if rows else None


def _ceiling_and_shape(func: str, records: Sequence[dict], shape: Sequence[int] | None,
                       fields: Sequence[str]) -> tuple[dict, tuple[int, ...]]:
    """The copy record and the table's shape (``shape``, else the headline shape) of a bandwidth
    table or plot, after checking the records: each has an ``impl``, the copy record a ``GBps``,
    every other a ``shape``, and those at the shape ``fields``. Raises ValueError naming ``func``."""
    require_fields(func, records, ("impl",))
    if not records:
        raise ValueError(f"{func}: no records (expected bench records with a copy record, the ceiling)")
    copy = next((r for r in records if r["impl"] == "copy"), None)
    if copy is None:
        raise ValueError(f"{func}: records: no copy record (the ceiling)")
    if not isinstance(copy.get("GBps"), (int, float)):
        raise ValueError(f"{func}: the copy record has no GBps (the ceiling), got {copy.get('GBps')!r}")
    require_fields(func, records, ("shape",), when=lambda r: r["impl"] != "copy")
    if shape is None:
        shape = _headline(records)
        if shape is None:
            raise ValueError(f"{func}: no fusedlib record to take the headline shape from; pass shape=")
    shape = tuple(shape)
    require_fields(func, records, fields, when=lambda r: r["impl"] != "copy" and tuple(r["shape"]) == shape)
    return copy, shape


def speedup_table(records: Sequence[dict], shape: Sequence[int] | None = None) -> str:
    """Text table of every implementation at ``shape`` (default: the headline shape):
    ms, GB/s, % of the copy ceiling, and how many times faster fusedlib is.

    Records timed as CUDA-graph replays (``"timer": "cuda_graph"``) also carry the time with
    plain launches (``"ms_eager"``); the table then shows both: ``ms`` (graph replays: the
    kernels) and ``plain-launch ms`` (what an eager training step pays, host included), each
    with fusedlib's ratio. A record of such a case that could not be captured (``"timer":
    "do_bench"``) is marked ``*``: its ms is plain launches, so it gets no ratio against graph
    times. Records without ``ms_eager`` (plain launches only) show one column, so labelled.
    A torch.compile compiled once for several shapes (``"compile": "dynamic"``) is marked
    ``(dynamic)``. Records without a byte count (``"GBps": None``) show ``-`` for GB/s and
    % copy.

    Args:
        records: bench records of one op, with its copy record (the ceiling).
        shape: the shape to show (default: the first fusedlib record's).

    Returns:
        The table, one line per pass and implementation.

    Raises:
        ValueError: naming the record, when there are no records, no copy record, no
            fusedlib record to take the default shape from, or a record lacks a key the table
            reads (``impl``; ``shape``; at the shape ``pass``, ``ms``, ``dtype``).

    Source: the benchmark protocol of :mod:`fusedlib.bench` (its records and copy ceiling).
    """
    copy, shape = _ceiling_and_shape("speedup_table", records, shape, ("pass", "ms", "dtype"))
    rows = [r for r in records if r["impl"] != "copy" and tuple(r["shape"]) == shape]
    fused = {r["pass"]: r for r in rows if r["impl"] == "fusedlib"}
    plain = any("ms_eager" in r for r in rows)
    head = f"{'pass':<9}{'impl':<24}{'ms':>9}{'GB/s':>8}{'% copy':>8}{'fusedlib is':>13}"
    if plain:
        head += f"{'plain-launch ms':>17}{'fusedlib is':>13}"
    timer = " (ms: CUDA-graph replays)" if plain else " (ms: plain launches)"
    out = [f"shape {list(shape)} {rows[0]['dtype'] if rows else ''}, copy ceiling {copy['GBps']:.0f} GB/s{timer}", head]
    order = {n: i for i, n in enumerate(IMPL_ORDER)}
    fallback = False
    for r in sorted(rows, key=lambda r: (r["pass"], order.get(r["impl"], 99))):
        f = fused.get(r["pass"])
        mixed = plain and (r.get("timer") == "do_bench") != (f is not None and f.get("timer") == "do_bench")
        fallback |= plain and r.get("timer") == "do_bench"
        sp = f"{r['ms'] / f['ms']:.2f}x" if f and r["impl"] != "fusedlib" and not mixed else ""
        ms = f"{r['ms']:.4f}" + ("*" if plain and r.get("timer") == "do_bench" else "")
        impl = r["impl"] + (" (dynamic)" if r.get("compile") == "dynamic" else "")
        gbps, pct = _bandwidth_cells(r, copy)
        line = f"{r['pass']:<9}{impl:<24}{ms:>9}{gbps:>8}{pct:>8}{sp:>13}"
        if plain:
            pe = r.get("ms_eager")
            sp_e = f"{pe / f['ms_eager']:.2f}x" if pe and f and f.get("ms_eager") and r["impl"] != "fusedlib" else ""
            line += (f"{pe:>17.4f}" if pe else f"{'':>17}") + f"{sp_e:>13}"
        out.append(line)
    if fallback:
        out.append("* no CUDA graph could be captured: ms is plain launches")
    return "\n".join(out)


def _bandwidth_cells(r: dict, copy: dict) -> tuple[str, str]:
    """GB/s and % of the copy ceiling of a record, as table cells ("-" without a byte count)."""
    if r.get("GBps") is None:
        return "-", "-"
    return f"{r['GBps']:.0f}", f"{100 * r['GBps'] / copy['GBps']:.1f}"


def _legend_below(ax, handles=None, labels=None):
    """A legend under the axes (below the tick labels), where it cannot cover a bar or a line."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    return ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
                     ncol=min(3, len(labels)), frameon=False)


def backward_table(records: Sequence[dict], shape: Sequence[int] | None = None) -> str:
    """Text table that splits each implementation's fwd+bwd time at ``shape`` (default: the
    headline shape) into its forward and the rest, the backward as the step times it:
    ``bwd ms = fwd+bwd ms - fwd ms``, charged the backward's fewest bytes
    (``bytes[fwd+bwd] - bytes[fwd]``), with its GB/s and % of the copy ceiling.

    Where fwd+bwd is far below the ceiling while fwd is near it, this says which half loses.
    The fwd+bwd time is one training step as the benchmark times it (autograd included), so
    the backward's share holds whatever that step adds beyond its kernels.

    Args:
        records: bench records of one op, with its copy record (the ceiling).
        shape: the shape to show (default: the first fusedlib record's).

    Returns:
        The table, one line per implementation with both passes and byte counts.

    Raises:
        ValueError: naming the record, when there are no records, no copy record, no
            fusedlib record to take the default shape from, or a record lacks a key the table
            reads (``impl``; ``shape``; at the shape ``pass``, ``ms``).

    Source: the benchmark protocol of :mod:`fusedlib.bench` (its records and copy ceiling).
    """
    copy, shape = _ceiling_and_shape("backward_table", records, shape, ("pass", "ms"))
    rows = [r for r in records if r["impl"] != "copy" and tuple(r["shape"]) == shape]
    order = {n: i for i, n in enumerate(IMPL_ORDER)}
    out = [f"shape {list(shape)}, copy ceiling {copy['GBps']:.0f} GB/s; bwd = fwd+bwd - fwd",
           f"{'impl':<15}{'fwd ms':>9}{'fwd+bwd ms':>12}{'bwd ms':>9}{'bwd GB/s':>10}{'bwd % copy':>12}"]
    for impl in sorted({r["impl"] for r in rows}, key=lambda i: order.get(i, 99)):
        f = next((r for r in rows if r["impl"] == impl and r["pass"] == "fwd"), None)
        fb = next((r for r in rows if r["impl"] == impl and r["pass"] == "fwd+bwd"), None)
        if f is None or fb is None or f.get("bytes") is None or fb.get("bytes") is None:
            continue  # (a model-level op has no fwd pass and no byte count)
        bwd_ms, bwd_bytes = fb["ms"] - f["ms"], fb["bytes"] - f["bytes"]
        gbps = bwd_bytes / (bwd_ms * 1e-3) / 1e9 if bwd_ms > 0 else float("inf")
        out.append(f"{impl:<15}{f['ms']:>9.4f}{fb['ms']:>12.4f}{bwd_ms:>9.4f}{gbps:>10.0f}"
                   f"{100 * gbps / copy['GBps']:>12.1f}")
    return "\n".join(out)


SHORT_NAMES = {"torch.compile": "compile", "megatron-core": "mcore"}


def sweep_table(records: Sequence[dict], impls: Sequence[str] | None = None) -> str:
    """Text table of a sweep: one line per shape, the % of the copy ceiling of each
    implementation (default: those measured at more than one shape) in each pass, ``-``
    where it was not measured at that shape. torch.compile is abbreviated "compile",
    megatron-core "mcore".

    Args:
        records: bench records of one op's sweep, with its copy record (the ceiling).
        impls: the implementations to show, in this order.

    Returns:
        The table: a title, two header lines, then one line per shape.

    Raises:
        ValueError: naming the record, when there are no records, no copy record, no
            implementation to show (none measured at more than one shape, or ``impls``
            empty), or a record lacks a key the table reads (``impl``; ``shape``, ``pass``).

    Source: the sweep of ``python -m fusedlib.bench --sweep`` (its records and copy ceiling).
    """
    copy, _ = _ceiling_and_shape("sweep_table", records, (), ())
    require_fields("sweep_table", records, ("pass",), when=lambda r: r["impl"] != "copy")
    rows = [r for r in records if r["impl"] != "copy"]
    if impls is None:
        n_shapes = {}
        for r in rows:
            n_shapes.setdefault(r["impl"], set()).add(tuple(r["shape"]))
        impls = [i for i in IMPL_ORDER if len(n_shapes.get(i, ())) > 1]
        impls += sorted(i for i in n_shapes if i not in IMPL_ORDER and len(n_shapes[i]) > 1)
    if not impls:
        raise ValueError("sweep_table: no implementation to show (impls is empty, or none was measured "
                         "at more than one shape)")
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: s[-1])
    cols = [(p, i) for p in ("fwd", "fwd+bwd") for i in impls]
    width = max([10] + [len(SHORT_NAMES.get(i, i)) + 2 for i in impls])
    out = [f"% of the copy ceiling ({copy['GBps']:.0f} GB/s)",
           f"{'':<20}" + "".join(f"{p:>{width}}" for p, _ in cols),
           f"{'shape':<20}" + "".join(f"{SHORT_NAMES.get(i, i):>{width}}" for _, i in cols)]
    for shape in shapes:
        line = f"{str(list(shape)):<20}"
        for p, i in cols:
            r = next((r for r in rows if r["impl"] == i and r["pass"] == p and tuple(r["shape"]) == shape), None)
            line += f"{_bandwidth_cells(r, copy)[1]:>{width}}" if r else f"{'-':>{width}}"
        out.append(line)
    return "\n".join(out)


def plot_bandwidth(records: Sequence[dict], title: str, shape: Sequence[int] | None = None, ax=None):
    """Bar chart of effective bandwidth (GB/s) per implementation and pass, against the
    measured copy ceiling: the book's roofline view of a memory-bound op.

    The y axis starts at 0 and ends above the copy ceiling; the legend sits under the axes,
    clear of the bars.

    Args:
        records: bench records of one op, with its copy record (the ceiling).
        title: the axes' title, followed by the shape, dtype and device.
        shape: the shape to draw (default: the first fusedlib record's).
        ax: an Axes to draw into (default: a new figure).

    Returns:
        The matplotlib Axes.

    Raises:
        ValueError: when no record at ``shape`` has a byte count (a model-level op such as
            ``transformer_layer``: plot its tokens/s with :func:`plot_throughput`); naming the
            record, when there are no records, no copy record, no fusedlib record to take the
            default shape from, or a record lacks a key the plot reads (``impl``; ``shape``; at
            the shape ``pass``, ``dtype``; the copy record's ``device``).

    Source: the roofline view (Williams, Waterman & Patterson, "Roofline", CACM 2009) of the
    benchmark's records; drawn with matplotlib.
    """
    import matplotlib.pyplot as plt

    copy, shape = _ceiling_and_shape("plot_bandwidth", records, shape, ("pass", "dtype"))
    if "device" not in copy:
        raise ValueError("plot_bandwidth: the copy record has no 'device' (the title names it)")
    rows = [r for r in records if r["impl"] != "copy" and tuple(r["shape"]) == shape and r.get("GBps") is not None]
    if not rows:
        raise ValueError(f"records: none at shape {list(shape) if shape else shape} has a byte count (GBps); "
                         "a model-level op's records plot as tokens/s with plot_throughput")
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in rows)]
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs, ys = [], []
        for j, p in enumerate(passes):
            r = next((r for r in rows if r["impl"] == impl and r["pass"] == p), None)
            if r:
                xs.append(j + (k - (len(impls) - 1) / 2) * width)
                ys.append(r["GBps"])
        ax.bar(xs, ys, width, label=impl, color=IMPL_COLORS.get(impl))
    ax.axhline(copy["GBps"], color="k", ls="--", lw=1, label=f"copy ceiling {copy['GBps']:.0f} GB/s")
    ax.set_xticks(range(len(passes)), passes)
    ax.set_ylim(0, 1.08 * max([copy["GBps"]] + [r["GBps"] for r in rows]))
    ax.set_ylabel("effective bandwidth (GB/s)")
    ax.set_title(f"{title}, {list(shape)} {rows[0]['dtype'] if rows else ''}, {copy['device']}")
    _legend_below(ax)
    if own:
        ax.figure.tight_layout()
    return ax


def plot_sweep(records: Sequence[dict], title: str, impls: Sequence[str] | None = None,
               width: Callable[[Sequence[int]], int] = lambda shape: shape[-1],
               xlabel: str = "hidden size h (columns)", marks: Sequence[float] = ()):
    """Effective bandwidth (GB/s) against the row width, one panel per pass (fwd, fwd+bwd):
    the sweep of ``python -m fusedlib.bench --sweep``, whose shapes keep the element count.

    Args:
        records: bench records of one op (with its ``copy`` record, drawn as the ceiling).
        title: the panels' title, followed by the pass.
        impls: the implementations to draw, in this order (default: every one in the records
            that has more than one shape, in the book's order).
        width: the x value of a record's shape (default: its last dim).
        xlabel: the x axis's label.
        marks: x values to mark with a dotted vertical line (e.g. a kernel's limit).

    Both panels share a y axis from 0 to above the copy ceiling; the legend sits under the
    panels.

    Returns:
        The matplotlib Figure.

    Raises:
        ValueError: when ``records`` has no copy record or no sweep (one shape per impl), or
            a record lacks a key the plot reads (``impl``; ``shape``, ``pass``, ``GBps``).

    Source: the sweep of ``python -m fusedlib.bench --sweep``; drawn with matplotlib.
    """
    import matplotlib.pyplot as plt

    copy, _ = _ceiling_and_shape("plot_sweep", records, (), ())
    require_fields("plot_sweep", records, ("pass", "GBps"), when=lambda r: r["impl"] != "copy")
    rows = [r for r in records if r["impl"] != "copy"]
    shapes = {}
    for r in rows:
        shapes.setdefault(r["impl"], set()).add(tuple(r["shape"]))
    if impls is None:
        impls = [i for i in IMPL_ORDER if len(shapes.get(i, ())) > 1]
        impls += sorted(i for i in shapes if i not in IMPL_ORDER and len(shapes[i]) > 1)
    if not any(len(shapes.get(i, ())) > 1 for i in impls):
        raise ValueError(f"records: no sweep (one shape per implementation) for {list(impls)}")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    top = copy["GBps"]
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        for impl in impls:
            pts = sorted((width(r["shape"]), r["GBps"]) for r in rows if r["impl"] == impl and r["pass"] == pas)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl, color=IMPL_COLORS.get(impl))
                top = max(top, *(p[1] for p in pts))
        ax.axhline(copy["GBps"], color="k", ls="--", lw=1, label=f"copy ceiling {copy['GBps']:.0f} GB/s")
        for x in marks:
            ax.axvline(x, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_title(f"{title}, {pas}", fontsize=10)
    axes[0].set_ylim(0, 1.08 * top)
    axes[0].set_ylabel("effective bandwidth (GB/s)")
    handles, labels = axes[0].get_legend_handles_labels()
    for h, l in zip(*axes[1].get_legend_handles_labels()):
        if l not in labels:
            handles.append(h)
            labels.append(l)
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # the bottom strip holds the legend
    return fig


#: Names of calls that return an alias of an operand without launching a kernel, which
#: ``Tensor._is_view`` does not flag, or that allocate without writing.
_NO_KERNEL = frozenset({"detach", "empty", "empty_like", "empty_strided", "new_empty", "requires_grad_",
                        "retain_grad", "register_hook"})
#: Python's in-place operators on tensors (``x += y``): kernels that return their operand.
_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                        "matmul", "and", "or", "xor", "lshift", "rshift"))
#: Reflected operators (``0.5 * x`` calls ``x.__rmul__``), listed under the operator's name.
_REFLECTED = frozenset({"radd", "rsub", "rmul", "rtruediv", "rdiv", "rfloordiv", "rmod", "rpow", "rmatmul",
                        "rand", "ror", "rxor", "rlshift", "rrshift"})


def eager_traffic(fn: Any, *example_inputs: torch.Tensor) -> list[dict]:
    """Kernels and bytes of ``fn`` run eagerly: one row per PyTorch call that launches a kernel.

    Runs ``fn`` on the example inputs (``meta`` tensors: no memory is touched, nothing is
    computed) under a ``TorchFunctionMode`` that sees each PyTorch call ``fn`` makes, and
    charges each call that launches a kernel the bytes of its tensor operands (each read
    once) and of its results (each written once), the way eager PyTorch moves them. A
    ``torch.nn.functional`` call is one row, whatever it runs inside (one kernel for the
    elementwise, norm and dropout functions). What is counted:

    * operands: every tensor among the call's arguments, also inside lists and tuples
      (``torch.cat([a, b])`` reads ``a`` and ``b``) and keyword arguments; a tensor passed
      twice (``x * x``) is charged twice, once per operand;
    * results: every tensor the call returns, also of a call with several results;
    * a tensor's bytes are its distinct elements' (a broadcast, stride-0 dim of an
      ``expand`` counts once) times its element size.

    Not charged, and not listed (they launch no kernel): views of an operand (``view``,
    ``reshape``/``flatten``/``contiguous`` where they return a view or the operand itself,
    ``unsqueeze``, ``squeeze``, ``transpose``, ``permute``, ``t``, ``expand``, ``narrow``,
    ``select`` and basic indexing, ``chunk``, ``split``, ``unbind``, ``detach``, and indexing
    their tuple of results), ``.to``/``.float()`` to the tensor's own dtype, and calls that
    return no tensor (``x.shape``, ``size``, ``dim``). Whether a call returns a view is seen on
    the example inputs, so a ``reshape`` that must copy (of a transposed tensor) is a kernel,
    charged its read and its write. In-place ops (``add_``, ``x += y``) are kernels, charged
    their operands and their result; ``x[i] = v`` reads ``v`` and writes ``x[i]``.

    Limits: it is a model of eager PyTorch, not a profile. Every operand is charged whole
    (``gather`` reads only what it indexes), an op's side outputs (dropout's mask) and a
    reduction's partials are not counted, caches are ignored, and a composite
    ``torch.nn.functional`` call (``multi_head_attention_forward``) counts as one row. Python
    control flow on shapes is fine; on values it cannot run on ``meta`` tensors (pass real
    ones).

    Args:
        fn: a function (or module) of tensors made of PyTorch calls.
        *example_inputs: tensors of the shapes and dtypes to count for.

    Returns:
        One dict per kernel, in call order: ``{"op", "read_bytes", "write_bytes"}`` (``op``:
        the call's name, ``"add"`` for ``a + b`` and ``0.5 + a`` alike, ``"getitem"`` for an
        indexing copy, ``"gelu"``, ``"float"``).

    Raises:
        Whatever ``fn`` raises on the example inputs.

    Source: the operator-by-operator traffic count of eager PyTorch (one kernel per operator);
    ``torch.overrides.TorchFunctionMode`` (the ``__torch_function__`` protocol).
    """
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    def tensors(value: Any) -> list[torch.Tensor]:
        return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]

    def nbytes(t: torch.Tensor) -> int:
        if t.numel() == 0:
            return 0
        distinct = 1
        for size, stride in zip(t.shape, t.stride()):
            distinct *= 1 if stride == 0 else size
        return distinct * t.element_size()

    def base(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    def op_name(raw: str) -> str:
        name = raw[2:-2] if raw.startswith("__") and raw.endswith("__") and len(raw) > 4 else raw
        if raw in _IN_PLACE_DUNDERS:
            return name[1:] + "_"  # __iadd__ -> add_
        return name[1:] if name in _REFLECTED else name

    rows = []

    class Counter(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)  # the mode is off inside: calls made by func are not seen
            raw = getattr(func, "__name__", str(func))
            name = op_name(raw)
            if raw == "__setitem__":
                value = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
                rows.append({"op": "setitem", "read_bytes": nbytes(value) if value is not None else 0,
                             "write_bytes": nbytes(args[0][args[1]])})
                return result
            ins, outs = tensors((args, kwargs)), tensors(result)
            in_place = name.endswith("_") and not name.startswith("_")
            if name in _NO_KERNEL or not outs:
                return result
            if not in_place:
                bases = {id(base(t)) for t in ins} | {id(t) for t in ins}
                if all(id(t) in bases or (t._is_view() and id(base(t)) in bases) for t in outs):
                    return result  # a view of an operand, or the operand itself: no kernel
            rows.append({"op": name, "read_bytes": sum(nbytes(t) for t in ins),
                         "write_bytes": sum(nbytes(t) for t in outs)})
            return result

    with Counter():
        fn(*example_inputs)
    return rows


def plot_host(records: Sequence[dict], pass_: str = "fwd+bwd", field: str = "us", ax=None,
              exclude: Sequence[str] = ("transformer_layer",)):
    """Bar chart of ``host.json``: host microseconds per call of each op for fusedlib, eager
    PyTorch and ``torch.compile``, in one pass (horizontal bars, one group per op).

    Args:
        records: host records (``"op": "host"``; other records are ignored).
        pass_: ``"fwd"`` or ``"fwd+bwd"``.
        field: ``"us"`` (wall time per call with one sync at the end), ``"enqueue_us"`` or
            ``"cpu_us"``.
        ax: an Axes to draw into (default: a new figure).
        exclude: measured ops left out of the chart (default: the whole transformer block,
            whose step costs tens of single ops and would flatten their bars; the table
            lists it).

    Returns:
        The matplotlib Axes. The x axis starts at 0; the legend sits under the axes.

    Raises:
        ValueError: for another pass or field, when no record has that pass, or naming the
            record, when a host record lacks ``pass``, ``measured_op`` or ``impl``, or one of
            the pass lacks ``field`` or ``device``.

    Source: the host protocol of :mod:`fusedlib.bench.host` (``python -m fusedlib.bench
    --host``); drawn with matplotlib.
    """
    import matplotlib.pyplot as plt

    if pass_ not in ("fwd", "fwd+bwd"):
        raise ValueError(f"pass_ must be 'fwd' or 'fwd+bwd', got {pass_!r}")
    if field not in ("us", "enqueue_us", "cpu_us"):
        raise ValueError(f"field must be 'us', 'enqueue_us' or 'cpu_us', got {field!r}")
    require_fields("plot_host", records, ("pass", "measured_op", "impl"), when=lambda r: r.get("op") == "host")
    require_fields("plot_host", records, (field, "device"),
                   when=lambda r: r.get("op") == "host" and r["pass"] == pass_ and r["measured_op"] not in exclude)
    rows = [r for r in records if r.get("op") == "host" and r["pass"] == pass_
            and r["measured_op"] not in exclude]
    if not rows:
        raise ValueError(f"records: no host record of pass {pass_!r}")
    ops = list(dict.fromkeys(r["measured_op"] for r in rows))
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(7, 0.3 * len(ops) * len(impls) + 1.5))
    height = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        ys, xs = [], []
        for j, op in enumerate(ops):
            r = next((r for r in rows if r["measured_op"] == op and r["impl"] == impl), None)
            if r:
                ys.append(j + (k - (len(impls) - 1) / 2) * height)
                xs.append(r[field])
        ax.barh(ys, xs, height, label=impl, color=IMPL_COLORS.get(impl))
    ax.set_yticks(range(len(ops)), ops)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.08 * max(r[field] for r in rows))
    ax.set_xlabel(f"host time per call, {pass_} (microseconds)")
    ax.set_title(f"host cost per call at tiny shapes, {rows[0]['device']}", fontsize=10)
    _legend_below(ax)
    if own:
        ax.figure.tight_layout()
    return ax


def plot_throughput(records: Sequence[dict], title: str = "one training step", axes=None):
    """Horizontal bars of tokens per second for each implementation of a model-level op
    (``transformer_layer`` records, which carry ``tokens_per_s``), one panel per shape: a bar
    for plain launches (``tokens_per_s_eager``) and one for the CUDA-graph replay
    (``tokens_per_s`` where ``"timer": "cuda_graph"``; absent where the step could not be
    captured).

    Args:
        records: bench records (those without ``tokens_per_s``, like the copy ceiling, are ignored).
        title: the panels' title, followed by the shape.
        axes: a sequence of Axes, one per shape (default: a new figure).

    Returns:
        The matplotlib Figure. Each x axis starts at 0; the legend sits under the panels.

    Raises:
        ValueError: when no record has ``tokens_per_s``, or naming the record, when one with
            ``tokens_per_s`` lacks ``shape``, ``impl`` or ``device``.

    Source: the benchmark's ``transformer_layer`` records (:mod:`fusedlib.bench.ops.transformer_layer`);
    drawn with matplotlib.
    """
    import matplotlib.pyplot as plt

    require_fields("plot_throughput", records, ("shape", "impl", "device"),
                   when=lambda r: r.get("tokens_per_s") is not None)
    rows = [r for r in records if r.get("tokens_per_s") is not None]
    if not rows:
        raise ValueError("records: none has tokens_per_s (a model-level op's records do)")
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    if axes is None:
        n_impls = max(len({r["impl"] for r in rows if tuple(r["shape"]) == s}) for s in shapes)
        fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 0.55 * n_impls + 1.8), squeeze=False)
        axes = axes[0]
    fig = axes[0].figure
    order = {n: i for i, n in enumerate(IMPL_ORDER)}
    kinds = (("plain launches", "tokens_per_s_eager", 1.0), ("CUDA graph", "tokens_per_s", 0.45))
    for ax, shape in zip(axes, shapes):
        at = sorted((r for r in rows if tuple(r["shape"]) == shape), key=lambda r: order.get(r["impl"], 99))
        height = 0.38
        for k, (label, key, alpha) in enumerate(kinds):
            ys, xs, colors = [], [], []
            for j, r in enumerate(at):
                if key == "tokens_per_s" and r.get("timer") != "cuda_graph":
                    continue  # no graph replay: the record's tokens_per_s is its plain launches
                v = r.get(key) if key == "tokens_per_s" else r.get(key, r.get("tokens_per_s"))
                if v:
                    ys.append(j + (k - 0.5) * height)
                    xs.append(v / 1e3)
                    colors.append(IMPL_COLORS.get(r["impl"], "#607d8b"))
            ax.barh(ys, xs, height, color=colors, alpha=alpha, label=label, edgecolor="k", linewidth=0.4)
        ax.set_yticks(range(len(at)), [r["impl"] for r in at])
        ax.invert_yaxis()
        ax.set_xlim(0, 1.1 * max([1e-9] + [max(r.get("tokens_per_s") or 0, r.get("tokens_per_s_eager") or 0) / 1e3
                                             for r in at]))
        ax.set_xlabel("thousand tokens per second (higher is better)")
        names = at[0].get("shape_names", ["s", "b", "h", "heads", "ffn", "layers"])
        ax.set_title(f"{title}\n{', '.join(f'{n} {v}' for n, v in zip(names, shape))}, {at[0]['device']}",
                     fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9e9e9e", alpha=a, edgecolor="k", linewidth=0.4)
               for _, _, a in kinds]
    fig.legend(handles, [label for label, _, _ in kinds], fontsize=8, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the bottom strip holds the legend
    return fig


@contextlib.contextmanager
def count_calls(targets: dict[str, tuple[Any, str]]) -> Iterator[dict[str, int]]:
    """Count the calls of named functions while the ``with`` block runs: which kernels ran.

    Each ``owner.name`` is replaced by a wrapper that counts, then calls the original (the
    results are unchanged); everything is restored on exit, also after an error. Patch the name
    where the caller looks it up at call time: ``(fusedlib.transformer.mlp, "bias_gelu_impl")``
    counts the MLP's calls, ``(torch.nn.functional, "dropout")`` every dropout, and
    ``(SomeFunction, "apply")`` an autograd Function.

    Args:
        targets: label -> ``(owner, attribute name)``; owner a module or a class.

    Yields:
        label -> number of calls so far (a dict, updated in place).

    Raises:
        AttributeError: an owner without that attribute (nothing is patched then).

    Source: fusedlib's own.
    """
    originals = []
    for label, (owner, name) in targets.items():
        getattr(owner, name)  # raises AttributeError, naming it, before anything is patched
    counts = {label: 0 for label in targets}
    try:
        for label, (owner, name) in targets.items():
            own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            original = getattr(owner, name)

            def counting(*args, __label=label, __original=original, **kwargs):
                counts[__label] += 1
                return __original(*args, **kwargs)

            originals.append((owner, name, own))
            setattr(owner, name, counting)
        yield counts
    finally:
        for owner, name, own in reversed(originals):
            if own is _MISSING:
                delattr(owner, name)  # inherited (e.g. Function.apply): the class's own lookup again
            else:
                setattr(owner, name, own)


_MISSING = object()
