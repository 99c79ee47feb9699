"""C++ masked_softmax (csrc/masked_softmax_cpu.cpp, the `cpu` backend; csrc/masked_softmax_cuda.cu,
the `cuda` backend, here in CPU emulation) against the DESIGN section 6 oracle.

* the whole functional path (F.masked_softmax(..., backend=BACKEND): validation, 4-D folding,
  custom op, autograd) and the C++ ops directly (torch.ops.transformer_fast_C.masked_softmax_fwd /
  _bwd, through a small autograd.Function so that the oracle checks gradients), over rows of
  1, 7, 127, 1000, 4097, Lq != Lk, every mask kind (bool / float, stride-0 broadcast dims, a
  transposed float mask, fp32 / fp64 masks on half scores), causal, fully masked rows,
  non-contiguous and misaligned scores, fp32 / fp16 / bf16, dropout (the exact keep mask of
  transformer_fast.philox, statistics, backward regeneration), NaN / +inf propagation, the ops'
  argument errors, determinism;
* the CUDA kernels compiled as host C++ (tests/cuda_emulation.py): the warp-per-row kernels
  (every register bucket) and the block-per-row kernels (Lk > 1024), forward and backward,
  dropout, dead rows, misaligned and strided views (scalar and 8/16-byte access paths).

tests/test_gpu_masked_softmax_cuda.py runs the functional / direct checks with BACKEND = "cuda".
"""
import pytest
import torch

from transformer_fast import backends, philox, reference
from transformer_fast import functional as F

from _functional_helpers import DTYPES, bool_mask, dt_id, float_mask, generator, randn
from conftest import require_backend
from cuda_emulation import build as cuda_emulation_build

# tests/test_gpu_masked_softmax_cuda.py monkeypatches this (module globals are read at call time).
BACKEND = "cpu"


@pytest.fixture
def device():
    return require_backend(BACKEND)


def _ops():
    backends.extension_status()  # imports _C, which registers the ops
    return torch.ops.transformer_fast_C


def _cxx_launchers():
    return _ops().masked_softmax_fwd, _ops().masked_softmax_bwd


# ---------------------------------------------------------------------------------------------
# Helpers


