"""transformer_fast.ops.call: an eager call with nothing to differentiate runs the custom op's
implementation directly (no custom-op dispatch); anything else goes through the op."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from transformer_fast import functional as F
from transformer_fast.ops import decode, layer_norm

from conftest import require_backend


def _ln_inputs(requires_grad=False):
    x, r = torch.randn(5, 24), torch.randn(5, 24)
    w, b = torch.rand(24) + 0.5, torch.randn(24)
    return [t.requires_grad_(requires_grad) for t in (x, r, w, b)]


def _refuse(*args, **kwargs):
    raise AssertionError("the custom op was dispatched")


def test_eager_calls_skip_the_custom_op(monkeypatch):
    require_backend("cpu")
    x, r, w, b = _ln_inputs()
    expected = F.add_layer_norm(x, r, w, b, backend="cpu")
    monkeypatch.setattr(layer_norm, "add_layer_norm_fwd", _refuse)
    monkeypatch.setattr(layer_norm, "add_layer_norm_bwd", _refuse)
    assert torch.equal(F.add_layer_norm(x, r, w, b, backend="cpu"), expected)  # nothing needs grad
    xg, rg, wg, bg = _ln_inputs(requires_grad=True)
    with torch.no_grad():
        F.add_layer_norm(xg, rg, wg, bg, backend="cpu")
    with torch.inference_mode():
        F.add_layer_norm(x, r, w, b, backend="cpu")
    y = F.add_layer_norm(xg, rg, wg, bg, backend="cpu")  # the op's formula in an autograd.Function
    torch.autograd.grad(y.sum(), [xg, rg, wg, bg])
    with _Recorder(), pytest.raises(AssertionError, match="dispatched"):  # a mode gets the op
        F.add_layer_norm(x, r, w, b, backend="cpu")


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _leaves(*shapes):
    return [torch.randn(*s).requires_grad_() for s in shapes]


def _cases():
    """(name, fn(*leaves) -> output, leaf shapes) for each fused op on the cpu backend."""
    pad = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    return [
        ("add_layer_norm prenorm", lambda x, r, w, b: torch.cat(
            F.add_layer_norm(x, r, w, b, dropout_p=0.3, prenorm=True, backend="cpu"), -1),
         [(2, 7, 24), (2, 7, 24), (24,), (24,)]),
        ("scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.2, key_padding_mask=pad, backend="cpu"),
         [(2, 3, 7, 16), (2, 3, 7, 16), (2, 3, 7, 16)]),
        ("feed_forward", lambda x, w1, b1, w2, b2: F.feed_forward(
            x, w1, b1, w2, b2, activation="gelu", dropout_p=0.25, backend="cpu"),
         [(2, 7, 24), (40, 24), (40,), (24, 40), (24,)]),
        ("linear_bias_act", lambda x, w, b: F.linear_bias_act(
            x, w, b, activation="relu", dropout_p=0.25, backend="cpu"),
         [(9, 24), (40, 24), (40,)]),
        ("masked_softmax", lambda s: F.masked_softmax(
            s, pad[:, None, None, :], scale=0.5, dropout_p=0.2, backend="cpu"),
         [(2, 3, 7, 7)]),
    ]


@pytest.mark.parametrize("case", _cases(), ids=[c[0] for c in _cases()])
def test_eager_and_dispatched_calls_agree_bitwise(case):
    """Forward and every gradient, with dropout (the same rng draw): the eager path (direct
    implementation, autograd.Function) against the custom op (forced by a dispatch mode)."""
    require_backend("cpu")
    _, fn, shapes = case
    leaves = _leaves(*shapes)

    def run(mode):
        torch.manual_seed(11)
        with mode:
            out = fn(*leaves)
            upstream = torch.ones_like(out).mul_(0.5).add_(torch.arange(out.shape[-1]) / 10)
            return [out.detach()] + list(torch.autograd.grad(out, leaves, upstream))

    import contextlib

    eager, dispatched = run(contextlib.nullcontext()), run(_PassThrough())
    for a, c in zip(eager, dispatched):
        assert torch.equal(a, c)
    with torch.no_grad():  # the no-grad path too
        torch.manual_seed(11)
        assert torch.equal(fn(*leaves), eager[0])


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_the_custom_op():
    """Op counters, FakeTensorMode and tracers run under a dispatch mode: they get the op."""
    require_backend("cpu")
    x, r, w, b = _ln_inputs()
    with _Recorder() as rec:
        F.add_layer_norm(x, r, w, b, backend="cpu")
    assert any("transformer_fast.add_layer_norm_fwd" in name for name in rec.ops), rec.ops


def test_direct_kv_cache_call_bumps_the_caches_versions(monkeypatch):
    require_backend("cpu")
    q = torch.randn(2, 2, 1, 16)
    k_cache, v_cache = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    seqlens = torch.tensor([0, 3], dtype=torch.int32)
    before = (k_cache._version, v_cache._version)
    monkeypatch.setattr(decode, "attention_with_kv_cache_op", _refuse)
    F.attention_with_kv_cache(q, k_cache, v_cache, seqlens, q.clone(), q.clone(), backend="cpu")
    assert k_cache._version > before[0] and v_cache._version > before[1]
    assert torch.equal(k_cache[0, :, 0], q[0, :, 0]) and torch.equal(k_cache[1, :, 3], q[1, :, 0])


@pytest.mark.parametrize("route", ["eager", "dispatched"])
def test_outputs_can_be_modified_in_place_like_torch_ops(route):
    """Outputs that are not saved for backward may be changed in place, as torch's own
    F.layer_norm / linear outputs (e.g. a layer's output followed by ``out += x``); the kernels'
    outputs are views of their 2-D results, which a multi-output autograd node would forbid."""
    require_backend("cpu")
    import contextlib

    import transformer_fast as tf

    x, r = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16, requires_grad=True)
    w1, w2 = torch.randn(32, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    layer = tf.nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
    cases = [
        (lambda: F.add_layer_norm(x, r, None, None, backend="cpu"), [x, r]),
        (lambda: F.add_layer_norm(x, r, None, None, prenorm=True, backend="cpu")[1], [x, r]),
        (lambda: F.feed_forward(x, w1, None, w2, None, activation="gelu", backend="cpu"), [x, w1, w2]),
        (lambda: layer(x), [x] + list(layer.parameters())),
    ]
    mode = contextlib.nullcontext() if route == "eager" else _PassThrough()
    for fn, leaves in cases:
        with mode:
            expected = torch.autograd.grad(fn().sum() * 2, leaves)
            out = fn()
            out.mul_(2)
            got = torch.autograd.grad(out.sum(), leaves)
        for a, c in zip(got, expected):
            torch.testing.assert_close(a, c)


class _CountFills(TorchDispatchMode):
    """Counts the tensors autograd (or anything) fills with a constant: the zero gradients it
    makes for outputs that took no part in the loss, when a backward asks for them."""

    FILLS = {"zeros", "zeros_like", "fill_", "zero_", "new_zeros", "full", "full_like"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.FILLS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("prenorm, use", [(False, "y"), (True, "y"), (True, "h"), (True, "both")])
def test_backward_makes_no_zero_gradients_for_unused_outputs(prenorm, use):
    """The fused ops' extra outputs (add_layer_norm's mean / rstd / post-LN placeholder,
    attention's lse) never get a gradient: autograd must not make zero tensors for them (on a
    GPU a memset kernel each, per layer and step).  An unused prenorm output still works."""
    require_backend("cpu")
    backend = "cpu"
    x, r, w, b = _ln_inputs(requires_grad=True)
    out = F.add_layer_norm(x, r, w, b, prenorm=prenorm, backend=backend)
    y, h = out if prenorm else (out, None)
    loss = {"y": y.sum(), "h": h.sum() if h is not None else None,
            "both": y.sum() + (h * 2).sum() if h is not None else None}[use]
    with _CountFills() as mode:
        grads = torch.autograd.grad(loss, [x, r, w, b], allow_unused=True)
    assert mode.count == (1 if use == "h" else 0)  # "h" alone: dy is made once, as zeros
    with torch.enable_grad():
        xr, rr, wr, br = (t.detach().double().requires_grad_() for t in (x, r, w, b))
        yr = torch.nn.functional.layer_norm(xr + rr, (24,), wr, br, 1e-5)
        hr = xr + rr
        ref_loss = {"y": yr.sum(), "h": hr.sum(), "both": yr.sum() + (hr * 2).sum()}[use]
        expected = torch.autograd.grad(ref_loss, [xr, rr, wr, br], allow_unused=True)
    for got, want in zip(grads, expected):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    q = torch.randn(2, 3, 5, 16, requires_grad=True)
    o = F.scaled_dot_product_attention(q, q, q, backend=backend)
    with _CountFills() as mode:
        torch.autograd.grad(o.sum(), q)
    assert mode.count == 0


@pytest.mark.parametrize("inputs", ["self", "cross", "separate"])
def test_mha_in_projection_backward_fills_nothing(inputs):
    """MultiheadAttention's packed in_proj_weight / in_proj_bias gradients come out of one
    concatenation: no zero-filled full-size buffer (a slice's backward, or chunk's for the unused
    k / v thirds) added to another, per layer and step.  Encoder-decoder attention (key is value)
    was the case that did; the gradients still equal torch's module."""
    import transformer_fast.modules as M

    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ours = M.MultiheadAttention(16, 2, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x, mem, other = torch.randn(2, 3, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    q, k, v = {"self": (x, x, x), "cross": (x, mem, mem), "separate": (x, mem, other)}[inputs]
    params = [ours.in_proj_weight, ours.in_proj_bias]
    out = ours(q, k, v, need_weights=False)[0]
    with _CountFills() as mode:
        got = torch.autograd.grad(out.sum(), params)
    assert mode.count == 0
    want = torch.autograd.grad(theirs(q, k, v, need_weights=False)[0].sum(), [theirs.in_proj_weight, theirs.in_proj_bias])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
