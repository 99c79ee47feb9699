"""The cuda backend of masked_softmax (csrc/masked_softmax_cuda.cu: warp-per-row and block-per-row
kernels) on CUDA tensors against the float64 oracle: the checks of tests/test_masked_softmax_cxx.py
with BACKEND = "cuda", plus larger shapes over every kernel (register buckets 4..32 per lane, the
block kernel up to 65536+), the current stream, another device index, and the fp32 / fp16 / bf16
masks.  Marked gpu: skipped without CUDA."""
import pytest
import torch

import test_masked_softmax_cxx as base
from test_masked_softmax_cxx import (  # noqa: F401  (the shared checks, collected again here)
    test_causal_rectangular,
    test_deterministic,
    test_dropout_exact_mask,
    test_dropout_p_one_and_tiny,
    test_dropout_statistics,
    test_empty,
    test_every_row_dead,
    test_expanded_dout_and_strided_probs,
    test_fully_masked_rows,
    test_last_dim_not_unit_stride,
    test_lk_one,
    test_mask_kinds,
    test_mixed_dtype_backward,
    test_nan_and_inf_propagate_like_reference,
    test_op_argument_errors,
    test_opcheck,
    test_other_ranks,
    test_registered_and_selected,
    test_scale,
    test_sizes,
    test_very_long_rows,
    test_grid_slow,
)
from _functional_helpers import DTYPES, bool_mask, dt_id, generator, randn
from conftest import require_backend

from transformer_fast import functional as F
from transformer_fast import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_backend(monkeypatch):
    monkeypatch.setattr(base, "BACKEND", "cuda")


@pytest.fixture
def device():
    return require_backend("cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", [1, 31, 33, 128, 129, 257, 513, 1024, 1025, 4096, 16385, 65536])
def test_every_kernel_bucket(device, lk, dtype):
    """Row lengths at every register-bucket edge of the warp kernels and the block kernel, many
    rows (several CTAs), causal + a bool (B, 1, Lq, Lk) mask + dropout, and plain."""
    B, H, Lq = (2, 4, 33) if lk <= 4096 else (1, 2, 3)
    g = generator()
    scores = randn(B, H, Lq, lk, dtype=dtype, g=g, scale=2.0).to(device)
    mask = bool_mask((B, 1, Lq, lk), g).to(device)
    base._oracle(scores, mask, scale=0.3, causal=True, p=0.2, rng=base._rng(device), layout="padded",
                 launchers=base._cxx_launchers())
    base._oracle(scores, launchers=base._cxx_launchers())
    base._oracle(scores, mask, causal=True)  # functional


def test_runs_on_the_current_stream(device):
    """The kernels are queued on the current stream (no implicit synchronisation with others)."""
    scores = torch.randn(4, 8, 64, 300, device=device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = F.masked_softmax(scores, is_causal=True, backend="cuda")
    stream.synchronize()
    ref = reference.masked_softmax(scores.double(), None, 1.0, True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)


def test_second_device(device):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    scores = torch.randn(2, 2, 5, 40, device="cuda:1")
    out = F.masked_softmax(scores, backend="cuda")
    assert out.device == scores.device
    torch.testing.assert_close(out, torch.softmax(scores, -1), atol=1e-6, rtol=0)
