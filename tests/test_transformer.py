"""The spec-driven transformer package: specs, config, the block fused and unfused, dispatch,
causality, grouped-query attention, recomputation, the SDPA backend, Float16Module, checkpoints.

The oracle is ``transformer_reference``: a float64 block written from the formulas, which reads
only the state dict. Sizes are small and odd (s = 7, h = 24, 4 query heads in 2 groups of
hn = 6, ffn = 20): on a CPU every fused kernel runs in Triton's interpreter.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune

import transformer_reference as R
from fusedlib import unfused
from fusedlib.fusions import fused_attention, fused_bias_dropout, fused_dense, fused_layer_norm, fused_softmax
from fusedlib.fusions.fused_bias_dropout import get_bias_dropout_add
from fusedlib.fusions.fused_layer_norm import FusedLayerNorm, FusedRMSNorm
from fusedlib.models.gpt import get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from fusedlib.parallel.layers import ColumnParallelLinear, RowParallelLinear
from fusedlib.transformer import (
    AttnBackend,
    AttnMaskType,
    Float16Module,
    IdentityFuncOp,
    IdentityOp,
    ModuleSpec,
    TransformerConfig,
    build_module,
)
from fusedlib.transformer import mlp as mlp_module
from fusedlib.transformer import transformer_block as block_module
from fusedlib.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from fusedlib.transformer.dot_product_attention import DotProductAttention
from fusedlib.transformer.mlp import MLP, MLPSubmodules
from fusedlib.transformer.torch_norm import WrappedTorchNorm
from fusedlib.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from fusedlib.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from conftest import DEVICE, assert_close  # noqa: I001

S, B, H, NP, NG, FFN = 7, 2, 24, 4, 2, 20  # odd sizes; hn = H / NP = 6
#: unit roundoff per dtype: one rounding to it is within u relative
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float64: 2.0 ** -53}
FUSIONS_ON = dict(bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
                  apply_rope_fusion=True, attention_backend=AttnBackend.local)


def make_config(dtype=torch.float32, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=NP, num_query_groups=NG, ffn_hidden_size=FFN,
                hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True, activation_func=F.silu,
                params_dtype=dtype, bf16=dtype is torch.bfloat16, attention_backend=AttnBackend.local)
    base.update(kw)
    return TransformerConfig(**base)


def randomize(module: torch.nn.Module) -> torch.nn.Module:
    """Random parameters, biases and norm weights included (the inits leave biases at 0, gamma at 1),
    drawn in float32 and rounded once to the parameters' dtype."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, device=p.device, dtype=torch.float32)
            p.copy_(1 + 0.2 * r if name.endswith("layernorm.weight") else 0.3 * r)
    return module


def hidden(dtype=torch.float32, s=S, requires_grad=True) -> torch.Tensor:
    """[s, b, h], non-contiguous (a transposed [b, s, h])."""
    x = torch.randn(B, s, H, device=DEVICE, dtype=torch.float32).to(dtype).transpose(0, 1)
    return x.requires_grad_(requires_grad)


def reference_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors in float64, as leaves that collect the reference's gradients."""
    return {k: v.detach().double().requires_grad_(True) for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor)}


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def nrmse(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS error normalized by the reference's RMS."""
    return rms(actual.double() - ref) / max(rms(ref), 1e-300)


def tensor_errors(outs: dict[str, torch.Tensor], refs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    """e_t = nrmse(out_t, ref_t) for each tensor.

    A tensor whose reference is 0 in exact arithmetic (its RMS below 1e-12 of the largest one's:
    float64 rounding) holds only rounding noise, so a relative error means nothing: it is checked
    against the largest reference's RMS instead (<= UNFUSED_IN_U·u of it) and left out of e. (The
    gradient of the key norm's bias is one: adding b to every key adds q·b to a whole score row,
    which the softmax ignores.)
    """
    scale = max(rms(r) for r in refs.values())
    errors = {}
    for name, out in outs.items():
        if rms(refs[name]) <= 1e-12 * scale:
            assert rms(out) <= UNFUSED_IN_U * U[dtype] * scale, (name, rms(out), scale)
        else:
            errors[name] = nrmse(out, refs[name])
    return errors


def assert_as_accurate(errors: dict[str, dict[str, float]], baseline: str, dtype: torch.dtype) -> dict[str, float]:
    """Every path's errors (tensor_errors) within the bounds above of the baseline path's.

    Returns the aggregates sqrt(mean_t e_t²) per path."""
    agg = {k: math.sqrt(sum(v * v for v in e.values()) / len(e)) for k, e in errors.items()}
    assert agg[baseline] <= UNFUSED_IN_U * U[dtype], agg
    for path, e in errors.items():
        assert agg[path] <= AGGREGATE_RATIO * agg[baseline], (path, agg)
        worst = max(e, key=e.get)
        assert e[worst] <= TENSOR_RATIO * agg[baseline], (path, worst, e[worst], agg)
    return agg


class Spy:
    """Replace ``owner.name`` with a wrapper that records each call, then calls the original."""

    def __init__(self, monkeypatch, owner, name):
        self.calls: list[tuple[tuple, dict]] = []
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.calls.append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    def __bool__(self) -> bool:
        return bool(self.calls)


# ---------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------


class _Probe(torch.nn.Module):
    def __init__(self, a, b=0, *, config=None, submodules=None, extra=None):
        super().__init__()
        self.args = (a, b, config, submodules, extra)


def test_build_module_builds_classes_and_returns_functions_uncalled():
    assert build_module(get_bias_dropout_add) is get_bias_dropout_add
    assert build_module(ModuleSpec(module=get_bias_dropout_add)) is get_bias_dropout_add
    cfg = object()
    m = build_module(ModuleSpec(_Probe, params={"b": 2}, submodules="subs"), 1, config=cfg, extra=3)
    assert m.args == (1, 2, cfg, "subs", 3)
    assert build_module(_Probe, 5).args == (5, 0, None, None, None)  # a bare class: no submodules argument
    m = ModuleSpec(("torch.nn", "Identity"))()  # an import path; calling a spec builds it
    assert isinstance(m, torch.nn.Identity)
    assert isinstance(build_module(IdentityOp, 1, config=cfg, anything=2), IdentityOp)
    f = IdentityFuncOp()(True, False)
    x = torch.zeros(1)
    assert f(x, "residual", 0.5) is x and IdentityOp()(x, 1, k=2) is x


def test_bad_specs_raise_naming_the_module():
    with pytest.raises(TypeError, match="must name a class, a function or an import path"):
        build_module(ModuleSpec(module=42))
    with pytest.raises(ModuleNotFoundError):
        build_module(ModuleSpec(("fusedlib.no_such_module", "X")))
    with pytest.raises(ImportError, match="has no 'NoSuchNorm'"):
        build_module(ModuleSpec(("fusedlib.fusions.fused_layer_norm", "NoSuchNorm")))
    with pytest.raises(TypeError, match="sets \\['config'\\] in params"):
        build_module(ModuleSpec(_Probe, params={"config": 1}), 0, config=2)
    with pytest.raises(TypeError, match="the spec of _Probe must have params as a dict of keyword arguments, got "
                                        "NoneType"):
        build_module(ModuleSpec(_Probe, params=None), 0)
    cfg = make_config(num_layers=1)
    # a wrong class deep in the tree: the error keeps its type and names the path down to it
    spec = get_gpt_layer_local_spec()
    spec.submodules.mlp = ModuleSpec(MLP, submodules=MLPSubmodules(linear_fc1=torch.nn.Linear,
                                                                   linear_fc2=RowParallelLinear))
    with pytest.raises(TypeError, match=r"\[while building Linear\] \[while building MLP\] "
                                        r"\[while building TransformerLayer\]"):
        TransformerBlock(cfg, spec)
    spec.submodules.mlp = ModuleSpec(MLP, submodules=MLPSubmodules())
    with pytest.raises(ValueError, match=r"MLPSubmodules.linear_fc1 is None.*\[while building MLP\]"):
        TransformerBlock(cfg, spec)
    with pytest.raises(TypeError, match="missing .* required positional argument"):
        SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear)  # the required slots have no default
    # an import path to a constant failed while formatting its own error (AttributeError: __name__)
    with pytest.raises(TypeError, match=r"import path must name a class or a function, got \('math', 'pi'\)"):
        build_module(ModuleSpec(("math", "pi")))
    with pytest.raises(TypeError, match="spec must be a TransformerBlockSubmodules or a ModuleSpec"):
        TransformerBlock(cfg, get_gpt_layer_local_spec().submodules)
    with pytest.raises(TypeError, match="neither a TransformerBlock nor a transformer layer"):
        TransformerBlock(cfg, ModuleSpec(MLP))
    with pytest.raises(NotImplementedError, match="num_experts=4"):
        get_gpt_layer_local_spec(num_experts=4)
    # submodules or a config of the wrong kind failed with a bare AttributeError on the first field read
    with pytest.raises(TypeError, match=r"TransformerBlock: submodules must be TransformerBlockSubmodules \(or have "
                                        r"its fields\), got NoneType without layer_specs, layer_norm"):
        TransformerBlock(cfg, ModuleSpec(module=TransformerBlock))
    with pytest.raises(TypeError, match="TransformerBlock: submodules must be TransformerBlockSubmodules .*got dict"):
        TransformerBlock(cfg, ModuleSpec(module=TransformerBlock, submodules={"layer_specs": []}))
    with pytest.raises(TypeError, match="TransformerBlock: layer_specs must be a list of layer specs .*got ModuleSpec"):
        TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=get_gpt_layer_local_spec()))
    with pytest.raises(TypeError, match=r"TransformerLayer: submodules must be TransformerLayerSubmodules .*got dict "
                                        r"without input_layernorm, .*\[while building TransformerLayer\]"):
        build_module(ModuleSpec(module=TransformerLayer, submodules={"mlp": MLP}), config=cfg)
    with pytest.raises(TypeError, match=r"TransformerLayer: config must be a TransformerConfig, got dict \(an object "
                                        r"with its fields serves too\)"):
        build_module(get_gpt_layer_local_spec(), config={"hidden_size": H})
    # an object with the config's fields serves (Megatron-core's own config among them), as do
    # submodules without the fields the layer never reads
    duck_cfg = types.SimpleNamespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    layer_subs = get_gpt_layer_local_spec().submodules
    duck_subs = types.SimpleNamespace(**{f.name: getattr(layer_subs, f.name) for f in dataclasses.fields(layer_subs)
                                         if f.name != "sharded_state_dict_keys_map"})
    assert TransformerLayer(duck_cfg, duck_subs)(hidden(torch.float32), None)[0].shape == (S, B, H)
    attn_subs = get_gpt_layer_local_spec().submodules.self_attention.submodules
    mlp_subs = get_gpt_layer_local_spec().submodules.mlp.submodules
    with pytest.raises(TypeError, match=r"MLP: submodules must be MLPSubmodules .*got SelfAttentionSubmodules "
                                        r"without linear_fc1, activation_func, linear_fc2"):
        MLP(cfg, attn_subs)
    with pytest.raises(TypeError, match=r"SelfAttention: submodules must be SelfAttentionSubmodules .*got "
                                        r"MLPSubmodules without linear_qkv"):
        SelfAttention(cfg, mlp_subs, 1)
    with pytest.raises(TypeError, match=r"CrossAttention: submodules must be CrossAttentionSubmodules .*got "
                                        r"SelfAttentionSubmodules without linear_q, linear_kv"):
        CrossAttention(make_config(num_query_groups=NP), attn_subs, 1)
    # any object with the fields serves, as Megatron-core reads them by name
    duck = types.SimpleNamespace(**{f.name: getattr(mlp_subs, f.name) for f in dataclasses.fields(MLPSubmodules)})
    assert isinstance(MLP(cfg, duck).linear_fc2, RowParallelLinear)
    # tensor parallelism needs its process groups first (tests/test_tensor_parallel.py runs it)
    with pytest.raises(RuntimeError, match="tensor_model_parallel_size=2, but model parallelism is not initialized"
                                           ".*while building RowParallelLinear"):
        TransformerBlock(make_config(num_layers=1, tensor_model_parallel_size=2), get_gpt_layer_local_spec())


class _Undecodable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        b"\xff".decode()  # UnicodeDecodeError: its constructor takes five arguments


