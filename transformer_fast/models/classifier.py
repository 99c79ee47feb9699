"""The encoder-only text classifier of the seeds: token embeddings and positions, the
Transformer encoder, a pooled sentence vector and a linear head."""
from __future__ import annotations

import torch
from torch import nn

from . import _validate
from ._layers import LayerNorm, TransformerEncoder, TransformerEncoderLayer
from .embedding import ScaledEmbedding, SinusoidalPositionalEncoding

POOLINGS = ("mean", "first")


class TransformerClassifier(nn.Module):
    """tokens (B, L) -> class logits (B, num_classes).

    Args:
        vocab_size, num_classes: sizes.
        d_model, nhead, num_layers, dim_feedforward, dropout: encoder hyper-parameters.
        pad_id: padding id (masked in attention and left out of the pooling).
        pooling: "mean" over the non-padding positions, or "first" (the vector at position 0,
            e.g. a [CLS] token the caller puts there).
        activation, norm_first: as torch.nn.TransformerEncoderLayer.
    """

    def __init__(self, vocab_size, num_classes, d_model=512, nhead=8, num_layers=6,
                 dim_feedforward=2048, dropout=0.1, pad_id=0, pooling="mean", *,
                 activation="relu", norm_first=False):
        super().__init__()
        vocab_size, num_classes, d_model, nhead, num_layers, dim_feedforward = (
            _validate.positive_int(name, value) for name, value in (
                ("vocab_size", vocab_size), ("num_classes", num_classes), ("d_model", d_model),
                ("nhead", nhead), ("num_layers", num_layers), ("dim_feedforward", dim_feedforward)))
        if d_model % nhead:
            raise ValueError(f"d_model ({d_model}) must be divisible by nhead ({nhead})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a float in [0, 1); got {dropout!r}")
        _validate.token_id("pad_id", pad_id, vocab_size)
        if not callable(activation) and activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu', 'gelu' or a callable; got {activation!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}; got {pooling!r}")
        self.vocab_size, self.num_classes, self.pad_id, self.pooling = vocab_size, num_classes, pad_id, pooling
        self.embed = ScaledEmbedding(vocab_size, d_model)
        self.positions = SinusoidalPositionalEncoding(d_model)
        self.dropout = nn.Dropout(dropout)
        layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation=activation,
                                        batch_first=True, norm_first=norm_first)
        self.encoder = TransformerEncoder(layer, num_layers, norm=LayerNorm(d_model) if norm_first else None,
                                          enable_nested_tensor=False)
        for p in self.encoder.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _validate.tokens("tokens", tokens, self.vocab_size, pad_id=self.pad_id,
                         device=self.head.weight.device)
        padding = tokens == self.pad_id  # (B, L) True = pad
        x = self.dropout(self.positions(self.embed(tokens)))  # (B, L, d)
        h = self.encoder(x, src_key_padding_mask=padding)  # (B, L, d)
        if self.pooling == "first":
            pooled = h[:, 0]
        else:
            keep = (~padding).unsqueeze(-1).to(h.dtype)  # (B, L, 1)
            # Every row has a token (checked eagerly; not while torch.compile traces, where an
            # all-padding row then pools to zeros, not NaN).
            pooled = (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        return self.head(pooled)  # (B, num_classes)
