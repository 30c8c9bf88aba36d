"""fusedlib: fused Transformer-training ops on Triton kernels, and the book that builds them.

Importing fusedlib first imports :mod:`fusedlib.runtime`, which sets ``TRITON_INTERPRET=1``
on a machine with no CUDA GPU before any kernel is defined. Everything below is importable
from ``fusedlib`` itself (Megatron-core's names); by layer:

* runtime: ``runtime`` (where kernels run: compiled on CUDA, interpreted on the CPU).
* helpers that need no kernel: ``jit`` (``jit_fuser``, ``enable_jit_fuser``,
  ``disable_jit_fuser``), ``checks`` (the input checks every op shares), ``utils``
  (Megatron-core's ``make_viewless_tensor``), ``unfused`` (the plain PyTorch references).
* fusions, by chapter (``fusedlib.fusions``; the kernels and their launch settings are in
  ``fusedlib.kernels``):

  1. bias + GeLU: ``bias_gelu_impl``, ``GeLUFunction``, ``bias_gelu``, ``bias_gelu_back``;
     the GeLU MLP with bias-GeLU in cuBLASLt's GEMM epilogues: ``fused_dense_gelu_dense``,
     ``FusedDenseGeluDenseFunction``.
  2. bias + dropout + add: ``get_bias_dropout_add``, ``bias_dropout_add_fused_train``,
     ``bias_dropout_add_fused_inference``, ``bias_dropout_add_unfused``,
     ``BiasDropoutAddFunction``. (Megatron-core's unfused ``_bias_dropout_add_func`` is in
     ``fusedlib.fusions.fused_bias_dropout``.)
  3. gated linear units: ``bias_geglu_impl``, ``GeGLUFunction``, ``BiasGeGLUFunction``;
     ``bias_swiglu_impl``, ``weighted_bias_swiglu_impl``, ``SwiGLUFunction``,
     ``BiasSwiGLUFunction``, ``WeightedSwiGLUFunction`` (all with the optional
     ``clamp_value`` of clamped SwiGLU); ``weighted_squared_relu_impl``,
     ``WeightedSquaredReLUFunction``. (The plain ``swiglu``, ``bias_swiglu``,
     ``weighted_swiglu``, ``clamped_swiglu``, ``bias_clamped_swiglu``,
     ``clamped_weighted_swiglu``, ``geglu``, ``bias_geglu``... functions and their ``_back``
     are in the fusion modules.)
  4. LayerNorm and RMSNorm: ``fused_layer_norm``, ``fused_rms_norm``, ``FusedLayerNorm``,
     ``FusedRMSNorm``, ``FusedNorm``, ``FusedLayerNormAffineFunction``,
     ``FusedRMSNormAffineFunction``, ``norm_with_residual``; a sublayer's bias-dropout-add in the
     next norm: ``bias_dropout_add_norm``, ``BiasDropoutAddNormFunction``.
  5. softmax: ``fused_scale_mask_softmax``, ``FusedScaleMaskSoftmax``,
     ``ScaledUpperTriangMaskedSoftmax``, ``ScaledMaskedSoftmax``, ``ScaledSoftmax``,
     ``SoftmaxOne``; with the attention dropout fused, ``fused_scale_mask_softmax_dropout``
     and ``ScaledMaskedSoftmaxDropout``.
  6. cross entropy: ``fused_vocab_parallel_cross_entropy`` (2 all-reduces).
  8. attention: ``flash_attention`` (FlashAttention-2 in Triton, forward and backward) and its
     autograd Function ``FlashAttentionFunction``.

* parallel: ``parallel`` (the package), ``vocab_parallel_cross_entropy`` (unfused, 3
  all-reduces), ``VocabUtility``, ``count_collectives``.
* transformer: ``TransformerConfig``, ``AttnMaskType`` (the rest of Megatron-core's
  transformer package, ``ModuleSpec``, ``build_module``, ``SelfAttention``,
  ``DotProductAttention``, ``MLP``, ``TransformerLayer``, ``TransformerBlock``,
  ``Float16Module``, is in ``fusedlib.transformer``).

Not imported here (import them by name): ``fusedlib.activations`` (``squared_relu``,
``quick_gelu``, ``fast_gelu``), ``fusedlib.transformer.utils`` (``attention_mask_func`` and
the mask builders), the rest of ``fusedlib.parallel`` (process groups,
the tensor-parallel mappings, ``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``finalize_model_grads``, state-dict sharding), ``fusedlib.models.gpt``
(``get_gpt_layer_local_spec``, ``get_gpt_layer_unfused_spec``, ``GPTModel``),
``fusedlib.fusions.fused_rope`` (rotary position embeddings), ``fusedlib.kernels`` (the Triton kernels, their launchers and tile tables),
``fusedlib.bench``, the benchmark harness (``python -m fusedlib.bench``), and
``fusedlib.book``, the chapters' helpers.
"""
# runtime first: settles TRITON_INTERPRET before any kernel is defined
from . import runtime

