"""functional.scaled_dot_product_attention: reference and torch backends against the float64
oracle (DESIGN section 6), torch SDPA semantics, fully masked rows, dropout."""
import math

import pytest
import torch
import torch.nn.functional as TF

from transformer_fast import functional as F
from transformer_fast import masks, reference

from _functional_helpers import (
    BACKENDS,
    DTYPES,
    MASK_KINDS,
    dt_id,
    generator,
    make_masks,
    oracle_atol,
    randn,
)

LENGTHS = [(1, 1), (7, 7), (1, 127), (127, 7), (7, 127), (127, 127)]
# A subset of length pairs by default (127x127 in fp32 only), all of them under -m slow.
_FAST = {(1, 1), (7, 127), (127, 7)}
DTYPE_LENGTHS = [
    pytest.param(dtype, lq, lk, id=f"{dt_id(dtype)}-{lq}x{lk}",
                 marks=() if (lq, lk) in _FAST or (dtype, lq) == (torch.float32, 127) else pytest.mark.slow)
    for dtype in DTYPES
    for lq, lk in LENGTHS
]
HEAD_DIMS = [16, 64, 128, 256]


def check_sdpa(backend, q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal=False,
               scale=None, enable_gqa=False, context=""):
    """Oracle over the output and the gradients of query, key, value (and nothing else)."""

    def kernel(query, key, value, attn_mask=None):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask, backend=backend,
        )

    def ref(query, key, value, attn_mask=None):
        return reference.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask,
        )

    inputs = {"query": q, "key": k, "value": v}
    if attn_mask is not None:
        inputs["attn_mask"] = attn_mask
    results = reference.run_oracle(kernel, ref, inputs, ["query", "key", "value"],
                                   atol=oracle_atol(backend, q.dtype))
    reference.assert_oracle(results, f"{backend} {context}")
    return results


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,lq,lk", DTYPE_LENGTHS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_oracle_masks(backend, dtype, lq, lk, kind):
    g = generator()
    batch, heads = 2, 2
    d = HEAD_DIMS[(lq + lk + len(kind)) % len(HEAD_DIMS)]  # spread head dims over the grid
    if lq * lk > 10_000:
        d = min(d, 64)  # keep the default run short; test_oracle_head_dims covers 256
    q = randn(batch, heads, lq, d, dtype=dtype, g=g)
    k = randn(batch, heads, lk, d, dtype=dtype, g=g)
    v = randn(batch, heads, lk, d, dtype=dtype, g=g)
    m = make_masks(kind, batch, heads, lq, lk, dtype, g)
    check_sdpa(backend, q, k, v, **m, context=f"{kind} {lq}x{lk} d={d} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_oracle_head_dims(backend, dtype, d):
    g = generator()
    q = randn(2, 2, 33, d, dtype=dtype, g=g)
    k = randn(2, 2, 45, d, dtype=dtype, g=g)
    v = randn(2, 2, 45, d, dtype=dtype, g=g)
    check_sdpa(backend, q, k, v, is_causal=True, context=f"d={d}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("kind", ["none", "causal", "bool_bh", "causal+float_bh+kpm", "dead"])
def test_oracle_gqa(backend, dtype, hkv, kind):
    g = generator()
    batch, heads, lq, lk, d = 2, 4, 7, 19, 32
    q = randn(batch, heads, lq, d, dtype=dtype, g=g)
    k = randn(batch, hkv, lk, d, dtype=dtype, g=g)
    v = randn(batch, hkv, lk, d, dtype=dtype, g=g)
    m = make_masks(kind, batch, heads, lq, lk, dtype, g)
    check_sdpa(backend, q, k, v, **m, enable_gqa=True, context=f"gqa {heads}/{hkv} {kind}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("kind", ["none", "causal", "causal+kpm", "dead"])
def test_oracle_non_contiguous_packed_qkv(backend, dtype, kind):
    """q, k, v as transposed views of one packed (B, L, 3, H, D) projection; gradients land in
    the packed tensor."""
    g = generator()
    batch, length, heads, d = 2, 13, 4, 16
    packed = randn(batch, length, 3, heads, d, dtype=dtype, g=g)
    m = make_masks(kind, batch, heads, length, length, dtype, g)

    def split(qkv):
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        assert not q.is_contiguous()
        return q, k, v

    def kernel(qkv, attn_mask=None):
        q, k, v = split(qkv)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, is_causal=m["is_causal"],
            key_padding_mask=m["key_padding_mask"], backend=backend,
        )

    def ref(qkv, attn_mask=None):
        q, k, v = split(qkv)
        return reference.scaled_dot_product_attention(
            q, k, v, attn_mask, is_causal=m["is_causal"], key_padding_mask=m["key_padding_mask"]
        )

    inputs = {"qkv": packed}
    if m["attn_mask"] is not None:
        inputs["attn_mask"] = m["attn_mask"]
    results = reference.run_oracle(kernel, ref, inputs, ["qkv"], atol=oracle_atol(backend, dtype))
    reference.assert_oracle(results, f"{backend} packed {kind}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_value_head_dim_differs_and_scale(backend):
    g = generator()
    q = randn(2, 3, 9, 32, g=g)
    k = randn(2, 3, 11, 32, g=g)
    v = randn(2, 3, 11, 48, g=g)
    check_sdpa(backend, q, k, v, is_causal=True, scale=0.3, context="Dv != D, scale")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_q,shape_k", [((3, 7, 16), (3, 9, 16)), ((2, 2, 3, 7, 16), (2, 2, 3, 9, 16))])
def test_oracle_other_ranks(backend, shape_q, shape_k):
    """3-D (N, L, D) without a head dimension, and 5-D with two leading batch dims."""
    g = generator()
    q, k, v = randn(*shape_q, g=g), randn(*shape_k, g=g), randn(*shape_k, g=g)
    lk = shape_k[-2]
    kpm = torch.rand(shape_q[0], lk) < 0.3
    check_sdpa(backend, q, k, v, is_causal=True, key_padding_mask=kpm, context=f"rank {len(shape_q)}")


# --------------------------------------------------------------------------------------------
# torch SDPA semantics where torch defines them


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5), (1, 6), (6, 1), (8, 8)])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_matches_torch_sdpa(backend, lq, lk, hkv, mask):
    g = generator()
    batch, heads, d = 2, 4, 16
    q = randn(batch, heads, lq, d, g=g, scale=2.0)
    k = randn(batch, hkv, lk, d, g=g)
    v = randn(batch, hkv, lk, 24, g=g)
    attn_mask, is_causal = None, mask == "causal"
    if mask == "bool":
        attn_mask = torch.rand(batch, 1, lq, lk, generator=g) < 0.7
        attn_mask[..., 0] = True  # torch's CPU path zeroes dead rows; keep them out of this test
    if mask == "float":
        attn_mask = randn(lq, lk, g=g)
    gqa = hkv != heads
    expected = TF.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=0.7, enable_gqa=gqa)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, 0.7, gqa, backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_match_torch_sdpa(backend):
    """Positional arguments, the default scale 1/sqrt(D), and the 3-D form."""
    g = generator()
    q, k, v = randn(3, 5, 20, g=g), randn(3, 8, 20, g=g), randn(3, 8, 20, g=g)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, backend=backend),
        TF.scaled_dot_product_attention(q, k, v),
    )
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, None, 0.0, True, backend=backend),
        TF.scaled_dot_product_attention(q, k, v, None, 0.0, True),
    )


