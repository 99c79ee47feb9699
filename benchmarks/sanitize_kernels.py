"""Runs every fused kernel of one backend once, forward and backward, at odd shapes, so that
compute-sanitizer (memcheck, racecheck, initcheck, synccheck) sees each kernel.  Used by
benchmarks/gpu_suite.sh; exits non-zero if a result is not finite."""
import argparse
import itertools
import sys

import torch

from transformer_fast import functional as F

# --shard i/n: this process runs cases i, i + n, i + 2n, ... of the whole sequence (the case
# generators ask _take() before computing a case).  gpu_suite.sh runs the Triton cases in 16
# shards without the sanitizer first, so that the sanitized run finds every kernel compiled.
_SHARD = [0, 1]
_COUNTER = itertools.count()


def _take() -> bool:
    return next(_COUNTER) % _SHARD[1] == _SHARD[0]


def layer_norm_cases(backend, device):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for m, n in ((1, 1), (3, 7), (5, 127), (17, 1000), (2, 4097), (1, 65536), (3, 65537)):
            for affine, prenorm, p in ((True, False, 0.0), (False, True, 0.1)):
                if not _take():
                    continue
                x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
                r = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
                w = torch.randn(n, device=device, dtype=dtype, requires_grad=True) if affine else None
                b = torch.randn(n, device=device, dtype=dtype, requires_grad=True) if affine else None
                out = F.add_layer_norm(x, r, w, b, dropout_p=p, prenorm=prenorm, backend=backend)
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
                yield f"add_layer_norm {dtype} {m}x{n}", outs + (x.grad, r.grad)


