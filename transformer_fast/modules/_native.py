"""A replayed layer's inference call as one C++ op (csrc/layer_inference.cpp).

A replayed call (modules/_lane.py) skips the checks and the backend choices, but still runs
~130-210 us of Python between a layer's kernels on this CPU (the ops' plumbing, views, module
attribute reads; benchmarks/NOTES.md "A layer's host time"), about the GPU's time for the
paper's base layer at B 64, L 128.  Where the replayed call is plain inference, the whole
layer runs instead as ``torch.ops.transformer_fast_C.encoder_layer_infer`` (or
``decoder_layer_infer``): the same ops on the same recorded backends (ATen's for ``torch``, our
C++ kernels for ``cpu`` / ``cuda``), so the result is the same bit for bit
(tests/test_native_layer.py).

A layer call runs natively when, besides being replayed: nothing needs a gradient; every
dropout rate is 0 (eval); the activation is relu / gelu / gelu_tanh; each attention packs q, k
and v in one projection, without bias_k / bias_v / add_zero_attn, a decoder's two with the same
number of heads and layout; the inputs are batched and
not empty; each attention's mask is a bool key padding mask, the causal hint, or none; the
recorded backends are ``torch``, ``cpu`` or ``cuda``; the ``torch`` add + LayerNorm has
parameters in the input's dtype.  All of it is part of the replay's signature, so it is decided once per signature
and position in the lane (a stack's chain has one per layer).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.utils import parametrize

from .. import backends
from .. import functional as tf_functional
from . import _lane
from . import _semantics as sem

# Switch for tests and measurements: False keeps every layer on the Python replay.
ENABLED = True

_CODES = {"torch": 0, "cpu": 1, "cuda": 1}  # csrc/layer_inference.cpp's kTorch / kFused
_ENCODER_OPS = ("scaled_dot_product_attention", "add_layer_norm", "feed_forward", "add_layer_norm")
_DECODER_OPS = ("scaled_dot_product_attention", "add_layer_norm", "scaled_dot_product_attention",
                "add_layer_norm", "feed_forward", "add_layer_norm")
_NO_PARAMS: dict = {}


class EncoderPlan(NamedTuple):
    """A native encoder layer call's constant arguments (csrc/layer_inference.cpp)."""

    count: int  # recorded ops it stands for
    eps: list
    codes: list
    heads: int
    batch_first: bool
    norm_first: bool
    causal: bool
    next_norm: bool
    activation: str
    fp32: bool  # allow_tf32 is read per call (torch's matmul setting)


class DecoderPlan(NamedTuple):
    count: int
    eps: list
    codes: list
    heads: int
    batch_first: bool
    norm_first: bool
    tgt_causal: bool
    memory_causal: bool
    next_norm: bool
    activation: str
    fp32: bool


def _available() -> bool:
    ok, _ = backends.extension_status()
    return ok and hasattr(torch.ops.transformer_fast_C, "decoder_layer_infer")


def _attention_ok(attn) -> bool:
    """A MultiheadAttention whose call _attend computes as the C++ attention does: ours, q / k /
    v packed in one in_proj_weight, no appended keys, no dropout."""
    from .activation import MultiheadAttention

    return (type(attn) is MultiheadAttention and attn._qkv_same_embed_dim
            and attn.in_proj_weight is not None and attn.bias_k is None and attn.bias_v is None
            and not attn.add_zero_attn and not (attn.training and attn.dropout > 0.0))


def _masks_ok(mask, padding, is_causal) -> bool:
    """No mask, the causal hint (which stands for the mask), and / or a bool key padding mask."""
    return ((mask is None or bool(is_causal))
            and (padding is None or (padding.dtype == torch.bool and padding.dim() == 2)))


def _weights_elsewhere(layer, next_norm) -> bool:
    """The native call reads the parameters from the modules' ``_parameters`` dicts.  A weight
    held otherwise stays on the Python replay, which reads the attributes: a parametrized one
    (torch.nn.utils.parametrize: weight_norm, spectral_norm, LoRA-style wrappers) is computed by
    its module's attribute, and a plain tensor attribute or a buffer (hand-tied weights:
    ``del lin.weight; lin.weight = other.weight.t()``) is in no ``_parameters``.  The layers'
    own modules hold neither."""
    modules = [*layer.modules(), *(() if next_norm is None else (next_norm,))]
    return any(parametrize.is_parametrized(m) or any(b is not None for b in m._buffers.values())
               or any(isinstance(v, torch.Tensor) for v in m.__dict__.values()) for m in modules)


