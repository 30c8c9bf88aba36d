"""Tile tuning on a GPU: ``python -m fusedlib.bench.tune --op NAME``.

For one op, times its forward and backward kernels *alone* (the host launchers of
:mod:`fusedlib.kernels`, no autograd, no argument checks) for every candidate tile, with
the benchmark's timer (:func:`fusedlib.bench.core.time_ms`, ``do_bench`` median), each
``--repeat`` times (the spread is the noise), and prints the effective bandwidth by the
benchmark's byte counts, the fraction of the copy ceiling, and which candidate the op's
tables pick today (``<- current``). Winners go into the op's tile table in its kernel file
(:data:`TUNE_OPS` names it), the numbers into NOTES.md.

Usage::

    python -m fusedlib.bench.tune --op bias_gelu                     # default shapes
    python -m fusedlib.bench.tune --op layer_norm --shape 8192,16384 --shape 16384,8192
    python -m fusedlib.bench.tune --op masked_softmax --pass fwd --limit 3
    python -m fusedlib.bench.tune --op cross_entropy --list          # candidates only (no GPU)
    python -m fusedlib.bench.tune --op swiglu --out tune_swiglu.json # also write JSON records

Shapes are in the op's benchmark layout (:mod:`fusedlib.bench.ops`): [rows, h] (GLUs
[rows, 2h]), causal softmax [b·np, sq, sk], masked softmax [b, np, sq, sk], cross entropy
[rows, V], attention [b, heads, s, head dim] (causal, bf16: q, k, v of one shape).
Candidate lists come from the tuning runs behind the current tables (NOTES.md).

How a tile reaches a kernel: every launcher takes ``tile=`` (a
:class:`fusedlib.kernels.launch.Tile`), which replaces its table's pick; a candidate is a
plain dict of the Tile's fields (JSON-ready), passed as ``Tile(**candidate)``. Nothing is
patched, so a failing candidate leaves nothing behind.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..checks import file_on_the_way
from ..kernels.launch import Tile, next_power_of_2, pick
from .core import environment, time_ms

__all__ = [
    "TuneOp",
    "TUNE_OPS",
    "candidates",
    "current_tile",
    "tile_label",
    "LAYOUTS",
    "check_shape",
    "tune",
    "main",
]

#: Tuning passes: each kernel alone ("bwd" is the backward kernel(s), not fwd + bwd).
TUNE_PASSES = ("fwd", "bwd")


def _p2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return next_power_of_2(max(1, n))


@dataclass(frozen=True)
class TuneOp:
    """How to tune one op.

    Attributes:
        op: the op's name (as in :mod:`fusedlib.bench.ops`).
        shapes: default shapes, in the op's benchmark layout.
        table: where the winners go (the kernel file's table), printed with the results.
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    table: str


TUNE_OPS: dict[str, TuneOp] = {t.op: t for t in (
    TuneOp("bias_gelu", ((8192, 16384),), "fusedlib/kernels/bias_gelu.py FWD_TILES (fwd), BWD_TILES (bwd)"),
    TuneOp("bias_dropout_add", ((32768, 4096),),
           "fusedlib/kernels/bias_dropout_add.py FWD_TILES (fwd), BWD_TILES (bwd)"),
    TuneOp("geglu", ((8192, 32768),), "fusedlib/kernels/glu.py TILES (one table for fwd and bwd)"),
    TuneOp("swiglu", ((8192, 32768),), "fusedlib/kernels/glu.py TILES (one table for fwd and bwd)"),
    TuneOp("layer_norm", ((32768, 4096),), "fusedlib/kernels/layer_norm.py FWD_TILES / BWD_TILES, shared with RMSNorm"),
    TuneOp("rms_norm", ((32768, 4096),),
           "fusedlib/kernels/layer_norm.py FWD_TILES (shared with LayerNorm) / RMS_BWD_TILES"),
    TuneOp("causal_softmax", ((128, 2048, 2048),),
           "fusedlib/kernels/softmax.py TILES, ONLINE_TILE, MAX_REGISTER_BLOCK (one table for every softmax)"),
    TuneOp("masked_softmax", ((4, 32, 2048, 2048), (4, 32, 128, 32768), (4, 32, 256, 16384)),
           "fusedlib/kernels/softmax.py (as causal_softmax)"),
    TuneOp("cross_entropy", ((8192, 128256),), "fusedlib/kernels/cross_entropy.py FWD_TILES / BWD_TILES"),
    # [b, heads, s, head dim], bf16, causal: the shapes for chapter 8
    TuneOp("attention", ((4, 16, 2048, 128), (2, 16, 8192, 128), (8, 32, 1024, 64)),
           "fusedlib/kernels/flash_attention.py FWD_TILES (fwd), BWD_DKDV_TILES (bwd; BWD_DQ_TILES gets "
           "its transpose)"),
)}


# ------------------------------------------------------------------------------------------
# Candidates: plain dicts of launch settings, JSON-ready
# ------------------------------------------------------------------------------------------

def _tile(block_n: int, block_m: int, warps: int, num_stages: int = 1, programs_per_sm: int = 0) -> dict:
    """A candidate: the fields of a :class:`~fusedlib.kernels.launch.Tile`, as a dict."""
    return dataclasses.asdict(Tile(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=num_stages,
                                   programs_per_sm=programs_per_sm))


def _dedupe(tiles: list[dict]) -> list[dict]:
    out: list[dict] = []
    for t in tiles:
        if t not in out:
            out.append(t)
    return out


def _elementwise(block_n_cap: int, tiles: Sequence[tuple[int, int, int]], per_sm: Sequence[int] = (),
                 stages: Sequence[int] = (1,)) -> list[dict]:
    """(BLOCK_N, BLOCK_M, warps) tiles with BLOCK_N capped at the row's next power of two,
    as the launchers cap it; times each programs-per-SM value if given, times each row-loop
    pipelining depth (``stages``)."""
    out = []
    for (bn, bm, w) in tiles:
        for st in stages:
            base = _tile(min(bn, block_n_cap), bm, w, num_stages=st)
            out += [dict(base, programs_per_sm=k) for k in per_sm] if per_sm else [base]
    return _dedupe(out)


def _norm_fwd_candidates(block_n: int) -> list[dict]:
    # one tile per program, or persistent with the next tile prefetched; 4..64 elements per
    # thread, at most 16 Ki elements per tile (the tuning run behind layer_norm.FWD_TILES)
    out = []
    for block_m, warps in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16, 32)):
        per_thread = block_m * block_n // (32 * warps)
        if block_m * block_n > 16384 or not 4 <= per_thread <= 64:
            continue
        out.append(_tile(block_n, block_m, warps, num_stages=1, programs_per_sm=0))
        out.append(_tile(block_n, block_m, warps, num_stages=2, programs_per_sm=4))
    return out


