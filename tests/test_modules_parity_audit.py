"""Parity audit of transformer_fast's drop-in modules and swap/unswap against the installed
torch, on the CPU with the "auto", "torch" and "cpu" backends: the unusual but legal argument
combinations the other module tests do not reach (add_bias_kv + add_zero_attn + padding +
3-D masks + per-head weights, kdim/vdim sequence-first, float padding masks, unbatched masks,
causal hints with rectangular masks, learnable float masks, activation modules with
parameters, float64, autocast, mixed-precision norms, torch's inference fast path, empty
batches, non-contiguous / expanded masks), more malformed inputs, copies, pickling and the
causal-mask helper.

The tests at the end pin the discrepancies the audit found (fixed since).
"""
import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fast
import transformer_fast.modules as M
from transformer_fast import reference
from conftest import require_backend
from test_modules_support import one_thread  # noqa: F401  (fixture)
from test_modules_support import assert_parity, fresh_generator, ours_like, randomize_

pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
    pytest.mark.filterwarnings("ignore:transformer_fast.swap"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.usefixtures("one_thread"),
]

# head dim 16: the smallest the C++ "cpu" attention kernels take, so that backend really runs
E, H, FF, N, L, S = 32, 2, 48, 2, 5, 7

BACKENDS = ["auto", "torch", "cpu"]


def _use(backend):
    """The use_backend context for ``backend`` (skipping when it cannot run here)."""
    if backend != "auto":
        require_backend(backend)
    return transformer_fast.use_backend(backend)


def _padding(g, n, length, dtype=torch.bool):
    """A key padding mask (True / -inf = padding), key 0 always open."""
    pad = torch.rand((n, length) if n else (length,), generator=g) < 0.35
    pad[..., 0] = False
    if dtype == torch.bool:
        return pad
    return (torch.randn(pad.shape, generator=g) * 0.3).masked_fill(pad, float("-inf")).to(dtype)


def _blocked(g, shape, dtype=torch.bool):
    """An attention mask (True / -inf = not allowed), key 0 always open."""
    blocked = torch.rand(shape, generator=g) < 0.3
    blocked[..., 0] = False
    if dtype == torch.bool:
        return blocked
    return (torch.randn(shape, generator=g) * 0.5).masked_fill(blocked, float("-inf")).to(dtype)


def _dtypes(backend):
    # the C++ cpu kernels take fp16/bf16/fp32; an explicit backend that cannot run an input
    # raises by design (DESIGN section 3), so float64 runs on auto and torch only
    return [torch.float32] if backend == "cpu" else [torch.float32, torch.float64]


# --------------------------------------------------------------------------------------------
# MultiheadAttention: unusual combinations, outputs + weights + every gradient (oracle)


def _mha_case(case, g):
    """(constructor kwargs, args, forward kwargs, grad_inputs) for a named case."""
    if case == "biaskv-zeroattn-kpm-float3d-headweights-seqfirst":
        ctor = dict(add_bias_kv=True, add_zero_attn=True)
        x = torch.randn(L, N, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, N, L), attn_mask=_blocked(g, (N * H, L, L), torch.float32),
                  need_weights=True, average_attn_weights=False)
        return ctor, (x, x, x), kw, (0,)
    if case == "biaskv-zeroattn-cross-kpmfloat-bool2d-bf":
        ctor = dict(add_bias_kv=True, add_zero_attn=True, batch_first=True)
        q, kv = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, N, S, torch.float32), attn_mask=_blocked(g, (L, S)),
                  need_weights=False)
        return ctor, (q, kv, kv), kw, (0, 1)
    if case == "kvdim-seqfirst-bool3d-kpm-headweights":
        ctor = dict(kdim=6, vdim=10)
        args = (torch.randn(L, N, E, generator=g), torch.randn(S, N, 6, generator=g),
                torch.randn(S, N, 10, generator=g))
        kw = dict(key_padding_mask=_padding(g, N, S), attn_mask=_blocked(g, (N * H, L, S)),
                  need_weights=True, average_attn_weights=False)
        return ctor, args, kw, (0, 1, 2)
    if case == "kvdim-biaskv-seqfirst-float2d-nokpm":
        ctor = dict(kdim=6, vdim=10, add_bias_kv=True)
        args = (torch.randn(L, N, E, generator=g), torch.randn(S, N, 6, generator=g),
                torch.randn(S, N, 10, generator=g))
        kw = dict(attn_mask=_blocked(g, (L, S), torch.float32), need_weights=False)
        return ctor, args, kw, (0, 1, 2)
    if case == "unbatched-biaskv-zeroattn-kpm-headweights":
        ctor = dict(add_bias_kv=True, add_zero_attn=True, batch_first=True)
        x = torch.randn(L, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, 0, L), attn_mask=_blocked(g, (H, L, L)),
                  need_weights=True, average_attn_weights=False)
        return ctor, (x, x, x), kw, (0,)
    if case == "unbatched-kpmfloat-float3d":
        ctor = dict()
        q, kv = torch.randn(L, E, generator=g), torch.randn(S, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, 0, S, torch.float32),
                  attn_mask=_blocked(g, (H, L, S), torch.float32), need_weights=False)
        return ctor, (q, kv, kv), kw, (0, 1)
    if case == "kpmfloat-only-weights":
        ctor = dict(batch_first=True)
        x = torch.randn(N, L, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, N, L, torch.float32), need_weights=True)
        return ctor, (x, x, x), kw, (0,)
    if case == "causal3d-bool-kpm-hint":
        ctor = dict(batch_first=True)
        x = torch.randn(N, L, E, generator=g)
        causal = torch.ones(L, L, dtype=torch.bool).triu(1).expand(N * H, L, L)
        kw = dict(key_padding_mask=_padding(g, N, L), attn_mask=causal, is_causal=True,
                  need_weights=False)
        return ctor, (x, x, x), kw, (0,)
    if case == "cross-causal-rect-hint-weights":
        ctor = dict(batch_first=True)
        q, kv = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
        kw = dict(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), is_causal=True,
                  need_weights=True)
        return ctor, (q, kv, kv), kw, (0, 1)
    if case == "nobias-zeroattn-kpm-weights":
        ctor = dict(bias=False, add_zero_attn=True)
        x = torch.randn(L, N, E, generator=g)
        kw = dict(key_padding_mask=_padding(g, N, L), need_weights=True)
        return ctor, (x, x, x), kw, (0,)
    raise AssertionError(case)


