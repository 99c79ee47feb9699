"""From the fifteenth outside audit (lifetimes, caches, threads, re-entrancy; 2026-11-30, tenth
session).  Each test failed before its fix."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import transformer_fast as tf
from transformer_fast.modules import _lane

E = 32


class _MixingActivation(nn.Module):
    """A token-mixing activation, gelu(h + attn(h)): the layer calls user code that calls
    another module of ours."""

    def __init__(self, d):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, h):
        return nn.functional.gelu(h + self.attn(h, h, h, need_weights=False)[0])


@pytest.mark.parametrize("grad", [False, True])
def test_an_activation_calling_our_modules_replays_in_step(grad):
    """The layer's record took in the inner module's ops, which its replay (the inner module
    replaying its own calls) never handed out: every call after the first raised
    AssertionError.  The activation's code now runs outside the layer's record."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, 2, E, 0.0, activation=_MixingActivation(E), batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train(grad)
    x = torch.randn(2, 5, E)
    with torch.set_grad_enabled(grad):
        want = model(x)
        tf.swap(model)
        for _ in range(3):
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


def test_tensor_attributes_are_not_kept_by_the_replay_cache():
    """A subclass storing its last output as an attribute: the replay key held every stored
    tensor (up to 8 a module, with their autograd graphs) and missed on each call."""

    class Keeping(tf.TransformerEncoderLayer):
        def forward(self, src, *args, **kwargs):
            out = super().forward(src, *args, **kwargs)
            self.last_output = out
            return out

    torch.manual_seed(0)
    layer = Keeping(E, 2, 64, 0.0, batch_first=True)
    refs = []
    for _ in range(12):
        out = layer(torch.randn(2, 5, E, requires_grad=True))
        refs.append(weakref.ref(out))
        del out
    gc.collect()
    assert sum(r() is not None for r in refs) == 1  # the last one, held by the attribute
    # two signatures: before the attribute exists, and after (the outputs' metadata agree)
    assert len(_lane._PLANS.get(layer, {})) == 2


def test_eviction_when_another_thread_evicted_first():
    """Two threads evicting from a full plan cache popped the same oldest entry: the second got
    KeyError (the audit saw it at 6 in 78,774 threaded calls).  Here the other thread's
    eviction happens, deterministically, between this one's look at the oldest key and its pop."""

    class EvictedMeanwhile(dict):
        def __iter__(self):
            oldest = next(super().__iter__())
            super().pop(oldest)  # the other thread's eviction
            yield oldest

    owner = nn.Linear(1, 1)
    plans = EvictedMeanwhile(((i, ()), ((), {})) for i in range(_lane._MAX_PLANS))
    _lane._PLANS[owner] = plans
    _lane.remember(owner, ("new", ()), [])
    assert ("new", ()) in plans and len(plans) == _lane._MAX_PLANS


def test_decodings_in_two_threads_keep_eval_and_restore_the_training_mode():
    """Two threads decoding a model left in training: the second saved the modes the first had
    set to eval (and restored eval at its end), and the first restored training while the
    second still decoded (dropout in its steps)."""
    torch.manual_seed(0)
    vocab = 20
    model = tf.models.Seq2SeqTransformer(vocab, vocab, d_model=32, nhead=2, num_encoder_layers=1,
                                         num_decoder_layers=1, dim_feedforward=64, dropout=0.5).train()
    src = torch.randint(3, vocab, (3, 7))
    want = model.greedy_decode(src, 8, use_cache=False)
    b_started, a_done = threading.Event(), threading.Event()

    def hook(module, args, output):
        # A waits at its first step until B has entered; B then waits until A has returned
        if threading.current_thread().name == "A" and not b_started.is_set():
            b_started.wait(10)
        if threading.current_thread().name == "B" and not a_done.is_set():
            b_started.set()
            a_done.wait(10)

    handle = model.generator.register_forward_hook(hook)
    out = {}

    def run(name):
        out[name] = model.greedy_decode(src, 8, use_cache=False)
        if name == "A":
            a_done.set()

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.remove()
    assert torch.equal(out["A"], want) and torch.equal(out["B"], want)
    assert model.training and all(m.training for m in model.modules())


def test_padded_encoder_reproducible_from_the_first_call_in_deterministic_mode():
    """The replayed calls ran the layers on the valid tokens alone (GEMMs over fewer rows), the
    first (checked) call on the padded batch: 5e-7 apart, under a mode that promises the same
    bits every call."""
    torch.manual_seed(0)
    enc = tf.TransformerEncoder(tf.TransformerEncoderLayer(64, 4, 64, 0.1, batch_first=True), 1,
                                enable_nested_tensor=True).eval()
    x = torch.randn(1, 5, 64)
    padding = torch.zeros(1, 5, dtype=torch.bool)
    padding[0, 2:] = True
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad(), tf.use_backend("torch"):
            outs = [enc(x, src_key_padding_mask=padding) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_a_hook_inside_a_decoding_step_is_checked():
    """The step trusted every value check on its thread, so a user's hook run inside it got no
    error for cache lengths past the cache (and zeros back)."""
    torch.manual_seed(0)
    vocab = 20
    model = tf.models.Seq2SeqTransformer(vocab, vocab, d_model=32, nhead=2, num_encoder_layers=1,
                                         num_decoder_layers=1, dim_feedforward=32).eval()
    errors = []

    def hook(module, args, output):
        if errors:
            return
        q, cache = torch.randn(1, 2, 1, 16), torch.zeros(1, 2, 4, 16)
        try:
            tf.functional.attention_with_kv_cache(q, cache, cache.clone(), torch.tensor([1000], dtype=torch.int32),
                                                  torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
            errors.append(None)
        except ValueError as e:
            errors.append(e)

    model.decoder.layers[0].self_attn.out_proj.register_forward_hook(hook)
    model.greedy_decode(torch.randint(3, vocab, (2, 5)), 3, use_cache=True)
    assert errors and isinstance(errors[0], ValueError) and "cache_seqlens" in str(errors[0])


class _Wrapper(nn.Module):
    """An attention wrapper with batch_first only (no embed_dim), as instrumentation adds."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.batch_first = inner.batch_first

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_self_attention_wrapper_without_embed_dim(kind):
    """torch's layers run with it (training; the decoder also in eval); ours read
    self_attn.embed_dim for the input check and raised AttributeError."""
    torch.manual_seed(0)
    cls = tf.TransformerEncoderLayer if kind == "encoder" else tf.TransformerDecoderLayer
    theirs_cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    theirs = theirs_cls(E, 2, 64, 0.0, batch_first=True)
    ours = cls(E, 2, 64, 0.0, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    theirs.self_attn, ours.self_attn = _Wrapper(theirs.self_attn), _Wrapper(ours.self_attn)
    x = torch.randn(2, 5, E)
    args = (x,) if kind == "encoder" else (x, x[:, :3])
    for _ in range(2):
        torch.testing.assert_close(ours(*args), theirs(*args), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="d_model=32"):
        ours(torch.randn(2, 5, E + 1), *args[1:])
