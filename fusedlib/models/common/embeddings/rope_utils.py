"""Applying rotary position embeddings, fused or not: Megatron-core's ``rope_utils``.

:func:`apply_rotary_pos_emb` is the one entry point attention calls: with
``config.apply_rope_fusion`` it runs fusedlib's Triton kernel
(:func:`fusedlib.fusions.fused_rope.fused_apply_rotary_pos_emb`, one read of t and one
write), otherwise Megatron's unfused PyTorch formula (:func:`_apply_rotary_pos_emb_bshd`,
about ten elementwise kernels). Both take t [s, b, np, d] and freqs [s, 1, 1, rot_dim]
or [s, b, 1, rot_dim] and give the same values (the fused one computed in float32 and
rounded once).

Not here (Megatron-core has them): packed sequences (``cu_seqlens``, the thd format) and
context parallelism; multi-latent attention runs on the unfused path only.

Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ....checks import FLOAT32_MAX, check_bool
from ....fusions.fused_rope import (_check_mscale, check_rope_inputs, first_positions,
                                     fused_apply_rotary_pos_emb)
from ....unfused import apply_rotary_pos_emb_bshd as _apply_rotary_pos_emb_bshd
from ....unfused import rotate_half as _rotate_half

__all__ = [
    "apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb",
    "_apply_rotary_pos_emb_bshd",
    "_rotate_half",
]


def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    config: Any,
    cu_seqlens: Optional[Tensor] = None,
    mscale: float = 1.0,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tensor:
    """Apply RoPE to ``t``, fused or unfused as ``config.apply_rope_fusion`` says.

    Args:
        t: [s, b, np, d] (queries or keys), float32 / float16 / bfloat16 (float64 too).
        freqs: angles in radians, [s2, 1, 1, rot_dim] (``RotaryEmbedding.forward``) or
            [s2, b, 1, rot_dim] (per-sample positions), float32, with s2 >= s (positions
            0 .. s-1 are read, on both paths, as Transformer Engine's fused function reads them)
            or s2 = 1; rot_dim even, <= d.
        config: a ``TransformerConfig`` (or any object) with ``apply_rope_fusion`` (bool:
            the Triton kernel, else Megatron's unfused formula) and ``rotary_interleaved``
            (bool: pairs (2k, 2k+1), else (k, k + rot_dim/2)); ``multi_latent_attention``
            is read if present (default False).
        cu_seqlens: packed-sequence boundaries (thd format): not supported, must be None.
        mscale: scale of cos and sin (1.0 = plain RoPE). Megatron's fused path cannot take
            it and falls back to the unfused one with a warning; fusedlib's kernel applies it.
        cp_group: context-parallel group: unused in the sbhd format (as in Megatron).

    Returns:
        A new [s, b, np, d] tensor of t's dtype.

    Raises:
        TypeError: ``config`` lacks ``apply_rope_fusion`` or ``rotary_interleaved``, or one of
            them (or ``multi_latent_attention``) is not a bool (numpy's bool is accepted).
        NotImplementedError: ``cu_seqlens`` given (packed sequences), or
            ``multi_latent_attention`` with ``apply_rope_fusion``.
        TypeError, ValueError: bad tensors, on either path
            (:func:`~fusedlib.fusions.fused_rope.check_rope_inputs`); mscale not a real number
            (TypeError) or not finite in float32 (ValueError), on either path; an odd rot_dim,
            or one outside [2, d], on either path (ValueError).

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
    (``apply_rotary_pos_emb``).
    """
    missing = [name for name in ("apply_rope_fusion", "rotary_interleaved") if not hasattr(config, name)]
    if missing:
        raise TypeError(f"config must have {' and '.join(missing)} (a TransformerConfig), got {type(config).__name__}")
    if cu_seqlens is not None:
        raise NotImplementedError(
            "cu_seqlens (packed sequences, the thd format) is not supported by fusedlib's RoPE: "
            "pass t as [s, b, np, d] with cu_seqlens=None"
        )
    if not (type(mscale) is float and -FLOAT32_MAX <= mscale <= FLOAT32_MAX):  # the happy case; NaN fails too
        mscale = _check_mscale(mscale)  # both paths: the unfused formula took None, nan or a str as well
    # the switches as bools, on both paths: a str "False" was read as True (the fused path
    # refused it for rotary_interleaved; the unfused one rotated interleaved pairs)
    fusion, interleaved = config.apply_rope_fusion, config.rotary_interleaved
    mla = getattr(config, "multi_latent_attention", False)
    if not all(v is True or v is False for v in (fusion, interleaved, mla)):
        fusion = check_bool("config.apply_rope_fusion", fusion)
        interleaved = check_bool("config.rotary_interleaved", interleaved)
        mla = check_bool("config.multi_latent_attention", mla)
    if fusion:
        if mla:
            raise NotImplementedError(
                "apply_rope_fusion with multi_latent_attention is not supported by fusedlib's RoPE kernel: "
                "set apply_rope_fusion=False"
            )
        return fused_apply_rotary_pos_emb(t, freqs, interleaved=interleaved, mscale=mscale)
    # the fused path's checks on the unfused one too, multi_latent_attention's included (it broadcast
    # wrong shapes, took int angles; an int t came back as zeros: cos and sin cast to its dtype)
    check_rope_inputs(t, freqs)
    return _apply_rotary_pos_emb_bshd(
        t, first_positions(t, freqs), rotary_interleaved=interleaved, multi_latent_attention=mla, mscale=mscale
    )
