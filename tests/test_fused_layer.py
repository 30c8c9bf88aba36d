"""FusedTransformerLayer: a GPT layer's training step as one autograd node.

The oracle is :class:`TransformerLayer` itself: the one-node layer calls the same fused ops'
Function forwards and backwards in the same order, with the Philox keys drawn in the same order,
so with the same seed its outputs and gradients must be the module path's bit for bit, dropout
on, in fp32 and bf16; and against the float64 block of ``transformer_reference`` (dropout 0) it
must be as accurate as the unfused block. Most tests run with the three attentions the layer takes
(the ``backend`` fixture): FlashAttention, the materialised path (``local``) and torch's SDPA
(``auto``). Sizes are small
and odd (s = 7, h = 24, 4 heads of hn = 6, ffn = 20); on a CPU the kernels run in Triton's
interpreter.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fractions
import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_reference as R
from fusedlib.fusions import fused_dense, fused_layer_norm, fused_softmax
from fusedlib.fusions.fused_bias_dropout import get_bias_dropout_add
from fusedlib.models.gpt import get_gpt_fused_layer_spec, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from fusedlib.transformer import AttnBackend, AttnMaskType, ModuleSpec, TransformerConfig
from fusedlib.transformer.fused_layer import FusedTransformerLayer, FusedTransformerLayerFunction
from fusedlib.transformer.transformer_block import TransformerBlock
from fusedlib.transformer.transformer_layer import TransformerLayer

from conftest import DEVICE, deterministic_sdpa  # noqa: I001
from test_transformer import U, assert_as_accurate, hidden, randomize, tensor_errors

S, B, H, NP, FFN = 7, 2, 24, 4, 20  # hn = 6
FUSED = dict(bias_activation_fusion=True, gemm_gelu_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
             persist_layer_norm=True, attention_backend=AttnBackend.flash)


def pinned(backend: AttnBackend):
    """conftest's ``deterministic_sdpa`` for an SDPA backend: the module path's and the one
    node's runs compare bit for bit."""
    return deterministic_sdpa(backend in (AttnBackend.auto, AttnBackend.fused))


@pytest.fixture(params=[AttnBackend.flash, AttnBackend.local, AttnBackend.auto], ids=["flash", "local", "sdpa"])
def backend(request):
    """The attention backends the one-node layer takes: FlashAttention, the materialised path, SDPA
    (:func:`pinned` for the test's length)."""
    with pinned(request.param):
        yield request.param


def make_config(dtype=torch.float32, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=NP, ffn_hidden_size=FFN, hidden_dropout=0.2,
                attention_dropout=0.15, activation_func=F.gelu, add_bias_linear=True, params_dtype=dtype,
                bf16=dtype is torch.bfloat16, use_cpu_initialization=DEVICE.type == "cpu", **FUSED)
    base.update(kw)
    return TransformerConfig(**base)


def fused_spec(qk_layernorm: bool = False) -> ModuleSpec:
    if not qk_layernorm:
        return get_gpt_fused_layer_spec()
    return ModuleSpec(FusedTransformerLayer, submodules=get_gpt_layer_local_spec(qk_layernorm=qk_layernorm).submodules)


def blocks(cfg: TransformerConfig) -> tuple[TransformerBlock, TransformerBlock]:
    """(the local spec's block with random parameters, the one-node block with the same state)."""
    module = randomize(TransformerBlock(cfg, get_gpt_layer_local_spec()).to(DEVICE))
    one = TransformerBlock(cfg, fused_spec()).to(DEVICE)
    one.load_state_dict(module.state_dict())
    return module.train(), one.train()


def step(block, x, seed, g=None, frozen=()):
    """(output, input gradient or None, parameter gradients by name) of one step from ``seed``."""
    for name, p in block.named_parameters():
        p.grad = None
        p.requires_grad_(name not in frozen)
    x = x.detach().clone().requires_grad_("x" not in frozen)
    torch.manual_seed(seed)
    y = block(x, None)
    y.backward(torch.ones_like(y) + y.detach() if g is None else g)  # a gradient that is not uniform
    return y, x.grad, {n: p.grad for n, p in block.named_parameters()}


