"""The MLP's GEMMs with bias-GeLU in their epilogues: ``fused_dense_gelu_dense``.

``bias_gelu_impl`` leaves one pass over the [tokens, ffn] activation in each direction: the
forward reads the fc1 GEMM's output and writes gelu_tanh(output + b1); the backward reads fc2's
input gradient and the saved pre-activation and writes dz. On CUDA this op moves both into
cuBLASLt GEMM epilogues (:mod:`fusedlib.backends.cublaslt`):

* forward: fc1's GEMM writes ``y = gelu_tanh(x·W1ᵀ + b1)`` and the pre-activation
  ``z = x·W1ᵀ + b1`` (kept for the backward) from its epilogue; then fc2's GEMM
  ``out = y·W2ᵀ (+ b2)``.
* backward: fc2's input-gradient GEMM writes ``dz = (g·W2) * gelu_tanh'(z)`` from its epilogue;
  fusedlib's column-sum kernel gives ``db1 = Σ dz`` (float32 sums, deterministic); the weight
  gradients and dx are plain GEMMs.

It saves x, y and z: what the unfused MLP saves (fc1's input, GeLU's input, fc2's input).
Where cuBLASLt cannot take the operands (the CPU, float32, unaligned or strided storage, widths
not multiples of 8, inside ``torch.compile``), the same Function runs the GEMMs through torch
and the activation through fusedlib's bias-GeLU kernels: the same math, one more pass each way.

Numerics: the epilogue adds the bias to the GEMM's float32 accumulator before rounding, where
the unfused path rounds x·W1ᵀ to the input dtype first and adds the bias in the kernel: the two
differ by the rounding of one bf16/fp16 value.

Source: Apex ``apex/fused_dense/fused_dense.py`` (``FusedDenseGeluDenseFunc``,
``fused_dense_gelu_dense_function``); Transformer Engine ``LayerNormMLP`` (its fc1 GEMM's GeLU
epilogue); Megatron-LM ``megatron/core/transformer/mlp.py`` (the MLP it replaces).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..backends import cublaslt
from ..checks import FLOAT_DTYPES, KERNEL_DEVICE_TYPES, check_bool, check_same_device, check_tensor, resolve_neg_grads
from ..kernels.bias_dropout_add import bias_dropout_add_bwd
from ..kernels.bias_gelu import bias_gelu_bwd, bias_gelu_fwd
from ..runtime import find_plan, param_key, plan_cache, remember_plan
from ._apply import apply, keep_graph_anchor, once_differentiable

__all__ = ["EPILOGUE_MIN_ELEMENTS", "FusedDenseGeluDenseFunction", "fused_dense_gelu_dense"]

Tensor = torch.Tensor


def _column_sum(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Σ over the rows of a [M, N] tensor, in float32, rounded once to ``dtype`` (fusedlib's kernel)."""
    return bias_dropout_add_bwd(t, t.dtype, None, 0.0, need_dx=False, need_dbias=True, db_dtype=dtype)[1]


#: The least size of the activation [M, F] (elements) at which the automatic choice
#: (``epilogue=None``) takes cuBLASLt's epilogues. ``python -m fusedlib.bench --op fused_dense
#: --sweep`` on the H200 (bf16, fwd+bwd, CUDA-graph replays): at [M, h, F] = [4096, 512, 2048]
#: (2^23 elements) the epilogues took 0.1389 ms against 0.1224 for fc1's GEMM, the bias-GeLU
#: kernels and fc2's GEMM; at the five larger shapes of that sweep (2.5·10^7 to 1.3·10^8
#: elements) 0.0 to 2.9 % less (0.5323 against 0.5464 at [32768, 384, 1536]); the same code timed
#: twice in that run came out up to 1.8 % apart.
EPILOGUE_MIN_ELEMENTS = 1 << 24


def _rows(input: Tensor) -> Tensor:  # noqa: A002
    """[..., K] -> [M, K] (a view where it can be; M given, not -1: K may be 0)."""
    return input.reshape(math.prod(input.shape[:-1]), input.shape[-1])


def _use_epilogue(epilogue: Optional[bool], x: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor) -> bool:
    """Whether the forward on ``x`` = :func:`_rows` of the input takes cuBLASLt's epilogues."""
    if epilogue is False or (epilogue is None and x.shape[0] * weight1.shape[0] < EPILOGUE_MIN_ELEMENTS):
        return False
    return not torch.compiler.is_compiling() and cublaslt.supported(x, weight1, bias1, weight2)


def _plan_key(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor,  # noqa: A002
              bias2: Optional[Tensor], epilogue: Optional[bool]) -> tuple:
    """A call's signature: everything :func:`_check` and :func:`_use_epilogue` read (each tensor's
    class, shape, strides, dtype, device and negative bit, the operands' addresses modulo
    cuBLASLt's alignment), the ``epilogue`` argument and the size rule."""
    a = cublaslt.ALIGNMENT
    return (param_key(input), param_key(weight1), param_key(bias1), param_key(weight2), param_key(bias2),
            input.data_ptr() % a, weight1.data_ptr() % a, bias1.data_ptr() % a, weight2.data_ptr() % a,
            epilogue, EPILOGUE_MIN_ELEMENTS)