def attention_cases(backend, device):
    """Odd shapes for the attention kernels (skipped by backends that do not implement them)."""
    for dtype in (torch.bfloat16, torch.float32):
        # (the last: 16-bit rows of > 128 keys, whose triton backward adds up dq by atomics)
        for b, h, hkv, lq, lk, d in ((1, 2, 1, 1, 1, 16), (2, 4, 2, 7, 33, 80), (1, 2, 2, 129, 67, 256),
                                     (1, 4, 2, 65, 201, 64)):
            if not _take():
                continue
            q = torch.randn(b, h, lq, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            pad = torch.rand(b, lk, device=device) < 0.3
            out = F.scaled_dot_product_attention(q, k, v, None, 0.1, True, enable_gqa=h != hkv,
                                                 key_padding_mask=pad, backend=backend)
            out.backward(torch.randn_like(out))
            yield f"sdpa {dtype} {b}x{h}x{hkv}x{lq}x{lk}x{d}", (out, q.grad, k.grad, v.grad)


def masked_softmax_cases(backend, device):
    """Odd row lengths over every masked_softmax kernel (cuda: the warp kernels' register buckets
    and the block kernel past 1024; triton: fused and looped paths), key-padding masks with dead
    rows, causal, dropout, and a misaligned strided view of the scores (scalar-access paths)."""
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for b, h, lq, lk in ((1, 2, 1, 1), (2, 4, 7, 33), (1, 2, 129, 67), (2, 2, 5, 1000),
                             (1, 2, 3, 1025), (1, 1, 2, 4097), (1, 1, 2, 65537)):
            pad = torch.rand(b, lk, device=device) < 0.3
            pad[-1] = True  # batch b-1: every key padded, all its rows dead
            for view in ("contiguous", "misaligned"):
                if not _take():
                    continue
                base = torch.randn(b * h * lq * (lk + 1) + 1, device=device, dtype=dtype)
                if view == "contiguous":
                    scores = base[: b * h * lq * lk].view(b, h, lq, lk)
                else:  # one element off an aligned start, rows of lk + 1
                    scores = base[1:].view(b, h, lq, lk + 1)[..., :lk]
                scores = scores.detach().requires_grad_(True)
                probs = F.masked_softmax(scores, pad[:, None, None, :].logical_not(), is_causal=True,
                                         dropout_p=0.1, backend=backend)
                probs.backward(torch.randn_like(probs))
                yield f"masked_softmax {dtype} {b}x{h}x{lq}x{lk} {view}", (probs, scores.grad)


def kv_cache_cases(backend, device):
    """attention_with_kv_cache (triton, cuda, cpu): decoding steps and chunks over GQA groups 1 /
    4 / 8 (the packed-row buckets of csrc/decode_cuda.cu), head dims 16..256 with Dv != D once,
    with and without k_new, unsplit and split-K (TRANSFORMER_FAST_KV_SPLITS forces the C++ split
    count; Triton's heuristic splits the B = 1 cases), a row at 0 and one at L_max - L_new."""
    import os

    shapes = ((1, 2, 2, 1, 6, 16, 16), (2, 8, 2, 2, 38, 80, 80), (1, 8, 1, 1, 300, 128, 128),
              (2, 4, 1, 7, 133, 256, 40), (1, 2, 1, 64, 200, 64, 64))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for b, h, hkv, l_new, l_max, d, dv in shapes:
            dv = d if backend == "triton" else dv  # the Triton kernels need Dv == D
            for with_new, splits in ((True, None), (True, "3"), (False, "2")):
                if not _take():
                    continue
                if splits is None:
                    os.environ.pop("TRANSFORMER_FAST_KV_SPLITS", None)
                else:
                    os.environ["TRANSFORMER_FAST_KV_SPLITS"] = splits
                with torch.no_grad():
                    kc = torch.randn(b, hkv, l_max, d, device=device, dtype=dtype)
                    vc = torch.randn(b, hkv, l_max, dv, device=device, dtype=dtype)
                    lens = torch.randint(l_new, l_max - l_new + 1, (b,), device=device, dtype=torch.int32)
                    lens[0] = 0 if with_new else l_new
                    lens[-1] = l_max - l_new
                    kn = torch.randn(b, hkv, l_new, d, device=device, dtype=dtype) if with_new else None
                    vn = torch.randn(b, hkv, l_new, dv, device=device, dtype=dtype) if with_new else None
                    q_new = torch.randn(b, h, l_new, d, device=device, dtype=dtype)
                    out = F.attention_with_kv_cache(q_new, kc, vc, lens, kn, vn, backend=backend)
                yield f"kv_cache {dtype} {b}x{h}x{hkv}x{l_new}x{l_max}x{d}x{dv} new={with_new} splits={splits}", (out,)
    os.environ.pop("TRANSFORMER_FAST_KV_SPLITS", None)


def sdpa_cases(backend, device):
    """scaled_dot_product_attention alone (the op the C++ backends implement; csrc/attention_*):
    every head-dim bucket of the CUDA kernels (64, 128, 256; D padded inside), partial tiles,
    GQA, and each mask path (causal + padding + dropout, causal + padding, bool mask, float mask
    with a dead row, causal alone, none).
    fp16/bf16 (the cuda kernels refuse fp32; the cpu backend runs these too)."""
    for dtype in (torch.bfloat16, torch.float16):
        for b, h, hkv, lq, lk, d in ((1, 2, 1, 1, 1, 16), (2, 4, 2, 7, 33, 80), (1, 2, 2, 129, 67, 128),
                                     (1, 2, 1, 65, 130, 256)):
            q = torch.randn(b, h, lq, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            pad = torch.rand(b, lk, device=device) < 0.3
            bool_mask = torch.rand(lq, lk, device=device) < 0.8
            float_mask = torch.randn(b, h, lq, lk, device=device, dtype=dtype)
            float_mask[:, :, 0] = float("-inf")
            # On the cuda backend all but the first (dropout) take the dense kernels where D <= 128
            # (masks included), the generic ones at D = 256.
            for kw in (dict(dropout_p=0.1, is_causal=True, key_padding_mask=pad), dict(is_causal=True, key_padding_mask=pad),
                       dict(attn_mask=bool_mask), dict(attn_mask=float_mask), dict(is_causal=True), dict()):
                if not _take():
                    continue
                q.grad = k.grad = v.grad = None
                out = F.scaled_dot_product_attention(q, k, v, enable_gqa=h != hkv, backend=backend, **kw)
                out.backward(torch.randn_like(out))
                yield f"sdpa {dtype} {b}x{h}x{hkv}x{lq}x{lk}x{d} {sorted(kw)}", (out, q.grad, k.grad, v.grad)


def ffn_cases(backend, device):
    """feed_forward and linear_bias_act at odd shapes (partial tiles everywhere, K = 1, a single
    row, a non-contiguous x), every activation, with and without dropout and biases."""
    shapes = ((1, 1, 1, 1), (7, 33, 70, 29), (129, 64, 257, 64), (300, 130, 67, 8))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for m, d_model, d_ff, d_out in shapes:
            for act, p, biases in (("relu", 0.0, True), ("gelu", 0.1, False), ("gelu_tanh", 0.1, True)):
                if not _take():
                    continue
                x = torch.randn(d_model, m, device=device, dtype=dtype).t().requires_grad_(True)
                w1 = torch.randn(d_ff, d_model, device=device, dtype=dtype, requires_grad=True)
                w2 = torch.randn(d_out, d_ff, device=device, dtype=dtype, requires_grad=True)
                b1 = torch.randn(d_ff, device=device, dtype=dtype, requires_grad=True) if biases else None
                b2 = torch.randn(d_out, device=device, dtype=dtype, requires_grad=True) if biases else None
                out = F.feed_forward(x, w1, b1, w2, b2, activation=act, dropout_p=p, backend=backend)
                out.backward(torch.randn_like(out))
                yield f"feed_forward {dtype} {m}x{d_model}x{d_ff}x{d_out} {act}", (out, x.grad, w1.grad, w2.grad)
                y = F.linear_bias_act(x.detach(), w1, b1, activation=act, dropout_p=p, backend=backend)
                y.backward(torch.randn_like(y))
                yield f"linear_bias_act {dtype} {m}x{d_model}x{d_ff} {act}", (y, w1.grad)


def cross_entropy_cases(backend, device):
    """The fused loss's row kernel (triton, 16-bit): vocabularies shorter than, equal to and
    longer than one block, chunks of 1 and 7 rows, ignored rows, a bias."""
    from transformer_fast.models import linear_cross_entropy

    for dtype in (torch.bfloat16, torch.float16):
        for n, e, v, chunk in ((1, 8, 1, None), (7, 33, 127, 1), (129, 64, 4096, 7), (33, 16, 5001, None)):
            if not _take():
                continue
            h = torch.randn(n, e, device=device, dtype=dtype, requires_grad=True)
            w = (torch.randn(v, e, device=device, dtype=dtype) / e ** 0.5).requires_grad_(True)
            b = torch.randn(v, device=device, dtype=dtype, requires_grad=True)
            t = torch.randint(0, v, (n,), device=device)
            t[::3] = -100
            loss = linear_cross_entropy(h, w, t, b, 0.1, ignore_index=-100, chunk_rows=chunk, backend=backend)
            loss.backward()
            yield f"linear_cross_entropy {dtype} {n}x{e}x{v} chunk {chunk}", (loss, h.grad, w.grad, b.grad)
    # The row kernel alone on logits written by torch.randn (not by a cuBLAS GEMM), in a row
    # pitch wider than V: the H200 run of 2026-11-29 had initcheck report uninitialized reads
    # at the start of F.linear's (1, 127) output in the case above; if these cases stay clean,
    # the reports concern memory cuBLAS wrote (its TMA stores), not this kernel's loads.
    from transformer_fast.kernels.cross_entropy import cross_entropy_rows

    for dtype in (torch.bfloat16, torch.float16):
        for rows, v, pitch in ((1, 127, 127), (7, 127, 136), (3, 5001, 5008)):
            if not _take():
                continue
            z = torch.randn(rows, pitch, device=device, dtype=dtype)[:, :v]
            t = torch.randint(0, v, (rows,), device=device)
            keep = torch.ones(rows, dtype=torch.bool, device=device)
            keep[::2] = False
            loss = cross_entropy_rows(z, t, keep, 0.1, True)
            yield f"cross_entropy_rows {dtype} {rows}x{v} pitch {pitch}", (loss, z)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (triton under TRITON_INTERPRET=1)")
    parser.add_argument("--only", default=None, choices=["sdpa"],
                        help="sdpa: the scaled_dot_product_attention cases alone (cuda / cpu)")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th")
    parser.add_argument("--verbose", action="store_true", help="print each case's name")
    args = parser.parse_args()
    try:
        index, count = (int(x) for x in args.shard.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        parser.error(f"--shard: expected i/n with 0 <= i < n; got {args.shard!r}")
    _SHARD[:] = [index, count]
    bad = 0
    cases = [layer_norm_cases(args.backend, args.device), ffn_cases(args.backend, args.device)]
    if args.backend == "triton":
        cases.append(attention_cases(args.backend, args.device))
        cases.append(cross_entropy_cases(args.backend, args.device))
    if args.backend in ("cuda", "cpu"):
        cases.append(sdpa_cases(args.backend, args.device))
    if args.backend in ("triton", "cuda", "cpu"):
        cases.append(kv_cache_cases(args.backend, args.device))
        cases.append(masked_softmax_cases(args.backend, args.device))
    if args.only == "sdpa":
        cases = [sdpa_cases(args.backend, args.device)] if args.backend in ("cuda", "cpu") else []
    for name, tensors in (case for group in cases for case in group):
        if args.device == "cuda":
            torch.cuda.synchronize()
        if args.verbose:
            print(name, flush=True)
        if not all(torch.isfinite(t).all() for t in tensors if t is not None):
            print(f"non-finite result: {args.backend} {name}")
            bad += 1
    print(f"{args.backend}: done{'' if count == 1 else f' (shard {args.shard})'}, {bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
