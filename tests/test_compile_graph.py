"""Every public op inside torch.compile and CUDA graphs, and input checks without a host sync.

GPU (skipped on a CPU-only machine, "needs a CUDA GPU"), for every public op:

(a) ``torch.compile(fn, fullgraph=True)`` of the forward equals eager;
(b) ``torch.compile`` of a whole step (forward, ``loss.backward()``) gives eager's outputs and
    gradients;
(c) a CUDA graph of forward and backward, captured after a warm-up on a side stream and
    replayed on new data copied into its static inputs, gives eager's results for that data;
(d) eager forward and backward under ``torch.cuda.set_sync_debug_mode("error")``: no host sync.

The device-side checks that replace the host syncs (an out-of-range cross-entropy target, a
zero gamma with the memory-efficient norms): lazily on CUDA (NaN at once, ValueError at a later
call or ``fusedlib.runtime.check_errors()``), at once with ``FUSEDLIB_SYNC_CHECKS=1`` and on the
CPU; NaN, never a wrong finite value, in the affected outputs in every mode. On the CPU, also
that the kernels compile for sm_90 when torch.compile hands them their int arguments as
constants (what broke bias-dropout-add's backward in Inductor).

Why no ``torch.library`` registration: every op passes (a) to (c) as a ``torch.autograd.Function``
launching ``@triton.jit`` kernels, which Dynamo traces into Inductor's Triton-kernel wrapper
(and functionalizes: it reads which tensors a kernel stores to from the kernel's IR).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

import fusedlib
from fusedlib import (
    BiasDropoutAddNormFunction,
    FusedLayerNormAffineFunction,
    FusedRMSNormAffineFunction,
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_geglu_impl,
    bias_gelu_impl,
    bias_swiglu_impl,
    fused_layer_norm,
    fused_rms_norm,
    fused_scale_mask_softmax,
    flash_attention,
    fused_vocab_parallel_cross_entropy,
    runtime,
    unfused,
    vocab_parallel_cross_entropy,
    weighted_bias_swiglu_impl,
    weighted_squared_relu_impl,
)
from fusedlib.fusions.fused_rope import fused_apply_rotary_pos_emb
from fusedlib.fusions.fused_softmax import fused_scale_mask_softmax_dropout
from fusedlib.kernels.bias_dropout_add import drop_threshold, dropout_scale
from fusedlib.kernels import launch as launch_layer
from fusedlib.kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from fusedlib.kernels.layer_norm import norm_bwd, norm_fwd
from fusedlib.parallel.layers import _EmbeddingDeterministicGrad
from fusedlib.runtime import collector_paused_for_capture
from fusedlib.transformer.enums import AttnMaskType

from conftest import DEVICE  # noqa: I001

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
#: CPU tensors run only where kernels are interpreted (no GPU, or TRITON_INTERPRET=1).
needs_cpu_kernels = pytest.mark.skipif(not runtime.INTERPRET_ON_CPU,
                                       reason="needs Triton's CPU interpreter (kernels here are compiled for CUDA)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# compiled or captured against eager: the same Triton kernels on the same data, in the same
# order (no atomics). What may differ is instruction selection when Inductor recompiles a
# kernel (an FMA contracted or not: a float32 rounding or two, ~1e-7 relative) and the few
# PyTorch ops around the kernels; then a float32 result moves by a few ulps (1e-5 relative is
# ~80 ulps of margin), and a bfloat16 one by at most one rounding flip (2^-8 = 3.9e-3 relative).
COMPILE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_pending_errors():
    """Every test starts and ends with no error reported by a device-side check."""
    runtime.check_errors()
    yield
    runtime.check_errors()


# ---------------------------------------------------------------------------------------------
# The ops, as cases: make(dtype) -> inputs (float ones require grad), fn(*inputs) -> output
# ---------------------------------------------------------------------------------------------

N, H = 6, 40  # tokens, hidden: odd-ish, small (every row fits one block)
HW = 3000  # a wide hidden size, where an op takes another path (see its kernel's tables)
B, NP, SQ, SK = 2, 3, 5, 24  # attention: batch, heads, queries, keys
V = 50  # vocabulary


def _r(*shape, dtype, grad=True, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda")).to(dtype).requires_grad_(grad)


@dataclass
class Case:
    make: Callable[[torch.dtype], tuple]
    fn: Callable[..., torch.Tensor]
    random: bool = False  # draws a dropout seed
    grad: bool = True  # False: forward only (in-place inference)
    dtypes: tuple = (torch.float32, torch.bfloat16)
    params: Callable[[], list] = lambda: []  # module parameters that receive gradients too


def _bda(p, train):
    f = bias_dropout_add_fused_train if train else bias_dropout_add_fused_inference
    return lambda x, b, r: f((x, b), r, p)


def _bda_inputs(grad):
    return lambda dt: (_r(N, H, dtype=dt, grad=grad), _r(H, dtype=dt, grad=grad), _r(N, H, dtype=dt, grad=grad))


def _fsms(mask_type, **kw):
    mod = FusedScaleMaskSoftmax(False, False, mask_type, True, unfused.attention_mask_func, True, **kw)
    return mod


_CAUSAL = _fsms(AttnMaskType.causal, scale=0.3)
_PADDING = _fsms(AttnMaskType.padding, scale=None)


_SOFTMAX_ONE = SoftmaxOne(-1, 0.5)  # a fixed sink logit
_MODULES: dict[str, torch.nn.Module] = {}


def _sink_module() -> torch.nn.Module:
    """SoftmaxOne with a learnable per-head sink logit (a Parameter), made on first use (CUDA)."""
    if "sink" not in _MODULES:
        _MODULES["sink"] = SoftmaxOne(-1, torch.nn.Parameter(0.5 * torch.randn(NP, device="cuda")))
    return _MODULES["sink"]


def _mask(dtype=None):
    m = torch.rand(B, 1, SQ, SK, device="cuda") < 0.3
    m[0, 0, 1] = True  # one fully masked row: zeros, never NaN
    return m


def _freqs(s, b, rot):
    """Rotary angles [s, b, 1, rot] (float32, no gradient), each angle stored twice as
    RotaryEmbedding stores them."""
    half = torch.rand(s, b, 1, rot // 2, device="cuda") * 6.0
    return torch.cat([half, half], dim=-1)


def _both(y_and_residual):
    """One output holding both of a norm's outputs (y, residual), each with its own gradient
    (stacked: no arithmetic, so compiled and eager round nothing differently)."""
    return torch.stack(y_and_residual)


def _targets():
    t = torch.randint(0, V, (N,), device="cuda")
    t[1] = -100  # ignored
    return t


CASES: dict[str, Case] = {
    "bias_gelu": Case(lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt)), bias_gelu_impl),
    "bias_dropout_add_train_p0.3": Case(_bda_inputs(True), _bda(0.3, True), random=True),
    "bias_dropout_add_train_p0": Case(_bda_inputs(True), _bda(0.0, True)),
    "bias_dropout_add_inference": Case(_bda_inputs(True), _bda(0.3, False)),
    "bias_dropout_add_inference_inplace": Case(_bda_inputs(False), _bda(0.3, False), grad=False),
    "bias_geglu": Case(lambda dt: (_r(N, 2 * H, dtype=dt), _r(2 * H, dtype=dt)), bias_geglu_impl),
    "bias_swiglu": Case(lambda dt: (_r(N, 2 * H, dtype=dt), _r(2 * H, dtype=dt)), bias_swiglu_impl),
    "swiglu_no_bias": Case(lambda dt: (_r(3, 2, 2 * H, dtype=dt),), lambda y: bias_swiglu_impl(y, None)),
    "weighted_bias_swiglu": Case(lambda dt: (_r(N, 2 * H, dtype=dt), _r(N, 1, dtype=torch.float32)),
                                 lambda y, w: weighted_bias_swiglu_impl(y, None, w)),
    "weighted_squared_relu": Case(lambda dt: (_r(N, H, dtype=dt), _r(N, 1, dtype=torch.float32)),
                                  weighted_squared_relu_impl),
    "layer_norm": Case(lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt), _r(H, dtype=dt)),
                       lambda x, w, b: fused_layer_norm(x, w, b, 1e-5)),
    "layer_norm_memory_efficient": Case(lambda dt: (_r(N, H, dtype=dt), (1 + _r(H, dtype=dt, grad=False, scale=0.2))
                                                    .requires_grad_(True), _r(H, dtype=dt, scale=0.1)),
                                        lambda x, w, b: fused_layer_norm(x, w, b, 1e-5, memory_efficient=True)),
    "rms_norm": Case(lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt)), lambda x, w: fused_rms_norm(x, w, 1e-5)),
    # the residual as the norm node's second output (an alias of x): its gradient is added in the kernel
    "layer_norm_with_residual": Case(
        lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt), _r(H, dtype=dt)),
        lambda x, w, b: _both(FusedLayerNormAffineFunction.apply(x, w, b, 1e-5, False, False, True))),
    "rms_norm_with_residual": Case(
        lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt)),
        lambda x, w: _both(FusedRMSNormAffineFunction.apply(x, w, 1e-5, False, False, True))),
    # a sublayer's bias-dropout-add in the next norm: (y, h) from one node, both with gradients
    "bias_dropout_add_layer_norm_p0.3": Case(
        lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt), _r(N, H, dtype=dt), _r(H, dtype=dt), _r(H, dtype=dt)),
        lambda x, lb, r, w, b: _both(BiasDropoutAddNormFunction.apply(x, lb, r, w, b, 1e-5, 0.3, True, False, False)),
        random=True),
    # rows of 2049-4096: x's gradient and the bias's column sum come from the norm's backward kernel
    "bias_dropout_add_layer_norm_wide_p0.2": Case(
        lambda dt: (_r(N, HW, dtype=dt), _r(HW, dtype=dt), _r(N, HW, dtype=dt), _r(HW, dtype=dt), _r(HW, dtype=dt)),
        lambda x, lb, r, w, b: _both(BiasDropoutAddNormFunction.apply(x, lb, r, w, b, 1e-5, 0.2, True, False, False)),
        random=True),
    "bias_dropout_add_rms_norm_p0": Case(
        lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt), _r(N, H, dtype=dt), _r(H, dtype=dt)),
        lambda x, lb, r, w: _both(BiasDropoutAddNormFunction.apply(x, lb, r, w, None, 1e-5, 0.0, True, True, False))),
    "rms_norm_memory_efficient_zero_centered": Case(
        lambda dt: (_r(N, H, dtype=dt), _r(H, dtype=dt, scale=0.1)),
        lambda x, w: fused_rms_norm(x, w, 1e-5, memory_efficient=True, zero_centered_gamma=True)),
    "scaled_upper_triang_masked_softmax": Case(lambda dt: (_r(B * NP, SK, SK, dtype=dt),),
                                               lambda x: ScaledUpperTriangMaskedSoftmax.apply(x, 0.5)),
    "scaled_masked_softmax": Case(lambda dt: (_r(B, NP, SQ, SK, dtype=dt), _mask()),
                                  lambda x, m: ScaledMaskedSoftmax.apply(x, m, 0.5)),
    "scaled_softmax": Case(lambda dt: (_r(B, NP, SQ, SK, dtype=dt),), lambda x: ScaledSoftmax.apply(x, 0.5)),
    "softmax_one_float_offset": Case(lambda dt: (_r(B, NP, SQ, SK, dtype=dt),), lambda x: _SOFTMAX_ONE(x)),
    "softmax_one_learnable_sink": Case(lambda dt: (_r(B, NP, SQ, SK, dtype=dt),), lambda x: _sink_module()(x),
                                       params=lambda: [_sink_module().denominator_offset]),
    "fused_scale_mask_softmax_window_sink": Case(
        lambda dt: (_r(B, NP, SQ, SK, dtype=dt), _mask(), _r(NP, dtype=torch.float32)),
        lambda x, m, o: fused_scale_mask_softmax(x, m, 0.5, window_size=(7, 0), softmax_offset=o)),
    "FusedScaleMaskSoftmax_causal": Case(lambda dt: (_r(B, NP, SK, SK, dtype=dt),), lambda x: _CAUSAL(x, None),
                                         dtypes=(torch.float32,)),
    "FusedScaleMaskSoftmax_padding_sink": Case(
        lambda dt: (_r(B, NP, SQ, SK, dtype=dt), _mask(), _r(NP, dtype=torch.float32)),
        lambda x, m, o: _PADDING(x, m, o), dtypes=(torch.float32,)),
    "softmax_dropout_causal_p0.3": Case(
        lambda dt: (_r(B, NP, SK, SK, dtype=dt),),
        lambda x: fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal, 0.5, 0.3), random=True),
    "rope_half_split": Case(lambda dt: (_r(SQ, B, NP, 40, dtype=dt), _freqs(SQ, 1, 24)),
                            lambda t, f: fused_apply_rotary_pos_emb(t, f)),
    "rope_interleaved_per_sample": Case(lambda dt: (_r(SQ, B, NP, 40, dtype=dt), _freqs(SQ, B, 40)),
                                        lambda t, f: fused_apply_rotary_pos_emb(t, f, interleaved=True)),
    "flash_attention_causal_gqa_padding_sink": Case(
        lambda dt: (_r(B, SK, NP, 40, dtype=dt), _r(B, SK, 1, 40, dtype=dt), _r(B, SK, 1, 40, dtype=dt),
                    _r(NP, dtype=torch.float32), _mask()[:, 0, 0].contiguous()),  # key padding [b, sk]
        lambda q, k, v, s, m: flash_attention(q, k, v, causal=True, attention_mask=m, sinks=s)),
    # the backward with dQ by atomic adds (d = 80); SK keys fit one key tile, so each dQ element
    # gets one atomic add and the graph replay still equals eager bit for bit
    "flash_attention_d80_atomic_dq": Case(
        lambda dt: (_r(B, SQ, NP, 80, dtype=dt), _r(B, SK, 1, 80, dtype=dt), _r(B, SK, 1, 80, dtype=dt)),
        lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=False)),
    # the same at d = 128: on a Hopper GPU each dQ tile is added by a TMA bulk reduction (a tensor
    # descriptor argument: direct launches and graphs take it, a torch.compile trace the pointers)
    "flash_attention_d128_atomic_dq": Case(
        lambda dt: (_r(B, SQ, NP, 128, dtype=dt), _r(B, SK, 1, 128, dtype=dt), _r(B, SK, 1, 128, dtype=dt)),
        lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=False)),
    # the deterministic embedding gradient (ids repeat, so runs of equal ids are summed)
    "embedding_deterministic_grad": Case(lambda dt: (_r(V, H, dtype=dt), torch.randint(0, 7, (3, N), device="cuda")),
                                         lambda w, ids: _EmbeddingDeterministicGrad.apply(ids, w)),
    "vocab_parallel_cross_entropy": Case(lambda dt: (_r(N, V, dtype=dt, scale=3.0), _targets()),
                                         lambda x, t: vocab_parallel_cross_entropy(x, t, 0.1)),
    "fused_vocab_parallel_cross_entropy": Case(lambda dt: (_r(N, V, dtype=dt, scale=3.0), _targets()),
                                               lambda x, t: fused_vocab_parallel_cross_entropy(x, t)),
}
ALL_CASES = sorted(CASES)


def _clone(inputs):
    out = []
    for t in inputs:
        c = t.detach().clone()
        out.append(c.requires_grad_(t.requires_grad) if t.is_floating_point() else c)
    return tuple(out)


def _close(actual, expected, dtype):
    atol, rtol = COMPILE_TOL[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False)


def _weights(out):
    # a fixed random weighting of the outputs, so that no gradient is trivially 1
    return torch.randn(out.shape, device=out.device, dtype=torch.float32)


def _cases_and_dtypes(all_dtypes=True, grad_only=False):
    return [pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}") for n in ALL_CASES
            if CASES[n].grad or not grad_only
            for dt in (CASES[n].dtypes if all_dtypes else (torch.float32,))]


def _diff(case, inputs):
    """What gets a gradient: the inputs that require one, then the module parameters."""
    return [t for t in inputs if t.is_floating_point() and t.requires_grad] + case.params()


# ---------------------------------------------------------------------------------------------
# (a) the forward, torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("name, dtype", _cases_and_dtypes(all_dtypes=False))
def test_forward_compiles_with_fullgraph_and_equals_eager(name, dtype):
    case = CASES[name]
    case.params()  # modules with parameters are made outside the compiled region
    inputs = case.make(dtype)
    compiled = torch.compile(case.fn, fullgraph=True)
    with inductor_config.patch(fallback_random=True):  # the seed drawn as eager draws it
        a, b = _clone(inputs), _clone(inputs)
        compiled(*_clone(inputs))  # compile once; the comparison below is a cached call
        torch.manual_seed(1234)
        got = compiled(*a)
        torch.manual_seed(1234)
        want = case.fn(*b)
    _close(got, want, dtype)
    if not case.grad:  # in-place inference: the result is written into x
        assert torch.equal(a[0], got) and torch.equal(b[0], want)


# ---------------------------------------------------------------------------------------------
# (b) a whole step, forward and backward, in torch.compile
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("name, dtype", _cases_and_dtypes(grad_only=True))
def test_whole_step_compiles_and_equals_eager(name, dtype):
    case = CASES[name]
    case.params()  # modules with parameters are made outside the compiled region
    inputs = case.make(dtype)
    w = _weights(case.fn(*_clone(inputs)))

    def step(*args):
        out = case.fn(*args)
        (out.float() * w).sum().backward()
        return out

    def run(fn, args, seed):
        for p in case.params():
            p.grad = None
        torch.manual_seed(seed)
        out = fn(*args)
        grads = _diff(case, args)
        assert all(t.grad is not None for t in grads), "a gradient is missing"
        return out, [t.grad.clone() for t in grads]

    compiled = torch.compile(step)
    with inductor_config.patch(fallback_random=True):
        run(compiled, _clone(inputs), 0)  # compile
        got, got_grads = run(compiled, _clone(inputs), 99)
        want, want_grads = run(step, _clone(inputs), 99)
    _close(got, want, dtype)
    for ga, gb in zip(got_grads, want_grads):
        _close(ga, gb, ga.dtype)


# ---------------------------------------------------------------------------------------------
# (c) CUDA graph of forward and backward, replayed on new data
# ---------------------------------------------------------------------------------------------


def _capture(step, warmups=3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with collector_paused_for_capture(), torch.cuda.graph(g):
        result = step()
    return g, result


def _copy_into(static, new):
    with torch.no_grad():
        for s, n in zip(static, new):
            s.copy_(n)


@needs_cuda
@pytest.mark.parametrize("name, dtype", _cases_and_dtypes())
def test_cuda_graph_of_forward_and_backward_replays_on_new_data(name, dtype):
    case = CASES[name]
    static = case.make(dtype)
    diff = _diff(case, static)
    with torch.no_grad():  # a probe graph kept alive would pin the leaves' gradient
        probe = case.fn(*_clone(static))  # accumulators to this stream (not the capture's)
    g_out = torch.randn(probe.shape, device="cuda", dtype=probe.dtype)
    fresh = case.make(dtype)  # the same inputs' own values: not aliased by the graph

    def step():
        if not case.grad:
            return (case.fn(*static),)
        out = case.fn(*static)
        return (out, *torch.autograd.grad(out, diff, g_out))

    if not case.grad:
        _copy_into(static, fresh)  # the in-place path overwrites x: refill before each use
    graph, result = _capture(step)
    new = case.make(dtype)
    _copy_into(static, new)
    _copy_into(case.params(), [torch.randn_like(p) for p in case.params()])
    graph.replay()
    torch.cuda.synchronize()

    ref_in = _clone(new)
    if case.random and name.startswith("softmax_dropout"):
        # the graph's own seed: its keep mask is where the output is nonzero (p > 0 on and below
        # the diagonal); the output and dx must be the float64 definition's with that mask, and
        # the kept fraction 1 - p' within 5 standard deviations over the unmasked positions
        out, dx = result
        x = static[0].detach().double()
        p_applied = drop_threshold(0.3) / 65536
        visible = torch.ones(SK, SK, device="cuda", dtype=torch.bool).tril().expand_as(x)
        keep = (out != 0) & visible
        xr = x.clone().requires_grad_(True)
        want = unfused.masked_softmax_dropout_reference(xr, ~visible, 0.5, keep, p_applied)
        (want_dx,) = torch.autograd.grad(want, xr, g_out.double())
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)
        torch.testing.assert_close(out.double(), want.detach(), atol=atol, rtol=rtol)
        torch.testing.assert_close(dx.double(), want_dx, atol=atol, rtol=rtol)
        n = int(visible.sum())
        assert abs(keep.sum().item() / n - (1 - p_applied)) <= 5 * math.sqrt(p_applied * (1 - p_applied) / n)
        return
    if case.random and name.startswith("bias_dropout_add_layer_norm"):
        # the graph's own seed, as below: h = r + keep·(x + lb)·s with the mask read off x's
        # gradient (dres·keep·s), and y the LayerNorm of h as stored
        out, dx, dlb, dr, dw, db = result
        x, lb, r, w, b = (t.detach().float() for t in static)
        p = float(name.rsplit("_p", 1)[1])  # the case's dropout probability
        s = dropout_scale(p)
        keep = (dx != 0).float()
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
        torch.testing.assert_close(out[1].float(), r + keep * (x + lb) * s, **tol)
        torch.testing.assert_close(out[0].float(), F.layer_norm(out[1].float(), (x.shape[-1],), w, b, 1e-5), **tol)
        assert torch.equal(dx, (dr.float() * keep * s).to(dx.dtype))
        assert abs(keep.mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / keep.numel())
        return
    if case.random:
        # another seed than eager's: check the graph's own mask instead. out = r + keep·(x + b)·s
        # with keep in {0, 1} per element, the backward's mask is the forward's (dx = g·keep·s),
        # and the kept fraction is 1 - p within 5 standard deviations.
        out, dx, db, dr = result
        x, b, r = (t.detach().float() for t in static)
        s = dropout_scale(0.3)
        keep = (dx != 0).float()  # g_out is never exactly 0
        torch.testing.assert_close(out.float(), r + keep * (x + b) * s, atol=1e-5, rtol=1e-5) if dtype == torch.float32 \
            else torch.testing.assert_close(out.float(), r + keep * (x + b) * s, atol=2e-2, rtol=1.6e-2)
        assert torch.equal(dx, (g_out.float() * keep * s).to(dx.dtype))
        assert torch.equal(dr, g_out)
        n = keep.numel()
        assert abs(keep.mean().item() - 0.7) <= 5 * math.sqrt(0.3 * 0.7 / n)
        return
    if case.grad:
        out = case.fn(*ref_in)
        want = (out, *torch.autograd.grad(out, _diff(case, ref_in), g_out))
    else:
        want = (case.fn(*ref_in),)
    for got_t, want_t in zip(result, want):
        assert torch.equal(got_t, want_t), f"{name}: graph replay differs from eager on the same data"


# ---------------------------------------------------------------------------------------------
# (d) no host sync in any forward or backward
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("name", ALL_CASES)
def test_eager_forward_and_backward_never_synchronize(name):
    case = CASES[name]
    inputs = case.make(torch.float32)
    diff = _diff(case, inputs)

    def run():
        out = case.fn(*inputs)
        if case.grad:
            torch.autograd.grad(out, diff, torch.ones_like(out))

    run()  # warm-up: Triton compiles, the check buffer is allocated (no sync either, but first calls do more)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            run()
    finally:
        torch.cuda.set_sync_debug_mode(old)


# ---------------------------------------------------------------------------------------------
# The device-side checks: cross-entropy targets
# ---------------------------------------------------------------------------------------------

CE = {"unfused": vocab_parallel_cross_entropy, "fused": fused_vocab_parallel_cross_entropy}
CE_OP = {"unfused": "vocab_parallel_cross_entropy", "fused": "fused_vocab_parallel_cross_entropy"}


def _ce_bad_inputs(device, bad):
    x = (3 * torch.randn(5, 11, device=device)).requires_grad_(True)
    t = torch.randint(0, 11, (5,), device=device)
    t[0] = -100
    t[3] = bad
    return x, t


def _ce_message(path, bad, vocab=11):
    return rf"^{CE_OP[path]}: target must hold vocabulary ids in \[0, {vocab}\) or ignore_index=-100, got {bad} "


def _check_ce_rows(x, t, loss, bad_row=3):
    """The bad row's loss is NaN, every other row equals F.cross_entropy (float64)."""
    assert torch.isnan(loss[bad_row])
    keep = torch.arange(len(t), device=t.device) != bad_row
    ref = F.cross_entropy(x.detach().double()[keep], t[keep], reduction="none")
    # float32 loss from float32 logits: log-sum-exp over 11 terms, a few float32 roundings
    torch.testing.assert_close(loss[keep].double(), ref, atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("path", CE)
@pytest.mark.parametrize("bad", (11, 1000, -2))
def test_bad_target_gives_nan_at_once_and_a_valueerror_later_on_cuda(path, bad):
    x, t = _ce_bad_inputs("cuda", bad)
    loss = CE[path](x, t)  # no host sync, so no error yet
    with pytest.raises(ValueError, match=_ce_message(path, bad)):
        runtime.check_errors()
    runtime.check_errors()  # reported once
    _check_ce_rows(x, t, loss)
    # the gradient of the bad row is NaN too, the others are softmax - onehot
    loss.backward(torch.ones_like(loss))
    assert torch.isnan(x.grad[3]).all() and torch.isfinite(x.grad[[1, 2, 4]]).all()
    assert (x.grad[0] == 0).all()  # ignored row


@needs_cuda
@pytest.mark.parametrize("path", CE)
def test_bad_target_is_reported_at_a_later_fusedlib_call(path):
    x, t = _ce_bad_inputs("cuda", 11)
    CE[path](x, t)
    torch.cuda.synchronize()  # the kernel has stored the bad id
    y, b = torch.randn(4, 8, device="cuda"), torch.randn(8, device="cuda")
    with pytest.raises(ValueError, match=_ce_message(path, 11)):
        bias_gelu_impl(y, b)  # any later launch polls, without waiting
    bias_gelu_impl(y, b)  # reported once


@needs_cuda
@pytest.mark.parametrize("path", CE)
def test_bad_target_raises_inside_the_call_with_sync_checks(path, monkeypatch):
    monkeypatch.setattr(runtime, "SYNC_CHECKS", True)
    x, t = _ce_bad_inputs("cuda", -7)
    with pytest.raises(ValueError, match=_ce_message(path, -7)):
        CE[path](x, t)
    t[3] = 4
    CE[path](x, t)  # good targets: no error


@needs_cpu_kernels
@pytest.mark.parametrize("path", CE)
@pytest.mark.parametrize("bad", (11, -2))
def test_bad_target_raises_inside_the_call_on_cpu(path, bad):
    x, t = _ce_bad_inputs("cpu", bad)
    with pytest.raises(ValueError, match=_ce_message(path, bad)):
        CE[path](x, t)
    runtime.check_errors()  # nothing left pending
    t[3] = 5
    CE[path](x, t)


@needs_cuda
@pytest.mark.parametrize("path", CE)
def test_bad_target_under_torch_compile_is_nan_only(path):
    # Inside torch.compile the check is not compiled in: NaN is the signal (documented).
    x, t = _ce_bad_inputs("cuda", 11)
    loss = torch.compile(CE[path], fullgraph=True)(x, t)
    torch.cuda.synchronize()
    runtime.check_errors()  # nothing recorded
    _check_ce_rows(x, t, loss)


@needs_cuda
@pytest.mark.parametrize("path", CE)
def test_bad_target_in_a_cuda_graph_replay_is_reported(path):
    # A graph captured in eager mode keeps the check: a replay on bad data is reported too.
    x, t = _ce_bad_inputs("cuda", 3)  # a valid id for the capture
    step = lambda: CE[path](x, t)  # noqa: E731
    graph, loss = _capture(step)
    with torch.no_grad():
        t[3] = 11
    graph.replay()
    with pytest.raises(ValueError, match=_ce_message(path, 11)):
        runtime.check_errors()
    _check_ce_rows(x, t, loss)


# ---------------------------------------------------------------------------------------------
# The device-side checks: a zero gamma with the memory-efficient norms
# ---------------------------------------------------------------------------------------------

NORMS = {"layer": (fused_layer_norm, "fused_layer_norm"), "rms": (fused_rms_norm, "fused_rms_norm")}


def _norm_inputs(norm, device, zero_centered, gamma5=0.0):
    x = (2 * torch.randn(4, 33, device=device) + 0.5).requires_grad_(True)
    # |gamma| in [0.5, 1.5] but in column 5, where it is gamma5 (0): x_hat = (y - beta) / gamma is
    # then recovered to ~ulp(y) / 0.5 elsewhere
    gamma = torch.where(torch.rand(33, device=device) < 0.5, -1.0, 1.0) * (0.5 + torch.rand(33, device=device))
    gamma[5] = gamma5
    w = gamma - 1 if zero_centered else gamma  # stored zero-centered: gamma = w + 1
    b = torch.randn(33, device=device).requires_grad_(True) if norm == "layer" else None
    return x, w.requires_grad_(True), b


def _apply_norm(norm, x, w, b, **kw):
    fn = NORMS[norm][0]
    return fn(x, w, b, 1e-5, **kw) if norm == "layer" else fn(x, w, 1e-5, **kw)


def _gamma_message(norm, zero_centered):
    gamma = r"weight\[5\] \+ 1" if zero_centered else r"weight\[5\]"
    return rf"^{NORMS[norm][1]}: memory_efficient=True needs every gamma != 0 .* got gamma = {gamma} = 0 or subnormal"


def _check_norm_nan(norm, x, w, b, y):
    """The backward from y: dgamma of column 5 and dx are NaN; the other dgammas and dbeta exact."""
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.isnan(w.grad[5]) and torch.isnan(x.grad).all()
    keep = torch.arange(33, device=w.device) != 5
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    if norm == "layer":
        _, dw64, db64 = unfused.layer_norm_back(dy64, x64, w64, 1e-5, False)
        torch.testing.assert_close(b.grad.double(), db64, atol=1e-5, rtol=1e-5)  # sum of 4 dy: exact-ish
    else:
        _, dw64 = unfused.rms_norm_back(dy64, x64, w64, 1e-5, False)
    # dgamma = sum over 4 rows of dy·x_hat; x_hat recovered from y (float32, |y| < ~10) errs by
    # <= 10·2^-24 / 0.5 = 1.2e-6, times |dy| < ~4, times 4 rows: < 2e-5
    torch.testing.assert_close(w.grad[keep].double(), dw64[keep], atol=1e-4, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zero_centered", (False, True))
def test_zero_gamma_memory_efficient_reports_lazily_on_cuda(norm, zero_centered):
    x, w, b = _norm_inputs(norm, "cuda", zero_centered)
    y = _apply_norm(norm, x, w, b, memory_efficient=True, zero_centered_gamma=zero_centered)
    with pytest.raises(ValueError, match=_gamma_message(norm, zero_centered)):
        runtime.check_errors()
    if not zero_centered:
        _check_norm_nan(norm, x, w, b, y)
    # without memory_efficient the same weight is fine: x is saved, no division by gamma
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    y = _apply_norm(norm, x, w, b, zero_centered_gamma=zero_centered)
    y.sum().backward()
    runtime.check_errors()
    assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()


@needs_cuda
@pytest.mark.parametrize("norm", NORMS)
def test_zero_gamma_memory_efficient_raises_inside_the_call_with_sync_checks(norm, monkeypatch):
    monkeypatch.setattr(runtime, "SYNC_CHECKS", True)
    x, w, b = _norm_inputs(norm, "cuda", False)
    with pytest.raises(ValueError, match=_gamma_message(norm, False)):
        _apply_norm(norm, x, w, b, memory_efficient=True)


@needs_cpu_kernels
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zero_centered", (False, True))
def test_zero_gamma_memory_efficient_raises_inside_the_call_on_cpu(norm, zero_centered):
    x, w, b = _norm_inputs(norm, "cpu", zero_centered)
    with pytest.raises(ValueError, match=_gamma_message(norm, zero_centered)):
        _apply_norm(norm, x, w, b, memory_efficient=True, zero_centered_gamma=zero_centered)
    runtime.check_errors()
    _apply_norm(norm, x, w, b, memory_efficient=False, zero_centered_gamma=zero_centered).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@needs_cpu_kernels
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("gamma5", (1e-39, -1e-41, 1e-45))
def test_subnormal_gamma_memory_efficient_raises_inside_the_call_on_cpu(norm, gamma5):
    # 1 / gamma overflows float32 for a subnormal gamma: the backward's dgamma and dx were NaN
    # without a word; the forward's check treats it as 0
    x, w, b = _norm_inputs(norm, "cpu", False, gamma5)
    assert w[5] != 0
    with pytest.raises(ValueError, match=_gamma_message(norm, False)):
        _apply_norm(norm, x, w, b, memory_efficient=True)
    runtime.check_errors()
    w2 = w.detach().clone()
    w2[5] = torch.finfo(torch.float32).tiny  # the smallest accepted: a finite backward
    w2.requires_grad_(True)
    y = _apply_norm(norm, x, w2, b, memory_efficient=True)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w2.grad).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy warns at 0 * inf: the point
@pytest.mark.parametrize("norm", NORMS)
def test_zero_gamma_memory_efficient_backward_kernels_give_nan_not_a_wrong_value(norm):
    # the kernels alone, without the check (as under torch.compile), on the test device
    rms = norm == "rms"
    x = torch.randn(4, 33, device=DEVICE)
    w = torch.randn(33, device=DEVICE)
    w[5] = 0.0
    b = None if rms else torch.randn(33, device=DEVICE)
    y, mean, rstd = norm_fwd(x, w, b, 1e-5, rms_norm=rms)
    dx, dw, db = norm_bwd(torch.randn_like(y), y, w, b, mean, rstd, rms_norm=rms, memory_efficient=True)
    assert torch.isnan(dw[5]) and torch.isnan(dx).all()
    assert torch.isfinite(dw[torch.arange(33, device=DEVICE) != 5]).all()
    assert db is None or torch.isfinite(db).all()


def test_bad_target_kernels_give_nan_not_a_wrong_value():
    # the kernels alone, without the check (as under torch.compile), on the test device: the
    # finished loss and lse (one rank), the shard statistics (several ranks) and the gradient
    x = torch.randn(5, 33, device=DEVICE)
    t = torch.tensor([1, 40, -3, -100, 32], device=DEVICE)  # 40 and -3 are bad, -100 ignored
    loss, lse = cross_entropy_fwd(x, t, finalize=True)
    bad = torch.tensor([False, True, True, False, False], device=DEVICE)
    assert torch.isnan(loss[bad]).all() and torch.isnan(lse[bad]).all()
    assert torch.isfinite(loss[~bad]).all() and loss[3] == 0
    stats = cross_entropy_fwd(x, t, 0, -100, 0.0, 33)
    assert torch.isnan(stats[1:3, bad]).all() and torch.isfinite(stats[1:3, ~bad]).all()
    dx = cross_entropy_bwd(x, t, lse, torch.ones(5, device=DEVICE))
    assert torch.isnan(dx[bad]).all() and torch.isfinite(dx[~bad]).all()


# ---------------------------------------------------------------------------------------------
# The mechanism itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), (" TRUE ", True), ("0", False), ("", False),
                                             ("false", False), ("off", False), ("N", False)])
