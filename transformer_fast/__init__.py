"""transformer_fast: fused kernels for the Transformer of "Attention Is All You Need".

    import transformer_fast as tf
    y = tf.functional.add_layer_norm(x, residual, weight, bias)
    with tf.use_backend("triton"):
        ...
"""
from . import backends

backends.extension_status()  # load _C (registers the C++ ops) before anything traces an op
backends.triton_status()

from . import functional, reference  # noqa: E402
from .backends import BACKENDS, BackendError, not_supported_reasons, use_backend

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendError",
    "backends",
    "functional",
    "not_supported_reasons",
    "reference",
    "use_backend",
]
