"""The project's own files agree with each other: environment.yml, pyproject, toc, chapters."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[]", req.strip(), maxsplit=1)[0].lower()


# conda names of the PyPI packages, where they differ
CONDA_NAME = {"torch": "pytorch"}


def test_environment_names_the_core_packages_of_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)}
    core = [_name(d) for d in pyproject["project"]["dependencies"]]
    extras = [_name(d) for group in ("book", "test") for d in pyproject["project"]["optional-dependencies"][group]]
    missing = [CONDA_NAME.get(n, n) for n in core + extras if CONDA_NAME.get(n, n) not in conda]
    assert not missing, f"environment.yml lacks {missing}"


def test_toc_lists_every_chapter_and_only_existing_files():
    toc = yaml.safe_load((ROOT / "toc.yml").read_text())
    files = [c["file"] for c in toc["chapters"]]
    chapters = sorted(p.with_suffix("").relative_to(ROOT).as_posix() for p in (ROOT / "chapters").glob("*.ipynb"))
    assert [f for f in files if f.startswith("chapters/")] == chapters
    for f in files + [toc["root"]]:
        assert any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")), f


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
