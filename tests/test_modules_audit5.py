"""The fifth outside audit of the modules (2026-11-29, fourth session): the masks a layer or a
stack hands its submodules where they run one by one, the calls a global module hook sees, the
final norm's calls on torch's NestedTensor path, torch's encoder-layer fast path under a CPU
autocast, and the LayerNorm parameter dtypes torch refuses.  Each case failed on the code before
the fix, compared with the same model left to torch."""
from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook

import transformer_fast

E, H, FF = 16, 2, 32


def _pair(model):
    ours = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # swap warns about the subclasses it leaves alone
        transformer_fast.swap(ours)
    return model, ours


def _padding(batch=2, length=5):
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[-1, 3:] = True  # left-aligned: torch's NestedTensor conditions
    return pad


class _AdditiveAttention(nn.MultiheadAttention):
    """A user's attention written against the float masks torch's encoder hands down (a
    subclass: swap leaves it alone)."""

    def forward(self, q, k, v, key_padding_mask=None, **kwargs):
        self.seen.append(None if key_padding_mask is None else key_padding_mask.dtype)
        b, n, e = q.shape
        q_, k_, v_ = nn.functional.linear(q, self.in_proj_weight, self.in_proj_bias).view(b, n, 3, e).unbind(2)
        scores = q_ @ k_.transpose(1, 2) / e**0.5
        if key_padding_mask is not None:
            scores = scores + key_padding_mask[:, None, :]
        return self.out_proj(scores.softmax(-1) @ v_), None


@pytest.mark.parametrize("training", [True, False])
def test_encoder_hands_float_masks_to_a_user_attention(training):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    layer.self_attn = _AdditiveAttention(E, 1, batch_first=True)
    theirs, ours = _pair(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train(training))
    x, pad = torch.randn(2, 5, E), _padding()
    outs = []
    for model in (theirs, ours):
        for mod in model.layers:
            mod.self_attn.seen = []
        outs.append(model(x, src_key_padding_mask=pad))
        assert [m.self_attn.seen for m in model.layers] == [[torch.float32]] * 2
    torch.testing.assert_close(outs[1][~pad], outs[0][~pad])


def test_encoder_layer_hands_float_masks_to_hooks_and_subclasses():
    torch.manual_seed(0)
    x, pad = torch.randn(2, 5, E), _padding()
    seen = {}
    theirs, ours = _pair(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 1,
                                               enable_nested_tensor=False))
    for name, model in (("torch", theirs), ("ours", ours)):
        seen[name] = []
        model.layers[0].self_attn.register_forward_pre_hook(
            lambda m, a, k, name=name: seen[name].append(k["key_padding_mask"].dtype), with_kwargs=True)
        model(x, src_key_padding_mask=pad)
    assert seen["ours"] == seen["torch"] == [torch.float32]

    class Recording(nn.TransformerEncoderLayer):
        def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
            self.seen = src_key_padding_mask.dtype
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)

    theirs, ours = _pair(nn.TransformerEncoder(Recording(E, H, FF, batch_first=True), 1,
                                               enable_nested_tensor=False))
    for model in (theirs, ours):
        model(x, src_key_padding_mask=pad)
    assert ours.layers[0].seen == theirs.layers[0].seen == torch.float32


def test_nested_path_calls_the_final_norm_once():
    torch.manual_seed(0)
    theirs, ours = _pair(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2,
                                               norm=nn.LayerNorm(E)).eval())
    x, pad = torch.randn(2, 5, E), _padding()
    calls, outs = {}, []
    for name, model in (("torch", theirs), ("ours", ours)):
        calls[name] = []
        model.norm.register_forward_hook(lambda m, i, o, name=name: calls[name].append(tuple(i[0].shape)))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's NestedTensor prototype warning
            outs.append(model(x, src_key_padding_mask=pad))
    assert calls["ours"] == calls["torch"] == [(2, 5, E)]
    torch.testing.assert_close(outs[1], outs[0])


