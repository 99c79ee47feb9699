"""The cuda backend of scaled_dot_product_attention (csrc/attention_cuda.cu, mma.sync tensor-core
flash attention for fp16 / bf16; csrc/attention_fp32_cuda.cu, exact-fp32 SIMT kernels for fp32)
against the float64 oracle: the checks of tests/test_attention_cpu.py with BACKEND = "cuda" (every
dtype), plus larger shapes across the head-dim buckets (64, 128, 256), fp32 under torch's tf32
setting, and the output layouts.  Marked gpu: skipped without CUDA."""
import pytest
import torch

import test_attention_cpu as base
from transformer_fast import functional as F
from test_attention_cpu import (  # noqa: F401  (the shared checks, collected again here)
    test_backward_is_deterministic,
    test_bad_input_errors,
    test_dead_rows_have_zero_gradient,
    test_dropout_exact_mask,
    test_gqa,
    test_launcher_keep_mask_and_lse,
    test_lengths_and_head_dims,
    test_masks,
    test_opcheck,
    test_strided_inputs,
)
from _functional_helpers import generator, make_masks, tf32_allowed
from conftest import require_backend
from test_functional_attention import check_sdpa


pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_backend(monkeypatch):
    monkeypatch.setattr(base, "BACKEND", "cuda")
    monkeypatch.setattr(base, "ONE_DTYPE", torch.float16)


@pytest.fixture
def device():
    return require_backend("cuda")


def test_fp32_is_exact_under_tf32_setting(device):
    """fp32 runs the exact-fp32 kernels whatever torch's tf32 setting says (allow_tf32 is ignored:
    exact fp32 is within the contract), so the fp32 oracle holds with tf32 allowed too."""
    g = generator()
    q, k, v = base._qkv(2, 4, 2, 100, 77, 128, torch.float32, device, g)
    with tf32_allowed():
        check_sdpa("cuda", q, k, v, is_causal=True, enable_gqa=True, context="fp32, tf32 allowed")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape, scale", [((2, 4, 2, 1, 70), None), ((2, 4, 2, 2, 7), 2.0), ((2, 4, 2, 3, 3), 2.0)],
                         ids=["one-key-rows", "2x7-scale2", "3x3-scale2"])
