"""The C++ KV-cache attention (csrc/decode_cpu.cpp, the `cpu` backend; csrc/decode_cuda.cu through
the CPU emulation of tests/cuda_emulation.py) against the DESIGN section 6 oracle.

Each check runs the kernel on cache copies NaN-poisoned from each row's cache_seqlens on (so a
read beyond a row's valid keys, or a missing append, shows up as NaN), with NaN-poisoned
outputs; the caches afterwards must equal the reference's exactly, the never-written tail still
NaN.  Split counts are forced through TRANSFORMER_FAST_KV_SPLITS (read by the C++ host code).
The helpers and the case grid of the Triton launcher tests (tests/test_triton_decode.py) are
reused: the C++ ops implement the same launcher contract.
"""
import contextlib
import os

import pytest
import torch

import test_functional_kv_cache as fkv
from conftest import require_backend
from cuda_emulation import build as cuda_emulation_build
from test_triton_decode import CASES as TRITON_CASES
from test_triton_decode import _case_id, _poison_tail, make_case, run_reference
from transformer_fast import functional as F
from transformer_fast import reference
from transformer_fast.reference import assert_oracle, oracle_compare, poisoned_outputs

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SPLITS_ENV = "TRANSFORMER_FAST_KV_SPLITS"
# tests/test_gpu_decode_cuda.py runs the backend tests below again with "cuda" / "cuda".
BACKEND = "cpu"
DEVICE = "cpu"


@contextlib.contextmanager
def forced_splits(n):
    """Force the C++ split count (None: the shape heuristic)."""
    old = os.environ.get(SPLITS_ENV)
    if n is None:
        os.environ.pop(SPLITS_ENV, None)
    else:
        os.environ[SPLITS_ENV] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SPLITS_ENV, None)
        else:
            os.environ[SPLITS_ENV] = old


def fresh_seed():
    """DESIGN 6: fresh random inputs every run (the seed goes into the failure context)."""
    return int(torch.randint(0, 2**31, ()))


def cxx_op(q, k_cache, v_cache, seqlens, k_new, v_new, scale):
    """The C++ op itself (the dispatcher picks the CPU or CUDA kernel from the tensors)."""
    return torch.ops.transformer_fast_C.attention_with_kv_cache_fwd(
        q, k_cache, v_cache, seqlens, k_new, v_new, scale, False)


def functional_op(backend):
    def run(q, k_cache, v_cache, seqlens, k_new, v_new, scale):
        return F.attention_with_kv_cache(q, k_cache, v_cache, seqlens, k_new, v_new, scale=scale,
                                         backend=backend)

    return run


def to_device(inputs, device):
    return [None if t is None else t.to(device) for t in inputs]


def check(run, q, k_cache, v_cache, seqlens, k_new, v_new, scale=None, splits=None, context=""):
    """Oracle on the output; exact caches with the unwritten tails untouched.  `run` is called on
    tensors of q's device; the references run on the CPU."""
    device = q.device
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cpu = to_device((q, k_cache, v_cache, seqlens, k_new, v_new), "cpu")
    ref64, _, _ = run_reference(*cpu, scale, torch.float64)
    ref_lp, kc_lp, vc_lp = run_reference(*cpu, scale, dtype)
    kc = _poison_tail(k_cache.clone(), seqlens)
    vc = _poison_tail(v_cache.clone(), seqlens)
    with forced_splits(splits), poisoned_outputs():
        out = run(q, kc, vc, seqlens, k_new, v_new, scale)
    assert out.shape == ref64.shape and out.dtype == dtype and out.is_contiguous()
    assert out.device == device
    out = out.cpu()
    assert_oracle([oracle_compare("out", out, ref_lp, ref64, dtype)], context)
    n_keys = seqlens.cpu() + (q.shape[2] if k_new is not None else 0)
    for name, got, want in (("k_cache", kc.cpu(), kc_lp), ("v_cache", vc.cpu(), vc_lp)):
        want = _poison_tail(want.clone(), n_keys)
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: wrong positions written ({context})"
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{name} != reference ({context})"
    return out


