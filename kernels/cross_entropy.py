"""Label-smoothed cross entropy over rows of logits, with the gradient written in place: the
row kernel of transformer_fast.models.fused_loss (no autograd here).

Contract:

  cross_entropy_rows(logits, target, keep, smoothing, write_grad) -> loss (rows,) float32

* logits: (rows, V) fp16 / bf16 / fp32, stride(-1) == 1, any row stride.  target (rows,) int64
  class ids in [0, V) where keep (an id outside is never read: the row's target term is then 0);
  keep (rows,) bool (False = ignored token).
* loss[r] = lse_r - (1 - eps) * z[r, t_r] - eps * mean_v z[r, v] (no mean term when eps == 0),
  0 where not keep; all arithmetic in fp32.
* write_grad: logits[r] is overwritten with the unscaled gradient of loss[r]:
  softmax(z_r) - eps / V - (1 - eps) * onehot(t_r), zeros where not keep; rounded to logits'
  dtype.

Plan (bandwidth bound): one program per row; pass 1 streams the row once for an online max /
rescaled sum of exponentials and the plain sum; pass 2 streams it again to write the gradient
over it.  Traffic: 2 reads and 1 write of the row, against the ~10 passes of fp32 copies that
the same math costs in separate torch ops (benchmarks/NOTES.md "The loss without the logits").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_fast.kernels.common import cast_out, is_interpreting, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_rows_kernel(
    z_ptr, stride_row, target_ptr, keep_ptr, loss_ptr, V, smoothing,
    WRITE_GRAD: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_row
    kept = tl.load(keep_ptr + row).to(tl.int32) != 0
    t = tl.load(target_ptr + row)
    cols0 = tl.arange(0, BLOCK)
    # Pass 1: running max m (per lane), sum of exp(z - m) and sum of z.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # A lane that has seen only -inf keeps s = 0 (exp(-inf - -inf) would be NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2((m - m_safe) * LOG2E) + tl.exp2((z - m_safe) * LOG2E)
        m = m_new
        total += tl.where(ok, z, 0.0)
    row_max = tl.max(m, axis=0)
    max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    m_lane = tl.where(m == float("-inf"), 0.0, m)
    sum_exp = tl.sum(s * tl.exp2((m_lane - max_safe) * LOG2E), axis=0)
    lse = max_safe + tl.log2(sum_exp) * LN2
    # The callers check targets (a device-side assert on a GPU); the bound here keeps an id out
    # of range from reading outside the row when those checks are off.
    z_target = tl.load(z_row + t, mask=kept & (t >= 0) & (t < V), other=0.0).to(tl.float32)
    loss = lse - (1.0 - smoothing) * z_target
    if SMOOTH:
        loss = loss - smoothing * (tl.sum(total, axis=0) / V)
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if WRITE_GRAD:
        for start in range(0, V, BLOCK):
            cols = start + cols0
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            g = tl.exp2((z - lse) * LOG2E)
            if SMOOTH:
                g = g - smoothing / V
            g = g - tl.where(cols == t, 1.0 - smoothing, 0.0)
            g = tl.where(kept, g, 0.0)
            tl.store(z_row + cols, cast_out(g, z_ptr.dtype.element_ty, INTERPRET), mask=ok)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, smoothing: float,
                       write_grad: bool) -> torch.Tensor:
    """Per-row label-smoothed cross entropy of (rows, V) logits; with write_grad, the rows'
    unscaled gradients overwrite the logits.  Returns (rows,) float32."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must have unit stride in its last dimension; got strides {logits.stride()}")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    block = min(4096, next_power_of_2(vocab))
    _cross_entropy_rows_kernel[(rows,)](
        logits, logits.stride(0), target, keep, loss, vocab, float(smoothing),
        WRITE_GRAD=write_grad, SMOOTH=smoothing > 0.0, BLOCK=block, INTERPRET=is_interpreting(),
        num_warps=8 if block >= 2048 else 4,
    )
    return loss
