"""Every public entry point under a training script's defaults: a default device, a float64 default dtype.

Training scripts set ``torch.set_default_device("cuda")`` or ``torch.set_default_dtype(...)``. An
allocation that does not name its device then lands on the default device, and one that does
not name its dtype takes the default dtype. So every allocation in fusedlib names both, and:

* each entry point runs forward and backward under each context, with outputs on the input's
  device and of the documented dtype, bit for bit what it gives outside the context, and
  within tolerance of a float64 reference computed outside the context;
* the default device is CUDA on a GPU machine (CUDA inputs); on a CPU-only machine it is
  ``"meta"`` (CPU inputs), where a forgotten ``device=`` fails loudly: the allocation lands on
  meta, and the kernel launch, a copy or ``.item()`` raises, or an output comes back on meta;
* a source check (``ast``) finds every torch allocation in fusedlib without ``device=`` and
  ``dtype=``, so that the kind cannot come back on code paths no test runs (the CUDA-only ones
  on a CPU machine).

The contexts are set and restored with try/finally, and a fixture checks after every test of
this module that torch's defaults are back, so no other test runs under them.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import math
import pathlib
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import fusedlib
from fusedlib import unfused
from fusedlib.fusions import fused_bias_geglu as geglu_mod
from fusedlib.fusions import fused_bias_gelu as gelu_mod
from fusedlib.fusions import fused_bias_swiglu as swiglu_mod
from fusedlib.fusions import fused_weighted_squared_relu as sqrelu_mod
from fusedlib.fusions.fused_bias_dropout import (
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)
from fusedlib.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from fusedlib.fusions.fused_layer_norm import FusedLayerNorm, FusedNorm, FusedRMSNorm, fused_layer_norm, fused_rms_norm
from fusedlib.fusions.fused_rope import fused_apply_rotary_pos_emb
from fusedlib.fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
    attention_mask_func,
    fused_scale_mask_softmax,
    fused_scale_mask_softmax_dropout,
    get_default_causal_mask,
    get_sliding_window_causal_mask,
)
from fusedlib.kernels.bias_dropout_add import KEEP_BITS, drop_threshold, dropout_mask, philox_seed
from fusedlib.kernels.softmax import softmax_dropout_mask
from fusedlib.models.common.embeddings import RotaryEmbedding, apply_rotary_pos_emb
from fusedlib.parallel import vocab_parallel_cross_entropy
from fusedlib.parallel.demo import make_global_inputs, run_tp, shard
from fusedlib.transformer import AttnMaskType, TransformerConfig
from fusedlib.utils import make_viewless_tensor

from conftest import DEVICE, assert_close  # noqa: I001

#: The default device of the device context: CUDA on a GPU machine (what training scripts set),
#: meta on a CPU-only one (an allocation without device= lands there and fails loudly).
CONTEXT_DEVICE = "cuda" if DEVICE.type == "cuda" else "meta"
SEED = 4321  # replayed before each run of an op that draws random numbers (dropout)
EPS = 1e-5
REPO = pathlib.Path(__file__).resolve().parent.parent
#: where the inputs are, with its index resolved (cuda:0, not cuda): where the outputs must be
INPUT_DEVICE = torch.empty(0, device=DEVICE).device


# ---------------------------------------------------------------------------------------------
# The contexts
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def default_device(device: str):
    """``torch.set_default_device(device)`` for the block; the previous default afterwards, even on error."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        # None, not "cpu": unset, as it was (torch.get_default_device() says cpu when unset)
        torch.set_default_device(None if previous == torch.device("cpu") else previous)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch.set_default_dtype(dtype)`` for the block; the previous default afterwards, even on error."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    f"default_device_{CONTEXT_DEVICE}": lambda: default_device(CONTEXT_DEVICE),
    "default_dtype_float64": lambda: default_dtype(torch.float64),
}


@pytest.fixture(autouse=True)
def _defaults_restored():
    """After each test: torch's defaults are back (restored here too, so one failure cannot leak)."""
    yield
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    assert (dtype, device) == (torch.float32, torch.device("cpu")), "a context leaked out of its test"


def test_contexts_restore_the_defaults_on_error():
    for make in CONTEXTS.values():
        with pytest.raises(RuntimeError, match="inside"):
            with make():
                raise RuntimeError("inside")
        assert torch.get_default_dtype() == torch.float32
        assert torch.get_default_device() == torch.device("cpu")


def test_the_device_context_catches_an_allocation_without_device():
    """The context this file relies on: an allocation without device= does not land on DEVICE."""
    with default_device(CONTEXT_DEVICE):
        assert torch.empty(1).device.type == CONTEXT_DEVICE
        assert torch.empty(1, device=DEVICE).device == INPUT_DEVICE
    with default_dtype(torch.float64):
        assert torch.empty(1).dtype == torch.float64
        assert torch.tensor(0.5).dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Cases: each builds its inputs on DEVICE (outside the contexts) and returns
#   run()      -> {name: tensor}: forward and backward of the entry point (fresh leaves each call)
#   reference()-> {name: float64 tensor}: the same quantities in float64 (unfused, outside)
#   expected   = {name: (documented dtype, tolerance dtype, tolerance scale)}
# ---------------------------------------------------------------------------------------------

Case = tuple[Callable[[], dict], Callable[[], dict], dict]
CASES: dict[str, tuple[Callable[[torch.dtype], Case], tuple[torch.dtype, ...]]] = {}
#: float32 and float16 inputs; bfloat16 has the same allocation code paths as float16
FUSED_DTYPES = (torch.float32, torch.float16)


def case(name: str, dtypes: tuple[torch.dtype, ...] = FUSED_DTYPES):
    def register(fn):
        CASES[name] = (fn, dtypes)
        return fn
    return register


def _randn(*shape, dtype, scale=1.0, shift=0.0):
    return (scale * torch.randn(*shape, device=DEVICE, dtype=torch.float32) + shift).to(dtype)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


def _leaves64(*ts):
    return [t.detach().double().requires_grad_(True) if t is not None else None for t in ts]


def _same(dtype, scale=1.0):
    return (dtype, dtype, scale)


# --- bias + GeLU (chapter 1) ------------------------------------------------------------------


@case("bias_gelu_impl")
def _bias_gelu_impl(dtype):
    y, b = _randn(3, 2, 37, dtype=dtype, scale=2.0), _randn(37, dtype=dtype)
    g = _randn(3, 2, 37, dtype=dtype)

    def run():
        yl, bl = _leaves(y, b)
        out = fusedlib.bias_gelu_impl(yl, bl)
        out.backward(g)
        return {"out": out, "dy": yl.grad, "db": bl.grad}

    def reference():
        y64, b64 = _leaves64(y, b)
        out = unfused.bias_gelu(b64, y64)
        out.backward(g.double())
        return {"out": out, "dy": y64.grad, "db": b64.grad}

    # the bias gradient sums 6 rows: sqrt(rows) as in tests/test_bias_gelu.py
    return run, reference, {"out": _same(dtype), "dy": _same(dtype), "db": _same(dtype, 6**0.5)}


