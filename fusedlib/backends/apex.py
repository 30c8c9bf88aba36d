"""Optional Apex backend for the norms: NVIDIA Apex's fused LayerNorm / RMSNorm CUDA kernels.

Megatron-core's ``FusedLayerNorm`` runs on Apex: the *persistent* kernel
``apex.contrib.layer_norm.FastLayerNormFN`` (``persist_layer_norm=True``) for the hidden
sizes it was compiled for, else ``apex.normalization.FusedLayerNormAffineFunction``.
fusedlib's ``FusedLayerNorm(..., backend="apex")`` makes the same choice, so the book
and the benchmark can put Apex's kernels next to fusedlib's. Nothing here is imported at
``import fusedlib`` time: Apex is probed on first use.

Apex is not on PyPI (PyPI's ``apex`` is an unrelated project). Get it from conda-forge
(``nvidia-apex``) or build it from source with its CUDA extensions; see
:data:`APEX_INSTALL_HINT`. Where it is missing, :func:`require` raises
:class:`ApexNotAvailableError` with that hint, and the tests skip with it.

Source: Megatron-LM ``megatron/core/fusions/fused_layer_norm.py``; Apex
``apex/contrib/layer_norm/layer_norm.py``, ``apex/normalization/fused_layer_norm.py``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Optional

import torch

from ..utils import make_viewless_tensor

__all__ = [
    "PERSIST_LN_HIDDEN_SIZES",
    "APEX_INSTALL_HINT",
    "ApexNotAvailableError",
    "apex_status",
    "apex_available",
    "require",
    "apex_layer_norm",
    "apex_rms_norm",
]

#: Hidden sizes Apex's persistent LayerNorm kernel is compiled for (one C++ template
#: instance per size, chosen at build time); Megatron-core falls back to the
#: non-persistent kernel for any other size. Copied from Megatron-core's
#: ``FusedLayerNorm.__init__``.
PERSIST_LN_HIDDEN_SIZES: tuple[int, ...] = (
    1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288,
    12800, 15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536,
)

#: How to get Apex: the message every "Apex is missing" error and skip carries.
APEX_INSTALL_HINT: str = (
    "NVIDIA Apex is not installed with its CUDA extensions. It is not on PyPI (`pip install apex` "
    "installs an unrelated project). Install it from conda-forge: `conda install -c conda-forge "
    "nvidia-apex`, or build it from source against your torch and CUDA: `git clone "
    "https://github.com/NVIDIA/apex && cd apex && pip install -v --no-build-isolation "
    "--config-settings '--build-option=--cpp_ext' --config-settings '--build-option=--cuda_ext' "
    "--config-settings '--build-option=--fast_layer_norm' .` (--fast_layer_norm builds the "
    "persistent FastLayerNorm). Or use backend='fusedlib', which needs none of this."
)

# What the backend uses: name -> (module, attribute, compiled extension it loads lazily).
_PARTS: dict[str, tuple[str, str, Optional[str]]] = {
    "FastLayerNormFN": ("apex.contrib.layer_norm.layer_norm", "FastLayerNormFN", None),
    "FusedLayerNormAffineFunction": ("apex.normalization.fused_layer_norm", "FusedLayerNormAffineFunction",
                                     "fused_layer_norm_cuda"),
    "FusedRMSNormAffineFunction": ("apex.normalization.fused_layer_norm", "FusedRMSNormAffineFunction",
                                   "fused_layer_norm_cuda"),
}


class ApexNotAvailableError(ImportError):
    """Apex (or the part of it a call needs) does not import here; the message says how
    to get it.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """


@functools.lru_cache(maxsize=None)
def apex_status() -> dict[str, str]:
    """Which Apex kernels import in this process.

    Returns:
        ``{name: ""}`` for each of ``FastLayerNormFN``, ``FusedLayerNormAffineFunction``,
        ``FusedRMSNormAffineFunction`` that imports (its CUDA extension included), else
        ``{name: why}``. Probed once per process.
    """
    status = {}
    for name, (module, attr, extension) in _PARTS.items():
        try:
            getattr(importlib.import_module(module), attr)
            if extension is not None:
                importlib.import_module(extension)  # Apex imports its extension only at first call
            status[name] = ""
        except Exception as exc:  # ImportError, or an extension built for another torch
            status[name] = f"{type(exc).__name__}: {exc}"
    return status


def apex_available(name: Optional[str] = None) -> bool:
    """True if Apex's kernel ``name`` imports (default: any of them).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    status = apex_status()
    if name is not None:
        return status[name] == ""
    return "" in status.values()


