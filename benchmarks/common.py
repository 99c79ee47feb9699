"""What every benchmark shares: timing, measured peaks, peak memory, errors, rows and output.

Timing (DESIGN section 8):
- GPU: ``triton.testing.do_bench`` (L2 flushed before every call, median and 20/80 quantiles);
  ``do_bench_cudagraph`` for steps so small that launch overhead would be measured instead.
- CPU: ``torch.utils.benchmark.Timer``; the quantiles come from the measurement's own per-run
  times (``Measurement.times``), never from a re-run.
Warm-up runs outside the timed region (both timers do it, and ``bench`` calls the function once
before timing: compilation, autotuning and allocator growth stay out of the numbers).

A row of results.json has exactly ROW_KEYS; ``shape`` is a free dict that also carries the
pass ("fwd" / "fwd+bwd") and, for end-to-end rows, tokens/s and notes.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = (
    "op", "provider", "dtype", "mask", "shape", "median_ms", "p20_ms", "p80_ms", "tflops",
    "gbps", "pct_peak", "max_err", "peak_mem_mb", "speedup_vs_reference", "speedup_vs_torch",
)
META_KEYS = ("device", "sm_count", "torch", "triton", "cuda", "commit", "date", "peaks")
QUANTILES = [0.5, 0.2, 0.8]
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _warm_worker_init() -> None:
    torch.set_num_threads(1)


def warm_in_processes(fn, tasks, jobs: int) -> None:
    """``fn(*task)`` for every task in ``jobs`` spawned processes (CUDA cannot be forked), each
    result logged; for their side effects only (compilation caches on disk).  A process that
    dies ends the warm-up early: the timed run then compiles what is left itself."""
    import concurrent.futures as cf
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(min(jobs, max(len(tasks), 1)), mp_context=ctx,
                                initializer=_warm_worker_init) as pool:
        futures = [pool.submit(fn, *t) for t in tasks]
        for fut in cf.as_completed(futures):
            try:
                log(f"  warm: {fut.result()}")
            except cf.process.BrokenProcessPool:
                log("  warm: a process died; the timed run compiles what is left")
                for other in futures:
                    other.cancel()
                return
            except Exception as exc:  # noqa: BLE001
                log(f"  warm: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")


def log(msg: str) -> None:
    """Messages go to stderr so they do not tear the progress bar (tqdm writes there too)."""
    try:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)


def progress(items: Sequence, desc: str):
    try:
        from tqdm import tqdm

        # Into a log file (gpu_suite.sh), a progress line every 30 s instead of a live bar.
        tty = sys.stderr.isatty()
        return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=tty, leave=True,
                    mininterval=0.1 if tty else 30.0, ascii=not tty)
    except ImportError:
        return items


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Timing


def cpu_cache_bytes() -> int:
    """The last-level cache size (inputs smaller than a few of it are rotated)."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
            return int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return 32 << 20


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 50 << 20))
    return cpu_cache_bytes()


def rotation_count(set_bytes: int, device: torch.device, limit: int = 8) -> int:
    """How many copies of the inputs to cycle through so that a call cannot find its inputs in
    cache from the previous call: enough to cover twice the cache, at most ``limit``."""
    if set_bytes <= 0:
        return 1
    return max(1, min(limit, math.ceil(2 * cache_bytes(device) / set_bytes)))


class Rotator:
    """Cycles through input sets: ``next(rotator)`` gives the next one."""

    def __init__(self, sets: list):
        self.sets = sets
        self.i = 0

    def __next__(self):
        item = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return item

    def __iter__(self):
        return self


def _quantiles_ms(times_s: Sequence[float]) -> tuple[float, float, float]:
    t = torch.tensor(list(times_s), dtype=torch.float64) * 1e3
    q = torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def time_cpu(fn: Callable[[], object], min_run_time: float) -> tuple[float, float, float]:
    """(median, p20, p80) in ms from torch.utils.benchmark's per-run times."""
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    start = time.perf_counter()
    fn()  # warm-up, and an estimate of one call
    one = time.perf_counter() - start
    # blocked_autorange times blocks of runs (one run per block for slow calls) until
    # min_run_time has passed: ask for at least ~4 blocks so the quantiles mean something.
    times = list(timer.blocked_autorange(min_run_time=max(min_run_time, 4 * one)).times)
    while len(times) < 4:
        times += list(timer.blocked_autorange(min_run_time=max(min_run_time, one) / 2).times)
    return _quantiles_ms(times)


