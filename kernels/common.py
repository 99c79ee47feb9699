"""Small @triton.jit helpers shared by the kernels in this package."""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner


# Triton reads TRITON_INTERPRET once, when its @triton.jit decorators run (this import): the
# kernels below are compiled or interpreted for good (a later change of the variable is refused
# by the backend check before any launch, backends._triton_mode_reason).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_interpreting() -> bool:
    """True when Triton runs these kernels through its interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETING


def device_guard(t: torch.Tensor):
    """Make t's GPU the current device around a launch (Triton launches on the current device and
    stream); nothing for a CPU tensor (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's SM count (the current device where `device` has no index)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code.  Since Triton 3.6 ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions whose host-side wrapper (an import and
    argument unwrapping per call) costs a few microseconds, tens of calls per layer."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for n <= 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_NO_DTYPE = frozenset((int, float, bool, type(None)))


class _KeyedAutotuner(Autotuner):
    """Triton's Autotuner whose launches for an already tuned key skip its per-call bookkeeping.

    ``Autotuner.run`` builds its cache key on every launch by merging all arguments into dicts
    and filtering them through a list (quadratic in the argument count): with the attention
    kernels' ~80 arguments that is ~25-35 us of host time per launch on a 2-core CPU host,
    more than Triton's own JIT launch path.  This computes the same key tuple (the ``key``
    arguments' values, then ``str(dtype)`` of every argument that has one, in argument order)
    from positions found once, and on a hit does what ``Autotuner.run`` does then: set
    ``best_config``, run the config's pre_hook, launch the JIT function with the config's
    keywords.  A miss (or a Triton whose key this does not reproduce) goes to ``Autotuner.run``,
    which tunes and fills ``self.cache``; clearing ``cache`` re-tunes as before."""

    _positions: dict | None = None

    def run(self, *args, **kwargs):
        if len(self.configs) <= 1:
            return super().run(*args, **kwargs)
        pos = self._positions
        if pos is None:
            pos = self._positions = {name: i for i, name in enumerate(self.arg_names)}
        key = []
        for name in self.keys:
            if name in kwargs:
                key.append(kwargs[name])
            elif pos.get(name, len(args)) < len(args):
                key.append(args[pos[name]])
        for a in args[:len(pos)]:
            # Triton asks hasattr(a, "dtype"); a failed attribute lookup on the many int
            # arguments costs more than this type test, which gives the same answer for them.
            t = type(a)
            if t is torch.Tensor or (t not in _NO_DTYPE and hasattr(a, "dtype")):
                key.append(str(a.dtype))
        for name, a in kwargs.items():
            if name in pos and type(a) not in _NO_DTYPE and hasattr(a, "dtype"):
                key.append(str(a.dtype))
        config = self.cache.get(tuple(key))
        if config is None:
            return super().run(*args, **kwargs)
        self.best_config = config
        config_kwargs = config.all_kwargs()
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config_kwargs})
        return self.fn.run(*args, **kwargs, **config_kwargs)


def autotune(**kwargs):
    """``triton.autotune(**kwargs)`` whose tuned launches cost less host time (_KeyedAutotuner).
    The object is Triton's own Autotuner (same attributes: cache, best_config, configs, fn),
    re-classed rather than re-constructed, so that its constructor's arguments stay Triton's."""

    def decorator(fn):
        tuner = triton.autotune(**kwargs)(fn)
        if type(tuner) is Autotuner and all(
                hasattr(tuner, name) for name in ("keys", "arg_names", "cache", "configs", "fn")):
            tuner.__class__ = _KeyedAutotuner  # else (another Triton's Autotuner): Triton's own
        return tuner

    return decorator


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
