"""Megatron-core's ``megatron/core/transformer`` package on fusedlib's fused kernels.

Modules (Megatron-core's names): :mod:`~fusedlib.transformer.spec_utils` (``ModuleSpec``,
``build_module``), :mod:`~fusedlib.transformer.identity_op`, :mod:`~fusedlib.transformer.enums`,
:mod:`~fusedlib.transformer.transformer_config` (``TransformerConfig``: shapes and fusion
switches), :mod:`~fusedlib.transformer.module` (``MegatronModule``, ``Float16Module``),
:mod:`~fusedlib.transformer.utils` (masks, inits), :mod:`~fusedlib.transformer.attention`,
:mod:`~fusedlib.transformer.dot_product_attention`, :mod:`~fusedlib.transformer.mlp`,
:mod:`~fusedlib.transformer.transformer_layer`, :mod:`~fusedlib.transformer.transformer_block`,
:mod:`~fusedlib.transformer.torch_norm`, :mod:`~fusedlib.transformer.cuda_graphs`
(``CudaGraphManager``: the layers as CUDA graphs), :mod:`~fusedlib.transformer.fused_layer`
(``FusedTransformerLayer``: a GPT layer's training step as one autograd node).

The layer classes are imported on first use (``fusedlib.transformer.TransformerLayer``): they
import the fused ops, and the fused softmax imports this package's enums.
"""
from importlib import import_module

from .enums import AttnBackend, AttnMaskType, AttnType, ModelType  # noqa: F401
from .identity_op import IdentityFuncOp, IdentityOp  # noqa: F401
from .module import Float16Module, MegatronModule  # noqa: F401
from .spec_utils import ModuleSpec, build_module  # noqa: F401
from .transformer_config import TransformerConfig  # noqa: F401

_LAZY = {
    "SelfAttention": "attention", "SelfAttentionSubmodules": "attention", "CrossAttention": "attention",
    "CrossAttentionSubmodules": "attention", "DotProductAttention": "dot_product_attention",
    "MLP": "mlp", "MLPSubmodules": "mlp", "TransformerLayer": "transformer_layer",
    "TransformerLayerSubmodules": "transformer_layer", "TransformerBlock": "transformer_block",
    "TransformerBlockSubmodules": "transformer_block", "WrappedTorchNorm": "torch_norm",
    "CudaGraphManager": "cuda_graphs", "FusedTransformerLayer": "fused_layer",
    "FusedTransformerLayerFunction": "fused_layer",
}

__all__ = ["AttnBackend", "AttnMaskType", "AttnType", "ModelType", "IdentityOp", "IdentityFuncOp",
           "MegatronModule", "Float16Module", "ModuleSpec", "build_module", "TransformerConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
