"""Property-based fuzzing of every functional op on every backend that runs here, against the
float64 reference with the DESIGN section 6 oracle (issue 9).

Hypothesis draws shapes (1 and odd sizes included), dtypes, strides (transposed and sliced
views), mask kinds and densities, scales and GQA ratios; inputs are then fresh random draws.
The default run has a small fixed budget per op and backend (TF_FUZZ_EXAMPLES, default 6);
`pytest -m slow tests/test_fuzz.py` runs the large budget (TF_FUZZ_SLOW_EXAMPLES, default 500
per op and backend).  A failure found here becomes a fixed-input regression test at the end of this file.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_fast import backends, functional as F, reference

from _functional_helpers import oracle_atol

FAST = int(os.environ.get("TF_FUZZ_EXAMPLES", "6"))
SLOW = int(os.environ.get("TF_FUZZ_SLOW_EXAMPLES", "500"))
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
ALL_BACKENDS = ("reference", "torch", "cpu", "triton")


def fuzz_tests(body):
    """Two tests from ``body(backend, data)``: a small budget in the default run and a large
    one under -m slow, each parametrised over the backends."""
    params = [
        pytest.param(name, marks=[pytest.mark.triton] if name == "triton" else [], id=name)
        for name in ALL_BACKENDS
    ]
    common = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))

    def make(budget):
        def test(backend, data):
            body(backend, data)

        test = given(data=st.data())(test)
        return pytest.mark.parametrize("backend", params)(settings(max_examples=budget, **common)(test))

    return make(FAST), pytest.mark.slow(make(SLOW))


def runnable(backend, op, inputs, device="cpu"):
    ok, why = backends.available(backend, device)
    if not ok:
        pytest.skip(why)
    if backend not in backends.implemented_backends(op):
        pytest.skip(f"{op} has no {backend} implementation")
    return not backends.not_supported_reasons(backend, op, inputs)


def tensor(data, shape, dtype, layout="contiguous"):
    """A random tensor of ``shape`` laid out as drawn: contiguous, transposed in its last two
    dims, or a slice of a larger buffer (non-unit row stride)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    if layout == "transposed" and len(shape) >= 2:
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype)
        return t.transpose(-1, -2)
    if layout == "sliced":
        t = torch.randn(*shape[:-1], shape[-1] + 3, generator=g).to(dtype)
        return t[..., 1 : 1 + shape[-1]]
    return torch.randn(*shape, generator=g).to(dtype)


LAYOUTS = st.sampled_from(["contiguous", "transposed", "sliced"])
LENGTHS = st.one_of(st.sampled_from([1, 7, 16, 33]), st.integers(1, 48))
# Mostly the small head dims (fast under the interpreter); the larger ones of the attention
# issue's list often enough that each is drawn in a slow run (their kernels pick other tiles).
HEAD_DIMS = st.one_of(st.sampled_from([16, 32, 40, 64]), st.sampled_from([80, 96, 128, 160, 192, 256]))


def check(data, kernel, ref, inputs, grads, backend, dtype, context, logit_max=0.0):
    # The upstream gradient is drawn too, so that a failing example replays exactly (hypothesis
    # shrinks it instead of calling it flaky) and prints the seed that replays it.
    seed = data.draw(st.integers(0, 2**62), label="upstream seed")
    atol = oracle_atol(backend, dtype, logit_max)
    results = reference.run_oracle(kernel, ref, inputs, grads, atol=atol, seed=seed)
    reference.assert_oracle(results, f"{backend} {context}")


# ---- scaled_dot_product_attention


