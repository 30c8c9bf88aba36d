"""``TransformerBlock``: num_layers layers from specs, then the final norm; activation recomputation.

``TransformerBlock(config, spec)`` takes either a :class:`TransformerBlockSubmodules` (one spec
per layer, and the final norm's), a ``ModuleSpec`` of a TransformerBlock, or one layer spec,
repeated ``config.num_layers`` times.

Full activation recomputation (``recompute_granularity="full"``, in training): the layers'
activations are not kept; only each checkpointed chunk's input is, and the chunk's forward runs
again in the backward, under ``torch.utils.checkpoint`` (non-reentrant) with the CPU and device
RNG states of the first run restored, so its dropout masks are the same:

* ``recompute_method="uniform"``: the layers in chunks of ``recompute_num_layers``, each chunk
  checkpointed;
* ``"block"``: only the first ``recompute_num_layers`` layers, one checkpoint each.

(Selective recomputation is in the attention and the layer: it checkpoints only the core
attention, or the MLP.)

Differences from Megatron-core: given one layer spec, the final norm is the spec's own
``input_layernorm`` class (so a torch-norm spec gets a torch final norm), where Megatron-core
takes a process-wide choice (Transformer Engine's, Apex's or torch's norm); when that slot is
an IdentityOp, :class:`~fusedlib.fusions.fused_layer_norm.FusedNorm`.

Sequence parallelism (p > 1): the block's input and output are this rank's s/p tokens
[s/p, b, h], and in training with dropout the layers run under the tensor-parallel RNG
tracker's model-parallel state (``get_cuda_rng_tracker().fork()``), so each rank's dropout
masks are its own, as in Megatron-core (which forks whether or not anything draws).
Recomputation replays the tracker's states too (:func:`fusedlib.parallel.random.checkpoint`).

CUDA graphs (``config.cuda_graph_impl = "local"``): in training, the layers and the final norm
run as two captured CUDA graphs (one forward, one backward) through
:class:`~fusedlib.transformer.cuda_graphs.CudaGraphManager` (see that module for what a graph
fixes and what the manager checks); the block returns a copy of the forward graph's output.
:meth:`TransformerBlock.reset_cuda_graphs` drops the captured graphs.

Left out: pipeline stages (``pre_process=False``, ``set_input_tensor``), virtual pipelines,
FP8/FP4 contexts, CPU offloading, CUDA graphs of parts of a layer or of a whole step,
multi-token prediction, inference.

Source: Megatron-LM ``megatron/core/transformer/transformer_block.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from ..checks import check_bools
from ..fusions.fused_layer_norm import FusedNorm
from ..parallel.random import checkpoint as tensor_parallel_checkpoint
from ..parallel.random import get_cuda_rng_tracker
from ..utils import make_viewless_tensor
from .cuda_graphs import GRAPHABLE_KWARGS, CudaGraphManager
from .identity_op import IdentityOp
from .module import MegatronModule
from .spec_utils import ModuleSpec, build_module, check_submodules, get_module
from .transformer_config import TransformerConfig
from .transformer_layer import BaseTransformerLayer, _norm, check_hidden_states
from .utils import param_device

__all__ = ["TransformerBlockSubmodules", "TransformerBlock"]


@dataclass
class TransformerBlockSubmodules:
    """The slots of a :class:`TransformerBlock`: one spec per layer, then the final norm's (None: none).

    Source: Megatron-LM ``megatron/core/transformer/transformer_block.py``.
    """

    layer_specs: Optional[List[ModuleSpec]] = None
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def _final_norm_of(layer_spec: ModuleSpec) -> Union[ModuleSpec, type]:
    norm = getattr(layer_spec.submodules, "input_layernorm", IdentityOp)
    return FusedNorm if norm is IdentityOp else norm


def _get_block_submodules(config: TransformerConfig, spec: Union[TransformerBlockSubmodules, ModuleSpec]
                          ) -> TransformerBlockSubmodules:
    """The block's submodules from any of the three kinds of spec (see the module docstring).

    Raises:
        TypeError: a spec of neither kind, naming what it got; a block's ModuleSpec whose
            submodules are not a TransformerBlockSubmodules (None, a dict...); layer_specs
            neither None nor a list or tuple of specs.
    """
    if isinstance(spec, ModuleSpec):
        module = get_module(spec)
        if isinstance(module, type) and issubclass(module, TransformerBlock):
            spec = check_submodules("TransformerBlock", spec.submodules, TransformerBlockSubmodules)
        elif isinstance(module, type) and issubclass(module, BaseTransformerLayer):
            return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=_final_norm_of(spec))
        else:
            raise TypeError(f"TransformerBlock: a ModuleSpec of {getattr(module, '__name__', module)!r} is neither a "
                            "TransformerBlock nor a transformer layer")
    elif not isinstance(spec, TransformerBlockSubmodules):
        raise TypeError(f"TransformerBlock: spec must be a TransformerBlockSubmodules or a ModuleSpec, "
                        f"got {type(spec).__name__}")
    if spec.layer_specs is not None and not isinstance(spec.layer_specs, (list, tuple)):
        raise TypeError(f"TransformerBlock: layer_specs must be a list of layer specs (or None), got "
                        f"{type(spec.layer_specs).__name__}")
    return spec


class TransformerBlock(MegatronModule):
    """A stack of transformer layers and the final norm: [s, b, h] -> [s, b, h].

    Args:
        config: reads num_layers (for a layer spec), hidden_size, layernorm_epsilon, params_dtype,
            the recompute settings and the CUDA-graph settings (``cuda_graph_impl``,
            ``cuda_graph_warmup_steps``).
        spec: TransformerBlockSubmodules, or a ModuleSpec of a block or of a layer.
        post_layer_norm: build the final norm.
        pre_process: must be True (pipeline stages left out).
        post_process: this is the last stage (the final norm is built only there).
        pg_collection, vp_stage: must be None.

    ``forward(hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
    attention_bias=None, inference_context=None, packed_seq_params=None)``: as
    :meth:`TransformerLayer.forward`; returns the hidden states [s, b, h] (not a view).

    Raises:
        NotImplementedError: a left-out feature asked for (with CUDA graphs: a cross-attention
            context, or a mask, rotary embedding or attention bias that is not a tensor).
        TypeError: a bad spec (see :func:`_get_block_submodules`); hidden states not floating point;
            post_layer_norm, pre_process or post_process not a bool (a str "False" is not False).
        ValueError: hidden states not a tensor [s, b, hidden_size] (s, b >= 1);
            ``cuda_graph_impl="local"`` in training with hidden states not on a CUDA device.
        NotImplementedError: with CUDA graphs, also a module hook on a layer, on the final norm
            or on one of their submodules, a global module hook, a tensor hook on one of their
            parameters, or (set after construction) recomputation or sequence parallelism.
        RuntimeError: with CUDA graphs, a second training forward before the first one's
            backward, a backward of an earlier forward, or a failed capture (see
            :mod:`fusedlib.transformer.cuda_graphs`).
        Errors of the layers, naming the module that failed.

    Source: Megatron-LM ``megatron/core/transformer/transformer_block.py`` (``TransformerBlock``).
    """

    def __init__(self, config: TransformerConfig, spec: Union[TransformerBlockSubmodules, ModuleSpec],
                 post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True,
                 pg_collection: object = None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config)
        post_layer_norm, pre_process, post_process = check_bools(
            "TransformerBlock", post_layer_norm=post_layer_norm, pre_process=pre_process, post_process=post_process)
        if not pre_process or pg_collection is not None or vp_stage is not None:
            raise NotImplementedError("TransformerBlock: pipeline stages (pre_process=False), pg_collection and "
                                      "vp_stage are left out of fusedlib")
        self.submodules = _get_block_submodules(config, spec)
        self.post_layer_norm, self.pre_process, self.post_process = post_layer_norm, pre_process, post_process
        # [Module 1: the layers], numbered from 1
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=i + 1)
            for i, layer_spec in enumerate(self.submodules.layer_specs or []))
        # [Module 2: the final norm]
        if self.submodules.layer_norm is not None and post_process and post_layer_norm:
            self.final_layernorm = build_module(self.submodules.layer_norm, config=config,
                                                hidden_size=config.hidden_size, eps=config.layernorm_epsilon,
                                                device=param_device(config), dtype=config.params_dtype)
        else:
            self.final_layernorm = None
        self.num_layers_per_pipeline_rank = len(self.layers)
        self._fork_rng = config.sequence_parallel and config.tensor_model_parallel_size > 1
        # (without dropout nothing draws random numbers: no fork, and no tracker needed)
        # (a DotProductAttention's attention_dropout may override the config's through its spec)
        self._draws_random_numbers = config.attention_dropout > 0 or any(
            getattr(layer, "hidden_dropout", config.hidden_dropout) > 0 for layer in self.layers) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.modules())
        self.cudagraph_manager = (CudaGraphManager(config.cuda_graph_warmup_steps)
                                  if config.cuda_graph_impl == "local" else None)

    def reset_cuda_graphs(self) -> None:
        """Drop the captured CUDA graphs of the layers and the final norm
        (``cuda_graph_impl="local"``); the next training call captures them again. Nothing to do
        without CUDA graphs."""
        if self.cudagraph_manager is not None:
            self.cudagraph_manager.reset()

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias):
        """The layers with full activation recomputation (config.recompute_method, recompute_num_layers)."""

        def custom(start: int, end: int):
            def custom_forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
                for layer in self.layers[start:end]:
                    hidden_states, context = layer(hidden_states, attention_mask=attention_mask, context=context,
                                                   context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                                                   attention_bias=attention_bias)
                return hidden_states, context
            return custom_forward

        def checkpointed(forward_func):
            return tensor_parallel_checkpoint(forward_func, hidden_states, attention_mask, context, context_mask,
                                              rotary_pos_emb)

        n, chunk = len(self.layers), self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            for start in range(0, n, chunk):  # every layer, in checkpointed chunks of `chunk` layers
                hidden_states, context = checkpointed(custom(start, min(start + chunk, n)))
        elif self.config.recompute_method == "block":
            for i in range(n):  # the first `chunk` layers checkpointed, the rest stored as usual
                run = custom(i, i + 1)
                hidden_states, context = (checkpointed(run) if i < chunk else
                                          run(hidden_states, attention_mask, context, context_mask, rotary_pos_emb))
        else:
            raise ValueError(f"Invalid activation recompute method {self.config.recompute_method!r}.")
        return hidden_states

    def _layers_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias):
        """The layers, checkpointed with full recomputation in training."""
        if self.config.recompute_granularity == "full" and self.training:
            return self._checkpointed_forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                                              attention_bias)
        for layer in self.layers:
            hidden_states, context = layer(hidden_states, attention_mask=attention_mask, context=context,
                                           context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                                           attention_bias=attention_bias)
        return hidden_states

    def _graphed_forward(self, manager, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                         attention_bias):
        """The layers and the final norm through the manager's CUDA graphs (training, CUDA)."""
        if self.config.recompute_granularity is not None or self._fork_rng:
            # (TransformerConfig refuses both with "local"; a config changed afterwards reaches here)
            raise NotImplementedError("TransformerBlock: cuda_graph_impl='local' captures the layers without "
                                      "activation recomputation and without sequence parallelism; got "
                                      f"recompute_granularity={self.config.recompute_granularity!r}, "
                                      f"sequence_parallel={self.config.sequence_parallel}")
        if context is not None or context_mask is not None:
            raise NotImplementedError("TransformerBlock: cuda_graph_impl='local' captures self-attention layers; "
                                      "a cross-attention context is left out")
        kwargs = dict(zip(GRAPHABLE_KWARGS, (attention_mask, rotary_pos_emb, attention_bias)))
        for name, value in kwargs.items():
            if value is not None and not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"TransformerBlock: cuda_graph_impl='local' takes {name} as a tensor "
                                          f"or None, got {type(value).__name__}")
        return manager.run(self.layers, hidden_states, kwargs, final_norm=self.final_layernorm)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, attention_bias: Optional[torch.Tensor] = None,
                inference_context: object = None, packed_seq_params: object = None) -> torch.Tensor:
        """The layers (checkpointed with full recomputation in training), then the final norm."""
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("TransformerBlock: inference_context and packed_seq_params are left out")
        check_hidden_states("TransformerBlock", hidden_states, self.config.hidden_size)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        manager = self.cudagraph_manager
        if manager is not None and manager.applies(self, hidden_states):
            return self._graphed_forward(manager, hidden_states, attention_mask, context, context_mask,
                                         rotary_pos_emb, attention_bias)
        if self._fork_rng and self.training and self._draws_random_numbers:
            # sequence parallelism: each rank holds its own tokens, so every dropout mask is its own
            with get_cuda_rng_tracker().fork():
                hidden_states = self._layers_forward(hidden_states, attention_mask, context, context_mask,
                                                     rotary_pos_emb, attention_bias)
        else:
            hidden_states = self._layers_forward(hidden_states, attention_mask, context, context_mask,
                                                 rotary_pos_emb, attention_bias)
        if self.final_layernorm is not None:
            hidden_states = _norm(self.final_layernorm, hidden_states)  # (cast to its weight's dtype)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return hidden_states
