"""GPTModel: embeddings (learned positions or RoPE), the block, the output layer and the per-token
loss, against the float64 model of ``transformer_reference``; the cross-entropy switch."""
from __future__ import annotations

import pytest
import torch

import transformer_reference as R
from fusedlib.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_layer_unfused_spec
from fusedlib.models.gpt import gpt_model as gpt_model_module
from fusedlib.transformer import Float16Module

from conftest import DEVICE  # noqa: I001
from test_transformer import (  # noqa: I001
    FUSIONS_ON, B, H, NP, S, Spy, assert_as_accurate, make_config, nrmse, randomize, reference_state, tensor_errors,
)

V = 37  # vocabulary: odd


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (B, S), device=DEVICE)
    labels = torch.randint(0, V, (B, S), device=DEVICE)
    return ids, labels


def _model(cfg, spec, **kw) -> GPTModel:
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S + 3, **kw)


@pytest.mark.parametrize("position, tied, interleaved", [
    ("learned_absolute", False, False),
    ("rope", True, False),  # rotary dim = hn = 6: not a power of two
    ("rope", False, True),
])
def test_gpt_loss_matches_the_float64_reference(position, tied, interleaved):
    kw = dict(num_layers=1, rotary_interleaved=interleaved)
    fused_cfg = make_config(**kw, **FUSIONS_ON, cross_entropy_loss_fusion=True)
    fused = randomize(_model(fused_cfg, get_gpt_layer_local_spec(), position_embedding_type=position,
                             share_embeddings_and_output_weights=tied))
    plain = _model(make_config(**kw), get_gpt_layer_unfused_spec(), position_embedding_type=position,
                   share_embeddings_and_output_weights=tied)
    plain.load_state_dict(fused.state_dict())
    assert ("output_layer.weight" in fused.state_dict()) is not tied
    ids, labels = _ids()

    sd = reference_state(fused)
    loss64 = R.gpt_loss(ids, labels, sd, fused_cfg, position_embedding_type=position, tied=tied, rot_dim=H // NP)
    g = torch.rand(B, S, device=DEVICE, dtype=torch.float64)  # a weighted mean, as a loss mask would give
    loss64.backward(g)
    refs = {"loss": loss64.detach(), **{n: sd[n].grad for n in sd}}

    errors = {}
    for name, model in (("fused", fused), ("plain", plain)):
        loss = model(ids, None, None, labels=labels)
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        loss.backward(g.float())
        outs = {"loss": loss, **{n: p.grad for n, p in model.named_parameters()}}
        errors[name] = tensor_errors(outs, refs, torch.float32)
        logits = model(ids, None, None)
        assert logits.shape == (B, S, V)
    # the bounds of test_every_fusion_on_equals_every_fusion_off (same setup, one more GEMM and the loss)
    assert_as_accurate(errors, "plain", torch.float32)
    # positions matter: the reference without them is far off
    if position == "rope":
        no_rope = R.gpt_loss(ids, labels, sd, fused_cfg, position_embedding_type="none", tied=tied)
        assert nrmse(no_rope, refs["loss"]) > 1e-3


@pytest.mark.parametrize("fusion", [True, False])
def test_cross_entropy_switch_chooses_the_loss(monkeypatch, fusion):
    fused = Spy(monkeypatch, gpt_model_module, "fused_vocab_parallel_cross_entropy")
    plain = Spy(monkeypatch, gpt_model_module, "vocab_parallel_cross_entropy")
    model = _model(make_config(num_layers=1, cross_entropy_loss_fusion=fusion), get_gpt_layer_unfused_spec())
    ids, labels = _ids()
    model(ids, None, None, labels=labels)
    assert bool(fused) is fusion and bool(plain) is not fusion


def test_gpt_in_bf16_through_float16_module():
    cfg = make_config(num_layers=1, bf16=True, fp32_residual_connection=True)
    model = Float16Module(cfg, _model(cfg, get_gpt_layer_unfused_spec()))
    ids, labels = _ids()
    positions = torch.arange(S, device=DEVICE).unsqueeze(0)
    loss = model(ids, positions, None, labels=labels)  # ids and positions are ints: never cast
    assert loss.dtype == torch.float32 and loss.shape == (B, S) and torch.isfinite(loss).all()
    loss.mean().backward()
    emb = model.module.embedding.word_embeddings.weight
    assert emb.dtype == torch.bfloat16 and emb.grad is not None


def test_gpt_refuses_left_out_features():
    cfg = make_config(num_layers=1)
    with pytest.raises(NotImplementedError, match="left out"):
        _model(cfg, get_gpt_layer_unfused_spec(), pre_process=False)
    with pytest.raises(ValueError, match="position_embedding_type"):
        _model(cfg, get_gpt_layer_unfused_spec(), position_embedding_type="yarn")


@pytest.mark.parametrize("labels, error, match", [
    # the cross entropy named its own transposed target: "target must have shape [9, 2] ..., got [8, 2]"
    (lambda: torch.zeros(B, S + 1, dtype=torch.int64), ValueError,
     rf"labels must have shape \[b, s\] = \[{B}, {S}\] \(input_ids' shape\), got \[{B}, {S + 1}\]$"),
    (lambda: torch.zeros(S, B, dtype=torch.int64), ValueError, r"got \[7, 2\] \(transposed\? labels are \[b, s\]"),
    (lambda: torch.zeros(B * S, dtype=torch.int64), ValueError, "labels must have shape"),
    (lambda: torch.zeros(B, S), TypeError, r"labels must have dtype in \(int64, int32\), got float32"),
    (lambda: [[0] * S] * B, TypeError, "labels must be a torch.Tensor, got list"),
])
def test_gpt_names_bad_labels(labels, error, match):
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec())
    ids, _ = _ids()
    bad = labels()
    with pytest.raises(error, match=match):
        model(ids, None, None, labels=bad.to(DEVICE) if isinstance(bad, torch.Tensor) else bad)


