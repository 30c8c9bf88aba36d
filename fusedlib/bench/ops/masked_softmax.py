"""Benchmark cases for the bool-masked (padding) softmax: fusedlib against eager,
torch.compile, Apex and Megatron-core's FusedScaleMaskSoftmax.

Scores [b, np, sq, sk] = [4, 32, 2048, 2048] bf16 with a padding mask [4, 1, 2048, 2048]
(key padding: sequence i keeps its first sk·(1 - i/8) keys), scale 1/sqrt(128). The sweep
runs sk from 128 to 32768 with sq = 2^22 / sk (2^29 elements); Apex asserts sk <= 4096.
Bytes: :func:`masked_softmax_bytes`.

The headline's torch.compile baseline is compiled statically; the sweep shares one
``torch.compile(dynamic=True)`` (``"compile": "dynamic"`` in its records), for the reason
:mod:`fusedlib.bench.ops.causal_softmax` gives.
"""
from __future__ import annotations

import torch

from ... import unfused
from ...fusions.fused_softmax import ScaledMaskedSoftmax
from ..core import BenchCase, Impl
from ._softmax_common import SCALE, SWEEP_ELEMENTS, SWEEP_SK, apex_masked, masked_bytes, megatron_softmax
from .baselines import compile_impl

DEFAULT_SHAPE = (4, 32, 2048, 2048)  # [b, np, sq, sk]
APEX_MAX_SK = 4096  # Apex's scaled_masked_softmax asserts sk <= 4096 (anchors README)


def masked_softmax_bytes(b: int, np_: int, sq: int, sk: int, mask_b: int, elem: int) -> dict[str, int]:
    """Fewest bytes: fwd reads x whole and the [mask_b, 1, sq, sk] bool mask once (1 byte an
    element) and writes p; bwd reads g and p and writes dx. Same for every impl."""
    return masked_bytes(b, np_, sq, sk, mask_b, elem)


def padding_mask(b: int, sq: int, sk: int, device) -> torch.Tensor:
    """[b, 1, sq, sk] bool key-padding mask: sequence i keeps its first sk·(1 - i/8) keys."""
    lengths = torch.tensor([max(1, sk - (i % 8) * sk // 8) for i in range(b)], device=device)
    keys = torch.arange(sk, device=device)
    return (keys[None, :] >= lengths[:, None])[:, None, None, :].expand(b, 1, sq, sk).contiguous()


def _unfused(x, mask):
    return unfused.scale_mask_softmax(x, mask, SCALE)


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, eager: bool,
          compiled: Impl | None = None) -> BenchCase:
    b, np_, sq, sk = shape

    def make_inputs(device, requires_grad):
        x = torch.randn(b, np_, sq, sk, device=device, dtype=dtype, requires_grad=requires_grad)
        return x, padding_mask(b, sq, sk, device)

    impls = [Impl("fusedlib", lambda x, mask: ScaledMaskedSoftmax.apply(x, mask, SCALE)),
             compiled or compile_impl(_unfused)]
    skipped = {}
    if eager:
        impls.insert(1, Impl("eager", _unfused))
    apex, why = apex_masked()
    if apex is None:
        skipped["apex"] = why
    elif sk > APEX_MAX_SK:
        skipped["apex"] = f"Apex's scaled_masked_softmax asserts sk <= {APEX_MAX_SK}, got sk = {sk}"
    else:
        impls.append(Impl("apex", lambda x, mask: apex(x, mask, SCALE)))
    mcore, why = megatron_softmax("padding", SCALE)
    if mcore is not None:
        impls.append(Impl("megatron-core", lambda x, mask: mcore(x, mask)))
    else:
        skipped["megatron-core"] = why
    return BenchCase("masked_softmax", shape, dtype, make_inputs,
                     masked_softmax_bytes(b, np_, sq, sk, b, torch.finfo(dtype).bits // 8), impls, skipped)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline [4, 32, 2048, 2048] with every baseline; with ``sweep``, sk in SWEEP_SK
    at [4, 32, 2^22 / sk, sk] (fusedlib, torch.compile(dynamic=True) shared by the sweep,
    Apex up to 4096, Megatron-core)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        dynamic = compile_impl(_unfused, dynamic=True)  # the deliberate exception: see the module docstring
        for sk in SWEEP_SK:
            shape = (4, 32, SWEEP_ELEMENTS // (4 * 32 * sk), sk)
            if shape != DEFAULT_SHAPE:
                out.append(_case(shape, dtype, eager=False, compiled=dynamic))
    return out


def case(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [b, np, sq, sk] with every baseline and a static compile (the
    headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, eager=True)
