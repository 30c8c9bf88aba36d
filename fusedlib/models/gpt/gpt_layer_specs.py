"""GPT layer specs: which module fills each slot of a :class:`TransformerLayer`.

* :func:`get_gpt_layer_local_spec`: Megatron-core's local spec with fusedlib's fused modules.
  Every fusion is *available*; the ``TransformerConfig`` switches choose, as in Megatron-core:

  ==========================  =========================================  ===========================
  slot                        module                                     switch
  ==========================  =========================================  ===========================
  input/pre_mlp layernorm     FusedNorm (fusedlib's LayerNorm/RMSNorm)   normalization,
                                                                         memory_efficient_layer_norm
  self_attention.linear_qkv   ColumnParallelLinear                       (a GEMM)
  q/k_layernorm               FusedNorm if ``qk_layernorm`` else Identity
  core_attention              DotProductAttention                        attention_backend,
                                                                         masked_softmax_fusion
  (RoPE, in SelfAttention)    rope_utils.apply_rotary_pos_emb            apply_rope_fusion
  linear_proj, linear_fc2     RowParallelLinear (bias returned)          (a GEMM)
  self_attn_bda, mlp_bda      get_bias_dropout_add                       bias_dropout_fusion
  mlp                         MLP (fc1 bias into the activation)         bias_activation_fusion,
                                                                         gemm_gelu_fusion
  ==========================  =========================================  ===========================

* :func:`get_gpt_fused_layer_spec`: the local spec's submodules in a
  :class:`~fusedlib.transformer.fused_layer.FusedTransformerLayer`: the same layer, its training
  step one autograd node (less host time per layer where the host decides).

* :func:`get_gpt_layer_unfused_spec`: every slot plain PyTorch whatever the switches say:
  torch's LayerNorm/RMSNorm, the materialised attention with torch's softmax and dropout, the
  activation after a separate bias add, an unfused bias-dropout-add and RoPE: the baseline the
  fused layer is measured against.

Left out: MoE (``num_experts``), multi-latent attention, L2 query/key norms, FP8, the kitchen
backends. Each raises NotImplementedError when asked for.

Source: Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_local_spec``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ...fusions.fused_bias_dropout import bias_dropout_add_unfused, get_bias_dropout_add
from ...fusions.fused_layer_norm import FusedNorm
from ...parallel.layers import ColumnParallelLinear, RowParallelLinear
from ...transformer.attention import SelfAttention, SelfAttentionSubmodules
from ...transformer.dot_product_attention import DotProductAttention
from ...transformer.enums import AttnBackend, AttnMaskType
from ...transformer.fused_layer import FusedTransformerLayer
from ...transformer.identity_op import IdentityOp
from ...transformer.mlp import MLP, MLPSubmodules
from ...transformer.spec_utils import ModuleSpec
from ...transformer.torch_norm import WrappedTorchNorm
from ...transformer.transformer_config import TransformerConfig
from ...transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["get_gpt_layer_local_spec", "get_gpt_fused_layer_spec", "get_gpt_layer_unfused_spec", "without_fusions",
           "UnfusedNorm", "UnfusedSelfAttention", "UnfusedMLP", "get_bias_dropout_add_unfused"]


def _refuse(**unsupported: object) -> None:
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(f"get_gpt_layer_*_spec: {name}={value!r} is left out of fusedlib")


def get_gpt_layer_local_spec(num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False,
                             qk_layernorm: Optional[bool] = False, multi_latent_attention: Optional[bool] = False,
                             fp8: Optional[str] = None, moe_use_legacy_grouped_gemm: Optional[bool] = False,
                             normalization: Optional[str] = None, qk_l2_norm: Optional[bool] = False,
                             use_kitchen: bool = False, use_kitchen_attention: bool = False,
                             kitchen_attention_backend: str = "sdpa") -> ModuleSpec:
    """The GPT layer spec with fusedlib's fused modules (see the module docstring's table).

    Args:
        qk_layernorm: normalize queries and keys per head (FusedNorm in q_layernorm/k_layernorm).
        normalization: accepted for Megatron-core's signature; FusedNorm builds what
            ``config.normalization`` names when the layer is built.
        num_experts, moe_grouped_gemm, multi_latent_attention, fp8, moe_use_legacy_grouped_gemm,
            qk_l2_norm, use_kitchen, use_kitchen_attention: must be left at their defaults.
        kitchen_attention_backend: ignored (with use_kitchen False, as in Megatron-core).

    Returns:
        ``ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(...))``; the self
        attention is causal.

    Raises:
        NotImplementedError: a left-out feature asked for.
        TypeError: qk_layernorm neither a bool nor None.

    Source: Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_local_spec``).
    """
    _refuse(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, multi_latent_attention=multi_latent_attention,
            fp8=fp8, moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm, qk_l2_norm=qk_l2_norm,
            use_kitchen=use_kitchen, use_kitchen_attention=use_kitchen_attention)
    return _layer_spec(FusedNorm, SelfAttention, MLP, get_bias_dropout_add, qk_layernorm)


def get_gpt_fused_layer_spec() -> ModuleSpec:
    """:func:`get_gpt_layer_local_spec`'s layer as a
    :class:`~fusedlib.transformer.fused_layer.FusedTransformerLayer`: the same submodules,
    parameters, state-dict names and results (bit for bit where the kernels are deterministic:
    fusedlib's are, SDPA's CUDA kernels other than its math kernel need not be), each training
    call of a layer one autograd node. fusedlib's own (Megatron-core has no such layer).

    The config must be one the one-node layer takes (``attention_backend`` flash, auto / fused
    (SDPA), or local / unfused with ``masked_softmax_fusion``; ``bias_dropout_fusion`` and
    ``gemm_gelu_fusion`` on; one rank; no query/key norms, recomputation or grouped-query
    attention: the list is :mod:`fusedlib.transformer.fused_layer`'s); the layer's build raises a
    ValueError naming what differs.

    Returns:
        ``ModuleSpec(FusedTransformerLayer, submodules=get_gpt_layer_local_spec().submodules)``.

    Source: Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_local_spec``,
    the submodules); the one-node layer after DeepSpeed's ``DeepSpeedTransformerLayer``.
    """
    return ModuleSpec(module=FusedTransformerLayer, submodules=get_gpt_layer_local_spec().submodules)


# ---------------------------------------------------------------------------------------------
# The all-unfused spec
# ---------------------------------------------------------------------------------------------


def without_fusions(config: TransformerConfig) -> TransformerConfig:
    """A copy of ``config`` with every fusion switch off and the materialised attention backend.

    Off: bias_activation_fusion, gemm_gelu_fusion, masked_softmax_fusion, bias_dropout_fusion,
    apply_rope_fusion, persist_layer_norm, memory_efficient_layer_norm, cross_entropy_loss_fusion;
    attention_backend = AttnBackend.unfused.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return dataclasses.replace(config, bias_activation_fusion=False, gemm_gelu_fusion=False, masked_softmax_fusion=False,
                               bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                               memory_efficient_layer_norm=False, cross_entropy_loss_fusion=False,
                               attention_backend=AttnBackend.unfused)


