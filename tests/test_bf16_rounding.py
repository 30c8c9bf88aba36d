"""bfloat16 outputs are rounded to nearest even, on the GPU and in Triton's CPU interpreter.

Every kernel computes in float32 and rounds once when it stores a bfloat16 result. Compiled
for the GPU that rounding is to nearest even; Triton's interpreter truncated instead (Triton
3.6 and 3.9), which :func:`fusedlib.runtime._fix_interpreter_bf16` repairs. The tests here are
exact where the loose per-dtype tolerances of the other test files (4 ulps) would hide a
one-ulp bias:

* conversions: float32/float16/float64 -> bfloat16 inside a kernel (``.to`` and the implicit
  cast of ``tl.store``) equal the correctly rounded value bit for bit, and bfloat16 -> float32
  is exact (all 65536 bit patterns);
* the three cases reported against the CPU path give exactly the correctly rounded results;
* for every op that stores bfloat16 (forward and backward outputs), each output lies within
  half a bfloat16 ulp of the float64 reference plus E, the float32 computation's own error
  bound, derived per op below; and the mean signed rounding error, in ulps, over the
  thousands of elements where E is negligible is ~0 (truncation gives about -0.5).

Notation of the bounds: u = 2^-24 is float32's unit roundoff (one +, -, * or fma: relative
error <= u); one exp, log, reciprocal, division or square root costs at most Q = 4u (the GPU's
``ex2.approx``/``lg2.approx``/``rcp.approx``/``div.full``/``sqrt.approx`` are within 2 float32
ulps; NumPy's are within one); exp(z) evaluated as ex2(z·log2 e) also carries the rounding of
z·log2 e, a relative error of u·|z|. A sum of n float32 terms errs by at most n·u·sum|terms|.
Each bound E is about twice the error these counts give (the margin named "x2"); it is
at most a few hundredths of a bfloat16 half-ulp (2^-9 relative) wherever the output is not
much smaller than the terms it is computed from.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import triton
import triton.language as tl

import fusedlib.kernels.softmax as ksoftmax
from fusedlib import runtime, unfused
from fusedlib.fusions.fused_bias_dropout import bias_dropout_add_fused_train
from fusedlib.fusions.fused_bias_geglu import bias_geglu_impl
from fusedlib.fusions.fused_bias_gelu import bias_gelu_impl
from fusedlib.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from fusedlib.fusions.fused_softmax import (
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
)
from fusedlib.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from fusedlib.kernels.bias_dropout_add import KEEP_BITS, drop_threshold, dropout_mask, philox_seed
from fusedlib.kernels.cross_entropy import FWD_TILES
from fusedlib.kernels.launch import pick

from conftest import DEVICE  # noqa: I001

BF16 = torch.bfloat16
U = 2.0**-24  # float32 unit roundoff
Q = 4 * U  # one exp / log / reciprocal / division / square root (see the module docstring)
C0 = math.sqrt(2 / math.pi)  # tanh-GeLU constants, as in the kernels
C1 = 0.044715
C2 = 3 * C0 * C1

ROWS, H = 48, 199  # 9552 outputs per [ROWS, H] tensor (odd width): enough for the mean-error check
#: The mean-error check needs at least this many informative elements (see _mean_error_bound).
N_STATS = 2000
#: An element enters the mean-error check when E <= ulp/64: its float32 error then moves the
#: rounding error by at most 1/64 ulp.
STATS_E_FRACTION = 1 / 64


def _randn(shape, scale=1.0):
    return (scale * torch.randn(shape, device=DEVICE)).to(BF16)


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns in [0, 0x7F80] -> their bfloat16 values, as float64."""
    return bits.to(torch.int16).view(BF16).double()


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The bfloat16 ulp at |v| (float64): 2^(floor(log2|v|) - 7), and 2^-133 below 2^-126."""
    _, e = torch.frexp(v.abs())  # |v| = m·2^e, m in [0.5, 1): floor(log2|v|) = e - 1
    return torch.ldexp(torch.ones_like(v), (e - 8).clamp(min=-133))


def _mean_error_bound(n: int) -> float:
    """|mean| bound of n rounding errors in ulps under round-to-nearest, failing with p < 1e-9.

    Each error lies in [-1/2 - 1/64, 1/2 + 1/64] (half an ulp plus the float32 error admitted by
    STATS_E_FRACTION) and has mean within 1/64 of 0 (nearest-even splits ties evenly; the
    fraction cut off is spread evenly over an ulp); Hoeffding's inequality gives a deviation
    of the mean above 1.04·sqrt(ln(2e9)/(2n)) with probability below 1e-9. Truncation makes
    the mean about -1/2: for n >= N_STATS the bound is below 0.1.
    """
    width = 1 + 2 * STATS_E_FRACTION
    return width * math.sqrt(math.log(2e9) / (2 * n)) + STATS_E_FRACTION


def _prepare(name, out, ref, err):
    assert out.dtype == BF16, f"{name}: dtype {out.dtype}"
    out = out.detach().cpu()
    ref = ref.detach().double().cpu()
    err = torch.as_tensor(err, dtype=torch.float64).cpu().expand_as(ref)
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all(), f"{name}: non-finite values"
    return out, ref, err


def _assert_within_half_ulp(name: str, out: torch.Tensor, ref: torch.Tensor, err) -> None:
    """``out`` (bfloat16) is the correct rounding of some value within ``err`` of ``ref`` (float64).

    That is: the interval of reals that round to ``out`` (half the gap to each bfloat16
    neighbour on either side) meets [ref - err, ref + err].
    """
    out, ref, err = _prepare(name, out, ref, err)
    o = out.double()
    mag_bits = out.view(torch.int16).to(torch.int32) & 0x7FFF
    mag = o.abs()
    above = _bf16_from_bits(mag_bits + 1)
    below = torch.where(mag_bits > 0, _bf16_from_bits((mag_bits - 1).clamp(min=0)), -above)
    lo_mag, hi_mag = (mag + below) / 2, (mag + above) / 2  # the reals that round to |out|
    neg = torch.signbit(o)
    lo = torch.where(neg, -hi_mag, lo_mag)
    hi = torch.where(neg, -lo_mag, hi_mag)
    bad = (lo > ref + err) | (hi < ref - err)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        ulp = _bf16_ulp(ref)
        rows = [(i, o[tuple(i)].item(), ref[tuple(i)].item(), ((o - ref) / ulp)[tuple(i)].item(),
                 (err / ulp)[tuple(i)].item()) for i in idx]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} bfloat16 outputs are not a rounding of the "
            f"float64 reference within its float32 error bound; (index, out, ref, out - ref in ulps, "
            f"bound in ulps): {rows}")


def _assert_unbiased(name: str, out: torch.Tensor, ref: torch.Tensor, err) -> None:
    """The mean signed rounding error (ulps, > 0 away from zero) is ~0: see _mean_error_bound.

    Over the elements where err <= ulp/64 and ref is not itself a bfloat16 value; there must be
    at least N_STATS of them.
    """
    out, ref, err = _prepare(name, out, ref, err)
    ulp = _bf16_ulp(ref)
    exact = ref.to(BF16).double() == ref  # a bfloat16 value: nothing to round
    use = (ref != 0) & ~exact & (err <= STATS_E_FRACTION * ulp)
    n = int(use.sum())
    assert n >= N_STATS, f"{name}: only {n} elements for the mean-error check, need {N_STATS}"
    signed = (torch.sign(ref) * (out.double() - ref) / ulp)[use]
    mean = signed.mean().item()
    bound = _mean_error_bound(n)
    assert abs(mean) < bound, (
        f"{name}: mean rounding error {mean:+.3f} ulp over {n} elements, |mean| must be < {bound:.3f} "
        "(about -0.5 means truncation)")


def _assert_rounded(name: str, out: torch.Tensor, ref: torch.Tensor, err, stats: bool = True) -> None:
    """Both checks (the mean-error one only with ``stats``); ``err`` is E, float64, like ``ref``."""
    _assert_within_half_ulp(name, out, ref, err)
    if stats:
        _assert_unbiased(name, out, ref, err)


def test_the_checks_catch_truncation():
    """Both checks pass a correctly rounded tensor and fail a truncated one (they can fail)."""
    ref32 = 3 * torch.randn(5000)
    ref = ref32.double()
    nearest = ref32.to(BF16)  # PyTorch: float32 -> bfloat16 to nearest even
    truncated = (ref32.view(torch.int32) >> 16).to(torch.int16).view(BF16)
    _assert_rounded("nearest", nearest, ref, 0.0)
    with pytest.raises(AssertionError, match="not a rounding"):
        _assert_within_half_ulp("truncated", truncated, ref, 0.0)
    with pytest.raises(AssertionError, match="mean rounding error -0.[45]"):
        _assert_unbiased("truncated", truncated, ref, 0.0)


# ---------------------------------------------------------------------------------------------
# The rounding itself
# ---------------------------------------------------------------------------------------------


def test_interpreter_rounding_is_fixed():
    """Kernels run compiled (the GPU rounds), or in an interpreter that fusedlib patched."""
    if runtime.INTERPRET_ON_CPU:
        assert runtime.BF16_ROUNDING == "patched", (
            f"Triton {triton.__version__}'s interpreter could not be patched to round bfloat16 "
            f"({runtime.BF16_ROUNDING}): bfloat16 results on the CPU are truncated")
        assert runtime._fix_interpreter_bf16() == "patched"  # idempotent: a second call changes nothing
    else:
        assert runtime.BF16_ROUNDING == "compiled"


def test_patch_fails_soft_without_hooks(monkeypatch, caplog):
    """A Triton whose interpreter lacks the hooks: a warning and a status, no exception."""
    from triton.runtime import interpreter

    class _BareBuilder:  # an InterpreterBuilder without cast_impl / create_fp_to_fp
        pass

    monkeypatch.setattr(interpreter, "InterpreterBuilder", _BareBuilder)
    with caplog.at_level(logging.WARNING, logger="fusedlib"):
        status = runtime._fix_interpreter_bf16()
    assert status.startswith("unavailable: ") and "cast_impl" in status
    assert "cannot fix bfloat16 rounding" in caplog.text


@triton.jit
def _convert_kernel(X_ptr, OUT_ptr, n, HOW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X_ptr + offs, mask=mask)
    if HOW == "to":  # an explicit cast to the output's dtype
        tl.store(OUT_ptr + offs, x.to(OUT_ptr.dtype.element_ty), mask=mask)
    else:  # "store": tl.store casts implicitly
        tl.store(OUT_ptr + offs, x, mask=mask)


def _convert(x: torch.Tensor, dtype: torch.dtype, how: str) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = 4096
    runtime.launch(_convert_kernel, (triton.cdiv(x.numel(), block),), x.device, x, out, x.numel(), HOW=how,
                   BLOCK=block)
    return out


def _same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bit patterns, or both NaN (NaN payloads differ between converters)."""
    return (a.view(torch.int16) == b.view(torch.int16)) | (torch.isnan(a) & torch.isnan(b))