def assert_same_bits(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, equal_nan=True)
    if a[1] is None or b[1] is None:
        assert a[1] is None and b[1] is None
    else:
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0, equal_nan=True)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        if a[2][name] is None or b[2][name] is None:
            assert a[2][name] is None and b[2][name] is None, name
        else:
            torch.testing.assert_close(a[2][name], b[2][name], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# The same results as TransformerLayer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_one_node_equals_the_layer_bit_for_bit_with_dropout(normalization, dtype, zero_centered_gamma, backend, seed):
    cfg = make_config(dtype, normalization=normalization, layernorm_zero_centered_gamma=zero_centered_gamma,
                      fp16=dtype is torch.float16, attention_backend=backend)
    module, one = blocks(cfg)
    x = hidden(dtype)  # [s, b, h], not contiguous
    x_before = x.detach().clone()
    assert all(layer.fused_path_applies(x) for layer in one.layers)
    got = step(one, x, seed)
    assert_same_bits(got, step(module, x, seed))
    assert torch.equal(x.detach(), x_before)  # the input is never modified
    assert got[0].dtype == dtype and got[0].shape == (S, B, H)


def test_one_node_path_runs_and_the_submodules_do_not(monkeypatch, backend, seed):
    module, one = blocks(make_config(attention_backend=backend))
    calls = []
    for name in ("forward",):
        for cls in {type(m) for m in one.layers[0].modules()} - {FusedTransformerLayer, TransformerLayer}:
            original = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda self, *a, _o=original, **k: (calls.append(type(self).__name__),
                                                                                _o(self, *a, **k))[1])
    applied = []
    original_apply = FusedTransformerLayerFunction.apply
    monkeypatch.setattr(FusedTransformerLayerFunction, "apply",
                        lambda *a: (applied.append(1), original_apply(*a))[1])
    x = hidden()
    out, _ = one.layers[0](x)
    assert type(out.grad_fn).__name__ == "FusedTransformerLayerFunctionBackward"
    assert applied == [1] and calls == []  # no submodule's forward ran
    assert one.layers[0].fused_path_applies(x)


def test_as_accurate_as_the_unfused_block_against_float64(backend, seed):
    # dropout 0: the one-node block and the unfused block against the float64 block (as
    # test_transformer's every-fusion-on check; GeLU's tanh form in the unfused block and the reference)
    for dtype in (torch.float32, torch.bfloat16):
        cfg = make_config(dtype, hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend)
        _, one = blocks(cfg)
        tanh_gelu = functools.partial(F.gelu, approximate="tanh")
        plain_cfg = make_config(dtype, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                                gemm_gelu_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                                persist_layer_norm=False, attention_backend=AttnBackend.local,
                                activation_func=tanh_gelu)
        plain = TransformerBlock(plain_cfg, get_gpt_layer_unfused_spec()).to(DEVICE)
        plain.load_state_dict(one.state_dict())
        x = hidden(dtype)
        g = torch.randn(S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
        sd = {k: v.detach().double().requires_grad_(True) for k, v in one.state_dict().items()
              if isinstance(v, torch.Tensor)}
        x64 = x.detach().double().requires_grad_(True)
        y64 = R.block(x64, sd, cfg, act=tanh_gelu)
        y64.backward(g.double())
        refs = {"y": y64.detach(), "dx": x64.grad, **{n: sd[n].grad for n in sd}}
        errors = {}
        for name, block in (("one node", one), ("plain", plain)):
            y, dx, grads = step(block, x, 0, g)
            errors[name] = tensor_errors({"y": y, "dx": dx, **grads}, refs, dtype)
        agg = assert_as_accurate(errors, "plain", dtype)
        assert agg["one node"] <= 64 * U[dtype]


@pytest.mark.parametrize("frozen", [
    {"x"},
    {"layers.0.input_layernorm.weight", "layers.0.input_layernorm.bias", "layers.0.self_attention.linear_qkv.weight"},
    "all but layers.1.pre_mlp_layernorm.weight",
    "all but layers.0.mlp.linear_fc2.bias",
    "all but layers.0.self_attention.linear_proj.weight",
])
def test_frozen_inputs_get_no_gradient_and_the_rest_are_the_layers(frozen, backend, seed):
    module, one = blocks(make_config(attention_backend=backend))
    if isinstance(frozen, str):
        keep = frozen.removeprefix("all but ")
        frozen = {"x", *(n for n, _ in one.named_parameters() if n != keep)}
    x = hidden()
    got, want = step(one, x, seed, frozen=frozen), step(module, x, seed, frozen=frozen)
    assert_same_bits(got, want)
    assert all((g is None) == (n in frozen) for n, g in got[2].items())


def test_state_dict_and_parameters_are_the_layers():
    module, one = blocks(make_config())
    assert list(module.state_dict()) == list(one.state_dict())
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in one.named_parameters()]
    assert all(isinstance(layer, FusedTransformerLayer) for layer in one.layers)


def test_a_double_backward_raises(backend):
    _, one = blocks(make_config(hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend))
    x = hidden()
    out, _ = one.layers[0](x)
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|backward"):
        gx.sum().backward()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="peak memory is measured on a CUDA device")
@pytest.mark.parametrize("backend", [AttnBackend.flash, AttnBackend.local, AttnBackend.auto],
                         ids=["flash", "local", "sdpa"])  # (no bits compared: SDPA's fused kernels, below)