@case("fused_dense_gelu_dense")
def _fused_dense_gelu_dense(dtype):
    x, w1, b1 = _randn(3, 2, 16, dtype=dtype), _randn(24, 16, dtype=dtype, scale=0.25), _randn(24, dtype=dtype)
    w2, b2, g = _randn(8, 24, dtype=dtype, scale=0.2), _randn(8, dtype=dtype), _randn(3, 2, 8, dtype=dtype)
    names = ("dx", "dw1", "db1", "dw2", "db2")

    def run():
        leaves = _leaves(x, w1, b1, w2, b2)
        out = fusedlib.fused_dense_gelu_dense(*leaves)
        out.backward(g)
        return {"out": out, **{n: t.grad for n, t in zip(names, leaves)}}

    def reference():
        leaves = _leaves64(x, w1, b1, w2, b2)
        out = F.linear(unfused.bias_gelu(leaves[2], F.linear(leaves[0], leaves[1])), leaves[3], leaves[4])
        out.backward(g.double())
        return {"out": out, **{n: t.grad for n, t in zip(names, leaves)}}

    # z and y rounded to the input dtype before the next GEMM: 3x one rounding (tests/test_fused_dense.py);
    # the weight and bias gradients sum 6 rows: sqrt(6) more
    rows = 6 ** 0.5
    return run, reference, {"out": _same(dtype, 3), "dx": _same(dtype, 3), "dw1": _same(dtype, 3 * rows),
                            "db1": _same(dtype, 3 * rows), "dw2": _same(dtype, 3 * rows), "db2": _same(dtype, 3 * rows)}


@case("bias_gelu, bias_gelu_back")
def _bias_gelu_plain(dtype):
    y, b, g = _randn(5, 19, dtype=dtype, scale=2.0), _randn(19, dtype=dtype), _randn(5, 19, dtype=dtype)

    def run():
        return {"out": gelu_mod.bias_gelu(b, y), "dy": gelu_mod.bias_gelu_back(g, b, y)}

    def reference():
        y64, b64 = y.double(), b.double()
        return {"out": unfused.bias_gelu(b64, y64), "dy": unfused.bias_gelu_back(g.double(), b64, y64)}

    return run, reference, {"out": _same(dtype), "dy": _same(dtype)}


# --- bias + dropout + residual add (chapter 2) ------------------------------------------------

P_DROP = 0.3


def _bda_inputs(dtype):
    return (_randn(3, 2, 33, dtype=dtype), _randn(33, dtype=dtype), _randn(3, 2, 33, dtype=dtype),
            _randn(3, 2, 33, dtype=dtype))


def _bda_run(fn, x, b, r, g, prob=P_DROP):
    xl, bl, rl = _leaves(x, b, r)
    out = fn((xl, bl), rl, prob)
    out.backward(g)
    return {"out": out, "dx": xl.grad, "db": bl.grad, "dr": rl.grad}


def _bda_reference(x, b, r, g, keep, p):
    x64, b64, r64 = _leaves64(x, b, r)
    out = unfused.bias_dropout_add_masked(x64, b64, r64, keep, p)
    out.backward(g.double())
    return {"out": out, "dx": x64.grad, "db": b64.grad, "dr": r64.grad}


def _bda_expected(dtype):
    # the bias gradient sums 6 rows: sqrt(rows), as in tests/test_bias_dropout_add.py
    return {"out": _same(dtype), "dx": _same(dtype), "db": _same(dtype, 6**0.5), "dr": _same(dtype)}


@case("bias_dropout_add_fused_train")
def _bda_fused_train(dtype):
    x, b, r, g = _bda_inputs(dtype)

    def reference():
        torch.manual_seed(SEED)  # the Philox key the op drew after the same seed (outside the contexts)
        keep = dropout_mask(philox_seed(DEVICE), 6, 33, P_DROP).view(x.shape)
        return _bda_reference(x, b, r, g, keep, drop_threshold(P_DROP) / 2**KEEP_BITS)

    return lambda: _bda_run(bias_dropout_add_fused_train, x, b, r, g), reference, _bda_expected(dtype)


@case("get_bias_dropout_add(training=False, fused=True)")
def _bda_fused_inference_with_grad(dtype):
    x, b, r, g = _bda_inputs(dtype)
    keep = torch.ones(x.shape, dtype=torch.bool, device=DEVICE)
    return (lambda: _bda_run(get_bias_dropout_add(False, True), x, b, r, g),
            lambda: _bda_reference(x, b, r, g, keep, 0.0), _bda_expected(dtype))


@case("bias_dropout_add_fused_inference in place")
def _bda_fused_inference_in_place(dtype):
    x, b, r, _ = _bda_inputs(dtype)

    def run():
        xc = x.clone()
        out = bias_dropout_add_fused_inference((xc, b), r, P_DROP)
        assert out is xc
        return {"out": out}

    return run, lambda: {"out": x.double() + b.double() + r.double()}, {"out": _same(dtype)}


@case("bias_dropout_add_unfused(training=True)", dtypes=(torch.float32,))  # eager: computed in x's dtype
def _bda_unfused_train(dtype):
    x, b, r, g = _bda_inputs(dtype)

    def reference():
        # torch's dropout draws its mask with bernoulli_ on a tensor of x's shape and dtype:
        # the same draw after the same seed gives the mask of the op's run
        torch.manual_seed(SEED)
        keep = F.dropout(torch.ones(x.shape, dtype=dtype, device=DEVICE), P_DROP, training=True) != 0
        return _bda_reference(x, b, r, g, keep, P_DROP)

    return lambda: _bda_run(bias_dropout_add_unfused(True), x, b, r, g), reference, _bda_expected(dtype)


# --- gated linear units and squared ReLU (chapter 3) ------------------------------------------

H = 19  # GLU output width: odd, below one tile


def _glu_inputs(dtype, rows_shape=(3, 2)):
    y = _randn(*rows_shape, 2 * H, dtype=dtype, scale=2.0)
    return y, _randn(2 * H, dtype=dtype), _randn(*rows_shape, H, dtype=dtype)


def _glu_case(impl, ref_fn, with_bias, dtype):
    y, b, g = _glu_inputs(dtype)
    b = b if with_bias else None

    def run():
        yl, bl = _leaves(y, b)
        out = impl(yl, bl)
        out.backward(g)
        return {"out": out, "dy": yl.grad, **({"db": bl.grad} if with_bias else {})}

    def reference():
        y64, b64 = _leaves64(y, b)
        out = ref_fn(y64 + b64 if with_bias else y64)
        out.backward(g.double())
        return {"out": out, "dy": y64.grad, **({"db": b64.grad} if with_bias else {})}

    # dy: two roundings of products in float32 (scale 4, as tests/test_glu.py); db: 6 rows
    expected = {"out": _same(dtype), "dy": _same(dtype, 4.0 if dtype == torch.float32 else 1.0)}
    if with_bias:
        expected["db"] = _same(dtype, 6**0.5)
    return run, reference, expected


