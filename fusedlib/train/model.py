"""The models the trainer builds: fusedlib's ``GPTModel``, fused or unfused, and the plain baseline.

All three compute the same function from the same weights (up to rounding):

    ids [b, s] -> token + learned position embedding -> L pre-LN layers (LayerNorm, causal
    self-attention, LayerNorm, tanh-GeLU MLP, a bias in every linear layer) -> final LayerNorm
    -> output layer tied to the token embedding -> per-token cross entropy [b, s]

* ``gpt`` with ``spec="fused"``: ``GPTModel`` from ``get_gpt_layer_local_spec`` with every fusion
  switch on (:data:`FUSED_SWITCHES`: fused LayerNorm, bias-GeLU (in the MLP's GEMM epilogues on
  CUDA, ``gemm_gelu_fusion``), bias-dropout-add, the softmax
  with its dropout when the attention is materialised, the fused cross entropy) and the
  attention backend asked for (``flash``, fusedlib's FlashAttention kernel, by default;
  ``auto``: torch's ``scaled_dot_product_attention``; ``local``: the materialised attention
  with fusedlib's softmax kernels).
* ``gpt`` with ``spec="unfused"``: ``GPTModel`` from ``get_gpt_layer_unfused_spec`` with every
  switch off (``without_fusions``): torch's norms, softmax and dropout, the materialised
  attention, the unfused cross entropy. The activation is torch's tanh GeLU, the function the
  fused bias-GeLU kernel computes.
* ``gpt`` with ``spec="fused"`` and ``fused_layer``: the same model with its layers from
  ``get_gpt_fused_layer_spec``: each layer a ``FusedTransformerLayer``, whose training forward
  and backward are one autograd node (the same kernels, results bit for bit where they are
  deterministic, less host time per layer).
* ``plain``: :class:`~fusedlib.train.plain_gpt.PlainGPT` (nanoGPT-style).

Initial weights (:func:`initial_state`): one ``GPTModel`` built on the CPU in float32 from the
seed, Megatron-core's init (N(0, 0.02), output projections N(0, 0.02/sqrt(2L)), biases 0, norms
1); every model loads that state dict (the plain model through
:func:`~fusedlib.train.plain_gpt.plain_state_dict_from_gpt`), so the same seed gives the same
start on every model and every device.

Source: Megatron-LM ``megatron/core/models/gpt/gpt_model.py`` and ``gpt_layer_specs.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..checks import check_bools
from ..models.gpt import GPTModel, get_gpt_fused_layer_spec, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from ..models.gpt.gpt_layer_specs import without_fusions
from ..transformer.enums import AttnBackend
from ..transformer.transformer_config import TransformerConfig
from .data import VOCAB_SIZE
from .plain_gpt import PlainGPT, plain_state_dict_from_gpt

__all__ = ["MODELS", "SPECS", "FUSED_SWITCHES", "ModelShape", "gpt_config", "build_gpt", "initial_state",
           "build_model", "count_parameters"]

MODELS = ("gpt", "plain")
SPECS = ("fused", "unfused")
#: The TransformerConfig switches of the fused model.
FUSED_SWITCHES = ("bias_activation_fusion", "gemm_gelu_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                  "persist_layer_norm", "cross_entropy_loss_fusion")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: layers, hidden size, heads, MLP width (None: 4·hidden), the longest
    sequence (rows of the position table), the vocabulary, and the dropout probability (of the
    embedding, the attention probabilities and both residual branches).

    Raises:
        ValueError: a size < 1, hidden not divisible by heads, dropout outside [0, 1).

    Source: fusedlib's own.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    ffn: Optional[int] = None
    vocab: int = VOCAB_SIZE
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.ffn is not None and (not isinstance(self.ffn, int) or self.ffn < 1):
            raise ValueError(f"ffn must be an int >= 1 or None, got {self.ffn!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden}): hidden must be divisible "
                             f"by heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


_tanh_gelu = functools.partial(F.gelu, approximate="tanh")


def gpt_config(shape: ModelShape, spec: str = "fused", attention_backend: str = "flash",
               dtype: torch.dtype = torch.float32, cpu_init: bool = False, tp: int = 1,
               sequence_parallel: bool = False, cuda_graph: bool = False) -> TransformerConfig:
    """The ``TransformerConfig`` of a fused or unfused ``GPTModel`` of ``shape``.

    Args:
        shape: the model's shape.
        spec: "fused" (:data:`FUSED_SWITCHES` on, ``attention_backend``) or "unfused" (every
            switch off, the materialised attention, torch's tanh GeLU).
        attention_backend: an ``AttnBackend`` name, for the fused spec ("flash": fusedlib's
            FlashAttention; "auto": SDPA; "local": materialised, fusedlib's softmax).
        dtype: the parameters' (bf16 also sets ``config.bf16``).
        cpu_init: create the parameters on the CPU.
        tp, sequence_parallel: ``tensor_model_parallel_size`` and ``sequence_parallel``
            (:mod:`fusedlib.parallel`).
        cuda_graph: ``cuda_graph_impl="local"``: in training the layers and the final norm run as CUDA graphs
            (:mod:`fusedlib.transformer.cuda_graphs`).

    Every configuration sets ``deterministic_mode`` (FlashAttention's backward without atomics, the
    token embedding's gradient from fusedlib's deterministic kernel), so that a resumed run repeats
    the uninterrupted one bit for bit.

    Raises:
        ValueError: an unknown spec or backend; ``cuda_graph`` with ``tp`` > 1.

    Source: Megatron-LM ``megatron/core/transformer/transformer_config.py`` (``TransformerConfig``).
    """
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    if attention_backend not in AttnBackend.__members__:
        raise ValueError(f"attention_backend must be one of {list(AttnBackend.__members__)}, got {attention_backend!r}")
    cfg = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                            ffn_hidden_size=shape.ffn, hidden_dropout=shape.dropout,
                            attention_dropout=shape.dropout, activation_func=F.gelu, add_bias_linear=True,
                            params_dtype=dtype, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
                            use_cpu_initialization=cpu_init, attention_backend=AttnBackend[attention_backend],
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                            cuda_graph_impl="local" if cuda_graph else "none",
                            deterministic_mode=True,  # a resumed run repeats the uninterrupted one bit for bit
                            **{k: True for k in FUSED_SWITCHES})
    if spec == "unfused":
        cfg = dataclasses.replace(without_fusions(cfg), activation_func=_tanh_gelu)
    return cfg


def build_gpt(shape: ModelShape, spec: str = "fused", attention_backend: str = "flash",
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: int = 1,
              sequence_parallel: bool = False, cuda_graph: bool = False, fused_layer: bool = False) -> GPTModel:
    """fusedlib's ``GPTModel`` of ``shape`` (learned positions, tied output layer), its weights
    from Megatron-core's init with torch's current RNG, on ``device`` in ``dtype``; with ``tp`` > 1
    this rank's part of the tensor-parallel model (``fusedlib.parallel``'s groups must exist).
    ``fused_layer``: the layers from ``get_gpt_fused_layer_spec`` (``FusedTransformerLayer``, the
    fused spec only).

    Raises:
        ValueError: as :func:`gpt_config`; ``fused_layer`` with the unfused spec; as
            ``FusedTransformerLayer`` for a config it does not take (e.g. ``tp`` > 1), naming
            the TransformerConfig field (``config.tensor_model_parallel_size``).
        TypeError: ``cuda_graph`` or ``fused_layer`` not a bool.

    Source: Megatron-LM ``megatron/core/models/gpt/gpt_model.py`` (``GPTModel``) and
    ``gpt_layer_specs.py``.
    """
    device = torch.device(device)
    cuda_graph, fused_layer = check_bools("build_gpt", cuda_graph=cuda_graph, fused_layer=fused_layer)
    cfg = gpt_config(shape, spec, attention_backend, dtype, cpu_init=device.type == "cpu", tp=tp,
                     sequence_parallel=sequence_parallel, cuda_graph=cuda_graph)
    if fused_layer and spec != "fused":
        raise ValueError(f"fused_layer needs spec 'fused' (FusedTransformerLayer runs the fused local spec), "
                         f"got {spec!r}")
    if fused_layer:
        layer_spec = get_gpt_fused_layer_spec()
    else:
        layer_spec = get_gpt_layer_local_spec() if spec == "fused" else get_gpt_layer_unfused_spec()
    model = GPTModel(cfg, layer_spec, vocab_size=shape.vocab, max_sequence_length=shape.seq,
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    return model.to(device=device, dtype=dtype)


def initial_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights of every model of ``shape``: a ``GPTModel``'s float32 state dict,
    built on the CPU after ``torch.manual_seed(seed)`` (torch's global RNG is restored after).

    Source: fusedlib's own.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_gpt(shape, "unfused", dtype=torch.float32, device="cpu")
    return model.state_dict()


def build_model(kind: str, shape: ModelShape, seed: int, spec: str = "fused", attention_backend: str = "flash",
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: int = 1,
                sequence_parallel: bool = False, cuda_graph: bool = False,
                fused_layer: bool = False) -> torch.nn.Module:
    """A model of ``kind`` ("gpt" or "plain") and ``shape`` holding :func:`initial_state` (``seed``),
    on ``device`` in ``dtype``, in training mode. ``spec``, ``attention_backend``, ``tp``,
    ``sequence_parallel``, ``cuda_graph`` (the block as CUDA graphs) and ``fused_layer`` (each
    layer one autograd node: :func:`build_gpt`) apply to "gpt"; with
    ``tp`` > 1 the model is this tensor-parallel rank's part and holds its shard of the same
    initial state (``fusedlib.parallel.shard_state_dict``), so every ``tp`` starts from the same
    weights.

    Raises:
        ValueError: an unknown kind, spec or backend, a bad shape, or ``tp`` > 1, ``cuda_graph``
            or ``fused_layer`` with "plain"; as :func:`build_gpt`.
        TypeError: ``cuda_graph`` or ``fused_layer`` not a bool.

    Source: fusedlib's own.
    """
    cuda_graph, fused_layer = check_bools("build_model", cuda_graph=cuda_graph, fused_layer=fused_layer)
    if kind not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {kind!r}")
    if kind == "plain" and cuda_graph:
        raise ValueError("cuda_graph is fusedlib's GPTModel's (config.cuda_graph_impl); the plain model has none")
    if kind == "plain" and fused_layer:
        raise ValueError("fused_layer is fusedlib's GPTModel's (FusedTransformerLayer); the plain model has none")
    if kind == "plain" and tp != 1:
        raise ValueError(f"tp must be 1 for the plain model (tensor parallelism is fusedlib's GPTModel's), got {tp}")
    state = initial_state(shape, seed)
    device = torch.device(device)
    if kind == "gpt":
        model = build_gpt(shape, spec, attention_backend, dtype, device, tp, sequence_parallel, cuda_graph,
                          fused_layer)
        if tp > 1:
            from ..parallel import get_tensor_model_parallel_rank, get_tensor_parallel_layout, shard_state_dict

            state = shard_state_dict(state, get_tensor_parallel_layout(model), get_tensor_model_parallel_rank(), tp)
        model.load_state_dict(state)
    else:
        model = PlainGPT(shape.vocab, shape.seq, shape.layers, shape.hidden, shape.heads, shape.ffn, shape.dropout,
                         device=device, dtype=dtype)
        model.load_state_dict(plain_state_dict_from_gpt(state, shape.heads))
    return model.train()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counted once).

    Source: fusedlib's own.
    """
    return sum(p.numel() for p in model.parameters())
