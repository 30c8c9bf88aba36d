"""fused_dense_gelu_dense: the MLP with bias-GeLU in cuBLASLt's GEMM epilogues (CUDA) or through
fusedlib's bias-GeLU kernels (elsewhere), against a float64 reference."""
from __future__ import annotations

import ctypes
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from fusedlib.backends import cublaslt
from fusedlib.checks import is_dense
from fusedlib.fusions import fused_dense
from fusedlib.fusions.fused_dense import fused_dense_gelu_dense
from fusedlib.runtime import collector_paused_for_capture

from conftest import DEVICE, FLOAT_DTYPES, assert_close  # noqa: I001

CUDA = DEVICE.type == "cuda"
needs_cublaslt = pytest.mark.skipif(not CUDA, reason="cuBLASLt's epilogues need a CUDA device")


def _gelu_tanh(z):
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def _inputs(lead, k, f, h, dtype, bias2=True):
    """x ~ N(0, 1), weights scaled by 1/sqrt(fan-in), biases ~ N(0, 1): every output O(1)."""
    def r(*shape, scale=1.0):
        return (scale * torch.randn(shape, device=DEVICE, dtype=torch.float32)).to(dtype).requires_grad_(True)
    return (r(*lead, k), r(f, k, scale=k ** -0.5), r(f), r(h, f, scale=f ** -0.5), r(h) if bias2 else None)


