"""``torchrun --nproc-per-node 2 -m fusedlib.parallel.check_tp``: a GPT on p ranks against the same GPT on one.

Every rank builds the one-rank GPT (tensor-parallel size 1) and the p-rank GPT from the same
seed, checks that the p-rank model's weights are the shards of the one-rank model's (the
layers draw the full weight and keep their shard), runs forward and backward on both for the
same tokens and the same upstream gradient, completes the p-rank gradients with
:func:`fusedlib.parallel.finalize_model_grads`, and compares the loss and this rank's gradient
shards with the one-rank model's. Rank 0 prints one line per case and ``all cases passed``;
the exit status is 0 only if every rank passed.

Cases (:data:`CASES`): the fused layer spec and the unfused one, with and without sequence
parallelism, the fused and the unfused vocab-parallel cross entropy, learned positions and RoPE,
GeLU and SwiGLU, grouped-query attention, tied embeddings, query/key norms.

    torchrun --nproc-per-node 2 -m fusedlib.parallel.check_tp            # NCCL on 2 GPUs
    torchrun --nproc-per-node 2 -m fusedlib.parallel.check_tp --dtype bfloat16
    python -m fusedlib.parallel.check_tp --tp 2                           # spawns 2 processes itself

Without ``torchrun`` it starts ``--tp`` processes with :func:`fusedlib.parallel.spawn` (NCCL if
there are that many GPUs, else gloo on CPU tensors in Triton's interpreter: slow, small sizes).

Tolerances, relative to the largest magnitude of the one-rank tensor compared: float64, 1e-9;
float32, 1e-4; bfloat16, 5e-2. The p-rank model computes the same sums in another order (each
rank's partial GEMM sums, then the all-reduce), so results differ by rounding only: in float64
~ n·eps with n <= 4·h summed terms, eps = 1.1e-16, amplified by two layers and the softmax
(< 1e-12 at the test sizes); in float32 the same with eps = 6e-8 (< 1e-5); in bfloat16 the
GEMMs round their outputs to 8 bits (eps = 3.9e-3) at every layer, a few roundings deep. Each
bound has >= 10x margin over those estimates. For gradients the scale is at least 0.1 times the
model's largest gradient entry: an entry is a sum of products of activations and upstream
gradients, and where those cancel (a key norm's bias has gradient exactly 0, the softmax being
invariant to a shift of all scores) its rounding error stays that of the terms, not of the result.

Source: the equivalence Megatron-core's tensor-parallel tests check layer by layer
(``tests/unit_tests/tensor_parallel/``), here end to end on fusedlib's GPT.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["CASES", "TOLERANCES", "tiny_gpt_config", "build_gpt", "gpt_tp_check", "compare", "close",
           "grad_scale_floor", "main"]

#: Relative tolerances per dtype (the module docstring derives them).
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}

#: Named model variants: TransformerConfig overrides, plus "spec" ("fused" or "unfused"),
#: "position" and "tied" for the GPTModel.
CASES: dict[str, dict[str, Any]] = {
    # fusedlib's kernels everywhere (norms, SwiGLU, softmax, bias-dropout-add, loss) on s/p tokens
    # (RoPE, per head, is split like the heads: the unfused cases run it under sequence parallelism)
    "fused/swiglu/learned/tied/sp/fused-ce": dict(
        spec="fused", position="learned_absolute", tied=True, sequence_parallel=True, cross_entropy_loss_fusion=True,
        gated_linear_unit=True, activation_func=F.silu),
    # plain PyTorch layers: every combination of sequence parallelism and cross entropy
    "unfused/gelu/learned/qk-norm/fused-ce": dict(
        spec="unfused", position="learned_absolute", tied=False, sequence_parallel=False,
        cross_entropy_loss_fusion=True, qk_layernorm=True),
    "unfused/gelu/learned/qk-norm/sp/unfused-ce": dict(
        spec="unfused", position="learned_absolute", tied=False, sequence_parallel=True,
        cross_entropy_loss_fusion=False, qk_layernorm=True),
    "unfused/swiglu/rope/tied/rmsnorm/sp/fused-ce": dict(
        spec="unfused", position="rope", tied=True, sequence_parallel=True, cross_entropy_loss_fusion=True,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm"),
    "unfused/swiglu/rope/rmsnorm/unfused-ce": dict(
        spec="unfused", position="rope", tied=False, sequence_parallel=False, cross_entropy_loss_fusion=False,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm"),
}

VOCAB, SEQ, BATCH = 64, 8, 2


def tiny_gpt_config(tensor_model_parallel_size: int, dtype: torch.dtype, **overrides: Any):
    """A 2-layer GPT config, h = 32, 8 query heads in 4 key/value groups, ffn 64, no dropout;
    the fused spec's switches on (bias-GeLU/SwiGLU, softmax, bias-dropout-add, RoPE kernels).

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    from ..transformer import AttnBackend, TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype is torch.bfloat16,
                tensor_model_parallel_size=tensor_model_parallel_size, attention_backend=AttnBackend.local,
                bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
                apply_rope_fusion=True)
    base.update(overrides)
    return TransformerConfig(**base)


