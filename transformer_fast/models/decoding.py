"""Autoregressive decoding for Seq2SeqTransformer: greedy, beam search and sampling.

Every mode runs on a *stepper* that turns the last token of each row into next-token logits:

- ``CachedStepper`` (the default off a GPU, and with ``cuda_graph=False``): each decoder layer
  keeps its self-attention keys/values in a cache (N, H, L_max, D) that grows by one position
  per step through
  ``functional.attention_with_kv_cache``; cross-attention keys/values are projected once from
  the encoder output and attended with ``functional.scaled_dot_product_attention`` under the
  source padding mask (or, when each source's padding is a suffix and the decoding attention
  runs on a fused kernel, with ``attention_with_kv_cache`` over each source's keys: one launch
  a step instead of SDPA's mask handling).  The per-step layer math is done from the layers'
  own parameters (``self_attn.in_proj_weight``, ``out_proj``, ``multihead_attn.*``, ``linear1/2``,
  ``norm1..3``, ``norm_first``, ``activation``) with the fused functional ops, so it works with
  torch.nn's layer classes and with transformer_fast.modules alike.
- ``UncachedStepper``: re-runs the whole decoder on the prefix every step (the baseline that
  cached decoding must reproduce token for token).
- ``GraphStepper`` (the default on a GPU; ``cuda_graph=True`` in every mode): the cached step with
  every per-step input and output in a fixed buffer and no host work between its kernels (the
  position comes from a device counter), recorded once as a CUDA graph and replayed every step
  after the first, so a step costs one launch instead of a few hundred.  Off a GPU the same
  static step runs eagerly (that is how it is tested here).

No mode ever emits pad or bos.  Decoding runs in eval mode (the model's mode is restored
afterwards) without autograd, in the model's parameter dtype (autocast is switched off inside:
cast the model, e.g. ``model.to(torch.bfloat16)``, for half-precision decoding).  The functional
ops pick their backends as everywhere else ("auto", ``with transformer_fast.use_backend(...)``,
``TRANSFORMER_FAST_BACKEND``).
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks, backends
from .. import functional as tf
from ..modules._semantics import backend_for
from . import _validate

__all__ = [
    "CachedStepper",
    "GraphStepper",
    "UncachedStepper",
    "greedy_decode",
    "beam_search",
    "sample",
]


# Models inside _inference, across threads: model -> [calls inside, the modes to restore].
_INFERENCE_LOCK = threading.Lock()
_IN_INFERENCE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _inference(model: nn.Module, device: torch.device):
    # Each module's own flag, not model.train(flag): a frozen encoder in eval inside a model in
    # training (or a dropout left in train for MC dropout) keeps its mode.  Counted per model:
    # decodings overlapping in several threads (or nested in a hook) see eval, and the first
    # one in saves the modes that the last one out restores.
    with _INFERENCE_LOCK:
        entry = _IN_INFERENCE.get(model)
        if entry is None:
            entry = _IN_INFERENCE[model] = [0, [(m, m.training) for m in model.modules()]]
            model.eval()
        entry[0] += 1
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            yield
    finally:
        with _INFERENCE_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _IN_INFERENCE[model]
                for m, training in entry[1]:
                    m.training = training


# --------------------------------------------------------------------------------------------
# Reading a layer's parameters


def _activation_name(activation) -> str | None:
    """The functional.feed_forward name of a layer's activation, or None for anything else."""
    if isinstance(activation, str):
        return activation if activation in ("relu", "gelu") else None
    if activation is F.relu or activation is torch.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu" if activation.approximate == "none" else "gelu_tanh"
    return None


def _projections(mha: nn.Module):
    """(w_q, w_k, w_v, b_q, b_k, b_v) of a MultiheadAttention, packed or separate weights."""
    if getattr(mha, "bias_k", None) is not None or getattr(mha, "add_zero_attn", False):
        raise ValueError("cached decoding does not support add_bias_kv / add_zero_attn attention")
    d = mha.embed_dim
    if getattr(mha, "_qkv_same_embed_dim", True):
        w_q, w_k, w_v = mha.in_proj_weight.split(d, dim=0)
    else:
        w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    b = mha.in_proj_bias
    b_q, b_k, b_v = (None, None, None) if b is None else b.split(d, dim=0)
    return w_q, w_k, w_v, b_q, b_k, b_v


