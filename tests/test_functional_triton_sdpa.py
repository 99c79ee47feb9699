"""functional.scaled_dot_product_attention with backend="triton": the whole path (validation,
mask folding, 4-D views, custom op, autograd) against the float64 oracle. Without a GPU the
kernels run in the Triton interpreter on CPU tensors, so shapes stay small."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F
from transformer_fast import philox, reference

from _functional_helpers import DTYPES, MASK_KINDS, dt_id, generator, make_masks, randn
from conftest import require_backend
from test_functional_attention import check_sdpa

pytestmark = pytest.mark.triton


@pytest.fixture
def device():
    return require_backend("triton")


def _qkv(b, h, hkv, lq, lk, d, dtype, device, g=None):
    g = g or generator()
    q = randn(b, h, lq, d, dtype=dtype, g=g).to(device)
    k = randn(b, hkv, lk, d, dtype=dtype, g=g).to(device)
    v = randn(b, hkv, lk, d, dtype=dtype, g=g).to(device)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks(device, dtype, kind):
    b, h, lq, lk, d = 2, 2, 7, 33, 32
    q, k, v = _qkv(b, h, h, lq, lk, d, dtype, device)
    m = make_masks(kind, b, h, lq, lk, dtype)
    m = {key: (t.to(device) if isinstance(t, torch.Tensor) else t) for key, t in m.items()}
    check_sdpa("triton", q, k, v, context=kind, **m)


@pytest.mark.parametrize(
    "lq,lk,d", [(1, 1, 16), (1, 127, 64), (127, 7, 80), (33, 33, 128), (5, 19, 256), (9, 12, 48)]
)
def test_shapes_and_head_dims(device, lq, lk, d):
    q, k, v = _qkv(1, 2, 2, lq, lk, d, torch.float16, device)
    check_sdpa("triton", q, k, v, is_causal=True, context=f"{lq}x{lk} d={d}")


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa(device, hkv):
    q, k, v = _qkv(2, 4, hkv, 9, 17, 64, torch.bfloat16, device)
    check_sdpa("triton", q, k, v, is_causal=True, enable_gqa=True, context=f"hkv={hkv}")


def test_three_dim_and_extra_batch_dims(device):
    q, k, v = _qkv(3, 1, 1, 5, 9, 32, torch.float32, device)
    check_sdpa("triton", q[:, 0], k[:, 0], v[:, 0], context="3-D")
    g = generator()
    q5 = randn(2, 3, 2, 5, 32, g=g).to(device)
    k5 = randn(2, 3, 2, 9, 32, g=g).to(device)
    v5 = randn(2, 3, 2, 9, 32, g=g).to(device)
    check_sdpa("triton", q5, k5, v5, key_padding_mask=torch.rand(2, 9, device=device) < 0.3, context="5-D")


def test_packed_qkv_views_are_not_copied(device):
    b, l, h, d = 2, 11, 2, 32
    packed = torch.randn(b, l, 3, h, d, device=device)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D) strided views
    assert not q.is_contiguous()
    check_sdpa("triton", q, k, v, is_causal=True, context="packed")


def test_dropout_exact_mask(device):
    b, h, lq, lk, d = 2, 2, 9, 13, 32
    q, k, v = _qkv(b, h, h, lq, lk, d, torch.float32, device)
    p, seed = 0.3, 1234
    torch.manual_seed(seed)
    keep = philox.dropout_keep_mask(philox.new_rng(device), (b, h, lq, lk), p)

    def kernel(query, key, value):
        torch.manual_seed(seed)
        return F.scaled_dot_product_attention(query, key, value, dropout_p=p, backend="triton")

    def ref(query, key, value):
        return reference.scaled_dot_product_attention(query, key, value, None, p, keep=keep)

    results = reference.run_oracle(kernel, ref, {"query": q, "key": k, "value": v}, ["query", "key", "value"])
    reference.assert_oracle(results, "dropout")


def test_auto_and_reasons(device):
    q, k, v = _qkv(1, 1, 1, 3, 3, 24 + 4, torch.float32, device)  # head dim 28: not supported
    reasons = tf.not_supported_reasons("triton", "scaled_dot_product_attention",
                                       {"query": q, "key": k, "value": v})
    assert any("head dims" in r for r in reasons)
    with pytest.raises(tf.BackendError, match="head dims"):
        F.scaled_dot_product_attention(q, k, v, backend="triton")
    mask = torch.zeros(3, 3, device=device, requires_grad=True)
    reasons = tf.not_supported_reasons("triton", "scaled_dot_product_attention",
                                       {"query": q, "key": k, "value": v, "attn_mask": mask})
    assert any("gradient of a float attn_mask" in r for r in reasons)


def test_opcheck(device):
    from transformer_fast.ops import attention as op

    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 5, 7, 16, torch.float32, device))
    mask = (torch.rand(1, 1, 5, 7, device=device) < 0.8).expand(1, 2, 5, 7)
    torch.library.opcheck(op.attention_fwd, (q, k, v, mask, None, True, 0.25, 0.0, None, False, "triton"))


@pytest.mark.parametrize("tune", ["0", "1"])
def test_kept_configs_fit_shared_memory(monkeypatch, tune):
    """The configs the autotune pruning keeps fit sm_90's shared memory by the launcher's estimate
    (an upper bound of Triton's allocation), so that TRANSFORMER_FAST_AUTOTUNE=0, which runs the
    first one alone, never launches one that raises OutOfResources.  The first GPU run (H200)
    failed every head-dim-256 case with Lq < 32 in fp16 / bf16: the forward kept (16, 128, 4, 3),
    274432 bytes (Triton 3.8's metadata.shared; the limit is 232448).  Plain Python: no GPU."""
    from transformer_fast.kernels import attention as A

    monkeypatch.setenv("TRANSFORMER_FAST_AUTOTUNE", tune)
    lists = {
        "fwd": (A._prune_fwd, A.FWD_TUNE_CONFIGS),
        "dq": (A._prune_dq, A.DQ_TUNE_CONFIGS),
        "dkdv": (A._prune_dkdv, A.DKDV_TUNE_CONFIGS),
    }
    for dtype, precise in ((torch.float16, False), (torch.bfloat16, False), (torch.float32, False),
                           (torch.float32, True)):
        q = torch.empty(1, dtype=dtype)
        for block_d in (16, 32, 64, 128, 256):
            for length in (1, 8, 16, 32, 64, 128, 1024):
                for mask_kind, drop in ((0, 0), (1, 0), (2, 0), (0, 2), (2, 2)):
                    args = dict(BLOCK_D=block_d, LQ_KEY=length, LK_KEY=length, MASK_KIND=mask_kind,
                                HAS_DROPOUT=drop, PRECISE=precise)
                    for kind, (prune, configs) in lists.items():
                        kept = prune(configs, {"Q": q}, **args)
                        assert kept and (len(kept) == 1 or tune == "1")
                        for c in kept:
                            est = A._smem_estimate(kind, c, {"Q": q, **args})
                            assert est <= A.SMEM_DEFAULT_LIMIT, (kind, dtype, args, A._key(c), est)
    # The configuration that failed, and what the forward keeps instead.
    args = dict(BLOCK_D=256, LQ_KEY=8, LK_KEY=32, MASK_KIND=0)
    first = A._key(A._prune_fwd(lists["fwd"][1], {"Q": torch.empty(1, dtype=torch.float16)}, **args)[0])
    assert first != (16, 128, 4, 3) and first[0] == 16


# Triton 3.8's metadata.shared for sm_90 (TRITON_INTERPRET=0, compile_check --resources; Triton
# 3.6 gives the same) of fp32 configs the estimate once put under it: exact fp32 ("precise")
# holds float64 dot operands.  (kind, precise, BLOCK_D, mask + dropout, config, bytes)
_FP32_SMEM_MEASURED = [
    ("dq", True, 256, False, (64, 32, 8, 2), 360448),  # kept first with AUTOTUNE=0: OutOfResources
    ("dq", True, 256, True, (32, 32, 4, 2), 233472),
    ("dq", True, 128, False, (64, 64, 8, 3), 262144),
    ("dq", True, 64, False, (64, 32, 8, 2), 90112),
    ("dq", False, 256, False, (64, 32, 8, 2), 262144),
    ("dq", False, 128, True, (64, 32, 8, 2), 139264),
    ("fwd", True, 64, False, (64, 32, 8, 2), 57600),
    ("fwd", False, 64, True, (64, 32, 4, 2), 65536),
    ("dkdv", True, 256, False, (16, 32, 4, 2), 172224),
    ("dkdv", True, 256, False, (64, 32, 8, 2), 328448),
    ("dkdv", True, 128, True, (16, 32, 4, 2), 88256),
    ("dkdv", True, 64, False, (16, 32, 4, 2), 43200),
    # The exact lists past BLOCK_D 64 (_FP32_EXACT_WIDE), within 1-3% of the estimate.
    ("dkdv", True, 128, False, (16, 32, 8, 2), 86208),
    ("dq", True, 256, True, (32, 16, 8, 2), 182272),
    ("dq", True, 256, True, (16, 16, 8, 2), 115712),
    ("fwd", True, 256, False, (64, 32, 8, 2), 205056),
]


@pytest.mark.parametrize("kind, precise, block_d, masked, cfg, measured", _FP32_SMEM_MEASURED)
def test_fp32_smem_estimate_covers_the_compiled_kernels(kind, precise, block_d, masked, cfg, measured):
    """The shared-memory estimate is at or above what the compiled fp32 kernels allocate, so the
    pruning never keeps one that does not fit: exact fp32's dq at head dims 129-256 kept (64, 32,
    8, 2), which needs 360448 bytes (sm_90 gives 232448)."""
    import triton

    from transformer_fast.kernels import attention as A

    c = triton.Config({"BLOCK_M": cfg[0], "BLOCK_N": cfg[1]}, num_warps=cfg[2], num_stages=cfg[3])
    args = {"Q": torch.empty(1, dtype=torch.float32), "BLOCK_D": block_d, "PRECISE": precise,
            "MASK_KIND": 2 if masked else 0, "HAS_DROPOUT": 2 if masked else 0}
    assert A._smem_estimate(kind, c, args) >= measured
