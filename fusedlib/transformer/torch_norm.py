"""``WrappedTorchNorm``: PyTorch's own ``LayerNorm`` or ``RMSNorm``, as ``config.normalization`` says.

The norm of the all-unfused layer spec (and Megatron-core's local spec where Apex is absent).

Source: Megatron-LM ``megatron/core/transformer/torch_norm.py``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..checks import short_repr, type_name
from ..fusions.fused_layer_norm import _check_eps, _config_flag, _hidden_size
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

    A deep copy of this torch module on its own loses the parameters' ``sequence_parallel``
    (torch's ``Parameter.__deepcopy__`` keeps no attribute); inside a fusedlib module (a layer,
    a block, a GPTModel: :class:`~fusedlib.utils.KeepParameterAttributes`) the copy keeps them.

    Raises:
        ValueError: a config switch torch's norms do not have (layernorm_zero_centered_gamma,
            persist_layer_norm, memory_efficient_layer_norm); Megatron-core asserts.
            config.normalization neither "LayerNorm" nor "RMSNorm" (Megatron-core raises too;
            anything else built a LayerNorm); eps negative, NaN or inf; hidden_size below 1 or a
            shape of more than one dim.
        TypeError: config without the normalization fields (None, a dict); a switch or
            config.sequence_parallel that is not a bool (a str "False" was True); eps or
            hidden_size not a number (a bool neither).

    Source: Megatron-LM ``megatron/core/transformer/torch_norm.py`` (``WrappedTorchNorm``).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm", *,
                device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None
                ) -> torch.nn.Module:
        if not hasattr(config, "normalization"):  # (an AttributeError naming a switch before)
            raise TypeError(f"WrappedTorchNorm: config must be a TransformerConfig (or an object with its "
                            f"normalization fields), got {type_name(config)}")
        for switch in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if _config_flag(config, switch):
                raise ValueError(f"{switch} is not supported by torch's LayerNorm/RMSNorm (WrappedTorchNorm)")
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"WrappedTorchNorm: config.normalization must be 'LayerNorm' or 'RMSNorm', got "
                             f"{short_repr(config.normalization)}")
        _check_eps(eps)  # (a negative eps gave NaN at the forward, a str failed inside torch)
        if isinstance(hidden_size, (tuple, list, torch.Size)) and len(hidden_size) > 1:
            # torch's norms take a shape of several dims (the last ones, normalised together)
            h = torch.Size(_hidden_size(n, kernels=False) for n in hidden_size)
        else:
            h = _hidden_size(hidden_size, kernels=False)
        sequence_parallel = _config_flag(config, "sequence_parallel")
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=h, eps=float(eps), device=device, dtype=dtype)
        for param in norm.parameters():  # as FusedNorm: the gradient all-reduce of sequence parallelism
            param.sequence_parallel = sequence_parallel
        return norm
