"""Megatron-core's ``megatron/core/utils.py`` helpers that fusedlib needs: viewless tensors.

(Input checks live in :mod:`fusedlib.checks`, launch settings in :mod:`fusedlib.kernels.launch`.)

Source: Megatron-LM ``megatron/core/utils.py``.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["make_viewless_tensor", "KeepParameterAttributes"]


class KeepParameterAttributes:
    """Mixin for a module: ``copy.deepcopy`` keeps the Python attributes of its parameters and of
    its submodules' (torch's own modules inside it included: the unfused spec's norms).

    Tensor parallelism marks parameters with attributes (``sequence_parallel``,
    ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) that
    :func:`~fusedlib.parallel.finalize_model_grads` and the checkpoint helpers read. torch's
    ``Parameter.__deepcopy__`` makes a new Parameter from the data alone, so a deep-copied model
    lost them silently (under sequence parallelism its norms' gradients were then no longer
    summed over the ranks). Megatron-core's modules have the same quirk; fusedlib's keep them
    (:class:`~fusedlib.transformer.MegatronModule`, the fused norms, the parallel layers). A
    torch module copied on its own (a lone ``WrappedTorchNorm``) still loses them.

    Source: fusedlib.
    """

    def __deepcopy__(self, memo: dict) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # what copy.deepcopy does for a module, field by field
            new.__dict__[key] = copy.deepcopy(value, memo)
        for param in self.parameters():  # the attributes torch's Parameter.__deepcopy__ drops
            twin = memo.get(id(param))  # (the copy of a parameter, tied ones once, is in memo)
            if twin is None or twin is param:
                continue
            for attr, value in vars(param).items():
                if attr not in vars(twin):
                    setattr(twin, attr, copy.deepcopy(value, memo))
        return new


def _kernel_make_viewless_tensor(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    # A new tensor object whose .data is inp's storage, shape and strides, with no _base.
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class _MakeViewlessTensor(torch.autograd.Function):
    """Identity in autograd; its output shares ``inp``'s memory but is not a view."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return ``inp``, or a tensor sharing its memory whose ``_base`` is None.

    Megatron's pipeline schedule frees an activation once the next stage has it, with
    ``deallocate_output_tensor(out)``: ``out.data = torch.empty((1,))`` keeps the autograd
    graph but drops the memory. For a *view* that frees nothing (its ``_base`` still
    holds the whole storage), so the schedule asserts ``out._base is None``. Apex's
    persistent LayerNorm returns ``ymat.view(x.shape)``, a view; Megatron wraps it with
    this function. fusedlib's own kernels allocate their outputs in the input's shape and
    never need it.

    Args:
        inp: any tensor.
        requires_grad: for the new tensor.
        keep_graph: True: go through an identity autograd Function, so gradients flow to
            ``inp``'s graph; False: a plain new tensor (no graph).

    Returns:
        ``inp`` itself if it is not a view, else a viewless tensor with the same data.

    Source: Megatron-LM ``megatron/core/utils.py`` (``make_viewless_tensor``).
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return _MakeViewlessTensor.apply(inp, requires_grad)
    return _kernel_make_viewless_tensor(inp, requires_grad)
