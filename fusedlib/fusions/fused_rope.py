"""Fused rotary position embeddings: Megatron-core's ``fused_apply_rotary_pos_emb`` on a Triton kernel.

``fused_apply_rotary_pos_emb(t, freqs, interleaved=False)`` (keyword) applies RoPE to ``t`` [s, b, np, d]
in one pass over memory (read t once, write the output once), and its backward applies the
transposed rotation to the output's gradient in one more. Megatron-core takes this function
from Transformer Engine (``megatron.core.extensions.transformer_engine``) when
``TransformerConfig.apply_rope_fusion`` is on; same name, arguments and semantics here, for
the ``sbhd`` layout Megatron's attention uses.

Differences from the unfused path (:func:`fusedlib.unfused.apply_rotary_pos_emb_bshd`, which
is Megatron's ``_apply_rotary_pos_emb_bshd``): cos and sin are never rounded to t's dtype,
and the two products and the sum are computed in float32 with one rounding at the end, so
for bf16 and fp16 inputs the fused result is the more accurate of the two. Only ``freqs``
is saved for the backward (the rotation's gradient does not depend on t).

Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py``
(``apply_rotary_pos_emb``) and ``megatron/core/extensions/transformer_engine.py``
(``fused_apply_rotary_pos_emb``); Transformer Engine ``FusedRoPEFunc``
(``transformer_engine/pytorch/attention/rope.py``).
"""
from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch.autograd.function import once_differentiable

from ..kernels.rope import rope_bwd, rope_fwd
from ..checks import (
    FLOAT32_MAX,
    FLOAT_DTYPES,
    SUPPORTED_FLOAT_DTYPES,
    check_bool,
    check_same_device,
    check_tensor,
    on_one_kernel_device,
    real_to_float,
    resolve_neg_grads,
    type_name,
)
from ._apply import apply

__all__ = ["FusedRoPEFunc", "fused_apply_rotary_pos_emb", "check_rope_inputs", "first_positions"]


def _check_mscale(mscale: object) -> float:
    """The slow path of the mscale check: a real number (not a bool) whose float32 is finite
    (the kernel multiplies cos and sin by it in float32)."""
    if isinstance(mscale, bool) or not isinstance(mscale, numbers.Real):
        raise TypeError(f"mscale must be a real number (the scale of cos and sin, 1.0 for plain RoPE), "
                        f"got {type_name(mscale)}")
    m = real_to_float("mscale", mscale, "a finite real number")
    if not (math.isfinite(m) and abs(m) <= FLOAT32_MAX):
        raise ValueError(f"mscale must be finite, with |mscale| <= float32's max ({FLOAT32_MAX:.4g}: the kernel "
                         f"scales cos and sin in float32), got {mscale!r}")
    return m


def check_rope_inputs(t: torch.Tensor, freqs: torch.Tensor) -> None:
    """Check the arguments of :func:`fused_apply_rotary_pos_emb`.

    Args:
        t: [s, b, np, d], float32 / float16 / bfloat16 / float64.
        freqs: [s2, 1, 1, rot_dim] or [s2, b, 1, rot_dim] with s2 >= s (positions 0 .. s-1
            are read, as Transformer Engine reads them) or s2 = 1 (broadcast), float32 (or
            float64 with float64 t), on t's device; rot_dim even, 2 <= rot_dim <= d.

    Raises:
        TypeError: a non-tensor, t of an unsupported dtype, or freqs not float32 (float64
            is accepted with float64 t only).
        ValueError: t not 4-D, freqs not 4-D or not broadcastable as above, rot_dim odd, 0
            or larger than d, or the tensors on different devices.

    Source: fusedlib's own check; the arguments of Megatron-LM
    ``megatron/core/extensions/transformer_engine.py`` (``fused_apply_rotary_pos_emb``).
    """
    # the happy case in one test; the checks below name what is wrong otherwise
    if (isinstance(t, torch.Tensor) and isinstance(freqs, torch.Tensor) and t.dtype in FLOAT_DTYPES
            and t.dim() == 4 and freqs.dim() == 4
            and (freqs.dtype == torch.float32 or freqs.dtype == torch.float64 == t.dtype)):
        (s, b, _, d), (fs, fb, fh, rot) = t.shape, freqs.shape
        if (fs >= s or fs == 1) and (fb in (b, 1) and fh == 1 and 2 <= rot <= d and rot % 2 == 0
                and on_one_kernel_device(t, freqs)):
            return
    check_tensor("t", t, dtypes=SUPPORTED_FLOAT_DTYPES, ndim=4)
    check_tensor("freqs", freqs, dtypes=None, ndim=4)
    allowed = (torch.float32, torch.float64) if t.dtype == torch.float64 else (torch.float32,)
    if freqs.dtype not in allowed:
        raise TypeError(
            f"freqs must be float32 (the angles RotaryEmbedding makes; float64 only with float64 t), "
            f"got {str(freqs.dtype).replace('torch.', '')} with t {str(t.dtype).replace('torch.', '')}"
        )
    s, b, _, d = t.shape
    fs, fb, fh, rot = freqs.shape
    if not (fs >= s or fs == 1) or fb not in (b, 1) or fh != 1:
        raise ValueError(
            f"freqs must have shape [s2, 1, 1, rot_dim] or [s2, b, 1, rot_dim] with s2 >= s = {s} (or 1) "
            f"and b = {b} (t's), got {list(freqs.shape)}"
        )
    if rot < 2 or rot % 2 or rot > d:
        raise ValueError(
            f"freqs.shape[-1] = rot_dim must be even and 2 <= rot_dim <= d = t.shape[-1] = {d}, got {rot}"
        )
    check_same_device(t=t, freqs=freqs)


