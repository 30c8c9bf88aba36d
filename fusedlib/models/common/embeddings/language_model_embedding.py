"""``LanguageModelEmbedding``: token embedding (+ learned positions), [b, s] ids -> [s, b, h].

Left out: token-type embeddings (``num_tokentypes`` must be 0), sequence parallelism's scatter,
tensor parallelism.

Source: Megatron-LM ``megatron/core/models/common/embeddings/language_model_embedding.py``.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from ....parallel.layers import VocabParallelEmbedding
from ....transformer.module import MegatronModule
from ....transformer.transformer_config import TransformerConfig
from ....transformer.utils import param_device

__all__ = ["LanguageModelEmbedding"]


class LanguageModelEmbedding(MegatronModule):
    """word_embeddings(ids) + position_embeddings(positions), transposed to [s, b, h], then dropout.

    Args:
        config: reads hidden_size, embedding_init_method, perform_initialization, params_dtype,
            hidden_dropout (the embedding dropout), fp32_residual_connection (cast the output
            to fp32, so the residual stream is fp32).
        vocab_size: V; max_sequence_length: rows of the position table.
        position_embedding_type: "learned_absolute" (a position table), "rope" or "none" (no table).
        num_tokentypes: must be 0.
        scatter_to_sequence_parallel, tp_group: accepted for Megatron-core's signature (one rank).

    ``forward(input_ids, position_ids, tokentype_ids=None)``: input_ids [b, s] int; position_ids
    [b, s] or [1, s] int (None: 0..s-1). Returns [s, b, h] in params dtype (fp32 with
    fp32_residual_connection).

    Raises:
        NotImplementedError: num_tokentypes > 0 or tokentype_ids given.
        ValueError: an unknown position_embedding_type.

    Source: Megatron-LM ``megatron/core/models/common/embeddings/language_model_embedding.py``.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
                 num_tokentypes: int = 0, scatter_to_sequence_parallel: bool = True,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__(config=config)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"position_embedding_type must be 'learned_absolute', 'rope' or 'none', "
                             f"got {position_embedding_type!r}")
        if num_tokentypes:
            raise NotImplementedError("LanguageModelEmbedding: token-type embeddings are left out of fusedlib")
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = 0
        # [Module 1: word embeddings] [V, h]
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size,
                                                      init_method=config.embedding_init_method, config=config,
                                                      tp_group=tp_group)
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
        embeddings = self.word_embeddings(input_ids)  # [b, s] -> [b, s, h]
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device, dtype=torch.long)
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        return self.embedding_dropout(embeddings)
