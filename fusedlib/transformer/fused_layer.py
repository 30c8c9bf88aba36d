"""``FusedTransformerLayer``: a pre-norm GPT layer whose training forward and backward are one
autograd node.

Where a training step waits for the host (a small model launched from Python: chapter 7's
GPT-2-small block), much of the host's time per layer is not the kernels' launches but the
Python around them: each submodule's ``__call__``, each fused op's ``Function.apply`` (seven
per layer), each op's argument checks, and autograd's bookkeeping for the views and GEMMs
between the fused ops. :class:`FusedTransformerLayer` is a :class:`TransformerLayer` (the
same submodules, parameters, state dict and results) whose training forward runs as one
:class:`FusedTransformerLayerFunction`: its ``forward`` calls the fused ops' own Function
forwards in the layer's order, each with a stand-in ``ctx``, and the GEMMs and views between
them without autograd; its ``backward`` calls their backwards in the reverse order and writes
the GEMMs' gradients itself. The kernels, their launches and the Philox keys (drawn in the
same order) are the module path's: with the same seed the outputs and every gradient equal
:class:`TransformerLayer`'s bit for bit, dropout on.

The layer it takes (checked when it is built, a ValueError naming what differs): fusedlib's
local GPT spec (``get_gpt_layer_local_spec()``'s submodules: fusedlib's LayerNorm or RMSNorm
on the fusedlib backend, self-attention with one QKV GEMM and a causal
``DotProductAttention``, the MLP, ``get_bias_dropout_add``) with ``attention_backend="flash"``
(fusedlib's FlashAttention kernel, whose backward is fusedlib's), ``bias_dropout_fusion`` and
``gemm_gelu_fusion`` on, one rank (no tensor or sequence parallelism), no grouped-query
attention, query/key norms, sliding window, activation recomputation, fp32 residual stream,
post-norm residuals or memory-efficient norms.

Each call takes the one-node path when it can: in training, with grad on, hidden states of
the parameters' dtype, no attention mask (the causal mask is the kernel's), no rotary
embeddings, attention bias or cross-attention context, no module hooks on the layer's
submodules (the path calls none of them: their hooks would not run), not under
``torch.compile`` or a ``torch.func`` transform. Otherwise it is :class:`TransformerLayer`'s
forward (evaluation, inference, masks...), with the same results.

Prior art: DeepSpeed's ``DeepSpeedTransformerLayer`` (``deepspeed/ops/transformer/
transformer.py``), a whole BERT layer as one ``torch.autograd.Function`` over its CUDA kernels.

Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py`` (the layer it computes).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..fusions._apply import in_transform, once_differentiable
from ..fusions.fused_attention import FlashAttentionFunction
from ..fusions.fused_bias_dropout import BiasDropoutAddFunction, get_bias_dropout_add
from ..fusions.fused_dense import FusedDenseGeluDenseFunction, _column_sum
from ..fusions.fused_layer_norm import (BiasDropoutAddNormFunction, FusedLayerNorm, FusedLayerNormAffineFunction,
                                        FusedRMSNorm, FusedRMSNormAffineFunction, _has_hooks)
from ..checks import resolve_neg_grads
from ..kernels.flash_attention import MAX_HEAD_DIM, PACKED_GRADS_ATTR, attention_band
from .enums import AttnBackend
from .identity_op import IdentityFuncOp, IdentityOp
from .transformer_config import TransformerConfig
from .transformer_layer import TransformerLayer, TransformerLayerSubmodules, check_hidden_states

__all__ = ["FusedTransformerLayer", "FusedTransformerLayerFunction"]


class _StandInCtx:
    """The ``ctx`` a fused op's Function forward and backward are called with inside
    :class:`FusedTransformerLayerFunction`: it keeps what the forward saves and sets, and tells
    the backward which inputs need gradients."""

    def __init__(self, needs_input_grad: Tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: Tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        pass  # the layer's backward hands every op its gradients, never None where one is read

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass  # (the layer's own node decides what is differentiable)


def _release(op_ctx: _StandInCtx) -> None:
    """Drop what an op's forward saved, once its backward has run."""
    op_ctx.__dict__.clear()


#: The positions of the tensors in :meth:`FusedTransformerLayerFunction.forward`'s arguments.
_X, _LN1_W, _LN1_B, _QKV_W, _QKV_B, _PROJ_W, _PROJ_B, _LN2_W, _LN2_B, _FC1_W, _FC1_B, _FC2_W, _FC2_B = range(13)


