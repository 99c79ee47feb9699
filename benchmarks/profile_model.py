"""Where a whole-model step's time goes: the training step (or inference) of benchmarks/models.py
under the profiler, torch.nn against ours.

    python benchmarks/profile_model.py --op train_step --providers torch.nn,ours:auto,ours:torch,ours:cuda

The models, inputs and step functions are exactly the benchmark's (a models.Runner whose
``measure`` profiles instead of timing).  For each provider, after a warm-up:

* ``wall``: ms per step over ``--iters`` back-to-back steps, the device synchronised only at the
  ends (what a training loop sees); ``host``: ms per step to issue the same steps without waiting
  (a step whose host time is close to its wall time is bound by the host: Python, dispatch,
  launches);
* from one profiled step: host time of its forward, backward and optimizer (models.py's named
  ranges) and each range's window on the device, the kernels' summed device time and count, the time the device was
  busy (the union of the kernels' intervals) against the step's span, the longest idle gaps of
  the device with the kernel that ended each, the device time by kind of kernel (GEMM,
  attention, elementwise, optimizer, ...), the five largest kernels, the CUDA runtime calls
  that block the host or allocate (synchronize, device-to-host copies, cudaMalloc / cudaFree)
  with their counts (one cudaDeviceSynchronize is the profiler's own, ending the step), and the
  CPU ops with the most host time;
* on a GPU, the operations that synchronised the host during one step, by name
  (``torch.cuda.set_sync_debug_mode("warn")``);
* ``--python-top N``: the N Python functions with the most own time (cProfile).

Printed as text (gpu_suite.sh's ``profile_model`` step keeps it in logs.txt).  On a CPU the
device columns are empty and the host columns are the whole step.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import models  # noqa: E402
from benchmarks.profile_ops import _per_call_ms, _python_top, _short, _sync  # noqa: E402

# Kernel kinds, first match wins (names from cuBLAS / cuDNN / PyTorch / our Triton and CUDA kernels).
KINDS = (
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|_mm_|sm90_|sm80_|ampere_|Kernel2"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("layer_norm", r"layer_norm|layernorm|LayerNorm"),
    ("softmax / loss", r"softmax|cross_entropy|nll_loss|log_softmax"),
    ("dropout / random", r"dropout|philox|bernoulli|rand"),
    ("embedding / index", r"embedding|index|scatter|gather"),
    ("reduction", r"reduce"),
    ("copy / fill", r"copy|fill|memset|memcpy|cat|Memset|Memcpy"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|where|masked"),
)
# CUDA runtime / driver calls that wait for the device or allocate: each is worth naming.
BLOCKING = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaMalloc|cudaFree|cuMemAlloc|cuMemFree|cudaHostAlloc")
DEVICE_TO_HOST = re.compile(r"cudaMemcpyAsync|cuMemcpyDtoH")


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def busy_union_ms(intervals) -> float:
    """Summed length (ms) of the union of (start_us, end_us) intervals."""
    total, end_seen = 0.0, None
    for start, end in sorted(intervals):
        if end_seen is None or start > end_seen:
            total += end - start
            end_seen = end
        elif end > end_seen:
            total += end - end_seen
            end_seen = end
    return total / 1e3


def idle_gaps(intervals, top: int = 5):
    """The ``top`` longest gaps (ms) between consecutive kernel intervals, with the index of the
    interval that ended before each: [(gap_ms, index)]."""
    gaps, end_seen, last = [], None, None
    for index, (start, end) in sorted(enumerate(intervals), key=lambda kv: kv[1]):
        if end_seen is not None and start > end_seen:
            gaps.append(((start - end_seen) / 1e3, last))
        if end_seen is None or end > end_seen:
            end_seen, last = end, index
    return sorted(gaps, reverse=True)[:top]


def profile_step(fn, device: torch.device) -> dict:
    """One profiled call of ``fn``: kernels, device busy time, idle gaps, blocking runtime calls
    and the host ops with the most time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    kernels, host, runtime, phases, windows = [], {}, {}, {}, {}
    host_start = host_end = None
    for e in prof.events():
        # Named ranges (models.py's train_step.*, torch's Optimizer.step#...) also appear on the
        # device's timeline as annotations spanning their kernels: not kernels themselves.
        annotation = bool(getattr(e, "is_user_annotation", False))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if annotation:
                if e.name.startswith("train_step."):
                    windows[e.name] = (e.time_range.end - e.time_range.start) / 1e3
            elif (getattr(e, "self_device_time_total", 0) or 0) > 0:
                kernels.append((e.name, e.time_range.start, e.time_range.end))
            continue
        if e.name.startswith("train_step."):  # models.py's named ranges, on the host
            phases[e.name] = e.cpu_time_total / 1e3
            continue
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        host_start = e.time_range.start if host_start is None else min(host_start, e.time_range.start)
        host_end = e.time_range.end if host_end is None else max(host_end, e.time_range.end)
        if e.name.startswith(("cuda", "cu")) and (BLOCKING.search(e.name) or DEVICE_TO_HOST.search(e.name)):
            count, ms = runtime.get(e.name, (0, 0.0))
            runtime[e.name] = (count + 1, ms + e.cpu_time_total / 1e3)
        elif not e.name.startswith(("cuda", "cu")):
            host[e.name] = host.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    intervals = [(start, end) for _, start, end in kernels]
    by_kind: dict[str, list] = {}
    by_name: dict[str, float] = {}
    for name, start, end in kernels:
        entry = by_kind.setdefault(kind(name), [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start) / 1e3
        by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e3
    span = 0.0
    if intervals:
        span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3
    return dict(
        kernel_ms=sum((e - s) for s, e in intervals) / 1e3,
        kernels=len(kernels),
        busy_ms=busy_union_ms(intervals),
        span_ms=span,
        host_span_ms=((host_end - host_start) / 1e3) if host_start is not None else 0.0,
        gaps=[(ms, kernels[i][0]) for ms, i in idle_gaps(intervals)],
        by_kind=sorted(by_kind.items(), key=lambda kv: -kv[1][1]),
        top_kernels=sorted(by_name.items(), key=lambda kv: -kv[1])[:5],
        runtime=sorted(runtime.items(), key=lambda kv: -kv[1][1]),
        top_host=sorted(host.items(), key=lambda kv: -kv[1])[:8],
        phases={name: (ms, windows.get(name)) for name, ms in phases.items()},
    )


def sync_points(fn, device: torch.device) -> dict[str, int]:
    """{warning text: count} of the operations that synchronised the host with the device during
    one call (CUDA only: torch's sync debug mode)."""
    if device.type != "cuda":
        return {}
    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    found: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        text = str(w.message).splitlines()[0][:120]
        if "synchroniz" in text.lower():
            where = f"{os.path.basename(w.filename)}:{w.lineno}"
            key = f"{text} ({where})"
            found[key] = found.get(key, 0) + 1
    _sync(device)
    return found


class ProfilingRunner(models.Runner):
    """models.Runner whose rows are profiles: same models, inputs and steps as the benchmark."""

    def __init__(self, device, dtype, mode, providers, iters, python_top):
        super().__init__(device, dtype, mode, peaks={}, skip=lambda *a: None, providers=providers)
        self.iters, self.python_top = iters, python_top

    def unavailable(self, op, provider, mask, shape, why):
        if self.wanted(provider):
            print(f"  {provider:18s} skipped: {why}")

    def measure(self, op, provider, mask, shape, fn, tokens, error_fn=None):
        if not self.wanted(provider):
            return
        try:
            for _ in range(5):  # compile, autotune, grow the caching allocator; CudaGraphStep: capture
                fn()
            wall = _per_call_ms(fn, self.iters, self.device, wait=True)
            issue = _per_call_ms(fn, self.iters, self.device, wait=False)
            _sync(self.device)
            prof = profile_step(fn, self.device)
            syncs = sync_points(fn, self.device)
            py_top = _python_top(fn, self.iters, self.device, self.python_top) if self.python_top else []
        except Exception as exc:  # one provider failing must not hide the others' figures
            print(f"  {provider:18s} FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            return
        prof.update(wall_ms=wall, host_ms=issue, syncs=syncs)
        _print_profile(provider, prof, self.device, py_top)


def _print_profile(provider, prof, device, py_top):
    line = f"  {provider:18s} wall {prof['wall_ms']:8.2f} ms/step   host {prof['host_ms']:8.2f} ms/step"
    if device.type == "cuda":
        line += (f"   kernels {prof['kernel_ms']:8.2f} ms in {prof['kernels']:5d}   device busy "
                 f"{prof['busy_ms']:8.2f} of {prof['span_ms']:8.2f} ms (host span {prof['host_span_ms']:8.2f})")
    print(line)
    for name, (host_ms, window_ms) in prof["phases"].items():
        # window: from the range's first kernel to its last on the device (idle gaps included;
        # backward's kernels come from autograd's own thread and may fall outside its range)
        print(f"      phase  {host_ms:8.3f} ms host" + (f"  {window_ms:8.3f} ms device window"
                                                       if window_ms is not None else "") + f"  {name}")
    for label, (count, ms) in prof["by_kind"]:
        print(f"      kind   {ms:8.3f} ms {count:5d}x  {label}")
    for name, ms in prof["top_kernels"]:
        print(f"      kernel {ms:8.3f} ms         {_short(name)}")
    for ms, after in prof["gaps"]:
        print(f"      idle   {ms:8.3f} ms  after {_short(after, 60)}")
    for name, (count, ms) in prof["runtime"]:
        print(f"      api    {ms:8.3f} ms {count:5d}x  {name}")
    for text, count in sorted(prof["syncs"].items(), key=lambda kv: -kv[1]):
        print(f"      sync   {count:5d}x  {_short(text, 110)}")
    for name, ms in prof["top_host"]:
        print(f"      host   {ms:8.3f} ms         {_short(name)}")
    for text in py_top:
        print(f"      python {text}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="+", default=["train_step"], choices=["train_step", "inference"])
    p.add_argument("--providers",
                   default="torch.nn,ours:auto,ours:torch,ours:cuda,ours:auto+swap,torch.nn+cuda_graph,ours:auto+cuda_graph",
                   help="comma list of benchmarks/models.py providers (torch.nn, ours:<backend>, ours:auto+logits, ...)")
    p.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--python-top", type=int, default=0,
                   help="also list the N Python functions with the most own time (cProfile)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: a shared CPU's spinning OpenMP threads can make "
                        "tiny ops thousands of times slower)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny model: tests
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    providers = [s.strip() for s in args.providers.split(",") if s.strip()]
    mode = "smoke" if args.smoke else "quick"
    runner = ProfilingRunner(device, dtype, mode, providers, args.iters, args.python_top)
    print(f"profile_model on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, {runner.cfg.describe()}, {args.iters} steps per figure")
    for op in args.op:
        print(f"{op} B={runner.cfg.batch} S={runner.cfg.src_len} T={runner.cfg.tgt_len}")
        getattr(runner, op)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
