"""From the seventeenth outside audit (the README's claims against the package; 2026-11-30,
eleventh session):

- an explicit `cpu` / `triton` / `cuda` scaled_dot_product_attention refused zero keys with a
  BackendError ("needs at least one key") where `auto`, `torch` and `reference` return zeros, as
  DESIGN asks of a row with nothing to attend to and the README's "zero-size lengths work" says;
- the `torch` backend's masked_softmax scaled fp16 scores in fp16: scale * scores overflowed to
  inf (NaN probabilities) where every other backend, scaling in fp32, is finite and exact.
"""
from __future__ import annotations

import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F, reference

from conftest import backend_params, require_backend

ALL = backend_params("reference", "torch", "cpu", "triton", "cuda")


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kpm", [False, True], ids=["plain", "padding"])
@pytest.mark.parametrize("dims", [(2, 3, 16), (1, 4, 32)], ids=["B2H3", "B1H4"])
def test_sdpa_without_keys_gives_zeros(backend, kpm, dims):
    device = require_backend(backend)
    b, h, d = dims
    q = torch.randn(b, h, 5, d, device=device, requires_grad=True)
    k = torch.randn(b, h, 0, d, device=device, requires_grad=True)
    v = torch.randn(b, h, 0, d, device=device, requires_grad=True)
    extra = {"key_padding_mask": torch.zeros(b, 0, dtype=torch.bool, device=device)} if kpm else {}
    out = F.scaled_dot_product_attention(q, k, v, backend=backend, **extra)
    expected = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    assert out.shape == expected.shape == (b, h, 5, d)
    assert torch.equal(out.detach(), torch.zeros_like(out))
    out.backward(torch.randn_like(out))
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("backend", ALL)
def test_module_attention_without_keys(backend):
    device = require_backend(backend)
    torch.manual_seed(0)
    ours = tf.nn.MultiheadAttention(32, 2, batch_first=True).to(device)
    theirs = torch.nn.MultiheadAttention(32, 2, batch_first=True).to(device)
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ours.out_proj.bias.normal_()
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    x, mem = torch.randn(2, 3, 32, device=device), torch.randn(2, 0, 32, device=device)
    with tf.use_backend(backend):
        out, _ = ours(x, mem, mem, need_weights=False)
    expected, _ = theirs(x, mem, mem, need_weights=False)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_torch_masked_softmax_scales_16bit_scores_in_fp32(dtype, masked):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    # |scores| up to ~4e4: scale 10 takes them past fp16's 65504, the probabilities stay finite
    scores = (torch.randn(2, 4, 6, generator=g) * 1e4).to(dtype)
    mask = (torch.rand(4, 6, generator=g) > 0.3) if masked else None
    x = scores.clone().requires_grad_()
    out = F.masked_softmax(x, mask, scale=10.0, backend="torch")
    exact = reference.masked_softmax(scores.double(), mask, 10.0)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), exact, atol=1e-2, rtol=0)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(x.grad).all()