@pytest.mark.parametrize("case, error, match", [
    # each failed inside torch with a message naming neither argument ("index out of range in
    # self", "Expected tensor for argument #1 'indices'", a size mismatch deep in a later op)
    ("float ids", TypeError, "input_ids must be int64 or int32, got torch.float32"),
    ("1-D ids", ValueError, rf"input_ids must be \[b, s\] with b, s >= 1, got shape \[{S}\]"),
    ("3-D ids", ValueError, rf"input_ids must be \[b, s\] with b, s >= 1, got shape \[{B}, {S}, 1\]"),
    ("id = V", ValueError, rf"input_ids must lie in \[0, vocab_size = {V}\), got values in \[0, {V}\]"),
    ("id = -1", ValueError, rf"input_ids must lie in \[0, vocab_size = {V}\), got values in \[-1, "),
    ("short positions", ValueError,
     rf"position_ids must be \[b or 1, s\] = \[{B} or 1, {S}\] .* got shape \[1, {S - 1}\]"),
    ("position past the table", ValueError, rf"position_ids must lie in \[0, max_sequence_length = {S + 3}\)"),
    ("float positions", TypeError, "position_ids must be int64 or int32, got torch.float32"),
    # a lookup of meta ids in a CPU table returned a CPU tensor of uninitialized memory, no error
    ("meta ids", ValueError, rf"input_ids must be on the embedding tables' device {DEVICE.type}(:\d+)?, got meta"),
    ("meta positions", ValueError,
     rf"position_ids must be on the embedding tables' device {DEVICE.type}(:\d+)?, got meta"),
])
def test_gpt_names_bad_input_and_position_ids(case, error, match):
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec())  # learned positions: S + 3 rows
    ids, _ = _ids()
    positions = None
    if case == "float ids":
        ids = ids.float()
    elif case == "1-D ids":
        ids = ids[0]
    elif case == "3-D ids":
        ids = ids[..., None]
    elif case == "id = V":
        ids = ids.clone()
        ids[0, 0] = V
        ids[1, 0] = 0
    elif case == "id = -1":
        ids = ids.clone()
        ids[1, 2] = -1
    elif case == "short positions":
        positions = torch.arange(S - 1, device=DEVICE)[None]
    elif case == "position past the table":
        positions = torch.arange(S, device=DEVICE)[None] + 4
    elif case == "meta ids":
        ids = ids.to("meta")
    elif case == "meta positions":
        positions = torch.arange(S, device="meta")[None]
    else:
        positions = torch.arange(S, device=DEVICE)[None].float()
    if DEVICE.type == "cuda" and case in ("id = V", "id = -1", "position past the table"):
        pytest.skip("the range is checked on the host for CPU tensors only (a check of CUDA ids would sync)")
    with pytest.raises(error, match=match):
        model(ids, positions, None)
    assert model(_ids()[0], torch.arange(S, device=DEVICE)[None], None).shape == (B, S, V)  # a good call still runs


