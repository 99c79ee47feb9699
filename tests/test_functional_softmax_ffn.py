"""functional.masked_softmax and functional.feed_forward: reference and torch backends against
the float64 oracle, semantics, fully masked rows, dropout."""
import pytest
import torch
import torch.nn.functional as TF

from transformer_fast import functional as F
from transformer_fast import reference

from _functional_helpers import (
    BACKENDS,
    DTYPES,
    bool_mask,
    dt_id,
    float_mask,
    generator,
    oracle_atol,
    randn,
)

# --------------------------------------------------------------------------------------------
# masked_softmax

SOFTMAX_MASKS = ["none", "bool_2d", "bool_b1", "bool_full", "float_2d", "float_h", "float_full", "bool_row"]


def softmax_mask(kind, shape, dtype, g):
    batch, heads, lq, lk = shape
    form = kind.split("_")[1] if "_" in kind else None
    mshape = {
        None: None,
        "2d": (lq, lk),
        "b1": (batch, 1, lq, lk),
        "h": (heads, 1, lk),
        "full": shape,
        "row": (lk,),
    }[form]
    if mshape is None:
        return None
    return bool_mask(mshape, g, 0.7) if kind.startswith("bool") else float_mask(mshape, dtype, g)


def check_softmax(backend, scores, mask, scale, is_causal, context=""):
    def kernel(scores, mask=None):
        return F.masked_softmax(scores, mask, scale=scale, is_causal=is_causal, backend=backend)

    def ref(scores, mask=None):
        return reference.masked_softmax(scores, mask, scale, is_causal)

    inputs = {"scores": scores}
    if mask is not None:
        inputs["mask"] = mask
    results = reference.run_oracle(kernel, ref, inputs, ["scores"], atol=oracle_atol(backend, scores.dtype))
    reference.assert_oracle(results, f"{backend} masked_softmax {context}")


