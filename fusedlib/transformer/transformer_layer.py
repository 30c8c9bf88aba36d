"""``TransformerLayer``: norm, attention, bias-dropout-add; norm, MLP, bias-dropout-add.

The forward, in Megatron-core's order, for hidden states x [s, b, h] (pre-norm):

    residual = x
    x = self_attn_bda(training, bias_dropout_fusion)(self_attention(input_layernorm(x)), residual, p)
    residual = x
    x = cross_attn_bda(...)(cross_attention(pre_cross_attn_layernorm(x), context), residual, p)
    residual = x
    x = mlp_bda(...)(mlp(pre_mlp_layernorm(x)), residual, p)

Each sublayer returns ``(output, bias)`` with its bias not yet added, and the bias-dropout-add
``residual + dropout(output + bias, p)`` is one kernel with ``config.bias_dropout_fusion``
(``get_bias_dropout_add``). Unused slots are IdentityOp/IdentityFuncOp: a GPT layer's cross
attention slot passes x through unchanged.

Each pre-norm and its residual come from :func:`~fusedlib.fusions.fused_layer_norm.norm_with_residual`:
with fusedlib's norms the residual is a second output of the norm's autograd node (the same values
as x), so the backward kernel of the norm adds the residual's gradient to x's instead of autograd
adding the two in a separate kernel (chapter 4); other norm modules get ``residual = x``. With
``bias_dropout_fusion`` and nothing between them (no cross attention, pre-norm residuals), the
self-attention's bias-dropout-add and the MLP's norm run as one op,
:func:`~fusedlib.fusions.fused_layer_norm.bias_dropout_add_norm` (the same values; fusedlib's norms
then take the bias-dropout-add into their kernels).

Residual options: ``apply_residual_connection_post_layernorm`` takes the residual after each
norm instead of before (Megatron-core keeps the field but its layer ignores it; this is
Megatron-LM's legacy behaviour). With ``fp32_residual_connection`` the residual stream is fp32
(the embedding casts it): each norm gets its input cast to its weight's dtype, and
bias-dropout-add returns the residual's dtype.

Selective recomputation of the MLP (``"mlp"`` in ``recompute_modules``) checkpoints it with
``torch.utils.checkpoint`` (non-reentrant, RNG state restored, the tensor-parallel tracker's
too: :func:`fusedlib.parallel.random.checkpoint`); the core attention's is in
:mod:`fusedlib.transformer.attention`.

Under sequence parallelism (p > 1) the norms, bias-dropout-adds and residuals run on this
rank's s/p tokens, [s/p, b, h]; the attention and MLP gather and scatter the sequence in
their linear layers.

Left out: pipeline layer offsets, MoE layers, inference (KV caches, fused TP communication),
CUDA graphs, activation offloading, layernorm recomputation.

Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

import torch

from ..fusions.fused_bias_dropout import get_bias_dropout_add
from ..fusions.fused_layer_norm import bias_dropout_add_norm, norm_with_residual
from ..parallel.random import checkpoint as tensor_parallel_checkpoint
from ..utils import make_viewless_tensor
from .identity_op import IdentityFuncOp, IdentityOp
from .module import MegatronModule
from .spec_utils import ModuleSpec, build_module, check_submodules
from .transformer_config import TransformerConfig
from .utils import check_dropout_override, check_layer_number, param_device

__all__ = ["TransformerLayerSubmodules", "BaseTransformerLayer", "TransformerLayer", "check_hidden_states"]

Spec = Union[ModuleSpec, type]


@dataclass
class TransformerLayerSubmodules:
    """The slots of a :class:`TransformerLayer`, in forward and build order; unused ones stay identities.

    ``sharded_state_dict_keys_map`` is Megatron-core's renaming for distributed checkpoints,
    kept for its specs and unused here.

    Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py``.
    """

    input_layernorm: Spec = IdentityOp
    self_attention: Spec = IdentityOp
    self_attn_bda: Spec = IdentityFuncOp

    pre_cross_attn_layernorm: Spec = IdentityOp
    cross_attention: Spec = IdentityOp
    cross_attn_bda: Spec = IdentityFuncOp

    pre_mlp_layernorm: Spec = IdentityOp
    mlp: Spec = IdentityOp
    mlp_bda: Spec = IdentityFuncOp

    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class BaseTransformerLayer:
    """Marks layer classes a :class:`~fusedlib.transformer.transformer_block.TransformerBlock` repeats
    num_layers times when given a layer spec.

    Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py``.
    """


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x), x first cast to the norm's weight dtype (an fp32 residual stream meets bf16 norms)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype != x.dtype:
        x = x.to(weight.dtype)
    return norm(x)


def _norm_and_residual(norm: torch.nn.Module, x: torch.Tensor,
                       post_ln_residual: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x), residual)`` (x cast as in :func:`_norm`): the residual is the norm's output
    with ``post_ln_residual``, else x, through
    :func:`~fusedlib.fusions.fused_layer_norm.norm_with_residual` (fusedlib's norms then add
    the residual's gradient in their backward kernel)."""
    if post_ln_residual:
        y = _norm(norm, x)
        return y, y
    return norm_with_residual(norm, x)


