"""Megatron-core's ``megatron/core/models``: :mod:`fusedlib.models.gpt` (layer specs, ``GPTModel``)
and :mod:`fusedlib.models.common` (embeddings)."""
