"""From the eighteenth to twentieth outside audits (gradcheck and the cpu backend, mutation
testing of the suite, property fuzzing beyond test_fuzz.py; 2026-11-30, eleventh session):

- the cpu backend's bf16 linear_bias_act / feed_forward rounded the GEMM to bf16 before adding
  the bias (one bf16 ulp off torch's F.linear in ~30% of elements): 16-bit GEMMs add it inside;
- masked_softmax with 16-bit scores and a float32 mask took its gradient from the 16-bit
  probabilities where the reference's softmax (float32 with such a mask) keeps float32 ones:
  outside the oracle in 25-65% of draws at scale >= 4 on cpu and triton;
- add_layer_norm(prenorm=True) with only the residual sum used gave weight / bias zero gradients
  where torch leaves them None (an optimizer then decays / carries momentum on them);
- mutants no test caught: a layer's dropouts swapped (dropout1 for dropout2 in the pre-LN FFN
  residual), the torch backend's pre-LN sum without dropout, the double backward of
  add_layer_norm ignoring eps;
- run_oracle's kernel inputs were clones: a sliced (or expanded) input reached the kernel
  contiguous, so the fuzz's "sliced" layouts were never exercised.
"""
from __future__ import annotations

import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F, reference

from conftest import backend_params, require_backend

FUSED = backend_params("cpu", "triton", "cuda")
ALL = backend_params("reference", "torch", "cpu", "triton", "cuda")


