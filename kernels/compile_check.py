"""Compile the Triton kernels for a GPU target without a GPU (ahead of time, through ptxas).

The interpreter (TRITON_INTERPRET=1) checks what kernels compute, not that they compile: a
construct the interpreter accepts can still be rejected by Triton's compiler (or by an older
Triton, such as the 3.6 on the GPU machines).  This module builds every launch configuration
the launchers can pick, for sm_90 by default, with the installed Triton and its bundled ptxas:

    TRITON_INTERPRET=0 python -m transformer_fast.kernels.compile_check [--arch 90] [--resources]

It must run with the interpreter off (the @triton.jit decorators read TRITON_INTERPRET when
the kernels are imported).  --resources prints registers / spill stack per kernel (cuobjdump).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HIDDEN_SIZES = (1, 7, 127, 512, 768, 1000, 4096, 8192, 12288, 65536)
DTYPES = ("bf16", "fp16", "fp32")


def _signature(fn, types: dict, constexprs: dict) -> dict:
    return {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in fn.arg_names}


def _layer_norm_jobs(dtypes=DTYPES, sizes=HIDDEN_SIZES):
    """(kernel, arg types, constexprs, num_warps, label) for every config the launchers pick."""
    from transformer_fast.kernels import layer_norm as K

    jobs, seen = [], set()
    for dt in dtypes:
        types = {n: f"*{dt}" for n in ("X", "R", "Y", "H", "DY", "DH", "DX", "DRES", "B")}
        types.update(W="*fp32", MEAN="*fp32", RSTD="*fp32", C1="*fp32", C2="*fp32", RNG="*i64",
                     DW_PART="*fp64", DB_PART="*fp64", eps="fp32", drop_scale="fp32")
        for n in sizes:
            for drop in (False, True):
                fused, bm, bn, w = K._tile(n, K.FWD_MAX_FUSED, 1 << 14, K.MAX_BLOCK_M)
                key = ("fwd", dt, fused, bm, bn, w, drop)
                if key not in seen:
                    seen.add(key)
                    label = f"fwd {dt} N={n} BLOCK_M={bm} BLOCK_N={bn} warps={w} dropout={drop}"
                    jobs.append((K._fwd_kernel, types, dict(
                        HAS_W=True, HAS_B=True, HAS_DROPOUT=drop, STORE_H=True, COMPUTE_STATS=fused,
                        BLOCK_M=bm, BLOCK_N=bn, INTERPRET=False), w, label))
                    if not fused:
                        jobs.append((K._fwd_stats_kernel, types, dict(HAS_DROPOUT=drop, BLOCK_N=bn), w,
                                     "stats " + label))
                fused, bm, bn, w = K._tile(n, K.BWD_MAX_FUSED, 1 << 14, K.BWD_MAX_BLOCK_M)
                key = ("bwd", dt, fused, bm, bn, w, drop)
                if key not in seen:
                    seen.add(key)
                    label = f"bwd {dt} N={n} BLOCK_M={bm} BLOCK_N={bn} warps={w} dropout={drop}"
                    jobs.append((K._bwd_kernel, types, dict(
                        HAS_W=True, HAS_DW=True, HAS_DB=True, HAS_DH=True, HAS_DROPOUT=drop,
                        COMPUTE_STATS=fused, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=False), w, label))
                    if not fused:
                        jobs.append((K._bwd_stats_kernel, types, dict(HAS_W=True, HAS_DROPOUT=drop, BLOCK_N=bn),
                                     w, "stats " + label))
    return jobs


def _resources(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(" ".join(line.split()[:2]) for line in out.splitlines() if "REG:" in line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--resources", action="store_true", help="print registers / spill stack")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: run with TRITON_INTERPRET unset or 0", file=sys.stderr)
        return 2

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    jobs = _layer_norm_jobs(tuple(args.dtypes.split(",")))
    for fn, types, constexprs, num_warps, label in jobs:
        src = ASTSource(fn, _signature(fn, types, constexprs), constexprs=constexprs)
        try:
            kernel = triton.compile(src, target=target, options={"num_warps": num_warps})
        except Exception as exc:  # noqa: BLE001  (report every failing config)
            failures += 1
            print(f"FAIL {fn.__name__} {label}: {type(exc).__name__}: {exc}", flush=True)
            continue
        extra = f"  {_resources(kernel.asm['cubin'])}" if args.resources else ""
        print(f"ok   {fn.__name__} {label}{extra}", flush=True)
    print(f"compile_check: triton {triton.__version__} sm_{args.arch}: "
          f"{len(jobs) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