def _reference(x, w1, b1, w2, b2, g):
    """Output and the five gradients in float64."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in (x, w1, b1, w2, b2)]
    x64, w164, b164, w264, b264 = leaves
    out = F.linear(_gelu_tanh(F.linear(x64, w164, b164)), w264, b264)
    out.backward(g.double())
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def _check(x, w1, b1, w2, b2, dtype, epilogue=None):
    before = [t.detach().clone() if t is not None else None for t in (x, w1, b1, w2, b2)]
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=epilogue)
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], w2.shape[0])
    g = torch.randn(out.shape, device=DEVICE, dtype=torch.float32).to(dtype)
    out.backward(g)
    ref, grads = _reference(x, w1, b1, w2, b2, g)
    rows = max(1, math.prod(x.shape[:-1]))
    # the output and dx carry two more roundings than one kernel's (the pre-activation z and the
    # activation y, each to the input dtype, before the next GEMM): scale 3; the weight and bias
    # gradients sum over the rows: sqrt(rows) more
    assert_close(out, ref, dtype, scale=3)
    assert_close(x.grad, grads[0], dtype, scale=3)
    for t, ref_grad in zip((w1, b1, w2, b2), grads[1:]):
        if t is not None:
            assert t.grad.dtype == dtype
            assert_close(t.grad, ref_grad, dtype, scale=3 * rows ** 0.5)
    for t, b in zip((x, w1, b1, w2, b2), before):
        if t is not None:
            assert torch.equal(t.detach(), b), "an input was modified"


@pytest.mark.parametrize("epilogue", [None, True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lead,k,f,h", [((1,), 8, 16, 8), ((37,), 24, 72, 40), ((5, 3), 16, 40, 24),
                                        ((9,), 20, 36, 12), ((4,), 1, 1, 1)])
def test_forward_backward_against_float64(dtype, lead, k, f, h, epilogue):
    # (9, 20, 36, 12): widths not multiples of 8, cuBLASLt refuses them: the unfused path on CUDA too
    _check(*_inputs(lead, k, f, h, dtype), dtype, epilogue)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_without_fc2_bias(dtype):
    x, w1, b1, w2, _ = _inputs((13,), 16, 48, 24, dtype, bias2=False)
    _check(x, w1, b1, w2, None, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_input(dtype):
    x, w1, b1, w2, b2 = _inputs((6, 4), 16, 32, 16, dtype)
    xt = x.detach().transpose(0, 1).requires_grad_(True)  # [4, 6, 16], strided
    assert not xt.is_contiguous()
    _check(xt, w1, b1, w2, b2, dtype)


def test_frozen_weights_and_no_grad():
    x, w1, b1, w2, b2 = _inputs((11,), 16, 32, 8, torch.float32)
    w1.requires_grad_(False)
    b2.requires_grad_(False)
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    out.sum().backward()
    assert w1.grad is None and b2.grad is None and x.grad is not None and b1.grad is not None
    with torch.no_grad():
        again = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    assert again.grad_fn is None and torch.equal(again, out.detach())


def test_weights_get_their_gradients_when_the_input_needs_none():
    # the first layer of a model: its input (token embeddings fed in as data) needs no gradient,
    # yet every weight and bias must receive theirs
    x, w1, b1, w2, b2 = _inputs((7,), 16, 24, 8, torch.float32)
    x.requires_grad_(False)
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    g = torch.randn(out.shape, device=DEVICE)
    out.backward(g)
    _, grads = _reference(x, w1, b1, w2, b2, g)
    assert x.grad is None
    for t, ref_grad in zip((w1, b1, w2, b2), grads[1:]):
        assert t.grad is not None
        assert_close(t.grad, ref_grad, torch.float32, scale=3 * 7 ** 0.5)


def test_empty_rows():
    x, w1, b1, w2, b2 = _inputs((0,), 16, 32, 8, torch.float32)
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(b1.grad, torch.zeros_like(b1)) and torch.equal(w1.grad, torch.zeros_like(w1))


@pytest.mark.parametrize("wrt", ["input", "weight1"])
def test_a_second_derivative_raises(wrt):
    # the backward is GEMMs and kernels: differentiating it again must fail loudly, also with an
    # incoming gradient that requires no grad (torch's once_differentiable then gave no graph)
    x, w1, b1, w2, b2 = _inputs((5,), 8, 16, 8, torch.float32)
    t = x if wrt == "input" else w1
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    for loss in (out.pow(2).sum(), (out * torch.randn_like(out)).sum()):
        (gt,) = torch.autograd.grad(loss, t, create_graph=True, retain_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gt.pow(2).sum().backward(retain_graph=True)


def test_negative_bit_inputs_are_refused_and_negative_bit_gradients_resolved():
    x, w1, b1, w2, b2 = _inputs((5,), 8, 16, 8, torch.float32)
    for name, args in (("input", (torch._neg_view(x.detach()), w1, b1, w2, b2)),
                       ("weight2", (x, w1, b1, torch._neg_view(w2.detach()), b2))):
        with pytest.raises(ValueError, match=f"{name} has its negative bit set"):
            fused_dense_gelu_dense(*args)
    g = torch.randn(5, 8, device=DEVICE)
    want = torch.autograd.grad(fused_dense_gelu_dense(x, w1, b1, w2, b2), (x, w1, b1, w2, b2), -g)
    got = torch.autograd.grad(fused_dense_gelu_dense(x, w1, b1, w2, b2), (x, w1, b1, w2, b2), torch._neg_view(g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_gradcheck_float64():
    # float64, which the op takes too (never cuBLASLt's epilogues), computed in float64 throughout
    x, w1, b1, w2, b2 = _inputs((2, 3), 4, 6, 3, torch.float64)
    assert torch.autograd.gradcheck(fused_dense_gelu_dense, (x, w1, b1, w2, b2))
    assert torch.autograd.gradcheck(lambda x, w1, b1, w2: fused_dense_gelu_dense(x, w1, b1, w2), (x, w1, b1, w2))


@pytest.mark.parametrize("epilogue", [None, True, False])
@pytest.mark.parametrize("k,f,h", [(0, 16, 8), (16, 0, 8), (16, 16, 0)])
def test_zero_widths(k, f, h, epilogue):
    # K = 0 (fc1's output is b1 alone) and H = 0 broke the reshapes to [M, K] and [M, H] (-1 rows
    # of 0 elements); F = 0 with the epilogue on CUDA went to cuBLASLt, whose heuristic refuses N = 0
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, w1, b1, w2, b2 = (torch.randn(shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(True)
                         for shape in ((3, 5, k), (f, k), (f,), (h, f), (h,)))
    _check(x, w1, b1, w2, b2, dtype, epilogue)


def test_the_output_can_be_modified_in_place():
    # a new tensor, as documented: not a view made inside the Function, which autograd would refuse
    # to modify in place ("Output 0 of FusedDenseGeluDenseFunction is a view ...")
    x, w1, b1, w2, b2 = _inputs((4, 3), 16, 32, 8, torch.float32)
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    assert out._base is None
    out.mul_(2)
    out.sum().backward()
    grads = [t.grad.clone() for t in (x, w1, b1, w2, b2)]
    for t in (x, w1, b1, w2, b2):
        t.grad = None
    (2 * fused_dense_gelu_dense(x, w1, b1, w2, b2)).sum().backward()
    for t, g in zip((x, w1, b1, w2, b2), grads):
        assert torch.equal(t.grad, g)


@pytest.mark.parametrize("bias2", [True, False])
def test_autocast_casts_the_arguments_and_runs_in_its_dtype(bias2):
    # as Apex's fused_dense: float32 arguments cast to autocast's dtype, the op computed in it; before,
    # autocast cast the Function's GEMMs alone and the backward raised (bfloat16 g against float32 W2)
    x, w1, b1, w2, b2 = _inputs((5, 3), 16, 32, 8, torch.float32, bias2=bias2)
    ts = [t for t in (x, w1, b1, w2, b2) if t is not None]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    g = torch.randn(out.shape, device=DEVICE, dtype=torch.float32).to(torch.bfloat16)
    out.backward(g)
    low = [t.detach().to(torch.bfloat16).requires_grad_(True) if t is not None else None for t in (x, w1, b1, w2, b2)]
    want = fused_dense_gelu_dense(*low)
    want.backward(g)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for t, t_low in zip(ts, [t for t in low if t is not None]):
        assert t.grad.dtype == torch.float32 and torch.equal(t.grad, t_low.grad.float())
    # float64 is not cast (as autocast leaves it)
    x64, w164, b164, w264, b264 = (t.detach().double() if t is not None else None for t in (x, w1, b1, w2, b2))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out64 = fused_dense_gelu_dense(x64, w164, b164, w264, b264)
    assert out64.dtype == torch.float64 and torch.equal(out64, fused_dense_gelu_dense(x64, w164, b164, w264, b264))


@pytest.mark.parametrize("bad,match", [
    (dict(input=[1.0, 2.0]), "input must be a torch.Tensor"),
    (dict(weight1=torch.zeros(32, 15)), r"weight1 must have shape"),
    (dict(bias1=torch.zeros(31)), r"bias1 must have shape"),
    (dict(weight2=torch.zeros(8, 31)), r"weight2 must have shape"),
    (dict(bias2=torch.zeros(9)), r"bias2 must have shape"),
    (dict(weight1=torch.zeros(32, 16, dtype=torch.float64)), "weight1 must have dtype"),
    (dict(input=torch.zeros(3, 16, dtype=torch.int64)), "input must have dtype"),
    (dict(epilogue="yes"), "epilogue must be a bool"),
    (dict(epilogue=1), "epilogue must be a bool"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(input=torch.zeros(3, 16), weight1=torch.zeros(32, 16), bias1=torch.zeros(32),
                weight2=torch.zeros(8, 32), bias2=torch.zeros(8))
    args.update(bad)
    args = {n: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
    with pytest.raises((TypeError, ValueError), match=match):
        fused_dense_gelu_dense(**args)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device beside the CPU")
def test_tensors_on_two_devices_are_refused():
    x, w1, b1, w2, b2 = _inputs((3,), 16, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="device"):
        fused_dense_gelu_dense(x, w1, b1.detach().cpu(), w2, b2)


@pytest.mark.parametrize("name", ["weight1", "bias1", "weight2", "bias2"])
def test_a_tensor_on_another_device_is_refused_naming_it(name):
    # one operand elsewhere (the CPU against CUDA; 'meta' against the CPU): a ValueError that
    # names it, before any GEMM meets the two devices
    other = "cpu" if CUDA else "meta"
    args = dict(zip(("input", "weight1", "bias1", "weight2", "bias2"),
                    (t.detach() for t in _inputs((3,), 16, 32, 8, torch.float32))))
    args[name] = args[name].to(other)
    with pytest.raises(ValueError, match=f"{name} on {other}"):
        fused_dense_gelu_dense(**args)


# ---------------------------------------------------------------- the cuBLASLt path (CUDA)
@needs_cublaslt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_epilogues_run_and_match_float64(dtype, count_calls):
    fwd = count_calls(fused_dense.cublaslt, "launch_linear_gelu_aux_bias")
    bwd = count_calls(fused_dense.cublaslt, "launch_matmul_dgelu")
    _check(*_inputs((3, 100), 64, 256, 96, dtype), dtype, epilogue=True)
    assert len(fwd) == 1 and len(bwd) == 1


@needs_cublaslt
@pytest.mark.parametrize("rows,f,epilogue,expect", [(16, 64, None, False), (2048, 8192, None, True),
                                                    (16, 64, True, True), (2048, 8192, False, False)])
def test_the_automatic_choice_takes_epilogues_from_the_least_size(count_calls, rows, f, epilogue, expect):
    # EPILOGUE_MIN_ELEMENTS = 2^24: the activation [M, F] of 16 x 64 is below, 2048 x 8192 at it
    fwd = count_calls(fused_dense.cublaslt, "launch_linear_gelu_aux_bias")
    bwd = count_calls(fused_dense.cublaslt, "launch_matmul_dgelu")
    assert fused_dense.EPILOGUE_MIN_ELEMENTS == 1 << 24
    x, w1, b1, w2, b2 = _inputs((rows,), 64, f, 64, torch.bfloat16)
    fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=epilogue).sum().backward()
    assert bool(fwd) is expect and bool(bwd) is expect


@needs_cublaslt
@pytest.mark.parametrize("case", ["float32", "width", "unaligned"])
def test_operands_cublaslt_cannot_take_run_unfused(case, count_calls):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    fwd = count_calls(fused_dense.cublaslt, "launch_linear_gelu_aux_bias")
    if case == "width":
        args = _inputs((33,), 64, 100, 64, dtype)  # F = 100: not a multiple of 8
    else:
        args = _inputs((33,), 64, 128, 64, dtype)
    if case == "unaligned":  # a view 2 elements (4 bytes) into its storage
        x = args[0]
        buf = torch.randn(x.numel() + 2, device=DEVICE, dtype=torch.float32).to(dtype)
        args = (buf[2:].view(x.shape).requires_grad_(True), *args[1:])
        assert args[0].data_ptr() % 16
    _check(*args, dtype, epilogue=True)
    assert not fwd


@needs_cublaslt
def test_calls_of_one_shape_read_their_own_operands():
    # a shape's plan keeps the bias and aux pointers it last set in cuBLASLt's descriptor and sets
    # them again only when they change: calls alternating between operands read each their own
    dtype = torch.bfloat16
    x, w1, _, w2, _ = _inputs((48,), 64, 128, 32, dtype)
    x, w1, w2 = x.detach(), w1.detach(), w2.detach()
    biases = [torch.randn(128, device=DEVICE).to(dtype) for _ in range(2)]
    g = torch.randn(48, 32, device=DEVICE).to(dtype)
    first = [cublaslt.linear_gelu_aux_bias(x, w1, b) for b in biases]
    again = [cublaslt.linear_gelu_aux_bias(x, w1, b) for b in reversed(biases)][::-1]
    for b, (y, z), (y2, z2) in zip(biases, first, again):
        z64 = F.linear(x.double(), w1.double(), b.double())
        assert_close(z, z64, dtype)
        assert_close(y, _gelu_tanh(z64), dtype, scale=2)
        assert torch.equal(y, y2) and torch.equal(z, z2)
    assert not torch.equal(first[0][1], first[1][1])
    dz = [cublaslt.matmul_dgelu(g, w2, z) for _, z in first]
    dz_again = [cublaslt.matmul_dgelu(g, w2, z) for _, z in reversed(first)][::-1]
    for (_, z), d, d2 in zip(first, dz, dz_again):
        z64 = z.double().requires_grad_(True)
        ref, = torch.autograd.grad(_gelu_tanh(z64), z64, g.double() @ w2.double())
        assert_close(d, ref, dtype, scale=2)
        assert torch.equal(d, d2)


@needs_cublaslt
def test_epilogue_path_replays_in_a_cuda_graph():
    x, w1, b1, w2, b2 = _inputs((64,), 64, 128, 32, torch.bfloat16)
    xs = x.detach().clone()
    params = [t.detach() for t in (w1, b1, w2, b2)]
    eager = fused_dense_gelu_dense(xs, *params, epilogue=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_dense_gelu_dense(xs, *params, epilogue=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with collector_paused_for_capture(), torch.cuda.graph(graph):
        out = fused_dense_gelu_dense(xs, *params, epilogue=True)
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_dense_gelu_dense(xs, *params, epilogue=True))
    assert not torch.equal(out, eager)


def test_clear_workspaces_drops_each_stream_s_workspace_and_a_later_call_makes_a_new_one(monkeypatch):
    # on the CPU, stand-ins of two streams' workspaces; on a GPU with cuBLASLt, a real call's
    monkeypatch.setattr(cublaslt, "_workspaces", {})
    sizes = [cublaslt.WORKSPACE_BYTES, 3 * 1024]
    for stream, size in enumerate(sizes):
        cublaslt._workspaces[(0, 1000 + stream)] = torch.empty(size, dtype=torch.uint8)
    cublaslt._workspaces[(0, 2000)] = torch.empty(5, dtype=torch.float32)  # bytes, not elements
    assert cublaslt.clear_workspaces() == sum(sizes) + 20
    assert cublaslt._workspaces == {} and cublaslt.clear_workspaces() == 0
    if CUDA and cublaslt.cublaslt_available():
        x, w1, b1, _, _ = _inputs((64,), 64, 128, 32, torch.bfloat16)
        y, _ = cublaslt.linear_gelu_aux_bias(x.detach(), w1.detach(), b1.detach())
        assert len(cublaslt._workspaces) == 1
        assert cublaslt.clear_workspaces() == cublaslt.WORKSPACE_BYTES and not cublaslt._workspaces
        y2, _ = cublaslt.linear_gelu_aux_bias(x.detach(), w1.detach(), b1.detach())
        assert torch.equal(y, y2) and len(cublaslt._workspaces) == 1


def test_cublaslt_refuses_what_it_cannot_take():
    x = torch.zeros(4, 16, device=DEVICE)
    assert not cublaslt.supported(x, torch.zeros(32, 16, device=DEVICE))  # float32
    with pytest.raises(ValueError, match="linear_gelu_aux_bias"):
        cublaslt.linear_gelu_aux_bias(x, torch.zeros(32, 16, device=DEVICE), torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match="expected grad"):
        cublaslt.matmul_dgelu(x, torch.zeros(8, 32, device=DEVICE), torch.zeros(4, 32, device=DEVICE))
    if not CUDA:
        assert not cublaslt.cublaslt_available()


def test_cublaslt_names_operands_it_cannot_read():
    # its entry points read the operands' memory: a non-tensor, a sparse tensor or one with the
    # negative bit (whose memory holds the negated values) refused by name on every device
    x, w, b = (torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for shape in ((4, 16), (32, 16), (32,)))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cublaslt.linear_gelu_aux_bias([[1.0] * 16], w, b)
    with pytest.raises(ValueError, match="x has its negative bit set"):
        cublaslt.linear_gelu_aux_bias(torch._neg_view(x), w, b)
    with pytest.raises(ValueError, match="bias has its negative bit set"):
        cublaslt.linear_gelu_aux_bias(x, w, torch._neg_view(b))
    with pytest.raises(TypeError, match="weight must be a dense"):
        cublaslt.matmul_dgelu(x, w.t().contiguous().to_sparse(), torch.zeros(4, 32, device=DEVICE, dtype=x.dtype))
    with pytest.raises(ValueError, match="z has its negative bit set"):
        cublaslt.matmul_dgelu(torch.zeros(4, 32, device=DEVICE, dtype=x.dtype), w, torch._neg_view(x))
    assert not cublaslt.supported(torch._neg_view(x), w, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_the_epilogue_path_s_wiring_with_cublaslt_emulated(dtype, monkeypatch):
    """The Function's epilogue branch on any device: cuBLASLt's two calls replaced by PyTorch
    (z = x·W1ᵀ + b1 rounded once, y = gelu_tanh(z); dz = (g·W2)·gelu_tanh'(z)), so the rest
    (what is saved, the column sum of dz for b1, dx and the weight gradients) is tested here."""
    calls = []

    def gelu_aux_bias(x, w, b):
        calls.append("fwd")
        z = (x.double() @ w.double().t() + b.double())
        return _gelu_tanh(z).to(x.dtype), z.to(x.dtype)

    def dgelu(g, w, z):
        calls.append("bwd")
        with torch.enable_grad():  # called inside the backward, where grad mode is off
            z64 = z.double().requires_grad_(True)
            (dz,) = torch.autograd.grad(_gelu_tanh(z64), z64, g.double() @ w.double())
        return dz.to(g.dtype)

    monkeypatch.setattr(fused_dense.cublaslt, "supported", lambda x, weight, *others: True)  # its signature
    monkeypatch.setattr(fused_dense.cublaslt, "supported_like", lambda t, like: True)
    monkeypatch.setattr(fused_dense, "_PLANS", {})  # no path chosen before (or remembered after) the patch
    monkeypatch.setattr(fused_dense.cublaslt, "launch_linear_gelu_aux_bias", gelu_aux_bias)
    monkeypatch.setattr(fused_dense.cublaslt, "launch_matmul_dgelu", dgelu)
    _check(*_inputs((5, 7), 16, 40, 24, dtype), dtype, epilogue=True)
    assert calls == ["fwd", "bwd"]
    calls.clear()
    # the automatic choice: [M, F] = [35, 40] is below EPILOGUE_MIN_ELEMENTS; at the limit, both
    _check(*_inputs((5, 7), 16, 40, 24, dtype), dtype)
    assert calls == []
    monkeypatch.setattr(fused_dense, "EPILOGUE_MIN_ELEMENTS", 35 * 40)
    _check(*_inputs((5, 7), 16, 40, 24, dtype), dtype)
    assert calls == ["fwd", "bwd"]
    calls.clear()
    monkeypatch.setattr(fused_dense, "EPILOGUE_MIN_ELEMENTS", 35 * 40 + 1)
    _check(*_inputs((5, 7), 16, 40, 24, dtype), dtype)
    assert calls == []


def test_a_checked_signature_skips_the_checks_and_others_do_not(monkeypatch):
    # the checks and the path run once per call signature (_PLANS); a call of another signature
    # (here: a bias of another dtype, a bad one) is checked and refused as ever
    monkeypatch.setattr(fused_dense, "_PLANS", {})
    checks = []
    real = fused_dense._check
    monkeypatch.setattr(fused_dense, "_check", lambda *a: (checks.append(1), real(*a))[1])
    x, w1, b1, w2, b2 = (t.detach() for t in _inputs((4, 3), 16, 32, 8, torch.float32))
    first = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    again = fused_dense_gelu_dense(x, w1, b1, w2, b2)  # the same signature (addresses included)
    assert len(checks) == 1 and torch.equal(first, again)
    with pytest.raises(TypeError, match="bias1"):
        fused_dense_gelu_dense(x, w1, b1.double(), w2, b2)
    with pytest.raises(ValueError, match="weight2"):
        fused_dense_gelu_dense(x, w1, b1, w2[:, :16], b2)
    assert len(checks) == 3
    fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=False)  # another epilogue argument: checked again
    assert len(checks) == 4


@needs_cublaslt
def test_the_path_follows_each_call_s_alignment(count_calls):
    # the remembered path is keyed by the operands' addresses modulo cuBLASLt's alignment: an
    # unaligned view of the same shape and strides as an aligned input takes the kernel path
    fwd = count_calls(fused_dense.cublaslt, "launch_linear_gelu_aux_bias")
    x, w1, b1, w2, b2 = (t.detach() for t in _inputs((33,), 64, 128, 64, torch.bfloat16))
    fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=True)
    assert len(fwd) == 1
    buf = torch.empty(x.numel() + 8, device=DEVICE, dtype=x.dtype)
    shifted = buf[8:].view(x.shape)  # 16 bytes in: aligned for Triton, not for cuBLASLt
    shifted.copy_(x)
    assert shifted.stride() == x.stride() and shifted.data_ptr() % cublaslt.ALIGNMENT
    out = fused_dense_gelu_dense(shifted, w1, b1, w2, b2, epilogue=True)
    assert len(fwd) == 1
    assert_close(out, fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=False), torch.bfloat16, scale=3)


def test_supported_like_asks_what_the_backward_s_gradient_needs():
    # a gradient beside an operand supported() took: same dtype and device, dense, contiguous, aligned
    buf = torch.zeros(4096, dtype=torch.bfloat16, device=DEVICE)
    off = (-buf.data_ptr() % cublaslt.ALIGNMENT) // buf.element_size()
    t = buf[off:off + 1024].view(64, 16)
    assert t.data_ptr() % cublaslt.ALIGNMENT == 0 and cublaslt.supported_like(t, t)
    assert not cublaslt.supported_like(buf[off + 8:off + 8 + 1024].view(64, 16), t)  # 16 bytes off
    assert not cublaslt.supported_like(t.float(), t)
    assert not cublaslt.supported_like(t.view(16, 64).t(), t)  # not contiguous
    assert not cublaslt.supported_like(torch._neg_view(t), t)
    # its rows a GEMM width (the dgelu GEMM's depth H, for the gradient g [M, H]): a multiple of 8, not 0
    assert not cublaslt.supported_like(buf[off:off + 1024].view(256, 4), t)
    assert not cublaslt.supported_like(buf[off:off + 1020].view(85, 12), t)
    assert not cublaslt.supported_like(buf[off:off].view(64, 0), t)
    assert cublaslt.supported_like(buf[off:off + 1024].view(128, 8), t)


def _aligned_copy(t):
    """A contiguous copy of ``t`` at an address that is a multiple of cuBLASLt's alignment (the
    CPU's allocator gives 64 bytes; CUDA's caching allocator 512)."""
    buf = torch.empty(t.numel() + cublaslt.ALIGNMENT, dtype=t.dtype, device=t.device)
    off = (-buf.data_ptr() % cublaslt.ALIGNMENT) // t.element_size()
    out = buf[off:off + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def _shifted_copy(t):
    """A contiguous copy of ``t`` 16 bytes past an address aligned for cuBLASLt."""
    buf = torch.empty(t.numel() + cublaslt.ALIGNMENT + 16, dtype=t.dtype, device=t.device)
    off = (-buf.data_ptr() % cublaslt.ALIGNMENT + 16) // t.element_size()
    out = buf[off:off + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def _lt_rule(x, weight, *others):
    """cuBLASLt's rule as :func:`cublaslt.supported` states it, but for the device and the
    library (which the CPU lacks): one dtype (float16 / bfloat16), dense, contiguous, 256-byte
    aligned (the address read as cuBLASLt's heuristic reads it), weight's widths multiples of 8."""
    ts = [x, weight] + [t for t in others if t is not None]
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
        return False
    if any(t.dtype != x.dtype or t.device != x.device or not is_dense(t) or not t.is_contiguous() for t in ts):
        return False
    return bool(weight.numel() and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0
                and all(t.data_ptr() % cublaslt.ALIGNMENT == 0 for t in ts))


@pytest.fixture
def lt_emulated(monkeypatch):
    """cuBLASLt on any device: supported() is :func:`_lt_rule`, and its two launches read their
    operands' memory as cuBLASLt does (row-major, whatever the strides) after asserting that the
    operands are ones supported() accepts (their contract); their outputs are aligned as CUDA's
    are. Returns the list of the launches made ("fwd", "bwd")."""
    calls = []

    def as_read(t):  # the memory cuBLASLt reads: [rows, cols] row-major from the data pointer
        return torch.as_strided(t, t.shape, (t.shape[1], 1))

    def gelu_aux_bias(x, w, b):
        assert _lt_rule(x, w, b), "launch_linear_gelu_aux_bias: operands supported() refuses"
        calls.append("fwd")
        z = as_read(x).double() @ as_read(w).double().t() + b.double()
        return _aligned_copy(_gelu_tanh(z).to(x.dtype)), _aligned_copy(z.to(x.dtype))

    def dgelu(g, w, z):
        assert _lt_rule(g, w, z), "launch_matmul_dgelu: operands supported() refuses"
        calls.append("bwd")
        with torch.enable_grad():
            z64 = as_read(z).double().requires_grad_(True)
            (dz,) = torch.autograd.grad(_gelu_tanh(z64), z64, as_read(g).double() @ as_read(w).double())
        return _aligned_copy(dz.to(g.dtype))

    monkeypatch.setattr(fused_dense.cublaslt, "supported", _lt_rule)
    monkeypatch.setattr(fused_dense, "_PLANS", {})
    monkeypatch.setattr(fused_dense.cublaslt, "launch_linear_gelu_aux_bias", gelu_aux_bias)
    monkeypatch.setattr(fused_dense.cublaslt, "launch_matmul_dgelu", dgelu)
    return calls


def _aligned_inputs(lead, k, f, h, dtype):
    return [_aligned_copy(t.detach()).requires_grad_(True) for t in _inputs(lead, k, f, h, dtype)]


def _grads_against_float64(args, g, dtype, **kw):
    out = fused_dense_gelu_dense(*args, **kw)
    grads = torch.autograd.grad(out, args, g)
    ref, want = _reference(*args, g)
    assert_close(out, ref, dtype, scale=3)
    rows = max(1, math.prod(out.shape[:-1]))
    for got, w in zip(grads, want):
        assert_close(got, w, dtype, scale=3 * rows ** 0.5)


@pytest.mark.parametrize("h", [16, 12, 4, 0])
def test_the_backward_s_gemm_takes_cublaslt_only_where_fc2_s_rows_are_multiples_of_8(h, lt_emulated):
    # the forward asks supported() of x, W1, b1, W2: W1's widths (K, F) alone; the backward's
    # dgelu GEMM g [M, H] · W2 [H, F] has depth H, which it must ask itself (before, supported(g,
    # W2, z) did; supported_like(g, z) alone sent H = 12, 4 and 0 to cuBLASLt)
    dtype = torch.bfloat16
    args = _aligned_inputs((6,), 16, 32, h, dtype)
    g = _aligned_copy(torch.randn(6, h, device=DEVICE).to(dtype))
    _grads_against_float64(args, g, dtype, epilogue=True)
    assert lt_emulated == (["fwd", "bwd"] if h == 16 else ["fwd"])


@pytest.mark.parametrize("how", ["strided", "unaligned"])
def test_a_weight_whose_data_is_replaced_before_the_backward(how, lt_emulated):
    # a sharded optimizer (ZeRO-3, FSDP) frees a parameter after the forward and gathers it again
    # before the backward, into new memory: W2's .data is replaced, which autograd does not
    # track. The backward must ask of the W2 it gets what cuBLASLt needs (cuBLASLt would read a
    # strided W2 as row-major: a wrong dx; an unaligned one breaks the alignment its algorithm assumed)
    dtype = torch.bfloat16
    x, w1, b1, w2, b2 = _aligned_inputs((6,), 16, 32, 16, dtype)
    g = _aligned_copy(torch.randn(6, 16, device=DEVICE).to(dtype))
    out = fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=True)
    ref, want = _reference(x, w1, b1, w2, b2, g)
    if how == "strided":
        w2.data = w2.detach().t().contiguous().t()  # the same values, column-major
    else:
        w2.data = _shifted_copy(w2.detach())  # the same values, 16 bytes past an aligned address
    assert not (w2.is_contiguous() and w2.data_ptr() % cublaslt.ALIGNMENT == 0)
    grads = torch.autograd.grad(out, (x, w1, b1, w2, b2), g)
    assert lt_emulated == ["fwd"]
    for got, w in zip(grads, want):
        assert_close(got, w, dtype, scale=3 * 6 ** 0.5)


def test_torch_func_transforms_raise_their_clear_error_where_the_epilogues_would_run(lt_emulated):
    # inside vmap / grad / jvp the operands are tensors without storage: choosing the path before
    # the Function (supported() reads the operands' addresses on CUDA) raised "Cannot access data
    # pointer of Tensor that doesn't have storage" there, before torch's error (the Functions lack
    # setup_context) or fusedlib's refusal of a tangent could say what is wrong
    x, w1, b1, w2, b2 = (t.detach() for t in _aligned_inputs((6,), 16, 32, 16, torch.bfloat16))
    fn = functools.partial(fused_dense_gelu_dense, weight1=w1, bias1=b1, weight2=w2, bias2=b2, epilogue=True)
    assert _lt_rule(x, w1, b1, w2)  # these operands take the epilogues outside a transform
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.vmap(fn)(x.unsqueeze(0).expand(2, *x.shape))
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda t: fn(t).float().sum())(x)
    with pytest.raises(NotImplementedError, match="carries a forward-mode AD tangent"):
        torch.func.jvp(fn, (x,), (torch.ones_like(x),))
    assert lt_emulated == []
    assert torch.equal(fn(x), fused_dense_gelu_dense(x, w1, b1, w2, b2, epilogue=True)) and lt_emulated == ["fwd"] * 2


class _FakeLt:
    """The two cuBLASLt calls :func:`cublaslt._matmul` makes, on the host: the descriptor's
    pointers kept as set, each launch recording the (bias, aux) pointers it would read;
    ``interrupt``: the next setting of a pointer is followed by a KeyboardInterrupt (Ctrl-C,
    which Python raises after the C call returned)."""

    def __init__(self):
        self.desc, self.launches, self.interrupt = {}, [], False

    def cublasLtMatmulDescSetAttribute(self, desc, attr, ref, size):
        self.desc[attr] = ref._obj.value
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return 0

    def cublasLtMatmul(self, *args):
        self.launches.append((self.desc.get(cublaslt._DESC_BIAS_POINTER), self.desc.get(cublaslt._DESC_AUX_POINTER)))
        return 0


def test_a_plan_s_descriptor_holds_each_call_s_pointers_also_after_an_interrupted_call(monkeypatch):
    # _matmul sets the bias and aux pointers only where they differ from those the plan last set:
    # a call interrupted between setting one and recording it left the plan naming the previous
    # pointer, and the next call with that pointer launched with the interrupted call's (freed) one
    lt = _FakeLt()
    d = torch.empty(4, 8)
    monkeypatch.setattr(cublaslt, "_lib", lt)
    monkeypatch.setattr(cublaslt, "_current_stream", lambda index: 0)
    monkeypatch.setattr(cublaslt, "_workspaces", {(d.device.index, 0): torch.empty(0, dtype=torch.uint8)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: d.device.index)
    plan = cublaslt._Plan(None, None, (None, None, None), ctypes.c_uint64(0))
    biases, auxes = [torch.empty(8) for _ in range(2)], [torch.empty(4, 8) for _ in range(2)]
    ptrs = [(b.data_ptr(), z.data_ptr()) for b, z in zip(biases, auxes)]
    for i in (0, 1, 1, 0):
        cublaslt._matmul(plan, d, d, d, biases[i], auxes[i])
        assert lt.launches[-1] == ptrs[i]
    for which in ("bias", "aux"):
        lt.interrupt = True
        b, z = (biases[1], auxes[0]) if which == "bias" else (biases[0], auxes[1])
        with pytest.raises(KeyboardInterrupt):
            cublaslt._matmul(plan, d, d, d, b, z)
        cublaslt._matmul(plan, d, d, d, biases[0], auxes[0])
        assert lt.launches[-1] == ptrs[0]
    dgelu = cublaslt._Plan(None, None, (None, None, None), ctypes.c_uint64(0))  # no bias: its pointer never set
    lt.desc.clear()
    cublaslt._matmul(dgelu, d, d, d, None, auxes[1])
    assert lt.launches[-1] == (None, ptrs[1][1])


def test_the_binding_says_why_cublaslt_is_missing(monkeypatch):
    monkeypatch.setattr(cublaslt, "_lib", None)
    monkeypatch.setattr(cublaslt, "_lib_error", "libcublasLt.so.99 not found")  # as _load() records it
    x = torch.zeros(4, 16, device=DEVICE, dtype=torch.bfloat16)
    w, b = torch.zeros(32, 16, device=DEVICE, dtype=torch.bfloat16), torch.zeros(32, device=DEVICE, dtype=torch.bfloat16)
    assert not cublaslt.supported(x, w, b)
    with pytest.raises(ValueError, match="libcublasLt.so.99 not found"):
        cublaslt.linear_gelu_aux_bias(x, w, b)


@needs_cublaslt
def test_cublaslt_s_gelu_is_the_tanh_form():
    """Which GeLU the epilogue computes, where the two forms differ most: z in [-3, -1.5], where
    erf GeLU minus tanh GeLU, d(z), reaches 4.7e-4 while float16's spacing of y is at most 6.1e-5;
    z passed through exactly (W = I, b = 0: the GEMM adds zeros in float32). The projection of
    y - gelu_tanh(z) on d(z) is 0 for the tanh form and 1 for the erf form; rounding, and a fast
    tanh's own error, are not shaped like d and move it little."""
    z = torch.linspace(-3.0, -1.5, 64 * 64, device=DEVICE).to(torch.float16).view(64, 64)
    w = torch.eye(64, device=DEVICE, dtype=torch.float16)
    y, z_out = cublaslt.linear_gelu_aux_bias(z, w, torch.zeros(64, device=DEVICE, dtype=torch.float16))
    assert torch.equal(z_out, z)
    z64 = z.double()
    d = F.gelu(z64) - _gelu_tanh(z64)
    assert d.abs().max() > 4e-4  # the two forms do differ here
    slope = ((y.double() - _gelu_tanh(z64)) * d).sum() / (d * d).sum()
    assert abs(slope.item()) < 0.25, f"the epilogue's GeLU projects {slope.item():.2f} of the way to the erf form"


@needs_cublaslt
def test_each_gemm_shape_and_epilogue_gets_its_own_plan():
    """cuBLASLt's plans are made once per GEMM: two forward GEMMs with the same output [M, N]
    but another depth K, and an MLP whose fc1 depth K equals fc2's H (its forward GEMM and its
    dgelu GEMM then have the same M, N and K, but another epilogue and transpose), each compute
    their own product."""
    dtype = torch.bfloat16
    for k in (32, 64):  # one [48, 128] output, depth 32 then 64
        x = torch.randn(48, k, device=DEVICE).to(dtype)
        w = (k ** -0.5 * torch.randn(128, k, device=DEVICE)).to(dtype)
        b = torch.randn(128, device=DEVICE).to(dtype)
        y, z = cublaslt.linear_gelu_aux_bias(x, w, b)
        z64 = F.linear(x.double(), w.double(), b.double())
        assert_close(z, z64, dtype)
        assert_close(y, _gelu_tanh(z64), dtype, scale=2)
    _check(*_inputs((48,), 64, 128, 64, dtype), dtype, epilogue=True)  # K = H = 64


@needs_cublaslt
def test_one_workspace_per_stream_kept_across_calls(monkeypatch):
    """cuBLASLt's workspace is made once per (device, stream) and kept: a second call on a
    stream uses the same one (not a new allocation per call), and a call on another stream
    gets its own (GEMMs on two streams may run at the same time)."""
    monkeypatch.setattr(cublaslt, "_workspaces", {})
    x, w1, b1, _, _ = (t.detach() for t in _inputs((64,), 64, 128, 32, torch.bfloat16))
    y, _ = cublaslt.linear_gelu_aux_bias(x, w1, b1)
    (first,) = cublaslt._workspaces.values()
    cublaslt.linear_gelu_aux_bias(x, w1, b1)
    (again,) = cublaslt._workspaces.values()
    assert again is first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (a stream other than the default one: its handle is not 0)
        y_side, _ = cublaslt.linear_gelu_aux_bias(x, w1, b1)
        kept = dict(cublaslt._workspaces)
        cublaslt.linear_gelu_aux_bias(x, w1, b1)
    torch.cuda.current_stream().wait_stream(side)
    assert len(kept) == 2 and torch.equal(y_side, y)
    assert cublaslt._workspaces.keys() == kept.keys()
    assert all(cublaslt._workspaces[key] is w for key, w in kept.items())


@needs_cublaslt
def test_supported_asks_every_width_and_one_device():
    """supported() refuses a weight whose rows K (the GEMM's depth, and the leading dimension of
    x and the weight) are not a multiple of 8, and an operand on another device, even one that
    is aligned as cuBLASLt needs."""
    dtype = torch.bfloat16
    x, w, b = (_aligned_copy(torch.zeros(shape, device=DEVICE, dtype=dtype)) for shape in ((4, 16), (32, 16), (32,)))
    assert cublaslt.supported(x, w, b)
    x12, w12 = (_aligned_copy(torch.zeros(shape, device=DEVICE, dtype=dtype)) for shape in ((4, 12), (32, 12)))
    assert not cublaslt.supported(x12, w12, b)
    b_cpu, w_cpu = _aligned_copy(b.cpu()), _aligned_copy(w.cpu())
    assert b_cpu.data_ptr() % cublaslt.ALIGNMENT == 0 and w_cpu.data_ptr() % cublaslt.ALIGNMENT == 0
    assert not cublaslt.supported(x, w, b_cpu)
    assert not cublaslt.supported(x, w_cpu, b)


@pytest.mark.parametrize("fn,shapes", [
    ("linear_gelu_aux_bias", ((4, 16), (32, 16), (24,))),  # bias [24] for N = 32
    ("linear_gelu_aux_bias", ((4, 24), (32, 16), (32,))),  # x's K = 24, the weight's 16
    ("matmul_dgelu", ((4, 32), (32, 16), (4, 24))),  # z [4, 24] for [M, F] = [4, 16]
])
def test_cublaslt_refuses_mismatched_shapes(fn, shapes):
    # every operand is one cuBLASLt could take alone (bfloat16, widths multiples of 8), but one
    # shape disagrees with the others: refused before anything reads memory (cuBLASLt would read
    # past the short operand, or write an output of another shape)
    args = [torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for shape in shapes]
    expected = "expected x" if fn == "linear_gelu_aux_bias" else "expected grad"
    with pytest.raises(ValueError, match=expected):
        getattr(cublaslt, fn)(*args)


@needs_cublaslt
def test_zero_rows_on_the_epilogue_path(count_calls):
    """An empty batch (M = 0) with operands cuBLASLt takes: the op goes to the epilogue path,
    whose GEMMs have nothing to compute, so neither makes a cuBLASLt plan or call; the output
    is empty and the weight gradients are zeros."""
    dtype = torch.bfloat16
    fwd = count_calls(fused_dense.cublaslt, "launch_linear_gelu_aux_bias")
    bwd = count_calls(fused_dense.cublaslt, "launch_matmul_dgelu")
    plans = count_calls(cublaslt, "_plan")
    x, w1, b1, w2, b2 = _inputs((0,), 64, 128, 32, dtype)
    _check(x, w1, b1, w2, b2, dtype, epilogue=True)
    assert len(fwd) == 1 and len(bwd) == 1
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(b1.grad, torch.zeros_like(b1))
    y, z = cublaslt.linear_gelu_aux_bias(x.detach(), w1.detach(), b1.detach())
    assert y.shape == z.shape == (0, 128)
    dz = cublaslt.matmul_dgelu(torch.zeros(0, 32, device=DEVICE, dtype=dtype), w2.detach(), z)
    assert dz.shape == (0, 128)
    assert plans == []
