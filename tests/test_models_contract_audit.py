"""Audit of transformer_fast.models against DESIGN 5 / issue 8, the paper and torch conventions.

Complements test_models.py, test_decoding.py and test_train_demo.py (nothing here repeats them):
decoding under left/interior padding, custom special ids and src != tgt vocabularies, beam sizes
1..5 x length penalties 0/1/2 x max_len 1/2/7, batch invariance, positional-table regrowth while
decoding, odd d_model, sampling edge cases, argument checks, the loss against
F.cross_entropy (values and gradients, every reduction), train_step, classifier pooling,
state_dict / dtype / train-eval behaviour.  The discrepancies it found are fixed; their tests stay.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

from transformer_fast.models import (
    Seq2SeqTransformer,
    TransformerClassifier,
    beam_search,
    greedy_decode,
    label_smoothed_cross_entropy,
    sample,
    shift_right,
    sinusoidal_positions,
    train_step,
    warmup_lr_lambda,
    warmup_scheduler,
)
from transformer_fast.models.decoding import CachedStepper

PAD, BOS, EOS = 0, 1, 2


pytestmark = pytest.mark.usefixtures("one_thread")


def small_model(vocab=19, tgt_vocab=None, d_model=32, nhead=4, layers=2, dropout=0.1, **kw):
    return Seq2SeqTransformer(vocab, tgt_vocab or vocab, d_model=d_model, nhead=nhead,
                              num_encoder_layers=layers, num_decoder_layers=layers,
                              dim_feedforward=64, dropout=dropout, **kw).eval()


def odd_padding_src(vocab, pad=PAD, low=3, width=12):
    """Right padding, left padding (one token at the end), one token first, interior pad."""
    src = torch.randint(low, vocab, (4, width))
    src[0, width // 2] = pad  # interior padding
    src[1, 3:] = pad
    src[2, : width - 1] = pad  # only the last position is a token
    src[3, 1:] = pad  # only the first position is a token
    return src


def trim(row, eos=EOS):
    row = row.tolist()
    return row[: row.index(eos) + 1] if eos in row else row


# ---- the contract's signatures


def test_signatures_follow_design_section_5():
    sig = inspect.signature(Seq2SeqTransformer.__init__)
    names = [p for p in sig.parameters if p != "self"][:14]
    assert names == ["src_vocab_size", "tgt_vocab_size", "d_model", "nhead", "num_encoder_layers",
                     "num_decoder_layers", "dim_feedforward", "dropout", "pad_id", "bos_id",
                     "eos_id", "share_embeddings", "activation", "norm_first"]
    defaults = {k: v.default for k, v in sig.parameters.items()}
    assert (defaults["d_model"], defaults["nhead"], defaults["num_encoder_layers"],
            defaults["num_decoder_layers"], defaults["dim_feedforward"], defaults["dropout"],
            defaults["pad_id"], defaults["bos_id"], defaults["eos_id"],
            defaults["share_embeddings"]) == (512, 8, 6, 6, 2048, 0.1, 0, 1, 2, False)
    g = inspect.signature(Seq2SeqTransformer.greedy_decode).parameters
    assert list(g)[1:3] == ["src", "max_len"] and g["use_cache"].default is True
    b = inspect.signature(Seq2SeqTransformer.beam_search).parameters
    assert list(b)[1:5] == ["src", "beam_size", "max_len", "length_penalty"]
    assert b["length_penalty"].default == 1.0


# ---- cached == uncached, beam, greedy, under hard padding


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_beam_equals_uncached_every_size_penalty_and_max_len(seed):
    torch.manual_seed(seed)
    model = small_model(vocab=11)
    src = odd_padding_src(11)
    for max_len in (1, 2, 7):
        greedy = greedy_decode(model, src, max_len)
        assert torch.equal(greedy, greedy_decode(model, src, max_len, use_cache=False))
        assert torch.equal(sample(model, src, max_len, top_k=1), greedy)
        for k in range(1, 6):
            for alpha in (0.0, 1.0, 2.0):
                cached = beam_search(model, src, k, max_len, alpha)
                uncached = beam_search(model, src, k, max_len, alpha, use_cache=False)
                assert torch.equal(cached, uncached), (seed, k, alpha, max_len)
                assert 1 <= cached.shape[1] <= max_len
                if k == 1:
                    assert torch.equal(cached, greedy), (seed, alpha, max_len)


@pytest.mark.parametrize("seed", [0, 1])
def test_custom_special_ids_and_different_vocabularies(seed):
    torch.manual_seed(seed)
    pad, bos, eos = 5, 3, 4
    model = small_model(13, 23, pad_id=pad, bos_id=bos, eos_id=eos)
    src = odd_padding_src(13, pad=pad, low=6, width=9)
    g = greedy_decode(model, src, 8)
    assert torch.equal(g, greedy_decode(model, src, 8, use_cache=False))
    assert not (g == bos).any() and int(g.max()) < 23
    for row in g.tolist():  # pad only after eos
        end = row.index(eos) + 1 if eos in row else len(row)
        assert pad not in row[:end] and all(t == pad for t in row[end:])
    b = beam_search(model, src, 3, 8)
    assert torch.equal(b, beam_search(model, src, 3, 8, use_cache=False))
    with torch.no_grad():
        assert model(src, torch.full((4, 3), bos)).shape == (4, 3, 23)


@pytest.mark.parametrize("seed", [0, 3])
def test_batch_invariance_each_row_decodes_as_alone(seed):
    """A row's output does not depend on the other rows nor on its trailing padding."""
    torch.manual_seed(seed)
    model = small_model()
    src = odd_padding_src(19)
    g = greedy_decode(model, src, 8)
    b = beam_search(model, src, 3, 8, length_penalty=1.0)
    for i in range(src.shape[0]):
        last = int((src[i] != PAD).nonzero().max()) + 1
        alone = src[i : i + 1, :last]
        assert trim(greedy_decode(model, alone, 8)[0]) == trim(g[i]), (seed, i)
        assert trim(beam_search(model, alone, 3, 8, length_penalty=1.0)[0]) == trim(b[i]), (seed, i)


