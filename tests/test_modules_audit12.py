"""From the twelfth outside audit (the modules in training loops; 2026-11-30, tenth session): a
key_padding_mask reused in place between forward and backward (e.g. flipped into a "valid
tokens" mask for the loss).  torch.nn's MultiheadAttention converts the mask before use, so its
backward runs.  The reference backend kept the caller's bool mask in its masked_fill and
autograd refused the edited version: it takes a copy now.  The fused backends keep the caller's
mask for backward (a copy would be one more kernel per attention call on a GPU): there autograd
refuses an edited mask with its in-place error, never a wrong gradient (README limits)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import transformer_fast as tf

from conftest import backend_params, require_backend


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_padding_mask_reused_in_place_before_backward(backend, kind):
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    ours = tf.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 6, 32)
    grads = []
    for layer in (theirs, ours):
        pad = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
        mask = pad if kind == "bool" else torch.zeros(2, 6).masked_fill(pad, float("-inf"))
        with tf.use_backend(backend):
            out = layer(x, src_key_padding_mask=mask)
        if kind == "bool":
            mask.logical_not_()  # now True = a real token
            weight = mask
        else:
            weight = torch.isfinite(mask)
            mask.zero_()
        loss = (out * weight[..., None]).sum() / weight.sum()
        layer.zero_grad()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("backend", backend_params("cpu", "triton"))
def test_fused_backends_refuse_a_padding_mask_edited_before_backward(backend, kind):
    require_backend(backend)
    torch.manual_seed(0)
    layer = tf.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    pad = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    mask = pad if kind == "bool" else torch.zeros(2, 6).masked_fill(pad, float("-inf"))
    with tf.use_backend(backend):
        out = layer(torch.randn(2, 6, 32), src_key_padding_mask=mask)
    mask.logical_not_() if kind == "bool" else mask.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