def test_signature_is_a_superset_of_torch():
    """torch's builtin has no inspectable signature: check ours against its documented one
    (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False; torch takes the last two by keyword only, ours either way)."""
    import inspect

    params = inspect.signature(F.scaled_dot_product_attention).parameters
    expected = {"query": inspect.Parameter.empty, "key": inspect.Parameter.empty,
                "value": inspect.Parameter.empty, "attn_mask": None, "dropout_p": 0.0,
                "is_causal": False, "scale": None, "enable_gqa": False}
    assert list(params)[: len(expected)] == list(expected)
    assert {n: params[n].default for n in expected} == expected
    assert params["key_padding_mask"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["backend"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_mask_equals_attn_mask(backend):
    """key_padding_mask True = padding is attn_mask False at (b, :, :, j)."""
    g = generator()
    q, k, v = randn(2, 3, 6, 16, g=g), randn(2, 3, 10, 16, g=g), randn(2, 3, 10, 16, g=g)
    kpm = torch.rand(2, 10, generator=g) < 0.4
    kpm[:, 0] = False
    a = F.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend=backend)
    b = F.scaled_dot_product_attention(q, k, v, ~kpm[:, None, None, :], backend=backend)
    c = TF.scaled_dot_product_attention(q, k, v, ~kpm[:, None, None, :])
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_combined_with_attn_mask(backend):
    """torch refuses is_causal with attn_mask; ours ANDs them."""
    g = generator()
    q, k, v = randn(1, 2, 6, 8, g=g), randn(1, 2, 9, 8, g=g), randn(1, 2, 9, 8, g=g)
    bias = randn(6, 9, g=g)
    causal = torch.ones(6, 9, dtype=torch.bool).tril()
    got = F.scaled_dot_product_attention(q, k, v, bias, is_causal=True, backend=backend)
    expected = TF.scaled_dot_product_attention(q, k, v, bias.masked_fill(~causal, float("-inf")))
    torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------------------------
# Fully masked rows: zeros and zero gradients, never NaN


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("how", ["bool", "float", "padding", "causal+padding", "float_padding"])
def test_fully_masked_rows_are_zero(backend, dtype, how):
    g = generator()
    batch, heads, lq, lk, d = 2, 2, 5, 6, 8
    q = randn(batch, heads, lq, d, dtype=dtype, g=g).requires_grad_()
    k = randn(batch, heads, lk, d, dtype=dtype, g=g).requires_grad_()
    v = randn(batch, heads, lk, d, dtype=dtype, g=g).requires_grad_()
    attn_mask, kpm, causal = None, None, False
    dead = torch.zeros(batch, heads, lq, dtype=torch.bool)
    if how == "bool":
        attn_mask = torch.ones(batch, 1, lq, lk, dtype=torch.bool)
        attn_mask[1, 0, 2] = False
        dead[1, :, 2] = True
    elif how == "float":
        attn_mask = torch.zeros(lq, lk, dtype=dtype)
        attn_mask[3] = float("-inf")
        dead[:, :, 3] = True
    elif how == "padding":
        kpm = torch.zeros(batch, lk, dtype=torch.bool)
        kpm[0] = True
        dead[0] = True
    elif how == "float_padding":
        kpm = torch.zeros(batch, lk, dtype=dtype)
        kpm[1] = float("-inf")
        dead[1] = True
    else:  # causal: query 0 sees key 0 only; padding key 0 of batch 1 leaves it nothing
        causal = True
        kpm = torch.zeros(batch, lk, dtype=torch.bool)
        kpm[1, 0] = True
        dead[1, :, 0] = True
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask, is_causal=causal, key_padding_mask=kpm, backend=backend
    )
    assert not out.isnan().any()
    assert (out[dead] == 0).all()
    assert (out[~dead].abs().sum(-1) > 0).all()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[dead] == 0).all()


