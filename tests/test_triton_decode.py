"""Triton KV-cache attention (kernels/decode.py) against a float64 naive reference.

Runs the launcher directly (no autograd) on CPU tensors through TRITON_INTERPRET=1 when there is
no GPU, on CUDA otherwise.  Oracle: DESIGN section 6 for the output; the caches after the call
must equal the reference's caches exactly.  The kernel's cache copies are NaN-poisoned from each
row's cache_seqlens on before the call, so a kernel that reads a key beyond a row's valid length
(or fails to append k_new / v_new) produces NaN and fails.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from transformer_fast import reference  # noqa: E402
from transformer_fast.reference import ATOL, assert_oracle, oracle_compare, poisoned_outputs  # noqa: E402

decode = pytest.importorskip("transformer_fast.kernels.decode")
from triton_gpu_math import gpu_fp32_math  # noqa: E402,F401  (the fixture)

pytestmark = [pytest.mark.triton]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Helpers


def make_case(B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new=True, Dv=None, seed=0):
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).to(DEVICE)

    q = rnd(B, H, L_new, D)
    k_cache = rnd(B, Hkv, L_max, D)
    v_cache = rnd(B, Hkv, L_max, Dv)
    k_new = rnd(B, Hkv, L_new, D) if with_new else None
    v_new = rnd(B, Hkv, L_new, Dv) if with_new else None
    seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    assert seqlens.shape == (B,)
    return q, k_cache, v_cache, seqlens, k_new, v_new


def _poison_tail(cache, starts):
    """NaN from position starts[b] on in row b (in place)."""
    pos = torch.arange(cache.shape[2], device=cache.device)
    tail = pos[None, :] >= starts.to(cache.device).long()[:, None]  # (B, L_max)
    cache.masked_fill_(tail[:, None, :, None], float("nan"))
    return cache


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, dtype):
    kc, vc = k_cache.to(dtype).clone(), v_cache.to(dtype).clone()
    out = reference.attention_with_kv_cache(q.to(dtype), kc, vc, seqlens,
                                            _cast(k_new, dtype), _cast(v_new, dtype), scale)
    return out, kc, vc


def run_kernel(q, k_cache, v_cache, seqlens, k_new, v_new, scale, allow_tf32=False, num_splits=None):
    """The kernel on cache copies NaN-poisoned from each row's cache_seqlens on."""
    kc = _poison_tail(k_cache.clone(), seqlens)
    vc = _poison_tail(v_cache.clone(), seqlens)
    with poisoned_outputs():
        out = decode.attention_with_kv_cache_fwd(q, kc, vc, seqlens, k_new, v_new, scale,
                                                 allow_tf32, num_splits=num_splits)
    return out, kc, vc


def check(q, k_cache, v_cache, seqlens, k_new, v_new, scale=None, allow_tf32=False, num_splits=None,
          atol=None, context=""):
    dtype = q.dtype
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    ref64, kc64, vc64 = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, torch.float64)
    ref_lp, kc_lp, vc_lp = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, dtype)
    out, kc, vc = run_kernel(q, k_cache, v_cache, seqlens, k_new, v_new, scale, allow_tf32, num_splits)
    assert out.shape == ref64.shape and out.dtype == dtype and out.is_contiguous()
    assert_oracle([oracle_compare("out", out, ref_lp, ref64, dtype, atol)], context)
    # Caches: the reference's exactly, with the never-written tail still NaN.
    n_keys = seqlens + (q.shape[2] if k_new is not None else 0)
    for name, got, want in (("k_cache", kc, kc_lp), ("v_cache", vc, vc_lp)):
        want = _poison_tail(want.clone(), n_keys)
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: wrong positions written ({context})"
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{name} != reference ({context})"
    return out


# ---------------------------------------------------------------------------------------------
# The grid

# (B, H, Hkv, L_new, L_max, D, dtype, cache_seqlens, with_new).  L_max is never a multiple of the
# interpreter's key block (16); every case has a row at 0 or at L_max - L_new.
CASES = [
    (3, 4, 2, 1, 45, 64, F32, [0, 44, 20], True),  # GQA decoding step
    (3, 4, 2, 3, 45, 64, F16, [0, 42, 17], True),  # GQA, short chunk
    (2, 4, 1, 17, 50, 16, BF16, [0, 33], True),  # MQA prefill chunk (packed rows span 2 tiles)
    (2, 4, 4, 3, 37, 128, F32, [5, 34], False),  # MHA, no k_new
    (3, 4, 2, 3, 37, 80, BF16, [1, 37, 0], False),  # no k_new, rows with nothing to attend to
    (1, 2, 2, 1, 70, 256, F16, [69], True),  # D = 256, cache full after the append
    (2, 2, 1, 17, 40, 64, F32, [0, 23], True),
    (1, 8, 1, 1, 33, 128, BF16, [32], True),  # MQA decoding: 8 query heads share each K/V tile
]


