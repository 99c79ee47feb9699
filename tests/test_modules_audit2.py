"""The second outside audit of the modules (2026-11-29): replayed calls (modules/_lane.py) and
the inference C++ path (modules/_native.py) against torch.nn on calls that change from one to
the next, modules swapped for foreign ones, parametrized weights and overridden blocks; and
TransformerEncoder's constructor warning.  Each case fails on the code before the fix."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import transformer_fast
import transformer_fast.modules as M

E, H, FF = 16, 2, 32


def _pair(torch_cls, ours_cls, *args, **kwargs):
    torch.manual_seed(0)
    ref = torch_cls(*args, **kwargs)
    ours = ours_cls(*args, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_a_mask_added_after_the_first_call(mode):
    """The layer records while its cross-attention replays its own earlier call: the record
    missed that attention's op and every later call raised AssertionError."""
    ref, ours = _pair(nn.Transformer, M.Transformer, E, H, 1, 1, FF, dropout=0.0, batch_first=True)
    if mode != "train":
        ref.eval(), ours.eval()
    src, tgt = torch.randn(2, 7, E), torch.randn(2, 5, E)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    calls = [{}, {"tgt_mask": causal}, {"tgt_mask": causal}, {"tgt_key_padding_mask": pad},
             {"tgt_mask": causal, "tgt_key_padding_mask": pad}, {"tgt_mask": causal}, {}]
    with torch.set_grad_enabled(mode == "train"):
        for kw in calls:
            _close(ours(src, tgt, **kw), ref(src, tgt, **kw))


def test_a_layer_called_alone_then_in_its_stack():
    torch.manual_seed(0)
    layer = M.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    stack = M.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    ref.load_state_dict(stack.state_dict())
    x = torch.randn(2, 6, E)
    for _ in range(2):
        stack.layers[0](x)
        stack.layers[1](x)
    for _ in range(3):
        _close(stack(x), ref(x))


def test_a_norm_eps_changed_between_calls():
    ref, ours = _pair(nn.TransformerEncoderLayer, M.TransformerEncoderLayer, E, H, FF, dropout=0.0,
                      batch_first=True)
    x = torch.randn(2, 5, E)
    ours(x)
    ours.norm2.eps = ref.norm2.eps = 1e-6
    for _ in range(3):
        _close(ours(x), ref(x))


def test_a_foreign_attention_module_inside_our_layer():
    """swap() leaves a subclass of torch's MultiheadAttention alone but swaps the layer around
    it: the layer's replay called a method only ours has (AttributeError on the second call)."""
    class MyMHA(nn.MultiheadAttention):
        pass

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    layer.self_attn = MyMHA(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    expected = layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer_fast.swap(layer)
    assert type(layer) is M.TransformerEncoderLayer and type(layer.self_attn) is MyMHA
    for _ in range(3):
        _close(layer(x), expected)


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_an_attention_subclass_forward_is_called_every_time(mode):
    class ZeroMHA(M.MultiheadAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out * 0.0, weights

    torch.manual_seed(0)
    layer = M.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    layer.multihead_attn = ZeroMHA(E, H, batch_first=True)
    if mode != "train":
        layer.eval()
    x, memory = torch.randn(2, 5, E), torch.randn(2, 4, E)
    with torch.set_grad_enabled(mode == "train"):
        h = layer.norm1(x + layer._sa_block(x, None, None))
        expected = layer.norm3(layer.norm2(h) + layer._ff_block(layer.norm2(h)))
        for _ in range(3):
            _close(layer(x, memory), expected)


@pytest.mark.parametrize("where", ["linear1", "linear2", "out_proj"])
@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_parametrized_weights(where, mode):
    """The inference C++ path read linear.weight from the module's parameter dict, where a
    parametrization (weight_norm, spectral_norm, LoRA-style) has none: KeyError on call 2."""
    class Double(nn.Module):
        def forward(self, w):
            return 2.0 * w

    ref, ours = _pair(nn.TransformerEncoderLayer, M.TransformerEncoderLayer, E, H, FF, dropout=0.0,
                      batch_first=True)
    for layer in (ref, ours):
        module = layer.self_attn.out_proj if where == "out_proj" else getattr(layer, where)
        parametrize.register_parametrization(module, "weight", Double())
        if mode != "train":
            layer.eval()
    x = torch.randn(2, 5, E)
    with torch.set_grad_enabled(mode == "train"):
        for _ in range(3):
            _close(ours(x), ref(x))


def test_overridden_blocks_are_called():
    """torch's layers call _sa_block / _mha_block / _ff_block; a subclass overriding one of them
    gets it called on every call (the fused path computed the blocks itself)."""
    def no_attention(base, block):
        def zero(self, x, *args, **kwargs):
            return torch.zeros_like(x)
        return type("NoAttn", (base,), {block: zero})

    x, memory = torch.randn(2, 5, E), torch.randn(2, 4, E)
    for torch_base, ours_base, block in ((nn.TransformerEncoderLayer, M.TransformerEncoderLayer, "_sa_block"),
                                         (nn.TransformerEncoderLayer, M.TransformerEncoderLayer, "_ff_block"),
                                         (nn.TransformerDecoderLayer, M.TransformerDecoderLayer, "_mha_block")):
        ref, ours = _pair(no_attention(torch_base, block), no_attention(ours_base, block), E, H, FF,
                          dropout=0.0, batch_first=True)
        args = (x,) if torch_base is nn.TransformerEncoderLayer else (x, memory)
        for _ in range(3):
            _close(ours(*args), ref(*args))


@pytest.mark.parametrize("kwargs", [
    {"norm_first": True}, {"batch_first": False}, {"bias": False}, {"activation": torch.tanh},
    {"layer_norm_eps": 1e-5}, {},
], ids=["norm_first", "not_batch_first", "no_bias", "activation", "plain", "defaults"])
@pytest.mark.parametrize("heads", [2, 1])
def test_encoder_constructor_warning_is_torchs(kwargs, heads):
    def warned(mod):
        kw = dict({"batch_first": True}, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            enc = mod.TransformerEncoder(mod.TransformerEncoderLayer(E, heads, FF, **kw), 2)
        return [str(w.message) for w in caught], enc.use_nested_tensor

    assert warned(M) == warned(nn)
