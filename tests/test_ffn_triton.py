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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh"])
def test_linear_fwd(K, dtype, activation):
    m, k, n, p = 77, 150, 70, 0.2  # K = 150: three 64-wide steps, the last partial
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


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_linear_dgrad_and_act_bwd(K, activation, p):
    """d = (dy @ w) * act'(pre) * keep / (1-p) and its column sums, from the GEMM epilogue and
    from the elementwise kernel."""
    m, k, n = 45, 70, 90
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
