"""torch.compile(fullgraph=True) over the modules and a whole Seq2SeqTransformer training step,
and torch.export of the encoder for inference (issue 9): no graph breaks, the same numbers as
eager.  On the CPU the compiled graphs use aot_eager (it traces forward and backward through
our custom ops exactly as inductor does, without minutes of C++ compilation); one test runs
inductor end to end on an encoder layer."""
from __future__ import annotations

import pytest
import torch

import transformer_fast as tf
from transformer_fast.models import Seq2SeqTransformer
from transformer_fast.models.training import label_smoothed_cross_entropy, shift_right


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _encoder(norm_first=False):
    torch.manual_seed(0)
    layer = tf.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    return tf.TransformerEncoder(layer, 2, norm=tf.LayerNorm(32), enable_nested_tensor=False)


def _inputs():
    x = torch.randn(3, 11, 32)
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[0, 7:] = True
    return x, pad


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
def test_encoder_compiles_fullgraph_forward_backward(norm_first):
    model = _encoder(norm_first)
    x, pad = _inputs()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    eager_out = model(x, src_key_padding_mask=pad)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    out = compiled(x, src_key_padding_mask=pad)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_decoder_and_attention_compile_fullgraph():
    torch.manual_seed(0)
    decoder_layer = tf.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    mha = tf.MultiheadAttention(32, 4, batch_first=True)
    tgt, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)

    def fn(tgt, memory):
        y = decoder_layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
        attn, weights = mha(y, memory, memory, need_weights=True)
        return attn, weights

    eager = fn(tgt, memory)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(tgt, memory)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_stacks_compile_fullgraph_with_a_causal_mask_and_no_hint(train, mask_kind):
    # is_causal=None asks the stacks to detect a causal mask, which reads its values; while
    # tracing they apply the mask as given instead, so fullgraph holds and the numbers agree.
    torch.manual_seed(0)
    enc_layer = tf.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    dec_layer = tf.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = tf.TransformerEncoder(enc_layer, 2, enable_nested_tensor=False).train(train)
    decoder = tf.TransformerDecoder(dec_layer, 2).train(train)
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 7, 32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    if mask_kind == "bool":
        causal = causal.isinf()

    def fn(x, memory):
        return encoder(x, mask=causal), decoder(x, memory, tgt_mask=causal)

    with torch.set_grad_enabled(train):
        eager = fn(x, memory)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, memory)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_seq2seq_training_step_compiles_fullgraph():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.0)
    src = torch.randint(3, 20, (3, 9))
    src[0, 6:] = model.pad_id
    tgt = torch.randint(3, 20, (3, 8))
    tgt[1, 5:] = model.pad_id

    def loss_fn(src, tgt):
        logits = model(src, shift_right(tgt, model.bos_id))
        return label_smoothed_cross_entropy(logits, tgt, 0.1, ignore_index=model.pad_id)

    eager_loss = loss_fn(src, tgt)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    step = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = step(src, tgt)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_encoder_layer_inductor():
    torch.manual_seed(0)
    layer = tf.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x, pad = _inputs()
    with torch.no_grad():
        eager = layer(x, src_key_padding_mask=pad)
        compiled = torch.compile(layer, fullgraph=True)(x, src_key_padding_mask=pad)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_export_encoder_for_inference():
    model = _encoder().eval()
    x, pad = _inputs()
    exported = torch.export.export(model, (x,), {"src_key_padding_mask": pad})
    with torch.no_grad():
        want = model(x, src_key_padding_mask=pad)
    got = exported.module()(x, src_key_padding_mask=pad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the exported graph calls our fused ops, not a decomposition of them
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("transformer_fast" in t for t in targets), sorted(targets)
