"""Benchmark cases, one module per op (file names as the records': ``<op>.json``).

Each module defines ``cases(device, sweep=False) -> list[BenchCase]``: the headline case
at the default shape first, then (with ``sweep``) the same op at other shapes; and
``case(shape, dtype=torch.bfloat16) -> BenchCase``: the op at any shape with every
baseline (``--host`` uses it at tiny shapes). A module may also define ``table(records) ->
str`` and ``extra_files(device, out_dir, log) -> list[Path]``, which ``python -m fusedlib.bench``
prints and writes after the op's records (:mod:`fusedlib.bench.__main__`).
"""
from __future__ import annotations

import importlib
from typing import Callable

from ..core import BenchCase

#: op name -> module under fusedlib.bench.ops
OP_MODULES: dict[str, str] = {
    "bias_gelu": "bias_gelu",
    "fused_dense": "fused_dense",
    "cross_entropy": "cross_entropy",
    "bias_dropout_add": "bias_dropout_add",
    "geglu": "geglu", "swiglu": "swiglu", "weighted_swiglu": "weighted_swiglu",
    "causal_softmax": "causal_softmax",
    "masked_softmax": "masked_softmax",
    "softmax_one": "softmax_one",
    "softmax_dropout": "softmax_dropout",
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
    "bias_dropout_add_norm": "bias_dropout_add_norm",
    "rope": "rope",
    "attention": "attention",
    "transformer_layer": "transformer_layer",
}


def get_op_module(op: str):
    """The module of op ``op`` (under ``fusedlib.bench.ops``).

    Raises:
        KeyError: naming the known ops, for an unknown one.
    """
    if op not in OP_MODULES:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(OP_MODULES)}")
    return importlib.import_module(f"{__name__}.{OP_MODULES[op]}")


def get_cases(op: str) -> Callable[..., list[BenchCase]]:
    """The ``cases`` function of op ``op``.

    Raises:
        KeyError: naming the known ops, for an unknown one.
    """
    return get_op_module(op).cases


def get_case(op: str) -> Callable[..., BenchCase]:
    """The ``case(shape, dtype=torch.bfloat16)`` function of op ``op``.

    Raises:
        KeyError: naming the known ops, for an unknown one.
    """
    return get_op_module(op).case