@pytest.mark.parametrize("how", ["to", "store"])
def test_float32_to_bfloat16_is_round_to_nearest_even(how):
    # Every bfloat16 (sign, exponent and top 7 mantissa bits) with low halves that probe each
    # rounding case: exact, below a tie, a tie (odd and even neighbours), above, just below the
    # next value; subnormals, overflow to inf, inf and NaN come with the high halves.
    high = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).reshape(-1)
    x = (bits - (bits >= 1 << 31).long() * (1 << 32)).to(torch.int32).view(torch.float32)  # the float32s
    out = _convert(x.to(DEVICE), BF16, how).cpu()
    expected = x.to(BF16)  # PyTorch's float32 -> bfloat16: round to nearest even
    ok = _same_bits_or_both_nan(out, expected)
    assert ok.all(), (
        f"{int((~ok).sum())} float32 -> bfloat16 conversions differ from round-to-nearest-even, e.g. "
        f"{[(hex(int(bits[i])), out[i].item(), expected[i].item()) for i in (~ok).nonzero()[:5, 0].tolist()]}")
    assert torch.isnan(out[torch.isnan(x)]).all()


def _nearest_bf16(x: torch.Tensor, toward_zero: bool = False) -> torch.Tensor:
    """The correctly rounded bfloat16 of float64 ``x``, as float64, computed exactly in float64.

    |x| = (k + f)·ulp with k an integer and 0 <= f < 1 (exact: ulp is a power of two): nearest
    even is k·ulp or (k + 1)·ulp, ties to even k, and inf from 2^128·(1 - 2^-9) up; toward zero
    is k·ulp, at most the largest finite bfloat16. NaN and inf stay.
    """
    fin = torch.isfinite(x)
    ax = x.abs().where(fin, torch.zeros_like(x))
    ulp = _bf16_ulp(ax.where(ax > 0, torch.ones_like(ax)))
    k = torch.floor(ax / ulp)
    f = ax / ulp - k
    if toward_zero:
        r = torch.minimum(k * ulp, torch.full_like(ax, (2 - 2.0**-7) * 2.0**127))
    else:
        up = (f > 0.5) | ((f == 0.5) & (torch.remainder(k, 2) == 1))
        r = torch.where(up, k + 1, k) * ulp
        r = torch.where(r >= 2.0**128, math.inf, r)  # rounded past the largest finite bfloat16
    return torch.where(fin, torch.copysign(r, x), x)


