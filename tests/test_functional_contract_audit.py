"""Contract audit of transformer_fast.functional and backend selection (DESIGN sections 3, 4, 6,
9) and of scaled_dot_product_attention as a drop-in for torch.nn.functional's (torch 2.14).

Only what the other functional tests do not already cover: the fused backends ("cpu", and
"triton" through its interpreter at tiny shapes) on the drop-in forms of SDPA, mask broadcast
forms of every rank, extra leading dims, scale <= 0, stride-0 inputs, float masks that require
grad, dropout outside grad mode, dtype routing, KV-cache corner cases, add_layer_norm parameter
dtypes, feed_forward weight layouts, and the selection precedence corner cases.

The seven discrepancies the audit found (causal SDPA with scale <= 0 on torch's CPU kernel, 0-d
and 1-D masks on the torch backend, the reference's dtype with float32 LayerNorm parameters, mixed
parameter dtypes on the torch backend, strided FFN biases in Triton, errors not catchable as
RuntimeError, NumPy / tensor scalars) are fixed; their tests stay.
"""
from __future__ import annotations

import contextlib
import os
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import transformer_fast as tf
from transformer_fast import backends, reference
from transformer_fast import functional as F

from conftest import backend_params, require_backend

# "auto" on CPU tensors: what a user gets by default.
ALL = ["reference", "torch", "auto", *backend_params("cpu", "triton")]
FUSED = backend_params("cpu", "triton")
NOT_TORCH = ["reference", *backend_params("cpu", "triton")]
SDPA = "scaled_dot_product_attention"


def _ready(backend):
    """Skip a backend that cannot run here; the device its tensors live on."""
    if backend in ("reference", "torch", "auto"):
        return "cpu"
    return require_backend(backend)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype=torch.float32):
    return torch.randn(tuple(shape), generator=g).to(dtype)


def _close(got, expected, atol=2e-5, rtol=1e-4):
    assert got.shape == expected.shape, (tuple(got.shape), tuple(expected.shape))
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def _bool_mask(shape, g):
    """attn_mask polarity; key 0 always takes part so no row is dead (rows torch may treat
    differently per path; the contract for dead rows is tested elsewhere)."""
    if len(shape) == 0:
        return torch.tensor(True)
    m = torch.rand(shape, generator=g) < 0.7
    m[..., 0] = True
    return m


# ============================================================================================
# scaled_dot_product_attention: drop-in parity with torch.nn.functional
# ============================================================================================

B, H, L, S, D = 2, 3, 5, 7, 16

# (query shape, key shape, mask shape or None, enable_gqa)
PARITY_CASES = {
    "5d": ((2, B, H, L, D), (2, B, H, S, D), None, False),
    "5d-mask-LS": ((2, B, H, L, D), (2, B, H, S, D), (L, S), False),
    "5d-mask-BHLS": ((2, B, H, L, D), (2, B, H, S, D), (B, 1, L, S), False),
    "5d-mask-A1111S": ((2, B, H, L, D), (2, B, H, S, D), (2, 1, 1, 1, S), False),
    "6d": ((1, 2, B, H, L, D), (1, 2, B, H, S, D), (H, L, S), False),
    "5d-gqa": ((2, B, 4, L, D), (2, B, 2, S, D), (1, 4, 1, S), True),
    "4d-LS": ((B, H, L, D), (B, H, S, D), (L, S), False),
    "4d-11LS": ((B, H, L, D), (B, H, S, D), (1, 1, L, S), False),
    "4d-B11S": ((B, H, L, D), (B, H, S, D), (B, 1, 1, S), False),
    "4d-1HLS": ((B, H, L, D), (B, H, S, D), (1, H, L, S), False),
    "4d-1S": ((B, H, L, D), (B, H, S, D), (1, S), False),
    "4d-H1S": ((B, H, L, D), (B, H, S, D), (H, 1, S), False),
    "4d-L1": ((B, H, L, D), (B, H, S, D), (L, 1), False),
    "4d-1111": ((B, H, L, D), (B, H, S, D), (1, 1, 1, 1), False),
    "4d-BHLS": ((B, H, L, D), (B, H, S, D), (B, H, L, S), False),
    # A 3-D mask right-aligns with (heads, L, S), not (batch, L, S), as torch broadcasting does.
    "4d-HLS-aligns-with-heads": ((B, H, L, D), (B, H, S, D), (H, L, S), False),
    "3d-BLS": ((B, L, D), (B, S, D), (B, L, S), False),
    "3d-1LS": ((B, L, D), (B, S, D), (1, L, S), False),
    "3d-B1S": ((B, L, D), (B, S, D), (B, 1, S), False),
    "3d-LS": ((B, L, D), (B, S, D), (L, S), False),
    "3d-S": ((B, L, D), (B, S, D), (S,), False),
    "3d-scalar": ((B, L, D), (B, S, D), (), False),
}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_sdpa_ranks_and_mask_broadcast_match_torch(backend, kind, case):
    device = _ready(backend)
    qs, ks, ms, gqa = PARITY_CASES[case]
    if ms is None and kind == "float":
        pytest.skip("no mask")
    g = _gen(zlib.crc32(f"{case}-{kind}".encode()))
    q, k, v = _randn(*qs, g=g), _randn(*ks, g=g), _randn(*ks, g=g)
    mask = None
    if ms is not None:
        mask = _bool_mask(ms, g) if kind == "bool" else _randn(*ms, g=g)
    expected = TF.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = F.scaled_dot_product_attention(to(q), to(k), to(v), to(mask), enable_gqa=gqa, backend=backend)
    _close(got.cpu(), expected)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("lq,lk", [(3, 8), (8, 3), (1, 5), (5, 1)])
def test_sdpa_causal_is_top_left_when_lengths_differ(backend, lq, lk):
    device = _ready(backend)
    g = _gen(lq * 10 + lk)
    q, k, v = _randn(1, 2, lq, D, g=g), _randn(1, 2, lk, D, g=g), _randn(1, 2, lk, D, g=g)
    expected = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), is_causal=True, backend=backend)
    _close(got.cpu(), expected)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("scale", [0.0, -1.0, 1e-3, 3.0])