def test_sync_checks_flag_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("FUSEDLIB_SYNC_CHECKS", value)
    assert launch_layer.env_flag("FUSEDLIB_SYNC_CHECKS", False) is expected


@pytest.mark.parametrize("name", ["FUSEDLIB_SYNC_CHECKS", "FUSEDLIB_DIRECT_LAUNCH", "FUSEDLIB_CHECK_LAUNCH",
                                  "FUSEDLIB_BENCH_STORED"])
def test_a_switch_set_to_a_value_it_cannot_read_stops_fusedlib_naming_it(name):
    # "2", "of" (a typo of "off") or "enable" were read as on (or, for FUSEDLIB_BENCH_STORED,
    # anything but "1" as off): fusedlib now stops with the variable's name and its values, on
    # any machine (at the import; FUSEDLIB_BENCH_STORED where the book asks for it)
    code = "import fusedlib, fusedlib.book; fusedlib.book.measure_live()"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[name] = "of"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0, res.stdout
    assert f"ValueError: environment variable {name}='of': expected one of 1, true" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("value", ["2", "enable", "0.0", "f"])
def test_env_flag_refuses_what_it_cannot_read(monkeypatch, value):
    monkeypatch.setenv("FUSEDLIB_SYNC_CHECKS", value)
    with pytest.raises(ValueError, match=f"FUSEDLIB_SYNC_CHECKS={value!r}: expected one of .* \\(on\\) or .* \\(off\\), or unset"):
        launch_layer.env_flag("FUSEDLIB_SYNC_CHECKS", False)


