"""Position-wise FFN building blocks: GEMMs with fused epilogues (Triton kernels + launchers).

Contract (shared with the C++ CPU and CUDA backends; autograd lives in transformer_fast/ops/ffn.py).
All matrices are 2-D; x, dy may have any strides; w is (out_features, in_features) as nn.Linear
stores it, any strides; outputs are contiguous, in x's dtype.

  linear_fwd(x, w, b, activation, dropout_p, rng, store_pre, allow_tf32) -> (y, pre)
      pre = x @ w^T + b                         (M, N), stored only when store_pre, else (0,)
      y   = dropout(act(pre))                   (M, N)
      The stored tensor is the activation state that this backend's dgrad / act_bwd read back
      as aux: pre itself here and in CUDA; the C++ CPU backend stores act'(pre) instead for
      gelu / gelu_tanh in fp32 (csrc/ffn_cpu.cpp, aux_holds_grad).  Backward always runs on the
      backend that ran the forward, so aux never crosses backends.
  linear_dgrad(dy, w, aux, activation, dropout_p, rng, want_dbias, allow_tf32) -> (d, dbias)
      d = (dy @ w) * act'(pre) * keep / (1 - p)  (M, N): the gradient of the pre-activation of
          the layer whose output feeds ``w``'s layer; aux is pre (gelu / gelu_tanh), y (relu:
          y > 0 iff pre > 0 and the element was kept, so neither pre nor the mask is needed)
          or None ("none": no activation factor).  With activation "none" and p = 0 it is the
          plain input gradient dy @ w.
      dbias = column sums of d (N,) when want_dbias, else (0,)
  linear_wgrad(dy, x, want_dbias, allow_tf32) -> (dw, dbias)
      dw = dy^T @ x (N, K); dbias = column sums of dy (N,) or (0,)
  act_bwd(dy, aux, activation, dropout_p, rng, want_dbias) -> (d, dbias)
      the elementwise d = dy * act'(pre) * keep / (1 - p) (for linear_bias_act's backward, where
      no GEMM produces dy), with its column sums.

Dropout follows transformer_fast.philox over the row-major element index m * N + n of the (M, N)
activation: the forward and the backward (any backend) regenerate the same mask from rng.

Kernel plan.  One GEMM kernel ``_gemm_kernel`` computes C = A @ B for A (M, K) and B (K, N)
given by strides (so x @ w^T, dy @ w and dy^T @ x are all the same kernel with no copies),
fp32 accumulation, grouped tile order (GROUP_M row tiles share the B columns they sweep: L2
reuse), @triton.autotune over a short list pruned by shape and shared memory on a GPU (a single
config under the interpreter).  Its epilogue is one of
  EPI_FWD:  + bias, store pre (optional), activation, dropout, store y;
  EPI_DACT: * act'(aux), dropout mask, store d, and the tile's column sums into a (tiles_m, N)
            fp64 buffer (db without atomics: torch.sum over the tiles finishes it).
``_act_bwd_kernel`` is the same dact epilogue as an elementwise pass (and, with nothing to
multiply, the column-sum kernel for dbias = sum(dy)).

fp32.  Exact fp32 (torch's allow_tf32 off) sums each K step's products from zero (Triton's
ieee dot: FMAs in K order) and adds the step sums with Kahan compensation: one fp32 chain over
all of K drifted past the oracle's bound against cuBLAS (split-K / gemv) at M = 1 and at K =
1000 rows (first GPU run, H200).  tf32 rounds the operand tiles to the nearest tf32 first
(_round_tf32): the tensor core truncates them otherwise.

Why pre is stored (gelu) instead of recomputed: see benchmarks/NOTES.md (FFN section).
"""
from __future__ import annotations

import collections
import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import (autotune, cast_out, cdiv, device_guard, dot, first_config_unless_tuning,
                                             is_interpreting, next_power_of_2, sm_count)
from transformer_fast.kernels.philox import dropout_keep_rows, dropout_scale, dropout_threshold, load_rng_if

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3}
EPI_FWD = 0
EPI_DACT = 1

_EMPTY = (0,)
# Globals read inside @triton.jit functions must be constexprs (and, for the interpreter, stand
# to the right of a tensor in products).
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)

# Programs of the persistent TMA GEMM under the interpreter (a GPU runs one per SM).
_INTERPRET_PROGRAMS = 3

# Elementwise kernel tile.
EW_BLOCK_M = 32
EW_BLOCK_N = 128


