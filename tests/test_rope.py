"""Rotary position embeddings: fusedlib's Triton kernel (forward and backward) against Megatron's
unfused formula in float64, the apply_rope_fusion switch, and RotaryEmbedding's angles.

Error bound of the kernel (the tolerance of every comparison here). Each rotated output is
``y = x1·c + x2·w`` with x1, x2 two inputs of the pair (exact in the compute dtype), c and
w = ±s the cosine and sine of one float32 angle, computed in the kernel's compute dtype
(float32; float64 for float64 inputs) with unit roundoff u_acc (2^-24; 2^-53):

* cos and sin are within 2 ulps (CUDA's ``cosf``/``sinf``; NumPy's, which the interpreter
  runs, within 1.5), i.e. within 4·u_acc absolutely since |c|, |s| <= 1;
* each product rounds once (u_acc), the mscale multiply once more when mscale != 1, the sum
  once: |y_acc - y| <= 7·u_acc·(|x1| + |x2|), to first order;
* the store rounds once to the output dtype: + u_out·|y|, u_out = 2^-p (half an ulp:
  p = 24, 11, 8 for float32, float16, bfloat16; 0 when the output is the compute dtype),
  plus half the smallest subnormal of float16 (2^-25) for outputs that small.

So ``|got - ref| <= u_out·|ref| + 8·(u_acc + u64)·A + floor`` elementwise, with
A = |x1| + |x2| the pair's inputs (the 8 covers 7·u_acc and the second-order terms; u64
covers the float64 reference's own rounding). The backward is the same form on the
output's gradient. Pass-through channels (rot_dim .. d) are copies: compared exactly.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fusedlib import unfused
from fusedlib.bench import ops as bench_ops
from fusedlib.bench.ops.rope import rope_bytes
from fusedlib.fusions.fused_rope import fused_apply_rotary_pos_emb
from fusedlib.kernels.rope import rope_bwd, rope_fwd, rope_tile
from fusedlib.models.common.embeddings import RotaryEmbedding, apply_rotary_pos_emb
from fusedlib.models.common.embeddings import rope_utils

from conftest import DEVICE, FLOAT_DTYPES  # noqa: I001

DTYPES = FLOAT_DTYPES + (torch.float64,)
U64 = 2.0**-53
#: unit roundoff of the compute dtype (float32 for every input but float64)
U_ACC = {torch.float32: 2.0**-24, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float64: U64}
#: half an ulp, relative, of one rounding to the output dtype (none when it is the compute dtype)
U_OUT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 0.0}
#: half of float16's smallest subnormal: the absolute rounding error of outputs that small
FLOOR = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 0.0, torch.float64: 0.0}

#: (d, rot_dim): full, half, non-powers of two (24, 40: 12 and 20 pairs), 2, at d = 64, 80, 128
GEOMETRIES = ((64, 64), (64, 32), (64, 24), (80, 80), (80, 40), (128, 128), (128, 2))


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE, dtype=torch.float32)).to(dtype)


def _angles(s, b, rot, interleaved=False, scale=30.0):
    """Random float32 angles [s, b, 1, rot] in about (-100, 100) radians, each stored twice
    in the channel layout ``interleaved`` pairs (as RotaryEmbedding stores them) when
    ``scale`` > 0; arbitrary (a different angle per channel) when ``interleaved`` is None."""
    if interleaved is None:
        return _randn(s, b, 1, rot, scale=scale)
    half = _randn(s, b, 1, rot // 2, scale=scale)
    if interleaved:
        return torch.stack((half, half), dim=-1).reshape(s, b, 1, rot)
    return torch.cat((half, half), dim=-1)


def _reference(t, freqs, g, interleaved, mscale=1.0):
    """Float64 output and gradient of t of Megatron's unfused formula (autograd)."""
    t64 = t.detach().double().requires_grad_(True)
    out = unfused.apply_rotary_pos_emb_bshd(t64, freqs.double(), interleaved, mscale=mscale)
    out.backward(g.double())
    return out.detach(), t64.grad


def _assert_within_bound(got, ref, x, rot, interleaved, dtype, what):
    """The module docstring's bound: rotated channels within it, pass-through channels exact."""
    assert got.shape == ref.shape and got.dtype == dtype and not torch.isnan(got).any(), what
    got64, ref, x64 = got.double(), ref.to(got.device), x.double()
    a = x64[..., :rot].abs() + unfused.rotate_half(x64[..., :rot], interleaved).abs()  # |x1| + |x2| per output
    bound = U_OUT[dtype] * ref[..., :rot].abs() + 8 * (U_ACC[dtype] + U64) * a + FLOOR[dtype]
    err = (got64[..., :rot] - ref[..., :rot]).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {err.max().item():.3g})"
    assert torch.equal(got[..., rot:], x[..., rot:].to(dtype)), f"{what}: pass-through channels changed"


def _check(t, freqs, interleaved, g=None, mscale=1.0):
    """Fused forward and backward against the float64 reference; inputs never modified."""
    dtype, rot = t.dtype, freqs.shape[-1]
    g = _randn(*t.shape, dtype=dtype) if g is None else g
    t_before, f_before, g_before = t.clone(), freqs.clone(), g.clone()
    ref, ref_dt = _reference(t, freqs, g, interleaved, mscale)
    leaf = t.detach().requires_grad_(True)  # keeps t's strides
    out = fused_apply_rotary_pos_emb(leaf, freqs, interleaved=interleaved, mscale=mscale)
    assert out.is_contiguous() and out.shape == t.shape and out.dtype == dtype
    out.backward(g)
    dt = leaf.grad
    _assert_within_bound(out.detach(), ref, t, rot, interleaved, dtype, "forward")
    _assert_within_bound(dt, ref_dt, g, rot, interleaved, dtype, "backward")
    assert torch.equal(t, t_before) and torch.equal(freqs, f_before) and torch.equal(g, g_before)
    return out, dt


