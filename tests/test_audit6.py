"""Parity and numerics items left by the fifth audit or found after it (2026-11-29, fifth
session): torch's mask-mismatch deprecation warnings, each as many times as torch gives it (the
encoder layer's own check inside a stack, the second check of MultiheadAttention); a head dim of
0 in scaled_dot_product_attention (torch: a softmax of zero scores, the mean of the values); the
cpu decode kernel's GEMM-like score loop with large logits; auto's CPU rule for prefill chunks.
The cases failed before their fix, compared with torch itself or the float64 oracle, except the
last test, which guards the cpu attention kernel where torch's own SDPA misses the oracle."""
from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fast
import transformer_fast.functional as tf
from transformer_fast import reference
from _functional_helpers import assert_kv_cache_on_oracle, large_logit_kv_cases, very_large_logit_kv_cases

E, H, FF, L = 16, 2, 32, 5
MASK_DTYPES = [None, torch.bool, torch.float32, torch.float64]


def _causal(dtype):
    if dtype is None:
        return None
    upper = torch.ones(L, L, dtype=torch.bool).triu(1)
    return upper if dtype == torch.bool else torch.zeros(L, L, dtype=dtype).masked_fill(upper, float("-inf"))


def _padding(dtype, batch=2):
    if dtype is None:
        return None
    pad = torch.zeros(batch, L, dtype=torch.bool)
    pad[-1, 3:] = True
    return pad if dtype == torch.bool else torch.zeros(batch, L, dtype=dtype).masked_fill(pad, float("-inf"))


def _warnings_and_output(call):
    """(the warnings' messages in order, the output or the exception's type name)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            out = type(exc).__name__
    messages = [str(w.message) for w in caught if "mismatched" in str(w.message)]
    return messages, out


def _compare(theirs, ours, call):
    want, out_t = _warnings_and_output(lambda: call(theirs))
    got, out_o = _warnings_and_output(lambda: call(ours))
    assert got == want
    if isinstance(out_t, str) or isinstance(out_o, str):
        assert (out_o if isinstance(out_o, str) else "ran") in (out_t, "Input" + out_t)
        return
    out_t = out_t[0] if isinstance(out_t, tuple) else out_t
    out_o = out_o[0] if isinstance(out_o, tuple) else out_o
    torch.testing.assert_close(out_o, out_t, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_dtype,pad_dtype", list(itertools.product(MASK_DTYPES, MASK_DTYPES)))
@pytest.mark.parametrize("training", [True, False])
def test_encoder_stack_warns_as_torch(mask_dtype, pad_dtype, training):
    """torch's stack checks the masks, then each layer checks them again as the stack made them
    (bool -> float), then each layer's attention twice: ours gives the same list, also on a
    second call (the stack's replay)."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True),
                                   2, enable_nested_tensor=False).train(training)
    ours = copy.deepcopy(theirs)
    transformer_fast.swap(ours)
    x = torch.randn(2, L, E)
    for _ in range(2):
        _compare(theirs, ours, lambda m: m(x, mask=_causal(mask_dtype),
                                           src_key_padding_mask=_padding(pad_dtype)))


@pytest.mark.parametrize("mask_dtype,pad_dtype", list(itertools.product(MASK_DTYPES, MASK_DTYPES)))
def test_transformer_warns_as_torch(mask_dtype, pad_dtype):
    torch.manual_seed(0)
    theirs = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True)
    ours = copy.deepcopy(theirs)
    transformer_fast.swap(ours)
    src, tgt = torch.randn(2, L, E), torch.randn(2, L, E)
    _compare(theirs, ours, lambda m: m(
        src, tgt, src_mask=_causal(mask_dtype), tgt_mask=_causal(mask_dtype),
        src_key_padding_mask=_padding(pad_dtype), tgt_key_padding_mask=_padding(pad_dtype),
        memory_key_padding_mask=_padding(pad_dtype)))


@pytest.mark.parametrize("mask_dtype,pad_dtype", list(itertools.product(MASK_DTYPES, MASK_DTYPES)))
@pytest.mark.parametrize("training,need_weights", [(True, True), (False, False), (False, True)])
def test_multihead_attention_warns_as_torch(mask_dtype, pad_dtype, training, need_weights):
    """torch checks the masks in MultiheadAttention.forward and again, bool masks made float,
    in F.multi_head_attention_forward: two float dtypes warn twice."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True).train(training)
    ours = transformer_fast.MultiheadAttention(E, H, batch_first=True).train(training)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, L, E)
    with torch.no_grad():
        _compare(theirs, ours, lambda m: m(x, x, x, attn_mask=_causal(mask_dtype),
                                           key_padding_mask=_padding(pad_dtype),
                                           need_weights=need_weights))


# ---- head dim 0


def _zero_dim_masks():
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1, 2:] = True
    bool_mask = torch.rand(3, 4) > 0.3
    bool_mask[0] = False  # a row with no key: zeros
    return [
        dict(),
        dict(is_causal=True),
        dict(attn_mask=bool_mask),
        dict(attn_mask=torch.randn(2, 3, 3, 4, dtype=torch.float64)),
        dict(key_padding_mask=pad),
        dict(scale=0.5),
    ]


def _torch_zero_dim(q, k, v, key_padding_mask=None, **kw):
    """torch's SDPA, with the padding mask and dead rows written the way ours defines them."""
    mask = kw.pop("attn_mask", None)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        mask = keep if mask is None else mask & keep
    # torch's math kernel: torch 2.12's F.scaled_dot_product_attention returns zeros for head dim 0
    add = mask
    if mask is not None and mask.dtype == torch.bool:  # the math op adds its mask as given
        add = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask=add, **kw)[0]
    out = torch.nan_to_num(out) if mask is not None else out  # rows with no key: NaN -> 0 below
    if mask is not None and mask.dtype == torch.bool:
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


