"""bias + tanh-GeLU: fusedlib's Triton kernels against a float64 PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from fusedlib import unfused
from fusedlib.fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl

from conftest import DEVICE, FLOAT_DTYPES, assert_close  # noqa: I001

HIDDEN = (1, 7, 1024, 1300, 5120, 65537)  # 1300: 512-column tiles, the last one part-masked


def _inputs(shape, dtype, requires_grad=True):
    y = (2 * torch.randn(shape, device=DEVICE, dtype=torch.float32)).to(dtype).requires_grad_(requires_grad)
    b = torch.randn(shape[-1], device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)
    return y, b


def _check_fwd_bwd(y, b, g=None):
    dtype = y.dtype
    out = bias_gelu_impl(y, b)
    assert out.dtype == dtype and out.shape == y.shape and out.is_contiguous()
    assert out.data_ptr() != y.data_ptr()
    y64, b64 = y.detach().double(), b.detach().double()
    assert_close(out, unfused.bias_gelu(b64, y64), dtype)
    g = torch.randn_like(out) if g is None else g
    g_before = g.clone()
    out.backward(g)
    assert torch.equal(g, g_before), "grad_output was modified"
    dy64 = unfused.bias_gelu_back(g.double(), b64, y64)
    assert y.grad.dtype == dtype and b.grad.dtype == dtype
    assert_close(y.grad, dy64, dtype)
    db64 = dy64.reshape(-1, y.shape[-1]).sum(0)
    rows = max(1, y.numel() // y.shape[-1])
    assert_close(b.grad, db64, dtype, scale=rows**0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", HIDDEN)
def test_forward_backward_2d(dtype, h):
    rows = 3 if h > 5000 else 33
    _check_fwd_bwd(*_inputs((rows, h), dtype))


@pytest.mark.parametrize("h", (7, 1300))
def test_forward_backward_float64(h):
    # float64 inputs compute in float64 (ACC), so the kernels' constants (c0, c1, c2 = 3·c0·c1)
    # must match the reference to float64's accuracy: a c2 off by 2e-6 relative moves dy by
    # ~1e-7, hidden under float32's tolerance, and gradcheck's finite differences miss it too
    _check_fwd_bwd(*_inputs((33, h), torch.float64))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_forward_backward_3d_bias_grad_over_s_b(dtype):
    # [s, b, h]: the bias gradient sums over both s and b
    _check_fwd_bwd(*_inputs((5, 3, 96), dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_single_row_and_1d(dtype):
    _check_fwd_bwd(*_inputs((1, 300), dtype))
    _check_fwd_bwd(*_inputs((300,), dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_transposed_input_and_grad(dtype):
    base = (2 * torch.randn(48, 20, device=DEVICE)).to(dtype)
    y = base.t().requires_grad_(True)  # [20, 48], strides (1, 20)
    assert not y.is_contiguous()
    b = torch.randn(48, device=DEVICE).to(dtype).requires_grad_(True)
    g = torch.randn(48, 20, device=DEVICE).to(dtype).t()
    y_before = y.detach().clone()
    _check_fwd_bwd(y, b, g)
    assert torch.equal(y.detach(), y_before), "input was modified"


def test_non_contiguous_3d_and_strided_bias():
    y = torch.randn(4, 6, 40, device=DEVICE).permute(1, 0, 2).requires_grad_(True)  # [6, 4, 40]
    b = torch.randn(80, device=DEVICE)[::2].requires_grad_(True)
    out = bias_gelu_impl(y, b)
    assert_close(out, unfused.bias_gelu(b.detach().double(), y.detach().double()), torch.float32)


def test_strided_bias_forward_and_backward():
    # a bias that is every other element of a longer tensor: the output and both gradients
    # are those of its own elements, not of the memory between them
    y, _ = _inputs((7, 40), torch.float32)
    b = torch.randn(80, device=DEVICE)[::2].requires_grad_(True)
    assert not b.is_contiguous()
    _check_fwd_bwd(y, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_empty_input(dtype):
    y, b = _inputs((0, 16), dtype)
    out = bias_gelu_impl(y, b)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert y.grad.shape == (0, 16)
    assert torch.equal(b.grad, torch.zeros_like(b))


# Triton's interpreter runs the kernels in NumPy, which warns of the float32 overflow of x² that a
# GPU performs silently (inf, as IEEE): the kernels take that inf into account.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,))
def test_saturated_inputs_give_the_limits(dtype):
    # Past |x| of about 20, tanh is +-1 in every dtype: gelu(x) is x (x > 0) or 0, its gradient
    # 1 or 0. Past 1.8e19 (float32 compute) x² overflows: the gradient's (1 - t²)·(c0 + c2·x²)
    # was 0·inf = NaN there (float64: past 1.3e154).
    big = torch.finfo(dtype).max
    vals = [v for v in (20.0, 1e4, 1e5, 2e19, 1e30, 1e200, big) if v <= big]
    x = torch.tensor([[-v for v in vals] + vals] * 3, dtype=torch.float64).to(dtype)
    y = x.to(DEVICE).requires_grad_(True)
    b = torch.zeros(x.shape[1], device=DEVICE, dtype=dtype, requires_grad=True)
    out = bias_gelu_impl(y, b)
    pos = y.detach() > 0
    assert torch.equal(out, torch.where(pos, y.detach(), torch.zeros_like(out)))
    out.backward(torch.full_like(out, 3.0))
    assert torch.equal(y.grad, torch.where(pos, 3.0, 0.0).to(dtype))
    assert torch.equal(b.grad, torch.where(pos[0], 9.0, 0.0).to(dtype))


def test_larger_multi_program_bias_reduction():
    # more rows than one backward program holds, so the two-stage bias reduction is exercised
    _check_fwd_bwd(*_inputs((1031, 24), torch.float32))


def test_plain_functions_match_reference():
    y, b = _inputs((9, 130), torch.float32, requires_grad=False)
    g = torch.randn_like(y)
    assert_close(bias_gelu(b, y), unfused.bias_gelu(b.double(), y.double()), torch.float32)
    assert_close(bias_gelu_back(g, b, y), unfused.bias_gelu_back(g.double(), b.double(), y.double()), torch.float32)


def test_gradcheck_float64():
    # float64 inputs run the same kernels computing in float64, so gradcheck checks them.
    y = torch.randn(3, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(GeLUFunction.apply, (y, b))
    y3 = torch.randn(2, 3, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b3 = torch.randn(4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(bias_gelu_impl, (y3, b3))


def test_megatron_constants_in_reference():
    assert abs(unfused.SQRT_2_OVER_PI - 0.79788456) < 1e-8
    assert abs(unfused.GELU_DERIV_COEF - 0.1070322243) < 5e-10  # Megatron's literal, rounded


def test_tanh_gelu_gradient_is_autograd_gradient():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64, requires_grad=True)
    unfused.gelu_tanh(x).sum().backward()
    torch.testing.assert_close(x.grad, unfused.gelu_tanh_grad(x.detach()), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (torch.randn(4, 8), torch.randn(7)), ValueError, r"bias must have shape \[h\] with h = input.shape\[-1\] = 8"),
        (lambda: (torch.randn(4, 8), torch.randn(8).half()), TypeError, "bias dtype"),
        (lambda: (torch.randn(4, 8).int(), torch.randn(8).int()), TypeError, "input must have dtype"),
        (lambda: (torch.randn(4, 8), torch.randn(1, 8)), ValueError, "bias must be 1-D"),
        (lambda: (torch.randn(4, 8), torch.randn(8, 1)), ValueError, "bias must be 1-D"),
        (lambda: (torch.tensor(1.0), torch.randn(1)), ValueError, "input must have at least 1 dimension"),
        (lambda: ([1.0, 2.0], torch.randn(2)), TypeError, "input must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_clear_error(make, error, match):
    y, b = make()
    y = y.to(DEVICE) if isinstance(y, torch.Tensor) else y
    with pytest.raises(error, match=match):
        bias_gelu_impl(y, b.to(DEVICE))


def test_a_signature_that_passed_the_check_skips_it_and_a_bad_one_never_does(count_calls):
    # GeLUFunction's forward checks its arguments only when no plan matches the call's signature;
    # a plan is remembered only for a signature that passed (the check itself in the key).
    import fusedlib.fusions.fused_bias_gelu as fbg
    from fusedlib.kernels.bias_gelu import bias_gelu_fwd

    checks = count_calls(fbg, "_check")
    gen = torch.Generator(device="cpu").manual_seed(3)
    y, b = torch.randn(6, 40, generator=gen).to(DEVICE), torch.randn(40, generator=gen).to(DEVICE)
    out = bias_gelu_impl(y, b)
    assert len(checks) == 1
    assert torch.equal(bias_gelu_impl(y, b), out) and len(checks) == 1  # the same signature: no check
    bias_gelu_impl(torch.randn(6, 40, device=DEVICE), torch.randn(40, device=DEVICE))
    assert len(checks) == 1  # new values, the same signature
    bias_gelu_impl(y[:5], b)
    assert len(checks) == 2  # a new shape: checked once
    for _ in range(2):
        with pytest.raises(TypeError, match="bias dtype"):
            bias_gelu_impl(y, b.double())
        with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):
            bias_gelu_impl(y, torch.randn(41, device=DEVICE))
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            bias_gelu_impl(y.tolist(), b)
    # a strided bias: the check copies it, every call checks again; an unchecked kernel-layer
    # call on it first (its plan never stands for the check) changes nothing
    wide = torch.zeros(80, device=DEVICE)
    wide[::2] = b
    bias_gelu_fwd(y, wide[::2])
    n = len(checks)
    for _ in range(2):
        assert torch.equal(bias_gelu_impl(y, wide[::2]), out)
    assert len(checks) == n + 2
    bias_gelu_fwd(y, torch.randn(41, device=DEVICE))  # unchecked: reads 40 of the 41
    with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):
        bias_gelu_impl(y, torch.randn(41, device=DEVICE))


def test_mixed_devices_raise():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match="one device, got input on"):
        bias_gelu_impl(torch.randn(4, 8, device=DEVICE), torch.randn(8, device=other))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda y, b: (y[:3], b, y), ValueError, r"grad_output must have shape \[4, 8\]"),
        (lambda y, b: (y.reshape(8, 4), b, y), ValueError, r"grad_output must have shape \[4, 8\]"),
        (lambda y, b: (y.double(), b, y), TypeError, "grad_output dtype torch.float64 must match"),
        (lambda y, b: (y, b.double(), y), TypeError, "bias dtype torch.float64 must match y dtype"),
        (lambda y, b: (y, b[:7], y), ValueError, r"h = y.shape\[-1\] = 8"),
    ],
)
def test_the_functional_forms_name_the_argument_at_fault(make, error, match):
    # bias_gelu(bias, y) and bias_gelu_back(g, bias, y) check g against y (a g of another shape
    # would be read out of its bounds by the kernel) and name their own arguments
    y, b = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    g, b2, y2 = make(y, b)
    with pytest.raises(error, match=match):
        bias_gelu_back(g, b2, y2)
    if g is y:  # the forward's checks too
        with pytest.raises(error, match=match):
            bias_gelu(b2, y2)