def test_peak_memory_of_a_step_is_the_layers(backend, seed):
    # the backward releases each op's saved tensors after its backward, as autograd frees a
    # node's: at this size a step's peak is the module path's (a few allocator blocks of slack,
    # less than one [s, b, h] tensor, 8 MiB here). (The node's incoming gradient, which autograd
    # holds until the node's backward returns, is one [s, b, h] more where a step's peak falls in
    # the attention's backward: the materialised block at chapter 7's headline size, not here.)
    cfg = make_config(torch.bfloat16, num_layers=3, hidden_size=512, num_attention_heads=4, ffn_hidden_size=1024,
                      attention_backend=backend)
    module, one = blocks(cfg)
    x = torch.randn(1024, 8, 512, device=DEVICE, dtype=torch.bfloat16)
    peaks = []
    # SDPA: one of torch's fused kernels, never its math one, whose materialised scores would put
    # the step's peak in the attention's backward, where the node holds one [s, b, h] more
    fused_sdpa = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    with fused_sdpa if backend is AttnBackend.auto else contextlib.nullcontext():
        for block in (module, one, module, one):
            step(block, x, seed)  # warm: kernels compiled, gradients allocated once
            for p in block.parameters():
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(block, x, seed)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
    assert max(peaks[1], peaks[3]) <= min(peaks[0], peaks[2]) + 4 * 2**20, peaks


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_the_layers_capture_in_cuda_graphs_and_replay_the_eager_steps(backend):
    # cuda_graph_impl="local": the one-node layers inside the manager's graphs give the eager
    # one-node block's steps bit for bit (the Philox keys drawn on the device, in the same order)
    cfg = make_config(torch.bfloat16, attention_backend=backend)
    _, eager = blocks(cfg)
    graphed = TransformerBlock(dataclasses.replace(cfg, cuda_graph_impl="local"), fused_spec()).to(DEVICE).train()
    graphed.load_state_dict(eager.state_dict())
    x = hidden(torch.bfloat16).contiguous()
    runs = []
    for block in (eager, graphed):
        runs.append([step(block, x, 5 + i) for i in range(3)])
    for a, b in zip(*runs):
        assert_same_bits(a, b)
    assert graphed.cudagraph_manager.captures == 1