def test_cached_step_logits_under_left_and_interior_padding_float64():
    torch.manual_seed(4)
    model = small_model().double()
    src = odd_padding_src(19)
    tgt_in = torch.randint(3, 19, (4, 6))
    tgt_in[:, 0] = BOS
    with torch.no_grad():
        full = model(src, tgt_in)
        memory, pad = model.encode(src)
        step = CachedStepper(model, memory, pad, max_len=6)
        out = torch.stack([step(tgt_in[:, t]) for t in range(6)], dim=1)
    assert (out - full).abs().max() < 1e-10


def _eos_first_for_row0(model):
    """Row 0 (greedy) gets a huge eos logit at the first step only, in both step kinds."""
    calls = {"n": 0}

    def hook(module, inputs, out):
        out = out.clone()
        if out.dim() == 3:  # uncached: (N, T, V), position 0 is the first step
            out[0, 0, EOS] += 100.0
        else:  # cached: (N, V), one call per step
            if calls["n"] == 0:
                out[0, EOS] += 100.0
            calls["n"] += 1
        return out

    return calls, model.generator.register_forward_hook(hook)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_row_that_ends_at_step_one(use_cache):
    torch.manual_seed(5)
    model = small_model()
    src = odd_padding_src(19)
    plain = greedy_decode(model, src, 6)
    calls, handle = _eos_first_for_row0(model)
    out = greedy_decode(model, src, 6, use_cache=use_cache)
    handle.remove()
    assert out[0].tolist() == [EOS] + [PAD] * (out.shape[1] - 1)
    assert [trim(r) for r in out[1:]] == [trim(r) for r in plain[1:]]


