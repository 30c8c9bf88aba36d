"""Megatron-core-shaped fused ops: ``torch.autograd.Function`` wrappers and entry points.

Each module mirrors the Megatron-core file of the same name under
``megatron/core/fusions/``, backed by fusedlib's Triton kernels.
"""
