"""transformer_fast.modules: the same interface as the installed torch.nn classes.

Signatures (inspect.signature, constructor and forward), attributes, repr, parameter names /
shapes / init (same seed -> same weights), state_dict round trips with strict=True both ways,
the errors torch raises for malformed inputs (ours are ValueError too), mask dtype warnings and
TransformerEncoder's causal-mask detection.
"""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_fast
import transformer_fast.modules as M
from test_modules_support import one_thread  # noqa: F401  (fixture)
from test_modules_support import randomize_

NAMES = ["MultiheadAttention", "LayerNorm", "TransformerEncoderLayer", "TransformerDecoderLayer",
         "TransformerEncoder", "TransformerDecoder", "Transformer"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", NAMES)
def test_signatures_match_torch(name):
    ours, theirs = getattr(M, name), getattr(torch.nn, name)
    assert inspect.signature(ours.__init__) == inspect.signature(theirs.__init__)
    assert inspect.signature(ours.forward) == inspect.signature(theirs.forward)
    assert not issubclass(ours, theirs)  # swap must be able to tell them apart


def test_static_method_and_exports():
    assert inspect.signature(M.Transformer.generate_square_subsequent_mask) == inspect.signature(
        torch.nn.Transformer.generate_square_subsequent_mask)
    for dtype in (None, torch.float64):
        assert torch.equal(M.Transformer.generate_square_subsequent_mask(5, dtype=dtype),
                           torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=dtype))
    for name in NAMES:
        assert getattr(transformer_fast, name) is getattr(M, name)
        assert getattr(transformer_fast.nn, name) is getattr(M, name)
    import transformer_fast.nn as tnn  # importable as a module too

    assert tnn.MultiheadAttention is M.MultiheadAttention


def _pair(name, seed=0):
    """(torch's module, ours) built from the same arguments under the same seed."""
    def build(ns):
        if name == "MultiheadAttention":
            return ns.MultiheadAttention(16, 4, dropout=0.1)
        if name == "MultiheadAttention-kvdim":
            return ns.MultiheadAttention(16, 4, kdim=6, vdim=10, add_bias_kv=True, batch_first=True)
        if name == "MultiheadAttention-nobias":
            return ns.MultiheadAttention(16, 2, bias=False, add_zero_attn=True)
        if name == "LayerNorm":
            return ns.LayerNorm(16)
        if name == "LayerNorm-2d":
            return ns.LayerNorm([3, 16], eps=1e-3, bias=False)
        if name == "TransformerEncoderLayer":
            return ns.TransformerEncoderLayer(16, 4, 32, activation="gelu", batch_first=True)
        if name == "TransformerDecoderLayer":
            return ns.TransformerDecoderLayer(16, 4, 32, norm_first=True, bias=False)
        if name == "TransformerEncoder":
            layer = ns.TransformerEncoderLayer(16, 4, 32, batch_first=True)
            return ns.TransformerEncoder(layer, 2, ns.LayerNorm(16), enable_nested_tensor=False)
        if name == "TransformerDecoder":
            return ns.TransformerDecoder(ns.TransformerDecoderLayer(16, 4, 32), 2)
        if name == "Transformer":
            return ns.Transformer(16, 4, 2, 1, 32)
        raise AssertionError(name)

    torch.manual_seed(seed)
    theirs = build(torch.nn)
    torch.manual_seed(seed)
    ours = build(M)
    return theirs, ours


PAIRS = ["MultiheadAttention", "MultiheadAttention-kvdim", "MultiheadAttention-nobias", "LayerNorm",
         "LayerNorm-2d", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
         "TransformerDecoder", "Transformer"]

# Attributes torch reads on these modules (everything in __dict__ that is not a parameter,
# buffer, submodule or hook table).
_SKIP_ATTRS = {"training", "use_nested_tensor"}  # ours never converts to NestedTensor


def _plain_attributes(module):
    out = {}
    for k, v in vars(module).items():
        if k.startswith("_") and k != "_qkv_same_embed_dim":
            continue
        if k in _SKIP_ATTRS:
            continue
        out[k] = v
    return out


@pytest.mark.parametrize("name", PAIRS)
def test_same_init_parameters_attributes_and_repr(name):
    theirs, ours = _pair(name, seed=int(torch.randint(0, 2**31, ())))
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    assert list(sd_t) == list(sd_o)
    for key in sd_t:
        assert sd_t[key].shape == sd_o[key].shape and sd_t[key].dtype == sd_o[key].dtype, key
        assert torch.equal(sd_t[key], sd_o[key]), f"{key}: init differs from torch's"
    assert [n for n, _ in theirs.named_parameters()] == [n for n, _ in ours.named_parameters()]
    assert [n for n, _ in theirs.named_modules()] == [n for n, _ in ours.named_modules()]
    for (n, mt), (_, mo) in zip(theirs.named_modules(), ours.named_modules()):
        assert _plain_attributes(mt) == _plain_attributes(mo), n
    assert repr(theirs) == repr(ours)


