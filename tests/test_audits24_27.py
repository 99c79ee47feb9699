"""From the twenty-fourth to twenty-seventh outside audits (PyTorch's own module tests run
against ours, the suite on the GPU machines' torch 2.11 / Python 3.12 / Triton 3.6, mutation
testing of the Triton backward / reference / decoding, mutation testing of the CUDA kernels
through the CPU emulation; 2026-11-30, twelfth session):

- MultiheadAttention with an in_proj_bias of another dtype than its weights (torch's test
  test_multihead_attn_fast_path_query_and_bias_have_different_dtypes): torch's in-projection of
  a batched, non-contiguous query runs matmul then add_, promoting the bias; ours refused it in
  addmm.
"""
from __future__ import annotations

import pytest
import torch

import transformer_fast as tf


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim"])
@pytest.mark.parametrize("training", [False, True])
def test_mha_in_proj_bias_of_another_dtype(bias_dtype, kind, training):
    kw = dict(kdim=6, vdim=5) if kind == "kdim" else {}
    ref = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.double, **kw)
    ours = tf.MultiheadAttention(4, 2, batch_first=True, dtype=torch.double, **kw)
    ours.load_state_dict(ref.state_dict())
    bias = torch.randn(12, dtype=torch.double).to(bias_dtype)
    for m in (ref, ours):
        m.in_proj_bias = torch.nn.Parameter(bias.clone())
        m.train(training)
    q = torch.randn(3, 4, 4, dtype=torch.double)
    k = q if kind == "self" else torch.randn(3, 5, kw.get("kdim", 4), dtype=torch.double)
    v = q if kind == "self" else (k if kind == "cross" else torch.randn(3, 5, 5, dtype=torch.double))
    with torch.set_grad_enabled(training):
        want, want_w = ref(q, k, v)
        got, got_w = ours(q, k, v)
    assert got.dtype == want.dtype == torch.double
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)
    if training:
        want.sum().backward()
        got.sum().backward()
        assert ours.in_proj_bias.grad.dtype == bias_dtype
        torch.testing.assert_close(ours.in_proj_bias.grad, ref.in_proj_bias.grad)
