"""Device functions shared by fusedlib's kernels.

Written with ``tl.exp`` and arithmetic only, so they run in Triton's interpreter (which
cannot call libdevice). :func:`tanh` and :func:`soft_clamp` never overflow inside for any
argument (an overflow in the interpreter is a NumPy RuntimeWarning on stderr, which a notebook
would show); an argument that has itself overflowed to ±inf gives their limits. The kernels'
own arithmetic around them can overflow for inputs near a dtype's largest value: GeLU's
c0·x·(1 + c1·x²) past |x| = ~1e13 in float32, which the interpreter warns of, and whose inf
tanh takes to its limit ±1, as the GPU does without a word.
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


@triton.jit
def gelu_tanh_derivative(x, x2, t, c0, c2):
    """d/dx of GeLU's tanh form 0.5·x·(1 + t): 0.5·x·(1 - t²)·(c0 + c2·x²) + 0.5·(1 + t), from x,
    x2 = x·x (as computed for t) and t = tanh(c0·x·(1 + c1·x²)); c2 = 3·c0·c1.

    x² is held at 1e30 inside: past |x| = 1.8e19 it overflows in float32, where t = ±1 and
    1 - t² = 0, and (1 - t²)·(c0 + c2·x²) would be 0·inf = NaN where its limit is 0 (the
    gradient is then exactly 1 for x > 0 and 0 for x < 0). Below |x| = 1e15 nothing changes;
    above it 1 - t² is 0 in float32 and float64 alike. A NaN x keeps a NaN t: a NaN gradient.
    One instruction more than the plain formula, in the backward only: the forward is
    unchanged, since tanh(±inf) = ±1 gives its limit already. (Triton's interpreter runs the
    kernels in NumPy, which warns of that overflow where the GPU gives inf silently.)"""
    return 0.5 * x * ((1.0 - t * t) * (tl.minimum(x2, 1e30) * c2 + c0)) + 0.5 * (1.0 + t)
