"""Position-wise FFN and its building block linear_bias_act as torch.library custom ops.

The ops run one of the fused implementations, chosen by the ``backend`` string argument:
  "triton"       -> transformer_fast.kernels.ffn (Triton, CUDA or the interpreter)
  "cuda" / "cpu" -> torch.ops.transformer_fast_C.ffn_{linear_fwd,linear_dgrad,linear_wgrad,act_bwd}
Each provides the four 2-D primitives documented in kernels/ffn.py (same arguments, same
results), and the autograd formulas below are written once on top of them:

  linear_bias_act:  y = dropout(act(x W^T + b))
      forward   linear_fwd (pre stored for gelu / gelu_tanh only, as the backend's own activation
                state: kernels/ffn.py; relu's backward reads y)
      backward  d = act_bwd(dy)  (elementwise: dy * act'(pre) * keep / (1 - p), + db)
                dx = d @ W (linear_dgrad, no epilogue);  dW = d^T x (linear_wgrad)
  feed_forward:     out = dropout(act(x W1^T + b1)) W2^T + b2
      forward   hidden, pre = linear_fwd(x, W1, b1, act, p);  out = linear_fwd(hidden, W2, b2)
      backward  dpre, db1 = linear_dgrad(dout, W2, aux=pre|hidden, act, p): the activation
                gradient and the dropout mask (regenerated from rng) are applied in the epilogue
                of the GEMM that produces d(hidden), whose column sums give db1;
                dW2, db2 = linear_wgrad(dout, hidden);  dx = dpre @ W1;  dW1 = dpre^T x.
x may have any leading dimensions and strides; the dropout mask is transformer_fast.philox over
the row-major index of the (rows, features) activation, rows = prod(x.shape[:-1]).
"""
from __future__ import annotations

import functools
import math
import types
from typing import Optional

import torch
from torch import Tensor

from .. import backends, philox, reference
from . import call, eager_autograd, half_to_float, own_reshaped, recomputed_grads, recording_backward

_EMPTY_SHAPE = (0,)
_NEEDS_PRE = ("gelu", "gelu_tanh")


def needs_pre(activation: str) -> bool:
    return activation in _NEEDS_PRE


def _rows(t: Tensor) -> Tensor:
    """(..., K) -> (M, K), a view when the strides allow (the launchers take any strides)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


@functools.cache  # a dict lookup per call instead of imports and torch.ops lookups
def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import ffn

        return ffn
    if backend in ("cuda", "cpu"):
        backends.extension_status()  # imports _C, which registers the ops
        ops = torch.ops.transformer_fast_C
        return types.SimpleNamespace(
            linear_fwd=ops.ffn_linear_fwd,
            linear_dgrad=ops.ffn_linear_dgrad,
            linear_wgrad=ops.ffn_linear_wgrad,
            act_bwd=ops.ffn_act_bwd,
        )
    raise ValueError(f"ffn op: no fused implementation named {backend!r}")


def _aux(activation: str, y: Tensor, pre: Tensor) -> Optional[Tensor]:
    """What the activation gradient reads: y for relu, pre for the gelus, nothing otherwise."""
    if activation == "relu":
        return y
    return pre if needs_pre(activation) else None


# The cpu and triton backends' 16-bit backward of a small problem (its largest GEMM at most 2^22
# multiply-adds) runs on fp32 copies of the inputs and rounds each gradient once.  The 16-bit path
# rounds d (= dy act'(pre) keep) to 16 bits before the gradient GEMMs, as torch's own chain does;
# where a gradient is a sum of few large terms (in_features 1: |dx| ~ 4-8, whose bf16 unit is
# above atol) that rounding put the result a unit off the float64 one in ~0.5% of draws (cpu and
# triton; triton's feed_forward 2.5%), over the oracle's bound whenever the 16-bit reference
# landed close (benchmarks/NOTES.md, twenty-ninth and thirtieth sessions).  At this size the fp32
# GEMMs cost microseconds (on a GPU, a few launches); the Triton fp32 kernels run exact fp32, as a
# tf32 rounding of d would give back fp16's 10 bits.
_FP32_BACKWARD_MAX_MACS = 1 << 22


def _fp32_backward(backend: str, dtype: torch.dtype, macs: int) -> bool:
    return (backend in ("cpu", "triton") and dtype in (torch.float16, torch.bfloat16)
            and macs <= _FP32_BACKWARD_MAX_MACS)


# feed_forward's forward of a small 16-bit problem with small weights (their fp32 copies <= 256
# KiB, so a decoding step of a real model keeps the 16-bit GEMMs) runs on fp32 copies too: out is
# rounded once and the hidden layer and activation state stay fp32 for the fp32 backward.  With
# the hidden layer rounded to 16 bits first, as torch's chain does, few unscaled terms put out a
# unit off float64's in 4 of 600 in_features-1 draws (cpu and triton alike, up to 1.2x the bound).
_FP32_FORWARD_MAX_WEIGHTS = 1 << 16


def _fp32_forward(backend: str, x: Tensor, w1: Tensor, w2: Tensor) -> bool:
    rows = math.prod(x.shape[:-1])
    return (w1.numel() + w2.numel() <= _FP32_FORWARD_MAX_WEIGHTS
            and _fp32_backward(backend, x.dtype, rows * w1.shape[0] * max(w1.shape[1], w2.shape[0])))


def _fp32_state(backend: str, activation: str, state: Optional[Tensor]) -> Optional[Tensor]:
    """The fp32 kernels' activation state from a 16-bit one (an fp32 one is already theirs): the
    cpu kernels keep act'(pre) for the gelus in fp32 (csrc/ffn_cpu.cpp, aux_holds_grad) and pre
    in 16-bit; triton keeps pre in both; relu's y is y."""
    if state is None or state.dtype == torch.float32 or backend != "cpu" or not needs_pre(activation):
        return None if state is None else state.float()
    pre = state.float()
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return torch.ops.aten.gelu_backward(torch.ones_like(pre), pre, approximate=approximate)


