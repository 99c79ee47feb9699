"""Per-op sweeps: every provider is one backend of transformer_fast.functional (backend=<name>).

A Case is one (op, shape, dtype, mask kind, pass) point: how to draw its inputs, how to call
the op, its FLOPs or the bytes that must move once, and (for ops whose float64 reference would
not fit in memory) a float64 reference computed in row chunks.  ``run_case`` measures every
provider on it and returns results.json rows (benchmarks/common.py).

Mask kinds (DESIGN section 8):
    none         no mask
    causal       is_causal=True (top-left)
    key_padding  per-row valid lengths drawn uniformly from [0.3 L, L], the longest row = L
                 (a batch padded to its longest sequence); SDPA gets key_padding_mask (B, L),
                 masked_softmax a (B, 1, 1, L) bool mask, decoding ragged cache_seqlens
    bool         a materialised (B, 1, L, L) bool attn_mask = causal & key padding, what a
                 decoder's self-attention receives once its masks are merged
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from transformer_fast import backends, reference
from transformer_fast import functional as TF

from . import common

OPS = ("scaled_dot_product_attention", "attention_with_kv_cache", "masked_softmax",
       "add_layer_norm", "feed_forward", "ffn_gemm")
PROVIDERS = ("reference", "torch", "torch.compile", "triton", "triton.dq_kernel", "triton.pointer", "cuda",
             "cuda.mma_sync", "cpu")
# The cuda backend with its sm_90a wgmma kernels switched off (TRANSFORMER_FAST_CUDA_WGMMA=0: the
# mma.sync kernels, what the cuda backend runs before Hopper): scaled_dot_product_attention on a
# compute capability 9.x GPU only, where "cuda" runs the wgmma kernels for unmasked calls.
WGMMA_ENV = "TRANSFORMER_FAST_CUDA_WGMMA"
X_KEYS = {"scaled_dot_product_attention": "L", "attention_with_kv_cache": "L",
          "masked_softmax": "L", "add_layer_norm": "N", "feed_forward": "M", "ffn_gemm": "M"}
ATTENTION_MASKS = ("none", "causal", "key_padding", "bool")


@dataclasses.dataclass
class Case:
    op: str
    shape: dict  # includes "pass": "fwd" or "fwd+bwd"
    dtype: torch.dtype
    mask: str
    make: Callable[[Draw], dict]  # one fresh random input set, on the device
    call: Callable[[dict, str], object]  # (inputs, backend) -> output tensor
    grad_names: tuple = ()  # inputs differentiated in the fwd+bwd pass
    flops: float | None = None
    bytes_moved: float | None = None
    naive_bytes: float = 0.0  # memory the naive reference materialises (skip it when too big)
    cudagraph: bool = False  # tiny steps: time with CUDA graphs on a GPU
    ref64: Callable | None = None  # (inputs, upstream) -> (outs, grads) in float64; None: whole
    bytes_for: Callable | None = None  # inputs -> bytes moved, where they depend on the draw
    compile_peer: bool = False  # also time torch.compile of the torch backend ("torch.compile")

    @property
    def backward(self) -> bool:
        return self.shape["pass"] == "fwd+bwd"


# --------------------------------------------------------------------------------------------
# Input helpers (fresh random draws, never zeros)


class Draw:
    """The random source of one case: ``cpu`` for small host-side draws (lengths), ``dev`` for
    the input tensors, drawn on their device (no host copy of GB-sized inputs)."""

    def __init__(self, seed: int, device: torch.device):
        self.cpu = torch.Generator().manual_seed(seed)
        self.dev = self.cpu if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)


def _randn(g: Draw, *shape, dtype, device, scale=1.0):
    on_cpu = torch.device(device).type == "cpu"
    x = torch.randn(*shape, generator=g.cpu if on_cpu else g.dev, device=device)
    return (x * scale).to(dtype)


def padding_lengths(g, batch: int, length: int) -> torch.Tensor:
    """(B,) int64 valid lengths, uniform in [0.3 L, L], the first row full (the batch's longest).
    ``g``: a Draw or a CPU torch.Generator."""
    frac = 0.3 + 0.7 * torch.rand(batch, generator=getattr(g, "cpu", g))
    lengths = (frac * length).long().clamp(1, length)
    lengths[0] = length
    return lengths


def _padding(g, batch, length, device):
    """(B, L) bool, True = padding (nn.MultiheadAttention polarity)."""
    lengths = padding_lengths(g, batch, length)
    return (torch.arange(length) >= lengths.unsqueeze(1)).to(device)


def _causal(lq, lk, device, offset=0):
    """(lq, lk) bool, True where query (i + offset) may see key j (top-left)."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + offset
    return torch.arange(lk, device=device) <= rows


def _free_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 8e9


def _chunk_rows(rows_total: int, bytes_per_row: float, device: torch.device) -> int:
    budget = 2e9 if device.type == "cuda" else 5e8
    return max(1, min(rows_total, int(budget // max(bytes_per_row, 1.0))))


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention


def _sdpa_ref64(causal):
    """Float64 reference in query chunks (an L x L float64 score matrix may not fit): outputs
    and, with an upstream gradient, grads of query/key/value (key/value summed over chunks)."""

    def ref64(inputs, upstream):
        q = inputs["query"].detach().double()
        k = inputs["key"].detach().double().requires_grad_(upstream is not None)
        v = inputs["value"].detach().double().requires_grad_(upstream is not None)
        attn_mask, kpm = inputs.get("attn_mask"), inputs.get("key_padding_mask")
        b, h, lq, _ = q.shape
        lk = k.shape[-2]
        step = _chunk_rows(lq, b * h * lk * 8 * 6, q.device)
        outs, dqs = [], []
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for s in range(0, lq, step):
            e = min(lq, s + step)
            qc = q[:, :, s:e].clone().requires_grad_(upstream is not None)
            mask = None if attn_mask is None else attn_mask[..., s:e, :]
            if causal:
                allowed = _causal(e - s, lk, q.device, offset=s)
                mask = allowed if mask is None else mask & allowed
            with torch.set_grad_enabled(upstream is not None):
                out = reference.scaled_dot_product_attention(qc, k, v, mask, key_padding_mask=kpm)
            if upstream is not None:
                gq, gk, gv = torch.autograd.grad(out, (qc, k, v), upstream[:, :, s:e].double())
                dqs.append(gq)
                dk += gk
                dv += gv
            outs.append(out.detach())
        out = torch.cat(outs, dim=2)
        if upstream is None:
            return [out], []
        return [out], [torch.cat(dqs, dim=2), dk, dv]

    return ref64


def sdpa_cases(device, dtype, mode):
    if device.type == "cuda":
        # B*L = 16k tokens, H*D = 2048 (the flash-attention benchmark convention; NOTES targets).
        dims = (128,) if mode != "full" else (64, 128)
        lengths = (1024, 4096) if mode == "quick" else (512, 1024, 2048, 4096, 8192, 16384)
        shapes = [(max(1, 16384 // L), 2048 // d, L, d) for d in dims for L in lengths]
    elif mode == "smoke":
        shapes = [(2, 2, 16, 16)]
    elif mode == "quick":
        shapes = [(2, 4, L, 64) for L in (128, 512)]
    else:
        shapes = [(max(2, 2048 // L), 8, L, 64) for L in (128, 256, 512, 1024, 2048)]
    for b, h, L, d in shapes:
        for mask in ATTENTION_MASKS:
            for pas in ("fwd", "fwd+bwd"):
                yield _sdpa_case(device, dtype, b, h, L, d, mask, pas)
    # Dropout 0.1 on the probabilities (training in the paper's setting), no mask, at the
    # longest length: the row that measures the kernels' Philox cost (benchmarks/NOTES.md); on
    # the CPU at the shortest too, where the cpu backend's materialising path and torch's math
    # path meet at a training step's lengths.
    dropout_shapes = shapes[-1:] if device.type == "cuda" or len(shapes) == 1 else [shapes[0], shapes[-1]]
    for b, h, L, d in dropout_shapes:
        for pas in ("fwd", "fwd+bwd"):
            yield _sdpa_case(device, dtype, b, h, L, d, "none", pas, dropout_p=0.1)


def _sdpa_case(device, dtype, b, h, L, d, mask, pas, dropout_p=0.0):
    causal = mask == "causal"

    def make(g):
        inputs = {n: _randn(g, b, h, L, d, dtype=dtype, device=device) for n in ("query", "key", "value")}
        if mask == "key_padding":
            inputs["key_padding_mask"] = _padding(g, b, L, device)
        if mask == "bool":
            pad = _padding(g, b, L, device)
            inputs["attn_mask"] = _causal(L, L, device).unsqueeze(0).unsqueeze(0) & ~pad[:, None, None, :]
        return inputs

    def call(inp, backend):
        return TF.scaled_dot_product_attention(
            inp["query"], inp["key"], inp["value"], attn_mask=inp.get("attn_mask"), dropout_p=dropout_p,
            is_causal=causal, key_padding_mask=inp.get("key_padding_mask"), backend=backend)

    def no_ref64(inputs, upstream):
        raise ValueError("dropout > 0: each provider draws its own mask; tests/test_triton_attention.py "
                         "checks ours exactly")

    flops = 4.0 * b * h * L * L * d * (0.5 if mask in ("causal", "bool") else 1.0)
    if pas == "fwd+bwd":
        flops *= 2.5
    elt = torch.finfo(dtype).bits // 8
    return Case(
        op="scaled_dot_product_attention",
        shape={"pass": pas, "B": b, "H": h, "L": L, "D": d, **({"p": dropout_p} if dropout_p else {})},
        dtype=dtype, mask=mask, make=make, call=call,
        grad_names=("query", "key", "value") if pas == "fwd+bwd" else (), flops=flops,
        naive_bytes=b * h * L * L * max(elt, 4) * (8 if pas == "fwd+bwd" else 3),
        ref64=no_ref64 if dropout_p else _sdpa_ref64(causal))


# --------------------------------------------------------------------------------------------
# attention_with_kv_cache (one decoding step: L_new = 1, inference only)


def kv_cache_cases(device, dtype, mode):
    if device.type == "cuda":
        lengths = (2048, 16384) if mode == "quick" else (512, 2048, 8192, 32768)
        heads = ((32, 8),) if mode == "quick" else ((32, 32), (32, 8))
        shapes = [(8, h, hkv, L, 128) for h, hkv in heads for L in lengths]
    elif mode == "smoke":
        shapes = [(2, 2, 2, 32, 16)]
    elif mode == "quick":
        shapes = [(4, 8, 8, L, 64) for L in (512, 2048)]
    else:
        shapes = [(4, 8, hkv, L, 64) for hkv in (8, 2) for L in (256, 1024, 4096)]
    for b, h, hkv, L, d in shapes:
        for mask in ("none", "key_padding"):
            yield _kv_case(device, dtype, b, h, hkv, L, d, mask)


def _kv_case(device, dtype, b, h, hkv, L, d, mask):
    def make(g):
        if mask == "key_padding":
            seqlens = padding_lengths(g, b, L) - 1  # keys already cached; the new one makes L
        else:
            seqlens = torch.full((b,), L - 1)
        return {
            "q": _randn(g, b, h, 1, d, dtype=dtype, device=device),
            "k_cache": _randn(g, b, hkv, L, d, dtype=dtype, device=device),
            "v_cache": _randn(g, b, hkv, L, d, dtype=dtype, device=device),
            "cache_seqlens": seqlens.to(device=device, dtype=torch.int32),
            "k_new": _randn(g, b, hkv, 1, d, dtype=dtype, device=device),
            "v_new": _randn(g, b, hkv, 1, d, dtype=dtype, device=device),
        }

    def call(inp, backend):
        return TF.attention_with_kv_cache(
            inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"], inp["k_new"],
            inp["v_new"], backend=backend)

    elt = torch.finfo(dtype).bits // 8
    # Expected valid keys per row: L for "none"; the mean of U(0.3, 1) L = 0.65 L for ragged
    # rows (the exact count is taken from the drawn lengths in bytes_for below).
    case = Case(
        op="attention_with_kv_cache", shape={"pass": "fwd", "B": b, "H": h, "Hkv": hkv, "L": L, "D": d},
        dtype=dtype, mask=mask, make=make, call=call, cudagraph=True,
        naive_bytes=b * h * L * 4 * 4 + 2 * b * h * L * d * elt)
    case.bytes_for = lambda inp: float(
        # read the valid K and V, read q and k_new/v_new, write them into the caches, write out
        (int(inp["cache_seqlens"].sum()) + b) * hkv * d * 2 * elt
        + 2 * b * h * d * elt + 2 * 2 * b * hkv * d * elt)
    return case


# --------------------------------------------------------------------------------------------
# masked_softmax


def _softmax_ref64(causal):
    def ref64(inputs, upstream):
        scores = inputs["scores"].detach().double()
        mask = inputs.get("mask")
        lq, lk = scores.shape[-2:]
        step = _chunk_rows(lq, scores[..., 0, :].numel() * 8 * 6, scores.device)
        outs, grads = [], []
        for s in range(0, lq, step):
            e = min(lq, s + step)
            sc = scores[..., s:e, :].clone().requires_grad_(upstream is not None)
            m = None if mask is None else (mask if mask.shape[-2] == 1 else mask[..., s:e, :])
            if causal:
                allowed = _causal(e - s, lk, scores.device, offset=s)
                m = allowed if m is None else m & allowed
            with torch.set_grad_enabled(upstream is not None):
                p = reference.masked_softmax(sc, m)
            if upstream is not None:
                grads.append(torch.autograd.grad(p, sc, upstream[..., s:e, :].double())[0])
            outs.append(p.detach())
        return [torch.cat(outs, dim=-2)], ([torch.cat(grads, dim=-2)] if grads else [])

    return ref64


def masked_softmax_cases(device, dtype, mode):
    if device.type == "cuda":
        # 8k query rows per head: B*L = 8192, 16 heads (at L = 8192 the scores are 2 GB bf16)
        lengths = (1024, 4096) if mode == "quick" else (512, 1024, 2048, 4096, 8192)
        shapes = [(max(1, 8192 // L), 16, L) for L in lengths]
    elif mode == "smoke":
        shapes = [(2, 2, 16)]
    elif mode == "quick":
        shapes = [(2, 4, L) for L in (256, 512)]
    else:
        shapes = [(2, 8, L) for L in (128, 256, 512, 1024, 2048)]
    for b, h, L in shapes:
        for mask in ATTENTION_MASKS:
            for pas in ("fwd", "fwd+bwd"):
                yield _softmax_case(device, dtype, b, h, L, mask, pas)


def _softmax_case(device, dtype, b, h, L, mask, pas):
    causal = mask == "causal"

    def make(g):
        inputs = {"scores": _randn(g, b, h, L, L, dtype=dtype, device=device, scale=3.0)}
        if mask == "key_padding":
            inputs["mask"] = ~_padding(g, b, L, device)[:, None, None, :]
        if mask == "bool":
            pad = _padding(g, b, L, device)
            inputs["mask"] = _causal(L, L, device)[None, None] & ~pad[:, None, None, :]
        return inputs

    def call(inp, backend):
        return TF.masked_softmax(inp["scores"], inp.get("mask"), scale=0.125, is_causal=causal,
                                 backend=backend)

    elt = torch.finfo(dtype).bits // 8
    n = b * h * L * L
    mask_bytes = {"none": 0, "causal": 0, "key_padding": b * L, "bool": b * L * L}[mask]
    case = Case(
        op="masked_softmax", shape={"pass": pas, "B": b, "H": h, "L": L}, dtype=dtype, mask=mask,
        make=make, call=call, grad_names=("scores",) if pas == "fwd+bwd" else (),
        # fwd: read scores, write probs; bwd: read probs and their gradient, write the scores'
        bytes_moved=n * elt * (5 if pas == "fwd+bwd" else 2) + mask_bytes,
        naive_bytes=n * max(elt, 4) * (8 if pas == "fwd+bwd" else 4), ref64=_softmax_ref64(causal))
    # The reference's scale is applied to the scores; ref64 must see the same op.
    inner = case.ref64
    case.ref64 = lambda inputs, upstream: _scaled_ref(inner, inputs, upstream, 0.125)
    return case


def _scaled_ref(inner, inputs, upstream, scale):
    scores = inputs["scores"].detach().double().requires_grad_(upstream is not None)
    with torch.set_grad_enabled(upstream is not None):
        scaled = scores * scale
    outs, grads = inner({**inputs, "scores": scaled.detach()}, upstream)
    return outs, [g * scale for g in grads]


# --------------------------------------------------------------------------------------------
# add_layer_norm


def add_layer_norm_cases(device, dtype, mode):
    if device.type == "cuda":
        widths = (1024, 4096) if mode == "quick" else (512, 1024, 2048, 4096, 8192)
        shapes = [(16384, n) for n in widths]
    elif mode == "smoke":
        shapes = [(64, 32)]
    elif mode == "quick":
        shapes = [(4096, n) for n in (512, 1024)]
    else:
        shapes = [(4096, n) for n in (256, 512, 1024, 2048, 4096)]
    for m, n in shapes:
        for pas in ("fwd", "fwd+bwd"):
            yield _layer_norm_case(device, dtype, m, n, pas)


def _layer_norm_case(device, dtype, m, n, pas):
    def make(g):
        return {
            "x": _randn(g, m, n, dtype=dtype, device=device),
            "residual": _randn(g, m, n, dtype=dtype, device=device),
            "weight": (1.0 + _randn(g, n, dtype=torch.float32, device="cpu", scale=0.2)).to(device, dtype),
            "bias": _randn(g, n, dtype=dtype, device=device, scale=0.2),
        }

    def call(inp, backend):
        return TF.add_layer_norm(inp["x"], inp["residual"], inp["weight"], inp["bias"], backend=backend)

    elt = torch.finfo(dtype).bits // 8
    return Case(
        op="add_layer_norm", shape={"pass": pas, "M": m, "N": n}, dtype=dtype, mask="none",
        make=make, call=call,
        grad_names=("x", "residual", "weight", "bias") if pas == "fwd+bwd" else (),
        # fwd reads x, residual, writes y (3); bwd reads dy, x, residual, writes dx = dresidual (4)
        bytes_moved=m * n * elt * (7 if pas == "fwd+bwd" else 3),
        naive_bytes=m * n * max(elt, 4) * 6)


# --------------------------------------------------------------------------------------------
# feed_forward


# Issue 6's target configuration: Linear-GELU-Dropout(0.1)-Linear at M 16384, d_model 1024,
# d_ff 4096 on the GPU (bf16), and the same layer on the CPU (fp32) at the paper's widths; the
# plain relu rows (dropout 0) are the GEMM-bound baseline and carry the error column.
FFN_TARGET = ("gelu", 0.1)


def feed_forward_cases(device, dtype, mode):
    if device.type == "cuda":
        plain = [(m, 512, 2048) for m in ((4096, 16384) if mode == "quick" else (2048, 8192, 32768))]
        plain += [] if mode == "quick" else [(m, 1024, 4096) for m in (2048, 8192, 32768)]
        target = [(16384, 1024, 4096)]
    elif mode == "smoke":
        plain, target = [(16, 32, 64)], [(16, 32, 64)]
    else:
        plain = [(m, 512, 2048) for m in ((256, 1024) if mode == "quick" else (256, 1024, 4096))]
        target = [(1024, 512, 2048)]
    configs = [(shape, "relu", 0.0) for shape in plain] + [(shape, *FFN_TARGET) for shape in target]
    for (m, dm, dff), activation, dropout_p in configs:
        for pas in ("fwd", "fwd+bwd"):
            # torch.compile's first call compiles for tens of seconds: not in the smoke run.
            yield _ffn_case(device, dtype, m, dm, dff, pas, activation, dropout_p,
                            compile_peer=(activation, dropout_p) == FFN_TARGET and mode != "smoke")


def _ffn_case(device, dtype, m, dm, dff, pas, activation, dropout_p, compile_peer=False):
    def make(g):
        return {
            "x": _randn(g, m, dm, dtype=dtype, device=device),
            "w1": _randn(g, dff, dm, dtype=dtype, device=device, scale=dm ** -0.5),
            "b1": _randn(g, dff, dtype=dtype, device=device, scale=0.1),
            "w2": _randn(g, dm, dff, dtype=dtype, device=device, scale=dff ** -0.5),
            "b2": _randn(g, dm, dtype=dtype, device=device, scale=0.1),
        }

    def call(inp, backend):
        return TF.feed_forward(inp["x"], inp["w1"], inp["b1"], inp["w2"], inp["b2"],
                               activation=activation, dropout_p=dropout_p, backend=backend)

    def no_ref64(inputs, upstream):
        # Each provider draws its own dropout mask (torch's RNG or our Philox stream), so one
        # float64 run cannot be everyone's truth; tests/test_ffn.py checks the masked numerics
        # exactly, and the dropout-0 rows here carry the error column.
        raise ValueError("dropout > 0: each provider draws its own mask; tests/test_ffn.py checks ours exactly")

    flops = 4.0 * m * dm * dff * (3 if pas == "fwd+bwd" else 1)
    return Case(
        op="feed_forward",
        shape={"pass": pas, "M": m, "d_model": dm, "d_ff": dff, "act": activation, "p": dropout_p},
        dtype=dtype, mask="none", make=make, call=call,
        grad_names=("x", "w1", "b1", "w2", "b2") if pas == "fwd+bwd" else (), flops=flops,
        naive_bytes=m * dff * max(torch.finfo(dtype).bits // 8, 4) * 4,
        ref64=no_ref64 if dropout_p > 0.0 else None, compile_peer=compile_peer)


# --------------------------------------------------------------------------------------------
# ffn_gemm: the FFN's six GEMMs one by one (issue 6: each >= 90% of cuBLAS for the same shape)


# (name, kind, rows, cols, reduction) for the FFN (M, d_model, d_ff); the operands are laid out as
# the FFN's forward and backward hold them: x, hidden, dout, dpre row-major (M, .), W1 (d_ff,
# d_model) and W2 (d_model, d_ff) as nn.Linear stores them.
def _ffn_gemms(m, dm, dff):
    return (("x@W1^T", "fwd", m, dff, dm), ("hidden@W2^T", "fwd", m, dm, dff),
            ("dout@W2", "dgrad", m, dff, dm), ("dout^T@hidden", "wgrad", dm, dff, m),
            ("dpre@W1", "dgrad", m, dm, dff), ("dpre^T@x", "wgrad", dff, dm, m))


def ffn_gemm_cases(device, dtype, mode):
    if device.type == "cuda":
        shapes = [(16384, 1024, 4096)] + ([] if mode == "quick" else [(16384, 512, 2048)])
    else:
        shapes = [(16, 32, 64)] if mode == "smoke" else [(1024, 512, 2048)]
    for m, dm, dff in shapes:
        for name, kind, rows, cols, red in _ffn_gemms(m, dm, dff):
            yield _ffn_gemm_case(device, dtype, name, kind, rows, cols, red)


def _ffn_gemm_case(device, dtype, name, kind, rows, cols, red):
    """C (rows, cols) = A @ B over ``red``: fwd x (rows, red) @ W^T with W (cols, red); dgrad
    dy (rows, red) @ W (red, cols); wgrad dy^T @ x with dy (red, rows), x (red, cols)."""
    shapes = {"fwd": ((rows, red), (cols, red)), "dgrad": ((rows, red), (red, cols)),
              "wgrad": ((red, rows), (red, cols))}[kind]

    def make(g):
        a, b = (_randn(g, *shape, dtype=dtype, device=device) for shape in shapes)
        return {"a": a, "b": b}

    def call(inp, backend):
        a, b = inp["a"], inp["b"]
        if backend in ("torch", "reference"):  # cuBLAS (CPU: MKL / oneDNN) on the same views
            return {"fwd": lambda: a @ b.t(), "dgrad": lambda: a @ b, "wgrad": lambda: a.t() @ b}[kind]()
        from transformer_fast.ops.ffn import _launcher

        launch = _launcher(backend)  # the backend's FFN primitive with no epilogue work
        if kind == "fwd":
            return launch.linear_fwd(a, b, None, "none", 0.0, None, False, False)[0]
        if kind == "dgrad":
            return launch.linear_dgrad(a, b, None, "none", 0.0, None, False, False)[0]
        return launch.linear_wgrad(a, b, False, False)[0]

    return Case(op="ffn_gemm", shape={"pass": "fwd", "gemm": name, "M": rows, "N": cols, "K": red},
                dtype=dtype, mask="none", make=make, call=call, flops=2.0 * rows * cols * red,
                naive_bytes=0.0)


CASES = {
    "scaled_dot_product_attention": sdpa_cases,
    "attention_with_kv_cache": kv_cache_cases,
    "masked_softmax": masked_softmax_cases,
    "add_layer_norm": add_layer_norm_cases,
    "feed_forward": feed_forward_cases,
    "ffn_gemm": ffn_gemm_cases,
}


def cases(op: str, device: torch.device, dtypes, mode: str) -> list[Case]:
    return [c for dtype in dtypes for c in CASES[op](device, dtype, mode)]


# --------------------------------------------------------------------------------------------
# Running one case


def provider_reasons(provider: str, case: Case, inputs: dict, device: torch.device) -> list[str]:
    """Why ``provider`` cannot run ``case`` here (empty: it can)."""
    if provider == "torch.compile":
        if not case.compile_peer:
            return ["timed only on the cases whose targets name it (feed_forward's GELU + dropout "
                    "layer); end to end: torch.nn+compile"]
        return backends.not_supported_reasons("torch", case.op, inputs)
    if provider == "cuda.mma_sync":
        if case.op != "scaled_dot_product_attention":
            return ["the wgmma kernels exist for scaled_dot_product_attention only"]
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
            return ["only on a compute capability 9.x (Hopper) GPU is it other than the cuda row"]
        return backends.not_supported_reasons("cuda", case.op, inputs)
    if provider == "triton.dq_kernel":
        if case.op != "scaled_dot_product_attention" or not case.backward:
            return ["the dq kernel's schedule differs from triton's only in scaled_dot_product_attention's backward"]
        provider = "triton"
    if provider == "triton.pointer":
        if case.op not in ("feed_forward", "ffn_gemm"):
            return ["the TMA GEMM (the row's alternative) serves feed_forward and ffn_gemm only"]
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
            return ["only on a compute capability >= 9 GPU does triton run the TMA GEMM instead"]
        provider = "triton"
    if case.op == "ffn_gemm":
        if provider == "reference":
            return ["one GEMM: the reference's matmul is torch's (the torch row)"]
        if provider == "torch":
            return []
        if provider == "torch.compile":
            return ["one GEMM: nothing for torch.compile to fuse"]
        if provider == "triton" and device.type == "cpu":
            return ["on a CPU Triton runs only through its interpreter, which is not a benchmark"]
        return backends.not_supported_reasons(provider, "linear_bias_act", {
            "x": inputs["a"], "w": inputs["b"], "b": None, "activation": None, "dropout_p": 0.0})
    if provider == "triton" and device.type == "cpu":
        return ["on a CPU Triton runs only through its interpreter (TRITON_INTERPRET=1), which "
                "checks kernels but is not a benchmark"]
    reasons = backends.not_supported_reasons(provider, case.op, inputs)
    if not reasons and provider == "reference" and case.naive_bytes > 0.6 * _free_bytes(device):
        reasons = [f"the naive reference would materialise ~{case.naive_bytes / 1e9:.0f} GB at "
                   f"{common._shape_text(case.shape)} (free: {_free_bytes(device) / 1e9:.0f} GB)"]
    return reasons


def _leaves(inputs: dict, names) -> list[torch.Tensor]:
    return [inputs[n] for n in names]


_COMPILED: dict = {}


@contextlib.contextmanager
def _environment(name: str, value: str):
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def _variant_switch(provider: str):
    """The switches of the variant providers, held across forward and backward (read at every
    call): cuda.mma_sync sets TRANSFORMER_FAST_CUDA_WGMMA=0 (the C++ side's mma.sync kernels on a
    Hopper); triton.dq_kernel has the Triton backward compute dq in its own kernel (the schedule
    torch.use_deterministic_algorithms gets) instead of by atomics in the dk/dv kernel;
    triton.pointer sets TRANSFORMER_FAST_TRITON_GEMM=pointer (the FFN's GEMMs through the
    pointer kernel where a Hopper runs the persistent TMA one)."""
    if provider == "triton.dq_kernel":
        from transformer_fast.kernels import attention as triton_attention

        previous = triton_attention.FORCE_ATOMIC_DQ
        triton_attention.FORCE_ATOMIC_DQ = False
        try:
            yield
        finally:
            triton_attention.FORCE_ATOMIC_DQ = previous
    elif provider == "triton.pointer":
        from transformer_fast.kernels import ffn as triton_ffn

        with _environment(triton_ffn.GEMM_PATH_ENV, "pointer"):
            yield
    elif provider == "cuda.mma_sync":
        with _environment(WGMMA_ENV, "0"):
            yield
    else:
        yield


_VARIANT_OF = {"cuda.mma_sync": "cuda", "triton.dq_kernel": "triton", "triton.pointer": "triton"}
_GEMM_OPS = ("feed_forward", "linear_bias_act", "ffn_gemm")


def _gemm_kernel_note(case: Case, provider: str, device) -> str | None:
    """Which Triton GEMM kernel an FFN row timed: under "auto" a TMA failure falls back to the
    pointer kernel for the process (with a warning only), and the row must not pass for the
    TMA kernel's."""
    if device.type != "cuda" or not provider.startswith("triton") or case.op not in _GEMM_OPS:
        return None
    from transformer_fast.kernels import ffn as triton_ffn

    kernels, failure = triton_ffn.recent_gemm_kernels()
    note = "gemm: " + "+".join(sorted(kernels))
    return note + (f" (the TMA kernel failed: {failure[:160]})" if failure else "")


def _call(case: Case, inputs: dict, provider: str):
    if provider in _VARIANT_OF:
        with _variant_switch(provider):
            return case.call(inputs, _VARIANT_OF[provider])
    if provider != "torch.compile":
        return case.call(inputs, provider)
    # torch.compile of the torch backend: the peer issue 6's "under torch.compile" target names.
    # One compiled function per case (its shape and flags are constants of the graph).
    key = id(case)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(lambda inp: case.call(inp, "torch"), fullgraph=True)
    return _COMPILED[key](inputs)


def _forward_backward(case: Case, inputs: dict, provider: str, upstream):
    with _variant_switch(provider):  # (run 3 timed its forward's switch without the backward)
        out = _call(case, inputs, provider)
        if not case.backward:
            return [out], []
        grads = torch.autograd.grad(out, _leaves(inputs, case.grad_names), upstream)
    return [out], list(grads)


# Providers whose first call compiles (Triton's autotuner compiles every config it times;
# inductor): warm_case runs them once so that their compilations are cached on disk.
COMPILING_PROVIDERS = ("triton", "triton.dq_kernel", "triton.pointer", "torch.compile")


def warm_case(op: str, mode: str, dtype: str, index: int, providers, device_type: str) -> str:
    """Call the compiling providers of case ``index`` of ``cases(op, device, [dtype], mode)`` once
    (forward and backward), results discarded: run in parallel processes before the timed run
    (``--compile-jobs``), this leaves every kernel the timed run needs in Triton's and
    inductor's on-disk caches, so that its first calls (autotuning included) compile nothing.
    Returns a line for the log."""
    device = torch.device(device_type)
    case = cases(op, device, [common.DTYPES[dtype]], mode)[index]
    g = Draw(int(torch.randint(0, 2**31 - 1, ())), device)
    inputs = case.make(g)
    for name in case.grad_names:
        inputs[name].requires_grad_(True)
    done = []
    for provider in providers:
        if provider not in COMPILING_PROVIDERS or provider_reasons(provider, case, inputs, device):
            continue
        try:
            with torch.set_grad_enabled(case.backward):
                out = _call(case, inputs, provider)
                if case.backward:
                    torch.autograd.grad(out, _leaves(inputs, case.grad_names), torch.ones_like(out))
            done.append(provider)
        except Exception as exc:  # noqa: BLE001  (the timed run reports it in its row)
            done.append(f"{provider} failed ({type(exc).__name__})")
    return f"{op} {common._shape_text(case.shape)} {case.mask} {case.shape['pass']}: {', '.join(done) or '-'}"


def _default_ref64(case: Case, inputs: dict, upstream):
    cast = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().double().requires_grad_(k in case.grad_names)
        elif isinstance(v, torch.Tensor):
            v = v.clone()  # the kv cache writes into its inputs: keep the originals apart
        cast[k] = v
    with torch.set_grad_enabled(case.backward):
        out = case.call(cast, "reference")
    if not case.backward:
        return [out.detach()], []
    grads = torch.autograd.grad(out, _leaves(cast, case.grad_names), upstream.double())
    return [out.detach()], list(grads)


def run_case(case: Case, providers, device: torch.device, mode: str, peaks: dict, skip) -> list[dict]:
    """Rows of every provider that can run ``case``; ``skip(provider, op, reasons)`` records
    the others."""
    try:
        return _run_case(case, providers, device, mode, peaks, skip)
    except Exception as exc:  # drawing the inputs failed (out of memory, say): one row says so
        msg = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        common.log(f"FAILED {case.op} {common._shape_text(case.shape)} {case.mask}: {msg}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [common.make_row(case.op, "(inputs)", case.dtype, case.mask,
                                dict(case.shape, note=f"failed: {msg}"))]


def _run_case(case: Case, providers, device: torch.device, mode: str, peaks: dict, skip) -> list[dict]:
    g = Draw(int(torch.randint(0, 2**31 - 1, ())), device)  # fresh inputs every run
    first = case.make(g)
    set_bytes = sum(t.numel() * t.element_size() for t in first.values() if isinstance(t, torch.Tensor))
    count = common.rotation_count(set_bytes, device)
    count = max(1, min(count, int(0.2 * _free_bytes(device) // max(set_bytes, 1))))
    sets = [first] + [case.make(g) for _ in range(count - 1)]
    for inputs in sets:
        for name in case.grad_names:
            inputs[name].requires_grad_(True)

    runnable = []
    for provider in providers:
        reasons = provider_reasons(provider, case, first, device)
        if reasons:
            skip(provider, case.op, reasons)
        else:
            runnable.append(provider)
    if not runnable:
        return []

    upstreams = [None] * len(sets)
    if case.backward:
        with torch.no_grad():
            probe = case.call({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in first.items()},
                              "torch" if "torch" in runnable else runnable[0].replace("torch.compile", "torch"))
        upstreams = [_randn(g, *probe.shape, dtype=probe.dtype, device=device) for _ in sets]
        del probe

    # The float64 truth for the first input set (chunked for the attention-sized ops).
    refs, ref_note = None, None
    try:
        if case.ref64 is not None:
            ref_outs, ref_grads = case.ref64(first, upstreams[0])
        else:
            ref_outs, ref_grads = _default_ref64(case, first, upstreams[0])
        refs = [t.detach() for t in ref_outs + ref_grads]
        del ref_outs, ref_grads
    except Exception as exc:  # e.g. out of memory: time the providers anyway, without max_err
        ref_note = f"no float64 reference ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})"
        common.log(f"{case.op} {common._shape_text(case.shape)}: {ref_note}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bytes_moved = case.bytes_moved
    if bytes_moved is None and case.bytes_for is not None:
        bytes_moved = case.bytes_for(first)

    rows = []
    for provider in runnable:
        try:
            with torch.set_grad_enabled(case.backward):
                outs, grads = _forward_backward(case, first, provider, upstreams[0])
            error = None if refs is None else common.max_err([t.detach() for t in outs + grads], refs)
            del outs, grads
            order = common.Rotator(list(zip(sets, upstreams)))

            def step():
                inputs, upstream = next(order)
                with torch.set_grad_enabled(case.backward):
                    return _forward_backward(case, inputs, provider, upstream)

            tuners = common.triton_autotuners() if provider.startswith("triton") and device.type == "cuda" else {}
            for tuner in tuners.values():
                tuner.best_config = None
            timing = common.bench(step, device, mode, cudagraph=case.cudagraph and provider != "reference")
            tuned = common.tuned_configs(tuners)
            mem = common.peak_memory_mb(lambda: _forward_backward(case, first, provider, upstreams[0]), device)
            shape = dict(case.shape)
            if timing[3] not in ("do_bench", "torch.utils.benchmark"):
                shape["timer"] = timing[3]
            notes = [n for n in (ref_note, _gemm_kernel_note(case, provider, device)) if n]
            if notes:
                shape["note"] = "; ".join(notes)
            if tuned:
                shape["tuned"] = tuned
            rows.append(common.make_row(
                case.op, provider, case.dtype, case.mask, shape, timing, flops=case.flops,
                bytes_moved=bytes_moved, peaks=peaks, error=error, peak_mem=mem))
        except Exception as exc:  # one provider failing must not sink the sweep: say so in the row
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            common.log(f"FAILED {case.op} {provider} {common._shape_text(case.shape)} "
                       f"{case.mask} {case.shape['pass']}: {msg}")
            shape = dict(case.shape, note=f"failed: {msg}")
            rows.append(common.make_row(case.op, provider, case.dtype, case.mask, shape))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del sets, refs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