def needs_pre(activation: str) -> bool:
    """Whether backward needs the pre-activation (relu recovers its gradient from y)."""
    return activation in ("gelu", "gelu_tanh")


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _tanh_sech2(u):
    """(tanh(u), 1 - tanh(u)^2) from e = exp(-2|u|) in (0, 1] (no overflow, no libdevice).
    sech^2 = 4e / (1 + e)^2 keeps its relative accuracy where tanh -> +-1; 1 - t*t would cancel
    there (an error of ~1e-7 times x * du/dx ~ 30 at |x| ~ 8: measured 2e-6 in fp32)."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0.0, -t, t)
    sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return t, sech2


@triton.jit
def _round_tf32(x):
    """fp32 -> the nearest tf32 (10-bit mantissa; ties away from zero, as cvt.rna.tf32.f32),
    kept in fp32.  Triton feeds fp32 tiles to the tf32 MMA (wgmma from shared memory, mma.sync
    from registers) as they are, and the tensor core ignores the low 13 mantissa bits: a
    truncation, biased toward zero, whose error sums coherently over K (dW over the rows:
    ~3x the error of torch's tf32 matmul, past the oracle's 2x).  Rounded here, the MMA's
    truncation is exact.  Integer ops only (the interpreter runs them too); NaN passes as is
    (CUDA's 0x7fffffff would otherwise carry into the sign bit)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (((bits + 0x1000) >> 13) << 13).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) in fp32."""
    if ACT == 1:
        y = tl.where(x < 0.0, 0.0, x)  # NaN stays NaN, as torch.relu
    elif ACT == 2:
        y = 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))
    elif ACT == 3:
        t, _ = _tanh_sech2((x + x * x * x * _GELU_C) * _SQRT_2_OVER_PI)
        y = 0.5 * x * (1.0 + t)
    else:
        y = x
    return y


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """act'(x) at the pre-activation x (fp32); relu' at 0 is 0, as torch."""
    if ACT == 1:
        g = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        g = cdf + x * (tl.exp(-0.5 * x * x) * _INV_SQRT_2PI)
    elif ACT == 3:
        x2 = x * x
        t, sech2 = _tanh_sech2((x + x2 * x * _GELU_C) * _SQRT_2_OVER_PI)
        du = (x2 * _GELU_C * 3.0 + 1.0) * _SQRT_2_OVER_PI  # d u / d x
        g = 0.5 * (1.0 + t) + 0.5 * x * sech2 * du
    else:
        g = x * 0.0 + 1.0
    return g


@triton.jit
def _dact(g, AUX, rows64, cols, mask, N, stride_auxm,
          seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale,
          ACT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
          rm64, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROP_GROUPS: tl.constexpr):
    """g * act'(pre) * keep * scale, with pre (or y for relu) loaded from AUX (fp32 math).  The
    tile is rows rm64 (1-D) x columns col0 + arange(BLOCK_N) (rows64 / cols: the same, 2-D)."""
    if ACT == 1:
        # AUX holds y = keep * relu(pre) * scale: y > 0 iff pre > 0 and the element was kept.
        # Written as "not y <= 0" so that a NaN passes its gradient, as torch's relu backward.
        y = tl.load(AUX + rows64 * stride_auxm + cols, mask=mask, other=0.0)
        d = tl.where(y <= 0, 0.0, g * drop_scale)
    else:
        if ACT != 0:
            pre = tl.load(AUX + rows64 * stride_auxm + cols, mask=mask, other=0.0).to(tl.float32)
            g = g * _act_grad(pre, ACT)
        if HAS_DROPOUT:
            keep = dropout_keep_rows(seed_lo, seed_hi, rm64, N, col0, off_lo, off_hi, drop_thr,
                                     BLOCK_M, BLOCK_N, DROP_GROUPS)
            g = tl.where(keep, g * drop_scale, 0.0)
        d = g
    return d


