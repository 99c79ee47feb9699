"""Fused residual-add (+ dropout) + LayerNorm: Triton kernels and launchers (no autograd here).

Contract (shared with the C++/CUDA backends; see transformer_fast/ops/layer_norm.py):

  add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, rng, prenorm)
      -> (y, h, mean, rstd)
  add_layer_norm_bwd(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p, rng)
      -> (dx, dresidual, dweight, dbias)

x, residual, dy, dh: (M, N), one dtype (fp32/fp16/bf16), unit stride along N (or N == 1), any
row stride (passed to the kernels, never copied).  weight/bias: (N,) or None, in x's dtype or
fp32.  rng: int64 [seed, offset] on x's device (None when dropout_p == 0); the dropout mask is
transformer_fast.philox over the row-major element index i * N + j and is regenerated in
backward (h is not saved).  Statistics and all arithmetic are fp32; h is kept in fp32 inside the
kernels (it is rounded to x's dtype only when stored as the prenorm output).

Kernel plan (bandwidth bound, tuned for H100):
  * "fused" path, next_pow2(N) <= FWD_MAX_FUSED (fwd) / BWD_MAX_FUSED (bwd): a tile of
    BLOCK_M rows x the whole row (BLOCK_N = next_pow2(N)) lives in registers; BLOCK_M > 1
    packs several short rows into one program (~TILE_ELEMS elements per program).
    One read of x and residual, one write of y (and h): the minimum traffic.
  * "looped" path, larger N: a per-row statistics kernel walks the row in LOOP_BLOCK chunks
    (fwd: chunked Welford/Chan merge -> mean, rstd; bwd: mean(g * xhat), mean(g)), then the
    same elementwise kernel as the fused path runs on a 2-D grid (row blocks x column chunks)
    with the statistics loaded instead of computed.  Any N works (1 ... 65536 and beyond).
  * floating point: the kernels are compiled with enable_fp_fusion=False (no mul + add -> fma
    contraction, by LLVM or by ptxas) and every division is tl.div_rn, sqrt tl.sqrt_rn: the GPU
    then rounds each operation as written, as the interpreter does.  Fused, `g - mean(g)` with
    g = dy * w became fma(dy, w, -mean(g)), leaving the product's rounding error where the exact
    result is 0 (a width-1 row: dx = rstd * 6e-8 |g| ~ 1e-5 instead of 0, on an H200); Triton's
    fp32 `/` is div.full.f32 (2 ulp) on NVIDIA.  The C++ cpu backend is built with
    -ffp-contract=off for the same reason (setup.py).
  * backward dweight/dbias: two stages, no atomics (deterministic).  Each program of the
    backward kernel owns a group of row blocks (a persistent, strided loop) and one column
    block; it accumulates dy * xhat and dy in fp32 registers (one running sum per row slot of
    the tile), sums the slots in fp64 and writes its partial row of a (num_groups, N) fp64
    buffer once.  torch.sum over dim 0 (fp64, deterministic) finishes the reduction.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import (cast_out, cdiv, check_rows, device_guard, is_interpreting, next_power_of_2,
                                             sm_count)
from transformer_fast.kernels.philox import dropout_keep, dropout_scale, dropout_threshold, load_rng_if

# Largest row kept whole in registers (elements, a power of two), forward / backward.
FWD_MAX_FUSED = 16384
BWD_MAX_FUSED = 8192
# Chunk length of the looped (large-N) path.
LOOP_BLOCK = 4096
# Elements per program targeted when packing several short rows into one program.
TILE_ELEMS = 4096
MAX_BLOCK_M = 128
# Backward packs fewer rows per tile: its dweight/dbias partials sum the tile's rows (short
# sums keep fp32 accumulation error low; the long reduction is torch.sum's pairwise one).
BWD_MAX_BLOCK_M = 16

_EMPTY = (0,)
# Compile options of every launch here: no fma contraction (see the module docstring).  The
# interpreter ignores them.
_FP_OPTIONS = {"enable_fp_fusion": False}


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _div(a, b):
    """a / b correctly rounded (Triton's fp32 `/` is the approximate div.full.f32 on NVIDIA);
    b may be an integer (a row length, possibly specialised to the constant 1)."""
    return tl.div_rn(a, b * 1.0)


@triton.jit
def _load_h_keep(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                 seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale,
                 HAS_DROPOUT: tl.constexpr):
    """(h, keep): h = residual + dropout(x) in fp32 (0 where ``mask`` is False) and the dropout
    keep mask (``mask`` itself without dropout).  ``rows64`` (int64) and ``cols`` broadcast
    against each other to the tile shape; the Philox index is row * N + col."""
    x = tl.load(X + rows64 * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + rows64 * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = dropout_keep(seed_lo, seed_hi, rows64 * N + cols, off_lo, off_hi, drop_thr)
        x = tl.where(keep, x * drop_scale, 0.0)
    else:
        keep = mask
    return x + r, keep


@triton.jit
def _load_h(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
            seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale,
            HAS_DROPOUT: tl.constexpr):
    h, _ = _load_h_keep(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                        seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
    return h


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_stats_kernel(
    X, R, MEAN, RSTD, RNG,
    N, stride_xm, stride_rm, eps, drop_thr, drop_scale,
    HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One row per program: mean and rstd of h over the row, in LOOP chunks of BLOCK_N
    (Welford per chunk, merged with Chan's formula: no catastrophic cancellation)."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    rows64 = rows.to(tl.int64)[:, None]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    mean = tl.zeros([1], dtype=tl.float32)
    m2 = tl.zeros([1], dtype=tl.float32)
    count = tl.zeros([1], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = (start + tl.arange(0, BLOCK_N))[None, :]
        mask = cols < N
        h = _load_h(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                    seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
        n_b = tl.sum(mask.to(tl.float32), axis=1)  # elements in this chunk (>= 1)
        mean_b = _div(tl.sum(h, axis=1), n_b)
        d = tl.where(mask, h - mean_b[:, None], 0.0)
        m2_b = tl.sum(d * d, axis=1)
        n_ab = count + n_b
        delta = mean_b - mean
        mean = mean + delta * _div(n_b, n_ab)
        m2 = m2 + m2_b + delta * delta * _div(count * n_b, n_ab)
        count = n_ab
    var = _div(m2, N)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    tl.store(MEAN + rows, mean)
    tl.store(RSTD + rows, rstd)


@triton.jit
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, RNG,
    M, N, stride_xm, stride_rm, eps, drop_thr, drop_scale,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_H: tl.constexpr, COMPUTE_STATS: tl.constexpr, F64_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Tile (BLOCK_M rows x BLOCK_N columns): row block program_id(0), column block
    program_id(1) (rows on grid axis 0, which allows 2**31 - 1 programs; axis 1 is <= 65535).
    COMPUTE_STATS: the tile holds whole rows (BLOCK_N >= N, one column block); mean/rstd are
    computed here and stored.  Otherwise they are loaded (written by _fwd_stats_kernel)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols1 < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols = cols1[None, :]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    h = _load_h(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
    if COMPUTE_STATS:
        if F64_STATS:
            # fp32 inputs: the row sums in fp64, each statistic rounded once.  With a large
            # common offset (mean / std ~1e4) an fp32 sum put the mean an ulp off, which
            # shifts every xhat of the row (up to 2.3x past the oracle's bound, interpreter).
            mean64 = tl.sum(h.to(tl.float64), axis=1) / N
            mean = mean64.to(tl.float32)
            # What rounding the mean to fp32 dropped: y centres on mean + mean_lo, so a row whose
            # mean is large against its spread keeps it (the saved mean stays fp32; backward
            # centres xhat on its row mean instead).  benchmarks/NOTES.md, "The modules under a
            # fuzzer".
            mean_lo = (mean64 - mean.to(tl.float64)).to(tl.float32)
            # (centred on mean + mean_lo: on mean alone the variance gained mean_lo^2)
            d = tl.where(mask, (h - mean[:, None]) - mean_lo[:, None], 0.0).to(tl.float64)
            var = (tl.sum(d * d, axis=1) / N).to(tl.float32)
        else:
            mean = _div(tl.sum(h, axis=1), N)
            mean_lo = tl.zeros([BLOCK_M], dtype=tl.float32)
            d = tl.where(mask, h - mean[:, None], 0.0)
            var = _div(tl.sum(d * d, axis=1), N)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
    else:
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        mean_lo = tl.zeros([BLOCK_M], dtype=tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    y = ((h - mean[:, None]) - mean_lo[:, None]) * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols1, mask=col_ok, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols1, mask=col_ok, other=0.0).to(tl.float32)
        y = y + b[None, :]
    out_off = rows64 * N + cols
    tl.store(Y + out_off, cast_out(y, Y.dtype.element_ty, INTERPRET), mask=mask)
    if STORE_H:
        tl.store(H + out_off, cast_out(h, H.dtype.element_ty, INTERPRET), mask=mask)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_stats_kernel(
    DY, X, R, W, MEAN, RSTD, RNG, C1, C2, C3,
    N, stride_dym, stride_xm, stride_rm, drop_thr, drop_scale,
    HAS_W: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One row per program, looped over the row: C3 = mean_j(xhat), C2 = mean_j(g),
    C1 = mean_j(g * (xhat - C3)), g = dy * weight (see _bwd_kernel for C3)."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    rows64 = rows.to(tl.int64)[:, None]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    mean = tl.load(MEAN + rows)
    rstd = tl.load(RSTD + rows)
    acc1 = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols1 = start + tl.arange(0, BLOCK_N)
        cols = cols1[None, :]
        mask = cols < N
        h = _load_h(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                    seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        g = tl.load(DY + rows64 * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(W + cols1, mask=cols1 < N, other=0.0).to(tl.float32)
            g = g * w[None, :]
        acc1 += g * xhat
        acc2 += g
        acc3 += xhat
    c2 = _div(tl.sum(acc2, axis=1), N)
    c3 = _div(tl.sum(acc3, axis=1), N)
    tl.store(C1 + rows, _div(tl.sum(acc1, axis=1), N) - c3 * c2)
    tl.store(C2 + rows, c2)
    tl.store(C3 + rows, c3)


@triton.jit
def _bwd_kernel(
    DY, DH, X, R, W, MEAN, RSTD, RNG, C1, C2, C3, DX, DRES, DW_PART, DB_PART,
    M, N, stride_dym, stride_dhm, stride_xm, stride_rm, drop_thr, drop_scale,
    num_row_blocks, num_groups,
    HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, COMPUTE_STATS: tl.constexpr, F64_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (pid_g, pid_n): row blocks pid_g, pid_g + num_groups, ... of column block pid_n.
    Writes dresidual (and dx) for its tiles and its fp32 partial sums of dy * (xhat - xbar) and
    dy for its column block into row pid_g of DW_PART / DB_PART (every element, no atomics).

    dresidual = rstd * (g - mean(g) - (xhat - xbar) * mean(g * (xhat - xbar))), xbar = mean(xhat):
    xbar is 0 in exact arithmetic, but the computed xhat carries the fp32 mean's rounding as a
    shift of the whole row, which the uncentred formula turns into a first-order error where a
    row's mean is large against its spread (27 of 300 fresh 2-wide fp32 draws failed the
    oracle; the C++ cpu kernel does the same, benchmarks/NOTES.md).

    F64_ROWS (fp32 rows of at most 8, one tile each): the row sums and dresidual in float64 from
    the fp32 xhat and g, rounded once, as the cpu kernel's tail: on 2-3 wide rows, where
    dresidual is a cancellation, the fp32 arithmetic's roundings missed the oracle's bound in
    39 of 3000 fresh 2-wide draws, 18 now (benchmarks/NOTES.md "The cpu add_layer_norm
    backward's tail in double")."""
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols1 < N
    cols = cols1[None, :]
    seed_lo, seed_hi, off_lo, off_hi = load_rng_if(RNG, HAS_DROPOUT)
    if HAS_W:
        w = tl.load(W + cols1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for rb in range(pid_g, num_row_blocks, num_groups):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        h, keep = _load_h_keep(X, R, rows64, cols, mask, N, stride_xm, stride_rm,
                               seed_lo, seed_hi, off_lo, off_hi, drop_thr, drop_scale, HAS_DROPOUT)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        dy = tl.load(DY + rows64 * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        if F64_ROWS:  # the rest of the row's arithmetic in float64 (see the docstring)
            g = g.to(tl.float64)
            xhat = xhat.to(tl.float64)
            rstd = rstd.to(tl.float64)
            c2 = tl.sum(g, axis=1)[:, None] / N
            c3 = tl.sum(xhat, axis=1)[:, None] / N
            c1 = tl.sum(g * xhat, axis=1)[:, None] / N - c3 * c2
        elif COMPUTE_STATS:
            c2 = _div(tl.sum(g, axis=1), N)[:, None]
            c3 = _div(tl.sum(xhat, axis=1), N)[:, None]
            c1 = _div(tl.sum(g * xhat, axis=1), N)[:, None] - c3 * c2
        else:
            c1 = tl.load(C1 + rows, mask=row_ok, other=0.0)[:, None]
            c2 = tl.load(C2 + rows, mask=row_ok, other=0.0)[:, None]
            c3 = tl.load(C3 + rows, mask=row_ok, other=0.0)[:, None]
        dsum = (g - c2 - (xhat - c3) * c1) * rstd
        if HAS_DH:
            dsum += tl.load(DH + rows64 * stride_dhm + cols, mask=mask, other=0.0).to(dsum.dtype)
        out_off = rows64 * N + cols
        tl.store(DRES + out_off, cast_out(dsum, DRES.dtype.element_ty, INTERPRET), mask=mask)
        if HAS_DROPOUT:
            dx = tl.where(keep, dsum * drop_scale, 0.0)
            tl.store(DX + out_off, cast_out(dx, DX.dtype.element_ty, INTERPRET), mask=mask)
        if HAS_DW:  # centred as dresidual's xhat: sum(dy * (xhat - xbar))
            dw_acc += dy * (xhat - c3).to(tl.float32)
        if HAS_DB:
            db_acc += dy
    # The tile's row slots are summed in float64 (once per program, after the loop), so a
    # partial carries only the fp32 rounding of its per-slot running sums.
    if HAS_DW:
        tl.store(DW_PART + pid_g * N + cols1, tl.sum(dw_acc.to(tl.float64), axis=0), mask=col_ok)
    if HAS_DB:
        tl.store(DB_PART + pid_g * N + cols1, tl.sum(db_acc.to(tl.float64), axis=0), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Launch configuration


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device)
    return 4  # the interpreter (CPU tensors): few programs, each looping


def _num_warps(tile_elems: int) -> int:
    """~8 elements per thread per live tensor (one 16-byte vector of a 16-bit row), 1..32 warps.
    Measured with ptxas for sm_90 (Triton 3.6 and 3.8, bf16): forward 4096/16 warps 57-77
    registers, 8192/32 warps 44-49, 16384/32 warps 64 with a small spill; backward 4096/16 warps
    ~105, 8192/32 warps 64, no spills (16 warps at 8192 spilled)."""
    return max(1, min(32, tile_elems // 256))


def _tile(n: int, max_fused: int, m: int, max_block_m: int):
    """(fused, BLOCK_M, BLOCK_N, num_warps) for rows of n elements."""
    block_n = next_power_of_2(n)
    if block_n <= max_fused:
        block_m = max(1, min(max_block_m, TILE_ELEMS // block_n, next_power_of_2(m)))
        return True, block_m, block_n, _num_warps(block_m * block_n)
    return False, 1, LOOP_BLOCK, _num_warps(LOOP_BLOCK)


def _check_2d(name: str, t: torch.Tensor, m: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if t.dim() != 2 or t.shape[0] != m or t.shape[1] != n:
        raise ValueError(f"add_layer_norm: {name} must have shape ({m}, {n}), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"add_layer_norm: {name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"add_layer_norm: {name} must be on {device}, got {t.device}")
    if n > 1 and t.stride(1) != 1:
        t = t.contiguous()  # the launcher contract promises unit stride; stay safe anyway
    return t


def _check_param(name: str, t, n: int, x: torch.Tensor):
    if t is None:
        return None
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"add_layer_norm: {name} must have shape ({n},), got {tuple(t.shape)}")
    if t.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"add_layer_norm: {name} must be {x.dtype} or torch.float32, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"add_layer_norm: {name} must be on {x.device}, got {t.device}")
    return t.contiguous()


def _dropout_args(dropout_p: float, rng, x: torch.Tensor):
    """(has_dropout, rng tensor or dummy, threshold, scale)."""
    if dropout_p < 0.0 or dropout_p > 1.0:
        raise ValueError(f"add_layer_norm: dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p == 0.0:
        return False, x, 0, 1.0
    if rng is None:
        raise ValueError("add_layer_norm: rng (int64 [seed, offset]) is required when dropout_p > 0")
    if rng.dtype != torch.int64 or rng.numel() < 2 or rng.device != x.device:
        raise ValueError(
            f"add_layer_norm: rng must be an int64 tensor [seed, offset] on {x.device}, got "
            f"{rng.dtype} {tuple(rng.shape)} on {rng.device}"
        )
    return True, rng.contiguous(), dropout_threshold(dropout_p), dropout_scale(dropout_p)


# ---------------------------------------------------------------------------------------------
# Launchers


def add_layer_norm_fwd(x, residual, weight, bias, eps: float, dropout_p: float, rng, prenorm: bool):
    """-> (y, h, mean, rstd); see the module docstring."""
    if x.dim() != 2:
        raise ValueError(f"add_layer_norm: x must be 2-D (M, N), got shape {tuple(x.shape)}")
    m, n = x.shape
    x = _check_2d("x", x, m, n, x.dtype, x.device)
    residual = _check_2d("residual", residual, m, n, x.dtype, x.device)
    weight = _check_param("weight", weight, n, x)
    bias = _check_param("bias", bias, n, x)
    has_dropout, rng_t, thr, scale = _dropout_args(dropout_p, rng, x)

    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device) if prenorm else x.new_empty(_EMPTY)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    check_rows("add_layer_norm", m, "x.shape[0]")
    if m == 0:
        return y, h, mean, rstd
    if n == 0:  # mean of nothing: NaN, as the reference
        mean.fill_(float("nan"))
        rstd.fill_(float("nan"))
        return y, h, mean, rstd

    fused, block_m, block_n, num_warps = _tile(n, FWD_MAX_FUSED, m, MAX_BLOCK_M)
    dummy = mean
    with device_guard(x):
        if not fused:
            _fwd_stats_kernel[(m,)](
                x, residual, mean, rstd, rng_t,
                n, x.stride(0), residual.stride(0), float(eps), thr, scale,
                HAS_DROPOUT=has_dropout, BLOCK_N=block_n, num_warps=num_warps, **_FP_OPTIONS,
            )
        grid = (cdiv(m, block_m), cdiv(n, block_n))
        _fwd_kernel[grid](
            x, residual,
            weight if weight is not None else dummy,
            bias if bias is not None else dummy,
            y, h if prenorm else y, mean, rstd, rng_t,
            m, n, x.stride(0), residual.stride(0), float(eps), thr, scale,
            HAS_W=weight is not None, HAS_B=bias is not None, HAS_DROPOUT=has_dropout,
            STORE_H=bool(prenorm), COMPUTE_STATS=fused, F64_STATS=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=is_interpreting(), num_warps=num_warps,
            **_FP_OPTIONS,
        )
    return y, h, mean, rstd


def add_layer_norm_bwd(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p: float, rng):
    """-> (dx, dresidual, dweight, dbias); see the module docstring."""
    if x.dim() != 2:
        raise ValueError(f"add_layer_norm: x must be 2-D (M, N), got shape {tuple(x.shape)}")
    m, n = x.shape
    x = _check_2d("x", x, m, n, x.dtype, x.device)
    residual = _check_2d("residual", residual, m, n, x.dtype, x.device)
    dy = _check_2d("dy", dy, m, n, x.dtype, x.device)
    if dh is not None:
        dh = _check_2d("dh", dh, m, n, x.dtype, x.device)
    weight = _check_param("weight", weight, n, x)
    bias = _check_param("bias", bias, n, x)
    mean = mean.reshape(m).to(torch.float32).contiguous()
    rstd = rstd.reshape(m).to(torch.float32).contiguous()
    has_dropout, rng_t, thr, scale = _dropout_args(dropout_p, rng, x)

    dres = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device) if has_dropout else x.new_empty(_EMPTY)
    if m == 0 or n == 0:
        dw = torch.zeros((n,), dtype=weight.dtype, device=x.device) if weight is not None else x.new_empty(_EMPTY)
        db = torch.zeros((n,), dtype=bias.dtype, device=x.device) if bias is not None else x.new_empty(_EMPTY)
        return dx, dres, dw, db

    fused, block_m, block_n, num_warps = _tile(n, BWD_MAX_FUSED, m, BWD_MAX_BLOCK_M)
    num_row_blocks = cdiv(m, block_m)
    num_col_blocks = cdiv(n, block_n)
    # Persistent groups: enough resident programs to cover the GPU, each looping over row blocks.
    resident = _num_sms(x.device) * max(1, 32 // num_warps)
    num_groups = max(1, min(num_row_blocks, cdiv(resident, num_col_blocks)))
    has_dw = weight is not None
    has_db = bias is not None
    dw_part = torch.empty((num_groups, n), dtype=torch.float64, device=x.device) if has_dw else None
    db_part = torch.empty((num_groups, n), dtype=torch.float64, device=x.device) if has_db else None
    dummy = mean
    with device_guard(x):
        if fused:
            c1 = c2 = c3 = dummy
        else:
            c1, c2, c3 = torch.empty((3, m), dtype=torch.float32, device=x.device).unbind(0)
            _bwd_stats_kernel[(m,)](
                dy, x, residual, weight if weight is not None else dummy, mean, rstd, rng_t, c1, c2, c3,
                n, dy.stride(0), x.stride(0), residual.stride(0), thr, scale,
                HAS_W=weight is not None, HAS_DROPOUT=has_dropout, BLOCK_N=block_n,
                num_warps=num_warps, **_FP_OPTIONS,
            )
        _bwd_kernel[(num_groups, num_col_blocks)](
            dy, dh if dh is not None else dy, x, residual,
            weight if weight is not None else dummy, mean, rstd, rng_t, c1, c2, c3,
            dx if has_dropout else dres, dres,
            dw_part if has_dw else dummy, db_part if has_db else dummy,
            m, n, dy.stride(0), dh.stride(0) if dh is not None else 0,
            x.stride(0), residual.stride(0), thr, scale,
            num_row_blocks, num_groups,
            HAS_W=weight is not None, HAS_DW=has_dw, HAS_DB=has_db, HAS_DH=dh is not None,
            HAS_DROPOUT=has_dropout, COMPUTE_STATS=fused,
            F64_ROWS=fused and block_n <= 8 and x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=is_interpreting(), num_warps=num_warps,
            **_FP_OPTIONS,
        )
        # Second stage: a deterministic float64 sum over the groups, one rounding at the end.
        dw = dw_part.sum(dim=0).to(weight.dtype) if has_dw else x.new_empty(_EMPTY)
        db = db_part.sum(dim=0).to(bias.dtype) if has_db else x.new_empty(_EMPTY)
    return dx, dres, dw, db
