"""The training package: corpus and tokenizer, the three models' agreement, resume bit for bit,
sampling, the command line's errors.

Everything runs on a tiny model (1-2 layers, hidden 32, sequences of 16 bytes) so that the
fused model's kernels, interpreted by Triton on a CPU, take seconds. Resume is checked with
``==`` on the losses: a resumed run must compute exactly the same steps, not nearly.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import DEVICE
from fusedlib.train import (PlainGPT, TrainConfig, Trainer, build_model, decode, encode, get_batch, load_corpus,
                            plain_state_dict_from_gpt, sample)
from fusedlib.train import __main__ as cli
from fusedlib.train import data as data_mod
from fusedlib.train.model import ModelShape, build_gpt

TINY = dict(layers=1, hidden=32, heads=2, seq=16, batch=2, warmup=2, log_interval=2, eval_interval=0,
            eval_batches=1, progress=False)


@pytest.fixture(scope="module")
def stdlib_root(tmp_path_factory) -> Path:
    """A small stand-in for the stdlib: real stdlib files copied into a temporary tree, plus
    files the corpus must leave out (site-packages, a test package, a non-.py file)."""
    src = data_mod.stdlib_dir()
    root = tmp_path_factory.mktemp("stdlib")
    names = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "json/__init__.py", "textwrap.py",
             "string.py", "bisect.py", "heapq.py", "keyword.py", "colorsys.py", "this.py", "abc.py", "shlex.py",
             "fnmatch.py", "glob.py", "copy.py", "queue.py", "sched.py", "numbers.py", "calendar.py", "difflib.py"]
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes((src / n).read_bytes())
    for junk in ("site-packages/pkg/mod.py", "test/test_x.py", "json/tests/test_y.py", "README.txt"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("JUNK = 1\n")
    (root / "sep.py").write_bytes(b"A = '\x1c'\n")  # holds the separator byte: left out
    return root


@pytest.fixture(scope="module")
def corpus(stdlib_root, tmp_path_factory):
    return load_corpus(tmp_path_factory.mktemp("cache"), root=stdlib_root)


# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ---------------------------------------------------------------------------------------------

def test_corpus_files_and_split(stdlib_root, corpus):
    files = data_mod.stdlib_files(stdlib_root)
    names = [f.as_posix() for f in files]
    assert names == sorted(names) and len(names) == 22
    assert corpus.skipped == ("sep.py",) and corpus.info()["skipped"] == ["sep.py"]
    names.remove("sep.py")
    assert not any("site-packages" in n or n.startswith("test/") or "/tests/" in n for n in names)
    val = [n for n in names if data_mod.is_validation_file(n)]
    assert corpus.n_files_val == len(val) and corpus.n_files_train == len(names) - len(val)
    # the tokens are the files' bytes joined by the separator, train and val files apart
    joined = {v: bytes([data_mod.FILE_SEPARATOR]).join((stdlib_root / n).read_bytes() for n in names
                                                      if data_mod.is_validation_file(n) == v) for v in (False, True)}
    assert bytes(corpus.train.tolist()) == joined[False]
    assert bytes(corpus.val.tolist()) == joined[True]
    assert corpus.train.dtype == torch.uint8 and corpus.val.dtype == torch.uint8


def test_split_depends_on_the_path_only():
    # 5% of paths by hash: the same answer whatever else exists; about 5% of many paths
    paths = [f"pkg{i}/mod{j}.py" for i in range(40) for j in range(50)]
    frac = sum(map(data_mod.is_validation_file, paths)) / len(paths)
    # binomial(2000, 0.05): sd = sqrt(2000·0.05·0.95)/2000 = 0.0049; 4 sd
    assert abs(frac - 0.05) < 4 * 0.0049
    assert data_mod.is_validation_file("json/decoder.py") == data_mod.is_validation_file(Path("json") / "decoder.py")


def test_corpus_cache_is_deterministic(stdlib_root, corpus, tmp_path):
    again = load_corpus(tmp_path, root=stdlib_root)  # built afresh
    cached = load_corpus(tmp_path, root=stdlib_root)  # read from the cache
    for c in (again, cached):
        assert c.sha256 == corpus.sha256 and torch.equal(c.train, corpus.train) and torch.equal(c.val, corpus.val)
        assert c.skipped == corpus.skipped
    # a corrupted cache is rebuilt, not trusted
    bin_file = next(tmp_path.glob("*.train.bin"))
    bin_file.write_bytes(b"x" * 10)
    assert torch.equal(load_corpus(tmp_path, root=stdlib_root).train, corpus.train)
    info = corpus.info()
    assert info["vocab_size"] == 256 and info["tokens_train"] == corpus.train.numel()


def test_real_stdlib_corpus(tmp_path):
    c = load_corpus(tmp_path)
    assert c.train.numel() > 1_000_000 and c.val.numel() > 50_000 and c.n_files_val > 0


def test_encode_decode():
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.numel() == len(text.encode("utf-8"))
    assert decode(ids) == text and decode(ids.tolist()) == text
    assert decode(encode("é")[:1]) == "\ufffd"  # a cut character
    with pytest.raises(ValueError, match="ids"):
        decode([256])
    with pytest.raises(ValueError, match="ids"):
        decode(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="text"):
        encode(b"bytes")


def test_get_batch(corpus):
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x, y = get_batch(corpus.train, 5, 17, g1)
    x2, y2 = get_batch(corpus.train, 5, 17, g2)
    assert x.shape == y.shape == (5, 17) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)  # same seed, same batch
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    # every row and its last target are s + 1 consecutive bytes of the data
    data = bytes(corpus.train.tolist())
    for row, nxt in zip(x.tolist(), y.tolist()):
        assert bytes(row + nxt[-1:]) in data
    x3, _ = get_batch(corpus.train, 5, 17, g1)  # the generator moved on
    assert not torch.equal(x3, x)
    for kw, match in ((dict(batch_size=0), "batch_size"), (dict(seq_len=-1), "seq_len"),
                      (dict(seq_len=corpus.val.numel()), "fewer than")):
        args = dict(batch_size=2, seq_len=4) | kw
        with pytest.raises(ValueError, match=match):
            get_batch(corpus.val, generator=g1, **args)
    with pytest.raises(ValueError, match="uint8"):
        get_batch(corpus.train.long(), 2, 4, g1)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def test_three_models_compute_the_same_function():
    # Random weights everywhere (biases and norms too: the init leaves them at 0 and 1, which
    # would hide a wrong QKV bias order) loaded into all three models. float32 on every path;
    # the losses are sums of a few hundred products of order-1 numbers per layer, rounded in
    # float32 (u = 6e-8) in different orders (Triton's norm and softmax vs torch's): they
    # agree within 1e-5 absolute (about 30 u of each loss of ~6), a wrong head order or tie
    # changes them by O(1).
    shape = ModelShape(layers=2, hidden=32, heads=4, seq=16, ffn=48)
    unfused = build_gpt(shape, "unfused")
    with torch.no_grad():
        for p in unfused.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    state = unfused.state_dict()
    fused = build_gpt(shape, "fused", device=DEVICE)
    fused.load_state_dict(state)
    plain = PlainGPT(256, 16, 2, 32, 4, 48, device=DEVICE)
    plain.load_state_dict(plain_state_dict_from_gpt(state, 4))
    assert plain.lm_head.weight is plain.wte.weight
    ids = torch.randint(0, 256, (3, 13))
    labels = torch.randint(0, 256, (3, 13))
    ref = unfused(ids, None, None, labels=labels)
    assert ref.shape == (3, 13) and ref.dtype == torch.float32
    for m in (fused, plain):
        got = m(ids.to(DEVICE), None, None, labels=labels.to(DEVICE))
        assert got.shape == (3, 13) and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=0)
        logits = m(ids.to(DEVICE), None, None)
        assert logits.shape == (3, 13, 256)
    # the conversion copies, and refuses what it does not know
    converted = plain_state_dict_from_gpt(state, 4)
    assert all(t.data_ptr() != s.data_ptr() for t in converted.values() for s in state.values()
               if isinstance(s, torch.Tensor))
    with pytest.raises(KeyError, match="no PlainGPT entry"):
        plain_state_dict_from_gpt({"decoder.layers.0.mystery": torch.zeros(1)}, 4)


def test_same_initial_weights_for_every_model():
    shape = ModelShape(layers=1, hidden=32, heads=2, seq=16)
    a = build_model("gpt", shape, seed=5, spec="fused")
    b = build_model("gpt", shape, seed=5, spec="unfused")
    c = build_model("gpt", shape, seed=6, spec="unfused")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if not k.endswith("_extra_state"))
    assert not torch.equal(sa["embedding.word_embeddings.weight"], sc["embedding.word_embeddings.weight"])
    with pytest.raises(ValueError, match="model"):
        build_model("llama", shape, 0)
    with pytest.raises(ValueError, match="hidden"):
        ModelShape(layers=1, hidden=30, heads=4, seq=8)


# ---------------------------------------------------------------------------------------------
# Training, checkpoints, resume
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, steps", [("fused", 4), ("plain", 6)])
def test_resume_is_bit_exact(kind, steps, corpus, tmp_path):
    # `steps` steps at once against steps/2, stop, resume, steps/2 more. Dropout on, so that the
    # resumed run must also restore torch's random state exactly (the fused model draws its
    # dropout keys from it); the fused model's interpreted kernels are slow: fewer steps.
    half = steps // 2
    kw = dict(TINY, steps=steps, dropout=0.1, device=str(DEVICE), bf16=False, weight_decay=0.1, eval_interval=half,
              model="gpt" if kind == "fused" else "plain", spec="fused")
    whole = Trainer(TrainConfig(out=str(tmp_path / "whole"), **kw), corpus=corpus, log=lambda s: None)
    whole.run()
    first = Trainer(TrainConfig(out=str(tmp_path / "cut"), stop_at=half, **kw), corpus=corpus, log=lambda s: None)
    first.run()
    assert first.step_count == half and (tmp_path / "cut" / "checkpoint.pt").exists()
    resumed = Trainer(TrainConfig(out=str(tmp_path / "cut"), resume=True, **kw), corpus=corpus, log=lambda s: None)
    assert resumed.step_count == half
    resumed.run()
    assert len(whole.losses()) == steps
    assert resumed.losses() == whole.losses()  # the metrics file kept the first half, then the rest: bit for bit
    for name, t in whole.model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(t, resumed.model.state_dict()[name]), name
    lines = [json.loads(s) for s in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, steps + 1))
    assert len([r for r in lines if "val_loss" in r]) == 2
    val = [r["val_loss"] for r in lines if "val_loss" in r]
    assert val == [r["val_loss"] for r in whole.history if "val_loss" in r]


def test_bf16_master_weights(corpus):
    # bf16 parameters, float32 master weights: after a step the parameters are the master
    # weights rounded to bf16, and the master weights moved by less than bf16 can represent
    tr = Trainer(TrainConfig(**dict(TINY, steps=2, model="plain", bf16=True, device="cpu")), corpus=corpus)
    before = [m.clone() for m in tr.master]
    tr.step()
    assert all(p.dtype == torch.bfloat16 for p in tr.params) and all(m.dtype == torch.float32 for m in tr.master)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(tr.params, tr.master))
    assert any(not torch.equal(m, b) for m, b in zip(tr.master, before))
    assert all(p.grad is None for p in tr.params)


def test_resume_refuses_another_configuration(corpus, tmp_path):
    kw = dict(TINY, steps=4, model="plain", device="cpu", out=str(tmp_path))
    Trainer(TrainConfig(stop_at=2, **kw), corpus=corpus).run()
    with pytest.raises(ValueError, match="lr"):
        Trainer(TrainConfig(resume=True, **(kw | dict(lr=2e-3))), corpus=corpus)
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        Trainer(TrainConfig(resume=True, **(kw | dict(out=str(tmp_path / "empty")))), corpus=corpus)


def test_schedule():
    from fusedlib.train import CosineSchedule

    s = CosineSchedule(warmup=4, steps=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and math.isclose(s(9), 0.55) and math.isclose(s(14), 0.1) and math.isclose(s(99), 0.1)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

def test_sample_shapes_and_determinism():
    shape = ModelShape(layers=1, hidden=32, heads=2, seq=8)
    model = build_model("plain", shape, seed=0, device=DEVICE)
    out = sample(model, "ab", 11, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(1))
    assert out.shape == (13,) and out.dtype == torch.int64 and out[:2].tolist() == list(b"ab")
    again = sample(model, "ab", 11, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, again) and model.training  # the mode is restored
    batch = sample(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), 4, generator=torch.Generator().manual_seed(0))
    assert batch.shape == (2, 7) and batch[:, :3].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert ((batch >= 0) & (batch < 256)).all()
    # top_k = 1 is greedy: the argmax of the logits, whatever the generator
    greedy = sample(model, "x", 3, top_k=1)
    ids = greedy[:1]
    for _ in range(3):
        ids = torch.cat([ids, model(ids[None], None, None)[0, -1].argmax()[None]])
    assert torch.equal(greedy, ids)
    assert sample(model, "xy", 0).tolist() == list(b"xy")
    fused = build_model("gpt", shape, seed=0, device=DEVICE)  # longer than seq: the context slides
    assert sample(fused, "q", 10, generator=torch.Generator().manual_seed(0)).shape == (11,)


@pytest.mark.parametrize("kw, match", [(dict(prompt=""), "prompt"), (dict(prompt=torch.zeros(1, 2, 2)), "prompt"),
                                       (dict(prompt=torch.ones(3)), "integer"), (dict(n_tokens=-1), "n_tokens"),
                                       (dict(temperature=0.0), "temperature"), (dict(top_k=0), "top_k"),
                                       (dict(top_k=257), "top_k")])
def test_sample_bad_arguments(kw, match):
    model = build_model("plain", ModelShape(layers=1, hidden=32, heads=2, seq=8), seed=0)
    args = dict(prompt="a", n_tokens=2) | kw
    with pytest.raises(ValueError, match=match):
        sample(model, **args)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--lr", "-1"], "--lr"), (["--layers", "0"], "--layers"), (["--hidden", "30", "--heads", "4"], "--hidden"),
    (["--spec", "partly"], "--spec"), (["--model", "llama"], "--model"), (["--resume"], "--resume"),
    (["--stop-at", "9", "--steps", "5", "--out", "x"], "--stop-at"), (["--dropout", "1.5"], "--dropout"),
    (["--bench-runs", "fusedlib"], "--bench-runs"), (["--bench", "--bench-runs", "nope"], "--bench-runs"),
    (["--top-k", "0"], "--top-k"), (["--attention-backend", "magic"], "--attention-backend"),
    (["--bench", "--bench-warmup", "5000"], "--bench-warmup"), (["--min-lr", "1"], "--min-lr"),
])
def test_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_trains_writes_metrics_and_samples(tmp_path, stdlib_root, capsys, monkeypatch):
    monkeypatch.setattr(data_mod, "stdlib_dir", lambda: stdlib_root)
    argv = ["--model", "plain", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2",
            "--steps", "4", "--warmup", "1", "--log-interval", "2", "--eval-interval", "2", "--eval-batches", "1",
            "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--no-progress",
            "--sample", "8", "--device", "cpu"]
    assert cli.main(argv) == 0
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in lines if "val_loss" in r] == [2, 4]
    assert all(set(r) == {"step", "loss", "lr", "tokens_per_s", "peak_bytes"} for r in lines if "loss" in r)
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert "M parameters" in capsys.readouterr().out


def test_cli_bench_writes_records(tmp_path, stdlib_root, monkeypatch):
    monkeypatch.setattr(data_mod, "stdlib_dir", lambda: stdlib_root)
    argv = ["--bench", "--bench-runs", "fusedlib-unfused", "torch.compile", "--layers", "1", "--hidden", "32",
            "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "4", "--warmup", "1", "--log-interval", "2",
            "--eval-interval", "0", "--eval-batches", "1", "--bench-warmup", "2", "--sample", "5",
            "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--device", "cpu"]
    from fusedlib.train import bench

    # (torch.compile's Inductor on a CPU compiles C++ for minutes: its "eager" backend traces the same graph)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **k: real(m, backend="eager"))
    assert cli.main(argv) == 0
    records = json.loads((tmp_path / bench.BENCH_FILE).read_text())
    assert [r["impl"] for r in records] == ["fusedlib-unfused", "torch.compile"]
    for r in records:
        assert r["op"] == "train" and len(r["losses"]) == 4 and r["timed_steps"] == 2 and r["tokens_per_s"] > 0
        assert r["corpus"]["sha256"] and r["python"] and r["val"][-1][0] == 4 and isinstance(r["sample"], str)
    # same weights, same batches, float32: the two models' first losses agree to rounding
    assert abs(records[0]["losses"][0] - records[1]["losses"][0]) < 1e-5
    assert "fusedlib-unfused" in bench.bench_table(records)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (gloo on CPU processes)
# ---------------------------------------------------------------------------------------------

def _tp_train_worker(rank: int, world_size: int, device: torch.device, kw: dict, root: str, cache: str, out: str):
    """One rank: the whole run, then the same run stopped half way and resumed; this rank's losses."""
    corpus = load_corpus(cache, root=root)
    half = kw["steps"] // 2
    whole = Trainer(TrainConfig(tp=world_size, out=f"{out}/whole", **kw), corpus=corpus)
    whole.run()
    Trainer(TrainConfig(tp=world_size, out=f"{out}/cut", stop_at=half, **kw), corpus=corpus).run()
    resumed = Trainer(TrainConfig(tp=world_size, out=f"{out}/cut", resume=True, **kw), corpus=corpus)
    resumed.run()
    torch.distributed.barrier()  # every rank's checkpoint written
    return whole.losses(), resumed.losses(), sorted(p.name for p in Path(f"{out}/cut").iterdir())


