"""Double backward (create_graph=True) through the fused ops, as through torch.nn: gradient
penalties and Hessian-vector products.  The kernels' backward passes are not differentiable, so
under create_graph each op's backward recomputes its reference formula in differentiable torch
ops (fp32) on the saved inputs (transformer_fast/ops/__init__.py, recomputed_grads).  Checked:
second derivatives against the float64 reference, the recorded first derivatives against the
kernels' own (the same dropout mask), and a gradient penalty through the modules against
torch.nn."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as F
from transformer_fast import philox
from conftest import backend_params, require_backend
from _functional_helpers import generator

BACKENDS = backend_params("cpu", "triton", "cuda")


def _ops(g, device):
    """name -> (inputs, call(inputs, backend, dropout_p)); small fp32 problems with odd sizes."""
    def t(*shape):
        return torch.randn(*shape, generator=g).to(device)

    ln = {"x": t(3, 7, 24), "residual": t(3, 7, 24), "weight": 1 + 0.3 * t(24), "bias": t(24)}
    sdpa = {"query": t(2, 4, 9, 16), "key": t(2, 2, 11, 16), "value": t(2, 2, 11, 16)}
    pad = torch.zeros(2, 11, dtype=torch.bool, device=device)
    pad[1, 8:] = True
    ff = {"x": t(5, 3, 12), "w1": 0.3 * t(20, 12), "b1": t(20), "w2": 0.3 * t(12, 20), "b2": t(12)}
    lba = {"x": t(5, 12), "w": 0.3 * t(20, 12), "b": t(20)}
    sm = {"scores": t(2, 3, 6, 9)}
    sm_mask = torch.rand(6, 9, generator=g).to(device) < 0.7
    return {
        "add_layer_norm": (ln, lambda i, be, p: F.add_layer_norm(
            i["x"], i["residual"], i["weight"], i["bias"], dropout_p=p, prenorm=True, backend=be)),
        "sdpa": (sdpa, lambda i, be, p: F.scaled_dot_product_attention(
            i["query"], i["key"], i["value"], dropout_p=p, is_causal=True, enable_gqa=True,
            key_padding_mask=pad, backend=be)),
        "feed_forward": (ff, lambda i, be, p: F.feed_forward(
            i["x"], i["w1"], i["b1"], i["w2"], i["b2"], activation="gelu", dropout_p=p, backend=be)),
        "linear_bias_act": (lba, lambda i, be, p: F.linear_bias_act(
            i["x"], i["w"], i["b"], activation="gelu_tanh", dropout_p=p, backend=be)),
        "masked_softmax": (sm, lambda i, be, p: F.masked_softmax(
            i["scores"], sm_mask, scale=0.7, is_causal=True, dropout_p=p, backend=be)),
    }


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _second_order(call, inputs, backend, g, dtype):
    """Gradient of <d<out, u>/d inputs, v> with respect to the inputs (a Hessian-vector product)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
    outs = _outputs(call(leaves, backend, 0.0))
    ups = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o) for o in outs]
    first = torch.autograd.grad(outs, list(leaves.values()), ups, create_graph=True)
    vs = [torch.randn(f.shape, generator=g, dtype=torch.float64).to(f) for f in first]
    total = sum((f * v).sum() for f, v in zip(first, vs))
    second = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return [torch.zeros_like(x) if s is None else s for s, x in zip(second, leaves.values())]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["add_layer_norm", "sdpa", "feed_forward", "linear_bias_act",
                                "masked_softmax"])
def test_second_derivatives_match_reference(backend, op):
    device = require_backend(backend)
    inputs, call = _ops(generator(), device)[op]
    seed = int(torch.randint(0, 2**31, ()))
    got = _second_order(call, inputs, backend, torch.Generator().manual_seed(seed), torch.float32)
    want = _second_order(call, inputs, "reference", torch.Generator().manual_seed(seed), torch.float64)
    for name, a, b in zip(inputs, got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=f"{op} d2/d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["add_layer_norm", "sdpa", "feed_forward", "linear_bias_act",
                                "masked_softmax"])