def test_sdpa_any_scale_without_causal_matches_torch(backend, scale):
    device = _ready(backend)
    g = _gen(7)
    q, k, v = _randn(2, 2, 4, D, g=g), _randn(2, 2, 6, D, g=g), _randn(2, 2, 6, D, g=g)
    expected = TF.scaled_dot_product_attention(q, k, v, scale=scale)
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), scale=scale, backend=backend)
    _close(got.cpu(), expected)



@pytest.mark.parametrize(
    "backend",
    [*NOT_TORCH, "torch", "auto"],
)
@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_sdpa_causal_with_nonpositive_scale_is_finite(backend, scale):
    """DESIGN 3/6/9: every backend agrees with the oracle; no input returns garbage silently.
    is_causal=True must equal the explicit top-left causal bool mask for any finite scale."""
    device = _ready(backend)
    g = _gen(11)
    q, k, v = _randn(1, 2, 4, D, g=g), _randn(1, 2, 6, D, g=g), _randn(1, 2, 6, D, g=g)
    causal = torch.ones(4, 6, dtype=torch.bool).tril()
    expected = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(), causal, scale=scale)
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), is_causal=True, scale=scale,
                                         backend=backend)
    assert not got.isnan().any(), "NaN output"
    _close(got.cpu().double(), expected, atol=1e-5)



@pytest.mark.parametrize(
    "backend",
    [*NOT_TORCH, "torch", "auto"],
)
@pytest.mark.parametrize("mask_shape", [(S,), ()], ids=["S", "scalar"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_low_rank_mask_on_4d_inputs(backend, mask_shape, kind):
    device = _ready(backend)
    g = _gen(13)
    q, k, v = _randn(B, H, L, D, g=g), _randn(B, H, S, D, g=g), _randn(B, H, S, D, g=g)
    mask = _bool_mask(mask_shape, g) if kind == "bool" else _randn(*mask_shape, g=g)
    # torch itself takes these masks for 3-D and 5-D inputs; as (1, S) / (1, 1) for 4-D.
    expected = TF.scaled_dot_product_attention(q, k, v, mask.reshape(1, -1) if mask.dim() else mask.reshape(1, 1))
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), mask.to(device), backend=backend)
    _close(got.cpu(), expected)


@pytest.mark.parametrize("backend", ALL)
def test_sdpa_non_contiguous_and_expanded_inputs(backend):
    """Transposed head-dim strides, stride-0 (expanded) batch/head dims and an expanded mask."""
    device = _ready(backend)
    g = _gen(17)
    q = _randn(1, 1, L, D, g=g).expand(B, H, L, D)
    k = _randn(B, H, D, S, g=g).transpose(-1, -2)  # last-dim stride != 1
    v = _randn(B, 1, S, D, g=g).expand(B, H, S, D)
    mask = _bool_mask((1, 1, L, S), g).expand(B, H, L, S)
    expected = TF.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous())
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), mask.to(device), backend=backend)
    _close(got.cpu(), expected)


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
@pytest.mark.parametrize("mask_shape", [(L, S), (B, 1, L, S), (1, H, 1, S)], ids=str)
def test_sdpa_float_mask_gradient_matches_torch(backend, mask_shape):
    """A float attn_mask that requires grad gets torch's gradient (float64: exact-ish)."""
    g = _gen(19)
    ins = [_randn(B, H, L, D, g=g), _randn(B, H, S, D, g=g), _randn(B, H, S, D, g=g), _randn(*mask_shape, g=g)]
    ins = [t.double() for t in ins]
    upstream = _randn(B, H, L, D, g=g).double()

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in ins]
        out = fn(*leaves)
        out.backward(upstream)
        return [out] + [t.grad for t in leaves]

    expected = run(lambda q, k, v, m: TF.scaled_dot_product_attention(q, k, v, m))
    got = run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m, backend=backend))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_sdpa_float_mask_requiring_grad_routes_away_from_cpu():
    """The cpu kernels have no mask gradient: explicit cpu says so; without grad mode it runs;
    auto picks torch."""
    require_backend("cpu")
    g = _gen(23)
    q, k, v = _randn(B, H, L, D, g=g), _randn(B, H, S, D, g=g), _randn(B, H, S, D, g=g)
    mask = _randn(L, S, g=g).requires_grad_()
    with pytest.raises(tf.BackendError, match="gradient of a float attn_mask.*Backends that can: reference, torch"):
        F.scaled_dot_product_attention(q, k, v, mask, backend="cpu")
    inputs = {"query": q, "key": k, "value": v, "attn_mask": mask, "key_padding_mask": None}
    assert backends.resolve(SDPA, None, inputs) == "torch"
    with torch.no_grad():
        got = F.scaled_dot_product_attention(q, k, v, mask, backend="cpu")
        _close(got, TF.scaled_dot_product_attention(q, k, v, mask))


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_sdpa_value_head_dim_differs_5d_with_mask(backend):
    g = _gen(29)
    q, k, v = _randn(2, B, H, L, D, g=g), _randn(2, B, H, S, D, g=g), _randn(2, B, H, S, 24, g=g)
    mask = _randn(B, 1, L, S, g=g)
    _close(F.scaled_dot_product_attention(q, k, v, mask, backend=backend),
           TF.scaled_dot_product_attention(q, k, v, mask))


@pytest.mark.parametrize("backend", FUSED)
def test_sdpa_fused_backends_refuse_value_head_dim_with_reasons(backend):
    device = _ready(backend)
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, S, D), torch.randn(B, H, S, 24)
    q, k, v = q.to(device), k.to(device), v.to(device)
    with pytest.raises(tf.BackendError, match=r"value's head dim.*24 != 16.*Backends that can: reference, torch"):
        F.scaled_dot_product_attention(q, k, v, backend=backend)
    reasons = tf.not_supported_reasons(backend, SDPA, {"query": q, "key": k, "value": v})
    assert any("value's head dim" in r for r in reasons)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("shape_q,shape_k", [((0, 2, 3, D), (0, 2, 4, D)), ((2, 0, 2, 3, D), (2, 0, 2, 4, D)),
                                             ((2, 2, 0, D), (2, 2, 4, D)), ((2, 1, 2, 0, D), (2, 1, 2, 4, D))],
                         ids=["B0", "5d-B0", "L0", "5d-L0"])
