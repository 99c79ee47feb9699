"""Output layouts the launchers share (plain torch, no Triton: the fake kernels and the C++
backends' Python side import it where Triton is absent)."""
from __future__ import annotations

import torch


def memory_order(t: torch.Tensor, ndim: int = 3) -> list[int]:
    """t's first ``ndim`` dims from outermost to innermost in memory, as torch.empty_like orders
    a tensor that is not dense (ATen's infer_dense_strides): an insertion sort by stride from the
    innermost dim, where a broadcast (stride-0) dim compares as a tie, so it stays where it is
    among its neighbours, and of two equal strides the larger dim goes outside."""
    strides, sizes = t.stride()[:ndim], t.shape[:ndim]

    def inner_first(a: int, b: int) -> int:  # > 0: dim b belongs inside dim a ... swap
        if strides[a] == 0 or strides[b] == 0:
            return 0
        if strides[a] != strides[b]:
            return 1 if strides[a] > strides[b] else -1
        return 1 if sizes[a] > sizes[b] else 0

    perm = list(range(ndim - 1, -1, -1))  # innermost first
    for i in range(1, ndim):
        moving = i
        for j in range(i - 1, -1, -1):
            cmp = inner_first(perm[j], perm[moving])
            if cmp > 0:
                perm[j], perm[moving] = perm[moving], perm[j]
                moving = j
            elif cmp < 0:
                break
    return perm[::-1]


def empty_in_layout_of(q: torch.Tensor, shape) -> torch.Tensor:
    """An empty (B, H, L, D) tensor whose B, H, L dims lie in memory in the order q's do (D last,
    unit stride): the rule of every attention launcher's ``out`` (csrc/attention_cuda.h keeps the
    C++ one).  q/k/v viewed from a packed projection, (B, L, 3, H, D) or (L, B, 3, H, D), then give
    an output whose head merge back to (B, L, H*D) or (L, B, H*D) is a view, not a copy; an
    expanded q gives the order torch.empty_like(q) gives, as torch's CPU SDPA does."""
    order = memory_order(q)
    inverse = [order.index(i) for i in range(3)]
    base = q.new_empty([shape[i] for i in order] + [shape[3]])
    return base.permute(*inverse, 3)
