"""Direct launches (fusedlib/kernels/launch.py): the cached compiled kernel gives what ``kernel[grid]`` gives.

On every machine (no GPU needed):

* the cache key is at least as fine as Triton's own specialization: for a pool of arguments
  (tensors of every dtype at aligned and unaligned addresses, ints around 1, 16, 2^31, 2^63,
  floats, bools, None), two arguments with one fusedlib key item always get one Triton
  specialization, as Triton's own C++ specializer (``native_specialize_impl``) computes it;
* the cache logic, on a ``JITFunction`` whose compile and launch are replaced by a fake that
  keeps Triton's cache (keyed by Triton's real specialization): the first call fills, later calls
  hit and pass every parameter in signature order; a new alignment, int class, constexpr or
  option misses; unsupported calls fall back to ``kernel[grid]``; the check mode
  (``FUSEDLIB_CHECK_LAUNCH``) raises when the cached kernel is not Triton's;
* the version gate: the direct path only for the Triton versions whose source was read.

GPU (skipped without CUDA, "needs a CUDA GPU"; the direct-path tests also need a Triton
version of :data:`~fusedlib.kernels.launch.DIRECT_LAUNCH_VERSIONS`): every public op, forward
and backward, several shapes and dtypes, inputs at 16-byte aligned and unaligned addresses
(one element off, which flips Triton's divisibility specialization), gives bitwise the same
outputs and gradients through the direct path (with the check mode on) as through
``kernel[grid]``, with no fallback, and a second call launches only cached kernels (hits, no
misses).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import types

import pytest
import torch

import fusedlib  # noqa: F401  (first)
import triton
import triton.language as tl
from fusedlib.kernels import launch as kl
from fusedlib.runtime import collector_paused_for_capture

from conftest import DEVICE  # noqa: I001

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_direct = pytest.mark.skipif(
    not (CUDA and kl._direct_launch_possible(triton.__version__, False)),
    reason=f"needs a CUDA GPU and Triton {' or '.join(kl.DIRECT_LAUNCH_VERSIONS)} (direct launches)")


# ---------------------------------------------------------------------------------------------
# The key against Triton's own specializer
# ---------------------------------------------------------------------------------------------


def _triton_spec(a):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    # a runtime parameter: not const, specialized, alignment specialized (Triton's defaults)
    return native_specialize_impl(BaseBackend, a, False, True, True)


def test_cross_entropy_forward_plans_take_the_shards_first_id_and_the_vocabulary_size(emulated_plans):
    """The cross entropy's forward passes the shard's first vocabulary id and the global
    vocabulary size as ints, which Triton specializes (1 is a constant, 0 and 16 are divisible by
    16): the same logits and targets as shards at other places of vocabularies of other sizes get
    plans of their own. The emulated C launcher checks every call's launch key against its
    plan's, and each call's statistics equal the same call's on fresh plans, bitwise."""
    from fusedlib.kernels.cross_entropy import cross_entropy_fwd

    gen = torch.Generator().manual_seed(14)
    x = torch.randn(5, 24, generator=gen).to(DEVICE)
    t = torch.randint(0, 33, (5,), generator=gen).to(DEVICE)  # valid ids in each vocabulary below
    cases = [(0, 64), (16, 64), (3, 64), (16, 48), (16, 33)]

    _as_on_fresh_plans(cases, lambda start, vocab: [cross_entropy_fwd(x, t, start, -100, 0.0, vocab)], emulated_plans)
    assert "_cross_entropy_fwd_kernel" in emulated_plans, "no forward went through a bound plan"


def test_partial_sum_plans_take_the_output_dtype(emulated_plans):
    """The same float32 partials summed into float32, bfloat16 and float16 outputs: the output's
    pointer is an argument whose dtype Triton compiles in, so each output dtype gets a plan of
    its own (the emulated C launcher checks every call's launch key against its plan's), and each
    call's sums equal the same call's on fresh plans, bitwise."""
    from fusedlib.kernels.reduce import sum_partials

    partials = torch.randn(40, 50, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cases = [(torch.float32,), (torch.bfloat16,), (torch.float16,)]
    _as_on_fresh_plans(cases, lambda dtype: [sum_partials(partials, dtype)], emulated_plans)
    assert "_sum_partials_kernel" in emulated_plans, "no sum went through a bound plan"


def test_bias_gelu_backward_plans_take_the_gradients_strides(emulated_plans):
    """The same y and bias with a contiguous gradient and with one whose rows are 33 elements
    apart (a column slice): Triton specializes a stride on its divisibility by 16, so the two
    gradients get plans of their own, checked by the emulated C launcher; each call's dy and
    bias gradient equal the same call's on fresh plans, bitwise."""
    from fusedlib.kernels.bias_gelu import bias_gelu_bwd

    gen = torch.Generator().manual_seed(5)
    y = torch.randn(6, 32, generator=gen).to(DEVICE)
    bias = torch.randn(32, generator=gen).to(DEVICE)
    wide = torch.randn(6, 33, generator=gen).to(DEVICE)
    cases = [(wide[:, :32].contiguous(),), (wide[:, :32],)]
    assert cases[1][0].stride() == (33, 1)
    _as_on_fresh_plans(cases, lambda g: list(bias_gelu_bwd(g, y, bias)), emulated_plans)
    assert "_bias_gelu_bwd_kernel" in emulated_plans, "no backward went through a bound plan"


def test_glu_plans_take_the_strides_of_the_gradient_and_row_weights(emulated_plans):
    """The GLUs pass the strides of the output gradient (backward) and of the row weights (both
    kernels) as ints, which Triton specializes (1 is a constant): one input with a contiguous then
    a transposed gradient, and with row weights of stride 1 then 2, gets plans of its own for
    each. The emulated C launcher checks every call's launch key against its plan's, and each call
    gives bitwise what it gives on fresh plans."""
    from fusedlib import bias_swiglu_impl, weighted_bias_swiglu_impl

    gen = torch.Generator().manual_seed(13)
    y = torch.randn(6, 2 * 8, generator=gen).to(DEVICE)
    g = torch.randn(6, 8, generator=gen).to(DEVICE)
    gt = torch.randn(8, 6, generator=gen).to(DEVICE).t()
    w = torch.rand(6, 2, generator=gen).to(DEVICE)
    cases = [(g, None), (gt, None), (g, w[:, :1].contiguous()), (g, w[:, :1])]
    assert [(gr.stride(), None if wr is None else wr.stride(0)) for gr, wr in cases] == \
        [((8, 1), None), ((1, 6), None), ((8, 1), 1), ((8, 1), 2)]

    def run(gr, wr):
        leaf = y.clone().requires_grad_()
        if wr is None:
            out = bias_swiglu_impl(leaf, None)
            return [out.detach(), *torch.autograd.grad(out, leaf, gr)]
        wl = wr.detach().requires_grad_()
        out = weighted_bias_swiglu_impl(leaf, None, wl)
        return [out.detach(), *torch.autograd.grad(out, (leaf, wl), gr)]

    _as_on_fresh_plans(cases, run, emulated_plans)
    assert {"_glu_fwd_kernel", "_glu_bwd_kernel"} <= set(emulated_plans), "no launch went through a bound plan"


def _arg_pool():
    pool = []
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool):
        buf = torch.zeros(64, dtype=dt)
        pool += [buf, buf[1:], buf[2:], buf[8:], buf[16:]]
    pool += [0, 1, 2, 3, 15, 16, 17, 32, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
             2**40, 2**40 + 3, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    pool += [0.0, 1.0, 1.5, -2.0, True, False, None]
    # Triton's host-side tensor descriptors (FlashAttention's dQ bulk reductions): the block
    # shape and dtype are specialized, the base, shape and strides are runtime arguments
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(4, 64, 32)
    pool += [TensorDescriptor.from_tensor(t, [1, 16, 32]), TensorDescriptor.from_tensor(t, [1, 32, 32]),
             TensorDescriptor.from_tensor(t.to(torch.bfloat16), [1, 16, 32]),
             TensorDescriptor.from_tensor(torch.zeros(8, 16, 32), [1, 16, 32]),
             TensorDescriptor(t, (4, 64, 32), (2048, 32, 1), [1, 16, 32], "nan")]
    return pool


def test_key_is_at_least_as_fine_as_tritons_specialization():
    pool = _arg_pool()
    keys = [kl.launch_key(None, 0, False, "", (a,), {}) for a in pool]
    specs = [_triton_spec(a) for a in pool]
    assert not any(isinstance(k, str) for k in keys), "every pool argument is a supported type"
    for (ka, sa, a), (kb, sb, b) in itertools.combinations(zip(keys, specs, pool), 2):
        if ka == kb:
            assert sa == sb, f"one fusedlib key, two Triton specializations: {a!r} {sa} / {b!r} {sb}"
    # and the key does tell apart what Triton does (so the test above has pairs to check)
    assert len(set(keys)) >= len(set(map(str, specs)))


def test_key_parts():
    x = torch.zeros(32, dtype=torch.float32)
    k = kl.launch_key("k", 0, False, "", (x, 16, 1, 3), {"BLOCK": 64, "num_warps": 4})
    assert k == (id("k"), 0, False, "", torch.float32, True, "i32/16", "one", "i32", "BLOCK", 64, "num_warps", 4)
    assert kl.launch_key("k", 0, False, "", (), {"ACC": tl.float32})[-1] == ("tl.dtype", "fp32")
    assert kl.launch_key("k", 0, False, "", (x[1:],), {})[-1] is False  # 4 bytes off: not divisible by 16
    assert kl.launch_key("k", 0, False, "", ((1, 2),), {}) == "an argument of type tuple"


# ---------------------------------------------------------------------------------------------
# The cache logic on a fake compile and launch
# ---------------------------------------------------------------------------------------------


def _toy(X_ptr, Y_ptr, n, stride, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _FakeLauncher:
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _FakeCompiled:
    def __init__(self, key):
        self.key = key
        self.run = _FakeLauncher()
        self.function = 1000 + len(key)
        self.packed_metadata = (4, 1, 0)


class _FakeKernel(triton.runtime.jit.JITFunction):
    """A real JITFunction (its params, its signature) whose compile and launch are fakes: a
    cache of fake compiled kernels keyed by Triton's real specialization of the arguments."""

    def __init__(self, fn):
        super().__init__(fn)
        self.triton_cache = {}
        self.grid_launches = []

    def _compiled(self, args, kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        spec = []
        for p in self.params:
            v = bound.get(p.name, p.default)
            spec.append(("constexpr", v) if p.is_constexpr else _triton_spec(v))
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.arg_names))
        key = (tuple(spec), options)
        if key not in self.triton_cache:
            self.triton_cache[key] = _FakeCompiled(key)
        return self.triton_cache[key]

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.grid_launches.append((tuple(grid), args, kwargs))
            return self._compiled(args, kwargs)
        return go

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup
        return self._compiled(args, kwargs)


@pytest.fixture
def fake(monkeypatch):
    """A fresh fake kernel, Triton's knobs with no hooks, a fake stream, empty stats."""
    knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode=""))
    monkeypatch.setattr(kl, "_KNOBS", knobs)
    monkeypatch.setattr(kl, "_get_stream", lambda index: 77 + index)
    monkeypatch.setattr(kl, "CHECK_LAUNCH", False)
    kl.clear_launch_cache()
    kl.launch_stats().reset()
    yield _FakeKernel(_toy), knobs
    kl.clear_launch_cache()
    kl.launch_stats().reset()


