"""C++ flash attention (csrc/attention_cpu.cpp, the `cpu` backend of scaled_dot_product_attention
and the tested reference of the tiling csrc/attention_cuda.cu runs) against the float64 oracle of
DESIGN section 6: the whole functional path (validation, mask folding, custom op, autograd) and the
C++ launcher directly (lse, dead rows, dropout keep mask bit for bit).

tests/test_gpu_attention_cuda.py runs the same checks for backend="cuda" (BACKEND below).
The kernels tile by 64 x 64, so lengths 1, 7, 63..65, 127, 130 cross every block edge case.
"""
import math

import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F
from transformer_fast import philox, reference

from _functional_helpers import DTYPES, MASK_KINDS, dt_id, generator, make_masks, randn
from conftest import require_backend
from test_functional_attention import check_sdpa

# The cuda test module monkeypatches these two (module globals are read at call time).
BACKEND = "cpu"
ONE_DTYPE = torch.float32  # the dtype of the tests that run one dtype (cuda: float16)


@pytest.fixture
def device():
    return require_backend(BACKEND)


def _qkv(b, h, hkv, lq, lk, d, dtype, device, g=None):
    g = g or generator()
    q = randn(b, h, lq, d, dtype=dtype, g=g).to(device)
    k = randn(b, hkv, lk, d, dtype=dtype, g=g).to(device)
    v = randn(b, hkv, lk, d, dtype=dtype, g=g).to(device)
    return q, k, v


def _to(m, device):
    return {key: (t.to(device) if isinstance(t, torch.Tensor) else t) for key, t in m.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks(device, dtype, kind):
    """Every mask kind (incl. fully masked rows, 'dead') with Lq != Lk over two key blocks."""
    b, h, lq, lk, d = 2, 2, 7, 70, 32
    q, k, v = _qkv(b, h, h, lq, lk, d, dtype, device)
    check_sdpa(BACKEND, q, k, v, context=kind, **_to(make_masks(kind, b, h, lq, lk, dtype), device))


@pytest.mark.parametrize(
    "lq,lk,d,causal",
    [(1, 1, 16, False), (1, 127, 64, True), (127, 7, 64, True), (127, 127, 128, True),
     (65, 130, 16, False), (5, 19, 256, True), (63, 64, 80, False)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
def test_lengths_and_head_dims(device, lq, lk, d, causal, dtype):
    q, k, v = _qkv(1, 2, 2, lq, lk, d, dtype, device)
    check_sdpa(BACKEND, q, k, v, is_causal=causal, context=f"{lq}x{lk} d={d} causal={causal}")


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa(device, hkv):
    """dk/dv summed over the query heads of each group (the dk/dv pass loops over them)."""
    dtype = torch.bfloat16
    q, k, v = _qkv(2, 4, hkv, 70, 67, 64, dtype, device)
    m = _to(make_masks("causal+kpm", 2, 4, 70, 67, dtype), device)
    check_sdpa(BACKEND, q, k, v, enable_gqa=True, context=f"hkv={hkv}", **m)


def test_strided_inputs(device):
    """q/k/v as (B, H, L, D) views of one packed (B, L, 3, H, D) projection, and a scale."""
    b, l, h, d = 2, 11, 2, 32
    dtype = ONE_DTYPE
    packed = randn(b, l, 3, h, d, dtype=dtype).to(device)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    check_sdpa(BACKEND, q, k, v, is_causal=True, scale=0.3, context="packed")


def test_dropout_exact_mask(device):
    """Forward and backward drop exactly transformer_fast.philox's elements (same rng draw)."""
    b, h, lq, lk, d = 2, 2, 9, 70, 32
    q, k, v = _qkv(b, h, h, lq, lk, d, ONE_DTYPE, device)
    p, seed = 0.3, 1234
    torch.manual_seed(seed)
    keep = philox.dropout_keep_mask(philox.new_rng(device), (b, h, lq, lk), p)

    def kernel(query, key, value):
        torch.manual_seed(seed)  # the functional draws the same rng as above
        return F.scaled_dot_product_attention(query, key, value, dropout_p=p, is_causal=True,
                                              backend=BACKEND)

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(query, key, value, None, p, True, keep=keep)

    results = reference.run_oracle(kernel, ref, {"query": q, "key": k, "value": v},
                                   ["query", "key", "value"])
    reference.assert_oracle(results, "dropout")


def _launch_fwd(q, k, v, mask=None, kpm=None, causal=False, scale=0.125, p=0.0, rng=None):
    import transformer_fast._C  # noqa: F401  (registers the ops)

    return torch.ops.transformer_fast_C.attention_fwd(q, k, v, mask, kpm, causal, scale, p, rng, False)


def test_launcher_keep_mask_and_lse(device):
    """With v = identity, out[i, :Lk] is the dropped probability row: the kernel's keep mask
    equals philox's bit for bit, the kept fraction is 1 - p, and lse is the natural-log
    logsumexp of the scaled scores (-inf and zero output for a row with no key)."""
    B, H, Lq, Lk, D, p = 2, 2, 64, 64, 64, 0.25
    dtype = ONE_DTYPE
    q = randn(B, H, Lq, D, dtype=dtype).to(device)
    k = randn(B, H, Lk, D, dtype=dtype).to(device)
    v = torch.eye(Lk, D, device=device, dtype=dtype).expand(B, H, Lk, D)
    rng = torch.tensor([123456789, 42], dtype=torch.int64, device=device)
    out, lse = _launch_fwd(q, k, v, p=p, rng=rng)
    kept = out != 0
    ref_keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p)
    assert torch.equal(kept, ref_keep)
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / kept.numel())
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.125
    probs = torch.softmax(s, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), probs * ref_keep / (1 - p), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-4)
    # the same rng gives the same output; another offset another mask
    assert torch.equal(_launch_fwd(q, k, v, p=p, rng=rng)[0], out)
    rng2 = torch.tensor([123456789, 43], dtype=torch.int64, device=device)
    assert not torch.equal(_launch_fwd(q, k, v, p=p, rng=rng2)[0] != 0, kept)
    # a fully padded batch row: output 0, lse -inf
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=device)
    kpm[1] = True
    out, lse = _launch_fwd(q, k, v, kpm=kpm)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()


