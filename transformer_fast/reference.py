"""The naive Transformer math the seeds describe, and the float64 oracle built on it.

Every function here is the readable baseline: it is the ``reference`` backend, the naive line in
every benchmark, and, upcast to float64, the oracle every kernel is checked against (DESIGN
section 6).  No tricks: materialised tensors, one PyTorch op per step.

Dropout: when ``dropout_p > 0`` the functions take an optional ``keep`` mask (bool, True = kept).
With it they drop exactly those elements, which is how the oracle checks a kernel's dropout
(the kernels' masks come from transformer_fast.philox); without it they call F.dropout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F


def _dropout(x: torch.Tensor, p: float, keep: torch.Tensor | None, training: bool = True):
    if p == 0.0 or not training:
        return x
    if keep is None:
        # F.dropout's draw (the same Bernoulli elements), applied as x * keep / (1 - p): in 16-bit
        # F.dropout multiplies by 1 / (1 - p) rounded to the dtype (bf16: 1.3359 for p = 0.25,
        # 0.2% off), which took the reference backend past the oracle's bound in some draws.
        keep = F.dropout(torch.ones_like(x), p, training=True) != 0
    return x * keep.to(x.dtype) / (1.0 - p)


# --------------------------------------------------------------------------------------------
# Residual add + LayerNorm (post-LN "Add & Norm"; prenorm returns the sum too)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    prenorm: bool = False,
    keep: torch.Tensor | None = None,
):
    """``LayerNorm(residual + dropout(x))`` over the last dimension, in separate steps."""
    summed = residual + _dropout(x, dropout_p, keep)
    mean = summed.mean(dim=-1, keepdim=True)
    var = ((summed - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as nn.LayerNorm
    out = (summed - mean) / torch.sqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    out = out.to(summed.dtype)  # float32 weight/bias with half inputs: the result stays in x's dtype
    return (out, summed) if prenorm else out


# --------------------------------------------------------------------------------------------
# Position-wise feed-forward: Linear - activation - dropout - Linear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": lambda h: F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
}


def linear_bias_act(x, w, b=None, activation=None, dropout_p=0.0, keep=None):
    """``dropout(act(x W^T + b))`` with the weight as nn.Linear stores it (out, in)."""
    out = x @ w.transpose(0, 1)
    if b is not None:
        out = out + b
    if activation is not None:
        out = _ACTIVATIONS[activation](out)
    return _dropout(out, dropout_p, keep)


def feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0, keep=None):
    """``dropout(act(x W1^T + b1)) W2^T + b2`` with the weights as nn.Linear stores them."""
    hidden = linear_bias_act(x, w1, b1, activation, dropout_p, keep)
    return linear_bias_act(hidden, w2, b2)


# --------------------------------------------------------------------------------------------
# Attention: scores = Q K^T * scale, mask with -inf, softmax, dropout, times V
#
# Masks follow transformer_fast.masks: bool attn_mask True = takes part, float attn_mask added,
# key_padding_mask (B, Lk) True = padding, is_causal top-left aligned as torch SDPA.  A row with
# no key left (every score -inf) is zero, with zero gradients: its scores are replaced by zeros
# BEFORE the softmax (so neither the softmax nor its backward ever sees an all -inf row, which
# would give NaN) and its probabilities are zeroed after it.


def _causal_allowed(lq, lk, device, bottom_right=False):
    """(lq, lk) bool, True where query i may see key j: j <= i (top-left, torch SDPA's
    is_causal) or j <= i + lk - lq (bottom-right, the KV-cache convention)."""
    offset = lk - lq if bottom_right else 0
    rows = torch.arange(lq, device=device).unsqueeze(-1)
    cols = torch.arange(lk, device=device)
    return cols <= rows + offset


def mask_compute_dtype(scores, *masks):
    """The dtype float masks are added in: float32 when 16-bit scores meet a float mask of
    another dtype (a float32 mask keeps its precision and range, as in torch's SDPA, instead of
    being rounded or overflowing to -inf in fp16); else the scores' dtype.  Every backend
    (functional.py) follows this rule."""
    if scores.dtype in (torch.float16, torch.bfloat16):
        for m in masks:
            if m is not None and m.is_floating_point() and m.dtype != scores.dtype:
                return torch.float32
    return scores.dtype


def _apply_masks(scores, attn_mask=None, is_causal=False, key_padding_mask=None, bottom_right=False):
    """Scores with removed keys set to -inf and float masks added (in float32 when
    mask_compute_dtype says so: the caller casts the probabilities back)."""
    scores = scores.to(mask_compute_dtype(scores, attn_mask, key_padding_mask))
    lk = scores.shape[-1]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(scores.dtype)
    if key_padding_mask is not None:
        batch = key_padding_mask.shape[0]
        padding = key_padding_mask.reshape((batch,) + (1,) * (scores.dim() - 2) + (lk,))
        if padding.dtype == torch.bool:
            # A copy: masked_fill keeps its mask for backward, and a caller may reuse the padding
            # mask's buffer before backward (torch.nn's MultiheadAttention converts it first).
            scores = scores.masked_fill(padding.clone(), float("-inf"))
        else:
            scores = scores + padding.to(scores.dtype)
    if is_causal:
        allowed = _causal_allowed(scores.shape[-2], lk, scores.device, bottom_right)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _softmax_zero_dead_rows(scores):
    """softmax over the last dim; rows whose scores are all -inf become zeros (no NaN, neither
    in the output nor in the gradient)."""
    dead = torch.isneginf(scores.detach()).all(dim=-1, keepdim=True)
    safe_scores = torch.where(dead, torch.zeros_like(scores), scores)
    probs = torch.softmax(safe_scores, dim=-1)
    probs = torch.where(dead, torch.zeros_like(probs), probs)
    return probs


def masked_softmax(scores, mask=None, scale=1.0, is_causal=False, dropout_p=0.0, keep=None):
    """``dropout(softmax(scores * scale masked))`` over the last dimension.

    ``mask`` broadcastable to ``scores``: bool True = takes part, float added (after scaling).
    ``is_causal`` masks the last two dims top-left (key j > query i).  Fully masked rows are 0.
    """
    scaled = scores * scale
    masked = _apply_masks(scaled, mask, is_causal)
    probs = _softmax_zero_dead_rows(masked).to(scores.dtype)
    return _dropout(probs, dropout_p, keep)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    key_padding_mask=None,
    keep=None,
    causal_bottom_right=False,
):
    """Naive attention, shapes as torch SDPA: query (..., Hq, Lq, D), key (..., Hkv, Lk, D),
    value (..., Hkv, Lk, Dv) -> (..., Hq, Lq, Dv).

    scale defaults to 1/sqrt(D).  With ``enable_gqa`` each key/value head serves Hq/Hkv
    consecutive query heads (repeat_interleave, as torch).  ``is_causal`` may be combined with
    the other masks (torch SDPA refuses is_causal with attn_mask; this one ANDs them).
    ``keep`` (..., Hq, Lq, Lk) bool is the exact dropout mask on the probabilities.
    """
    head_dim = query.shape[-1]
    if scale is None:
        # D == 0: the scores are empty sums, 0 for any scale (torch: softmax of zeros, mean of v).
        scale = 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = query @ key.transpose(-2, -1)
    scores = scores * scale
    masked = _apply_masks(scores, attn_mask, is_causal, key_padding_mask, causal_bottom_right)
    probs = _softmax_zero_dead_rows(masked).to(scores.dtype)
    probs = _dropout(probs, dropout_p, keep)
    return probs @ value


def attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, scale=None):
    """Incremental decoding step.

    q (B, H, Lq, D); caches (B, Hkv, L_max, D / Dv); cache_seqlens (B,) int; k_new/v_new
    (B, Hkv, L_new, D / Dv) or None.  Writes k_new/v_new into the caches IN PLACE at positions
    cache_seqlens[b] .. cache_seqlens[b] + L_new - 1, then lets query i of row b attend to keys
    j <= cache_seqlens[b] + L_new - Lq + i (causal, bottom-right aligned among the new tokens;
    with no k_new the queries' own keys are taken to be the last Lq of cache_seqlens[b]).
    """
    batch, heads, lq, _ = q.shape
    kv_heads, l_max = k_cache.shape[1], k_cache.shape[2]
    l_new = 0 if k_new is None else k_new.shape[2]
    for b in range(batch):
        start = int(cache_seqlens[b])
        if k_new is not None:
            k_cache[b, :, start : start + l_new] = k_new[b]
            v_cache[b, :, start : start + l_new] = v_new[b]
    num_keys = cache_seqlens.to(torch.int64) + l_new  # (B,)
    rows = torch.arange(lq, device=q.device).reshape(1, lq, 1)
    cols = torch.arange(l_max, device=q.device).reshape(1, 1, l_max)
    last_visible = num_keys.reshape(batch, 1, 1) - lq + rows  # (B, Lq, 1)
    allowed = cols <= last_visible  # (B, Lq, L_max)
    allowed = allowed.unsqueeze(1)  # (B, 1, Lq, L_max)
    # Slots past a row's valid keys are not part of its cache: they may hold anything (a cache
    # from torch.empty), so their values are dropped, not just weighted 0 (0 * NaN = NaN).
    in_cache = (cols < num_keys.reshape(batch, 1, 1)).reshape(batch, 1, l_max, 1)
    v_cache = v_cache.masked_fill(~in_cache, 0.0)
    return scaled_dot_product_attention(
        q, k_cache, v_cache, allowed, scale=scale, enable_gqa=heads != kv_heads
    )


# --------------------------------------------------------------------------------------------
# The oracle (DESIGN section 6)

ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
TF32_ATOL = ATOL[torch.bfloat16]


@contextlib.contextmanager
def poisoned_outputs():
    """Every torch.empty (Python or C++ at::empty) is NaN-filled while active, so a kernel
    that leaves part of its output unwritten fails the oracle instead of passing by luck."""
    from torch.utils import deterministic

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in float64; a NaN/Inf that the reference does not have counts as inf."""
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64)
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return 0.0
    same_nonfinite = (out64.isnan() & ref64.isnan()) | (out64 == ref64)
    diff = (out64 - ref64).abs()
    diff = torch.where(same_nonfinite, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf"))
    return float(diff.max())


@dataclasses.dataclass
class OracleResult:
    name: str  # "out", "out[1]", "grad x", ...
    error: float  # max |kernel - ref64|
    bound: float  # 2 * max |ref_lp - ref64| + atol
    ok: bool


def oracle_compare(name, out, ref_lp, ref64, dtype, atol=None) -> OracleResult:
    atol = ATOL[dtype] if atol is None else atol
    error = max_abs_error(out, ref64)
    bound = 2.0 * max_abs_error(ref_lp, ref64) + atol
    return OracleResult(name, error, bound, error <= bound)


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def copy_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with ``t``'s strides, so that the kernel under test sees the caller's
    layout: ``clone()`` keeps a dense layout (transposed, permuted) but makes a sliced view
    contiguous and materialises an expanded (stride-0) one.

    The gaps between a sliced view's rows hold a huge finite value (a quarter of the dtype's
    max), as they hold another tensor's data in a caller's buffer: a kernel that used them would
    be far off, while one that only reads them into a product with zero padding is unaffected.
    Not NaN (what ``poisoned_outputs`` would leave there): torch's own oneDNN bf16 / fp16 GEMMs
    on CPUs with AMX read a row's gap elements into tiles whose other operand is zero-padded, so
    a NaN there makes even ``F.linear``'s result NaN (benchmarks/NOTES.md, "Sliced inputs' gaps
    and AMX GEMMs")."""
    if t.numel() == 0 or t.is_contiguous():
        return t.clone()
    core = t
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.size(d) > 1:
            core = core.narrow(d, 0, 1)  # the broadcast dim is expanded again below
    span = 1 + sum((n - 1) * s for n, s in zip(core.shape, core.stride()))
    copy = core.new_empty(span)
    if copy.is_floating_point():
        copy.fill_(torch.finfo(copy.dtype).max / 4)
    copy = copy.as_strided(core.shape, core.stride())
    try:
        copy.copy_(core)
    except RuntimeError:  # self-overlapping strides other than broadcasts: a dense copy
        return t.clone()
    return copy.expand(t.shape)


