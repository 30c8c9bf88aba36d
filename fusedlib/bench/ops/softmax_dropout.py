"""Benchmark cases for the attention softmax with its dropout fused: fusedlib's one kernel
against what Megatron-core's ``DotProductAttention`` runs unfused, softmax then
``torch.nn.Dropout``: eager, torch.compile of the same function, and Megatron-core's own
``FusedScaleMaskSoftmax`` followed by torch's dropout.

Scores [b, np, sq, sk] = [4, 32, 2048, 2048] bf16, causal, scale 1/sqrt(128), p = 0.1
(Megatron's default ``attention_dropout``); the sweep runs sk = sq in :data:`SWEEP_SK` at
2^29 elements (32768 takes fusedlib's looping kernel), each shape compiled statically.
Bytes: :func:`softmax_dropout_bytes`, the causal softmax's count (the dropout adds no
tensor that an exact implementation must move: its mask can be regenerated, as fusedlib does).
"""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_softmax import fused_scale_mask_softmax_dropout
from ...transformer.enums import AttnMaskType
from ..core import BenchCase, Impl
from ._softmax_common import SCALE, SWEEP_ELEMENTS, causal_bytes, megatron_softmax
from .baselines import compile_impl

DEFAULT_SHAPE = (4, 32, 2048, 2048)  # [b, np, sq, sk]: 4 sequences, 32 heads, 2048 tokens
PROB = 0.1  # Megatron's default attention_dropout
#: Key lengths of the sweep (the headline's 2048 is its own case); 32768 takes the looping kernel.
SWEEP_SK = (1024, 8192, 32768)


def softmax_dropout_bytes(b: int, np_: int, sq: int, sk: int, elem: int) -> dict[str, int]:
    """Fewest bytes, the same for every implementation: fwd reads x on the causal band and
    writes the dropped probabilities whole (1R + 1W); bwd reads g and x (or p) on the band and
    writes dx whole (2R + 1W). No dropout mask: it need not be stored (fusedlib regenerates it),
    and the row statistics fusedlib saves (8 bytes a row) are not counted either."""
    return causal_bytes(b * np_, sq, sk, elem)


def _unfused(x, mask):
    # Megatron-core's unfused path: upcast, scale, fill -10000, softmax, zero empty rows, cast;
    # then torch's dropout (writes the output and a byte-per-element mask)
    return unfused.scale_mask_softmax_dropout(x, mask, SCALE, PROB)


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    b, np_, sq, sk = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(b, np_, sq, sk, device=device, dtype=dtype, requires_grad=requires_grad)
        mask = unfused.causal_mask(sq, sk, device=device)  # built once, as Megatron caches it
        return x, mask

    impls = [Impl("fusedlib", lambda x, mask: fused_scale_mask_softmax_dropout(x, None, AttnMaskType.causal,
                                                                               SCALE, PROB)),
             compile_impl(_unfused)]
    skipped = {}
    if baselines:
        impls.insert(1, Impl("eager", _unfused))
        mcore, why = megatron_softmax("causal", SCALE)
        if mcore is not None:
            impls.append(Impl("megatron-core", lambda x, mask: torch.nn.functional.dropout(mcore(x, None), PROB)))
        else:
            skipped["megatron-core"] = why
    return BenchCase("softmax_dropout", shape, dtype, make_inputs,
                     softmax_dropout_bytes(b, np_, sq, sk, torch.finfo(dtype).bits // 8), impls, skipped,
                     peak_memory=True)


def case(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [b, np, sq, sk] with every baseline and a static compile (the
    headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline [4, 32, 2048, 2048] with every baseline; with ``sweep``, sk = sq in
    SWEEP_SK with b = 1, np = max(1, 2^29 / sk²) against torch.compile (static per shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        out += [_case((1, max(1, SWEEP_ELEMENTS // (sk * sk)), sk, sk), dtype, baselines=False) for sk in SWEEP_SK]
    return out