def _fuzz_sdpa(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    b = data.draw(st.integers(1, 3), label="batch")
    hkv = data.draw(st.sampled_from([1, 2]), label="kv heads")
    group = data.draw(st.sampled_from([1, 2, 3]), label="gqa ratio")
    h = hkv * group
    lq, lk = data.draw(LENGTHS, label="lq"), data.draw(LENGTHS, label="lk")
    d = data.draw(HEAD_DIMS, label="head dim")
    layout = data.draw(LAYOUTS, label="layout")
    q = tensor(data, (b, h, lq, d), dtype, layout)
    k = tensor(data, (b, hkv, lk, d), dtype, layout)
    v = tensor(data, (b, hkv, lk, d), dtype, layout)
    if layout == "transposed":  # the packed-projection form: (B, L, H, D) viewed as (B, H, L, D)
        q, k, v = (tensor(data, (t.shape[0], t.shape[2], t.shape[1], d), dtype).transpose(1, 2) for t in (q, k, v))
    is_causal = data.draw(st.booleans(), label="causal")
    mask_kind = data.draw(st.sampled_from(["none", "bool", "float", "padding", "bool+padding"]), label="mask")
    density = data.draw(st.floats(0.0, 1.0), label="mask density")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="mask seed"))
    attn_mask = key_padding_mask = None
    mask_shape = data.draw(st.sampled_from([(lq, lk), (b, 1, lq, lk), (b, h, lq, lk), (1, h, 1, lk)]), label="mask shape")
    if "bool" in mask_kind:
        attn_mask = torch.rand(mask_shape, generator=g) < density
    elif mask_kind == "float":
        attn_mask = torch.randn(mask_shape, generator=g).masked_fill(torch.rand(mask_shape, generator=g) > density, float("-inf")).to(dtype)
    if "padding" in mask_kind:
        key_padding_mask = torch.rand(b, lk, generator=g) > density
    scale = data.draw(st.one_of(st.none(), st.floats(0.01, 2.0)), label="scale")
    gqa = group > 1

    def kernel(query, key, value, attn_mask=None):
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale, gqa,
                                              key_padding_mask=key_padding_mask, backend=backend)

    def ref(query, key, value, attn_mask=None):
        return reference.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale, gqa,
                                                      key_padding_mask=key_padding_mask)

    inputs = {"query": q, "key": k, "value": v}
    if attn_mask is not None:
        inputs["attn_mask"] = attn_mask
    if not runnable(backend, "scaled_dot_product_attention", inputs | {"is_causal": is_causal, "key_padding_mask": key_padding_mask, "enable_gqa": gqa}):
        return
    logit_max = 0.0  # read by the torch peer's bound only (oracle_atol)
    if backend == "torch":  # (B, H, Lq, Lk): GQA's key heads repeated for the query heads
        logits = q.double() @ k.double().repeat_interleave(group, dim=1).transpose(-1, -2)
        logit_max = logits.abs().amax().item() * (scale if scale is not None else d ** -0.5)
    check(data, kernel, ref, inputs, ["query", "key", "value"], backend, dtype,
          f"sdpa {tuple(q.shape)} hkv={hkv} lk={lk} {dtype} {layout} causal={is_causal} {mask_kind}{mask_shape} scale={scale}",
          logit_max)


test_fuzz_sdpa, test_fuzz_sdpa_slow = fuzz_tests(_fuzz_sdpa)


# ---- masked_softmax


