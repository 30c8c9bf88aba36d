"""``FusedTransformerLayer``: a pre-norm GPT layer whose training forward and backward are one
autograd node.

Where a training step waits for the host (a small model launched from Python: chapter 7's
GPT-2-small block), much of the host's time per layer is not the kernels' launches but the
Python around them: each submodule's ``__call__`` (seven per layer), each autograd Function's
``apply`` (seven: five fused ops, the QKV projection's GEMM and the QKV split), each op's
argument checks, and autograd's bookkeeping for the views and GEMMs between the fused ops.
:class:`FusedTransformerLayer` is a :class:`TransformerLayer` (the same submodules,
parameters, state dict and results) whose training forward runs as one
:class:`FusedTransformerLayerFunction`: its ``forward`` calls the fused ops' own Function
forwards in the layer's order, each with a stand-in ``ctx``, and the GEMMs and views between
them without autograd; its ``backward`` calls their backwards in the reverse order and writes
the GEMMs' gradients itself. The kernels, their launches and the Philox keys (drawn in the
same order) are the module path's: with the same seed the outputs and every gradient equal
:class:`TransformerLayer`'s bit for bit, dropout on, wherever the kernels are deterministic (all
of fusedlib's; torch's SDPA kernels on a CUDA device other than its math kernel may sum gradients
with atomic additions, and then two runs of either path differ as much as each other).

The layer it takes (checked when it is built, a ValueError naming what differs): fusedlib's
local GPT spec (``get_gpt_layer_local_spec()``'s submodules: fusedlib's LayerNorm or RMSNorm,
one kind for both norms, on the fusedlib backend, self-attention with one QKV GEMM and a causal
``DotProductAttention``, the MLP, ``get_bias_dropout_add``) with ``attention_backend`` one of
``flash`` (fusedlib's FlashAttention kernel, whose backward is fusedlib's; heads of at most 256
channels), ``local`` / ``unfused`` with ``masked_softmax_fusion`` on (DotProductAttention's
materialised path: the scores by ``torch.baddbmm``, the probabilities and their dropout by
fusedlib's softmax kernel, the context by ``torch.bmm``; the layer computes the two products'
gradients itself by autograd's own formulas, on the same operands) or ``auto`` / ``fused``
(torch's ``scaled_dot_product_attention``, DotProductAttention's SDPA call: its backward is
torch's, inside autograd, so the node keeps that one call's small graph, made on views of q, k
and v that hold no tensor (``_SdpaInputs``), and runs its backward with ``torch.autograd.grad``;
torch picks the kernel, as it does for the module path), ``bias_dropout_fusion`` and
``gemm_gelu_fusion`` on, one rank (``tensor_model_parallel_size`` 1), heads of
``kv_channels = hidden_size / num_attention_heads`` channels, no grouped-query attention,
query/key norms, sliding window, activation recomputation, fp32 residual stream, post-norm
residuals or memory-efficient norms.

Each call takes the one-node path only when the module path would compute the same thing with
the same checks passing, else it is :class:`TransformerLayer`'s forward (the same results, and
the same errors): in training (the layer and every submodule the path replaces), with grad on,
no autocast, no saved-tensor hooks (activation checkpointing or offloading: the path's
activations are not saved through autograd, so those hooks could not reach them), not under
``torch.compile`` or a ``torch.func`` transform; no attention mask (the causal mask is the
kernel's), rotary embeddings, attention bias or cross-attention context; no module hooks on the
submodules (the path calls none of them: their hooks would not run); the layer as built checks
again (its config and submodules may have changed since: the check above runs at every call);
its parameters of the hidden states' dtype (float16, bfloat16 or float32) and shapes; a valid
attention dropout (with SDPA, the dropout module's value is handed to torch as the module
path hands it); with FlashAttention a valid softmax scale; with SDPA a float softmax scale > 0
(where the module path passes ``is_causal``, not an explicit mask:
:func:`~fusedlib.transformer.dot_product_attention.sdpa_is_causal_call`); on the materialised path the
attention's softmax and dropout modules of their built types (``FusedScaleMaskSoftmax``,
``torch.nn.Dropout``), the softmax module's scale valid, its fp16 / bf16 flags matching that
dtype, a bool ``attention_softmax_in_fp32``, and fusedlib's fused softmax kernel on the causal
band, without a window, being what the module path would run (``DotProductAttention.softmax_function``).

Autograd still checks the layer's inputs (hidden states and parameters) for in-place changes
between the forward and the backward, as for the module path, with its own error.

Prior art: DeepSpeed's ``DeepSpeedTransformerLayer`` (``deepspeed/ops/transformer/
transformer.py``), a whole BERT layer as one ``torch.autograd.Function`` over its CUDA kernels.

Source: Megatron-LM ``megatron/core/transformer/transformer_layer.py`` (the layer it computes).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..fusions._apply import in_transform, once_differentiable
from ..fusions.fused_attention import FlashAttentionFunction, _check_dropout_p, _check_scale
from ..fusions.fused_bias_dropout import BiasDropoutAddFunction, get_bias_dropout_add
from ..fusions.fused_dense import FusedDenseGeluDenseFunction, _checked_path, _column_sum
from ..fusions.fused_layer_norm import (BiasDropoutAddNormFunction, FusedLayerNorm, FusedLayerNormAffineFunction,
                                        FusedRMSNorm, FusedRMSNormAffineFunction, _global_module_hooks,
                                        _has_own_hooks)
from ..fusions.fused_softmax import ScaledMaskedSoftmaxDropout
from ..fusions.fused_softmax import _check_scale as _softmax_check_scale
from ..checks import check_bool, resolve_neg_grads
from ..kernels.flash_attention import MAX_HEAD_DIM, attention_band
from ..kernels.softmax import causal_band
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from .attention import SelfAttention, SplitLastDim
from .dot_product_attention import (_CAUSAL, FLASH_BACKENDS, MATERIALISED_BACKENDS, SDPA_BACKENDS,
                                    DotProductAttention, materialised_context, materialised_scores,
                                    sdpa_context, sdpa_is_causal_call)
from .identity_op import IdentityOp
from .mlp import MLP
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
        pass  # (the layer's backward hands the ops None only where their backwards take None)

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass  # (the layer's own node decides what is differentiable)


def _release(op_ctx: _StandInCtx, keep: bool = False) -> None:
    """Drop what an op's forward saved, once its backward has run (``keep``: a backward that
    retains the graph, ``retain_graph=True``: nothing is dropped)."""
    if not keep:
        op_ctx.__dict__.clear()


def _keeps_graph() -> bool:
    """Whether the backward running now retains the graph (``retain_graph=True``, or
    ``create_graph``): autograd keeps every node's saved tensors then, and so must the one node.
    Read from autograd's current graph task, as PyTorch's own compiled backward reads it
    (``torch/_functorch/_aot_autograd/runtime_wrappers.py``); False where this torch has no such
    query (the node then releases, and a second backward raises)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False


