"""The third outside audit of the modules (2026-11-29, second session): what the fused paths
skip that torch's layers call (a ``forward`` set on a submodule's instance, a block set on the
layer's), weights held outside the modules' parameters, and the NestedTensor that torch's
encoder hands a swapped layer.  Each case failed on the code before the fix, compared with the
same model left to torch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import transformer_fast

E, H, FF = 16, 2, 32
MODES = ["train", "eval_grad", "eval_no_grad"]


def _run(model, mode, *inputs, **kwargs):
    model.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        return model(*inputs, **kwargs)


def _torch_and_swapped(build):
    models = []
    for _ in range(2):  # built twice from one seed: a tied (non-leaf) weight cannot be deep-copied
        torch.manual_seed(0)
        models.append(build())
    transformer_fast.swap(models[1])
    return tuple(models)


def _scaled(f, factor):
    def patched(*args, **kwargs):
        out = f(*args, **kwargs)
        return (out[0] * factor, None) if isinstance(out, tuple) else out * factor

    return patched


def _encoder_layer():
    return nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)


def _decoder_layer():
    return nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True)


def _stack():
    return nn.TransformerEncoder(_encoder_layer(), 2, norm=nn.LayerNorm(E), enable_nested_tensor=False)


# (model, where the forward is set): torch's layers and stacks call these modules by name.
PATCHES = {
    "layer.linear1": (_encoder_layer, lambda m: m.linear1),
    "layer.norm1": (_encoder_layer, lambda m: m.norm1),
    "layer.self_attn": (_encoder_layer, lambda m: m.self_attn),
    "decoder_layer.multihead_attn": (_decoder_layer, lambda m: m.multihead_attn),
    "stack.layers[0]": (_stack, lambda m: m.layers[0]),
    "stack.norm": (_stack, lambda m: m.norm),
}


@pytest.mark.parametrize("when", ["before_swap", "after_swap", "after_calls"])
@pytest.mark.parametrize("where", list(PATCHES))
def test_a_forward_set_on_a_submodule_instance_is_honoured(where, when):
    """``module.forward = ...`` (accelerate's hooks, ad-hoc patches): ignored on every call
    (linear1, norms, a stack's layer or norm), or on the replayed calls from the second on
    (attention), or an AssertionError from the second call (set before swap)."""
    build, target = PATCHES[where]
    torch.manual_seed(0)
    ref = build()
    ours = copy.deepcopy(ref)
    x = torch.randn(2, 5, E)
    inputs = (x, torch.randn(2, 7, E)) if where.startswith("decoder") else (x,)
    for model in (ref, ours):
        if when == "before_swap":
            target(model).forward = _scaled(target(model).forward, 3.0)
    transformer_fast.swap(ours)
    if when == "after_calls":
        for _ in range(2):
            _run(ours, "train", *inputs)
    for model in (ref, ours):
        if when != "before_swap":
            target(model).forward = _scaled(target(model).forward, 3.0)
    for mode in MODES:  # torch's inference fast path ignores the forward: eval_grad is torch's
        want = _run(ref, "eval_grad" if mode == "eval_no_grad" else mode, *inputs)
        for _ in range(3):  # the first call records, the later ones replay
            torch.testing.assert_close(_run(ours, mode, *inputs), want)


def test_a_block_set_on_the_layer_instance_is_honoured():
    ref, ours = _torch_and_swapped(_encoder_layer)
    x = torch.randn(2, 5, E)
    for _ in range(2):
        _run(ours, "eval_no_grad", x)
    for model in (ref, ours):
        model._sa_block = _scaled(model._sa_block, 2.0)
    for mode in MODES:
        # torch's inference fast path ignores the block (it runs its fused C++ layer): ours
        # honours it there too, giving torch's numbers with grad enabled.
        want = _run(ref, "eval_grad" if mode == "eval_no_grad" else mode, x)
        for _ in range(3):
            torch.testing.assert_close(_run(ours, mode, x), want)


def _plain_tensor(module, name, as_buffer=False):
    value = getattr(module, name).detach().clone() * 1.5
    delattr(module, name)
    if as_buffer:
        module.register_buffer(name, value)
    else:
        setattr(module, name, value)


WEIGHTS = {
    "linear2.weight tied to linear1.weight.t()": lambda m: (delattr(m.linear2, "weight"),
                                                            setattr(m.linear2, "weight", m.linear1.weight.t())),
    "linear1.weight plain": lambda m: _plain_tensor(m.linear1, "weight"),
    "norm1.weight plain": lambda m: _plain_tensor(m.norm1, "weight"),
    "norm2.bias plain": lambda m: _plain_tensor(m.norm2, "bias"),
    "in_proj_weight plain": lambda m: _plain_tensor(m.self_attn, "in_proj_weight"),
    "in_proj_bias buffer": lambda m: _plain_tensor(m.self_attn, "in_proj_bias", as_buffer=True),
    "out_proj.bias plain": lambda m: _plain_tensor(m.self_attn.out_proj, "bias"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", ["encoder", "decoder"])
@pytest.mark.parametrize("weight", list(WEIGHTS))
def test_weights_outside_the_parameters(weight, layer, mode):
    """A weight held as a plain tensor attribute or a buffer: KeyError from the second call (the
    C++ inference call read ``_parameters``), or a norm weight or bias silently left out."""
    def build():
        m = _encoder_layer() if layer == "encoder" else _decoder_layer()
        WEIGHTS[weight](m)
        return m

    ref, ours = _torch_and_swapped(build)
    inputs = (torch.randn(2, 5, E),) if layer == "encoder" else (torch.randn(2, 5, E), torch.randn(2, 7, E))
    ref_out = _run(ref, mode, *inputs)
    for _ in range(3):
        torch.testing.assert_close(_run(ours, mode, *inputs), ref_out)


@pytest.mark.parametrize("swap_what", ["layers", "subclass"])
def test_torch_encoder_hands_swapped_layers_a_nested_tensor(swap_what):
    """torch's TransformerEncoder left alone by swap (its layers swapped alone, or a subclass
    swap skips) passes its layers a NestedTensor in inference with a padding mask; ours
    raised InputError."""
    class MyEncoder(nn.TransformerEncoder):
        pass

    torch.manual_seed(0)
    enc = MyEncoder(_encoder_layer(), 2).eval()
    ours = copy.deepcopy(enc)
    transformer_fast.swap(ours.layers if swap_what == "layers" else ours)
    assert type(ours) is MyEncoder and type(ours.layers[0]) is not nn.TransformerEncoderLayer
    x = torch.randn(3, 6, E)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] + [True] * 5])
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=pad)
        for _ in range(2):
            out = ours(x, src_key_padding_mask=pad)
            assert not out.is_nested
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_nested_tensor_comes_back_nested():
    torch.manual_seed(0)
    ref = _encoder_layer().eval()
    ours = copy.deepcopy(ref)
    transformer_fast.swap(ours)
    rows = [torch.randn(n, E) for n in (4, 1, 6)]
    with torch.no_grad():
        out = ours(torch.nested.nested_tensor(rows))
    assert out.is_nested
    for row, got in zip(rows, out.unbind()):
        with torch.no_grad():
            torch.testing.assert_close(got, ref(row[None])[0], rtol=1e-5, atol=1e-5)


def test_unswap_warns_about_a_module_it_leaves():
    """A module of ours parametrized after swap is a subclass torch's parametrize made: unswap
    left it ours with no word outside the report."""
    import torch.nn.utils.parametrize as parametrize

    model = nn.Sequential(_encoder_layer())
    transformer_fast.swap(model)

    class Scale(nn.Module):
        def forward(self, w):
            return w * 1.0

    parametrize.register_parametrization(model[0].linear1, "weight", Scale())
    parametrize.register_parametrization(model[0].self_attn, "in_proj_weight", Scale())
    with pytest.warns(UserWarning, match="unswap: 0.self_attn"):
        report = transformer_fast.unswap(model)
    assert [name for name, _, _ in report.skipped] == ["0.self_attn"]
