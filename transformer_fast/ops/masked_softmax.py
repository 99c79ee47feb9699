"""Fused scale + mask + softmax (+ dropout) as torch.library custom ops: autograd + fake kernels.

Launcher contract (transformer_fast.kernels.masked_softmax), on 4-D scores (B, H, Lq, Lk):
  fwd(scores, mask?, scale, is_causal, dropout_p, rng?) -> (out, probs)
      mask expanded to (B, H, Lq, Lk): bool True = takes part, float added after scaling;
      out = dropout(softmax(...)); probs = the pre-dropout probabilities when dropout_p > 0,
      else an empty tensor (out is then the probabilities). Fully masked rows are zeros.
  bwd(dout, probs, scale, dropout_p, rng?) -> dscores
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import backends, philox
from . import call, eager_autograd, own, recording_backward

_EMPTY_SHAPE = (0,)


@functools.cache  # a dict lookup per call instead of imports and torch.ops lookups
def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import masked_softmax

        return masked_softmax.masked_softmax_fwd, masked_softmax.masked_softmax_bwd
    if backend in ("cpu", "cuda"):  # csrc/masked_softmax_{cpu.cpp,cuda.cu}: the same contract
        backends.extension_status()  # imports _C, which registers the ops
        ops = torch.ops.transformer_fast_C
        return ops.masked_softmax_fwd, ops.masked_softmax_bwd
    raise ValueError(f"masked_softmax op: no fused implementation named {backend!r}")


def _masked_softmax_fwd_impl(
    scores: Tensor,
    mask: Optional[Tensor],
    scale: float,
    is_causal: bool,
    dropout_p: float,
    rng: Optional[Tensor],
    backend: str,
) -> tuple[Tensor, Tensor]:
    fwd, _ = _launcher(backend)
    out, probs = fwd(scores, mask, scale, is_causal, dropout_p, rng)
    return own(out), probs


masked_softmax_fwd = torch.library.custom_op(
    "transformer_fast::masked_softmax_fwd", _masked_softmax_fwd_impl, mutates_args=()
)


@masked_softmax_fwd.register_fake
def _(scores, mask, scale, is_causal, dropout_p, rng, backend):
    out = torch.empty_like(scores, memory_format=torch.contiguous_format)
    probs = torch.empty_like(out) if dropout_p > 0.0 else scores.new_empty(_EMPTY_SHAPE)
    return out, probs


def _masked_softmax_bwd_impl(
    dout: Tensor, probs: Tensor, scale: float, dropout_p: float, rng: Optional[Tensor], backend: str
) -> Tensor:
    _, bwd = _launcher(backend)
    return bwd(dout, probs, scale, dropout_p, rng)


masked_softmax_bwd = torch.library.custom_op(
    "transformer_fast::masked_softmax_bwd", _masked_softmax_bwd_impl, mutates_args=()
)


@masked_softmax_bwd.register_fake
def _(dout, probs, scale, dropout_p, rng, backend):
    return torch.empty_like(probs, dtype=dout.dtype, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    scores, mask, scale, is_causal, dropout_p, rng, backend = inputs
    out, probs = output
    ctx.save_for_backward(probs if dropout_p > 0.0 else out, rng)
    # With dropout, probs (the size of the scores) is an output only for backward: no zero
    # gradient of that size per backward (None reaches _backward instead).
    ctx.set_materialize_grads(False)
    ctx.flags = (scale, dropout_p, backend)


def _recorded_backward(dout, dprobs, probs, rng, scale, dropout_p):
    """create_graph=True: softmax's backward in differentiable torch ops (fp32) from the saved
    probabilities, an output of this op; so a second derivative flows through them back into
    this formula as ``dprobs``, which it adds to the dropped-out upstream gradient."""
    g = dout.float()
    if dropout_p > 0.0:
        keep = philox.dropout_keep_mask(rng, probs.shape, dropout_p)
        g = g * keep / (1.0 - dropout_p)
    if dprobs is not None and dprobs.numel() == probs.numel():
        g = g + dprobs.float()
    return _softmax_backward_of(g, probs, scale).to(probs.dtype), None, None, None, None, None, None


def _softmax_backward_of(dprobs, probs, scale):
    """softmax's backward of a gradient reaching the probabilities themselves (fp32)."""
    p, g = probs.float(), dprobs.float()
    return scale * p * (g - (g * p).sum(dim=-1, keepdim=True))


def _backward(ctx, dout, dprobs):
    probs, rng = ctx.saved_tensors
    scale, dropout_p, backend = ctx.flags
    if dout is None:  # only probs was differentiated (a second derivative through it)
        if not recording_backward():  # (no kernel pass over a zero upstream gradient)
            return _softmax_backward_of(dprobs, probs, scale).to(probs.dtype), None, None, None, None, None, None
        dout = torch.zeros_like(probs)
    if recording_backward():
        return _recorded_backward(dout, dprobs, probs, rng, scale, dropout_p)
    dscores = call(masked_softmax_bwd, _masked_softmax_bwd_impl, dout, probs, scale, dropout_p, rng, backend)
    if dprobs is not None and dprobs.numel() == probs.numel():
        # probs is an output only with dropout, where a recorded first derivative reads it: a
        # second derivative taken without create_graph arrives here as dprobs (the backward is
        # linear in the upstream gradient, so its part adds to the kernel's).
        dscores = (dscores.float() + _softmax_backward_of(dprobs, probs, scale)).to(dscores.dtype)
    return dscores, None, None, None, None, None, None


masked_softmax_fwd.register_autograd(_backward, setup_context=_setup_context)
_MaskedSoftmaxFunction = eager_autograd(_masked_softmax_fwd_impl, _setup_context, _backward)


def masked_softmax(scores, mask, scale, is_causal, dropout_p, rng, backend):
    out, _ = call(masked_softmax_fwd, _masked_softmax_fwd_impl, scores, mask, scale, is_causal, dropout_p, rng, backend,
                  autograd=_MaskedSoftmaxFunction)
    return out
