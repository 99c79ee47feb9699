"""transformer_fast: fused kernels for the Transformer of "Attention Is All You Need".

    import transformer_fast as tf
    y = tf.functional.add_layer_norm(x, residual, weight, bias)
    with tf.use_backend("triton"):
        ...
    report = tf.swap(model)            # torch.nn Transformer modules -> fused drop-ins
    layer = tf.TransformerEncoderLayer(512, 8, batch_first=True)   # or tf.modules.*
"""
from . import backends

backends.extension_status()  # load _C (registers the C++ ops) before anything traces an op
backends.triton_status()

from . import functional, reference  # noqa: E402
from . import modules  # noqa: E402
from . import modules as nn  # noqa: E402  (transformer_fast.nn.TransformerEncoderLayer, ...)
from .backends import BACKENDS, BackendError, not_supported_reasons, use_backend  # noqa: E402
from .modules import (  # noqa: E402
    LayerNorm,
    MultiheadAttention,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from .swap import SwapReport, swap, unswap  # noqa: E402
from . import models  # noqa: E402  (tf.models.Seq2SeqTransformer, ...)

import sys as _sys  # noqa: E402

_sys.modules.setdefault(__name__ + ".nn", modules)  # `import transformer_fast.nn` works too

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendError",
    "LayerNorm",
    "MultiheadAttention",
    "SwapReport",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "backends",
    "functional",
    "models",
    "modules",
    "nn",
    "not_supported_reasons",
    "reference",
    "swap",
    "unswap",
    "use_backend",
]