def _softmax(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    b, h = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(1, 3), label="heads")
    lq, lk = data.draw(LENGTHS, label="lq"), data.draw(st.one_of(LENGTHS, st.integers(100, 700)), label="lk")
    scores = tensor(data, (b, h, lq, lk), dtype, data.draw(LAYOUTS, label="layout"))
    is_causal = data.draw(st.booleans(), label="causal")
    density = data.draw(st.floats(0.0, 1.0), label="density")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="mask seed"))
    mask_shape = data.draw(st.sampled_from([None, (lk,), (lq, lk), (b, 1, lq, lk), (b, h, lq, lk)]), label="mask shape")
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=g) < density
        if data.draw(st.booleans(), label="float mask"):
            mask = torch.zeros(mask_shape).masked_fill(~mask, float("-inf")).to(dtype) + torch.randn(mask_shape, generator=g).to(dtype)
    scale = data.draw(st.floats(0.05, 3.0), label="scale")
    inputs = {"scores": scores}
    if mask is not None and mask.is_floating_point():
        inputs["mask"] = mask
    fixed_mask = None if "mask" in inputs else mask

    def kernel(scores, mask=fixed_mask):
        return F.masked_softmax(scores, mask, scale=scale, is_causal=is_causal, backend=backend)

    def ref(scores, mask=fixed_mask):
        return reference.masked_softmax(scores, mask, scale=scale, is_causal=is_causal)

    if not runnable(backend, "masked_softmax", {"scores": scores, "mask": mask, "is_causal": is_causal}):
        return
    check(data, kernel, ref, inputs, ["scores"], backend, dtype,
          f"softmax {tuple(scores.shape)} {dtype} causal={is_causal} mask={mask_shape} scale={scale}")


test_fuzz_masked_softmax, test_fuzz_masked_softmax_slow = fuzz_tests(_softmax)


# ---- add_layer_norm


def _layer_norm(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    lead = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=2), label="leading dims")
    # Now and then a long row, up to past the Triton kernels' whole-row limits (backward 8192,
    # forward 16384), beyond which they loop over the row.
    n = data.draw(st.one_of(st.sampled_from([1, 7, 127, 512, 1000]), st.integers(1, 300), st.integers(1001, 20000)),
                  label="width")
    if n > 1000:
        lead = lead[:1]  # a few long rows keep the interpreter's run short
    layout = data.draw(st.sampled_from(["contiguous", "sliced"]), label="layout")
    x = tensor(data, (*lead, n), dtype, layout)
    residual = tensor(data, (*lead, n), dtype, data.draw(st.sampled_from(["contiguous", "sliced"]), label="residual layout"))
    affine = data.draw(st.sampled_from(["both", "weight", "none"]), label="affine")
    weight = (1 + 0.5 * tensor(data, (n,), torch.float32)).to(dtype) if affine != "none" else None
    bias = tensor(data, (n,), dtype) if affine == "both" else None
    eps = data.draw(st.sampled_from([1e-5, 1e-6, 1e-3]), label="eps")
    prenorm = data.draw(st.booleans(), label="prenorm")
    inputs = {"x": x, "residual": residual}
    if weight is not None:
        inputs["weight"] = weight
    if bias is not None:
        inputs["bias"] = bias

    def kernel(x, residual, weight=None, bias=None):
        return F.add_layer_norm(x, residual, weight, bias, eps, prenorm=prenorm, backend=backend)

    def ref(x, residual, weight=None, bias=None):
        return reference.add_layer_norm(x, residual, weight, bias, eps, 0.0, prenorm)

    if not runnable(backend, "add_layer_norm", {"x": x, "residual": residual, "weight": weight, "bias": bias}):
        return
    if backend == "torch" and (n <= 2 or dtype != torch.float32):
        # PyTorch's CPU F.layer_norm backward for hidden sizes 1 and 2 and its half-precision
        # weight/bias gradients are outside the bound (README, Status note): peer behaviour.
        return
    check(data, kernel, ref, inputs, list(inputs), backend, dtype,
          f"add_layer_norm {tuple(x.shape)} {dtype} {layout} affine={affine} eps={eps} prenorm={prenorm}")


test_fuzz_add_layer_norm, test_fuzz_add_layer_norm_slow = fuzz_tests(_layer_norm)


# ---- attention_with_kv_cache (forward: decoding has no backward)


