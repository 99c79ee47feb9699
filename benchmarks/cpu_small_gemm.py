"""The C++ cpu FFN's small fp32 GEMMs (summed in double) and what rests on them, one thread, fp32:
minimum of N calls per case, in microseconds, one "case<TAB>us" line each, for comparing two
builds interleaved (PYTHONPATH=<tree> python benchmarks/cpu_small_gemm.py [torch]).

Cases: the FFN primitives at 1-2 rows of the paper's 512 / 2048 (forward, dgrad, wgrad: what a
decoding step runs), an encoder layer at batch 2 of one token in eval, and greedy decoding of the
base Seq2SeqTransformer (6 + 6 layers, 16 source tokens, 16 steps, no early stop) at batch 1 and
2.  With ``torch``: the same cases in torch (F.linear + relu, matmuls, nn.TransformerEncoderLayer's
fast path, torch.nn.Transformer re-running the decoder every step as benchmarks/models.py does)."""
import sys
import time

import torch

import transformer_fast  # noqa: F401  (loads the ops)
import transformer_fast.modules as tf_modules
from transformer_fast.models import Seq2SeqTransformer

VOCAB, SRC, STEPS = 1000, 16, 16


def best_us(fn, n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main(peer: bool) -> dict[str, float]:
    torch.set_num_threads(1)
    ops = torch.ops.transformer_fast_C
    res = {}
    with torch.no_grad():
        for m in (1, 2):
            for k, n in ((512, 2048), (2048, 512)):
                x, w, b, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(n), torch.randn(m, n)
                if peer:
                    fwd, dgrad, wgrad = (lambda: torch.relu(torch.nn.functional.linear(x, w, b)),
                                         lambda: dy @ w, lambda: dy.t() @ x)
                else:
                    fwd = lambda: ops.ffn_linear_fwd(x, w, b, "relu", 0.0, None, False, False)  # noqa: E731
                    dgrad = lambda: ops.ffn_linear_dgrad(dy, w, None, "none", 0.0, None, False, False)  # noqa: E731
                    wgrad = lambda: ops.ffn_linear_wgrad(dy, x, False, False)  # noqa: E731
                for name, fn in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad)):
                    res[f"ffn {name} M={m} {k}->{n}"] = best_us(fn, 40)
        torch.manual_seed(0)
        theirs = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True).eval()
        ours = tf_modules.TransformerEncoderLayer(512, 8, 2048, batch_first=True).eval()
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(2, 1, 512)
        layer = theirs if peer else ours
        res["encoder layer eval B=2 L=1"] = best_us(lambda: layer(x), 40)
        torch.manual_seed(0)
        if peer:
            from benchmarks import models as bench_models

            cfg = bench_models.Config("base", 512, 8, 6, 2048, VOCAB, 1, SRC, STEPS, 1, SRC, STEPS)
            model = bench_models.TorchSeq2Seq(cfg, 0.0).eval()
            decode = lambda src: bench_models.prefix_greedy_decode(model, src, STEPS)  # noqa: E731
        else:
            model = Seq2SeqTransformer(VOCAB, VOCAB, dropout=0.0).eval()
            model.eos_id = -1  # all STEPS tokens: no early stop
            decode = lambda src: model.greedy_decode(src, STEPS)  # noqa: E731
        for batch in (1, 2):
            src = torch.randint(3, VOCAB, (batch, SRC), generator=torch.Generator().manual_seed(batch))
            res[f"greedy_decode B={batch}, per step"] = best_us(lambda: decode(src), 3) / STEPS
    return res


if __name__ == "__main__":
    for case, us in main("torch" in sys.argv[1:]).items():
        print(f"{case}\t{us:.1f}")
