"""FlashAttention-2 in Triton: the whole attention, forward and backward, without the scores.

Layout: q [b, sq, hq, d], k and v [b, sk, hkv, d] ("bshd"), any strides with a unit last
stride; hq a multiple of hkv (grouped-query attention: query head h reads key/value head
h // (hq/hkv); K and V are never repeated in memory). The output o has q's shape.

Forward (Dao, "FlashAttention-2", 2023, Algorithm 1), for one tile of BLOCK_M query rows of
one head: keep a running row max m, a running denominator l and an unnormalised output
acc in float32 (registers), and walk the key/value tiles of BLOCK_N keys:

    s     = (q·kᵀ)·scale·log2(e)           the scores in base 2: exp2 is one instruction
    m_new = max(m, rowmax(s))
    alpha = 2^(m - m_new)                  rescales what was summed under the old max
    p     = 2^(s - m_new)
    l     = alpha·l + rowsum(p)
    acc   = alpha·acc + p·v
    m     = m_new

and at the end o = acc/l and LSE = (m + log2(l))·ln(2), the natural log-sum-exp of the
row's scores, saved (float32, [b, hq, sq]: O(s) memory) for the backward. The
[b, hq, sq, sk] scores and probabilities never leave the registers.

Masks. Key j is visible to query i iff i + band_lo <= j <= i + band_hi
(:func:`attention_band`): causal is band_hi = sk - sq (the diagonal aligned bottom-right, as
chapter 5), a sliding window (left, right) adds band_lo = sk - sq - left and band_hi =
sk - sq + right (-1: unbounded), and both together intersect (FlashAttention's rule). A tile
loop never visits key tiles outside the band, and splits the rest into tiles that need no
mask (every key visible to every row of the tile: no compare, no select) and the tiles at
the band's two edges and at the end of the sequence, which do. A bool mask (True = masked)
is read as bytes per tile: per key ([b, sk] key padding, or any mask constant along the
queries: one row of bytes per tile) or per (query, key) through its strides.

Off-by-one softmax with a sink (chapter 5): a per-head logit o_h joins every row's
denominator, D = sum_j e^{s_j} + e^{o_h}; the loop starts from m = o_h·log2(e), l = 1
instead of m = -inf, l = 0, and the sink's probability is no output.

A row that sees no key (and has no sink) keeps m = -inf and l = 0: its output is 0 and its
LSE -inf, never NaN (the max subtracted is taken as 0 while it is -inf, so nothing computes
-inf - (-inf)).

Attention dropout (chapter 2's Philox-4x32-10 and threshold, :func:`_attention_keep_mask`):
the probability of key j for query i of head h in batch b is kept iff its 16 bits are >= T
(T = round(p·2^16)). One Philox call draws the bits of 8 scores, queries {i, i+1, i+8, i+9} x
keys {j, j+8} (i with bits 0 and 3 clear, j with bit 3 clear): the scores one thread of the
backward's tensor-core tiles holds, so no kernel moves mask bits between threads there. The
same mask whatever the tiles (:func:`flash_attn_dropout_mask` writes it), but not chapter 2's
column order (8 neighbouring columns per call), so not the mask the materialised path
(:func:`~fusedlib.kernels.softmax.softmax_dropout_mask`) draws for the same seed. The
denominator l sums the probabilities before dropout; acc only the kept ones, scaled by
1/(1 - p') once at the end. The backward regenerates the mask from the seed.

Backward (FlashAttention-2, Algorithm 2), with dO the output's gradient, deterministic form
in three kernels and without atomics (so bitwise reproducible):

1. preprocess: Delta_i = rowsum(dO_i·O_i) (= sum_j P_ij·dP_ij), float32 [b, hq, sq]; with a
   sink also each row's -P_sink,i·Delta_i, whose sum over b and i is d o_h;
2. dK, dV: one program per tile of BLOCK_N keys of one key/value head, walking the query
   tiles of every query head of its group; P = 2^(s - LSE·log2(e)) recomputed from the saved
   LSE, dV += Pᵀ·dO (P dropped and rescaled with dropout), dP = dO·vᵀ, dS = P∘(dP - Delta),
   dK += dSᵀ·q·scale. The GQA sum over the group's heads happens in registers;
3. dQ: one program per tile of BLOCK_M queries, walking the key tiles as the forward does:
   dQ += dS·k·scale.

Without sinks the dQ kernel runs first and computes Delta itself, for the rows whose dO it
loads anyway, storing it for the dK/dV kernel (``DELTA_IN_DQ``, :func:`delta_in_dq_kernel`:
every head dim without dropout; with dropout from a padded head dim of 128, head dims above
64): two kernels, one launch and one read of dO fewer, the same bits.

Kernels 2 and 3 both recompute s and dP (7 matrix products where an atomic dQ does 5);
the price of a deterministic backward with no [b, sq, hq, d] float32 accumulator. The
nondeterministic form (``deterministic=False``, FlashAttention-2's own): kernel 2 also adds
dS·k of each tile into a float32 dQ accumulator with atomic adds (which the preprocess
zeroes), and a last kernel scales and casts it; the order of those float32 additions varies
from run to run. Taken where it measured faster (:func:`use_atomic_dq`). On Hopper GPUs the
tile is added by one TMA bulk reduction (FlashAttention-3's way, Shah et al. 2024, Sec. 3.1)
instead of a float32 atomic per element (:func:`dq_by_tma`): the tile is written to shared
memory once and the copy engine adds it while the warps go on with the next query tile.

Dtype policy: q, k, v in float16 or bfloat16 (float32 for tests, with IEEE float32
products: no TF32), products accumulated in float32 on the tensor cores, softmax statistics
in float32, P and dS rounded to the inputs' dtype before their products (as FlashAttention),
outputs stored in the inputs' dtype, LSE and Delta float32. Head dims up to 256; a head dim
that is not a power of two is padded to the next one (at least 16) with masked loads.

Source: Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023), Algorithms 1 and 2; Dao et al., "FlashAttention" (2022), for the
dropout regenerated in the backward; Triton's fused-attention tutorial
(``python/tutorials/06-fused-attention.py``) for the exp2 form and the split key loop;
Megatron-LM ``megatron/core/transformer/dot_product_attention.py`` and
``megatron/core/extensions/transformer_engine.py`` (core-attention semantics: the mask types,
the sliding window, softmax_scale); Miller, "Attention is off by one" (2023) for the sink.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..runtime import (
    INTERPRET_ON_CPU, Planned, find_plan, launch, launch_planned, param_key, plan_cache, planned, remember_plan,
    spec_key, tensor_key,
)
from .bias_dropout_add import KEEP_BITS, drop_threshold, dropout_scale
from .launch import Tile, TileTable, _TensorDescriptor as _HostDescriptor, cdiv, dot_settings, next_power_of_2, pick

#: Triton's host-side descriptor class (the launch layer's import: None in a Triton without one)
#: where Triton's device-side descriptors have bulk reductions (``atomic_add``), else None.
_TensorDescriptor = (_HostDescriptor if hasattr(getattr(tl.core, "tensor_descriptor_base", None), "atomic_add")
                     else None)

__all__ = [
    "LOG2E",
    "MAX_HEAD_DIM",
    "FWD_TILES",
    "FWD_DROPOUT_TILES",
    "BWD_DKDV_TILES",
    "BWD_DQ_TILES",
    "BWD_ATOMIC_TILES",
    "INTERPRETER_TILE",
    "attention_tile",
    "use_atomic_dq",
    "delta_in_dq_kernel",
    "DELTA_IN_DQ_MAX_HEAD_DIM",
    "DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM",
    "dq_by_tma",
    "DQ_BY_TMA",
    "tma_loads",
    "LOADS_BY_TMA",
    "TMA_LOADS",
    "attention_band",
    "SCHEDULE_HEADS",
    "program_order",
    "flash_attn_fwd",
    "flash_attn_bwd",
    "flash_attn_dropout_mask",
    "packed_grads",
    "PACKED_GRADS_ATTR",
]

#: log2(e): scores are scaled by softmax_scale·log2(e) once, so every exponential is an exp2.
LOG2E: float = 1.4426950408889634
#: ln(2): the LSE is stored in natural-log units, (m + log2 l)·ln 2.
LN2: float = 0.6931471805599453

#: Largest head dim the kernels take (the padded head dim, a power of two, is a tile's width).
MAX_HEAD_DIM: int = 256

# ---------------------------------------------------------------------------------------------
# Launch settings: tables keyed by the head dim (upper bound of d, Tile). Starting points from
# FlashAttention-2 (Sec. 3.3: BLOCK_M 128, BLOCK_N 64 for d <= 128, 4 or 8 warps) and from
# Triton's fused-attention tutorial (its Hopper configs: forward [128, 64] tiles, 3-4 stages;
# backward dK/dV programs of 128 keys walking 32 queries at a time, dQ programs of 128 queries
# walking 32 keys); the d <= 256 row is still those. The d <= 128 row is
# ``python -m fusedlib.bench.tune --op attention``'s winner on the H200 (causal [4, 16, 2048,
# 128], bf16, kernel only; NOTES.md): forward [64, 64] at 4 warps, 3 stages, 0.191 ms against
# 0.213 for [128, 64] at 8 warps; backward [64, 64] at 4 warps, 2 stages (dQ the same square
# tile), 0.667 ms against 0.962 for [32, 128] at 8 warps. The forward's [64, 64] tile (4 warps,
# 3 stages; the d <= 64 row's too) was then compared with ten other tiles at each of the
# benchmark's four cases (pointer loads, kernel only; NOTES.md) and was the fastest at every one
# (causal [4, 16, 2048, 128]: 0.190 ms against 0.207-0.303). The d <= 64 row: the same sweep at
# causal [64, 6, 512, 64] (chapter 9's model) and [8, 32, 1024, 64], bf16, kernel only, each
# kernel's tile swept with the others at the table's (ms; tools: NOTES.md): forward [64, 64]
# 0.0671 / 0.1267 against 0.0793 / 0.1452 for the earlier [128, 64]; dK/dV 32 queries per step
# over 64 keys 0.2277 / 0.4322 against 0.2544 / 0.4843 for [32, 128] (the whole backward); dQ
# [64, 32] 0.2349 against 0.2559 for [128, 32] (the whole backward, first shape).
#
# Registers bound the tiles. Forward: acc [BLOCK_M, d] float32 plus the [BLOCK_M, BLOCK_N]
# scores, per thread acc is BLOCK_M·d/(32·warps) floats: 64 at [128, 128] and 8 warps. Shared
# memory: K and V tiles, BLOCK_N·d·2 bytes each per stage: 3 stages of [64, 128] bf16 = 96 KB
# of the H200's 227 KB. dK/dV: two [BLOCK_N, d] float32 accumulators plus K and V in
# registers: 128 keys at d = 128 needs 8 warps; d = 256 halves the keys.
#
# The launchers' plans (flash_attn_fwd, flash_attn_bwd: one per input signature) keep what they
# read from the module settings here and below (the tile tables, INTERPRETER_TILE, SCHEDULE_HEADS
# and program_order, DQ_BY_TMA, LOADS_BY_TMA, TMA_LOADS): after changing one at run time, call
# fusedlib.runtime.clear_plans().
# ---------------------------------------------------------------------------------------------

#: Forward: one program per BLOCK_M queries of one head, walking BLOCK_N keys at a time.
FWD_TILES: TileTable = (
    (64, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)),
    (128, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)),
    (256, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)),
)
#: Forward with dropout: half the keys per step. The Philox draw adds registers to every step.
#: Timed on the H200 (bf16, dropout 0.1, kernel ms, 12 tiles at three shapes): causal
#: [4, 16, 2048, 128], [64, 32] at 4 warps and 3 stages 0.332 against FWD_TILES's [64, 64]
#: 0.392; non-causal 0.555 against 0.659; causal [8, 32, 1024, 64] 0.252 against 0.256;
#: [128, *] at 8 warps 0.360-0.407 at the first. The backward's tiles, timed with dropout at
#: the same shapes, stayed. Head dims above 128 keep FWD_TILES's tile (not measured with dropout).
#: These timings drew chapter 2's mask order (a Philox call per 8 neighbouring keys). With
#: :func:`_attention_keep_mask`'s order, 9 tiles timed again (same timer): [64, 32] at 4 warps and
#: 3 stages 0.325 ms at causal [4, 16, 2048, 128] (the next, [64, 64] at 2 stages, 0.329;
#: [128, 64] at 8 warps 0.343), 0.615 non-causal ([64, 64] at 2 stages 0.586, 5 % less), 0.118
#: at causal [8, 12, 1024, 64] ([64, 64] at 3 stages 0.117) and 0.274 at [8, 32, 1024, 64]
#: ([64, 64] at 3 stages 0.278): no tile faster at every case, the table kept. The backward
#: tables' dropout rows were timed with chapter 2's order only.
FWD_DROPOUT_TILES: TileTable = (
    (64, Tile(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)),
    (128, Tile(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)),
    (256, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)),
)
#: Backward dK/dV: one program per BLOCK_N keys of one key/value head, walking BLOCK_M queries.
BWD_DKDV_TILES: TileTable = (
    (64, Tile(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)),
    (128, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
    (256, Tile(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2)),
)
#: Backward with atomic dQ (:func:`use_atomic_dq`): one program per BLOCK_N keys computes dK, dV
#: and adds each step's dS·k into a float32 dQ accumulator. Swept on the H200 (bf16, kernel
#: only, NOTES.md), whole backward ms: d = 128 [64 queries, 128 keys] at 8 warps 0.649 at causal
#: [4, 16, 2048, 128] (the deterministic pair 0.664), 1.085 non-causal (1.138), 3.857 at causal
#: [2, 16, 8192, 128] (4.147); every 64-key tile was slower than the deterministic pair (0.87-1.08
#: at the first shape): fewer, wider key tiles mean fewer atomic adds. With the TMA bulk
#: reductions (:data:`DQ_BY_TMA`) the same tile at 3 stages: 0.612, 0.953 and 3.626 (2 stages
#: 0.656, 1.089, 3.901; [32, 128] and 64-key tiles 0.87-2.09 at the first two shapes). d = 64
#: with dropout 0.1, [64, 64] at 4 warps: 0.611 at causal [8, 32, 1024, 64] (the deterministic
#: pair 0.767), 0.312 at [64, 6, 512, 64] (0.361) with element atomics and 3 stages; with the
#: bulk reductions and 2 stages 0.576 and 0.287 (3 stages 0.589 and 0.306; [32, 64] and
#: [64, 128] slower, 0.67-0.76 at the first shape).
BWD_ATOMIC_TILES: TileTable = (
    (64, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
    (128, Tile(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3)),
)
#: Backward dQ: one program per BLOCK_M queries of one head, walking BLOCK_N keys.
BWD_DQ_TILES: TileTable = (
    (64, Tile(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)),
    (128, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
    (256, Tile(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)),
)

#: Every kernel's tile in Triton's CPU interpreter, which runs programs one at a time at a
#: fixed cost per operation (large tiles: few programs, few loop steps; numpy does the
#: products). Tests lower it to 16 to run many tiles, the band's edges and partial tiles (and
#: then clear the launchers' plans, ``fusedlib.runtime.clear_plans()``, which keep the tile).
INTERPRETER_TILE: Tile = Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)


#: The largest tile a float32 launch takes (queries or keys per block). float32 is a reference
#: dtype, not a speed one: its IEEE products (no TF32) compile to unrolled FMA loops, one per
#: element of a thread's share of each product, [BLOCK_M, BLOCK_N] x d of them. The tables' d = 128
#: tiles took about 2 minutes of compile time per kernel on the H200 (the atomic dK/dV kernel's
#: [64, 128] at 8 warps: 4096 FMAs per thread per product); [32, 32] at 4 warps is 1024.
FLOAT32_MAX_BLOCK: int = 32


def _float32_tile(tile: Tile, dtype: torch.dtype) -> Tile:
    """``tile`` for inputs of ``dtype``: for float32, blocks of at most
    :data:`FLOAT32_MAX_BLOCK` queries and keys at 4 warps or fewer (short compiles, see there)
    and one pipeline stage fewer (twice the bytes per stage: compiled offline for sm_90, the
    float32 forward at d = 128 with the table's [64, 64] and 3 stages needed 229 376 bytes of
    shared memory, 3 KB under the H200's 232 448); other dtypes' tiles, and every tile in Triton's
    CPU interpreter (nothing is compiled there: its tile is chosen for few programs), unchanged."""
    if dtype != torch.float32 or INTERPRET_ON_CPU:
        return tile
    cap = FLOAT32_MAX_BLOCK
    return dataclasses.replace(tile, BLOCK_M=min(tile.BLOCK_M, cap), BLOCK_N=min(tile.BLOCK_N, cap),
                               num_warps=min(tile.num_warps, 4), num_stages=max(tile.num_stages - 1, 1))


def attention_tile(table: TileTable, head_dim: int) -> Tile:
    """The tile of ``table`` for head dim ``head_dim``: the first row whose bound is >= it
    (the interpreter's :data:`INTERPRETER_TILE` when kernels run on the CPU).

    BLOCK_N is a number of keys, not a part of the head dim: :func:`~fusedlib.kernels.launch.pick`
    returns it as the table gives it (``resolve_block_n=False``).

    Raises:
        ValueError: head_dim < 1 or > the table's last bound.

    Source: fusedlib's own tile table (see :func:`~fusedlib.kernels.launch.pick`).
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or not 1 <= head_dim <= table[-1][0]:
        raise ValueError(f"head_dim must be an int in [1, {table[-1][0]}] (the tile table's last bound), "
                         f"got {head_dim!r}")
    if INTERPRET_ON_CPU:
        return INTERPRETER_TILE
    return pick(table, head_dim, resolve_block_n=False)


def use_atomic_dq(head_dim: int, dropout: bool) -> bool:
    """Whether a backward that may be nondeterministic (``deterministic=False``) takes dQ by
    atomic adds from the dK/dV kernel (5 products and one Philox draw per tile, two kernels
    fewer) instead of the dQ kernel (7 products, the mask drawn again). Where it measured
    faster on the H200 (:data:`BWD_ATOMIC_TILES`): head dims 65-128 (2-7 % less backward time
    without dropout), and every head dim up to 64 with dropout (14-20 %); without dropout at
    d <= 64 the atomics cost more than the two products they save (0.230 against 0.207 ms at
    causal [64, 6, 512, 64]), and above 128 the kernel is unmeasured: those keep the
    deterministic pair.

    Source: Dao, "FlashAttention-2" (2023) (dQ by atomic adds); the choice is fusedlib's own, by
    timings.
    """
    block_d = _block_d(head_dim)
    return 64 < block_d <= 128 or (dropout and block_d <= 64)


#: Largest padded head dim at which the deterministic backward (without sinks) computes
#: Delta = rowsum(dO·O) in the dQ kernel, for the rows it loads dO of anyway, and runs that
#: kernel before the dK/dV kernel, which reads Delta: one launch and one read of dO fewer than
#: the preprocess kernel, and the same bits. ``python tools/attention_delta.py`` times both
#: routes (``chapters/data/bench/attention_delta.json``, printed in chapter 8): on the H200 the
#: dQ kernel's route was the faster at every case without dropout (head dims 64, 128 and 256)
#: and with dropout at head dims 128 and 256, so the limit is the largest head dim the kernels
#: take; with dropout at 64 it was the slower (:data:`DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM`). Padded
#: head dims 16 and 32 were not timed: they follow 64.
DELTA_IN_DQ_MAX_HEAD_DIM: int = 256

#: With dropout, the least padded head dim at which the dQ kernel computes Delta: at 64 the
#: backward with Delta in the dQ kernel was the slower (attention_delta.json, H200: the whole
#: backward timed, 0.979x and 0.985x the preprocess route's speed).
DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM: int = 128


def delta_in_dq_kernel(head_dim: int, dropout: bool = False) -> bool:
    """Whether the deterministic backward without sinks computes Delta in its dQ kernel (run
    first) instead of a preprocess kernel: up to :data:`DELTA_IN_DQ_MAX_HEAD_DIM`, and with
    dropout from :data:`DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM` (padded head dims, ``_block_d``).

    Source: fusedlib's own (FlashAttention-2's preprocess, Dao 2023, moved into the dQ pass).
    """
    block_d = _block_d(head_dim)
    return block_d <= DELTA_IN_DQ_MAX_HEAD_DIM and (not dropout or block_d >= DELTA_IN_DQ_DROPOUT_MIN_HEAD_DIM)


def attention_band(sq: int, sk: int, causal: bool, window_size: Optional[tuple[int, int]]) -> tuple[int, int]:
    """(band_lo, band_hi): query i sees key j iff i + band_lo <= j <= i + band_hi.

    causal: j <= i + sk - sq (bottom-right aligned, as chapter 5's
    :func:`~fusedlib.kernels.softmax.causal_band`). window ``(left, right)``: as Megatron-core's
    ``get_sliding_window_causal_mask`` and chapter 5's
    :func:`~fusedlib.kernels.softmax.window_band`, sk - sq - left <= j - i <= sk - sq + right,
    -1 meaning unbounded on that side. With both, their intersection (FlashAttention's
    ``causal`` with ``window_size``: the window's right side capped at the diagonal). An
    unbounded side is returned as ±(sq + sk), past every key of every row.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_sliding_window_causal_mask``);
    FlashAttention's rule for a causal window.
    """
    big = sq + sk
    lo, hi = -big, big
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            lo = sk - sq - left
        if right >= 0:
            hi = sk - sq + right
    if causal:
        hi = min(hi, sk - sq)
    return max(lo, -big), min(hi, big)


#: The programs' order (:func:`_scheduled_tile`), by head dim: (largest head dim, pairs per
#: group), the number of (head, batch) pairs the programs walk together, heaviest block first;
#: taken where the band makes the blocks' costs differ (:func:`program_order`). Timed on the
#: H200 (bf16, kernel ms, CUDA-graph replays; ``tools/attention_order.py`` ->
#: ``attention_order.json``, the grid's order against groups of 8 / 16 / every pair): causal
#: [4, 16, 2048, 128] forward 0.180 against 0.170 / 0.172 / 0.185, with dropout 0.366 against
#: 0.324 / 0.325 / 0.324, deterministic backward 0.654 against 0.596 / 0.600 / 0.628, atomic 0.616
#: against 0.567 / 0.565 / 0.570, atomic with dropout 0.768 against 0.706 / 0.702 / 0.708; causal
#: [2, 16, 8192, 128] groups of 8 3-8 % faster in four forms, 2 % slower in the forward without
#: dropout (1.250 against the grid's 1.226; 16 and every pair 1.305 and 1.298). At causal
#: [8, 32, 1024, 64] groups of 8 were slower in two forms of four (deterministic backward 0.466
#: against 0.404, forward 0.133 against 0.125), level in the forward with dropout, 3 % faster in
#: the atomic backward with dropout (0.500 against 0.515): d <= 64 keeps the grid's order, as
#: d = 256 (not measured).
SCHEDULE_HEADS: tuple[tuple[int, int], ...] = ((64, 1), (128, 8), (256, 1))


def _visible(i: int, lo: int, hi: int, n: int) -> int:
    """How many of n columns j have lo <= j - i <= hi."""
    return max(0, min(n - 1, i + hi) - max(0, i + lo) + 1)


def _end_costs(band: tuple[int, int], sq: int, sk: int, by_keys: bool) -> tuple[int, int]:
    """How much of the band the first and the last row (``by_keys=False``: keys each query sees)
    or key (``by_keys=True``: queries that see it) cover."""
    lo, hi = band
    if by_keys:  # key j is seen by the queries i with lo <= j - i <= hi
        return _visible(0, -hi, -lo, sq), _visible(sk - 1, -hi, -lo, sq)
    return _visible(0, lo, hi, sk), _visible(sq - 1, lo, hi, sk)


def program_order(band: tuple[int, int], sq: int, sk: int, head_dim: int, by_keys: bool) -> tuple[int, bool]:
    """``(GROUP_HEADS, REVERSE_BLOCKS)`` of :func:`_scheduled_tile` for a kernel whose programs
    each take one block of queries (``by_keys=False``: the forward, the dQ kernel) or of keys
    (``by_keys=True``: the dK/dV kernel) under ``band``.

    Where the first and the last row (key) see as many keys (queries) of the band, every block
    costs about the same and the grid's order is kept: ``(1, False)``; so it is for the head dims
    where :data:`SCHEDULE_HEADS` gives 1 (the blocks of one head reversed, ``(1, True)``, was not
    timed). Otherwise that table's group, with REVERSE_BLOCKS where the last block is the heavier:
    the forward's and dQ's under a causal band (the last query row sees every key), the dK/dV
    kernel's under a band open only to later keys.

    Source: fusedlib's own scheduling, by timings.
    """
    first, last = _end_costs(band, sq, sk, by_keys)
    if first == last:
        return 1, False
    block_d = _block_d(head_dim)
    group = next((g for bound, g in SCHEDULE_HEADS if block_d <= bound), 1)
    return (group, last > first) if group > 1 else (1, False)


# ---------------------------------------------------------------------------------------------
# The dropout mask
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attention_keep_mask(seed, row0, m0, n0, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask, bool [BLOCK_M, BLOCK_N], of queries m0 + [0, BLOCK_M) and keys
    n0 + [0, BLOCK_N) of the head whose first row is ``row0`` = (b·hq + h)·sq (m0 and n0
    multiples of 16; BLOCK_M and BLOCK_N too, as every tile of a product is).

    Philox-4x32-10 call (counter (j & ~8, row0 + (i & ~9), 0, 0), key ``seed``) gives the 16
    bits of the 8 scores (i ^ {0, 1, 8, 9}, j ^ {0, 8}): word 2·bit3(i) + bit3(j), its low half
    for even i, its high half for odd i; kept iff the bits are >= T.

    Why these 8: the dK/dV kernel holds its tiles transposed, [keys, queries], in Hopper's
    tensor-core accumulator layout, where one thread holds the query pairs (2c, 2c + 1) at
    steps of 8 of the key rows r and r + 8: bits 0 and 3 of the query and bit 3 of the key
    are a thread's own, so the draw needs no value from another thread (no shared memory,
    no barrier). Chapter 2's order (8 neighbouring keys per call) put each call's values in
    8 threads there. The forward and the dQ kernel hold [queries, keys] tiles, where i and
    i + 1 sit in neighbouring rows of threads: their masks cross threads once per tile.
    Measured on the H200 (bf16, dropout 0.1, kernels alone, CUDA-graph replays, ms, forward /
    backward), chapter 2's order against this one: causal [4, 16, 2048, 128] 0.306 / 0.809
    against 0.322 / 0.706, non-causal 0.556 / 1.399 against 0.615 / 1.190, causal
    [2, 16, 8192, 128] 2.156 / 5.240 against 2.292 / 4.466, causal [8, 12, 1024, 64] 0.111 /
    0.241 against 0.118 / 0.217 (the backward with atomic dQ; the deterministic one at the
    first shape 0.920 against 0.850).
    """
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "the mask's tiles are multiples of 16")
    a = tl.arange(0, BLOCK_M // 4)  # the calls' queries: i with bits 0 and 3 clear
    c = tl.arange(0, BLOCK_N // 2)  # their keys: j with bit 3 clear
    i = m0 + (a // 4) * 16 + (a % 4) * 2
    j = n0 + (c // 8) * 16 + c % 8
    c0 = j[None, :] + tl.zeros_like(i)[:, None]  # [BM/4, BN/2]
    c1 = (row0 + i).to(tl.int32)[:, None] + tl.zeros_like(j)[None, :]
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [BM/4, BN/2, bit3(i), bit3(j)]: word 2·bit3(i) + bit3(j)
    bits16 = tl.join(w & 0xFFFF, w >> 16)  # [..., bit0(i)]: the low half for even i
    keep = bits16.to(tl.int32) >= T  # compared as int32 (see _keep_mask)
    # [i // 16, (i // 2) % 4, j // 16, j % 8, bit3(i), bit3(j), bit0(i)] -> [i, j]
    keep = tl.reshape(keep, [BLOCK_M // 16, 4, BLOCK_N // 16, 8, 2, 2, 2])
    keep = tl.permute(keep, [0, 4, 1, 6, 2, 5, 3])
    return tl.reshape(keep, [BLOCK_M, BLOCK_N])


@triton.jit(do_not_specialize=["T"])
def _flash_dropout_mask_kernel(SEED_ptr, OUT_ptr, sq, sk, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT (int8 [b·hq, sq, sk], contiguous) = the keep mask: one program per tile
    (query tile, key tile, b·hq)."""
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = bh.to(tl.int64) * sq
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    keep = _attention_keep_mask(tl.load(SEED_ptr), row0, m0, n0, T, BLOCK_M, BLOCK_N)
    offs_m, offs_n = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    tl.store(OUT_ptr + (row0 + offs_m)[:, None] * sk + offs_n[None, :], keep.to(tl.int8),
             mask=(offs_m < sq)[:, None] & (offs_n < sk)[None, :])


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq, stride_mk,
               seed, row0, m0, offs_m, offs_d, m_ok, lo, hi, sk, band_lo, band_hi, qk_scale, T, b, hk,
               KV_TMA: tl.constexpr, EDGE: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
               PRECISION: tl.constexpr):
    """Key tiles [lo, hi) of the online softmax (lo, hi multiples of BLOCK_N). EDGE: the tiles
    may hold keys outside the band or past sk, so the band and the end are masked; else every
    key of every tile is visible (only the caller's mask, if any, applies). KV_TMA: k_base and
    v_base are [b, sk, hkv, d] descriptors, read at (b, start_n, hk, 0) in [1, BLOCK_N, 1, d]
    boxes (keys past sk arrive as zeros, as the masked loads' other=0)."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if EDGE:
            n_ok = offs_n < sk
        if KV_TMA:
            kT = tl.trans(tl.reshape(k_base.load([b, start_n, hk, 0]), [BLOCK_N, HEAD_DIM]))
        elif EDGE:
            kT = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                         other=0.0)
        else:
            kT = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, kT.to(DOT), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 scores
        if EDGE:
            rel = offs_n[None, :] - offs_m[:, None]  # j - i
            s = tl.where((rel >= band_lo) & (rel <= band_hi) & n_ok[None, :], s, float("-inf"))
        if MASK_KIND == 1:  # one row of mask bytes for every query (key padding)
            masked = tl.load(mask_base + offs_n * stride_mk, mask=offs_n < sk, other=1)
            s = tl.where(masked[None, :] == 0, s, float("-inf"))
        if MASK_KIND == 2:  # a mask per (query, key)
            masked = tl.load(mask_base + offs_m[:, None] * stride_mq + offs_n[None, :] * stride_mk,
                             mask=m_ok[:, None] & (offs_n < sk)[None, :], other=1)
            s = tl.where(masked == 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:  # l keeps every probability; acc only the kept ones (rescaled at the end)
            keep = _attention_keep_mask(seed, row0, m0, start_n, T, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        if KV_TMA:
            v = tl.reshape(v_base.load([b, start_n, hk, 0]), [BLOCK_N, HEAD_DIM])
        elif EDGE:
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
        else:
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), acc, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tile_ranges(m0, m_last, band_lo, band_hi, n_total, BLOCK_N: tl.constexpr):
    """Key tiles of query rows [m0, m_last]: [lo, a) and [b, hi) need masks, [a, b) do not.
    All multiples of BLOCK_N, lo <= a <= b <= hi (every bound clamped at 0 first: Triton's
    integer division truncates toward zero)."""
    lo = (tl.maximum(m0 + band_lo, 0) // BLOCK_N) * BLOCK_N  # first visible key, rounded down
    end = tl.minimum(tl.maximum(m_last + band_hi + 1, 0), n_total)  # one past the last visible key
    hi = tl.maximum(((end + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    # a tile [n, n + BLOCK_N) needs no mask iff n >= m_last + band_lo (the last row's lower
    # edge), n + BLOCK_N <= m0 + band_hi + 1 (the first row's upper edge) and n + BLOCK_N <= n_total
    full_lo = ((tl.maximum(m_last + band_lo, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = (tl.maximum(tl.minimum(m0 + band_hi + 1, n_total), 0) // BLOCK_N) * BLOCK_N
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.minimum(tl.maximum(full_hi, a), hi)
    return lo, a, b, hi


@triton.jit
def _scheduled_tile(GROUP_HEADS: tl.constexpr, REVERSE_BLOCKS: tl.constexpr):
    """(block, head, batch) of this program of a (blocks, heads, batch) grid, in the order the
    GPU should start them. CUDA promises no order, but GPUs start programs in about the order of
    their linear index (axis 0 fastest), each as soon as one ends. Under a causal band the
    blocks' costs differ (the forward's last query block walks every key tile, its first block
    one), so the grid's order ends the kernel with heavy blocks running after the light ones
    have drained: a tail. Here the linear index walks GROUP_HEADS (head, batch) pairs at a time,
    the heaviest block of each pair first (the longest-processing-time-first rule of list
    scheduling, Graham 1969; FlashAttention's CuTe kernels start causal tiles so,
    ``SingleTileLPTScheduler``), so the last programs to start are the lightest. Groups of
    heads, not every head at once, keep the tiles that the running programs share (K/V in the
    forward, q/dO and the dQ accumulator in the backward) few enough for the L2 cache.
    REVERSE_BLOCKS: the heaviest block is the last index (the host decides from the band).
    GROUP_HEADS = 1 without REVERSE_BLOCKS is the grid's own order."""
    n_blocks = tl.num_programs(0)
    if GROUP_HEADS == 1:  # the grid's own indices (no arithmetic added to the kernel)
        blk = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
    else:
        n_heads = tl.num_programs(1)
        pid = tl.program_id(0) + n_blocks * (tl.program_id(1) + n_heads * tl.program_id(2))
        per_group = GROUP_HEADS * n_blocks
        g = pid // per_group
        r = pid - g * per_group
        # pairs in this group: GROUP_HEADS, fewer in the last
        g_heads = tl.minimum(n_heads * tl.num_programs(2) - g * GROUP_HEADS, GROUP_HEADS)
        blk = r // g_heads
        hb = g * GROUP_HEADS + (r - blk * g_heads)
        h = hb % n_heads
        b = hb // n_heads
    if REVERSE_BLOCKS:
        blk = n_blocks - 1 - blk
    return blk, h, b


