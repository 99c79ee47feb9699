"""Fused masked softmax attention as torch.library custom ops: autograd formula + fake kernels.

The op runs a flash-attention implementation chosen by the ``backend`` string:
  "triton"       -> transformer_fast.kernels.attention
  "cpu" / "cuda" -> torch.ops.transformer_fast_C.attention_{fwd,bwd} (csrc/attention_cpu.cpp,
                    csrc/attention_cuda.cu); the C++ side reads rng ([seed, offset]) itself
Launcher contract (on 4-D tensors; q (B, H, Lq, D), k/v (B, Hkv, Lk, D), any strides with unit
stride along D):

  fwd(q, k, v, attn_mask?, key_padding_mask?, is_causal, scale, dropout_p, rng?, allow_tf32)
      -> (out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) fp32)
  bwd(do, q, k, v, out, lse, attn_mask?, key_padding_mask?, is_causal, scale, dropout_p, rng?,
      allow_tf32) -> (dq, dk, dv)   (dk/dv summed over each GQA group)

attn_mask is broadcast (expanded, stride 0) to (B, H, Lq, Lk): bool True = takes part, float
added. key_padding_mask (B, Lk) bool True = padding. is_causal is top-left aligned. A query row
with no key to attend to has output 0 and gradient 0.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends


def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import attention

        return attention.attention_fwd, attention.attention_bwd
    if backend in ("cuda", "cpu"):
        backends.extension_status()  # imports _C, which registers the ops
        ops = torch.ops.transformer_fast_C
        return ops.attention_fwd, ops.attention_bwd
    raise ValueError(f"attention op: no fused implementation named {backend!r}")


@torch.library.custom_op("transformer_fast::attention_fwd", mutates_args=())
def attention_fwd(
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
    return fwd(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32)


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    b, h, lq, _ = q.shape
    if backend == "triton":  # the Triton launcher lays out out like q (no head-merge copy)
        from transformer_fast.kernels.attention import empty_in_layout_of

        out = empty_in_layout_of(q, (b, h, lq, v.shape[-1]))
    else:
        out = q.new_empty((b, h, lq, v.shape[-1]))
    return out, q.new_empty((b, h, lq), dtype=torch.float32)


@torch.library.custom_op("transformer_fast::attention_bwd", mutates_args=())
def attention_bwd(
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


@attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, rng)
    ctx.flags = (is_causal, scale, dropout_p, allow_tf32, backend)
    ctx.mask_needs_grad = attn_mask is not None and attn_mask.requires_grad


def _backward(ctx, dout, dlse):
    if ctx.mask_needs_grad:
        raise NotImplementedError(
            "attn_mask: the fused attention kernels do not compute the gradient of a float "
            "attn_mask; use backend='torch' or 'reference', or detach the mask"
        )
    q, k, v, out, lse, attn_mask, key_padding_mask, rng = ctx.saved_tensors
    is_causal, scale, dropout_p, allow_tf32, backend = ctx.flags
    dq, dk, dv = attention_bwd(
        dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend):
    out, _ = attention_fwd(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32, backend)
    return out
