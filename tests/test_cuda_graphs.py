"""CUDA graphs of a block's layers and final norm (``TransformerConfig.cuda_graph_impl = "local"``).

The config checks, the CPU refusal, the hook refusal and the manager's bookkeeping (with an
eager stand-in for ``make_graphed_callables``: signatures, recaptures, guards, gradient copies)
run everywhere; the graphs themselves need CUDA. On a GPU
the graphed block replays the kernels the eager block launches, on the same inputs and (after
``torch.manual_seed``) the same Philox offsets, so its outputs and gradients are compared with
the eager block's for exact equality, dropout included.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusedlib.models.gpt import get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from fusedlib.runtime import collector_paused_for_capture
from fusedlib.transformer.cuda_graphs import MAX_SIGNATURES, CudaGraphManager, _check_no_hooks, _hook_dicts
from fusedlib.transformer.identity_op import IdentityOp
from fusedlib.transformer import TransformerConfig
from fusedlib.transformer.enums import AttnBackend
from fusedlib.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from conftest import DEVICE, empty_cache_frees  # noqa: I001

S, B, H, NP, FFN = 9, 3, 24, 4, 40  # odd sizes
FUSIONS_ON = dict(bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
                  apply_rope_fusion=True)
cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")


def config(dtype=torch.float32, **kw) -> TransformerConfig:
    base = dict(num_layers=3, hidden_size=H, num_attention_heads=NP, ffn_hidden_size=FFN, hidden_dropout=0.0,
                attention_dropout=0.0, activation_func=F.gelu, add_bias_linear=True, params_dtype=dtype,
                bf16=dtype is torch.bfloat16, attention_backend=AttnBackend.local, **FUSIONS_ON)
    base.update(kw)
    return TransformerConfig(**base)


def pair(dtype=torch.float32, final_norm=True, **kw) -> tuple[TransformerBlock, TransformerBlock]:
    """(eager block, graphed block) with the same random parameters, in training mode."""
    spec = get_gpt_layer_local_spec()
    if not final_norm:
        spec = TransformerBlockSubmodules(layer_specs=[spec] * 3, layer_norm=None)
    eager = TransformerBlock(config(dtype, **kw), spec).to(DEVICE)
    graphed = TransformerBlock(config(dtype, cuda_graph_impl="local", **kw), spec).to(DEVICE)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(0.3 * torch.randn(p.shape, device=DEVICE, dtype=torch.float32))
    graphed.load_state_dict(eager.state_dict())
    return eager.train(), graphed.train()


def step(block: TransformerBlock, x: torch.Tensor, g: torch.Tensor, seed, attention_mask=None, input_grad=True,
         **kw):
    """Output and gradients (input, then parameters by name) of one training step from ``seed``
    (None: the generator as it is); with ``input_grad=False`` the input needs no gradient (its
    gradient is None)."""
    for p in block.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(input_grad)
    if seed is not None:
        torch.manual_seed(seed)
    y = block(x, attention_mask, **kw)
    y.backward(g)
    return y.detach().clone(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def assert_same(a, b) -> None:
    ya, dxa, pa = a
    yb, dxb, pb = b
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    torch.testing.assert_close(dxb, dxa, rtol=0, atol=0)
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


# ------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, match", [
    (dict(cuda_graph_impl="transformer_engine"), "cuda_graph_impl must be 'none' or 'local'"),
    (dict(cuda_graph_impl="full"), "cuda_graph_impl must be 'none' or 'local'"),
    (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=0), "cuda_graph_warmup_steps must be an int >= 1"),
    (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=-1), "cuda_graph_warmup_steps must be an int >= 1"),
    (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=1.5), "cuda_graph_warmup_steps must be an int >= 1"),
    (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=True), "cuda_graph_warmup_steps must be an int >= 1"),
    (dict(cuda_graph_impl="local", recompute_granularity="selective"), "activation recomputation"),
    (dict(cuda_graph_impl="local", recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), "activation recomputation"),
    (dict(cuda_graph_impl="local", enable_cuda_graph=True), "Do not use enable_cuda_graph with cuda_graph_impl"),
    (dict(enable_cuda_graph="False"), "enable_cuda_graph must be a bool"),
    (dict(enable_cuda_graph=None), "enable_cuda_graph must be a bool"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_config_rejects_tensor_parallel_graphs():
    with pytest.raises(ValueError, match="tensor_model_parallel_size = 1 only, got 2"):
        config(cuda_graph_impl="local", tensor_model_parallel_size=2)


def test_enable_cuda_graph_is_the_deprecated_spelling():
    with pytest.warns(UserWarning, match="cuda_graph_impl='local'") as record:
        cfg = config(enable_cuda_graph=True)
    assert record[0].filename == __file__, "the warning names the caller's line"
    assert cfg.cuda_graph_impl == "local" and not cfg.enable_cuda_graph
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(cfg, hidden_dropout=0.2).cuda_graph_impl == "local"  # a copy maps nothing again
        assert config().cuda_graph_impl == "none" and config().cuda_graph_warmup_steps == 3


def test_graphs_on_the_cpu_are_refused_in_training():
    block = TransformerBlock(config(cuda_graph_impl="local"), get_gpt_layer_local_spec()).cpu().train()
    x = torch.randn(S, B, H, requires_grad=True)
    with pytest.raises(ValueError, match="hidden_states must be on a CUDA device, got cpu"):
        block(x, None)
    for p in block.parameters():  # nothing to differentiate: refused all the same (not silently eager)
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="hidden_states must be on a CUDA device, got cpu"):
        block(x.detach(), None)


def test_the_specs_have_no_module_hooks():
    for spec in (get_gpt_layer_local_spec(), get_gpt_layer_unfused_spec()):
        _check_no_hooks(_hook_dicts(TransformerBlock(config(), spec).layers))  # the library's own layers: no hooks


def test_module_and_parameter_hooks_are_refused_before_and_after_the_capture():
    """Hooks on the modules of the layers and the final norm (at the capture, or added after it)
    and tensor hooks on their parameters are refused, naming where; hooks on the block itself
    are fine (the eager stand-in for make_graphed_callables: see the bookkeeping tests below)."""
    _, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    handle = managed.layers[1].mlp.linear_fc1.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(NotImplementedError, match=r"layers\.1\.mlp\.linear_fc1 \(.*\) has a module hook"):
        managed(x, None)
    handle.remove()
    block_hook = managed.register_forward_hook(lambda m, i, o: None)
    managed(x, None).sum().backward()  # captured
    handle = managed.layers[0].register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(NotImplementedError, match=r"layers\.0 \(.*\) has a module hook"):
        managed(x, None)
    handle.remove()
    handle = managed.layers[2].mlp.linear_fc2.weight.register_hook(lambda g: 2 * g)
    with pytest.raises(NotImplementedError, match=r"parameter layers\.2\.mlp\.linear_fc2\.weight has a tensor hook"):
        managed(x, None)
    handle.remove()
    handle = managed.final_layernorm.register_forward_hook(lambda m, i, o: None)  # in the graphs too
    with pytest.raises(NotImplementedError, match=r"final_layernorm \(.*\) has a module hook"):
        managed(x, None)
    handle.remove()
    handle = managed.final_layernorm.weight.register_hook(lambda g: 2 * g)
    with pytest.raises(NotImplementedError, match=r"parameter final_layernorm\.weight has a tensor hook"):
        managed(x, None)
    handle.remove()
    managed(x, None).sum().backward()
    block_hook.remove()
    assert managed.cudagraph_manager.captures == 1


def test_the_manager_checks_its_warmup():
    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
            CudaGraphManager(bad)


def test_under_torch_compile_the_layers_run_eagerly():
    """torch.compile traces the eager layers (no capture inside a trace): on any device, with the
    unfused spec (the fused kernels cannot be traced in Triton's CPU interpreter)."""
    block = TransformerBlock(config(cuda_graph_impl="local"), get_gpt_layer_unfused_spec()).to(DEVICE).train()
    compiled = torch.compile(block, backend="eager")
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    compiled(x, None).sum().backward()
    assert x.grad is not None and block.cudagraph_manager.captures == 0


def test_eval_and_no_grad_run_the_eager_layers():
    """In eval mode and without grad (on any device) the block runs its layers eagerly: the same
    output as the block without graphs, and nothing captured."""
    eager, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    torch.testing.assert_close(graphed.eval()(x, None), eager.eval()(x, None), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(graphed.train()(x, None), eager.train()(x, None), rtol=0, atol=0)
    assert graphed.cudagraph_manager.captures == 0


# ------------------------------------------------------------------------------------- on a GPU


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_graphed_block_equals_eager_block(dtype, dropout, seed):
    """Three steps (the first captures, the next two replay) on fresh inputs, the generator seeded
    once before the three: outputs and every gradient equal the eager block's exactly, dropout
    included (the capture leaves the generator as it found it; the replays draw what the eager
    steps draw)."""
    eager, graphed = pair(dtype, hidden_dropout=dropout, attention_dropout=dropout)
    xs = torch.randn(3, S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
    gs = torch.randn(3, S, B, H, device=DEVICE, dtype=torch.float32).to(dtype)
    results = {}
    for name, block in (("eager", eager), ("graphed", graphed)):
        torch.manual_seed(seed)
        results[name] = [step(block, xs[i], gs[i], seed=None) for i in range(3)]
    for a, b in zip(results["eager"], results["graphed"]):
        assert_same(a, b)
    assert graphed.cudagraph_manager.captures == 1


@cuda_only
def test_dropout_draws_new_masks_on_every_replay(seed):
    _, graphed = pair(hidden_dropout=0.3, attention_dropout=0.3)
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.ones(S, B, H, device=DEVICE)
    step(graphed, x, g, seed)  # captures
    outs = []
    for _ in range(2):  # two replays on the same input, the generator not reseeded
        y = graphed(x.clone().requires_grad_(True), None)
        y.backward(g)
        outs.append(y.detach())
    assert not torch.equal(outs[0], outs[1])


@cuda_only
def test_new_shape_recaptures_and_inputs_are_not_modified(seed):
    eager, graphed = pair()
    for s in (S, 2 * S + 1, S):
        x = torch.randn(s, B, H, device=DEVICE)
        g = torch.randn(s, B, H, device=DEVICE)
        x_before = x.clone()
        assert_same(step(eager, x, g, seed), step(graphed, x, g, seed))
        torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    assert graphed.cudagraph_manager.captures == 2


@cuda_only
def test_attention_mask_is_a_graph_input(seed):
    """A padding mask changes between replays: the graph reads each call's mask (copied into its
    static input), and the caller's mask is left as it was."""
    eager, graphed = pair()
    for i in range(2):
        mask = torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool)
        mask[i, ..., -(i + 2):] = True
        mask_before = mask.clone()
        x = torch.randn(S, B, H, device=DEVICE)
        g = torch.randn(S, B, H, device=DEVICE)
        assert_same(step(eager, x, g, seed, mask), step(graphed, x, g, seed, mask))
        assert torch.equal(mask, mask_before)
    assert graphed.cudagraph_manager.captures == 1


@cuda_only
def test_second_forward_before_backward_is_refused():
    _, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    graphed(x, None)  # captures; its output dropped at once: no backward can come
    y = graphed(x, None)  # so a new forward is allowed
    with pytest.raises(RuntimeError, match="before the backward of the previous one"):
        graphed(x, None)  # y's graph is alive, its backward not started
    del y
    with torch.no_grad():
        graphed(x, None)  # no autograd: the eager path is allowed
    graphed.eval()(x, None)
    y = graphed.train()(x, None)  # y's backward stays pending while y lives
    graphed.reset_cuda_graphs()  # forgets y's pending backward too
    graphed(x, None).sum().backward()
    assert graphed.cudagraph_manager.captures == 2
    del y


@cuda_only
@pytest.mark.parametrize("final_norm", [True, False])
def test_the_output_is_not_overwritten_by_the_next_replay(final_norm, seed):
    eager, graphed = pair(final_norm=final_norm)
    x1, x2 = torch.randn(2, S, B, H, device=DEVICE).unbind(0)
    g = torch.randn(S, B, H, device=DEVICE)
    y1 = step(graphed, x1, g, seed)[0]
    kept = graphed(x1.clone().requires_grad_(True), None)  # the block's own output tensor
    kept_value = kept.detach().clone()
    kept.backward(g)
    step(graphed, x2, g, seed)
    torch.testing.assert_close(kept.detach(), kept_value, rtol=0, atol=0)
    torch.testing.assert_close(y1, step(eager, x1, g, seed)[0], rtol=0, atol=0)


@cuda_only
def test_gradients_are_not_the_graphs_buffers_and_accumulate(seed):
    """Gradients kept from one step survive the next replay, and two backwards without zeroing
    accumulate (a gradient taken as the graph's own buffer would be overwritten instead)."""
    eager, graphed = pair()
    x1, x2 = torch.randn(2, S, B, H, device=DEVICE).unbind(0)
    g = torch.randn(S, B, H, device=DEVICE)
    r1 = step(graphed, x1, g, seed)
    kept = {n: t.clone() for n, t in r1[2].items()}
    step(graphed, x2, g, seed)
    for n, t in r1[2].items():
        torch.testing.assert_close(t, kept[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    for block in (eager, graphed):
        for p in block.parameters():
            p.grad = None
        for x in (x1, x2):
            block(x.clone().requires_grad_(True), None).backward(g)
    for (n, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(pg.grad, pe.grad, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


@cuda_only
def test_moving_the_parameters_recaptures(seed):
    eager, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    step(graphed, x, g, seed)
    for block in (eager, graphed):  # new storage for every parameter (and back to float32)
        block.to(torch.float64).to(torch.float32)
    assert_same(step(eager, x, g, seed), step(graphed, x, g, seed))
    assert graphed.cudagraph_manager.captures == 2


@cuda_only
def test_optimizer_updates_reach_the_graphs(seed):
    """The graphs read the parameters in place: after an SGD step of both blocks they still agree."""
    eager, graphed = pair()
    opts = [torch.optim.SGD(b.parameters(), lr=0.1) for b in (eager, graphed)]
    for i in range(3):
        x = torch.randn(S, B, H, device=DEVICE)
        g = torch.randn(S, B, H, device=DEVICE)
        assert_same(step(eager, x, g, seed + i), step(graphed, x, g, seed + i))
        for o in opts:
            o.step()


@cuda_only
def test_freezing_and_unfreezing_recaptures(seed):
    """requires_grad is part of what a capture fixed: freezing a parameter after the capture
    leaves its gradient None and the others equal to the eager block's; unfreezing it again
    gives it a gradient again."""
    eager, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    step(graphed, x, g, seed)
    for block in (eager, graphed):
        block.layers[0].mlp.linear_fc1.weight.requires_grad_(False)
    a, b = step(eager, x, g, seed), step(graphed, x, g, seed)
    assert b[2]["layers.0.mlp.linear_fc1.weight"] is None
    assert_same(a, b)
    for block in (eager, graphed):
        block.layers[0].mlp.linear_fc1.weight.requires_grad_(True)
    assert_same(step(eager, x, g, seed), step(graphed, x, g, seed))
    assert graphed.cudagraph_manager.captures == 3


@cuda_only
def test_frozen_first_layer_and_an_input_without_grad(seed):
    """Nothing before the second layer requires grad: the graphs give no input gradient and none
    for the first layer, and the block still trains the rest as the eager block does."""
    eager, graphed = pair()
    for block in (eager, graphed):
        for p in block.layers[0].parameters():
            p.requires_grad_(False)
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    for _ in range(2):
        results = []
        for block in (eager, graphed):
            for p in block.parameters():
                p.grad = None
            torch.manual_seed(seed)
            y = block(x, None)  # x does not require grad
            y.backward(g)
            results.append((y.detach().clone(), {n: p.grad for n, p in block.named_parameters()}))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
        for n, t in results[0][1].items():
            assert (t is None) == (results[1][1][n] is None), n
            if t is not None:
                torch.testing.assert_close(results[1][1][n], t, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


@cuda_only
def test_a_backward_of_an_earlier_forward_is_refused():
    _, graphed = pair()
    x1, x2 = (torch.randn(S, B, H, device=DEVICE, requires_grad=True) for _ in range(2))
    y1 = graphed(x1, None)
    y1.sum().backward(retain_graph=True)
    y2 = graphed(x2, None)  # replays over y1's activations
    with pytest.raises(RuntimeError, match="earlier forward than the latest one"):
        y1.sum().backward()
    y2.sum().backward()


@cuda_only
def test_replaced_parameters_recapture(seed):
    """load_state_dict(assign=True) puts new Parameter objects in place: the graphs of the old
    ones are not used."""
    eager, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    step(graphed, x, g, seed)
    state = {k: 0.5 * v if isinstance(v, torch.Tensor) else v for k, v in eager.state_dict().items()}  # (and _extra_state)
    eager.load_state_dict(state)
    graphed.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, assign=True)
    assert_same(step(eager, x, g, seed), step(graphed, x, g, seed))
    assert graphed.cudagraph_manager.captures == 2


@cuda_only
def test_an_identity_final_norm_returns_a_copy(seed):
    eager, graphed = pair(final_norm=False)
    spec = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec()] * 3, layer_norm=IdentityOp)
    graphed = TransformerBlock(config(cuda_graph_impl="local"), spec).to(DEVICE).train()
    graphed.load_state_dict(eager.state_dict(), strict=False)
    x1, x2 = torch.randn(2, S, B, H, device=DEVICE).unbind(0)
    g = torch.randn(S, B, H, device=DEVICE)
    kept = graphed(x1.clone().requires_grad_(True), None)
    kept_value = kept.detach().clone()
    kept.backward(g)
    step(graphed, x2, g, seed)
    torch.testing.assert_close(kept.detach(), kept_value, rtol=0, atol=0)


@cuda_only
def test_a_mask_that_comes_and_goes(seed):
    """With and without a mask are two signatures, each with its own graphs."""
    eager, graphed = pair()
    mask = torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool)
    mask[0, ..., -2:] = True
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    for m in (None, mask, None, mask):
        assert_same(step(eager, x, g, seed, m), step(graphed, x, g, seed, m))
    assert graphed.cudagraph_manager.captures == 2


class _SyncsTheHost(torch.nn.Module):
    """A layer that reads a value on the host at every call: runs eagerly, cannot be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(H, H, device=DEVICE)

    def forward(self, hidden_states, **kwargs):
        if not torch.isfinite(hidden_states.sum()).item():  # (a host sync: refused inside a capture)
            raise ValueError("non-finite hidden states")
        return self.linear(hidden_states)


@cuda_only
def test_a_failed_capture_leaves_random_numbers_working():
    """A layer that syncs the host makes the capture fail: the block raises, the caller's stream
    is current again, the caching allocator frees memory again, and the CUDA generator is usable
    afterwards (a failed capture leaves it in capture mode, where every later random draw
    fails): dropout draws, and another block captures with dropout on."""
    _, graphed = pair()
    graphed.layers[1] = _SyncsTheHost()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # (conftest: every test starts on it)
    with pytest.raises(RuntimeError, match="capturing the layers as CUDA graphs failed"):
        graphed(x, None)
    # the caller's stream is current again (torch.cuda.graph's exit raised before leaving its own),
    # and the allocator no longer routes to the capture's pool (empty_cache frees memory)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert empty_cache_frees()
    y = F.dropout(torch.ones(256, device=DEVICE), 0.5)
    assert bool((y == 0).any()) and bool((y == 2).any())
    _, again = pair(hidden_dropout=0.1, attention_dropout=0.1)
    again(x, None).sum().backward()
    assert again.cudagraph_manager.captures == 1 and x.grad is not None


#: Bytes the backward of :class:`_SyncsInBackward` allocates (inside the capture: from its pool).
BIG = 1 << 29


class _SyncsInBackward(torch.autograd.Function):
    """The identity, whose backward allocates BIG bytes and reads a value on the host."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.empty(BIG, dtype=torch.uint8, device=grad.device)
        if not torch.isfinite(grad.sum() + scratch[:1].float().mul(0)).item():  # (a host sync)
            raise ValueError("non-finite gradient")
        return grad


class _SyncsTheHostInBackward(torch.nn.Module):
    """A layer whose forward can be captured and whose backward cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(H, H, device=DEVICE)

    def forward(self, hidden_states, **kwargs):
        return _SyncsInBackward.apply(self.linear(hidden_states))


@cuda_only
def test_a_failed_backward_capture_after_a_captured_forward_frees_the_pool():
    """make_graphed_callables captures the forward, then the backward into the same memory pool
    (each capture takes a reference to it): when only the backward's capture fails, the forward's
    graph holds one reference and the failed capture the other. The block raises, the caller's
    stream is current again, the allocator frees memory again, and once the forward's graph is
    gone (with the error's frames) the pool is freed, the BIG bytes the failed backward capture
    allocated in it included; random draws work."""
    import gc

    _, graphed = pair()
    graphed.layers[1] = _SyncsTheHostInBackward()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(RuntimeError, match="capturing the layers as CUDA graphs failed") as info:
        graphed(x, None)
    assert "non-finite" not in str(info.value)  # (the backward's sync failed the capture, not its check)
    del info
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert empty_cache_frees()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved + BIG // 2, (reserved, torch.cuda.memory_reserved())
    assert torch.rand(8, device=DEVICE).unique().numel() == 8


@cuda_only
def test_inside_a_capture_of_the_whole_step_the_block_takes_the_eager_path():
    """While the current stream is being captured (a graph of the whole training step) the
    block's layers run eagerly, their kernels going into that graph: a capture of graphs of
    their own cannot start inside another capture."""
    _, graphed = pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    assert CudaGraphManager.applies(graphed, x)
    graph = torch.cuda.CUDAGraph()
    with collector_paused_for_capture(), torch.cuda.graph(graph):
        inside = CudaGraphManager.applies(graphed, x)
        doubled = 2 * x.detach()  # (something for the capture to hold)
    graph.replay()
    torch.cuda.synchronize()
    assert not inside and torch.equal(doubled, 2 * x.detach())
    assert CudaGraphManager.applies(graphed, x)


@cuda_only
def test_the_caller_s_tensors_are_not_the_capture_s_sample_inputs(seed):
    """Each replay copies its call's hidden states and mask into the graphs' static inputs: those
    must be copies made at the capture, not the capturing call's own tensors, which the next
    call would otherwise overwrite."""
    _, graphed = pair()
    xs = [torch.randn(S, B, H, device=DEVICE, requires_grad=True) for _ in range(2)]
    masks = [torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool) for _ in range(2)]
    masks[1][0, ..., -2:] = True
    kept = [(x.detach().clone(), m.clone()) for x, m in zip(xs, masks)]
    for x, m in zip(xs, masks):
        graphed(x, m).sum().backward()
    for i, (x, m) in enumerate(zip(xs, masks)):
        assert torch.equal(x.detach(), kept[i][0]), f"the hidden states of call {i} were modified"
        assert torch.equal(m, kept[i][1]), f"the mask of call {i} was modified"
    assert graphed.cudagraph_manager.captures == 1


# ------------------------------------------------------------------------ the bookkeeping, anywhere
# The manager with a stand-in for torch.cuda.make_graphed_callables that "replays" by running the
# captured stack eagerly inside an autograd.Function, as make_graphed_callables' own Function does: its
# checks, guards and hooks run on any device (the unfused spec: torch's kernels, quick on a CPU).


def _eager_stand_in(calls, samples, num_warmup_iters=3, pool=None):
    return tuple(_replaying(call) for call in calls)


def _replaying(call):
    params = tuple(call.parameters())
    forward = call.forward

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            args = [t.detach().requires_grad_(t.requires_grad) for t in inputs[:len(inputs) - len(params)]]
            with torch.enable_grad():
                out = forward(*args)
            ctx.args, ctx.out = args, out
            return out.detach()

        @staticmethod
        def backward(ctx, grad):
            wrt = [a for a in ctx.args if a.requires_grad] + [p for p in params if p.requires_grad]
            grads = iter(torch.autograd.grad(ctx.out, wrt, grad, allow_unused=True))
            return tuple(next(grads) if t.requires_grad else None for t in (*ctx.args, *params))

    call.forward = lambda *inputs: Replay.apply(*inputs, *params)
    return call


def stand_in_pair(spec=None):
    """(eager block, block whose manager uses the eager stand-in), unfused spec, same parameters."""
    spec = spec or get_gpt_layer_unfused_spec()
    eager = TransformerBlock(config(), spec).to(DEVICE).train()
    managed = TransformerBlock(config(cuda_graph_impl="local"), spec).to(DEVICE).train()
    managed.load_state_dict(eager.state_dict())
    managed.cudagraph_manager = CudaGraphManager(3, capture=_eager_stand_in)
    return eager, managed


def close(a, b) -> None:
    """Output and gradients equal bit for bit: the stand-in runs the same kernels, layer by layer."""
    torch.testing.assert_close(b[0], a[0], rtol=0, atol=0)
    torch.testing.assert_close(b[1], a[1], rtol=0, atol=0)
    for n in a[2]:
        assert (a[2][n] is None) == (b[2][n] is None), n
        if a[2][n] is not None:
            torch.testing.assert_close(b[2][n], a[2][n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_bookkeeping_captures_once_and_recaptures_on_freeze_and_replacement(seed):
    eager, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    for _ in range(2):
        close(step(eager, x, g, seed), step(managed, x, g, seed))
    assert managed.cudagraph_manager.captures == 1
    for block in (eager, managed):  # frozen: a new capture, no gradient for it
        block.layers[1].mlp.linear_fc2.weight.requires_grad_(False)
    r = step(managed, x, g, seed)
    close(step(eager, x, g, seed), r)
    assert r[2]["layers.1.mlp.linear_fc2.weight"] is None and managed.cudagraph_manager.captures == 2
    state = {k: 0.5 * v if isinstance(v, torch.Tensor) else v for k, v in eager.state_dict().items()}
    eager.load_state_dict(state)
    managed.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
                            assign=True)  # new Parameter objects
    close(step(eager, x, g, seed), step(managed, x, g, seed))
    assert managed.cudagraph_manager.captures == 3


def test_bookkeeping_frozen_first_layer_and_input_without_grad(seed):
    eager, managed = stand_in_pair()
    for block in (eager, managed):
        for p in block.layers[0].parameters():
            p.requires_grad_(False)
    x = torch.randn(S, B, H, device=DEVICE)  # no grad
    g = torch.randn(S, B, H, device=DEVICE)
    outs = []
    for block in (eager, managed):
        y = block(x, None)
        y.backward(g)
        outs.append((y.detach(), {n: p.grad for n, p in block.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    for n, t in outs[0][1].items():
        assert (t is None) == (outs[1][1][n] is None), n
        if t is not None:
            torch.testing.assert_close(outs[1][1][n], t, rtol=0, atol=0)


def test_bookkeeping_one_graph_pair_holds_the_layers_and_the_final_norm(seed):
    """The stack is captured as one callable (one forward and one backward graph) whose
    parameters are every parameter of the block, the final norm's included; the block returns
    a new tensor each step, not the replayed buffer."""
    seen = []

    def recording(calls, samples, num_warmup_iters=3, pool=None):
        seen.append((len(calls), len(samples), {id(p) for p in calls[0].parameters()}))
        return _eager_stand_in(calls, samples, num_warmup_iters)

    eager, managed = stand_in_pair()
    managed.cudagraph_manager = CudaGraphManager(3, capture=recording)
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    close(step(eager, x, g, seed), step(managed, x, g, seed))
    assert seen == [(1, 1, {id(p) for p in managed.parameters()})]
    y = managed(x.clone().requires_grad_(True), None)
    assert y.grad_fn.name() == "CloneBackward0"
    y.backward(g)


def test_a_failed_capture_names_the_error_inside_it(seed):
    """torch.cuda.graph's exit raises an error of its own when the capture failed ("operation
    failed due to a previous error during capture"), with the layer's error (a host sync, say)
    only as its context: the manager's message names both."""
    def failing(calls, samples, num_warmup_iters=3, pool=None):
        try:
            raise RuntimeError("operation not permitted when stream is capturing")  # the layer's
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")  # the exit's

    _, managed = stand_in_pair()
    managed.cudagraph_manager = CudaGraphManager(3, capture=failing)
    x = torch.randn(S, B, H, device=DEVICE)
    with pytest.raises(RuntimeError) as info:
        step(managed, x, torch.randn(S, B, H, device=DEVICE), seed)
    assert str(info.value) == (
        "cuda_graph_impl='local': capturing the layers as CUDA graphs failed: RuntimeError: operation failed due to "
        "a previous error during capture (inside the capture: RuntimeError: operation not permitted when stream is "
        "capturing)")


def test_bookkeeping_collects_garbage_before_a_capture_and_none_during_it(seed, monkeypatch):
    """An earlier capture's graphs are cyclic garbage (a graphed module's forward holds the
    module), freed whenever the collector runs: the manager collects before a capture and keeps
    the collector off during it, then restores it as it was, after a failed capture too."""
    events = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect") or collect(*a))

    def recording(calls, samples, num_warmup_iters=3, pool=None):
        events.append(("capture", gc.isenabled()))
        return _eager_stand_in(calls, samples, num_warmup_iters)

    def failing(calls, samples, num_warmup_iters=3, pool=None):
        events.append(("capture", gc.isenabled()))
        raise MemoryError("a capture that fails")

    eager, managed = stand_in_pair()
    managed.cudagraph_manager = CudaGraphManager(3, capture=recording)
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    assert gc.isenabled()
    close(step(eager, x, g, seed), step(managed, x, g, seed))
    assert events == ["collect", ("capture", False)] and gc.isenabled()
    events.clear()
    managed.cudagraph_manager = CudaGraphManager(3, capture=failing)
    with pytest.raises(RuntimeError, match="capturing the layers as CUDA graphs failed: MemoryError") as info:
        step(managed, x, g, seed)
    assert "inside the capture" not in str(info.value)  # (no earlier error to name)
    assert events == ["collect", ("capture", False)] and gc.isenabled()
    events.clear()
    gc.disable()  # a caller's choice stays
    try:
        managed.cudagraph_manager = CudaGraphManager(3, capture=recording)
        close(step(eager, x, g, seed), step(managed, x, g, seed))
        assert events == ["collect", ("capture", False)] and not gc.isenabled()
    finally:
        gc.enable()


def test_bookkeeping_replaced_modules_recapture(seed):
    """A final norm or a layer replaced after the capture (new module objects, same slots): the
    stack is captured again and runs the new modules, as the eager block does."""
    eager, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    close(step(eager, x, g, seed), step(managed, x, g, seed))
    for block in (eager, managed):
        block.final_layernorm = torch.nn.LayerNorm(H, device=DEVICE)
        with torch.no_grad():
            block.final_layernorm.weight.fill_(2.0)
            block.final_layernorm.bias.fill_(0.5)
    r = step(managed, x, g, seed)
    close(step(eager, x, g, seed), r)
    assert r[2]["final_layernorm.weight"] is not None and managed.cudagraph_manager.captures == 2
    fresh = TransformerBlock(config(), get_gpt_layer_unfused_spec()).to(DEVICE).train().layers[1]
    eager.layers[1] = managed.layers[1] = fresh  # the same new layer in both blocks
    y, dx, _ = step(eager, x, g, seed)
    y, dx = y.clone(), dx.clone()
    r = step(managed, x, g, seed)
    torch.testing.assert_close(r[0], y, rtol=0, atol=0)
    torch.testing.assert_close(r[1], dx, rtol=0, atol=0)
    assert managed.cudagraph_manager.captures == 3


def test_bookkeeping_final_norm_dtype_and_the_eager_path(seed):
    """bf16 parameters and a float32 input: the final norm gets the last layer's output cast to
    its weight's dtype inside the graphs, as the eager block casts it. With nothing to
    differentiate (parameters frozen, input without grad) the stack runs eagerly, final norm
    included, and nothing is captured."""
    spec = get_gpt_layer_unfused_spec()
    eager = TransformerBlock(config(torch.bfloat16), spec).to(DEVICE).train()
    managed = TransformerBlock(config(torch.bfloat16, cuda_graph_impl="local"), spec).to(DEVICE).train()
    managed.load_state_dict(eager.state_dict())
    managed.cudagraph_manager = CudaGraphManager(3, capture=_eager_stand_in)
    x = torch.randn(S, B, H, device=DEVICE)  # float32 into bf16 layers
    g = torch.randn(S, B, H, device=DEVICE, dtype=torch.bfloat16)
    a, b = step(eager, x, g, seed), step(managed, x, g, seed)
    assert b[0].dtype == torch.bfloat16
    close(a, b)
    for block in (eager, managed):
        for p in block.parameters():
            p.requires_grad_(False)
    before = managed.cudagraph_manager.captures
    y_eager, y_managed = eager(x, None), managed(x, None)
    assert not y_managed.requires_grad and managed.cudagraph_manager.captures == before
    torch.testing.assert_close(y_managed, y_eager, rtol=0, atol=0)


def test_bookkeeping_guards():
    _, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    managed(x, None)  # dropped at once: allowed to go on
    y = managed(x, None)
    with pytest.raises(RuntimeError, match="before the backward of the previous one"):
        managed(x, None)
    y.sum().backward(retain_graph=True)
    y2 = managed(x, None)
    with pytest.raises(RuntimeError, match="earlier forward than the latest one"):
        y.sum().backward()
    y2.sum().backward()


def test_bookkeeping_gradients_accumulate_and_signatures_are_bounded(seed):
    eager, managed = stand_in_pair()
    g = torch.randn(S, B, H, device=DEVICE)
    xs = torch.randn(2, S, B, H, device=DEVICE)
    for block in (eager, managed):
        for x in xs:
            block(x.clone().requires_grad_(True), None).backward(g)
    for (n, pe), pm in zip(eager.named_parameters(), managed.parameters()):
        torch.testing.assert_close(pm.grad, pe.grad, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    for s in range(1, MAX_SIGNATURES + 4):  # more sequence lengths than signatures kept
        managed(torch.randn(s, B, H, device=DEVICE, requires_grad=True), None).sum().backward()
    assert len(managed.cudagraph_manager._graphs) == MAX_SIGNATURES


def test_bookkeeping_of_the_benchmarks_plain_graphed_block(seed):
    """The benchmark's plain PyTorch block through the same manager: outputs and gradients equal
    the plain block's bit for bit (dropout off), one capture for two steps."""
    from fusedlib.bench.ops.transformer_layer import GraphedPlainGPTBlock, PlainGPTBlock

    plain = PlainGPTBlock(H, 4, FFN, 3, hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE).train()
    graphed = GraphedPlainGPTBlock(H, 4, FFN, 3, hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE).train()
    graphed.load_state_dict(plain.state_dict())
    graphed.cudagraph_manager = CudaGraphManager(3, capture=_eager_stand_in)
    g = torch.randn(S, B, H, device=DEVICE)
    for x in torch.randn(2, S, B, H, device=DEVICE):
        results = []
        for block in (plain, graphed):
            for p in block.parameters():
                p.grad = None
            xi = x.clone().requires_grad_(True)
            y = block(xi)
            y.backward(g)
            results.append((y.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}))
        close(*results)
    assert graphed.cudagraph_manager.captures == 1



def test_bookkeeping_the_least_recently_used_signature_is_dropped(seed):
    """The signatures kept are the most recently used ones: a signature used again before the
    bound is reached outlives the next new one (the oldest unused one goes instead), so a run
    that alternates its usual shapes with a rare one does not capture its usual ones again."""
    _, managed = stand_in_pair()

    def call(s):
        managed(torch.randn(s, B, H, device=DEVICE, requires_grad=True), None).sum().backward()

    for s in range(1, MAX_SIGNATURES + 1):  # as many signatures as kept
        call(s)
    call(1)  # replayed: 2 is now the least recently used
    assert managed.cudagraph_manager.captures == MAX_SIGNATURES
    call(MAX_SIGNATURES + 1)  # a new one: 2 is dropped, not 1
    call(1)
    assert managed.cudagraph_manager.captures == MAX_SIGNATURES + 1
    call(2)
    assert managed.cudagraph_manager.captures == MAX_SIGNATURES + 2


@pytest.mark.parametrize("change", ["dtype", "input_grad", "mask_shape", "autocast", "layer_mode"])
def test_bookkeeping_every_part_of_the_signature_has_its_own_graphs(change, seed):
    """Each part of the signature a capture fixes, changed alone, gets graphs of its own, and
    the first signature's graphs are replayed again afterwards: the input's dtype (a replay
    copies its input into the captured buffer, in that buffer's dtype) and requires_grad (graphs
    captured for an input without grad give it none), a mask's shape, autocast's state (the
    captured kernels' dtypes) and a layer's training flag (dropout on or off)."""
    dtype = torch.bfloat16 if change == "dtype" else torch.float32
    managed = TransformerBlock(config(dtype, cuda_graph_impl="local"), get_gpt_layer_unfused_spec()).to(DEVICE).train()
    managed.cudagraph_manager = CudaGraphManager(3, capture=_eager_stand_in)
    x = torch.randn(S, B, H, device=DEVICE)
    mask = torch.zeros(B, 1, S, S, device=DEVICE, dtype=torch.bool)
    mask[1, ..., -3:] = True

    def call(changed):
        xi = x.clone().requires_grad_(not (change == "input_grad" and changed))
        if change == "dtype" and changed:
            xi = x.to(dtype).requires_grad_(True)
        m = (mask[1:2] if changed else mask) if change == "mask_shape" else None
        managed.layers[1].train(not (change == "layer_mode" and changed))
        # autocast in the device's default autocast dtype: only its enabled state differs from
        # the first call's signature (which holds that dtype too)
        autocast = torch.autocast(DEVICE.type, dtype=torch.get_autocast_dtype(DEVICE.type)) \
            if change == "autocast" and changed else contextlib.nullcontext()
        with autocast:
            y = managed(xi, m)
        y.float().sum().backward()

    for changed, captures in ((False, 1), (True, 2), (False, 2), (True, 2)):
        call(changed)
        assert managed.cudagraph_manager.captures == captures, (change, changed)


def test_bookkeeping_a_new_parameter_object_on_the_same_storage_recaptures(seed):
    """A parameter replaced by a new Parameter object over the same storage (as a wrapper that
    registers its parameters again does): the values the graphs read are the same, but their
    backward would give the gradient to the old object; the stack is captured again, and the
    new parameter gets its gradient as in the eager block."""
    eager, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    close(step(eager, x, g, seed), step(managed, x, g, seed))
    fc2 = managed.layers[1].mlp.linear_fc2
    fc2.weight = torch.nn.Parameter(fc2.weight.data)  # the same storage, a new object
    r = step(managed, x, g, seed)
    close(step(eager, x, g, seed), r)
    assert r[2]["layers.1.mlp.linear_fc2.weight"] is not None and managed.cudagraph_manager.captures == 2


@pytest.mark.parametrize("hook", ["global", "backward_pre", "tensor_before_the_capture"])
def test_bookkeeping_hooks_of_every_kind_are_refused(hook):
    """A global module hook, a module's backward pre-hook and a tensor hook registered on a
    parameter before the first capture are refused as the other hooks are: the graphs would run
    none of them (or, for the tensor hook, apply it twice)."""
    from torch.nn.modules import module as module_mod

    _, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE, requires_grad=True)
    if hook == "global":
        handle = module_mod.register_module_forward_hook(lambda m, i, o: None)
        match = "a global module hook is registered"
    elif hook == "backward_pre":
        handle = managed.layers[0].mlp.register_full_backward_pre_hook(lambda m, g: None)
        match = r"layers\.0\.mlp \(.*\) has a module hook"
    else:
        handle = managed.layers[0].mlp.linear_fc1.weight.register_hook(lambda g: g)
        match = r"parameter layers\.0\.mlp\.linear_fc1\.weight has a tensor hook"
    try:
        with pytest.raises(NotImplementedError, match=match):
            managed(x, None)
    finally:
        handle.remove()
    managed(x, None).sum().backward()
    assert managed.cudagraph_manager.captures == 1


def test_bookkeeping_trainable_layers_capture_for_an_input_without_grad(seed):
    """The first block of a model gets embeddings that need no gradient: its layers still train,
    so the stack is captured (the eager path is for calls with nothing to differentiate), and
    its gradients equal the eager block's."""
    eager, managed = stand_in_pair()
    x = torch.randn(S, B, H, device=DEVICE)
    g = torch.randn(S, B, H, device=DEVICE)
    for _ in range(2):
        assert_same(step(eager, x, g, None, input_grad=False), step(managed, x, g, None, input_grad=False))
    assert managed.cudagraph_manager.captures == 1
