"""bias + dropout + residual add: fusedlib's Triton kernels against float64 PyTorch references.

The fused op draws its mask inside the kernel. To compare values, a test replays the seed:
``torch.manual_seed(s)`` before the op, then ``torch.manual_seed(s); philox_seed(device)``
gives the same Philox key, and ``dropout_mask`` the mask the kernels drew with it. The
mask itself is checked against an independent pure-Python Philox-4x32-10.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusedlib import unfused
from fusedlib.fusions.fused_bias_dropout import (
    BiasDropoutAddFunction,
    _bias_dropout_add_func,
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)
from fusedlib.kernels.bias_dropout_add import (
    KEEP_BITS,
    _keep_mask,
    drop_threshold,
    dropout_mask,
    dropout_scale,
    philox_seed,
)
from fusedlib.runtime import launch
import triton  # after fusedlib: on a CPU-only machine fusedlib selects Triton's interpreter first
import triton.language as tl

from conftest import DEVICE, FLOAT_DTYPES, assert_close, generator_state  # noqa: I001

SEED = 1234  # replayed seed of the op under test (inputs are drawn before it, fresh per test)


def _inputs(shape, dtype, r_dtype=None, bias=True, requires_grad=True):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(requires_grad)
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_(requires_grad) if bias else None
    r = torch.randn(shape, device=DEVICE).to(r_dtype or dtype).requires_grad_(requires_grad)
    return x, b, r


def _replayed_mask(shape, p):
    """The mask the op drew right after torch.manual_seed(SEED), as a bool tensor of ``shape``."""
    torch.manual_seed(SEED)
    seed = philox_seed(DEVICE)
    h = shape[-1] if len(shape) else 1
    return dropout_mask(seed, math.prod(shape) // max(h, 1) if h else 0, h, p).view(shape)


def _check_train(x, b, r, p, g=None):
    """Forward and backward of bias_dropout_add_fused_train against the float64 masked reference."""
    inputs_before = [t.detach().clone() for t in (x, b, r) if t is not None]
    torch.manual_seed(SEED)
    out = bias_dropout_add_fused_train((x, b), r, p)
    assert out.dtype == r.dtype and out.shape == x.shape and out.is_contiguous()
    assert out.data_ptr() not in (x.data_ptr(), r.data_ptr())
    keep = _replayed_mask(tuple(x.shape), p)
    b64 = b.detach().double() if b is not None else None
    p_used = drop_threshold(p) / 2**KEEP_BITS  # the probability applied (16-bit resolution): scale 1/(1 - p_used)
    assert_close(out, unfused.bias_dropout_add_masked(x.detach().double(), b64, r.detach().double(), keep, p_used),
                 r.dtype)
    g = torch.randn(out.shape, device=DEVICE).to(out.dtype) if g is None else g
    g_before = g.clone()
    out.backward(g)
    assert torch.equal(g, g_before), "grad_output was modified"
    for t, before in zip([t for t in (x, b, r) if t is not None], inputs_before):
        assert torch.equal(t.detach(), before), "an input was modified"
    scale = 1.0 / (1.0 - p_used) if p_used < 1 else 0.0
    dx64 = torch.where(keep, g.double() * scale, torch.zeros((), dtype=torch.float64, device=DEVICE))
    assert x.grad.dtype == x.dtype and r.grad.dtype == r.dtype
    assert_close(x.grad, dx64, x.dtype)
    assert torch.equal(r.grad, g), "d residual must be grad_output itself"
    if b is not None:
        assert b.grad.dtype == b.dtype
        rows = max(1, x.numel() // x.shape[-1])
        assert_close(b.grad, dx64.reshape(-1, x.shape[-1]).sum(0), b.dtype, scale=rows**0.5)
    return out, keep


# ---------------------------------------------------------------------------------------
# values: forward and backward against float64
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("h", (1, 7, 1000, 2049, 5121))
def test_train_forward_backward_2d(dtype, h):
    rows = 3 if h > 5000 else 33
    _check_train(*_inputs((rows, h), dtype), p=0.3)


def test_long_row():
    # 65537 columns: 33 column blocks, the last one a single column (the interpreter is slow: fp32 only)
    _check_train(*_inputs((1, 65537), torch.float32), p=0.3)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_train_3d_bias_grad_over_s_and_b(dtype):
    _check_train(*_inputs((5, 3, 96), dtype), p=0.1)  # [s, b, h]: db sums over s and b


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_train_without_bias(dtype):
    _check_train(*_inputs((17, 130), dtype, bias=False), p=0.2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_single_row_and_1d(dtype):
    _check_train(*_inputs((1, 300), dtype), p=0.4)
    _check_train(*_inputs((300,), dtype), p=0.4)


def test_multi_program_bias_reduction_and_bwd_loop():
    # more rows than one backward program holds: the backward loops over row blocks and the
    # two-stage bias reduction runs; its mask still agrees with the forward's
    _check_train(*_inputs((1031, 24), torch.float32), p=0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_inputs_and_grad(dtype):
    x = torch.randn(48, 20, device=DEVICE).to(dtype).t().requires_grad_(True)  # [20, 48], strides (1, 20)
    r = torch.randn(40, 48, device=DEVICE).to(dtype)[::2].requires_grad_(True)  # row stride 96
    b = torch.randn(96, device=DEVICE).to(dtype)[::2].requires_grad_(True)  # strided bias
    g = torch.randn(48, 20, device=DEVICE).to(dtype).t()
    assert not (x.is_contiguous() or r.is_contiguous() or b.is_contiguous() or g.is_contiguous())
    _check_train(x, b, r, p=0.25, g=g)


def test_non_contiguous_3d():
    x = torch.randn(4, 6, 40, device=DEVICE).permute(1, 0, 2).requires_grad_(True)  # [6, 4, 40]
    r = torch.randn(6, 4, 40, device=DEVICE).requires_grad_(True)
    b = torch.randn(40, device=DEVICE).requires_grad_(True)
    _check_train(x, b, r, p=0.1)


@pytest.mark.parametrize("x_dtype", (torch.bfloat16, torch.float16))
def test_fp32_residual_connection_dtypes(x_dtype):
    # x bf16/fp16, residual fp32: out and residual.grad fp32, x.grad and bias.grad in x's dtype
    out, _ = _check_train(*_inputs((9, 72), x_dtype, r_dtype=torch.float32), p=0.2)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("x_dtype", (torch.bfloat16, torch.float16))
def test_a_float32_bias_of_a_half_x_gets_a_float32_gradient(x_dtype):
    # x bf16/fp16 (a GEMM's output), bias and residual fp32: the bias gradient is summed in float32
    # and returned in the bias's dtype at float32's accuracy, never rounded through x's dtype
    x, _, r = _inputs((9, 72), x_dtype, r_dtype=torch.float32)
    b = torch.randn(72, device=DEVICE).requires_grad_(True)
    _check_train(x, b, r, p=0.2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_empty_input(dtype):
    x, b, r = _inputs((0, 16), dtype)
    out = bias_dropout_add_fused_train((x, b), r, 0.1)
    assert out.shape == (0, 16) and out.dtype == dtype
    out.sum().backward()
    assert x.grad.shape == (0, 16) and r.grad.shape == (0, 16)
    assert torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_empty_input_draws_no_random_numbers(shape):
    # as torch's dropout: an empty input drops nothing, so the generator does not move (a
    # later dropout's mask is the one it would have been without the empty call)
    x, b, r = _inputs(shape, torch.float32)
    before = generator_state(DEVICE)
    torch.nn.functional.dropout(torch.empty(shape, device=DEVICE), 0.1, True)
    assert torch.equal(generator_state(DEVICE), before)  # torch's own behaviour, on this device
    out = bias_dropout_add_fused_train((x, b), r, 0.1)
    assert torch.equal(generator_state(DEVICE), before)
    out.sum().backward()
    assert x.grad.shape == shape and r.grad.shape == shape
    x_one, b_one, r_one = _inputs((3, 8), torch.float32)
    bias_dropout_add_fused_train((x_one, b_one), r_one, 0.1)
    assert not torch.equal(generator_state(DEVICE), before)  # a non-empty input draws its seed


@pytest.mark.parametrize("p", [1.0, 1.0 - 2.0**-18])
def test_dropping_everything_draws_no_random_numbers(p):
    # p' = round(p·2^16)/2^16 = 1 drops every element whatever the random bits: as torch's
    # dropout for p = 1, no random numbers are drawn, and the output is the residual, the
    # gradient of x zero (the backward regenerates the same all-dropped mask)
    x, b, r = _inputs((5, 24), torch.float32)
    before = generator_state(DEVICE)
    out = bias_dropout_add_fused_train((x, b), r, p)
    assert torch.equal(generator_state(DEVICE), before)
    assert torch.equal(out, r.detach())
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(b.grad, torch.zeros_like(b))
    assert torch.equal(r.grad, torch.ones_like(r))
    bias_dropout_add_fused_train((x, b), r, 1.0 - 2.0**-16)  # p' < 1: the key is drawn
    assert not torch.equal(generator_state(DEVICE), before)


@pytest.mark.parametrize("fn", ["train", "inference"])
def test_hidden_size_zero(fn):
    # h = 0: reshape(-1, 0) cannot infer the row count; the op returns empty results
    f = get_bias_dropout_add(fn == "train", True)
    x, b, r = _inputs((4, 0), torch.float32)
    out = f((x, b), r, 0.1)
    assert out.shape == (4, 0) and out.dtype == torch.float32
    out.sum().backward()
    assert x.grad.shape == (4, 0) and b.grad.shape == (0,) and r.grad.shape == (4, 0)
    x3, _, r3 = _inputs((2, 3, 0), torch.float32, requires_grad=False)
    out3 = f((x3, None), r3, 0.5)
    assert out3.shape == (2, 3, 0)


def test_mean_preserved_at_p_0_99999():
    # p = 0.99999 is applied as p' = 65535/65536 (16-bit resolution): kept values must be
    # scaled by 1/(1 - p') = 65536 (not 1/(1 - p) = 100000, a 1.53x bias), so E[out] = x.
    n_rows, h = 1024, 4096  # 2^22 elements: ~64 kept
    x = torch.ones(n_rows, h, device=DEVICE)
    out = bias_dropout_add_fused_train((x, None), torch.zeros_like(x), 0.99999)
    kept = out != 0
    assert torch.equal(out[kept].cpu(), torch.full((int(kept.sum()),), 65536.0))
    assert dropout_scale(0.99999) * (1 - drop_threshold(0.99999) / 2**KEEP_BITS) == 1.0
    # the mean of the kept-and-scaled values: E = 1, sd = sqrt((1 - q)/(n q)) with q = 2^-16
    n, q = x.numel(), 2.0**-KEEP_BITS
    assert abs(out.double().mean().item() - 1.0) <= 4 * math.sqrt((1 - q) / (n * q))


def test_scale_is_exact_for_representable_p():
    for p, s in ((0.0, 1.0), (0.5, 2.0), (0.25, 4.0 / 3.0), (0.75, 4.0), (1.0, 0.0), (1 - 2.0**-18, 0.0)):
        assert dropout_scale(p) == s, p


def test_gradcheck_float64():
    # float64 runs the same kernels computing in float64; the seed is replayed on every call so
    # gradcheck's repeated evaluations see one mask. p = 0.5: 1/(1-p) = 2 is exact in float32.
    def f(x, b, r):
        torch.manual_seed(SEED)
        return BiasDropoutAddFunction.apply(x, b, r, 0.5, True)

    x, b, r = _inputs((2, 3), torch.float64)
    assert torch.autograd.gradcheck(f, (x, b, r))
    # fast mode (a random projection of the Jacobian): fewer evaluations in the slow interpreter
    x3, b3, r3 = _inputs((2, 3, 4), torch.float64)
    assert torch.autograd.gradcheck(lambda x, r: f(x, None, r), (x3, r3), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, b, r: BiasDropoutAddFunction.apply(x, b, r, 0.3, False), (x3, b3, r3),
                                    fast_mode=True)


def test_bias_grad_deterministic():
    x, b, r = _inputs((777, 40), torch.float32)
    g = torch.randn(777, 40, device=DEVICE)
    grads = []
    for _ in range(2):
        torch.manual_seed(SEED)
        b.grad = None
        bias_dropout_add_fused_train((x, b), r, 0.3).backward(g)
        grads.append(b.grad.clone())
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------------------------------
# dropout semantics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_p0_is_the_plain_sum(dtype):
    x, b, r = _inputs((13, 77), dtype)
    out = bias_dropout_add_fused_train((x, b), r, 0.0)
    plain = ((x.float() + b.float()) + r.float()).to(dtype)  # one float32 sum, rounded once
    assert torch.equal(out, plain)  # bf16 on the CPU too: fusedlib.runtime makes the interpreter round
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(x.grad, g) and torch.equal(r.grad, g)  # nothing dropped, nothing scaled
    assert_close(b.grad, g.double().sum(0), dtype, scale=13**0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_p1_gives_the_residual(dtype):
    x, b, r = _inputs((13, 77), dtype)
    out = bias_dropout_add_fused_train((x, b), r, 1.0)
    assert torch.equal(out, r)
    out.backward(torch.randn_like(out))
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("p", (0.1, 0.5))
def test_kept_fraction_within_4_sigma_and_kept_values_scaled(p):
    # 2^20 elements; x = 1, residual = 0, no bias: out is exactly mask·fp32(1/(1-p)).
    n_rows, h = 256, 4096
    x = torch.ones(n_rows, h, device=DEVICE)
    out = bias_dropout_add_fused_train((x, None), torch.zeros_like(x), p)
    kept = out != 0
    p_used = drop_threshold(p) / 2**KEEP_BITS  # 0.1 -> 6554/65536
    scale32 = torch.tensor(1.0 / (1.0 - p_used), dtype=torch.float32)
    assert torch.equal(out[kept].cpu(), scale32.expand(int(kept.sum())))  # kept values scaled by 1/(1-p')
    n = x.numel()
    sigma = math.sqrt(n * p * (1 - p))  # kept count ~ Binomial(n, 1 - p)
    assert abs(int(kept.sum()) - n * (1 - p)) <= 4 * sigma
    # and no row or column is special: every row keeps within 6 sigma of its share
    per_row = kept.sum(1).double()
    assert (per_row - h * (1 - p)).abs().max() <= 6 * math.sqrt(h * p * (1 - p))


def test_same_seed_same_mask_new_draw_new_mask():
    x, b, r = _inputs((64, 96), torch.float32, requires_grad=False)
    torch.manual_seed(7)
    o1 = bias_dropout_add_fused_train((x, b), r, 0.5)
    o2 = bias_dropout_add_fused_train((x, b), r, 0.5)  # the generator moved on: a new mask
    torch.manual_seed(7)
    o3 = bias_dropout_add_fused_train((x, b), r, 0.5)
    assert torch.equal(o1, o3)
    assert not torch.equal(o1 == r, o2 == r)


def test_forward_and_backward_masks_agree():
    # where the forward dropped an element (out == residual), the backward's dx is 0, and
    # where it kept one, dx = g/(1-p): the backward regenerated the forward's mask
    x, b, r = _inputs((300, 130), torch.float32)
    out = bias_dropout_add_fused_train((x, b), r, 0.3)
    g = torch.randn_like(out)
    out.backward(g)
    kept_fwd = (out - r).detach() != 0
    kept_bwd = x.grad != 0
    assert torch.equal(kept_fwd, kept_bwd)
    assert_close(x.grad[kept_bwd], g[kept_bwd].double() / 0.7, torch.float32)


def _philox_4x32_10(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> tuple[int, int, int, int]:
    """Philox-4x32-10 in plain Python integers (Salmon et al., SC'11; Random123's constants)."""
    m32 = 0xFFFFFFFF
    for _ in range(10):
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p2 >> 32) ^ c1 ^ k0) & m32, p2 & m32, ((p0 >> 32) ^ c3 ^ k1) & m32, p0 & m32
        k0, k1 = (k0 + 0x9E3779B9) & m32, (k1 + 0xBB67AE85) & m32
    return c0, c1, c2, c3


@pytest.mark.parametrize("h", (7, 200))
def test_mask_is_philox_as_documented(h):
    # element (row, col) keeps iff the 16 bits of Philox((col // 8, row, 0, 0), seed) it owns,
    # word (col % 8) // 2, low half for even col, are >= round(p·2^16)
    n_rows, p = 3, 0.37
    seed = philox_seed(DEVICE)
    mask = dropout_mask(seed, n_rows, h, p).cpu()
    s = int(seed.item())
    t = drop_threshold(p)
    expected = torch.zeros(n_rows, h, dtype=torch.bool)
    for row in range(n_rows):
        for col in range(h):
            word = _philox_4x32_10(col // 8, row, 0, 0, s & 0xFFFFFFFF, s >> 32)[(col % 8) // 2]
            bits = (word >> 16) if col % 2 else (word & 0xFFFF)
            expected[row, col] = bits >= t
    assert torch.equal(mask, expected)


@triton.jit
def _write_keep_mask(OUT_ptr, SEED_ptr, row0, pid_n, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_M)
    seed = tl.load(SEED_ptr)
    r, c = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    tl.store(OUT_ptr + r[:, None] * BLOCK_N + c[None, :], _keep_mask(seed, rows, pid_n, T, BLOCK_M, BLOCK_N).to(tl.int8))


@pytest.mark.parametrize("block_m, block_n, row0, pid_n", [(16, 16, 0, 0), (1, 64, 5, 3), (32, 128, 70, 2)])
def test_tile_mask_is_philox_as_documented(block_m, block_n, row0, pid_n):
    # the kernels' tile generator _keep_mask against a pure-Python Philox, element by element
    seed, p = philox_seed(DEVICE), 0.37
    t = drop_threshold(p)
    out = torch.full((block_m, block_n), -1, dtype=torch.int8, device=DEVICE)
    launch(_write_keep_mask, (1,), out.device, out, seed, row0, pid_n, t, BLOCK_M=block_m, BLOCK_N=block_n)
    s = int(seed.item())
    expected = torch.zeros(block_m, block_n, dtype=torch.int8)
    for i in range(block_m):
        for j in range(block_n):
            col = pid_n * block_n + j
            word = _philox_4x32_10(col // 8, row0 + i, 0, 0, s & 0xFFFFFFFF, s >> 32)[(col % 8) // 2]
            expected[i, j] = ((word >> 16) if col % 2 else (word & 0xFFFF)) >= t
    assert torch.equal(out.cpu(), expected)


def test_mask_depends_on_row_and_column_only():
    # the counter is (col // 8, row): a bigger input (other tiles, other grid) repeats the mask of a
    # smaller one on their common rows and columns
    seed = philox_seed(DEVICE)
    small = dropout_mask(seed, 5, 300, 0.5)
    assert torch.equal(small, dropout_mask(seed, 1000, 300, 0.5)[:5])
    assert torch.equal(small, dropout_mask(seed, 5, 3000, 0.5)[:, :300])


def test_drop_threshold_exact_ends():
    assert drop_threshold(0.0) == 0 and drop_threshold(1.0) == 1 << KEEP_BITS
    assert abs(drop_threshold(0.1) / 2**KEEP_BITS - 0.1) <= 2.0 ** -(KEEP_BITS + 1)


# ---------------------------------------------------------------------------------------
# inference: in place when nothing needs grad
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bias", (True, False))
def test_inference_in_place_aliases_x(dtype, bias):
    x, b, r = _inputs((11, 3, 50), dtype, bias=bias, requires_grad=False)
    expected = unfused.bias_dropout_add_masked(x.double(), b.double() if bias else None, r.double(),
                                               torch.ones_like(x, dtype=torch.bool), 0.0)
    r_before = r.clone()
    ptr, version = x.data_ptr(), x._version
    out = bias_dropout_add_fused_inference((x, b), r, 0.1)
    assert out is x and out.data_ptr() == ptr
    assert x._version > version, "the in-place write must bump x's version counter"
    assert_close(out, expected, dtype)
    assert torch.equal(r, r_before)


def test_inference_in_place_under_inference_mode():
    with torch.inference_mode():
        x, b, r = _inputs((6, 40), torch.float32, requires_grad=False)
        expected = x + b + r
        out = bias_dropout_add_fused_inference((x, b), r, 0.1)
        assert out is x and torch.equal(out, expected)


def test_inference_in_place_non_contiguous_x():
    base = torch.randn(40, 24, device=DEVICE)
    x = base.t()  # [24, 40], a view: written through its strides
    r, b = torch.randn(24, 40, device=DEVICE), torch.randn(40, device=DEVICE)
    expected = x.double() + b.double() + r.double()
    out = bias_dropout_add_fused_inference((x, b), r, 0.0)
    assert out is x and out.data_ptr() == base.data_ptr()
    assert_close(base.t(), expected, torch.float32)
    y = torch.randn(5, 4, 6, device=DEVICE).transpose(0, 1)  # [4, 5, 6]: cannot be viewed as [20, 6]
    r3 = torch.randn(4, 5, 6, device=DEVICE)
    expected3 = y.double() + r3.double()
    assert bias_dropout_add_fused_inference((y, None), r3, 0.0) is y
    assert_close(y, expected3, torch.float32)


def test_inference_with_grad_is_not_in_place():
    x, b, r = _inputs((10, 33), torch.float32)
    x_before = x.detach().clone()
    out = bias_dropout_add_fused_inference((x, b), r, 0.5)  # no dropout in inference
    assert out.data_ptr() != x.data_ptr() and torch.equal(x.detach(), x_before)
    assert_close(out, x_before.double() + b.detach().double() + r.detach().double(), torch.float32)
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(x.grad, g) and torch.equal(r.grad, g)
    assert_close(b.grad, g.double().sum(0), torch.float32, scale=10**0.5)


def test_inference_mixed_dtypes_not_in_place():
    x, b, r = _inputs((10, 33), torch.bfloat16, r_dtype=torch.float32, requires_grad=False)
    x_before = x.clone()
    out = bias_dropout_add_fused_inference((x, b), r, 0.1)
    assert out.dtype == torch.float32 and out.data_ptr() != x.data_ptr()
    assert torch.equal(x, x_before)
    assert_close(out, x.double() + b.double() + r.double(), torch.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the interpreter (NumPy)
def test_non_finite_values_go_through_the_dropout_as_in_torch():
    # torch's dropout multiplies by the mask: a dropped NaN stays NaN, a dropped inf becomes
    # NaN (0·inf), and a NaN gradient is NaN whether its element was kept or dropped. (About
    # 330 draws at p = 0.5 per column group: some kept and some dropped under any seed.)
    x = torch.full((16, 64), float("nan"), device=DEVICE)
    x[:, 1::3] = float("inf")
    x[:, 2::3] = 1.0
    x.requires_grad_(True)
    out = bias_dropout_add_fused_train((x, None), torch.zeros(16, 64, device=DEVICE), 0.5)
    kept = out.detach()[:, 2::3] != 0  # the finite column's mask: 2.0 where kept
    assert kept.any() and (~kept).any() and torch.equal(out.detach()[:, 2::3][kept], torch.full_like(out[:, 2::3][kept], 2.0))
    assert out.detach()[:, 0::3].isnan().all()
    inf_cols = out.detach()[:, 1::3]
    assert (inf_cols.isnan() | (inf_cols == float("inf"))).all() and inf_cols.isnan().any() and (inf_cols == float("inf")).any()
    g = torch.ones_like(out)
    g[:, 0::3] = float("nan")
    out.backward(g)
    assert x.grad[:, 0::3].isnan().all()  # dropped ones too
    assert torch.equal((x.grad == 0)[:, 2::3], ~kept)  # the backward regenerates the forward's mask
    assert torch.equal(x.grad[:, 1::3] == 0, inf_cols.isnan())  # the inf columns' mask, as drawn forward


def test_inference_not_in_place_where_x_shares_memory_with_a_read_operand():
    # a residual that is x's transpose, or a bias that is a row of x, would be read after the
    # kernel overwrote it (max error 4.5 once): such calls return a new tensor, x untouched
    x = torch.randn(33, 33, device=DEVICE)
    x_before = x.clone()
    out = bias_dropout_add_fused_inference((x, None), x.t(), 0.0)
    assert out is not x and torch.equal(x, x_before)
    assert_close(out, x_before.double() + x_before.t().double(), torch.float32)
    r = torch.randn(33, 33, device=DEVICE)
    out = bias_dropout_add_fused_inference((x, x[3]), r, 0.0)
    assert out is not x and torch.equal(x, x_before)
    assert_close(out, x_before.double() + x_before[3].double() + r.double(), torch.float32)
    out = bias_dropout_add_fused_inference((x, None), x, 0.0)  # the very same view: in place is exact
    assert out is x and torch.equal(x, x_before + x_before)


def test_inference_tensor_outside_inference_mode_is_not_written():
    # torch forbids writing an inference tensor outside inference mode; the fused path wrote it
    with torch.inference_mode():
        x, b, r = _inputs((6, 40), torch.float32, requires_grad=False)
    x_before = x.clone()
    out = bias_dropout_add_fused_inference((x, b), r, 0.1)
    assert out is not x and torch.equal(x, x_before)
    assert_close(out, x.double() + b.double() + r.double(), torch.float32)


@pytest.mark.parametrize("dual", ("x", "residual", "bias"))
def test_inference_refuses_forward_ad_tangents(dual):
    # the in-place write dropped every tangent but x's (a residual tangent of 1 came back None);
    # the Function refuses forward AD by name, as in training
    import torch.autograd.forward_ad as fwAD
    x, b, r = _inputs((4, 8), torch.float32, requires_grad=False)
    x_before = x.clone()
    with fwAD.dual_level():
        args = {"x": x, "bias": b, "residual": r}
        args[dual] = fwAD.make_dual(args[dual], torch.ones_like(args[dual]))
        with pytest.raises(NotImplementedError, match=f"{dual} carries a forward-mode AD tangent"):
            bias_dropout_add_fused_inference((args["x"], args["bias"]), args["residual"], 0.1)
    assert torch.equal(x, x_before)


def test_expanded_x_in_place_raises():
    x = torch.randn(1, 8, device=DEVICE).expand(4, 8)
    with pytest.raises(ValueError, match="x is written in place in inference"):
        bias_dropout_add_fused_inference((x, None), torch.randn(4, 8, device=DEVICE), 0.0)


@pytest.mark.parametrize("strides", [(1, 1), (4, 1), (2, 1)])
def test_overlapping_x_in_place_raises(strides):
    # rows that overlap in memory cannot hold one sum per element: refused, x left as it was
    base = torch.randn(64, device=DEVICE)
    x = base.as_strided((3, 8), strides)
    before = base.clone()
    with pytest.raises(ValueError, match="x is written in place in inference.*share memory"):
        bias_dropout_add_fused_inference((x, torch.randn(8, device=DEVICE)), torch.randn(3, 8, device=DEVICE), 0.0)
    assert torch.equal(base, before)


def test_strided_x_with_distinct_elements_is_written_in_place():
    # strides whose elements interleave without sharing an address (offsets 0, 2, 4 and 3, 5, 7)
    base = torch.randn(16, device=DEVICE)
    x = base.as_strided((3, 2), (2, 3))
    b, r = torch.randn(2, device=DEVICE), torch.randn(3, 2, device=DEVICE)
    expected = x + b + r
    out = bias_dropout_add_fused_inference((x, b), r, 0.0)
    assert out is x and torch.equal(out, expected)


# ---------------------------------------------------------------------------------------
# Megatron's API and the unfused path
# ---------------------------------------------------------------------------------------


def test_get_bias_dropout_add_selects_megatrons_functions():
    assert get_bias_dropout_add(True, True) is bias_dropout_add_fused_train
    assert get_bias_dropout_add(False, True) is bias_dropout_add_fused_inference
    x, b, r = _inputs((6, 20), torch.float32, requires_grad=False)
    expected = x + b + r
    assert torch.equal(get_bias_dropout_add(True, False)((x, b), r, 0.0), expected)
    out = get_bias_dropout_add(False, False)((x, b), r, 0.7)
    assert out is x and torch.equal(out, expected)  # Megatron's unfused inference is in place too


@pytest.mark.parametrize("training", ["False", 1, None])
def test_unfused_selector_checks_training_when_called(training):
    # any value was accepted, and a wrong one failed only when the returned function ran
    with pytest.raises(TypeError, match="training must be a bool"):
        bias_dropout_add_unfused(training)


def test_numpy_bool_training_is_accepted_by_both_selectors():
    # get_bias_dropout_add took numpy's bool, bias_dropout_add_unfused's function then refused it
    # with "training must be a bool, got bool"
    np = pytest.importorskip("numpy")
    x, b, r = _inputs((6, 20), torch.float32, requires_grad=False)
    want = x + b + r
    for f in (bias_dropout_add_unfused(np.True_), get_bias_dropout_add(np.True_, False)):
        assert torch.equal(f((x, b), r, 0.0), want)


def test_unfused_fp32_residual_connection():
    x, b, r = _inputs((6, 20), torch.bfloat16, r_dtype=torch.float32)
    torch.manual_seed(0)
    out = bias_dropout_add_unfused(True)((x, b), r, 0.3)
    out.backward(torch.randn_like(out))
    assert out.dtype == torch.float32 and r.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_fused_matches_unfused_without_dropout():
    x, b, r = _inputs((40, 24), torch.float32)
    xu, bu, ru = (t.detach().clone().requires_grad_(True) for t in (x, b, r))
    out = bias_dropout_add_fused_train((x, b), r, 0.0)
    ref = bias_dropout_add_unfused(True)((xu, bu), ru, 0.0)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, xu.grad) and torch.equal(r.grad, ru.grad)
    torch.testing.assert_close(b.grad, bu.grad)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bias_dropout_add_func_training_is_torch_dropout(dtype, bias):
    # Megatron's unfused function: residual + F.dropout(x + bias, p), torch's generator and
    # mask, autograd through it; same seed, same mask, the same numbers as the eager ops.
    x, b, r = _inputs((7, 3, 33), dtype, bias=bias)
    x_before, r_before = x.detach().clone(), r.detach().clone()
    torch.manual_seed(SEED)
    out = _bias_dropout_add_func((x, b), r, 0.3, True)
    xe, be, re_ = (t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, b, r))
    torch.manual_seed(SEED)
    expected = re_ + torch.nn.functional.dropout(xe + be if bias else xe, p=0.3, training=True)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(x.detach(), x_before) and torch.equal(r.detach(), r_before)  # training: never in place
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    assert torch.equal(x.grad, xe.grad) and torch.equal(r.grad, g)
    if bias:
        assert torch.equal(b.grad, be.grad)
    kept = x.grad != 0  # dx = g·mask/(1 - p): the mask against the float64 oracle
    want = unfused.bias_dropout_add_masked(x.detach().double(), b.detach().double() if bias else None,
                                           r.detach().double(), kept, 0.3)
    # The eager ops round three times in ``dtype`` (x + b, then ·1/(1-p), then + r), each within
    # u = eps/2 of its own result: |out - want| <= u·(|x + b|·s (1 + u) + |x + b|·s + |want|) + O(u²),
    # s = 1/(1 - p), absolute per element (a relative bound fails where + r cancels).
    u = torch.finfo(dtype).eps / 2
    v = (x.detach().double() + (b.detach().double() if bias else 0)).abs() / (1 - 0.3) * kept
    bound = 1.01 * u * (2 * v + want.abs()) + torch.finfo(dtype).tiny
    assert ((out.detach().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_bias_dropout_add_func_fp32_residual(x_dtype, training, bias):
    # fp32_residual_connection: x and bias are upcast to the residual's float32, never the
    # residual downcast; the result is exact in float32 (no dropout at p = 0).
    x, b, r = _inputs((16, 64), x_dtype, r_dtype=torch.float32, bias=bias)
    out = _bias_dropout_add_func((x, b), r, 0.0, training)
    assert out.dtype == torch.float32
    expected = r.detach().double() + x.detach().double() + (b.detach().double() if bias else 0.0)
    assert_close(out, expected, torch.float32)
    out.backward(torch.ones_like(out))
    assert x.grad.dtype == x_dtype and r.grad.dtype == torch.float32 and (not bias or b.grad.dtype == x_dtype)


def test_bias_dropout_add_func_inference_in_place():
    # Megatron's in-place inference path: same dtype and no grads -> the result is x itself;
    # x of another dtype than the residual is upcast first, a new tensor, so x is left alone.
    x, b, r = _inputs((8, 40), torch.bfloat16, requires_grad=False)
    expected = x.double() + b.double() + r.double()  # (two bf16 roundings in place: within the bf16 tolerance)
    out = _bias_dropout_add_func((x, b), r, 0.5, False)
    assert out is x
    assert_close(x, expected, torch.bfloat16)
    x2, _, r32 = _inputs((8, 40), torch.bfloat16, r_dtype=torch.float32, requires_grad=False)
    x2_before = x2.clone()
    out = _bias_dropout_add_func((x2, None), r32, 0.0, False)
    assert out.dtype == torch.float32 and out.data_ptr() != x2.data_ptr() and torch.equal(x2, x2_before)
    x3, b3, r3 = _inputs((4, 8), torch.float32, requires_grad=True)
    assert _bias_dropout_add_func((x3, b3), r3, 0.0, False) is not x3  # x requires grad: not in place


def test_bias_dropout_add_unfused_calls_bias_dropout_add_func(monkeypatch):
    # as in Megatron-core, the unfused selector goes through _bias_dropout_add_func (patchable)
    from fusedlib.fusions import fused_bias_dropout as mod

    calls = []
    monkeypatch.setattr(mod, "_bias_dropout_add_func", lambda *a: calls.append(a) or a[1])
    x, b, r = _inputs((2, 4), torch.float32, requires_grad=False)
    assert get_bias_dropout_add(False, False)((x, b), r, 0.2) is r
    assert len(calls) == 1 and calls[0][2:] == (0.2, False)


@pytest.mark.parametrize(
    "args, error, match",
    [
        (lambda x, r: ((x,), r, 0.1, True), TypeError, r"x_with_bias must be a pair \(x, bias\)"),
        (lambda x, r: (x, r, 0.1, True), TypeError, r"x_with_bias must be a pair \(x, bias\)"),
        (lambda x, r: (([1.0], None), r, 0.1, True), TypeError, "x must be a torch.Tensor"),
        (lambda x, r: ((x, [0.0]), r, 0.1, True), TypeError, "bias must be a torch.Tensor or None"),
        (lambda x, r: ((x, None), 2.0, 0.1, True), TypeError, "residual must be a torch.Tensor"),
        (lambda x, r: ((x, None), r, 1.5, True), ValueError, r"prob must be a dropout probability in \[0, 1\]"),
        (lambda x, r: ((x, None), r, "0.1", True), ValueError, r"prob must be a dropout probability"),
        (lambda x, r: ((x, None), r, 0.1, "yes"), TypeError, "training must be a bool"),
    ],
)
def test_bias_dropout_add_func_bad_input(args, error, match):
    x, _, r = _inputs((4, 8), torch.float32, bias=False, requires_grad=False)
    with pytest.raises(error, match=match):
        _bias_dropout_add_func(*args(x, r))


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def test_a_signature_that_passed_the_check_skips_it_and_a_bad_one_never_does(count_calls):
    # In training the Function's forward checks its arguments only when no plan matches the call's
    # signature; a plan is remembered only for a signature that passed (the check in the key), and
    # the seed is drawn after the check: a refused call draws no random numbers.
    import fusedlib.fusions.fused_bias_dropout as fbd
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_fwd

    checks = count_calls(fbd, "_check")
    gen = torch.Generator(device="cpu").manual_seed(5)
    x, b, r = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((6, 40), (40,), (6, 40)))
    torch.manual_seed(0)
    out = bias_dropout_add_fused_train((x, b), r, 0.25)
    assert len(checks) == 1
    torch.manual_seed(0)
    assert torch.equal(bias_dropout_add_fused_train([x, b], r, 0.25), out) and len(checks) == 1  # no check
    bias_dropout_add_fused_train((torch.randn(6, 40, device=DEVICE), b), torch.randn(6, 40, device=DEVICE), 0.25)
    assert len(checks) == 1  # new values, the same signature
    bias_dropout_add_fused_train((x[:5], b), r[:5], 0.25)
    assert len(checks) == 2  # a new shape: checked once
    b41 = torch.randn(41, device=DEVICE)
    bias_dropout_add_fused_train((x, b), r, 1.0)  # remembered: True below equals it as a key, but is a bool
    state = torch.random.get_rng_state(), (torch.cuda.get_rng_state() if DEVICE.type == "cuda" else None)
    for _ in range(2):
        with pytest.raises(TypeError, match="given as a Python float, got bool"):
            bias_dropout_add_fused_train((x, b), r, True)
        with pytest.raises(ValueError, match=r"prob must be a dropout probability in \[0, 1\]"):
            bias_dropout_add_fused_train((x, b), r, float("nan"))
        with pytest.raises(TypeError, match=r"prob must be a dropout probability .* got list"):
            bias_dropout_add_fused_train((x, b), r, [0.25])  # unhashable: the check's to refuse
        with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):
            bias_dropout_add_fused_train((x, b41), r, 0.25)
        with pytest.raises(TypeError, match="x must be a torch.Tensor"):
            bias_dropout_add_fused_train((x.tolist(), b), r, 0.25)
        with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):  # the Function itself checks too
            BiasDropoutAddFunction.apply(x, b41, r, 0.25, True)
    assert torch.equal(torch.random.get_rng_state(), state[0])
    assert state[1] is None or torch.equal(torch.cuda.get_rng_state(), state[1])
    # training must be a bool (a tensor flag flipped in place kept the dropout plan); a Real
    # that is not a float is checked at every call (its value may change under one identity)
    with pytest.raises(TypeError, match="training must be a bool, got torch.Tensor"):
        BiasDropoutAddFunction.apply(x, b, r, 0.25, torch.tensor(True))

    class Schedule(float):  # a float subclass: not keyed, checked every call
        pass

    n = len(checks)
    for _ in range(2):
        bias_dropout_add_fused_train((x, b), r, Schedule(0.25))
    assert len(checks) == n + 2
    # inside torch.func transforms torch refuses the Function first: the op checks before it
    with pytest.raises(ValueError, match=r"bias must have shape \[h\]"):
        torch.func.vmap(lambda xx: bias_dropout_add_fused_train((xx, b41), r, 0.25))(x[None])
    # a strided bias: copied, checked every call, the same result; an unchecked kernel-layer call
    # on it first (its plan never stands for the check) changes nothing
    wide = torch.zeros(80, device=DEVICE)
    wide[::2] = b
    bias_dropout_add_fwd(x, wide[::2], r, None, 0.0)
    n = len(checks)
    for _ in range(2):
        torch.manual_seed(0)
        assert torch.equal(bias_dropout_add_fused_train((x, wide[::2]), r, 0.25), out)
    assert len(checks) == n + 2


@pytest.mark.parametrize("prob", (-0.1, 1.5, float("nan"), True, "0.1", None))
@pytest.mark.parametrize("fn", (bias_dropout_add_fused_train, bias_dropout_add_fused_inference))
def test_bad_prob_raises(fn, prob):
    x, b, r = _inputs((4, 8), torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"prob must be a dropout probability in \[0, 1\]"):
        fn((x, b), r, prob)


@pytest.mark.parametrize("prob, got", [(torch.tensor(0.1), "torch.Tensor"), ("0.1", "str"), (None, "NoneType"),
                                       (True, "bool")])
@pytest.mark.parametrize("fn", (bias_dropout_add_fused_train, bias_dropout_add_fused_inference,
                                lambda xb, r, p: _bias_dropout_add_func(xb, r, p, True)))
def test_prob_of_the_wrong_type_says_a_python_float_is_expected(fn, prob, got):
    # a 0-d tensor was reported as a bad value ("got tensor(0.1000)"); it is a wrong type, and
    # reading its value would synchronise with the device. A TypeError, still a ValueError.
    x, b, r = _inputs((4, 8), torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match=rf"prob must be a dropout probability in \[0, 1\] given as a Python float, "
                                        rf"got {got}") as info:
        fn((x, b), r, prob)
    assert isinstance(info.value, ValueError)
    if got == "torch.Tensor":
        assert "synchronise" in str(info.value)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ((torch.randn(4, 8), torch.randn(7)), torch.randn(4, 8)), ValueError,
         r"bias must have shape \[h\] with h = x.shape\[-1\] = 8, got \[7\]"),
        (lambda: ((torch.randn(4, 8), torch.randn(1, 8)), torch.randn(4, 8)), ValueError, "bias must be 1-D"),
        (lambda: ((torch.randn(4, 8), None), torch.randn(4, 9)), ValueError,
         r"residual must have x's shape \[4, 8\], got \[4, 9\]"),
        (lambda: ((torch.randn(4, 8), None), torch.randn(8)), ValueError, "residual must have x's shape"),
        (lambda: ((torch.randn(4, 8).int(), None), torch.randn(4, 8)), TypeError, "x must have dtype"),
        (lambda: ((torch.randn(4, 8), None), torch.randn(4, 8).long()), TypeError, "residual must have dtype"),
        (lambda: (torch.randn(4, 8), torch.randn(4, 8)), TypeError, r"x_with_bias must be a pair \(x, bias\)"),
        (lambda: ((torch.randn(4, 8),), torch.randn(4, 8)), TypeError, "x_with_bias must be a pair"),
        (lambda: (([1.0], None), torch.randn(1)), TypeError, "x must be a torch.Tensor"),
        (lambda: ((torch.randn(4, 8), None), 3.0), TypeError, "residual must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_clear_error(make, error, match):
    xb, r = make()
    move = (lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t)
    xb = tuple(move(t) for t in xb) if isinstance(xb, tuple) else move(xb)
    with pytest.raises(error, match=match):
        bias_dropout_add_fused_train(xb, move(r), 0.1)


def test_mixed_devices_raise():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one device, got x on"):
        bias_dropout_add_fused_train((x, torch.randn(8, device=other)), torch.randn(4, 8, device=DEVICE), 0.1)
    with pytest.raises(ValueError, match="one device, got x on"):
        bias_dropout_add_fused_train((x, None), torch.randn(4, 8, device=other), 0.1)


def test_get_bias_dropout_add_refuses_non_bool_switches():
    # "False" was read as its truth value, True: the training function for inference
    with pytest.raises(TypeError, match="training must be a bool, got str 'False'"):
        get_bias_dropout_add("False", True)
    with pytest.raises(TypeError, match="fused must be a bool, got int 1"):
        get_bias_dropout_add(True, 1)
    import numpy as np

    assert get_bias_dropout_add(np.bool_(False), np.bool_(True)) is bias_dropout_add_fused_inference


# ---------------------------------------------------------------------------------------------
# p = 1 of other real types; inference where only the residual or the bias needs a gradient (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prob", [1, np.float64(1.0)], ids=["int", "numpy"])
def test_p1_of_another_real_type_gives_the_residual(prob):
    # prob = 1 is in [0, 1] whatever its real type: the check's slow path (not a Python float) takes it
    x, b, r = _inputs((5, 12), torch.float32)
    assert torch.equal(bias_dropout_add_fused_train((x, b), r, prob), r)


def test_the_unfused_p1_gives_the_residual():
    x, b, r = _inputs((5, 12), torch.float32)
    out = bias_dropout_add_unfused(True)((x, b), r, 1.0)  # torch's dropout at p = 1: everything dropped
    assert torch.equal(out, r)


@pytest.mark.parametrize("needs_grad", ["residual", "bias"])
def test_inference_where_only_the_residual_or_bias_needs_grad_is_not_in_place(needs_grad):
    # x without grad, but the residual (or the bias) with: the sum must stay in the graph, x untouched
    x, b, r = _inputs((10, 33), torch.float32, requires_grad=False)
    leaf = {"residual": r, "bias": b}[needs_grad].requires_grad_(True)
    x_before = x.clone()
    out = bias_dropout_add_fused_inference((x, b), r, 0.5)
    assert out.data_ptr() != x.data_ptr() and torch.equal(x, x_before)
    assert_close(out, x_before.double() + b.detach().double() + r.detach().double(), torch.float32)
    g = torch.randn_like(out)
    out.backward(g)
    if needs_grad == "residual":
        assert torch.equal(leaf.grad, g)
    else:
        assert_close(leaf.grad, g.double().sum(0), torch.float32, scale=10**0.5)


# ---------------------------------------------------------------------------------------------
# Remembered launches: calls one after another that differ in one argument
# ---------------------------------------------------------------------------------------------


def _kept(g64, keep, p):
    """g·keep/(1 - p'), float64: dx of a forward that dropped with ``keep`` at probability p."""
    return torch.where(keep, g64 * dropout_scale(p), torch.zeros((), dtype=torch.float64, device=DEVICE))


def test_forward_calls_differing_in_one_argument_each_get_their_own_launch():
    # The kernel layer remembers a launch per call signature. Calls on the same x and residual,
    # one after another, that differ only in the bias's presence, the probability, or whether
    # anything is dropped each give their own out = r + keep·(x + b)/(1 - p'); and a float64
    # residual with a float32 x is added in float64 (out is the residual's dtype).
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_fwd

    x, b, r = _inputs((6, 40), torch.float32, requires_grad=False)
    seed = philox_seed(DEVICE)
    x64, b64, r64 = x.double(), b.double(), r.double()
    for bias, p in [(b, 0.25), (None, 0.25), (b, 0.5), (None, 0.5), (b, 0.25), (b, None)]:
        v = x64 + (b64 if bias is not None else 0)
        want = r64 + (v if p is None else _kept(v, dropout_mask(seed, 6, 40, p), p))
        out = bias_dropout_add_fwd(x, bias, r, None if p is None else seed, 0.0 if p is None else p)
        assert_close(out, want, torch.float32)
    r_wide = torch.randn(6, 40, device=DEVICE, dtype=torch.float64)  # not representable in float32
    out = bias_dropout_add_fwd(x, b, r_wide, None, 0.0)
    assert out.dtype == torch.float64
    assert_close(out, r_wide + x64 + b64, torch.float64)


def test_backward_calls_differing_in_one_argument_each_get_their_own_launch():
    # As the forward: on one g, calls that differ only in x's dtype (whether dx must be stored,
    # cast, or is g itself), the probability, or which gradients are asked for each give their
    # own dx = g·keep/(1 - p') and db = its sum over rows.
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_bwd

    rows, h = 6, 40
    g = torch.randn(rows, h, device=DEVICE)
    g64 = g.double()
    seed = philox_seed(DEVICE)
    # nothing dropped: dx is g itself for float32 x; a bfloat16 x gets g rounded to bfloat16
    for x_dtype in (torch.float32, torch.bfloat16, torch.float32):
        dx, db = bias_dropout_add_bwd(g, x_dtype, None, 0.0, need_dbias=True)
        assert dx.dtype == x_dtype and torch.equal(dx, g.to(x_dtype))
        assert_close(db, g64.sum(0), torch.float32, scale=rows**0.5)
    for p in (0.25, 0.5, 0.25):
        dx64 = _kept(g64, dropout_mask(seed, rows, h, p), p)
        dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dbias=True)
        assert_close(dx, dx64, torch.float32)
        assert_close(db, dx64.sum(0), torch.float32, scale=rows**0.5)
    # dx alone, then db as well; db alone, then dx as well (p = 0.75: a signature not seen above)
    p = 0.75
    dx64 = _kept(g64, dropout_mask(seed, rows, h, p), p)
    dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dbias=False)
    assert db is None
    assert_close(dx, dx64, torch.float32)
    dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dbias=True)
    assert_close(dx, dx64, torch.float32)
    assert_close(db, dx64.sum(0), torch.float32, scale=rows**0.5)
    p = 0.125
    dx64 = _kept(g64, dropout_mask(seed, rows, h, p), p)
    dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dx=False, need_dbias=True)
    assert dx is None
    assert_close(db, dx64.sum(0), torch.float32, scale=rows**0.5)
    dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dx=True, need_dbias=True)
    assert_close(dx, dx64, torch.float32)
    assert_close(db, dx64.sum(0), torch.float32, scale=rows**0.5)


