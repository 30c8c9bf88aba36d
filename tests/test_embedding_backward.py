"""The deterministic embedding weight gradient (fusedlib.kernels.embedding.embedding_backward)
against a float64 reference, its bits from call to call, its errors, and its use by
VocabParallelEmbedding under ``deterministic_mode``.

Two routes: the one-hot matrix product (V <= ONEHOT_MAX_VOCAB, 16- and 32-bit gradients) and
the sort; every test names the route it checks (``onehot=True`` / ``False``) or takes the
public function's choice.

Tolerance: the kernel adds a row's k gradients in float32 (float64 for float64 input) and rounds
once to the output dtype, so |out - ref| <= k·u_acc·sum|g| + u_out·|ref| (u: unit roundoff,
2^-24 for float32 accumulation, 2^-53 for float64; u_out of the output dtype), the standard
bound for recursive summation (Higham, Accuracy and Stability of Numerical Algorithms, 4.2)
plus one rounding. The one-hot route's sums are the tensor cores' float32 accumulations, which
NVIDIA does not document as rounding to nearest: with truncation each addition errs by up to
2^-23 (one ulp, not half), so that route's bound takes u_acc = 2^-23.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from fusedlib import runtime
from fusedlib.kernels import embedding as emb
from fusedlib.kernels.embedding import embedding_backward

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float64: 2.0 ** -53}


def _reference(ids, grad, v):
    h = grad.shape[-1]
    return torch.zeros(v, h, dtype=torch.float64, device=grad.device).index_add_(
        0, ids.reshape(-1).long(), grad.reshape(-1, h).double())


def _check(ids, grad, v, out_dtype=None, host_runs=None, onehot=False):
    """``host_runs`` None: the public function (its route); else the sort with the runs found
    by the host (the CPU's) or a program per position (a GPU's). ``onehot``: the product."""
    if onehot:
        out = emb._embedding_backward(ids, grad, v, out_dtype, host_runs=False, onehot=True)
    elif host_runs is None:
        out = embedding_backward(ids, grad, v, out_dtype)
    else:
        out = emb._embedding_backward(ids, grad, v, out_dtype, host_runs=host_runs, onehot=False)
    onehot = onehot or (host_runs is None and v <= emb.ONEHOT_MAX_VOCAB and grad.dtype != torch.float64)
    assert out.shape == (v, grad.shape[-1]) and out.dtype == (out_dtype or grad.dtype)
    ref = _reference(ids, grad, v)
    h = grad.shape[-1]
    flat = ids.reshape(-1).long()
    k = torch.bincount(flat, minlength=v).double().to(grad.device)[:, None]  # terms per row
    abs_sum = torch.zeros(v, h, dtype=torch.float64, device=grad.device).index_add_(
        0, flat, grad.reshape(-1, h).double().abs())
    u_acc = 2.0 ** -53 if grad.dtype == torch.float64 else 2.0 ** -23 if onehot else 2.0 ** -24
    tol = k * u_acc * abs_sum + UNIT[out.dtype] * ref.abs()
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item()} (tolerance there {tol[err.argmax() // h].max().item()})"
    return out


@pytest.mark.parametrize("route", ["public", "onehot", "sorted, other runs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v, shape, h", [(7, (3, 5), 33), (256, (4, 37), 130), (1, (9,), 5), (50, (1,), 1),
                                          (3, (2, 50), 1025), (300, (5, 31), 17), (1000, (6, 7), 64)])
def test_matches_float64_reference(dtype, v, shape, h, route):
    """Both routes at odd sizes (V, h not multiples of the tiles, one token, h = 1): the
    public function's choice, the one-hot product (16- and 32-bit gradients), and the sort
    with the runs found the other way than the device's own."""
    if route == "onehot" and dtype == torch.float64:
        return  # (the one-hot route refuses float64: test_onehot_route_refuses_float64)
    gen = torch.Generator().manual_seed(v * 1000 + h)
    ids = torch.randint(0, v, shape, generator=gen).to(DEVICE)
    grad = torch.randn(*shape, h, generator=gen).to(DEVICE, dtype)
    out = _check(ids, grad, v, None, None if route == "public" else not DEVICE.type == "cpu", route == "onehot")
    absent = torch.ones(v, dtype=torch.bool, device=DEVICE)
    absent[ids.reshape(-1)] = False
    assert (out[absent] == 0).all()  # ids that do not occur: zero rows