def test_gpt_refuses_more_positions_than_its_table():
    cfg = make_config(num_layers=1)
    model = _model(cfg, get_gpt_layer_unfused_spec())  # learned positions: S + 3 rows
    ids = torch.randint(0, V, (B, S + 4), device=DEVICE)
    with pytest.raises(ValueError, match=f"input_ids has {S + 4} positions, more than max_sequence_length {S + 3}"):
        model(ids, None, None)


@pytest.mark.parametrize("name, value, error", [
    ("vocab_size", "11", TypeError), ("vocab_size", 11.0, TypeError), ("vocab_size", True, TypeError),
    ("vocab_size", 0, ValueError), ("max_sequence_length", -1, ValueError), ("max_sequence_length", 0, ValueError),
])
def test_gpt_model_checks_its_sizes(name, value, error):
    kw = dict(vocab_size=V, max_sequence_length=S)
    kw[name] = value
    with pytest.raises(error, match=f"GPTModel: {name} must be an int >= 1"):
        GPTModel(make_config(num_layers=1), get_gpt_layer_local_spec(), **kw)


@pytest.mark.parametrize("name", ["fp16_lm_cross_entropy", "parallel_output", "share_embeddings_and_output_weights",
                                  "rope_scaling", "scatter_embedding_sequence_parallel", "pre_process",
                                  "post_process"])
@pytest.mark.parametrize("value", ["False", "no", 0, None])
def test_gpt_model_refuses_switches_that_are_not_bools(name, value):
    # by truthiness "False" tied the weights or turned on Llama 3's frequency scaling
    with pytest.raises(TypeError, match=f"GPTModel: {name} must be a bool"):
        _model(make_config(num_layers=1), get_gpt_layer_local_spec(), position_embedding_type="rope", **{name: value})


def test_language_model_embedding_refuses_a_scatter_switch_that_is_not_a_bool():
    from fusedlib.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    with pytest.raises(TypeError, match="LanguageModelEmbedding: scatter_to_sequence_parallel must be a bool"):
        LanguageModelEmbedding(make_config(num_layers=1), V, S, scatter_to_sequence_parallel="False")


def test_gpt_model_with_rope_refuses_an_odd_kv_channels_when_built():
    # it was built, and the first forward failed naming the op's internal freqs and t
    cfg = make_config(num_layers=1, kv_channels=7)
    with pytest.raises(ValueError, match="RoPE rotates pairs of channels: kv_channels = 7 with rotary_percent = 1.0"):
        _model(cfg, get_gpt_layer_local_spec(), position_embedding_type="rope")


@pytest.mark.parametrize("position", ["rope", "none"])
def test_gpt_checks_position_ids_it_does_not_read(position):
    # with RoPE (or no positions) position_ids is not read, as in Megatron-core; a wrong argument
    # (a str, a float tensor, a wrong shape) was silently ignored, it is now refused by name
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec(), position_embedding_type=position).eval()
    ids, _ = _ids()
    with pytest.raises(TypeError, match="position_ids must be an int64 tensor"):
        model(ids, "0..s-1", None)
    with pytest.raises(TypeError, match="position_ids must be int64 or int32, got torch.float32"):
        model(ids, torch.arange(S, device=DEVICE)[None].float(), None)
    with pytest.raises(ValueError, match=rf"position_ids must be \[b or 1, s\] = \[{B} or 1, {S}\]"):
        model(ids, torch.arange(3, device=DEVICE), None)
    with torch.no_grad():  # good positions are not read: the logits of positions 0..s-1
        assert torch.equal(model(ids, torch.arange(S, device=DEVICE)[None], None), model(ids, None, None))


