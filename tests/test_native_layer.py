"""A layer's replayed inference call in one C++ op (transformer_fast/modules/_native.py,
csrc/layer_inference.cpp): the same bits as the Python replay, and only where it applies."""
import copy

import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as tf_functional
from transformer_fast import modules as tfm
from transformer_fast.modules import _lane, _native

from _functional_helpers import count_calls, generator

D, H, FF, B, L = 64, 4, 96, 3, 7  # head dim 16: the cpu kernels' smallest

pytestmark = pytest.mark.skipif(
    not tf.backends.extension_status()[0], reason="needs the C++ extension")


@pytest.fixture
def python_ops(monkeypatch):
    """Counts the functional op bodies the Python replay runs (a native call runs none)."""
    return count_calls(monkeypatch, tf_functional, (
        "run_add_layer_norm", "run_scaled_dot_product_attention", "run_feed_forward"))


def _inputs(kind, batch_first, dtype=torch.float32, device="cpu"):
    g = generator()
    x = torch.randn((B, L, D) if batch_first else (L, B, D), generator=g).to(device, dtype)
    live = torch.rand(B, L, generator=g) < 0.3
    live[:, 0] = False  # every query keeps a key, causal or not: the CPU skips the dead-row fix-up
    pad = live.clone()
    pad[1] = True  # a sequence of padding only: its rows are zeros before the out-projection
    pad, live = pad.to(device), live.to(device)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
    return x, {
        "none": {},
        "padding": {"src_key_padding_mask": pad},
        "padding_live": {"src_key_padding_mask": live},
        "causal": {"src_mask": causal, "is_causal": True},
        "causal+padding": {"src_mask": causal, "is_causal": True, "src_key_padding_mask": pad},
        "causal+padding_live": {"src_mask": causal, "is_causal": True, "src_key_padding_mask": live},
    }[kind]


def _calls(monkeypatch, layer, x, kwargs, native, n=3):
    monkeypatch.setattr(_native, "ENABLED", native)
    return [layer(x, **kwargs) for _ in range(n)]


def _natives(module):
    """The native plans decided for ``module``'s replayed signatures."""
    return [plan for _, natives in _lane._PLANS.get(module, {}).values() for plan in natives.values()]


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["none", "padding", "padding_live", "causal", "causal+padding",
                                  "causal+padding_live"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_native_layer_matches_the_python_replay(backend, norm_first, batch_first, kind, activation,
                                                monkeypatch, python_ops):
    act = torch.nn.GELU("tanh") if activation == "gelu_tanh" else activation
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1, activation=act, batch_first=batch_first,
                                        norm_first=norm_first).eval()
    python = copy.deepcopy(layer)
    x, kwargs = _inputs(kind, batch_first)
    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, kwargs, native=False)
        got = _calls(monkeypatch, layer, x, kwargs, native=True, n=1)  # the checked call
        python_ops["n"] = 0
        got += _calls(monkeypatch, layer, x, kwargs, native=True, n=2)
    assert python_ops["n"] == 0, "a native call ran Python op bodies"
    assert _natives(layer) and all(plan is not None for plan in _natives(layer))
    assert _natives(python) == [None]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[-1]._base is None  # a tensor of its own: in-place changes allowed, as torch's
    got[-1].add_(1.0)


def _decoder_inputs(tgt_kind, memory_padding, batch_first, dtype=torch.float32, device="cpu"):
    x, kwargs = _inputs(tgt_kind, batch_first, dtype, device)
    kwargs = {{"src_mask": "tgt_mask", "is_causal": "tgt_is_causal",
               "src_key_padding_mask": "tgt_key_padding_mask"}[k]: v for k, v in kwargs.items()}
    g = generator()
    s = 5
    memory = torch.randn((B, s, D) if batch_first else (s, B, D), generator=g).to(device, dtype)
    if memory_padding:
        pad = torch.rand(B, s, generator=g) < 0.4
        pad[:, 0] = False
        if memory_padding != "live":
            pad[0] = True  # a sequence whose memory is all padding: its cross-attention rows are zeros
        kwargs["memory_key_padding_mask"] = pad.to(device)
    return x, memory, kwargs


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("tgt_kind", ["none", "padding", "causal", "causal+padding", "causal+padding_live"])
@pytest.mark.parametrize("memory_padding", [False, True, "live"], ids=["memory", "memory+padding", "memory+live_padding"])
def test_native_decoder_layer_matches_the_python_replay(backend, norm_first, batch_first, tgt_kind,
                                                        memory_padding, monkeypatch, python_ops):
    layer = tfm.TransformerDecoderLayer(D, H, FF, 0.1, activation="gelu", batch_first=batch_first,
                                        norm_first=norm_first).eval()
    python = copy.deepcopy(layer)
    x, memory, kwargs = _decoder_inputs(tgt_kind, memory_padding, batch_first)
    with torch.no_grad(), tf.use_backend(backend):
        monkeypatch.setattr(_native, "ENABLED", False)
        want = [python(x, memory, **kwargs) for _ in range(3)]
        monkeypatch.setattr(_native, "ENABLED", True)
        got = [layer(x, memory, **kwargs)]
        python_ops["n"] = 0
        got += [layer(x, memory, **kwargs) for _ in range(2)]
    assert python_ops["n"] == 0, "a native call ran Python op bodies"
    assert _natives(layer) and all(plan is not None for plan in _natives(layer))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[-1]._base is None


