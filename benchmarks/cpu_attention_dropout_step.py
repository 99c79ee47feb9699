"""The CPU training step with and without the cpu backend's materialising attention (2026-12-01).

    python benchmarks/cpu_attention_dropout_step.py [steps] [threads]

The full CPU benchmark model (benchmarks/models.py "full" config: 3+3 layers, d_model 256,
vocabulary 8000, B 8, S = T = 64, fp32, dropout 0.1, Adam) on ``auto``, its loss
Seq2SeqTransformer.loss.  Two models with the same weights, steps alternating in one process:
one with ``backends.CPU_ATTENTION_SCORES_IN_MEMORY = 0`` (every SDPA with dropout and a gradient
goes to torch's SDPA, as before f96cd6a), one with the default bound (the cpu backend keeps the
scores in memory).  One model each because a layer replays the backends its first call resolved
(transformer_fast/modules/_lane.py).  Prints min and median ms per step.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import models as M  # noqa: E402
from transformer_fast import backends  # noqa: E402
from transformer_fast.models import Seq2SeqTransformer  # noqa: E402

BEFORE, AFTER = "torch SDPA (before)", "cpu, scores in memory (after)"
BOUNDS = {BEFORE: 0, AFTER: backends.CPU_ATTENTION_SCORES_IN_MEMORY}


def main(steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    cfg = M.config(dev, "full")
    g = torch.Generator().manual_seed(1)
    b, s, t = cfg.batch, cfg.src_len, cfg.tgt_len
    src = M._tokens(g, b, s, cfg.vocab, dev)
    tgt = M._tokens(g, b, t + 1, cfg.vocab, dev)
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_in[:, 0] = M.BOS

    def build():
        torch.manual_seed(0)
        model = Seq2SeqTransformer(cfg.vocab, cfg.vocab, cfg.d_model, cfg.nhead, cfg.layers, cfg.layers,
                                   cfg.d_ff, 0.1, pad_id=M.PAD, bos_id=M.BOS, eos_id=M.EOS).train()
        return model, torch.optim.Adam(model.parameters(), lr=1e-5)

    runs = {name: build() for name in BOUNDS}
    times = {name: [] for name in BOUNDS}

    def step(name):
        backends.CPU_ATTENTION_SCORES_IN_MEMORY = BOUNDS[name]
        model, opt = runs[name]
        start = time.perf_counter()
        model.loss(src, tgt_in, tgt_out, smoothing=0.1).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    for _ in range(2):  # warm-up (and each model's recorded backends)
        for name in BOUNDS:
            step(name)
    for _ in range(steps):
        for name in BOUNDS:
            times[name].append(step(name))
    for name, ts in times.items():
        ts.sort()
        print(f"  {name}: min {ts[0]:.1f} median {ts[len(ts) // 2]:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
