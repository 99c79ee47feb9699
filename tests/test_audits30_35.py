"""From the thirtieth to thirty-fifth outside audits (2026-11-30, thirteenth session): the
ecosystem tools people apply to torch.nn Transformer models, used on swapped ones (the ONNX export
has its own file, tests/test_onnx_export.py)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import transformer_fast as tf
from conftest import require_backend

E, H, FF = 64, 4, 64


def _modules(batch_first):
    return {
        "mha": (nn.MultiheadAttention(E, H, batch_first=batch_first), lambda m, x: m(x, x, x)[0]),
        "encoder_layer": (nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first),
                          lambda m, x: m(x)),
        "decoder_layer": (nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first),
                          lambda m, x: m(x, x)),
        "transformer": (nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=batch_first),
                        lambda m, x: m(x, x)),
    }


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("name", ["mha", "encoder_layer", "decoder_layer", "transformer"])
def test_training_on_an_inference_tensor(name, batch_first, backend):
    """Data made under torch.inference_mode, then trained on: torch's batch-first modules take it
    (their in-projection runs on a transposed copy), ours raised "Inference tensors cannot be
    saved for backward" in the in-projection.  Ours take it either layout, with the gradients of
    an ordinary copy of the input."""
    require_backend(backend)
    torch.manual_seed(0)
    with torch.inference_mode():
        x_inf = torch.randn(2, 9, E)
    x = x_inf.clone()
    assert x_inf.is_inference() and not x.is_inference()
    module, run = _modules(batch_first)[name]
    ours = nn.ModuleList([copy.deepcopy(module)])
    tf.swap(ours)
    ours = ours[0]
    twin = copy.deepcopy(ours)
    with tf.use_backend(backend):
        run(ours, x_inf).square().sum().backward()
        run(twin, x).square().sum().backward()
    for (n, p), q in zip(ours.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    if batch_first:  # torch's own module takes it too
        run(module, x_inf).square().sum().backward()


def test_strict_export_has_no_side_effect_warning():
    """torch.export(strict=True) warned of a side effect in forward: the thread-local list that
    records backend choices for the replays (appended and popped while tracing)."""
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), 1,
                                  enable_nested_tensor=False).eval()
    tf.swap(model)
    x = torch.randn(2, 5, E)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = torch.export.export(model, (x,), strict=True)
    side_effects = [str(w.message) for w in caught if "side effect" in str(w.message)]
    assert not side_effects, side_effects
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x), rtol=1e-5, atol=1e-5)