def test_sdpa_empty_shapes_match_torch(backend, shape_q, shape_k):
    device = _ready(backend)
    q, k, v = torch.randn(shape_q), torch.randn(shape_k), torch.randn(shape_k)
    mask = torch.ones(shape_q[-2], shape_k[-2], dtype=torch.bool)
    expected = TF.scaled_dot_product_attention(q, k, v, mask)
    got = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), mask.to(device), backend=backend)
    _close(got.cpu(), expected)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("shape", [(0, 2, 3, 5), (1, 2, 2, 0, 5), (1, 2, 2, 5, 0), (2, 1, 0, 3, 4, 5)],
                         ids=["B0", "5d-Lq0", "5d-Lk0", "6d-H0"])
def test_masked_softmax_empty_shapes_match_torch(backend, shape):
    """Zero-size scores of any rank (5-D with a 0 among the last three dims crashed the fused
    path's reshape to 4-D, found by a differential fuzz against torch)."""
    device = _ready(backend)
    scores = torch.randn(shape)
    got = F.masked_softmax(scores.to(device), backend=backend)
    _close(got.cpu(), torch.softmax(scores, dim=-1))


def test_sdpa_no_keys_with_value_head_dim_gives_zeros():
    q, k, v = torch.randn(2, 2, 3, D), torch.randn(2, 2, 0, D), torch.randn(2, 2, 0, 24)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 2, 3, 24) and not out.any()


# ---- dropout: applied whenever dropout_p > 0, also outside grad mode (like torch's function)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_sdpa_dropout_applies_outside_grad_mode_and_follows_manual_seed(backend, mode):
    device = _ready(backend)
    g = _gen(31)
    q, k, v = (_randn(1, 2, 8, D, g=g).to(device) for _ in range(3))
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        plain = F.scaled_dot_product_attention(q, k, v, backend=backend)
        torch.manual_seed(5)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
        torch.manual_seed(5)
        b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
        c = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    assert not torch.allclose(a, plain, atol=1e-4), "dropout_p > 0 must drop outside grad mode too"
    assert torch.equal(a, b), "torch.manual_seed must make dropout reproducible"
    assert not torch.equal(a, c)


@pytest.mark.parametrize("backend", ["reference", "torch", *backend_params("cpu")])
@pytest.mark.parametrize("op", ["add_layer_norm", "masked_softmax", "feed_forward"])
def test_other_ops_dropout_applies_under_no_grad(backend, op):
    _ready(backend)
    g = _gen(37)
    x = _randn(6, 32, g=g)
    w1, w2 = _randn(16, 32, g=g), _randn(32, 16, g=g)
    call = {
        "add_layer_norm": lambda p: F.add_layer_norm(x, x, None, None, dropout_p=p, backend=backend),
        "masked_softmax": lambda p: F.masked_softmax(x, dropout_p=p, backend=backend),
        "feed_forward": lambda p: F.feed_forward(x, w1, None, w2, None, dropout_p=p, backend=backend),
    }[op]
    with torch.no_grad():
        assert not torch.allclose(call(0.5), call(0.0))


# ---- dtype routing: what auto chooses, what explicit backends say


def _op_inputs(op, dtype):
    g = _gen(41)
    t = lambda *s: _randn(*s, g=g, dtype=dtype)  # noqa: E731
    q = t(2, 2, 3, D)
    return {
        SDPA: {"query": q, "key": t(2, 2, 5, D), "value": t(2, 2, 5, D), "attn_mask": None, "key_padding_mask": None},
        "attention_with_kv_cache": {"q": q, "k_cache": t(2, 2, 8, D), "v_cache": t(2, 2, 8, D),
                                    "cache_seqlens": torch.tensor([1, 2], dtype=torch.int32),
                                    "k_new": t(2, 2, 3, D), "v_new": t(2, 2, 3, D)},
        "masked_softmax": {"scores": q, "mask": None},
        "add_layer_norm": {"x": q, "residual": t(2, 2, 3, D), "weight": None, "bias": None},
        "feed_forward": {"x": q, "w1": t(8, D), "b1": None, "w2": t(D, 8), "b2": None},
        "linear_bias_act": {"x": q, "w": t(8, D), "b": None},
    }[op]


_CALL = {
    SDPA: lambda i, b: F.scaled_dot_product_attention(i["query"], i["key"], i["value"], backend=b),
    "attention_with_kv_cache": lambda i, b: F.attention_with_kv_cache(
        i["q"], i["k_cache"].clone(), i["v_cache"].clone(), i["cache_seqlens"], i["k_new"], i["v_new"], backend=b),
    "masked_softmax": lambda i, b: F.masked_softmax(i["scores"], backend=b),
    "add_layer_norm": lambda i, b: F.add_layer_norm(i["x"], i["residual"], None, None, backend=b),
    "feed_forward": lambda i, b: F.feed_forward(i["x"], i["w1"], None, i["w2"], None, backend=b),
    "linear_bias_act": lambda i, b: F.linear_bias_act(i["x"], i["w"], backend=b),
}


@pytest.mark.parametrize("op", list(_CALL))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_auto_never_picks_reference_and_keeps_dtype(op, dtype):
    inputs = _op_inputs(op, dtype)
    chosen = backends.resolve(op, "auto", inputs)
    assert chosen != "reference"
    if dtype == torch.float64:
        assert chosen == "torch"  # the fused kernels take fp16/bf16/fp32
    out = _CALL[op](inputs, None)
    assert out.dtype == dtype