def test_gpt_checks_decoder_input_against_input_ids():
    # a [b, s, h] decoder_input was read as s = b, b = s: logits of the wrong shape, no error; one
    # of another length got a labels message quoting the wrong input_ids shape
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec()).eval()
    ids, labels = _ids()
    with pytest.raises(ValueError, match=rf"decoder_input must be \[s, b, h\] = \[{S}, {B}, {H}\] .*got shape "
                                         rf"\[{B}, {S}, {H}\] \(transposed\?"):
        model(ids, None, None, decoder_input=torch.randn(B, S, H, device=DEVICE))
    with pytest.raises(ValueError, match=rf"got shape \[{S - 1}, {B}, {H}\]$"):
        model(ids, None, None, decoder_input=torch.randn(S - 1, B, H, device=DEVICE), labels=labels)
    with pytest.raises(ValueError, match=rf"got shape \[{S}, {B}, {H + 1}\]$"):
        model(ids, None, None, decoder_input=torch.randn(S, B, H + 1, device=DEVICE))
    with torch.no_grad():  # the embedding's own output as decoder_input: the same logits
        emb = model.embedding(input_ids=ids, position_ids=None)
        assert torch.equal(model(ids, None, None, decoder_input=emb), model(ids, None, None))


def test_gpt_names_other_bad_arguments():
    with pytest.raises(TypeError, match="GPTModel: config must be a TransformerConfig, got None"):
        _model(None, get_gpt_layer_unfused_spec())
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec())
    ids, labels = _ids()
    with pytest.raises(TypeError, match="extra_block_kwargs must be a dict"):
        model(ids, None, None, extra_block_kwargs=[1])
    with pytest.raises(ValueError, match=f"labels must be on the model's device {DEVICE.type}.*, got meta"):
        model(ids, None, None, labels=labels.to("meta"))


@pytest.mark.parametrize("kw, error, match", [
    (dict(rope_scaling=True, rope_scaling_factor=0.0), ValueError, "rope_scaling_factor must be a finite number > 0"),
    (dict(rope_scaling=True, rope_scaling_factor=float("nan")), ValueError, "rope_scaling_factor must be a finite"),
    (dict(rope_scaling=True, rope_scaling_factor=-8.0), ValueError, "rope_scaling_factor must be a finite"),
    (dict(rope_scaling=True, rope_scaling_factor="8"), TypeError, "rope_scaling_factor must be a number > 0"),
    (dict(rotary_base="10000"), TypeError, "rotary_base must be a number > 0, got str"),
    (dict(rotary_base=float("inf")), ValueError, "rotary_base must be a finite number > 0"),
    (dict(seq_len_interpolation_factor=float("inf")), ValueError,
     r"seq_len_interpolation_factor must be a finite number > 0 \(or None\)"),
    (dict(rotary_percent="1"), TypeError, r"rotary_percent must be a number in \(0, 1\]"),
])
def test_gpt_refuses_bad_rope_settings(kw, error, match):
    # a rope_scaling_factor of 0 or NaN made every angle inf or NaN: NaN logits on every
    # backend but torch's CPU SDPA, which gave finite ones (NaN queries hidden)
    with pytest.raises(error, match=match):
        _model(make_config(num_layers=1), get_gpt_layer_local_spec(), position_embedding_type="rope", **kw)


@pytest.mark.parametrize("kw", [dict(post_process=False), dict(mtp_block_spec=get_gpt_layer_local_spec()),
                                dict(pg_collection=object()), dict(vp_stage=0)],
                         ids=["post_process", "mtp_block_spec", "pg_collection", "vp_stage"])
def test_gpt_refuses_every_left_out_constructor_feature(kw):
    with pytest.raises(NotImplementedError, match="left out of fusedlib"):
        _model(make_config(num_layers=1), get_gpt_layer_unfused_spec(), **kw)


