"""The pre-softmax projection fused with the label-smoothed cross entropy, in row chunks.

    loss = linear_cross_entropy(hidden, weight, target, bias, smoothing=0.1, ignore_index=pad)
    # == label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, 0.1, pad)

A training step of the paper's model spends more memory on its last layer than on any other:
the (N, V) logits (N = B * T target tokens, V = 32000 in the base setup) in the model's dtype,
their float32 copy, the float32 log-probabilities the loss keeps for backward and, in backward,
two more (N, V) float32 gradients: about 14 bytes per logit at the peak, 3.7 GB at B 64, T 128.

Here the logits are made a chunk of rows at a time, and each chunk's gradient is formed at
once (softmax minus the smoothed one-hot target, over the count of kept tokens) and pushed
through the projection: d hidden for the chunk's rows, d weight and d bias accumulated.  The
loss keeps those gradients (N x E and V x E) instead of any logits, and backward scales them by
the incoming gradient of the (scalar) loss.  The GEMMs are the same three as Linear's forward
and backward, so no FLOPs are added; the logits of one chunk (at most ``CHUNK_ELEMENTS``, or
``ROW_KERNEL_CHUNK_ELEMENTS`` in 16 bits for the Triton row kernel) are all that is ever in memory.

Where the precomputed gradients do not apply, the unfused composition runs instead (the
readable reference, ``reference()`` below): reduction="none" (each token's gradient would
need its own upstream factor) and torch.compile tracing (Inductor fuses the composition
itself).  The fused backward is not itself differentiable (create_graph=True raises).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends
from ..functional import _allow_tf32
from .training import check_targets, label_smoothed_cross_entropy

# Logits per chunk: 2**25 (128 MiB as float32), e.g. 1048 rows of a 32000-token vocabulary,
# where a chunk's softmax runs in torch ops (float32 / float64 temporaries of the chunk's size).
CHUNK_ELEMENTS = 1 << 25
# The Triton row kernel (16-bit CUDA logits) works in place on the 16-bit chunk: 2**27 (256 MiB
# as bf16, 4096 rows at V 32000, 2 chunks for the base model's B 64 x T 128 where 2**25 made 8):
# each chunk is ~6 launches and one pass of adding its weight gradient into the float32 total,
# and a training step on the lent GPUs' host was bound by launches (benchmarks/NOTES.md).
ROW_KERNEL_CHUNK_ELEMENTS = 1 << 27
# float32 chunks of fewer rows than this run their softmax and d hidden in float64
# (_accumulation_dtype); larger ones in float32, as the composition does.
WIDE_BELOW_ROWS = 16
# 16-bit inputs of at most this many multiply-adds (N x V x E) keep the gradient over the logits
# in float32 and form d hidden / d weight as float32 GEMMs, rounded once in backward: rounding
# it to 16 bits first (as the composition does) put d hidden a unit off float64 where it is a sum
# of few large terms (E = 1, V = 2: 1.75x the oracle's bound; benchmarks/NOTES.md, twenty-ninth
# session).  At that size the float32 GEMMs cost microseconds.
WIDE_16BIT_MAX_MACS = 1 << 22
BACKENDS = (None, "auto", "triton", "torch", "reference")


def reference(hidden, weight, target, bias=None, smoothing=0.1, ignore_index=None, reduction="mean"):
    """The unfused composition: Linear, then label_smoothed_cross_entropy on its logits."""
    return label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, smoothing, ignore_index, reduction)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         smoothing: float = 0.1, ignore_index: int | None = None, reduction: str = "mean",
                         *, chunk_rows: int | None = None, backend: str | None = None) -> Tensor:
    """``label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the
    (..., V) logits ever in memory at once.

    Args:
        hidden: (..., E) float, the states before the pre-softmax projection.
        weight: (V, E), as nn.Linear stores it; bias: (V,) or None.
        target: (...) integer class ids in [0, V), or ignore_index (counts for nothing).
        smoothing, ignore_index, reduction: as label_smoothed_cross_entropy.
        chunk_rows: rows of logits made at a time (default: CHUNK_ELEMENTS // V, or
            ROW_KERNEL_CHUNK_ELEMENTS // V for the Triton row kernel).
        backend: how each chunk's softmax and gradient run: "triton" (kernels/cross_entropy.py,
            fp16 / bf16), "torch" (separate torch ops), "reference" (the unfused composition),
            "auto": triton for 16-bit CUDA tensors where Triton is installed, else torch; None:
            the package's selection (transformer_fast.use_backend / TRANSFORMER_FAST_BACKEND:
            reference and triton as named, torch / cpu / cuda -> torch, auto -> auto).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point torch.Tensor; got "
                        f"{hidden.dtype if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have a feature dimension (..., E); got a 0-d tensor")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]
            or weight.shape[0] == 0):
        raise ValueError(f"weight must be a (V, E) tensor with V >= 1 and E = hidden.shape[-1] = {hidden.shape[-1]}; got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a ({weight.shape[0]},) tensor; got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    for name, t in (("weight", weight), ("bias", bias), ("target", target)):
        if isinstance(t, torch.Tensor) and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}; got {t.device}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None; got {chunk_rows!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    keep, safe_target = check_targets(target, tuple(hidden.shape[:-1]), weight.shape[0], smoothing,
                                      ignore_index, reduction, "hidden's")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # As F.linear under autocast: the GEMMs in the autocast dtype (the loss stays float32),
        # float64 left as it is.
        low = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (t if t is None or t.dtype == torch.float64 else t.to(low)
                                for t in (hidden, weight, bias))
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"weight and bias must have hidden's dtype {hidden.dtype}; got {weight.dtype}"
                        f"{'' if bias is None else f' and {bias.dtype}'}")
    explicit = backend is not None
    if backend is None:
        backend = _ambient(backends.requested_backend())
    # The composition where the fused autograd.Function cannot go: torch.compile's trace, and
    # torch.func transforms (grad, vmap: the Function has no setup_context).
    if (backend == "reference" or reduction == "none" or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        with torch.autocast(device_type, enabled=False):
            return reference(hidden, weight, target, bias, smoothing, ignore_index, reduction)
    sixteen_bit = hidden.dtype in (torch.float16, torch.bfloat16)
    triton_ok, triton_why = backends.available("triton", device_type)
    if backend == "triton" and not (sixteen_bit and triton_ok):
        if explicit:
            why = triton_why if sixteen_bit else f"it takes float16 / bfloat16 hidden; got {hidden.dtype}"
            raise ValueError(f"backend 'triton' of linear_cross_entropy cannot run: {why}")
        backend = "torch"  # use_backend("triton") around a float32 model: its loss on torch ops
    if backend == "auto":
        backend = "triton" if sixteen_bit and hidden.is_cuda and triton_ok else "torch"
    per_chunk = ROW_KERNEL_CHUNK_ELEMENTS if backend == "triton" else CHUNK_ELEMENTS
    rows = chunk_rows or max(1, per_chunk // max(1, weight.shape[0]))
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                         keep.reshape(-1), safe_target.reshape(-1), float(smoothing),
                                         reduction == "mean", rows, backend == "triton")


def _ambient(requested: str) -> str:
    """The package's backend selection (use_backend / TRANSFORMER_FAST_BACKEND) mapped onto this
    loss: reference -> the composition, triton -> the row kernel (16-bit; else torch ops), the
    other named backends -> torch ops, auto -> auto."""
    if requested in ("reference", "auto"):
        return requested
    return "triton" if requested == "triton" else "torch"


def _accumulation_dtype(dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype of a chunk's softmax and of its d hidden GEMM.  16-bit logits: float32, as the
    composition upcasts them.  float32 logits: float32 too, with the row sums and d bias summed in
    float64 (_softmax_rows, the caller), for chunks of WIDE_BELOW_ROWS rows or more: each d hidden
    row is then the composition's own float32 GEMM over the vocabulary, and the softmax more
    exact than its log_softmax.  A chunk of fewer rows runs in float64 (unless tf32 GEMMs are
    allowed on CUDA, where the oracle's tolerance is bf16's): its GEMM takes another path than the
    composition's (a one-row chunk is a matrix-vector product, summed in another order), whose
    float32 d hidden went past twice the composition's error in 6 of 1400 fresh draws (512
    tokens, reduction "sum", chunks of 1; up to 1.39x); in float64 it did not.  float64
    throughout cost a float32 step 1.8x on the CPU (the d hidden GEMM alone 3x:
    benchmarks/NOTES.md, "The fused loss in float32")."""
    if dtype == torch.float64 or (dtype == torch.float32 and rows < WIDE_BELOW_ROWS
                                  and not (device.type == "cuda" and _allow_tf32(dtype))):
        return torch.float64
    return torch.float32


def _softmax_rows(logits, t, kept, smoothing, acc, row_losses, want_grad):
    """The torch-ops path of one chunk: writes each row's loss (float64) into row_losses and
    returns the unscaled gradient softmax - smoothed one-hot (acc dtype; zero at ignored rows),
    or None without want_grad.  logits (rows, V), t (rows, 1), kept (rows,)."""
    vocab = logits.shape[1]
    z = logits if logits.dtype == acc else logits.to(acc)
    z_target = z.gather(1, t).squeeze(1).double()
    z_mean = _wide_sum(z, 1) / vocab if smoothing > 0.0 else None
    row_max = z.amax(dim=1, keepdim=True)
    e = z.sub_(row_max).exp_()  # exp(z - max), in place
    total_e = _wide_sum(e, 1)
    lse = row_max.squeeze(1).double() + total_e.log()  # (rows,)
    row_loss = lse - (1.0 - smoothing) * z_target
    if z_mean is not None:  # skipped at 0: 0 * inf (a class masked with -inf) would be NaN
        row_loss = row_loss - smoothing * z_mean
    # A masked_fill, not a product: NaN / inf logits at ignored rows count for nothing.
    row_losses.copy_(row_loss.masked_fill(~kept, 0.0))
    if not want_grad:
        return None
    dz = e.div_(total_e.to(e.dtype).unsqueeze(1))
    if smoothing > 0.0:
        dz.sub_(smoothing / vocab)
    dz.scatter_add_(1, t, torch.full_like(t, -(1.0 - smoothing), dtype=dz.dtype))
    return dz.masked_fill_(~kept.unsqueeze(1), 0.0)


def _wide_sum(x: Tensor, dim: int) -> Tensor:
    """x.sum(dim) in float64 for a 2-D chunk, without the float64 copy of x that
    ``sum(dtype=torch.float64)`` makes (it cost a float32 chunk more than its softmax): blocks
    of 128 elements along a row (16 rows down a column) summed in x's dtype, the block sums in
    float64.  Sums in float32 alone, as the composition's, put the loss at 0.97x of twice the
    composition's error in 1 of 4000 fresh draws, and the bias gradient 1.06x past it in 1 of
    1400 (reduction "sum": benchmarks/NOTES.md, "The fused loss in float32")."""
    block = 128 if dim == 1 else 16
    n = x.shape[dim]
    full = n - n % block
    total = x.narrow(dim, full, n - full).sum(dim=dim, dtype=torch.float64)
    if full:
        blocks = x.narrow(dim, 0, full).unflatten(dim, (-1, block)).sum(dim=dim + 1)
        total += blocks.sum(dim=dim, dtype=torch.float64)
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward forms the gradients for an upstream gradient of 1 and a count of 1, unscaled:
    values of order 1 that fp16 holds without underflow (divided by a count of thousands of
    tokens they would not be).  Backward scales them by upstream / count in float32 or float64
    and rounds once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, keep, target, smoothing, mean, rows, row_kernel):
        # hidden (N, E), weight (V, E), bias (V,) or None, keep / target (N,)
        n, vocab = hidden.shape[0], weight.shape[0]
        grads = ctx.needs_input_grad[:3]
        sixteen_bit = hidden.dtype in (torch.float16, torch.bfloat16)
        wide16 = sixteen_bit and n * vocab * hidden.shape[1] <= WIDE_16BIT_MAX_MACS
        # Each token's loss in float64, summed once: the result is within half a unit of the
        # last place where the composition's float32 sum may be off by more.
        row_losses = torch.empty(n, dtype=torch.float64, device=hidden.device)
        d_hidden = (torch.empty(hidden.shape, dtype=torch.float32 if wide16 else hidden.dtype, device=hidden.device)
                    if grads[0] else None)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32 if sixteen_bit else weight.dtype,
                               device=weight.device) if grads[1] else None
        d_bias = torch.zeros(vocab, dtype=torch.float64, device=weight.device) if grads[2] else None
        weight_wide = None  # weight in float64, made for the first float64 chunk
        # A 16-bit GEMM per chunk would round d weight once per chunk; on the CPU (no faster in
        # 16-bit) each chunk's goes through float32 instead.  On CUDA, chunks are >= 1000 rows
        # at the base model's vocabulary: a few roundings, summed in float32.
        wgrad_in_float32 = sixteen_bit and hidden.device.type == "cpu"
        if row_kernel:
            from transformer_fast.kernels.cross_entropy import cross_entropy_rows  # Triton: imported on use
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            h, kept, t = hidden[start:stop], keep[start:stop], target[start:stop].unsqueeze(1)
            acc = _accumulation_dtype(hidden.dtype, hidden.device, stop - start)
            logits = F.linear(h, weight, bias)  # (rows, V) in hidden's dtype, as nn.Linear's
            if row_kernel:  # kernels/cross_entropy.py: the loss, and the gradient over the logits
                if wide16:  # the gradient written over a float32 copy (the logits as rounded)
                    logits = logits.float()
                row_losses[start:stop] = cross_entropy_rows(logits, t.squeeze(1), kept, smoothing, any(grads))
                if not any(grads):
                    continue
                dz, dz_low = (logits, None) if wide16 else (None, logits)
            else:
                dz = _softmax_rows(logits, t, kept, smoothing, acc, row_losses[start:stop], any(grads))
                del logits
                if dz is None:
                    continue
                dz_low = None if wide16 else (dz if dz.dtype == hidden.dtype else dz.to(hidden.dtype))
            if d_bias is not None:
                d_bias += _wide_sum(dz, 0) if dz is not None else dz_low.sum(dim=0, dtype=torch.float32)
            if d_hidden is not None:
                if dz_low is not None and (dz_low is dz or sixteen_bit):  # the GEMM in hidden's dtype
                    torch.mm(dz_low, weight, out=d_hidden[start:stop])
                else:  # a float64 chunk of float32 rows, or a float32 one of a small 16-bit problem
                    if weight_wide is None:
                        weight_wide = weight.to(dz.dtype)
                    d_hidden[start:stop] = torch.mm(dz, weight_wide)
            if d_weight is not None:
                if wgrad_in_float32 or wide16:
                    d_weight.addmm_((dz if dz is not None else dz_low.float()).t(), h.float())
                elif sixteen_bit:
                    d_weight += dz_low.t().mm(h)
                else:  # (dz_low: dz in hidden's dtype, which is weight's)
                    d_weight.addmm_(dz_low.t(), h)
            del dz, dz_low
        denom = keep.sum().clamp(min=1).to(torch.float64) if mean else None
        total = row_losses.sum()
        if d_weight is not None and weight.dtype == torch.bfloat16 and not wide16:
            d_weight = d_weight.to(weight.dtype)  # bf16 has float32's range; fp16's could overflow
        ctx.save_for_backward(d_hidden, d_weight, d_bias, denom)
        ctx.dtypes = hidden.dtype, weight.dtype
        wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        return (total if denom is None else total / denom).to(wide)

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():  # create_graph=True: the saved gradients have no graph
            raise RuntimeError("linear_cross_entropy's backward is not differentiable (its gradients are formed in "
                               "forward); for double backward use label_smoothed_cross_entropy(F.linear(...))")
        d_hidden, d_weight, d_bias, denom = ctx.saved_tensors
        scale = grad_loss.double() if denom is None else grad_loss.double() / denom

        def scaled(g, dtype):
            if g is None:
                return None
            wide = torch.float64 if g.dtype == torch.float64 else torch.float32
            w = g.to(wide)
            # In place on the widened copy (the same bits): one fp32 weight-sized temporary, not two
            w = w.mul_(scale.to(wide)) if w is not g else w * scale.to(wide)
            return w.to(dtype)

        hidden_dtype, weight_dtype = ctx.dtypes
        return (scaled(d_hidden, hidden_dtype), scaled(d_weight, weight_dtype), scaled(d_bias, weight_dtype),
                None, None, None, None, None, None)