def test_a_second_backward_after_one_that_released_the_graph_raises_naming_retain_graph(backend):
    _, one = blocks(make_config(attention_backend=backend))
    out, _ = one.layers[0](hidden())
    node = out.grad_fn
    assert type(node).__name__ == "FusedTransformerLayerFunctionBackward" and node.ops is not None
    out.sum().backward(retain_graph=True)
    assert node.ops is not None and node.core is not None  # kept for the next backward
    out.sum().backward()
    assert node.ops is None and node.core is None and node.y1 is None  # an ordinary backward releases them
    with pytest.raises(RuntimeError, match="^FusedTransformerLayer: a second backward .*retain_graph=True keeps it"):
        out.sum().backward()


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_backward_that_retains_the_graph_keeps_it_as_the_module_path_does(how, backend, seed):
    # retain_graph=True: the node keeps every op's saved tensors (as autograd keeps each node's),
    # so the next backward gives the same gradients again, bit for bit the module path's; the
    # backward that does not retain the graph releases them, and one more raises
    module, one = blocks(make_config(attention_backend=backend))
    x = hidden()
    grads = []
    for block in (module, one):
        for p in block.parameters():
            p.grad = None
        torch.manual_seed(seed)
        y = block(x, None)
        g = torch.ones_like(y) + y.detach()
        params = list(block.parameters())
        if how == "backward":
            y.backward(g, retain_graph=True)
            first = [p.grad.clone() for p in params]
            y.backward(g, retain_graph=True)
            y.backward(g)
            grads.append((first, [p.grad for p in params]))
        else:
            first = torch.autograd.grad(y, params, g, retain_graph=True)
            grads.append((first, torch.autograd.grad(y, params, g)))
        with pytest.raises(RuntimeError, match="retain_graph|second time"):
            y.backward(g)
    (first_m, last_m), (first_o, last_o) = grads
    for a, b_, c, d in zip(first_m, first_o, last_m, last_o):
        torch.testing.assert_close(b_, a, rtol=0, atol=0)
        torch.testing.assert_close(d, c, rtol=0, atol=0)
        if how == "backward":  # three equal backwards accumulated: 3 · the first (exact for these sums)
            torch.testing.assert_close(d, a + a + a, rtol=0, atol=0)
        else:
            torch.testing.assert_close(d, a, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Where the one-node path does not apply, the layer's forward runs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["eval", "no_grad", "mask", "hook", "rotary"])
def test_other_calls_take_the_layers_forward_with_its_results(case, backend, seed):
    module, one = blocks(make_config(attention_backend=backend))
    layer, ref = one.layers[0], module.layers[0]
    x = hidden()
    kwargs = {}
    hooked = []
    if case == "eval":
        layer.eval(), ref.eval()
    if case == "mask":  # padding: sample 1's last two keys masked, with the causal mask
        kwargs["attention_mask"] = torch.zeros(B, 1, S, S, dtype=torch.bool, device=DEVICE)
        kwargs["attention_mask"][1, ..., -2:] = True
    if case == "hook":
        layer.mlp.linear_fc1.register_forward_hook(lambda m, i, o: hooked.append(1))
    if case == "rotary":
        kwargs["rotary_pos_emb"] = torch.randn(S, 1, 1, H // NP, device=DEVICE)
    with torch.no_grad() if case == "no_grad" else torch.enable_grad():
        assert not layer.fused_path_applies(x, **kwargs)
    results = []
    for lay in (layer, ref):
        torch.manual_seed(seed)
        if case == "no_grad":
            with torch.no_grad():
                results.append(lay(x, **kwargs)[0])
        else:
            out, _ = lay(x, **kwargs)
            assert out.grad_fn is None or type(out.grad_fn).__name__ != "FusedTransformerLayerFunctionBackward"
            results.append(out)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    if case == "hook":
        assert hooked == [1]  # the hook ran: the layer took the module path


def _checkpoint_layer(layer, x):
    return torch.utils.checkpoint.checkpoint(lambda t: layer(t)[0], x, use_reentrant=False)


class _SoftmaxWithoutKernel(fused_softmax.FusedScaleMaskSoftmax):
    """A softmax module of another type: Megatron-core's kernel-availability rule says no here."""

    def is_kernel_available(self, mask, b, np, sq, sk):
        return False


# Changes after the build, and call conditions, where the module path computes something else or
# checks something: the one-node path must step aside (or follow the change) and give the
# module path's results or its error. Each is applied to both layers alike.
AFTER_BUILD = {
    "attention in eval": lambda layer: layer.self_attention.core_attention.eval(),
    # the layer's own flag alone: its bias-dropout-adds read it (no hidden dropout), its submodules train
    "the layer alone in eval": lambda layer: setattr(layer, "training", False),
    "post-norm residual": lambda layer: setattr(layer.config, "apply_residual_connection_post_layernorm", True),
    "bias-dropout fusion off": lambda layer: setattr(layer.config, "bias_dropout_fusion", False),
    "the other backend": lambda layer: setattr(layer.config, "attention_backend", (
        AttnBackend.flash if layer.config.attention_backend == AttnBackend.local else AttnBackend.local)),
    "masked softmax fusion off": lambda layer: setattr(layer.config, "masked_softmax_fusion", False),
    "softmax flag bf16": lambda layer: setattr(layer.self_attention.core_attention.scale_mask_softmax,
                                               "input_in_bf16", True),
    "softmax window": lambda layer: setattr(layer.self_attention.core_attention.scale_mask_softmax, "window_size",
                                            (2, 0)),
    "attention dropout 0, softmax kernel off": lambda layer: (
        setattr(layer.self_attention.core_attention.attention_dropout, "p", 0.0),
        setattr(layer.self_attention.core_attention.scale_mask_softmax, "scaled_masked_softmax_fusion", False)),
    # with dropout 0 the module path runs the softmax module itself: its window and mask type count
    "attention dropout 0, softmax window": lambda layer: (
        setattr(layer.self_attention.core_attention.attention_dropout, "p", 0.0),
        setattr(layer.self_attention.core_attention.scale_mask_softmax, "window_size", (2, 0))),
    "attention dropout 0, softmax mask type padding": lambda layer: (
        setattr(layer.self_attention.core_attention.attention_dropout, "p", 0.0),
        setattr(layer.self_attention.core_attention.scale_mask_softmax, "attn_mask_type", AttnMaskType.padding)),
    "attention dropout 0, a softmax subclass without the kernel": lambda layer: (
        setattr(layer.self_attention.core_attention.attention_dropout, "p", 0.0),
        setattr(layer.self_attention.core_attention.scale_mask_softmax, "__class__", _SoftmaxWithoutKernel)),
    "softmax_in_fp32 None": lambda layer: setattr(layer.config, "attention_softmax_in_fp32", None),
    "memory-efficient norms": lambda layer: setattr(layer.config, "memory_efficient_layer_norm", True),
    "mlp norm eps": lambda layer: setattr(layer.pre_mlp_layernorm, "eps", 0.5),
    "mlp norm zero-centered": lambda layer: setattr(layer.pre_mlp_layernorm, "zero_centered_gamma", True),
    "non-causal mask type": lambda layer: setattr(layer.self_attention.core_attention, "attn_mask_type",
                                                   AttnMaskType.no_mask),
    "hook on a new mlp": lambda layer: (setattr(layer, "mlp", copy.deepcopy(layer.mlp)),
                                        layer.mlp.linear_fc1.register_forward_hook(lambda m, i, o: o * 2)),
    "softmax scale nan": lambda layer: setattr(layer.self_attention.core_attention, "softmax_scale", float("nan")),
    # (SDPA's module path takes an explicit causal mask for a scale <= 0: torch's is_causal kernels
    # give NaN there; on the CPU its math kernel, taken with dropout, does not)
    "softmax scale negative": lambda layer: setattr(layer.self_attention.core_attention, "softmax_scale", -0.75),
    "attention dropout 0, softmax scale negative": lambda layer: (
        setattr(layer.self_attention.core_attention.attention_dropout, "p", 0.0),
        setattr(layer.self_attention.core_attention, "softmax_scale", -0.75)),
    "attention dropout negative": lambda layer: setattr(layer.self_attention.core_attention.attention_dropout, "p",
                                                        -0.5),
    # (SDPA's module path hands the module's value to torch, which refuses a Fraction by its type)
    "attention dropout a Fraction": lambda layer: setattr(layer.self_attention.core_attention.attention_dropout,
                                                          "p", fractions.Fraction(3, 20)),
    "deterministic_mode a str": lambda layer: setattr(layer.config, "deterministic_mode", "yes"),
    "fc1 weight bf16": lambda layer: setattr(layer.mlp.linear_fc1, "weight",
                                             torch.nn.Parameter(layer.mlp.linear_fc1.weight.detach().bfloat16())),
    "fc1 bias None": lambda layer: setattr(layer.mlp.linear_fc1, "bias", None),
    # (the module path's SelfAttention drops a QKV bias that its linear layer returns instead of adding)
    "qkv skip_bias_add": lambda layer: setattr(layer.self_attention.linear_qkv, "skip_bias_add", True),
    "mlp bias-dropout-add unfused": lambda layer: setattr(
        layer, "mlp_bda", lambda training, fused: get_bias_dropout_add(training, False)),
    # norms of two kinds: an RMSNorm before the attention, a LayerNorm without its bias before the MLP
    "norms of two kinds": lambda layer: (
        setattr(layer, "input_layernorm", fused_layer_norm.FusedRMSNorm(
            dataclasses.replace(layer.config, normalization="RMSNorm"), H, eps=layer.input_layernorm.eps).to(DEVICE)),
        setattr(layer.pre_mlp_layernorm, "bias", None)),
    "projection weight bf16": lambda layer: setattr(layer.self_attention.linear_proj, "weight", torch.nn.Parameter(
        layer.self_attention.linear_proj.weight.detach().bfloat16())),
    "float64 layer": lambda layer: layer.double(),
}


def _outcome(layer, x, case, seed):
    torch.manual_seed(seed)
    try:
        if case == "autocast":
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                out, _ = layer(x)
        elif case == "checkpointed":
            out = _checkpoint_layer(layer, x)
        elif case == "forward AD":
            with fwAD.dual_level():
                out, _ = layer(fwAD.make_dual(x, torch.ones_like(x)))
        else:
            out, _ = layer(x)
        out.backward(torch.ones_like(out))
    except (TypeError, ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {str(err).replace('FusedTransformerLayer', 'TransformerLayer')}"
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("case", [*AFTER_BUILD, "autocast", "checkpointed", "forward AD"])
def test_after_the_build_the_layer_follows_what_the_module_path_does(case, backend, seed):
    module, one = blocks(make_config(num_layers=1, attention_backend=backend))
    layer, ref = one.layers[0], module.layers[0]
    if case in AFTER_BUILD:
        for lay in (layer, ref):  # (a config change reaches both: the two blocks share their config)
            AFTER_BUILD[case](lay)
    x = hidden()
    got = _outcome(layer, x.detach().clone().requires_grad_(True), case, seed)
    want = _outcome(ref, x.detach().clone().requires_grad_(True), case, seed)
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str), got
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("what", ["x", "fc1 weight", "input norm weight", "mlp norm bias", "qkv weight"])
def test_an_input_changed_in_place_before_the_backward_raises_as_for_the_module_path(what, backend):
    for block in blocks(make_config(num_layers=1, attention_backend=backend)):
        layer = block.layers[0]
        x = hidden()
        out, _ = layer(x)
        tensor = {"x": x, "fc1 weight": layer.mlp.linear_fc1.weight,
                  "input norm weight": layer.input_layernorm.weight, "mlp norm bias": layer.pre_mlp_layernorm.bias,
                  "qkv weight": layer.self_attention.linear_qkv.weight}[what]
        with torch.no_grad():
            tensor.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_conditions_of_a_call_that_the_path_steps_aside_for():
    _, one = blocks(make_config(num_layers=1))
    layer = one.layers[0]
    x = hidden()
    assert layer.fused_path_applies(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not layer.fused_path_applies(x)  # checkpointing and offloading reach the module path's tensors
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert not layer.fused_path_applies(x)
    with torch.inference_mode():
        x_inference = torch.randn(S, B, H, device=DEVICE)
    assert not layer.fused_path_applies(x_inference)
    with pytest.raises(ValueError, match="FusedTransformerLayer: hidden_states"):
        layer([1.0])


def test_global_module_hooks_do_not_stop_the_build_and_run_at_the_call(seed):
    # a tool that registers PyTorch's global module hooks (FlopCounterMode, profilers) while the
    # model is built: the layer builds; its calls under such hooks take the module path, hooks run
    # (the module path's own route under them: the MLP's GEMM epilogues step aside for hooks too)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        module, one = blocks(make_config(num_layers=1))
        x = hidden()
        assert not one.layers[0].fused_path_applies(x)
        got, want = step(one, x, seed), step(module, x, seed)
        assert "MLP" in seen
    finally:
        handle.remove()
    assert_same_bits(got, want)
    assert one.layers[0].fused_path_applies(x)
    assert_same_bits(step(one, x, seed), step(module, x, seed))


def test_sequence_parallel_on_one_rank_is_taken(backend, seed):
    module, one = blocks(make_config(sequence_parallel=True, attention_backend=backend))
    x = hidden()
    assert all(layer.fused_path_applies(x) for layer in one.layers)
    assert_same_bits(step(one, x, seed), step(module, x, seed))


# ---------------------------------------------------------------------------------------------
# The layers it refuses to build
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, spec, match", [
    (dict(attention_backend=AttnBackend.local, masked_softmax_fusion=False), None, "masked_softmax_fusion"),
    (dict(bias_dropout_fusion=False), None, "bias_dropout_fusion"),
    (dict(gemm_gelu_fusion=False), None, "gemm_gelu_fusion"),
    (dict(recompute_granularity="selective"), None, "recompute_granularity"),
    (dict(fp32_residual_connection=True), None, "fp32_residual_connection"),
    (dict(apply_residual_connection_post_layernorm=True), None, "apply_residual_connection_post_layernorm"),
    (dict(memory_efficient_layer_norm=True), None, "memory_efficient_layer_norm"),
    (dict(num_query_groups=2), None, "grouped-query"),
    (dict(window_size=(3, 0)), None, "sliding window"),
    (dict(), "qk_layernorm", "query/key norms"),
    (dict(), "unfused", "FusedLayerNorm or FusedRMSNorm"),
])
def test_layers_it_does_not_run_are_refused_naming_why(kwargs, spec, match):
    cfg = make_config(**kwargs)
    if spec == "qk_layernorm":
        submodules = get_gpt_layer_local_spec(qk_layernorm=True).submodules
    elif spec == "unfused":
        submodules = get_gpt_layer_unfused_spec().submodules
    else:
        submodules = get_gpt_layer_local_spec().submodules
    with pytest.raises(ValueError, match=match):
        FusedTransformerLayer(cfg, submodules)
    if spec is None:  # the same config builds a TransformerLayer
        TransformerLayer(cfg, submodules)


def test_a_backend_that_is_not_an_attnbackend_is_refused_naming_its_value():
    cfg = make_config(num_layers=1)
    cfg.attention_backend = "auto"  # (a str set after the config's checks)
    with pytest.raises(ValueError, match=r"attention_backend must be an AttnBackend \(flash, auto, fused, local or "
                                         r"unfused\), got 'auto'"):
        FusedTransformerLayer(cfg, get_gpt_layer_local_spec().submodules)


def test_the_gemm_epilogue_path_takes_the_same_route(monkeypatch, backend, seed):
    # where cuBLASLt's epilogues run (CUDA, ffn a multiple of 8), both paths take them
    monkeypatch.setattr(fused_dense, "EPILOGUE_MIN_ELEMENTS", 1)
    cfg = make_config(torch.bfloat16, ffn_hidden_size=32, attention_backend=backend)
    module, one = blocks(cfg)
    x = hidden(torch.bfloat16)
    assert_same_bits(step(one, x, seed), step(module, x, seed))


def test_dropouts_changed_after_the_build_are_read_at_the_call(backend):
    # the path reads the dropouts and the scale from the modules at each call: a layer whose
    # dropout was changed afterwards (a hidden_dropout override) still matches the module path
    # (the materialised path's softmax without dropout: the softmax's own Function)
    module, one = blocks(make_config(attention_backend=backend))
    for block in (module, one):
        for layer in block.layers:
            layer.hidden_dropout = 0.0
            layer.self_attention.core_attention.attention_dropout.p = 0.0
    x = hidden()
    assert_same_bits(step(one, x, 3), step(module, x, 3))
    assert dataclasses.is_dataclass(one.config)


# ---------------------------------------------------------------------------------------------
# The materialised attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dropout", [0.15, 0.0])
def test_the_materialised_path_runs_the_module_paths_kernels(monkeypatch, dropout, seed):
    # the dispatch, not only the numbers: per layer one baddbmm for the scores, the softmax and
    # dropout kernel's Function with dropout (the plain softmax's without), one bmm for the context
    cfg = make_config(attention_backend=AttnBackend.local, attention_dropout=dropout)
    _, one = blocks(cfg)
    calls = []
    for owner, name, label in ((torch, "baddbmm", "baddbmm"), (torch, "bmm", "bmm"),
                               (fused_softmax.ScaledMaskedSoftmaxDropout, "forward", "softmax+dropout"),
                               (fused_softmax._ScaleMaskSoftmaxFunction, "forward", "softmax")):
        def wrapped(*a, _o=getattr(owner, name), _label=label, **k):
            calls.append(_label)
            return _o(*a, **k)
        monkeypatch.setattr(owner, name, staticmethod(wrapped) if isinstance(owner, type) else wrapped)
    out, _ = one.layers[0](hidden())
    assert type(out.grad_fn).__name__ == "FusedTransformerLayerFunctionBackward"
    assert calls == ["baddbmm", "softmax+dropout" if dropout else "softmax", "bmm"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_query_key_layer_scaling_is_the_layers(backend, dtype, seed):
    # the scores at softmax_scale / layer_number, the softmax multiplying back by layer_number
    # (FusedScaleMaskSoftmax's scale): the module path's two scales, each where it applies
    cfg = make_config(dtype, fp16=dtype is torch.float16, apply_query_key_layer_scaling=True, num_layers=3,
                      attention_backend=backend)
    module, one = blocks(cfg)
    assert [layer.self_attention.core_attention.scale_mask_softmax.scale for layer in one.layers] == [1, 2, 3]
    x = hidden(dtype)
    assert all(layer.fused_path_applies(x) for layer in one.layers)
    assert_same_bits(step(one, x, seed), step(module, x, seed))


@pytest.mark.parametrize("backend_", [AttnBackend.local, AttnBackend.auto])
def test_the_other_attentions_take_head_dims_flash_refuses(backend_, seed):
    # hn = 264 > FlashAttention's 256: the flash layer is refused, the materialised and SDPA ones run
    kw = dict(hidden_size=528, num_attention_heads=2, ffn_hidden_size=40, num_layers=1)
    with pytest.raises(ValueError, match="at most 256 with the flash backend"):
        FusedTransformerLayer(make_config(**kw), get_gpt_layer_local_spec().submodules)
    module, one = blocks(make_config(attention_backend=backend_, **kw))
    x = torch.randn(5, 1, 528, device=DEVICE)
    assert one.layers[0].fused_path_applies(x)
    with pinned(backend_):
        assert_same_bits(step(one, x, seed), step(module, x, seed))


def test_the_unfused_backend_is_the_materialised_path(seed):
    # attention_backend "unfused" runs DotProductAttention's materialised path too: taken, bit for bit
    module, one = blocks(make_config(attention_backend=AttnBackend.unfused))
    x = hidden()
    assert all(layer.fused_path_applies(x) for layer in one.layers)
    assert_same_bits(step(one, x, seed), step(module, x, seed))


# ---------------------------------------------------------------------------------------------
# SDPA
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dropout", [0.15, 0.0])
def test_the_sdpa_path_makes_the_module_paths_call_and_runs_torchs_backward(monkeypatch, dropout, seed):
    # the dispatch: per layer one scaled_dot_product_attention call, its arguments (the inputs'
    # shapes and strides, causal, the scale, the dropout) the module path's, its backward torch's
    # own through one autograd.grad
    cfg = make_config(attention_backend=AttnBackend.auto, attention_dropout=dropout)
    module, one = blocks(cfg)
    calls, grads = [], []
    sdpa, grad = F.scaled_dot_product_attention, torch.autograd.grad

    def counted_sdpa(*args, **kw):
        calls[-1].append(([(t.shape, t.stride()) for t in args], kw))
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: (grads.append(1), grad(*a, **k))[1])
    x = hidden()
    for block in (module, one):
        calls.append([])
        torch.manual_seed(seed)
        out, _ = block.layers[0](x)
        out.sum().backward()
    assert type(out.grad_fn).__name__ == "FusedTransformerLayerFunctionBackward"
    assert len(calls[1]) == 1 and calls[1] == calls[0], calls
    dpa = one.layers[0].self_attention.core_attention
    assert calls[1][0][1] == dict(dropout_p=dropout, is_causal=True, scale=dpa.softmax_scale, enable_gqa=False)
    assert grads == [1] and one.layers[0].self_attention.linear_qkv.weight.grad is not None


@pytest.mark.parametrize("dtype, dropout", [(torch.float32, 0.15), (torch.bfloat16, 0.15), (torch.bfloat16, 0.0)])
def test_the_sdpa_graph_keeps_no_more_than_the_module_paths(monkeypatch, dtype, dropout):
    # after the forward, the SDPA call's output and the QKV buffer its inputs view are alive in the
    # one-node block exactly where they are in the module path's. On the CPU: with dropout torch's
    # math kernel, which saves neither the output nor, in bf16, the QKV buffer (it saves float
    # copies; in fp32 it saves v itself, a view of the buffer); without dropout its flash kernel,
    # which saves both. The cases with dropout tell a graph that keeps nothing beyond the module
    # path's from one that keeps q, k, v and the output (detached leaves): by the output in fp32,
    # by both in bf16
    sdpa, alive = F.scaled_dot_product_attention, []

    def spy(q, k, v, **kw):
        o = sdpa(q, k, v, **kw)
        alive.append((StorageWeakRef(o.untyped_storage()), StorageWeakRef(q.untyped_storage())))
        return o

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    module, one = blocks(make_config(dtype, attention_backend=AttnBackend.auto, attention_dropout=dropout))
    x = hidden(dtype).detach().requires_grad_(True)
    kept = []
    with pinned(AttnBackend.auto):
        for block in (module, one):
            alive.clear()
            torch.manual_seed(0)
            y = block(x, None)  # the graph held, its backward not yet run
            kept.append([(not o.expired(), not q.expired()) for o, q in alive])
            y.sum().backward()
    assert len(kept[0]) == 2 and kept[1] == kept[0], kept  # (two layers)


def test_the_fused_backend_is_sdpa_and_needs_no_softmax_fusion(seed):
    # attention_backend "fused" calls SDPA as "auto" does; neither reads masked_softmax_fusion
    for kw in (dict(attention_backend=AttnBackend.fused),
               dict(attention_backend=AttnBackend.auto, masked_softmax_fusion=False)):
        module, one = blocks(make_config(**kw))
        x = hidden()
        assert all(layer.fused_path_applies(x) for layer in one.layers)
        with pinned(kw["attention_backend"]):
            assert_same_bits(step(one, x, seed), step(module, x, seed))


@pytest.mark.parametrize("backend_", [AttnBackend.local, AttnBackend.flash, AttnBackend.auto])
def test_what_no_backward_reads_is_not_kept(backend_):
    # x, the first norm and the QKV projection frozen: the module path builds no node for the
    # attention's inputs, so it keeps neither the scores nor the probabilities; nor does the node
    cfg = make_config(attention_backend=backend_)
    _, one = blocks(cfg)
    for name in ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                 "self_attention.linear_qkv.bias"):
        one.layers[0].get_parameter(name).requires_grad_(False)
    sdpa_inputs = []
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **k: (sdpa_inputs.extend(a), sdpa(*a, **k))[1]
    try:
        out, _ = one.layers[0](hidden().detach())
    finally:
        F.scaled_dot_product_attention = sdpa
    assert not any(t.requires_grad for t in sdpa_inputs)  # (SDPA: no graph built for its call)
    node = out.grad_fn
    assert type(node).__name__ == "FusedTransformerLayerFunctionBackward"
    c_norm, _, c_attn = node.ops[:3]
    assert vars(c_attn) == {} and vars(c_norm) == {}  # released in the forward
    out.sum().backward()  # the rest of the layer still trains
    assert one.layers[0].mlp.linear_fc1.weight.grad is not None
    assert one.layers[0].self_attention.linear_qkv.weight.grad is None


