"""cuBLASLt's GEMM epilogues, called through ``ctypes``: the MLP's bias-GeLU inside its GEMMs.

fusedlib's bias-GeLU kernel reads the fc1 GEMM's output once and writes the activation once;
what is left of the MLP's elementwise traffic is that pass itself. cuBLASLt's GEMMs can apply
the bias and the GeLU to the tile they hold in registers before it reaches memory (an
*epilogue*), and, in the backward, multiply fc2's input gradient by GeLU's derivative and sum
fc1's bias gradient in the same way (fusedlib takes the first, not the second: see
:func:`matmul_dgelu`). Transformer Engine and Apex (``fused_dense``) do this;
PyTorch exposes no binding with the pre-activation output the backward needs, so this module
calls cuBLASLt's C API itself, on the library torch has already loaded:

* :func:`linear_gelu_aux_bias` -- ``z = x·Wᵀ + b`` and ``y = gelu_tanh(z)`` from one GEMM
  (``CUBLASLT_EPILOGUE_GELU_AUX_BIAS``: y is the output, z the "aux" output kept for the
  backward);
* :func:`matmul_dgelu` -- ``dz = (g·W) * gelu_tanh'(z)`` from one GEMM
  (``CUBLASLT_EPILOGUE_DGELU``); the bias gradient ``Σ_rows dz`` is one more pass (see there
  why not cuBLASLt's own).

cuBLASLt's documentation does not say which GeLU its epilogues compute; PyTorch's
``_addmm_activation`` substitutes ``gelu(approximate="tanh")`` where it cannot use them, and
Transformer Engine uses them for its tanh GeLU, the form of Megatron's ``bias_gelu_impl``.
fusedlib's tests compare them with the tanh form at float16's and bfloat16's tolerances, which
cannot tell the two forms apart (they differ by at most 4.7e-4). The GEMMs are
column-major: a row-major [M, N] output is cuBLASLt's [N, M] with leading dimension N, so
``x·Wᵀ`` is ``op(A)·op(B)`` with A = W (transposed) and B = x, and the bias (one value per
row of cuBLASLt's output) is one value per column of ours.

Only CUDA devices with cuBLASLt (what torch links), float16 / bfloat16, contiguous row-major
operands with 256-byte aligned storage (what the heuristic assumes) and widths a multiple of 8
(cuBLASLt's rule for the aux matrix's leading dimension): :func:`supported` says whether a call
qualifies, and callers fall back to the separate GEMM and Triton kernel otherwise (the CPU
always does).

Descriptors and the heuristic's algorithm are made once per (device, dtype, shape) and kept for
the process's life (a training run has a few shapes); a call sets the two pointers the
descriptor holds and launches on torch's current stream, so it can be captured in a CUDA graph.
cuBLASLt gets a workspace of :data:`WORKSPACE_BYTES` (without one its heuristic found no
algorithm for the bias-gradient epilogue; every timing here had it), one per device and stream
as torch keeps its own, made on the first call on that stream: graphs captured on one stream
share it, so replay them one after another, not concurrently on several streams.

Source: NVIDIA cuBLAS documentation, "cuBLASLt API" (``cublasLtMatmul``, ``cublasLtEpilogue_t``);
Apex ``apex/fused_dense`` (``gemm_bias_gelu_lt``, ``gemm_dgelu_bgradb_lt``); Transformer Engine
``transformer_engine/common/gemm/cublaslt_gemm.cu``.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Optional, Tuple

import torch

from ..checks import check_tensor, is_dense

__all__ = ["ALIGNMENT", "CublasLtError", "WORKSPACE_BYTES", "clear_workspaces", "cublaslt_available", "supported",
           "supported_like", "linear_gelu_aux_bias", "launch_linear_gelu_aux_bias", "matmul_dgelu",
           "launch_matmul_dgelu"]

# enum values from cublasLt.h / cublas_api.h / library_types.h (the same in CUDA 12 and 13)
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_DTYPE_CODE = {torch.float16: 2, torch.bfloat16: 14}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE = 3, 4, 7
_DESC_BIAS_POINTER, _DESC_AUX_POINTER, _DESC_AUX_LD = 8, 11, 12
_POINTER_ATTRS = (_DESC_BIAS_POINTER, _DESC_AUX_POINTER)  # the order of a plan's `pointers`
_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4
_EPILOGUE_DGELU = 64 | 128
_PREF_MAX_WORKSPACE_BYTES = 1

#: Bytes of workspace each (device, stream) gives cuBLASLt (Apex's ``fused_dense`` gives 4 MiB).
WORKSPACE_BYTES = 4 << 20


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS (the message names it).

    Source: fusedlib's own; the statuses are cuBLAS's ``cublasStatus_t`` (NVIDIA cuBLAS
    documentation).
    """