class _Launchers(torch.autograd.Function):
    """Autograd over a (fwd, bwd) launcher pair, checking their output contract on the way."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal, p, rng, fwd, bwd):
        out, probs = fwd(scores, mask, scale, causal, p, rng)
        assert out.shape == scores.shape and out.dtype == scores.dtype and out.is_contiguous()
        if p > 0:
            assert probs.shape == scores.shape and probs.dtype == scores.dtype and probs.is_contiguous()
        else:
            assert probs.shape == (0,)
        ctx.save_for_backward(probs if p > 0 else out, rng)
        ctx.args = (scale, p, bwd)
        return out

    @staticmethod
    def backward(ctx, dout):
        probs, rng = ctx.saved_tensors
        scale, p, bwd = ctx.args
        ds = bwd(dout, probs, scale, p, rng)
        assert ds.shape == dout.shape and ds.dtype == dout.dtype and ds.is_contiguous()
        return ds, None, None, None, None, None, None, None


def _layout(t, layout):
    """The values of ``t`` (B, H, Lq, Lk) in another layout (differentiable):
    padded     (B, Lq, H, Lk + 3) storage seen through a transposed view: odd row strides;
    aligned    (B, Lq, H, Lk rounded up past a multiple of 8) storage: strided, 16-byte rows;
    misaligned contiguous but one element past an aligned start."""
    if layout == "contig":
        return t
    lk = t.shape[-1]
    if layout in ("padded", "aligned"):
        pad = 3 if layout == "padded" else (8 - lk % 8) + 8
        wide = torch.nn.functional.pad(t.transpose(1, 2), (0, pad), value=float("nan"))
        view = wide[..., :lk].transpose(1, 2)
        assert view.stride(-1) == 1 and not view.is_contiguous()
        return view
    if layout == "misaligned":
        flat = torch.cat([t.new_zeros(1), t.reshape(-1)])
        view = flat[1:].view(t.shape)
        assert view.data_ptr() % 16 != 0 or t.numel() == 0
        return view
    raise AssertionError(layout)


def _mask(kind, B, H, Lq, Lk, dtype, g, device):
    """(mask in its broadcastable form, is_causal) for a mask kind; float masks hold -inf."""
    causal = kind.endswith("+causal") or kind == "causal"
    kind = kind.replace("+causal", "")
    if kind in ("none", "causal"):
        return None, causal
    shapes = {"2d": (Lq, Lk), "b1": (B, 1, Lq, Lk), "full": (B, H, Lq, Lk), "keys": (B, 1, 1, Lk),
              "rows": (B, H, Lq, 1), "transposed": (Lk, Lq)}
    base, form = kind.split("_", 1)
    if base == "bool":
        m = bool_mask(shapes[form], g, keep_prob=0.6 if form == "rows" else 0.75)
    else:
        mdtype = {"float": dtype, "float32": torch.float32, "float64": torch.float64}[base]
        m = float_mask(shapes[form], mdtype, g, inf_prob=0.25)
    if form == "transposed":
        m = m.t()  # last stride != 1
    return m.to(device), causal


MASK_KINDS = ["none", "causal", "bool_2d", "bool_b1", "bool_full", "bool_keys", "bool_rows",
              "float_2d", "float32_b1", "float64_full", "float_transposed", "bool_b1+causal",
              "float_2d+causal"]


def _oracle(scores, mask=None, *, scale=1.0, causal=False, p=0.0, rng=None, layout="contig",
            launchers=None, context=""):
    """Oracle check of out and d(scores).  Without ``launchers`` (and dropout) through
    F.masked_softmax(backend=BACKEND); with them, the launcher pair on the expanded mask."""
    B, H, Lq, Lk = scores.shape
    keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p) if p > 0 else None
    if launchers is None:
        assert p == 0.0, "the functional path draws its own rng: dropout goes through the launchers"

        def kernel(scores):
            return F.masked_softmax(_layout(scores, layout), mask, scale=scale, is_causal=causal,
                                    backend=BACKEND)
    else:
        expanded = mask.expand(B, H, Lq, Lk) if mask is not None else None

        def kernel(scores):
            return _Launchers.apply(_layout(scores, layout), expanded, scale, causal, p, rng, *launchers)

    def ref(scores):
        return reference.masked_softmax(scores, mask, scale, causal, p, keep=keep)

    results = reference.run_oracle(kernel, ref, {"scores": scores}, ["scores"])
    mdesc = "none" if mask is None else f"{mask.dtype} {tuple(mask.shape)} strides {mask.stride()}"
    reference.assert_oracle(results, f"{BACKEND} {(B, H, Lq, Lk)} {scores.dtype} mask={mdesc} causal={causal} "
                                     f"scale={scale} p={p} layout={layout} {context}")


def _rng(device, values=None):
    if values is None:
        return philox.new_rng(device)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _run(scores, mask=None, *, scale=1.0, causal=False, p=0.0, rng=None, dout=None, launchers=None):
    """(out, probs, dscores or None) straight from the launchers."""
    fwd, bwd = launchers or _cxx_launchers()
    B, H, Lq, Lk = scores.shape
    expanded = mask.expand(B, H, Lq, Lk) if mask is not None else None
    out, probs = fwd(scores, expanded, scale, causal, p, rng)
    ds = None if dout is None else bwd(dout, probs if p > 0 else out, scale, p, rng)
    return out, probs, ds


# ---------------------------------------------------------------------------------------------
# Oracle: row lengths x dtypes

# (B, H, Lq) per Lk: Lq != Lk throughout; 4097 is past the CUDA warp kernels (block kernel).
SHAPES = {1: (2, 3, 9), 7: (2, 3, 11), 127: (2, 2, 13), 1000: (1, 3, 5), 4097: (1, 2, 3)}


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", list(SHAPES))
def test_sizes(device, lk, dtype):
    """Every size and dtype, three ways: functional (bool (B,1,Lq,Lk) mask + causal, padded
    strided scores), launchers (float (Lq, Lk) mask, dropout, misaligned scores), launchers
    (nothing, contiguous)."""
    B, H, Lq = SHAPES[lk]
    g = generator()
    scores = randn(B, H, Lq, lk, dtype=dtype, g=g, scale=2.0).to(device)
    bmask = bool_mask((B, 1, Lq, lk), g).to(device)
    fmask = float_mask((Lq, lk), dtype, g).to(device)
    _oracle(scores, bmask, scale=0.5, causal=True, layout="padded")
    _oracle(scores, fmask, scale=1.3, p=0.2, rng=_rng(device), layout="misaligned", launchers=_cxx_launchers())
    _oracle(scores, launchers=_cxx_launchers())


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds(device, kind, dtype, p):
    B, H, Lq, Lk = 2, 3, 9, 37
    g = generator()
    scores = randn(B, H, Lq, Lk, dtype=dtype, g=g, scale=2.0).to(device)
    mask, causal = _mask(kind, B, H, Lq, Lk, dtype, g, device)
    if p == 0.0 and not (mask is not None and mask.dtype == torch.float64):
        _oracle(scores, mask, scale=0.6, causal=causal, context=kind)  # functional
    _oracle(scores, mask, scale=0.6, causal=causal, p=p, rng=_rng(device) if p else None,
            layout="padded", launchers=_cxx_launchers(), context=kind)


@pytest.mark.parametrize("shape,mshape", [((37,), (37,)), ((9, 37), (9, 1)), ((3, 9, 37), (9, 37)),
                                          ((2, 2, 3, 5, 7), (2, 1, 1, 5, 7))])
def test_other_ranks(device, shape, mshape):
    """The functional path folds 1-D..5-D scores into (B, H, Lq, Lk) (causal needs 2-D+)."""
    g = generator()
    scores = randn(*shape, g=g).to(device).requires_grad_()
    mask = bool_mask(mshape, g).to(device)
    causal = len(shape) >= 2
    out = F.masked_softmax(scores, mask, scale=0.7, is_causal=causal, backend=BACKEND)
    ref = reference.masked_softmax(scores.detach().double(), mask, 0.7, causal)
    assert out.shape == scores.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    dout = torch.randn_like(out)
    (ds,) = torch.autograd.grad(out, scores, dout)
    s64 = scores.detach().double().requires_grad_()
    (ds_ref,) = torch.autograd.grad(reference.masked_softmax(s64, mask, 0.7, causal), s64, dout.double())
    torch.testing.assert_close(ds.double(), ds_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lq,lk", [(1, 7), (7, 1), (20, 5), (5, 20), (3, 64)])
def test_causal_rectangular(device, lq, lk):
    """Top-left causal with Lq != Lk (rows past Lk see every key; key 0 is always visible)."""
    g = generator()
    scores = randn(2, 2, lq, lk, g=g).to(device)
    _oracle(scores, causal=True, scale=1.5)
    _oracle(scores.to(torch.float16), bool_mask((lq, lk), g).to(device), causal=True, p=0.4,
            rng=_rng(device), launchers=_cxx_launchers())


# ---------------------------------------------------------------------------------------------
# Fully masked rows


def _dead_row_cases(B, H, Lq, Lk, g, dtype, device):
    """(mask, causal, dead (B, H, Lq) bool) with known fully masked rows."""
    bmask = bool_mask((B, H, Lq, Lk), g, keep_prob=0.7)
    bmask[0, 0, 1] = False
    bmask[1, 2, :] = False  # a whole head
    bmask[:, 1, Lq - 1] = False
    fmask = float_mask((B, 1, Lq, Lk), dtype, g, inf_prob=0.2)
    fmask[0, 0, 0] = float("-inf")
    fmask[1, 0, Lq - 1] = float("-inf")
    cmask = bool_mask((Lq, Lk), g, keep_prob=0.7)
    cmask[:, 0] = False  # with causal, row 0 (sees key 0 only) is dead
    cmask[2, :3] = False  # row 2 sees keys 0..2: dead
    causal = torch.ones(Lq, Lk, dtype=torch.bool).tril()

    def dead_of(allowed):
        return ~allowed.expand(B, H, Lq, Lk).any(dim=-1)

    return [(m.to(device), c, dead_of(a).to(device)) for m, c, a in (
        (bmask, False, bmask), (fmask, False, ~torch.isneginf(fmask)), (cmask, True, cmask & causal))]


@pytest.mark.parametrize("lk", [41, 1500])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
def test_fully_masked_rows(device, dtype, p, lk):
    """Rows with nothing allowed: exactly zero output and gradient (never NaN); the oracle on the
    whole tensor."""
    B, H, Lq = 2, 3, 4
    g = generator()
    scores = randn(B, H, Lq, lk, dtype=dtype, g=g, scale=2.0).to(device)
    rng = _rng(device, (42, 7)) if p > 0 else None
    for mask, causal, dead in _dead_row_cases(B, H, Lq, lk, g, dtype, device):
        assert dead.any()
        dout = randn(B, H, Lq, lk, dtype=dtype, g=g).to(device)
        out, probs, ds = _run(scores, mask, scale=0.8, causal=causal, p=p, rng=rng, dout=dout)
        assert torch.isfinite(out).all() and torch.isfinite(ds).all()
        assert (out[dead] == 0).all() and (ds[dead] == 0).all()
        if p > 0:
            assert (probs[dead] == 0).all()
        else:
            live = out[~dead].to(torch.float32)
            torch.testing.assert_close(live.sum(-1), torch.ones_like(live[:, 0]), atol=2e-2, rtol=0)
        _oracle(scores, mask, scale=0.8, causal=causal, p=p, rng=rng, launchers=_cxx_launchers())


def test_every_row_dead(device):
    """Every row dead (bool all False; float all -inf): zeros everywhere, zero gradient."""
    scores = randn(1, 2, 3, 50).to(device)
    dout = torch.randn_like(scores)
    for mask in (torch.zeros(3, 50, dtype=torch.bool, device=device),
                 torch.full((3, 50), float("-inf"), device=device)):
        out, _, ds = _run(scores, mask, dout=dout)
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ds, torch.zeros_like(ds))


# ---------------------------------------------------------------------------------------------
# NaN / inf, scale, strides, dtypes


@pytest.mark.parametrize("lk", [9, 2000])
def test_nan_and_inf_propagate_like_reference(device, lk):
    """A NaN or +inf score makes its row NaN (as torch.softmax does); a NaN under a removed entry
    (bool mask False, past the causal diagonal) is removed with it."""
    scores = randn(1, 2, 4, lk).to(device)
    scores[0, 0, 1, 1] = float("nan")
    scores[0, 1, 2, 2] = float("inf")
    scores[0, 1, 0, 4] = float("nan")  # past the diagonal of row 0: removed by causal
    mask = torch.ones(4, lk, dtype=torch.bool, device=device)
    mask[3, 0] = False
    scores[0, 0, 3, 0] = float("nan")  # removed by the mask
    for causal in (False, True):
        out, _, _ = _run(scores, mask, causal=causal)
        ref = reference.masked_softmax(scores.double(), mask, 1.0, causal)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), causal
        finite = ~torch.isnan(ref)
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=1e-6, rtol=0)
        assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(out[0, 1, 2]).all()
        assert not torch.isnan(out[0, 0, 3]).any() and (not causal or not torch.isnan(out[0, 1, 0]).any())


@pytest.mark.parametrize("scale", [0.125, 3.0, -0.5, 0.0])
def test_scale(device, scale):
    g = generator()
    scores = randn(2, 2, 5, 33, g=g).to(device)
    _oracle(scores, float_mask((5, 33), torch.float32, g).to(device), scale=scale, causal=True)


def test_last_dim_not_unit_stride(device):
    """scores / dout whose last stride is not 1 are copied: the same result as contiguous."""
    g = generator()
    scores = randn(2, 3, 40, 9, g=g).to(device).transpose(-1, -2)
    dout = randn(2, 3, 40, 9, g=g).to(device).transpose(-1, -2)
    mask = bool_mask((9, 40), g).to(device)
    out, _, ds = _run(scores, mask, scale=0.5, causal=True, dout=dout)
    out_c, _, ds_c = _run(scores.contiguous(), mask, scale=0.5, causal=True, dout=dout.contiguous())
    assert torch.equal(out, out_c) and torch.equal(ds, ds_c)


def test_expanded_dout_and_strided_probs(device):
    """dout with stride 0 everywhere (the gradient of out.sum()) and a strided probs view."""
    scores = randn(2, 2, 7, 19).to(device)
    out, _, _ = _run(scores, scale=0.9)
    dout = torch.ones((), device=device).expand(2, 2, 7, 19)
    bwd = _ops().masked_softmax_bwd
    ds = bwd(dout, _layout(out, "padded"), 0.9, 0.0, None)
    assert torch.equal(ds, bwd(dout.contiguous(), out, 0.9, 0.0, None))
    assert ds.abs().max() < 1e-5  # rows sum to 1: the gradient of the sum is ~0


def test_mixed_dtype_backward(device):
    """dout and probs of different dtypes (not produced by the op layer): computed in fp32,
    returned in dout's dtype."""
    scores = randn(2, 2, 5, 30).to(device)
    out, _, _ = _run(scores)
    dout = randn(2, 2, 5, 30).to(device)
    bwd = _ops().masked_softmax_bwd
    ds = bwd(dout, out.half(), 1.0, 0.0, None)
    assert ds.dtype == torch.float32
    torch.testing.assert_close(ds, bwd(dout, out.half().float(), 1.0, 0.0, None), atol=0, rtol=0)
    ds16 = bwd(dout.half(), out, 1.0, 0.0, None)
    assert ds16.dtype == torch.float16
    torch.testing.assert_close(ds16, bwd(dout.half().float(), out, 1.0, 0.0, None).half(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Dropout


def test_dropout_exact_mask(device):
    """out == probs * keep / (1 - p) with keep exactly transformer_fast.philox's mask over the
    row-major (B, H, Lq, Lk) index; probs is the no-dropout output; the backward regenerates the
    same mask (it equals the no-dropout backward of dout * keep / (1 - p))."""
    p = 0.35
    B, H, Lq, Lk = 2, 3, 7, 150
    g = generator()
    scores = randn(B, H, Lq, Lk, g=g, scale=0.5).to(device)
    for rng_values in [(1234567, 89), (-(2**62) + 12345, 2**40 + 7)]:
        rng = _rng(device, rng_values)
        keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p)
        dout = randn(B, H, Lq, Lk, g=g).to(device)
        out, probs, ds = _run(scores, None, scale=0.7, p=p, rng=rng, dout=dout)
        assert (probs > 0).all()
        assert torch.equal(out != 0, keep)
        torch.testing.assert_close(out, torch.where(keep, probs * (1.0 / (1.0 - p)), 0.0), atol=0, rtol=0)
        out0, _, _ = _run(scores, None, scale=0.7)
        assert torch.equal(probs, out0)
        ds_ref = _ops().masked_softmax_bwd(torch.where(keep, dout / (1.0 - p), 0.0), probs, 0.7, 0.0, None)
        torch.testing.assert_close(ds, ds_ref, atol=1e-7, rtol=1e-6)


def test_dropout_statistics(device):
    """Kept fraction ~ 1 - p; row sums ~ 1 on average; other seeds / offsets give other masks."""
    p = 0.2
    B, H, Lq, Lk = 2, 4, 16, 256
    scores = randn(B, H, Lq, Lk, scale=0.1).to(device)  # near-uniform rows
    out, _, _ = _run(scores, None, p=p, rng=_rng(device, (2024, 0)))
    n = out.numel()
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, kept
    assert abs(out.double().sum(-1).mean().item() - 1.0) < 0.02
    for values in ((2025, 0), (2024, 1)):
        other, _, _ = _run(scores, None, p=p, rng=_rng(device, values))
        assert ((out != 0) == (other != 0)).double().mean().item() < 0.8  # independent: ~0.68


def test_dropout_p_one_and_tiny(device):
    scores = randn(1, 2, 3, 10).to(device)
    rng = _rng(device, (5, 6))
    out, _, ds = _run(scores, None, p=1.0, rng=rng, dout=torch.ones_like(scores))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ds, torch.zeros_like(ds))
    out, _, _ = _run(scores, None, p=1e-12, rng=rng)
    assert (out != 0).all()