@pytest.mark.parametrize("host_runs", [True, False])
def test_long_runs_int32_ids_and_strided_grad(host_runs):
    """A run of 2,100 rows (66 pieces of BLOCK_R, three steps of BLOCK_K pieces in the second
    stage) beside short ones, int32 ids, a grad that is a transposed view, float32 sums rounded
    to bf16 on request; on both paths (the host finding the runs, or a program per position)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((2200,), 4, dtype=torch.int32)
    ids[torch.randperm(2200, generator=gen)[:100]] = torch.randint(0, 6, (100,), generator=gen, dtype=torch.int32)
    ids = ids.to(DEVICE)
    base = torch.randn(24, 2200, generator=gen).to(DEVICE)
    grad = base.t()  # [2200, 24], stride (1, 2200): not unit column stride
    _check(ids, grad, 6, torch.bfloat16, host_runs)
    ids2 = torch.randint(0, 5, (2, 40), generator=gen).to(DEVICE)
    grad2 = torch.randn(2, 40, 80, generator=gen).to(DEVICE)[..., ::2]  # a column stride of 2
    _check(ids2, grad2, 5, None, host_runs)


@pytest.mark.parametrize("onehot", [True, False])
def test_same_bits_every_call(onehot):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (4, 33), generator=gen).to(DEVICE)
    grad = torch.randn(4, 33, 48, generator=gen).to(DEVICE, torch.bfloat16)
    host = DEVICE.type == "cpu"
    first = emb._embedding_backward(ids, grad, 9, None, host_runs=host, onehot=onehot)
    assert all(torch.equal(first, emb._embedding_backward(ids, grad, 9, None, host_runs=host, onehot=onehot))
               for _ in range(3))


@pytest.mark.parametrize("host_runs", [True, False])
def test_equal_ids_are_added_in_the_tokens_order(host_runs):
    """The sort is stable: each id's rows are added in the tokens' order, so moving tokens of
    different ids past each other (each id's own tokens keeping their order) leaves the bits
    unchanged. (Values over 2^24 of dynamic range: another order rounds differently.)"""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 5, (100,), generator=gen)
    grad = torch.randn(100, 16, generator=gen) * 2.0 ** torch.randint(-12, 13, (100, 1), generator=gen)
    grouped = torch.argsort(ids, stable=True)  # each id's tokens together, in their order
    out = emb._embedding_backward(ids.to(DEVICE), grad.to(DEVICE), 5, None, host_runs=host_runs, onehot=False)
    out_grouped = emb._embedding_backward(ids[grouped].to(DEVICE), grad[grouped].to(DEVICE), 5, None,
                                          host_runs=host_runs, onehot=False)
    assert torch.equal(out, out_grouped)


@pytest.mark.parametrize("host_runs", [True, False])
def test_ids_outside_the_vocabulary_write_nothing(host_runs):
    """The forward's lookup rejects them; here the kernels must not write outside the weight
    (nor outside their buffer of pieces: many distinct bad ids)."""
    ids = torch.tensor([0, 2, -1, 3, 2, 99, -7, 5, 6, 7, 8, 9], device=DEVICE)
    grad = torch.ones(12, 4, device=DEVICE)
    # the weight gradient handed out as rows 1-3 of a buffer whose rows 0 and 4 hold a marker:
    # a write one row before or past the weight shows there (rather than as a damaged heap)
    buffer = torch.zeros(5, 4, device=DEVICE)
    buffer[0] = buffer[4] = 1234.0
    real_zeros = torch.zeros
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emb.torch, "zeros", lambda *shape, **kw: buffer[1:4] if tuple(shape) == (3, 4)
                   else real_zeros(*shape, **kw))
        out = emb._embedding_backward(ids, grad, 3, None, host_runs=host_runs, onehot=False)
    assert out.data_ptr() == buffer[1:4].data_ptr()
    assert out.tolist() == [[1.0] * 4, [0.0] * 4, [2.0] * 4]
    assert buffer[0].tolist() == [1234.0] * 4 and buffer[4].tolist() == [1234.0] * 4


@pytest.mark.parametrize("host_runs", [True, False])
def test_a_run_one_row_past_a_whole_step_of_pieces(host_runs):
    """A run of 32 * 32 + 1 = 1,025 rows: 32 whole pieces (one step of BLOCK_K pieces in the
    second stage), then a piece of one row, which the second step adds too."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.cat([torch.full((1025,), 1), torch.tensor([0, 2, 0])])
    ids = ids[torch.randperm(1028, generator=gen)].to(DEVICE)
    grad = torch.randn(1028, 8, generator=gen).to(DEVICE)
    _check(ids, grad, 3, None, host_runs)


@pytest.mark.parametrize("host_runs", [True, False])
def test_distinct_negative_ids_leave_the_rows_of_valid_ids_whole(host_runs):
    """Negative ids, like ids past V, are one run that is never written: more distinct negative
    ids than V + 1 (they sort before every valid id) still leave each valid id its own run."""
    ids = torch.tensor([-1, 0, -2, 1, -3, 0, -4], device=DEVICE)
    grad = torch.arange(1.0, 8.0, device=DEVICE)[:, None].expand(7, 3)
    out = emb._embedding_backward(ids, grad, 2, None, host_runs=host_runs, onehot=False)
    assert out.tolist() == [[8.0] * 3, [4.0] * 3]
    assert emb._embedding_backward(ids, grad, 2, None, host_runs=host_runs, onehot=True).tolist() == out.tolist()


@pytest.mark.parametrize("onehot", [True, False])
def test_empty_inputs(onehot):
    empty = emb._embedding_backward(torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, 3, device=DEVICE),
                                    4, None, host_runs=False, onehot=onehot)
    assert empty.shape == (4, 3) and empty.eq(0).all()
    assert emb._embedding_backward(torch.zeros(2, dtype=torch.long, device=DEVICE), torch.zeros(2, 0, device=DEVICE),
                                   4, None, host_runs=False, onehot=onehot).shape == (4, 0)


