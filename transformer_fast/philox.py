"""The dropout random stream shared by every backend (Python reference implementation).

All kernels that drop use the same counter-based generator, so a dropout mask is a pure function
of (seed, offset, element index): backward regenerates the forward mask without storing it, and
every backend (reference, triton, cuda, cpu) drops exactly the same elements for the same
``rng`` tensor, which lets the float64 oracle check dropout exactly.

Definition (Philox4x32-10, Salmon et al. 2011, the same rounds as Random123 and tl.rand): element
i takes word (i mod 4) of the block at counter n = i div 4, so that a kernel handling 4
consecutive elements runs Philox once for them (one block gives 4 words):
  key     (k0, k1)          = (lo32(seed), hi32(seed))
  counter (c0, c1, c2, c3)  = (lo32(n), hi32(n), lo32(offset), hi32(offset))
  10 rounds of
      c0, c1, c2, c3 = mulhi(B, c2) ^ c1 ^ k0, B * c2, mulhi(A, c0) ^ c3 ^ k1, A * c0
      k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85
  with A = 0xD2511F53, B = 0xCD9E8D57 (all arithmetic mod 2**32); the random word of element i is
  (c0, c1, c2, c3)[i mod 4].
An element is kept when ``word >= dropout_threshold(p)`` (a uint32 compare, no float rounding),
and a kept element is scaled by 1 / (1 - p).

``i`` is the element's row-major index in the op's logical (rows, cols) layout, independent of
strides.  ``rng`` is an int64 tensor ``[seed, offset]`` on the inputs' device, drawn by
``new_rng`` from torch's generator, so ``torch.manual_seed`` makes dropout reproducible.
"""
from __future__ import annotations

import numpy as np
import torch

PHILOX_A = 0xD2511F53
PHILOX_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
ROUNDS = 10
_M32 = np.uint64(0xFFFFFFFF)


def dropout_threshold(p: float) -> int:
    """uint32 threshold below which a random word drops its element."""
    return min(int(p * 4294967296.0), 0xFFFFFFFF)


def new_rng(device: torch.device | str) -> torch.Tensor:
    """A fresh ``[seed, offset]`` int64 pair on ``device`` from torch's default generator."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def philox_blocks(seed: int, offset: int, counter: np.ndarray) -> tuple[np.ndarray, ...]:
    """The four uint32 output words (c0, c1, c2, c3) of Philox4x32-10 for each block counter
    (numpy uint64 in; the counter's high half is (lo32(offset), hi32(offset)))."""
    counter = np.asarray(counter, dtype=np.uint64)
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    c0 = counter & _M32
    c1 = counter >> np.uint64(32)
    c2 = np.full_like(counter, offset & 0xFFFFFFFF)
    c3 = np.full_like(counter, offset >> 32)
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64(seed >> 32)
    a = np.uint64(PHILOX_A)
    b = np.uint64(PHILOX_B)
    for _ in range(ROUNDS):
        prod_a = a * c0  # < 2**64: exact in uint64
        prod_b = b * c2
        c0, c1, c2, c3 = (
            ((prod_b >> np.uint64(32)) ^ c1 ^ k0) & _M32,
            prod_b & _M32,
            ((prod_a >> np.uint64(32)) ^ c3 ^ k1) & _M32,
            prod_a & _M32,
        )
        k0 = (k0 + np.uint64(PHILOX_KEY_A)) & _M32
        k1 = (k1 + np.uint64(PHILOX_KEY_B)) & _M32
    return c0, c1, c2, c3


def philox_words(seed: int, offset: int, index: np.ndarray) -> np.ndarray:
    """The uint32 random word of each element index (numpy uint64 in): word (i mod 4) of the
    block at counter i div 4."""
    index = np.asarray(index, dtype=np.uint64)
    words = np.stack(philox_blocks(seed, offset, index >> np.uint64(2)))  # (4, ...)
    lane = (index & np.uint64(3)).astype(np.intp)
    return np.take_along_axis(words, lane[None], axis=0)[0]


def dropout_keep_mask(rng: torch.Tensor, shape, p: float) -> torch.Tensor:
    """Bool mask (True = kept) that every backend uses for elements of a tensor of ``shape``."""
    seed, offset = (int(v) for v in rng.detach().cpu().tolist())
    numel = int(np.prod(shape)) if len(shape) else 1
    # Indices 0..numel-1 fill whole blocks in order: each block once, its words in lane order.
    blocks = philox_blocks(seed, offset, np.arange((numel + 3) // 4, dtype=np.uint64))
    words = np.stack(blocks, axis=1).reshape(-1)[:numel]
    keep = words >= np.uint64(dropout_threshold(p))
    return torch.from_numpy(keep.reshape(tuple(shape))).to(rng.device)