def _nan_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """An SDPA that, like the GPU fused paths, gives NaN (and NaN gradients) for dead rows."""
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = query @ key.transpose(-2, -1) * scale
    if attn_mask is not None:
        s = s + masks.to_additive(attn_mask, s.dtype)
    return torch.softmax(s, -1) @ value


def test_torch_backend_fixes_nan_rows_of_sdpa(monkeypatch):
    """The torch backend must not rely on the CPU math path zeroing dead rows."""
    monkeypatch.setattr(TF, "scaled_dot_product_attention", _nan_sdpa)
    g = generator()
    q = randn(2, 4, 5, 8, g=g).requires_grad_()
    k = randn(2, 2, 6, 8, g=g).requires_grad_()
    v = randn(2, 2, 6, 8, g=g).requires_grad_()
    mask = torch.rand(2, 4, 5, 6, generator=g) < 0.8
    mask[0, 1, 3] = False
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True
    assert _nan_sdpa(q, k, v, mask & ~kpm[:, None, None], enable_gqa=True).isnan().any()
    out = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, key_padding_mask=kpm, backend="torch")
    ref = reference.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, key_padding_mask=kpm)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_key_length_gives_zeros(backend):
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    out = F.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.shape == (1, 2, 3, 8) and (out == 0).all()


