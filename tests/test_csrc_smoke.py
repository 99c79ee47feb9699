"""Smoke tests of the C++ extension's add_layer_norm ops (csrc/), called directly through
torch.ops.transformer_fast_C, against the float64 oracle (DESIGN section 6).

CPU everywhere; the same checks run on CUDA (marked gpu) when a GPU is present.
"""
import itertools

import pytest
import torch

from transformer_fast import philox, reference

_C = pytest.importorskip("transformer_fast._C")
ops = torch.ops.transformer_fast_C

ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()


def _reference(x, r, w, b, eps, p, keep, prenorm, dy, dh, dtype):
    """(y, h, dx, dres, dw, db) of reference.add_layer_norm computed in `dtype` by autograd."""
    x, r = x.detach().to(dtype).requires_grad_(), r.detach().to(dtype).requires_grad_()
    w = None if w is None else w.detach().to(dtype if w.dtype != torch.float32 else torch.float64 if dtype == torch.float64 else w.dtype).requires_grad_()
    b = None if b is None else b.detach().to(dtype if b.dtype != torch.float32 else torch.float64 if dtype == torch.float64 else b.dtype).requires_grad_()
    out = reference.add_layer_norm(x, r, w, b, eps, p, prenorm, keep)
    y, h = out if prenorm else (out, None)
    outs, grads = [y], [dy.to(y.dtype)]
    if prenorm and dh is not None:
        outs.append(h)
        grads.append(dh.to(h.dtype))
    torch.autograd.backward(outs, grads)
    return y, h, x.grad, r.grad, None if w is None else w.grad, None if b is None else b.grad


def _check(name, out, ref_lp, ref64, dtype):
    out64 = out.double()
    err = (out64 - ref64).abs().max().item() if out.numel() else 0.0
    bound = 2 * ((ref_lp.double() - ref64).abs().max().item() if out.numel() else 0.0) + ATOL[dtype]
    assert err <= bound, f"{name}: max err {err:.3g} > bound {bound:.3g}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"


def _run_case(device, dtype, M, N, affine, param_dtype, p, prenorm, strided, with_dh=True):
    gen = torch.Generator().manual_seed(1000 * N + M)
    pad = 5 if strided else 0

    def rows():
        big = torch.randn(M, N + pad, generator=gen).to(dtype).to(device)
        return big[:, :N] if strided else big

    x, r, dy = rows(), rows(), rows()
    dh = rows() if (prenorm and with_dh) else None
    pdt = dtype if param_dtype == "x" else torch.float32
    w = (1 + 0.5 * torch.randn(N, generator=gen)).to(pdt).to(device) if affine in ("w", "wb") else None
    b = (0.5 * torch.randn(N, generator=gen)).to(pdt).to(device) if affine in ("b", "wb") else None
    rng = torch.tensor([0x1234_5678_9ABC_DEF0 - 2**63, 7 + N], dtype=torch.int64, device=device) if p > 0 else None
    eps = 1e-5

    y, h, mean, rstd = ops.add_layer_norm_fwd(x, r, w, b, eps, p, rng, prenorm)
    assert y.shape == (M, N) and y.dtype == dtype and y.is_contiguous()
    assert mean.shape == (M,) and rstd.shape == (M,) and mean.dtype == torch.float32
    assert h.shape == ((M, N) if prenorm else (0,))
    keep = philox.dropout_keep_mask(rng, (M, N), p).to(device) if p > 0 else None

    dx, dres, dw, db = ops.add_layer_norm_bwd(dy, dh, x, r, w, b, mean, rstd, p, rng)
    assert dres.shape == (M, N) and dres.dtype == dtype
    assert dx.shape == ((M, N) if p > 0 else (0,))
    assert dw.shape == ((N,) if w is not None else (0,))
    assert db.shape == ((N,) if b is not None else (0,))
    if w is not None:
        assert dw.dtype == w.dtype
    if b is not None:
        assert db.dtype == b.dtype

    ref64 = _reference(x, r, w, b, eps, p, keep, prenorm, dy, dh, torch.float64)
    reflp = _reference(x, r, w, b, eps, p, keep, prenorm, dy, dh, dtype)
    _check("y", y, reflp[0], ref64[0], dtype)
    if prenorm:
        _check("h", h, reflp[1], ref64[1], dtype)
    if p > 0:
        _check("dx", dx, reflp[2], ref64[2], dtype)
    _check("dresidual", dres, reflp[3], ref64[3], dtype)
    if w is not None:
        _check("dweight", dw, reflp[4], ref64[4], dtype)
    if b is not None:
        _check("dbias", db, reflp[5], ref64[5], dtype)
    # statistics against float64
    s = (r.double() + (x.double() * keep / (1 - p) if p > 0 else x.double()))
    torch.testing.assert_close(mean.double(), s.mean(-1), atol=1e-5 * max(1.0, s.abs().max().item()), rtol=1e-5)
    if p > 0:
        # dropped elements of x get exactly zero gradient
        assert (dx[~keep] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 7, 127, 512, 768, 1000, 4096, 8192, 65536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_add_layer_norm_grid(device, N, dtype):
    M = 3 if N >= 65536 else 9
    cases = [
        # affine, param dtype, p, prenorm, strided
        ("wb", "x", 0.0, False, False),
        ("wb", "fp32", 0.3, True, True),
        ("w", "x", 0.3, False, False),
        ("b", "fp32", 0.0, True, False),
        ("none", "x", 0.0, False, True),
    ]
    for affine, pdt, p, prenorm, strided in cases:
        _run_case(device, dtype, M, N, affine, pdt, p, prenorm, strided)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_shapes_and_prenorm_without_dh(device):
    _run_case(device, torch.float32, 1, 33, "wb", "x", 0.1, True, False, with_dh=False)
    _run_case(device, torch.bfloat16, 257, 64, "wb", "x", 0.5, True, True)
    x = torch.empty(0, 16, device=device)
    y, h, mean, rstd = ops.add_layer_norm_fwd(x, x, None, None, 1e-5, 0.0, None, False)
    assert y.shape == (0, 16) and mean.shape == (0,) and h.shape == (0,)
    w = torch.ones(16, device=device)
    dx, dres, dw, db = ops.add_layer_norm_bwd(x, None, x, x, w, w, mean, rstd, 0.0, None)
    assert dres.shape == (0, 16) and (dw == 0).all() and (db == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_layer_norm_fwd(x, torch.randn(4, 9, device=device), None, None, 1e-5, 0.0, None, False)
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_layer_norm_fwd(x, x, torch.ones(7, device=device), None, 1e-5, 0.0, None, False)
    with pytest.raises(RuntimeError, match="rng"):
        ops.add_layer_norm_fwd(x, x, None, None, 1e-5, 0.1, None, False)
    with pytest.raises(RuntimeError, match="stride"):
        ops.add_layer_norm_fwd(x.t(), x.t(), None, None, 1e-5, 0.0, None, False)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.add_layer_norm_fwd(x, x.double(), None, None, 1e-5, 0.0, None, False)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.add_layer_norm_fwd(x.double(), x.double(), None, None, 1e-5, 0.0, None, False)


def test_deterministic_backward():
    x, r, dy = (torch.randn(300, 1000) for _ in range(3))
    w, b = torch.randn(1000), torch.randn(1000)
    _, _, mean, rstd = ops.add_layer_norm_fwd(x, r, w, b, 1e-5, 0.0, None, False)
    outs = [ops.add_layer_norm_bwd(dy, None, x, r, w, b, mean, rstd, 0.0, None) for _ in range(3)]
    for o in outs[1:]:
        for a, c in zip(outs[0][1:], o[1:]):
            assert torch.equal(a, c)


# Members of libstdc++ that only a copy of the library itself defines (std::locale::classic(),
# std::ostream::_M_insert<long>): an extension linked with -static-libstdc++ exports them.
_LIBSTDCXX_OWN_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_")


def test_extension_uses_the_shared_libstdcxx():
    """_C must use the libstdc++.so torch uses, not a static copy: on the GPU image whose g++
    wrapper linked libstdc++ statically, every TORCH_CHECK that formatted a shape crashed the
    process (SIGSEGV in ostream code) instead of raising.  setup.py's explicit -lstdc++ prevents
    it; this reads the built library's dynamic symbols to check."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", _C.__file__], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
    copied = [s for s in _LIBSTDCXX_OWN_SYMBOLS if s in defined]
    assert not copied, f"{_C.__file__} carries its own libstdc++ (defines {copied}); link it with -lstdc++"
