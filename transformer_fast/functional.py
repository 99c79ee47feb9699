"""Public functional ops (DESIGN section 4): validate inputs, choose a backend, run it.

Each op validates its arguments before any kernel runs (DESIGN section 9), resolves the backend
(``backend=`` keyword > ``use_backend`` context > ``TRANSFORMER_FAST_BACKEND`` > "auto") and
then runs the naive reference, PyTorch's own path, or one of the fused implementations through
the custom ops in transformer_fast.ops.

Dropout follows torch.nn.functional: it is applied whenever ``dropout_p > 0``; modules pass
``dropout_p=0`` in eval mode.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from . import _checks, backends, masks, philox, reference
from ._checks import ArgumentTypeError, ArgumentValueError
from .ops import attention as _attention_op
from .ops import cpu_attention as _cpu_attention_op
from .ops import decode as _decode_op
from .ops import ffn as _ffn_op
from .ops import layer_norm as _layer_norm_op
from .ops import masked_softmax as _masked_softmax_op

__all__ = [
    "scaled_dot_product_attention",
    "attention_with_kv_cache",
    "masked_softmax",
    "add_layer_norm",
    "feed_forward",
    "linear_bias_act",
]


# --------------------------------------------------------------------------------------------
# add_layer_norm


def _add_layer_norm_support(backend):
    def check(inputs):
        reasons = _checks.kernel_dtype_reasons(
            backend, x=inputs["x"], weight=inputs.get("weight"), bias=inputs.get("bias")
        )
        if inputs.get("eps", 1.0) == 0.0:  # torch takes it (a constant row then gives NaN)
            reasons.append(f"the {backend} kernels take eps > 0; got 0")
        return reasons

    return check


for _name in ("triton", "cuda", "cpu"):
    backends.register("add_layer_norm", _name, _add_layer_norm_support(_name))
backends.register("add_layer_norm", "reference")
backends.register("add_layer_norm", "torch")


def _torch_add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm):
    params = [p for p in (weight, bias) if p is not None]
    if any(p.dtype != x.dtype for p in params):
        # F.layer_norm takes parameters in x's dtype, or float32 ones for half x (both): float64
        # x with float32 parameters, or one half and one float32 parameter, would raise there.
        pdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        weight, bias = (None if p is None else p.to(pdt) for p in (weight, bias))
        if weight is None and bias.dtype != x.dtype:
            # torch's mixed-dtype backward fails with a float32 bias and no weight ("expected
            # scalar type Half but found Float"): a weight of ones is exact.
            weight = torch.ones_like(bias)
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
        eps: added to the variance, >= 0 (0, as torch takes it, on reference / torch only).
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
        raise ArgumentValueError(f"x must have a non-empty last dimension; got shape {tuple(x.shape)}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            _checks.tensor(name, param, ndim=1)
            _checks.shape(name, param, (n,), "the last dimension of x")
            if param.dtype not in (x.dtype, torch.float32):
                raise ArgumentTypeError(
                    f"{name} must have x's dtype ({x.dtype}) or float32; got {param.dtype}"
                )
    _checks.same_device(x=x, residual=residual, weight=weight, bias=bias)
    eps = _checks.positive_float("eps", eps, zero_ok=True)
    dropout_p = _checks.dropout_p(dropout_p)
    _checks.boolean("prenorm", prenorm)

    if (torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in (weight, bias))
            and not torch.compiler.is_compiling() and (x.is_inference() or residual.is_inference())):
        # torch's layer_norm(residual + x) saves the sum, an ordinary tensor; the fused op would
        # save the inference tensors themselves, which autograd refuses.
        x, residual = (t.clone() if t.is_inference() else t for t in (x, residual))
    inputs = {"x": x, "residual": residual, "weight": weight, "bias": bias, "eps": eps}
    name = backends.resolve("add_layer_norm", backend, inputs)
    return run_add_layer_norm(name, x, residual, weight, bias, eps, dropout_p, prenorm)


def run_add_layer_norm(name, x, residual, weight, bias, eps, dropout_p, prenorm):
    """add_layer_norm on the resolved backend ``name``, for inputs already checked."""
    if name == "reference":
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm)
    if name == "torch":
        return _torch_add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm)
    rng = philox.new_rng(x.device) if dropout_p > 0.0 else None
    return _layer_norm_op.add_layer_norm(x, residual, weight, bias, eps, dropout_p, rng, prenorm, name)


# --------------------------------------------------------------------------------------------
# Attention, masked softmax, feed-forward.  For now the "reference" and "torch" backends
# implement them (the fused triton/cuda/cpu kernels register here when they arrive).

for _op in ("scaled_dot_product_attention", "attention_with_kv_cache", "masked_softmax", "feed_forward"):
    backends.register(_op, "reference")
    backends.register(_op, "torch")

_NEG_INF = float("-inf")


def _zero_dead_rows_softmax(x):
    """softmax over the last dim with all -inf rows -> zeros and zero gradients (torch's own
    ``_safe_softmax`` where it exists, the path SDPA's math backend uses; not under
    torch.onnx.export's TorchScript exporter, which has no ONNX form for it)."""
    if hasattr(torch.ops.aten, "_safe_softmax") and not backends.onnx_exporting():  # torch.compile traces it
        return torch.ops.aten._safe_softmax(x, -1)
    dead = (x == _NEG_INF).all(dim=-1, keepdim=True)  # (== -inf: ONNX has no isneginf)
    probs = torch.softmax(x.masked_fill(dead, 0.0), dim=-1)
    return probs.masked_fill(dead, 0.0)


def _autocast_dtype(t):
    """The autocast dtype in effect for ``t``'s device, or None when autocast is off there."""
    if not isinstance(t, torch.Tensor):  # (the callers' main input; checked later)
        return None
    device_type = t.device.type
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return None  # (meta tensors and the like: no autocast state to read)
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(*tensors):
    """torch's autocast runs SDPA and linear in its lower-precision dtype, casting their floating
    inputs (float64 excepted) to it: the same cast here, before any backend, so that every
    backend computes what torch computes under autocast (the fused kernels do not see
    autocast themselves)."""
    dtype = _autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype not in (dtype, torch.float64) else t for t in tensors)


