"""Benchmark cases for the causal softmax: fusedlib against eager, torch.compile, Apex and
Megatron-core's FusedScaleMaskSoftmax.

Scores [b·np, sq, sk] = [4·32, 2048, 2048] bf16, scale 1/sqrt(128);
the sweep runs sk = sq from 128 to 32768 at 2^29 elements (Apex's kernel and Megatron-core's
fused path stop at 4096; above it Megatron-core runs its PyTorch path).
Bytes: :func:`causal_softmax_bytes` (kept band read, outputs written whole).

The headline's torch.compile baseline is compiled statically, as every other op's. The
sweep's is the one deliberate exception: one ``torch.compile(dynamic=True)`` shared by its
nine shapes (records say ``"compile": "dynamic"``), because nine static compiles of the
forward and of the forward + backward would cost minutes of GPU-machine time for a curve
whose point is fusedlib's kernel choice across row lengths. A dynamic-shape kernel can be
slower than a static one, so the sweep's torch.compile times are an upper bound, and the
chapter says so.
"""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_softmax import ScaledUpperTriangMaskedSoftmax
from ..core import BenchCase, Impl
from ._softmax_common import SCALE, SWEEP_ELEMENTS, SWEEP_SK, apex_causal, causal_bytes, megatron_softmax
from .baselines import compile_impl

DEFAULT_SHAPE = (4 * 32, 2048, 2048)  # [b·np, sq, sk]: 4 sequences, 32 heads, 2048 tokens


def causal_softmax_bytes(attn_batches: int, sq: int, sk: int, elem: int) -> dict[str, int]:
    """Fewest bytes: fwd reads x on the causal band (sk·(sk+1)/2 per matrix for sq = sk) and
    writes p whole; bwd reads g and p on the band and writes dx whole. Same for every impl."""
    return causal_bytes(attn_batches, sq, sk, elem)


def _unfused(x, mask):
    # the PyTorch path on [1, b·np, sq, sk]: upcast, scale, fill -10000, softmax, zero empty rows, cast
    ab, sq, sk = x.shape
    return unfused.scale_mask_softmax(x.view(1, ab, sq, sk), mask, SCALE).view(ab, sq, sk)


def _case(shape: tuple[int, int, int], dtype: torch.dtype, eager: bool, compiled: Impl | None = None) -> BenchCase:
    ab, sq, sk = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(ab, sq, sk, device=device, dtype=dtype, requires_grad=requires_grad)
        mask = unfused.causal_mask(sq, sk, device=device)  # built once, as Megatron caches it
        return x, mask

    impls = [Impl("fusedlib", lambda x, mask: ScaledUpperTriangMaskedSoftmax.apply(x, SCALE)),
             compiled or compile_impl(_unfused)]
    skipped = {}
    if eager:
        impls.insert(1, Impl("eager", _unfused))
    apex, why = apex_causal()
    if apex is not None:
        impls.append(Impl("apex", lambda x, mask: apex(x, SCALE)))
    else:
        skipped["apex"] = why
    mcore, why = megatron_softmax("causal", SCALE)
    if mcore is not None:
        impls.append(Impl("megatron-core", lambda x, mask: mcore(x.view(1, ab, sq, sk), None).view(ab, sq, sk)))
    else:
        skipped["megatron-core"] = why
    return BenchCase("causal_softmax", shape, dtype, make_inputs,
                     causal_softmax_bytes(ab, sq, sk, torch.finfo(dtype).bits // 8), impls, skipped)


def case(shape: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [b·np, sq, sk] with every baseline and a static compile (the
    headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, eager=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline [128, 2048, 2048] with every baseline; with ``sweep``, sk = sq in SWEEP_SK
    with b·np = max(1, 2^29 / sk²) (fusedlib, torch.compile, Apex, Megatron-core). The sweep
    shares one dynamic compile, on purpose (module docstring)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        dynamic = compile_impl(_unfused, dynamic=True)  # the deliberate exception: see the module docstring
        for sk in SWEEP_SK:
            shape = (max(1, SWEEP_ELEMENTS // (sk * sk)), sk, sk)
            if shape != DEFAULT_SHAPE:
                out.append(_case(shape, dtype, eager=False, compiled=dynamic))
    return out
