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

