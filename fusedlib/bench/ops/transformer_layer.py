"""Benchmark cases for a whole transformer block: one training step of fusedlib's block, fused
and unfused, against megatron-core's local spec and a plain PyTorch block.

What is timed: one training step of a GPT block of ``layers`` pre-norm layers (LayerNorm,
causal self-attention, LayerNorm, GeLU MLP; a bias in every linear layer; the final
LayerNorm), on random bf16 hidden states [s, b, h]: the forward, then the backward of the
output against a fixed random gradient, in training mode with Megatron-core's default dropout
(``hidden_dropout`` 0.1 in both bias-dropout-adds, ``attention_dropout`` 0.1 on the attention
probabilities). Before every step the parameters' gradients are set to None, as
``zero_grad(set_to_none=True)`` does, so each step writes fresh gradients
(:attr:`fusedlib.bench.core.Impl.params`). No rotary embeddings (GPT-2's positions are added
at the embedding, outside the block: :mod:`fusedlib.bench.ops.rope` times RoPE), no
optimizer step, no embedding or loss.

Shapes ``[s, b, h, heads, ffn, layers]``, both measured by ``python -m fusedlib.bench --op
transformer_layer``: :data:`DEFAULT_SHAPE` (seq 2048, micro-batch 4, hidden 2048, 16 heads,
ffn 8192, 4 layers) and :data:`GPT2_SMALL_SHAPE` (seq 1024, batch 8, hidden 768, 12 heads,
ffn 3072, 6 layers), where the GEMMs are small and the host's launches weigh more; ``--sweep``
adds :data:`SMALL_SHAPE` (seq 512, batch 8, hidden 512, 8 heads, ffn 2048, 4 layers).

Implementations (record ``impl``; :data:`IMPLS` says the same):

================================  ===================================================================
``fusedlib-unfused``              fusedlib's ``TransformerBlock`` from ``get_gpt_layer_unfused_spec``:
                                  torch's LayerNorm, softmax and dropout, bias add then GeLU, unfused
                                  bias-dropout-add; the materialised attention
``fusedlib``                      ``get_gpt_layer_local_spec`` with every fusion on: fused LayerNorm,
                                  bias-GeLU, bias-dropout-add, and the materialised attention's
                                  softmax with its dropout in one kernel (``attention_backend`` local)
``fusedlib-sdpa``                 the same, ``attention_backend`` auto: torch's
                                  ``scaled_dot_product_attention`` (no scores in memory)
``fusedlib-flash``                the same, ``attention_backend`` flash: fusedlib's FlashAttention-2
                                  kernel in Triton (chapter 8)
``fusedlib-fused-layer``          ``fusedlib-flash`` with each layer a ``FusedTransformerLayer``: the
                                  same kernels, each layer's training step one autograd node
                                  (:mod:`fusedlib.transformer.fused_layer`)
``fusedlib-fused-layer-local``    ``fusedlib`` (the materialised attention) with each layer a
                                  ``FusedTransformerLayer``
``fusedlib-fused-layer-sdpa``     ``fusedlib-sdpa`` with each layer a ``FusedTransformerLayer`` (SDPA's
                                  backward torch's, through autograd, inside the node)
``fusedlib-graphs``               ``fusedlib`` (the materialised attention) with
                                  ``cuda_graph_impl="local"``: the layers' and the final norm's
                                  forward and backward replayed as two CUDA graphs
                                  (:mod:`fusedlib.transformer.cuda_graphs`)
``fusedlib-sdpa-graphs``          ``fusedlib-sdpa`` with ``cuda_graph_impl="local"``, as
                                  ``fusedlib-graphs``
``megatron-core-unfused``         megatron-core's ``TransformerBlock`` from its
                                  ``get_gpt_layer_local_spec``, fusions off
``megatron-core``                 the same with ``bias_activation_fusion`` and ``bias_dropout_fusion``
                                  (``torch.compile``d in megatron-core), and ``masked_softmax_fusion``
                                  / ``persist_layer_norm`` only where their CUDA extensions (Apex's)
                                  import: each record lists its ``fusions`` and, in
                                  ``fusions_unavailable``, why the others are off
``eager``                         a plain PyTorch pre-LN GPT block (:class:`PlainGPTBlock`:
                                  ``torch.nn`` layers, ``scaled_dot_product_attention``), eager
``eager-graphs``                  the plain PyTorch block with its layers and final norm through the
                                  same graph manager (:class:`GraphedPlainGPTBlock`): one forward
                                  and one backward graph, as ``fusedlib-sdpa-graphs``
``torch.compile``                 the same block with each layer's forward ``torch.compile``d
                                  (``dynamic=False``: static shapes), the final norm eager
================================  ===================================================================

torch.compile is applied per layer, as torchtitan compiles each transformer block: the layers
are identical, so Dynamo traces one layer's forward and reuses the compiled graph for the
others (Inductor's graph cache serves any recompile), which keeps the compile at one layer's
cost per shape instead of growing with the number of layers. What it gives up is fusion across
a layer boundary (the last residual add with the next layer's LayerNorm): about one [s, b, h]
write and read per layer and pass, tens of microseconds per step at these shapes against steps of
milliseconds. Its records say ``"compile_scope": "layer"``.

megatron-core's blocks need CUDA and ``torch.distributed``: a one-rank NCCL group, its
``parallel_state`` (tensor- and pipeline-parallel size 1) and its RNG tracker are set up at
their first call (:func:`init_megatron`). The tracker is megatron-core's graph-safe one
(``use_cudagraphable_rng``, as its own CUDA graphs use it): its attention dropout swaps the
tracker's generator state into the default generator, where the plain tracker copies a saved
state in (``set_state``), which a capture refuses; the graph-safe tracker's states are
registered with the timer's CUDA graph (:attr:`fusedlib.bench.core.Impl.generators`), so the
block's replays are timed like the others' (its records say ``"rng_tracker": "graph-safe"``;
records stored before have no such field, and no replay). Where megatron-core does not import
they are absent and ``skipped`` says why.

Records (one per implementation and shape, pass ``"fwd+bwd"``; the case is timed as every case
of the harness, :func:`fusedlib.bench.core.measure_case`): a transformer block is not
memory-bound, so ``"bytes"`` and ``"GBps"`` are None. Its fields beyond the benchmark records' usual ones:

The three ``-graphs`` implementations capture their layers and final norm at their first call;
under the harness's own capture of a whole step (the ``"ms"`` timer) they run them eagerly (a
graph of the step records the same kernels), so their ``"ms"`` repeats the un-graphed block's
and their ``"ms_eager"`` is what the block's graphs buy with plain launches. Their graphs'
memory pools are allocated at the capture, before the measured step, so ``"peak_bytes"``
leaves them out.

* ``"ms"``: the step as a CUDA-graph replay (``"timer": "cuda_graph"``), the median of
  :data:`PLAIN_ROUNDS` replays timed in the same rounds as the plain launches, each right after
  them (``"ms_replay_rounds"``; of the rounds it finished, with ``"replay_rounds_error"``, where a
  later replay failed; records stored before the replays were timed in rounds have one replay
  and no such field), or plain launches where it could not be captured
  (``"timer": "do_bench"`` and the reason in ``"graph_error"``); ``"ms_eager"``: the step as plain launches, what an eager training step pays,
  the median of :data:`PLAIN_ROUNDS` timings with the implementations in turns (``"ms_plain_rounds"``);
* ``"tokens"`` (s·b), ``"tokens_per_s"`` (from ``ms``), ``"tokens_per_s_eager"`` (from
  ``ms_eager``);
* ``"peak_bytes"``: the most memory the step allocates beyond what was allocated before it
  (activations, gradients, workspaces; not the weights, not the input, and not a buffer a
  module keeps between steps, such as megatron-core's global scores buffer);
  ``"weight_bytes"``: the parameters (the same for every implementation);
* ``"shape_names"``, ``"hidden_dropout"``, ``"attention_dropout"``, ``"params"``, and per
  implementation ``"fusions"`` (the TransformerConfig switches on) and ``"attention"``
  (``"materialised"`` or ``"sdpa"``); ``"compile": "static"`` on torch.compile's.

The profile (:func:`profile`, written by :func:`extra_files` as
``transformer_layer_profile.json``): ``torch.profiler``'s CUDA kernels of a few plain-launch
steps of :data:`PROFILE_IMPLS` at :data:`DEFAULT_SHAPE`, summed by kernel name and by
category (:func:`kernel_category`), per step: where the step's time goes.

The clock under load (:func:`power_state`, written by :func:`extra_files` on a CUDA device as
``transformer_layer_power.json``): :data:`POWER_IMPLS` at :data:`DEFAULT_SHAPE`, timed over the
benchmark's 200 ms window and over 3 s of back-to-back steps, and profiled, with the SM clock
and board power ``nvidia-smi`` reports during each (:mod:`fusedlib.bench.clocks`): whether
two timings ran at the same clock, and what a long, power-limited run gets.

Time: about 25 steps per implementation, timer and round (triton's ``do_bench``: five to
estimate, a warm-up, then as many as fit in 200 ms; :data:`PLAIN_ROUNDS` rounds of plain
launches and of replays, each replay round with its own capture), one layer's
``torch.compile`` per shape, Triton's kernels compiled once per shape, megatron-core's
``torch.compile``d fusions, the profile's handful of steps and the clock's timings (about 50 s).
A ``--sweep`` run took 3 min 35 s on the H200 while only the plain launches were timed in
rounds; each replay round adds a capture and a timing per capturable implementation and shape.

Source: Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py``,
``megatron/core/transformer/transformer_block.py``; the step as Megatron's training loop runs it
(``zero_grad``, forward, backward).
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import math
import numbers
import socket
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from ...transformer.cuda_graphs import CudaGraphManager
from ...transformer.enums import AttnBackend
from ..core import BenchCase, Impl, environment, require_fields
from .baselines import compile_impl, try_import

__all__ = [
    "DEFAULT_SHAPE", "GPT2_SMALL_SHAPE", "SMALL_SHAPE", "SHAPE_NAMES", "HIDDEN_DROPOUT", "ATTENTION_DROPOUT", "IMPLS",
    "PROFILE_IMPLS", "PROFILE_FILE", "FUSIONS_ON", "param_count", "gemm_flops", "fusedlib_block",
    "megatron_block", "init_megatron", "megatron_generators", "PlainGPTLayer", "PlainGPTBlock", "case", "cases", "table",
    "kernel_category", "kernel_summary", "device_span", "profile", "profile_table", "extra_files", "load_profile",
    "POWER_IMPLS", "POWER_FILE", "power_state", "power_table", "write_power_state", "load_power_state",
    "PLAIN_ROUNDS",
]

#: [s, b, h, heads, ffn, layers]: the headline (2048 tokens x 4 sequences, hidden 2048, 16 heads of 128)
DEFAULT_SHAPE = (2048, 4, 2048, 16, 8192, 4)
#: GPT-2 small's layer (Radford et al. 2019): hidden 768, 12 heads of 64, ffn 3072; seq 1024, batch 8, 6 layers
GPT2_SMALL_SHAPE = (1024, 8, 768, 12, 3072, 6)
#: A small stack (seq 512, batch 8, hidden 512, 8 heads of 64, ffn 2048, 4 layers): kernels so short that the
#: host's launches decide the step time; timed with ``--sweep``.
SMALL_SHAPE = (512, 8, 512, 8, 2048, 4)
SHAPE_NAMES = ("s", "b", "h", "heads", "ffn", "layers")
HIDDEN_DROPOUT = 0.1  # Megatron-core's TransformerConfig default
ATTENTION_DROPOUT = 0.1  # Megatron-core's TransformerConfig default

IMPLS: dict[str, str] = {
    "fusedlib-unfused": "fusedlib's block from get_gpt_layer_unfused_spec: every fusion off, materialised attention",
    "fusedlib": "fusedlib's local spec, every fusion on, materialised attention with the softmax+dropout kernel",
    "fusedlib-sdpa": "fusedlib's local spec, every fusion on, attention_backend auto (scaled_dot_product_attention)",
    "fusedlib-flash": "fusedlib's local spec, every fusion on, attention_backend flash (fusedlib's Triton FlashAttention)",
    "fusedlib-fused-layer": "fusedlib-flash with FusedTransformerLayer: each layer's training step one autograd node",
    "fusedlib-fused-layer-local": "fusedlib (materialised attention) with FusedTransformerLayer, one node per layer",
    "fusedlib-fused-layer-sdpa": "fusedlib-sdpa with FusedTransformerLayer, one node per layer",
    "megatron-core-unfused": "megatron-core's get_gpt_layer_local_spec, fusions off",
    "megatron-core": "megatron-core's get_gpt_layer_local_spec, with every fusion it can run here switched on",
    "fusedlib-graphs": "fusedlib (materialised attention), cuda_graph_impl='local': the block's forward and backward "
                       "as CUDA graphs",
    "fusedlib-sdpa-graphs": "fusedlib-sdpa, cuda_graph_impl='local': the block's forward and backward as CUDA graphs",
    "eager": "plain PyTorch pre-LN GPT block with scaled_dot_product_attention, eager",
    "eager-graphs": "the plain PyTorch block, its layers' forward and backward as CUDA graphs (the same manager)",
    "torch.compile": "the plain PyTorch block, each layer torch.compile(dynamic=False)d, once per shape",
}

#: Rounds of plain-launch timings (:attr:`fusedlib.bench.core.BenchCase.plain_rounds`), every
#: implementation once per round, in turns; the median is kept. At the two smaller shapes the
#: host sets a plain-launch step's pace, and its speed moves over seconds: on the H200 machine
#: the GPT-2-small fusedlib block's 20-step windows in one process ranged from 16.3 to 18.0 ms,
#: and one benchmark run measured 27.8 ms for it where another had 17.0 (NOTES.md). Each round
#: adds one plain-launch timing (a 200 ms window) per implementation and shape, and one
#: CUDA-graph replay timing (``replay_rounds``: the replays' median is ``"ms"``) per capturable
#: implementation: the same kernels timed minutes apart can meet the GPU at another clock.
PLAIN_ROUNDS: int = 5

#: The implementations that run their layers as CUDA graphs (CUDA only).
GRAPH_IMPLS = ("fusedlib-graphs", "fusedlib-sdpa-graphs", "eager-graphs")

#: The TransformerConfig switches of "every fusion on" (apply_rope_fusion is on but idle: no RoPE here).
FUSIONS_ON = ("bias_activation_fusion", "gemm_gelu_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
              "persist_layer_norm", "apply_rope_fusion")

#: Profiled at DEFAULT_SHAPE, as plain launches (torch.compile: the goals' strongest baseline, its kernels beside
#: fusedlib's).
PROFILE_IMPLS = ("fusedlib-unfused", "fusedlib", "fusedlib-sdpa", "fusedlib-flash", "torch.compile")
PROFILE_FILE = "transformer_layer_profile.json"


# ---------------------------------------------------------------------------------------------
# Shapes, sizes
# ---------------------------------------------------------------------------------------------

def _check_shape(shape: Sequence[int]) -> tuple[int, int, int, int, int, int]:
    """``shape`` as a tuple [s, b, h, heads, ffn, layers] of positive ints, h divisible by heads.

    Raises:
        ValueError: naming ``shape`` and what is wrong with it.
    """
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be [s, b, h, heads, ffn, layers] of ints, got {shape!r}") from None
    if len(shape) != 6 or min(shape) < 1:
        raise ValueError(f"shape must be [s, b, h, heads, ffn, layers], six ints >= 1, got {list(shape)}")
    if shape[2] % shape[3]:
        raise ValueError(f"shape: hidden size h = {shape[2]} must be divisible by heads = {shape[3]}")
    return shape


def param_count(shape: Sequence[int]) -> int:
    """Parameters of the block at ``shape`` = [s, b, h, heads, ffn, layers] (every implementation has
    these): per layer two LayerNorms (2·2h), QKV (3h² + 3h), the attention's output (h² + h),
    fc1 (h·ffn + ffn) and fc2 (ffn·h + h); then the final LayerNorm (2h)."""
    _, _, h, _, ffn, layers = _check_shape(shape)
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
    return layers * per_layer + 2 * h


def gemm_flops(shape: Sequence[int], causal_half: bool = False) -> int:
    """FLOPs of the GEMMs of one training step (forward and backward) at ``shape``.

    Per layer and token, the forward multiplies by the weights (2·(4h² + 2h·ffn) FLOPs: QKV,
    the output projection, fc1, fc2) and computes attention, Q·Kᵀ and probabilities·V
    (2·2·s·h FLOPs); the backward costs twice the forward (a gradient for the input and one
    for the weights, or for both operands of the attention's products).

    Args:
        shape: [s, b, h, heads, ffn, layers].
        causal_half: count only the causal half of the attention's products (what a flash
            kernel computes, its recomputation in the backward not counted); False: all of
            them, as the materialised attention's dense GEMMs compute them.

    Returns:
        FLOPs per step (an exact int).
    """
    s, b, h, _, ffn, layers = _check_shape(shape)
    attention = 2 * 2 * s * h // (2 if causal_half else 1)
    fwd = s * b * layers * (2 * (4 * h * h + 2 * h * ffn) + attention)
    return 3 * fwd


# ---------------------------------------------------------------------------------------------
# The blocks
# ---------------------------------------------------------------------------------------------

def fusedlib_block(shape: Sequence[int], fused: bool, backend: AttnBackend = AttnBackend.local,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   cuda_graph: bool = False, fused_layer: bool = False) -> torch.nn.Module:
    """fusedlib's ``TransformerBlock`` at ``shape`` (its parameters random from the config's inits).

    Args:
        shape: [s, b, h, heads, ffn, layers] (s and b are not used to build).
        fused: every fusion on (:data:`FUSIONS_ON`) with ``get_gpt_layer_local_spec``; False:
            ``get_gpt_layer_unfused_spec`` with every switch off (``without_fusions``).
        backend: the attention backend with ``fused`` (local: materialised; auto or fused:
            SDPA; flash: fusedlib's FlashAttention kernel).
        dtype: the parameters' dtype (bf16: ``config.bf16`` too).
        device: where the parameters live.
        cuda_graph: ``cuda_graph_impl="local"`` (the layers as CUDA graphs; needs CUDA).
        fused_layer: with ``fused``, the local spec's submodules in a
            :class:`~fusedlib.transformer.fused_layer.FusedTransformerLayer` (any ``backend``).

    Returns:
        The block in training mode; call it as ``block(hidden_states, None)``.

    Raises:
        ValueError: a bad ``shape``; ``fused_layer`` without ``fused``.
    """
    from ...models.gpt.gpt_layer_specs import (get_gpt_fused_layer_spec, get_gpt_layer_local_spec,
                                               get_gpt_layer_unfused_spec, without_fusions)
    from ...transformer.transformer_block import TransformerBlock
    from ...transformer.transformer_config import TransformerConfig

    _, _, h, heads, ffn, layers = _check_shape(shape)
    if fused_layer and not fused:
        raise ValueError("fused_layer: FusedTransformerLayer runs the fused local spec; pass fused=True with it")
    device = torch.device(device)
    cfg = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
                            hidden_dropout=HIDDEN_DROPOUT, attention_dropout=ATTENTION_DROPOUT, params_dtype=dtype,
                            bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, activation_func=F.gelu,
                            add_bias_linear=True, use_cpu_initialization=device.type == "cpu",
                            attention_backend=backend, cuda_graph_impl="local" if cuda_graph else "none",
                            **{k: True for k in FUSIONS_ON})
    if fused and fused_layer:
        block = TransformerBlock(cfg, get_gpt_fused_layer_spec())
    elif fused:
        block = TransformerBlock(cfg, get_gpt_layer_local_spec())
    else:
        block = TransformerBlock(without_fusions(cfg), get_gpt_layer_unfused_spec())
    return block.to(device).train()


def init_megatron(seed: int = 1234) -> None:
    """Set up what megatron-core's layers need: a one-rank NCCL process group (on a free local
    port, destroyed at the process's exit) unless one exists, ``parallel_state`` with tensor- and
    pipeline-parallel size 1 unless it is set up, and megatron-core's graph-safe CUDA RNG tracker
    unless that is the tracker in use (``model_parallel_cuda_manual_seed(seed,
    use_cudagraphable_rng=True, force_reset_rng=True)``: this seeds torch's CUDA generator and
    replaces a tracker made earlier in the process without graph-safe states;
    :func:`megatron_generators` gives the tracker's states). Called at every build of one of its
    blocks; after the first it changes nothing.

    Raises:
        ImportError: megatron-core does not import. RuntimeError: from torch.distributed (no CUDA).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    if tracker is None or not megatron_random.is_graph_safe_cuda_rng_tracker(tracker):
        megatron_random.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)


def megatron_generators() -> list[torch.Generator]:
    """The generator states of megatron-core's graph-safe CUDA RNG tracker (its data-, tensor-
    and expert-parallel ones), which a CUDA graph of its layers must register
    (``CUDAGraph.register_generator_state``): its ``fork()`` swaps them into the default CUDA
    generator (``graphsafe_set_state``), and a capture that draws from a state it did not
    register fails. (megatron-core's plain tracker copies a saved state in instead
    (``set_state``), which a capture refuses.) Empty before :func:`init_megatron`.

    Raises:
        RuntimeError: the tracker in use is megatron-core's plain one (its states are byte
            tensors, not generators): :func:`init_megatron` replaces it.

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``CudaRNGStatesTracker``
    with ``use_cudagraphable_rng``, ``is_graph_safe_cuda_rng_tracker``).
    """
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random._CUDA_RNG_STATE_TRACKER  # (get_cuda_rng_tracker() would make a plain one)
    if tracker is None:
        return []
    if not megatron_random.is_graph_safe_cuda_rng_tracker(tracker):
        raise RuntimeError("megatron-core's CUDA RNG tracker is not its graph-safe one: call "
                           "fusedlib.bench.ops.transformer_layer.init_megatron() first (it replaces it)")
    return list(tracker.get_states().values())


def _megatron_fusions(fused: bool) -> tuple[dict, dict[str, str]]:
    """megatron-core's fusion switches (on where they can run here) and why the others are off."""
    if not fused:
        return {}, {}
    on = {"bias_activation_fusion": True, "bias_dropout_fusion": True}  # torch.compile'd PyTorch
    off = {}
    if importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is None:
        off["masked_softmax_fusion"] = "its CUDA extension scaled_upper_triang_masked_softmax_cuda is not installed"
    else:
        on["masked_softmax_fusion"] = True
    if importlib.util.find_spec("apex") is None:  # the local spec then builds torch's norms (WrappedTorchNorm)
        off["persist_layer_norm"] = "Apex is not installed: the local spec builds torch's LayerNorm"
    else:
        on["persist_layer_norm"] = True
    return on, off


def megatron_block(shape: Sequence[int], fused: bool, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cuda") -> torch.nn.Module:
    """megatron-core's ``TransformerBlock`` from its ``get_gpt_layer_local_spec`` at ``shape``, with
    the fusions :func:`_megatron_fusions` finds runnable (``fused``) or none, in training mode;
    call it as ``block(hidden_states, None)``. Calls :func:`init_megatron` first.

    Raises:
        ImportError: megatron-core does not import.
    """
    init_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    _, _, h, heads, ffn, layers = _check_shape(shape)
    on, _ = _megatron_fusions(fused)
    cfg = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
                            hidden_dropout=HIDDEN_DROPOUT, attention_dropout=ATTENTION_DROPOUT, params_dtype=dtype,
                            bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, activation_func=F.gelu,
                            add_bias_linear=True, **on)
    # (torch's norms, built on the CPU by WrappedTorchNorm where Apex is absent: move everything)
    return TransformerBlock(cfg, get_gpt_layer_local_spec()).to(device=device, dtype=dtype).train()


class PlainGPTLayer(torch.nn.Module):
    """A pre-LN GPT layer in plain PyTorch: x + dropout(proj(attn(ln1(x)))), then
    x + dropout(fc2(gelu(fc1(ln2(x))))), causal ``scaled_dot_product_attention`` with its own
    dropout, tanh GeLU (GPT-2's), a bias in every linear layer.

    Args:
        h, heads, ffn: hidden size, attention heads (h divisible by heads), MLP width.
        hidden_dropout, attention_dropout: the probabilities (applied in training only).
        device, dtype: the parameters' (torch's factory arguments).

    ``forward(x)``: x [s, b, h] -> [s, b, h], x's dtype.

    Source: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019), the
    pre-LN GPT-2 layer; PyTorch's ``scaled_dot_product_attention``.
    """

    def __init__(self, h: int, heads: int, ffn: int, hidden_dropout: float = HIDDEN_DROPOUT,
                 attention_dropout: float = ATTENTION_DROPOUT, device=None, dtype=None) -> None:
        super().__init__()
        if h % heads:
            raise ValueError(f"h = {h} must be divisible by heads = {heads}")
        f = dict(device=device, dtype=dtype)
        self.heads, self.hidden_dropout, self.attention_dropout = heads, hidden_dropout, attention_dropout
        self.ln1 = torch.nn.LayerNorm(h, **f)
        self.qkv = torch.nn.Linear(h, 3 * h, **f)
        self.proj = torch.nn.Linear(h, h, **f)
        self.ln2 = torch.nn.LayerNorm(h, **f)
        self.fc1 = torch.nn.Linear(h, ffn, **f)
        self.fc2 = torch.nn.Linear(ffn, h, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        hn = h // self.heads
        qkv = self.qkv(self.ln1(x))  # [s, b, 3h]
        # [s, b, 3h] -> [s, b, 3, np, hn] -> 3 x [b, np, s, hn] (views: SDPA takes strided inputs)
        q, k, v = qkv.view(s, b, 3, self.heads, hn).permute(2, 1, 3, 0, 4).unbind(0)
        p = self.attention_dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [b, np, s, hn]
        a = a.permute(2, 0, 1, 3).reshape(s, b, h)  # [b, np, s, hn] -> [s, b, np·hn]
        x = x + F.dropout(self.proj(a), self.hidden_dropout, self.training)
        y = F.gelu(self.fc1(self.ln2(x)), approximate="tanh")  # [s, b, ffn]
        return x + F.dropout(self.fc2(y), self.hidden_dropout, self.training)


class PlainGPTBlock(torch.nn.Module):
    """``layers`` :class:`PlainGPTLayer` and a final LayerNorm: [s, b, h] -> [s, b, h].

    Args: as :class:`PlainGPTLayer`, plus ``layers``.
    """

    def __init__(self, h: int, heads: int, ffn: int, layers: int, hidden_dropout: float = HIDDEN_DROPOUT,
                 attention_dropout: float = ATTENTION_DROPOUT, device=None, dtype=None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(PlainGPTLayer(h, heads, ffn, hidden_dropout, attention_dropout,
                                                        device=device, dtype=dtype) for _ in range(layers))
        self.final_layernorm = torch.nn.LayerNorm(h, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class GraphedPlainGPTBlock(PlainGPTBlock):
    """:class:`PlainGPTBlock` whose layers and final norm run, in training with grad on a CUDA
    device, as CUDA graphs through fusedlib's
    :class:`~fusedlib.transformer.cuda_graphs.CudaGraphManager` (the one behind
    ``cuda_graph_impl="local"``: ``torch.cuda.make_graphed_callables``, one forward and one
    backward graph for the stack, the same checks, guards, gradient copies and output copy); so
    the two graphed implementations of this benchmark do the same work around their graphs.
    In eval mode, without grad or under another capture: the eager layers. As the manager
    raises, a training call on a CPU raises ValueError (the benchmark builds it on CUDA only).

    Args and ``forward``: as :class:`PlainGPTBlock`.

    Source: PyTorch ``torch.cuda.make_graphed_callables`` and its CUDA-graphs notes.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cudagraph_manager = CudaGraphManager()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cudagraph_manager.applies(self, x):
            return super().forward(x)
        return self.cudagraph_manager.run(self.layers, x, {}, final_norm=self.final_layernorm)


class _Model:
    """A block built at its first call, on the input's device and in its dtype, then run.

    ``build(device, dtype) -> module``; ``call(module, x) -> output``. :meth:`params` gives the
    parameters once built (none before), for the harness to reset their gradients; building
    lazily keeps ``cases()`` free of allocations (the test suite builds every case on a CPU)."""

    def __init__(self, build: Callable[[torch.device, torch.dtype], torch.nn.Module],
                 call: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> None:
        self.build, self.call, self.module = build, call, None

    def ensure(self, x: torch.Tensor) -> torch.nn.Module:
        if self.module is None:
            self.module = self.build(x.device, x.dtype)
        return self.module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.ensure(x), x)

    def layer_by_layer(self, layer_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A :class:`PlainGPTBlock`'s forward with ``layer_fn(layer, x)`` (a compiled
        :func:`_layer_forward`) for each layer, the final norm eager; builds the block first."""
        def run(x: torch.Tensor) -> torch.Tensor:
            block = self.ensure(x)
            for layer in block.layers:
                x = layer_fn(layer, x)
            return block.final_layernorm(x)
        return run

    def params(self) -> list[torch.Tensor]:
        return [] if self.module is None else list(self.module.parameters())


def _block_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x, None)  # TransformerBlock.forward(hidden_states, attention_mask): causal, no mask


def _plain_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _layer_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One layer's forward: what the ``torch.compile`` baseline compiles (once for every layer)."""
    return layer(x)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

def case(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16, *,
         compile_backend: str | Callable = "inductor", cuda_graphs: Optional[bool] = None) -> BenchCase:
    """One training step at ``shape`` = [s, b, h, heads, ffn, layers] with every implementation
    of :data:`IMPLS` (megatron-core's where it imports). Nothing is built until an
    implementation's first call.

    Args:
        shape: see above.
        dtype: of the parameters and the hidden states (bf16 for the numbers; tests use others).
        compile_backend: ``torch.compile``'s backend for the compiled layers (tests pass "eager").
        cuda_graphs: include the three ``-graphs`` implementations, which need CUDA (None: where
            ``torch.cuda.is_available()``); left out, ``skipped`` says why.

    Returns:
        The case: input ``(x,)`` with x [s, b, h] random; pass "fwd+bwd" only; ``bytes`` None;
        ``tokens`` s·b; ``peak_memory`` on.

    Raises:
        ValueError: a bad ``shape``.
    """
    shape = _check_shape(shape)
    s, b, h, heads, ffn, layers = shape

    def make_inputs(device, requires_grad):
        return (torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=requires_grad),)

    step = ("fwd+bwd",)
    fused_on = list(FUSIONS_ON)
    if cuda_graphs is None:
        cuda_graphs = torch.cuda.is_available()

    def impl(name: str, model: _Model, generators=None, **info) -> Impl:
        return Impl(name, model, passes=step, params=model.params, info=info, generators=generators)

    impls = [
        impl("fusedlib-unfused", _Model(lambda d, t: fusedlib_block(shape, False, dtype=t, device=d), _block_call),
             fusions=[], attention="materialised"),
        impl("fusedlib", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.local, t, d), _block_call),
             fusions=fused_on, attention="materialised"),
        impl("fusedlib-sdpa", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.auto, t, d), _block_call),
             fusions=fused_on, attention="sdpa"),
        impl("fusedlib-flash", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.flash, t, d), _block_call),
             fusions=fused_on, attention="flash"),
        impl("fusedlib-fused-layer", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.flash, t, d,
                                                                        fused_layer=True), _block_call),
             fusions=fused_on, attention="flash", layer="FusedTransformerLayer"),
        impl("fusedlib-fused-layer-local", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.local, t, d,
                                                                              fused_layer=True), _block_call),
             fusions=fused_on, attention="materialised", layer="FusedTransformerLayer"),
        impl("fusedlib-fused-layer-sdpa", _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.auto, t, d,
                                                                             fused_layer=True), _block_call),
             fusions=fused_on, attention="sdpa", layer="FusedTransformerLayer"),
    ]
    if cuda_graphs:
        impls.append(impl("fusedlib-graphs",
                          _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.local, t, d, cuda_graph=True),
                                 _block_call), fusions=fused_on, attention="materialised", cuda_graph_impl="local"))
        impls.append(impl("fusedlib-sdpa-graphs",
                          _Model(lambda d, t: fusedlib_block(shape, True, AttnBackend.auto, t, d, cuda_graph=True),
                                 _block_call), fusions=fused_on, attention="sdpa", cuda_graph_impl="local"))
    skipped = {} if cuda_graphs else {name: "CUDA graphs need a CUDA device" for name in GRAPH_IMPLS}
    spec, why = try_import("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec")
    if spec is not None:
        for name, fused in (("megatron-core-unfused", False), ("megatron-core", True)):
            on, off = _megatron_fusions(fused)
            model = _Model(lambda d, t, fused=fused: megatron_block(shape, fused, t, d), _block_call)
            impls.append(impl(name, model, generators=megatron_generators, fusions=sorted(on),
                              fusions_unavailable=off, attention="materialised", rng_tracker="graph-safe"))
    else:
        skipped["megatron-core-unfused"] = skipped["megatron-core"] = why

    def build_plain(d, t):
        return PlainGPTBlock(h, heads, ffn, layers, device=d, dtype=t).train()

    impls.append(impl("eager", _Model(build_plain, _plain_call), fusions=[], attention="sdpa"))
    if cuda_graphs:
        def build_graphed(d, t):
            return GraphedPlainGPTBlock(h, heads, ffn, layers, device=d, dtype=t).train()

        impls.append(impl("eager-graphs", _Model(build_graphed, _plain_call), fusions=[], attention="sdpa",
                          cuda_graph_impl="local"))
    plain = _Model(build_plain, _plain_call)
    comp = compile_impl(_layer_forward, adapt=plain.layer_by_layer, backend=compile_backend)
    comp.passes, comp.params = step, plain.params
    comp.info = dict(fusions=[], attention="sdpa", compile_scope="layer")
    impls.append(comp)

    elem = torch.finfo(dtype).bits // 8
    info = {"shape_names": list(SHAPE_NAMES), "hidden_dropout": HIDDEN_DROPOUT,
            "attention_dropout": ATTENTION_DROPOUT, "params": param_count(shape),
            "weight_bytes": param_count(shape) * elem}
    return BenchCase("transformer_layer", shape, dtype, make_inputs, {"fwd+bwd": None}, impls, skipped,
                     peak_memory=True, tokens=s * b, info=info, plain_rounds=PLAIN_ROUNDS, replay_rounds=True)