def _kv_cache(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    b = data.draw(st.integers(1, 3), label="batch")
    hkv = data.draw(st.sampled_from([1, 2]), label="kv heads")
    h = hkv * data.draw(st.sampled_from([1, 2, 4]), label="gqa ratio")
    d = data.draw(HEAD_DIMS, label="head dim")
    l_max = data.draw(st.integers(1, 80), label="cache length")
    # A decoding step (a few tokens) or a prefill chunk (up to the whole cache).
    l_new = data.draw(st.one_of(st.integers(0, min(4, l_max)), st.integers(0, l_max)), label="new tokens")
    seqlens = data.draw(st.lists(st.integers(0, l_max - l_new), min_size=b, max_size=b), label="cache_seqlens")
    if l_new == 0 and max(seqlens) == 0:
        seqlens[0] = l_max
    lq = max(l_new, 1)
    q = tensor(data, (b, h, lq, d), dtype)
    k_cache, v_cache = tensor(data, (b, hkv, l_max, d), dtype), tensor(data, (b, hkv, l_max, d), dtype)
    k_new = tensor(data, (b, hkv, l_new, d), dtype) if l_new else None
    v_new = tensor(data, (b, hkv, l_new, d), dtype) if l_new else None
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if l_new:
        inputs |= {"k_new": k_new, "v_new": v_new}

    def kernel(q, k_cache, v_cache, k_new=None, v_new=None):
        return F.attention_with_kv_cache(q, k_cache, v_cache, lengths, k_new, v_new, backend=backend)

    def ref(q, k_cache, v_cache, k_new=None, v_new=None):
        return reference.attention_with_kv_cache(q, k_cache, v_cache, lengths, k_new, v_new)

    if not runnable(backend, "attention_with_kv_cache", inputs | {"cache_seqlens": lengths}):
        return
    check(data, kernel, ref, inputs, [], backend, dtype,
          f"kv cache q={tuple(q.shape)} hkv={hkv} l_max={l_max} seqlens={seqlens} l_new={l_new} {dtype}")


test_fuzz_kv_cache, test_fuzz_kv_cache_slow = fuzz_tests(_kv_cache)


# ---- feed_forward


def _feed_forward(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    m = data.draw(st.one_of(st.sampled_from([1, 7, 100]), st.integers(1, 64)), label="rows")
    d_model = data.draw(st.integers(1, 48), label="d_model")
    d_ff = data.draw(st.integers(1, 96), label="d_ff")
    layout = data.draw(LAYOUTS, label="layout")
    x = tensor(data, (m, d_model), dtype, layout)
    w1 = (tensor(data, (d_ff, d_model), torch.float32) / d_model**0.5).to(dtype)
    w2 = (tensor(data, (d_model, d_ff), torch.float32) / d_ff**0.5).to(dtype)
    with_bias = data.draw(st.booleans(), label="bias")
    b1 = tensor(data, (d_ff,), dtype) if with_bias else None
    b2 = tensor(data, (d_model,), dtype) if with_bias else None
    activation = data.draw(st.sampled_from(["relu", "gelu", "gelu_tanh"]), label="activation")
    inputs = {"x": x, "w1": w1, "w2": w2}
    if with_bias:
        inputs |= {"b1": b1, "b2": b2}

    def kernel(x, w1, w2, b1=None, b2=None):
        return F.feed_forward(x, w1, b1, w2, b2, activation=activation, backend=backend)

    def ref(x, w1, w2, b1=None, b2=None):
        return reference.feed_forward(x, w1, b1, w2, b2, activation, 0.0)

    if not runnable(backend, "feed_forward", {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}):
        return
    check(data, kernel, ref, inputs, list(inputs), backend, dtype,
          f"feed_forward x={tuple(x.shape)} d_ff={d_ff} {dtype} {layout} {activation} bias={with_bias}")


test_fuzz_feed_forward, test_fuzz_feed_forward_slow = fuzz_tests(_feed_forward)


# ---- linear_bias_act


def _linear_bias_act(backend, data):
    dtype = data.draw(DTYPES, label="dtype")
    lead = data.draw(st.lists(st.integers(1, 9), min_size=0, max_size=2), label="leading dims")
    n_in = data.draw(st.integers(1, 72), label="in_features")
    n_out = data.draw(st.integers(1, 72), label="out_features")
    layout = data.draw(LAYOUTS, label="layout") if lead else "contiguous"
    x = tensor(data, (*lead, n_in), dtype, layout)
    w = (tensor(data, (n_out, n_in), torch.float32, data.draw(LAYOUTS, label="w layout")) / n_in**0.5).to(dtype)
    b = tensor(data, (n_out,), dtype) if data.draw(st.booleans(), label="bias") else None
    activation = data.draw(st.sampled_from([None, "relu", "gelu", "gelu_tanh"]), label="activation")
    inputs = {"x": x, "w": w} | ({"b": b} if b is not None else {})

    def kernel(x, w, b=None):
        return F.linear_bias_act(x, w, b, activation=activation, backend=backend)

    def ref(x, w, b=None):
        return reference.linear_bias_act(x, w, b, activation, 0.0)

    if not runnable(backend, "linear_bias_act", {"x": x, "w": w, "b": b}):
        return
    check(data, kernel, ref, inputs, list(inputs), backend, dtype,
          f"linear_bias_act x={tuple(x.shape)} w={tuple(w.shape)} {dtype} {layout} {activation} bias={b is not None}")


test_fuzz_linear_bias_act, test_fuzz_linear_bias_act_slow = fuzz_tests(_linear_bias_act)


# ---- linear_cross_entropy (the models' fused pre-softmax projection + loss)


def _linear_cross_entropy(backend, data):
    from transformer_fast.models import fused_loss

    if backend in ("cpu", "reference"):
        pytest.skip("linear_cross_entropy's reference backend is the oracle's own composition; "
                    "its chunks run on torch or triton")
    ok, why = backends.available(backend, "cpu")
    if not ok:
        pytest.skip(why)
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16] if backend == "triton" else
                                      [torch.float32, torch.float16, torch.bfloat16]), label="dtype")
    rows = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=2), label="rows")
    e = data.draw(st.integers(1, 64), label="E")
    v = data.draw(st.one_of(st.integers(2, 64), st.integers(65, 2000)), label="V")
    hidden = tensor(data, (*rows, e), dtype, data.draw(LAYOUTS, label="layout"))
    weight = (tensor(data, (v, e), torch.float32) / e**0.5).to(dtype)
    bias = tensor(data, (v,), dtype) if data.draw(st.booleans(), label="bias") else None
    ignore_index = data.draw(st.sampled_from([None, 0, -100]), label="ignore_index")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="target seed"))
    target = torch.randint(0, v, tuple(rows), generator=g)
    if ignore_index is not None:
        target[torch.rand(tuple(rows), generator=g) < data.draw(st.floats(0.0, 1.0), label="ignored")] = ignore_index
    smoothing = data.draw(st.sampled_from([0.0, 0.1, 0.3]), label="smoothing")
    # "sum" only over a few dozen tokens: its loss and weight gradient grow with the count, and
    # past ~100 tokens a bf16 / fp32 element of the weight gradient is many units of atol wide,
    # where a correctly rounded result fails 2x the composition's error whenever the
    # composition's rounding lands close by chance (benchmarks/NOTES.md, 2026-12-01 twentieth).
    tokens = hidden.shape[:-1].numel()
    reduction = data.draw(st.sampled_from(["mean", "sum"] if tokens <= 64 else ["mean"]), label="reduction")
    chunk_rows = data.draw(st.one_of(st.none(), st.integers(1, 50)), label="chunk_rows")
    inputs = {"hidden": hidden, "weight": weight} | ({"bias": bias} if bias is not None else {})

    def kernel(hidden, weight, bias=None):
        return fused_loss.linear_cross_entropy(hidden, weight, target, bias, smoothing, ignore_index, reduction,
                                               chunk_rows=chunk_rows, backend=backend)

    def ref(hidden, weight, bias=None):
        # On a contiguous copy: torch's F.linear adds the bias of a strided N-d input after a
        # rounded matmul (two roundings), of a contiguous one inside addmm (one), as the fused
        # path does on its flattened rows.  With two, the composition's error is an independent
        # draw, and a sum over hundreds of tokens then failed 2x of it in 18 of 100 bf16 / fp16
        # cases while ours was the more accurate.
        return fused_loss.reference(hidden.contiguous(), weight, target, bias, smoothing, ignore_index, reduction)

    check(data, kernel, ref, inputs, list(inputs), backend, dtype,
          f"linear_cross_entropy hidden={tuple(hidden.shape)} V={v} {dtype} bias={bias is not None} "
          f"ignore_index={ignore_index} smoothing={smoothing} {reduction} chunk_rows={chunk_rows}")