def _random_float64(n: int) -> torch.Tensor:
    """n float64 values of either sign and every magnitude bfloat16 has, subnormal to overflow."""
    mant = 1 + torch.rand(n, dtype=torch.float64)
    sign = torch.where(torch.rand(n) < 0.5, -1.0, 1.0).double()
    return sign * torch.ldexp(mant, torch.randint(-140, 129, (n,)))


SPECIALS = [0.0, -0.0, 1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, float("inf"), float("-inf"), float("nan"), 3.4e38,
            -3.4e38, 3.39e38, 2.0**-133, 2.0**-134, 3 * 2.0**-135, 3 * 2.0**-134, 1e-40]
#: float64 values just off a bfloat16 tie, where rounding to float32 first and then to bfloat16
#: (twice to nearest) lands on the tie and goes the wrong way: 1 + 2^-8 is the tie between 1
#: and 1 + 2^-7, 1 + 3·2^-8 between 1 + 2^-7 and 1 + 2^-6, 2^-134 between 0 and 2^-133.
NEAR_TIES = [1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 1 + 3 * 2.0**-8 - 2.0**-30, 2.0**-134 + 2.0**-160]


def _equal_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))


def test_float16_and_float64_to_bfloat16():
    # float16: every finite and special value; its conversion to float32 is exact, so the
    # correctly rounded bfloat16 is PyTorch's float32 -> bfloat16.
    h = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for how in ("to", "store"):
        out = _convert(h.to(DEVICE), BF16, how).cpu()
        assert _same_bits_or_both_nan(out, h.float().to(BF16)).all(), f"float16 -> bfloat16 ({how})"
    # float64: random values, specials, and NEAR_TIES, which a double rounding through float32
    # gets wrong (on the GPU, sm_90 has a single cvt.rn.bf16.f64)
    x = torch.cat([_random_float64(20000), torch.tensor(SPECIALS + NEAR_TIES, dtype=torch.float64)])
    expected = _nearest_bf16(x)
    for how in ("to", "store"):
        out = _convert(x.to(DEVICE), BF16, how).cpu().double()
        ok = _equal_or_both_nan(out, expected)
        wrong = (~ok).nonzero()[:5, 0].tolist()
        assert ok.all(), (f"float64 -> bfloat16 ({how}): {int((~ok).sum())} wrong, e.g. "
                          f"{[(x[i].item(), out[i].item(), expected[i].item()) for i in wrong]}")


