"""The fused path inside the modules: every backend (reference, torch, cpu, and triton through
the interpreter) against torch's modules under the oracle, with a check that the ops really ran
on the chosen backend; no hidden copies or host syncs in a layer's forward; torch.compile with
fullgraph=True."""
import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fast
import transformer_fast.modules as M
from transformer_fast import backends
from conftest import backend_params, require_backend
from test_modules_support import one_thread  # noqa: F401  (fixture)
from test_modules_support import assert_parity, fresh_generator, ours_like, randomize_

pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched"),
              pytest.mark.usefixtures("one_thread")]

# head dim 16: the smallest the fused attention kernels take
E, H, FF, N, L, S = 32, 2, 48, 2, 5, 7


@contextlib.contextmanager
def resolved_backends():
    """Records (op, backend) for every functional op call resolved inside."""
    seen = []
    real = backends.resolve

    def spy(op, backend, inputs):
        name = real(op, backend, inputs)
        seen.append((op, name))
        return name

    backends.resolve = spy
    try:
        yield seen
    finally:
        backends.resolve = real


def _padding(g, length):
    pad = torch.rand(N, length, generator=g) < 0.3
    pad[:, 0] = False
    return pad


def _expect(seen, backend):
    """Each op implemented by ``backend`` ran on it; the others on auto's choice."""
    assert seen, "no functional op ran: the module did not take the fused path"
    for op, name in seen:
        if backend in backends.implemented_backends(op):
            assert name == backend, (op, name)
        else:
            assert name == backends.resolve(op, "auto", {}), (op, name)


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton"))
def test_layers_on_each_backend(backend, norm_first):
    device = require_backend(backend)
    g = fresh_generator()
    ctor = dict(dim_feedforward=FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                activation="gelu", device=device)
    enc_t = randomize_(torch.nn.TransformerEncoderLayer(E, H, **ctor), g)
    enc_o = ours_like(enc_t, M.TransformerEncoderLayer, E, H, **ctor)
    dec_t = randomize_(torch.nn.TransformerDecoderLayer(E, H, **ctor), g)
    dec_o = ours_like(dec_t, M.TransformerDecoderLayer, E, H, **ctor)
    x = torch.randn(N, L, E, generator=g).to(device)
    mem = torch.randn(N, S, E, generator=g).to(device)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device)
    kpm, mkpm = _padding(g, L).to(device), _padding(g, S).to(device)
    with transformer_fast.use_backend(backend), resolved_backends() as seen:
        assert_parity(enc_t, enc_o, (x,), dict(src_mask=causal, src_key_padding_mask=kpm, is_causal=True),
                      torch.float32, (0,), context=f"encoder layer on {backend}")
        assert_parity(dec_t, dec_o, (x, mem),
                      dict(tgt_mask=causal, tgt_key_padding_mask=kpm, memory_key_padding_mask=mkpm,
                           tgt_is_causal=True),
                      torch.float32, (0, 1), context=f"decoder layer on {backend}")
    _expect(seen, backend)
    assert {"add_layer_norm", "feed_forward", "scaled_dot_product_attention"} <= {op for op, _ in seen}


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton"))
def test_mha_need_weights_on_each_backend(backend):
    device = require_backend(backend)
    g = fresh_generator()
    theirs = randomize_(torch.nn.MultiheadAttention(E, H, batch_first=True, device=device), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True, device=device)
    q = torch.randn(N, L, E, generator=g).to(device)
    kv = torch.randn(N, S, E, generator=g).to(device)
    blocked = torch.rand(L, S, generator=g) < 0.3
    blocked[:, 0] = False
    with transformer_fast.use_backend(backend), resolved_backends() as seen:
        assert_parity(theirs, ours, (q, kv, kv),
                      dict(key_padding_mask=_padding(g, S).to(device), attn_mask=blocked.to(device),
                           need_weights=True, average_attn_weights=False),
                      torch.float32, (0, 1))
    _expect(seen, backend)
    assert ("masked_softmax" in {op for op, _ in seen})