def first_positions(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rows of ``freqs`` that ``t`` reads: positions 0 .. s-1 (a view) of a table longer than
    t's s, as Transformer Engine reads them; ``freqs`` itself otherwise (s2 = s, or s2 = 1, which
    broadcasts). Call after :func:`check_rope_inputs`.

    Args:
        t: [s, b, np, d].
        freqs: [s2, 1 or b, 1, rot_dim] with s2 >= s or s2 = 1.

    Returns:
        [s, 1 or b, 1, rot_dim] (or [1, ...] when s2 = 1 <= s: it broadcasts).

    Source: Transformer Engine ``apply_rotary_pos_emb`` (freqs ``[s2, 1, 1, d2]`` with ``s2 >= s``).
    """
    s = t.shape[0]
    return freqs[:s] if freqs.shape[0] > s else freqs


class FusedRoPEFunc(torch.autograd.Function):
    """Autograd wiring of the fused RoPE kernel.

    ``forward(ctx, t, freqs, interleaved=False, mscale=1.0)`` checks the inputs (interleaved a
    bool, mscale a finite real number: see :func:`fused_apply_rotary_pos_emb`), saves
    ``freqs`` only, and returns RoPE(t) as a new contiguous [s, b, np, d] tensor of t's
    dtype. ``backward`` returns ``(d t, None, None, None)``: the transposed rotation of the
    output's gradient, in t's dtype. freqs gets no gradient (rotary angles are not trained;
    :func:`fused_apply_rotary_pos_emb` refuses a freqs that requires grad rather than
    silently giving it none, as Transformer Engine's does).

    Source: Transformer Engine ``FusedRoPEFunc`` (the name and the argument order), and
    Megatron-LM ``rope_utils.py`` for the math.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                mscale: float = 1.0) -> torch.Tensor:
        check_rope_inputs(t, freqs)
        freqs = first_positions(t, freqs)
        if interleaved is not True and interleaved is not False:  # a str "False" is truthy: refuse it
            interleaved = check_bool("interleaved", interleaved)
        if not (type(mscale) is float and -FLOAT32_MAX <= mscale <= FLOAT32_MAX):  # NaN fails too
            mscale = _check_mscale(mscale)
        ctx.save_for_backward(freqs)
        ctx.interleaved = interleaved
        ctx.mscale = mscale
        return rope_fwd(t, freqs, ctx.interleaved, ctx.mscale)

    @staticmethod
    @once_differentiable  # the kernel's backward is not itself differentiable: say so, not silently
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (freqs,) = ctx.saved_tensors
        # autograd has checked grad_output's shape and dtype against the output; any strides
        return rope_bwd(grad_output, freqs, ctx.interleaved, ctx.mscale), None, None, None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False, *, mscale: float = 1.0) -> torch.Tensor:
    """Apply rotary position embeddings to ``t`` with one Triton kernel (forward and backward).

    For each token and head, the first ``rot_dim`` channels are rotated in pairs by the angles
    in ``freqs`` (``out = t·cos(freqs) + rotate_half(t)·sin(freqs)``, each cos and sin scaled
    by ``mscale``); channels ``rot_dim .. d`` pass through unchanged. Same values as Megatron's
    unfused ``_apply_rotary_pos_emb_bshd`` computed in float32 and rounded once.

    Args:
        t: [s, b, np, d] (Megatron's sbhd layout), float32 / float16 / bfloat16 (float64 for
            gradcheck), CUDA or CPU, any strides (e.g. a slice of a fused QKV tensor).
        freqs: angles in radians, float32: [s2, 1, 1, rot_dim] (the same positions for every
            sample, as ``RotaryEmbedding.forward`` makes them) or [s2, b, 1, rot_dim]
            (per-sample positions), with s2 >= s: as Transformer Engine's function of this
            name, a longer table is read at positions 0 .. s-1 (s2 = 1 broadcasts one
            position to every token); rot_dim even, any size up to d (powers of two or not).
        transpose_output_memory: accepted for Megatron's signature; like Megatron's
            Transformer Engine path, it is ignored with a warning (the output is contiguous).
        interleaved: pairs (2k, 2k+1) (``rotary_interleaved``, GPT-J) if True, else
            (k, k + rot_dim/2) (GPT-NeoX, Megatron's default). A bool (numpy's too).
        mscale: scale of cos and sin (default 1.0), a real number, finite in float32. Megatron's
            fused path takes none and falls back to its unfused path when mscale != 1; this
            kernel applies it directly.

    Returns:
        A new contiguous [s, b, np, d] tensor of t's dtype; differentiable in t.

    Raises:
        TypeError, ValueError: see :func:`check_rope_inputs`; ValueError also for a freqs that
            requires grad (no gradient is computed for freqs).
        TypeError: interleaved or transpose_output_memory not a bool (a str ``"False"`` would
            be read as True), mscale not a real number (a bool, a str, None).
        ValueError: mscale not finite, or beyond float32's range (the kernel's cos and sin
            would be inf or NaN).

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py`` and
    ``megatron/core/extensions/transformer_engine.py`` (``fused_apply_rotary_pos_emb``).
    """
    if isinstance(freqs, torch.Tensor) and freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "freqs requires grad, but fused_apply_rotary_pos_emb computes no gradient for freqs "
            "(rotary angles are not trained): pass freqs.detach(), or use the unfused path "
            "(apply_rope_fusion=False) to differentiate through them"
        )
    if transpose_output_memory is not False and check_bool("transpose_output_memory", transpose_output_memory):
        warnings.warn("transpose_output_memory is not supported by the fused RoPE and will be ignored.",
                      stacklevel=2)
    return apply(FusedRoPEFunc, t, freqs, interleaved, mscale)