def _self_attention_weights(mha: nn.Module) -> tuple:
    """(in_proj_weight, in_proj_bias) when q, k and v are one packed projection (one GEMM), else
    the six separate weights and biases of _projections (which rejects add_bias_kv/add_zero_attn)."""
    projections = _projections(mha)
    if getattr(mha, "_qkv_same_embed_dim", True):
        return mha.in_proj_weight, mha.in_proj_bias
    return projections


def _heads(x: torch.Tensor, nhead: int) -> torch.Tensor:
    # (N, L, d) -> (N, H, L, d / H)
    n, length, d = x.shape
    return x.view(n, length, nhead, d // nhead).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    # (N, H, L, Dh) -> (N, L, H * Dh)
    n, h, length, dh = x.shape
    return x.transpose(1, 2).reshape(n, length, h * dh)


def _layer_norm(x, norm):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _add_norm(x, residual, norm, backend, prenorm=False):
    """norm(residual + x) (and residual + x with prenorm) in one fused pass."""
    return tf.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, prenorm=prenorm,
                             backend=backend)


def _feed_forward(layer, x, backend):
    name = _activation_name(layer.activation)
    l1, l2 = layer.linear1, layer.linear2
    if name is not None:
        return tf.feed_forward(x, l1.weight, l1.bias, l2.weight, l2.bias, activation=name,
                               backend=backend)
    return l2(layer.activation(l1(x)))  # a custom activation: unfused


# --------------------------------------------------------------------------------------------
# Steppers