# ---- positions: regrowth while decoding, long inputs, odd d_model


def test_positional_table_regrows_during_cached_decoding():
    torch.manual_seed(6)
    model = small_model()
    model.positions.initial_length = 3
    model.positions._tables.clear()
    src = odd_padding_src(19)
    assert torch.equal(greedy_decode(model, src, 10), greedy_decode(model, src, 10, use_cache=False))
    table = model.positions.positions(40, 0, dtype=torch.float64)
    assert torch.equal(table, sinusoidal_positions(40, 32, dtype=torch.float64))
    # A source longer than the table's first size.
    long_src = torch.randint(3, 19, (1, 600))
    assert greedy_decode(model, long_src, 2).shape[0] == 1


@pytest.mark.parametrize("d_model, nhead", [(15, 3), (9, 1)])
def test_odd_d_model(d_model, nhead):
    torch.manual_seed(7)
    model = small_model(d_model=d_model, nhead=nhead)
    src = odd_padding_src(19)
    with torch.no_grad():
        x = model.positions(torch.zeros(1, 5, d_model))[0].double()
    pos = torch.arange(5, dtype=torch.float64)[:, None]
    i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / 10000 ** (i / d_model)
    assert torch.allclose(x[:, 0::2], torch.sin(angle), atol=1e-6)
    assert torch.allclose(x[:, 1::2], torch.cos(angle[:, : d_model // 2]), atol=1e-6)
    assert torch.equal(greedy_decode(model, src, 5), greedy_decode(model, src, 5, use_cache=False))


# ---- sampling


def test_sampling_generator_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(8)
    model = small_model()
    src = odd_padding_src(19)
    state = torch.get_rng_state()
    a = sample(model, src, 8, temperature=2.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(state, torch.get_rng_state())
    b = sample(model, src, 8, temperature=2.0, generator=torch.Generator().manual_seed(3),
               use_cache=False)
    assert torch.equal(a, b)
    torch.manual_seed(11)
    c = sample(model, src, 8, temperature=2.0)
    torch.manual_seed(11)
    assert torch.equal(c, sample(model, src, 8, temperature=2.0))


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-38])
def test_small_temperature_is_greedy(temperature):
    torch.manual_seed(9)
    model = small_model()
    src = odd_padding_src(19)
    assert torch.equal(sample(model, src, 5, temperature=temperature), greedy_decode(model, src, 5))


def test_huge_temperature_and_huge_top_k_still_valid():
    torch.manual_seed(10)
    model = small_model()
    src = odd_padding_src(19)
    out = sample(model, src, 6, temperature=1e30, top_k=1000, generator=torch.Generator().manual_seed(1))
    assert not ((out == BOS).any()) and int(out.max()) < 19


# ---- arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, s: greedy_decode(m, s, -1), ValueError, "max_len"),
    (lambda m, s: greedy_decode(m, s, True), TypeError, "max_len"),
    (lambda m, s: beam_search(m, s, -2, 4), ValueError, "beam_size"),
    (lambda m, s: beam_search(m, s, True, 4), TypeError, "beam_size"),
    (lambda m, s: beam_search(m, s, 2, 4, length_penalty=True), TypeError, "length_penalty"),
    (lambda m, s: greedy_decode(m, s[None], 4), ValueError, "src"),
    (lambda m, s: greedy_decode(m, s.bool(), 4), TypeError, "src"),
    (lambda m, s: greedy_decode(m, s - 5, 4), ValueError, "src"),
    (lambda m, s: sample(m, s, 4, temperature=float("inf")), ValueError, "temperature"),
    (lambda m, s: sample(m, s, 4, temperature=True), TypeError, "temperature"),
    (lambda m, s: sample(m, s, 4, top_k=2.0), TypeError, "top_k"),
    (lambda m, s: m(s, torch.full((2, 3), 19)), ValueError, "tgt_in"),
    (lambda m, s: m(s, torch.ones(3, 3, dtype=torch.long)), ValueError, "tgt_in"),
    # the second audit: generator checked before any work; loss's targets named as loss names them
    (lambda m, s: sample(m, s, 4, generator="not a generator"), TypeError, "generator"),
    (lambda m, s: sample(m, s, 4, top_k=1, generator=3), TypeError, "generator"),
    (lambda m, s: m.loss(s, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)),
     ValueError, "tgt_out"),
    (lambda m, s: m.loss(s, torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), 19)), ValueError, "tgt_out"),
    (lambda m, s: m.loss(s, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)), TypeError, "tgt_out"),
    (lambda m, s: greedy_decode(m, s, torch.tensor(True)), TypeError, "max_len"),
    (lambda m, s: greedy_decode(m, s, torch.tensor(2.0)), TypeError, "max_len"),
])
def test_bad_arguments_name_the_argument(call, exc, match):
    model = small_model()
    src = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    with pytest.raises(exc, match=match):
        call(model, src)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8], ids=str)
