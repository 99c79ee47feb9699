"""Peak memory of one training step, device-independent: the profiler's allocation timeline.

    python -m benchmarks.train_step_memory --batch 16 --dtype bfloat16 > result.txt

Runs the base model (6+6 layers, d_model 512, FFN 2048, vocabulary 32000, S = T = 128) on the
CPU: `torch.nn` (benchmarks.models.TorchSeq2Seq), ours with torch's loss on its logits
(`+logits`) and ours with Seq2SeqTransformer.loss, each for one warm step (Adam), then one
profiled step.  The peak is the largest sum of live allocations over that step
(torch.profiler's memory timeline: allocations and frees in order), above what was live when
it began (the weights and Adam's state), with the categories live at that moment.  A GPU's
caching allocator adds fragmentation on top, and torch.nn's attention keeps less there (flash
SDPA instead of the CPU's math path): benchmarks/NOTES.md "The loss without the logits".
"""
from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfile

import transformer_fast
from transformer_fast.models import Seq2SeqTransformer

from . import common, models


def peak_above_start(step) -> tuple[float, dict]:
    """(peak MB, {category: MB live at the peak}) over one call of ``step``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    timeline = MemoryProfile(prof.profiler.kineto_results)
    live, peak, alive, at_peak = 0, 0, {}, {}
    for _, action, (key, version), size in timeline.timeline:
        if action.name == "CREATE":
            live += size
            alive[(key, version)] = size
            if live > peak:
                peak, at_peak = live, dict(alive)
        elif action.name == "DESTROY":
            live -= size
            alive.pop((key, version), None)
        elif action.name == "INCREMENT_VERSION":
            alive[(key, version + 1)] = alive.pop((key, version), size)
    categories: dict[str, float] = {}
    for (key, version), size in at_peak.items():
        category = timeline._categories.get(key, version)
        name = category.name if category is not None else "unknown"
        categories[name] = categories.get(name, 0.0) + size / 1e6
    return peak / 1e6, categories


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--backend", default="cpu", help="ours' backend (use_backend)")
    p.add_argument("--tiny", action="store_true", help="a 1+1-layer d_model 32 model (tests)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cfg = (models.Config("tiny", 32, 2, 1, 64, 500, args.batch, 16, 16, 1, 1, 1) if args.tiny
           else models.Config("base", 512, 8, 6, 2048, 32000, args.batch, 128, 128, 1, 1, 1))
    g = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    src = models._tokens(g, cfg.batch, cfg.src_len, cfg.vocab, cpu)
    tgt = models._tokens(g, cfg.batch, cfg.tgt_len + 1, cfg.vocab, cpu)
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_in[:, 0] = models.BOS

    def step_of(model, fused, backend):
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)

        def step():
            with transformer_fast.use_backend(backend):
                if fused:
                    loss = model.loss(src, tgt_in, tgt_out, smoothing=0.1)
                else:
                    loss = F.cross_entropy(model(src, tgt_in).reshape(-1, cfg.vocab).float(), tgt_out.reshape(-1),
                                           ignore_index=models.PAD, label_smoothing=0.1)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    print(f"train_step peak memory: {cfg.describe()}, B {cfg.batch}, S = T = {cfg.src_len}, {args.dtype}, "
          f"dropout 0.1, Adam; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"commit {common.git_commit()}")
    results = {}
    for name in ("torch.nn", f"ours:{args.backend}+logits", f"ours:{args.backend}"):
        torch.manual_seed(0)
        if name == "torch.nn":
            model, fused, backend = models.TorchSeq2Seq(cfg, 0.1).to(dtype=dtype).train(), False, "auto"
        else:
            model = Seq2SeqTransformer(cfg.vocab, cfg.vocab, cfg.d_model, cfg.nhead, cfg.layers, cfg.layers,
                                       cfg.d_ff, 0.1, pad_id=models.PAD, bos_id=models.BOS,
                                       eos_id=models.EOS).to(dtype=dtype).train()
            fused, backend = not name.endswith("+logits"), args.backend
        step = step_of(model, fused, backend)
        step()  # Adam's state exists before the measured step
        peak, categories = peak_above_start(step)
        results[name] = peak
        weights = sum(q.numel() * q.element_size() for q in model.parameters()) / 1e6
        print(f"{name:18s} peak {peak:8.1f} MB above the step's start (weights {weights:.1f} MB); live at the "
              f"peak: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(categories.items(), key=lambda kv: -kv[1])))
    base = results["torch.nn"]
    print("ratios to torch.nn: " + ", ".join(f"{k} {v / base:.2f}x" for k, v in results.items()))
    return results


if __name__ == "__main__":
    main()