class CachedStepper:
    """KV-cached decoder steps for N rows (batch, or batch * beam).

    Args:
        model: a Seq2SeqTransformer (any object with its tgt_embed, positions, decoder,
            generator attributes).
        memory: (N, S, d_model) encoder output.
        src_padding: (N, S) bool, True = padding.
        max_len: the most tokens that will be fed (the caches' length L_max).
    """

    def __init__(self, model, memory: torch.Tensor, src_padding: torch.Tensor, max_len: int):
        self.model = model
        self.length = 0  # tokens fed so far (the same for every row)
        self.max_len = max_len
        self.src_padding = src_padding
        n = memory.shape[0]
        self.seqlens = torch.zeros(n, dtype=torch.int32, device=memory.device)  # (N,)
        self.layers = []
        for layer in model.decoder.layers:
            sa, ca = layer.self_attn, layer.multihead_attn
            heads, dh = sa.num_heads, sa.embed_dim // sa.num_heads
            _, w_k, w_v, _, b_k, b_v = _projections(ca)
            dtype = sa.out_proj.weight.dtype
            self.layers.append({
                "k": torch.zeros(n, heads, max_len, dh, dtype=dtype, device=memory.device),
                "v": torch.zeros(n, heads, max_len, dh, dtype=dtype, device=memory.device),
                # Cross-attention keys/values: projected once, (N, H, S, Dh).
                "mem_k": _heads(F.linear(memory, w_k, b_k), ca.num_heads),
                "mem_v": _heads(F.linear(memory, w_v, b_v), ca.num_heads),
                # Per-step weights looked up once (a step is a few us of Python per op).
                "self_qkv": _self_attention_weights(sa),
                "cross_q": _projections(ca)[0::3],  # (w_q, b_q)
            })
        # The backends chosen for this decoding (use_backend is read once, not every op).
        self.backend = {op: backend_for(op) for op in
                        ("attention_with_kv_cache", "scaled_dot_product_attention", "add_layer_norm",
                         "feed_forward")}
        self.src_lengths = self._cross_attention_lengths(src_padding)

    def _cross_attention_lengths(self, src_padding: torch.Tensor) -> torch.Tensor | None:
        """(N,) int32 source lengths when every row's padding is a suffix and the decoding
        attention runs on a fused kernel (one launch a call), else None: cross-attention then
        goes through SDPA with the key_padding_mask.  One host read per decoding, not per step."""
        n, s = src_padding.shape
        if n == 0 or s == 0 or not self.layers:
            return None
        lengths = (~src_padding).sum(dim=1, dtype=torch.int32)  # (N,)
        mem_k, mem_v = self.layers[0]["mem_k"], self.layers[0]["mem_v"]
        inputs = {"q": mem_k[:, :, :1], "k_cache": mem_k, "v_cache": mem_v, "cache_seqlens": lengths,
                  "k_new": None, "v_new": None}
        name = backends.resolve("attention_with_kv_cache", self.backend["attention_with_kv_cache"], inputs)
        if name in ("torch", "reference"):  # their decoding path is SDPA plus more mask handling
            return None
        suffix = torch.arange(s, device=src_padding.device) >= lengths[:, None]  # (N, S)
        return lengths if torch.equal(suffix, src_padding) else None

    def _self_attention(self, layer, cache, h):
        sa = layer.self_attn
        weights = cache["self_qkv"]
        if len(weights) == 2:  # one GEMM for q, k and v
            q, k, v = F.linear(h, *weights).chunk(3, dim=-1)
        else:
            w_q, w_k, w_v, b_q, b_k, b_v = weights
            q, k, v = F.linear(h, w_q, b_q), F.linear(h, w_k, b_k), F.linear(h, w_v, b_v)
        q, k, v = (_heads(t, sa.num_heads) for t in (q, k, v))  # (N, H, 1, Dh) each
        # The cache lengths are this stepper's own (bounded by max_len before every step): no
        # device-side bounds assert, which is 5 more kernels per attention call on a GPU.  (Only
        # around these calls: a user's hook run by the step, on out_proj say, is checked.)
        with _checks.trusted_values():
            out = tf.attention_with_kv_cache(q, cache["k"], cache["v"], self.seqlens, k, v,
                                            backend=self.backend["attention_with_kv_cache"])
        return sa.out_proj(_merge_heads(out))  # (N, 1, d)

    def _cross_attention(self, layer, cache, h):
        ca = layer.multihead_attn
        q = _heads(F.linear(h, *cache["cross_q"]), ca.num_heads)  # (N, H, 1, Dh)
        if self.src_lengths is not None:
            # The memory as a read-only cache of src_lengths keys per row: one decoding kernel,
            # where SDPA with a key_padding_mask on the torch path is ~7 (mask, dead rows, ...).
            with _checks.trusted_values():
                out = tf.attention_with_kv_cache(q, cache["mem_k"], cache["mem_v"], self.src_lengths,
                                                backend=self.backend["attention_with_kv_cache"])
        else:
            out = tf.scaled_dot_product_attention(
                q, cache["mem_k"], cache["mem_v"], key_padding_mask=self.src_padding,
                backend=self.backend["scaled_dot_product_attention"],
            )
        return ca.out_proj(_merge_heads(out))  # (N, 1, d)

    def _layer(self, layer, cache, x):
        # x: (N, 1, d).  torch.nn.TransformerDecoderLayer's order, dropout off (eval).
        ln, ffn = self.backend["add_layer_norm"], self.backend["feed_forward"]
        if layer.norm_first:
            h = _layer_norm(x, layer.norm1)
            h, x = _add_norm(self._self_attention(layer, cache, h), x, layer.norm2, ln, prenorm=True)
            h, x = _add_norm(self._cross_attention(layer, cache, h), x, layer.norm3, ln, prenorm=True)
            return x + _feed_forward(layer, h, ffn)
        x = _add_norm(self._self_attention(layer, cache, x), x, layer.norm1, ln)
        x = _add_norm(self._cross_attention(layer, cache, x), x, layer.norm2, ln)
        return _add_norm(_feed_forward(layer, x, ffn), x, layer.norm3, ln)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N,) at position ``self.length`` -> next-token logits (N, V)."""
        if self.length >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} steps; all are used")
        model = self.model
        x = model.tgt_embed(tokens[:, None])  # (N, 1, d)
        x = x + model.positions.positions(1, self.length, dtype=x.dtype, device=x.device)
        self.length += 1
        return self._decoder_step(x)

    def _decoder_step(self, x: torch.Tensor) -> torch.Tensor:
        """Embedded tokens (N, 1, d) -> next-token logits (N, V), the caches one step longer."""
        model = self.model
        for layer, cache in zip(model.decoder.layers, self.layers):
            x = self._layer(layer, cache, x)
        if model.decoder.norm is not None:
            x = _layer_norm(x, model.decoder.norm)
        self.seqlens += 1  # the caller of attention_with_kv_cache advances the lengths
        return model.generator(x[:, 0])  # (N, V)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (N,) of the self-attention caches (beam search: each new beam's
        parent).  Cross-attention keys/values stay: a beam never leaves its source row."""
        for cache in self.layers:
            cache["k"] = cache["k"].index_select(0, index)
            cache["v"] = cache["v"].index_select(0, index)


