"""Tensor parallelism (``fusedlib.parallel``) in several processes: gloo on CPU tensors, NCCL on GPUs.

* the GPT at tp = 2 and tp = 4 against the same GPT at tp = 1 (the p-rank weights are the
  shards of the one-rank weights): loss, gathered logits and gathered gradients, with and without
  sequence parallelism, fused and unfused cross entropy, fused and unfused layer specs, float64
  (and float32, bfloat16 at tp = 2);
* the seven mappings, forward and backward, against what the ranks' inputs say they must give;
* the parallel layers against ``F.linear`` / ``F.embedding`` on the full weights, in float64;
* dropout: which masks agree across ranks and which differ, and recomputation replaying them;
* the collectives a GPT step issues, and none on one rank;
* sharding and gathering state dicts; the errors for bad sizes.

Every rank draws its inputs from the test's seed (conftest), handed to the ranks. The gloo runs
use tiny models (h = 32, 2 layers, vocabulary 64, 8 tokens): the kernels run in Triton's
interpreter. The NCCL variants need 2 (4) CUDA GPUs and are skipped otherwise.

Tolerances: see :mod:`fusedlib.parallel.check_tp` (derived there) for the GPT; the layer and
mapping checks are float64 sums of <= 6 terms, so the one-rank and p-rank results agree to a
few ulps: 1e-12 relative to the largest entry (1e3 margin over 6·eps·|terms|); mappings that
only move data are checked for exact equality, sums of p float64 values to 1e-15 relative.
"""
from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
import torch.nn.functional as F

import fusedlib.parallel as fp
import fusedlib.runtime
from fusedlib.parallel import parallel_state
from fusedlib.parallel.finalize_model_grads import grads_to_sum_over_tensor_parallel_ranks
from fusedlib.parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from fusedlib.parallel.random import get_data_parallel_rng_tracker_name
from fusedlib.parallel.utils import SINGLE_RANK
from fusedlib.parallel.check_tp import CASES, close, gpt_tp_check, grad_scale_floor
from fusedlib.parallel.checkpointing import (
    PartitionSpec, get_tensor_parallel_layout, shard_state_dict, shard_tensor, unshard_state_dict, unshard_tensors,
)

UNFUSED_CASES = [name for name in CASES if name.startswith("unfused")]


def _backends(world_size: int) -> list:
    return [pytest.param("gloo", id="gloo"),
            pytest.param("nccl", id="nccl", marks=pytest.mark.skipif(
                torch.cuda.device_count() < world_size, reason=f"NCCL needs {world_size} CUDA GPUs"))]


def _spawn(fn, world_size: int, backend: str, *args):
    return fp.spawn(fn, world_size, *args, backend=backend)


# ----------------------------------------------------------------------------------- the GPT
def _gpt_worker(rank, world_size, device, runs, seed):
    # (the logits of the fused spec are left out on CPU: its kernels are interpreted, and the loss
    # and every gradient already check its forward)
    return [(name, str(dtype), gpt_tp_check(rank, world_size, device, name, dtype, seed, reference_on_rank0_only=True,
                                            check_logits=device.type == "cuda" or name.startswith("unfused")))
            for name, dtype in runs]


def _check_gpt(results: list, world_size: int) -> list[str]:
    """Compare the ranks' results with rank 0's one-rank reference, gathering the gradients."""
    failures = []
    for i, (name, dtype_name, rank0) in enumerate(results[0]):
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        tag = f"tp={world_size} {dtype_name} {name}"
        ranks = [r[i][2] for r in results]
        if not all(r["init_matches"] for r in ranks):
            failures.append(f"{tag}: the p-rank weights are not the shards of the one-rank weights")
        if rank0["logits_ok"] is False:
            failures.append(f"{tag}: gathered logits differ from the one-rank logits")
        if not all(torch.equal(r["loss"], rank0["loss"]) for r in ranks):
            failures.append(f"{tag}: the ranks' losses differ")
        if not close(rank0["loss"], rank0["ref_loss"], dtype):
            failures.append(f"{tag}: loss differs from the one-rank loss")
        if not all(torch.equal(r["grad_norm"], rank0["grad_norm"]) for r in ranks) or \
                not close(rank0["grad_norm"], rank0["ref_grad_norm"], dtype):
            failures.append(f"{tag}: the gradient norm differs from the one-rank norm (or between ranks)")
        # the gradients gathered from the ranks; replicated ones must agree bitwise across ranks
        grads = unshard_state_dict([r["grads"] for r in ranks], rank0["layout"])
        floor = grad_scale_floor(rank0["ref_grads"])
        assert set(grads) == set(rank0["ref_grads"]), tag
        for k, ref in rank0["ref_grads"].items():
            if grads[k].shape != ref.shape or not close(grads[k], ref, dtype, floor):
                failures.append(f"{tag}: gradient of {k} differs")
    return failures


@pytest.mark.parametrize("backend", _backends(2))
def test_gpt_tp2_matches_one_rank(backend, seed):
    runs = [(name, torch.float64) for name in CASES]
    runs += [("unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce", torch.float32),
             ("unfused/gelu/learned/qk-norm/fused-ce", torch.bfloat16)]
    results = _spawn(_gpt_worker, 2, backend, runs, seed)
    failures = _check_gpt(results, 2)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", _backends(4))
def test_gpt_tp4_matches_one_rank(backend, seed):
    # the unfused layers (plain PyTorch, the loss on fusedlib's kernels): every combination of
    # sequence parallelism and fused/unfused cross entropy; the fused layers run at tp = 2 above
    runs = [(name, torch.float64) for name in (CASES if backend == "nccl" else UNFUSED_CASES)]
    results = _spawn(_gpt_worker, 4, backend, runs, seed)
    failures = _check_gpt(results, 4)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------- collectives
def _collectives_worker(rank, world_size, device, seed):
    from fusedlib.parallel.check_tp import _inputs, build_gpt
    from fusedlib.parallel.finalize_model_grads import finalize_model_grads

    out = {}
    for name in ("unfused/gelu/learned/qk-norm/fused-ce", "unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce"):
        model = build_gpt(CASES[name], world_size, torch.float64, seed,
                          use_cpu_initialization=device.type == "cpu").to(device)
        ids, labels, grad = _inputs(seed, device)
        with fp.count_collectives() as fwd:
            loss = model(ids, None, None, labels=labels)
        with fp.count_collectives() as bwd:
            loss.backward(grad)
        with fp.count_collectives() as fin:
            finalize_model_grads(model)
        out[name] = [[(c.name, c.op) for c in log] for log in (fwd, bwd, fin)]
    # what the gradients look like without finalize_model_grads: replicas of the norms disagree
    res = gpt_tp_check(rank, world_size, device, "unfused/gelu/learned/qk-norm/sp/unfused-ce", torch.float64, seed,
                       finalize=False)
    out["unfinalized"] = (res["grads"], res["layout"])
    return out


def test_collectives_of_a_gpt_step(seed):
    results = _spawn(_collectives_worker, 2, "gloo", seed)
    L = 2  # layers
    count = lambda log, name, op=None: sum(1 for n, o in log if n == name and (op is None or o == op))  # noqa: E731

    # without sequence parallelism: each layer's two row-parallel linears all-reduce their output
    # (forward) and its two column-parallel ones their input gradient (backward); the embedding
    # all-reduces its rows, the output layer its input gradient, the fused loss 2 statistics.
    fwd, bwd, fin = results[0]["unfused/gelu/learned/qk-norm/fused-ce"]
    assert [o for _, o in fwd] == ["SUM"] * (1 + 2 * L) + ["MAX", "SUM"], fwd
    assert count(fwd, "all_reduce") == len(fwd) == 1 + 2 * L + 2
    assert count(bwd, "all_reduce", "SUM") == len(bwd) == 2 * L + 1, bwd
    assert fin == [("all_reduce", "SUM")], fin  # the q/k norms saw this rank's heads only

    # with sequence parallelism (RoPE: the embedding reduce-scatters): each all-reduce becomes a
    # reduce-scatter (forward) or a gather + reduce-scatter pair (backward of a column-parallel layer,
    # which gathers its saved s/p input again for the weight gradient)
    fwd, bwd, fin = results[0]["unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce"]
    columns, rows = 2 * L + 1, 2 * L  # QKV, fc1 per layer + the output layer; proj, fc2 per layer
    assert count(fwd, "reduce_scatter") == 1 + rows and count(fwd, "all_gather") == columns, fwd
    assert count(fwd, "all_reduce") == 2, fwd  # the fused loss
    assert count(bwd, "all_gather") == columns + rows + 1, bwd  # + the embedding's reduce-scatter's adjoint
    assert count(bwd, "reduce_scatter") == columns and count(bwd, "all_reduce") == 0, bwd
    assert fin == [("all_reduce", "SUM")], fin  # one flat buffer: norms and row-parallel biases

    # the test above can fail: without finalize_model_grads the norms' gradients disagree across ranks
    with pytest.raises(ValueError, match=r"replicated entry 'decoder\.layers\.0\.input_layernorm\.weight' differs"):
        unshard_state_dict([r["unfinalized"][0] for r in results], results[0]["unfinalized"][1])