@triton.jit(do_not_specialize=["T"])
def _flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr,  # q [b, sq, hq, d], k and v [b, sk, hkv, d], unit last stride
    O_ptr,  # o, q's shape and dtype
    LSE_ptr,  # float32 [b, hq, sq], contiguous: the log-sum-exp of each row (natural log)
    MASK_ptr,  # uint8 (or bool) mask, True = masked, element (b, h, i, j) at the stride_m* strides
    SINK_ptr,  # float32 [hq]: sink logits (with HAS_SINK)
    SEED_ptr,  # int64 [1]: the Philox key (with DROPOUT)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    n_heads,  # hq
    group,  # hq // hkv
    sq, sk,
    qk_scale,  # softmax_scale·log2(e)
    band_lo, band_hi,  # query i sees keys i + band_lo <= j <= i + band_hi
    T,  # drop threshold round(p·2^16) (with DROPOUT)
    keep_scale,  # 1/(1 - p') (1.0 without DROPOUT)
    HEAD_DIM: tl.constexpr,  # d
    BLOCK_D: tl.constexpr,  # d padded to a power of two (>= 16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0: no mask; 1: one row of bytes per (b, h) (keys only); 2: per (i, j)
    HAS_SINK: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT: tl.constexpr,  # dtype of the products' operands (float32 for bfloat16 in the interpreter)
    PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), else "tf32" (unused by 16-bit types)
    KV_TMA: tl.constexpr = False,  # K_ptr and V_ptr are [b, sk, hkv, d] tensor descriptors: TMA tile loads
    GROUP_HEADS: tl.constexpr = 1,  # the programs' order (_scheduled_tile)
    REVERSE_BLOCKS: tl.constexpr = False,
):
    # float arguments are float32 (Triton's launcher) or float64 (Inductor types a Python float so):
    # compute in float32 either way, or float64 would spread to the scores and the accumulators
    qk_scale, keep_scale = tl.cast(qk_scale, tl.float32), tl.cast(keep_scale, tl.float32)
    pid_m, h, b = _scheduled_tile(GROUP_HEADS, REVERSE_BLOCKS)
    hk = h // group  # the key/value head of this query head
    b64 = b.to(tl.int64)
    q_base = Q_ptr + b64 * stride_qb + h.to(tl.int64) * stride_qh
    if KV_TMA:  # descriptors: the tile loads index (b, key, hk, 0)
        k_base = K_ptr
        v_base = V_ptr
    else:
        k_base = K_ptr + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V_ptr + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    o_base = O_ptr + b64 * stride_ob + h.to(tl.int64) * stride_oh
    mask_base = MASK_ptr + b64 * stride_mb + h.to(tl.int64) * stride_mh

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < sq
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0).to(DOT)

    if HAS_SINK:  # the sink logit starts the row: m = o·log2(e), l = 2^(m - m) = 1
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINK_ptr + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seed = 0
    row0 = (b64 * n_heads + h) * sq  # the dropout mask's first row: (b·hq + h)·sq
    if DROPOUT:
        seed = tl.load(SEED_ptr)

    m_last = tl.minimum(m0 + BLOCK_M, sq) - 1
    lo, a, bb, hi = _tile_ranges(m0, m_last, band_lo, band_hi, sk, BLOCK_N)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq,
                               stride_mk, seed, row0, m0, offs_m, offs_d, m_ok, lo, a, sk, band_lo, band_hi,
                               qk_scale, T, b, hk, KV_TMA, True, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT,
                               PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq,
                               stride_mk, seed, row0, m0, offs_m, offs_d, m_ok, a, bb, sk, band_lo, band_hi,
                               qk_scale, T, b, hk, KV_TMA, False, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT,
                               PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq,
                               stride_mk, seed, row0, m0, offs_m, offs_d, m_ok, bb, hi, sk, band_lo, band_hi,
                               qk_scale, T, b, hk, KV_TMA, True, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT,
                               PRECISION)

    empty = l_i == 0.0  # nothing visible and no sink: output 0, LSE -inf
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc * (keep_scale / l_safe)[:, None]
    tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :], o.to(O_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE_ptr + (b64 * n_heads + h) * sq + offs_m, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_tile(sq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile of a program of the grid (row tiles, heads, batch) over [b, s, h, d] rows:
    (head, batch as int64, row offsets, column offsets, the in-bounds mask)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < sq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    return h, b, offs_m, offs_d, ok


@triton.jit
def _flash_bwd_preprocess_kernel(
    O_ptr, DO_ptr,  # o and its gradient [b, sq, hq, d]
    LSE_ptr,  # float32 [b, hq, sq]
    SINK_ptr,  # float32 [hq] (with HAS_SINK)
    DELTA_ptr,  # float32 [b, hq, sq], written: rowsum(dO·O)
    DSINK_ptr,  # float32 [b, hq, sq], written with HAS_SINK: -P_sink·Delta per row
    DQACC_ptr,  # float32 [b, hq, sq, d], zeroed with ZERO_DQACC (the atomic dQ's accumulator)
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    n_heads, sq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINK: tl.constexpr,
    ZERO_DQACC: tl.constexpr,
):
    h, b, offs_m, offs_d, ok = _row_tile(sq, HEAD_DIM, BLOCK_D, BLOCK_M)
    o = tl.load(O_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=ok,
                other=0.0).to(tl.float32)
    do = tl.load(DO_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row = (b * n_heads + h) * sq + offs_m
    tl.store(DELTA_ptr + row, delta, mask=offs_m < sq)
    if ZERO_DQACC:
        tl.store(DQACC_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=ok)
    if HAS_SINK:
        lse = tl.load(LSE_ptr + row, mask=offs_m < sq, other=0.0)
        # a -inf sink (no sink) on a row that sees no key has LSE -inf too: its P_sink is 0, not
        # e^(-inf + inf) = NaN
        no_key = lse == float("-inf")
        p_sink = tl.where(no_key, 0.0, tl.exp(tl.load(SINK_ptr + h).to(tl.float32) - tl.where(no_key, 0.0, lse)))
        tl.store(DSINK_ptr + row, -p_sink * delta, mask=offs_m < sq)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, stride_qs, stride_dos, lse_base, delta_base, kmask,
                mask_base, stride_mq, stride_mk, seed, row0, n0, offs_n, offs_d, lo, hi, sq, band_lo, band_hi,
                qk_scale, T, keep_scale, dqacc_base, bh, b, h,
                QDO_TMA: tl.constexpr, EDGE: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
                MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Query tiles [lo, hi) of one head for the key tile offs_n: accumulate dK (unscaled) and
    dV. Computed transposed ([keys, queries]) so that no product needs a transposed result.
    Rows past sq contribute nothing: their q and dO load as 0, their LSE as +inf (P = 0).
    QDO_TMA: q_base and do_base are [b, sq, hq, d] descriptors, read at (b, start_m, h, 0) in
    [1, BLOCK_M, 1, d] boxes (rows past sq arrive as zeros)."""
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < sq
        if DROPOUT and ATOMIC_DQ:
            # the keep mask drawn here, first in the step, while the last step's dK and dV
            # products (asynchronous) are still running: the draw's integer work overlaps them.
            # Measured on an H200 (dropout 0.1, kernel alone, ms), drawn first against drawn
            # after dP's product (below): causal [4, 16, 2048, 128] 0.706 against 0.712,
            # [2, 16, 8192, 128] 4.466 against 4.530, causal [8, 12, 1024, 64] 0.215 against
            # 0.217. The deterministic form draws it after dP: drawn first, it took 0.869
            # against 0.847 ms at the first shape.
            keepT = tl.trans(_attention_keep_mask(seed, row0, start_m, n0, T, BLOCK_M, BLOCK_N))
        if QDO_TMA:
            qT = tl.trans(tl.reshape(q_base.load([b, start_m, h, 0]), [BLOCK_M, HEAD_DIM])).to(DOT)
        else:
            qT = tl.load(q_base + offs_m[None, :] * stride_qs + offs_d[:, None], mask=d_ok[:, None] & m_ok[None, :],
                         other=0.0).to(DOT)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # an empty row: P = 0
        sT = tl.dot(k, qT, input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        # every mask goes on the scores, before the exponential (as in the forward): P = 0
        # exactly, never 2^(s - LSE) of a key the row did not see, which overflows where that
        # score is far above the row's LSE (a padded key's s = 0 in a row of very negative
        # scores): its dK and dV rows are never stored, but the atomic dQ would sum inf·0 = NaN
        sT = tl.where(kmask[:, None] == 0, sT, float("-inf"))  # keys past sk; kind 1's masked keys
        if EDGE:
            rel = offs_n[:, None] - offs_m[None, :]  # j - i
            sT = tl.where((rel >= band_lo) & (rel <= band_hi), sT, float("-inf"))
        if MASK_KIND == 2:
            masked = tl.load(mask_base + offs_m[None, :] * stride_mq + offs_n[:, None] * stride_mk,
                             mask=m_ok[None, :] & (kmask == 0)[:, None], other=1)  # kmask: 1 past sk
            sT = tl.where(masked == 0, sT, float("-inf"))
        pT = tl.exp2(sT - lse[None, :])  # an empty row: -inf - inf = -inf, P = 0
        if QDO_TMA:
            do = tl.reshape(do_base.load([b, start_m, h, 0]), [BLOCK_M, HEAD_DIM])
        else:
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                         other=0.0)
        dpT = tl.dot(v, tl.trans(do.to(DOT)), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]: (dO·vᵀ)ᵀ
        if DROPOUT:  # dV takes the dropped P, dP the gradient through the dropout
            if not ATOMIC_DQ:
                keepT = tl.trans(_attention_keep_mask(seed, row0, start_m, n0, T, BLOCK_M, BLOCK_N))
            # the kept P, unscaled: dV takes 1/(1 - p') once, in float32, at the end (the caller),
            # so no P·scale is rounded to 16 bits (float16 overflows at P·65536 for p' = 1 - 2^-16)
            pdT = tl.where(keepT, pT, 0.0)
            dpT = tl.where(keepT, dpT * keep_scale, 0.0)
            dv = tl.dot(pdT.to(do.dtype).to(DOT), do.to(DOT), dv, input_precision=PRECISION)
        else:
            dv = tl.dot(pT.to(do.dtype).to(DOT), do.to(DOT), dv, input_precision=PRECISION)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        dsT = (pT * (dpT - delta[None, :])).to(do.dtype).to(DOT)
        dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=PRECISION)
        if ATOMIC_DQ:  # this tile's share of dQ (unscaled), added into the float32 accumulator
            dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            if DQ_TMA:  # one bulk reduction of the tile (rows past sq clipped by the descriptor)
                dqacc_base.atomic_add([bh, start_m, 0], tl.reshape(dq, [1, BLOCK_M, HEAD_DIM]))
            else:
                tl.atomic_add(dqacc_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq,
                              mask=m_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T"])
def _flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr,
    LSE_ptr, DELTA_ptr,  # float32 [b, hq, sq]
    DK_ptr, DV_ptr,  # k's and v's shape and dtype, written
    DQACC_ptr,  # float32 [b, hq, sq, d], zeroed, accumulated with ATOMIC_DQ (dQ before its scale)
    MASK_ptr, SEED_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    n_heads, group, sq, sk,
    sm_scale,  # softmax_scale (dK = scale·dSᵀ·q)
    qk_scale, band_lo, band_hi, T, keep_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,  # also dQ, by atomic adds (not bitwise reproducible)
    DQ_TMA: tl.constexpr = False,  # DQACC_ptr is a [b·hq, sq, d] tensor descriptor: bulk reductions
    QDO_TMA: tl.constexpr = False,  # Q_ptr and DO_ptr are [b, sq, hq, d] tensor descriptors: TMA tile loads
    GROUP_HEADS: tl.constexpr = 1,  # the programs' order (_scheduled_tile)
    REVERSE_BLOCKS: tl.constexpr = False,
):
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)
    keep_scale = tl.cast(keep_scale, tl.float32)
    pid_n, hk, b = _scheduled_tile(GROUP_HEADS, REVERSE_BLOCKS)
    b64 = b.to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < sk
    d_ok = offs_d < HEAD_DIM
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K_ptr + b64 * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=kv_ok, other=0.0).to(DOT)
    v = tl.load(V_ptr + b64 * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=kv_ok, other=0.0).to(DOT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED_ptr)

    # query tiles of rows that see a key of this tile: i in [n0 - band_hi, n_last - band_lo]; with
    # the roles of rows and keys swapped, _tile_ranges gives them (a tile [i, i + BLOCK_M) needs
    # no mask iff i >= n_last - band_hi and i + BLOCK_M <= n0 - band_lo + 1 and <= sq)
    n_last = tl.minimum(n0 + BLOCK_N, sk) - 1
    lo, a, bb, hi = _tile_ranges(n0, n_last, -band_hi, -band_lo, sq, BLOCK_M)
    for g in range(0, group):  # every query head of this key/value head: the GQA sum in registers
        h = hk * group + g
        if QDO_TMA:  # descriptors: the tile loads index (b, query, h, 0)
            q_base = Q_ptr
            do_base = DO_ptr
        else:
            q_base = Q_ptr + b64 * stride_qb + h.to(tl.int64) * stride_qh
            do_base = DO_ptr + b64 * stride_dob + h.to(tl.int64) * stride_doh
        lse_base = LSE_ptr + (b64 * n_heads + h) * sq
        delta_base = DELTA_ptr + (b64 * n_heads + h) * sq
        mask_base = MASK_ptr + b64 * stride_mb + h.to(tl.int64) * stride_mh
        row0 = (b64 * n_heads + h) * sq
        if DQ_TMA:
            dqacc_base = DQACC_ptr
        else:
            dqacc_base = DQACC_ptr + row0 * HEAD_DIM  # float32 [b, hq, sq, d] (with ATOMIC_DQ)
        bh = b * n_heads + h
        kmask = tl.where(n_ok, 0, 1).to(tl.int8)  # 1 = masked: the keys past sk
        if MASK_KIND == 1:  # the same for every query: read once per head
            kmask = tl.load(mask_base + offs_n * stride_mk, mask=n_ok, other=1).to(tl.int8)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, stride_qs, stride_dos, lse_base, delta_base, kmask,
                             mask_base, stride_mq, stride_mk, seed, row0, n0, offs_n, offs_d, lo, a, sq, band_lo,
                             band_hi, qk_scale, T, keep_scale, dqacc_base, bh, b, h, QDO_TMA, True, ATOMIC_DQ, DQ_TMA,
                             MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, stride_qs, stride_dos, lse_base, delta_base, kmask,
                             mask_base, stride_mq, stride_mk, seed, row0, n0, offs_n, offs_d, a, bb, sq, band_lo,
                             band_hi, qk_scale, T, keep_scale, dqacc_base, bh, b, h, QDO_TMA, False, ATOMIC_DQ, DQ_TMA,
                             MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, stride_qs, stride_dos, lse_base, delta_base, kmask,
                             mask_base, stride_mq, stride_mk, seed, row0, n0, offs_n, offs_d, bb, hi, sq, band_lo,
                             band_hi, qk_scale, T, keep_scale, dqacc_base, bh, b, h, QDO_TMA, True, ATOMIC_DQ, DQ_TMA,
                             MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
    dk = dk * sm_scale
    tl.store(DK_ptr + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dks
             + offs_d[None, :], dk.to(DK_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(DV_ptr + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvs
             + offs_d[None, :], (dv * keep_scale).to(DV_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq, stride_mk,
              seed, row0, m0, offs_m, offs_d, m_ok, lo, hi, sk, band_lo, band_hi, qk_scale, T, keep_scale, b, hk,
              KV_TMA: tl.constexpr, EDGE: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
              PRECISION: tl.constexpr):
    """Key tiles [lo, hi) for the query tile offs_m: accumulate dQ (unscaled). KV_TMA: as
    :func:`_fwd_tiles`."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < sk
        if EDGE:
            ld = d_ok[:, None] & n_ok[None, :]
        else:
            ld = d_ok[:, None]
        if KV_TMA:
            kT = tl.trans(tl.reshape(k_base.load([b, start_n, hk, 0]), [BLOCK_N, HEAD_DIM]))
            vT = tl.trans(tl.reshape(v_base.load([b, start_n, hk, 0]), [BLOCK_N, HEAD_DIM]))
        else:
            kT = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=ld, other=0.0)
            vT = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None], mask=ld, other=0.0)
        s = tl.dot(q, kT.to(DOT), input_precision=PRECISION) * qk_scale
        if EDGE:  # the masks on the scores, before the exponential (see _dkdv_tiles)
            rel = offs_n[None, :] - offs_m[:, None]
            s = tl.where((rel >= band_lo) & (rel <= band_hi) & n_ok[None, :], s, float("-inf"))
        if MASK_KIND == 1:
            masked = tl.load(mask_base + offs_n * stride_mk, mask=n_ok, other=1)
            s = tl.where(masked[None, :] == 0, s, float("-inf"))
        if MASK_KIND == 2:
            masked = tl.load(mask_base + offs_m[:, None] * stride_mq + offs_n[None, :] * stride_mk,
                             mask=m_ok[:, None] & n_ok[None, :], other=1)
            s = tl.where(masked == 0, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, vT.to(DOT), input_precision=PRECISION)
        if DROPOUT:
            keep = _attention_keep_mask(seed, row0, m0, start_n, T, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype).to(DOT), tl.trans(kT.to(DOT)), dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["T"])