def _norm_bwd_candidates(block_n: int) -> list[dict]:
    # a persistent grid (registers bound the tile: 4..32 elements per thread), pipelined
    # 1-3 stages; long rows also the split backward (the run behind layer_norm.BWD_TILES)
    out = []
    for block_m, warps in itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32)):
        per_thread = block_m * block_n // (32 * warps)
        if block_m * block_n > 8192 and block_m > 1 or not 4 <= per_thread <= 32:
            continue
        stages_options = (1, 2, 3) if block_m * block_n <= 8192 else (1, 2)
        for programs_per_sm, stages in itertools.product((1, 2, 4) if warps <= 8 else (1, 2), stages_options):
            out.append(_tile(block_n, block_m, warps, num_stages=stages, programs_per_sm=programs_per_sm))
    if block_n >= 8192:  # the split backward: BLOCK_N columns per program, below the row's block
        for split, block_m, warps, programs_per_sm in itertools.product((1024, 2048, 4096), (1, 2), (4, 8), (4, 8)):
            if 8 <= block_m * split // (32 * warps) <= 32:
                out.append(_tile(split, block_m, warps, num_stages=2, programs_per_sm=programs_per_sm))
    return out


def _softmax_candidates(sk: int) -> list[dict]:
    block_n = _p2(sk)

    def reg(m: int, w: int) -> dict:  # the whole row in registers
        return _tile(block_n, m, w)

    def online(n: int, w: int) -> dict:  # the looping kernel: BLOCK_N below the row's block
        return _tile(n, 1, w)

    if block_n <= 4096:  # rows in registers: the 2 Ki run's list
        return [reg(m, w) for m, w in ((1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8))]
    if block_n <= 16384:  # the 16 Ki run's list: one row in registers, or the looping kernel
        return [reg(1, 8), reg(1, 16), reg(1, 32), online(4096, 8), online(8192, 16)]
    return ([online(n, w) for n, w in itertools.product((2048, 4096, 8192), (4, 8, 16))]
            + [reg(1, 16), reg(1, 32)])


