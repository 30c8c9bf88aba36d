"""fusedlib: fused Transformer-training ops on Triton kernels, and the book that builds them.

Public API (Megatron-core's names):

* ``fusedlib.fusions.fused_bias_gelu``: ``bias_gelu_impl``, ``GeLUFunction``,
  ``bias_gelu``, ``bias_gelu_back``.
* ``fusedlib.parallel``: ``vocab_parallel_cross_entropy`` (unfused, 3 all-reduces),
  ``fused_vocab_parallel_cross_entropy`` (2 all-reduces; also
  ``fusedlib.fusions.fused_cross_entropy``), ``VocabUtility``, ``count_collectives``.
* ``fusedlib.fusions.fused_bias_dropout``: ``get_bias_dropout_add``,
  ``bias_dropout_add_fused_train``, ``bias_dropout_add_fused_inference``,
  ``bias_dropout_add_unfused``, ``_bias_dropout_add_func`` (the unfused function),
  ``BiasDropoutAddFunction``.
* ``fusedlib.fusions.fused_bias_swiglu``: ``bias_swiglu_impl``, ``weighted_bias_swiglu_impl``,
  ``SwiGLUFunction``, ``BiasSwiGLUFunction``, ``WeightedSwiGLUFunction`` (all with the
  optional ``clamp_value`` of clamped SwiGLU), and the plain ``swiglu``, ``bias_swiglu``,
  ``weighted_swiglu``, ``clamped_swiglu``, ``bias_clamped_swiglu``, ``clamped_weighted_swiglu``
  (+ ``_back``) functions.
* ``fusedlib.fusions.fused_bias_geglu``: ``bias_geglu_impl``, ``GeGLUFunction``,
  ``BiasGeGLUFunction``, ``geglu``, ``bias_geglu`` (+ ``_back``).
* ``fusedlib.fusions.fused_weighted_squared_relu``: ``weighted_squared_relu_impl``,
  ``WeightedSquaredReLUFunction``, ``weighted_squared_relu`` (+ ``_back``).
* ``fusedlib.fusions.fused_softmax``: ``ScaledUpperTriangMaskedSoftmax``,
  ``ScaledMaskedSoftmax``, ``ScaledSoftmax``, ``SoftmaxOne``, ``FusedScaleMaskSoftmax``,
  ``fused_scale_mask_softmax``, and with the attention dropout fused
  ``fused_scale_mask_softmax_dropout`` (``ScaledMaskedSoftmaxDropout``);
  ``fusedlib.transformer.enums.AttnMaskType``;
  ``fusedlib.transformer.utils``: ``attention_mask_func`` and the mask builders.
* ``fusedlib.activations``: ``squared_relu``, ``quick_gelu``, ``fast_gelu``.
* ``fusedlib.unfused``: the plain PyTorch references.
* ``fusedlib.jit``: ``jit_fuser``, ``enable_jit_fuser``, ``disable_jit_fuser``.
* ``fusedlib.runtime``: where kernels run (compiled on CUDA, interpreted on the CPU).
* ``fusedlib.bench``: the benchmark harness (``python -m fusedlib.bench``).
* ``fusedlib.book``: helpers for the chapters.
* ``fusedlib.transformer``: Megatron-core's transformer package (``TransformerConfig``, ``ModuleSpec``,
  ``build_module``, ``SelfAttention``, ``DotProductAttention``, ``MLP``, ``TransformerLayer``,
  ``TransformerBlock``, ``Float16Module``); ``fusedlib.parallel.layers``: ``ColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding`` (one rank).
* ``fusedlib.models.gpt``: ``get_gpt_layer_local_spec`` (every fusion, chosen by the config),
  ``get_gpt_layer_unfused_spec``, ``GPTModel``.

Importing fusedlib first imports :mod:`fusedlib.runtime`, which sets
``TRITON_INTERPRET=1`` on a machine with no CUDA GPU before any kernel is defined.
"""
from . import runtime  # noqa: F401  (first: settles TRITON_INTERPRET before kernels are defined)
from . import jit, unfused, utils  # noqa: F401
from .fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl
from . import parallel  # noqa: F401
from .fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from .parallel import VocabUtility, count_collectives, vocab_parallel_cross_entropy
from .fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    ScaledMaskedSoftmaxDropout,
    SoftmaxOne,
    fused_scale_mask_softmax,
    fused_scale_mask_softmax_dropout,
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
    "parallel",
    "vocab_parallel_cross_entropy",
    "fused_vocab_parallel_cross_entropy",
    "VocabUtility",
    "count_collectives",
]

from .fusions.fused_bias_dropout import (  # noqa: E402  (chapter 2)
    BiasDropoutAddFunction,
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)

__all__ += [
    "BiasDropoutAddFunction",
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_unfused",
    "get_bias_dropout_add",
]

from .fusions.fused_bias_geglu import BiasGeGLUFunction, GeGLUFunction, bias_geglu_impl  # noqa: E402  (chapter 3)
from .fusions.fused_bias_swiglu import (  # noqa: E402
    BiasSwiGLUFunction,
    SwiGLUFunction,
    WeightedSwiGLUFunction,
    bias_swiglu_impl,
    weighted_bias_swiglu_impl,
)
from .fusions.fused_weighted_squared_relu import WeightedSquaredReLUFunction, weighted_squared_relu_impl  # noqa: E402

__all__ += [
    "BiasGeGLUFunction",
    "GeGLUFunction",
    "bias_geglu_impl",
    "BiasSwiGLUFunction",
    "SwiGLUFunction",
    "WeightedSwiGLUFunction",
    "bias_swiglu_impl",
    "weighted_bias_swiglu_impl",
    "WeightedSquaredReLUFunction",
    "weighted_squared_relu_impl",
    # chapter 5
    "FusedScaleMaskSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "SoftmaxOne",
    "fused_scale_mask_softmax",
    "ScaledMaskedSoftmaxDropout",
    "fused_scale_mask_softmax_dropout",
    "AttnMaskType",
]

# Chapter 4: fused LayerNorm and RMSNorm, and the TransformerConfig switches they read.
from .fusions.fused_layer_norm import (  # noqa: E402
    FusedLayerNorm,
    FusedLayerNormAffineFunction,
    FusedNorm,
    FusedRMSNorm,
    FusedRMSNormAffineFunction,
    fused_layer_norm,
    fused_rms_norm,
)
from .transformer import TransformerConfig  # noqa: E402

__all__ += [
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedNorm",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "fused_layer_norm",
    "fused_rms_norm",
    "TransformerConfig",
]