def _case_id(c):
    B, H, Hkv, L, Lm, D, dt, sl, new = c
    return f"B{B}-H{H}x{Hkv}-L{L}-Lmax{Lm}-D{D}-{str(dt)[6:]}-{'new' if new else 'nonew'}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kv_cache_attention(case):
    B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new = case
    inputs = make_case(B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new)
    out1 = check(*inputs, num_splits=1, context=f"{_case_id(case)} no split")
    # Forced split-K: more splits than some rows have key blocks (splits beyond a row's length).
    out3 = check(*inputs, num_splits=3, context=f"{_case_id(case)} 3 splits")
    # Same math up to the order of fp32 accumulation.
    tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
    torch.testing.assert_close(out3.float(), out1.float(), rtol=tol, atol=tol)


def test_value_head_dim_differs():
    inputs = make_case(2, 4, 2, 3, 30, 64, F16, [0, 27], True, Dv=32)
    check(*inputs, num_splits=1, context="Dv=32")
    check(*inputs, num_splits=2, context="Dv=32 split")


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_split_counts(splits):
    # B=1 with a long-ish cache: 16 splits leave most of the splits empty for the short row.
    inputs = make_case(2, 2, 1, 2, 61, 32, F32, [59, 4], True, seed=splits)
    check(*inputs, num_splits=splits, context=f"{splits} splits")


def test_default_heuristic_path():
    inputs = make_case(1, 2, 1, 1, 64, 64, F16, [40], True, seed=3)
    check(*inputs, context="heuristic")


def test_tf32_path():
    inputs = make_case(2, 4, 2, 3, 35, 64, F32, [7, 32], True, seed=4)
    check(*inputs, allow_tf32=True, num_splits=2, atol=reference.TF32_ATOL, context="tf32")


def test_scale_and_int64_offsets(monkeypatch):
    monkeypatch.setattr(decode, "FORCE_OFF64", True)
    inputs = make_case(2, 4, 2, 3, 35, 64, F16, [0, 32], True, seed=5)
    check(*inputs, scale=0.3, num_splits=2, context="off64")


def test_strided_inputs():
    """q a transposed (B, L, H, D) view; caches slices of bigger (B, L, Hkv, D') buffers; k_new /
    v_new transposed views too.  The caches must be written through their strides."""
    B, H, Hkv, L_new, L_max, D = 2, 4, 2, 3, 29, 64
    g = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(F16).to(DEVICE)

    q = rnd(B, L_new, H, D).transpose(1, 2)
    k_buf = rnd(B, L_max + 5, Hkv + 1, D + 16)
    v_buf = rnd(B, L_max + 5, Hkv + 1, D + 16)
    k_cache = k_buf[:, 2:L_max + 2, 1:, 8:D + 8].transpose(1, 2)
    v_cache = v_buf[:, 2:L_max + 2, 1:, 8:D + 8].transpose(1, 2)
    k_new = rnd(B, L_new, Hkv, D).transpose(1, 2)
    v_new = rnd(B, L_new, Hkv, D).transpose(1, 2)
    seqlens = torch.tensor([0, L_max - L_new], dtype=torch.int32, device=DEVICE)
    assert not q.is_contiguous() and not k_cache.is_contiguous() and k_cache.stride(-1) == 1
    scale = D ** -0.5
    ref64, kc64, vc64 = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, torch.float64)
    ref_lp, kc_lp, vc_lp = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, F16)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    with poisoned_outputs():
        out = decode.attention_with_kv_cache_fwd(q, k_cache, v_cache, seqlens, k_new, v_new, scale,
                                                 False, num_splits=2)
    assert_oracle([oracle_compare("out", out, ref_lp, ref64, F16)], "strided")
    assert torch.equal(k_cache, kc_lp) and torch.equal(v_cache, vc_lp)
    # Nothing outside the cache views changed.
    outside = torch.ones_like(k_buf, dtype=torch.bool)
    outside[:, 2:L_max + 2, 1:, 8:D + 8] = False
    assert torch.equal(k_buf[outside], k_before[outside]) and torch.equal(v_buf[outside], v_before[outside])