@pytest.mark.parametrize("op", list(_CALL))
def test_explicit_cpu_refuses_float64_with_reasons(op):
    require_backend("cpu")
    inputs = _op_inputs(op, torch.float64)
    reasons = tf.not_supported_reasons("cpu", op, inputs)
    assert reasons and any("float64" in r for r in reasons)
    with pytest.raises(tf.BackendError, match=r"backend 'cpu' cannot run.*float64.*Backends that can: reference, torch") as info:
        _CALL[op](inputs, "cpu")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sdpa_half_precision_keeps_dtype_and_meets_oracle(backend, dtype):
    device = _ready(backend)
    g = _gen(43)
    q, k, v = (_randn(2, 2, 5, D, g=g, dtype=dtype) for _ in range(3))
    mask = _randn(5, 5, g=g)  # a float32 mask with half inputs is allowed (an extension over torch)

    def kernel(query, key, value):
        return F.scaled_dot_product_attention(query.to(device), key.to(device), value.to(device), mask.to(device),
                                              backend=backend).cpu()

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(query, key, value, mask.to(query.dtype))

    atol = 10 * reference.ATOL[dtype] if backend in ("torch", "auto") else None  # torch as a peer
    results = reference.run_oracle(kernel, ref, {"query": q, "key": k, "value": v}, atol=atol)
    reference.assert_oracle(results, f"{backend} {dtype}")
    assert kernel(q, k, v).dtype == dtype


# ---- errors: DESIGN 9 types and argument names; deliberate differences from torch


@pytest.mark.parametrize("overrides,needle", [
    # a batch that does not broadcast (torch raises too); DESIGN 9: a ValueError naming it
    (dict(key=torch.randn(B + 1, H, S, D), value=torch.randn(B + 1, H, S, D)), "key must have query's batch"),
    (dict(value=torch.randn(B, H, S - 1, D)), "value must have key's sequence length"),
    (dict(value=torch.randn(B, 1, S, D), key=torch.randn(B, 2, S, D), enable_gqa=True),
     "value must have key's number of heads"),
], ids=["key-batch", "value-length", "value-heads"])
def test_sdpa_shape_errors_name_the_argument(overrides, needle):
    kwargs = dict(query=torch.randn(B, H, L, D), key=torch.randn(B, H, S, D), value=torch.randn(B, H, S, D))
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=needle):
        F.scaled_dot_product_attention(**kwargs)


@pytest.mark.parametrize("backend", ["reference", "torch", *backend_params("cpu", "triton", "cuda")])
@pytest.mark.parametrize("q_shape,kv_shape,gqa", [
    ((2, 3, 5, 16), (1, 3, 6, 16), False),   # a size-1 batch: k, v shared across it
    ((2, 3, 5, 16), (2, 1, 6, 16), False),   # one head broadcast (no enable_gqa)
    ((2, 3, 5, 16), (3, 6, 16), False),      # a lower-rank key / value
    ((4, 5, 16), (1, 6, 16), False),         # 3-D inputs
    ((1, 4, 5, 16), (2, 2, 6, 16), True),    # query's batch broadcast, heads grouped
], ids=["batch-1", "heads-1", "rank-3", "3d", "gqa-query-batch-1"])
def test_sdpa_broadcasts_batch_dims_like_torch(backend, q_shape, kv_shape, gqa):
    """torch's SDPA broadcasts every dim but (L, D) (the heads group instead under enable_gqa);
    ours expands the views to one shape, and autograd sums the gradients back."""
    device = require_backend(backend)
    q = torch.randn(q_shape, device=device, requires_grad=True)
    k, v = (torch.randn(kv_shape, device=device, requires_grad=True) for _ in range(2))
    upstream = None
    results = []
    for fn in (lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, enable_gqa=gqa),
               lambda *a: F.scaled_dot_product_attention(*a, enable_gqa=gqa, backend=backend)):
        out = fn(q, k, v)
        upstream = torch.randn_like(out) if upstream is None else upstream
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    for theirs, ours in zip(*results):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


_RUNTIME_CASES = {
    "heads-mismatch": dict(key=torch.randn(B, 2, S, D), value=torch.randn(B, 2, S, D)),
    "gqa-not-dividing": dict(query=torch.randn(B, 4, L, D), key=torch.randn(B, 3, S, D),
                             value=torch.randn(B, 3, S, D), enable_gqa=True),
    "dtype-mix": dict(key=torch.randn(B, H, S, D, dtype=torch.float64)),
    "int-mask": dict(attn_mask=torch.ones(L, S, dtype=torch.int32)),
    "head-dim-mismatch": dict(key=torch.randn(B, H, S, 8)),
    "mask-shape": dict(attn_mask=torch.ones(L, S - 1, dtype=torch.bool)),
}


@pytest.mark.parametrize("case", list(_RUNTIME_CASES))
def test_sdpa_errors_are_design9_types(case):
    kwargs = dict(query=torch.randn(B, H, L, D), key=torch.randn(B, H, S, D), value=torch.randn(B, H, S, D))
    kwargs.update(_RUNTIME_CASES[case])
    with pytest.raises(RuntimeError):
        TF.scaled_dot_product_attention(**kwargs)  # torch's own type for the same input
    with pytest.raises((ValueError, TypeError)):
        F.scaled_dot_product_attention(**kwargs)


@pytest.mark.parametrize("case", list(_RUNTIME_CASES))
def test_sdpa_errors_catchable_as_torch_runtime_error(case):
    kwargs = dict(query=torch.randn(B, H, L, D), key=torch.randn(B, H, S, D), value=torch.randn(B, H, S, D))
    kwargs.update(_RUNTIME_CASES[case])
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(scale=np.float32(0.25)), dict(scale=torch.tensor(0.25)),
                                    dict(dropout_p=np.float32(0.0))], ids=["scale-np32", "scale-0d-tensor", "dropout-np32"])
def test_sdpa_accepts_the_scalars_torch_accepts(kwargs):
    g = _gen(47)
    q, k, v = _randn(1, 2, 3, D, g=g), _randn(1, 2, 4, D, g=g), _randn(1, 2, 4, D, g=g)
    expected = TF.scaled_dot_product_attention(q, k, v, **kwargs)
    _close(F.scaled_dot_product_attention(q, k, v, **kwargs), expected)


# ============================================================================================
# attention_with_kv_cache
# ============================================================================================