# ---------------------------------------------------------------------------------------------
# GEMM with fused epilogues


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the tile-th output tile in grouped order: consecutive tiles walk GROUP_M
    row tiles down one column tile, so the B tile (weights) and the GROUP_M A tiles stay in L2
    while the group sweeps the columns."""
    per_group = GROUP_M * num_pid_n
    first_pid_m = (tile // per_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (tile % per_group) % group_size_m, (tile % per_group) // group_size_m


@triton.jit
def _gemm_epilogue(acc, pid_m, pid_n, C, BIAS, AUX, RNG, PART, M, N, stride_cm, stride_auxm,
                   drop_thr, drop_scale, EPILOGUE: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_AUX: tl.constexpr,
                   HAS_PART: tl.constexpr, INTERPRET: tl.constexpr, DROP_GROUPS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile (pid_m, pid_n) of C from its fp32 product ``acc`` (BLOCK_M, BLOCK_N): the
    epilogues of the module docstring, shared by both GEMM kernels."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = rn < N
    mask = (rm < M)[:, None] & col_ok[None, :]
    rm64 = rm.to(tl.int64)
    rows = rm64[:, None]
    cols = rn[None, :]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    if EPILOGUE == 0:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if STORE_AUX:
            tl.store(AUX + rows * stride_auxm + cols, cast_out(acc, AUX.dtype.element_ty, INTERPRET), mask=mask)
        out = _act(acc, ACT)
        if HAS_DROPOUT:
            keep = dropout_keep_rows(seed_lo, seed_hi, rm64, N, pid_n * BLOCK_N, off_lo, off_hi, drop_thr,
                                     BLOCK_M, BLOCK_N, DROP_GROUPS)
            out = tl.where(keep, out * drop_scale, 0.0)
    else:
        out = _dact(acc, AUX, rows, cols, mask, N, stride_auxm,
                    seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, ACT, HAS_DROPOUT,
                    rm64, pid_n * BLOCK_N, BLOCK_M, BLOCK_N, DROP_GROUPS)
        if HAS_PART:
            # This tile's column sums: one row of the (tiles_m, N) partials, no atomics.  Summed
            # in fp64 (cheap: once per tile), so db carries only the rounding of the d values.
            part = tl.sum(tl.where(mask, out, 0.0).to(tl.float64), axis=0)
            tl.store(PART + pid_m.to(tl.int64) * N + rn, part, mask=col_ok)
    tl.store(C + rows * stride_cm + cols, cast_out(out, C.dtype.element_ty, INTERPRET), mask=mask)


def _config(bm, bn, bk, warps, stages, pre_hook=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages, pre_hook=pre_hook)


def _gemm_configs():
    if is_interpreting():
        # One config: the interpreter cannot autotune over several.  Big K blocks: fewer steps.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4},
                              num_warps=4, num_stages=1)]
    cfg = _config
    return [
        # 16-bit on H100: the large tiles win at FFN sizes; the small ones serve short M / N.
        cfg(128, 256, 64, 8, 3),
        cfg(256, 128, 64, 8, 3),
        cfg(128, 128, 64, 8, 4),
        cfg(128, 128, 64, 4, 4),
        cfg(64, 128, 64, 4, 4),
        cfg(128, 64, 64, 4, 4),
        cfg(64, 64, 64, 4, 4),
        cfg(32, 64, 64, 4, 4),
        # fp32 (tf32 or exact FMA): smaller K steps fit shared memory.
        cfg(128, 128, 32, 8, 3),
        cfg(64, 64, 32, 4, 3),
        # Exact fp32 (FMA dot + Kahan step sums, _IEEE_MAX_PER_THREAD): the tiles that do not spill.
        cfg(128, 64, 32, 8, 3),
        cfg(64, 64, 32, 8, 3),
    ]


# Dynamic shared memory a config may use (H100: 227 KiB; leave room for the epilogue's layout
# conversion scratch).
_SMEM_BUDGET = 200 * 1024


# Accumulator elements per thread above which an epilogue that runs Philox (dropout) or loads
# a second tile (the dact epilogue) spills: measured with ptxas for sm_90 (compile_check
# --resources): 128x256 / 8 warps (128 per thread) with dropout spilled ~4 KB per thread.
_HEAVY_EPILOGUE_MAX_PER_THREAD = 64

# The compiled exact-fp32 loop holds the accumulator, its Kahan compensation and the step's
# FMA-dot sum, plus the dot's operand fragments: measured with ptxas for sm_90 (compile_check
# --resources, Triton 3.8), 128x128 / 8 warps (64 per thread) spilled 80-208 bytes and
# 64x64 / 4 warps 8 bytes at 16-aligned shapes; 128x64 / 8 warps did not (up to 104 bytes at
# unaligned ones, N = 70) and 64x64 / 8 warps (<= 142 registers) at most 8.
_IEEE_MAX_PER_THREAD = 32
_IEEE_WARPS = 8


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose tiles are not much larger than the problem, whose pipeline fits
    shared memory and whose epilogue does not spill; always keep at least the smallest."""
    m, n = named_args["M"], named_args["N"]
    esize = named_args["A"].element_size()
    heavy = bool(kwargs.get("HAS_DROPOUT", False)) or kwargs.get("EPILOGUE", EPI_FWD) == EPI_DACT
    ieee = esize == 4 and bool(kwargs.get("IEEE", False)) and not is_interpreting()
    kept = []
    for c in configs:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        if heavy and bm * bn // (32 * c.num_warps) > _HEAVY_EPILOGUE_MAX_PER_THREAD:
            continue
        if ieee and (c.num_warps != _IEEE_WARPS or bm * bn // (32 * c.num_warps) > _IEEE_MAX_PER_THREAD):
            continue
        if bm > max(32, next_power_of_2(m)) or bn > max(64, next_power_of_2(n)):
            continue
        if (bm * bk + bk * bn) * esize * max(1, c.num_stages) > _SMEM_BUDGET:
            continue
        if esize == 4 and bk > 32:  # fp32: 64-wide K blocks double the smem for no gain
            continue
        if esize < 4 and bk < 64:
            continue
        kept.append(c)
    return first_config_unless_tuning(kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])])