def test_accepted_integer_dtypes_work_or_are_rejected_by_name(dtype):
    model = small_model()
    src = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    tgt_in = torch.tensor([[BOS, 5], [BOS, 6]])
    try:
        with torch.no_grad():
            expected = model(src, tgt_in)
            assert torch.equal(model(src.to(dtype), tgt_in.to(dtype)), expected)
        assert torch.equal(greedy_decode(model, src.to(dtype), 4), greedy_decode(model, src, 4))
    except TypeError as e:  # acceptable: a clear rejection naming the argument
        assert "src" in str(e) or "tgt_in" in str(e)


# ---- decoding edge cases (the audit's discrepancies, fixed; the early stop documented)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_stop_waits_for_beam_size_finished_hypotheses(use_cache):
    """Hugging Face's default stop: step 1 gives eos logit 2.0, token 3 logit 1.9, the rest -10;
    later steps: eos certain.  [eos] scores log p(eos) = -0.64 and beats the live beam [3] at
    length 1 (-0.74), but with beam_size 2 the row holds one finished hypothesis, so it goes on:
    [3, eos] scores (-0.74 + ~0) / 2 = -0.37 with length_penalty=1 and wins (the audit's case:
    stopping at the first winning eos returned [eos]); with length_penalty=0 it scores -0.74 and
    [eos] stays best.  beam_size=1 stops at the first eos: greedy decoding."""
    model = small_model()

    def hook(module, inputs, out):
        logits = torch.full_like(out, -10.0)
        if out.dim() == 3:  # uncached: (N, T, V), position 0 is the first step
            logits[..., 1:, EOS] = 10.0
            logits[..., 0, EOS], logits[..., 0, 3] = 2.0, 1.9
        elif hook.calls == 0:  # cached: (N, V), one call per step
            logits[:, EOS], logits[:, 3] = 2.0, 1.9
        else:
            logits[:, EOS] = 10.0
        hook.calls += 1
        return logits

    src = torch.tensor([[5, 6, 7]])
    handle = model.generator.register_forward_hook(hook)
    results = {}
    for beam, alpha in ((2, 0.0), (2, 1.0), (1, 1.0)):
        hook.calls = 0
        results[beam, alpha] = beam_search(model, src, beam, 3, length_penalty=alpha,
                                           use_cache=use_cache).tolist()
    handle.remove()
    assert results == {(2, 0.0): [[EOS]], (2, 1.0): [[3, EOS]], (1, 1.0): [[EOS]]}


def test_tiny_subnormal_temperature_is_greedy_or_rejected():
    torch.manual_seed(9)
    model = small_model()
    src = odd_padding_src(19)
    try:
        out = sample(model, src, 5, temperature=1e-39)
    except ValueError as e:
        assert "temperature" in str(e)
    else:
        assert torch.equal(out, greedy_decode(model, src, 5))


