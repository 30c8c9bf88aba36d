"""Helpers of Megatron-core's ``transformer/utils.py``: attention masks, weight inits, placement.

* masks: ``attention_mask_func``, ``get_default_causal_mask``, ``get_sliding_window_causal_mask``
  (the ones :class:`fusedlib.fusions.fused_softmax.FusedScaleMaskSoftmax` builds), and
  ``is_layer_window_attention``;
* inits: ``init_method_normal``, ``scaled_init_method_normal`` (Megatron-core keeps these two in
  ``megatron/core/utils.py``), ``get_linear_layer``;
* placement: ``param_device``, where a module built from a config creates its parameters;
* tensor parallelism: ``heads_per_partition``, the attention heads of each rank.

Two deliberate differences from Megatron-core (chapter 5): ``attention_mask_func`` returns a
new tensor instead of filling the scores in place, and ``get_default_causal_mask(sq, sk)``
also takes sq != sk (aligned bottom-right).

Source: Megatron-LM ``megatron/core/transformer/utils.py`` and ``megatron/core/utils.py``.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import torch

from ..checks import ArgumentTypeError, short_repr, type_name
from ..fusions.fused_softmax import get_default_causal_mask, get_sliding_window_causal_mask
from ..runtime import default_device
from ..unfused import attention_mask_func

if TYPE_CHECKING:  # (an annotation only: transformer_config imports this module's neighbours)
    from .transformer_config import TransformerConfig

__all__ = [
    "attention_mask_func",
    "check_layer_number",
    "get_default_causal_mask",
    "get_sliding_window_causal_mask",
    "is_layer_window_attention",
    "init_method_normal",
    "scaled_init_method_normal",
    "get_linear_layer",
    "param_device",
    "heads_per_partition",
]

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(sigma: float) -> InitMethod:
    """An init method that fills a tensor in place with N(0, sigma²) samples (torch's generator).

    Source: Megatron-LM ``megatron/core/utils.py`` (``init_method_normal``).
    """
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0) -> InitMethod:
    """N(0, (sigma / sqrt(multiplier·num_layers))²): the init of the layers that write into the
    residual stream, so its variance stays O(1) after 2·num_layers residual additions (GPT-2,
    Radford et al. 2019).

    Raises:
        ValueError: num_layers < 1 or multiplier <= 0.

    Source: Megatron-LM ``megatron/core/utils.py`` (``scaled_init_method_normal``).
    """
    if num_layers < 1 or multiplier <= 0:
        raise ValueError(f"scaled_init_method_normal needs num_layers >= 1 and multiplier > 0, "
                         f"got num_layers={num_layers}, multiplier={multiplier}")
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma / math.sqrt(multiplier * num_layers))


def check_layer_number(owner: str, layer_number: object) -> int:
    """``layer_number`` as a Python int, checked: an integer (not a bool) >= 1.

    Layers are numbered from 1 (Megatron-core's ``TransformerBlock`` builds layer i as
    ``layer_number=i + 1``); the number picks a layer's sliding-window setting
    (:func:`is_layer_window_attention`) and the query-key layer scaling's coefficient.

    Raises:
        TypeError: not an integer (a str, a float, a bool), naming ``owner``.
        ValueError: < 1, naming ``owner``.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    if isinstance(layer_number, bool) or not isinstance(layer_number, numbers.Integral):
        raise TypeError(f"{owner}: layer_number must be an int >= 1 (layers are numbered from 1), "
                        f"got {type(layer_number).__name__} {layer_number!r}")
    if layer_number < 1:
        raise ValueError(f"{owner}: layer_number must be an int >= 1 (layers are numbered from 1), "
                         f"got {layer_number}")
    return int(layer_number)


def check_dropout_override(owner: str, name: str, value: object, below_one: bool = False,
                           why: str = "") -> Optional[float]:
    """A module's override of ``config.<name>``: None (the config's), or the probability as a
    Python float, checked as the config checks its field.

    Args:
        owner, name: the module and the argument, for the message.
        value: what was passed.
        below_one: the range is [0, 1) (attention dropout: 1 would zero every context), else [0, 1].
        why: said of the upper bound in the range error.

    Raises:
        ArgumentTypeError: not a real number, a bool included (a TypeError, and the ValueError
            these checks have always raised).
        ValueError: outside the range, NaN included.
    """
    if value is None:
        return None
    interval = "[0, 1)" if below_one else "[0, 1]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{owner}: {name} must be None (config.{name}) or a probability in {interval}, "
                                f"got {type_name(value)} {short_repr(value)}")
    if not (0.0 <= value < 1.0 if below_one else 0.0 <= value <= 1.0):  # NaN fails too
        raise ValueError(f"{owner}: {name} must be None (config.{name}) or a probability in {interval}{why}, got "
                         f"{type_name(value)} {short_repr(value)}")
    return float(value)


