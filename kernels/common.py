"""Small @triton.jit helpers shared by the kernels in this package."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def is_interpreting() -> bool:
    """True when Triton runs kernels through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's SM count (the current device where `device` has no index)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


# Row-block kernels index rows as program_id * BLOCK_M + arange(BLOCK_M) in int32: the last
# block's rows must stay below 2**31 (BLOCK_M <= 4096 everywhere).
MAX_ROWS = 2**31 - 4096


def check_rows(op: str, rows: int, what: str) -> None:
    if rows > MAX_ROWS:
        raise ValueError(f"{op}: {what} = {rows} rows exceeds the Triton kernels' limit of {MAX_ROWS}")


AUTOTUNE_ENV = "TRANSFORMER_FAST_AUTOTUNE"


def first_config_unless_tuning(configs: list) -> list:
    """An autotuner's pruned configs, or only the first of them with TRANSFORMER_FAST_AUTOTUNE=0.

    Every config of a list is a correct kernel; timing them all only picks the fastest.  A run
    that checks numerics over many shapes (the gpu tests, verify, compute-sanitizer) compiles
    one config per tuning key instead of up to eight and times it once instead of each: most of
    its GPU time.  Read at every tuning decision, so it can be set per process."""
    if configs and os.environ.get(AUTOTUNE_ENV, "1") in ("0", ""):
        return configs[:1]
    return configs


@triton.jit
def cast_out(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even everywhere.

    Compiled, ``.to(tl.bfloat16)`` already rounds to nearest even.  Triton's interpreter
    (3.8) truncates fp32 -> bf16 instead (its "rtne" mode does not carry into the exponent
    either), so under the interpreter the rounding is done here on the bits (finite inputs
    exact; inf stays inf; NaN stays NaN)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def imin(a, b):
    """min of two int32 scalars by arithmetic only: usable in loop bounds on Triton 3.6, which
    rejects loop bounds computed with tl.minimum / tl.maximum."""
    d = a - b
    return b + (d & (d >> 31))


@triton.jit
def imax(a, b):
    """max of two int32 scalars by arithmetic only (see imin)."""
    d = a - b
    return a - (d & (d >> 31))


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ b``. DOT_FP32 casts the operands to fp32 first (the interpreter multiplies
    bf16 bit patterns otherwise); IEEE forces exact fp32 products instead of tf32."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