MHA_CASES = ["biaskv-zeroattn-kpm-float3d-headweights-seqfirst", "biaskv-zeroattn-cross-kpmfloat-bool2d-bf",
             "kvdim-seqfirst-bool3d-kpm-headweights", "kvdim-biaskv-seqfirst-float2d-nokpm",
             "unbatched-biaskv-zeroattn-kpm-headweights", "unbatched-kpmfloat-float3d",
             "kpmfloat-only-weights", "causal3d-bool-kpm-hint", "cross-causal-rect-hint-weights",
             "nobias-zeroattn-kpm-weights"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_unusual_combinations_match_torch(case, backend):
    g = fresh_generator()
    ctor, args, kwargs, grad_inputs = _mha_case(case, g)
    theirs = randomize_(nn.MultiheadAttention(E, H, dropout=0.0, **ctor), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, dropout=0.0, **ctor)
    with _use(backend):
        for dtype in _dtypes(backend):
            for training in (False, True):
                theirs.train(training)
                ours.train(training)
                assert_parity(theirs, ours, args, kwargs, dtype, grad_inputs,
                              context=f"{case} {backend} {dtype} training={training}")


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("which", ["attn_mask-2d", "attn_mask-3d", "key_padding_mask", "both"])
def test_mha_learnable_float_mask_gets_torch_gradients(which, need_weights, backend):
    """A float mask that requires grad (a learned relative-position bias, ALiBi slopes, ...)
    gets torch's gradient.  (An explicit "cpu" backend refuses such a mask with a BackendError
    naming the backends that can, by design: its kernels do not differentiate the mask.)"""
    g = fresh_generator()
    theirs = randomize_(nn.MultiheadAttention(E, H, batch_first=True), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True)
    x = torch.randn(N, L, E, generator=g)
    masks = {}
    if which in ("attn_mask-2d", "both"):
        masks["attn_mask"] = torch.randn(L, L, generator=g)
    if which == "attn_mask-3d":
        masks["attn_mask"] = torch.randn(N * H, L, L, generator=g)
    if which in ("key_padding_mask", "both"):
        masks["key_padding_mask"] = torch.randn(N, L, generator=g)
    upstream = torch.randn(N, L, E, generator=g)
    results = []
    with _use(backend):
        for module in (theirs, ours):
            leaves = {k: v.clone().requires_grad_(True) for k, v in masks.items()}
            out, _ = module(x, x, x, need_weights=need_weights, **leaves)
            grads = torch.autograd.grad(out, list(leaves.values()), upstream)
            results.append((out, grads))
    (out_t, grads_t), (out_o, grads_o) = results
    torch.testing.assert_close(out_o, out_t, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_o, grads_t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mha_dropout_weights_are_the_ones_applied():
    """need_weights in training with attention dropout: as torch, the returned per-head weights
    are the dropped (and rescaled) probabilities that multiplied the values."""
    g = fresh_generator()
    p = 0.5
    ours = randomize_(M.MultiheadAttention(E, H, dropout=p, batch_first=True), g).train()
    x = torch.randn(N, L, E, generator=g)
    out, w = ours(x, x, x, need_weights=True, average_attn_weights=False)
    assert w.shape == (N, H, L, L)
    zeros = (w == 0).float().mean()
    assert 0.2 < zeros < 0.8, zeros  # dropout really applied to the weights
    v = F.linear(x, ours.in_proj_weight[2 * E:], ours.in_proj_bias[2 * E:])
    v = v.view(N, L, H, E // H).transpose(1, 2)
    expected = ours.out_proj(torch.matmul(w, v).transpose(1, 2).reshape(N, L, E))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_noncontiguous_inputs_and_expanded_masks(backend):
    """Transposed inputs, stride-0 (expanded) padding and 3-D masks, transposed float masks."""
    g = fresh_generator()
    theirs = randomize_(nn.MultiheadAttention(E, H, batch_first=True), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True)
    x = torch.randn(L, N, E, generator=g).transpose(0, 1)  # (N, L, E) view
    pad = _padding(g, 0, L).expand(N, L)
    bool3d = _blocked(g, (L, L)).expand(N * H, L, L)
    float3d = _blocked(g, (L, N * H, L), torch.float32).transpose(0, 1)
    with _use(backend):
        for kw in (dict(key_padding_mask=pad, attn_mask=bool3d), dict(attn_mask=float3d),
                   dict(attn_mask=_blocked(g, (L, L), torch.float32).t())):
            for need_weights in (False, True):
                assert_parity(theirs, ours, (x, x, x), dict(kw, need_weights=need_weights),
                              torch.float32, (), context=f"{list(kw)} need_weights={need_weights}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_query(backend):
    """N = 0 and L = 0 (legal in torch): same shapes, no error."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True)
    layer_t = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    layer_o = ours_like(layer_t, M.TransformerEncoderLayer, E, H, FF, dropout=0.0, batch_first=True)
    x0, q0, kv = torch.randn(0, L, E), torch.randn(N, 0, E), torch.randn(N, S, E)
    with _use(backend):
        for need_weights in (False, True):
            for args in ((x0, x0, x0), (q0, kv, kv)):
                a, b = theirs(*args, need_weights=need_weights), ours(*args, need_weights=need_weights)
                assert a[0].shape == b[0].shape
                assert (a[1] is None) == (b[1] is None)
                if a[1] is not None:
                    assert a[1].shape == b[1].shape
        assert layer_o(x0).shape == layer_t(x0).shape == (0, L, E)


# --------------------------------------------------------------------------------------------
# Layers: activation modules, float padding masks, mixed masks


ACT_MODULES = {
    "nn.ReLU": lambda: nn.ReLU(),
    "nn.GELU": lambda: nn.GELU(),
    "nn.SiLU": lambda: nn.SiLU(),  # unfused module
    "nn.PReLU": lambda: nn.PReLU(),  # a module with a parameter (state_dict key activation.weight)
}


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("act", list(ACT_MODULES))
def test_layer_activation_module_instances(act, kind):
    g = fresh_generator()
    ctor = dict(dropout=0.0, batch_first=True, norm_first=kind == "decoder")
    cls_t = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    cls_o = M.TransformerEncoderLayer if kind == "encoder" else M.TransformerDecoderLayer
    theirs = randomize_(cls_t(E, H, FF, activation=ACT_MODULES[act](), **ctor), g)
    ours = cls_o(E, H, FF, activation=ACT_MODULES[act](), **ctor)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    if kind == "encoder":
        assert ours.activation_relu_or_gelu == theirs.activation_relu_or_gelu
        args, kw, grads = (torch.randn(N, L, E, generator=g),), dict(src_key_padding_mask=_padding(g, N, L)), (0,)
    else:
        args = (torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g))
        kw, grads = dict(memory_key_padding_mask=_padding(g, N, S)), (0, 1)
    for training in (False, True):
        theirs.train(training)
        ours.train(training)
        if kind == "encoder":
            assert_parity(theirs, ours, args, kw, torch.float32, grads, context=f"{act} training={training}")
        else:
            # the oracle helper deep-copies torch's module, and torch's decoder layer turns a module
            # activation into relu on copy (see test_decoder_layer_keeps_module_activation_on_copy):
            # compare the very modules, forward and every gradient, in float32
            _compare_in_place(theirs, ours, args, kw)


def _compare_in_place(theirs, ours, args, kwargs):
    outs, grads = [], []
    for module in (theirs, ours):
        leaves = [a.clone().requires_grad_(True) for a in args]
        out = module(*leaves, **kwargs)
        params = [p for _, p in module.named_parameters()]
        up = torch.ones_like(out).cumsum(-1).sin()
        grads.append(torch.autograd.grad(out, params + leaves, up))
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    names = [n for n, _ in theirs.named_parameters()] + [f"input {i}" for i in range(len(args))]
    for name, a, b in zip(names, *grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _encoder_kwargs(spec, g, unbatched=False):
    n = 0 if unbatched else N
    kw = {}
    if "kpmfloat" in spec:
        kw["src_key_padding_mask"] = _padding(g, n, L, torch.float32)
    elif "kpm" in spec:
        kw["src_key_padding_mask"] = _padding(g, n, L)
    if "float2d" in spec:
        kw["mask"] = _blocked(g, (L, L), torch.float32)
    if "bool2d" in spec:
        kw["mask"] = _blocked(g, (L, L))
    if "float3d" in spec:
        kw["mask"] = _blocked(g, ((n or 1) * H, L, L), torch.float32)
    if "causalbool" in spec:
        kw["mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)
    elif "causal" in spec:
        kw["mask"] = nn.Transformer.generate_square_subsequent_mask(L)
    if "hint" in spec:
        kw["is_causal"] = True
    return kw


ENCODER_SPECS = [
    # (mask spec, norm_first, batch_first, final norm, unbatched)
    ("kpmfloat+float2d", False, True, True, False),
    ("kpm+float2d", True, False, False, False),  # mismatched kinds: both become additive
    ("kpmfloat+bool2d", True, True, True, False),
    ("kpmfloat+float3d", False, False, False, False),
    ("kpm+causalbool", True, True, False, False),  # a bool causal mask, detected
    ("kpmfloat+causal+hint", False, True, True, False),
    ("kpm+float3d", True, False, True, True),  # unbatched
    ("kpmfloat+causal", False, True, False, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec,norm_first,batch_first,final_norm,unbatched", ENCODER_SPECS,
                         ids=[f"{s[0]}-{'preLN' if s[1] else 'postLN'}-{'bf' if s[2] else 'sf'}"
                              f"-{'norm' if s[3] else 'nonorm'}{'-unbatched' if s[4] else ''}"
                              for s in ENCODER_SPECS])
def test_encoder_stack_mask_mixes(spec, norm_first, batch_first, final_norm, unbatched, backend):
    g = fresh_generator()
    ctor = dict(dim_feedforward=FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)

    def build(ns):
        torch.manual_seed(0)
        return ns.TransformerEncoder(ns.TransformerEncoderLayer(E, H, **ctor), 2,
                                     ns.LayerNorm(E) if final_norm else None,
                                     enable_nested_tensor=False)

    theirs = randomize_(build(nn), g)
    ours = build(M)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    if unbatched:
        x = torch.randn(L, E, generator=g)
    else:
        x = torch.randn((N, L, E) if batch_first else (L, N, E), generator=g)
    kw = _encoder_kwargs(spec, g, unbatched)
    with _use(backend):
        for dtype in _dtypes(backend):
            for training in (False, True):
                theirs.train(training)
                ours.train(training)
                assert_parity(theirs, ours, (x,), kw, dtype, (0,),
                              context=f"{spec} {dtype} training={training}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
def test_decoder_stack_memory_masks(unbatched, backend):
    """3-D float memory mask with float memory padding; a rectangular (L != S) causal memory mask
    with memory_is_causal; a bool tgt causal mask detected by the stack."""
    g = fresh_generator()
    ctor = dict(dim_feedforward=FF, dropout=0.0, batch_first=False, norm_first=True)

    def build(ns):
        torch.manual_seed(0)
        return ns.TransformerDecoder(ns.TransformerDecoderLayer(E, H, **ctor), 2, None)

    theirs = randomize_(build(nn), g)
    ours = build(M)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    n = 0 if unbatched else N
    shape = (lambda ln: (ln, E)) if unbatched else (lambda ln: (ln, N, E))
    tgt, mem = torch.randn(shape(L), generator=g), torch.randn(shape(S), generator=g)
    cases = [
        dict(memory_mask=_blocked(g, ((n or 1) * H, L, S), torch.float32),
             memory_key_padding_mask=_padding(g, n, S, torch.float32)),
        dict(memory_mask=torch.ones(L, S, dtype=torch.bool).triu(1), memory_is_causal=True,
             tgt_mask=torch.ones(L, L, dtype=torch.bool).triu(1),
             tgt_key_padding_mask=_padding(g, n, L)),
    ]
    with _use(backend):
        for kw in cases:
            for dtype in _dtypes(backend):
                assert_parity(theirs, ours, (tgt, mem), kw, dtype, (0, 1), context=f"{list(kw)} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformer_all_masks_unbatched_and_custom_parts(backend):
    """Every mask of nn.Transformer at once (float src mask, bool padding, float memory mask),
    unbatched inputs, and custom_encoder / custom_decoder holding torch's own modules."""
    g = fresh_generator()

    def build(ns):
        torch.manual_seed(0)
        return ns.Transformer(E, H, 1, 2, FF, dropout=0.0, activation="gelu")

    theirs = randomize_(build(nn), g)
    ours = build(M)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    src, tgt = torch.randn(S, E, generator=g), torch.randn(L, E, generator=g)
    kw = dict(src_mask=_blocked(g, (S, S), torch.float32), tgt_mask=nn.Transformer.generate_square_subsequent_mask(L),
              memory_mask=_blocked(g, (L, S), torch.float32), src_key_padding_mask=_padding(g, 0, S, torch.float32),
              tgt_key_padding_mask=_padding(g, 0, L, torch.float32),
              memory_key_padding_mask=_padding(g, 0, S, torch.float32))
    with _use(backend):
        for dtype in _dtypes(backend):
            assert_parity(theirs, ours, (src, tgt), kw, dtype, (0, 1), context=f"unbatched {dtype}")
        # ours with torch's encoder / decoder plugged in
        mixed = M.Transformer(E, H, custom_encoder=copy.deepcopy(theirs.encoder),
                              custom_decoder=copy.deepcopy(theirs.decoder))
        mixed.load_state_dict(theirs.state_dict(), strict=True)
        assert_parity(theirs, mixed, (src, tgt), kw, torch.float32, (0, 1), context="custom parts")


NORM_VARIANTS = ["rmsnorm", "layernorm-no-affine", "identity-dropout", "per-norm-eps"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("variant", NORM_VARIANTS)
def test_swapped_encoder_with_modified_submodules(variant, norm_first, backend):
    """Common edits of a torch encoder before swap: RMSNorm layers / final norm (not fusable:
    the layer calls them), a non-affine LayerNorm, an nn.Identity in place of a Dropout, one
    norm's eps changed."""
    g = fresh_generator()
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    final = nn.RMSNorm(E) if variant == "rmsnorm" else nn.LayerNorm(E, elementwise_affine=False)
    theirs = nn.TransformerEncoder(layer, 2, final, enable_nested_tensor=False)
    for mod in theirs.layers:
        if variant == "rmsnorm":
            mod.norm1 = nn.RMSNorm(E)
        elif variant == "layernorm-no-affine":
            mod.norm2 = nn.LayerNorm(E, elementwise_affine=False)
        elif variant == "identity-dropout":
            mod.dropout = nn.Identity()
        else:
            mod.norm1.eps = 1e-2
    randomize_(theirs, g)
    ours = copy.deepcopy(theirs)
    transformer_fast.swap(ours)
    assert type(ours.layers[1]) is M.TransformerEncoderLayer
    x = torch.randn(N, L, E, generator=g)
    kw = dict(src_key_padding_mask=_padding(g, N, L))
    with _use(backend):
        for training in (False, True):
            theirs.train(training)
            ours.train(training)
            assert_parity(theirs, ours, (x,), kw, torch.float32, (0,), context=f"{variant} training={training}")


# --------------------------------------------------------------------------------------------
# dtype handling: autocast, mixed-precision norms, inference mode


def _oracle_ok(ours, torch_lp, ref64, dtype):
    atol = reference.ATOL[dtype] * max(1.0, float(ref64.abs().max()))
    err = float((ours.double() - ref64).abs().max())
    bound = 2.0 * float((torch_lp.double() - ref64).abs().max()) + atol
    return err <= bound, (err, bound)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mha", "encoder", "decoder"])
def test_cpu_autocast_bf16(kind, backend):
    """Under torch.autocast("cpu", bfloat16): torch's output dtype, and the oracle against the
    same module run in float64 without autocast."""
    g = fresh_generator()
    if kind == "mha":
        theirs = randomize_(nn.MultiheadAttention(E, H, batch_first=True), g)
        ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True)
    elif kind == "encoder":
        theirs = randomize_(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), g)
        ours = ours_like(theirs, M.TransformerEncoderLayer, E, H, FF, dropout=0.0, batch_first=True)
    else:
        theirs = randomize_(nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=True), g)
        ours = ours_like(theirs, M.TransformerDecoderLayer, E, H, FF, dropout=0.0, batch_first=True,
                         norm_first=True)
    x, mem = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
    pad = _padding(g, N, L)
    if kind == "mha":
        args, kw = (x, mem, mem), dict(key_padding_mask=_padding(g, N, S))
    elif kind == "encoder":
        args, kw = (x,), dict(src_key_padding_mask=pad)
    else:
        args, kw = (x, mem), dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(L),
                                  tgt_key_padding_mask=pad, tgt_is_causal=True)
    with torch.no_grad():
        ref64 = copy.deepcopy(theirs).double()(*[a.double() for a in args], **{
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kw.items()})
    with _use(backend), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out_t, out_o = theirs(*args, **kw), ours(*args, **kw)
    for i, (a, b, r) in enumerate(zip(*(o if isinstance(o, tuple) else (o,) for o in (out_t, out_o, ref64)))):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype)
        ok, detail = _oracle_ok(b, a, r, torch.bfloat16)
        assert ok, (i, detail)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
