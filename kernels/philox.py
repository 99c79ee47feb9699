"""Philox4x32-10 dropout stream for Triton kernels (bit-exact with transformer_fast.philox).

The definition lives in transformer_fast/philox.py; this file is its @triton.jit twin, shared by
every Triton kernel that drops (layer norm, attention, FFN):

  key     (k0, k1)          = (lo32(seed), hi32(seed))
  counter (c0, c1, c2, c3)  = (lo32(i div 4), hi32(i div 4), lo32(offset), hi32(offset))
  10 rounds; the random word of element i is (c0, c1, c2, c3)[i mod 4].  ``dropout_keep`` runs a
  block per element and keeps its word; ``dropout_keep_rows`` runs one block per 4 adjacent
  columns of a tile whose row length is a multiple of 4.
  Keep element i iff word >= threshold (uint32 compare),
  threshold = min(floor(p * 2**32), 2**32 - 1) computed on the host (``dropout_threshold``),
  and scale kept elements by 1 / (1 - p) (``dropout_scale``).

Usage inside a kernel::

    seed_lo, seed_hi, off_lo, off_hi = load_rng(RNG)            # RNG: int64 [seed, offset]
    keep = dropout_keep(seed_lo, seed_hi, idx, off_lo, off_hi, thr)  # idx: int64 element index
    x = tl.where(keep, x * scale, 0.0)

All arithmetic is uint32 (``tl.umulhi`` for the high half of the 32x32 product, wrapping ``*`` for
the low half), which works the same compiled (Triton 3.6+) and under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import triton
import triton.language as tl

from transformer_fast.philox import dropout_threshold  # noqa: F401  (host side, re-exported)

PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)


def dropout_scale(p: float) -> float:
    """Factor applied to kept elements: 1 / (1 - p) (0 when p >= 1: everything is dropped)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


@triton.jit
def load_rng(RNG):
    """Load ``[seed, offset]`` (int64) from device memory; return (seed_lo, seed_hi, off_lo, off_hi)
    as uint32 scalars.  No host synchronisation: the values stay on the device."""
    seed = tl.load(RNG).to(tl.uint64, bitcast=True)
    offset = tl.load(RNG + 1).to(tl.uint64, bitcast=True)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    off_lo = (offset & 0xFFFFFFFF).to(tl.uint32)
    off_hi = (offset >> 32).to(tl.uint32)
    return seed_lo, seed_hi, off_lo, off_hi


@triton.jit
def load_rng_if(RNG, HAS_DROPOUT: tl.constexpr):
    """load_rng when the kernel drops, else zeros (RNG may then be a dummy pointer)."""
    if HAS_DROPOUT:
        seed_lo, seed_hi, off_lo, off_hi = load_rng(RNG)
    else:
        seed_lo = 0
        seed_hi = 0
        off_lo = 0
        off_hi = 0
    return seed_lo, seed_hi, off_lo, off_hi


@triton.jit
def philox_block_u32(seed_lo, seed_hi, c0, c1, off_lo, off_hi):
    """Philox4x32-10's four output words for counters (c0, c1, off_lo, off_hi), key (seed_lo,
    seed_hi).  c0/c1 are uint32 tensors (lo/hi halves of the block counter); the rest uint32
    scalars."""
    c2 = c0 * 0 + off_lo
    c3 = c0 * 0 + off_hi
    k0 = seed_lo
    k1 = seed_hi
    for _ in tl.static_range(PHILOX_ROUNDS):
        prev_c0 = c0
        prev_c2 = c2
        c0 = tl.umulhi(prev_c2, PHILOX_ROUND_B) ^ c1 ^ k0
        c2 = tl.umulhi(prev_c0, PHILOX_ROUND_A) ^ c3 ^ k1
        c1 = prev_c2 * PHILOX_ROUND_B
        c3 = prev_c0 * PHILOX_ROUND_A
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@triton.jit
def philox_word(seed_lo, seed_hi, idx, off_lo, off_hi):
    """Random uint32 word of element ``idx`` (a non-negative int32/int64 tensor: the element's
    row-major index in the op's logical layout): word idx % 4 of the block at counter idx // 4."""
    idx64 = idx.to(tl.int64)
    block = idx64 >> 2
    w0, w1, w2, w3 = philox_block_u32(seed_lo, seed_hi, (block & 0xFFFFFFFF).to(tl.uint32),
                                      (block >> 32).to(tl.uint32), off_lo, off_hi)
    lane = idx64 & 3
    return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))


@triton.jit
def dropout_keep(seed_lo, seed_hi, idx, off_lo, off_hi, threshold):
    """Bool tensor: True where element ``idx`` is kept (word >= threshold, unsigned compare).
    ``threshold`` is the host's ``dropout_threshold(p)`` (a kernel int argument)."""
    word = philox_word(seed_lo, seed_hi, idx, off_lo, off_hi)
    # Compare in int64: the host int may arrive as i32 (< 2**31), i64 (>= 2**31) or a
    # specialised constexpr; the zero-extended word compares correctly against each.
    return word.to(tl.int64) >= threshold


@triton.jit
def dropout_keep_rows(seed_lo, seed_hi, rows64, N, col0, off_lo, off_hi, threshold,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPED: tl.constexpr):
    """Keep mask (BLOCK_M, BLOCK_N) of the elements rows64[r] * N + col0 + c (rows64: int64
    (BLOCK_M,) row indices, N the row length).  GROUPED (N, col0 and BLOCK_N multiples of 4):
    the 4 words of one Philox block serve 4 adjacent columns, interleaved back into place (a
    quarter of the Philox work, which bounds dropout epilogues on wide tiles); else one block
    per element as ``dropout_keep``."""
    if GROUPED:
        grp = col0 + 4 * tl.arange(0, BLOCK_N // 4)
        blk = (rows64[:, None] * N + grp[None, :]) >> 2  # (BM, BN / 4)
        w0, w1, w2, w3 = philox_block_u32(seed_lo, seed_hi, (blk & 0xFFFFFFFF).to(tl.uint32),
                                          (blk >> 32).to(tl.uint32), off_lo, off_hi)
        # join(join(w0, w2), join(w1, w3))[..., i, o] = w_(2i + o): row-major (i, o) is lane order.
        word = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_M, BLOCK_N))
    else:
        idx = rows64[:, None] * N + col0 + tl.arange(0, BLOCK_N)[None, :]
        word = philox_word(seed_lo, seed_hi, idx, off_lo, off_hi)
    return word.to(tl.int64) >= threshold