def _attention_candidates(pass_: str, d: int) -> list[dict]:
    """FlashAttention tiles around FlashAttention-2's and Triton's tutorial settings. fwd:
    [BLOCK_M queries, BLOCK_N keys]; bwd: the dK/dV kernel's [BLOCK_M queries per step,
    BLOCK_N keys per program] (the dQ kernel runs the transposed tile)."""
    out = []
    if pass_ == "fwd":
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            if bm * d <= 128 * 128 and bn * d <= 128 * 128:  # acc and K/V tiles of at most 32 Ki elements
                out.append(_tile(bn, bm, w, num_stages=st))
    else:
        for (bm, bn), w, st in itertools.product(((16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128)),
                                                 (4, 8), (1, 2, 3)):
            if bn * d <= 128 * 128:  # two [BLOCK_N, d] float32 accumulators
                out.append(_tile(bn, bm, w, num_stages=st))
    from ..kernels import flash_attention as k

    cur = _attention_table_tile(k.FWD_TILES if pass_ == "fwd" else k.BWD_DKDV_TILES, d)
    cur = dataclasses.asdict(cur)
    return _dedupe(out + [cur])


def _attention_table_tile(table, d: int) -> Tile:
    """The GPU table's tile for head dim d (also where kernels are interpreted here).

    Raises:
        ValueError: d past the table's last bound.
    """
    tile = next((t for bound, t in table if d <= bound), None)
    if tile is None:
        raise ValueError(f"head dim {d} is past the attention tile table's last bound, {table[-1][0]}")
    return tile