# ---------------------------------------------------------------------------------------------
# The path steps aside for what the module path refuses or runs otherwise; single trainable biases (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def test_flash_takes_a_head_dim_of_exactly_256():
    # FlashAttention's limit is inclusive (heads of at most 256 channels): hn = 256 builds and is taken
    cfg = make_config(hidden_size=512, num_attention_heads=2, ffn_hidden_size=40, num_layers=1,
                      attention_backend=AttnBackend.flash)
    layer = FusedTransformerLayer(cfg, get_gpt_layer_local_spec().submodules).to(DEVICE).train()
    assert layer.fused_path_applies(torch.randn(3, 1, 512, device=DEVICE, requires_grad=True))


def test_an_attention_bias_takes_the_layers_forward_and_its_error(backend):
    # the module path refuses attention_bias (NotImplementedError): the one-node path must step
    # aside for it rather than ignore it
    module, one = blocks(make_config(num_layers=1, attention_backend=backend))
    x = hidden()
    bias = torch.zeros(2, 4, 7, 7, device=DEVICE)
    assert not one.layers[0].fused_path_applies(x, attention_bias=bias)
    for layer in (module.layers[0], one.layers[0]):
        with pytest.raises(NotImplementedError, match="attention_bias"):
            layer(x, attention_bias=bias)


