"""The deterministic embedding weight gradient (fusedlib.kernels.embedding.embedding_backward)
against a float64 reference, its bits from call to call, its errors, and its use by
VocabParallelEmbedding under ``deterministic_mode``.

Tolerance: the kernel adds a row's k gradients in float32 (float64 for float64 input) and rounds
once to the output dtype, so |out - ref| <= k·u_acc·sum|g| + u_out·|ref| (u: unit roundoff,
2^-24 for float32 accumulation, 2^-53 for float64; u_out of the output dtype), the standard
bound for recursive summation (Higham, Accuracy and Stability of Numerical Algorithms, 4.2)
plus one rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from fusedlib.kernels import embedding as emb
from fusedlib.kernels.embedding import embedding_backward

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float64: 2.0 ** -53}


def _reference(ids, grad, v):
    h = grad.shape[-1]
    return torch.zeros(v, h, dtype=torch.float64, device=grad.device).index_add_(
        0, ids.reshape(-1).long(), grad.reshape(-1, h).double())


def _check(ids, grad, v, out_dtype=None):
    out = embedding_backward(ids, grad, v, out_dtype)
    assert out.shape == (v, grad.shape[-1]) and out.dtype == (out_dtype or grad.dtype)
    ref = _reference(ids, grad, v)
    h = grad.shape[-1]
    flat = ids.reshape(-1).long()
    k = torch.bincount(flat, minlength=v).double().to(grad.device)[:, None]  # terms per row
    abs_sum = torch.zeros(v, h, dtype=torch.float64, device=grad.device).index_add_(
        0, flat, grad.reshape(-1, h).double().abs())
    u_acc = 2.0 ** -53 if grad.dtype == torch.float64 else 2.0 ** -24
    tol = k * u_acc * abs_sum + UNIT[out.dtype] * ref.abs()
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item()} (tolerance there {tol[err.argmax() // h].max().item()})"
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v, shape, h", [(7, (3, 5), 33), (256, (4, 37), 130), (1, (9,), 5), (50, (1,), 1),
                                          (3, (2, 50), 1025), (1000, (6, 7), 64)])
def test_matches_float64_reference(dtype, v, shape, h):
    gen = torch.Generator().manual_seed(hash((v, shape, h)) % 2 ** 31)
    ids = torch.randint(0, v, shape, generator=gen).to(DEVICE)
    grad = torch.randn(*shape, h, generator=gen).to(DEVICE, dtype)
    out = _check(ids, grad, v)
    absent = torch.ones(v, dtype=torch.bool, device=DEVICE)
    absent[ids.reshape(-1)] = False
    assert (out[absent] == 0).all()  # ids that do not occur: zero rows


def test_one_long_run_and_int32_ids_and_strided_grad():
    """Every token the same id (one run of 300 rows, many BLOCK_R steps), int32 ids, a grad that
    is a transposed view, float32 sums rounded to bf16 on request."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((300,), 4, dtype=torch.int32).to(DEVICE)
    base = torch.randn(24, 300, generator=gen).to(DEVICE)
    grad = base.t()  # [300, 24], stride (1, 300): not unit column stride
    out = _check(ids, grad, 6, torch.bfloat16)
    assert (out[:4] == 0).all() and (out[5:] == 0).all()
    ids2 = torch.randint(0, 5, (2, 40), generator=gen).to(DEVICE)
    grad2 = torch.randn(2, 40, 80, generator=gen).to(DEVICE)[..., ::2]  # a column stride of 2
    _check(ids2, grad2, 5)


def test_same_bits_every_call():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (4, 33), generator=gen).to(DEVICE)
    grad = torch.randn(4, 33, 48, generator=gen).to(DEVICE, torch.bfloat16)
    first = embedding_backward(ids, grad, 9)
    assert all(torch.equal(first, embedding_backward(ids, grad, 9)) for _ in range(3))


def test_ids_outside_the_vocabulary_write_nothing():
    """The forward's lookup rejects them; here the kernel must not write outside the weight."""
    ids = torch.tensor([0, 2, -1, 3, 2, 99], device=DEVICE)
    grad = torch.ones(6, 4, device=DEVICE)
    out = embedding_backward(ids, grad, 3)
    assert out.tolist() == [[1.0] * 4, [0.0] * 4, [2.0] * 4]


def test_empty_inputs():
    assert embedding_backward(torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, 3, device=DEVICE),
                              4).eq(0).all()
    assert embedding_backward(torch.zeros(2, dtype=torch.long, device=DEVICE), torch.zeros(2, 0, device=DEVICE),
                              4).shape == (4, 0)


@pytest.mark.parametrize("ids, grad, v, match", [
    (torch.zeros(3), torch.zeros(3, 2), 4, "ids must be an int32 or int64 tensor"),
    (torch.zeros(3, dtype=torch.long), torch.zeros(4, 2), 4, r"grad must have ids' shape \[3\]"),
    (torch.zeros(3, dtype=torch.long), torch.zeros(3), 4, r"grad must have ids' shape \[3\]"),
    (torch.zeros(3, dtype=torch.long), torch.zeros(3, 2), 0, "num_embeddings must be an int >= 1"),
    (torch.zeros(3, dtype=torch.long), torch.zeros(3, 2), True, "num_embeddings must be an int >= 1"),
])
def test_bad_input(ids, grad, v, match):
    with pytest.raises(ValueError, match=match):
        embedding_backward(ids.to(DEVICE), grad.to(DEVICE), v)


@pytest.mark.parametrize("deterministic", [True, False])
def test_vocab_parallel_embedding_uses_it_in_deterministic_mode(deterministic, monkeypatch):
    """deterministic_mode routes the weight gradient through the kernel (counted), with the
    gradient F.embedding's backward gives; without it, and without grad, F.embedding alone."""
    from fusedlib.parallel import layers
    from fusedlib.transformer import TransformerConfig

    calls = []
    real = layers.embedding_backward
    monkeypatch.setattr(layers, "embedding_backward", lambda *a: calls.append(1) or real(*a))
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, deterministic_mode=deterministic)
    torch.manual_seed(0)
    layer = layers.VocabParallelEmbedding(11, 16, init_method=torch.nn.init.normal_, config=cfg).to(DEVICE)
    ids = torch.randint(0, 11, (3, 8), device=DEVICE)
    g = torch.randn(3, 8, 16, device=DEVICE)
    layer(ids).backward(g)
    weight = layer.weight.detach().clone().requires_grad_(True)
    F.embedding(ids, weight).backward(g)
    torch.testing.assert_close(layer.weight.grad, weight.grad, rtol=0, atol=8 * 2.0 ** -24 * g.abs().sum().item())
    assert len(calls) == (1 if deterministic else 0)
    with torch.no_grad():
        assert torch.equal(layer(ids), F.embedding(ids, layer.weight))
    assert len(calls) == (1 if deterministic else 0)


def test_interpreter_takes_one_program_per_run():
    """On the CPU the host finds the runs first (one program each); on CUDA a program per token."""
    if DEVICE.type != "cpu":
        pytest.skip("the CPU path")
    seen = []
    real = emb.launch
    emb.launch = lambda kernel, grid, *a, **k: seen.append(tuple(grid)) or real(kernel, grid, *a, **k)
    try:
        embedding_backward(torch.tensor([3, 1, 3, 3, 0]), torch.ones(5, 2), 4)
    finally:
        emb.launch = real
    assert seen == [(3, 1)]
