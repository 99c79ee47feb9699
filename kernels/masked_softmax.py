"""Fused scale + mask + softmax (+ dropout) over materialised scores: Triton kernels and launchers
(no autograd here; the op layer adds it).

Contract (the ``triton`` backend of ``transformer_fast.functional.masked_softmax``):

  masked_softmax_fwd(scores, mask, scale, is_causal, dropout_p, rng) -> (out, probs)
  masked_softmax_bwd(dout, probs, scale, dropout_p, rng) -> dscores

* scores: (B, H, Lq, Lk) fp16 / bf16 / fp32, any strides with stride(-1) == 1 (read through the
  strides; a tensor whose last stride is not 1 is copied, the one case that copies).
* mask: None, or a (B, H, Lq, Lk) tensor (typically an ``.expand`` of a smaller one: all four
  strides are used, stride-0 dims included); bool (True = takes part) or floating (added to the
  scaled scores; -inf removes the entry).  is_causal: top-left aligned, query i sees key j iff
  j <= i.  Both may be given (they combine).
* probs = softmax_j(scores * scale + mask) with removed entries -inf, all arithmetic in fp32.
  A row with no allowed entry (or only -inf) is all zeros, never NaN.
* dropout (dropout_p > 0): element (b, h, i, j) is kept iff the Philox word of the row-major index
  ((b*H + h)*Lq + i)*Lk + j is >= dropout_threshold(p) (transformer_fast.philox via
  kernels/philox.py; rng = int64 [seed, offset] on the device, read in-kernel, None when p == 0);
  kept elements are scaled by 1/(1-p).
* Returns ``out`` (B, H, Lq, Lk) contiguous in scores' dtype (the probabilities after dropout) and
  ``probs``: the pre-dropout probabilities (contiguous, scores' dtype) when dropout_p > 0 (backward
  needs them), else an empty (0,) tensor (``out`` is then the probabilities).
* Backward: dp = dout * keep / (1-p) (the mask is regenerated from rng) or dout;
  dscores = scale * probs * (dp - sum_j(dp * probs)) in fp32; (B, H, Lq, Lk) contiguous in dout's
  dtype.  Removed entries have probs == 0, so they (and fully masked rows) get zero gradient.
  dout and probs: any strides with stride(-1) == 1 (else copied).  Deterministic (no atomics).

Kernel plan (bandwidth bound; the conventions of kernels/layer_norm.py):
  * "fused" (register) path, next_pow2(Lk) <= FWD_MAX_FUSED (fwd) / BWD_MAX_FUSED (bwd): a tile
    of BLOCK_M rows x the whole row (BLOCK_N = next_pow2(Lk)) lives in registers; BLOCK_M > 1
    packs several short rows into one program (~TILE_ELEMS elements per program).  One read of
    scores (and mask), one write of out (and probs): the minimum traffic.  Entries beyond the
    causal diagonal are not read (their loads are predicated off).
  * "looped" path, longer rows (or few long rows, so that the GPU fills up): the row is cut into
    SPLITS ranges of whole LOOP_BLOCK chunks; a statistics kernel on a (rows x splits) grid walks
    its range with an online max / rescaled sum (fwd) or the partial sum of dp * probs (bwd) and
    writes one fp32 partial per (row, split); then an elementwise kernel on a (rows x chunks)
    grid merges the row's partials (fixed order: deterministic) and writes its chunk.  Any Lk
    works (1 ... 65536 and beyond); the causal diagonal bounds the statistics loop.
  * exponentials are exp2 of (s - rowmax) * log2(e) (the argument is formed relative to the row
    max, so the rounding of the exponent does not grow with |s|).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import (cast_out, cdiv, check_rows, device_guard, imin, is_interpreting,
                                             next_power_of_2, sm_count)
from transformer_fast.kernels.philox import dropout_keep, dropout_scale, dropout_threshold, load_rng, load_rng_if

LOG2E = tl.constexpr(1.4426950408889634)

# Largest row kept whole in registers (elements, a power of two), forward / backward.  The
# forward with dropout stops at BWD_MAX_FUSED too: ptxas (sm_90, Triton 3.8) spills ~210 bytes
# per thread for a 16384-element row with the Philox stream live (Triton 3.6: 8-16 bytes).
FWD_MAX_FUSED = 16384
BWD_MAX_FUSED = 8192
# Chunk length of the looped (long-row) path.
LOOP_BLOCK = 4096
# Elements per program targeted when packing several short rows into one program.
TILE_ELEMS = 4096
MAX_BLOCK_M = 256
# Looped path: at most this many splits of one row; programs aimed at per SM by the statistics grid.
MAX_SPLITS = 64
STATS_PROGRAMS_PER_SM = 4
# Rows of at least SPLIT_MIN_CHUNKS * LOOP_BLOCK elements go to the looped path even when they fit
# in registers if the fused grid would leave most of the GPU idle (fewer row blocks than
# SMs / FEW_ROWS_DIVISOR): splitting the row over programs then fills the GPU.
SPLIT_MIN_CHUNKS = 2
FEW_ROWS_DIVISOR = 2

_EMPTY = (0,)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _row_offset(rows, H, Lq, s_b, s_h, s_m):
    """Element offset (int64) of the start of row ``rows`` (= (b*H + h)*Lq + i; int32 scalar or
    tensor) in a 4-D tensor with strides (s_b, s_h, s_m, 1)."""
    i = rows % Lq
    bh = rows // Lq
    h = bh % H
    b = bh // H
    return b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + i.to(tl.int64) * s_m


@triton.jit
def _out_row_1(row, Lk, ALIGN_O: tl.constexpr):
    """(1, 1) int64 offset of row ``row`` (a scalar) of a contiguous (M, Lk) tensor."""
    return tl.multiple_of((row + tl.arange(0, 1)).to(tl.int64) * Lk, ALIGN_O)[:, None]


@triton.jit
def _row_offsets_1(row, H, Lq, s_sb, s_sh, s_sm, s_ab, s_ah, s_am,
                   MASK_KIND: tl.constexpr, ALIGN_S: tl.constexpr, ALIGN_A: tl.constexpr):
    """(1, 1) int64 row offsets in scores and mask of row ``row`` (a scalar), carrying the
    alignment hints (tl.multiple_of needs a tensor, hence the 1-element shape)."""
    rows = row + tl.arange(0, 1)
    s_off = tl.multiple_of(_row_offset(rows, H, Lq, s_sb, s_sh, s_sm), ALIGN_S)[:, None]
    if MASK_KIND != 0:
        am_off = tl.multiple_of(_row_offset(rows, H, Lq, s_ab, s_ah, s_am), ALIGN_A)[:, None]
    else:
        am_off = s_off
    return s_off, am_off


@triton.jit
def _masked_scores(S, AM, s_off, am_off, qi, cols, ok, scale, s_an,
                   MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr):
    """fp32 ``scores * scale (+ float mask)`` with removed entries (and entries outside ``ok``)
    at -inf.  ``s_off`` / ``am_off`` / ``qi`` (row offsets, query index) broadcast against
    ``cols``; ``ok`` has the tile's shape.  Entries beyond the causal diagonal are not read."""
    if CAUSAL:
        ok = ok & (cols <= qi)
    x = tl.load(S + s_off + cols, mask=ok, other=0.0).to(tl.float32)
    s = x * scale
    # The mask's column offsets in int64: a transposed mask's column stride times Lk passes
    # 2**31 from Lq * Lk > 2**31 on (its unit stride is specialised to a constant, free).
    if MASK_KIND == 2:  # float, added after scaling
        am = tl.load(AM + am_off + cols.to(tl.int64) * s_an, mask=ok, other=0.0).to(tl.float32)
        s = s + am
    if MASK_KIND == 1:  # bool (as uint8), True = takes part
        am = tl.load(AM + am_off + cols.to(tl.int64) * s_an, mask=ok, other=0)
        ok = ok & (am != 0)
    return tl.where(ok, s, float("-inf"))


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_fused_kernel(
    S, AM, OUT, PROBS, RNG,
    M, H, Lq, Lk, s_sb, s_sh, s_sm, s_ab, s_ah, s_am, s_an, scale, drop_thr, drop_scale,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ALIGN_S: tl.constexpr, ALIGN_A: tl.constexpr, ALIGN_O: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """BLOCK_M whole rows (BLOCK_N >= Lk) per program, in registers.  ALIGN_*: powers of two
    that divide the row offsets of scores / mask / out (vectorisation hints)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    row_ok = rows < M
    ok = row_ok[:, None] & (cols < Lk)
    s_off = tl.multiple_of(_row_offset(rows, H, Lq, s_sb, s_sh, s_sm), ALIGN_S)[:, None]
    if MASK_KIND != 0:
        am_off = tl.multiple_of(_row_offset(rows, H, Lq, s_ab, s_ah, s_am), ALIGN_A)[:, None]
    else:
        am_off = s_off
    qi = (rows % Lq)[:, None]
    s = _masked_scores(S, AM, s_off, am_off, qi, cols, ok, scale, s_an, MASK_KIND, CAUSAL)

    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # dead row: exp2(-inf) = 0 everywhere, no NaN
    e = tl.exp2((s - m[:, None]) * LOG2E)
    l = tl.sum(e, axis=1)
    # l == 0 only for a dead row; a NaN l (NaN or +inf score) must stay NaN, as in the reference
    inv = tl.where(l == 0.0, 0.0, tl.div_rn(1.0, tl.where(l == 0.0, 1.0, l)))
    p = e * inv[:, None]

    out_off = tl.multiple_of(rows.to(tl.int64) * Lk, ALIGN_O)[:, None] + cols
    if HAS_DROPOUT:
        seed_lo, seed_hi, off_lo, off_hi = load_rng(RNG)
        keep = dropout_keep(seed_lo, seed_hi, out_off, off_lo, off_hi, drop_thr)
        tl.store(PROBS + out_off, cast_out(p, PROBS.dtype.element_ty, INTERPRET), mask=ok)
        p = tl.where(keep, p * drop_scale, 0.0)
    tl.store(OUT + out_off, cast_out(p, OUT.dtype.element_ty, INTERPRET), mask=ok)


@triton.jit
def _fwd_stats_kernel(
    S, AM, PART_M, PART_L,
    H, Lq, Lk, s_sb, s_sh, s_sm, s_ab, s_ah, s_am, s_an, scale, span,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
    ALIGN_S: tl.constexpr, ALIGN_A: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (row, split): online max / rescaled sum of exp over columns
    [split * span, min((split + 1) * span, Lk)) -> PART_M / PART_L[row, split]."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    s_off, am_off = _row_offsets_1(row, H, Lq, s_sb, s_sh, s_sm, s_ab, s_ah, s_am,
                                   MASK_KIND, ALIGN_S, ALIGN_A)
    qi = row % Lq  # a scalar: usable in the loop bound
    lo = split * span
    hi = imin(lo + span, Lk)
    if CAUSAL:
        hi = imin(hi, qi + 1)  # keys past the diagonal: not even visited
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = (start + tl.arange(0, BLOCK_N))[None, :]
        s = _masked_scores(S, AM, s_off, am_off, qi, cols, cols < hi, scale, s_an, MASK_KIND, CAUSAL)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_safe) * LOG2E)  # 0 while m_i is -inf
        l_i = l_i * alpha + tl.sum(tl.exp2((s - m_safe[:, None]) * LOG2E), axis=1)
        m_i = m_new
    idx = row.to(tl.int64) * nsplit + split + tl.arange(0, 1)
    tl.store(PART_M + idx, m_i)
    tl.store(PART_L + idx, l_i)


@triton.jit
def _fwd_apply_kernel(
    S, AM, OUT, PROBS, RNG, PART_M, PART_L,
    H, Lq, Lk, s_sb, s_sh, s_sm, s_ab, s_ah, s_am, s_an, scale, drop_thr, drop_scale, nsplit,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ALIGN_S: tl.constexpr, ALIGN_A: tl.constexpr, ALIGN_O: tl.constexpr,
    SPLITS_P2: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (row, chunk): merge the row's partial statistics, write its chunk of out/probs."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ks = tl.arange(0, SPLITS_P2)
    k_ok = ks < nsplit
    part = row.to(tl.int64) * nsplit + ks
    mk = tl.load(PART_M + part, mask=k_ok, other=float("-inf"))
    lk = tl.load(PART_L + part, mask=k_ok, other=0.0)
    m = tl.max(mk, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(lk * tl.exp2((mk - m) * LOG2E), axis=0)
    # l == 0 only for a dead row; a NaN l (NaN or +inf score) must stay NaN, as in the reference
    inv = tl.where(l == 0.0, 0.0, tl.div_rn(1.0, tl.where(l == 0.0, 1.0, l)))

    s_off, am_off = _row_offsets_1(row, H, Lq, s_sb, s_sh, s_sm, s_ab, s_ah, s_am,
                                   MASK_KIND, ALIGN_S, ALIGN_A)
    qi = row % Lq
    cols = (chunk * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    ok = cols < Lk
    s = _masked_scores(S, AM, s_off, am_off, qi, cols, ok, scale, s_an, MASK_KIND, CAUSAL)
    p = tl.exp2((s - m) * LOG2E) * inv

    out_off = _out_row_1(row, Lk, ALIGN_O) + cols
    if HAS_DROPOUT:
        seed_lo, seed_hi, off_lo, off_hi = load_rng(RNG)
        keep = dropout_keep(seed_lo, seed_hi, out_off, off_lo, off_hi, drop_thr)
        tl.store(PROBS + out_off, cast_out(p, PROBS.dtype.element_ty, INTERPRET), mask=ok)
        p = tl.where(keep, p * drop_scale, 0.0)
    tl.store(OUT + out_off, cast_out(p, OUT.dtype.element_ty, INTERPRET), mask=ok)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _load_p_dp(P, DO, p_off, do_off, out_off, cols, ok,
               seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT: tl.constexpr):
    """(probs, dp) in fp32: dp = dout * keep / (1 - p) (mask regenerated) or dout."""
    p = tl.load(P + p_off + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(DO + do_off + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = dropout_keep(seed_lo, seed_hi, out_off, off_lo, off_hi, drop_thr)
        g = tl.where(keep, g * drop_scale, 0.0)
    return p, g


@triton.jit
def _bwd_fused_kernel(
    DO, P, DS, RNG,
    M, H, Lq, Lk, s_db, s_dh, s_dm, s_pb, s_ph, s_pm, scale, drop_thr, drop_scale,
    HAS_DROPOUT: tl.constexpr, ALIGN_D: tl.constexpr, ALIGN_P: tl.constexpr, ALIGN_O: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    ok = (rows < M)[:, None] & (cols < Lk)
    do_off = tl.multiple_of(_row_offset(rows, H, Lq, s_db, s_dh, s_dm), ALIGN_D)[:, None]
    p_off = tl.multiple_of(_row_offset(rows, H, Lq, s_pb, s_ph, s_pm), ALIGN_P)[:, None]
    out_off = tl.multiple_of(rows.to(tl.int64) * Lk, ALIGN_O)[:, None] + cols
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    p, g = _load_p_dp(P, DO, p_off, do_off, out_off, cols, ok,
                      seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
    delta = tl.sum(g * p, axis=1)
    ds = scale * (p * (g - delta[:, None]))
    tl.store(DS + out_off, cast_out(ds, DS.dtype.element_ty, INTERPRET), mask=ok)


@triton.jit
def _bwd_stats_kernel(
    DO, P, RNG, PART,
    H, Lq, Lk, s_db, s_dh, s_dm, s_pb, s_ph, s_pm, drop_thr, drop_scale, span,
    HAS_DROPOUT: tl.constexpr, ALIGN_D: tl.constexpr, ALIGN_P: tl.constexpr,
    ALIGN_O: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (row, split): partial sum of dp * probs over the split's columns -> PART."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    do_off, p_off = _row_offsets_1(row, H, Lq, s_db, s_dh, s_dm, s_pb, s_ph, s_pm, 1, ALIGN_D, ALIGN_P)
    row_out = _out_row_1(row, Lk, ALIGN_O)
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    lo = split * span
    hi = imin(lo + span, Lk)
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = (start + tl.arange(0, BLOCK_N))[None, :]
        p, g = _load_p_dp(P, DO, p_off, do_off, row_out + cols, cols, cols < hi,
                          seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
        acc += g * p
    idx = row.to(tl.int64) * nsplit + split + tl.arange(0, 1)
    tl.store(PART + idx, tl.sum(acc, axis=1))


@triton.jit
def _bwd_apply_kernel(
    DO, P, DS, RNG, PART,
    H, Lq, Lk, s_db, s_dh, s_dm, s_pb, s_ph, s_pm, scale, drop_thr, drop_scale, nsplit,
    HAS_DROPOUT: tl.constexpr, ALIGN_D: tl.constexpr, ALIGN_P: tl.constexpr,
    ALIGN_O: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ks = tl.arange(0, SPLITS_P2)
    delta = tl.sum(tl.load(PART + row.to(tl.int64) * nsplit + ks, mask=ks < nsplit, other=0.0), axis=0)
    do_off, p_off = _row_offsets_1(row, H, Lq, s_db, s_dh, s_dm, s_pb, s_ph, s_pm, 1, ALIGN_D, ALIGN_P)
    cols = (chunk * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    ok = cols < Lk
    out_off = _out_row_1(row, Lk, ALIGN_O) + cols
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    p, g = _load_p_dp(P, DO, p_off, do_off, out_off, cols, ok,
                      seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
    ds = scale * (p * (g - delta))
    tl.store(DS + out_off, cast_out(ds, DS.dtype.element_ty, INTERPRET), mask=ok)


# ---------------------------------------------------------------------------------------------
# Launch configuration


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device)
    return 4  # the interpreter (CPU tensors): few programs


def _num_warps(tile_elems: int) -> int:
    """~8 elements per thread per live tensor, 1..32 warps (as kernels/layer_norm.py)."""
    return max(1, min(32, tile_elems // 256))


def _align(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (0 divides by anything): a hint that lets
    the compiler vectorise row accesses when row offsets are multiples of it."""
    a = 16
    for v in values:
        v = abs(int(v))
        while a > 1 and v % a:
            a //= 2
    return a


def _plan(m: int, n: int, max_fused: int, device: torch.device):
    """("fused", BLOCK_M, BLOCK_N, num_warps) or ("looped", nsplit, span, num_warps)."""
    block_n = next_power_of_2(n)
    sms = _num_sms(device)
    if block_n <= max_fused:
        block_m = max(1, min(MAX_BLOCK_M, TILE_ELEMS // block_n, next_power_of_2(m)))
        few_rows = cdiv(m, block_m) * FEW_ROWS_DIVISOR < sms
        if not (few_rows and n >= SPLIT_MIN_CHUNKS * LOOP_BLOCK):
            return "fused", block_m, block_n, _num_warps(block_m * block_n)
    n_chunks = cdiv(n, LOOP_BLOCK)
    want = max(1, cdiv(STATS_PROGRAMS_PER_SM * sms, m))
    nsplit = max(1, min(n_chunks, want, MAX_SPLITS))
    per_split = cdiv(n_chunks, nsplit)
    nsplit = cdiv(n_chunks, per_split)  # no empty split
    return "looped", nsplit, per_split * LOOP_BLOCK, _num_warps(LOOP_BLOCK)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _check_4d(name: str, t, shape, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"masked_softmax: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"masked_softmax: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"masked_softmax: {name} must be on {device}, got {t.device}")
    return t


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"masked_softmax: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def _dropout_args(dropout_p: float, rng, like: torch.Tensor):
    """(has_dropout, rng tensor or dummy, threshold, scale)."""
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"masked_softmax: dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p == 0.0:
        return False, like, 0, 1.0
    if not isinstance(rng, torch.Tensor):
        raise ValueError("masked_softmax: rng (int64 [seed, offset]) is required when dropout_p > 0")
    if rng.dtype != torch.int64 or rng.numel() < 2 or rng.device != like.device:
        raise ValueError(
            f"masked_softmax: rng must be an int64 tensor [seed, offset] on {like.device}, got "
            f"{rng.dtype} {tuple(rng.shape)} on {rng.device}"
        )
    return True, rng.reshape(-1).contiguous(), dropout_threshold(dropout_p), dropout_scale(dropout_p)


# ---------------------------------------------------------------------------------------------
# Launchers


def masked_softmax_fwd(scores, mask, scale: float, is_causal: bool, dropout_p: float, rng):
    """-> (out, probs); see the module docstring."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 4:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"masked_softmax: scores must be 4-D (B, H, Lq, Lk), got {shape}")
    _check_dtype("scores", scores)
    B, H, Lq, Lk = scores.shape
    scores = _unit_last(scores)
    if mask is not None:
        _check_4d("mask", mask, scores.shape, scores.device)
        if mask.dtype == torch.bool:
            mask_kind, am = 1, mask.view(torch.uint8)  # same strides (one-byte elements)
        elif mask.is_floating_point():
            mask_kind, am = 2, mask
        else:
            raise TypeError(f"masked_softmax: mask must be bool or floating, got {mask.dtype}")
        am_strides = tuple(am.stride())
    else:
        mask_kind, am, am_strides = 0, scores, (0, 0, 0, 0)
    has_dropout, rng_t, thr, dscale = _dropout_args(dropout_p, rng, scores)

    M = B * H * Lq
    out = torch.empty((B, H, Lq, Lk), dtype=scores.dtype, device=scores.device)
    probs = torch.empty_like(out) if has_dropout else scores.new_empty(_EMPTY)
    if M == 0 or Lk == 0:
        return out, probs
    check_rows("masked_softmax", M, "B*H*Lq")

    s_strides = tuple(scores.stride()[:3])
    align = dict(ALIGN_S=_align(*s_strides), ALIGN_A=_align(*am_strides[:3]), ALIGN_O=_align(Lk))
    common = dict(MASK_KIND=mask_kind, CAUSAL=bool(is_causal), HAS_DROPOUT=has_dropout,
                  INTERPRET=is_interpreting())
    max_fused = min(FWD_MAX_FUSED, BWD_MAX_FUSED) if has_dropout else FWD_MAX_FUSED
    path, a, b, num_warps = _plan(M, Lk, max_fused, scores.device)
    with device_guard(scores):
        if path == "fused":
            block_m, block_n = a, b
            _fwd_fused_kernel[(cdiv(M, block_m),)](
                scores, am, out, probs if has_dropout else out, rng_t,
                M, H, Lq, Lk, *s_strides, *am_strides, float(scale), thr, dscale, **align,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **common,
            )
        else:
            nsplit, span = a, b
            part_m = torch.empty((M, nsplit), dtype=torch.float32, device=scores.device)
            part_l = torch.empty((M, nsplit), dtype=torch.float32, device=scores.device)
            _fwd_stats_kernel[(M, nsplit)](
                scores, am, part_m, part_l,
                H, Lq, Lk, *s_strides, *am_strides, float(scale), span,
                MASK_KIND=mask_kind, CAUSAL=bool(is_causal), ALIGN_S=align["ALIGN_S"],
                ALIGN_A=align["ALIGN_A"], BLOCK_N=LOOP_BLOCK, num_warps=num_warps,
            )
            _fwd_apply_kernel[(M, cdiv(Lk, LOOP_BLOCK))](
                scores, am, out, probs if has_dropout else out, rng_t, part_m, part_l,
                H, Lq, Lk, *s_strides, *am_strides, float(scale), thr, dscale, nsplit, **align,
                SPLITS_P2=next_power_of_2(nsplit), BLOCK_N=LOOP_BLOCK,
                num_warps=num_warps, **common,
            )
    return out, probs


def masked_softmax_bwd(dout, probs, scale: float, dropout_p: float, rng):
    """-> dscores (B, H, Lq, Lk) contiguous in dout's dtype; see the module docstring."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 4:
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"masked_softmax: probs must be 4-D (B, H, Lq, Lk), got {shape}")
    _check_dtype("probs", probs)
    _check_4d("dout", dout, probs.shape, probs.device)
    _check_dtype("dout", dout)
    B, H, Lq, Lk = probs.shape
    dout, probs = _unit_last(dout), _unit_last(probs)
    has_dropout, rng_t, thr, dscale = _dropout_args(dropout_p, rng, probs)

    M = B * H * Lq
    ds = torch.empty((B, H, Lq, Lk), dtype=dout.dtype, device=dout.device)
    if M == 0 or Lk == 0:
        return ds
    check_rows("masked_softmax", M, "B*H*Lq")

    d_strides = tuple(dout.stride()[:3])
    p_strides = tuple(probs.stride()[:3])
    align = dict(ALIGN_D=_align(*d_strides), ALIGN_P=_align(*p_strides), ALIGN_O=_align(Lk))
    path, a, b, num_warps = _plan(M, Lk, BWD_MAX_FUSED, dout.device)
    with device_guard(dout):
        if path == "fused":
            block_m, block_n = a, b
            _bwd_fused_kernel[(cdiv(M, block_m),)](
                dout, probs, ds, rng_t,
                M, H, Lq, Lk, *d_strides, *p_strides, float(scale), thr, dscale,
                HAS_DROPOUT=has_dropout, **align, BLOCK_M=block_m, BLOCK_N=block_n,
                INTERPRET=is_interpreting(), num_warps=num_warps,
            )
        else:
            nsplit, span = a, b
            part = torch.empty((M, nsplit), dtype=torch.float32, device=dout.device)
            _bwd_stats_kernel[(M, nsplit)](
                dout, probs, rng_t, part,
                H, Lq, Lk, *d_strides, *p_strides, thr, dscale, span,
                HAS_DROPOUT=has_dropout, **align, BLOCK_N=LOOP_BLOCK, num_warps=num_warps,
            )
            _bwd_apply_kernel[(M, cdiv(Lk, LOOP_BLOCK))](
                dout, probs, ds, rng_t, part,
                H, Lq, Lk, *d_strides, *p_strides, float(scale), thr, dscale, nsplit,
                HAS_DROPOUT=has_dropout, **align, SPLITS_P2=next_power_of_2(nsplit),
                BLOCK_N=LOOP_BLOCK, INTERPRET=is_interpreting(), num_warps=num_warps,
            )
    return ds