def test_fp32_norms_in_a_bf16_layer(norm_first, backend):
    """A common mixed-precision recipe: the layer in bfloat16, its LayerNorms kept in float32."""
    g = fresh_generator()
    ctor = dict(dropout=0.0, batch_first=True, norm_first=norm_first)
    theirs = randomize_(nn.TransformerEncoderLayer(E, H, FF, **ctor), g)
    ours = ours_like(theirs, M.TransformerEncoderLayer, E, H, FF, **ctor)
    ref = copy.deepcopy(theirs).double()
    for m in (theirs, ours):
        m.to(torch.bfloat16)
        m.norm1.float()
        m.norm2.float()
    x = torch.randn(N, L, E, generator=g)
    pad = _padding(g, N, L)
    with torch.no_grad():
        r = ref(x.double(), src_key_padding_mask=pad)
        with _use(backend):
            a = theirs(x.bfloat16(), src_key_padding_mask=pad)
            b = ours(x.bfloat16(), src_key_padding_mask=pad)
    assert a.dtype == b.dtype
    ok, detail = _oracle_ok(b, a, r, torch.bfloat16)
    assert ok, detail


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode_and_torch_fast_path(backend):
    """eval + no_grad / inference_mode, where torch takes its fused inference fast paths
    (torch._transformer_encoder_layer_fwd, torch._native_multi_head_attention): a swapped model
    gives what the original gave."""
    g = fresh_generator()
    model = randomize_(nn.Transformer(E, H, 2, 2, FF, dropout=0.0, batch_first=True), g).eval()
    mha = randomize_(nn.MultiheadAttention(E, H, batch_first=True), g).eval()
    original_model, original_mha = copy.deepcopy(model), copy.deepcopy(mha)
    transformer_fast.swap(model)
    transformer_fast.swap(mha)
    src, tgt = torch.randn(N, S, E, generator=g), torch.randn(N, L, E, generator=g)
    spad = _padding(g, N, S)
    kw = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(L), src_key_padding_mask=spad,
              memory_key_padding_mask=spad, tgt_is_causal=True)
    with _use(backend):
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                torch.testing.assert_close(model(src, tgt, **kw), original_model(src, tgt, **kw),
                                           rtol=1e-5, atol=2e-5)
                for mkw in (dict(), dict(key_padding_mask=spad), dict(key_padding_mask=spad, need_weights=False)):
                    a, b = original_mha(tgt, src, src, **mkw), mha(tgt, src, src, **mkw)
                    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-5)
                    if a[1] is not None:
                        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("final_norm", [False, True])