@pytest.mark.parametrize("kw", [dict(inference_context=object()), dict(packed_seq_params=object())],
                         ids=["inference_context", "packed_seq_params"])
def test_gpt_forward_refuses_inference_and_packed_sequences(kw):
    model = _model(make_config(num_layers=1), get_gpt_layer_unfused_spec())
    with pytest.raises(NotImplementedError, match="inference_context and packed_seq_params are left out"):
        model(_ids()[0], None, None, **kw)


def test_gpt_passes_every_rope_setting_to_its_rotary_embedding():
    # each setting was only checked for its type by the tests: a model that dropped one (took
    # the default) built and ran. hn = 6, rotary_percent 0.5: 3 rotary channels (4 angles, as
    # Megatron); base 1e6 puts the slowest wavelength (2π·1e4) above Llama 3's 8192, so the
    # scaling and its factor change it
    from fusedlib.models.common.embeddings import RotaryEmbedding

    rope = dict(rotary_percent=0.5, rotary_base=10**6, seq_len_interpolation_factor=2.0, rope_scaling=True,
                rope_scaling_factor=4.0)
    model = _model(make_config(num_layers=1, rotary_interleaved=True), get_gpt_layer_unfused_spec(),
                   position_embedding_type="rope", **rope)
    want = RotaryEmbedding(H // NP, rotary_interleaved=True, device=DEVICE, **rope)(S)
    got = model.rotary_pos_emb(S)
    assert got.shape == want.shape == (S, 1, 1, 4) and torch.equal(got, want)
    # and each setting matters here: leaving any one at its default changes the angles
    defaults = dict(rotary_percent=1.0, rotary_base=10000, seq_len_interpolation_factor=None, rope_scaling=False,
                    rope_scaling_factor=8.0, rotary_interleaved=False)
    for name, default in defaults.items():
        kw = {**rope, "rotary_interleaved": True, name: default}
        other = RotaryEmbedding(H // NP, device=DEVICE, **kw)(S)
        assert other.shape != got.shape or not torch.equal(other, got), name


def test_gpt_output_layer_and_embeddings_take_megatrons_init_methods():
    # Megatron-core: the output layer is initialised with init_method (not the scaled
    # output_layer_init_method of the attention's and MLP's output projections), both embedding
    # tables with embedding_init_method
    def fill(value):
        return lambda w: torch.nn.init.constant_(w, value)

    cfg = make_config(num_layers=1, init_method=fill(0.5), output_layer_init_method=fill(0.25),
                      embedding_init_method=fill(0.125))
    model = _model(cfg, get_gpt_layer_unfused_spec())
    assert (model.output_layer.weight == 0.5).all()
    assert (model.embedding.word_embeddings.weight == 0.125).all()
    assert (model.embedding.position_embeddings.weight == 0.125).all()
    assert (model.decoder.layers[0].mlp.linear_fc2.weight == 0.25).all()  # (the scaled one's own place)
    # perform_initialization=False: no init method runs
    cfg = make_config(num_layers=1, init_method=fill(0.5), output_layer_init_method=fill(0.25),
                      embedding_init_method=fill(0.125), perform_initialization=False)
    model = _model(cfg, get_gpt_layer_unfused_spec())
    assert not (model.embedding.position_embeddings.weight == 0.125).all()


def _embedding(cfg, position_embedding_type="learned_absolute"):
    from fusedlib.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    return randomize(LanguageModelEmbedding(cfg, V, S + 3, position_embedding_type=position_embedding_type)).to(DEVICE)


def test_language_model_embedding_reads_the_position_ids_it_is_given():
    # positions were only ever passed as 0..s-1, the default: an embedding that ignored them
    # (or shifted the default by one) passed. float64: the sum of two table rows is exact
    emb = _embedding(make_config(torch.float64, num_layers=1))
    ids = _ids()[0]
    word, pos = emb.word_embeddings.weight.detach(), emb.position_embeddings.weight.detach()
    per_sample = torch.stack([torch.arange(S, device=DEVICE).flip(0), torch.arange(S, device=DEVICE) + 3])  # [b, s]
    shared = (torch.arange(S, device=DEVICE) * 2 % (S + 3))[None]  # [1, s]: broadcast over the batch
    for positions in (per_sample, shared, None):
        p = torch.arange(S, device=DEVICE)[None] if positions is None else positions
        want = (word[ids] + pos[p.expand(B, S)]).transpose(0, 1)  # [s, b, h]
        assert torch.equal(emb(ids, positions), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_language_model_embedding_writes_s_b_h_and_both_tables_gradients(deterministic, dtype):
    # the lookup takes the ids transposed, so that it writes [s, b, h] itself (no transposed copy
    # of the activations, nor of their gradient in the backward): the output is a new contiguous
    # [s, b, h] tensor, and each table's gradient is the float64 sum of the output gradient's
    # rows over the tokens with that id (word) or position (position). float64: sums of a few
    # terms, equal to rounding; bf16 (deterministic: the one-hot route): each gradient row is
    # rounded once to bf16 from a float32 sum, half an ulp of the float64 sum plus the float32
    # sum's error (S·B = 42 terms of bf16 values: far below bf16's ulp)
    torch.manual_seed(7)
    emb = _embedding(make_config(dtype, num_layers=1, deterministic_mode=deterministic))
    ids = _ids()[0]
    ids_before = ids.clone()
    out = emb(ids, None)
    assert out.shape == (S, B, H) and out.is_contiguous() and torch.equal(ids, ids_before)
    g = torch.randn(S, B, H, device=DEVICE).to(dtype)
    out.backward(g)
    g64 = g.double()
    word = torch.zeros(V, H, dtype=torch.float64, device=DEVICE).index_add_(
        0, ids.reshape(-1), g64.transpose(0, 1).reshape(-1, H))  # token (b, i) is ids[b, i]
    pos = torch.zeros(S + 3, H, dtype=torch.float64, device=DEVICE)
    pos[:S] = g64.sum(1)  # position i of every sequence
    for got, want in ((emb.word_embeddings.weight.grad, word), (emb.position_embeddings.weight.grad, pos)):
        assert got.dtype == dtype
        if dtype is torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        else:
            ulp = torch.finfo(torch.bfloat16).eps * want.abs()  # bf16's spacing at the value: <= 2x its ulp
            assert ((got.double() - want).abs() <= ulp + 1e-6).all()


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_language_model_embedding_dropout_is_hidden_dropout(position):
    # Megatron-core's embedding dropout has p = hidden_dropout (attention_dropout is the
    # attention's). With p = 1/2 each element is dropped or doubled: the eval output times 0 or 2,
    # zeros in 1/2 of B·S·H = 336 elements (a standard deviation of 0.027: 0.5 ± 0.2 is 7 of them)
    torch.manual_seed(0)
    emb = _embedding(make_config(num_layers=1, hidden_dropout=0.5, attention_dropout=0.0), position)
    ids = _ids()[0]
    want = emb.eval()(ids, None)
    got = emb.train()(ids, None)
    dropped = got == 0
    assert torch.equal(got[~dropped], 2 * want[~dropped])
    assert 0.3 < dropped.float().mean().item() < 0.7
    # attention_dropout does not apply to the embeddings
    emb = _embedding(make_config(num_layers=1, hidden_dropout=0.0, attention_dropout=0.5), position)
    assert torch.equal(emb.train()(ids, None), emb.eval()(ids, None))


def test_language_model_embedding_fp32_residual_connection_returns_float32():
    # bf16 tables, fp32_residual_connection: the output (the residual stream) is float32, the
    # bf16 sum widened exactly
    emb = _embedding(make_config(torch.bfloat16, num_layers=1, fp32_residual_connection=True))
    ids = _ids()[0]
    out = emb(ids, None)
    assert out.dtype == torch.float32 and out.shape == (S, B, H)
    plain = _embedding(make_config(torch.bfloat16, num_layers=1))
    plain.load_state_dict(emb.state_dict())
    want = plain(ids, None)
    assert want.dtype == torch.bfloat16 and torch.equal(out, want.float())