def _autocast_masks(query, attn_mask, key_padding_mask):
    """SDPA's float masks under autocast, as torch computes them: its SDPA rounds attn_mask to
    the autocast dtype, and torch.nn.MultiheadAttention adds a float key_padding_mask into
    attn_mask (in their dtype) before that rounding.  So a float key_padding_mask is summed
    with a float attn_mask first and the sum rounded once (alone, it is rounded itself); a bool
    one removes keys whatever the rounding.  Run by both the checked call and a module's
    replay (run_scaled_dot_product_attention), which must agree."""
    dtype = _autocast_dtype(query)
    if dtype is None:
        return attn_mask, key_padding_mask

    def rounded(m):
        return m.to(dtype) if m.dtype not in (dtype, torch.float64) else m

    float_attn = attn_mask is not None and attn_mask.is_floating_point()
    float_padding = key_padding_mask is not None and key_padding_mask.is_floating_point()
    if float_attn and float_padding:
        batch, keys = key_padding_mask.shape
        padding = key_padding_mask.reshape((batch,) + (1,) * (query.dim() - 2) + (keys,))
        return rounded(attn_mask + padding), None  # (B, ..., Lq | 1, S)
    return (rounded(attn_mask) if float_attn else attn_mask,
            rounded(key_padding_mask) if float_padding else key_padding_mask)


# ---- scaled_dot_product_attention


def _broadcast_batch_dims(query, key, value, enable_gqa):
    """torch's SDPA broadcasts query, key and value over every dim but (L, D) (and the heads,
    which group instead, under enable_gqa): q (2, 3, L, D) with k, v (1, 3, S, D) or
    (2, 1, S, D) is attention with k, v shared across that dim.  Expanded views (no copy;
    autograd sums the gradients back); shapes that do not broadcast are left for the checks."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in tensors):
        return tensors
    kept = 3 if enable_gqa is True else 2  # trailing dims that do not broadcast
    leads = [t.shape[:-kept] for t in tensors]
    if leads[0] == leads[1] == leads[2] and query.dim() == key.dim() == value.dim():
        return tensors
    try:
        batch = torch.broadcast_shapes(*leads)
    except RuntimeError:
        return tensors
    return tuple(t.expand(*batch, *t.shape[-kept:]) for t in tensors)


def _gqa_common_heads(query, key, value, enable_gqa):
    """Under enable_gqa torch lets key and value have different numbers of heads, each dividing
    query's (query head h reads key head h // (Hq / Hk) and value head h // (Hq / Hv)); the
    kernels take one Hkv.  Both are repeated to lcm(Hk, Hv) heads, which keeps every query head
    on its key and value head (gradients sum back through the repeat).  A rare form: the copy is
    accepted; other head counts are left to _check_attention's errors."""
    if enable_gqa is not True or not all(isinstance(t, torch.Tensor) and t.dim() >= 4 for t in (query, key, value)):
        return key, value
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk == hv or hk == 0 or hv == 0 or hq % hk or hq % hv:
        return key, value
    heads = math.lcm(hk, hv)
    return key.repeat_interleave(heads // hk, dim=-3), value.repeat_interleave(heads // hv, dim=-3)


def _check_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     key_padding_mask):
    _checks.tensor("query", query, min_ndim=3)
    _checks.tensor("key", key, min_ndim=3)
    _checks.tensor("value", value, min_ndim=3)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != query.dim():
            raise ArgumentValueError(
                f"{name} must have as many dimensions as query ({query.dim()}, shape "
                f"{tuple(query.shape)}); got shape {tuple(t.shape)}"
            )
    _checks.same_dtype(query=query, key=key, value=value)
    _checks.optional_tensor("attn_mask", attn_mask, dtypes=None)
    _checks.optional_tensor("key_padding_mask", key_padding_mask, dtypes=None)
    _checks.same_device(
        query=query, key=key, value=value, attn_mask=attn_mask, key_padding_mask=key_padding_mask
    )
    is_causal = _checks.boolean("is_causal", is_causal)
    enable_gqa = _checks.boolean("enable_gqa", enable_gqa)
    dropout_p = _checks.dropout_p(dropout_p)
    scale = _checks.optional_scale(scale)

    for name, t in (("key", key), ("value", value)):
        if t.shape[:-3] != query.shape[:-3]:
            raise ArgumentValueError(
                f"{name} must have query's batch dimensions {tuple(query.shape[:-3])}; "
                f"got shape {tuple(t.shape)} (query {tuple(query.shape)})"
            )
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    what = "heads" if query.dim() > 3 else "batch size"
    if hv != hk:
        raise ArgumentValueError(
            f"value must have key's number of {what} ({hk}, dim -3); got {hv} "
            f"(key {tuple(key.shape)}, value {tuple(value.shape)})"
        )
    if hq != hk:
        if query.dim() == 3:
            raise ArgumentValueError(
                f"key must have query's batch size ({hq}, dim 0); got {hk} (3-D inputs are "
                f"(batch, L, D); with enable_gqa and no key_padding_mask, dim 0 counts heads)"
            )
        if not enable_gqa:
            raise ArgumentValueError(
                f"key must have query's number of heads ({hq}, dim -3); got {hk}. Pass "
                f"enable_gqa=True for grouped-query attention"
            )
        if hk == 0 or hq % hk != 0:
            raise ArgumentValueError(
                f"with enable_gqa, key's number of heads ({hk}) must divide query's ({hq})"
            )
    if key.shape[-1] != query.shape[-1]:
        raise ArgumentValueError(
            f"key must have query's head dimension ({query.shape[-1]}, dim -1); got "
            f"{key.shape[-1]} (key {tuple(key.shape)})"
        )
    if value.shape[-2] != key.shape[-2]:
        raise ArgumentValueError(
            f"value must have key's sequence length ({key.shape[-2]}, dim -2); got "
            f"{value.shape[-2]} (value {tuple(value.shape)})"
        )
    lq, lk = query.shape[-2], key.shape[-2]
    scores_shape = tuple(query.shape[:-1]) + (lk,)
    masks.check_mask("attn_mask", attn_mask, scores_shape, query.dtype,
                     "the attention scores (..., heads, query length, key length)")
    masks.check_key_padding_mask("key_padding_mask", key_padding_mask, query.shape[0], lk, query.dtype)
    return dropout_p, is_causal, scale, enable_gqa


def _gqa_flag(enable_gqa, heads, kv_heads) -> bool:
    """torch's enable_gqa for ``heads`` query heads over ``kv_heads``: only where they differ
    (some of torch's SDPA kernels refuse enable_gqa), but while torch.compile traces, as asked:
    head counts may be symbols there, and torch's SDPA refuses a SymBool (enable_gqa with equal
    heads is exact)."""
    if torch.compiler.is_compiling():
        return bool(enable_gqa)
    return bool(enable_gqa) and heads != kv_heads


