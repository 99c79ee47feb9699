"""The cuda backend of scaled_dot_product_attention (csrc/attention_cuda.cu, mma.sync tensor-core
flash attention) against the float64 oracle: the checks of tests/test_attention_cpu.py with
BACKEND = "cuda" (fp16 / bf16 only: the kernels have no fp32 path), plus larger shapes across the
head-dim buckets (64, 128, 256) and the error for fp32.  Marked gpu: skipped without CUDA."""
import pytest
import torch

import test_attention_cpu as base
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
from _functional_helpers import generator, make_masks
from conftest import require_backend
from test_functional_attention import check_sdpa

import transformer_fast as tf
from transformer_fast import functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_backend(monkeypatch):
    monkeypatch.setattr(base, "BACKEND", "cuda")
    monkeypatch.setattr(base, "ONE_DTYPE", torch.float16)


@pytest.fixture
def device():
    return require_backend("cuda")


# The shared tests parametrize over fp32 too (for the cpu backend); the cuda backend refuses fp32
# (test_fp32_is_refused checks that), so those cases are skipped here.
def _skip_fp32(dtype):
    if dtype == torch.float32:
        pytest.skip("cuda attention is fp16/bf16 only (see test_fp32_is_refused)")


@pytest.fixture(autouse=True)
def _no_fp32(request):
    dtype = request.node.callspec.params.get("dtype") if hasattr(request.node, "callspec") else None
    if dtype is not None:
        _skip_fp32(dtype)


def test_fp32_is_refused(device):
    q = torch.randn(1, 2, 8, 64, device=device)
    with pytest.raises(tf.BackendError, match="float16/bfloat16"):
        F.scaled_dot_product_attention(q, q, q, backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 80, 128, 192, 256])
@pytest.mark.parametrize("kind", ["none", "causal", "causal+float_bh+kpm", "dead"])
def test_large_shapes(device, dtype, d, kind):
    b, h, lq, lk = 2, 4, 300, 517
    g = generator()
    q, k, v = base._qkv(b, h, h, lq, lk, d, dtype, device, g)
    m = base._to(make_masks(kind, b, h, lq, lk, dtype, g), device)
    check_sdpa("cuda", q, k, v, context=f"{kind} d={d}", **m)