def _flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr,
    O_ptr,  # o [b, sq, hq, d] (read with DELTA_IN_DQ)
    LSE_ptr,
    DELTA_ptr,  # float32 [b, hq, sq]: read, or written with DELTA_IN_DQ
    DQ_ptr,  # q's shape and dtype, written
    MASK_ptr, SEED_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_ob, stride_os, stride_oh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    n_heads, group, sq, sk,
    sm_scale, qk_scale, band_lo, band_hi, T, keep_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    KV_TMA: tl.constexpr = False,  # K_ptr and V_ptr are [b, sk, hkv, d] tensor descriptors: TMA tile loads
    GROUP_HEADS: tl.constexpr = 1,  # the programs' order (_scheduled_tile)
    REVERSE_BLOCKS: tl.constexpr = False,
    DELTA_IN_DQ: tl.constexpr = False,  # Delta = rowsum(dO·O) computed here and stored for the dK/dV kernel
):
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)
    keep_scale = tl.cast(keep_scale, tl.float32)
    pid_m, h, b = _scheduled_tile(GROUP_HEADS, REVERSE_BLOCKS)
    hk = h // group
    b64 = b.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < sq
    ld = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q_ptr + b64 * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=ld, other=0.0).to(DOT)
    do = tl.load(DO_ptr + b64 * stride_dob + h.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :], mask=ld, other=0.0)
    row0 = (b64 * n_heads + h) * sq  # the dropout mask's first row
    rows = row0 + offs_m
    lse = tl.load(LSE_ptr + rows, mask=m_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # an empty row: P = 0
    if DELTA_IN_DQ:  # the preprocess's sum for this program's rows, from the dO tile loaded anyway
        o = tl.load(O_ptr + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_os
                    + offs_d[None, :], mask=ld, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA_ptr + rows, delta, mask=m_ok)
    else:
        delta = tl.load(DELTA_ptr + rows, mask=m_ok, other=0.0)
    do = do.to(DOT)
    if KV_TMA:
        k_base = K_ptr
        v_base = V_ptr
    else:
        k_base = K_ptr + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V_ptr + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = MASK_ptr + b64 * stride_mb + h.to(tl.int64) * stride_mh
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED_ptr)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_last = tl.minimum(m0 + BLOCK_M, sq) - 1
    lo, a, bb, hi = _tile_ranges(m0, m_last, band_lo, band_hi, sk, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq, stride_mk,
                   seed, row0, m0, offs_m, offs_d, m_ok, lo, a, sk, band_lo, band_hi, qk_scale, T, keep_scale,
                   b, hk, KV_TMA, True, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq, stride_mk,
                   seed, row0, m0, offs_m, offs_d, m_ok, a, bb, sk, band_lo, band_hi, qk_scale, T, keep_scale,
                   b, hk, KV_TMA, False, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, mask_base, stride_mq, stride_mk,
                   seed, row0, m0, offs_m, offs_d, m_ok, bb, hi, sk, band_lo, band_hi, qk_scale, T, keep_scale,
                   b, hk, KV_TMA, True, MASK_KIND, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT, PRECISION)
    dq = dq * sm_scale
    tl.store(DQ_ptr + b64 * stride_dqb + h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ_ptr.dtype.element_ty), mask=ld)


