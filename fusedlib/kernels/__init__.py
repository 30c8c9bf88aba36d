"""Triton kernels and the host functions that launch them, one file per fusion.

No autograd here: each ``*_fwd`` / ``*_bwd`` host function takes tensors, checks
nothing beyond what the kernel needs, launches, and returns new tensors. The
``fusedlib.fusions`` layer checks user input and wires autograd.
"""