def _materialised_attention(c_softmax: _StandInCtx, function: type, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, alpha: float, coeff: float, dropout_p: float) -> torch.Tensor:
    """DotProductAttention's materialised causal attention through its own steps
    (:func:`~fusedlib.transformer.dot_product_attention.materialised_scores` and
    ``materialised_context``): q, k, v [s, b, np, hn] (views of the QKV projection) -> the
    context [s, b, np·hn]. The softmax (and its dropout, one kernel when ``dropout_p`` > 0) is
    ``function``, the Function the module path would run
    (:meth:`~fusedlib.transformer.dot_product_attention.DotProductAttention.softmax_function`),
    run with the stand-in ``c_softmax``, which also keeps what the products' gradients read."""
    s = q.shape[0]
    q2, k2, scores = materialised_scores(q, k, alpha)
    if function is ScaledMaskedSoftmaxDropout:
        probs = function.forward(c_softmax, scores, None, coeff, causal_band(s, s), None, dropout_p)
    else:
        probs = function.forward(c_softmax, scores, None, coeff, causal_band(s, s), None)
    p3, v2, context = materialised_context(probs, v)
    c_softmax.function = function
    c_softmax.products = (q2, k2, v2, p3, alpha, q.shape)
    return context


def _materialised_attention_backward(c_softmax: _StandInCtx,
                                     keep: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v [s, b, np, hn] from the context's, as autograd computes them
    through the module path's graph: the products' gradients by the formulas of PyTorch's
    ``derivatives.yaml`` for ``bmm`` and ``baddbmm``, on the same strided operands, around the
    softmax's own backward. ``c_softmax``: the stand-in :func:`_materialised_attention` ran with,
    holding the context's gradient as ``dctx`` [b·np, s, hn] (the [s, b, np, hn] gradient seen
    through the context's views); what it holds is released as soon as it is read, but for the
    operands of the products and the softmax's saved tensors when ``keep`` (a backward that
    retains the graph)."""
    q2, k2, v2, p3, alpha, (s, b, np_, hn) = c_softmax.products
    dctx = c_softmax.dctx
    c_softmax.dctx = None
    if not keep:
        c_softmax.products = None
    dp = dctx.bmm(v2.transpose(1, 2))  # bmm: self's gradient, grad · mat2ᵀ
    dv2 = p3.transpose(1, 2).bmm(dctx)  # ... mat2's, selfᵀ · grad
    del p3, v2, dctx
    ds = c_softmax.function.backward(c_softmax, dp.view(b, np_, s, s))[0].view(b * np_, s, s)
    del dp
    if not keep:
        c_softmax.saved_tensors = ()  # the scores
    dq2 = ds.bmm(k2)  # baddbmm: batch1's gradient, grad · batch2ᵀ · alpha
    dk2t = q2.transpose(1, 2).bmm(ds)  # ... batch2's, batch1ᵀ · grad · alpha, [b·np, hn, s]
    if alpha != 1:  # (autograd's maybe_multiply: no multiply by 1)
        dq2.mul_(alpha), dk2t.mul_(alpha)
    # [b·np, s, hn] -> [s, b·np, hn] -> [s, b, np, hn]: views
    return (dq2.transpose(0, 1).reshape(s, b, np_, hn), dk2t.transpose(1, 2).transpose(0, 1).reshape(s, b, np_, hn),
            dv2.transpose(0, 1).reshape(s, b, np_, hn))


class _SdpaInputs(torch.autograd.Function):
    """q, k and v as inputs of the SDPA call's graph that hold no tensor: ``apply(anchor, q, k, v)``
    returns views of q, k and v whose node leads only to ``anchor``, a 0-element leaf. The graph's
    gradients are read at this node's three edges, so its backward never runs; a leaf made from q,
    k and v themselves would keep them (and the QKV buffer they view) alive through its
    ``AccumulateGrad`` node, where the module path's graph keeps only what SDPA's kernel saves."""

    @staticmethod
    def forward(ctx, anchor, q, k, v):
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):  # (not reached: the gradients are taken at the edges into it)
        return None, dq, dk, dv


def _sdpa_attention(c_attn: _StandInCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    dropout_p: Any, need_grad: bool) -> torch.Tensor:
    """DotProductAttention's SDPA call for causal attention without a mask
    (:func:`~fusedlib.transformer.dot_product_attention.sdpa_context`, as ``_forward_sdpa`` makes
    it): q, k, v [s, b, np, hn] (views of the QKV projection) -> the context [s, b, np·hn], with
    ``is_causal``, ``scale`` and the dropout module's own ``dropout_p``. Its backward is torch's,
    inside autograd: with ``need_grad`` the call runs under ``enable_grad`` on
    :class:`_SdpaInputs`' views of q, k and v, and ``c_attn`` keeps that small graph's edges, the
    context's and the three inputs', for :func:`_sdpa_attention_backward`: the same kernel, the
    same random-number draws and the same saved tensors as the module path's SDPA node, and no
    tensor beyond them."""
    if not need_grad:
        return sdpa_context(q, k, v, dropout_p, True, scale, False)
    edge = torch.autograd.graph.get_gradient_edge
    with torch.enable_grad():
        anchor = torch.empty(0, device=q.device, dtype=q.dtype, requires_grad=True)
        inputs = _SdpaInputs.apply(anchor, q, k, v)
        core = sdpa_context(*inputs, dropout_p, True, scale, False)
    # (where a GradientEdge holds its node weakly, torch 2.6's, the context's edge keeps the chain
    # of nodes back to _SdpaInputs' alive)
    c_attn.sdpa = (edge(core), tuple(edge(t) for t in inputs))
    return core.detach()


def _sdpa_attention_backward(c_attn: _StandInCtx, dcore: torch.Tensor,
                             keep: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v [s, b, np, hn] from the context's, ``dcore`` [s, b, np, hn],
    through the graph :func:`_sdpa_attention` kept: torch's own SDPA backward (``keep``: the graph
    retained for another backward)."""
    out, inputs = c_attn.sdpa
    if not keep:
        c_attn.sdpa = None
    s, b, np_, hn = dcore.shape
    return torch.autograd.grad(out, inputs, dcore.view(s, b, np_ * hn), retain_graph=keep)


