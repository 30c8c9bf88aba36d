"""Execute chapter notebooks in place with nbclient, on this machine's device.

This is how the committed outputs are made: run on a CPU, where the kernels run in Triton's
interpreter and the benchmark cells load the H200 records stored in chapters/data/bench/. On a
CUDA GPU the same command compiles the kernels and the benchmark cells measure live.

Usage: python tools/execute_notebooks.py [chapters/NN_name.ipynb ...]   (default: every chapter)

Each notebook runs top to bottom in a fresh python3 kernel with chapters/ as its working
directory; the executed notebook replaces the file. The stored records the run read
(``fusedlib.book.RECORDS_READ``: each name with the SHA-256 of its bytes), and whether its
benchmark cells measured live (a GPU without ``FUSEDLIB_BENCH_STORED=1``), asked of the kernel
by one more cell, which is then removed, go into the notebook's metadata
(``fusedlib.records_read``, ``fusedlib.measured_live``): tests/test_bench_book.py checks that
each chapter's outputs come from the records as they are now, and from no live run. Exits
non-zero if a cell raised, and lists every stderr output of a cell that nbval compares (those
must not exist).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


#: The cell appended for the run and removed after it: the records the chapter read (name ->
#: SHA-256) and whether its benchmark cells measured live, as one JSON object.
RECORDS_CELL = ("import json as _json, fusedlib.book as _book\n"
                "print(_json.dumps({'records_read': dict(sorted(_book.RECORDS_READ.items())),\n"
                "                   'measured_live': _book.measure_live()}))")


def records_read(cell: nbformat.NotebookNode) -> dict:
    """What :data:`RECORDS_CELL` printed: ``{"records_read": {name: sha256}, "measured_live": bool}``.

    Raises:
        ValueError: the cell printed no such JSON object (it raised, or printed something else).
    """
    text = "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    try:
        got = json.loads(text.strip().splitlines()[-1]) if text.strip() else None
    except ValueError:  # (printed, but not JSON)
        got = None
    if not (isinstance(got, dict) and set(got) == {"records_read", "measured_live"}
            and isinstance(got["records_read"], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in got["records_read"].items())
            and isinstance(got["measured_live"], bool)):
        raise ValueError(f"the records cell printed {text!r}, not its JSON object of records read")
    return got


def main(paths: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    notebooks = [Path(p) for p in paths] or sorted((root / "chapters").glob("*.ipynb"))
    failed = 0
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        nb.cells.append(nbformat.v4.new_code_cell(RECORDS_CELL))
        try:
            NotebookClient(nb, timeout=1800, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            read = records_read(nb.cells.pop())
        except Exception as exc:  # report and go on with the other chapters
            failed += 1
            print(f"FAILED {path}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            continue
        nb.metadata.setdefault("fusedlib", {}).update(read)
        nbformat.write(nb, path)
        problems = []
        for i, cell in enumerate(nb.cells):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell.cell_type != "code" or "nbval-ignore-output" in tags:
                continue
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream" and out.get("name") == "stderr":
                    problems.append(f"cell {i} stderr: {out['text'][:200]!r}")
        print(f"executed {path.name} in {time.time() - t0:.0f} s" + "".join(f"\n  {p}" for p in problems), flush=True)
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="chapter notebooks to execute in place (default: every chapter)")
    sys.exit(main(parser.parse_args().notebooks))