@pytest.mark.parametrize("case", ["bool", "float", "float_soft", "dead_row", "not_left_aligned",
                                  "grad", "train", "seq_first", "with_mask"])
def test_nested_tensor_encoder_matches_torch_everywhere(case, final_norm):
    """enable_nested_tensor=True (the default): where torch runs a padded eval batch as a
    NestedTensor (and only there: train mode, grad through the weights, seq-first layers, an
    attention mask or padding that is not left-aligned keep it padded), it leaves padded
    positions out and returns zeros there (norm(0) with a final norm), and reads a float padding
    mask by zero / nonzero alone.  Ours gives the same numbers at every position."""
    g = fresh_generator()
    batch_first = case != "seq_first"

    def build(ns):
        torch.manual_seed(0)
        layer = ns.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first)
        norm = ns.LayerNorm(E) if final_norm else None
        enc = ns.TransformerEncoder(layer, 2, norm, enable_nested_tensor=True)
        return enc.train() if case == "train" else enc.eval()

    theirs = randomize_(build(nn), g)
    ours = build(M)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert ours.use_nested_tensor is theirs.use_nested_tensor
    x = torch.randn(N, L, E, generator=g)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[0, 3:] = True
    mask = pad
    if case in ("float", "float_soft"):
        mask = torch.zeros(N, L).masked_fill(pad, float("-inf"))
        if case == "float_soft":
            mask[1, 4] = -0.5  # torch's NestedTensor path drops this key: nonzero = padding
            mask[0, 3:] = -1e4
    elif case == "dead_row":
        pad[1, :] = True
    elif case == "not_left_aligned":
        pad[1, 1] = True
    kwargs = {"src_key_padding_mask": mask}
    if case == "with_mask":
        # bool like the padding mask (torch 2.14's layer fast path gives NaN everywhere for a
        # float attention mask with a bool padding mask in eval; ours does not)
        # (key 0 open to every query: no row fully masked, where torch's fast path gives NaN)
        kwargs["mask"] = torch.rand(L, L, generator=g) < 0.3
        kwargs["mask"][:, 0] = False
    if not batch_first:
        x = x.transpose(0, 1)
    context = torch.enable_grad() if case == "grad" else torch.no_grad()
    with context:
        want, got = theirs(x, **kwargs), ours(x, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Malformed inputs (the ones test_modules_api does not cover)


def _bad_calls(ns):
    torch.manual_seed(0)
    x, m = torch.randn(5, 2, 16), torch.randn(7, 2, 16)
    B = torch.bool
    mha = ns.MultiheadAttention(16, 2)
    mkv = ns.MultiheadAttention(16, 2, kdim=6, vdim=10)
    el = ns.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
    dl = ns.TransformerDecoderLayer(16, 2, 32, dropout=0.0)
    enc = ns.TransformerEncoder(copy.deepcopy(el), 2, enable_nested_tensor=False)
    dec = ns.TransformerDecoder(copy.deepcopy(dl), 2)
    tr = ns.Transformer(16, 2, 1, 1, 32, dropout=0.0)
    return {
        "mha key/value length": lambda: mha(x, m, m[:6]),
        "mha value width": lambda: mha(x, m, torch.randn(7, 2, 8)),
        "mha 4-D attn_mask": lambda: mha(x, x, x, attn_mask=torch.zeros(1, 4, 5, 5, dtype=B)),
        "mha 1-D attn_mask": lambda: mha(x, x, x, attn_mask=torch.zeros(5, dtype=B)),
        "mha 3-D attn_mask batch*heads": lambda: mha(x, x, x, attn_mask=torch.zeros(5, 5, 5, dtype=B)),
        "mha attn_mask not a tensor": lambda: mha(x, x, x, attn_mask=[[0.0] * 5] * 5),
        "mha kdim/vdim swapped": lambda: mkv(x, torch.randn(7, 2, 10), torch.randn(7, 2, 6)),
        "mha int64 query": lambda: mha(x.long(), x.long(), x.long()),
        "mha float64 query": lambda: mha(x.double(), x.double(), x.double()),
        "mha unbatched kpm length": lambda: mha(x[:, 0], x[:, 0], x[:, 0], key_padding_mask=torch.zeros(4, dtype=B)),
        "mha unbatched 2-D attn_mask": lambda: mha(x[:, 0], x[:, 0], x[:, 0], attn_mask=torch.zeros(5, 4, dtype=B)),
        "encoder layer src_mask shape": lambda: el(x, src_mask=torch.zeros(5, 4, dtype=B)),
        "encoder layer kpm shape": lambda: el(x, src_key_padding_mask=torch.zeros(2, 4, dtype=B)),
        "encoder layer kpm rank": lambda: el(x, src_key_padding_mask=torch.zeros(2, 5, 1, dtype=B)),
        "encoder layer src_mask int": lambda: el(x, src_mask=torch.zeros(5, 5, dtype=torch.int64)),
        "encoder layer kpm int": lambda: el(x, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)),
        "encoder layer int src": lambda: el(x.long()),
        "encoder layer 1-D src": lambda: el(torch.randn(16)),
        "decoder layer tgt_mask shape": lambda: dl(x, m, tgt_mask=torch.zeros(5, 7, dtype=B)),
        "decoder layer memory_mask shape": lambda: dl(x, m, memory_mask=torch.zeros(5, 5, dtype=B)),
        "decoder layer tgt kpm int": lambda: dl(x, m, tgt_key_padding_mask=torch.zeros(2, 5, dtype=torch.int32)),
        "decoder layer memory kpm shape": lambda: dl(x, m, memory_key_padding_mask=torch.zeros(2, 5, dtype=B)),
        "decoder layer unbatched tgt, batched memory": lambda: dl(x[:, 0], m),
        "encoder mask shape": lambda: enc(x, mask=torch.zeros(4, 4, dtype=B)),
        "encoder kpm int": lambda: enc(x, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)),
        "encoder mask int": lambda: enc(x, mask=torch.zeros(5, 5, dtype=torch.int64)),
        "encoder 4-D src": lambda: enc(x[None]),
        "decoder tgt_mask int": lambda: dec(x, m, tgt_mask=torch.zeros(5, 5, dtype=torch.int64)),
        "decoder memory kpm shape": lambda: dec(x, m, memory_key_padding_mask=torch.zeros(2, 5, dtype=B)),
        "transformer unbatched src, batched tgt": lambda: tr(x[:, 0], x),
        "transformer 4-D src": lambda: tr(x[None], x),
        "transformer tgt_mask shape": lambda: tr(m, x, tgt_mask=torch.zeros(4, 4)),
        "layernorm width": lambda: ns.LayerNorm(16)(torch.randn(3, 8)),
        # is_causal without a mask, in training (torch's eval fast path of the encoder layer
        # ignores the hint instead; ours raises there too)
        "encoder layer is_causal without mask": lambda: el(x, is_causal=True),
        "decoder layer tgt_is_causal without mask": lambda: dl(x, m, tgt_is_causal=True),
        "decoder layer memory_is_causal without mask": lambda: dl(x, m, memory_is_causal=True),
        "encoder is_causal without mask": lambda: enc(x, is_causal=True),
        "decoder tgt_is_causal without mask": lambda: dec(x, m, tgt_is_causal=True),
        "transformer tgt_is_causal without mask": lambda: tr(m, x, tgt_is_causal=True),
        "transformer src_is_causal without mask": lambda: tr(m, x, src_is_causal=True),
    }


