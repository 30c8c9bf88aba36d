"""``GPTModel``: embedding, transformer block, output layer, and the per-token loss.

    input_ids [b, s] -> embedding [s, b, h] -> TransformerBlock [s, b, h] -> output_layer
    logits [s, b, V] -> cross entropy against labels [b, s] -> loss [b, s] (float32; float64 for float64 logits)

Positions: ``"learned_absolute"`` adds a learned table to the token embeddings; ``"rope"`` rotates
queries and keys in every attention (``RotaryEmbedding`` makes the angles once per forward,
``config.apply_rope_fusion`` picks the kernel); ``"none"`` uses neither. The loss is fusedlib's
vocab-parallel cross entropy, fused (``config.cross_entropy_loss_fusion``) or not (on one rank
both are one Triton kernel; they differ in the all-reduces they would issue across ranks).
With ``share_embeddings_and_output_weights`` the output layer has no weight of its own and
uses the word embeddings'.

Tensor parallelism (``config.tensor_model_parallel_size = p > 1``, after
:func:`fusedlib.parallel.initialize_model_parallel`): the word embeddings are vocab-parallel,
every layer splits its heads and MLP features over the ranks, and the output layer is
column-parallel *without* a gather: each rank computes the logits of its V/p vocabulary ids,
[s, b, V/p], and the vocab-parallel cross entropy (fused: 2 all-reduces of [s·b] statistics;
unfused: 3) turns them into the loss without ever assembling the [s, b, V] logits. Every rank
returns the same loss. Under sequence parallelism the block runs on s/p tokens per rank and
the output layer gathers the sequence. After ``loss.backward()`` call
:func:`fusedlib.parallel.finalize_model_grads` (it sums the gradients of the parameters that
saw only this rank's tokens or heads) before the optimizer step. With the same seed on every
rank, a model of any p holds the shards of the one-rank model (``fusedlib.parallel.layers``).

Left out: pipeline stages, multi-token prediction, inference (KV caches, logits of the last
token only), YaRN/multimodal RoPE, the loss mask (apply it to the returned per-token loss).

Source: Megatron-LM ``megatron/core/models/gpt/gpt_model.py`` and
``megatron/core/models/common/language_module/language_module.py`` (``compute_language_model_loss``).
"""
from __future__ import annotations

import numbers
from typing import Literal, Optional, Union

import torch

from ...checks import check_bools, check_tensor
from ...fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from ...parallel.cross_entropy import TARGET_DTYPES, vocab_parallel_cross_entropy
from ...parallel.layers import ColumnParallelLinear
from ...parallel.utils import SINGLE_RANK
from ...transformer.enums import ModelType
from ...transformer.module import MegatronModule
from ...transformer.spec_utils import ModuleSpec
from ...transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from ...transformer.transformer_config import TransformerConfig
from ..common.embeddings.language_model_embedding import LanguageModelEmbedding

__all__ = ["GPTModel"]



def _check_labels(labels: object, logits: torch.Tensor) -> None:
    """labels [b, s] against the logits [s, b, V]: named as the user passed them (the cross
    entropy would report its own transposed ``target [s, b]``)."""
    check_tensor("labels", labels, dtypes=TARGET_DTYPES)
    s, b = logits.shape[0], logits.shape[1]
    if tuple(labels.shape) != (b, s):
        hint = " (transposed? labels are [b, s], as input_ids)" if tuple(labels.shape) == (s, b) else ""
        raise ValueError(f"labels must have shape [b, s] = [{b}, {s}] (input_ids' shape), got "
                         f"{list(labels.shape)}{hint}")
    if labels.device != logits.device:
        raise ValueError(f"labels must be on the model's device {logits.device}, got {labels.device}")


def _rotary_embedding_class() -> type:
    from ..common.embeddings.rotary_pos_embedding import RotaryEmbedding  # on first use: no import cycle

    return RotaryEmbedding