def _kv_case(g, b=3, h=4, hkv=2, lq=2, l_max=10, d=D, dv=D, dtype=torch.float32):
    return (_randn(b, h, lq, d, g=g, dtype=dtype), _randn(b, hkv, l_max, d, g=g, dtype=dtype),
            _randn(b, hkv, l_max, dv, g=g, dtype=dtype), _randn(b, hkv, lq, d, g=g, dtype=dtype),
            _randn(b, hkv, lq, dv, g=g, dtype=dtype))


KV_VARIANTS = ["strided-seqlens", "expanded-seqlens", "expanded-k_new", "scale-0", "scale-negative", "mqa", "dv-24"]


@pytest.mark.parametrize("backend", ["torch", "auto", *backend_params("cpu", "triton")])
@pytest.mark.parametrize("variant", KV_VARIANTS)
def test_kv_cache_corner_cases_match_reference_and_write_in_place(backend, variant):
    device = _ready(backend)
    g = _gen(53)
    hkv = 1 if variant == "mqa" else 2
    dv = 24 if variant == "dv-24" else D
    q, kc, vc, kn, vn = _kv_case(g, hkv=hkv, dv=dv)
    seqlens = torch.tensor([1, 0, 5, 0, 8, 0], dtype=torch.int32)[::2]
    if variant == "expanded-seqlens":
        seqlens = torch.tensor([4], dtype=torch.int32).expand(3)
    if variant == "expanded-k_new":
        kn = kn[:1].expand_as(kn)
    scale = {"scale-0": 0.0, "scale-negative": -0.7}.get(variant)
    if backend == "triton" and variant == "dv-24":
        pytest.skip("triton needs Dv == D (reported by not_supported_reasons)")
    kr, vr = kc.clone(), vc.clone()
    expected = reference.attention_with_kv_cache(q, kr, vr, seqlens.contiguous(), kn.contiguous(), vn, scale)
    seqlens_before = seqlens.clone()
    kd, vd = kc.to(device), vc.to(device)
    got = F.attention_with_kv_cache(q.to(device), kd, vd, seqlens.to(device), kn.to(device), vn.to(device),
                                    scale=scale, backend=backend)
    _close(got.cpu(), expected)
    assert torch.equal(kd.cpu(), kr) and torch.equal(vd.cpu(), vr), "caches written in place as the reference"
    assert torch.equal(seqlens, seqlens_before), "cache_seqlens is the caller's to advance"


@pytest.mark.parametrize("backend", ["reference", "torch", "auto", *backend_params("cpu")])
@pytest.mark.parametrize("shape", ["B0", "L0"])
def test_kv_cache_empty(backend, shape):
    _ready(backend)
    g = _gen(59)
    b, lq = (0, 1) if shape == "B0" else (2, 0)
    q, kc, vc, kn, vn = _kv_case(g, b=b, lq=lq)
    seqlens = torch.arange(b, dtype=torch.int32) + 2
    kr = kc.clone()
    out = F.attention_with_kv_cache(q, kc, vc, seqlens, kn, vn, backend=backend)
    assert out.shape == q.shape
    assert torch.equal(kc, kr)


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_kv_cache_float64_gqa_prefill_equals_sdpa(backend):
    """float64 (auto -> torch): a prompt of 5 into rows already holding 0 and 3 tokens equals
    torch SDPA over the row's prefix + new keys with bottom-right causal alignment."""
    g = _gen(61)
    q, kc, vc, kn, vn = (t.double() for t in _kv_case(g, b=2, h=4, hkv=1, lq=5, l_max=9))
    prefix_k, prefix_v = kc.clone(), vc.clone()
    seq = [0, 3]
    out = F.attention_with_kv_cache(q, kc, vc, torch.tensor(seq, dtype=torch.int32), kn, vn, backend=backend)
    for b, s in enumerate(seq):
        keys = torch.cat([prefix_k[b:b + 1, :, :s], kn[b:b + 1]], 2)
        vals = torch.cat([prefix_v[b:b + 1, :, :s], vn[b:b + 1]], 2)
        allowed = torch.ones(5, s + 5, dtype=torch.bool).tril(diagonal=s)
        torch.testing.assert_close(out[b:b + 1], TF.scaled_dot_product_attention(q[b:b + 1], keys, vals, allowed,
                                                                                 enable_gqa=True))


# ============================================================================================
# masked_softmax
# ============================================================================================


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mask_shape", [(), (7,), (5, 1), (3, 1, 7), (2, 1, 1, 7), (1, 1, 1, 1)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_softmax_broadcast_mask_forms(backend, mask_shape, kind):
    device = _ready(backend)
    g = _gen(67)
    scores = _randn(2, 3, 5, 7, g=g)
    mask = (torch.rand(mask_shape, generator=g) < 0.7) if kind == "bool" else _randn(*mask_shape, g=g)
    if kind == "float" and mask.dim() == 2:
        mask[1] = float("-inf")  # a fully removed row -> zeros
    if kind == "bool" and mask.dim() == 1:
        mask[:] = False  # every row fully masked -> zeros
    expected = reference.masked_softmax(scores.double(), mask if kind == "bool" else mask.double(), 0.5, True)
    got = F.masked_softmax(scores.to(device), mask.to(device), scale=0.5, is_causal=True, backend=backend)
    assert not got.isnan().any()
    _close(got.cpu().double(), expected, atol=1e-6)


@pytest.mark.parametrize("backend", ALL)
def test_masked_softmax_non_contiguous_and_expanded(backend):
    device = _ready(backend)
    g = _gen(71)
    scores = _randn(2, 3, 7, 5, g=g).transpose(-1, -2)
    mask = (torch.rand(7, 5, generator=g) < 0.7).t()
    bias = _randn(1, 1, 5, 7, g=g).expand(2, 3, 5, 7)
    for m in (mask, bias):
        expected = reference.masked_softmax(scores.double(), m if m.dtype == torch.bool else m.double())
        got = F.masked_softmax(scores.to(device), m.to(device), backend=backend)
        _close(got.cpu().double(), expected, atol=1e-6)