def _args(x, y, n=64, stride=16, scale=0.5):
    return (x, y, n, stride, scale)


def test_first_call_fills_later_calls_launch_directly(fake):
    kernel, _ = fake
    x, y = torch.zeros(64), torch.zeros(64)
    kl.direct_launch(kernel, (3,), 0, _args(x, y), {"BLOCK": 32, "num_warps": 4})
    assert len(kernel.grid_launches) == 1 and kl.launch_stats().misses == 1
    compiled = next(iter(kernel.triton_cache.values()))
    for _ in range(3):
        kl.direct_launch(kernel, (3, 2), 0, _args(x, y, n=80), {"BLOCK": 32, "num_warps": 4})
    assert len(kernel.grid_launches) == 1, "hits do not go through kernel[grid]"
    assert kl.launch_stats().snapshot() == {"hits": 3, "misses": 1, "fallbacks": 0, "checks": 0}
    call = compiled.run.calls[-1]
    # grid (padded with 1), stream, function, CudaLauncher's head, then every parameter in order
    assert call[:5] == (3, 2, 1, 77, compiled.function)
    assert call[5:13] == (False, False, None, None, (4, 1, 0), None, None, None)
    assert call[13:] == (x, y, 80, 16, 0.5, 32, False)  # BLOCK by keyword, FLAG's default


def test_what_triton_specializes_on_misses(fake):
    kernel, _ = fake
    buf = torch.zeros(80)
    x, y = buf[:64], torch.zeros(64)
    kw = {"BLOCK": 32, "num_warps": 4}
    kl.direct_launch(kernel, (1,), 0, _args(x, y), kw)
    stats = kl.launch_stats()
    # each of these selects another compiled kernel in Triton: a miss each
    for args, kwargs in [
        (_args(buf[1:65], y), kw),  # x one element off: not 16-byte aligned
        (_args(x, y.to(torch.float16)), kw),  # another dtype
        (_args(x, y, n=1), kw),  # an int equal to 1 is a constexpr in Triton
        (_args(x, y, n=65), kw),  # not divisible by 16
        (_args(x, y, stride=2**31 + 16), kw),  # i64
        (_args(x, y), {"BLOCK": 64, "num_warps": 4}),  # another constexpr
        (_args(x, y), {"BLOCK": 32, "num_warps": 8}),  # another option
        (_args(x, y), {"BLOCK": 32, "FLAG": True, "num_warps": 4}),  # a defaulted constexpr set
    ]:
        before = stats.misses
        kl.direct_launch(kernel, (1,), 0, args, kwargs)
        assert stats.misses == before + 1, args
    # these do not: the same Triton kernel (and the fusedlib entry is reused)
    before = stats.misses
    kl.direct_launch(kernel, (1,), 0, _args(buf[4:68], y, n=128, stride=32, scale=-3.0), kw)  # 16 bytes off
    assert stats.misses == before and stats.hits == 1
    # another device: its own entry
    kl.direct_launch(kernel, (1,), 1, _args(x, y), kw)
    assert stats.misses == before + 1


def test_the_check_mode_agrees_with_triton_on_many_calls(fake, monkeypatch):
    kernel, _ = fake
    monkeypatch.setattr(kl, "CHECK_LAUNCH", True)
    pool = torch.zeros(200)
    ints = [1, 2, 16, 17, 48, 2**31 + 16]
    for off, n, stride, block in itertools.product([0, 1, 4, 8], ints, ints, [16, 32]):
        kl.direct_launch(kernel, (2,), 0, _args(pool[off:off + 64], pool[:64], n, stride), {"BLOCK": block})
    stats = kl.launch_stats()
    assert stats.checks == stats.hits > 0 and stats.fallbacks == 0


def test_the_check_mode_catches_a_key_that_misses_something(fake, monkeypatch):
    kernel, _ = fake
    monkeypatch.setattr(kl, "CHECK_LAUNCH", True)
    real_key = kl.launch_key

    def key_without_alignment(*a):  # a defective key: drops the tensors' alignment
        return tuple(item for item in real_key(*a) if not isinstance(item, bool))

    monkeypatch.setattr(kl, "launch_key", key_without_alignment)
    buf = torch.zeros(80)
    kl.direct_launch(kernel, (1,), 0, _args(buf[:64], buf[:64]), {"BLOCK": 32})
    with pytest.raises(RuntimeError, match="not the one Triton selects"):
        kl.direct_launch(kernel, (1,), 0, _args(buf[1:65], buf[:64]), {"BLOCK": 32})


