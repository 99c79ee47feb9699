"""Argument checks shared by the models and decoders: TypeError for a wrong kind of object or
dtype, ValueError for a wrong shape or value, each naming the argument (DESIGN section 9)."""
from __future__ import annotations

import operator

import torch

from .. import _checks

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
TOKEN_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes


def _as_int(name: str, value: object, what: str) -> int:
    """value as a Python int: an int or anything with __index__ (a numpy integer, a one-element
    integer tensor), as range() takes it; bools are refused (True is not a length)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}") from None


def positive_int(name: str, value: object) -> int:
    value = _as_int(name, value, "a positive int")
    if value < 1:
        raise ValueError(f"{name} must be a positive int; got {value}")
    return value


def integer(name: str, value: object, minimum: int | None = None) -> int:
    """An int (not a bool) >= minimum; a traced torch.SymInt (torch.compile dynamic=True)
    passes unchecked."""
    if isinstance(value, torch.SymInt):
        return value
    value = _as_int(name, value, "an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def token_id(name: str, value: object, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int token id; got {type(value).__name__}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be in [0, {vocab_size}) (the vocabulary); got {value}")
    return value


def finite_float(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float; got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite; got {value}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be > 0; got {value}")
    return value


def tokens(name: str, value: object, vocab_size: int, *, pad_id: int | None = None,
           device: torch.device | None = None) -> torch.Tensor:
    """A (B, L) integer token tensor with B, L >= 1.  Values are range-checked where the
    package's host checks run (CPU tensors, not while torch.compile traces; see
    transformer_fast._checks.host_checks_enabled): on a GPU the check would cost a host sync per
    call (the embedding's device-side assert still stops an out-of-range id there)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids; got {type(value).__name__}")
    if value.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must have dtype int64 or int32 (token ids, as nn.Embedding takes); "
                        f"got {value.dtype}")
    if value.dim() != 2 or value.shape[0] < 1 or value.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape (batch, length) with batch, length >= 1; got {tuple(value.shape)}"
        )
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on the model's device ({device}); got {value.device}")
    if _checks.host_checks_enabled(value.device):
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{name} must hold token ids in [0, {vocab_size}); got values in [{low}, {high}]"
            )
        if pad_id is not None:
            empty = (value == pad_id).all(dim=1)
            if bool(empty.any()):
                rows = empty.nonzero().flatten().tolist()[:8]
                raise ValueError(
                    f"{name} has rows made only of padding (pad_id={pad_id}): rows {rows}; "
                    "every sequence needs at least one token"
                )
    return value
