"""Process groups for tensor parallelism: ``initialize_model_parallel`` and its getters.

With ``W`` processes and tensor-parallel size ``p`` (``W % p == 0``), Megatron-core's order
puts the ``p`` ranks of one tensor-parallel group next to each other (on one node, where the
fast links are):

    tensor-parallel groups:  [0, 1, .., p-1], [p, .., 2p-1], ...     (W / p groups of p ranks)
    data-parallel groups:    [0, p, 2p, ..], [1, p+1, ..], ...       (p groups of W / p ranks)

Each process asks for its own group with :func:`get_tensor_model_parallel_group` and its place
in it with :func:`get_tensor_model_parallel_rank` / ``_world_size``. The layers of
:mod:`fusedlib.parallel.layers` take this group when ``config.tensor_model_parallel_size > 1``.

Starting the processes (two ways, same code after):

* ``torchrun --nproc-per-node 2 script.py``: torchrun sets ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`initialize_model_parallel` then
  initializes ``torch.distributed`` from them (``env://``) when the script has not;
* :func:`spawn` (``torch.multiprocessing``, from a test or a notebook): starts ``W`` processes,
  joins them in one process group, calls :func:`initialize_model_parallel` in each and runs a
  function there.

Backend: NCCL when CUDA is available (one GPU per process, ``LOCAL_RANK`` picks it), gloo
(CPU tensors) otherwise. One process without ``torchrun`` is a valid world of one rank:
``initialize_model_parallel(1)`` then needs no ``torch.distributed`` at all.

Left out: pipeline, context and expert parallelism, hierarchical groups, NCCL options.

Source: Megatron-LM ``megatron/core/parallel_state.py``.
"""
from __future__ import annotations

import datetime
import numbers
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "default_backend",
    "init_distributed",
    "spawn",
]

# None until initialize_model_parallel; then the group (None in a one-process world without
# torch.distributed), with its rank and size cached (they never change while it lives).
_INITIALIZED = False
_TENSOR_MODEL_PARALLEL_GROUP: Optional[dist.ProcessGroup] = None
_DATA_PARALLEL_GROUP: Optional[dist.ProcessGroup] = None
_TP_RANK, _TP_SIZE = 0, 1
_DP_RANK, _DP_SIZE = 0, 1


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``.

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Initialize ``torch.distributed`` from ``torchrun``'s environment (``env://``), once.

    Does nothing if it is already initialized. With NCCL, binds this process to GPU
    ``LOCAL_RANK`` first.

    Args:
        backend: "nccl", "gloo", or None for :func:`default_backend`.
        timeout_s: collective timeout in seconds.

    Raises:
        RuntimeError: torch.distributed unavailable, or ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/
            ``MASTER_PORT`` not set (start the script with ``torchrun``, or use :func:`spawn`).
        ValueError: an unknown backend.

    Source: fusedlib's own, on ``torch.distributed.init_process_group`` (``env://``); Megatron-core
    has no counterpart.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        return
    backend = default_backend() if backend is None else backend
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    missing = [k for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialized and {', '.join(missing)} not set: start the "
                           "processes with torchrun (e.g. torchrun --nproc-per-node 2 script.py), or with "
                           "fusedlib.parallel.parallel_state.spawn")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, *, backend: Optional[str] = None) -> None:
    """Create the tensor- and data-parallel groups (see the module docstring for the layout).

    Every process of the world must call it, with the same size (``new_group`` is collective).
    Initializes ``torch.distributed`` first if needed (:func:`init_distributed`), except in a
    one-process world without ``torchrun``'s variables, where ``tensor_model_parallel_size=1``
    needs no process group.

    Args:
        tensor_model_parallel_size: p, ranks per tensor-parallel group; must divide the world size.
        backend: for :func:`init_distributed` ("nccl", "gloo" or None: NCCL when CUDA is available).

    Raises:
        ValueError: p not an int >= 1, or not a divisor of the world size; an unknown backend.
        RuntimeError: already initialized (call :func:`destroy_model_parallel` first), or p > 1
            in a process started without ``torchrun`` or :func:`spawn`.

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``initialize_model_parallel``).
    """
    global _INITIALIZED, _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _TP_RANK, _TP_SIZE, _DP_RANK, _DP_SIZE
    p = tensor_model_parallel_size
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
        raise ValueError(f"tensor_model_parallel_size must be an int >= 1, got {p!r}")
    if backend not in (None, "nccl", "gloo"):  # (checked here too: a one-process world never reaches init_distributed)
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if _INITIALIZED:
        raise RuntimeError("model parallel groups are already initialized: call destroy_model_parallel() first")
    single = not (dist.is_available() and dist.is_initialized()) and "WORLD_SIZE" not in os.environ
    if single:
        if p != 1:
            raise RuntimeError(f"tensor_model_parallel_size={p} needs {p} processes, but this one was started "
                               "alone (no torch.distributed, no torchrun variables): launch with torchrun "
                               f"--nproc-per-node {p}, or fusedlib.parallel.parallel_state.spawn")
        _INITIALIZED = True
        _TENSOR_MODEL_PARALLEL_GROUP = _DATA_PARALLEL_GROUP = None
        _TP_RANK, _TP_SIZE, _DP_RANK, _DP_SIZE = 0, 1, 0, 1
        return
    init_distributed(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % p:
        raise ValueError(f"tensor_model_parallel_size={p} must divide the world size {world}")
    # every rank creates every group (new_group is collective), and keeps its own
    for k in range(world // p):
        ranks = list(range(k * p, (k + 1) * p))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group
    for j in range(p):
        ranks = list(range(j, world, p))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
    _TP_RANK, _TP_SIZE = rank % p, p
    _DP_RANK, _DP_SIZE = rank // p, world // p
    _INITIALIZED = True


def destroy_model_parallel() -> None:
    """Forget the groups (``torch.distributed`` itself stays initialized; the groups are freed
    with it, by ``torch.distributed.destroy_process_group``).

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``destroy_model_parallel``).
    """
    global _INITIALIZED, _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _TP_RANK, _TP_SIZE, _DP_RANK, _DP_SIZE
    _INITIALIZED = False
    _TENSOR_MODEL_PARALLEL_GROUP = _DATA_PARALLEL_GROUP = None
    _TP_RANK, _TP_SIZE, _DP_RANK, _DP_SIZE = 0, 1, 0, 1


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and :func:`destroy_model_parallel` not since).

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``model_parallel_is_initialized``).
    """
    return _INITIALIZED


def _check_initialized(what: str) -> None:
    if not _INITIALIZED:
        raise RuntimeError(f"{what}: model parallel groups are not initialized: call "
                           "fusedlib.parallel.initialize_model_parallel(tensor_model_parallel_size) first")


def get_tensor_model_parallel_group(check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    """This rank's tensor-parallel group (None in a one-process world without torch.distributed).

    Raises:
        RuntimeError: not initialized (unless ``check_initialized=False``, which returns None).

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``get_tensor_model_parallel_group``).
    """
    if check_initialized:
        _check_initialized("get_tensor_model_parallel_group")
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group, 0 .. p-1.

    Raises:
        RuntimeError: not initialized.

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``get_tensor_model_parallel_rank``).
    """
    _check_initialized("get_tensor_model_parallel_rank")
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    """p, the size of the tensor-parallel group.

    Raises:
        RuntimeError: not initialized.

    Source: Megatron-LM ``megatron/core/parallel_state.py``
    (``get_tensor_model_parallel_world_size``).
    """
    _check_initialized("get_tensor_model_parallel_world_size")
    return _TP_SIZE


