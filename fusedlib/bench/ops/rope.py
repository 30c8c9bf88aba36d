"""Benchmark cases for rotary position embeddings: fusedlib against eager (Megatron's unfused
formula), torch.compile of it, and megatron-core's own ``apply_rotary_pos_emb`` with
``apply_rope_fusion=False`` where megatron-core imports.

Megatron-core's fused RoPE is Transformer Engine's kernel, not timed here. Every
implementation gets t [s, b, np, d] (the queries of one layer; bf16 by default) and the
float32 angles [s, 1, 1, d] that ``RotaryEmbedding`` makes (full rotary dim, half-split);
only t is differentiated (rotary angles are not trained).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ... import unfused
from ...fusions.fused_rope import fused_apply_rotary_pos_emb
from ...models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from ..core import BenchCase, Impl
from .baselines import compile_impl, try_import

DEFAULT_SHAPE = (4096, 2, 32, 128)  # [s, b, np, d]: a 4 Ki-token sequence, 32 heads of 128, bf16: 67 MB
#: other [s, b, np, d] at the same 2^25 elements: more, narrower heads; fewer, wider ones; b = 4
SWEEP_SHAPES = ((4096, 2, 64, 64), (4096, 2, 16, 256), (2048, 4, 32, 128))

#: Megatron-core's config fields its apply_rotary_pos_emb reads on the unfused sbhd path.
MEGATRON_CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False,
                                  multi_latent_attention=False, mrope_section=None)


def rope_bytes(s: int, b: int, n_heads: int, d: int, elem: int, rot_dim: int | None = None,
               freqs_b: int = 1) -> dict[str, int]:
    """Fewest bytes: fwd reads t and writes out; bwd reads the output's gradient and writes t's.
    Each pass also reads the float32 angles once ([s, freqs_b, 1, rot_dim], 4 bytes each:
    1.6% of the bf16 traffic at the default shape)."""
    n = s * b * n_heads * d
    freqs = s * freqs_b * (rot_dim if rot_dim is not None else d) * 4
    fwd = 2 * n * elem + freqs
    bwd = 2 * n * elem + freqs
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


class _NoContextParallel:
    """A stand-in context-parallel group of one rank: megatron-core's apply_rotary_pos_emb
    asks parallel_state for one when given none, which needs an initialized model parallel
    state; the sbhd path never uses it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, baselines: bool) -> BenchCase:
    s, b, n_heads, d = shape

    def make_inputs(device, requires_grad):
        t = torch.randn(s, b, n_heads, d, device=device, dtype=dtype, requires_grad=requires_grad)
        freqs = RotaryEmbedding(d, 1.0, device=device)(s)  # [s, 1, 1, d] float32, positions 0 .. s-1
        return t, freqs

    eager = lambda t, f: unfused.apply_rotary_pos_emb_bshd(t, f)  # noqa: E731
    impls = [Impl("fusedlib", lambda t, f: fused_apply_rotary_pos_emb(t, f))]
    if baselines:
        impls.append(Impl("eager", eager))
    impls.append(compile_impl(eager))  # static: Inductor specializes on this shape
    skipped: dict[str, str] = {}
    if baselines:
        mcore, why = try_import("megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb")
        if mcore is not None:
            no_cp = _NoContextParallel()
            impls.append(Impl("megatron-core", lambda t, f: mcore(t, f, MEGATRON_CONFIG, cp_group=no_cp)))
        else:
            skipped["megatron-core"] = why
    return BenchCase("rope", shape, dtype, make_inputs,
                     rope_bytes(s, b, n_heads, d, torch.finfo(dtype).bits // 8), impls, skipped)


def case(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16) -> BenchCase:
    """One case at ``shape`` = [s, b, np, d] (full rotary dim) with every baseline (the
    headline's, and ``--host``'s)."""
    return _case(tuple(shape), dtype, baselines=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """The headline case [4096, 2, 32, 128] with every baseline; with ``sweep``, the shapes of
    :data:`SWEEP_SHAPES` against torch.compile (compiled statically for each shape)."""
    out = [case(DEFAULT_SHAPE, dtype)]
    if sweep:
        out += [_case(shape, dtype, baselines=False) for shape in SWEEP_SHAPES]
    return out
