"""Rotary position embeddings: Megatron-core's ``RotaryEmbedding``, the angles RoPE rotates by.

``RotaryEmbedding(kv_channels, rotary_percent)`` holds the inverse frequencies
``inv_freq[i] = 1 / base^(2i / dim)`` for ``i = 0 .. dim/2 - 1`` (``dim = kv_channels ·
rotary_percent``), and ``forward(max_seq_len, offset=0)`` returns the angles
``freqs[p, i] = (p + offset) · inv_freq[i]`` for every position, each stored twice (the
two channels of a pair), in Megatron's layout [s, 1, 1, dim] float32. The angles are applied
by :func:`fusedlib.models.common.embeddings.rope_utils.apply_rotary_pos_emb`.

Source: Megatron-LM ``megatron/core/models/common/embeddings/rotary_pos_embedding.py``;
Su et al., "RoFormer", arXiv:2104.09864; Chen et al., "Extending Context Window of Large
Language Models via Positional Interpolation", arXiv:2306.15595
(``seq_len_interpolation_factor``); Llama 3.1's frequency scaling (``rope_scaling``).
"""
from __future__ import annotations

import math
import numbers
import operator
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ....checks import check_bools, real_to_float, short_repr, type_name
from ....runtime import default_device
from .rope_utils import _apply_rotary_pos_emb_bshd, _rotate_half, apply_rotary_pos_emb  # noqa: F401 (Megatron re-exports them)

__all__ = ["RotaryEmbedding"]

#: Entries of :meth:`RotaryEmbedding.forward`'s cache (Megatron: ``lru_cache(maxsize=32)``).
FORWARD_CACHE_SIZE = 32