def test_explicit_backend_that_cannot_run_raises():
    """An explicitly chosen backend that implements an op but cannot run these inputs raises
    (no silent fallback): triton needs head dims 16..256."""
    if not backends.available("triton", "cpu")[0]:
        pytest.skip("triton not available here")
    m = M.MultiheadAttention(8, 2, batch_first=True)  # head dim 4
    x = torch.randn(1, 3, 8)
    with transformer_fast.use_backend("triton"), pytest.raises(backends.BackendError, match="head dim"):
        m(x, x, x, need_weights=False)


# --------------------------------------------------------------------------------------------
# No hidden copies or host syncs in a layer's forward


class _CountOps(TorchDispatchMode):
    COPIES = {"copy_", "clone", "_to_copy", "contiguous"}
    SYNCS = {"item", "_local_scalar_dense", "nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def copies(self):
        return {k: v for k, v in self.counts.items() if k in self.COPIES}

    def syncs(self):
        return {k: v for k, v in self.counts.items() if k in self.SYNCS}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "bf"])
@pytest.mark.parametrize("backend", ["auto", "cpu", pytest.param("triton", marks=pytest.mark.triton)])
def test_encoder_layer_forward_copies_and_syncs(backend, batch_first, norm_first, training):
    """An encoder layer's forward makes no host sync and no copy on the triton and cpu backends:
    q/k/v reach the attention kernel as strided views, masks are not converted per head, and the
    kernel writes its output in q's memory order, so the head merge back to (N, L, H*D) rows for
    the out-projection is a view.  Torch's SDPA (auto on the CPU) returns (N, H, L, D)
    contiguous, which costs that merge one copy.  (What a C++ kernel copies inside itself, e.g.
    the cpu attention's fp32 staging of q/k/v, is below the dispatch mode and not counted.)
    On "auto" (the CPU: C++ add_layer_norm / FFN, torch's SDPA) dropout is 0, because torch's
    CPU SDPA with dropout runs its math path, which copies q/k internally; the triton kernels
    (through the interpreter) take dropout 0.1 with the same single copy.  Where the cpu
    backend trains with dropout, its attention keeps the scores in memory (one custom op,
    ops/cpu_attention.py, as torch's CPU SDPA does with dropout): its batched GEMMs' packing of
    q, k and v, and the output's copy into q's memory order, happen inside the op (uncounted, as
    the C++ kernels' staging).  Torch's own layer makes at least as many copies."""
    # triton: CUDA tensors where a GPU is (CPU tensors run only through the interpreter).
    device = "cpu" if backend == "auto" else require_backend(backend)
    p = 0.0 if backend == "auto" else 0.1
    layer = M.TransformerEncoderLayer(E, H, FF, dropout=p, batch_first=batch_first,
                                      norm_first=norm_first, device=device).train(training)
    x = torch.randn((N, L, E) if batch_first else (L, N, E), device=device, requires_grad=training)
    kpm = _padding(torch.Generator().manual_seed(0), L).to(device)
    with transformer_fast.use_backend(backend), resolved_backends() as seen, _CountOps() as ops:
        layer(x, src_key_padding_mask=kpm)
    what = f"ops seen on {device}: {dict(ops.counts)}; functional ops resolved: {seen}"
    assert ops.syncs() == {}, f"host syncs {ops.syncs()}; {what}"
    expected = {"clone": 1} if backend == "auto" else {}
    assert ops.copies() == expected, f"copies {ops.copies()}; {what}"
    theirs = torch.nn.TransformerEncoderLayer(E, H, FF, dropout=p, batch_first=batch_first,
                                             norm_first=norm_first, device=device).train(training)
    with _CountOps() as torch_ops:
        theirs(x, src_key_padding_mask=kpm)
    assert sum(torch_ops.copies().values()) >= sum(ops.copies().values()), (torch_ops.counts, ops.counts)


def test_copy_counter_sees_copies():
    """The counter is not blind: a .contiguous() on a strided tensor shows up."""
    with _CountOps() as ops:
        torch.randn(4, 6).t().contiguous()
    assert ops.copies() == {"clone": 1}


