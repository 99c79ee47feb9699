"""Attention over a KV cache (incremental decoding), flash-decoding style: Triton kernels and
launchers (inference only, no autograd).

Contract (the ``triton`` backend of attention_with_kv_cache builds on it):

  attention_with_kv_cache_fwd(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, allow_tf32,
                              *, num_splits=None) -> out

* q (B, H, L_new, D); k_cache (B, Hkv, L_max, D), v_cache (B, Hkv, L_max, Dv), Hkv divides H
  (query head h reads kv head h // (H // Hkv)); cache_seqlens int32 (B,) on q's device;
  k_new (B, Hkv, L_new, D) and v_new (B, Hkv, L_new, Dv), or both None.  Any strides with
  stride(-1) == 1: everything is read through its strides and the caches are written through
  theirs (a cache whose last stride is not 1 takes a slow torch path; q / k_new / v_new are then
  made contiguous).  D, Dv <= 256 (padded to a power of two inside the kernels with masked
  loads).  fp16 / bf16 / fp32; fp32 dots run in tf32 when ``allow_tf32``, else q.k, the
  scores and the running max in fp64 (s - max rounded to fp32 for exp2) and p @ v in exact fp32.
* Semantics (transformer_fast.reference.attention_with_kv_cache): with k_new / v_new, first write
  them into the caches in place at positions cache_seqlens[b] + t, t < L_new (a small Triton
  kernel that reads cache_seqlens on the device: no host sync); the caller advances
  cache_seqlens.  Then row b has n_b = cache_seqlens[b] + (L_new if k_new is given else 0) valid
  keys and query t sees key j iff j <= n_b - L_new + t (causal, bottom-right aligned among the
  new tokens).  s = scale * q.k, fp32 online softmax in base 2 (log2(e) folded into the scale),
  out = p @ v.  A query with no visible key returns 0.  out: (B, H, L_new, Dv) contiguous in q's
  dtype.  Positions outside [0, L_max) are never read or written (an out-of-range
  cache_seqlens, which the functional layer rejects, cannot make the kernels touch memory
  outside the caches).
* num_splits: None = the heuristic below; an int forces that many key splits (tests).

Kernel plan (bandwidth bound: the floor is the bytes of each row's valid K/V prefix):
  * GQA packing: one program owns one KV head of one batch row and a tile of BLOCK_M packed
    query rows r = t * GROUP + g (query position t, head hk * GROUP + g of the KV group).  For a
    decoding step (L_new = 1) the GROUP query heads of a KV group share every K/V tile, so K/V
    is streamed once per KV head instead of once per query head (MQA/GQA decoding reaches
    bandwidth); for a prefill chunk the tile also spans consecutive positions, which keeps the
    causal range of a tile tight.
  * Per tile the key range is [0, hi) with hi = n_b - L_new + t_last + 1 (t_last: the tile's
    last real query); keys below n_b - L_new + t_first + 1 are seen by every row of the tile and
    run a loop without masks, the rest (the causal staircase, the ragged last block) a masked
    loop.  Nothing beyond a row's valid length is loaded.
  * Split-K (flash-decoding): when B * Hkv * ceil(L_new * GROUP / BLOCK_M) programs would not
    fill the GPU, the key range of every tile is split over NUM_SPLITS programs (grid axis 1).
    The split count is chosen on the host from shapes only (L_max, never the actual lengths:
    no host sync), with FlashAttention-2's wave-efficiency rule over 2 programs per SM.  On the
    device each tile divides ITS OWN valid block range evenly among the splits (so a short row
    in a long cache still spreads its work); a split that starts beyond the range runs no
    iteration and writes a neutral partial (out 0, lse -inf).  Partials (out normalised, lse in
    base 2; fp32, fp64 for exact-fp32 inputs) are merged by a small combine kernel with the log-sum-exp rule.  Without
    splitting, the main kernel writes the output directly.

Configuration: fixed per shape class (no autotuning; see ``_config``): BLOCK_M = 16/32/64 from
the packed row count (128 with 8 warps for long prefill chunks), BLOCK_N 64-128, 4 warps, 2-3
stages.  Under TRITON_INTERPRET=1 small blocks (``INTERPRETER_BLOCK_N``) and bf16 dot operands
cast to fp32 (bf16 tl.dot is wrong in the interpreter; triton-lang/triton#11584).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import (cast_out, cdiv, device_guard, dot, imax, imin, is_interpreting,
                                             next_power_of_2, sm_count)

LOG2E = 1.4426950408889634

_INTERPRET = is_interpreting()

# Under the interpreter: key block length (small, so that short test caches span several
# blocks) and the number of "program slots" the split heuristic assumes.  Tests may change them.
INTERPRETER_BLOCK_N = 16
INTERPRETER_SLOTS = 4
# Tests may force the int64 in-head offsets path.
FORCE_OFF64 = False
# Most splits per tile (also bounds the combine kernel's lse tile).
MAX_SPLITS = 128


# ---------------------------------------------------------------------------------------------
# Device helpers


# ---------------------------------------------------------------------------------------------
# Append k_new / v_new into the cache


@triton.jit
def _kv_append_kernel(SK, DK, SV, DV, SEQLENS, sk_b, sk_h, sk_n, dk_b, dk_h, dk_n,
                      sv_b, sv_h, sv_n, dv_b, dv_h, dv_n, Hkv, L_new, L_max, DIM_K, DIM_V, T_BLOCKS,
                      BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    # Grid axis 0: (b, h, time block) flattened (axis 1 would stop at 65535 time blocks, a
    # prefill of ~2M tokens); axis 2 picks the tensor: 0 appends keys, 1 values (one launch for
    # both).  Each branch builds its whole pointer blocks and mask, whose types are the same in
    # both (a stride or head dim alone may be specialised differently per tensor: an int32,
    # int64 or constant 1).
    pid = tl.program_id(0)
    bh = pid // T_BLOCKS
    tb = pid % T_BLOCKS
    b64 = (bh // Hkv).to(tl.int64)
    h64 = (bh % Hkv).to(tl.int64)
    start = tl.load(SEQLENS + b64)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    pos = start + offs_t
    ok = (offs_t < L_new) & (pos >= 0) & (pos < L_max)
    t64 = offs_t[:, None].to(tl.int64)
    p64 = pos[:, None].to(tl.int64)
    if tl.program_id(2) == 0:
        mask = ok[:, None] & (offs_d < DIM_K)[None, :]
        src = SK + b64 * sk_b + h64 * sk_h + t64 * sk_n + offs_d[None, :]
        dst = DK + b64 * dk_b + h64 * dk_h + p64 * dk_n + offs_d[None, :]
    else:
        mask = ok[:, None] & (offs_d < DIM_V)[None, :]
        src = SV + b64 * sv_b + h64 * sv_h + t64 * sv_n + offs_d[None, :]
        dst = DV + b64 * dv_b + h64 * dv_h + p64 * dv_n + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------
# Attention over the cache (one split of the key range per program)


@triton.jit
def _decode_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, last_vis, lo, hi, hi_keys, qk_scale,
                  qk_scale_lo,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                  OFF64: tl.constexpr, F64_SCORES: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_nb = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DV
    for nb in range(lo, hi):
        n0 = nb * BLOCK_N
        offs_n = n0 + offs_nb
        if OFF64:  # in-head offsets may exceed int32
            n064 = n0.to(tl.int64)
            kt_ptrs = Kh + n064 * skn + offs_nb[None, :] * skn + offs_d[:, None]
            v_ptrs = Vh + n064 * svn + offs_nb[:, None] * svn + offs_dv[None, :]
        else:  # int32 offsets: cheaper address math
            kt_ptrs = Kh + offs_n[None, :] * skn + offs_d[:, None]
            v_ptrs = Vh + offs_n[:, None] * svn + offs_dv[None, :]
        if MASKED:
            kT = tl.load(kt_ptrs, mask=(offs_n[None, :] < hi_keys) & d_ok[:, None], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kT = tl.load(kt_ptrs)
        else:
            kT = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        if F64_SCORES:
            # Exact fp32 inputs: q.k and its scaling (qk_scale + qk_scale_lo: the scale to ~48
            # bits) in fp64, and the score and running max stay fp64: only s - m (small where
            # the probability matters) goes to fp32.  With large logits (a peaked softmax turns
            # a score's absolute error into the output's relative error) the fp32 dot's
            # sequential sums went up to 4.5x past the oracle's bound, an fp64 dot rounded
            # before the fp32 scaling to 1.6x, the score rounded to fp32 (error up to ulp(s) / 2,
            # |s| in the hundreds at logit std 100) to 8x (interpreter).
            s = tl.dot(q.to(tl.float64), kT.to(tl.float64),
                       tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64), out_dtype=tl.float64)
            s = s * qk_scale + s * qk_scale_lo  # fp64 products (promoted)
        else:
            s = dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, IEEE)
            s = s * qk_scale
        if MASKED:
            s = tl.where(offs_n[None, :] <= last_vis[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2((s - m_use[:, None]).to(tl.float32))
        alpha = tl.exp2((m_i - m_use).to(tl.float32))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < hi_keys) & dv_ok[None, :], other=0.0)
        elif HEAD_DV == BLOCK_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        acc = dot(p.to(v.dtype), v, acc, DOT_FP32, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _decode_fwd_kernel(
    Q, K, V, O, OP, LSEP, SEQLENS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    sps, spb, sph, spm, sls, slb, slh,
    Hkv, GROUP, L_new, L_max, N_EXTRA, NUM_SPLITS, qk_scale, qk_scale_lo,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, OFF64: tl.constexpr,
    F64_SCORES: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m_total = L_new * GROUP
    n_mt = tl.cdiv(m_total, BLOCK_M)
    mt = n_mt - 1 - pid % n_mt  # the last (heaviest) query tiles first
    bhk = pid // n_mt
    b = bhk // Hkv
    hk = bhk % Hkv
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    m0 = mt * BLOCK_M

    # Packed query rows: r = t * GROUP + g -> position t, query head hk * GROUP + g.
    offs_r = m0 + tl.arange(0, BLOCK_M)
    r_ok = offs_r < m_total
    t = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b64 * sqb + h64[:, None] * sqh + t64[:, None] * sqm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)

    # Key ranges of this tile (all int32 scalars, clamped into [0, L_max]).
    n_keys = imin(imax(tl.load(SEQLENS + b) + N_EXTRA, 0), L_max)
    base = n_keys - L_new  # query t sees keys j <= base + t
    last_vis = base + t
    t_first = m0 // GROUP
    t_last = (imin(m0 + BLOCK_M, m_total) - 1) // GROUP
    hi_keys = imax(imin(base + t_last + 1, n_keys), 0)  # keys [0, hi_keys) are loaded
    full_keys = imax(imin(base + t_first + 1, n_keys), 0)  # seen by every row of the tile
    n_blk = tl.cdiv(hi_keys, BLOCK_N)
    full_blk = full_keys // BLOCK_N
    if SPLIT:
        per = tl.cdiv(n_blk, NUM_SPLITS)
        lo = split * per
        hi = imin(lo + per, n_blk)
    else:
        lo = 0
        hi = n_blk
    # [lo, mid) needs no mask; [mid2, hi) is masked (empty ranges run no iteration).
    mid = imin(hi, full_blk)
    mid2 = imax(lo, full_blk)

    Kh = K + b64 * skb + hk64 * skh
    Vh = V + b64 * svb + hk64 * svh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if F64_SCORES:  # the running max in the scores' dtype
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float64)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, last_vis, lo, mid, hi_keys,
                                  qk_scale, qk_scale_lo, HEAD_DIM, BLOCK_D, HEAD_DV, BLOCK_DV,
                                  BLOCK_M, BLOCK_N,
                                  False, DOT_FP32, IEEE, OFF64, F64_SCORES)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, Kh, Vh, skn, svn, last_vis, mid2, hi, hi_keys,
                                  qk_scale, qk_scale_lo, HEAD_DIM, BLOCK_D, HEAD_DV, BLOCK_DV,
                                  BLOCK_M, BLOCK_N,
                                  True, DOT_FP32, IEEE, OFF64, F64_SCORES)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    o_mask = r_ok[:, None] & (offs_dv < HEAD_DV)[None, :]
    if SPLIT:
        # In LSEP's dtype (fp64 for exact-fp32 inputs): an fp32 sum would carry |m| * 2^-24
        # into the split's weight, past the oracle's bound where the logits are large.
        lse_ty = LSEP.dtype.element_ty
        lse = tl.where(empty, float("-inf"), m_i.to(lse_ty) + tl.log2(l_safe).to(lse_ty))
        split64 = split.to(tl.int64)
        op_ptrs = (OP + split64 * sps + b64 * spb + h64[:, None] * sph + t64[:, None] * spm
                   + offs_dv[None, :])
        tl.store(op_ptrs, out, mask=o_mask)
        tl.store(LSEP + split64 * sls + b64 * slb + h64 * slh + t64, lse, mask=r_ok)
    else:
        o_ptrs = O + b64 * sob + h64[:, None] * soh + t64[:, None] * som + offs_dv[None, :]
        tl.store(o_ptrs, cast_out(out, O.dtype.element_ty, INTERPRET), mask=o_mask)


@triton.jit
def _decode_combine_kernel(
    OP, LSEP, O, sps, spb, sph, spm, sls, slb, slh, sob, soh, som,
    H, L_new, NUM_SPLITS,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tb = tl.cdiv(L_new, BLOCK_T)
    bh = pid // n_tb
    tb = pid % n_tb
    b64 = (bh // H).to(tl.int64)
    h64 = (bh % H).to(tl.int64)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    t_ok = offs_t < L_new
    t64 = offs_t.to(tl.int64)
    lse_base = LSEP + b64 * slb + h64 * slh
    lses = tl.load(lse_base + offs_s[None, :].to(tl.int64) * sls + t64[:, None],
                   mask=t_ok[:, None] & (offs_s < NUM_SPLITS)[None, :], other=float("-inf"))
    m = tl.max(lses, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    # lses may be fp64 (exact-fp32 inputs): the differences are taken there, exp2 in fp32.
    tot = tl.sum(tl.exp2((lses - m_use[:, None]).to(tl.float32)), 1)
    inv_tot = 1.0 / tl.where(tot == 0.0, 1.0, tot)
    acc = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
    dv_ok = offs_dv < HEAD_DV
    l_ptrs = lse_base + t64
    p_ptrs = OP + b64 * spb + h64 * sph + t64[:, None] * spm + offs_dv[None, :]
    for _ in range(0, NUM_SPLITS):  # pointers advance by one split per step (64-bit math)
        ls = tl.load(l_ptrs, mask=t_ok, other=float("-inf"))
        w = tl.exp2((ls - m_use).to(tl.float32)) * inv_tot  # exactly 0 for an empty split
        part = tl.load(p_ptrs, mask=(w > 0.0)[:, None] & dv_ok[None, :], other=0.0)
        acc += w[:, None] * part
        l_ptrs += sls
        p_ptrs += sps
    o_ptrs = O + b64 * sob + h64 * soh + t64[:, None] * som + offs_dv[None, :]
    tl.store(o_ptrs, cast_out(acc, O.dtype.element_ty, INTERPRET), mask=t_ok[:, None] & dv_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Configuration


def _config(m_total: int, block_d: int, block_dv: int, dtype: torch.dtype, ieee: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``m_total`` packed query rows.

    From ptxas reports of Triton 3.6 for sm_90a (with the 16-divisibility specialisation a real
    launch gets, which is what lets the loads pipeline through shared memory): every 16-bit
    entry compiles without register spills, 128-240 registers, 57-164 KB of shared memory; the
    decoding entries (BLOCK_M 16/32) use ~70-86 KB, so 2-3 programs fit on an SM."""
    wide = max(block_d, block_dv)
    if _INTERPRET:
        bm = 16 if m_total <= 16 else 32
        return bm, INTERPRETER_BLOCK_N, 4, 1
    if ieee:
        # Exact fp32 dots are FMA loops: register-hungry, keep tiles small.
        if wide <= 64:
            return (16 if m_total <= 16 else 32), 32, 4, 2
        return 16, (64 if wide <= 128 else 16), 4, 2
    if dtype == torch.float32:  # tf32: fp32 operands double the registers / shared memory
        bm = 16 if m_total <= 16 else 32
        if wide <= 128:
            return bm, 64, 4, 2
        return bm, 32, (4 if bm == 16 else 8), 2
    if m_total <= 32:
        # Decoding (and GQA groups / short chunks): few rows, stream K/V.
        bm = 16 if m_total <= 16 else 32
        if wide <= 64:
            return bm, 128, 4, 3
        if wide <= 128:
            return bm, 64, 4, 3
        return bm, 64, (4 if bm == 16 else 8), 2
    if m_total <= 64:
        if wide <= 64:
            return 64, 64, 4, 3
        if wide <= 128:
            return 64, 32, 4, 3
        return 64, 32, 8, 2
    # Prefill chunks: the flash-attention forward's shapes.
    if wide <= 128:
        return 128, 64, 8, 3
    return 64, 64, 8, 2


