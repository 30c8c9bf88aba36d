"""Benchmark cases for the off-by-one softmax with a learnable sink logit per head, under a
causal mask (as in attention with sinks): fusedlib against eager, torch.compile and
Megatron-core (which computes it in PyTorch: its CUDA kernels have no offset).

Scores [4, 32, 2048, 2048] bf16, sink logits [32] float32 (learnable), scale 1/sqrt(128).
Bytes: :func:`softmax_one_bytes`.
"""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_softmax import FusedScaleMaskSoftmax, attention_mask_func
from ...transformer.enums import AttnMaskType
from ..core import BenchCase, Impl
from ._softmax_common import SCALE, causal_bytes, megatron_softmax
from .baselines import compile_impl

DEFAULT_SHAPE = (4, 32, 2048, 2048)  # [b, np, sq, sk]


def softmax_one_bytes(b: int, np_: int, sq: int, sk: int, elem: int) -> dict[str, int]:
    """Fewest bytes: the causal softmax's (kept band read, outputs whole), plus the float32
    sink logits [np] read in fwd and their gradient written in bwd. Same for every impl."""
    out = causal_bytes(b * np_, sq, sk, elem)
    return {"fwd": out["fwd"] + 4 * np_, "fwd+bwd": out["fwd+bwd"] + 8 * np_}


def _unfused(x, offset, mask):
    return unfused.scale_mask_softmax(x, mask, SCALE, True, offset)


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype) -> BenchCase:
    b, np_, sq, sk = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(b, np_, sq, sk, device=device, dtype=dtype, requires_grad=requires_grad)
        offset = torch.randn(np_, device=device, dtype=torch.float32, requires_grad=requires_grad)
        return x, offset, unfused.causal_mask(sq, sk, device=device)

    fused = FusedScaleMaskSoftmax(dtype == torch.float16, dtype == torch.bfloat16, AttnMaskType.causal, True,
                                  attention_mask_func, True, SCALE)
    impls = [Impl("fusedlib", lambda x, off, mask: fused(x, None, off)),
             Impl("eager", _unfused),
             compile_impl(_unfused)]
    skipped = {}
    mcore, why = megatron_softmax("causal", SCALE)
    if mcore is not None:
        impls.append(Impl("megatron-core", lambda x, off, mask: mcore(x, None, off)))
    else:
        skipped["megatron-core"] = why
    return BenchCase("softmax_one", shape, dtype, make_inputs,
                     softmax_one_bytes(b, np_, sq, sk, torch.finfo(dtype).bits // 8), impls, skipped)


def case(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [b, np, sq, sk] with every baseline (the headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline [4, 32, 2048, 2048] with a learnable [32] sink, every baseline (no sweep:
    the sweep of the causal kernel is causal_softmax's)."""
    return [case(DEFAULT_SHAPE, dtype)]
