"""Benchmark cases for LayerNorm: fusedlib against eager ``F.layer_norm``, ``torch.compile``
of it, Liger-Kernel and Apex (each where it imports), plus a sweep over hidden sizes.

megatron-core's ``FusedLayerNorm`` runs Apex's kernels, so it is timed as "apex".
The same module builds the RMSNorm cases (:mod:`fusedlib.bench.ops.rms_norm`).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from ...backends import apex as apex_backend
from ...fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

DEFAULT_SHAPE = (32768, 4096)  # [s*b, h]: s = 8192, b = 4 at h = 4096, bf16: 268 MB per tensor
SWEEP_H = (768, 1024, 2048, 5120, 8192, 12288, 16384)  # and 4096 (the headline), at 2^27 elements
EPS = 1e-5


def layer_norm_bytes(n_rows: int, h: int, elem: int) -> dict[str, int]:
    """Fewest bytes: fwd reads x, gamma, beta and writes y; bwd reads dy, x, gamma and
    writes dx, dgamma, dbeta. (Row statistics, 8 bytes a row, are an implementation's
    choice and not counted.) fwd+bwd = 5 passes over the [n_rows, h] activations."""
    n = n_rows * h
    fwd = (2 * n + 2 * h) * elem
    bwd = (3 * n + 3 * h) * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def rms_norm_bytes(n_rows: int, h: int, elem: int) -> dict[str, int]:
    """Fewest bytes: fwd reads x, gamma and writes y; bwd reads dy, x, gamma and writes
    dx, dgamma. fwd+bwd = 5 passes over the [n_rows, h] activations."""
    n = n_rows * h
    fwd = (2 * n + h) * elem
    bwd = (3 * n + 2 * h) * elem
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def _liger_rms_norm() -> tuple[Callable | None, str]:
    fn, why = try_import("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
    if fn is None:
        return None, why
    if "in_place" in inspect.getfullargspec(fn.forward).args:
        # in_place=False: Liger's default writes dx into grad_output, which the benchmark reuses
        return (lambda x, w: fn.apply(x, w, EPS, 0.0, "llama", False)), ""
    return (lambda x, w: fn.apply(x, w, EPS)), ""


def norm_case(op: str, shape: tuple[int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    """One BenchCase of ``op`` ("layer_norm" or "rms_norm") at ``shape`` = [rows, h].

    ``baselines``: also time eager PyTorch (the sweep leaves it out to save time);
    torch.compile, Liger and Apex are timed at every shape where they import."""
    n_rows, h = shape
    rms = op == "rms_norm"

    def make_inputs(device, requires_grad):
        x = torch.randn(n_rows, h, device=device, dtype=dtype, requires_grad=requires_grad)
        w = (1 + 0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_(requires_grad)
        if rms:
            return x, w
        b = (0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_(requires_grad)
        return x, w, b

    if rms:
        eager = lambda x, w: F.rms_norm(x, (h,), w, EPS)  # noqa: E731
        impls = [Impl("fusedlib", lambda x, w: fused_rms_norm(x, w, EPS))]
    else:
        eager = lambda x, w, b: F.layer_norm(x, (h,), w, b, EPS)  # noqa: E731
        impls = [Impl("fusedlib", lambda x, w, b: fused_layer_norm(x, w, b, EPS))]
    if baselines:
        impls.append(Impl("eager", eager))
    impls.append(compile_impl(eager))  # static: Inductor specializes on this shape
    skipped: dict[str, str] = {}
    if rms:
        liger, why = _liger_rms_norm()
    else:
        fn, why = try_import("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
        liger = (lambda x, w, b: fn.apply(x, w, b, EPS)) if fn is not None else None
    if liger is not None:
        impls.append(Impl("liger", liger))
    else:
        skipped["liger"] = why
    apex_part = "FusedRMSNormAffineFunction" if rms else (
        "FastLayerNormFN" if h in apex_backend.PERSIST_LN_HIDDEN_SIZES and apex_backend.apex_available("FastLayerNormFN")
        else "FusedLayerNormAffineFunction")
    if apex_backend.apex_available(apex_part):
        if rms:
            impls.append(Impl("apex", lambda x, w: apex_backend.apex_rms_norm(x, w, EPS)))
        else:
            impls.append(Impl("apex", lambda x, w, b: apex_backend.apex_layer_norm(x, w, b, EPS, persist=True)))
    else:
        skipped["apex"] = f"Apex's {apex_part} unavailable: {apex_backend.apex_status()[apex_part]}"
    if not rms:
        skipped["megatron-core"] = "megatron-core's FusedLayerNorm runs Apex's kernels: timed as 'apex'"
    nbytes = (rms_norm_bytes if rms else layer_norm_bytes)(n_rows, h, torch.finfo(dtype).bits // 8)
    return BenchCase(op, shape, dtype, make_inputs, nbytes, impls, skipped)


def norm_cases(op: str, sweep: bool, dtype: torch.dtype) -> list[BenchCase]:
    out = [norm_case(op, DEFAULT_SHAPE, dtype, baselines=True)]
    if sweep:
        n = DEFAULT_SHAPE[0] * DEFAULT_SHAPE[1]
        out += [norm_case(op, (n // h, h), dtype, baselines=False) for h in SWEEP_H]
    return out


def case(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [rows, h] with every baseline (the headline's, and ``--host``'s)."""
    return norm_case("layer_norm", tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [32768, 4096] bf16 with every baseline; with ``sweep``, h in
    SWEEP_H (768..16384) at 2^27 elements against torch.compile, Liger and Apex."""
    return norm_cases("layer_norm", sweep, dtype)
