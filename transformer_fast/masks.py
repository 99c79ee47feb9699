"""Attention mask canonicalisation: one place that knows every mask convention.

The functional API (DESIGN section 4) takes three kinds of mask, with the conventions of the
torch function or module each one comes from:

* ``attn_mask`` (torch.nn.functional.scaled_dot_product_attention's polarity): broadcastable to
  the scores ``(..., Lq, Lk)``; bool True = the key takes part; float = added to the scores
  (``-inf`` removes a key).
* ``is_causal``: top-left aligned as torch SDPA (query ``i`` sees keys ``j <= i``, also when
  ``Lq != Lk``).  ``bottom_right`` alignment (query ``i`` sees keys ``j <= i + Lk - Lq``, the
  KV-cache convention) is available to the ops that need it.
* ``key_padding_mask`` (torch.nn.MultiheadAttention's polarity): ``(B, Lk)``; bool True = padding
  (the key is excluded); float = added.

``combine`` folds any subset into ONE mask broadcastable to the scores: a bool "allowed" mask
(True = takes part) when every given mask is boolean, else an additive float mask whose removed
keys are ``-inf``.  A query row is *dead* when none of its keys takes part (all ``-inf``): the
contract is that such a row returns zeros and zero gradients; ``dead_rows`` / ``revive`` let a
backend that would produce NaN there run on a harmless row and zero it afterwards.

Nothing here reads tensor values on the host: it is safe on the GPU hot path and under
torch.compile.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._checks import ArgumentTypeError, ArgumentValueError

NEG_INF = float("-inf")


def _describe(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------------------------
# Validation


def _check_kind(name: str, mask: object, dtype: torch.dtype, bool_meaning: str) -> None:
    """A mask is a tensor of bool or of a float dtype (``dtype`` or float32)."""
    if not isinstance(mask, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor or None; got {type(mask).__name__}")
    allowed = {torch.bool, dtype, torch.float32}
    if mask.dtype not in allowed:
        names = ", ".join(sorted(_describe(d) for d in allowed))
        raise ArgumentTypeError(
            f"{name} must have dtype {bool_meaning} or a float dtype ({names}); got {mask.dtype}"
        )


def check_mask(
    name: str,
    mask: object,
    target_shape: Sequence[int],
    dtype: torch.dtype,
    target: str = "the attention scores",
) -> torch.Tensor | None:
    """Validate a bool/float mask broadcastable to ``target_shape``.

    Float masks must be in ``dtype`` (the query's/scores' dtype) or float32.  Raises TypeError
    for a wrong kind or dtype, ValueError for a shape that does not broadcast to the target
    (broadcasting may not grow the target: the mask's rank is at most the target's).
    """
    if mask is None:
        return None
    _check_kind(name, mask, dtype, "bool")
    target_shape = tuple(target_shape)
    ok = mask.dim() <= len(target_shape)
    if ok:
        try:
            ok = tuple(torch.broadcast_shapes(tuple(mask.shape), target_shape)) == target_shape
        except RuntimeError:
            ok = False
    if not ok:
        raise ArgumentValueError(
            f"{name} must be broadcastable to {target} {target_shape}; got shape {tuple(mask.shape)}"
        )
    return mask


def check_key_padding_mask(
    name: str, mask: object, batch: int, lk: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """Validate a ``(B, Lk)`` key padding mask: bool (True = padding) or float (added)."""
    if mask is None:
        return None
    _check_kind(name, mask, dtype, "bool (True = padding)")
    if tuple(mask.shape) != (batch, lk):
        raise ArgumentValueError(
            f"{name} must have shape (batch, key length) = {(batch, lk)}; got {tuple(mask.shape)}"
        )
    return mask


# --------------------------------------------------------------------------------------------
# Building blocks


def causal_allowed(
    lq: int, lk: int, device: torch.device | str, bottom_right: bool = False
) -> torch.Tensor:
    """``(lq, lk)`` bool, True where query ``i`` may see key ``j``.

    Top-left (torch SDPA's ``is_causal``): ``j <= i``.  Bottom-right: ``j <= i + lk - lq``.
    """
    offset = lk - lq if bottom_right else 0
    rows = torch.arange(lq, device=device).unsqueeze(-1)
    cols = torch.arange(lk, device=device)
    return cols <= rows + offset


def padding_as_mask(key_padding_mask: torch.Tensor, ndim: int) -> torch.Tensor:
    """``(B, Lk)`` key padding mask -> a mask of rank ``ndim`` broadcastable to the scores
    ``(B, ..., Lq, Lk)``, in attn_mask polarity: bool True = takes part (padding inverted);
    float unchanged (added)."""
    b, lk = key_padding_mask.shape
    shape = (b,) + (1,) * (ndim - 2) + (lk,)
    mask = key_padding_mask.reshape(shape)
    return ~mask if mask.dtype == torch.bool else mask


def to_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask in attn_mask polarity as an additive float mask in ``dtype`` (bool False -> -inf)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        zeros = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zeros, NEG_INF)
    return mask.to(dtype)


def _and(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Combine two masks in attn_mask polarity (bool AND / float sum / bool-gated float)."""
    if a is None:
        return b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    # a is float from here
    if b.dtype == torch.bool:
        return torch.where(b, a, NEG_INF)
    return a + b


def combine(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    key_padding_mask: torch.Tensor | None,
    lq: int,
    lk: int,
    ndim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    bottom_right: bool = False,
) -> torch.Tensor | None:
    """One mask for the scores ``(..., lq, lk)`` of rank ``ndim`` (or None when unmasked).

    Returns a bool mask (True = takes part) when every given mask is boolean (the causal mask
    is boolean), else an additive float mask in ``dtype`` (float masks are cast to ``dtype``)
    with ``-inf`` at removed keys.  The result broadcasts to the scores; it is only as large as
    the masks it combines.
    """
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    if key_padding_mask is not None:
        padding = padding_as_mask(key_padding_mask, ndim)
        mask = _and(mask, padding if padding.dtype == torch.bool else padding.to(dtype))
    if is_causal:
        mask = _and(mask, causal_allowed(lq, lk, device, bottom_right))
    return mask


# --------------------------------------------------------------------------------------------
# Fully masked ("dead") rows


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """``(..., Lq, 1)`` bool: rows of ``mask`` (attn_mask polarity) where no key takes part.

    An empty key dimension counts as dead (nothing to attend to)."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def revive(mask: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """``mask`` with its dead rows opened to every key (finite scores there, so a softmax and
    its backward stay finite); the caller zeroes those rows of the result afterwards."""
    if mask.dtype == torch.bool:
        return mask | dead
    return mask.masked_fill(dead, 0.0)