def test_native_decoder_layer_with_memory_the_target_itself(monkeypatch, python_ops):
    """``layer(x, x)``: the cross-attention then projects q, k and v in one GEMM (as MHA does
    when query is key is value), which the native call does not: it runs the Python replay."""
    layer = tfm.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True).eval()
    python = copy.deepcopy(layer)
    x, _ = _inputs("none", True)
    with torch.no_grad(), tf.use_backend("cpu"):
        monkeypatch.setattr(_native, "ENABLED", False)
        want = [python(x, x) for _ in range(3)]
        monkeypatch.setattr(_native, "ENABLED", True)
        got = [layer(x, x) for _ in range(3)]
        python_ops["n"] = 0
        layer(x, x)
        assert python_ops["n"] > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_native_layer_dtypes(backend, dtype, monkeypatch):
    if backend == "cpu" and dtype == torch.float64:
        pytest.skip("the cpu attention kernel takes 16-bit and float32 inputs")
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1, batch_first=True, dtype=dtype).eval()
    python = copy.deepcopy(layer)
    x, kwargs = _inputs("padding", True, dtype)
    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, kwargs, native=False)
        got = _calls(monkeypatch, layer, x, kwargs, native=True)
    assert all(plan is not None for plan in _natives(layer))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
def test_native_stacks_and_model(backend, norm_first, monkeypatch):
    """TransformerEncoder (the stack chains its layers, each with a native plan; pre-LN: the
    next layer's first norm fused into the last add) and a whole nn.Transformer-style model."""
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1, batch_first=True, norm_first=norm_first)
    encoder = tfm.TransformerEncoder(layer, 3, norm=tfm.LayerNorm(D), enable_nested_tensor=False).eval()
    model = tfm.Transformer(D, H, 2, 2, FF, 0.1, batch_first=True, norm_first=norm_first).eval()
    py_encoder, py_model = copy.deepcopy(encoder), copy.deepcopy(model)
    x, kwargs = _inputs("padding", True)
    tgt = torch.randn(B, 5, D)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)

    def run_model(m):
        return m(x, tgt, tgt_mask=causal, src_key_padding_mask=kwargs["src_key_padding_mask"],
                 tgt_is_causal=True)

    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, py_encoder, x, kwargs, native=False)
        want_model = [run_model(py_model) for _ in range(3)]
        got = _calls(monkeypatch, encoder, x, kwargs, native=True)
        got_model = [run_model(model) for _ in range(3)]
    for a, b in zip(got + got_model, want + want_model):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    plans = _natives(encoder)  # the stack's chain: one plan per layer
    assert len(plans) == 3 and all(plan is not None for plan in plans)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("layer_type", ["encoder", "decoder"])