class GPTModel(MegatronModule):
    """A GPT language model: token ids [b, s] -> logits [b, s, V], or with labels the loss [b, s].

    Args:
        config: the TransformerConfig (also reads cross_entropy_loss_fusion at each forward).
        transformer_layer_spec: a layer spec (repeated config.num_layers times) or a block spec.
        vocab_size: V.
        max_sequence_length: rows of the learned position table.
        pre_process, post_process: must be True (pipeline stages left out).
        fp16_lm_cross_entropy: accepted, no effect (the loss is float32 for 16-bit logits).
        parallel_output: keep logits split across tensor-parallel ranks, [b, s, V/p] (False:
            gather them, [b, s, V]; one rank: no effect). The loss always uses the split logits.
        share_embeddings_and_output_weights: tie the output layer to the word embeddings.
        position_embedding_type: "learned_absolute", "rope" or "none".
        rotary_percent, rotary_base, seq_len_interpolation_factor, rope_scaling, rope_scaling_factor:
            RoPE's (rot_dim = hn·rotary_percent; Llama 3's frequency scaling), passed to RotaryEmbedding.
        scatter_embedding_sequence_parallel: under sequence parallelism, the embedding hands the
            block this rank's s/p tokens (Megatron-core's default True; False is not supported
            here: the block expects the split sequence).
        mtp_block_spec, pg_collection, vp_stage: must stay at their defaults.

    ``forward(input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
    runtime_gather_output=None)``: input_ids, position_ids [b, s] int (position_ids None: 0..s-1;
    with "rope" or "none" it is checked but not read, as in Megatron-core: RoPE rotates by the
    positions 0..s-1);
    attention_mask bool [b or 1, 1, s, s] True = masked, or None (the layer spec's attention is
    causal anyway); decoder_input [s, b, h] ([s/p, b, h] under sequence parallelism) replaces the
    embedding. Returns logits [b, s, V] ([b, s, V/p] with p > 1 and parallel_output) without
    labels, else the per-token loss [b, s] (float32; float64 for float64 logits; a label of -100,
    the cross entropy's ignore_index, gives loss 0), the same on every tensor-parallel rank.

    Raises:
        NotImplementedError: a left-out feature asked for, or scatter_embedding_sequence_parallel
            False under sequence parallelism.
        TypeError: vocab_size or max_sequence_length not an int; an on/off argument (pre_process,
            post_process, fp16_lm_cross_entropy, parallel_output, share_embeddings_and_output_weights,
            rope_scaling, scatter_embedding_sequence_parallel) not a bool; kv_channels, with RoPE,
            as :class:`~fusedlib.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding` refuses
            it (an odd rotary dim: ValueError).
        ValueError: vocab_size or max_sequence_length < 1; an unknown position_embedding_type;
            input_ids longer than max_sequence_length
            (learned positions); decoder_input not [s, b, h] for input_ids [b, s] (under sequence
            parallelism [s/p, b, h]); labels not of input_ids' shape [b, s]; label ids outside
            [0, V) other than -100 (the cross entropy); V, heads or widths not divisible by p (the layers).
        TypeError: labels not an int64/int32 tensor; extra_block_kwargs not a dict (or None).
        ValueError: labels on another device than the model.
        RuntimeError: p > 1 before :func:`fusedlib.parallel.initialize_model_parallel`.

    Source: Megatron-LM ``megatron/core/models/gpt/gpt_model.py`` (``GPTModel``).
    """

    def __init__(self, config: TransformerConfig, transformer_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
                 vocab_size: int, max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True,
                 seq_len_interpolation_factor: Optional[float] = None, mtp_block_spec: Optional[ModuleSpec] = None,
                 pg_collection: object = None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config)
        (pre_process, post_process, fp16_lm_cross_entropy, parallel_output, share_embeddings_and_output_weights,
         rope_scaling, scatter_embedding_sequence_parallel) = check_bools(
            "GPTModel", pre_process=pre_process, post_process=post_process,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy, parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights, rope_scaling=rope_scaling,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel)
        if (not pre_process or not post_process or mtp_block_spec is not None
                or pg_collection is not None or vp_stage is not None):
            raise NotImplementedError("GPTModel: pipeline stages (pre_process/post_process False), multi-token "
                                      "prediction, pg_collection and vp_stage are left out of fusedlib")
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"position_embedding_type must be 'learned_absolute', 'rope' or 'none', "
                             f"got {position_embedding_type!r}")
        for name, v in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"GPTModel: {name} must be an int >= 1, got {type(v).__name__} {v!r}")
            if v < 1:
                raise ValueError(f"GPTModel: {name} must be an int >= 1, got {v}")
        vocab_size, max_sequence_length = int(vocab_size), int(max_sequence_length)
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder

        # [Module 1: embedding]
        if config.sequence_parallel and config.tensor_model_parallel_size > 1 \
                and not scatter_embedding_sequence_parallel:
            raise NotImplementedError("GPTModel: scatter_embedding_sequence_parallel=False with sequence parallelism "
                                      "is left out of fusedlib (the block expects this rank's s/p tokens)")
        self.embedding = LanguageModelEmbedding(config=config, vocab_size=vocab_size,
                                                max_sequence_length=max_sequence_length,
                                                position_embedding_type=position_embedding_type,
                                                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel)
        # [Module 2: rotary angles] (no parameters)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = _rotary_embedding_class()(
                kv_channels=config.kv_channels, rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        # [Module 3: decoder]
        self.decoder = TransformerBlock(config=config, spec=transformer_layer_spec)
        # [Module 4: output layer] h -> V, no bias; no weight of its own when tied
        self.output_layer = ColumnParallelLinear(config.hidden_size, vocab_size, config=config,
                                                 init_method=config.init_method, bias=False, skip_bias_add=False,
                                                 gather_output=not parallel_output,
                                                 skip_weight_param_allocation=share_embeddings_and_output_weights)
        # the cross entropy's group: the tensor-parallel one when the logits are split, else a
        # one-rank stand-in (never the default group, which may hold data-parallel ranks)
        split_logits = self.output_layer.tp_world_size > 1
        self._loss_group = self.output_layer.tp_group if split_logits else SINGLE_RANK
        # under sequence parallelism the block sees s/p positions; RoPE needs angles for all s
        self._rotary_seq_len_factor = self.output_layer.tp_world_size if config.sequence_parallel else 1

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight [V, h], which the tied output layer uses."""
        return self.embedding.word_embeddings.weight

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy: labels [b, s], logits [s, b, V] ([s, b, V/p], split over the
        tensor-parallel ranks) -> loss [b, s], float32 (float64 for float64 logits).

        Raises:
            TypeError: labels not an int64/int32 tensor.
            ValueError: labels not of shape [b, s] (input_ids' shape: the logits' [s, b] transposed)
                or not on the logits' device.

        Source: Megatron-LM ``language_module.py`` (``compute_language_model_loss``).
        """
        if not (isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[0] == logits.shape[1]
                and labels.shape[1] == logits.shape[0] and labels.dtype in TARGET_DTYPES
                and labels.device == logits.device):
            _check_labels(labels, logits)
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
        if self.config.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(logits, labels, self._loss_group)
        else:
            loss = vocab_parallel_cross_entropy(logits, labels, 0.0, self._loss_group)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

    def _check_decoder_input(self, x: object, input_ids: object) -> None:
        """decoder_input [s, b, h] ([s/p, b, h] under sequence parallelism) against input_ids [b, s]
        (a [b, s, h] tensor would otherwise be read as s = b: logits of the wrong shape, no error)."""
        check_tensor("decoder_input", x, ndim=3)
        h, p = self.config.hidden_size, self._rotary_seq_len_factor
        want = [None, None, h]
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            b, s = input_ids.shape
            want[:2] = [s // p if s % p == 0 else None, b]
        if x.shape[2] != h or any(w is not None and w != n for w, n in zip(want[:2], x.shape[:2])):
            where = "[s/p, b, h]" if p > 1 else "[s, b, h]"
            hint = " (transposed? decoder_input is [s, b, h])" if (
                isinstance(input_ids, torch.Tensor) and tuple(x.shape[:2]) == tuple(input_ids.shape)) else ""
            raise ValueError(f"decoder_input must be {where} = {['?' if w is None else w for w in want]} "
                             f"(input_ids [b, s] and hidden_size), got shape {list(x.shape)}{hint}")

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], decoder_input: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, inference_context: object = None,
                packed_seq_params: object = None, extra_block_kwargs: Optional[dict] = None,
                runtime_gather_output: Optional[bool] = None) -> torch.Tensor:
        """Logits [b, s, V], or with labels the loss [b, s] (see the class docstring)."""
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("GPTModel: inference_context and packed_seq_params are left out of fusedlib")
        if decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        else:
            self._check_decoder_input(decoder_input, input_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_seq_len = decoder_input.size(0) * self._rotary_seq_len_factor  # s (s/p·p under SP)
            rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len).to(decoder_input.device)  # [s, 1, 1, rot]
        if extra_block_kwargs is not None and not isinstance(extra_block_kwargs, dict):
            raise TypeError(f"extra_block_kwargs must be a dict of the block's keyword arguments or None, got "
                            f"{type(extra_block_kwargs).__name__}")
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=rotary_pos_emb, **(extra_block_kwargs or {}))
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is None:
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)  # [s, b, V or V/p]
            return logits.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V]
        logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                      runtime_gather_output=False)  # [s, b, V/p]: the loss takes split logits
        return self.compute_language_model_loss(labels, logits)