def test_tensor_parallel_training_matches_one_rank_and_resumes(stdlib_root, corpus, tmp_path):
    # tp = 2 (two gloo processes) against tp = 1, from the same weights on the same batches, in
    # float32 without dropout: the ranks sum partial GEMMs and all-reduce, so each loss differs by
    # rounding (float32, u = 6e-8, sums of ~100 terms per entry: ~1e-6 relative per step), and a
    # few AdamW steps keep it far below 1e-4 (a wrong shard or a missing all-reduce changes the
    # loss at the first step by O(0.1)). Resume with dropout: the tensor-parallel RNG tracker's
    # state must come back too, bit for bit.
    from fusedlib.parallel import spawn

    cache = str(tmp_path / "cache")
    load_corpus(cache, root=stdlib_root)  # built once, before the ranks read it
    kw = dict(TINY, steps=4, spec="unfused", device="cpu", bf16=False, heads=2, eval_interval=2)
    ranks = spawn(_tp_train_worker, 2, dict(kw, dropout=0.1), str(stdlib_root), cache, str(tmp_path / "tp"))
    for whole, resumed, files in ranks:
        assert resumed == whole
        assert files == ["checkpoint-tp0.pt", "checkpoint-tp1.pt", "metrics.jsonl"]
    assert ranks[0][0] == ranks[1][0]  # every rank computes the same (all-reduced) loss
    no_dropout = spawn(_tp_train_worker, 2, kw, str(stdlib_root), cache, str(tmp_path / "tp0"))[0][0]
    one = Trainer(TrainConfig(**kw), corpus=corpus)
    one.run()
    assert len(one.losses()) == 4
    assert max(abs(a - b) for a, b in zip(no_dropout, one.losses())) < 1e-4


def test_tensor_parallel_flags():
    with pytest.raises(ValueError, match="tp"):
        TrainConfig(tp=2, model="plain")
    with pytest.raises(ValueError, match="divide"):
        TrainConfig(tp=4, heads=6)
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer(TrainConfig(**dict(TINY, tp=2, steps=2, device="cpu")))