@autotune(
    configs=_gemm_configs(),
    key=["M", "N", "K", "EPILOGUE", "ACT", "HAS_DROPOUT", "IEEE"],
    prune_configs_by={"early_config_prune": _prune_configs},
    # The dact epilogue's column-sum partials are indexed by row tile, whose count depends on
    # the config: zero them between benchmark runs so that no stale row survives.
    reset_to_zero=["PART"],
)
@triton.jit
def _gemm_kernel(
    A, B, C, BIAS, AUX, RNG, PART,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_auxm,
    drop_thr, drop_scale,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_AUX: tl.constexpr, HAS_PART: tl.constexpr,
    DOT_FP32: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, DROP_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C (M, N) = epilogue(A (M, K) @ B (K, N)); see the module docstring for the epilogues."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    a_ptrs = A + rm64[:, None] * stride_am + rk[None, :].to(tl.int64) * stride_ak  # (BM, BK)
    b_ptrs = B + rk[:, None].to(tl.int64) * stride_bk + rn64[None, :] * stride_bn  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # Kahan compensation (compiled IEEE)
    for k in range(0, K, BLOCK_K):
        k_ok = rk < K - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERPRET and IEEE:
            # Exact fp32 under the interpreter: each tile's product in fp64, rounded once.  numpy's
            # sequential fp32 matmul drifted past the oracle's bound on dW (e.g. 1.06x, CI); the
            # GPU compiles the branch below.
            acc = acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
        elif IEEE:
            # Exact fp32 on the GPU: Triton lowers an ieee fp32 dot to FMAs in K order, so
            # dot(a, b, acc) would chain all K products through one fp32 accumulator (error
            # ~sqrt(K) ulps: modelled at 3-5x a split-K / gemv sum, as cuBLAS runs M = 1 or
            # K = 1000 rows, past the oracle's 2x bound).  Each K step's BLOCK_K products are
            # summed from zero, and the step sums are added with Kahan compensation.  (Plain
            # ``acc + tl.dot(a, b)`` would not do: Triton's combine pass folds it back into
            # dot(a, b, acc).)
            part = tl.dot(a, b, input_precision="ieee")
            y = part - comp
            t = acc + y
            comp = (t - acc) - y
            acc = t
        else:
            if a.dtype == tl.float32:  # tf32 (fp32 with torch's allow_tf32)
                a = _round_tf32(a)
                b = _round_tf32(b)
            acc = dot(a, b, acc, DOT_FP32, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    _gemm_epilogue(acc, pid_m, pid_n, C, BIAS, AUX, RNG, PART, M, N, stride_cm, stride_auxm,
                   drop_thr, drop_scale, EPILOGUE, ACT, HAS_BIAS, HAS_DROPOUT, STORE_AUX, HAS_PART,
                   INTERPRET, DROP_GROUPS, BLOCK_M, BLOCK_N)


# The same GEMM on Hopper's tensor memory accelerator: 16-bit operands read through TMA
# descriptors (bulk copies into swizzled shared memory, out-of-range rows and columns filled with
# zeros by the copy engine: no masks, no per-element addresses), one program per SM walking the
# output tiles (the loop over tiles and K steps flattened, so the next tile's loads are in
# flight during this tile's epilogue).  Triton's recipe for cuBLAS-level Hopper GEMMs; the
# epilogues are the pointer kernel's.


def _tma_configs():
    if is_interpreting():
        # Small tiles and few programs: the tests' shapes then take several tiles per program and
        # several K steps per tile.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 2, "PROGRAMS_PER_SM": 1},
                              num_warps=4, num_stages=1, pre_hook=_tma_block_shapes)]
    def cfg(bm, bn, bk, warps, stages, per_sm=1):
        c = _config(bm, bn, bk, warps, stages, pre_hook=_tma_block_shapes)
        c.kwargs["PROGRAMS_PER_SM"] = per_sm
        return c

    return [
        cfg(128, 256, 64, 8, 3),
        cfg(128, 128, 64, 8, 4),
        cfg(128, 128, 64, 4, 4),
        cfg(64, 256, 64, 4, 4),
        cfg(128, 64, 64, 4, 4),
        cfg(64, 128, 64, 4, 4),
        cfg(64, 64, 64, 4, 4),
        # Two programs an SM where two CTAs fit (one warpgroup: <= 255 registers x 128 threads;
        # Triton 3.8, sm_90: 128x64 / 64x128 x 3 stages 80 KB, 104 KB with dropout's scratch,
        # 128x128 x 3 stages 104 KB): one program's epilogue (bias, the activation, the pre
        # store, Philox: ~40 instructions an element for gelu, ~0.6x of the K loop's time at
        # K 1024) then runs while the other's wgmma loop does.  With one program an SM nothing
        # overlaps it (benchmarks/NOTES.md, twenty-ninth session).
        cfg(128, 128, 64, 4, 3, per_sm=2),
        cfg(128, 64, 64, 4, 3, per_sm=2),
        cfg(64, 128, 64, 4, 3, per_sm=2),
    ]