SLOW_CALL_MS = 100.0  # time_gpu --quick: calls at least this long get ~3 repeats


def time_gpu(fn: Callable[[], object], cudagraph: bool = False, quick: bool = False):
    """(median, p20, p80, timer) in ms with Triton's do_bench (L2 flushed) or, for tiny steps,
    do_bench_cudagraph (no launch overhead); falls back to do_bench when capture fails."""
    import triton.testing

    fn()  # warm-up: compile, autotune, grow the caching allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - start) * 1e3
    if quick and one_ms >= SLOW_CALL_MS:
        # Whole-model calls (greedy decoding, 0.1-2 s each): do_bench adds 5 estimating calls
        # and a warm-up to its repeats (11 calls a row for 3 repeats, 15-43 s per eager decoding
        # row in H100 run 5).  --quick: the timed call above and two more, wall clock around a
        # synchronize (microseconds against a call of 100 ms or more); median, min, max.
        times = [one_ms]
        for _ in range(2):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return times[1], times[0], times[2], "wall clock, 3 calls"
    # do_bench repeats for ``rep`` ms: ask for at least ~10 calls so the quantiles mean something
    rep = max(50 if quick else 100, min(10 * one_ms, 5000))  # slow calls: at least ~5 of them
    if cudagraph:
        try:
            q = triton.testing.do_bench_cudagraph(fn, rep=max(20, rep / 2), quantiles=QUANTILES)
            return tuple(float(v) for v in q) + ("cudagraph",)
        except Exception as exc:  # a host sync in fn breaks the capture
            torch.cuda.synchronize()
            reason = f"do_bench (CUDA graph capture failed: {type(exc).__name__})"
            q = triton.testing.do_bench(fn, warmup=max(10, one_ms), rep=rep, quantiles=QUANTILES)
            return tuple(float(v) for v in q) + (reason,)
    q = triton.testing.do_bench(fn, warmup=max(10 if quick else 25, one_ms), rep=rep,
                                quantiles=QUANTILES)
    return tuple(float(v) for v in q) + ("do_bench",)


MIN_RUN_TIME = {"full": 1.0, "quick": 0.2, "smoke": 0.01}  # CPU timing budget per row, s


def bench(fn: Callable[[], object], device: torch.device, mode: str, cudagraph: bool = False):
    """(median_ms, p20_ms, p80_ms, timer) for ``fn`` on ``device``; mode full / quick / smoke."""
    if device.type == "cuda":
        return time_gpu(fn, cudagraph=cudagraph, quick=mode != "full")
    return time_cpu(fn, MIN_RUN_TIME[mode]) + ("torch.utils.benchmark",)


# --------------------------------------------------------------------------------------------
# Peak memory of one call


_LIBC = None


def _malloc_thresholds(low: bool) -> None:
    """glibc: with ``low``, blocks over 256 KiB are mmap-ed and returned to the OS at free, so
    the resident set size follows live CPU tensors (for the memory measurement); otherwise
    fixed at the 32 MiB mmap threshold glibc's dynamic threshold grows to, so that timings run
    with the allocator reusing freed blocks as it normally does."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.mallopt(-3, (256 << 10) if low else (32 << 20))  # M_MMAP_THRESHOLD
        _LIBC.mallopt(-1, (256 << 10) if low else (64 << 20))  # M_TRIM_THRESHOLD
        if low:
            # Free blocks kept by earlier (timed) calls would be reused without a page fault,
            # invisible to the resident set: hand their pages back first.
            _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """Memory one call allocates above what was live before it, at its peak, in MB (1e6).
    GPU: torch.cuda.max_memory_allocated.  CPU: peak resident set size (VmHWM, reset through
    /proc/self/clear_refs) minus the resident set before the call; None where unavailable."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del result
        return (peak - before) / 1e6
    _malloc_thresholds(low=True)
    try:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            return None
        before = _status_kb("VmRSS")
        result = fn()
        peak = _status_kb("VmHWM")
        del result
    finally:
        _malloc_thresholds(low=False)
    if before is None or peak is None:
        return None
    return max(0.0, (peak - before) * 1024 / 1e6)


