"""Shared test settings: the device, tolerances per dtype, and a float64 comparison."""
from __future__ import annotations

import pytest
import torch

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


def assert_close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare a kernel's output (any dtype) with a float64 reference, at ``dtype``'s tolerance.

    ``scale`` widens the tolerance for results that sum many terms (bias gradients).
    """
    assert actual.shape == expected64.shape, (actual.shape, expected64.shape)
    assert not torch.isnan(actual).any(), "NaN in result"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64.double().cpu(), atol=atol * scale, rtol=rtol)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test (from its name), so inputs are fresh random but reproducible."""
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
    yield