class FusedTransformerLayerFunction(torch.autograd.Function):
    """A pre-norm GPT layer with FlashAttention as one autograd node (see the module docstring).

    ``apply(x, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight,
    ln2_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, heads, rms_norm, zero_centered_gamma,
    eps, softmax_scale, hidden_dropout, attention_dropout, deterministic)``:

    - x [s, b, h] (float16, bfloat16 or float32, on a device fusedlib's kernels run on);
    - the norms' weight [h] and bias [h] (None for RMSNorm, ``rms_norm=True``);
    - qkv_weight [3h, h] in Megatron-core's per-head order (each head's query, key and value
      rows together), qkv_bias [3h] or None; proj_weight [h, h], proj_bias [h] or None;
      fc1_weight [ffn, h], fc1_bias [ffn]; fc2_weight [h, ffn], fc2_bias [h] or None; every
      parameter of x's dtype;
    - heads (h divisible by it, head dim h / heads at most 256), eps (both norms'),
      softmax_scale (a float), hidden_dropout and attention_dropout in [0, 1), deterministic
      (FlashAttention's backward without atomic additions).

    Returns out [s, b, h], a new tensor of x's dtype::

        y1 = norm1(x); q, k, v = split(y1 · qkv_weightᵀ + qkv_bias)
        h1 = x + dropout(flash_attention(q, k, v, causal) · proj_weightᵀ + proj_bias, hidden_dropout)
        out = h1 + dropout(gelu_tanh(norm2(h1) · fc1_weightᵀ + fc1_bias) · fc2_weightᵀ + fc2_bias, hidden_dropout)

    with the kernels of :func:`~fusedlib.fusions.fused_layer_norm.fused_layer_norm`,
    :func:`~fusedlib.fusions.fused_attention.flash_attention`,
    :func:`~fusedlib.fusions.fused_layer_norm.bias_dropout_add_norm`,
    :func:`~fusedlib.fusions.fused_dense.fused_dense_gelu_dense` and
    :func:`~fusedlib.fusions.fused_bias_dropout.bias_dropout_add_fused_train`, called in that
    order through their Functions' ``forward``; the backward returns the gradients of the
    13 tensors (None for those that need none). Differentiable once (a double backward raises);
    its backward releases each op's saved tensors once that op's backward has run (the peak
    memory of the module path), so a second backward through the node (``retain_graph=True``)
    raises a RuntimeError.

    The arguments are not checked here: :class:`FusedTransformerLayer` builds them from a
    checked layer (the fused ops' own checks still run inside their forwards).

    Source: the Functions it chains (each names its own source); the one-node layer after
    DeepSpeed's ``DeepSpeedTransformerFunction`` (``deepspeed/ops/transformer/transformer.py``).
    """

    @staticmethod
    def forward(ctx, x, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight, ln2_bias,
                fc1_weight, fc1_bias, fc2_weight, fc2_bias, heads, rms_norm, zero_centered_gamma, eps, softmax_scale,
                hidden_dropout, attention_dropout, deterministic):
        need = ctx.needs_input_grad
        s, b, h = x.shape
        hn = h // heads
        # what each op's inputs need: h1 depends on x, norm1 and the attention's parameters; y2 on
        # those and norm2's; the MLP's output on all of them but fc2's bias
        need_qkv = need[_X] or need[_LN1_W] or need[_LN1_B] or need[_QKV_W] or need[_QKV_B]
        need_a = need_qkv or need[_PROJ_W]
        need_h1 = need_a or need[_PROJ_B]
        need_y2 = need_h1 or need[_LN2_W] or need[_LN2_B]
        need_m = need_y2 or need[_FC1_W] or need[_FC1_B] or need[_FC2_W]
        c_norm = _StandInCtx((need[_X], need[_LN1_W], need[_LN1_B]) + (False,) * 4)
        c_attn = _StandInCtx((need_qkv,) * 3 + (False,) * 6)
        c_bdan = _StandInCtx((need_a, need[_PROJ_B], need[_X], need[_LN2_W], need[_LN2_B]) + (False,) * 5)
        c_mlp = _StandInCtx((need_y2, need[_FC1_W], need[_FC1_B], need[_FC2_W]) + (False,) * 3)
        c_bda = _StandInCtx((need_m, need[_FC2_B], need_h1, False, False))

        if rms_norm:
            y1 = FusedRMSNormAffineFunction.forward(c_norm, x, ln1_weight, eps, False, zero_centered_gamma)
        else:
            y1 = FusedLayerNormAffineFunction.forward(c_norm, x, ln1_weight, ln1_bias, eps, False, zero_centered_gamma)
        # [s, b, h] -> [s, b, 3h] -> [s, b, np, 3·hn] (Megatron-core's per-head q, k, v) -> three views
        mixed = F.linear(y1, qkv_weight, qkv_bias).view(s, b, heads, 3 * hn)
        q, k, v = (t.transpose(0, 1) for t in torch.split(mixed, [hn, hn, hn], dim=-1))  # [b, s, np, hn] views
        o = FlashAttentionFunction.forward(c_attn, q, k, v, None, None, softmax_scale, attention_band(s, s, True, None),
                                           attention_dropout, deterministic)
        core = o.transpose(0, 1).reshape(s, b, h)  # o follows q's [s, b] memory order: a view
        a = F.linear(core, proj_weight)  # the bias goes to the bias-dropout-add
        y2, h1 = BiasDropoutAddNormFunction.forward(c_bdan, a, proj_bias, x, ln2_weight, ln2_bias, eps,
                                                    hidden_dropout, True, rms_norm, zero_centered_gamma)
        m = FusedDenseGeluDenseFunction.forward(c_mlp, y2, fc1_weight, fc1_bias, fc2_weight, None, None, None)
        out = BiasDropoutAddFunction.forward(c_bda, m, fc2_bias, h1, hidden_dropout, True)
        ctx.ops = (c_norm, c_attn, c_bdan, c_mlp, c_bda)
        ctx.save_for_backward(y1 if need[_QKV_W] else None, core if need[_PROJ_W] else None, qkv_weight, proj_weight)
        ctx.dims = (s, b, h, heads, hn)
        ctx.rms_norm = rms_norm
        ctx.needs = (need_qkv, need_a, need_h1, need_y2, need_m)
        return out

    @staticmethod
    @once_differentiable  # the ops' backwards are not themselves differentiable: say so, not silently
    @resolve_neg_grads  # a gradient with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_out):
        if ctx.ops is None:
            raise RuntimeError("FusedTransformerLayer: a second backward through a layer's node (retain_graph=True) "
                               "is not supported: its first backward released the fused ops' saved tensors, as "
                               "each op's own node would have freed them; run the forward again, or use "
                               "TransformerLayer")
        c_norm, c_attn, c_bdan, c_mlp, c_bda = ctx.ops
        y1, core, qkv_weight, proj_weight = ctx.saved_tensors  # (core: a view of the attention's output)
        s, b, h, heads, hn = ctx.dims
        need = ctx.needs_input_grad
        need_qkv, need_a, need_h1, need_y2, need_m = ctx.needs
        # Each op's saved tensors and each gradient are released as soon as the next op no longer
        # needs them (``_release``, ``del``), as autograd frees a node's after its backward: else
        # the MLP's [s·b, ffn] activations would live through the attention's backward.
        grads = [None] * 13
        dm, grads[_FC2_B], dh1 = BiasDropoutAddFunction.backward(c_bda, grad_out)[:3]
        _release(c_bda)
        dy2 = None
        if need_m:
            dy2, grads[_FC1_W], grads[_FC1_B], grads[_FC2_W] = FusedDenseGeluDenseFunction.backward(c_mlp, dm)[:4]
        del dm
        _release(c_mlp)
        if need_y2:  # (need_m covers need_y2, and need_y2 need_h1: dy2 is there, dh1 where needed)
            da, grads[_PROJ_B], dres, grads[_LN2_W], grads[_LN2_B] = BiasDropoutAddNormFunction.backward(
                c_bdan, dy2, dh1)[:5]
            del dy2, dh1
            _release(c_bdan)
            if need[_PROJ_W]:
                grads[_PROJ_W] = da.reshape(s * b, h).t().matmul(core.reshape(s * b, h))  # [h, h]
            del core
            if need_qkv:
                dcore = da.reshape(s * b, h).matmul(proj_weight)  # [s·b, h]
                del da
                do = dcore.view(s, b, heads, hn).transpose(0, 1)  # [b, s, np, hn], as o
                dq, dk, dv = FlashAttentionFunction.backward(c_attn, do)[:3]
                del dcore, do
                _release(c_attn)
                buf = dq._base  # the kernel writes the three into one buffer laid out as mixed (packed_grads)
                if buf is not None and getattr(buf, PACKED_GRADS_ATTR, False) and buf.numel() == 3 * s * b * h:
                    dmixed = buf.view(s * b, 3 * h)
                else:
                    dmixed = torch.cat([t.transpose(0, 1) for t in (dq, dk, dv)], dim=-1).reshape(s * b, 3 * h)
                del dq, dk, dv, buf
                if need[_QKV_W]:
                    grads[_QKV_W] = dmixed.t().matmul(y1.reshape(s * b, h))  # [3h, h]
                if need[_QKV_B]:
                    grads[_QKV_B] = _column_sum(dmixed, qkv_weight.dtype)
                if need[_X] or need[_LN1_W] or need[_LN1_B]:
                    dy1 = dmixed.matmul(qkv_weight).view(s, b, h)
                    norm = FusedRMSNormAffineFunction if ctx.rms_norm else FusedLayerNormAffineFunction
                    # x's gradient: the norm's, plus the residual's (dres) added inside its kernel
                    del dmixed
                    dx, grads[_LN1_W], grads[_LN1_B] = norm.backward(c_norm, dy1, dres)[:3]
                    grads[_X] = dx if need[_X] else None
        ctx.ops = None
        return (*grads, *(None,) * 8)


