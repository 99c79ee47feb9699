"""swap(model) / unswap(model): torch.nn's Transformer modules <-> transformer_fast.modules.

Swapping is done in place by changing each module's class: our classes keep exactly torch's
attributes, parameters, buffers and submodule names, so a module keeps its identity (references
held elsewhere, optimizers, shared use in several places), its parameters (same tensors: device,
dtype, requires_grad, gradients), hooks and train/eval mode, and only its forward changes.
Only modules whose type is exactly one of torch's classes are swapped: a subclass may override
forward or rely on torch internals, so it is left alone with a warning.
"""
from __future__ import annotations

import dataclasses
import types
import warnings

import torch

from . import modules as _ours

_PAIRS = (
    (torch.nn.MultiheadAttention, _ours.MultiheadAttention),
    (torch.nn.LayerNorm, _ours.LayerNorm),
    (torch.nn.TransformerEncoderLayer, _ours.TransformerEncoderLayer),
    (torch.nn.TransformerDecoderLayer, _ours.TransformerDecoderLayer),
    (torch.nn.TransformerEncoder, _ours.TransformerEncoder),
    (torch.nn.TransformerDecoder, _ours.TransformerDecoder),
    (torch.nn.Transformer, _ours.Transformer),
)
TORCH_TO_OURS = {t: o for t, o in _PAIRS}
OURS_TO_TORCH = {o: t for t, o in _PAIRS}

__all__ = ["swap", "unswap", "SwapReport"]


@dataclasses.dataclass
class SwapReport:
    """What swap/unswap did.  ``swapped``: (qualified name, old class, new class) per module
    (a module reachable under several names is changed once and listed under its first name;
    the root is named ""); ``skipped``: (name, class, reason) for subclasses left alone."""

    swapped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.swapped)

    def counts(self) -> dict[str, int]:
        """Number of swapped modules per original class name."""
        out: dict[str, int] = {}
        for _, old, _ in self.swapped:
            out[old] = out.get(old, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"{len(self.swapped)} module(s) swapped"]
        lines += [f"  {name or '<root>'}: {old} -> {new}" for name, old, new in self.swapped]
        if self.skipped:
            lines.append(f"{len(self.skipped)} left alone")
            lines += [f"  {name or '<root>'}: {cls} ({why})" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _rebind_methods(module: torch.nn.Module, old_cls: type, new_cls: type) -> None:
    """Methods of ``module`` stored on the instance, bound from its old class (accelerate's
    ``module._old_forward = module.forward`` under a wrapper ``forward``, say), bound again
    from the new class: else they would run the old class's code on the new class's object."""
    for key, value in list(vars(module).items()):
        if isinstance(value, types.MethodType) and value.__self__ is module:
            name = value.__func__.__name__
            if getattr(old_cls, name, None) is value.__func__ and callable(getattr(new_cls, name, None)):
                setattr(module, key, types.MethodType(getattr(new_cls, name), module))


def _convert(model: torch.nn.Module, table: dict, who: str) -> SwapReport:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    report = SwapReport()
    seen: set[int] = set()
    # named_modules(remove_duplicate=False) visits every path, so a module shared by two parents
    # is found under both names; `seen` changes it once.  The list is built before any class
    # changes, so the traversal does not depend on the swap.
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in seen:
            continue
        seen.add(id(module))
        cls = type(module)
        new_cls = table.get(cls)
        if new_cls is not None:
            module.__class__ = new_cls
            _rebind_methods(module, cls, new_cls)
            report.swapped.append((name, _qualname(cls), _qualname(new_cls)))
            continue
        base = next((t for t in table if issubclass(cls, t)), None)
        if base is not None:
            why = f"subclass of {_qualname(base)}; it may override forward, so it is left alone"
            report.skipped.append((name, _qualname(cls), why))
            # (unswap meets one when a module of ours was parametrized after swap: torch's
            # parametrize made a subclass of it.)
    by_class: dict[tuple[str, str], list[str]] = {}  # one warning per class, not per layer
    for name, cls_name, why in report.skipped:
        by_class.setdefault((cls_name, why), []).append(name or "the model")
    for (cls_name, why), names in by_class.items():
        where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(f"transformer_fast.{who}: {where} ({cls_name}) is a {why}", stacklevel=3)
    return report


def swap(model: torch.nn.Module) -> SwapReport:
    """Replace, in place, every torch.nn.MultiheadAttention, LayerNorm, TransformerEncoderLayer,
    TransformerDecoderLayer, TransformerEncoder, TransformerDecoder and Transformer inside
    ``model`` (``model`` itself included) by transformer_fast's fused equivalent.

    Parameters, buffers, device, dtype, requires_grad, hooks, train/eval mode and sharing are
    kept (the module objects stay the same objects).  Subclasses of those torch classes are left
    alone with a warning.  Returns a SwapReport; ``unswap(model)`` goes back.
    """
    return _convert(model, TORCH_TO_OURS, "swap")


def unswap(model: torch.nn.Module) -> SwapReport:
    """Turn every transformer_fast module inside ``model`` back into torch's class (in place;
    also modules built directly from transformer_fast.modules); a subclass of ours is left alone
    with a warning.  Returns a SwapReport."""
    return _convert(model, OURS_TO_TORCH, "unswap")
