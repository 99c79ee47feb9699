"""The cuda backend of attention_with_kv_cache (csrc/decode_cuda.cu: append, split-K decode and
combine kernels) on CUDA tensors against the float64 oracle: the checks of
tests/test_decode_cxx.py with BACKEND = DEVICE = "cuda" (fp32 / fp16 / bf16; split counts forced
through TRANSFORMER_FAST_KV_SPLITS), plus long caches through the split heuristic, a decoding loop
against full causal attention, a larger sweep and determinism.  Marked gpu: skipped without CUDA."""
import pytest
import torch

import test_decode_cxx as base
from conftest import require_backend
from test_decode_cxx import (  # noqa: F401  (the shared checks and their fixtures, collected again here)
    backend_ready,
    test_bad_arguments,
    test_cache_without_unit_last_stride,
    test_empty_shapes,
    test_functional_api,
    test_kv_cache_op,
    test_opcheck,
    test_out_of_range_lengths_stay_in_bounds,
    test_prefill_then_decode_equals_causal_attention,
    test_split_counts,
    test_strided_inputs,
    test_without_new_keys_dead_rows,
)
from test_triton_decode import make_case

from transformer_fast import functional as F

pytestmark = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _cuda_backend(monkeypatch):
    monkeypatch.setattr(base, "BACKEND", "cuda")
    monkeypatch.setattr(base, "DEVICE", "cuda")


@pytest.fixture
def device():
    return require_backend("cuda")


def _inputs(*args, **kwargs):
    return base.to_device(make_case(*args, **kwargs), "cuda")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_cache_split_heuristic(device, dtype, group):
    """B = 1, long ragged caches: the default heuristic splits the key range over many CTAs."""
    inputs = _inputs(2, 2 * group, 2, 1, 5000, 128, dtype, [4999, 1234], True, seed=group)
    base.check(base.cxx_op, *inputs, context=f"long cache G{group} {dtype}")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("D", [16, 32, 64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("L_new,with_new,group", [(1, True, 1), (1, True, 8), (7, True, 2), (64, True, 4), (17, False, 2)])
def test_sweep(device, D, dtype, L_new, with_new, group):
    L_max = 523
    lo = L_new if not with_new else 0
    seqlens = [lo, L_max - (L_new if with_new else 0), 300]
    inputs = _inputs(3, 2 * group, 2, L_new, L_max, D, dtype, seqlens, with_new, seed=D + L_new)
    for splits in (1, 5, None):
        base.check(base.cxx_op, *inputs, splits=splits, context=f"D{D} {dtype} L{L_new} G{group} splits {splits}")


def test_decoding_loop_matches_causal_attention(device):
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, length, d = 2, 8, 2, 40, 64
    q, k, v = (torch.randn(batch, h, length, d, generator=g).cuda() for h in (heads, kv_heads, kv_heads))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k_cache = torch.zeros(batch, kv_heads, length, d, device="cuda")
    v_cache = torch.zeros(batch, kv_heads, length, d, device="cuda")
    cache_seqlens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    outs = []
    for t in range(length):
        sl = slice(t, t + 1)
        outs.append(F.attention_with_kv_cache(q[:, :, sl], k_cache, v_cache, cache_seqlens, k[:, :, sl], v[:, :, sl], backend="cuda"))
        cache_seqlens += 1
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, k, rtol=0, atol=0)


@pytest.mark.parametrize("splits", [1, 7])
def test_deterministic(device, splits):
    inputs = _inputs(1, 8, 2, 3, 3000, 128, BF16, [2990], True, seed=5)
    outs = []
    with base.forced_splits(splits):
        for _ in range(3):
            kc, vc = inputs[1].clone(), inputs[2].clone()
            outs.append(base.cxx_op(inputs[0], kc, vc, *inputs[3:], 0.1))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_nonfinite_hidden_values_propagate_like_reference(device, dtype, splits):
    """kv_hidden_kernel on the GPU: NaN / Inf at keys hidden from some queries of the chunk give
    the reference's NaN pattern (the functional test runs only the split heuristic)."""
    from test_decode_cuda_emulated import check_hidden_nonfinite

    check_hidden_nonfinite(base.cxx_op, dtype, splits, device="cuda")


@pytest.mark.parametrize("heads,kv_heads,splits", [(2, 2, 3), (16, 1, 1), (16, 1, None)])
def test_fp32_large_logits_meet_the_oracle(device, heads, kv_heads, splits):
    """The fp32 inputs' double q.k and the splits' double lse on the GPU (the CPU emulation's
    case, tests/test_decode_cuda_emulated.py)."""
    from _functional_helpers import assert_kv_cache_on_oracle, large_logit_kv_cases

    def run(q, kc, vc, lens, kn, vn):
        args = [t.cuda() for t in (q, kc, vc, lens, kn, vn)]
        with base.forced_splits(splits):
            return base.cxx_op(*args, q.shape[-1] ** -0.5).cpu()

    for t, case in enumerate(large_logit_kv_cases(heads, kv_heads, 1, 128, draws=12, seed=3000)):
        assert_kv_cache_on_oracle(run, case, f"draw {t}")


@pytest.mark.parametrize("splits", [1, 2])
def test_fp32_very_large_logits_meet_the_oracle(device, splits):
    """The fp32 inputs' double score and running max on the GPU (logit std ~100; the CPU
    emulation's case, tests/test_decode_cuda_emulated.py)."""
    from _functional_helpers import assert_kv_cache_on_oracle, very_large_logit_kv_cases

    def run(q, kc, vc, lens, kn, vn):
        args = [t.cuda() for t in (q, kc, vc, lens, kn, vn)]
        with base.forced_splits(splits):
            return base.cxx_op(*args, q.shape[-1] ** -0.5).cpu()

    for seed, case in zip(range(4000, 4008), very_large_logit_kv_cases(range(4000, 4008))):
        assert_kv_cache_on_oracle(run, case, f"seed {seed}")