def test_dead_rows_have_zero_gradient(device):
    dtype = ONE_DTYPE
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 2, 9, 70, 32, dtype, device))
    kpm = torch.zeros(2, 70, dtype=torch.bool, device=device)
    kpm[1] = True
    out = F.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend=BACKEND)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.equal(t.grad[1], torch.zeros_like(t.grad[1]))


def test_backward_is_deterministic(device):
    dtype = ONE_DTYPE
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 70, 70, 32, dtype, device))
    grads = []
    for _ in range(2):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=BACKEND)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_bad_input_errors(device):
    dtype = ONE_DTYPE
    q, k, v = _qkv(1, 2, 2, 3, 5, 28, dtype, device)  # head dim 28: not a multiple of 8
    with pytest.raises(tf.BackendError, match="head dims"):
        F.scaled_dot_product_attention(q, k, v, backend=BACKEND)
    q, k, v = _qkv(1, 2, 2, 3, 5, 32, dtype, device)
    with pytest.raises(ValueError, match="key_padding_mask"):
        F.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool,
                                                                              device=device),
                                       backend=BACKEND)
    # the C++ launcher checks too (TORCH_CHECK names the argument)
    with pytest.raises(RuntimeError, match="attn_mask must be"):
        _launch_fwd(q, k, v, mask=torch.ones(1, 2, 3, 4, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match="rng"):
        _launch_fwd(q, k, v, p=0.5)


def test_opcheck(device):
    from transformer_fast.ops import attention as op

    dtype = ONE_DTYPE
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 5, 7, 16, dtype, device))
    mask = (torch.rand(1, 1, 5, 7, device=device) < 0.8).expand(1, 2, 5, 7)
    torch.library.opcheck(op.attention_fwd, (q, k, v, mask, None, True, 0.25, 0.0, None, False, BACKEND))
