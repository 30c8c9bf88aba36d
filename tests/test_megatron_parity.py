"""fusedlib's GPT block and model against megatron-core's, built from their local layer specs.

Both are built with the same configuration; megatron-core's weights are loaded into fusedlib's
model with ``load_state_dict(strict=True)``: fusedlib uses megatron-core's parameter names
(``layers.0.self_attention.linear_qkv.weight``, ``...linear_qkv._extra_state``, ...), so the
mapping is the identity and the load fails on any missing or extra key. Then both run forward
and backward on the same inputs, and each is compared with the float64 model of
``transformer_reference`` with the bounds of ``test_transformer`` (megatron-core playing the role
of the unfused block), and megatron-core's against fusedlib's unfused block directly.

megatron-core's side runs with its fusions off: its fused softmax needs a CUDA extension the wheel
does not ship, and its other fusions are ``torch.compile``d PyTorch (the same formulas). GeLU
cases give megatron-core the tanh GeLU, which fusedlib's fused bias-GeLU computes (megatron-core's
fused bias-GeLU does too; ``F.gelu`` is the erf form).

megatron-core's layers need CUDA (parameters, RNG tracker and scratch buffers on the GPU) and
torch.distributed: a one-rank NCCL group and its ``parallel_state`` with tensor-parallel size 1 are
set up by the module fixture. Its wheel is built for Python 3.12 (the GPU machine's). Where either
is missing the tests skip, saying why.
"""
from __future__ import annotations

import dataclasses
import functools
import socket

import pytest
import torch
import torch.nn.functional as F

import transformer_reference as R
from fusedlib.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from fusedlib.transformer import AttnBackend, TransformerConfig
from fusedlib.transformer.transformer_block import TransformerBlock

from conftest import DEVICE, megatron_why_not  # noqa: I001
from test_transformer import (  # noqa: I001
    B, FFN, H, NG, NP, S, TENSOR_RATIO, U, UNFUSED_IN_U, assert_as_accurate, nrmse, tensor_errors,
)


_REASON = megatron_why_not()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

V = 37  # the sizes of test_transformer, whose error bounds were measured for them