def test_fp32_lone_keys_and_large_logits_on_the_gpus_exp(device, backend, shape, scale):
    """Exact fp32 on the GPU's own expf / ex2.approx (2026-12-02: in CPU emulation with a 2-ulp
    expf, the cuda backward's log-domain renormalisation failed these in 12-83% of draws; both
    backends now renormalise by 1 / rowsum).  Causal with Lq 1: each row sees one key."""
    require_backend(backend)
    b, h, hkv, lq, lk = shape
    for draw in range(8):
        g = generator()
        q, k, v = base._qkv(b, h, hkv, lq, lk, 64, torch.float32, device, g)
        check_sdpa(backend, q, k, v, is_causal=lq == 1, scale=scale, enable_gqa=True, context=f"draw {draw}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_output_layout_follows_q(device, dtype):
    """out in q's memory order (a (B, L, H, D) view gives a (B, L, H, D)-ordered out: the head
    merge is a view), gradients like q / k / v, as the fake op says (opcheck checks it too)."""
    from transformer_fast.ops import attention as op

    b, l, h, d = 2, 37, 4, 64
    packed = torch.randn(b, l, 3, h, d, device=device, dtype=dtype)
    q, k, v = (packed[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    out, _ = op.attention_fwd(q, k, v, None, None, True, d ** -0.5, 0.0, None, False, "cuda")
    assert out.transpose(1, 2).is_contiguous()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    for got, like in ((dq, q), (dk, k), (dv, v)):
        assert got.stride() == torch.empty_like(like).stride()
    torch.library.opcheck(op.attention_fwd, (q, k, v, None, None, True, 0.125, 0.0, None, False, "cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("d", [32, 64, 80, 128, 192, 256])
@pytest.mark.parametrize("kind", ["none", "causal", "causal+float_bh+kpm", "dead"])
def test_large_shapes(device, dtype, d, kind):
    b, h, lq, lk = 2, 4, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, h, lq, lk, d, dtype, device, g)
    m = base._to(make_masks(kind, b, h, lq, lk, dtype, g), device)
    check_sdpa("cuda", q, k, v, context=f"{kind} d={d}", **m)


# ---- The sm_90a wgmma kernels: on a Hopper GPU the dense ones (csrc/attention_wgmma_{dense,dkdv,dq}.cuh)
# take the unmasked calls by default; TRANSFORMER_FAST_CUDA_WGMMA=0 turns them off, =1 also sends the
# forwards no dense kernel takes to fwd_wgmma_kernel (csrc/attention_wgmma.cuh).

WGMMA_ENV = "TRANSFORMER_FAST_CUDA_WGMMA"
DENSE_ENV = "TRANSFORMER_FAST_CUDA_DENSE"


def _kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@pytest.fixture
def wgmma(device, monkeypatch):
    """The wgmma forward switched on, and shown to run (a profiled call launches its kernel)."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the wgmma forward runs on compute capability 9.x (Hopper) only")
    monkeypatch.setenv(WGMMA_ENV, "1")
    q = torch.randn(1, 2, 64, 64, device=device, dtype=torch.float16)
    # with dropout: the generic wgmma forward (the dense kernels take no dropout)
    names = _kernel_names(lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5, backend="cuda"))
    assert any("fwd_wgmma_kernel" in n for n in names), (
        f"{WGMMA_ENV}=1 on a 9.x GPU did not launch fwd_wgmma_kernel (extension built without "
        f"sm_90a? TORCH_CUDA_ARCH_LIST must include 9.0a); kernels: {sorted(names)}")
    return device


@pytest.fixture
def mma_sync(device, monkeypatch):
    """The wgmma kernels switched off: the mma.sync kernels run on every GPU (on a Hopper the
    dense wgmma ones would otherwise take the unmasked calls)."""
    monkeypatch.setenv(WGMMA_ENV, "0")
    return device


def test_wgmma_is_the_default_on_hopper(device, monkeypatch):
    """Without the variable, a Hopper GPU runs the dense wgmma kernels (forward and backward) for
    an unmasked 16-bit call and for one with a key_padding_mask, the mma.sync dense kernels for
    one with an attn_mask and fwd_kernel (not fwd_wgmma_kernel) for one with dropout;
    TRANSFORMER_FAST_CUDA_WGMMA=0 runs no wgmma kernel.  Elsewhere no wgmma kernel runs."""
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    monkeypatch.delenv(DENSE_ENV, raising=False)
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    q = torch.randn(1, 2, 200, 64, device=device, dtype=torch.bfloat16, requires_grad=True)

    def call(**kw):
        F.scaled_dot_product_attention(q, q, q, backend="cuda", **kw).sum().backward()

    names = _kernel_names(call)
    for kernel in ("fwd_wgmma_dense_kernel", "dkdv_wgmma_dense_kernel", "dq_wgmma_dense_kernel"):
        assert any(kernel in n for n in names) == hopper, (kernel, sorted(names))
    kpm = torch.zeros(1, 200, dtype=torch.bool, device=device)
    kpm[0, -1] = True
    names = _kernel_names(lambda: call(key_padding_mask=kpm))
    for kernel in ("fwd_wgmma_dense_kernel", "dkdv_wgmma_dense_kernel", "dq_wgmma_dense_kernel"):
        assert any(kernel in n for n in names) == hopper, (kernel, sorted(names))
    assert any("dkdv_dense_kernel" in n and "wgmma" not in n for n in names) != hopper, sorted(names)
    names = _kernel_names(lambda: call(attn_mask=~kpm[0].expand(200, 200)))
    assert not any("wgmma" in n for n in names) and any("fwd_dense_kernel" in n for n in names), sorted(names)
    names = _kernel_names(lambda: call(dropout_p=0.3))
    assert not any("wgmma" in n for n in names) and any("fwd_kernel" in n for n in names), sorted(names)
    monkeypatch.setenv(WGMMA_ENV, "0")
    names = _kernel_names(call)
    assert not any("wgmma" in n for n in names) and any("fwd_dense_kernel" in n for n in names), sorted(names)


def test_wgmma_dense_runs_where_it_fits(wgmma, monkeypatch):
    """With the wgmma forward on, an unmasked 16-bit forward runs fwd_wgmma_dense_kernel
    (csrc/attention_wgmma_dense.cuh) and its backward dkdv_wgmma_dense_kernel and
    dq_wgmma_dense_kernel (attention_wgmma_{dkdv,dq}.cuh), and so does one with a
    key_padding_mask; one with an attn_mask the mma.sync dense kernels (the wgmma ones have no
    attn_mask code); TRANSFORMER_FAST_CUDA_DENSE=0 sends them to fwd_wgmma_kernel and the
    generic backward."""
    q = torch.randn(1, 2, 300, 128, device=wgmma, dtype=torch.bfloat16, requires_grad=True)

    def call(**kw):
        F.scaled_dot_product_attention(q, q, q, is_causal=True, backend="cuda", **kw).sum().backward()

    kpm = torch.zeros(1, 300, dtype=torch.bool, device=wgmma)
    kpm[0, -1] = True
    for names in (_kernel_names(call), _kernel_names(lambda: call(key_padding_mask=kpm))):
        for kernel in ("fwd_wgmma_dense_kernel", "dkdv_wgmma_dense_kernel", "dq_wgmma_dense_kernel"):
            assert any(kernel in n for n in names), (kernel, sorted(names))
    names = _kernel_names(lambda: call(attn_mask=~kpm[0].expand(300, 300)))
    for kernel in ("fwd_dense_kernel", "dkdv_dense_kernel", "dq_dense_kernel"):
        assert any(kernel in n and "wgmma" not in n for n in names), (kernel, sorted(names))
    monkeypatch.setenv(DENSE_ENV, "0")
    names = _kernel_names(call)
    assert not any("wgmma_dense" in n for n in names) and any("fwd_wgmma_kernel" in n for n in names)


def _bwd_args(ops, device, d, causal, mask="nomask"):
    """attention_bwd's arguments from one forward: bf16, B 1, H 4 over Hkv 2 (GQA), Lq 300,
    Lk 517, fresh draws, no dropout; mask "kpm": 30% of the keys and keys 64..191 padding, "am":
    a (1, 4, 300, 517) bf16 attn_mask (-inf at 20%)."""
    g = generator()
    q = base._qkv(1, 4, 2, 300, 517, d, torch.bfloat16, device, g)  # (q, k, v)
    do = torch.randn_like(q[0])
    pad = am = None
    if mask == "kpm":
        pad = torch.rand(1, 517, generator=g) < 0.3
        pad[:, 64:192] = True
        pad = pad.to(device)
    if mask == "am":
        am = make_masks("float_bh", 1, 4, 300, 517, torch.bfloat16, g)["attn_mask"].to(device)
    out, lse = ops.attention_fwd(*q, am, pad, causal, d ** -0.5, 0.0, None, False)
    return (do, *q, out, lse, am, pad, causal, d ** -0.5, 0.0, None, False)


@pytest.mark.parametrize("mask", ["nomask", "kpm"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("d", [40, 128])
def test_wgmma_backward_matches_dense(wgmma, monkeypatch, d, causal, mask):
    """From the same forward: the wgmma backward's dQ, dK and dV agree with the dense mma.sync
    kernels' to bf16 rounding (as in the CPU emulation), with a key_padding_mask too."""
    ops = torch.ops.transformer_fast_C
    args = _bwd_args(ops, wgmma, d, causal, mask)
    got = ops.attention_bwd(*args)
    monkeypatch.setenv(WGMMA_ENV, "0")
    want = ops.attention_bwd(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


ATOMIC_DQ_ENV = "TRANSFORMER_FAST_CUDA_ATOMIC_DQ"


@pytest.mark.parametrize("mask", ["nomask", "kpm"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("d", [96, 128])
def test_wgmma_atomic_dq_matches_dq_kernel(device, monkeypatch, d, causal, mask):
    """TRANSFORMER_FAST_CUDA_ATOMIC_DQ=1 on a Hopper: dkdv_wgmma_dense_kernel forms dQ by atomics
    and dq_wgmma_dense_kernel does not run; dQ agrees with that kernel's to bf16 rounding and dK,
    dV are the same bits (as in the CPU emulation); under torch.use_deterministic_algorithms the
    dQ kernel runs again."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the wgmma kernels run on compute capability 9.x (Hopper) only")
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    ops = torch.ops.transformer_fast_C
    args = _bwd_args(ops, device, d, causal, mask)
    want = ops.attention_bwd(*args)
    monkeypatch.setenv(ATOMIC_DQ_ENV, "1")
    names = _kernel_names(lambda: ops.attention_bwd(*args))
    assert not any("dq_wgmma_dense_kernel" in n for n in names), sorted(names)
    got = ops.attention_bwd(*args)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        names = _kernel_names(lambda: ops.attention_bwd(*args))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert any("dq_wgmma_dense_kernel" in n for n in names), sorted(names)


@pytest.mark.parametrize("kind", ["none", "causal", "kpm", "causal+kpm_tail"])
@pytest.mark.parametrize("d", [80, 128])
def test_wgmma_atomic_dq_oracle(device, monkeypatch, d, kind):
    """The oracle with dQ by atomics: ragged lengths, GQA, padding with rows of one key and none."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the wgmma kernels run on compute capability 9.x (Hopper) only")
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    monkeypatch.setenv(ATOMIC_DQ_ENV, "1")
    b, h, lq, lk = 3, 4, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, 2, lq, lk, d, torch.bfloat16, device, g)
    m = base._to(make_masks(kind, b, h, lq, lk, torch.bfloat16, g), device)
    check_sdpa("cuda", q, k, v, enable_gqa=True, context=f"atomic dq {kind} d={d}", **m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [16, 40, 64, 96, 128])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 517), (1, 2, 2, 1, 129), (2, 2, 1, 256, 64), (1, 4, 4, 1024, 1024)],
                         ids=lambda s: "B{}H{}kv{}q{}k{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_wgmma_dense_oracle(wgmma, dtype, d, shape, causal):
    """fwd_wgmma_dense_kernel (128 x 128 tiles, one to eight key tiles) and, for the gradients,
    dkdv_wgmma_dense_kernel (128 keys x 64-query tiles) and dq_wgmma_dense_kernel (128 rows x
    64-key tiles): ragged lengths, GQA."""
    b, h, hkv, lq, lk = shape
    g = generator()
    q, k, v = base._qkv(b, h, hkv, lq, lk, d, dtype, wgmma, g)
    check_sdpa("cuda", q, k, v, is_causal=causal, enable_gqa=True, context=f"wgmma dense d={d} {shape}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("kind", ["kpm", "causal+kpm", "kpm_tail", "causal+kpm_tail"])
def test_wgmma_dense_kpm_oracle(device, dtype, d, kind):
    """The default path with a key_padding_mask (on a Hopper: the wgmma dense kernels' padding
    bits and right-padding end, forward and backward): scattered and right padding,
    rows of one key and of none, causal or not, forward and gradients."""
    b, h, lq, lk = 3, 4, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, 2, lq, lk, d, dtype, device, g)
    m = base._to(make_masks(kind, b, h, lq, lk, dtype, g), device)
    check_sdpa("cuda", q, k, v, enable_gqa=True, context=f"wgmma kpm {kind} d={d}", **m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize("kind", ["none", "causal", "causal+float_bh+kpm", "bool_b1", "dead"])
def test_wgmma_forward_oracle(wgmma, monkeypatch, dtype, d, kind):
    """fwd_wgmma_kernel, the generic wgmma forward: with the dense kernels switched off (they
    would take these calls, masks included)."""
    monkeypatch.setenv(DENSE_ENV, "0")
    b, h, hkv, lq, lk = 2, 4, 2, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, hkv, lq, lk, d, dtype, wgmma, g)
    m = base._to(make_masks(kind, b, h, lq, lk, dtype, g), wgmma)
    check_sdpa("cuda", q, k, v, enable_gqa=True, context=f"wgmma {kind} d={d}", **m)


def test_wgmma_forward_packed_views_and_dropout(wgmma, monkeypatch):
    """q/k/v as views of one packed projection (read through strides), dropout: the same keep
    mask as fwd_kernel (the outputs differ by accumulation order only, a wrong mask by O(1))."""
    b, l, h, d = 2, 197, 4, 64
    qkv = torch.randn(b, l, 3, h, d, device=wgmma, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    check_sdpa("cuda", q, k, v, is_causal=True, context="wgmma, packed views")
    torch.manual_seed(7)
    got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True, backend="cuda")
    monkeypatch.setenv(WGMMA_ENV, "0")
    torch.manual_seed(7)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True, backend="cuda")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ---- The dense forward (csrc/attention_dense_fwd.cuh): the default for fp16 / bf16 forwards
# without dropout (is_causal, key_padding_mask and attn_mask allowed), 16-byte aligned rows,
# D <= 128; TRANSFORMER_FAST_CUDA_DENSE=0 sends them to fwd_kernel.


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_dense_forward_runs_where_it_fits(device, mma_sync, monkeypatch, causal):
    """The dense kernel is what runs for a 16-bit forward with or without masks, and fwd_kernel
    what runs with dropout or with the switch off."""
    monkeypatch.delenv(DENSE_ENV, raising=False)
    q = torch.randn(1, 2, 64, 64, device=device, dtype=torch.bfloat16)
    call = lambda **kw: F.scaled_dot_product_attention(q, q, q, is_causal=causal, backend="cuda", **kw)  # noqa: E731
    assert any("fwd_dense_kernel" in n for n in _kernel_names(call))
    kpm = torch.zeros(1, 64, dtype=torch.bool, device=device)
    kpm[0, -1] = True  # one padded key: a mask no layer above could drop as empty
    assert any("fwd_dense_kernel" in n for n in _kernel_names(lambda: call(key_padding_mask=kpm)))
    assert any("fwd_dense_kernel" in n for n in _kernel_names(lambda: call(attn_mask=~kpm[0].expand(64, 64))))
    dropped = _kernel_names(lambda: call(dropout_p=0.5))
    assert not any("fwd_dense_kernel" in n for n in dropped) and any("fwd_kernel" in n for n in dropped)
    monkeypatch.setenv(DENSE_ENV, "0")
    assert not any("fwd_dense_kernel" in n for n in _kernel_names(call))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("kind", ["kpm", "causal+kpm", "kpm_tail", "causal+kpm_tail", "bool_b1",
                                  "causal+float_bh+kpm", "float_2d", "dead"])
def test_dense_masks_oracle(device, mma_sync, dtype, d, kind):
    """The dense kernels with masks, forward and backward: scattered padding and right padding
    (tiles and dK / dV blocks of padding only, a batch row of padding only), attn_mask bool and
    float, broadcast or full, with padding and causal, rows with nothing visible."""
    b, h, lq, lk = 3, 4, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, 2, lq, lk, d, dtype, device, g)
    m = base._to(make_masks(kind, b, h, lq, lk, dtype, g), device)
    check_sdpa("cuda", q, k, v, enable_gqa=True, context=f"dense {kind} d={d}", **m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [16, 40, 64, 96, 128])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 517), (1, 2, 2, 1, 129), (2, 2, 1, 256, 64), (1, 4, 4, 1024, 1024)],
                         ids=lambda s: "B{}H{}kv{}q{}k{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_dense_forward_oracle(device, mma_sync, dtype, d, shape, causal):
    b, h, hkv, lq, lk = shape
    g = generator()
    q, k, v = base._qkv(b, h, hkv, lq, lk, d, dtype, device, g)
    check_sdpa("cuda", q, k, v, is_causal=causal, enable_gqa=True, context=f"dense d={d} {shape}")