_lib: Optional[ctypes.CDLL] = None
_lib_error: Optional[str] = None
_lock = threading.Lock()
_plans: dict = {}
_handles: dict = {}
_workspaces: dict = {}
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_REF, _ZERO_REF = ctypes.byref(_ONE), ctypes.byref(_ZERO)
# torch's current stream of a device as the raw cudaStream_t (what Triton's launcher reads:
# about 0.6 us a call on the H200's host, against 15 for torch.cuda.current_stream(...).cuda_stream)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def clear_workspaces() -> int:
    """Drop the workspaces this module keeps (one per device and stream) and return their bytes.

    The workspaces live for the process's life, as torch keeps its own cuBLAS workspaces (one
    per handle and stream, 32 MiB each on an H200): a process that trains one model after
    another holds one per stream any of them ran an epilogue GEMM on, :data:`WORKSPACE_BYTES`
    each. This drops them (the caching allocator gets the memory back once nothing else refers
    to it); the next call on a stream makes a new one. The counterpart of
    ``torch._C._cuda_clearCublasWorkspaces`` for torch's own.

    Call it only where no CUDA graph that captured one of this module's GEMMs will be replayed
    again: a graph keeps the workspace's address, not the tensor, and would write into memory
    given to something else.

    Returns:
        The bytes of the workspaces dropped (0 where there were none, as on a CPU-only machine).

    Source: PyTorch ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (``clearCublasWorkspaces``).
    """
    with _lock:
        released = sum(w.numel() * w.element_size() for w in _workspaces.values())
        _workspaces.clear()
    return released


def _load() -> Optional[ctypes.CDLL]:
    """The cuBLASLt library torch loaded (by soname, then from the nvidia wheels), or None."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    if not torch.cuda.is_available() or torch.version.cuda is None:
        _lib_error = "no CUDA device (or a torch built without CUDA)"
        return None
    major = torch.version.cuda.split(".")[0]
    names = [f"libcublasLt.so.{major}"]
    for root in sys.path:  # the pip wheels' layout: nvidia/cu13/lib or nvidia/cublas/lib
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", f"libcublasLt.so.{major}*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        c = ctypes
        lib.cublasLtCreate.argtypes = [c.POINTER(c.c_void_p)]
        lib.cublasLtMatmulDescCreate.argtypes = [c.POINTER(c.c_void_p), c.c_int, c.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [c.c_void_p, c.c_int, c.c_void_p, c.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [c.POINTER(c.c_void_p), c.c_int, c.c_uint64, c.c_uint64, c.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [c.POINTER(c.c_void_p)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [c.c_void_p, c.c_int, c.c_void_p, c.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                                       c.c_void_p, c.c_void_p, c.c_int,
                                                       c.POINTER(_HeuristicResult), c.POINTER(c.c_int)]
        lib.cublasLtMatmul.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                       c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                       c.c_void_p, c.c_void_p, c.c_size_t, c.c_void_p]
        _lib = lib
        return lib
    _lib_error = f"libcublasLt.so.{major} not found"
    return None


def cublaslt_available() -> bool:
    """True where cuBLASLt can be called (a CUDA build of torch on a machine with a GPU).

    Source: fusedlib's own; Megatron-core has no counterpart.
    """
    return _load() is not None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt: {what} returned status {status}")


#: The alignment (bytes) cuBLASLt's heuristic assumes of every pointer unless told otherwise
#: (``CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES``' default); torch's allocations have it, and an
#: operand without it takes the unfused path.
ALIGNMENT = 256


def _operand_ok(t: torch.Tensor, like: torch.Tensor) -> bool:
    """``t`` beside ``like`` as cuBLASLt reads its operands: the same device and dtype, dense,
    contiguous and :data:`ALIGNMENT`-byte aligned."""
    return (t.device == like.device and t.dtype == like.dtype and is_dense(t) and t.is_contiguous()
            and t.data_ptr() % ALIGNMENT == 0)


def supported(x: torch.Tensor, weight: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Whether cuBLASLt's epilogue GEMMs can take these operands (else use the unfused path).

    Args:
        x: [M, K] (or [..., K]) activations; weight: [N, K]; others: more operands of the call
            (bias, pre-activation, gradient), None entries ignored.

    Returns:
        True when every tensor is on one CUDA device, float16 or bfloat16 alike, dense without
        the negative bit (:func:`~fusedlib.checks.is_dense`: cuBLASLt reads the memory),
        contiguous, :data:`ALIGNMENT`-byte aligned, the widths (K, N) are multiples of 8 and not 0 (cuBLASLt's
        heuristic refuses N = 0), and cuBLASLt loads.

    Source: fusedlib's own; the conditions from the NVIDIA cuBLAS documentation, "cuBLASLt API" (see
    the module docstring).
    """
    if not (x.is_cuda and x.dtype in _DTYPE_CODE and weight.dim() == 2):
        return False
    if not weight.numel() or weight.shape[0] % 8 or weight.shape[1] % 8:
        return False
    if not all(_operand_ok(t, x) for t in (x, weight, *others) if t is not None):
        return False
    return cublaslt_available()


