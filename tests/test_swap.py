"""transformer_fast.swap / unswap on real models: an encoder-only text classifier built on
nn.TransformerEncoder, a model using nn.MultiheadAttention directly, nn.Sequential, nested
containers, shared modules, subclasses (left alone with a warning), a full nn.Transformer; the
swapped model computes what it did (DESIGN section 6 oracle), keeps its parameters (same
tensors), device, dtype, requires_grad and train/eval mode, trains, and survives pickle and
deepcopy."""
import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn as nn

import transformer_fast
import transformer_fast.modules as M
from test_modules_support import one_thread  # noqa: F401  (fixture)
from test_modules_support import assert_parity, fresh_generator, randomize_

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]


class TextClassifier(nn.Module):
    """The seeds' encoder-only text classifier: embeddings scaled by sqrt(d_model), sinusoidal
    positions, nn.TransformerEncoder with a padding mask, mean pooling over real tokens."""

    def __init__(self, vocab=50, d_model=16, nhead=2, layers=2, classes=3, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab, d_model, padding_idx=pad_id)
        pos = torch.arange(64).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(64, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        layer = nn.TransformerEncoderLayer(d_model, nhead, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        pad = tokens == self.pad_id  # (B, T) True = padding
        x = self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.pe[: tokens.shape[1]]
        h = self.encoder(x, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class AttnPool(nn.Module):
    """A model that uses nn.MultiheadAttention directly (cross-attention from learned queries,
    with need_weights=True, returning the weights too)."""

    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.queries = nn.Parameter(torch.randn(3, d))
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True, kdim=d, vdim=d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, padding):
        kv = self.proj(x)
        q = self.queries.unsqueeze(0).expand(x.shape[0], -1, -1)
        out, weights = self.attn(q, kv, kv, key_padding_mask=padding, average_attn_weights=False)
        return self.norm(out), weights


def _tokens(g, batch=4, length=9, vocab=50):
    t = torch.randint(1, vocab, (batch, length), generator=g)
    for b in range(batch):  # right padding of random lengths >= 2
        n = int(torch.randint(2, length + 1, (), generator=g))
        t[b, n:] = 0
    return t


def _classes(report):
    return {old.rsplit(".", 1)[1]: n for old, n in report.counts().items()}


def test_text_classifier_swap_keeps_everything_and_matches():
    g = fresh_generator()
    model = randomize_(TextClassifier(), g)
    reference_model = copy.deepcopy(model)
    params_before = dict(model.named_parameters())
    model.encoder.layers[1].linear2.weight.requires_grad_(False)  # a frozen weight stays frozen
    model.eval()
    report = transformer_fast.swap(model)
    assert _classes(report) == {"TransformerEncoder": 1, "TransformerEncoderLayer": 2,
                                "MultiheadAttention": 2, "LayerNorm": 5}
    assert type(model.encoder) is M.TransformerEncoder
    assert type(model.encoder.layers[0].self_attn) is M.MultiheadAttention
    assert type(model.encoder.norm) is M.LayerNorm
    assert "layers.0.self_attn" in str(report)
    for name, p in model.named_parameters():  # the very same tensors
        assert p is params_before[name], name
    assert not model.encoder.layers[1].linear2.weight.requires_grad
    assert not model.training and not model.encoder.layers[0].training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    tokens = _tokens(g)
    reference_model.encoder.layers[1].linear2.weight.requires_grad_(False)
    reference_model.eval()
    # the swapped model vs the unswapped original, float64 / float32 (gradients of all
    # trainable parameters too)
    assert_parity(reference_model, model, (tokens,), dtype=torch.float32)


def test_swap_is_trainable_and_state_dict_compatible():
    g = fresh_generator()
    torch_model = randomize_(TextClassifier(), g)
    model = copy.deepcopy(torch_model)
    transformer_fast.swap(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, labels = _tokens(g), torch.randint(0, 3, (4,), generator=g)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    # checkpoints go both ways, strict
    torch_model.load_state_dict(model.state_dict(), strict=True)
    fresh = TextClassifier()
    transformer_fast.swap(fresh)
    fresh.load_state_dict(torch_model.state_dict(), strict=True)
    fresh.eval()
    model.eval()
    torch.testing.assert_close(fresh(tokens), model(tokens))


def test_mha_model_swap_matches_with_weights():
    g = fresh_generator()
    model = randomize_(AttnPool(), g)
    reference_model = copy.deepcopy(model)
    report = transformer_fast.swap(model)
    assert _classes(report) == {"MultiheadAttention": 1, "LayerNorm": 1}
    x = torch.randn(2, 6, 8, generator=g)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    for dtype in (torch.float32, torch.bfloat16):
        assert_parity(reference_model, model, (x, padding), dtype=dtype, grad_inputs=(0,))


def test_sequential_nested_shared_and_root():
    shared = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
    inner = nn.ModuleDict({"a": nn.ModuleList([shared, nn.LayerNorm(16)]), "b": shared})
    model = nn.Sequential(nn.Linear(16, 16), inner, nn.Sequential(nn.Sequential(nn.LayerNorm(16))))
    report = transformer_fast.swap(model)
    # the shared layer is swapped once (with its self_attn and norms) and stays shared
    assert _classes(report) == {"TransformerEncoderLayer": 1, "MultiheadAttention": 1, "LayerNorm": 4}
    assert model[1]["a"][0] is model[1]["b"] and type(model[1]["b"]) is M.TransformerEncoderLayer
    assert type(model[2][0][0]) is M.LayerNorm
    assert len(transformer_fast.swap(model)) == 0  # idempotent
    # the root itself
    root = nn.MultiheadAttention(16, 2)
    assert len(transformer_fast.swap(root)) == 1 and type(root) is M.MultiheadAttention


def test_subclasses_left_alone_with_warning():
    class MyAttention(nn.MultiheadAttention):
        pass

    class MyLayer(nn.TransformerEncoderLayer):
        def forward(self, src, *args, **kwargs):
            return super().forward(src, *args, **kwargs) * 2

    model = nn.Sequential(MyAttention(16, 2), MyLayer(16, 2, 32))
    with pytest.warns(UserWarning, match="subclass of torch.nn") as record:
        report = transformer_fast.swap(model)
    messages = [str(w.message) for w in record if "transformer_fast.swap" in str(w.message)]
    assert len(messages) == 2 and "MyAttention" in messages[0] and "MyLayer" in messages[1]
    assert type(model[0]) is MyAttention and type(model[1]) is MyLayer
    assert len(report.skipped) == 2
    # the children of a skipped subclass are ordinary torch modules: swapped
    assert type(model[1].self_attn) is M.MultiheadAttention
    assert type(model[1].norm1) is M.LayerNorm


def test_unswap_restores_torch_classes():
    g = fresh_generator()
    model = randomize_(nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True), g)
    src, tgt = torch.randn(2, 6, 16, generator=g), torch.randn(2, 4, 16, generator=g)
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    before = model(src, tgt, tgt_mask=mask)
    report = transformer_fast.swap(model)
    assert _classes(report) == {"Transformer": 1, "TransformerEncoder": 1, "TransformerDecoder": 1,
                                "TransformerEncoderLayer": 1, "TransformerDecoderLayer": 1,
                                "MultiheadAttention": 3, "LayerNorm": 7}
    swapped = model(src, tgt, tgt_mask=mask)
    torch.testing.assert_close(swapped, before, atol=2e-5, rtol=1e-5)
    back = transformer_fast.unswap(model)
    assert len(back) == len(report)
    assert all(type(m).__module__.startswith("torch.nn") for m in model.modules())
    torch.testing.assert_close(model(src, tgt, tgt_mask=mask), before, rtol=0, atol=0)
    # unswap also converts modules built directly from transformer_fast.modules
    ours = M.TransformerEncoderLayer(16, 2, 32)
    transformer_fast.unswap(ours)
    assert type(ours) is nn.TransformerEncoderLayer


def test_swap_keeps_device_dtype_and_mode():
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dtype=torch.float64)).train()
    model[0].self_attn.eval()  # mixed modes are kept per module
    transformer_fast.swap(model)
    assert model.training and not model[0].self_attn.training and model[0].norm1.training
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    assert model(x).dtype == torch.float64


def test_pickle_and_deepcopy_of_swapped_models():
    g = fresh_generator()
    model = randomize_(TextClassifier(), g).eval()
    transformer_fast.swap(model)
    tokens = _tokens(g)
    expected = model(tokens)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone.encoder.layers[0]) is M.TransformerEncoderLayer
        torch.testing.assert_close(clone(tokens), expected, rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(tokens), expected, rtol=0, atol=0)


def test_swap_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        transformer_fast.swap("not a model")