# ---------------------------------------------------------------------------------------------
# Determinism, empties, errors


def test_deterministic(device):
    """Bitwise reproducible (and, on the CPU, independent of the thread count)."""
    g = generator()
    shape = (2, 3, 5, 300)
    scores = randn(*shape, dtype=torch.float16, g=g).to(device)
    dout = randn(*shape, dtype=torch.float16, g=g).to(device)
    mask = float_mask((2, 1, 5, 300), torch.float16, g).to(device)
    rng = _rng(device, (11, 12))
    run = lambda: _run(scores, mask, scale=0.3, causal=True, p=0.1, rng=rng, dout=dout)  # noqa: E731
    first = run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        second = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 3, 0, 4), (2, 3, 4, 0)])
def test_empty(device, shape):
    scores = torch.randn(shape, device=device)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    fwd, bwd = _cxx_launchers()
    out, probs = fwd(scores, mask, 1.0, True, 0.5, _rng(device, (1, 2)))
    assert out.shape == shape and probs.shape == shape
    out, probs = fwd(scores, None, 1.0, False, 0.0, None)
    assert out.shape == shape and probs.shape == (0,)
    assert bwd(scores, scores, 1.0, 0.0, None).shape == shape
    s = torch.randn(shape, device=device, requires_grad=True)
    F.masked_softmax(s, backend=BACKEND).sum().backward()
    assert s.grad.shape == shape