@pytest.mark.parametrize("case", list(_bad_calls(M)))
def test_more_bad_inputs_raise_like_torch(case):
    with pytest.raises(Exception) as torch_err:
        _bad_calls(nn)[case]()
    with pytest.raises(Exception) as our_err:
        _bad_calls(M)[case]()
    assert isinstance(our_err.value, type(torch_err.value)), (torch_err.value, our_err.value)


# --------------------------------------------------------------------------------------------
# Copies, pickling, dtype conversion, state_dict, the static causal-mask helper


def _all_modules(ns):
    torch.manual_seed(0)
    return {
        "mha-kvdim-biaskv": ns.MultiheadAttention(16, 2, kdim=6, vdim=10, add_bias_kv=True, add_zero_attn=True),
        "layernorm-noaffine": ns.LayerNorm([3, 16], elementwise_affine=False),
        "encoder-layer-gelu-module": ns.TransformerEncoderLayer(16, 2, 32, activation=nn.GELU(), dropout=0.0),
        "decoder-layer-prelu": ns.TransformerDecoderLayer(16, 2, 32, activation=nn.PReLU(), dropout=0.0),
        "encoder-nonorm": ns.TransformerEncoder(ns.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2, None,
                                                enable_nested_tensor=False),
        "decoder-norm": ns.TransformerDecoder(ns.TransformerDecoderLayer(16, 2, 32, dropout=0.0), 2, ns.LayerNorm(16)),
        "transformer-bias-false": ns.Transformer(16, 2, 1, 1, 32, dropout=0.0, bias=False, norm_first=True),
    }