def test_one_rank_issues_no_collectives(seed):
    from fusedlib.parallel.check_tp import _inputs, build_gpt

    model = build_gpt(CASES["unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce"], 1, torch.float32, seed)
    ids, labels, grad = _inputs(seed, next(model.parameters()).device)
    with fp.count_collectives() as log:
        model(ids, None, None, labels=labels).backward(grad.float())
        fp.finalize_model_grads(model)
    assert len(log) == 0, log.summary()
    # the linear layers are F.linear itself on one rank, except a bias added in the GEMM (the
    # QKV projection's here), whose gradient the column-parallel Function sums with fusedlib's kernel
    x = torch.randn(3, 2, 32, device=ids.device, requires_grad=True)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.bias is not None and not qkv.skip_bias_add
    out, _ = qkv(x)
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    out, _ = model.decoder.layers[0].mlp.linear_fc2(torch.randn(3, 2, model.decoder.layers[0].mlp.linear_fc2.input_size,
                                                                device=ids.device, requires_grad=True))
    assert type(out.grad_fn).__name__ in ("ViewBackward0", "UnsafeViewBackward0", "AddBackward0", "MmBackward0",
                                          "AddmmBackward0"), type(out.grad_fn).__name__
    # the layout is marked on one rank too
    layout = get_tensor_parallel_layout(model)
    assert layout["decoder.layers.0.mlp.linear_fc1.weight"] == PartitionSpec(0, 2)  # SwiGLU: stride 2
    assert layout["decoder.layers.0.self_attention.linear_proj.weight"] == PartitionSpec(1, 1)
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in layout


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_out", [1, 53, 1152])
def test_one_rank_bias_in_the_gemm_sums_its_gradient_with_fusedlib(dtype, n_out, seed):
    # p = 1, bias added in the GEMM: the column-parallel Function (Megatron-core's), whose bias
    # gradient is fusedlib's column sum; checked against float64 on a non-contiguous input.
    # Bounds: a float32 sum of n products or terms errs by <= n·2^-24 of the sum of their
    # magnitudes, rounded once to the dtype (u); a 2x margin on the sum of the two
    from conftest import DEVICE

    torch.manual_seed(seed)
    cfg = dataclasses.replace(_layer_config(1, False, DEVICE), params_dtype=dtype)
    layer = fp.ColumnParallelLinear(37, n_out, config=cfg, init_method=_normal, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(5, 3, 37, device=DEVICE).to(dtype).transpose(0, 1).requires_grad_(True)  # [s=3, b=5, 37]
    out, none = layer(x)
    assert none is None and type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    g = torch.randn(out.shape, device=DEVICE).to(dtype)
    out.backward(g)
    x64, w64, b64, g64 = (t.detach().double() for t in (x, layer.weight, layer.bias, g))
    u = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[dtype]
    u32 = 2.0 ** -24 if dtype != torch.float64 else 2.0 ** -53

    def close(name, got, want, mag, n):
        err = (got.double() - want).abs()
        bad = err > 2 * (u + n * u32) * mag + 1e-300
        assert not bad.any(), (name, err.max().item())

    close("out", out, F.linear(x64, w64, b64), F.linear(x64.abs(), w64.abs(), b64.abs()), 38)
    close("dx", x.grad, g64 @ w64, g64.abs() @ w64.abs(), n_out)
    g2, x2 = g64.reshape(-1, n_out), x64.reshape(-1, 37)
    close("dw", layer.weight.grad, g2.t() @ x2, g2.abs().t() @ x2.abs(), 15)
    close("db", layer.bias.grad, g2.sum(0), g2.abs().sum(0), 15)
    assert layer.bias.grad.dtype == dtype
    # F.linear itself where the Function has nothing to add or cannot run: no bias gradient
    # wanted, skip_bias_add, autocast
    with torch.no_grad():
        assert layer(x)[0].grad_fn is None
    layer.bias.requires_grad_(False)
    assert type(layer(x)[0].grad_fn).__name__ != "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    layer.bias.requires_grad_(True)
    skip = fp.ColumnParallelLinear(37, n_out, config=cfg, init_method=_normal, bias=True, skip_bias_add=True)
    assert type(skip(x)[0].grad_fn).__name__ != "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    if dtype == torch.float32:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            assert type(layer(x)[0].grad_fn).__name__ != "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    if dtype == torch.float64 and n_out == 53:  # a double backward goes through torch's (differentiable) sum
        fn = fp.layers.LinearWithGradAccumulationAndAsyncCommunication.apply
        w, b = (t.detach()[:4, :6].clone().requires_grad_(True) for t in (layer.weight, layer.bias[:, None]))
        xs = x.detach()[:2, :2, :6].clone().requires_grad_(True)
        assert torch.autograd.gradgradcheck(lambda x, w, b: fn(x, w, b[:, 0], False, False, None), (xs, w, b))


def test_one_rank_bias_in_the_gemm_edge_cases(seed):
    # 0 tokens, 0 input or output features, a 1-D input; a frozen weight keeps no input for
    # the backward; torch.func and forward-mode AD take F.linear (the Function has neither
    # setup_context nor jvp)
    from conftest import DEVICE

    torch.manual_seed(seed)
    cfg = _layer_config(1, False, DEVICE)
    name = "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    for n_in, n_out, shape in ((0, 5, (3, 0)), (7, 0, (3, 7)), (7, 5, (7,)), (7, 5, (0, 2, 7))):
        layer = fp.ColumnParallelLinear(n_in, n_out, config=cfg, init_method=_normal, bias=True)
        x = torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)
        out, _ = layer(x)
        assert type(out.grad_fn).__name__ == name
        g = torch.randn(out.shape, device=DEVICE, dtype=torch.float64)
        out.backward(g)
        rows = lambda t: t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # noqa: E731  (0 rows or columns too)
        torch.testing.assert_close(layer.bias.grad, rows(g).sum(0), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(x.grad, g @ layer.weight.detach(), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(layer.weight.grad, rows(g).t() @ rows(x.detach()), rtol=1e-14, atol=1e-14)
    layer = fp.ColumnParallelLinear(7, 5, config=cfg, init_method=_normal, bias=True)
    layer.weight.requires_grad_(False)
    out, _ = layer(torch.randn(4, 7, device=DEVICE, dtype=torch.float64, requires_grad=True))
    assert out.grad_fn.saved_tensors[0] is None  # the input: only the weight's gradient would need it
    layer.weight.requires_grad_(True)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    x = torch.randn(4, 3, 7, device=DEVICE, dtype=torch.float64)
    loss = lambda p, x: torch.func.functional_call(layer, p, (x,))[0].pow(2).sum()  # noqa: E731
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(4):
        y = F.linear(x[i], params["weight"], params["bias"])
        torch.testing.assert_close(per_sample["bias"][i], 2 * y.sum(0), rtol=1e-14, atol=1e-14)
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        t = torch.randn_like(x)
        out, _ = layer(fwad.make_dual(x, t))
        torch.testing.assert_close(fwad.unpack_dual(out).tangent, t @ params["weight"].t(), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch_on_one_rank(norm_type, seed):
    from fusedlib.parallel.check_tp import _inputs, build_gpt

    model = build_gpt(CASES["unfused/gelu/learned/qk-norm/fused-ce"], 1, torch.float64, seed)
    ids, labels, grad = _inputs(seed, next(model.parameters()).device)
    model(ids, None, None, labels=labels).backward(grad)
    params = [p for p in model.parameters()]
    ref = [p.grad.clone() for p in params]
    ref_params = [torch.nn.Parameter(torch.empty_like(g)) for g in ref]
    for rp, g in zip(ref_params, ref):
        rp.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type=norm_type)
    norm = fp.clip_grad_norm(model, 0.5, norm_type=norm_type)
    # float64 norms of ~1e4 entries: ~1e4·eps relative at most; the clipped gradients one more rounding
    torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=0)
    assert norm > 0.5  # so the gradients were clipped
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-12, atol=1e-15)


def test_clip_grad_norm_below_max_norm_leaves_the_gradients_as_they_are(seed):
    # the coefficient is min(1, max_norm / (norm + 1e-6)): a norm below max_norm must not scale the
    # gradients up. The clamp gives exactly 1.0, and g * 1.0 == g, so the gradients stay bit for bit
    # (without the clamp they grow by max_norm / norm = 2 here).
    from fusedlib.parallel.check_tp import _inputs, build_gpt

    model = build_gpt(CASES["unfused/gelu/learned/qk-norm/fused-ce"], 1, torch.float64, seed)
    ids, labels, grad = _inputs(seed, next(model.parameters()).device)
    model(ids, None, None, labels=labels).backward(grad)
    before = [p.grad.clone() for p in model.parameters()]
    exact = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before]))  # float64
    norm = fp.clip_grad_norm(model, 2 * float(exact))
    torch.testing.assert_close(norm, exact, rtol=1e-12, atol=0)  # (as the test above)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


@pytest.mark.parametrize("max_norm, error, match", [
    (-1.0, ValueError, "max_norm must be > 0"), (0.0, ValueError, "max_norm must be > 0"),
    (float("nan"), ValueError, "max_norm must be > 0"), ("1.0", TypeError, "max_norm must be a real number"),
    (None, TypeError, "max_norm must be a real number"), (True, TypeError, "max_norm must be a real number")])
def test_clip_grad_norm_refuses_a_bad_max_norm_and_leaves_the_gradients(max_norm, error, match):
    # a negative max_norm flipped every gradient's sign, NaN made every gradient NaN, 0 zeroed them;
    # a str or None failed inside torch's division
    torch.manual_seed(2024)
    m = torch.nn.Linear(3, 2)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(error, match=match):
        fp.clip_grad_norm(m, max_norm)
    from fusedlib.parallel.clip_grads import clip_grad_by_total_norm_fp32
    with pytest.raises(error, match=match):
        clip_grad_by_total_norm_fp32(list(m.parameters()), max_norm, torch.tensor(1.0))
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), before))


def test_clip_grad_norm_refuses_a_model_that_is_not_a_module():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got list"):
        fp.clip_grad_norm([m], 1.0)


@pytest.mark.parametrize("norm_type", [True, "2", None])
def test_clip_grad_norm_refuses_a_norm_type_that_is_not_a_number(norm_type):
    # True was the 1-norm, "2" the 2-norm
    m = torch.nn.Linear(2, 2)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="norm_type must be a real number > 0"):
        fp.clip_grad_norm(m, 1.0, norm_type=norm_type)
    # a one-element float tensor is its value (Megatron-core's float(norm_type))
    assert torch.equal(fp.clip_grad_norm(m, math.inf, norm_type=torch.tensor(2.0)), fp.clip_grad_norm(m, math.inf))


def _default_groups_worker(rank: int, world_size: int, device: torch.device, seed: int) -> dict:
    """Two processes. With tp = 1 (data-parallel 2): the cross entropies of whole logits with
    tp_group None. With tp = 2: the norm of a model of parallel layers that has no config."""
    torch.manual_seed(seed)
    out = {}
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        x = torch.randn(3, 2, 8, dtype=torch.float64, device=device)
        t = torch.randint(0, 8, (3, 2), device=device)
        want = F.cross_entropy(x.reshape(-1, 8), t.reshape(-1), reduction="none").reshape(3, 2)
        out["ce"] = [float((fn(x, t) - want).abs().max())
                     for fn in (fp.vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy)]
        return out
    cfg = _layer_config(2, False, device)
    model = torch.nn.Sequential(fp.ColumnParallelLinear(6, 10, config=cfg, init_method=_normal, gather_output=False),
                                fp.RowParallelLinear(10, 6, config=cfg, init_method=_normal, bias=True,
                                                    input_is_parallel=True, skip_bias_add=False))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    # the whole model's norm: the split weights' squares summed over both ranks, the replicated
    # bias (RowParallelLinear's) counted once
    shards = [p.grad.square().sum() for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    total = torch.stack(shards).sum()
    torch.distributed.all_reduce(total)
    total += sum(p.grad.square().sum() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False))
    out["want"] = float(total.sqrt())
    out["default"] = float(fp.clip_grad_norm(model, math.inf))
    out["explicit"] = float(fp.clip_grad_norm(model, math.inf, tp_group=parallel_state.get_tensor_model_parallel_group()))
    # finalize_model_grads cannot tell which gradients to sum without a config: it said nothing
    try:
        fp.finalize_model_grads(model)
        out["finalize"] = "done"
    except ValueError as err:
        out["finalize"] = str(err)
    return out


def test_default_groups_are_the_tensor_parallel_group(seed):
    # tp_group None in the cross entropies meant the whole world: with tp = 1 and two processes
    # each holding whole logits, the loss was log 2 too large; clip_grad_norm on a model of
    # parallel layers without a config (and even with an explicit tp_group) returned each rank's
    # own shards' norm, different on the two ranks
    for res in fp.spawn(_default_groups_worker, 2, seed, tensor_model_parallel_size=1, backend="gloo"):
        assert max(res["ce"]) < 1e-12, res
    ranks = fp.spawn(_default_groups_worker, 2, seed, backend="gloo")
    for res in ranks:
        # float64 sums of ~100 squares: a few roundings
        assert abs(res["default"] - res["want"]) <= 1e-12 * res["want"], res
        assert abs(res["explicit"] - res["want"]) <= 1e-12 * res["want"], res
    assert ranks[0]["default"] == ranks[1]["default"]
    assert all("finalize_model_grads: a module without a config (Sequential) in a tensor-parallel run"
               in res["finalize"] for res in ranks), ranks


@pytest.mark.parametrize("fn", ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                                "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
                                "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
                                "reduce_scatter_to_sequence_parallel_region"])
def test_mappings_name_a_bad_argument(fn):
    # a list failed with "'list' object has no attribute 'clone'", a group's name with "'str' object
    # has no attribute 'size'", a 0-dim tensor to split or gather with an IndexError
    f = getattr(fp, fn)
    with pytest.raises(TypeError, match=f"{fn}: input_ must be a torch.Tensor, got list"):
        f([1.0, 2.0])
    with pytest.raises(TypeError, match=f"{fn}: group must be None .* or a torch.distributed.ProcessGroup, got "
                                        "str 'tp'"):
        f(torch.zeros(2, 2), group="tp")
    if fn.startswith(("copy", "reduce_from")):
        return
    two_ranks = types.SimpleNamespace(rank=lambda: 0, size=lambda: 2)  # refused before any collective
    with pytest.raises(ValueError, match=f"{fn}: input_ must have at least 1 dim"):
        f(torch.tensor(1.0), group=two_ranks)
    scalar = torch.tensor(1.0)
    assert f(scalar, group=SINGLE_RANK) is scalar  # one rank: the identity, as before (and Megatron-core's)