def candidates(op: str, pass_: str, shape: Sequence[int]) -> list[dict]:
    """The tiles tried for ``op``'s ``pass_`` kernel at ``shape`` (no GPU needed).

    Raises:
        KeyError: for an op :data:`TUNE_OPS` does not know; ValueError: for another pass.
    """
    _check(op, pass_)
    shape = tuple(shape)
    if op == "attention":
        return _attention_candidates(pass_, shape[-1])
    if op == "bias_gelu":
        cap = _p2(shape[-1])
        # 512- and 256-column tiles: rows of 3·2^k (1536 in a GPT of hidden 384) waste a quarter
        # of a 2048-column tile's lanes
        if pass_ == "fwd":
            return _elementwise(cap, [(1024, 2, 4), (2048, 2, 8), (4096, 1, 8), (512, 4, 4), (512, 8, 4),
                                      (512, 8, 8), (256, 16, 4), (256, 32, 8)])
        return _elementwise(cap, [(2048, 4, 8), (1024, 4, 4), (2048, 2, 8), (4096, 2, 8), (1024, 8, 8),
                                  (4096, 4, 16), (512, 8, 4), (512, 8, 8), (512, 16, 8), (256, 16, 4),
                                  (512, 4, 4), (1024, 2, 4)],
                            per_sm=(4, 8, 16), stages=(1, 3))
    if op == "bias_dropout_add":
        cap = max(8, _p2(shape[-1]))  # BLOCK_N >= 8: one Philox call per 8 columns
        if pass_ == "fwd":  # (128-column tiles: rows of 3·2^k waste no lanes)
            return _elementwise(cap, [(2048, 2, 4), (1024, 4, 4), (4096, 1, 4), (1024, 2, 2), (2048, 4, 8),
                                      (4096, 2, 8), (1024, 8, 8), (128, 32, 4), (128, 64, 8), (128, 16, 2)])
        # the backward's tile itself (rows and warps already scaled), as the forward tiles
        # times 1 or 2 (the run behind BWD_TILES: twice the forward's rows and warps), its row
        # loop pipelined or not
        base = [(2048, 2, 4), (1024, 4, 4), (4096, 1, 4), (2048, 4, 8), (128, 32, 4)]
        return _elementwise(cap, [(bn, bm * s, w * s) for (bn, bm, w) in base for s in (1, 2)],
                            per_sm=(4, 8, 16, 32), stages=(1, 3))
    if op in ("geglu", "swiglu"):
        cap = _p2(shape[-1] // 2)  # the output width h
        tiles = [(bn, bm, w) for bn, bm, w in itertools.product((1024, 2048, 4096), (1, 2, 4, 8), (4, 8))
                 if 2048 <= bn * bm <= 8192]  # the range glu.TILES' comment gives
        return _elementwise(cap, tiles)
    if op in ("layer_norm", "rms_norm"):
        block_n = _p2(shape[-1])
        return _norm_fwd_candidates(block_n) if pass_ == "fwd" else _norm_bwd_candidates(block_n)
    if op in ("causal_softmax", "masked_softmax"):
        return _softmax_candidates(shape[-1])
    # cross_entropy: (BLOCK_N, num_warps) for both kernels, with the tables' BLOCK_M rule: the
    # forward packs TILE_ELEMENTS // BLOCK_N rows to a program only when one step holds the
    # whole row, the (elementwise) backward always
    from ..kernels.cross_entropy import TILE_ELEMENTS

    v = shape[-1]
    return [_tile(n, max(1, TILE_ELEMENTS // n) if pass_ == "bwd" or n >= v else 1, w)
            for n, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))]


#: Each op's shape layout (the module docstring), as :func:`check_shape`'s errors name it.
LAYOUTS: dict[str, str] = {"bias_gelu": "[rows, h]", "bias_dropout_add": "[rows, h]", "geglu": "[rows, 2h]",
                           "swiglu": "[rows, 2h]", "layer_norm": "[rows, h]", "rms_norm": "[rows, h]",
                           "causal_softmax": "[b·np, sq, sk]", "masked_softmax": "[b, np, sq, sk]",
                           "cross_entropy": "[rows, V]", "attention": "[b, heads, s, head dim]"}


def check_shape(op: str, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple, checked for ``op``: its layout's number of sizes (:data:`LAYOUTS`),
    each an int >= 1, an even width for the GLUs ([rows, 2h]), and a row (attention: a head dim)
    that the op's tile tables cover.

    Raises:
        KeyError: for an op :data:`TUNE_OPS` does not know; ValueError: for a shape it cannot be tuned at.
    """
    _check(op, "fwd")
    shape = tuple(shape)
    layout = LAYOUTS[op]
    article = "an" if op[0] in "aeiou" else "a"
    if len(shape) != len(TUNE_OPS[op].shapes[0]) or any(isinstance(n, bool) or not isinstance(n, numbers.Integral)
                                                        or n < 1 for n in shape):
        raise ValueError(f"{article} {op} shape is {layout}: {len(TUNE_OPS[op].shapes[0])} ints >= 1, "
                         f"got {list(shape)}")
    shape = tuple(int(n) for n in shape)  # (numpy's ints as Python ints)
    if op in ("geglu", "swiglu") and shape[-1] % 2:
        raise ValueError(f"{article} {op} shape is {layout}: its last size must be even, got {list(shape)}")
    for pass_ in TUNE_PASSES:
        try:
            current_tile(op, pass_, shape)
            candidates(op, pass_, shape)
        except ValueError as err:
            raise ValueError(f"{op} cannot be tuned at {list(shape)} ({layout}): {err}") from None
    return shape


def tile_label(tile: dict) -> str:
    """``"BLOCK_N=2048 BLOCK_M=2 num_warps=8"``: a tile as printed."""
    return " ".join(f"{k}={v}" for k, v in tile.items())


def _check(op: str, pass_: str) -> None:
    if op not in TUNE_OPS:
        raise KeyError(f"unknown op {op!r} for tuning; known: {', '.join(TUNE_OPS)}")
    if pass_ not in TUNE_PASSES:
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")


# ------------------------------------------------------------------------------------------
# The tables today
# ------------------------------------------------------------------------------------------

def current_tile(op: str, pass_: str, shape: Sequence[int]) -> dict:
    """The tile the op's tables pick today for ``pass_`` at ``shape``, in the candidates' form
    (as on a GPU: without the CPU interpreter's larger tiles).

    Raises:
        KeyError, ValueError: as :func:`candidates`.
    """
    _check(op, pass_)
    h = shape[-1]
    if op == "bias_gelu":
        from ..kernels import bias_gelu as k

        tile = pick(k.FWD_TILES if pass_ == "fwd" else k.BWD_TILES, h)
    elif op == "bias_dropout_add":
        from ..kernels import bias_dropout_add as k

        tile = pick(k.FWD_TILES if pass_ == "fwd" else k.BWD_TILES, h)
        if tile.BLOCK_N < k.ELEMENTS_PER_PHILOX:
            tile = dataclasses.replace(tile, BLOCK_N=k.ELEMENTS_PER_PHILOX)
    elif op in ("geglu", "swiglu"):
        from ..kernels import glu as k

        tile = pick(k.TILES, h // 2)
    elif op in ("layer_norm", "rms_norm"):
        from ..kernels import layer_norm as k

        table = k.FWD_TILES if pass_ == "fwd" else (k.RMS_BWD_TILES if op == "rms_norm" else k.BWD_TILES)
        tile = pick(table, h)
    elif op in ("causal_softmax", "masked_softmax"):
        from ..kernels import softmax as k

        tile = k.softmax_tile(h)
    elif op == "attention":
        from ..kernels import flash_attention as k

        tile = _attention_table_tile(k.FWD_TILES if pass_ == "fwd" else k.BWD_DKDV_TILES, h)
    else:
        from ..kernels import cross_entropy as k

        tile = pick(k.FWD_TILES if pass_ == "fwd" else k.BWD_TILES, h)
    return dataclasses.asdict(tile)


# ------------------------------------------------------------------------------------------
# Inputs, launches, bytes
# ------------------------------------------------------------------------------------------

def _elem(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _setup(op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> dict:
    """Random inputs (never zeros) for both kernels of ``op`` at ``shape``."""
    def rnd(*s, dt=dtype):
        return torch.randn(*s, device=device, dtype=dt)

    if op == "bias_gelu":
        n, h = shape
        return {"y": rnd(n, h), "b": rnd(h), "g": rnd(n, h)}
    if op == "bias_dropout_add":
        from ..kernels.bias_dropout_add import philox_seed

        n, h = shape
        return {"x": rnd(n, h), "b": rnd(h), "r": rnd(n, h), "g": rnd(n, h), "seed": philox_seed(device)}
    if op in ("geglu", "swiglu"):
        n, two_h = shape
        return {"y": rnd(n, two_h), "g": rnd(n, two_h // 2)}
    if op in ("layer_norm", "rms_norm"):
        from ..kernels.layer_norm import norm_fwd

        n, h = shape
        rms = op == "rms_norm"
        x = rnd(n, h)
        w = (1 + 0.1 * torch.randn(h, device=device, dtype=torch.float32)).to(dtype)
        b = None if rms else (0.1 * torch.randn(h, device=device, dtype=torch.float32)).to(dtype)
        _, mean, rstd = norm_fwd(x, w, b, 1e-5, rms_norm=rms)
        return {"x": x, "w": w, "b": b, "dy": torch.randn_like(x), "mean": mean, "rstd": rstd}
    if op in ("causal_softmax", "masked_softmax"):
        from ..kernels import softmax as k
        from .ops._softmax_common import SCALE
        from .ops.masked_softmax import padding_mask

        if op == "causal_softmax":
            ab, sq, sk = shape
            x4, mask, band = rnd(ab, 1, sq, sk), None, k.causal_band(sq, sk)
        else:
            b, np_, sq, sk = shape
            x4, mask, band = rnd(b, np_, sq, sk), padding_mask(b, sq, sk, device), None
        p4, _ = k.softmax_fwd(x4, SCALE, mask, band)
        return {"x4": x4, "mask": mask, "band": band, "g4": torch.randn_like(x4), "p4": p4, "scale": SCALE}
    if op == "attention":
        from ..kernels.flash_attention import attention_band, flash_attn_fwd

        b, heads, s, d = shape
        q, k, v = rnd(b, s, heads, d), rnd(b, s, heads, d), rnd(b, s, heads, d)
        scale, band = d ** -0.5, attention_band(s, s, True, None)
        o, lse = flash_attn_fwd(q, k, v, scale, band)
        return {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": torch.randn_like(o), "scale": scale, "band": band}
    from ..kernels.cross_entropy import cross_entropy_fwd

    n, v = shape
    x = rnd(n, v)
    t = torch.randint(0, v, (n,), device=device)
    _, lse = cross_entropy_fwd(x, t, finalize=True)
    return {"x": x, "t": t, "lse": lse, "g": torch.randn(n, device=device, dtype=torch.float32)}


def _launcher(op: str, pass_: str, tile: dict, inp: dict) -> Callable[[], object]:
    """The kernel launch of ``op``'s ``pass_`` on ``inp`` with ``tile`` (passed as ``tile=``)."""
    t = Tile(**tile)
    if op == "bias_gelu":
        from ..kernels import bias_gelu as k

        if pass_ == "fwd":
            return lambda: k.bias_gelu_fwd(inp["y"], inp["b"], tile=t)
        return lambda: k.bias_gelu_bwd(inp["g"], inp["y"], inp["b"], tile=t)
    if op == "bias_dropout_add":
        from ..kernels import bias_dropout_add as k
        from .ops.bias_dropout_add import PROB

        if pass_ == "fwd":
            return lambda: k.bias_dropout_add_fwd(inp["x"], inp["b"], inp["r"], inp["seed"], PROB, tile=t)
        return lambda: k.bias_dropout_add_bwd(inp["g"], inp["x"].dtype, inp["seed"], PROB, True, True, tile=t)
    if op in ("geglu", "swiglu"):
        from ..kernels import glu as k

        act = "gelu_tanh" if op == "geglu" else "silu"
        if pass_ == "fwd":
            return lambda: k.glu_fwd(inp["y"], None, None, act, tile=t)
        return lambda: k.glu_bwd(inp["g"], inp["y"], None, None, act, tile=t)
    if op in ("layer_norm", "rms_norm"):
        from ..kernels.layer_norm import norm_bwd, norm_fwd

        rms = op == "rms_norm"
        if pass_ == "fwd":
            return lambda: norm_fwd(inp["x"], inp["w"], inp["b"], 1e-5, rms_norm=rms, tile=t)
        return lambda: norm_bwd(inp["dy"], inp["x"], inp["w"], inp["b"], inp["mean"], inp["rstd"],
                                rms_norm=rms, tile=t)
    if op in ("causal_softmax", "masked_softmax"):
        from ..kernels import softmax as k

        if pass_ == "fwd":
            return lambda: k.softmax_fwd(inp["x4"], inp["scale"], inp["mask"], inp["band"], tile=t)
        return lambda: k.softmax_bwd(inp["g4"], inp["p4"], inp["scale"], inp["band"], tile=t)
    if op == "attention":
        from ..kernels.flash_attention import flash_attn_bwd, flash_attn_fwd

        if pass_ == "fwd":
            return lambda: flash_attn_fwd(inp["q"], inp["k"], inp["v"], inp["scale"], inp["band"], tile=t)
        t_dq = Tile(BLOCK_M=t.BLOCK_N, BLOCK_N=t.BLOCK_M, num_warps=t.num_warps, num_stages=t.num_stages)
        return lambda: flash_attn_bwd(inp["do"], inp["q"], inp["k"], inp["v"], inp["o"], inp["lse"], inp["scale"],
                                      inp["band"], tile=t, dq_tile=t_dq)
    from ..kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd

    if pass_ == "fwd":
        return lambda: cross_entropy_fwd(inp["x"], inp["t"], finalize=True, tile=t)
    return lambda: cross_entropy_bwd(inp["x"], inp["t"], inp["lse"], inp["g"], tile=t)


def kernel_bytes(op: str, pass_: str, shape: Sequence[int], dtype: torch.dtype) -> int:
    """The benchmark's fewest bytes for ``op`` (:mod:`fusedlib.bench.ops`), split into the
    forward kernel's and the backward kernel's (fwd+bwd minus fwd)."""
    _check(op, pass_)
    e = _elem(dtype)
    if op == "bias_gelu":
        from .ops.bias_gelu import bias_gelu_bytes as f
        nb = f(*shape, e)
    elif op == "bias_dropout_add":
        from .ops.bias_dropout_add import bias_dropout_add_bytes as f
        nb = f(*shape, e)
    elif op in ("geglu", "swiglu"):
        from .ops._glu import glu_bytes
        nb = glu_bytes(shape[0], shape[1] // 2, e)
    elif op in ("layer_norm", "rms_norm"):
        from .ops.layer_norm import layer_norm_bytes, rms_norm_bytes
        nb = (rms_norm_bytes if op == "rms_norm" else layer_norm_bytes)(*shape, e)
    elif op == "causal_softmax":
        from .ops._softmax_common import causal_bytes
        nb = causal_bytes(*shape, e)
    elif op == "masked_softmax":
        from .ops._softmax_common import masked_bytes
        b, np_, sq, sk = shape
        nb = masked_bytes(b, np_, sq, sk, b, e)
    elif op == "attention":
        # q, k, v read and o written (+ the float32 LSE); backward: q, k, v, o, dO read, dq, dk,
        # dv written, LSE read and Delta written and read (float32 per row)
        b, heads, s, d = shape
        t, rows = b * heads * s * d * e, b * heads * s * 4
        nb = {"fwd": 4 * t + rows, "fwd+bwd": 4 * t + rows + 8 * t + 3 * rows}
    else:
        from .ops.cross_entropy import cross_entropy_bytes
        nb = cross_entropy_bytes(*shape, e)
    return nb["fwd"] if pass_ == "fwd" else nb["fwd+bwd"] - nb["fwd"]


# ------------------------------------------------------------------------------------------
# The tuning loop and the command line
# ------------------------------------------------------------------------------------------

def tune(op: str, shapes: Sequence[Sequence[int]] | None = None, passes: Sequence[str] = TUNE_PASSES,
         dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda", repeat: int = 2,
         rep_ms: int = 100, limit: int | None = None, copy_gbps: float | None = None,
         timer: Callable[..., float] = time_ms, emit: Callable[[str], None] = print) -> list[dict]:
    """Time every candidate tile of ``op``'s kernels; print one line per candidate.

    Args:
        op: a key of :data:`TUNE_OPS`.
        shapes: shapes to tune at (default: the op's).
        passes: subset of ("fwd", "bwd").
        dtype: the inputs' dtype.
        device: a CUDA device for real numbers (the tests use the CPU with a fake timer).
        repeat: timings per candidate; GB/s is from the fastest.
        rep_ms: do_bench's repetition budget per timing, ms.
        limit: time only the first ``limit`` candidates (a quick check).
        copy_gbps: the copy ceiling, for the "% of copy" column (None: left out).
        timer: ``(fn, warmup=, rep=) -> ms``: :func:`fusedlib.bench.core.time_ms`.
        emit: where lines go.

    Raises:
        KeyError, ValueError: for an unknown op or pass (:func:`candidates`), or a shape
            :func:`check_shape` refuses (each checked before the first timing).

    Returns:
        One record per candidate that ran: ``{"op", "pass", "shape", "dtype", "tile", "ms"
        (the fastest), "ms_repeats", "bytes", "GBps", "current"}`` and the device and versions.
        A candidate that fails (e.g. too many registers or too much shared memory) is printed
        with its error and skipped.
    """
    for pass_ in passes:
        _check(op, pass_)
    spec = TUNE_OPS[op]
    shapes = [check_shape(op, s) for s in (shapes or spec.shapes)]
    device = torch.device(device)
    records = []
    env = environment()
    for shape in shapes:
        inp = _setup(op, shape, dtype, device)
        for pass_ in passes:
            nbytes = kernel_bytes(op, pass_, shape, dtype)
            cur = current_tile(op, pass_, shape)
            cands = candidates(op, pass_, shape)
            if limit is not None:
                cands = cands[:limit]
            floor = f", {nbytes / copy_gbps / 1e6:.4f} ms at copy speed" if copy_gbps else ""
            emit(f"{op} {pass_} {list(shape)} {str(dtype).replace('torch.', '')}: {len(cands)} candidates, "
                 f"{nbytes / 1e9:.3f} GB{floor}")
            results = []
            for tile in cands:
                label = tile_label(tile)
                try:
                    fn = _launcher(op, pass_, tile, inp)
                    ms = [timer(fn, warmup=10, rep=rep_ms) for _ in range(repeat)]
                except Exception as exc:  # a tile that does not compile or launch
                    emit(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                best = min(ms)
                gbps = nbytes / (best * 1e-3) / 1e9
                pct = f" {100 * gbps / copy_gbps:5.1f}% of copy" if copy_gbps else ""
                mark = "  <- current" if tile == cur else ""
                emit(f"  {label:<72} {' '.join(f'{t:.4f}' for t in ms)} ms {gbps:6.0f} GB/s{pct}{mark}")
                results.append((best, label))
                records.append({"op": op, "pass": pass_, "shape": list(shape),
                                "dtype": str(dtype).replace("torch.", ""), "tile": tile, "ms": round(best, 5),
                                "ms_repeats": [round(t, 5) for t in ms], "bytes": nbytes,
                                "GBps": round(gbps, 1), "current": tile == cur, **env})
            results.sort()
            if results:
                emit("  best: " + "; ".join(f"{ms:.4f} ms {label}" for ms, label in results[:3]))
    emit(f"winners go into {spec.table}")
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring); ``--repeat``, ``--rep``, ``--limit`` or ``--out`` with
    ``--list`` (which times nothing), a shape :func:`check_shape` refuses, and an ``--out`` that
    is a folder or lies under a file are errors."""
    parser = argparse.ArgumentParser(prog="python -m fusedlib.bench.tune",
                                     description="Time each op kernel's candidate tiles alone, on a GPU.")
    parser.add_argument("--op", required=True, choices=sorted(TUNE_OPS), help="the op to tune")
    parser.add_argument("--shape", action="append", default=None, type=_shape_arg,
                        help="a shape in the op's layout, comma-separated (repeatable; default: the op's)")
    parser.add_argument("--pass", dest="passes", nargs="+", choices=TUNE_PASSES, default=list(TUNE_PASSES),
                        help="kernels to tune (default: fwd bwd)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the inputs' dtype (default bfloat16)")
    parser.add_argument("--repeat", type=_positive, default=None, help="timings per candidate (default 2)")
    parser.add_argument("--rep", type=_positive, default=None, help="do_bench's budget per timing, ms (default 100)")
    parser.add_argument("--limit", type=_positive, default=None, help="only the first N candidates")
    parser.add_argument("--list", action="store_true", help="print the candidates and the current tiles, no timing")
    parser.add_argument("--out", default=None, help="also write the records to this JSON file")
    args = parser.parse_args(argv)
    if args.list:  # --list times nothing: the timing flags would be ignored
        given = [f for f, v in (("--repeat", args.repeat), ("--rep", args.rep), ("--limit", args.limit),
                                ("--out", args.out)) if v is not None]
        if given:
            parser.error(f"{', '.join(given)}: --list prints the candidates and times nothing; leave them out")
    args.repeat = 2 if args.repeat is None else args.repeat
    args.rep = 100 if args.rep is None else args.rep
    if args.out is not None:  # refused before any timing: the records are written at the end of the run
        out = Path(args.out)
        blocked = file_on_the_way(out)
        if out.is_dir() or blocked is not None:
            parser.error(f"--out must be a JSON file's path, got {args.out!r}: "
                         f"{'a folder' if blocked is None else repr(str(blocked)) + ' on its way is a file'}")
    for shape in args.shape or ():
        try:
            check_shape(args.op, shape)
        except ValueError as err:
            parser.error(f"--shape: {err}")
    # a shape or pass named twice is timed once (not two sets of records)
    args.passes = list(dict.fromkeys(args.passes))
    args.shape = list(dict.fromkeys(args.shape)) if args.shape else args.shape
    return args


def _shape_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is comma-separated ints, e.g. 8192,16384; got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape sizes must be >= 1, got {text!r}")
    return shape


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def list_candidates(op: str, shapes: Sequence[Sequence[int]] | None = None,
                    passes: Sequence[str] = TUNE_PASSES) -> str:
    """The candidates of ``op`` per shape and pass, the current tile marked (no GPU needed)."""
    lines = []
    for shape in [tuple(s) for s in (shapes or TUNE_OPS[op].shapes)]:
        for pass_ in passes:
            cur = current_tile(op, pass_, shape)
            cands = candidates(op, pass_, shape)
            lines.append(f"{op} {pass_} {list(shape)}: {len(cands)} candidates; current: {tile_label(cur)}"
                         + ("" if cur in cands else " (not among them)"))
            lines += [f"  {tile_label(t)}" + ("  <- current" if t == cur else "") for t in cands]
    lines.append(f"winners go into {TUNE_OPS[op].table}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(list_candidates(args.op, args.shape, args.passes))
        return 0
    if not torch.cuda.is_available():
        print("fusedlib.bench.tune needs a CUDA GPU: kernel timings in Triton's CPU interpreter mean nothing "
              "(--list works anywhere).", file=sys.stderr)
        return 2
    from .core import copy_record

    copy = copy_record()
    print(f"copy ceiling {copy['GBps']:.0f} GB/s ({copy['device']}, torch {copy['torch']}, triton {copy['triton']})",
          flush=True)
    records = tune(args.op, args.shape, args.passes, getattr(torch, args.dtype), "cuda", repeat=args.repeat,
                   rep_ms=args.rep, limit=args.limit, copy_gbps=copy["GBps"],
                   emit=lambda line: print(line, flush=True))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([copy] + records, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
