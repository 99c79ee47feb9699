"""Triton masked_softmax launchers (kernels/masked_softmax.py) against the DESIGN section 6 oracle.

Tested at the launcher level through a small autograd.Function (the op layer is tested elsewhere),
on CPU tensors through TRITON_INTERPRET=1 here, on the GPU when there is one.  Covers the fused
(register) and looped (split-row, online max/sum) paths, every mask kind and broadcast form,
causal, fully masked rows, non-contiguous inputs, scale, dropout (exact mask, statistics,
backward regeneration), determinism and the launcher's argument checks.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports transformer_fast.kernels
import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from transformer_fast import philox, reference  # noqa: E402
from transformer_fast.kernels import masked_softmax as K  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_dt = lambda d: str(d).replace("torch.", "")  # noqa: E731


# ---------------------------------------------------------------------------------------------
# Helpers


class _MaskedSoftmax(torch.autograd.Function):
    """Autograd over the two launchers, so reference.run_oracle can check gradients."""

    @staticmethod
    def forward(ctx, scores, mask, scale, is_causal, dropout_p, rng):
        out, probs = K.masked_softmax_fwd(scores, mask, scale, is_causal, dropout_p, rng)
        assert out.shape == scores.shape and out.dtype == scores.dtype and out.is_contiguous()
        if dropout_p > 0:
            assert probs.shape == scores.shape and probs.dtype == scores.dtype and probs.is_contiguous()
            saved = probs
        else:
            assert probs.shape == (0,)
            saved = out
        ctx.save_for_backward(saved, rng)
        ctx.scale, ctx.dropout_p = scale, dropout_p
        return out

    @staticmethod
    def backward(ctx, dout):
        probs, rng = ctx.saved_tensors
        ds = K.masked_softmax_bwd(dout, probs, ctx.scale, ctx.dropout_p, rng)
        assert ds.shape == dout.shape and ds.dtype == dout.dtype and ds.is_contiguous()
        return ds, None, None, None, None, None


def _gen(seed=None):
    seed = int(torch.randint(0, 2**31, ())) if seed is None else seed
    return torch.Generator().manual_seed(seed), seed


def _scores(shape, dtype, g, mult=2.0):
    return (torch.randn(*shape, generator=g) * mult).to(dtype).to(DEVICE)


def _bool_mask(shape, g, p_keep=0.7):
    return (torch.rand(*shape, generator=g) < p_keep).to(DEVICE)


def _float_mask(shape, g, dtype, p_inf=0.3):
    vals = torch.randn(*shape, generator=g)
    vals = torch.where(torch.rand(*shape, generator=g) < p_inf, torch.full_like(vals, float("-inf")), vals)
    return vals.to(dtype).to(DEVICE)


def _noncontig(t, pad=3):
    """Same values as ``t`` (B, H, Lq, Lk), stored (B, Lq, H, Lk + pad): unit last stride, rows
    padded with NaN, heads interleaved.  Differentiable."""
    wide = torch.nn.functional.pad(t.transpose(1, 2), (0, pad), value=float("nan"))
    view = wide[..., : t.shape[-1]].transpose(1, 2)
    assert view.stride(-1) == 1 and not view.is_contiguous()
    return view


def _oracle(scores, mask=None, *, scale=1.0, causal=False, p=0.0, rng_values=(1234567, 89),
            noncontig=False, context=""):
    B, H, Lq, Lk = scores.shape
    rng = torch.tensor(rng_values, dtype=torch.int64, device=DEVICE) if p > 0 else None
    keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p) if p > 0 else None
    expanded = mask.expand(B, H, Lq, Lk) if mask is not None else None

    def kernel(scores):
        s = _noncontig(scores) if noncontig else scores
        return _MaskedSoftmax.apply(s, expanded, scale, causal, p, rng)

    def ref(scores):
        return reference.masked_softmax(scores, mask, scale, causal, p, keep=keep)

    results = reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"])
    mdesc = "none" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"
    reference.assert_oracle(
        results,
        f"{(B, H, Lq, Lk)} {scores.dtype} mask={mdesc} causal={causal} scale={scale} p={p} "
        f"noncontig={noncontig} {context}",
    )


def _run(scores, mask=None, *, scale=1.0, causal=False, p=0.0, rng=None, dout=None):
    """(out, probs, dscores) straight from the launchers."""
    B, H, Lq, Lk = scores.shape
    expanded = mask.expand(B, H, Lq, Lk) if mask is not None else None
    out, probs = K.masked_softmax_fwd(scores, expanded, scale, causal, p, rng)
    if dout is None:
        return out, probs, None
    ds = K.masked_softmax_bwd(dout, probs if p > 0 else out, scale, p, rng)
    return out, probs, ds


def _force_loop(monkeypatch, block, max_splits=3):
    """Force the looped path for rows longer than ``block`` (chunks of ``block``), with up to
    ``max_splits`` splits per row.  The interpreter pays per program (~5 ms, ~25 ms with
    dropout), so looped tests keep rows x chunks small."""
    monkeypatch.setattr(K, "FWD_MAX_FUSED", block)
    monkeypatch.setattr(K, "BWD_MAX_FUSED", block)
    monkeypatch.setattr(K, "LOOP_BLOCK", block)
    monkeypatch.setattr(K, "_num_sms", lambda device: 64)
    monkeypatch.setattr(K, "MAX_SPLITS", max_splits)


# ---------------------------------------------------------------------------------------------
# Oracle: sizes x dtypes (fused path, and Lk = 5000 also looped)

# (B, H, Lq) per Lk: Lq != Lk throughout, several row blocks, small enough for the interpreter.
SHAPES = {1: (2, 3, 9), 7: (2, 3, 11), 127: (2, 2, 13), 1000: (1, 3, 5), 5000: (1, 2, 3)}


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("lk", list(SHAPES))
def test_oracle_sizes(lk, dtype):
    """Every size and dtype, twice: (causal + bool (B,1,Lq,Lk) mask, scale 0.5, dropout 0.2,
    non-contiguous scores) and (no mask, scale 1, no dropout, contiguous)."""
    B, H, Lq = SHAPES[lk]
    g, seed = _gen()
    scores = _scores((B, H, Lq, lk), dtype, g)
    mask = _bool_mask((B, 1, Lq, lk), g)
    _oracle(scores, mask, scale=0.5, causal=True, p=0.2, noncontig=True, context=f"seed={seed}")
    _oracle(scores, context=f"seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("lk,block", [(129, 64), (1000, 256), (5000, 1024)])
def test_oracle_looped_path(monkeypatch, lk, block, dtype):
    """Looped path: 3-5 chunks per row, split over up to 3 programs (ragged last chunk and
    split), causal bounding the statistics loop."""
    _force_loop(monkeypatch, block)
    plan = K._plan(6, lk, K.FWD_MAX_FUSED, torch.device(DEVICE))
    assert plan[0] == "looped" and plan[1] >= 2
    g, seed = _gen()
    scores = _scores((1, 2, 3, lk), dtype, g)
    mask = _float_mask((3, lk), g, dtype)
    _oracle(scores, mask, scale=0.7, causal=True, p=0.25, noncontig=True, context=f"seed={seed}")
    bmask = _bool_mask((1, 2, 3, lk), g)
    bmask[0, 1, 2] = False  # a dead row
    _oracle(scores, bmask, scale=1.3, context=f"seed={seed}")


@pytest.mark.parametrize("lk,rows", [(17000, 2), (9000, 1)])
def test_oracle_looped_natural(lk, rows):
    """Without monkeypatching: a row longer than FWD_MAX_FUSED, and few rows of a long-but-fusable
    length (split over programs to fill the GPU) take the looped path."""
    device = torch.device(DEVICE)
    assert K._plan(rows, lk, K.FWD_MAX_FUSED, device)[0] == "looped"
    g, seed = _gen()
    scores = _scores((1, 1, rows, lk), torch.float32, g)
    mask = _bool_mask((rows, lk), g, p_keep=0.9)
    _oracle(scores, mask, scale=0.3, causal=True, p=0.1, context=f"seed={seed}")
    _oracle(scores, scale=0.3, context=f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# Oracle: mask kinds


def _mask_for(kind, B, H, Lq, Lk, g, dtype):
    """(mask, causal) for a mask kind; float masks hold -inf entries."""
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool_2d":  # (Lq, Lk) -> expand
        return _bool_mask((Lq, Lk), g), False
    if kind == "bool_b1":  # (B, 1, Lq, Lk)
        return _bool_mask((B, 1, Lq, Lk), g), False
    if kind == "bool_full":
        return _bool_mask((B, H, Lq, Lk), g), False
    if kind == "bool_keys":  # (B, 1, 1, Lk): key padding as an attn_mask
        return _bool_mask((B, 1, 1, Lk), g, p_keep=0.8), False
    if kind == "bool_rows":  # (B, H, Lq, 1): whole rows in or out (stride 0 along Lk)
        return _bool_mask((B, H, Lq, 1), g, p_keep=0.6), False
    if kind == "float_2d":
        return _float_mask((Lq, Lk), g, dtype), False
    if kind == "float32_b1":
        return _float_mask((B, 1, Lq, Lk), g, torch.float32), False
    if kind == "float_transposed":  # a (Lk, Lq) tensor seen transposed: last stride != 1
        return _float_mask((Lk, Lq), g, dtype).t(), False
    if kind == "bool_causal":
        return _bool_mask((B, 1, Lq, Lk), g), True
    if kind == "float_causal":
        return _float_mask((Lq, Lk), g, dtype), True
    raise AssertionError(kind)


MASK_KINDS = ["none", "causal", "bool_2d", "bool_b1", "bool_full", "bool_keys", "bool_rows",
              "float_2d", "float32_b1", "float_transposed", "bool_causal", "float_causal"]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_oracle_mask_kinds(kind, dtype, p):
    B, H, Lq, Lk = 2, 3, 9, 37
    g, seed = _gen()
    scores = _scores((B, H, Lq, Lk), dtype, g)
    mask, causal = _mask_for(kind, B, H, Lq, Lk, g, dtype)
    _oracle(scores, mask, scale=0.6, causal=causal, p=p, noncontig=p > 0, context=f"{kind} seed={seed}")


@pytest.mark.parametrize("lq,lk", [(1, 7), (7, 1), (20, 5), (5, 20), (3, 64)])
def test_oracle_causal_rectangular(lq, lk):
    """Top-left causal with Lq != Lk (rows beyond Lk see every key; key 0 is always visible)."""
    g, seed = _gen()
    scores = _scores((2, 2, lq, lk), torch.float32, g)
    _oracle(scores, causal=True, scale=1.5, context=f"seed={seed}")
    _oracle(scores.to(torch.float16), _bool_mask((lq, lk), g), causal=True, p=0.4, context=f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# Fully masked rows


def _dead_row_cases(B, H, Lq, Lk, g, dtype):
    """(mask, causal, dead (B, H, Lq) bool) with a known set of fully masked rows."""
    bmask = _bool_mask((B, H, Lq, Lk), g)
    bmask[0, 0, 1] = False
    bmask[1, 2, :] = False  # a whole head
    bmask[:, 1, Lq - 1] = False
    fmask = _float_mask((B, 1, Lq, Lk), g, dtype, p_inf=0.2)
    fmask[0, 0, 0] = float("-inf")
    fmask[1, 0, Lq - 1] = float("-inf")
    cmask = _bool_mask((Lq, Lk), g)
    cmask[:, 0] = False  # with causal, row 0 (sees only key 0) is dead
    cmask[2, :3] = False  # row 2 sees keys 0..2: dead

    def dead_of(allowed):
        return ~allowed.expand(B, H, Lq, Lk).any(dim=-1)

    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=DEVICE).tril()
    return [
        (bmask, False, dead_of(bmask)),
        (fmask, False, dead_of(~torch.isneginf(fmask))),
        (cmask, True, dead_of(cmask & causal)),
    ]


DEAD_ROW_CASES = [(d, "fused", p) for d in DTYPES for p in (0.0, 0.3)] + [
    (torch.float32, "looped", 0.0), (torch.bfloat16, "looped", 0.3)]


def _id(v):
    return _dt(v) if isinstance(v, torch.dtype) else str(v)


@pytest.mark.parametrize("dtype,path,p", DEAD_ROW_CASES, ids=_id)
def test_fully_masked_rows(dtype, path, p, monkeypatch):
    """Rows with nothing allowed: exactly zero output and exactly zero gradient (never NaN), and
    the oracle on the whole tensor."""
    if path == "looped":
        _force_loop(monkeypatch, 32, max_splits=2)  # 2 chunks, 2 splits per row
    B, H, Lq, Lk = 2, 3, 4, 41
    g, seed = _gen()
    scores = _scores((B, H, Lq, Lk), dtype, g)
    rng = torch.tensor([42, 7], dtype=torch.int64, device=DEVICE) if p > 0 else None
    cases = _dead_row_cases(B, H, Lq, Lk, g, dtype)
    slow_interp = path == "looped" and p > 0 and not torch.cuda.is_available()
    if slow_interp:
        cases = cases[:1]  # philox in every one of the looped path's programs: slow interpreted
    for mask, causal, dead in cases:
        assert dead.any()
        dout = _scores((B, H, Lq, Lk), dtype, g)
        out, probs, ds = _run(scores, mask, scale=0.8, causal=causal, p=p, rng=rng, dout=dout)
        assert torch.isfinite(out).all() and torch.isfinite(ds).all()
        assert (out[dead] == 0).all() and (ds[dead] == 0).all()
        if p > 0:
            assert (probs[dead] == 0).all()
        live = out[~dead].to(torch.float32)
        if p == 0:
            torch.testing.assert_close(live.sum(-1), torch.ones_like(live[:, 0]), atol=2e-2, rtol=0)
        if not slow_interp:
            _oracle(scores, mask, scale=0.8, causal=causal, p=p, rng_values=(42, 7), context=f"seed={seed}")


def test_all_rows_masked_and_all_neg_inf():
    """Every row dead (bool all False; float all -inf): zeros everywhere, zero gradient."""
    scores = _scores((1, 2, 3, 50), torch.float32, _gen()[0])
    dout = torch.randn_like(scores)
    for mask in (torch.zeros(3, 50, dtype=torch.bool, device=DEVICE),
                 torch.full((3, 50), float("-inf"), device=DEVICE)):
        out, _, ds = _run(scores, mask, dout=dout)
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ds, torch.zeros_like(ds))


# ---------------------------------------------------------------------------------------------
# Scale, strides


@pytest.mark.parametrize("scale", [0.125, 1.0, 3.0, -0.5, 0.0])
def test_oracle_scale(scale):
    g, seed = _gen()
    scores = _scores((2, 2, 5, 33), torch.float32, g)
    _oracle(scores, _float_mask((5, 33), g, torch.float32), scale=scale, causal=True,
            context=f"seed={seed}")


def test_last_dim_not_unit_stride():
    """scores / dout whose last stride is not 1 are copied: same result as contiguous."""
    g, _ = _gen()
    base = _scores((2, 3, 40, 9), torch.float32, g)  # seen transposed: (2, 3, 9, 40)
    scores = base.transpose(-1, -2)
    dout = _scores((2, 3, 40, 9), torch.float32, g).transpose(-1, -2)
    mask = _bool_mask((9, 40), g)
    out, _, ds = _run(scores, mask, scale=0.5, causal=True, dout=dout)
    out_c, _, ds_c = _run(scores.contiguous(), mask, scale=0.5, causal=True, dout=dout.contiguous())
    assert torch.equal(out, out_c) and torch.equal(ds, ds_c)


def test_expanded_dout():
    """dout with stride 0 everywhere (the gradient of out.sum()) and a strided probs view."""
    g, _ = _gen()
    scores = _scores((2, 2, 7, 19), torch.float32, g)
    out, _, _ = _run(scores, scale=0.9)
    dout = torch.ones((), device=DEVICE).expand(2, 2, 7, 19)
    ds = K.masked_softmax_bwd(dout, _noncontig(out), 0.9, 0.0, None)
    ds_ref = K.masked_softmax_bwd(dout.contiguous(), out, 0.9, 0.0, None)
    assert torch.equal(ds, ds_ref)
    assert ds.abs().max() < 1e-5  # softmax rows sum to 1: gradient of the sum is ~0


# ---------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("path", ["fused", "looped"])
def test_dropout_exact_mask(path, monkeypatch):
    """out == probs * keep / (1 - p) with keep exactly transformer_fast.philox's mask over the
    row-major (B, H, Lq, Lk) index, and the backward regenerates the same mask."""
    if path == "looped":
        _force_loop(monkeypatch, 64)
    p = 0.35
    B, H, Lq, Lk = (2, 3, 7, 150) if path == "fused" else (1, 2, 3, 150)
    g, _ = _gen()
    scores = _scores((B, H, Lq, Lk), torch.float32, g, mult=0.5)
    for rng_values in [(1234567, 89), (-(2**62) + 12345, 2**40 + 7)]:
        rng = torch.tensor(rng_values, dtype=torch.int64, device=DEVICE)
        keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p)
        dout = torch.randn(B, H, Lq, Lk, generator=g).to(DEVICE)
        out, probs, ds = _run(scores, None, scale=0.7, p=p, rng=rng, dout=dout)
        assert (probs > 0).all()
        assert torch.equal(out != 0, keep)
        torch.testing.assert_close(out, torch.where(keep, probs * (1.0 / (1.0 - p)), 0.0), atol=0, rtol=0)
        # the pre-dropout probabilities are the no-dropout output
        out0, _, _ = _run(scores, None, scale=0.7)
        assert torch.equal(probs, out0)
        # backward = the no-dropout backward applied to dout * keep / (1 - p)
        ds_ref = K.masked_softmax_bwd(torch.where(keep, dout / (1.0 - p), 0.0), probs, 0.7, 0.0, None)
        torch.testing.assert_close(ds, ds_ref, atol=1e-7, rtol=1e-6)


def test_dropout_statistics():
    """Kept fraction ~ 1 - p; E[out] row sums ~ 1; different seeds / offsets give different masks."""
    p = 0.2
    B, H, Lq, Lk = 2, 4, 16, 256
    scores = _scores((B, H, Lq, Lk), torch.float32, _gen()[0], mult=0.1)  # near-uniform rows
    rng = torch.tensor([2024, 0], dtype=torch.int64, device=DEVICE)
    out, probs, _ = _run(scores, None, p=p, rng=rng)
    n = out.numel()
    kept = (out != 0).double().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma, kept
    row_sums = out.double().sum(-1)
    assert abs(row_sums.mean().item() - 1.0) < 0.02
    masks = [(out != 0)]
    for rv in ([2025, 0], [2024, 1]):
        o, _, _ = _run(scores, None, p=p, rng=torch.tensor(rv, dtype=torch.int64, device=DEVICE))
        masks.append(o != 0)
    for other in masks[1:]:
        agree = (masks[0] == other).double().mean().item()
        assert agree < 0.8  # independent masks agree on ~ (1-p)^2 + p^2 = 0.68


def test_dropout_p_one_and_tiny():
    scores = _scores((1, 2, 3, 10), torch.float32, _gen()[0])
    rng = torch.tensor([5, 6], dtype=torch.int64, device=DEVICE)
    out, probs, ds = _run(scores, None, p=1.0, rng=rng, dout=torch.ones_like(scores))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ds, torch.zeros_like(ds))
    out, probs, _ = _run(scores, None, p=1e-12, rng=rng)
    assert (out != 0).all()


# ---------------------------------------------------------------------------------------------
# Determinism, plan, empties, argument checks


@pytest.mark.parametrize("path", ["fused", "looped"])
def test_deterministic(path, monkeypatch):
    if path == "looped":
        _force_loop(monkeypatch, 128)
    g, _ = _gen()
    shape = (2, 2, 5, 300) if path == "fused" else (1, 2, 3, 300)
    scores = _scores(shape, torch.float16, g)
    dout = _scores(shape, torch.float16, g)
    mask = _float_mask((shape[0], 1) + shape[2:], g, torch.float16)
    rng = torch.tensor([11, 12], dtype=torch.int64, device=DEVICE)
    first = _run(scores, mask, scale=0.3, causal=True, p=0.1, rng=rng, dout=dout)
    second = _run(scores, mask, scale=0.3, causal=True, p=0.1, rng=rng, dout=dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_plan():
    dev = torch.device("cpu")
    fused, bm, bn, _ = K._plan(10000, 7, K.FWD_MAX_FUSED, dev)
    assert fused == "fused" and bn == 8 and bm > 1  # several short rows per program
    fused, bm, bn, _ = K._plan(10000, 1000, K.FWD_MAX_FUSED, dev)
    assert fused == "fused" and bn == 1024 and bm == 4
    assert K._plan(10000, K.FWD_MAX_FUSED, K.FWD_MAX_FUSED, dev)[0] == "fused"
    looped, nsplit, span, _ = K._plan(10000, K.FWD_MAX_FUSED + 1, K.FWD_MAX_FUSED, dev)
    assert looped == "looped" and nsplit == 1 and span >= K.FWD_MAX_FUSED + 1
    looped, nsplit, span, _ = K._plan(1, 65536, K.FWD_MAX_FUSED, dev)
    assert looped == "looped" and nsplit > 1 and nsplit * span >= 65536 > (nsplit - 1) * span
    assert K._align(0, 64, 1024) == 16 and K._align(1000) == 8 and K._align(7, 16) == 1


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 3, 0, 4), (2, 3, 4, 0)])
def test_empty(shape):
    scores = torch.randn(shape, device=DEVICE)
    rng = torch.tensor([1, 2], dtype=torch.int64, device=DEVICE)
    mask = torch.ones(shape, dtype=torch.bool, device=DEVICE)
    out, probs = K.masked_softmax_fwd(scores, mask, 1.0, True, 0.5, rng)
    assert out.shape == shape and probs.shape == shape
    out, probs = K.masked_softmax_fwd(scores, None, 1.0, False, 0.0, None)
    assert out.shape == shape and probs.shape == (0,)
    ds = K.masked_softmax_bwd(scores, scores, 1.0, 0.0, None)
    assert ds.shape == shape


def test_lk_one():
    """Lk == 1: probability 1 unless masked; gradient exactly 0."""
    scores = _scores((2, 3, 5, 1), torch.float32, _gen()[0])
    mask = torch.tensor([True, False, True, True, False], device=DEVICE).view(5, 1)
    out, _, ds = _run(scores, mask, dout=torch.randn_like(scores))
    expect = mask.to(torch.float32).expand(2, 3, 5, 1)
    assert torch.equal(out, expect) and torch.equal(ds, torch.zeros_like(ds))


def test_argument_errors():
    s = torch.randn(2, 3, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="4-D"):
        K.masked_softmax_fwd(s[0], None, 1.0, False, 0.0, None)
    with pytest.raises(TypeError, match="float16"):
        K.masked_softmax_fwd(s.double(), None, 1.0, False, 0.0, None)
    with pytest.raises(ValueError, match="mask must have shape"):
        K.masked_softmax_fwd(s, torch.ones(4, 5, dtype=torch.bool, device=DEVICE), 1.0, False, 0.0, None)
    with pytest.raises(TypeError, match="bool or floating"):
        K.masked_softmax_fwd(s, torch.ones(2, 3, 4, 5, dtype=torch.int32, device=DEVICE), 1.0, False, 0.0, None)
    with pytest.raises(ValueError, match="rng"):
        K.masked_softmax_fwd(s, None, 1.0, False, 0.5, None)
    with pytest.raises(ValueError, match="dropout_p"):
        K.masked_softmax_fwd(s, None, 1.0, False, 1.5, None)
    with pytest.raises(ValueError, match="dout must have shape"):
        K.masked_softmax_bwd(s[:, :, :2], s, 1.0, 0.0, None)


# ---------------------------------------------------------------------------------------------
# Slow: bigger shapes, very long rows


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("lk", [65536, 70001])
def test_oracle_very_long_rows(lk, dtype):
    g, seed = _gen()
    scores = _scores((1, 2, 2, lk), dtype, g)
    _oracle(scores, _bool_mask((2, lk), g, p_keep=0.95), scale=0.2, causal=False, p=0.1,
            noncontig=True, context=f"seed={seed}")
    _oracle(scores, _float_mask((1, 2, 2, lk), g, dtype, p_inf=0.1), causal=True, context=f"seed={seed}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("lk", [1, 7, 64, 127, 200, 1000, 2048, 5000, 8192, 16384])
@pytest.mark.parametrize("kind", ["bool_causal", "float_causal", "bool_keys", "float32_b1"])
def test_oracle_grid_slow(kind, lk, dtype):
    B, H, Lq = 2, 2, 9
    g, seed = _gen()
    scores = _scores((B, H, Lq, lk), dtype, g)
    mask, causal = _mask_for(kind, B, H, Lq, lk, g, dtype)
    _oracle(scores, mask, scale=0.4, causal=causal, p=0.15, noncontig=True, context=f"{kind} seed={seed}")


def test_looped_row_of_large_negative_scores(monkeypatch):
    """Looped path with 3 splits per row (a masked fourth partial): every score near -300 (a
    finite float mask; softmax ignores the shift).  A masked partial's max must not count as 0,
    or exp(-300 - 0) underflows and the row comes out 0."""
    _force_loop(monkeypatch, 64, max_splits=3)
    g, seed = _gen()
    scores = torch.randn(1, 2, 3, 150, generator=g).to(DEVICE)
    mask = (torch.randn(1, 2, 3, 150, generator=g) - 300.0).to(DEVICE)
    plan = K._plan(6, 150, K.FWD_MAX_FUSED, scores.device)
    assert plan[0] == "looped" and plan[1] == 3, plan
    _oracle(scores, mask, context=f"scores near -300, looped, seed {seed}")
