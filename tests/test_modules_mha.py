"""MultiheadAttention parity with torch.nn.MultiheadAttention under the DESIGN section 6 oracle:
outputs, attention weights and all parameter and input gradients, fp32 and bf16, eval and
training (dropout 0), across batch_first, self / cross / distinct q-k-v attention, every mask
kind torch accepts, is_causal, need_weights / average_attn_weights, kdim/vdim, add_bias_kv,
add_zero_attn, bias=False and unbatched inputs.  Plus the documented difference (fully masked
rows give zeros) and the copy-free q/k/v views."""
import pytest
import torch

import transformer_fast.modules as M
from test_modules_support import one_thread  # noqa: F401  (fixture)
from test_modules_support import assert_parity, fresh_generator, ours_like, randomize_

E, H, N, L, S = 16, 2, 3, 5, 7

pytestmark = pytest.mark.usefixtures("one_thread")


def _masks(spec, g, lq, lk, dtype=torch.float32, batched=True):
    """torch.nn polarity masks (bool True = not allowed / padding); key 0 is always open, so no
    query row is fully masked."""
    attn_mask = key_padding_mask = None
    is_causal = False
    for part in spec.split("+") if spec else []:
        if part in ("bool2d", "float2d", "bool3d", "float3d"):
            shape = (lq, lk) if part.endswith("2d") else ((N if batched else 1) * H, lq, lk)
            blocked = torch.rand(shape, generator=g) < 0.3
            blocked[..., 0] = False
            if part.startswith("bool"):
                attn_mask = blocked
            else:
                attn_mask = (torch.randn(shape, generator=g) * 0.5).masked_fill(blocked, float("-inf")).to(dtype)
        elif part in ("kpm", "kpm_float"):
            shape = (N, lk) if batched else (lk,)
            pad = torch.rand(shape, generator=g) < 0.3
            pad[..., 0] = False
            key_padding_mask = pad if part == "kpm" else (
                (torch.randn(shape, generator=g) * 0.5).masked_fill(pad, float("-inf")).to(dtype))
        elif part == "causal":
            attn_mask = torch.nn.Transformer.generate_square_subsequent_mask(lq, dtype=dtype)
            is_causal = True
        elif part == "causal_bool":
            attn_mask = torch.ones(lq, lk, dtype=torch.bool).triu(1)
            is_causal = True
        else:
            raise AssertionError(part)
    return attn_mask, key_padding_mask, is_causal


# id: (constructor kwargs, attention kind, mask spec, need_weights, average_attn_weights, unbatched)
CASES = {
    "self-none": (dict(), "self", "", False, True, False),
    "self-bf-weights": (dict(batch_first=True), "self", "", True, True, False),
    "self-bf-bool2d": (dict(batch_first=True), "self", "bool2d", False, True, False),
    "self-float2d-kpm": (dict(), "self", "float2d+kpm", False, True, False),
    "self-bf-bool3d-kpm-headweights": (dict(batch_first=True), "self", "bool3d+kpm", True, False, False),
    "self-bf-causal-kpm": (dict(batch_first=True), "self", "causal+kpm", False, True, False),
    "self-causal": (dict(), "self", "causal", False, True, False),
    "self-bf-causalbool-weights": (dict(batch_first=True), "self", "causal_bool", True, True, False),
    "self-kpmfloat-bool2d": (dict(batch_first=True), "self", "bool2d+kpm_float", False, True, False),
    "cross-bf-kpm": (dict(batch_first=True), "cross", "kpm", False, True, False),
    "cross-float3d-kpmfloat-weights": (dict(), "cross", "float3d+kpm_float", True, True, False),
    "distinct-bf-bool2d": (dict(batch_first=True), "distinct", "bool2d", False, True, False),
    "kvdim-bf-kpm": (dict(batch_first=True, kdim=6, vdim=10), "distinct", "kpm", False, True, False),
    "kvdim-float2d-weights": (dict(kdim=6, vdim=10), "distinct", "float2d", True, True, False),
    "biaskv-bool2d-kpm": (dict(add_bias_kv=True), "self", "bool2d+kpm", False, True, False),
    "zeroattn-bf-float3d-headweights": (dict(add_zero_attn=True, batch_first=True), "self", "float3d", True, False, False),
    "biaskv-zeroattn-cross-kpm-weights": (dict(add_bias_kv=True, add_zero_attn=True, batch_first=True), "cross", "kpm", True, True, False),
    "nobias-bf-bool2d": (dict(bias=False, batch_first=True), "self", "bool2d", False, True, False),
    "unbatched-self-weights": (dict(), "self", "", True, True, True),
    "unbatched-cross-kpm-bool3d": (dict(batch_first=True), "cross", "kpm+bool3d", False, True, True),
    "unbatched-self-causal": (dict(), "self", "causal", False, True, True),
    "unbatched-kvdim-float2d-headweights": (dict(kdim=6, vdim=10), "distinct", "float2d", True, False, True),
}


