"""Pieces the models share (Megatron-core's ``megatron/core/models/common``)."""