#: The path each checked call signature takes (:func:`_plan_key` -> True: the epilogues): a
#: call whose signature passed the checks before skips them and ``supported()``, host work
#: paid on every call otherwise (as fusedlib's other ops skip theirs: :mod:`fusedlib.runtime`).
_PLANS: dict = plan_cache()


class FusedDenseGeluDenseFunction(torch.autograd.Function):
    """Autograd wiring of :func:`fused_dense_gelu_dense` (see the module docstring).

    ``forward(ctx, input, weight1, bias1, weight2, bias2, epilogue, path=None)``: input [..., K],
    weight1 [F, K], bias1 [F], weight2 [H, F], bias2 [H] or None, epilogue as
    :func:`fused_dense_gelu_dense`'s; ``path`` the choice already made for these operands
    (True: the epilogues; :func:`fused_dense_gelu_dense` passes the one its checks cached, or
    None where it keys none), None to make it here; returns [..., H]. ``backward`` returns the
    gradients of all five (None for bias2 when it is None), each in its tensor's dtype; the
    bias gradients are float32 sums rounded once.

    Source: Apex ``apex/fused_dense/fused_dense.py`` (``FusedDenseGeluDenseFunc``).
    """

    @staticmethod
    def forward(ctx, input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor,  # noqa: A002
                bias2: Optional[Tensor], epilogue: Optional[bool] = None, path: Optional[bool] = None) -> Tensor:
        x = _rows(input)  # [..., K] -> [M, K]
        if path is None:
            path = _use_epilogue(epilogue, x, weight1, bias1, weight2)
        ctx.epilogue = path
        if ctx.epilogue:
            y, z = cublaslt.launch_linear_gelu_aux_bias(x, weight1, bias1)  # [M, F] each; z includes b1
        else:
            z = F.linear(x, weight1)  # [M, F], without b1: the kernel adds it
            y = bias_gelu_fwd(z, bias1.contiguous())
        # [M, H] written into a new [..., H] tensor: returned, it is no view (a view made in a
        # Function's forward could not be modified in place)
        out = torch.empty((*input.shape[:-1], weight2.shape[0]), dtype=y.dtype, device=y.device)
        out2d = out.view(x.shape[0], weight2.shape[0])
        if bias2 is None:
            torch.mm(y, weight2.t(), out=out2d)
        else:
            torch.addmm(bias2, y, weight2.t(), out=out2d)  # F.linear's GEMM with its bias
        ctx.save_for_backward(x, weight1, bias1, weight2, y, z)
        keep_graph_anchor(ctx, input, x)  # (x: a copy where input's rows were not one view)
        ctx.has_bias2 = bias2 is not None
        ctx.in_shape = input.shape
        return out

    @staticmethod
    @once_differentiable  # GEMMs and kernels: the backward is not itself differentiable
    @resolve_neg_grads  # gradients with the negative bit, resolved (checks.check_dense)
    def backward(ctx, grad_output: Tensor):
        x, weight1, bias1, weight2, y, z = ctx.saved_tensors
        g = grad_output.reshape(x.shape[0], grad_output.shape[-1]).contiguous()  # [M, H] (H may be 0)
        need = ctx.needs_input_grad
        dx = dw1 = db1 = dw2 = db2 = None
        if need[3]:
            dw2 = g.t().matmul(y)  # [H, F]
        if ctx.has_bias2 and need[4]:
            db2 = _column_sum(g, weight2.dtype)
        if need[0] or need[1] or need[2]:
            # z: supported() in the forward; g [M, H] and weight2 [H, F] asked here (H, the GEMM's
            # depth, is no width the forward asked of; weight2's .data may have been replaced since)
            if ctx.epilogue and cublaslt.supported_like(g, z) and cublaslt.supported_like(weight2, z):
                dz = cublaslt.launch_matmul_dgelu(g, weight2, z)  # [M, F]
                db1 = _column_sum(dz, bias1.dtype) if need[2] else None
            else:  # z holds b1 on the epilogue path: add none again
                b = torch.zeros_like(bias1) if ctx.epilogue else bias1
                dz, db1 = bias_gelu_bwd(g.matmul(weight2), z, b.contiguous())
                db1 = db1 if need[2] else None
            if need[0]:
                dx = dz.matmul(weight1).view(ctx.in_shape)  # [M, K] -> [..., K]
            if need[1]:
                dw1 = dz.t().matmul(x)  # [F, K]
        return dx, dw1, db1, dw2, db2, None, None


