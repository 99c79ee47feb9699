"""``python -m benchmarks``: per-op and end-to-end benchmarks (DESIGN section 8).

    python -m benchmarks --quick                       # a few shapes per op, minutes
    python -m benchmarks                               # the full sweep
    python -m benchmarks --op scaled_dot_product_attention --providers torch,triton --dtype bf16

Writes results.json, results.md and PNG plots (ops.png, end_to_end.png) to --output, else to
$OUT when set (as benchmarks/gpu_suite.sh), else benchmarks/results/<device-slug>/<date>-<commit>/.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

# Kept here (ops.OPS + models.MODEL_OPS; a test checks) so that --help and argument errors
# answer before torch is imported.
MODEL_OPS = ("encoder_layer", "decoder_layer", "inference", "train_step", "greedy_decode")
ALL_OPS = ("scaled_dot_product_attention", "attention_with_kv_cache", "masked_softmax",
           "add_layer_norm", "feed_forward", "ffn_gemm") + MODEL_OPS
PROVIDERS = ("reference", "torch", "torch.compile", "triton", "triton.dq_kernel", "triton.pointer", "cuda",
             "cuda.mma_sync", "cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="+", default=["all"], choices=ALL_OPS + ("all",),
                   help="ops to run (default all)")
    p.add_argument("--quick", action="store_true", help="a few shapes per op (minutes)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny shapes: tests
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--dtype", default=None,
                   help="comma list of float32/float16/bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDERS)} (default: all that can run); "
                        "end to end, torch selects torch.nn and ours:torch, <backend> selects ours:<backend>, "
                        "and torch.nn / torch.nn+compile / torch.nn+cuda_graph / ours:<backend> / ours:<backend>+cuda_graph / "
                        "ours:auto+logits / ours:auto+swap name one")
    p.add_argument("--output", default=None, type=Path, help="output folder (default: $OUT, else "
                   "benchmarks/results/<device-slug>/<date>-<commit>/)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own choice; 1 with the smoke test)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--match", nargs="+", default=None, metavar="TEXT",
                   help="per-op cases: keep those whose text (op, shape, mask, pass, e.g. "
                   "'scaled_dot_product_attention B=4 H=16 L=4096 D=128 causal fwd+bwd') contains "
                   "any TEXT; end-to-end ops are not filtered")
    p.add_argument("--compile-jobs", type=int, default=0,
                   help="before timing, call the compiling providers (triton, torch.compile) of every "
                   "op case once in this many processes, so that the timed run finds its kernels "
                   "compiled (default: one per CPU core, at most 16, on CUDA; 0 or 1: none)")
    args = p.parse_args(argv)
    args.mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
    if args.providers:
        ours = ("ours:auto",) + tuple(f"ours:{b}" for b in PROVIDERS if b not in ("torch.compile", "cuda.mma_sync", "triton.dq_kernel", "triton.pointer"))
        known = (PROVIDERS + ("torch.nn", "torch.nn+compile", "torch.nn+cuda_graph") + ours + tuple(o + "+cuda_graph" for o in ours)
                 + ("ours:auto+logits", "ours:auto+swap"))
        unknown = [n for n in args.providers.split(",") if n.strip() and n.strip() not in known]
        if unknown:
            p.error(f"--providers: unknown {', '.join(unknown)}; expected names from {', '.join(known)}")
        if "all" not in args.op and not set(args.op) & set(MODEL_OPS):
            # The end-to-end names (torch.nn, ours:...) select nothing in a per-op benchmark.
            model_only = [n.strip() for n in args.providers.split(",") if n.strip() and n.strip() not in PROVIDERS]
            if model_only:
                p.error(f"--providers: {', '.join(model_only)} name end-to-end providers, and --op "
                        f"{' '.join(args.op)} has none; per op the names are {', '.join(PROVIDERS)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1; got {args.threads}")
    if args.compile_jobs < 0:
        p.error(f"--compile-jobs must be >= 0; got {args.compile_jobs}")
    if args.output is not None:
        # A folder, made if missing: refused before any work when a file is in the way.
        existing = args.output.absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            p.error(f"--output {str(args.output)!r}: {str(existing)!r} is a file, not a folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from . import common, models, ops
    threads = args.threads or (1 if args.mode == "smoke" else None)
    if threads:
        # A shared or oversubscribed CPU makes OpenMP's spinning threads far slower than one.
        torch.set_num_threads(threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.dtype:
        try:
            dtypes = [common.DTYPES[d.strip()] for d in args.dtype.split(",")]
        except KeyError as exc:
            print(f"--dtype: unknown dtype {exc}; expected {', '.join(common.DTYPES)}", file=sys.stderr)
            return 2
    else:
        dtypes = [torch.bfloat16 if device.type == "cuda" else torch.float32]
    providers = list(ops.PROVIDERS)
    provider_filter = None
    if args.providers:
        provider_filter = [p.strip() for p in args.providers.split(",") if p.strip()]
        providers = [p for p in provider_filter if p in ops.PROVIDERS]
    selected = list(ALL_OPS) if "all" in args.op else list(dict.fromkeys(args.op))
    out_dir = args.output or common.default_output_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    common.log(f"benchmarks: {common.device_name(device)}, {args.mode}, dtypes "
               f"{', '.join(map(common.dtype_name, dtypes))}, ops {', '.join(selected)} -> {out_dir}")
    load = common.cpu_load()
    if device.type == "cpu" and load and load[0] > torch.get_num_threads():
        common.log(f"warning: load average {load[0]:.1f} exceeds the {torch.get_num_threads()} threads "
                   "in use: other jobs share these cores and every time below is inflated "
                   "(oversubscribed OpenMP threads can be 10-30x slower; --threads 1 suffers least)")
    malloc_note = ""
    if device.type == "cpu" and common.pin_cpu_malloc():
        malloc_note = common.CPU_MALLOC_NOTE + "."
        common.log(malloc_note)
    peaks = common.measure_peaks(device, args.mode)
    common.log(f"measured peaks: copy {peaks['copy_gbps']} GB/s, matmul {peaks['matmul_tflops']} TFLOP/s")

    skipped: dict[tuple, str] = {}

    def skip(provider, op, reasons):
        key = (provider, op, "; ".join(reasons))
        if key not in skipped:
            line = f"{op}: skipping {provider}: {'; '.join(reasons)}"
            skipped[key] = line
            common.log(line)

    rows: list[dict] = []
    argv_text = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)

    def write_results():
        # After every case, not only at the end: a run killed by its time limit (gpu_suite.sh's
        # step budget, a device call's 10 minutes) still leaves every row it measured.
        common.fill_speedups(rows)
        meta = common.collect_meta(device, peaks)
        common.write_json(out_dir / "results.json", meta, rows)
        common.write_markdown(out_dir / "results.md", meta, rows, list(skipped.values()), argv_text,
                              load=load if device.type == "cpu" else None, malloc_note=malloc_note)

    def wanted(case) -> bool:
        return args.match is None or any(text in case_text(case) for text in args.match)

    jobs = args.compile_jobs if args.compile_jobs else (min(os.cpu_count() or 1, 16) if device.type == "cuda" else 1)
    if jobs > 1:
        warm_start = time.perf_counter()
        tasks = [(op, args.mode, common.dtype_name(dt), i, providers, device.type)
                 for op in selected if op in ops.OPS for dt in dtypes
                 for i, case in enumerate(ops.cases(op, device, [dt], args.mode)) if wanted(case)]
        common.warm_in_processes(ops.warm_case, tasks, jobs)
        common.log(f"compiled ahead in {jobs} processes: {len(tasks)} cases in "
                   f"{time.perf_counter() - warm_start:.0f} s")
    def add_row(row):
        rows.append(row)
        write_results()

    # In the order of --op (a time-limited GPU run names what matters most first).
    ordered = [item for op in selected
               for item in ([c for c in ops.cases(op, device, dtypes, args.mode) if wanted(c)] if op in ops.OPS
                            else [op] if op in models.MODEL_OPS else [])]
    if not ordered and args.match:
        common.log(f"nothing to run: no case of {', '.join(selected)} matches --match {shlex.join(args.match or [])}")
        return 2
    bar = common.progress(ordered, "cases")
    for item in bar:
        if isinstance(item, str):  # an end-to-end op
            for dtype in dtypes:
                models.run(item, device, dtype, args.mode, peaks, skip, provider_filter, on_row=add_row)
        else:
            rows += ops.run_case(item, providers, device, args.mode, peaks, skip)
            write_results()

    write_results()
    plots = [] if args.no_plots else common.write_plots(out_dir, rows, ops.X_KEYS)
    failed = [r for r in rows if str(r["shape"].get("note", "")).startswith("failed")]
    common.log(f"{len(rows)} rows ({len(failed)} failed) in {time.perf_counter() - start:.0f} s: "
               f"{', '.join(str(p) for p in [out_dir / 'results.json', out_dir / 'results.md', *plots])}")
    return 1 if failed else 0


def case_text(case) -> str:
    """What --match looks in: 'op shape mask pass' (the shape as results.md writes it)."""
    from . import common

    return f"{case.op} {common._shape_text(case.shape)} {case.mask} {case.shape['pass']}"


if __name__ == "__main__":
    sys.exit(main())