class UnfusedNorm:
    """:class:`WrappedTorchNorm` (torch's LayerNorm/RMSNorm) built from :func:`without_fusions` of its
    config, so the norms' performance switches (persist, memory-efficient) do not apply.

    Raises:
        ValueError: layernorm_zero_centered_gamma set (torch's norms have none).

    Source: Megatron-LM ``megatron/core/transformer/torch_norm.py`` (``WrappedTorchNorm``).
    """

    def __new__(cls, config: TransformerConfig, *args: object, **kwargs: object):
        return WrappedTorchNorm(without_fusions(config), *args, **kwargs)


class UnfusedSelfAttention(SelfAttention):
    """:class:`SelfAttention` built from :func:`without_fusions` of its config, and so are its
    submodules: torch's softmax and dropout, the materialised attention, unfused RoPE.

    Source: Megatron-LM ``megatron/core/transformer/attention.py`` (``SelfAttention``).
    """

    def __init__(self, config: TransformerConfig, *args: object, **kwargs: object) -> None:
        super().__init__(without_fusions(config), *args, **kwargs)


class UnfusedMLP(MLP):
    """:class:`MLP` built from :func:`without_fusions` of its config: the fc1 bias added by
    PyTorch, then the activation (Megatron-core's ``glu`` for gated units).

    Source: Megatron-LM ``megatron/core/transformer/mlp.py`` (``MLP``).
    """

    def __init__(self, config: TransformerConfig, *args: object, **kwargs: object) -> None:
        super().__init__(without_fusions(config), *args, **kwargs)


def get_bias_dropout_add_unfused(training: bool, fused: bool) -> Callable:
    """``get_bias_dropout_add``'s signature, ignoring ``fused``: always the PyTorch bias-dropout-add.

    Source: Megatron-LM ``megatron/core/fusions/fused_bias_dropout.py`` (``get_bias_dropout_add``,
    ``bias_dropout_add_unfused``).
    """
    return bias_dropout_add_unfused(training)


def get_gpt_layer_unfused_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """The GPT layer spec in plain PyTorch, whatever the config's fusion switches say.

    Same slots, parameters and state-dict names as :func:`get_gpt_layer_local_spec` (so one
    state dict loads into both), with :class:`UnfusedNorm` (torch) norms,
    :class:`UnfusedSelfAttention`, :class:`UnfusedMLP` and :func:`get_bias_dropout_add_unfused`.

    Args:
        qk_layernorm: normalize queries and keys per head (torch norms).

    Returns:
        ``ModuleSpec(TransformerLayer, ...)``, causal self-attention.

    Raises:
        TypeError: qk_layernorm neither a bool nor None.

    Source: fusedlib's own; the slots of Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py``
    (``get_gpt_layer_local_spec``), filled with plain PyTorch.
    """
    return _layer_spec(UnfusedNorm, UnfusedSelfAttention, UnfusedMLP, get_bias_dropout_add_unfused, qk_layernorm)


def _layer_spec(norm: type, attention: type, mlp: type, bda: Callable, qk_layernorm: bool) -> ModuleSpec:
    """A causal GPT layer's spec from its parts (the local and the unfused specs differ only in
    these): ``norm`` for the two pre-norms (and the q/k norms with ``qk_layernorm``), the
    self-attention and MLP classes, and the bias-dropout-add factory."""
    if qk_layernorm is not None and not isinstance(qk_layernorm, bool):  # (a truthy "no" built the norms)
        raise TypeError(f"qk_layernorm must be a bool (or None: False), got {type(qk_layernorm).__name__} "
                        f"{qk_layernorm!r}")
    qk_norm = norm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=attention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=bda,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=mlp, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=bda,
        ),
    )