def supported_like(t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``t`` can stand where ``like``, an operand :func:`supported` accepted, stood:
    the same dtype and device, dense, contiguous, :data:`ALIGNMENT`-byte aligned, and its rows
    (the last dim: its leading dimension, a width of the GEMM it enters) a multiple of 8 and not
    0, as :func:`supported` asks of the widths (the rest of its shape is the caller's to match).
    The backward's check of its gradient, and of a saved operand whose ``.data`` may have been
    replaced since the forward checked it (a sharded optimizer gathers its parameters again).

    Source: fusedlib's own; the conditions of :func:`supported`.
    """
    return t.dim() > 0 and t.shape[-1] > 0 and t.shape[-1] % 8 == 0 and _operand_ok(t, like)


def _require_supported(fn: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError naming ``fn`` when :func:`supported` refuses ``tensors`` (and why cuBLASLt
    did not load, where it did not)."""
    if not supported(*tensors):
        why = f": {_lib_error}" if _lib is None and _lib_error else ""
        raise ValueError(f"{fn}: operands cuBLASLt cannot take (see supported()){why}")


def _check_args(**tensors: object) -> None:
    """Refuse, by name, an argument that is not a tensor, or one cuBLASLt could not read as its
    values (sparse, nested, the negative bit: :func:`~fusedlib.checks.check_tensor`)."""
    for name, t in tensors.items():
        if not (isinstance(t, torch.Tensor) and is_dense(t)):
            check_tensor(name, t, dtypes=None)


def _handle(device: torch.device) -> ctypes.c_void_p:
    h = _handles.get(device.index)
    if h is None:
        with torch.cuda.device(device):
            h = ctypes.c_void_p()
            _check(_lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        _handles[device.index] = h
    return h


def _plan(device: torch.device, dtype: torch.dtype, epilogue: int, transa: int, m: int, n: int, k: int,
          lda: int, ldb: int, ldd: int, a_rows: int, a_cols: int, b_rows: int, b_cols: int):
    """The :class:`_Plan` of D[m, n] = op(A)·op(B) (column-major), made once per key."""
    key = (device.index, dtype, epilogue, transa, m, n, k)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    lib, c = _lib, ctypes
    code = _DTYPE_CODE[dtype]
    handle = _handle(device)
    desc = c.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(c.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
    for attr, value in ((_DESC_TRANSA, c.c_int32(transa)), (_DESC_TRANSB, c.c_int32(_OP_N)),
                        (_DESC_EPILOGUE, c.c_uint32(epilogue)), (_DESC_AUX_LD, c.c_int64(ldd))):
        _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, c.byref(value), c.sizeof(value)),
               f"cublasLtMatmulDescSetAttribute({attr})")
    layouts = []
    for rows, cols, ld in ((a_rows, a_cols, lda), (b_rows, b_cols, ldb), (m, n, ldd)):
        layout = c.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(c.byref(layout), code, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    pref = c.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(c.byref(pref)), "cublasLtMatmulPreferenceCreate")
    limit = c.c_uint64(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, c.byref(limit), c.sizeof(limit)),
           "cublasLtMatmulPreferenceSetAttribute")
    # the heuristic reads the pointers' alignment from the descriptor: give it aligned placeholders
    placeholder = c.c_void_p(256)
    for attr in ((_DESC_BIAS_POINTER, _DESC_AUX_POINTER) if epilogue & (4 | 16) else (_DESC_AUX_POINTER,)):
        _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, c.byref(placeholder), c.sizeof(placeholder)),
               "cublasLtMatmulDescSetAttribute(pointer)")
    # the heuristic's first algorithm, always: timing the candidates would pick faster ones at some
    # shapes, but not the same one in every process (and a resumed run must compute what the
    # uninterrupted one did, bit for bit)
    result, count = _HeuristicResult(), c.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, 1,
                                              c.byref(result), c.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    if count.value < 1 or result.state != 0:
        raise CublasLtError(f"cuBLASLt: no algorithm for epilogue {epilogue} at m={m}, n={n}, k={k} ({dtype})")
    plan = _Plan(handle, desc, layouts, result.algo)
    _plans[key] = plan
    return plan


