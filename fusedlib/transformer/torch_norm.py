"""``WrappedTorchNorm``: PyTorch's own ``LayerNorm`` or ``RMSNorm``, as ``config.normalization`` says.

The norm of the all-unfused layer spec (and Megatron-core's local spec where Apex is absent).

Source: Megatron-LM ``megatron/core/transformer/torch_norm.py``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .transformer_config import TransformerConfig

__all__ = ["WrappedTorchNorm"]


class WrappedTorchNorm:
    """Build ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` over the last dim, from a config.

    ``WrappedTorchNorm(config, hidden_size, eps=1e-5, persist_layer_norm=False,
    zero_centered_gamma=False, normalization="LayerNorm", *, device=None, dtype=None)`` returns the
    torch module (parameters ``weight`` and, for LayerNorm, ``bias``); the middle three arguments
    are ignored, as in Megatron-core (the config decides). ``device``/``dtype``: torch's factory
    arguments (None: torch's defaults), beyond Megatron-core's signature.

    The parameters carry ``sequence_parallel`` (config.sequence_parallel), as fusedlib's fused
    norms' do, so that :func:`fusedlib.parallel.finalize_model_grads` sums their gradients under
    sequence parallelism: a norm is per token, so it runs on a sequence shard unchanged.
    Megatron-core rejects sequence_parallel here.

    Raises:
        ValueError: a config switch torch's norms do not have (layernorm_zero_centered_gamma,
            persist_layer_norm, memory_efficient_layer_norm); Megatron-core asserts.

    Source: Megatron-LM ``megatron/core/transformer/torch_norm.py`` (``WrappedTorchNorm``).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm", *,
                device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None
                ) -> torch.nn.Module:
        for switch in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, switch):
                raise ValueError(f"{switch} is not supported by torch's LayerNorm/RMSNorm (WrappedTorchNorm)")
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps, device=device, dtype=dtype)
        for param in norm.parameters():  # as FusedNorm: the gradient all-reduce of sequence parallelism
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
