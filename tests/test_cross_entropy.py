"""Vocab-parallel cross entropy: fusedlib's unfused and fused paths against float64 PyTorch.

Single process (tensor-parallel size 1): every dtype, odd vocabulary sizes, label smoothing,
ignore_index, non-contiguous inputs, gradcheck, bad input, the fixes to Megatron-core.
Several processes (gloo on CPU, world sizes 1, 2 and 4): every rank's loss and gradient
shard against ``F.cross_entropy`` on the gathered logits in float64, the collective counts
(3 or 4 against 2), and Megatron-core's own unit test.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import fusedlib
from fusedlib import unfused
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.kernels.cross_entropy import STAT_ROWS
from fusedlib.parallel import VocabParallelCrossEntropy, VocabUtility, count_collectives, vocab_parallel_cross_entropy
from fusedlib.parallel.demo import run_tp
from fusedlib.parallel.utils import all_reduce

from conftest import DEVICE, FLOAT_DTYPES, assert_close  # noqa: I001

PATHS = ("unfused", "fused")
ALL_DTYPES = FLOAT_DTYPES + (torch.float64,)
VOCAB = (1, 7, 1000, 5000)  # one id, tiny, non power of two, longer than one 4 Ki loop step
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ce(path: str, x, t, label_smoothing: float = 0.0, ignore_index: int = -100, tp_group=None):
    """Call one of the two entry points with the same arguments."""
    if path == "unfused":
        return vocab_parallel_cross_entropy(x, t, label_smoothing, tp_group, ignore_index=ignore_index)
    return fused_vocab_parallel_cross_entropy(x, t, tp_group, label_smoothing=label_smoothing,
                                              ignore_index=ignore_index)


def loss_tol(dtype: torch.dtype) -> torch.dtype:
    # The loss is computed in float32 (float64 for float64) from logits that are exact in
    # float64, so it is as accurate as float32 arithmetic whatever the logits' dtype.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inputs(shape, vocab, dtype, n_ignored=1, ignore_index=-100):
    x = (3 * torch.randn(*shape, vocab, device=DEVICE, dtype=torch.float64)).to(dtype).requires_grad_(True)
    t = torch.randint(0, vocab, shape, device=DEVICE)
    t.view(-1)[:n_ignored] = ignore_index
    return x, t


def _check(path, x, t, label_smoothing=0.0, ignore_index=-100, g=None):
    """Forward and backward against the float64 reference; input and grad_output untouched."""
    dtype = x.dtype
    x_before = x.detach().clone()
    loss = ce(path, x, t, label_smoothing, ignore_index)
    assert loss.shape == t.shape and loss.dtype == loss_tol(dtype)
    x64 = x.detach().double()
    assert_close(loss, unfused.cross_entropy(x64, t, label_smoothing, ignore_index), loss_tol(dtype),
                 scale=max(1.0, math.log(x.shape[-1])))
    g = torch.randn(t.shape, device=DEVICE, dtype=loss.dtype) if g is None else g
    g_before = g.clone()
    loss.backward(g)
    assert torch.equal(g, g_before), "grad_output was modified"
    assert torch.equal(x.detach(), x_before), "logits were modified"
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    assert_close(x.grad, unfused.cross_entropy_grad(x64, t, g.double(), label_smoothing, ignore_index), dtype)
    return loss


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("vocab", VOCAB)
def test_forward_backward(path, dtype, vocab):
    shape = (3, 2) if vocab < 5000 else (2, 2)  # [s, b]
    _check(path, *_inputs(shape, vocab, dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_label_smoothing_matches_torch_with_converted_epsilon(path, dtype):
    # Megatron's epsilon spreads over the V - 1 wrong ids: F.cross_entropy(label_smoothing=eps·V/(V-1)).
    x, t = _inputs((4, 3), 1000, dtype)
    _check(path, x, t, label_smoothing=0.1)
    assert unfused.megatron_smoothing_to_torch(0.1, 1000) == pytest.approx(0.1 * 1000 / 999)


@pytest.mark.parametrize("path", PATHS)
def test_ignore_index_rows_have_zero_loss_and_zero_gradient(path):
    x, t = _inputs((6,), 300, torch.float32, n_ignored=0)
    t[[1, 4]] = -1
    loss = _check(path, x, t, label_smoothing=0.05, ignore_index=-1)
    assert torch.equal(loss[[1, 4]], torch.zeros(2, device=DEVICE))
    assert torch.equal(x.grad[[1, 4]], torch.zeros(2, 300, device=DEVICE))
    assert (loss[[0, 2, 3, 5]] > 0).all()


@pytest.mark.parametrize("path", PATHS)
def test_ignore_index_can_be_a_vocabulary_id_and_all_rows_ignored(path):
    x, t = _inputs((5,), 40, torch.float32, n_ignored=0)
    t[:] = torch.tensor([3, 0, 3, 9, 39])
    _check(path, x, t, ignore_index=3)  # PyTorch allows an ignore_index inside [0, V)
    x2, t2 = _inputs((4,), 40, torch.bfloat16, n_ignored=4)
    loss = ce(path, x2, t2)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(4, device=DEVICE)) and torch.equal(x2.grad, torch.zeros_like(x2))


@pytest.mark.parametrize("path", PATHS)
def test_fp32_logits_are_not_modified(path):
    # Megatron subtracts the max from vocab_parallel_logits.float() in place: for float32
    # logits .float() is no copy, so the caller's logits change.
    x, t = _inputs((8,), 64, torch.float32)
    before = x.detach().clone()
    ce(path, x, t, 0.1).sum().backward()
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gradient_has_the_logits_dtype(path, dtype):
    # Megatron's fused path returned bfloat16 whatever the logits' dtype.
    x, t = _inputs((3,), 20, dtype)
    ce(path, x, t).sum().backward()
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", (7, 100, -2, -101))
def test_targets_outside_the_vocabulary_raise(path, bad):
    # On the CPU the call raises; on CUDA the kernel reports it without a host sync and
    # check_errors() raises (tests/test_compile_graph.py tests each mode on its own).
    x, t = _inputs((5,), 7, torch.float32)
    t[2] = bad
    op = "vocab_parallel_cross_entropy" if path == "unfused" else "fused_vocab_parallel_cross_entropy"
    with pytest.raises(ValueError, match=rf"^{op}: target must hold vocabulary ids in \[0, 7\) or ignore_index=-100, "
                                         rf"got {bad} \(its loss and gradient are NaN\)"):
        loss = ce(path, x, t)
        fusedlib.runtime.check_errors()
    assert DEVICE.type == "cpu" or torch.isnan(loss[2])
    fusedlib.runtime.check_errors()  # reported once


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (torch.randn(4, 8), torch.randn(4)), TypeError, "target must have dtype in"),
        (lambda: (torch.randn(4, 8).int(), torch.zeros(4, dtype=torch.long)), TypeError,
         "vocab_parallel_logits must have dtype in"),
        (lambda: (torch.randn(4, 8), torch.zeros(3, dtype=torch.long)), ValueError,
         r"target must have shape \[4\] \(the logits' shape without the vocabulary dim\), got \[3\]"),
        (lambda: (torch.randn(4, 0), torch.zeros(4, dtype=torch.long)), ValueError, "at least 1 column"),
        ([1.0, 2.0], TypeError, "vocab_parallel_logits must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_clear_error(path, make, error, match):
    if callable(make):
        x, t = make()
        x, t = x.to(DEVICE), t.to(DEVICE)
    else:
        x, t = make, torch.zeros(2, dtype=torch.long)
    with pytest.raises(error, match=match):
        ce(path, x, t)


@pytest.mark.parametrize("path", PATHS)
def test_bad_label_smoothing_and_ignore_index_raise(path):
    x, t = _inputs((3,), 5, torch.float32)
    for eps in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\)"):
            ce(path, x, t, eps)
    with pytest.raises(ValueError, match="label_smoothing needs a vocabulary of at least 2 ids"):
        ce(path, *_inputs((3,), 1, torch.float32), 0.1)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        ce(path, x, t, ignore_index=-100.0)


def test_a_signature_that_passed_the_checks_skips_them_and_a_bad_one_never_does(count_calls):
    # On one rank the fused forward checks its arguments only when no plan matches the call's
    # signature; a plan is remembered only for a signature that passed (the key holds all the
    # checks read, label_smoothing's and ignore_index's types included).
    import fusedlib.fusions.fused_cross_entropy as fce

    checks = count_calls(fce, "_check_one_rank")
    x, t = _inputs((6,), 9, torch.float32, ignore_index=1)
    loss = fused_vocab_parallel_cross_entropy(x, t, ignore_index=1)
    assert len(checks) == 1
    assert torch.equal(fused_vocab_parallel_cross_entropy(x, t, ignore_index=1), loss) and len(checks) == 1
    x2, t2 = _inputs((6,), 9, torch.float32, ignore_index=1)
    fused_vocab_parallel_cross_entropy(x2, t2, ignore_index=1)
    assert len(checks) == 1  # new values, the same signature
    fused_vocab_parallel_cross_entropy(x2[:5], t2[:5], ignore_index=1)
    assert len(checks) == 2  # a new shape: checked once
    for _ in range(2):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            fused_vocab_parallel_cross_entropy(x, t, ignore_index=True)  # equal to 1 as a key, but a bool
        with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\)"):
            fused_vocab_parallel_cross_entropy(x, t, label_smoothing=False)  # equal to 0.0, but a bool
        with pytest.raises(TypeError, match="target must have dtype in"):
            fused_vocab_parallel_cross_entropy(x, t.float(), ignore_index=1)
        with pytest.raises(TypeError, match="vocab_parallel_logits must be a torch.Tensor"):
            fused_vocab_parallel_cross_entropy(x.tolist(), t, ignore_index=1)
        with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\)"):
            fused_vocab_parallel_cross_entropy(x, t, label_smoothing=[0.1])  # unhashable: the check's to refuse

    class Smoothing(float):  # a Real that is not a float: not keyed (its value may change), checked every call
        pass

    n = len(checks)
    for _ in range(2):
        assert torch.equal(fused_vocab_parallel_cross_entropy(x, t, label_smoothing=Smoothing(0.0), ignore_index=1),
                           loss)
    assert len(checks) == n + 2
    # the unchecked kernel-layer call's plans never stand for the op's checks
    from fusedlib.kernels.cross_entropy import cross_entropy_fwd

    x2 = x.detach()
    with warnings.catch_warnings():  # what the unchecked call computes is not the point
        warnings.simplefilter("ignore", RuntimeWarning)
        cross_entropy_fwd(x2, t, 0, 1, 1.5, None, finalize=True, check=fce.TARGET_CHECK)
    with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\)"):
        fused_vocab_parallel_cross_entropy(x2, t, label_smoothing=1.5, ignore_index=1)


def test_mixed_devices_raise():
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    with pytest.raises(ValueError, match="one device, got vocab_parallel_logits on"):
        fused_vocab_parallel_cross_entropy(torch.randn(4, 8, device=DEVICE), torch.zeros(4, dtype=torch.long,
                                                                                         device=other))


@pytest.mark.parametrize("path", PATHS)
def test_non_contiguous_logits_target_and_grad(path):
    # a transposed [N, V] (column stride N), a vocabulary slice, a permuted [b, s, V] -> [s, b, V]
    xt = (3 * torch.randn(300, 6, device=DEVICE)).t().requires_grad_(True)
    t = torch.randint(0, 300, (12,), device=DEVICE)[::2]
    assert not xt.is_contiguous() and not t.is_contiguous()
    _check(path, xt, t, label_smoothing=0.1)
    xs = (3 * torch.randn(3, 2, 64, device=DEVICE))[:, :, :50].requires_grad_(True)
    _check(path, xs, torch.randint(0, 50, (3, 2), device=DEVICE))
    xp = (3 * torch.randn(2, 3, 50, device=DEVICE, dtype=torch.bfloat16)).permute(1, 0, 2).requires_grad_(True)
    tp = torch.randint(0, 50, (2, 3), device=DEVICE).t()
    g = torch.randn(2, 3, device=DEVICE).t()  # a non-contiguous grad_output
    _check(path, xp, tp, g=g)


@pytest.mark.parametrize("path", PATHS)
def test_broadcast_grad_output_of_a_mean(path):
    x, t = _inputs((4, 3), 33, torch.float32, n_ignored=0)
    ce(path, x, t).mean().backward()  # grad_output arrives as an expanded scalar (stride 0)
    ref = unfused.cross_entropy_grad(x.detach().double(), t, torch.full(t.shape, 1 / 12, dtype=torch.float64, device=DEVICE))
    assert_close(x.grad, ref, torch.float32)


@pytest.mark.parametrize("path", PATHS)
def test_strided_and_stride_zero_grad_output_of_per_token_losses(path):
    # a 1-D loss keeps the strides of the grad_output it is given: every other element of a
    # longer tensor (stride 2), and one value expanded to every row (stride 0)
    x, t = _inputs((7,), 33, torch.float32)
    g = torch.randn(14, device=DEVICE)[::2]
    assert g.stride() == (2,)
    _check(path, x, t, g=g)
    x, t = _inputs((7,), 33, torch.float32)
    g = torch.full((1,), 0.75, device=DEVICE).expand(7)
    assert g.stride() == (0,)
    _check(path, x, t, g=g)


@pytest.mark.parametrize("path", PATHS)
def test_one_row_int32_target_and_empty_batch(path):
    x, t = _inputs((1,), 129, torch.float16)
    _check(path, x, t.int())
    x0 = torch.randn(0, 3, 17, device=DEVICE, requires_grad=True)
    loss = ce(path, x0, torch.zeros(0, 3, dtype=torch.long, device=DEVICE))
    assert loss.shape == (0, 3)
    loss.sum().backward()
    assert x0.grad.shape == (0, 3, 17)


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_float64(path):
    # float64 logits run the same kernels computing in float64, so gradcheck checks them.
    x = torch.randn(3, 2, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[1, 5], [-100, 0], [3, 3]], device=DEVICE)
    assert torch.autograd.gradcheck(lambda x: ce(path, x, t, 0.2), (x,))


@pytest.mark.parametrize("path", PATHS)
def test_extreme_logits_stay_finite(path):
    # -inf logits (a masked vocabulary) are skipped; large logits do not overflow exp.
    x = torch.tensor([[0.0, float("-inf"), 2.0], [1e4, 1e4 - 1, -1e4], [float("-inf"), 5.0, float("-inf")]],
                     device=DEVICE, requires_grad=True)
    t = torch.tensor([0, 1, 1], device=DEVICE)
    loss = ce(path, x, t)
    loss.sum().backward()
    ref = F.cross_entropy(x.detach().double(), t, reduction="none")
    assert_close(loss, ref, torch.float32)
    assert torch.isfinite(x.grad).all()


def test_megatron_unit_test_single_rank():
    # Megatron-core's tests/unit_tests/tensor_parallel/test_cross_entropy.py at tp=4 holds
    # range(0, 8) repeated over a [16, 32] shard per rank (V = 128) and targets 0, 2, ..., 30;
    # here the gathered [16, 128] on one rank must give the same losses.
    logits = torch.arange(0, 8, dtype=torch.float32, device=DEVICE).repeat(16, 16)
    target = torch.arange(0, 32, 2, device=DEVICE)
    expected = torch.tensor([10.2309, 8.2309, 6.2309, 4.2309] * 4, device=DEVICE)
    for path in PATHS:
        out = ce(path, logits, target)
        assert torch.equal(torch.round(expected), torch.round(out))  # Megatron's own comparison
        exact = math.log(16 * sum(math.exp(k) for k in range(8))) - (target % 8).double()
        assert_close(out, exact, torch.float32)


def test_step_functions_compose_to_the_loss():
    x, t = _inputs((10,), 90, torch.float32)
    x2d, t1d = x.detach(), t
    vpce = VocabParallelCrossEntropy
    stats, logits_max = vpce.calculate_logits_max(x2d, t1d, 0, -100, 0.1)
    assert stats.shape == (len(STAT_ROWS), 10) and torch.equal(logits_max, stats[0])
    assert logits_max.data_ptr() != stats.data_ptr()  # a copy: the MAX all-reduce must not touch stats
    predicted, sum_exp, sum_logits = vpce.calculate_predicted_logits(stats, logits_max)
    assert stats[1:3].is_contiguous()  # the fused path's one SUM all-reduce needs no torch.cat
    loss, lse = vpce.calculate_cross_entropy_loss(predicted, sum_exp, sum_logits, logits_max, t1d, 90, -100, 0.1)
    ref = unfused.cross_entropy(x2d.double(), t1d, 0.1)
    assert_close(loss, ref, torch.float32)
    assert_close(lse[1:], torch.logsumexp(x2d.double(), -1)[1:], torch.float32)
    assert lse[0] == 0  # row 0 is ignored
    g = torch.randn(10, device=DEVICE)
    grad = vpce.calculate_gradients(x2d, t1d, lse, g, 0, 90, -100, 0.1)
    assert_close(grad, unfused.cross_entropy_grad(x2d.double(), t1d, g.double(), 0.1), torch.float32)



@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_step_functions_send_one_block_of_what_the_loss_needs(label_smoothing):
    """The fused path's SUM all-reduce sends [sum-exp, target logit] ([2, rows]), and the sum of
    logits as a third row only with label smoothing: a contiguous view of the statistics, no
    more bytes than the loss reads. The split block gives the unfused step functions' loss."""
    from fusedlib.fusions import fused_cross_entropy as fce

    x, t = _inputs((10,), 90, torch.float32)
    stats, logits_max = fce.calculate_logits_max(x.detach(), t, 0, -100, label_smoothing)
    block = fce.calculate_predicted_logits(stats, logits_max, label_smoothing)
    assert block.shape == (3 if label_smoothing else 2, 10) and block.is_contiguous()
    assert block.data_ptr() == stats[1].data_ptr()  # a view: no torch.cat
    loss, _ = fce.calculate_cross_entropy_loss(block, logits_max, t, 90, -100, label_smoothing)
    assert_close(loss, unfused.cross_entropy(x.detach().double(), t, label_smoothing), torch.float32)