# --------------------------------------------------------------------------------------------
# Peaks measured in the same run


def measure_peaks(device: torch.device, mode: str) -> dict:
    """{"copy_gbps", "matmul_tflops"}: a large copy (bytes read + written) and a large matmul
    (bf16 on GPU, fp32 on CPU), random data."""
    if device.type == "cuda":
        n = (1 << 30) // 2  # 1 GiB of bf16 per buffer
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy_ms = bench(lambda: dst.copy_(src), device, mode)[0]
        copy_gbps = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e9
        del src, dst
        m = 8192
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        mm_ms = bench(lambda: a @ b, device, mode)[0]
        del a, b
        torch.cuda.empty_cache()
    else:
        n = (16 if mode == "smoke" else 256) * (1 << 20) // 4  # 256 MiB of fp32 per buffer: far beyond the caches
        src = torch.randn(n)
        dst = torch.empty_like(src)
        copy_ms = bench(lambda: dst.copy_(src), device, mode)[0]
        copy_gbps = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e9
        del src, dst
        m = {"full": 2048, "quick": 1024}.get(mode, 256)
        a, b = torch.randn(m, m), torch.randn(m, m)
        mm_ms = bench(lambda: a @ b, device, mode)[0]
    return {"copy_gbps": round(copy_gbps, 2), "matmul_tflops": round(2 * m**3 / (mm_ms * 1e-3) / 1e12, 4)}


# --------------------------------------------------------------------------------------------
# Errors


def max_err(outs: Iterable[torch.Tensor], refs: Iterable[torch.Tensor]) -> float:
    """max |out - ref64| over every output and gradient (a NaN or Inf counts as inf)."""
    from transformer_fast import reference

    worst = 0.0
    for out, ref in zip(outs, refs):
        worst = max(worst, reference.max_abs_error(out, ref))
    return worst


# --------------------------------------------------------------------------------------------
# Rows


def make_row(op, provider, dtype, mask, shape, timing=None, *, flops=None, bytes_moved=None,
             peaks=None, error=None, peak_mem=None) -> dict:
    """One results.json row (exactly ROW_KEYS).  ``timing`` is (median, p20, p80, ...) ms or
    None (a row that could not run: it says why in shape["note"])."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(op=op, provider=provider, dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
               mask=mask, shape=dict(shape))
    if timing is not None:
        median, p20, p80 = timing[:3]
        row.update(median_ms=_r(median), p20_ms=_r(p20), p80_ms=_r(p80))
        if flops is not None:
            row["tflops"] = _r(flops / (median * 1e-3) / 1e12)
            if peaks and peaks.get("matmul_tflops"):
                row["pct_peak"] = _r(100 * row["tflops"] / peaks["matmul_tflops"])
        if bytes_moved is not None:
            row["gbps"] = _r(bytes_moved / (median * 1e-3) / 1e9)
            if peaks and peaks.get("copy_gbps"):
                row["pct_peak"] = _r(100 * row["gbps"] / peaks["copy_gbps"])
    if error is not None and not math.isfinite(error):  # JSON has no inf: null, and say why
        row["shape"]["note"] = ("output or gradient not finite where the float64 reference is; "
                                + row["shape"].get("note", "")).strip("; ")
        error = None
    row["max_err"] = None if error is None else float(error)
    row["peak_mem_mb"] = None if peak_mem is None else _r(peak_mem)
    return row


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def row_group(row: dict) -> tuple:
    """Rows that measure the same work (for the speedup columns)."""
    return (row["op"], row["dtype"], row["mask"],
            json.dumps({k: v for k, v in row["shape"].items() if k not in ("note", "tokens_per_s", "timer", "tuned")},
                       sort_keys=True))


def fill_speedups(rows: list[dict], reference_name: str = "reference", torch_names=("torch", "torch.nn")) -> None:
    """speedup_vs_reference / speedup_vs_torch = their median / this row's median."""
    groups: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row["median_ms"]:
            groups.setdefault(row_group(row), {})[row["provider"]] = row["median_ms"]
    for row in rows:
        if not row["median_ms"]:
            continue
        medians = groups.get(row_group(row), {})
        if reference_name in medians:
            row["speedup_vs_reference"] = _r(medians[reference_name] / row["median_ms"])
        for name in torch_names:
            if name in medians:
                row["speedup_vs_torch"] = _r(medians[name] / row["median_ms"])


