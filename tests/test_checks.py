"""fusedlib.checks and the argument checks built on it: a Python int too large for a float
(``10**400``) is a ValueError naming the argument, in every API that takes a real number,
never float()'s or math.isfinite's bare OverflowError."""
from __future__ import annotations

import pytest
import torch

import fusedlib  # noqa: F401  (first)
from fusedlib import bias_dropout_add_fused_train, flash_attention, fused_layer_norm
from fusedlib.checks import check_tensor, nearest_float32, real_to_float
from fusedlib.fusions import _glu, fused_rope, fused_softmax
from fusedlib.fusions.fused_dense import fused_dense_gelu_dense
from fusedlib.train.loop import TrainConfig, sample
from fusedlib.transformer import TransformerConfig

from conftest import DEVICE  # noqa: I001

HUGE = 10 ** 400  # an int, and a real number, beyond a Python float's range


@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, 2.0**-130, 3.0e38, -7.25, 0.0])
def test_nearest_float32_is_what_a_float32_tensor_holds(value):
    # the number a float32 kernel argument holds: torch's own rounding of the value to float32
    expected = torch.tensor(value, dtype=torch.float64).to(torch.float32).item()
    got = nearest_float32(value)
    assert type(got) is float and got == expected
    assert nearest_float32(got) == got  # a float32 number stays itself


def test_real_to_float_converts_and_names_the_argument():
    assert real_to_float("x", 3, "a number") == 3.0 and type(real_to_float("x", 3, "a number")) is float
    assert real_to_float("x", 2.5, "a number") == 2.5
    with pytest.raises(ValueError, match=r"^width must be a number > 0, got an int too large for a float: 1000"):
        real_to_float("width", HUGE, "a number > 0")


def _tiny(*shape):
    return torch.randn(*shape, device=DEVICE)


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, **kw)


