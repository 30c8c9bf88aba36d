"""fusedlib: fused Transformer-training ops on Triton kernels, and the book that builds them.

Public API (Megatron-core's names):

* ``fusedlib.fusions.fused_bias_gelu``: ``bias_gelu_impl``, ``GeLUFunction``,
  ``bias_gelu``, ``bias_gelu_back``.
* ``fusedlib.fusions.fused_softmax``: ``ScaledUpperTriangMaskedSoftmax``,
  ``ScaledMaskedSoftmax``, ``ScaledSoftmax``, ``SoftmaxOne``, ``FusedScaleMaskSoftmax``,
  ``fused_scale_mask_softmax``; ``fusedlib.transformer.enums.AttnMaskType``.
* ``fusedlib.unfused``: the plain PyTorch references.
* ``fusedlib.jit``: ``jit_fuser``, ``enable_jit_fuser``, ``disable_jit_fuser``.
* ``fusedlib.runtime``: where kernels run (compiled on CUDA, interpreted on the CPU).
* ``fusedlib.bench``: the benchmark harness (``python -m fusedlib.bench``).
* ``fusedlib.book``: helpers for the chapters.

Importing fusedlib first imports :mod:`fusedlib.runtime`, which sets
``TRITON_INTERPRET=1`` on a machine with no CUDA GPU before any kernel is defined.
"""
from . import runtime  # noqa: F401  (first: settles TRITON_INTERPRET before kernels are defined)
from . import jit, unfused, utils  # noqa: F401
from .fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl
from .fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
    fused_scale_mask_softmax,
)
from .transformer.enums import AttnMaskType

__version__ = "0.1.0"

__all__ = [
    "runtime",
    "jit",
    "unfused",
    "utils",
    "GeLUFunction",
    "bias_gelu",
    "bias_gelu_back",
    "bias_gelu_impl",
    "FusedScaleMaskSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "SoftmaxOne",
    "fused_scale_mask_softmax",
    "AttnMaskType",
]