def test_lk_one(device):
    """Lk == 1: probability 1 unless masked; gradient exactly 0."""
    scores = randn(2, 3, 5, 1).to(device)
    mask = torch.tensor([True, False, True, True, False], device=device).view(5, 1)
    out, _, ds = _run(scores, mask, dout=torch.randn_like(scores))
    assert torch.equal(out, mask.to(torch.float32).expand(2, 3, 5, 1))
    assert torch.equal(ds, torch.zeros_like(ds))


def test_op_argument_errors(device):
    """The C++ ops check their arguments (ValueError / TypeError naming the argument)."""
    fwd, bwd = _cxx_launchers()
    s = torch.randn(2, 3, 4, 5, device=device)
    with pytest.raises(ValueError, match="scores must be 4-D"):
        fwd(s[0], None, 1.0, False, 0.0, None)
    with pytest.raises(TypeError, match="scores must be float16"):
        # (float64 scores are the cpu attention's exact fp32 path: CPU only)
        fwd(s.double() if device != "cpu" else s.int(), None, 1.0, False, 0.0, None)
    with pytest.raises(ValueError, match="mask must have shape"):
        fwd(s, torch.ones(4, 5, dtype=torch.bool, device=device), 1.0, False, 0.0, None)
    with pytest.raises(TypeError, match="mask must be bool or floating"):
        fwd(s, torch.ones(2, 3, 4, 5, dtype=torch.int32, device=device), 1.0, False, 0.0, None)
    with pytest.raises(ValueError, match="rng"):
        fwd(s, None, 1.0, False, 0.5, None)
    with pytest.raises(ValueError, match="rng must be an int64"):
        fwd(s, None, 1.0, False, 0.5, torch.tensor([1.0, 2.0], device=device))
    with pytest.raises(ValueError, match="dropout_p"):
        fwd(s, None, 1.0, False, 1.5, None)
    with pytest.raises(ValueError, match="scale must be finite"):
        fwd(s, None, float("inf"), False, 0.0, None)
    with pytest.raises(ValueError, match="dout must have shape"):
        bwd(s[:, :, :2], s, 1.0, 0.0, None)
    with pytest.raises(TypeError, match="dout must be float16"):
        bwd(s.double(), s, 1.0, 0.0, None)
    other = "cpu" if device != "cpu" else None
    if other is None and torch.cuda.is_available():
        other = "cuda"
    if other is not None:
        with pytest.raises(ValueError, match="mask must be on"):
            fwd(s, torch.ones(2, 3, 4, 5, dtype=torch.bool, device=other), 1.0, False, 0.0, None)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_opcheck(device, p):
    """The op layer's fake kernels agree with the C++ ops (shapes, dtypes, strides: contiguous out,
    empty or full probs, contiguous dscores), with padded strided scores and a stride-0 mask."""
    from transformer_fast.ops import masked_softmax as op

    scores = _layout(randn(2, 3, 5, 19).to(device), "padded").detach().requires_grad_()
    mask = (torch.rand(5, 19, device=device) < 0.8).expand(2, 3, 5, 19)
    rng = _rng(device, (3, 4)) if p else None
    torch.library.opcheck(op.masked_softmax_fwd, (scores, mask, 0.5, True, p, rng, BACKEND))
    probs = torch.rand(2, 3, 5, 19, device=device)
    dout = _layout(torch.randn(2, 3, 5, 19, device=device), "padded")
    torch.library.opcheck(op.masked_softmax_bwd, (dout, probs, 0.5, p, rng, BACKEND))


