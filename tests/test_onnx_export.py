"""torch.onnx.export of swapped models: torch.nn's modules export to ONNX, so ours must too.

Our fused kernels are custom ops with no ONNX form (exporting a swapped encoder failed with "No
ONNX function found for transformer_fast.add_layer_norm_fwd"); under torch.onnx.export, ``auto``
takes the ``torch`` backend, whose ops are torch's own (backends.onnx_exporting).  Each exported
graph is run by onnx's reference evaluator (numpy, no onnxruntime) and compared with torch.nn's
eager output on the same weights, for both exporters (dynamo, the default, and TorchScript)."""
import copy
import os

import pytest
import torch
import torch.nn as nn

import transformer_fast
from transformer_fast import backends

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")  # the dynamo exporter's translation library
from onnx.reference import ReferenceEvaluator  # noqa: E402

E, H, FF = 32, 4, 64


class _CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.enc(x, mask=mask, is_causal=True)


class _Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, norm_first=True), 1)

    def forward(self, x, pad):
        return self.enc(x, src_key_padding_mask=pad)


class _Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        return self.t(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(tgt.shape[1]))


class _CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, kdim=16, vdim=24)

    def forward(self, q, k, v):
        return self.attn(q, k, v, need_weights=False)[0]


class _AttentionWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, attn_mask=mask)[1]


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, E, generator=g)
    pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    row_dead = torch.zeros(7, 7, dtype=torch.bool)
    row_dead[3] = True  # a fully masked query row: zero weights, not NaN
    return {
        "causal_lm": (_CausalLM, (x,)),
        "padded_pre_ln": (_Padded, (x.transpose(0, 1), pad)),
        "seq2seq": (_Seq2Seq, (x, torch.randn(2, 5, E, generator=g))),
        "cross_attention": (_CrossAttention, (x, torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 24, generator=g))),
        "attention_weights": (_AttentionWeights, (x, row_dead)),
    }


def _export_and_run(model, args, dynamo, path):
    torch.onnx.export(model, args, path, dynamo=dynamo)
    graph = onnx.load(path)
    domains = {n.domain for n in graph.graph.node} | {f.domain for f in graph.functions}
    session = ReferenceEvaluator(path)
    feeds = {i.name: a.numpy() for i, a in zip(session.proto_.graph.input, args)}
    return domains, torch.from_numpy(session.run(None, feeds)[0])


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(_cases()))
def test_swapped_model_exports_like_torch(name, dynamo, tmp_path):
    make, args = _cases()[name]
    torch.manual_seed(1)
    model = make().eval()
    with torch.no_grad():
        want = model(*args)
    # torch's need_weights path gives a fully masked row NaN weights, ours zeros (README)
    want = want.nan_to_num(nan=0.0) if name == "attention_weights" else want
    ours = copy.deepcopy(model)
    assert transformer_fast.swap(ours).swapped
    with torch.no_grad():
        torch.testing.assert_close(ours(*args), want, atol=1e-5, rtol=1e-5)
    domains, got = _export_and_run(ours, args, dynamo, os.fspath(tmp_path / f"{name}.onnx"))
    assert domains <= {"", "ai.onnx", "pkg.onnxscript.torch_lib", "pkg.onnxscript.torch_lib.common"}, domains
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_backend_named_under_export_says_why(tmp_path):
    """An explicit fused backend cannot be exported: the error names ONNX (auto takes torch)."""
    make, args = _cases()["causal_lm"]
    model = make().eval()
    transformer_fast.swap(model)
    with transformer_fast.use_backend("cpu"), pytest.raises(Exception, match="ONNX"):
        torch.onnx.export(model, args, os.fspath(tmp_path / "cpu.onnx"), dynamo=False)


def test_auto_keeps_the_kernels_outside_export():
    """The export rule does not leak: outside torch.onnx.export, auto on a CPU tensor takes the
    C++ kernels when they are built (torch.onnx imported or not)."""
    import torch.onnx  # noqa: F401  (imported: the check must read its flag, not its presence)

    assert not backends.onnx_exporting()
    x = torch.randn(2, 3, E)
    inputs = {"x": x, "residual": x, "weight": None, "bias": None, "eps": 1e-5, "dropout_p": 0.0,
              "prenorm": False}
    want = "cpu" if not backends.not_supported_reasons("cpu", "add_layer_norm", inputs) else "torch"
    assert backends.resolve("add_layer_norm", None, inputs) == want