test_fuzz_linear_cross_entropy, test_fuzz_linear_cross_entropy_slow = fuzz_tests(_linear_cross_entropy)


# ---- regression tests: failures the fuzzing found, replayed on fixed inputs


@pytest.mark.parametrize("backend", [pytest.param("cpu"), pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("dtype, lq, lk, is_causal", [
    (torch.bfloat16, 2, 7, True),    # found: triton sdpa (1, 4, 2, 40) hkv=2 lk=7 bf16 causal scale=1.19
    (torch.bfloat16, 1, 8, False),
    (torch.float16, 2, 2, False),
])
def test_sdpa_16bit_short_rows_backward(backend, dtype, lq, lk, is_causal):
    """Rows with few keys in fp16 / bf16: backward's delta = rowsum(dO * O) taken from the output
    rounded to 16 bits erred by up to 4x the oracle's bound (10-26% of fresh draws failed); the
    kernels now sum p * dp for such rows.  Of these fixed draws, seeds 0, 4, 7 and 8 failed before
    on both backends (tests/test_attention_cpu.py replays them on the emulated CUDA kernels)."""
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, h, n, 40, generator=g).to(dtype) for h, n in ((4, lq), (2, lk), (2, lk)))

        def kernel(query, key, value):
            return F.scaled_dot_product_attention(query, key, value, None, 0.0, is_causal, 1.19, True, backend=backend)

        def ref(query, key, value):
            return reference.scaled_dot_product_attention(query, key, value, None, 0.0, is_causal, 1.19, True)

        inputs = {"query": q, "key": k, "value": v}
        if not runnable(backend, "scaled_dot_product_attention", inputs | {"is_causal": is_causal, "enable_gqa": True}):
            pytest.skip(f"{backend} does not run this case")
        results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol(backend, dtype), seed=seed)
        reference.assert_oracle(results, f"{backend} seed {seed}")