def _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                key_padding_mask):
    lq, lk = query.shape[-2], key.shape[-2]
    gqa = _gqa_flag(enable_gqa, query.shape[-3], key.shape[-3])
    if lk == 0:  # nothing to attend to: zeros (through autograd, as the reference)
        return reference.scaled_dot_product_attention(
            query, key, value, scale=scale, enable_gqa=gqa
        )
    if query.shape[-1] == 0:  # torch 2.12's SDPA returns zeros for a head dim of 0
        return reference.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa,
            key_padding_mask=key_padding_mask,
        )
    if attn_mask is not None and attn_mask.dim() < 2:  # 0-d / (S,): torch's 4-D path indexes dim -2
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
    if attn_mask is None and key_padding_mask is None and not (is_causal and scale is not None and scale <= 0):
        # Top-left causal alone never empties a row (key 0 is always visible): no fix-up.  (Not
        # with scale <= 0: torch's CPU kernel scales its -inf causal fill, giving NaN / +inf.)
        return F.scaled_dot_product_attention(
            query, key, value, None, dropout_p, is_causal, scale=scale, enable_gqa=gqa
        )
    mask = masks.combine(
        attn_mask, is_causal, key_padding_mask, lq, lk, query.dim(),
        reference.mask_compute_dtype(query, attn_mask, key_padding_mask), query.device,
    )
    # Some SDPA paths (flash / efficient / cuDNN) return NaN for a row with no key, and NaN
    # gradients.  Open such rows to every key (finite everywhere, so forward and backward stay
    # finite), then zero their outputs: masked_fill also zeroes their upstream gradient, so q, k,
    # v get exactly zero from them.  No host sync: the rows are found on the device.
    dead = masks.dead_rows(mask)
    mask = masks.revive(mask, dead)
    out = F.scaled_dot_product_attention(
        query, key, value, mask, dropout_p, False, scale=scale, enable_gqa=gqa
    )
    # In place on a copy, not masked_fill: that returns a contiguous tensor, where torch's SDPA
    # returns q's memory order (a (B, L, H, D) projection's head merge after it is a view).
    return out.clone().masked_fill_(dead, 0.0)


FUSED_ATTENTION_HEAD_DIMS = "16..256, a multiple of 8"


def _fused_attention_support(backend):
    def check(inputs):
        q, k, v = inputs["query"], inputs["key"], inputs["value"]
        mask = inputs.get("attn_mask")
        reasons = _checks.kernel_dtype_reasons(backend, query=q)
        reasons += _head_dim_reasons(backend, q.shape[-1], v.shape[-1])
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            reasons.append(f"{backend} does not compute the gradient of a float attn_mask")
        kpm = inputs.get("key_padding_mask")
        if kpm is not None and kpm.requires_grad and torch.is_grad_enabled():
            reasons.append(f"{backend} does not compute the gradient of a float key_padding_mask")
        return reasons

    return check


backends.register(
    "scaled_dot_product_attention", "triton", _fused_attention_support("triton")
)

def _cxx_kernel_check(cxx_op, what):
    """A check that the C++ op ``cxx_op`` has a kernel for the backend's device (an extension
    built before it lacks it), read once at import so that selection traced by torch.compile
    reads plain values."""
    built = {
        name: backends.extension_status()[0] and backends.cxx_op_has_kernel(cxx_op, key)
        for name, key in (("cpu", "CPU"), ("cuda", "CUDA"))
    }

    def reasons(backend):
        if built[backend]:
            return []
        return [f"transformer_fast._C has no {backend} {what} kernels (rebuild the extension)"]

    return reasons


_attention_built = _cxx_kernel_check("attention_fwd", "attention")


def _cxx_attention_support(backend):
    fused = _fused_attention_support(backend)

    def check(inputs):
        # fp32 runs everywhere: on cuda the exact-fp32 SIMT kernels of csrc/attention_fp32_cuda.cu
        # (fp16 / bf16 take the mma.sync kernels of csrc/attention_cuda.cu).
        return fused(inputs) + _attention_built(backend)

    return check


for _name in ("cpu", "cuda"):
    backends.register("scaled_dot_product_attention", _name, _cxx_attention_support(_name))


def _head_dim_reasons(backend, d, dv):
    reasons = []
    if not (16 <= d <= 256 and d % 8 == 0):
        reasons.append(f"{backend} supports head dims {FUSED_ATTENTION_HEAD_DIMS}; got {d}")
    if dv != d:
        reasons.append(f"{backend} needs value's head dim equal to query's ({dv} != {d})")
    return reasons


def _fused_kv_cache_support(backend):
    def check(inputs):
        q, v_cache = inputs["q"], inputs["v_cache"]
        reasons = _checks.kernel_dtype_reasons(backend, q=q)
        reasons += _head_dim_reasons(backend, q.shape[-1], v_cache.shape[-1])
        if backends.inputs_need_grad(inputs):
            reasons.append(f"{backend} decoding is inference only (an input requires grad)")
        return reasons

    return check


def _fused_masked_softmax_support(backend):
    def check(inputs):
        scores, mask = inputs["scores"], inputs.get("mask")
        reasons = _checks.kernel_dtype_reasons(backend, scores=scores)
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            reasons.append(f"{backend} does not compute the gradient of a float mask")
        return reasons

    return check


backends.register("attention_with_kv_cache", "triton", _fused_kv_cache_support("triton"))

_kv_cache_built = _cxx_kernel_check("attention_with_kv_cache_fwd", "KV-cache")


def _cxx_kv_cache_support(backend):
    def check(inputs):
        q, v_cache = inputs["q"], inputs["v_cache"]
        reasons = _checks.kernel_dtype_reasons(backend, q=q)
        # The C++ kernels take any head dims up to 256, and a value head dim of its own.
        d, dv = q.shape[-1], v_cache.shape[-1]
        if not (1 <= d <= 256 and 1 <= dv <= 256):
            reasons.append(f"{backend} supports head dims 1..256; got {d} (q) and {dv} (v_cache)")
        if backends.inputs_need_grad(inputs):
            reasons.append(f"{backend} decoding is inference only (an input requires grad)")
        return reasons + _kv_cache_built(backend)

    return check


for _name in ("cpu", "cuda"):
    backends.register("attention_with_kv_cache", _name, _cxx_kv_cache_support(_name))

backends.register("masked_softmax", "triton", _fused_masked_softmax_support("triton"))

_masked_softmax_built = _cxx_kernel_check("masked_softmax_fwd", "masked_softmax")


def _cxx_masked_softmax_support(backend):
    fused = _fused_masked_softmax_support(backend)

    def check(inputs):
        return fused(inputs) + _masked_softmax_built(backend)

    return check


for _name in ("cpu", "cuda"):
    backends.register("masked_softmax", _name, _cxx_masked_softmax_support(_name))