class GraphStepper(CachedStepper):
    """CachedStepper whose step reads only fixed buffers (tokens, a device step counter, the
    caches and their lengths) and writes only fixed buffers, with no host sync, so that on a
    GPU it is captured once as a CUDA graph and replayed.

    The first step runs eagerly: it compiles and autotunes the kernels and creates the
    workspaces that the graph will reuse.  The second step is captured, then replayed (a
    capture records kernels without running them), and so is every later step.  ``reorder``
    (beam search, between steps) copies the chosen cache rows into the same buffers.

    tests/test_decoding.py runs the static step eagerly on the CPU (tokens equal to
    CachedStepper's; no host sync inside a step) and, on a GPU, greedy and beam search through
    the graph against eager cached decoding (passed on an H100, run 5).
    """

    def __init__(self, model, memory: torch.Tensor, src_padding: torch.Tensor, max_len: int):
        super().__init__(model, memory, src_padding, max_len)
        n, device = memory.shape[0], memory.device
        dtype = model.tgt_embed.weight.dtype
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)  # (N,) this step's input
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # this step's position
        self.position_table = model.positions.positions(max_len, 0, dtype=dtype, device=device)  # (L_max, d)
        self.use_graph = device.type == "cuda"
        self.graph = None
        self.logits = None  # (N, V), rewritten by every step

    def _static_step(self) -> torch.Tensor:
        x = self.model.tgt_embed(self.tokens[:, None])  # (N, 1, d)
        x = x + self.position_table.index_select(0, self.position)  # (1, d): the same rows as positions()
        self.position += 1
        return self._decoder_step(x)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.length >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} steps; all are used")
        self.tokens.copy_(tokens)
        if not (self.use_graph and self.length >= 1):
            self.logits = self._static_step()
        else:
            # On the model's GPU whichever is current (capture and replay use its streams).
            with torch.cuda.device(self.tokens.device):
                if self.graph is None:
                    self.graph = self._capture()
                self.graph.replay()
        self.length += 1
        # A copy: the graph's logits buffer is rewritten by the next replay.
        return self.logits.clone() if self.graph is not None else self.logits

    def _capture(self) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self._static_step()
        except Exception as exc:
            raise RuntimeError(
                "capturing the decoding step as a CUDA graph failed (an op in the step cannot be "
                f"captured: {type(exc).__name__}: {exc}); decode with cuda_graph=False to run the "
                "steps eagerly"
            ) from exc
        return graph

    def reorder(self, index: torch.Tensor) -> None:
        """CachedStepper.reorder into the same cache buffers (the graph reads their addresses)."""
        for cache in self.layers:
            cache["k"].copy_(cache["k"].index_select(0, index))
            cache["v"].copy_(cache["v"].index_select(0, index))


class UncachedStepper:
    """Re-runs the decoder over the whole prefix every step (no cache)."""

    def __init__(self, model, memory: torch.Tensor, src_padding: torch.Tensor, max_len: int):
        self.model, self.memory, self.src_padding = model, memory, src_padding
        self.prefix = torch.empty(memory.shape[0], 0, dtype=torch.long, device=memory.device)
        self.length = 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.prefix = torch.cat([self.prefix, tokens[:, None].to(torch.long)], dim=1)  # (N, t+1)
        self.length += 1
        return self.model.decode(self.prefix, self.memory, self.src_padding)[:, -1]  # (N, V)

    def reorder(self, index: torch.Tensor) -> None:
        self.prefix = self.prefix.index_select(0, index)