def test_native_layers_without_bias(backend, layer_type, monkeypatch):
    """bias=False: no in_proj / out_proj / linear biases and LayerNorms without bias."""
    cls = tfm.TransformerEncoderLayer if layer_type == "encoder" else tfm.TransformerDecoderLayer
    layer = cls(D, H, FF, 0.1, batch_first=True, bias=False).eval()
    python = copy.deepcopy(layer)
    x, _ = _inputs("none", True)
    args = (x,) if layer_type == "encoder" else (x, torch.randn(B, 5, D, generator=generator()))
    with torch.no_grad(), tf.use_backend(backend):
        monkeypatch.setattr(_native, "ENABLED", False)
        want = [python(*args) for _ in range(3)]
        monkeypatch.setattr(_native, "ENABLED", True)
        got = [layer(*args) for _ in range(3)]
    assert all(plan is not None for plan in _natives(layer))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_native_layer_strided_input(backend, monkeypatch):
    """A sequence-first layer fed a transposed view of a batch-first tensor (no copy)."""
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1).eval()
    python = copy.deepcopy(layer)
    x = torch.randn(B, L, D, generator=generator()).transpose(0, 1)  # (L, B, D), not contiguous
    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, {}, native=False)
        got = _calls(monkeypatch, layer, x, {}, native=True)
    assert all(plan is not None for plan in _natives(layer))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _packed_calls(monkeypatch):
    """Counts the stack calls that ran on the valid tokens alone (modules/_native.py)."""
    counts = {"n": 0}
    original = _native.packed_encoder

    def counted(*args):
        out = original(*args)
        counts["n"] += out is not None
        return out

    monkeypatch.setattr(_native, "packed_encoder", counted)
    return counts


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto"])
@pytest.mark.parametrize("final_norm", [False, True], ids=["no_norm", "norm"])
def test_packed_encoder_matches_the_padded_replay(backend, final_norm, monkeypatch):
    """Where torch's encoder runs a NestedTensor (post-LN, batch first, eval, no grad, a
    left-aligned padding mask), ours runs its layers on the valid tokens alone: the numbers of
    the padded Python replay up to the GEMMs' rounding (fewer rows may take other blocking),
    exactly its zeros / norm(0) at padded positions, and torch's."""
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1, batch_first=True)
    norm = tfm.LayerNorm(D) if final_norm else None
    encoder = tfm.TransformerEncoder(layer, 3, norm=norm).eval()  # enable_nested_tensor=True
    torch_encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(D, H, FF, 0.1, batch_first=True), 3,
        norm=torch.nn.LayerNorm(D) if final_norm else None).eval()
    torch_encoder.load_state_dict(encoder.state_dict())
    python = copy.deepcopy(encoder)
    x, kwargs = _inputs("padding", True)
    lengths = torch.randint(0, L + 1, (B,), generator=generator())
    lengths[0] = L
    kwargs["src_key_padding_mask"] = torch.arange(L) >= lengths[:, None]  # left-aligned
    packed = _packed_calls(monkeypatch)
    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, kwargs, native=False)
        got = _calls(monkeypatch, encoder, x, kwargs, native=True)
        expected = torch_encoder(x, **kwargs)
    assert packed["n"] == 2  # the replayed calls (the first one is the checked call)
    padded = kwargs["src_key_padding_mask"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a[padded], b[padded], rtol=0, atol=0)
    torch.testing.assert_close(got[-1], expected, rtol=1e-5, atol=1e-5)


def _stays_on_python(monkeypatch, layer, x, kwargs, grad=False, backend="cpu"):
    python = copy.deepcopy(layer)
    torch.manual_seed(5)
    with torch.set_grad_enabled(grad), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, kwargs, native=False)
        torch.manual_seed(5)
        got = _calls(monkeypatch, layer, x, kwargs, native=True)
    assert _natives(layer) == [None]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["dropout", "grad", "float_mask", "bool_mask", "reference",
                                  "float32_norm_on_torch", "bias_kv"])
def test_what_stays_on_the_python_replay(case, monkeypatch):
    dropout = 0.2 if case == "dropout" else 0.0
    # (sequence first for the masks: in eval, batch first, torch's fast path reads a float mask
    # as bool, which ours mimics on the checked path, unreplayed)
    batch_first = case not in ("float_mask", "bool_mask")
    layer = tfm.TransformerEncoderLayer(D, H, FF, dropout, batch_first=batch_first)
    layer.train(case == "dropout")
    x, kwargs = _inputs("padding", batch_first)
    backend = {"reference": "reference", "float32_norm_on_torch": "torch"}.get(case, "cpu")
    if case == "float_mask":
        kwargs = {"src_mask": torch.randn(L, L)}
    elif case == "bool_mask":
        kwargs = {"src_mask": torch.rand(L, L) < 0.3}
    elif case == "float32_norm_on_torch":
        layer = layer.to(torch.bfloat16)
        layer.norm1.float()
        x = x.to(torch.bfloat16)
    elif case == "bias_kv":
        attn = layer.self_attn
        attn.bias_k = torch.nn.Parameter(torch.randn(1, 1, D))
        attn.bias_v = torch.nn.Parameter(torch.randn(1, 1, D))
    if case == "dropout":  # dropout draws: the same seed before each copy's calls
        _stays_on_python(monkeypatch, layer, x, kwargs, backend=backend)
        return
    with torch.no_grad() if case != "grad" else torch.enable_grad():
        _stays_on_python(monkeypatch, layer, x, kwargs, grad=case == "grad", backend=backend)


