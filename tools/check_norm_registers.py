"""Compile the norm kernels for an H100/H200 (sm_90) without a GPU; print registers, spills, shared memory.

Usage (any machine with triton's bundled CUDA tools, no GPU needed):
    python tools/check_norm_registers.py                 # every row of the two tables
    python tools/check_norm_registers.py 4096 16384      # chosen hidden sizes
    python tools/check_norm_registers.py --fp64 8        # float64 inputs (gradcheck's kernels)

For each hidden size, LayerNorm and RMSNorm, forward and backward (and the memory-efficient
backward), with the tables' Tile and bf16 inputs, it prints REG (registers per
thread), LOCAL (bytes spilled per thread: should be 0), SMEM (bytes of shared memory per
program: the pipeline's stage buffers and reduction scratch) and the programs per SM that
those allow. The tables in fusedlib/kernels/layer_norm.py were checked with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, even on a machine without a GPU
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from fusedlib.kernels import layer_norm as L  # noqa: E402
from fusedlib.kernels.launch import pick  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SM_REGISTERS, SM_THREADS, SM_SMEM = 65536, 2048, 227 * 1024


def compile_kernel(kernel, signature, constexprs, aligned, num_warps):
    """(registers, spilled bytes, shared bytes) of ``kernel`` compiled for sm_90."""
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # 16-byte aligned, as at run time
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
    backend = make_backend(TARGET)
    options = backend.parse_options({"num_warps": num_warps}).__dict__
    compiled = triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = dict(kv.split(":") for kv in next(line for line in out.splitlines() if "REG:" in line).split())
    return int(usage["REG"]), int(usage["LOCAL"]), compiled.metadata.shared


def programs_per_sm(regs, num_warps, smem):
    threads = 32 * num_warps
    return min(SM_REGISTERS // (max(regs, 1) * threads), SM_THREADS // threads, SM_SMEM // smem if smem else 32)


def main(hidden_sizes, dtype="bf16"):
    """Compile every kernel the tables pick for ``hidden_sizes`` with ``dtype`` inputs
    ("bf16", or "fp64": float64 inputs compute in float64) and print its resources."""
    acc, stat = (tl.float64, "*fp64") if dtype == "fp64" else (tl.float32, "*fp32")
    elem = f"*{dtype}"
    for h in hidden_sizes:
        block_n = triton.next_power_of_2(h)
        aligned_dims = ["n_cols"] if h % 16 == 0 else []
        for rms in (False, True):
            name = "RMSNorm  " if rms else "LayerNorm"
            cf = pick(L.FWD_TILES, h)
            sig = {"X_ptr": elem, "Y_ptr": elem, "W_ptr": elem, "B_ptr": elem, "MEAN_ptr": stat,
                   "RSTD_ptr": stat, "ERR_ptr": "*i64", "n_rows": "i32", "n_cols": "i32", "X_row_stride": "i32",
                   "X_col_stride": "i32", "eps": "fp32", "rows_per_program": "i32", "LB_ptr": elem, "R_ptr": elem,
                   "H_ptr": elem, "SEED_ptr": "*i64", "R_row_stride": "i32", "R_col_stride": "i32", "T": "i32",
                   "scale": "fp32"}
            const = dict(X_col_stride=1, BLOCK_M=cf.BLOCK_M, BLOCK_N=block_n, IS_RMS_NORM=rms, HAS_BIAS=not rms,
                         ZERO_CENTERED_GAMMA=False, NUM_STAGES=cf.num_stages, ACC=acc, CHECK_GAMMA=False,
                         ADD_IN=False, HAS_LB=False, DROPOUT=False, STORE_STATS=True)
            if cf.programs_per_sm == 0 and cf.BLOCK_M == 1:
                const["rows_per_program"] = 1  # Triton specializes an int argument equal to 1
            aligned = ["X_ptr", "Y_ptr", "W_ptr", "B_ptr", "MEAN_ptr", "RSTD_ptr", "n_rows"] + aligned_dims + (
                ["X_row_stride"] if aligned_dims else [])
            r = compile_kernel(L._norm_fwd_kernel, sig, const, aligned, cf.num_warps)
            print(f"h={h:5d} {dtype} {name} fwd {cf}: REG={r[0]} LOCAL={r[1]} SMEM={r[2]} "
                  f"-> {programs_per_sm(r[0], cf.num_warps, r[2])} programs/SM", flush=True)
            cb = pick(L.RMS_BWD_TILES if rms else L.BWD_TILES, h)
            bwd_block = cb.BLOCK_N  # below block_n: the split backward
            split = bwd_block < block_n
            for me in (False, True):
                if split:
                    s_tile = L._ROW_STATS_TILES["cuda"]
                    s_m, s_n, s_warps = s_tile.BLOCK_M, s_tile.BLOCK_N, s_tile.num_warps
                    sig = {"DY_ptr": elem, "X_ptr": elem, "W_ptr": elem, "B_ptr": elem, "MEAN_ptr": stat,
                           "RSTD_ptr": stat, "C_ptr": stat, "n_rows": "i32", "n_cols": "i32", "DY_row_stride": "i32",
                           "DY_col_stride": "i32", "X_row_stride": "i32", "X_col_stride": "i32"}
                    const = dict(DY_col_stride=1, X_col_stride=1, BLOCK_M=s_m, BLOCK_N=min(s_n, block_n),
                                 IS_RMS_NORM=rms, HAS_BIAS=not rms, ZERO_CENTERED_GAMMA=False, MEMORY_EFFICIENT=me,
                                 ACC=acc)
                    aligned = ["DY_ptr", "X_ptr", "W_ptr", "B_ptr", "MEAN_ptr", "RSTD_ptr", "C_ptr",
                               "n_rows"] + aligned_dims + (["DY_row_stride", "X_row_stride"] if aligned_dims else [])
                    r = compile_kernel(L._norm_bwd_row_stats_kernel, sig, const, aligned, s_warps)
                    print(f"h={h:5d} {dtype} {name} bwd row sums{' (memory-efficient)' if me else ''}: "
                          f"REG={r[0]} LOCAL={r[1]} SMEM={r[2]} -> {programs_per_sm(r[0], s_warps, r[2])} programs/SM",
                          flush=True)
                sig = {"DY_ptr": elem, "X_ptr": elem, "W_ptr": elem, "B_ptr": elem, "MEAN_ptr": stat,
                       "RSTD_ptr": stat, "C_ptr": stat, "DX_ptr": elem, "PARTIAL_ptr": stat, "DRES_ptr": elem,
                       "n_rows": "i32", "n_cols": "i32", "DY_row_stride": "i32", "DY_col_stride": "i32",
                       "X_row_stride": "i32", "X_col_stride": "i32", "DRES_row_stride": "i32",
                       "DRES_col_stride": "i32", "rows_per_program": "i32", "DXIN_ptr": elem, "SEED_ptr": "*i64",
                       "T": "i32", "scale": "fp32"}
                # with the residual's gradient added (HAS_DRES), as a transformer layer's norms run
                const = dict(DY_col_stride=1, X_col_stride=1, DRES_col_stride=1, BLOCK_M=cb.BLOCK_M,
                             BLOCK_N=bwd_block, IS_RMS_NORM=rms, HAS_BIAS=not rms, ZERO_CENTERED_GAMMA=False,
                             MEMORY_EFFICIENT=me, SPLIT=split, NUM_STAGES=cb.num_stages, ACC=acc, HAS_DRES=True,
                             HAS_DLB=False, DLB_ROW=2 if not rms else 1, DROPOUT=False, STORE_DXIN=False)
                aligned = ["DY_ptr", "X_ptr", "W_ptr", "B_ptr", "MEAN_ptr", "RSTD_ptr", "C_ptr", "DX_ptr",
                           "PARTIAL_ptr", "DRES_ptr", "n_rows"] + aligned_dims + (
                    ["DY_row_stride", "X_row_stride", "DRES_row_stride"] if aligned_dims else [])
                r = compile_kernel(L._norm_bwd_kernel, sig, const, aligned, cb.num_warps)
                print(f"h={h:5d} {dtype} {name} bwd{' (memory-efficient)' if me else ''} {cb}: "
                      f"REG={r[0]} LOCAL={r[1]} SMEM={r[2]} -> {programs_per_sm(r[0], cb.num_warps, r[2])} programs/SM",
                      flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    dtype = "fp64" if "--fp64" in args else "bf16"
    sizes = [int(a) for a in args if a != "--fp64"] or [bound for bound, _ in L.FWD_TILES]
    main(sizes, dtype)
