"""transformer_fast.models: embeddings and positions, the encoder-decoder's masks and weight
sharing, the classifier, and the training helpers (loss, schedule, teacher forcing)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_fast.models import (
    LabelSmoothedCrossEntropy,
    Seq2SeqTransformer,
    SinusoidalPositionalEncoding,
    TransformerClassifier,
    label_smoothed_cross_entropy,
    shift_right,
    sinusoidal_positions,
    train_step,
    warmup_lr_lambda,
    warmup_scheduler,
)
from transformer_fast.models import _layers

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is faster, and on the shared 2-core machine an idle-spinning
    second OpenMP thread made these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh_seed() -> int:
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    return seed


def small_model(vocab=17, tgt_vocab=None, **kw):
    args = dict(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                dim_feedforward=64, dropout=0.0)
    args.update(kw)
    return Seq2SeqTransformer(vocab, tgt_vocab or vocab, **args)


def random_src(batch, length, vocab, lengths=None):
    src = torch.randint(3, vocab, (batch, length))
    if lengths is not None:
        for i, n in enumerate(lengths):
            src[i, n:] = PAD
    return src


# ---- positions and embeddings


@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_values_sin_even_cos_odd(d_model):
    table = sinusoidal_positions(50, d_model, dtype=torch.float64)
    assert table.shape == (50, d_model)
    for pos in (0, 1, 13, 49):
        for j in range(d_model):
            i2 = j - (j % 2)  # the 2i of the pair
            angle = pos / 10000 ** (i2 / d_model)
            expected = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert table[pos, j].item() == pytest.approx(expected, abs=1e-12), (pos, j)


def test_positional_encoding_any_length_and_offset():
    pe = SinusoidalPositionalEncoding(12, initial_length=8)
    x = torch.randn(2, 1000, 12, dtype=torch.float64)  # far past the initial table
    out = pe(x)
    assert torch.allclose(out - x, sinusoidal_positions(1000, 12, dtype=torch.float64), atol=1e-12)
    # A slice at an offset is the same rows of the table (what each decoding step adds).
    step = pe.positions(3, offset=997, dtype=torch.float64)
    assert torch.equal(step, pe.positions(1000, dtype=torch.float64)[997:])
    # Not a parameter and not in the state_dict.
    assert list(pe.state_dict()) == [] and list(pe.parameters()) == []


def test_embeddings_scaled_by_sqrt_d_model():
    fresh_seed()
    model = small_model()
    tokens = torch.randint(0, 17, (3, 5))
    expected = model.src_embed.weight[tokens] * math.sqrt(32)
    assert torch.allclose(model.src_embed(tokens), expected)


# ---- the encoder-decoder


def test_default_is_the_base_configuration():
    model = Seq2SeqTransformer(100, 100)
    assert len(model.encoder.layers) == 6 and len(model.decoder.layers) == 6
    layer = model.decoder.layers[0]
    assert model.d_model == 512 and layer.self_attn.num_heads == 8
    assert layer.linear1.out_features == 2048 and layer.dropout.p == 0.1
    assert layer.norm_first is False  # the paper's post-LN
    assert isinstance(layer, _layers.TransformerDecoderLayer)


def test_shared_embeddings_tie_weights():
    fresh_seed()
    model = small_model(share_embeddings=True)
    w = model.src_embed.weight
    assert model.tgt_embed.weight is w and model.generator.weight is w
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if "embed" not in n and "generator" not in n
    ) + w.numel()
    src, tgt_in = random_src(2, 6, 17), torch.randint(1, 17, (2, 4))
    model(src, tgt_in).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    # A round trip through the state_dict keeps the tie.
    other = small_model(share_embeddings=True)
    other.load_state_dict(model.state_dict())
    assert other.generator.weight is other.src_embed.weight
    assert torch.equal(other.generator.weight, w)

    unshared = small_model()
    assert unshared.tgt_embed.weight is not unshared.src_embed.weight
    assert unshared.generator.weight is not unshared.tgt_embed.weight
    with pytest.raises(ValueError, match="src_vocab_size == tgt_vocab_size"):
        small_model(vocab=10, tgt_vocab=12, share_embeddings=True)


def test_forward_shape_and_padding_masks():
    seed = fresh_seed()
    model = small_model(vocab=19, tgt_vocab=23).eval()
    src = random_src(3, 7, 19, lengths=[7, 4, 1])
    tgt_in = torch.randint(3, 23, (3, 5))
    tgt_in[:, 0] = BOS
    with torch.no_grad():
        logits = model(src, tgt_in)
        assert logits.shape == (3, 5, 23)
        # Extra source padding changes nothing: the padding mask hides it.
        more_pad = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
        assert torch.allclose(model(more_pad, tgt_in), logits, atol=1e-5), seed
        # Causal: changing target token t leaves the logits of positions < t alone.
        changed = tgt_in.clone()
        changed[:, 3] = (changed[:, 3] - 3 + 1) % 20 + 3
        other = model(src, changed)
        assert torch.allclose(other[:, :3], logits[:, :3], atol=1e-5), seed
        assert not torch.allclose(other[:, 3:], logits[:, 3:], atol=1e-5), seed


@pytest.mark.parametrize("bad, exc, match", [
    (torch.zeros(2, 3), TypeError, "dtype int64 or int32"),
    (torch.ones(3, dtype=torch.long), ValueError, r"shape \(batch, length\)"),
    (torch.full((2, 3), 99), ValueError, r"token ids in \[0, 17\)"),
    (torch.tensor([[5, 6], [0, 0]]), ValueError, "only of padding"),
    ([[5, 6]], TypeError, "torch.Tensor"),
])
def test_bad_source_is_rejected(bad, exc, match):
    model = small_model()
    with pytest.raises(exc, match=match):
        model(bad, torch.ones(2, 2, dtype=torch.long))


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=30), "divisible by nhead"),
    (dict(nhead=0), "nhead"),
    (dict(dropout=1.5), "dropout"),
    (dict(pad_id=1), "must differ"),
    (dict(eos_id=17), "eos_id"),
    (dict(activation="tanh"), "activation"),
])
def test_bad_constructor_arguments(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        small_model(**kw)


# ---- classifier


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_classifier_forward_backward(pooling):
    seed = fresh_seed()
    model = TransformerClassifier(30, 5, d_model=32, nhead=4, num_layers=2, dim_feedforward=64,
                                  dropout=0.1, pooling=pooling)
    tokens = random_src(4, 9, 30, lengths=[9, 5, 2, 1])
    logits = model(tokens)
    assert logits.shape == (4, 5) and torch.isfinite(logits).all()
    F.cross_entropy(logits, torch.randint(0, 5, (4,))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.embed.weight.grad.abs().sum() > 0 and model.head.weight.grad.abs().sum() > 0
    # Eval: padding is invisible (masked in attention, left out of the mean).
    model.eval()
    with torch.no_grad():
        padded = torch.cat([tokens, torch.zeros(4, 3, dtype=torch.long)], dim=1)
        assert torch.allclose(model(padded), model(tokens), atol=1e-5), seed


def test_classifier_rejects_bad_input():
    model = TransformerClassifier(30, 5, d_model=32, nhead=4, num_layers=1, dim_feedforward=64)
    with pytest.raises(TypeError, match="tokens"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match="pooling"):
        TransformerClassifier(30, 5, pooling="max")


# ---- training helpers


def test_label_smoothing_matches_a_hand_computation():
    seed = fresh_seed()
    eps, vocab = 0.1, 6
    logits = torch.randn(2, 4, vocab, dtype=torch.float64)
    target = torch.tensor([[3, 5, 2, PAD], [4, 2, PAD, PAD]])
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):
            y = int(target[b, t])
            if y == PAD:
                continue
            z = [float(v) for v in logits[b, t]]
            log_z = math.log(sum(math.exp(v) for v in z))
            logp = [v - log_z for v in z]
            # smoothed target: (1 - eps) on y plus eps / V on every class
            q = [eps / vocab + (1 - eps if k == y else 0.0) for k in range(vocab)]
            total += -sum(qk * lk for qk, lk in zip(q, logp))
            count += 1
    expected = total / count
    got = label_smoothed_cross_entropy(logits, target, eps, ignore_index=PAD)
    assert got.item() == pytest.approx(expected, rel=1e-12), seed
    # The same distribution as torch's label_smoothing.
    torch_loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=PAD,
                                 label_smoothing=eps)
    assert got.item() == pytest.approx(torch_loss.item(), rel=1e-12)
    per_token = LabelSmoothedCrossEntropy(eps, PAD, reduction="none")(logits, target)
    assert per_token.shape == (2, 4) and (per_token[target == PAD] == 0).all()
    assert per_token.sum().item() == pytest.approx(total, rel=1e-12)
    # All padding: zero, not NaN.
    assert label_smoothed_cross_entropy(logits, torch.zeros_like(target), ignore_index=PAD).item() == 0.0
    with pytest.raises(ValueError, match="target"):
        label_smoothed_cross_entropy(logits, target[:, :3])
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_cross_entropy(logits, target, 1.5)  # [0, 1] as F.cross_entropy's


def test_warmup_schedule_values():
    d_model, warmup = 512, 4000
    rate = warmup_lr_lambda(d_model, warmup)
    for step in (0, 1, 99, 3998, 3999, 4000, 9999, 99999):
        n = step + 1
        assert rate(step) == pytest.approx(d_model ** -0.5 * min(n ** -0.5, n * warmup ** -1.5))
    assert rate(0) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    peak = max(range(8000), key=rate)
    assert peak == warmup - 1 and rate(peak) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)
    # Linear warm-up, then inverse square root decay.
    assert rate(999) == pytest.approx(rate(499) * 2)
    assert rate(4 * 4000 - 1) == pytest.approx(rate(4000 - 1) / 2)

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = warmup_scheduler(opt, d_model=64, warmup_steps=10, scale=2.0)
    seen = []
    for _ in range(30):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(2)
        opt.step()
        sched.step()
    expected = [2.0 * 64 ** -0.5 * min((s + 1) ** -0.5, (s + 1) * 10 ** -1.5) for s in range(30)]
    assert seen == pytest.approx(expected)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_lr_lambda(64, 0)


def test_shift_right_teacher_forcing():
    tgt = torch.tensor([[5, 6, EOS, PAD], [7, EOS, PAD, PAD]])
    assert shift_right(tgt, BOS).tolist() == [[BOS, 5, 6, EOS], [BOS, 7, EOS, PAD]]


def test_train_step_fits_a_fixed_batch():
    seed = fresh_seed()
    model = small_model(vocab=12, share_embeddings=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = random_src(8, 6, 12, lengths=[6, 5, 4, 3, 6, 2, 1, 5])
    tgt = torch.full((8, 7), PAD)
    for i in range(8):
        n = int((src[i] != PAD).sum())
        tgt[i, :n] = src[i, :n]
        tgt[i, n] = EOS
    losses = [train_step(model, src, tgt, opt, smoothing=0.0).item() for _ in range(60)]
    assert losses[-1] < 0.3 * losses[0], (seed, losses[0], losses[-1])