@pytest.mark.parametrize("layer, flags", [
    ("ColumnParallelLinear", ("bias", "gather_output", "skip_bias_add", "skip_weight_param_allocation",
                              "keep_master_weight_for_test", "is_expert", "disable_grad_reduce")),
    ("RowParallelLinear", ("bias", "input_is_parallel", "skip_bias_add", "keep_master_weight_for_test", "is_expert")),
    ("VocabParallelEmbedding", ("reduce_scatter_embeddings",)),
])
def test_parallel_layers_refuse_switches_that_are_not_bools(layer, flags):
    # by truthiness bias="False" made a bias
    cfg = fp_config(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    base = {"ColumnParallelLinear": dict(bias=True), "VocabParallelEmbedding": {},
            "RowParallelLinear": dict(bias=True, input_is_parallel=False, skip_bias_add=False)}[layer]
    for flag in flags:
        kw = {**base, flag: "False"}
        with pytest.raises(TypeError, match=f"{layer}: {flag} must be a bool, got str 'False'"):
            getattr(fp, layer)(8, 6, config=cfg, init_method=_normal, **kw)


@pytest.mark.parametrize("value", ["False", 0, 1.0])
def test_column_parallel_linear_refuses_a_runtime_gather_output_that_is_not_a_bool(value):
    # the forward's switch (None: the layer's gather_output) is read as a bool on several ranks
    cfg = fp_config(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    layer = fp.ColumnParallelLinear(8, 6, config=cfg, init_method=_normal)
    x = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match="ColumnParallelLinear: runtime_gather_output must be a bool"):
        layer(x, runtime_gather_output=value)
    np = pytest.importorskip("numpy")
    out, _ = layer(x, runtime_gather_output=np.bool_(False))
    assert torch.equal(out, layer(x, runtime_gather_output=None)[0])


@pytest.mark.parametrize("args, error, match", [
    ((10.0, 0, 2), TypeError, "global_vocab_size must be an int, got float"),
    (("10", 0, 2), TypeError, "global_vocab_size must be an int, got str"),
    ((10, True, 2), TypeError, "rank must be an int, got bool"),
    ((10, 0, 2.0), TypeError, "world_size must be an int, got float"),
    ((10, 0, 0), ValueError, "must be divisible by world_size=0"),
    ((10, 2, 2), ValueError, r"rank must be in \[0, world_size=2\)"),
])
def test_vocab_utility_checks_its_ints(args, error, match):
    # a float vocabulary gave float bounds (5.0, 10.0); a str failed in a %-format
    with pytest.raises(error, match=match):
        fp.VocabUtility.vocab_range_from_global_vocab_size(*args)


def test_vocab_utility_per_partition_checks_its_ints():
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        fp.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 0.5, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        fp.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 0, 0)
    np = pytest.importorskip("numpy")
    assert fp.VocabUtility.vocab_range_from_per_partition_vocab_size(np.int64(5), np.int32(1), 2) == (5, 10)


@pytest.mark.parametrize("bad", [10, -1, 1000])
def test_one_rank_embedding_names_an_id_outside_the_vocabulary_on_the_cpu(bad):
    # F.embedding's bare "IndexError: index out of range in self" named nothing
    cfg = fp_config(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    emb = fp.VocabParallelEmbedding(10, 8, init_method=torch.nn.init.zeros_, config=cfg)
    ids = torch.full((2, 3), 3)
    ids[1, 2] = bad
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, num_embeddings = 10\), got values in "):
        emb(ids)


