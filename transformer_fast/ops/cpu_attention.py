"""The cpu backend's attention with the scores in memory, as a torch.library custom op.

Where the scores fit (transformer_fast.backends.cpu_attention_in_memory), the cpu backend's SDPA
keeps them in memory, as torch's CPU math path does, but in three passes instead of torch's
chain of ops:

  forward   scores = q @ k^T (torch's batched GEMM), the C++ masked_softmax kernel (scale, masks,
            softmax and dropout in one pass over the scores), out = attn @ v;
  backward  dv = attn^T @ dO, dp = dO @ v^T, ds = the kernel's softmax backward (dropout mask
            regenerated, delta summed in double), dq = ds @ k, dk = ds^T @ q.

GQA without repeating k / v: the H / Hkv query heads that share a key head are consecutive, so q
(B, H, Lq, D) is read as (B, Hkv, G * Lq, D) against each key head; dk / dv come out summed over
the group.  Everything runs in fp32 (16-bit inputs are upcast, as torch's CPU math path does),
except fp32 inputs' q @ k^T, summed in float64 and kept so in the kernel until the row max is
subtracted: a score of ~60 rounded to fp32 first moves its probability by up to 60 x 2^-24, as
much as the fp32 reference's own error, and such draws missed the DESIGN section 6 bound (1 in
~400 peaked fuzz draws; benchmarks/NOTES.md "Exact scores for the cpu attention in memory").
The other GEMMs take fp32 operands as the reference's do.

Contract (4-D tensors): q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), any strides;
mask None or (B, H, Lq, Lk) bool (True = takes part) / float32 (added after scaling), expanded;
top-left causal.  Returns (out (B, H, Lq, Dv) in q's dtype, attn (B, H, Lq, Lk) fp32 = the
dropped-out probabilities, probs = the probabilities before dropout, or an empty tensor without
dropout); only ``out`` is the caller's, the others are saved for backward.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .. import philox, reference
from . import call, eager_autograd, half_to_float, own, recomputed_grads, recording_backward
from . import masked_softmax as _masked_softmax_op

_EMPTY_SHAPE = (0,)


def _grouped(t: Tensor, hkv: int) -> Tensor:
    """(B, H, L, X) as (B, Hkv, G * L, X): a view where strides allow, else a copy."""
    b, h, l, x = t.shape
    return t.reshape(b, hkv, (h // hkv) * l, x)


def _autocast_off():
    """The caller's CPU autocast switched off around this op's GEMMs: an eager call runs the
    body directly, inside the caller's autocast region (and a backward called there runs in it
    too), where ``q @ k^T`` would run in 16 bits and save 16-bit probabilities.  The inputs come
    already cast to the autocast dtype (functional._autocast), as torch's SDPA casts them."""
    if torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def _output_like(q: Tensor, out: Tensor) -> Tensor:
    """The GEMM's contiguous fp32 ``out`` (B, H, Lq, Dv) given back in q's dtype and in
    torch.empty_like(q)'s memory order, as the flash kernels and torch's SDPA give theirs: the
    output of q/k/v viewed from a (B, L, H, D) projection then views back as (B, L, H * D)."""
    if out.shape == q.shape:
        res = torch.empty_like(q)
        if not (res.is_contiguous() and q.dtype == out.dtype):
            return res.copy_(out)
    return out if q.dtype == out.dtype else out.to(q.dtype)


def _cpu_attention_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    is_causal: bool,
    scale: float,
    dropout_p: float,
    rng: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    b, h, lq, _ = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    wide = torch.float64 if q.dtype == torch.float32 else torch.float32
    with _autocast_off():
        qw = q.to(wide, memory_format=torch.contiguous_format)
        kw = k.to(wide)
        scores = (_grouped(qw, hkv) @ kw.transpose(-2, -1)).view(b, h, lq, lk)
        del qw, kw
        softmax_fwd, _ = _masked_softmax_op._launcher("cpu")  # csrc/masked_softmax_cpu.cpp
        attn, probs = softmax_fwd(scores, mask, scale, is_causal, dropout_p, rng)
        del scores
        out = (_grouped(attn, hkv) @ v.float()).view(b, h, lq, dv)
    return own(_output_like(q, out)), attn, probs


cpu_attention_fwd = torch.library.custom_op(
    "transformer_fast::cpu_attention_fwd", _cpu_attention_fwd_impl, mutates_args=()
)


@cpu_attention_fwd.register_fake
def _(q, k, v, mask, is_causal, scale, dropout_p, rng):
    b, h, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[3]
    attn = q.new_empty((b, h, lq, lk), dtype=torch.float32)
    probs = torch.empty_like(attn) if dropout_p > 0.0 else attn.new_empty(_EMPTY_SHAPE)
    out = torch.empty_like(q) if dv == q.shape[3] else q.new_empty((b, h, lq, dv))
    return out, attn, probs


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, dropout_p, rng = inputs
    _, attn, probs = output
    ctx.save_for_backward(q, k, v, mask, attn, probs, rng)
    ctx.flags = (is_causal, scale, dropout_p)
    # attn and probs are outputs only for backward: no zero gradient of the scores' size for them
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dattn, _dprobs):
    if dout is None:
        return (None,) * 8
    with _autocast_off():
        return _backward_body(ctx, dout)


def _backward_body(ctx, dout):
    none = (None,) * 5
    q, k, v, mask, attn, probs, rng = ctx.saved_tensors
    is_causal, scale, dropout_p = ctx.flags
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if recording_backward():  # create_graph=True: the reference (fp32), differentiated
        keep = philox.dropout_keep_mask(rng, (b, h, lq, lk), dropout_p) if dropout_p > 0.0 else None

        def forward(q_, k_, v_):
            o = reference.scaled_dot_product_attention(
                *half_to_float(q_, k_, v_), mask, dropout_p, is_causal, scale, hkv != h, keep=keep)
            return (o.to(q.dtype),)

        return (*recomputed_grads(forward, (q, k, v), (dout,)), *none)
    go = _grouped(dout.float(), hkv)  # (B, Hkv, G * Lq, Dv)
    a = _grouped(attn, hkv)
    dv = a.transpose(-2, -1) @ go  # (B, Hkv, Lk, Dv), summed over the group
    dp = (go @ v.float().transpose(-2, -1)).view(b, h, lq, lk)
    saved_p = probs if dropout_p > 0.0 else attn
    ds = call(_masked_softmax_op.masked_softmax_bwd, _masked_softmax_op._masked_softmax_bwd_impl,
              dp, saved_p, scale, dropout_p, rng, "cpu")
    ds = _grouped(ds, hkv)  # (B, Hkv, G * Lq, Lk)
    dq = (ds @ k.float()).view(b, h, lq, d)
    dk = ds.transpose(-2, -1) @ _grouped(q.float(), hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *none


cpu_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_CpuAttentionFunction = eager_autograd(_cpu_attention_fwd_impl, _setup_context, _backward)


def attention_in_memory(q, k, v, mask, is_causal, scale, dropout_p, rng) -> Tensor:
    out, _, _ = call(cpu_attention_fwd, _cpu_attention_fwd_impl, q, k, v, mask, is_causal, scale,
                     dropout_p, rng, autograd=_CpuAttentionFunction)
    return out
