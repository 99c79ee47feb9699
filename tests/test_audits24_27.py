"""From the twenty-fourth to twenty-seventh outside audits (PyTorch's own module tests run
against ours, the suite on the GPU machines' torch 2.11 / Python 3.12 / Triton 3.6, mutation
testing of the Triton backward / reference / decoding, mutation testing of the CUDA kernels
through the CPU emulation; 2026-11-30, twelfth session):

- MultiheadAttention with an in_proj_bias of another dtype than its weights (torch's test
  test_multihead_attn_fast_path_query_and_bias_have_different_dtypes): torch's in-projection of
  a batched, non-contiguous query runs matmul then add_, promoting the bias; ours refused it in
  addmm.
- The modules' input errors were AssertionError and RuntimeError at once everywhere; torch's
  test_transformer_args_check needs an AssertionError that is not a RuntimeError in training.
- Attention's output of a query broadcast over heads (or over the length) was laid out with the
  broadcast dim outermost: not contiguous, where torch's SDPA gives torch.empty_like's order.
- Mutants no test caught: the oracle's bound 10x looser, a NaN the reference lacks not counted,
  poisoned_outputs no longer poisoning (here); the Triton backward's delta kernel reading out
  with dO's strides, a key block whose only valid key is its last skipped in backward
  (tests/test_triton_attention.py).
"""
from __future__ import annotations

import pytest
import torch

import transformer_fast as tf
from transformer_fast import functional as tff, reference
from transformer_fast.kernels.layout import empty_in_layout_of

from conftest import backend_params, require_backend


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim"])
@pytest.mark.parametrize("training", [False, True])
def test_mha_in_proj_bias_of_another_dtype(bias_dtype, kind, training):
    kw = dict(kdim=6, vdim=5) if kind == "kdim" else {}
    ref = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.double, **kw)
    ours = tf.MultiheadAttention(4, 2, batch_first=True, dtype=torch.double, **kw)
    ours.load_state_dict(ref.state_dict())
    bias = torch.randn(12, dtype=torch.double).to(bias_dtype)
    for m in (ref, ours):
        m.in_proj_bias = torch.nn.Parameter(bias.clone())
        m.train(training)
    q = torch.randn(3, 4, 4, dtype=torch.double)
    k = q if kind == "self" else torch.randn(3, 5, kw.get("kdim", 4), dtype=torch.double)
    v = q if kind == "self" else (k if kind == "cross" else torch.randn(3, 5, 5, dtype=torch.double))
    with torch.set_grad_enabled(training):
        want, want_w = ref(q, k, v)
        got, got_w = ours(q, k, v)
    assert got.dtype == want.dtype == torch.double
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)
    if training:
        want.sum().backward()
        got.sum().backward()
        assert ours.in_proj_bias.grad.dtype == bias_dtype
        torch.testing.assert_close(ours.in_proj_bias.grad, ref.in_proj_bias.grad)


# --------------------------------------------------------------------------------------------
# Error classes: torch's own test_transformer_args_check nests assertRaises(RuntimeError) inside
# assertRaises(AssertionError) for a key padding mask of the wrong shape in training: the error
# must be an AssertionError and NOT a RuntimeError there (ours was both everywhere).

_FAMILY = (AssertionError, RuntimeError)
_E, _H, _N, _S, _T = 8, 2, 3, 5, 4


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the class is what is compared
        return exc
    return None


def _seq(batch_first, length, n=_N, e=_E):
    return torch.randn(n, length, e) if batch_first else torch.randn(length, n, e)


