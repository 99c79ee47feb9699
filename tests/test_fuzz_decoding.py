"""Property-based fuzzing of KV-cached decoding (transformer_fast.models.decoding): cached
decoding must give the tokens of uncached decoding (the whole prefix re-run every step).

Hypothesis draws a small Seq2SeqTransformer (heads, widths, 1-2 layers a stack, d_ff down to 1,
post- or pre-LN, relu or gelu, shared embeddings), a batch of sources padded at the end, at the
start or anywhere (every row keeps a token: a row made only of padding is refused), a method
(greedy, beam search with 1-5 beams and a length penalty, top-k sampling with a seeded
generator), max_len, the static-step path (``cuda_graph=True``, run eagerly off a GPU) or the
plain cached one, and a backend.  tests/test_decoding.py checks the same property on fixed
cases; this walks the corners (one-token sources, d_ff 1, beams wider than what is left, max_len
1, a vocabulary of 4).

float64 models on `reference` / `torch` for every method.  The fused `cpu` / `triton` kernels
take fp32 only: there the cached and uncached runs round differently, so two tokens whose logits
tie to ~1e-6 may swap; greedy is fuzzed there and a divergence passes only at such a tie (the
float64 logits of the two tokens within 1e-4 of each other at the first differing step).

TF_FUZZ_DECODING_EXAMPLES (default 3) cases for each method x backend; `pytest -m slow
tests/test_fuzz_decoding.py` draws TF_FUZZ_DECODING_SLOW_EXAMPLES (default 60); triton, through
the interpreter, a third of either.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import transformer_fast as tf
from transformer_fast.models import Seq2SeqTransformer

from conftest import backend_params, require_backend

FAST = int(os.environ.get("TF_FUZZ_DECODING_EXAMPLES", "3"))
SLOW = int(os.environ.get("TF_FUZZ_DECODING_SLOW_EXAMPLES", "60"))
PAD, BOS, EOS = 0, 1, 2
FP32_BACKENDS = ("cpu", "triton")  # the fused kernels take no float64
CASES = [("greedy", b) for b in ("reference", "torch", "cpu")] + [
    (method, b) for method in ("beam", "sample") for b in ("reference", "torch")]
# An interpreted Triton example costs ~15 s (every kernel of a step through the interpreter):
# a third of the budget.
TRITON_CASES = [("greedy", "triton")]
TIE = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def _draw_model(data, backend):
    vocab = data.draw(st.integers(4, 12), label="vocab")
    nhead = data.draw(st.sampled_from([1, 2, 4]), label="nhead")
    # the fused kernels take head dims 16..256, multiples of 8
    head_dim = data.draw(st.sampled_from([16, 24] if backend in FP32_BACKENDS else [4, 8, 16]), label="head_dim")
    config = dict(
        d_model=nhead * head_dim, nhead=nhead,
        num_encoder_layers=data.draw(st.integers(1, 2), label="encoder layers"),
        num_decoder_layers=data.draw(st.integers(1, 2), label="decoder layers"),
        dim_feedforward=data.draw(st.integers(1, 24), label="d_ff"),
        norm_first=data.draw(st.booleans(), label="norm_first"),
        activation=data.draw(st.sampled_from(["relu", "gelu"]), label="activation"),
        share_embeddings=data.draw(st.booleans(), label="share_embeddings"),
    )
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="weights seed"))
    model = Seq2SeqTransformer(vocab, vocab, dropout=0.1, **config).double().eval()
    return model, vocab


def _draw_source(data, vocab):
    rows = data.draw(st.integers(1, 4), label="batch")
    width = data.draw(st.integers(1, 7), label="source length")
    layout = data.draw(st.sampled_from(["suffix", "prefix", "anywhere"]), label="padding")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="source seed"))
    src = torch.randint(3, vocab, (rows, width), generator=g)
    for i in range(rows):
        n = data.draw(st.integers(1, width), label=f"row {i} tokens")
        if layout == "suffix":
            src[i, n:] = PAD
        elif layout == "prefix":
            src[i, : width - n] = PAD
        else:
            src[i, torch.randperm(width, generator=g)[: width - n]] = PAD
    return src


def _decode(model, src, method, options, backend, use_cache, cuda_graph):
    with tf.use_backend(backend):
        if method == "greedy":
            return model.greedy_decode(src, options["max_len"], use_cache=use_cache, cuda_graph=cuda_graph)
        if method == "beam":
            return model.beam_search(src, options["beam"], options["max_len"], options["length_penalty"],
                                     use_cache=use_cache, cuda_graph=cuda_graph)
        return model.sample(src, options["max_len"], temperature=0.7, top_k=options["top_k"],
                            generator=torch.Generator().manual_seed(options["sample_seed"]),
                            use_cache=use_cache, cuda_graph=cuda_graph)


def _greedy_tie(model64, src, cached, uncached):
    """Whether greedy's first differing step chose between two tokens whose float64 logits tie
    to TIE (the only divergence fp32 rounding can explain)."""
    def tokens(row):  # without the padding that only widens a row to the batch's longest
        out = row.tolist()
        while out and out[-1] == PAD:
            out.pop()
        return out

    for row in range(src.shape[0]):
        a, b = tokens(cached[row]), tokens(uncached[row])
        if a == b:
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is None:  # one row stopped where the other went on: not a choice between two tokens
            return False
        prefix = torch.tensor([[BOS] + a[:t]])
        with torch.no_grad(), tf.use_backend("reference"):
            logits = model64(src[row:row + 1], prefix)[0, -1]  # (V,)
        if abs(float(logits[a[t]] - logits[b[t]])) > TIE:
            return False
    return True


def _fuzz(method, backend, data):
    require_backend(backend)
    model64, vocab = _draw_model(data, backend)
    src = _draw_source(data, vocab)
    options = dict(
        max_len=data.draw(st.integers(1, 8), label="max_len"),
        beam=data.draw(st.integers(1, 5), label="beam"),
        length_penalty=data.draw(st.sampled_from([0.0, 0.6, 1.0]), label="length_penalty"),
        top_k=data.draw(st.one_of(st.none(), st.integers(1, vocab)), label="top_k"),
        sample_seed=data.draw(st.integers(0, 2**31 - 1), label="sample seed"),
    )
    cuda_graph = data.draw(st.booleans(), label="cuda_graph (the static step)")
    model = copy.deepcopy(model64).float() if backend in FP32_BACKENDS else model64
    cached = _decode(model, src, method, options, backend, True, cuda_graph)
    uncached = _decode(model, src, method, options, backend, False, False)
    assert cached.dim() == 2 and cached.shape[0] == src.shape[0] and 1 <= cached.shape[1] <= options["max_len"]
    if torch.equal(cached, uncached):
        return
    if backend in FP32_BACKENDS and _greedy_tie(model64, src, cached, uncached):
        return
    raise AssertionError(f"cached decoding differs from uncached:\n  cached   {cached.tolist()}\n"
                         f"  uncached {uncached.tolist()}\n  source   {src.tolist()}")


def _make(budget, cases):
    # No shrinking: the drawn labels name the whole case in the failure report, and
    # TF_TEST_SEED replays it.
    common = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=(Phase.explicit, Phase.reuse, Phase.generate))

    @pytest.mark.parametrize("method, backend", [
        pytest.param(m, b, marks=backend_params(b)[0].marks, id=f"{m}-{b}") for m, b in cases])
    @settings(max_examples=budget, **common)
    @given(data=st.data())
    def test(method, backend, data):
        _fuzz(method, backend, data)

    return test


test_fuzz_decoding = _make(FAST, CASES)
test_fuzz_decoding_triton = _make(max(1, FAST // 3), TRITON_CASES)
test_fuzz_decoding_slow = pytest.mark.slow(_make(SLOW, CASES))
test_fuzz_decoding_triton_slow = pytest.mark.slow(_make(max(1, SLOW // 3), TRITON_CASES))
