"""Triton kernels (kernels/) tested directly at the launcher level, through TRITON_INTERPRET=1.

Covers kernels/philox.py (bit-exact with transformer_fast.philox) and kernels/layer_norm.py
(fused add + dropout + LayerNorm forward/backward launchers) against the float64 oracle of
DESIGN section 6.  The end-to-end op/autograd tests live in tests/test_add_layer_norm.py.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports transformer_fast.kernels

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from transformer_fast import philox, reference  # noqa: E402
from transformer_fast.kernels import layer_norm as K  # noqa: E402
from transformer_fast.kernels.common import cast_out, is_interpreting  # noqa: E402
from transformer_fast.kernels.philox import dropout_keep, load_rng, philox_word  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_dt = lambda d: str(d).replace("torch.", "")  # noqa: E731


# ---------------------------------------------------------------------------------------------
# Philox


@triton.jit
def _philox_probe_kernel(RNG, IDX, WORDS, KEEP, thr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    idx = tl.load(IDX + offs, mask=m, other=0)
    seed_lo, seed_hi, off_lo, off_hi = load_rng(RNG)
    word = philox_word(seed_lo, seed_hi, idx, off_lo, off_hi)
    tl.store(WORDS + offs, word.to(tl.int64), mask=m)
    keep = dropout_keep(seed_lo, seed_hi, idx, off_lo, off_hi, thr)
    tl.store(KEEP + offs, keep.to(tl.int8), mask=m)


SEEDS_OFFSETS = [
    (0, 0),
    (1, 0),
    (12345, 678),
    (2**32 - 1, 2**32 - 1),  # all low bits
    (2**32, 2**32),  # high word only
    (2**63 - 1, 2**40 + 5),
    (-1, -2),  # negative int64: all high bits set (seed & (2**64 - 1) in Python)
    (-(2**62) + 17, 2**33 + 3),
]


@pytest.mark.parametrize("seed,offset", SEEDS_OFFSETS)
def test_philox_word_matches_python(seed, offset):
    idx = torch.cat(
        [
            torch.arange(257, dtype=torch.int64),
            torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 11]),
        ]
    ).to(DEVICE)
    rng = torch.tensor([seed, offset], dtype=torch.int64, device=DEVICE)
    expect = philox.philox_words(seed, offset, idx.cpu().numpy().astype(np.uint64))
    for p in (0.0, 0.1, 0.5, 0.9, 1.0 - 2**-33):
        thr = philox.dropout_threshold(p)
        words = torch.empty_like(idx)
        keep = torch.empty(idx.shape, dtype=torch.int8, device=DEVICE)
        _philox_probe_kernel[(triton.cdiv(idx.numel(), 128),)](rng, idx, words, keep, thr, idx.numel(), BLOCK=128)
        got = words.cpu().numpy().astype(np.uint64)
        assert (got == expect).all(), f"seed={seed} offset={offset}: first mismatch at {np.argmax(got != expect)}"
        assert (keep.cpu().numpy().astype(bool) == (expect >= np.uint64(thr))).all(), f"p={p}"


def test_philox_word_known_value():
    # Random123's published known-answer vector for philox4x32-10, counter and key all zero: the
    # words of elements 0..3 (block 0), in order.
    idx = torch.arange(4, dtype=torch.int64, device=DEVICE)
    words = torch.empty_like(idx)
    keep = torch.empty(4, dtype=torch.int8, device=DEVICE)
    rng = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    _philox_probe_kernel[(1,)](rng, idx, words, keep, 0, 4, BLOCK=4)
    assert [int(w) for w in words.cpu()] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


# ---------------------------------------------------------------------------------------------
# Rounding of stored outputs


@triton.jit
def _cast_probe_kernel(X, Y, n, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m, other=0.0)
    tl.store(Y + offs, cast_out(x, Y.dtype.element_ty, INTERPRET), mask=m)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_dt)
def test_cast_out_rounds_to_nearest_even(dtype):
    """Stored half outputs round like torch's .to() (the interpreter's own bf16 cast truncates)."""
    x = torch.randn(4000, dtype=torch.float64).float() * 10.0
    specials = torch.tensor(
        [1.9999999, 1.00390625, 1.01171875, -1.00390625, 255.99, 0.0, -0.0, 1e-30, 3.0e38, float("inf"), -float("inf")]
    )
    x = torch.cat([x, specials]).to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    _cast_probe_kernel[(triton.cdiv(x.numel(), 512),)](x, y, x.numel(), INTERPRET=is_interpreting(), BLOCK=512)
    assert torch.equal(y, x.to(dtype))


# ---------------------------------------------------------------------------------------------
# add_layer_norm launchers: helpers


class _AddLayerNorm(torch.autograd.Function):
    """Autograd over the two launchers, so reference.run_oracle can check gradients."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, dropout_p, rng, prenorm):
        y, h, mean, rstd = K.add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, rng, prenorm)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        assert mean.shape == (x.shape[0],) and mean.dtype == torch.float32
        assert rstd.shape == (x.shape[0],) and rstd.dtype == torch.float32
        if prenorm:
            assert h.shape == x.shape and h.dtype == x.dtype and h.is_contiguous()
        else:
            assert h.shape == (0,)
        ctx.save_for_backward(x, residual, weight, bias, mean, rstd, rng)
        ctx.dropout_p = dropout_p
        ctx.prenorm = prenorm
        return (y, h) if prenorm else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, residual, weight, bias, mean, rstd, rng = ctx.saved_tensors
        dx, dres, dw, db = K.add_layer_norm_bwd(
            dy, dh if ctx.prenorm else None, x, residual, weight, bias, mean, rstd, ctx.dropout_p, rng
        )
        assert dres.shape == x.shape and dres.dtype == x.dtype
        if ctx.dropout_p > 0:
            assert dx.shape == x.shape and dx.dtype == x.dtype
        else:
            assert dx.shape == (0,)
            dx = dres
        if weight is None:
            assert dw.shape == (0,)
            dw = None
        else:
            assert dw.shape == weight.shape and dw.dtype == weight.dtype
        if bias is None:
            assert db.shape == (0,)
            db = None
        else:
            assert db.shape == bias.shape and db.dtype == bias.dtype
        return dx, dres, dw, db, None, None, None, None


