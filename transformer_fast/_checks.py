"""Input validation shared by the functional ops (DESIGN section 9).

Every check raises before any kernel runs and names the argument, what was expected and what
came.  TypeError for a wrong kind of object or dtype, ValueError for a wrong shape or value.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ArgumentValueError(ValueError, RuntimeError):
    """A bad argument value or shape: ValueError (DESIGN section 9), and RuntimeError as torch's
    own ops raise for the same inputs, so code written against either keeps catching it."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A wrong kind of object or dtype: TypeError (DESIGN section 9), and RuntimeError as
    torch's own ops raise for the same inputs."""


def _real(value: object) -> float | None:
    """A real scalar as torch's float arguments take it (Python or NumPy int/float, a
    one-element tensor) -> float; None for anything else (bools included).  Symbolic numbers
    (torch.compile(dynamic=True) traces eps and scale as SymFloat) pass through as they are."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, (int, float)):
        return value if type(value) is float else float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        if value.requires_grad:
            # float() would detach it: a learned scale would silently get no gradient (torch's
            # own float arguments refuse a tensor outright).
            return None
        return float(value)
    return None


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(
    name: str,
    value: object,
    *,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            raise ArgumentValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions; "
                f"got shape {tuple(value.shape)}"
            )
    if min_ndim is not None and value.dim() < min_ndim:
        raise ArgumentValueError(
            f"{name} must have at least {min_ndim} dimension(s); got shape {tuple(value.shape)}"
        )
    if dtypes is not None and value.dtype not in dtypes:
        raise ArgumentTypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}); got {value.dtype}")
    return value


def optional_tensor(name: str, value: object, **kwargs) -> torch.Tensor | None:
    return None if value is None else tensor(name, value, **kwargs)


def _first_mismatch(tensors: dict, attr: str) -> bool:
    # A plain loop: these checks run on every call of every op (a few us matter when decoding).
    first = None
    for v in tensors.values():
        if v is not None:
            value = getattr(v, attr)
            if first is None:
                first = value
            elif value != first:
                return True
    return False


def same_device(**tensors: torch.Tensor | None) -> None:
    if _first_mismatch(tensors, "device"):
        listing = ", ".join(f"{k} on {v.device}" for k, v in tensors.items() if v is not None)
        raise ArgumentValueError(f"all tensors must be on one device; got {listing}")


def same_dtype(**tensors: torch.Tensor | None) -> None:
    if _first_mismatch(tensors, "dtype"):
        listing = ", ".join(f"{k} is {v.dtype}" for k, v in tensors.items() if v is not None)
        raise ArgumentTypeError(f"tensors must share one dtype; got {listing}")


def shape(name: str, value: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(value.shape) != tuple(expected):
        raise ArgumentValueError(
            f"{name} must have shape {tuple(expected)}{' (' + what + ')' if what else ''}; "
            f"got {tuple(value.shape)}"
        )


def dropout_p(value: object, name: str = "dropout_p") -> float:
    # torch takes a bool here (a bool is an int): ``dropout_p=self.training and p`` is False in eval.
    real = float(value) if isinstance(value, bool) else _real(value)
    if real is None:
        raise ArgumentTypeError(f"{name} must be a float in [0, 1); got {type(value).__name__}")
    value = real
    if not (0.0 <= value < 1.0):
        raise ArgumentValueError(f"{name} must be in [0, 1); got {value}")
    return value


def positive_float(name: str, value: object, *, zero_ok: bool = False) -> float:
    """A finite real > 0 (>= 0 with ``zero_ok``) as a float."""
    bound = ">= 0" if zero_ok else "> 0"
    real = _real(value)
    if real is None:
        raise ArgumentTypeError(f"{name} must be a float {bound}; got {type(value).__name__}")
    if not (real >= 0.0 if zero_ok else real > 0.0) or not _finite(real):
        raise ArgumentValueError(f"{name} must be a finite float {bound}; got {real}")
    return real


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool; got {type(value).__name__}")
    return value


def optional_scale(value: object, name: str = "scale") -> float | None:
    return None if value is None else number(name, value, "a float or None")


def _finite(value) -> bool:
    """math.isfinite; not checked while torch.compile traces (with dynamic=True eps and scale
    are symbolic floats, which math.isfinite cannot take; eager calls check them)."""
    if torch.compiler.is_compiling() or isinstance(value, (torch.SymFloat, torch.SymInt)):
        return True
    return math.isfinite(value)


def kernel_dtype_reasons(backend: str, **tensors: torch.Tensor | None) -> list[str]:
    """The fused kernels compute fp16/bf16/fp32 inputs (fp32 math inside)."""
    return [
        f"{backend} supports dtypes {_dtype_names(KERNEL_DTYPES)}; {k} is {v.dtype}"
        for k, v in tensors.items()
        if v is not None and v.is_floating_point() and v.dtype not in KERNEL_DTYPES
    ]


def choice(name: str, value: object, options: Sequence[str]) -> str:
    """A string option: TypeError for a non-string, ValueError for an unknown one."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, one of {', '.join(map(repr, options))}; got {type(value).__name__}")
    if value not in options:
        raise ArgumentValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def number(name: str, value: object, expected: str = "a float") -> float:
    """A finite real number (not bool)."""
    real = _real(value)
    if real is None:
        raise ArgumentTypeError(f"{name} must be {expected}; got {type(value).__name__}")
    value = real
    if not _finite(value):
        raise ArgumentValueError(f"{name} must be finite; got {value}")
    return value


# Checks that must read tensor VALUES on the host (e.g. cache_seqlens bounds).  On the CPU the
# read is free, so they always run.  On a GPU the read would synchronise the stream on the hot
# path (every decoding step), so they run only with TRANSFORMER_FAST_CHECKS=1; callers put a
# sync-free device-side assert there instead.  TRANSFORMER_FAST_CHECKS=0 turns them off
# everywhere.  Never while torch.compile traces (a data-dependent read breaks the graph).
CHECKS_ENV = "TRANSFORMER_FAST_CHECKS"
_CHECKS_OFF = ("0", "false", "False", "no", "off")


def _fake_mode_active() -> bool:
    # FakeTensorMode (torch.export, shape propagation): tensors without values to read.  (Not
    # asked while torch.compile traces: dynamo cannot, and its fake mode is its own business.)
    if torch.compiler.is_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def host_checks_enabled(device: torch.device) -> bool:
    if torch.compiler.is_compiling() or device.type == "meta" or _fake_mode_active():
        return False
    flag = os.environ.get(CHECKS_ENV, "").strip()
    if flag:
        return flag not in _CHECKS_OFF
    return device.type == "cpu"


class _Trusted(threading.local):
    depth = 0


_trusted = _Trusted()


@contextlib.contextmanager
def trusted_values():
    """Inside, value checks are skipped: for callers whose values are correct by construction
    (a decoding loop's own cache lengths), where the GPU's device-side assert would add
    kernels to every step.  Shape, dtype and device checks still run."""
    _trusted.depth += 1
    try:
        yield
    finally:
        _trusted.depth -= 1


def value_check_mode(device: torch.device) -> str:
    """How a check of tensor values runs: "host" (read on the host, ValueError), "device" (a
    sync-free device-side assert) or "off" (TRANSFORMER_FAST_CHECKS=0, trusted_values(), the
    meta device)."""
    if _trusted.depth or device.type == "meta" or _fake_mode_active():
        return "off"
    if host_checks_enabled(device):
        return "host"
    if os.environ.get(CHECKS_ENV, "").strip() in _CHECKS_OFF:
        return "off"
    return "device"  # also a CPU tensor under torch.compile: the assert compiles, a read would not
