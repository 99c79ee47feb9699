"""Runs every fused kernel of one backend once, forward and backward, at odd shapes, so that
compute-sanitizer (memcheck, racecheck, initcheck, synccheck) sees each kernel.  Used by
benchmarks/gpu_suite.sh; exits non-zero if a result is not finite."""
import argparse
import sys

import torch

from transformer_fast import functional as F


def layer_norm_cases(backend, device):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for m, n in ((1, 1), (3, 7), (5, 127), (17, 1000), (2, 4097), (1, 65536), (3, 65537)):
            for affine, prenorm, p in ((True, False, 0.0), (False, True, 0.1)):
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
        for b, h, hkv, lq, lk, d in ((1, 2, 1, 1, 1, 16), (2, 4, 2, 7, 33, 80), (1, 2, 2, 129, 67, 256)):
            q = torch.randn(b, h, lq, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(b, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
            pad = torch.rand(b, lk, device=device) < 0.3
            out = F.scaled_dot_product_attention(q, k, v, None, 0.1, True, enable_gqa=h != hkv,
                                                 key_padding_mask=pad, backend=backend)
            out.backward(torch.randn_like(out))
            yield f"sdpa {dtype} {b}x{h}x{hkv}x{lq}x{lk}x{d}", (out, q.grad, k.grad, v.grad)
            scores = torch.randn(b, h, lq, lk, device=device, dtype=dtype, requires_grad=True)
            probs = F.masked_softmax(scores, pad[:, None, None, :].logical_not(), is_causal=True,
                                     dropout_p=0.1, backend=backend)
            probs.backward(torch.randn_like(probs))
            yield f"masked_softmax {dtype} {b}x{h}x{lq}x{lk}", (probs, scores.grad)
            with torch.no_grad():
                l_max = lk + 5
                kc = torch.randn(b, hkv, l_max, d, device=device, dtype=dtype)
                vc = torch.randn_like(kc)
                lens = torch.randint(0, l_max - 2, (b,), device=device, dtype=torch.int32)
                kn = torch.randn(b, hkv, 2, d, device=device, dtype=dtype)
                q_new = torch.randn(b, h, 2, d, device=device, dtype=dtype)
                out = F.attention_with_kv_cache(q_new, kc, vc, lens, kn, torch.randn_like(kn), backend=backend)
            yield f"kv_cache {dtype} {b}x{h}x{hkv}x{l_max}x{d}", (out,)


def sdpa_cases(backend, device):
    """scaled_dot_product_attention alone (the op the C++ backends implement; csrc/attention_*):
    every head-dim bucket of the CUDA kernels (64, 128, 256; D padded inside), partial tiles,
    GQA, and each mask path (causal + padding + dropout, bool mask, float mask with a dead row).
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
            for kw in (dict(dropout_p=0.1, is_causal=True, key_padding_mask=pad),
                       dict(attn_mask=bool_mask), dict(attn_mask=float_mask)):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (triton under TRITON_INTERPRET=1)")
    args = parser.parse_args()
    bad = 0
    cases = [layer_norm_cases(args.backend, args.device), ffn_cases(args.backend, args.device)]
    if args.backend == "triton":
        cases.append(attention_cases(args.backend, args.device))
    if args.backend in ("cuda", "cpu"):
        cases.append(sdpa_cases(args.backend, args.device))
    for name, tensors in (case for group in cases for case in group):
        if args.device == "cuda":
            torch.cuda.synchronize()
        if not all(torch.isfinite(t).all() for t in tensors if t is not None):
            print(f"non-finite result: {args.backend} {name}")
            bad += 1
    print(f"{args.backend}: done, {bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