# helpers that need no kernel
from . import checks, jit, unfused, utils

# fusions, by chapter
from .fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl  # 1
from .fusions.fused_dense import FusedDenseGeluDenseFunction, fused_dense_gelu_dense  # 1
from .fusions.fused_bias_dropout import (  # 2
    BiasDropoutAddFunction,
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)
from .fusions.fused_bias_geglu import BiasGeGLUFunction, GeGLUFunction, bias_geglu_impl  # 3
from .fusions.fused_bias_swiglu import (
    BiasSwiGLUFunction,
    SwiGLUFunction,
    WeightedSwiGLUFunction,
    bias_swiglu_impl,
    weighted_bias_swiglu_impl,
)
from .fusions.fused_weighted_squared_relu import WeightedSquaredReLUFunction, weighted_squared_relu_impl
from .fusions.fused_layer_norm import (  # 4
    FusedLayerNorm,
    FusedLayerNormAffineFunction,
    FusedNorm,
    FusedRMSNorm,
    FusedRMSNormAffineFunction,
    fused_layer_norm,
    fused_rms_norm,
    norm_with_residual,
    bias_dropout_add_norm,
    BiasDropoutAddNormFunction,
)
from .fusions.fused_softmax import (  # 5
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledMaskedSoftmaxDropout,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
    fused_scale_mask_softmax,
    fused_scale_mask_softmax_dropout,
)
from .fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy  # 6
from .fusions.fused_attention import FlashAttentionFunction, flash_attention  # 8

# parallel
from . import parallel
from .parallel import VocabUtility, count_collectives, vocab_parallel_cross_entropy

# transformer
from .transformer import TransformerConfig
from .transformer.enums import AttnMaskType

__version__ = "0.1.0"

__all__ = [
    # runtime
    "runtime",
    # helpers that need no kernel
    "checks",
    "jit",
    "unfused",
    "utils",
    # 1. bias + GeLU
    "GeLUFunction",
    "bias_gelu",
    "bias_gelu_back",
    "bias_gelu_impl",
    "FusedDenseGeluDenseFunction",
    "fused_dense_gelu_dense",
    # 2. bias + dropout + add
    "BiasDropoutAddFunction",
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_unfused",
    "get_bias_dropout_add",
    # 3. gated linear units
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
    # 4. LayerNorm and RMSNorm
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedNorm",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "fused_layer_norm",
    "fused_rms_norm",
    "norm_with_residual",
    "bias_dropout_add_norm",
    "BiasDropoutAddNormFunction",
    # 5. softmax
    "FusedScaleMaskSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "SoftmaxOne",
    "fused_scale_mask_softmax",
    "ScaledMaskedSoftmaxDropout",
    "fused_scale_mask_softmax_dropout",
    # 6. cross entropy
    "fused_vocab_parallel_cross_entropy",
    # 8. attention
    "FlashAttentionFunction",
    "flash_attention",
    # parallel
    "parallel",
    "vocab_parallel_cross_entropy",
    "VocabUtility",
    "count_collectives",
    # transformer
    "TransformerConfig",
    "AttnMaskType",
]