def is_layer_window_attention(window_size: Optional[Tuple[int, int]],
                              window_attn_skip_freq: Union[int, List[int], None], layer_number: int) -> bool:
    """Does layer ``layer_number`` (1-based) use the sliding window?

    Yes if a window is set and ``window_attn_skip_freq`` is None; with an int n every n-th layer
    skips it; with a list, the layer's entry (1: window, 0: full attention).

    Raises:
        ValueError: window_attn_skip_freq of another type; a list without an entry for
            ``layer_number`` (1-based).

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``is_layer_window_attention``).
    """
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, list):
        if not 1 <= layer_number <= len(window_attn_skip_freq):
            raise ValueError(f"layer_number {layer_number} has no entry in window_attn_skip_freq (one per layer, "
                             f"{len(window_attn_skip_freq)} entries: layers 1 to {len(window_attn_skip_freq)})")
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"Invalid `window_attn_skip_freq`: {type(window_attn_skip_freq)}, {window_attn_skip_freq}")


def param_device(config) -> torch.device:
    """Where modules built from ``config`` create their parameters: the CPU with
    ``config.use_cpu_initialization``, else fusedlib's default device (CUDA when present, as
    Megatron-core's ``torch.cuda.current_device()``; the CPU otherwise).

    Source: fusedlib's own; Megatron-core places parameters on ``torch.cuda.current_device()``
    unless ``use_cpu_initialization`` (e.g. ``megatron/core/tensor_parallel/layers.py``).
    """
    return torch.device("cpu") if config.use_cpu_initialization else default_device()


def get_linear_layer(rows: int, columns: int, init_method: InitMethod, perform_initialization: bool = True,
                     *, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> torch.nn.Linear:
    """A ``torch.nn.Linear(rows, columns)`` with its weight from ``init_method`` and a zero bias.

    ``device``/``dtype``: torch's factory arguments (None: torch's defaults), beyond Megatron-core's.

    Source: Megatron-LM ``megatron/core/transformer/utils.py`` (``get_linear_layer``).
    """
    layer = torch.nn.Linear(rows, columns, device=device, dtype=dtype)
    if perform_initialization:
        with torch.no_grad():
            init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def heads_per_partition(config: TransformerConfig) -> Tuple[int, int]:
    """``(np / p, ng / p)``: query heads and key/value groups on each of the p =
    ``config.tensor_model_parallel_size`` ranks.

    Raises:
        ValueError: np or ng not divisible by p (Megatron-core also replicates key/value groups
            when ng < p; fusedlib does not); np = 0 (a norms-only config has no heads to split).

    Source: Megatron-LM ``megatron/core/transformer/attention.py`` (``Attention.__init__``).
    """
    p, np_, ng = config.tensor_model_parallel_size, config.num_attention_heads, config.num_query_groups
    if np_ < 1:
        raise ValueError(f"num_attention_heads must be >= 1 to build attention, got {np_} (TransformerConfig's "
                         "default 0 configures only the norms)")
    if np_ % p or ng % p:
        raise ValueError(f"num_attention_heads ({np_}) and num_query_groups ({ng}) must both be divisible by "
                         f"tensor_model_parallel_size ({p}): each rank holds whole heads and whole key/value groups")
    return np_ // p, ng // p