def _helper_bf16(data, rtz: bool = False) -> torch.Tensor:
    """runtime._to_bf16_bits (the interpreter patch's rounding), as float64 values."""
    return torch.from_numpy(runtime._to_bf16_bits(data, rtz=rtz).astype("int16")).view(BF16).double()


def test_interpreter_rounding_helpers():
    """The patch's NumPy rounding (device-independent): one correct rounding from every source."""
    x = torch.cat([_random_float64(20000), torch.tensor(SPECIALS + NEAR_TIES, dtype=torch.float64)])
    for rtz in (False, True):
        ok = _equal_or_both_nan(_helper_bf16(x.numpy(), rtz), _nearest_bf16(x, toward_zero=rtz))
        assert ok.all(), f"float64 (rtz={rtz}): {x[~ok][:5].tolist()}"
    x32 = torch.randint(-(1 << 31), 1 << 31, (20000,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    for rtz in (False, True):
        ok = _equal_or_both_nan(_helper_bf16(x32.numpy(), rtz), _nearest_bf16(x32.double(), toward_zero=rtz))
        assert ok.all(), f"float32 (rtz={rtz}): {x32[~ok][:5].tolist()}"
    assert torch.isnan(_helper_bf16(x32[torch.isnan(x32)].numpy())).all()
    ints = torch.tensor([0, 1, -1, 255, 257, 259, -259, 2**24 + 1, 3 * 2**29 + 2**20, -(2**31)])
    for dt in (torch.int32, torch.int64):
        ok = _equal_or_both_nan(_helper_bf16(ints.to(dt).numpy()), _nearest_bf16(ints.double()))
        assert ok.all(), f"{dt}: {ints[~ok].tolist()}"
    # bfloat16 -> float32 is exact for every bit pattern (subnormals included)
    b = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    wide = torch.from_numpy(runtime._bf16_bits_to_f32(b.numpy().view("uint16")))
    assert _equal_or_both_nan(wide.double(), b.view(BF16).double()).all()


def test_bfloat16_to_wider_types_is_exact():
    """All 65536 bfloat16 bit patterns widen exactly (subnormals included) and round-trip."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
    b = bits.to(torch.int16).view(BF16)
    # float64: without the signaling NaNs (quiet bit 0x0040 clear), whose float32 -> float64 step
    # (Triton's own code in the interpreter) raises NumPy's invalid-value warning
    signaling = torch.isnan(b) & ((bits & 0x0040) == 0)
    for dtype in (torch.float32, torch.float64):
        if dtype == torch.float64:
            b = b[~signaling]
        w = _convert(b.to(DEVICE), dtype, "to").cpu()
        ok = (w == b.to(dtype)) | (torch.isnan(w) & torch.isnan(b))
        assert ok.all(), f"bfloat16 -> {dtype}: {int((~ok).sum())} wrong"
    b = bits.to(torch.int16).view(BF16)
    back = _convert(_convert(b.to(DEVICE), torch.float32, "to"), BF16, "store").cpu()
    assert _same_bits_or_both_nan(back, b).all(), "bfloat16 -> float32 -> bfloat16 is not the identity"


# ---------------------------------------------------------------------------------------------
# The reported cases, exactly
# ---------------------------------------------------------------------------------------------


def test_reported_bias_gelu_case():
    y = torch.tensor([[4.03125, 3.140625]], dtype=BF16, device=DEVICE, requires_grad=True)
    out = bias_gelu_impl(y, torch.zeros(2, dtype=BF16, device=DEVICE))
    # gelu(4.03125) = 4.03125 - 6.0e-5 and gelu(3.140625) = 3.140625 - 0.0023: within half an
    # ulp (1/64, 1/128) of the input, so they round back to it; truncation gives the one below
    assert out.tolist() == [[4.03125, 3.140625]]
    out.backward(torch.ones_like(out))
    # gelu'(4.03125) = 1.00029 and gelu'(3.140625) = 1.00776: 1 + 2^-7 = 1.0078125 is the nearer
    assert y.grad.tolist() == [[1.0, 1.0078125]]


def test_reported_layer_norm_case():
    x = torch.tensor([[0.0, 1.0, 2.0]], dtype=BF16, device=DEVICE)
    y = fused_layer_norm(x, torch.ones(3, dtype=BF16, device=DEVICE), torch.zeros(3, dtype=BF16, device=DEVICE))
    # (x - 1)/sqrt(2/3 + 1e-5) = -+1.2247357: nearer to 1.2265625 than to 1.21875
    assert y.tolist() == [[-1.2265625, 0.0, 1.2265625]]


# ---------------------------------------------------------------------------------------------
# Every op that stores bfloat16, forward and backward
# ---------------------------------------------------------------------------------------------


def _gelu_parts(x):
    """tanh-GeLU of float64 x: value, derivative, and the kernels' float32 error bound for each.

    Value 0.5·x·(1 + t), t = tanh(z), z = c0·x·(1 + c1·x²), tanh via e = exp(-2|z|) as
    (1 - e)/(1 + e). Error of t (absolute): from z (6 roundings, relative 6u) sech²(z)·|z|·6u <=
    2.7u; from e (Q + 2|z|u relative) at most 2·e·(Q + 2|z|u) <= 8u; the two sums and the
    division u + u + Q: 17u. Value: 0.5|x|·(17u + 2u) + u|x| + the rounding of x = y + b through
    gelu' <= 1.13 (1.13u|x|): 11.6u|x|; x2: 24u|x|. Derivative 0.5x(1 - t²)(c0 + c2x²) +
    0.5(1 + t): 1 - t² errs by 2·17u + 2u = 36u, times 0.5|x|(c0 + c2x²) with 4 more roundings:
    20u·|x|(c0 + c2x²); 0.5(1 + t): 10u; x's rounding through gelu'' <= 0.8: 0.8u|x|; the sum
    u·1.13: total u·(20|x|(c0 + c2x²) + 12 + 0.8|x|); x2: 40u·(1 + |x| + |x|(c0 + c2x²)).
    """
    t = torch.tanh(C0 * x * (1 + C1 * x * x))
    a = 0.5 * x * (1 + t)
    da = 0.5 * x * ((1 - t * t) * (C0 + C2 * x * x)) + 0.5 * (1 + t)
    ax = x.abs()
    return a, da, 24 * U * ax, 40 * U * (1 + ax + ax * (C0 + C2 * x * x))


def _silu_parts(x):
    """SiLU of float64 x: value, derivative, and the kernels' float32 error bounds.

    σ = r = 1/(1 + e) for x >= 0, e·r for x < 0, e = exp(-|x|) (relative error Q + u|x|): σ errs
    relatively by Q + 2u + e·(Q + u|x|) <= 10u (x >= 0), or (Q + u|x|) + 10u + u = (15 + |x|)u
    (x < 0); silu = x·σ adds u, x's own rounding (x = y + b) adds |silu'|·u|x| <= 1.1u|x|:
    E(silu) <= u·((16 + |x|)·|silu| + 1.1|x|). silu' = σ·(1 + x(1 - σ)): with Δσ <= (15 + |x|)u·σ,
    |1 + x(1 - σ)| <= 1 + |x| and 4 roundings, E(silu') <= u·σ·(1 + 2|x|)(18 + |x|) + 0.5u|x|
    (x's rounding through |silu''| <= 0.5). Both x2.
    """
    s = torch.sigmoid(x)
    a = x * s
    da = s * (1 + x * (1 - s))
    ax = x.abs()
    return a, da, 2 * U * ((16 + ax) * a.abs() + 1.1 * ax), 2 * U * (s * (1 + 2 * ax) * (18 + ax) + 0.5 * ax)


def test_bias_gelu():
    y = _randn((H, ROWS), 2.0).t()  # non-contiguous [ROWS, H]
    b = _randn((H,), 0.5)
    g = _randn((ROWS, H))
    yv, bv = y.clone().requires_grad_(True), b.clone().requires_grad_(True)
    out = bias_gelu_impl(yv, bv)
    out.backward(g)
    x = y.double() + b.double()
    a, da, e_a, e_da = _gelu_parts(x)
    dy = da * g.double()
    e_dy = e_da * g.double().abs() + 2 * U * dy.abs()  # times g: one rounding (x2)
    _assert_rounded("bias_gelu out", out, a, e_a)
    _assert_rounded("bias_gelu d input", yv.grad, dy, e_dy)
    # d bias: the float32 sum over ROWS rows of dy (float32 values): ROWS·u·sum|dy| more (x2)
    _assert_rounded("bias_gelu d bias", bv.grad, dy.sum(0), (e_dy + 2 * ROWS * U * dy.abs()).sum(0), stats=False)


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_glu(act, with_bias):
    y = _randn((ROWS, 2 * H), 2.0)
    b = _randn((2 * H,), 0.5) if with_bias else None
    g = _randn((ROWS, H))
    yv = y.clone().requires_grad_(True)
    bv = b.clone().requires_grad_(True) if with_bias else None
    out = (bias_swiglu_impl if act == "swiglu" else bias_geglu_impl)(yv, bv)
    out.backward(g)
    y64 = y.double() + (b.double() if with_bias else 0.0)
    x1, x2 = y64[:, :H], y64[:, H:]
    a, da, e_a, e_da = (_silu_parts if act == "swiglu" else _gelu_parts)(x1)
    g64 = g.double()
    # out = act(x1)·x2: act's error times |x2|, x2's rounding (bias) and the product: 2 roundings (x2)
    _assert_rounded(f"{act} out", out, a * x2, (e_a + 4 * U * a.abs()) * x2.abs())
    # dy1 = g·x2·act'(x1) (3 roundings with x2's), dy2 = g·act(x1) (2): x2
    dy = torch.cat([g64 * x2 * da, g64 * a], dim=1)
    e_dy = torch.cat([(g64 * x2).abs() * (e_da + 6 * U * da.abs()), g64.abs() * (e_a + 4 * U * a.abs())], dim=1)
    _assert_rounded(f"{act} d input", yv.grad, dy, e_dy)
    if with_bias:
        _assert_rounded(f"{act} d bias", bv.grad, dy.sum(0), (e_dy + 2 * ROWS * U * dy.abs()).sum(0), stats=False)


def test_weighted_swiglu():
    y = _randn((ROWS, 2 * H), 2.0)
    w = _randn((ROWS, 1))
    g = _randn((ROWS, H))
    yv, wv = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = weighted_bias_swiglu_impl(yv, None, wv)
    out.backward(g)
    x1, x2, w64, g64 = y[:, :H].double(), y[:, H:].double(), w.double(), g.double()
    a, da, e_a, e_da = _silu_parts(x1)
    # one more product (by w) than test_glu: 2u more (x2)
    _assert_rounded("weighted swiglu out", out, a * x2 * w64, (e_a + 6 * U * a.abs()) * (x2 * w64).abs())
    dy = torch.cat([g64 * x2 * da * w64, g64 * a * w64], dim=1)
    e_dy = torch.cat([(g64 * x2 * w64).abs() * (e_da + 8 * U * da.abs()), (g64 * w64).abs() * (e_a + 6 * U * a.abs())],
                     dim=1)
    _assert_rounded("weighted swiglu d input", yv.grad, dy, e_dy)
    # d weights = sum over H of g·act(x1)·x2 in float32, rounded by PyTorch: H·u·sum|terms| (x2)
    terms = g64 * a * x2
    e_terms = (g64 * x2).abs() * (e_a + 6 * U * a.abs())
    _assert_rounded("weighted swiglu d weights", wv.grad, terms.sum(1, keepdim=True),
                    (e_terms + 2 * H * U * terms.abs()).sum(1, keepdim=True), stats=False)


def test_weighted_squared_relu():
    x = _randn((H, ROWS), 2.0).t()  # non-contiguous [ROWS, H]
    w = _randn((ROWS, 1))
    g = _randn((ROWS, H))
    xv, wv = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = weighted_squared_relu_impl(xv, wv)
    out.backward(g)
    r, w64, g64 = x.double().clamp(min=0), w.double(), g.double()
    # r·r·w and 2r·g·w are products of bfloat16 values (8 significant bits each, 24 in all):
    # exact in float32, so only the final rounding is left; the bound admits 2 roundings anyway
    _assert_rounded("weighted squared relu out", out, r * r * w64, 2 * U * (r * r * w64).abs())
    dx = 2 * r * g64 * w64
    _assert_rounded("weighted squared relu d input", xv.grad, dx, 3 * U * dx.abs())
    terms = r * r * g64  # d weights: sum over H in float32 (x2)
    _assert_rounded("weighted squared relu d weights", wv.grad, terms.sum(1, keepdim=True),
                    (2 * H * U * terms.abs()).sum(1, keepdim=True), stats=False)


SEED = 1234  # the replayed seed of the dropout op


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_bias_dropout_add(p):
    x, r, g = _randn((ROWS, H)), _randn((ROWS, H)), _randn((ROWS, H))
    b = _randn((H,))
    xv, bv, rv = (t.clone().requires_grad_(True) for t in (x, b, r))
    torch.manual_seed(SEED)
    out = bias_dropout_add_fused_train((xv, bv), rv, p)
    out.backward(g)
    # the mask the kernels drew (replayed from the seed, as tests/test_bias_dropout_add.py does)
    torch.manual_seed(SEED)
    if p > 0:
        keep = dropout_mask(philox_seed(DEVICE), ROWS, H, p).view(ROWS, H)
    else:
        keep = torch.ones(ROWS, H, dtype=torch.bool, device=DEVICE)
    p_used = drop_threshold(p) / 2**KEEP_BITS if p > 0 else 0.0
    scale = 1.0 / (1.0 - p_used)
    v = (x.double() + b.double()) * scale
    ref = r.double() + torch.where(keep, v, torch.zeros_like(v))
    # x + b, the scale rounded to float32, times it, + r: 4 roundings, the last of |out| (x2)
    _assert_rounded(f"bias_dropout_add(p={p}) out", out, ref, 2 * U * (3 * v.abs() * keep + ref.abs()))
    dx = torch.where(keep, g.double() * scale, torch.zeros_like(v))
    e_dx = 4 * U * dx.abs()  # g times the float32 scale: 2 roundings (x2); 0 for p = 0 (dx is g)
    _assert_rounded(f"bias_dropout_add(p={p}) d input", xv.grad, dx, e_dx, stats=p > 0)
    _assert_rounded(f"bias_dropout_add(p={p}) d bias", bv.grad, dx.sum(0), (e_dx + 2 * ROWS * U * dx.abs()).sum(0),
                    stats=False)
    assert torch.equal(rv.grad, g)


def _norm_inputs(h):
    x = (_randn((ROWS, h)).float() + 0.5).to(BF16)  # a mean away from 0
    w = (1 + 0.5 * torch.randn(h, device=DEVICE)).to(BF16)
    b = _randn((h,), 0.5)
    g = _randn((ROWS, h))
    return x, w, b, g


def _norm_bounds(x, w, y_ref, dy, xhat, rstd, c1, c2, mean_term):
    """Error bounds of the norm kernels (module docstring, kernels/layer_norm.py's formulas).

    x_hat = (x - mean)·rstd (LayerNorm) or x·rstd (RMSNorm): the mean errs by (h + 1)u·mean|x|
    (``mean_term`` = rstd·(h + 1)u·mean|x|, 0 for RMSNorm); var (or the mean square) relatively by
    (h + 4)u (the mean's error cancels to first order, as sum(x - mean) = 0); rstd = 1/sqrt(var +
    eps) by (h/2 + 2)u + u + 2Q; x_hat by ``mean_term`` + (h/2 + 13)u·|x_hat| =: D.
    y = gamma·x_hat + beta: |gamma|·D + u|gamma·x_hat| + u|y|.
    dx = (g - (x_hat·c1 + c2))·rstd, g = gamma·dy, c1 = mean(x_hat·g), c2 = mean(g) (0 for
    RMSNorm): Δc1 <= mean(|g|·D) + (h + 3)u·mean|x_hat·g|, Δc2 <= (h + 2)u·mean|g|; the inner
    sum errs by |c1|·D + |x_hat|·Δc1 + Δc2 + 2u(|g| + |x_hat·c1| + |c2|) + u|inner|, and rstd
    multiplies by (1 + (h/2 + 12)u). dgamma = sum over rows of dy·x_hat: |dy|·D + u|dy·x_hat|
    per term and ROWS·u·sum|dy·x_hat| for the sum; dbeta: ROWS·u·sum|dy|. All x2.
    """
    h = x.shape[-1]
    gam = w.double()
    D = mean_term + (h / 2 + 13) * U * xhat.abs()
    e_y = 2 * (gam.abs() * D + U * (gam * xhat).abs() + U * y_ref.abs())
    g = gam * dy
    dc1 = (g.abs() * D).mean(-1, keepdim=True) + (h + 3) * U * (xhat * g).abs().mean(-1, keepdim=True)
    dc2 = (h + 2) * U * g.abs().mean(-1, keepdim=True) if c2 is not None else 0.0
    c2v = c2 if c2 is not None else torch.zeros_like(c1)
    inner = g - (xhat * c1 + c2v)
    e_inner = (c1.abs() * D + xhat.abs() * dc1 + dc2 + 2 * U * (g.abs() + (xhat * c1).abs() + c2v.abs())
               + U * inner.abs())
    e_dx = 2 * (rstd * e_inner + (h / 2 + 12) * U * (rstd * inner).abs())
    e_dgamma = 2 * ((dy.abs() * D + U * (dy * xhat).abs()) + ROWS * U * (dy * xhat).abs()).sum(0)
    e_dbeta = 2 * ROWS * U * dy.abs().sum(0)
    return e_y, e_dx, e_dgamma, e_dbeta


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm(kind):
    x, w, b, g = _norm_inputs(H)
    xv, wv = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bv = b.clone().requires_grad_(True)
    eps = 1e-5
    out = fused_layer_norm(xv, wv, bv, eps) if kind == "layer" else fused_rms_norm(xv, wv, eps)
    out.backward(g)
    x64, w64, b64, dy = x.double(), w.double(), b.double(), g.double()
    if kind == "layer":
        mean = x64.mean(-1, keepdim=True)
        rstd = torch.rsqrt(((x64 - mean) ** 2).mean(-1, keepdim=True) + eps)
        xhat = (x64 - mean) * rstd
        y_ref = unfused.layer_norm(x64, w64, b64, eps)
        dx_ref, dw_ref, db_ref = unfused.layer_norm_back(dy, x64, w64, eps)
        gg = w64 * dy
        c1, c2 = (xhat * gg).mean(-1, keepdim=True), gg.mean(-1, keepdim=True)
        mean_term = rstd * (H + 1) * U * x64.abs().mean(-1, keepdim=True)
    else:
        rstd = torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
        xhat = x64 * rstd
        y_ref = unfused.rms_norm(x64, w64, eps)
        dx_ref, dw_ref = unfused.rms_norm_back(dy, x64, w64, eps)
        gg = w64 * dy
        c1, c2 = (xhat * gg).mean(-1, keepdim=True), None
        mean_term = 0.0
    e_y, e_dx, e_dw, e_db = _norm_bounds(x64, w, y_ref, dy, xhat, rstd, c1, c2, mean_term)
    _assert_rounded(f"{kind}_norm out", out, y_ref, e_y)
    _assert_rounded(f"{kind}_norm d input", xv.grad, dx_ref, e_dx)
    _assert_rounded(f"{kind}_norm d weight", wv.grad, dw_ref, e_dw, stats=False)
    if kind == "layer":
        _assert_rounded(f"{kind}_norm d bias", bv.grad, db_ref, e_db, stats=False)


SOFTMAX_SCALE = 1.0 / math.sqrt(128)
ONLINE_TILE = 16  # the looping kernel on short rows: 16-column tiles, 4 per row of 53


def _softmax_case(variant, shape):
    """(probabilities p of the fused op, a closure for its backward, float64 p, mask, offset)."""
    x = (3 * torch.randn(shape, device=DEVICE)).to(BF16)  # |scores| of a few units
    xv = x.clone().requires_grad_(True)
    mask, offset = None, None
    if variant == "scaled":
        p = ScaledSoftmax.apply(xv, SOFTMAX_SCALE)
    elif variant == "masked":
        mask = torch.rand(shape[0], 1, shape[2], shape[3], device=DEVICE) < 0.3
        p = ScaledMaskedSoftmax.apply(xv, mask, SOFTMAX_SCALE)
    elif variant == "causal":  # [attn_batches, sq, sk]
        x3 = xv.reshape(-1, shape[2], shape[3])
        p = ScaledUpperTriangMaskedSoftmax.apply(x3, SOFTMAX_SCALE).view(shape)
        mask = unfused.causal_mask(shape[2], shape[3], device=DEVICE)
    else:  # "softmax_one": the sink logit o = 0.5 (scale 1)
        offset = 0.5
        p = SoftmaxOne(-1, offset)(xv)
    scale = 1.0 if variant == "softmax_one" else SOFTMAX_SCALE
    return xv, p, scale, mask, offset


@pytest.mark.parametrize("variant,online", [
    ("scaled", False), ("masked", False), ("causal", False), ("softmax_one", False),
    ("masked", True), ("softmax_one", True),
], ids=["scaled", "masked", "causal", "softmax_one", "masked-online", "softmax_one-online"])
def test_softmax(variant, online, monkeypatch):
    if online:
        monkeypatch.setattr(ksoftmax, "MAX_REGISTER_BLOCK", ONLINE_TILE)
        shape = (1, 4, 19, 53)  # 4028 outputs: few programs for the interpreter's sequential loop
    else:
        shape = (2, 3, 37, 53)
    xv, p, scale, mask, offset = _softmax_case(variant, shape)
    g = _randn(shape)
    p.backward(g)
    sk = shape[-1]
    x64 = xv.detach().double()
    full_mask = mask.expand(shape) if mask is not None else torch.zeros(shape, dtype=torch.bool, device=DEVICE)
    p_ref = unfused.masked_softmax_reference(x64, full_mask, scale, offset)
    # Forward: p = e^{s - m}/d, s = scale·x (2u|s| with the float32 scale), s - m (u|s - m|),
    # exp (Q, and u|s - m| for the prescale), d = sum of sk (+ 1 sink) terms ((sk + 1)u, plus the
    # largest relative error of a term), 1/d (Q) and the product (u); the looping kernel also
    # rescales d once per tile by e^{m_old - m_new} (Q + 2u·range each, range = max - min of the
    # kept s). x2.
    s = (x64 * scale).masked_fill(full_mask, float("nan"))
    m = s.nan_to_num(nan=-math.inf).amax(-1, keepdim=True)
    if offset is not None:
        m = torch.maximum(m, torch.tensor(float(offset), dtype=torch.float64, device=DEVICE))
    term = (2 * s.abs() + 2 * (s - m).abs()).nan_to_num(nan=0.0)
    rng = (m - s.nan_to_num(nan=math.inf).amin(-1, keepdim=True)).clamp(min=0).nan_to_num(posinf=0.0)
    tiles = math.ceil(sk / ONLINE_TILE) if online else 1
    rel = U * (term + term.amax(-1, keepdim=True) + sk + 1) + 3 * Q + 2 * U + tiles * (Q + 2 * U * rng)
    _assert_rounded(f"softmax {variant}{' online' if online else ''} out", p, p_ref, 2 * rel * p_ref)
    # Backward from the stored bfloat16 p (what the kernel reads): dx = scale·(g·p - p·c),
    # c = sum g·p: g·p (u), c ((sk + 1)u·sum|g·p|, per tile too), p·c (u), the difference (u),
    # the scale (a float32 argument, u) and the product (u). x2.
    p_st, g64 = p.detach().double(), g.double()
    gp = g64 * p_st
    c = gp.sum(-1, keepdim=True)
    dx_ref = scale * (gp - p_st * c)
    e_dx = 2 * (scale * (U * gp.abs() + p_st * ((sk + 1) * U * gp.abs().sum(-1, keepdim=True) + U * c.abs())
                         + U * (gp - p_st * c).abs()) + 2 * U * dx_ref.abs())
    _assert_rounded(f"softmax {variant}{' online' if online else ''} d input", xv.grad, dx_ref, e_dx)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_grad(label_smoothing):
    s_, b_, V = 8, 4, 331  # 32 tokens, an odd vocabulary
    logits = (2 * torch.randn(s_, b_, V, device=DEVICE)).to(BF16)
    target = torch.randint(0, V, (s_, b_), device=DEVICE)
    lv = logits.clone().requires_grad_(True)
    loss = fused_vocab_parallel_cross_entropy(lv, target, label_smoothing=label_smoothing)
    g = torch.randn(s_, b_, device=DEVICE)  # the loss is float32, so is its gradient
    loss.backward(g)
    x64, g64 = logits.double(), g.double()
    dx_ref = unfused.cross_entropy_grad(x64, target, g64, label_smoothing)
    # dx = (p - coefs)·g, p = e^{x - lse} with the forward's float32 lse = m + log(s): s sums V
    # terms e^{x - m} (Q + u·range each, range = max - min of the row) over nb column tiles,
    # rescaled once per tile (Q + 2u·range): Δs/s <= (V + 1)u + (nb + 1)(Q + 2u·range);
    # log: Q·(1 + log s); the sum m + log s: u|lse|. p: Δlse + 2u|x - lse| + Q relative. The
    # coefficients [1 - s, s/V] are float32 (u each), the subtraction and the product u each. x2.
    m = x64.amax(-1, keepdim=True)
    lse = torch.logsumexp(x64, -1, keepdim=True)
    rng = m - x64.amin(-1, keepdim=True)
    nb = math.ceil(V / pick(FWD_TILES, V).BLOCK_N)
    d_lse = U * lse.abs() + Q * (1 + (lse - m)) + (V + 1) * U + (nb + 1) * (Q + 2 * U * rng)
    p = torch.softmax(x64, -1)
    s_eff = unfused.megatron_smoothing_to_torch(label_smoothing, V)
    coefs = (1 - s_eff) * torch.nn.functional.one_hot(target, V).double() + s_eff / V
    rel_p = d_lse + 2 * U * (x64 - lse).abs() + Q
    e_dx = 2 * (g64.abs()[..., None] * (p * rel_p + 3 * U * ((p - coefs).abs() + coefs)) + U * dx_ref.abs())
    _assert_rounded(f"cross entropy (smoothing {label_smoothing}) d logits", lv.grad, dx_ref, e_dx)