_IDS = torch.zeros(3, dtype=torch.long)


@pytest.mark.parametrize("ids, grad, v, dtype, error, match", [
    (torch.zeros(3), torch.zeros(3, 2), 4, None, TypeError, r"ids must have dtype in \(int32, int64\)"),
    ([0, 1, 2], torch.zeros(3, 2), 4, None, TypeError, "ids must be a torch.Tensor, got list"),
    (_IDS, torch.zeros(3, 2, dtype=torch.int64), 4, None, TypeError, "grad must have dtype in"),
    (_IDS, torch.zeros(3, 2, dtype=torch.int8), 4, None, TypeError, "grad must have dtype in"),
    (_IDS, torch.zeros(3, 2, dtype=torch.bool), 4, None, TypeError, "grad must have dtype in"),
    (_IDS, torch.zeros(3, 2, dtype=torch.complex64), 4, None, TypeError, "grad must have dtype in"),
    (_IDS, torch.zeros(4, 2), 4, None, ValueError, r"grad must have ids' shape \[3\]"),
    (_IDS, torch.zeros(3), 4, None, ValueError, r"grad must have ids' shape \[3\]"),
    (_IDS, torch.zeros(3, 2), 0, None, ValueError, r"num_embeddings must be an int in \[1, 2\^31\)"),
    (_IDS, torch.zeros(3, 2), True, None, ValueError, r"num_embeddings must be an int in \[1, 2\^31\)"),
    (_IDS, torch.zeros(3, 2), 2 ** 62, None, ValueError, r"num_embeddings must be an int in \[1, 2\^31\)"),
    (_IDS, torch.zeros(3, 2), 4, torch.int64, ValueError, "dtype must be None or one of"),
    (_IDS, torch.zeros(3, 2), 4, "float32", ValueError, "dtype must be None or one of"),
])
def test_bad_input(ids, grad, v, dtype, error, match):
    ids = ids.to(DEVICE) if isinstance(ids, torch.Tensor) else ids
    with pytest.raises(error, match=match):
        embedding_backward(ids, grad.to(DEVICE), v, dtype)