def test_recorded_first_derivatives_match_kernels_with_dropout(backend, op):
    """create_graph=True recomputes the backward with the kernels' own dropout mask (philox):
    its first derivatives equal the kernels' (up to fp32 rounding)."""
    device = require_backend(backend)
    inputs, call = _ops(generator(), device)[op]
    seed = int(torch.randint(0, 2**31, ()))
    grads = {}
    for create_graph in (False, True):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        torch.manual_seed(seed)  # the same philox seed / offset for both runs
        outs = _outputs(call(leaves, backend, 0.3))
        ups = [torch.ones_like(o) for o in outs]
        grads[create_graph] = torch.autograd.grad(outs, list(leaves.values()), ups, create_graph=create_graph)
    for name, a, b in zip(inputs, grads[True], grads[False]):
        torch.testing.assert_close(a.detach(), b, rtol=1e-4, atol=1e-5, msg=f"{op} d/d{name}")


def test_keep_mask_is_the_kernels():
    """The recorded path draws its mask with philox.dropout_keep_mask: the mask the kernels use
    (a dropped element of the cpu kernel's output is exactly 0 where the mask says dropped)."""
    require_backend("cpu")
    x = torch.randn(4, 64)
    torch.manual_seed(3)
    rng = philox.new_rng("cpu")
    y = tf.ops.ffn.linear_bias_act(x, torch.eye(64), None, "none", 0.5, rng, False, "cpu")
    keep = philox.dropout_keep_mask(rng, (4, 64), 0.5)
    assert torch.equal(y == 0, ~keep)


@pytest.mark.parametrize("norm_first", [False, True])
def test_gradient_penalty_through_encoder_layer_matches_torch(norm_first):
    """A gradient penalty (d loss / d input, squared, backpropagated) through our layer on the
    fused cpu ops gives torch.nn's parameter gradients (torch's own CPU flash SDPA has no double
    backward, so its layer runs the math SDPA here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    require_backend("cpu")
    torch.manual_seed(0)
    ours = tf.TransformerEncoderLayer(64, 4, 96, dropout=0.0, batch_first=True, norm_first=norm_first,
                                      activation="gelu")
    theirs = torch.nn.TransformerEncoderLayer(64, 4, 96, dropout=0.0, batch_first=True,
                                              norm_first=norm_first, activation="gelu")
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 64, generator=generator())
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True

    def penalty_grads(module):
        xi = x.clone().requires_grad_()
        with tf.use_backend("cpu") if module is ours else sdpa_kernel(SDPBackend.MATH):
            out = module(xi, src_key_padding_mask=pad)
        (dx,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        dx.square().sum().backward()
        return {n: p.grad for n, p in module.named_parameters()}

    got, want = penalty_grads(ours), penalty_grads(theirs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_computed_from_another_input(backend):
    """A pre-LN residual add: the sublayer output x is a function of the residual r.  The
    recorded backward differentiates with respect to each input alone (d/dr of the op, not of
    everything upstream of x too), so the first and second derivatives match the reference."""
    device = require_backend(backend)
    g = generator()
    r0 = torch.randn(3, 5, 32, generator=g, dtype=torch.float64).to(device)
    w = (1 + 0.3 * torch.randn(32, generator=g, dtype=torch.float64)).to(device)

    def grads(be, dtype):
        r = r0.to(dtype).requires_grad_()
        x = torch.tanh(r) * 1.5
        y, h = F.add_layer_norm(x, r, w.to(dtype), None, prenorm=True, backend=be)
        (dr,) = torch.autograd.grad((y * y).sum() + (h * y).sum(), r, create_graph=True)
        (d2r,) = torch.autograd.grad((dr * dr).sum(), r)
        return dr.detach().double(), d2r.double()

    for got, want in zip(grads(backend, torch.float32), grads("reference", torch.float64)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
