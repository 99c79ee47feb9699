"""functional.attention_with_kv_cache: oracle, cache writes, equivalence with full attention
over the concatenated prefix, fully masked rows and bounds."""
import pytest
import torch
import torch.nn.functional as TF

from transformer_fast import functional as F
from transformer_fast import reference

from _functional_helpers import BACKENDS, DTYPES, dt_id, generator, oracle_atol, randn
from conftest import backend_params, require_backend


def make_case(batch, heads, kv_heads, lq, l_max, d, dtype, seqlens, with_new=True, dv=None, g=None):
    g = g or generator()
    dv = dv or d
    q = randn(batch, heads, lq, d, dtype=dtype, g=g)
    k_cache = randn(batch, kv_heads, l_max, d, dtype=dtype, g=g)
    v_cache = randn(batch, kv_heads, l_max, dv, dtype=dtype, g=g)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
    k_new = randn(batch, kv_heads, lq, d, dtype=dtype, g=g) if with_new else None
    v_new = randn(batch, kv_heads, lq, dv, dtype=dtype, g=g) if with_new else None
    return q, k_cache, v_cache, cache_seqlens, k_new, v_new


def check_kv(backend, q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale=None, context=""):
    def kernel(q, k_cache, v_cache, k_new=None, v_new=None):
        return F.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale=scale, backend=backend)

    def ref(q, k_cache, v_cache, k_new=None, v_new=None):
        return reference.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale)

    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    grads = ["q"]
    if k_new is not None:
        inputs.update(k_new=k_new, v_new=v_new)
        grads += ["k_new", "v_new"]
    results = reference.run_oracle(kernel, ref, inputs, grads, atol=oracle_atol(backend, q.dtype))
    reference.assert_oracle(results, f"{backend} kv-cache {context}")


