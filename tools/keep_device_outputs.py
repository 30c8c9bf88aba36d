"""Put a GPU run's outputs back into the device-dependent cells of a notebook re-executed on a CPU.

Usage: python tools/keep_device_outputs.py GPU_EXECUTED.ipynb CPU_EXECUTED.ipynb

After a change that only touches device-independent cells (say, kernel source shown by
``show_source``), a chapter can be re-executed on a CPU: its checked cells are the same on
every device by construction. The cells tagged ``nbval-ignore-output`` (banner, benchmarks,
plots) would then show the CPU run; this copies their outputs, cell by cell (matched by cell
id, sources must be equal), from the GPU-executed copy into the CPU-executed file in place.
"""
from __future__ import annotations

import sys

import nbformat


def main(gpu_path: str, cpu_path: str) -> int:
    gpu, cpu = nbformat.read(gpu_path, as_version=4), nbformat.read(cpu_path, as_version=4)
    by_id = {c.get("id"): c for c in gpu.cells}
    kept = 0
    for cell in cpu.cells:
        if cell.cell_type != "code" or "nbval-ignore-output" not in cell.get("metadata", {}).get("tags", []):
            continue
        old = by_id.get(cell.get("id"))
        if old is None or old.source != cell.source:
            print(f"cell {cell.get('id')}: no GPU output with the same source; keeping the CPU output")
            continue
        cell.outputs, cell.execution_count = old.outputs, old.execution_count
        kept += 1
    nbformat.write(cpu, cpu_path)
    print(f"{cpu_path}: {kept} device-dependent cells keep the outputs of {gpu_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