def _gen():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("dims", [(1, 11, 77), (64, 64, 64), (100, 96, 40)], ids=str)
def test_cpu_bf16_linear_rounds_once_as_torch(activation, dims):
    require_backend("cpu")
    m, k, n = dims
    g = _gen()
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    ours = F.linear_bias_act(x, w, b, activation=activation, backend="cpu")
    theirs = torch.nn.functional.linear(x, w, b)
    theirs = theirs.relu() if activation else theirs
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("d_model, d_ff", [(160, 448), (30, 20)])
def test_cpu_bf16_feed_forward_relu_as_torch(d_model, d_ff):
    """Past 2^16 weight elements the bf16 FFN rounds as torch's chain does (each GEMM once, the
    bias inside); a small problem with small weights runs on fp32 copies and rounds out once
    (ops/ffn.py, _fp32_forward; benchmarks/NOTES.md, thirtieth session)."""
    require_backend("cpu")
    g = _gen()
    x = torch.randn(3, 7, d_model, generator=g).bfloat16()
    w1 = (torch.randn(d_ff, d_model, generator=g) / d_model**0.5).bfloat16()
    w2 = (torch.randn(d_model, d_ff, generator=g) / d_ff**0.5).bfloat16()
    b1, b2 = torch.randn(d_ff, generator=g).bfloat16(), torch.randn(d_model, generator=g).bfloat16()
    ours = F.feed_forward(x, w1, b1, w2, b2, activation="relu", backend="cpu")
    if w1.numel() + w2.numel() > 1 << 16:
        lin = torch.nn.functional.linear
        assert torch.equal(ours, lin(lin(x, w1, b1).relu(), w2, b2))
    else:
        wide = F.feed_forward(*(t.float() for t in (x, w1, b1, w2, b2)), activation="relu", backend="cpu")
        assert torch.equal(ours, wide.bfloat16())


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_masked_softmax_16bit_scores_float32_mask_gradient(backend, dtype):
    device = require_backend(backend)
    g = _gen()
    for draw in range(12):
        scores = torch.randn(2, 3, 16, 8, generator=g).to(device=device, dtype=dtype)
        mask = torch.randn(16, 8, generator=g).to(device)  # float32: softmax in float32

        def kernel(scores):
            return F.masked_softmax(scores, mask, scale=8.0, backend=backend)

        def ref(scores):
            m = mask.double() if scores.dtype == torch.float64 else mask
            return reference.masked_softmax(scores, m, 8.0)

        results = reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"],
                                       seed=int(torch.randint(0, 2**62, (), generator=g)))
        reference.assert_oracle(results, f"{backend} {dtype} draw {draw}")
    out = F.masked_softmax(scores.requires_grad_(), mask, scale=8.0, backend=backend)
    assert out.dtype == dtype


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_prenorm_sum_alone_leaves_weight_and_bias_grads_none(backend, dropout_p):
    device = require_backend(backend)
    x = torch.randn(4, 6, 32, device=device, requires_grad=True)
    r = torch.randn(4, 6, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    _, h = F.add_layer_norm(x, r, w, b, dropout_p=dropout_p, prenorm=True, backend=backend)
    h.sum().backward()
    assert w.grad is None and b.grad is None
    assert torch.equal(r.grad, torch.ones_like(r))
    if dropout_p == 0.0:
        assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("backend", ALL)
def test_prenorm_sum_carries_the_dropout(backend):
    device = require_backend(backend)
    x = torch.rand(8, 64, device=device) + 1.0
    res = torch.randn(8, 64, device=device)
    normed, summed = F.add_layer_norm(x, res, None, None, dropout_p=0.5, prenorm=True, backend=backend)
    kept = (summed - res).abs() > 1e-3
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close((summed - res)[kept], (x / 0.5)[kept])
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm(summed, (64,)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", backend_params("cpu", "triton", "cuda", "reference"))
def test_add_layer_norm_double_backward_honours_eps(backend):
    device = require_backend(backend)
    g = _gen()
    x0 = torch.randn(4, 8, generator=g).to(device)
    r = torch.randn(4, 8, generator=g).to(device)
    w = torch.arange(8.0, device=device)

    def grads(be):
        x = x0.clone().requires_grad_()
        y = F.add_layer_norm(x, r, None, None, eps=0.5, backend=be)
        (gx,) = torch.autograd.grad((y * w).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad((gx**2).sum(), x)
        return gx, ggx

    for ours, theirs in zip(grads(backend), grads("torch")):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


ENCODER_DROPOUTS = ["dropout", "dropout1", "dropout2", "self_attn.dropout"]
DECODER_DROPOUTS = ["dropout", "dropout1", "dropout2", "dropout3", "self_attn.dropout", "multihead_attn.dropout"]


def _set_p(layer, name, p):
    module = layer
    parts = name.split(".")
    for part in parts[:-1]:
        module = getattr(module, part)
    if isinstance(getattr(module, parts[-1]), float):  # MultiheadAttention.dropout is a float
        setattr(module, parts[-1], p)
    else:
        getattr(module, parts[-1]).p = p


@pytest.mark.parametrize("backend", backend_params("torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_each_dropout_of_a_layer_is_its_own(backend, norm_first, kind):
    """One of a layer's dropouts at p = 0.5, the others at 0, in training (p = 1 would leave the
    fused path: the ops take p < 1): each has an effect; and in pre-LN the last residual's
    dropout (dropout2 / dropout3) drops exactly the FFN branch: out - (the input to that residual
    add) is 0 or 2 * ffn elementwise, the pieces computed by torch's layer in eval."""
    device = require_backend(backend)
    torch.manual_seed(0)
    cls, names, last = ((tf.nn.TransformerEncoderLayer, ENCODER_DROPOUTS, "dropout2") if kind == "encoder"
                        else (tf.nn.TransformerDecoderLayer, DECODER_DROPOUTS, "dropout3"))
    tcls = getattr(torch.nn, cls.__name__)
    x, mem = torch.randn(2, 5, 64, device=device), torch.randn(2, 4, 64, device=device)
    args = (x,) if kind == "encoder" else (x, mem)
    for name in names:
        ours = cls(64, 4, 96, dropout=0.0, batch_first=True, norm_first=norm_first).to(device)
        _set_p(ours, name, 0.5)
        with tf.use_backend(backend):
            trained, evaluated = ours.train()(*args), ours.eval()(*args)
        assert not torch.allclose(trained, evaluated), f"{name} at p = 0.5 had no effect"
        if not norm_first or name != last:
            continue
        theirs = tcls(64, 4, 96, dropout=0.0, batch_first=True, norm_first=True).to(device).eval()
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            h = x + theirs._sa_block(theirs.norm1(x), None, None)
            if kind == "decoder":
                h = h + theirs._mha_block(theirs.norm2(h), mem, None, None)
            ffn = theirs._ff_block(theirs.norm3(h) if kind == "decoder" else theirs.norm2(h))
        branch = trained.detach() - h
        dropped = branch.abs() <= 1e-4 + 1e-4 * (2 * ffn).abs()
        assert 0 < dropped.float().mean() < 1
        torch.testing.assert_close(branch[~dropped], 2 * ffn[~dropped], atol=1e-4, rtol=1e-4)


def test_run_oracle_hands_the_kernel_the_callers_layout():
    seen = []

    def kernel(x):
        seen.append(x.stride())
        return (x * 2).sum(-1)

    def ref(x):
        return (x * 2).sum(-1)

    for t, strides in ((torch.randn(4, 7)[:, :4], (7, 1)), (torch.randn(4, 1).expand(4, 5), (1, 0)),
                       (torch.randn(3, 4).t(), (1, 4)), (torch.randn(9)[::2], (2,))):
        reference.assert_oracle(reference.run_oracle(kernel, ref, {"x": t}, ["x"], seed=1))
        assert seen[-1] == strides