# Every mask form alone, and causal with a few of them.
SOFTMAX_CASES = [(kind, False) for kind in SOFTMAX_MASKS] + [
    (kind, True) for kind in ("none", "bool_b1", "float_full", "bool_row")
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 127), (127, 7), (5, 1000)])
@pytest.mark.parametrize("kind,is_causal", SOFTMAX_CASES, ids=lambda v: {True: "causal", False: "full"}.get(v, v) if isinstance(v, bool) else v)
def test_masked_softmax_oracle(backend, dtype, lq, lk, kind, is_causal):
    g = generator()
    shape = (2, 3, lq, lk)
    scores = randn(*shape, dtype=dtype, g=g, scale=3.0)
    mask = softmax_mask(kind, shape, dtype, g)
    check_softmax(backend, scores, mask, 0.37, is_causal, f"{kind} {shape}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(5,), (4, 9), (2, 3, 4, 5, 6)])
def test_masked_softmax_ranks(backend, shape):
    g = generator()
    scores = randn(*shape, g=g)
    mask = bool_mask(shape[-1:], g)
    check_softmax(backend, scores, mask, 1.0, False, f"rank {len(shape)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_softmax_semantics(backend):
    g = generator()
    scores = randn(2, 3, 5, 8, g=g)
    bias = randn(5, 8, g=g)
    allowed = bool_mask((2, 1, 5, 8), g)
    allowed[..., 0] = True
    # float mask added after scaling; bool True = takes part
    torch.testing.assert_close(
        F.masked_softmax(scores, bias, scale=0.5, backend=backend), torch.softmax(scores * 0.5 + bias, -1)
    )
    torch.testing.assert_close(
        F.masked_softmax(scores, allowed, backend=backend),
        torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1),
    )
    causal = torch.ones(5, 8, dtype=torch.bool).tril()  # top-left
    torch.testing.assert_close(
        F.masked_softmax(scores, is_causal=True, backend=backend),
        torch.softmax(scores.masked_fill(~causal, float("-inf")), -1),
    )
    # is_causal combines with a mask (AND)
    torch.testing.assert_close(
        F.masked_softmax(scores, allowed, is_causal=True, backend=backend),
        torch.softmax(scores.masked_fill(~(causal & allowed), float("-inf")), -1),
    )
    # attention weights of SDPA
    q, k = randn(2, 3, 5, 16, g=g), randn(2, 3, 8, 16, g=g)
    v = torch.eye(8).expand(2, 3, 8, 8)
    torch.testing.assert_close(
        F.masked_softmax(q @ k.transpose(-1, -2), allowed, scale=0.25, backend=backend),
        TF.scaled_dot_product_attention(q, k, v, allowed),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
def test_masked_softmax_fully_masked_rows(backend, dtype):
    g = generator()
    scores = randn(2, 4, 6, dtype=dtype, g=g).requires_grad_()
    mask = torch.ones(2, 4, 6, dtype=torch.bool)
    mask[0, 1] = False
    bias = torch.zeros(4, 6, dtype=dtype)
    bias[3] = float("-inf")
    for m in (mask, bias):
        scores.grad = None
        out = F.masked_softmax(scores, m, backend=backend)
        dead = ~(m if m.dtype == torch.bool else ~torch.isneginf(m)).any(-1).expand(2, 4)
        assert not out.isnan().any()
        assert (out[dead] == 0).all()
        torch.testing.assert_close(out[~dead].float().sum(-1), torch.ones((~dead).sum().item()), atol=1e-2, rtol=0)
        out.backward(torch.randn_like(out))
        assert torch.isfinite(scores.grad).all() and (scores.grad[dead] == 0).all()
    # -inf already in the scores: the same contract
    raw = torch.full((3, 4), float("-inf"), dtype=dtype)
    raw[0, 1] = 1.0
    out = F.masked_softmax(raw, backend=backend)
    assert out[0].tolist() == [0, 1, 0, 0] and (out[1:] == 0).all()


def _zero_fraction_and_mean(backend, p):
    torch.manual_seed(0)
    scores = torch.randn(64, 256)
    clean = F.masked_softmax(scores, backend=backend)
    dropped = F.masked_softmax(scores, dropout_p=p, backend=backend)
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], clean[kept] / (1 - p))
    return (~kept).float().mean().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_softmax_dropout_statistics(backend):
    assert abs(_zero_fraction_and_mean(backend, 0.2) - 0.2) < 0.01


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dt_id)
def test_masked_softmax_dropout_exact_keep_mask(backend, dtype):
    """Seeded, both backends drop what F.dropout draws over the scores' shape: the reference
    with that exact keep mask reproduces them (output and gradient, by the oracle)."""
    g = generator()
    p, seed = 0.3, int(torch.randint(0, 2**31, ()))
    scores = randn(3, 7, 11, dtype=dtype, g=g)
    mask = bool_mask((7, 11), g)
    torch.manual_seed(seed)
    keep = TF.dropout(torch.ones(3, 7, 11, dtype=dtype), p) != 0

    def kernel(scores):
        torch.manual_seed(seed)
        return F.masked_softmax(scores, mask, scale=0.5, is_causal=True, dropout_p=p, backend=backend)

    def ref(scores):
        return reference.masked_softmax(scores, mask, 0.5, True, p, keep=keep)

    results = reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"], atol=oracle_atol(backend, dtype))
    reference.assert_oracle(results, f"{backend} masked_softmax dropout")


# --------------------------------------------------------------------------------------------
# feed_forward

ACTIVATIONS = ["relu", "gelu", "gelu_tanh"]


def make_ffn(d_model, d_ff, dtype, bias1=True, bias2=True, g=None, d_out=None):
    g = g or generator()
    d_out = d_out or d_model
    w1 = randn(d_ff, d_model, dtype=dtype, g=g, scale=d_model**-0.5)
    b1 = randn(d_ff, dtype=dtype, g=g) if bias1 else None
    w2 = randn(d_out, d_ff, dtype=dtype, g=g, scale=d_ff**-0.5)
    b2 = randn(d_out, dtype=dtype, g=g) if bias2 else None
    return w1, b1, w2, b2