class _Plan:
    """One shape's cuBLASLt call, made once: the handle, the descriptor, the three layouts, the
    algorithm, and the launch's constant arguments and the pointers last set in the descriptor
    (set again only when they change: ``cublasLtMatmulDescSetAttribute`` costs host time)."""

    __slots__ = ("handle", "desc", "la", "lb", "ld", "algo", "algo_ref", "pointers")

    def __init__(self, handle, desc, layouts, algo) -> None:
        self.handle, self.desc, (self.la, self.lb, self.ld), self.algo = handle, desc, layouts, algo
        self.algo_ref = ctypes.byref(algo)
        # the bias and aux pointers last set (:data:`_POINTER_ATTRS`); None: not set yet, or
        # unknown (the placeholders are, or were)
        self.pointers = [None, None]


def _matmul(plan: _Plan, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, bias: Optional[torch.Tensor],
            aux: torch.Tensor) -> None:
    lib = _lib
    index = d.device.index
    if torch.cuda.current_device() != index:
        with torch.cuda.device(d.device):
            return _matmul(plan, a, b, d, bias, aux)
    stream = _current_stream(index)
    workspace = _workspaces.get((index, stream))
    if workspace is None:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=d.device)
        _workspaces[(index, stream)] = workspace
    bias_p = bias.data_ptr() if bias is not None else None
    aux_p = aux.data_ptr()
    with _lock:  # the descriptor holds the pointers: set and launch as one
        held = plan.pointers
        for i, ptr in enumerate((bias_p, aux_p)):
            if ptr != held[i]:
                # unknown (None) until the call is through: an exception between cuBLASLt's call
                # and the bookkeeping (a KeyboardInterrupt) must not leave the plan naming a
                # pointer the descriptor no longer holds
                held[i] = None
                value = ctypes.c_void_p(ptr)
                _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, _POINTER_ATTRS[i], ctypes.byref(value), 8),
                       "set pointer")
                held[i] = ptr
        _check(lib.cublasLtMatmul(plan.handle, plan.desc, _ONE_REF, a.data_ptr(), plan.la, b.data_ptr(), plan.lb,
                                  _ZERO_REF, d.data_ptr(), plan.ld, d.data_ptr(), plan.ld, plan.algo_ref,
                                  workspace.data_ptr(), WORKSPACE_BYTES, stream),
               "cublasLtMatmul")


