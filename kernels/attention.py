"""Masked softmax attention, FlashAttention-2 style: Triton kernels and launchers (no autograd).

Contract (the ``triton`` backend of scaled_dot_product_attention builds on it):

  attention_fwd(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32)
      -> (out, lse)
  attention_bwd(do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                rng, allow_tf32) -> (dq, dk, dv)

* q (B, H, Lq, D); k, v (B, Hkv, Lk, D), Hkv divides H (query head h reads kv head
  h // (H // Hkv)); any strides with stride(-1) == 1 (read through the strides, never copied;
  a tensor whose last stride is not 1 is the one case that is made contiguous).  Lq, Lk >= 1.
  D in 16..256 (any D <= 256 works: the kernels pad D to the next power of two with masked loads).
  fp16 / bf16 / fp32; fp32 dots run in tf32 when ``allow_tf32`` else in exact fp32 ("ieee").
* attn_mask: None or a (B, H, Lq, Lk) tensor (typically an ``.expand`` of a smaller one: stride-0
  dims are read through their strides); bool (True = takes part) or floating (added to the scaled
  scores, -inf allowed).  key_padding_mask: None or (B, Lk) bool, True = padding.  is_causal:
  top-left aligned, query i sees keys j <= i (torch SDPA's convention for Lq != Lk).
* s = scale * q.k (+ float mask); masked -> -inf; p = softmax_j(s) in fp32; dropout keeps
  (b, h, i, j) iff Philox(seed, offset, ((b*H + h)*Lq + i)*Lk + j) >= threshold(dropout_p) (the
  stream of transformer_fast.philox, via kernels/philox.py; rng = int64 [seed, offset] on the
  device, read in-kernel, None when dropout_p == 0) and scales kept elements by 1/(1-p);
  out = dropout(p) @ v.
* out (B, H, Lq, D) contiguous, q's dtype.  lse (B, H, Lq) fp32, the NATURAL-log logsumexp of
  the scaled scores: lse[b,h,i] = log(sum_j exp(s_ij)) (as torch's own SDPA kernels return it).
  A row with nothing to attend to has lse = -inf and output 0; backward gives it zero gradient
  (its probabilities are recomputed as exactly 0).
* dq, dk, dv: contiguous with the shapes (and dtypes) of q, k, v.  Backward: delta =
  rowsum(do * out) in a small kernel; one kernel over key blocks computes dk, dv (looping over the
  query heads of its GQA group; when that leaves too few programs for the GPU, the group is split
  over programs that write fp32 partials, summed afterwards); dq either in one kernel over query
  blocks (deterministic) or, for fp16 / bf16 at head dims <= 128 with more than 128 keys and
  torch's deterministic mode off, by fp32 atomics from the dk/dv kernel (_atomic_dq; its last
  bits may differ run to run on a GPU).

Work skipping: key tiles entirely beyond the causal diagonal are outside the loop bounds; with a
key_padding_mask the key loop runs over [first valid key, last valid key] of each batch row only
(_kpm_ranges_kernel summarises the mask on the device: one launch, no host sync), and a key block
whose keys are all padding does no work in the dk/dv kernel.  (Blocks of padding strictly inside
a row's valid range are computed, masked.)  The blocks inside the run of valid keys that starts
at a row's first (a right-padded row's, bar its last block) take the unmasked loops of the
forward and dq kernels.  (The dk/dv kernel keeps one loop: a second one for key blocks without
padding spilled 136 bytes at D 64 with every mask and dropout, against 32, on Triton 3.6.)
Tiles that need no masking at all (full blocks before the causal diagonal, no attn_mask / padding
mask) run a loop without any mask code; the causal diagonal and the ragged last block run a
second, masked loop.  Masks are loaded only when present (constexpr flags).

Numerics.  Exact fp32 (fp32 inputs without tf32: PRECISE, where the oracle bound is tightest):
the head-dim contractions (q.k, do.v) are fp64 dots (exact products, fp64 sums; fp64 mma.sync),
the scores kept in fp64 in natural units until the row max / lse is subtracted, then
exp2((s - m) * log2(e)) in fp32 (_dot_hd, _exp_sub); each block's p@v / ds@k / ... product is
summed on its own before it is added to the accumulator (a plain dot accumulates sequentially:
the GPU's exact-fp32 FMA dot, and numpy's matmul under the interpreter, err ~1.5-2x more than
torch's CPU matmul for D = 256, which made 14% of fresh draws fail the oracle on grad q/k/v);
backward renormalises p and takes delta = rowsum(p * dp) from a first pass, both summed in fp64
(_row_sums), and keeps the gradient of a p that rounds to 1 (_ds).  fp16 /
bf16 (and tf32) keep FlashAttention-2 arithmetic (log2(e) folded into the scale, one FMA per score
when compiled): their error is dominated by the fp16 / bf16 roundings.  Values rounded to the
input dtype (the stores of out, dq, dk, dv; p and ds as dot operands) go through
kernels/common.py's ``cast_out``: round to nearest even under the interpreter too (its fp32 ->
bf16 cast truncates, which biased bf16 results by up to 1 ulp), so the interpreter models the GPU.

Configuration: on a GPU a small autotuned list per head-dim class (BLOCK_M 128 x BLOCK_N 64 and
neighbours for the forward, num_warps 4-8, num_stages 2-4); under TRITON_INTERPRET=1 one fixed
config (``INTERPRETER_CONFIG``), and bf16 dot operands are cast to fp32 there (bf16 tl.dot is
wrong in the interpreter; triton-lang/triton#11584).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import (autotune, cast_out, cdiv, device_guard, dot, first_config_unless_tuning,
                                             imax, imin, next_power_of_2, sm_count)
from transformer_fast.kernels.layout import empty_in_layout_of
from transformer_fast.kernels.philox import dropout_keep_rows, dropout_scale, dropout_threshold, load_rng_if

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# (BLOCK_M, BLOCK_N) per kernel under the interpreter.  The dk/dv kernel deliberately uses
# BLOCK_N > BLOCK_M and the others BLOCK_M > BLOCK_N so both orientations of the causal-range
# arithmetic are exercised by the CPU tests.  Tests may change these.
INTERPRETER_CONFIG = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
# Tests may force the GQA split of the dk/dv kernel (None: heuristic) and the int64 offsets path.
FORCE_GQA_SPLIT = None
FORCE_OFF64 = False
# Tests may force the arithmetic: True = PRECISE (natural-unit scores and dO.v^T as fp64 dots,
# the scores kept in fp64 until the max / lse is subtracted, per-block products summed before
# accumulation, delta and the row sums in fp64), False = FlashAttention-2 style; None: PRECISE
# for exact fp32 (fp32 inputs without tf32), whose oracle bound is tight.
FORCE_PRECISE = None


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _dot_hd(a, b, M: tl.constexpr, N: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
            PRECISE: tl.constexpr):
    """a (M, BLOCK_D) @ b (BLOCK_D, N), a contraction over the head dim: fp32, or with PRECISE
    (exact fp32 inputs) an fp64 dot: the fp32 products are exact in fp64 and their sum errs by
    ~2^-53, so the result is the exact score before any rounding (fp64 mma.sync on sm_80 / sm_90,
    whose fp64 tensor-core rate matches the fp32 FMA rate an exact fp32 dot runs at).  The scores
    stay in fp64 until the row max / lse is subtracted (_exp_sub): rounding a score of ~60 to
    fp32 moves its probability by up to 2^-24 x 60 relative, and with such logits (scale 1.5-2,
    D 40-64) that alone put 0.3-1.2% of fresh draws past the oracle on dq / dk, where the fp32
    reference happened to round its own scores more kindly (benchmarks/NOTES.md, 2026-12-01).
    dp = dO.v^T takes the same dot, rounded to fp32 by the caller."""
    if PRECISE:
        return tl.dot(a.to(tl.float64), b.to(tl.float64))
    else:
        return dot(a, b, tl.zeros([M, N], dtype=tl.float32), DOT_FP32, IEEE)


@triton.jit
def _dot_acc(a, b, acc, PRECISE: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b.  PRECISE: the block's product is summed on its own and then added (two-level
    summation over the sequence; a dot chained through ``acc`` accumulates the whole sequence
    sequentially)."""
    if PRECISE:
        return acc + dot(a, b, tl.zeros_like(acc), DOT_FP32, IEEE)
    else:
        return dot(a, b, acc, DOT_FP32, IEEE)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    # x.to(dtype), rounding to nearest even also under the interpreter (whose fp32 -> bf16 cast
    # truncates), so that what the interpreter computes models the GPU.
    return cast_out(x, dtype, INTERPRET)