def check_ffn(backend, x, w1, b1, w2, b2, activation, x_view=None, context=""):
    view = x_view or (lambda t: t)

    def kernel(x, w1, w2, b1=None, b2=None):
        return F.feed_forward(view(x), w1, b1, w2, b2, activation=activation, backend=backend)

    def ref(x, w1, w2, b1=None, b2=None):
        return reference.feed_forward(view(x), w1, b1, w2, b2, activation)

    inputs = {"x": x, "w1": w1, "w2": w2}
    if b1 is not None:
        inputs["b1"] = b1
    if b2 is not None:
        inputs["b2"] = b2
    results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol(backend, x.dtype))
    reference.assert_oracle(results, f"{backend} feed_forward {activation} {context}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("biases", ["both", "none", "b1", "b2"])
def test_feed_forward_oracle(backend, dtype, activation, biases):
    g = generator()
    x = randn(3, 7, 64, dtype=dtype, g=g)
    params = make_ffn(64, 256, dtype, biases in ("both", "b1"), biases in ("both", "b2"), g)
    check_ffn(backend, x, *params, activation, context=biases)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,d_ff,d_out", [((1, 1), 1, 1), ((127, 7), 33, 5), ((2, 3, 5, 16), 48, 16), ((16,), 64, 16)])
def test_feed_forward_odd_shapes(backend, shape, d_ff, d_out):
    g = generator()
    x = randn(*shape, g=g)
    check_ffn(backend, x, *make_ffn(shape[-1], d_ff, torch.float32, g=g, d_out=d_out), "gelu", context=str(shape))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_feed_forward_non_contiguous_x(backend, activation):
    """x as a transposed, strided view (sequence-first activations read batch-first)."""
    g = generator()
    base = randn(9, 4, 96, g=g)
    params = make_ffn(48, 128, torch.float32, g=g)

    def view(t):
        v = t.transpose(0, 1)[:, :, ::2]
        assert not v.is_contiguous()
        return v

    check_ffn(backend, base, *params, activation, x_view=view, context="non-contiguous")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_feed_forward_matches_nn_modules(backend, activation):
    lin1, lin2 = torch.nn.Linear(32, 80), torch.nn.Linear(80, 32)
    act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU("tanh")}[activation]
    x = torch.randn(4, 6, 32)
    expected = lin2(act(lin1(x)))
    got = F.feed_forward(x, lin1.weight, lin1.bias, lin2.weight, lin2.bias, activation=activation, backend=backend)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_feed_forward_dropout_statistics(backend):
    """With w2 = identity and no biases the output is dropout(act(x W1^T)): ~p zeros, the rest
    scaled by 1/(1-p)."""
    torch.manual_seed(0)
    p = 0.4
    x = torch.randn(256, 64)
    w1 = torch.randn(64, 64) / 8
    w2 = torch.eye(64)
    clean = F.feed_forward(x, w1, None, w2, None, activation="gelu", backend=backend)
    dropped = F.feed_forward(x, w1, None, w2, None, activation="gelu", dropout_p=p, backend=backend)
    assert (clean != 0).all()
    kept = dropped != 0
    assert abs((~kept).float().mean().item() - p) < 0.01
    torch.testing.assert_close(dropped[kept], clean[kept] / (1 - p))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dt_id)
def test_feed_forward_dropout_exact_keep_mask(backend, dtype):
    g = generator()
    p, seed = 0.2, int(torch.randint(0, 2**31, ()))
    x = randn(5, 9, 32, dtype=dtype, g=g)
    w1, b1, w2, b2 = make_ffn(32, 96, dtype, g=g)
    torch.manual_seed(seed)
    keep = TF.dropout(torch.ones(5, 9, 96, dtype=dtype), p) != 0

    def kernel(x, w1, b1, w2, b2):
        torch.manual_seed(seed)
        return F.feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=p, backend=backend)

    def ref(x, w1, b1, w2, b2):
        return reference.feed_forward(x, w1, b1, w2, b2, "relu", p, keep=keep)

    inputs = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    results = reference.run_oracle(kernel, ref, inputs, list(inputs), atol=oracle_atol(backend, dtype))
    reference.assert_oracle(results, f"{backend} feed_forward dropout")


def test_masked_softmax_torch_fallback_without_safe_softmax(monkeypatch):
    """Older torch has no torch._safe_softmax: the fallback keeps the same contract."""
    monkeypatch.delattr(torch, "_safe_softmax", raising=False)
    scores = torch.randn(3, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out = F.masked_softmax(scores, mask, scale=0.5, backend="torch")
    expected = reference.masked_softmax(scores, mask, 0.5)
    torch.testing.assert_close(out, expected)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(scores.grad).all() and (scores.grad[1] == 0).all()
