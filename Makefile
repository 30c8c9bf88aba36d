# fusedlib: two commands do everything on a fresh machine (GPU optional). The package needs
# Python 3.10+ (pyproject.toml's requires-python); make test needs 3.11+ (tests/test_packaging.py
# imports tomllib), so, as README.md says, use Python 3.11+ for both.
#   make book   set up .venv, execute every chapter on this machine's device, build _build/html
#   make test   set up .venv, run the unit tests (the built book in a browser included) and nbval
#               over every chapter, spread over JOBS pytest-xdist workers (one per core, at most 8;
#               JOBS=0: one process)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fusedlib-setup
# torch to install when the venv has none: see tools/pick_torch.py (CUDA build where an
# NVIDIA driver is present, a CPU-only build already on this machine where not).
TORCH  ?= $(shell $(PYTHON) tools/pick_torch.py $(PYTHON))
JOBS   ?= $(shell $(PYTHON) -c "import os; print(max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)))")

.PHONY: setup book test bench clean

setup: $(STAMP)

# The browser test of the built book (tests/test_book_browser.py) needs Chromium and chromedriver:
# tools/install_browser.sh installs them with apt-get where it can (root on Debian, as in CI) and
# otherwise says why not, in one line; the test then skips with that reason.
$(STAMP): pyproject.toml tools/pick_torch.py tools/install_browser.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --disable-pip-version-check -e ".[book,test]"
	sh tools/install_browser.sh $(VENV)/browser-install.log
	$(PY) -c "import fusedlib, torch, triton; print('fusedlib', fusedlib.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
	touch $@

# Executes every chapter here, every time (book.yml: execute_notebooks: force; the committed
# notebooks are left as they are) and builds the HTML book, warnings as errors.
book: setup
	$(VENV)/bin/jupyter-book build . --config book.yml --toc toc.yml -W -n --keep-going
	@echo "open _build/html/index.html"

# (on 3.10 one line says so, instead of an ImportError in the middle of the collection)
test: setup
	@$(PY) -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 'make test needs Python 3.11+ (tomllib) in $(VENV), got ' + sys.version.split()[0] + ': remove $(VENV), then PYTHON=python3.11 make test')"
	$(PY) -m pytest tests chapters --nbval --nbval-current-env --nbval-cell-timeout=900 -p no:cacheprovider -n $(JOBS) --dist loadfile

# On a GPU: time every op and its baselines, write chapters/data/bench/<op>.json, and the
# host cost per call of every op into chapters/data/bench/host.json.
bench: setup
	$(PY) -m fusedlib.bench --out chapters/data/bench
	$(PY) -m fusedlib.bench --host --out chapters/data/bench

clean:
	rm -rf _build .pytest_cache
