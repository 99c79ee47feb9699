"""torch.func transforms and forward-mode AD over the functional ops and the modules (an outside
audit, 2026-11-29, second session): vjp and jacrev gave zero gradients on the fused backends,
forward-mode AD dropped the tangent, vmap of grad failed inside.  Under any of them the calls
now go to torch's ops (auto), and an explicit fused backend says it cannot run them."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import transformer_fast as tf
from transformer_fast import backends
from transformer_fast import functional as F
from transformer_fast import reference

torch.manual_seed(0)
_X, _R = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
_W, _B = torch.randn(24, 16, dtype=torch.float64) / 4, torch.randn(24, dtype=torch.float64)
_W2, _B2 = torch.randn(16, 24, dtype=torch.float64) / 5, torch.randn(16, dtype=torch.float64)
_Q = torch.randn(1, 2, 5, 8, dtype=torch.float64)

# op -> (ours(x, backend) in x's dtype, the float64 reference composition(x), x)
OPS = {
    "add_layer_norm": (lambda x, be: F.add_layer_norm(x, _R[: x.shape[0]].to(x.dtype), None, None, backend=be),
                       lambda x: torch.nn.functional.layer_norm(x + _R[: x.shape[0]], (16,)), _X),
    "linear_bias_act": (lambda x, be: F.linear_bias_act(x, _W.to(x.dtype), _B.to(x.dtype), activation="gelu",
                                                        backend=be),
                        lambda x: torch.nn.functional.gelu(torch.nn.functional.linear(x, _W, _B)), _X),
    "feed_forward": (lambda x, be: F.feed_forward(x, *(t.to(x.dtype) for t in (_W, _B, _W2, _B2)),
                                                  activation="relu", backend=be),
                     lambda x: reference.feed_forward(x, _W, _B, _W2, _B2, "relu", 0.0), _X),
    "masked_softmax": (lambda x, be: F.masked_softmax(x, None, is_causal=True, backend=be),
                       lambda x: reference.masked_softmax(x, None, 1.0, True, 0.0),
                       torch.randn(2, 5, 5, dtype=torch.float64)),
    "scaled_dot_product_attention": (
        lambda x, be: F.scaled_dot_product_attention(x, _Q.to(x.dtype), _Q.to(x.dtype), backend=be),
        lambda x: reference.scaled_dot_product_attention(x, _Q, _Q), _Q),
}


def _float32(op):
    """The op in float32 (the C++ kernels take float32 and 16-bit) against the float64
    composition."""
    ours, ref, x = OPS[op]
    return ours, ref, x.float()


@pytest.mark.parametrize("op", list(OPS))
def test_vjp_and_jacrev_under_auto(op):
    ours, ref, x = _float32(op)
    out, vjp = torch.func.vjp(lambda a: ours(a, None), x)
    cotangent = torch.randn_like(out)
    _, ref_vjp = torch.func.vjp(ref, x.double())
    torch.testing.assert_close(vjp(cotangent)[0].double(), ref_vjp(cotangent.double())[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.func.jacrev(lambda a: ours(a, None))(x).double(),
                               torch.func.jacrev(ref)(x.double()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", [op for op in OPS if op != "scaled_dot_product_attention"])
def test_forward_mode_under_auto(op):
    """(SDPA: torch's own CPU kernel has no forward-mode formula either; it raises.)"""
    ours, ref, x = _float32(op)
    tangent = torch.randn_like(x)
    _, want = torch.func.jvp(ref, (x.double(),), (tangent.double(),))
    _, got = torch.func.jvp(lambda a: ours(a, None), (x,), (tangent,))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(ours(fwAD.make_dual(x, tangent), None)).tangent
    assert got is not None
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["add_layer_norm", "linear_bias_act", "feed_forward"])
def test_per_sample_gradients_under_auto(op):
    ours, ref, x = _float32(op)
    got = torch.func.vmap(torch.func.grad(lambda a: ours(a[None], None).square().sum()))(x)
    want = torch.func.vmap(torch.func.grad(lambda a: ref(a[None]).square().sum()))(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_an_explicit_fused_backend_says_it_cannot_run_under_a_transform(backend):
    ok, why = backends.available(backend, "cpu")
    if not ok:
        pytest.skip(why)
    ours, _, x = _float32("add_layer_norm")
    with pytest.raises(backends.BackendError, match="differentiating transforms or forward-mode AD"):
        torch.func.vjp(lambda a: ours(a, backend), x)
    with fwAD.dual_level(), pytest.raises(backends.BackendError, match="forward-mode AD"):
        ours(fwAD.make_dual(x, torch.ones_like(x)), backend)
    ours(x, backend)  # outside them it runs


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_vjp_through_a_layer_as_torchs(mode):
    """torch.func.vjp over functional_call of our encoder layer gave zero parameter gradients."""
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).train(mode == "train")
    ours = copy.deepcopy(ref)
    tf.swap(ours)
    x = torch.randn(2, 5, 16)
    for model in (ours, ours):  # the second call replays (modules/_lane.py)
        params = {k: v.detach() for k, v in model.named_parameters()}
        out, vjp = torch.func.vjp(lambda p: torch.func.functional_call(model, p, (x,)), params)
        grads = vjp(torch.ones_like(out))[0]
        ref_params = {k: v.detach() for k, v in ref.named_parameters()}
        ref_out, ref_vjp = torch.func.vjp(lambda p: torch.func.functional_call(ref, p, (x,)), ref_params)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        for name, g in ref_vjp(torch.ones_like(ref_out))[0].items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)
