"""Where the time of one benchmark case goes: host (Python, dispatch, launches) or device.

    python benchmarks/profile_ops.py --op feed_forward --match "M=4096" --providers torch,triton,cuda
    python benchmarks/profile_ops.py --op scaled_dot_product_attention --match "L=1024 D=128 none"

For every case of ``python -m benchmarks`` (``--quick`` shapes; ``--match``: substrings of the
case's shape text, all required) and provider, after a warm-up: the wall time per call with the
device synchronised only at the ends of ``--iters`` back-to-back calls (what a training loop
sees), the host time per call to enqueue them (the same loop without waiting for the device),
and, from one profiled call, the device time of its kernels (their sum, their count, the largest
five) and the CPU ops that took the most host time.  ``--python-top N``: also the N Python
functions with the most own time over ``--iters`` calls (cProfile), to name the Python code
behind a host-bound call (a recorded op's "self" host time includes the Python it runs, e.g. a
Triton launcher's).  A call whose host time is close to its wall
time while its kernels' sum is far below it is bound by the host, not by its kernels.

Printed as text (benchmarks/gpu_suite.sh's `profile` step keeps it in logs.txt); on a CPU the
device columns are empty and the host columns are the whole call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common, ops  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call_ms(fn, iters: int, device: torch.device, wait: bool) -> float:
    """Mean ms per call over ``iters`` calls, the device synchronised before; after the loop as
    well with ``wait`` (wall time), else not (the host's time to issue the calls)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if wait:
        _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def _profile_once(fn, device: torch.device):
    """(device ms summed over the kernels, kernel count, [(name, ms)] largest five, [(op, host ms)]
    largest five) of one call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    kernels, host = {}, {}
    count = 0
    for e in prof.events():
        dev_us = getattr(e, "self_device_time_total", 0) or 0
        if e.device_type == torch.autograd.DeviceType.CUDA and dev_us > 0:
            kernels[e.name] = kernels.get(e.name, 0.0) + dev_us / 1e3
            count += 1
        elif e.device_type == torch.autograd.DeviceType.CPU:
            host[e.name] = host.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    top_k = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    top_h = sorted(host.items(), key=lambda kv: -kv[1])[:5]
    return sum(kernels.values()), count, top_k, top_h


def _python_top(fn, iters: int, device: torch.device, top: int) -> list[str]:
    """The ``top`` Python functions by own time over ``iters`` calls: 'own ms/call  calls/call  where'."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    _sync(device)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, tottime, cumtime, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = []
    for (path, line, name), (_, calls, tottime, _cum, _callers) in ranked:
        where = f"{'/'.join(path.split('/')[-2:])}:{line}({name})"
        lines.append(f"{tottime / iters * 1e3:8.3f} ms {calls / iters:6.1f}x  {_short(where, 90)}")
    return lines


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_case(case: ops.Case, providers, device: torch.device, iters: int, python_top: int = 0) -> list[dict]:
    g = ops.Draw(1234, device)
    inputs = case.make(g)
    for name in case.grad_names:
        inputs[name].requires_grad_(True)
    upstream = None
    if case.backward:
        with torch.no_grad():
            probe = case.call({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                              "torch")
        upstream = torch.randn(probe.shape, device=device).to(probe.dtype)
    rows = []
    for provider in providers:
        reasons = ops.provider_reasons(provider, case, inputs, device)
        if reasons:
            print(f"  {provider:14s} skipped: {reasons[0]}")
            continue

        def fn():
            with torch.set_grad_enabled(case.backward):
                ops._forward_backward(case, inputs, provider, upstream)

        try:
            for _ in range(3):  # compile, autotune, grow the caching allocator
                fn()
            wall = _per_call_ms(fn, iters, device, wait=True)
            issue = _per_call_ms(fn, iters, device, wait=False)
            _sync(device)
            dev_ms, count, top_k, top_h = _profile_once(fn, device)
            py_top = _python_top(fn, iters, device, python_top) if python_top else []
        except Exception as exc:  # one provider failing must not hide the others' figures
            print(f"  {provider:14s} FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            continue
        row = dict(provider=provider, wall_ms=wall, host_ms=issue, kernel_ms=dev_ms, kernels=count)
        rows.append(row)
        kern = f"kernels {dev_ms:8.3f} ms in {count:3d}" if device.type == "cuda" else "kernels     -"
        print(f"  {provider:14s} wall {wall:8.3f} ms/call   host {issue:8.3f} ms/call   {kern}")
        for name, ms in top_k:
            print(f"      device {ms:8.3f} ms  {_short(name)}")
        for name, ms in top_h:
            print(f"      host   {ms:8.3f} ms  {_short(name)}")
        for text in py_top:
            print(f"      python {text}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="+", default=["feed_forward", "scaled_dot_product_attention"],
                   choices=[op for op in ops.CASES])
    p.add_argument("--match", nargs="*", default=[], help="substrings the case's shape text must contain")
    p.add_argument("--providers", default=None, help="comma list (default: torch, triton, cuda, cpu)")
    p.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-cases", type=int, default=8, help="profile at most this many cases per op")
    p.add_argument("--python-top", type=int, default=0,
                   help="also list the N Python functions with the most own time (cProfile)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny shapes: tests
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    providers = [s.strip() for s in (args.providers or "torch,triton,cuda,cpu").split(",") if s.strip()]
    mode = "smoke" if args.smoke else "quick"
    print(f"profile on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, {args.iters} calls per figure")
    for op in args.op:
        chosen = [c for c in ops.cases(op, device, [dtype], mode)
                  if all(m in common._shape_text(c.shape) + f" {c.mask}" for m in args.match)][: args.max_cases]
        for case in chosen:
            print(f"{op} {common._shape_text(case.shape)} {case.mask}")
            profile_case(case, providers, device, args.iters, args.python_top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
