"""``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding``, on one rank or p.

Megatron-core's signatures and return values. Each linear returns ``(output, output_bias)``:
with ``skip_bias_add=True`` the bias is *not* added and is returned instead, so the caller can
fuse it into the next elementwise kernel (bias-GeLU, bias-SwiGLU, bias-dropout-add); otherwise
the bias is added and ``output_bias`` is None.

Tensor parallelism (``config.tensor_model_parallel_size = p > 1``; the group is
:func:`fusedlib.parallel.parallel_state.get_tensor_model_parallel_group`, or ``tp_group``):

* ``ColumnParallelLinear`` splits the output features: rank r holds W_r [out/p, in], the rows
  ``[r·out/p, (r+1)·out/p)`` of W (and of the bias), and computes Y_r = X·W_rᵀ. The input
  is the same on every rank, so its gradient is the sum of the ranks' partial gradients: one
  all-reduce in the backward (:func:`linear_with_grad_accumulation_and_async_allreduce`,
  overlapped with the weight-gradient GEMM). ``gather_output`` all-gathers Y.
* ``RowParallelLinear`` splits the input features: rank r holds W_r [out, in/p] and the input
  slice X_r [.., in/p] (``input_is_parallel``: the column-parallel layer before it produced it;
  otherwise it is scattered here), computes the partial product X_r·W_rᵀ and all-reduces it;
  the bias (not split) is added after.
* A column-parallel layer followed by a row-parallel one (attention: QKV then projection; MLP:
  fc1 then fc2) needs one all-reduce forward and one backward, and nothing in between: the
  activation, softmax and per-head work all run on the split features.
* ``VocabParallelEmbedding`` splits the vocabulary: rank r looks up the ids it holds, writes
  zeros for the others, and an all-reduce sums the ranks' rows.

Sequence parallelism (``config.sequence_parallel`` and p > 1; Korthikanti et al. 2022,
arXiv:2205.05198): outside the linears every activation is split along the sequence, [s/p, b, h]
(the norms, dropout and residual adds then do 1/p of the work and keep 1/p of the memory). The
column-parallel layer all-gathers its input's sequence (and reduce-scatters the input gradient);
the row-parallel layer reduce-scatters its output instead of all-reducing it; the embedding
reduce-scatters. Same bytes on the wire as the all-reduce (an all-reduce is a reduce-scatter
then an all-gather).

Parameters that are *replicated* over the ranks but see only a slice of the data get only a
partial gradient: under sequence parallelism the norms' weights and the row-parallel biases
(each rank saw s/p tokens); with ``qk_layernorm`` the query/key norms (each rank saw its
heads). They carry ``sequence_parallel=True`` (Megatron's mark), and
:func:`fusedlib.parallel.finalize_model_grads` sums their gradients over the group after the
backward; call it before the optimizer step.

Every split parameter carries Megatron's attributes ``tensor_model_parallel=True``,
``partition_dim`` (0 for column-parallel weights and biases and the embedding, 1 for row-parallel
weights) and ``partition_stride`` (2 for a gated MLP's fc1: its two halves are split
separately), on one rank too: :mod:`fusedlib.parallel.checkpointing` reads them to shard and
gather state dicts.

Initialization: every rank draws the FULL weight with ``init_method`` from the default
generator and keeps its shard (Megatron's ``use_cpu_initialization`` path, on the parameter's
device). With the same seed on every rank, a model of any p holds the shards of the one-rank
model: p changes nothing but the work split. Megatron's GPU path draws each shard from the
tracker's model-parallel state instead, so its weights depend on p.

One rank (p = 1) runs exactly the one-rank code: ``F.linear`` / ``F.embedding``, no collective,
no extra copy. Two exceptions. With ``config.deterministic_mode`` the embedding's weight
gradient comes from fusedlib's deterministic kernels (:class:`VocabParallelEmbedding`). And, as in Megatron-core (whose column-parallel GEMM is its autograd
function at any p): a column-parallel layer that adds its bias in the GEMM (``skip_bias_add``
False, the QKV projection's case) runs through
:class:`LinearWithGradAccumulationAndAsyncCommunication` when the bias needs a gradient
(not under autocast, torch.compile, torch.func transforms or forward-mode AD:
:func:`~fusedlib.runtime.optional_function_ok`), so that the bias gradient is fusedlib's column sum
(:func:`~fusedlib.kernels.bias_dropout_add.bias_dropout_add_bwd` with only db) rather than
torch's ``sum(0)``; the GEMMs are the same.

Left out: gradient-accumulation fusion, deferred weight gradients, MoE experts, CPU offloading,
Transformer Engine's communication overlap.

Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.parameter import Parameter

from ..checks import check_bool, check_bools, check_ids_below_on_cpu, resolve_neg_grads
from ..kernels.bias_dropout_add import bias_dropout_add_bwd
from ..kernels.embedding import check_ids_in_range, embedding_backward
from ..kernels.launch import as_rows
from ..runtime import optional_function_ok
from ..utils import KeepParameterAttributes
from . import parallel_state
from .mappings import (
    _ReduceFromModelParallelRegion,
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .utils import VocabUtility, _record, all_gather, reduce_scatter

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_grad_accumulation_and_async_allreduce",
    "set_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "divide",
]

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, checked.

    Raises:
        ValueError: numerator not divisible by denominator (naming ``what``).

    Source: Megatron-LM ``megatron/core/utils.py`` (``divide``).
    """
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_model_parallel_size ({denominator})")
    return numerator // denominator


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark a parameter as split over the tensor-parallel ranks: ``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride`` (Megatron's attribute names).

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``.
    """
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group: object = None) -> bool:
    """True for a split parameter, and for a replicated one on tensor-parallel rank 0 only (so a
    sum over ranks, e.g. of squared gradient norms, counts each replica once).

    Args:
        param: a parameter.
        tp_group: the group (None: :mod:`parallel_state`'s, rank 0 when not initialized).

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tp_group is not None:
        return tp_group.rank() == 0
    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0


def _tp_group(layer: str, config, tp_group, is_expert: bool = False):
    """``(group, rank, size)`` for a layer: ``tp_group``, else parallel_state's group when
    ``config.tensor_model_parallel_size > 1``, else (None, 0, 1).

    Raises:
        NotImplementedError: is_expert.
        RuntimeError: p > 1 and model parallelism not initialized.
        ValueError: the group's size is not config.tensor_model_parallel_size.
    """
    if is_expert:
        raise NotImplementedError(f"{layer}: is_expert=True: MoE experts are left out of fusedlib")
    p = config.tensor_model_parallel_size
    if tp_group is None and p > 1:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(f"{layer}: config.tensor_model_parallel_size={p}, but model parallelism is not "
                               f"initialized: call fusedlib.parallel.initialize_model_parallel({p}) on every rank "
                               "before building the model")
        tp_group = parallel_state.get_tensor_model_parallel_group()
    size = 1 if tp_group is None else tp_group.size()
    if size != p:
        raise ValueError(f"{layer}: config.tensor_model_parallel_size={p}, but the tensor-parallel group has "
                         f"{size} rank(s)")
    if size == 1:
        return None, 0, 1
    return tp_group, tp_group.rank(), size


def _new_param(config, *shape: int) -> Parameter:
    from ..transformer.utils import param_device  # here: the transformer package imports this module

    return Parameter(torch.empty(*shape, device=param_device(config), dtype=config.params_dtype))


def _shard_of(full: torch.Tensor, dim: int, stride: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim``: the chunks ``rank, rank + p, ...`` of
    ``p·stride`` equal chunks, concatenated (Megatron's strided split; stride 1: one contiguous
    block). A contiguous copy."""
    chunks = torch.chunk(full, world_size * stride, dim=dim)
    return torch.cat(chunks[rank::world_size], dim=dim).contiguous()


def _init_weight_and_bias(layer: torch.nn.Module, config, init_method: Optional[InitMethod],
                          full_shape: Optional[tuple] = None, partition_dim: int = 0, stride: int = 1) -> None:
    """Fill the weight with ``init_method`` and zero the bias. With p > 1 the full weight
    ``full_shape`` is drawn (same generator, device and dtype as on one rank) and this rank's
    shard kept, so every p holds the same model."""
    if not config.perform_initialization:
        return
    if init_method is None:
        raise ValueError(f"{type(layer).__name__}: init_method is None (the config derives "
                         "output_layer_init_method from num_layers: set num_layers >= 1, or pass the init method)")
    with torch.no_grad():
        if layer.weight is not None:
            if layer.tp_world_size == 1:
                init_method(layer.weight)
            else:
                full = torch.empty(full_shape, device=layer.weight.device, dtype=layer.weight.dtype)
                init_method(full)
                layer.weight.copy_(_shard_of(full, partition_dim, stride, layer.tp_rank, layer.tp_world_size))
        if layer.bias is not None:
            layer.bias.zero_()  # Megatron-core: the bias always starts at zero


def _check_sizes(layer: str, **sizes: object) -> None:
    """Sizes are ints >= 0 (0: an empty layer, as torch.nn.Linear; a negative one failed in
    torch.empty, a float in its argument parsing)."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{layer}: {name} must be an int >= 0, got {type(v).__name__} {v!r}")
        if v < 0:
            raise ValueError(f"{layer}: {name} must be an int >= 0, got {v!r}")


def _check_input(layer: str, input_: object, width: int, weight: torch.Tensor, what: str) -> None:
    """A linear layer's input: a tensor [..., width] on the weight's device, of the weight's dtype
    (any dtype under autocast), else a ValueError naming the layer and what it expected (torch's
    own error names neither: "mat1 and mat2 shapes cannot be multiplied")."""
    if not isinstance(input_, torch.Tensor):
        raise ValueError(f"{layer}: input_ must be a tensor [..., {width}], got {type(input_).__name__}")
    if input_.dim() == 0 or input_.shape[-1] != width:
        raise ValueError(f"{layer}: input_ must be [..., {width}] ({what}), got shape {list(input_.shape)}")
    if input_.device != weight.device:  # (meta against CPU: a matmul of unwritten memory, or torch's errors)
        raise ValueError(f"{layer}: input_ must be on the weight's device {weight.device}, got {input_.device}")
    if input_.dtype != weight.dtype and not torch.is_autocast_enabled(input_.device.type):
        raise ValueError(f"{layer}: input_ must have the weight's dtype {weight.dtype} (or run under autocast), "
                         f"got {input_.dtype}")


class _ExtraStateMixin:
    """Megatron-core's linear layers carry an empty ``_extra_state`` (Transformer Engine keeps FP8
    metadata there); keeping it makes a Megatron-core state dict load 1:1, strictly, and back."""

    def get_extra_state(self) -> None:
        """Nothing to save (Megatron-core's value)."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Ignored, as in Megatron-core."""

    def _register_extra_state_default(self) -> None:
        # a module-level function, not a lambda: a module holding the hook must pickle (torch.save(model))
        self._register_load_state_dict_pre_hook(_default_extra_state)


def _default_extra_state(state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
    """Load pre-hook: a state dict without this layer's ``_extra_state`` (one saved by torch's
    modules, or before the key existed) loads as if it had Megatron-core's empty value."""
    state_dict.setdefault(f"{prefix}_extra_state")


# ---------------------------------------------------------------------------- the column-parallel GEMM
class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``F.linear`` of a column-parallel layer with its communication (p > 1), or on one rank with
    only its bias gradient taken by fusedlib's column sum (a bias added in the GEMM).

    ``apply(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group)``: input
    [s, b, in] (any [..., in]; [s/p, b, in] with sequence_parallel), weight [out/p, in], bias
    [out/p] or None, all of one float dtype; tp_group None when both flags are off. Returns
    [..., out/p] in input's dtype.

    Forward: with ``sequence_parallel`` all-gather the input's sequence [s/p, b, in] ->
    [s, b, in] first; then Y = X·Wᵀ (+ b). Saves the input as given (the s/p shard under
    sequence parallelism: the backward gathers it again rather than keep p times the memory),
    and only when the weight needs a gradient (a frozen weight's layer keeps no activation).

    Backward: dX = dY·W, then all-reduce it (``allreduce_dgrad``: the input was replicated) or
    reduce-scatter it to the sequence shard (``sequence_parallel``), asynchronously, while
    dW = dYᵀ·X (on the gathered X) and db = sum dY (fusedlib's column-sum kernel; torch's
    ``sum`` under ``create_graph``, where a double backward needs it differentiable) run; then
    wait. With neither (p = 1, a bias in the GEMM) there is no communication: the Function is
    then only the GEMMs and the column sum.

    Why not the bias gradient inside the weight-gradient GEMM (cuBLASLt's
    ``CUBLASLT_EPILOGUE_BGRADB``, Transformer Engine's way): on the H200 (bf16, CUDA-graph
    replays, the heuristic's first algorithm) that GEMM took longer than torch's GEMM plus the
    column sum at the shapes of chapters 7 and 9 but the widest: [M, in] -> [M, out] =
    [32768, 384] -> 1152: 0.0816 against 0.0714 ms; [8192, 768] -> 3072: 0.0805 against 0.0701;
    [8192, 2048] -> 2048: 0.0984 against 0.0967; it saved 0.02 ms at [8192, 2048] -> 6144
    (0.3008 against 0.3217).

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``
    (``LinearWithGradAccumulationAndAsyncCommunication``).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group):
        # the input only where the weight's gradient needs it (a frozen weight: not kept)
        ctx.save_for_backward(input if ctx.needs_input_grad[1] else None, weight)
        ctx.use_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = _gather_first_dim(input, tp_group) if sequence_parallel else input
        return F.linear(total_input, weight, bias)  # [s, b, in] -> [s, b, out/p]

    @staticmethod
    @resolve_neg_grads  # gradients with the negative bit, resolved (its bias gradient is a kernel's)
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.tp_group
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gather = None
        if ctx.sequence_parallel and need_dw:  # the weight gradient needs the whole sequence again
            x = input.contiguous()
            total_input = torch.empty((group.size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            gather = all_gather(total_input, x, group, async_op=True)
        else:
            total_input = input
        grad_input = grad_output.matmul(weight) if need_dx else None  # [s, b, out/p] -> [s, b, in]
        if gather is not None:
            gather.wait()
        work = None
        if need_dx and ctx.allreduce_dgrad:
            _record("all_reduce", "SUM", grad_input)
            grad_input = grad_input.contiguous()
            work = dist.all_reduce(grad_input, group=group, async_op=True)  # fresh tensor: reduced in place
        elif need_dx and ctx.sequence_parallel:
            grad_input = grad_input.contiguous()
            sub_grad_input = torch.empty((grad_input.shape[0] // group.size(), *grad_input.shape[1:]),
                                         dtype=grad_input.dtype, device=grad_input.device)
            work = reduce_scatter(sub_grad_input, grad_input, group, async_op=True)
            grad_input = sub_grad_input
        grad_weight = grad_bias = None
        need_db = ctx.use_bias and ctx.needs_input_grad[2]
        if need_dw or need_db:
            g2d = as_rows(grad_output)  # [s, b, out/p] -> [s·b, out/p]
            if need_dw:
                grad_weight = g2d.t().matmul(as_rows(total_input))  # [out/p, in]
            if need_db:
                if torch.is_grad_enabled():  # a double backward (create_graph): torch's sum, differentiable
                    grad_bias = g2d.sum(dim=0)
                else:  # the column sums by fusedlib's kernel (deterministic, two stages), in the bias's dtype
                    grad_bias = bias_dropout_add_bwd(g2d, g2d.dtype, None, 0.0, need_dx=False, need_dbias=True,
                                                     db_dtype=ctx.bias_dtype)[1]
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _gather_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    x = input_.contiguous()
    out = torch.empty((group.size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return all_gather(out, x, group)


def linear_with_grad_accumulation_and_async_allreduce(
        input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        gradient_accumulation_fusion: bool = False, allreduce_dgrad: bool = False, sequence_parallel: bool = False,
        grad_output_buffer: Optional[List[torch.Tensor]] = None, wgrad_deferral_limit: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The column-parallel GEMM with its communication (see
    :class:`LinearWithGradAccumulationAndAsyncCommunication`).

    Args:
        input: [s, b, in] (any [..., in]; [s/p, b, in] with sequence_parallel, split on dim 0).
        weight: [out/p, in]; bias: [out/p] or None.
        gradient_accumulation_fusion, grad_output_buffer, wgrad_deferral_limit: must stay off.
        allreduce_dgrad: all-reduce the input gradient over ``tp_group``.
        sequence_parallel: gather the input's sequence (forward), reduce-scatter its gradient.
        tp_group: a process group of p > 1 ranks (needed when either is set).

    Returns:
        [s, b, out/p] (the whole sequence).

    Raises:
        NotImplementedError: gradient-accumulation fusion or deferred weight gradients.
        RuntimeError: allreduce_dgrad and sequence_parallel both set.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py``.
    """
    if gradient_accumulation_fusion or grad_output_buffer is not None or wgrad_deferral_limit:
        raise NotImplementedError("gradient accumulation fusion and deferred weight gradients are left out of fusedlib")
    if allreduce_dgrad and sequence_parallel:
        raise RuntimeError("`allreduce_dgrad` and `sequence_parallel` cannot be enabled at the same time.")
    if not (allreduce_dgrad or sequence_parallel):
        return F.linear(input, weight, bias)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(input, weight, bias, allreduce_dgrad,
                                                                 sequence_parallel, tp_group)


# ---------------------------------------------------------------------------- the layers
class ColumnParallelLinear(_ExtraStateMixin, KeepParameterAttributes, torch.nn.Module):
    """Y = X·Wᵀ + b, W of shape [output_size, input_size], split along the output over p ranks.

    Args:
        input_size, output_size: the two global sizes (output_size divisible by p).
        config: reads tensor_model_parallel_size (p), sequence_parallel, params_dtype,
            use_cpu_initialization, perform_initialization.
        init_method: fills the (full) weight (``config.init_method`` in the layer specs).
        bias: create a bias [output_size / p].
        gather_output: all-gather Y (identity on one rank).
        stride: the weight is split in ``stride`` interleaved parts (2 for a gated MLP's fc1,
            whose halves are split separately).
        skip_bias_add: return the bias instead of adding it.
        skip_weight_param_allocation: create no weight; ``forward`` then takes ``weight=`` (the
            output layer with tied embeddings).
        disable_grad_reduce: do not all-reduce the input gradient (Megatron's LoRA hook).
        keep_master_weight_for_test, tp_comm_buffer_name: accepted for Megatron-core's signature.
        embedding_activation_buffer, grad_output_buffer: must be None (deferred weight gradients:
            left out).
        is_expert: must be False.
        tp_group: the group (None: :mod:`parallel_state`'s when p > 1); its size must be p.

    ``forward(input_, weight=None, runtime_gather_output=None)``: input_ [s, b, input_size]
    ([s/p, b, input_size] under sequence parallelism; any [..., input_size] otherwise) ->
    ``(output [s, b, output_size / p] (output_size with gather_output), output_bias or None)``.

    Attributes: ``output_size_per_partition``, ``tp_group`` (None on one rank), ``tp_rank``,
    ``tp_world_size``, ``sequence_parallel`` (config.sequence_parallel and p > 1).

    Raises:
        NotImplementedError: experts or deferred gradients asked for.
        RuntimeError: p > 1 before :func:`fusedlib.parallel.initialize_model_parallel`; no weight
            (skip_weight_param_allocation) and none passed, or a passed weight of the wrong
            shape (Megatron-core's messages).
        TypeError: input_size or output_size not an int; a passed weight that is not a tensor; an
            on/off argument (bias, gather_output, skip_bias_add, ..., the forward's
            runtime_gather_output unless None) not a bool.
        ValueError: input_size or output_size < 0, output_size not divisible by p, a group of the
            wrong size, init_method None while initializing; in the forward an ``input_`` that is
            not [..., input_size], not on the weight's device, or not of the weight's dtype
            outside autocast; a passed weight not floating point or not of the bias's dtype and
            device.

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
        (bias, gather_output, keep_master_weight_for_test, skip_bias_add, skip_weight_param_allocation, is_expert,
         disable_grad_reduce) = check_bools(
            "ColumnParallelLinear", bias=bias, gather_output=gather_output,
            keep_master_weight_for_test=keep_master_weight_for_test, skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation, is_expert=is_expert,
            disable_grad_reduce=disable_grad_reduce)
        self.tp_group, self.tp_rank, self.tp_world_size = _tp_group("ColumnParallelLinear", config, tp_group, is_expert)
        if embedding_activation_buffer is not None or grad_output_buffer is not None:
            raise NotImplementedError("ColumnParallelLinear: deferred embedding weight gradients are left out")
        p = self.tp_world_size
        _check_sizes("ColumnParallelLinear", input_size=input_size, output_size=output_size)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, p, "ColumnParallelLinear: output_size")
        if p > 1 and self.output_size_per_partition % stride:
            raise ValueError(f"ColumnParallelLinear: output_size / p ({self.output_size_per_partition}) must be "
                             f"divisible by stride ({stride})")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel) and p > 1
        self.allreduce_dgrad = p > 1 and not self.sequence_parallel and not disable_grad_reduce
        self.weight = None if skip_weight_param_allocation else _new_param(config, self.output_size_per_partition,
                                                                            input_size)
        self.bias = _new_param(config, self.output_size_per_partition) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                set_tensor_model_parallel_attributes(param, True, 0, stride)
        _init_weight_and_bias(self, config, init_method, (output_size, input_size), 0, stride)
        self._register_extra_state_default()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(x·Wᵀ [+ b], b if skip_bias_add else None)``, gathered if asked (see the class docstring)."""
        if not (runtime_gather_output is None or runtime_gather_output is True or runtime_gather_output is False):
            # a str "False" would gather by truthiness on several ranks (numpy's bool converted)
            runtime_gather_output = check_bool("ColumnParallelLinear: runtime_gather_output", runtime_gather_output)
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        elif not isinstance(weight, torch.Tensor):
            raise TypeError(f"ColumnParallelLinear: weight must be a tensor [output_size / p, input_size] or None, "
                            f"got {type(weight).__name__}")
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                               f"not {(self.output_size_per_partition, self.input_size)} as expected")
        elif not weight.is_floating_point() or (self.bias is not None and (weight.dtype, weight.device) != (
                self.bias.dtype, self.bias.device)):  # (else torch's messages, or a matmul of meta memory)
            where = f" (the layer's bias: {self.bias.dtype} on {self.bias.device})" if self.bias is not None else ""
            raise ValueError(f"ColumnParallelLinear: the supplied weight must be floating point, of the layer's dtype "
                             f"and on its device{where}, got {weight.dtype} on {weight.device}")
        _check_input("ColumnParallelLinear", input_, self.input_size, weight, "input_size")
        bias = self.bias if not self.skip_bias_add else None
        if self.tp_world_size == 1:
            if (bias is not None and bias.requires_grad and torch.is_grad_enabled() and optional_function_ok()
                    and not torch.is_autocast_enabled(input_.device.type)):
                # the same GEMMs; the bias gradient by fusedlib's column sum (module docstring)
                output = LinearWithGradAccumulationAndAsyncCommunication.apply(input_, weight, bias, False, False, None)
            else:
                output = F.linear(input_, weight, bias)  # [..., in] -> [..., out]
            return output, (self.bias if self.skip_bias_add else None)
        # [s, b, in] (or [s/p, b, in]) -> [s, b, out/p]; the input gradient is all-reduced or
        # reduce-scattered in the backward (disable_grad_reduce: neither)
        output = linear_with_grad_accumulation_and_async_allreduce(
            input_, weight, bias, allreduce_dgrad=self.allreduce_dgrad, sequence_parallel=self.sequence_parallel,
            tp_group=self.tp_group)
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)  # -> [s, b, out]
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
                f"TP={self.tp_world_size}")


class RowParallelLinear(_ExtraStateMixin, KeepParameterAttributes, torch.nn.Module):
    """Y = X·Wᵀ + b, W of shape [output_size, input_size], split along the input over p ranks.

    Args:
        input_size, output_size: the two global sizes (input_size divisible by p).
        config, init_method, stride, keep_master_weight_for_test, tp_comm_buffer_name, is_expert,
            tp_group: as :class:`ColumnParallelLinear` (``config.output_layer_init_method`` in the
            layer specs).
        bias: create a bias [output_size] (never split; under sequence parallelism marked
            ``sequence_parallel``: its gradient is partial on each rank).
        input_is_parallel: the input is already split across ranks, [..., input_size / p]
            (otherwise it is [..., input_size] and scattered here).
        skip_bias_add: return the bias instead of adding it.

    ``forward(input_)``: [s, b, input_size / p] -> ``(output, output_bias or None)``, output
    [s, b, output_size] (all-reduced), or [s/p, b, output_size] under sequence parallelism
    (reduce-scattered). The bias is added after the reduction, as Megatron-core does.

    Raises:
        RuntimeError: sequence_parallel without input_is_parallel (Megatron's rule), or as
            :class:`ColumnParallelLinear`.
        TypeError, ValueError, NotImplementedError: as :class:`ColumnParallelLinear` (the input's width:
            input_size / p with input_is_parallel and p > 1, else input_size).

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``RowParallelLinear``).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Optional[InitMethod], bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__()
        bias, input_is_parallel, skip_bias_add, keep_master_weight_for_test, is_expert = check_bools(
            "RowParallelLinear", bias=bias, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
            keep_master_weight_for_test=keep_master_weight_for_test, is_expert=is_expert)
        self.tp_group, self.tp_rank, self.tp_world_size = _tp_group("RowParallelLinear", config, tp_group, is_expert)
        p = self.tp_world_size
        self.sequence_parallel = bool(config.sequence_parallel) and p > 1
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        self.input_size, self.output_size = input_size, output_size
        _check_sizes("RowParallelLinear", input_size=input_size, output_size=output_size)
        self.input_size_per_partition = divide(input_size, p, "RowParallelLinear: input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.config = config
        self.weight = _new_param(config, output_size, self.input_size_per_partition)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.bias = _new_param(config, output_size) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = bool(config.sequence_parallel)
        _init_weight_and_bias(self, config, init_method, (output_size, input_size), 1, stride)
        self._register_extra_state_default()

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(x·Wᵀ + b, None)``, or ``(x·Wᵀ, b)`` with skip_bias_add; reduced over the ranks."""
        if self.input_is_parallel and self.tp_world_size > 1:
            _check_input("RowParallelLinear", input_, self.input_size_per_partition, self.weight,
                         f"input_size / p: input_is_parallel, p = {self.tp_world_size}")
        else:
            _check_input("RowParallelLinear", input_, self.input_size, self.weight, "input_size")
        if self.tp_world_size == 1:
            output_ = F.linear(input_, self.weight)  # [..., in] -> [..., out]
        else:
            input_parallel = input_ if self.input_is_parallel else \
                scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)  # [.., in] -> [.., in/p]
            output_parallel = F.linear(input_parallel, self.weight)  # [s, b, in/p] -> [s, b, out], partial sums
            if self.sequence_parallel:
                # sum over ranks, keep this rank's s/p tokens: [s, b, out] -> [s/p, b, out]
                output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
            else:
                # sum over ranks, in place on this layer's own GEMM output
                output_ = _ReduceFromModelParallelRegion.apply(output_parallel, self.tp_group, True)
        if self.skip_bias_add:
            return output_, self.bias
        return (output_ + self.bias if self.bias is not None else output_), None

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
                f"TP={self.tp_world_size}")


class _EmbeddingDeterministicGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient is fusedlib's deterministic kernel
    (:func:`fusedlib.kernels.embedding.embedding_backward`) instead of PyTorch's, which adds
    with atomics on CUDA."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids.resolve_neg())  # the backward's kernel reads the ids' memory
        ctx.num_embeddings, ctx.weight_dtype = weight.shape[0], weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    @once_differentiable  # torch's: the gradient is linear in the weight (a second derivative through
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output):  # the incoming gradient raises, as for bias-dropout-add and RoPE)
        (ids,) = ctx.saved_tensors
        return None, embedding_backward(ids, grad_output, ctx.num_embeddings, ctx.weight_dtype)


class VocabParallelEmbedding(KeepParameterAttributes, torch.nn.Module):
    """Token embedding, weight [num_embeddings, embedding_dim], split along the vocabulary over p ranks.

    Rank r holds the rows of ids ``[r·V/p, (r+1)·V/p)``, looks those up, writes zeros for the
    other ids, and the ranks' rows are summed: all-reduced, or with ``reduce_scatter_embeddings``
    (sequence parallelism) reduce-scattered along the sequence.

    Args:
        num_embeddings: vocabulary size V (divisible by p); embedding_dim: h.
        init_method: fills the (full) weight (``config.embedding_init_method``).
        reduce_scatter_embeddings: return [s/p, b, h] (transposed and reduce-scattered) instead of
            [b, s, h] (only with p > 1; on one rank: [b, s, h] as usual).
        config, tp_group: as :class:`ColumnParallelLinear`.

    ``forward(input_)``: int ids [b, s] -> [b, s, h] in the weight's dtype (or [s/p, b, h]).
    With ``config.deterministic_mode`` (p = 1) the weight's gradient comes from fusedlib's
    deterministic kernel (:func:`fusedlib.kernels.embedding.embedding_backward`): PyTorch's CUDA
    kernel adds it with atomics, in an order that changes from run to run.
    An id outside [0, V): on one rank a ValueError on the CPU (a host check) and the lookup's own
    device-side check on CUDA (as in
    :class:`~fusedlib.models.common.embeddings.language_model_embedding.LanguageModelEmbedding`);
    with p > 1 every rank would mask it into a zero row (Megatron-core accepts it), so a small
    kernel checks the ids on the device
    (:func:`fusedlib.kernels.embedding.check_ids_in_range`, no host sync) and fusedlib reports a
    ValueError: at once on the CPU, on CUDA at a later fusedlib call or at
    :func:`fusedlib.runtime.check_errors`, on every rank.

    Raises:
        RuntimeError, ValueError: as :class:`ColumnParallelLinear` (V not divisible by p); ValueError
            for an id outside [0, V) at p > 1 and on one rank on the CPU (above), and for ids on
            another device than the weight.
        TypeError: ids not an int64 or int32 tensor; reduce_scatter_embeddings not a bool.

    Source: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``VocabParallelEmbedding``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Optional[InitMethod],
                 reduce_scatter_embeddings: bool = False, config,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__()
        (reduce_scatter_embeddings,) = check_bools("VocabParallelEmbedding",
                                                   reduce_scatter_embeddings=reduce_scatter_embeddings)
        self.tp_group, self.tp_rank, self.tp_world_size = _tp_group("VocabParallelEmbedding", config, tp_group)
        p = self.tp_world_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        divide(num_embeddings, p, "VocabParallelEmbedding: num_embeddings (the vocabulary)")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, p)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.reduce_scatter_embeddings = bool(reduce_scatter_embeddings) and p > 1
        self.weight = _new_param(config, self.num_embeddings_per_partition, embedding_dim)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.deterministic = bool(config.deterministic_mode)
        self.bias = None
        _init_weight_and_bias(self, config, init_method, (num_embeddings, embedding_dim), 0, 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: [b, s] ids -> [b, s, h] (see the class docstring)."""
        if not isinstance(input_, torch.Tensor) or input_.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: input_ids must be an int64 or int32 tensor, got "
                            f"{input_.dtype if isinstance(input_, torch.Tensor) else type(input_).__name__}")
        if input_.device != self.weight.device:
            # (F.embedding of meta ids and a CPU weight returns a CPU tensor of uninitialized memory)
            raise ValueError(f"VocabParallelEmbedding: input_ids must be on the weight's device "
                             f"{self.weight.device}, got {input_.device}")
        if self.tp_world_size == 1:
            check_ids_below_on_cpu("VocabParallelEmbedding: input_ids", input_, self.num_embeddings,
                                   "num_embeddings")  # (on CUDA the lookup's own device-side check)
            if self.deterministic and torch.is_grad_enabled() and self.weight.requires_grad:
                return _EmbeddingDeterministicGrad.apply(input_, self.weight)
            return F.embedding(input_, self.weight)
        input_ = input_.resolve_neg()  # (a lazy negation view: the range check's kernel reads memory)
        # else a bad id is a zero row on every rank; the kernel reads the ids as one contiguous row
        # (a strided or expanded view, which ``reshape`` keeps as a view, would be read past its
        # elements: ids missed, others reported, memory outside the tensor read), hence a copy of those
        check_ids_in_range(input_.contiguous(), self.num_embeddings)
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)  # ids of other ranks
        masked_input = (input_ - self.vocab_start_index).masked_fill_(input_mask, 0)  # local ids, 0 for others
        output_parallel = F.embedding(masked_input, self.weight)  # [b, s] -> [b, s, h]
        output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0.0)  # other ranks' ids contribute nothing
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)  # [s/p, b, h]
        return _ReduceFromModelParallelRegion.apply(output_parallel, self.tp_group, True)  # sum, in place