def test_empty_shapes():
    q, kc, vc, sl, kn, vn = make_case(2, 2, 1, 1, 8, 16, F32, [0, 3], True)
    out = decode.attention_with_kv_cache_fwd(q[:, :, :0], kc, vc, sl, kn[:, :, :0], vn[:, :, :0], 0.25, False)
    assert out.shape == (2, 2, 0, 16)
    out = decode.attention_with_kv_cache_fwd(q, kc[:, :, :0], vc[:, :, :0], sl * 0, None, None, 0.25, False)
    assert out.shape == (2, 2, 1, 16) and not out.any()


def test_decoding_loop_equals_full_causal_attention():
    """Prefill a chunk, then 5 single-token steps advancing cache_seqlens: every step equals full
    causal attention over the concatenated sequence (rows start from different prefixes)."""
    B, H, Hkv, D, dtype = 2, 4, 2, 32, F32
    chunk, steps, L_max = 7, 5, 23
    prefix = [0, 9]  # row 1 starts with 9 keys already cached (their queries are not ours)
    T = chunk + steps
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q_all = rnd(B, H, max(prefix) + T, D)
    k_all = rnd(B, Hkv, max(prefix) + T, D)
    v_all = rnd(B, Hkv, max(prefix) + T, D)
    k_cache = rnd(B, Hkv, L_max, D)
    v_cache = rnd(B, Hkv, L_max, D)
    for b, p in enumerate(prefix):
        k_cache[b, :, :p] = k_all[b, :, :p]
        v_cache[b, :, :p] = v_all[b, :, :p]
    seqlens = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    scale = D ** -0.5

    outs = []
    spans = [(0, chunk)] + [(chunk + i, chunk + i + 1) for i in range(steps)]
    for i, (a, e) in enumerate(spans):
        sel = torch.stack([torch.arange(p + a, p + e) for p in prefix]).to(DEVICE)  # (B, e - a)
        pick = torch.arange(B, device=DEVICE)[:, None]
        q = q_all.transpose(1, 2)[pick, sel].transpose(1, 2)
        kn = k_all.transpose(1, 2)[pick, sel].transpose(1, 2)
        vn = v_all.transpose(1, 2)[pick, sel].transpose(1, 2)
        with poisoned_outputs():
            outs.append(decode.attention_with_kv_cache_fwd(q, k_cache, v_cache, seqlens, kn, vn, scale,
                                                           False, num_splits=1 + i % 3))
        seqlens = seqlens + (e - a)
    got = torch.cat(outs, dim=2)  # (B, H, T, D)

    for b, p in enumerate(prefix):
        n = p + T
        args = [t[b:b + 1, :, :n] for t in (q_all, k_all, v_all)]
        ref64 = reference.scaled_dot_product_attention(*[t.double() for t in args], is_causal=True,
                                                       scale=scale, enable_gqa=True)[:, :, p:]
        ref_lp = reference.scaled_dot_product_attention(*args, is_causal=True, scale=scale,
                                                        enable_gqa=True)[:, :, p:]
        assert_oracle([oracle_compare(f"row {b}", got[b:b + 1], ref_lp, ref64, dtype)], "decoding loop")
        assert torch.equal(k_cache[b, :, :n], k_all[b, :, :n])
        assert torch.equal(v_cache[b, :, :n], v_all[b, :, :n])


def test_split_heuristic():
    h = decode.num_splits_heuristic
    assert h(programs=264, slots=264, n_blocks=512) == 1  # the grid already fills the GPU
    assert h(programs=8, slots=264, n_blocks=1) == 1  # nothing to split
    s = h(programs=8, slots=264, n_blocks=512)  # B=1, 8 KV heads, 32k cache
    assert 16 <= s <= decode.MAX_SPLITS and 8 * s <= 264
    assert h(programs=8, slots=264, n_blocks=4) <= 4
    assert h(programs=1, slots=264, n_blocks=10_000) <= decode.MAX_SPLITS


# ---------------------------------------------------------------------------------------------
# Larger sweep (pytest -m slow)