#: The positions of the tensors in :meth:`FusedTransformerLayerFunction.forward`'s arguments.
_X, _LN1_W, _LN1_B, _QKV_W, _QKV_B, _PROJ_W, _PROJ_B, _LN2_W, _LN2_B, _FC1_W, _FC1_B, _FC2_W, _FC2_B = range(13)


class FusedTransformerLayerFunction(torch.autograd.Function):
    """A pre-norm GPT layer as one autograd node, its attention FlashAttention, the materialised
    path or torch's SDPA (see the module docstring).

    ``apply(x, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight,
    ln2_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, heads, rms_norm, ln1_zero_centered_gamma,
    ln1_eps, ln2_zero_centered_gamma, ln2_eps, softmax_scale, hidden_dropout, attention_dropout,
    deterministic, materialised=None, softmax_coeff=1.0, sdpa=False)``:

    - x [s, b, h] (float16, bfloat16 or float32, on a device fusedlib's kernels run on);
    - the norms' weight [h] and bias [h] (None for RMSNorm, ``rms_norm=True``);
    - qkv_weight [3h, h] in Megatron-core's per-head order (each head's query, key and value
      rows together), qkv_bias [3h] or None; proj_weight [h, h], proj_bias [h] or None;
      fc1_weight [ffn, h], fc1_bias [ffn]; fc2_weight [h, ffn], fc2_bias [h] or None; every
      parameter of x's dtype;
    - heads (h divisible by it; head dim h / heads at most 256 with FlashAttention), each norm's
      zero-centered gamma and eps, hidden_dropout in [0, 1], attention_dropout in [0, 1),
      deterministic (FlashAttention's backward without atomic additions; unused by the other
      two attentions);
    - materialised: None for FlashAttention, whose softmax_scale (a float) multiplies the
      scores; for DotProductAttention's materialised path the softmax's autograd Function
      (:meth:`~fusedlib.transformer.dot_product_attention.DotProductAttention.softmax_function`:
      the softmax with its dropout, or without dropout the softmax alone): scores =
      softmax_scale · q·kᵀ by ``torch.baddbmm``, then that causal softmax of softmax_coeff ·
      scores (a float; ``FusedScaleMaskSoftmax``'s ``scale``, the query-key layer scaling's
      factor) with its dropout, the context by ``torch.bmm``;
    - sdpa: True (with materialised None) for torch's ``scaled_dot_product_attention``, causal,
      its scale softmax_scale (a float > 0), its dropout attention_dropout (the dropout module's
      value, unconverted): its backward through autograd (:func:`_sdpa_attention`).

    Returns out [s, b, h], a new tensor of x's dtype::

        y1 = norm1(x); q, k, v = split(y1 · qkv_weightᵀ + qkv_bias)
        h1 = x + dropout(attention(q, k, v, causal) · proj_weightᵀ + proj_bias, hidden_dropout)
        out = h1 + dropout(gelu_tanh(norm2(h1) · fc1_weightᵀ + fc1_bias) · fc2_weightᵀ + fc2_bias, hidden_dropout)

    with the kernels of :func:`~fusedlib.fusions.fused_layer_norm.fused_layer_norm`,
    :func:`~fusedlib.fusions.fused_attention.flash_attention` (or the materialised attention's
    GEMMs and :func:`~fusedlib.fusions.fused_softmax.fused_scale_mask_softmax_dropout`, or SDPA),
    :func:`~fusedlib.fusions.fused_layer_norm.bias_dropout_add_norm`,
    :func:`~fusedlib.fusions.fused_dense.fused_dense_gelu_dense` and
    :func:`~fusedlib.fusions.fused_bias_dropout.bias_dropout_add_fused_train`, called in that
    order through their Functions' ``forward``; the backward returns the gradients of the
    13 tensors (None for those that need none), the materialised attention's products' by the
    formulas autograd uses for them (the module path's gradients bit for bit). Differentiable
    once (a double backward raises); its backward releases each op's saved tensors once that
    op's backward has run, as autograd frees each node's, except in a backward that retains the
    graph (``retain_graph=True``, read from autograd's current graph task), which keeps them all,
    as autograd keeps every node's: the next backward gives the same gradients again. A
    backward after one that released them raises a RuntimeError, as the module path's graph
    does. Peak memory: autograd holds the gradient it hands the node, grad_out
    [s, b, h], until the node's backward returns, where the module path's graph frees it after
    the MLP's bias-dropout-add; so the node's backward holds one [s, b, h] tensor longer. Where
    a step's peak falls inside the attention's backward (the materialised attention: its
    [b, np, s, s] gradients) that is one [s, b, h] more at the peak (32 MiB on an H200 at s 2048,
    b 4, h 2048: 3434 against 3402 MiB); with FlashAttention the peak falls elsewhere and is the
    module path's; with SDPA it depends on where torch's kernel puts the step's peak (its math
    kernel materialises the scores as the materialised attention does).

    The arguments are not checked here: :class:`FusedTransformerLayer` builds them from a
    checked layer (the fused ops' own checks still run inside their forwards).

    Source: the Functions it chains (each names its own source); the one-node layer after
    DeepSpeed's ``DeepSpeedTransformerFunction`` (``deepspeed/ops/transformer/transformer.py``).
    """

    @staticmethod
    def forward(ctx, x, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight, ln2_bias,
                fc1_weight, fc1_bias, fc2_weight, fc2_bias, heads, rms_norm, ln1_zero_centered_gamma, ln1_eps,
                ln2_zero_centered_gamma, ln2_eps, softmax_scale, hidden_dropout, attention_dropout, deterministic,
                materialised=None, softmax_coeff=1.0, sdpa=False):
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
        c_attn = _StandInCtx((need_qkv,) * 3 + (False,) * 6)  # (the softmax's backward reads [4]: False)
        c_bdan = _StandInCtx((need_a, need[_PROJ_B], need[_X], need[_LN2_W], need[_LN2_B]) + (False,) * 5)
        c_mlp = _StandInCtx((need_y2, need[_FC1_W], need[_FC1_B], need[_FC2_W]) + (False,) * 3)
        c_bda = _StandInCtx((need_m, need[_FC2_B], need_h1, False, False))

        if rms_norm:
            y1 = FusedRMSNormAffineFunction.forward(c_norm, x, ln1_weight, ln1_eps, False, ln1_zero_centered_gamma)
        else:
            y1 = FusedLayerNormAffineFunction.forward(c_norm, x, ln1_weight, ln1_bias, ln1_eps, False,
                                                      ln1_zero_centered_gamma)
        # [s, b, h] -> [s, b, 3h] -> [s, b, np, 3·hn] (Megatron-core's per-head q, k, v) -> three views
        mixed = F.linear(y1, qkv_weight, qkv_bias).view(s, b, heads, 3 * hn)
        # the module path's split (SplitLastDim), whose backward takes FlashAttention's packed gradient whole
        c_split = _StandInCtx(())
        q, k, v = SplitLastDim.forward(c_split, mixed, [hn, hn, hn])  # [s, b, np, hn] views
        if materialised is not None:  # the scores and probabilities in memory (DotProductAttention's local path)
            core = _materialised_attention(c_attn, materialised, q, k, v, softmax_scale, softmax_coeff,
                                           attention_dropout)
        elif sdpa:  # torch's scaled_dot_product_attention, its backward inside autograd
            core = _sdpa_attention(c_attn, q, k, v, softmax_scale, attention_dropout, need_qkv)
        else:  # [s, b, np, hn] seen as [b, s, np, hn]: views, read through their strides
            o = FlashAttentionFunction.forward(c_attn, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None,
                                               None, softmax_scale, attention_band(s, s, True, None),
                                               attention_dropout, deterministic)
            core = o.transpose(0, 1).reshape(s, b, h)  # o follows q's [s, b] memory order: a view
        a = F.linear(core, proj_weight)  # the bias goes to the bias-dropout-add
        y2, h1 = BiasDropoutAddNormFunction.forward(c_bdan, a, proj_bias, x, ln2_weight, ln2_bias, ln2_eps,
                                                    hidden_dropout, True, rms_norm, ln2_zero_centered_gamma)
        # the MLP's route (cuBLASLt's epilogues or the kernels) as fused_dense_gelu_dense chooses it
        # for the module path: checked once per signature, then taken from its plan
        path = _checked_path(y2, fc1_weight, fc1_bias, fc2_weight, None, None)
        m = FusedDenseGeluDenseFunction.forward(c_mlp, y2, fc1_weight, fc1_bias, fc2_weight, None, None, path)
        out = BiasDropoutAddFunction.forward(c_bda, m, fc2_bias, h1, hidden_dropout, True)
        ctx.ops = (c_norm, c_split, c_attn, c_bdan, c_mlp, c_bda)
        # the inputs the ops saved go through save_for_backward too, so that autograd checks them
        # for in-place changes before the backward, as it would each op's node (the ops' own
        # stand-ins hold them for their backwards)
        ctx.save_for_backward(qkv_weight, proj_weight, x, ln1_weight, ln1_bias, ln2_weight, ln2_bias, fc1_weight,
                              fc1_bias, fc2_weight)
        # internal tensors (no caller can change them): held here, each dropped once its GEMM has read it
        ctx.y1, ctx.core = (y1 if need[_QKV_W] else None), (core if need[_PROJ_W] else None)
        ctx.dims = (s, b, h, heads, hn)
        ctx.rms_norm, ctx.materialised, ctx.sdpa = rms_norm, materialised is not None, sdpa
        # what no backward will read is not kept (the module path builds no node for it): the
        # attention's saved tensors where nothing before it needs a gradient, the first norm's
        # where neither x nor its parameters do
        if not need_qkv:
            _release(c_attn)
        if not (need[_X] or need[_LN1_W] or need[_LN1_B]):
            _release(c_norm)
        ctx.needs = (need_qkv, need_a, need_h1, need_y2, need_m)
        return out

    @staticmethod
    @once_differentiable  # the ops' backwards are not themselves differentiable: say so, not silently
    @resolve_neg_grads  # a gradient with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_out):
        if ctx.ops is None:
            raise RuntimeError("FusedTransformerLayer: a second backward through a layer's node after a backward "
                               "that did not retain the graph (retain_graph=True keeps it): the first backward "
                               "released the fused ops' saved tensors, as each op's own node would have freed "
                               "them; run the forward again")
        keep = _keeps_graph()  # retain_graph: release nothing, as autograd then frees no node's tensors
        c_norm, c_split, c_attn, c_bdan, c_mlp, c_bda = ctx.ops
        qkv_weight, proj_weight = ctx.saved_tensors[:2]  # (the rest: autograd's in-place checks of the inputs)
        s, b, h, heads, hn = ctx.dims
        need = ctx.needs_input_grad
        need_qkv, need_a, need_h1, need_y2, need_m = ctx.needs
        # Each op's saved tensors and each gradient are released as soon as the next op no longer
        # needs them (``_release``, ``del``), as autograd frees a node's after its backward: else
        # the MLP's [s·b, ffn] activations would live through the attention's backward.
        grads = [None] * 13
        dm, grads[_FC2_B], dh1 = BiasDropoutAddFunction.backward(c_bda, grad_out)[:3]
        _release(c_bda, keep)
        dy2 = None
        if need_m:
            dy2, grads[_FC1_W], grads[_FC1_B], grads[_FC2_W] = FusedDenseGeluDenseFunction.backward(c_mlp, dm)[:4]
        del dm
        _release(c_mlp, keep)
        if need_y2:  # (need_m covers need_y2, and need_y2 need_h1: dy2 is there, dh1 where needed)
            da, grads[_PROJ_B], dres, grads[_LN2_W], grads[_LN2_B] = BiasDropoutAddNormFunction.backward(
                c_bdan, dy2, dh1)[:5]
            del dy2, dh1
            _release(c_bdan, keep)
            if need[_PROJ_W]:  # (core: a view of the attention's output)
                grads[_PROJ_W] = da.reshape(s * b, h).t().matmul(ctx.core.reshape(s * b, h))  # [h, h]
            if not keep:
                ctx.core = None
            if need_qkv:
                dcore = da.reshape(s * b, h).matmul(proj_weight).view(s, b, heads, hn)  # [s, b, np, hn]
                del da
                if ctx.materialised:  # (the stand-in carries the gradient in, so that the backward frees it)
                    c_attn.dctx, dcore = dcore.permute(1, 2, 0, 3).reshape(b * heads, s, hn), None  # a view
                    dq, dk, dv = _materialised_attention_backward(c_attn, keep)
                elif ctx.sdpa:
                    dq, dk, dv = _sdpa_attention_backward(c_attn, dcore, keep)
                else:
                    dq, dk, dv = (t.transpose(0, 1)  # [b, s, np, hn] -> [s, b, np, hn]
                                  for t in FlashAttentionFunction.backward(c_attn, dcore.transpose(0, 1))[:3])
                del dcore
                _release(c_attn, keep)
                # [s, b, np, 3·hn] as the split's backward gives it: FlashAttention's packed buffer whole
                # where the kernel wrote one, else the three concatenated
                dmixed = SplitLastDim.backward(c_split, dq, dk, dv)[0]
                dmixed = dmixed.reshape(s * b, 3 * h)
                del dq, dk, dv
                if need[_QKV_W]:
                    grads[_QKV_W] = dmixed.t().matmul(ctx.y1.reshape(s * b, h))  # [3h, h]
                if not keep:
                    ctx.y1 = None
                if need[_QKV_B]:
                    grads[_QKV_B] = _column_sum(dmixed, qkv_weight.dtype)
                if need[_X] or need[_LN1_W] or need[_LN1_B]:
                    dy1 = dmixed.matmul(qkv_weight).view(s, b, h)
                    norm = FusedRMSNormAffineFunction if ctx.rms_norm else FusedLayerNormAffineFunction
                    # x's gradient: the norm's, plus the residual's (dres) added inside its kernel
                    del dmixed
                    dx, grads[_LN1_W], grads[_LN1_B] = norm.backward(c_norm, dy1, dres)[:3]
                    grads[_X] = dx if need[_X] else None
        if not keep:
            ctx.ops = None
        return (*grads, *(None,) * 13)


