"""The fused kernels on a real GPU at realistic sizes, against the float64 oracle. Marked `gpu`
(skipped without CUDA); benchmarks/gpu_suite.sh runs them. The CPU suite covers the same code
paths at small shapes (Triton through the interpreter)."""
import pytest
import torch

from transformer_fast import functional as F
from transformer_fast import philox, reference, verify

from _functional_helpers import dt_id, make_masks

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("shape", [(4096, 1024), (16384, 4096), (7, 65536), (1000, 1000), (33, 127)])
def test_add_layer_norm(backend, dtype, shape):
    for dropout_p, prenorm in ((0.0, False), (0.1, True)):
        run = verify._add_layer_norm_runner(shape, dtype, "cuda", dropout_p, prenorm)
        reference.assert_oracle(run(backend), f"{backend} {shape} p={dropout_p}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize(
    "shape",  # (B, H, Hkv, Lq, Lk, D)
    [(2, 8, 8, 1024, 1024, 64), (1, 8, 2, 200, 1000, 128), (4, 4, 4, 127, 127, 256),
     (2, 16, 16, 513, 257, 80), (8, 8, 1, 1, 4096, 128)],
)
@pytest.mark.parametrize("mask_kind", ["causal", "padding", "bool"])
def test_attention(dtype, shape, mask_kind):
    dropout_p = 0.1 if mask_kind == "bool" else 0.0
    run = verify._sdpa_runner(shape, dtype, "cuda", mask_kind, dropout_p)
    reference.assert_oracle(run("triton"), f"{shape} {mask_kind}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("kind", ["none", "causal+kpm", "causal+float_bh+kpm", "dead", "bool_2d"])
def test_attention_mask_kinds(dtype, kind):
    b, h, lq, lk, d = 2, 4, 200, 333, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for n in (lq, lk, lk))
    m = {key: (t.cuda() if isinstance(t, torch.Tensor) else t) for key, t in make_masks(kind, b, h, lq, lk, dtype).items()}

    def kernel(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, m["attn_mask"], 0.0, m["is_causal"],
                                              key_padding_mask=m["key_padding_mask"], backend="triton")

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(query, key, value, m["attn_mask"], 0.0, m["is_causal"],
                                                      key_padding_mask=m["key_padding_mask"])

    results = reference.run_oracle(kernel, ref, {"query": q, "key": k, "value": v}, ["query", "key", "value"])
    reference.assert_oracle(results, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("b,h,hkv,l_new,l_max,d", [(1, 32, 8, 1, 8192, 128), (64, 8, 8, 1, 1024, 64),
                                                   (4, 8, 2, 129, 2048, 128)])
def test_kv_cache_decoding(dtype, b, h, hkv, l_new, l_max, d):
    q = torch.randn(b, h, l_new, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(b, hkv, l_max, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(b, hkv, l_new, d, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    seqlens = torch.randint(0, l_max - l_new + 1, (b,), device="cuda", dtype=torch.int32)
    caches = [t.clone() for t in (k_cache, v_cache)]
    out = F.attention_with_kv_cache(q, k_cache, v_cache, seqlens, k_new, v_new, backend="triton")
    ref_caches = [t.double() for t in caches]
    ref64 = reference.attention_with_kv_cache(q.double(), *ref_caches, seqlens, k_new.double(), v_new.double())
    lp_caches = [t.clone() for t in caches]
    ref_lp = reference.attention_with_kv_cache(q, *lp_caches, seqlens, k_new, v_new)
    result = reference.oracle_compare("out", out, ref_lp, ref64, dtype)
    assert result.ok, result
    assert torch.equal(k_cache, lp_caches[0]) and torch.equal(v_cache, lp_caches[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", [1, 127, 1000, 4096, 70000])
def test_masked_softmax(dtype, lk):
    b, h, lq = 2, 4, 33
    scores = torch.randn(b, h, lq, lk, device="cuda", dtype=dtype) * 4
    mask = torch.rand(b, 1, lq, lk, device="cuda") < 0.9
    mask[0, 0, 3] = False  # a fully masked row
    p, seed = 0.1, 77
    torch.manual_seed(seed)
    keep = philox.dropout_keep_mask(philox.new_rng("cuda"), (b, h, lq, lk), p)

    def kernel(scores):
        torch.manual_seed(seed)
        return F.masked_softmax(scores, mask, scale=0.5, dropout_p=p, backend="triton")

    def ref(scores):
        return reference.masked_softmax(scores, mask, 0.5, False, p, keep=keep)

    reference.assert_oracle(reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"]), f"lk={lk}")