def _draw(m, n, dtype, *, weight=True, bias=True, generator=None):
    g = generator or torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    draw = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    x = (draw(m, n) * 2.0).to(dtype).to(DEVICE)
    res = (draw(m, n) + 0.5).to(dtype).to(DEVICE)
    w = (1.0 + 0.5 * draw(n)).to(dtype).to(DEVICE) if weight else None
    b = draw(n).to(dtype).to(DEVICE) if bias else None
    return x, res, w, b


def _strided(t, pad):
    """Same values, row stride N + pad (a differentiable view, unit column stride)."""
    if pad == 0:
        return t
    return torch.nn.functional.pad(t, (0, pad), value=float("nan"))[:, : t.shape[1]]


def _oracle(x, res, w, b, *, eps=1e-5, p=0.0, prenorm=False, pad=0, rng_values=(1234567, 89)):
    m, n = x.shape
    rng = torch.tensor(rng_values, dtype=torch.int64, device=DEVICE) if p > 0 else None
    keep = philox.dropout_keep_mask(rng, (m, n), p) if p > 0 else None

    def kernel(x, residual, weight=None, bias=None):
        xs, rs = _strided(x, pad), _strided(residual, pad)
        if pad:
            assert xs.stride(0) == n + pad and rs.stride(0) == n + pad
        return _AddLayerNorm.apply(xs, rs, weight, bias, eps, p, rng, prenorm)

    def ref(x, residual, weight=None, bias=None):
        return reference.add_layer_norm(x, residual, weight, bias, eps, p, prenorm, keep=keep)

    inputs = {"x": x, "residual": res}
    if w is not None:
        inputs["weight"] = w
    if b is not None:
        inputs["bias"] = b
    results = reference.run_oracle(kernel, ref, inputs, list(inputs))
    reference.assert_oracle(
        results, f"{(m, n)} {x.dtype} w={w is not None} b={b is not None} p={p} prenorm={prenorm} pad={pad}"
    )