def _codes(layer, upcoming, ops, dropouts, x, tensors, norms) -> list | None:
    """The backend codes of the recorded ``ops`` when the layer's call can run natively."""
    if not (ENABLED and _available()) or x.dim() != 3 or x.numel() == 0:
        return None
    if sem.fused_activation(layer.activation) is None or any(sem.dropout_p(d) != 0.0 for d in dropouts):
        return None
    count = len(ops)
    if len(upcoming) < count or tuple(op for op, _ in upcoming[:count]) != ops:
        return None
    codes = [_CODES.get(name) for _, name in upcoming[:count]]
    if None in codes:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    for norm, code in zip(norms, codes[1::2]):  # each add + norm follows a sublayer
        # functional._torch_add_layer_norm casts parameters of another dtype first
        if norm is not None and code == 0 and any(
                p is not None and p.dtype != x.dtype for p in (norm.weight, norm.bias)):
            return None
    return codes


def encoder_plan(layer, upcoming, x, mask, padding, is_causal, normed, next_norm):
    """The constant arguments of the native call for ``layer._fused(x, mask, padding,
    is_causal, normed, next_norm)`` at a lane position whose recorded ops are ``upcoming``, or
    None when this call must stay on the Python replay."""
    if (not _attention_ok(layer.self_attn) or not _masks_ok(mask, padding, is_causal)
            or (next_norm is not None and not layer.norm_first) or _weights_elsewhere(layer, next_norm)):
        return None
    pre = layer.norm_first
    ops = _ENCODER_OPS[:3] if pre and next_norm is None else _ENCODER_OPS
    norms = (layer.norm2, next_norm) if pre else (layer.norm1, layer.norm2)
    codes = _codes(layer, upcoming, ops, (layer.dropout, layer.dropout1, layer.dropout2), x,
                   (x, normed, padding, *_encoder_params(layer, next_norm)), norms)
    if codes is None:
        return None
    eps = [layer.norm1.eps, layer.norm2.eps, 0.0 if next_norm is None else next_norm.eps]
    return EncoderPlan(len(ops), eps, codes + [0] * (4 - len(ops)), layer.self_attn.num_heads,
                       layer.self_attn.batch_first, pre, bool(is_causal), next_norm is not None,
                       sem.fused_activation(layer.activation), x.dtype == torch.float32)


def decoder_plan(layer, upcoming, x, memory, tgt_mask, memory_mask, tgt_padding, memory_padding,
                 tgt_is_causal, memory_is_causal, normed, next_norm):
    """encoder_plan for ``TransformerDecoderLayer._fused``."""
    if (not _attention_ok(layer.self_attn) or not _attention_ok(layer.multihead_attn)
            # the C++ op takes one head count and layout for both attentions (a replaced
            # multihead_attn may differ)
            or layer.multihead_attn.num_heads != layer.self_attn.num_heads
            or layer.multihead_attn.batch_first != layer.self_attn.batch_first
            or not _masks_ok(tgt_mask, tgt_padding, tgt_is_causal)
            or not _masks_ok(memory_mask, memory_padding, memory_is_causal)
            or memory.dim() != 3 or memory.numel() == 0
            or (next_norm is not None and not layer.norm_first) or _weights_elsewhere(layer, next_norm)):
        return None
    pre = layer.norm_first
    ops = _DECODER_OPS[:5] if pre and next_norm is None else _DECODER_OPS
    norms = (layer.norm2, layer.norm3, next_norm) if pre else (layer.norm1, layer.norm2, layer.norm3)
    tensors = (x, memory, normed, tgt_padding, memory_padding, *_decoder_params(layer, next_norm))
    codes = _codes(layer, upcoming, ops, (layer.dropout, layer.dropout1, layer.dropout2, layer.dropout3),
                   x, tensors, norms)
    if codes is None:
        return None
    eps = [layer.norm1.eps, layer.norm2.eps, layer.norm3.eps,
           0.0 if next_norm is None else next_norm.eps]
    return DecoderPlan(len(ops), eps, codes + [0] * (6 - len(ops)), layer.self_attn.num_heads,
                       layer.self_attn.batch_first, pre, bool(tgt_is_causal), bool(memory_is_causal),
                       next_norm is not None, sem.fused_activation(layer.activation),
                       x.dtype == torch.float32)


# The layers' tensors in csrc/layer_inference.cpp's order, read from the modules' dicts
# (Module.__getattr__ costs ~0.3 us a read).

def _attention_params(attn) -> list:
    ap = attn._parameters
    out = attn._modules["out_proj"]._parameters
    return [ap["in_proj_weight"], ap.get("in_proj_bias"), out["weight"], out.get("bias")]


def _ffn_and_norm_params(mods, norms, next_norm) -> list:
    l1, l2 = mods["linear1"]._parameters, mods["linear2"]._parameters
    params = [l1["weight"], l1.get("bias"), l2["weight"], l2.get("bias")]
    for name in norms:
        n = mods[name]._parameters
        params += (n.get("weight"), n.get("bias"))
    n = _NO_PARAMS if next_norm is None else next_norm._parameters
    return params + [n.get("weight"), n.get("bias")]


