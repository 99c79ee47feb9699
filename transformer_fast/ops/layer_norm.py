"""Fused residual-add + LayerNorm as torch.library custom ops: autograd formula + fake kernels.

The op runs one of the fused implementations, chosen by the ``backend`` string argument:
  "triton"       -> transformer_fast.kernels.layer_norm (Triton, CUDA or the interpreter)
  "cuda" / "cpu" -> torch.ops.transformer_fast_C.add_layer_norm_{fwd,bwd} (csrc/)
Both launchers share one contract on 2-D row views (M rows of N, unit stride along N):

  fwd(x, residual, weight?, bias?, eps, dropout_p, rng?, prenorm) -> (y, h, mean, rstd)
      h = residual + dropout(x)    y = (h - mean) * rstd * weight + bias
      y (M, N) in x's dtype; h (M, N) when prenorm else an empty tensor; mean, rstd (M,) fp32
  bwd(dy, dh?, x, residual, weight?, bias?, mean, rstd, dropout_p, rng?)
      -> (dx, dresidual, dweight, dbias)
      dresidual = d(sum) (+ dh, the gradient of the prenorm output); dx = dresidual * keep / (1-p)
      when dropout_p > 0, else an empty tensor (dx equals dresidual); dweight/dbias (N,) in
      weight's/bias's dtype, reduced in two stages without atomics, empty when weight/bias is
      None (bias is read for its presence and dtype only).
Dropout keeps follow transformer_fast.philox over the row-major (M, N) element index.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import backends, philox, reference
from . import call, eager_autograd, half_to_float, own_reshaped, recomputed_grads, recording_backward

_EMPTY_SHAPE = (0,)


def _rows(t: Tensor, n: int) -> Tensor:
    """(…, N) -> (M, N) view with unit stride along N (copies only when no such view exists)."""
    t2 = t.reshape(-1, n)
    if t2.stride(1) == 1 or n == 1:
        return t2
    # An empty tensor counts as contiguous whatever its strides ((0, 16) views of (0,) sums
    # come with strides (0, 0)), so .contiguous() would keep them: a fresh one has unit stride.
    return t2.contiguous() if t2.numel() else t2.new_empty(t2.shape)


@functools.cache  # a dict lookup per call instead of imports and torch.ops lookups
def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import layer_norm

        return layer_norm.add_layer_norm_fwd, layer_norm.add_layer_norm_bwd
    if backend in ("cuda", "cpu"):
        backends.extension_status()  # imports _C, which registers the ops
        ops = torch.ops.transformer_fast_C
        return ops.add_layer_norm_fwd, ops.add_layer_norm_bwd
    raise ValueError(f"add_layer_norm op: no fused implementation named {backend!r}")


def _add_layer_norm_fwd_impl(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    dropout_p: float,
    rng: Optional[Tensor],
    prenorm: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    fwd, _ = _launcher(backend)
    y, h, mean, rstd = fwd(_rows(x, n), _rows(residual, n), weight, bias, eps, dropout_p, rng, prenorm)
    y = own_reshaped(y, x.shape)
    h = own_reshaped(h, x.shape) if prenorm else h
    return y, h, mean, rstd


add_layer_norm_fwd = torch.library.custom_op(
    "transformer_fast::add_layer_norm_fwd", _add_layer_norm_fwd_impl, mutates_args=()
)


def _fwd_outputs(x, prenorm):
    """Empty (y, h, mean, rstd) shaped as the forward contract says (for the fake kernels)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(y) if prenorm else x.new_empty(_EMPTY_SHAPE)
    stats = x.new_empty((rows,), dtype=torch.float32)
    return y, h, stats, torch.empty_like(stats)


def _bwd_outputs(x, weight, bias, dropout_p):
    """Empty (dx, dresidual, dweight, dbias) shaped as the backward contract says."""
    dres = torch.empty_like(x, memory_format=torch.contiguous_format)
    dx = torch.empty_like(dres) if dropout_p > 0.0 else x.new_empty(_EMPTY_SHAPE)
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(_EMPTY_SHAPE)
    db = torch.empty_like(bias) if bias is not None else x.new_empty(_EMPTY_SHAPE)
    return dx, dres, dw, db


@add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, dropout_p, rng, prenorm, backend):
    return _fwd_outputs(x, prenorm)