@torch.compiler.assume_constant_result
def _tf32_matmul_enabled() -> bool:
    """Whether torch's own fp32 matmuls may use tf32.

    Read through ``fp32_precision`` where torch has it: reading the legacy ``allow_tf32`` raises
    once a program has set the new API (torch 2.9+); the legacy setters and
    ``set_float32_matmul_precision`` update ``fp32_precision`` too, and "none" inherits the
    global ``torch.backends.fp32_precision``.  torch.compile cannot trace that getter, so a
    compiled graph takes the value at trace time as a constant."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def _allow_tf32(dtype: torch.dtype) -> bool:
    """fp32 attention and GEMMs may use tf32 dots only where PyTorch's own matmuls may."""
    return dtype == torch.float32 and _tf32_matmul_enabled()


def _cpu_scores_in_memory(q4, k4, v4, dropout_p) -> bool:
    """Whether the cpu backend's attention keeps these scores in memory
    (backends.cpu_attention_in_memory: with dropout or 16-bit inputs, where they fit) and _C has
    the masked_softmax kernel it then runs."""
    needs_grad = torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad)
    return backends.cpu_attention_in_memory(q4, k4, dropout_p, needs_grad) and not _masked_softmax_built("cpu")


def _cpu_materialized_attention(q4, k4, v4, mask4, padding, is_causal, scale, dropout_p, rng):
    """The cpu backend's attention with the scores in memory (ops/cpu_attention.py: q @ k^T and
    attn @ v as torch's batched GEMMs, scale + masks + softmax + dropout in one pass of the C++
    masked_softmax kernel, the same Philox elements as the flash kernel's dropout).

    Why not the flash kernel: on the CPU its recomputing backward and per-tile double sums make
    it slower than torch's SDPA, which with dropout runs its own materialising math path (a
    Bernoulli draw, a softmax and several elementwise passes over the scores); this path
    measured 1.3-1.5x torch's forward+backward in fp32 and 1.7-2x in bf16 with dropout, and
    2-3x the flash kernel without (benchmarks/NOTES.md, "The cpu backend's attention with
    dropout", "Exact scores for the cpu attention in memory").  Without a gradient to take, the
    flash kernel's forward is the faster from 1024 keys and keeps that
    (backends.cpu_attention_in_memory).
    q4 (B, H, Lq, D), k4 / v4 (B, Hkv, Lk, D / Dv), mask4 (B, H, Lq, Lk) view or None, padding
    (B, Lk) bool (True = pad) or None -> (B, H, Lq, Dv) in q4's dtype."""
    b, h, lq, _ = q4.shape
    lk = k4.shape[2]
    # One mask for the kernel (float masks added in fp32), expanded as its contract asks.
    mask4 = masks.combine(mask4, False, padding, lq, lk, 4, torch.float32, q4.device)
    if mask4 is not None:
        mask4 = mask4.expand(b, h, lq, lk)
    return _cpu_attention_op.attention_in_memory(q4, k4, v4, mask4, is_causal, scale, dropout_p, rng)


def _fused_sdpa(name, query, key, value, attn_mask, dropout_p, is_causal, scale, key_padding_mask):
    """Run a flash-attention backend on 4-D (B, H, L, D) views of the inputs."""
    lq, lk, d = query.shape[-2], key.shape[-2], query.shape[-1]
    scores_shape = tuple(query.shape[:-1]) + (lk,)
    if query.dim() == 3:  # (N, L, D): one head
        q4, k4, v4 = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif query.dim() == 4:
        q4, k4, v4 = query, key, value
    else:  # (..., H, L, D): fold the leading dims into one batch (a view when strides allow)
        q4, k4, v4 = (t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:]) for t in (query, key, value))
    b4, h = q4.shape[0], q4.shape[1]

    # the dtype float masks are added in (the kernels read any of them)
    mask_dtype = reference.mask_compute_dtype(query, attn_mask, key_padding_mask)
    padding = None
    if key_padding_mask is not None and key_padding_mask.dtype == torch.bool and b4 == key_padding_mask.shape[0]:
        padding = key_padding_mask  # the kernel's native (B, Lk) form
    elif key_padding_mask is not None:  # float padding, or >4-D leading dims: fold into the mask
        attn_mask = masks.combine(
            attn_mask, False, key_padding_mask, lq, lk, query.dim(), mask_dtype, query.device
        )
    mask4 = None
    if attn_mask is not None:
        mask4 = attn_mask.expand(scores_shape)
        mask4 = mask4.unsqueeze(1) if query.dim() == 3 else mask4.reshape(b4, h, lq, lk)
        if mask4.is_floating_point() and mask4.dtype != mask_dtype:
            mask4 = mask4.to(mask_dtype)
    rng = philox.new_rng(query.device) if dropout_p > 0.0 else None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if name == "cpu" and _cpu_scores_in_memory(q4, k4, v4, dropout_p):
        out = _cpu_materialized_attention(q4, k4, v4, mask4, padding, is_causal, scale, dropout_p, rng)
        return out if query.dim() == 4 else out.reshape(*query.shape[:-1], value.shape[-1])
    out = _attention_op.attention(
        q4, k4, v4, mask4, padding, is_causal, scale, dropout_p, rng, _allow_tf32(query.dtype), name
    )
    return out if query.dim() == 4 else out.reshape(*query.shape[:-1], value.shape[-1])


