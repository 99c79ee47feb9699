"""Determinism (issue 9): with torch.use_deterministic_algorithms(True), every op's forward and
backward is bitwise reproducible run to run, on every backend that runs here (CPU tensors; the
same test runs on CUDA tensors when a GPU is present, marked gpu).

No kernel of ours accumulates with atomics: attention's dq and dk/dv come from separate
kernels that each own their outputs (GQA groups are summed in a fixed order), layer norm's
dweight/dbias are reduced in two fixed stages, and dropout masks come from a counter-based
Philox stream keyed by the seed the op draws from torch's generator.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from transformer_fast import backends, functional as F

HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
BACKENDS = ("reference", "torch", "cpu", "triton", "cuda")


@contextlib.contextmanager
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _sdpa_case(device, dtype):
    q, k, v = (torch.randn(2, 4, 37, 32, device=device, dtype=dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: dk/dv summed over a group of 2 query heads
    pad = torch.rand(2, 37, device=device) < 0.2

    def run(backend, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.1,
                                              key_padding_mask=pad, backend=backend)

    return run, (q, k, v)


def _softmax_case(device, dtype):
    scores = torch.randn(2, 3, 17, 300, device=device, dtype=dtype)

    def run(backend, scores):
        return F.masked_softmax(scores, scale=0.7, is_causal=True, dropout_p=0.1, backend=backend)

    return run, (scores,)


def _layer_norm_case(device, dtype):
    x, r = torch.randn(300, 257, device=device, dtype=dtype), torch.randn(300, 257, device=device, dtype=dtype)
    w, b = torch.randn(257, device=device, dtype=dtype), torch.randn(257, device=device, dtype=dtype)

    def run(backend, x, r, w, b):
        y, h = F.add_layer_norm(x, r, w, b, dropout_p=0.1, prenorm=True, backend=backend)
        return y + h

    return run, (x, r, w, b)


def _feed_forward_case(device, dtype):
    x = torch.randn(70, 48, device=device, dtype=dtype)
    w1, b1 = torch.randn(96, 48, device=device, dtype=dtype) / 7, torch.randn(96, device=device, dtype=dtype)
    w2, b2 = torch.randn(48, 96, device=device, dtype=dtype) / 10, torch.randn(48, device=device, dtype=dtype)

    def run(backend, x, w1, b1, w2, b2):
        return F.feed_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.1, backend=backend)

    return run, (x, w1, b1, w2, b2)


CASES = {
    "scaled_dot_product_attention": _sdpa_case,
    "masked_softmax": _softmax_case,
    "add_layer_norm": _layer_norm_case,
    "feed_forward": _feed_forward_case,
}


def _fwd_bwd(run, backend, inputs, upstream_seed):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    torch.manual_seed(1234)  # the op's dropout seed comes from torch's generator
    out = run(backend, *leaves)
    g = torch.Generator(device="cpu").manual_seed(upstream_seed)
    upstream = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, upstream, allow_unused=True)
    return [out.detach()] + [gr for gr in grads if gr is not None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(CASES))
def test_backward_is_bitwise_reproducible(op, backend, device):
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    ok, why = backends.available(backend, device)
    if not ok:
        pytest.skip(why)
    if backend not in backends.implemented_backends(op):
        pytest.skip(f"{op} has no {backend} implementation")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    run, inputs = CASES[op](device, dtype)
    with deterministic():
        try:
            first = _fwd_bwd(run, backend, inputs, 7)
        except RuntimeError as err:  # a path that cannot be deterministic must say so clearly
            assert "deterministic" in str(err), err
            pytest.skip(f"{backend} raises under deterministic mode: {err}")
        second = _fwd_bwd(run, backend, inputs, 7)
    assert len(first) == len(second) == 1 + len(inputs)
    for a, b in zip(first, second):
        assert torch.equal(a, b), f"{op} {backend}: not bitwise reproducible"
