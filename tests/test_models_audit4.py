"""An outside audit of the model-level API (2026-11-29, second session): the fused loss under
autocast with float64 inputs and under torch.func transforms, the positional encoding's
arguments, and argument handling a torch user expects.  Each case failed before the fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from transformer_fast.models import (ScaledEmbedding, Seq2SeqTransformer, SinusoidalPositionalEncoding,
                                     TransformerClassifier, label_smoothed_cross_entropy,
                                     linear_cross_entropy)


def test_fused_loss_keeps_float64_under_autocast():
    """torch's autocast leaves float64 alone; the fused loss cast it to bf16 (8.8e-4 off)."""
    torch.manual_seed(0)
    h, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    t = torch.randint(0, 11, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, None, 0.1)
        want = F.cross_entropy(F.linear(h, w), t, label_smoothing=0.1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)


def test_model_loss_in_float64_under_autocast():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(13, 13, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0).double()
    src, tgt = torch.randint(3, 13, (2, 5)), torch.randint(3, 13, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.loss(src, tgt[:, :-1], tgt[:, 1:])
        logits = model(src, tgt[:, :-1])
    assert got.dtype == torch.float64 and logits.dtype == torch.float64
    torch.testing.assert_close(got, label_smoothed_cross_entropy(logits, tgt[:, 1:], 0.1, 0))


def test_fused_loss_under_torch_func():
    """The fused autograd.Function has no setup_context: torch.func.grad and vmap raised."""
    torch.manual_seed(0)
    h, w, t = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
    got = torch.func.grad(lambda x: linear_cross_entropy(x, w, t, None, 0.1))(h)
    want = torch.func.grad(lambda x: F.cross_entropy(F.linear(x, w), t, label_smoothing=0.1))(h)
    torch.testing.assert_close(got, want)
    per_row = torch.func.vmap(lambda x, y: linear_cross_entropy(x[None], w, y[None], None, 0.1))(h, t)
    torch.testing.assert_close(per_row, F.cross_entropy(F.linear(h, w), t, label_smoothing=0.1,
                                                        reduction="none"))

    model = Seq2SeqTransformer(13, 13, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0)
    src, tgt = torch.randint(3, 13, (2, 5)), torch.randint(3, 13, (2, 6))
    loss_of = _LossOf(model)
    params = {name: p.detach() for name, p in loss_of.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(loss_of, p, (src, tgt)))(params)
    model.loss(src, tgt[:, :-1], tgt[:, 1:]).backward()
    for name, p in loss_of.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


class _LossOf(torch.nn.Module):
    """model.loss as a module's forward, for torch.func.functional_call."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, src, tgt):
        return self.model.loss(src, tgt[:, :-1], tgt[:, 1:])


@pytest.mark.parametrize("offset", [-1, -5])
def test_positional_encoding_refuses_a_negative_offset(offset):
    """A negative offset sliced the cached table from its end (positions 507..509)."""
    pe = SinusoidalPositionalEncoding(8)
    with pytest.raises(ValueError, match="offset"):
        pe(torch.zeros(1, 3, 8), offset)
    with pytest.raises(ValueError, match="offset"):
        pe.positions(3, offset)


@pytest.mark.parametrize("shape", [(2, 3, 1), (2, 3, 5), (3, 8)])
def test_positional_encoding_checks_the_input_width(shape):
    """A last dimension of 1 broadcast to d_model silently."""
    with pytest.raises(ValueError, match="d_model"):
        SinusoidalPositionalEncoding(8)(torch.zeros(shape))


def test_numpy_float32_smoothing_is_taken_as_torch_takes_it():
    torch.manual_seed(0)
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    want = F.cross_entropy(F.linear(h, w), t, label_smoothing=np.float32(0.1))
    torch.testing.assert_close(linear_cross_entropy(h, w, t, None, np.float32(0.1)), want)
    torch.testing.assert_close(label_smoothed_cross_entropy(F.linear(h, w), t, np.float32(0.1)), want)


def test_an_empty_vocabulary_is_a_named_error():
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(0, 8), torch.full((4,), -100), None, 0.1, -100)


def test_scaled_embedding_from_pretrained():
    w = torch.randn(5, 4)
    emb = ScaledEmbedding.from_pretrained(w)
    assert not emb.weight.requires_grad
    torch.testing.assert_close(emb(torch.tensor([1, 3])), w[[1, 3]] * 2.0)
    padded = ScaledEmbedding(5, 4, padding_idx=0)
    assert padded.weight[0].eq(0).all()


def test_classifier_names_a_bad_activation():
    with pytest.raises(ValueError, match="activation"):
        TransformerClassifier(20, 3, d_model=8, nhead=2, num_layers=1, activation="tanh")
    TransformerClassifier(20, 3, d_model=8, nhead=2, num_layers=1, activation=torch.tanh)
