"""Shared pieces of the softmax benchmarks (causal_softmax, masked_softmax, softmax_one):
the byte counts, the sweep shapes, and the baselines (Apex's CUDA kernels, Megatron-core).

Byte convention (the same for every implementation of an op): each tensor is charged once,
and only the elements an exact implementation must move:

* the scores x are read where a probability can be nonzero: for a causal mask, the kept
  band only (row q of [sq, sk] keeps min(sk, max(0, q + sk - sq + 1)) keys); for a bool
  mask, every element (which ones are masked is known only after reading the mask);
* the probabilities p and the gradient dx are written whole: they are dense tensors and
  the masked part must be written as zeros;
* the backward reads g and p where p can be nonzero (dx = scale·p·(g - sum g·p) is 0
  elsewhere), and nothing of the mask;
* a bool mask is read once, one byte per element of its own shape (a [b, 1, sq, sk] mask
  is shared by the heads: re-reads come from L2);
* the sink logits are read once (float32, [np]) and their gradient written once.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .baselines import try_import

#: 1/sqrt(head dim 128): the scale Megatron-core applies to the scores.
SCALE = 1.0 / math.sqrt(128)

#: Key lengths of the sweeps: Apex's kernels and Megatron-core's fused path stop at 4096.
SWEEP_SK = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Elements of the scores in every sweep case (the headline's 2^29 = 128·2048·2048).
SWEEP_ELEMENTS = 1 << 29


def kept_causal(sq: int, sk: int) -> int:
    """Elements of one [sq, sk] causal score matrix that can be nonzero (bottom-right
    diagonal): sum over q of min(sk, max(0, q + sk - sq + 1)). sq = sk: sk·(sk + 1)/2."""
    return sum(min(sk, max(0, q + sk - sq + 1)) for q in range(sq))


def causal_bytes(attn_batches: int, sq: int, sk: int, elem: int) -> dict[str, int]:
    """Fewest bytes of the causal softmax: fwd reads x on the kept band and writes p whole;
    bwd reads g and p on the kept band and writes dx whole (module docstring)."""
    kept = attn_batches * kept_causal(sq, sk)
    full = attn_batches * sq * sk
    fwd = (kept + full) * elem
    bwd = (2 * kept + full) * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def masked_bytes(b: int, np_: int, sq: int, sk: int, mask_b: int, elem: int) -> dict[str, int]:
    """Fewest bytes of the bool-masked softmax: fwd reads x whole and the mask once (1 byte
    per element of [mask_b, 1, sq, sk]) and writes p; bwd reads g and p and writes dx."""
    n = b * np_ * sq * sk
    fwd = 2 * n * elem + mask_b * sq * sk
    bwd = 3 * n * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _apex_function(module: str, masked: bool) -> tuple[Optional[Callable], str]:
    """An autograd wrapper of one of Apex's ``csrc/megatron`` softmax extensions, called as
    Megatron-core calls them (saving the output, backward from it), or (None, why)."""
    ext, why = try_import(module, "forward")
    if ext is None:
        return None, why
    import importlib

    mod = importlib.import_module(module)

    class ApexSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mask, scale):
            p = mod.forward(x, mask, scale) if masked else mod.forward(x, scale)
            ctx.save_for_backward(p)
            ctx.scale = scale
            return p

        @staticmethod
        def backward(ctx, g):
            (p,) = ctx.saved_tensors
            return mod.backward(g.contiguous(), p, ctx.scale), None, None

    return ApexSoftmax.apply, ""


def apex_causal() -> tuple[Optional[Callable], str]:
    """Apex's ``scaled_upper_triang_masked_softmax_cuda`` as ``fn(x[ab, sq, sk], scale)``."""
    fn, why = _apex_function("scaled_upper_triang_masked_softmax_cuda", masked=False)
    return (None, why) if fn is None else ((lambda x, scale: fn(x, None, scale)), "")


def apex_masked() -> tuple[Optional[Callable], str]:
    """Apex's ``scaled_masked_softmax_cuda`` as ``fn(x[b, np, sq, sk], mask, scale)``."""
    return _apex_function("scaled_masked_softmax_cuda", masked=True)


def megatron_softmax(mask_type: str, scale: float) -> tuple[Optional[torch.nn.Module], str]:
    """Megatron-core's own ``FusedScaleMaskSoftmax`` (bf16, fusion on, softmax in fp32): its
    CUDA kernels (Apex's) where its availability rule allows, else its PyTorch path."""
    cls, why = try_import("megatron.core.fusions.fused_softmax", "FusedScaleMaskSoftmax")
    if cls is None:
        return None, why
    enum_cls, why = try_import("megatron.core.transformer.enums", "AttnMaskType")
    mask_func, why2 = try_import("megatron.core.transformer.utils", "attention_mask_func")
    if enum_cls is None or mask_func is None:
        return None, why or why2
    return cls(input_in_fp16=False, input_in_bf16=True, attn_mask_type=getattr(enum_cls, mask_type),
               scaled_masked_softmax_fusion=True, mask_func=mask_func, softmax_in_fp32=True, scale=scale), ""
