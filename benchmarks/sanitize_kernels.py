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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args()
    bad = 0
    for name, tensors in layer_norm_cases(args.backend, "cuda"):
        torch.cuda.synchronize()
        if not all(torch.isfinite(t).all() for t in tensors if t is not None):
            print(f"non-finite result: {args.backend} {name}")
            bad += 1
    print(f"{args.backend}: done, {bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