def test_training_and_evaluation_on_one_signature_each_get_their_own_launch():
    # The Function's forward remembers its checked launch per signature: training, evaluation
    # and another probability on the same tensors, one after another, each give their own out.
    x, b, r = _inputs((6, 40), torch.float32)  # requires grad: evaluation is not done in place
    x64, b64, r64 = (t.detach().double() for t in (x, b, r))
    for prob, training in [(0.5, True), (0.5, False), (0.5, True), (0.25, True)]:
        torch.manual_seed(SEED)
        out = BiasDropoutAddFunction.apply(x, b, r, prob, training)
        keep = _replayed_mask((6, 40), prob) if training else torch.ones(6, 40, dtype=torch.bool, device=DEVICE)
        p_used = drop_threshold(prob) / 2**KEEP_BITS if training else 0.0
        assert_close(out, unfused.bias_dropout_add_masked(x64, b64, r64, keep, p_used), torch.float32)


def test_float64_bias_gradient_over_a_persistent_grid_stays_float64():
    # More row tiles than the persistent grid has programs (the interpreter's 2 "SMs" at 4
    # programs each: 8 programs for 25 tiles of 4 rows), so each program loops over several
    # tiles; the per-program partial sums of a float64 db are added in float64 in the second
    # stage, and db comes out float64 (the default db_dtype is the accumulation dtype). Also
    # for a float32 g of a float64 x (a float32 residual): the accumulation dtype is float64.
    # p = 0.5: 1/(1 - p') = 2, exact, so dx is exact and db is float64 sums (TOL[float64]).
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_bwd
    from fusedlib.kernels.launch import Tile

    rows, h, p = 100, 40, 0.5
    tile = Tile(BLOCK_M=4, BLOCK_N=64, num_warps=4, programs_per_sm=4)
    seed = philox_seed(DEVICE)
    keep = dropout_mask(seed, rows, h, p)
    for g in (torch.randn(rows, h, device=DEVICE, dtype=torch.float64), torch.randn(rows, h, device=DEVICE)):
        dx64 = _kept(g.double(), keep, p)
        dx, db = bias_dropout_add_bwd(g, torch.float64, seed, p, need_dbias=True, tile=tile)
        assert dx.dtype == db.dtype == torch.float64
        assert_close(dx, dx64, torch.float64)
        assert_close(db, dx64.sum(0), torch.float64)