def test_one_signature_with_other_label_smoothing_and_ignore_index():
    # the same logits and targets, label smoothing off, on and off again, and another ignore_index:
    # each call's loss and gradient are those of its own arguments, and a label_smoothing or an
    # ignore_index the check refuses is still refused after calls of the same signature that passed
    x, t = _inputs((6,), 50, torch.float32, n_ignored=0)
    for label_smoothing, ignore_index in ((0.0, -100), (0.1, -100), (0.0, -100), (0.2, -100), (0.0, int(t[3]))):
        x.grad = None
        _check("fused", x, t, label_smoothing=label_smoothing, ignore_index=ignore_index)
    with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\)"):
        fused_vocab_parallel_cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"ignore_index must be an int in \[-2\^63, 2\^63\)"):
        fused_vocab_parallel_cross_entropy(x, t, ignore_index=2**70)


def test_statistics_and_finalized_loss_of_one_signature():
    # the kernel layer on the same logits, alternately writing the shard statistics (tensor
    # parallelism) and the finished loss and lse (one device): each call gets what it asked for
    from fusedlib.kernels.cross_entropy import cross_entropy_fwd

    x, t = _inputs((7,), 30, torch.float32)
    x64 = x.detach().double()
    active = t != -100
    for _ in range(2):
        stats = cross_entropy_fwd(x.detach(), t)
        assert stats.shape == (len(STAT_ROWS), 7)
        assert_close(stats[0, active], x64.max(-1).values[active], torch.float32)
        loss, lse = cross_entropy_fwd(x.detach(), t, finalize=True)
        assert loss.shape == lse.shape == (7,)
        assert_close(loss, unfused.cross_entropy(x64, t), torch.float32, scale=math.log(30))
        assert_close(lse[active], torch.logsumexp(x64, -1)[active], torch.float32, scale=math.log(30))


