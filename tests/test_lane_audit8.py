"""Regressions from the eighth outside audit (2026-11-30): a replayed call (modules/_lane.py,
modules/_native.py) must compute what a fresh module computes, and what torch.nn computes."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf

D, H, FF = 32, 2, 64


def _pair(cls, **kwargs):
    torch.manual_seed(0)
    ours = getattr(tf, cls)(D, H, **kwargs)
    theirs = getattr(torch.nn, cls)(D, H, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("masks", ["attn", "padding", "both", "large_both"])
@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
def test_autocast_float_masks_replay_as_torch(masks, backend):
    """Under CPU autocast torch adds a float key_padding_mask into attn_mask and rounds the sum
    to bf16 once (its SDPA's autocast); the checked call rounded attn_mask alone first, the
    replays not at all."""
    ours, theirs = _pair("MultiheadAttention", batch_first=True)
    x = torch.randn(2, 5, D)
    big = masks == "large_both"
    am = (300.0 + torch.randn(5, 5)) if big else torch.randn(5, 5) * 3
    kpm = torch.full((2, 5), -300.0) if big else torch.randn(2, 5) * 3
    am, kpm = (None if masks == "padding" else am), (None if masks == "attn" else kpm)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), tf.use_backend(backend):
        want = theirs(x, x, x, need_weights=False, attn_mask=am, key_padding_mask=kpm)[0]
        outs = [ours(x, x, x, need_weights=False, attn_mask=am, key_padding_mask=kpm)[0] for _ in range(3)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # the replays compute what the checked call did
    # ~1 bf16 ulp of accumulation order between kernels; the mask rounding made 0.36 (large)
    torch.testing.assert_close(outs[0].float(), want.float(), rtol=0, atol=8e-3)


def test_decoder_layer_replays_autocast_float_masks_as_torch():
    torch.manual_seed(0)
    ours = tf.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True)
    theirs = torch.nn.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    tgt, memory = torch.randn(2, 5, D), torch.randn(2, 4, D)
    mask = 300.0 + torch.randn(5, 5)
    padding = torch.full((2, 5), -300.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = theirs(tgt, memory, tgt_mask=mask, tgt_key_padding_mask=padding)
        for _ in range(3):
            got = ours(tgt, memory, tgt_mask=mask, tgt_key_padding_mask=padding)
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)


def test_inference_tensor_inputs_with_trainable_norms():
    """Features made under inference_mode, LayerNorm-only training: every call works and
    matches torch (the 2nd call raised "Inference tensors cannot be saved for backward")."""
    torch.manual_seed(0)
    ours = tf.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True)
    theirs = torch.nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    for m in (ours, theirs):
        m.requires_grad_(False)
        m.norm1.requires_grad_(True)
        m.norm2.requires_grad_(True)
    with torch.inference_mode():
        x = torch.randn(2, 5, D)
    for _ in range(3):
        want = theirs(x)
        got = ours(x)
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_autocast_state_is_part_of_the_signature():
    """The encoder layer's torch fast-path mimicry reads CUDA's autocast state (torch's
    argument-less is_autocast_enabled): a plan recorded under it is not replayed without it."""
    torch.manual_seed(0)
    ours = tf.TransformerEncoderLayer(D, 4, FF, 0.0, batch_first=True).eval()
    x = torch.randn(2, 5, D)
    mask = torch.zeros(5, 5)
    mask[:, 0] = -2.0
    with torch.no_grad():
        torch.set_autocast_enabled("cuda", True)
        try:
            ours(x, src_mask=mask)
            ours(x, src_mask=mask)
        finally:
            torch.set_autocast_enabled("cuda", False)
        got = ours(x, src_mask=mask)
        fresh = copy.deepcopy(ours)(x, src_mask=mask)
    assert torch.equal(got, fresh)


def test_an_activation_edited_in_place_is_read_again():
    """A functools.partial activation whose keywords change between calls: the native call's
    activation follows it (the replay's signature cannot see inside the partial)."""
    act = functools.partial(F.gelu, approximate="tanh")
    torch.manual_seed(0)
    ours = tf.TransformerEncoderLayer(D, 4, FF, 0.0, activation=act, batch_first=True).eval()
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        ours(x)
        ours(x)
        act.keywords["approximate"] = "none"
        got = ours(x)
        fresh = copy.deepcopy(ours)(x)
    assert torch.equal(got, fresh)


def test_children_swapped_between_slots_change_the_signature():
    """Two submodules exchanged between their slots while the module walk meets them in the
    same order: the replay must not keep the old norm1 / norm2 roles (eps 1e-5 / 0.5)."""
    torch.manual_seed(0)
    ours = tf.TransformerEncoderLayer(D, 4, FF, 0.0, batch_first=True).eval()
    ours.norm2.eps = 0.5
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        ours(x)
        ours(x)
        mods = ours._modules
        a, b = mods["norm1"], mods["norm2"]
        tail = {k: mods.pop(k) for k in list(mods) if k not in ("self_attn", "linear1", "dropout", "linear2")}
        mods["norm2"], mods["norm1"] = a, b
        for k in ("dropout1", "dropout2"):
            mods[k] = tail[k]
        got = ours(x)
        fresh = copy.deepcopy(ours)(x)
    assert ours.norm1.eps == 0.5
    assert torch.equal(got, fresh)
