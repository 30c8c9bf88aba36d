"""fusedlib's own Python per call, on the CPU, with every Triton launch stubbed out.

Usage: python tools/host_overhead_cpu.py [--op NAME ...] [--calls N] [--repeats N]
                                         [--profile OP] [--compile] [--json PATH] [--launch-key]

On a machine without a GPU the kernels run in Triton's interpreter, which swamps everything
else; but the host code around them (argument checks, launch-setting lookups, allocations,
``autograd.Function``) is the same Python that runs before every launch on a GPU. This tool
replaces the module-level ``launch`` name of every ``fusedlib.kernels`` module, and
``fusedlib.runtime.launch`` (which the ops' launch plans call), with a no-op (the outputs stay
uninitialised: nothing reads them), then times each op of ``python -m fusedlib.bench --host``
at its host shape (:data:`fusedlib.bench.host.HOST_SHAPES`, bf16), fusedlib beside the eager
unfused op, in both passes of :func:`fusedlib.bench.host.host_step`:

* ``fwd``: the forward under ``torch.no_grad()``;
* ``fwd+bwd``: ``.grad = None``, the forward, ``out.float().sum().backward()``.

It prints microseconds of this thread's CPU time per call: the fastest of ``--repeats``
repeats of ``--calls`` calls (the cores may be shared, and other processes only ever add
time). The eager
column runs the real (tiny) CPU kernels, as a GPU's eager op enqueues real kernels.

``--launch-key``: each stubbed launch does the Python of a direct launch instead of nothing
(:func:`fusedlib.kernels.launch.launch_key` over the launch's arguments, a dict lookup, a call
of a no-op launcher with every argument), so the table includes what fusedlib's launch layer
costs on the GPU minus the C launch itself; a launch plan's launch (every op whose launches
are planned, :class:`fusedlib.runtime.LaunchPlan`) calls the no-op launcher without the key,
as a bound plan does on the GPU.

``--profile OP`` prints cProfile's table (by own time) of fusedlib's fwd and fwd+bwd calls.
``--compile`` checks that each op's fusedlib forward traces in
``torch.compile(fullgraph=True, backend="eager")`` with the launches stubbed (Dynamo must
see the host code through; the kernels themselves are not compiled here).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pkgutil
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: this checkout's fusedlib

import torch  # noqa: E402

import fusedlib  # noqa: E402,F401  (first: settles TRITON_INTERPRET)
import fusedlib.kernels  # noqa: E402
from fusedlib.bench.host import HOST_SHAPES, host_step  # noqa: E402
from fusedlib.bench.ops import get_case  # noqa: E402

DTYPE = torch.bfloat16
IMPLS = ("fusedlib", "eager")
PASSES = ("fwd", "fwd+bwd")


def _no_launch(*args, **kwargs) -> None:
    return None


_KEYED: dict = {}


def _noop(*args) -> None:
    return None


def _key_launch(kernel, grid, device, *args, **kwargs) -> None:
    """The Python of a direct launch (fusedlib/kernels/launch.py) with a no-op launcher."""
    from fusedlib.kernels.launch import launch_key

    key = launch_key(kernel, 0, False, "", args, kwargs)
    entry = _KEYED.get(key)
    if entry is None:
        entry = _KEYED[key] = (_noop, 0, (False, False, None, None, (4, 1, 0), None, None, None), ())
    fn, function, head, tail = entry
    n = len(grid)
    fn(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, 0, function, *head, *args, *tail)


def _plan_launch(kernel, grid, device, *args, **kwargs) -> None:
    """What a bound LaunchPlan's call costs past its checks: a no-op launcher called with the
    grid and every argument (no key, no lookup; fusedlib.runtime.LaunchPlan)."""
    n = len(grid)
    _noop(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, 0, None, False, False, None, None, (4, 1, 0),
          None, None, None, *args, *kwargs.values())


def stub_launches(keyed: bool = False) -> list[str]:
    """Set ``launch`` to a no-op (``keyed``: :func:`_key_launch`) in every ``fusedlib.kernels``
    module that has one, and ``fusedlib.runtime.launch``, which the ops' launch plans call on the
    CPU, to a no-op (``keyed``: :func:`_plan_launch`, a bound plan's launch: no key); returns
    the modules' names."""
    from fusedlib import runtime

    stubbed = []
    for info in pkgutil.iter_modules(fusedlib.kernels.__path__):
        mod = importlib.import_module(f"fusedlib.kernels.{info.name}")
        if callable(getattr(mod, "launch", None)) and not isinstance(getattr(mod, "launch"), type(sys)):
            mod.launch = _key_launch if keyed else _no_launch
            stubbed.append(mod.__name__)
    runtime.launch = _plan_launch if keyed else _no_launch
    stubbed.append(runtime.__name__)
    return stubbed


def cpu_us_per_call(step, calls: int, repeats: int) -> float:
    """CPU time of this thread per call of ``step``, microseconds: the fastest of ``repeats``
    repeats of ``calls`` calls. Thread CPU time, not wall time, and the fastest repeat: the
    cores may be shared with other processes, which only ever add time (intra-op threads
    are off, so the eager ops' CPU kernels run in this thread too)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            step()
        best = min(best, (time.thread_time() - t0) / calls * 1e6)
    return best


def _impl(case, name):
    return next(i for i in case.impls if i.name == name)


def measure(ops, calls: int, repeats: int, warmup: int = 30) -> dict:
    """{op: {pass: {impl: us}}}."""
    out = {}
    for op in ops:
        case = get_case(op)(HOST_SHAPES[op], DTYPE)
        out[op] = {}
        for pass_ in PASSES:
            out[op][pass_] = {}
            for name in IMPLS:
                step, ctx = host_step(case, _impl(case, name), pass_, torch.device("cpu"))
                with ctx:
                    for _ in range(warmup):
                        step()
                    out[op][pass_][name] = cpu_us_per_call(step, calls, repeats)
    return out


def table(res: dict) -> str:
    lines = ["CPU us per call, launches stubbed (fusedlib) / real CPU kernels (eager); bf16, host shapes",
             f"{'op':<18}{'fwd: fusedlib':>14}{'eager':>8}{'fwd+bwd: fusedlib':>19}{'eager':>8}"]
    for op, r in res.items():
        lines.append(f"{op:<18}{r['fwd']['fusedlib']:>14.1f}{r['fwd']['eager']:>8.1f}"
                     f"{r['fwd+bwd']['fusedlib']:>19.1f}{r['fwd+bwd']['eager']:>8.1f}")
    return "\n".join(lines)


def profile(op: str, calls: int = 300) -> None:
    case = get_case(op)(HOST_SHAPES[op], DTYPE)
    for pass_ in PASSES:
        step, ctx = host_step(case, _impl(case, "fusedlib"), pass_, torch.device("cpu"))
        with ctx:
            for _ in range(30):
                step()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                step()
            pr.disable()
        print(f"===== cProfile {op} {pass_}, {calls} calls, by own time")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def compile_check(ops) -> dict:
    """{op: "ok" or the error}: fusedlib's forward in torch.compile(fullgraph=True, backend="eager"),
    then a backward through it; compiled first before any eager call (empty caches), then
    again after eager calls (filled caches)."""
    out = {}
    for op in ops:
        case = get_case(op)(HOST_SHAPES[op], DTYPE)
        fn = _impl(case, "fusedlib").fn
        results = []
        for warm in (False, True):
            torch._dynamo.reset()
            try:
                inputs = case.make_inputs(torch.device("cpu"), True)
                if warm:
                    res = fn(*inputs)
                    (res[0] if isinstance(res, tuple) else res).float().sum().backward()
                res = torch.compile(fn, fullgraph=True, backend="eager")(*inputs)
                res = res[0] if isinstance(res, tuple) else res
                res.float().sum().backward()
                results.append("ok")
            except Exception as exc:  # report and go on
                results.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        out[op] = results[0] if results[0] == results[1] else f"cold: {results[0]}; warm: {results[1]}"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", choices=sorted(HOST_SHAPES), default=None)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--profile", action="append", default=[], choices=sorted(HOST_SHAPES))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", default=None, help="also write the table as JSON")
    parser.add_argument("--launch-key", action="store_true",
                        help="stubbed launches do a direct launch's Python (key, lookup, no-op launcher call)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ops = args.op or list(HOST_SHAPES)
    stub_launches(keyed=args.launch_key)
    if args.profile:
        for op in args.profile:
            profile(op)
        return 0
    if args.compile:
        for op, why in compile_check(ops).items():
            print(f"{op:<18} {why}")
        return 0
    res = measure(ops, args.calls, args.repeats)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