def test_top_k_one_with_tied_logits_is_greedy():
    model = small_model()
    with torch.no_grad():
        model.generator.weight.zero_()  # every logit 0: all tokens tie
    src = torch.randint(3, 19, (8, 4))
    out = sample(model, src, 1, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, greedy_decode(model, src, 1))


# ---- training helpers vs torch


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_values_and_grads_match_torch(eps, reduction):
    torch.manual_seed(12)
    vocab = 7
    logits = torch.randn(3, 5, vocab, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (3, 5))
    target[0, 3:] = PAD
    target[2, :] = PAD  # a row made only of padding
    ours = label_smoothed_cross_entropy(logits, target, eps, ignore_index=PAD, reduction=reduction)
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=PAD,
                          label_smoothing=eps, reduction=reduction)
    ref = ref.view(3, 5) if reduction == "none" else ref
    assert torch.allclose(ours, ref, atol=1e-12, rtol=1e-12)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-12, rtol=1e-12)


def test_loss_without_ignore_index_and_unbatched():
    torch.manual_seed(13)
    logits, target = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 5, (6,))
    assert torch.allclose(label_smoothed_cross_entropy(logits, target, 0.1),
                          F.cross_entropy(logits, target, label_smoothing=0.1))
    x = torch.randn(5, dtype=torch.float64)
    assert torch.allclose(label_smoothed_cross_entropy(x, torch.tensor(3), 0.2),
                          F.cross_entropy(x, torch.tensor(3), label_smoothing=0.2))
    all_pad = label_smoothed_cross_entropy(logits, torch.zeros(6, dtype=torch.long), ignore_index=0,
                                           reduction="sum")
    assert all_pad.item() == 0.0


def test_zero_smoothing_with_a_masked_class_is_plain_cross_entropy():
    torch.manual_seed(14)
    logits = torch.randn(4, 6)
    logits[:, BOS] = float("-inf")  # a class the caller masks out
    target = torch.tensor([3, 4, PAD, 5])
    ours = label_smoothed_cross_entropy(logits, target, 0.0, ignore_index=PAD)
    assert torch.allclose(ours, F.cross_entropy(logits, target, ignore_index=PAD))


def test_non_finite_logits_at_ignored_positions_are_ignored():
    torch.manual_seed(15)
    logits = torch.randn(4, 6)
    logits[2] = float("nan")  # e.g. a fully masked / overflowed padding position
    target = torch.tensor([3, 4, PAD, 5])
    per_token = label_smoothed_cross_entropy(logits, target, 0.1, ignore_index=PAD, reduction="none")
    ref = F.cross_entropy(logits, target, ignore_index=PAD, label_smoothing=0.1, reduction="none")
    assert torch.allclose(per_token, ref)
    assert torch.isfinite(label_smoothed_cross_entropy(logits, target, 0.1, ignore_index=PAD))


def test_smoothing_one_is_accepted_like_torch():
    logits, target = torch.randn(3, 5), torch.tensor([1, 2, 3])
    assert torch.allclose(label_smoothed_cross_entropy(logits, target, 1.0),
                          F.cross_entropy(logits, target, label_smoothing=1.0))


def test_shift_right_wrong_rank_is_a_value_error():
    with pytest.raises(ValueError, match="tgt"):
        shift_right(torch.tensor([5, 6, EOS]), BOS)


