"""Every config the Triton autotuners of attention and of the FFN GEMM can choose, run on a GPU
and checked against the float64 oracle (gpu).

The other gpu tests, verify and compute-sanitizer run with TRANSFORMER_FAST_AUTOTUNE=0: the
first config of each pruned list.  With tuning on (the benchmarks, and users by default) the
autotuner may pick any config its pruning keeps, and each is a differently compiled kernel.
Here the pruning's choice is forced to the index-th kept config (clamped to the list), for the
forward, dq and dk/dv kernels at once, on shapes with partial tiles and the masked, padded and
few-query paths; the configs that ran are named in a failure."""
import pytest
import torch

from transformer_fast import functional as F
from transformer_fast import reference, verify

from _functional_helpers import dt_id, make_masks, oracle_atol

# (B, H, Hkv, Lq, Lk, mask kind): causal with ragged blocks; padding (every tile masked, skipped
# padding blocks); a bool mask with few queries (the small-BLOCK_M forward configs).
CASES = [(2, 2, 2, 200, 200, "causal"), (2, 4, 2, 130, 200, "kpm"), (1, 2, 1, 40, 200, "bool_b1")]
MAX_CONFIGS = 7  # the longest list (the forward's at D = 128, 16-bit)


def _list_lengths(dtype, head_dim):
    from transformer_fast.kernels import attention as A

    if dtype == torch.float32:  # exact dots (torch's allow_tf32 is off by default)
        args = {"PRECISE": True, "BLOCK_D": max(16, 1 << (head_dim - 1).bit_length())}
        return [len(A._fp32_wanted(kind, args)) for kind in ("fwd", "dq", "dkdv")]
    d = A._dclass(head_dim)
    return [len(A._FWD_CONFIGS[d]), len(A._FWD_SMALL_M), len(A._DQ_CONFIGS[d]), len(A._DKDV_CONFIGS[d])]


@pytest.fixture
def forced_config(monkeypatch):
    from transformer_fast.kernels import attention as A

    tuners = (A._fwd, A._dq, A._dkdv)

    def force(index):
        monkeypatch.setattr(A, "first_config_unless_tuning",
                            lambda configs: [configs[min(index, len(configs) - 1)]])
        for t in tuners:
            t.cache.clear()

    yield force, tuners
    for t in tuners:
        t.cache.clear()


def test_the_index_range_covers_every_list():
    from transformer_fast.kernels import attention as A

    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (16, 64, 128, 256):
            assert max(_list_lengths(dtype, head_dim)) <= MAX_CONFIGS
    assert set(A._FWD_CONFIGS) == set(A._DQ_CONFIGS) == set(A._DKDV_CONFIGS) == {64, 128, 256}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1])
@pytest.mark.parametrize("index", range(MAX_CONFIGS))
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128),
                                             (torch.bfloat16, 256), (torch.float16, 128),
                                             (torch.float32, 64), (torch.float32, 256)], ids=lambda v: dt_id(v) if isinstance(v, torch.dtype) else str(v))
