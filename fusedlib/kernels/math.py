"""Device functions shared by fusedlib's kernels.

Written with ``tl.exp`` and arithmetic only, so they run in Triton's interpreter (which
cannot call libdevice) and never overflow there: an overflow in the interpreter is a
NumPy RuntimeWarning on stderr, which a notebook would show.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(z):
    """tanh(z) = sign(z)·(1 - e^{-2|z|}) / (1 + e^{-2|z|}): e^{-2|z|} <= 1 never overflows."""
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


#: Below this z, :func:`soft_clamp` takes tanh(z)/z from its Taylor series (next term
#: 1382·z^10/155925 < 1e-11 there); above, 1 - e^{-2z} loses at most 2 of float32's 24 bits.
SOFT_CLAMP_SERIES_BELOW: tl.constexpr = tl.constexpr(0.125)


@triton.jit
def soft_clamp(r, s):
    """(s·tanh(r/s), tanh(r/s)) for r >= 0 and s > 0, both with float32's relative accuracy.

    :func:`tanh` computes 1 - e^{-2z}, which cancels for small z = r/s: at s = 1e4 and r = 1
    its relative error is about 3e-2, and once z is below float32's resolution the clamp
    returns 0 where it should return r. For z < :data:`SOFT_CLAMP_SERIES_BELOW` this takes
    tanh(z)/z = 1 - z²/3 + 2z⁴/15 - 17z⁶/315 + 62z⁸/2835 and returns r·(tanh(z)/z), exact
    even when z underflows to 0; above it, s·tanh(z) (r = inf gives s, as torch does)."""
    z = r / s
    z2 = z * z
    ratio = 1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0 + z2 * (62.0 / 2835.0))))
    small = z < SOFT_CLAMP_SERIES_BELOW
    t = tl.where(small, z * ratio, tanh(z))
    return tl.where(small, r * ratio, s * t), t


#: Past |x| = 1e4 GeLU's tanh is ±1 in float32 and float64 alike (its argument passes 3.6e10,
#: e^{-7e10} = 0), so :func:`gelu_tanh_t` holds x there: x² could overflow otherwise (float32
#: past |x| = 1.8e19), and the gradient would become (1 - t²)·inf = 0·inf = NaN where its limit
#: is 1 (x > 0) or 0 (x < 0).
GELU_SATURATED: tl.constexpr = tl.constexpr(1e4)


@triton.jit
def gelu_tanh_t(x, c0, c1):
    """(t, xs): t = tanh(c0·xs·(1 + c1·xs²)) of GeLU's tanh approximation, xs = x held to
    ±:data:`GELU_SATURATED` (the same t, no overflow). A NaN x stays NaN in both."""
    big = tl.abs(x) > GELU_SATURATED
    xs = tl.where(big, tl.where(x > 0, GELU_SATURATED, -GELU_SATURATED), x)
    return tanh(xs * c0 * (1.0 + xs * xs * c1)), xs


@triton.jit
def gelu_tanh_derivative(xs, t, c0, c2):
    """d/dx of 0.5·x·(1 + t): 0.5·xs·(1 - t²)·(c0 + c2·xs²) + 0.5·(1 + t), c2 = 3·c0·c1, from
    :func:`gelu_tanh_t`'s (t, xs). Past the saturation 1 - t² is exactly 0, and so is the first
    term: the gradient is exactly its limit, 1 or 0."""
    return 0.5 * xs * ((1.0 - t * t) * (xs * xs * c2 + c0)) + 0.5 * (1.0 + t)