def test_train_step_is_teacher_forced_label_smoothed_loss_and_steps_the_schedule():
    torch.manual_seed(16)
    model = small_model(12, layers=1, dropout=0.0)
    src = torch.randint(3, 12, (4, 5))
    tgt = torch.randint(3, 12, (4, 6))
    tgt[:, 4], tgt[:, 5] = EOS, PAD
    tgt[1, 2], tgt[1, 3:] = EOS, PAD
    before = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = warmup_scheduler(opt, d_model=32, warmup_steps=10)
    loss = train_step(model, src, tgt, opt, sched, smoothing=0.1)
    with torch.no_grad():
        ref = label_smoothed_cross_entropy(before(src, shift_right(tgt, BOS)), tgt, 0.1,
                                           ignore_index=PAD)
    assert not loss.requires_grad and model.training
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    # After one update the lr is the paper's rate at step_num 2.
    assert opt.param_groups[0]["lr"] == pytest.approx(32 ** -0.5 * min(2 ** -0.5, 2 * 10 ** -1.5))
    rate = warmup_lr_lambda(512, 4000)
    for step_num in (1, 4000, 8000):  # the paper's 1-based step_num = scheduler step + 1
        assert rate(step_num - 1) == pytest.approx(512 ** -0.5 * min(step_num ** -0.5,
                                                                     step_num * 4000 ** -1.5))


# ---- classifier pooling


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_classifier_pooling_by_hand(pooling):
    torch.manual_seed(17)
    clf = TransformerClassifier(30, 4, d_model=32, nhead=4, num_layers=2, dim_feedforward=64,
                                dropout=0.0, pooling=pooling).eval()
    tokens = torch.randint(3, 30, (3, 6))
    tokens[1, 2:] = PAD
    tokens[2, 1:] = PAD
    with torch.no_grad():
        pad = tokens == PAD
        h = clf.encoder(clf.positions(clf.embed(tokens)), src_key_padding_mask=pad)
        if pooling == "mean":
            pooled = torch.stack([h[i][~pad[i]].mean(0) for i in range(3)])
        else:
            pooled = h[:, 0]
        assert torch.allclose(clf(tokens), clf.head(pooled), atol=1e-6)
        assert torch.allclose(clf(tokens[2:3, :1]), clf(tokens)[2:3], atol=1e-5)


# ---- state_dict, dtype, train/eval


def test_state_dict_round_trip_and_shared_tie_under_casts():
    torch.manual_seed(18)
    model = small_model(share_embeddings=True)
    sd = model.state_dict()
    assert not any("position" in k for k in sd)  # the table is a cache, not state
    fresh = small_model(share_embeddings=True)
    fresh.load_state_dict(sd)
    src = odd_padding_src(19)
    assert torch.equal(greedy_decode(fresh, src, 6), greedy_decode(model, src, 6))
    # A shared checkpoint loads strictly into an unshared model and computes the same.
    unshared = small_model()
    unshared.load_state_dict(sd, strict=True)
    assert torch.equal(beam_search(unshared, src, 3, 6), beam_search(model, src, 3, 6))
    for m in (copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)):
        assert m.generator.weight is m.src_embed.weight and m.tgt_embed is m.src_embed
    double = copy.deepcopy(model).double()
    tgt_in = torch.tensor([[BOS, 5, 6]] * 4)
    with torch.no_grad():
        out = double(src, tgt_in)
        assert out.dtype == torch.float64
        assert torch.allclose(out.float(), model(src, tgt_in), atol=1e-4)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert torch.equal(beam_search(bf16, src, 3, 5), beam_search(bf16, src, 3, 5, use_cache=False))


def test_decoding_in_train_mode_equals_eval_and_is_deterministic():
    torch.manual_seed(19)
    model = small_model(dropout=0.3).train()
    src = odd_padding_src(19)
    g, b = greedy_decode(model, src, 7), beam_search(model, src, 3, 7)
    assert model.training
    model.eval()
    assert torch.equal(g, greedy_decode(model, src, 7)) and torch.equal(b, beam_search(model, src, 3, 7))
    assert torch.equal(g, greedy_decode(model, src, 7)) and torch.equal(b, beam_search(model, src, 3, 7))
    no_drop = small_model(dropout=0.0)
    tgt_in = torch.tensor([[BOS, 5, 6]] * 4)
    with torch.no_grad():
        assert torch.equal(no_drop.train()(src, tgt_in), no_drop.eval()(src, tgt_in))


# ---- Findings of the 2026-11-28 audit


