"""Triton kernel for rotary position embeddings (RoPE), forward and backward.

RoPE rotates pairs of channels of each head by an angle that grows with the token's
position (Su et al. 2021). With ``t`` of shape [s, b, np, d] and ``freqs`` of shape
[s, 1 or b, 1, rot] (the angles, radians, float32; ``rot <= d``, even), the first ``rot``
channels of every head are rotated and channels ``rot .. d`` pass through unchanged.

The channels form ``rot / 2`` pairs ``(i1, i2)``: ``(k, k + rot/2)`` in the half-split
layout (GPT-NeoX, Megatron's default), ``(2k, 2k + 1)`` in the interleaved layout (GPT-J,
``rotary_interleaved``). Megatron-core computes, per channel i, with ``f = freqs[..., i]``::

    out = t * cos(f) + rotate_half(t) * sin(f)       rotate_half: (x1, x2) -> (-x2, x1)

which, written per pair with ``c_j = cos(f_ij)``, ``s_j = sin(f_ij)`` (times ``mscale``)::

    forward:   o1 = x1 * c1 - x2 * s1
               o2 = x2 * c2 + x1 * s2

The map is linear in t, so its backward is the transpose of that 2x2 matrix::

    backward:  d1 = g1 * c1 + g2 * s2
               d2 = g2 * c2 - g1 * s1

When ``f1 == f2`` (what ``RotaryEmbedding`` produces: each angle is stored twice) this is
the rotation by ``-theta``; the kernel uses the partner channel's sine as above, so it is
the exact gradient for any ``freqs`` (as Transformer Engine's fused RoPE does). One
kernel serves both passes: the ``BACKWARD`` flag only swaps which sine multiplies which
term.

Memory traffic: one read of t (or of the output's gradient) and one write of the output
(or of t's gradient) per element; ``freqs`` (4·rot bytes per position, or per token) is
read once per program, and shared by the b programs of a position through the L2 cache:
1.5 % of the bytes moved at [s, b, np, d] = [4096, 2, 32, 128] bf16. Nothing is saved for
the backward but ``freqs``.

Grid: one program per token (position s, sample b). It loads its row of ``freqs`` once,
computes ``cos`` and ``sin`` of the pair angles in float32 (as Megatron does, from the
same float32 ``freqs``), then loops over its heads ``BLOCK_H`` at a time, reusing those
values for every head, so the sines and cosines (accurate ones, with full range reduction:
angles reach thousands of radians) cost a fraction of an evaluation per element instead
of two. Interleaved pairs are loaded as [heads, pairs, 2] tiles and split, so that both
layouts read contiguous memory.

Dtype policy: load, compute in float32 (float64 for float64 inputs, so
``torch.autograd.gradcheck`` can check the kernel), store in t's dtype. Each rotated
output is two products and a sum in float32, then one rounding to the output dtype; the
pass-through channels are copied bit for bit.

Sources: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
(``_rotate_half``, ``_apply_rotary_pos_emb_bshd``); Transformer Engine
``transformer_engine/common/fused_rope/fused_rope.cu`` (the exact transposed backward);
Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import launch
from .launch import TL_DTYPE, Tile, acc_dtype, empty_contiguous_like, next_power_of_2

__all__ = ["rope_fwd", "rope_bwd", "rope_launch", "rope_tile"]


@triton.jit
def _rope_kernel(
    X_ptr,  # input [s, b, np, d]: t (forward) or the output's gradient (backward); any strides
    F_ptr,  # freqs [s, b or 1, 1, rot], float32 (float64 for float64 x); broadcast dims: stride 0
    OUT_ptr,  # output [s, b, np, d], contiguous, x's dtype
    batch,  # b
    n_heads,  # np
    head_dim,  # d
    half_rot,  # rot / 2: the number of channel pairs rotated
    X_stride_s,
    X_stride_b,
    X_stride_h,
    X_stride_d,
    F_stride_s,  # 0 when freqs has one position for every token (never in practice)
    F_stride_b,  # 0 when freqs is [s, 1, 1, rot]: the same positions for every sample
    F_stride_d,
    mscale,  # float: cos and sin are scaled by it (Megatron's mscale; 1.0 = plain RoPE)
    INTERLEAVED: tl.constexpr,  # pairs (2k, 2k + 1) if True, else (k, k + rot/2)
    BACKWARD: tl.constexpr,  # apply the transpose (the gradient) instead of the rotation
    BLOCK_H: tl.constexpr,  # heads per loop step
    BLOCK_K: tl.constexpr,  # pairs per head: next power of two >= rot / 2
    BLOCK_P: tl.constexpr,  # pass-through channels: next power of two >= d - rot, or 0 if d == rot
    ACC: tl.constexpr,  # compute dtype: float32, or float64 for float64 inputs
):
    row = tl.program_id(0)  # the token: row = s_idx * batch + b_idx
    s_idx = row // batch
    b_idx = row - s_idx * batch
    # int64 offsets: t may hold more than 2^31 elements
    x_row = X_ptr + s_idx.to(tl.int64) * X_stride_s + b_idx.to(tl.int64) * X_stride_b
    f_row = F_ptr + s_idx.to(tl.int64) * F_stride_s + b_idx.to(tl.int64) * F_stride_b
    out_row = OUT_ptr + row.to(tl.int64) * n_heads * head_dim

    k = tl.arange(0, BLOCK_K)  # pair index
    k_mask = k < half_rot
    # This token's angles, once: cos and sin for both channels of every pair, in ACC
    if INTERLEAVED:
        # a pair's channels (2k, 2k + 1) are adjacent: load them as a [BLOCK_K, 2] tile
        # (contiguous, so vector loads) and split it into the two halves of each pair
        ch = 2 * k[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_K, 2]
        ch_mask = ch < 2 * half_rot
        f1, f2 = tl.split(tl.load(f_row + ch * F_stride_d, mask=ch_mask, other=0.0).to(ACC))
    else:
        i1 = k  # channel of each pair's first element
        i2 = k + half_rot  # ... and of its partner
        f1 = tl.load(f_row + i1 * F_stride_d, mask=k_mask, other=0.0).to(ACC)
        f2 = tl.load(f_row + i2 * F_stride_d, mask=k_mask, other=0.0).to(ACC)
    c1 = tl.cos(f1) * mscale
    c2 = tl.cos(f2) * mscale
    s1 = tl.sin(f1) * mscale
    s2 = tl.sin(f2) * mscale
    # w12: the weight of x2 in out1; w21: the weight of x1 in out2
    if BACKWARD:
        w12 = s2  # d1 = g1 * c1 + g2 * s2
        w21 = -s1  # d2 = g2 * c2 - g1 * s1
    else:
        w12 = -s1  # o1 = x1 * c1 - x2 * s1
        w21 = s2  # o2 = x2 * c2 + x1 * s2
    c1 = c1[None, :]  # [1, BLOCK_K]: broadcast over the heads
    c2 = c2[None, :]
    w12 = w12[None, :]
    w21 = w21[None, :]

    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < n_heads
        x_h = x_row + h[:, None].to(tl.int64) * X_stride_h  # [BLOCK_H, 1] pointers to each head
        o_h = out_row + h[:, None].to(tl.int64) * head_dim
        if INTERLEAVED:
            # [BLOCK_H, BLOCK_K, 2] tiles: each pair's two channels side by side
            mask3 = h_mask[:, None, None] & ch_mask[None, :, :]
            x1, x2 = tl.split(tl.load(x_h[:, :, None] + ch[None, :, :] * X_stride_d, mask=mask3, other=0.0).to(ACC))
            o = tl.join(x1 * c1 + x2 * w12, x2 * c2 + x1 * w21)
            tl.store(o_h[:, :, None] + ch[None, :, :], o.to(OUT_ptr.dtype.element_ty), mask=mask3)
        else:
            mask = h_mask[:, None] & k_mask[None, :]
            x1 = tl.load(x_h + i1[None, :] * X_stride_d, mask=mask, other=0.0).to(ACC)
            x2 = tl.load(x_h + i2[None, :] * X_stride_d, mask=mask, other=0.0).to(ACC)
            o1 = x1 * c1 + x2 * w12
            o2 = x2 * c2 + x1 * w21
            tl.store(o_h + i1[None, :], o1.to(OUT_ptr.dtype.element_ty), mask=mask)
            tl.store(o_h + i2[None, :], o2.to(OUT_ptr.dtype.element_ty), mask=mask)
        if BLOCK_P > 0:  # channels rot .. d: copied, no arithmetic, no rounding
            p = 2 * half_rot + tl.arange(0, BLOCK_P)
            p_mask = h_mask[:, None] & (p < head_dim)[None, :]
            xp = tl.load(x_h + p[None, :] * X_stride_d, mask=p_mask, other=0.0)
            tl.store(o_h + p[None, :], xp, mask=p_mask)


# Launch settings. The compiler gives the per-pair values (the angles' loads, cos, sin) their
# own compact layout, one pair per thread, when a program has at most BLOCK_K threads, and
# converts them once through shared memory; with more threads than pairs it recomputes them
# in every thread that holds a head of that pair, up to two sines and two cosines per element
# (read off the Triton 3.9 IR for sm_90). So a program gets one warp per 32 pairs, at most 8:
# the four sines and cosines of a pair then serve its 2·np elements.
MAX_WARPS = 8
# Elements of x per loop step and warp: 32 per thread, e.g. 2 Ki elements (16 heads x 64
# pairs x 2) for 2 warps at d = rot = 128: four 16-byte loads per thread per step.
ELEMENTS_PER_WARP = 1024


# (n_heads, head_dim, rot_dim) -> rope_tile's answer (filled outside torch.compile only, as
# fusedlib.kernels.launch.pick's memory).
_TILES: dict[tuple[int, int, int], Tile] = {}


def _pass_through_block(head_dim: int, rot_dim: int) -> int:
    """BLOCK_P: a power of two >= head_dim - rot_dim, or 0 when every channel is rotated."""
    return next_power_of_2(head_dim - rot_dim) if head_dim > rot_dim else 0


def rope_tile(n_heads: int, head_dim: int, rot_dim: int) -> Tile:
    """Launch settings of :func:`_rope_kernel` for heads of ``head_dim`` channels.

    Args:
        n_heads: heads per token (>= 1).
        head_dim: channels per head, d.
        rot_dim: rotated channels, even, 2 <= rot_dim <= head_dim.

    Returns:
        A :class:`~fusedlib.kernels.launch.Tile`: BLOCK_M = BLOCK_H, heads per loop step;
        BLOCK_N = BLOCK_K, pairs per head (a power of two >= rot_dim / 2); num_warps =
        BLOCK_K / 32, between 1 and :data:`MAX_WARPS`. (The kernel's BLOCK_P, the pass-through
        channels per head, follows from the dims: a power of two >= head_dim - rot_dim, or 0.)

    Source: fusedlib's own.
    """
    key = (n_heads, head_dim, rot_dim)
    tile = _TILES.get(key)
    if tile is None:
        block_k = next_power_of_2(rot_dim // 2)
        warps = max(1, min(MAX_WARPS, block_k // 32))
        width = max(2 * block_k, _pass_through_block(head_dim, rot_dim))  # elements of one head per step
        block_h = max(1, min(next_power_of_2(n_heads), warps * ELEMENTS_PER_WARP // width))
        tile = Tile(BLOCK_M=block_h, BLOCK_N=block_k, num_warps=warps)
        if not torch.compiler.is_compiling():
            _TILES[key] = tile
    return tile


def rope_launch(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, backward: bool,
                mscale: float = 1.0, tile: Tile | None = None) -> torch.Tensor:
    """Launch the kernel: the rotation (forward) or its transpose (backward) of ``x``.

    No argument checks beyond what the kernel needs (the caller,
    :mod:`fusedlib.fusions.fused_rope`, checks user input).

    Args:
        x: [s, b, np, d], float32/float16/bfloat16/float64, any strides.
        freqs: [s or 1, b or 1, 1, rot], float32 (or float64 with float64 x), same device,
            rot even and <= d; any strides.
        interleaved: pairs (2k, 2k+1) if True, else (k, k + rot/2).
        backward: apply the transpose (the gradient of the forward) instead.
        mscale: scale of cos and sin.
        tile: launch settings (None: :func:`rope_tile`): BLOCK_M heads per step, BLOCK_N
            pairs per head (a power of two >= rot / 2), num_warps.

    Returns:
        A new contiguous [s, b, np, d] tensor of x's dtype.

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``; Transformer Engine
    ``transformer_engine/common/fused_rope/fused_rope.cu``.
    """
    s, b, n_heads, d = x.shape
    rot = freqs.shape[-1]
    out = empty_contiguous_like(x)
    if out.numel() == 0:
        return out
    if tile is None:
        tile = rope_tile(n_heads, d, rot)
    f_shape, f_strides = freqs.shape, freqs.stride()
    launch(
        _rope_kernel, (s * b,), x.device,
        x, freqs, out, b, n_heads, d, rot // 2, *x.stride(),
        f_strides[0] if f_shape[0] != 1 else 0, f_strides[1] if f_shape[1] != 1 else 0, f_strides[3], float(mscale),
        INTERLEAVED=bool(interleaved), BACKWARD=bool(backward), BLOCK_H=tile.BLOCK_M, BLOCK_K=tile.BLOCK_N,
        BLOCK_P=_pass_through_block(d, rot), ACC=TL_DTYPE[acc_dtype(x.dtype)], num_warps=tile.num_warps,
    )
    return out


def rope_fwd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """RoPE applied to ``t`` [s, b, np, d] with ``freqs`` [s, 1 or b, 1, rot]: a new
    contiguous tensor of t's shape and dtype (see :func:`rope_launch`).

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
    (``_apply_rotary_pos_emb_bshd``); Su et al., arXiv:2104.09864.
    """
    return rope_launch(t, freqs, interleaved, backward=False, mscale=mscale)


def rope_bwd(g: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """The gradient of :func:`rope_fwd` with respect to t, given the output's gradient
    ``g`` [s, b, np, d] (any strides): a new contiguous tensor of g's shape and dtype.

    Source: Transformer Engine ``transformer_engine/common/fused_rope/fused_rope.cu`` (the exact
    transposed backward).
    """
    return rope_launch(g, freqs, interleaved, backward=True, mscale=mscale)