for _bias in (True, False):
    case(f"bias_swiglu_impl(bias={_bias})")(
        lambda dtype, _b=_bias: _glu_case(fusedlib.bias_swiglu_impl, unfused.swiglu, _b, dtype))
    case(f"bias_geglu_impl(bias={_bias})")(
        lambda dtype, _b=_bias: _glu_case(fusedlib.bias_geglu_impl, unfused.geglu, _b, dtype))


def _weighted_case(impl, ref_fn, dtype, in_cols):
    x = _randn(6, in_cols, dtype=dtype, scale=2.0)
    w = torch.rand(6, 1, device=DEVICE, dtype=torch.float32)  # router probabilities: float32
    g = _randn(6, H, dtype=dtype)

    def run():
        xl, wl = _leaves(x, w)
        out = impl(xl, wl)
        out.backward(g)
        return {"out": out, "dx": xl.grad, "dw": wl.grad}

    def reference():
        x64, w64 = _leaves64(x, w)
        out = ref_fn(x64) * w64
        out.backward(g.double())
        return {"out": out, "dx": x64.grad, "dw": w64.grad}

    # dweights sums h = 19 products: sqrt(h), as tests/test_glu.py
    return run, reference, {"out": _same(dtype), "dx": _same(dtype, 4.0 if dtype == torch.float32 else 1.0),
                            "dw": (torch.float32, torch.float32 if dtype == torch.float32 else dtype, H**0.5)}


case("weighted_bias_swiglu_impl")(lambda dtype: _weighted_case(
    lambda x, w: fusedlib.weighted_bias_swiglu_impl(x, None, w), unfused.swiglu, dtype, 2 * H))
case("weighted_squared_relu_impl")(lambda dtype: _weighted_case(
    fusedlib.weighted_squared_relu_impl, unfused.squared_relu, dtype, H))
case("weighted_squared_relu_impl(clamp_scale=1.5)")(lambda dtype: _weighted_case(
    lambda x, w: fusedlib.weighted_squared_relu_impl(x, w, 1.5),
    lambda x: (1.5 * torch.tanh(torch.relu(x) / 1.5)) ** 2, dtype, H))


@case("swiglu, geglu, squared ReLU: the plain functions")
def _glu_plain(dtype):
    y, b, g = _glu_inputs(dtype, (6,))
    w = torch.rand(6, 1, device=DEVICE, dtype=torch.float32)
    x = y[:, :H]

    def run():
        s, ge, sq = swiglu_mod, geglu_mod, sqrelu_mod
        dyw, dww = s.weighted_swiglu_back(g, y, w)
        dxr, dwr = sq.weighted_squared_relu_back(g, x, w)
        return {
            "swiglu": s.swiglu(y), "bias_swiglu": s.bias_swiglu(y, b), "weighted_swiglu": s.weighted_swiglu(y, w),
            "swiglu_back": s.swiglu_back(g, y), "bias_swiglu_back": s.bias_swiglu_back(g, y, b),
            "weighted_swiglu_back.dy": dyw, "weighted_swiglu_back.dw": dww,
            "geglu": ge.geglu(y), "bias_geglu": ge.bias_geglu(b, y), "geglu_back": ge.geglu_back(g, y),
            "bias_geglu_back": ge.bias_geglu_back(g, y, b),
            "weighted_squared_relu": sq.weighted_squared_relu(x, w),
            "weighted_squared_relu_back.dx": dxr, "weighted_squared_relu_back.dw": dwr,
        }

    def reference():
        u = unfused
        y64, b64, g64, w64, x64 = y.double(), b.double(), g.double(), w.double(), x.double()
        dyw, dww = u.weighted_swiglu_back(g64, y64, w64)
        dxr, dwr = u.weighted_squared_relu_back(g64, x64, w64)
        return {
            "swiglu": u.swiglu(y64), "bias_swiglu": u.bias_swiglu(y64, b64),
            "weighted_swiglu": u.weighted_swiglu(y64, w64), "swiglu_back": u.swiglu_back(g64, y64),
            "bias_swiglu_back": u.bias_swiglu_back(g64, y64, b64),
            "weighted_swiglu_back.dy": dyw, "weighted_swiglu_back.dw": dww,
            "geglu": u.geglu(y64), "bias_geglu": u.bias_geglu(b64, y64), "geglu_back": u.geglu_back(g64, y64),
            "bias_geglu_back": u.bias_geglu_back(g64, y64, b64),
            "weighted_squared_relu": u.weighted_squared_relu(x64, w64),
            "weighted_squared_relu_back.dx": dxr, "weighted_squared_relu_back.dw": dwr,
        }

    dy_scale = 4.0 if dtype == torch.float32 else 1.0
    expected = {k: _same(dtype, dy_scale) for k in ("swiglu", "bias_swiglu", "weighted_swiglu", "swiglu_back",
                                                     "bias_swiglu_back", "weighted_swiglu_back.dy", "geglu",
                                                     "bias_geglu", "geglu_back", "bias_geglu_back",
                                                     "weighted_squared_relu", "weighted_squared_relu_back.dx")}
    w_tol = torch.float32 if dtype == torch.float32 else dtype  # sums of dtype-rounded products
    expected["weighted_swiglu_back.dw"] = (torch.float32, w_tol, H**0.5)
    expected["weighted_squared_relu_back.dw"] = (torch.float32, w_tol, H**0.5)
    return run, reference, expected


# --- LayerNorm and RMSNorm (chapter 4) --------------------------------------------------------

HN = 37  # hidden size: odd


def _norm_inputs(dtype, layer=True, zero_centered=False):
    x = _randn(3, 2, HN, dtype=dtype, scale=2.0, shift=0.5)
    # gamma in [0.5, 1.5]: well away from 0, where the memory-efficient backward's x_hat =
    # (y - beta)/gamma loses accuracy as 1/|gamma| (chapter 4)
    gamma = 0.5 + torch.rand(HN, device=DEVICE, dtype=torch.float32)
    w = (gamma - 1 if zero_centered else gamma).to(dtype)
    b = _randn(HN, dtype=dtype) if layer else None
    return x, w, b, _randn(3, 2, HN, dtype=dtype)


def _norm_reference(x, w, b, dy, zero_centered=False):
    x64, w64, b64 = _leaves64(x, w, b)
    if b is not None:
        y = unfused.layer_norm(x64, w64, b64, EPS, zero_centered)
    else:
        y = unfused.rms_norm(x64, w64, EPS, zero_centered)
    y.backward(dy.double())
    return {"out": y, "dx": x64.grad, "dw": w64.grad, **({"db": b64.grad} if b is not None else {})}


