"""Where the CPU's `cpu` decode kernel stops beating the torch backend as a step carries more
query rows (a prefill chunk of Lq tokens; Lq * H / Hkv packed rows per key head): the ratio
torch time / cpu time (min of 15 calls, fp32, one thread, cache half full) for Lq 1..128.
`auto` takes the torch backend from 64 packed rows (transformer_fast/backends.py AUTO_RULES).
Run: python benchmarks/cpu_kv_cache_prefill.py"""
import time

import torch

from transformer_fast import functional as F

SHAPES = ((1, 8, 8, 1024, 64), (1, 8, 8, 4096, 64), (1, 8, 8, 2048, 128), (2, 32, 8, 2048, 128))
CHUNKS = (1, 4, 8, 16, 32, 64, 128)


def best_time(fn, calls=15):
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for b, h, hkv, length, d in SHAPES:
        row = []
        for lq in CHUNKS:
            q = torch.randn(b, h, lq, d)
            kc, vc = torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
            lens = torch.full((b,), length // 2, dtype=torch.int32)
            kn, vn = torch.randn(b, hkv, lq, d), torch.randn(b, hkv, lq, d)
            cpu, ref = (best_time(lambda be=be: F.attention_with_kv_cache(
                q, kc, vc, lens, kn, vn, backend=be)) for be in ("cpu", "torch"))
            row.append(f"Lq {lq} ({lq * h // hkv} rows) {ref / cpu:.2f}x")
        print(f"B, H, Hkv, L, D = {(b, h, hkv, length, d)}: torch / cpu time: " + " | ".join(row),
              flush=True)


if __name__ == "__main__":
    main()