@triton.jit
def _exp_sub(s, m, PRECISE: tl.constexpr):
    """exp(s - m) for scores and a row max / logsumexp ``m`` in the kernel's units.

    PRECISE (fp32 inputs): natural units, s (and the running max) in fp64; the difference is
    taken first, in fp64, and only then rounded to fp32 and converted to base 2, so the large
    terms cancel before any rounding: for the dominant probabilities |s - m| is small and so is
    the error of exp2((s - m) * log2(e)).  Otherwise (fp16 / bf16, FlashAttention-2 style) s and
    m are already in the log2 domain (log2(e) folded into the scale): one subtraction, or a
    single FMA with the scaling when compiled."""
    if PRECISE:
        return tl.exp2((s - m).to(tl.float32) * 1.4426950408889634)
    else:
        return tl.exp2(s - m)


@triton.jit
def _to_log2(x):
    """x * log2(e) for x in natural units, a finite x saturating at +-FLT_MAX rather than
    overflowing to +-inf: a finite float mask past FLT_MAX / log2(e) (torch.finfo(dtype).min, the
    usual "masked" bias) then leaves its row finite and uniform, as torch's, instead of dead."""
    y = x * 1.4426950408889634
    return tl.where(tl.abs(x) <= 3.4028234663852886e38,
                    tl.minimum(tl.maximum(y, -3.4028234663852886e38), 3.4028234663852886e38), y)


@triton.jit
def _mask_scores(s, om, on, Lq, Lk, AMh, s_amm, s_amn, KPMb, s_kpn,
                 BOUNDS: tl.constexpr, CAUSAL: tl.constexpr,
                 MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, OFF64: tl.constexpr,
                 PRECISE: tl.constexpr):
    """Apply the masks to scores ``s`` (natural units if PRECISE, else log2 domain).  ``om`` / ``on`` are the query / key indices
    broadcastable to s's shape (either orientation: (M,1)/(1,N) or (1,M)/(N,1))."""
    if MASK_KIND != 0:
        if OFF64:
            am_ptrs = AMh + om.to(tl.int64) * s_amm + on.to(tl.int64) * s_amn
        else:
            am_ptrs = AMh + om * s_amm + on * s_amn
    if MASK_KIND == 2:  # float, added (scaled into the log2 domain unless PRECISE)
        am = tl.load(am_ptrs, mask=(om < Lq) & (on < Lk), other=0.0)
        if PRECISE:
            s = s + am.to(tl.float32)
        else:
            s = s + _to_log2(am.to(tl.float32))
    if MASK_KIND == 1:  # bool (as uint8), True = takes part
        am = tl.load(am_ptrs, mask=(om < Lq) & (on < Lk), other=0)
        s = tl.where(am != 0, s, float("-inf"))
    if HAS_KPM:  # (uint8) True = padding
        pad = tl.load(KPMb + on * s_kpn, mask=on < Lk, other=1)
        s = tl.where(pad == 0, s, float("-inf"))
    if BOUNDS:
        s = tl.where(on < Lk, s, float("-inf"))
    if CAUSAL:
        s = tl.where(on <= om, s, float("-inf"))
    return s


# ---------------------------------------------------------------------------------------------
# key_padding_mask ranges


@triton.jit
def _kpm_ranges_kernel(KPM, s_kpb, s_kpn, KVR, KCNT, Lk, NEED_KCNT: tl.constexpr, BLOCK: tl.constexpr):
    """Row b of key_padding_mask (uint8, True = padding) summarised for the attention kernels:
    KVR[b] = (first valid key, one past the last valid key, end of the run of valid keys that
    starts at the first), (0, 0, 0) for a row of padding only; with NEED_KCNT, KCNT[b, j] (of
    (B, Lk + 1)) = the number of valid keys before key j.  One program per batch row, in order
    over chunks of BLOCK keys (the first valid key is final by the chunk that holds it, so the
    run's end is the first padding after it)."""
    b64 = tl.program_id(0).to(tl.int64)
    row = KPM + b64 * s_kpb
    offs = tl.arange(0, BLOCK)
    first = tl.full([], 0, tl.int32) + Lk
    last = tl.full([], 0, tl.int32)
    run_end = tl.full([], 0, tl.int32) + Lk
    count = tl.full([], 0, tl.int32)
    for c0 in range(0, Lk, BLOCK):
        idx = c0 + offs
        ok = idx < Lk
        pad = tl.load(row + idx.to(tl.int64) * s_kpn, mask=ok, other=1) != 0
        valid = ok & (pad == 0)
        first = tl.minimum(first, tl.min(tl.where(valid, idx, Lk), 0))
        last = tl.maximum(last, tl.max(tl.where(valid, idx + 1, 0), 0))
        run_end = tl.minimum(run_end, tl.min(tl.where(ok & pad & (idx > first), idx, Lk), 0))
        if NEED_KCNT:
            v32 = valid.to(tl.int32)
            tl.store(KCNT + b64 * (Lk + 1) + 1 + idx, count + tl.cumsum(v32, 0), mask=ok)
            count = count + tl.sum(v32, 0)
    if NEED_KCNT:
        tl.store(KCNT + b64 * (Lk + 1), 0)
    none = last == 0
    tl.store(KVR + 3 * b64, tl.where(none, 0, first))
    tl.store(KVR + 3 * b64 + 1, last)
    tl.store(KVR + 3 * b64 + 2, tl.where(none, 0, tl.minimum(run_end, last)))