# ----------------------------------------------------------------------------------- mappings
def _rank_input(q: int, shape, seed: int, device) -> torch.Tensor:
    """Rank q's input: the same on every process that asks, non-contiguous ([b, s, n] transposed)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 31 + q)
    t = torch.randn(shape[1], shape[0], *shape[2:], generator=gen, dtype=torch.float64)
    return t.to(device).transpose(0, 1)  # [s, b, n], non-contiguous


def _mappings_worker(rank, world_size, device, seed):
    p = world_size
    group = parallel_state.get_tensor_model_parallel_group()
    shape = (2 * p, 3, 2 * p)  # [s, b, n]: both split dims divisible by p
    xs = [_rank_input(q, shape, seed, device) for q in range(p)]  # every rank's input
    gs = [_rank_input(100 + q, shape, seed, device) for q in range(p)]  # every rank's upstream gradient
    n, s = shape[2] // p, shape[0] // p
    last = lambda t, q: t[..., q * n:(q + 1) * n]  # noqa: E731  rank q's slice of the last dim
    first = lambda t, q: t[q * s:(q + 1) * s]  # noqa: E731  ... and of dim 0
    sum_ = lambda ts: sum(ts[1:], ts[0].clone())  # noqa: E731
    r = rank
    # (function, this rank's input, this rank's upstream gradient (shaped as the output),
    #  expected output, expected input gradient)
    cases = {
        "copy_to": (fp.copy_to_tensor_model_parallel_region, xs[r], gs[r], xs[r], sum_(gs)),
        "reduce_from": (fp.reduce_from_tensor_model_parallel_region, xs[r], gs[r], sum_(xs), gs[r]),
        "scatter_to": (fp.scatter_to_tensor_model_parallel_region, xs[0], last(gs[r], r), last(xs[0], r),
                       torch.cat([last(gs[q], q) for q in range(p)], dim=-1)),
        "gather_from": (fp.gather_from_tensor_model_parallel_region, last(xs[r], r), gs[r],
                        torch.cat([last(xs[q], q) for q in range(p)], dim=-1), last(gs[r], r)),
        "scatter_to_sequence": (fp.scatter_to_sequence_parallel_region, xs[0], first(gs[r], r), first(xs[0], r),
                                torch.cat([first(gs[q], q) for q in range(p)], dim=0)),
        "gather_from_sequence": (fp.gather_from_sequence_parallel_region, first(xs[r], r), gs[r],
                                 torch.cat([first(xs[q], q) for q in range(p)], dim=0),
                                 first(sum_(gs), r)),
        "gather_from_sequence(tensor_parallel_output_grad=False)": (
            lambda t, group=None: fp.gather_from_sequence_parallel_region(t, False, group), first(xs[r], r), gs[r],
            torch.cat([first(xs[q], q) for q in range(p)], dim=0), first(gs[r], r)),
        "reduce_scatter_to_sequence": (fp.reduce_scatter_to_sequence_parallel_region, xs[r], first(gs[r], r),
                                       first(sum_(xs), r), torch.cat([first(gs[q], q) for q in range(p)], dim=0)),
    }
    done = []
    for name, (fn, x, g, want, want_grad) in cases.items():
        for explicit_group in (False, True):  # the group passed, or parallel_state's
            x_in = x.detach().clone().requires_grad_(True)  # (clone keeps a transposed input's strides)
            x_before, g_before = x_in.detach().clone(), g.clone()
            y = fn(x_in, group=group) if explicit_group else fn(x_in)
            y.backward(g)
            # moving data is exact; a sum of p float64 values is within p·eps of its exact value
            tol = dict(rtol=1e-15 * p, atol=1e-15 * p)
            torch.testing.assert_close(y, want, **tol, msg=f"{name} forward")
            torch.testing.assert_close(x_in.grad, want_grad, **tol, msg=f"{name} backward")
            assert y.shape == want.shape and x_in.grad.shape == x.shape, name
            assert torch.equal(x_in.detach(), x_before) and torch.equal(g, g_before), f"{name} modified an input"
        done.append(name)
    # a dim not divisible by p
    with pytest.raises(ValueError, match=rf"first \(sequence\) dim .* divisible by the tensor-parallel size {p}"):
        fp.scatter_to_sequence_parallel_region(torch.zeros(2 * p + 1, 2, device=device))
    with pytest.raises(ValueError, match=rf"last dim .* divisible by the tensor-parallel size {p}"):
        fp.scatter_to_tensor_model_parallel_region(torch.zeros(2, 2 * p + 1, device=device))
    return done


@pytest.mark.parametrize("backend", _backends(2))
def test_mappings_forward_and_backward(backend, seed):
    results = _spawn(_mappings_worker, 2, backend, seed)
    assert all(len(done) == 8 for done in results), results


def test_mappings_without_model_parallelism_name_the_fix():
    with pytest.raises(RuntimeError, match=r"call fusedlib.parallel.initialize_model_parallel"):
        fp.copy_to_tensor_model_parallel_region(torch.zeros(2))


# ----------------------------------------------------------------------------------- layers
def _layer_config(p: int, sp: bool, device):
    return fp_config(tensor_model_parallel_size=p, sequence_parallel=sp, params_dtype=torch.float64,
                     use_cpu_initialization=device.type == "cpu")


def fp_config(**kw):
    from fusedlib.transformer import TransformerConfig

    return TransformerConfig(**kw)


def _normal(w: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.normal_(w, 0.0, 1.0)


def _layers_worker(rank, world_size, device, seed):
    p, r = world_size, rank
    s, b = 2 * p, 3
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    tol = dict(rtol=1e-12, atol=1e-12)  # float64 sums of <= 6 products (module docstring)
    seq = lambda t: t[r * s // p:(r + 1) * s // p]  # noqa: E731  this rank's tokens
    done = []
    for sp in (False, True):
        cfg = _layer_config(p, sp, device)
        one = dataclasses.replace(cfg, tensor_model_parallel_size=1, sequence_parallel=False)

        # ColumnParallelLinear 5 -> 6: weight [3, 5] on each of 2 ranks
        for gather_output, skip_bias_add in ((False, False), (True, True)):
            if sp and gather_output:
                continue
            torch.manual_seed(seed)
            full = fp.ColumnParallelLinear(5, 6, config=one, init_method=_normal)
            torch.manual_seed(seed)
            layer = fp.ColumnParallelLinear(5, 6, config=cfg, init_method=_normal, gather_output=gather_output,
                                            skip_bias_add=skip_bias_add)
            bias = rand(6)
            with torch.no_grad():
                layer.bias.copy_(shard_tensor(bias, PartitionSpec(0), r, p))
            assert torch.equal(layer.weight, shard_tensor(full.weight.detach(), PartitionSpec(0), r, p))
            x, g = rand(s, b, 5), rand(s, b, 6)
            x_local = (seq(x) if sp else x).clone().requires_grad_(True)
            out, out_bias = layer(x_local)
            want = F.linear(x, full.weight.detach(), None if skip_bias_add else bias)
            mine = want if gather_output else want[..., r * 3:(r + 1) * 3]
            torch.testing.assert_close(out, mine, **tol)
            assert (out_bias is layer.bias) is skip_bias_add
            out.backward(g if gather_output else g[..., r * 3:(r + 1) * 3])
            grad_x = g.matmul(full.weight.detach())  # the sum over ranks of their partial input gradients
            torch.testing.assert_close(x_local.grad, seq(grad_x) if sp else grad_x, **tol)
            g_mine = g[..., r * 3:(r + 1) * 3]
            torch.testing.assert_close(layer.weight.grad, g_mine.reshape(-1, 3).t() @ x.reshape(-1, 5), **tol)
            if not skip_bias_add:
                torch.testing.assert_close(layer.bias.grad, g_mine.sum(dim=(0, 1)), **tol)
            done.append(f"column sp={sp} gather={gather_output}")

        # RowParallelLinear 6 -> 5: weight [5, 3] on each of 2 ranks
        for input_is_parallel in ((True,) if sp else (True, False)):
            torch.manual_seed(seed)
            full = fp.RowParallelLinear(6, 5, config=one, init_method=_normal, bias=True, input_is_parallel=True,
                                        skip_bias_add=False)
            torch.manual_seed(seed)
            layer = fp.RowParallelLinear(6, 5, config=cfg, init_method=_normal, bias=True,
                                         input_is_parallel=input_is_parallel, skip_bias_add=False)
            assert torch.equal(layer.weight, shard_tensor(full.weight.detach(), PartitionSpec(1), r, p))
            assert layer.bias.sequence_parallel is sp
            # a replicated parameter counts once over the ranks (e.g. in a gradient norm), a split one on each
            assert fp.layers.param_is_not_tensor_parallel_duplicate(layer.weight)
            assert fp.layers.param_is_not_tensor_parallel_duplicate(layer.bias) is (r == 0)
            bias = rand(5)
            with torch.no_grad():
                layer.bias.copy_(bias)
            x, g = rand(s, b, 6), rand(s, b, 5)
            x_local = (x[..., r * 3:(r + 1) * 3] if input_is_parallel else x).clone().requires_grad_(True)
            out, _ = layer(x_local)
            want = F.linear(x, full.weight.detach(), bias)
            torch.testing.assert_close(out, seq(want) if sp else want, **tol)
            out.backward(seq(g) if sp else g)
            grad_x = g.matmul(full.weight.detach())
            torch.testing.assert_close(x_local.grad, grad_x[..., r * 3:(r + 1) * 3] if input_is_parallel else grad_x,
                                       **tol)
            grad_w = g.reshape(-1, 5).t() @ x.reshape(-1, 6)  # [5, 6]: this rank holds columns r·3 .. r·3 + 2
            torch.testing.assert_close(layer.weight.grad, grad_w[:, r * 3:(r + 1) * 3], **tol)
            # the bias saw this rank's tokens only under sequence parallelism: a partial sum
            torch.testing.assert_close(layer.bias.grad, (seq(g) if sp else g).sum(dim=(0, 1)), **tol)
            done.append(f"row sp={sp} input_is_parallel={input_is_parallel}")

        # VocabParallelEmbedding V = 10, h = 4: every id, some twice
        ids = torch.tensor([[0, 9, 4, 5], [5, 1, 8, 2], [3, 7, 6, 0]], device=device)[:, :s]  # [b, s]
        torch.manual_seed(seed)
        full = fp.VocabParallelEmbedding(10, 4, init_method=_normal, config=one)
        torch.manual_seed(seed)
        emb = fp.VocabParallelEmbedding(10, 4, init_method=_normal, config=cfg, reduce_scatter_embeddings=sp)
        out = emb(ids)
        want = F.embedding(ids, full.weight.detach())  # [b, s, h]
        want = seq(want.transpose(0, 1)) if sp else want
        torch.testing.assert_close(out, want, rtol=0, atol=0)  # one nonzero term per entry: exact
        g = rand(*want.shape)
        out.backward(g)
        # every rank drew the same g: under sequence parallelism the backward gathers the p ranks'
        # [s/p, b, h] gradients into [s, b, h]
        g_full = torch.cat([g] * p, dim=0).transpose(0, 1) if sp else g  # [b, s, h]
        expected_rows = torch.zeros(10, 4, dtype=torch.float64, device=device).index_add_(
            0, ids.reshape(-1), g_full.reshape(-1, 4))
        torch.testing.assert_close(emb.weight.grad, expected_rows[r * 5:(r + 1) * 5], **tol)
        done.append(f"embedding sp={sp}")

    # bad sizes name the argument and p
    cfg = _layer_config(p, False, device)
    with pytest.raises(ValueError, match=rf"ColumnParallelLinear: output_size \(5\) must be divisible by "
                                         rf"tensor_model_parallel_size \({p}\)"):
        fp.ColumnParallelLinear(4, 5, config=cfg, init_method=_normal)
    with pytest.raises(ValueError, match=r"RowParallelLinear: input_size \(7\) must be divisible"):
        fp.RowParallelLinear(7, 4, config=cfg, init_method=_normal, bias=False, input_is_parallel=True,
                             skip_bias_add=False)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: num_embeddings \(the vocabulary\) \(11\)"):
        fp.VocabParallelEmbedding(11, 4, init_method=_normal, config=cfg)
    with pytest.raises(RuntimeError, match="`input_is_parallel` must be `True`"):
        fp.RowParallelLinear(8, 4, config=_layer_config(p, True, device), init_method=_normal, bias=False,
                             input_is_parallel=False, skip_bias_add=False)
    wrong = dataclasses.replace(cfg, tensor_model_parallel_size=2 * p)
    with pytest.raises(ValueError, match=rf"tensor_model_parallel_size={2 * p}, but the tensor-parallel group "
                                         rf"has {p} rank"):
        fp.ColumnParallelLinear(4, 4 * p, config=wrong, init_method=_normal)
    # an id outside [0, V) would be a zero row on every rank: the device-side check reports it on
    # every rank (at once on the CPU; on CUDA at check_errors, after the collective completed)
    emb = fp.VocabParallelEmbedding(10, 4, init_method=_normal, config=cfg)
    for bad in (10, -1):
        ids_bad = torch.tensor([[0, 3], [bad, 9]], device=device)
        match = rf"VocabParallelEmbedding: input_ids must hold vocabulary ids in \[0, 10\), got {bad}"
        with pytest.raises(ValueError, match=match):
            emb(ids_bad)
            fusedlib.runtime.check_errors()
    emb(torch.tensor([[0, 9]], device=device))  # in range: nothing reported
    fusedlib.runtime.check_errors()
    # strided and expanded ids (views that reshape keeps): the check reads their own elements, not
    # the memory after the first one (which missed the 10 here, and reported the 10s in between)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: input_ids must hold vocabulary ids in \[0, 10\), "
                                         r"got 10"):
        emb(torch.tensor([[0, 1, 2, 3, 10, 5]], device=device)[:, ::2])
        fusedlib.runtime.check_errors()
    emb(torch.tensor([[0, 10, 1, 10]], device=device)[:, ::2])  # [[0, 1]]: in range
    emb(torch.tensor([[3]], device=device).expand(2, 4))  # stride 0: one element, in range
    emb(torch.tensor([[0, 10], [4, 10]], device=device)[:, :1])  # [[0], [4]]: a column, in range
    fusedlib.runtime.check_errors()
    # the process groups: a size that does not divide the world, and a second initialization
    parallel_state.destroy_model_parallel()
    with pytest.raises(ValueError, match=rf"tensor_model_parallel_size=3 must divide the world size {p}"):
        parallel_state.initialize_model_parallel(3)
    parallel_state.initialize_model_parallel(p)
    with pytest.raises(RuntimeError, match="already initialized"):
        parallel_state.initialize_model_parallel(p)
    assert (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size()) == (r, p, 1)
    # sequence parallelism with a sequence not divisible by p
    from fusedlib.parallel.check_tp import build_gpt

    gpt = build_gpt(CASES["unfused/gelu/learned/qk-norm/sp/unfused-ce"], p, torch.float64, seed,
                    use_cpu_initialization=device.type == "cpu").to(device)
    ids = torch.zeros(2, 2 * p + 1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=rf"first \(sequence\) dim .* divisible by the tensor-parallel size {p}"):
        gpt(ids, None, None)
    done.append("errors")
    return done


@pytest.mark.parametrize("backend", _backends(2))
def test_parallel_layers_match_the_full_layer(backend, seed):
    results = _spawn(_layers_worker, 2, backend, seed)
    for done in results:
        assert len(done) == 9 and done[-1] == "errors", done  # 5 layers without, 3 with SP


# ----------------------------------------------------------------------------------- random numbers
def _dropout_worker(rank, world_size, device, seed):
    from fusedlib.parallel.check_tp import _inputs, build_gpt
    from fusedlib.parallel.finalize_model_grads import finalize_model_grads
    from fusedlib.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from fusedlib.transformer.dot_product_attention import DotProductAttention
    from fusedlib.transformer.enums import AttnBackend, AttnMaskType

    p = world_size
    cpu = {"use_cpu_initialization": device.type == "cpu"}
    gather = lambda t: [torch.empty_like(t) for _ in range(p)]  # noqa: E731
    out = {}

    # the tracker: outside a fork every rank draws the same numbers, inside each its own, and the
    # default stream continues after the fork as if it had not happened
    tracker = fp.get_cuda_rng_tracker()
    with pytest.raises(KeyError, match="call fusedlib.parallel.model_parallel_cuda_manual_seed"):
        with tracker.fork():
            pass
    fp.model_parallel_cuda_manual_seed(seed)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("another", seed)
    a = torch.rand(4, device=device)
    with tracker.fork():
        b = torch.rand(4, device=device)
    c = torch.rand(4, device=device)
    torch.manual_seed(seed)
    a2, c2 = torch.rand(4, device=device), torch.rand(4, device=device)  # the same draws without the fork
    assert torch.equal(a, a2) and torch.equal(c, c2), "the fork moved the default stream"
    parts = gather(b)
    torch.distributed.all_gather(parts, b)
    assert not torch.equal(parts[0], parts[1]), "forked streams agree across ranks"
    parts = gather(a)
    torch.distributed.all_gather(parts, a)
    assert torch.equal(parts[0], parts[1]), "default streams differ across ranks"

    # the attention dropout of this rank's heads is this rank's own, on every backend: give every
    # rank the same heads (rank 0's QKV shard) and the same input; without dropout their core
    # attentions agree, with it they differ
    for backend in (AttnBackend.local, AttnBackend.auto, AttnBackend.flash):
        cfg = fp_config(num_layers=1, hidden_size=16, num_attention_heads=2 * p, kv_channels=4, attention_dropout=0.5,
                        tensor_model_parallel_size=p, attention_backend=backend, add_bias_linear=False, **cpu)
        attn = SelfAttention(cfg, SelfAttentionSubmodules(linear_qkv=fp.ColumnParallelLinear,
                                                          core_attention=DotProductAttention,
                                                          linear_proj=fp.RowParallelLinear),
                             layer_number=1, attn_mask_type=AttnMaskType.causal).to(device)
        torch.distributed.broadcast(attn.linear_qkv.weight.data, src=0)
        seen = []
        attn.core_attention.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
        x = torch.randn(5, 1, 16, device=device)  # [s, b, h], the same on every rank
        for train in (False, True):
            seen.clear()
            attn.train(train)(x, None)
            parts = gather(seen[0])
            torch.distributed.all_gather(parts, seen[0])
            assert torch.equal(parts[0], parts[1]) is not train, \
                f"{backend.name}: the ranks' identical heads drew {'the same' if train else 'different'} outputs"

    # the hidden dropout of the replicated residual stream (no sequence parallelism) is the same on
    # every rank, and the same as on one rank: the loss equals the one-rank loss in training
    case = CASES["unfused/gelu/learned/qk-norm/fused-ce"]
    ids, labels, grad = _inputs(seed, device)
    losses = []
    for tp in (1, p):
        model = build_gpt(case, tp, torch.float64, seed, hidden_dropout=0.25, **cpu).to(device).train()
        fp.model_parallel_cuda_manual_seed(seed + 1)
        losses.append(model(ids, None, None, labels=labels).detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
    dropped = build_gpt(case, 1, torch.float64, seed, **cpu).to(device)
    assert not torch.allclose(dropped(ids, None, None, labels=labels), losses[0]), "the dropout did nothing"

    # recomputation replays the dropout masks, the tracker's included: selective (core attention,
    # forked per head) and full (sequence parallelism: the whole block forked)
    for name, recompute in (("unfused/gelu/learned/qk-norm/fused-ce", dict(recompute_granularity="selective")),
                            ("unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce",
                             dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))):
        runs = []
        for kw in ({}, recompute):
            model = build_gpt(CASES[name], p, torch.float64, seed, hidden_dropout=0.25, attention_dropout=0.25,
                              **kw, **cpu).to(device).train()
            fp.model_parallel_cuda_manual_seed(seed + 2)
            model(ids, None, None, labels=labels).backward(grad)
            finalize_model_grads(model)
            runs.append({n: q.grad for n, q in model.named_parameters()})
        for n in runs[0]:
            # the same masks give the same gradients up to the order of float64 sums (CUDA's
            # atomics); a different mask changes them at O(1)
            torch.testing.assert_close(runs[1][n], runs[0][n], rtol=1e-12, atol=1e-12,
                                       msg=f"{name}: recomputation changed the gradient of {n}")
        out[name] = len(runs[0])
    return out


@pytest.mark.parametrize("backend", _backends(2))
def test_dropout_masks_agree_where_replicated_and_differ_where_split(backend, seed):
    results = _spawn(_dropout_worker, 2, backend, seed)
    assert all(len(r) == 2 for r in results), results


# ----------------------------------------------------------------------------------- data parallelism
def _data_parallel_worker(rank, world_size, device, seed):
    # tensor-parallel size 1 on 2 ranks: two data-parallel replicas
    assert (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()) == (rank, 2)
    cfg = fp_config(sequence_parallel=True, params_dtype=torch.float64, use_cpu_initialization=device.type == "cpu")
    model = torch.nn.Module()
    model.config = cfg
    model.linear = fp.ColumnParallelLinear(4, 6, config=cfg, init_method=_normal)
    model.norm = fp_norm(cfg)
    grads = {}
    for name, param in model.named_parameters():
        gen = torch.Generator(device="cpu").manual_seed(seed + rank)
        param.grad = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(device)
        grads[name] = param.grad.clone()
    with fp.count_collectives() as log:
        fp.finalize_model_grads(model)
    # tensor-parallel size 1: no sum over tensor-parallel ranks (sequence_parallel marks or not);
    # one all-reduce of all gradients (one dtype) over the data-parallel group, then / 2
    assert len(log) == 1, log.summary()
    return grads, {n: q.grad for n, q in model.named_parameters()}


def fp_norm(cfg):
    from fusedlib.fusions.fused_layer_norm import FusedLayerNorm

    return FusedLayerNorm(cfg, 4, device="cpu" if cfg.use_cpu_initialization else None, dtype=cfg.params_dtype)


def test_finalize_model_grads_averages_over_data_parallel_ranks(seed):
    results = fp.spawn(_data_parallel_worker, 2, seed, tensor_model_parallel_size=1, backend="gloo")
    (before0, after0), (before1, after1) = results
    for name in before0:
        mean = (before0[name] + before1[name]) / 2
        torch.testing.assert_close(after0[name], mean, rtol=1e-15, atol=0)  # (a + b) / 2: exact but one rounding
        assert torch.equal(after0[name], after1[name]), name


# ----------------------------------------------------------------------------------- one process
def test_process_groups_in_one_process():
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        parallel_state.get_tensor_model_parallel_rank()
    with pytest.raises(RuntimeError, match="needs 2 processes.*torchrun --nproc-per-node 2"):
        parallel_state.initialize_model_parallel(2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be an int >= 1, got 0"):
        parallel_state.initialize_model_parallel(0)
    assert not parallel_state.model_parallel_is_initialized()
    parallel_state.initialize_model_parallel(1)  # one process: no torch.distributed needed
    try:
        assert parallel_state.get_tensor_model_parallel_group() is None
        assert (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()) == (0, 1, 0, 1)
        x = torch.randn(3, requires_grad=True)
        assert fp.copy_to_tensor_model_parallel_region(x) is x  # one rank: the identity, no autograd node
        assert fp.reduce_scatter_to_sequence_parallel_region(x) is x
    finally:
        parallel_state.destroy_model_parallel()
    assert not parallel_state.model_parallel_is_initialized()


def test_getters_refuse_before_initialization_and_the_size_must_be_an_int():
    # every getter names the missing initialization (the group getters return None only when
    # told not to check); a bool or a float size is refused even where it equals 1
    assert not parallel_state.model_parallel_is_initialized()
    for getter in (parallel_state.get_tensor_model_parallel_group, parallel_state.get_tensor_model_parallel_rank,
                   parallel_state.get_tensor_model_parallel_world_size, parallel_state.get_data_parallel_group,
                   parallel_state.get_data_parallel_rank, parallel_state.get_data_parallel_world_size):
        with pytest.raises(RuntimeError, match=f"{getter.__name__}: model parallel groups are not initialized"):
            getter()
    assert parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None
    assert parallel_state.get_data_parallel_group(check_initialized=False) is None
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"tensor_model_parallel_size must be an int >= 1, got "):
            parallel_state.initialize_model_parallel(bad)
        assert not parallel_state.model_parallel_is_initialized()


def test_default_backend_is_nccl_only_with_cuda(monkeypatch):
    for cuda, want in ((True, "nccl"), (False, "gloo")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        assert parallel_state.default_backend() == want


_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_init_distributed_reads_torchruns_environment(monkeypatch):
    # torch.distributed itself is replaced by a recorder: what init_distributed asks of it
    import datetime

    calls, devices = [], []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for k in _TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    # not started by torchrun: the missing variables named, nothing initialized
    with pytest.raises(RuntimeError, match="WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT not set: start the processes "
                                           "with torchrun"):
        parallel_state.init_distributed("gloo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized and RANK, MASTER_PORT not set"):
        parallel_state.init_distributed("gloo")
    assert calls == [] and devices == []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for bad in ("mpi", "NCCL"):
        with pytest.raises(ValueError, match=f"backend must be 'nccl', 'gloo' or None, got '{bad}'"):
            parallel_state.init_distributed(bad)
    assert calls == []
    # NCCL: this process's GPU is LOCAL_RANK's (not RANK's), bound before the group is made
    parallel_state.init_distributed("nccl", timeout_s=42.0)
    assert devices == [1]
    assert calls == [(("nccl",), dict(init_method="env://", timeout=datetime.timedelta(seconds=42),
                                      device_id=torch.device("cuda", 1)))]
    # gloo: no GPU; None takes the default backend (gloo without CUDA)
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parallel_state.init_distributed(None)
    parallel_state.init_distributed("gloo", timeout_s=5)
    assert devices == [1]
    assert calls == [(("gloo",), dict(init_method="env://", timeout=datetime.timedelta(seconds=600))),
                     (("gloo",), dict(init_method="env://", timeout=datetime.timedelta(seconds=5)))]
    # already initialized: nothing asked
    calls.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    parallel_state.init_distributed("gloo")
    assert calls == []


def test_a_torchrun_process_initializes_torch_distributed_even_at_size_1(monkeypatch):
    # with torchrun's WORLD_SIZE set, initialize_model_parallel(1) must join the process group
    # (the data-parallel ranks are the other processes), with the backend it was given
    backends = []

    def init_distributed(backend=None, timeout_s=600.0):
        backends.append(backend)
        raise RuntimeError("torch.distributed stands in here")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "init_distributed", init_distributed)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for backend in ("gloo", None):
        with pytest.raises(RuntimeError, match="torch.distributed stands in here"):
            parallel_state.initialize_model_parallel(1, backend=backend)
        assert not parallel_state.model_parallel_is_initialized()
    assert backends == ["gloo", None]


def _group_layout_worker(rank, world_size, device):
    ranks = torch.distributed.get_process_group_ranks
    out = dict(tp=ranks(parallel_state.get_tensor_model_parallel_group()),
               dp=ranks(parallel_state.get_data_parallel_group()),
               tp_rank=parallel_state.get_tensor_model_parallel_rank(),
               tp_size=parallel_state.get_tensor_model_parallel_world_size(),
               dp_rank=parallel_state.get_data_parallel_rank(), dp_size=parallel_state.get_data_parallel_world_size())
    parallel_state.destroy_model_parallel()
    out["after_destroy"] = (parallel_state.model_parallel_is_initialized(),
                            parallel_state.get_tensor_model_parallel_group(check_initialized=False),
                            parallel_state.get_data_parallel_group(check_initialized=False))
    return out


def test_groups_of_four_ranks_at_tensor_parallel_size_2():
    # Megatron's layout: tensor-parallel groups of adjacent ranks [0, 1], [2, 3]; data-parallel
    # groups of the ranks holding the same shard [0, 2], [1, 3] (at world = p the two layouts
    # cannot be told apart); destroy_model_parallel forgets both groups
    for r, res in enumerate(fp.spawn(_group_layout_worker, 4, tensor_model_parallel_size=2, backend="gloo")):
        assert res == dict(tp=[2 * (r // 2), 2 * (r // 2) + 1], dp=[r % 2, r % 2 + 2], tp_rank=r % 2, tp_size=2,
                           dp_rank=r // 2, dp_size=2, after_destroy=(False, None, None)), (r, res)


def test_spawn_picks_nccl_only_with_a_gpu_per_rank(monkeypatch):
    from fusedlib.parallel import demo

    calls = []
    monkeypatch.setattr(demo, "run_tp", lambda fn, world_size, *args, backend: calls.append((world_size, args, backend)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpus, want in ((1, "gloo"), (2, "nccl"), (3, "nccl")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        calls.clear()
        fp.spawn(_noop_rank, 2, "arg")
        fp.spawn(_noop_rank, 2, tensor_model_parallel_size=1, backend="gloo")
        # (fn, p, *args) reach the launcher; p defaults to the world size
        assert calls == [(2, (_noop_rank, 2, "arg"), want), (2, (_noop_rank, 1), "gloo")], (gpus, calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls.clear()
    fp.spawn(_noop_rank, 2)
    assert calls == [(2, (_noop_rank, 2), "gloo")]


def test_bad_tensor_parallel_sizes_raise_clear_errors():
    from fusedlib.models.gpt import GPTModel, get_gpt_layer_local_spec

    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) and num_query_groups \(3\) must both be "
                                         r"divisible by tensor_model_parallel_size \(2\)"):
        fp_config(num_layers=1, hidden_size=12, num_attention_heads=6, num_query_groups=3, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be >= 1, got 0"):
        fp_config(tensor_model_parallel_size=0)
    cfg = fp_config(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2)
    with pytest.raises(RuntimeError, match=r"tensor_model_parallel_size=2, but model parallelism is not initialized: "
                                           r"call fusedlib.parallel.initialize_model_parallel\(2\)"):
        GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=8, max_sequence_length=4)


# ----------------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("world_size", (2, 4))
def test_shard_and_unshard_state_dict_round_trip(world_size, seed):
    from fusedlib.parallel.check_tp import build_gpt

    model = build_gpt(CASES["fused/swiglu/learned/tied/sp/fused-ce"], 1, torch.float32, seed)
    full = model.state_dict()
    layout = get_tensor_parallel_layout(model)
    shards = [shard_state_dict(full, layout, r, world_size) for r in range(world_size)]
    back = unshard_state_dict(shards, layout)
    assert list(back) == list(full)
    # any iterable of the shards (a generator failed: the type check consumed it, then indexing failed)
    again = unshard_state_dict((sd for sd in shards), layout)
    assert list(again) == list(full) and all(v is None or torch.equal(v, back[k]) for k, v in again.items())
    for k, v in full.items():
        assert (v is None and back[k] is None) or torch.equal(back[k], v), k
        if k not in layout and isinstance(v, torch.Tensor):
            assert shards[1][k] is v  # replicated: passed through, not copied
    # the shapes a p-rank model holds
    p, fc1 = world_size, "decoder.layers.0.mlp.linear_fc1.weight"
    assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 32 // p)
    assert shards[0]["embedding.word_embeddings.weight"].shape == (64 // p, 32)
    # SwiGLU's fc1 [2·ffn, h] = [x1; x2]: rank r holds [x1_r; x2_r]
    x1, x2 = full[fc1].chunk(2, dim=0)
    r = p - 1
    assert torch.equal(shards[r][fc1], torch.cat([x1.chunk(p)[r], x2.chunk(p)[r]]))
    assert shards[r][fc1].is_contiguous() and not any(t.data_ptr() == full[fc1].data_ptr() for t in shards[r].values()
                                                      if isinstance(t, torch.Tensor) and t.numel())
    # nothing was modified
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in full.items() if isinstance(v, torch.Tensor))


def test_deepcopy_keeps_the_parameters_tensor_parallel_attributes(seed):
    # torch's Parameter.__deepcopy__ drops Python attributes: a deep-copied model lost
    # sequence_parallel / tensor_model_parallel / partition_dim, which finalize_model_grads and
    # the checkpoint helpers read (silently: the norms' gradients were no longer summed)
    import copy

    from fusedlib.parallel.check_tp import build_gpt

    model = build_gpt(CASES["fused/swiglu/learned/tied/sp/fused-ce"], 1, torch.float32, seed)
    marked = {n: dict(vars(p)) for n, p in model.named_parameters() if vars(p)}
    assert any("sequence_parallel" in a for a in marked.values()) and any("partition_dim" in a for a in marked.values())
    twin = copy.deepcopy(model)
    copied = dict(twin.named_parameters())
    for name, attrs in marked.items():
        assert dict(vars(copied[name])) == attrs, name
        assert copied[name] is not dict(model.named_parameters())[name]
    assert get_tensor_parallel_layout(twin) == get_tensor_parallel_layout(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_state_dict_helpers_raise_clear_errors():
    full = {"w": torch.arange(12.0).reshape(6, 2), "n": torch.ones(2)}
    layout = {"w": PartitionSpec(0, 1)}
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\), got 2"):
        shard_state_dict(full, layout, 2, 2)
    with pytest.raises(ValueError, match=r"w: dim 0 of shape \[6, 2\] \(6\) must be divisible by "
                                         r"world_size·stride = 4·1"):
        shard_state_dict(full, layout, 0, 4)
    with pytest.raises(ValueError, match=r"the layout's entries \['missing'\] are not in the state dict"):
        shard_state_dict(full, {"missing": PartitionSpec(0)}, 0, 2)
    shards = [shard_state_dict(full, layout, r, 2) for r in range(2)]
    shards[1] = {**shards[1], "n": torch.tensor([1.0, 1.5])}
    with pytest.raises(ValueError, match=r"replicated entry 'n' differs between rank 0 and rank 1 "
                                         r"\(max \|difference\| 0.5\)"):
        unshard_state_dict(shards, layout)
    assert torch.equal(unshard_state_dict(shards, layout, check_replicas=False)["n"], full["n"])
    with pytest.raises(ValueError, match=r"rank 1's keys differ from rank 0's: \['n'\]"):
        unshard_state_dict([shards[0], {"w": shards[1]["w"]}], layout)


def test_state_dict_helpers_refuse_what_does_not_join():
    # each of these was merged silently (dtype promotion by torch.cat, a None replica taken from
    # rank 0, a layout entry skipped) or raised ZeroDivisionError / IndexError / AttributeError
    full = {"w": torch.arange(16.0).reshape(4, 4), "n": torch.ones(4)}
    layout = {"w": PartitionSpec(0)}
    shards = [shard_state_dict(full, layout, r, 2) for r in range(2)]
    for other, dtype in ((torch.float64, "torch.float64"), (torch.int64, "torch.int64")):
        with pytest.raises(ValueError, match=rf"w: the shards' dtypes differ: \['torch.float32', '{dtype}'\]"):
            unshard_state_dict([shards[0], {**shards[1], "w": shards[1]["w"].to(other)}], layout)
    for r in (0, 1):
        bad = [dict(sd) for sd in shards]
        bad[r]["n"] = None
        first, then = ("NoneType", "Tensor") if r == 0 else ("Tensor", "NoneType")
        with pytest.raises(ValueError, match=f"replicated entry 'n' is {first} on rank 0 and {then} on rank 1"):
            unshard_state_dict(bad, layout)
    with pytest.raises(ValueError, match=r"replicated entry 'n' differs .*\(dtype torch.float32 against torch.float64\)"):
        unshard_state_dict([shards[0], {**shards[1], "n": shards[1]["n"].double()}], layout)
    with pytest.raises(ValueError, match=r"the layout's entries \['missing'\] are not in the state dicts"):
        unshard_state_dict(shards, {**layout, "missing": PartitionSpec(0)})
    for spec, match in ((PartitionSpec(0, 0), "stride must be >= 1, got 0"),
                        (PartitionSpec(0, -1), "stride must be >= 1, got -1"),
                        (PartitionSpec(0.0, 1), "dim must be an int, got 0.0"), ((0,), "must be a PartitionSpec")):
        with pytest.raises(ValueError, match=f"w: .*{match}"):
            shard_state_dict(full, {"w": spec}, 0, 2)
        with pytest.raises(ValueError, match=f"w: .*{match}"):
            unshard_state_dict(shards, {"w": spec})
    with pytest.raises(ValueError, match=r"w: partition_dim 5 out of range for the shards' shape \[2, 4\]"):
        unshard_state_dict(shards, {"w": PartitionSpec(5)})
    with pytest.raises(ValueError, match="w: the full entry must be a tensor .* got NoneType"):
        shard_state_dict({**full, "w": None}, layout, 0, 2)
    with pytest.raises(ValueError, match="w: rank 1's shard must be a tensor .* got NoneType"):
        unshard_state_dict([shards[0], {**shards[1], "w": None}], layout)
    assert torch.equal(unshard_state_dict(shards, layout)["w"], full["w"])  # and the good ones still join


def test_state_dict_helpers_on_complex_devices_plain_values_and_containers():
    # two equal complex NaN replicas were called different, and an imaginary-only difference was
    # reported as 0.0; int64 replicas differing above 2^53 as 0.0; non-tensor replicas were never
    # compared; mixed devices reached torch's own errors; a dict for the list of shards gave
    # KeyError: 0; a Parameter's shard kept a grad_fn
    full = {"w": torch.nn.Parameter(torch.arange(8.0).reshape(4, 2)), "c": torch.tensor([complex("nan"), 1j]),
            "i": torch.tensor([2 ** 60]), "e": 1}
    layout = {"w": PartitionSpec(0)}
    shards = [shard_state_dict(full, layout, r, 2) for r in range(2)]
    assert shards[0]["w"].grad_fn is None and not shards[0]["w"].requires_grad
    assert unshard_state_dict(shards, layout)["c"] is full["c"]  # equal complex NaNs are equal
    with pytest.raises(ValueError, match=r"replicated entry 'c' differs .*\(max \|difference\| 1.0\)"):
        unshard_state_dict([shards[0], {**shards[1], "c": torch.tensor([complex("nan"), 2j])}], layout)
    with pytest.raises(ValueError, match=r"replicated entry 'i' differs .*\(max \|difference\| 1\)"):
        unshard_state_dict([shards[0], {**shards[1], "i": torch.tensor([2 ** 60 + 1])}], layout)
    with pytest.raises(ValueError, match="replicated entry 'e' is 1 on rank 0 and 2 on rank 1"):
        unshard_state_dict([shards[0], {**shards[1], "e": 2}], layout)
    with pytest.raises(ValueError, match=r"w: the shards' devices differ: \['cpu', 'meta'\]"):
        unshard_state_dict([shards[0], {**shards[1], "w": shards[1]["w"].to("meta")}], layout)
    with pytest.raises(ValueError, match="replicated entry 'i' is on cpu on rank 0 and on meta on rank 1"):
        unshard_state_dict([shards[0], {**shards[1], "i": shards[1]["i"].to("meta")}], layout)
    with pytest.raises(TypeError, match="shards must be a list of the ranks' state dicts .* got dict"):
        unshard_state_dict(shards[0], layout)
    with pytest.raises(TypeError, match="shard_state_dict: layout must be a dict, got list"):
        shard_state_dict(full, list(layout.items()), 0, 2)


def test_layout_is_named_as_the_state_dict():
    # from named_parameters: a Float16Module's entries were named "module.*" (not in its state dict:
    # shard_state_dict refused the pair) and a tied parameter's second name was left out (its full
    # weight then sat beside the shards as if replicated)
    from fusedlib.transformer import Float16Module

    cfg = fp_config(use_cpu_initialization=True)
    wrapped = Float16Module(fp_config(bf16=True), fp.ColumnParallelLinear(4, 8, config=cfg, init_method=_normal))
    layout = get_tensor_parallel_layout(wrapped)
    assert set(layout) == {"weight", "bias"}
    shards = [shard_state_dict(wrapped.state_dict(), layout, r, 2) for r in range(2)]
    assert torch.equal(unshard_state_dict(shards, layout)["weight"], wrapped.state_dict()["weight"])
    tied = torch.nn.Module()
    tied.a = fp.ColumnParallelLinear(4, 8, config=cfg, init_method=_normal, bias=False)
    tied.b = fp.ColumnParallelLinear(4, 8, config=cfg, init_method=_normal, bias=False)
    tied.b.weight = tied.a.weight
    assert set(get_tensor_parallel_layout(tied)) == {"a.weight", "b.weight"}


def _noop_rank(rank, world_size, device):
    return rank


def test_launch_and_seed_arguments_are_checked(seed):
    from fusedlib.parallel import spawn

    for world_size in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got "):
            spawn(_noop_rank, world_size)
    for backend in ("mpi", "not-a-backend"):  # a one-process world accepted any backend
        with pytest.raises(ValueError, match=f"backend must be 'nccl', 'gloo' or None, got '{backend}'"):
            parallel_state.initialize_model_parallel(1, backend=backend)
        assert not parallel_state.model_parallel_is_initialized()
    for bad in (2 ** 64, 2 ** 63 - 2718, -1, 1.5):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^63 - 2718 - tp_rank\)"):
            fp.model_parallel_cuda_manual_seed(bad, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank must be an int >= 0 or None, got -1"):
        fp.model_parallel_cuda_manual_seed(seed, tp_rank=-1)


def test_parallel_linears_name_a_wrong_input(seed):
    # torch's "mat1 and mat2 shapes cannot be multiplied (6x6 and 8x4)" named neither the layer
    # nor the width it expected
    from conftest import DEVICE

    cfg = fp_config(num_layers=1, hidden_size=8, num_attention_heads=2)
    col = fp.ColumnParallelLinear(8, 6, config=cfg, init_method=torch.nn.init.zeros_).to(DEVICE)
    row = fp.RowParallelLinear(8, 6, config=cfg, init_method=torch.nn.init.zeros_, bias=True, input_is_parallel=True,
                               skip_bias_add=False).to(DEVICE)
    for layer, name in ((col, "ColumnParallelLinear"), (row, "RowParallelLinear")):
        with pytest.raises(ValueError, match=rf"{name}: input_ must be \[\.\.\., 8\] \(input_size\), got shape \[3, 2, 6\]"):
            layer(torch.randn(3, 2, 6, device=DEVICE))
        with pytest.raises(ValueError, match=rf"{name}: input_ must have the weight's dtype torch.float32 .*float64"):
            layer(torch.randn(3, 2, 8, device=DEVICE, dtype=torch.float64))
        with pytest.raises(ValueError, match=rf"{name}: input_ must be a tensor \[\.\.\., 8\], got list"):
            layer([1.0] * 8)
        x = torch.randn(3, 2, 8, device=DEVICE)
        assert layer(x)[0].shape == (3, 2, 6)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):  # autocast casts: a bf16 input meets float32 weights
            assert layer(x.bfloat16())[0].shape == (3, 2, 6)


def test_a_leaked_process_group_is_destroyed_after_its_test():
    # the conftest fixture's contract: this test creates a one-rank group and leaves it; the next
    # test (below, in the same process) must start without one
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group leaked into this test from an earlier one")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.is_initialized()


def test_the_group_left_by_the_test_above_is_gone():
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_one_rank_layers_name_bad_arguments(seed):
    # a supplied weight or an input on another device (meta) was multiplied as unwritten memory or
    # reached torch's autocast ("unknown device type"); a list weight gave an AttributeError; a
    # float64 weight torch's dtype message; sizes of -6 or 6.0 failed inside torch.empty; float ids
    # reached F.embedding's message at p = 1
    from conftest import DEVICE

    cfg = _layer_config(1, False, DEVICE)
    col = fp.ColumnParallelLinear(6, 4, config=cfg, init_method=_normal, bias=True)
    row = fp.RowParallelLinear(6, 4, config=cfg, init_method=_normal, bias=True, input_is_parallel=True,
                               skip_bias_add=False)
    x = torch.randn(3, 6, device=DEVICE, dtype=torch.float64)
    for layer in (col, row):
        with pytest.raises(ValueError, match=f"{type(layer).__name__}: input_ must be on the weight's device"):
            layer(x.to("meta"))
    with pytest.raises(TypeError, match=r"weight must be a tensor \[output_size / p, input_size\] or None, got list"):
        col(x, weight=[[0.0] * 6] * 4)
    with pytest.raises(ValueError, match="the supplied weight must be floating point, of the layer's dtype and on its "
                                         "device .* got torch.float32 on"):
        col(x, weight=torch.randn(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="got torch.float64 on meta"):
        col(x, weight=torch.randn(4, 6, device="meta", dtype=torch.float64))
    torch.testing.assert_close(col(x, weight=col.weight.detach().clone())[0], col(x)[0], rtol=0, atol=0)
    for make in (fp.ColumnParallelLinear, fp.RowParallelLinear):
        kw = dict(config=cfg, init_method=_normal, bias=False)
        if make is fp.RowParallelLinear:
            kw.update(input_is_parallel=True, skip_bias_add=False)
        with pytest.raises(ValueError, match=f"{make.__name__}: input_size must be an int >= 0, got -6"):
            make(-6, 4, **kw)
        with pytest.raises(TypeError, match=f"{make.__name__}: output_size must be an int >= 0, got float 4.0"):
            make(6, 4.0, **kw)
    emb = fp.VocabParallelEmbedding(10, 4, init_method=_normal, config=cfg)
    for ids in (torch.tensor([[1.0, 2.0]], device=DEVICE), torch.tensor([[True]], device=DEVICE), [[1, 2]]):
        with pytest.raises(TypeError, match="VocabParallelEmbedding: input_ids must be an int64 or int32 tensor"):
            emb(ids)


# ---------------------------------------------------------------------------------------------
# The block's RNG fork under sequence parallelism; shard / unshard refusals (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def _fork_worker(rank, world_size, device, seed, hidden_dropout, attention_dropout):
    from fusedlib.models.gpt import get_gpt_layer_unfused_spec
    from fusedlib.transformer import TransformerConfig
    from fusedlib.transformer.enums import AttnBackend
    from fusedlib.transformer.transformer_block import TransformerBlock

    fp.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=True, hidden_dropout=hidden_dropout,
                            attention_dropout=attention_dropout, use_cpu_initialization=True,
                            params_dtype=torch.float64, attention_backend=AttnBackend.unfused)
    block = TransformerBlock(cfg, get_gpt_layer_unfused_spec()).train()
    tracker = fp.get_cuda_rng_tracker()
    real_fork, forks = tracker.fork, []

    def counting_fork(*a, **k):
        forks.append(1)
        return real_fork(*a, **k)

    tracker.fork = counting_fork
    x = torch.randn(2, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))  # [s/p, b, h]
    block(x, None)
    block.eval()(x, None)  # evaluation draws nothing: no fork
    return len(forks)


@pytest.mark.parametrize("hidden_dropout, attention_dropout, forks", [(0.5, 0.0, 1), (0.0, 0.0, 0)])
def test_sequence_parallel_block_forks_the_tracker_when_hidden_dropout_draws(hidden_dropout, attention_dropout,
                                                                              forks, seed):
    ranks = fp.spawn(_fork_worker, 2, seed, hidden_dropout, attention_dropout, backend="gloo")
    assert ranks == [forks, forks]


def test_shard_tensor_refuses_a_dim_not_divisible_by_world_size_times_stride():
    full = torch.arange(12.0, dtype=torch.float64).view(6, 2)  # 6 % 2 == 0 but 6 % (2·2) != 0
    with pytest.raises(ValueError, match="must be divisible by world_size·stride = 2·2"):
        shard_tensor(full, PartitionSpec(0, 2), 0, 2)
    ok = torch.arange(16.0, dtype=torch.float64).view(8, 2)
    shards = [shard_tensor(ok, PartitionSpec(0, 2), r, 2) for r in range(2)]
    assert torch.equal(unshard_tensors(shards, PartitionSpec(0, 2)), ok)


def test_shard_tensor_refuses_a_dim_equal_to_the_number_of_dims():
    with pytest.raises(ValueError, match=r"partition_dim 2 out of range for shape \[4, 2\]"):
        shard_tensor(torch.zeros(4, 2), PartitionSpec(2), 0, 2)


def test_unshard_tensors_refuses_shards_not_divisible_by_the_stride():
    shards = [torch.zeros(3, 2), torch.ones(3, 2)]
    with pytest.raises(ValueError, match=r"shard dim 0 \(3\) is not divisible by stride 2"):
        unshard_tensors(shards, PartitionSpec(0, 2))


def test_unshard_state_dict_refuses_a_replica_that_is_nan_on_one_rank_only():
    shards = [{"b": torch.tensor([1.0, 2.0])}, {"b": torch.tensor([1.0, float("nan")])}]
    with pytest.raises(ValueError, match="'b' differs between rank 0 and rank 1 .*NaN on one rank"):
        unshard_state_dict(shards, {})
    both = [{"b": torch.tensor([1.0, float("nan")])}, {"b": torch.tensor([1.0, float("nan")])}]
    assert torch.equal(unshard_state_dict(both, {})["b"].isnan(), torch.tensor([False, True]))


def test_unshard_state_dict_refuses_a_rank_with_an_extra_key():
    shards = [{"b": torch.ones(2)}, {"b": torch.ones(2), "extra": torch.zeros(1)}]
    with pytest.raises(ValueError, match=r"rank 1's keys differ from rank 0's: \['extra'\]"):
        unshard_state_dict(shards, {})


def test_shard_and_unshard_take_a_partition_dim_counted_from_the_end():
    # a layout may name the dim from the end, as torch does: PartitionSpec(-1) of a 2-D weight
    # is PartitionSpec(1), both ways; a dim beyond the tensor's from either end is refused
    full = torch.arange(24.0).reshape(4, 6)
    for stride in (1, 3):
        neg = [shard_tensor(full, PartitionSpec(-1, stride), r, 2) for r in range(2)]
        pos = [shard_tensor(full, PartitionSpec(1, stride), r, 2) for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(neg, pos))
        assert torch.equal(unshard_tensors(neg, PartitionSpec(-1, stride)), full)
    with pytest.raises(ValueError, match=r"partition_dim -3 out of range for shape \[4, 6\]"):
        shard_tensor(full, PartitionSpec(-3), 0, 2)


def test_layout_leaves_out_a_parameter_marked_not_split():
    # set_tensor_model_parallel_attributes(p, False, ...) marks a replicated parameter (Megatron
    # marks every parameter so): its partition_dim and stride do not make it split
    from fusedlib.parallel.layers import set_tensor_model_parallel_attributes

    m = torch.nn.Linear(4, 6)
    set_tensor_model_parallel_attributes(m.weight, True, 0, 1)
    set_tensor_model_parallel_attributes(m.bias, False, 0, 1)
    layout = get_tensor_parallel_layout(m)
    assert layout == {"weight": PartitionSpec(0, 1)}
    full = m.state_dict()
    shards = [shard_state_dict(full, layout, r, 2) for r in range(2)]
    assert shards[1]["bias"] is full["bias"] and shards[1]["weight"].shape == (3, 4)


# ---------------------------------------------------------------------------------------------
# Row-parallel skip_bias_add on one rank; the async-allreduce linear's refusal (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def test_one_rank_row_parallel_skip_bias_add_returns_the_bias_unadded(seed):
    # skip_bias_add=True: output is x·Wᵀ alone and the bias comes back separately (Megatron's
    # contract); float64, so the reference is exact up to the GEMM's rounding
    from conftest import DEVICE

    torch.manual_seed(seed)
    cfg = dataclasses.replace(_layer_config(1, False, DEVICE), params_dtype=torch.float64)
    layer = fp.RowParallelLinear(11, 7, config=cfg, init_method=_normal, bias=True,
                                 input_is_parallel=False, skip_bias_add=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(3, 2, 11, device=DEVICE, dtype=torch.float64)
    out, bias = layer(x)
    assert bias is layer.bias
    torch.testing.assert_close(out, x @ layer.weight.detach().T, rtol=1e-12, atol=1e-12)


def test_linear_with_async_allreduce_refuses_allreduce_dgrad_with_sequence_parallel():
    x = torch.randn(2, 3, dtype=torch.float64)
    w = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="cannot be enabled at the same time"):
        linear_with_grad_accumulation_and_async_allreduce(x, w, None, allreduce_dgrad=True, sequence_parallel=True)


# ----------------------------------------------------------------------------------- parallel_output
def _parallel_output_worker(rank, world_size, device, seed):
    from fusedlib.models.gpt import GPTModel, get_gpt_layer_unfused_spec
    from fusedlib.parallel.check_tp import SEQ, VOCAB, _inputs, tiny_gpt_config

    ids, labels, _ = _inputs(seed, device)
    out = {}
    for parallel_output in (True, False):
        torch.manual_seed(seed)  # the same weights for both
        cfg = tiny_gpt_config(world_size, torch.float64, use_cpu_initialization=device.type == "cpu")
        model = GPTModel(cfg, get_gpt_layer_unfused_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                         parallel_output=parallel_output).to(device)
        with torch.no_grad():
            out[parallel_output] = dict(
                logits=model(ids, None, None), split=model(ids, None, None, runtime_gather_output=False),
                gathered=model(ids, None, None, runtime_gather_output=True),
                losses=[model(ids, None, None, labels=labels),
                        model(ids, None, None, labels=labels, runtime_gather_output=True),
                        model(ids, None, None, labels=labels, runtime_gather_output=False)])
    return out


def test_gpt_parallel_output_splits_the_logits_but_never_the_loss(seed):
    # Megatron-core: parallel_output keeps each rank's V/p logits (False gathers them, as does
    # runtime_gather_output=True); the loss always takes the split logits, whatever either says.
    # The TP checks above gather with runtime_gather_output=True only: the default was never run
    from fusedlib.parallel.check_tp import BATCH, SEQ, VOCAB

    results = _spawn(_parallel_output_worker, 2, "gloo", seed)
    part = VOCAB // 2
    loss = results[0][True]["losses"][0]
    for rank, out in enumerate(results):
        split, full = out[True]["logits"], out[False]["logits"]
        assert split.shape == (BATCH, SEQ, part) and full.shape == (BATCH, SEQ, VOCAB)
        # the gather moves data: this rank's columns of the full logits are its split ones, exactly
        assert torch.equal(full[..., rank * part:(rank + 1) * part], split)
        assert torch.equal(out[True]["gathered"], full) and torch.equal(out[False]["split"], split)
        for parallel_output in (True, False):
            for got in out[parallel_output]["losses"]:
                assert got.shape == (BATCH, SEQ) and torch.equal(got, loss)


def _sequence_parallel_embedding_worker(rank, world_size, device, seed):
    from fusedlib.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from fusedlib.models.gpt import GPTModel, get_gpt_layer_unfused_spec
    from fusedlib.parallel.check_tp import SEQ, VOCAB, _inputs, tiny_gpt_config

    ids, _, _ = _inputs(seed, device)
    torch.manual_seed(seed)
    cfg = tiny_gpt_config(world_size, torch.float64, sequence_parallel=True,
                          use_cpu_initialization=device.type == "cpu")
    model = GPTModel(cfg, get_gpt_layer_unfused_spec(), vocab_size=VOCAB, max_sequence_length=SEQ).to(device)
    whole = LanguageModelEmbedding(cfg, VOCAB, SEQ, scatter_to_sequence_parallel=False).to(device)
    whole.load_state_dict(model.embedding.state_dict())
    with torch.no_grad():
        emb = model.embedding(input_ids=ids, position_ids=None)  # this rank's s/p tokens
        return dict(emb=emb, whole=whole(ids, None),
                    same=torch.equal(model(ids, None, None, decoder_input=emb), model(ids, None, None)))


def test_sequence_parallel_embedding_scatters_only_when_asked_and_feeds_decoder_input(seed):
    # under sequence parallelism the embedding hands each rank its s/p tokens, which GPTModel
    # takes back as decoder_input (Megatron-core's [s/p, b, h]); scatter_to_sequence_parallel=False
    # returns the whole sequence. Neither was run before (GPTModel refuses False, and no test
    # passed a decoder_input at p > 1)
    from fusedlib.parallel.check_tp import BATCH, SEQ

    results = _spawn(_sequence_parallel_embedding_worker, 2, "gloo", seed)
    part = SEQ // 2
    for rank, out in enumerate(results):
        assert out["emb"].shape == (part, BATCH, 32) and out["whole"].shape == (SEQ, BATCH, 32)
        assert torch.equal(out["whole"][rank * part:(rank + 1) * part], out["emb"])  # a split: data moved only
        assert out["same"]
    assert torch.equal(results[0]["whole"], results[1]["whole"])


# ---------------------------------------------------------------------------------------------
# A mutation pass over tensor parallelism (mappings, layers, random, finalize_model_grads): each
# test below fails on a mutation that no test caught
# ---------------------------------------------------------------------------------------------


def _contiguous_mappings_worker(rank, world_size, device, seed):
    # the mappings worker above hands in transposed (non-contiguous) tensors only: an all-reduce on
    # ``input_.contiguous()`` (the tensor itself when contiguous) went unseen
    gen = torch.Generator(device="cpu").manual_seed(seed * 31 + rank)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64).to(device)
    g = torch.randn(4, 3, generator=gen, dtype=torch.float64).to(device)
    x_before, g_before = x.clone(), g.clone()
    summed = fp.reduce_from_tensor_model_parallel_region(x)
    x_in = x.clone().requires_grad_(True)
    # a residual branch shares the gradient that copy_to's backward all-reduces
    (fp.copy_to_tensor_model_parallel_region(x_in) + x_in).backward(g)
    return dict(x=x, x_before=x_before, summed=summed, g=g, g_before=g_before, x_grad=x_in.grad)


def test_reduce_from_and_copy_to_leave_a_contiguous_input_and_gradient_unmodified(seed):
    results = _spawn(_contiguous_mappings_worker, 2, "gloo", seed)
    total_x = results[0]["x_before"] + results[1]["x_before"]
    total_g = results[0]["g_before"] + results[1]["g_before"]
    for rank, out in enumerate(results):
        assert torch.equal(out["x"], out["x_before"]), f"rank {rank}: reduce_from modified its input"
        assert torch.equal(out["g"], out["g_before"]), f"rank {rank}: copy_to's backward modified the gradient"
        torch.testing.assert_close(out["summed"], total_x, rtol=1e-15, atol=1e-15)
        # copy_to's branch: the sum over ranks; the residual branch: this rank's own gradient
        torch.testing.assert_close(out["x_grad"], total_g + out["g_before"], rtol=1e-15, atol=1e-15)


def _column_grad_reduce_worker(rank, world_size, device, seed):
    p, r = world_size, rank
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    cfg = _layer_config(p, False, device)
    one = dataclasses.replace(cfg, tensor_model_parallel_size=1)
    torch.manual_seed(seed)
    full = fp.ColumnParallelLinear(5, 6, config=one, init_method=_normal)
    w_mine = full.weight.detach()[r * 3:(r + 1) * 3]
    x, g = rand(4, 2, 5), rand(4, 2, 6)  # the same on every rank
    g_mine = g[..., r * 3:(r + 1) * 3]
    out = {}
    # disable_grad_reduce (Megatron's LoRA hook): the input gradient stays this rank's partial one
    torch.manual_seed(seed)
    layer = fp.ColumnParallelLinear(5, 6, config=cfg, init_method=_normal, disable_grad_reduce=True)
    x_in = x.clone().requires_grad_(True)
    with fp.count_collectives() as log:
        layer(x_in)[0].backward(g_mine)
    out["disable_grad_reduce"] = (x_in.grad, g_mine.matmul(w_mine), len(log))
    # create_graph=True (a double backward to come): the first-order gradients are those of a plain backward
    torch.manual_seed(seed)
    layer = fp.ColumnParallelLinear(5, 6, config=cfg, init_method=_normal)
    bias = rand(6)
    with torch.no_grad():
        layer.bias.copy_(bias[r * 3:(r + 1) * 3])
    x_in = x.clone().requires_grad_(True)
    layer(x_in)[0].backward(g_mine, create_graph=True)
    out["create_graph"] = [(layer.bias.grad.detach(), g_mine.sum(dim=(0, 1))),
                           (layer.weight.grad.detach(), g_mine.reshape(-1, 3).t() @ x.reshape(-1, 5)),
                           (x_in.grad.detach(), g.matmul(full.weight.detach()))]
    return out


def test_column_parallel_disable_grad_reduce_and_create_graph_input_and_bias_gradients(seed):
    # disable_grad_reduce was only checked to be a bool; no p > 1 column-parallel backward ran with
    # create_graph (its bias gradient is torch's sum there, not fusedlib's column-sum kernel)
    for rank, out in enumerate(_spawn(_column_grad_reduce_worker, 2, "gloo", seed)):
        got, want, n_collectives = out["disable_grad_reduce"]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: disable_grad_reduce")
        assert n_collectives == 0, f"rank {rank}: disable_grad_reduce still reduced the input gradient"
        for name, (got, want) in zip(("bias", "weight", "input"), out["create_graph"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                       msg=f"rank {rank}: {name} gradient with create_graph=True")


def _row_skip_bias_add_worker(rank, world_size, device, seed):
    p, r = world_size, rank
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    x, bias = rand(2 * p, 3, 6), rand(5)
    out = {}
    for sp in (False, True):
        cfg = _layer_config(p, sp, device)
        torch.manual_seed(seed)
        full = fp.RowParallelLinear(6, 5, config=dataclasses.replace(cfg, tensor_model_parallel_size=1,
                                                                      sequence_parallel=False),
                                    init_method=_normal, bias=True, input_is_parallel=True, skip_bias_add=False)
        torch.manual_seed(seed)
        layer = fp.RowParallelLinear(6, 5, config=cfg, init_method=_normal, bias=True, input_is_parallel=True,
                                     skip_bias_add=True)
        with torch.no_grad():
            layer.bias.copy_(bias)
        y, y_bias = layer(x[..., r * 3:(r + 1) * 3])
        want = F.linear(x, full.weight.detach())  # x·Wᵀ, the bias left to the caller
        out[sp] = (y, want[r * 2:(r + 1) * 2] if sp else want, y_bias is layer.bias)
    return out


def test_row_parallel_skip_bias_add_returns_the_bias_unadded_on_two_ranks(seed):
    # the layer test above runs RowParallelLinear at p > 1 with skip_bias_add=False only, and the
    # GPT cases have no linear biases: a bias added at p > 1 despite skip_bias_add went unseen
    for rank, out in enumerate(_spawn(_row_skip_bias_add_worker, 2, "gloo", seed)):
        for sp, (got, want, returned) in out.items():
            assert returned, f"rank {rank} sp={sp}: output_bias is not the layer's bias"
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank} sp={sp}")


@pytest.fixture
def fresh_rng_tracker():
    """The process's tracker, reset after the test (later tests' checkpoints see no tracker states)."""
    tracker = fp.get_cuda_rng_tracker()
    tracker.reset()
    yield tracker
    tracker.reset()


def test_model_parallel_cuda_manual_seed_seeds_the_default_generator(fresh_rng_tracker, seed):
    fp.model_parallel_cuda_manual_seed(seed + 1, tp_rank=0)
    got = torch.rand(4)
    torch.manual_seed(seed + 1)
    assert torch.equal(got, torch.rand(4)), "the default generator was not seeded with the seed"


def test_rng_tracker_forks_continue_their_stream_and_nest(fresh_rng_tracker, seed):
    tracker, name = fresh_rng_tracker, "model-parallel-rng"
    fp.model_parallel_cuda_manual_seed(seed, tp_rank=0)
    with tracker.fork():
        want = torch.rand(3, 4)  # three draws in one fork
    fp.model_parallel_cuda_manual_seed(seed, tp_rank=0)
    with tracker.fork():  # two forks in a row: the second continues where the first stopped
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
        with tracker.fork(get_data_parallel_rng_tracker_name()):  # a nested fork of another state
            torch.rand(4)
        third = torch.rand(4)  # ... after which the outer state continues, not restarts
    assert not torch.equal(first, second), "the second fork replayed the first one's draws"
    assert torch.equal(torch.stack([first, second, third]), want)
    assert name in tracker.get_states()


def test_checkpoint_replays_the_trackers_draws_and_leaves_the_tracker_where_it_was(fresh_rng_tracker, seed):
    # fusedlib's own modules fork outside their checkpoints (torch restores the default generator
    # for those): a function that forks inside fp.checkpoint, as Megatron-core's may, was never run
    tracker = fresh_rng_tracker

    def dropout_in_fork(x):
        with tracker.fork():
            return F.dropout(x, 0.5, training=True) * x  # the mask is saved, hence recomputed

    x = torch.randn(64, dtype=torch.float64)
    runs = []
    for checkpointed in (False, True):
        fp.model_parallel_cuda_manual_seed(seed, tp_rank=0)
        x_in = x.clone().requires_grad_(True)
        y = fp.checkpoint(dropout_in_fork, x_in) if checkpointed else dropout_in_fork(x_in)
        with tracker.fork():
            torch.rand(4)  # a later layer's draws, before the backward
        y.sum().backward()
        with tracker.fork():
            after = torch.rand(8)  # the tracker after the backward (and the recomputation)
        runs.append((y.detach(), x_in.grad, after))
    (y0, grad0, after0), (y1, grad1, after1) = runs
    assert torch.equal(y1, y0)
    assert torch.equal(grad1, grad0), "the recomputation drew another dropout mask"
    assert torch.equal(after1, after0), "the recomputation left the tracker rewound"


def test_grads_to_sum_over_tensor_parallel_ranks_finds_the_config_of_a_wrapped_module(seed):
    # a wrapper without a config of its own (torch's DistributedDataParallel) holds the model as
    # .module: its config decides (Float16Module has its own config, so no test reached this)
    cfg = fp_config(sequence_parallel=True, params_dtype=torch.float64, use_cpu_initialization=True)
    model = torch.nn.Module()
    model.config = cfg
    model.linear = fp.RowParallelLinear(4, 6, config=cfg, init_method=_normal, bias=True, input_is_parallel=True,
                                        skip_bias_add=False)
    model.norm = fp_norm(cfg)
    wrapper = torch.nn.Module()
    wrapper.module = model
    names = [name for name, _ in grads_to_sum_over_tensor_parallel_ranks(wrapper)]
    assert names == ["module.linear.bias", "module.norm.weight", "module.norm.bias"]


def _mixed_dtype_finalize_worker(rank, world_size, device, seed):
    cfg = fp_config(tensor_model_parallel_size=world_size, sequence_parallel=True, params_dtype=torch.float32,
                    use_cpu_initialization=device.type == "cpu")
    model = torch.nn.Module()
    model.config = cfg
    model.norm32 = fp_norm(cfg).to(device)
    model.norm16 = fp_norm(dataclasses.replace(cfg, params_dtype=torch.bfloat16)).to(device)
    before = {}
    for name, param in model.named_parameters():
        gen = torch.Generator(device="cpu").manual_seed(seed * 31 + rank)
        param.grad = torch.randn(param.shape, generator=gen).to(device, param.dtype)
        before[name] = param.grad.clone()
    with fp.count_collectives() as log:
        fp.finalize_model_grads(model)
    return before, {n: q.grad for n, q in model.named_parameters()}, [(c.name, c.dtype) for c in log]


def test_finalize_model_grads_sums_each_dtype_in_its_own_all_reduce(seed):
    # every model of the tests above has one parameter dtype: one bucket for float32 and bfloat16
    # gradients together (promoted to float32, one all-reduce, cast back) went unseen
    (before0, after0, log0), (before1, after1, log1) = _spawn(_mixed_dtype_finalize_worker, 2, "gloo", seed)
    assert sorted(log0) == sorted(log1) == [("all_reduce", "bfloat16"), ("all_reduce", "float32")], log0
    for name in before0:
        assert after0[name].dtype == before0[name].dtype and torch.equal(after0[name], after1[name]), name
        # two terms: the sum in the gradient's own dtype, one rounding
        assert torch.equal(after0[name], before0[name] + before1[name]), name
