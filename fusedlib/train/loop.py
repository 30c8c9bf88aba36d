"""The training loop: AdamW with a cosine schedule, bf16 weights with float32 master weights,
JSON-lines metrics, and checkpoints that resume bit for bit.

One step (:meth:`Trainer.step`)::

    x, y = get_batch(train tokens, b, s, data generator)          # int64 [b, s] each
    loss = model(x, None, None, labels=y).mean()                   # per-token loss [b, s] -> scalar
    loss.backward()                                                # bf16 gradients
    master.grad = param.grad.float()                               # (bf16 only) to the fp32 copies,
                                                                   # all in one multi-tensor copy
    clip_grad_norm_(master, grad_clip); AdamW.step(); schedule.step()
    param.copy_(master)                                            # (bf16 only) round the new weights

Precision: with ``bf16`` the model's parameters, activations and gradients are bf16, and the
optimizer updates a float32 copy of every parameter (its "master weights"), as Megatron-core's
``Float16OptimizerWithFloat16Params`` does: an update of 1e-3 relative would mostly vanish if
added to a bf16 weight (8 bits of mantissa) directly. Every model of a comparison runs the same
scheme.

Schedule (:class:`CosineSchedule`): the learning rate rises linearly over ``warmup`` steps to
``lr`` (step k of them, 1-based, runs at lr·k/warmup), then falls along a half cosine towards
``min_lr`` (default lr/10): the step of 0-based index i >= warmup runs at
``min_lr + (lr - min_lr)·(1 + cos(π·(i - warmup)/(steps - warmup)))/2``, which reaches
``min_lr`` at index ``steps``, one past the last step run. So the last step (index steps - 1)
runs a little above ``min_lr`` (with steps 6, warmup 2, lr 1e-3: at 2.32e-4 against min_lr
1e-4; with the defaults, 1500 steps and warmup 100, 1.1e-5 relative above it), and the
optimizer holds ``min_lr`` after it, the rate a further step would take (Loshchilov and Hutter,
SGDR, 2017; the schedule of GPT-3 and nanoGPT). ``warmup`` must be less than ``steps``, as
Megatron-LM asserts of its warm-up and decay steps: else the rate would stop at a fraction of
``lr`` and never decay. Weight decay applies to the matrices (2-D parameters) only.

The token splits live on the training device (uint8, a few MB): a batch's offsets are drawn
on the CPU and the windows gathered on the device, the same batches on every device.

Nothing in a step synchronises the host with the GPU: the losses stay on the device until the
end of a logging window (``log_interval`` steps, and before every evaluation and checkpoint),
when they are read back together, the window is timed and the metrics written. Tokens/s are
the window's tokens over its wall time; evaluation time is never inside a window.

Full-iteration CUDA graph (``full_iteration_graph``, CUDA only): the whole step above but
the batch and the schedule (forward, backward, the master gradients, clipping, AdamW, the bf16
copy) is captured once as one CUDA graph and replayed, so a step costs the host one replay
instead of a launch per kernel. The first ``FULL_ITERATION_WARMUP`` steps run eagerly on a side
stream (they compile the kernels and create AdamW's state), the next step captures the graph
and replays it; the batch goes into static input buffers, the learning rate into a device
tensor that the scheduler fills. The graph runs the same kernels on the same data as the eager
step: the losses are the eager run's, bit for bit. Megatron-core's ``cuda_graph_impl=
"full_iteration"`` (``megatron/core/full_cuda_graph.py``) captures forward and backward and
the optimizer in a second graph; here they are one.

Resume. A checkpoint (``<out>/checkpoint.pt``) holds the step, the model's state dict, the
master weights, the optimizer's and the schedule's state, the data generator's state and
torch's CPU and CUDA generator states (dropout draws from them). Evaluation and sampling run
inside ``torch.random.fork_rng``, so they never move the training's random streams. So a run
stopped at step k (``stop_at``) and resumed (``resume``) computes exactly the steps k+1, ...
that the uninterrupted run computes, on the same device and software: the losses are equal
bit for bit (``tests/test_train.py`` checks it with ``==``). The metrics file is cut back to
step k on resume, so it then holds the same records as the uninterrupted run's (timings aside).

Tensor parallelism (``tp`` > 1, ``fusedlib.parallel``): every rank builds its part of the
``GPTModel`` and loads its shard of the same initial weights, reads the same batches, and after
the backward completes its gradients with ``finalize_model_grads``; the clipping norm is the
whole model's (split parameters summed over the ranks, replicated ones counted once); each rank
saves its own checkpoint with the tensor-parallel RNG tracker's states. Rank 0 writes the metrics.

Source: Loshchilov and Hutter, "Decoupled Weight Decay Regularization" (AdamW, ICLR 2019);
Megatron-LM ``megatron/core/optimizer/optimizer.py`` (``Float16OptimizerWithFloat16Params``,
``clip_grads.py``);
Karpathy, nanoGPT ``train.py``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import runtime
from ..checks import FLOAT32_MAX, ArgumentTypeError, check_bool, file_on_the_way, real_to_float
from ..kernels.flash_attention import MAX_HEAD_DIM
from ..parallel.finalize_model_grads import finalize_model_grads
from ..parallel.utils import all_reduce
from ..transformer.enums import AttnBackend
from .data import VOCAB_SIZE, Corpus, decode, encode, get_batch, load_corpus
from .model import MODELS, SPECS, ModelShape, build_model

__all__ = ["TrainConfig", "CosineSchedule", "Trainer", "sample", "CHECKPOINT", "METRICS", "RESUMABLE_CHANGES",
           "COMPILE_MODES", "FULL_ITERATION_WARMUP"]

#: ``TrainConfig.compile_mode``'s values: None (torch.compile's default) and torch.compile's modes.
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
#: The largest size or count a flag takes (an index-sized int; larger ones overflow in torch).
_MAX_INT = 2 ** 31 - 1
#: The largest learning rate: float32's largest number (AdamW's step computes in float32).
_MAX_LR = float(torch.finfo(torch.float32).max)

#: Config fields a resumed run may change: they do not touch the training's arithmetic.
RESUMABLE_CHANGES = frozenset({"out", "resume", "stop_at", "save_interval", "log_interval", "eval_interval",
                               "eval_batches", "progress", "cache_dir", "compile", "compile_mode",
                               "cuda_graph", "full_iteration_graph", "fused_layer"})
#: Eager steps before the full-iteration graph is captured (Megatron-core's
#: ``cuda_graph_warmup_steps`` default): they compile the kernels and create AdamW's state.
FULL_ITERATION_WARMUP = 3
#: Compile modes that replay CUDA graphs of their own (a full-iteration capture cannot hold them).
_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def _out_of_memory(err: BaseException) -> Optional[str]:
    """The first line of ``err``'s message if it says an allocation failed (torch's
    OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError "can't allocate
    memory"), else None: the other errors are not to be disguised as a lack of memory."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (isinstance(err, RuntimeError) and "allocate" in text):
        return text
    return None


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on (the command line's flags, one to one).

    Model: ``model`` ("gpt": fusedlib's GPTModel; "plain": the nanoGPT-style baseline),
    ``spec`` ("fused" or "unfused", for "gpt"), ``attention_backend`` (an ``AttnBackend`` name,
    for the fused spec), ``layers``, ``hidden``, ``heads``, ``ffn`` (None: 4·hidden), ``seq``
    (tokens per sequence), ``dropout``.
    Optimisation: ``batch`` (sequences per step), ``steps``, ``lr`` (peak), ``min_lr`` (None:
    lr/10; the schedule reaches it at step index ``steps``, one past the last step), ``warmup``
    (steps, fewer than ``steps``; 0: none), ``weight_decay``, ``beta1``, ``beta2``, ``grad_clip``
    (max global norm; 0: none).
    Execution: ``device`` (None: CUDA when present; with ``tp`` > 1 this rank's GPU), ``bf16``
    (None: on CUDA), ``compile`` (``torch.compile`` the model; the fused "gpt" model only where
    fusedlib's kernels are compiled for CUDA, not in Triton's interpreter), ``compile_mode`` (its ``mode``,
    e.g. "reduce-overhead": CUDA graphs of the compiled code; None: the default),
    ``cuda_graph`` (fusedlib's GPTModel with ``cuda_graph_impl="local"``: in training its
    layers and final norm run as CUDA graphs; CUDA only), ``full_iteration_graph`` (the
    whole step as one CUDA graph, see the module docstring; CUDA only, tp = 1, not with
    ``cuda_graph`` or a compile mode that makes its own graphs), ``fused_layer`` (fusedlib's
    GPTModel with each layer a ``FusedTransformerLayer``: a layer's training forward and
    backward one autograd node, the same kernels, and results bit for bit where they are
    deterministic (SDPA's CUDA kernels need not be), less host time per layer; the fused spec
    with any attention backend, eager, tp = 1, no CUDA graphs), ``tp`` (tensor-parallel ranks:
    the process must be one of ``tp`` ranks started by ``torchrun`` or
    ``fusedlib.parallel.spawn``), ``sequence_parallel``, ``seed`` (weights, data order, dropout).
    Output: ``out`` (directory for metrics and checkpoints; None: none written),
    ``log_interval``, ``eval_interval`` (0: only at the end), ``eval_batches``,
    ``save_interval`` (0: only at the end; else needs ``out``), ``stop_at`` (stop after this step
    and save, as an interruption would; the schedule still runs to ``steps``), ``resume``
    (continue from ``out``'s checkpoint: ``checkpoint.pt``, with ``tp`` > 1 one
    ``checkpoint-tp<rank>.pt`` per rank), ``progress`` (a tqdm bar), ``cache_dir`` (the corpus
    cache).

    The on/off fields (``bf16``, which may also be None, ``compile``, ``cuda_graph``,
    ``full_iteration_graph``, ``fused_layer``, ``sequence_parallel``, ``resume``, ``progress``) must be bools
    (numpy's bool is converted): a str ``"False"`` would otherwise be read as True.

    The defaults are the book's GPU run: 6 layers of hidden size 384 in 6 heads (10.9 M
    parameters), 64 sequences of 512 bytes per step (32,768 tokens), 1500 steps (49 M tokens,
    about five passes over the training split of Python 3.11's stdlib).

    Raises:
        ValueError: a field out of range, naming it.
        ArgumentTypeError: an on/off field that is not a bool, naming it (a TypeError, and a
            ValueError as every other field's refusal is).

    Source: fusedlib's own.
    """

    model: str = "gpt"
    spec: str = "fused"
    attention_backend: str = "flash"
    layers: int = 6
    hidden: int = 384
    heads: int = 6
    ffn: Optional[int] = None
    seq: int = 512
    dropout: float = 0.0
    batch: int = 64
    steps: int = 1500
    lr: float = 1e-3
    min_lr: Optional[float] = None
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    device: Optional[str] = None
    bf16: Optional[bool] = None
    compile: bool = False
    compile_mode: Optional[str] = None
    cuda_graph: bool = False
    full_iteration_graph: bool = False
    fused_layer: bool = False
    tp: int = 1
    sequence_parallel: bool = False
    seed: int = 1234
    out: Optional[str] = None
    log_interval: int = 10
    eval_interval: int = 250
    eval_batches: int = 8
    save_interval: int = 0
    stop_at: Optional[int] = None
    resume: bool = False
    progress: bool = True
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        self._check_bools()  # first: the checks below read them by truth value
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if self.attention_backend not in AttnBackend.__members__:
            raise ValueError(f"attention_backend must be one of {list(AttnBackend.__members__)}, "
                             f"got {self.attention_backend!r}")
        for name in ("layers", "hidden", "heads", "seq", "batch", "steps", "log_interval", "eval_batches", "tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_INT:
                raise ValueError(f"{name} must be an int in [1, 2^31 - 1], got {v!r}")
        if self.ffn is not None and (isinstance(self.ffn, bool) or not isinstance(self.ffn, int)
                                     or not 1 <= self.ffn <= _MAX_INT):
            raise ValueError(f"ffn must be None (4·hidden) or an int in [1, 2^31 - 1], got {self.ffn!r}")
        for name in ("warmup", "eval_interval", "save_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_INT:
                raise ValueError(f"{name} must be an int in [0, 2^31 - 1], got {v!r}")
        if self.warmup >= self.steps:  # (Megatron-LM asserts lr_warmup_steps < lr_decay_steps)
            raise ValueError(f"warmup ({self.warmup}) must be less than steps ({self.steps}): the learning rate would "
                             f"stop at a fraction of lr and never decay (0: no warm-up)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an int in [0, 2^63) (torch.manual_seed's range), got {self.seed!r}")
        for name in ("lr", "min_lr", "beta1", "beta2", "weight_decay", "grad_clip", "dropout"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name} must be a real number, got {type(v).__name__} {v!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must be between 1 and steps ({self.steps}), got {self.stop_at!r}")
        if not (self.lr > 0 and math.isfinite(real_to_float("lr", self.lr, "a finite number > 0"))):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.lr > _MAX_LR:  # AdamW's step multiplies float32 tensors by it: 1e39 is not a float32
            raise ValueError(f"lr must be at most {_MAX_LR:g} (float32's largest: AdamW's step is float32), "
                             f"got {self.lr!r}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr = {self.lr}], got {self.min_lr!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"weight_decay must be in [0, 1), got {self.weight_decay!r}")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip!r}")
        if self.compile_mode is not None and not self.compile:
            raise ValueError(f"compile_mode ({self.compile_mode!r}) needs compile")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be None or one of torch.compile's modes {COMPILE_MODES[1:]}, "
                             f"got {self.compile_mode!r}")
        if self.cuda_graph and self.model != "gpt":
            raise ValueError(f"cuda_graph needs model 'gpt' (fusedlib's GPTModel), got {self.model!r}")
        if self.cuda_graph and self.compile:
            raise ValueError("cuda_graph and compile exclude each other: under torch.compile the layers run as traced "
                             "code, not as fusedlib's CUDA graphs (use compile_mode='reduce-overhead' for "
                             "torch.compile's own)")
        if self.cuda_graph and self.tp > 1:
            raise ValueError(f"cuda_graph needs tp = 1, got {self.tp}")
        if self.full_iteration_graph and self.cuda_graph:
            raise ValueError("full_iteration_graph and cuda_graph exclude each other: the step's graph holds the "
                             "layers already (a graph cannot be captured inside another)")
        if self.full_iteration_graph and self.compile_mode in _GRAPH_COMPILE_MODES:
            raise ValueError(f"full_iteration_graph with compile_mode {self.compile_mode!r}: that mode replays CUDA "
                             f"graphs of its own, which the step's graph cannot hold (use the default mode or "
                             f"'max-autotune-no-cudagraphs')")
        if self.full_iteration_graph and self.tp > 1:
            raise ValueError(f"full_iteration_graph needs tp = 1, got {self.tp}")
        if self.fused_layer:
            self._check_fused_layer()
        if self.tp > 1 and self.model != "gpt":
            raise ValueError(f"tp > 1 needs model 'gpt' (fusedlib's GPTModel), got {self.model!r}")
        if self.tp > 1 and (self.heads % self.tp or self.hidden % self.tp):
            raise ValueError(f"tp ({self.tp}) must divide heads ({self.heads}) and hidden ({self.hidden})")
        # (both failed at the model's build, naming a layer's output_size / the embedding's rows)
        if self.tp > 1 and self.ffn is not None and self.ffn % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide ffn ({self.ffn}): fc1 and fc2 are split over the ranks")
        if self.tp > 1 and VOCAB_SIZE % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide the vocabulary ({VOCAB_SIZE} byte values): the embedding "
                             f"and the output layer are split over the ranks")
        if self.sequence_parallel and self.tp == 1:  # Megatron-core's ModelParallelConfig refuses it too
            raise ValueError("sequence_parallel needs tp > 1: cannot use sequence parallelism without tensor parallelism")
        if self.sequence_parallel and self.seq % self.tp:
            raise ValueError(f"sequence_parallel: tp ({self.tp}) must divide seq ({self.seq})")
        if (self.resume or self.stop_at is not None) and self.out is None:
            raise ValueError(f"{'resume' if self.resume else 'stop_at'} needs out: the directory of the checkpoint")
        if self.save_interval and self.out is None:  # (else no checkpoint would be written at all)
            raise ValueError(f"save_interval ({self.save_interval}) needs out: the directory of the checkpoints "
                             f"(0: none but at the end, where out is set)")
        for name in ("out", "cache_dir"):
            if getattr(self, name) is not None and str(getattr(self, name)) == "":
                raise ValueError(f"{name} must be a directory path or None, got '' (which would mean the current "
                                 f"directory)")
            if getattr(self, name) is not None and Path(getattr(self, name)).is_file():
                raise ValueError(f"{name} must be a directory path or None, got {str(getattr(self, name))!r}, a file")
            if getattr(self, name) is not None:  # a file on the way: no directory can be made there
                path = Path(getattr(self, name))
                blocked = file_on_the_way(path)
                if blocked is not None:
                    raise ValueError(f"{name} must be a directory path or None, got {str(getattr(self, name))!r}: "
                                     f"{str(blocked)!r} on its way is a file")
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"device must be a torch device name, got {self.device!r}") from None
            if torch.device(self.device).type not in ("cuda", "cpu"):
                raise ValueError(f"device must be 'cuda' (optionally with an index) or 'cpu': fusedlib's kernels "
                                 f"run on those; got {self.device!r}")
            if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: no CUDA device here (torch.cuda.is_available() is False)")
        self.shape()  # checks the model's shape
        for name in ("cuda_graph", "full_iteration_graph"):
            if getattr(self, name) and self.resolved_device().type != "cuda":
                raise ValueError(f"{name} needs a CUDA device, got {self.resolved_device()}")
        if self.compile and self.model == "gpt" and runtime.INTERPRET_ON_CPU:
            raise ValueError("compile with model 'gpt' needs fusedlib's kernels compiled for CUDA: in Triton's "
                             "interpreter (this process runs them there: no GPU, or TRITON_INTERPRET=1) "
                             "torch.compile cannot trace them; the plain model compiles anywhere")

    def check_model(self) -> None:
        """What the model's build would refuse, checked before anything is built and named by
        its field: with the fused spec's ``attention_backend`` flash, heads of more than
        fusedlib's FlashAttention's 256 channels (else the build or the first step failed,
        naming the kernel's head dim, not the flags). Not part of ``__post_init__``: a
        ``--bench`` base configuration need not describe a model that any chosen run builds
        (``Trainer`` and the command line call it for the runs that do).

        Raises:
            ValueError: naming ``heads``.
        """
        head_dim = self.hidden // self.heads
        if self.uses_attention_backend() and self.attention_backend == "flash" and head_dim > MAX_HEAD_DIM:
            raise ValueError(f"heads ({self.heads}) too few for attention_backend 'flash': fusedlib's FlashAttention "
                             f"takes heads of at most {MAX_HEAD_DIM} channels, and hidden / heads = {self.hidden} / "
                             f"{self.heads} = {head_dim}; take more heads, or attention_backend 'local'")

    def _check_fused_layer(self) -> None:
        """``fused_layer``'s combinations: FusedTransformerLayer is fusedlib's GPT layer of the
        fused spec, on one rank (it refuses the rest when built); it saves host time per layer,
        which a CUDA graph's replay does not spend and under torch.compile it steps aside (the
        compiled code traces TransformerLayer's forward): with either it would change nothing.

        Raises:
            ValueError: naming the field that does not go with it.
        """
        if self.model != "gpt":
            raise ValueError(f"fused_layer needs model 'gpt' (fusedlib's GPTModel), got {self.model!r}")
        if self.spec != "fused":
            raise ValueError(f"fused_layer needs spec 'fused' (FusedTransformerLayer runs the fused local spec), "
                             f"got {self.spec!r}")
        if self.tp > 1:
            raise ValueError(f"fused_layer needs tp = 1 (FusedTransformerLayer runs on one rank), got {self.tp}")
        for name in ("compile", "cuda_graph", "full_iteration_graph"):
            if getattr(self, name):
                why = ("under torch.compile the layer runs TransformerLayer's forward, traced" if name == "compile"
                       else "a CUDA graph's replay spends none")
                raise ValueError(f"fused_layer and {name} exclude each other: the one-node layer saves host time "
                                 f"per layer, and {why}")

    def _check_bools(self) -> None:
        """Every field annotated ``bool`` (``bf16``: ``Optional[bool]``) a bool, numpy's converted:
        read by truth value, a str ``"False"`` switched bf16 on and a resume started.

        Raises:
            ArgumentTypeError: naming the field and the type it got.
        """
        for f in dataclasses.fields(self):
            # (the annotations are strs under this module's __future__ import, types without it)
            optional = f.type in ("Optional[bool]", Optional[bool])
            if not (optional or f.type in ("bool", bool)):
                continue
            v = getattr(self, f.name)
            if v is True or v is False or (v is None and optional):
                continue
            try:
                setattr(self, f.name, check_bool(f.name, v))
            except TypeError as err:
                none = " or None (None: on CUDA)" if optional else ""
                raise ArgumentTypeError(str(err).replace(" must be a bool", f" must be a bool{none}", 1)) from None

    def shape(self) -> ModelShape:
        """The model's :class:`ModelShape`."""
        return ModelShape(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq, ffn=self.ffn,
                          dropout=self.dropout)

    def resolved_device(self) -> torch.device:
        """``device``, or CUDA when present (with ``tp`` > 1 under NCCL: this process's GPU), else the CPU."""
        if self.device is not None:
            return torch.device(self.device)
        if self.tp > 1:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_backend() == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def use_bf16(self) -> bool:
        """``bf16``, or whether the device is CUDA."""
        return self.bf16 if self.bf16 is not None else self.resolved_device().type == "cuda"

    def uses_attention_backend(self) -> bool:
        """Whether the model reads ``attention_backend``: the fused GPT only (the unfused spec
        and the plain model have an attention of their own)."""
        return self.model == "gpt" and self.spec == "fused"

    def record(self) -> dict:
        """The fields for a benchmark record: ``dataclasses.asdict``, with ``attention_backend``
        None where the model does not read it (:meth:`uses_attention_backend`)."""
        fields = dataclasses.asdict(self)
        if not self.uses_attention_backend():
            fields["attention_backend"] = None
        return fields

    def label(self) -> str:
        """A short name: "fused", "unfused", "fused (local)", "plain", with "+ CUDA graphs",
        "+ one node per layer" (``fused_layer``),
        "+ compile" (and its mode) and "+ full-iteration graph" where they apply."""
        name = "plain" if self.model == "plain" else self.spec
        if self.uses_attention_backend() and self.attention_backend != "flash":
            name += f" ({self.attention_backend})"
        if self.tp > 1:
            name += f", tp = {self.tp}" + (" + SP" if self.sequence_parallel else "")
        if self.cuda_graph:
            name += " + CUDA graphs"
        if self.fused_layer:
            name += " + one node per layer"
        if self.compile:
            name += " + compile" + (f" ({self.compile_mode})" if self.compile_mode else "")
        if self.full_iteration_graph:
            name += " + full-iteration graph"
        return name


class CosineSchedule:
    """Multiplier of the peak learning rate at step ``i`` (0-based, as ``LambdaLR`` counts):
    ``(i + 1)/warmup`` while ``i < warmup``, then ``r + (1 - r)·(1 + cos(π·t))/2`` with
    ``t = (i - warmup)/(steps - warmup)`` (clamped to 1) and ``r = min_lr/lr``.

    A run of ``steps`` steps uses ``i`` = 0 to steps - 1, so ``t`` < 1 at its last step: the
    multiplier reaches ``r`` at ``i = steps``, the rate the optimizer holds after the last step,
    not within the run (steps 6, warmup 2, r 0.1: 0.5, 1, 1, 0.87, 0.55, 0.23; then 0.1).

    A callable object, not a function, so ``LambdaLR.state_dict()`` saves its fields.

    Source: Loshchilov & Hutter, "SGDR" (ICLR 2017), with a linear warm-up, as Karpathy's nanoGPT
    ``train.py`` (``get_lr``).
    """

    def __init__(self, warmup: int, steps: int, min_ratio: float) -> None:
        self.warmup, self.steps, self.min_ratio = warmup, steps, min_ratio

    def __call__(self, i: int) -> float:
        if i < self.warmup:
            return (i + 1) / self.warmup
        t = min(1.0, (i - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def _model_forward(model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, None, None, labels=y)  # GPTModel's (input_ids, position_ids, attention_mask), per-token loss [b, s]


def _float_rates(state: dict) -> dict:
    """An optimizer's or scheduler's state dict with the learning rates that live in device
    tensors (``full_iteration_graph``) as floats, so that every run's checkpoint reads alike."""
    def plain(v):
        return float(v) if isinstance(v, torch.Tensor) else v

    if "param_groups" in state:
        state["param_groups"] = [{k: plain(v) if k in ("lr", "initial_lr") else v for k, v in g.items()}
                                 for g in state["param_groups"]]
    for key in ("_last_lr", "base_lrs"):
        if key in state:
            state[key] = [plain(v) for v in state[key]]
    return state


class _FullIterationGraph:
    """A training step's body (``body(x, y) -> loss``) as one CUDA graph.

    The first ``warmup`` calls run ``body`` eagerly on a side stream (as torch.cuda.graphs'
    whole-network capture asks); the next call copies its batch into static buffers, captures
    ``body`` on them into a ``torch.cuda.CUDAGraph`` and replays it; later calls copy the batch
    and replay. Each call returns a fresh copy of the loss (the graph's own is overwritten by
    the next replay). Torch's CUDA generator is registered with the graph by
    ``torch.cuda.graph``, so dropout draws new numbers at every replay. Python's garbage
    collector runs before the capture and stays off during it
    (:func:`fusedlib.runtime.collector_paused_for_capture`). A capture that fails raises with
    the caller's stream current again, the allocator's routing to the capture's pool ended and
    the generators out of capture mode (:func:`fusedlib.runtime.restore_after_failed_capture`),
    and keeps no graph: the next call captures again.

    Source: PyTorch's CUDA semantics notes, "Whole-network capture"; Megatron-core
    ``megatron/core/full_cuda_graph.py`` (``FullCudaGraphWrapper``).
    """

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], warmup: int) -> None:
        self.body, self.warmup, self.calls = body, warmup, 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # x, y
        self.loss: Optional[torch.Tensor] = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        current = torch.cuda.current_stream(x.device)
        if self.calls <= self.warmup:
            side = torch.cuda.Stream(x.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                loss = self.body(x, y)
            current.wait_stream(side)
            loss.record_stream(current)
            return loss
        if self.graph is None:
            b, s = x.shape
            window = torch.empty(b, s + 1, dtype=x.dtype, device=x.device)  # x and y as get_batch makes them:
            self.static = (window[:, :-1], window[:, 1:])                   # two views of one window
            self._load(x, y)
            torch.cuda.synchronize(x.device)
            graph = torch.cuda.CUDAGraph()
            # a failed capture leaves its side stream current, the allocator routing to its pool
            # and the generators in capture mode: all put back before the error; and no graph is
            # kept, so a later call captures again
            with runtime.restore_after_failed_capture(x.device) as pool, runtime.collector_paused_for_capture(), \
                    torch.cuda.graph(graph, pool=pool):
                self.loss = self.body(*self.static)
            self.graph = graph
        else:
            self._load(x, y)
        self.graph.replay()
        return self.loss.clone()

    def _load(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.static[0].copy_(x)
        self.static[1].copy_(y)


def _master_gradients(params: list[torch.Tensor], master: list[torch.Tensor]) -> None:
    """Set each float32 master weight's ``.grad`` to its parameter's (bf16) gradient in float32.

    The gradients go into one new float32 buffer, each master gradient a view of it of its
    parameter's shape, through one ``torch._foreach_copy_`` (on CUDA a multi-tensor kernel
    for gradients of one dtype and layout, where a ``.float()`` per parameter costs an
    allocation and a copy kernel each: 76 of them for chapter 9's model). The views are
    contiguous, so this path is taken only when every master weight is contiguous (the
    optimizer's fused kernels want a gradient of its weight's strides); otherwise each
    gradient is copied with ``.float()``, keeping its layout. A parameter without a gradient
    leaves its master weight without one (AdamW skips it).

    Args:
        params: the model's parameters (their ``.grad`` read, never changed).
        master: their float32 copies, one per parameter, in the same order (``.grad`` set).
    """
    grads = [p.grad for p in params]
    if not all(m.is_contiguous() for m in master):
        for m, g in zip(master, grads):
            m.grad = None if g is None else g.float()
        return
    have = [i for i, g in enumerate(grads) if g is not None]
    for i, m in enumerate(master):
        if grads[i] is None:
            m.grad = None
    if not have:
        return
    sizes = [grads[i].numel() for i in have]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=grads[have[0]].device)
    views = [v.view(grads[i].shape) for v, i in zip(flat.split(sizes), have)]
    torch._foreach_copy_(views, [grads[i] for i in have])
    for v, i in zip(views, have):
        master[i].grad = v


class Trainer:
    """A training run of :class:`TrainConfig` (see the module docstring).

    Args:
        config: the run.
        corpus: the tokens (default :func:`~fusedlib.train.data.load_corpus` with ``config.cache_dir``).
        log: where text lines go (default ``print``; the progress bar's ``write`` while it shows).

    Attributes:
        model: the (uncompiled) model; ``step_count``: steps done; ``history``: the metric
        records written so far (also to ``<out>/metrics.jsonl``); ``windows``: per logging
        window ``(first step, last step, seconds)``; ``rank``: the tensor-parallel rank (0
        with ``tp`` = 1; only rank 0 writes metrics, logs and shows the progress bar, every rank
        writes its own checkpoint ``checkpoint-tp<rank>.pt``).

    Raises:
        FileNotFoundError: ``resume`` without a checkpoint in ``out``.
        TypeError: a corpus that is not a :class:`~fusedlib.train.data.Corpus`.
        ValueError: what :meth:`TrainConfig.check_model` refuses; a corpus split that is not 1-D
            uint8 or is shorter than ``seq`` + 1 tokens; ``resume`` with a checkpoint of another configuration or corpus; ``tp``
            different from the tensor-parallel size of the process groups, or from the number
            of processes (no data parallelism).
        RuntimeError: ``tp`` > 1 in a process started alone (from ``initialize_model_parallel``).

    Source: fusedlib's own loop, as nanoGPT's ``train.py``; master weights as Megatron-LM
    ``megatron/core/optimizer/optimizer.py`` (``Float16OptimizerWithFloat16Params``).
    """

    def __init__(self, config: TrainConfig, corpus: Optional[Corpus] = None,
                 log: Optional[Callable[[str], Any]] = None) -> None:
        self.config = cfg = config
        cfg.check_model()
        self.rank = 0
        if cfg.tp > 1:
            from ..parallel import parallel_state

            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(cfg.tp)
            if parallel_state.get_tensor_model_parallel_world_size() != cfg.tp:
                raise ValueError(f"tp ({cfg.tp}) differs from the tensor-parallel size of the process groups "
                                 f"({parallel_state.get_tensor_model_parallel_world_size()})")
            if parallel_state.get_data_parallel_world_size() != 1:  # two copies would write one run's files
                raise ValueError(f"tp ({cfg.tp}) must equal the number of processes "
                                 f"({cfg.tp * parallel_state.get_data_parallel_world_size()}): the trainer has no "
                                 f"data parallelism")
            self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.is_main = self.rank == 0
        self.device = cfg.resolved_device()
        self.bf16 = cfg.use_bf16()
        self.log = (log or print) if self.is_main else (lambda line: None)
        if corpus is not None and not isinstance(corpus, Corpus):
            raise TypeError(f"corpus must be a Corpus (fusedlib.train.load_corpus) or None, got {type(corpus).__name__}")
        self.corpus = corpus if corpus is not None else load_corpus(cfg.cache_dir)
        # the corpus checked before anything is built, seeded or written
        for name, split in (("train", self.corpus.train), ("val", self.corpus.val)):
            if not isinstance(split, torch.Tensor) or split.dim() != 1 or split.dtype != torch.uint8:
                raise ValueError(f"corpus: its {name} split must be a 1-D uint8 tensor of tokens, got "
                                 + (f"{split.dtype} of shape {list(split.shape)}" if isinstance(split, torch.Tensor)
                                    else type(split).__name__))
            if split.numel() < cfg.seq + 1:
                raise ValueError(f"seq ({cfg.seq}) needs at least seq + 1 tokens in the corpus' {name} split, which "
                                 f"has {split.numel()}")
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        try:
            self.model = build_model(cfg.model, cfg.shape(), cfg.seed, cfg.spec, cfg.attention_backend, dtype,
                                     self.device, cfg.tp, cfg.sequence_parallel, cfg.cuda_graph, cfg.fused_layer)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
            text = _out_of_memory(err)
            if text is None:
                raise
            raise ValueError(f"the model (layers {cfg.layers}, hidden {cfg.hidden}, ffn {cfg.ffn or 4 * cfg.hidden}) "
                             f"does not fit in the {self.device.type} memory: {text}") from None
        self.forward = torch.compile(self.model, mode=cfg.compile_mode) if cfg.compile else self.model
        self.params = list(self.model.parameters())
        if self.bf16:  # float32 master weights, updated by the optimizer, rounded into the bf16 parameters
            self.master = [p.detach().float().clone() for p in self.params]
        else:
            self.master = self.params
        decay = [m for m in self.master if m.dim() >= 2]
        no_decay = [m for m in self.master if m.dim() < 2]
        cuda = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                           fused=cuda, foreach=None if cuda else True,
                                           capturable=cfg.full_iteration_graph)
        min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
        self.schedule = CosineSchedule(cfg.warmup, cfg.steps, min_lr / cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        # full_iteration_graph: the learning rates live in device tensors the graph reads
        self._lr_tensors: Optional[list[torch.Tensor]] = None
        self._graph: Optional[_FullIterationGraph] = None
        self.data_generator = torch.Generator(device="cpu").manual_seed(cfg.seed)  # the same batches on every rank
        torch.manual_seed(cfg.seed)  # dropout's stream (CPU and every CUDA device)
        if cfg.tp > 1:  # and the tensor-parallel stream of split tensors, seed + 2718 + rank
            from ..parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.seed)
        self.step_count = 0
        self.history: list[dict] = []
        self.windows: list[tuple[int, int, float]] = []
        self.out = Path(cfg.out) if cfg.out is not None else None
        self.checkpoint_path = None
        if self.out is not None:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # a file on the way, no permission, a file system that refuses
                raise ValueError(f"out: cannot make the directory {str(self.out)!r}: {err.strerror or err}") from None
            self.checkpoint_path = self.out / (CHECKPOINT if cfg.tp == 1 else f"checkpoint-tp{self.rank}.pt")
            for path in (self.checkpoint_path, self.out / METRICS):  # (else an IsADirectoryError mid-run)
                if path.is_dir():
                    raise ValueError(f"out: {str(path)!r} is a directory where the run keeps a file; remove it or "
                                     f"choose another out")
        # the token splits on the device (uint8: a few MB): a batch is gathered there from offsets
        # drawn on the CPU (the same batches as on the CPU), so the host neither gathers nor copies
        # windows at every step
        self._train_tokens = self.corpus.train.to(self.device)
        self._val_tokens = self.corpus.val.to(self.device)
        if cfg.resume:
            self.load(self.checkpoint_path)
        elif self.out is not None:  # a fresh run starts the directory over: metrics and checkpoint
            if self.checkpoint_path.exists():  # (else a later resume would continue the earlier run
                self.checkpoint_path.unlink()  # with this run's metrics gone)
            if self.is_main:
                (self.out / METRICS).write_text("")
        if cfg.full_iteration_graph:
            self._lr_tensors = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device)
                                for g in self.optimizer.param_groups]
            for g, t in zip(self.optimizer.param_groups, self._lr_tensors):
                g["lr"], g["capturable"] = t, True  # (a loaded checkpoint's groups may say otherwise)
            self._graph = _FullIterationGraph(self._step_body, FULL_ITERATION_WARMUP)

    # ------------------------------------------------------------------ one step
    def step(self) -> torch.Tensor:
        """One optimizer step on a fresh batch. Returns the batch's mean loss (a 0-d float32
        tensor on the device; reading it is the caller's synchronisation)."""
        cfg = self.config
        x, y = get_batch(self._train_tokens, cfg.batch, cfg.seq, self.data_generator, self.device)
        loss = self._graph(x, y) if self._graph is not None else self._step_body(x, y)
        self.scheduler.step()
        if self._lr_tensors is not None:  # the graph reads the rates from these tensors
            for g, t in zip(self.optimizer.param_groups, self._lr_tensors):
                if g["lr"] is not t:  # (a scheduler that assigns floats instead of filling tensors)
                    t.fill_(float(g["lr"]))
                    g["lr"] = t
        self.step_count += 1
        return loss

    def _step_body(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, backward, master gradients, clipping, AdamW and the bf16 copy: the part of
        a step that the full-iteration graph captures. Returns the detached mean loss."""
        cfg = self.config
        loss = _model_forward(self.forward, x, y).mean()
        loss.backward()
        if cfg.tp > 1:  # sum the gradients that each rank holds only part of (sequence-parallel norms)
            finalize_model_grads(self.model)
        if self.bf16:
            _master_gradients(self.params, self.master)
        if cfg.grad_clip > 0 and cfg.tp > 1:
            self._clip_tensor_parallel(cfg.grad_clip)
        elif cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.master, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.bf16:
            for p in self.params:
                p.grad = None
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        return loss.detach()

    def _clip_tensor_parallel(self, max_norm: float) -> None:
        """Clip the master gradients to a global norm over the whole (split) model: each split
        parameter's on every rank, each replicated one's once (on rank 0), reduced over the
        tensor-parallel group (``fusedlib.parallel.clip_grads``, Megatron-core's
        ``get_grad_norm_fp32``); no host synchronisation."""
        from ..parallel import get_tensor_model_parallel_group
        from ..parallel.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
        from ..parallel.layers import param_is_not_tensor_parallel_duplicate

        group = get_tensor_model_parallel_group()
        grads = [m.grad for m, p in zip(self.master, self.params)  # (the split attributes are the model's)
                 if m.grad is not None and param_is_not_tensor_parallel_duplicate(p, group)]
        clip_grad_by_total_norm_fp32(self.master, max_norm, get_grad_norm_fp32(grads, 2.0, group))

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` validation batches, the same batches at every call
        (their own generator, seeded from ``seed``), in evaluation mode; torch's random state
        is left as it was."""
        cfg = self.config
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self.model.eval()
            try:
                # (the uncompiled model: a compiled one would compile again for evaluation mode)
                losses = [_model_forward(self.model, *get_batch(self._val_tokens, cfg.batch, cfg.seq, gen, self.device))
                          .mean() for _ in range(cfg.eval_batches)]
            finally:
                self.model.train()
        return float(torch.stack(losses).mean())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs (see the module docstring)."""
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"config": dataclasses.asdict(self.config), "step": self.step_count, "corpus": self.corpus.info(),
                "model": self.model.state_dict(), "master": self.master if self.bf16 else None,
                "optimizer": _float_rates(self.optimizer.state_dict()),
                "scheduler": _float_rates(self.scheduler.state_dict()),
                "data_rng": self.data_generator.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": cuda_rng, "tp_rank": self.rank, "rng_tracker": self._tracker_states(),
                "resolved": {"device": self.device.type, "bf16": self.bf16}}

    def _tracker_states(self) -> Optional[dict]:
        if self.config.tp == 1:
            return None
        from ..parallel import get_cuda_rng_tracker

        return get_cuda_rng_tracker().get_states()

    def save(self, path: Optional[Path] = None) -> Path:
        """Write :meth:`state_dict` to ``path`` (default ``<out>/checkpoint.pt``, with ``tp`` > 1
        ``<out>/checkpoint-tp<rank>.pt``) atomically."""
        path = Path(path) if path is not None else self.checkpoint_path
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        return path

    def _read_checkpoint(self, path: Path) -> dict:
        """This rank's checkpoint, checked against this run (see :meth:`load`'s Raises)."""
        if not path.exists():
            raise FileNotFoundError(f"resume: no checkpoint at {path}{self._other_tp_checkpoints(path.parent)}")
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
            if not (isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("step"), int)
                    and isinstance(ckpt.get("corpus"), dict)):
                raise ValueError("not the dict that Trainer.save writes")
        except Exception as err:  # truncated, empty, another file, a directory
            text = str(err).strip()
            first = text.splitlines()[0] if text else ""
            # (torch's refusal goes on for lines, with advice to load the file unsafely: not repeated)
            why = ("its contents are not only tensors and containers: torch.load(weights_only=True) refused it"
                   if first.startswith("Weights only load failed") else f"{type(err).__name__}: {first}")
            raise ValueError(f"resume: {path} is not a checkpoint of this trainer ({why})") from None
        mine = dataclasses.asdict(self.config)
        resolved = ckpt.get("resolved")  # the device type and bf16 as the run resolved them (None: the default)
        compared = dict(mine)
        if isinstance(resolved, dict):
            compared.update(device=self.device.type, bf16=self.bf16)
            theirs = dict(ckpt["config"], **resolved)
        else:  # a checkpoint written before the resolved values were stored: the raw fields
            theirs = ckpt["config"]
        diff = {k: (theirs.get(k), v) for k, v in compared.items()
                if k not in RESUMABLE_CHANGES and theirs.get(k) != v}
        if diff:
            raise ValueError("resume: the checkpoint's configuration differs in "
                             + ", ".join(f"{k} (checkpoint {a!r}, now {b!r})" for k, (a, b) in diff.items())
                             + "; a resumed run continues the checkpoint's run with its flags (to train for "
                               "more steps, start a new run with the larger --steps)")
        problem = self._unrestorable(ckpt)
        if problem is not None:
            raise ValueError(f"resume: {path} cannot be restored into this run: {problem}")
        if ckpt["corpus"]["sha256"] != self.corpus.sha256:
            raise ValueError(f"resume: the checkpoint was trained on another corpus (Python "
                             f"{ckpt['corpus']['python']}, sha256 {ckpt['corpus']['sha256'][:12]}), this is Python "
                             f"{self.corpus.python}'s ({self.corpus.sha256[:12]})")
        return ckpt

    def _other_tp_checkpoints(self, folder: Path) -> str:
        """For the message of a missing checkpoint: the checkpoints in ``folder`` of another
        tensor-parallel size and the ``tp`` they resume with ('' where there are none). A run
        with tp = 1 keeps ``checkpoint.pt``, one with tp > 1 ``checkpoint-tp<rank>.pt`` per rank,
        so a resume with the other tp looked for a file that was never written."""
        ranks = sorted(int(m.group(1)) for p in folder.glob("checkpoint-tp*.pt")
                       if (m := re.fullmatch(r"checkpoint-tp(\d+)\.pt", p.name)))
        if ranks:
            names = ", ".join(f"checkpoint-tp{r}.pt" for r in ranks)
            n = ranks[-1] + 1
            if n >= 2 and ranks == list(range(n)):
                return (f"; {folder} holds the tensor-parallel checkpoints {names}, one per rank of a run with "
                        f"tp = {n}: resume them with tp = {n} (--tp {n}, under torchrun --nproc-per-node {n})")
            return (f"; {folder} holds the tensor-parallel checkpoints {names}, of a run with tp > 1 whose other "
                    f"ranks' files are missing")
        if self.config.tp > 1 and (folder / CHECKPOINT).is_file():
            return f"; {folder} holds {CHECKPOINT}, the checkpoint of a run with tp = 1: resume it with tp = 1 (--tp 1)"
        return ""

    def _unrestorable(self, ckpt: dict) -> Optional[str]:
        """Why ``ckpt`` (a dict with the config, step and corpus entries) cannot be restored into
        this trainer, or None: every entry :meth:`state_dict` writes, of the type, shape and
        dtype that this run's own state has, and the model's, the master weights' and the
        optimizer's floating-point tensors finite. (torch.load does not check the archive's
        CRCs: damaged bytes load; a non-finite weight is the damage that would train on silently.)
        Checked before anything is restored, so that with ``tp`` > 1 every rank knows in time."""
        if ckpt["step"] < 0:
            return f"its step is {ckpt['step']}, not a step count"
        # every rank's file holds the same shapes: only the rank it stores tells another rank's apart
        # (a copied or swapped file resumed silently with the other rank's weight shards)
        if ckpt.get("tp_rank", self.rank) != self.rank:
            return (f"it is tensor-parallel rank {ckpt['tp_rank']!r}'s checkpoint, and this is rank {self.rank} "
                    f"(each rank resumes from its own checkpoint-tp<rank>.pt)")
        corpus = ckpt["corpus"]
        if not (isinstance(corpus.get("sha256"), str) and isinstance(corpus.get("python"), str)):
            return "its corpus entry has no sha256 and python strings"
        mine = self.state_dict()
        for key in ("model", "optimizer", "scheduler", "data_rng", "torch_rng", "cuda_rng", "master"):
            if key not in ckpt:
                return f"it has no {key!r} entry"

        def same_kind(a, b, where: str) -> Optional[str]:
            if isinstance(b, torch.Tensor):
                if not isinstance(a, torch.Tensor):
                    return f"{where} is {type(a).__name__}, not a tensor"
                if a.shape != b.shape or a.dtype != b.dtype:
                    return (f"{where} is a {a.dtype} tensor of shape {list(a.shape)}, this run's a {b.dtype} "
                            f"tensor of shape {list(b.shape)}")
                if a.is_floating_point() and not bool(torch.isfinite(a).all()):
                    return f"{where} holds values that are not finite (a damaged file?)"
                return None
            if isinstance(b, dict):
                if not isinstance(a, dict) or set(a) != set(b):
                    return f"{where} does not have this run's entries"
                return next((w for k in b if (w := same_kind(a[k], b[k], f"{where}[{k!r}]"))), None)
            if isinstance(b, (list, tuple)):
                if not isinstance(a, (list, tuple)) or len(a) != len(b):
                    return f"{where} does not have this run's {len(b)} entries"
                return next((w for i, (x, y) in enumerate(zip(a, b)) if (w := same_kind(x, y, f"{where}[{i}]"))),
                            None)
            if b is None or isinstance(b, (bool, int, float, str)):
                if a is not None and b is not None and not isinstance(a, (bool, int, float, str)):
                    return f"{where} is {type(a).__name__}, not a number or a string"
            return None

        for key in ("model", "master", "scheduler", "data_rng", "torch_rng"):
            why = same_kind(ckpt[key], mine[key], key)
            if why:
                return why
        opt, my_opt = ckpt["optimizer"], mine["optimizer"]
        if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict)
                and isinstance(opt.get("param_groups"), list)):
            return "its optimizer entry is not an optimizer's state dict"
        sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
                 for g in opt["param_groups"]]
        my_sizes = [len(g["params"]) for g in my_opt["param_groups"]]
        if sizes != my_sizes:
            return f"its optimizer's parameter groups hold {sizes} parameters, this run's {my_sizes}"
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, state in opt["state"].items():
            if not (isinstance(index, int) and 0 <= index < len(params) and isinstance(state, dict)):
                return f"its optimizer state has an entry {index!r} for no parameter"
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # exp_avg, exp_avg_sq (step: a scalar)
                    why = same_kind(value, torch.empty_like(params[index], device="cpu"),
                                    f"optimizer state {index} {name!r}")
                    if why:
                        return why
                elif isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
                    return f"optimizer state {index} {name!r} is not finite"
        if not isinstance(ckpt["cuda_rng"], (list, tuple)):
            return "its cuda_rng entry is not a list"
        return None

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save`, and cut the metrics file back to its step.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            ValueError: not a checkpoint this trainer wrote (truncated, empty, another file; an
                entry missing, or of another type, shape or dtype than this run's state; a
                non-finite weight or optimizer state: :meth:`_unrestorable`);
                its configuration differs in a field outside :data:`RESUMABLE_CHANGES` (the
                device type and bf16 compared as resolved), or its corpus differs (another
                Python's stdlib); with ``tp`` > 1, the ranks' checkpoints are of different steps.
        """
        path = Path(path)
        try:
            ckpt = self._read_checkpoint(path)
            problem = None
        except (FileNotFoundError, ValueError) as err:
            ckpt, problem = None, err
        if self.config.tp > 1:
            # the ranks decide together, in one all-reduce: a rank that raised alone would leave
            # the others waiting in their next collective; and their files must be of one step
            # (files of two runs mixed are refused)
            from ..parallel import get_tensor_model_parallel_group

            step = ckpt["step"] if ckpt is not None else 0
            status = all_reduce(torch.tensor([int(problem is not None), step, -step], dtype=torch.int64,
                                             device=self.device), "MAX", get_tensor_model_parallel_group())
            if problem is None and int(status[0]):
                problem = ValueError(f"resume: another rank's checkpoint in {path.parent} cannot be resumed (that "
                                     f"rank says why)")
            elif problem is None and int(status[1]) != -int(status[2]):
                problem = ValueError(f"resume: the ranks' checkpoints in {path.parent} are of different steps "
                                     f"({-int(status[2])} to {int(status[1])}): files of two runs; this rank's is of "
                                     f"step {step}")
        if problem is not None:
            raise problem
        self.model.load_state_dict(ckpt["model"])
        if self.bf16:
            with torch.no_grad():
                for m, saved in zip(self.master, ckpt["master"]):
                    m.copy_(saved)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.data_generator.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        if ckpt["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
        if ckpt.get("rng_tracker"):
            from ..parallel import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(ckpt["rng_tracker"])
        self.step_count = ckpt["step"]
        metrics = self.out / METRICS
        if metrics.exists():  # every rank reads the history; rank 0 cuts the file, atomically
            try:
                kept = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in kept):
                    raise ValueError("a line without its step")
            except ValueError as err:  # (JSON errors are ValueErrors)
                raise ValueError(f"resume: {metrics} is not a metrics file of this trainer ({err})") from None
            self.history = [r for r in kept if r["step"] <= self.step_count]
            if self.is_main:
                tmp = metrics.with_name(metrics.name + ".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
                os.replace(tmp, metrics)

    # ------------------------------------------------------------------ the loop
    def _write(self, records: list[dict]) -> None:
        self.history += records
        if self.out is not None and self.is_main:
            with open(self.out / METRICS, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)

    def _peak_bytes(self) -> Optional[int]:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def run(self) -> list[dict]:
        """Train from :attr:`step_count` to ``steps`` (or ``stop_at``), logging, evaluating and
        saving as configured; evaluates after the last step (not at ``stop_at``, which stands for
        an interruption) and saves at both. Returns :attr:`history`.

        Records: ``{"step", "loss", "lr", "tokens_per_s", "peak_bytes"}`` per step (tokens/s of
        the step's logging window; peak_bytes: CUDA's peak allocation so far, None on a CPU) and
        ``{"step", "val_loss"}`` per evaluation.

        Raises:
            FloatingPointError: a training loss (checked at each logging window's synchronisation)
                or a validation loss is not finite: the run diverged. The records of the
                window's steps before it are written; nothing is saved after it (the last
                checkpoint stays).
        """
        cfg = self.config
        last = cfg.stop_at if cfg.stop_at is not None else cfg.steps
        bar = None
        if cfg.progress and self.is_main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step_count, desc=self.config.label(), unit="step",
                       dynamic_ncols=True)
        log = bar.write if bar is not None else self.log
        if self.step_count >= last:  # a resumed run that is already there: say so, train nothing
            log(f"nothing to train: the run is at step {self.step_count}, and "
                f"{'stop_at' if cfg.stop_at is not None else 'steps'} is {last}")
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        pending: list[tuple[int, torch.Tensor, float]] = []
        tokens_per_step = cfg.batch * cfg.seq
        try:
            sync()
            t0 = time.perf_counter()
            while self.step_count < last:
                lr = cfg.lr * self.schedule(self.scheduler.last_epoch)  # (LambdaLR's rate, on the host)
                loss = self.step()
                pending.append((self.step_count, loss, lr))
                s = self.step_count
                evaluate = s == cfg.steps or (cfg.eval_interval and s % cfg.eval_interval == 0)  # (not at stop_at)
                save = self.out is not None and (s == last or (cfg.save_interval and s % cfg.save_interval == 0))
                if s % cfg.log_interval == 0 or evaluate or save:
                    losses = torch.stack([p[1] for p in pending]).tolist()  # the window's one synchronisation
                    sync()
                    seconds = time.perf_counter() - t0
                    tps = tokens_per_step * len(pending) / seconds
                    peak = self._peak_bytes()
                    bad = next((i for i, l in enumerate(losses) if not math.isfinite(l)), None)
                    if bad is not None:  # diverged: log the finite steps before it, save nothing, stop
                        self._write([{"step": st, "loss": l, "lr": r, "tokens_per_s": tps, "peak_bytes": peak}
                                     for (st, _, r), l in zip(pending[:bad], losses[:bad])])
                        raise FloatingPointError(
                            f"step {pending[bad][0]}: the training loss is {losses[bad]}: the run diverged "
                            f"(lr {pending[bad][2]:g}; a smaller lr or a grad_clip may help); nothing was saved "
                            f"after it")
                    self.windows.append((pending[0][0], s, seconds))
                    self._write([{"step": st, "loss": l, "lr": r, "tokens_per_s": tps, "peak_bytes": peak}
                                 for (st, _, r), l in zip(pending, losses)])
                    if bar is not None:
                        bar.update(len(pending))
                        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tps:,.0f}")
                    pending = []
                    if evaluate:
                        val = self.evaluate()
                        if not math.isfinite(val):
                            raise FloatingPointError(f"step {s}: the validation loss is {val} (the training loss "
                                                     f"{losses[-1]}): the model diverged; nothing was saved after it")
                        self._write([{"step": s, "val_loss": val}])
                        log(f"step {s}: train loss {losses[-1]:.4f}, val loss {val:.4f}")
                    if save:
                        self.save()
                    sync()
                    t0 = time.perf_counter()
        finally:
            if bar is not None:
                bar.close()
        return self.history

    def losses(self) -> list[float]:
        """The training loss of every step so far, in step order."""
        return [r["loss"] for r in self.history if "loss" in r]

    def sample(self, prompt: str = "def ", n_tokens: int = 200, temperature: float = 0.8, top_k: Optional[int] = 40,
               seed: int = 0) -> str:
        """Text generated by the model after ``prompt`` (:func:`sample`, a CPU generator seeded
        with ``seed``; torch's random state is left as it was).

        Raises:
            ValueError: as :func:`sample`; a prompt of token ids that is not 1-D (one text: :func:`sample`
                itself takes [b, t]); a seed outside ``torch.Generator.manual_seed``'s range
                [-2^63, 2^64).
            TypeError: a seed that is not an int (a bool, a float, a str; numpy's ints are ints
                here).
        """
        if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:  # (refused before the tokens, not by decode after)
            raise ValueError(f"prompt must be a str or 1-D token ids (one text), got shape {list(prompt.shape)}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        if not -2 ** 63 <= int(seed) < 2 ** 64:
            raise ValueError(f"seed must be an int in [-2^63, 2^64) (torch.Generator.manual_seed's range), "
                             f"got {seed!r}")
        ids = sample(self.model, prompt, n_tokens, temperature, top_k,
                     torch.Generator(device="cpu").manual_seed(int(seed)))
        return decode(ids)


#: float32's least normal, 2^-126: the least temperature the sampler divides by. A float below
#: 2^-149 rounds to 0 in float32 (0 / 0 = NaN), and CUDA divides by a scalar as a product with its
#: reciprocal, which is inf in float32 below 2^-128 (0 · inf = NaN); 2^126 is finite.
_F32_LEAST = 2.0 ** -126


@torch.no_grad()
def sample(model: torch.nn.Module, prompt, n_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Generate ``n_tokens`` tokens after ``prompt``, one at a time, from the model's distribution
    of the next token: logits / temperature, cut to the ``top_k`` largest, softmax, one draw.

    Without a KV cache: each token is one forward pass over the last ``max_sequence_length``
    tokens (the model's longest sequence). The model runs in evaluation mode and is put back
    in the mode it was in.

    Args:
        model: a ``GPTModel`` or :class:`~fusedlib.train.plain_gpt.PlainGPT` (anything with
            ``max_sequence_length`` whose ``model(ids, None, None)`` gives logits [b, t, V] of a
            causal model); a tensor-parallel ``GPTModel`` gathers its logits, and every rank
            draws the same tokens (the same generator state on every rank). Under sequence
            parallelism each context is padded on the right to a multiple of the
            tensor-parallel size and read at its last real token; the window is then the
            largest such multiple up to ``max_sequence_length``.
        prompt: a str (UTF-8 bytes), or int token ids [t] or [b, t] (b, t >= 1).
        n_tokens: tokens to generate, >= 0.
        temperature: > 0; lower is greedier.
        top_k: keep the k most likely tokens (1 <= k <= V), or None for all; tokens whose logit
            ties the k-th largest are kept too (nanoGPT's cut: logits below the k-th are dropped).
        generator: the draws' ``torch.Generator`` (its device is where the draw happens: a CPU
            generator gives the same draws on every device for the same logits).

    Returns:
        int64 token ids, the prompt followed by the new tokens: [t + n_tokens] for a str or a 1-D
        prompt, [b, t + n_tokens] for a 2-D one, on the model's device.

    Raises:
        ValueError: an empty or ill-shaped prompt, ids outside [0, V), n_tokens < 0, temperature
            not a finite number > 0, a bad top_k (each checked before the first token).
        TypeError: a generator that is not a ``torch.Generator``.

    Source: Karpathy, nanoGPT ``model.py`` (``GPT.generate``: temperature, top-k, one draw).
    """
    if isinstance(prompt, str):
        prompt = encode(prompt)
    if not isinstance(prompt, torch.Tensor) or prompt.dim() not in (1, 2) or prompt.numel() < 1:
        raise ValueError("prompt must be a non-empty str or an int tensor [t] or [b, t] with b, t >= 1"
                         + (f", got shape {list(prompt.shape)}" if isinstance(prompt, torch.Tensor) else ""))
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise ValueError(f"prompt must hold integer token ids, got {prompt.dtype}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
    if not (isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and temperature > 0
            and math.isfinite(real_to_float("temperature", temperature, "a finite number > 0"))):  # numpy's too
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    # divided in float32: held in [2^-126, float32's max] (above it 1e39 was inf in float32, and with
    # top_k the masked -inf / inf gave NaN probabilities: torch.multinomial's error; every temperature
    # above about 1e38 draws uniformly among the kept ids either way)
    t = min(max(float(temperature), _F32_LEAST), FLOAT32_MAX)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    vocab_size = getattr(model, "vocab_size", VOCAB_SIZE)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, {vocab_size}], got {top_k!r}")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:  # (the prompt: a few ids, read once)
        raise ValueError(f"prompt ids must lie in [0, {vocab_size}), got {int(prompt.min())}..{int(prompt.max())}")
    device = next(model.parameters()).device
    # [b, t], a new tensor even when no token follows (n_tokens = 0 returned the caller's prompt itself)
    ids = (prompt if prompt.dim() == 2 else prompt[None]).to(device=device, dtype=torch.int64, copy=True)
    max_seq = model.max_sequence_length
    # a tensor-parallel GPTModel returns its rank's slice of the vocabulary unless asked to gather
    config = getattr(model, "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    gather = {"runtime_gather_output": True} if tp > 1 else {}
    # under sequence parallelism the model splits the sequence over the ranks: a context whose
    # length tp does not divide is padded on the right with id 0 and the logits are read at its
    # last real token (the model is causal: no position sees a later one), within a window of
    # whole multiples of tp (the contexts of every length failed at the embedding's split)
    pad_to = tp if tp > 1 and getattr(config, "sequence_parallel", False) else 1
    window = max_seq - max_seq % pad_to
    if window < 1:  # (a window of 0 took the whole, growing context)
        raise ValueError(f"sampling a sequence-parallel model needs max_sequence_length ({max_seq}) >= the "
                         f"tensor-parallel size ({tp})")
    was_training = model.training
    model.eval()
    try:
        for _ in range(n_tokens):
            context = ids[:, -window:]
            last = context.shape[1] - 1
            if context.shape[1] % pad_to:
                context = torch.nn.functional.pad(context, (0, pad_to - context.shape[1] % pad_to))
            logits = model(context, None, None, **gather)[:, last, :].float()  # [b, V]
            if top_k is not None:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [b, 1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            # the largest logit subtracted first: logit / temperature overflows for a temperature
            # near 0 (inf - inf = NaN), the differences are <= 0 and give 0 or -inf, never NaN; a
            # temperature below float32's least subnormal would round to 0 in the division (0 / 0)
            probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / t, dim=-1)
            where = generator.device if generator is not None else device
            nxt = torch.multinomial(probs.to(where), 1, generator=generator).to(device)  # [b, 1]
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        model.train(was_training)
    return ids if prompt.dim() == 2 else ids[0]