class _Unopenable(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        open(path)


def test_build_module_keeps_the_errors_fields(tmp_path):
    # a type that cannot be made from a message became a RuntimeError; an OSError lost errno and filename
    with pytest.raises(UnicodeDecodeError) as info:
        build_module(ModuleSpec(_Undecodable))
    assert info.value.__notes__ == ["[while building _Undecodable]"]
    missing = str(tmp_path / "no_such_file")
    with pytest.raises(FileNotFoundError, match=r"\[while building _Unopenable\]") as info:
        build_module(ModuleSpec(_Unopenable), missing)
    assert (info.value.errno, info.value.filename) == (2, missing)


def test_calling_a_spec_builds_it_with_its_params_and_submodules():
    cfg = object()
    spec = ModuleSpec(_Probe, params={"b": 2}, submodules="subs")
    assert spec(1, config=cfg).args == (1, 2, cfg, "subs", None)
    assert ModuleSpec(_Probe)(1).args == (1, 0, None, None, None)  # no submodules: none passed


def test_build_module_returns_builtin_functions_uncalled():
    # torch.relu is a builtin_function_or_method, not a types.FunctionType: returned as it is too,
    # given directly, in a spec or as an import path
    assert build_module(torch.relu) is torch.relu
    assert build_module(ModuleSpec(torch.relu)) is torch.relu
    assert build_module(ModuleSpec(("torch", "relu")), "ignored", config=None) is torch.relu


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan"), "0.1", True])
def test_layer_checks_its_hidden_dropout_when_built(value):
    # an override of 1.5 or "0.1" was accepted and failed at the first forward, naming "prob"
    with pytest.raises(ValueError, match=r"TransformerLayer: hidden_dropout must be None \(config.hidden_dropout\) "
                                         r"or a probability in \[0, 1\]"):
        TransformerLayer(make_config(num_layers=1), get_gpt_layer_local_spec().submodules, hidden_dropout=value)
    assert TransformerLayer(make_config(num_layers=1), get_gpt_layer_local_spec().submodules,
                            hidden_dropout=0).hidden_dropout == 0.0


@pytest.mark.parametrize("value, error", [(1.0, ValueError), (1.5, ValueError), (-0.1, ValueError),
                                          (float("nan"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_core_attention_checks_its_attention_dropout_when_built(value, error):
    # 1.0 gave an all-zero context in training on three backends (flash refused it at the forward);
    # "0.1" and NaN failed at the first forward with messages naming no argument; True was p = True
    with pytest.raises(error, match=r"DotProductAttention: attention_dropout must be None \(config.attention_dropout\) "
                                    r"or a probability in \[0, 1\)"):
        DotProductAttention(make_config(), 1, AttnMaskType.causal, "self", attention_dropout=value)
    with pytest.raises(error, match=r"attention_dropout must be .*\[while building DotProductAttention\]"):
        build_module(ModuleSpec(DotProductAttention, params={"attention_dropout": value}), config=make_config(),
                     layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    made = DotProductAttention(make_config(), 1, AttnMaskType.causal, "self", attention_dropout=np.float32(0.25))
    assert type(made.attention_dropout.p) is float and made.attention_dropout.p == 0.25


@pytest.mark.parametrize("name", ["input_size", "ffn_hidden_size"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (-4, ValueError), (8.0, TypeError), (True, TypeError)])
def test_mlp_checks_its_sizes(name, value, error):
    # a zero size built an MLP that returned zeros (the config refuses a zero ffn_hidden_size)
    subs = get_gpt_layer_local_spec().submodules.mlp.submodules
    with pytest.raises(error, match=f"MLP: {name} must be None \\(the config's\\) or an int >= 1"):
        MLP(make_config(), subs, **{name: value})
    mlp = MLP(make_config(), subs, **{name: np.int64(8)})
    assert (mlp.input_size if name == "input_size" else mlp.linear_fc2.weight.shape[1]) == 8


def test_wrapped_torch_norm_checks_what_it_builds_from():
    # an unknown normalization built a LayerNorm, a negative eps a norm whose forward gave NaN,
    # a str "False" sequence_parallel marked the parameters True; None as config, a float size
    # failed inside with errors naming neither
    cfg = make_config()
    wrong = make_config()
    wrong.normalization = "rmsnorm"
    with pytest.raises(ValueError, match="WrappedTorchNorm: config.normalization must be 'LayerNorm' or 'RMSNorm', "
                                         "got 'rmsnorm'"):
        WrappedTorchNorm(wrong, H)
    for eps, error in ((-1.0, ValueError), (float("nan"), ValueError), ("1e-5", TypeError), (None, TypeError)):
        with pytest.raises(error, match="eps must be a finite number >= 0"):
            WrappedTorchNorm(cfg, H, eps=eps)
    for size, error in ((0, ValueError), (8.0, TypeError), (True, TypeError), ([4, 0], ValueError),
                        ((4, 8.0), TypeError)):
        with pytest.raises(error, match="hidden_size must be"):
            WrappedTorchNorm(cfg, size)
    assert WrappedTorchNorm(cfg, [4, 8]).normalized_shape == (4, 8)  # torch's shape of several dims, as before
    with pytest.raises(TypeError, match="WrappedTorchNorm: config must be a TransformerConfig .* got NoneType"):
        WrappedTorchNorm(None, H)
    duck = types.SimpleNamespace(normalization="LayerNorm", layernorm_zero_centered_gamma=False,
                                 persist_layer_norm=False, memory_efficient_layer_norm=False, sequence_parallel="False")
    with pytest.raises(TypeError, match="config.sequence_parallel must be a bool"):
        WrappedTorchNorm(duck, H)
    norm = WrappedTorchNorm(cfg, np.int64(H), eps=np.float32(1e-5))
    assert isinstance(norm, torch.nn.LayerNorm) and norm.normalized_shape == (H,) and type(norm.eps) is float
    assert all(p.sequence_parallel is False for p in norm.parameters())


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_wrapped_torch_norm_takes_its_eps_and_marks_sequence_parallel(normalization):
    for sp in (False, True):
        norm = WrappedTorchNorm(make_config(normalization=normalization, sequence_parallel=sp), H, eps=1e-3)
        assert norm.eps == 1e-3
        assert [p.sequence_parallel for p in norm.parameters()] == [sp] * (2 if normalization == "LayerNorm" else 1)
    # the eps reaches the forward: rows of variance ~1e-3, against torch's functional norm
    x = 0.03 * torch.randn(3, H, device=DEVICE)
    norm = WrappedTorchNorm(make_config(normalization=normalization), H, eps=1e-3, device=DEVICE)
    ref = F.layer_norm(x, (H,), eps=1e-3) if normalization == "LayerNorm" else F.rms_norm(x, (H,), eps=1e-3)
    torch.testing.assert_close(norm(x), ref, atol=0, rtol=0)


def test_modules_pickle_whole():
    # torch.save(model) failed: the linear layers' load pre-hook was a lambda
    block = randomize(TransformerBlock(make_config(), get_gpt_layer_local_spec()))
    buf = io.BytesIO()
    torch.save(block, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    x = hidden(torch.float32)
    assert torch.equal(block(x, None), again(x, None))
    # the hook still does its work: a state dict without the _extra_state keys loads strictly
    state = {k: v for k, v in block.state_dict().items() if not k.endswith("_extra_state")}
    assert len(state) < len(block.state_dict())
    assert not again.load_state_dict(state, strict=True).missing_keys


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_specs_build_the_documented_modules(normalization):
    cfg = make_config(normalization=normalization, qk_layernorm=True, **FUSIONS_ON)
    fused = TransformerBlock(cfg, get_gpt_layer_local_spec(qk_layernorm=True))
    plain = TransformerBlock(cfg, get_gpt_layer_unfused_spec(qk_layernorm=True))
    norm_cls = FusedLayerNorm if normalization == "LayerNorm" else FusedRMSNorm
    torch_cls = torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm
    layer = fused.layers[1]
    assert layer.layer_number == 2 and len(fused.layers) == 2
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm, layer.self_attention.q_layernorm,
                 fused.final_layernorm):
        assert type(norm) is norm_cls
    for norm in (plain.layers[0].input_layernorm, plain.layers[0].self_attention.k_layernorm, plain.final_layernorm):
        assert type(norm) is torch_cls
    assert isinstance(layer.self_attention.core_attention, DotProductAttention)
    assert layer.self_attention.attn_mask_type is AttnMaskType.causal
    assert isinstance(layer.cross_attention, IdentityOp) and isinstance(layer.cross_attn_bda, IdentityFuncOp)
    assert layer.self_attn_bda is get_bias_dropout_add
    hn = H // NP
    shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items() if isinstance(v, torch.Tensor)}
    assert shapes["layers.0.self_attention.linear_qkv.weight"] == ((NP + 2 * NG) * hn, H)
    assert shapes["layers.0.self_attention.linear_proj.weight"] == (H, NP * hn)
    assert shapes["layers.0.self_attention.q_layernorm.weight"] == (hn,)
    assert shapes["layers.0.mlp.linear_fc1.weight"] == (2 * FFN, H)  # both GLU halves in one GEMM
    assert shapes["layers.0.mlp.linear_fc2.weight"] == (H, FFN)
    # the unfused spec has the same parameters under the same names: one checkpoint fits both
    assert fused.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(fused.state_dict(), strict=True)
    for p in fused.parameters():
        assert p.device.type == DEVICE.type and p.dtype == torch.float32
    assert not plain.layers[0].mlp.config.bias_activation_fusion and plain.layers[0].mlp.config is not cfg


def test_module_tree_and_initialization():
    cfg = make_config(num_layers=3, init_method_std=0.05)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec())
    text = repr(block)
    for name in ("input_layernorm", "self_attention", "core_attention", "linear_qkv", "linear_proj",
                 "pre_mlp_layernorm", "linear_fc1", "linear_fc2", "final_layernorm"):
        assert name in text
    qkv = block.layers[0].self_attention.linear_qkv
    proj = block.layers[0].self_attention.linear_proj
    assert torch.all(qkv.bias == 0) and torch.all(proj.bias == 0)
    # init_method N(0, 0.05²); the output layers N(0, 0.05² / (2·num_layers)): the sample std of
    # n draws is within 5/sqrt(2n) of sigma with overwhelming probability (n = 576: 15 %)
    for w, sigma in ((qkv.weight, 0.05), (proj.weight, 0.05 / math.sqrt(2 * 3))):
        assert abs(w.float().std().item() / sigma - 1) < 5 / math.sqrt(2 * w.numel())


# ---------------------------------------------------------------------------------------------
# TransformerConfig
# ---------------------------------------------------------------------------------------------


def test_config_derives_megatrons_defaults():
    c = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8)
    assert (c.ffn_hidden_size, c.kv_channels, c.num_query_groups) == (256, 8, 8)
    assert (c.hidden_dropout, c.attention_dropout, c.layernorm_epsilon, c.init_method_std) == (0.1, 0.1, 1e-5, 0.02)
    assert c.activation_func is F.gelu and c.add_bias_linear and not c.add_qkv_bias
    assert c.attention_backend is AttnBackend.auto and c.attention_softmax_in_fp32
    assert c.init_method.keywords == {"mean": 0.0, "std": 0.02}
    assert c.output_layer_init_method.keywords["std"] == pytest.approx(0.02 / math.sqrt(2 * 4))
    assert c.embedding_init_method.keywords["std"] == 0.02 and c.embedding_init_method_std == 0.02
    assert c.recompute_modules == ["core_attn"]
    assert not any((c.bias_activation_fusion, c.masked_softmax_fusion, c.bias_dropout_fusion, c.apply_rope_fusion,
                    c.persist_layer_norm, c.memory_efficient_layer_norm, c.cross_entropy_loss_fusion))
    assert TransformerConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
                             ffn_hidden_size=100).kv_channels == 16
    assert TransformerConfig(hidden_size=60, num_attention_heads=8, kv_channels=8).kv_channels == 8  # 60 % 8 != 0: ok
    # Megatron-core: query-key layer scaling forces the fp32 softmax
    c_scaled = TransformerConfig(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert c_scaled.attention_softmax_in_fp32
    # the norms-only config of chapter 4
    c0 = TransformerConfig()
    assert c0.kv_channels is None and c0.num_query_groups is None and c0.output_layer_init_method is None
    custom = lambda w: w  # noqa: E731
    c1 = TransformerConfig(num_layers=1, init_method=custom)
    assert c1.embedding_init_method is custom
    c2 = TransformerConfig(num_layers=1, init_method=custom, embedding_init_method_std=1.0)
    assert c2.embedding_init_method.keywords["std"] == 1.0
    assert TransformerConfig(window_size=[4, 0]).window_size == (4, 0)


@pytest.mark.parametrize("groups", [None, 2])
def test_attention_of_a_norms_only_config_is_named(groups):
    # num_attention_heads = 0 (the norms-only default) reached "unsupported operand type(s) for *:
    # 'NoneType' and 'int'" in SelfAttention's projection sizes
    config = TransformerConfig(num_layers=1, hidden_size=8, num_query_groups=groups)
    for build in (lambda: TransformerBlock(config, get_gpt_layer_local_spec()),
                  lambda: DotProductAttention(config, 1, AttnMaskType.causal, "self")):
        with pytest.raises(ValueError, match=r"num_attention_heads must be >= 1 to build attention, got 0"):
            build()


class _ForeignBackend(enum.Enum):  # another library's enum with the same member names (Megatron-core's)
    local = 4


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fp16=True, bf16=True), ValueError, "Only one of fp16"),
    (dict(hidden_size=30, num_attention_heads=4), ValueError, "hidden_size \\(30\\) must be divisible"),
    (dict(hidden_size=32, num_attention_heads=6, kv_channels=8, num_query_groups=4), ValueError,
     "must be a multiple of num_query_groups"),
    (dict(hidden_size=32, num_attention_heads=4, num_query_groups=0), ValueError, "num_query_groups"),
    (dict(bias_activation_fusion=True, activation_func=F.relu), ValueError, "activation_func must be F.gelu"),
    (dict(bias_activation_fusion=True, activation_func=F.silu), ValueError, "gated_linear_unit must be True"),
    (dict(bias_activation_fusion=True, add_bias_linear=False), ValueError, "add_bias_linear must also be True"),
    (dict(gemm_gelu_fusion=True), ValueError, "gemm_gelu_fusion .* needs bias_activation_fusion=True"),
    (dict(gemm_gelu_fusion=True, bias_activation_fusion=True, gated_linear_unit=True), ValueError,
     "gemm_gelu_fusion .* gated_linear_unit=False"),
    (dict(bias_activation_fusion=True, gated_linear_unit=True, glu_linear_offset=1.0), ValueError,
     "glu_linear_offset must be 0"),
    (dict(activation_func_clamp_value=float("nan"), num_moe_experts=2, gated_linear_unit=True), ValueError,
     "finite number > 0"),
    (dict(activation_func_clamp_value=float("inf"), num_moe_experts=2, gated_linear_unit=True), ValueError,
     "finite number > 0"),
    (dict(activation_func_clamp_value=0.0, num_moe_experts=2, gated_linear_unit=True), ValueError, "finite number > 0"),
    (dict(activation_func_clamp_value=True, num_moe_experts=2, gated_linear_unit=True), ValueError, "finite number"),
    (dict(activation_func_clamp_value=7.0, gated_linear_unit=True), ValueError, "only supported with MoE"),
    (dict(activation_func_clamp_value=7.0, num_moe_experts=2), ValueError, "set gated_linear_unit=True"),
    (dict(activation_func_clamp_value=7.0, num_moe_experts=2, gated_linear_unit=True, glu_linear_offset=1.0),
     ValueError, "glu_linear_offset == 0"),
    (dict(activation_func_clamp_value=7.0, num_moe_experts=2, gated_linear_unit=True, bias_activation_fusion=True),
     ValueError, "needs SwiGLU"),
    (dict(num_moe_experts=0), ValueError, "num_moe_experts must be positive"),
    (dict(window_size=(3,)), ValueError, "window_size must be None or a pair"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be None or a pair"),
    (dict(recompute_granularity="some"), ValueError, "recompute_granularity must be"),
    (dict(num_layers=2, recompute_granularity="full", recompute_num_layers=1), ValueError,
     'recompute_method must be "block" or "uniform"'),
    (dict(num_layers=2, recompute_granularity="full", recompute_method="uniform"), ValueError,
     "recompute_num_layers must be between 1 and num_layers"),
    (dict(num_layers=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
     ValueError, "recompute_num_layers must be between 1 and num_layers"),
    (dict(num_layers=2, recompute_granularity="full", recompute_method="zigzag", recompute_num_layers=1),
     ValueError, "recompute_method must be"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), ValueError, "recompute_num_layers must be None"),
    (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), ValueError,
     "not implemented in fusedlib"),
    (dict(normalization="BatchNorm"), ValueError, "normalization must be one of"),
    (dict(layernorm_epsilon=-1.0), ValueError, "layernorm_epsilon must be a finite number > 0"),
    (dict(hidden_dropout=1.5), ValueError, "hidden_dropout must be a probability"),
    (dict(attention_dropout=-0.1), ValueError, "attention_dropout must be a probability"),
    (dict(params_dtype=torch.int32), TypeError, "params_dtype must be one of"),
    (dict(attention_backend="flash"), TypeError, "attention_backend must be an AttnBackend"),
    (dict(cross_entropy_fusion_impl="te"), ValueError, "cross_entropy_fusion_impl must be 'native'"),
])
def test_config_rejections(kwargs, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(**kwargs)


_BOOL_FIELDS = sorted(f.name for f in dataclasses.fields(TransformerConfig) if f.type in ("bool", bool))


@pytest.mark.parametrize("value", ["False", "no", "yes", 0, 1, None])
@pytest.mark.parametrize("name", _BOOL_FIELDS)
def test_config_bool_fields_refuse_non_bools(name, value):
    # each was accepted and read as its truth value ("False" as True); a TypeError, and a
    # ValueError too (the config's errors always were)
    with pytest.raises(TypeError, match=rf"^{name} must be a bool, got {type(value).__name__} ") as info:
        TransformerConfig(**{name: value})
    assert isinstance(info.value, ValueError)


def test_config_bool_fields_are_many_and_accept_numpy_bools():
    assert len(_BOOL_FIELDS) >= 20 and {"add_bias_linear", "fp16", "enable_cuda_graph"} <= set(_BOOL_FIELDS)
    c = TransformerConfig(add_bias_linear=np.bool_(False), qk_layernorm=np.bool_(True))
    assert c.add_bias_linear is False and c.qk_layernorm is True


@pytest.mark.parametrize("kwargs, error, match", [
    # sizes: ints >= 1 where set (a float, a bool or a str was accepted, or failed later unnamed)
    (dict(kv_channels=2.5), TypeError, r"kv_channels must be an int >= 1 \(None: hidden_size / num_attention_heads\), "
                                       r"got float 2.5"),
    (dict(kv_channels=True), TypeError, "kv_channels must be an int >= 1"),
    (dict(kv_channels="8"), TypeError, "kv_channels must be an int >= 1"),
    (dict(kv_channels=0, hidden_size=64, num_attention_heads=4), ValueError, "kv_channels must be an int >= 1"),
    (dict(ffn_hidden_size=0, hidden_size=64, num_attention_heads=4), ValueError, "ffn_hidden_size must be an int >= 1"),
    (dict(ffn_hidden_size=8.0), TypeError, "ffn_hidden_size must be an int >= 1"),
    (dict(hidden_size=8, num_attention_heads=2, num_query_groups=2.0), TypeError,
     "num_query_groups must be an int >= 1"),
    (dict(num_moe_experts=2.0), TypeError, r"num_moe_experts must be an int \(or None for no MoE\), got float"),
    (dict(num_moe_experts="2"), TypeError, "num_moe_experts must be an int"),
    (dict(window_attn_skip_freq=0), ValueError, "window_attn_skip_freq must be an int >= 1"),
    (dict(window_attn_skip_freq=1.5), TypeError, "window_attn_skip_freq must be None, an int >= 1"),
    (dict(window_attn_skip_freq=True), TypeError, "window_attn_skip_freq must be None, an int >= 1"),
    (dict(num_layers=2, window_attn_skip_freq=[1, 2]), ValueError,
     "window_attn_skip_freq as a list must hold one 0 or 1"),
    (dict(num_layers=2, window_attn_skip_freq=[1, 0, 1]), ValueError, "one entry per layer, num_layers = 2, got 3"),
    (dict(recompute_num_layers=0), ValueError, "recompute_num_layers must be an int >= 1"),
    (dict(num_layers=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=1.0), TypeError,
     "recompute_num_layers must be an int >= 1"),
    (dict(num_layers="2"), TypeError, "num_layers must be an int >= 0, got str"),
    # floats: finite, in range, real
    (dict(layernorm_epsilon=0.0), ValueError, "layernorm_epsilon must be a finite number > 0"),
    (dict(layernorm_epsilon=math.inf), ValueError, "layernorm_epsilon must be a finite number > 0"),
    (dict(layernorm_epsilon=math.nan), ValueError, "layernorm_epsilon must be a finite number > 0"),
    (dict(layernorm_epsilon=1e39), ValueError, "layernorm_epsilon must be a finite number > 0, at most float32's max"),
    (dict(layernorm_epsilon="1e-5"), TypeError, "layernorm_epsilon must be a finite number > 0, got str"),
    # 1e-50 is 0 in float32, where the norms add it: a constant row (padding) gave 0/0 = NaN
    (dict(layernorm_epsilon=1e-50), ValueError, "layernorm_epsilon must be a finite number > 0 that float32 holds"),
    # the flash kernels take no float64: refused at the first forward, naming the kernel's q
    (dict(attention_backend=AttnBackend.flash, params_dtype=torch.float64), ValueError,
     "attention_backend flash runs float16, bfloat16 or float32, got params_dtype float64"),
    (dict(init_method_std=-1.0), ValueError, "init_method_std must be a finite number >= 0"),
    (dict(init_method_std=math.nan), ValueError, "init_method_std must be a finite number >= 0"),
    (dict(init_method_std=math.inf), ValueError, "init_method_std must be a finite number >= 0"),
    (dict(init_method_std="0.02"), TypeError, "init_method_std must be a finite number >= 0"),
    (dict(embedding_init_method_std=-1.0), ValueError, "embedding_init_method_std must be a finite number >= 0"),
    (dict(softmax_scale=math.nan), ValueError, "softmax_scale must be None or a finite number"),
    (dict(softmax_scale=-math.inf), ValueError, "softmax_scale must be None or a finite number"),
    (dict(softmax_scale=1e39), ValueError, "softmax_scale must be None or a finite number"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be None or a finite number, got str"),
    (dict(activation_func_clamp_value=1e39, num_moe_experts=2, gated_linear_unit=True), ValueError,
     r"activation_func_clamp_value must be a finite number > 0 in float32's normal range .*got 1e\+39"),
    (dict(activation_func_clamp_value=1e-46, num_moe_experts=2, gated_linear_unit=True), ValueError,
     r"activation_func_clamp_value must be a finite number > 0 in float32's normal range .*got 1e-46"),
    # attention_dropout 1 was accepted, then refused by some backends at the first forward
    (dict(attention_dropout=1.0), ValueError, r"attention_dropout must be a probability in \[0, 1\)"),
    (dict(attention_dropout="0.1"), TypeError, "attention_dropout must be a probability"),
    # recompute_method is checked without a granularity too
    (dict(recompute_method="zigzag"), ValueError, 'recompute_method must be "block" or "uniform"'),
    # recompute_modules: a bare string was iterated ("['l', 'm', 'p'] are not implemented")
    (dict(recompute_modules="mlp"), TypeError, r"recompute_modules must be a list of module names.* \(a list is "
                                               r"expected: \['mlp'\]"),
    (dict(recompute_granularity="selective", recompute_modules="mlp"), TypeError,
     "recompute_modules must be a list of module names"),
    (dict(recompute_modules=["mlp", 1]), TypeError, "recompute_modules must be a list of module names"),
    # fields that were not checked: a NaN offset gave a NaN model, the others failed at build or forward
    (dict(gated_linear_unit=True, glu_linear_offset=math.nan), ValueError, "glu_linear_offset must be a finite number"),
    (dict(glu_linear_offset=math.inf), ValueError, "glu_linear_offset must be a finite number"),
    (dict(glu_linear_offset="1"), TypeError, "glu_linear_offset must be a finite number, got str"),
    (dict(glu_linear_offset=None), TypeError, "glu_linear_offset must be a finite number, got NoneType"),
    (dict(activation_func=None), TypeError, "activation_func must be a callable"),
    (dict(activation_func="gelu"), TypeError, "activation_func must be a callable"),
    (dict(init_method=3), TypeError, "init_method must be None or a callable"),
    (dict(output_layer_init_method="x"), TypeError, "output_layer_init_method must be None or a callable"),
    (dict(embedding_init_method=3), TypeError, "embedding_init_method must be None or a callable"),
])
def test_config_rejects_bad_field_types_and_values(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        TransformerConfig(**kwargs)
    assert isinstance(info.value, ValueError)  # the config's contract: every rejection is a ValueError


def test_config_accepts_the_boundaries():
    assert TransformerConfig(layernorm_epsilon=1e-44).layernorm_epsilon == 1e-44  # a float32 subnormal: not 0
    assert TransformerConfig(hidden_dropout=1.0).hidden_dropout == 1.0  # residual dropout: [0, 1]
    assert TransformerConfig(attention_dropout=0.999).attention_dropout == 0.999
    assert TransformerConfig(init_method_std=0.0).init_method_std == 0.0  # all-zero init: torch's normal_ takes std 0
    assert TransformerConfig(softmax_scale=0).softmax_scale == 0
    assert TransformerConfig(recompute_modules=("mlp",)).recompute_modules == ("mlp",)
    assert TransformerConfig(num_layers=2, window_attn_skip_freq=[1, 0]).window_attn_skip_freq == [1, 0]
    assert TransformerConfig(kv_channels=np.int64(8), hidden_size=16, num_attention_heads=2).kv_channels == 8


def test_numpy_int_sizes_become_ints_and_build():
    # window_attn_skip_freq = np.int64(2) was accepted, then refused while building the attention
    cfg = make_config(window_size=(2, 0), window_attn_skip_freq=np.int64(2), kv_channels=np.int64(H // NP))
    assert type(cfg.window_attn_skip_freq) is int and type(cfg.kv_channels) is int
    assert make_config(window_size=(2, 0), window_attn_skip_freq=[np.int64(1), 0]).window_attn_skip_freq == [1, 0]
    TransformerBlock(cfg, get_gpt_layer_local_spec())


def test_config_with_derived_sizes_round_trips_through_replace():
    # hidden_size 0 (a config for parallel state): __post_init__ derives ffn_hidden_size and
    # kv_channels 0, and dataclasses.replace passes them back
    for base in (TransformerConfig(tensor_model_parallel_size=2),
                 TransformerConfig(hidden_size=0, num_attention_heads=4),
                 TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)):
        again = dataclasses.replace(base, tensor_model_parallel_size=1)
        assert (again.ffn_hidden_size, again.kv_channels) == (base.ffn_hidden_size, base.kv_channels)
    with pytest.raises(ValueError, match="ffn_hidden_size must be an int >= 1"):
        TransformerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=0)


def test_config_accepts_what_it_can_run():
    c = TransformerConfig(activation_func_clamp_value=7.0, num_moe_experts=2, gated_linear_unit=True,
                          activation_func=F.silu, bias_activation_fusion=True)
    assert c.activation_func_clamp_value == 7.0
    for act, glu, bias in ((F.gelu, False, True), (F.gelu, True, False), (F.silu, True, False)):
        TransformerConfig(bias_activation_fusion=True, activation_func=act, gated_linear_unit=glu, add_bias_linear=bias)
    assert TransformerConfig(attention_backend=_ForeignBackend.local).attention_backend is AttnBackend.local
    assert TransformerConfig(num_layers=3, recompute_granularity="full", recompute_method="block",
                             recompute_num_layers=3).recompute_num_layers == 3


# ---------------------------------------------------------------------------------------------
# Every fusion on equals every fusion off (dropout 0)
# ---------------------------------------------------------------------------------------------

# The fused and the unfused block compute the same function, rounding at different places. Both
# are compared with the float64 block, tensor by tensor (the output, the input's gradient and every
# parameter's gradient), by RMS error normalized by the reference's RMS (e_t), aggregated as
# sqrt(mean_t e_t²). Their errors have the same size in distribution, but the block's backward
# amplifies rounding differently from draw to draw. Measured over 80 draws of this setup (40 seeds
# x fp32/bf16): fused/unfused aggregate ratio 0.6-2.2; a single fused tensor at most 6.2x the
# unfused aggregate (24-element tensors fluctuate); the unfused aggregate at most 23u (u the
# dtype's unit roundoff). Bounds: about twice those. A wrong formula is off by O(1), and a kernel
# that stores an fp32 intermediate in bf16 by ~10^4 u in fp32: both far outside.
AGGREGATE_RATIO, TENSOR_RATIO, UNFUSED_IN_U = 4.0, 12.0, 64.0

BLOCK_CASES = {
    "fp32-swiglu-layernorm": dict(dtype=torch.float32),
    "bf16-swiglu-rmsnorm-qknorm": dict(dtype=torch.bfloat16, normalization="RMSNorm", qk_layernorm=True),
    "fp32-gelu-padding-mask": dict(dtype=torch.float32, gated_linear_unit=False, activation_func="gelu", mask=True),
    # the MLP as one op, bias-GeLU in cuBLASLt's GEMM epilogues on CUDA (ffn a multiple of 8 for them)
    "bf16-gelu-gemm-epilogue": dict(dtype=torch.bfloat16, gated_linear_unit=False, activation_func="gelu",
                                    ffn_hidden_size=32, gemm_gelu_fusion=True),
}


def _errors(block, x, g, mask, refs):
    xi = x.detach().clone().requires_grad_(True)
    y = block(xi, mask)
    y.backward(g)
    assert y.dtype == x.dtype and y.shape == x.shape and y._base is None
    outs = {"y": y, "dx": xi.grad, **{n: p.grad for n, p in block.named_parameters()}}
    return tensor_errors(outs, refs, x.dtype)


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_every_fusion_on_equals_every_fusion_off(case, monkeypatch):
    kw = dict(BLOCK_CASES[case])
    dtype, use_mask = kw.pop("dtype"), kw.pop("mask", False)
    qk = kw.pop("qk_layernorm", False)
    fused_only = {"gemm_gelu_fusion": kw.pop("gemm_gelu_fusion")} if "gemm_gelu_fusion" in kw else {}
    if fused_only:  # the epilogues at this small size too (on CUDA), not only from 2^24 elements up
        monkeypatch.setattr(fused_dense, "EPILOGUE_MIN_ELEMENTS", 1)
    act64 = None
    if kw.get("activation_func") == "gelu":
        # the fused bias-GeLU is the tanh approximation (as Megatron's): the unfused block gets the same
        kw["activation_func"] = F.gelu
        fused_cfg = make_config(dtype, qk_layernorm=qk, **kw, **FUSIONS_ON, **fused_only)
        kw["activation_func"] = functools.partial(F.gelu, approximate="tanh")
        act64 = kw["activation_func"]
    else:
        fused_cfg = make_config(dtype, qk_layernorm=qk, **kw, **FUSIONS_ON)
    unfused_cfg = make_config(dtype, qk_layernorm=qk, **kw)
    fused = randomize(TransformerBlock(fused_cfg, get_gpt_layer_local_spec(qk_layernorm=qk)))
    plain = TransformerBlock(unfused_cfg, get_gpt_layer_unfused_spec(qk_layernorm=qk))
    plain.load_state_dict(fused.state_dict())
    x = hidden(dtype)
    x_before = x.detach().clone()
    g = torch.randn(S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
    mask = None
    if use_mask:  # padding: sample 1's last two keys are masked
        mask = torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool)
        mask[1, ..., -2:] = True

    sd = reference_state(fused)
    x64 = x.detach().double().requires_grad_(True)
    y64 = R.block(x64, sd, fused_cfg, act=act64, mask=mask)
    y64.backward(g.double())
    refs = {"y": y64.detach(), "dx": x64.grad, **{n: sd[n].grad for n in sd}}

    errors = {"fused": _errors(fused, x, g, mask, refs), "plain": _errors(plain, x, g, mask, refs)}
    assert torch.equal(x.detach(), x_before)  # the input is never modified
    assert_as_accurate(errors, "plain", dtype)


# ---------------------------------------------------------------------------------------------
# Each switch changes which kernel runs
# ---------------------------------------------------------------------------------------------

def _run_one_layer(cfg, *, backward=False):
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    x = hidden(cfg.params_dtype, requires_grad=backward)
    y = block(x, None)
    if backward:
        y.sum().backward()
    return y


@pytest.mark.parametrize("switch", ["masked_softmax_fusion", "bias_dropout_fusion", "swiglu", "geglu", "gelu",
                                    "attention_backend", "attention_backend_flash", "memory_efficient_layer_norm",
                                    "gemm_gelu_fusion"])
@pytest.mark.parametrize("on", [True, False])
def test_each_switch_chooses_the_kernel(monkeypatch, switch, on):
    act = {"swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
           "geglu": dict(gated_linear_unit=True, activation_func=F.gelu),
           "gelu": dict(gated_linear_unit=False, activation_func=F.gelu)}
    kw = dict(act.get(switch, {}), num_layers=1)
    if switch == "gemm_gelu_fusion":  # the MLP as one op, or fc1, the bias-GeLU kernel and fc2
        kw.update(act["gelu"], bias_activation_fusion=True, gemm_gelu_fusion=on)
        fused, plain = Spy(monkeypatch, mlp_module, "fused_dense_gelu_dense"), Spy(monkeypatch, mlp_module,
                                                                                  "bias_gelu_impl")
        _run_one_layer(make_config(**kw))
        assert bool(fused) is on and bool(plain) is not on
        return
    if switch in act:
        kw["bias_activation_fusion"] = on
        fused = Spy(monkeypatch, mlp_module, f"bias_{switch}_impl")
        others = [Spy(monkeypatch, mlp_module, f"bias_{n}_impl") for n in act if n != switch]
        _run_one_layer(make_config(**kw))
        assert bool(fused) is on and not any(others)
        return
    if switch == "attention_backend":
        kw[switch] = AttnBackend.fused if on else AttnBackend.local
        fused, plain = (Spy(monkeypatch, torch.nn.functional, "scaled_dot_product_attention"),
                        Spy(monkeypatch, torch, "baddbmm"))
    elif switch == "attention_backend_flash":
        kw["attention_backend"] = AttnBackend.flash if on else AttnBackend.local
        fused, plain = Spy(monkeypatch, fused_attention, "flash_attention"), Spy(monkeypatch, torch, "baddbmm")
    elif switch == "masked_softmax_fusion":
        kw[switch] = on
        fused, plain = Spy(monkeypatch, fused_softmax, "softmax_fwd"), Spy(monkeypatch, unfused, "scale_mask_softmax")
    elif switch == "bias_dropout_fusion":
        kw[switch] = on
        fused, plain = (Spy(monkeypatch, fused_bias_dropout, "_bias_dropout_add_fwd_checked"),  # training
                        Spy(monkeypatch, unfused, "bias_dropout_add"))
    else:  # memory_efficient_layer_norm: the norm saves y instead of x
        kw[switch] = on
        # the Function's forward (ctx, x, weight, bias, eps, memory_efficient, ...): the fused ops call
        # Function.apply through fusions/_apply.py, not through the class attribute
        spy = Spy(monkeypatch, fused_layer_norm.FusedLayerNormAffineFunction, "forward")
        _run_one_layer(make_config(**kw), backward=True)
        assert spy.calls and all(args[5] is on for args, _ in spy.calls)
        return
    _run_one_layer(make_config(**kw))
    assert bool(fused) is on and bool(plain) is not on


@pytest.mark.parametrize("post_ln_residual", [False, True])
def test_pre_norms_take_the_residual_gradient(monkeypatch, post_ln_residual):
    # x feeds the pre-norm and the residual connection: with fusedlib's norms the norm's backward
    # kernel adds the residual's gradient (no separate add); the final norm has no residual, and
    # with apply_residual_connection_post_layernorm the residual is the norm's output instead
    spy = Spy(monkeypatch, fused_layer_norm, "norm_bwd")
    cfg = make_config(num_layers=2, apply_residual_connection_post_layernorm=post_ln_residual)
    _run_one_layer(cfg, backward=True)
    given = [kw.get("dresidual") is not None for _, kw in spy.calls]
    assert len(given) == 2 * 2 + 1  # two pre-norms per layer, then the final norm
    assert sum(given) == (0 if post_ln_residual else 4)


def _block_step(block, x, seed):
    """(output, input gradient, parameter gradients by name) of one step from ``seed``."""
    for p in block.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = block(x, None)
    y.backward(torch.ones_like(y) + y.detach())  # a gradient that is not uniform
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bias_dropout_add_runs_in_the_mlp_norm(monkeypatch, normalization, dtype, seed):
    # with bias_dropout_fusion, each layer's attention bias-dropout-add and pre-MLP norm are one op
    # (bias_dropout_add_norm): the same outputs and gradients, bit for bit, as the two fused ops
    # (the projection bias's gradient is summed in another order), dropout included
    cfg = make_config(dtype, bias_dropout_fusion=True, hidden_dropout=0.2, normalization=normalization)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec())).to(DEVICE)
    x = hidden(dtype)
    spy = Spy(monkeypatch, fused_layer_norm.BiasDropoutAddNormFunction, "forward")
    fused = _block_step(block, x, seed)
    assert len(spy.calls) == cfg.num_layers
    monkeypatch.setattr(TransformerLayer, "_bda_into_pre_mlp_norm", lambda self: False)
    apart = _block_step(block, x, seed)
    assert len(spy.calls) == cfg.num_layers
    # interpreted, the same bits (at this width the projection bias's gradient is summed by the
    # bias-dropout-add backward kernel on either path, BDA_BWD_IN_NORM); compiled, the fused
    # kernels may place an FMA differently (a float32 rounding apart, carried on by the layers
    # below): within the dtype's tolerance there, widened by sqrt(rows) for the parameter
    # gradients, which sum over the s·b rows
    if DEVICE.type == "cpu":
        torch.testing.assert_close(fused[0], apart[0], rtol=0, atol=0)
        torch.testing.assert_close(fused[1], apart[1], rtol=0, atol=0)
        for name, g in apart[2].items():
            torch.testing.assert_close(fused[2][name], g, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        return
    assert_close(fused[0], apart[0].double(), dtype)
    assert_close(fused[1], apart[1].double(), dtype)
    for name, g in apart[2].items():
        assert_close(fused[2][name], g.double(), dtype, scale=(S * B) ** 0.5)


@pytest.mark.parametrize("case", ["fusion off", "post-norm residual", "fp32 residual", "torch norm"])
def test_attention_bias_dropout_add_and_the_mlp_norm_stay_apart_otherwise(monkeypatch, case):
    kw = dict(bias_dropout_fusion=case != "fusion off")
    if case == "post-norm residual":
        kw["apply_residual_connection_post_layernorm"] = True
    if case == "fp32 residual":
        kw.update(fp32_residual_connection=True)
    cfg = make_config(torch.bfloat16 if case == "fp32 residual" else torch.float32, **kw)
    spec = get_gpt_layer_unfused_spec() if case == "torch norm" else get_gpt_layer_local_spec()
    block = randomize(TransformerBlock(cfg, spec)).to(DEVICE)
    spy = Spy(monkeypatch, fused_layer_norm.BiasDropoutAddNormFunction, "forward")
    x = hidden(torch.float32 if case == "fp32 residual" else cfg.params_dtype)
    block(x, None).float().sum().backward()
    assert not spy.calls


def _attention_inputs(dtype=torch.float32, sq=S, sk=S, ng=NG, requires_grad=False):
    hn = H // NP
    mk = lambda s, n: torch.randn(s, B, n, hn, device=DEVICE, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v = mk(sq, NP), mk(sk, ng), mk(sk, ng)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_fused_softmax_dropout_runs_when_its_switches_say(monkeypatch):
    calls = []

    def fake(input, mask, attn_mask_type, scale, dropout_p, *, softmax_in_fp32=True, window_size=None):  # noqa: A002
        calls.append(dict(mask=mask, attn_mask_type=attn_mask_type, scale=scale, p=dropout_p,
                          softmax_in_fp32=softmax_in_fp32, window_size=window_size))
        return torch.nn.functional.dropout(unfused.scale_mask_softmax(input, unfused.causal_mask(
            input.shape[-2], input.shape[-1], device=input.device), scale), dropout_p)

    monkeypatch.setattr(fused_softmax, "fused_scale_mask_softmax_dropout", fake, raising=False)
    q, k, v = _attention_inputs()

    def run(train=True, p=0.25, fusion=True, **kw):
        calls.clear()
        attn = DotProductAttention(make_config(masked_softmax_fusion=fusion, attention_dropout=p, **kw), 3,
                                   AttnMaskType.causal, "self")
        attn.train(train)
        attn(q, k, v, None)
        return list(calls)

    (call,) = run(apply_query_key_layer_scaling=True, window_size=(3, 0))
    assert call == dict(mask=None, attn_mask_type=AttnMaskType.causal, scale=3, p=0.25, softmax_in_fp32=True,
                        window_size=(3, 0))
    assert run(train=False) == [] and run(p=0.0) == [] and run(fusion=False) == []


def test_softmax_function_names_the_kernels_function_only_for_causal_scores():
    # DotProductAttention.softmax_function (FusedTransformerLayer runs the Function it names): the
    # softmax+dropout kernel's Function for causal scores, None for another mask type
    cfg = make_config(masked_softmax_fusion=True, attention_dropout=0.1)
    causal = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    assert causal.softmax_function(0.1) is fused_softmax.ScaledMaskedSoftmaxDropout
    assert DotProductAttention(cfg, 1, AttnMaskType.padding, "self").softmax_function(0.1) is None


def test_without_the_fused_softmax_dropout_the_softmax_is_fused_and_dropout_follows(monkeypatch):
    monkeypatch.delattr(fused_softmax, "fused_scale_mask_softmax_dropout", raising=False)
    softmax = Spy(monkeypatch, fused_softmax, "softmax_fwd")
    dropout = Spy(monkeypatch, torch.nn.functional, "dropout")
    q, k, v = _attention_inputs()
    attn = DotProductAttention(make_config(masked_softmax_fusion=True, attention_dropout=0.5), 1,
                               AttnMaskType.causal, "self")
    attn(q, k, v, None)
    assert softmax and dropout and dropout.calls[0][0][1] == 0.5


def test_rope_goes_through_rope_utils_with_the_config(monkeypatch):
    calls = []
    fake = types.ModuleType("fusedlib.models.common.embeddings.rope_utils")

    def apply_rotary_pos_emb(t, freqs, config):
        calls.append((tuple(t.shape), tuple(freqs.shape), config))
        return t

    fake.apply_rotary_pos_emb = apply_rotary_pos_emb
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    cfg = make_config(attention_backend=AttnBackend.unfused)
    attn = SelfAttention(cfg, get_gpt_layer_local_spec().submodules.self_attention.submodules, layer_number=1,
                         attn_mask_type=AttnMaskType.causal)
    freqs = torch.randn(S, 1, 1, H // NP, device=DEVICE, dtype=torch.float32)
    attn(hidden(), None, rotary_pos_emb=freqs)
    assert calls == [((S, B, NP, H // NP), (S, 1, 1, H // NP), cfg), ((S, B, NG, H // NP), (S, 1, 1, H // NP), cfg)]


# ---------------------------------------------------------------------------------------------
# Attention: causality, the two backends, grouped queries, cross attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.auto, AttnBackend.flash])
def test_a_later_token_never_changes_an_earlier_output(backend):
    cfg = make_config(**dict(FUSIONS_ON, attention_backend=backend))
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    x = hidden()
    t = 4
    y = block(x, None)
    y[:t].sum().backward()
    assert torch.all(x.grad[t:] == 0) and torch.any(x.grad[:t] != 0)
    x2 = x.detach().clone()
    x2[t:] = torch.randn(S - t, B, H, device=DEVICE, dtype=torch.float32)
    y2 = block(x2, None)
    assert torch.equal(y2[:t], y[:t].detach())  # exactly: masked keys get probability 0, and 0·v = 0
    assert not torch.allclose(y2[t:], y[t:].detach())


@pytest.mark.parametrize("deterministic_mode", [True, False])
def test_deterministic_mode_reaches_flash_attention(deterministic_mode, monkeypatch):
    from fusedlib.fusions import fused_attention

    seen = []
    real = fused_attention.flash_attention
    monkeypatch.setattr(fused_attention, "flash_attention",
                        lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    cfg = make_config(**dict(FUSIONS_ON, attention_backend=AttnBackend.flash, deterministic_mode=deterministic_mode))
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    block(hidden(), None).sum().backward()
    assert seen == [deterministic_mode] * cfg.num_layers


def test_split_last_dim_takes_gradients_that_tile_one_buffer_whole():
    import fusedlib.kernels.flash_attention as kfa
    from fusedlib.transformer.attention import split_last_dim

    torch.manual_seed(5)
    x = torch.randn(S, B, 3 * H, device=DEVICE, requires_grad=True)
    sizes = [H, H // 2, 3 * H - H - H // 2]
    y = x * 1.0  # a contiguous non-leaf, as the QKV projection's output
    seen = []
    y.register_hook(lambda g: seen.append(g))
    parts = split_last_dim(y, sizes)
    assert [p.shape[-1] for p in parts] == sizes and all(p._base is not None for p in parts)
    # a buffer made by packed_grads (marked as fresh), its pieces as the gradients: taken whole
    buf = torch.randn(S, B, 3 * H, device=DEVICE)
    setattr(buf, kfa.PACKED_GRADS_ATTR, True)
    (gx,) = torch.autograd.grad(parts, x, list(torch.split(buf, sizes, dim=-1)))
    assert torch.equal(gx, buf) and seen[-1].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    # the same pieces of an unmarked buffer (a caller's tensor), separate gradients, or views of
    # one marked buffer in another layout: concatenated, as torch.split's backward
    unmarked = torch.randn(S, B, 3 * H, device=DEVICE)
    other = torch.randn(S, B, 3 * H, device=DEVICE)
    setattr(other, kfa.PACKED_GRADS_ATTR, True)
    for grads in (list(torch.split(unmarked, sizes, dim=-1)), [torch.randn(S, B, n, device=DEVICE) for n in sizes],
                  list(torch.split(other, sizes[::-1], dim=-1))[::-1]):
        seen.clear()
        y = x * 1.0
        y.register_hook(lambda g: seen.append(g))
        (gx,) = torch.autograd.grad(split_last_dim(y, sizes), x, grads)
        assert torch.equal(gx, torch.cat(grads, dim=-1))
        assert all(seen[-1].untyped_storage().data_ptr() != g.untyped_storage().data_ptr() for g in grads)
    (gx,) = torch.autograd.grad(split_last_dim(x * 1.0, sizes)[1].sum(), x)  # the other pieces unused
    assert torch.equal(gx, torch.cat([torch.zeros(S, B, sizes[0]), torch.ones(S, B, sizes[1]),
                                      torch.zeros(S, B, sizes[2])], -1).to(DEVICE))


def test_split_last_dim_leaves_the_callers_gradient_alone_and_differentiates_twice():
    from fusedlib.transformer.attention import split_last_dim

    torch.manual_seed(6)
    x = torch.randn(S, 12, device=DEVICE, dtype=torch.float64, requires_grad=True)
    g = torch.ones(S, 12, device=DEVICE, dtype=torch.float64)
    for _ in range(3):  # accumulated into x.grad: never into the caller's g
        torch.cat(split_last_dim(x, [4, 4, 4]), -1).backward(g)
    assert torch.equal(x.grad, 3 * g) and torch.equal(g, torch.ones_like(g))
    # a second derivative through the split: loss = sum(cat(pieces)^3), Hessian-vector product 6x
    y = torch.cat(split_last_dim(x * 1.0, [4, 4, 4]), -1).pow(3).sum()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    (h,) = torch.autograd.grad(gx.sum(), x)
    torch.testing.assert_close(h, 6 * x.detach(), rtol=1e-15, atol=0)
    # torch.func and forward-mode AD: plain torch.split there
    got = torch.func.grad(lambda t: sum(p.pow(2).sum() for p in split_last_dim(t, [5, 7])))(x.detach())
    torch.testing.assert_close(got, 2 * x.detach(), rtol=1e-15, atol=0)
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        t = torch.randn_like(x)
        parts = split_last_dim(fwad.make_dual(x.detach(), t), [5, 7])
        assert torch.equal(torch.cat([fwad.unpack_dual(p).tangent for p in parts], -1), t)


def test_flash_self_attention_hands_its_packed_gradient_to_the_projection(monkeypatch):
    # the split's backward takes FlashAttention's packed buffer as the QKV output's gradient:
    # the same bits as with torch.split, and no concatenation
    import fusedlib.kernels.flash_attention as kfa
    from fusedlib.transformer import attention

    made = []
    real = kfa.packed_grads
    monkeypatch.setattr(kfa, "packed_grads", lambda q, k, v: made.append(real(q, k, v)) or made[-1])
    cfg = make_config(**dict(FUSIONS_ON, attention_backend=AttnBackend.flash, num_query_groups=NP))
    torch.manual_seed(3)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    x = hidden()

    def backward_ops() -> set:
        y = block(x, None).sum()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y.backward()
        return {e.name for e in prof.events()}

    assert "aten::cat" not in backward_ops(), "the QKV gradient was concatenated"
    assert len(made) == cfg.num_layers and all(m is not None for m in made)
    grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    monkeypatch.setattr(attention, "split_last_dim", lambda t, sizes: torch.split(t, sizes, dim=-1))
    x.grad = None
    block.zero_grad()
    assert "aten::cat" in backward_ops()  # torch.split's backward concatenates
    assert all(torch.equal(a, b) for a, b in zip(grads, [x.grad] + [p.grad for p in block.parameters()]))


BAD_MASKS = {
    # [b, sk] (a key-padding mask) is read as [sq, sk]: the flash path reported its 4-D view,
    # "got [1, 1, 2, 7]", and SDPA a raw broadcast RuntimeError
    "[b, sk]": (lambda: torch.zeros(B, S, dtype=torch.bool), ValueError,
                r"attention_mask must broadcast to the scores' shape \[b, np, sq, sk\] = \[2, 4, 7, 7\] .*"
                r"mask\[:, None, None, :\]\), got shape \[2, 7\]$"),
    "[b, sk - 1]": (lambda: torch.zeros(B, S - 1, dtype=torch.bool), ValueError, r"got shape \[2, 6\]$"),
    "4-D, other b": (lambda: torch.zeros(3, 1, S, S, dtype=torch.bool), ValueError, r"got shape \[3, 1, 7, 7\]$"),
    "5-D": (lambda: torch.zeros(1, 1, 1, S, S, dtype=torch.bool), ValueError, r"got shape \[1, 1, 1, 7, 7\]$"),
    # SDPA: NotImplementedError "bitwise_or_cpu" not implemented for 'Float'
    "float": (lambda: torch.zeros(B, 1, S, S), TypeError, r"attention_mask must have dtype bool, got float32"),
    "list": (lambda: [[True]], TypeError, "attention_mask must be a torch.Tensor, got list"),
    "meta device": (lambda: torch.zeros(B, 1, S, S, dtype=torch.bool, device="meta"), ValueError,
                    "attention_mask must be on query's device"),
}


@pytest.mark.parametrize("backend", list(AttnBackend))
@pytest.mark.parametrize("mask", list(BAD_MASKS))
def test_bad_attention_mask_is_named_with_the_shape_passed(backend, mask):
    make, error, match = BAD_MASKS[mask]
    block = TransformerBlock(make_config(num_layers=1, attention_backend=backend), get_gpt_layer_local_spec())
    bad = make()
    bad = bad.to(DEVICE) if isinstance(bad, torch.Tensor) and bad.device.type != "meta" else bad
    with pytest.raises(error, match=match):
        block(hidden(requires_grad=False), bad)


ATTENTION_CASES = {
    "causal": dict(mask_type=AttnMaskType.causal),
    "causal-gqa-padding-empty-row": dict(mask_type=AttnMaskType.causal, padding=True),
    "window": dict(mask_type=AttnMaskType.causal, window=(2, 0)),
    "cross-sq-ne-sk": dict(mask_type=AttnMaskType.no_mask, sk=5, ng=NP),
    "causal-sq-gt-sk": dict(mask_type=AttnMaskType.causal, sk=4),
    # a window open to later keys (i - 2 <= j <= i + 1) replaces the causal mask on every backend
    "window-open-right": dict(mask_type=AttnMaskType.causal, window=(2, 1)),
    # query-key layer scaling at layer 3: scores at scale/3, multiplied by 3 inside the softmax,
    # so every backend gives the probabilities of the plain scale 1/sqrt(hn)
    "layer-scaling-layer-3": dict(mask_type=AttnMaskType.causal, layer_number=3),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", [False, True])
def test_sdpa_backend_equals_the_materialised_attention(case, dtype, fusion):
    c = ATTENTION_CASES[case]
    sk, ng = c.get("sk", S), c.get("ng", NG)
    cfg = make_config(dtype, masked_softmax_fusion=fusion, num_query_groups=ng, window_size=c.get("window"),
                      apply_query_key_layer_scaling="layer_number" in c)
    q, k, v = _attention_inputs(dtype, sk=sk, ng=ng, requires_grad=True)
    mask = None
    if c.get("padding"):  # sample 0 masks keys 1..2; sample 1 masks every key of query row 2
        mask = torch.zeros(B, 1, S, sk, device=DEVICE, dtype=torch.bool)
        mask[0, ..., 1:3] = True
        mask[1, 0, 2, :] = True
    causal = c["mask_type"] is AttnMaskType.causal
    keep = R.keep_mask(S, sk, causal, c.get("window"), device=DEVICE)
    if mask is not None:
        keep = keep & ~mask
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    per = NP // ng
    ref = R.attention(q64, k64.repeat_interleave(per, 2), v64.repeat_interleave(per, 2), keep, 1 / math.sqrt(H // NP))
    g = torch.randn_like(ref)
    ref.backward(g)
    # the output is a convex combination of rows of v (|v| <~ 4): a few roundings of the output's
    # dtype. The gradients (fp32 only) sum sk <= 7 products: a few float32 roundings as well.
    atol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for backend in (AttnBackend.local, AttnBackend.fused, AttnBackend.flash):
        cfg.attention_backend = backend
        attn = DotProductAttention(cfg, c.get("layer_number", 1), c["mask_type"], "self")
        q.grad = k.grad = v.grad = None
        out = attn(q, k, v, mask)
        assert out.shape == (S, B, NP * (H // NP)) and out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
        if mask is not None:
            assert torch.all(out[2, 1] == 0)  # the row with every key masked: zeros, never NaN
        if dtype is torch.float32:
            out.backward(g.to(dtype))
            for t, t64 in ((q, q64), (k, k64), (v, v64)):
                torch.testing.assert_close(t.grad.double(), t64.grad, atol=atol, rtol=0)


def test_window_attn_skip_freq_as_an_int_skips_every_nth_layer():
    # Megatron-core's is_layer_window_attention: with an int n, layers n, 2n, ... attend to every
    # key, the others take the window
    cfg = make_config(num_layers=4, window_size=(4, 0), window_attn_skip_freq=2)
    got = [DotProductAttention(cfg, i, AttnMaskType.causal, "self").window_size for i in (1, 2, 3, 4)]
    assert got == [(4, 0), None, (4, 0), None]


@pytest.mark.parametrize("fusion", [False, True])
def test_rope_pair_rotates_queries_and_keys_by_their_own_angles(fusion):
    # rotary_pos_emb = (query angles, key angles): queries at positions 5.., keys at 0.., against
    # the float64 reference (angles given in float64, so the only differences are float64 roundings)
    hn, per = H // NP, NP // NG
    cfg = make_config(torch.float64, attention_backend=AttnBackend.unfused, apply_rope_fusion=fusion)
    attn = randomize(SelfAttention(cfg, get_gpt_layer_local_spec().submodules.self_attention.submodules, 1,
                                   AttnMaskType.causal))
    pos_q, pos_k = torch.arange(S, device=DEVICE) + 5, torch.arange(S, device=DEVICE)
    inv = 10000.0 ** (-2 * torch.arange(hn // 2, dtype=torch.float64, device=DEVICE) / hn)

    def angles(pos):
        theta = pos.double()[:, None] * inv
        return torch.cat((theta, theta), dim=-1)[:, None, None, :]  # [s, 1, 1, hn], half-split layout

    x = hidden(torch.float64)
    out, bias = attn(x, None, rotary_pos_emb=(angles(pos_q), angles(pos_k)))
    sd = {k: v for k, v in attn.state_dict().items() if isinstance(v, torch.Tensor)}
    qkv = R.linear(x, sd, "linear_qkv").view(S, B, NG, (per + 2) * hn)
    q, k, v = torch.split(qkv, [per * hn, hn, hn], dim=-1)
    q, k = R.rope(q.reshape(S, B, NP, hn), pos_q, hn), R.rope(k, pos_k, hn)
    ref = R.attention(q, k.repeat_interleave(per, 2), v.repeat_interleave(per, 2), R.keep_mask(S, S, device=DEVICE),
                      1 / math.sqrt(hn))
    torch.testing.assert_close(out + bias, R.linear(ref, sd, "linear_proj"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.flash, AttnBackend.auto])
def test_self_attention_of_no_tokens(backend):
    # an empty sequence (s = 0) or an empty batch (b = 0): an empty output of [s, b, h] and empty
    # gradients, on each attention path, as any other s or b gives its own
    cfg = make_config(attention_backend=backend)
    attn = SelfAttention(cfg, get_gpt_layer_local_spec().submodules.self_attention.submodules, 1, AttnMaskType.causal)
    for s, b in ((0, B), (S, 0)):
        x = torch.randn(s, b, H, device=DEVICE, requires_grad=True)
        out, bias = attn(x, None)
        assert out.shape == (s, b, H)
        (out + bias).sum().backward()
        assert x.grad.shape == (s, b, H)


def test_add_qkv_bias_gives_the_qkv_projection_alone_a_bias():
    # Megatron-core: linear_qkv has a bias where add_bias_linear or add_qkv_bias (Qwen's layout: a
    # bias on the QKV projection only); float64, against the reference
    cfg = make_config(torch.float64, add_bias_linear=False, add_qkv_bias=True, attention_backend=AttnBackend.unfused)
    attn = randomize(SelfAttention(cfg, get_gpt_layer_local_spec().submodules.self_attention.submodules, 1,
                                   AttnMaskType.causal))
    hn = H // NP
    assert attn.linear_qkv.bias is not None and attn.linear_qkv.bias.shape == ((NP + 2 * NG) * hn,)
    assert attn.linear_proj.bias is None
    x = hidden(torch.float64)
    out, bias = attn(x, None)
    assert bias is None
    ref = R.self_attention(x.detach(), reference_state(attn), "", cfg, R.keep_mask(S, S, device=DEVICE))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.fused, AttnBackend.flash])
def test_attention_dropout_is_off_in_eval_mode(backend):
    # attention_dropout = 0.5 in eval mode: no dropout on any backend, the float64 reference's output
    # (a convex combination of rows of v: a few float32 roundings, as in the test above)
    cfg = make_config(attention_dropout=0.5, attention_backend=backend)
    attn = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    q, k, v = _attention_inputs()
    per = NP // NG
    ref = R.attention(q.double(), k.double().repeat_interleave(per, 2), v.double().repeat_interleave(per, 2),
                      R.keep_mask(S, S, device=DEVICE), 1 / math.sqrt(H // NP))
    torch.testing.assert_close(attn(q, k, v, None).double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", [AttnBackend.unfused, AttnBackend.fused])
def test_gqa_with_repeated_kv_weights_equals_mha(backend):
    """float64: the same arithmetic on the same numbers, to within a few roundings of 2^-53."""
    hn, per = H // NP, NP // NG
    spec = get_gpt_layer_local_spec().submodules.self_attention.submodules
    cfg = dict(dtype=torch.float64, attention_backend=backend)
    gqa = randomize(SelfAttention(make_config(**cfg), spec, 1, AttnMaskType.causal))
    mha = SelfAttention(make_config(num_query_groups=NP, **cfg), spec, 1, AttnMaskType.causal)
    mha_none = SelfAttention(make_config(num_query_groups=None, **cfg), spec, 1, AttnMaskType.causal)
    # GQA rows per group: [q_1 .. q_per, k, v]; MHA rows per head: [q, k, v] with the group's k, v
    w = gqa.linear_qkv.weight.detach().view(NG, per + 2, hn, H)
    b = gqa.linear_qkv.bias.detach().view(NG, per + 2, hn)
    w_mha = torch.stack([torch.stack([w[i // per, i % per], w[i // per, per], w[i // per, per + 1]])
                         for i in range(NP)])  # [np, 3, hn, h]
    b_mha = torch.stack([torch.stack([b[i // per, i % per], b[i // per, per], b[i // per, per + 1]])
                         for i in range(NP)])
    state = dict(gqa.state_dict())
    state["linear_qkv.weight"], state["linear_qkv.bias"] = w_mha.reshape(-1, H), b_mha.reshape(-1)
    mha.load_state_dict(state)
    mha_none.load_state_dict(state)
    x = hidden(torch.float64)
    out_gqa, _ = gqa(x, None)
    out_mha, _ = mha(x, None)
    torch.testing.assert_close(out_gqa, out_mha, atol=1e-12, rtol=0)
    assert torch.equal(mha_none(x, None)[0], out_mha)  # num_query_groups None is multi-head attention


def test_cross_attention_against_the_reference():
    cfg = make_config(torch.float64, num_query_groups=NP, attention_backend=AttnBackend.unfused)
    subs = CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                    core_attention=DotProductAttention, linear_proj=RowParallelLinear)
    attn = randomize(CrossAttention(cfg, subs, 1, AttnMaskType.no_mask))
    x, ctx = hidden(torch.float64), hidden(torch.float64, s=5)
    out, bias = attn(x, None, key_value_states=ctx)
    sd = {k: v for k, v in attn.state_dict().items() if isinstance(v, torch.Tensor)}
    hn = H // NP
    q = R.linear(x, sd, "linear_q").view(S, B, NP, hn)
    k, v = R.linear(ctx, sd, "linear_kv").view(5, B, NP, 2 * hn).split(hn, dim=-1)
    ref = R.attention(q, k, v, R.keep_mask(S, 5, causal=False, device=DEVICE), 1 / math.sqrt(hn))
    torch.testing.assert_close(out + bias, R.linear(ref, sd, "linear_proj"), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="Group query attention is not currently supported"):
        CrossAttention(make_config(), subs, 1)
    with pytest.raises(ValueError, match="key_value_states cannot be None"):
        attn(x, None)
    # a context of the wrong rank was reported as a "key" of a shape derived after the projection;
    # an empty one gave zero attention where an empty hidden_states is refused
    for bad, what in ((torch.zeros(5, H, dtype=torch.float64), f"shape \\[5, {H}\\]"),
                      (hidden(torch.float64, s=0), f"shape \\[0, {B}, {H}\\]"),
                      (hidden(torch.float64, s=5)[:, :1], f"shape \\[5, 1, {H}\\]")):
        with pytest.raises(ValueError, match=r"CrossAttention: key_value_states \(the layer's context\) must be a "
                                             r"tensor \[sk, b, h\] with sk >= 1, b = hidden_states' batch "
                                             f"\\({B}\\) and h = hidden_size = {H}, got {what}"):
            attn(x, None, key_value_states=bad)
    with pytest.raises(TypeError, match=r"key_value_states \(the layer's context\) must be a tensor \[sk, b, h\], "
                                        r"got list"):
        attn(x, None, key_value_states=[[0.0]])
    with pytest.raises(TypeError, match="key_value_states .* must be floating point, got torch.int64"):
        attn(x, None, key_value_states=torch.zeros(5, B, H, dtype=torch.int64))


def _decoder_layer_submodules(cross_mask_type: AttnMaskType) -> TransformerLayerSubmodules:
    """A decoder layer's submodules: the local spec's self-attention and MLP, torch's norms, and a
    cross attention with ``cross_mask_type``, each sub-block followed by bias-dropout-add."""
    local = get_gpt_layer_local_spec().submodules
    return TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=local.self_attention, self_attn_bda=get_bias_dropout_add,
        pre_cross_attn_layernorm=WrappedTorchNorm,
        cross_attention=ModuleSpec(CrossAttention, params={"attn_mask_type": cross_mask_type},
                                   submodules=CrossAttentionSubmodules(
                                       linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                       core_attention=DotProductAttention, linear_proj=RowParallelLinear)),
        cross_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=WrappedTorchNorm, mlp=local.mlp,
        mlp_bda=get_bias_dropout_add)


def test_decoder_layer_with_cross_attention_follows_megatrons_order():
    """norm, self-attention, bias-dropout-add; norm, cross-attention on the context, bias-dropout-add;
    norm, MLP, bias-dropout-add: in float64, to within a few roundings of 2^-53."""
    cfg = make_config(torch.float64, num_query_groups=NP, attention_backend=AttnBackend.unfused)
    subs = _decoder_layer_submodules(AttnMaskType.no_mask)
    layer = randomize(TransformerLayer(cfg, subs, layer_number=1))
    x, ctx = hidden(torch.float64), hidden(torch.float64, s=5)
    out, context = layer(x, None, context=ctx)
    assert context is ctx
    sd = {k: v for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    keep = R.keep_mask(S, S, causal=True, device=DEVICE)
    h = x + R.self_attention(R.norm(x, sd, "input_layernorm", cfg), sd, "self_attention.", cfg, keep)
    q_in = R.norm(h, sd, "pre_cross_attn_layernorm", cfg)
    hn = H // NP
    q = R.linear(q_in, sd, "cross_attention.linear_q").view(S, B, NP, hn)
    k, v = R.linear(ctx, sd, "cross_attention.linear_kv").view(5, B, NP, 2 * hn).split(hn, dim=-1)
    cross = R.attention(q, k, v, R.keep_mask(S, 5, causal=False, device=DEVICE), 1 / math.sqrt(hn))
    h = h + R.linear(cross, sd, "cross_attention.linear_proj")
    ref = h + R.mlp(R.norm(h, sd, "pre_mlp_layernorm", cfg), sd, "mlp.", cfg, F.silu)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unit, clamp", [("swiglu", None), ("swiglu", 0.4), ("geglu", None)])
def test_mlp_fused_activation_equals_the_reference(unit, clamp):
    act = F.silu if unit == "swiglu" else F.gelu
    extra = dict(num_moe_experts=2, activation_func_clamp_value=clamp) if clamp else {}
    fused_cfg = make_config(activation_func=act, bias_activation_fusion=True, **extra)
    act64 = act if unit == "swiglu" else functools.partial(F.gelu, approximate="tanh")
    plain_cfg = make_config(activation_func=act64, **extra)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    fused = randomize(MLP(fused_cfg, subs))
    plain = MLP(plain_cfg, subs)
    plain.load_state_dict(fused.state_dict())
    x = hidden()
    sd = reference_state(fused)
    x64 = x.detach().double().requires_grad_(True)
    ref = R.mlp(x64, sd, "", plain_cfg, act64)
    g = torch.randn_like(ref)
    ref.backward(g)
    if clamp:
        h1 = R.linear(x64.detach(), sd, "linear_fc1")
        assert (h1[..., :FFN] > clamp).any() and (h1[..., FFN:].abs() > clamp).any()  # the clamp bites
    for mlp in (fused, plain):
        xi = x.detach().clone().requires_grad_(True)
        out, bias = mlp(xi)
        assert bias is mlp.linear_fc2.bias  # returned, not added: for the bias-dropout-add
        (out + bias).backward(g.float())
        # float32 throughout: a few roundings of values <~ 10 (fc1 sums 24 products, fc2 20)
        torch.testing.assert_close((out + bias).double(), ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(xi.grad.double(), x64.grad, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mlp.linear_fc1.weight.grad.double(), sd["linear_fc1.weight"].grad,
                                   atol=2e-5, rtol=1e-5)


def test_mlp_glu_linear_offset_shifts_the_linear_half():
    # Megatron-core's unfused gated unit: act(x1) · (x2 + glu_linear_offset), against the float64
    # reference (float64 throughout: the only differences are float64 roundings)
    cfg = make_config(torch.float64, glu_linear_offset=1.0)
    mlp = randomize(MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    x = hidden(torch.float64)
    out, bias = mlp(x)
    ref = R.mlp(x.detach(), reference_state(mlp), "", cfg, F.silu)
    torch.testing.assert_close(out + bias, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("hook", ["fc2_forward_hook", "fc1_pruned"])
def test_gemm_gelu_fusion_leaves_linear_layers_with_hooks_to_their_forward(hook):
    # the fused op calls neither linear layer: a layer with hooks (here one that scales fc2's output,
    # and pruning's forward pre-hook that recomputes fc1's weight from weight_orig and the mask at
    # every call) runs as without the switch, over two steps of plain gradient descent
    results = []
    for on in (True, False):
        cfg = make_config(gated_linear_unit=False, activation_func=F.gelu, bias_activation_fusion=True,
                          gemm_gelu_fusion=on)
        torch.manual_seed(0)
        mlp = randomize(MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
        if hook == "fc2_forward_hook":
            mlp.linear_fc2.register_forward_hook(lambda module, args, out: (2 * out[0], out[1]))
        else:
            prune.random_unstructured(mlp.linear_fc1, "weight", amount=0.5)
        x = hidden()
        outs = []
        for _ in range(2):
            out, bias = mlp(x)
            (out + bias).sum().backward()
            outs.append(out.detach())
            with torch.no_grad():
                for p in mlp.parameters():
                    p.sub_(0.1 * p.grad)
                    p.grad = None
        results.append(outs)
    for on, off in zip(*results):
        torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Residual options
# ---------------------------------------------------------------------------------------------


def test_residual_after_the_norm_and_fp32_residual_stream():
    # the residual taken after each norm (BERT's order), float32: close to the float64 block
    cfg = make_config(apply_residual_connection_post_layernorm=True)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_unfused_spec()))
    x = hidden()
    ref = R.block(x.detach(), reference_state(block), cfg)
    assert nrmse(block(x, None), ref) <= UNFUSED_IN_U * U[torch.float32]
    assert nrmse(block(x, None), R.block(x.detach(), reference_state(block), make_config())) > 0.1

    # bf16 parameters, an fp32 residual stream: the layers' outputs stay fp32, the norms run in bf16
    cfg = make_config(torch.bfloat16, fp32_residual_connection=True, **FUSIONS_ON)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    dtypes = []
    for layer in block.layers:
        layer.register_forward_hook(lambda m, i, out: dtypes.append(out[0].dtype))
    x32 = hidden(torch.float32)
    y = block(x32, None)
    assert dtypes == [torch.float32, torch.float32] and y.dtype == torch.bfloat16
    ref = R.block(x32.detach(), reference_state(block), cfg)
    assert nrmse(y, ref) <= UNFUSED_IN_U * U[torch.bfloat16]
    y.float().sum().backward()
    assert x32.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Activation recomputation
# ---------------------------------------------------------------------------------------------

RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective-core-attn": dict(recompute_granularity="selective"),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
}


def _train_step(cfg, spec, state, x, seed):
    block = TransformerBlock(cfg, spec)
    block.load_state_dict(state)
    counts = {"layer": 0, "core": 0, "mlp": 0}
    for layer in block.layers:
        layer.register_forward_pre_hook(lambda *a: counts.__setitem__("layer", counts["layer"] + 1))
        layer.self_attention.core_attention.register_forward_pre_hook(
            lambda *a: counts.__setitem__("core", counts["core"] + 1))
        layer.mlp.register_forward_pre_hook(lambda *a: counts.__setitem__("mlp", counts["mlp"] + 1))
    xi = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = block(xi, None)
    y.backward(torch.ones_like(y))
    return y.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}, counts


@pytest.mark.parametrize("spec_name, modes", [
    ("unfused", list(RECOMPUTE)),
    ("fused", ["full-uniform", "selective-core-attn"]),
])
def test_recomputation_gives_the_same_outputs_and_gradients_with_dropout(spec_name, modes):
    """Same ops on the same numbers in the same order, the RNG state restored for the recompute:
    the same bits (dropout masks included)."""
    spec = get_gpt_layer_local_spec() if spec_name == "fused" else get_gpt_layer_unfused_spec()
    kw = dict(FUSIONS_ON if spec_name == "fused" else {}, hidden_dropout=0.3, attention_dropout=0.2,
              num_layers=2 if spec_name == "unfused" else 1)
    state = randomize(TransformerBlock(make_config(**kw), spec)).state_dict()
    x, seed = hidden(), int(torch.randint(0, 2**31, (1,)).item())
    y0, dx0, grads0, counts0 = _train_step(make_config(**kw), spec, state, x, seed)
    n = kw["num_layers"]
    assert counts0 == {"layer": n, "core": n, "mlp": n}
    # dropout is on: another seed gives another output
    assert not torch.equal(_train_step(make_config(**kw), spec, state, x, seed + 1)[0], y0)
    for mode in modes:
        y, dx, grads, counts = _train_step(make_config(**kw, **RECOMPUTE[mode]), spec, state, x, seed)
        assert torch.equal(y, y0) and torch.equal(dx, dx0), mode
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), (mode, name)
        # the recomputed module runs twice (forward, and again in the backward); "block" with
        # recompute_num_layers=1 recomputes the first layer only
        recomputed = {"full-uniform": "layer", "full-block": "layer", "selective-core-attn": "core",
                      "selective-mlp": "mlp"}[mode]
        assert counts[recomputed] == (n + 1 if mode == "full-block" else 2 * n), (mode, counts)


# ---------------------------------------------------------------------------------------------
# Float16Module and checkpoints
# ---------------------------------------------------------------------------------------------


def test_float16_module_casts_at_the_edges():
    cfg = make_config(bf16=True)
    block = TransformerBlock(cfg, get_gpt_layer_unfused_spec())
    seen = []
    block.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    model = Float16Module(cfg, block)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = hidden(torch.float32)
    mask = torch.zeros(1, 1, S, S, device=DEVICE, dtype=torch.bool)
    y = model(x, mask)
    assert seen == [torch.bfloat16] and y.dtype == torch.float32
    assert model(x, mask, fp32_output=False).dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.dtype == torch.float32
    assert model.state_dict().keys() == block.state_dict().keys()
    assert model.state_dict_for_save_checkpoint().keys() == block.state_dict().keys()
    with pytest.raises(ValueError, match="needs config.fp16 or config.bf16"):
        Float16Module(make_config(), block)
    half = Float16Module(make_config(torch.float32, fp16=True), TransformerBlock(make_config(),
                                                                                 get_gpt_layer_unfused_spec()))
    assert all(p.dtype == torch.float16 for p in half.parameters())


class _PairOut(torch.nn.Module):
    Out = collections.namedtuple("Out", "logits size")

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, pair):
        return self.Out(self.lin(x) + pair.shift, x.shape)


def test_float16_module_inside_another_module_round_trips_and_keeps_named_tuples():
    # its state_dict / load_state_dict overrides served calls on the Float16Module only: a parent's
    # state dict could not be loaded back (strict=False loaded nothing); named tuples and torch.Size
    # came back as plain tuples (out.logits failed); a lambda convertor could not be pickled
    cfg = make_config(bf16=True)

    def parent():
        p = torch.nn.Module()
        p.f16, p.other = Float16Module(cfg, _PairOut()), torch.nn.Linear(2, 2)
        return p.to(DEVICE)

    a, b = parent(), parent()
    state = a.state_dict()
    assert list(state) == ["f16.lin.weight", "f16.lin.bias", "other.weight", "other.bias"]
    assert not b.load_state_dict(state).missing_keys
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(), state.values()))
    state["f16.lin.bias"] = state["f16.lin.bias"] + 1
    b.load_state_dict(state, strict=False)
    assert torch.equal(b.f16.module.lin.bias, state["f16.lin.bias"])
    Pair = collections.namedtuple("Pair", "shift")
    out = a.f16(torch.randn(2, 4, device=DEVICE), Pair(torch.zeros(3, device=DEVICE)))
    assert type(out) is _PairOut.Out and out.logits.dtype == torch.float32 and type(out.size) is torch.Size
    buffer = io.BytesIO()
    torch.save(a.f16, buffer)  # pickles the module (the convertor included)
    with pytest.raises(TypeError, match="Float16Module: module must be a torch.nn.Module, got NoneType"):
        Float16Module(cfg, None)


def test_state_dict_save_and_load_round_trip():
    cfg = make_config(**FUSIONS_ON)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    buffer = io.BytesIO()
    torch.save(block.state_dict_for_save_checkpoint(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert any(k.endswith("_extra_state") for k in state)  # Megatron-core's (empty) entries
    fresh = TransformerBlock(make_config(), get_gpt_layer_unfused_spec())
    x = hidden()
    assert not torch.allclose(fresh(x, None), block(x, None))
    fresh.load_state_dict(state, strict=True)
    for (n, p), (n2, p2) in zip(block.named_parameters(), fresh.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    # a checkpoint without the _extra_state entries (not every writer has them) loads strictly too
    fresh.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")}, strict=True)
    with torch.no_grad():
        y, y_fresh = block(x, None), fresh(x, None)
    assert nrmse(y_fresh, y.double()) <= UNFUSED_IN_U * U[torch.float32]


class _DtypeProbe(torch.nn.Module):
    """Records the dtypes of its inputs; returns its first input times a weight, and the input."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x, *others):
        self.seen = [t.dtype for t in (x, *others)]
        return x * self.w, x


def test_float16_module_in_fp16_casts_only_float32_inputs_and_its_fp16_outputs_back():
    # Megatron-core's fp32_to_float16 casts float32 tensors only (a float64 input, ids and masks
    # pass as they are) and float16_to_fp32 casts fp16 as well as bf16 outputs back to float32
    model = Float16Module(make_config(fp16=True), _DtypeProbe()).to(DEVICE)
    x = torch.randn(2, 4, device=DEVICE)
    x64 = torch.randn(2, device=DEVICE, dtype=torch.float64)
    ids, mask = torch.arange(2, device=DEVICE), torch.ones(2, device=DEVICE, dtype=torch.bool)
    y, x_in = model(x, x64, ids, mask)
    assert model.module.seen == [torch.float16, torch.float64, torch.int64, torch.bool]
    assert model.module.w.dtype == torch.float16
    assert y.dtype == torch.float32 and x_in.dtype == torch.float32
    # one rounding of x to fp16; w = 0.5 scales exactly
    assert torch.equal(x_in, x.half().float()) and torch.equal(y, 0.5 * x.half().float())
    y16, x16 = model(x, x64, ids, mask, fp32_output=False)
    assert y16.dtype == torch.float16 and x16.dtype == torch.float16


def test_float16_module_loads_keys_already_under_module_and_saves_with_keep_vars():
    # the load pre-hook prefixes the wrapped module's names with "module."; names already under
    # "module." (a state dict of the Float16Module's own named_parameters) must not become
    # "module.module.*"
    model = Float16Module(make_config(bf16=True), _DtypeProbe()).to(DEVICE)
    w = torch.arange(4, dtype=torch.bfloat16, device=DEVICE)
    assert not model.load_state_dict({"module.w": w}, strict=True).missing_keys
    assert torch.equal(model.module.w, w)
    model.load_state_dict({"w": w + 1}, strict=True)
    assert torch.equal(model.module.w, w + 1)
    # keep_vars=True hands out the parameters themselves (MegatronModule and Float16Module alike)
    block = TransformerBlock(make_config(num_layers=1), get_gpt_layer_unfused_spec())
    saved = block.state_dict_for_save_checkpoint(prefix="m.", keep_vars=True)
    params = dict(block.named_parameters(prefix="m"))
    assert params and all(saved[name] is p for name, p in params.items())
    assert model.state_dict_for_save_checkpoint(keep_vars=True)["w"] is model.module.w


# ---------------------------------------------------------------------------------------------
# No host synchronization in forward and backward (CUDA only: the CPU has nothing to sync with)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host syncs are a CUDA notion; on the CPU every op is synchronous")
@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.auto])
def test_no_host_sync_in_forward_and_backward(backend):
    cfg = make_config(torch.bfloat16, **dict(FUSIONS_ON, attention_backend=backend), hidden_dropout=0.1,
                      attention_dropout=0.1)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()))
    x = hidden(torch.bfloat16)
    block(x, None).sum().backward()  # warm-up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(x, None).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------
# Shapes and arguments the modules check themselves, alike on every backend
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.0, -0.25])
def test_a_non_positive_softmax_scale_gives_one_answer_on_every_backend(scale):
    # torch's SDPA with is_causal and a scale <= 0 returned NaN: the auto and fused backends did too
    q, k, v = _attention_inputs(ng=NP)
    outs = {}
    for backend in (AttnBackend.unfused, AttnBackend.local, AttnBackend.auto, AttnBackend.fused, AttnBackend.flash):
        attn = DotProductAttention(make_config(num_query_groups=NP, attention_backend=backend), 1,
                                   AttnMaskType.causal, "self", softmax_scale=scale)
        outs[backend] = attn(q, k, v, None)
    ref = outs.pop(AttnBackend.unfused)
    assert torch.isfinite(ref).all()
    for backend, out in outs.items():
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("backend", list(AttnBackend))
@pytest.mark.parametrize("scale, error, match", [
    (float("nan"), ValueError, "softmax_scale must be finite"), (float("inf"), ValueError, "softmax_scale must be finite"),
    (1e39, ValueError, "softmax_scale must be finite"), ("0.5", TypeError, "softmax_scale must be a real number"),
    (True, TypeError, "softmax_scale must be a real number"),
    (torch.tensor(0.3), TypeError, "softmax_scale must be a real number")])
def test_dot_product_attention_checks_its_softmax_scale_on_every_backend(backend, scale, error, match):
    # only the flash backend checked it: the others gave an all-NaN context for a NaN or inf
    # scale, took True as 1, and failed deep inside baddbmm or a multiplication for a string
    with pytest.raises(error, match=match):
        DotProductAttention(make_config(attention_backend=backend), 1, AttnMaskType.causal, "self",
                            softmax_scale=scale)


@pytest.mark.parametrize("backend", list(AttnBackend))
def test_a_window_side_beyond_int64_gives_the_unbounded_answer_on_every_backend(backend):
    # the SDPA backends built the window mask with the side as given: torch.triu's diagonal
    # overflowed ("Overflow when unpacking long long"); a side past the sequence is unbounded
    torch.manual_seed(1717)
    q, k, v = _attention_inputs(ng=NP)
    out = {}
    for left in (2 ** 70, -1):
        attn = DotProductAttention(make_config(num_query_groups=NP, attention_backend=backend, window_size=(left, 0)),
                                   1, AttnMaskType.causal, "self")
        out[left] = attn(q, k, v, None)
    torch.testing.assert_close(out[2 ** 70], out[-1], atol=0, rtol=0)


@pytest.mark.parametrize("backend", list(AttnBackend))
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_attention_mask_is_refused_by_name_on_every_backend(backend, layout):
    # it passed the mask check (a bool tensor) and failed inside: "expand is unsupported for
    # Sparse tensors" (flash), aten::all on SparseCPU (SDPA)
    q, k, v = _attention_inputs()
    dense = torch.zeros(1, 1, S, S, dtype=torch.bool, device=DEVICE)
    mask = dense.to_sparse() if layout == "coo" else dense[0, 0].to_sparse_csr()
    attn = DotProductAttention(make_config(attention_backend=backend), 1, AttnMaskType.causal, "self")
    with pytest.raises(TypeError, match=r"attention_mask must be a dense \(strided\) tensor"):
        attn(q, k, v, mask)


@pytest.mark.parametrize("training", [True, False])
def test_the_softmax_dtype_flags_are_checked_in_training_and_evaluation_alike(training):
    # with masked_softmax_fusion and attention dropout the training path (the softmax+dropout
    # kernel) skipped FusedScaleMaskSoftmax's check: config.bf16 with float32 scores ran in
    # training and raised in evaluation
    cfg = make_config(attention_backend=AttnBackend.local, masked_softmax_fusion=True, attention_dropout=0.1)
    cfg.bf16 = True  # float32 parameters and inputs, the flag saying bf16 (a config built by hand)
    attn = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").train(training)
    q, k, v = _attention_inputs()
    with pytest.raises(ValueError, match="input_in_bf16=True but input has dtype float32"):
        attn(q, k, v, None)


@pytest.mark.parametrize("name", ["post_layer_norm", "pre_process", "post_process"])
def test_transformer_block_refuses_switches_that_are_not_bools(name):
    # by truthiness post_layer_norm="False" still built the final norm
    with pytest.raises(TypeError, match=f"TransformerBlock: {name} must be a bool, got str 'False'"):
        TransformerBlock(make_config(num_layers=1), get_gpt_layer_local_spec(), **{name: "False"})


BAD_QKV = {
    # query [sq, b, np, hn], key/value [sk, b, ng, hn] with np = 4, ng = 2, hn = 6
    "k, v with np heads": ((S, B, NP, 6), (S, B, NP, 6), (S, B, NP, 6), r"key and value must be \[sk, b, ng, hn\] with "
                           r"ng = 2 key/value groups \(this rank's\) and hn = kv_channels = 6, got shape \[7, 2, 4, 6\]"),
    "hn off kv_channels": ((S, B, NP, 5), (S, B, NG, 5), (S, B, NG, 5), r"query must be \[sq, b, np, hn\] with np = 4 "
                           r"query heads \(this rank's\) and hn = kv_channels = 6, got shape \[7, 2, 4, 5\]"),
    "k, v lengths differ": ((S, B, NP, 6), (S, B, NG, 6), (S - 1, B, NG, 6), r"key and value must have one shape"),
    "other batch": ((S, B, NP, 6), (S, B + 1, NG, 6), (S, B + 1, NG, 6), r"query, key and value must have one batch size b \(dim 1\), got 2 and 3"),
    "3-D query": ((S, B, NP * 6), (S, B, NG, 6), (S, B, NG, 6), r"query must be 4-D \(\[s, b, heads, hn\]\), got shape"),
}


@pytest.mark.parametrize("backend", list(AttnBackend))
@pytest.mark.parametrize("case", list(BAD_QKV))
def test_dot_product_attention_checks_its_shapes_alike_on_every_backend(backend, case):
    # the materialised path failed in a reshape; SDPA and flash returned a context of another width
    *shapes, match = BAD_QKV[case]
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    attn = DotProductAttention(make_config(attention_backend=backend), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="DotProductAttention: " + match):
        attn(q, k, v, None)


@pytest.mark.parametrize("shape", [(S, H), (S, B, 1, H), (S, 0, H), (0, B, H), (S, B, H + 1)])
def test_transformer_layer_names_a_bad_hidden_states_shape(shape):
    layer = TransformerLayer(make_config(num_layers=1), get_gpt_layer_local_spec().submodules)
    with pytest.raises(ValueError, match=rf"TransformerLayer: hidden_states must be a tensor \[s, b, h\] with s, b >= 1 "
                                         rf"and h = hidden_size = {H}, got shape \[{', '.join(map(str, shape))}\]"):
        layer(torch.randn(shape, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_layer_and_block_refuse_hidden_states_that_are_not_floating_point(dtype):
    # the residual stream kept the input's dtype: an int64 input came out rounded to ints, a
    # block's final norm cast it back to float32 and hid it; complex ran with a warning
    cfg = make_config(num_layers=1)
    layer = TransformerLayer(cfg, get_gpt_layer_local_spec().submodules).to(DEVICE)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec()).to(DEVICE)
    x = torch.ones(S, B, H, device=DEVICE).to(dtype)
    for module, name in ((layer, "TransformerLayer"), (block, "TransformerBlock")):
        with pytest.raises(TypeError, match=f"{name}: hidden_states must be a floating-point tensor, got {dtype}"):
            module(x, None)
    for bad in (np.ones((S, B, H), dtype=np.float32), [[0.0] * H]):  # AttributeError '_base' before
        with pytest.raises(ValueError, match=f"TransformerBlock: hidden_states must be a tensor .* got "
                                             f"{type(bad).__name__}"):
            block(bad, None)


def test_misspelt_knobs_are_refused_whatever_else_is_set():
    # a recompute_modules typo passed unless the granularity was "selective"; a bad
    # cuda_graph_warmup_steps unless cuda_graph_impl was "local"; a truthy str built the q/k norms
    for granularity in (None, "full", "selective"):
        kw = dict(recompute_method="uniform", recompute_num_layers=1) if granularity == "full" else {}
        with pytest.raises(ValueError, match=r"recompute_modules \['mpl'\] are not module names"):
            make_config(recompute_granularity=granularity, recompute_modules=["mpl"], **kw)
    assert make_config(recompute_modules=["layernorm"]).recompute_modules == ["layernorm"]  # Megatron's: kept
    with pytest.raises(ValueError, match=r"recompute_modules \['layernorm'\] are not implemented in fusedlib"):
        make_config(recompute_granularity="selective", recompute_modules=["layernorm"])
    for bad in ("x", 0, True):
        with pytest.raises(ValueError, match="cuda_graph_warmup_steps must be an int >= 1"):
            make_config(cuda_graph_warmup_steps=bad)
    for spec in (get_gpt_layer_local_spec, get_gpt_layer_unfused_spec):
        with pytest.raises(TypeError, match="qk_layernorm must be a bool .* got str 'no'"):
            spec(qk_layernorm="no")
        assert spec(qk_layernorm=None).submodules.self_attention.submodules.q_layernorm is IdentityOp


def test_rotary_pos_emb_that_is_neither_angles_nor_a_pair_is_named():
    # a list failed with "'list' object has no attribute 'shape'" inside RoPE, a 3-tuple with
    # "too many values to unpack"
    cfg = make_config(num_layers=1)
    layer = TransformerLayer(cfg, get_gpt_layer_local_spec().submodules).to(DEVICE)
    x = torch.randn(S, B, H, device=DEVICE)
    freqs = torch.zeros(S, 1, 1, H // NP, device=DEVICE)
    with pytest.raises(TypeError, match="SelfAttention: rotary_pos_emb must be a tensor of angles, a pair .* got list"):
        layer(x, None, rotary_pos_emb=[freqs, freqs])
    with pytest.raises(ValueError, match="SelfAttention: rotary_pos_emb as a tuple must be a pair .* got 3 entries"):
        layer(x, None, rotary_pos_emb=(freqs,) * 3)
    out, _ = layer(x, None, rotary_pos_emb=(freqs, freqs))  # angles 0: the identity rotation
    assert torch.equal(out, layer(x, None)[0])


def test_config_takes_numpy_ints_for_its_sizes_as_ints():
    # the derived num_query_groups and kv_channels stayed numpy ints, and SDPA then refused
    # enable_gqa=numpy.bool at the first forward
    cfg = make_config(num_layers=np.int64(1), hidden_size=np.int64(H), num_attention_heads=np.int64(2),
                      attention_backend=AttnBackend.auto)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size"):
        assert type(getattr(cfg, name)) is int, name
    out = TransformerBlock(cfg, get_gpt_layer_local_spec()).to(DEVICE)(torch.randn(S, B, H, device=DEVICE), None)
    assert out.shape == (S, B, H)


def test_mask_helpers_check_their_arguments():
    from fusedlib.transformer.utils import get_default_causal_mask, get_sliding_window_causal_mask
    for bad, error in ((3.0, TypeError), ("3", TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="sq must be an int >= 0"):
            get_default_causal_mask(bad, device=DEVICE)
    with pytest.raises(ValueError, match="skv must be an int >= 0"):
        get_sliding_window_causal_mask(4, -2, (1, 0), device=DEVICE)
    with pytest.raises(ValueError, match="window_size must be a pair .* got None"):
        get_sliding_window_causal_mask(4, 4, None, device=DEVICE)
    assert torch.equal(get_default_causal_mask(np.int64(3), device=DEVICE), get_default_causal_mask(3, device=DEVICE))


@pytest.mark.parametrize("bad, exc", [("1", TypeError), (1.0, TypeError), (True, TypeError), (0, ValueError),
                                      (-2, ValueError)])
def test_layer_number_must_be_an_int_from_one(bad, exc):
    # a str once failed in max(1, "1") naming neither module nor argument; 0 and negatives
    # were taken (a negative number then indexed window_attn_skip_freq from its end)
    cfg = make_config()
    with pytest.raises(exc, match=r"TransformerLayer: layer_number must be an int >= 1"):
        TransformerLayer(cfg, get_gpt_layer_local_spec().submodules, layer_number=bad)
    with pytest.raises(exc, match=r"DotProductAttention: layer_number must be an int >= 1"):
        DotProductAttention(cfg, layer_number=bad, attn_mask_type=AttnMaskType.causal, attention_type="self")
    layer = TransformerLayer(cfg, get_gpt_layer_local_spec().submodules, layer_number=np.int64(2))
    assert type(layer.layer_number) is int and layer.self_attention.core_attention.layer_number == 2


def test_layer_number_beyond_the_window_list_is_named():
    cfg = make_config(window_size=(4, 0), window_attn_skip_freq=[1, 0])
    assert DotProductAttention(cfg, 1, AttnMaskType.causal, "self").window_size == (4, 0)
    assert DotProductAttention(cfg, 2, AttnMaskType.causal, "self").window_size is None
    with pytest.raises(ValueError, match=r"layer_number 3 has no entry in window_attn_skip_freq"):
        DotProductAttention(cfg, 3, AttnMaskType.causal, "self")


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.unfused, AttnBackend.fused, AttnBackend.flash])
def test_core_attention_refuses_mixed_dtypes_and_devices_on_every_backend(backend):
    # the materialised paths failed in baddbmm ("expected scalar type Float but found Half") or
    # read a key or query on meta as unwritten memory: a context of garbage, no error
    attn = DotProductAttention(make_config(attention_backend=backend), 1, AttnMaskType.causal, "self")
    hn = H // NP
    q = torch.randn(S, B, NP, hn, device=DEVICE)
    kv = torch.randn(S, B, NG, hn, device=DEVICE)
    with pytest.raises(TypeError, match="query, key and value must have one floating dtype .* got float32, "
                                        "float16, float32"):
        attn(q, kv.half(), kv, None)
    with pytest.raises(TypeError, match="got int64, int64, int64"):
        attn(q.long(), kv.long(), kv.long(), None)
    for meta in ("query", "key", "value"):
        args = [t.to("meta") if name == meta else t for name, t in (("query", q), ("key", kv), ("value", kv))]
        with pytest.raises(ValueError, match="query, key and value must be on one device"):
            attn(*args, None)


# ---------------------------------------------------------------------------------------------
# The config's derived init, the block's final norm and recomputation chunks, the layer's dropout
# and cross-attention arguments (each was a mutation no test caught)
# ---------------------------------------------------------------------------------------------


def test_config_output_layer_init_uses_init_method_std_not_the_embeddings():
    c = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, init_method_std=0.02,
                          embedding_init_method_std=1.0)
    assert c.output_layer_init_method.keywords["std"] == pytest.approx(0.02 / math.sqrt(2 * 4), rel=1e-15)
    assert c.embedding_init_method.keywords["std"] == 1.0


@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_config_flash_with_float64_params_is_accepted_when_the_model_runs_in_half(half):
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=8, params_dtype=torch.float64,
              attention_backend=AttnBackend.flash)
    assert TransformerConfig(**kw, **{half: True}).attention_backend is AttnBackend.flash
    with pytest.raises(ValueError, match="attention_backend flash runs float16, bfloat16 or float32"):
        TransformerConfig(**kw)


def test_block_final_norm_is_config_eps_in_eval_and_post_layer_norm_false_drops_it():
    torch.manual_seed(0)
    cfg = make_config(torch.float64, layernorm_epsilon=0.5, attention_backend=AttnBackend.unfused)
    spec = get_gpt_layer_unfused_spec()
    block = randomize(TransformerBlock(cfg, spec)).eval()
    bare = TransformerBlock(cfg, spec, post_layer_norm=False).eval()
    assert bare.final_layernorm is None
    state = {k: v for k, v in block.state_dict().items() if not k.startswith("final_layernorm")}
    missing, unexpected = bare.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    x = hidden(torch.float64, requires_grad=False)
    with torch.no_grad():
        y, z = block(x, None), bare(x, None)
    sd = block.state_dict()
    ref = F.layer_norm(z, (H,), sd["final_layernorm.weight"], sd.get("final_layernorm.bias"), eps=0.5)
    torch.testing.assert_close(y, ref, atol=1e-13, rtol=0)
    assert not torch.allclose(y, z)


@pytest.mark.parametrize("method, n, layers, calls", [("uniform", 2, 4, 2), ("uniform", 3, 4, 2),
                                                     ("uniform", 4, 4, 1), ("block", 2, 4, 2)])
def test_full_recomputation_checkpoints_chunks_of_recompute_num_layers(monkeypatch, method, n, layers, calls):
    seen = []

    def counting(fn, *args):
        seen.append(fn)
        return real(fn, *args)

    real = block_module.tensor_parallel_checkpoint
    monkeypatch.setattr(block_module, "tensor_parallel_checkpoint", counting)
    cfg = make_config(num_layers=layers, recompute_granularity="full", recompute_method=method,
                      recompute_num_layers=n)
    torch.manual_seed(0)
    block = randomize(TransformerBlock(cfg, get_gpt_layer_unfused_spec())).train()
    plain = TransformerBlock(make_config(num_layers=layers), get_gpt_layer_unfused_spec()).train()
    plain.load_state_dict(block.state_dict())
    x = hidden()
    y = block(x, None)
    y.sum().backward()
    assert len(seen) == calls
    assert torch.equal(y, plain(x, None))  # every layer ran, once per chunk


def test_layer_hidden_dropout_override_replaces_the_configs():
    torch.manual_seed(0)
    cfg = make_config(hidden_dropout=0.5, attention_dropout=0.0)
    layer = TransformerLayer(cfg, get_gpt_layer_unfused_spec().submodules, hidden_dropout=0.0)
    assert layer.hidden_dropout == 0.0
    x = hidden(requires_grad=False)
    with torch.no_grad():
        train_out = layer.train()(x)[0]
        eval_out = layer.eval()(x)[0]
    assert torch.equal(train_out, eval_out)


def test_cross_attention_gets_the_context_mask_and_its_bda_the_dropout():
    cfg = make_config(torch.float64, num_query_groups=4, hidden_dropout=0.25, attention_backend=AttnBackend.unfused)
    subs = _decoder_layer_submodules(AttnMaskType.padding)
    layer = TransformerLayer(cfg, subs, layer_number=1).train()
    masks, probs = [], []
    layer.cross_attention.register_forward_pre_hook(
        lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    real_bda = layer.cross_attn_bda

    def spy(training, fused):
        f = real_bda(training, fused)
        return lambda out, res, p: (probs.append(p), f(out, res, p))[1]

    layer.cross_attn_bda = spy
    x, ctx = hidden(torch.float64), hidden(torch.float64, s=5)
    context_mask = torch.zeros(1, 1, x.shape[0], 5, device=DEVICE, dtype=torch.bool)
    context_mask[..., -2:] = True
    layer(x, None, context=ctx, context_mask=context_mask)
    assert len(masks) == 1 and masks[0] is context_mask and probs == [0.25]


# ---------------------------------------------------------------------------------------------
# Masks without causal, masks of fewer dims, on every backend (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.fused, AttnBackend.flash])
def test_a_padding_mask_without_causal_masks_only_what_it_says(backend):
    # bidirectional attention (mask type padding) with a caller's key-padding mask: every backend
    # attends to every unmasked key, later ones included (no causal mask slips in)
    q, k, v = _attention_inputs(torch.float32, ng=NP)
    mask = torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool)
    mask[0, ..., 1:3] = True
    mask[1, 0, 2, :] = True  # a row with every key masked: zeros
    keep = R.keep_mask(S, S, False, None, device=DEVICE) & ~mask
    ref = R.attention(*(t.double() for t in (q, k, v)), keep, 1 / math.sqrt(H // NP))
    attn = DotProductAttention(make_config(num_query_groups=NP, attention_backend=backend), 1,
                               AttnMaskType.padding, "self")
    out = attn(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.all(out[2, 1] == 0)


@pytest.mark.parametrize("shape", [(S, S), (1, S, S)], ids=["2d", "3d"])
def test_a_mask_of_fewer_dims_is_broadcast_alike_on_every_backend(shape):
    # a mask broadcastable to [b, np, sq, sk] with fewer dims ([sq, sk], [1, sq, sk]): every backend
    # reads it as its trailing dims, as the float64 reference does
    q, k, v = _attention_inputs(torch.float32, ng=NP)
    mask = torch.zeros(shape, device=DEVICE, dtype=torch.bool)
    mask[..., 3, 1:3] = True
    keep = R.keep_mask(S, S, True, None, device=DEVICE) & ~mask
    ref = R.attention(*(t.double() for t in (q, k, v)), keep, 1 / math.sqrt(H // NP))
    for backend in (AttnBackend.local, AttnBackend.fused, AttnBackend.flash):
        attn = DotProductAttention(make_config(num_query_groups=NP, attention_backend=backend), 1,
                                   AttnMaskType.causal, "self")
        torch.testing.assert_close(attn(q, k, v, mask).double(), ref, atol=1e-5, rtol=0,
                                   msg=lambda m, b=backend: f"{b}: {m}")


_FUSION_SWITCHES = ("bias_activation_fusion", "gemm_gelu_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                    "apply_rope_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
                    "cross_entropy_loss_fusion")


def _every_fusion_on(**kw):
    return make_config(num_layers=1, gated_linear_unit=False, activation_func=F.gelu,
                       attention_backend=AttnBackend.flash, **{name: True for name in _FUSION_SWITCHES}, **kw)


def test_without_fusions_turns_every_switch_off_and_keeps_the_rest():
    from fusedlib.models.gpt.gpt_layer_specs import without_fusions

    cfg = _every_fusion_on()
    off = without_fusions(cfg)
    assert {name: getattr(off, name) for name in _FUSION_SWITCHES} == dict.fromkeys(_FUSION_SWITCHES, False)
    assert off.attention_backend == AttnBackend.unfused
    changed = set(_FUSION_SWITCHES) | {"attention_backend"}
    assert all(getattr(off, f.name) == getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in changed)


def test_unfused_spec_ignores_the_configs_fusion_switches(monkeypatch):
    # the baseline the fused layer is measured against: every submodule built from
    # without_fusions(config), both bias-dropout-adds PyTorch's even with bias_dropout_fusion on
    from fusedlib.fusions import fused_bias_dropout
    from fusedlib.models.gpt.gpt_layer_specs import get_bias_dropout_add_unfused

    subs = get_gpt_layer_unfused_spec(qk_layernorm=True).submodules
    assert subs.self_attn_bda is get_bias_dropout_add_unfused and subs.mlp_bda is get_bias_dropout_add_unfused
    cfg = _every_fusion_on()
    layer = TransformerLayer(cfg, subs).to(DEVICE)
    for name, module in layer.named_modules():
        if module is layer or not isinstance(getattr(module, "config", None), TransformerConfig):
            continue
        switches = {s: getattr(module.config, s) for s in _FUSION_SWITCHES}
        assert switches == dict.fromkeys(_FUSION_SWITCHES, False), name
        assert module.config.attention_backend == AttnBackend.unfused, name
    spy = Spy(monkeypatch, fused_bias_dropout, "_bias_dropout_add_func")
    for training in (True, False):
        assert get_bias_dropout_add_unfused(training, True).__qualname__.startswith("bias_dropout_add_unfused.")
        layer.train(training)
        with torch.no_grad():
            layer(hidden(requires_grad=False), None)
    assert len(spy.calls) == 4  # the attention's and the MLP's, in each mode


@pytest.mark.parametrize("kw", [dict(num_experts=4), dict(moe_grouped_gemm=True), dict(multi_latent_attention=True),
                                dict(fp8="e4m3"), dict(moe_use_legacy_grouped_gemm=True), dict(qk_l2_norm=True),
                                dict(use_kitchen=True), dict(use_kitchen_attention=True)],
                         ids=lambda kw: next(iter(kw)))
def test_local_spec_refuses_every_left_out_feature(kw):
    name = next(iter(kw))
    with pytest.raises(NotImplementedError, match=rf"get_gpt_layer_\*_spec: {name}=.* is left out of fusedlib"):
        get_gpt_layer_local_spec(**kw)
