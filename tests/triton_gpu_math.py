"""The GPU's approximate fp32 math under the Triton interpreter, for tests of exact-fp32 paths.

On a GPU tl.exp2 on fp32 compiles to ``ex2.approx.ftz.f32`` and ``/`` to ``div.full.f32``, each
within ~2 ulp; the interpreter computes them with numpy, correctly rounded, so without a model an
exact-fp32 kernel's pass rate under the interpreter says nothing about the GPU's (benchmarks/
NOTES.md, 2026-12-02).  The fixture moves each fp32 result by a full 2 ulp relative, the sign a
hash of the arguments' bits (deterministic, like the hardware: a backward's row-sum pass and its
gradient passes must see the same p); exp2 of an integer and division by 1 stay exact, subnormal
exp2 results are flushed.  It checks through a small kernel that the model is in force.
"""
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _exp2_div_kernel(X, Y, Z, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, tl.exp2(x))
    tl.store(Z + offs, 1.0 / (x + 4.0))


def _gpu_ulps(y, *args):
    """y (fp32) moved by a full 2 ulp relative, the sign a hash of the arguments' bits."""
    h = np.zeros(y.shape, dtype=np.uint64)
    for a in args:
        bits = np.broadcast_to(np.asarray(a, dtype=np.float32), y.shape).view(np.uint32).astype(np.uint64)
        h = (h * np.uint64(40503)) ^ (bits * np.uint64(2654435761))
    sign = np.where((h >> np.uint64(13)) & np.uint64(1), -1.0, 1.0)
    return (y * (1.0 + sign * 2.0 ** -22)).astype(np.float32)


def _exp2(x):
    y = np.exp2(x)
    if y.dtype != np.float32:
        return y
    y = np.where(x == np.round(x), y, _gpu_ulps(y, x))
    return np.where(np.abs(y) < np.float32(2.0 ** -126), np.float32(0.0), y).astype(np.float32)


def _fdiv(a, b):
    y = np.divide(a, b)
    if y.dtype != np.float32:
        return y
    return np.where((np.asarray(b) == 1.0) | ~np.isfinite(y), y, _gpu_ulps(y, a, b)).astype(np.float32)


@pytest.fixture
def gpu_fp32_math(monkeypatch):
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("models the GPU's fp32 math under the interpreter")
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", lambda self, arg: self.unary_op(arg, _exp2))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fdiv",
                        lambda self, lhs, rhs: self.binary_op(lhs, rhs, _fdiv))
    x = torch.tensor([1e-7, 0.5, 0.0, -3.0])
    y, z = torch.empty_like(x), torch.empty_like(x)
    _exp2_div_kernel[(1,)](x, y, z, N=4)
    assert y[0] != 1.0 and y[1] != 2.0 ** 0.5 and y[2] == 1.0 and y[3] == 0.125, y  # the model is in force
    assert z[1] != torch.tensor(1.0 / 4.5, dtype=torch.float32), z