def _grad_or_none(g: Tensor, present: bool) -> Optional[Tensor]:
    return g if present else None


def _recorded_ffn_grads(ctx, rng, hidden_shape, inputs, dout, forward_ref):
    """create_graph=True: the reference formula (fp32) on the saved inputs, differentiated."""
    p = ctx.dropout_p
    keep = philox.dropout_keep_mask(rng, hidden_shape, p) if p > 0.0 else None
    activation = None if ctx.activation == "none" else ctx.activation
    dtype = inputs[0].dtype

    def forward(*tensors):
        return (forward_ref(*half_to_float(*tensors), activation, p, keep).to(dtype),)

    return recomputed_grads(forward, inputs, (dout,))


# --------------------------------------------------------------------------------------------
# linear_bias_act


def _linear_bias_act_fwd_impl(
    x: Tensor,
    w: Tensor,
    b: Optional[Tensor],
    activation: str,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    launch = _launcher(backend)
    y, pre = launch.linear_fwd(_rows(x), w, b, activation, dropout_p, rng, needs_pre(activation), allow_tf32)
    return own_reshaped(y, (*x.shape[:-1], w.shape[0])), pre


linear_bias_act_fwd = torch.library.custom_op(
    "transformer_fast::linear_bias_act_fwd", _linear_bias_act_fwd_impl, mutates_args=()
)


@linear_bias_act_fwd.register_fake
def _(x, w, b, activation, dropout_p, rng, allow_tf32, backend):
    rows = math.prod(x.shape[:-1])
    y = x.new_empty((*x.shape[:-1], w.shape[0]))
    pre = x.new_empty((rows, w.shape[0]) if needs_pre(activation) else _EMPTY_SHAPE)
    return y, pre


def _linear_bias_act_bwd_impl(
    dy: Tensor,
    x: Tensor,
    w: Tensor,
    aux: Optional[Tensor],
    has_bias: bool,
    activation: str,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if _fp32_backward(backend, dy.dtype, dy.numel() * x.shape[-1]):
        grads = _linear_bias_act_bwd_impl(dy.float(), x.float(), w.float(), _fp32_state(backend, activation, aux),
                                          has_bias, activation, dropout_p, rng, False, backend)
        return tuple(g.to(dy.dtype) for g in grads)
    launch = _launcher(backend)
    dy2, x2 = _rows(dy), _rows(x)
    if activation == "none" and dropout_p == 0.0:
        d, db = dy2, None  # nothing between the GEMM and the output
    else:
        d, db = launch.act_bwd(dy2, None if aux is None else _rows(aux), activation, dropout_p, rng, has_bias)
    dx, _ = launch.linear_dgrad(d, w, None, "none", 0.0, None, False, allow_tf32)
    dw, db_w = launch.linear_wgrad(d, x2, has_bias and db is None, allow_tf32)
    if db is None:
        db = db_w
    return dx.view(x.shape), dw, db


linear_bias_act_bwd = torch.library.custom_op(
    "transformer_fast::linear_bias_act_bwd", _linear_bias_act_bwd_impl, mutates_args=()
)


@linear_bias_act_bwd.register_fake
def _(dy, x, w, aux, has_bias, activation, dropout_p, rng, allow_tf32, backend):
    db = w.new_empty((w.shape[0],) if has_bias else _EMPTY_SHAPE)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w), db


def _lba_setup_context(ctx, inputs, output):
    x, w, b, activation, dropout_p, rng, allow_tf32, backend = inputs
    y, pre = output
    aux = _aux(activation, y, pre)
    ctx.save_for_backward(x, w, aux, rng, b)
    ctx.set_materialize_grads(False)  # pre never gets a gradient: no zero (M, N) tensor for it
    ctx.has_bias = b is not None
    ctx.activation, ctx.dropout_p, ctx.allow_tf32, ctx.backend = activation, dropout_p, allow_tf32, backend


def _lba_backward(ctx, dy, dpre):
    x, w, aux, rng, b = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None, None, None
    if recording_backward():
        dx, dw, db = _recorded_ffn_grads(ctx, rng, (*x.shape[:-1], w.shape[0]), (x, w, b), dy,
                                         reference.linear_bias_act)
        return dx, dw, db, None, None, None, None, None
    dx, dw, db = call(linear_bias_act_bwd, _linear_bias_act_bwd_impl,
                      dy, x, w, aux, ctx.has_bias, ctx.activation, ctx.dropout_p, rng, ctx.allow_tf32, ctx.backend)
    return dx, dw, _grad_or_none(db, ctx.has_bias), None, None, None, None, None


linear_bias_act_fwd.register_autograd(_lba_backward, setup_context=_lba_setup_context)
_LinearBiasActFunction = eager_autograd(_linear_bias_act_fwd_impl, _lba_setup_context, _lba_backward)


def linear_bias_act(x, w, b, activation, dropout_p, rng, allow_tf32, backend):
    """Run the fused op; returns y (..., N)."""
    y, _ = call(linear_bias_act_fwd, _linear_bias_act_fwd_impl, x, w, b, activation, dropout_p, rng, allow_tf32,
                backend, autograd=_LinearBiasActFunction)
    return y


# --------------------------------------------------------------------------------------------
# feed_forward


def _feed_forward_fwd_impl(
    x: Tensor,
    w1: Tensor,
    b1: Optional[Tensor],
    w2: Tensor,
    b2: Optional[Tensor],
    activation: str,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if _fp32_forward(backend, x, w1, w2):
        f32 = lambda t: None if t is None else t.float()
        out, hidden, pre = _feed_forward_fwd_impl(x.float(), w1.float(), f32(b1), w2.float(), f32(b2), activation,
                                                  dropout_p, rng, False, backend)
        return out.to(x.dtype), hidden, pre
    launch = _launcher(backend)
    hidden, pre = launch.linear_fwd(_rows(x), w1, b1, activation, dropout_p, rng, needs_pre(activation), allow_tf32)
    out, _ = launch.linear_fwd(hidden, w2, b2, "none", 0.0, None, False, allow_tf32)
    return own_reshaped(out, (*x.shape[:-1], w2.shape[0])), hidden, pre


feed_forward_fwd = torch.library.custom_op(
    "transformer_fast::feed_forward_fwd", _feed_forward_fwd_impl, mutates_args=()
)


@feed_forward_fwd.register_fake
def _(x, w1, b1, w2, b2, activation, dropout_p, rng, allow_tf32, backend):
    rows = math.prod(x.shape[:-1])
    out = x.new_empty((*x.shape[:-1], w2.shape[0]))
    kept = torch.float32 if _fp32_forward(backend, x, w1, w2) else x.dtype
    hidden = x.new_empty((rows, w1.shape[0]), dtype=kept)
    pre = x.new_empty((rows, w1.shape[0]) if needs_pre(activation) else _EMPTY_SHAPE, dtype=kept)
    return out, hidden, pre


def _feed_forward_bwd_impl(
    dout: Tensor,
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    hidden: Tensor,
    pre: Tensor,
    has_b1: bool,
    has_b2: bool,
    activation: str,
    dropout_p: float,
    rng: Optional[Tensor],
    allow_tf32: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if hidden.dtype != dout.dtype or _fp32_backward(backend, dout.dtype, dout.numel() * w2.shape[1]):
        grads = _feed_forward_bwd_impl(dout.float(), x.float(), w1.float(), w2.float(), hidden.float(),
                                       _fp32_state(backend, activation, pre), has_b1, has_b2, activation, dropout_p,
                                       rng, False, backend)
        return tuple(g.to(dout.dtype) for g in grads)
    launch = _launcher(backend)
    dout2, x2 = _rows(dout), _rows(x)
    aux = _aux(activation, hidden, pre)
    # d(pre-activation): dout @ W2 with act' and the regenerated dropout mask in its epilogue.
    dpre, db1 = launch.linear_dgrad(dout2, w2, aux, activation, dropout_p, rng, has_b1, allow_tf32)
    dw2, db2 = launch.linear_wgrad(dout2, hidden, has_b2, allow_tf32)
    dx, _ = launch.linear_dgrad(dpre, w1, None, "none", 0.0, None, False, allow_tf32)
    dw1, _ = launch.linear_wgrad(dpre, x2, False, allow_tf32)
    return dx.view(x.shape), dw1, db1, dw2, db2


feed_forward_bwd = torch.library.custom_op(
    "transformer_fast::feed_forward_bwd", _feed_forward_bwd_impl, mutates_args=()
)


@feed_forward_bwd.register_fake
def _(dout, x, w1, w2, hidden, pre, has_b1, has_b2, activation, dropout_p, rng, allow_tf32, backend):
    db1 = w1.new_empty((w1.shape[0],) if has_b1 else _EMPTY_SHAPE)
    db2 = w2.new_empty((w2.shape[0],) if has_b2 else _EMPTY_SHAPE)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, torch.empty_like(w1), db1, torch.empty_like(w2), db2


def _ff_setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, activation, dropout_p, rng, allow_tf32, backend = inputs
    _, hidden, pre = output
    ctx.save_for_backward(x, w1, w2, hidden, pre, rng, b1, b2)
    # hidden and pre are saved for backward, never differentiated: without this, autograd would
    # allocate and zero an (M, d_ff) gradient for each of them on every backward.
    ctx.set_materialize_grads(False)
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    ctx.activation, ctx.dropout_p, ctx.allow_tf32, ctx.backend = activation, dropout_p, allow_tf32, backend


def _ff_backward(ctx, dout, dhidden, dpre):
    x, w1, w2, hidden, pre, rng, b1, b2 = ctx.saved_tensors
    if dout is None:
        return None, None, None, None, None, None, None, None, None, None
    if recording_backward():

        def ref(x_, w1_, b1_, w2_, b2_, activation, p, keep):
            return reference.feed_forward(x_, w1_, b1_, w2_, b2_, activation, p, keep)

        dx, dw1, db1, dw2, db2 = _recorded_ffn_grads(ctx, rng, (*x.shape[:-1], w1.shape[0]),
                                                     (x, w1, b1, w2, b2), dout, ref)
        return dx, dw1, db1, dw2, db2, None, None, None, None, None
    dx, dw1, db1, dw2, db2 = call(feed_forward_bwd, _feed_forward_bwd_impl,
                                  dout, x, w1, w2, hidden, pre, ctx.has_b1, ctx.has_b2, ctx.activation,
                                  ctx.dropout_p, rng, ctx.allow_tf32, ctx.backend)
    return (dx, dw1, _grad_or_none(db1, ctx.has_b1), dw2, _grad_or_none(db2, ctx.has_b2),
            None, None, None, None, None)


feed_forward_fwd.register_autograd(_ff_backward, setup_context=_ff_setup_context)
_FeedForwardFunction = eager_autograd(_feed_forward_fwd_impl, _ff_setup_context, _ff_backward)


def feed_forward(x, w1, b1, w2, b2, activation, dropout_p, rng, allow_tf32, backend):
    """Run the fused op; returns out (..., d_out)."""
    out, _, _ = call(feed_forward_fwd, _feed_forward_fwd_impl, x, w1, b1, w2, b2, activation, dropout_p, rng,
                     allow_tf32, backend, autograd=_FeedForwardFunction)
    return out


# --------------------------------------------------------------------------------------------
# Fake kernels of the C++ primitives (so that they too can be traced and opchecked)


def _register_cxx_fakes():
    if not backends.extension_status()[0] or not hasattr(torch.ops.transformer_fast_C, "ffn_linear_fwd"):
        return

    def _empty(t):
        return t.new_empty(_EMPTY_SHAPE)

    @torch.library.register_fake("transformer_fast_C::ffn_linear_fwd")
    def _(x, w, b, activation, dropout_p, rng, store_pre, allow_tf32):
        y = x.new_empty((x.shape[0], w.shape[0]))
        return y, (torch.empty_like(y) if store_pre else _empty(x))

    @torch.library.register_fake("transformer_fast_C::ffn_linear_dgrad")
    def _(dy, w, aux, activation, dropout_p, rng, want_dbias, allow_tf32):
        d = dy.new_empty((dy.shape[0], w.shape[1]))
        return d, (dy.new_empty((w.shape[1],)) if want_dbias else _empty(dy))

    @torch.library.register_fake("transformer_fast_C::ffn_linear_wgrad")
    def _(dy, x, want_dbias, allow_tf32):
        dw = dy.new_empty((dy.shape[1], x.shape[1]))
        return dw, (dy.new_empty((dy.shape[1],)) if want_dbias else _empty(dy))

    @torch.library.register_fake("transformer_fast_C::ffn_act_bwd")
    def _(dy, aux, activation, dropout_p, rng, want_dbias):
        return torch.empty_like(dy, memory_format=torch.contiguous_format), (
            dy.new_empty((dy.shape[1],)) if want_dbias else _empty(dy))


_register_cxx_fakes()