@pytest.mark.parametrize("clip_norm", [-1.0, 0.0, float("nan"), float("inf")])
def test_train_step_refuses_a_bad_clip_norm(clip_norm):
    """clip_norm -1 reversed the update, nan turned every parameter into NaN, 0 froze them."""
    model = small_model(dropout=0.0)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    src, tgt = torch.tensor([[3, 4, 5, EOS, PAD]]), torch.tensor([[5, 6, 7, EOS]])
    with pytest.raises(ValueError, match="clip_norm"):
        train_step(model, src, tgt, opt, clip_norm=clip_norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_step_names_its_own_arguments():
    model = small_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    src = torch.tensor([[3, 4, 5, EOS], [6, 7, EOS, PAD]])
    with pytest.raises(ValueError, match="tgt must have src's batch size"):
        train_step(model, src, torch.tensor([[5, 6, EOS]]), opt)
    with pytest.raises(ValueError, match=r"^tgt must hold token ids"):
        train_step(model, src, torch.tensor([[5, 6, 99], [5, EOS, PAD]]), opt)
    with pytest.raises(TypeError, match="autocast_dtype"):
        train_step(model, src, torch.tensor([[5, 6, EOS], [5, EOS, PAD]]), opt, autocast_dtype="bf16")


def test_compiled_classifier_pools_an_all_padding_row_to_finite_values():
    """Eager calls refuse a row of padding only; while torch.compile traces the token checks are
    skipped, and mean pooling divided by zero (NaN logits)."""
    torch.manual_seed(0)
    clf = TransformerClassifier(20, 3, d_model=32, nhead=2, num_layers=1, dim_feedforward=64,
                                dropout=0.0).eval()
    tokens = torch.tensor([[PAD, PAD, PAD], [8, 9, PAD]])
    with pytest.raises(ValueError, match="padding"):
        clf(tokens)
    out = torch.compile(clf, fullgraph=True, backend="aot_eager")(tokens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], clf(tokens[1:]), rtol=1e-5, atol=1e-6)


def test_small_argument_checks_name_the_argument():
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="ignore_index"):
            label_smoothed_cross_entropy(logits, target, ignore_index=bad)
    with pytest.raises(ValueError, match="length"):
        sinusoidal_positions(-1, 4)
    with pytest.raises(TypeError, match="d_model"):
        sinusoidal_positions(3, 4.0)


@pytest.mark.parametrize("wrap", [int, lambda n: __import__("numpy").int64(n), torch.tensor],
                         ids=["int", "numpy", "tensor"])
def test_integer_like_lengths_are_taken_as_range_takes_them(wrap):
    """max_len, beam_size and top_k accept any integer-like value (__index__: numpy integers,
    one-element integer tensors), as range() and most torch APIs do."""
    model = small_model()
    src = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    assert torch.equal(greedy_decode(model, src, wrap(4)), greedy_decode(model, src, 4))
    assert torch.equal(beam_search(model, src, wrap(2), wrap(4)), beam_search(model, src, 2, 4))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sample(model, src, wrap(4), top_k=wrap(3), generator=g1),
                       sample(model, src, 4, top_k=3, generator=g2))


def test_integer_like_constructor_sizes():
    np = pytest.importorskip("numpy")
    model = Seq2SeqTransformer(np.int64(20), np.int64(20), d_model=np.int64(16), nhead=np.int64(2),
                               num_encoder_layers=np.int64(1), num_decoder_layers=torch.tensor(1),
                               dim_feedforward=np.int64(32))
    assert model.greedy_decode(torch.tensor([[5, 6, 7]]), 4).shape[0] == 1
    clf = TransformerClassifier(np.int64(20), np.int64(3), d_model=np.int64(16), nhead=np.int64(2),
                                num_layers=np.int64(1), dim_feedforward=np.int64(32))
    assert clf(torch.tensor([[5, 6, 7]])).shape == (1, 3)