# --------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
def test_compile_encoder_layer_fullgraph(norm_first):
    torch._dynamo.reset()
    g = fresh_generator()
    layer = randomize_(M.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True,
                                                 norm_first=norm_first), g)
    x = torch.randn(N, L, E, generator=g, requires_grad=True)
    kpm = _padding(g, L)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x, src_key_padding_mask=kpm)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    y_ref = layer(x, src_key_padding_mask=kpm)
    (gx_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compile_encoder_layer_inductor():
    """Inductor compiles the layer (custom ops stay opaque) with fullgraph=True (~20 s on CPU)."""
    torch._dynamo.reset()
    g = fresh_generator()
    layer = randomize_(M.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), g)
    x = torch.randn(N, L, E, generator=g, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# On a GPU (auto picks the fused CUDA/Triton kernels): realistic sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
def test_layers_on_gpu(norm_first, dtype):
    device = "cuda"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = fresh_generator()
    e, h, ff, n, lq, lk = 256, 4, 1024, 4, 127, 200
    ctor = dict(dim_feedforward=ff, dropout=0.0, batch_first=True, norm_first=norm_first,
                activation="gelu", device=device)
    enc_t = randomize_(torch.nn.TransformerEncoderLayer(e, h, **ctor), g)
    enc_o = ours_like(enc_t, M.TransformerEncoderLayer, e, h, **ctor)
    dec_t = randomize_(torch.nn.TransformerDecoderLayer(e, h, **ctor), g)
    dec_o = ours_like(dec_t, M.TransformerDecoderLayer, e, h, **ctor)
    x = torch.randn(n, lq, e, generator=g).to(device)
    mem = torch.randn(n, lk, e, generator=g).to(device)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(lq, device=device)
    pad = torch.rand(n, lq, generator=g) < 0.2
    pad[:, 0] = False
    mpad = torch.rand(n, lk, generator=g) < 0.2
    mpad[:, 0] = False
    with resolved_backends() as seen:
        assert_parity(enc_t, enc_o, (x,), dict(src_mask=causal, src_key_padding_mask=pad.to(device),
                                               is_causal=True), dtype, (0,), context="encoder layer")
        assert_parity(dec_t, dec_o, (x, mem),
                      dict(tgt_mask=causal, tgt_key_padding_mask=pad.to(device),
                           memory_key_padding_mask=mpad.to(device), tgt_is_causal=True),
                      dtype, (0, 1), context="decoder layer")
    assert all(name not in ("reference",) for _, name in seen)


@pytest.mark.gpu
def test_encoder_layer_forward_copies_and_syncs_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    layer = M.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True, device="cuda").train()
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    pad = torch.zeros(4, 128, dtype=torch.bool, device="cuda")
    pad[:, 100:] = True
    with transformer_fast.use_backend("triton"):  # the fused path (auto takes torch's SDPA on a GPU for now)
        layer(x, src_key_padding_mask=pad)  # warm-up (autotuning, compilation)
        with _CountOps() as ops:
            layer(x, src_key_padding_mask=pad)
    assert ops.syncs() == {}
    assert ops.copies() == {}, ops.counts  # the triton kernels write out in q's order: no head-merge copy


def test_compile_decoder_layer_mha_and_prenorm_stack_fullgraph():
    """fullgraph=True also through a decoder layer (causal hint + memory padding), a standalone
    MultiheadAttention with need_weights, and a chained pre-LN encoder stack."""
    torch._dynamo.reset()
    g = fresh_generator()
    x = torch.randn(N, L, E, generator=g, requires_grad=True)
    mem = torch.randn(N, S, E, generator=g)
    causal = M.Transformer.generate_square_subsequent_mask(L)
    mpad = _padding(g, S)
    dec = randomize_(M.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True,
                                               norm_first=True), g)
    mha = randomize_(M.MultiheadAttention(E, H, batch_first=True), g)
    enc = randomize_(M.TransformerEncoder(M.TransformerEncoderLayer(E, H, FF, dropout=0.0,
                                                                  batch_first=True, norm_first=True),
                                          2, M.LayerNorm(E)), g)
    cases = [
        (dec, (x, mem), dict(tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mpad)),
        (mha, (x, mem, mem), dict(key_padding_mask=mpad, average_attn_weights=False)),
        (enc, (x,), dict(mask=causal, is_causal=True)),
    ]
    for module, args, kwargs in cases:
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        got, want = compiled(*args, **kwargs), module(*args, **kwargs)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        (ga,) = torch.autograd.grad(got[0].sum(), x)
        (gb,) = torch.autograd.grad(want[0].sum(), x)
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-5)
