"""``LanguageModelEmbedding``: token embedding (+ learned positions), [b, s] ids -> [s, b, h].

Tensor parallelism (p > 1): the word embeddings are vocab-parallel (an all-reduce sums the
ranks' rows); the position table is replicated. Under sequence parallelism the output is this
rank's s/p tokens, [s/p, b, h]: without a position table the word embeddings reduce-scatter it
directly (one collective, Megatron's ``reduce_scatter_embeddings``); with one, the summed
embeddings are split along the sequence (``scatter_to_sequence_parallel_region``). The dropout
then draws from the tracker's model-parallel state (each rank's own tokens, its own mask).

Left out: token-type embeddings (``num_tokentypes`` must be 0).

Source: Megatron-LM ``megatron/core/models/common/embeddings/language_model_embedding.py``.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from ....checks import check_bools, check_ids_below_on_cpu
from ....parallel.layers import VocabParallelEmbedding
from ....parallel.mappings import scatter_to_sequence_parallel_region
from ....parallel.random import get_cuda_rng_tracker
from ....transformer.module import MegatronModule
from ....transformer.transformer_config import TransformerConfig
from ....transformer.utils import param_device

__all__ = ["LanguageModelEmbedding"]


def _check_ids(name: str, ids: object, like: Optional[torch.Size], bound: Optional[int], bound_name: str,
               device: torch.device) -> None:
    """Token ids [b, s] (``like`` None) or positions [b or 1, s] (``like`` = the ids' shape):
    int32 / int64, on ``device`` (the table's: a lookup of meta ids in a CPU table returns
    uninitialized memory); on the CPU also in [0, bound) (a host check there costs no sync; on
    CUDA the table lookup's own check applies), unless ``bound`` is None (ids not read)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an int64 tensor [b, s], got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"{name} must be on the embedding tables' device {device}, got {ids.device}")
    if like is None:
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"{name} must be [b, s] with b, s >= 1, got shape {list(ids.shape)}")
    elif ids.dim() != 2 or ids.shape[1] != like[1] or ids.shape[0] not in (1, like[0]):
        raise ValueError(f"{name} must be [b or 1, s] = [{like[0]} or 1, {like[1]}] (input_ids' shape), got shape "
                         f"{list(ids.shape)}")
    if bound is not None:
        check_ids_below_on_cpu(name, ids, bound, bound_name)


class LanguageModelEmbedding(MegatronModule):
    """word_embeddings(ids) + position_embeddings(positions) as [s, b, h], then dropout.

    Args:
        config: reads hidden_size, embedding_init_method, perform_initialization, params_dtype,
            hidden_dropout (the embedding dropout), fp32_residual_connection (cast the output
            to fp32, so the residual stream is fp32).
        vocab_size: V; max_sequence_length: rows of the position table.
        position_embedding_type: "learned_absolute" (a position table), "rope" or "none" (no table).
        num_tokentypes: must be 0.
        scatter_to_sequence_parallel: under sequence parallelism (p > 1), return this rank's s/p
            tokens (False: the whole sequence).
        tp_group: the tensor-parallel group (None: parallel_state's when p > 1).

    ``forward(input_ids, position_ids, tokentype_ids=None)``: input_ids [b, s] int; position_ids
    [b, s] or [1, s] int (None: 0..s-1); with "rope" or "none" position_ids is checked (dtype,
    shape, device) but not read, as in Megatron-core. Returns [s, b, h] ([s/p, b, h] under sequence
    parallelism) in params dtype (fp32 with fp32_residual_connection).

    Raises:
        NotImplementedError: num_tokentypes > 0 or tokentype_ids given.
        ValueError: an unknown position_embedding_type; input_ids longer than
            max_sequence_length (learned positions, position_ids None); input_ids not a 2-D
            [b, s] tensor (b, s >= 1), position_ids not [b or 1, s]; on the CPU, an id outside
            [0, vocab_size) or a position outside [0, max_sequence_length); input_ids or
            position_ids on another device than the embedding tables.
        TypeError: input_ids or position_ids not int32 / int64; scatter_to_sequence_parallel not
            a bool.

    Source: Megatron-LM ``megatron/core/models/common/embeddings/language_model_embedding.py``.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
                 num_tokentypes: int = 0, scatter_to_sequence_parallel: bool = True,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__(config=config)
        (scatter_to_sequence_parallel,) = check_bools("LanguageModelEmbedding",
                                                      scatter_to_sequence_parallel=scatter_to_sequence_parallel)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"position_embedding_type must be 'learned_absolute', 'rope' or 'none', "
                             f"got {position_embedding_type!r}")
        if num_tokentypes:
            raise NotImplementedError("LanguageModelEmbedding: token-type embeddings are left out of fusedlib")
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = 0
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        # under sequence parallelism without a position table the word embeddings reduce-scatter
        reduce_scatter = not self.add_position_embedding and config.sequence_parallel and scatter_to_sequence_parallel
        # [Module 1: word embeddings] [V, h] ([V/p, h] on each of p ranks)
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size,
                                                      init_method=config.embedding_init_method,
                                                      reduce_scatter_embeddings=reduce_scatter, config=config,
                                                      tp_group=tp_group)
        self.tp_group = self.word_embeddings.tp_group
        self.reduce_scatter_embeddings = self.word_embeddings.reduce_scatter_embeddings  # (False on one rank)
        # p > 1 and sequence parallelism: split the sequence, dropout on the tracker's state
        self._sequence_parallel = config.sequence_parallel and self.word_embeddings.tp_world_size > 1
        # [Module 2: position embeddings] [max_sequence_length, h]
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          device=param_device(config), dtype=config.params_dtype)
            if config.perform_initialization:
                with torch.no_grad():
                    config.embedding_init_method(self.position_embeddings.weight)
        self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Embeddings [s, b, h] (see the class docstring)."""
        if tokentype_ids is not None:
            raise NotImplementedError("LanguageModelEmbedding: tokentype_ids are left out of fusedlib")
        _check_ids("input_ids", input_ids, None, self.vocab_size, "vocab_size", self.word_embeddings.weight.device)
        if position_ids is not None and self.add_position_embedding:
            _check_ids("position_ids", position_ids, input_ids.shape, self.max_sequence_length, "max_sequence_length",
                       self.position_embeddings.weight.device)
        elif position_ids is not None:  # "rope" / "none": not read, but a wrong argument is still refused
            _check_ids("position_ids", position_ids, input_ids.shape, None, "", self.word_embeddings.weight.device)
        if self.reduce_scatter_embeddings:  # (no position table) [b, s] -> [s/p, b, h], transposed inside
            embeddings = self.word_embeddings(input_ids)
        else:
            # the ids transposed ([s, b], a copy of b·s integers), so the lookup writes [s, b, h]
            # directly: Megatron-core looks up [b, s, h] and copies it transposed, which costs a
            # read and a write of the activations, and their gradient's transpose again in the
            # backward. The same rows in the same places.
            embeddings = self.word_embeddings(input_ids.t().contiguous())  # [s, b, h]
        if self.add_position_embedding:
            if position_ids is None:
                if input_ids.size(1) > self.max_sequence_length:  # (else an IndexError from the table)
                    raise ValueError(f"input_ids has {input_ids.size(1)} positions, more than max_sequence_length "
                                     f"{self.max_sequence_length} (the position table's rows)")
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device, dtype=torch.long)[None]
            # [b or 1, s] -> [s, b or 1, h], broadcast over the batch
            embeddings = embeddings + self.position_embeddings(position_ids.t())
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if not self._sequence_parallel:
            return self.embedding_dropout(embeddings)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            # [s, b, h] -> [s/p, b, h] (a copy: the full tensor can be freed)
            embeddings = scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
        if not (self.training and self.embedding_dropout.p > 0):
            return embeddings  # no random numbers drawn: no tracker needed
        with get_cuda_rng_tracker().fork():  # this rank's tokens: this rank's mask
            return self.embedding_dropout(embeddings)