def _norm_expected(dtype, layer, memory_efficient=False):
    # as tests/test_layer_norm.py: parameter gradients sum 6 rows (sqrt(rows)); the memory-
    # efficient backward recovers x_hat from the rounded y, divided by gamma >= 0.5: x2 on dx, x4 on dw
    dx_scale, dw_scale = (2.0, 4.0) if memory_efficient else (1.0, 1.0)
    e = {"out": _same(dtype), "dx": _same(dtype, dx_scale), "dw": _same(dtype, dw_scale * 6**0.5)}
    if layer:
        e["db"] = _same(dtype, 6**0.5)
    return e


for _layer in (True, False):
    for _me, _zc in ((False, False), (True, True)):
        def _fused_norm_case(dtype, layer=_layer, me=_me, zc=_zc):
            x, w, b, dy = _norm_inputs(dtype, layer, zc)

            def run():
                xl, wl, bl = _leaves(x, w, b)
                if layer:
                    y = fused_layer_norm(xl, wl, bl, EPS, zero_centered_gamma=zc, memory_efficient=me)
                else:
                    y = fused_rms_norm(xl, wl, EPS, zero_centered_gamma=zc, memory_efficient=me)
                y.backward(dy)
                return {"out": y, "dx": xl.grad, "dw": wl.grad, **({"db": bl.grad} if layer else {})}

            return run, lambda: _norm_reference(x, w, b, dy, zc), _norm_expected(dtype, layer, me)

        name = "fused_layer_norm" if _layer else "fused_rms_norm"
        case(f"{name}(memory_efficient={_me}, zero_centered_gamma={_zc})")(_fused_norm_case)


