"""Replayed layer calls (transformer_fast/modules/_lane.py): the same bits as the checked call,
and a checked call again whenever anything the checks or the backend choice read has changed."""
import copy

import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import functional as tf_functional
from transformer_fast import modules as tfm
from transformer_fast.modules import _lane

from _functional_helpers import count_calls

D, H, FF, B, L, S = 32, 2, 64, 3, 7, 5

BACKENDS = ["reference", "torch", "cpu"]


@pytest.fixture
def checked_calls(monkeypatch):
    """Counts the public (checked) functional calls the layers make."""
    return count_calls(monkeypatch, tf_functional,
                       ("add_layer_norm", "scaled_dot_product_attention", "feed_forward"))


def _assert_same_parameter_grads(out, module, reference, fresh):
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(module.parameters()), upstream)
    expected = torch.autograd.grad(reference, list(fresh.parameters()), upstream)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _masks(kind):
    g = torch.Generator().manual_seed(1)
    pad = torch.rand(B, L, generator=g) < 0.3
    pad[:, 0] = False
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    if kind == "none":
        return None, None, False
    if kind == "padding":
        return None, pad, False
    if kind == "bool_mask":
        return torch.rand(L, L, generator=g) < 0.3, None, False
    if kind == "float_mask+padding":
        return torch.randn(L, L, generator=g), pad.float().masked_fill(pad, float("-inf")), False
    if kind == "causal+padding":
        return causal, pad, True
    raise AssertionError(kind)


def _encoder(norm_first, batch_first, activation="relu"):
    torch.manual_seed(0)
    return tfm.TransformerEncoderLayer(D, H, FF, 0.0, activation=activation, batch_first=batch_first,
                                       norm_first=norm_first)