# --------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics(backend):
    """value = identity exposes the dropped probabilities: ~p of them are zero, the rest are
    scaled by 1/(1-p); averaged over draws the output is the no-dropout output."""
    torch.manual_seed(0)
    p, lk = 0.3, 64
    q = torch.randn(4, 4, 64, 16)
    k = torch.randn(4, 4, lk, 16)
    v = torch.eye(lk).expand(4, 4, lk, lk)
    clean = F.scaled_dot_product_attention(q, k, v, backend=backend)
    dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=p, backend=backend)
    zero_fraction = (dropped == 0).float().mean().item()
    assert abs(zero_fraction - p) < 0.02
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], (clean / (1 - p))[kept])
    draws = [F.scaled_dot_product_attention(q, k, v, dropout_p=p, backend=backend) for _ in range(50)]
    mean = torch.stack(draws).mean(0)
    # per element the mean of 50 draws has relative std sqrt(p / (1 - p) / 50) ~ 0.09
    assert (mean - clean).abs().mean() < 0.15 * clean.abs().mean()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dt_id)
def test_dropout_exact_keep_mask(backend, dtype):
    """Seeded, both backends drop what F.dropout draws over the (B, H, Lq, Lk) probabilities,
    so the reference with that exact keep mask reproduces them (output and gradients, checked
    by the oracle)."""
    g = generator()
    p, seed = 0.25, int(torch.randint(0, 2**31, ()))
    q, k, v = randn(2, 3, 7, 16, dtype=dtype, g=g), randn(2, 3, 9, 16, dtype=dtype, g=g), randn(2, 3, 9, 16, dtype=dtype, g=g)
    kpm = torch.rand(2, 9, generator=g) < 0.3
    torch.manual_seed(seed)
    keep = TF.dropout(torch.ones(2, 3, 7, 9, dtype=dtype), p) != 0

    def kernel(query, key, value):
        torch.manual_seed(seed)
        return F.scaled_dot_product_attention(query, key, value, None, p, True, key_padding_mask=kpm, backend=backend)

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(
            query, key, value, None, p, True, key_padding_mask=kpm, keep=keep
        )

    results = reference.run_oracle(kernel, ref, {"query": q, "key": k, "value": v},
                                   ["query", "key", "value"], atol=oracle_atol(backend, dtype))
    reference.assert_oracle(results, f"{backend} dropout")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lq,lk", [(1000, 1000), (1, 1000), (1000, 127)])
@pytest.mark.parametrize("kind", ["causal", "causal+float_bh+kpm", "dead"])
def test_oracle_long(backend, dtype, lq, lk, kind):
    g = generator()
    q = randn(1, 2, lq, 64, dtype=dtype, g=g)
    k = randn(1, 2, lk, 64, dtype=dtype, g=g)
    v = randn(1, 2, lk, 64, dtype=dtype, g=g)
    m = make_masks(kind, 1, 2, lq, lk, dtype, g)
    check_sdpa(backend, q, k, v, **m, context=f"long {kind} {lq}x{lk}")
