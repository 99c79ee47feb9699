"""Fused masked softmax attention as torch.library custom ops: autograd formula + fake kernels.

The op runs a flash-attention implementation chosen by the ``backend`` string:
  "triton"       -> transformer_fast.kernels.attention
  "cpu" / "cuda" -> torch.ops.transformer_fast_C.attention_{fwd,bwd} (csrc/attention_cpu.cpp,
                    csrc/attention_cuda.cu); the C++ side reads rng ([seed, offset]) itself
Launcher contract (on 4-D tensors; q (B, H, Lq, D), k/v (B, Hkv, Lk, D), any strides with unit
stride along D):

  fwd(q, k, v, attn_mask?, key_padding_mask?, is_causal, scale, dropout_p, rng?, allow_tf32)
      -> (out (B, H, Lq, D) in q's dtype and memory order (kernels/layout.py's empty_in_layout_of), lse (B, H, Lq) fp32)
  bwd(do, q, k, v, out, lse, attn_mask?, key_padding_mask?, is_causal, scale, dropout_p, rng?,
      allow_tf32) -> (dq, dk, dv)   (dk/dv summed over each GQA group; cpu / cuda: laid out like
      q / k / v, torch.empty_like; triton: contiguous)

attn_mask is broadcast (expanded, stride 0) to (B, H, Lq, Lk): bool True = takes part, float
added. key_padding_mask (B, Lk) bool True = padding. is_causal is top-left aligned. A query row
with no key to attend to has output 0 and gradient 0.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import backends, philox, reference
from ..kernels.layout import empty_in_layout_of
from . import call, eager_autograd, half_to_float, own, recomputed_grads, recording_backward


@functools.cache  # a dict lookup per call instead of imports and torch.ops lookups
def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import attention

        return attention.attention_fwd, attention.attention_bwd
    if backend in ("cuda", "cpu"):
        backends.extension_status()  # imports _C, which registers the ops
        ops = torch.ops.transformer_fast_C
        return ops.attention_fwd, ops.attention_bwd
    raise ValueError(f"attention op: no fused implementation named {backend!r}")


def _attention_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    scale: float,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    fwd, _ = _launcher(backend)
    out, lse = fwd(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32)
    return own(out), lse


attention_fwd = torch.library.custom_op(
    "transformer_fast::attention_fwd", _attention_fwd_impl, mutates_args=()
)


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    b, h, lq, _ = q.shape
    # Every launcher lays out out like q (no head-merge copy in the modules).
    out = empty_in_layout_of(q, (b, h, lq, v.shape[-1]))
    return out, q.new_empty((b, h, lq), dtype=torch.float32)


def _attention_bwd_impl(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    scale: float,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    _, bwd = _launcher(backend)
    return bwd(
        do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32
    )


attention_bwd = torch.library.custom_op(
    "transformer_fast::attention_bwd", _attention_bwd_impl, mutates_args=()
)


@attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    if backend == "triton":  # kernels/attention.py allocates contiguous gradients
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))
    # cpu / cuda (csrc/attention_*.cpp/.cu): at::empty_like, the same rule as torch.empty_like
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, rng)
    ctx.flags = (is_causal, scale, dropout_p, allow_tf32, backend)
    ctx.mask_needs_grad = attn_mask is not None and attn_mask.requires_grad
    ctx.set_materialize_grads(False)  # lse never gets a gradient: no zero (B, H, Lq) tensor for it


def _backward(ctx, dout, dlse):
    if dout is None:  # the output took no part in the loss
        return (None,) * 11
    if ctx.mask_needs_grad:
        raise NotImplementedError(
            "attn_mask: the fused attention kernels do not compute the gradient of a float "
            "attn_mask; use backend='torch' or 'reference', or detach the mask"
        )
    q, k, v, out, lse, attn_mask, key_padding_mask, rng = ctx.saved_tensors
    is_causal, scale, dropout_p, allow_tf32, backend = ctx.flags
    if recording_backward():  # create_graph=True: the reference (fp32), differentiated
        b, h, lq, _ = q.shape
        keep = philox.dropout_keep_mask(rng, (b, h, lq, k.shape[2]), dropout_p) if dropout_p > 0.0 else None

        def forward(q_, k_, v_):
            o = reference.scaled_dot_product_attention(
                *half_to_float(q_, k_, v_), attn_mask, dropout_p, is_causal, scale, k.shape[1] != h,
                key_padding_mask, keep)
            return (o.to(q.dtype),)

        dq, dk, dv = recomputed_grads(forward, (q, k, v), (dout,))
        return dq, dk, dv, None, None, None, None, None, None, None, None
    dq, dk, dv = call(attention_bwd, _attention_bwd_impl, dout, q, k, v, out, lse, attn_mask, key_padding_mask,
                      is_causal, scale, dropout_p, rng, allow_tf32, backend)
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_AttentionFunction = eager_autograd(_attention_fwd_impl, _setup_context, _backward)


def attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    out, _ = call(attention_fwd, _attention_fwd_impl, q, k, v, attn_mask, key_padding_mask, is_causal, scale,
                  dropout_p, rng, allow_tf32, backend, autograd=_AttentionFunction)
    return out