@pytest.fixture
def plan_env(fake, monkeypatch):
    """The fake kernel, with fusedlib.runtime acting as on one CUDA device (device 0 current,
    compiled kernels, direct launches on): its launch() is the direct path, as on CUDA."""
    kernel, knobs = fake
    import fusedlib.runtime as rt

    monkeypatch.setattr(kl, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(rt, "INTERPRET_ON_CPU", False)
    monkeypatch.setattr(rt, "_ARMED", False)
    current = [0]
    monkeypatch.setattr(rt, "_cuda_get_device", lambda: current[0])
    launched = []

    def launch(k, grid, device, *args, **kwargs):
        launched.append(args)
        kl.direct_launch(k, grid, device.index, args, kwargs)

    monkeypatch.setattr(rt, "launch", launch)
    return kernel, knobs, rt, launched, current


def test_a_launch_plan_binds_on_its_first_call_then_calls_the_c_launcher(plan_env):
    kernel, _, rt, launched, _ = plan_env
    plan = rt.LaunchPlan(kernel, (3, 2), torch.device("cuda", 0), {"BLOCK": 32, "num_warps": 4})
    x, y = torch.zeros(64), torch.zeros(64)
    plan(*_args(x, y))
    assert len(launched) == 1 and len(kernel.grid_launches) == 1  # through launch(): compiled, cached
    compiled = next(iter(kernel.triton_cache.values()))
    x2, y2 = torch.zeros(64), torch.zeros(64)
    for n in (80, 96):
        plan(*_args(x2, y2, n=n))
    assert len(launched) == 1 and len(kernel.grid_launches) == 1, "later calls go to the C launcher alone"
    assert kl.launch_stats().hits == 2
    call = compiled.run.calls[-1]
    assert call[:5] == (3, 2, 1, 77, compiled.function)
    assert call[5:13] == (False, False, None, None, (4, 1, 0), None, None, None)
    assert call[13:] == (x2, y2, 96, 16, 0.5, 32, False)  # the call's arguments, then the keywords in order


@pytest.mark.parametrize("how", ["direct launches off", "debug knob", "hook", "other device"])
def test_a_launch_plan_goes_through_launch_when_it_must(plan_env, monkeypatch, how):
    kernel, knobs, rt, launched, current = plan_env
    plan = rt.LaunchPlan(kernel, (1,), torch.device("cuda", 0), {"BLOCK": 32})
    x = torch.zeros(64)
    plan(*_args(x, x))
    plan(*_args(x, x))
    assert len(launched) == 1
    if how == "direct launches off":
        monkeypatch.setattr(kl, "DIRECT_LAUNCH", False)
    elif how == "debug knob":
        knobs.runtime.debug = True  # another compiled kernel in Triton
    elif how == "hook":
        knobs.runtime.launch_enter_hook = _HookChain(lambda metadata: None)
    else:
        current[0] = 1
    plan(*_args(x, x))
    assert len(launched) == 2


def test_a_launch_plan_polls_the_device_side_checks_as_launch_does(plan_env, monkeypatch):
    kernel, _, rt, launched, _ = plan_env
    plan = rt.LaunchPlan(kernel, (1,), torch.device("cuda", 0), {"BLOCK": 32})
    x = torch.zeros(64)
    plan(*_args(x, x))
    polls = []
    monkeypatch.setattr(rt, "_poll", lambda: polls.append(1))
    plan(*_args(x, x))
    assert polls == [], "nothing armed: no poll"
    monkeypatch.setattr(rt, "_ARMED", True)  # an op with a device-side check ran
    plan(*_args(x, x))
    assert polls == [1] and len(launched) == 1, "a poll, then the C launcher"

    def found():
        raise ValueError("a bad target id")

    monkeypatch.setattr(rt, "_poll", found)
    hits = kl.launch_stats().hits
    with pytest.raises(ValueError, match="bad target id"):
        plan(*_args(x, x))
    assert kl.launch_stats().hits == hits, "raised before launching"


def test_the_check_mode_catches_a_plan_called_with_other_specializations(plan_env, monkeypatch):
    kernel, _, rt, launched, _ = plan_env
    monkeypatch.setattr(kl, "CHECK_LAUNCH", True)
    plan = rt.LaunchPlan(kernel, (1,), torch.device("cuda", 0), {"BLOCK": 32})
    buf = torch.zeros(80)
    plan(*_args(buf[:64], buf[:64]))
    plan(*_args(buf[16:80], buf[:64]))  # another 16-byte aligned address: the same kernel
    with pytest.raises(RuntimeError, match="Triton specializes otherwise"):
        plan(*_args(buf[1:65], buf[:64]))  # 4 bytes off: Triton's kernel for unaligned x
    with pytest.raises(RuntimeError, match="Triton specializes otherwise"):
        plan(*_args(buf[:64], buf[:64], n=1))  # n = 1 is a constant to Triton


def test_clear_plans_forgets_every_ops_plans():
    import fusedlib.runtime as rt

    cache = rt.plan_cache()
    rt.remember_plan(cache, ("k",), "plan")
    assert cache == {("k",): "plan"}
    rt.clear_plans()
    assert cache == {}
    for i in range(rt.PLAN_CACHE_SIZE + 1):  # a full cache starts over
        rt.remember_plan(cache, (i,), i)
    assert cache == {(rt.PLAN_CACHE_SIZE,): rt.PLAN_CACHE_SIZE}


class _HookChain:
    """Triton 3.6's ``knobs.runtime.launch_enter_hook``: a chain of callables in ``.calls``."""

    def __init__(self, *calls):
        self.calls = list(calls)

    def __call__(self, metadata):
        for c in self.calls:
            c(metadata)


@pytest.mark.parametrize("how", ["constexpr positional", "runtime by keyword", "tuple argument", "hook",
                                 "hook chain with a hook", "exit hook chain with a hook"])
def test_calls_the_direct_path_does_not_take_go_through_kernel_grid(fake, how):
    kernel, knobs = fake
    x = torch.zeros(64)
    args, kwargs = _args(x, x), {"BLOCK": 32}
    if how == "constexpr positional":
        args, kwargs = args + (32,), {}
    elif how == "runtime by keyword":
        args, kwargs = args[:4], {"scale": 0.5, "BLOCK": 32}
    elif how == "tuple argument":
        args = (x, x, (1, 2), 16, 0.5)
    elif how == "hook":
        knobs.runtime.launch_enter_hook = lambda metadata: None
    elif how == "hook chain with a hook":
        knobs.runtime.launch_enter_hook = _HookChain(lambda metadata: None)
    else:
        knobs.runtime.launch_exit_hook = _HookChain(lambda metadata: None)
    for _ in range(3):
        kl.direct_launch(kernel, (1,), 0, args, kwargs)
    stats = kl.launch_stats()
    assert len(kernel.grid_launches) == 3 and stats.hits == 0
    assert stats.fallbacks + stats.misses == 3 and stats.reasons


def test_empty_hook_chains_take_the_direct_path(fake):
    # Triton 3.6 always holds a HookChain, empty unless a profiler adds a hook: the direct
    # path must not treat an empty chain as a hook (it would never launch directly there)
    kernel, knobs = fake
    knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook = _HookChain(), _HookChain()
    x = torch.zeros(64)
    for _ in range(3):
        kl.direct_launch(kernel, (1,), 0, _args(x, x), {"BLOCK": 32})
    stats = kl.launch_stats()
    assert (stats.misses, stats.hits, stats.fallbacks) == (1, 2, 0), stats


def test_version_gate():
    assert kl._direct_launch_possible("3.6.0", interpret=False)
    assert not kl._direct_launch_possible("3.6.0", interpret=True)
    assert not kl._direct_launch_possible("3.9.0", interpret=False)
    assert not kl._direct_launch_possible("3.5.1", interpret=False)


def test_interpreted_or_unverified_triton_launches_through_kernel_grid():
    """Where the direct path is off (here: the interpreter, or another Triton version),
    fusedlib launches through kernel[grid] and counts nothing."""
    if kl._direct_launch_possible(triton.__version__, fusedlib.runtime.INTERPRET_ON_CPU):
        pytest.skip("the direct path is on here (see the GPU tests)")
    assert kl.DIRECT_LAUNCH is False
    from fusedlib import bias_gelu_impl

    kl.launch_stats().reset()
    y = torch.randn(4, 16, device=DEVICE)
    b = torch.randn(16, device=DEVICE)
    torch.testing.assert_close(bias_gelu_impl(y, b).double(),
                               torch.nn.functional.gelu(y.double() + b.double(), approximate="tanh"),
                               atol=1e-5, rtol=1e-5)  # float32, one rounding: see conftest.TOL
    assert kl.launch_stats().snapshot() == {"hits": 0, "misses": 0, "fallbacks": 0, "checks": 0}


# ---------------------------------------------------------------------------------------------
# GPU: every op, direct path == kernel[grid] path, bitwise
# ---------------------------------------------------------------------------------------------


def _offset_copy(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` (contiguous, same requires_grad) stored ``offset`` elements into a
    larger buffer: offset 1 puts it 2 or 4 bytes off a 16-byte boundary."""
    if not t.is_floating_point() or offset == 0:
        return t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t.clone()
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t.detach())
    return view.detach().requires_grad_(t.requires_grad)


def _run(fn, inputs, params, direct: bool, check: bool, seed: int = 1234):
    """fn's output and every gradient, through the direct path or kernel[grid]."""
    old = kl.DIRECT_LAUNCH, kl.CHECK_LAUNCH
    kl.DIRECT_LAUNCH, kl.CHECK_LAUNCH = direct, check
    try:
        for p in params:
            p.grad = None
        torch.manual_seed(seed)
        out = fn(*inputs)
        diff = [t for t in inputs if t.is_floating_point() and t.requires_grad] + list(params)
        if diff:
            g = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(7))
            (out.float() * g).sum().backward()
        torch.cuda.synchronize()
        return [out.detach().clone()] + [t.grad.clone() for t in diff]
    finally:
        kl.DIRECT_LAUNCH, kl.CHECK_LAUNCH = old


def _same(a_list, b_list, context=""):
    """Each tensor of ``a_list`` equal to ``b_list``'s (torch.equal); a failure names the tensor
    and its first differing elements with their values in hex, so that a rare failure says
    whether it is a last-bit difference (another compiled kernel) or a wrong value."""
    assert len(a_list) == len(b_list)
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        assert a.dtype == b.dtype and a.shape == b.shape
        a = a.view(torch.uint8) if a.dtype == torch.bool else a
        assert torch.equal(a, b), f"direct != kernel[grid]{context}: tensor {i}: {_differences(a, b)}"


def _differences(a, b, most=4):
    """The first ``most`` elements where ``a`` and ``b`` differ (NaN equal to NaN): index, both
    values (floats in hex), and how many differ."""
    ne = a != b
    if a.is_floating_point():
        ne &= ~(a.isnan() & b.isnan())
    where = ne.nonzero().tolist()
    if not where:
        return "no element differs (NaN in both at the same places)"

    def show(v):
        return float(v).hex() if a.is_floating_point() else str(int(v))

    items = [f"{tuple(ix)}: {show(a[tuple(ix)])} vs {show(b[tuple(ix)])}" for ix in where[:most]]
    return f"{len(where)} of {a.numel()} differ; " + ", ".join(items)


def _as_on_fresh_plans(cases, run, emulated_plans):
    """Runs ``run(*case)`` for each case on fresh plans, then every case twice more in turn,
    through the plans the emulated C launcher binds (which checks each call's launch key against
    its plan's): each call's tensors equal its fresh-plan ones bitwise."""
    want = []
    for case in cases:
        fusedlib.runtime.clear_plans()
        want.append(run(*case))
    fusedlib.runtime.clear_plans()
    emulated_plans.clear()
    for turn in range(2):
        for case, w in zip(cases, want):
            _same(run(*case), w, f" (case {case}, turn {turn + 1})")


def _main_ops():
    """(name, make(rows, h, dtype) -> inputs, fn): the seven ops of the host table, at any shape."""
    from fusedlib import (ScaledUpperTriangMaskedSoftmax, bias_dropout_add_fused_train, bias_gelu_impl,
                          bias_swiglu_impl, fused_layer_norm, fused_rms_norm, fused_vocab_parallel_cross_entropy)

    def r(*shape, dtype, grad=True):
        return torch.randn(*shape, device="cuda").to(dtype).requires_grad_(grad)

    return {
        "bias_gelu": (lambda n, h, dt: (r(n, h, dtype=dt), r(h, dtype=dt)), bias_gelu_impl),
        "layer_norm": (lambda n, h, dt: (r(n, h, dtype=dt), r(h, dtype=dt), r(h, dtype=dt)),
                       lambda x, w, b: fused_layer_norm(x, w, b, 1e-5)),
        "rms_norm": (lambda n, h, dt: (r(n, h, dtype=dt), r(h, dtype=dt)), lambda x, w: fused_rms_norm(x, w, 1e-5)),
        "swiglu": (lambda n, h, dt: (r(n, 2 * h, dtype=dt), r(2 * h, dtype=dt)), bias_swiglu_impl),
        "bias_dropout_add": (lambda n, h, dt: (r(n, h, dtype=dt), r(h, dtype=dt), r(n, h, dtype=dt)),
                             lambda x, b, res: bias_dropout_add_fused_train((x, b), res, 0.1)),
        "causal_softmax": (lambda n, h, dt: (r(2, h, h, dtype=dt),),
                           lambda s: ScaledUpperTriangMaskedSoftmax.apply(s, 0.125)),
        "cross_entropy": (lambda n, h, dt: (r(n, h, dtype=dt), torch.randint(0, h, (n,), device="cuda")),
                          lambda x, t: fused_vocab_parallel_cross_entropy(x, t)),
    }


MAIN_OPS = ["bias_gelu", "layer_norm", "rms_norm", "swiglu", "bias_dropout_add", "causal_softmax", "cross_entropy"]
SHAPES = [(32, 256), (7, 40), (1000, 2000)]  # the host shape, odd and tiny, several programs per row block


@needs_direct
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one-element-off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MAIN_OPS)
def test_direct_path_equals_kernel_grid_bitwise(name, shape, dtype, offset):
    make, fn = _main_ops()[name]
    inputs = tuple(_offset_copy(t, offset) for t in make(*shape, dtype))
    if offset:
        assert any(t.data_ptr() % 16 for t in inputs if t.is_floating_point())
    stats = kl.launch_stats()
    want = _run(fn, tuple(_offset_copy(t, offset) for t in inputs), [], direct=False, check=False)
    stats.reset()
    got = _run(fn, tuple(_offset_copy(t, offset) for t in inputs), [], direct=True, check=True)
    _same(got, want)
    assert stats.fallbacks == 0, stats.reasons
    assert stats.checks == stats.hits  # every direct launch was compared with Triton's choice
    # a second call: every launch is a hit of the cache
    stats.reset()
    again = _run(fn, tuple(_offset_copy(t, offset) for t in inputs), [], direct=True, check=False)
    _same(again, want)
    assert stats.misses == 0 and stats.fallbacks == 0 and stats.hits > 0, stats


@needs_direct
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one-element-off"])
def test_every_public_op_direct_equals_kernel_grid_bitwise(offset):
    """Every case of tests/test_compile_graph.py (every public op and variant), float32 and
    bfloat16: direct (check mode on) == kernel[grid], bitwise, and no fallback."""
    from test_compile_graph import CASES

    stats = kl.launch_stats()
    for name, case in sorted(CASES.items()):
        for dtype in case.dtypes:
            params = case.params()
            base = case.make(dtype)
            want = _run(case.fn, tuple(_offset_copy(t, offset) for t in base), params, direct=False, check=False)
            stats.reset()
            got = _run(case.fn, tuple(_offset_copy(t, offset) for t in base), params, direct=True, check=True)
            assert stats.fallbacks == 0, (name, stats.reasons)
            assert stats.checks == stats.hits, name
            if case.grad:
                _same(got, want)
            else:  # in-place inference: compare the outputs
                _same(got[:1], want[:1])


@needs_direct
def test_cuda_graph_capture_through_the_direct_path(monkeypatch):
    """A CUDA graph captured while fusedlib launches directly replays the same kernels."""
    from fusedlib import bias_gelu_impl

    monkeypatch.setattr(kl, "DIRECT_LAUNCH", True)  # whatever the process default

    y = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = _run(bias_gelu_impl, (y, b), [], direct=False, check=False)

    def step():
        y.grad = b.grad = None
        out = bias_gelu_impl(y, b)
        (out.float() * 0.5).sum().backward()
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    kl.launch_stats().reset()
    g = torch.cuda.CUDAGraph()
    with collector_paused_for_capture(), torch.cuda.graph(g):
        out = step()
    assert kl.launch_stats().hits > 0 and kl.launch_stats().misses == 0
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Every launch fusedlib makes is one the direct path takes (checked here on any machine)
# ---------------------------------------------------------------------------------------------

#: the ops of ``python -m fusedlib.bench --host`` but the whole transformer block (slow on the CPU)
HOST_OPS = ["bias_gelu", "bias_dropout_add", "geglu", "swiglu", "weighted_swiglu", "layer_norm", "rms_norm",
            "causal_softmax", "masked_softmax", "softmax_one", "softmax_dropout", "cross_entropy", "rope"]


@pytest.mark.parametrize("op", HOST_OPS)
def test_every_fusedlib_launch_can_go_direct(op, monkeypatch):
    """Each kernel launch of the op's fused forward and backward passes the direct path's
    conditions (no constexpr positionally, no runtime argument by keyword, supported argument
    types, hashable keywords), judged on a JITFunction of the same kernel source; the launch
    itself runs as usual (on the CPU, in Triton's interpreter)."""
    import importlib
    import pkgutil

    import fusedlib.kernels
    from fusedlib.bench.host import HOST_SHAPES, host_step
    from fusedlib.bench.ops import get_case

    seen = []
    jit_of = {}

    def checking_launch(orig):
        def launch(kernel, grid, device, *args, **kwargs):
            fn = getattr(kernel, "fn", kernel)
            jit = jit_of.setdefault(fn, triton.runtime.jit.JITFunction(fn))
            why = kl._why_not_direct(jit, len(args), kwargs)
            key = kl.launch_key(jit, 0, False, "", args, kwargs)
            assert why is None, f"{fn.__name__}: {why}"
            assert not isinstance(key, str), f"{fn.__name__}: {key}"
            hash(key)
            seen.append(fn.__name__)
            return orig(kernel, grid, device, *args, **kwargs)
        return launch

    for info in pkgutil.iter_modules(fusedlib.kernels.__path__):
        mod = importlib.import_module(f"fusedlib.kernels.{info.name}")
        if callable(getattr(mod, "launch", None)) and not isinstance(mod.launch, types.ModuleType):
            monkeypatch.setattr(mod, "launch", checking_launch(mod.launch))
    # a LaunchPlan's launches that do not go straight to Triton's C launcher (all of them on the CPU)
    monkeypatch.setattr(fusedlib.runtime, "launch", checking_launch(fusedlib.runtime.launch))
    case = get_case(op)(HOST_SHAPES[op], torch.float32)
    impl = next(i for i in case.impls if i.name == "fusedlib")
    for pass_ in ("fwd", "fwd+bwd"):
        step, ctx = host_step(case, impl, pass_, DEVICE)
        with ctx:
            step()
    assert seen, "no kernel was launched"


# ---------------------------------------------------------------------------------------------
# Small inputs: one row program, no second-stage reduction, the same bits
# ---------------------------------------------------------------------------------------------


def _bwd_call(op, rows, h, dtype):
    """(kernels module name, call() -> (dx, dparam[, dparam2]), the terms each parameter
    gradient sums over rows, float64 [rows, n])."""
    r = lambda *s: torch.randn(*s, device=DEVICE).to(dtype)  # noqa: E731
    if op == "bias_gelu":
        from fusedlib.kernels.bias_gelu import bias_gelu_bwd

        g, y, b = r(rows, h), r(rows, h), r(h)
        return "bias_gelu", lambda: bias_gelu_bwd(g, y, b), lambda out: [out[0].double()]
    if op == "swiglu":
        from fusedlib.kernels.glu import glu_bwd

        g, y, b = r(rows, h), r(rows, 2 * h), r(2 * h)
        return "glu", lambda: glu_bwd(g, y, b, None, "silu")[:2], lambda out: [out[0].double()]
    if op == "bias_dropout_add":
        from fusedlib.kernels.bias_dropout_add import bias_dropout_add_bwd, philox_seed

        g, seed = r(rows, h), philox_seed(DEVICE)
        tile = kl.Tile(BLOCK_M=16, BLOCK_N=64, num_warps=4, programs_per_sm=4)  # the interpreter's tile is 1 row tile
        return ("bias_dropout_add",
                lambda: bias_dropout_add_bwd(g, dtype, seed, 0.25, need_dbias=True, db_dtype=dtype, tile=tile),
                lambda out: [out[0].double()])
    from fusedlib.kernels.layer_norm import norm_bwd, norm_fwd

    rms = op == "rms_norm"
    x, w, b, dy = r(rows, h), r(h), (None if rms else r(h)), r(rows, h)
    _, mean, rstd = norm_fwd(x, w, b, 1e-5, rms_norm=rms)
    x_hat = (x.double() - (0 if rms else mean.double()[:, None])) * rstd.double()[:, None]
    return ("layer_norm", lambda: norm_bwd(dy, x, w, b, mean, rstd, rms_norm=rms),
            lambda out: [dy.double() * x_hat] + ([] if rms else [dy.double()]))


def _count_second_stages(monkeypatch, module_name):
    """A list that gets one item per second-stage launch (sum_partials, the norms' reduce kernel)."""
    import importlib

    from fusedlib.kernels import reduce as reduce_mod

    seen = []
    real_sum = reduce_mod.sum_partials
    monkeypatch.setattr(reduce_mod, "sum_partials", lambda *a: seen.append("sum_partials") or real_sum(*a))
    module = importlib.import_module(f"fusedlib.kernels.{module_name}")

    def counting(real_launch):
        def launch(kernel, *a, **k):
            if getattr(kernel, "fn", kernel).__name__ == "_norm_bwd_reduce_kernel":
                seen.append("reduce")
            return real_launch(kernel, *a, **k)
        return launch

    if hasattr(module, "launch"):
        monkeypatch.setattr(module, "launch", counting(module.launch))
    # a LaunchPlan's launches that do not go straight to Triton's C launcher (all of them on the CPU)
    monkeypatch.setattr(fusedlib.runtime, "launch", counting(fusedlib.runtime.launch))
    return module, seen


SECOND_STAGE_OPS = ["bias_gelu", "swiglu", "bias_dropout_add", "layer_norm", "rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("op", SECOND_STAGE_OPS)
def test_small_inputs_skip_the_second_stage(op, dtype, monkeypatch):
    """At a shape of at most FOLD_TILES row tiles, one program takes every row and the bias /
    gamma / beta gradient comes out of the backward kernel itself, in the parameter's dtype:
    no second-stage launch. Its value is the two-stage one's up to the order of the float32
    additions: both add the same n = rows terms t (the other path in several partial sums),
    so they differ by at most 2·n·2^-24·sum|t| (Higham, recursive summation, twice), plus the
    rounding to the output dtype, which may fall either way: one ulp of the result, at most
    2^(1-p)·|b| for a p-bit significand (2^-23 for float32, 2^-7 for bfloat16; a bf16 result
    of 3.59 has an ulp of 2^-6, more than 2^-8·3.59)."""
    rows, h = 100, 48  # a few row tiles (up to 32 rows each at h = 48), at most FOLD_TILES
    name, call, terms = _bwd_call(op, rows, h, dtype)
    module, seen = _count_second_stages(monkeypatch, name)
    folded = call()
    assert seen == [], "one program: no second stage"
    monkeypatch.setattr(module, "FOLD_TILES", 0)
    fusedlib.runtime.clear_plans()  # plans keep the settings they were made with
    two_stage = call()
    assert seen, "several programs: a second stage"
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    assert torch.equal(folded[0], two_stage[0])  # dx does not depend on the grid
    for a, b, t in zip(folded[1:], two_stage[1:], terms(two_stage)):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (t.shape[1],)
        bound = 2 * rows * 2.0 ** -24 * t.abs().sum(0) * 1.01 + ulp * b.double().abs()
        assert ((a.double() - b.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("op", ["bias_gelu", "swiglu", "bias_dropout_add"])
def test_one_program_result_equals_the_second_stage_bitwise(op, dtype, monkeypatch):
    """One row tile (one program on either path): the kernel's own store of the column sum
    (rounded once to the parameter's dtype) equals what the second stage makes of the same
    float32 row (adds zeros, rounds once), bitwise."""
    import importlib

    from fusedlib.kernels import reduce as reduce_mod

    name, call, _ = _bwd_call(op, 5, 48, dtype)
    folded = call()
    module = importlib.import_module(f"fusedlib.kernels.{name}")
    acc_only = lambda programs, n, acc, out_dtype, device: torch.empty((programs, n), dtype=acc, device=device)  # noqa: E731
    monkeypatch.setattr(module, "partials_buffer", acc_only)  # the float32 partial row, then sum_partials
    fusedlib.runtime.clear_plans()  # a plan is bound to its buffers' dtypes
    launched = []
    real_sum = reduce_mod.sum_partials
    monkeypatch.setattr(reduce_mod, "sum_partials", lambda *a: launched.append(1) or real_sum(*a))
    two_stage = call()
    if dtype != torch.float32:
        assert launched, "the second stage ran"
    for a, b in zip(folded, two_stage):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_direct_launches_are_on_by_default_where_possible():
    """Direct launches are on wherever they are possible (compiled kernels, a verified Triton)
    unless FUSEDLIB_DIRECT_LAUNCH=0 (or another off value) turns them off."""
    if os.environ.get("FUSEDLIB_DIRECT_LAUNCH", "").strip():
        pytest.skip("FUSEDLIB_DIRECT_LAUNCH is set in this environment")
    assert kl.env_flag("FUSEDLIB_DIRECT_LAUNCH", True) is True
    possible = kl._direct_launch_possible(triton.__version__, fusedlib.runtime.INTERPRET_ON_CPU)
    assert kl.DIRECT_LAUNCH is possible
    for value, on in (("0", False), ("off", False), ("1", True), ("yes", True)):
        os.environ["FUSEDLIB_DIRECT_LAUNCH"] = value
        try:
            assert kl.env_flag("FUSEDLIB_DIRECT_LAUNCH", True) is on
        finally:
            del os.environ["FUSEDLIB_DIRECT_LAUNCH"]


# ---------------------------------------------------------------------------------------------
# Launch plans through the ops, on any machine: Triton's C launcher emulated
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def emulated_plans(monkeypatch):
    """Every LaunchPlan binds on its first call (as on CUDA with direct launches) to an emulated
    C launcher, which launches ``kernel[grid]`` with the positional arguments it is handed and
    the plan's keywords, after checking the plan's contract: the arguments get the launch key the
    plan was bound with (Triton would select the same compiled kernel for them). Returns the list
    of launches: a kernel's name for each emulated C-launcher call, "plain NAME" for each
    launch through ``fusedlib.runtime.launch``."""
    import fusedlib.runtime as rt

    calls = []
    monkeypatch.setattr(kl, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(kl, "CHECK_LAUNCH", False)
    monkeypatch.setattr(kl, "_KNOBS", types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode="")))
    # the stream a cached direct launch goes to: the current one, as Triton's get_current_stream
    # gives the real direct path (the legacy stream 0 would not be ordered after work on another)
    monkeypatch.setattr(kl, "_get_stream", (lambda index: torch.cuda.current_stream(index).cuda_stream) if CUDA
                        else (lambda index: 0))
    monkeypatch.setattr(rt, "_cuda_get_device", lambda: 0)

    def bind(self, args):
        kernel, kwargs = self.kernel, self.kwargs
        key = kl.launch_key(kernel, 0, False, "", args, kwargs)
        grid = self.grid + (1,) * (3 - len(self.grid))

        def c_launch(gx, gy, gz, stream, function, *call_args):
            assert kl.launch_key(kernel, 0, False, "", call_args, kwargs) == key, (
                f"{kernel.fn.__name__}: a plan called with arguments Triton specializes otherwise")
            calls.append(kernel.fn.__name__)
            kernel[(gx, gy, gz)](*call_args, **kwargs)

        self._bound = (c_launch, *grid, None, (), (), key, 0, False, "")

    monkeypatch.setattr(rt.LaunchPlan, "_bind", bind)
    real_launch = rt.launch

    def plain_launch(kernel, *args, **kwargs):
        calls.append("plain " + kernel.fn.__name__)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", plain_launch)
    fusedlib.runtime.clear_plans()
    return calls


def _plan_cases():
    """(name, make(offset) -> inputs, fn, random): ops whose launches are planned, forward and
    backward, with the variants that take other paths (dropout, no bias, weights, memory-efficient,
    the residual output, bias-dropout-add in the norm, rows long enough to split, cross entropy)."""
    from fusedlib import (bias_dropout_add_fused_train, bias_geglu_impl, bias_gelu_impl, bias_swiglu_impl,
                          fused_layer_norm, fused_rms_norm, fused_vocab_parallel_cross_entropy,
                          weighted_bias_swiglu_impl)
    from fusedlib.fusions.fused_attention import flash_attention
    from fusedlib.fusions.fused_layer_norm import BiasDropoutAddNormFunction, FusedLayerNormAffineFunction

    def r(*shape, scale=1.0, grad=True, dtype=torch.float32):
        gen = torch.Generator().manual_seed(sum(shape) + len(shape))
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype).requires_grad_(grad)

    n, h = 37, 24
    return {
        "bias_gelu": (lambda: (r(n, h), r(h)), bias_gelu_impl, False),
        "bias_dropout_add_p0.3": (lambda: (r(n, h), r(h), r(n, h)),
                                  lambda x, b, res: bias_dropout_add_fused_train((x, b), res, 0.3), True),
        "bias_dropout_add_bf16_into_fp32": (lambda: (r(n, h, dtype=torch.bfloat16), r(h, dtype=torch.bfloat16),
                                                     r(n, h)),
                                            lambda x, b, res: bias_dropout_add_fused_train((x, b), res, 0.0), False),
        "bias_geglu": (lambda: (r(n, 2 * h), r(2 * h)), bias_geglu_impl, False),
        "swiglu_no_bias": (lambda: (r(n, 2 * h),), lambda y: bias_swiglu_impl(y, None), False),
        "weighted_swiglu": (lambda: (r(n, 2 * h), r(n, 1)), lambda y, w: weighted_bias_swiglu_impl(y, None, w), False),
        "layer_norm": (lambda: (r(n, h), r(h), r(h)), lambda x, w, b: fused_layer_norm(x, w, b, 1e-5), False),
        "layer_norm_memory_efficient": (lambda: (r(n, h), (1 + r(h, scale=0.2, grad=False)).requires_grad_(),
                                                 r(h, scale=0.1)),
                                        lambda x, w, b: fused_layer_norm(x, w, b, 1e-5, memory_efficient=True), False),
        "rms_norm_zero_centered": (lambda: (r(n, h), r(h, scale=0.1)),
                                   lambda x, w: fused_rms_norm(x, w, 1e-5, zero_centered_gamma=True), False),
        "layer_norm_with_residual": (lambda: (r(n, h), r(h), r(h)),
                                     lambda x, w, b: torch.stack(FusedLayerNormAffineFunction.apply(
                                         x, w, b, 1e-5, False, False, True)), False),
        "bias_dropout_add_layer_norm_p0.3": (
            lambda: (r(n, h), r(h), r(n, h), r(h), r(h)),
            lambda x, lb, res, w, b: torch.stack(BiasDropoutAddNormFunction.apply(
                x, lb, res, w, b, 1e-5, 0.3, True, False, False)), True),
        "cross_entropy": (lambda: (r(n, 50, scale=3.0), torch.randint(0, 50, (n,), device=DEVICE)),
                          lambda x, t: fused_vocab_parallel_cross_entropy(x, t), False),
        "cross_entropy_smoothing": (lambda: (r(n, 50, scale=3.0), torch.randint(0, 50, (n,), device=DEVICE)),
                                    lambda x, t: fused_vocab_parallel_cross_entropy(x, t, label_smoothing=0.1), False),
        # FlashAttention: GQA, sq != sk, a head dim padded to 32; the deterministic backward (three
        # kernels), and dQ by atomics (dropout at d <= 64) with a key-padding mask and sinks
        "flash_attention_causal_gqa": (lambda: (r(2, 9, 4, 24), r(2, 11, 2, 24), r(2, 11, 2, 24)),
                                       lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True),
                                       False),
        "flash_attention_mask_sinks_dropout": (
            lambda: (r(2, 9, 4, 24), r(2, 11, 2, 24), r(2, 11, 2, 24), r(4),
                     torch.arange(11, device=DEVICE).expand(2, 11) >= torch.tensor([[8], [11]], device=DEVICE)),
            lambda q, k, v, s, m: flash_attention(q, k, v, sinks=s, attention_mask=m, dropout_p=0.2,
                                                  window_size=(4, -1)),
            True),
    }


def _variant(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values as a new leaf: ``"aligned"``, ``"offset"`` (stored one element off a
    16-byte boundary), or ``"strided"`` (a view of every other column of a wider buffer)."""
    if not t.is_floating_point():
        return t.clone()
    if how == "offset":
        return _offset_copy(t, 1)
    if how == "strided" and t.dim() == 2:
        wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype, device=t.device)
        wide[:, ::2] = t.detach()
        return wide[:, ::2].detach().requires_grad_(t.requires_grad)
    if how == "strided" and t.dim() == 4:  # attention's [b, s, h, d]: rows of 2d elements, unit last stride
        wide = torch.zeros(*t.shape[:3], 2 * t.shape[3], dtype=t.dtype, device=t.device)
        wide[..., :t.shape[3]] = t.detach()
        return wide[..., :t.shape[3]].detach().requires_grad_(t.requires_grad)
    return t.detach().clone().requires_grad_(t.requires_grad)


def _fwd_bwd(fn, inputs, seed=5):
    torch.manual_seed(seed)
    out = fn(*inputs)
    diff = [t for t in inputs if t.is_floating_point() and t.requires_grad]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, diff, g)
    return [out.detach()] + list(grads)


@pytest.mark.parametrize("name", sorted(_plan_cases()))
def test_ops_through_bound_launch_plans_equal_the_plain_launches_bitwise(name, emulated_plans, monkeypatch):
    """Each op, forward and backward, called again and again with inputs at aligned addresses,
    one element off and strided (each a new signature, so a new plan), gives bitwise what it
    gives through plain launches, and its later calls go through the bound plans, whose
    arguments always have the launch key the plan was bound with."""
    make, fn, _ = _plan_cases()[name]
    base = make()
    hows = ["aligned", "offset", "strided", "aligned", "offset", "strided"]
    monkeypatch.setattr(kl, "DIRECT_LAUNCH", False)  # plans do not bind: every launch is a plain one
    want = {how: _fwd_bwd(fn, [_variant(t, how) for t in base]) for how in hows[:3]}
    fusedlib.runtime.clear_plans()
    monkeypatch.setattr(kl, "DIRECT_LAUNCH", True)
    for i, how in enumerate(hows):
        emulated_plans.clear()
        _same(_fwd_bwd(fn, [_variant(t, how) for t in base]), want[how])
        if i < 3:  # a new signature: a new plan at least for the forward, whose first call is a plain launch
            # (a backward that never sees the changed input, e.g. memory-efficient's, keeps its plan)
            assert emulated_plans and emulated_plans[0].startswith("plain "), emulated_plans
        else:  # every launch through a bound plan
            assert emulated_plans and not any(c.startswith("plain ") for c in emulated_plans), emulated_plans


@pytest.mark.parametrize("op", ["cross_entropy", "layer_norm_memory_efficient"])
def test_a_check_without_its_word_is_not_compiled_in_and_gets_its_own_plan(op, emulated_plans, monkeypatch):
    """A device-side check has no word while a CUDA graph is captured before any check buffer
    exists (and while torch.compile traces): the kernel is then launched without the check, the
    pointer it would write through is never the caller's tensor, and the call's plan is not the
    plan of a call with the word (their arguments differ: the word is an int64 pointer)."""
    import fusedlib.runtime as rt
    from fusedlib import fused_layer_norm, fused_vocab_parallel_cross_entropy
    from fusedlib.fusions.fused_cross_entropy import TARGET_CHECK
    from fusedlib.fusions.fused_layer_norm import LAYER_NORM_GAMMA_CHECK

    gen = torch.Generator().manual_seed(3)
    if op == "cross_entropy":
        check = TARGET_CHECK
        x = torch.randn(4, 10, generator=gen).to(DEVICE)
        t = torch.tensor([1, 2, 3, 4], device=DEVICE)

        def call(target):
            return fused_vocab_parallel_cross_entropy(x, target)
    else:
        check = LAYER_NORM_GAMMA_CHECK
        # x requires grad: the gamma check is compiled in only for a call autograd records (a
        # backward may divide by gamma); without one it is not (tests/test_layer_norm.py)
        x = torch.randn(4, 10, generator=gen).to(DEVICE).requires_grad_(True)
        w, b = 1 + torch.rand(10, generator=gen).to(DEVICE), torch.randn(10, generator=gen).to(DEVICE)

        def call(target):
            return fused_layer_norm(x, w, b, 1e-5, memory_efficient=True)
    want = call(t if op == "cross_entropy" else None)
    call(t if op == "cross_entropy" else None)  # through the bound plan
    monkeypatch.setattr(check, "_words", {})
    monkeypatch.setattr(rt, "_buffer", lambda cuda: None)  # as in a capture before any buffer exists
    assert check.word(x) is None
    emulated_plans.clear()
    if op == "cross_entropy":
        bad = torch.tensor([1, 2, 30, 3], device=DEVICE)  # 30 is outside the vocabulary
        got = call(bad)
        assert bad.tolist() == [1, 2, 30, 3], "the kernel wrote into the caller's target"
        good = call(torch.tensor([1, 2, 0, 3], device=DEVICE))
        assert torch.isnan(got[2]) and torch.equal(got[[0, 1, 3]], good[[0, 1, 3]])
    else:
        got = call(None)
        assert torch.equal(got, want)
    assert emulated_plans and emulated_plans[0].startswith("plain "), "a call without the word gets its own plan"


def test_flash_attention_plans_take_the_scale_and_lse_as_triton_specializes_them(emulated_plans):
    """FlashAttention's backward, planned for one call, called again with what its key does not
    hold as a signature: an int scale of 1 (a constant to Triton) then a float one, and an LSE
    4 bytes off a 16-byte boundary (a pointer Triton specializes by alignment). The emulated C
    launcher checks every call's launch key against the one its plan was bound with, and each
    result equals the same call's on fresh plans, bitwise."""
    import fusedlib.kernels.flash_attention as kfa

    gen = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(1, 9, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    band = kfa.attention_band(9, 9, True, None)
    o, lse = kfa.flash_attn_fwd(q, k, v, 1.0, band)
    shifted = torch.empty(lse.numel() + 1, device=DEVICE)[1:].view(lse.shape).copy_(lse)
    calls = [(1, lse), (0.5, lse), (0.5, shifted), (1, shifted)]
    want = []
    for scale, l in calls:
        fusedlib.runtime.clear_plans()
        want.append(kfa.flash_attn_bwd(do, q, k, v, o, l, scale, band)[:3])
    fusedlib.runtime.clear_plans()
    for (scale, l), w in zip(calls, want):
        _same(list(kfa.flash_attn_bwd(do, q, k, v, o, l, scale, band)[:3]), list(w))
    assert any(not c.startswith("plain ") for c in emulated_plans), "no call went through a bound plan"


def test_a_tensor_subclass_gets_its_own_plan(emulated_plans):
    """A tensor subclass (here a Parameter subclass) is keyed apart from a plain tensor, as the
    launch layer's key tells them apart: a plan bound for one is not called with the other."""
    from fusedlib import fused_layer_norm

    class MyParameter(torch.nn.Parameter):
        pass

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 24, generator=gen).to(DEVICE)
    w, b = torch.randn(24, generator=gen).to(DEVICE), torch.randn(24, generator=gen).to(DEVICE)
    plain = [fused_layer_norm(x, torch.nn.Parameter(w), torch.nn.Parameter(b), 1e-5) for _ in range(2)]
    sub = fused_layer_norm(x, MyParameter(w), MyParameter(b), 1e-5)  # the emulated launcher checks the key
    assert torch.equal(sub, plain[0]) and torch.equal(plain[1], plain[0])


def test_a_target_of_another_dtype_gets_its_own_plan(emulated_plans):
    """An argument whose shape and strides a plan key takes from others' (the cross entropy's
    target, beside the logits, in its backward's key) is still keyed by its dtype: the same logits
    with an int64 then an int32 target, forward and backward. The emulated C launcher checks every
    call's launch key against its plan's, and each call gives bitwise what it gives on fresh plans."""
    from fusedlib import fused_vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 24, generator=gen).to(DEVICE)
    t = torch.randint(0, 24, (5,), generator=gen).to(DEVICE)
    leaves = [(x.clone().requires_grad_(), t), (x.clone().requires_grad_(), t.to(torch.int32))]
    want = []
    for args in leaves:
        fusedlib.runtime.clear_plans()
        want.append(_fwd_bwd(fused_vocab_parallel_cross_entropy, args))
    fusedlib.runtime.clear_plans()
    emulated_plans.clear()
    for _ in range(2):
        for args, w in zip(leaves, want):
            _same(_fwd_bwd(fused_vocab_parallel_cross_entropy, args), w)
    assert any(not c.startswith("plain ") for c in emulated_plans), "no call went through a bound plan"


# ---------------------------------------------------------------------------------------------
# Tile: its fields are checked where a tile is made, before any kernel is compiled with it
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, error, match", [
    ("num_stages", 0, ValueError, "Tile.num_stages must be from 1"),
    ("num_stages", -1, ValueError, "Tile.num_stages must be from 1"),
    ("num_stages", kl.MAX_NUM_STAGES + 1, ValueError, "Tile.num_stages must be from 1"),
    ("num_stages", 2.5, TypeError, "Tile.num_stages must be an int"),
    ("num_stages", "3", TypeError, "Tile.num_stages must be an int"),
    ("num_stages", True, TypeError, "Tile.num_stages must be an int"),
    ("num_stages", None, TypeError, "Tile.num_stages must be an int"),
    ("BLOCK_M", 0, ValueError, "Tile.BLOCK_M must be >= 1"),
    ("BLOCK_N", -64, ValueError, "Tile.BLOCK_N must be >= 0"),
    ("num_warps", 3, ValueError, "Tile.num_warps must be a power of two"),
    ("num_warps", 64, ValueError, "Tile.num_warps must be a power of two"),
    ("programs_per_sm", -1, ValueError, "Tile.programs_per_sm must be >= 0"),
])
def test_tile_fields_are_checked(field, value, error, match):
    good = dict(BLOCK_M=4, BLOCK_N=64, num_warps=4, num_stages=3, programs_per_sm=4)
    kl.Tile(**good)  # the good tile itself
    with pytest.raises(error, match=match):
        kl.Tile(**dict(good, **{field: value}))
    with pytest.raises(error, match=match):  # dataclasses.replace checks too
        dataclasses.replace(kl.Tile(**good), **{field: value})



# ---------------------------------------------------------------------------------------------
# The tile, grid and dtype helpers, on their own (each check was a mutation no test caught)
# ---------------------------------------------------------------------------------------------


def test_pick_takes_the_first_bound_not_passed_and_resolves_block_n_only_where_asked():
    """A row length equal to a bound takes that row; BLOCK_N 0 (or past the row) resolves to the
    row's next power of two, but not where the caller asks for the table's value as it is, in
    either order of the two kinds of call (pick remembers each separately)."""
    small, big = kl.Tile(4, 0, 4), kl.Tile(1, 1024, 8)
    table = ((64, small), (kl.HUGE, big))
    assert kl.pick(table, 40, resolve_block_n=False) is small
    assert kl.pick(table, 40) == dataclasses.replace(small, BLOCK_N=64)
    assert kl.pick(table, 40, resolve_block_n=False) is small
    assert kl.pick(table, 64) == dataclasses.replace(small, BLOCK_N=64)  # the bound itself: its row
    assert kl.pick(table, 65) == dataclasses.replace(big, BLOCK_N=128)  # capped at the row's next power of two
    assert kl.pick(table, 65, resolve_block_n=False) is big
    assert kl.pick(table, 5000) is big
    assert kl.pick(table, 1) == dataclasses.replace(small, BLOCK_N=1)


@pytest.mark.parametrize("fold_tiles", [0, kl.FOLD_TILES])
def test_persistent_grid_covers_every_row_within_the_devices_programs(fold_tiles):
    """For row counts around the tile size and the device's program budget: every program gets
    whole tiles and at least one row, the programs cover every row, a persistent grid has at most
    k programs per multiprocessor shared among the column blocks, a plain one a program per tile,
    and at most ``fold_tiles`` tiles are folded into one program."""
    sms = kl.sm_count(torch.device(DEVICE))
    for n_rows, block_m, k, column_blocks in itertools.product(
            (1, 2, 7, 8, 9, 33, 64, 65, 1000), (1, 4, 8), (0, 1, 2, 4), (1, 3, 2 * sms + 1)):
        programs, rows = kl.persistent_grid(n_rows, block_m, k, torch.device(DEVICE), column_blocks, fold_tiles)
        case = (n_rows, block_m, k, column_blocks, fold_tiles, programs, rows)
        tiles = kl.cdiv(n_rows, block_m)
        assert programs >= 1 and rows >= block_m and rows % block_m == 0, case
        assert (programs - 1) * rows < n_rows <= programs * rows, case  # all rows, no program without one
        if tiles <= fold_tiles:
            assert programs == 1, case
        elif k == 0:
            assert (programs, rows) == (tiles, block_m), case
        else:
            assert programs <= max(1, k * sms // column_blocks), case


def test_acc_dtype_is_float64_when_any_input_is():
    assert kl.acc_dtype(torch.bfloat16, torch.float64) is torch.float64
    assert kl.acc_dtype(torch.float64, torch.float16) is torch.float64
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        assert kl.acc_dtype(dt) is torch.float32
        assert kl.acc_dtype(dt, torch.float32) is torch.float32


def test_as_rows_and_empty_contiguous_like():
    """as_rows: [..., n] -> [prod(...), n] for any sizes, 0 rows or 0 columns too, a view where
    strides allow; empty_contiguous_like: contiguous whatever the input's strides."""
    assert kl.as_rows(torch.zeros(2, 3, 0)).shape == (6, 0)
    assert kl.as_rows(torch.zeros(0, 3, 5)).shape == (0, 5)
    assert kl.as_rows(torch.zeros(5)).shape == (1, 5)
    t = torch.zeros(2, 3, 4)
    assert kl.as_rows(t).data_ptr() == t.data_ptr() and kl.as_rows(t).shape == (6, 4)
    x = torch.zeros(6, 4).t()  # [4, 6], strides (1, 4)
    assert kl.as_rows(x) is x
    for dtype in (None, torch.float32, torch.float64):
        out = kl.empty_contiguous_like(x, dtype)
        assert out.is_contiguous() and out.shape == x.shape and out.dtype == (dtype or x.dtype)
        out = kl.empty_contiguous_like(x[:, ::2], dtype)
        assert out.is_contiguous() and out.shape == (4, 3)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_a_plan_is_keyed_by_the_row_count_not_only_the_strides(op):
    """Contiguous inputs of 3 rows and of 300 rows have the same strides, dtype and alignment: their
    plans (grids sized by the rows) must still be apart. Each call, forward and backward, gives
    bitwise what it gives on fresh plans, and the float64 reference's values."""
    from fusedlib import bias_geglu_impl, bias_swiglu_impl

    fn = bias_swiglu_impl if op == "swiglu" else bias_geglu_impl
    gen = torch.Generator().manual_seed(9)
    cases = [(torch.randn(n, 16, generator=gen).to(DEVICE).requires_grad_(),
              torch.randn(16, generator=gen).to(DEVICE).requires_grad_()) for n in (3, 300, 3)]
    want = []
    for args in cases:
        fusedlib.runtime.clear_plans()
        want.append(_fwd_bwd(fn, args))
    fusedlib.runtime.clear_plans()
    for args, w in zip(cases, want):
        _same(_fwd_bwd(fn, args), w)
    y = (cases[1][0] + cases[1][1]).detach().double()
    a, b = y.chunk(2, -1)
    act = torch.nn.functional.silu(a) if op == "swiglu" else torch.nn.functional.gelu(a, approximate="tanh")
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(want[1][0].double(), act * b, atol=64 * eps, rtol=64 * eps)


def test_an_input_of_another_dtype_or_class_gets_its_own_plan(emulated_plans):
    """The same shape, strides and alignment as a float32 tensor, but bfloat16, or a tensor
    subclass: the op's plan key (here the SwiGLU's without a bias, whose key has no other tensor)
    tells them apart, as Triton's specialization and the launch layer's key do. The emulated C
    launcher checks every call's launch key against its plan's, and each call gives bitwise what
    it gives on fresh plans."""
    from fusedlib import bias_swiglu_impl

    class Sub(torch.Tensor):
        pass

    gen = torch.Generator().manual_seed(10)
    y = torch.randn(6, 32, generator=gen).to(DEVICE)
    cases = [y.clone().requires_grad_(), y.to(torch.bfloat16).requires_grad_(),
             y.clone().as_subclass(Sub).requires_grad_()]

    def fn(y):
        return bias_swiglu_impl(y, None)

    want = []
    for args in cases:
        fusedlib.runtime.clear_plans()
        want.append([t.as_subclass(torch.Tensor) for t in _fwd_bwd(fn, [args])])
    fusedlib.runtime.clear_plans()
    for _ in range(2):
        for args, w in zip(cases, want):
            _same([t.as_subclass(torch.Tensor) for t in _fwd_bwd(fn, [args])], w)


def test_cross_entropy_backward_plans_take_the_strides_of_the_gradient_and_target(emulated_plans):
    """The cross entropy's backward passes the strides of the loss gradient and of the target as
    ints, which Triton specializes (1 is a constant, 0 and 16 are divisible by 16): a gradient
    of stride 1 then a broadcast one of stride 0 (a mean's), a target of stride 1 then 2, of the
    same logits, get plans of their own. The emulated C launcher checks every call's launch key
    against its plan's, and each gradient equals the same call's on fresh plans, bitwise."""
    from fusedlib import fused_vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 24, generator=gen).to(DEVICE)
    wide = torch.randint(0, 24, (5, 2), generator=gen).to(DEVICE)
    g = torch.randn(5, generator=gen).to(DEVICE)
    cases = [(wide[:, 0].contiguous(), g), (wide[:, 0].contiguous(), torch.full((), 0.2).to(DEVICE).expand(5)),
             (wide[:, 0], g)]
    assert [(t.stride(0), gr.stride(0)) for t, gr in cases] == [(1, 1), (1, 0), (2, 1)]

    def run(t, gr):
        leaf = x.clone().requires_grad_()
        loss = fused_vocab_parallel_cross_entropy(leaf, t)
        return [loss.detach(), *torch.autograd.grad(loss, leaf, gr)]

    _as_on_fresh_plans(cases, run, emulated_plans)
    assert "_cross_entropy_bwd_kernel" in emulated_plans, "no backward went through a bound plan"