@pytest.fixture(scope="module")
def megatron():
    """torch.distributed with one rank, megatron-core's parallel state (TP = PP = 1) and its RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        created = True
    # an xdist worker may come back to this module after other modules' tests: start from a
    # clean megatron state whatever the last visit left (megatron asserts its groups are unset)
    parallel_state.destroy_model_parallel()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)  # (whatever tracker an earlier test made)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


CASES = {
    "fp32-swiglu": dict(dtype=torch.float32, act="swiglu"),
    "bf16-swiglu-qknorm": dict(dtype=torch.bfloat16, act="swiglu", qk_layernorm=True),
    "fp32-gelu": dict(dtype=torch.float32, act="gelu"),
    "bf16-rmsnorm-gqa-swiglu": dict(dtype=torch.bfloat16, act="swiglu", normalization="RMSNorm"),
}


def _configs(case):
    c = dict(CASES[case])
    dtype, act = c.pop("dtype"), c.pop("act")
    glu = act == "swiglu"
    common = dict(num_layers=2, hidden_size=H, num_attention_heads=NP, num_query_groups=NG, ffn_hidden_size=FFN,
                  hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=glu, params_dtype=dtype,
                  bf16=dtype is torch.bfloat16, normalization=c.get("normalization", "LayerNorm"),
                  qk_layernorm=c.get("qk_layernorm", False))
    tanh_gelu = functools.partial(F.gelu, approximate="tanh")
    fused = TransformerConfig(**common, activation_func=F.silu if glu else F.gelu, bias_activation_fusion=True,
                              masked_softmax_fusion=True, bias_dropout_fusion=True,
                              attention_backend=AttnBackend.local)
    plain = TransformerConfig(**common, activation_func=F.silu if glu else tanh_gelu)
    return dtype, fused, plain, dict(common, activation_func=F.silu if glu else tanh_gelu)


def _megatron_block(kw):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as mcore_spec
    from megatron.core.transformer.transformer_block import TransformerBlock as MBlock
    from megatron.core.transformer.transformer_config import TransformerConfig as MConfig

    cfg = MConfig(**kw)
    spec = mcore_spec(qk_layernorm=kw["qk_layernorm"], normalization=kw["normalization"])
    # (torch's norms, built on the CPU by megatron-core's WrappedTorchNorm where Apex is absent: move them)
    return cfg, MBlock(cfg, spec).to(device=DEVICE, dtype=kw["params_dtype"])


def _randomize(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, device=p.device, dtype=torch.float32)
            p.copy_(1 + 0.2 * r if name.endswith("layernorm.weight") else 0.3 * r)


def _run(block, x, g):
    xi = x.detach().clone().requires_grad_(True)
    y = block(xi, None)
    y.backward(g)
    return {"y": y, "dx": xi.grad, **{n: p.grad for n, p in block.named_parameters()}}


@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_megatron_core(megatron, case):
    dtype, fused_cfg, plain_cfg, mkw = _configs(case)
    m_cfg, m_block = _megatron_block(mkw)
    _randomize(m_block)
    state = m_block.state_dict()
    fused = TransformerBlock(fused_cfg, get_gpt_layer_local_spec(qk_layernorm=fused_cfg.qk_layernorm))
    plain = TransformerBlock(plain_cfg, get_gpt_layer_unfused_spec(qk_layernorm=fused_cfg.qk_layernorm))
    fused.load_state_dict(state, strict=True)  # Megatron-core's names: the identity mapping
    plain.load_state_dict(state, strict=True)
    assert set(fused.state_dict()) == set(state)

    x = torch.randn(S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
    g = torch.randn(S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
    sd = {k: v.detach().double().requires_grad_(True) for k, v in state.items() if isinstance(v, torch.Tensor)}
    x64 = x.double().requires_grad_(True)
    y64 = R.block(x64, sd, plain_cfg)
    y64.backward(g.double())
    refs = {"y": y64.detach(), "dx": x64.grad, **{n: sd[n].grad for n in sd}}

    out = {"megatron": _run(m_block, x, g), "fused": _run(fused, x, g), "plain": _run(plain, x, g)}
    errors = {k: tensor_errors(o, refs, dtype) for k, o in out.items()}
    # megatron-core's block is the formula the reference writes down (layout, GQA, masks, norms): its
    # error is within UNFUSED_IN_U·u, and fusedlib's fused and unfused blocks are as accurate as it
    agg = assert_as_accurate(errors, "megatron", dtype)
    print(f"\n{case}: normalized RMS error vs float64, aggregate over output and gradients: "
          + ", ".join(f"{k} {v / U[dtype]:.1f}u" for k, v in agg.items()))
    if dtype is torch.float32:  # the same PyTorch ops in the same order: nearly the same bits
        diff = max((out["plain"][t].double() - out["megatron"][t].double()).abs().max().item() for t in refs)
        print(f"{case}: max |fusedlib unfused - megatron-core| over output and gradients: {diff:.3g}")


def test_gpt_model_matches_megatron_core(megatron):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as mcore_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MGPT
    from megatron.core.transformer.transformer_config import TransformerConfig as MConfig

    dtype, fused_cfg, _, mkw = _configs("fp32-swiglu")
    m_model = MGPT(MConfig(**mkw), mcore_spec(), vocab_size=V, max_sequence_length=S).to(DEVICE)
    _randomize(m_model)
    state = m_model.state_dict()
    cfg = dataclasses.replace(fused_cfg, cross_entropy_loss_fusion=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S)
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, V, (B, S), device=DEVICE)
    labels = torch.randint(0, V, (B, S), device=DEVICE)
    positions = torch.arange(S, device=DEVICE).unsqueeze(0).expand(B, S)
    sd = {k: v.detach().double() for k, v in state.items() if isinstance(v, torch.Tensor)}
    ref = R.gpt_loss(ids, labels, sd, cfg)
    losses = {"megatron": m_model(ids, positions, None, labels=labels),
              "fused": model(ids, positions, None, labels=labels)}
    err = {k: nrmse(v, ref) for k, v in losses.items()}
    assert losses["fused"].shape == losses["megatron"].shape == (B, S)
    assert err["megatron"] <= UNFUSED_IN_U * U[dtype], err
    assert err["fused"] <= TENSOR_RATIO * max(err["megatron"], U[dtype]), err