def _bad_calls(kind, batch_first):
    """(name, args, kwargs) of malformed calls of one module kind."""
    s, t = _seq(batch_first, _S), _seq(batch_first, _T)
    bool_ = torch.bool
    if kind == "mha":
        yield "kpm shape", (s, s, s), dict(key_padding_mask=torch.zeros(_N + 1, _S, dtype=bool_))
        yield "kpm rank", (s, s, s), dict(key_padding_mask=torch.zeros(_N, _S, 1, dtype=bool_))
        yield "mask shape", (s, s, s), dict(attn_mask=torch.zeros(_S + 1, _S, dtype=bool_))
        yield "mask int", (s, s, s), dict(attn_mask=torch.zeros(_S, _S, dtype=torch.int64))
        yield "embed", (s[..., :-1],) * 3, {}
        yield "cross kpm", (t, s, s), dict(key_padding_mask=torch.zeros(_N, _S + 1, dtype=bool_))
        yield "key rank", (s, s[0], s[0]), {}
    elif kind == "encoder_layer":
        yield "kpm shape", (s,), dict(src_key_padding_mask=torch.zeros(_N + 1, _S, dtype=bool_))
        yield "mask int", (s,), dict(src_mask=torch.zeros(_S, _S, dtype=torch.int64))
        yield "kpm int", (s,), dict(src_key_padding_mask=torch.zeros(_N, _S, dtype=torch.int64))
    elif kind == "decoder":
        yield "tgt kpm", (t, s), dict(tgt_key_padding_mask=torch.zeros(_N + 1, _T, dtype=bool_))
        yield "memory kpm", (t, s), dict(memory_key_padding_mask=torch.zeros(_N, _S + 1, dtype=bool_))
        yield "tgt mask int", (t, s), dict(tgt_mask=torch.zeros(_T, _T, dtype=torch.int64))
        yield "tgt mask int 3-D", (t, s), dict(tgt_mask=torch.zeros(_N * _H, _T, _T, dtype=torch.int64))
    else:  # transformer
        yield "src kpm", (s, t), dict(src_key_padding_mask=torch.zeros(_N + 2, _S + 1, dtype=bool_))
        yield "memory kpm", (s, t), dict(memory_key_padding_mask=torch.zeros(_N + 2, _S + 1, dtype=bool_))


def _build(mod, kind, batch_first):
    kw = dict(dim_feedforward=16, dropout=0.0, batch_first=batch_first)
    if kind == "mha":
        return mod.MultiheadAttention(_E, _H, batch_first=batch_first)
    if kind == "encoder_layer":
        return mod.TransformerEncoderLayer(_E, _H, **kw)
    if kind == "decoder":
        return mod.TransformerDecoder(mod.TransformerDecoderLayer(_E, _H, **kw), 2)
    return mod.Transformer(_E, _H, 1, 1, **kw)


