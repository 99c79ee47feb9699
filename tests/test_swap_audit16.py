"""From the sixteenth outside audit (swap / unswap on real-world models; 2026-11-30, tenth
session): methods stored on a module's instance across a swap, and one warning per subclass."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import transformer_fast
from transformer_fast import modules as M

LAYERS = {
    "MultiheadAttention": (lambda: nn.MultiheadAttention(16, 2, batch_first=True),
                           lambda x: (x, x, x)),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                lambda x: (x,)),
    "TransformerDecoderLayer": (lambda: nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                lambda x: (x, x)),
    "TransformerEncoder": (lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False),
        lambda x: (x,)),
}


def _wrap_forward(module):
    """What accelerate's add_hook_to_module does: the bound forward kept on the instance,
    a wrapper installed as the instance's forward."""
    module._old_forward = module.forward
    module.forward = lambda *args, **kwargs: module._old_forward(*args, **kwargs)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_instance_forward_wrappers_follow_swap_and_unswap(kind):
    make, args = LAYERS[kind]
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(2, 5, 16)
    want = module(*args(x))
    # wrapped after swap, then unswapped: torch's forward runs (ours raised AttributeError)
    transformer_fast.swap(module)
    _wrap_forward(module)
    transformer_fast.unswap(module)
    assert module._old_forward.__func__ is getattr(nn, kind).forward
    torch.testing.assert_close(module(*args(x)), want, rtol=0, atol=0)
    # wrapped before swap: ours runs after it (torch's kept running, unreported)
    transformer_fast.swap(module)
    assert module._old_forward.__func__ is getattr(M, kind).forward
    torch.testing.assert_close(module(*args(x)), want, rtol=1e-5, atol=1e-6)


def test_one_warning_per_subclass_left_alone():
    class MyNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(*(MyNorm(8) for _ in range(5)), nn.LayerNorm(8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report = transformer_fast.swap(model)
    messages = [str(w.message) for w in record if "transformer_fast.swap" in str(w.message)]
    assert len(messages) == 1, messages
    assert "0, 1, 2 and 2 more" in messages[0] and "MyNorm" in messages[0]
    assert len(report.skipped) == 5 and len(report.swapped) == 1