def require(name: str):
    """The Apex object ``name`` (see :func:`apex_status`).

    Raises:
        ApexNotAvailableError: naming what failed to import and how to get Apex.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    why = apex_status()[name]
    if why:
        raise ApexNotAvailableError(f"backend='apex' needs Apex's {name}, which does not import ({why}). "
                                    + APEX_INSTALL_HINT)
    module, attr, _ = _PARTS[name]
    return getattr(importlib.import_module(module), attr)


def _takes_memory_efficient(fn_class) -> bool:
    # Older Apex releases have no memory_efficient argument; Megatron-core checks the same way.
    return "memory_efficient" in inspect.getfullargspec(fn_class.forward).args


def apex_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
                    persist: bool, memory_efficient: bool = False) -> torch.Tensor:
    """LayerNorm through Apex, chosen as Megatron-core's ``FusedLayerNorm.forward`` chooses.

    Args:
        x: [..., h], CUDA, float32/float16/bfloat16.
        weight: [h] gamma (already ``weight + 1`` for a zero-centered weight).
        bias: [h].
        eps: added to the variance.
        persist: use the persistent ``FastLayerNormFN`` if h is in
            :data:`PERSIST_LN_HIDDEN_SIZES` and it imports; otherwise, or if not,
            ``FusedLayerNormAffineFunction``.
        memory_efficient: passed on where the Apex build takes it.

    Returns:
        y, [..., h], never a view (``make_viewless_tensor`` where Apex returns one).

    Raises:
        ApexNotAvailableError: if the Apex kernel needed does not import.

    Source: Megatron-LM ``megatron/core/fusions/fused_layer_norm.py`` (``FusedLayerNorm.forward``);
    Apex ``apex/contrib/layer_norm/layer_norm.py`` (``FastLayerNormFN``),
    ``apex/normalization/fused_layer_norm.py``.
    """
    h = x.shape[-1]
    if persist and h in PERSIST_LN_HIDDEN_SIZES and apex_available("FastLayerNormFN"):
        fn = require("FastLayerNormFN")
        args = (x, weight, bias, eps) + ((memory_efficient,) if _takes_memory_efficient(fn) else ())
        # Apex returns ymat.view(x.shape): a view, which deallocate_output_tensor refuses.
        return make_viewless_tensor(fn.apply(*args), requires_grad=x.requires_grad, keep_graph=True)
    fn = require("FusedLayerNormAffineFunction")
    args = (x, weight, bias, (h,), eps) + ((memory_efficient,) if _takes_memory_efficient(fn) else ())
    return fn.apply(*args)


def apex_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                  memory_efficient: bool = False) -> torch.Tensor:
    """RMSNorm through Apex's ``FusedRMSNormAffineFunction`` (Apex has no persistent RMSNorm).

    Args:
        x: [..., h], CUDA. weight: [h] gamma. eps: added to the mean square.
        memory_efficient: passed on where the Apex build takes it.

    Returns:
        y, [..., h].

    Raises:
        ApexNotAvailableError: if it does not import.

    Source: Apex ``apex/normalization/fused_layer_norm.py`` (``FusedRMSNormAffineFunction``).
    """
    fn = require("FusedRMSNormAffineFunction")
    args = (x, weight, (x.shape[-1],), eps) + ((memory_efficient,) if _takes_memory_efficient(fn) else ())
    return fn.apply(*args)
