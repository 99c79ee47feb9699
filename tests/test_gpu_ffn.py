"""feed_forward / linear_bias_act on a GPU (marked gpu: skipped without CUDA).

The cuda backend (cuBLASLt + our kernels) has never run on the machines that wrote it: these
tests are its first check.  They run the float64 oracle at realistic sizes (the paper's 512/2048
and the issue's benchmark width 1024/4096) for both GPU backends, the tf32 path with the
bf16-level tolerance (DESIGN 6), the cuBLASLt fused epilogues (16-bit gelu_tanh: GELU_AUX_BIAS,
DGELU; fp32: BGRADB for db2) and their fallbacks (feature sizes that are not multiples of
8), and that every backend drops exactly the elements of transformer_fast.philox's mask.
"""
import pytest
import torch

from transformer_fast import philox, reference
from transformer_fast import functional as F

from _functional_helpers import tf32_allowed
from conftest import backend_params, require_backend
from test_ffn import _assert_oracle, _make, check_feed_forward, check_linear_bias_act

pytestmark = pytest.mark.gpu

GPU = backend_params("cuda", "triton")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_dt = lambda d: str(d).replace("torch.", "")


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("rows, d_model, d_ff", [(1, 512, 2048), (1000, 512, 2048), (2048, 1024, 4096), (7, 33, 70)],
                         ids=lambda v: str(v))
def test_oracle_gpu(backend, dtype, activation, dropout_p, rows, d_model, d_ff):
    device = require_backend(backend)
    x, w1, b1, w2, b2 = _make((rows,), d_model, d_ff, d_model, dtype, device)
    check_feed_forward(backend, x, w1, b1, w2, b2, activation, dropout_p)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh"])
def test_linear_bias_act_gpu(backend, dtype, activation):
    device = require_backend(backend)
    x, w, b, _, _ = _make((4, 250), 512, 1024, 1, dtype, device)
    check_linear_bias_act(backend, x, w, b, activation, 0.1)
    check_linear_bias_act(backend, x, w, None, activation, 0.0)


@pytest.mark.parametrize("backend", GPU)
def test_tf32_path(backend):
    """fp32 with torch's allow_tf32 on: tf32 matmuls, checked with the bf16-level tolerance."""
    device = require_backend(backend)
    x, w1, b1, w2, b2 = _make((777,), 512, 2048, 512, torch.float32, device)
    with tf32_allowed():
        def kernel(x, w1, b1, w2, b2):
            return F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend=backend)

        def ref(x, w1, b1, w2, b2):
            return reference.feed_forward(x, w1, b1, w2, b2, "gelu")

        results = reference.run_oracle(kernel, ref, dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2),
                                       ["x", "w1", "b1", "w2", "b2"], atol=reference.TF32_ATOL)
        _assert_oracle(backend, results, f"{backend} tf32")


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_non_contiguous_x_gpu(backend, layout):
    device = require_backend(backend)
    _, w1, b1, w2, b2 = _make((1,), 256, 1024, 256, torch.bfloat16, device)
    if layout == "transposed":
        x = torch.randn(37, 5, 256, device=device, dtype=torch.bfloat16)
        view = lambda t: t.transpose(0, 1)
    else:
        x = torch.randn(300, 512, device=device, dtype=torch.bfloat16)
        view = lambda t: t[:, ::2]
    check_feed_forward(backend, x, w1, b1, w2, b2, "gelu_tanh", 0.1, view=view)


def test_backends_drop_the_same_elements_gpu():
    require_backend("cuda")
    require_backend("triton")
    x = torch.rand(301, 520, device="cuda") + 0.5
    w = torch.eye(520, device="cuda")
    torch.manual_seed(11)
    want = philox.dropout_keep_mask(philox.new_rng("cuda"), (301, 520), 0.2)
    for name in ("cuda", "triton"):
        torch.manual_seed(11)
        y = F.linear_bias_act(x, w, None, activation="relu", dropout_p=0.2, backend=name)
        assert torch.equal(y != 0, want), name


@pytest.mark.parametrize("backend", GPU)
def test_cuda_graph_and_streams(backend):
    """No host sync in the op: it can be captured in a CUDA graph, and it runs on side streams
    (the cuBLASLt workspace is per stream)."""
    device = require_backend(backend)
    x, w1, b1, w2, b2 = _make((256,), 256, 1024, 256, torch.bfloat16, device)
    F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend=backend)  # warm up / autotune
    want = F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = F.feed_forward(x, w1, b1, w2, b2, activation="gelu", backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, want)