def _inputs(ctor, kind, unbatched, g, dtype=torch.float32):
    bf = ctor.get("batch_first", False)
    kdim, vdim = ctor.get("kdim", E), ctor.get("vdim", E)

    def seq(length, feat):
        if unbatched:
            return torch.randn(length, feat, generator=g)
        return torch.randn((N, length, feat) if bf else (length, N, feat), generator=g)

    lk = L if kind == "self" else S
    q = seq(L, E)
    if kind == "self":
        return (q, q, q), (0,), L, L
    if kind == "cross":
        mem = seq(S, E)
        return (q, mem, mem), (0, 1), L, S
    return (q, seq(S, kdim), seq(S, vdim)), (0, 1, 2), L, lk


@pytest.mark.filterwarnings("ignore:Support for mismatched")  # torch's deprecation (tested in _api)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_mha_matches_torch(case, dtype):
    ctor, kind, spec, need_weights, average, unbatched = CASES[case]
    g = fresh_generator()
    theirs = randomize_(torch.nn.MultiheadAttention(E, H, dropout=0.0, **ctor), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, dropout=0.0, **ctor)
    args, grad_inputs, lq, lk = _inputs(ctor, kind, unbatched, g)
    attn_mask, kpm, is_causal = _masks(spec, g, lq, lk, batched=not unbatched)
    kwargs = dict(key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask,
                  average_attn_weights=average, is_causal=is_causal)
    for training in (False, True) if case.startswith("self") else (False,):
        theirs.train(training)
        ours.train(training)
        assert_parity(theirs, ours, args, kwargs, dtype, grad_inputs,
                      context=f"{case} {dtype} training={training}")


def test_mha_return_shapes_match_torch():
    g = fresh_generator()
    for bf in (False, True):
        theirs = torch.nn.MultiheadAttention(E, H, batch_first=bf)
        ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=bf)
        q = torch.randn((N, L, E) if bf else (L, N, E), generator=g)
        for need_weights in (False, True):
            for average in (False, True):
                a = theirs(q, q, q, need_weights=need_weights, average_attn_weights=average)
                b = ours(q, q, q, need_weights=need_weights, average_attn_weights=average)
                assert a[0].shape == b[0].shape
                assert (a[1] is None) == (b[1] is None)
                if a[1] is not None:
                    assert a[1].shape == b[1].shape


def test_fully_masked_rows_are_zeros_where_torch_gives_nan():
    """The documented difference: a query with every key masked gives zeros (and finite, zero
    gradients through that row); torch's need_weights path gives NaN there."""
    g = fresh_generator()
    theirs = randomize_(torch.nn.MultiheadAttention(E, H, batch_first=True, bias=False), g)
    ours = ours_like(theirs, M.MultiheadAttention, E, H, batch_first=True, bias=False)
    x = torch.randn(N, L, E, generator=g, requires_grad=True)
    mask = torch.zeros(L, L, dtype=torch.bool)
    mask[2] = True  # query 2 may attend to nothing
    t_out, t_w = theirs(x, x, x, attn_mask=mask)
    assert torch.isnan(t_out[:, 2]).all() and torch.isnan(t_w[:, 2]).all()
    for need_weights in (False, True):
        out, w = ours(x, x, x, attn_mask=mask, need_weights=need_weights)
        # bias=False: a zero attention row projects to a zero output row
        assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
        if need_weights:
            assert torch.equal(w[:, 2], torch.zeros_like(w[:, 2]))
            others = [i for i in range(L) if i != 2]
            assert torch.allclose(w[:, others].sum(-1), torch.ones(N, L - 1))
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(grad).all()
        ok = torch.ones(L, dtype=torch.bool)
        ok[2] = False
        assert torch.allclose(out[:, ok], t_out[:, ok], atol=1e-5)


def test_self_attention_projects_once_into_strided_views(monkeypatch):
    """Self-attention: one in-projection GEMM, and q/k/v reach the attention op as views of its
    output (no copy): they share its storage."""
    from transformer_fast import functional as tf_functional

    seen = {}
    real = tf_functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen["qkv"] = (q, k, v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(tf_functional, "scaled_dot_product_attention", spy)
    for bf in (False, True):
        m = M.MultiheadAttention(E, H, batch_first=bf)
        x = torch.randn((N, L, E) if bf else (L, N, E))
        m(x, x, x, need_weights=False)
        q, k, v = seen["qkv"]
        assert q.shape == k.shape == v.shape == (N, H, L, E // H)
        base = q.untyped_storage().data_ptr()
        assert k.untyped_storage().data_ptr() == base == v.untyped_storage().data_ptr()
        assert not q.is_contiguous()  # a strided view of the (.., 3, H, D) projection
        assert k.data_ptr() - q.data_ptr() == E * q.element_size()  # k starts E after q
