"""The benchmark harness: ``python -m fusedlib.bench [--op NAME ...] [--out DIR] [--sweep | --host]``.

See :mod:`fusedlib.bench.core` for the protocol,
:mod:`fusedlib.bench.ops` for the cases, :mod:`fusedlib.bench.host` for the host cost per
call (``--host``), and :mod:`fusedlib.bench.tune` for the kernels' tile tuning
(``python -m fusedlib.bench.tune --op NAME``). Run them on a GPU; results are JSON lists
of records, one file per op (and ``host.json``), that the chapters plot.
"""
from .core import BenchCase, Impl, copy_record, load_records, measure_case, time_ms, write_records  # noqa: F401
from .ops import OP_MODULES, get_cases  # noqa: F401


def run_op(op: str, device=None, sweep: bool = False, copy: dict | None = None,
           progress=None) -> tuple[list[dict], dict[str, str]]:
    """Measure one op's cases on ``device`` (default: the current CUDA device).

    Args:
        op: op name (see ``fusedlib.bench.OP_MODULES``).
        device: torch device; a GPU for meaningful numbers.
        sweep: also measure the op's sweep shapes.
        copy: a copy record from the same run to include (measured if None).
        progress: callback per timing, for a progress bar.

    Returns:
        ``(records, skipped)``: the records, the copy ceiling first; and, for each
        baseline that could not run, why.
    """
    import torch

    device = torch.device(device or "cuda")
    copy = copy if copy is not None else copy_record(device=str(device))
    records, skipped = [copy], {}
    for case in get_cases(op)(device, sweep=sweep):
        records += measure_case(case, device, progress=progress)
        skipped.update(case.skipped)
    return records, skipped