def _x(batch_first, length=L, seed=2):
    g = torch.Generator().manual_seed(seed)
    shape = (B, length, D) if batch_first else (length, B, D)
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["none", "padding", "bool_mask", "causal+padding"])
@pytest.mark.parametrize("grad", [False, True])
def test_encoder_layer_replay_matches_the_checked_call(backend, norm_first, batch_first, kind, grad,
                                                      checked_calls):
    layer = _encoder(norm_first, batch_first)
    fresh = copy.deepcopy(layer)
    x = _x(batch_first)
    mask, pad, causal = _masks(kind)
    with tf.use_backend(backend), torch.set_grad_enabled(grad):
        first = layer(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
        recorded = checked_calls["n"]
        assert recorded > 0
        checked_calls["n"] = 0
        replay = layer(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
        assert checked_calls["n"] == 0, "the second call with the same signature ran the checks"
        reference = fresh(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
    torch.testing.assert_close(replay, reference, rtol=0, atol=0)
    torch.testing.assert_close(first, reference, rtol=0, atol=0)
    if grad:
        _assert_same_parameter_grads(replay, layer, reference, fresh)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("kind", ["none", "padding", "float_mask+padding", "causal+padding"])
def test_decoder_layer_replay_matches_the_checked_call(backend, norm_first, kind, checked_calls):
    torch.manual_seed(0)
    layer = tfm.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=norm_first).eval()
    fresh = copy.deepcopy(layer)
    x, memory = _x(True), _x(True, S, seed=3)
    mask, pad, causal = _masks(kind)
    mem_pad = torch.zeros(B, S, dtype=torch.bool)
    mem_pad[0, -2:] = True
    kwargs = dict(tgt_mask=mask, tgt_key_padding_mask=pad, memory_key_padding_mask=mem_pad,
                  tgt_is_causal=causal)
    if kind == "float_mask+padding":
        kwargs["memory_key_padding_mask"] = torch.zeros(B, S).masked_fill(mem_pad, float("-inf"))
    with tf.use_backend(backend), torch.no_grad():
        layer(x, memory, **kwargs)
        checked_calls["n"] = 0
        replay = layer(x, memory, **kwargs)
        assert checked_calls["n"] == 0
        reference = fresh(x, memory, **kwargs)
    torch.testing.assert_close(replay, reference, rtol=0, atol=0)


def _set_eps(layer):
    layer.norm1.eps = 1e-2


def _set_activation(layer):
    layer.activation = F.gelu


def _replace_linear(layer):
    new = torch.nn.Linear(FF, D)
    layer.linear2 = new


def _replace_nested_linear(layer):
    out = torch.nn.modules.linear.NonDynamicallyQuantizableLinear(D, D)
    layer.self_attn.out_proj = out


def _to_double(layer):
    layer.double()


def _transpose_weight_storage(layer):
    w = layer.linear1.weight
    w.data = w.data.t().contiguous().t()


def _train_with_dropout(layer):
    layer.train()
    for m in layer.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5


def _freeze(layer):
    layer.requires_grad_(False)


CHANGES = {
    "norm eps": _set_eps,
    "activation": _set_activation,
    "replaced linear2": _replace_linear,
    "replaced self_attn.out_proj": _replace_nested_linear,
    "double": _to_double,
    "weight strides": _transpose_weight_storage,
    "train with dropout": _train_with_dropout,
    "frozen parameters": _freeze,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_layer_runs_checked_again(change, checked_calls):
    layer = _encoder(False, True)
    x = _x(True)
    _, pad, _ = _masks("padding")
    with tf.use_backend("torch"):  # (every dtype, double included)
        layer(x, src_key_padding_mask=pad)
        layer(x, src_key_padding_mask=pad)
        CHANGES[change](layer)
        fresh = copy.deepcopy(layer)
        xs = x.double() if change == "double" else x
        checked_calls["n"] = 0
        torch.manual_seed(5)
        out = layer(xs, src_key_padding_mask=pad)
        assert checked_calls["n"] > 0, "a changed layer replayed a stale plan"
        torch.manual_seed(5)
        expected = fresh(xs, src_key_padding_mask=pad)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _other_length(x, pad):
    return x[:, :-1], pad[:, :-1]


def _other_layout(x, pad):
    return x.transpose(0, 1).contiguous().transpose(0, 1), pad


def _float_padding(x, pad):
    return x, torch.zeros(pad.shape).masked_fill(pad, float("-inf"))


def _grad_padding(x, pad):
    return x, torch.zeros(pad.shape).masked_fill(pad, -1e4).requires_grad_(True)


INPUT_CHANGES = {"length": _other_length, "strides": _other_layout, "float padding": _float_padding,
                 "padding that requires grad": _grad_padding}


@pytest.mark.parametrize("change", list(INPUT_CHANGES))
def test_changed_inputs_run_checked_again(change, checked_calls):
    layer = _encoder(False, True)
    x = _x(True)
    _, pad, _ = _masks("padding")
    with tf.use_backend("torch"):  # (which computes the gradient of a float mask)
        layer(x, src_key_padding_mask=pad)
        layer(x, src_key_padding_mask=pad)
        x2, pad2 = INPUT_CHANGES[change](x, pad)
        checked_calls["n"] = 0
        layer(x2, src_key_padding_mask=pad2)
        assert checked_calls["n"] > 0
    if change == "padding that requires grad":
        # The cpu backend's checks refuse it (no gradient for a float mask) where a stale plan
        # would have run it.
        with tf.use_backend("cpu"):
            layer(x, src_key_padding_mask=pad)
            layer(x, src_key_padding_mask=pad)
            with pytest.raises(ValueError, match="gradient of a float key_padding_mask"):
                layer(x2, src_key_padding_mask=pad2)


def test_bad_inputs_still_raise_after_a_replayed_call():
    layer = _encoder(False, True)
    x = _x(True)
    _, pad, _ = _masks("padding")
    layer(x, src_key_padding_mask=pad)
    layer(x, src_key_padding_mask=pad)
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, src_key_padding_mask=pad[:, :-1])
    with pytest.raises((TypeError, AssertionError)):
        layer(x, src_key_padding_mask=pad.int())


def test_hooks_run_checked_and_fire(checked_calls):
    layer = _encoder(False, True)
    x = _x(True)
    layer(x)
    layer(x)
    seen = []
    handle = layer.linear1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    checked_calls["n"] = 0
    layer(x)
    assert seen, "a hook under a replayable layer was skipped"
    handle.remove()
    global_handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(1))
    try:
        assert _lane.signature(layer, (x, None, None), False) is None
    finally:
        global_handle.remove()


def test_dispatch_modes_see_the_checked_path(checked_calls):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    layer = _encoder(False, True)
    x = _x(True)
    layer(x)
    layer(x)
    checked_calls["n"] = 0
    with Passthrough():
        layer(x)
    assert checked_calls["n"] > 0


def test_plans_are_bounded_and_not_pickled():
    layer = _encoder(False, True)
    for length in range(2, 2 + 2 * _lane._MAX_PLANS):
        x = _x(True, length)
        layer(x)
    assert 0 < len(_lane._PLANS[layer]) <= _lane._MAX_PLANS
    state = layer.__getstate__() if hasattr(layer, "__getstate__") else layer.__dict__
    assert not any("lane" in k or "plan" in k for k in state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("norm_first", [True, False], ids=["preLN", "postLN"])
def test_stack_replays_its_chain(backend, stack, grad, norm_first, checked_calls):
    torch.manual_seed(0)
    if stack == "encoder":
        layer = tfm.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=norm_first)
        model = tfm.TransformerEncoder(layer, 2, norm=tfm.LayerNorm(D), enable_nested_tensor=False)
    else:
        layer = tfm.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=norm_first)
        model = tfm.TransformerDecoder(layer, 2, norm=tfm.LayerNorm(D))
    fresh = copy.deepcopy(model)
    x, memory = _x(True), _x(True, S, seed=3)
    mask, pad, causal = _masks("causal+padding")

    def run(m):
        if stack == "encoder":
            return m(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)
        return m(x, memory, tgt_mask=mask, tgt_key_padding_mask=pad, tgt_is_causal=causal)

    with tf.use_backend(backend), torch.set_grad_enabled(grad):
        run(model)
        checked_calls["n"] = 0
        replay = run(model)
        assert checked_calls["n"] == 0
        reference = run(fresh)
        torch.testing.assert_close(replay, reference, rtol=0, atol=0)
        # A setting deep in the stack is part of its signature.
        model.layers[1].norm2.eps = fresh.layers[1].norm2.eps = 1e-3
        checked_calls["n"] = 0
        changed = run(model)
        assert checked_calls["n"] > 0
        torch.testing.assert_close(changed, run(fresh), rtol=0, atol=0)
    if grad:
        _assert_same_parameter_grads(replay, model, reference, fresh)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["self", "cross", "separate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_multihead_attention_replays(need_weights, kind, backend):
    torch.manual_seed(0)
    mha = tfm.MultiheadAttention(D, H, batch_first=True)
    fresh = copy.deepcopy(mha)
    x, memory = _x(True), _x(True, S, seed=3)
    q, k, v = {"self": (x, x, x), "cross": (x, memory, memory),
               "separate": (x, memory, memory.clone())}[kind]
    pad = torch.zeros(B, k.shape[1], dtype=torch.bool)
    pad[0, -2:] = True
    calls = {"n": 0}
    original = tf_functional.masked_softmax if need_weights else tf_functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    with tf.use_backend(backend), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tf_functional, original.__name__, counted)
        mha(q, k, v, key_padding_mask=pad, need_weights=need_weights)
        calls["n"] = 0
        out, weights = mha(q, k, v, key_padding_mask=pad, need_weights=need_weights)
        assert calls["n"] == 0
        ref, ref_weights = fresh(q, k, v, key_padding_mask=pad, need_weights=need_weights)
        # the identity of query / key / value is part of the signature
        mha(q, k.clone(), v, key_padding_mask=pad, need_weights=need_weights)
        assert calls["n"] > 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    if need_weights:
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)


