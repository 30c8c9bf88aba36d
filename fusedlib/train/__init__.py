"""Training a small GPT on the Python standard library's source: the book's last chapter.

* :mod:`fusedlib.train.data`: the corpus (the stdlib's ``*.py`` files), the byte-level
  tokenizer (:func:`encode`, :func:`decode`), the train/validation split by file, random
  batches (:func:`get_batch`).
* :mod:`fusedlib.train.model`: the models: fusedlib's ``GPTModel`` with the fused or the
  unfused layer spec, and :class:`PlainGPT`, a nanoGPT-style model in plain PyTorch, all from
  the same initial weights.
* :mod:`fusedlib.train.loop`: :class:`TrainConfig`, :class:`Trainer` (AdamW, cosine schedule,
  bf16 with float32 master weights, JSON-lines metrics, checkpoints that resume bit for bit),
  :func:`sample`.
* :mod:`fusedlib.train.bench`: ``--bench``, the three models trained in one process.

Command line: ``python -m fusedlib.train --help``.
"""
from .data import Corpus, decode, encode, get_batch, load_corpus
from .loop import CosineSchedule, TrainConfig, Trainer, sample
from .model import ModelShape, build_model, count_parameters
from .plain_gpt import PlainGPT, plain_state_dict_from_gpt

__all__ = ["Corpus", "load_corpus", "encode", "decode", "get_batch", "ModelShape", "build_model",
           "count_parameters", "PlainGPT", "plain_state_dict_from_gpt", "TrainConfig", "CosineSchedule", "Trainer",
           "sample"]
