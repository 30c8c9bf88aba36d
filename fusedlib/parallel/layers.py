"""``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` on one rank.

Megatron-core's signatures and return values, with tensor-parallel size 1: the layers a layer
spec names for its linear slots. Each linear returns ``(output, output_bias)``: with
``skip_bias_add=True`` the bias is *not* added and is returned instead, so the caller can fuse
it into the next elementwise kernel (bias-GeLU, bias-SwiGLU, bias-dropout-add); otherwise the
bias is added and ``output_bias`` is None.

Weights are ``[out, in]`` (``F.linear`` computes x·Wᵀ), created in ``config.params_dtype`` on
:func:`fusedlib.transformer.utils.param_device` and filled by ``init_method`` when
``config.perform_initialization``; biases are zeros.

Left out: tensor parallelism (``config.tensor_model_parallel_size > 1`` or a ``tp_group`` of
more than one rank raises NotImplementedError; chapter 9 is about it), sequence parallelism's
collectives, gradient-accumulation fusion, deferred weight gradients, MoE experts.

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def _check_single_rank(layer: str, config, tp_group, is_expert: bool = False) -> None:
    if config.tensor_model_parallel_size != 1:
        raise NotImplementedError(f"{layer}: tensor_model_parallel_size={config.tensor_model_parallel_size}: "
                                  "fusedlib's layers run on one rank (tensor parallelism is a later chapter); "
                                  "set it to 1")
    if tp_group is not None and tp_group.size() != 1:
        raise NotImplementedError(f"{layer}: a tp_group of {tp_group.size()} ranks: fusedlib's layers run on one rank")
    if is_expert:
        raise NotImplementedError(f"{layer}: is_expert=True: MoE experts are left out of fusedlib")


def _new_param(config, *shape: int) -> Parameter:
    from ..transformer.utils import param_device  # here: the transformer package imports this module

    return Parameter(torch.empty(*shape, device=param_device(config), dtype=config.params_dtype))


def _init_weight_and_bias(layer: torch.nn.Module, config, init_method: Optional[InitMethod]) -> None:
    if not config.perform_initialization:
        return
    if init_method is None:
        raise ValueError(f"{type(layer).__name__}: init_method is None (the config derives "
                         "output_layer_init_method from num_layers: set num_layers >= 1, or pass the init method)")
    with torch.no_grad():
        if layer.weight is not None:
            init_method(layer.weight)
        if layer.bias is not None:
            layer.bias.zero_()  # Megatron-core: the bias always starts at zero


class _ExtraStateMixin:
    """Megatron-core's linear layers carry an empty ``_extra_state`` (Transformer Engine keeps FP8
    metadata there); keeping it makes a Megatron-core state dict load 1:1, strictly, and back."""

    def get_extra_state(self) -> None:
        """Nothing to save (Megatron-core's value)."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Ignored, as in Megatron-core."""

    def _register_extra_state_default(self) -> None:
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))


class ColumnParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """Y = X·Wᵀ + b, W of shape [output_size, input_size] (tensor-parallel: split along the output).

    Args:
        input_size, output_size: the two sizes.
        config: reads tensor_model_parallel_size (must be 1), params_dtype, use_cpu_initialization,
            perform_initialization.
        init_method: fills the weight (``config.init_method`` in the layer specs).
        bias: create a bias [output_size].
        gather_output: all-gather the output (identity on one rank).
        stride, keep_master_weight_for_test, tp_comm_buffer_name, disable_grad_reduce: accepted for
            Megatron-core's signature; they change nothing on one rank.
        skip_bias_add: return the bias instead of adding it.
        skip_weight_param_allocation: create no weight; ``forward`` then takes ``weight=`` (the
            output layer with tied embeddings).
        embedding_activation_buffer, grad_output_buffer: must be None (deferred weight gradients:
            left out).
        is_expert: must be False; tp_group: None or a one-rank group.

    ``forward(input_, weight=None, runtime_gather_output=None)``: input_ [s, b, input_size] (any
    [..., input_size]) -> ``(output [..., output_size], output_bias [output_size] or None)``.

    Raises:
        NotImplementedError: tensor parallelism, experts or deferred gradients asked for.
        ValueError: init_method None while initializing.
        RuntimeError: no weight (skip_weight_param_allocation) and none passed, or a passed
            weight of the wrong shape (Megatron-core's messages).

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``ColumnParallelLinear``).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Optional[InitMethod],
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False,
                 embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
                 grad_output_buffer: Optional[List[torch.Tensor]] = None, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, disable_grad_reduce: bool = False,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__()
        _check_single_rank("ColumnParallelLinear", config, tp_group, is_expert)
        if embedding_activation_buffer is not None or grad_output_buffer is not None:
            raise NotImplementedError("ColumnParallelLinear: deferred embedding weight gradients are left out")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.config = config
        self.weight = None if skip_weight_param_allocation else _new_param(config, output_size, input_size)
        self.bias = _new_param(config, output_size) if bias else None
        _init_weight_and_bias(self, config, init_method)
        self._register_extra_state_default()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(x·Wᵀ [+ b], b if skip_bias_add else None)``; ``gather_output`` is the identity on one rank."""
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        elif weight.shape != (self.output_size, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                               f"not {(self.output_size, self.input_size)} as expected")
        bias = self.bias if not self.skip_bias_add else None
        output = F.linear(input_, weight, bias)  # [..., in] -> [..., out]
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, TP=1"


class RowParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """Y = X·Wᵀ + b, W of shape [output_size, input_size] (tensor-parallel: split along the input).

    Args:
        input_size, output_size: the two sizes.
        config, init_method, stride, keep_master_weight_for_test, tp_comm_buffer_name, is_expert,
            tp_group: as :class:`ColumnParallelLinear` (``config.output_layer_init_method`` in the
            layer specs).
        bias: create a bias [output_size] (never split, in Megatron-core either).
        input_is_parallel: the input is already split across ranks (no-op on one rank).
        skip_bias_add: return the bias instead of adding it.

    ``forward(input_)``: [..., input_size] -> ``(output [..., output_size], output_bias or None)``.
    The bias is added after the GEMM, as Megatron-core does (after its all-reduce).

    Raises:
        NotImplementedError, ValueError: as :class:`ColumnParallelLinear`.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``RowParallelLinear``).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Optional[InitMethod], bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__()
        _check_single_rank("RowParallelLinear", config, tp_group, is_expert)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.config = config
        self.weight = _new_param(config, output_size, input_size)
        self.bias = _new_param(config, output_size) if bias else None
        _init_weight_and_bias(self, config, init_method)
        self._register_extra_state_default()

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(x·Wᵀ + b, None)``, or ``(x·Wᵀ, b)`` with skip_bias_add."""
        output_ = F.linear(input_, self.weight)  # [..., in] -> [..., out]
        if self.skip_bias_add:
            return output_, self.bias
        return (output_ + self.bias if self.bias is not None else output_), None

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, TP=1"


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding, weight [num_embeddings, embedding_dim] (tensor-parallel: split along the vocabulary).

    Args:
        num_embeddings: vocabulary size V; embedding_dim: h.
        init_method: fills the weight (``config.embedding_init_method``).
        reduce_scatter_embeddings: must be False (sequence parallelism's collective: left out).
        config, tp_group: as :class:`ColumnParallelLinear`.

    ``forward(input_)``: int ids [b, s] -> [b, s, h] in the weight's dtype.

    Raises:
        NotImplementedError: tensor parallelism or reduce_scatter_embeddings.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``VocabParallelEmbedding``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Optional[InitMethod],
                 reduce_scatter_embeddings: bool = False, config,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__()
        _check_single_rank("VocabParallelEmbedding", config, tp_group)
        if reduce_scatter_embeddings:
            raise NotImplementedError("VocabParallelEmbedding: reduce_scatter_embeddings (sequence parallelism) "
                                      "is left out")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _new_param(config, num_embeddings, embedding_dim)
        self.bias = None
        _init_weight_and_bias(self, config, init_method)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: [b, s] ids -> [b, s, h]."""
        return F.embedding(input_, self.weight)