def _built_norm(cls, config, dtype, w, b):
    """The norm module built under the context, with the documented factory arguments, holding
    ``w`` (and ``b``, for LayerNorm)."""
    module = cls(config, HN, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        if b is not None:
            module.bias.copy_(b)
    return module


def _module_case(dtype, cls, normalization, with_residual=False):
    """The norm module built under the context; with_residual: through fusedlib.norm_with_residual,
    whose backward kernel adds the residual's gradient (x's gradient is then both)."""
    layer = normalization == "LayerNorm"
    x, w, b, dy = _norm_inputs(dtype, layer)
    dres = _randn(*x.shape, dtype=dtype)
    config = TransformerConfig(normalization=normalization)

    def run():
        module = _built_norm(cls, config, dtype, w, b)
        xl = _leaves(x)[0]
        if with_residual:
            y, residual = fusedlib.norm_with_residual(module, xl)
            torch.autograd.backward((y, residual), (dy, dres))
        else:
            y = module(xl)
            y.backward(dy)
        return {"out": y, "dx": xl.grad, "dw": module.weight.grad,
                **({"db": module.bias.grad} if layer else {})}

    def reference():
        r = _norm_reference(x, w, b, dy)
        return dict(r, dx=r["dx"] + dres.double()) if with_residual else r

    return run, reference, _norm_expected(dtype, layer)


for _cls, _normalization in ((FusedLayerNorm, "LayerNorm"), (FusedRMSNorm, "RMSNorm"), (FusedNorm, "RMSNorm")):
    case(f"{_cls.__name__}({_normalization})")(functools.partial(_module_case, cls=_cls, normalization=_normalization))
for _cls, _normalization in ((FusedLayerNorm, "LayerNorm"), (FusedRMSNorm, "RMSNorm")):
    case(f"norm_with_residual({_cls.__name__})")(
        functools.partial(_module_case, cls=_cls, normalization=_normalization, with_residual=True))


def _bda_norm_case(dtype, cls, normalization):
    """fusedlib.bias_dropout_add_norm with the module built under the context (dropout off, so
    the float64 reference needs no mask): h = residual + x + bias, y = norm(h)."""
    layer = normalization == "LayerNorm"
    x, w, b, dy = _norm_inputs(dtype, layer)
    r, dh = _randn(*x.shape, dtype=dtype), _randn(*x.shape, dtype=dtype)
    lb = _randn(x.shape[-1], dtype=dtype)
    config = TransformerConfig(normalization=normalization)

    def run():
        module = _built_norm(cls, config, dtype, w, b)
        xl, rl, lbl = _leaves(x, r, lb)
        y, h = fusedlib.bias_dropout_add_norm(module, (xl, lbl), rl, 0.0, True)
        torch.autograd.backward((y, h), (dy, dh))
        return {"out": y, "h": h, "dx": xl.grad, "dres": rl.grad, "dlb": lbl.grad, "dw": module.weight.grad,
                **({"db": module.bias.grad} if layer else {})}

    def reference():
        h64 = r.double() + x.double() + lb.double()
        ref = _norm_reference(h64.to(dtype), w, b, dy)  # the norm of h as stored
        dres = ref["dx"] + dh.double()
        return dict(ref, h=h64, dx=dres, dres=dres, dlb=dres.reshape(-1, HN).sum(0))

    e = _norm_expected(dtype, layer)
    return run, reference, dict(e, h=_same(dtype), dres=e["dx"], dlb=_same(dtype, 6**0.5))


for _cls, _normalization in ((FusedLayerNorm, "LayerNorm"), (FusedRMSNorm, "RMSNorm")):
    case(f"bias_dropout_add_norm({_cls.__name__})")(
        functools.partial(_bda_norm_case, cls=_cls, normalization=_normalization))


# --- the attention softmax (chapter 5) --------------------------------------------------------

B, NP, SQ, SK = 2, 3, 5, 7
ATT_SCALE = 0.7


def _softmax_case(dtype, fn, mask=None, causal=False, offset=None, shape=(B, NP, SQ, SK), window=None,
                  scale=ATT_SCALE):
    """fn(x_leaf, offset_leaf) -> p; the reference masks with `mask` (or-ed with causal/window)."""
    x = _randn(*shape, dtype=dtype, scale=3.0)
    g = _randn(*shape, dtype=dtype)
    full_mask = mask
    if window is not None:
        band = unfused.sliding_window_causal_mask(shape[-2], shape[-1], window, device=DEVICE)
        full_mask = band if full_mask is None else full_mask | band
    elif causal:
        band = unfused.causal_mask(shape[-2], shape[-1], device=DEVICE)
        full_mask = band if full_mask is None else full_mask | band
    trainable = isinstance(offset, torch.Tensor)

    def run():
        xl = _leaves(x)[0]
        ol = _leaves(offset)[0] if trainable else offset
        p = fn(xl, ol)
        p.backward(g)
        return {"p": p, "dx": xl.grad, **({"doffset": ol.grad} if trainable else {})}

    def reference():
        x64 = _leaves64(x)[0]
        o64 = _leaves64(offset)[0] if trainable else offset
        p = unfused.masked_softmax_reference(x64, full_mask, scale, o64)
        p.backward(g.double())
        return {"p": p, "dx": x64.grad, **({"doffset": o64.grad} if trainable else {})}

    # one rounding to dtype of a float32 result, in the kernels and in the torch path alike
    expected = {"p": _same(dtype), "dx": _same(dtype)}
    if trainable:  # the offset's gradient sums b·sq rows per head, as tests/test_softmax.py
        expected["doffset"] = (offset.dtype, torch.float32 if dtype == torch.float32 else dtype,
                               math.sqrt(B * SQ))
    return run, reference, expected


def _padding_mask():
    return torch.rand(B, 1, SQ, SK, device=DEVICE) < 0.3


case("ScaledUpperTriangMaskedSoftmax")(lambda dtype: _softmax_case(
    dtype, lambda x, _: ScaledUpperTriangMaskedSoftmax.apply(x, ATT_SCALE), causal=True, shape=(B * NP, SQ, SK)))
case("ScaledMaskedSoftmax")(lambda dtype: (lambda m: _softmax_case(
    dtype, lambda x, _: ScaledMaskedSoftmax.apply(x, m, ATT_SCALE), mask=m))(_padding_mask()))
case("ScaledSoftmax")(lambda dtype: _softmax_case(dtype, lambda x, _: ScaledSoftmax.apply(x, ATT_SCALE)))
case("SoftmaxOne(float offset)")(lambda dtype: _softmax_case(
    dtype, lambda x, o: SoftmaxOne(None, o)(x), offset=0.5, scale=1.0))
case("SoftmaxOne(learnable [np] offset)")(lambda dtype: _softmax_case(
    dtype, lambda x, o: SoftmaxOne(-1, o)(x), scale=1.0,
    offset=torch.nn.Parameter(torch.randn(NP, device=DEVICE, dtype=torch.float32))))
case("fused_scale_mask_softmax(causal, mask, float offset)")(lambda dtype: (lambda m: _softmax_case(
    dtype, lambda x, o: fused_scale_mask_softmax(x, m, ATT_SCALE, causal=True, softmax_offset=o),
    mask=m, causal=True, offset=-0.5))(_padding_mask()))



@case("fused_scale_mask_softmax_dropout / ScaledMaskedSoftmaxDropout(causal, mask, [np] offset)")
def _softmax_dropout(dtype):
    x, g = _randn(B, NP, SQ, SK, dtype=dtype, scale=3.0), _randn(B, NP, SQ, SK, dtype=dtype)
    m = _padding_mask()
    off = torch.nn.Parameter(torch.randn(NP, device=DEVICE, dtype=torch.float32))

    def run():
        xl, ol = _leaves(x, off)
        z = fused_scale_mask_softmax_dropout(xl, m, AttnMaskType.causal, ATT_SCALE, P_DROP, softmax_offset=ol)
        z.backward(g)
        return {"p": z, "dx": xl.grad, "doffset": ol.grad}

    def reference():
        torch.manual_seed(SEED)  # the Philox key the op drew after the same seed (outside the contexts)
        keep = softmax_dropout_mask(philox_seed(DEVICE), (B, NP, SQ, SK), P_DROP)
        x64, o64 = _leaves64(x, off)
        full_mask = m | unfused.causal_mask(SQ, SK, device=DEVICE)
        z = unfused.masked_softmax_dropout_reference(x64, full_mask, ATT_SCALE, keep,
                                                     drop_threshold(P_DROP) / 2**KEEP_BITS, o64)
        z.backward(g.double())
        return {"p": z, "dx": x64.grad, "doffset": o64.grad}

    # as the softmax cases, with every value scaled by 1/(1 - p') (absolute errors too)
    ks = 1.0 / (1.0 - P_DROP)
    return run, reference, {"p": _same(dtype, ks), "dx": _same(dtype, ks),
                            "doffset": (torch.float32, torch.float32 if dtype == torch.float32 else dtype,
                                        ks * math.sqrt(B * SQ))}


def _fsm(dtype, fused, mask_type, window=None):
    return FusedScaleMaskSoftmax(dtype == torch.float16, False, mask_type, fused, attention_mask_func, True,
                                 ATT_SCALE, window)


for _fused in (True, False):
    case(f"FusedScaleMaskSoftmax(fusion={_fused}, causal, mask, [np] offset)")(
        lambda dtype, f=_fused: (lambda m: _softmax_case(
            dtype, lambda x, o: _fsm(dtype, f, AttnMaskType.causal)(x, m, o), mask=m, causal=True,
            offset=torch.nn.Parameter(torch.randn(NP, device=DEVICE, dtype=torch.float32))))(_padding_mask()))
    case(f"FusedScaleMaskSoftmax(fusion={_fused}, sliding window)")(
        lambda dtype, f=_fused: _softmax_case(
            dtype, lambda x, _: _fsm(dtype, f, AttnMaskType.no_mask, (2, 0))(x, None), window=(2, 0)))


@case("get_default_causal_mask, get_sliding_window_causal_mask", dtypes=(torch.bool,))
def _mask_builders(dtype):
    def run():
        return {"causal": get_default_causal_mask(SQ, SK), "window": get_sliding_window_causal_mask(SQ, SK, (2, 1))}

    def reference():
        return {"causal": unfused.causal_mask(SQ, SK, device=DEVICE),
                "window": unfused.sliding_window_causal_mask(SQ, SK, (2, 1), device=DEVICE)}

    # documented default device: CUDA when present, else the CPU (= DEVICE), never torch's default
    return run, reference, {"causal": (torch.bool, None, 1.0), "window": (torch.bool, None, 1.0)}


# --- vocab-parallel cross entropy (chapter 6) -------------------------------------------------

VOCAB = 37


def _ce_case(path, label_smoothing, dtype):
    x = _randn(3, 2, VOCAB, dtype=dtype, scale=3.0)
    t = torch.randint(0, VOCAB, (3, 2), device=DEVICE)
    t[0, 0] = -100  # one ignored row
    g = torch.randn(3, 2, device=DEVICE, dtype=torch.float32)  # the loss is float32

    def run():
        xl = _leaves(x)[0]
        if path == "fused":
            loss = fused_vocab_parallel_cross_entropy(xl, t, label_smoothing=label_smoothing)
        else:
            loss = vocab_parallel_cross_entropy(xl, t, label_smoothing)
        loss.backward(g)
        return {"loss": loss, "dx": xl.grad}

    def reference():
        x64 = x.double()
        return {"loss": unfused.cross_entropy(x64, t, label_smoothing),
                "dx": unfused.cross_entropy_grad(x64, t, g.double(), label_smoothing)}

    # the loss is computed in float32 from logits exact in float64; a sum over V terms: log V,
    # as tests/test_cross_entropy.py
    return run, reference, {"loss": (torch.float32, torch.float32, math.log(VOCAB)), "dx": _same(dtype)}


for _path in ("unfused", "fused"):
    for _ls in (0.0, 0.1):
        name = "vocab_parallel_cross_entropy" if _path == "unfused" else "fused_vocab_parallel_cross_entropy"
        case(f"{name}(label_smoothing={_ls})")(lambda dtype, p=_path, s=_ls: _ce_case(p, s, dtype))


@case("parallel.demo.make_global_inputs", dtypes=(torch.float32,))
def _global_inputs(dtype):
    def run():
        logits, target, grad = make_global_inputs(4, VOCAB, dtype, 7, DEVICE, n_ignored=1)
        return {"logits": logits, "target": target, "grad": grad}

    def reference():
        return run()  # its values are its seed's: the check is that the contexts change nothing

    return run, reference, {"logits": _same(dtype), "target": (torch.int64, None, 1.0),
                            "grad": (torch.float64, torch.float64, 1.0)}


# --- rotary position embeddings (chapter 7) ---------------------------------------------------


@case("RotaryEmbedding, apply_rotary_pos_emb(apply_rope_fusion=True), fused_apply_rotary_pos_emb")
def _rope(dtype):
    t, g = _randn(3, 2, 2, 40, dtype=dtype, scale=2.0), _randn(3, 2, 2, 40, dtype=dtype)
    config = SimpleNamespace(apply_rope_fusion=True, rotary_interleaved=False)

    def run():
        freqs = RotaryEmbedding(40, 0.6, device=DEVICE)(3)  # [3, 1, 1, 24] float32, made in the context
        tl = _leaves(t)[0]
        out = apply_rotary_pos_emb(tl, freqs, config)
        out.backward(g)
        return {"freqs": freqs, "out": out, "dt": tl.grad,
                "fused(per-sample, interleaved)": fused_apply_rotary_pos_emb(t, freqs.expand(3, 2, 1, 24),
                                                                             interleaved=True)}

    def reference():
        i = torch.arange(12, device=DEVICE, dtype=torch.float64)
        angles = torch.arange(3, device=DEVICE, dtype=torch.float64)[:, None] / 10000.0 ** (2 * i / 24)
        freqs = torch.cat((angles, angles), -1)[:, None, None, :]  # [3, 1, 1, 24] float64
        t64 = _leaves64(t)[0]
        out = unfused.apply_rotary_pos_emb_bshd(t64, freqs)
        out.backward(g.double())
        return {"freqs": freqs, "out": out, "dt": t64.grad,
                "fused(per-sample, interleaved)": unfused.apply_rotary_pos_emb_bshd(t.double(), freqs, True)}

    expected = {"freqs": (torch.float32, torch.float32, 1.0), "out": _same(dtype), "dt": _same(dtype),
                "fused(per-sample, interleaved)": _same(dtype)}
    return run, reference, expected


# --- utils --------------------------------------------------------------------------------------


@case("make_viewless_tensor")
def _viewless(dtype):
    base, g = _randn(4, 6, dtype=dtype), _randn(6, 4, dtype=dtype)

    def run():
        bl = _leaves(base)[0]
        view = bl.t()
        out = make_viewless_tensor(view, True, True)
        assert out._base is None
        (out * 2).backward(g)
        return {"out": out, "dbase": bl.grad}

    def reference():
        b64 = _leaves64(base)[0]
        (b64.t() * 2).backward(g.double())
        return {"out": b64.t(), "dbase": b64.grad}

    return run, reference, {"out": _same(dtype), "dbase": _same(dtype)}


# --- the unfused references, which users call too (float32: they compute in the input's dtype) --


@case("unfused: GeLU", dtypes=(torch.float32,))
def _unfused_gelu(dtype):
    y, b, g = _randn(5, 19, dtype=dtype, scale=2.0), _randn(19, dtype=dtype), _randn(5, 19, dtype=dtype)

    def compute(y, b, g):
        yl, bl = _leaves(y, b)
        out = unfused.bias_gelu(bl, yl)
        out.backward(g)
        return {"bias_gelu": out, "dy": yl.grad, "db": bl.grad, "gelu_tanh": unfused.gelu_tanh(y),
                "gelu_tanh_grad": unfused.gelu_tanh_grad(y), "gelu_erf": unfused.gelu_erf(y),
                "gelu_erf_grad": unfused.gelu_erf_grad(y), "bias_gelu_back": unfused.bias_gelu_back(g, b, y)}

    expected = {k: _same(dtype) for k in ("bias_gelu", "dy", "gelu_tanh", "gelu_tanh_grad", "gelu_erf",
                                          "gelu_erf_grad", "bias_gelu_back")}
    expected["db"] = _same(dtype, 5**0.5)
    return lambda: compute(y, b, g), lambda: compute(y.double(), b.double(), g.double()), expected


@case("unfused: cross entropy, bias-dropout-add, GLUs", dtypes=(torch.float32,))
def _unfused_misc(dtype):
    x = _randn(4, VOCAB, dtype=dtype, scale=3.0)
    t = torch.randint(0, VOCAB, (4,), device=DEVICE)
    gl = torch.randn(4, device=DEVICE, dtype=dtype)
    y, b, g = _glu_inputs(dtype, (4,))
    r = _randn(4, 2 * H, dtype=dtype)
    keep = torch.rand(4, 2 * H, device=DEVICE) < 0.7

    def compute(x, gl, y, b, g, r):
        xl = _leaves(x)[0]
        loss = unfused.cross_entropy(xl, t, 0.1)
        loss.backward(gl)
        return {
            "cross_entropy": loss, "cross_entropy.dx": xl.grad,
            "cross_entropy_grad": unfused.cross_entropy_grad(x, t, gl, 0.1),
            # a copy: without grads in eval mode it adds in place, into its x
            "bias_dropout_add(eval)": unfused.bias_dropout_add((y.clone(), b), r, 0.3, False),
            "bias_dropout_add_masked": unfused.bias_dropout_add_masked(y, b, r, keep, 0.3),
            "silu_grad": unfused.silu_grad(y), "bias_swiglu_back": unfused.bias_swiglu_back(g, y, b),
            "bias_geglu_back": unfused.bias_geglu_back(g, y, b),
        }

    expected = {k: _same(dtype) for k in ("cross_entropy.dx", "cross_entropy_grad", "bias_dropout_add(eval)",
                                          "bias_dropout_add_masked", "silu_grad", "bias_swiglu_back",
                                          "bias_geglu_back")}
    expected["cross_entropy"] = _same(dtype, math.log(VOCAB))
    return (lambda: compute(x, gl, y, b, g, r),
            lambda: compute(*(v.double() for v in (x, gl, y, b, g, r))), expected)


@case("unfused: norms", dtypes=(torch.float32,))
def _unfused_norms(dtype):
    x, w, b, dy = _norm_inputs(dtype)

    def compute(x, w, b, dy):
        xl, wl, bl = _leaves(x, w, b)
        y = unfused.layer_norm(xl, wl, bl, EPS)
        y.backward(dy)
        dx, dw, db = unfused.layer_norm_back(dy, x, w, EPS)
        rdx, rdw = unfused.rms_norm_back(dy, x, w, EPS, True)
        return {"layer_norm": y, "autograd.dx": xl.grad, "autograd.dw": wl.grad, "autograd.db": bl.grad,
                "layer_norm_back.dx": dx, "layer_norm_back.dw": dw, "layer_norm_back.db": db,
                "rms_norm": unfused.rms_norm(x, w, EPS, True), "rms_norm_back.dx": rdx, "rms_norm_back.dw": rdw}

    expected = {k: _same(dtype) for k in ("layer_norm", "autograd.dx", "layer_norm_back.dx", "rms_norm",
                                          "rms_norm_back.dx")}
    expected.update({k: _same(dtype, 6**0.5) for k in ("autograd.dw", "autograd.db", "layer_norm_back.dw",
                                                       "layer_norm_back.db", "rms_norm_back.dw")})
    return (lambda: compute(x, w, b, dy), lambda: compute(*(v.double() for v in (x, w, b, dy))), expected)


@case("unfused: softmax and masks", dtypes=(torch.float32,))
def _unfused_softmax(dtype):
    x, g = _randn(B, NP, SQ, SK, dtype=dtype, scale=3.0), _randn(B, NP, SQ, SK, dtype=dtype)
    pad = _padding_mask()

    def compute(x, g):
        causal = unfused.causal_mask(SQ, SK, device=x.device)
        window = unfused.sliding_window_causal_mask(SQ, SK, (2, 1), device=x.device)
        xl = _leaves(x)[0]
        p = unfused.scale_mask_softmax(xl, pad | causal, ATT_SCALE, True, None)
        p.backward(g)
        return {
            "causal_mask": causal, "sliding_window_causal_mask": window,
            "attention_mask_func": unfused.attention_mask_func(x, pad),
            "scale_mask_softmax": p, "scale_mask_softmax.dx": xl.grad,
            "softmax_one(float)": unfused.softmax_one(x, 0.5),
            "masked_softmax_reference": unfused.masked_softmax_reference(x, window, ATT_SCALE, -0.5),
            "softmax_backward": unfused.softmax_backward(g, p.detach(), ATT_SCALE),
        }

    expected = {k: _same(dtype) for k in ("attention_mask_func", "scale_mask_softmax", "scale_mask_softmax.dx",
                                          "softmax_one(float)", "masked_softmax_reference", "softmax_backward")}
    expected.update({"causal_mask": (torch.bool, None, 1.0), "sliding_window_causal_mask": (torch.bool, None, 1.0)})
    return lambda: compute(x, g), lambda: compute(x.double(), g.double()), expected


@case("flash_attention(causal, key padding, GQA, sinks, dropout)")
def _flash_attention(dtype):
    from fusedlib.kernels.flash_attention import flash_attn_dropout_mask

    hq, hkv, d = NP, 1, 16
    q, k, v = (_randn(B, s, h, d, dtype=dtype, scale=0.5) for s, h in ((SQ, hq), (SK, hkv), (SK, hkv)))
    g = _randn(B, SQ, hq, d, dtype=dtype)
    pad = torch.rand(B, SK, device=DEVICE) < 0.3
    sinks = torch.nn.Parameter(torch.randn(hq, device=DEVICE, dtype=torch.float32))

    def run():
        ql, kl, vl, sl = _leaves(q, k, v, sinks)
        o = fusedlib.flash_attention(ql, kl, vl, causal=True, attention_mask=pad, sinks=sl, dropout_p=P_DROP)
        o.backward(g)
        return {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "dsinks": sl.grad}

    def reference():
        torch.manual_seed(SEED)  # the Philox key the op drew after the same seed (outside the contexts)
        keep = flash_attn_dropout_mask(philox_seed(DEVICE), (B, hq, SQ, SK), P_DROP)
        q64, k64, v64, s64 = _leaves64(q, k, v, sinks)
        o = unfused.attention_reference(q64, k64, v64, causal=True, attention_mask=pad, sinks=s64,
                                        dropout_p=drop_threshold(P_DROP) / 2**KEEP_BITS, dropout_mask=keep)
        o.backward(g.double())
        return {"o": o, "dq": q64.grad, "dk": k64.grad, "dv": v64.grad, "dsinks": s64.grad}

    # values scaled by 1/(1 - p'); P and dS are rounded to the dtype before their products (one
    # more rounding than the softmax's, of terms summing to a few times the output): 4x; dk and dv
    # sum over the hq/hkv = NP query heads too, dsinks over the b·sq rows (sqrt of the terms)
    ks = 4.0 / (1.0 - P_DROP)
    return run, reference, {"o": _same(dtype, ks), "dq": _same(dtype, ks), "dk": _same(dtype, ks * NP),
                            "dv": _same(dtype, ks * NP),
                            "dsinks": (torch.float32, torch.float32 if dtype == torch.float32 else dtype,
                                       ks * math.sqrt(B * SQ))}


# ---------------------------------------------------------------------------------------------
# The test of every case under every context
# ---------------------------------------------------------------------------------------------

PARAMS = [pytest.param(name, dtype, id=f"{name}-{str(dtype).replace('torch.', '')}")
          for name, (_, dtypes) in CASES.items() for dtype in dtypes]


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("name, dtype", PARAMS)
def test_entry_point_under_default_device_and_dtype(context, name, dtype):
    run, reference, expected = CASES[name][0](dtype)  # inputs: on DEVICE, outside the context
    torch.manual_seed(SEED)
    baseline = run()  # no context
    with CONTEXTS[context]():
        torch.manual_seed(SEED)
        got = run()
    ref = reference()
    assert set(got) == set(expected) == set(ref), (sorted(got), sorted(expected), sorted(ref))
    for key, (documented_dtype, tol_dtype, scale) in expected.items():
        t = got[key]
        assert t.device == INPUT_DEVICE, f"{key} is on {t.device}, its input on {INPUT_DEVICE}"
        assert t.dtype == documented_dtype, f"{key} has dtype {t.dtype}, documented {documented_dtype}"
        # bit for bit what the same call gives without the context: nothing computed in another dtype
        assert torch.equal(t, baseline[key]), f"{key} differs from its value outside the context"
        if tol_dtype is None:  # bool / int outputs: exact
            assert torch.equal(t, ref[key].to(t.device)), key
        else:
            assert_close(t, ref[key], tol_dtype, scale)


def test_the_cases_cover_every_top_level_entry_point():
    covered = " ".join(CASES)
    skip = ("runtime", "jit", "checks", "unfused", "utils", "parallel",  # modules
            "AttnMaskType", "TransformerConfig", "VocabUtility", "count_collectives")  # allocate nothing
    for name in fusedlib.__all__:
        # autograd Functions are reached through their entry points (GeLUFunction: bias_gelu_impl)
        if name not in skip and not name.endswith("Function"):
            assert name in covered, f"no case runs fusedlib.{name}"


# ---------------------------------------------------------------------------------------------
# Modules follow torch's defaults where they are documented to (PyTorch's factory arguments)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, normalization", [(FusedLayerNorm, "LayerNorm"), (FusedRMSNorm, "RMSNorm")])
def test_norm_module_parameters_follow_their_factory_arguments(cls, normalization):
    config = TransformerConfig(normalization=normalization)
    with default_device(CONTEXT_DEVICE):
        m = cls(config, 8)  # no device: torch's default device, as torch.nn.LayerNorm
        assert m.weight.device.type == CONTEXT_DEVICE
        m = cls(config, 8, device=DEVICE, dtype=torch.float16)
        assert m.weight.device == INPUT_DEVICE and m.weight.dtype == torch.float16
    with default_dtype(torch.float64):
        assert cls(config, 8).weight.dtype == torch.float64  # no dtype: torch's default dtype
        m = cls(config, 8, device=DEVICE, dtype=torch.float32)
        assert m.weight.dtype == torch.float32
        x = torch.randn(2, 8, device=DEVICE, dtype=torch.float32)
        assert m(x).dtype == torch.float32
    if normalization == "LayerNorm":
        assert m.bias.dtype == torch.float32
    m = FusedNorm(config, 8, device=DEVICE, dtype=torch.float16)
    assert type(m) is cls and m.weight.dtype == torch.float16


# ---------------------------------------------------------------------------------------------
# Several processes (gloo on CPU): the tensor-parallel paths under the contexts
# ---------------------------------------------------------------------------------------------


def _tp_worker(rank: int, world_size: int, device: torch.device, context: str) -> dict:
    full, target, grad = make_global_inputs(5, 9 * world_size, torch.float32, 11, device, n_ignored=1)  # V/p odd
    out = {}
    for path in ("unfused", "fused"):
        for ls in (0.0, 0.1):
            x = shard(full, rank, world_size).requires_grad_(True)
            with CONTEXTS[context]():
                if path == "fused":
                    loss = fused_vocab_parallel_cross_entropy(x, target, label_smoothing=ls)
                else:
                    loss = vocab_parallel_cross_entropy(x, target, ls)
                loss.backward(grad.to(loss.dtype))
            out[(path, ls)] = (loss.detach(), x.grad)
    return {"full": full, "target": target, "grad": grad, "out": out}


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_tensor_parallel_gloo_under_the_contexts(context):
    world_size = 2
    results = run_tp(_tp_worker, world_size, context)
    full, target, grad = results[0]["full"], results[0]["target"], results[0]["grad"]
    for (path, ls), _ in results[0]["out"].items():
        x64 = full.double()
        ref_loss = unfused.cross_entropy(x64, target, ls)
        ref_grad = unfused.cross_entropy_grad(x64, target, grad, ls)
        for rank, res in enumerate(results):
            loss, dx = res["out"][(path, ls)]
            assert loss.device == full.device and loss.dtype == torch.float32
            assert dx.device == full.device and dx.dtype == torch.float32
            assert_close(loss, ref_loss, torch.float32, scale=math.log(full.shape[-1]))
            assert_close(dx, shard(ref_grad, rank, world_size), torch.float32)


# ---------------------------------------------------------------------------------------------
# The source check: every torch allocation in fusedlib names its device and its dtype
# ---------------------------------------------------------------------------------------------

#: torch functions that allocate a new tensor (or, Generator, a generator) on the default device
#: unless given device=.
FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "asarray", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "normal", "empty_strided", "scalar_tensor",
    "empty_permuted", "tril_indices", "triu_indices", "Generator",
})
#: ... of which these never take the default dtype: int64 ids (torch documents it), a generator
NO_DTYPE_NEEDED = frozenset({"randint", "randperm", "tril_indices", "triu_indices", "Generator"})
#: legacy constructors: they always use the default device and name no dtype
LEGACY = frozenset({"Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                    "IntTensor", "BoolTensor", "ByteTensor"})

#: (file under fusedlib/, the call's source) -> why it may stay as it is. Keep it short.
ALLOWED = {
    ("bench/ops/masked_softmax.py",
     "torch.tensor([max(1, sk - i % 8 * sk // 8) for i in range(b)], device=device)"):
        "benchmark input built from Python ints: int64 whatever the default dtype",
    ("bench/ops/masked_softmax.py", "torch.arange(sk, device=device)"):
        "benchmark input, an int end: int64 whatever the default dtype",
    ("bench/ops/layer_norm.py", "torch.randn(h, device=device)"):
        "benchmark parameter, cast to the benchmark's dtype right after (.to(dtype))",
}


def _missing(node: ast.Call) -> list[str]:
    """What a call ``torch.<fn>(...)`` leaves to torch's defaults: [], ["device"], ["dtype"] or both."""
    fn = node.func.attr
    keywords = {k.arg for k in node.keywords}
    if (fn not in FACTORIES and fn not in LEGACY) or None in keywords:
        return []  # *_like (device and dtype from their tensor), non-allocating calls; **kwargs (none in fusedlib)
    missing = ["device"] if fn in LEGACY or "device" not in keywords else []
    if fn not in NO_DTYPE_NEEDED and (fn in LEGACY or "dtype" not in keywords):
        missing.append("dtype")
    return missing


def _violations() -> tuple[list[str], set]:
    bad, used = [], set()
    root = REPO / "fusedlib"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                continue
            missing = _missing(node)
            if not missing:
                continue
            src = ast.unparse(node)
            if (rel, src) in ALLOWED:
                used.add((rel, src))
                continue
            bad.append(f"fusedlib/{rel}:{node.lineno}: {src} names no {' and no '.join(missing)}")
    return bad, used


def test_every_allocation_names_its_device_and_dtype():
    bad, _ = _violations()
    assert not bad, ("allocations that follow torch's default device or dtype (a training script's "
                     "torch.set_default_device / set_default_dtype):\n" + "\n".join(bad))


def test_the_allowlist_has_no_stale_entries():
    _, used = _violations()
    assert used == set(ALLOWED), f"entries matching no call: {sorted(set(ALLOWED) - used)}"


def test_the_source_check_flags_what_it_must():
    """The check itself can fail: each kind of call it must flag, and what it must let pass."""
    calls = {
        "torch.empty((), dtype=torch.bool, pin_memory=True)": ["device"],  # the pinned host flag
        "torch.zeros(3, device=d)": ["dtype"],
        "torch.tensor(0.5)": ["device", "dtype"],
        "torch.Tensor(3)": ["device", "dtype"],
        "torch.Tensor(3, device=d, dtype=t)": ["device", "dtype"],  # legacy: never acceptable
        "torch.Generator()": ["device"],
        "torch.randint(0, 5, (3,))": ["device"],
        "torch.randint(0, 5, (3,), device=d)": [],
        "torch.full((2,), 1.0, dtype=t, device=d)": [],
        "torch.zeros_like(x)": [],
        "torch.exp(x)": [],
    }
    for src, missing in calls.items():
        assert _missing(ast.parse(src).body[0].value) == missing, src