def test_training_at_p_0_draws_no_random_numbers():
    # p = 0 in training drops nothing: no key is drawn (torch's dropout draws none at p = 0 either),
    # so later masks are the ones they would have been, and the gradient of x is g itself
    x, b, r = _inputs((6, 40), torch.float32)
    state = torch.random.get_rng_state(), (torch.cuda.get_rng_state() if DEVICE.type == "cuda" else None)
    out = bias_dropout_add_fused_train((x, b), r, 0.0)
    assert torch.equal(torch.random.get_rng_state(), state[0])
    assert state[1] is None or torch.equal(torch.cuda.get_rng_state(), state[1])
    assert_close(out, x.detach().double() + b.detach().double() + r.detach().double(), torch.float32)
    g = torch.randn(out.shape, device=DEVICE)
    out.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_transposed_residual_gives_a_contiguous_out(dtype):
    # a dense residual whose strides are not row-major (a transpose): out is a new contiguous
    # tensor of x's shape, written row by row, not a tensor with the residual's strides
    x, b, _ = _inputs((6, 40), dtype)
    r = torch.randn(40, 6, device=DEVICE).to(dtype).t().requires_grad_(True)
    assert not r.is_contiguous()
    _check_train(x, b, r, 0.3)


def test_a_given_tile_is_each_calls_own(spy_launches):
    # The tuner tries tiles one after another on one signature: each call launches with its own
    # tile, forward and backward, and the values do not depend on it.
    from fusedlib.kernels.bias_dropout_add import bias_dropout_add_bwd, bias_dropout_add_fwd
    from fusedlib.kernels.launch import Tile

    def seen():
        return [(c.kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in spy_launches
                if c.kernel.startswith("_bias_dropout_add")]

    x, b, r = _inputs((6, 40), torch.float32, requires_grad=False)
    g = torch.randn(6, 40, device=DEVICE)
    seed = philox_seed(DEVICE)
    p = 0.5
    keep = dropout_mask(seed, 6, 40, p)
    out64 = r.double() + _kept(x.double() + b.double(), keep, p)
    dx64 = _kept(g.double(), keep, p)
    for tile in (Tile(BLOCK_M=2, BLOCK_N=16, num_warps=4, programs_per_sm=4),
                 Tile(BLOCK_M=4, BLOCK_N=32, num_warps=4, programs_per_sm=4)):
        spy_launches.clear()
        out = bias_dropout_add_fwd(x, b, r, seed, p, tile=tile)
        dx, db = bias_dropout_add_bwd(g, torch.float32, seed, p, need_dbias=True, tile=tile)
        assert seen() == [("_bias_dropout_add_fwd_kernel", tile.BLOCK_M, tile.BLOCK_N),
                        ("_bias_dropout_add_bwd_kernel", tile.BLOCK_M, tile.BLOCK_N)]
        assert_close(out, out64, torch.float32)
        assert_close(dx, dx64, torch.float32)
        assert_close(db, dx64.sum(0), torch.float32, scale=6**0.5)
