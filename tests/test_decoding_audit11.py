"""From the eleventh outside audit (models, decoding, CLIs; 2026-11-30, tenth session)."""
from __future__ import annotations

import torch

from transformer_fast.models import Seq2SeqTransformer


def test_beam_of_one_is_greedy_in_a_float64_model():
    """beam_search ranked in float32 whatever the model's dtype: logits of a float64 model that
    differ below float32's resolution (1e-9 here) tied, and beam_size=1 left greedy decoding
    (which takes the float64 argmax).  It ranks in float64 for a float64 model now."""
    torch.manual_seed(0)
    vocab = 40
    model = Seq2SeqTransformer(vocab, vocab, d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=64).double().eval()
    with torch.no_grad():
        w = model.generator.weight
        for i in range(3, vocab - 1, 2):
            w[i + 1] = w[i] * (1 + 1e-9)  # class i + 1's logit exceeds class i's by ~1e-9 |z|
        w[2].zero_()
        w.mul_(5)
    src = torch.randint(3, vocab, (4, 6))
    greedy = model.greedy_decode(src, 6)
    assert torch.equal(model.beam_search(src, 1, 6, 1.0), greedy)
    assert torch.equal(model.beam_search(src, 1, 6, 1.0, use_cache=False), greedy)
