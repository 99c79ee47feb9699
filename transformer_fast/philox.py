"""The dropout random stream shared by every backend (Python reference implementation).

All kernels that drop use the same counter-based generator, so a dropout mask is a pure function
of (seed, offset, element index): backward regenerates the forward mask without storing it, and
every backend (reference, triton, cuda, cpu) drops exactly the same elements for the same
``rng`` tensor, which lets the float64 oracle check dropout exactly.

Definition (Philox4x32-10, Salmon et al. 2011, the same rounds as Random123 and tl.rand):
  key     (k0, k1)          = (lo32(seed), hi32(seed))
  counter (c0, c1, c2, c3)  = (lo32(i), hi32(i), lo32(offset), hi32(offset))
  10 rounds of
      c0, c1, c2, c3 = mulhi(B, c2) ^ c1 ^ k0, B * c2, mulhi(A, c0) ^ c3 ^ k1, A * c0
      k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85
  with A = 0xD2511F53, B = 0xCD9E8D57 (all arithmetic mod 2**32); the random word is c0.
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


def philox_words(seed: int, offset: int, index: np.ndarray) -> np.ndarray:
    """The first uint32 output word of Philox4x32-10 for each element index (numpy uint64 in)."""
    index = np.asarray(index, dtype=np.uint64)
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    c0 = index & _M32
    c1 = index >> np.uint64(32)
    c2 = np.full_like(index, offset & 0xFFFFFFFF)
    c3 = np.full_like(index, offset >> 32)
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
    return c0


def dropout_keep_mask(rng: torch.Tensor, shape, p: float) -> torch.Tensor:
    """Bool mask (True = kept) that every backend uses for elements of a tensor of ``shape``."""
    seed, offset = (int(v) for v in rng.detach().cpu().tolist())
    numel = int(np.prod(shape)) if len(shape) else 1
    words = philox_words(seed, offset, np.arange(numel, dtype=np.uint64))
    keep = words >= np.uint64(dropout_threshold(p))
    return torch.from_numpy(keep.reshape(tuple(shape))).to(rng.device)