def _add_layer_norm_bwd_impl(
    dy: Tensor,
    dh: Optional[Tensor],
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    dropout_p: float,
    rng: Optional[Tensor],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    _, bwd = _launcher(backend)
    dx, dres, dw, db = bwd(
        _rows(dy, n),
        None if dh is None else _rows(dh, n),
        _rows(x, n),
        _rows(residual, n),
        weight,
        bias,
        mean,
        rstd,
        dropout_p,
        rng,
    )
    dres = dres.view(x.shape)
    dx = dx.view(x.shape) if dropout_p > 0.0 else dx
    return dx, dres, dw, db


add_layer_norm_bwd = torch.library.custom_op(
    "transformer_fast::add_layer_norm_bwd", _add_layer_norm_bwd_impl, mutates_args=()
)


@add_layer_norm_bwd.register_fake
def _(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p, rng, backend):
    return _bwd_outputs(x, weight, bias, dropout_p)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, rng, prenorm, backend = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, bias, mean, rstd, rng)
    ctx.dropout_p = dropout_p
    ctx.prenorm = prenorm
    ctx.backend = backend
    ctx.eps = eps
    # mean / rstd never get a gradient, nor the (0,) placeholder of a post-LN call: no zero
    # tensors (a memset kernel each on a GPU) are made for them.
    ctx.set_materialize_grads(False)
    if prenorm and not (x.requires_grad or residual.requires_grad):
        # The sum depends on x and residual alone: it needs no grad, as torch's residual + x.
        ctx.mark_non_differentiable(output[1])


def _recorded_backward(ctx, dy, dh, x, residual, weight, bias, rng):
    """create_graph=True: reference.add_layer_norm (fp32) on the saved inputs, differentiated."""
    keep = philox.dropout_keep_mask(rng, x.shape, ctx.dropout_p) if ctx.dropout_p > 0.0 else None

    def forward(x_, residual_, weight_, bias_):
        y, h = reference.add_layer_norm(*half_to_float(x_, residual_, weight_, bias_), ctx.eps,
                                        ctx.dropout_p, True, keep)
        return y.to(x.dtype), h.to(x.dtype)

    dx, dres, dw, db = recomputed_grads(forward, (x, residual, weight, bias), (dy, dh))
    return dx, dres, dw, db, None, None, None, None, None


def _backward(ctx, dy, dh, dmean, drstd):
    x, residual, weight, bias, mean, rstd, rng = ctx.saved_tensors
    if not ctx.prenorm:
        dh = None  # the gradient of the placeholder (0,) output
    if dy is None and dh is None:  # neither output took part in the loss
        return (None,) * 9
    if recording_backward():
        return _recorded_backward(ctx, dy, dh, x, residual, weight, bias, rng)
    normed_used = dy is not None
    if not normed_used:  # pre-LN, only the residual sum used
        dy = torch.zeros_like(x)
    dx, dres, dw, db = call(add_layer_norm_bwd, _add_layer_norm_bwd_impl,
                            dy, dh, x, residual, weight, bias, mean, rstd, ctx.dropout_p, rng, ctx.backend)
    if ctx.dropout_p == 0.0:
        dx = dres
    # weight and bias only reach the normed output: without it their grads stay None, as torch's
    # (an optimizer skips a None grad, but would decay / carry momentum on a zero one).
    dweight = dw if weight is not None and normed_used else None
    dbias = db if bias is not None and normed_used else None
    return dx, dres, dweight, dbias, None, None, None, None, None


add_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_AddLayerNormFunction = eager_autograd(_add_layer_norm_fwd_impl, _setup_context, _backward)


def _register_cxx_fakes():
    """Fake kernels for the C++ ops themselves (same shapes as the 2-D launcher contract), so
    they too can be traced and opchecked."""
    if not backends.extension_status()[0]:
        return

    @torch.library.register_fake("transformer_fast_C::add_layer_norm_fwd")
    def _(x, residual, weight, bias, eps, dropout_p, rng, prenorm):
        return _fwd_outputs(x, prenorm)

    @torch.library.register_fake("transformer_fast_C::add_layer_norm_bwd")
    def _(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p, rng):
        return _bwd_outputs(x, weight, bias, dropout_p)


_register_cxx_fakes()


def add_layer_norm(x, residual, weight, bias, eps, dropout_p, rng, prenorm, backend):
    """Run the fused op; returns ``y`` or ``(y, residual + dropout(x))`` when prenorm."""
    y, h, _, _ = call(add_layer_norm_fwd, _add_layer_norm_fwd_impl,
                      x, residual, weight, bias, eps, dropout_p, rng, prenorm, backend,
                      autograd=_AddLayerNormFunction)
    return (y, h) if prenorm else y