def _encoder_params(layer, next_norm) -> list:
    mods = layer._modules
    return _attention_params(mods["self_attn"]) + _ffn_and_norm_params(mods, ("norm1", "norm2"), next_norm)


def _decoder_params(layer, next_norm) -> list:
    mods = layer._modules
    return (_attention_params(mods["self_attn"]) + _attention_params(mods["multihead_attn"])
            + _ffn_and_norm_params(mods, ("norm1", "norm2", "norm3"), next_norm))


def _plan(lane, decide, layer, position=None):
    """The plan decided at the lane's current (or the given) position, deciding it first; None
    when ``layer``'s activation now means another function than when it was decided (a
    functools.partial's keywords edited in place leave the replay's signature unchanged)."""
    plan = lane.native(position)
    if plan is _lane.UNSET:
        plan = lane.decide_native(decide(), position)
    if plan is not None and sem.fused_activation(layer.activation) != plan.activation:
        return None
    return plan


def _allow_tf32(plan, x) -> bool:
    return tf_functional._allow_tf32(x.dtype) if plan.fp32 else False


def _run_encoder(layer, plan, x, normed, padding, next_norm, rows=None, buffer=None):
    return torch.ops.transformer_fast_C.encoder_layer_infer(
        x, normed, padding, _encoder_params(layer, next_norm), plan.eps, plan.codes, plan.heads,
        plan.batch_first, plan.norm_first, plan.causal, plan.next_norm, plan.activation,
        _allow_tf32(plan, x), rows, buffer)


def encoder_layer(layer, lane, x, mask, padding, is_causal, normed, next_norm):
    """``layer._fused(...)``'s (out, next_norm(out) or None) computed natively when the lane's
    plan at this position allows it; None to run the Python replay."""
    plan = _plan(lane, lambda: encoder_plan(layer, lane.upcoming(), x, mask, padding, is_causal,
                                             normed, next_norm), layer)
    if plan is None:
        return None
    lane.skip(plan.count)
    outs = _run_encoder(layer, plan, x, normed, padding, next_norm)
    return outs[0], (outs[1] if plan.next_norm else None)


def decoder_layer(layer, lane, x, memory, tgt_mask, memory_mask, tgt_padding, memory_padding,
                  tgt_is_causal, memory_is_causal, normed, next_norm):
    """encoder_layer for ``TransformerDecoderLayer._fused``."""
    if x is memory:  # the cross-attention then projects q, k, v in one GEMM, as self-attention
        return None
    plan = _plan(lane, lambda: decoder_plan(
        layer, lane.upcoming(), x, memory, tgt_mask, memory_mask, tgt_padding, memory_padding,
        tgt_is_causal, memory_is_causal, normed, next_norm), layer)
    if plan is None:
        return None
    lane.skip(plan.count)
    outs = torch.ops.transformer_fast_C.decoder_layer_infer(
        x, memory, normed, tgt_padding, memory_padding, _decoder_params(layer, next_norm), plan.eps,
        plan.codes, plan.heads, plan.batch_first, plan.norm_first, plan.tgt_causal,
        plan.memory_causal, plan.next_norm, plan.activation, _allow_tf32(plan, x))
    return outs[0], (outs[1] if plan.next_norm else None)


def packed_encoder(stack, lane, src, padding):
    """A post-LN encoder stack's layers on the valid tokens alone, where torch's encoder runs a
    NestedTensor (TransformerEncoder._nested_padding: eval, no grad, batch first, a left-aligned
    bool key padding mask and no attention mask), so that the padded positions' outputs are
    zeros whatever the layers compute there.  Every position-wise op (projections, add +
    LayerNorm, FFN) runs on the (N, E) valid rows, as torch's NestedTensor path does; the
    attention on a (B, L, 3E) buffer of them with the padding masked.  Returns the layers'
    output with zeros at padded positions (the final norm not applied), or None when a layer
    cannot run natively.  Finding the valid rows reads the mask (a host sync; torch's
    NestedTensor conversion and the left-alignment check both read it too)."""
    plans, position = [], lane.position()
    for layer in stack.layers:
        plan = _plan(lane, lambda: encoder_plan(layer, lane.upcoming(position), src, None, padding,
                                                False, None, None), layer, position)
        if plan is None or plan.norm_first or not plan.batch_first:
            return None
        plans.append(plan)
        position += plan.count
    b, l, e = src.shape
    rows = padding.logical_not().reshape(-1).nonzero().squeeze(1)  # (N,)
    x = src.reshape(b * l, e).index_select(0, rows)
    buffer = src.new_zeros(b, l, 3 * e)
    for layer, plan in zip(stack.layers, plans):
        x = _run_encoder(layer, plan, x, None, padding, None, rows, buffer)[0]
    lane.skip(position - lane.position())
    return src.new_zeros(b * l, e).index_copy_(0, rows, x).view(b, l, e)
