"""Print the pip requirement for torch that `make setup` installs into .venv.

* A machine with an NVIDIA driver (nvidia-smi on PATH): PyPI's default build, `torch>=2.6`,
  which bundles CUDA.
* A machine without one: a CPU-only build of torch if pip's configured find-links already
  hold one for this Python (CI keeps one there), since PyPI's default Linux build brings
  several GB of CUDA libraries the CPU cannot use. Otherwise `torch>=2.6` all the same.

Override it: `make test TORCH="torch==2.7.1 --index-url https://download.pytorch.org/whl/cpu"`.
Usage: python3 tools/pick_torch.py PYTHON   (PYTHON: the venv's interpreter, for its wheel tag)
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

DEFAULT = "torch>=2.6"


def find_links() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += value.strip().strip("'\"").split()
    return [link.removeprefix("file://") for link in links if os.path.isdir(link.removeprefix("file://"))]


def main() -> None:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    if shutil.which("nvidia-smi"):
        print(DEFAULT)
        return
    tag = subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                         capture_output=True, text=True).stdout.strip()
    wheels = sorted(w for d in find_links() for w in glob.glob(os.path.join(d, f"torch-*+cpu-{tag}-*.whl")))
    print(wheels[-1] if wheels else DEFAULT)


if __name__ == "__main__":
    main()
