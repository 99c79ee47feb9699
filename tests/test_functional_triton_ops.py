"""functional.masked_softmax and functional.attention_with_kv_cache with backend="triton": the
whole path (validation, reshapes, custom ops, autograd) against the float64 oracle. Without a
GPU the kernels run in the Triton interpreter on CPU tensors."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F
from transformer_fast import philox, reference

from _functional_helpers import DTYPES, dt_id, generator, randn
from conftest import require_backend

pytestmark = pytest.mark.triton


@pytest.fixture
def device():
    return require_backend("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize(
    "shape,mask_shape,is_causal",
    [((9,), None, False), ((7, 13), (7, 13), True), ((2, 5, 33), (1, 33), False),
     ((2, 3, 6, 17), (2, 1, 6, 17), True), ((2, 2, 2, 4, 9), (4, 9), False)],
)
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
def test_masked_softmax(device, dtype, shape, mask_shape, is_causal, mask_dtype):
    g = generator()
    scores = randn(*shape, dtype=dtype, g=g, scale=3.0).to(device)
    mask = None
    if mask_shape is not None:
        allowed = torch.rand(mask_shape, generator=g) < 0.75
        allowed.view(-1, mask_shape[-1])[0] = False  # a fully masked row
        mask = allowed if mask_dtype == "bool" else torch.zeros(mask_shape).masked_fill(~allowed, float("-inf")).to(dtype)
        mask = mask.to(device)

    def kernel(scores):
        return F.masked_softmax(scores, mask, scale=0.7, is_causal=is_causal, backend="triton")

    def ref(scores):
        return reference.masked_softmax(scores, mask, 0.7, is_causal)

    reference.assert_oracle(reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"]), str(shape))


def test_masked_softmax_dropout_exact(device):
    scores = torch.randn(2, 3, 5, 40, device=device)
    p, seed = 0.25, 99
    torch.manual_seed(seed)
    keep = philox.dropout_keep_mask(philox.new_rng(device), scores.shape, p)

    def kernel(scores):
        torch.manual_seed(seed)
        return F.masked_softmax(scores, dropout_p=p, backend="triton")

    def ref(scores):
        return reference.masked_softmax(scores, None, 1.0, False, p, keep=keep)

    reference.assert_oracle(reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"]), "dropout")


def test_masked_softmax_mask_grad_not_supported(device):
    scores = torch.randn(3, 4, device=device)
    mask = torch.zeros(3, 4, device=device, requires_grad=True)
    with pytest.raises(tf.BackendError, match="gradient of a float mask"):
        F.masked_softmax(scores, mask, backend="triton")


def _caches(b, hkv, l_max, d, dtype, device, g):
    return (randn(b, hkv, l_max, d, dtype=dtype, g=g).to(device), randn(b, hkv, l_max, d, dtype=dtype, g=g).to(device))


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("b,h,hkv,l_new,l_max,d,with_new", [
    (2, 4, 2, 1, 40, 64, True), (3, 2, 2, 5, 33, 32, True), (1, 4, 1, 3, 70, 128, False),
])
def test_kv_cache_against_reference(device, dtype, b, h, hkv, l_new, l_max, d, with_new):
    g = generator()
    q = randn(b, h, l_new, d, dtype=dtype, g=g).to(device)
    k_cache, v_cache = _caches(b, hkv, l_max, d, dtype, device, g)
    k_new = v_new = None
    if with_new:
        k_new, v_new = (randn(b, hkv, l_new, d, dtype=dtype, g=g).to(device) for _ in range(2))
    lengths = torch.randint(0 if with_new else l_new, l_max - l_new + 1, (b,), generator=g).to(torch.int32).to(device)
    ours = [t.clone() for t in (k_cache, v_cache)]
    out = F.attention_with_kv_cache(q, *ours, lengths, k_new, v_new, backend="triton")
    lp = [t.clone() for t in (k_cache, v_cache)]
    ref_lp = reference.attention_with_kv_cache(q, *lp, lengths, k_new, v_new)
    ref64 = reference.attention_with_kv_cache(
        q.double(), *(t.double() for t in (k_cache, v_cache)), lengths,
        None if k_new is None else k_new.double(), None if v_new is None else v_new.double(),
    )
    result = reference.oracle_compare("out", out, ref_lp, ref64, dtype)
    assert result.ok, result
    assert torch.equal(ours[0], lp[0]) and torch.equal(ours[1], lp[1])


def test_decoding_loop_equals_full_causal_attention(device):
    b, h, d, prompt, steps, l_max = 2, 2, 32, 6, 4, 16
    total = prompt + steps
    q, k, v = (torch.randn(b, h, total, d, device=device) for _ in range(3))
    k_cache = torch.zeros(b, h, l_max, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    lengths = torch.zeros(b, dtype=torch.int32, device=device)
    outs = [F.attention_with_kv_cache(q[:, :, :prompt], k_cache, v_cache, lengths,
                                      k[:, :, :prompt], v[:, :, :prompt], backend="triton")]
    lengths += prompt
    for t in range(prompt, total):
        s = slice(t, t + 1)
        outs.append(F.attention_with_kv_cache(q[:, :, s], k_cache, v_cache, lengths, k[:, :, s], v[:, :, s], backend="triton"))
        lengths += 1
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_requires_grad_falls_back(device):
    q = torch.randn(1, 2, 1, 16, device=device, requires_grad=True)
    k_cache, v_cache = torch.randn(1, 2, 8, 16, device=device), torch.randn(1, 2, 8, 16, device=device)
    lengths = torch.tensor([3], dtype=torch.int32, device=device)
    reasons = tf.not_supported_reasons("triton", "attention_with_kv_cache",
                                       {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": lengths})
    assert any("inference only" in r for r in reasons)
    with torch.no_grad():
        F.attention_with_kv_cache(q, k_cache, v_cache, lengths, backend="triton")