# ============================================================================================
# add_layer_norm
# ============================================================================================


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 0.5, 3])
def test_add_layer_norm_matches_torch_layer_norm(backend, affine, prenorm, eps):
    device = _ready(backend)
    g = _gen(73)
    n = 33
    x, r = _randn(3, 4, n, g=g), _randn(3, 4, n, g=g)
    w = _randn(n, g=g) if affine in ("both", "weight") else None
    b = _randn(n, g=g) if affine in ("both", "bias") else None
    d = lambda t: None if t is None else t.double()  # noqa: E731
    summed = d(r) + d(x)
    expected = TF.layer_norm(summed, (n,), d(w), d(b), eps)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = F.add_layer_norm(to(x), to(r), to(w), to(b), eps, prenorm=prenorm, backend=backend)
    if prenorm:
        out, s = out
        _close(s.cpu().double(), summed, atol=1e-6)
        assert s.dtype == x.dtype
    _close(out.cpu().double(), expected, atol=1e-5)



@pytest.mark.parametrize("backend", ["reference", "torch", "auto",
                                     *backend_params("cpu", "triton")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("params", ["weight+bias", "weight", "bias"])
def test_add_layer_norm_half_input_float32_params_keep_x_dtype(backend, dtype, params):
    device = _ready(backend)
    g = _gen(79)
    x, r = _randn(4, 32, g=g, dtype=dtype).to(device), _randn(4, 32, g=g, dtype=dtype).to(device)
    w = _randn(32, g=g).to(device) if "weight" in params else None
    b = _randn(32, g=g).to(device) if "bias" in params else None
    y, s = F.add_layer_norm(x, r, w, b, prenorm=True, backend=backend)
    assert s.dtype == dtype
    assert y.dtype == dtype, f"{backend} returned {y.dtype} for {dtype} x"



@pytest.mark.parametrize(
    "backend",
    ["reference", "torch", "auto"],
)
@pytest.mark.parametrize(
    "x_dtype,w_dtype,b_dtype",
    [(torch.float64, torch.float32, torch.float32), (torch.float64, torch.float32, None),
     (torch.float16, torch.float16, torch.float32), (torch.float16, torch.float32, torch.float16)],
    ids=["f64-f32-f32", "f64-f32-none", "f16-f16-f32", "f16-f32-f16"],
)
def test_add_layer_norm_accepted_param_dtypes_run(backend, x_dtype, w_dtype, b_dtype):
    if backend == "auto" and x_dtype != torch.float64:
        pytest.skip("auto picks the cpu backend for half inputs, which handles the mix")
    g = _gen(83)
    x, r = _randn(4, 32, g=g, dtype=x_dtype), _randn(4, 32, g=g, dtype=x_dtype)
    w = _randn(32, g=g, dtype=w_dtype)
    b = None if b_dtype is None else _randn(32, g=g, dtype=b_dtype)
    y = F.add_layer_norm(x, r, w, b, backend=backend)
    expected = TF.layer_norm((r.double() + x.double()), (32,), w.double(), None if b is None else b.double())
    tol = 1e-10 if x_dtype == torch.float64 else 5e-3
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=tol)


# ============================================================================================
# feed_forward / linear_bias_act
# ============================================================================================


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_weight_layouts_and_odd_sizes(backend, activation):
    """Transposed (non-contiguous) weights, an expanded x, d_ff = 1 and 0."""
    device = _ready(backend)
    g = _gen(89)
    x = _randn(1, 13, g=g).expand(5, 13)
    for d_ff in (7, 1, 0):
        w1 = _randn(13, d_ff, g=g).t()
        b1 = _randn(d_ff, g=g)
        w2 = _randn(d_ff, 11, g=g).t()
        b2 = _randn(11, g=g)
        d = lambda t: t.double()  # noqa: E731
        hidden = TF.linear(d(x), d(w1), d(b1))
        hidden = {"relu": TF.relu, "gelu": TF.gelu, "gelu_tanh": lambda h: TF.gelu(h, approximate="tanh")}[activation](hidden)
        expected = TF.linear(hidden, d(w2), d(b2))
        to = lambda t: t.to(device)  # noqa: E731
        got = F.feed_forward(to(x), to(w1), to(b1), to(w2), to(b2), activation=activation, backend=backend)
        _close(got.cpu().double(), expected, atol=1e-4)



@pytest.mark.parametrize("backend", ["reference", "torch", "auto", *backend_params("cpu"),
                                     pytest.param("triton", marks=[pytest.mark.triton])])
@pytest.mark.parametrize("which", ["ffn-b1", "ffn-b2", "linear_bias_act-b", "linear_bias_act-b-stride0"])
def test_strided_bias(backend, which):
    device = _ready(backend)
    g = _gen(97)
    x, w1, w2 = _randn(5, 13, g=g), _randn(7, 13, g=g), _randn(11, 7, g=g)
    b1, b2 = _randn(7, 2, g=g)[:, 0], _randn(11, 2, g=g)[:, 1]  # columns of matrices: stride 2
    d = lambda t: t.double()  # noqa: E731
    to = lambda t: t.to(device)  # noqa: E731
    if which == "linear_bias_act-b-stride0":
        # One value broadcast to every output (stride 0).  Taken from a larger buffer so that a
        # kernel reading it as contiguous reads wrong values, not memory outside the storage.
        b1 = _randn(16, g=g)[:1].expand(7)
    if which.startswith("linear_bias_act"):
        expected = TF.gelu(TF.linear(d(x), d(w1), d(b1)))
        got = F.linear_bias_act(to(x), to(w1), to(b1), activation="gelu", backend=backend)
    else:
        b1 = b1 if which == "ffn-b1" else b1.contiguous()
        b2 = b2 if which == "ffn-b2" else b2.contiguous()
        expected = TF.linear(TF.relu(TF.linear(d(x), d(w1), d(b1))), d(w2), d(b2))
        got = F.feed_forward(to(x), to(w1), to(b1), to(w2), to(b2), backend=backend)
    _close(got.cpu().double(), expected, atol=1e-4)


# ============================================================================================
# Backend selection (DESIGN 3)
# ============================================================================================

_LN_INPUTS = {"x": torch.randn(3, 8), "residual": torch.randn(3, 8), "weight": None, "bias": None}


@contextlib.contextmanager
def _env(value):
    old = os.environ.get(backends.ENV_VAR)
    if value is None:
        os.environ.pop(backends.ENV_VAR, None)
    else:
        os.environ[backends.ENV_VAR] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(backends.ENV_VAR, None)
        else:
            os.environ[backends.ENV_VAR] = old


def _auto():
    return backends.resolve("add_layer_norm", "auto", _LN_INPUTS)


@pytest.mark.parametrize("keyword,context,env,expected", [
    (None, None, None, "AUTO"),
    (None, None, "", "AUTO"),  # an empty variable is unset
    (None, None, "reference", "reference"),
    (None, "torch", "reference", "torch"),
    (None, "auto", "reference", "AUTO"),  # an inner "auto" beats the environment
    ("auto", "reference", "reference", "AUTO"),  # keyword "auto" beats everything
    ("torch", "reference", "bogus", "torch"),  # a bad variable is not read when not needed
    (None, "torch", "bogus", "torch"),
])
def test_selection_precedence(keyword, context, env, expected):
    expected = _auto() if expected == "AUTO" else expected
    with _env(env), (tf.use_backend(context) if context else contextlib.nullcontext()):
        assert backends.resolve("add_layer_norm", keyword, _LN_INPUTS) == expected
        x = _LN_INPUTS["x"]
        F.add_layer_norm(x, x, None, None, backend=keyword)  # the public op runs with it too


def test_environment_variable_is_read_at_call_time():
    x = torch.randn(2, 8)
    with _env("reference"):
        assert backends.resolve("add_layer_norm", None, _LN_INPUTS) == "reference"
    with _env("torch"):
        assert backends.resolve("add_layer_norm", None, _LN_INPUTS) == "torch"
    with _env("nonsense"), pytest.raises(ValueError, match=backends.ENV_VAR):
        F.add_layer_norm(x, x, None, None)


def test_use_backend_restores_after_exception_and_works_as_decorator():
    with _env(None):
        with pytest.raises(KeyError):
            with tf.use_backend("reference"):
                with tf.use_backend("torch"):
                    raise KeyError
        assert backends.requested_backend() == "auto"

        @tf.use_backend("reference")
        def inner():
            return backends.resolve("add_layer_norm", None, _LN_INPUTS)

        assert inner() == "reference" and inner() == "reference"
        assert backends.requested_backend() == "auto"


def test_use_backend_is_per_thread():
    """Like torch.no_grad: a use_backend block in one thread does not steer another thread."""
    import threading

    entered, release, seen = threading.Event(), threading.Event(), {}

    def holder():
        with tf.use_backend("reference"):
            seen["holder"] = backends.requested_backend()
            entered.set()
            release.wait(10)

    with _env(None):
        thread = threading.Thread(target=holder)
        thread.start()
        assert entered.wait(10)
        seen["main"] = backends.requested_backend()
        release.set()
        thread.join(10)
    assert seen == {"holder": "reference", "main": "auto"}


@pytest.mark.parametrize("bad", [None, 1, "Torch", "auto ", ""])
def test_invalid_backend_names(bad):
    with pytest.raises((ValueError, TypeError), match="backend"):
        with tf.use_backend(bad):
            pass
    if bad is not None:  # None as a keyword means "the ambient default"
        x = torch.randn(2, 8)
        with pytest.raises((ValueError, TypeError), match="backend"):
            F.add_layer_norm(x, x, None, None, backend=bad)


def test_context_requested_backend_that_cannot_run_raises_with_reasons():
    """An explicit request through use_backend is explicit too: no silent fall-through."""
    x = torch.randn(2, 2, 3, 12)  # head dim 12: no fused kernel
    with tf.use_backend("cpu"), pytest.raises(tf.BackendError) as info:
        F.scaled_dot_product_attention(x, x, x)
    message = str(info.value)
    assert "head dims 16..256" in message and "Backends that can: reference, torch" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    with tf.use_backend("auto"):
        F.scaled_dot_product_attention(x, x, x)  # auto falls through to torch


def test_triton_without_interpreter_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not backends.triton_status()[0]:
        pytest.skip("triton not installed")
    reasons = tf.not_supported_reasons("triton", "add_layer_norm", _LN_INPUTS)
    assert any("TRITON_INTERPRET" in r for r in reasons)


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_expanded_cache_that_would_be_written_is_rejected(which):
    q = torch.randn(2, 2, 1, 16)
    caches = {"k_cache": torch.zeros(2, 2, 8, 16), "v_cache": torch.zeros(2, 2, 8, 16)}
    caches[which] = torch.zeros(1, 2, 8, 16).expand(2, -1, -1, -1)  # both rows share storage
    seqlens = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"{which}.*stride-0"):
        F.attention_with_kv_cache(q, caches["k_cache"], caches["v_cache"], seqlens, q, q)
    # Read-only use (no k_new/v_new) of an expanded cache is fine.
    F.attention_with_kv_cache(q, caches["k_cache"], caches["v_cache"], seqlens)


