"""Output layouts the launchers share (plain torch, no Triton: the fake kernels and the C++
backends' Python side import it where Triton is absent)."""
from __future__ import annotations

import math

import torch


def empty_in_layout_of(q: torch.Tensor, shape) -> torch.Tensor:
    """An empty (B, H, L, D) tensor whose B, H, L dims lie in memory in the order q's do (D last,
    unit stride): the rule of every attention launcher's ``out`` (csrc/attention_cuda.h keeps the
    C++ one).  q/k/v viewed from a packed projection, (B, L, 3, H, D) or (L, B, 3, H, D), then give
    an output whose head merge back to (B, L, H*D) or (L, B, H*D) is a view, not a copy."""
    # Stable: ties keep B, H, L order.  A broadcast (stride-0) dim counts as outermost, so an
    # expanded q gives a contiguous out, as torch's SDPA does.
    order = sorted(range(3), key=lambda i: -q.stride(i) if q.stride(i) else -math.inf)
    inverse = [order.index(i) for i in range(3)]
    base = q.new_empty([shape[i] for i in order] + [shape[3]])
    return base.permute(*inverse, 3)
