"""Chapter 7's block with each attention kernel, on a GPU: fusedlib's FlashAttention against torch's
``scaled_dot_product_attention`` with its own choice of kernel and held to each of its fused backends.

Usage: python tools/attention_block.py [--out PATH] [--sweep]
(default: attention_block.json here; the book reads chapters/data/bench/attention_block.json)

The attention benchmark (``python -m fusedlib.bench --op attention``) times the kernels alone,
without dropout, against each SDPA backend. The block benchmark (``--op transformer_layer``,
chapter 7) times the block with fusedlib's FlashAttention (``fusedlib-flash``) and with SDPA's
default (``fusedlib-sdpa``), attention dropout 0.1, where SDPA picks its kernel itself. This tool
times the same training step (:func:`fusedlib.bench.ops.transformer_layer.case`: its shapes,
dropouts, weights' initialisation and timer) with those two blocks and with ``fusedlib-sdpa``
held to one SDPA backend by ``torch.nn.attention.sdpa_kernel`` around the step (:func:`held`):

* ``fusedlib-sdpa-flash``: FLASH_ATTENTION, the kernel the attention benchmark's "faster than"
  goal is set against;
* ``fusedlib-sdpa-cudnn``: CUDNN_ATTENTION;
* ``fusedlib-sdpa-efficient``: EFFICIENT_ATTENTION.

(MATH, the materialised path in torch's own operators, is left out: chapter 7's ``eager`` block
and the materialised ``fusedlib`` block stand for it.) Each held block is built apart from the
others, with its own modules. All in one run and one process, the implementations in turns:
:data:`~fusedlib.bench.ops.transformer_layer.PLAIN_ROUNDS` rounds of plain launches and of
CUDA-graph replays (:func:`fusedlib.bench.core.measure_case`), at chapter 7's headline shape and
GPT-2 small's; ``--sweep`` adds its smallest stack.

Records (a JSON list): the block benchmark's ``transformer_layer`` records (its fields, ``"op":
"transformer_layer"``), each with ``"sdpa_backend"``: the held backend's name, or None
(``fusedlib-flash``, which calls no SDPA, and ``fusedlib-sdpa``, SDPA's own choice).

Source: PyTorch ``torch.nn.attention.sdpa_kernel`` and ``SDPBackend``.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlib.bench.core import BenchCase, Impl, measure_case, write_records
from fusedlib.bench.ops import transformer_layer as tl
from fusedlib.bench.ops.attention import SDPA_BACKENDS

#: impl name -> the SDPA backend it is held to: the attention benchmark's fused backends
#: (:data:`fusedlib.bench.ops.attention.SDPA_BACKENDS` less MATH), "fusedlib-" before each name
HELD: dict[str, str] = {f"fusedlib-{name}": backend for name, backend in SDPA_BACKENDS.items() if backend != "MATH"}
#: the blocks of chapter 7's benchmark timed beside the held ones
FREE = ("fusedlib-flash", "fusedlib-sdpa")


def held(impl: Impl, name: str, backend: str) -> Impl:
    """``impl`` (an SDPA block's step) run inside ``sdpa_kernel(SDPBackend.<backend>)``.

    The forward runs inside the context, so SDPA may take that backend only (and raises
    "No available kernel" where the backend cannot run the call); the backward runs the
    backward of the kernel the forward took, whatever the context.

    Args:
        impl: an implementation of the block benchmark (``fusedlib-sdpa``).
        name: the new implementation's name.
        backend: a name of ``torch.nn.attention.SDPBackend`` (``"FLASH_ATTENTION"``, ...).

    Returns:
        An :class:`~fusedlib.bench.core.Impl` with ``impl``'s passes, parameters, generators
        and info, plus ``"sdpa_backend": backend``.

    Raises:
        ValueError: ``backend`` is not one of the names MATH, FLASH_ATTENTION,
            EFFICIENT_ATTENTION, CUDNN_ATTENTION (naming them).
    """
    members = list(SDPA_BACKENDS.values())  # the attention benchmark's names of SDPBackend's kernels
    if backend not in members:
        raise ValueError(f"backend must be one of {', '.join(members)}, got {backend!r}")
    which = getattr(SDPBackend, backend)

    def fn(*args, _fn=impl.fn):
        with sdpa_kernel(which):
            return _fn(*args)

    return Impl(name, fn, passes=impl.passes, compile=impl.compile, params=impl.params,
                info={**impl.info, "sdpa_backend": backend}, generators=impl.generators)


def block_case(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16,
               backends: dict[str, str] | None = None) -> BenchCase:
    """The block benchmark's case at ``shape`` with :data:`FREE` and the held blocks only.

    Args:
        shape: [s, b, h, heads, ffn, layers], as :func:`fusedlib.bench.ops.transformer_layer.case`.
        dtype: of the parameters and hidden states.
        backends: impl name -> SDPA backend (default :data:`HELD`).

    Returns:
        The case; each held block comes from a case of its own, so no two implementations
        share a module.

    Raises:
        ValueError: a bad ``shape``; ``dtype`` not a floating torch dtype; ``backends`` not a
            dict of new names (not those of :data:`FREE`) to backend names, or a bad backend name.
    """
    backends = HELD if backends is None else backends
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not isinstance(backends, dict) or any(not isinstance(n, str) or n in FREE for n in backends):
        raise ValueError(f"backends must be a dict of new impl names (not {', '.join(FREE)}) -> SDPA backend "
                         f"names, got {backends!r}")

    def sdpa_impl() -> Impl:
        return next(i for i in tl.case(shape, dtype, cuda_graphs=False).impls if i.name == "fusedlib-sdpa")

    case = tl.case(shape, dtype, cuda_graphs=False)
    impls = [i for i in case.impls if i.name in FREE]
    for i in impls:
        i.info = {**i.info, "sdpa_backend": None}
    impls += [held(sdpa_impl(), name, backend) for name, backend in backends.items()]
    case.impls, case.skipped = impls, {}
    return case


def measure(shapes: Sequence[Sequence[int]], rounds: int = tl.PLAIN_ROUNDS,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time :func:`block_case` at each shape on the current CUDA device.

    Args:
        shapes: [s, b, h, heads, ffn, layers] each.
        rounds: rounds of plain launches and replays, the implementations in turns
            (:attr:`fusedlib.bench.core.BenchCase.plain_rounds`).
        progress: called with a label after each timing (:func:`fusedlib.bench.core.measure_case`).

    Returns:
        The records (an implementation that failed is logged and left out, as the harness
        does, and printed with why).

    Raises:
        SystemExit: without a CUDA GPU.
        ValueError: a bad shape (every shape checked before the first is timed), or ``rounds``
            not an int >= 1.
    """
    if not torch.cuda.is_available():
        raise SystemExit("attention_block: needs a CUDA GPU")
    shapes = [tl._check_shape(shape) for shape in shapes]
    records = []
    for shape in shapes:
        case = block_case(shape)
        case.plain_rounds = rounds
        records += measure_case(case, torch.device("cuda"), passes=("fwd+bwd",), progress=progress)
        for name, why in case.skipped.items():
            print(f"{list(shape)} {name}: not timed ({why})", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", default="attention_block.json", help="where to write the records (JSON)")
    parser.add_argument("--sweep", action="store_true", help="add chapter 7's smallest stack")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder):  # found before minutes of timing, not after
        parser.error(f"--out must be a file's path in an existing folder, got {args.out!r}")
    shapes = [tl.DEFAULT_SHAPE, tl.GPT2_SMALL_SHAPE] + ([tl.SMALL_SHAPE] if args.sweep else [])
    records = measure(shapes)
    write_records(records, args.out)
    for r in records:
        replay = f"{r['ms']:8.3f} ms" if r.get("timer") == "cuda_graph" else "     n/a   "
        print(f"{r['shape']} {r['impl']:24s} replay {replay}  plain {r.get('ms_eager', r['ms']):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