def test_each_kept_config_passes_the_oracle(forced_config, dtype, head_dim, index, case):
    if index >= max(_list_lengths(dtype, head_dim)):
        pytest.skip("past every list's end: the same configs as the last index")
    force, tuners = forced_config
    force(index)
    g = torch.Generator().manual_seed(1000 * head_dim + index)
    b, h, hkv, lq, lk, kind = case  # one case per test: each compiles its own kernels
    masks = make_masks(kind, b, h, lq, lk, dtype, g)
    masks = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in masks.items()}
    inputs = {
        "query": torch.randn(b, h, lq, head_dim, generator=g).to("cuda", dtype),
        "key": torch.randn(b, hkv, lk, head_dim, generator=g).to("cuda", dtype),
        "value": torch.randn(b, hkv, lk, head_dim, generator=g).to("cuda", dtype),
    }

    def kernel(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=h != hkv,
                                              backend="triton", **masks)

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(
            query, key, value, masks["attn_mask"], 0.0, masks["is_causal"], None, h != hkv,
            key_padding_mask=masks["key_padding_mask"])

    results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol("triton", dtype),
                                   seed=index)
    ran = "; ".join(f"{t.fn.__name__} {t.best_config}" for t in tuners)
    reference.assert_oracle(results, f"{kind} {b}x{h}x{hkv}x{lq}x{lk}x{head_dim} {dtype} with {ran}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "causal+kpm"])
def test_autotuned_atomic_dq_backward_passes_the_oracle(monkeypatch, kind):
    """With tuning on (every kept config timed on the call's own arguments), the backward that
    adds up dq by atomics in the dk/dv kernel (16-bit, rows of > 128 keys): the timed runs add
    into the same buffer, which the autotuner must zero before each and before the call's own
    run (reset_to_zero), or dq comes out several times too large."""
    from transformer_fast.kernels import attention as A

    monkeypatch.setenv("TRANSFORMER_FAST_AUTOTUNE", "1")
    for t in (A._fwd, A._dq, A._dkdv):
        t.cache.clear()
    b, h, hkv, lq, lk, d = 1, 4, 2, 300, 517, 128
    g = torch.Generator().manual_seed(11)
    masks = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
             for k, v in make_masks(kind, b, h, lq, lk, torch.bfloat16, g).items()}
    inputs = {n: torch.randn(b, hh, ll, d, generator=g).to("cuda", torch.bfloat16)
              for n, hh, ll in (("query", h, lq), ("key", hkv, lk), ("value", hkv, lk))}
    assert A._atomic_dq(A._Common(inputs["query"], inputs["key"], inputs["value"], None, None, False,
                                  d ** -0.5, 0.0, None, False), torch.bfloat16)

    def kernel(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=True, backend="triton", **masks)

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(
            query, key, value, masks["attn_mask"], 0.0, masks["is_causal"], None, True,
            key_padding_mask=masks["key_padding_mask"])

    results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol("triton", torch.bfloat16), seed=3)
    reference.assert_oracle(results, f"autotuned, {kind}, dkdv {A._dkdv.best_config}")


MAX_GEMM_CONFIGS = 10  # the longest list (the TMA kernel's)


def _gemm_list_length(dtype):
    from transformer_fast.kernels import ffn as FF

    # The pruning keeps 64-wide K blocks for 16-bit inputs and 32-wide ones for fp32; 16-bit
    # operands on a Hopper take the TMA kernel's list.
    pointer = len([c for c in FF._gemm_configs() if (c.kwargs["BLOCK_K"] >= 64) == (dtype != torch.float32)])
    return pointer if dtype == torch.float32 else max(pointer, len(FF._tma_configs()))


def _clear_gemm_caches(FF):
    FF._gemm_kernel.cache.clear()
    FF._gemm_tma_kernel.cache.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("activation, dropout_p", [("gelu", 0.1), ("relu", 0.0)])
@pytest.mark.parametrize("index", range(MAX_GEMM_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dt_id)
def test_each_kept_gemm_config_passes_the_oracle(monkeypatch, dtype, index, activation, dropout_p):
    """feed_forward forward and backward (every GEMM epilogue: bias + gelu + Philox dropout,
    the activation-gradient one, the plain ones) with the pruning forced to its index-th kept
    config, at M, d_model and d_ff that leave partial tiles.  (One activation per test: exact
    fp32 GEMMs take seconds each to compile.)"""
    from transformer_fast.kernels import ffn as FF

    if index >= _gemm_list_length(dtype):
        pytest.skip("past the list's end: the same configs as the last index")
    monkeypatch.setattr(FF, "first_config_unless_tuning", lambda configs: [configs[min(index, len(configs) - 1)]])
    _clear_gemm_caches(FF)
    try:
        torch.manual_seed(index)
        results = verify._feed_forward_runner((300, 136, 520), dtype, "cuda", activation, dropout_p)("triton")
        reference.assert_oracle(results, f"{activation} p={dropout_p} {dtype}\n{FF.recent_gemm_launches()}")
        assert not FF._TMA_FAILED, FF._TMA_FAILED  # (auto falls back to the pointer kernel, warning)
    finally:
        _clear_gemm_caches(FF)


def test_the_gemm_index_range_covers_the_list():
    assert max(_gemm_list_length(torch.bfloat16), _gemm_list_length(torch.float32)) <= MAX_GEMM_CONFIGS