def _global_hook_counts(model, *inputs, **kwargs):
    seen = []
    handle = register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(*inputs, **kwargs)
    finally:
        handle.remove()
    return collections.Counter(seen), out


@pytest.mark.parametrize("training", [False, True])
def test_global_hooks_see_the_calls_torch_makes(training):
    """torch's encoder-layer fast path (eval, no grad) calls no submodule: a global hook sees
    the layer alone; in training both call every submodule."""
    torch.manual_seed(0)
    theirs, ours = _pair(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True).train(training))
    x = torch.randn(2, 5, E)
    (count_t, out_t), (count_o, out_o) = (_global_hook_counts(m, x) for m in (theirs, ours))
    assert count_o == count_t
    torch.testing.assert_close(out_o, out_t)

    torch.manual_seed(0)
    theirs, ours = _pair(nn.Transformer(E, H, 2, 2, FF, dropout=0.0, batch_first=True).train(training))
    src, tgt = torch.randn(2, 5, E), torch.randn(2, 4, E)
    pad = _padding()
    (count_t, out_t), (count_o, out_o) = (
        _global_hook_counts(m, src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)
        for m in (theirs, ours))
    assert count_o == count_t
    torch.testing.assert_close(out_o, out_t)


CAST_CASES = [  # (parameters, input, autocast): torch's fast path casts all to the autocast dtype
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float32, torch.float16),
    (torch.bfloat16, torch.float16, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float16),
    (torch.float32, torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("params,inp,cast", CAST_CASES)
@pytest.mark.parametrize("stack", [False, True])
def test_encoder_fast_path_under_cpu_autocast(params, inp, cast, stack):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False) if stack else layer
    theirs, ours = _pair(model.to(params).eval())
    x = torch.randn(2, 5, E, dtype=inp)
    outs = []
    for model in (theirs, ours):
        with torch.no_grad(), torch.autocast("cpu", dtype=cast):
            outs.append(model(x, src_key_padding_mask=_padding()))
    assert outs[1].dtype == outs[0].dtype == cast
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def _f64_with_f32_norms(layer):
    layer.double()
    for name in ("norm1", "norm2", "norm3"):
        if hasattr(layer, name):
            getattr(layer, name).float()
    return torch.float64


def _bf16_with_f32_norm_weights(layer):
    layer.bfloat16()
    for name in ("norm1", "norm2", "norm3"):
        if hasattr(layer, name):
            norm = getattr(layer, name)
            norm.weight = nn.Parameter(norm.weight.float())  # the bias stays bf16
    return torch.bfloat16


@pytest.mark.parametrize("recipe", [_f64_with_f32_norms, _bf16_with_f32_norm_weights])
@pytest.mark.parametrize("cls", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
@pytest.mark.parametrize("norm_first", [False, True])
def test_layer_norm_parameter_dtypes_torch_refuses(recipe, cls, norm_first):
    torch.manual_seed(0)
    theirs = cls(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    dtype = recipe(theirs)
    theirs, ours = _pair(theirs)
    x = torch.randn(2, 5, E, dtype=dtype)
    args = (x,) if cls is nn.TransformerEncoderLayer else (x, x)
    with pytest.raises(RuntimeError, match="mixed dtype") as torch_error:
        theirs(*args)
    with pytest.raises(RuntimeError, match="mixed dtype") as our_error:
        ours(*args)
    assert str(our_error.value) == str(torch_error.value)


def test_layer_norm_float32_parameters_with_a_16_bit_layer_still_fuse():
    """The mix F.layer_norm takes (16-bit x, float32 weight and bias) keeps the fused path."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True).bfloat16()
    for norm in (theirs.norm1, theirs.norm2):
        norm.float()
    theirs, ours = _pair(theirs)
    x = torch.randn(2, 5, E, dtype=torch.bfloat16)
    assert ours._can_fuse(x)
    torch.testing.assert_close(ours(x), theirs(x), atol=3e-2, rtol=3e-2)