def check_hidden_states(owner: str, hidden_states: object, h: int) -> None:
    """The hidden states a layer or a block takes: a floating-point tensor [s, b, h], s, b >= 1.

    Raises:
        ValueError: not a tensor of that shape (``owner`` names the module).
        TypeError: a tensor that is not floating point (an integer, bool or complex residual
            stream would be rounded to its dtype at every addition: wrong answers, no error).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if not (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3
            and hidden_states.shape[2] == h and hidden_states.shape[0] > 0 and hidden_states.shape[1] > 0):
        got = (f"shape {list(hidden_states.shape)}" if isinstance(hidden_states, torch.Tensor)
               else type(hidden_states).__name__)
        raise ValueError(f"{owner}: hidden_states must be a tensor [s, b, h] with s, b >= 1 and h = "
                         f"hidden_size = {h}, got {got}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"{owner}: hidden_states must be a floating-point tensor, got {hidden_states.dtype}")


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """One transformer layer: [s, b, h] -> ``(output [s, b, h], context)``.

    Args:
        config: reads hidden_size, layernorm_epsilon, hidden_dropout, params_dtype, recompute
            settings, and at each forward bias_dropout_fusion and
            apply_residual_connection_post_layernorm.
        submodules: :class:`TransformerLayerSubmodules`.
        layer_number: 1-based (an int >= 1), passed to the attentions.
        hidden_dropout: overrides config.hidden_dropout.
        pg_collection, vp_stage: must be None (process groups, virtual pipeline: left out).

    The norm slots are built with Megatron-core's ``config, hidden_size, eps`` and, beyond it,
    ``device`` and ``dtype`` (``config.params_dtype``), so that every parameter of the layer is
    created where and as its linear layers are.

    ``forward(hidden_states, attention_mask=None, context=None, context_mask=None,
    rotary_pos_emb=None, attention_bias=None, inference_context=None, packed_seq_params=None)``:
    attention_mask bool [b or 1, 1, s, s], True = masked (or None); context, context_mask: the
    cross attention's key/value states and mask. Returns the output (not a view) and context.

    hidden_states may have another floating dtype than the parameters (an fp32 residual stream
    with bf16 weights, ``fp32_residual_connection``'s case): each norm casts its input to its
    weight's dtype, the residual stream keeps hidden_states' dtype through the layer, and the
    output has it. So bf16 hidden states through an fp32 layer give a bf16 residual stream (the
    sublayers still compute in fp32): pass hidden states of the parameters' dtype for a
    computation wholly in that dtype.

    Raises:
        NotImplementedError: pg_collection, vp_stage, inference_context or packed_seq_params given.
        TypeError: submodules lacking a :class:`TransformerLayerSubmodules` field
            (:func:`~fusedlib.transformer.spec_utils.check_submodules`); config not a TransformerConfig.
        TypeError / ValueError: layer_number not an int / < 1 (:func:`check_layer_number`).
        ValueError: hidden_states not a tensor [s, b, h] with s, b >= 1 and h = hidden_size;
            hidden_dropout not None nor a number in [0, 1].
        TypeError: hidden_states not floating point (:func:`check_hidden_states`).
        Errors of the submodules, naming the module that failed.

    Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py`` (``TransformerLayer``).
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection: object = None,
                 vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config)
        if pg_collection is not None or vp_stage is not None:
            raise NotImplementedError("TransformerLayer: pg_collection and vp_stage are left out of fusedlib")
        self.submodules_config = submodules = check_submodules(
            "TransformerLayer", submodules, TransformerLayerSubmodules, unused=("sharded_state_dict_keys_map",))
        self.layer_number = check_layer_number("TransformerLayer", layer_number)
        hidden_dropout = check_dropout_override("TransformerLayer", "hidden_dropout", hidden_dropout)
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon,
                           device=param_device(config), dtype=config.params_dtype)

        # [Module 1: Input Layernorm]
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        # [Module 2: SelfAttention]
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=self.layer_number)
        # [Module 3: BiasDropoutFusion] a function selector, called at each forward
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        # [Module 4: Pre CrossAttention Layernorm]
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm_kwargs)
        # [Module 5: CrossAttention]
        self.cross_attention = build_module(submodules.cross_attention, config=config,
                                            layer_number=self.layer_number)
        # [Module 6: BiasDropoutFusion]
        self.cross_attn_bda = build_module(submodules.cross_attn_bda, config=config)
        # [Module 7: Pre MLP Layernorm]
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        # [Module 8: MLP block]
        self.mlp = build_module(submodules.mlp, config=config)
        # [Module 9: BiasDropoutFusion]
        self.mlp_bda = build_module(submodules.mlp_bda)

        self.recompute_mlp = (config.recompute_granularity == "selective" and "mlp" in config.recompute_modules
                              and not isinstance(self.mlp, IdentityOp))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, attention_bias: Optional[torch.Tensor] = None,
                inference_context: object = None, packed_seq_params: object = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output [s, b, h], context)``: the attention part, then the MLP part."""
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("TransformerLayer: inference_context and packed_seq_params are left out")
        check_hidden_states("TransformerLayer", hidden_states, self.config.hidden_size)
        if self._bda_into_pre_mlp_norm():
            # nothing between the attention's bias-dropout-add and the MLP's norm: one op for both
            attention_output_with_bias, residual = self._self_attention(hidden_states, attention_mask,
                                                                        rotary_pos_emb, attention_bias)
            pre_mlp_layernorm_output, residual = bias_dropout_add_norm(
                self.pre_mlp_layernorm, attention_output_with_bias, residual, self.hidden_dropout, self.training)
            return self._mlp_and_bda(pre_mlp_layernorm_output, residual), context
        hidden_states, context = self._forward_attention(hidden_states, attention_mask, context, context_mask,
                                                         rotary_pos_emb, attention_bias)
        return self._forward_mlp(hidden_states), context

    def _bda_into_pre_mlp_norm(self) -> bool:
        """Whether the self-attention's bias-dropout-add and the MLP's norm run as one op
        (:func:`~fusedlib.fusions.fused_layer_norm.bias_dropout_add_norm`): the fused
        bias-dropout-add of the specs (``get_bias_dropout_add`` with ``bias_dropout_fusion``),
        no cross attention between them, pre-norm residuals."""
        return (self.config.bias_dropout_fusion and self.self_attn_bda is get_bias_dropout_add
                and not self.config.apply_residual_connection_post_layernorm
                and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
                and isinstance(self.cross_attention, IdentityOp) and isinstance(self.cross_attn_bda, IdentityFuncOp))

    def _self_attention(self, hidden_states, attention_mask, rotary_pos_emb, attention_bias):
        """``(self_attention(input_layernorm(x)) as (output, bias), residual)``."""
        input_layernorm_output, residual = _norm_and_residual(
            self.input_layernorm, hidden_states, self.config.apply_residual_connection_post_layernorm)
        attention_output_with_bias = self.self_attention(input_layernorm_output, attention_mask=attention_mask,
                                                         rotary_pos_emb=rotary_pos_emb,
                                                         attention_bias=attention_bias)
        return attention_output_with_bias, residual

    def _forward_attention(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                           attention_bias):
        post_ln_residual = self.config.apply_residual_connection_post_layernorm
        # (Megatron-core runs each bda under torch.enable_grad, a leftover of nvfuser; not needed here)
        attention_output_with_bias, residual = self._self_attention(hidden_states, attention_mask, rotary_pos_emb,
                                                                    attention_bias)
        hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
            attention_output_with_bias, residual, self.hidden_dropout)

        pre_cross_attn_layernorm_output, residual = _norm_and_residual(
            self.pre_cross_attn_layernorm, hidden_states,
            post_ln_residual and not isinstance(self.pre_cross_attn_layernorm, IdentityOp))
        attention_output_with_bias = self.cross_attention(pre_cross_attn_layernorm_output,
                                                          attention_mask=context_mask, key_value_states=context)
        hidden_states = self.cross_attn_bda(self.training, self.config.bias_dropout_fusion)(
            attention_output_with_bias, residual, self.hidden_dropout)
        return hidden_states, context

    def _forward_mlp(self, hidden_states):
        pre_mlp_layernorm_output, residual = _norm_and_residual(
            self.pre_mlp_layernorm, hidden_states, self.config.apply_residual_connection_post_layernorm)
        return self._mlp_and_bda(pre_mlp_layernorm_output, residual)

    def _mlp_and_bda(self, pre_mlp_layernorm_output, residual):
        if self.recompute_mlp and self.training:
            mlp_output_with_bias = tensor_parallel_checkpoint(self.mlp, pre_mlp_layernorm_output)
        else:
            mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output)
        hidden_states = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
            mlp_output_with_bias, residual, self.hidden_dropout)
        # a function may return a view; Megatron's pipeline schedule frees outputs only if they are not
        return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)