# ---- Findings of the 2026-11-25 audit


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_float32_mask_keeps_its_precision_with_half_queries(backend, dtype):
    """torch's SDPA adds a float32 mask to half-precision scores without rounding it to the
    query's dtype; ours too (it was rounded: 0.12 off at a 1000 bias in fp16, NaN at 7e4)."""
    device = _ready(backend)  # triton: CUDA tensors where a GPU is (CPU ones only interpreted)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (5, 7, 7))
    mask = 1000 + torch.rand(5, 7, generator=g)
    mask[0, 1] = 7e4  # beyond fp16's range
    kpm = torch.zeros(2, 7)
    kpm[1, 5:] = float("-inf")
    truth = tf.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask.double(), key_padding_mask=kpm.double(),
        backend="reference")
    to = lambda t: t.to(device)  # noqa: E731
    got = tf.functional.scaled_dot_product_attention(
        to(q.to(dtype)), to(k.to(dtype)), to(v.to(dtype)), to(mask), key_padding_mask=to(kpm),
        backend=backend)
    assert got.dtype == dtype and got.device.type == torch.device(device).type
    tol = 4e-3 if dtype == torch.float16 else 3e-2  # one rounding of O(1) outputs
    err = (got.cpu().double() - truth).abs().max()
    assert err < tol, f"max error {float(err):.3g} >= {tol} ({backend}, {dtype}, {device})"


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_masked_softmax_float32_mask_keeps_its_precision(backend, dtype):
    """As the SDPA op (above): a float32 mask on 16-bit scores is added in float32 on every
    backend, the reference included (the 2026-11-28 audit: rounded to the scores' dtype, -1e5
    became -inf in fp16 and a live row came out as zeros; the reference is also the oracle's
    ref_lp)."""
    device = _ready(backend)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    scores = torch.randn(2, 3, 5, 7, generator=g)
    mask = -1e5 + 3 * torch.rand(5, 7, generator=g)  # past fp16's range, spread under bf16's step
    mask[0] = 0.0
    mask[1, 4] = 7e4
    truth = torch.softmax(scores.double() + mask.double(), dim=-1)
    got = tf.functional.masked_softmax(scores.to(dtype).to(device), mask.to(device), backend=backend)
    assert got.dtype == dtype
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    err = (got.cpu().double() - truth).abs().max()
    assert err < tol, f"max error {float(err):.3g} >= {tol} ({backend}, {dtype}, {device})"