@pytest.mark.parametrize("backend", [pytest.param("cpu"), pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("lq, lk", [(2, 7), (3, 3)])
def test_sdpa_fp32_large_logits_backward(backend, lq, lk):
    """Exact fp32 with large logits (scale 2, D 64): p recomputed from the fp32 lse carried |lse| x
    2^-24 of error, mostly in grad value.  Before backward renormalised each row: 6 of the first
    10 draws failed at (2, 7) on triton; 27-43% of fresh draws at these shapes on cpu.
    At most 4 of 40 draws (10%) may miss the bound, against the 27-60% that missed before the
    renormalisation: gradients of magnitude ~20 agree with float64 to a few fp32 ulps, and where
    the fp32 reference lands within an ulp by chance the bound (2x its error + 1e-6) is under what
    a computation of p from scores rounded to fp32 reaches.  Measured on an Intel Xeon
    (2026-11-28, fresh draws at (2, 7) / (3, 3)): cpu 2 / 200 and 1 / 200 missed, triton 2 / 60
    and 0 / 60, torch's own SDPA 106 / 200 and 80 / 200.  Seed 7 at (2, 7) misses on cpu and
    triton alike here; the AMD EPYC where this test was written passed its first 10 draws (the
    reference's fp32 matmul rounds differently there)."""
    misses = []
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, h, n, 64, generator=g) for h, n in ((4, lq), (2, lk), (2, lk)))

        def kernel(query, key, value):
            return F.scaled_dot_product_attention(query, key, value, None, 0.0, False, 2.0, True, backend=backend)

        def ref(query, key, value):
            return reference.scaled_dot_product_attention(query, key, value, None, 0.0, False, 2.0, True)

        inputs = {"query": q, "key": k, "value": v}
        if not runnable(backend, "scaled_dot_product_attention", inputs | {"enable_gqa": True}):
            pytest.skip(f"{backend} does not run this case")
        results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol(backend, torch.float32), seed=seed)
        try:
            reference.assert_oracle(results, f"{backend} seed {seed}")
        except AssertionError as miss:
            misses.append(str(miss))
    assert len(misses) <= 4, misses


