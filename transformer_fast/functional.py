"""Public functional ops (DESIGN section 4): validate inputs, choose a backend, run it.

Each op validates its arguments before any kernel runs (DESIGN section 9), resolves the backend
(``backend=`` keyword > ``use_backend`` context > ``TRANSFORMER_FAST_BACKEND`` > "auto") and
then runs the naive reference, PyTorch's own path, or one of the fused implementations through
the custom ops in transformer_fast.ops.

Dropout follows torch.nn.functional: it is applied whenever ``dropout_p > 0``; modules pass
``dropout_p=0`` in eval mode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks, backends, philox, reference
from .ops import layer_norm as _layer_norm_op

__all__ = [
    "scaled_dot_product_attention",
    "attention_with_kv_cache",
    "masked_softmax",
    "add_layer_norm",
    "feed_forward",
]


# --------------------------------------------------------------------------------------------
# add_layer_norm


def _add_layer_norm_support(backend):
    def check(inputs):
        return _checks.kernel_dtype_reasons(
            backend, x=inputs["x"], weight=inputs.get("weight"), bias=inputs.get("bias")
        )

    return check


for _name in ("triton", "cuda", "cpu"):
    backends.register("add_layer_norm", _name, _add_layer_norm_support(_name))
backends.register("add_layer_norm", "reference")
backends.register("add_layer_norm", "torch")


def _torch_add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm):
    summed = residual + F.dropout(x, dropout_p) if dropout_p > 0.0 else residual + x
    out = F.layer_norm(summed, (x.shape[-1],), weight, bias, eps)
    return (out, summed) if prenorm else out


def add_layer_norm(
    x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, prenorm=False, backend=None
):
    """``LayerNorm(residual + dropout(x))`` over the last dimension, fused in one pass.

    Args:
        x: (..., N) the sublayer output (dropout applies to it).
        residual: (..., N) the sublayer input, same shape, dtype and device as ``x``.
        weight, bias: (N,) LayerNorm affine parameters in ``x``'s dtype or float32, or None.
        eps: added to the variance, > 0.
        dropout_p: probability of dropping an element of ``x``, in [0, 1).
        prenorm: also return ``residual + dropout(x)`` (the running residual of a pre-LN stack).
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu" (None: the current
            default, see transformer_fast.use_backend).

    Returns:
        ``y`` (..., N) in ``x``'s dtype, or ``(y, residual + dropout(x))`` when ``prenorm``.
        Statistics are computed in float32 for half-precision inputs.
    """
    _checks.tensor("x", x, min_ndim=1)
    _checks.tensor("residual", residual)
    _checks.same_dtype(x=x, residual=residual)
    _checks.shape("residual", residual, x.shape, "the shape of x")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"x must have a non-empty last dimension; got shape {tuple(x.shape)}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            _checks.tensor(name, param, ndim=1)
            _checks.shape(name, param, (n,), "the last dimension of x")
            if param.dtype not in (x.dtype, torch.float32):
                raise TypeError(
                    f"{name} must have x's dtype ({x.dtype}) or float32; got {param.dtype}"
                )
    _checks.same_device(x=x, residual=residual, weight=weight, bias=bias)
    eps = _checks.positive_float("eps", eps)
    dropout_p = _checks.dropout_p(dropout_p)
    _checks.boolean("prenorm", prenorm)

    inputs = {"x": x, "residual": residual, "weight": weight, "bias": bias}
    name = backends.resolve("add_layer_norm", backend, inputs)
    if name == "reference":
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm)
    if name == "torch":
        return _torch_add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm)
    rng = philox.new_rng(x.device) if dropout_p > 0.0 else None
    return _layer_norm_op.add_layer_norm(x, residual, weight, bias, eps, dropout_p, rng, prenorm, name)


# --------------------------------------------------------------------------------------------
# Attention, masked softmax, feed-forward: reference and torch backends (fused kernels: later
# issues).


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, key_padding_mask=None, backend=None,
):
    raise NotImplementedError


def attention_with_kv_cache(
    q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, scale=None, backend=None
):
    raise NotImplementedError


def masked_softmax(scores, mask=None, *, scale=1.0, is_causal=False, dropout_p=0.0, backend=None):
    raise NotImplementedError


def feed_forward(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, backend=None):
    raise NotImplementedError
