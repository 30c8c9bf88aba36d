"""``TransformerConfig``: the model's shape and the switches that choose each fused kernel.

One dataclass with Megatron-core's field names, defaults and meanings (it merges the fields
of Megatron's ``ModelParallelConfig`` that the transformer package reads), so a Megatron user
reads the same switches. ``__post_init__`` derives what Megatron-core derives and rejects what
it rejects, each with a ValueError that says why.

Left out (Megatron-core has a few hundred fields): pipeline, context, expert and
data parallelism, MoE routing, FP8/FP4, CUDA graphs other than the block's layers and final
norm, CPU offloading, inference, multi-latent attention and the other attention variants. Of
the parallelisms, tensor parallelism (``tensor_model_parallel_size``, ``sequence_parallel``) is implemented: :mod:`fusedlib.parallel`.

Differences from Megatron-core, each deliberate:

* ``TransformerConfig()`` with no arguments is valid and configures only the norms (chapter 4
  builds norms from it): with ``num_attention_heads = 0`` the attention fields stay None and
  with ``num_layers = 0`` so does ``output_layer_init_method``; the modules that need them
  say so when built. (Megatron-core divides by zero.)
* ``hidden_size`` not divisible by ``num_attention_heads`` without ``kv_channels`` is an error
  (Megatron-core floors ``hidden_size // num_attention_heads`` silently).
* ``bias_activation_fusion`` is checked against what fusedlib can fuse (tanh-GeLU, GeGLU,
  SwiGLU) when the config is made; Megatron-core lets SiLU without GLU through and fails at the
  first forward.
* ``activation_func_clamp_value``: must be > 0 and a normal float32 number, needs MoE (``num_moe_experts``), a
  gated linear unit and ``glu_linear_offset = 0``, and with ``bias_activation_fusion`` SwiGLU
  (the only fused unit with a clamp). Megatron-LM's main branch rejects a SwiGLU clamp
  without MoE; megatron-core 0.16 ignores the clamp where it cannot apply it.
* ``sequence_parallel`` with ``tensor_model_parallel_size = 1`` is accepted and changes nothing
  but the norms' marks on their weights (chapter 9 uses it); Megatron-core rejects it.
* Field types and ranges are checked, where Megatron-core takes what it is given: every
  ``bool`` field must be a bool (a str ``"False"`` would be read as True; numpy's bool is
  converted), sizes must be ints >= 1 where set, ``layernorm_epsilon`` a finite number > 0,
  the float knobs finite (within float32's range where the kernels take them as float32),
  ``recompute_modules`` a list of str, ``recompute_method`` valid even without a granularity,
  and ``attention_dropout`` < 1 (dropping every attention probability: the flash and fused
  softmax+dropout kernels refuse it; ``hidden_dropout`` may be 1).

Derived fields, as in Megatron-core: ``__post_init__`` fills ``ffn_hidden_size``,
``kv_channels``, ``num_query_groups`` and the init methods only where they are None. So
``dataclasses.replace(config, hidden_size=...)`` (or ``num_layers=``, ``num_attention_heads=``,
``init_method_std=``) keeps the values derived from the old shape: pass the derived fields as
None in the same call to derive them again, e.g. ``replace(config, hidden_size=64,
ffn_hidden_size=None, kv_channels=None)``.

Source: Megatron-LM ``megatron/core/transformer/transformer_config.py`` and
``megatron/core/model_parallel_config.py``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import struct
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..checks import (FLOAT32_MAX, FLOAT32_TINY, ArgumentTypeError, check_window_size, is_numpy_bool, real_to_float,
                      type_name)
from .enums import AttnBackend

__all__ = ["TransformerConfig", "NORMALIZATIONS", "RECOMPUTE_MODULES"]

#: Values ``TransformerConfig.normalization`` may take (Megatron-core's spelling).
NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")
#: ``recompute_modules`` fusedlib implements (Megatron-core also has "layernorm", "moe", "moe_act",
#: "mla_up_proj", "shared_experts": features left out here).
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "mlp")
_MEGATRON_RECOMPUTE_MODULES = RECOMPUTE_MODULES + ("layernorm", "moe", "moe_act", "mla_up_proj", "shared_experts")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Optional size fields: an int >= 1 when set; what None means, for the messages.
_OPTIONAL_SIZES: dict[str, str] = {
    "kv_channels": "None: hidden_size / num_attention_heads",
    "ffn_hidden_size": "None: 4·hidden_size",
    "num_query_groups": "None: num_attention_heads",
    "recompute_num_layers": 'None unless recompute_granularity is "full"',
}
#: The largest |softmax_scale| the attention kernels take: they scale the scores by
#: softmax_scale·log2(e) in float32 (fusedlib.fusions.fused_attention's rule).
_MAX_SOFTMAX_SCALE = FLOAT32_MAX / math.log2(math.e)


def _is_real(v: object) -> bool:
    """A real number, not a bool (True is an int to Python, but never a size or a scale here)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class TransformerConfig:
    """Configuration of a Transformer. Shapes: h = hidden_size, np = num_attention_heads,
    ng = num_query_groups, hn = kv_channels.

    Raises (from ``__post_init__``), each a ValueError unless noted:
        a field of the wrong type: a bool field given anything but a bool (numpy's bool is
        accepted and converted; a str ``"False"`` is refused, not read as True), a size
        (num_layers, hidden_size, num_attention_heads, tensor_model_parallel_size, kv_channels,
        ffn_hidden_size, num_query_groups, num_moe_experts, window_attn_skip_freq,
        recompute_num_layers) not an int (a bool, a float, a str), a float field not a real
        number, recompute_modules not a list of str: each an
        :class:`~fusedlib.checks.ArgumentTypeError`, a TypeError that is also a ValueError;
        fp16 and bf16 both set; normalization not LayerNorm/RMSNorm; layernorm_epsilon not a
        finite number > 0 within float32's range (nor one that rounds to 0 in float32);
        init_method_std or embedding_init_method_std
        not finite or < 0; softmax_scale not None or finite (with |softmax_scale|·log2(e)
        within float32's range); hidden_dropout outside [0, 1], attention_dropout outside
        [0, 1); kv_channels, ffn_hidden_size, num_query_groups, recompute_num_layers < 1 when
        set; window_attn_skip_freq not an int >= 1 or a 0/1 list of num_layers entries;
        hidden_size % num_attention_heads != 0 without kv_channels;
        num_attention_heads % num_query_groups != 0; tensor_model_parallel_size < 1, or not
        dividing num_attention_heads and num_query_groups; activation_func not callable,
        glu_linear_offset not a finite number, init_method, output_layer_init_method or
        embedding_init_method neither None nor callable (each an ArgumentTypeError but the
        non-finite offset); bias_activation_fusion with an
        activation fusedlib cannot fuse; gemm_gelu_fusion without bias_activation_fusion and a
        non-gated GeLU; a bad activation_func_clamp_value (see the module
        docstring); num_moe_experts <= 0; a bad window_size; a bad recompute setting
        (recompute_method not "uniform"/"block"/None, with or without recompute_granularity); a bad
        CUDA-graph setting (an unknown ``cuda_graph_impl``, ``enable_cuda_graph`` not a bool,
        ``cuda_graph_warmup_steps`` < 1 with "local",
        "local" with recomputation or with tensor_model_parallel_size > 1); attention_backend
        flash with params_dtype float64;
        TypeError for params_dtype not a float dtype or attention_backend not an AttnBackend.

    Source: Megatron-LM ``megatron/core/transformer/transformer_config.py``.
    """

    # ---------------------------------------------------------------- parallelism and precision
    tensor_model_parallel_size: int = 1
    """p, the ranks each layer is split over (:mod:`fusedlib.parallel`; p > 1 needs
    ``fusedlib.parallel.initialize_model_parallel(p)`` before the model is built)."""
    sequence_parallel: bool = False
    """Split activations outside tensor-parallel regions along the sequence (Korthikanti et al.
    2022, arXiv:2205.05198); with p > 1 the sequence length must be divisible by p. The norms
    mark their weights with it, for the gradient all-reduce (``fusedlib.parallel.finalize_model_grads``)."""
    fp16: bool = False
    """The model runs in fp16 (``Float16Module`` casts to it; the softmax checks its input's dtype)."""
    bf16: bool = False
    """The model runs in bf16 (as ``fp16``)."""
    params_dtype: torch.dtype = torch.float32
    """dtype in which every parameter is created."""
    use_cpu_initialization: bool = False
    """Create the parameters on the CPU; otherwise on fusedlib's default device (CUDA when present)."""
    perform_initialization: bool = True
    """Initialize the weights (init_method) and zero the biases; off when a checkpoint will be loaded."""

    # ---------------------------------------------------------------- model shape
    num_layers: int = 0
    """Transformer layers in the block."""
    hidden_size: int = 0
    """h: the width of the residual stream."""
    num_attention_heads: int = 0
    """np: query heads."""
    num_query_groups: Optional[int] = None
    """ng: key/value heads (grouped-query attention); None: np (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """The MLP's inner width; None: 4·h."""
    kv_channels: Optional[int] = None
    """hn: the width of one head; None: h / np."""
    hidden_dropout: float = 0.1
    """Dropout probability of the residual branches (bias-dropout-add) and of the embeddings, in [0, 1]."""
    attention_dropout: float = 0.1
    """Dropout probability of the attention probabilities, in [0, 1)."""
    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32: the embedding's output is cast to fp32, each norm casts its
    input to its weight's dtype, and bias-dropout-add returns the residual's dtype."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the norm (the original BERT ordering). Megatron-core keeps the field
    but its TransformerLayer ignores it; fusedlib implements it as Megatron-LM's legacy layer did."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm: a finite number > 0 (<= float32's max)."""
    layernorm_zero_centered_gamma: bool = False
    """Store the norms' gamma as gamma - 1 (so weight decay pulls gamma towards 1)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm"."""
    qk_layernorm: bool = False
    """Normalize queries and keys per head (the layer spec's q_layernorm/k_layernorm slots)."""
    add_bias_linear: bool = True
    """A bias in every linear layer (QKV, attention output, both MLP layers)."""
    add_qkv_bias: bool = False
    """A bias in the QKV projection only."""
    gated_linear_unit: bool = False
    """The MLP's fc1 outputs two halves, act(x1)·(x2 + glu_linear_offset) (Shazeer 2020, arXiv:2002.05202)."""
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    """The MLP's activation (F.gelu: GeLU, with GLU GeGLU; F.silu with GLU: SwiGLU)."""
    glu_linear_offset: float = 0.0
    """Added to the linear half of a gated linear unit."""
    activation_func_clamp_value: Optional[float] = None
    """Clamp of a gated linear unit's halves: x1 <= c, |x2| <= c (used with MoE experts)."""
    num_moe_experts: Optional[int] = None
    """Experts of a MoE layer (MoE layers themselves are left out of fusedlib)."""
    rotary_interleaved: bool = False
    """RoPE rotates pairs of even and odd channels (RoFormer) instead of the two halves (LLaMA)."""
    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention (left, right); -1 is an unbounded side."""
    window_attn_skip_freq: Optional[int | List[int]] = None
    """Which layers skip the window: every n-th (an int >= 1), or a 0/1 list of num_layers entries
    (1: window, 0: full attention)."""

    # ---------------------------------------------------------------- attention
    attention_backend: AttnBackend = AttnBackend.auto
    """Materialised attention (local, unfused) or torch's scaled_dot_product_attention (flash, fused, auto)."""
    softmax_scale: Optional[float] = None
    """The scores' scale, a finite number (|softmax_scale|·log2(e) within float32's range); None: 1 / sqrt(hn)."""
    apply_query_key_layer_scaling: bool = False
    """Scale Q·K^T by 1/layer_number before the softmax and by layer_number inside it (fp16
    range); sets attention_softmax_in_fp32, as Megatron-core does."""
    attention_softmax_in_fp32: bool = True
    """Mask and softmax in fp32 for fp16/bf16 scores (the unfused path; the kernel always does)."""
    deterministic_mode: bool = False
    """Choose code with deterministic execution (Megatron-core's switch): here, fusedlib's
    FlashAttention backward without atomics (``flash_attention(deterministic=True)``), and the
    token embedding's weight gradient from fusedlib's kernel
    (:func:`fusedlib.kernels.embedding.embedding_backward`) instead of PyTorch's, which adds with
    atomics on CUDA: bitwise reproducible. False lets FlashAttention sum dQ by atomic adds where
    that is faster, and leaves the embedding to PyTorch."""

    # ---------------------------------------------------------------- initialization
    init_method: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """Weight init; None: N(0, init_method_std). Biases are zeroed."""
    output_layer_init_method: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """Init of the attention's and MLP's output layers; None: N(0, init_method_std / sqrt(2·num_layers))."""
    init_method_std: float = 0.02
    """Standard deviation of the default inits, finite, >= 0 (0: all-zero weights, as torch's normal_ gives)."""
    embedding_init_method: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """Init of the embeddings; None: init_method, or N(0, embedding_init_method_std) if that differs."""
    embedding_init_method_std: Optional[float] = None
    """None: init_method_std."""

    # ---------------------------------------------------------------- fusions
    bias_activation_fusion: bool = False
    """Fuse the MLP's fc1 bias into its activation (bias_gelu_impl, bias_geglu_impl, bias_swiglu_impl)."""
    gemm_gelu_fusion: bool = False
    """fusedlib's (not Megatron-core's; Transformer Engine's ``LayerNormMLP`` does the same): the fused
    bias-GeLU moves into the MLP's GEMMs, cuBLASLt's epilogues (``fused_dense_gelu_dense``), on one
    tensor-parallel rank; needs bias_activation_fusion with GeLU, no gated unit."""
    masked_softmax_fusion: bool = False
    """Fused scale + mask + softmax (and, in training with attention dropout, the fused softmax+dropout)."""
    persist_layer_norm: bool = False
    """Apex's persistent LayerNorm kernel (fusedlib's kernels need no such switch: see FusedLayerNorm)."""
    memory_efficient_layer_norm: bool = False
    """The norms save their output instead of their input for the backward."""
    bias_dropout_fusion: bool = False
    """Fused bias + dropout + residual add."""
    apply_rope_fusion: bool = False
    """Fused RoPE kernel."""
    cross_entropy_loss_fusion: bool = False
    """The fused vocab-parallel cross entropy (two all-reduces instead of three)."""
    cross_entropy_fusion_impl: str = "native"
    """Which fused cross entropy: "native" (fusedlib's; Megatron's "te" is Transformer Engine's)."""

    # ---------------------------------------------------------------- activation recomputation
    recompute_granularity: Optional[str] = None
    """None, "full" (whole layers, by recompute_method) or "selective" (recompute_modules)."""
    recompute_method: Optional[str] = None
    """"uniform" (checkpoint chunks of recompute_num_layers layers) or "block" (the first
    recompute_num_layers layers); required for "full"."""
    recompute_num_layers: Optional[int] = None
    """Layers per chunk ("uniform") or layers recomputed ("block"); None for "selective"."""
    recompute_modules: Optional[List[str]] = None
    """With "selective": the submodules recomputed, a list of "core_attn" and "mlp" (a bare string is
    refused); None: ["core_attn"]."""

    # ---------------------------------------------------------------- CUDA graphs
    cuda_graph_impl: str = "none"
    """"none", or "local": in training, the layers and the final norm of a
    :class:`~fusedlib.transformer.transformer_block.TransformerBlock` run as two CUDA graphs (their
    forward and their backward, captured with ``torch.cuda.make_graphed_callables`` at the first
    training call for each input signature: :mod:`fusedlib.transformer.cuda_graphs`), so a step
    pays one graph launch per pass instead of every kernel's host-side launch.
    Megatron-core's "transformer_engine" needs Transformer Engine and is not available."""
    enable_cuda_graph: bool = False
    """Deprecated spelling of ``cuda_graph_impl="local"`` (as in Megatron-core)."""
    cuda_graph_warmup_steps: int = 3
    """Eager iterations run (on a side stream, with copies of the inputs) before each capture;
    >= 1, checked with ``cuda_graph_impl="local"``. (Megatron-core counts training steps before
    its capture with the same name.)"""

    def __post_init__(self) -> None:
        """Derive Megatron-core's defaults, and reject what Megatron-core rejects (see the class)."""
        self._check_field_types()
        self._check_basics()
        if self.fp16 and self.bf16:
            raise ValueError(f"Only one of fp16 ({self.fp16}) and bf16 ({self.bf16}) should be True.")
        self._derive_shapes()
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True  # Megatron-core: the 1/layer_number scale needs fp32 scores
        self._check_activation()
        self._check_recompute()
        self._check_cuda_graph()
        self._check_init_methods()
        self._derive_init_methods()

    # ------------------------------------------------------------ checks, one topic each
    def _check_field_types(self) -> None:
        """Every bool field a bool, every optional size an int >= 1: a non-bool switch would be
        read as its truth value (``"False"`` is True), a float size floored or broken later."""
        for f in dataclasses.fields(self):
            if f.type not in ("bool", bool):
                continue
            v = getattr(self, f.name)
            if v is True or v is False:
                continue
            if is_numpy_bool(v):
                setattr(self, f.name, bool(v))
                continue
            raise ArgumentTypeError(f"{f.name} must be a bool, got {type_name(v)} {v!r}")
        for name, none_means in _OPTIONAL_SIZES.items():
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(f"{name} must be an int >= 1 ({none_means}), got {type_name(v)} {v!r}")
            # 0 is what __post_init__ derives from hidden_size = 0 (a config for parallel state or
            # the norms alone): dataclasses.replace passes it back, and it must round-trip
            if v < 1 and not (v == 0 and self.hidden_size == 0 and name in ("ffn_hidden_size", "kv_channels")):
                raise ValueError(f"{name} must be an int >= 1 ({none_means}), got {v}")
            setattr(self, name, int(v))  # numpy's int64 as a Python int (modules test isinstance(v, int))
        n = self.num_moe_experts
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
            raise ArgumentTypeError(f"num_moe_experts must be an int (or None for no MoE), got {type_name(n)} {n!r}")
        freq = self.window_attn_skip_freq
        if freq is not None:
            if isinstance(freq, list):
                if not all(isinstance(e, numbers.Integral) and e in (0, 1) for e in freq):
                    raise ValueError(f"window_attn_skip_freq as a list must hold one 0 or 1 per layer (1: sliding "
                                     f"window, 0: full attention), got {freq!r}")
                if self.num_layers > 0 and len(freq) != self.num_layers:
                    raise ValueError(f"window_attn_skip_freq as a list must have one entry per layer, "
                                     f"num_layers = {self.num_layers}, got {len(freq)}")
                self.window_attn_skip_freq = [int(e) for e in freq]
            elif isinstance(freq, bool) or not isinstance(freq, numbers.Integral):
                raise ArgumentTypeError(f"window_attn_skip_freq must be None, an int >= 1 (every n-th layer skips the "
                                        f"window) or a list of 0/1 per layer, got {type_name(freq)} {freq!r}")
            elif freq < 1:
                raise ValueError(f"window_attn_skip_freq must be an int >= 1 (every n-th layer skips the window), "
                                 f"got {freq}")
            else:
                self.window_attn_skip_freq = int(freq)  # numpy's int64 as a Python int
        mods = self.recompute_modules
        if mods is not None and not (isinstance(mods, (list, tuple)) and all(isinstance(m, str) for m in mods)):
            hint = f" (a list is expected: [{mods!r}])" if isinstance(mods, str) else ""
            raise ArgumentTypeError(f"recompute_modules must be a list of module names, of "
                                    f"{', '.join(map(repr, RECOMPUTE_MODULES))}, got {type_name(mods)} {mods!r}{hint}")

    def _check_basics(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {', '.join(map(repr, NORMALIZATIONS))}, got {self.normalization!r}"
            )
        eps = self.layernorm_epsilon
        if not _is_real(eps):
            raise ArgumentTypeError(f"layernorm_epsilon must be a finite number > 0, got {type_name(eps)} {eps!r}")
        if not 0.0 < eps <= FLOAT32_MAX:  # NaN fails this too
            raise ValueError(f"layernorm_epsilon must be a finite number > 0, at most float32's max "
                             f"({FLOAT32_MAX:.4g}: the norms add it in float32), got {eps!r}")
        if struct.unpack("f", struct.pack("f", eps))[0] == 0.0:  # a constant row would then give 0/0
            raise ValueError(f"layernorm_epsilon must be a finite number > 0 that float32 holds (the norms add "
                             f"it in float32, where {eps!r} rounds to 0; float32's smallest is about 1.4e-45)")
        for name in ("init_method_std", "embedding_init_method_std"):
            std = getattr(self, name)
            if std is None and name == "embedding_init_method_std":
                continue
            if not _is_real(std):
                raise ArgumentTypeError(f"{name} must be a finite number >= 0, got {type_name(std)} {std!r}")
            # 0 is meaningful: torch.nn.init.normal_(std=0) fills zeros
            if not 0.0 <= real_to_float(name, std, "a finite number >= 0") < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (a standard deviation), got {std!r}")
        scale = self.softmax_scale
        if scale is not None:
            if not _is_real(scale):
                raise ArgumentTypeError(f"softmax_scale must be None or a finite number, got {type_name(scale)} "
                                        f"{scale!r}")
            if not -_MAX_SOFTMAX_SCALE <= scale <= _MAX_SOFTMAX_SCALE:
                raise ValueError(f"softmax_scale must be None or a finite number, with |softmax_scale|·log2(e) <= "
                                 f"float32's max ({FLOAT32_MAX:.4g}: the attention kernels scale the scores by it in "
                                 f"float32), got {scale!r}")
        if self.params_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"params_dtype must be one of {_FLOAT_DTYPES}, got {self.params_dtype!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not _is_real(p):
                raise ArgumentTypeError(f"{name} must be a probability in [0, 1], got {type_name(p)} {p!r}")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        if not self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be a probability in [0, 1) (1 would drop every attention "
                             f"probability: the attention output would be zeros; the flash and fused softmax+dropout "
                             f"kernels refuse it), got {self.attention_dropout!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(f"{name} must be an int >= 0, got {type_name(v)} {v!r}")
            if v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
            setattr(self, name, int(v))  # numpy's int64 as a Python int (the sizes derived from it too)
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"tensor_model_parallel_size must be >= 1, got {self.tensor_model_parallel_size}")
        if not isinstance(self.attention_backend, AttnBackend):
            try:  # Megatron-core's enum (or any enum) with one of AttnBackend's member names
                self.attention_backend = AttnBackend[self.attention_backend.name]
            except (AttributeError, KeyError):
                raise TypeError(f"attention_backend must be an AttnBackend ({', '.join(AttnBackend.__members__)}), "
                                f"got {self.attention_backend!r}") from None
        if self.attention_backend is AttnBackend.flash and self.params_dtype == torch.float64 and not (
                self.bf16 or self.fp16):  # (else refused at the first forward, naming the kernel's q)
            raise ValueError("attention_backend flash runs float16, bfloat16 or float32, got params_dtype float64: "
                             "choose attention_backend local or unfused for float64")
        self.window_size = check_window_size(self.window_size)
        if self.num_moe_experts is not None and self.num_moe_experts <= 0:
            raise ValueError(f"num_moe_experts must be positive (or None for no MoE), got {self.num_moe_experts}")
        if self.cross_entropy_fusion_impl != "native":
            raise ValueError(f"cross_entropy_fusion_impl must be 'native' (fusedlib's kernel; 'te' is Transformer "
                             f"Engine's, not used here), got {self.cross_entropy_fusion_impl!r}")

    def _derive_shapes(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_attention_heads == 0:  # a norms-only config: nothing to derive
            return
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) when kv_channels is not given")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_query_groups ({self.num_query_groups}): each key/value head serves "
                             "the same number of query heads")
        p = self.tensor_model_parallel_size
        if self.num_attention_heads % p or self.num_query_groups % p:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) and num_query_groups "
                             f"({self.num_query_groups}) must both be divisible by tensor_model_parallel_size ({p}): "
                             "each rank holds whole heads and whole key/value groups")

    def _check_activation(self) -> None:
        act, glu = self.activation_func, self.gated_linear_unit
        if not callable(act):
            raise ArgumentTypeError(f"activation_func must be a callable (e.g. torch.nn.functional.gelu), got "
                                    f"{type_name(act)} {act!r}")
        offset = self.glu_linear_offset
        if not _is_real(offset):
            raise ArgumentTypeError(f"glu_linear_offset must be a finite number, got {type_name(offset)} {offset!r}")
        if not math.isfinite(real_to_float("glu_linear_offset", offset, "a finite number")):
            raise ValueError(f"glu_linear_offset must be a finite number (the GLU adds it to the linear half), "
                             f"got {offset!r}")
        if self.bias_activation_fusion:
            if act not in (F.gelu, F.silu):
                raise ValueError("When bias_activation_fusion is True, activation_func must be F.gelu (GeLU, or GeGLU "
                                 f"with gated_linear_unit) or F.silu with gated_linear_unit (SwiGLU), got {act!r}")
            if act is F.silu and not glu:
                raise ValueError("When bias_activation_fusion is True and activation_func is F.silu, "
                                 "gated_linear_unit must be True (fusedlib fuses SwiGLU, not SiLU alone)")
            if act is F.gelu and not glu and not self.add_bias_linear:
                raise ValueError("When bias_activation_fusion is True, gated_linear_unit is False and activation "
                                 "function is gelu, add_bias_linear must also be True.")
            if self.glu_linear_offset != 0.0:
                raise ValueError("When bias_activation_fusion is True, glu_linear_offset must be 0 (Megatron fuses "
                                 "an offset for quick_gelu only; fusedlib's fused units have none)")
        if self.gemm_gelu_fusion and not (self.bias_activation_fusion and act is F.gelu and not glu):
            raise ValueError("gemm_gelu_fusion moves the fused bias-GeLU into the MLP's GEMMs: it needs "
                             "bias_activation_fusion=True, activation_func=F.gelu and gated_linear_unit=False")
        c = self.activation_func_clamp_value
        if c is None:
            return
        if (isinstance(c, bool) or not isinstance(c, numbers.Real)
                or not math.isfinite(real_to_float("activation_func_clamp_value", c, "a finite number > 0")) or c <= 0):
            raise ValueError(f"activation_func_clamp_value must be a finite number > 0 (or None), got {c!r}")
        if not FLOAT32_TINY <= c <= FLOAT32_MAX:
            raise ValueError(f"activation_func_clamp_value must be a finite number > 0 in float32's normal range "
                             f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (the kernels clamp in float32), got {c!r}")
        if self.num_moe_experts is None:
            raise ValueError("activation_func_clamp_value is only supported with MoE (set num_moe_experts)")
        if not glu:
            raise ValueError("activation_func_clamp_value clamps the halves of a gated linear unit: "
                             "set gated_linear_unit=True")
        if self.glu_linear_offset != 0.0:
            raise ValueError("activation_func_clamp_value needs glu_linear_offset == 0 (fusedlib's clamped "
                             f"units have no offset), got {self.glu_linear_offset}")
        if self.bias_activation_fusion and act is not F.silu:
            raise ValueError("activation_func_clamp_value with bias_activation_fusion needs SwiGLU (F.silu): "
                             "fusedlib's fused GeGLU has no clamp")

    def _check_init_methods(self) -> None:
        """The init fields: None (derived from the stds) or callables that fill a weight."""
        for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ArgumentTypeError(f"{name} must be None or a callable that fills a weight in place (e.g. "
                                        f"fusedlib.transformer.utils.init_method_normal(0.02)), got {type_name(fn)} "
                                        f"{fn!r}")

    def _check_recompute(self) -> None:
        g, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        # checked with or without a granularity: a typo must not wait for the day "full" is set
        if method is not None and method not in ("block", "uniform"):
            raise ValueError(f'recompute_method must be "block" or "uniform" (or None), got {method!r}')
        if g is not None:
            if g not in ("full", "selective"):
                raise ValueError(f'recompute_granularity must be None, "full" or "selective", got {g!r}')
            if g == "full":
                if method is None:
                    raise ValueError('With recompute_granularity "full", recompute_method must be "block" or "uniform"')
                if n is None or not 1 <= n <= max(1, self.num_layers):
                    raise ValueError(f'With recompute_granularity "full", recompute_num_layers must be between 1 and '
                                     f"num_layers ({self.num_layers}), got {n!r}")
            elif n is not None:
                raise ValueError(f'With recompute_granularity "selective", recompute_num_layers must be None, got {n}')
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        unknown = sorted(set(self.recompute_modules) - set(_MEGATRON_RECOMPUTE_MODULES))
        if unknown:  # a misspelling, whatever the granularity (Megatron-core's other names pass unless selective)
            raise ValueError(f"recompute_modules {unknown} are not module names (fusedlib implements "
                             f"{', '.join(RECOMPUTE_MODULES)}; Megatron-core also names "
                             f"{', '.join(_MEGATRON_RECOMPUTE_MODULES[len(RECOMPUTE_MODULES):])})")
        bad = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        if g == "selective" and bad:
            raise ValueError(f"recompute_modules {bad} are not implemented in fusedlib (choices: "
                             f"{', '.join(RECOMPUTE_MODULES)})")

    def _check_cuda_graph(self) -> None:
        if not isinstance(self.enable_cuda_graph, bool):
            raise ValueError(f"enable_cuda_graph must be a bool, got {self.enable_cuda_graph!r}")
        if self.enable_cuda_graph:
            if self.cuda_graph_impl != "none":
                raise ValueError("Do not use enable_cuda_graph with cuda_graph_impl: enable_cuda_graph is the "
                                 "deprecated spelling of cuda_graph_impl='local' "
                                 f"(got cuda_graph_impl={self.cuda_graph_impl!r})")
            # (a UserWarning, as Megatron-core's: a DeprecationWarning from here would be hidden)
            warnings.warn("enable_cuda_graph is deprecated, use cuda_graph_impl='local' instead.", stacklevel=4)
            self.cuda_graph_impl = "local"
            self.enable_cuda_graph = False  # mapped: a copy (dataclasses.replace) must not map it again
        if self.cuda_graph_impl not in ("none", "local"):
            raise ValueError(f"cuda_graph_impl must be 'none' or 'local' (fusedlib has no Transformer Engine), "
                             f"got {self.cuda_graph_impl!r}")
        w = self.cuda_graph_warmup_steps  # (checked without graphs too: a bad value was kept unnoticed)
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1:
            raise ValueError(f"cuda_graph_warmup_steps must be an int >= 1 (the kernels are compiled and the libraries "
                             f"initialised in an eager iteration before the capture), got {w!r}")
        if self.cuda_graph_impl == "none":
            return
        if self.recompute_granularity is not None:
            raise ValueError(f"cuda_graph_impl='local' is implemented without activation recomputation "
                             f"(got recompute_granularity={self.recompute_granularity!r}): turn one of the two off")
        if self.tensor_model_parallel_size > 1:
            raise ValueError("cuda_graph_impl='local' is implemented for tensor_model_parallel_size = 1 only, got "
                             f"{self.tensor_model_parallel_size}")

    def _derive_init_methods(self) -> None:
        # imported here: transformer.utils imports the fused softmax, which imports this package
        from .utils import init_method_normal, scaled_init_method_normal

        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None and self.num_layers > 0:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
