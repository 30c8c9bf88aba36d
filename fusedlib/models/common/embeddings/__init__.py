"""Position embeddings (Megatron-core's ``models/common/embeddings``): rotary embeddings and
the function that applies them, fused or unfused."""
from .rope_utils import apply_rotary_pos_emb
from .rotary_pos_embedding import RotaryEmbedding

__all__ = ["apply_rotary_pos_emb", "RotaryEmbedding"]