def _from_causal_bias(bias, is_causal, query, key):
    """torch.nn.attention.bias.CausalBias as (attn_mask, is_causal): torch's SDPA takes it as its
    attn_mask (through __torch_function__).  Upper left is is_causal; lower right (the diagonal
    ending at the last query and key) is that too when Lq == Lk, else its bool mask."""
    if is_causal:
        raise ArgumentValueError("CausalBias should not be used with causal=True (attn_mask is a "
                                 "CausalBias: it says the causal variant itself)")
    lq, lk = (t.shape[-2] if isinstance(t, torch.Tensor) and t.dim() >= 2 else None for t in (query, key))
    if (bias.seq_len_q, bias.seq_len_kv) != (lq, lk):
        raise ArgumentValueError(
            f"attn_mask: a CausalBias for {bias.seq_len_q} queries and {bias.seq_len_kv} keys; "
            f"query and key have {lq} and {lk}")
    if bias.variant == CausalVariant.UPPER_LEFT or lq == lk:
        return None, True
    return bias._materialize(query.device), False  # (Lq, Lk) bool, True = takes part


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, key_padding_mask=None, backend=None,
):
    """Scaled dot-product attention; a drop-in for torch.nn.functional.scaled_dot_product_attention.

    ``softmax(query @ key^T * scale + mask) @ value``, with dropout on the probabilities.

    Args:
        query: (..., Hq, Lq, D) (or (N, Lq, D) without a head dimension; with ``enable_gqa``,
            as in torch, N counts heads; or (Lq, D) with key and value 2-D too),
            float16/bfloat16/float32/float64.  Any strides.
        key: (..., Hkv, Lk, D), query's dtype and device; leading dimensions that broadcast with
            query's (as torch's: k, v shared across a size-1 dim, no copy).  Hkv == Hq, or with
            ``enable_gqa`` any divisor of Hq (key/value head h serves query heads
            h * Hq/Hkv .. (h+1) * Hq/Hkv - 1, as torch).
        value: (..., Hkv, Lk, Dv); Dv may differ from D.  With ``enable_gqa``, as in torch, its
            number of heads may differ from key's when each divides Hq.
        attn_mask: broadcastable to the scores (..., Hq, Lq, Lk), e.g. (Lq, Lk), (B, 1, Lq, Lk)
            or (B, Hq, Lq, Lk).  torch SDPA polarity: bool True = the key TAKES PART (False
            removes it); a float mask (query's dtype or float32) is ADDED to the scaled scores
            (-inf removes the key).  A torch.nn.attention.bias.CausalBias (causal_upper_left /
            causal_lower_right) works as with torch's SDPA.
        dropout_p: probability of dropping an attention probability, in [0, 1); applied
            whenever > 0 (pass 0.0 in eval mode, as with torch's function).
        is_causal: mask key j > query i, top-left aligned as torch SDPA (also when Lq != Lk).
            Unlike torch, it may be combined with ``attn_mask`` and ``key_padding_mask``: the
            masks are ANDed.
        scale: multiplies q @ k^T; None = 1/sqrt(D).
        enable_gqa: allow Hkv < Hq (grouped-query attention).
        key_padding_mask: (B, Lk) with B = query.shape[0]; nn.MultiheadAttention polarity: bool
            True = PADDING (the key is removed); float is added.
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu"; None = the
            current default (see transformer_fast.use_backend).

    Returns:
        (..., Hq, Lq, Dv) in query's dtype.  A query row left with no key (every key masked)
        is zeros, with zero gradients, never NaN.

    Raises:
        TypeError / ValueError naming the argument for any malformed input, before computing.
    """
    if isinstance(attn_mask, CausalBias):
        attn_mask, is_causal = _from_causal_bias(attn_mask, is_causal, query, key)
    if all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (query, key, value)):
        # (L, D) inputs, which torch's SDPA also takes: one sequence without heads.
        if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() == 1:
            key_padding_mask = key_padding_mask[None]  # (S,) -> (1, S), as an unbatched MHA's
        return scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale,
            enable_gqa, key_padding_mask=key_padding_mask, backend=backend,
        )[0]
    query, key, value = _autocast(query, key, value)
    dtype = _autocast_dtype(query)
    if dtype is not None:
        # A float mask of the other 16-bit dtype becomes the autocast dtype, as torch's SDPA
        # casts it (so the checks accept it); the rounding of float32 masks, and of a float
        # key_padding_mask summed into attn_mask first, is _autocast_masks'.
        attn_mask, key_padding_mask = (
            m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point()
            and m.dtype not in (dtype, torch.float32, torch.float64) else m
            for m in (attn_mask, key_padding_mask))
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and t.dim() < 2:
            raise ArgumentValueError(f"{name} must have at least 2 dimensions ((..., L, D), as torch's "
                                     f"SDPA takes); got shape {tuple(t.shape)}")
    if (all(isinstance(t, torch.Tensor) for t in (query, key, value))
            and min(t.dim() for t in (query, key, value)) == 2 < max(t.dim() for t in (query, key, value))):
        # A 2-D (L, D) operand beside batched ones: torch broadcasts it over their leading dims.
        query, key, value = (t[None] if t.dim() == 2 else t for t in (query, key, value))
    if (isinstance(query, torch.Tensor) and query.dim() == 3 and isinstance(attn_mask, torch.Tensor)
            and attn_mask.dim() == 4 and attn_mask.shape[0] == 1):
        # torch also takes, for 3-D inputs, a mask one rank higher with a leading 1.
        attn_mask = attn_mask[0]
    if (enable_gqa is True and key_padding_mask is None
            and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (query, key, value))):
        # torch reads dim -3 of 3-D inputs as the heads under enable_gqa: one batch of heads.
        return scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale, True,
            backend=backend,
        )[0]
    query, key, value = _broadcast_batch_dims(query, key, value, enable_gqa)
    key, value = _gqa_common_heads(query, key, value, enable_gqa)
    dropout_p, is_causal, scale, enable_gqa = _check_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    inputs = {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
              "key_padding_mask": key_padding_mask, "dropout_p": dropout_p, "is_causal": is_causal}
    name = backends.resolve("scaled_dot_product_attention", backend, inputs)
    return run_scaled_dot_product_attention(
        name, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )


def run_scaled_dot_product_attention(name, query, key, value, attn_mask, dropout_p, is_causal,
                                     scale, enable_gqa, key_padding_mask):
    """scaled_dot_product_attention on the resolved backend ``name``, for inputs already
    checked (3-D or more, batch dims broadcast, key and value with a common number of heads)."""
    if attn_mask is not None or key_padding_mask is not None:
        attn_mask, key_padding_mask = _autocast_masks(query, attn_mask, key_padding_mask)
    if name == "reference" or key.shape[-2] == 0 or (key.dim() > 3 and key.shape[-3] == 0):
        # No key (or no head): every row attends to nothing, zeros and zero gradients on every
        # backend (DESIGN 4); the reference's empty matmuls give them without a kernel launch.
        return reference.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask,
        )
    if name == "torch":
        return _torch_sdpa(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
        )
    return _fused_sdpa(
        name, query, key, value, attn_mask, dropout_p, is_causal, scale, key_padding_mask
    )


# ---- attention_with_kv_cache


