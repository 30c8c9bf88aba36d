"""Random numbers under tensor parallelism: which dropout masks agree across ranks and which differ.

Two kinds of tensor exist in a tensor-parallel model, and their dropout masks must differ in kind:

* *replicated* tensors (the residual stream without sequence parallelism: every rank holds the
  same [s, b, h]): the hidden and embedding dropout must draw the SAME mask on every rank, or
  the replicas drift apart. They use the default generator, seeded identically on every rank.
* *split* tensors (the attention probabilities, whose heads are spread over the ranks; and with
  sequence parallelism every activation outside the linears, each rank holding s/p of the
  tokens): each rank must draw its OWN mask, or head k on rank 1 would reuse head k's mask on
  rank 0. These draw from a second generator state, the "model-parallel" one, seeded
  ``seed + 2718 + tp_rank``, entered with ``get_cuda_rng_tracker().fork()``.

:class:`CudaRNGStatesTracker` keeps named generator states; ``fork(name)`` swaps one in for the
``with`` block and saves where it got to, so the default stream is untouched by what runs
inside. :func:`model_parallel_cuda_manual_seed` seeds both (Megatron's names; the
tracker also tracks the CPU generator, since fusedlib's dropout runs on CPU tensors too, in
Triton's interpreter). fusedlib's modules fork only when the tensor-parallel size is > 1, so
one rank needs no tracker and runs exactly as before.

Where fusedlib forks: without sequence parallelism, around the core attention
(:class:`~fusedlib.transformer.attention.Attention`: every backend's attention dropout;
Megatron-core forks around the dropout inside ``DotProductAttention``); with sequence
parallelism, the whole transformer block and the embedding dropout (as Megatron-core).

Activation recomputation reruns a forward in the backward; the rerun must draw the masks of
the first run. ``torch.utils.checkpoint`` restores the default generators for that, not the
tracker's states: :func:`checkpoint` does both.

Differences from Megatron-core: the tracker swaps the CPU generator's state as well as the
current CUDA device's (Megatron tracks CUDA only and warns if the CPU state changes inside a
fork); :func:`model_parallel_cuda_manual_seed` seeds the CPU generator too; no CUDA-graph-safe
generators, no expert-parallel or inference trackers; Megatron's reentrant ``checkpoint``
(``distribute_saved_activations``) is replaced by torch's non-reentrant one.

Source: Megatron-LM ``megatron/core/tensor_parallel/random.py``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

__all__ = [
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "get_data_parallel_rng_tracker_name",
    "checkpoint",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

#: A generator state: (CPU state, current CUDA device's state or None without CUDA).
State = tuple[torch.Tensor, Optional[torch.Tensor]]


def get_data_parallel_rng_tracker_name() -> str:
    """The name of the data-parallel state (seeded with the plain seed).

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py``
    (``get_data_parallel_rng_tracker_name``).
    """
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def _cuda() -> bool:
    return torch.cuda.is_available()


def _get_state() -> State:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda() else None)


def _set_state(state: State) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and _cuda():
        torch.cuda.set_rng_state(cuda)


def _seeded_state(seed: int) -> State:
    """The state the default generators would have after ``torch.manual_seed(seed)``, made on
    fresh generators (the default ones are not touched)."""
    cpu = torch.Generator(device="cpu")
    cpu.manual_seed(seed)
    cuda = None
    if _cuda():
        g = torch.Generator(device=torch.device("cuda", torch.cuda.current_device()))
        g.manual_seed(seed)
        cuda = g.get_state()
    return cpu.get_state(), cuda


class CudaRNGStatesTracker:
    """Named generator states, entered with :meth:`fork`.

    ``add(name, seed)`` creates a state; ``fork(name)`` makes it the default generators' state
    inside a ``with`` block (CPU and current CUDA device), saves it back on exit and restores
    what was there before; ``get_states``/``set_states`` snapshot and restore all of them (for
    recomputation and checkpoints). Forks nest.

    Raises (from the methods): ValueError for a seed or name added twice; KeyError for a fork of
    a name never added (call :func:`model_parallel_cuda_manual_seed` first).

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``CudaRNGStatesTracker``).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every state."""
        self._is_initialized = False
        self.states_: dict[str, State] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def is_initialized(self) -> bool:
        """Whether any state was added (or set)."""
        return self._is_initialized

    def get_states(self) -> dict[str, State]:
        """A copy of the name -> state map (the states themselves are never modified in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, State]) -> None:
        """Replace the map (from :meth:`get_states`)."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state, the default generators' state after ``torch.manual_seed(seed)``.

        Raises:
            ValueError: ``seed`` or ``name`` already added.
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the ``with`` block on the generator state ``name``, then restore the previous one.

        Raises:
            KeyError: ``name`` was never added.
        """
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not added: call "
                           "fusedlib.parallel.model_parallel_cuda_manual_seed(seed) after initialize_model_parallel")
        orig_state = _get_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        _set_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            _set_state(orig_state)
            self._current_state_name = orig_name


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker.

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``get_cuda_rng_tracker``).
    """
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Seed the default generators with ``seed`` (the same on every tensor-parallel rank) and
    the tracker's model-parallel state with ``seed + 2718 + tp_rank`` (its own on each rank).

    Call it on every rank, after :func:`fusedlib.parallel.initialize_model_parallel`, before
    building the model (the weights are drawn from the default generator, so they agree).

    Args:
        seed: an int >= 0.
        tp_rank: this rank's tensor-parallel rank (None: from :mod:`parallel_state`, 0 when
            model parallelism is not initialized).

    Raises:
        ValueError: ``seed`` not an int in [0, 2^63 - 2718 - tp_rank) (torch's seeds are below
            2^63, and the tracker's is seed + 2718 + tp_rank), or ``tp_rank`` not an int >= 0.

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``model_parallel_cuda_manual_seed``;
    2718 is Megatron's offset).
    """
    from . import parallel_state

    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() \
            else 0
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"tp_rank must be an int >= 0 or None, got {tp_rank!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63 - 2718 - tp_rank:
        raise ValueError(f"seed must be an int in [0, 2^63 - 2718 - tp_rank) (the model-parallel seed is "
                         f"seed + 2718 + tp_rank, and torch's seeds are below 2^63), got {seed!r}")
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


def _tracker_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint``: the forward snapshots the tracker's
    states; the recomputation runs on that snapshot and leaves the tracker where it was."""
    tracker = get_cuda_rng_tracker()
    snapshot: dict[str, dict[str, State]] = {}

    @contextlib.contextmanager
    def forward_ctx() -> Iterator[None]:
        snapshot["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_ctx() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(snapshot["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward_ctx(), recompute_ctx()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` whose
    recomputation also replays the tracker's states (so dropout under :meth:`fork` draws the
    masks of the first run). Without tracker states: exactly torch's.

    Args:
        function: the forward to recompute in the backward.
        *args: its arguments.

    Returns:
        What ``function`` returns.

    Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``checkpoint``; here on
    torch's non-reentrant checkpoint).
    """
    if not get_cuda_rng_tracker().is_initialized():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_tracker_context_fn)
