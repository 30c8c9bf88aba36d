"""Plain-PyTorch RoPE, used only where ``fusedlib.models.common.embeddings`` has no RoPE modules.

The attention and the GPT model call ``rope_utils.apply_rotary_pos_emb`` and
``rotary_pos_embedding.RotaryEmbedding`` (with the fused Triton kernel behind
``config.apply_rope_fusion``); where those modules are absent they fall back to these
unfused formulas, which are Megatron-core's.

Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
(``_rotate_half``, ``_apply_rotary_pos_emb_bshd``) and ``rotary_pos_embedding.py``
(``RotaryEmbedding``); Su et al., "RoFormer" (arXiv:2104.09864).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["apply_rotary_pos_emb", "RotaryEmbedding"]


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # [..., d/2, 2] -> [..., d]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config) -> torch.Tensor:
    """t·cos(freqs) + rotate_half(t)·sin(freqs) on the first rot_dim = freqs.shape[-1] channels.

    Args:
        t: [s, b, np, hn]; freqs: [s, 1, 1, rot_dim] or [s, b, 1, rot_dim] (float32 angles);
        config: reads ``rotary_interleaved`` (``apply_rope_fusion`` has no kernel to choose here).

    Returns:
        A new tensor like t.
    """
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t_rot = t_rot * cos_ + _rotate_half(t_rot, config.rotary_interleaved) * sin_
    return torch.cat((t_rot, t_pass), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """The RoPE angles: ``forward(max_seq_len, offset=0)`` -> freqs [s, 1, 1, rot_dim], float32.

    rot_dim = kv_channels·rotary_percent (even); angle of position p, pair i: p·base^(-2i/rot_dim).
    ``inv_freq`` is a plain attribute, not state (as in Megatron-core).
    """

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                 use_cpu_initialization: bool = False) -> None:
        super().__init__()
        if rope_scaling:
            raise NotImplementedError("rope_scaling needs fusedlib.models.common.embeddings.RotaryEmbedding")
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, dtype=torch.float32, device="cpu") + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, self.inv_freq)  # [s, rot_dim/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, rot_dim]: f0..f_{d/2-1}, f0..
        else:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [s, rot_dim]: f0, f0, f1, f1, ...
        return emb[:, None, None, :]  # [s, 1, 1, rot_dim]
