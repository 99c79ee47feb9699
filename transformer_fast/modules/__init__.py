"""Drop-in replacements for torch.nn's Transformer modules, on the fused functional ops.

    from transformer_fast import modules as nn   # or: import transformer_fast.modules as tnn
    layer = nn.TransformerEncoderLayer(512, 8, batch_first=True)

Each class has the constructor and forward signature, attributes, parameters (names, shapes,
init) and state_dict of the installed torch's class of the same name; a torch checkpoint loads
with strict=True and back.  transformer_fast.swap(model) turns torch's instances inside a model
into these (and unswap back).
"""
from .activation import MultiheadAttention
from .normalization import LayerNorm
from .transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "LayerNorm",
    "MultiheadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