@pytest.mark.parametrize("kind", ["mha", "encoder_layer", "decoder", "transformer"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_input_errors_are_of_torchs_class(kind, batch_first, mode):
    """Where torch surely runs its Python path (training, batch_first=False, grad needed) our
    error is of exactly torch's classes among AssertionError / RuntimeError; where its inference
    fast path may run (eval, batch_first, no grad) at least torch's class."""
    ref, ours = _build(torch.nn, kind, batch_first), _build(tf, kind, batch_first)
    ours.load_state_dict(ref.state_dict())
    ref.train(mode == "train")
    ours.train(mode == "train")
    surely_slow = mode != "eval_no_grad" or not batch_first
    for name, args, kwargs in _bad_calls(kind, batch_first):
        with torch.set_grad_enabled(mode != "eval_no_grad"):
            want = _raised(lambda: ref(*args, **kwargs))
            got = _raised(lambda: ours(*args, **kwargs))
        assert want is not None and got is not None, (name, want, got)
        assert isinstance(got, (ValueError, TypeError)), (name, type(got).__mro__)
        want_family = {c for c in _FAMILY if isinstance(want, c)}
        got_family = {c for c in _FAMILY if isinstance(got, c)}
        assert want_family <= got_family, (name, type(want), type(got).__mro__)
        if surely_slow:
            assert got_family == want_family, (name, type(want), type(got).__mro__)


def test_transformer_key_padding_mask_error_is_an_assertion_not_a_runtime_error():
    """torch's test_transformer_args_check, the nesting that failed on ours."""
    model = tf.Transformer(16, 2, 1, 1, 32, 0.3)  # training, batch_first=False
    src, tgt = torch.randn(7, 3, 16), torch.randn(5, 3, 16)
    with pytest.raises(AssertionError) as info:
        model(src, tgt, src_key_padding_mask=torch.rand(4, 8) >= 0.5)
    assert not isinstance(info.value, RuntimeError)
    assert "src_key_padding_mask" in str(info.value)


# --------------------------------------------------------------------------------------------
# The oracle itself (DESIGN section 6): its factor of 2, its NaN rule, its poisoning.


def test_oracle_bound_is_twice_the_reference_error():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    a, b = (torch.randn(64, 64, generator=g) * 100 for _ in range(2))
    ref64 = a.double() @ b.double()
    err = (a @ b).double() - ref64
    assert float(err.abs().max()) > 100 * reference.ATOL[torch.float32]  # atol negligible
    for factor, ok in ((1.5, True), (1.9, True), (2.2, False), (3.0, False)):
        # (in float64: a rounding to float32 would move the result by up to half an ulp)
        result = reference.oracle_compare("out", ref64 + factor * err, a @ b, ref64, torch.float32)
        assert result.ok is ok, (factor, result)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_oracle_counts_a_non_finite_value_the_reference_lacks(bad):
    ref = torch.zeros(4, dtype=torch.float64)
    out = torch.tensor([0.0, bad, 0.0, 0.0])
    assert reference.max_abs_error(out, ref) == float("inf")
    assert not reference.oracle_compare("out", out, ref.float(), ref, torch.float32).ok
    # where the reference has it too, it is not an error
    assert reference.max_abs_error(out, out.double()) == 0.0


def test_poisoned_outputs_fill_new_tensors_with_nan():
    was = torch.are_deterministic_algorithms_enabled()
    with reference.poisoned_outputs():
        fresh = torch.empty(16)
        from_cxx = torch.empty_like(torch.zeros(3, 5).t())  # at::empty_strided
    assert fresh.isnan().all() and from_cxx.isnan().all()
    assert torch.are_deterministic_algorithms_enabled() == was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sliced_copies_hold_a_huge_finite_value_in_their_gaps(dtype):
    """The oracle's copy of a sliced input keeps its strides, and its gaps hold a quarter of the
    dtype's max (another tensor's data in a caller's buffer), even under poisoned_outputs: a
    kernel that used them would be far off, but torch's oneDNN bf16 GEMMs on AMX CPUs, which
    read a row's gap elements against zero padding, give the contiguous input's result (with
    NaN there they gave NaN: the fuzz's linear_cross_entropy failed on an AMX Xeon)."""
    base = torch.randn(17, 38, dtype=dtype)
    sliced = base[:, 1:36]
    with reference.poisoned_outputs():
        copy = reference.copy_keeping_layout(sliced)
    assert copy.stride() == sliced.stride() and torch.equal(copy, sliced)
    flat = copy.as_strided((copy.untyped_storage().nbytes() // copy.element_size(),), (1,), 0)
    gaps = flat.view(-1)[35:].unfold(0, 3, 38)  # the 3 elements after each row but the last
    assert (gaps == torch.finfo(dtype).max / 4).all()
    w = torch.randn(7, 35, dtype=dtype)
    # Close, not equal: MKL's fp32 GEMM may block a leading dimension of 38 differently from one
    # of 35 (a CI run differed in the last bits); a GEMM that read a gap would be ~1e37 off.
    torch.testing.assert_close(torch.mm(copy, w.t()), torch.mm(sliced.contiguous(), w.t()))


# --------------------------------------------------------------------------------------------
# Attention's output layout: torch.empty_like's order for an expanded or sliced query.


def _layouts():
    B, H, L, D = 2, 3, 5, 16
    yield "heads broadcast", torch.randn(B, 1, L, D).expand(B, H, L, D)
    yield "batch broadcast", torch.randn(1, H, L, D).expand(B, H, L, D)
    yield "length broadcast", torch.randn(B, H, 1, D).expand(B, H, L, D)
    yield "heads broadcast of (B, L, H, D)", torch.randn(B, L, 1, D).expand(B, L, H, D).transpose(1, 2)
    yield "packed (B, L, 3, H, D)", torch.randn(B, L, 3, H, D)[:, :, 0].transpose(1, 2)
    yield "packed (L, B, 3, H, D)", torch.randn(L, B, 3, H, D)[:, :, 0].permute(1, 2, 0, 3)
    yield "sliced heads", torch.randn(B, 2 * H, L, D)[:, ::2]


@pytest.mark.parametrize("backend", backend_params("torch", "cpu", "triton"))
def test_attention_output_in_torchs_layout(backend):
    device = require_backend(backend)
    for name, q in _layouts():
        q = q.to(device)
        k, v = (torch.randn(2, 3, 7, 16, device=device) for _ in range(2))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        got = tff.scaled_dot_product_attention(q, k, v, backend=backend)
        assert got.stride() == torch.empty_like(q).stride(), (name, got.stride())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_empty_in_layout_of_is_empty_likes_order():
    """Every (B, H, L) stride pattern of small sizes: sliced, permuted, broadcast, size 1; the
    C++ twin (csrc/attention_cuda.h) through the cpu backend's outputs above."""
    import itertools

    count = 0
    for sizes in itertools.product((1, 2, 3), repeat=3):
        for perm in itertools.permutations(range(3)):
            for gap, broadcast in itertools.product((1, 2), range(8)):
                buf = torch.empty([sizes[p] for p in perm] + [gap, 4])[..., 0, :]
                q = buf.permute(*[perm.index(i) for i in range(3)], 3)
                shape = list(q.shape[:3])
                for d in range(3):
                    if broadcast >> d & 1:
                        q, shape[d] = q.narrow(d, 0, 1), shape[d] + 1
                q = q.expand(*shape, 4)
                got, want = empty_in_layout_of(q, (*shape, 4)), torch.empty_like(q)
                # (a dim of size 1 may have any stride: empty_like keeps q's for a dense q)
                assert all(got.stride(d) == want.stride(d) for d in range(4) if q.shape[d] > 1), (
                    sizes, perm, gap, broadcast, got.stride(), want.stride())
                count += 1
    assert count == 27 * 6 * 16


# --------------------------------------------------------------------------------------------
# torch 2.11 (the GPU machines' version): its dynamo cannot trace torch.amp.is_autocast_available
# nor read a walrus target inside a generator expression; both broke every fullgraph compile of
# the layers there while torch 2.14 (CI) traced them.  CI cannot run 2.11: these pin the idioms.


def test_layers_never_ask_is_autocast_available_for_cpu(monkeypatch):
    def refuse(device_type):
        raise AssertionError(f"is_autocast_available({device_type!r}) called (torch 2.11's dynamo cannot trace it)")

    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)
    torch.manual_seed(0)
    model = tf.Transformer(16, 2, 1, 1, 32, dropout=0.1, batch_first=True)
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    model(src, tgt, tgt_mask=model.generate_square_subsequent_mask(4)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(src, tgt, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    tf.MultiheadAttention(16, 2)(src, src, src)


def test_no_walrus_inside_a_comprehension():
    import ast
    import pathlib

    root = pathlib.Path(tf.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
                if any(isinstance(inner, ast.NamedExpr) for inner in ast.walk(node)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


# --------------------------------------------------------------------------------------------
# torch.nn.attention.bias.CausalBias as attn_mask (torch's SDPA takes it through
# __torch_function__; ours read its uninitialised storage as a float mask).


@pytest.mark.parametrize("backend", backend_params("reference", "torch", "cpu", "triton"))
@pytest.mark.parametrize("lengths", [(4, 6), (6, 4), (5, 5)], ids=str)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_as_attn_mask(backend, lengths, variant):
    from torch.nn.attention import bias as attn_bias

    device = require_backend(backend)
    lq, lk = lengths
    make = getattr(attn_bias, f"causal_{variant}")
    q, k, v = (torch.randn(2, 2, n, 16, device=device, requires_grad=True) for n in (lq, lk, lk))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=make(lq, lk))
    got = tff.scaled_dot_product_attention(q, k, v, attn_mask=make(lq, lk), backend=backend)
    live = ~want.isnan().any(-1, keepdim=True)  # torch: NaN where a row sees no key; ours 0
    torch.testing.assert_close(got * live, torch.nan_to_num(want) * live, atol=1e-5, rtol=1e-5)
    assert (got[~live.expand_as(got)] == 0).all()
    grads = torch.autograd.grad((got * live).sum(), (q, k, v))
    want_grads = torch.autograd.grad((torch.nan_to_num(want) * live).sum(), (q, k, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, torch.nan_to_num(b), atol=1e-5, rtol=1e-5)


def test_causal_bias_errors():
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, 2, 4, 16)
    k = torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        tff.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(4, 6), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        tff.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(4, 7))


# --------------------------------------------------------------------------------------------
# From the mutation round 5b (audit 28): masked_softmax's second derivative with dropout, and
# the survivors' killing tests.


@pytest.mark.parametrize("backend", backend_params("reference", "cpu", "triton"))
@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "recorded"])
def test_masked_softmax_second_derivative_with_dropout(backend, create_graph):
    """With dropout the op's pre-dropout probabilities are an output that the recorded first
    derivative reads, so a second derivative reaches them as their gradient: the plain second
    call (create_graph=False) dropped it (exactly 0 where float64 gives ~0.2)."""
    require_backend(backend)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    scores = torch.randn(2, 3, 6, 9, generator=g)
    mask = torch.rand(6, 9, generator=g) < 0.7
    p, scale = 0.3, 0.7
    x = scores.clone().requires_grad_()
    out = tff.masked_softmax(x, mask, scale=scale, is_causal=True, dropout_p=p, backend=backend)
    keep = out.detach() != 0  # the dropout mask, read off the output
    u, w = (torch.randn(out.shape, generator=g) for _ in range(2))
    (first,) = torch.autograd.grad(out, x, u, create_graph=True)
    (second,) = torch.autograd.grad((first * w).sum(), x, create_graph=create_graph)
    x64 = scores.double().requires_grad_()
    ref = reference.masked_softmax(x64, mask, scale, True, p, keep)
    (first64,) = torch.autograd.grad(ref, x64, u.double(), create_graph=True)
    (second64,) = torch.autograd.grad((first64 * w.double()).sum(), x64)
    torch.testing.assert_close(first.detach().double(), first64.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second.detach().double(), second64, rtol=1e-4, atol=1e-5)
    assert second64.abs().max() > 1e-2


def test_oracle_upstream_gradient_is_not_uniform():
    """Under a ones upstream gradient softmax's exact gradient is 0 (rows sum to 1): a kernel
    whose backward returns zeros would pass.  run_oracle's must be random."""
    results = reference.run_oracle(
        lambda x: torch.softmax(x.detach(), dim=-1) + 0.0 * x,  # no gradient through softmax
        lambda x: torch.softmax(x, dim=-1), {"x": torch.randn(4, 9)}, grad_names=("x",), seed=0)
    assert [r.ok for r in results] == [True, False], results


def test_oracle_counts_an_infinity_of_the_wrong_sign():
    ref = torch.tensor([0.0, float("-inf")], dtype=torch.float64)
    assert reference.max_abs_error(torch.tensor([0.0, float("inf")]), ref) == float("inf")
    assert reference.max_abs_error(torch.tensor([0.0, float("-inf")]), ref) == 0.0


@pytest.mark.parametrize("backend", backend_params("cpu", "triton"))
def test_kv_cache_op_fake_kernel_takes_the_value_head_dim(backend):
    require_backend(backend)
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, Lmax, D, Dv = 2, 2, 1, 1, 12, 16, 32
    q = torch.randn(B, H, L, D, generator=g)
    k_cache, v_cache = torch.randn(B, Hkv, Lmax, D, generator=g), torch.randn(B, Hkv, Lmax, Dv, generator=g)
    k_new, v_new = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, Dv, generator=g)
    lengths = torch.tensor([0, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.transformer_fast.attention_with_kv_cache,
                          (q, k_cache, v_cache, lengths, k_new, v_new, 0.25, False, backend))


@pytest.mark.parametrize("backend", backend_params("reference", "cpu", "triton"))
def test_float32_key_padding_mask_keeps_its_precision_with_half_queries(backend):
    """A float32 key_padding_mask near -1e5 on every key (a shift, which softmax ignores) with
    fp16 q / k / v is added in float32, as a float32 attn_mask is: rounded to fp16 it would be
    -inf and every row dead."""
    require_backend(backend)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v = (torch.randn(2, 2, 5, 16, generator=g) for _ in range(3))
    kpm = torch.full((2, 5), -1e5) + torch.randn(2, 5, generator=g)
    want = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                  key_padding_mask=kpm.double())
    got = tff.scaled_dot_product_attention(q.half(), k.half(), v.half(), key_padding_mask=kpm,
                                           backend=backend)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


def test_cached_decoding_with_a_tanh_gelu_activation():
    """A decoder layer whose activation is nn.GELU(approximate="tanh"): the cached step uses
    gelu_tanh, not the exact gelu, so its logits equal the uncached decoder's."""
    from transformer_fast.models import Seq2SeqTransformer
    from transformer_fast.models.decoding import CachedStepper, UncachedStepper, _inference

    torch.manual_seed(0)
    model = Seq2SeqTransformer(19, 19, d_model=32, nhead=2, num_encoder_layers=1,
                               num_decoder_layers=2, dim_feedforward=64, dropout=0.0).eval()
    for layer in model.decoder.layers:
        layer.activation = torch.nn.GELU(approximate="tanh")
        with torch.no_grad():
            layer.linear1.weight.mul_(8.0)  # wide pre-activations: the two gelus differ by ~1e-4
    src = torch.randint(3, 19, (3, 6))
    with _inference(model, src.device):
        memory, padding = model.encode(src)
        cached = CachedStepper(model, memory, padding, 5)
        plain = UncachedStepper(model, memory, padding, 5)
        tokens = torch.full((3,), 1)
        for _ in range(4):
            a, b = cached(tokens), plain(tokens)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            tokens = b.argmax(-1).clamp(min=3)


def test_beam_keeps_k_live_beams_when_two_candidates_end_in_eos(monkeypatch):
    """Step 2's best candidates: "a a" -1.386, "a eos" -1.492, "b eos" -1.533, "b a" -1.554.
    Two of the top k + 1 end in eos, so the two live beams are "a a" and "b a", which only the
    2k candidates reach; "b a eos" (-1.584 / 3) then beats "a eos" (-1.492 / 2)."""
    import math

    from transformer_fast.models import decoding

    pad, bos, eos, a, b, z = range(6)
    table = {
        (): {a: 0.5, b: 0.45, z: 0.04, eos: 0.01},
        (a,): {a: 0.5, eos: 0.45, b: 0.025, z: 0.025},
        (b,): {eos: 0.48, a: 0.47, z: 0.05},
        (a, a): {eos: 0.25, a: 0.25, b: 0.25, z: 0.25},
        (b, a): {eos: 0.97, a: 0.01, b: 0.01, z: 0.01},
    }

    class Stub(torch.nn.Module):
        src_vocab_size = tgt_vocab_size = 6
        pad_id, bos_id, eos_id = pad, bos, eos

        def __init__(self):
            super().__init__()
            self.generator = torch.nn.Linear(1, 6)

        def encode(self, src):
            return torch.zeros(src.shape[0], 1, 4), torch.zeros(src.shape[0], 1, dtype=torch.bool)

    class Scripted:  # log-probabilities by prefix, in place of the model's decoder
        def __init__(self, model, memory, src_padding, max_len, use_cache, cuda_graph=False):
            self.prefix = [[] for _ in range(memory.shape[0])]

        def __call__(self, tokens):
            rows = []
            for i, t in enumerate(tokens.tolist()):
                if t != bos:
                    self.prefix[i].append(t)
                probs = table.get(tuple(self.prefix[i]), {eos: 0.25, a: 0.25, b: 0.25, z: 0.25})
                rows.append([math.log(probs[v]) if probs.get(v, 0) > 0 else -math.inf for v in range(6)])
            return torch.tensor(rows)

        def reorder(self, index):
            self.prefix = [list(self.prefix[i]) for i in index.tolist()]

    monkeypatch.setattr(decoding, "_stepper", Scripted)
    out = decoding.beam_search(Stub(), torch.tensor([[3, 4]]), beam_size=2, max_len=3, length_penalty=1.0)
    assert out.tolist() == [[b, a, eos]]


@pytest.mark.parametrize("backend", backend_params("torch", "cpu", "triton", "cuda"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_finfo_min_rows_are_uniform(backend, dtype):
    """A float32 mask of torch.finfo(float32).min on every key of a row (Hugging Face's masking)
    gives that row the mean of v, as torch's, with finite gradients; the other rows match torch's."""
    device = require_backend(backend)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v = (torch.randn(2, 2, n, 32, generator=g).to(device, dtype).requires_grad_()
               for n in (6, 150, 150))
    mask = torch.randn(6, 150, generator=g)
    mask[0] = torch.finfo(torch.float32).min
    mask[3, :100] = torch.finfo(torch.float32).min
    mask = mask.to(device)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    got = tff.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)
    torch.testing.assert_close(got[:, :, 0].float(), v.float().mean(2), atol=2e-2, rtol=0)
    do = torch.randn(got.shape, generator=g).to(device, dtype)
    do[:, :, 0] = 0  # (the all-masked row's own gradient is not exact in fp32 flash backwards)
    grads = torch.autograd.grad(got, (q, k, v), do)
    want_grads = torch.autograd.grad(want, (q, k, v), do.float())
    for a, b in zip(grads, want_grads):
        assert a.isfinite().all()
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)