# ------------------------------------------------------------------------------------------
# The kernel against float64: geometries, layouts, dtypes, shapes, strides
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("d, rot", GEOMETRIES, ids=[f"d{d}-rot{r}" for d, r in GEOMETRIES])
def test_forward_backward_every_rotary_dim(d, rot, interleaved):
    t = _randn(3, 2, 3, d)
    _check(t, _angles(3, 1, rot, interleaved), interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("d, rot", [(80, 40), (64, 64)], ids=["d80-rot40", "d64-rot64"])
def test_every_dtype(dtype, d, rot, interleaved):
    _check(_randn(3, 2, 2, d, dtype=dtype, scale=2.0), _angles(3, 1, rot, interleaved), interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_arbitrary_angles_per_channel_and_the_exact_transpose(interleaved):
    # Megatron's formula reads one angle per channel; the two channels of a pair need not
    # share it. The backward must then be the transpose (the partner's sine), not -theta.
    _check(_randn(3, 2, 2, 40), _angles(3, 2, 24, None), interleaved)


@pytest.mark.parametrize("s, b, n_heads", [(7, 5, 1), (1, 1, 3), (1, 3, 2), (5, 1, 7)])
def test_odd_shapes_and_a_single_token(s, b, n_heads):
    _check(_randn(s, b, n_heads, 24), _angles(s, 1, 24), False)


def test_more_heads_than_one_loop_step():
    # heads are processed BLOCK_H per loop step: a head count past one step, not a multiple of it
    d = rot = 128
    block_h = rope_tile(1 << 10, d, rot).BLOCK_M
    n_heads = block_h + 3
    _check(_randn(2, 1, n_heads, d), _angles(2, 1, rot), False)


def test_launch_settings_follow_the_dims_of_each_call(monkeypatch):
    # rope_tile's documented settings: BLOCK_N, the pairs per head, the power of two >= rot / 2;
    # one warp per 32 of them, between 1 and MAX_WARPS; BLOCK_M heads per step, a power of two
    # no larger than the heads', whose elements (the wider of the rotated pairs and the
    # pass-through channels) fit the warps' budget. Calls with the same heads and rotary dim but
    # another head_dim (a table of 64 two-channel heads before one of 64 heads of 128) must not
    # share an answer: more pass-through channels leave room for fewer heads per step.
    from fusedlib.kernels import rope as rope_kernels
    from fusedlib.kernels.launch import next_power_of_2

    monkeypatch.setattr(rope_kernels, "_TILES", {})
    for n_heads, d, rot in ((64, 2, 2), (64, 128, 2), (64, 128, 128), (3, 80, 40), (1, 8, 8), (32, 512, 512),
                            (16, 1024, 1024), (5, 130, 4)):
        tile = rope_tile(n_heads, d, rot)
        block_k, block_p = tile.BLOCK_N, (next_power_of_2(d - rot) if d > rot else 0)
        assert block_k == next_power_of_2(rot // 2), (n_heads, d, rot, tile)
        assert tile.num_warps == max(1, min(rope_kernels.MAX_WARPS, block_k // 32)), (n_heads, d, rot, tile)
        assert tile.BLOCK_M == next_power_of_2(tile.BLOCK_M) and 1 <= tile.BLOCK_M <= next_power_of_2(n_heads)
        width = max(2 * block_k, block_p)
        assert tile.BLOCK_M == 1 or tile.BLOCK_M * width <= tile.num_warps * rope_kernels.ELEMENTS_PER_WARP, \
            (n_heads, d, rot, tile)
        assert rope_tile(n_heads, d, rot) == tile  # the remembered answer is the same


def test_per_sample_positions():
    # freqs [s, b, 1, rot]: each sample its own positions (here offsets 0, 5, 11)
    s, b, d, rot = 5, 3, 40, 40
    emb = RotaryEmbedding(rot, 1.0, device=DEVICE)
    freqs = torch.cat([emb(s, offset=o) for o in (0, 5, 11)], dim=1)  # [s, 1, 1, rot] x 3 -> [s, 3, 1, rot]
    out, _ = _check(_randn(s, b, 2, d), freqs, False)
    # each sample equals the same op with its own [s, 1, 1, rot] angles
    t = _randn(s, b, 2, d)
    out = fused_apply_rotary_pos_emb(t, freqs)
    for i, o in enumerate((0, 5, 11)):
        torch.testing.assert_close(out[:, i:i + 1], fused_apply_rotary_pos_emb(t[:, i:i + 1], emb(s, offset=o)),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_one_position_of_angles_broadcasts_over_the_sequence(interleaved):
    # freqs [1, 1, 1, rot] (a size-1 s broadcasts, as check_rope_inputs allows): every token is
    # rotated by the same angles, as Megatron's broadcasting formula does
    _check(_randn(4, 2, 2, 40), _angles(1, 1, 24, interleaved), interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("b_freqs", [1, 3], ids=["shared", "per-sample"])
def test_a_longer_table_of_angles_is_read_at_the_first_positions(interleaved, b_freqs):
    # freqs [s2, 1 or b, 1, rot] with s2 > s, as Transformer Engine's function of this name takes
    # them (callers pass the whole position table): positions 0 .. s-1 are read, on the fused
    # and on the unfused path, bit for bit what the table cut to s rows gives
    s, b, d, rot = 5, 3, 40, 24
    table = _angles(11, b_freqs, rot, interleaved)
    t, g = _randn(s, b, 2, d), _randn(s, b, 2, d)
    out, dt = _check(t, table[:s], interleaved, g=g)
    leaf = t.detach().requires_grad_(True)
    long_out = fused_apply_rotary_pos_emb(leaf, table, interleaved=interleaved)
    long_out.backward(g)
    assert torch.equal(long_out, out) and torch.equal(leaf.grad, dt)
    for fusion in (False, True):
        config = _config(fusion, interleaved)
        assert torch.equal(apply_rotary_pos_emb(t, table, config), apply_rotary_pos_emb(t, table[:s], config))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("s2", [1, 11])
def test_an_empty_sequence_with_a_table_of_angles(interleaved, s2):
    # s = 0 with a table of one position (which broadcasts) or of 11 (read from position 0): both
    # paths return the empty output and an empty gradient, as for any other s within the table
    table = _angles(s2, 1, 24, interleaved)
    for fusion in (False, True):
        leaf = _randn(0, 3, 2, 40).requires_grad_(True)
        out = apply_rotary_pos_emb(leaf, table, _config(fusion, interleaved))
        assert out.shape == (0, 3, 2, 40)
        out.sum().backward()
        assert leaf.grad.shape == (0, 3, 2, 40)


def test_non_contiguous_inputs():
    s, b, n_heads, d, rot = 5, 3, 2, 40, 24
    # t: the query slice of a fused [s, b, np, 3d] QKV tensor (last-dim slice, larger strides)
    qkv = _randn(s, b, n_heads, 3 * d)
    q = qkv[..., :d]
    assert not q.is_contiguous()
    # freqs: a strided view too (every other position of a longer table)
    freqs = _angles(2 * s, 1, rot)[::2]
    # the output's gradient: a transposed [b, s] buffer
    g = _randn(b, s, n_heads, d).transpose(0, 1)
    _check(q, freqs, False, g=g)
    # the backward kernel reads the strided gradient as is (autograd may hand it over contiguous)
    assert torch.equal(rope_bwd(g, freqs), rope_bwd(g.contiguous(), freqs.contiguous()))
    # t: a transposed [b, s] view; a gradient flowing back into the fused QKV tensor
    x = _randn(b, s, n_heads, d).transpose(0, 1)
    _check(x, _angles(s, 1, rot), True)
    qkv.requires_grad_(True)
    out = fused_apply_rotary_pos_emb(qkv[..., :d], freqs)
    out.backward(g)
    _, ref_dt = _reference(qkv[..., :d], freqs, g, False)
    _assert_within_bound(qkv.grad[..., :d], ref_dt, g, rot, False, torch.float32, "QKV gradient")
    assert torch.equal(qkv.grad[..., d:], torch.zeros_like(qkv.grad[..., d:]))


def test_head_dim_stride_not_one():
    # channels strided: d is the slow dim of the storage
    t = _randn(3, 2, 24, 2).permute(0, 1, 3, 2)  # [3, 2, 2, 24] with stride(-1) = 2
    assert t.stride(-1) != 1
    _check(t, _angles(3, 1, 24, True), True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_angles_strided_along_the_channels(interleaved):
    # freqs whose channels are not adjacent in memory (every other column of a wider buffer):
    # the kernel must step through them by freqs.stride(-1), not assume 1
    s, b, d, rot = 4, 2, 40, 24
    wide = torch.stack((_angles(s, 1, rot, interleaved), _randn(s, 1, 1, rot, scale=30.0)), dim=-1)
    freqs = wide.reshape(s, 1, 1, 2 * rot)[..., ::2]
    assert freqs.stride(-1) == 2 and torch.equal(freqs, wide[..., 0])
    _check(_randn(s, b, 3, d), freqs, interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("d, rot", [(24, 24), (40, 24)], ids=["d24-rot24", "d40-rot24"])
def test_nothing_is_written_outside_the_output(d, rot, interleaved, monkeypatch):
    # 12 pairs in a tile of 16: the masked-off lanes must store nothing. The output is placed
    # inside a larger buffer whose cells around it hold NaN; a store past a head's rotated
    # channels lands in the next head, the next token, or after the last token's last head
    # (the cells checked here), in both the forward and the backward kernel
    from fusedlib.kernels import rope as rope_kernels

    pad, buffers = 64, []

    def guarded_empty(x):
        buf = torch.full((x.numel() + 2 * pad,), math.nan, dtype=x.dtype, device=x.device)
        buffers.append(buf)
        return buf[pad:pad + x.numel()].view(x.shape)

    monkeypatch.setattr(rope_kernels, "empty_contiguous_like", guarded_empty)
    t = _randn(3, 2, 2, d)
    for fn in (rope_fwd, rope_bwd):
        out = fn(t, _angles(3, 1, rot, interleaved), interleaved)
        assert not torch.isnan(out).any(), fn.__name__
        buf = buffers[-1]
        assert torch.isnan(buf[:pad]).all() and torch.isnan(buf[-pad:]).all(), fn.__name__


def test_empty_inputs():
    for shape in ((0, 2, 2, 8), (3, 0, 2, 8), (3, 2, 0, 8)):
        t = _randn(*shape).requires_grad_(True)
        out = fused_apply_rotary_pos_emb(t, _angles(max(shape[0], 1), 1, 8)[: shape[0]])
        assert out.shape == shape
        out.sum().backward()
        assert t.grad.shape == shape


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_mscale(interleaved):
    _check(_randn(3, 2, 2, 40), _angles(3, 1, 40, interleaved), interleaved, mscale=0.7)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_gradcheck_float64(interleaved):
    # one token (each finite difference is a kernel launch in the interpreter), 2 heads,
    # 4 rotated channels with arbitrary angles and 2 passed through
    t = _randn(1, 1, 2, 6, dtype=torch.float64).requires_grad_(True)
    freqs = _angles(1, 1, 4, None)
    assert torch.autograd.gradcheck(lambda x: fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved), (t,))


def test_launchers_without_autograd_and_the_backward_is_the_inverse_rotation():
    # rope_bwd(rope_fwd(t)) = t when both channels of a pair share the angle (a rotation's
    # transpose is its inverse): float64 to rounding.
    t = _randn(3, 2, 2, 40, dtype=torch.float64)
    freqs = _angles(3, 1, 32, True)
    back = rope_bwd(rope_fwd(t, freqs, True), freqs, True)
    torch.testing.assert_close(back, t, atol=1e-13, rtol=0)


def test_interleaved_is_half_split_on_permuted_channels():
    # interleaved pairs (2k, 2k+1) are half-split pairs (k, k + rot/2) after reordering the
    # channels [even | odd]: the two layouts of the kernel agree through that permutation
    rot, d = 24, 40
    t = _randn(3, 2, 2, d)
    half = _angles(3, 1, rot // 2)[..., : rot // 2]
    perm = torch.cat((torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d))).to(DEVICE)
    out_i = fused_apply_rotary_pos_emb(t, torch.stack((half, half), -1).reshape(3, 1, 1, rot), interleaved=True)
    out_h = fused_apply_rotary_pos_emb(t[..., perm], torch.cat((half, half), -1), interleaved=False)
    # In the interpreter (NumPy, no fused multiply-add) the two layouts give the same bits.
    # Compiled, each may contract x1·cos - x2·sin into an FMA differently: each output then
    # differs by at most one rounding of either product, 2u (|x1| + |x2|) with u = 2^-24;
    # pass-through channels are copies either way.
    th = t[..., perm]
    partner = torch.cat((th[..., rot // 2:rot], th[..., :rot // 2], torch.zeros_like(th[..., rot:])), -1)
    bound = 2 * 2.0**-24 * (th.abs() + partner.abs()) * (torch.arange(d, device=DEVICE) < rot)
    assert ((out_i[..., perm] - out_h).abs() <= bound).all()
    if not torch.cuda.is_available():
        assert torch.equal(out_i[..., perm], out_h)


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------

BAD = {
    "t not 4-D": (lambda: (_randn(3, 2, 8), _angles(3, 1, 8)), ValueError, "t must be 4-D"),
    "t integer": (lambda: (torch.ones(3, 2, 1, 8, dtype=torch.int32, device=DEVICE), _angles(3, 1, 8)),
                  TypeError, "t must have dtype"),
    "freqs 3-D": (lambda: (_randn(3, 2, 1, 8), _randn(3, 1, 8)), ValueError, "freqs must be 4-D"),
    "freqs shorter": (lambda: (_randn(3, 2, 1, 8), _angles(2, 1, 8)), ValueError,
                      r"freqs must have shape \[s2, 1, 1, rot_dim\] .* with s2 >= s = 3 \(or 1\)"),
    "freqs other b": (lambda: (_randn(3, 2, 1, 8), _angles(3, 3, 8)), ValueError, r"freqs must have shape \[s2, 1, 1"),
    "freqs per head": (lambda: (_randn(3, 2, 2, 8), _randn(3, 1, 2, 8)), ValueError, r"freqs must have shape"),
    "rot_dim > d": (lambda: (_randn(3, 2, 1, 8), _angles(3, 1, 10)), ValueError, "rot_dim must be even"),
    "rot_dim odd": (lambda: (_randn(3, 2, 1, 8), _randn(3, 1, 1, 5)), ValueError, "rot_dim must be even"),
    "rot_dim 0": (lambda: (_randn(3, 2, 1, 8), _randn(3, 1, 1, 0)), ValueError, "rot_dim must be even"),
    "freqs bf16": (lambda: (_randn(3, 2, 1, 8), _angles(3, 1, 8).bfloat16()), TypeError, "freqs must be float32"),
    "freqs float64, t float32": (lambda: (_randn(3, 2, 1, 8), _angles(3, 1, 8).double()), TypeError,
                                 "freqs must be float32"),
    "freqs a list": (lambda: (_randn(3, 2, 1, 8), [0.0] * 8), TypeError, "freqs must be a torch.Tensor"),
    "devices differ": (lambda: (_randn(3, 2, 1, 8), torch.empty(3, 1, 1, 8, device="meta", dtype=torch.float32)),
                       ValueError, "one device"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_raise_clear_errors(name):
    make, exc, match = BAD[name]
    t, freqs = make()
    with pytest.raises(exc, match=match):
        fused_apply_rotary_pos_emb(t, freqs)


BAD_ARGS = {
    # interleaved: a truthy non-bool was silently taken as True (the string "False" too)
    "interleaved str": (dict(interleaved="False"), TypeError, "interleaved must be a bool, got str"),
    "interleaved int": (dict(interleaved=1), TypeError, "interleaved must be a bool, got int"),
    "interleaved None": (dict(interleaved=None), TypeError, "interleaved must be a bool, got NoneType"),
    "transpose_output_memory str": (dict(transpose_output_memory="no"), TypeError,
                                    "transpose_output_memory must be a bool"),
    # mscale: None gave float()'s unnamed TypeError; bool and str were converted; nan, inf and
    # values beyond float32 gave non-finite outputs
    "mscale None": (dict(mscale=None), TypeError, "mscale must be a real number"),
    "mscale bool": (dict(mscale=True), TypeError, "mscale must be a real number"),
    "mscale str": (dict(mscale="1"), TypeError, "mscale must be a real number"),
    "mscale tensor": (dict(mscale=torch.tensor(1.0)), TypeError, "mscale must be a real number"),
    "mscale nan": (dict(mscale=math.nan), ValueError, "mscale must be finite"),
    "mscale inf": (dict(mscale=-math.inf), ValueError, "mscale must be finite"),
    "mscale beyond float32": (dict(mscale=1e39), ValueError, "mscale must be finite"),
}


@pytest.mark.parametrize("name", sorted(BAD_ARGS))
def test_bad_flags_and_mscale_raise_naming_them(name):
    kwargs, exc, match = BAD_ARGS[name]
    with pytest.raises(exc, match=match):
        fused_apply_rotary_pos_emb(_randn(3, 2, 1, 8), _angles(3, 1, 8), **kwargs)


@pytest.mark.parametrize("fusion", (False, True))
@pytest.mark.parametrize("name", sorted(k for k in BAD_ARGS if k.startswith("mscale")))
def test_bad_mscale_raises_on_the_unfused_path_too(name, fusion):
    # rope_utils.apply_rotary_pos_emb with apply_rope_fusion=False took None, a str or nan into
    # Megatron's unfused formula
    kwargs, exc, match = BAD_ARGS[name]
    with pytest.raises(exc, match=match):
        apply_rotary_pos_emb(_randn(3, 2, 1, 8), _angles(3, 1, 8), _config(fusion), **kwargs)


@pytest.mark.parametrize("fusion", (False, True))
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_raise_on_the_unfused_path_too(name, fusion):
    # the unfused formula took an odd rot_dim and returned a tensor of the input's shape; it
    # broadcast freqs of other shapes (per head: no error), took integer angles, and failed on
    # others inside torch ("The size of tensor a (6) must match ...", "'list' object has no
    # attribute 'shape'")
    make, exc, match = BAD[name]
    t, freqs = make()
    with pytest.raises(exc, match=match):
        apply_rotary_pos_emb(t, freqs, _config(fusion))


def test_numpy_bool_and_real_scalars_are_accepted():
    import numpy as np

    t, freqs = _randn(3, 2, 1, 8), _angles(3, 1, 8, interleaved=True)
    ref = fused_apply_rotary_pos_emb(t, freqs, interleaved=True, mscale=2.0)
    assert torch.equal(fused_apply_rotary_pos_emb(t, freqs, interleaved=np.bool_(True), mscale=np.float32(2.0)), ref)
    assert torch.equal(fused_apply_rotary_pos_emb(t, freqs, interleaved=True, mscale=2), ref)


def test_mscale_of_float32s_largest_magnitude_is_accepted_in_every_real_type():
    # |mscale| <= float32's max is the documented range: its ends are accepted whether they come
    # as a Python float, an int or a NumPy float32, and give the same output (t small enough
    # that the scaled products stay finite)
    import numpy as np

    big = torch.finfo(torch.float32).max
    t, freqs = _randn(3, 2, 1, 8, scale=2.0**-6), _angles(3, 1, 8)
    for sign in (1, -1):
        ref = fused_apply_rotary_pos_emb(t, freqs, mscale=sign * big)
        assert torch.isfinite(ref).all()
        for m in (np.float32(sign * big), sign * int(big)):
            assert torch.equal(fused_apply_rotary_pos_emb(t, freqs, mscale=m), ref), type(m)


def test_freqs_that_require_grad_raise():
    freqs = _angles(3, 1, 8).requires_grad_(True)
    with pytest.raises(ValueError, match="no gradient for freqs"):
        fused_apply_rotary_pos_emb(_randn(3, 2, 1, 8), freqs)
    with torch.no_grad():  # no graph, no gradient asked: fine
        fused_apply_rotary_pos_emb(_randn(3, 2, 1, 8), freqs)


def test_double_backward_raises():
    t = _randn(3, 2, 2, 8).requires_grad_(True)
    out = fused_apply_rotary_pos_emb(t, _angles(3, 1, 8))
    (gt,) = torch.autograd.grad(out.pow(2).sum(), t, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gt.pow(2).sum().backward()


def test_transpose_output_memory_is_ignored_with_a_warning():
    t, freqs = _randn(3, 2, 1, 8), _angles(3, 1, 8)
    with pytest.warns(UserWarning, match="transpose_output_memory"):
        out = fused_apply_rotary_pos_emb(t, freqs, True)
    assert torch.equal(out, fused_apply_rotary_pos_emb(t, freqs))


# ------------------------------------------------------------------------------------------
# The apply_rope_fusion switch (Megatron's rope_utils.apply_rotary_pos_emb)
# ------------------------------------------------------------------------------------------


def _config(fusion, interleaved=False, **kw):
    return SimpleNamespace(apply_rope_fusion=fusion, rotary_interleaved=interleaved, **kw)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_switch_dispatches_and_fused_equals_unfused(interleaved, monkeypatch):
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        monkeypatch.setattr(rope_utils, name, wrapped)

    spy("fused_apply_rotary_pos_emb", rope_utils.fused_apply_rotary_pos_emb)
    spy("_apply_rotary_pos_emb_bshd", rope_utils._apply_rotary_pos_emb_bshd)
    s, b, d = 5, 3, 40
    emb = RotaryEmbedding(d, 0.6, rotary_interleaved=interleaved, device=DEVICE)  # rot_dim 24
    freqs = emb(s)
    t, g = _randn(s, b, 2, d), _randn(s, b, 2, d)
    results = {}
    for fusion in (True, False):
        leaf = t.clone().requires_grad_(True)
        out = apply_rotary_pos_emb(leaf, freqs, config=_config(fusion, interleaved))
        out.backward(g)
        results[fusion] = (out.detach(), leaf.grad)
    assert calls == ["fused_apply_rotary_pos_emb", "_apply_rotary_pos_emb_bshd"]
    ref, ref_dt = _reference(t, freqs, g, interleaved)
    # float32: the unfused path rounds cos and sin to float32 (they are float32 already) and
    # each product and the sum once: the same bound holds for both paths
    for fusion, (out, dt) in results.items():
        _assert_within_bound(out, ref, t, 24, interleaved, torch.float32, f"fusion={fusion}")
        _assert_within_bound(dt, ref_dt, g, 24, interleaved, torch.float32, f"fusion={fusion} grad")


def test_switch_with_mscale_and_bf16():
    # bf16: the unfused path rounds cos and sin to bf16, then each product and the sum in bf16:
    # 2^-8 relative each, |err| <= 3·2^-8·(|x1| + |x2|) to first order (4·2^-8 with the
    # second-order terms and float32's cos and sin); the fused path rounds once
    s, b, d, rot = 5, 2, 40, 40
    t, freqs = _randn(s, b, 2, d, dtype=torch.bfloat16), RotaryEmbedding(rot, 1.0, device=DEVICE)(s)
    ref = unfused.apply_rotary_pos_emb_bshd(t.double(), freqs.double(), mscale=0.5)
    fused = apply_rotary_pos_emb(t, freqs, _config(True), mscale=0.5)
    plain = apply_rotary_pos_emb(t, freqs, _config(False), mscale=0.5)
    _assert_within_bound(fused, ref, t, rot, False, torch.bfloat16, "fused bf16")
    a = t.double().abs() + unfused.rotate_half(t.double(), False).abs()
    assert ((plain.double() - ref).abs() <= 4 * 2.0**-8 * a).all()
    assert (fused.double() - ref).abs().sum() < (plain.double() - ref).abs().sum()  # one rounding beats four


def test_switch_errors():
    t, freqs = _randn(3, 2, 1, 8), _angles(3, 1, 8)
    with pytest.raises(TypeError, match="apply_rope_fusion"):
        apply_rotary_pos_emb(t, freqs, SimpleNamespace(rotary_interleaved=False))
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        apply_rotary_pos_emb(t, freqs, _config(True), cu_seqlens=torch.tensor([0, 3], device=DEVICE))
    with pytest.raises(NotImplementedError, match="multi_latent_attention"):
        apply_rotary_pos_emb(t, freqs, _config(True, multi_latent_attention=True))


@pytest.mark.parametrize("field", ["apply_rope_fusion", "rotary_interleaved", "multi_latent_attention"])
@pytest.mark.parametrize("fusion", (False, True))
def test_switch_fields_must_be_bools_on_both_paths(field, fusion):
    # config may be any object with the fields: with rotary_interleaved="False" the fused path
    # refused it, the unfused one rotated interleaved pairs; apply_rope_fusion="False" took the
    # fused path, multi_latent_attention="False" the MLA reordering
    import numpy as np

    t, freqs = _randn(3, 2, 1, 8), _angles(3, 1, 8)
    fields = dict(apply_rope_fusion=fusion, rotary_interleaved=False, multi_latent_attention=False)
    for bad, got in (("False", "str"), (0, "int"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"config.{field} must be a bool, got {got}"):
            apply_rotary_pos_emb(t, freqs, SimpleNamespace(**{**fields, field: bad}))
    want = apply_rotary_pos_emb(t, freqs, SimpleNamespace(**fields))
    numpy_fields = {**fields, field: np.bool_(fields[field])}
    assert torch.equal(apply_rotary_pos_emb(t, freqs, SimpleNamespace(**numpy_fields)), want)


def test_unfused_multi_latent_attention_reorders_then_rotates():
    # MLA: channels [even | odd] first, then half-split rotation (Megatron's unfused path)
    t, freqs = _randn(3, 2, 2, 12, dtype=torch.float64), _angles(3, 1, 8).double()
    got = apply_rotary_pos_emb(t, freqs, _config(False, multi_latent_attention=True))
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11], device=DEVICE)
    torch.testing.assert_close(got, unfused.apply_rotary_pos_emb_bshd(t[..., perm], freqs), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------
# RotaryEmbedding: Megatron's angles
# ------------------------------------------------------------------------------------------


def _megatron_freqs(kv_channels, rotary_percent, s, offset=0, interleaved=False, factor=None, base=10000):
    """Megatron-core's RotaryEmbedding.forward, its float32 operations written out."""
    dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEVICE) / dim))
    seq = torch.arange(s, device=DEVICE, dtype=torch.float32) + offset
    if factor is not None:
        seq *= 1 / factor
    freqs = torch.outer(seq, inv_freq)
    if interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_rotary_embedding_of_no_positions(interleaved):
    # max_seq_len = 0: an empty table of the channel layout's width, in either layout
    emb = RotaryEmbedding(64, 0.5, rotary_interleaved=interleaved, device=DEVICE)
    freqs = emb(0)
    assert freqs.shape == (0, 1, 1, 32) and freqs.dtype == torch.float32


@pytest.mark.parametrize("kv, pct, offset, interleaved, factor", [
    (128, 1.0, 0, False, None), (128, 0.5, 3, True, None), (80, 0.3, 0, False, 4.0), (64, 0.25, 7, True, 2.5)])
def test_rotary_embedding_freqs_are_megatrons_formula(kv, pct, offset, interleaved, factor):
    s = 9
    emb = RotaryEmbedding(kv, pct, rotary_interleaved=interleaved, seq_len_interpolation_factor=factor, device=DEVICE)
    freqs = emb(s, offset=offset)
    want = _megatron_freqs(kv, pct, s, offset, interleaved, factor)
    assert freqs.dtype == torch.float32 and freqs.shape == want.shape and torch.equal(freqs, want)
    # and the values: angle (p + offset) / factor / base^(2i/dim) per pair, within float32 rounding
    dim = want.shape[-1]
    i = torch.arange(dim // 2, dtype=torch.float64, device=DEVICE)
    p = (torch.arange(s, dtype=torch.float64, device=DEVICE) + offset) / (factor or 1.0)
    exact = p[:, None] / 10000.0 ** (2 * i / dim)
    pairs = freqs[:, 0, 0].double().view(s, dim // 2, 2) if interleaved else freqs[:, 0, 0].double().view(s, 2, -1)
    for j in range(2):
        got = pairs[..., j] if interleaved else pairs[:, j]
        # float32: the exponent 2i/dim rounds (u), which base^e turns into ln(10000)·u = 9.2u;
        # pow (2 ulps = 2u), the reciprocal, 1/factor, its product and the outer product (u each)
        torch.testing.assert_close(got, exact, atol=0, rtol=16 * 2.0**-24)


def test_rotary_embedding_module_behaviour():
    emb = RotaryEmbedding(64, 1.0, device=DEVICE)
    assert emb(8) is emb(8)  # cached, as Megatron's lru_cache
    assert emb.state_dict() == {}  # inv_freq is not state, as in Megatron
    emb.load_state_dict({"inv_freq": torch.zeros(32)})  # old checkpoints carrying it load, ignored
    assert torch.equal(emb(8), _megatron_freqs(64, 1.0, 8))
    emb.bfloat16()
    assert emb.inv_freq.dtype == torch.float32 and emb(8).dtype == torch.float32  # casts leave the angles exact
    cpu = RotaryEmbedding(64, 1.0, use_cpu_initialization=True)
    assert cpu.inv_freq.device.type == "cpu"
    assert RotaryEmbedding(64, 1.0, device=DEVICE).to("meta").inv_freq.device.type == "meta"  # follows .to(device)
    seq_len = emb.get_rotary_seq_len(None, None, torch.empty(6, 2, 4, device=DEVICE), SimpleNamespace())
    assert seq_len == 6
    assert emb.get_rotary_seq_len(None, None, torch.empty(6, 2, 4, device=DEVICE),
                                  SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2)) == 12


def test_rotary_embedding_cache_is_keyed_by_the_positions_computed():
    # the cache keyed int(offset) and int(max_seq_len): forward(4, offset=0.5) was cached as
    # (4, 0), and forward(4) then returned the angles of positions 0.5 .. 3.5; forward(2.5)
    # (3 positions, torch.arange's length) was cached as 2
    emb = RotaryEmbedding(16, 1.0, device=DEVICE)
    half = emb(4, offset=0.5)
    assert torch.equal(half, _megatron_freqs(16, 1.0, 4, offset=0.5))
    assert torch.equal(emb(4), _megatron_freqs(16, 1.0, 4))
    assert torch.equal(emb(4, offset=0.5), half)
    import numpy as np

    assert emb(np.int64(4)) is emb(4) and emb(torch.tensor(4), offset=np.int32(0)) is emb(4)  # one key: ints
    for args, exc, match in (((2.5,), TypeError, "max_seq_len must be an int"),
                             ((True,), TypeError, "max_seq_len must be an int"),
                             ((-1,), ValueError, "max_seq_len must be >= 0"),
                             ((4, "1"), TypeError, "offset must be an int"),
                             ((4, float("nan")), ValueError, "offset must be finite")):
        with pytest.raises(exc, match=match):
            emb(*args)
    assert emb(0).shape == (0, 1, 1, 16)


def test_rotary_embedding_rope_scaling_is_llama3s():
    emb = RotaryEmbedding(128, 1.0, rope_scaling=True, rope_scaling_factor=8.0, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * math.pi / inv
    # Llama 3.1: wavelengths under 8192/4 kept, over 8192/1 divided by 8, between interpolated
    smooth = (8192 / wavelen - 1) / (4 - 1)
    want = torch.where(wavelen < 2048, inv, torch.where(wavelen > 8192, inv / 8, (1 - smooth) * inv / 8 + smooth * inv))
    torch.testing.assert_close(emb.inv_freq.double().cpu(), want, atol=0, rtol=1e-6)
    assert (wavelen < 2048).any() and (wavelen > 8192).any() and ((wavelen >= 2048) & (wavelen <= 8192)).any()


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"kv_channels": 0, "rotary_percent": 1.0}, ValueError, "kv_channels"),
    ({"kv_channels": 64, "rotary_percent": 0.0}, ValueError, "rotary_percent"),
    ({"kv_channels": 64, "rotary_percent": 1.5}, ValueError, "rotary_percent"),
    ({"kv_channels": 4, "rotary_percent": 0.2}, ValueError, "rounds to 0"),
    ({"kv_channels": 64, "rotary_percent": 1.0, "seq_len_interpolation_factor": 0.0}, ValueError, "interpolation"),
    ({"kv_channels": 64, "rotary_percent": 1.0, "cp_group": SimpleNamespace(size=lambda: 2)},
     NotImplementedError, "context parallelism"),
])
def test_rotary_embedding_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RotaryEmbedding(**kwargs)


def test_megatron_core_parity(monkeypatch):
    """megatron-core's own RotaryEmbedding and unfused apply_rotary_pos_emb, where it imports."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (a test oracle only)")
    if DEVICE.type == "cpu":  # its forward moves inv_freq to torch.cuda.current_device(): here, the CPU
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    from megatron.core.models.common.embeddings import rope_utils as mc_rope
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding as McRotaryEmbedding

    class _OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    for interleaved in (False, True):
        mc = McRotaryEmbedding(80, 0.3, rotary_interleaved=interleaved, seq_len_interpolation_factor=2.0,
                               use_cpu_initialization=True, cp_group=_OneRank())
        # the same device for inv_freq as megatron-core's (pow rounds differently on CPU and GPU)
        ours = RotaryEmbedding(80, 0.3, rotary_interleaved=interleaved, seq_len_interpolation_factor=2.0,
                               use_cpu_initialization=True)
        freqs = mc(7, offset=2)
        assert torch.equal(ours(7, offset=2).to(freqs.device), freqs)  # megatron-core moves it to the GPU
        t = _randn(7, 2, 3, 80, dtype=torch.float64)
        cfg = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=False,
                              mrope_section=None)
        want = mc_rope.apply_rotary_pos_emb(t, freqs.double(), cfg, cp_group=_OneRank())
        assert torch.equal(apply_rotary_pos_emb(t, freqs.double(), _config(False, interleaved)), want)
        got = apply_rotary_pos_emb(t.float(), freqs, _config(True, interleaved))
        _assert_within_bound(got, want, t.float(), 24, interleaved, torch.float32, "fused vs megatron-core")


# ------------------------------------------------------------------------------------------
# The benchmark case
# ------------------------------------------------------------------------------------------


def test_bench_case_builds_and_runs_on_cpu_at_a_tiny_shape():
    shape = (5, 2, 3, 16)
    case = bench_ops.get_case("rope")(shape, torch.float32)
    assert case.op == "rope" and case.shape == shape and case.dtype == torch.float32
    names = {impl.name for impl in case.impls}
    assert {"fusedlib", "eager", "torch.compile"} <= names
    assert ("megatron-core" in names) != ("megatron-core" in case.skipped)
    assert case.bytes == rope_bytes(*shape, 4)
    t, freqs = case.make_inputs(DEVICE, True)
    assert t.requires_grad and not freqs.requires_grad and freqs.shape == (5, 1, 1, 16)
    g = _randn(*shape)
    results = {}
    for impl in case.impls:
        if impl.name == "torch.compile":
            continue  # compiling on CPU needs a C compiler and minutes; its function is eager's
        t.grad = None
        out = impl.fn(t, freqs)
        out.backward(g)
        results[impl.name] = (out.detach(), t.grad.clone())
    ref, ref_dt = _reference(t, freqs, g, False)
    for name, (out, dt) in results.items():
        _assert_within_bound(out, ref, t.detach(), 16, False, torch.float32, name)
        _assert_within_bound(dt, ref_dt, g, 16, False, torch.float32, name)
    headline = bench_ops.get_cases("rope")(torch.device("cpu"))[0]
    assert headline.shape == (4096, 2, 32, 128) and headline.dtype == torch.bfloat16


def test_rope_bytes_are_the_floor():
    b = rope_bytes(10, 3, 4, 8, 2)
    n = 10 * 3 * 4 * 8
    assert b["fwd"] == 2 * n * 2 + 10 * 8 * 4  # read t, write out; the float32 angles once
    assert b["fwd+bwd"] == 2 * b["fwd"]  # read g, write dt; the angles once more


def test_unfused_multi_latent_attention_checks_its_tensors():
    # this path skipped the checks of the others: an int t came back as int zeros (cos and sin
    # cast to t's dtype), fp16 or int angles were taken, wrong shapes failed deep in torch
    cfg = _config(False, multi_latent_attention=True)
    t, freqs = _randn(3, 2, 2, 8), _angles(3, 1, 8)
    with pytest.raises(TypeError, match="t must have dtype"):
        apply_rotary_pos_emb(torch.randint(-5, 5, (3, 2, 2, 8), device=DEVICE), freqs, cfg)
    with pytest.raises(TypeError, match="freqs must be float32"):
        apply_rotary_pos_emb(t, freqs.half(), cfg)
    with pytest.raises(ValueError, match=r"freqs must have shape \[s2, 1, 1, rot_dim\] or \[s2, b, 1, rot_dim\]"):
        apply_rotary_pos_emb(t, _angles(3, 1, 8).reshape(3, 1, 1, 8).expand(3, 1, 2, 8), cfg)


@pytest.mark.parametrize("kv", [7, 81])
def test_rotary_embedding_refuses_an_odd_head_rotated_whole(kv):
    # RoPE rotates pairs: an odd dim gets dim + 1 angles, more than an odd head has, refused only at
    # the first forward by the op, naming freqs and t, which the user never passed
    with pytest.raises(ValueError, match=rf"RoPE rotates pairs of channels: kv_channels = {kv} with rotary_percent "
                                         rf"= 1.0 gives {kv} rotary channels, whose {(kv + 1) // 2} pairs need "
                                         rf"{kv + 1} > {kv} channels"):
        RotaryEmbedding(kv, 1.0, device=DEVICE)


@pytest.mark.parametrize("kv, pct", [(10, 0.5), (14, 0.5)])
def test_rotary_embedding_takes_an_odd_partial_rotary_dim_as_megatron(kv, pct):
    # int(kv·pct) odd below rotary_percent 1: dim + 1 angles (Megatron-core's arange(0, dim, 2)),
    # which fit the head; the channels past them pass through the op unrotated
    torch.manual_seed(77)
    freqs = RotaryEmbedding(kv, pct, device=DEVICE)(4)
    dim = int(kv * pct)
    assert freqs.shape == (4, 1, 1, dim + 1) and torch.equal(freqs, _megatron_freqs(kv, pct, 4))
    t = torch.randn(4, 1, 2, kv, device=DEVICE)
    out = fused_apply_rotary_pos_emb(t, freqs)
    assert torch.equal(out[..., dim + 1:], t[..., dim + 1:])


def test_rotary_embedding_checks_its_int_and_bool_arguments():
    np = pytest.importorskip("numpy")
    emb = RotaryEmbedding(np.int64(16), 1.0, device=DEVICE)  # numpy ints, as TransformerConfig takes them
    assert torch.equal(emb(5), RotaryEmbedding(16, 1.0, device=DEVICE)(5))
    with pytest.raises(TypeError, match="kv_channels must be an int >= 1, got bool"):
        RotaryEmbedding(True, 1.0, device=DEVICE)
    with pytest.raises(TypeError, match="kv_channels must be an int >= 1, got float"):
        RotaryEmbedding(16.0, 1.0, device=DEVICE)
    for name in ("rotary_interleaved", "rope_scaling", "use_cpu_initialization"):
        with pytest.raises(TypeError, match=f"{name} must be a bool, got str 'False'"):
            RotaryEmbedding(16, 1.0, **{name: "False"}, device=DEVICE)  # was read as True


@pytest.mark.parametrize("base", [500000, 10.0])
def test_rotary_embedding_rotary_base_sets_the_frequencies(base):
    # the tests above all ran at the default base 10000: a module that ignored rotary_base passed
    s, kv = 9, 32
    freqs = RotaryEmbedding(kv, 1.0, rotary_base=base, device=DEVICE)(s)
    assert torch.equal(freqs, _megatron_freqs(kv, 1.0, s, base=base))
    i = torch.arange(kv // 2, dtype=torch.float64, device=DEVICE)
    exact = torch.arange(s, dtype=torch.float64, device=DEVICE)[:, None] / float(base) ** (2 * i / kv)
    # the bound of test_rotary_embedding_freqs_are_megatrons_formula with ln(base) for ln(10000):
    # the exponent's rounding ln(500000)·u = 13.1u, pow 2u, the reciprocal and the product u each
    torch.testing.assert_close(freqs[:, 0, 0, : kv // 2].double(), exact, atol=0, rtol=18 * 2.0**-24)


@pytest.mark.parametrize("factor", [4.0, 16.0])
def test_rotary_embedding_rope_scaling_takes_its_factor(factor):
    # test_rotary_embedding_rope_scaling_is_llama3s uses 8.0, the default: a module that dropped
    # the factor passed it
    emb = RotaryEmbedding(128, 1.0, rope_scaling=True, rope_scaling_factor=factor, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * math.pi / inv
    smooth = (8192 / wavelen - 1) / (4 - 1)
    want = torch.where(wavelen < 2048, inv,
                       torch.where(wavelen > 8192, inv / factor, (1 - smooth) * inv / factor + smooth * inv))
    torch.testing.assert_close(emb.inv_freq.double().cpu(), want, atol=0, rtol=1e-6)


def test_rotary_embedding_rope_scaling_factor_defaults_to_8():
    default = RotaryEmbedding(128, 1.0, rope_scaling=True, device=DEVICE)
    assert torch.equal(default.inv_freq, RotaryEmbedding(128, 1.0, rope_scaling=True, rope_scaling_factor=8.0,
                                                         device=DEVICE).inv_freq)
    assert not torch.equal(default.inv_freq, RotaryEmbedding(128, 1.0, device=DEVICE).inv_freq)


def test_rotary_embedding_get_cos_sin_are_the_cosine_and_sine_of_the_angles():
    emb = RotaryEmbedding(16, 1.0, seq_len_interpolation_factor=2.0, device=DEVICE)
    cos, sin = emb.get_cos_sin(5, offset=3)
    angles = _megatron_freqs(16, 1.0, 5, offset=3, factor=2.0)[:, 0, 0, :8]  # [s, dim/2]
    assert cos.shape == sin.shape == (5, 8)
    assert torch.equal(cos, torch.cos(angles)) and torch.equal(sin, torch.sin(angles))


def test_rotary_embedding_get_rotary_seq_len_follows_megatron():
    emb = RotaryEmbedding(16, 1.0, device=DEVICE)
    x = torch.empty(6, 2, 4, device=DEVICE)
    block = SimpleNamespace(input_tensor=torch.empty(5, 2, 4, device=DEVICE))
    cfg = SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=2, context_parallel_size=3)
    assert emb.get_rotary_seq_len(None, None, x, cfg) == 6 * 3  # context parallelism: the whole sequence
    assert emb.get_rotary_seq_len(None, block, x, cfg) == 5 * 3  # the block's input tensor, when set
    assert emb.get_rotary_seq_len(None, SimpleNamespace(input_tensor=None), x, cfg) == 6 * 3
    assert emb.get_rotary_seq_len(SimpleNamespace(max_sequence_length=11), block, x, cfg) == 11 * 3  # inference
    packed = SimpleNamespace(max_seqlen_q=4, max_seqlen_kv=9)
    assert emb.get_rotary_seq_len(None, block, x, cfg, packed_seq_params=packed) == 9
    assert emb.get_rotary_seq_len(None, block, x, cfg, SimpleNamespace(max_seqlen_q=9, max_seqlen_kv=4)) == 9


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_rotary_embedding_angles_cached_under_inference_mode_serve_training_afterwards(fusion):
    # angles made by a forward under torch.inference_mode are inference tensors, which autograd
    # cannot save for a backward: a training call at the same length afterwards gets angles it
    # can differentiate through (the fused RoPE saves them), equal to the ones cached before
    s, b, d = 5, 2, 16
    emb = RotaryEmbedding(d, 1.0, device=DEVICE)
    with torch.inference_mode():
        inside = emb(s)
        assert emb(s) is inside
    freqs = emb(s)
    t, g = _randn(s, b, 2, d), _randn(s, b, 2, d)
    leaf = t.clone().requires_grad_(True)
    out = apply_rotary_pos_emb(leaf, freqs, config=_config(fusion))
    out.backward(g)
    ref, ref_dt = _reference(t, freqs, g, False)
    _assert_within_bound(out.detach(), ref, t, d, False, torch.float32, "forward")
    _assert_within_bound(leaf.grad, ref_dt, g, d, False, torch.float32, "backward")
    assert not freqs.is_inference() and torch.equal(freqs, inside)
    assert emb(s) is freqs  # cached too


def test_rotary_embedding_cache_keeps_the_newest_angles():
    # FORWARD_CACHE_SIZE entries: past them the oldest goes, and the angles just computed stay
    # cached (evicting the newest made every new length recomputed at each call once full)
    from fusedlib.models.common.embeddings.rotary_pos_embedding import FORWARD_CACHE_SIZE

    emb = RotaryEmbedding(8, 1.0, device=DEVICE)
    first = emb(1)
    for n in range(2, FORWARD_CACHE_SIZE + 3):
        assert emb(n) is emb(n), n
    assert emb(1) is not first and torch.equal(emb(1), first)  # evicted, recomputed


def test_rotary_embedding_cache_evicts_the_least_recently_used_as_lru_cache():
    # a length used between new ones stays cached (Megatron's functools.lru_cache): a hit makes
    # an entry the most recently used, so the entry evicted is the one unused the longest
    from fusedlib.models.common.embeddings.rotary_pos_embedding import FORWARD_CACHE_SIZE

    emb = RotaryEmbedding(8, 1.0, device=DEVICE)
    steady, other = emb(1), emb(2)
    for n in range(3, 3 + 2 * FORWARD_CACHE_SIZE):
        assert emb(1) is steady, n  # used at every step: never evicted
        emb(n)
    assert emb(2) is not other and torch.equal(emb(2), other)  # unused since: evicted, recomputed