def _tma_block_shapes(nargs):
    """Autotuner pre-hook: the descriptors' boxes are the config's tiles (a K-major operand's
    box is (rows, BLOCK_K), an M- or N-major one's (BLOCK_K, rows))."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["A_DESC"].block_shape = [bm, bk] if nargs["A_KMAJOR"] else [bk, bm]
    nargs["B_DESC"].block_shape = [bn, bk] if nargs["B_KMAJOR"] else [bk, bn]


def _prune_tma_configs(configs, named_args, **kwargs):
    if is_interpreting():  # its one small config (BLOCK_K 32, below the 16-bit GPU minimum)
        return configs
    return _prune_configs(configs, {**named_args, "A": named_args["A_DESC"].base}, **kwargs)


@autotune(
    configs=_tma_configs(),
    key=["M", "N", "K", "EPILOGUE", "ACT", "HAS_DROPOUT", "A_KMAJOR", "B_KMAJOR"],
    prune_configs_by={"early_config_prune": _prune_tma_configs},
    reset_to_zero=["PART"],
)
@triton.jit
def _gemm_tma_kernel(
    A_DESC, B_DESC, C, BIAS, AUX, RNG, PART,
    M, N, K, stride_cm, stride_auxm,
    drop_thr, drop_scale,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_AUX: tl.constexpr, HAS_PART: tl.constexpr,
    DOT_FP32: tl.constexpr, INTERPRET: tl.constexpr, DROP_GROUPS: tl.constexpr,
    A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,
):
    """C (M, N) = epilogue(A (M, K) @ B (K, N)), 16-bit A and B through TMA descriptors:
    A_DESC over A (M, K) when A_KMAJOR, else over A^T (K, M); B_DESC over B^T (N, K) when
    B_KMAJOR, else over B (K, N).  With P = NUM_PROGRAMS (the SMs) x PROGRAMS_PER_SM, program i
    takes tiles i, i + P, ... (the grid is min(P, tiles))."""
    step = NUM_PROGRAMS * PROGRAMS_PER_SM
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    start = tl.program_id(0)
    # The epilogue's tile index is a second counter, not the loop variable: Triton's tutorial
    # does the same so that the software pipeliner, which issues the next tile's loads early,
    # never hands the epilogue a value of the next iteration.
    tile_out = start - step
    for tile in tl.range(start, num_pid_m * num_pid_n, step, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            off_k = ks * BLOCK_K
            if A_KMAJOR:
                a = A_DESC.load([off_m, off_k])  # (BM, BK)
            else:
                a = A_DESC.load([off_k, off_m]).T
            if B_KMAJOR:
                b = B_DESC.load([off_n, off_k]).T  # (BK, BN)
            else:
                b = B_DESC.load([off_k, off_n])
            acc = dot(a, b, acc, DOT_FP32, False)
        tile_out += step
        pid_m, pid_n = _tile_coords(tile_out, num_pid_m, num_pid_n, GROUP_M)
        _gemm_epilogue(acc, pid_m, pid_n, C, BIAS, AUX, RNG, PART, M, N, stride_cm, stride_auxm,
                       drop_thr, drop_scale, EPILOGUE, ACT, HAS_BIAS, HAS_DROPOUT, STORE_AUX, HAS_PART,
                       INTERPRET, DROP_GROUPS, BLOCK_M, BLOCK_N)


@triton.jit
def _act_bwd_kernel(
    DY, AUX, D, RNG, PART,
    M, N, stride_dym, stride_auxm, drop_thr, drop_scale,
    ACT: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_D: tl.constexpr, HAS_PART: tl.constexpr,
    INTERPRET: tl.constexpr, DROP_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Tile (row block program_id(0), column block program_id(1)): d = dy * act'(aux) * keep *
    scale (stored when STORE_D) and the tile's column sums (when HAS_PART)."""
    pid_m = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = rn < N
    mask = (rm < M)[:, None] & col_ok[None, :]
    rows = rm.to(tl.int64)[:, None]
    cols = rn[None, :]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    g = tl.load(DY + rows * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
    d = _dact(g, AUX, rows, cols, mask, N, stride_auxm,
              seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, ACT, HAS_DROPOUT,
              rm.to(tl.int64), tl.program_id(1) * BLOCK_N, BLOCK_M, BLOCK_N, DROP_GROUPS)
    if STORE_D:
        tl.store(D + rows * N + cols, cast_out(d, D.dtype.element_ty, INTERPRET), mask=mask)
    if HAS_PART:
        tl.store(PART + pid_m.to(tl.int64) * N + rn, tl.sum(tl.where(mask, d, 0.0).to(tl.float64), axis=0), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Launchers


def _check_matrix(name: str, t, dtype, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"ffn: {name} must be a 2-D tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"ffn: {name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"ffn: {name} must be on {device}, got {t.device}")


def _activation_code(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"ffn: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _dropout_args(dropout_p: float, rng, x: torch.Tensor):
    """(has_dropout, rng tensor or dummy, threshold, scale)."""
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"ffn: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return False, x, 0, 1.0
    if rng is None or rng.dtype != torch.int64 or rng.numel() != 2 or rng.device != x.device:
        raise ValueError(f"ffn: rng must be an int64 tensor [seed, offset] on {x.device} when dropout_p > 0")
    return True, rng.contiguous(), dropout_threshold(dropout_p), dropout_scale(dropout_p)


def _dot_flags(dtype: torch.dtype, allow_tf32: bool):
    """(DOT_FP32, IEEE): fp32 operands under the interpreter (bf16 dots are wrong there), exact
    fp32 products unless torch's setting allows tf32."""
    return is_interpreting(), dtype == torch.float32 and not allow_tf32


# Which GEMM kernel runs: "auto" (TMA on a GPU of compute capability >= 9 for 16-bit operands
# that TMA can address, else the pointer kernel; the pointer kernel under the interpreter),
# "tma" (TMA wherever the operands allow it, the interpreter included: the tests) or "pointer".
GEMM_PATH_ENV = "TRANSFORMER_FAST_TRITON_GEMM"


# The first failure of the TMA kernel under "auto" (it then falls back to the pointer kernel).
_TMA_FAILED: list = []


def _gemm_path() -> str:
    path = os.environ.get(GEMM_PATH_ENV, "auto") or "auto"
    if path not in ("auto", "tma", "pointer"):
        raise ValueError(f"{GEMM_PATH_ENV} must be auto, tma or pointer; got {path!r}")
    return path


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _tma_capable(t) -> bool:
    """Whether ``auto`` may give t's GEMM to the TMA kernel: compiled, on a Hopper or newer."""
    return not is_interpreting() and t.is_cuda and _hopper_or_newer(t.device.index)


def _tma_view(t, rows, cols, stride_r, stride_c, k_is_cols):
    """(shape, strides, k_major) of a TMA descriptor over the (rows, cols) operand with these
    strides, or None when TMA cannot address it: no empty dimension (a descriptor's dims are
    positive), the contiguous dimension with stride 1, the other a multiple of 16 bytes and at
    least one line long (cuTensorMapEncodeTiled: no broadcast or overlapping lines), the base
    16-byte aligned.  k_major: the K dimension is the contiguous one (k_is_cols says which of
    rows / cols is K)."""
    esize = t.element_size()
    if t.data_ptr() % 16 or rows == 0 or cols == 0:
        return None
    if stride_c == 1 and (stride_r * esize) % 16 == 0 and stride_r >= cols:
        return [rows, cols], [stride_r, 1], k_is_cols
    if stride_r == 1 and (stride_c * esize) % 16 == 0 and stride_c >= rows:
        return [cols, rows], [stride_c, 1], not k_is_cols
    return None


def _tma_operands(a, b, m, n, k, strides_a, strides_b):
    """(A descriptor, A_KMAJOR, B descriptor, B_KMAJOR) for the TMA kernel, or None."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    path = _gemm_path()
    if path == "pointer" or a.dtype not in (torch.float16, torch.bfloat16) or (path == "auto" and _TMA_FAILED):
        return None
    if path == "auto" and not _tma_capable(a):
        return None
    va = _tma_view(a, m, k, strides_a[0], strides_a[1], k_is_cols=True)
    # B (K, N): K is its rows, so a K-major B is described as B^T (N, K).
    vb = _tma_view(b, k, n, strides_b[0], strides_b[1], k_is_cols=False)
    if va is None or vb is None:
        return None
    # Boxes are set per config by _tma_block_shapes; these placeholders only pass validation.
    desc_a = TensorDescriptor(a, va[0], va[1], [16, 16])
    desc_b = TensorDescriptor(b, vb[0], vb[1], [16, 16])
    return desc_a, va[2], desc_b, vb[2]


def _launch_gemm(a, b, c, m, n, k, strides_a, strides_b, *, epilogue, act=0, bias=None, aux=None,
                 stride_auxm=0, store_aux=False, drop=(False, None, 0, 1.0), part=None, allow_tf32=False):
    has_dropout, rng_t, thr, scale = drop
    dot_fp32, ieee = _dot_flags(a.dtype, allow_tf32)
    dummy = c
    epilogue_tensors = (bias if bias is not None else dummy, aux if aux is not None else dummy,
                        rng_t if has_dropout else dummy, part if part is not None else dummy)
    flags = dict(EPILOGUE=epilogue, ACT=act, HAS_BIAS=bias is not None, HAS_DROPOUT=has_dropout,
                 STORE_AUX=store_aux, HAS_PART=part is not None, DOT_FP32=dot_fp32,
                 INTERPRET=is_interpreting(), DROP_GROUPS=has_dropout and n % 4 == 0)
    tma = _tma_operands(a, b, m, n, k, strides_a, strides_b)
    with device_guard(c):
        if tma is not None:
            desc_a, a_kmajor, desc_b, b_kmajor = tma
            programs = _INTERPRET_PROGRAMS if is_interpreting() else sm_count(c.device)
            kernel = _gemm_tma_kernel
            grid = lambda meta: (min(programs * meta["PROGRAMS_PER_SM"],  # noqa: E731
                                     cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])),)
            try:
                kernel[grid](desc_a, desc_b, c, *epilogue_tensors, m, n, k, c.stride(0), stride_auxm, thr,
                             scale, **flags, A_KMAJOR=a_kmajor, B_KMAJOR=b_kmajor, NUM_PROGRAMS=programs)
            except Exception as exc:  # noqa: BLE001
                if _gemm_path() != "auto":
                    raise
                # The TMA kernel is newer than the pointer kernel (and the Triton on a user's
                # machine may compile it differently): where it cannot be compiled or launched,
                # "auto" says so once and keeps to the pointer kernel for the process.
                _TMA_FAILED.append(f"{type(exc).__name__}: {exc}")
                warnings.warn(f"transformer_fast: the Triton TMA GEMM failed ({_TMA_FAILED[0][:300]}); "
                              f"the FFN GEMMs use the pointer kernel from now on ({GEMM_PATH_ENV}=pointer "
                              "silences this)", RuntimeWarning, stacklevel=2)
                tma = None
        if tma is None:
            kernel = _gemm_kernel
            grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
            kernel[grid](a, b, c, *epilogue_tensors, m, n, k,
                         strides_a[0], strides_a[1], strides_b[0], strides_b[1], c.stride(0), stride_auxm,
                         thr, scale, **flags, IEEE=ieee)
    # For failure reports (recent_gemm_launches): the kernel and the autotuner's pick for this launch.
    _RECENT_LAUNCHES.append((m, n, k, epilogue, act, has_dropout, a.dtype, ieee,
                             "pointer" if tma is None else "tma", getattr(kernel, "best_config", None)))


# The last GEMM launches (a failing numerics test prints them: which config computed what).
_RECENT_LAUNCHES = collections.deque(maxlen=16)


def recent_gemm_kernels() -> tuple[set, str | None]:
    """The kernels ("tma", "pointer") of the recent GEMM launches, and why the TMA kernel was
    given up for the process (None if it was not): a benchmark row says what it timed."""
    return {launch[8] for launch in _RECENT_LAUNCHES}, (_TMA_FAILED[0] if _TMA_FAILED else None)


def recent_gemm_launches() -> str:
    """One line per recent GEMM launch, oldest first: shape, epilogue, precision (ieee = exact
    fp32, tf32, or the 16-bit dtype), the kernel (tma or pointer) and the config the autotuner
    ran."""
    lines = []
    for m, n, k, epi, act, drop, dtype, ieee, kernel, cfg in _RECENT_LAUNCHES:
        prec = "ieee" if ieee else ("tf32" if dtype == torch.float32 else str(dtype).replace("torch.", ""))
        if cfg is None:
            desc = "config ?"
        else:
            desc = " ".join(f"{key}={v}" for key, v in cfg.kwargs.items())
            desc += f" warps={cfg.num_warps} stages={cfg.num_stages}"
        lines.append(f"  M={m} N={n} K={k} {'fwd' if epi == EPI_FWD else 'dact'} act={act} "
                     f"dropout={int(drop)} {prec} {kernel}: {desc}")
    return "\n".join(lines)


# The launch's BLOCK_M is chosen by the autotuner, so the column-sum partials of the dact
# epilogue get a row per tile of the smallest BLOCK_M of any config (zeroed: unused rows add 0).
_MIN_BLOCK_M = min(c.kwargs["BLOCK_M"] for c in _gemm_configs() + _tma_configs())


def _part_rows(m: int) -> int:
    return cdiv(m, _MIN_BLOCK_M)


def _unit_cols(t):
    """The epilogue and elementwise kernels address rows by stride and columns by 1."""
    return t if t is None or t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _finish_colsum(part: torch.Tensor, n: int, dtype) -> torch.Tensor:
    # Stage 2 of the bias gradient: a deterministic torch sum over the row tiles.
    return part.sum(dim=0).to(dtype) if part.shape[0] else torch.zeros(n, dtype=dtype, device=part.device)


def linear_fwd(x, w, b, activation: str, dropout_p: float, rng, store_pre: bool, allow_tf32: bool):
    """-> (y, pre); see the module docstring."""
    _check_matrix("x", x, x.dtype, x.device)
    _check_matrix("w", w, x.dtype, x.device)
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"ffn: w must have shape (N, {k}), got {tuple(w.shape)}")
    if b is not None and (b.shape != (n,) or b.dtype != x.dtype or b.device != x.device):
        raise ValueError(f"ffn: b must be a ({n},) {x.dtype} tensor on {x.device}")
    if b is not None:
        b = b.contiguous()  # the epilogue reads BIAS + column (a strided or expanded b would not be)
    act = _activation_code(activation)
    drop = _dropout_args(dropout_p, rng, x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pre = torch.empty((m, n), dtype=x.dtype, device=x.device) if store_pre else x.new_empty(_EMPTY)
    if m == 0 or n == 0:
        return y, pre
    # x @ w^T: B[k, j] = w[j, k], read through w's strides (no transpose copy).
    _launch_gemm(x, w, y, m, n, k, (x.stride(0), x.stride(1)), (w.stride(1), w.stride(0)),
                 epilogue=EPI_FWD, act=act, bias=b, aux=pre if store_pre else None,
                 stride_auxm=n if store_pre else 0, store_aux=store_pre, drop=drop, allow_tf32=allow_tf32)
    return y, pre


def linear_dgrad(dy, w, aux, activation: str, dropout_p: float, rng, want_dbias: bool, allow_tf32: bool):
    """-> (d, dbias); see the module docstring."""
    _check_matrix("dy", dy, dy.dtype, dy.device)
    _check_matrix("w", w, dy.dtype, dy.device)
    m, k = dy.shape
    n = w.shape[1]
    if w.shape[0] != k:
        raise ValueError(f"ffn: w must have shape ({k}, N), got {tuple(w.shape)}")
    act = _activation_code(activation)
    if act != 0:
        _check_matrix("aux", aux, dy.dtype, dy.device)
        if tuple(aux.shape) != (m, n):
            raise ValueError(f"ffn: aux must have shape ({m}, {n}), got {tuple(aux.shape)}")
        aux = _unit_cols(aux)
    drop = _dropout_args(dropout_p, rng, dy)
    d = torch.empty((m, n), dtype=dy.dtype, device=dy.device)
    part = torch.empty((_part_rows(m), n), dtype=torch.float64, device=dy.device) if want_dbias else None
    if m > 0 and n > 0:
        if part is not None:
            part.zero_()  # rows past the launch's tile count stay zero
        _launch_gemm(dy, w, d, m, n, k, (dy.stride(0), dy.stride(1)), (w.stride(0), w.stride(1)),
                     epilogue=EPI_DACT, act=act, aux=aux, stride_auxm=aux.stride(0) if act else 0,
                     drop=drop, part=part, allow_tf32=allow_tf32)
    dbias = _finish_colsum(part, n, dy.dtype) if want_dbias else dy.new_empty(_EMPTY)
    if want_dbias and m == 0:
        dbias = torch.zeros(n, dtype=dy.dtype, device=dy.device)
    return d, dbias


def colsum(dy) -> torch.Tensor:
    """sum over rows of dy (M, N) -> (N,) in dy's dtype (fp64 partials, no atomics)."""
    _, db = act_bwd(dy, None, "none", 0.0, None, True, store=False)
    return db


def linear_wgrad(dy, x, want_dbias: bool, allow_tf32: bool):
    """-> (dw, dbias); see the module docstring."""
    _check_matrix("dy", dy, dy.dtype, dy.device)
    _check_matrix("x", x, dy.dtype, dy.device)
    m, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != m:
        raise ValueError(f"ffn: x must have {m} rows, got {tuple(x.shape)}")
    dw = torch.empty((n, k), dtype=dy.dtype, device=dy.device)
    if n > 0 and k > 0:
        if m == 0:
            dw.zero_()
        else:
            # dy^T @ x: A[i, r] = dy[r, i] through dy's strides; the reduction runs over the rows.
            _launch_gemm(dy, x, dw, n, k, m, (dy.stride(1), dy.stride(0)), (x.stride(0), x.stride(1)),
                         epilogue=EPI_FWD, allow_tf32=allow_tf32)
    dbias = colsum(dy) if want_dbias else dy.new_empty(_EMPTY)
    return dw, dbias


def act_bwd(dy, aux, activation: str, dropout_p: float, rng, want_dbias: bool, store: bool = True):
    """-> (d, dbias); see the module docstring (``store=False``: column sums only)."""
    _check_matrix("dy", dy, dy.dtype, dy.device)
    m, n = dy.shape
    act = _activation_code(activation)
    if act != 0:
        _check_matrix("aux", aux, dy.dtype, dy.device)
        if tuple(aux.shape) != (m, n):
            raise ValueError(f"ffn: aux must have shape ({m}, {n}), got {tuple(aux.shape)}")
        aux = _unit_cols(aux)
    dy = _unit_cols(dy)
    drop = _dropout_args(dropout_p, rng, dy)
    has_dropout, rng_t, thr, scale = drop
    d = torch.empty((m, n), dtype=dy.dtype, device=dy.device) if store else dy.new_empty(_EMPTY)
    tiles_m = cdiv(m, EW_BLOCK_M)
    part = torch.empty((tiles_m, n), dtype=torch.float64, device=dy.device) if want_dbias else None
    if m > 0 and n > 0:
        with device_guard(dy):
            _act_bwd_kernel[(tiles_m, cdiv(n, EW_BLOCK_N))](
                dy, aux if act else dy, d if store else dy, rng_t if has_dropout else dy,
                part if part is not None else dy,
                m, n, dy.stride(0), aux.stride(0) if act else 0, thr, scale,
                ACT=act, HAS_DROPOUT=has_dropout, STORE_D=store, HAS_PART=part is not None,
                INTERPRET=is_interpreting(), DROP_GROUPS=has_dropout and n % 4 == 0,
                BLOCK_M=EW_BLOCK_M, BLOCK_N=EW_BLOCK_N, num_warps=4,
            )
    dbias = _finish_colsum(part, n, dy.dtype) if want_dbias else dy.new_empty(_EMPTY)
    return d, dbias
