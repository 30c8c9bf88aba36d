"""GPT (Megatron-core's ``megatron/core/models/gpt``): layer specs and ``GPTModel``."""
from .gpt_layer_specs import get_gpt_fused_layer_spec, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec  # noqa: F401
from .gpt_model import GPTModel  # noqa: F401

__all__ = ["GPTModel", "get_gpt_layer_local_spec", "get_gpt_fused_layer_spec", "get_gpt_layer_unfused_spec"]