# --------------------------------------------------------------------------------------------
# Meta and output


def device_name(device: torch.device) -> str:
    """The GPU's name; on a CPU its model name with, in parentheses, its x86 family / model (the
    same name has covered CPUs of different speeds: benchmarks/NOTES.md, "The cpu FFN on a Zen 4"),
    AVX-512 where present, and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, details = platform.processor() or "cpu", []
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if not name.strip():
                break  # the first processor's block only
            fields.setdefault(name.strip(), value.strip())
        model = fields.get("model name", model)
        if "cpu family" in fields and "model" in fields:
            details.append(f"family {fields['cpu family']} model {fields['model']}")
        if "avx512f" in fields.get("flags", "").split():
            details.append("AVX-512")
    except OSError:
        pass
    details = ", ".join(details) + "; " if details else ""
    return f"CPU {model} ({details}{torch.get_num_threads()} threads)"


def device_slug(device: torch.device) -> str:
    """Folder name for a device, as benchmarks/gpu_suite.sh computes it (spaces -> '_')."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu-" + re.sub(r"\(.*?\)", "", device_name(device)[4:]).strip()
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def git_commit() -> str:
    """The measured commit: TRANSFORMER_FAST_COMMIT when set (a copy of the tree without .git, as
    on a lent GPU machine, is told it by benchmarks/gpu_suite.sh's caller), else git's."""
    if os.environ.get("TRANSFORMER_FAST_COMMIT"):
        return os.environ["TRANSFORMER_FAST_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "csrc", "kernels",
                                "transformer_fast", "benchmarks/*.py"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def default_output_dir(device: torch.device) -> Path:
    """$OUT when set (as benchmarks/gpu_suite.sh), else
    benchmarks/results/<device-slug>/<date>-<commit>/."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return ROOT / "benchmarks" / "results" / device_slug(device) / f"{date}-{git_commit()}"


def collect_meta(device: torch.device, peaks: dict) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "device": device_name(device),
        "sm_count": props.multi_processor_count if props else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "peaks": peaks,
    }


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def triton_autotuners() -> dict:
    """{name: Autotuner} of our Triton kernels (module.attribute), for recording the configs the
    autotuner chose in a benchmark row."""
    try:
        import importlib

        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001  (no Triton: nothing to record)
        return {}
    found = {}
    for mod in ("attention", "decode", "ffn", "layer_norm", "masked_softmax"):
        try:
            module = importlib.import_module(f"transformer_fast.kernels.{mod}")
        except Exception:  # noqa: BLE001
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, Autotuner):
                found[f"{mod}.{name.lstrip('_')}"] = obj
    return found


def tuned_configs(tuners: dict) -> str:
    """The configs ``tuners`` ran last, e.g. "attention.fwd 128x64 w8 s3; ..." (those that ran
    since their best_config was cleared)."""
    parts = []
    for name, tuner in tuners.items():
        cfg = getattr(tuner, "best_config", None)
        if cfg is None:
            continue
        kw = cfg.kwargs
        tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in kw)
        parts.append(f"{name} {tile} w{cfg.num_warps} s{cfg.num_stages}")
    return "; ".join(parts)


def _shape_text(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items()
                    if k not in ("note", "pass", "timer", "config", "tokens_per_s", "tuned"))


# glibc malloc: give freed memory back to the OS never, and take blocks of up to 32 MiB (its
# maximum) from the heap instead of a fresh mmap.  Otherwise every large tensor a call allocates
# can arrive as fresh pages that fault in (and are zeroed) on first touch: on this build machine
# that made CPU timings bimodal (add_layer_norm forward+backward at 4096 x 1024: 1.2M-1.6M page
# faults per 300 calls and 3.6-11 ms, against ~0 and 3.6-3.9 ms pinned; benchmarks/NOTES.md).  It
# is what a caching allocator (jemalloc, tcmalloc) gives a training loop, for every provider alike.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
CPU_MALLOC_NOTE = ("glibc malloc pinned for the run (no trimming, heap blocks up to 32 MiB, 256 MiB "
                   "top pad), as a caching allocator would: fresh-page faults otherwise dominate")


def pin_cpu_malloc() -> bool:
    """Apply the settings above through mallopt; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(opt, val) == 1 for opt, val in ((_M_TRIM_THRESHOLD, 2**31 - 1),
                                                       (_M_TOP_PAD, 256 << 20),
                                                       (_M_MMAP_THRESHOLD, 32 << 20)))