SLOW_HEAD_DIMS = [16, 32, 64, 80, 96, 128, 160, 192, 256]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("D", SLOW_HEAD_DIMS)
@pytest.mark.parametrize("L_new,with_new", [(1, True), (5, True), (17, False)])
def test_kv_cache_attention_sweep(D, dtype, L_new, with_new):
    L_max = 71
    lo = L_new if not with_new else 0
    seqlens = [lo, L_max - (L_new if with_new else 0), 31]
    inputs = make_case(3, 6, 2, L_new, L_max, D, dtype, seqlens, with_new, seed=D + L_new)
    for splits in (1, 4):
        check(*inputs, num_splits=splits, context=f"D{D} {dtype} L{L_new} splits {splits}")


@pytest.mark.parametrize("strided", ["both", "k", "v"])
def test_cache_without_unit_last_stride(strided):
    """A cache whose last stride is not 1 (slow path: torch append, contiguous read copy); with
    one such cache the other is appended by the kernel alone (a value head dim of its own)."""
    B, H, Hkv, L_new, L_max, D, Dv = 2, 2, 1, 2, 21, 16, 32
    q, _, _, seqlens, k_new, v_new = make_case(B, H, Hkv, L_new, L_max, D, F32, [0, 19], True, Dv=Dv,
                                               seed=13)
    g = torch.Generator().manual_seed(14)

    def cache(dim, transposed):
        if transposed:
            return torch.randn(B, Hkv, dim, L_max, generator=g).to(DEVICE).transpose(2, 3)
        return torch.randn(B, Hkv, L_max, dim, generator=g).to(DEVICE)

    k_cache, v_cache = cache(D, strided != "v"), cache(Dv, strided != "k")
    assert (k_cache.stride(-1) != 1) == (strided != "v") and (v_cache.stride(-1) != 1) == (strided != "k")
    check(q, k_cache, v_cache, seqlens, k_new, v_new, num_splits=2, context=f"last stride != 1 ({strided})")


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (16, 1)])
@pytest.mark.parametrize("math", ["numpy", "gpu"])
def test_fp32_large_logits_meet_the_oracle(request, heads, kv_heads, math):
    """Logits with a standard deviation of ~34 (a peaked softmax turns a score's absolute error
    into the output's relative error): the exact-fp32 path's q.k (an fp32 dot, then the fp32
    scaling) went up to 4.5x past the oracle's bound in the interpreter (2 of 12 draws at GQA 1,
    7 at GQA 16); q.k and its scaling in fp64, rounded once, and an fp64 split lse meet it.
    "gpu": with exp2 and division as inexact as the GPU's (triton_gpu_math)."""
    if math == "gpu":
        request.getfixturevalue("gpu_fp32_math")
    from _functional_helpers import assert_kv_cache_on_oracle, large_logit_kv_cases

    def run(q, kc, vc, lens, kn, vn):
        args = [t.to(DEVICE) for t in (q, kc, vc, lens, kn, vn)]
        return decode.attention_with_kv_cache_fwd(*args, q.shape[-1] ** -0.5, False).cpu()

    for t, case in enumerate(large_logit_kv_cases(heads, kv_heads, 1, 128, draws=12, seed=3000)):
        assert_kv_cache_on_oracle(run, case, f"draw {t}")


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("math", ["numpy", "gpu"])
def test_fp32_very_large_logits_meet_the_oracle(request, splits, math):
    """Logits with a standard deviation of ~100: with the fp64 score rounded to fp32 and an fp32
    running max the exact-fp32 path went past the oracle's bound (interpreter); the score and
    running max now stay fp64 and only s - m goes to fp32.  "gpu": with exp2 and division as
    inexact as the GPU's (triton_gpu_math)."""
    if math == "gpu":
        request.getfixturevalue("gpu_fp32_math")
    from _functional_helpers import assert_kv_cache_on_oracle, very_large_logit_kv_cases

    def run(q, kc, vc, lens, kn, vn):
        args = [t.to(DEVICE) for t in (q, kc, vc, lens, kn, vn)]
        return decode.attention_with_kv_cache_fwd(*args, q.shape[-1] ** -0.5, False,
                                                  num_splits=splits).cpu()

    for seed, case in zip(range(4000, 4008), very_large_logit_kv_cases(range(4000, 4008))):
        assert_kv_cache_on_oracle(run, case, f"seed {seed}")