class FusedTransformerLayer(TransformerLayer):
    """:class:`TransformerLayer` whose training forward and backward are one autograd node,
    :class:`FusedTransformerLayerFunction` (see the module docstring): the same submodules,
    parameters and state dict, the same outputs and gradients (bit for bit where the kernels are
    deterministic: see the module docstring), less host time per step.

    Build it from fusedlib's local GPT spec with this class as the module, e.g.
    ``ModuleSpec(FusedTransformerLayer, submodules=get_gpt_layer_local_spec().submodules)``
    (``fusedlib.models.gpt.get_gpt_fused_layer_spec()``), and a
    config with ``attention_backend`` flash, auto / fused (SDPA), or local / unfused with
    ``masked_softmax_fusion``;
    a :class:`~fusedlib.transformer.transformer_block.TransformerBlock` repeats it as any layer
    spec.

    Args:
        as :class:`TransformerLayer`.

    ``forward``: as :class:`TransformerLayer`'s, ``(output [s, b, h], context)``; the one-node
    path where :meth:`fused_path_applies` (the module docstring lists when), else
    :class:`TransformerLayer`'s forward. A backward with ``retain_graph=True`` keeps the node's
    saved tensors, as the module path keeps its nodes' (two losses backpropagated through one
    forward work as with :class:`TransformerLayer`); a backward after one without it raises a
    RuntimeError (:class:`FusedTransformerLayerFunction`), as the module path's graph does.

    Raises:
        ValueError: at construction, naming the field or submodule the one-node layer does not
            take (the module docstring lists what it takes).
        RuntimeError: a backward through a one-node call after a backward that did not retain the
            graph (as :class:`TransformerLayer`'s graph raises, with PyTorch's own message).
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

    def _parts(self) -> Optional[tuple]:
        """(norm1, attention, qkv, proj, core attention, norm2, mlp, fc1, fc2) as the layer holds them
        now, read from the modules' own dicts (a call reads them every time, cheaply), or None
        where a slot is not a module with the children the one-node layer reads."""
        try:
            m = self._modules
            attn, mlp = m["self_attention"], m["mlp"]
            am, mm = attn._modules, mlp._modules
            return (m["input_layernorm"], attn, am["linear_qkv"], am["linear_proj"], am["core_attention"],
                    m["pre_mlp_layernorm"], mlp, mm["linear_fc1"], mm["linear_fc2"])
        except (KeyError, AttributeError, TypeError):
            return None

    def _unsupported(self, parts: Optional[tuple] = None) -> str:
        """Why this layer, as its config and submodules are now, cannot run as one node ('' when it
        can); ``parts``: :meth:`_parts`, read here when None."""
        cfg = self.config
        flash, sdpa = cfg.attention_backend in FLASH_BACKENDS, cfg.attention_backend in SDPA_BACKENDS
        if not (flash or sdpa or cfg.attention_backend in MATERIALISED_BACKENDS):
            return (f"config.attention_backend must be an AttnBackend (flash, auto, fused, local or unfused), got "
                    f"{cfg.attention_backend!r}")
        if not (flash or sdpa) and cfg.masked_softmax_fusion is not True:
            return ("config.masked_softmax_fusion must be True with the materialised attention (local or unfused: "
                    f"fusedlib's softmax and dropout kernel), got {cfg.masked_softmax_fusion!r}")
        for name, want in (("bias_dropout_fusion", True), ("gemm_gelu_fusion", True),
                           ("fp32_residual_connection", False), ("apply_residual_connection_post_layernorm", False),
                           ("memory_efficient_layer_norm", False)):
            if getattr(cfg, name) is not want:
                return f"config.{name} must be {want}, got {getattr(cfg, name)!r}"
        if cfg.tensor_model_parallel_size != 1:
            return f"config.tensor_model_parallel_size must be 1, got {cfg.tensor_model_parallel_size}"
        if cfg.recompute_granularity is not None:
            return f"config.recompute_granularity must be None, got {cfg.recompute_granularity!r}"
        parts = self._parts() if parts is None else parts
        if parts is None:
            return "the layer must have the local spec's submodules (self_attention, mlp and their children)"
        norm1, attn, qkv, proj, dpa, norm2, mlp, _, _ = parts
        kind = type(norm1)
        if not (kind in _FUSED_NORMS and type(norm2) is kind and norm1.backend == "fusedlib"
                and norm2.backend == "fusedlib"):
            return ("input_layernorm and pre_mlp_layernorm must be fusedlib's FusedLayerNorm or FusedRMSNorm (one "
                    f"kind, backend 'fusedlib'), got {kind.__name__} and {type(norm2).__name__}")
        if type(attn) is not SelfAttention:
            return f"self_attention must be SelfAttention, got {type(attn).__name__}"
        am = attn._modules
        if not (type(qkv) is ColumnParallelLinear and not qkv.skip_bias_add and type(proj) is RowParallelLinear
                and proj.skip_bias_add and isinstance(am.get("q_layernorm"), IdentityOp)
                and isinstance(am.get("k_layernorm"), IdentityOp)):
            return ("the self-attention must have fusedlib's ColumnParallelLinear QKV (its bias in the GEMM), "
                    "RowParallelLinear projection (skip_bias_add) and no query/key norms")
        if type(dpa) is not DotProductAttention or dpa.attn_mask_type not in _CAUSAL or dpa.window_size is not None:
            return "core_attention must be a causal DotProductAttention without a sliding window"
        heads, groups, hn = (dpa.num_attention_heads_per_partition, dpa.num_query_groups_per_partition,
                             dpa.hidden_size_per_attention_head)
        if heads != groups:
            return f"grouped-query attention ({groups} query groups for {heads} heads) is not taken"
        if heads * hn != cfg.hidden_size or (flash and hn > MAX_HEAD_DIM):
            return (f"the heads must split hidden_size {cfg.hidden_size}: {heads} heads of kv_channels {hn}"
                    + (f" (at most {MAX_HEAD_DIM} with the flash backend)" if flash else ""))
        if not (self._bda_into_pre_mlp_norm() and self.mlp_bda is get_bias_dropout_add):
            return ("the bias-dropout-adds must be get_bias_dropout_add, with no cross attention "
                    "(IdentityOp / IdentityFuncOp slots) between the attention's and the MLP's norm")
        # (the MLP's structure as MLP._gemm_gelu_applies reads it; hooks are a call's matter: _plan)
        fc1, fc2 = mlp._modules.get("linear_fc1"), mlp._modules.get("linear_fc2")
        if not (type(mlp) is MLP and type(fc1) is ColumnParallelLinear and type(fc2) is RowParallelLinear):
            return "mlp must be an MLP of fusedlib's ColumnParallelLinear fc1 and RowParallelLinear fc2"
        if not (fc1.tp_world_size == 1 and fc2.tp_world_size == 1 and fc1.skip_bias_add and fc2.skip_bias_add
                and fc1.weight is not None and fc1.bias is not None):
            return "mlp's fc1 and fc2 must be on one rank, return their biases (skip_bias_add), fc1 with a bias"
        return ""

    def _plan(self, x: torch.Tensor, attention_mask, context, context_mask, rotary_pos_emb,
              attention_bias) -> Optional[tuple]:
        """The arguments of :class:`FusedTransformerLayerFunction` after x for this call, or None
        where the call takes :class:`TransformerLayer`'s forward (see the module docstring)."""
        if not (self.training and torch.is_grad_enabled() and attention_mask is None and context is None
                and context_mask is None and rotary_pos_emb is None and attention_bias is None
                and isinstance(x, torch.Tensor)):
            return None
        if (torch.compiler.is_compiling() or in_transform() or x.is_inference()
                or torch.is_autocast_enabled(x.device.type) or _saved_tensors_hooks_on()):
            return None
        parts = self._parts()
        if self._unsupported(parts):  # (the parts exist once this passed)
            return None
        norm1, attn, qkv, proj, dpa, norm2, mlp, fc1, fc2 = parts
        am, dm = attn._modules, dpa._modules
        modules = (norm1, attn, qkv, am["q_layernorm"], am["k_layernorm"], dpa, dm["scale_mask_softmax"],
                   dm["attention_dropout"], proj, norm2, mlp, fc1, fc2)
        if any(not m.training or _has_own_hooks(m) for m in modules) or _global_module_hooks():
            return None  # a submodule in evaluation (its dropout is off), or hooks the path would not run
        deterministic = self.config.deterministic_mode
        if (deterministic is not True and deterministic is not False) or not self._parameters_fit(x, parts):
            return None
        softmax, function = dm["scale_mask_softmax"], None
        try:  # checked as the module path's attention checks them: it raises where they fail
            p = dm["attention_dropout"].p
            backend = self.config.attention_backend
            if backend in SDPA_BACKENDS:  # the module path's call: is_causal with its scale, the module's own p
                scale, coeff = dpa.kernel_scale(), 1.0
                if not (type(scale) is float and sdpa_is_causal_call(True, x.shape[0], x.shape[0], scale)):
                    return None  # (the module path passes an explicit mask)
            else:  # fusedlib's kernels: the dropout as they check it
                p = 0.0 if (type(p) is float and p == 0.0) else _check_dropout_p(p)
                if backend in FLASH_BACKENDS:
                    scale, coeff = _check_scale(dpa.kernel_scale(), dpa.hidden_size_per_attention_head), 1.0
                else:  # the Function the module path's softmax would run; scores = softmax_scale · q·kᵀ
                    function = dpa.softmax_function(p)
                    if function is None:
                        return None
                    softmax.check_input_dtype(x)  # the scores' dtype: a ValueError where the module path raises it
                    check_bool("attention_softmax_in_fp32", self.config.attention_softmax_in_fp32)  # as the kernel's op
                    scale, coeff = dpa.softmax_scale, _softmax_check_scale(softmax.scale)
        except (TypeError, ValueError, AttributeError):
            return None
        n1, qp, pp, n2, f1, f2 = (norm1._parameters, qkv._parameters, proj._parameters, norm2._parameters,
                                  fc1._parameters, fc2._parameters)
        return (n1["weight"], n1.get("bias"), qp["weight"], qp.get("bias"), pp["weight"], pp.get("bias"),
                n2["weight"], n2.get("bias"), f1["weight"], f1["bias"], f2["weight"], f2.get("bias"),
                dpa.num_attention_heads_per_partition, type(norm1) is FusedRMSNorm, norm1.zero_centered_gamma,
                norm1.eps, norm2.zero_centered_gamma, norm2.eps, scale, self.hidden_dropout, p, deterministic,
                function, coeff, backend in SDPA_BACKENDS)

    def _parameters_fit(self, x: torch.Tensor, parts: tuple) -> bool:
        """The parameters the path reads: tensors of x's dtype (float16, bfloat16 or float32) and
        device with the layer's shapes ([3h, h] and [3h] for the QKV, [h, h] and [h] the
        projection, [ffn, h] and [ffn] fc1, [h, ffn] and [h] fc2, [h] the norms; the optional
        biases may be None, the norms' as their kind says). ``parts``: :meth:`_parts`."""
        dtype, device = x.dtype, x.device
        if dtype not in _DTYPES:
            return False
        h = x.shape[-1]
        norm1, _, qkv, proj, _, norm2, _, fc1, fc2 = parts
        w1 = fc1._parameters.get("weight")
        if w1 is None:
            return False
        ffn = w1.shape[0]
        rms = type(norm1) is FusedRMSNorm
        for module, wshape, bshape, optional in ((norm1, (h,), (h,), rms), (qkv, (3 * h, h), (3 * h,), True),
                                                 (proj, (h, h), (h,), True), (norm2, (h,), (h,), rms),
                                                 (fc1, (ffn, h), (ffn,), False), (fc2, (h, ffn), (h,), True)):
            params = module._parameters
            w, b = params.get("weight"), params.get("bias")
            if w is None or w.dtype != dtype or w.shape != wshape or w.device != device:
                return False
            if b is None:
                if not optional:
                    return False
            elif b.dtype != dtype or b.shape != bshape or b.device != device:
                return False
        return (norm1._parameters.get("bias") is None) == rms and (norm2._parameters.get("bias") is None) == rms

    def fused_path_applies(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                           context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                           rotary_pos_emb: Optional[torch.Tensor] = None,
                           attention_bias: Optional[torch.Tensor] = None) -> bool:
        """Whether a call with these arguments runs as one node (else as :class:`TransformerLayer`);
        see the module docstring for the conditions."""
        return self._plan(hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                          attention_bias) is not None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, attention_bias: Optional[torch.Tensor] = None,
                inference_context: object = None, packed_seq_params: object = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output [s, b, h], context)``: one node where :meth:`fused_path_applies`, else
        :class:`TransformerLayer`'s forward."""
        plan = None
        if inference_context is None and packed_seq_params is None:
            check_hidden_states("FusedTransformerLayer", hidden_states, self.config.hidden_size)
            plan = self._plan(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias)
        if plan is None:
            return super().forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                                   attention_bias, inference_context, packed_seq_params)
        return FusedTransformerLayerFunction.apply(hidden_states, *plan), context


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSED_NORMS = (FusedLayerNorm, FusedRMSNorm)


def _saved_tensors_hooks_on() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are active (activation checkpointing,
    offloading): the one-node path keeps its activations outside autograd's saved tensors, where
    such hooks cannot reach them, so it steps aside for them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None