@pytest.mark.parametrize("name", PAIRS)
def test_state_dict_round_trips_strict(name):
    theirs, ours = _pair(name)
    randomize_(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # torch checkpoint -> ours
    for (k, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), k
    theirs2, ours2 = _pair(name, seed=1)
    randomize_(ours2)
    theirs2.load_state_dict(ours2.state_dict(), strict=True)  # ours -> torch
    for (k, a), (_, b) in zip(theirs2.state_dict().items(), ours2.state_dict().items()):
        assert torch.equal(a, b), k


def test_factory_kwargs_and_bias_false():
    m = M.TransformerEncoderLayer(16, 2, 32, bias=False, dtype=torch.float64)
    t = torch.nn.TransformerEncoderLayer(16, 2, 32, bias=False, dtype=torch.float64)
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in t.named_parameters()]
    assert m.self_attn.in_proj_bias is None and m.norm1.bias is None and m.linear1.bias is None


def test_activation_strings_and_callables():
    assert M.TransformerEncoderLayer(8, 2, activation="gelu").activation is F.gelu
    assert M.TransformerEncoderLayer(8, 2, activation="relu").activation_relu_or_gelu == 1
    assert M.TransformerEncoderLayer(8, 2, activation=torch.nn.GELU()).activation_relu_or_gelu == 2
    assert M.TransformerEncoderLayer(8, 2, activation=torch.tanh).activation_relu_or_gelu == 0
    assert M.TransformerDecoderLayer(8, 2, activation="gelu").activation is F.gelu
    for cls in (M.TransformerEncoderLayer, M.TransformerDecoderLayer):
        with pytest.raises(RuntimeError, match="relu/gelu"):
            cls(8, 2, activation="swish")


def test_constructor_errors_match_torch():
    for ns in (torch.nn, M):
        with pytest.raises(AssertionError, match="divisible"):
            ns.MultiheadAttention(10, 3)
        with pytest.raises(ValueError, match="greater than 0"):
            ns.MultiheadAttention(0, 2)


# --------------------------------------------------------------------------------------------
# Malformed inputs: torch's exception class, and ValueError/TypeError for our contract


def _mha_bad_inputs():
    x = torch.randn(5, 2, 8)
    return {
        "4-D query": dict(args=(x[None], x[None], x[None])),
        "key rank": dict(args=(x, x[0], x[0])),
        "kpm rank": dict(args=(x, x, x), kwargs=dict(key_padding_mask=torch.zeros(2, 5, 1, dtype=torch.bool))),
        "kpm shape": dict(args=(x, x, x), kwargs=dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))),
        "attn_mask 2-D shape": dict(args=(x, x, x), kwargs=dict(attn_mask=torch.zeros(5, 4, dtype=torch.bool))),
        "attn_mask 3-D shape": dict(args=(x, x, x), kwargs=dict(attn_mask=torch.zeros(2, 5, 5, dtype=torch.bool))),
        "attn_mask int": dict(args=(x, x, x), kwargs=dict(attn_mask=torch.zeros(5, 5, dtype=torch.int64))),
        "kpm int": dict(args=(x, x, x), kwargs=dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.int32))),
        "is_causal without mask": dict(args=(x, x, x), kwargs=dict(is_causal=True)),
        "embed dim": dict(args=(torch.randn(5, 2, 6),) * 3),
        "unbatched 3-D mask shape": dict(args=(x[:, 0], x[:, 0], x[:, 0]),
                                         kwargs=dict(attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool))),
        "unbatched kpm rank": dict(args=(x[:, 0], x[:, 0], x[:, 0]),
                                   kwargs=dict(key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))),
    }


@pytest.mark.parametrize("case", list(_mha_bad_inputs()))
def test_mha_bad_inputs_raise_like_torch(case):
    spec = _mha_bad_inputs()[case]
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2)
    ours = M.MultiheadAttention(8, 2)
    with pytest.raises(Exception) as torch_err:
        theirs(*spec["args"], **spec.get("kwargs", {}))
    with pytest.raises(Exception) as our_err:
        ours(*spec["args"], **spec.get("kwargs", {}))
    assert isinstance(our_err.value, type(torch_err.value)), (torch_err.value, our_err.value)
    assert isinstance(our_err.value, (ValueError, TypeError))