def _check_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale):
    _checks.tensor("q", q, ndim=4)
    _checks.tensor("k_cache", k_cache, ndim=4)
    _checks.tensor("v_cache", v_cache, ndim=4)
    if (k_new is None) != (v_new is None):
        raise ArgumentValueError(
            "k_new and v_new must be given together or both be None; got "
            f"k_new={'None' if k_new is None else 'a tensor'}, v_new={'None' if v_new is None else 'a tensor'}"
        )
    _checks.optional_tensor("k_new", k_new, ndim=4)
    _checks.optional_tensor("v_new", v_new, ndim=4)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ArgumentTypeError(f"cache_seqlens must be a torch.Tensor; got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise ArgumentTypeError(f"cache_seqlens must have dtype int32; got {cache_seqlens.dtype}")
    _checks.same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    _checks.same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new
    )
    scale = _checks.optional_scale(scale)

    batch, heads, lq, dim = q.shape
    if dim < 1:
        raise ArgumentValueError(f"q must have a head dimension >= 1; got shape {tuple(q.shape)}")
    _, kv_heads, l_max, _ = k_cache.shape
    _checks.shape("k_cache", k_cache, (batch, kv_heads, l_max, dim),
                  "(batch, kv heads, max length, head dim) with q's batch and head dim")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ArgumentValueError(
            f"k_cache's number of heads ({kv_heads}, dim 1) must divide q's ({heads}); "
            f"got k_cache {tuple(k_cache.shape)}, q {tuple(q.shape)}"
        )
    dim_v = v_cache.shape[3]
    _checks.shape("v_cache", v_cache, (batch, kv_heads, l_max, dim_v),
                  "k_cache's (batch, kv heads, max length) and any value head dim")
    l_new = 0
    if k_new is not None:
        l_new = k_new.shape[2]
        _checks.shape("k_new", k_new, (batch, kv_heads, lq, dim),
                      "(batch, kv heads, q's length, head dim)")
        _checks.shape("v_new", v_new, (batch, kv_heads, lq, dim_v),
                      "(batch, kv heads, q's length, v_cache's head dim)")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(st == 0 and n > 1 for st, n in zip(cache.stride(), cache.shape)):
                raise ArgumentValueError(
                    f"{name} is written in place, so it cannot be an expanded (stride-0) view: "
                    f"got shape {tuple(cache.shape)}, strides {cache.stride()}"
                )
            if cache.requires_grad and cache.is_leaf and torch.is_grad_enabled():
                raise ArgumentValueError(
                    f"{name} is written in place, so it cannot be a leaf tensor that requires "
                    "grad; pass a cache that does not require grad (or detach it)"
                )
    if l_new > l_max:
        raise ArgumentValueError(f"k_new's length ({l_new}) exceeds the cache length L_max={l_max}")
    _checks.shape("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    # Bounds of the VALUES: 0 <= cache_seqlens[b] and cache_seqlens[b] + L_new <= L_max.
    checks = _checks.value_check_mode(cache_seqlens.device)
    if checks == "host":
        low = int(cache_seqlens.min()) if batch else 0
        high = int(cache_seqlens.max()) if batch else 0
        if low < 0:
            raise ArgumentValueError(f"cache_seqlens must be >= 0; got a minimum of {low}")
        if high + l_new > l_max:
            raise ArgumentValueError(
                f"cache_seqlens + L_new must be <= L_max={l_max} (k_cache dim 2); got "
                f"max(cache_seqlens)={high} with L_new={l_new}"
            )
    elif checks == "device" and batch:
        # GPU hot path: no host sync.  A device-side assert stops the stream before any write
        # lands out of bounds (it surfaces asynchronously as a device-side assertion error);
        # TRANSFORMER_FAST_CHECKS=1 gives the ValueError above instead, at the cost of a sync.
        ok = ((cache_seqlens >= 0) & (cache_seqlens <= l_max - l_new)).all()
        torch._assert_async(ok, "attention_with_kv_cache: cache_seqlens out of [0, L_max - L_new]")
    return scale


def _torch_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale):
    batch, heads, lq, _ = q.shape
    kv_heads, l_max = k_cache.shape[1], k_cache.shape[2]
    seqlens = cache_seqlens.to(torch.int64)
    l_new = 0
    if k_new is not None:
        l_new = k_new.shape[2]
        positions = seqlens.unsqueeze(1) + torch.arange(l_new, device=q.device)  # (B, L_new)
        rows = torch.arange(batch, device=q.device).unsqueeze(1)  # (B, 1)
        # (B, L_max, Hkv, D) views: one index_put_ per cache writes all rows, no host sync.
        k_cache.transpose(1, 2)[rows, positions] = k_new.transpose(1, 2)
        v_cache.transpose(1, 2)[rows, positions] = v_new.transpose(1, 2)
    last_visible = (seqlens + (l_new - lq)).reshape(batch, 1, 1) + torch.arange(
        lq, device=q.device
    ).reshape(1, lq, 1)
    allowed = torch.arange(l_max, device=q.device) <= last_visible  # (B, Lq, L_max)
    allowed = allowed.unsqueeze(1)  # (B, 1, Lq, L_max)
    if l_max == 0:
        return reference.scaled_dot_product_attention(
            q, k_cache, v_cache, allowed, scale=scale, enable_gqa=_gqa_flag(True, heads, kv_heads)
        )
    dead = masks.dead_rows(allowed)  # only without k_new, when cache_seqlens[b] < Lq
    allowed = masks.revive(allowed, dead)
    # Slots past a row's valid keys may hold anything (a cache from torch.empty): torch's SDPA
    # would still multiply their values by 0 (0 * NaN = NaN) and add its -inf mask to their
    # scores (Inf + -inf = NaN), so they are zeroed first (the reference drops the values too).
    in_cache = torch.arange(l_max, device=q.device) < (seqlens + l_new).reshape(batch, 1)  # (B, L_max)
    junk = ~in_cache.reshape(batch, 1, l_max, 1)
    k_cache, v_cache = k_cache.masked_fill(junk, 0.0), v_cache.masked_fill(junk, 0.0)
    out = F.scaled_dot_product_attention(
        q, k_cache, v_cache, allowed, scale=scale, enable_gqa=_gqa_flag(True, heads, kv_heads)
    )
    return out.masked_fill(dead, 0.0)


def attention_with_kv_cache(
    q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, scale=None, backend=None
):
    """One incremental-decoding attention step over a preallocated KV cache.

    Args:
        q: (B, H, Lq, D) queries of the new tokens (any strides).
        k_cache: (B, Hkv, L_max, D) key cache, q's dtype and device; Hkv divides H (each cache
            head serves H/Hkv consecutive query heads, as SDPA's enable_gqa).  Written in place.
        v_cache: (B, Hkv, L_max, Dv) value cache.  Written in place.
        cache_seqlens: (B,) int32 on q's device: the number of valid keys already in each row
            of the cache.  Not modified: the caller advances it (by Lq) after the call.
        k_new, v_new: (B, Hkv, Lq, D) / (B, Hkv, Lq, Dv) keys and values of the new tokens, or
            both None when the caller has already written them.
        scale: multiplies q @ k^T; None = 1/sqrt(D).
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu"; None = the current
            default (see transformer_fast.use_backend).

    Semantics:
        k_new/v_new are copied into the caches at positions cache_seqlens[b] ..
        cache_seqlens[b] + Lq - 1; then query i of row b attends to the keys
        j <= cache_seqlens[b] + L_new - Lq + i (L_new = Lq with k_new, else 0): the whole prefix
        plus the new tokens up to itself, causal and bottom-right aligned among the new tokens.
        Without k_new the last Lq of the cache_seqlens[b] keys are taken to be the queries' own;
        a query with no visible key (cache_seqlens[b] < Lq there) returns zeros.

        Bounds: 0 <= cache_seqlens[b] and cache_seqlens[b] + L_new <= L_max.  Checked with a
        ValueError on CPU tensors; on a GPU the check would need a host sync, so by default it
        is a sync-free device-side assert, and the ValueError only with TRANSFORMER_FAST_CHECKS=1
        (TRANSFORMER_FAST_CHECKS=0 disables the value check; skipped under torch.compile).

        Autograd flows to q, k_new and v_new (and to the caches' own history, if any); the
        caches must not be leaf tensors that require grad.  The fused backends (cpu, triton,
        cuda) are inference only: with an input that requires grad (and grad mode on) ``auto``
        runs reference / torch, and naming a fused backend raises BackendError.

    Returns:
        (B, H, Lq, Dv) in q's dtype.
    """
    scale = _check_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale)
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
              "k_new": k_new, "v_new": v_new}
    name = backends.resolve("attention_with_kv_cache", backend, inputs)
    if name == "reference":
        return reference.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale)
    if name == "torch":
        return _torch_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _decode_op.attention_with_kv_cache(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, _allow_tf32(q.dtype), name
    )


