"""The fused loss (transformer_fast.models.linear_cross_entropy) against its composition
(F.linear + label-smoothed F.cross_entropy), forward + backward on the CPU, float32, at the CPU
benchmark models' generator shapes: min ms of interleaved calls (benchmarks/NOTES.md, "The fused
loss in float32").  With --baseline FILE (another version of transformer_fast/models/fused_loss.py,
e.g. from `git show <rev>:transformer_fast/models/fused_loss.py`) that version is timed in the same
process, interleaved with the others.

    python benchmarks/cpu_fused_loss_cost.py [--threads 2] [--rounds 7] [--baseline old.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import torch
import torch.nn.functional as F

from transformer_fast.models import fused_loss

# (tokens N, d_model E, vocabulary V): benchmarks/models.py's CPU configurations (quick and full:
# B x T tokens) and a larger vocabulary.
SHAPES = ((128, 128, 1000), (512, 256, 8000), (512, 512, 16000))
PAD = 0


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("transformer_fast.models._fused_loss_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3, help="calls per round (the min over all is kept)")
    p.add_argument("--baseline", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    versions = {"fused": fused_loss}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, smoothing 0.1, "
          f"min over {args.rounds} rounds x {args.calls} calls, interleaved")
    for n, e, v in SHAPES:
        hidden = torch.randn(n, e, requires_grad=True)
        weight = (torch.randn(v, e) * e ** -0.5).requires_grad_()
        target = torch.randint(1, v, (n,))
        target[torch.rand(n) < 0.1] = PAD

        def composition():
            F.cross_entropy(F.linear(hidden, weight), target, ignore_index=PAD, label_smoothing=0.1).backward()

        fns = {name: (lambda m=m: m.linear_cross_entropy(hidden, weight, target, None, 0.1, PAD).backward())
               for name, m in versions.items()}
        fns["composition"] = composition
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.rounds):
            for name, fn in fns.items():
                fn()  # warm
                for _ in range(args.calls):
                    start = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - start)
                hidden.grad = weight.grad = None
        cells = " | ".join(f"{name} {ms * 1e3:.1f} ms" for name, ms in best.items())
        ratio = best["composition"] / best["fused"]
        print(f"N {n}, E {e}, V {v}: {cells} | composition / fused {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