def _call(name, module, g, dtype=torch.float32):
    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, m = r(5, 2, 16), r(7, 2, 16)
    if name.startswith("mha"):
        return module(x, r(7, 2, 6), r(7, 2, 10))[0]
    if name.startswith("layernorm"):
        return module(r(2, 3, 16))
    if name.startswith("encoder"):
        return module(x)
    if name.startswith("transformer"):
        return module(m, x)
    return module(x, m)  # decoder layer / stack


@pytest.mark.parametrize("name", list(_all_modules(M)))
def test_deepcopy_pickle_and_dtype_conversion(name):
    ours = _all_modules(M)[name]
    theirs = _all_modules(nn)[name]
    randomize_(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    seed = int(torch.randint(0, 2**31, ()))
    expected = _call(name, ours, torch.Generator().manual_seed(seed))
    torch.testing.assert_close(expected, _call(name, theirs, torch.Generator().manual_seed(seed)),
                               rtol=1e-5, atol=2e-5)
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert type(clone) is type(ours) and repr(clone) == repr(ours)
        torch.testing.assert_close(_call(name, clone, torch.Generator().manual_seed(seed)), expected,
                                   rtol=0, atol=0)
    # .double() / .to(dtype): a float64 checkpoint loads into torch's float64 module, strict
    # (in place: torch's decoder layer turns a module activation into relu on deepcopy)
    ours64 = ours.double()
    theirs64 = theirs.to(torch.float64)
    theirs64.load_state_dict(ours64.state_dict(), strict=True)
    sd = ours64.state_dict()
    assert all(v.dtype == torch.float64 for v in sd.values() if v.is_floating_point())
    got = _call(name, ours64, torch.Generator().manual_seed(seed), torch.float64)
    want = _call(name, theirs64, torch.Generator().manual_seed(seed), torch.float64)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_generate_square_subsequent_mask_called_like_torch():
    """On an instance, with device / dtype, with the default dtype changed, sz 0 and 1."""
    model = M.Transformer(16, 2, 1, 1, 32)
    theirs = nn.Transformer(16, 2, 1, 1, 32)
    for sz in (0, 1, 4):
        for kw in (dict(), dict(device="cpu"), dict(dtype=torch.float16), dict(device=torch.device("cpu"), dtype=torch.bfloat16)):
            a = theirs.generate_square_subsequent_mask(sz, **kw)
            b = model.generate_square_subsequent_mask(sz, **kw)
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        a, b = nn.Transformer.generate_square_subsequent_mask(3), M.Transformer.generate_square_subsequent_mask(3)
        assert a.dtype == b.dtype == torch.float64 and torch.equal(a, b)
    finally:
        torch.set_default_dtype(was)


def test_swap_unswap_round_trip_keeps_a_parametrized_linear():
    """A parametrization (weight_norm) on a layer's linear1 survives swap; the swapped layer
    computes with the parametrized weight; unswap restores torch's class."""
    from torch.nn.utils import parametrizations

    g = fresh_generator()
    model = randomize_(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), g)
    parametrizations.weight_norm(model.linear1)
    with torch.no_grad():
        model.linear1.parametrizations.weight.original0.mul_(1.7)
    original = copy.deepcopy(model)
    transformer_fast.swap(model)
    x = torch.randn(N, L, E, generator=g)
    torch.testing.assert_close(model(x), original(x), rtol=1e-5, atol=1e-5)
    transformer_fast.unswap(model)
    assert type(model) is nn.TransformerEncoderLayer
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Discrepancies the audit found, fixed since


def test_swap_inside_a_skipped_torch_layer_subclass_in_eval():
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    g = fresh_generator()
    model = nn.Sequential(randomize_(MyLayer(E, H, FF, dropout=0.0, batch_first=True), g)).eval()
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer_fast.swap(model)
    assert type(model[0].self_attn) is M.MultiheadAttention
    x = torch.randn(N, L, E, generator=g)
    pad = _padding(g, N, L)
    with torch.no_grad():
        torch.testing.assert_close(model[0](x, src_key_padding_mask=pad),
                                   original[0](x, src_key_padding_mask=pad), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), original(x), rtol=1e-5, atol=1e-5)