@pytest.mark.parametrize("grad", [None, [[0.0, 1.0]], "x"])
def test_a_grad_that_is_not_a_tensor(grad):
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        embedding_backward(torch.tensor([0], device=DEVICE), grad, 2)


def test_ids_and_grad_on_two_devices_or_meta():
    with pytest.raises(ValueError, match="one device"):
        embedding_backward(_IDS.to("meta"), torch.zeros(3, 2, device=DEVICE), 4)
    with pytest.raises(ValueError):
        embedding_backward(_IDS.to("meta"), torch.zeros(3, 2, device="meta"), 4)


@pytest.mark.parametrize("v, dtype, route", [
    (1, torch.bfloat16, "_embedding_bwd_onehot_kernel"), (emb.ONEHOT_MAX_VOCAB, torch.float32, "_embedding_bwd_onehot_kernel"),
    (emb.ONEHOT_MAX_VOCAB, torch.float16, "_embedding_bwd_onehot_kernel"),
    (emb.ONEHOT_MAX_VOCAB + 1, torch.bfloat16, "_embedding_bwd_pieces_kernel"),
    (7, torch.float64, "_embedding_bwd_pieces_kernel")])
def test_the_route_by_vocabulary_and_dtype(v, dtype, route, monkeypatch):
    """The public function's choice: the one-hot product up to ONEHOT_MAX_VOCAB rows for 16- and
    32-bit gradients, the sort above it and for float64 (the first kernel launched names it)."""
    seen = []
    real = emb.launch
    monkeypatch.setattr(emb, "launch", lambda kernel, grid, *a, **k: seen.append(kernel.__name__) or real(kernel, grid,
                                                                                                         *a, **k))
    ids = torch.tensor([0, v - 1, 0], device=DEVICE)
    grad = torch.ones(3, 2, device=DEVICE, dtype=dtype)
    out = embedding_backward(ids, grad, v)
    assert seen[0] == route
    expected = torch.zeros(v, 2, dtype=torch.float64).index_add_(0, ids.cpu(), torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(out.double().cpu(), expected)


def test_onehot_route_refuses_float64():
    with pytest.raises(ValueError, match="one-hot route takes float16, bfloat16 or float32 gradients, got float64"):
        emb._embedding_backward(_IDS.to(DEVICE), torch.zeros(3, 2, dtype=torch.float64, device=DEVICE), 4, None,
                                host_runs=False, onehot=True)


@pytest.mark.parametrize("chunks", [2, 3])
def test_onehot_chunks_added_in_a_second_stage(chunks, monkeypatch):
    """With the tokens in chunks (a GPU's grid: one program per SM), each chunk's float32 sums
    go to a partials buffer that the reduction module's second stage adds in chunk order and
    rounds once: the float64 reference's tolerance and the same bits on every call. The grid
    is forced (the CPU's two interpreter SMs give one chunk), and recorded."""
    def forced(n_rows, block_m, programs_per_sm, device, column_blocks=1, fold_tiles=0):
        per = -(-(-(-n_rows // block_m)) // chunks) * block_m  # cdiv(tiles, chunks) tiles a chunk
        return -(-n_rows // per), per

    monkeypatch.setattr(emb, "persistent_grid", forced)
    grids = []
    real = emb.launch
    monkeypatch.setattr(emb, "launch", lambda kernel, grid, *a, **k: grids.append(tuple(grid)) or real(kernel, grid,
                                                                                                       *a, **k))
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, 40, (5 * 64 + 9,), generator=gen).to(DEVICE)
    grad = torch.randn(5 * 64 + 9, 24, generator=gen).to(DEVICE, torch.bfloat16)
    out = _check(ids, grad, 40, torch.float32, onehot=True)
    assert grids == [(1, 1, chunks)]
    assert torch.equal(out, emb._embedding_backward(ids, grad, 40, torch.float32, host_runs=False, onehot=True))


@pytest.mark.parametrize("onehot", [True, False])
def test_strided_and_expanded_ids(onehot):
    """Ids that are a view with steps, a column of a matrix, or one id expanded (stride 0): each
    token its own id, as the float64 reference reads them (the one-hot kernel reads n
    consecutive integers, so such a view must be copied first)."""
    host = DEVICE.type == "cpu"
    base = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], device=DEVICE)
    pairs = torch.tensor([[3, 9], [3, 9], [4, 9]], device=DEVICE)
    for ids in (base[::2], pairs[:, 0], torch.tensor([1], device=DEVICE).expand(4), base.view(2, 4)[:, ::2]):
        grad = torch.randn(*ids.shape, 3, generator=torch.Generator().manual_seed(ids.numel())).to(DEVICE)
        out = emb._embedding_backward(ids, grad, 10, None, host_runs=host, onehot=onehot)
        torch.testing.assert_close(out.double(), _reference(ids, grad, 10), rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf on purpose (numpy's, in the interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("onehot", [True, False])
def test_inf_and_nan_stay_in_their_rows(dtype, onehot):
    """An inf or NaN in the gradient of a token reaches only its id's row, as in torch's sum
    (index_add_): a row of an absent id stays 0, an out-of-range id's NaN reaches no row. (A
    product with the one-hot matrix would spread 0 * inf = NaN over every row: the one-hot
    route adds such a step of tokens one by one.)"""
    inf, nan = float("inf"), float("nan")
    ids = torch.tensor([0, 1, 2, 0, 7, -1], device=DEVICE)
    grad = torch.tensor([[1.0, 1.0], [inf, 1.0], [3.0, nan], [2.0, -inf], [nan, nan], [inf, inf]],
                        device=DEVICE).to(dtype)
    out = emb._embedding_backward(ids, grad, 4, None, host_runs=DEVICE.type == "cpu", onehot=onehot)
    expected = torch.tensor([[3.0, -inf], [inf, 1.0], [3.0, nan], [0.0, 0.0]])
    torch.testing.assert_close(out.float().cpu(), expected, equal_nan=True, rtol=0, atol=0)


def test_onehot_writes_nothing_outside_its_buffer(monkeypatch):
    """Ids outside [0, V) (negative, V, far past it) match no row of the one-hot matrix: they add
    nothing and no program writes outside the result, here a buffer between marker rows."""
    ids = torch.tensor([0, 2, -1, 3, 2, 99, -7, 5, 6, 7, 8, 9], device=DEVICE)
    grad = torch.ones(12, 4, device=DEVICE)
    buffer = torch.zeros(5 * 4, device=DEVICE)
    buffer[:4] = buffer[16:] = 1234.0
    monkeypatch.setattr(emb, "partials_buffer", lambda rows, n_cols, acc, out_dtype, device: buffer[4:16].view(1, 12))
    out = emb._embedding_backward(ids, grad, 3, None, host_runs=False, onehot=True)
    assert out.data_ptr() == buffer[4:].data_ptr()
    assert out.tolist() == [[1.0] * 4, [0.0] * 4, [2.0] * 4]
    assert buffer[:4].tolist() == [1234.0] * 4 and buffer[16:].tolist() == [1234.0] * 4


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


@pytest.mark.parametrize("host_runs, grids", [(True, [(4, 1), (3, 1)]), (False, [(6, 1), (5, 1)])])
def test_programs_per_piece_and_run_or_bound(host_runs, grids, monkeypatch):
    """The sort: with the runs found by the host (the CPU's path) a program per piece, then one
    per run; else (a GPU's: counting them would wait for the device) as many as the bounds the
    host knows: n // 32 + V + 1 = 6 pieces and V + 1 = 5 runs, the spare programs idle.
    Here: id 3 35 times (two pieces of 32 rows), ids 1 and 0 once each, 2 absent."""
    seen = []
    real = emb.launch
    monkeypatch.setattr(emb, "launch", lambda kernel, grid, *a, **k: seen.append(tuple(grid)) or real(kernel, grid,
                                                                                                       *a, **k))
    ids = torch.tensor([3] * 20 + [1] + [3] * 13 + [0 ] * 0 + [0] + [3] * 2, device=DEVICE)[:37]
    grad = torch.ones(37, 2, device=DEVICE)
    out = emb._embedding_backward(ids, grad, 4, None, host_runs=host_runs, onehot=False)
    assert seen == grids
    assert out[:, 0].tolist() == [1.0, 1.0, 0.0, 35.0]


def test_programs_per_piece_never_more_than_the_tokens(monkeypatch):
    """n // 32 + V + 1 pieces bounds the pieces of the GPU's path, but never more than n:
    32 distinct ids are 32 pieces of one row (not 1 + 32), and still each its own row."""
    seen = []
    real = emb.launch
    monkeypatch.setattr(emb, "launch", lambda kernel, grid, *a, **k: seen.append(tuple(grid)) or real(kernel, grid,
                                                                                                       *a, **k))
    ids = torch.arange(31, -1, -1, device=DEVICE)
    grad = torch.arange(32, dtype=torch.float32, device=DEVICE)[:, None].expand(32, 2)
    out = emb._embedding_backward(ids, grad, 32, None, host_runs=False, onehot=False)
    assert seen == [(32, 1), (32, 1)]
    assert torch.equal(out, grad.flip(0))


@pytest.mark.parametrize("deterministic", [True, False])
def test_vocab_parallel_embedding_refuses_ids_on_another_device(deterministic):
    """F.embedding of meta ids and a CPU (or CUDA) weight returned a tensor of uninitialized
    memory on the weight's device, without an error: the layer names the ids' device."""
    from fusedlib.parallel import layers
    from fusedlib.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=2, deterministic_mode=deterministic)
    torch.manual_seed(0)
    layer = layers.VocabParallelEmbedding(5, 4, init_method=torch.nn.init.normal_, config=cfg).to(DEVICE)
    with pytest.raises(ValueError, match=rf"VocabParallelEmbedding: input_ids must be on the weight's device "
                                         rf"{DEVICE.type}(:\d+)?, got meta"):
        layer(torch.tensor([[1, 7]], device="meta"))
    ids = torch.tensor([[1, 4]], device=DEVICE)
    assert torch.equal(layer(ids), F.embedding(ids, layer.weight))  # ids on the weight's device: as before


# ---------------------------------------------------------------- check_ids_in_range


def test_check_ids_in_range_reads_views_as_their_elements():
    # The kernel reads one contiguous row; a strided or expanded view reshaped without a copy
    # was read as memory: a bad id at the view's second element was missed, values between
    # its elements were reported, and an expanded [1, 1] read past the tensor. A bad id raises
    # at once on the CPU, on CUDA at check_errors (the check is lazy there).
    def check(ids, v=5):
        emb.check_ids_in_range(ids, v)
        runtime.check_errors()

    base = torch.tensor([1, 99, 10, 99, 2, 99], device=DEVICE)  # V = 5: 99 and 10 out of range
    with pytest.raises(ValueError, match="got 10"):
        check(base[::2])  # [1, 10, 2]: the 10 is the view's second element
    check(torch.tensor([[1, 99], [3, 99]], device=DEVICE)[:, 0])  # [1, 3]: in range
    check(torch.tensor([4], device=DEVICE).expand(3, 4))
    check(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=DEVICE).t())
    with pytest.raises(ValueError, match="got 7"):
        check(torch.tensor([[1, 2], [7, 4]], dtype=torch.int32, device=DEVICE).t())
    runtime.check_errors()  # nothing left pending


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([1.0, 2.0]), "ids must have dtype"),
    (torch.tensor([True, False]), "ids must have dtype"),
    ([1, 2], "ids must be a torch.Tensor"),
])
def test_check_ids_in_range_refuses_other_dtypes(ids, match):
    with pytest.raises(TypeError, match=match):
        emb.check_ids_in_range(ids, 5)
