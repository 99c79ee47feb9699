"""Attention over a KV cache (incremental decoding) as a torch.library custom op.

Inference only: the op appends k_new/v_new into the caches in place (so it declares them as
mutated) and has no autograd formula; the functional layer sends inputs that require grad to
a backend with autograd.

Launcher contract (transformer_fast.kernels.decode; the "cpu" / "cuda" backends run the same contract
in C++: torch.ops.transformer_fast_C.attention_with_kv_cache_fwd, csrc/decode_cpu.cpp and
csrc/decode_cuda.cu):
  attention_with_kv_cache_fwd(q, k_cache, v_cache, cache_seqlens, k_new?, v_new?, scale,
                              allow_tf32) -> out (B, H, L_new, D)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import backends
from . import call


@functools.cache  # a dict lookup per call instead of imports and torch.ops lookups
def _launcher(backend: str):
    if backend == "triton":
        from transformer_fast.kernels import decode

        return decode.attention_with_kv_cache_fwd
    if backend in ("cpu", "cuda"):
        backends.extension_status()  # imports _C, which registers the ops
        return torch.ops.transformer_fast_C.attention_with_kv_cache_fwd
    raise ValueError(f"attention_with_kv_cache op: no fused implementation named {backend!r}")


def _attention_with_kv_cache_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_new: Optional[Tensor],
    v_new: Optional[Tensor],
    scale: float,
    allow_tf32: bool,
    backend: str,
) -> Tensor:
    return _launcher(backend)(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, allow_tf32)


attention_with_kv_cache_op = torch.library.custom_op(
    "transformer_fast::attention_with_kv_cache", _attention_with_kv_cache_impl, mutates_args=("k_cache", "v_cache")
)


@attention_with_kv_cache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, allow_tf32, backend):
    b, h, l_new, _ = q.shape
    return q.new_empty((b, h, l_new, v_cache.shape[-1]))


def attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, allow_tf32, backend):
    """Run the op: appends k_new/v_new into the caches in place, returns out (B, H, L_new, D)."""
    return call(attention_with_kv_cache_op, _attention_with_kv_cache_impl, q, k_cache, v_cache, cache_seqlens,
                k_new, v_new, scale, allow_tf32, backend, mutated=(k_cache, v_cache))
