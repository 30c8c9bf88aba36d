"""``SelfAttention`` and ``CrossAttention``: the projections around the core attention.

Self-attention, for hidden states [sq, b, h]:

1. ``linear_qkv``: one GEMM to [sq, b, ng·(np/ng + 2)·hn], laid out per query group as
   Megatron-core's checkpoints are: ``[q_1 .. q_{np/ng}, k, v]`` for group 1, then group 2, ...;
   viewed as [sq, b, ng, (np/ng + 2)·hn] and split into query [sq, b, np, hn] and key, value
   [sq, b, ng, hn] (grouped-query attention: ng key/value heads, each serving np/ng queries);
2. ``q_layernorm``, ``k_layernorm`` per head (IdentityOp unless ``qk_layernorm``);
3. rotary embeddings, when ``rotary_pos_emb`` is given, through
   ``rope_utils.apply_rotary_pos_emb(t, freqs, config)`` (``config.apply_rope_fusion`` picks the
   Triton kernel or the unfused formula);
4. ``core_attention`` (checkpointed in training with ``recompute_granularity="selective"``
   and "core_attn" in ``recompute_modules``);
5. ``linear_proj`` [sq, b, np·hn] -> [sq, b, h], returning ``(output, bias)``: the bias is
   left for the layer's bias-dropout-add to fuse.

Cross-attention takes its query from the hidden states (``linear_q``) and key and value from
``key_value_states`` (``linear_kv``, [sk, b, np, 2·hn] split in two); it has no grouped-query
attention, as in Megatron-core.

Left out: inference (KV caches, flash decoding), packed sequences, context parallelism, the
output gate, QK clipping, fused QKV+RoPE, activation offloading; with tensor parallelism, fewer
key/value groups than ranks.

Tensor parallelism (``config.tensor_model_parallel_size = p``): the QKV projection is
column-parallel and the output projection row-parallel, so each rank computes whole heads,
np/p query heads and ng/p key/value groups (the QKV weight's rows are grouped per key/value
group, ``[ng, (np/ng + 2)·hn]``, so a contiguous split hands each rank whole groups), and the
only communication is the projection's all-reduce (or reduce-scatter). np and ng must be
divisible by p (a ValueError otherwise). In training with attention dropout and without
sequence parallelism, the core attention runs under the tensor-parallel RNG tracker's
model-parallel state (``get_cuda_rng_tracker().fork()``), so each rank's heads draw their own
masks, whichever backend computes them (Megatron-core forks around the dropout inside its
``DotProductAttention``).

Source: Megatron-LM ``megatron/core/transformer/attention.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ..checks import ArgumentTypeError, type_name
from ..kernels.flash_attention import PACKED_GRADS_ATTR
from ..parallel.random import checkpoint as tensor_parallel_checkpoint
from ..parallel.random import get_cuda_rng_tracker
from ..runtime import optional_function_ok
from .enums import AttnMaskType
from .identity_op import IdentityOp
from .module import MegatronModule
from .spec_utils import ModuleSpec, build_module, check_submodules
from .transformer_config import TransformerConfig
from .utils import heads_per_partition, param_device

__all__ = ["SelfAttentionSubmodules", "CrossAttentionSubmodules", "Attention", "SelfAttention", "CrossAttention"]

Spec = Union[ModuleSpec, type]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """RoPE on t [s, b, heads, hn] with angles freqs [s, 1 or b, 1, rot_dim]: fusedlib's
    ``rope_utils.apply_rotary_pos_emb`` (fused or not by ``config.apply_rope_fusion``)."""
    from ..models.common.embeddings.rope_utils import apply_rotary_pos_emb as rope  # on first use: no import cycle

    return rope(t, freqs, config)


class SplitLastDim(torch.autograd.Function):
    """``torch.split(x, sizes, dim=-1)`` whose backward takes FlashAttention's packed gradient
    buffer whole instead of concatenating the pieces' gradients.

    ``apply(x, sizes)``: x contiguous [..., sum(sizes)]; returns the pieces, views of x. The
    backward of ``torch.split`` is ``torch.cat``: a copy of the whole tensor ([s, b, 3·h] for
    the QKV projection). FlashAttention's backward writes the gradients of q, k and v of one
    packed QKV tensor into views of one fresh buffer laid out as that tensor
    (:func:`~fusedlib.kernels.flash_attention.packed_grads`, which marks the buffer). Where the
    pieces' gradients are views of such a marked buffer, each with its piece's strides and at
    its piece's offset from the others, they tile it exactly as the pieces tiled x, and the
    backward returns the buffer, as a view, as x's gradient: no copy, and no tensor a caller
    holds becomes x's gradient. Otherwise (any other backend, rotary embeddings or a query/key
    norm, which make q and k new tensors, a piece unused, GQA, or a double backward:
    ``create_graph``) it concatenates, as torch.split's backward does.

    Source: the copy it saves is ``split_with_sizes_backward``'s concatenation (PyTorch
    ``torch/csrc/autograd/FunctionsManual.cpp``); the packed layout is Megatron-core's fused
    QKV projection (``megatron/core/transformer/attention.py``).
    """

    @staticmethod
    def forward(ctx, x, sizes):
        parts = torch.split(x, sizes, dim=-1)
        base = x.storage_offset()
        ctx.layout = tuple((p.stride(), p.storage_offset() - base) for p in parts)
        ctx.shape, ctx.stride, ctx.numel = x.shape, x.stride(), x.numel()
        return parts

    @staticmethod
    def backward(ctx, *grads):
        g0 = grads[0]
        buf = g0._base
        # (a double backward needs a differentiable function of every piece's gradient: cat)
        if buf is not None and getattr(buf, PACKED_GRADS_ATTR, False) and not torch.is_grad_enabled():
            start = g0.storage_offset() - ctx.layout[0][1]
            if (start >= 0 and start + ctx.numel <= buf.numel()
                    and all(g._base is buf and g.dtype == g0.dtype and g.stride() == stride
                            and g.storage_offset() - start == off for g, (stride, off) in zip(grads, ctx.layout))):
                # the pieces' gradients tile the fresh buffer as the pieces tile x: it is x's gradient
                return g0.as_strided(ctx.shape, ctx.stride, start), None
        return torch.cat(grads, dim=-1), None


def split_last_dim(x: torch.Tensor, sizes: list) -> Tuple[torch.Tensor, ...]:
    """Split x's last dim into pieces of ``sizes`` (views), through :class:`SplitLastDim` (whose
    backward takes FlashAttention's packed gradients whole) where x needs a gradient, grad mode
    is on, x is contiguous and :func:`~fusedlib.runtime.optional_function_ok` (not under
    torch.compile, whose Inductor plans that copy itself, torch.func transforms or forward-mode
    AD); else ``torch.split``.

    Args:
        x: [..., sum(sizes)], any dtype.
        sizes: the pieces' widths.

    Returns:
        The pieces, views of x, as ``torch.split(x, sizes, dim=-1)``; their gradients flow back
        as through torch.split (a concatenation), or without a copy (see SplitLastDim).

    Raises:
        RuntimeError: sizes not summing to x's last dim (torch.split's error).
    """
    if x.requires_grad and torch.is_grad_enabled() and x.is_contiguous() and optional_function_ok():
        return SplitLastDim.apply(x, sizes)
    return torch.split(x, sizes, dim=-1)


@dataclass
class SelfAttentionSubmodules:
    """The slots of :class:`SelfAttention`. Built in Megatron-core's order (so parameters register
    in the same order): core_attention and linear_proj by :class:`Attention`, then linear_qkv,
    q_layernorm, k_layernorm.

    Source: Megatron-LM ``megatron/core/transformer/attention.py``.
    """

    linear_qkv: Spec
    core_attention: Spec
    linear_proj: Spec
    q_layernorm: Spec = IdentityOp
    k_layernorm: Spec = IdentityOp


@dataclass
class CrossAttentionSubmodules:
    """The slots of :class:`CrossAttention`. Built in Megatron-core's order: core_attention and
    linear_proj by :class:`Attention`, then linear_q, linear_kv.

    Source: Megatron-LM ``megatron/core/transformer/attention.py``.
    """

    linear_q: Spec
    linear_kv: Spec
    core_attention: Spec
    linear_proj: Spec


class Attention(MegatronModule):
    """What self- and cross-attention share: the core attention, the output projection, the forward.

    Args:
        config: reads kv_channels, num_attention_heads, num_query_groups, hidden_size,
            add_bias_linear, softmax_scale, output_layer_init_method, recompute settings.
        submodules: a SelfAttentionSubmodules or CrossAttentionSubmodules.
        layer_number: 1-based, passed to the core attention.
        attn_mask_type: passed to the core attention.
        attention_type: "self" or "cross".
        cp_comm_type, pg_collection: must be None (left out).

    ``forward(hidden_states, attention_mask, key_value_states=None, inference_context=None,
    rotary_pos_emb=None, attention_bias=None, packed_seq_params=None)``: hidden_states
    [sq, b, h]; rotary_pos_emb: freqs, or a pair (query freqs, key freqs). Returns
    ``(output [sq, b, h], bias [h] or None)``. Megatron-core's inference-only arguments
    (rotary_pos_cos/sin, sequence_len_offset) are left out.

    Raises:
        NotImplementedError: a left-out argument given.
        ValueError: num_attention_heads 0 (a norms-only config), or num_attention_heads or
            num_query_groups not divisible by config.tensor_model_parallel_size; in the forward a
            rotary_pos_emb tuple that is not a pair.
        TypeError: in the forward a rotary_pos_emb neither a tensor, a tuple nor None.

    Source: Megatron-LM ``megatron/core/transformer/attention.py`` (``Attention``).
    """

    def __init__(self, config: TransformerConfig, submodules: Union[SelfAttentionSubmodules, CrossAttentionSubmodules],
                 layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 cp_comm_type: Optional[str] = None, pg_collection: object = None) -> None:
        super().__init__(config=config)
        if cp_comm_type is not None or pg_collection is not None:
            raise NotImplementedError(f"{type(self).__name__}: cp_comm_type and pg_collection are left out of fusedlib")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # tensor parallelism: each of the p ranks holds np/p query heads and ng/p key/value groups
        self.num_attention_heads_per_partition, self.num_query_groups_per_partition = heads_per_partition(config)
        self.query_projection_size = config.kv_channels * config.num_attention_heads  # np·hn
        self.kv_projection_size = config.kv_channels * config.num_query_groups  # ng·hn
        self.hidden_size_per_attention_head = config.kv_channels  # hn
        self.world_size = config.tensor_model_parallel_size

        # [Module 1: core attention] (the subclass then builds its input projections and norms)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type=attention_type,
                                           softmax_scale=config.softmax_scale)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in config.recompute_modules)
        # tensor parallelism without sequence parallelism: this rank's heads draw their own
        # attention-dropout masks, from the tracker's model-parallel state (any core attention)
        dropout = getattr(getattr(self.core_attention, "attention_dropout", None), "p", config.attention_dropout)
        self._fork_core_attention_rng = (config.tensor_model_parallel_size > 1 and not config.sequence_parallel
                                         and dropout > 0)
        # [Module 2: output projection]
        self.linear_proj = build_module(submodules.linear_proj, self.query_projection_size, config.hidden_size,
                                        config=config, init_method=config.output_layer_init_method,
                                        bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
                                        is_expert=False, tp_comm_buffer_name="proj")

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Optional[torch.Tensor] = None
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [sq, b, np, hn], key and value [sk, b, ng, hn]."""
        raise NotImplementedError

    def _checkpointed_attention_forward(self, query, key, value, attention_mask) -> torch.Tensor:
        """The core attention under activation checkpointing: its [b, np, sq, sk] probabilities are
        recomputed in the backward instead of stored; the RNG state (and with tensor parallelism
        the tracker's, :func:`fusedlib.parallel.random.checkpoint`) is restored for the
        recompute, so the attention dropout draws the same mask."""
        return tensor_parallel_checkpoint(self.core_attention, query, key, value, attention_mask)

    def _core_attention_forward(self, query, key, value, attention_mask) -> torch.Tensor:
        """The core attention, checkpointed in training with selective recomputation of "core_attn"."""
        if self.checkpoint_core_attention and self.training:
            return self._checkpointed_attention_forward(query, key, value, attention_mask)
        return self.core_attention(query, key, value, attention_mask)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                key_value_states: Optional[torch.Tensor] = None, inference_context: object = None,
                rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: object = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output [sq, b, h], bias or None)``; see the class docstring."""
        if inference_context is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError(f"{type(self).__name__}: inference_context, attention_bias and "
                                      "packed_seq_params are left out of fusedlib")
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            if not isinstance(rotary_pos_emb, torch.Tensor):  # (a list failed at .shape, deep in RoPE)
                raise TypeError(f"{type(self).__name__}: rotary_pos_emb must be a tensor of angles, a pair "
                                f"(query angles, key angles) as a tuple, or None; got {type(rotary_pos_emb).__name__}")
            rotary_pos_emb = (rotary_pos_emb,) * 2  # the same angles for queries and keys
        elif rotary_pos_emb is not None and len(rotary_pos_emb) != 2:  # ("too many values to unpack")
            raise ValueError(f"{type(self).__name__}: rotary_pos_emb as a tuple must be a pair (query angles, key "
                             f"angles), got {len(rotary_pos_emb)} entries")

        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)

        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            if q_pos_emb is not None:
                query = apply_rotary_pos_emb(query, q_pos_emb, self.config)
            if k_pos_emb is not None:
                key = apply_rotary_pos_emb(key, k_pos_emb, self.config)

        if self._fork_core_attention_rng and self.training:
            with get_cuda_rng_tracker().fork():  # this rank's heads: this rank's dropout masks
                core_attn_out = self._core_attention_forward(query, key, value, attention_mask)
        else:
            core_attn_out = self._core_attention_forward(query, key, value, attention_mask)  # [sq, b, np/p·hn]

        output, bias = self.linear_proj(core_attn_out)  # [sq, b, h], [h] or None
        return output, bias


class SelfAttention(Attention):
    """Self-attention: input [s, b, h] -> ``(output [s, b, h], bias)``.

    Args:
        config, layer_number, cp_comm_type, pg_collection: as :class:`Attention`; also reads
            add_qkv_bias, init_method, layernorm_epsilon, params_dtype.
        submodules: :class:`SelfAttentionSubmodules`.
        attn_mask_type: default ``AttnMaskType.padding`` (the GPT specs pass causal).

    Raises:
        NotImplementedError: as :class:`Attention`.
        TypeError: submodules lacking a :class:`SelfAttentionSubmodules` field
            (:func:`~fusedlib.transformer.spec_utils.check_submodules`).
        Errors of the submodules, naming the one that failed (build_module).

    Source: Megatron-LM ``megatron/core/transformer/attention.py`` (``SelfAttention``).
    """

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection: object = None) -> None:
        check_submodules("SelfAttention", submodules, SelfAttentionSubmodules)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="self", cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        # [Module 3: QKV projection] h -> np·hn + 2·ng·hn, bias added here (skip_bias_add=False)
        self.linear_qkv = build_module(submodules.linear_qkv, config.hidden_size,
                                       self.query_projection_size + 2 * self.kv_projection_size, config=config,
                                       init_method=config.init_method, gather_output=False,
                                       bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                                       is_expert=False, tp_comm_buffer_name="qkv")
        # [Module 4, 5: query and key norms] over hn, per head
        norm_kwargs = dict(hidden_size=self.hidden_size_per_attention_head, config=config,
                           eps=config.layernorm_epsilon, device=param_device(config), dtype=config.params_dtype)
        # (None, Megatron-core's "no norm", builds an IdentityOp)
        self.q_layernorm = build_module(submodules.q_layernorm or IdentityOp, **norm_kwargs)
        self.k_layernorm = build_module(submodules.k_layernorm or IdentityOp, **norm_kwargs)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Optional[torch.Tensor] = None
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [sq, b, np, hn], key and value [sq, b, ng, hn] from one GEMM (key_value_states is unused)."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [sq, b, h] -> [sq, b, ng·(np/ng + 2)·hn]
        hn, ng = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // ng  # query heads per group
        # [sq, b, ng·(np/ng + 2)·hn] -> [sq, b, ng, (np/ng + 2)·hn]
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], ng, (per_group + 2) * hn)
        # -> [sq, b, ng, np/ng·hn], [sq, b, ng, hn], [sq, b, ng, hn] (views)
        # (split_last_dim: torch.split whose backward takes FlashAttention's packed gradients whole)
        query, key, value = split_last_dim(mixed_qkv, [per_group * hn, hn, hn])
        # [sq, b, ng, np/ng·hn] -> [sq, b, np, hn] (np given: -1 is ambiguous at sq = 0 or b = 0)
        query = query.reshape(query.size(0), query.size(1), ng * per_group, hn)
        query = self.q_layernorm(query)
        key = self.k_layernorm(key)
        return query, key, value


class CrossAttention(Attention):
    """Cross-attention: query from hidden_states [sq, b, h], key and value from key_value_states [sk, b, h].

    Args:
        as :class:`SelfAttention`, with :class:`CrossAttentionSubmodules`.

    Raises:
        ValueError: num_query_groups != num_attention_heads (Megatron-core's rule).
        TypeError: submodules lacking a :class:`CrossAttentionSubmodules` field
            (:func:`~fusedlib.transformer.spec_utils.check_submodules`).
        NotImplementedError: as :class:`Attention`.

    Source: Megatron-LM ``megatron/core/transformer/attention.py`` (``CrossAttention``).
    """

    def __init__(self, config: TransformerConfig, submodules: CrossAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection: object = None) -> None:
        check_submodules("CrossAttention", submodules, CrossAttentionSubmodules)
        if getattr(config, "num_query_groups", None) != getattr(config, "num_attention_heads", None):
            raise ValueError("Group query attention is not currently supported in cross attention.")
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="cross", cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        common = dict(config=config, init_method=config.init_method, gather_output=False,
                      bias=config.add_bias_linear, skip_bias_add=False, is_expert=False)
        # [Module 3: query projection] h -> np·hn
        self.linear_q = build_module(submodules.linear_q, config.hidden_size, self.query_projection_size, **common)
        # [Module 4: key/value projection] h -> 2·np·hn
        self.linear_kv = build_module(submodules.linear_kv, config.hidden_size, 2 * self.kv_projection_size, **common)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Optional[torch.Tensor] = None
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [sq, b, np, hn] from hidden_states; key, value [sk, b, np, hn] from key_value_states.

        Raises:
            ValueError: key_value_states is None, or not a tensor [sk, b, h] with sk >= 1, b
                hidden_states' batch and h = hidden_size (the layer's ``context``).
            TypeError: key_value_states not a tensor (an ArgumentTypeError, also a ValueError) or
                not floating point.
        """
        if key_value_states is None:
            raise ValueError("key_value_states cannot be None for CrossAttention")
        h, b = self.config.hidden_size, hidden_states.shape[1] if hidden_states.dim() == 3 else None
        kv = key_value_states
        if not isinstance(kv, torch.Tensor):  # (an ArgumentTypeError: a TypeError, and a ValueError as below)
            raise ArgumentTypeError(f"CrossAttention: key_value_states (the layer's context) must be a tensor "
                                    f"[sk, b, h], got {type_name(kv)}")
        if not (kv.dim() == 3 and kv.shape[0] > 0 and kv.shape[1] == b
                and kv.shape[2] == h):
            got = f"shape {list(kv.shape)}"
            raise ValueError(f"CrossAttention: key_value_states (the layer's context) must be a tensor [sk, b, h] "
                             f"with sk >= 1, b = hidden_states' batch ({b}) and h = hidden_size = {h}, got {got}")
        if not kv.is_floating_point():
            raise TypeError(f"CrossAttention: key_value_states (the layer's context) must be floating point, got "
                            f"{kv.dtype}")
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_kv, _ = self.linear_kv(key_value_states)  # [sk, b, h] -> [sk, b, np·2·hn]
        mixed_kv = mixed_kv.view(*mixed_kv.shape[:-1], np_, 2 * hn)  # -> [sk, b, np, 2·hn]
        key, value = torch.split(mixed_kv, hn, dim=-1)  # -> 2 x [sk, b, np, hn]
        query, _ = self.linear_q(hidden_states)  # [sq, b, h] -> [sq, b, np·hn]
        query = query.view(*query.shape[:-1], np_, hn)  # -> [sq, b, np, hn]
        return query, key, value
