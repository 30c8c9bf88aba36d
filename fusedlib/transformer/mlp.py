"""``MLP``: h -> ffn -> h, with the fc1 bias fused into the activation when the config says so.

``linear_fc1`` returns ``(x·W1ᵀ, b1)`` (``skip_bias_add=True``): the bias is not added by the
GEMM but handed to the activation, so that with ``config.bias_activation_fusion`` one kernel
reads the GEMM's output once and writes act(x + b1):

=================================  ==================  =====================================
activation_func, gated_linear_unit  fused kernel        unfused (PyTorch)
=================================  ==================  =====================================
F.gelu, False                       bias_gelu_impl      F.gelu(x + b1) (erf GeLU)
F.gelu, True                        bias_geglu_impl     gelu(x1 + b)·(x2 + b + offset)
F.silu, True                        bias_swiglu_impl    silu(x1 + b)·(x2 + b + offset)
=================================  ==================  =====================================

(x1, x2: the two halves of fc1's output, activated half first, as Megatron-core's checkpoints
store them.) As in Megatron-core, the fused GeLU and GeGLU kernels compute the *tanh*
approximation of GeLU while ``F.gelu`` is the erf form: the two differ by at most 4.7e-4 in
absolute value. ``activation_func_clamp_value`` clamps x1 <= c and |x2| <= c, in the fused
SwiGLU (``clamp_value``) and in the unfused unit alike. ``linear_fc2`` returns its bias too,
for the layer's bias-dropout-add.

The switch is read at each forward, as in Megatron-core.

``config.gemm_gelu_fusion`` (fusedlib's switch) goes one step further for the GeLU MLP: fc1's
GEMM, the bias-GeLU and fc2's GEMM become one op, :func:`~fusedlib.fusions.fused_dense.
fused_dense_gelu_dense`, with the bias and GeLU in cuBLASLt's GEMM epilogues (and GeLU's
derivative in fc2's input-gradient GEMM). It applies on one tensor-parallel rank with
fusedlib's own linear layers (whose weights it reads), neither with module hooks (it calls
neither layer); otherwise the MLP runs as above.

Tensor parallelism: fc1 is column-parallel and fc2 row-parallel, so each rank computes ffn/p of
the inner features, activation included, and fc2's all-reduce (or reduce-scatter) is the only
communication. A gated unit's fc1 is split with stride 2 (Megatron-core's layout): rank r holds
rows ``[x1_r; x2_r]`` of the two halves, so ``chunk(2)`` pairs them correctly on every rank.

Left out: MoE experts (``is_expert``, ``per_token_scale``), Transformer Engine activations (the
``activation_func`` slot), FP8 input storage, CPU offloading.

Source: Megatron-LM ``megatron/core/transformer/mlp.py``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..checks import short_repr, type_name
from ..fusions.fused_bias_geglu import bias_geglu_impl
from ..fusions.fused_bias_gelu import bias_gelu_impl
from ..fusions.fused_bias_swiglu import bias_swiglu_impl
from ..fusions.fused_dense import fused_dense_gelu_dense
from ..fusions.fused_layer_norm import _has_hooks
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from .module import MegatronModule
from .spec_utils import ModuleSpec, build_module, check_submodules
from .transformer_config import TransformerConfig

__all__ = ["MLPSubmodules", "MLP"]


@dataclass
class MLPSubmodules:
    """The slots of :class:`MLP`: ``linear_fc1`` and ``linear_fc2`` (built in this order).

    ``activation_func`` is Megatron-core's slot for a Transformer Engine activation module; it must
    stay None here (the activation is ``config.activation_func``).

    Source: Megatron-LM ``megatron/core/transformer/mlp.py``.
    """

    linear_fc1: Union[ModuleSpec, type, None] = None
    activation_func: Union[ModuleSpec, type, None] = None
    linear_fc2: Union[ModuleSpec, type, None] = None


class MLP(MegatronModule):
    """Feed-forward block: [s, b, h] -> ``(output [s, b, h], fc2 bias [h] or None)``.

    Args:
        config: reads ffn_hidden_size, hidden_size, gated_linear_unit, activation_func,
            add_bias_linear, init_method, output_layer_init_method, and at each forward
            bias_activation_fusion, activation_func_clamp_value, glu_linear_offset.
        submodules: :class:`MLPSubmodules`.
        is_expert: must be False (MoE left out).
        input_size: default config.hidden_size.
        ffn_hidden_size: default config.ffn_hidden_size (Megatron-core warns when it is not
            given; fusedlib takes the config's silently). With a gated linear unit fc1 has twice
            this width.
        tp_group: None or a one-rank group.

    Raises:
        ValueError: a missing linear slot; input_size or ffn_hidden_size below 1.
        TypeError: submodules lacking an :class:`MLPSubmodules` field
            (:func:`~fusedlib.transformer.spec_utils.check_submodules`); input_size or
            ffn_hidden_size neither None nor an int (numpy ints accepted, bools not).
        NotImplementedError: is_expert, a submodules.activation_func, or per_token_scale.

    Source: Megatron-LM ``megatron/core/transformer/mlp.py`` (``MLP``).
    """

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, is_expert: bool = False,
                 input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__(config=config)
        check_submodules("MLP", submodules, MLPSubmodules)
        if is_expert or submodules.activation_func is not None:
            raise NotImplementedError("MLP: MoE experts (is_expert) and Transformer Engine activations "
                                      "(MLPSubmodules.activation_func) are left out of fusedlib")
        for slot in ("linear_fc1", "linear_fc2"):
            if getattr(submodules, slot) is None:
                raise ValueError(f"MLPSubmodules.{slot} is None: give it a linear layer (e.g. ColumnParallelLinear)")
        for name, size in (("input_size", input_size), ("ffn_hidden_size", ffn_hidden_size)):
            if size is None:
                continue
            if isinstance(size, bool) or not isinstance(size, numbers.Integral):
                raise TypeError(f"MLP: {name} must be None (the config's) or an int >= 1, got "
                                f"{type_name(size)} {short_repr(size)}")
            if size < 1:  # (the config refuses a zero ffn_hidden_size too: an MLP of zeros)
                raise ValueError(f"MLP: {name} must be None (the config's) or an int >= 1, got {size}")
        self.input_size = int(input_size) if input_size is not None else config.hidden_size
        ffn = int(ffn_hidden_size) if ffn_hidden_size is not None else config.ffn_hidden_size
        # [Module 1: fc1] h -> ffn (2·ffn with a gated linear unit: both halves in one GEMM)
        # (a gated unit's two halves are split over tensor-parallel ranks separately, stride 2: each
        # rank holds [x1_r; x2_r], so the activation pairs the right halves on every rank)
        stride = {"stride": 2} if config.gated_linear_unit else {}
        self.linear_fc1 = build_module(submodules.linear_fc1, self.input_size,
                                       2 * ffn if config.gated_linear_unit else ffn, config=config,
                                       init_method=config.init_method, gather_output=False,
                                       bias=config.add_bias_linear, skip_bias_add=True, is_expert=False,
                                       tp_comm_buffer_name="fc1", tp_group=tp_group, **stride)
        self.activation_func = config.activation_func
        # [Module 2: fc2] ffn -> h, bias returned for the bias-dropout-add
        self.linear_fc2 = build_module(submodules.linear_fc2, ffn, config.hidden_size, config=config,
                                       init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                                       input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                       tp_comm_buffer_name="fc2", tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None,
                **kwargs: object) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """fc1, activation (bias fused in or added first), fc2; see the module docstring."""
        if per_token_scale is not None:
            raise NotImplementedError("MLP: per_token_scale (MoE experts) is left out of fusedlib")
        if self.config.gemm_gelu_fusion and self._gemm_gelu_applies():
            fc1, fc2 = self.linear_fc1, self.linear_fc2
            # [s, b, h] -> [s, b, h]: fc1, bias-GeLU and fc2 in one op (the module docstring)
            return fused_dense_gelu_dense(hidden_states, fc1.weight, fc1.bias, fc2.weight), fc2.bias
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, h] -> [s, b, ffn or 2·ffn], bias
        intermediate = self.activation(intermediate, bias)  # -> [s, b, ffn]
        return self.linear_fc2(intermediate)  # -> ([s, b, h], bias)

    def _gemm_gelu_applies(self) -> bool:
        """Whether ``gemm_gelu_fusion`` can take this MLP: fusedlib's linear layers on one rank,
        fc1 returning its bias (the config has checked GeLU, no gated unit, a bias), neither
        with hooks (the op calls neither layer: their hooks, e.g. pruning's or weight norm's
        forward pre-hook that recomputes the weight, would not run)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return (type(fc1) is ColumnParallelLinear and type(fc2) is RowParallelLinear and fc1.tp_world_size == 1
                and fc2.tp_world_size == 1 and fc1.skip_bias_add and fc2.skip_bias_add and fc1.bias is not None
                and fc1.weight is not None and not _has_hooks(fc1) and not _has_hooks(fc2))

    def activation(self, intermediate: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """act(intermediate + bias): one fused kernel with ``config.bias_activation_fusion``, else PyTorch."""
        cfg = self.config
        if cfg.bias_activation_fusion:
            if self.activation_func is F.gelu:
                if cfg.gated_linear_unit:
                    return bias_geglu_impl(intermediate, bias)
                return bias_gelu_impl(intermediate, bias)  # the config made sure the bias exists
            if self.activation_func is F.silu and cfg.gated_linear_unit:
                return bias_swiglu_impl(intermediate, bias, clamp_value=cfg.activation_func_clamp_value)
            raise ValueError("Only support fusion of gelu and swiglu")  # the config rejects this earlier
        if bias is not None:
            intermediate = intermediate + bias
        if not cfg.gated_linear_unit:
            return self.activation_func(intermediate)
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)  # [.., 2·ffn] -> 2 x [.., ffn]
        if (c := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=c)
            x_linear = x_linear.clamp(min=-c, max=c)
        return self.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
