"""Embeddings (Megatron-core's ``megatron/core/models/common/embeddings``)."""
