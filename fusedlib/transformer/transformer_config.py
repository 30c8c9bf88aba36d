"""``TransformerConfig``: the switches fusedlib's fused modules read, Megatron-core's names.

A small subset of Megatron-core's ``TransformerConfig`` (which has a few hundred fields):
only the fields fusedlib's modules use so far, with Megatron's names, defaults and
meanings, so a Megatron user reads the same switches. Add fields here as modules need
them; keep Megatron's name and default for each.

Source: Megatron-LM ``megatron/core/transformer/transformer_config.py`` and
``megatron/core/model_parallel_config.py`` (``sequence_parallel``).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransformerConfig", "NORMALIZATIONS"]

#: Values ``TransformerConfig.normalization`` may take (Megatron-core's spelling).
NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")


@dataclass
class TransformerConfig:
    """Configuration of a Transformer, as read by fusedlib's modules.

    Attributes:
        normalization: which norm the normalization layers use, ``"LayerNorm"`` or
            ``"RMSNorm"`` (Megatron default ``"LayerNorm"``).
        layernorm_epsilon: epsilon added to the variance (RMSNorm: to the mean square) in
            every norm (Megatron default 1e-5).
        layernorm_zero_centered_gamma: store the norm's weight centered around 0 and use
            ``gamma = weight + 1``, so weight decay pulls gamma towards 1 and a bf16 weight
            keeps its precision near gamma = 1 (Megatron default False).
        persist_layer_norm: use Apex's persistent fused LayerNorm kernel, which exists for
            a fixed list of hidden sizes only (Megatron default False). fusedlib's own
            kernel keeps the row in registers for every hidden size 1..65536, so with
            ``backend="fusedlib"`` this switch changes nothing.
        memory_efficient_layer_norm: the norm saves its output instead of its input for the
            backward and recomputes ``x_hat = (y - beta) / gamma`` (Megatron default
            False; in Megatron it is passed to Apex).
        sequence_parallel: activations outside tensor-parallel regions (norms, dropout) are
            split along the sequence dim across the tensor-parallel group; the norms'
            weight and bias then get partial gradients on each rank, and are marked with
            a ``sequence_parallel`` attribute so that their gradients are all-reduced
            (Megatron default False; Korthikanti et al. 2022, arXiv:2205.05198).

    Raises:
        ValueError: for a ``normalization`` other than ``"LayerNorm"`` / ``"RMSNorm"``,
            or a negative ``layernorm_epsilon``.

    Source: Megatron-LM ``megatron/core/transformer/transformer_config.py``.
    """

    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {', '.join(map(repr, NORMALIZATIONS))}, got {self.normalization!r}"
            )
        if not self.layernorm_epsilon >= 0:
            raise ValueError(f"layernorm_epsilon must be >= 0, got {self.layernorm_epsilon}")
