"""Time one CPU decoding step of attention_with_kv_cache (backend "cpu", fp32, one thread):
20th percentile (and minimum) of 60 calls per shape, for comparing two builds interleaved
(PYTHONPATH=<tree> python benchmarks/cpu_kv_cache_cost.py [cpu|torch]).  One thread, since on a
shared 2-core machine two threads measured scheduler quanta, not the kernel."""
import sys
import time

import torch

from transformer_fast import functional as F

# B, H, Hkv, L, D, Lq: decoding steps (Lq 1) whose packed rows (Lq * H / Hkv) take the
# per-key dot (< 16 rows) or the GEMM-like loop (>= 16: a GQA group of 16, a prefill chunk)
SHAPES = ((4, 8, 8, 2048, 64, 1), (4, 8, 8, 512, 64, 1), (1, 32, 8, 4096, 128, 1),
          (1, 32, 2, 4096, 128, 1), (1, 8, 8, 1024, 64, 32))


def main(backend: str = "cpu") -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    res = []
    for b, h, hkv, length, d, lq in SHAPES:
        q = torch.randn(b, h, lq, d)
        kc, vc = torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
        lens = torch.full((b,), length - lq, dtype=torch.int32)
        kn, vn = torch.randn(b, hkv, lq, d), torch.randn(b, hkv, lq, d)

        def step():
            return F.attention_with_kv_cache(q, kc, vc, lens, kn, vn, backend=backend)

        for _ in range(5):
            step()
        times = []
        for _ in range(60):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        times.sort()
        res.append(f"{(b, h, hkv, length, d, lq)} {times[len(times) // 5] * 1e3:.3f} "
                   f"({times[0] * 1e3:.3f})")
    print(f"{backend}: " + " | ".join(res), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