CALLS = {
    "flash_attention softmax_scale": ("softmax_scale", lambda v: flash_attention(
        _tiny(1, 4, 1, 8), _tiny(1, 4, 1, 8), _tiny(1, 4, 1, 8), softmax_scale=v)),
    "flash_attention dropout_p": ("dropout_p", lambda v: flash_attention(
        _tiny(1, 4, 1, 8), _tiny(1, 4, 1, 8), _tiny(1, 4, 1, 8), dropout_p=v)),
    "fused_layer_norm eps": ("eps", lambda v: fused_layer_norm(_tiny(2, 16), torch.ones(16, device=DEVICE),
                                                              torch.zeros(16, device=DEVICE), v)),
    "bias_dropout_add prob": ("prob", lambda v: bias_dropout_add_fused_train(
        (_tiny(2, 16), torch.zeros(16, device=DEVICE)), _tiny(2, 16), v)),
    "softmax scale": ("scale", lambda v: fused_softmax._check_scale(v)),
    "softmax dropout_p": ("dropout_p", lambda v: fused_softmax._check_dropout_p(v)),
    "rope mscale": ("mscale", lambda v: fused_rope._check_mscale(v)),
    "glu clamp_value": ("clamp_value", lambda v: _glu.check_clamp_value(v)),
    "TransformerConfig init_method_std": ("init_method_std", lambda v: _config(init_method_std=v)),
    "TransformerConfig embedding_init_method_std": ("embedding_init_method_std",
                                                    lambda v: _config(embedding_init_method_std=v)),
    "TransformerConfig activation_func_clamp_value": ("activation_func_clamp_value",
                                                      lambda v: _config(activation_func_clamp_value=v)),
    "TransformerConfig layernorm_epsilon": ("layernorm_epsilon", lambda v: _config(layernorm_epsilon=v)),
    "TransformerConfig softmax_scale": ("softmax_scale", lambda v: _config(softmax_scale=v)),
    "TrainConfig lr": ("lr", lambda v: TrainConfig(lr=v)),
    "sample temperature": ("temperature", lambda v: sample(torch.nn.Linear(1, 1), torch.tensor([1]), 1,
                                                               temperature=v)),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_an_int_beyond_a_float_is_a_value_error_naming_the_argument(case):
    name, call = CALLS[case]
    with pytest.raises(ValueError, match=rf"^{name} must be ") as err:
        call(HUGE)
    assert not isinstance(err.value, OverflowError)


def test_small_ints_are_still_accepted_where_a_real_number_is():
    q = _tiny(1, 3, 1, 4)
    torch.testing.assert_close(flash_attention(q, q, q, softmax_scale=1), flash_attention(q, q, q, softmax_scale=1.0))
    x, w, b = _tiny(2, 16), torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    torch.testing.assert_close(fused_layer_norm(x, w, b, 1), fused_layer_norm(x, w, b, 1.0))
    assert _glu.check_clamp_value(7) == 7.0 and fused_rope._check_mscale(2) == 2.0
    assert _config(init_method_std=0).init_method_std == 0 and TrainConfig(lr=1).lr == 1


def test_file_on_the_way(tmp_path):
    from fusedlib.checks import file_on_the_way

    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    assert file_on_the_way(tmp_path / "f" / "a" / "b") == tmp_path / "f"
    assert file_on_the_way(tmp_path / "f") is None and file_on_the_way(tmp_path / "f", include_self=True) == tmp_path / "f"
    assert file_on_the_way(tmp_path / "d" / "new") is None and file_on_the_way(str(tmp_path / "d"), include_self=True) is None


# ---------------------------------------------------------------------------------------------
# min_ndim is inclusive: one-dim inputs (each was a mutation
# no test caught)
# ---------------------------------------------------------------------------------------------


def test_check_tensor_min_ndim_takes_exactly_that_many_dims():
    x = torch.zeros(3)
    assert check_tensor("x", x, min_ndim=1) is x  # 1 dim is "at least 1"
    with pytest.raises(ValueError, match=r"x must have at least 1 dimension, got shape \(\)"):
        check_tensor("x", torch.zeros(()), min_ndim=1)


def test_check_tensor_messages_name_the_dims_and_dtypes_in_words():
    # one allowed dtype is named alone, several as a set; dims as "N-D"; "dimensions" plural
    with pytest.raises(TypeError, match=r"^mask must have dtype bool, got float32$"):
        check_tensor("mask", torch.zeros(2), dtypes=(torch.bool,))
    with pytest.raises(TypeError, match=r"^x must have dtype in \(float16, bfloat16\), got float32$"):
        check_tensor("x", torch.zeros(2), dtypes=(torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match=r"^bias must be 1-D, got shape \(1, 6\)$"):
        check_tensor("bias", torch.zeros(1, 6), ndim=1)
    with pytest.raises(ValueError, match=r"^x must be 2-D or 3-D, got shape \(4,\)$"):
        check_tensor("x", torch.zeros(4), ndim=(2, 3))
    with pytest.raises(ValueError, match=r"^x must have at least 2 dimensions, got shape \(4,\)$"):
        check_tensor("x", torch.zeros(4), min_ndim=2)


def test_a_one_dim_input_passes_the_ops_checks():
    # the ops check their input with min_ndim=1: a single token [K] is a valid input
    torch.manual_seed(0)
    x, w1, b1, w2 = (torch.randn(*s, device=DEVICE) for s in ((8,), (5, 8), (5,), (8, 5)))
    out = fused_dense_gelu_dense(x, w1, b1, w2, None)
    ref = torch.nn.functional.gelu(x.double() @ w1.double().t() + b1.double(), approximate="tanh") @ w2.double().t()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Devices, shapes and ids (each was a mutation no test caught)
# ---------------------------------------------------------------------------------------------


def test_a_tensor_on_another_device_is_named_by_the_fast_and_the_full_check():
    """A meta tensor (a device no kernel runs on, and the one other device a CPU-only machine
    has) beside a kernel-device tensor: the fast path says no, the full check names both."""
    from fusedlib.checks import check_same_device, on_one_kernel_device

    x, m = torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 3, device="meta")
    assert on_one_kernel_device(x, x) and not on_one_kernel_device(x, m) and not on_one_kernel_device(m, m)
    with pytest.raises(ValueError, match=rf"^all tensors must be on one device, got x on {x.device}, w on meta$"):
        check_same_device(x=x, w=m, b=None)
    with pytest.raises(ValueError, match=r"fusedlib kernels run on 'cuda' or 'cpu' tensors, got meta"):
        check_same_device(x=m, w=m)
    assert check_same_device(x=x, w=None) == x.device


def test_an_op_names_an_argument_on_another_device():
    x, w = torch.randn(4, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        fused_layer_norm(x, w.to("meta"), torch.zeros(8, device=DEVICE), 1e-5)


def test_check_tensor_shape_takes_exactly_that_many_dims():
    assert check_tensor("f", torch.zeros(4, 1, 6), shape=(None, 1, 6)).shape == (4, 1, 6)
    with pytest.raises(ValueError, match=r"^f must have shape \[\*, 1, 6\], got \[4, 1, 6, 2\]$"):
        check_tensor("f", torch.zeros(4, 1, 6, 2), shape=(None, 1, 6))
    with pytest.raises(ValueError, match=r"^f must have shape \[\*, 1, 6\], got \[1, 6\]$"):
        check_tensor("f", torch.zeros(1, 6), shape=(None, 1, 6))


def test_ids_must_lie_below_the_bound_and_at_or_above_zero():
    from fusedlib.checks import check_ids_below_on_cpu

    check_ids_below_on_cpu("ids", torch.tensor([0, 9]), 10, "vocab")
    check_ids_below_on_cpu("ids", torch.zeros(0, dtype=torch.long), 10, "vocab")
    for bad, lo, hi in (([0, 10], 0, 10), ([-1, 3], -1, 3)):
        with pytest.raises(ValueError, match=rf"^ids must lie in \[0, vocab = 10\), got values in \[{lo}, {hi}\]$"):
            check_ids_below_on_cpu("ids", torch.tensor(bad), 10, "vocab")


@pytest.mark.parametrize("window", [(True, -1), (4, False), (-2, 0), (0, -5), (1.0, 2), (1, 2, 3), "ab"])
def test_a_window_is_a_pair_of_ints_from_minus_one(window):
    """A bool is no int (True would read as a window of 1), -1 is the only negative (unbounded)."""
    from fusedlib.checks import check_window_size

    assert check_window_size((-1, 0)) == (-1, 0) and check_window_size(None) is None
    with pytest.raises(ValueError, match=r"window_size must be None or a pair \(left, right\) of ints >= -1"):
        check_window_size(window)