@pytest.mark.parametrize("keep", ["layers.0.self_attention.linear_proj.bias", "layers.1.mlp.linear_fc1.bias",
                                  "layers.0.input_layernorm.bias", "layers.0.self_attention.linear_qkv.bias"])
def test_a_single_trainable_bias_gets_the_layers_gradient(keep, backend, seed):
    # BitFit-style fine-tuning: every tensor frozen but one bias; its gradient is the module path's
    module, one = blocks(make_config(attention_backend=backend))
    frozen = {"x", *(n for n, _ in one.named_parameters() if n != keep)}
    x = hidden()
    got, want = step(one, x, seed, frozen=frozen), step(module, x, seed, frozen=frozen)
    assert want[2][keep] is not None
    assert_same_bits(got, want)


def _outcome_or_error(layer, x, seed):
    """(output, x's gradient, parameters' gradients) of a step, or the error it raised (any type:
    Apex's missing-extension error is an ImportError), with the layer's name made one."""
    torch.manual_seed(seed)
    try:
        out, _ = layer(x)
        out.backward(torch.ones_like(out))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err).replace('FusedTransformerLayer', 'TransformerLayer')}"
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("norm", ["input_layernorm", "pre_mlp_layernorm"])
def test_a_norm_switched_to_another_backend_after_the_build_is_the_layers(norm, backend, seed):
    # a norm's backend set to "apex" after the build: the module path runs Apex's kernel (or raises
    # where Apex is missing); the one-node path runs fusedlib's, so it must step aside: same outcome
    module, one = blocks(make_config(num_layers=1, attention_backend=backend))
    layer, ref = one.layers[0], module.layers[0]
    for lay in (layer, ref):
        setattr(getattr(lay, norm), "backend", "apex")
    x = hidden()
    assert not layer.fused_path_applies(x)
    got = _outcome_or_error(layer, x.detach().clone().requires_grad_(True), seed)
    want = _outcome_or_error(ref, x.detach().clone().requires_grad_(True), seed)
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str), got
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kwarg", ["packed_seq_params", "inference_context"])
def test_packed_sequences_and_inference_contexts_are_refused_as_by_the_layer(kwarg, backend):
    # TransformerLayer raises NotImplementedError for them; the one-node layer must not ignore them
    module, one = blocks(make_config(num_layers=1, attention_backend=backend))
    x = hidden()
    for layer in (module.layers[0], one.layers[0]):
        with pytest.raises(NotImplementedError, match="packed_seq_params"):
            layer(x, **{kwarg: object()})