def build_gpt(case: dict[str, Any], tensor_model_parallel_size: int, dtype: torch.dtype, seed: int, **config_kw: Any):
    """``torch.manual_seed(seed)``, then the GPTModel of ``case`` (see :data:`CASES`);
    ``config_kw`` overrides config fields.

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    from ..models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec

    kw = {k: v for k, v in case.items() if k not in ("spec", "position", "tied")}
    kw.update(config_kw)
    qk = bool(kw.get("qk_layernorm", False))
    spec = get_gpt_layer_local_spec(qk_layernorm=qk) if case["spec"] == "fused" else \
        get_gpt_layer_unfused_spec(qk_layernorm=qk)
    torch.manual_seed(seed)
    config = tiny_gpt_config(tensor_model_parallel_size, dtype, **kw)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=case["position"],
                    share_embeddings_and_output_weights=case["tied"])


def _inputs(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids and labels [b, s] and the float64 upstream gradient [b, s], the same on every rank."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, device="cpu")
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, device="cpu")
    grad = torch.rand(BATCH, SEQ, generator=gen, dtype=torch.float64, device="cpu")
    return ids.to(device), labels.to(device), grad.to(device)


def _run(model, ids, labels, grad, finalize: bool = True
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    from .clip_grads import clip_grad_norm
    from .finalize_model_grads import finalize_model_grads

    loss = model(ids, None, None, labels=labels)  # [b, s] float32 (float64 for float64 weights)
    loss.backward(grad.to(loss.dtype))
    if finalize:
        finalize_model_grads(model)
    grad_norm = clip_grad_norm(model, math.inf)  # (max_norm inf: measures, clips nothing)
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, grad_norm


def gpt_tp_check(rank: int, world_size: int, device: torch.device, case_name: str, dtype: torch.dtype, seed: int,
                 reference_on_rank0_only: bool = False, finalize: bool = True, check_logits: bool = True
                 ) -> dict[str, Any]:
    """Run one case on this rank (model parallelism initialized with p = world size).

    Returns:
        A dict, on the CPU: ``loss`` (this rank's p-rank loss [b, s]), ``grads`` (name -> this
        rank's gradient shard), ``grad_norm`` (the model's total gradient norm,
        :func:`~fusedlib.parallel.clip_grad_norm`), ``layout`` (the split entries),
        ``init_matches`` (the p-rank weights are exactly the shards of the one-rank weights),
        ``logits_ok`` (the gathered logits equal the one-rank logits, at the dtype's tolerance),
        and on rank 0 (every rank unless ``reference_on_rank0_only``) ``ref_loss``,
        ``ref_grads`` and ``ref_grad_norm`` of the one-rank model. ``finalize=False`` leaves out
        :func:`fusedlib.parallel.finalize_model_grads` on the p-rank model (to show what it
        fixes); ``check_logits=False`` skips the logits (one forward pass of each model less;
        ``logits_ok`` is then None).

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    from .checkpointing import get_tensor_parallel_layout, shard_state_dict

    from .random import model_parallel_cuda_manual_seed

    case = CASES[case_name]
    model_parallel_cuda_manual_seed(seed)
    cpu = {"use_cpu_initialization": device.type == "cpu"}  # (gloo ranks on a machine with a GPU)
    single = build_gpt(case, 1, dtype, seed, **cpu).to(device)
    model = build_gpt(case, world_size, dtype, seed, **cpu).to(device)
    layout = get_tensor_parallel_layout(model)
    full = single.state_dict()
    expected = shard_state_dict(full, layout, rank, world_size)
    got = model.state_dict()
    init_matches = set(expected) == set(got) and all(
        not isinstance(v, torch.Tensor) or torch.equal(v, got[k]) for k, v in expected.items())

    ids, labels, grad = _inputs(seed, device)
    out: dict[str, Any] = {"layout": dict(layout), "init_matches": init_matches}
    loss, grads, grad_norm = _run(model, ids, labels, grad, finalize)
    out["loss"], out["grads"], out["grad_norm"] = loss.cpu(), {k: v.cpu() for k, v in grads.items()}, grad_norm.cpu()
    if check_logits:
        with torch.no_grad():
            logits = model(ids, None, None, runtime_gather_output=True)  # [b, s, V], gathered from the ranks
    out["logits_ok"] = None
    if rank == 0 or not reference_on_rank0_only:
        ref_loss, ref_grads, ref_norm = _run(single, ids, labels, grad)
        out["ref_loss"], out["ref_grads"] = ref_loss.cpu(), {k: v.cpu() for k, v in ref_grads.items()}
        out["ref_grad_norm"] = ref_norm.cpu()
        if check_logits:
            with torch.no_grad():
                ref_logits = single(ids, None, None)
            out["logits_ok"] = close(logits, ref_logits, dtype)
    return out


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, floor: float = 0.0) -> bool:
    """|actual - expected| <= tol · max(max|expected|, floor) everywhere (tol: :data:`TOLERANCES`).

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    scale = max(expected.double().abs().max().item() if expected.numel() else 0.0, floor, 1e-300)
    return bool(((actual.double() - expected.double()).abs() <= TOLERANCES[dtype] * scale).all())


def grad_scale_floor(ref_grads: dict[str, torch.Tensor]) -> float:
    """0.1 · the largest gradient entry of the model: the floor of each gradient's scale in the
    comparisons (see the module docstring).

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    return 0.1 * max(g.double().abs().max().item() for g in ref_grads.values() if g.numel())