def _real(name: str, value: object, expected: str) -> float:
    """``float(value)`` for a real number (not a bool), else a TypeError naming the argument (an
    int beyond a float's range: a ValueError, :func:`~fusedlib.checks.real_to_float`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number {expected}, got {type_name(value)} {short_repr(value)}")
    return real_to_float(name, value, f"a number {expected}")


def _finite_positive(name: str, value: object, alternative: str = "") -> float:
    """A real number > 0 and finite, as a float; else a TypeError or ValueError naming it."""
    v = _real(name, value, f"> 0{alternative}")
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0{alternative}, got {value!r}")
    return v


class RotaryEmbedding(nn.Module):
    """Rotary embedding angles for a language model, Megatron-core's ``RotaryEmbedding``.

    Args:
        kv_channels: channels per attention head (``TransformerConfig.kv_channels``).
        rotary_percent: fraction of the channels rotated, in (0, 1]; below 1 the rotary
            dim is ``int(kv_channels * rotary_percent)``.
        rotary_interleaved: the angles' layout: ``[f0, f0, f1, f1, ...]`` (pairs (2k, 2k+1))
            if True, else ``[f0, f1, ..., f0, f1, ...]`` (pairs (k, k + dim/2)). Default False.
        seq_len_interpolation_factor: positions are divided by it (linear position
            interpolation for longer sequences; Megatron: a float > 1). Default None.
        rotary_base: the base of the inverse frequencies (default 10000).
        rope_scaling: apply Llama 3.x's frequency scaling (default False).
        rope_scaling_factor: its factor (default 8.0).
        use_cpu_initialization: create ``inv_freq`` on the CPU (default False: on ``device``).
        cp_group: context-parallel group; groups of more than one rank are not supported.
        device: where ``inv_freq`` (and so the angles) live when ``use_cpu_initialization``
            is False (default: CUDA when present, else the CPU; Megatron: the current CUDA
            device). ``module.to(device)`` moves it.

    ``inv_freq`` [dim/2] float32 is a plain attribute, not a parameter or buffer, as in
    Megatron: it is not in the state dict, and ``module.bfloat16()`` does not round it (a
    bf16 ``inv_freq`` would make the angles of far positions wrong by whole radians); it
    follows the module's device.

    Raises:
        TypeError: kv_channels not an int (a bool neither); rotary_percent,
            seq_len_interpolation_factor, rotary_base or rope_scaling_factor not a number;
            rotary_interleaved, rope_scaling or use_cpu_initialization not a bool.
        ValueError: kv_channels < 1, rotary_percent not in (0, 1], a rotary dim that rounds
            to 0, or an odd one at rotary_percent 1 (its pairs need kv_channels + 1 channels), a
            seq_len_interpolation_factor, rotary_base or (with rope_scaling)
            rope_scaling_factor that is not a finite number > 0.
        NotImplementedError: a cp_group of more than one rank.

    Source: Megatron-LM ``megatron/core/models/common/embeddings/rotary_pos_embedding.py``.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: Optional[Any] = None,
        *,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if isinstance(kv_channels, bool) or not isinstance(kv_channels, numbers.Integral):
            raise TypeError(f"kv_channels must be an int >= 1, got {type_name(kv_channels)} {short_repr(kv_channels)}")
        if kv_channels < 1:
            raise ValueError(f"kv_channels must be an int >= 1, got {kv_channels!r}")
        kv_channels = int(kv_channels)
        rotary_interleaved, rope_scaling, use_cpu_initialization = check_bools(  # (a str "False" was True)
            "RotaryEmbedding", rotary_interleaved=rotary_interleaved, rope_scaling=rope_scaling,
            use_cpu_initialization=use_cpu_initialization)
        if not 0.0 < _real("rotary_percent", rotary_percent, "in (0, 1]") <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent!r}")
        if seq_len_interpolation_factor is not None:
            _finite_positive("seq_len_interpolation_factor", seq_len_interpolation_factor, " (or None)")
        _finite_positive("rotary_base", rotary_base)
        if rope_scaling:  # a factor of 0, NaN or inf made the angles inf or NaN, so the logits NaN
            _finite_positive("rope_scaling_factor", rope_scaling_factor)
        _check_cp_group(cp_group)
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim < 1:
            raise ValueError(
                f"kv_channels * rotary_percent = {kv_channels} * {rotary_percent} rounds to {dim} rotary channels"
            )
        if dim + dim % 2 > kv_channels:
            # RoPE rotates pairs: an odd dim gets (dim + 1) / 2 frequencies, so dim + 1 angles (as in
            # Megatron-core), which fit a head below rotary_percent 1 but not all of an odd head,
            # refused then only at the first forward, by the op, naming its freqs and t
            raise ValueError(
                f"RoPE rotates pairs of channels: kv_channels = {kv_channels} with rotary_percent = "
                f"{rotary_percent} gives {dim} rotary channels, whose {(dim + 1) // 2} pairs need {dim + 1} > "
                f"{kv_channels} channels (an even kv_channels, or rotary_percent < 1)"
            )
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        device = torch.device("cpu") if use_cpu_initialization else torch.device(device or default_device())
        # inv_freq[i] = 1 / base^(2i / dim): float32, computed as Megatron computes it
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            self.inv_freq = self._apply_scaling(self.inv_freq, factor=rope_scaling_factor)
        self.cp_group = cp_group
        self._cache: OrderedDict[tuple, Tensor] = OrderedDict()

    def _apply_scaling(self, freqs: Tensor, factor: float = 8, low_freq_factor: float = 1,
                       high_freq_factor: float = 4, original_max_position_embeddings: int = 8192) -> Tensor:
        """Llama 3.x's scaling of the inverse frequencies: wavelengths longer than
        ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
        shorter than ``.../ high_freq_factor`` kept, and those between interpolated.

        Source: Megatron-LM ``rotary_pos_embedding.py`` (``_apply_scaling``), adapted there from
        Hugging Face transformers ``modeling_rope_utils.py`` (``_compute_llama3_parameters``).
        """
        old_context_len = original_max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / freqs
        # wavelen < high_freq_wavelen: do nothing; wavelen > low_freq_wavelen: divide by factor
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
        # otherwise: interpolate between the two, using a smooth factor
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """The angles ``(p + offset) · inv_freq[i]`` (positions divided by
        ``seq_len_interpolation_factor`` if set): [max_seq_len, dim/2] float32."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq *= 1 / self.seq_len_interpolation_factor
        return torch.outer(seq, self.inv_freq)  # [seq len, dim/2]

    def get_cos_sin(self, max_seq_len: int, offset: int = 0) -> tuple[Tensor, Tensor]:
        """cos and sin of :meth:`get_freqs_non_repeated`: two [max_seq_len, dim/2] float32 tensors."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cos(freqs), torch.sin(freqs)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """The angles of every channel, [max_seq_len, 1, 1, dim] float32: ``[f | f]``
        (half-split) or ``[f0, f0, f1, f1, ...]`` (interleaved)."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            # [s, dim/2] -> [s·dim/2, 1] twice -> [s·dim/2, 1, 2] -> [s, dim]
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], 2 * freqs.shape[1])
        return emb[:, None, None, :]  # [s, dim] -> [s, 1, 1, dim]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[Any] = None) -> Tensor:
        """The rotary angles for positions ``offset .. offset + max_seq_len - 1``.

        Args:
            max_seq_len: number of positions (>= 0).
            offset: first position (default 0).
            packed_seq: accepted for Megatron's signature (only matters with context parallelism).
            cp_group: context-parallel group; more than one rank is not supported.

        Returns:
            freqs [max_seq_len, 1, 1, dim], float32, on ``inv_freq``'s device. Cached per
            (max_seq_len, offset), as Megatron's ``lru_cache``: the same tensor each call,
            which callers must not modify (angles made under ``torch.inference_mode`` are
            cached apart: they are inference tensors, which autograd cannot save).

        Raises:
            NotImplementedError: a cp_group of more than one rank.
            TypeError: max_seq_len not an int (numpy's and a 0-d integer tensor's too), or
                offset not a real number.
            ValueError: max_seq_len < 0, or offset not finite.
        """
        _check_cp_group(cp_group)
        max_seq_len, offset = _check_positions(max_seq_len, offset)
        # the key holds the values the angles are computed from (int(offset) keyed an offset of
        # 0.5 as 0: the next call with offset 0 got the 0.5 angles), and whether inference mode
        # is on: angles made under torch.inference_mode are inference tensors, which a later
        # training call could not save for its backward (the fused RoPE's raised there)
        key = (max_seq_len, offset, self.inv_freq.device, torch.is_inference_mode_enabled())
        emb = self._cache.get(key)
        if emb is None:
            emb = self.get_emb(max_seq_len, offset)
            self._cache[key] = emb
            if len(self._cache) > FORWARD_CACHE_SIZE:
                self._cache.popitem(last=False)  # the least recently used
        else:
            self._cache.move_to_end(key)  # a hit makes it the most recently used, as lru_cache
        return emb

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() / .cpu(): move inv_freq with the module; casts (.half(),
        # .bfloat16(), .to(dtype)) leave it float32, as Megatron's plain attribute is left
        module = super()._apply(fn, *args, **kwargs)
        device = fn(self.inv_freq).device
        if device != self.inv_freq.device:
            self.inv_freq = self.inv_freq.to(device=device)
            self._cache.clear()
        return module

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints from versions that saved inv_freq: it is recomputed, never loaded
        state_dict.pop(f"{prefix}inv_freq", None)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_rotary_seq_len(self, inference_context: Any, transformer: Any, transformer_input: Tensor,
                           transformer_config: Any, packed_seq_params: Any = None) -> int:
        """The number of positions the model needs angles for.

        Args:
            inference_context: an inference context with ``max_sequence_length``, or None.
            transformer: the TransformerBlock (its ``input_tensor``, if set, is used) or None.
            transformer_input: the block's input [s, b, h].
            transformer_config: read for ``sequence_parallel``, ``tensor_model_parallel_size``
                and ``context_parallel_size`` (defaults False, 1, 1 when absent).
            packed_seq_params: with ``max_seqlen_q`` and ``max_seqlen_kv``, or None.

        Returns:
            The rotary sequence length (an int).

        Source: Megatron-LM ``rotary_pos_embedding.py`` (``RotaryEmbedding.get_rotary_seq_len``).
        """
        if packed_seq_params is not None:
            return max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)
        if inference_context is not None:
            rotary_seq_len = inference_context.max_sequence_length
        else:
            if transformer is not None and getattr(transformer, "input_tensor", None) is not None:
                rotary_seq_len = transformer.input_tensor.size(0)
            else:
                rotary_seq_len = transformer_input.size(0)
            if getattr(transformer_config, "sequence_parallel", False):
                rotary_seq_len *= getattr(transformer_config, "tensor_model_parallel_size", 1)
        rotary_seq_len *= getattr(transformer_config, "context_parallel_size", 1)
        return rotary_seq_len


