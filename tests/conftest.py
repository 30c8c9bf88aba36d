"""Shared test settings: the device, tolerances per dtype, a float64 comparison, and the seeds.

Seeds. Every test starts from ``torch.manual_seed(seed)`` with

    seed = (zlib.crc32(node id) + offset) mod 2**31

where the node id is pytest's, e.g. ``tests/test_layer_norm.py::test_empty_input[rms]``. So a
test gets the same seed on every run and every machine (Python's string hash,
used before, is salted per process: its inputs changed from run to run), and each test a
different one. The offset, an
integer, shifts every test's seed at once: a seed sweep runs the suite under offsets 0, 1,
2, ...; a failure found at offset 7 repeats with either of

    pytest --seed-offset 7 tests/test_layer_norm.py
    FUSEDLIB_TEST_SEED=7 pytest tests/test_layer_norm.py

The option wins over the environment variable; without both the offset is 0. The header of
every run prints the offset in use. A test that draws random numbers in another process (a
subprocess, the ranks of a process group) takes its seed from the ``seed`` fixture and hands
it over, so those inputs follow the offset too.
"""
from __future__ import annotations

import gc
import os
import sys
import zlib

import pytest
import torch
import torch.distributed as dist

import fusedlib  # noqa: F401  (sets TRITON_INTERPRET on a CPU-only machine before kernels load)

#: Every test runs on the book's device: CUDA when present (compiled kernels), else the
#: CPU (Triton's interpreter), so keep sizes small.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: (atol, rtol) against a float64 reference, per dtype of the op's input and output.
#: Why each value: the kernels compute in float32 and round once when storing, so the
#: error is about one rounding of the output dtype plus a few float32 ulps.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),  # gradcheck-style inputs, computed in float32 though: see tests
    torch.float32: (1e-5, 1e-5),  # float32 arithmetic: ~1e-7 relative, 100x margin for tanh/exp
    torch.float16: (1e-3, 2e-3),  # one rounding to fp16: 2^-11 = 4.9e-4 relative, 4x margin
    torch.bfloat16: (1e-2, 1.6e-2),  # one rounding to bf16: 2^-8 = 3.9e-3 relative, 4x margin
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def deterministic_sdpa(sdpa: bool = True):
    """A context in which ``scaled_dot_product_attention`` compares bit for bit between two runs:
    on a CUDA device (with ``sdpa``) its math kernel pinned, since torch's other CUDA kernels for
    it may sum the backward's gradients with atomic additions, in whatever order the thread blocks
    finish; elsewhere, or without ``sdpa``, nothing (the CPU's kernels are deterministic)."""
    import contextlib

    if not (sdpa and DEVICE.type == "cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def generator_state(device: torch.device = DEVICE) -> torch.Tensor:
    """The state of the default generator of ``device`` (CUDA's, else the CPU's): the one
    fusedlib's dropout draws its keys from there."""
    return torch.cuda.get_rng_state(device) if torch.device(device).type == "cuda" else torch.get_rng_state()


def assert_close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare a kernel's output (any dtype) with a float64 reference, at ``dtype``'s tolerance.

    ``scale`` widens the tolerance for results that sum many terms (bias gradients).
    """
    assert actual.shape == expected64.shape, (actual.shape, expected64.shape)
    assert not torch.isnan(actual).any(), "NaN in result"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64.double().cpu(), atol=atol * scale, rtol=rtol)


def empty_cache_frees(nbytes: int = 1 << 29) -> bool:
    """Whether ``torch.cuda.empty_cache()`` gives a freed tensor's memory back to the driver (CUDA
    only): a tensor of at least ``nbytes`` is allocated and freed, and the reserved bytes must fall
    by its size. A failed capture whose allocator routing to its memory pool was left on makes
    the allocator act as if a capture were under way, and ``empty_cache`` then frees none of the
    default pools' memory. The tensor is made larger than every free block of the segments that
    stay (``inactive_split_bytes``: the free parts of segments partly in use), so that it gets a
    segment of its own, which ``empty_cache`` can free once the tensor is."""
    torch.cuda.synchronize()
    gc.collect()  # (a caught capture error's traceback holds frames in a cycle)
    torch.cuda.empty_cache()
    nbytes = max(nbytes, torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0) + (2 << 20))
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reserved = torch.cuda.memory_reserved()
    del x
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() <= reserved - nbytes


def megatron_why_not() -> str | None:
    """Why megatron-core's layers cannot run here (None when they can): they need CUDA
    (parameters, RNG tracker and buffers on the GPU) and megatron-core importable (Python >= 3.12)."""
    if DEVICE.type != "cuda":
        return "megatron-core's layers need CUDA (parameters, RNG tracker and buffers on the GPU)"
    try:
        import megatron.core  # noqa: F401
    except Exception as e:  # ImportError, or a SyntaxError of 3.12-only syntax on an older Python
        return f"megatron-core does not import on Python {sys.version.split()[0]}: {type(e).__name__}: {e}"
    return None


#: Environment variable that shifts every test's seed (the option ``--seed-offset`` wins).
SEED_ENV = "FUSEDLIB_TEST_SEED"


def pytest_addoption(parser):
    parser.addoption(
        "--seed-offset", type=int, default=None, metavar="N",
        help=f"shift every test's seed by the integer N (default: ${SEED_ENV}, else 0); see tests/conftest.py",
    )


def seed_offset(config) -> int:
    """The offset added to every test's seed: ``--seed-offset``, else ``$FUSEDLIB_TEST_SEED``, else 0.

    Raises:
        pytest.UsageError: if ``FUSEDLIB_TEST_SEED`` is set but is not an integer.
    """
    option = config.getoption("seed_offset", default=None)
    if option is not None:
        return option
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return 0
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer seed offset, got {value!r}") from None


def seed_of(nodeid: str, offset: int) -> int:
    """The seed of the test with pytest node id ``nodeid`` under seed offset ``offset``."""
    return (zlib.crc32(nodeid.encode()) + offset) % 2**31


def pytest_report_header(config):
    return (f"fusedlib test seeds: zlib.crc32(node id) + offset, offset {seed_offset(config)} "
            f"(--seed-offset N or {SEED_ENV}=N repeats a run)")


@pytest.fixture
def seed(request) -> int:
    """This test's seed (see the module docstring), for inputs drawn outside this process."""
    return seed_of(request.node.nodeid, seed_offset(request.config))