class _ScaledLinear(nn.Linear):
    """An nn.Linear subclass with its own forward (LoRA adapters, quantized / low-rank linears)."""

    def forward(self, x):
        return super().forward(x) * 2.0


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("which", ["linear1", "linear2"])
def test_linear_subclass_forward_is_called(which, kind):
    g = fresh_generator()
    cls_t = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    cls_o = M.TransformerEncoderLayer if kind == "encoder" else M.TransformerDecoderLayer
    theirs = randomize_(cls_t(E, H, FF, dropout=0.0, batch_first=True), g)
    ours = ours_like(theirs, cls_o, E, H, FF, dropout=0.0, batch_first=True)
    old = getattr(theirs, which)
    for m in (theirs, ours):
        new = _ScaledLinear(old.in_features, old.out_features)
        new.load_state_dict(old.state_dict())
        setattr(m, which, new)
    x = torch.randn(N, L, E, generator=g)
    args = (x,) if kind == "encoder" else (x, torch.randn(N, S, E, generator=g))
    torch.testing.assert_close(ours(*args), theirs(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
@pytest.mark.parametrize("path", ["need_weights", "key_padding_mask"])
def test_causal_hint_with_appended_keys(path, extra):
    g = fresh_generator()
    theirs = randomize_(nn.MultiheadAttention(E, H, batch_first=True, **{extra: True}), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True, **{extra: True})
    x = torch.randn(N, L, E, generator=g)
    kw = dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    if path == "need_weights":
        kw["need_weights"] = True
    else:
        kw.update(need_weights=False, key_padding_mask=torch.zeros(N, L, dtype=torch.bool))
    torch.testing.assert_close(ours(x, x, x, **kw)[0], theirs(x, x, x, **kw)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["mha", "decoder_layer"])
def test_batch_mismatch_error_class(where):
    errors = []
    for ns in (nn, M):
        torch.manual_seed(0)
        x = torch.randn(5, 2, 16)
        if where == "mha":
            mod, args = ns.MultiheadAttention(16, 2), (x, torch.randn(7, 3, 16), torch.randn(7, 3, 16))
        else:
            mod, args = ns.TransformerDecoderLayer(16, 2, 32), (x, torch.randn(7, 3, 16))
        with pytest.raises(Exception) as err:
            mod(*args)
        errors.append(err.value)
    assert isinstance(errors[1], type(errors[0])), errors


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.float16], ids=["f64", "f16"])
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["flash", "weights"])
def test_float_mask_of_another_dtype_rejected_like_torch(which, mask_dtype, need_weights):
    x = torch.randn(5, 2, 16)
    mask = torch.zeros((5, 5) if which == "attn_mask" else (2, 5), dtype=mask_dtype)
    for ns in (nn, M):
        torch.manual_seed(0)
        with pytest.raises(RuntimeError):
            ns.MultiheadAttention(16, 2)(x, x, x, need_weights=need_weights, **{which: mask})


def _outcome(fn):
    """("ok", output) or the exception's family: which of torch's classes a caller catches."""
    try:
        return "ok", fn()
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:
        return tuple(c.__name__ for c in (RuntimeError, AssertionError, TypeError, ValueError)
                     if isinstance(e, c)), None


_X5 = (5, 2, 16)
_MASK_CASES = {
    # torch adds the two masks (a bool one becomes the query's dtype), so the sum is fp32 here
    "f16-attn_mask+bool-padding": lambda ns, x: ns.MultiheadAttention(16, 2)(
        x, x, x, attn_mask=torch.randn(5, 5).half(), key_padding_mask=torch.rand(2, 5) < 0.3,
        need_weights=False),
    "f16-attn_mask+bool-padding-weights": lambda ns, x: ns.MultiheadAttention(16, 2)(
        x, x, x, attn_mask=torch.randn(5, 5).half(), key_padding_mask=torch.rand(2, 5) < 0.3),
    "f16-padding+f32-attn_mask": lambda ns, x: ns.MultiheadAttention(16, 2)(
        x, x, x, attn_mask=torch.randn(5, 5), key_padding_mask=torch.randn(2, 5).half(),
        need_weights=False),
    "f64-model-f32-attn_mask+bool-padding-weights": lambda ns, x: ns.MultiheadAttention(16, 2, dtype=torch.float64)(
        x.double(), x.double(), x.double(), attn_mask=torch.randn(5, 5),
        key_padding_mask=torch.rand(2, 5) < 0.3),
    "f64-model-f32-attn_mask-weights": lambda ns, x: ns.MultiheadAttention(16, 2, dtype=torch.float64)(
        x.double(), x.double(), x.double(), attn_mask=torch.randn(5, 5)),
    # is_causal without padding or weights: torch drops attn_mask after checking only its rank
    "causal-drops-f64-src_mask": lambda ns, x: ns.TransformerEncoderLayer(16, 2, 32, dropout=0.0)(
        x, src_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64), is_causal=True),
    "causal-4d-attn_mask": lambda ns, x: ns.MultiheadAttention(16, 2)(
        x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(1).expand(1, 4, 5, 5),
        is_causal=True, need_weights=False),
    "causal-unbatched-3d-attn_mask-of-1-head": lambda ns, x: ns.MultiheadAttention(16, 2)(
        x[:, 0], x[:, 0], x[:, 0], attn_mask=torch.ones(1, 5, 5, dtype=torch.bool).triu(1),
        is_causal=True, need_weights=False),
    # torch checks attn_mask's size before key_padding_mask's (a RuntimeError, not an assertion)
    "length-disagrees-with-both-masks": lambda ns, x: ns.TransformerEncoderLayer(16, 2, 32, dropout=0.0)(
        torch.randn(6, 2, 16), src_mask=torch.zeros(5, 5),
        src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
    "integer-3d-tgt_mask-in-decoder": lambda ns, x: ns.TransformerDecoder(ns.TransformerDecoderLayer(16, 2, 32), 1)(
        x, torch.randn(7, 2, 16), tgt_mask=torch.zeros(4, 5, 5, dtype=torch.int64)),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(_MASK_CASES))
def test_mask_checks_follow_torch(case):
    """Mask dtype / shape rules where torch's order of operations decides (found by a
    differential fuzz against torch.nn): the same inputs run on both, or raise a class a
    caller of torch's module catches, and where both run the outputs agree."""
    x = torch.randn(*_X5)
    results = []
    for ns in (nn, M):
        torch.manual_seed(0)
        results.append(_outcome(lambda: _MASK_CASES[case](ns, x)))
    (theirs, t_out), (ours, o_out) = results
    if theirs == "ok":
        assert ours == "ok", f"torch runs {case}; ours raised {ours}"
        t_out = t_out[0] if isinstance(t_out, tuple) else t_out
        o_out = o_out[0] if isinstance(o_out, tuple) else o_out
        torch.testing.assert_close(o_out, t_out, rtol=1e-4, atol=1e-5)
    else:
        assert ours != "ok", f"torch raises {theirs} for {case}; ours ran"
        assert set(theirs) <= set(ours), f"torch raises {theirs}; ours {ours}"