class FusedTransformerLayer(TransformerLayer):
    """:class:`TransformerLayer` whose training forward and backward are one autograd node,
    :class:`FusedTransformerLayerFunction` (see the module docstring): the same submodules,
    parameters and state dict, the same outputs and gradients, less host time per step.

    Build it from fusedlib's local GPT spec with this class as the module, e.g.
    ``ModuleSpec(FusedTransformerLayer, submodules=get_gpt_layer_local_spec().submodules)``, and a
    config with ``attention_backend="flash"``; a :class:`~fusedlib.transformer.transformer_block.
    TransformerBlock` repeats it as any layer spec.

    Args:
        as :class:`TransformerLayer`.

    ``forward``: as :class:`TransformerLayer`'s, ``(output [s, b, h], context)``; the one-node
    path where it applies (the module docstring), else :class:`TransformerLayer`'s forward.
    :meth:`fused_path_applies` says which a call takes.

    Raises:
        ValueError: at construction, naming the field or submodule the one-node layer does not
            take (the module docstring lists what it takes).
        As :class:`TransformerLayer`.

    Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py``; the one-node layer after
    DeepSpeed's ``DeepSpeedTransformerLayer`` (``deepspeed/ops/transformer/transformer.py``).
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection: object = None,
                 vp_stage: Optional[int] = None) -> None:
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        why = self._unsupported()
        if why:
            raise ValueError(f"FusedTransformerLayer runs one kind of layer as one autograd node (see "
                             f"fusedlib.transformer.fused_layer); this one differs: {why}")
        attn = self.self_attention
        dpa = attn.core_attention
        self._modules_called = (self.input_layernorm, attn, attn.linear_qkv, attn.q_layernorm, attn.k_layernorm,
                                dpa, attn.linear_proj, self.pre_mlp_layernorm, self.mlp, self.mlp.linear_fc1,
                                self.mlp.linear_fc2)

    def _unsupported(self) -> str:
        """Why this layer cannot run as one node ('' when it can)."""
        from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
        from .attention import SelfAttention
        from .dot_product_attention import _CAUSAL, DotProductAttention
        from .mlp import MLP

        cfg = self.config
        checks = (
            (cfg.attention_backend == AttnBackend.flash, f"attention_backend must be flash, got {cfg.attention_backend}"),
            (cfg.bias_dropout_fusion, "bias_dropout_fusion must be on"),
            (cfg.gemm_gelu_fusion, "gemm_gelu_fusion must be on (the MLP as one fused op)"),
            (cfg.tensor_model_parallel_size == 1 and not cfg.sequence_parallel,
             "tensor_model_parallel_size must be 1 and sequence_parallel off"),
            (cfg.recompute_granularity is None, f"recompute_granularity must be None, got {cfg.recompute_granularity!r}"),
            (not cfg.fp32_residual_connection, "fp32_residual_connection must be off"),
            (not cfg.apply_residual_connection_post_layernorm, "apply_residual_connection_post_layernorm must be off"),
            (not cfg.memory_efficient_layer_norm, "memory_efficient_layer_norm must be off"),
            (cfg.num_query_groups == cfg.num_attention_heads, "grouped-query attention (num_query_groups "
             f"{cfg.num_query_groups} != num_attention_heads {cfg.num_attention_heads}) is not taken"),
            (cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size and cfg.kv_channels <= MAX_HEAD_DIM,
             f"kv_channels ({cfg.kv_channels}) x heads must be hidden_size with a head dim <= {MAX_HEAD_DIM}"),
        )
        for ok, why in checks:
            if not ok:
                return why
        norms = (self.input_layernorm, self.pre_mlp_layernorm)
        if not all(type(n) in (FusedLayerNorm, FusedRMSNorm) and n.backend == "fusedlib" for n in norms) \
                or type(norms[0]) is not type(norms[1]) or norms[0].eps != norms[1].eps:
            return ("input_layernorm and pre_mlp_layernorm must be fusedlib's FusedLayerNorm or FusedRMSNorm (one "
                    f"kind, one eps, backend 'fusedlib'), got {type(norms[0]).__name__} and {type(norms[1]).__name__}")
        attn = self.self_attention
        if type(attn) is not SelfAttention:
            return f"self_attention must be SelfAttention, got {type(attn).__name__}"
        qkv, proj, dpa = attn.linear_qkv, attn.linear_proj, attn.core_attention
        if not (type(qkv) is ColumnParallelLinear and not qkv.skip_bias_add and type(proj) is RowParallelLinear
                and proj.skip_bias_add and isinstance(attn.q_layernorm, IdentityOp)
                and isinstance(attn.k_layernorm, IdentityOp)):
            return ("the self-attention must have fusedlib's ColumnParallelLinear QKV (its bias in the GEMM), "
                    "RowParallelLinear projection (skip_bias_add) and no query/key norms")
        if type(dpa) is not DotProductAttention or dpa.attn_mask_type not in _CAUSAL or dpa.window_size is not None:
            return "core_attention must be a causal DotProductAttention without a sliding window"
        if not (self._bda_into_pre_mlp_norm() and self.mlp_bda is get_bias_dropout_add):
            return ("the bias-dropout-adds must be get_bias_dropout_add, with no cross attention "
                    "(IdentityOp / IdentityFuncOp slots) between the attention's and the MLP's norm")
        if not (type(self.mlp) is MLP and self.mlp._gemm_gelu_applies()):
            return "mlp must be an MLP that gemm_gelu_fusion takes (GeLU, fc1 with a bias, one rank, no hooks)"
        if not isinstance(self.cross_attn_bda, IdentityFuncOp):
            return "cross_attn_bda must be IdentityFuncOp"
        return ""

    def fused_path_applies(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                           context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                           rotary_pos_emb: Optional[torch.Tensor] = None,
                           attention_bias: Optional[torch.Tensor] = None) -> bool:
        """Whether a call with these arguments runs as one node (else as :class:`TransformerLayer`):
        training, grad on, hidden states of the parameters' dtype, none of the other inputs,
        no hooks on the submodules the path skips, not under torch.compile or a transform."""
        if not (self.training and torch.is_grad_enabled() and attention_mask is None and context is None
                and context_mask is None and rotary_pos_emb is None and attention_bias is None):
            return False
        if torch.compiler.is_compiling() or in_transform():
            return False
        if hidden_states.dtype != self.input_layernorm.weight.dtype:
            return False
        return not any(_has_hooks(m) for m in self._modules_called)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, attention_bias: Optional[torch.Tensor] = None,
                inference_context: object = None, packed_seq_params: object = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output [s, b, h], context)``: one node where :meth:`fused_path_applies`, else
        :class:`TransformerLayer`'s forward."""
        if inference_context is not None or packed_seq_params is not None \
                or not isinstance(hidden_states, torch.Tensor) \
                or not self.fused_path_applies(hidden_states, attention_mask, context, context_mask,
                                               rotary_pos_emb, attention_bias):
            return super().forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                                   attention_bias, inference_context, packed_seq_params)
        check_hidden_states("FusedTransformerLayer", hidden_states, self.config.hidden_size)
        attn, mlp = self.self_attention, self.mlp
        dpa = attn.core_attention
        ln1, ln2 = self.input_layernorm, self.pre_mlp_layernorm
        out = FusedTransformerLayerFunction.apply(
            hidden_states, ln1.weight, ln1.bias, attn.linear_qkv.weight, attn.linear_qkv.bias,
            attn.linear_proj.weight, attn.linear_proj.bias, ln2.weight, ln2.bias, mlp.linear_fc1.weight,
            mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias, self.config.num_attention_heads,
            type(ln1) is FusedRMSNorm, ln1.zero_centered_gamma, ln1.eps,
            dpa.softmax_scale * (dpa.scale_mask_softmax.scale or 1.0), self.hidden_dropout, dpa.attention_dropout.p,
            self.config.deterministic_mode)
        return out, context
