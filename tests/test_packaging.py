"""The project's own files agree with each other: environment.yml, pyproject, toc, chapters."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[]", req.strip(), maxsplit=1)[0].lower()


# conda names of the PyPI packages, where they differ
CONDA_NAME = {"torch": "pytorch"}


def _environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _conda_specs(env: dict) -> list[str]:
    return [d for d in env["dependencies"] if isinstance(d, str)]


def _pip_specs(env: dict) -> list[str]:
    return [p for d in env["dependencies"] if isinstance(d, dict) for p in d.get("pip", [])]


def test_environment_names_the_core_packages_of_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = _environment()
    # a package not on conda-forge comes from PyPI through the environment's pip section
    have = {_name(d) for d in _conda_specs(env)} | {_name(p) for p in _pip_specs(env)}
    core = [_name(d) for d in pyproject["project"]["dependencies"]]
    extras = [_name(d) for group in ("book", "test") for d in pyproject["project"]["optional-dependencies"][group]]
    missing = [CONDA_NAME.get(n, n) for n in core + extras if CONDA_NAME.get(n, n) not in have and n not in have]
    assert not missing, f"environment.yml lacks {missing}"


def check_cuda_pytorch_from_conda_forge(env: dict) -> list[str]:
    """What keeps `env` (a parsed environment.yml) from a current PyTorch with CUDA.

    PyTorch stopped publishing to the `pytorch` conda channel after 2.5, and `pytorch-cuda` (its
    CUDA selector) exists only there, so either one pins an old PyTorch or fails to resolve;
    conda-forge's pytorch is selected as its CUDA build by the build string `cuda*`.
    """
    faults = []
    channels = env.get("channels", [])
    if channels != ["conda-forge"]:
        faults.append(f"channels are {channels}, not conda-forge alone")
    specs = _conda_specs(env)
    for spec in specs:
        name = _name(spec.split("::")[-1])
        if "::" in spec:
            faults.append(f"{spec!r} names a channel of its own")
        if name in ("pytorch-cuda", "cpuonly", "pytorch-cpu"):
            faults.append(f"{spec!r} selects a PyTorch variant of the pytorch channel or a CPU build")
    torch_specs = [s for s in specs if _name(s) == "pytorch"]
    if len(torch_specs) != 1:
        faults.append(f"pytorch listed {len(torch_specs)} times")
    else:
        # conda's "name version build" form: the build string must ask for a CUDA build
        parts = torch_specs[0].split()
        if len(parts) != 3 or not parts[2].startswith("cuda"):
            faults.append(f"{torch_specs[0]!r} does not require conda-forge's CUDA build (`pytorch >=X cuda*`)")
    return faults


def test_environment_gives_a_cuda_pytorch_from_conda_forge():
    assert check_cuda_pytorch_from_conda_forge(_environment()) == []


def test_the_cuda_pytorch_check_rejects_the_pytorch_channel_and_pytorch_cuda():
    """The check above fails on the old file's kinds of fault, one at a time."""
    good = _environment()
    assert not check_cuda_pytorch_from_conda_forge(good)

    def variant(channels=None, replace=None, add=()):
        env = {**good, "channels": channels or good["channels"]}
        deps = [replace.get(d, d) if isinstance(d, str) and replace else d for d in good["dependencies"]]
        env["dependencies"] = deps + list(add)
        return env

    torch = next(s for s in _conda_specs(good) if _name(s) == "pytorch")
    bad = {
        "pytorch channel": variant(channels=["pytorch", "nvidia", "conda-forge"]),
        "pytorch-cuda": variant(add=["pytorch-cuda"]),
        "pytorch-cuda with version": variant(add=["pytorch-cuda=12.4"]),
        "channel in the spec": variant(replace={torch: "pytorch::pytorch>=2.6"}),
        "no CUDA build": variant(replace={torch: "pytorch>=2.6"}),
        "CPU build": variant(replace={torch: "pytorch >=2.6 cpu*"}),
    }
    for what, env in bad.items():
        assert check_cuda_pytorch_from_conda_forge(env), f"not caught: {what}"


def test_toc_lists_every_chapter_and_only_existing_files():
    toc = yaml.safe_load((ROOT / "toc.yml").read_text())
    files = [c["file"] for c in toc["chapters"]]
    chapters = sorted(p.with_suffix("").relative_to(ROOT).as_posix() for p in (ROOT / "chapters").glob("*.ipynb"))
    assert [f for f in files if f.startswith("chapters/")] == chapters
    for f in files + [toc["root"]]:
        assert any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")), f


def test_the_book_reads_no_file_in_a_hidden_folder(tmp_path):
    """Sphinx's own file discovery, with book.yml's exclude_patterns, in a tree holding the book's
    files and Markdown in hidden folders (a reader's notes, a virtual environment's, notebook
    checkpoints): only the book's files are read, so a stray file cannot fail the build's -W."""
    Project = pytest.importorskip("sphinx.project", reason="Sphinx comes with the book extra").Project
    config = yaml.safe_load((ROOT / "book.yml").read_text())
    toc = yaml.safe_load((ROOT / "toc.yml").read_text())
    book = [toc["root"]] + [c["file"] for c in toc["chapters"]]
    hidden = [".notes/draft", ".venv/lib/python3.11/site-packages/pkg/README", "chapters/.ipynb_checkpoints/x",
              ".a/b/.c/d"]
    for name in book + hidden:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{name}.md").write_text("# a page\n")
    found = Project(tmp_path, {".md": "markdown"}).discover(exclude_paths=config["exclude_patterns"])
    assert found == set(book)


def test_chapters_are_executed_and_have_a_kernelspec():
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", path
        code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
        assert all(c["execution_count"] is not None for c in code), f"{path}: unexecuted cells"


def test_readme_shows_the_two_commands_and_ci_calls_make_test():
    readme = (ROOT / "README.md").read_text()
    assert "make book" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readmes_python_examples_run_on_this_device():
    # the README's Python blocks for this machine's device, in order in one namespace (a later
    # block may use an earlier one's imports): those that name "cuda" on a GPU, the others (the
    # CPU-only machine's) without one
    from conftest import DEVICE

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    mine = [b for b in blocks if ('"cuda"' in b) == (DEVICE.type == "cuda")]
    assert len(mine) >= (1 if DEVICE.type == "cuda" else 2), len(blocks)
    namespace: dict = {}
    for block in mine:
        exec(compile(block, "README.md", "exec"), namespace)
    for name in ("out", "y"):  # every example ends with a backward
        assert namespace[name].requires_grad


def _public_api() -> list[tuple[str, object]]:
    """``(dotted name, object)`` of every public function and class: the names in a module's
    ``__all__`` defined in that module, in every module of fusedlib whose dotted path has no
    component starting with ``_``, outside ``fusedlib.bench`` and the ``__main__`` modules."""
    import importlib
    import inspect
    import pkgutil

    import fusedlib

    found = []
    for info in pkgutil.walk_packages(fusedlib.__path__, "fusedlib."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]) or parts[1] == "bench" or parts[-1] == "__main__":
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", None) or []:
            obj = getattr(module, name, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == info.name:
                found.append((f"{info.name}.{name}", obj))
    return found


def test_every_public_function_and_class_names_its_source():
    # the project's rule: every public docstring ends with a "Source:" line (the Megatron file or
    # paper it follows, or fusedlib's own where nothing outside has one)
    import inspect

    api = _public_api()
    assert len(api) > 300, len(api)  # the walk found the package
    missing = [name for name, obj in api if "Source:" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"{len(missing)} public docstrings without a 'Source:' line: {missing}"