def test_unswapped_encoder_keeps_torch_nested_tensor_flag():
    def build(ns):
        return ns.TransformerEncoder(ns.TransformerEncoderLayer(E, H, FF, batch_first=True), 2,
                                     enable_nested_tensor=True)

    theirs, ours = build(nn), build(M)
    transformer_fast.unswap(ours)
    assert type(ours) is nn.TransformerEncoder
    assert ours.use_nested_tensor == theirs.use_nested_tensor


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["mha", "encoder", "encoder-pre", "decoder", "transformer"])
def test_dropout_one_in_training_matches_torch(kind, need_weights):
    """dropout=1.0 is a rate torch's modules accept (every dropped branch becomes zeros); the
    functional ops take [0, 1), so the modules zero those branches themselves (the attention
    times zero, the layers through their unfused blocks).  Found by an audit: training mode
    raised.  Outputs and every gradient as torch's, float64."""
    if need_weights and kind != "mha":
        pytest.skip("need_weights is MultiheadAttention's argument")
    torch.manual_seed(0)
    build = {
        "mha": lambda ns: ns.MultiheadAttention(16, 4, dropout=1.0, batch_first=True),
        "encoder": lambda ns: ns.TransformerEncoderLayer(16, 4, 32, dropout=1.0, batch_first=True),
        "encoder-pre": lambda ns: ns.TransformerEncoderLayer(16, 4, 32, dropout=1.0, batch_first=True,
                                                             norm_first=True),
        "decoder": lambda ns: ns.TransformerDecoderLayer(16, 4, 32, dropout=1.0, batch_first=True),
        "transformer": lambda ns: ns.Transformer(16, 4, 1, 1, 32, dropout=1.0, batch_first=True),
    }[kind]
    theirs = build(nn).double().train()
    ours = build(M).double().train()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    mem = torch.randn(3, 7, 16, dtype=torch.float64)

    def run(module):
        inp = x.clone().requires_grad_(True)
        if kind == "mha":
            out, w = module(inp, inp, inp, need_weights=need_weights)
        else:
            out, w = module(*((inp,) if kind.startswith("encoder") else (inp, mem))), None
        out.sum().backward()
        grads = [inp.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in module.parameters()]
        return out, w, grads

    (t_out, t_w, t_grads), (o_out, o_w, o_grads) = run(theirs), run(ours)
    torch.testing.assert_close(o_out, t_out, rtol=1e-12, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(o_w, t_w, rtol=0, atol=0)
    for a, b in zip(o_grads, t_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _fast_path_cases():
    """Inputs on which torch's encoder-layer inference fast path (eval, no grad, batch_first)
    computes something else than its training path: float masks (read by zero / nonzero after
    merge_masks, of any float dtype), the is_causal hint without a mask (ignored)."""
    kpm = torch.zeros(N, L)
    kpm[0, 3:] = -2.0
    kpm[1, 1] = 2.0
    kpm_bool = torch.zeros(N, L, dtype=torch.bool)
    kpm_bool[0, 3:] = True
    am = torch.zeros(L, L)
    am[:, 2] = -2.0
    am[3, 1] = 0.5
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    return {
        "float kpm": dict(src_key_padding_mask=kpm),
        "float mask": dict(mask=am),
        "float mask (N*H, L, L)": dict(mask=torch.randn(N * H, L, L).round().clamp(max=0)),
        "float mask + float kpm": dict(mask=am, src_key_padding_mask=kpm),
        "float64 mask": dict(mask=am.double()),
        "fp16 kpm": dict(src_key_padding_mask=kpm.half()),
        "bf16 mask + bool kpm": dict(mask=am.bfloat16(), src_key_padding_mask=kpm_bool),
        "is_causal without mask": dict(is_causal=True),
        "causal float mask + hint": dict(mask=causal, is_causal=True),
        "causal float mask + float kpm + hint": dict(mask=causal, src_key_padding_mask=kpm, is_causal=True),
    }


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("stack", [False, True], ids=["layer", "encoder"])
@pytest.mark.parametrize("case", list(_fast_path_cases()))
def test_encoder_fast_path_inputs_match_torch(case, stack, norm_first, grad):
    """The 2026-11-28 audit: in eval without grad torch's encoder layer (alone or in a
    TransformerEncoder) ran its fast path, which accepts a float mask of another dtype than the
    input (ours raised), reads float masks by zero / nonzero (ours added them) and ignores the
    is_causal hint without a mask; with grad both take the training path.  Ours gives torch's
    result, or raises the same error type, either way."""
    g = fresh_generator()

    def build(ns):
        torch.manual_seed(0)
        layer = ns.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
        if stack:
            return ns.TransformerEncoder(layer, 2, ns.LayerNorm(E), enable_nested_tensor=False).eval()
        return layer.eval()

    theirs = randomize_(build(nn), g)
    ours = build(M)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    kwargs = dict(_fast_path_cases()[case])
    if not stack and "mask" in kwargs:
        kwargs["src_mask"] = kwargs.pop("mask")
    x = torch.randn(N, L, E, generator=g)
    with torch.set_grad_enabled(grad):
        try:
            want = theirs(x, **kwargs)
        except Exception as exc:  # noqa: BLE001
            with pytest.raises(type(exc)):
                ours(x, **kwargs)
            return
        got = ours(x, **kwargs)
    finite = torch.isfinite(want)  # torch's fast path gives NaN for rows it leaves without keys
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("stack", [False, True], ids=["layer", "encoder"])
def test_encoder_fast_path_under_cpu_autocast_returns_its_dtype(stack, dtype):
    """torch's fast path runs under a CPU autocast (its check reads CUDA's) and returns the
    autocast dtype; ours too (the audit: float32)."""
    g = fresh_generator()
    layer = M.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    theirs_layer = randomize_(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True), g)
    layer.load_state_dict(theirs_layer.state_dict())
    ours = M.TransformerEncoder(layer, 2, enable_nested_tensor=False) if stack else layer
    theirs = nn.TransformerEncoder(theirs_layer, 2, enable_nested_tensor=False) if stack else theirs_layer
    ours.eval(), theirs.eval()
    x = torch.randn(N, L, E, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want, got = theirs(x), ours(x)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.1)