def test_registered_and_selected(device):
    """The backend is registered with its support check and answers through the functional API."""
    s = randn(2, 5, 9).to(device)
    assert backends.not_supported_reasons(BACKEND, "masked_softmax", {"scores": s, "mask": None}) == []
    reasons = backends.not_supported_reasons(BACKEND, "masked_softmax", {"scores": s.double(), "mask": None})
    assert reasons and "float64" in " ".join(reasons)
    torch.testing.assert_close(F.masked_softmax(s, backend=BACKEND), torch.softmax(s, -1), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels in CPU emulation (tests/cuda_emulation.py)

_EMU_HARNESS = r"""
namespace transformer_fast {
namespace {
alignas(16) unsigned char smem_raw[1 << 12];  // the kernels' `extern __shared__ ... smem_raw[]`
void check_cuda_device(const at::Tensor& t);
}  // namespace
}  // namespace transformer_fast

#include "masked_softmax_cuda.cu"

namespace transformer_fast {
namespace {
void check_cuda_device(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "the emulation runs on CPU tensors");
}

template <typename Kernel, typename P>
void launch(Kernel kernel, int64_t blocks, int threads, size_t smem_bytes, const P& p) {
  emu::run_grid(EmuDim3{static_cast<unsigned>(blocks), 1, 1}, threads, smem_raw, sizeof(smem_raw),
                smem_bytes, [&] { kernel(p); });
}
}  // namespace
}  // namespace transformer_fast

std::vector<at::Tensor> fwd(at::Tensor scores, std::optional<at::Tensor> mask, double scale, bool causal,
                            double p, std::optional<at::Tensor> rng) {
  auto [out, probs] = transformer_fast::masked_softmax_fwd_cuda(scores, mask, scale, causal, p, rng);
  return {out, probs};
}

at::Tensor bwd(at::Tensor dout, at::Tensor probs, double scale, double p, std::optional<at::Tensor> rng) {
  return transformer_fast::masked_softmax_bwd_cuda(dout, probs, scale, p, rng);
}

// Values per lane of the warp kernels for a row length; 0 = the block (long-row) kernels.
int64_t warp_items(int64_t lk) { return transformer_fast::warp_items(lk); }
"""


@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal", "dropout"])
def test_float64_scores_give_exact_fp32_probabilities(device, kind):
    """float64 scores (the cpu attention's exact fp32 path, transformer_fast/ops/cpu_attention.py):
    the softmax in double, each probability rounded to fp32 once: within an fp32 ulp of the
    float64 softmax at logits up to ~150, where rounding the scores to fp32 first is off by up
    to ~150 x 2^-24 relative.  Masks, causal rows, dead rows and dropout as for fp32 scores."""
    if device != "cpu":
        pytest.skip("float64 scores: the CPU kernel only")
    g = generator()
    scores = torch.randn(2, 3, 7, 37, generator=g, dtype=torch.float64) * 50
    mask, causal, p, rng = None, kind == "causal", 0.0, None
    if kind == "bool":
        mask = bool_mask((2, 3, 7, 37), g)
        mask[0, 1, 3] = False  # a dead row
    elif kind == "float":
        mask = torch.randn(2, 3, 7, 37, generator=g)
        mask[1, 2, 4, :] = float("-inf")  # a dead row
    elif kind == "dropout":
        p, rng = 0.3, philox.new_rng("cpu")
    out, probs, _ = _run(scores, mask, scale=0.7, causal=causal, p=p, rng=rng)
    assert out.dtype == torch.float32 and probs.dtype == torch.float32

    x = scores * 0.7
    if kind == "bool":
        x = x.masked_fill(~mask, float("-inf"))
    elif kind == "float":
        x = x + mask.double()
    elif causal:
        x = x.masked_fill(torch.ones(7, 37, dtype=torch.bool).triu(1), float("-inf"))
    dead = (x == float("-inf")).all(-1, keepdim=True)
    exact = torch.softmax(x.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    got = probs if p > 0 else out
    err = (got.double() - exact).abs()
    assert (err <= exact * 2.0**-24 + 1e-45).all(), f"worst relative error {(err / exact.clamp_min(1e-300)).max():.3g}"
    if kind in ("bool", "float"):
        assert torch.equal(got[dead.expand_as(got)], torch.zeros_like(got[dead.expand_as(got)]))
    if p > 0:
        keep = philox.dropout_keep_mask(rng, out.shape, p)
        assert torch.equal(out, torch.where(keep, probs * (1 / (1 - p)), 0.0).float()) or torch.allclose(
            out, torch.where(keep, probs / (1 - p), 0.0), rtol=2.0**-23, atol=0.0)
        # the fp32 path drops the same elements
        out32, probs32, _ = _run(scores.float(), None, scale=0.7, p=p, rng=rng)
        assert torch.equal(out32, torch.where(keep, out32, 0.0)) and (out32[keep] > 0).sum() == (probs32[keep] > 0).sum()


def test_float64_scores_nan_rows(device):
    """A NaN or +inf score makes its row NaN, as with fp32 scores (and the reference)."""
    if device != "cpu":
        pytest.skip("float64 scores: the CPU kernel only")
    scores = torch.randn(1, 1, 3, 9, dtype=torch.float64)
    scores[0, 0, 0, 4] = float("nan")
    scores[0, 0, 1, 2] = float("inf")
    out, _, _ = _run(scores)
    assert out[0, 0, :2].isnan().all() and torch.isfinite(out[0, 0, 2]).all()


@pytest.fixture(scope="module")
def cuda_emulation():
    return cuda_emulation_build("tf_masked_softmax_cuda_emu", _EMU_HARNESS,
                                ("masked_softmax_cuda.cu", "masked_softmax.h", "attention_cuda.h", "ops.h",
                                 "philox.h"),
                                ("fwd", "bwd", "warp_items"))


def _emu_launchers(emu):
    def fwd(scores, mask, scale, causal, p, rng):
        out, probs = emu.fwd(scores, mask, scale, causal, p, rng)
        return out, probs

    return fwd, emu.bwd


# B, H, Lq, Lk, dtype, mask kind, dropout, scores layout; the warp kernels hold 4..32 values per
# lane (Lk <= 1024), longer rows take the block kernels.
_EMU_CASES = [
    (2, 2, 5, 7, torch.float32, "bool_b1+causal", 0.2, "contig"),       # warp, 4 per lane
    (1, 3, 6, 127, torch.float16, "float_2d", 0.0, "misaligned"),       # warp, 4, scalar loads
    (2, 1, 5, 256, torch.float16, "bool_keys", 0.0, "aligned"),         # warp, 8: 16-byte groups, strided
    (1, 2, 3, 300, torch.float32, "float32_b1+causal", 0.3, "padded"),  # warp, 16, odd strides
    (1, 2, 5, 1000, torch.bfloat16, "bool_rows", 0.25, "contig"),       # warp, 32, stride-0 mask
    (1, 2, 3, 1100, torch.float32, "dead", 0.25, "aligned"),            # block, dead rows
    (1, 1, 3, 4097, torch.bfloat16, "float_2d+causal", 0.0, "contig"),  # block, causal, odd length
    (1, 2, 2, 2050, torch.float16, "none", 0.1, "misaligned"),          # block, scalar loads
]


def _emu_id(case):
    B, H, Lq, Lk, dtype, kind, p, layout = case
    return f"{B}x{H}x{Lq}x{Lk}-{dt_id(dtype)}-{kind}-p{p}-{layout}"


@pytest.mark.parametrize("case", _EMU_CASES, ids=_emu_id)
def test_cuda_kernels_emulated(cuda_emulation, case):
    B, H, Lq, Lk, dtype, kind, p, layout = case
    items = cuda_emulation.warp_items(Lk)
    assert (items == 0) == (Lk > 1024) and (items == 0 or items * 32 >= Lk)
    g = generator()
    scores = randn(B, H, Lq, Lk, dtype=dtype, g=g, scale=2.0)
    dead = None
    if kind == "dead":
        mask, causal = bool_mask((B, H, Lq, Lk), g), False
        mask[0, 1, 1] = False
        mask[0, 0, 2] = False
        dead = ~mask.any(-1)
    else:
        mask, causal = _mask(kind, B, H, Lq, Lk, dtype, g, "cpu")
    rng = _rng("cpu") if p > 0 else None
    launchers = _emu_launchers(cuda_emulation)
    _oracle(scores, mask, scale=0.7, causal=causal, p=p, rng=rng, layout=layout, launchers=launchers,
            context="emulated cuda")
    # the same bits of dropout, and zeros on dead rows, as the C++ cpu kernels
    dout = randn(B, H, Lq, Lk, dtype=dtype, g=g)
    s = _layout(scores, layout)
    out, probs, ds = _run(s, mask, scale=0.7, causal=causal, p=p, rng=rng, dout=dout, launchers=launchers)
    out_c, probs_c, ds_c = _run(s, mask, scale=0.7, causal=causal, p=p, rng=rng, dout=dout)
    if p > 0:  # dropped entries exactly 0; kept ones nonzero wherever their probability is
        keep = philox.dropout_keep_mask(rng, (B, H, Lq, Lk), p)
        assert (out[~keep] == 0).all() and (out[keep & (probs != 0)] != 0).all()
        # probs are saved before dropout: not all zero at the dropped entries when the C++ cpu
        # kernel's are not (a small causal case can drop only masked entries, ~0.1% of draws).
        assert (probs[~keep] != 0).any() or not (probs_c[~keep] != 0).any()
    if dead is not None:
        assert (out[dead] == 0).all() and (ds[dead] == 0).all() and torch.isfinite(ds).all()
    tol = reference.ATOL[dtype] * 4
    torch.testing.assert_close(out.float(), out_c.float(), atol=tol, rtol=0)
    torch.testing.assert_close(ds.float(), ds_c.float(), atol=tol * 4, rtol=1e-2)


def test_cuda_emulated_nan_inf_and_errors(cuda_emulation):
    """NaN / +inf rows, both kernels; the shared argument checks run in the emulated host code."""
    fwd, bwd = _emu_launchers(cuda_emulation)
    for lk in (9, 1500):
        scores = randn(1, 2, 3, lk)
        scores[0, 0, 1, 1] = float("nan")
        scores[0, 1, 2, 2] = float("inf")
        scores[0, 1, 0, 5] = float("nan")  # removed by causal
        out, _ = fwd(scores, None, 1.0, True, 0.0, None)
        ref = reference.masked_softmax(scores.double(), None, 1.0, True)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(out[0, 1, 2]).all()
        assert not torch.isnan(out[0, 1, 0]).any()
        finite = ~torch.isnan(ref)
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=1e-6, rtol=0)
    s = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="mask must have shape"):
        fwd(s, torch.ones(4, 5, dtype=torch.bool), 1.0, False, 0.0, None)
    with pytest.raises(ValueError, match="rng"):
        fwd(s, None, 1.0, False, 0.5, None)
    with pytest.raises(ValueError, match="dout must have shape"):
        bwd(s[:, :, :2], s, 1.0, 0.0, None)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", [1, 33, 65, 129, 513, 1024, 1025, 8193])
