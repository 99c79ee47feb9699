"""From the fourteenth outside audit (the functional ops' metadata against torch's; 2026-11-30,
tenth session):

- with a mask, the `torch` backend (and `auto` on it) returned a contiguous SDPA output where
  torch's SDPA keeps q's memory order: q/k/v as (B, L, H, D) projections transposed, then
  `out.transpose(1, 2).view(B, L, H * D)` failed (the zeroing of fully masked rows made a
  contiguous copy);
- the fused kernels laid the output out by q's strides with a broadcast (stride-0) dim
  innermost: torch's output for an expanded q is contiguous;
- enable_gqa under torch.compile with symbolic head counts (dynamic=True): torch's SDPA refused
  the SymBool we handed it;
- attention_with_kv_cache under a FakeTensorMode read cache_seqlens' values on the host.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from torch._subclasses.fake_tensor import FakeTensorMode

from transformer_fast import functional as F

from conftest import backend_params, require_backend

B, L, H, D = 2, 5, 3, 16


def _projected(device, dtype=torch.float32):
    """q, k, v as (B, H, L, D) views of (B, L, H, D) tensors, as a packed projection gives them."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    return tuple(torch.randn(B, L, H, D, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
                 for _ in range(3))


MASKS = {
    "none": lambda dev: ({}, {}),
    "bool": lambda dev: ({"attn_mask": torch.ones(L, L, dtype=torch.bool, device=dev).tril()},) * 2,
    "float": lambda dev: ({"attn_mask": torch.randn(L, L, device=dev)},) * 2,
    "bool_b11s": lambda dev: ({"attn_mask": torch.rand(B, 1, 1, L, device=dev) > 0.3},) * 2,
    "causal": lambda dev: ({"is_causal": True},) * 2,
    "key_padding": lambda dev: _padding(dev),
}


def _padding(dev):
    kpm = torch.zeros(B, L, dtype=torch.bool, device=dev)
    kpm[0, -2:] = True
    return {"key_padding_mask": kpm}, {"attn_mask": ~kpm.view(B, 1, 1, L)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("backend", ["auto", "torch", *backend_params("cpu", "triton")])
def test_output_keeps_the_projections_memory_order_as_torch(backend, mask):
    dev = require_backend(backend) if backend not in ("auto", "torch") else "cpu"
    q, k, v = _projected(dev)
    ours_kw, torch_kw = MASKS[mask](dev)
    out = F.scaled_dot_product_attention(q, k, v, **ours_kw, backend=backend)
    want = TF.scaled_dot_product_attention(q, k, v, **torch_kw)
    assert out.stride() == want.stride()
    merged = out.transpose(1, 2).view(B, L, H * D)  # the head merge is a view, as with torch's
    torch.testing.assert_close(merged, want.transpose(1, 2).reshape(B, L, H * D), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", *backend_params("cpu", "triton")])
def test_expanded_query_gives_a_contiguous_output_as_torch(backend):
    dev = require_backend(backend) if backend != "auto" else "cpu"
    q = torch.randn(1, H, L, D, device=dev).expand(B, H, L, D)
    k, v = torch.randn(B, H, L, D, device=dev), torch.randn(B, H, L, D, device=dev)
    out = F.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.is_contiguous() and TF.scaled_dot_product_attention(q, k, v).is_contiguous()
    out.view(B, -1)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_grouped_query_attention_compiles_with_symbolic_head_counts(backend):
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend),
                       fullgraph=True, backend="aot_eager", dynamic=True)
    for heads, kv_heads in ((4, 2), (6, 3), (4, 4)):
        q = torch.randn(2, heads, 5, 16)
        k, v = torch.randn(2, kv_heads, 5, 16), torch.randn(2, kv_heads, 5, 16)
        want = TF.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(fn(q, k, v), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_kv_cache_compiles_with_symbolic_head_counts(backend):
    fn = torch.compile(lambda *a: F.attention_with_kv_cache(*a, backend=backend), fullgraph=True,
                       backend="aot_eager", dynamic=True)
    for heads, kv_heads in ((4, 2), (6, 3), (8, 8)):
        q = torch.randn(2, heads, 3, 16)
        caches = torch.randn(2, kv_heads, 10, 16), torch.randn(2, kv_heads, 10, 16)
        seqlens = torch.tensor([2, 4], dtype=torch.int32)
        new = torch.randn(2, kv_heads, 3, 16), torch.randn(2, kv_heads, 3, 16)
        want = F.attention_with_kv_cache(q, *(c.clone() for c in caches), seqlens, *new, backend="reference")
        got = fn(q, *(c.clone() for c in caches), seqlens, *new)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "torch", *backend_params("cpu")])
def test_kv_cache_under_a_fake_tensor_mode(backend):
    if backend == "cpu":
        require_backend("cpu")
    args = (torch.randn(2, 2, 1, 16), torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16),
            torch.tensor([1, 2], dtype=torch.int32), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(a) for a in args]
    with mode:
        out = F.attention_with_kv_cache(*fakes, backend=backend)
    assert tuple(out.shape) == (2, 2, 1, 16) and out.dtype == torch.float32