def test_dense_forward_packed_views_match_fwd_kernel(device, mma_sync, monkeypatch):
    """q/k/v as views of one packed projection: the dense forward reads them through their
    strides and agrees with fwd_kernel (same math, base-2 exponent: rounding differences only)."""
    b, l, h, d = 2, 197, 4, 128
    qkv = torch.randn(b, l, 3, h, d, device=device, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    check_sdpa("cuda", q, k, v, is_causal=True, context="dense, packed views")
    monkeypatch.delenv(DENSE_ENV, raising=False)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cuda")
    monkeypatch.setenv(DENSE_ENV, "0")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cuda")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mask", ["nomask", "kpm", "am"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("d", [40, 128])
def test_dense_backward_matches_generic(device, mma_sync, monkeypatch, d, causal, mask):
    """From the same forward: dkdv_dense_kernel and dq_dense_kernel agree with the generic
    kernels to bf16 rounding (as in the CPU emulation), with a key_padding_mask or an attn_mask."""
    ops = torch.ops.transformer_fast_C
    args = _bwd_args(ops, device, d, causal, mask)
    monkeypatch.setenv(DENSE_ENV, "0")
    want = ops.attention_bwd(*args)
    monkeypatch.delenv(DENSE_ENV)
    got = ops.attention_bwd(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