def test_smoothing_coefs_are_megatrons_in_the_dtype_asked():
    # [1 - s, s / V] with s = eps·V/(V - 1), computed in float64 and handed over in the dtype asked
    from fusedlib.kernels.cross_entropy import smoothing_coefs

    for eps, v in ((0.1, 1000), (0.3, 7)):
        s = eps * v / (v - 1)
        got = smoothing_coefs(eps, v, torch.float64, DEVICE)
        assert got.dtype == torch.float64 and got.device.type == DEVICE.type
        torch.testing.assert_close(got.cpu(), torch.tensor([1 - s, s / v], dtype=torch.float64), atol=1e-16, rtol=0)
    # no smoothing: [1, 0], also for a vocabulary of one id (where eps·V/(V - 1) has no value)
    assert smoothing_coefs(0.0, 1, torch.float32, DEVICE).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_smoothing_coefficients_reach_the_kernels_in_float32(dtype, spy_launches):
    # with 16-bit logits the kernels still take [1 - s, s / V] in float32 (the accumulator's
    # dtype): rounded to bf16, 1 - s = 0.9 would become 0.8984, an error of 1.5e-3 times the
    # gradient, inside bf16's tolerance, so only the launch arguments show it
    from fusedlib.kernels.cross_entropy import smoothing_coefs

    x, t = _inputs((5,), 40, dtype)
    fused_vocab_parallel_cross_entropy(x, t, label_smoothing=0.1).sum().backward()
    want = smoothing_coefs(0.1, 40, torch.float32, DEVICE)
    coefs = {c.kernel: c.args[5] for c in spy_launches if c.kernel.startswith("_cross_entropy_")}
    assert sorted(coefs) == ["_cross_entropy_bwd_kernel", "_cross_entropy_fwd_kernel"]
    for kernel, got in coefs.items():
        assert got.dtype == torch.float32 and torch.equal(got, want), (kernel, got)


