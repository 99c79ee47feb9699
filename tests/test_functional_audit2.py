"""The second outside audit of the functional ops (2026-11-29): shapes torch's SDPA takes that
ours refused, a scale tensor that needs a gradient, NestedTensor inputs under backend="auto"."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from transformer_fast import functional as F

BACKENDS = ["reference", "torch", "cpu", "auto"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_shape, kv_shape", [
    ((2, 4, 5, 16), (7, 16)), ((5, 16), (2, 4, 7, 16)), ((5, 16), (3, 7, 16)), ((3, 5, 16), (7, 16)),
])
def test_a_2d_operand_broadcasts_over_the_others_batch_dims(backend, q_shape, kv_shape):
    torch.manual_seed(0)
    q = torch.randn(q_shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    if backend == "cpu":  # the C++ kernels take float32 / 16-bit
        q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = TF.scaled_dot_product_attention(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.shape == expected.shape
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected, **tol)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_shape", [(1, 1, 5, 7), (1, 2, 5, 7), (1, 2, 1, 7)])
def test_3d_inputs_take_a_4d_mask_with_a_leading_1(backend, mask_shape):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    mask = torch.rand(mask_shape) > 0.3
    # torch 2.14 broadcasts the 3-D call as this 4-D one; torch 2.11 refuses it ("output with
    # shape [2, 5, 7] doesn't match the broadcast shape"): ours takes it as 2.14 does.
    expected = TF.scaled_dot_product_attention(q[None], k[None], v[None], mask)[0]
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, mask, backend=backend), expected,
                               rtol=1e-5, atol=1e-5)


def test_4d_inputs_refuse_a_5d_mask_as_torch():
    q = torch.randn(2, 2, 5, 16)
    mask = torch.rand(1, 2, 2, 5, 5) > 0.3
    with pytest.raises(RuntimeError):
        TF.scaled_dot_product_attention(q, q, q, mask)
    with pytest.raises(ValueError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, mask)


def test_a_scale_tensor_that_needs_grad_is_refused():
    """float() of it would detach it: a learned temperature would silently get no gradient."""
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(TypeError, match="scale"):
        F.scaled_dot_product_attention(q, q, q, scale=torch.tensor(0.25, requires_grad=True))
    with pytest.raises(TypeError, match="scale"):
        F.masked_softmax(torch.randn(3, 5), scale=torch.tensor(2.0, requires_grad=True))
    plain = F.scaled_dot_product_attention(q, q, q, scale=torch.tensor(0.25))
    torch.testing.assert_close(plain, F.scaled_dot_product_attention(q, q, q, scale=0.25))


def test_nested_tensors_fall_through_to_torch_under_auto():
    torch.manual_seed(0)
    nt = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    out = F.feed_forward(nt, w1, b1, w2, b2)
    expected = TF.linear(TF.relu(TF.linear(nt, w1, b1)), w2, b2)
    for a, b in zip(out.unbind(), expected.unbind()):
        torch.testing.assert_close(a, b)
    normed = F.add_layer_norm(nt, nt, torch.ones(8), torch.zeros(8))
    assert normed.is_nested
    with pytest.raises(Exception, match="strided"):
        F.feed_forward(nt, w1, b1, w2, b2, backend="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_casts_as_torch_does(backend):
    """Under autocast torch runs SDPA and linear in the autocast dtype, casting their inputs:
    every backend now gets the same cast (the fused kernels computed in float32 before, and a
    bf16 query with float32 keys was refused)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    x, w1, b1, w2, b2 = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = TF.scaled_dot_product_attention(q.bfloat16(), k, v)
        out = F.scaled_dot_product_attention(q.bfloat16(), k, v, backend=backend)
        assert out.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        ffn = F.feed_forward(x, w1, b1, w2, b2, backend=backend)
        hidden = F.linear_bias_act(x, w1, b1, activation="relu", backend=backend)
        assert ffn.dtype == hidden.dtype == TF.linear(x, w1, b1).dtype == torch.bfloat16
        torch.testing.assert_close(hidden, TF.relu(TF.linear(x, w1, b1)), rtol=2e-2, atol=5e-2)
    # float64 is left alone, as torch's autocast leaves it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(q.double(), k.double(), v.double(), backend="reference").dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_p_false_is_zero_as_in_torch(backend):
    """torch takes a bool dropout_p (``dropout_p=self.training and p`` is False in eval); it
    was refused as a TypeError.  True is p = 1, refused as any p = 1 is."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 5, 16)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, dropout_p=False, backend=backend),
                               TF.scaled_dot_product_attention(q, q, q, dropout_p=False))
    x, w = torch.randn(3, 16), torch.ones(16)
    torch.testing.assert_close(F.add_layer_norm(x, x, w, None, dropout_p=False, backend=backend),
                               TF.layer_norm(x + x, (16,), w))
    with pytest.raises(ValueError, match="dropout_p"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=True, backend=backend)