# Rows per size: several row blocks (ragged last block) while the interpreter stays fast.
ROWS = {1: 300, 7: 300, 127: 70, 512: 19, 768: 11, 1000: 9, 4096: 3, 8192: 2, 65536: 1}


# ---------------------------------------------------------------------------------------------
# add_layer_norm: oracle over the size x dtype grid (fused and looped paths)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("n", list(ROWS))
def test_add_layer_norm_oracle_sizes(n, dtype):
    """Every size and dtype, twice: (weight+bias, prenorm, dropout 0.25, strided rows) and
    (no affine or one of weight/bias, post-LN, no dropout, contiguous)."""
    m = ROWS[n]
    x, res, w, b = _draw(m, n, dtype)
    _oracle(x, res, w, b, p=0.25, prenorm=True, pad=3)
    variant = list(ROWS).index(n) % 3
    x, res, w, b = _draw(m, n, dtype, weight=variant != 1, bias=variant != 2)
    if variant == 0:
        w = b = None
    _oracle(x, res, w, b, p=0.0, prenorm=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("affine", ["both", "none", "weight", "bias"])
@pytest.mark.parametrize("prenorm", [False, True], ids=["postln", "prenorm"])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_add_layer_norm_oracle_flags(dtype, affine, prenorm, p):
    x, res, w, b = _draw(21, 127, dtype, weight=affine in ("both", "weight"), bias=affine in ("both", "bias"))
    _oracle(x, res, w, b, p=p, prenorm=prenorm, pad=5 if prenorm else 0)


@pytest.fixture
def small_loop(monkeypatch):
    """Force the looped (multi-pass) path at small N, and few persistent backward groups."""
    monkeypatch.setattr(K, "FWD_MAX_FUSED", 128)
    monkeypatch.setattr(K, "BWD_MAX_FUSED", 128)
    monkeypatch.setattr(K, "LOOP_BLOCK", 128)
    monkeypatch.setattr(K, "_num_sms", lambda device: 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("n", [129, 300])
def test_add_layer_norm_oracle_looped_path(small_loop, n, dtype):
    """N > the fused limit: chunked Welford statistics + a 2-D (chunks x rows) grid, with a
    ragged last chunk; backward groups that loop over several rows each."""
    x, res, w, b = _draw(9, n, dtype)
    _oracle(x, res, w, b, p=0.25, prenorm=True, pad=2)
    _oracle(x, res, None, b, p=0.0, prenorm=False)


def test_add_layer_norm_oracle_persistent_groups(monkeypatch):
    """Fused backward with fewer groups than row blocks: each program loops over row blocks."""
    monkeypatch.setattr(K, "_num_sms", lambda device: 1)
    x, res, w, b = _draw(300, 127, torch.float32)  # BLOCK_M 32 -> 10 row blocks, 4 groups
    _oracle(x, res, w, b, p=0.25, prenorm=True)


def test_add_layer_norm_large_mean_offset():
    """Rows with |mean| >> std: the statistics must not cancel catastrophically (fused and
    looped paths agree with float64)."""
    for n in (1000, 20000):
        x, res, w, b = _draw(2, n, torch.float32)
        res = res + 1000.0
        _oracle(x, res, w, b)


def test_add_layer_norm_high_bit_rng():
    x, res, w, b = _draw(5, 1000, torch.float32)
    _oracle(x, res, w, b, p=0.25, rng_values=(-(2**62) + 12345, 2**40 + 7))


# ---------------------------------------------------------------------------------------------
# Dropout behaviour


def _dropout_masks(m, n, p, rng, dtype=torch.float32):
    """(forward keep mask from h, backward keep mask from dx) for x = 1, residual = 0."""
    x = torch.ones(m, n, dtype=dtype, device=DEVICE)
    res = torch.zeros_like(x)
    with reference.poisoned_outputs():
        y, h, mean, rstd = K.add_layer_norm_fwd(x, res, None, None, 1e-5, p, rng, True)
        # dy = 0, dh = 1: dresidual == 1 exactly, dx == keep / (1 - p).
        dx, dres, _, _ = K.add_layer_norm_bwd(
            torch.zeros_like(x), torch.ones_like(x), x, res, None, None, mean, rstd, p, rng
        )
    assert torch.equal(dres, torch.ones_like(dres))
    scale = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
    fwd_keep, bwd_keep = h != 0, dx != 0
    assert torch.equal(h[fwd_keep].cpu(), scale.expand(int(fwd_keep.sum())))
    assert torch.equal(dx[bwd_keep].cpu(), scale.expand(int(bwd_keep.sum())))
    return fwd_keep, bwd_keep


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_exact_mask(p):
    m, n = 64, 1000
    rng = torch.tensor([987654321, 42], dtype=torch.int64, device=DEVICE)
    fwd_keep, bwd_keep = _dropout_masks(m, n, p, rng)
    expect = philox.dropout_keep_mask(rng, (m, n), p)
    assert torch.equal(fwd_keep, expect)
    assert torch.equal(bwd_keep, expect)
    frac = fwd_keep.double().mean().item()
    sigma = (p * (1 - p) / (m * n)) ** 0.5
    assert abs(frac - (1 - p)) < 5 * sigma, (frac, 1 - p)


@pytest.mark.parametrize("n", [1000, 300], ids=["fused", "looped"])
def test_backward_regenerates_forward_mask(n, request):
    """Fused and looped paths; another rng gives another mask."""
    if n == 300:
        request.getfixturevalue("small_loop")
    rng = torch.tensor([2**40 + 3, 2**33 + 1], dtype=torch.int64, device=DEVICE)
    fwd_keep, bwd_keep = _dropout_masks(3, n, 0.3, rng, dtype=torch.bfloat16)
    assert torch.equal(fwd_keep, bwd_keep)
    assert torch.equal(fwd_keep, philox.dropout_keep_mask(rng, (3, n), 0.3))
    other, _ = _dropout_masks(3, n, 0.3, rng + torch.tensor([0, 1], device=DEVICE), dtype=torch.bfloat16)
    assert not torch.equal(fwd_keep, other)


# ---------------------------------------------------------------------------------------------
# Layout, determinism, parameter dtypes, empty inputs


@pytest.mark.parametrize("n", [512, 300], ids=["fused", "looped"])
def test_strided_rows_match_contiguous_bitwise(n, request):
    """Arbitrary row strides for x, residual, dy and dh: identical bits to contiguous inputs."""
    if n == 300:
        request.getfixturevalue("small_loop")
    m, p = 3, 0.2
    rng = torch.tensor([5, 6], dtype=torch.int64, device=DEVICE)
    x, res, w, b = _draw(m, n, torch.float16)
    dy, dh = _draw(m, n, torch.float16)[:2]
    with reference.poisoned_outputs():
        out_c = K.add_layer_norm_fwd(x, res, w, b, 1e-5, p, rng, True)
        out_s = K.add_layer_norm_fwd(_strided(x, 8), _strided(res, 3), w, b, 1e-5, p, rng, True)
        g_c = K.add_layer_norm_bwd(dy, dh, x, res, w, b, out_c[2], out_c[3], p, rng)
        g_s = K.add_layer_norm_bwd(
            _strided(dy, 5), _strided(dh, 1), _strided(x, 8), _strided(res, 3), w, b, out_c[2], out_c[3], p, rng
        )
    for a, s in zip(out_c + g_c, out_s + g_s):
        assert torch.equal(a, s)


@pytest.mark.parametrize("n,m", [(768, 37), (300, 5)], ids=["fused", "looped"])
def test_backward_is_deterministic(n, m, request):
    if n == 300:
        request.getfixturevalue("small_loop")
    x, res, w, b = _draw(m, n, torch.bfloat16)
    dy = _draw(m, n, torch.bfloat16)[0]
    rng = torch.tensor([11, 12], dtype=torch.int64, device=DEVICE)
    _, _, mean, rstd = K.add_layer_norm_fwd(x, res, w, b, 1e-5, 0.1, rng, False)
    first = K.add_layer_norm_bwd(dy, None, x, res, w, b, mean, rstd, 0.1, rng)
    second = K.add_layer_norm_bwd(dy, None, x, res, w, b, mean, rstd, 0.1, rng)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_dt)
def test_float32_params_with_half_inputs(dtype):
    """fp32 weight/bias holding the same values as half ones give the same bits (the kernels
    compute in fp32 either way); dweight/dbias come back in the parameters' dtype."""
    m, n = 7, 1000
    x, res, w, b = _draw(m, n, dtype)
    dy = _draw(m, n, dtype)[0]
    w32, b32 = w.float(), b.float()
    y16, _, mean, rstd = K.add_layer_norm_fwd(x, res, w, b, 1e-5, 0.0, None, False)
    y32, _, mean32, rstd32 = K.add_layer_norm_fwd(x, res, w32, b32, 1e-5, 0.0, None, False)
    assert torch.equal(y16, y32) and torch.equal(mean, mean32) and torch.equal(rstd, rstd32)
    _, dres16, dw16, db16 = K.add_layer_norm_bwd(dy, None, x, res, w, b, mean, rstd, 0.0, None)
    _, dres32, dw32, db32 = K.add_layer_norm_bwd(dy, None, x, res, w32, b32, mean, rstd, 0.0, None)
    assert dw16.dtype == dtype and dw32.dtype == torch.float32 and db32.dtype == torch.float32
    assert torch.equal(dres16, dres32)
    assert torch.equal(dw16, dw32.to(dtype)) and torch.equal(db16, db32.to(dtype))


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_empty_rows(prenorm, p):
    n = 64
    x = torch.empty(0, n, device=DEVICE)
    w, b = torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    rng = torch.tensor([1, 2], dtype=torch.int64, device=DEVICE) if p else None
    y, h, mean, rstd = K.add_layer_norm_fwd(x, x, w, b, 1e-5, p, rng, prenorm)
    assert y.shape == (0, n) and mean.shape == (0,) and rstd.shape == (0,)
    assert h.shape == ((0, n) if prenorm else (0,))
    dx, dres, dw, db = K.add_layer_norm_bwd(x, x if prenorm else None, x, x, w, b, mean, rstd, p, rng)
    assert dres.shape == (0, n) and dx.shape == ((0, n) if p else (0,))
    assert torch.equal(dw, torch.zeros(n, device=DEVICE)) and torch.equal(db, torch.zeros(n, device=DEVICE))


def test_bad_inputs():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        K.add_layer_norm_fwd(x, torch.randn(4, 9, device=DEVICE), None, None, 1e-5, 0.0, None, False)
    with pytest.raises(ValueError, match="weight"):
        K.add_layer_norm_fwd(x, x, torch.ones(7, device=DEVICE), None, 1e-5, 0.0, None, False)
    with pytest.raises(ValueError, match="rng"):
        K.add_layer_norm_fwd(x, x, None, None, 1e-5, 0.5, None, False)
    with pytest.raises(TypeError, match="residual"):
        K.add_layer_norm_fwd(x, x.double(), None, None, 1e-5, 0.0, None, False)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation for a GPU (no GPU needed): catches what the interpreter accepts but
# Triton's compiler rejects.


def test_kernels_compile_for_sm90():
    import subprocess
    import sys

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no bundled ptxas")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        # every layer-norm configuration for bf16; all kernels (quick): tests/test_triton_compile.py
        [sys.executable, "-m", "transformer_fast.kernels.compile_check", "--arch", "90", "--dtypes", "bf16",
         "--kernels", "layer_norm"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failed" in proc.stdout


# ---------------------------------------------------------------------------------------------
# TRANSFORMER_FAST_AUTOTUNE=0: the first config each autotune list keeps (gpu_suite.sh's numerics
# steps); the pruning functions are plain Python, so they are checked here without a GPU.


@pytest.mark.parametrize("tune", ["1", "0"])
def test_autotune_switch_keeps_the_preferred_config(monkeypatch, tune):
    from transformer_fast.kernels import attention as A
    from transformer_fast.kernels import ffn as FF

    monkeypatch.setenv("TRANSFORMER_FAST_AUTOTUNE", tune)
    q16 = torch.empty(1, dtype=torch.bfloat16)
    kept = A._prune_fwd(A.FWD_TUNE_CONFIGS, {"Q": q16}, BLOCK_D=128, LQ_KEY=4096)
    assert [A._key(c) for c in kept] == (A._FWD_CONFIGS[128] if tune == "1" else A._FWD_CONFIGS[128][:1])
    kept = A._prune_dq(A.DQ_TUNE_CONFIGS, {"Q": torch.empty(1)}, BLOCK_D=64, LQ_KEY=512)  # fp32
    assert [A._key(c) for c in kept] == (A._FP32_CONFIGS["dq"] if tune == "1" else A._FP32_CONFIGS["dq"][:1])

    cfg = lambda bm, bn, bk: triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                           num_warps=8, num_stages=3)
    gemm = [cfg(128, 256, 64), cfg(128, 128, 64), cfg(64, 64, 64)]
    kept = FF._prune_configs(gemm, {"M": 4096, "N": 4096, "A": q16})
    assert kept == (gemm if tune == "1" else gemm[:1])


# The first config AUTOTUNE=0 keeps for exact fp32 and what it compiled to (Triton 3.8, sm_90,
# compile_check --resources, no mask / float mask + padding + dropout): no register spills.  The
# common fp32 list's first ones spilled there (dk/dv at BLOCK_D 128 288 / 496 bytes and 2112 at
# 256, dq at 256 512).
_EXACT_FP32_FIRST = {("fwd", 256): (64, 32, 8, 2), ("dq", 128): (64, 32, 8, 2), ("dq", 256): (16, 32, 8, 2),
                     ("dkdv", 128): (32, 16, 8, 2), ("dkdv", 256): (32, 16, 8, 2)}


@pytest.mark.parametrize("block_d", [128, 256])
def test_exact_fp32_keeps_spill_free_configs_first(monkeypatch, block_d):
    from transformer_fast.kernels import attention as A

    monkeypatch.setenv("TRANSFORMER_FAST_AUTOTUNE", "0")
    prunes = {"fwd": (A._prune_fwd, A.FWD_TUNE_CONFIGS), "dq": (A._prune_dq, A.DQ_TUNE_CONFIGS),
              "dkdv": (A._prune_dkdv, A.DKDV_TUNE_CONFIGS)}
    for (kind, bd), want in _EXACT_FP32_FIRST.items():
        if bd != block_d:
            continue
        prune, configs = prunes[kind]
        for masked in (0, 2):
            args = dict(BLOCK_D=block_d, LQ_KEY=1024, LK_KEY=1024, MASK_KIND=masked, HAS_DROPOUT=masked)
            kept = prune(configs, {"Q": torch.empty(1)}, PRECISE=True, **args)
            assert [A._key(c) for c in kept] == [want], (kind, masked)
            # tf32 keeps the common list
            kept = prune(configs, {"Q": torch.empty(1)}, PRECISE=False, **args)
            assert A._key(kept[0]) in A._FP32_CONFIGS[kind]