def compare(result: dict[str, Any], rank: int, world_size: int, dtype: torch.dtype) -> list[str]:
    """What differs between one rank's result of :func:`gpt_tp_check` and its own one-rank
    reference (this rank's shards of the reference gradients): a list of messages, empty if none.

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    from .checkpointing import shard_tensor

    bad = []
    if not result["init_matches"]:
        bad.append("the p-rank weights are not the shards of the one-rank weights")
    if result["logits_ok"] is False:
        bad.append("logits differ")
    if not close(result["loss"], result["ref_loss"], dtype):
        bad.append("loss differs")
    if not close(result["grad_norm"], result["ref_grad_norm"], dtype):
        bad.append("gradient norm differs")
    floor = grad_scale_floor(result["ref_grads"])
    for name, ref in result["ref_grads"].items():
        spec = result["layout"].get(name)
        ref = shard_tensor(ref, spec, rank, world_size, name) if spec is not None else ref
        if not close(result["grads"][name], ref, dtype, floor):
            bad.append(f"grad of {name} differs")
    return bad


def _worker(rank: int, world_size: int, device: torch.device, cases: list[str], dtype: torch.dtype,
            seed: int) -> list[tuple[str, list[str]]]:
    return [(name, compare(gpt_tp_check(rank, world_size, device, name, dtype, seed), rank, world_size, dtype))
            for name in cases]


def main(argv: Optional[list[str]] = None) -> int:
    """Command line: see the module docstring. Returns the exit status.

    Source: fusedlib's own check (see the module docstring); Megatron-core has no counterpart.
    """
    import torch.distributed as dist

    from . import parallel_state

    parser = argparse.ArgumentParser(prog="python -m fusedlib.parallel.check_tp", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="processes to spawn without torchrun (default 2)")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="run only these (repeatable)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cases = args.case or list(CASES)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        parallel_state.initialize_model_parallel(int(os.environ["WORLD_SIZE"]))
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        results = _worker(rank, world, device, cases, dtype, args.seed)
        ok = torch.tensor([all(not bad for _, bad in results)], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        per_rank = [results] if rank == 0 else []
        passed = bool(ok.item())
        backend = dist.get_backend()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    else:
        per_rank = parallel_state.spawn(_worker, args.tp, cases, dtype, args.seed)
        rank, world, backend = 0, args.tp, "spawned"
        passed = all(not bad for results in per_rank for _, bad in results)
    if rank == 0:
        for name, bad in per_rank[0]:
            print(f"tp={world} {args.dtype} {name}: {'ok' if not bad else '; '.join(bad)}")
        print(f"{'all cases passed' if passed else 'FAILED'} (tp={world}, {backend}, {args.dtype})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