def test_short_rows_are_packed_to_a_program_by_the_tables():
    # rows up to 1 Ki (and the forward's up to 4 Ki) are read in one step, TILE_ELEMENTS // BLOCK_N
    # of them to a program, with each table's warps: every power of two up to there has its row
    from fusedlib.kernels.cross_entropy import BWD_TILES, FWD_TILES, TILE_ELEMENTS
    from fusedlib.kernels.launch import next_power_of_2, pick

    for table, last in ((FWD_TILES, 4096), (BWD_TILES, 1024)):
        for v in sorted({n + d for n in (2**k for k in range(last.bit_length())) for d in (-1, 0)} - {0}):
            tile = pick(table, v)
            assert tile.BLOCK_N == next_power_of_2(v) and tile.BLOCK_M * tile.BLOCK_N == TILE_ELEMENTS, (v, tile)
            assert tile.num_warps == (4 if v <= 1024 else 8), (v, tile)


def test_vocab_utility():
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(32, 2, 4) == (64, 96)
    assert VocabUtility.vocab_range_from_global_vocab_size(128256, 1, 2) == (64128, 128256)
    with pytest.raises(ValueError, match="must be divisible by world_size=3"):
        VocabUtility.vocab_range_from_global_vocab_size(128, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
        VocabUtility.vocab_range_from_per_partition_vocab_size(8, 2, 2)


def test_single_rank_issues_no_collectives():
    x, t = _inputs((4,), 16, torch.float32)
    with count_collectives() as log:
        ce("unfused", x, t, 0.1).sum().backward()
        ce("fused", x, t, 0.1).sum().backward()
    assert log == [] and log.summary() == "0 collectives: "
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce(torch.zeros(2), "MIN", None)


def test_offsets_are_int64_past_2_to_the_31(seed):
    # Rows 2^30 elements apart: row 2 starts at element 2^31, past int32. The stride fits in
    # int32, so only the kernels' own int64 arithmetic reaches row 2 correctly (without it
    # the offset wraps: a wrong loss or a crash, hence a subprocess). The 4 GiB bf16 storage
    # is only reserved, not touched: 3 rows of V elements are written.
    code = textwrap.dedent("""
        import torch, fusedlib, torch.nn.functional as F
        from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        V = 37
        torch.manual_seed(SEED)  # this test's seed (conftest), handed to the subprocess
        base = torch.empty(2**31 + V, dtype=torch.bfloat16, device=dev)
        x = base.as_strided((3, V), (2**30, 1))
        x.copy_(torch.randn(3, V, device=dev))
        x.requires_grad_(True)
        t = torch.tensor([1, 5, 36], device=dev)
        loss = fused_vocab_parallel_cross_entropy(x, t)
        loss.sum().backward()
        x64 = x.detach().double().requires_grad_(True)
        F.cross_entropy(x64, t, reduction="none").sum().backward()
        assert torch.allclose(loss.double(), F.cross_entropy(x64.detach(), t, reduction="none"), atol=1e-5)
        assert torch.allclose(x.grad.double(), x64.grad, atol=1e-2)
        print("int64 offsets ok")
    """).replace("SEED", str(seed))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "int64 offsets ok" in res.stdout, (res.returncode, res.stdout, res.stderr[-3000:])


def test_kernels_compile_for_sm90_with_vector_loads():
    # Compiles the kernels for an H100/H200 (sm_90) without a GPU, through Triton's own
    # compiler and ptxas: catches compiled-mode errors the interpreter cannot see, and checks
    # that the logits are read and the gradient written with 16-byte vector accesses.
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import fusedlib.kernels.cross_entropy as ce
        div = ("X_ptr", "TARGET_ptr", "STATS_ptr", "LOSS_ptr", "LSE_ptr", "G_ptr", "DX_ptr", "COEF_ptr",
               "X_row_stride", "n_cols")
        common = {"n_rows": "i32", "n_cols": "i32", "X_row_stride": "i32", "X_col_stride": "constexpr",
                  "target_stride": "constexpr", "vocab_start_index": "i32", "vocab_size": "i32",
                  "ignore_index": "i32", "ERR_ptr": "*i64",
                  "TARGET_ptr": "*i64", "X_ptr": "*bf16", "COEF_ptr": "*fp32", "LSE_ptr": "*fp32",
                  "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "ACC": "constexpr", "SMOOTHING": "constexpr"}
        consts = {"X_col_stride": 1, "target_stride": 1, "BLOCK_M": 1, "BLOCK_N": 4096, "ACC": tl.float32,
                  "SMOOTHING": True}
        kernels = {
            "fwd": (ce._cross_entropy_fwd_kernel, {"STATS_ptr": "*fp32", "LOSS_ptr": "*fp32", "FINALIZE": "constexpr",
                                                   "CHECK": "constexpr"},
                    {"FINALIZE": False, "CHECK": True}),
            "bwd": (ce._cross_entropy_bwd_kernel, {"G_ptr": "*fp32", "DX_ptr": "*bf16", "g_stride": "i32"}, {}),
        }
        for name, (fn, sig, extra) in kernels.items():
            sig = {a: {**common, **sig}[a] for a in fn.arg_names}
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div if a in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs={**consts, **extra}, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            ptx = k.asm["ptx"]
            assert "ld.global.v4" in ptx, name
            assert name == "fwd" or "st.global.v4" in ptx, name
            print(name, "compiled")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "bwd compiled" in res.stdout, (res.stdout, res.stderr[-3000:])


# --- several processes: gloo on CPU ---------------------------------------------------------

GLOBAL_VOCAB = 24  # divisible by 1, 2 and 4


def _tp_worker(rank: int, world_size: int, device: torch.device, seed: int) -> list[str]:
    """Runs in every rank: returns a list of passed check names (raises on the first failure).
    ``seed``: the test's seed (conftest); every rank draws the same inputs from it."""
    torch.manual_seed(seed)  # a forked rank inherits the parent's generator, a spawned one would not
    import torch.distributed as dist

    from fusedlib.parallel.demo import make_global_inputs, shard

    done = []
    configs = [(torch.float64, 0.0, -100, seed), (torch.float32, 0.1, -100, seed + 1),
               (torch.bfloat16, 0.0, -1, seed + 2)]
    for dtype, eps, ignore_index, input_seed in configs:
        full, target, grad = make_global_inputs(5, GLOBAL_VOCAB, dtype, input_seed, device, n_ignored=1,
                                                ignore_index=ignore_index)
        for path in PATHS:
            x = shard(full, rank, world_size).requires_grad_(True)
            before = x.detach().clone()
            with count_collectives() as log:
                loss = ce(path, x, target, eps, ignore_index)
                loss.backward(grad.to(loss.dtype))
            # reference: F.cross_entropy on the logits gathered from every rank, in float64
            parts = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(parts, x.detach())
            gathered = torch.cat(parts, dim=-1).double().requires_grad_(True)
            assert torch.equal(gathered.detach(), full.double())
            ref = unfused.cross_entropy(gathered, target, eps, ignore_index)
            ref.backward(grad)
            tag = f"rank {rank}/{world_size} {path} {dtype} eps={eps}"
            assert_close(loss, ref.detach(), loss_tol(dtype), scale=3.0)
            assert_close(x.grad, shard(gathered.grad, rank, world_size), dtype)
            assert x.grad.dtype == dtype, tag
            assert torch.equal(x.detach(), before), tag + ": logits modified"
            expected = 0 if world_size == 1 else (3 + (eps > 0) if path == "unfused" else 2)
            assert len(log) == expected, (tag, log.summary())
            if world_size > 1:
                assert [c.op for c in log] == (["MAX", "SUM", "SUM"] + ["SUM"] * (eps > 0) if path == "unfused"
                                               else ["MAX", "SUM"]), (tag, log.summary())
            done.append(tag)

    # Megatron-core's unit test: every rank holds range(0, 8) repeated, [16, 32]; V = 32·p.
    logits = torch.arange(0, 8, dtype=torch.float32).repeat(16, 4)
    target = torch.arange(0, 32, 2)
    for path in PATHS:
        out = ce(path, logits, target)
        exact = math.log(4 * world_size * sum(math.exp(k) for k in range(8))) - (target % 8).double()
        assert_close(out, exact, torch.float32)
        if world_size == 4:
            expected = torch.tensor([10.2309, 8.2309, 6.2309, 4.2309] * 4)
            assert torch.equal(torch.round(expected), torch.round(out))  # Megatron's own assertion
        done.append(f"megatron {path}")

    # A target outside [0, V) raises on every rank (the same target everywhere: no rank hangs).
    bad = torch.tensor([0, GLOBAL_VOCAB, 3])
    x = torch.randn(3, GLOBAL_VOCAB // world_size)
    for path in PATHS:
        with pytest.raises(ValueError, match=rf"\[0, {GLOBAL_VOCAB}\)"):
            ce(path, x, bad)
        done.append(f"bad target {path}")
    return done


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_tensor_parallel_gloo_matches_gathered_reference(world_size, seed):
    results = run_tp(_tp_worker, world_size, seed)
    assert len(results) == world_size
    for rank, done in enumerate(results):
        assert len(done) == 3 * len(PATHS) + 2 * len(PATHS), (rank, done)


class _OneRankGroup:
    """Megatron-core's unit-test stand-in for a tensor-parallel group of one rank."""

    def rank(self):
        return 0

    def size(self):
        return 1


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_group_with_rank_and_size_methods_megatrons_stand_in(monkeypatch, dtype):
    # Megatron-core's fused_vocab_parallel_cross_entropy only calls tp_group.rank() and
    # .size() (and torch.distributed.all_reduce, patched to the identity by its test): such
    # an object is accepted, and with one rank no collective is issued at all.
    def no_all_reduce(tensor, op=None, group=None):
        raise AssertionError("a one-rank group needs no all_reduce")

    monkeypatch.setattr(torch.distributed, "all_reduce", no_all_reduce)
    for path in PATHS:
        x, t = _inputs((4, 2), 8, dtype, n_ignored=0)
        with count_collectives() as log:
            loss = ce(path, x, t, tp_group=_OneRankGroup())
        loss.sum().backward()
        assert not log and x.grad.dtype == dtype and x.grad.shape == x.shape
        x64 = x.detach().double().requires_grad_(True)
        ref = F.cross_entropy(x64.reshape(-1, 8), t.reshape(-1), reduction="none").reshape(4, 2)
        ref.sum().backward()
        assert_close(loss, ref.detach(), loss_tol(dtype))
        assert_close(x.grad, x64.grad, dtype)


def test_the_fused_path_finishes_the_loss_in_its_kernel_for_a_group_of_one_rank(spy_launches):
    # a group of one rank holds the whole vocabulary: the fused forward is one kernel that writes
    # the loss itself (FINALIZE), nothing combined after it, as with tp_group=None
    x, t = _inputs((4, 3), 9, torch.float32)
    loss = fused_vocab_parallel_cross_entropy(x, t, _OneRankGroup(), label_smoothing=0.1)
    assert_close(loss, unfused.cross_entropy(x.detach().double(), t, 0.1), torch.float32, scale=math.log(9))
    assert [(c.kernel, c.kwargs["FINALIZE"]) for c in spy_launches] == [("_cross_entropy_fwd_kernel", True)]


@pytest.mark.parametrize("path", PATHS)
def test_a_group_of_one_rank_refuses_what_one_rank_refuses(path):
    # A group of one rank (Megatron-core's stand-in here) computes the loss by another code path
    # than tp_group=None: a target id outside [0, V) and label smoothing over a vocabulary of one
    # id (eps·V/(V-1) undefined) raise there too.
    x, t = _inputs((5,), 7, torch.float32, n_ignored=0)
    t[2] = 7
    op = "vocab_parallel_cross_entropy" if path == "unfused" else "fused_vocab_parallel_cross_entropy"
    with pytest.raises(ValueError, match=rf"^{op}: target must hold vocabulary ids in \[0, 7\) or ignore_index=-100, "
                                         rf"got 7"):
        ce(path, x, t, tp_group=_OneRankGroup())
        fusedlib.runtime.check_errors()
    fusedlib.runtime.check_errors()  # reported once
    with pytest.raises(ValueError, match="label_smoothing needs a vocabulary of at least 2 ids"):
        ce(path, *_inputs((3,), 1, torch.float32), 0.1, tp_group=_OneRankGroup())


@pytest.mark.parametrize("fn", [vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy])
@pytest.mark.parametrize("group", ["g", 0, object()])
def test_tp_group_of_the_wrong_type_raises_naming_it(fn, group):
    x, t = _inputs((3,), 5, torch.float32)
    with pytest.raises(TypeError, match=r"tp_group must be None or a torch.distributed.ProcessGroup"):
        fn(x, t, tp_group=group)


@pytest.mark.parametrize("path", PATHS)
def test_a_bool_label_smoothing_and_an_ignore_index_beyond_int64_are_named(path):
    fn = fused_vocab_parallel_cross_entropy if path == "fused" else vocab_parallel_cross_entropy
    logits, target = torch.randn(2, 5, device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    for bad, shown in ((False, "bool False"), ("0.1", "str '0.1'"), ([0.1], r"list \[0.1\]")):
        # a wrong type: a TypeError (the ValueError it was before too); False was read as 0
        # (True refused as >= 1)
        with pytest.raises(TypeError, match=rf"label_smoothing must be a float in \[0, 1\), got {shown}$"):
            fn(logits, target, label_smoothing=bad)
        with pytest.raises(ValueError):
            fn(logits, target, label_smoothing=bad)
    for bad in (1.0, -0.0625, float("nan")):  # a number out of range: a ValueError, not a TypeError
        with pytest.raises(ValueError, match=r"label_smoothing must be a float in \[0, 1\), got") as info:
            fn(logits, target, label_smoothing=bad)
        assert not isinstance(info.value, TypeError)
    with pytest.raises(ValueError, match=r"ignore_index must be an int in \[-2\^63, 2\^63\)"):
        fn(logits, target, ignore_index=2 ** 70)  # Triton's OverflowError before


class _TwoRankStandIn:
    """Rank 0 of a group of two, in one process: with ``torch.distributed.all_reduce`` patched to
    the identity the collectives add nothing, so the loss of a target in this rank's shard
    [0, V) is the cross entropy of the shard alone, computed by the multi-rank code path."""

    def rank(self):
        return 0

    def size(self):
        return 2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ranks", (1, 2))
def test_an_int32_target_with_an_ignore_index_beyond_int32_ignores_nothing(path, ranks, monkeypatch):
    # No int32 id equals ignore_index = 2**32 + 3, but torch wraps a Python int to the tensor's
    # dtype when it compares (t != 2**32 + 3 is t != 3): the loss of every target 3 was zero,
    # silently, on the unfused path and on the fused path with several ranks (its gradient
    # was not: the kernels compare in int64).
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    x, t = _inputs((4, 3), 7, torch.float32, n_ignored=0)
    t.view(-1)[::2] = 3
    t32 = t.int()
    loss = ce(path, x, t32, ignore_index=2 ** 32 + 3, tp_group=None if ranks == 1 else _TwoRankStandIn())
    x64 = x.detach().double()
    assert_close(loss, unfused.cross_entropy(x64, t, 0.0, -100), torch.float32, scale=math.log(7))
    g = torch.randn(t.shape, device=DEVICE)
    loss.backward(g)
    assert_close(x.grad, unfused.cross_entropy_grad(x64, t, g.double(), 0.0, -100), torch.float32)
    assert t32.dtype == torch.int32 and torch.equal(t32, t.int())  # the caller's target: untouched


@pytest.mark.parametrize("ignore_index", [2**32 + 1, 2**31], ids=["2**32+1", "2**31"])  # (2**31: the first beyond)
def test_an_int32_target_with_an_ignore_index_beyond_int32_reads_no_row_past_the_end(seed, ignore_index):
    # The kernels load the target with other=ignore_index, which Triton casts to the target's
    # int32: 2**32 + 1 became id 1, so the padding rows of the last program counted as active
    # and read the logits (and grad_output) past the tensor's end. One row with a row stride
    # of 10**11 elements puts those reads at unmapped addresses: a segmentation fault on the
    # CPU before the fix (an illegal address or garbage reads on CUDA), hence a subprocess.
    code = textwrap.dedent("""
        import torch, fusedlib, torch.nn.functional as F
        from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        from fusedlib.parallel import vocab_parallel_cross_entropy
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(SEED)  # this test's seed (conftest), handed to the subprocess
        base = torch.randn(6, device=dev)
        x = base.as_strided((1, 6), (10**11, 1)).requires_grad_(True)  # one row: any row stride is valid
        t = torch.tensor([1], dtype=torch.int32, device=dev)
        ref = F.cross_entropy(base.double()[None], t.long(), reduction="none")
        for fn in (fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy):
            x.grad = None
            loss = fn(x, t, ignore_index=IGNORE)
            loss.backward(torch.ones_like(loss))
            assert torch.allclose(loss.double(), ref, atol=1e-5), (fn.__name__, loss, ref)
            assert torch.isfinite(x.grad).all()
        print("no read past the end")
    """).replace("SEED", str(seed)).replace("IGNORE", str(ignore_index))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "no read past the end" in res.stdout, (res.returncode, res.stdout,
                                                                          res.stderr[-3000:])