@pytest.mark.parametrize("backend, device", [
    pytest.param("cpu", "cpu", id="cpu"),
    pytest.param("triton", "cpu", marks=pytest.mark.triton, id="triton"),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu, id="triton-gpu"),
    pytest.param("cuda", "cuda", marks=pytest.mark.gpu, id="cuda-gpu"),
])
@pytest.mark.parametrize("tied, seeds", [(True, (9, 0, 1, 2, 3)), (False, (55, 4, 5, 6, 7))])
def test_sdpa_fp32_peaked_rows_backward(backend, device, tied, seeds):
    """Exact fp32, logits of 20-90 (scale 1-2; ``tied``: the first keys equal the first queries,
    as hypothesis draws when two seeds coincide, so those rows are nearly one-hot).  Found
    2026-12-01: triton's dq / dk at 1.23x the bound at seed 9 (tied) and 1.37x at seed 55, ~1% of
    such draws: the scores were rounded to fp32 before the row max / lse was subtracted, moving
    each p by up to 2^-24 x |s| relative (the cpu and the emulated cuda fp32 kernels missed too,
    more rarely).  All three now keep the scores unrounded until then; Triton's PRECISE kernels
    also sum delta and the row's renormalisation in fp64 (kernels/attention.py)."""
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        lq, lk = (int(torch.randint(1, 40, (1,), generator=g)) for _ in range(2))
        d, scale = (16, 32, 40, 64)[seed % 4], (1.0, 1.5, 2.0)[seed % 3]
        q, k, v = (torch.randn(1, 2, n, d, generator=g) for n in (lq, lk, lk))
        if tied:
            k[:, :, : min(lq, lk)] = q[:, :, : min(lq, lk)]
        q, k, v = (t.to(device) for t in (q, k, v))

        def kernel(query, key, value):
            return F.scaled_dot_product_attention(query, key, value, scale=scale, backend=backend)

        def ref(query, key, value):
            return reference.scaled_dot_product_attention(query, key, value, scale=scale)

        inputs = {"query": q, "key": k, "value": v}
        if not runnable(backend, "scaled_dot_product_attention", inputs, device):
            pytest.skip(f"{backend} does not run this case")
        results = reference.run_oracle(kernel, ref, inputs, list(inputs), seed=seed)
        reference.assert_oracle(results, f"{backend} seed {seed} (Lq {lq}, Lk {lk}, D {d}, scale {scale})")


@pytest.mark.parametrize("backend", [pytest.param("cpu"), pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("dtype, lk", [(torch.float16, 1), (torch.bfloat16, 1), (torch.float16, 3)])
def test_sdpa_16bit_large_mask_offset_backward(backend, dtype, lk):
    """A float mask that shifts whole rows by -1e4 (found: the triton oracle grid's float_full
    case, Lk 1, fp16).  The fp32 lse then carries ~1e-3 of relative error into every recomputed
    p; with delta = rowsum(p * dp) it did not cancel, and a one-key row (exact gradient 0) got
    dq, dk up to 5x the bound: 26% of fresh draws failed on triton before p was renormalised."""
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 2, n, 96, generator=g).to(dtype) for n in (7, lk, lk))
        mask = torch.randn(1, 2, 7, lk, generator=g) * 2
        mask = (mask - 1e4 * (torch.rand(1, 2, 7, 1, generator=g) < 0.5)).to(dtype)

        def kernel(query, key, value):
            return F.scaled_dot_product_attention(query, key, value, mask, backend=backend)

        def ref(query, key, value):
            return reference.scaled_dot_product_attention(query, key, value, mask)

        inputs = {"query": q, "key": k, "value": v}
        if not runnable(backend, "scaled_dot_product_attention", inputs | {"attn_mask": mask}):
            pytest.skip(f"{backend} does not run this case")
        results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol(backend, dtype), seed=seed)
        reference.assert_oracle(results, f"{backend} seed {seed}")