def test_float_key_padding_mask_needing_grad_is_refused_by_fused_backends():
    q, k, v = (torch.randn(2, 2, 4, 16, requires_grad=True) for _ in range(3))
    kpm = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(tf.BackendError, match="key_padding_mask"):
        tf.functional.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend="cpu")
    out = tf.functional.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)  # auto: torch
    (gk,) = torch.autograd.grad(out.sum(), kpm)
    want = tf.functional.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend="reference")
    torch.testing.assert_close(gk, torch.autograd.grad(want.sum(), kpm)[0], rtol=1e-5, atol=1e-6)


def test_zero_heads():
    """Zero key heads under enable_gqa: a ValueError naming key (not ZeroDivisionError); zero
    heads everywhere: an empty output on auto, as torch, and on a fused backend (since the
    eleventh session; it raised a BackendError before)."""
    with pytest.raises(ValueError, match="key"):
        tf.functional.scaled_dot_product_attention(
            torch.randn(2, 4, 5, 16), torch.randn(2, 0, 7, 16), torch.randn(2, 0, 7, 16), enable_gqa=True)
    q = torch.randn(2, 0, 5, 16)
    assert tf.functional.scaled_dot_product_attention(q, q, q).shape == (2, 0, 5, 16)
    assert tf.functional.scaled_dot_product_attention(q, q, q, backend="cpu").shape == (2, 0, 5, 16)


@pytest.mark.parametrize("backend", ["reference", "torch", *backend_params("cpu", "triton")])
def test_gqa_on_3d_inputs_reads_dim_0_as_heads(backend):
    """torch's SDPA with enable_gqa reads dim -3 of 3-D inputs as the heads (key/value heads
    repeat_interleave'd over the query's): the same numbers and gradients here."""
    device = _ready(backend)  # triton: CUDA tensors where a GPU is (CPU ones only interpreted)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = torch.randn(6, 5, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    mask = torch.randn(6, 5, 7, generator=g)
    # Differentiable moves: the gradients land on the CPU leaves, next to torch's CPU result.
    got = tf.functional.scaled_dot_product_attention(
        q.to(device), k.to(device), v.to(device), mask.to(device), enable_gqa=True, backend=backend)
    assert got.device.type == torch.device(device).type
    want = TF.scaled_dot_product_attention(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), mask)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["default", "legacy", "new", "global", "matmul_precision"])
def test_tf32_switch_read_like_torch(how):
    """The fused backends use tf32 for fp32 dots exactly when torch's own matmuls would, however
    the program set it (the legacy allow_tf32 flag raises when read after the new API is used)."""
    from transformer_fast import functional as F_

    matmul = torch.backends.cuda.matmul
    saved = (matmul.fp32_precision, torch.backends.fp32_precision, torch.get_float32_matmul_precision())
    try:
        if how == "legacy":
            matmul.allow_tf32 = True
        elif how == "new":
            matmul.fp32_precision = "tf32"
        elif how == "global":
            torch.backends.fp32_precision = "tf32"
        elif how == "matmul_precision":
            torch.set_float32_matmul_precision("high")
        assert F_._allow_tf32(torch.float32) is (how != "default")
        assert F_._allow_tf32(torch.float16) is False
    finally:
        torch.backends.fp32_precision = saved[1]
        matmul.fp32_precision = saved[0]
        torch.set_float32_matmul_precision(saved[2])
        if saved[0] == "none":
            matmul.fp32_precision = "none"


# ---- Findings of the 2026-11-28 audit


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_add_layer_norm_float32_bias_without_weight_differentiates(backend, dtype):
    """weight None with a float32 bias on 16-bit x (allowed by the contract): torch's own
    F.layer_norm backward raised "expected scalar type Half but found Float" on the torch path."""
    device = _ready(backend)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, res = (torch.randn(6, 24, generator=g) for _ in range(2))
    bias = torch.randn(24, generator=g)
    up = torch.randn(6, 24, generator=g)
    leaves = [x.to(dtype).to(device).requires_grad_(), res.to(dtype).to(device).requires_grad_(),
              bias.to(device).requires_grad_()]
    out = tf.functional.add_layer_norm(leaves[0], leaves[1], None, leaves[2], backend=backend)
    grads = torch.autograd.grad(out, leaves, up.to(dtype).to(device))
    want_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want = tf.functional.add_layer_norm(want_leaves[0], want_leaves[1], None, want_leaves[2],
                                        backend="reference")
    want_grads = torch.autograd.grad(want, want_leaves, up.double())
    tol = 2e-2 if dtype == torch.float16 else 1.5e-1  # O(1) values, a few roundings in 16-bit
    for name, got_t, want_t in zip(("out", "dx", "dres", "dbias"), (out, *grads), (want, *want_grads)):
        assert got_t.dtype == (torch.float32 if name == "dbias" else dtype), name
        err = (got_t.detach().cpu().double() - want_t).abs().max()
        assert err < tol * max(1.0, float(want_t.detach().abs().max())), (name, float(err), backend)
