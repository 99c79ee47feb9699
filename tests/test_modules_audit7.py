"""Regressions from the seventh outside audit of the modules against torch.nn (2026-11-30)."""
import pytest
import torch

from transformer_fast import nn as tnn

D, H, FF = 8, 2, 16


def _pair(build):
    torch.manual_seed(0)
    theirs = build(torch.nn)
    ours = build(tnn)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_decoder_layer_takes_a_memory_of_the_cross_attentions_kdim(mode):
    """A decoder layer whose multihead_attn has kdim = vdim != d_model takes a memory of that
    width, as torch's (it refused: "memory must have d_model=8 features"), with torch's numbers."""
    def build(lib):
        layer = lib.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True)
        layer.multihead_attn = lib.MultiheadAttention(D, H, dropout=0.0, batch_first=True, kdim=6, vdim=6)
        return layer.train(mode == "train")

    theirs, ours = _pair(build)
    tgt, memory = torch.randn(2, 5, D), torch.randn(2, 3, 6)
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        for _ in range(2):  # the checked call and the replayed one
            torch.testing.assert_close(ours(tgt, memory), theirs(tgt, memory), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="memory must have multihead_attn.kdim=6"):
        ours(tgt, torch.randn(2, 3, D))


def test_is_causal_without_a_mask_is_checked_after_the_shapes():
    """torch checks the inputs' shapes before the is_causal hint's mask: a malformed
    key_padding_mask raises its AssertionError first (ours raised the hint's RuntimeError)."""
    x = torch.randn(2, 5, D)
    bad = torch.zeros(1, 2, 5, dtype=torch.bool)
    for mha in (torch.nn.MultiheadAttention(D, H), tnn.MultiheadAttention(D, H)):
        with pytest.raises(AssertionError, match="key_padding_mask"):
            mha(x, x, x, key_padding_mask=bad, is_causal=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blocks"])
def test_layer_errors_name_the_layers_arguments(fused):
    """An input error raised inside a layer's attention (worded with the attention's argument
    names, as torch's) also names the layer's argument (DESIGN section 9); torch's type and
    message start are kept."""
    x, memory = torch.randn(2, 5, D), torch.randn(2, 4, D)
    enc = tnn.TransformerEncoderLayer(D, H, FF, batch_first=True)
    dec = tnn.TransformerDecoderLayer(D, H, FF, batch_first=True)
    if not fused:  # a hook on a sublayer keeps the layers on torch's block methods
        for layer in (enc, dec):
            layer.self_attn.register_forward_hook(lambda *args: None)
    cases = [
        (lambda: enc(x, src_mask=torch.zeros(4, 4)), "src_mask is its attn_mask"),
        (lambda: enc(x, src_key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), "src_key_padding_mask"),
        (lambda: dec(x, memory, memory_mask=torch.zeros(5, 5)), "memory_mask its attn_mask"),
        (lambda: dec(x, memory[:1]), "memory its key and value"),
        (lambda: dec(x, memory, memory_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         "memory_key_padding_mask its key_padding_mask"),
        (lambda: dec(x, memory, tgt_mask=torch.zeros(5, 4)), "tgt_mask is its attn_mask"),
        (lambda: dec(x, memory, memory_is_causal=True), "memory_is_causal its is_causal"),
    ]
    torch_enc = torch.nn.TransformerEncoderLayer(D, H, FF, batch_first=True)
    torch_dec = torch.nn.TransformerDecoderLayer(D, H, FF, batch_first=True)
    peers = [lambda: torch_enc(x, src_mask=torch.zeros(4, 4)),
             lambda: torch_enc(x, src_key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
             lambda: torch_dec(x, memory, memory_mask=torch.zeros(5, 5)),
             lambda: torch_dec(x, memory[:1]),
             lambda: torch_dec(x, memory, memory_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
             lambda: torch_dec(x, memory, tgt_mask=torch.zeros(5, 4)),
             lambda: torch_dec(x, memory, memory_is_causal=True)]
    for (call, named), peer in zip(cases, peers):
        with pytest.raises(Exception) as theirs:
            peer()
        with pytest.raises(Exception) as ours:
            call()
        assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
        assert named in str(ours.value), str(ours.value)