# ---- masked_softmax


def masked_softmax(scores, mask=None, *, scale=1.0, is_causal=False, dropout_p=0.0, backend=None):
    """``dropout(softmax(scores * scale, masked))`` over the last dimension (need_weights path).

    Args:
        scores: (..., Lq, Lk) float16/bfloat16/float32/float64 (at least 2-D with is_causal).
        mask: broadcastable to ``scores`` (e.g. (Lq, Lk), (B, 1, Lq, Lk)), SDPA polarity: bool
            True = takes part (False removes the entry); float (scores' dtype or float32) is
            added AFTER scaling (-inf removes the entry).
        scale: multiplies the scores first (finite float).
        is_causal: remove entries j > i of the last two dims (top-left aligned); combines
            with ``mask``.
        dropout_p: dropout on the probabilities, in [0, 1); applied whenever > 0.
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu"; None = the current
            default (see transformer_fast.use_backend).

    Returns:
        Probabilities shaped and typed like ``scores``.  A row with every entry removed (or
        -inf) is zeros, with zero gradients.
    """
    _checks.tensor("scores", scores, min_ndim=2 if is_causal is True else 1)
    _checks.optional_tensor("mask", mask, dtypes=None)
    _checks.same_device(scores=scores, mask=mask)
    masks.check_mask("mask", mask, scores.shape, scores.dtype, "scores")
    scale = _checks.number("scale", scale)
    is_causal = _checks.boolean("is_causal", is_causal)
    dropout_p = _checks.dropout_p(dropout_p)

    inputs = {"scores": scores, "mask": mask}
    name = backends.resolve("masked_softmax", backend, inputs)
    return run_masked_softmax(name, scores, mask, scale, is_causal, dropout_p)


def run_masked_softmax(name, scores, mask, scale, is_causal, dropout_p):
    """masked_softmax on the resolved backend ``name``, for inputs already checked."""
    if name == "reference":
        return reference.masked_softmax(scores, mask, scale, is_causal, dropout_p)
    if name == "torch":
        x = scores
        if scale != 1.0:
            # 16-bit scores scaled in fp32, as the fused kernels do: scale * scores may overflow
            # fp16 where the probabilities are finite.
            x = (scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores) * scale
        mask_dtype = reference.mask_compute_dtype(scores, mask)
        combined = masks.combine(
            mask, is_causal, None, scores.shape[-2] if scores.dim() > 1 else 1, scores.shape[-1],
            scores.dim(), mask_dtype, scores.device,
        )
        if combined is not None:
            if combined.dtype == torch.bool:
                x = x.masked_fill(~combined, _NEG_INF)
            else:
                x = x.to(mask_dtype) + combined
        probs = _zero_dead_rows_softmax(x).to(scores.dtype)
        return F.dropout(probs, dropout_p) if dropout_p > 0.0 else probs
    return _fused_masked_softmax(name, scores, mask, scale, is_causal, dropout_p)


def _fused_masked_softmax(name, scores, mask, scale, is_causal, dropout_p):
    """Run a fused backend on a 4-D (B, H, Lq, Lk) view of the scores."""
    shape = scores.shape
    four_d = (1,) * (4 - scores.dim()) + tuple(shape) if scores.dim() <= 4 else (math.prod(shape[:-3]), *shape[-3:])
    scores4 = scores.reshape(four_d)
    mask4 = None
    if mask is not None:
        mask4 = mask.expand(shape).reshape(scores4.shape)
        if mask4.is_floating_point() and mask4.dtype != scores.dtype:
            mask4 = mask4.to(reference.mask_compute_dtype(scores, mask4))  # fp32 for 16-bit scores
    rng = philox.new_rng(scores.device) if dropout_p > 0.0 else None
    if (mask4 is not None and mask4.dtype == torch.float32 and scores.dtype != torch.float32
            and scores.requires_grad and torch.is_grad_enabled()):
        # 16-bit scores meeting a float32 mask are softmaxed in fp32 (mask_compute_dtype), and the
        # gradient must come from those fp32 probabilities, as the reference's does: from the
        # 16-bit output it missed the oracle's bound in 25-65% of draws at scale >= 4 (up to
        # 3.7x).  The kernel runs in fp32 and the output is rounded once.
        out = _masked_softmax_op.masked_softmax(scores4.float(), mask4, scale, is_causal, dropout_p, rng, name)
        return out.to(scores.dtype).reshape(shape)
    out = _masked_softmax_op.masked_softmax(scores4, mask4, scale, is_causal, dropout_p, rng, name)
    return out.reshape(shape)


# ---- feed_forward and linear_bias_act

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_LBA_ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh")


# Whether _C holds the FFN kernels (an extension built before them lacks them).  Read once at
# import, so that backend selection traced by torch.compile reads plain values.
_FFN_CXX = {
    name: backends.extension_status()[0] and backends.cxx_op_has_kernel("ffn_linear_fwd", key)
    for name, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


def _fused_ffn_support(backend):
    def check(inputs):
        reasons = _checks.kernel_dtype_reasons(backend, x=inputs["x"])
        if backend in _FFN_CXX and not _FFN_CXX[backend]:
            reasons.append(f"transformer_fast._C has no {backend} FFN kernels (rebuild the extension)")
        return reasons

    return check


for _op in ("feed_forward", "linear_bias_act"):
    for _name in ("triton", "cuda", "cpu"):
        backends.register(_op, _name, _fused_ffn_support(_name))
backends.register("linear_bias_act", "reference")
backends.register("linear_bias_act", "torch")


def _torch_activation(hidden, activation):
    if activation == "relu":
        return F.relu(hidden)
    if activation == "gelu":
        return F.gelu(hidden)
    if activation == "gelu_tanh":
        return F.gelu(hidden, approximate="tanh")
    return hidden


def _torch_feed_forward(x, w1, b1, w2, b2, activation, dropout_p):
    hidden = _torch_activation(F.linear(x, w1, b1), activation)
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, dropout_p)
    return F.linear(hidden, w2, b2)