def test_transformer_bad_inputs_raise_like_torch():
    torch.manual_seed(0)
    for ns in (torch.nn, M):
        model = ns.Transformer(8, 2, 1, 1, 16)
        with pytest.raises(RuntimeError, match="batch number"):
            model(torch.randn(5, 2, 8), torch.randn(4, 3, 8))
        with pytest.raises(RuntimeError, match="feature number"):
            model(torch.randn(5, 2, 8), torch.randn(4, 2, 6))


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("case", ["enc-src", "dec-tgt", "dec-memory", "enc-rank"])
def test_layer_bad_inputs_raise_like_torch(case, norm_first):
    """Wrong width or rank: torch raises AssertionError or RuntimeError depending on which op
    meets it first; ours raises before any kernel, an error that is both (and a ValueError)."""
    good, bad = torch.randn(5, 2, 8), torch.randn(5, 2, 6)
    for_torch, for_ours = [], []
    for ns, sink in ((torch.nn, for_torch), (M, for_ours)):
        torch.manual_seed(0)
        if case.startswith("enc"):
            layer = ns.TransformerEncoderLayer(8, 2, 16, norm_first=norm_first)
            args = (bad,) if case == "enc-src" else (torch.randn(1, 5, 2, 8),)
        else:
            layer = ns.TransformerDecoderLayer(8, 2, 16, norm_first=norm_first)
            args = (bad, good) if case == "dec-tgt" else (good, bad)
        with pytest.raises(Exception) as err:
            layer(*args)
        sink.append(err.value)
    assert isinstance(for_ours[0], type(for_torch[0])), (for_torch[0], for_ours[0])
    assert isinstance(for_ours[0], ValueError)


def test_mismatched_mask_dtypes_warn_like_torch():
    x = torch.randn(5, 2, 8)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    mask = torch.zeros(5, 5)
    for ns in (torch.nn, M):
        with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
            ns.MultiheadAttention(8, 2)(x, x, x, key_padding_mask=kpm, attn_mask=mask)
        with pytest.warns(UserWarning, match="mismatched src_key_padding_mask and mask"):
            layer = ns.TransformerEncoderLayer(8, 2, 16)
            ns.TransformerEncoder(layer, 2, enable_nested_tensor=False)(
                x, mask=mask, src_key_padding_mask=kpm)
    with warnings.catch_warnings(record=True) as rec:  # matching kinds: no warning
        warnings.simplefilter("always")
        M.MultiheadAttention(8, 2)(x, x, x, key_padding_mask=kpm, attn_mask=mask.bool())
    assert not [w for w in rec if "mismatched" in str(w.message)]


# --------------------------------------------------------------------------------------------
# TransformerEncoder / Decoder: the is_causal the layers receive


def _seen_is_causal(stack, *args, **kwargs):
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs.get("is_causal", kwargs.get("tgt_is_causal")))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in stack.layers]
    stack(*args, **kwargs)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("mask_kind", ["float_causal", "bool_causal", "float_other", "bool_other", "none"])
@pytest.mark.parametrize("hint", [None, True, False])
def test_causal_mask_detection_matches_torch(mask_kind, hint):
    L = 6
    float_causal = torch.nn.Transformer.generate_square_subsequent_mask(L)
    masks = {
        "float_causal": float_causal,
        "bool_causal": torch.ones(L, L, dtype=torch.bool).triu(1),
        "float_other": float_causal.roll(1, 0),
        "bool_other": torch.ones(L, L, dtype=torch.bool).triu(2),
        "none": None,
    }
    mask = masks[mask_kind]
    if hint and mask is None:
        pytest.skip("is_causal=True needs a mask")
    x = torch.randn(2, L, 8)
    results = []
    for ns in (torch.nn, M):
        torch.manual_seed(0)
        enc = ns.TransformerEncoder(ns.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                    enable_nested_tensor=False)
        dec = ns.TransformerDecoder(ns.TransformerDecoderLayer(8, 2, 16, batch_first=True), 2)
        results.append((_seen_is_causal(enc, x, mask=mask, is_causal=hint),
                        _seen_is_causal(dec, x, x, tgt_mask=mask, tgt_is_causal=hint)))
    assert results[0] == results[1]


def test_enable_nested_tensor_accepted():
    layer = M.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns here for a non-torch layer; ours does not
        enc = M.TransformerEncoder(layer, 2, enable_nested_tensor=True, mask_check=False)
    # use_nested_tensor follows torch's rule (unswap gives torch's encoder), unread by ours.
    theirs = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    assert enc.enable_nested_tensor is True and enc.use_nested_tensor is theirs.use_nested_tensor is True
    assert enc.mask_check is False
    odd_heads = M.TransformerEncoder(M.TransformerEncoderLayer(9, 3, 16, batch_first=True), 1)
    assert odd_heads.use_nested_tensor is False