@triton.jit
def _flash_bwd_dq_convert_kernel(
    DQACC_ptr,  # float32 [b, hq, sq, d] contiguous: dQ before its scale
    DQ_ptr,  # q's shape and dtype, written: dQ = softmax_scale·acc
    stride_dqb, stride_dqs, stride_dqh,
    n_heads, sq, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    sm_scale = tl.cast(sm_scale, tl.float32)
    h, b, offs_m, offs_d, ok = _row_tile(sq, HEAD_DIM, BLOCK_D, BLOCK_M)
    row = (b * n_heads + h) * sq + offs_m
    acc = tl.load(DQACC_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
    tl.store(DQ_ptr + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (acc * sm_scale).to(DQ_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Host launchers (no autograd, no user-input checks: fusedlib.fusions.fused_attention does those)
# ---------------------------------------------------------------------------------------------

def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _mask_strides(mask: Optional[torch.Tensor], shape: tuple[int, int, int, int]
                  ) -> tuple[tuple[int, int, int, int], int]:
    """(the mask's four strides as [b, hq, sq, sk], MASK_KIND).

    ``mask``: bool [b, sk] (key padding) or 4-D, broadcastable to ``shape``: the strides of its
    expansion to ``shape`` (zero strides, no copy), through which the kernels read it from its
    own address (:func:`_mask_bytes`). Kind 1 when it does not vary along the queries, 2 when it
    does, 0 without a mask (strides 0)."""
    if mask is None:
        return (0, 0, 0, 0), 0
    B, H, SQ, SK = shape
    m4 = mask[:, None, None, :] if mask.dim() == 2 else mask  # [b, sk] -> [b, 1, 1, sk] (a view)
    strides = m4.expand(B, H, SQ, SK).stride()
    return strides, (1 if (strides[2] == 0 or SQ == 1) else 2)


def _mask_bytes(mask: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """A bool mask as the kernels read it: its bytes (``view(torch.uint8)``: the same memory and
    strides), or the bool tensor itself inside a ``torch.compile`` trace; ``dummy`` (a pointer
    the kernels never read) for None. The kernels take its address and the strides of its
    expansion (:func:`_mask_strides`)."""
    if mask is None:
        return dummy
    return mask if torch.compiler.is_compiling() else mask.view(torch.uint8)


def _dropout_args(seed: Optional[torch.Tensor], dropout_p: float, device: torch.device) -> tuple[int, float]:
    """(T, 1/(1 - p')) for the kernels; (0, 1.0) without a seed (no dropout, whatever
    ``dropout_p`` says: the op passes none where nothing is drawn, e.g. for an empty input).

    Raises:
        ValueError: with a seed, ``dropout_p`` not a number in [0, 1) whose p' = round(p·2^16)/2^16
            is below 1 (every element dropped is the op's to handle), or ``seed`` not an int64
            tensor of one element on ``device``.
    """
    if seed is None:
        return 0, 1.0
    if not isinstance(seed, torch.Tensor):
        raise ValueError(f"seed must be an int64 tensor of one element on {device} (philox_seed), "
                         f"got {type(seed).__name__}")
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != device:
        raise ValueError(f"seed must be an int64 tensor of one element on {device} (philox_seed), "
                         f"got {seed.dtype} of shape {tuple(seed.shape)} on {seed.device}")
    if not (isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool) and 0.0 <= dropout_p < 1.0
            and drop_threshold(dropout_p) < 1 << KEEP_BITS):
        raise ValueError(f"dropout_p must be in [0, 1) with p' = round(p·2^16)/2^16 < 1 when a seed is given, "
                         f"got {dropout_p!r}")
    return drop_threshold(dropout_p), dropout_scale(dropout_p)


def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    band: tuple[int, int],
    mask: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    seed: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    tile: Optional[Tile] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Through a launch plan per input signature (:class:`~fusedlib.runtime.LaunchPlan`): the tile,
    grid, constexprs, the mask's strides, the dropout threshold, the TMA boxes and every int
    argument are worked out on the first call with a signature (:func:`_fwd_key`), and a later
    call builds the key, allocates its outputs and launches. The plan keeps the module settings it
    read (the tile tables, :data:`LOADS_BY_TMA`, ...): ``fusedlib.runtime.clear_plans()`` after
    changing one.

    Args:
        q: [b, sq, hq, d], float16/bfloat16/float32, unit last stride (any other strides).
        k, v: [b, sk, hkv, d], q's dtype and device, unit last stride; hq % hkv == 0.
        softmax_scale: multiplies q·kᵀ.
        band: ``(band_lo, band_hi)`` from :func:`attention_band`.
        mask: bool, True = masked: [b, sk] (key padding) or 4-D broadcastable to
            [b, hq, sq, sk]; read through its strides, never copied. None: no mask.
        sinks: float32 [hq] contiguous sink logits, or None.
        seed: int64 [1] Philox key (dropout on), or None.
        dropout_p: the dropout probability (with ``seed``).
        tile: launch settings (None: :data:`FWD_TILES` by head dim, :data:`FWD_DROPOUT_TILES`
            with ``seed``).

    Returns:
        ``(o, lse)``: o like ``q`` (``torch.empty_like``: q's strides where q is dense), lse
        float32 [b, hq, sq] contiguous (natural log; -inf for a row that saw nothing).

    Raises:
        ValueError: with ``seed``, ``dropout_p`` outside [0, 1) or rounding to p' = 1, or
            ``seed`` not an int64 tensor of one element on q's device. The other arguments are
            the op's to check (:func:`~fusedlib.fusions.fused_attention.flash_attention`).

    Source: Dao, "FlashAttention-2" (2023), Algorithm 1; Triton's fused-attention tutorial
    (``python/tutorials/06-fused-attention.py``).
    """
    B, SQ, HQ, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, HQ, SQ), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        if lse.numel():  # (rows but no head dim: the op refuses d = 0; lse would be unwritten memory)
            raise ValueError(f"flash_attn_fwd: the head dim (q's last dim) must be >= 1, got {D}")
        return o, lse
    key, p = find_plan(_FWD_PLANS, _fwd_key, q, k, v, mask, sinks, seed, dropout_p, band, tile)
    if p is None:
        p = remember_plan(_FWD_PLANS, key, _fwd_plan(q, k, v, o, mask, sinks, seed, dropout_p, band, tile))
    ka, va = _descs(k, v, p.kv_boxes)
    launch_planned(_flash_fwd_kernel, p.launch, q.device,
                   q, ka, va, o, lse, _mask_bytes(mask, q), lse if sinks is None else sinks,
                   lse if seed is None else seed, *p.ints, float(softmax_scale) * LOG2E, *p.tail)
    return o, lse


class _FwdPlan(NamedTuple):
    """:func:`flash_attn_fwd`'s launch for one input signature: the kernel's launch, its int
    arguments before the scale (strides, heads, lengths) and after it (the band, the dropout
    threshold and scale), and k's and v's TMA descriptor boxes (``(shape, strides, box)`` each,
    :func:`_desc_box`) or None (pointer loads)."""

    launch: Planned
    ints: tuple
    tail: tuple
    kv_boxes: Optional[tuple]


# flash_attn_fwd's and flash_attn_bwd's plans by input signature (fusedlib.runtime.remember_plan)
_FWD_PLANS: dict = plan_cache()
_BWD_PLANS: dict = plan_cache()


def _fwd_key(q, k, v, mask, sinks, seed, dropout_p, band, tile) -> tuple:
    """:func:`flash_attn_fwd`'s plan key: q's, k's and v's signatures, q's device, the mask's
    (its strides decide the kernel's), the sinks' and the seed's (the seed's check reads its
    dtype, shape and device), the dropout probability's type and value where a seed is given (a
    value equal to an accepted one but of another type, ``False`` for 0.0, gets its own plan and so
    its own check), the band (ints the kernel specializes) and the tile. The scale is a float
    argument of every call."""
    return (tensor_key(q), tensor_key(k), tensor_key(v), q.device, None if mask is None else tensor_key(mask),
            spec_key(sinks), None if seed is None else (param_key(seed), dropout_p.__class__, dropout_p), band, tile)


def _fwd_plan(q, k, v, o, mask, sinks, seed, dropout_p, band, tile) -> _FwdPlan:
    B, SQ, HQ, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    if tile is None:
        tile = _float32_tile(attention_tile(FWD_TILES if seed is None else FWD_DROPOUT_TILES, D), q.dtype)
    ms, kind = _mask_strides(mask, (B, HQ, SQ, SK))
    T, keep_scale = _dropout_args(seed, dropout_p, q.device)
    dot, precision = dot_settings(q.dtype, INTERPRET_ON_CPU)
    boxes = _desc_boxes(k, v, tile.BLOCK_N) if tma_loads(q, D, "forward" if seed is None else "forward_dropout") else None
    group_heads, reverse = program_order(band, SQ, SK, D, False)
    fwd = planned(_flash_fwd_kernel, (cdiv(SQ, tile.BLOCK_M), HQ, B), q.device, dict(
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, MASK_KIND=kind,
        HAS_SINK=sinks is not None, DROPOUT=seed is not None, DOT=dot, PRECISION=precision,
        KV_TMA=boxes is not None, GROUP_HEADS=group_heads, REVERSE_BLOCKS=reverse,
        num_warps=tile.num_warps, num_stages=tile.num_stages))
    ints = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *ms, HQ, HQ // HKV, SQ, SK)
    return _FwdPlan(fwd, ints, (band[0], band[1], T, keep_scale), boxes)


#: The attribute :func:`packed_grads` sets on the buffer it allocates (the gradients' ``_base``).
PACKED_GRADS_ATTR: str = "_fusedlib_packed_grads"


def packed_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Gradient buffers for q, k, v that are views of one fresh buffer laid out as their base,
    when q, k and v are split views of one contiguous base that tile it exactly once, in one
    of the two layouts below; else None.

    The case it finds is the fused QKV projection's: one GEMM output [.., 3·h·d] (or
    Megatron-core's [.., h, 3, d] per-head order, or [.., 3, h, d]) split into q, k and v. Written
    into such a buffer, the three gradients are the base's gradient without the copy that
    ``torch.cat`` (the split's backward) would make; :class:`fusedlib.transformer.attention`'s
    split takes the buffer whole. Checked (cheaply, from shapes, strides and offsets): the same
    base, shapes and strides; rows (the b and s dims) dense at 3·h·d elements each; inside a
    row the three views at offsets {0, d, 2d} with head stride 3d, or {0, h·d, 2·h·d} with
    head stride d, all in the base's dtype. Anything else gives None: GQA, overlapping or
    foreign views, a traced call, and q or k made new by rotary embeddings or a query/key norm
    (the packed path serves models without them, e.g. learned positions),
    and so do q, k, v saved by a non-reentrant activation checkpoint, which come back from the
    recomputation without their base. The buffer is marked (attribute
    ``PACKED_GRADS_ATTR``): the split's backward takes only such a fresh buffer whole, never a
    tensor that a caller also holds.

    Args:
        q, k, v: [b, s, h, d] views (the backward's saved inputs).

    Returns:
        ``(dq, dk, dv)``: uninitialised views with q's, k's and v's strides, or None.

    Source: the layout is Megatron-core's fused QKV projection
    (``megatron/core/transformer/attention.py``, ``get_query_key_value_tensors``); the copy it
    saves is the split's backward concatenation (PyTorch ``split_with_sizes_backward``).
    """
    base = q._base
    if (base is None or k._base is not base or v._base is not base or torch.compiler.is_compiling()
            or q.shape != k.shape or k.shape != v.shape or q.stride() != k.stride() or k.stride() != v.stride()
            or q.dtype != base.dtype or not base.is_contiguous() or 3 * q.numel() != base.numel()
            or q.numel() == 0 or q.stride(3) != 1):
        return None
    B, S, H, D = q.shape
    sb, ss, sh, _ = q.stride()
    row = 3 * H * D
    expect = row  # the b and s dims enumerate rows of 3·h·d elements densely, in either order
    for size, stride in sorted(((B, sb), (S, ss)), key=lambda t: t[1]):
        if size > 1:
            if stride != expect:
                return None
            expect *= size
    base_off = base.storage_offset()
    offs = sorted(t.storage_offset() - base_off for t in (q, k, v))
    if not ((H == 1 or sh == 3 * D) and offs == [0, D, 2 * D]) and not ((H == 1 or sh == D) and offs == [0, H * D, 2 * H * D]):
        return None
    buf = torch.empty_like(base, memory_format=torch.contiguous_format)
    setattr(buf, PACKED_GRADS_ATTR, True)
    return tuple(buf.as_strided(t.shape, t.stride(), t.storage_offset() - base_off) for t in (q, k, v))


#: Whether the atomic dQ adds each [BLOCK_M, d] tile with one TMA bulk reduction
#: (``cp.reduce.async.bulk.tensor``: the tile goes through shared memory and the copy engine
#: adds it into global memory) instead of one float32 atomic per element, where
#: :func:`dq_by_tma` allows. Measured on the H200 (bf16, whole backward, kernel only, ms,
#: NOTES.md), element atomics against the bulk reduction at the same [64, 128] tile, 8 warps,
#: 3 stages: causal [4, 16, 2048, 128] 0.669 / 0.612, non-causal 1.026 / 0.953, causal
#: [2, 16, 8192, 128] 3.955 / 3.626. Tests set it False to run the element atomics on a GPU
#: (the launchers' plans keep it: ``fusedlib.runtime.clear_plans()`` after a change).
DQ_BY_TMA: bool = True

_CAPABILITY: dict[int, tuple[int, int]] = {}


def dq_by_tma(q: torch.Tensor, head_dim: int) -> bool:
    """Whether the atomic dQ of a backward on ``q`` ([b, sq, hq, d]) takes TMA bulk
    reductions (:data:`DQ_BY_TMA`): on a CUDA GPU of compute capability 9.0 or newer (the
    Hopper tensor-memory accelerator), with kernels compiled (not Triton's interpreter, which
    has no bulk reduction), outside a ``torch.compile`` trace (Inductor's Triton wrapper is
    given plain pointers), for a head dim that is a power of two of at least 16 (the tile's
    width, so every row of the [b·hq, sq, d] accumulator is 16-byte aligned and the
    descriptor's box matches the tile), with a Triton whose tensor descriptors have
    ``atomic_add``.

    Source: Shah et al., "FlashAttention-3" (2024), Sec. 3.1 (dQ added by TMA bulk reductions).
    """
    return DQ_BY_TMA and _TensorDescriptor is not None and _tma_usable(q, head_dim)


def _tma_usable(q: torch.Tensor, head_dim: int) -> bool:
    """What every TMA path asks (:func:`dq_by_tma`, :func:`tma_loads`): q on a CUDA GPU of
    compute capability 9.0 or newer (cached per device), kernels compiled (not Triton's
    interpreter), outside a ``torch.compile`` trace, a head dim that is a power of two of at
    least 16 (the tile's width: a box covers the whole head)."""
    if INTERPRET_ON_CPU or q.device.type != "cuda":
        return False
    if head_dim != _block_d(head_dim) or torch.compiler.is_compiling():
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap[0] >= 9


#: Whether the kernels read the tiles they stream (the forward's and the dQ kernel's K and V
#: tiles, the dK/dV kernel's q and dO tiles) with TMA tile loads where :func:`tma_loads`
#: allows, instead of a masked pointer load per element. The copy engine fills shared memory
#: from a descriptor while the warps compute: the forward's loop, whose pointer loads Triton
#: 3.6 compiles for sm_90 without cp.async (each tile waited for), is then pipelined over its
#: stages, and it keeps no addresses in registers (compiled for sm_90: no spill, 79 local
#: memory instructions with pointer loads). Tests set it False to run the pointer loads on a GPU
#: (the launchers' plans keep it, and :data:`TMA_LOADS`: ``fusedlib.runtime.clear_plans()`` after
#: a change of either).
LOADS_BY_TMA: bool = True

#: Where the kernels take the TMA loads: for each form of launch, the head dims at which they
#: measured faster on the H200 (``python tools/attention_loads.py``, stored as
#: ``chapters/data/bench/attention_loads.json``; bf16, kernel only, CUDA-graph replays, ms,
#: pointer / TMA loads at causal [4, 16, 2048, 128]): the forward without dropout (0.181 /
#: 0.171), the deterministic backward (0.609 / 0.597; with dropout 0.875 / 0.849), at d = 128,
#: faster at every d = 128 case. Slower, so left on pointer loads: the forward with dropout
#: (0.326 / 0.339), the backward with atomic dQ (0.567 / 0.717: compiled for sm_90 its q and dO
#: stages take 210 KB of shared memory instead of 129) and four forms of five at d = 64 (the
#: fifth, the atomic backward with dropout, 1 % faster by TMA at the one d = 64 case, 0.515 /
#: 0.509, is not taken). d = 256: not measured.
TMA_LOADS: dict[str, tuple[int, ...]] = {
    "forward": (128,),  # without dropout
    "forward_dropout": (),
    "backward": (128,),  # the deterministic kernels (dK/dV, then dQ), without dropout
    "backward_dropout": (128,),  # the deterministic kernels with dropout
    "backward_atomic": (),  # dK/dV with atomic dQ, with or without dropout
}


def tma_loads(q: torch.Tensor, head_dim: int, form: str) -> bool:
    """Whether the kernels of ``form`` (a key of :data:`TMA_LOADS`) on ``q`` ([b, sq, hq, d])
    may read their streamed tiles by TMA (:data:`LOADS_BY_TMA`): on a CUDA GPU of compute
    capability 9.0 or newer, kernels compiled (not Triton's interpreter), outside a
    ``torch.compile`` trace (Inductor's Triton wrapper passes plain pointers), at a head dim
    :data:`TMA_LOADS` lists for the form (powers of two: the box is the whole head), with a
    Triton that has host-side tensor descriptors. The tensors themselves are not looked at
    here: the launchers then pass descriptors only for a pair the copy engine can address
    (:func:`_desc_boxes`), and the kernel's flag follows what they passed.

    Raises:
        ValueError: ``form`` not a key of :data:`TMA_LOADS`.

    Source: fusedlib's own switch (Hopper's tensor-memory accelerator through Triton's tensor
    descriptors).
    """
    if form not in TMA_LOADS:
        raise ValueError(f"form must be one of {sorted(TMA_LOADS)}, got {form!r}")
    return LOADS_BY_TMA and _HostDescriptor is not None and head_dim in TMA_LOADS[form] and _tma_usable(q, head_dim)


def _desc_box(t: torch.Tensor, rows: int) -> Optional[tuple[list, list, list]]:
    """``(shape, strides, box)`` of t ([b, s, h, d], unit last stride) as a TMA descriptor of
    [1, rows, 1, d] boxes (rows past s read as zeros), or None where the copy engine cannot
    address it: a base address or a stride (of a dim longer than 1) that is not a multiple of 16
    bytes, a zero stride, a last stride other than 1, or no elements. A dim of length 1 is only
    ever read at index 0: its stride is given as 16 bytes. What it reads (shape, strides,
    ``data_ptr() % 16``, dtype) is part of every plan key, so a plan keeps the boxes."""
    if t.data_ptr() % 16 or t.numel() == 0 or t.stride(3) != 1:
        return None
    es = t.element_size()
    strides = list(t.stride())
    for i in range(3):
        if t.shape[i] == 1:
            strides[i] = 16 // es
        elif strides[i] == 0 or (strides[i] * es) % 16:
            return None
    return list(t.shape), strides, [1, rows, 1, t.shape[3]]


def _desc_boxes(a: torch.Tensor, b: torch.Tensor, rows: int) -> Optional[tuple]:
    """(a's box, b's box) (:func:`_desc_box`) when both can be described, else None: the kernel
    takes both or neither."""
    da = _desc_box(a, rows)
    db = _desc_box(b, rows) if da is not None else None
    return (da, db) if db is not None else None


def _descs(a: torch.Tensor, b: torch.Tensor, boxes: Optional[tuple]) -> tuple:
    """(a, b) as TMA descriptors of the plan's ``boxes`` (:func:`_desc_boxes`), or (a, b)
    themselves for None (pointer loads)."""
    return (a, b) if boxes is None else (_HostDescriptor(a, *boxes[0]), _HostDescriptor(b, *boxes[1]))


def flash_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    band: tuple[int, int],
    mask: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    seed: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    tile: Optional[Tile] = None,
    dq_tile: Optional[Tile] = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward: preprocess, dK/dV, dQ (three kernels, no atomics; without sinks,
    where :func:`delta_in_dq_kernel` says so, two, the dQ kernel first computing Delta); or, with
    ``deterministic=False`` where :func:`use_atomic_dq` says so, preprocess (which also zeroes
    a float32 [b, hq, sq, d] dQ accumulator), dK/dV adding dQ by atomics, and a kernel that
    scales and casts the accumulator into dq. Planned per input signature as
    :func:`flash_attn_fwd` (:func:`_bwd_key`).

    Args:
        do: the gradient of o, o's shape and dtype, unit last stride; read, never written.
        q, k, v, mask, sinks, seed, dropout_p, softmax_scale, band: the forward's.
        o, lse: the forward's outputs.
        tile: the dK/dV kernel's tile (None: :data:`BWD_DKDV_TILES`): BLOCK_N keys per
            program, BLOCK_M queries per step.
        dq_tile: the dQ kernel's (None: :data:`BWD_DQ_TILES`): BLOCK_M queries per program,
            BLOCK_N keys per step.
        deterministic: True: bitwise reproducible, every sum in a fixed order. False: dQ may
            be summed by float32 atomic adds in an order that varies from run to run (dK, dV
            and dsink stay reproducible); ``tile`` is then the atomic kernel's (None:
            :data:`BWD_ATOMIC_TILES`) where the atomic path is taken.

    Returns:
        ``(dq, dk, dv, dsink)``: like q, k, v (``torch.empty_like``), or, where q, k and v
        are the three views of one packed QKV tensor, views of one buffer laid out as it
        (:func:`packed_grads`); dsink float32 [hq] when ``sinks`` is given, else None.

    Raises:
        ValueError: as :func:`flash_attn_fwd` for ``seed`` and ``dropout_p``.

    Source: Dao, "FlashAttention-2" (2023), Algorithm 2; Triton's fused-attention tutorial
    (``python/tutorials/06-fused-attention.py``).
    """
    B, SQ, HQ, D = q.shape
    grads = packed_grads(q, k, v)
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    dsink = None
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        if sinks is not None:
            dsink = torch.zeros((HQ,), dtype=torch.float32, device=q.device)
        return dq, dk, dv, dsink
    key, p = find_plan(_BWD_PLANS, _bwd_key, do, q, k, v, o, lse, dq, dk, dv, mask, sinks, seed, dropout_p, band,
                       tile, dq_tile, deterministic)
    if p is None:
        p = remember_plan(_BWD_PLANS, key, _bwd_plan(do, q, k, v, o, dq, dk, dv, mask, sinks, seed, dropout_p, band,
                                                     tile, dq_tile, deterministic))
    device = q.device
    delta = torch.empty((B, HQ, SQ), dtype=torch.float32, device=device)
    m4 = _mask_bytes(mask, q)
    seed_arg = lse if seed is None else seed
    softmax_scale = float(softmax_scale)  # passed as given, an int 1 would be a constant to Triton
    scales = (softmax_scale, softmax_scale * LOG2E)
    # the atomic dQ's float32 accumulator (a placeholder argument otherwise), or the dQ kernel's arguments
    dq_acc = torch.empty((B, HQ, SQ, D), dtype=torch.float32, device=device) if p.atomic else delta
    dq_args = None if p.atomic else (q, *_descs(k, v, p.kv_boxes), do, o, lse, delta, dq, m4, seed_arg,
                                     *p.last_ints, *scales, *p.tail)
    if p.pre is None:  # the dQ kernel first: it writes Delta, which the dK/dV kernel then reads
        launch_planned(_flash_bwd_dq_kernel, p.last, device, *dq_args)
    else:
        dsink_rows = torch.empty((B, HQ, SQ), dtype=torch.float32, device=device) if sinks is not None else None
        launch_planned(_flash_bwd_preprocess_kernel, p.pre, device,
                       o, do, lse, lse if sinks is None else sinks, delta, delta if dsink_rows is None else dsink_rows,
                       dq_acc, *p.pre_ints)
        if dsink_rows is not None:
            dsink = dsink_rows.sum(dim=(0, 2))
    # the accumulator as [b·hq, sq, d] rows for the bulk reductions: a tile's rows past sq are
    # outside the descriptor's bounds, so the copy engine drops them
    dq_arg = dq_acc if p.dq_box is None else _TensorDescriptor(dq_acc, *p.dq_box)
    qa, doa = _descs(q, do, p.qdo_boxes)
    launch_planned(_flash_bwd_dkdv_kernel, p.main, device,
                   qa, k, v, doa, lse, delta, dk, dv, dq_arg, m4, seed_arg, *p.main_ints, *scales, *p.tail)
    if p.atomic:
        launch_planned(_flash_bwd_dq_convert_kernel, p.last, device, dq_acc, dq, *p.last_ints, softmax_scale)
    elif p.pre is not None:  # Delta from the preprocess kernel: the dQ kernel last
        launch_planned(_flash_bwd_dq_kernel, p.last, device, *dq_args)
    return dq, dk, dv, dsink


class _BwdPlan(NamedTuple):
    """:func:`flash_attn_bwd`'s launches for one input signature: the preprocess, the dK/dV
    kernel and the last one (the dQ kernel, or with ``atomic`` the accumulator's conversion), each
    with its int arguments (``*_ints``: strides, heads, lengths; ``tail``: the band and the
    dropout threshold and scale, after the two scales), and the TMA boxes (:func:`_desc_box`)
    of the dQ accumulator, of q and dO, and of k and v for the dQ kernel (None: not by TMA)."""

    atomic: bool
    pre: Optional[Planned]  # None: the dQ kernel computes Delta and runs first (delta_in_dq)
    pre_ints: tuple
    main: Planned
    main_ints: tuple
    last: Planned
    last_ints: tuple
    tail: tuple
    dq_box: Optional[tuple]
    qdo_boxes: Optional[tuple]
    kv_boxes: Optional[tuple]


def _bwd_key(do, q, k, v, o, lse, dq, dk, dv, mask, sinks, seed, dropout_p, band, tile, dq_tile,
             deterministic) -> tuple:
    """:func:`flash_attn_bwd`'s plan key: :func:`_fwd_key`'s items, dO's, o's and the three
    gradient buffers' signatures (their strides and alignment: :func:`packed_grads`'s views or
    new tensors), the LSE's dtype and alignment (a pointer argument, and the placeholder for
    absent sinks), the two tiles and ``deterministic``."""
    return (*_fwd_key(q, k, v, mask, sinks, seed, dropout_p, band, tile), tensor_key(do), tensor_key(o),
            tensor_key(dq), tensor_key(dk), tensor_key(dv), spec_key(lse), dq_tile, deterministic)


def _bwd_plan(do, q, k, v, o, dq, dk, dv, mask, sinks, seed, dropout_p, band, tile, dq_tile,
              deterministic) -> _BwdPlan:
    B, SQ, HQ, D = q.shape
    SK, HKV = k.shape[1], k.shape[2]
    device = q.device
    block_d = _block_d(D)
    # each kernel's strides, read once
    q_s, k_s, v_s, do_s = q.stride()[:3], k.stride()[:3], v.stride()[:3], do.stride()[:3]
    pre_m = 64 if block_d <= 128 else 32  # rows per program: [64, 128] float32 products, 32 per thread at 8 warps
    if INTERPRET_ON_CPU:
        pre_m = max(pre_m, min(256, next_power_of_2(SQ)))
    atomic = not deterministic and use_atomic_dq(D, seed is not None)
    delta_in_dq = not atomic and sinks is None and delta_in_dq_kernel(D, seed is not None)
    pre_warps = 8 if block_d > 64 else 4
    pre = None if delta_in_dq else planned(_flash_bwd_preprocess_kernel, (cdiv(SQ, pre_m), HQ, B), device, dict(
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pre_m, HAS_SINK=sinks is not None, ZERO_DQACC=atomic,
        num_warps=pre_warps))
    pre_ints = (*o.stride()[:3], *do_s, HQ, SQ)
    ms, kind = _mask_strides(mask, (B, HQ, SQ, SK))
    T, keep_scale = _dropout_args(seed, dropout_p, device)
    dot, precision = dot_settings(q.dtype, INTERPRET_ON_CPU)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, MASK_KIND=kind, DROPOUT=seed is not None, DOT=dot,
                  PRECISION=precision)
    if tile is None:
        tile = _float32_tile(attention_tile(BWD_ATOMIC_TILES if atomic else BWD_DKDV_TILES, D), q.dtype)
    dq_box = ([B * HQ, SQ, D], [SQ * D, D, 1], [1, tile.BLOCK_M, D]) if atomic and dq_by_tma(q, D) else None
    loads = tma_loads(q, D, "backward_atomic" if atomic else "backward" if seed is None else "backward_dropout")
    qdo_boxes = _desc_boxes(q, do, tile.BLOCK_M) if loads else None
    group_heads, reverse = program_order(band, SQ, SK, D, True)
    main = planned(_flash_bwd_dkdv_kernel, (cdiv(SK, tile.BLOCK_N), HKV, B), device, dict(
        BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, num_warps=tile.num_warps, num_stages=tile.num_stages,
        ATOMIC_DQ=atomic, DQ_TMA=dq_box is not None, QDO_TMA=qdo_boxes is not None, GROUP_HEADS=group_heads,
        REVERSE_BLOCKS=reverse, **common))
    main_ints = (*q_s, *k_s, *v_s, *do_s, *dk.stride()[:3], *dv.stride()[:3], *ms, HQ, HQ // HKV, SQ, SK)
    tail = (band[0], band[1], T, keep_scale)
    if atomic:
        last = planned(_flash_bwd_dq_convert_kernel, (cdiv(SQ, pre_m), HQ, B), device, dict(
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pre_m, num_warps=pre_warps))
        return _BwdPlan(True, pre, pre_ints, main, main_ints, last, (*dq.stride()[:3], HQ, SQ), tail, dq_box,
                        qdo_boxes, None)
    if dq_tile is None:
        dq_tile = _float32_tile(attention_tile(BWD_DQ_TILES, D), q.dtype)
    kv_boxes = _desc_boxes(k, v, dq_tile.BLOCK_N) if loads else None
    group_heads, reverse = program_order(band, SQ, SK, D, False)
    last = planned(_flash_bwd_dq_kernel, (cdiv(SQ, dq_tile.BLOCK_M), HQ, B), device, dict(
        BLOCK_M=dq_tile.BLOCK_M, BLOCK_N=dq_tile.BLOCK_N, num_warps=dq_tile.num_warps,
        num_stages=dq_tile.num_stages, KV_TMA=kv_boxes is not None, GROUP_HEADS=group_heads,
        REVERSE_BLOCKS=reverse, DELTA_IN_DQ=delta_in_dq, **common))
    last_ints = (*q_s, *k_s, *v_s, *do_s, *o.stride()[:3], *dq.stride()[:3], *ms, HQ, HQ // HKV, SQ, SK)
    return _BwdPlan(False, pre, pre_ints, main, main_ints, last, last_ints, tail, dq_box, qdo_boxes, kv_boxes)


def flash_attn_dropout_mask(seed: torch.Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> torch.Tensor:
    """The keep mask the kernels draw for ``seed``, as bool [b, hq, sq, sk] (True = kept):
    for tests and the book (the kernels never write it). Element (b, h, i, j) is query i, key j
    of row block (b·hq + h)·sq in :func:`_attention_keep_mask`'s order, drawn by that same
    function, so the bits are the kernels' by construction.

    Args:
        seed: int64 [1] Philox key on the device to run on.
        shape: (b, hq, sq, sk), each >= 0.
        dropout_p: the dropout probability, as the kernels take it (:func:`_dropout_args`).

    Returns:
        bool [b, hq, sq, sk] on ``seed``'s device.

    Raises:
        ValueError: ``shape`` not four non-negative ints; ``seed`` or ``dropout_p`` not what the
            kernels take (:func:`_dropout_args`).

    Source: fusedlib's own (the kernels' Philox-4x32-10 draw, Salmon et al., SC 2011).
    """
    if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 4
            or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in shape)):
        raise ValueError(f"shape must be four non-negative ints (b, hq, sq, sk), got {shape!r}")
    if not isinstance(seed, torch.Tensor):  # (_dropout_args reads no dropout into a None seed)
        raise ValueError(f"seed must be an int64 tensor of one element (philox_seed), got {type(seed).__name__}")
    T, _ = _dropout_args(seed, dropout_p, seed.device)
    B, H, SQ, SK = (int(n) for n in shape)
    out = torch.empty((B * H, SQ, SK), dtype=torch.int8, device=seed.device)
    if out.numel() > 0:
        block = 64
        launch(_flash_dropout_mask_kernel, (cdiv(SQ, block), cdiv(SK, block), B * H), seed.device, seed, out, SQ, SK,
               T, BLOCK_M=block, BLOCK_N=block, num_warps=4)
    return out.view(B, H, SQ, SK).bool()