@pytest.mark.parametrize("value, live", [("1", False), ("true", False), ("0", True), ("", True)])
def test_measure_live_reads_fusedlib_bench_stored(monkeypatch, value, live):
    import fusedlib.book as book

    monkeypatch.setenv("FUSEDLIB_BENCH_STORED", value)
    monkeypatch.setattr(book, "CUDA_AVAILABLE", True)
    assert book.measure_live() is live
    monkeypatch.setattr(book, "CUDA_AVAILABLE", False)
    assert book.measure_live() is False


def test_sync_checks_is_set_at_import_from_the_environment():
    code = "import fusedlib; print(fusedlib.runtime.SYNC_CHECKS)"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), FUSEDLIB_SYNC_CHECKS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "True", (res.stdout, res.stderr[-2000:])


def test_check_errors_is_a_no_op_when_nothing_is_pending():
    runtime.check_errors()
    runtime.check_errors()


# ---------------------------------------------------------------------------------------------
# Kernels compile with their int arguments as constants (torch.compile's Inductor does that)
# ---------------------------------------------------------------------------------------------


def test_kernels_compile_for_sm90_with_int_arguments_as_constants():
    # Inductor's analysis of which tensors a user kernel writes (and its compile of the kernel)
    # may pass the int arguments as plain Python constants: `T.to(tl.uint32)` on the dropout
    # threshold then failed ("'int' object has no attribute 'to'") and bias-dropout-add's
    # backward could not compile. Compiles each kernel for sm_90 (no GPU needed) with every int
    # argument once as a constant and once as an i32, and the new check paths (CHECK, CHECK_GAMMA).
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import fusedlib.kernels.bias_dropout_add as bda
        import fusedlib.kernels.cross_entropy as ce
        import fusedlib.kernels.layer_norm as ln

        PTR = {"SEED_ptr": "*i64", "TARGET_ptr": "*i64", "ERR_ptr": "*i64", "MASK_ptr": "*i8"}
        INTS = {"T": 6554, "n_rows": 7, "n_cols": 40, "rows_per_program": 8, "vocab_start_index": 0,
                "vocab_size": 40, "ignore_index": -100}

        def compile_(fn, consts, as_constants):
            sig, cx = {}, {}
            for a in fn.arg_names:
                p = fn.params[fn.arg_names.index(a)]
                if p.is_constexpr:
                    sig[a], cx[a] = "constexpr", consts[a]
                elif a.endswith("_ptr"):
                    sig[a] = PTR.get(a, "*fp32")
                elif a == "scale":
                    sig[a] = consts.get("scale type", "fp32")
                elif a == "eps":
                    sig[a] = "fp32"
                elif as_constants:
                    sig[a], cx[a] = "constexpr", consts.get(a, INTS.get(a, 3))
                else:
                    sig[a] = "i32"
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})

        drop = {"HAS_BIAS": True, "DROPOUT": True, "BLOCK_M": 4, "BLOCK_N": 64, "ACC": tl.float32,
                "STORE_DX": True, "HAS_DBIAS": True, "NUM_STAGES": 3}  # (the backward's row loop pipelined)
        cases = {
            "bda fwd": (bda._bias_dropout_add_fwd_kernel, drop),
            "bda bwd": (bda._bias_dropout_add_bwd_kernel, drop),
            "dropout mask": (bda._dropout_mask_kernel, drop),
            "ce fwd finalize check": (ce._cross_entropy_fwd_kernel, {"BLOCK_M": 4, "BLOCK_N": 64, "ACC": tl.float32,
                                      "SMOOTHING": True, "FINALIZE": True, "CHECK": True}),
            "ce fwd stats check": (ce._cross_entropy_fwd_kernel, {"BLOCK_M": 1, "BLOCK_N": 64, "ACC": tl.float32,
                                   "SMOOTHING": False, "FINALIZE": False, "CHECK": True}),
            "norm fwd check gamma": (ln._norm_fwd_kernel, {"BLOCK_M": 2, "BLOCK_N": 64, "IS_RMS_NORM": False,
                                     "HAS_BIAS": True, "ZERO_CENTERED_GAMMA": True, "NUM_STAGES": 1,
                                     "ACC": tl.float32, "CHECK_GAMMA": True, "ADD_IN": False, "HAS_LB": False,
                                     "DROPOUT": False, "STORE_STATS": True}),
            # the bias-dropout-add in the norm: its dropout threshold T is an int argument too
            "norm fwd add in": (ln._norm_fwd_kernel, {"BLOCK_M": 2, "BLOCK_N": 64, "IS_RMS_NORM": False,
                                "HAS_BIAS": True, "ZERO_CENTERED_GAMMA": False, "NUM_STAGES": 1,
                                "ACC": tl.float32, "CHECK_GAMMA": False, "ADD_IN": True, "HAS_LB": True,
                                "DROPOUT": True, "STORE_STATS": True, "scale type": "fp64"}),
            # scale as float64, as Inductor passes a float argument: the loop-carried bias sum must
            # stay float32
            "norm bwd add in": (ln._norm_bwd_kernel, {"BLOCK_M": 2, "BLOCK_N": 64, "IS_RMS_NORM": False,
                                "HAS_BIAS": True, "ZERO_CENTERED_GAMMA": False, "MEMORY_EFFICIENT": False,
                                "SPLIT": False, "NUM_STAGES": 2, "ACC": tl.float32, "HAS_DRES": True,
                                "HAS_DLB": True, "DLB_ROW": 2, "DROPOUT": True, "STORE_DXIN": True,
                                "scale type": "fp64"}),
        }
        for name, (fn, consts) in cases.items():
            for as_constants in (True, False):
                compile_(fn, consts, as_constants)
            print(name, "compiled")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and res.stdout.count("compiled") == 8, (res.stdout, res.stderr[-4000:])