def cpu_load() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


def write_markdown(path: Path, meta: dict, rows: list[dict], skipped: list[str], argv: str,
                   load=None, malloc_note: str = "") -> None:
    lines = [
        f"# Benchmarks: {meta['device']}",
        "",
        f"`{argv}` — commit {meta['commit']}, {meta['date']}; torch {meta['torch']}, "
        f"Triton {meta['triton']}, CUDA {meta['cuda']}, SMs {meta['sm_count']}.",
        f"Peaks measured in this run: copy {meta['peaks'].get('copy_gbps')} GB/s (bytes read + "
        f"written), matmul {meta['peaks'].get('matmul_tflops')} TFLOP/s "
        f"({'bf16' if meta['sm_count'] else 'fp32'}).",
        (f"CPU load average when the run started: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on "
         f"{os.cpu_count()} cores, {torch.get_num_threads()} threads used." if load else ""),
        malloc_note,
        "",
        "Times in ms (median, 20%–80%); TFLOP/s (attention 4·B·H·Lq·Lk·D, halved for causal "
        "masks, x2.5 fwd+bwd; FFN 4·M·d_model·d_ff, x3 fwd+bwd) or GB/s (bytes that must move "
        "once); % of the measured peak; max |error| vs float64 on the same input (outputs and, "
        "for fwd+bwd, gradients); memory the call allocates above its inputs at its peak (MB); "
        "speedups against the naive reference and against PyTorch.",
        "",
    ]
    ops = []
    for row in rows:
        if row["op"] not in ops:
            ops.append(row["op"])
    for op in ops:
        configs = sorted({r["shape"]["config"] for r in rows if r["op"] == op and "config" in r["shape"]})
        lines += [f"## {op}", ""] + [f"Model: {c}." for c in configs] + ([""] if configs else []) + [
                  "| pass | shape | dtype | mask | provider | median ms | p20–p80 | TFLOP/s | GB/s | % peak | max err | mem MB | vs ref | vs torch | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["op"] == op):
            s = r["shape"]
            spread = "—" if r["p20_ms"] is None else f"{_fmt(r['p20_ms'])}–{_fmt(r['p80_ms'])}"
            note = s.get("note", "")
            if s.get("tuned"):
                note = (note + "; " if note else "") + f"tuned: {s['tuned']}"
            if "tokens_per_s" in s:
                note = (f"{s['tokens_per_s']:.4g} tokens/s; " + note).rstrip("; ")
            lines.append(
                f"| {s.get('pass', '')} | {_shape_text(s)} | {r['dtype']} | {r['mask']} | {r['provider']} | "
                f"{_fmt(r['median_ms'])} | {spread} | {_fmt(r['tflops'])} | {_fmt(r['gbps'])} | "
                f"{_fmt(r['pct_peak'])} | {_fmt(r['max_err'])} | {_fmt(r['peak_mem_mb'])} | "
                f"{_fmt(r['speedup_vs_reference'])} | {_fmt(r['speedup_vs_torch'])} | {note} |"
            )
        lines.append("")
    if skipped:
        lines += ["## Providers not run", ""] + [f"- {s}" for s in skipped] + [""]
    path.write_text("\n".join(lines))


_COLORS = {"reference": "tab:gray", "torch": "tab:blue", "triton": "tab:orange", "cuda": "tab:green",
           "cuda.mma_sync": "tab:olive", "triton.dq_kernel": "tab:cyan", "triton.pointer": "tab:brown",
           "cpu": "tab:red", "auto": "tab:purple"}


def _color(provider: str):
    """One colour per implementation (ours:<backend> takes <backend>'s)."""
    if provider.startswith("torch.nn"):
        return "tab:pink" if "compile" in provider else "tab:brown"
    return _COLORS.get(provider.split(":", 1)[-1])


def write_plots(out_dir: Path, rows: list[dict], x_keys: dict[str, str], max_files: int = 2) -> list[Path]:
    """Multi-panel PNGs (few files: a run keeps to at most 8): ops.png has one panel per op and
    mask kind (TFLOP/s or GB/s vs the op's size axis, one line per provider, solid fwd, dashed
    fwd+bwd); end_to_end.png one panel per end-to-end op (tokens/s per provider)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return []
    written = []
    op_rows = [r for r in rows if r["op"] in x_keys and r["median_ms"]]
    panels = []
    for r in op_rows:
        key = (r["op"], r["mask"])
        if key not in panels:
            panels.append(key)
    if panels:
        cols = min(4, len(panels))
        nrows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
        for ax, (op, mask) in zip(axes.flat, panels):
            sel = [r for r in op_rows if r["op"] == op and r["mask"] == mask]
            metric = "tflops" if any(r["tflops"] is not None for r in sel) else "gbps"
            series: dict[tuple, list] = {}
            for r in sel:
                s = r["shape"]
                rest = {k: v for k, v in s.items() if k not in (x_keys[op], "pass", "note", "timer", "B")}
                label = (r["provider"], s.get("pass", "fwd"), r["dtype"], json.dumps(rest, sort_keys=True))
                series.setdefault(label, []).append((s.get(x_keys[op]), r[metric]))
            for (provider, pas, dtype, rest), pts in sorted(series.items()):
                pts = sorted(p for p in pts if p[0] is not None and p[1] is not None)
                if not pts:
                    continue
                extra = ",".join(f"{k}{v}" for k, v in json.loads(rest).items())
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        linestyle="-" if pas == "fwd" else "--", color=_color(provider),
                        label=f"{provider} {pas} {dtype} {extra}".strip())
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}\nmask={mask}", fontsize=8)
            ax.set_xlabel(x_keys[op], fontsize=7)
            ax.set_ylabel("TFLOP/s" if metric == "tflops" else "GB/s", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=4.5)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / "ops.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    e2e = [r for r in rows if r["op"] not in x_keys and r["shape"].get("tokens_per_s")]
    if e2e and len(written) < max_files:
        names = []
        for r in e2e:
            if r["op"] not in names:
                names.append(r["op"])
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
        for ax, op in zip(axes.flat, names):
            sel = [r for r in e2e if r["op"] == op]
            labels = [f"{r['provider']}\n{r['shape'].get('pass', '')} {r['mask']}".strip() for r in sel]
            ax.barh(range(len(sel)), [r["shape"]["tokens_per_s"] for r in sel],
                    color=[_color(r["provider"]) or "tab:purple" for r in sel])
            ax.set_yticks(range(len(sel)), labels, fontsize=5)
            ax.set_xlabel("tokens/s", fontsize=7)
            ax.set_title(op, fontsize=8)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        path = out_dir / "end_to_end.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