def cases(device: torch.device, sweep: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[BenchCase]:
    """:data:`DEFAULT_SHAPE` then :data:`GPT2_SMALL_SHAPE`, each with every implementation and its
    own static compile; ``sweep`` adds :data:`SMALL_SHAPE`."""
    shapes = (DEFAULT_SHAPE, GPT2_SMALL_SHAPE) + ((SMALL_SHAPE,) if sweep else ())
    return [case(shape, dtype, cuda_graphs=device.type == "cuda") for shape in shapes]


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def _order(impl: str) -> int:
    names = list(IMPLS)
    return names.index(impl) if impl in names else len(names)


def table(records: Sequence[dict]) -> str:
    """Text table of ``transformer_layer`` records, one block per shape: ms per step with plain
    launches and as a CUDA-graph replay, tokens/s of each, the step's peak memory beyond the
    weights and the input (GB), and how many times faster ``fusedlib`` is than each
    implementation with plain launches (the time an eager training step pays).

    A graph time that could not be measured (the capture failed) shows ``-``, its reason below
    the table. Records of other ops (the copy ceiling) are ignored.

    Args:
        records: bench records (only ``"op": "transformer_layer"`` ones are read).

    Returns:
        The table (``"no transformer_layer records"`` when there is none).

    Raises:
        ValueError: naming the record, when a ``transformer_layer`` record lacks ``shape``,
            ``impl``, ``ms``, ``dtype`` or ``device``.

    Source: the benchmark protocol of :mod:`fusedlib.bench` (its ``transformer_layer`` records).
    """
    require_fields("throughput_table", records, ("shape", "impl", "ms", "dtype", "device"),
                   when=lambda r: r.get("op") == "transformer_layer")
    rows = [r for r in records if r.get("op") == "transformer_layer"]
    if not rows:
        return "no transformer_layer records"
    out = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        at = sorted((r for r in rows if tuple(r["shape"]) == shape), key=lambda r: _order(r["impl"]))
        first = at[0]
        names = first.get("shape_names", SHAPE_NAMES)
        fused = next((r for r in at if r["impl"] == "fusedlib"), None)
        out.append(f"{', '.join(f'{n} {v}' for n, v in zip(names, shape))}: {first.get('tokens', '?')} tokens "
                   f"per step, {first['dtype']}, one training step (fwd+bwd), {first['device']}")
        w = max(23, 1 + max(len(r["impl"]) for r in at))  # the longest name and a space
        out.append(f"{'impl':<{w}}{'plain ms':>10}{'graph ms':>10}{'tok/s plain':>13}{'tok/s graph':>13}"
                   f"{'peak GB':>9}{'fusedlib is':>13}")
        notes = []
        for r in at:
            graph = r.get("timer") == "cuda_graph"
            plain_ms = r.get("ms_eager", r["ms"])
            plain_tps = r.get("tokens_per_s_eager", r.get("tokens_per_s"))
            g_ms = f"{r['ms']:.2f}" if graph else "-"
            g_tps = f"{r['tokens_per_s'] / 1e3:.0f}k" if graph and r.get("tokens_per_s") else "-"
            p_tps = f"{plain_tps / 1e3:.0f}k" if plain_tps else "-"
            peak = f"{r['peak_bytes'] / 1e9:.2f}" if r.get("peak_bytes") is not None else "-"
            ratio = ""
            if fused is not None and r["impl"] != "fusedlib":
                ratio = f"{plain_ms / fused.get('ms_eager', fused['ms']):.2f}x"
            out.append(f"{r['impl']:<{w}}{plain_ms:>10.2f}{g_ms:>10}{p_tps:>13}{g_tps:>13}{peak:>9}{ratio:>13}")
            if r.get("graph_error"):
                why = r["graph_error"]
                if len(why) > 120:  # cut at a word's end
                    why = why[:120].rsplit(" ", 1)[0] + " ..."
                notes.append(f"  {r['impl']}: no CUDA graph ({why})")
        out += notes
        out.append("")
    return "\n".join(out).rstrip()


# ---------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------

#: kernel-name fragments (lower case) -> category, first match wins: cuBLAS/CUTLASS GEMMs, fusedlib's
#: FlashAttention kernels (chapter 8), SDPA's attention kernels, softmax, the norms, then everything
#: else (bias, activation, dropout, adds, casts, copies) as elementwise.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "sm90_", "sm80_")),
    ("attention (fusedlib flash)", ("_flash_fwd_kernel", "_flash_bwd_")),
    ("attention (SDPA)", ("flash", "fmha", "attention", "attn")),
    ("softmax (+dropout)", ("softmax",)),
    ("norm", ("layer_norm", "layernorm", "_norm_", "rms_norm")),
)


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel, from its name (:data:`CATEGORIES`; else "elementwise & other")."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise & other"