@pytest.fixture
def backend_ready():
    return require_backend(BACKEND)


# ---------------------------------------------------------------------------------------------
# The cpu backend: the Triton grid, then cases of its own

# (B, H, Hkv, L_new, L_max, D, dtype, cache_seqlens, with_new): GQA groups 1/2/4/8, L_new 1 / 7 /
# 64 (a prefill chunk spanning several 128-row tiles with GROUP 4), head dims off the powers of
# two, rows at 0 and at L_max - L_new, caches longer than one 64-key block.
CPU_CASES = TRITON_CASES + [
    (2, 8, 1, 1, 300, 96, F32, [299, 0], True),  # MQA decoding, 5 key blocks
    (2, 8, 2, 7, 150, 160, BF16, [143, 60], True),  # 7 new tokens, GQA 4
    (1, 8, 2, 64, 200, 64, F32, [136], True),  # prefill chunk: 256 packed rows (GEMM path)
    (2, 4, 4, 64, 64, 32, F16, [0, 0], True),  # a prompt into empty caches: plain causal
    (3, 8, 8, 1, 90, 256, F32, [89, 0, 45], True),
    (2, 16, 2, 1, 70, 80, F16, [69, 3], True),  # GQA 8 (the packed rows of one kv head)
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[_case_id(c) for c in CPU_CASES])
def test_kv_cache_op(backend_ready, case):
    B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new = case
    seed = fresh_seed()
    inputs = to_device(make_case(B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new, seed=seed), DEVICE)
    out1 = check(cxx_op, *inputs, splits=1, context=f"{_case_id(case)} seed {seed} no split")
    # More splits than some rows have key blocks: splits past a row's range write neutral partials.
    out3 = check(cxx_op, *inputs, splits=3, context=f"{_case_id(case)} seed {seed} 3 splits")
    tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
    torch.testing.assert_close(out3.float(), out1.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("splits", [None, 2, 5, 16, 200])
def test_split_counts(backend_ready, splits):
    # None: the shape heuristic (B * Hkv = 2 tasks -> it splits); 200 is clamped to 128.
    inputs = to_device(make_case(2, 4, 1, 2, 700, 64, F32, [690, 4], True, seed=3), DEVICE)
    check(cxx_op, *inputs, splits=splits, context=f"splits {splits}")


def test_cpu_results_do_not_depend_on_thread_count(backend_ready):
    inputs = to_device(make_case(1, 8, 2, 1, 900, 64, F32, [899], True, seed=4), DEVICE)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kc, vc = inputs[1].clone(), inputs[2].clone()
            outs.append(cxx_op(inputs[0], kc, vc, *inputs[3:], 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_functional_api(backend_ready, dtype):
    """The backend through F.attention_with_kv_cache; value head dim != D; a scale."""
    inputs = to_device(make_case(3, 4, 2, 3, 77, 64, dtype, [0, 74, 30], True, Dv=48, seed=5), DEVICE)
    check(functional_op(BACKEND), *inputs, scale=0.3, context=f"functional {dtype}")


def test_without_new_keys_dead_rows(backend_ready):
    # Without k_new, query t sees keys j <= cache_seqlens[b] - L_new + t: rows 0 and 1 of batch 0
    # and all of batch 1 see nothing and must be exactly 0.
    inputs = to_device(make_case(2, 4, 2, 5, 40, 16, F32, [3, 0], False, seed=6), DEVICE)
    out = check(cxx_op, *inputs, splits=2, context="dead rows")
    assert (out[0, :, :2] == 0).all() and (out[1] == 0).all() and (out[0, :, 2:] != 0).any()


def test_strided_inputs(backend_ready):
    """q a transposed (B, L, H, D) view; caches slices of bigger (B, L, Hkv, D') buffers, written
    through their strides; nothing outside the cache views changes."""
    B, H, Hkv, L_new, L_max, D = 2, 4, 2, 3, 29, 64
    g = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(BF16).to(DEVICE)

    q = rnd(B, L_new, H, D).transpose(1, 2)
    k_buf, v_buf = rnd(B, L_max + 5, Hkv + 1, D + 16), rnd(B, L_max + 5, Hkv + 1, D + 16)
    k_cache = k_buf[:, 2:L_max + 2, 1:, 8:D + 8].transpose(1, 2)
    v_cache = v_buf[:, 2:L_max + 2, 1:, 8:D + 8].transpose(1, 2)
    k_new, v_new = rnd(B, L_new, Hkv, D).transpose(1, 2), rnd(B, L_new, Hkv, D).transpose(1, 2)
    seqlens = torch.tensor([0, L_max - L_new], dtype=torch.int32, device=DEVICE)
    assert not q.is_contiguous() and not k_cache.is_contiguous() and k_cache.stride(-1) == 1
    scale = D ** -0.5
    cpu = to_device((q, k_cache, v_cache, seqlens, k_new, v_new), "cpu")
    ref64, _, _ = run_reference(*cpu, scale, torch.float64)
    ref_lp, kc_lp, vc_lp = run_reference(*cpu, scale, BF16)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    with forced_splits(2), poisoned_outputs():
        out = cxx_op(q, k_cache, v_cache, seqlens, k_new, v_new, scale)
    assert_oracle([oracle_compare("out", out.cpu(), ref_lp, ref64, BF16)], "strided")
    assert torch.equal(k_cache.cpu(), kc_lp) and torch.equal(v_cache.cpu(), vc_lp)
    outside = torch.ones_like(k_buf, dtype=torch.bool)
    outside[:, 2:L_max + 2, 1:, 8:D + 8] = False
    assert torch.equal(k_buf[outside], k_before[outside]) and torch.equal(v_buf[outside], v_before[outside])


def test_cache_without_unit_last_stride(backend_ready):
    q, _, _, seqlens, k_new, v_new = to_device(make_case(2, 2, 1, 2, 21, 16, F32, [0, 19], True, seed=13), DEVICE)
    g = torch.Generator().manual_seed(14)
    k_cache = torch.randn(2, 1, 16, 21, generator=g).to(DEVICE).transpose(2, 3)
    v_cache = torch.randn(2, 1, 16, 21, generator=g).to(DEVICE).transpose(2, 3)
    assert k_cache.stride(-1) != 1
    check(cxx_op, q, k_cache, v_cache, seqlens, k_new, v_new, splits=2, context="last stride != 1")


def test_empty_shapes(backend_ready):
    q, kc, vc, sl, kn, vn = to_device(make_case(2, 2, 1, 1, 8, 16, F32, [0, 3], True), DEVICE)
    out = cxx_op(q[:, :, :0], kc, vc, sl, kn[:, :, :0], vn[:, :, :0], 0.25)
    assert out.shape == (2, 2, 0, 16)
    out = cxx_op(q, kc[:, :, :0], vc[:, :, :0], sl * 0, None, None, 0.25)
    assert out.shape == (2, 2, 1, 16) and not out.any()


def test_out_of_range_lengths_stay_in_bounds(backend_ready):
    """The op itself (below the functional layer's ValueError) clamps: nothing outside the
    caches is written, positions past L_max are dropped."""
    B, Hkv, L_max, D = 2, 1, 10, 16
    buf_k = torch.randn(B, Hkv, L_max + 4, D, device=DEVICE)
    buf_v = torch.randn(B, Hkv, L_max + 4, D, device=DEVICE)
    before_k, before_v = buf_k.clone(), buf_v.clone()
    q = torch.randn(B, 2, 3, D, device=DEVICE)
    kn, vn = torch.randn(B, Hkv, 3, D, device=DEVICE), torch.randn(B, Hkv, 3, D, device=DEVICE)
    seqlens = torch.tensor([9, -5], dtype=torch.int32, device=DEVICE)  # row 0 runs past L_max, row 1 before 0
    out = cxx_op(q, buf_k[:, :, :L_max], buf_v[:, :, :L_max], seqlens, kn, vn, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(buf_k[:, :, L_max:], before_k[:, :, L_max:])
    assert torch.equal(buf_v[:, :, L_max:], before_v[:, :, L_max:])
    assert torch.equal(buf_k[0, :, 9], kn[0, :, 0]) and torch.equal(buf_k[1, :, :L_max], before_k[1, :, :L_max])


def test_bad_arguments(backend_ready):
    q, kc, vc, sl, kn, vn = to_device(make_case(2, 4, 2, 1, 8, 16, F32, [0, 3], True), DEVICE)
    with pytest.raises(RuntimeError, match="must divide"):
        cxx_op(q[:, :3], kc, vc, sl, kn, vn, 0.25)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        cxx_op(q, kc, vc, sl.long(), kn, vn, 0.25)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cxx_op(q, kc.half(), vc, sl, kn, vn, 0.25)
    with pytest.raises(RuntimeError, match="k_new must be"):
        cxx_op(q, kc, vc, sl, kn[:, :1], vn, 0.25)
    with pytest.raises(RuntimeError, match="head dims"):
        big = torch.randn(2, 4, 1, 300, device=DEVICE)
        cxx_op(big, torch.randn(2, 2, 8, 300, device=DEVICE), vc, sl, None, None, 0.25)


def test_opcheck(backend_ready):
    q, kc, vc, sl, kn, vn = to_device(make_case(2, 4, 2, 2, 12, 16, F32, [0, 9], True), DEVICE)
    torch.library.opcheck(torch.ops.transformer_fast.attention_with_kv_cache,
                          (q, kc, vc, sl, kn, vn, 0.25, False, BACKEND))


# CPU only (tests/test_gpu_decode_cuda.py has its own versions):
# the functional tests' end-to-end properties, with backend="cpu" (they take a backend name and
# build CPU tensors).
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("lq", [1, 5])
def test_cpu_matches_full_attention_on_concatenated_prefix(backend_ready, kv_heads, lq):
    fkv.test_matches_full_attention_on_concatenated_prefix("cpu", kv_heads, lq)


def test_cpu_decoding_loop_matches_causal_attention(backend_ready):
    fkv.test_decoding_loop_matches_causal_attention("cpu")


def test_cpu_non_contiguous_q_and_caches(backend_ready):
    fkv.test_non_contiguous_q_and_caches("cpu")


def test_prefill_then_decode_equals_causal_attention(backend_ready):
    """A 64-token prefill chunk, then single-token steps with forced splits, bf16: every output
    equals causal attention over the concatenated sequence (oracle), the caches hold it."""
    B, H, Hkv, D, dtype = 2, 8, 2, 64, BF16
    chunk, steps, L_max = 64, 4, 80
    prefix = [0, 11]
    T = chunk + steps
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q_all, k_all, v_all = rnd(B, H, max(prefix) + T, D), rnd(B, Hkv, max(prefix) + T, D), rnd(B, Hkv, max(prefix) + T, D)
    k_cache, v_cache = rnd(B, Hkv, L_max, D), rnd(B, Hkv, L_max, D)
    for b, p in enumerate(prefix):
        k_cache[b, :, :p], v_cache[b, :, :p] = k_all[b, :, :p], v_all[b, :, :p]
    seqlens = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    scale = D ** -0.5
    outs = []
    spans = [(0, chunk)] + [(chunk + i, chunk + i + 1) for i in range(steps)]
    for i, (a, e) in enumerate(spans):
        sel = torch.stack([torch.arange(p + a, p + e) for p in prefix]).to(DEVICE)
        pick = torch.arange(B, device=DEVICE)[:, None]
        q, kn, vn = (t.transpose(1, 2)[pick, sel].transpose(1, 2) for t in (q_all, k_all, v_all))
        with forced_splits(1 + i % 3), poisoned_outputs():
            outs.append(F.attention_with_kv_cache(q, k_cache, v_cache, seqlens, kn, vn, scale=scale, backend=BACKEND))
        seqlens = seqlens + (e - a)
    got = torch.cat(outs, dim=2).cpu()
    q_all, k_all, v_all, k_cache, v_cache = (t.cpu() for t in (q_all, k_all, v_all, k_cache, v_cache))
    for b, p in enumerate(prefix):
        n = p + T
        args = [t[b:b + 1, :, :n] for t in (q_all, k_all, v_all)]
        ref64 = reference.scaled_dot_product_attention(*[t.double() for t in args], is_causal=True,
                                                       scale=scale, enable_gqa=True)[:, :, p:]
        ref_lp = reference.scaled_dot_product_attention(*args, is_causal=True, scale=scale,
                                                        enable_gqa=True)[:, :, p:]
        assert_oracle([oracle_compare(f"row {b}", got[b:b + 1], ref_lp, ref64, dtype)], "prefill+decode")
        assert torch.equal(k_cache[b, :, :n], k_all[b, :, :n]) and torch.equal(v_cache[b, :, :n], v_all[b, :, :n])


SLOW_HEAD_DIMS = [16, 24, 32, 64, 80, 96, 128, 160, 192, 256]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("D", SLOW_HEAD_DIMS)
@pytest.mark.parametrize("L_new,with_new,group", [(1, True, 1), (1, True, 8), (7, True, 2), (64, True, 4), (17, False, 2)])
def test_cpu_sweep(backend_ready, D, dtype, L_new, with_new, group):
    L_max = 211
    lo = L_new if not with_new else 0
    seqlens = [lo, L_max - (L_new if with_new else 0), 97]
    seed = fresh_seed()
    inputs = to_device(make_case(3, 2 * group, 2, L_new, L_max, D, dtype, seqlens, with_new, seed=seed), DEVICE)
    for splits in (1, 4):
        check(cxx_op, *inputs, splits=splits, context=f"D{D} {dtype} L{L_new} G{group} seed {seed} splits {splits}")


# ---------------------------------------------------------------------------------------------
# decode_cuda.cu in CPU emulation

_EMU_HARNESS = r"""
// The shared checks and split rule come from decode_cpu.cpp itself (without its registration).
#define TF_KV_CACHE_NO_CPU_REGISTRATION 1
#include "decode_cpu.cpp"

namespace transformer_fast {
using std::max;
using std::min;
namespace {
alignas(16) unsigned char smem_raw[1 << 16];  // the kernels' `extern __shared__ smem_raw[]`
struct Grid;
int64_t device_slots(const at::Tensor& q);
template <typename Kernel, typename P>
void launch(Kernel kernel, Grid grid, size_t smem_bytes, const P& p);
}  // namespace
}  // namespace transformer_fast

#include "decode_cuda.cu"

namespace transformer_fast {
namespace {
int64_t device_slots(const at::Tensor&) { return 8; }

template <typename Kernel, typename P>
void launch(Kernel kernel, Grid grid, size_t smem_bytes, const P& p) {
  emu::run_grid(EmuDim3{static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y),
                        static_cast<unsigned>(grid.z)},
                kThreads, smem_raw, sizeof(smem_raw), smem_bytes, [&] { kernel(p); });
}
}  // namespace
}  // namespace transformer_fast

at::Tensor kv_fwd(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor seqlens,
                  std::optional<at::Tensor> k_new, std::optional<at::Tensor> v_new, double scale) {
  return transformer_fast::attention_with_kv_cache_fwd_cuda(q, k_cache, v_cache, seqlens, k_new,
                                                            v_new, scale, false);
}
"""


@pytest.fixture(scope="module")
def cuda_emulation():
    return cuda_emulation_build("tf_decode_cuda_emu", _EMU_HARNESS,
                                ("decode_cuda.cu", "decode_cpu.cpp", "decode.h", "ops.h"), ("kv_fwd",))


# (B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new, splits, Dv): small grids (every CTA is 128
# emulated threads).  ROWS buckets 1 / 4 / 8, head-dim buckets 64 / 128 / 256, split and unsplit.
EMU_CASES = [
    (2, 2, 2, 1, 45, 64, F32, [0, 44], True, 1, None),  # MHA decoding (ROWS 1)
    (2, 4, 2, 1, 45, 64, F32, [13, 44], True, 3, None),  # GQA 2, 3 splits (one row has 1 block)
    (1, 8, 1, 1, 70, 80, BF16, [69], True, 2, None),  # MQA: 8 heads packed in one CTA
    (1, 4, 1, 5, 40, 32, F32, [20], True, 1, None),  # chunk: 20 packed rows over 3 CTAs
    (1, 2, 1, 17, 40, 16, BF16, [6], True, 2, None),  # prefill-like chunk, split
    (2, 2, 2, 3, 20, 16, F32, [0, 2], False, 2, None),  # no k_new: dead rows (and a dead batch)
    (1, 2, 2, 1, 30, 256, F32, [29], True, 1, 40),  # D 256, Dv 40
    (1, 4, 2, 2, 30, 128, F16, [7], True, 4, None),  # more splits than key blocks
]


def _emu_id(c):
    B, H, Hkv, L, Lm, D, dt, sl, new, sp, dv = c
    return f"B{B}-H{H}x{Hkv}-L{L}-Lmax{Lm}-D{D}{'-Dv' + str(dv) if dv else ''}-{str(dt)[6:]}-{'new' if new else 'nonew'}-s{sp}"


@pytest.mark.parametrize("case", EMU_CASES, ids=[_emu_id(c) for c in EMU_CASES])
def test_cuda_kernels_emulated(cuda_emulation, case):
    B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new, splits, Dv = case
    seed = fresh_seed()
    inputs = to_device(make_case(B, H, Hkv, L_new, L_max, D, dtype, seqlens, with_new, Dv=Dv, seed=seed), "cpu")
    check(cuda_emulation.kv_fwd, *inputs, splits=splits, context=f"emulated {_emu_id(case)} seed {seed}")


def test_cuda_emulated_strided_and_heuristic(cuda_emulation):
    """Transposed q / k_new, caches as slices of bigger buffers (the append writes through their
    strides), the default split heuristic (8 slots, 2 CTAs -> it splits)."""
    B, H, Hkv, L_new, L_max, D = 1, 4, 2, 2, 150, 32
    g = torch.Generator().manual_seed(21)
    q = torch.randn(B, L_new, H, D, generator=g).transpose(1, 2)
    k_buf, v_buf = torch.randn(B, L_max + 3, Hkv, D + 8, generator=g), torch.randn(B, L_max + 3, Hkv, D + 8, generator=g)
    k_cache, v_cache = k_buf[:, 1:L_max + 1, :, 4:D + 4].transpose(1, 2), v_buf[:, 1:L_max + 1, :, 4:D + 4].transpose(1, 2)
    k_new, v_new = torch.randn(B, L_new, Hkv, D, generator=g).transpose(1, 2), torch.randn(B, L_new, Hkv, D, generator=g).transpose(1, 2)
    seqlens = torch.tensor([140], dtype=torch.int32)
    scale = D ** -0.5
    ref64, _, _ = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, torch.float64)
    ref_lp, kc_lp, vc_lp = run_reference(q, k_cache, v_cache, seqlens, k_new, v_new, scale, F32)
    k_before = k_buf.clone()
    with forced_splits(None), poisoned_outputs():
        out = cuda_emulation.kv_fwd(q, k_cache, v_cache, seqlens, k_new, v_new, scale)
    assert_oracle([oracle_compare("out", out, ref_lp, ref64, F32)], "emulated strided")
    assert torch.equal(k_cache, kc_lp) and torch.equal(v_cache, vc_lp)
    outside = torch.ones_like(k_buf, dtype=torch.bool)
    outside[:, 1:L_max + 1, :, 4:D + 4] = False
    assert torch.equal(k_buf[outside], k_before[outside])


def test_cuda_emulated_matches_cpu_backend(cuda_emulation):
    """Same inputs through both C++ backends: same caches, outputs within fp32 rounding."""
    inputs = to_device(make_case(2, 4, 2, 3, 50, 48, F32, [0, 47], True, seed=9), "cpu")
    q, kc, vc, sl, kn, vn = inputs
    kc2, vc2 = kc.clone(), vc.clone()
    with forced_splits(2):
        a = cuda_emulation.kv_fwd(q, kc, vc, sl, kn, vn, 0.2)
        b = cxx_op(q, kc2, vc2, sl, kn, vn, 0.2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