def _slots(device: torch.device) -> int:
    """Programs that run concurrently on the device (2 per SM for 4-warp programs)."""
    if device.type != "cuda":
        return INTERPRETER_SLOTS
    return 2 * sm_count(device)


def num_splits_heuristic(programs: int, slots: int, n_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention-2's rule: no split when the programs already fill ~80% of one wave;
    otherwise the smallest split count whose wave efficiency is within 85% of the best, among
    counts that change the number of key blocks per split."""
    if programs >= 0.8 * slots or n_blocks <= 1:
        return 1
    max_splits = max(1, min(max_splits, slots, n_blocks))

    def eligible(s):
        return s == 1 or cdiv(n_blocks, s) != cdiv(n_blocks, s - 1)

    effs = []
    for s in range(1, max_splits + 1):
        if not eligible(s):
            effs.append(0.0)
            continue
        waves = programs * s / slots
        effs.append(waves / -(-waves // 1))
    best = max(effs)
    for s in range(1, max_splits + 1):
        if eligible(s) and effs[s - 1] >= 0.85 * best:
            return s
    return 1


def _span(t: torch.Tensor, dim: int) -> int:
    """Largest element offset inside one slice ``t[i0, ..., i_{dim-1}]`` (dims ``dim`` onward)."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape[dim:], t.stride()[dim:]))


def _unit_last(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# Launchers


def _append(pairs, seqlens: torch.Tensor) -> None:
    """Copy each (src (B, Hkv, L_new, D), dst cache) pair's rows to positions seqlens[b] + t:
    one launch for up to two pairs (keys and values)."""
    (sk, dk), (sv, dv) = pairs[0], pairs[-1]
    B, Hkv, L_new, _ = sk.shape
    L_max = dk.shape[2]
    block_d = max(16, next_power_of_2(max(sk.shape[3], sv.shape[3])))
    block_t = max(1, min(next_power_of_2(L_new), max(1, 4096 // block_d)))
    t_blocks = cdiv(L_new, block_t)
    grid = (B * Hkv * t_blocks, 1, len(pairs))
    _kv_append_kernel[grid](
        sk, dk, sv, dv, seqlens, *sk.stride()[:3], *dk.stride()[:3], *sv.stride()[:3], *dv.stride()[:3],
        Hkv, L_new, L_max, sk.shape[3], sv.shape[3], t_blocks, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=4,
    )


def _torch_append(src: torch.Tensor, dst: torch.Tensor, seqlens: torch.Tensor) -> None:
    # Caches whose last stride is not 1: one index_put_ per cache, no host sync.
    B, _, L_new, _ = src.shape
    pos = seqlens.to(torch.int64).unsqueeze(1) + torch.arange(L_new, device=src.device)
    rows = torch.arange(B, device=src.device).unsqueeze(1)
    dst.transpose(1, 2)[rows, pos] = src.transpose(1, 2)


def attention_with_kv_cache_fwd(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale: float,
                                allow_tf32: bool, *, num_splits=None):
    """Returns out (B, H, L_new, Dv), contiguous, q's dtype.  Writes k_new / v_new (when given)
    into the caches in place at positions cache_seqlens[b] + t."""
    assert q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4, "q and caches must be 4-D"
    B, H, L_new, D = q.shape
    Bk, Hkv, L_max, Dk = k_cache.shape
    Dv = v_cache.shape[3]
    assert Bk == B and Dk == D and tuple(v_cache.shape[:3]) == (B, Hkv, L_max), "cache shapes"
    assert Hkv >= 1 and H % Hkv == 0, "Hkv must divide H"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and caches must share a dtype"
    assert 1 <= D <= 256 and 1 <= Dv <= 256, "head dims must be in 1..256"
    assert tuple(cache_seqlens.shape) == (B,) and cache_seqlens.dtype == torch.int32
    assert (k_new is None) == (v_new is None), "k_new and v_new go together"
    for t in (k_cache, v_cache, cache_seqlens):
        assert t.device == q.device, "all tensors must be on q's device"
    seqlens = cache_seqlens.contiguous()
    has_new = k_new is not None
    out = torch.empty((B, H, L_new, Dv), dtype=q.dtype, device=q.device)

    with device_guard(q):
        # 1. Append the new keys / values.
        if has_new:
            assert tuple(k_new.shape) == (B, Hkv, L_new, D) and tuple(v_new.shape) == (B, Hkv, L_new, Dv)
            assert k_new.dtype == q.dtype and v_new.dtype == q.dtype
            assert k_new.device == q.device and v_new.device == q.device
            if L_new > 0 and B * Hkv > 0:
                k_new, v_new = _unit_last(k_new), _unit_last(v_new)
                fused = []
                for src, dst in ((k_new, k_cache), (v_new, v_cache)):
                    if dst.stride(-1) == 1:
                        fused.append((src, dst))
                    else:
                        _torch_append(src, dst, seqlens)
                if fused:
                    _append(fused, seqlens)
        if out.numel() == 0:
            return out
        if L_max == 0:
            return out.zero_()
        q = _unit_last(q)
        k_cache = _unit_last(k_cache)  # a copy only for the slow last-stride != 1 case
        v_cache = _unit_last(v_cache)

        # 2. Attention.
        group = H // Hkv
        m_total = L_new * group
        block_d = max(16, next_power_of_2(D))
        block_dv = max(16, next_power_of_2(Dv))
        ieee = q.dtype == torch.float32 and not allow_tf32
        bm, bn, warps, stages = _config(m_total, block_d, block_dv, q.dtype, ieee)
        programs = B * Hkv * cdiv(m_total, bm)
        n_blocks = cdiv(L_max, bn)
        if num_splits is None:
            nsplit = num_splits_heuristic(programs, _slots(q.device), n_blocks)
        else:
            nsplit = max(1, min(int(num_splits), MAX_SPLITS))
        split = nsplit > 1
        qk_scale = float(scale) * LOG2E
        qk_hi = struct.unpack("f", struct.pack("f", qk_scale))[0]  # the kernel's fp32 qk_scale
        off64 = FORCE_OFF64 or max(_span(k_cache, 2), _span(v_cache, 2)) >= 2**31 - 1
        if split:
            op = torch.empty((nsplit, B, H, L_new, Dv), dtype=torch.float32, device=q.device)
            lsep = torch.empty((nsplit, B, H, L_new), dtype=torch.float64 if ieee else torch.float32,
                               device=q.device)
            op_strides = op.stride()[:4]
            lse_strides = lsep.stride()[:3]
        else:
            op, lsep = out, out  # unused
            op_strides, lse_strides = (0, 0, 0, 0), (0, 0, 0)
        _decode_fwd_kernel[(programs, nsplit)](
            q, k_cache, v_cache, out, op, lsep, seqlens,
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
            *op_strides, *lse_strides,
            Hkv, group, L_new, L_max, L_new if has_new else 0, nsplit, qk_scale, qk_scale - qk_hi,
            HEAD_DIM=D, BLOCK_D=block_d, HEAD_DV=Dv, BLOCK_DV=block_dv, SPLIT=split,
            DOT_FP32=_INTERPRET and q.dtype == torch.bfloat16,
            IEEE=ieee, OFF64=off64, F64_SCORES=ieee, INTERPRET=_INTERPRET,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
        )
        if split:
            block_t = min(16, next_power_of_2(L_new))
            block_s = max(2, next_power_of_2(nsplit))
            _decode_combine_kernel[(B * H * cdiv(L_new, block_t),)](
                op, lsep, out, *op_strides, *lse_strides, *out.stride()[:3],
                H, L_new, nsplit,
                HEAD_DV=Dv, BLOCK_DV=block_dv, BLOCK_T=block_t, BLOCK_S=block_s,
                INTERPRET=_INTERPRET, num_warps=4,
            )
    return out