@pytest.mark.parametrize("backend", ["reference", "torch", None])
@pytest.mark.parametrize("case", range(6))
def test_sdpa_head_dim_zero_is_the_softmax_of_zero_scores(backend, case):
    torch.manual_seed(case)
    kw = _zero_dim_masks()[case]
    q = torch.randn(2, 3, 3, 0, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 4, 0, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    out = tf.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    want = _torch_zero_dim(q, k, v, **kw)
    torch.testing.assert_close(out, want)
    assert not out.isnan().any()
    grad = torch.randn_like(out)
    (gv,) = torch.autograd.grad(out, v, grad)
    (gv_want,) = torch.autograd.grad(want, v, grad)
    torch.testing.assert_close(gv, gv_want)
    if kw == {}:
        torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))


# ---- the cpu decode kernel's GEMM-like score loop (16 or more packed rows) with large logits


@pytest.mark.parametrize("heads,kv_heads,lq,dim", [
    (16, 1, 1, 64), (16, 1, 1, 128), (32, 2, 1, 256), (4, 4, 32, 64), (2, 1, 16, 128),
])
def test_kv_cache_cpu_many_rows_with_large_logits_meets_the_oracle(heads, kv_heads, lq, dim):
    """A GQA group of 16 or a prefill chunk packs 16 or more query rows per key head, which
    the cpu kernel scores with its GEMM-like loop: in fp32 sums of 16 terms that loop went up
    to 10x past the oracle's bound where the logits are large."""
    for t, case in enumerate(large_logit_kv_cases(heads, kv_heads, lq, dim, draws=12, seed=3000)):
        assert_kv_cache_on_oracle(
            lambda *a: tf.attention_with_kv_cache(*a, backend="cpu"), case, f"draw {t}")


@pytest.mark.parametrize("heads,kv_heads,lq,want", [
    (8, 8, 1, "cpu"), (8, 8, 63, "cpu"), (8, 8, 64, "torch"), (32, 8, 16, "torch"), (32, 8, 15, "cpu"),
    (16, 1, 4, "torch"), (16, 1, 3, "cpu"),
])
def test_auto_sends_cpu_prefill_chunks_to_torch(heads, kv_heads, lq, want):
    """From 64 query rows per key head the cpu decode kernel measured slower than torch's GEMMs
    (benchmarks/cpu_kv_cache_prefill.py): auto takes torch there, the kernel below."""
    from transformer_fast import backends

    q = torch.randn(1, heads, lq, 16)
    kc, vc = torch.zeros(1, kv_heads, 80, 16), torch.zeros(1, kv_heads, 80, 16)
    kn, vn = torch.randn(1, kv_heads, lq, 16), torch.randn(1, kv_heads, lq, 16)
    lens = torch.tensor([3], dtype=torch.int32)
    with backends.recording_resolutions() as names:
        out = tf.attention_with_kv_cache(q, kc, vc, lens, kn, vn)
    assert names == [("attention_with_kv_cache", want)]
    ref = tf.attention_with_kv_cache(q, kc.clone(), vc.clone(), lens, kn, vn, backend="reference")
    torch.testing.assert_close(out, ref)


# ---- fp32 SDPA with very large logits, backward


@pytest.mark.parametrize("dim", [64, 128])
def test_sdpa_cpu_backend_gradients_meet_the_oracle_with_large_logits(dim):
    """The cpu attention kernel's gradients stay within the oracle's bound with logits of a
    standard deviation of ~34 (torch's own SDPA, the `torch` backend, does not there: README's
    Limits)."""
    for t in range(4):
        g = torch.Generator().manual_seed(7000 + t)
        length = (100, 300)[t % 2]
        q0 = torch.randn(1, 2, 8, dim, generator=g) * 34.0 * (128 / dim) ** 0.5
        k0, v0 = (torch.randn(1, 2, length, dim, generator=g) for _ in range(2))
        grad_out = torch.randn(1, 2, 8, dim, generator=g)

        def grads(fn, dtype):
            q, k, v = (x.to(dtype).requires_grad_() for x in (q0, k0, v0))
            out = fn(q, k, v)
            return (out,) + torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))

        want = grads(reference.scaled_dot_product_attention, torch.float64)
        naive = grads(reference.scaled_dot_product_attention, torch.float32)
        got = grads(lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, backend="cpu"),
                    torch.float32)
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, naive, want):
            bound = 2 * reference.max_abs_error(b, c) + reference.ATOL[torch.float32]
            assert reference.max_abs_error(a, c) <= bound, f"draw {t} {name}"


