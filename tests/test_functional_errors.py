"""Bad inputs to the functional ops (DESIGN section 9): a TypeError/ValueError naming the
argument, raised before any computation."""
import pytest
import torch

from transformer_fast import _checks, functional as F


def qkv(b=2, h=4, lq=5, lk=7, d=16, hkv=None, dtype=torch.float32):
    hkv = hkv or h
    return (torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype),
            torch.randn(b, hkv, lk, d, dtype=dtype))


Q, K, V = qkv()
META = torch.device("meta")

SDPA_BAD = {
    "query rank": (dict(query=torch.randn(16)), ValueError, "query"),  # (2-D broadcasts, as torch)
    "query not a tensor": (dict(query=[[1.0]]), TypeError, "query"),
    "key rank": (dict(key=torch.randn(2, 4, 7, 16, 1)), ValueError, "key"),
    "int query": (dict(query=torch.ones(2, 4, 5, 16, dtype=torch.int64)), TypeError, "query"),
    "dtype mix": (dict(key=K.double()), TypeError, "key"),
    "batch mismatch": (dict(key=torch.randn(3, 4, 7, 16), value=torch.randn(3, 4, 7, 16)), ValueError, "key"),
    "heads mismatch": (dict(key=torch.randn(2, 2, 7, 16), value=torch.randn(2, 2, 7, 16)), ValueError, "enable_gqa"),
    "gqa not dividing": (dict(key=torch.randn(2, 3, 7, 16), value=torch.randn(2, 3, 7, 16), enable_gqa=True), ValueError, "divide"),
    "value heads": (dict(value=torch.randn(2, 2, 7, 16)), ValueError, "value"),
    "head dim mismatch": (dict(key=torch.randn(2, 4, 7, 8)), ValueError, "key"),
    "value length": (dict(value=torch.randn(2, 4, 6, 16)), ValueError, "value"),
    "3-D gqa": (dict(query=torch.randn(4, 5, 16), key=torch.randn(3, 7, 16), value=torch.randn(3, 7, 16), enable_gqa=True), ValueError, "key"),
    "mask shape": (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask rank too big": (dict(attn_mask=torch.ones(1, 2, 4, 5, 7, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask batch": (dict(attn_mask=torch.ones(3, 1, 5, 7, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask int dtype": (dict(attn_mask=torch.ones(5, 7, dtype=torch.int32)), TypeError, "attn_mask"),
    "mask float64 for fp32": (dict(attn_mask=torch.zeros(5, 7, dtype=torch.float64)), TypeError, "attn_mask"),
    "mask not tensor": (dict(attn_mask=[[True]]), TypeError, "attn_mask"),
    "kpm shape": (dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), ValueError, "key_padding_mask"),
    "kpm batch": (dict(key_padding_mask=torch.zeros(1, 7, dtype=torch.bool)), ValueError, "key_padding_mask"),
    "kpm dtype": (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.int64)), TypeError, "key_padding_mask"),
    "key on another device": (dict(key=torch.empty(2, 4, 7, 16, device=META)), ValueError, "key on meta"),
    "mask on another device": (dict(attn_mask=torch.empty(5, 7, dtype=torch.bool, device=META)), ValueError, "attn_mask on meta"),
    "dropout 1": (dict(dropout_p=1.0), ValueError, "dropout_p"),
    "dropout negative": (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    "dropout str": (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    "is_causal not bool": (dict(is_causal=1), TypeError, "is_causal"),
    "scale inf": (dict(scale=float("inf")), ValueError, "scale"),
    "scale str": (dict(scale="1"), TypeError, "scale"),
    "unknown backend": (dict(backend="nope"), ValueError, "backend"),
}


@pytest.mark.parametrize("case", list(SDPA_BAD), ids=list(SDPA_BAD))
def test_sdpa_bad_inputs(case):
    overrides, exc, needle = SDPA_BAD[case]
    kwargs = dict(query=Q, key=K, value=V, backend="reference")
    kwargs.update(overrides)
    with pytest.raises(exc, match=needle):
        F.scaled_dot_product_attention(**kwargs)


def test_unimplemented_backend_lists_alternatives(monkeypatch):
    """Every op of the package now has every backend; an op registered for reference/torch only
    stands in for one whose fused kernels have not arrived yet."""
    from transformer_fast import backends
    from transformer_fast.backends import BackendError

    monkeypatch.setitem(backends._SUPPORT, "future_op", {})
    backends.register("future_op", "reference")
    backends.register("future_op", "torch")
    inputs = {"x": torch.randn(2, 3)}
    with pytest.raises(BackendError, match="no cpu implementation yet.*Backends that can: reference, torch"):
        backends.resolve("future_op", "cpu", inputs)
    assert backends.resolve("future_op", None, inputs) == "torch"


def test_errors_happen_before_computation(monkeypatch):
    """A validation error must come before anything runs: the backends are never reached."""
    import transformer_fast.reference as ref

    def boom(*a, **k):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(ref, "scaled_dot_product_attention", boom)
    monkeypatch.setattr(F, "_torch_sdpa", boom)
    k_cache = torch.zeros(2, 4, 8, 16)
    monkeypatch.setattr(ref, "attention_with_kv_cache", boom)
    monkeypatch.setattr(F, "_torch_kv_cache", boom)
    for backend in ("reference", "torch"):
        with pytest.raises(ValueError):
            F.scaled_dot_product_attention(Q, K, V, torch.ones(5, 6, dtype=torch.bool), backend=backend)
        with pytest.raises(ValueError):
            F.attention_with_kv_cache(
                torch.randn(2, 4, 1, 16), k_cache, k_cache.clone(), torch.tensor([8, 0], dtype=torch.int32),
                torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16), backend=backend,
            )
    assert (k_cache == 0).all()


# --------------------------------------------------------------------------------------------
# attention_with_kv_cache


def kv_inputs():
    return dict(
        q=torch.randn(2, 4, 1, 16),
        k_cache=torch.randn(2, 2, 8, 16),
        v_cache=torch.randn(2, 2, 8, 16),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        k_new=torch.randn(2, 2, 1, 16),
        v_new=torch.randn(2, 2, 1, 16),
    )


KV_BAD = {
    "q rank": (dict(q=torch.randn(2, 4, 16)), ValueError, "q"),
    "cache rank": (dict(k_cache=torch.randn(2, 8, 16)), ValueError, "k_cache"),
    "dtype mix": (dict(k_cache=torch.randn(2, 2, 8, 16, dtype=torch.float64)), TypeError, "k_cache"),
    "cache batch": (dict(k_cache=torch.randn(3, 2, 8, 16), v_cache=torch.randn(3, 2, 8, 16)), ValueError, "k_cache"),
    "cache head dim": (dict(k_cache=torch.randn(2, 2, 8, 8)), ValueError, "k_cache"),
    "heads not dividing": (dict(k_cache=torch.randn(2, 3, 8, 16), v_cache=torch.randn(2, 3, 8, 16),
                                k_new=torch.randn(2, 3, 1, 16), v_new=torch.randn(2, 3, 1, 16)), ValueError, "k_cache"),
    "v_cache length": (dict(v_cache=torch.randn(2, 2, 9, 16)), ValueError, "v_cache"),
    "k_new shape": (dict(k_new=torch.randn(2, 2, 2, 16)), ValueError, "k_new"),
    "v_new shape": (dict(v_new=torch.randn(2, 4, 1, 16)), ValueError, "v_new"),
    "only k_new": (dict(v_new=None), ValueError, "v_new"),
    "seqlens int64": (dict(cache_seqlens=torch.tensor([3, 7])), TypeError, "cache_seqlens"),
    "seqlens float": (dict(cache_seqlens=torch.tensor([3.0, 7.0])), TypeError, "cache_seqlens"),
    "seqlens list": (dict(cache_seqlens=[3, 7]), TypeError, "cache_seqlens"),
    "seqlens shape": (dict(cache_seqlens=torch.tensor([[3, 7]], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "seqlens batch": (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "seqlens negative": (dict(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "seqlens too large": (dict(cache_seqlens=torch.tensor([3, 8], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "chunk too large": (dict(q=torch.randn(2, 4, 9, 16), k_new=torch.randn(2, 2, 9, 16),
                             v_new=torch.randn(2, 2, 9, 16), cache_seqlens=torch.zeros(2, dtype=torch.int32)), ValueError, "L_max"),
    "cache on another device": (dict(v_cache=torch.empty(2, 2, 8, 16, device=META)), ValueError, "v_cache on meta"),
    "seqlens on another device": (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device=META)), ValueError, "cache_seqlens on meta"),
    "scale str": (dict(scale="x"), TypeError, "scale"),
    "leaf cache requiring grad": (dict(k_cache=torch.randn(2, 2, 8, 16, requires_grad=True)), ValueError, "k_cache"),
}


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(KV_BAD), ids=list(KV_BAD))
def test_kv_cache_bad_inputs(case, backend):
    overrides, exc, needle = KV_BAD[case]
    kwargs = kv_inputs()
    kwargs.update(overrides)
    kwargs["backend"] = backend
    with pytest.raises(exc, match=needle):
        F.attention_with_kv_cache(**kwargs)


def test_kv_cache_bounds_at_the_edge_are_fine():
    kwargs = kv_inputs()
    kwargs["cache_seqlens"] = torch.tensor([0, 7], dtype=torch.int32)  # 7 + 1 == L_max
    F.attention_with_kv_cache(**kwargs, backend="torch")


def test_kv_cache_value_checks_follow_the_flag(monkeypatch):
    """TRANSFORMER_FAST_CHECKS=0 turns the host read off (CPU included); =1 forces it on (on a
    GPU too); unset: CPU only."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.delenv(_checks.CHECKS_ENV, raising=False)
    assert _checks.host_checks_enabled(cpu) and not _checks.host_checks_enabled(meta)
    monkeypatch.setenv(_checks.CHECKS_ENV, "0")
    assert not _checks.host_checks_enabled(cpu)
    monkeypatch.setenv(_checks.CHECKS_ENV, "1")
    assert _checks.host_checks_enabled(cpu) and _checks.host_checks_enabled(torch.device("cuda"))


@pytest.mark.parametrize("flag, cpu_mode, cuda_mode", [
    (None, "host", "device"), ("0", "off", "off"), ("1", "host", "host"),
])
def test_kv_cache_value_check_mode(monkeypatch, flag, cpu_mode, cuda_mode):
    """Unset: a host read on the CPU, a device-side assert on a GPU; =0 neither (on a GPU too);
    =1 the host read everywhere; trusted_values() and the meta device: none."""
    if flag is None:
        monkeypatch.delenv(_checks.CHECKS_ENV, raising=False)
    else:
        monkeypatch.setenv(_checks.CHECKS_ENV, flag)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (_checks.value_check_mode(cpu), _checks.value_check_mode(cuda)) == (cpu_mode, cuda_mode)
    assert _checks.value_check_mode(torch.device("meta")) == "off"
    with _checks.trusted_values():
        with _checks.trusted_values():
            assert _checks.value_check_mode(cuda) == _checks.value_check_mode(cpu) == "off"
        assert _checks.value_check_mode(cpu) == "off"
    assert _checks.value_check_mode(cpu) == cpu_mode


def test_kv_cache_trusted_values_skip_the_bounds_check(monkeypatch):
    """Inside trusted_values() the lengths' values are not checked (the caller vouches for
    them: no host read, no device-side assert); their shape still is."""
    seen = []
    real = _checks.value_check_mode
    monkeypatch.setattr(_checks, "value_check_mode", lambda device: seen.append(real(device)) or seen[-1])
    monkeypatch.delenv(_checks.CHECKS_ENV, raising=False)
    kwargs = kv_inputs()
    with _checks.trusted_values():
        F.attention_with_kv_cache(**kwargs, backend="torch")
        with pytest.raises(ValueError, match="cache_seqlens"):
            F.attention_with_kv_cache(**dict(kwargs, cache_seqlens=torch.zeros(3, dtype=torch.int32)),
                                      backend="torch")
    F.attention_with_kv_cache(**kwargs, backend="torch")
    assert seen == ["off", "host"]


@pytest.mark.gpu
def test_kv_cache_gpu_bounds():
    """On CUDA: ValueError with TRANSFORMER_FAST_CHECKS=1 (host read); otherwise the call does
    not synchronise (device-side assert), and in-range calls pass."""
    kwargs = {k: v.cuda() for k, v in kv_inputs().items()}
    F.attention_with_kv_cache(**kwargs, backend="torch")
    torch.cuda.synchronize()
    bad = dict(kwargs, cache_seqlens=torch.tensor([3, 8], dtype=torch.int32, device="cuda"))
    import os

    old = os.environ.get(_checks.CHECKS_ENV)
    os.environ[_checks.CHECKS_ENV] = "1"
    try:
        with pytest.raises(ValueError, match="cache_seqlens"):
            F.attention_with_kv_cache(**bad, backend="torch")
    finally:
        if old is None:
            del os.environ[_checks.CHECKS_ENV]
        else:
            os.environ[_checks.CHECKS_ENV] = old


# --------------------------------------------------------------------------------------------
# masked_softmax


SOFTMAX_BAD = {
    "not a tensor": (dict(scores=[1.0, 2.0]), TypeError, "scores"),
    "int scores": (dict(scores=torch.ones(3, 4, dtype=torch.int64)), TypeError, "scores"),
    "0-d scores": (dict(scores=torch.tensor(1.0)), ValueError, "scores"),
    "causal on 1-D": (dict(scores=torch.randn(4), is_causal=True), ValueError, "scores"),
    "mask shape": (dict(mask=torch.ones(3, 5, dtype=torch.bool)), ValueError, "mask"),
    "mask bigger rank": (dict(mask=torch.ones(2, 3, 4, dtype=torch.bool)), ValueError, "mask"),
    "mask dtype": (dict(mask=torch.ones(3, 4, dtype=torch.uint8)), TypeError, "mask"),
    "mask device": (dict(mask=torch.empty(3, 4, dtype=torch.bool, device=META)), ValueError, "mask on meta"),
    "scale str": (dict(scale="2"), TypeError, "scale"),
    "scale nan": (dict(scale=float("nan")), ValueError, "scale"),
    "dropout": (dict(dropout_p=1.5), ValueError, "dropout_p"),
    "is_causal": (dict(is_causal="yes"), TypeError, "is_causal"),
}


@pytest.mark.parametrize("case", list(SOFTMAX_BAD), ids=list(SOFTMAX_BAD))
def test_masked_softmax_bad_inputs(case):
    overrides, exc, needle = SOFTMAX_BAD[case]
    kwargs = dict(scores=torch.randn(3, 4), backend="torch")
    kwargs.update(overrides)
    with pytest.raises(exc, match=needle):
        F.masked_softmax(**kwargs)


# --------------------------------------------------------------------------------------------
# feed_forward


def ffn_inputs():
    return dict(x=torch.randn(3, 8), w1=torch.randn(32, 8), b1=torch.randn(32), w2=torch.randn(8, 32), b2=torch.randn(8))


FFN_BAD = {
    "x not tensor": (dict(x=1.0), TypeError, "x"),
    "x 0-d": (dict(x=torch.tensor(1.0)), ValueError, "x"),
    "w1 rank": (dict(w1=torch.randn(32 * 8)), ValueError, "w1"),
    "w1 in_features": (dict(w1=torch.randn(32, 9)), ValueError, "w1"),
    "w1 transposed": (dict(w1=torch.randn(8, 32)), ValueError, "w1"),
    "b1 shape": (dict(b1=torch.randn(31)), ValueError, "b1"),
    "w2 shape": (dict(w2=torch.randn(8, 31)), ValueError, "w2"),
    "b2 shape": (dict(b2=torch.randn(9)), ValueError, "b2"),
    "dtype mix": (dict(w2=torch.randn(8, 32, dtype=torch.float16)), TypeError, "w2"),
    "device": (dict(b1=torch.empty(32, device=META)), ValueError, "b1 on meta"),
    "activation unknown": (dict(activation="swish"), ValueError, "activation"),
    "activation type": (dict(activation=None), TypeError, "activation"),
    "dropout": (dict(dropout_p=1.0), ValueError, "dropout_p"),
}


@pytest.mark.parametrize("case", list(FFN_BAD), ids=list(FFN_BAD))
def test_feed_forward_bad_inputs(case):
    overrides, exc, needle = FFN_BAD[case]
    kwargs = ffn_inputs()
    kwargs.update(overrides)
    with pytest.raises(exc, match=needle):
        F.feed_forward(**kwargs, backend="torch")