def run_oracle(
    kernel_fn: Callable[..., object],
    reference_fn: Callable[..., object],
    inputs: Mapping[str, object],
    grad_names: Sequence[str] = (),
    atol: float | None = None,
    seed: int | None = None,
) -> list[OracleResult]:
    """Check ``kernel_fn(**inputs)`` against ``reference_fn`` run in the inputs' dtype and in
    float64, for every output and for the gradients of ``grad_names`` under a random upstream
    gradient.  Tensor inputs are floating point in one dtype (the kernel's); other values
    (masks, ints, flags) are passed unchanged to all three runs."""
    float_inputs = {
        k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    dtype = next(iter(float_inputs.values())).dtype

    def prepared(cast):
        prepared_inputs, leaves = {}, {}
        for k, v in inputs.items():
            if k in float_inputs:
                t = cast(v.detach())
                if k in grad_names:
                    t.requires_grad_(True)
                    leaves[k] = t
                prepared_inputs[k] = t
            else:
                prepared_inputs[k] = v
        return prepared_inputs, leaves

    def run(fn, cast, grads_out=None):
        args, leaves = prepared(cast)
        outs = _as_tuple(fn(**args))
        grads = {}
        if leaves:
            diff_outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            upstream = [g.to(o.dtype) for g, o in zip(grads_out, diff_outs)]
            computed = torch.autograd.grad(diff_outs, list(leaves.values()), upstream, allow_unused=True)
            grads = {k: (g if g is not None else torch.zeros_like(leaves[k])) for k, g in zip(leaves, computed)}
        return outs, grads

    # Upstream gradients: random draws shaped like the differentiable outputs, from ``seed`` or
    # else from torch's global generator (so torch.manual_seed replays a check, as it does the
    # inputs drawn with it).
    with torch.no_grad():
        probe = _as_tuple(reference_fn(**prepared(lambda t: t.to(torch.float64))[0]))
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Drawn representable in the kernel's dtype, as the inputs are: the float64 run then sees
    # the upstream gradient the kernel sees (not a value the kernel and the low-precision
    # reference both round first, whose shared rounding the reference could land closer to
    # float64 by chance: benchmarks/NOTES.md "The oracle's flakes in 16-bit").
    grads_out = [
        torch.randn(o.shape, generator=generator, dtype=torch.float64).to(dtype).to(torch.float64).to(o.device)
        for o in probe
        if isinstance(o, torch.Tensor) and o.is_floating_point()
    ]

    ref64_out, ref64_grads = run(reference_fn, lambda t: t.to(torch.float64), grads_out)
    reflp_out, reflp_grads = run(reference_fn, lambda t: t.clone(), grads_out)
    with poisoned_outputs():
        out, grads = run(kernel_fn, copy_keeping_layout, grads_out)

    results = []
    if len(out) != len(ref64_out):
        raise AssertionError(f"kernel returned {len(out)} outputs, reference {len(ref64_out)}")
    for i, (o, r_lp, r64) in enumerate(zip(out, reflp_out, ref64_out)):
        if isinstance(o, torch.Tensor):
            name = "out" if len(out) == 1 else f"out[{i}]"
            results.append(oracle_compare(name, o, r_lp, r64, dtype, atol))
    for k in grads:
        results.append(oracle_compare(f"grad {k}", grads[k], reflp_grads[k], ref64_grads[k], dtype, atol))
    return results


def assert_oracle(results: Sequence[OracleResult], context: str = "") -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        lines = ", ".join(f"{r.name}: err {r.error:.3e} > bound {r.bound:.3e}" for r in bad)
        raise AssertionError(f"oracle failed{' (' + context + ')' if context else ''}: {lines}")