def _graph_default(cuda_graph, use_cache: bool, device: torch.device) -> bool:
    """cuda_graph=None: replay the cached step as a CUDA graph on a GPU (H100 run 5: the same
    tokens as eager decoding, 7-16x faster at the base model), eager elsewhere."""
    use_cache = _checks.boolean("use_cache", use_cache)
    if cuda_graph is None:
        return use_cache and device.type == "cuda"
    return _checks.boolean("cuda_graph", cuda_graph)


def _stepper(model, memory, src_padding, max_len, use_cache, cuda_graph=False):
    if cuda_graph and not use_cache:
        raise ValueError("cuda_graph=True needs use_cache=True (the graph replays a cached step)")
    cls = GraphStepper if cuda_graph else CachedStepper if use_cache else UncachedStepper
    return cls(model, memory, src_padding, max_len)


# --------------------------------------------------------------------------------------------
# Greedy and sampling


def _specials_mask(model, device: torch.device) -> torch.Tensor:
    """(V,) bool, True at pad and bos: never a next token (they would read as the end of a row /
    a restart).  Made once per decoding on the device: indexing the logits with a Python list
    every step made a host-to-device copy, which torch does with a stream sync, so the host
    waited for each step's kernels before queueing the next step."""
    mask = torch.zeros(model.tgt_vocab_size, dtype=torch.bool, device=device)
    mask[model.pad_id] = True
    mask[model.bos_id] = True
    return mask