def get_data_parallel_group(check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    """This rank's data-parallel group: the ranks that hold the same tensor-parallel shard.

    Raises:
        RuntimeError: not initialized (unless ``check_initialized=False``).

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``get_data_parallel_group``).
    """
    if check_initialized:
        _check_initialized("get_data_parallel_group")
    return _DATA_PARALLEL_GROUP


def get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group.

    Raises:
        RuntimeError: not initialized.

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``get_data_parallel_rank``).
    """
    _check_initialized("get_data_parallel_rank")
    return _DP_RANK


def get_data_parallel_world_size() -> int:
    """The size of the data-parallel group, world size / p.

    Raises:
        RuntimeError: not initialized.

    Source: Megatron-LM ``megatron/core/parallel_state.py`` (``get_data_parallel_world_size``).
    """
    _check_initialized("get_data_parallel_world_size")
    return _DP_SIZE


def _run_with_model_parallel(rank: int, world_size: int, device: torch.device, fn: Callable[..., Any],
                             tensor_model_parallel_size: int, *args: Any) -> Any:
    initialize_model_parallel(tensor_model_parallel_size)
    try:
        return fn(rank, world_size, device, *args)
    finally:
        destroy_model_parallel()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, tensor_model_parallel_size: Optional[int] = None,
          backend: Optional[str] = None) -> list[Any]:
    """Run ``fn(rank, world_size, device, *args)`` in ``world_size`` new processes with model
    parallelism initialized, and return what each rank returned.

    Each process joins one process group (a file rendezvous: no network port), calls
    ``initialize_model_parallel(tensor_model_parallel_size)``, runs ``fn``, then
    :func:`destroy_model_parallel`. ``device`` is ``cuda:rank`` with NCCL, the CPU with gloo.
    The launcher is :func:`fusedlib.parallel.demo.run_tp` (read it for the start methods).

    Args:
        fn: a function defined at module level of an importable module (it is pickled by name).
        world_size: number of processes.
        *args: picklable arguments for every rank.
        tensor_model_parallel_size: p (None: ``world_size``).
        backend: "nccl" (one GPU per rank), "gloo" (CPU tensors, kernels in Triton's
            interpreter), or None: NCCL when there are ``world_size`` GPUs, else gloo.

    Returns:
        The return values of ranks 0 .. world_size - 1.

    Raises:
        ValueError: world_size not an int >= 1; as :func:`fusedlib.parallel.demo.run_tp`.
        torch.multiprocessing.ProcessRaisedException: a rank raised (the others are stopped).

    Source: fusedlib's own, on :func:`fusedlib.parallel.demo.run_tp`; Megatron-core has no
    counterpart.
    """
    from .demo import run_tp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    p = world_size if tensor_model_parallel_size is None else tensor_model_parallel_size
    return run_tp(_run_with_model_parallel, world_size, fn, p, *args, backend=backend)