def test_cuda_kernels_emulated_grid(cuda_emulation, lk, dtype):
    """Every register bucket edge and the block kernel, every dtype (slow: ~0.5-3 s each)."""
    g = generator()
    scores = randn(1, 2, 4, lk, dtype=dtype, g=g, scale=2.0)
    mask, causal = _mask("bool_b1+causal", 1, 2, 4, lk, dtype, g, "cpu")
    _oracle(scores, mask, scale=0.4, causal=causal, p=0.15, rng=_rng("cpu"), layout="padded",
            launchers=_emu_launchers(cuda_emulation), context="emulated cuda")
    _oracle(scores, launchers=_emu_launchers(cuda_emulation), context="emulated cuda")


# ---------------------------------------------------------------------------------------------
# Slow: bigger shapes, very long rows (cpu / cuda backends)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", [65536, 70001])
def test_very_long_rows(device, lk, dtype):
    g = generator()
    scores = randn(1, 2, 2, lk, dtype=dtype, g=g, scale=2.0).to(device)
    _oracle(scores, bool_mask((2, lk), g, keep_prob=0.95).to(device), scale=0.2, p=0.1, rng=_rng(device),
            layout="padded", launchers=_cxx_launchers())
    _oracle(scores, float_mask((1, 2, 2, lk), dtype, g, inf_prob=0.1).to(device), causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("lk", [2, 64, 200, 1024, 2048, 5000, 16384])
@pytest.mark.parametrize("kind", ["bool_b1+causal", "float_2d+causal", "bool_keys", "float32_b1"])
def test_grid_slow(device, kind, lk, dtype):
    B, H, Lq = 2, 2, 9
    g = generator()
    scores = randn(B, H, Lq, lk, dtype=dtype, g=g, scale=2.0).to(device)
    mask, causal = _mask(kind, B, H, Lq, lk, dtype, g, device)
    _oracle(scores, mask, scale=0.4, causal=causal, p=0.15, rng=_rng(device), layout="padded",
            launchers=_cxx_launchers(), context=kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
def test_backward_of_a_constant_upstream_gradient_is_zero(device, dtype):
    """A softmax row sums to 1, so an upstream gradient that is the same along the row has
    gradient 0.  The saved probabilities, rounded, sum to 1 +- a few ulps: the backward takes
    delta over their own sum, which keeps that 0, where sum(p * dy) alone left p * c * (1 - sum p)
    in every element (the cpu attention's in-memory path with dropout missed the oracle by up to
    8x from it on peaked rows: benchmarks/NOTES.md, "The in-memory attention's delta over the
    probabilities' sum").  Masked entries and dead rows stay 0."""
    if device != "cpu":
        pytest.skip("the CPU kernel's backward")
    g = generator()
    scores = (torch.randn(2, 3, 5, 300, generator=g) * 8).to(dtype).requires_grad_()
    mask = bool_mask((2, 3, 5, 300), g)
    mask[1, 0, 2] = False  # a dead row
    out = F.masked_softmax(scores, mask, scale=1.3, backend="cpu")
    c = 1000.0
    (grad,) = torch.autograd.grad(out, scores, torch.full_like(out, c))
    assert grad.abs().max().item() <= c * 1e-9, grad.abs().max().item()
    # against sum(p * dy) alone: its error is visible at this c (a check that can fail)
    p = out.detach().double()
    unnormalised = p * (c - (p * c).sum(-1, keepdim=True))
    assert unnormalised.abs().max().item() > c * 1e-9