def _check_positions(max_seq_len: Any, offset: Any) -> tuple[int, int | float]:
    """:meth:`RotaryEmbedding.forward`'s positions as the cache keys them: max_seq_len an int
    >= 0 (anything ``operator.index`` takes: numpy's ints, a 0-d integer tensor), offset an int
    likewise, or a finite real number (a float offset shifts every position by it).

    Raises:
        TypeError: max_seq_len not an int (a float, whose ``torch.arange`` has another length
            than its ``int``), offset not a real number (bools refused for both).
        ValueError: max_seq_len < 0, offset not finite.
    """
    if isinstance(max_seq_len, bool):
        raise TypeError("max_seq_len must be an int (the number of positions), got bool")
    try:
        n = operator.index(max_seq_len)
    except TypeError:
        raise TypeError(f"max_seq_len must be an int (the number of positions), got "
                        f"{type(max_seq_len).__name__} {max_seq_len!r}") from None
    if n < 0:
        raise ValueError(f"max_seq_len must be >= 0 (the number of positions), got {n}")
    if isinstance(offset, bool):
        raise TypeError("offset must be an int (the first position), got bool")
    try:
        return n, operator.index(offset)
    except TypeError:
        pass
    if not isinstance(offset, numbers.Real):
        raise TypeError(f"offset must be an int (the first position) or a real number, got {type(offset).__name__}")
    o = float(offset)
    if not math.isfinite(o):
        raise ValueError(f"offset must be finite, got {offset!r}")
    return n, o


def _check_cp_group(cp_group: Any) -> None:
    if cp_group is not None and cp_group.size() > 1:
        raise NotImplementedError(
            f"context parallelism (a cp_group of {cp_group.size()} ranks) is not supported by fusedlib's "
            "RotaryEmbedding: pass cp_group=None"
        )