def _check(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor,  # noqa: A002
           bias2: Optional[Tensor]) -> None:
    check_tensor("input", input, dtypes=FLOAT_DTYPES, min_ndim=1)
    k = input.shape[-1]
    check_tensor("weight1", weight1, dtypes=(input.dtype,), shape=(None, k))
    f = weight1.shape[0]
    check_tensor("bias1", bias1, dtypes=(input.dtype,), shape=(f,))
    check_tensor("weight2", weight2, dtypes=(input.dtype,), shape=(None, f))
    if bias2 is not None:
        check_tensor("bias2", bias2, dtypes=(input.dtype,), shape=(weight2.shape[0],))
    check_same_device(input=input, weight1=weight1, bias1=bias1, weight2=weight2, bias2=bias2)


def fused_dense_gelu_dense(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor,  # noqa: A002
                           bias2: Optional[Tensor] = None, *, epilogue: Optional[bool] = None) -> Tensor:
    """``linear(gelu_tanh(linear(input, weight1, bias1)), weight2, bias2)``, bias-GeLU in the GEMMs.

    The MLP of a GPT layer with its activation in cuBLASLt's GEMM epilogues on CUDA (module
    docstring), with autograd.

    Under ``torch.autocast`` on input's device, the floating tensors (float64 aside) are cast to
    autocast's dtype first and the op computes in it (as Apex's ``fused_dense``): the result has
    that dtype, and the gradients their tensors' dtypes.

    Args:
        input: [..., K] (e.g. [s, b, h]), float32 / float16 / bfloat16 (or float64, computed
            in float64: for gradcheck), any strides.
        weight1: fc1's [F, K]; bias1: [F]; weight2: fc2's [H, F]; bias2: [H] or None (None:
            the caller adds fc2's bias, e.g. in a bias-dropout-add). All of input's dtype and
            device.
        epilogue: None (default): cuBLASLt's epilogues where they take the operands and the
            activation [M, F] has at least :data:`EPILOGUE_MIN_ELEMENTS` elements (on smaller
            GEMMs the epilogue cost more than the pass it saves); True: wherever cuBLASLt
            takes the operands; False: never (fc1's GEMM, the bias-GeLU kernels, fc2's GEMM).

    Returns:
        A new [..., H] tensor of input's dtype (autocast's under ``torch.autocast``).

    Raises:
        TypeError: a non-tensor argument, an unsupported dtype, dtypes that differ, or an
            epilogue that is not None or a bool.
        ValueError: shapes that do not chain ([F, K], [F], [H, F], [H]), or tensors on
            different devices.

    Source: Apex ``apex/fused_dense/fused_dense.py`` (``fused_dense_gelu_dense_function``).
    """
    if epilogue is not None and epilogue is not True and epilogue is not False:
        epilogue = check_bool("epilogue", epilogue)  # a numpy bool converted, anything else refused
    dev = input.device.type if isinstance(input, Tensor) else None
    if dev in KERNEL_DEVICE_TYPES and torch.is_autocast_enabled(dev):
        # as Apex's fused_dense_gelu_dense_function: the arguments cast to autocast's dtype, the op
        # run without autocast (else its GEMMs would be cast and the rest not: mixed dtypes)
        dtype = torch.get_autocast_dtype(dev)
        args = [_autocast_cast(t, dev, dtype) for t in (input, weight1, bias1, weight2, bias2)]
        path = _checked_path(*args, epilogue)
        with torch.autocast(dev, enabled=False):
            return apply(FusedDenseGeluDenseFunction, *args, epilogue, path)
    path = _checked_path(input, weight1, bias1, weight2, bias2, epilogue)
    return apply(FusedDenseGeluDenseFunction, input, weight1, bias1, weight2, bias2, epilogue, path)


def _checked_path(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor,  # noqa: A002
                  bias2: Optional[Tensor], epilogue: Optional[bool]) -> Optional[bool]:
    """:func:`_check` the arguments and choose the path (:func:`_use_epilogue`), or take both from the
    plan of a call with the same signature (:data:`_PLANS`). None (checked, the path left to
    the Function's forward, where it runs) for a call without a key: inside a ``torch.func``
    transform (tensors without storage, whose address :func:`_use_epilogue` would read: torch's own
    error, or the refusal of a tangent, says what is wrong) or a ``torch.compile`` trace."""
    key, path = find_plan(_PLANS, _plan_key, input, weight1, bias1, weight2, bias2, epilogue)
    if path is None:
        _check(input, weight1, bias1, weight2, bias2)
        if key is None:
            return None
        path = remember_plan(_PLANS, key, _use_epilogue(epilogue, _rows(input), weight1, bias1, weight2))
    return path


def _autocast_cast(t: object, device_type: str, dtype: torch.dtype) -> object:
    """``t.to(dtype)`` for a floating tensor on ``device_type`` but float64, as autocast casts a
    GEMM's operands (``torch.amp.autocast_mode._cast``); anything else unchanged (the checks see it)."""
    if isinstance(t, Tensor) and t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64:
        return t.to(dtype)
    return t
