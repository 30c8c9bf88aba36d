"""``MegatronModule`` (a module that holds its config) and ``Float16Module`` (half precision at the edges).

A checkpoint is the plain ``state_dict``: parameter names follow Megatron-core's modules
(``self_attention.linear_qkv.weight``, ...), so a Megatron-core local-spec state dict loads
into the matching fusedlib model and back (the linear layers carry Megatron's empty
``_extra_state`` entries for that).

Left out: sharded (distributed) checkpoints, pipeline stages (``set_input_tensor``), CUDA graphs.

Source: Megatron-LM ``megatron/core/transformer/module.py``.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from ..utils import KeepParameterAttributes
from .transformer_config import TransformerConfig

__all__ = ["MegatronModule", "Float16Module", "fp32_to_float16", "float16_to_fp32"]


class MegatronModule(KeepParameterAttributes, torch.nn.Module):
    """A ``torch.nn.Module`` that keeps the ``TransformerConfig`` it was built from as ``self.config``.

    Raises:
        TypeError: config neither a :class:`TransformerConfig` nor an object with its fields (None,
            a dict of them...).

    Source: Megatron-LM ``megatron/core/transformer/module.py`` (``MegatronModule``).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        # (else an AttributeError about the first field read; an object with the config's fields
        # serves, as in Megatron-core, which reads them by name)
        if isinstance(config, Mapping) or not hasattr(config, "hidden_size"):
            raise TypeError(f"{type(self).__name__}: config must be a TransformerConfig, got {type(config).__name__} "
                            f"(an object with its fields serves too)")
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The state dict to save: ``self.state_dict(prefix=prefix, keep_vars=keep_vars)``.

        Load it back with ``load_state_dict``. Subclasses override this where the saved
        state differs from the live one (Megatron-core's models do, for tied weights).
        """
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


def _convert(val: Any, conversion) -> Any:
    """Apply ``conversion`` to ``val``, or to each element of a (nested) tuple or list. A container
    whose elements all come back as they were is returned itself (a torch.Size stays one); a
    named tuple stays a named tuple of its type (it became a plain tuple: ``out.logits`` failed)."""
    if isinstance(val, (tuple, list)):
        out = [_convert(v, conversion) for v in val]
        if all(o is v for o, v in zip(out, val)):
            return val
        if isinstance(val, tuple):
            return type(val)(*out) if hasattr(type(val), "_fields") else tuple(out)
        return out
    return conversion(val)


def _drop_module_prefix(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state-dict hook: ``<prefix>module.<name>`` -> ``<prefix><name>``, in place, order kept."""
    inner = prefix + "module."
    if any(k.startswith(inner) for k in state_dict):
        items = list(state_dict.items())
        state_dict.clear()
        for k, v in items:
            state_dict[prefix + k[len(inner):] if k.startswith(inner) else k] = v


def _add_module_prefix(state_dict: dict, prefix: str, *args: Any) -> None:
    """A load pre-hook: ``<prefix><name>`` -> ``<prefix>module.<name>`` (keys already under
    ``module.`` are left); torch passes a copy of the caller's dict."""
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


def fp32_to_float16(val: Any, float16_convertor) -> Any:
    """Cast each float32 tensor in ``val`` (a tensor, or a nested tuple/list) with ``float16_convertor``;
    leave everything else (ids, masks, other dtypes, non-tensors) as it is.

    Source: Megatron-LM ``megatron/core/transformer/module.py`` (``fp32_to_float16``).
    """
    return _convert(val, lambda v: float16_convertor(v)
                    if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v)


def float16_to_fp32(val: Any) -> Any:
    """Cast each fp16/bf16 tensor in ``val`` to float32; leave everything else as it is.

    Source: Megatron-LM ``megatron/core/transformer/module.py`` (``float16_to_fp32``).
    """
    return _convert(val, lambda v: v.float()
                    if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v)


class Float16Module(MegatronModule):
    """Run ``module`` in fp16 or bf16 with fp32 at the edges.

    The wrapped module is cast once, at construction (``module.half()`` / ``module.bfloat16()``:
    parameters and buffers). Each forward casts the float32 tensors among the *positional*
    inputs to that dtype (keyword arguments pass as they are, as in Megatron-core), runs the
    module, and casts fp16/bf16 tensors among the outputs back to float32 (unless
    ``fp32_output=False``). Integer inputs (token ids) and bool masks are never cast.

    Args:
        config: ``config.fp16`` or ``config.bf16`` must be True.
        module: the model.

    Raises:
        ValueError: neither config.fp16 nor config.bf16 is set.
        TypeError: module not a torch.nn.Module.

    ``state_dict``/``load_state_dict`` use the wrapped module's names (no ``module.`` prefix),
    also when the Float16Module is itself inside another module.

    Source: Megatron-LM ``megatron/core/transformer/module.py`` (``Float16Module``).
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module) -> None:
        super().__init__(config)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Float16Module: module must be a torch.nn.Module, got {type(module).__name__}")
        self.fp16, self.bf16 = config.fp16, config.bf16
        if self.fp16:
            self.add_module("module", module.half())
            self.float16_convertor = operator.methodcaller("half")  # (a lambda could not be pickled)
        elif self.bf16:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = operator.methodcaller("bfloat16")
        else:
            raise ValueError("Float16Module needs config.fp16 or config.bf16 to be True.")
        # the wrapped module's names, without "module.", also where this module sits inside another
        # (overriding state_dict / load_state_dict served a call on this module only: its parent's
        # state dict could not be loaded back, and with strict=False nothing loaded)
        self._register_state_dict_hook(_drop_module_prefix)
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        """``module(*half(inputs), **kwargs)``, with its fp16/bf16 outputs cast to float32 if ``fp32_output``."""
        inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        return float16_to_fp32(outputs) if fp32_output else outputs

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The wrapped module's state dict to save."""
        save = getattr(self.module, "state_dict_for_save_checkpoint", self.module.state_dict)
        return save(prefix=prefix, keep_vars=keep_vars)