# ---- add_layer_norm, fp32 rows with a large common offset


def _offset_rows(seed, rows, n, mean, sd):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, n, generator=g) * sd,
            "residual": mean + torch.randn(rows, n, generator=g) * sd,
            "weight": 1 + torch.randn(n, generator=g), "bias": torch.randn(n, generator=g)}


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("rows,n,mean,sd", [(1, 16, 100.0, 1e-2), (1, 96, 1e4, 1.0), (4, 16, 100.0, 1e-2)])
def test_add_layer_norm_offset_rows_forward_meets_the_oracle(backend, rows, n, mean, sd):
    """A row whose mean is ~1e4 times its spread: a row sum in fp32 lanes (cpu) or an fp32
    tl.sum (triton) put the mean an ulp off, shifting every xhat of the row: out and dweight
    went up to 3.7x past the oracle's bound (cpu 23 / 300 draws, triton 5 / 60; these 60 draws:
    cpu 2 of 3 cases failed, triton's pass and guard).  The sums are double now.  (dx can still
    miss by an ulp where its values are large: README's Limits.)"""
    import os

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    names = ("x", "residual", "weight", "bias")
    for s in range(60):
        inp = _offset_rows(9000 + s, rows, n, mean, sd)
        args = [inp[k].requires_grad_() for k in names]
        out = tf.add_layer_norm(*args, backend=backend)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(s))
        got = (out,) + torch.autograd.grad(out, args[2:], grad)
        r64 = [a.detach().double().requires_grad_() for a in args]
        want = reference.add_layer_norm(*r64)
        want = (want,) + torch.autograd.grad(want, r64[2:], grad.double())
        rlp = [a.detach().clone().requires_grad_() for a in args]
        low = reference.add_layer_norm(*rlp)
        low = (low,) + torch.autograd.grad(low, rlp[2:], grad)
        for name, a, b, c in zip(("out", "dweight", "dbias"), got, low, want):
            bound = 2 * reference.max_abs_error(b, c) + reference.ATOL[torch.float32]
            assert reference.max_abs_error(a, c) <= bound, f"draw {s} {name}"


@pytest.mark.parametrize("heads,kv_heads,dim,lmax", [(4, 1, 64, 129), (16, 1, 128, 1000)])
def test_kv_cache_cpu_very_large_logits_meets_the_oracle(heads, kv_heads, dim, lmax):
    """Logits with a standard deviation of ~100: with the double dot rounded to an fp32 score
    and an fp32 running max the cpu kernel went up to 3.9x past the oracle's bound (1 of these
    60 draws at GQA 16, none at GQA 4); the score and running max now stay double."""
    cases = very_large_logit_kv_cases(range(5000, 5060), heads, kv_heads, dim, lmax)
    for seed, case in zip(range(5000, 5060), cases):
        assert_kv_cache_on_oracle(
            lambda *a: tf.attention_with_kv_cache(*a, backend="cpu"), case, f"seed {seed}")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_kv_cache_fp32_scores_not_rounded_to_fp32(backend):
    """The sixth audit's draw (logit std ~34, D 256, 4 keys) where two dominant scores of the
    fp32 reference carry nearly equal errors that cancel: a kernel that rounds each score once to
    fp32 went 1.70x (cpu) / 1.54x (triton) past the oracle's bound; scores and running max in
    double / fp64 meet it (0.12x / 0.19x)."""
    import os

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5279)
    a = 34 ** 0.5
    q = (torch.randn(1, 1, 1, 256, generator=g, dtype=torch.float64) * a).float()
    k = (torch.randn(1, 1, 4, 256, generator=g, dtype=torch.float64) * a).float()
    v = torch.randn(1, 1, 4, 256, generator=g, dtype=torch.float64).float()
    lens = torch.tensor([4], dtype=torch.int32)
    (r,) = reference.run_oracle(
        lambda q, k_cache, v_cache: tf.attention_with_kv_cache(q, k_cache, v_cache, lens, backend=backend),
        lambda q, k_cache, v_cache: reference.attention_with_kv_cache(q, k_cache, v_cache, lens),
        dict(q=q, k_cache=k, v_cache=v), (), seed=0)
    assert r.error <= r.bound, f"{r.error:.3e} > {r.bound:.3e}"