@pytest.mark.parametrize("change", ["cross_heads", "cross_layout"])
def test_decoder_with_a_different_cross_attention_stays_on_the_replay(change, monkeypatch):
    """A decoder layer whose multihead_attn was replaced by one with another head count (or
    layout) computes as torch's on every call: the C++ op takes one head count and layout for
    both attentions, so such a layer stays on the Python replay (an outside audit found the
    replayed calls after the first 0.13 off with 4 cross-attention heads beside 2)."""
    torch.manual_seed(0)
    heads = 2 if change == "cross_heads" else H
    ours = tfm.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True)
    ours.multihead_attn = tfm.MultiheadAttention(D, heads, 0.0, batch_first=change != "cross_layout")
    ref = torch.nn.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True)
    ref.multihead_attn = torch.nn.MultiheadAttention(D, heads, 0.0, batch_first=change != "cross_layout")
    ref.load_state_dict(ours.state_dict())
    ours.eval(), ref.eval()
    x, _ = _inputs("none", True)
    # (the other layout reads dim 1 as the batch: the memory's must then be the target's)
    memory = torch.randn(B, L if change == "cross_layout" else L + 2, D, generator=generator())
    monkeypatch.setattr(_native, "ENABLED", True)
    with torch.no_grad(), tf.use_backend("cpu"):
        got = [ours(x, memory) for _ in range(3)]
        want = ref(x, memory)
    assert _natives(ours) == [None]
    for out in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_op_checks_its_arguments():
    op = torch.ops.transformer_fast_C.encoder_layer_infer
    x = torch.randn(2, 3, D)
    with pytest.raises(RuntimeError, match="params must hold 14"):
        op(x, None, None, [None] * 3, [1e-5] * 3, [0] * 4, H, True, False, False, False, "relu", False)
    with pytest.raises(RuntimeError, match="unknown backend code"):
        op(x, None, None, [None] * 14, [1e-5] * 3, [0, 0, 7, 0], H, True, False, False, False, "relu",
           False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_packed_encoder_on_gpu(backend, monkeypatch):
    """The valid-tokens stack on a GPU, bf16: its GEMMs see fewer rows than the padded replay's,
    so cuBLAS may pick other kernels: compared within bf16's tolerance, not bit for bit."""
    layer = tfm.TransformerEncoderLayer(D, H, FF, 0.1, batch_first=True, device="cuda",
                                        dtype=torch.bfloat16)
    encoder = tfm.TransformerEncoder(layer, 3, norm=tfm.LayerNorm(D, device="cuda",
                                                                  dtype=torch.bfloat16)).eval()
    python = copy.deepcopy(encoder)
    x, kwargs = _inputs("padding", True, torch.bfloat16, "cuda")
    kwargs["src_key_padding_mask"] = (torch.arange(L) >= torch.tensor([L, 4, 1])[:, None]).cuda()
    packed = _packed_calls(monkeypatch)
    with torch.no_grad(), tf.use_backend(backend):
        want = _calls(monkeypatch, python, x, kwargs, native=False)
        got = _calls(monkeypatch, encoder, x, kwargs, native=True)
    assert packed["n"] == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "cuda"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("kind", ["none", "padding", "causal+padding"])
@pytest.mark.parametrize("layer_type", ["encoder", "decoder"])
def test_native_layer_on_gpu_matches_the_python_replay(backend, norm_first, kind, layer_type,
                                                       monkeypatch):
    cls = tfm.TransformerEncoderLayer if layer_type == "encoder" else tfm.TransformerDecoderLayer
    layer = cls(D, H, FF, 0.1, batch_first=True, norm_first=norm_first, device="cuda",
                dtype=torch.bfloat16).eval()
    python = copy.deepcopy(layer)
    if layer_type == "encoder":
        x, kwargs = _inputs(kind, True, torch.bfloat16, "cuda")
        args = (x,)
    else:
        x, memory, kwargs = _decoder_inputs(kind, kind != "none", True, torch.bfloat16, "cuda")
        args = (x, memory)
    with torch.no_grad(), tf.use_backend(backend):
        monkeypatch.setattr(_native, "ENABLED", False)
        want = [python(*args, **kwargs) for _ in range(3)]
        monkeypatch.setattr(_native, "ENABLED", True)
        got = [layer(*args, **kwargs) for _ in range(3)]
    assert all(plan is not None for plan in _natives(layer))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