def test_flash_attention_kernels_compile_for_sm90():
    # FlashAttention's kernels compiled for sm_90 without a GPU, at the H200 tables' d = 128
    # tiles in bf16: the forward with dropout and sinks (its own table), the atomic dQ form with
    # dropout (the dK/dV kernel's largest variant; with element atomics and with TMA bulk
    # reductions), the deterministic dQ kernel with a per-(query, key) mask, the three kernels
    # that read their streamed tiles by TMA loads (descriptors of [1, rows, 1, d] boxes; the
    # backward's two with dropout, the forms TMA_LOADS takes at d = 128; the dQ kernel also
    # computing Delta, as it does when it runs first), and the
    # small kernels around them; the three tiled kernels in the order of programs a causal
    # band takes (SCHEDULE_HEADS's groups); their shared memory within the H200's 227 KB per block
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import fusedlib.kernels.flash_attention as fa
        from fusedlib.kernels.launch import pick  # the table's tile (attention_tile gives the interpreter's here)

        PTR = {n: "*bf16" for n in ("Q_ptr", "K_ptr", "V_ptr", "DO_ptr", "DK_ptr", "DV_ptr", "DQ_ptr", "O_ptr")}
        PTR.update({"SEED_ptr": "*i64", "MASK_ptr": "*u8"})

        def compile_(name, fn, consts, tile):
            sig, cx = {}, {}
            for a in fn.arg_names:
                if fn.params[fn.arg_names.index(a)].is_constexpr:
                    sig[a], cx[a] = "constexpr", consts.get(a, fn.params[fn.arg_names.index(a)].default)
                elif a.endswith("_ptr"):
                    sig[a] = PTR.get(a, "*fp32")
                else:
                    sig[a] = "fp32" if a in ("qk_scale", "keep_scale", "sm_scale") else "i32"
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
            assert k.metadata.shared <= 232448, (name, k.metadata.shared)
            print(name, "compiled", tile)

        # the programs in the order a causal band takes at d = 128 (_scheduled_tile): groups of
        # heads, the query-block kernels' blocks reversed
        head = dict(HEAD_DIM=128, BLOCK_D=128, DOT=tl.bfloat16, PRECISION="tf32",
                    GROUP_HEADS=dict(fa.SCHEDULE_HEADS)[128])
        t = pick(fa.FWD_DROPOUT_TILES, 128, resolve_block_n=False)
        compile_("fwd dropout", fa._flash_fwd_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=0, HAS_SINK=True, DROPOUT=True,
                      REVERSE_BLOCKS=True), t)
        t = pick(fa.BWD_ATOMIC_TILES, 128, resolve_block_n=False)
        compile_("dkdv atomic dropout", fa._flash_bwd_dkdv_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=0, DROPOUT=True, ATOMIC_DQ=True,
                      DQ_TMA=False), t)
        PTR["DQACC_ptr"] = "tensordesc<fp32[1,%d,128]>" % t.BLOCK_M  # the dQ tiles by TMA bulk reductions
        compile_("dkdv atomic dropout tma", fa._flash_bwd_dkdv_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=0, DROPOUT=True, ATOMIC_DQ=True,
                      DQ_TMA=True), t)
        del PTR["DQACC_ptr"]
        t = pick(fa.BWD_DQ_TILES, 128, resolve_block_n=False)
        compile_("dq 4d mask", fa._flash_bwd_dq_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=2, DROPOUT=False, REVERSE_BLOCKS=True), t)
        # the TMA tile loads (LOADS_BY_TMA): [b, s, h, d] descriptors of [1, rows, 1, d] boxes
        PTR["K_ptr"] = PTR["V_ptr"] = "tensordesc<bf16[1,%d,1,128]>" % t.BLOCK_N
        compile_("dq tma loads dropout delta", fa._flash_bwd_dq_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=0, DROPOUT=True, KV_TMA=True,
                      DELTA_IN_DQ=True), t)
        t = pick(fa.FWD_TILES, 128, resolve_block_n=False)
        PTR["K_ptr"] = PTR["V_ptr"] = "tensordesc<bf16[1,%d,1,128]>" % t.BLOCK_N
        compile_("fwd tma loads", fa._flash_fwd_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=1, HAS_SINK=True, DROPOUT=False,
                      KV_TMA=True, REVERSE_BLOCKS=True), t)
        PTR["K_ptr"] = PTR["V_ptr"] = "*bf16"
        t = pick(fa.BWD_DKDV_TILES, 128, resolve_block_n=False)
        PTR["Q_ptr"] = PTR["DO_ptr"] = "tensordesc<bf16[1,%d,1,128]>" % t.BLOCK_M
        compile_("dkdv tma loads dropout", fa._flash_bwd_dkdv_kernel,
                 dict(head, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, MASK_KIND=0, DROPOUT=True, ATOMIC_DQ=False,
                      QDO_TMA=True), t)
        PTR["Q_ptr"] = PTR["DO_ptr"] = "*bf16"
        small = fa.Tile(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1)
        compile_("preprocess", fa._flash_bwd_preprocess_kernel,
                 dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_M=64, HAS_SINK=True, ZERO_DQACC=True), small)
        compile_("dq convert", fa._flash_bwd_dq_convert_kernel, dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_M=64), small)
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and res.stdout.count("compiled") == 9, (res.stdout, res.stderr[-4000:])
