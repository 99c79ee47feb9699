"""What dropout adds to the C++ cpu kernels' forward: add_layer_norm (4096 x 1024) and
masked_softmax (2 x 4 x 512 x 512), fp32, dropout 0 against 0.1, median ms of 21 calls under
no_grad (benchmarks/NOTES.md, "CPU dropout: one Philox block per 4 elements").

    PYTHONPATH=<checkout> python benchmarks/cpu_dropout_cost.py
"""
import statistics
import subprocess
import time
from pathlib import Path

import torch

import transformer_fast
import transformer_fast.functional as F


def median_ms(fn, calls=21, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    root = Path(transformer_fast.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"transformer_fast from {root} (commit {commit}), {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    x, residual = torch.randn(4096, 1024), torch.randn(4096, 1024)
    weight, bias = torch.randn(1024), torch.randn(1024)
    scores = torch.randn(2, 4, 512, 512)
    with torch.no_grad():
        for p in (0.0, 0.1):
            ms = median_ms(lambda: F.add_layer_norm(x, residual, weight, bias, dropout_p=p, backend="cpu"))
            print(f"add_layer_norm 4096x1024 fwd dropout {p}: {ms:.2f} ms")
        for p in (0.0, 0.1):
            ms = median_ms(lambda: F.masked_softmax(scores, dropout_p=p, backend="cpu"))
            print(f"masked_softmax 2x4x512x512 fwd dropout {p}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