def _assert_cpu_ffn_oracle(inputs, seed, context):
    """The oracle for the C++ cpu feed_forward (gelu) on fixed fp32 inputs x, w1, w2 (b1, b2)."""
    results = reference.run_oracle(
        lambda x, w1, w2, b1=None, b2=None: F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend="cpu"),
        lambda x, w1, w2, b1=None, b2=None: reference.feed_forward(x, w1, b1, w2, b2, "gelu", 0.0),
        inputs, list(inputs), atol=oracle_atol("cpu", torch.float32), seed=seed)
    reference.assert_oracle(results, context)


def _seeded_randn(shape, seed, transposed=False):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # the fuzz's "transposed" layout: a transposed view of a contiguous draw
        return torch.randn(shape[1], shape[0], generator=g).t()
    return torch.randn(*shape, generator=g)


def test_cpu_ffn_tiny_fp32_gemms_are_exact():
    """Found by the slow fuzz: cpu feed_forward x (100, 1), d_ff 1, fp32, gelu, grad w2 at 1.9x the
    bound (a 1 x 1 weight gradient: one fp32 reduction chain of 100 terms against torch's).  The
    C++ cpu backend's small fp32 GEMMs (<= 4.2 MFLOP) now run in fp64 and round once: bit for bit that here."""
    ok, why = backends.available("cpu", "cpu")
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(100, 1, generator=g), torch.randn(100, 3, generator=g)
    w = torch.randn(5, 3, generator=g)
    ops = torch.ops.transformer_fast_C
    dw, _ = ops.ffn_linear_wgrad(dy, x, False, False)
    assert torch.equal(dw, (dy.double().t() @ x.double()).float())
    y, _ = ops.ffn_linear_fwd(x, w, None, "none", 0.0, None, False, False)
    assert torch.equal(y, (x.double() @ w.double().t()).float())
    # The failing draw itself (inputs seeded 1 / 203 / 0, upstream gradient 1085).
    inputs = {"x": _seeded_randn((100, 1), 1), "w1": _seeded_randn((1, 1), 203), "w2": _seeded_randn((1, 1), 0)}
    _assert_cpu_ffn_oracle(inputs, 1085, "cpu (100, 1) d_ff 1 gelu")


def test_cpu_ffn_small_fp32_weight_gradient():
    """Found by the slow fuzz: cpu feed_forward x (100, 32) transposed, d_ff 87, fp32, gelu: grad w2
    3.5e-5 against a bound of 2.9e-5 (torch's own fp32 chain erred 1.4e-5 on its slightly
    different hidden activations; |dW2| up to 65).  Its fp64 GEMMs leave 5e-6."""
    ok, why = backends.available("cpu", "cpu")
    if not ok:
        pytest.skip(why)
    inputs = {"x": _seeded_randn((100, 32), 610, True), "w1": _seeded_randn((87, 32), 458) / 32**0.5,
              "w2": _seeded_randn((32, 87), 0) / 87**0.5, "b1": _seeded_randn((87,), 1458),
              "b2": _seeded_randn((32,), 0)}
    _assert_cpu_ffn_oracle(inputs, 1_569_325_055, "cpu (100, 32) d_ff 87 gelu")
