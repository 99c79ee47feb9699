"""The one place the models take their Transformer building blocks from.

The models are built from drop-in ``torch.nn``-compatible modules (same constructor signatures
and parameter names), so switching between ``torch.nn`` and ``transformer_fast.modules`` is this
one import.  The KV-cached decoding path (decoding.py) reads the layers' own parameters, so it
works with either class.
"""
from __future__ import annotations

from ..modules import (  # noqa: F401  (re-exported)
    LayerNorm,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

SOURCE = "transformer_fast.modules"
