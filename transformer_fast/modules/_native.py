"""A replayed encoder layer's inference call as one C++ op (csrc/encoder_layer.cpp).

A replayed call (modules/_lane.py) skips the checks and the backend choices, but still runs
~130-210 us of Python between a layer's kernels on this CPU (the ops' plumbing, views, module
attribute reads; benchmarks/NOTES.md "A layer's host time"), about the GPU's time for the
paper's base layer at B 64, L 128.  Where the replayed call is plain inference, the whole layer
runs instead as ``torch.ops.transformer_fast_C.encoder_layer_infer``: the same ops on the same
recorded backends (ATen's for ``torch``, our C++ kernels for ``cpu`` / ``cuda``), so the result
is the same bit for bit (tests/test_native_layer.py).

A layer call runs natively when, besides being replayed: nothing needs a gradient; every
dropout rate is 0 (eval); the activation is relu / gelu / gelu_tanh; the self-attention packs
q, k and v in one projection, without bias_k / bias_v / add_zero_attn; the input is batched and
not empty; the mask is a bool key padding mask, the causal hint, or none; the recorded
backends are ``torch``, ``cpu`` or ``cuda``; the ``torch`` add + LayerNorm has parameters in the
input's dtype.  All of it is part of the replay's signature, so it is decided once per signature
and position in the lane (a stack's chain has one per layer).
"""
from __future__ import annotations

import torch

from .. import backends
from .. import functional as tf_functional
from . import _lane
from . import _semantics as sem

# Switch for tests and measurements: False keeps every layer on the Python replay.
ENABLED = True

_CODES = {"torch": 0, "cpu": 1, "cuda": 1}  # csrc/encoder_layer.cpp's kTorch / kFused
_OPS = ("scaled_dot_product_attention", "add_layer_norm", "feed_forward", "add_layer_norm")
_NO_PARAMS: dict = {}


def _op():
    ok, _ = backends.extension_status()
    return getattr(torch.ops.transformer_fast_C, "encoder_layer_infer", None) if ok else None


def encoder_plan(layer, upcoming, x, mask, padding, is_causal, normed, next_norm):
    """The constant arguments of the native call for ``layer._fused(x, mask, padding,
    is_causal, normed, next_norm)`` at a lane position whose recorded ops are ``upcoming``, or
    None when this call must stay on the Python replay."""
    from .activation import MultiheadAttention

    if not ENABLED or _op() is None:
        return None
    attn = layer.self_attn
    if (type(attn) is not MultiheadAttention or not attn._qkv_same_embed_dim
            or attn.in_proj_weight is None or attn.bias_k is not None or attn.bias_v is not None
            or attn.add_zero_attn or (attn.training and attn.dropout > 0.0)):
        return None
    if x.dim() != 3 or x.numel() == 0 or (next_norm is not None and not layer.norm_first):
        return None
    causal = bool(is_causal)
    if (mask is not None and not causal) or (
            padding is not None and (padding.dtype != torch.bool or padding.dim() != 2)):
        return None
    activation = sem.fused_activation(layer.activation)
    if activation is None or any(sem.dropout_p(d) != 0.0
                                 for d in (layer.dropout, layer.dropout1, layer.dropout2)):
        return None
    count = 3 if layer.norm_first and next_norm is None else 4
    if len(upcoming) < count or tuple(op for op, _ in upcoming[:count]) != _OPS[:count]:
        return None
    codes = [_CODES.get(name) for _, name in upcoming[:count]]
    if None in codes:
        return None
    codes += [0] * (4 - count)
    params = _params(layer, next_norm)
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, normed, padding, *params)):
        return None
    if layer.norm_first:
        norms, eps = (layer.norm2, next_norm), (layer.norm1.eps, layer.norm2.eps,
                                                 0.0 if next_norm is None else next_norm.eps)
    else:
        norms, eps = (layer.norm1, layer.norm2), (layer.norm1.eps, layer.norm2.eps, 0.0)
    for norm, code in zip(norms, (codes[1], codes[3])):
        # functional._torch_add_layer_norm casts parameters of another dtype first
        if norm is not None and code == 0 and any(
                p is not None and p.dtype != x.dtype for p in (norm.weight, norm.bias)):
            return None
    return (count, list(eps), codes, attn.num_heads, attn.batch_first, layer.norm_first, causal,
            next_norm is not None, activation, x.dtype == torch.float32)


def _params(layer, next_norm) -> list:
    """The layer's tensors in csrc/encoder_layer.cpp's Param order (read from the modules'
    dicts: Module.__getattr__ costs ~0.3 us a read)."""
    mods = layer._modules
    attn = mods["self_attn"]
    ap = attn._parameters
    out = attn._modules["out_proj"]._parameters
    l1, l2 = mods["linear1"]._parameters, mods["linear2"]._parameters
    n1, n2 = mods["norm1"]._parameters, mods["norm2"]._parameters
    nn = _NO_PARAMS if next_norm is None else next_norm._parameters
    return [ap["in_proj_weight"], ap.get("in_proj_bias"), out["weight"], out.get("bias"),
            l1["weight"], l1.get("bias"), l2["weight"], l2.get("bias"),
            n1.get("weight"), n1.get("bias"), n2.get("weight"), n2.get("bias"),
            nn.get("weight"), nn.get("bias")]


def encoder_layer(layer, lane, x, mask, padding, is_causal, normed, next_norm):
    """``layer._fused(...)``'s (out, next_norm(out) or None) computed natively when the lane's
    plan at this position allows it; None to run the Python replay."""
    plan = lane.native()
    if plan is _lane.UNSET:
        plan = lane.decide_native(
            encoder_plan(layer, lane.upcoming(), x, mask, padding, is_causal, normed, next_norm))
    if plan is None:
        return None
    count, eps, codes, heads, batch_first, norm_first, causal, has_next, activation, fp32 = plan
    lane.skip(count)
    allow_tf32 = tf_functional._allow_tf32(x.dtype) if fp32 else False
    outs = torch.ops.transformer_fast_C.encoder_layer_infer(
        x, normed, padding, _params(layer, next_norm), eps, codes, heads, batch_first, norm_first,
        causal, has_next, activation, allow_tf32)
    return outs[0], (outs[1] if has_next else None)