@pytest.fixture(autouse=True)
def _fresh_seed(seed):
    """Seed torch's generators (CPU and every GPU) with this test's seed before it runs."""
    torch.manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Forget every op's launch plans after each test (fusedlib.runtime.clear_plans): a plan
    keeps the launch settings it was made with, and tests monkeypatch settings (FOLD_TILES,
    the partial-sum buffers) that a plan of a later test must not keep."""
    yield
    import fusedlib.runtime

    fusedlib.runtime.clear_plans()


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)``: replace ``module.name`` (a function) for the test by one
    that records each call's positional arguments in the returned list, then calls it."""

    def count(module, name):
        calls, real = [], getattr(module, name)

        def counting(*args):
            calls.append(args)
            return real(*args)

        monkeypatch.setattr(module, name, counting)
        return calls

    return count


@pytest.fixture
def spy_launches(monkeypatch):
    """Every fusedlib kernel launch of the test, recorded: a list that gets one
    ``SimpleNamespace(kernel=name, grid=tuple, args=tuple, kwargs=dict)`` per launch.

    Direct launches are off for the test, so that no op's LaunchPlan calls Triton's C launcher
    on its own: every launch goes through ``fusedlib.runtime.launch`` (or a kernels module's
    own reference to it), where the spy sits."""
    import importlib
    import pkgutil
    import types

    import fusedlib.kernels
    import fusedlib.runtime as rt
    from fusedlib.kernels import launch as kl

    monkeypatch.setattr(kl, "DIRECT_LAUNCH", False)
    calls = []
    real = rt.launch

    def spy(kernel, grid, device, *args, **kwargs):
        calls.append(types.SimpleNamespace(kernel=getattr(kernel, "fn", kernel).__name__, grid=tuple(grid),
                                           args=args, kwargs=kwargs))
        return real(kernel, grid, device, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", spy)
    for info in pkgutil.iter_modules(fusedlib.kernels.__path__):
        mod = importlib.import_module(f"fusedlib.kernels.{info.name}")
        if getattr(mod, "launch", None) is real:
            monkeypatch.setattr(mod, "launch", spy)
    return calls


@pytest.fixture(autouse=True)
def _collector_restored():
    """A test that fails inside a block with Python's garbage collector off (the captures'
    :func:`fusedlib.runtime.collector_paused_for_capture`) does not leave it off for the tests
    after it in the same worker."""
    enabled = gc.isenabled()
    yield
    if enabled and not gc.isenabled():
        gc.enable()


@pytest.fixture(autouse=True)
def _default_stream_restored():
    """A test that fails a CUDA graph capture outside fusedlib's own capture paths
    (``torch.cuda.graph``'s exit raises from ``capture_end`` before it leaves its stream context)
    does not leave the capture's side stream current for the tests after it in the same worker:
    the current device's default stream is made current again. Tests start on it, so the tests
    of a failed capture can ask that their stream afterwards is the default one."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        default = torch.cuda.default_stream()
        if torch.cuda.current_stream() != default:
            torch.cuda.set_stream(default)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that leaves a torch.distributed group (and megatron-core's parallel state on it)
    behind, e.g. a benchmark case that creates a one-rank group for a vocab-parallel baseline,
    has it destroyed after it: later tests in the same pytest-xdist worker see the process state
    they would see alone (test_process_groups_in_one_process needs no group). Groups that a
    module fixture holds across its tests were there before each test and are left alone."""
    had = dist.is_available() and dist.is_initialized()
    yield
    if had or not (dist.is_available() and dist.is_initialized()):
        return
    megatron_state = sys.modules.get("megatron.core.parallel_state")
    if megatron_state is not None:
        megatron_state.destroy_model_parallel()
    dist.destroy_process_group()