CASES = [
    # batch, heads, kv_heads, lq, l_max, d, seqlens
    (3, 4, 4, 1, 16, 16, [0, 7, 15]),  # decode one token; empty and full-to-the-brim rows
    (2, 4, 2, 1, 127, 64, [126, 31]),
    (2, 4, 1, 7, 33, 32, [0, 26]),  # chunk of 7 new tokens (prefill / speculative)
    (2, 4, 2, 7, 127, 128, [100, 5]),
    (1, 2, 2, 127, 127, 16, [0]),  # prompt into an empty cache: plain causal attention
    (2, 2, 1, 3, 9, 256, [6, 2]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}kv{c[2]}q{c[3]}max{c[4]}d{c[5]}")
def test_oracle(backend, dtype, case):
    batch, heads, kv_heads, lq, l_max, d, seqlens = case
    check_kv(backend, *make_case(batch, heads, kv_heads, lq, l_max, d, dtype, seqlens), context=str(case))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
def test_oracle_without_new_keys_and_scale(backend, dtype):
    check_kv(backend, *make_case(2, 4, 2, 3, 20, 32, dtype, [10, 17], with_new=False), scale=0.2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("lq", [1, 5])
def test_matches_full_attention_on_concatenated_prefix(backend, kv_heads, lq):
    """Per row: torch SDPA over cat(prefix, new) with bottom-right causal among the new tokens."""
    batch, heads, l_max, d, dv = 3, 4, 24, 16, 8
    seqlens = [0, 9, l_max - lq]
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = make_case(
        batch, heads, kv_heads, lq, l_max, d, torch.float32, seqlens, dv=dv
    )
    prefix_k, prefix_v = k_cache.clone(), v_cache.clone()
    out = F.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, backend=backend)
    for b, s in enumerate(seqlens):
        keys = torch.cat([prefix_k[b : b + 1, :, :s], k_new[b : b + 1]], dim=2)
        values = torch.cat([prefix_v[b : b + 1, :, :s], v_new[b : b + 1]], dim=2)
        allowed = torch.ones(lq, s + lq, dtype=torch.bool).tril(diagonal=s)  # bottom-right
        expected = TF.scaled_dot_product_attention(
            q[b : b + 1], keys, values, allowed, enable_gqa=kv_heads != heads
        )
        torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-5, atol=1e-5)
        # The cache now holds prefix + new at [s, s + lq) and is untouched elsewhere.
        torch.testing.assert_close(k_cache[b, :, : s + lq], keys[0], rtol=0, atol=0)
        torch.testing.assert_close(v_cache[b, :, : s + lq], values[0], rtol=0, atol=0)
        torch.testing.assert_close(k_cache[b, :, s + lq :], prefix_k[b, :, s + lq :], rtol=0, atol=0)
        torch.testing.assert_close(v_cache[b, :, s + lq :], prefix_v[b, :, s + lq :], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_loop_matches_causal_attention(backend):
    """Token by token through the cache == one causal SDPA over the whole sequence."""
    g = generator()
    batch, heads, kv_heads, length, d = 2, 4, 2, 12, 16
    q, k, v = randn(batch, heads, length, d, g=g), randn(batch, kv_heads, length, d, g=g), randn(batch, kv_heads, length, d, g=g)
    expected = TF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k_cache = torch.zeros(batch, kv_heads, length, d)
    v_cache = torch.zeros(batch, kv_heads, length, d)
    cache_seqlens = torch.zeros(batch, dtype=torch.int32)
    outs = []
    for t in range(length):
        sl = slice(t, t + 1)
        outs.append(F.attention_with_kv_cache(
            q[:, :, sl], k_cache, v_cache, cache_seqlens, k[:, :, sl], v[:, :, sl], backend=backend
        ))
        cache_seqlens += 1
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_q_and_caches(backend):
    """q a transposed view of (B, L, H, D); caches transposed views of (B, L_max, Hkv, D)
    buffers: the in-place write must land in the buffers."""
    g = generator()
    batch, heads, kv_heads, lq, l_max, d = 2, 4, 2, 3, 10, 16
    q = randn(batch, lq, heads, d, g=g).transpose(1, 2)
    k_buf, v_buf = randn(batch, l_max, kv_heads, d, g=g), randn(batch, l_max, kv_heads, d, g=g)
    k_new = randn(batch, lq, kv_heads, d, g=g).transpose(1, 2)
    v_new = randn(batch, lq, kv_heads, d, g=g).transpose(1, 2)
    seqlens = torch.tensor([2, 7], dtype=torch.int32)
    ref_k, ref_v = k_buf.transpose(1, 2).contiguous(), v_buf.transpose(1, 2).contiguous()
    expected = reference.attention_with_kv_cache(q.contiguous(), ref_k, ref_v, seqlens, k_new.contiguous(), v_new.contiguous())
    out = F.attention_with_kv_cache(q, k_buf.transpose(1, 2), v_buf.transpose(1, 2), seqlens, k_new, v_new, backend=backend)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(k_buf.transpose(1, 2), ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_buf.transpose(1, 2), ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_visible_keys_are_zero(backend):
    """Without k_new a query i sees keys j <= cache_seqlens[b] - Lq + i: with cache_seqlens[b]
    < Lq the first queries see nothing and must return zeros with zero gradients."""
    q, k_cache, v_cache, _, _, _ = make_case(2, 2, 2, 4, 8, 16, torch.float32, [0, 0], with_new=False)
    cache_seqlens = torch.tensor([2, 0], dtype=torch.int32)
    q.requires_grad_()
    out = F.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, backend=backend)
    assert not out.isnan().any()
    assert (out[0, :, :2] == 0).all() and (out[0, :, 2:].abs().sum(-1) > 0).all()
    assert (out[1] == 0).all()
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and (q.grad[0, :, :2] == 0).all() and (q.grad[1] == 0).all()


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("garbage", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_cache_slots_past_the_valid_keys_are_never_read(backend, garbage):
    """Slots past cache_seqlens[b] + L_new are not part of row b's cache (a cache made with
    torch.empty holds anything there): NaN / Inf in them must not reach the output, as a 0 weight
    times NaN would in a dense p @ v."""
    device = require_backend(backend)
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = (
        t if t is None else t.to(device)
        for t in make_case(2, 4, 2, 2, 40, 16, torch.float32, [3, 17]))
    clean = F.attention_with_kv_cache(q, k_cache.clone(), v_cache.clone(), cache_seqlens, k_new, v_new,
                                      backend=backend)
    valid = (torch.arange(40, device=device) < (cache_seqlens.to(device).long() + 2)[:, None])
    junk = ~valid[:, None, :, None]  # (B, 1, L_max, 1)
    out = F.attention_with_kv_cache(q, k_cache.masked_fill(junk, garbage), v_cache.masked_fill(junk, garbage),
                                    cache_seqlens, k_new, v_new, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params("torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("with_new", [True, False], ids=["prefill_chunk", "no_new_keys"])
def test_nonfinite_value_hidden_from_a_query_propagates_like_reference(backend, bad, with_new):
    """Inside a row's valid keys the reference is dense: a key hidden from a query of the chunk
    (causal among the new tokens, or every key for a query that sees none) still meets it as
    0 * v, so a NaN / Inf value there makes that query's output NaN in its column."""
    device = require_backend(backend)
    q, k_cache, v_cache, _, k_new, v_new = (
        t if t is None else t.to(device)
        for t in make_case(2, 4, 2, 3, 12, 16, torch.float32, [0, 0], with_new=with_new))
    if with_new:
        cache_seqlens = torch.tensor([4, 0], dtype=torch.int32, device=device)
        v_new[:, 1, 2, 5] = bad  # the chunk's last token: hidden from its first two queries
    else:
        cache_seqlens = torch.tensor([4, 2], dtype=torch.int32, device=device)
        v_cache[:, 1, 3, 5] = bad  # row 0: hidden from queries 0, 1; row 1: past its keys
    want = reference.attention_with_kv_cache(q, k_cache.clone(), v_cache.clone(), cache_seqlens, k_new, v_new)
    got = F.attention_with_kv_cache(q, k_cache.clone(), v_cache.clone(), cache_seqlens, k_new, v_new,
                                    backend=backend)
    assert want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_and_write_the_same_cache(backend):
    case = make_case(3, 4, 2, 2, 12, 16, torch.float32, [0, 5, 10])
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = case
    k2, v2 = k_cache.clone(), v_cache.clone()
    a = F.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, backend=backend)
    b = reference.attention_with_kv_cache(q, k2, v2, cache_seqlens, k_new, v_new)
    torch.testing.assert_close(a, b)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert cache_seqlens.tolist() == [0, 5, 10]  # the caller advances it


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_reach_new_keys_through_the_cache(backend):
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = make_case(2, 2, 1, 2, 6, 4, torch.float64, [1, 4])
    for t in (q, k_new, v_new):
        t.requires_grad_()

    def fn(q, k_new, v_new):
        return F.attention_with_kv_cache(q, k_cache.clone(), v_cache.clone(), cache_seqlens, k_new, v_new, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k_new, v_new))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_out_of_range_lengths_raise_under_torch_compile(backend):
    """Compiled, the host check cannot read the lengths: a CPU call skipped the check, so -1
    wrote the new key into the cache's last slot (torch backend) or dropped it (cpu); now the
    sync-free assert the GPU uses raises."""
    require_backend(backend)
    step = torch.compile(lambda *args: F.attention_with_kv_cache(*args, backend=backend), fullgraph=True)
    k_cache, v_cache = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    q, k_new, v_new = torch.randn(2, 2, 1, 16), torch.ones(2, 2, 1, 16), torch.ones(2, 2, 1, 16)
    step(q, k_cache, v_cache, torch.tensor([3, 0], dtype=torch.int32), k_new, v_new)
    for bad in ([-1, 0], [8, 0]):
        with pytest.raises(RuntimeError, match="cache_seqlens"):
            step(q, k_cache, v_cache, torch.tensor(bad, dtype=torch.int32), k_new, v_new)
    assert k_cache[0, :, 3].eq(1).all() and k_cache[0, :, 7].eq(0).all()