def kpm_ranges(kpm_u8: torch.Tensor, need_kcnt: bool):
    """``(kvr, kcnt)`` of _kpm_ranges_kernel for a (B, Lk) uint8 key_padding_mask: kvr (B, 3)
    int32, kcnt (B, Lk + 1) int32 or None.  One launch, no host sync."""
    B, Lk = kpm_u8.shape
    kvr = torch.empty((B, 3), dtype=torch.int32, device=kpm_u8.device)
    kcnt = torch.empty((B, Lk + 1), dtype=torch.int32, device=kpm_u8.device) if need_kcnt else kvr
    block = min(next_power_of_2(max(Lk, 1)), 64 if _INTERPRET else 1024)
    with device_guard(kpm_u8):
        _kpm_ranges_kernel[(B,)](kpm_u8, *kpm_u8.stride(), kvr, kcnt, Lk, NEED_KCNT=need_kcnt, BLOCK=block)
    return kvr, (kcnt if need_kcnt else None)


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _kpm_blocks(KVR, b, hi, full, BLOCK_N: tl.constexpr):
    """Key-block ranges of batch row b under a key_padding_mask (KVR of _kpm_ranges_kernel), given
    the block bounds without it (hi: one past the last block visited; full: blocks [0, full) need
    no causal or bounds mask): [lo, a) and [c, hi) are masked, [a, c) lies inside the run of
    valid keys and in [0, full) and needs no mask; lo <= a <= c, any of the ranges may be empty."""
    kv_lo = tl.load(KVR + 3 * b)
    kv_hi = tl.load(KVR + 3 * b + 1)
    kv_run = tl.load(KVR + 3 * b + 2)
    lo = kv_lo // BLOCK_N
    hi = imin(hi, tl.cdiv(kv_hi, BLOCK_N))
    a = imax(imin(tl.cdiv(kv_lo, BLOCK_N), hi), lo)
    c = imax(imin(imin(full, kv_run // BLOCK_N), hi), a)
    return lo, a, c, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, offs_m, lo, hi, Lq, Lk, qk_scale,
               AMh, s_amm, s_amn, KPMb, s_kpn,
               seed_lo, seed_hi, off_lo, off_hi, drop_thr, row_base,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, DIAG: tl.constexpr, IS_CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    PRECISE: tl.constexpr, INTERPRET: tl.constexpr, FOLD_SCALE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for nb in range(lo, hi):
        n0 = nb * BLOCK_N
        offs_n = n0 + offs_nb
        if OFF64:  # in-head offsets may exceed int32
            n064 = n0.to(tl.int64)
            kt_ptrs = Kh + n064 * skn + offs_nb[None, :] * skn + offs_d[:, None]
            v_ptrs = Vh + n064 * svn + offs_nb[:, None] * svn + offs_d[None, :]
        else:  # int32 offsets: cheaper address math, no register spills
            kt_ptrs = Kh + offs_n[None, :] * skn + offs_d[:, None]
            v_ptrs = Vh + offs_n[:, None] * svn + offs_d[None, :]
        if DIAG:
            kT = tl.load(kt_ptrs, mask=(offs_n[None, :] < Lk) & d_ok[:, None], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kT = tl.load(kt_ptrs)
        else:
            kT = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        s = _dot_hd(q, kT, BLOCK_M, BLOCK_N, DOT_FP32, IEEE, PRECISE)
        if FOLD_SCALE and not (DIAG or (MASK_KIND != 0) or HAS_KPM):
            # Unmasked block, scale >= 0 in the log2 domain: the row max of the raw scores times
            # the scale (rounding is monotone), then one FMA per score inside exp2, instead of
            # a multiply per score whose result the max and the exponent both read (the
            # softmax's FP32 work is serialised with the MMAs: benchmarks/NOTES.md).
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        else:
            s = s * qk_scale
            if DIAG or (MASK_KIND != 0) or HAS_KPM:
                s = _mask_scores(s, offs_m[:, None], offs_n[None, :], Lq, Lk, AMh, s_amm, s_amn,
                                 KPMb, s_kpn, DIAG, DIAG and IS_CAUSAL, MASK_KIND, HAS_KPM, OFF64, PRECISE)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = m_new
            p = _exp_sub(s, m_use[:, None], PRECISE)
        alpha = _exp_sub(m_i, m_use, PRECISE)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep_rows(seed_lo, seed_hi, row_base + offs_m.to(tl.int64), Lk, n0, off_lo, off_hi,
                                     drop_thr, BLOCK_M, BLOCK_N, HAS_DROPOUT == 2)
            p = tl.where(keep, p, 0.0)
        if DIAG:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < Lk) & d_ok[None, :], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        acc = _dot_acc(_cast(p, v.dtype, INTERPRET), v, acc, PRECISE, DOT_FP32, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, AM, KPM, KVR, RNG,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    s_amb, s_amh, s_amm, s_amn, s_kpb, s_kpn,
    H, GROUP, Lq, Lk, qk_scale, drop_thr, drop_scale,
    LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    PRECISE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD_SCALE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n_mb = tl.cdiv(Lq, BLOCK_M)
    bh = pid // n_mb
    mb = n_mb - 1 - pid % n_mb  # the last (for causal: heaviest) query blocks first
    b = bh // H
    h = bh % H
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    m0 = mb * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b64 * sqb + h64 * sqh + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    Kh = K + b64 * skb + hk64 * skh
    Vh = V + b64 * svb + hk64 * svh
    AMh = AM
    if MASK_KIND != 0:
        AMh = AM + b64 * s_amb + h64 * s_amh
    KPMb = KPM
    if HAS_KPM:
        KPMb = KPM + b64 * s_kpb
    row_base = (b64 * H + h64) * Lq
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)

    # Key-block ranges: [0, full) needs no mask at all, [full, hi) is masked (causal diagonal and
    # the ragged last block).  Blocks beyond the diagonal are never visited.
    hi = tl.cdiv(Lk, BLOCK_N)
    full = Lk // BLOCK_N
    if IS_CAUSAL:
        hi = tl.cdiv(imin(imin(Lk, Lq), m0 + BLOCK_M), BLOCK_N)
        full = imin(full, (m0 + 1) // BLOCK_N)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRECISE:  # the running max of fp64 scores (_dot_hd)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float64)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Without a key_padding_mask: [0, full) unmasked, [full, hi) masked.  With one, only the batch
    # row's [first valid key, last valid key] range: [lo, a) and [full, hi) masked, [a, full) (the
    # blocks inside the run of valid keys from the first: a right-padded row's bar its last)
    # unmasked.
    a = 0
    if HAS_KPM:
        lo, a, full, hi = _kpm_blocks(KVR, b, hi, full, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, offs_m, lo, a, Lq, Lk,
                                   qk_scale, AMh, s_amm, s_amn, KPMb, s_kpn,
                                   seed_lo, seed_hi, off_lo, off_hi, drop_thr, row_base,
                                   HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND,
                                   HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET,
                                   FOLD_SCALE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, offs_m, a, full, Lq, Lk,
                               qk_scale, AMh, s_amm, s_amn, KPMb, s_kpn,
                               seed_lo, seed_hi, off_lo, off_hi, drop_thr, row_base,
                               HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, IS_CAUSAL, MASK_KIND,
                               False, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET,
                               FOLD_SCALE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, offs_m, full, hi, Lq, Lk,
                               qk_scale, AMh, s_amm, s_amn, KPMb, s_kpn,
                               seed_lo, seed_hi, off_lo, off_hi, drop_thr, row_base,
                               HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND,
                               HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET,
                               FOLD_SCALE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    if HAS_DROPOUT:
        out = out * drop_scale
    # lse in natural units (the logsumexp of the scaled scores).
    if PRECISE:
        lse = (m_i + tl.log(l_safe).to(tl.float64)).to(tl.float32)
    else:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = O + b64 * sob + h64 * soh + offs_m[:, None].to(tl.int64) * som + offs_d[None, :]
    tl.store(o_ptrs, _cast(out, O.dtype.element_ty, INTERPRET), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + row_base + offs_m, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _attn_bwd_delta_kernel(O, DO, DELTA, sob, soh, som, sdob, sdoh, sdom, H, Lq,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    n_mb = tl.cdiv(Lq, BLOCK_M)
    bh = pid // n_mb
    mb = pid % n_mb
    b64 = (bh // H).to(tl.int64)
    h64 = (bh % H).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + b64 * sob + h64 * soh + rows * som + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b64 * sdob + h64 * sdoh + rows * sdom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _ds(p, dp, delta, PRECISE: tl.constexpr):
    """The scores' gradient p * (dp - delta).  p == 1 (a row saturated on this key, in particular
    a single visible key) has exact gradient 0, where dp - delta would leave the rounding gap of
    two different sums (rowsum(dO * O) against dO.v): 0 there.  Not when PRECISE: its delta is
    rowsum(p * dp) summed in fp64 for these p and dp (EXACT_DELTA), which cancels on its own, and
    a p that merely rounds to 1 (a runner-up key ~17 nats below) still has a gradient that matters
    at the fp32 oracle's bound."""
    if PRECISE:
        return p * (dp - delta)
    else:
        return tl.where(p == 1.0, 0.0, p * (dp - delta))


@triton.jit
def _load_lse(LSEh, offs, ok, PRECISE: tl.constexpr):
    # The stored (natural-log) lse in the kernel's units: natural if PRECISE, else log2 domain.
    # Rows with nothing to attend to (lse = -inf) and rows past Lq get +inf, so that their
    # recomputed probabilities exp(s - lse) are exactly 0.
    lse = tl.load(LSEh + offs, mask=ok, other=float("-inf"))
    if not PRECISE:
        lse = _to_log2(lse)
        # A row whose scores all saturated at +-FLT_MAX (_to_log2 of a huge float mask) had that
        # lse; its round trip through the natural-log store can land an ulp (2^104) inside,
        # and exp2(s - lse) of the saturated scores would then be inf: snap it back.
        saturated = (tl.abs(lse) >= 3.4028e38) & (tl.abs(lse) != float("inf"))
        lse = tl.where(saturated, tl.where(lse > 0, 3.4028234663852886e38, -3.4028234663852886e38), lse)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, RINVh, DELTAh, DQAh, sqm, sdom, n0, offs_n, lo, hi, Lq, Lk, qk_scale,
                AMh, s_amm, s_amn, KPMb, s_kpn,
                seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, DIAG: tl.constexpr, IS_CAUSAL: tl.constexpr,
                MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    PRECISE: tl.constexpr, INTERPRET: tl.constexpr, REFINE_LSE: tl.constexpr,
    ATOMIC_DQ: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_mb = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    for mb in range(lo, hi):
        m0 = mb * BLOCK_M
        offs_m = m0 + offs_mb
        m_ok = offs_m < Lq
        if OFF64:
            m064 = m0.to(tl.int64)
            qT_ptrs = Qh + m064 * sqm + offs_mb[None, :] * sqm + offs_d[:, None]
            do_ptrs = DOh + m064 * sdom + offs_mb[:, None] * sdom + offs_d[None, :]
        else:
            qT_ptrs = Qh + offs_m[None, :] * sqm + offs_d[:, None]
            do_ptrs = DOh + offs_m[:, None] * sdom + offs_d[None, :]
        qT = tl.load(qT_ptrs, mask=m_ok[None, :] & d_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse = _load_lse(LSEh, offs_m, m_ok, PRECISE)
        Di = tl.load(DELTAh + offs_m, mask=m_ok, other=0.0)
        sT = _dot_hd(k, qT, BLOCK_N, BLOCK_M, DOT_FP32, IEEE, PRECISE)
        sT = sT * qk_scale
        if DIAG or (MASK_KIND != 0) or HAS_KPM:
            # No bounds mask: rows past Lq have lse = +inf (p = 0); columns past Lk only feed
            # rows of dk/dv that are not stored.
            sT = _mask_scores(sT, offs_m[None, :], offs_n[:, None], Lq, Lk, AMh, s_amm, s_amn,
                              KPMb, s_kpn, False, DIAG and IS_CAUSAL, MASK_KIND, HAS_KPM, OFF64, PRECISE)
        pT = _exp_sub(sT, lse[None, :], PRECISE)
        if REFINE_LSE:
            pT = pT * tl.load(RINVh + offs_m, mask=m_ok, other=1.0)[None, :]
        if HAS_DROPOUT:
            keep = tl.trans(dropout_keep_rows(seed_lo, seed_hi, row_base + offs_m.to(tl.int64), Lk, n0, off_lo,
                                              off_hi, drop_thr, BLOCK_M, BLOCK_N, HAS_DROPOUT == 2))  # (BN, BM)
            pdT = tl.where(keep, pT * drop_scale, 0.0)
        else:
            pdT = pT
        dv = _dot_acc(_cast(pdT, do.dtype, INTERPRET), do, dv, PRECISE, DOT_FP32, IEEE)
        dpT = _dot_hd(v, tl.trans(do), BLOCK_N, BLOCK_M, DOT_FP32, IEEE, PRECISE).to(tl.float32)
        if HAS_DROPOUT:
            dpT = tl.where(keep, dpT * drop_scale, 0.0)
        dsT = _cast(_ds(pT, dpT, Di[None, :], PRECISE), qT.dtype, INTERPRET)
        dk = _dot_acc(dsT, tl.trans(qT), dk, PRECISE, DOT_FP32, IEEE)
        if ATOMIC_DQ:
            # This key block's share of dq (unscaled), added into the fp32 accumulator: one more
            # product here instead of the dq kernel's three (it recomputes s and dp).  Keys past
            # Lk (unmasked above) can hold inf / NaN scores: their ds must be 0 here.
            dsT = tl.where(offs_n[:, None] < Lk, dsT, 0.0)
            dq_part = dot(tl.trans(dsT), k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), DOT_FP32, IEEE)
            if OFF64:
                dqa_ptrs = DQAh + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
            else:
                dqa_ptrs = DQAh + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            tl.atomic_add(dqa_ptrs, dq_part, mask=m_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, RINV, DELTA, DK, DV, DQA, AM, KPM, KCNT, RNG,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    sdks, sdkb, sdkh, sdkn, sdvs, sdvb, sdvh, sdvn,
    s_amb, s_amh, s_amm, s_amn, s_kpb, s_kpn,
    H, Hkv, GROUP, HEADS_PER_SPLIT, NSPLIT, Lq, Lk, qk_scale, scale, drop_thr, drop_scale,
    LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    PRECISE: tl.constexpr, INTERPRET: tl.constexpr, REFINE_LSE: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk, dv of one (batch, kv head, key block), over the query heads of its GQA group (or of
    its split of the group); with ATOMIC_DQ also each tile's share of dq, added into DQA (fp32,
    (B, H, Lq, HEAD_DIM) contiguous)."""
    pid = tl.program_id(0)
    n_nb = tl.cdiv(Lk, BLOCK_N)
    nb = pid % n_nb
    rest = pid // n_nb
    split = rest % NSPLIT
    bhk = rest // NSPLIT
    b = bhk // Hkv
    hk = bhk % Hkv
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    n0 = nb * BLOCK_N

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Lk
    d_ok = offs_d < HEAD_DIM
    nd_mask = n_ok[:, None] & d_ok[None, :]
    rows_n = offs_n[:, None].to(tl.int64)
    k = tl.load(K + b64 * skb + hk64 * skh + rows_n * skn + offs_d[None, :], mask=nd_mask, other=0.0)
    v = tl.load(V + b64 * svb + hk64 * svh + rows_n * svn + offs_d[None, :], mask=nd_mask, other=0.0)

    # Query-block ranges: [diag_lo, full_lo) crosses the causal diagonal (masked), [full_lo, hi)
    # sees every key of this block.  Query blocks entirely above the diagonal are not visited.
    n_mb = tl.cdiv(Lq, BLOCK_M)
    hi = n_mb
    diag_lo = 0
    full_lo = 0
    if IS_CAUSAL:
        diag_lo = imin(n0 // BLOCK_M, n_mb)
        full_lo = imin(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M), n_mb)
    KPMb = KPM
    if HAS_KPM:
        KPMb = KPM + b64 * s_kpb
        cnt_base = KCNT + b64 * (Lk + 1)
        n_valid = tl.load(cnt_base + imin(n0 + BLOCK_N, Lk)) - tl.load(cnt_base + n0)
        active = (n_valid > 0).to(tl.int32)  # a block of padding only: no work, zero gradient
        hi = hi * active
        diag_lo = diag_lo * active
        full_lo = full_lo * active

    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for gi in range(0, HEADS_PER_SPLIT):
        h = hk * GROUP + split * HEADS_PER_SPLIT + gi
        h64 = h.to(tl.int64)
        Qh = Q + b64 * sqb + h64 * sqh
        DOh = DO + b64 * sdob + h64 * sdoh
        row_base = (b64 * H + h64) * Lq
        LSEh = LSE + row_base
        RINVh = RINV + row_base
        DELTAh = DELTA + row_base
        DQAh = DQA + row_base * HEAD_DIM
        AMh = AM
        if MASK_KIND != 0:
            AMh = AM + b64 * s_amb + h64 * s_amh
        if IS_CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, RINVh, DELTAh, DQAh, sqm, sdom, n0, offs_n,
                                 diag_lo, full_lo, Lq, Lk, qk_scale, AMh, s_amm, s_amn, KPMb, s_kpn,
                                 seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND,
                                 HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET, REFINE_LSE,
                                 ATOMIC_DQ)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, RINVh, DELTAh, DQAh, sqm, sdom, n0, offs_n,
                             full_lo, hi, Lq, Lk, qk_scale, AMh, s_amm, s_amn, KPMb, s_kpn,
                             seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, IS_CAUSAL, MASK_KIND,
                             HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET, REFINE_LSE,
                             ATOMIC_DQ)

    split64 = split.to(tl.int64)
    dk_ptrs = DK + split64 * sdks + b64 * sdkb + hk64 * sdkh + rows_n * sdkn + offs_d[None, :]
    dv_ptrs = DV + split64 * sdvs + b64 * sdvb + hk64 * sdvh + rows_n * sdvn + offs_d[None, :]
    tl.store(dk_ptrs, _cast(dk * scale, DK.dtype.element_ty, INTERPRET), mask=nd_mask)
    tl.store(dv_ptrs, _cast(dv, DV.dtype.element_ty, INTERPRET), mask=nd_mask)


@triton.jit
def _p_dp_tile(q, do, lse, rinv, Kh, Vh, skn, svn, offs_m, nb, Lq, Lk, qk_scale,
               AMh, s_amm, s_amn, KPMb, s_kpn,
               seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, DIAG: tl.constexpr, IS_CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
               PRECISE: tl.constexpr, INTERPRET: tl.constexpr,
               REFINE_LSE: tl.constexpr):
    """One key block seen from a query block: k^T (BLOCK_D, BLOCK_N), the recomputed
    probabilities p (times the row factor rinv when REFINE_LSE) and dp = dO.v^T (dropout
    applied), both (BLOCK_M, BLOCK_N) fp32."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    n0 = nb * BLOCK_N
    offs_n = n0 + offs_nb
    if OFF64:
        n064 = n0.to(tl.int64)
        kt_ptrs = Kh + n064 * skn + offs_nb[None, :] * skn + offs_d[:, None]
        vt_ptrs = Vh + n064 * svn + offs_nb[None, :] * svn + offs_d[:, None]
    else:
        kt_ptrs = Kh + offs_n[None, :] * skn + offs_d[:, None]
        vt_ptrs = Vh + offs_n[None, :] * svn + offs_d[:, None]
    if DIAG:
        kv_mask = (offs_n[None, :] < Lk) & d_ok[:, None]
        kT = tl.load(kt_ptrs, mask=kv_mask, other=0.0)
        vT = tl.load(vt_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        kT = tl.load(kt_ptrs)
        vT = tl.load(vt_ptrs)
    else:
        kT = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        vT = tl.load(vt_ptrs, mask=d_ok[:, None], other=0.0)
    s = _dot_hd(q, kT, BLOCK_M, BLOCK_N, DOT_FP32, IEEE, PRECISE)
    s = s * qk_scale
    if DIAG or (MASK_KIND != 0) or HAS_KPM:
        s = _mask_scores(s, offs_m[:, None], offs_n[None, :], Lq, Lk, AMh, s_amm, s_amn,
                         KPMb, s_kpn, DIAG, DIAG and IS_CAUSAL, MASK_KIND, HAS_KPM, OFF64, PRECISE)
    p = _exp_sub(s, lse[:, None], PRECISE)
    if REFINE_LSE:
        p = p * rinv[:, None]
    dp = _dot_hd(do, vT, BLOCK_M, BLOCK_N, DOT_FP32, IEEE, PRECISE).to(tl.float32)
    if HAS_DROPOUT:
        keep = dropout_keep_rows(seed_lo, seed_hi, row_base + offs_m.to(tl.int64), Lk, n0, off_lo, off_hi,
                                 drop_thr, BLOCK_M, BLOCK_N, HAS_DROPOUT == 2)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    return kT, p, dp


@triton.jit
def _dq_inner(dq, q, do, lse, rinv, Di, Kh, Vh, skn, svn, offs_m, lo, hi, Lq, Lk, qk_scale,
              AMh, s_amm, s_amn, KPMb, s_kpn,
              seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, DIAG: tl.constexpr, IS_CAUSAL: tl.constexpr,
              MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
              PRECISE: tl.constexpr, INTERPRET: tl.constexpr,
              REFINE_LSE: tl.constexpr):
    for nb in range(lo, hi):
        kT, p, dp = _p_dp_tile(q, do, lse, rinv, Kh, Vh, skn, svn, offs_m, nb, Lq, Lk, qk_scale,
                               AMh, s_amm, s_amn, KPMb, s_kpn,
                               seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                               HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DIAG, IS_CAUSAL, MASK_KIND,
                               HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET,
                               REFINE_LSE)
        ds = _ds(p, dp, Di[:, None], PRECISE)
        dq = _dot_acc(_cast(ds, kT.dtype, INTERPRET), tl.trans(kT), dq, PRECISE, DOT_FP32, IEEE)
    return dq


@triton.jit
def _row_sums(q, do, lse, Kh, Vh, skn, svn, offs_m, lo, hi, Lq, Lk, qk_scale,
              AMh, s_amm, s_amn, KPMb, s_kpn,
              seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
              MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
              PRECISE: tl.constexpr, INTERPRET: tl.constexpr):
    """rowsum(p) and rowsum(p * dp) over key blocks [lo, hi) (masked loop), p = exp(s - lse)
    from the stored lse: the row's normalisation (1 up to the fp32 lse's rounding) and delta
    for those p."""
    # (in fp64 when PRECISE: delta and the renormalisation are then exact for the p and dp the
    # gradients use, so that dp - delta cancels as the reference's softmax backward does)
    SUM_TYPE: tl.constexpr = tl.float64 if PRECISE else tl.float32
    psum = tl.zeros([BLOCK_M], dtype=SUM_TYPE)
    pdp = tl.zeros([BLOCK_M], dtype=SUM_TYPE)
    for nb in range(lo, hi):  # (REFINE_LSE False: _p_dp_tile ignores its rinv, passed as lse)
        _, p, dp = _p_dp_tile(q, do, lse, lse, Kh, Vh, skn, svn, offs_m, nb, Lq, Lk, qk_scale,
                              AMh, s_amm, s_amn, KPMb, s_kpn,
                              seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                              HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND,
                              HAS_KPM, HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET,
                              False)
        psum += tl.sum(p.to(SUM_TYPE), 1)
        pdp += tl.sum(p.to(SUM_TYPE) * dp.to(SUM_TYPE), 1)
    return psum, pdp


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, RINV, DELTA, DQ, AM, KPM, KVR, RNG,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
    s_amb, s_amh, s_amm, s_amn, s_kpb, s_kpn,
    H, GROUP, Lq, Lk, qk_scale, scale, drop_thr, drop_scale,
    LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    PRECISE: tl.constexpr, INTERPRET: tl.constexpr, EXACT_DELTA: tl.constexpr,
    REFINE_LSE: tl.constexpr, ROW_SUMS_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dq of one (batch, head, query block), after the row sums of REFINE_LSE / EXACT_DELTA
    (below); ROW_SUMS_ONLY: those sums alone, for a dk/dv kernel that adds up dq itself."""
    pid = tl.program_id(0)
    n_mb = tl.cdiv(Lq, BLOCK_M)
    bh = pid // n_mb
    mb = n_mb - 1 - pid % n_mb
    b = bh // H
    h = bh % H
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    m0 = mb * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    md_mask = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + b64 * sqb + h64 * sqh + rows * sqm + offs_d[None, :], mask=md_mask, other=0.0)
    do = tl.load(DO + b64 * sdob + h64 * sdoh + rows * sdom + offs_d[None, :], mask=md_mask, other=0.0)
    row_base = (b64 * H + h64) * Lq
    lse = _load_lse(LSE + row_base, offs_m, m_ok, PRECISE)

    Kh = K + b64 * skb + hk64 * skh
    Vh = V + b64 * svb + hk64 * svh
    AMh = AM
    if MASK_KIND != 0:
        AMh = AM + b64 * s_amb + h64 * s_amh
    KPMb = KPM
    if HAS_KPM:
        KPMb = KPM + b64 * s_kpb
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)

    hi = tl.cdiv(Lk, BLOCK_N)
    full = Lk // BLOCK_N
    if IS_CAUSAL:
        hi = tl.cdiv(imin(imin(Lk, Lq), m0 + BLOCK_M), BLOCK_N)
        full = imin(full, (m0 + 1) // BLOCK_N)

    lo = 0
    a = 0
    if HAS_KPM:  # the batch row's [first valid key, last valid key] as in the forward
        lo, a, full, hi = _kpm_blocks(KVR, b, hi, full, BLOCK_N)
    # One pass over the row's key blocks writes, for the dk/dv kernel that runs after this one:
    # REFINE_LSE: rinv = 1 / rowsum(exp(s - lse)).  The stored fp32 lse is off by up to
    # |lse| x 2^-24, which every recomputed p of the row inherits (with large logits several
    # times the fp32 reference's error; uncancelled in an EXACT_DELTA delta); rinv renormalises.
    # EXACT_DELTA (short rows): delta = rowsum(p * dp).  rowsum(dO * O) with O rounded to 16 bits
    # errs by about as much as the reference's whole gradient when a row has few keys.
    rinv = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if REFINE_LSE or EXACT_DELTA:
        psum, pdp = _row_sums(q, do, lse, Kh, Vh, skn, svn, offs_m, lo, hi, Lq, Lk, qk_scale,
                              AMh, s_amm, s_amn, KPMb, s_kpn,
                              seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                              HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND, HAS_KPM,
                              HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET)
        rinv_sum = tl.full([BLOCK_M], 1.0, dtype=psum.dtype)
        if REFINE_LSE:
            rinv_sum = 1.0 / tl.where(psum > 0.0, psum, 1.0)  # (fp64 if PRECISE); an empty row: no 1 / 0
            rinv = rinv_sum.to(tl.float32)
            tl.store(RINV + row_base + offs_m, rinv, mask=m_ok)
    if EXACT_DELTA:  # every block through the masked loop, as _row_sums computed p
        a = lo
        full = lo
        Di = (pdp * rinv_sum).to(tl.float32)  # rowsum(p * dp) of the p the gradients use
        tl.store(DELTA + row_base + offs_m, Di, mask=m_ok)
    else:
        Di = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)

    if not ROW_SUMS_ONLY:
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if HAS_KPM:  # [lo, a): blocks before the run of valid keys, masked
            dq = _dq_inner(dq, q, do, lse, rinv, Di, Kh, Vh, skn, svn, offs_m, lo, a, Lq, Lk, qk_scale,
                           AMh, s_amm, s_amn, KPMb, s_kpn,
                           seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                           HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND, HAS_KPM,
                           HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET, REFINE_LSE)
        # [a, full): full blocks, no mask code
        dq = _dq_inner(dq, q, do, lse, rinv, Di, Kh, Vh, skn, svn, offs_m, a, full, Lq, Lk, qk_scale,
                       AMh, s_amm, s_amn, KPMb, s_kpn,
                       seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                       HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, IS_CAUSAL, MASK_KIND, False,
                       HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET, REFINE_LSE)
        dq = _dq_inner(dq, q, do, lse, rinv, Di, Kh, Vh, skn, svn, offs_m, full, hi, Lq, Lk, qk_scale,
                       AMh, s_amm, s_amn, KPMb, s_kpn,
                       seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, row_base,
                       HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, IS_CAUSAL, MASK_KIND, HAS_KPM,
                       HAS_DROPOUT, DOT_FP32, IEEE, OFF64, PRECISE, INTERPRET, REFINE_LSE)

        dq_ptrs = DQ + b64 * sdqb + h64 * sdqh + rows * sdqm + offs_d[None, :]
        tl.store(dq_ptrs, _cast(dq * scale, DQ.dtype.element_ty, INTERPRET), mask=md_mask)


# ---------------------------------------------------------------------------------------------
# Configuration (GPU: a pruned autotune list; interpreter: one fixed config)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head-dim class (BLOCK_D <= 64, 128, 256).
# Chosen from ptxas register reports of Triton 3.6 for sm_90a (bf16, causal): the first entries
# of each list compile without register spills (D=256 spills a little in every shape tried).
# The D=128 lists' later entries (2026-11-26, before any of them was timed) are the larger tiles
# that also compile for sm_90a without spills, all on wgmma (Triton 3.6, bf16, dense: forward
# 128x128 at 250/254 registers, 64x64 x 4 stages at 166; dk/dv holding 128 keys at 218/255; dq
# 64x32 on 4 warps at 152, 128x64 x 3 stages at 211); their 4-warp neighbours with 128-wide
# tiles spill 200-730 bytes and were left out.  Which wins is for the autotuner on the GPU: the
# first GPU run measured the forward at 0.65x and forward+backward at 0.47x torch's SDPA.
_FWD_CONFIGS = {
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3),
          (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 4)],
    256: [(64, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2)],
}
# Few query rows (decoding, short sequences): small BLOCK_M.
_FWD_SMALL_M = [(16, 128, 4, 3), (16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3)]
# dk/dv: BLOCK_N keys held (dk, dv accumulators), BLOCK_M queries streamed.
_DKDV_CONFIGS = {
    64: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3)],
    128: [(32, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (128, 32, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2)],
    256: [(32, 32, 8, 2), (16, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2)],
}
# dq: BLOCK_M queries held, BLOCK_N keys streamed.
_DQ_CONFIGS = {
    64: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2)],
    128: [(128, 64, 8, 2), (64, 64, 8, 3), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 3)],
    256: [(16, 64, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2), (32, 64, 8, 1)],
}
# fp32 inputs (tf32 or exact "ieee" FMA dots) need smaller tiles: fp32 operands double the
# registers and shared memory of a tile (the bf16 lists spill heavily or exceed shared memory).
_FP32_CONFIGS = {
    "fwd": [(64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (64, 32, 4, 2)],
    "dkdv": [(32, 32, 8, 2), (16, 32, 4, 2), (32, 16, 4, 2), (64, 32, 8, 2)],
    "dq": [(64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (64, 64, 8, 3)],
}
# Exact fp32 (PRECISE) past BLOCK_D 64: the float64 dot operands spill the lists above (Triton 3.8,
# sm_90, compile_check --resources, no mask / float mask + padding + dropout: dk/dv (32, 32, 8, 2)
# 288 / 496 bytes at BLOCK_D 128 and 2112 at 256, (16, 32, 4, 2) 880 / 1224 at 256; dq
# (32, 32, 4, 2) 512 at 256; the forward's (64, 32, 4, 2) 280 / 11648 at 256).  These lists keep
# what compiles without spills in both (dk/dv (64, 16, 8, 2) at 128 and (32, 16, 4, 2) at 256:
# 160 and 40 bytes with the mask), fewer keys held per dk/dv program and fewer queries per dq one.
_FP32_EXACT_WIDE = {
    128: {"dkdv": [(32, 16, 8, 2), (32, 16, 4, 2), (16, 32, 8, 2), (64, 16, 8, 2)]},
    256: {"fwd": [(64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)],
          "dkdv": [(32, 16, 8, 2), (32, 16, 4, 2)],
          "dq": [(16, 32, 8, 2), (16, 32, 4, 2), (32, 16, 8, 2), (16, 16, 8, 2)]},
}


def _is_fp32(args) -> bool:
    return args["Q"].dtype == torch.float32


def _fp32_wanted(kind: str, args) -> list:
    if args.get("PRECISE", False) and args["BLOCK_D"] > 64:
        return _FP32_EXACT_WIDE[_dclass(args["BLOCK_D"])].get(kind, _FP32_CONFIGS[kind])
    return _FP32_CONFIGS[kind]


def _dclass(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


def _as_configs(rows):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in rows]


def _all_configs(table, extra=()):
    seen, rows = set(), []
    for lst in list(table.values()) + [list(extra)]:
        for r in lst:
            if r not in seen:
                seen.add(r)
                rows.append(r)
    return _as_configs(rows)


def _key(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


# Shared memory.  A config whose kernel needs more shared memory than the device gives one block
# fails at launch (OutOfResources): the autotuner skips it when it times several, but with
# TRANSFORMER_FAST_AUTOTUNE=0 the one config kept must fit (the first GPU run, H200: the forward's
# (16, 128, 4, 3) small-Lq config at BLOCK_D = 256 needs 274432 bytes, sm_90 gives 232448).  So
# the pruning drops configs whose estimate exceeds the device's limit.  The estimate is an upper
# bound of Triton's allocation, fitted to `metadata.shared` of the configs of the lists below
# (Triton 3.8, sm_90, no mask / float mask + padding + dropout): exact for several, never under.
# Last refitted on 2026-12-02, when exact fp32's float64 dots had put it up to 36% under: 95 bf16
# compiles (D 64 / 128 / 256, L 1024 and 64, both backward schedules) at 1.00-2.03x, 144 fp32
# ones (tf32 and exact) at 1.00-1.51x.  Streamed
# tiles take max(num_stages - 1, 1) buffers; one more tile of the streamed operand, the held
# tile, the fp32 accumulator, (with an attn_mask) a (BLOCK_M, BLOCK_N) fp32 tile per buffer and
# (grouped dropout) one more.
SMEM_DEFAULT_LIMIT = 232448  # sm_90 (H100 / H200) opt-in maximum per block; also meta tensors


def _smem_estimate(kind: str, c, args) -> int:
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    bd, es = args["BLOCK_D"], args["Q"].element_size()
    st = max(c.num_stages - 1, 1)
    if kind == "fwd":  # streams K^T, V (BLOCK_N x BLOCK_D); holds q, acc (BLOCK_M x BLOCK_D)
        est = st * 2 * bn * bd * es + bn * bd * es + bm * bd * (es + 2)
    elif kind == "dq":  # streams K^T, V^T; holds q, dO, dq; (short rows) the row sums' scratch
        est = st * 2 * bn * bd * es + bn * bd * es + bm * bd * (es + 4) + 1024
    else:  # dkdv: streams q^T, dO (BLOCK_M x BLOCK_D); holds k, v, dk, dv (BLOCK_N x BLOCK_D)
        est = st * 2 * bm * bd * es + bm * bd * es + bn * bd * (2 * es + 4) + 1024
        if args.get("ATOMIC_DQ", False):  # the dq product's operands: k once more, ds (Triton 3.8)
            est += bn * bd * es + bm * bn * es
    if es == 4:
        # fp32 (tf32 or exact dots), fitted on 2026-12-02 to every _FP32_CONFIGS entry at BLOCK_D
        # 64 / 128 / 256, no mask and float mask + padding + dropout (Triton 3.8, sm_90; 3.6 gives
        # the same): the terms above came in up to 36% under it.  Exact (PRECISE): the float64
        # dot operands (dq: q, +bm*bd*8; dk/dv: the streamed and held tiles' conversions); the
        # forward's score tile through shared memory at BLOCK_M 64; tf32 dq's accumulator
        # conversion at BLOCK_M 64.
        precise = args.get("PRECISE", False)
        if kind == "fwd":
            est += bm * bn * 4 + 256
        elif kind == "dq":
            est += bm * bd * (8 if precise else 2)
        elif precise:
            est += 2 * (bm + bn) * bd
    if args.get("MASK_KIND", 0):
        est += st * bm * bn * 4
    if args.get("HAS_DROPOUT", 0) == 2:
        # dropout_keep_rows' interleave of the words back into the score layout goes through a
        # scratch tile (Triton 3.6, sm_90: +16 KB at 128 x 64 forward, +32 KB dq / dk-dv).
        est += bm * bn * 4
    return est


@functools.lru_cache(maxsize=None)
def _smem_limit_of(index: int) -> int:
    try:  # what Triton checks at launch: CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001  (the per-SM figure less the 1 KB the driver reserves)
        try:
            return int(torch.cuda.get_device_properties(index).shared_memory_per_multiprocessor) - 1024
        except Exception:  # noqa: BLE001
            return SMEM_DEFAULT_LIMIT


def _smem_limit(t) -> int:
    if isinstance(t, torch.Tensor) and t.is_cuda:
        index = t.device.index
        return _smem_limit_of(torch.cuda.current_device() if index is None else index)
    return SMEM_DEFAULT_LIMIT


def _pick(configs, wanted, kind=None, args=None):
    """The configs of ``wanted``, in its order of preference (the first is the one kept with
    TRANSFORMER_FAST_AUTOTUNE=0), less those whose shared memory (estimated for ``kind``) does
    not fit the device; when none fits, the one with the smallest estimate."""
    by_key = {_key(c): c for c in configs}
    out = [by_key[w] for w in dict.fromkeys(wanted) if w in by_key]
    if out and kind is not None:
        limit = _smem_limit(args.get("Q"))
        fits = [c for c in out if _smem_estimate(kind, c, args) <= limit]
        out = fits or [min(out, key=lambda c: _smem_estimate(kind, c, args))]
    return first_config_unless_tuning(out or configs[:1])


def _prune_fwd(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    if _is_fp32(args):
        return _pick(configs, _fp32_wanted("fwd", args), "fwd", args)
    wanted = list(_FWD_CONFIGS[_dclass(args["BLOCK_D"])])
    lq = args["LQ_KEY"]
    if lq < 128:
        wanted = [r for r in wanted + _FWD_SMALL_M if r[0] <= max(16, lq)]
        if args["BLOCK_D"] > 128:
            wanted = [r for r in wanted if r[0] * r[1] <= 64 * 64]
    return _pick(configs, wanted, "fwd", args)


def _prune_dkdv(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    wanted = _fp32_wanted("dkdv", args) if _is_fp32(args) else _DKDV_CONFIGS[_dclass(args["BLOCK_D"])]
    lk = args["LK_KEY"]
    small = [r for r in wanted if r[1] <= max(32, lk)]
    return _pick(configs, small or wanted, "dkdv", args)


def _prune_dq(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    wanted = _fp32_wanted("dq", args) if _is_fp32(args) else _DQ_CONFIGS[_dclass(args["BLOCK_D"])]
    lq = args["LQ_KEY"]
    small = [r for r in wanted if r[0] <= max(32, lq)]
    return _pick(configs, small or wanted, "dq", args)


def _fp32_rows(kind: str) -> list:
    return _FP32_CONFIGS[kind] + [r for wide in _FP32_EXACT_WIDE.values() for r in wide.get(kind, ())]


# Every config an autotuner may keep (its pruning picks the list for the call's arguments).
FWD_TUNE_CONFIGS = _all_configs(_FWD_CONFIGS, _FWD_SMALL_M + _fp32_rows("fwd"))
DKDV_TUNE_CONFIGS = _all_configs(_DKDV_CONFIGS, _fp32_rows("dkdv"))
DQ_TUNE_CONFIGS = _all_configs(_DQ_CONFIGS, _fp32_rows("dq"))

_TUNE_KEY = ["LQ_KEY", "LK_KEY", "HEAD_DIM", "IS_CAUSAL", "MASK_KIND", "HAS_KPM", "HAS_DROPOUT", "IEEE",
             "OFF64", "PRECISE"]

if _INTERPRET:
    _fwd = _attn_fwd_kernel
    _dkdv = _attn_bwd_dkdv_kernel
    _dq = _attn_bwd_dq_kernel
else:
    _fwd = autotune(configs=FWD_TUNE_CONFIGS, key=_TUNE_KEY,
                    prune_configs_by={"early_config_prune": _prune_fwd})(_attn_fwd_kernel)
    # reset_to_zero: the timed runs of each config add dq into DQA (ATOMIC_DQ); it is zeroed before
    # each and once more before the call's own run.
    _dkdv = autotune(configs=DKDV_TUNE_CONFIGS,
                     key=_TUNE_KEY + ["HEADS_PER_SPLIT", "ATOMIC_DQ"], reset_to_zero=["DQA"],
                     prune_configs_by={"early_config_prune": _prune_dkdv})(_attn_bwd_dkdv_kernel)
    _dq = autotune(configs=DQ_TUNE_CONFIGS, key=_TUNE_KEY + ["ROW_SUMS_ONLY"],
                   prune_configs_by={"early_config_prune": _prune_dq})(_attn_bwd_dq_kernel)


def _interp_meta(which: str) -> dict:
    bm, bn = INTERPRETER_CONFIG[which]
    return {"BLOCK_M": bm, "BLOCK_N": bn}


# ---------------------------------------------------------------------------------------------
# Launchers


def _span(t: torch.Tensor, dim: int) -> int:
    """Largest element offset inside one slice ``t[i0, ..., i_{dim-1}]`` (dims ``dim`` onward)."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape[dim:], t.stride()[dim:]))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bucket(n: int) -> int:
    return next_power_of_2(max(int(n), 1))


class _Common:
    """Shapes, mask arguments and constexpr flags shared by forward and backward."""

    def __init__(self, q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng,
                 allow_tf32, need_kcnt=False):
        assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "q, k, v must be (B, H, L, D)"
        B, H, Lq, D = q.shape
        Bk, Hkv, Lk, Dk = k.shape
        assert Bk == B and Dk == D and tuple(v.shape) == (B, Hkv, Lk, D), "q/k/v shape mismatch"
        assert Hkv >= 1 and H % Hkv == 0, "Hkv must divide H"
        assert k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share a dtype"
        assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
        assert 1 <= D <= 256, "head dim must be <= 256"
        assert k.device == q.device and v.device == q.device
        self.B, self.H, self.Hkv, self.Lq, self.Lk, self.D = B, H, Hkv, Lq, Lk, D
        self.group = H // Hkv
        self.block_d = max(16, next_power_of_2(D))
        self.scale = float(scale)
        self.ieee = q.dtype == torch.float32 and not allow_tf32
        self.precise = self.ieee if FORCE_PRECISE is None else bool(FORCE_PRECISE)
        # Scores in the kernels: natural units when precise, else log2(e) folded into the scale.
        self.qk_scale = float(scale) if self.precise else float(scale) * LOG2E
        self.is_causal = bool(is_causal)
        self.dot_fp32 = _INTERPRET and q.dtype == torch.bfloat16
        dummy = q

        # attn_mask
        if attn_mask is None:
            self.mask_kind, self.am, self.am_strides = 0, dummy, (0, 0, 0, 0)
        else:
            assert tuple(attn_mask.shape) == (B, H, Lq, Lk), "attn_mask must be expanded to (B, H, Lq, Lk)"
            assert attn_mask.device == q.device
            if attn_mask.dtype == torch.bool:
                self.mask_kind, self.am = 1, attn_mask.view(torch.uint8)
            else:
                assert attn_mask.is_floating_point(), attn_mask.dtype
                self.mask_kind, self.am = 2, attn_mask
            self.am_strides = tuple(self.am.stride())

        # key_padding_mask: (B, Lk) bool, True = padding
        self.kcnt = None
        if key_padding_mask is None:
            self.has_kpm, self.kpm, self.kpm_strides, self.kvr = False, dummy, (0, 0), dummy
        else:
            kpm = key_padding_mask
            assert tuple(kpm.shape) == (B, Lk) and kpm.dtype == torch.bool and kpm.device == q.device
            self.has_kpm = True
            self.kpm = kpm.view(torch.uint8)
            self.kpm_strides = tuple(self.kpm.stride())
            self.kvr, self.kcnt = kpm_ranges(self.kpm, need_kcnt)

        # dropout; HAS_DROPOUT = drop_mode: 0 none, 1 one Philox block per score, 2 one per 4
        # adjacent keys (rows of Lk % 4 == 0 keys: dropout_keep_rows)
        self.has_dropout = dropout_p > 0.0
        self.drop_mode = (2 if Lk % 4 == 0 else 1) if self.has_dropout else 0
        if self.has_dropout:
            assert rng is not None and rng.dtype == torch.int64 and rng.numel() >= 2 and rng.device == q.device
            self.rng = rng.contiguous()
            self.drop_thr = int(dropout_threshold(dropout_p))
            self.drop_scale = float(dropout_scale(dropout_p))
        else:
            self.rng, self.drop_thr, self.drop_scale = dummy, 0, 1.0

        self.lq_key = _bucket(Lq)
        self.lk_key = _bucket(Lk)
        # Offsets inside one (batch, head) slice fit int32 (the fast path) unless told otherwise.
        self.max_offset = max(_span(q, 2), _span(k, 2), _span(v, 2))
        if attn_mask is not None:
            self.max_offset = max(self.max_offset, (Lq - 1) * abs(self.am_strides[2])
                                  + (Lk - 1) * abs(self.am_strides[3]))
        if key_padding_mask is not None:
            self.max_offset = max(self.max_offset, (Lk - 1) * abs(self.kpm_strides[1]))

    def add_tensor(self, t):
        self.max_offset = max(self.max_offset, _span(t, 2))

    def flags(self):
        return dict(HEAD_DIM=self.D, BLOCK_D=self.block_d, IS_CAUSAL=self.is_causal,
                    MASK_KIND=self.mask_kind, HAS_KPM=self.has_kpm, HAS_DROPOUT=self.drop_mode,
                    DOT_FP32=self.dot_fp32, IEEE=self.ieee,
                    OFF64=FORCE_OFF64 or self.max_offset >= 2**31 - 1,
                    PRECISE=self.precise, INTERPRET=_INTERPRET)


def attention_fwd(q, k, v, attn_mask, key_padding_mask, is_causal: bool, scale: float,
                  dropout_p: float, rng, allow_tf32: bool):
    """Returns ``(out, lse)``: out (B, H, Lq, D) in q's dtype and memory order
    (empty_in_layout_of), lse (B, H, Lq) fp32, the natural-log logsumexp of the scaled scores
    (-inf for rows with no key)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    c = _Common(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32)
    B, H, Lq, D = q.shape
    out = empty_in_layout_of(q, (B, H, Lq, D))
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    meta = _interp_meta("fwd") if _INTERPRET else {}

    def grid(m):
        return (cdiv(Lq, m["BLOCK_M"]) * B * H,)

    with device_guard(q):
        _fwd[grid](
            q, k, v, out, lse, c.am, c.kpm, c.kvr, c.rng,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            *c.am_strides, *c.kpm_strides,
            H, c.group, Lq, c.Lk, c.qk_scale, c.drop_thr, c.drop_scale,
            c.lq_key, c.lk_key,
            **c.flags(), **meta, FOLD_SCALE=not c.precise and c.qk_scale >= 0.0,
        )
    return out, lse


def _gqa_split(c: _Common, device: torch.device) -> int:
    if FORCE_GQA_SPLIT is not None:
        assert c.group % FORCE_GQA_SPLIT == 0
        return int(FORCE_GQA_SPLIT)
    if c.group == 1 or device.type != "cuda":
        return 1
    programs = cdiv(c.Lk, 128) * c.B * c.Hkv
    target = 2 * sm_count(device)
    if programs >= target:
        return 1
    want = cdiv(target, programs)
    best = 1
    for d in range(1, c.group + 1):
        if c.group % d == 0 and d <= want:
            best = d
    return best


# dq by atomics: None = the rule of _atomic_dq, True / False forces it (tests, benchmarks).
FORCE_ATOMIC_DQ = None


def _atomic_dq(c: _Common, dtype: torch.dtype) -> bool:
    """Whether the dk/dv kernel adds up dq itself (fp32 atomics), so that no dq kernel recomputes
    s and dp: 5 products per tile pair instead of 7 (FlashAttention-2's schedule).  Not for exact
    fp32 (PRECISE: its two-level sums), nor when torch asks for deterministic algorithms (the
    atomics' order varies run to run), nor on short key rows (<= EXACT_DELTA_MAX_LK keys: the dq
    kernel runs anyway for their exact delta, and few key blocks leave little to save)."""
    if c.precise:
        return False
    if FORCE_ATOMIC_DQ is not None:
        return bool(FORCE_ATOMIC_DQ)
    return (dtype in (torch.float16, torch.bfloat16) and c.block_d <= 128 and c.Lk > EXACT_DELTA_MAX_LK
            and not torch.are_deterministic_algorithms_enabled())


# Key count up to which backward computes delta = rowsum(p * dp) instead of rowsum(dO * O):
# one extra pass over at most two key blocks.  Measured (interpreter, 100 fresh draws per shape,
# oracle ratio): rowsum(dO * O) failed 10-26% of draws at Lk <= 7 and 4% at Lq = 1, Lk = 32.
EXACT_DELTA_MAX_LK = 128


def attention_bwd(do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal: bool,
                  scale: float, dropout_p: float, rng, allow_tf32: bool):
    """Returns ``(dq, dk, dv)`` (contiguous, shapes and dtypes of q, k, v)."""
    q, k, v, out, do = (_unit_last(t) for t in (q, k, v, out, do))
    c = _Common(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng, allow_tf32,
                need_kcnt=True)
    for t in (do, out):
        c.add_tensor(t)
    B, H, Lq, D = q.shape
    Hkv, Lk = c.Hkv, c.Lk
    assert tuple(do.shape) == (B, H, Lq, D) and tuple(out.shape) == (B, H, Lq, D)
    assert tuple(lse.shape) == (B, H, Lq) and lse.dtype == torch.float32
    lse = lse.contiguous()
    dq = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Lk, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Lk, D), dtype=v.dtype, device=q.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    flags = c.flags()

    # Rows with few keys, and exact fp32 (PRECISE) rows, take delta from p and dp (the dq kernel,
    # run first); the rest from rowsum(dO * O) in a small kernel.
    exact_delta = Lk <= EXACT_DELTA_MAX_LK or c.precise
    # Renormalise the recomputed p (rinv, from the dq kernel's first pass) for exact fp32, and
    # wherever that pass runs anyway: delta = rowsum(p * dp) inherits the fp32 lse's rounding
    # (|lse| x 2^-24, 1e-3 relative at a float mask of -1e4) uncancelled, so a row with one key
    # got dq, dk of 1e-2 where the exact gradient is 0.
    refine = c.precise or exact_delta
    atomic_dq = _atomic_dq(c, q.dtype)

    with device_guard(q):
        delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        rinv = torch.empty_like(delta) if refine else delta
        if not exact_delta:
            bm_delta = 64 if c.block_d <= 128 else 32
            _attn_bwd_delta_kernel[(cdiv(Lq, bm_delta) * B * H,)](
                out, do, delta, *out.stride()[:3], *do.stride()[:3], H, Lq,
                HEAD_DIM=D, BLOCK_D=c.block_d, BLOCK_M=bm_delta, num_warps=4,
            )

        meta = _interp_meta("dq") if _INTERPRET else {}

        def grid_q(m):
            return (cdiv(Lq, m["BLOCK_M"]) * B * H,)

        if refine or not atomic_dq:
            _dq[grid_q](
                q, k, v, do, lse, rinv, delta, dq, c.am, c.kpm, c.kvr, c.rng,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
                *c.am_strides, *c.kpm_strides,
                H, c.group, Lq, Lk, c.qk_scale, c.scale, c.drop_thr, c.drop_scale,
                c.lq_key, c.lk_key,
                **flags, EXACT_DELTA=exact_delta, REFINE_LSE=refine, ROW_SUMS_ONLY=atomic_dq, **meta,
            )
        # (B, H, Lq, D) fp32, zeroed: dq's sum over key blocks (atomic_dq); else a placeholder of
        # its own (the autotuner zeroes this argument before each timed run: reset_to_zero)
        dq_acc = torch.zeros((B, H, Lq, D) if atomic_dq else (1,), dtype=torch.float32, device=q.device)

        nsplit = _gqa_split(c, q.device)
        if nsplit == 1:
            dk_buf, dv_buf = dk, dv
            dk_strides = (0, *dk.stride()[:3])
            dv_strides = (0, *dv.stride()[:3])
        else:
            dk_buf = torch.empty((nsplit, B, Hkv, Lk, D), dtype=torch.float32, device=q.device)
            dv_buf = torch.empty_like(dk_buf)
            dk_strides = dk_buf.stride()[:4]
            dv_strides = dv_buf.stride()[:4]
        meta = _interp_meta("dkdv") if _INTERPRET else {}

        def grid_kv(m):
            return (cdiv(Lk, m["BLOCK_N"]) * B * Hkv * nsplit,)

        _dkdv[grid_kv](
            q, k, v, do, lse, rinv, delta, dk_buf, dv_buf, dq_acc, c.am, c.kpm, c.kcnt if c.has_kpm else q, c.rng,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dk_strides, *dv_strides,
            *c.am_strides, *c.kpm_strides,
            H, Hkv, c.group, c.group // nsplit, nsplit, Lq, Lk, c.qk_scale, c.scale,
            c.drop_thr, c.drop_scale, c.lq_key, c.lk_key,
            **flags, REFINE_LSE=refine, ATOMIC_DQ=atomic_dq, **meta,
        )
        if atomic_dq:
            torch.mul(dq_acc, c.scale, out=dq)
        if nsplit > 1:
            dk.copy_(dk_buf.sum(0))
            dv.copy_(dv_buf.sum(0))
    return dq, dk, dv
