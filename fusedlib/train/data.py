"""The training corpus: the Python standard library's own source, as UTF-8 bytes.

Why this corpus. It is real text written by people (code, comments, docstrings), it is on
every machine that runs fusedlib (the interpreter ships it), its licence is the PSF licence,
and nothing is downloaded or generated: the book trains on the very files that
``sysconfig.get_paths()["stdlib"]`` points at. Its one drawback is that it is not the same
everywhere: each Python version ships its own standard library (3.11's and 3.12's differ), so
every result records the Python version, the number of files and bytes, and a SHA-256 of the
tokens (:meth:`Corpus.info`).

Which files: every ``*.py`` file under the stdlib directory, in sorted order of their paths
relative to it, except those under a directory named in :data:`EXCLUDED_DIRS`: third-party
packages (``site-packages``, ``dist-packages``: not the standard library, other licences),
byte-code caches, and the test suites (``test``, ``tests``, ``idle_test``: Linux distributions
often ship them apart or not at all, so leaving them out keeps the corpus closer across machines).

Tokenizer: bytes. A token is one byte of the UTF-8 file, so the vocabulary is the 256 byte
values (:data:`VOCAB_SIZE`, already a multiple of 128, so the embedding and output GEMMs get
aligned shapes), encoding is ``str.encode("utf-8")`` and decoding ``bytes.decode`` (a sample
that cuts a multi-byte character shows U+FFFD there). No merges to learn or store: the model
learns spelling as well as code, which a byte-level model of a few million parameters does well
on a corpus this size. Files are joined with the ASCII *file separator* byte 0x1C
(:data:`FILE_SEPARATOR`), which no stdlib source file of Python 3.11 contains; a file that does
is left out and named in :meth:`Corpus.info` (``skipped``), so the separator stays unambiguous.

Split: by file, not by position, so no validation file was seen in training. A file goes to
validation when the first 4 bytes of the SHA-256 of its relative path, as an integer, are below
:data:`VAL_PERCENT` percent of 2^32: the assignment of a file never depends on which other
files exist (it is the same for 3.11's and 3.12's ``json/decoder.py``).

Cache: the two token arrays are written once to ``<cache_dir>/stdlib-<python>-<key>.{train,val}.bin``
(raw uint8) with a JSON of :meth:`Corpus.info`, and read back into memory (about 15 MB): ``key``
hashes the file list and sizes, so a changed stdlib makes a new cache; a cache whose SHA-256 does
not match is rebuilt. ``cache_dir`` defaults to ``$FUSEDLIB_CACHE`` or ``~/.cache/fusedlib``.

Batches (:func:`get_batch`): ``b`` windows of ``s + 1`` consecutive tokens at offsets drawn
uniformly from a seeded ``torch.Generator`` (on the CPU: its state is saved with a checkpoint),
as nanoGPT samples them; inputs are the first ``s`` tokens, targets the last ``s``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

__all__ = [
    "VOCAB_SIZE", "FILE_SEPARATOR", "EXCLUDED_DIRS", "VAL_PERCENT", "Corpus", "stdlib_dir", "stdlib_files",
    "is_validation_file", "load_corpus", "encode", "decode", "get_batch", "default_cache_dir",
]

#: Byte-level vocabulary: the 256 values of a byte (a multiple of 128 already).
VOCAB_SIZE = 256
#: ASCII's "file separator" control character, between two files.
FILE_SEPARATOR = 0x1C
#: Directories whose files are left out (see the module docstring).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
#: Percent of the files (by a hash of their path) held out for validation.
VAL_PERCENT = 5


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Union[str, Path]] = None) -> list[Path]:
    """The corpus's files: ``*.py`` under ``root`` (default :func:`stdlib_dir`) outside
    :data:`EXCLUDED_DIRS`, as paths relative to ``root``, sorted.

    Raises:
        FileNotFoundError: ``root`` is not a directory, or holds no such file.
    """
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"root: the standard-library directory {root} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: never walk site-packages
        here = Path(dirpath).relative_to(root)
        files += [here / f for f in filenames if f.endswith(".py") and (Path(dirpath) / f).is_file()]
    files.sort()
    if not files:
        raise FileNotFoundError(f"root: no *.py files under {root} outside {sorted(EXCLUDED_DIRS)}")
    return files


def is_validation_file(relpath: Union[str, Path]) -> bool:
    """Whether a file (its path relative to the stdlib, '/'-separated) is held out for validation."""
    digest = hashlib.sha256(Path(relpath).as_posix().encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") < VAL_PERCENT * 2**32 // 100


def encode(text: str) -> torch.Tensor:
    """Text -> token ids: its UTF-8 bytes as an int64 tensor [n] (values 0..255)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids: Union[torch.Tensor, Sequence[int]]) -> str:
    """Token ids [n] (values 0..255) -> text; bytes that are not valid UTF-8 become U+FFFD.

    Raises:
        ValueError: an id outside [0, 256) or a tensor that is not 1-D.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {list(ids.shape)}")
        ids = ids.tolist()
    ids = list(ids)
    if any(not 0 <= i < VOCAB_SIZE for i in ids):
        raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}) (bytes)")
    return bytes(ids).decode("utf-8", errors="replace")


def default_cache_dir() -> Path:
    """``$FUSEDLIB_CACHE``, else ``~/.cache/fusedlib``."""
    env = os.environ.get("FUSEDLIB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fusedlib"


@dataclass(frozen=True)
class Corpus:
    """The tokenized corpus.

    Attributes:
        train, val: uint8 tensors [n_train], [n_val] (CPU), the files of each split joined by
            :data:`FILE_SEPARATOR`.
        n_files_train, n_files_val: files in each split.
        python: the interpreter's version ("3.11.7"), whose stdlib this is.
        root: the stdlib directory read.
        sha256: hex SHA-256 of the train tokens followed by the val tokens.
        skipped: files left out because they contain :data:`FILE_SEPARATOR` (relative paths).
    """

    train: torch.Tensor
    val: torch.Tensor
    n_files_train: int
    n_files_val: int
    python: str
    root: str
    sha256: str
    skipped: tuple[str, ...] = ()

    def info(self) -> dict:
        """What a result must record about its data (JSON-serialisable)."""
        return {"corpus": "python-stdlib", "python": self.python, "root": self.root,
                "files_train": self.n_files_train, "files_val": self.n_files_val,
                "tokens_train": int(self.train.numel()), "tokens_val": int(self.val.numel()),
                "vocab_size": VOCAB_SIZE, "tokenizer": "utf-8 bytes", "sha256": self.sha256,
                "skipped": list(self.skipped)}


def _digest(train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(train.tobytes())
    h.update(val.tobytes())
    return h.hexdigest()


def _build(root: Path, files: list[Path]) -> tuple[np.ndarray, np.ndarray, int, int, tuple[str, ...]]:
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    skipped = []
    for rel in files:
        raw = (root / rel).read_bytes()
        if FILE_SEPARATOR in raw:
            skipped.append(rel.as_posix())
            continue
        parts[is_validation_file(rel)].append(raw)
    sep = bytes([FILE_SEPARATOR])
    arrays = [np.frombuffer(sep.join(parts[v]), dtype=np.uint8).copy() for v in (False, True)]
    if not parts[True] or not parts[False]:
        raise ValueError(f"the split of {len(files)} files left one side empty")
    return arrays[0], arrays[1], len(parts[False]), len(parts[True]), tuple(skipped)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load_corpus(cache_dir: Optional[Union[str, Path]] = None, root: Optional[Union[str, Path]] = None) -> Corpus:
    """The standard library's source, tokenized and split (see the module docstring), from the
    cache when it is there and intact, else built from the files and cached.

    Args:
        cache_dir: where the token arrays are cached (default :func:`default_cache_dir`);
            created if missing. If it cannot be written, the corpus is built in memory only.
        root: the directory to read (default :func:`stdlib_dir`): tests pass a small one.

    Returns:
        A :class:`Corpus`; the same tokens on every call for the same files.

    Raises:
        FileNotFoundError: no such directory or no file in it; ValueError: a split is empty.
    """
    root = Path(root) if root is not None else stdlib_dir()
    files = stdlib_files(root)
    python = platform.python_version()
    listing = "\n".join(f"{f.as_posix()}\t{(root / f).stat().st_size}" for f in files)
    key = hashlib.sha256(f"{root}\n{listing}".encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stem = cache / f"stdlib-{python}-{key}"
    meta_path = Path(f"{stem}.json")
    train_path, val_path = Path(f"{stem}.train.bin"), Path(f"{stem}.val.bin")
    if meta_path.exists() and train_path.exists() and val_path.exists():
        meta = json.loads(meta_path.read_text())
        train, val = np.fromfile(train_path, dtype=np.uint8), np.fromfile(val_path, dtype=np.uint8)
        if _digest(train, val) == meta.get("sha256"):
            return Corpus(torch.from_numpy(train), torch.from_numpy(val), meta["files_train"], meta["files_val"],
                          python, str(root), meta["sha256"], tuple(meta.get("skipped", ())))
    train, val, n_train, n_val, skipped = _build(root, files)
    corpus = Corpus(torch.from_numpy(train), torch.from_numpy(val), n_train, n_val, python, str(root),
                    _digest(train, val), skipped)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(train_path, train.tobytes())
        _write_atomic(val_path, val.tobytes())
        _write_atomic(meta_path, (json.dumps(corpus.info(), indent=1) + "\n").encode())
    except OSError:
        pass  # a read-only home: the corpus is built again next time, nothing else changes
    return corpus


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator,
              device: Union[str, torch.device] = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch: ``batch_size`` windows of ``seq_len + 1`` consecutive tokens.

    Args:
        data: uint8 tokens [n] on the CPU (a split of :class:`Corpus`).
        batch_size, seq_len: b and s, each >= 1.
        generator: a CPU ``torch.Generator``; draws b offsets from it (its state advances).
        device: where the batch goes.

    Returns:
        ``(inputs, targets)``: int64 [b, s] each, ``targets[:, i] = inputs[:, i + 1]`` in the data.

    Raises:
        ValueError: b or s < 1, data not 1-D uint8, or fewer than s + 1 tokens.
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError(f"data must be a 1-D uint8 tensor, got {data.dtype} of shape {list(data.shape)}")
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    offsets = torch.randint(data.numel() - seq_len, (batch_size,), generator=generator)  # [b]
    index = offsets[:, None] + torch.arange(seq_len + 1)  # [b, s + 1]
    window = data[index].to(torch.int64)  # [b, s + 1]
    device = torch.device(device)
    if device.type == "cuda":
        window = window.pin_memory().to(device, non_blocking=True)
    else:
        window = window.to(device)
    return window[:, :-1], window[:, 1:]