def _forbid_specials(logits: torch.Tensor, specials: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(specials, float("-inf"))  # (N, V), a new tensor


SYNC_EVERY = {"cpu": 1}  # steps between "all rows done?" checks, per device type (default 4)


def _generate(model, src, max_len, use_cache, pick, cuda_graph=False):
    """Feed bos, then each row's picked token, until every row has produced eos or max_len
    tokens.  Returns (B, <= max_len): rows that stopped are padded with pad_id after their eos."""
    memory, src_padding = model.encode(src)
    n = src.shape[0]
    step = _stepper(model, memory, src_padding, max_len, use_cache, cuda_graph)
    out = torch.full((n, max_len), model.pad_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(n, dtype=torch.bool, device=src.device)
    tokens = torch.full((n,), model.bos_id, dtype=torch.long, device=src.device)
    # Whether every row is done needs a host sync; on a GPU ask only every few steps so the
    # host keeps queueing work (the extra steps of finished rows only write pad).
    check_every = SYNC_EVERY.get(src.device.type, 4)
    specials = _specials_mask(model, src.device)
    for t in range(max_len):
        logits = step(tokens)  # (N, V)
        nxt = pick(_forbid_specials(logits, specials))
        nxt = nxt.masked_fill(finished, model.pad_id)  # finished rows only pad
        out[:, t] = nxt
        finished |= nxt == model.eos_id
        if (t + 1) % check_every == 0 and bool(finished.all()):
            break
        tokens = nxt
    # Width: the longest row (a row still running never holds pad, finished rows end in it).
    width = int((out != model.pad_id).any(dim=0).sum())
    return out[:, :width]


def _check_decode_args(model, src, max_len):
    _validate.tokens("src", src, model.src_vocab_size, pad_id=model.pad_id,
                     device=model.generator.weight.device)
    return _validate.positive_int("max_len", max_len)


def greedy_decode(model, src: torch.Tensor, max_len: int, use_cache: bool = True, *,
                  cuda_graph: bool | None = None) -> torch.Tensor:
    """Greedy decoding: (B, S) source ids -> (B, <= max_len) target ids.

    Each row starts after bos and stops at its eos (the eos is kept); rows that stopped are
    padded with pad_id; the width is the longest row.  ``use_cache=False`` re-runs the whole
    decoder every step (same tokens, slower).  ``cuda_graph`` (default None: True on a GPU when
    use_cache, else False) replays each cached step as one CUDA graph on a GPU (GraphStepper: on
    an H100, the same tokens as eager cached decoding and 7-16x faster at the base model;
    benchmarks/NOTES.md, fifth GPU run); off a GPU True runs the same static step eagerly.
    ``cuda_graph=False`` runs every step eagerly.
    """
    max_len = _check_decode_args(model, src, max_len)
    cuda_graph = _graph_default(cuda_graph, use_cache, src.device)
    with _inference(model, src.device):
        return _generate(model, src, max_len, use_cache, lambda logits: logits.argmax(dim=-1), cuda_graph)


def sample(model, src: torch.Tensor, max_len: int, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None, use_cache: bool = True, *,
           cuda_graph: bool | None = None) -> torch.Tensor:
    """Ancestral sampling from softmax(logits / temperature), restricted to the top_k most
    likely tokens when top_k is given.  Same output layout as greedy_decode; ``generator``
    (on the model's device) makes it reproducible; ``cuda_graph`` as in greedy_decode."""
    max_len = _check_decode_args(model, src, max_len)
    cuda_graph = _graph_default(cuda_graph, use_cache, src.device)
    temperature = _validate.finite_float("temperature", temperature, positive=True)
    if top_k is not None:
        top_k = min(_validate.positive_int("top_k", top_k), model.tgt_vocab_size)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
        if generator.device.type != src.device.type:
            raise ValueError(f"generator must be on the model's device ({src.device.type}); "
                             f"got a {generator.device.type} generator")

    def pick(logits):
        logits = logits.float()  # (N, V)
        if top_k == 1:  # exactly greedy, ties included
            return logits.argmax(dim=-1)
        if top_k is not None:  # exactly top_k tokens stay, ties with the k-th broken by topk
            values, index = logits.topk(top_k, dim=-1)
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, index, values)
        # Shifted before dividing: a tiny temperature sends the others to -inf, not the max to inf.
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    with _inference(model, src.device):
        return _generate(model, src, max_len, use_cache, pick, cuda_graph)


# --------------------------------------------------------------------------------------------
# Beam search


def beam_search(model, src: torch.Tensor, beam_size: int, max_len: int, length_penalty: float = 1.0,
                use_cache: bool = True, *, cuda_graph: bool | None = None) -> torch.Tensor:
    """Beam search: (B, S) source ids -> (B, <= max_len) target ids, the best hypothesis per row.

    Hypotheses are ranked by ``sum(log p) / length ** length_penalty`` (length counts the
    generated tokens, eos included; 0 ranks by the plain sum, > 0 favours longer outputs).
    Each step expands the ``beam_size`` live beams of every row, keeps the best ``beam_size``
    continuations that do not end in eos, and records the best finished hypothesis (an eos
    among the top ``beam_size`` candidates).  A row stops once it holds ``beam_size`` finished
    hypotheses and the worst of them scores at least as high as its best live beam at the
    current length (Hugging Face's default stop, early_stopping=False: with length_penalty > 0
    a longer continuation that might still overtake is not explored); at max_len the live beams
    compete too.  With beam_size=1 this is greedy decoding.  The self-attention caches are
    reordered to each beam's parent every step (index_select along batch * beam).
    ``cuda_graph`` as in greedy_decode.
    Output layout as greedy_decode (eos kept, pad after it).
    """
    max_len = _check_decode_args(model, src, max_len)
    beam_size = _validate.positive_int("beam_size", beam_size)
    length_penalty = _validate.finite_float("length_penalty", length_penalty)
    cuda_graph = _graph_default(cuda_graph, use_cache, src.device)
    with _inference(model, src.device):
        return _beam_search(model, src, beam_size, max_len, length_penalty, use_cache, cuda_graph)


def _beam_search(model, src, k, max_len, alpha, use_cache, cuda_graph=False):
    device = src.device
    b = src.shape[0]
    n = b * k
    vocab = model.tgt_vocab_size
    memory, src_padding = model.encode(src)  # (B, S, d), (B, S)
    memory = memory.repeat_interleave(k, dim=0)  # (B*K, S, d): row i*K + j is beam j of row i
    src_padding = src_padding.repeat_interleave(k, dim=0)
    step = _stepper(model, memory, src_padding, max_len, use_cache, cuda_graph)

    neg_inf = float("-inf")
    # Ranked in float32, or float64 for a float64 model (as its greedy decoding's argmax).
    sdtype = torch.float64 if memory.dtype == torch.float64 else torch.float32
    scores = torch.full((b, k), neg_inf, dtype=sdtype, device=device)  # (B, K) sum of log p of live beams
    scores[:, 0] = 0.0  # one live beam at the start, so the first expansion has no duplicates
    seqs = torch.empty(n, 0, dtype=torch.long, device=device)  # (B*K, t)
    tokens = torch.full((n,), model.bos_id, dtype=torch.long, device=device)
    best = torch.full((b, max_len), model.pad_id, dtype=torch.long, device=device)
    best_score = torch.full((b,), neg_inf, dtype=sdtype, device=device)  # normalised
    finished = torch.full((b, k), neg_inf, dtype=sdtype, device=device)  # (B, K) best K finished scores, normalised
    best_len = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)
    n_cand = min(2 * k, k * vocab)
    rank = torch.arange(n_cand, device=device)
    specials = _specials_mask(model, device)

    for t in range(max_len):
        length = t + 1  # tokens generated once this step's token is appended
        norm = float(length) ** alpha
        logp = torch.log_softmax(_forbid_specials(step(tokens).to(sdtype), specials), dim=-1)  # (B*K, V)
        cand = (scores.view(n, 1) + logp).view(b, k * vocab)  # (B, K*V)
        top_s, top_i = cand.topk(n_cand, dim=-1)  # (B, 2K), best first
        parent_beam = torch.div(top_i, vocab, rounding_mode="floor")
        tok = top_i % vocab
        is_eos = tok == model.eos_id

        # Finished hypotheses: an eos among the top K candidates of a row still searching.
        finishing = is_eos & (rank < k) & ~done[:, None] & torch.isfinite(top_s)
        fin_score = torch.where(finishing, top_s / norm, torch.full_like(top_s, neg_inf))
        fs, fj = fin_score.max(dim=-1)  # (B,)
        finished = torch.cat([finished, fin_score], dim=1).topk(k, dim=-1).values
        better = fs > best_score
        if bool(better.any()):
            parent = rows * k + parent_beam[rows, fj]  # (B,)
            hyp = torch.cat([seqs[parent], tok[rows, fj][:, None]], dim=1)  # (B, length)
            best[:, :length] = torch.where(better[:, None], hyp, best[:, :length])
            best[better, length:] = model.pad_id
            best_score = torch.where(better, fs, best_score)
            best_len = torch.where(better, torch.full_like(best_len, length), best_len)

        # Live beams: the best K candidates that do not end in eos.
        live_s, live_j = top_s.masked_fill(is_eos, neg_inf).topk(k, dim=-1)  # (B, K)
        parent = (rows[:, None] * k + parent_beam.gather(1, live_j)).view(n)  # (B*K,)
        tokens = tok.gather(1, live_j).view(n)
        seqs = torch.cat([seqs[parent], tokens[:, None]], dim=1)
        scores = live_s
        # Hugging Face's default stop (early_stopping=False): K finished hypotheses, the worst
        # of them (-inf until there are K) against the best live beam at the current length.
        # With length_penalty > 0 a longer continuation could still overtake (its bound would be
        # score / max_len**alpha); judging at the current length keeps beam_size=1 equal to
        # greedy decoding.
        done |= finished[:, -1] >= scores.max(dim=-1).values / norm
        if bool(done.all()) or t == max_len - 1:
            break
        step.reorder(parent)

    # Rows still searching at max_len: their live beams are complete hypotheses too.
    live_best, live_j = (scores / (float(seqs.shape[1]) ** alpha)).max(dim=-1)  # (B,)
    take_live = ~done & (live_best > best_score)
    if bool(take_live.any()):
        width = seqs.shape[1]
        live_seq = seqs.view(b, k, width)[rows, live_j]  # (B, width)
        best[take_live, :width] = live_seq[take_live]
        best_len = torch.where(take_live, torch.full_like(best_len, width), best_len)
    return best[:, : int(best_len.max())]
