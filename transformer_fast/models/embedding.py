"""Token embeddings scaled by sqrt(d_model) and sinusoidal positional encoding (paper 3.4, 3.5)."""
from __future__ import annotations

import math

import torch
from torch import nn

from . import _validate


def sinusoidal_positions(length: int, d_model: int, *, offset: int = 0, device=None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(length, d_model) table for positions offset .. offset + length - 1.

    PE[pos, 2i] = sin(pos / 10000^(2i / d_model)), PE[pos, 2i + 1] = cos(pos / 10000^(2i / d_model)).
    Computed in float64 (exact enough for positions far past any training length), then cast.
    """
    for name, value, low in (("length", length, 0), ("d_model", d_model, 1), ("offset", offset, 0)):
        _validate.integer(name, value, low)  # (arange and the division take integer-likes)
    pos = torch.arange(offset, offset + length, dtype=torch.float64, device=device).unsqueeze(1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (ceil(d/2),)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (length, ceil(d/2))
    table = torch.empty(length, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])  # odd d_model: one cos column fewer
    return table.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """``x + PE[offset : offset + L]`` for x (B, L, d_model), any length.

    The float64 table is a per-device cache, not a buffer: absent from the state_dict, untouched
    by ``model.half()`` (positions are cast to the input's dtype on use, never rounded twice), and
    regrown on demand, so sequences longer than any seen in training work.  While tracing
    (torch.compile, export) the rows are computed in the graph, so a dynamic length is unbounded.
    """

    def __init__(self, d_model: int, initial_length: int = 512):
        super().__init__()
        self.d_model = d_model
        self.initial_length = initial_length
        self._tables: dict[torch.device, torch.Tensor] = {}

    def positions(self, length: int, offset: int = 0, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """(length, d_model) encodings of positions offset .. offset + length - 1."""
        # A negative offset would slice the cached table from its end.
        offset, length = _validate.integer("offset", offset, 0), _validate.integer("length", length, 0)
        device = torch.device(device if device is not None else "cpu")
        if torch.compiler.is_compiling():
            # A traced length would guard on the cached table's size (an exported encoder
            # bounded by it): compute the rows in the graph instead, the same float64 formula.
            return sinusoidal_positions(length, self.d_model, offset=offset, device=device, dtype=dtype)
        end = offset + length
        table = self._tables.get(device)
        if table is None or end > table.shape[0]:
            grown = max(end, self.initial_length, 2 * (0 if table is None else table.shape[0]))
            table = sinusoidal_positions(grown, self.d_model, device=device, dtype=torch.float64)
            self._tables[device] = table
        return table[offset:end].to(dtype)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:  # (a last dim of 1 would broadcast)
            raise ValueError(f"x must be (B, L, d_model={self.d_model}); got shape {tuple(x.shape)}")
        return x + self.positions(x.shape[1], offset, dtype=x.dtype, device=x.device)


class ScaledEmbedding(nn.Embedding):
    """``Embedding(tokens) * sqrt(d_model)``; weights drawn from N(0, 1/d_model) so the scaled
    embeddings have unit variance (and a tied output projection starts with small logits)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, _weight=None, **kwargs):
        # nn.Embedding's other arguments pass through (from_pretrained gives _weight).
        super().__init__(num_embeddings, embedding_dim, *args, _weight=_weight, **kwargs)
        self.scale = math.sqrt(embedding_dim)
        if _weight is None:
            with torch.no_grad():
                nn.init.normal_(self.weight, mean=0.0, std=embedding_dim ** -0.5)
                if self.padding_idx is not None:
                    self.weight[self.padding_idx].zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale
