"""The Triton FFN launchers (kernels/ffn.py) primitive by primitive, against float64 math.

Under TRITON_INTERPRET=1 on CPU tensors here (conftest), on CUDA when present.  Outputs are
poisoned (NaN-filled) before the kernels write them, so a tile the grouped order misses fails.
Shapes are chosen to leave partial tiles in M, N and K and to take several K steps.
"""
import pytest
import torch
import torch.nn.functional as TF

from transformer_fast import philox, reference

from conftest import require_backend

pytestmark = pytest.mark.triton

ACT64 = {
    "none": lambda h: h,
    "relu": torch.relu,
    "gelu": TF.gelu,
    "gelu_tanh": lambda h: TF.gelu(h, approximate="tanh"),
}
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@pytest.fixture(scope="module")
def K():
    require_backend("triton")
    from transformer_fast.kernels import ffn

    return ffn


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _err(got, want):
    return reference.max_abs_error(got, want)


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).to(_device())


# n % 4 == 0 takes the dropout epilogues' grouped Philox (one block per 4 columns), else one
# block per element; both must give philox.py's mask.
@pytest.mark.parametrize("n", [70, 72])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh"])
def test_linear_fwd(K, dtype, activation, n):
    m, k, p = 77, 150, 0.2  # K = 150: three 64-wide steps, the last partial
    x = _rand(k, m, dtype=dtype).t()  # column-major x: strides (1, m)
    w = _rand(n, k, dtype=dtype, scale=k ** -0.5)
    b = _rand(n, dtype=dtype)
    rng = philox.new_rng(x.device)
    with reference.poisoned_outputs():
        y, pre = K.linear_fwd(x, w, b, activation, p, rng, True, False)
    pre64 = x.double() @ w.double().t() + b.double()
    keep = philox.dropout_keep_mask(rng, (m, n), p)
    y64 = ACT64[activation](pre64) * keep / (1 - p)
    assert _err(pre, pre64) <= TOL[dtype]
    assert _err(y, y64) <= TOL[dtype]


def test_linear_fwd_without_pre_and_bias(K):
    x, w = _rand(33, 17), _rand(65, 17)
    with reference.poisoned_outputs():
        y, pre = K.linear_fwd(x, w, None, "gelu", 0.0, None, False, False)
    assert pre.numel() == 0
    assert _err(y, TF.gelu(x.double() @ w.double().t())) <= 2e-5


@pytest.mark.parametrize("n", [90, 92])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_linear_dgrad_and_act_bwd(K, activation, p, n):
    """d = (dy @ w) * act'(pre) * keep / (1-p) and its column sums, from the GEMM epilogue and
    from the elementwise kernel."""
    m, k = 45, 70
    dy, w = _rand(m, k), _rand(k, n, scale=k ** -0.5)
    pre = _rand(m, n)
    rng = philox.new_rng(dy.device) if p else None
    keep = philox.dropout_keep_mask(rng, (m, n), p) if p else torch.ones(m, n, dtype=torch.bool)
    y = ACT64[activation](pre) * keep.to(pre.device) / (1 - p)  # the forward output (relu's aux)
    pre64 = pre.double().requires_grad_(True)
    (ACT64[activation](pre64) * keep.to(pre.device) / (1 - p)).backward(dy.double() @ w.double())
    want = pre64.grad
    aux = {"none": None, "relu": y, "gelu": pre, "gelu_tanh": pre}[activation]
    with reference.poisoned_outputs():
        d, db = K.linear_dgrad(dy, w, aux, activation, p, rng, True, False)
    assert _err(d, want) <= 2e-5
    assert _err(db, want.sum(0)) <= 1e-4
    # The elementwise twin, from dy @ w computed apart.
    g = (dy.double() @ w.double()).float()
    with reference.poisoned_outputs():
        d2, db2 = K.act_bwd(g, aux, activation, p, rng, True)
    assert _err(d2, want) <= 2e-5
    assert _err(db2, want.sum(0)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_linear_wgrad(K, dtype):
    m, n, k = 130, 37, 70  # reduction over the 130 rows: three 64-wide K steps
    dy = _rand(n, m, dtype=dtype).t()  # non-contiguous
    x = _rand(m, k, dtype=dtype)
    with reference.poisoned_outputs():
        dw, db = K.linear_wgrad(dy, x, True, False)
    assert _err(dw, dy.double().t() @ x.double()) <= TOL[dtype] * 4
    assert _err(db, dy.double().sum(0)) <= TOL[dtype] * 4


def test_grouped_order_writes_every_tile(K):
    """More row tiles than GROUP_M and several column tiles: every element is written once."""
    x, w = _rand(300, 8), _rand(330, 8)
    with reference.poisoned_outputs():
        y, _ = K.linear_fwd(x, w, None, "none", 0.0, None, False, False)
    assert torch.isfinite(y).all()
    assert _err(y, x.double() @ w.double().t()) <= 2e-5


def test_empty_and_degenerate_shapes(K):
    x, w, b = _rand(0, 5), _rand(4, 5), _rand(4)
    y, _ = K.linear_fwd(x, w, b, "relu", 0.0, None, False, False)
    assert y.shape == (0, 4)
    # K = 0: the GEMM is empty, the epilogue still applies bias and activation.
    y, pre = K.linear_fwd(_rand(3, 0), _rand(4, 0), b, "gelu", 0.0, None, True, False)
    assert _err(pre, b.double().expand(3, 4)) == 0.0
    assert _err(y, TF.gelu(b.double()).expand(3, 4)) <= 1e-6
    dw, db = K.linear_wgrad(_rand(0, 4), _rand(0, 5), True, False)
    assert dw.shape == (4, 5) and not dw.any() and not db.any()


def test_bad_arguments(K):
    x, w = _rand(3, 5), _rand(4, 5)
    with pytest.raises(ValueError, match="activation"):
        K.linear_fwd(x, w, None, "tanh", 0.0, None, False, False)
    with pytest.raises(ValueError, match="rng"):
        K.linear_fwd(x, w, None, "relu", 0.1, None, False, False)
    with pytest.raises(ValueError, match="w must have shape"):
        K.linear_fwd(x, _rand(4, 6), None, "relu", 0.0, None, False, False)
    with pytest.raises(TypeError, match="dtype"):
        K.linear_fwd(x, w.double(), None, "relu", 0.0, None, False, False)


def test_gpu_config_pruning(K):
    """The GPU autotune list (built as on a GPU) is pruned to configs that fit shared memory
    and are not far larger than the problem; at least one always survives."""
    from unittest import mock

    with mock.patch.object(K, "is_interpreting", return_value=False):
        configs = K._gemm_configs()
    assert len(configs) > 1
    for m, n, dtype in ((1, 64, torch.bfloat16), (16384, 4096, torch.bfloat16), (1000, 1000, torch.float32),
                        (7, 3, torch.float16)):
        a = torch.empty(1, dtype=dtype)
        kept = K._prune_configs(configs, {"M": m, "N": n, "A": a})
        assert kept
        for c in kept:
            bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            assert (bm * bk + bk * bn) * a.element_size() * c.num_stages <= K._SMEM_BUDGET
        if m >= 4096:
            assert any(c.kwargs["BLOCK_M"] >= 128 for c in kept)
        if m == 1:
            assert all(c.kwargs["BLOCK_M"] <= 32 for c in kept)


# ---------------------------------------------------------------------------------------------
# fp32 precision paths (the first GPU run failed the fp32 oracle here: see kernels/ffn.py's
# _round_tf32 and the compiled IEEE branch of _gemm_kernel)


def _tf32_rna(t):
    """cvt.rna.tf32.f32 on the host: round the magnitude to 10 mantissa bits, ties away."""
    bits = t.float().cpu().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (((bits + 0x1000) >> 13) << 13) & 0xFFFFFFFF
    out = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(t.cpu().isnan(), t.cpu(), out).to(t.device)


def test_tf32_path_rounds_the_operands_to_nearest(K):
    """allow_tf32: the GEMM sees its fp32 operands rounded to the nearest tf32 (not truncated,
    as the tensor core would read them): the result is the exact product of rounded operands."""
    m, k, n = 37, 150, 70
    x, w, b = _rand(m, k), _rand(n, k, scale=k ** -0.5), _rand(n)
    with reference.poisoned_outputs():
        y, pre = K.linear_fwd(x, w, b, "none", 0.0, None, True, True)
    want = _tf32_rna(x).double() @ _tf32_rna(w).double().t() + b.double()
    exact = x.double() @ w.double().t() + b.double()
    assert _err(pre, want) <= 2e-5
    assert _err(y, want) <= 2e-5
    assert _err(pre, exact) > 1e-4  # tf32 did happen (else this test checks nothing)
    trunc = lambda t: (t.float().cpu().view(torch.int32) & ~0x1FFF).view(torch.float32).to(t.device)
    assert _err(pre, trunc(x).double() @ trunc(w).double().t() + b.double()) > 2 * _err(pre, want)


def test_tf32_rounding_edge_values(K):
    """Ties round away from zero, overflow rounds to inf, inf stays, NaN (CUDA's 0x7fffffff
    included) stays NaN; 16-bit and exact-fp32 launches are not rounded."""
    vals = torch.tensor([1.0 + 2**-11, -(1.0 + 2**-11), 1.0 + 2**-11 - 2**-23, 3.4028235e38, float("inf"),
                         -float("inf"), 0.0, -0.0, 1e-40], dtype=torch.float32)
    nan_bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1], dtype=torch.int32).view(torch.float32)
    col = torch.cat([vals, nan_bits]).to(_device())
    x = col[:, None]  # (rows, 1) @ (1, 1) identity: y = round(x) * 1
    w = torch.ones(1, 1, device=col.device)
    y, _ = K.linear_fwd(x, w, None, "none", 0.0, None, False, True)
    got = y[:, 0].cpu()
    want = _tf32_rna(col).cpu()
    assert torch.equal(got[:len(vals)], want[:len(vals)])
    assert got[0] == 1.0 + 2**-10 and got[1] == -(1.0 + 2**-10) and got[2] == 1.0
    assert got[3] == float("inf")
    assert got[len(vals):].isnan().all()
    y, _ = K.linear_fwd(x, w, None, "none", 0.0, None, False, False)  # exact fp32: untouched
    assert torch.equal(y[:len(vals), 0].cpu(), col[:len(vals)].cpu())


def test_compiled_ieee_branch_sums_k_steps_with_compensation(K, monkeypatch):
    """The GPU's exact-fp32 loop (per-step dot from zero + Kahan), run by the interpreter with
    INTERPRET off: dW over 1000 rows (the shape class the first GPU run failed) within the
    oracle's bound against torch's own fp32 matmul."""
    monkeypatch.setattr(K, "is_interpreting", lambda: False)
    m, n, k = 1000, 40, 24
    dy, x = _rand(m, n, scale=0.5), _rand(m, k)
    dw, _ = K.linear_wgrad(dy, x, False, False)
    want = dy.double().t() @ x.double()
    bound = 2 * _err(dy.t() @ x, want) + 1e-6
    assert _err(dw, want) <= bound
    # The compensation itself: 1 + 100 K steps of 2^-25 each (below half an ulp of 1, so a
    # plain fp32 running sum stays at 1.0); exact 1 + 25 * 2^-23 is an fp32 value.
    rows = torch.zeros(64 * 101, 1)
    rows[0] = 1.0
    rows[64::64] = 2.0 ** -25
    dw, _ = K.linear_wgrad(rows.to(_device()), torch.ones(64 * 101, 1, device=_device()), False, False)
    assert dw.item() == 1.0 + 25 * 2.0 ** -23, dw.item()


def test_ieee_configs_fit_registers(K):
    """Compiled exact fp32 keeps only the tiles measured not to spill (8 warps, <= 32
    accumulators per thread); tf32 and 16-bit keep their first configs."""
    from unittest import mock

    with mock.patch.object(K, "is_interpreting", return_value=False):
        configs = K._gemm_configs()
        f32 = torch.empty(1, dtype=torch.float32)
        for m, n in ((1000, 2048), (100, 64), (4096, 4096)):
            kept = K._prune_configs(configs, {"M": m, "N": n, "A": f32}, IEEE=True)
            assert kept
            for c in kept:
                per_thread = c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps)
                assert c.num_warps == K._IEEE_WARPS and per_thread <= K._IEEE_MAX_PER_THREAD, c
        kept = K._prune_configs(configs, {"M": 4096, "N": 4096, "A": f32}, IEEE=False)
        assert (kept[0].kwargs["BLOCK_M"], kept[0].kwargs["BLOCK_N"]) == (128, 128)
        kept = K._prune_configs(configs, {"M": 1, "N": 2048, "A": f32}, IEEE=True)
        assert all(c.kwargs["BLOCK_M"] <= 32 for c in kept)


def test_recent_gemm_launches_names_the_config(K):
    x, w = _rand(9, 8), _rand(12, 8)
    K.linear_fwd(x, w, None, "relu", 0.0, None, False, False)
    last = K.recent_gemm_launches().splitlines()[-1]
    assert "M=9 N=12 K=8 fwd" in last and "ieee" in last and "BLOCK_M=" in last
    assert "pointer:" in last


# ---------------------------------------------------------------------------------------------
# The persistent TMA GEMM (kernels/ffn.py, _gemm_tma_kernel): the path a Hopper GPU takes for
# 16-bit operands TMA can address.  Forced here (TRANSFORMER_FAST_TRITON_GEMM=tma): the
# interpreter runs it with 32 x 64 x 32 tiles on 3 programs, so these shapes (strides multiples
# of 8 elements, partial tiles in M, N and K) take several tiles per program and several K steps.

TMA_M, TMA_K, TMA_N = 72, 88, 136


@pytest.fixture
def tma(K, monkeypatch):
    monkeypatch.setenv(K.GEMM_PATH_ENV, "tma")
    return K


def _last_kernel(K):
    return K.recent_gemm_launches().splitlines()[-1].split(":")[0].split()[-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("x_layout", ["rows", "cols"])
@pytest.mark.parametrize("activation, p", [("none", 0.0), ("relu", 0.2), ("gelu", 0.2), ("gelu_tanh", 0.0)])
def test_tma_linear_fwd(tma, dtype, x_layout, activation, p):
    """x @ w^T + b, activation, dropout: A K-major (x row-major) or M-major (x transposed), B
    K-major (w as nn.Linear stores it)."""
    m, k, n = TMA_M, TMA_K, TMA_N
    x = _rand(m, k, dtype=dtype) if x_layout == "rows" else _rand(k, m, dtype=dtype).t()
    w, b = _rand(n, k, dtype=dtype, scale=k ** -0.5), _rand(n, dtype=dtype)
    rng = philox.new_rng(x.device)
    with reference.poisoned_outputs():
        y, pre = tma.linear_fwd(x, w, b, activation, p, rng, True, False)
    assert _last_kernel(tma) == "tma"
    pre64 = x.double() @ w.double().t() + b.double()
    keep = philox.dropout_keep_mask(rng, (m, n), p) if p else torch.ones(m, n, dtype=torch.bool)
    y64 = ACT64[activation](pre64) * keep.to(pre64.device) / (1 - p)
    assert _err(pre, pre64) <= TOL[dtype]
    assert _err(y, y64) <= TOL[dtype]


@pytest.mark.parametrize("per_sm", [2, 4])
def test_tma_two_programs_an_sm(tma, monkeypatch, per_sm):
    """Configs with PROGRAMS_PER_SM > 1 launch that many programs per SM and stride the tile walk
    by their total: 6 or 12 programs over the 9 output tiles (some take two, some one, some
    none), with gelu + dropout in the epilogue."""
    cfg = tma._gemm_tma_kernel.configs[0]
    monkeypatch.setitem(cfg.kwargs, "PROGRAMS_PER_SM", per_sm)
    tma._gemm_tma_kernel.cache.clear()
    m, k, n = TMA_M, TMA_K, TMA_N
    x = _rand(m, k, dtype=torch.bfloat16)
    w, b = _rand(n, k, dtype=torch.bfloat16, scale=k ** -0.5), _rand(n, dtype=torch.bfloat16)
    rng = philox.new_rng(x.device)
    try:
        with reference.poisoned_outputs():
            y, pre = tma.linear_fwd(x, w, b, "gelu", 0.2, rng, True, False)
    finally:
        tma._gemm_tma_kernel.cache.clear()
    assert _last_kernel(tma) == "tma"
    assert f"PROGRAMS_PER_SM={per_sm}" in tma.recent_gemm_launches().splitlines()[-1]
    pre64 = x.double() @ w.double().t() + b.double()
    keep = philox.dropout_keep_mask(rng, (m, n), 0.2)
    assert _err(pre, pre64) <= TOL[torch.bfloat16]
    assert _err(y, ACT64["gelu"](pre64) * keep.to(pre64.device) / 0.8) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation, p", [("none", 0.0), ("relu", 0.3), ("gelu", 0.3), ("gelu_tanh", 0.0)])
def test_tma_linear_dgrad(tma, dtype, activation, p):
    """(dy @ w) * act'(pre) * keep / (1 - p) with its column sums: B N-major (w read as is)."""
    m, k, n = TMA_M, TMA_K, TMA_N
    dy, w = _rand(m, k, dtype=dtype), _rand(k, n, dtype=dtype, scale=k ** -0.5)
    pre = _rand(m, n, dtype=dtype)
    rng = philox.new_rng(dy.device) if p else None
    keep = philox.dropout_keep_mask(rng, (m, n), p) if p else torch.ones(m, n, dtype=torch.bool)
    keep = keep.to(pre.device)
    y = (ACT64[activation](pre.double()) * keep / (1 - p)).to(dtype)  # the forward output (relu's aux)
    pre64 = pre.double().requires_grad_(True)
    (ACT64[activation](pre64) * keep / (1 - p)).backward(dy.double() @ w.double())
    aux = {"none": None, "relu": y, "gelu": pre, "gelu_tanh": pre}[activation]
    with reference.poisoned_outputs():
        d, db = tma.linear_dgrad(dy, w, aux, activation, p, rng, True, False)
    assert _last_kernel(tma) == "tma"
    assert _err(d, pre64.grad) <= TOL[dtype]
    assert _err(db, pre64.grad.sum(0)) <= TOL[dtype] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("x_layout", ["rows", "cols"])
def test_tma_linear_wgrad(tma, dtype, x_layout):
    """dy^T @ x over the rows: A M-major (dy read transposed); B N-major (x row-major) or K-major
    (x transposed)."""
    rows, n, k = TMA_K, TMA_N, TMA_M
    dy = _rand(rows, n, dtype=dtype)
    x = _rand(rows, k, dtype=dtype) if x_layout == "rows" else _rand(k, rows, dtype=dtype).t()
    with reference.poisoned_outputs():
        dw, db = tma.linear_wgrad(dy, x, True, False)
    assert _last_kernel(tma) == "tma"
    assert _err(dw, dy.double().t() @ x.double()) <= TOL[dtype] * 4
    assert _err(db, dy.double().sum(0)) <= TOL[dtype] * 4


def test_tma_falls_back_to_pointers(K, monkeypatch):
    """Where TMA cannot address an operand (a row pitch that is not a multiple of 16 bytes, a
    base that is not 16-byte aligned, fp32) the pointer kernel runs, with the same result; with
    "auto" the interpreter runs the pointer kernel."""
    monkeypatch.setenv(K.GEMM_PATH_ENV, "tma")
    w = _rand(TMA_N, TMA_K, dtype=torch.bfloat16, scale=TMA_K ** -0.5)  # |y| ~ 1: TOL is absolute
    for x in (_rand(9, 70, dtype=torch.bfloat16)[:, :TMA_K - 18],           # pitch 140 bytes
              _rand(9, TMA_K + 1, dtype=torch.bfloat16)[:, 1:]):           # base + 2 bytes
        y, _ = K.linear_fwd(x, w[:, :x.shape[1]], None, "none", 0.0, None, False, False)
        assert _last_kernel(K) == "pointer"
        assert _err(y, x.double() @ w[:, :x.shape[1]].double().t()) <= TOL[torch.bfloat16]
    K.linear_fwd(_rand(8, 16), _rand(8, 16), None, "none", 0.0, None, False, False)
    assert _last_kernel(K) == "pointer"
    monkeypatch.setenv(K.GEMM_PATH_ENV, "auto")
    K.linear_fwd(_rand(8, 16, dtype=torch.bfloat16), _rand(8, 16, dtype=torch.bfloat16), None, "none", 0.0,
                 None, False, False)
    assert _last_kernel(K) == ("tma" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
                               else "pointer")
    monkeypatch.setenv(K.GEMM_PATH_ENV, "cublas")
    with pytest.raises(ValueError, match=K.GEMM_PATH_ENV):
        K.linear_fwd(_rand(8, 16), _rand(8, 16), None, "none", 0.0, None, False, False)


def test_tma_refuses_what_a_descriptor_cannot_describe(K, monkeypatch):
    """(A review of the unverified TMA path, 2026-11-30.)  A sliced zero-width K (a descriptor's
    dims must be positive: Triton asserted, outside the fallback) and broadcast rows (row stride
    0: cuTensorMapEncodeTiled wants each line at least a line apart) take the pointer kernel."""
    monkeypatch.setenv(K.GEMM_PATH_ENV, "tma")
    w = _rand(TMA_N, TMA_K, dtype=torch.bfloat16, scale=TMA_K ** -0.5)
    b = _rand(TMA_N, dtype=torch.bfloat16)
    x = _rand(9, TMA_K, dtype=torch.bfloat16)
    y, _ = K.linear_fwd(x[:, :0], w[:, :0], b, "none", 0.0, None, False, False)  # row pitch 176 bytes
    assert _last_kernel(K) == "pointer" and torch.equal(y, b.expand(9, TMA_N))
    rows = _rand(1, TMA_K, dtype=torch.bfloat16).expand(9, TMA_K)  # strides (0, 1)
    y, _ = K.linear_fwd(rows, w, None, "none", 0.0, None, False, False)
    assert _last_kernel(K) == "pointer"
    assert _err(y, rows.double() @ w.double().t()) <= TOL[torch.bfloat16]


def test_tma_gpu_configs(K):
    """The TMA autotune list as on a GPU: 16-bit tiles that fit shared memory; the heavy
    epilogues (dropout, dact) keep only tiles of <= 64 accumulators per thread; the pre-hook
    sets each descriptor's box to the config's tile in the operand's orientation."""
    from types import SimpleNamespace
    from unittest import mock

    a = torch.empty(1, dtype=torch.bfloat16)
    named = {"M": 16384, "N": 4096, "A_DESC": SimpleNamespace(base=a)}
    with mock.patch.object(K, "is_interpreting", return_value=False):  # the list and pruning as on a GPU
        configs = K._tma_configs()
        assert len(configs) > 1
        kept = K._prune_tma_configs(configs, named)
        assert (kept[0].kwargs["BLOCK_M"], kept[0].kwargs["BLOCK_N"]) == (128, 256)
        for c in kept:
            bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            assert (bm * bk + bk * bn) * 2 * c.num_stages <= K._SMEM_BUDGET
        for heavy in ({"HAS_DROPOUT": True}, {"EPILOGUE": K.EPI_DACT}):
            for c in K._prune_tma_configs(configs, named, **heavy):
                assert c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps) <= 64
    desc_a, desc_b = SimpleNamespace(block_shape=None), SimpleNamespace(block_shape=None)
    for a_k, b_k, want_a, want_b in ((True, True, [128, 64], [256, 64]), (False, False, [64, 128], [64, 256])):
        configs[0].pre_hook({**configs[0].all_kwargs(), "A_DESC": desc_a, "B_DESC": desc_b,
                             "A_KMAJOR": a_k, "B_KMAJOR": b_k})
        assert (desc_a.block_shape, desc_b.block_shape) == (want_a, want_b)


def test_auto_falls_back_once_when_the_tma_kernel_fails(K, monkeypatch):
    """Under "auto" a TMA kernel that cannot compile or launch (it is newer than the pointer
    kernel) warns once and leaves the process on the pointer kernel, with the right result;
    forced ("tma") it raises."""
    real = K._tma_operands

    def operands_as_on_a_hopper(*args):
        if K._TMA_FAILED:  # what "auto" does after a failure
            return None
        monkeypatch.setenv(K.GEMM_PATH_ENV, "tma")
        try:
            return real(*args)
        finally:
            monkeypatch.setenv(K.GEMM_PATH_ENV, "auto")

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no TMA here")
            return launch

    monkeypatch.setattr(K, "_TMA_FAILED", [])
    monkeypatch.setattr(K, "_tma_operands", operands_as_on_a_hopper)
    monkeypatch.setattr(K, "_gemm_tma_kernel", Broken())
    monkeypatch.setenv(K.GEMM_PATH_ENV, "auto")
    x, w = _rand(TMA_M, TMA_K, dtype=torch.bfloat16), _rand(TMA_N, TMA_K, dtype=torch.bfloat16, scale=TMA_K ** -0.5)
    with pytest.warns(RuntimeWarning, match="TMA GEMM failed.*no TMA here"):
        y, _ = K.linear_fwd(x, w, None, "none", 0.0, None, False, False)
    assert _last_kernel(K) == "pointer"
    assert _err(y, x.double() @ w.double().t()) <= TOL[torch.bfloat16]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (Triton 3.6's interpreter itself warns
        K.linear_fwd(x, w, None, "none", 0.0, None, False, False)  # DeprecationWarnings): no second
    assert _last_kernel(K) == "pointer"
    monkeypatch.setattr(K, "_tma_operands", real)
    monkeypatch.setenv(K.GEMM_PATH_ENV, "tma")
    with pytest.raises(RuntimeError, match="no TMA here"):
        K.linear_fwd(x, w, None, "none", 0.0, None, False, False)