def _reference_linear_bias_act(x, w, b, activation, dropout_p):
    """The naive steps: matmul, bias add, activation, dropout (F.dropout's own mask)."""
    out = x @ w.transpose(0, 1)
    if b is not None:
        out = out + b
    if activation is not None:
        out = reference._ACTIVATIONS[activation](out)
    return F.dropout(out, dropout_p) if dropout_p > 0.0 else out


def _check_linear(xname, x, wname, w, bname, b):
    """x (..., in), w (out, in) as nn.Linear stores it, b (out,) or None: one dtype and device."""
    _checks.tensor(wname, w, ndim=2)
    _checks.optional_tensor(bname, b, ndim=1)
    _checks.shape(wname, w, (w.shape[0], x.shape[-1]),
                  f"(out_features, in_features) with in_features = {xname}.shape[-1]")
    if b is not None:
        _checks.shape(bname, b, (w.shape[0],), f"(out_features,) = {wname}.shape[0]")


def feed_forward(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, backend=None):
    """Position-wise feed-forward ``dropout(act(x W1^T + b1)) W2^T + b2``.

    The fused backends (triton, cuda, cpu) add b1, apply the activation and dropout in the first
    GEMM's epilogue and b2 in the second's; backward applies act' and the dropout mask
    (regenerated from the Philox stream, never stored) in the epilogue of the GEMM that produces
    d(hidden).

    Args:
        x: (..., d_model) float16/bfloat16/float32/float64, any strides.
        w1: (d_ff, d_model), as nn.Linear(d_model, d_ff).weight; x's dtype and device.
        b1: (d_ff,) or None.
        w2: (d_out, d_ff), as nn.Linear(d_ff, d_out).weight (d_out is d_model in a Transformer).
        b2: (d_out,) or None.
        activation: "relu", "gelu" (erf) or "gelu_tanh" (tanh approximation).
        dropout_p: dropout on the activations, in [0, 1); applied whenever > 0.
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu" (None: the current
            default, see transformer_fast.use_backend).  The fused backends take fp16/bf16/fp32;
            fp32 matmuls use tf32 only where torch's own setting allows it.

    Returns:
        (..., d_out) in x's dtype.
    """
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    _checks.tensor("x", x, min_ndim=1)
    _checks.tensor("w1", w1, ndim=2)
    _checks.optional_tensor("b1", b1, ndim=1)
    _checks.tensor("w2", w2, ndim=2)
    _checks.optional_tensor("b2", b2, ndim=1)
    _checks.same_dtype(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    _checks.same_device(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    d_model = x.shape[-1]
    d_ff = w1.shape[0]
    _checks.shape("w1", w1, (d_ff, d_model), "(d_ff, d_model) with d_model = x.shape[-1]")
    if b1 is not None:
        _checks.shape("b1", b1, (d_ff,), "(d_ff,) = w1.shape[0]")
    d_out = w2.shape[0]
    _checks.shape("w2", w2, (d_out, d_ff), "(d_out, d_ff) with d_ff = w1.shape[0]")
    if b2 is not None:
        _checks.shape("b2", b2, (d_out,), "(d_out,) = w2.shape[0]")
    activation = _checks.choice("activation", activation, ACTIVATIONS)
    dropout_p = _checks.dropout_p(dropout_p)

    inputs = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "activation": activation,
              "dropout_p": dropout_p}
    name = backends.resolve("feed_forward", backend, inputs)
    return run_feed_forward(name, x, w1, b1, w2, b2, activation, dropout_p)


def run_feed_forward(name, x, w1, b1, w2, b2, activation, dropout_p):
    """feed_forward on the resolved backend ``name``, for inputs already checked."""
    if name == "reference":
        return reference.feed_forward(x, w1, b1, w2, b2, activation, dropout_p)
    if name == "torch":
        return _torch_feed_forward(x, w1, b1, w2, b2, activation, dropout_p)
    rng = philox.new_rng(x.device) if dropout_p > 0.0 else None
    return _ffn_op.feed_forward(
        x, w1, b1, w2, b2, activation, dropout_p, rng, _allow_tf32(x.dtype), name
    )


def linear_bias_act(x, w, b=None, *, activation=None, dropout_p=0.0, backend=None):
    """``dropout(act(x W^T + b))``: one GEMM with bias, activation and dropout in its epilogue.

    The building block of feed_forward, for any Linear followed by an activation.

    Args:
        x: (..., in_features) float16/bfloat16/float32/float64, any strides.
        w: (out_features, in_features), as nn.Linear stores it; x's dtype and device.
        b: (out_features,) or None.
        activation: None, "relu", "gelu" (erf) or "gelu_tanh" (tanh approximation).
        dropout_p: dropout on the output, in [0, 1); applied whenever > 0.  The mask is the
            Philox stream of transformer_fast.philox over the row-major index of the
            (rows, out_features) output, regenerated (not stored) in backward.
        backend: "auto", "reference", "torch", "triton", "cuda" or "cpu" (None: the current
            default, see transformer_fast.use_backend).

    Returns:
        (..., out_features) in x's dtype.

    Raises:
        TypeError / ValueError naming the argument for any malformed input, before computing.
    """
    x, w, b = _autocast(x, w, b)
    _checks.tensor("x", x, min_ndim=1)
    _check_linear("x", x, "w", w, "b", b)
    _checks.same_dtype(x=x, w=w, b=b)
    _checks.same_device(x=x, w=w, b=b)
    if activation is not None:
        _checks.choice("activation", activation, ACTIVATIONS)
    dropout_p = _checks.dropout_p(dropout_p)

    inputs = {"x": x, "w": w, "b": b, "activation": activation, "dropout_p": dropout_p}
    name = backends.resolve("linear_bias_act", backend, inputs)
    if name == "reference":
        return _reference_linear_bias_act(x, w, b, activation, dropout_p)
    if name == "torch":
        out = _torch_activation(F.linear(x, w, b), activation)
        return F.dropout(out, dropout_p) if dropout_p > 0.0 else out
    rng = philox.new_rng(x.device) if dropout_p > 0.0 else None
    return _ffn_op.linear_bias_act(
        x, w, b, activation or "none", dropout_p, rng, _allow_tf32(x.dtype), name
    )