def kernel_summary(kernels: Iterable[tuple[str, float]], steps: int, top: int = 12,
                   span: Optional[tuple[float, float]] = None) -> dict:
    """Per-step totals of ``(kernel name, microseconds)`` pairs collected over ``steps`` steps.

    Args:
        kernels: ``(name, us)`` of every kernel (:func:`device_events`).
        steps: how many steps they cover (>= 1).
        top: kernels listed.
        span: ``(span_us, busy_us)`` of the same kernels (:func:`device_span`), or None.

    Returns:
        ``{"kernel_ms": total kernel time per step, "launches": kernels per step, "categories":
        {category: ms per step}, "top": [{"name", "category", "calls", "ms", "share"}]}``: the
        ``top`` kernels by total time (calls and ms per step, share of the step's kernel time),
        names cut to 200 characters. With ``span``, also ``"span_ms"`` (from the first kernel's
        start to the last one's end, per step) and ``"idle_ms"`` (the time in that span when no
        kernel ran: launch gaps, host work the device waits for; per step). Recorded under
        ``torch.profiler``, whose own host work per operation lengthens the gaps of plain
        launches: an upper bound on what the same steps leave idle without the profiler.

    Raises:
        ValueError: ``steps`` not an int >= 1; ``span`` not a pair of finite numbers with
            0 <= busy_us <= span_us.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if span is not None and not (
            isinstance(span, tuple) and len(span) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in span)
            and 0 <= span[1] <= span[0]):
        raise ValueError(f"span must be (span_us, busy_us) as device_span gives it: finite, with "
                         f"0 <= busy_us <= span_us, got {span!r}")
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    total = sum(sum(v) for v in by_name.values()) / steps / 1e3
    cats: dict[str, float] = {}
    for name, v in by_name.items():
        cat = kernel_category(name)
        cats[cat] = cats.get(cat, 0.0) + sum(v) / steps / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    timeline = {} if span is None else {"span_ms": round(span[0] / steps / 1e3, 4),
                                        "idle_ms": round((span[0] - span[1]) / steps / 1e3, 4)}
    return {
        "kernel_ms": round(total, 4),
        **timeline,
        "launches": round(sum(len(v) for v in by_name.values()) / steps, 1),
        "categories": {c: round(ms, 4) for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name[:200], "category": kernel_category(name), "calls": round(len(v) / steps, 1),
                 "ms": round(sum(v) / steps / 1e3, 4), "share": round(sum(v) / steps / 1e3 / total, 4) if total else 0.0}
                for name, v in ranked],
    }


def device_events(prof, device_type) -> list[tuple[str, float]]:
    """(name, microseconds) of every event of ``device_type`` (CUDA: the kernels) a profiler
    recorded, without user ranges (``record_function``'s, e.g. ``Optimizer.step#AdamW.step``):
    they span kernels that are listed already."""
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == device_type and not e.is_user_annotation]


def device_span(prof, device_type) -> tuple[float, float]:
    """``(span_us, busy_us)`` of the device events :func:`device_events` lists: span from the
    first one's start to the last one's end, busy the length of the union of their intervals
    (kernels that overlap count once). ``(0.0, 0.0)`` without events."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == device_type and not e.is_user_annotation)
    if not intervals:
        return 0.0, 0.0
    busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
    for start, end in intervals[1:]:
        if start > cur_end:  # a gap: close the current run of overlapping intervals
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return float(cur_end - intervals[0][0]), float(busy)  # (the last run ends last)


def profiler_setup(device: torch.device) -> tuple[list, torch.autograd.DeviceType, Callable[[], None]]:
    """``(activities, kind, sync)`` for profiling on ``device``: on CUDA, CPU and CUDA activity
    (the kernels are then correlated with the operators that launched them) and the CUDA
    events; on the CPU (for tests), the CPU operators; ``sync`` waits for the device."""
    from torch.profiler import ProfilerActivity

    if device.type == "cuda":
        return ([ProfilerActivity.CPU, ProfilerActivity.CUDA], torch.autograd.DeviceType.CUDA,
                lambda: torch.cuda.synchronize(device))
    return [ProfilerActivity.CPU], torch.autograd.DeviceType.CPU, lambda: None


def _training_step(im: Impl, c: BenchCase, device: torch.device) -> Callable[[], None]:
    """A step of implementation ``im`` of case ``c``: the benchmark's fwd+bwd pass, the input's
    and the parameters' gradients set to None first."""
    (x,) = c.make_inputs(device, True)
    g = torch.randn_like(im.fn(x))  # (the first call builds the module)
    leaves = [x] + list(im.params())

    def step():
        for t in leaves:
            t.grad = None
        im.fn(x).backward(g)

    return step


def _profile_steps(step: Callable[[], None], device: torch.device, steps: int, top: int,
                   window: Optional[list] = None) -> dict:
    """:func:`kernel_summary` of ``steps`` calls of ``step`` under ``torch.profiler``; ``window``
    (a list) gets ``(t0, t1)``, the ``time.time()`` seconds from the first step's launch to the
    last one's end (the profiler's start-up and the trace's parsing left out)."""
    import time

    from torch.profiler import profile as torch_profile

    activities, kind, sync = profiler_setup(device)
    sync()
    with torch_profile(activities=activities) as prof:
        t0 = time.time()
        for _ in range(steps):
            step()
        sync()
        t1 = time.time()
    if window is not None:
        window.append((t0, t1))
    return kernel_summary(device_events(prof, kind), steps, top, device_span(prof, kind))


def profile(device: torch.device | str = "cuda", shape: Sequence[int] = DEFAULT_SHAPE,
            impls: Sequence[str] = PROFILE_IMPLS, steps: int = 3, warmup: int = 2, top: int = 16,
            dtype: torch.dtype = torch.bfloat16) -> dict:
    """Where a training step's time goes: the kernels ``torch.profiler`` records in ``steps``
    plain-launch steps of each implementation in ``impls`` (after ``warmup`` steps), per step.

    Args:
        device: a CUDA device (on the CPU the CPU operators are recorded instead: for tests).
        shape, dtype: the case's.
        impls: names of :data:`IMPLS`.
        steps, warmup, top: steps profiled, untimed steps first (compiles), kernels listed.

    Returns:
        ``{"op": "transformer_layer", "shape", "shape_names", "dtype", "steps", device and
        versions, "impls": {name: kernel_summary(...)}}``; an implementation that fails is left
        out and named in ``"skipped"`` with its error.

    Raises:
        ValueError: an unknown implementation name.
    """
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        raise ValueError(f"impls: unknown {unknown}; known: {', '.join(IMPLS)}")
    device = torch.device(device)
    c = case(shape, dtype)
    out = {"op": "transformer_layer", "shape": list(c.shape), "shape_names": list(SHAPE_NAMES),
           "dtype": str(dtype).replace("torch.", ""), "steps": steps, **environment(), "impls": {}, "skipped": {}}
    for im in c.impls:
        if im.name not in impls:
            continue
        try:
            step = _training_step(im, c, device)
            for _ in range(warmup):
                step()
            out["impls"][im.name] = _profile_steps(step, device, steps, top)
        except Exception as exc:  # one failing implementation must not lose the others
            out["skipped"][im.name] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if isinstance(im.fn, _Model):
                im.fn.module = None  # free its weights before the next one
    return out


def profile_table(prof: dict, top: int = 8) -> str:
    """Text table of a :func:`profile` result: per implementation, the kernel time per step and
    its split by category (ms and share), then its ``top`` kernels (names cut to 70 characters).

    Args:
        prof: a :func:`profile` result (a dict, as ``transformer_layer_profile.json`` holds it).
        top: how many of each implementation's kernels to list.

    Returns:
        The table.

    Raises:
        ValueError: when ``prof`` is not a dict with ``shape``, ``steps``, ``dtype``, ``device``
            and ``impls``, or an implementation's summary lacks ``kernel_ms``, ``launches``,
            ``categories`` or ``top`` (the message names the missing keys).

    Source: fusedlib's profile of one training step (:func:`profile`, torch.profiler's kernels).
    """
    if not isinstance(prof, dict):
        raise ValueError(f"profile_table: prof is a {type(prof).__name__}, expected a profile() result (a dict)")
    missing = [k for k in ("shape", "steps", "dtype", "device", "impls") if k not in prof]
    if missing:
        raise ValueError(f"profile_table: the profile has no {', '.join(map(repr, missing))} "
                         "(expected a profile() result)")
    if not isinstance(prof["impls"], dict):
        raise ValueError(f"profile_table: the profile's 'impls' is a {type(prof['impls']).__name__}, expected a dict")
    for name, summary in prof["impls"].items():
        missing = [k for k in ("kernel_ms", "launches", "categories", "top")
                   if not isinstance(summary, dict) or k not in summary]
        if missing:
            raise ValueError(f"profile_table: the profile's impls[{name!r}] has no {', '.join(map(repr, missing))} "
                             "(expected a kernel_summary() result)")
    shape = ", ".join(f"{n} {v}" for n, v in zip(prof.get("shape_names", SHAPE_NAMES), prof["shape"]))
    out = [f"kernels of one training step (plain launches, {prof['steps']} steps profiled), {shape}, "
           f"{prof['dtype']}, {prof['device']}"]
    for name in sorted(prof["impls"], key=_order):
        out += kernel_summary_lines(name, prof["impls"][name], top)
    for name, why in prof.get("skipped", {}).items():
        out.append(f"{name}: not profiled ({why})")
    return "\n".join(out)


def kernel_summary_lines(name: str, summary: dict, top: int = 8) -> list[str]:
    """Text lines of one :func:`kernel_summary`: the kernel time per step, its categories (ms and
    share), then its ``top`` kernels (names cut to 70 characters; calls and ms per step, share)."""
    p = summary
    out = [f"\n{name}: {p['kernel_ms']:.2f} ms of kernels per step, {p['launches']:.0f} launches"
           + (f"; first kernel to last {p['span_ms']:.2f} ms, no kernel running {p['idle_ms']:.2f} ms"
              if "span_ms" in p else "")]
    for cat, ms in p["categories"].items():
        out.append(f"  {cat:<28}{ms:>9.2f} ms {100 * ms / p['kernel_ms'] if p['kernel_ms'] else 0:>6.1f}%")
    out.append(f"  top {min(top, len(p['top']))} kernels:{'calls':>56}{'ms':>9}{'share':>8}")
    for k in p["top"][:top]:
        label = k["name"] if len(k["name"]) <= 70 else k["name"][:67] + "..."
        out.append(f"    {label:<70}{k['calls']:>5.0f}{k['ms']:>9.3f}{100 * k['share']:>7.1f}%")
    return out


def extra_files(device: torch.device, out_dir: str | Path, log: Callable[[str], object] = print) -> list[Path]:
    """Write :func:`profile` on ``device`` to ``out_dir/transformer_layer_profile.json`` and, on a
    CUDA device, :func:`power_state` to ``out_dir/transformer_layer_power.json``, passing their
    tables to ``log`` (the CLI gives ``tqdm.write``). Returns the written paths."""
    prof = profile(device)
    paths = [_write_stored(out_dir, PROFILE_FILE, prof)]
    log(profile_table(prof))
    if torch.device(device).type == "cuda":
        paths.append(write_power_state(device, out_dir, log))
    return paths


def load_profile(path: Optional[str | Path] = None) -> Optional[dict]:
    """The stored profile (default: ``transformer_layer_profile.json`` in
    :func:`fusedlib.book.bench_dir`), or None when it has not been written yet."""
    return _load_stored(path, PROFILE_FILE)


def _write_stored(out_dir: str | Path, name: str, data: dict) -> Path:
    """``data`` as JSON in ``out_dir/name`` (folders made as needed); the path."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _load_stored(path: Optional[str | Path], name: str) -> Optional[dict]:
    """The JSON at ``path`` (None: ``name`` in :func:`fusedlib.book.bench_dir`), or None when
    there is no such file."""
    if path is None:
        from ...book import bench_dir

        path = bench_dir() / name
    path = Path(path)
    if not path.exists():
        return None
    from ...book import read_record

    return read_record(path)


# ---------------------------------------------------------------------------------------------
# The clock under load
# ---------------------------------------------------------------------------------------------

#: The implementations :func:`power_state` times: the two pairs of the chapter's goals (every fusion
#: on against megatron-core's local spec; the SDPA block against the compiled plain block).
POWER_IMPLS = ("fusedlib", "megatron-core", "fusedlib-sdpa", "torch.compile")
POWER_FILE = "transformer_layer_power.json"


def power_state(device: torch.device | str = "cuda", shape: Sequence[int] = DEFAULT_SHAPE,
                impls: Sequence[str] = POWER_IMPLS, rounds: int = 2, windows_ms: Sequence[int] = (200, 3000),
                rest_s: float = 1.0, profile_steps: int = 3, warmup: int = 5,
                dtype: torch.dtype = torch.bfloat16, sampler: Optional[Callable[[], object]] = None) -> dict:
    """Each implementation's training step timed over a short and a long window of back-to-back
    steps, and profiled over a few steps, with the SM clock and board power during each
    (:mod:`fusedlib.bench.clocks`).

    The short window is the benchmark's own (``time_ms``'s default 200 ms of steps: the table's
    plain-launch timings); the long one keeps the GPU loaded for seconds, as training does, long
    enough for the board to reach its power limit. ``rounds`` rounds go through the
    implementations in turn, ``rest_s`` of idle before each timing, so that no implementation
    always follows another; then each is profiled as :func:`profile` does (``profile_steps``
    steps after a rest), which shows the clock the profile's kernel times were measured at.

    Args:
        device: a CUDA device.
        shape, dtype: the case's.
        impls: names of :data:`IMPLS`.
        rounds: >= 1.
        windows_ms: do_bench's repetition budgets (ms), each >= 1.
        rest_s: idle seconds before each timing (>= 0).
        profile_steps, warmup: steps profiled; untimed steps first (compiles), each >= 1.
        sampler: a factory of a :class:`~fusedlib.bench.clocks.ClockSampler`-like context
            manager (``samples()``, ``fields``, ``error``); None: ``nvidia-smi`` on ``device``'s
            GPU (by its UUID: :func:`~fusedlib.bench.clocks.gpu_id`).

    Returns:
        ``{"op": "transformer_layer_power", "shape", "shape_names", "dtype", device and versions,
        "rounds", "windows_ms", "rest_s", "profile_steps", "sampler": {"fields", "error",
        "interval_ms", and the sampler's ``limits``: "power_limit_w", "sm_max_mhz"}, "phases":
        [...], "skipped": {...}}``; each phase ``{"impl", "round", "timer": "do_bench",
        "window_ms", "ms", clocks...}`` or ``{"impl", "timer": "profile", "steps", "kernel_ms",
        "span_ms", "idle_ms", "launches", clocks...}`` with
        :func:`~fusedlib.bench.clocks.summarize`'s fields over the phase's wall-clock window: a
        timing's whole ``time_ms`` call (its estimate and warm-up steps included), a profile's
        steps alone (from the first one's launch to the last one's end).
        An implementation that fails (in its set-up, a timing or its profile) is named in
        ``"skipped"`` with its error and left out from there on; its phases before the failure
        stay.

    Raises:
        ValueError: a device other than CUDA; an unknown implementation name; a count or
            window out of range.
    """
    import time

    from ..clocks import ClockSampler, gpu_id, summarize
    from ..core import time_ms

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"power_state times CUDA kernels and samples the GPU's clock: device must be CUDA, "
                         f"got {device}")
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        raise ValueError(f"impls: unknown {unknown}; known: {', '.join(IMPLS)}")
    impls, windows_ms = list(impls), list(windows_ms)  # (a generator would be used up by the checks)
    for name, v in (("rounds", rounds), ("profile_steps", profile_steps), ("warmup", warmup), *(
            ("windows_ms", w) for w in windows_ms)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} must be an int >= 1 (windows_ms: each of them), got {v!r}")
    rounds, profile_steps, warmup, windows_ms = int(rounds), int(profile_steps), int(warmup), [int(w) for w in windows_ms]
    if isinstance(rest_s, bool) or not (isinstance(rest_s, numbers.Real) and math.isfinite(rest_s) and rest_s >= 0):
        raise ValueError(f"rest_s must be a finite number >= 0, got {rest_s!r}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = case(shape, dtype)
    out = {"op": "transformer_layer_power", "shape": list(c.shape), "shape_names": list(SHAPE_NAMES),
           "dtype": str(dtype).replace("torch.", ""), **environment(), "rounds": rounds,
           "windows_ms": windows_ms, "rest_s": rest_s, "profile_steps": profile_steps, "sampler": None,
           "phases": [], "skipped": {}}
    out["skipped"].update({n: why for n, why in c.skipped.items() if n in impls})  # (megatron-core not importable)
    steps = {}

    def drop(im: Impl, exc: Exception) -> None:
        """Leave ``im`` out from here on, with its error (one failing implementation must not lose
        the others), and free its weights."""
        out["skipped"][im.name] = f"{type(exc).__name__}: {exc}"[:300]
        steps.pop(im.name, None)
        if isinstance(im.fn, _Model):
            im.fn.module = None

    for im in c.impls:
        if im.name in impls:
            try:
                step = _training_step(im, c, device)
                for _ in range(warmup):
                    step()
                torch.cuda.synchronize(device)
                steps[im.name] = (im, step)
            except Exception as exc:
                drop(im, exc)
    with (sampler or (lambda: ClockSampler(gpu_id(device))))() as smp:
        out["sampler"] = {"fields": list(smp.fields) if smp.fields else None, "error": smp.error,
                          "interval_ms": getattr(smp, "interval_ms", None), **(getattr(smp, "limits", None) or {})}
        started = time.time()
        while smp.fields and not smp.samples() and time.time() - started < 5.0:
            time.sleep(0.02)  # the first timing only once the samples flow
        spans = []
        for rnd in range(rounds):
            for name, (im, step) in list(steps.items()):
                for w in windows_ms:
                    time.sleep(rest_s)
                    t0 = time.time()
                    try:
                        ms = time_ms(step, rep=w)  # (step sets the gradients to None itself)
                    except Exception as exc:  # (out of memory over a long window, ...)
                        drop(im, exc)
                        break
                    spans.append((len(out["phases"]), t0, time.time()))
                    out["phases"].append({"impl": name, "round": rnd, "timer": "do_bench", "window_ms": w,
                                          "ms": round(ms, 4)})
        for name, (im, step) in list(steps.items()):
            time.sleep(rest_s)
            window = []
            try:
                summary = _profile_steps(step, device, profile_steps, top=0, window=window)
            except Exception as exc:
                drop(im, exc)
                continue
            spans.append((len(out["phases"]), *window[0]))
            out["phases"].append({"impl": name, "timer": "profile", "steps": profile_steps,
                                  **{k: v for k, v in summary.items() if k not in ("top", "categories")}})
        last = max((t1 for _, _, t1 in spans), default=0.0)
        started = time.time()
        samples = smp.samples()
        while smp.fields and not any(x.t > last for x in samples) and time.time() - started < 5.0:
            time.sleep(0.02)  # the last phase's samples: nvidia-smi's output may lag
            samples = smp.samples()
    for i, t0, t1 in spans:
        out["phases"][i].update(summarize(samples, t0, t1))
    return out


def power_table(state: dict) -> str:
    """Text table of a :func:`power_state` result: per phase, the time and the clock."""
    lines = [f"the clock under load, {state['device']}, shape {state['shape']} ({state['dtype']})"]
    smp = state.get("sampler") or {}
    if smp.get("error"):
        lines.append(f"  no clock samples: {smp['error']}")
    elif smp.get("power_limit_w") is not None:
        lines.append(f"  the board's power limit {smp['power_limit_w']:.0f} W, its top SM clock "
                     f"{smp['sm_max_mhz']:.0f} MHz; a sample every {smp.get('interval_ms')} ms")
    lines.append("  ms: a step's time (do_bench), or a step's kernel time (profile); SM MHz and W: medians of "
                 "the samples")
    lines.append(f"  {'implementation':<16}{'timer':<22}{'ms':>8}{'SM MHz':>8}{'W':>7}  clock held down by")
    for ph in state["phases"]:
        timer = (f"do_bench {ph['window_ms']} ms (r{ph['round']})" if ph["timer"] == "do_bench"
                 else f"profile, {ph['steps']} steps")
        ms = ph["ms"] if ph["timer"] == "do_bench" else ph["kernel_ms"]
        clock = (f"{ph['sm_mhz']:>8.0f}{ph['power_w']:>7.0f}  "
                 + ", ".join(f"{k} {100 * v:.0f}%" for k, v in ph["reasons"].items())) if ph.get("samples") else \
            f"{'-':>8}{'-':>7}"
        lines.append(f"  {ph['impl']:<16}{timer:<22}{ms:>8.2f}{clock}")
    for name, why in state.get("skipped", {}).items():
        lines.append(f"  {name}: not timed: {why}")
    return "\n".join(lines)


def write_power_state(device: torch.device | str, out_dir: str | Path, log: Callable[[str], object] = print,
                      **kwargs) -> Path:
    """Write :func:`power_state` (``kwargs`` passed on) to ``out_dir/transformer_layer_power.json``
    and pass its table to ``log``. Returns the path."""
    state = power_state(device, **kwargs)
    path = _write_stored(out_dir, POWER_FILE, state)
    log(power_table(state))
    return path


def load_power_state(path: Optional[str | Path] = None) -> Optional[dict]:
    """The stored :func:`power_state` (default: ``transformer_layer_power.json`` in
    :func:`fusedlib.book.bench_dir`), or None when it has not been written yet."""
    return _load_stored(path, POWER_FILE)
