"""End to end: one encoder layer, one decoder layer, the whole model's inference forward, a
training step and greedy decoding of the paper's encoder-decoder (base: 6+6 layers, d_model 512, 8 heads, FFN 2048; smaller on a CPU,
named in every row's shape["config"]).

Providers:
    torch.nn          torch.nn.Transformer* in eager mode (its own fast paths included)
    torch.nn+compile  the same under torch.compile
    reference         the naive model below: transformer_fast.reference ops (materialised
                      scores, separate add and LayerNorm, Linear-ReLU-Linear) on the same weights
    ours:<backend>    transformer_fast.modules / transformer_fast.models.Seq2SeqTransformer with
                      transformer_fast.use_backend(<backend>); ours:auto is what a user gets
                      without choosing (each op on the backend `auto` picks for it)
    ours:<backend>+cuda_graph   greedy decoding on a GPU with cuda_graph=True (the default
                      there; the rows without the suffix pass cuda_graph=False): every step after
                      the first replayed as one CUDA graph (the capture is part of the timed call);
                      the training step (ours:auto+cuda_graph, torch.nn+cuda_graph): the whole
                      step (forward, backward, Adam with capturable=True) captured once by
                      transformer_fast.models.CudaGraphStep and replayed (GPU only)
    ours:auto+logits  the training step computing torch's loss on ours' (B, T, V) logits, as
                      torch.nn's and the reference's rows do (the modules alone, dropped in); the
                      rows without the suffix use Seq2SeqTransformer.loss, which fuses the
                      pre-softmax projection into the same label-smoothed cross entropy
                      (transformer_fast/models/fused_loss.py: no (B, T, V) logits in memory)
    ours:auto+swap    the training step and inference of torch.nn's model above (its embeddings,
                      torch.nn.Transformer, its loss) after ``transformer_fast.swap(model)``: the
                      drop-in use, our layers inside a model that was written for torch.nn
Ours are imported lazily: a missing module gives a row that says "not available yet".

Tokens per second (shape["tokens_per_s"]): layers, tokens through the layer; inference, target
tokens per forward (eval, no grad: torch.nn.Transformer on its inference fast paths, issue 5's
target); train_step, target tokens per optimizer step; greedy_decode, generated tokens (every row decodes max_len tokens:
no early stop at eos, so every provider does the same work).  torch.nn's and the reference's
greedy decoding re-run the decoder on the whole prefix every step (no KV cache); ours uses its
KV cache (use_cache=True).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from transformer_fast import backends, reference

from . import common

MODEL_OPS = ("encoder_layer", "decoder_layer", "inference", "train_step", "greedy_decode")
GRAPH_SUFFIX = "+cuda_graph"  # ours' greedy decoding with cuda_graph=True (GPU only)
LOGITS_SUFFIX = "+logits"  # ours' training step with torch's loss on the (B, T, V) logits
SWAP_SUFFIX = "+swap"  # torch.nn's own model after transformer_fast.swap()
SUFFIXES = (GRAPH_SUFFIX, LOGITS_SUFFIX, SWAP_SUFFIX)
PAD, BOS, EOS = 0, 1, 2


def _base_provider(provider: str) -> str:
    """The backend of an ours:<backend>[+suffix] provider (ours:auto+cuda_graph -> auto)."""
    base = provider.split(":", 1)[-1]
    for suffix in SUFFIXES:
        base = base.removesuffix(suffix)
    return base


@dataclasses.dataclass
class Config:
    name: str
    d_model: int
    nhead: int
    layers: int  # encoder layers = decoder layers
    d_ff: int
    vocab: int
    batch: int
    src_len: int
    tgt_len: int
    decode_batch: int
    decode_src_len: int
    max_len: int

    def describe(self) -> str:
        return f"{self.name}: {self.layers}+{self.layers} layers, d_model {self.d_model}, {self.nhead} heads, FFN {self.d_ff}, vocab {self.vocab}"


def config(device: torch.device, mode: str) -> Config:
    if mode == "smoke":
        return Config("tiny", 32, 2, 1, 64, 50, 2, 8, 8, 2, 8, 4)
    if device.type == "cuda":
        if mode == "quick":
            return Config("base", 512, 8, 6, 2048, 32000, 64, 128, 128, 64, 64, 128)
        # Decoding: issue 8's target, 128 generated tokens at batch 1 and 64.
        return Config("base", 512, 8, 6, 2048, 32000, 128, 128, 128, 64, 64, 128)
    if mode == "quick":
        return Config("small (CPU)", 128, 4, 2, 512, 1000, 4, 32, 32, 4, 16, 16)
    return Config("small (CPU)", 256, 4, 3, 1024, 8000, 8, 64, 64, 8, 32, 32)


def ours_providers(device: torch.device) -> list[str]:
    names = ["auto", "torch", "triton", "cuda"] if device.type == "cuda" else ["auto", "torch", "cpu", "triton"]
    return [f"ours:{n}" for n in names]


def _backend_reason(provider: str, device: torch.device) -> str | None:
    name = provider.split(":", 1)[1]
    if name == "auto":
        return None
    if name == "triton" and device.type == "cpu":
        return ("on a CPU Triton runs only through its interpreter (TRITON_INTERPRET=1), which "
                "checks kernels but is not a benchmark")
    ok, why = backends.available(name, device.type)
    return None if ok else why


# --------------------------------------------------------------------------------------------
# The naive model: reference ops on the parameters of torch.nn modules


def naive_mha(mha: nn.MultiheadAttention, q_in, kv_in, *, is_causal=False, key_padding_mask=None):
    """nn.MultiheadAttention (batch first, packed in_proj) with reference.scaled_dot_product_attention."""
    d, h = mha.embed_dim, mha.num_heads
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = q_in @ w[:d].t() + b[:d]  # (B, Lq, d)
    k = kv_in @ w[d:2 * d].t() + b[d:2 * d]
    v = kv_in @ w[2 * d:].t() + b[2 * d:]

    def heads(x):  # (B, L, d) -> (B, h, L, d / h)
        return x.reshape(x.shape[0], x.shape[1], h, d // h).transpose(1, 2)

    p = mha.dropout if mha.training else 0.0
    o = reference.scaled_dot_product_attention(heads(q), heads(k), heads(v), dropout_p=p,
                                               is_causal=is_causal, key_padding_mask=key_padding_mask)
    o = o.transpose(1, 2).reshape(q.shape)  # (B, Lq, d)
    return o @ mha.out_proj.weight.t() + mha.out_proj.bias


def _drop(layer, module):
    return module.p if layer.training else 0.0


def naive_ffn(layer, x):
    return reference.feed_forward(x, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
                                  layer.linear2.bias, "relu", _drop(layer, layer.dropout))


def naive_add_norm(sub, residual, norm, p):
    return reference.add_layer_norm(sub, residual, norm.weight, norm.bias, norm.eps, p)


def naive_encoder_layer(layer: nn.TransformerEncoderLayer, x, src_key_padding_mask=None):
    """Post-LN encoder layer (the paper's), on ``layer``'s parameters."""
    x = naive_add_norm(naive_mha(layer.self_attn, x, x, key_padding_mask=src_key_padding_mask),
                       x, layer.norm1, _drop(layer, layer.dropout1))
    return naive_add_norm(naive_ffn(layer, x), x, layer.norm2, _drop(layer, layer.dropout2))


def naive_decoder_layer(layer: nn.TransformerDecoderLayer, y, memory, tgt_key_padding_mask=None,
                        memory_key_padding_mask=None):
    y = naive_add_norm(naive_mha(layer.self_attn, y, y, is_causal=True, key_padding_mask=tgt_key_padding_mask),
                       y, layer.norm1, _drop(layer, layer.dropout1))
    y = naive_add_norm(naive_mha(layer.multihead_attn, y, memory, key_padding_mask=memory_key_padding_mask),
                       y, layer.norm2, _drop(layer, layer.dropout2))
    return naive_add_norm(naive_ffn(layer, y), y, layer.norm3, _drop(layer, layer.dropout3))


class NaiveEncoderLayer(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, src, src_key_padding_mask=None):
        return naive_encoder_layer(self.layer, src, src_key_padding_mask)


class NaiveDecoderLayer(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, tgt, memory, tgt_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
                tgt_is_causal=True):
        return naive_decoder_layer(self.layer, tgt, memory, tgt_key_padding_mask, memory_key_padding_mask)


def _positions(length, d_model, device, dtype):
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    inv = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model, device=device)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe.to(dtype)


class TorchSeq2Seq(nn.Module):
    """Scaled embeddings + sinusoidal positions + torch.nn.Transformer + output projection.
    With ``naive=True`` the same parameters run through the reference ops instead."""

    def __init__(self, cfg: Config, dropout=0.1, naive=False):
        super().__init__()
        self.cfg, self.naive = cfg, naive
        self.src_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.core = nn.Transformer(cfg.d_model, cfg.nhead, cfg.layers, cfg.layers, cfg.d_ff, dropout,
                                   batch_first=True)
        self.generator = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.drop = nn.Dropout(dropout)

    def _embed(self, table, tokens):
        x = table(tokens) * math.sqrt(self.cfg.d_model)
        return self.drop(x + _positions(tokens.shape[1], self.cfg.d_model, x.device, x.dtype))

    def encode(self, src):
        pad = src == PAD
        x = self._embed(self.src_embed, src)
        enc = self.core.encoder
        if self.naive:
            for layer in enc.layers:
                x = naive_encoder_layer(layer, x, pad)
            return reference.add_layer_norm(x, torch.zeros_like(x), enc.norm.weight, enc.norm.bias, enc.norm.eps), pad
        return enc(x, src_key_padding_mask=pad), pad

    def decode(self, tgt, memory, src_pad):
        y = self._embed(self.tgt_embed, tgt)
        tgt_pad = tgt == PAD
        dec = self.core.decoder
        if self.naive:
            for layer in dec.layers:
                y = naive_decoder_layer(layer, y, memory, tgt_pad, src_pad)
            y = reference.add_layer_norm(y, torch.zeros_like(y), dec.norm.weight, dec.norm.bias, dec.norm.eps)
        else:
            causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).triu_(1)
            y = dec(y, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_pad,
                    memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.generator(y)

    def forward(self, src, tgt_in):
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)


@torch.no_grad()
def prefix_greedy_decode(model, src, max_len):
    """Greedy decoding without a cache: the decoder re-runs on the whole prefix every step."""
    memory, pad = model.encode(src)
    ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
    for _ in range(max_len):
        nxt = model.decode(ys, memory, pad)[:, -1].argmax(-1)
        ys = torch.cat([ys, nxt.unsqueeze(1)], dim=1)
    return ys[:, 1:]


# --------------------------------------------------------------------------------------------
# Inputs


def _tokens(g, batch, length, vocab, device):
    """(B, L) ids in [3, vocab) padded at the end to realistic lengths (common.padding)."""
    from .ops import padding_lengths

    ids = torch.randint(3, vocab, (batch, length), generator=g)
    lengths = padding_lengths(g, batch, length)
    ids[torch.arange(length) >= lengths.unsqueeze(1)] = PAD
    return ids.to(device)


def _pad_mask(g, batch, length, device):
    from .ops import _padding

    return _padding(g, batch, length, device)


# --------------------------------------------------------------------------------------------
# Rows


class Runner:
    def __init__(self, device, dtype, mode, peaks, skip, providers=None, on_row=None):
        self.device, self.dtype, self.mode, self.peaks, self.skip = device, dtype, mode, peaks, skip
        self.cfg = config(device, mode)
        self.rows: list[dict] = []
        self.providers = providers  # None = all; else a filter on names (backend names match ours:<name>)
        # Called with each row as it is made: the caller writes its results files then, so that a
        # run killed at its time limit keeps the rows measured so far (a GPU run lost a whole op).
        self.on_row = on_row

    def wanted(self, provider):
        if self.providers is None:
            return True
        base = _base_provider(provider) if provider.startswith("ours:") else provider
        return provider in self.providers or base in self.providers or (
            provider.startswith("torch.nn") and "torch" in self.providers)

    def compile_reason(self, op):
        """Why torch.compile is not measured for ``op`` in this mode (None: it is).  Compiling
        costs ~20 s to minutes per graph, so --quick keeps it to the training step on a GPU."""
        if self.mode == "smoke":
            return "torch.compile is not run in the smoke test"
        if self.mode == "quick" and self.device.type == "cpu":
            return "torch.compile skipped in --quick on a CPU (compiling takes minutes here); run the full sweep"
        if self.mode == "quick" and op != "train_step":
            return f"torch.compile of {op} runs in the full sweep only (compile time)"
        return None

    def row(self, op, provider, mask, shape, timing=None, tokens=None, error=None, mem=None, note=None):
        shape = dict(shape, config=self.cfg.describe())
        if timing is not None and tokens:
            shape["tokens_per_s"] = float(f"{tokens / (timing[0] * 1e-3):.4g}")
        if timing is not None and timing[3] not in ("do_bench", "torch.utils.benchmark"):
            shape["timer"] = timing[3]
        if note:
            shape["note"] = note
        self.rows.append(common.make_row(op, provider, self.dtype, mask, shape, timing, peaks=self.peaks,
                                         error=error, peak_mem=mem))
        if self.on_row is not None:
            self.on_row(self.rows[-1])

    def measure(self, op, provider, mask, shape, fn, tokens, error_fn=None):
        """Time ``fn`` and add the row; a failure becomes a row with the error as its note."""
        if not self.wanted(provider):
            return
        start = time.perf_counter()
        try:
            error = error_fn() if error_fn else None
            timing = common.bench(fn, self.device, self.mode)
            mem = common.peak_memory_mb(fn, self.device)
            self.row(op, provider, mask, shape, timing, tokens, error, mem)
            common.log(f"{op} {provider} {common._shape_text(shape)}: {self.rows[-1]['shape'].get('tokens_per_s')} "
                       f"tokens/s, {timing[0]:.3g} ms per call ({time.perf_counter() - start:.0f} s to measure)")
        except Exception as exc:
            msg = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            common.log(f"FAILED {op} {provider}: {msg}")
            self.row(op, provider, mask, shape, note=f"failed: {msg}")
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def unavailable(self, op, provider, mask, shape, why):
        if not self.wanted(provider):
            return
        self.skip(provider, op, [why])
        self.row(op, provider, mask, shape, note=why)

    # ---- single layers

    def layer(self, op):
        cfg, dev, dt = self.cfg, self.device, self.dtype
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        decoder = op == "decoder_layer"
        cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
        base = cls(cfg.d_model, cfg.nhead, cfg.d_ff, 0.1, batch_first=True).to(dev, dt)
        b, s = cfg.batch, cfg.src_len
        x = torch.randn(b, s, cfg.d_model, generator=g).to(dev, dt)
        pad = _pad_mask(g, b, s, dev)
        mem_x = torch.randn(b, s, cfg.d_model, generator=g).to(dev, dt)
        mem_pad = _pad_mask(g, b, s, dev)
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).triu_(1)
        mask = "causal+key_padding" if decoder else "key_padding"
        valid = ~pad  # compare only real (unpadded) positions

        def call(module, inp):
            if decoder:
                return module(inp, mem_x, tgt_mask=causal, tgt_key_padding_mask=pad,
                              memory_key_padding_mask=mem_pad, tgt_is_causal=True)
            return module(inp, src_key_padding_mask=pad)

        truth = copy.deepcopy(base).double().eval()
        with torch.no_grad():
            if decoder:
                ref64 = truth(x.double(), mem_x.double(), tgt_mask=causal, tgt_key_padding_mask=pad,
                              memory_key_padding_mask=mem_pad, tgt_is_causal=True)
            else:
                ref64 = truth(x.double(), src_key_padding_mask=pad)
        del truth

        modules = {"torch.nn": base, "reference": (NaiveDecoderLayer if decoder else NaiveEncoderLayer)(base)}
        compile_why = self.compile_reason(op)
        ours_cls, ours_why = None, None
        try:
            from transformer_fast import modules as tfm

            ours_cls = getattr(tfm, cls.__name__)
        except (ImportError, AttributeError) as exc:
            ours_why = f"not available yet (transformer_fast.modules.{cls.__name__}: {exc})"

        for pas in ("fwd", "fwd+bwd"):
            shape = {"pass": pas, "B": b, "L": s, "d_model": cfg.d_model}
            if pas == "fwd":
                shape["note"] = "eval, no grad"
            else:
                shape["note"] = "train mode, dropout 0.1 (no max_err: random dropout)"
            variants = list(modules.items())
            if compile_why:
                self.unavailable(op, "torch.nn+compile", mask, shape, compile_why)
            else:
                variants.append(("torch.nn+compile", torch.compile(base)))
            for provider in ours_providers(dev):
                why = ours_why or _backend_reason(provider, dev)
                if why:
                    self.unavailable(op, provider, mask, shape, why)
                    continue
                mod = ours_cls(cfg.d_model, cfg.nhead, cfg.d_ff, 0.1, batch_first=True).to(dev, dt)
                mod.load_state_dict(base.state_dict())
                variants.append((provider, mod))
            for provider, module in variants:
                backend = provider.split(":", 1)[1] if provider.startswith("ours:") else None
                self._layer_row(op, provider, mask, shape, module, call, x, pas, backend, ref64, valid)

    def _layer_row(self, op, provider, mask, shape, module, call, x, pas, backend, ref64, valid):
        import transformer_fast

        def ctx():
            return transformer_fast.use_backend(backend) if backend else _null()

        tokens = x.shape[0] * x.shape[1]
        if pas == "fwd":
            module.eval()

            def fn():
                with torch.no_grad(), ctx():
                    return call(module, x)

            def error():
                out = fn()
                return common.max_err([out[valid]], [ref64[valid]])

            self.measure(op, provider, mask, shape, fn, tokens, error)
        else:
            module.train()
            leaf = x.detach().clone().requires_grad_(True)
            upstream = torch.randn_like(x)
            params = [p for p in module.parameters() if p.requires_grad]

            def fn():
                with ctx():
                    out = call(module, leaf)
                    return torch.autograd.grad(out, [leaf] + params, upstream)

            self.measure(op, provider, mask, shape, fn, tokens)

    # ---- the whole model

    def _ours_model(self):
        """(Seq2SeqTransformer class or None, reason)."""
        try:
            from transformer_fast.models import Seq2SeqTransformer

            return Seq2SeqTransformer, None
        except ImportError as exc:
            return None, f"not available yet (transformer_fast.models.Seq2SeqTransformer: {exc})"

    def _build_ours(self, cls, dropout):
        cfg = self.cfg
        model = cls(cfg.vocab, cfg.vocab, cfg.d_model, cfg.nhead, cfg.layers, cfg.layers, cfg.d_ff,
                    dropout, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        return model.to(self.device, self.dtype)

    def train_step(self):
        cfg, dev = self.cfg, self.device
        g = torch.Generator().manual_seed(1)
        b, s, t = cfg.batch, cfg.src_len, cfg.tgt_len
        src = _tokens(g, b, s, cfg.vocab, dev)
        tgt = _tokens(g, b, t + 1, cfg.vocab, dev)
        tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
        tgt_in[:, 0] = BOS
        shape = {"pass": "fwd+bwd+adam", "B": b, "S": s, "T": t,
                 "note": "label-smoothed CE (ours: fused with the projection, except +logits), Adam; target tokens/s"}
        mask = "key_padding"

        def step_fn(model, logits=False, cuda_graph=False):
            # (capturable: the optimizer's step count and update stay on the device, as a CUDA
            # graph needs; the eager rows keep Adam's default)
            opt = torch.optim.Adam(model.parameters(), lr=1e-5, betas=(0.9, 0.98), eps=1e-6,
                                   capturable=cuda_graph)
            fused = hasattr(model, "loss") and not logits  # ours: Seq2SeqTransformer.loss

            def step():
                # (Named ranges for benchmarks/profile_model.py; a few microseconds a step.)
                with record_function("train_step.forward"):
                    if fused:  # the same loss without the (B, T, V) logits
                        loss = model.loss(src, tgt_in, tgt_out, smoothing=0.1)
                    else:
                        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, cfg.vocab).float(),
                                               tgt_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1)
                with record_function("train_step.backward"):
                    loss.backward()
                with record_function("train_step.optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                return loss.detach()

            if cuda_graph:  # the whole step captured once, then replayed (models/training.py)
                from transformer_fast.models import CudaGraphStep

                return CudaGraphStep(step, optimizer=opt)
            return step

        self._model_rows("train_step", mask, shape, b * t, step_fn, train=True)

    def inference(self):
        """The whole model's forward in eval without grad (teacher-forced logits, as when
        scoring): the training step's shapes, source key padding, causal target."""
        cfg, dev = self.cfg, self.device
        g = torch.Generator().manual_seed(3)
        b, s, t = cfg.batch, cfg.src_len, cfg.tgt_len
        src = _tokens(g, b, s, cfg.vocab, dev)
        tgt_in = _tokens(g, b, t, cfg.vocab, dev)
        tgt_in[:, 0] = BOS
        shape = {"pass": "fwd", "B": b, "S": s, "T": t, "note": "eval, no grad; target tokens/s"}

        def step_fn(model):
            def step():
                with torch.no_grad():
                    return model(src, tgt_in)

            return step

        self._model_rows("inference", "key_padding", shape, b * t, step_fn, train=False)

    def greedy_decode(self):
        cfg, dev = self.cfg, self.device
        g = torch.Generator().manual_seed(2)
        s, n = cfg.decode_src_len, cfg.max_len
        # On a GPU, issue 8's two target shapes: batch 1 (launch-bound) and the configured batch.
        batches = sorted({1, cfg.decode_batch}) if dev.type == "cuda" else [cfg.decode_batch]
        for b in batches:
            src = _tokens(g, b, s, cfg.vocab, dev)
            shape = {"pass": "decode", "B": b, "S": s, "max_len": n}

            def step_fn(model, cuda_graph=False, src=src):
                if isinstance(model, TorchSeq2Seq) or getattr(model, "_orig_mod", None) is not None:
                    return lambda: prefix_greedy_decode(model, src, n)
                from transformer_fast.models import greedy_decode

                return lambda: greedy_decode(model, src, n, use_cache=True, cuda_graph=cuda_graph)

            self._model_rows("greedy_decode", "key_padding", shape, b * n, step_fn, train=False)

    def _model_rows(self, op, mask, shape, tokens, step_fn, train):
        torch.manual_seed(0)
        dropout = 0.1 if train else 0.0
        torch_model = TorchSeq2Seq(self.cfg, dropout).to(self.device, self.dtype).train(train)
        naive = TorchSeq2Seq(self.cfg, dropout, naive=True).to(self.device, self.dtype).train(train)
        naive.load_state_dict(torch_model.state_dict())
        variants = [("torch.nn", torch_model), ("reference", naive)]

        def torch_copy():  # torch.nn's model again, same weights (rows that change the module)
            copy_ = TorchSeq2Seq(self.cfg, dropout).to(self.device, self.dtype).train(train)
            copy_.load_state_dict(torch_model.state_dict())
            return copy_

        why = self.compile_reason(op)
        if why:
            self.unavailable(op, "torch.nn+compile", mask, shape, why)
        else:
            compiled = torch_copy()
            if op == "greedy_decode":
                compiled.decode = torch.compile(compiled.decode, dynamic=True)
                compiled.encode = torch.compile(compiled.encode, dynamic=True)
                variants.append(("torch.nn+compile", compiled))
            else:
                variants.append(("torch.nn+compile", torch.compile(compiled)))
        if op == "train_step" and self.device.type == "cuda" and self.wanted("torch.nn" + GRAPH_SUFFIX):
            # What a CUDA graph of the whole step gives torch.nn's own model (beside ours').
            variants.append(("torch.nn" + GRAPH_SUFFIX, torch_copy()))
        cls, ours_why = self._ours_model()
        for provider in ours_providers(self.device):
            why = ours_why or _backend_reason(provider, self.device)
            if why:
                self.unavailable(op, provider, mask, shape, why)
                continue
            try:
                model = self._build_ours(cls, dropout).train(train)
            except Exception as exc:
                self.unavailable(op, provider, mask, shape, f"failed to build: {type(exc).__name__}: {exc}")
                continue
            if op == "greedy_decode":
                model.eos_id = -1  # decode all max_len tokens: no early stop (same work as the others)
            variants.append((provider, model))
            if op == "greedy_decode" and self.device.type == "cuda":
                variants.append((provider + GRAPH_SUFFIX, model))  # each step replayed as a CUDA graph
            if (op == "train_step" and provider == "ours:auto" and self.device.type == "cuda"
                    and self.wanted(provider + GRAPH_SUFFIX)):
                # A model of its own: the graph keeps its parameters' and gradients' addresses
                # for good, shared with none of the eager rows.
                graphed = self._build_ours(cls, dropout).train(train)
                graphed.load_state_dict(model.state_dict())
                variants.append((provider + GRAPH_SUFFIX, graphed))  # the whole step as one CUDA graph
            if op == "train_step" and provider == "ours:auto":
                variants.append((provider + LOGITS_SUFFIX, model))  # torch's loss on ours' logits
            if op in ("train_step", "inference") and provider == "ours:auto" and self.wanted(provider + SWAP_SUFFIX):
                import transformer_fast

                swapped = torch_copy()
                transformer_fast.swap(swapped)
                variants.append((provider + SWAP_SUFFIX, swapped))
        for provider, model in variants:
            if not self.wanted(provider):
                continue
            backend = _base_provider(provider) if provider.startswith("ours:") else None
            if provider.endswith(GRAPH_SUFFIX):
                step = step_fn(model, cuda_graph=True)
            elif provider.endswith(LOGITS_SUFFIX):
                step = step_fn(model, logits=True)
            else:
                step = step_fn(model)

            def fn(step=step, backend=backend):
                if backend is None:
                    return step()
                import transformer_fast

                with transformer_fast.use_backend(backend):
                    return step()

            self.measure(op, provider, mask, shape, fn, tokens)
            del model, step
        del variants


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run(op: str, device, dtype, mode, peaks, skip, providers=None, on_row=None) -> list[dict]:
    runner = Runner(device, dtype, mode, peaks, skip, providers, on_row)
    if op in ("encoder_layer", "decoder_layer"):
        runner.layer(op)
    elif op == "inference":
        runner.inference()
    elif op == "train_step":
        runner.train_step()
    elif op == "greedy_decode":
        runner.greedy_decode()
    else:
        raise ValueError(f"unknown end-to-end op {op!r}")
    return runner.rows