def linear_gelu_aux_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``y = gelu_tanh(x·Wᵀ + b)`` and the pre-activation ``z = x·Wᵀ + b``, from one cuBLASLt GEMM.

    Args:
        x: [M, K]; weight: [N, K]; bias: [N]; one CUDA device, float16 or bfloat16 alike,
            contiguous, 256-byte aligned, K and N multiples of 8 (:func:`supported`).

    Returns:
        ``(y, z)``, both new [M, N] tensors of x's dtype (y the GEMM's output, z its aux output).

    Raises:
        TypeError: an argument that is not a tensor, or is sparse or nested.
        ValueError: operands :func:`supported` refuses (a tensor with the negative bit named) or
            of mismatched shapes.
        CublasLtError: cuBLASLt refused the call.

    Source: cuBLASLt ``CUBLASLT_EPILOGUE_GELU_AUX_BIAS``; Apex ``fused_dense`` (``gemm_bias_gelu_lt``).
    """
    _check_args(x=x, weight=weight, bias=bias)
    if x.dim() != 2 or weight.dim() != 2 or bias.shape != (weight.shape[0],) or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_gelu_aux_bias: expected x [M, K], weight [N, K], bias [N]; got "
                         f"{list(x.shape)}, {list(weight.shape)}, {list(bias.shape)}")
    _require_supported("linear_gelu_aux_bias", x, weight, bias)
    return launch_linear_gelu_aux_bias(x, weight, bias)


def launch_linear_gelu_aux_bias(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_gelu_aux_bias` without its checks, for a caller that has had :func:`supported`
    accept the operands (``fused_dense_gelu_dense``: one check per call, not two).

    Source: cuBLASLt ``CUBLASLT_EPILOGUE_GELU_AUX_BIAS``; Apex ``fused_dense``
    (``gemm_bias_gelu_lt``).
    """
    m_rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m_rows, n), dtype=x.dtype, device=x.device)
    z = torch.empty_like(y)
    if m_rows == 0:
        return y, z
    # column-major: D[n, M] = op(A)[n, k] · B[k, M]; A = W stored [k, n] (ld k), transposed
    plan = _plan(x.device, x.dtype, _EPILOGUE_GELU_AUX_BIAS, _OP_T, n, m_rows, k, k, k, n, k, n, k, m_rows)
    _matmul(plan, weight, x, y, bias, z)
    return y, z


def matmul_dgelu(grad: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``dz = (grad·W) * gelu_tanh'(z)``, from one cuBLASLt GEMM.

    The backward of ``linear(gelu_tanh(z), W)`` with respect to z: fc2's input-gradient GEMM
    with the activation's derivative in its epilogue (z, the aux input, read once there).
    fc1's bias gradient, the column sums of dz, is left to the caller: cuBLASLt's
    ``CUBLASLT_EPILOGUE_DGELU_BGRAD``, which sums it in the same GEMM, took 2.5-4.0x this
    epilogue's time on the H200 at the MLP shapes of chapters 7 and 9 (bf16: 0.476 against
    0.120 ms at [32768, 384] x [384, 1536]; 0.976 against 0.398 at [8192, 2048] x [2048, 8192];
    the heuristic's first algorithm with a 4 MiB workspace, CUDA-graph replays), and fusedlib's
    column-sum kernel adds 0.028 and 0.035 ms.

    Args:
        grad: [M, H], the gradient of fc2's output; weight: fc2's [H, F]; z: [M, F], the
            pre-activation :func:`linear_gelu_aux_bias` returned; as :func:`supported` asks.

    Returns:
        dz, a new [M, F] tensor of grad's dtype.

    Raises:
        TypeError: an argument that is not a tensor, or is sparse or nested.
        ValueError: operands :func:`supported` refuses (a tensor with the negative bit named) or
            of mismatched shapes.
        CublasLtError: cuBLASLt refused the call.

    Source: cuBLASLt ``CUBLASLT_EPILOGUE_DGELU``; Apex ``fused_dense`` (``gemm_dgelu_bgradb_lt``, which
    also takes the bias gradient from the epilogue).
    """
    _check_args(grad=grad, weight=weight, z=z)
    if (grad.dim() != 2 or weight.dim() != 2 or z.dim() != 2 or grad.shape[1] != weight.shape[0]
            or z.shape != (grad.shape[0], weight.shape[1])):
        raise ValueError(f"matmul_dgelu: expected grad [M, H], weight [H, F], z [M, F]; got "
                         f"{list(grad.shape)}, {list(weight.shape)}, {list(z.shape)}")
    _require_supported("matmul_dgelu", grad, weight, z)
    return launch_matmul_dgelu(grad, weight, z)


def launch_matmul_dgelu(grad: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """:func:`matmul_dgelu` without its checks, for a caller that has had :func:`supported` accept
    the operands.

    Source: cuBLASLt ``CUBLASLT_EPILOGUE_DGELU``; Apex ``fused_dense`` (``gemm_dgelu_bgradb_lt``).
    """
    m_rows, h = grad.shape
    f = weight.shape[1]
    dz = torch.empty((m_rows, f), dtype=grad.dtype, device=grad.device)
    if m_rows == 0:
        return dz
    # column-major: D[f, M] = A[f, h] · B[h, M]; A = W stored [h, f] row-major = [f, h] col-major (ld f)
    plan = _plan(grad.device, grad.dtype, _EPILOGUE_DGELU, _OP_N, f, m_rows, h, f, h, f, f, h, h, m_rows)
    _matmul(plan, weight, grad, dz, None, z)
    return dz