def test_nested_and_non_tensor_inputs_get_the_checked_errors():
    layer = _encoder(False, True)
    nested = torch.nested.nested_tensor([torch.randn(3, D), torch.randn(5, D)])
    with pytest.raises(ValueError, match="NestedTensor"):  # alone it runs (test_modules_audit3.py)
        layer(nested, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="src"):
        layer([[0.0] * D])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_replay_on_gpu_matches_the_checked_call(backend, checked_calls):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    ctor = dict(dropout=0.0, batch_first=True, device="cuda", dtype=torch.bfloat16)
    layers = [tfm.TransformerEncoderLayer(256, 4, 1024, **ctor).eval(),
              tfm.TransformerDecoderLayer(256, 4, 1024, **ctor).eval()]
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    pad = torch.zeros(4, 128, dtype=torch.bool, device="cuda")
    pad[:, 100:] = True
    for layer in layers:
        fresh = copy.deepcopy(layer)
        args = (x,) if isinstance(layer, tfm.TransformerEncoderLayer) else (x, x)
        kwargs = ({"src_key_padding_mask": pad} if len(args) == 1
                  else {"tgt_key_padding_mask": pad, "memory_key_padding_mask": pad})
        with tf.use_backend(backend), torch.no_grad():
            layer(*args, **kwargs)
            checked_calls["n"] = 0
            replay = layer(*args, **kwargs)
            assert checked_calls["n"] == 0
            expected = fresh(*args, **kwargs)
        torch.testing.assert_close(replay, expected, rtol=0, atol=0)


def _other_backend(monkeypatch):
    monkeypatch.setenv("TRANSFORMER_FAST_BACKEND", "reference")


def _other_fastpath_switch(monkeypatch):
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(not was)
    return lambda: torch.backends.mha.set_fastpath_enabled(was)


def _other_interpreter_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if tf.backends.triton_interpreting() else "1")


GLOBAL_SWITCHES = {"backend selection": _other_backend, "torch's mha fastpath": _other_fastpath_switch,
                   "TRITON_INTERPRET": _other_interpreter_switch}


@pytest.mark.parametrize("switch", list(GLOBAL_SWITCHES))
def test_global_switches_are_part_of_the_signature(switch, checked_calls, monkeypatch):
    layer = _encoder(False, True).eval()
    x = _x(True)
    with torch.no_grad():
        layer(x)
        layer(x)
        checked_calls["n"] = 0
        restore = GLOBAL_SWITCHES[switch](monkeypatch)
        try:
            layer(x)
        finally:
            if restore is not None:
                restore()
    assert checked_calls["n"] > 0
