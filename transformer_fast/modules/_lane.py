"""Replayed layer calls: a layer's input checks and backend choices made once per signature.

A fused layer's eager call spends most of its host time in Python that depends only on
metadata: torch's input rules in the modules, DESIGN section 9's checks in each functional op,
and the backend each op resolves to (~200 us of a small encoder layer's ~300 us on this CPU,
against ~75 us for its C++ ops; benchmarks/NOTES.md "A layer's host time").  On a GPU that is
the difference between a layer bound by its kernels and one bound by Python.

So a layer keeps, per call signature, the ``(op, backend)`` sequence its checked call resolved
(``backends.recording_resolutions``), and a later call with the same signature runs the same code
with each functional op's body called directly on that backend (``functional.run_*``), skipping
the checks and the resolution.  The signature holds everything those depended on: the inputs'
shapes, strides, dtypes and devices, the masks' and hints' kinds, every submodule's identity,
type, plain attributes and parameters' metadata, the grad mode, the requested backend and the
interpreter switch.  A call that cannot be replayed runs checked:

* while torch.compile, torch.export or jit trace, under a dispatch or torch-function mode or a
  functorch transform (they must see the checked path and the custom ops);
* with hooks anywhere in the layer, or global module hooks;
* with inputs or parameters that are tensor subclasses (the signature would not cover them).

The replayed call computes exactly what the checked call computes (the same functions, the same
backends): tests/test_lane.py compares them bit for bit and checks that each part of the
signature, changed, makes the next call run checked again.  MultiheadAttention replays its
own calls the same way (the identity of query / key / value is part of its signature).
"""
from __future__ import annotations

import operator
import os
import weakref

import torch
from torch.nn.modules import module as _module

from .. import backends
from . import _semantics as sem

# Plans kept per layer: a few signatures (e.g. train and eval, two sequence lengths) at once.
_MAX_PLANS = 8
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_MAX_MODULES = 512  # a layer has ~10, a stack of 6 ~80; beyond (or in a cycle): checked

# Module attributes that are torch's bookkeeping, not settings the layers read.
_BOOKKEEPING = frozenset(
    name for name in vars(torch.nn.Module()) if name != "training"
)
_ATTR_GETTERS: dict[tuple, object] = {}


UNSET = object()


class Lane:
    """The recorded backends of one signature, handed out in call order, and the native (C++)
    plans decided for positions in it (modules/_native.py)."""

    __slots__ = ("_names", "_next", "_natives")

    def __init__(self, names, natives):
        self._names = names
        self._next = 0
        self._natives = natives  # position -> a native plan, or None: shared by the signature

    def position(self) -> int:
        return self._next

    def native(self, position=None):
        """The native plan decided for the current (or the given) position, None, or UNSET
        (not decided)."""
        return self._natives.get(self._next if position is None else position, UNSET)

    def upcoming(self, position=None) -> tuple:
        """The recorded (op, backend) pairs from the current (or the given) position on."""
        return self._names[self._next if position is None else position:]

    def decide_native(self, plan, position=None):
        self._natives[self._next if position is None else position] = plan
        return plan

    def skip(self, count: int) -> None:
        """``count`` recorded ops run natively."""
        self._next += count

    def next(self, op: str) -> str:
        recorded_op, name = self._names[self._next]
        if recorded_op != op:  # the replay took another path than the record: a bug here
            raise AssertionError(f"transformer_fast lane: replayed {op}, recorded {recorded_op}")
        self._next += 1
        return name


# TRITON_INTERPRET read from os.environ's own dict: os.environ.get costs ~4 us a call.
_ENVIRON_BYTES = getattr(os.environ, "_data", None)
_INTERPRET_KEY = os.environ.encodekey("TRITON_INTERPRET") if _ENVIRON_BYTES is not None else None


def _triton_interpret_flag():
    if _ENVIRON_BYTES is None:
        return os.environ.get("TRITON_INTERPRET")
    return _ENVIRON_BYTES.get(_INTERPRET_KEY)


def _plain_call() -> bool:
    """No tracer, mode or transform that must see the checked path."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state()
                or torch._C._are_functorch_transforms_active() or backends.forward_ad_active())


def _tensor_key(t):
    if t is None:
        return None
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_nested:
        raise _NotReplayable  # a subclass, not a tensor, sparse or nested: the checks answer
    return (t.dtype, t.device, t.shape, t.stride(), t.requires_grad)


class _NotReplayable(Exception):
    pass


def _attr_getter(module):
    """(number of attributes, their names, an itemgetter of their values) for ``module``'s
    plain attributes (its settings: p, eps, batch_first, activation, ...), cached per type; an
    instance with another number of attributes, or missing a name, gets a fresh one."""
    d = module.__dict__
    names = tuple(k for k in d if k not in _BOOKKEEPING)
    if len(names) == 1:  # (itemgetter of one name gives the value itself, not a 1-tuple)
        getter = lambda d, name=names[0]: (d[name],)  # noqa: E731
    else:
        getter = operator.itemgetter(*names) if names else (lambda d: ())
    entry = (len(d), names, getter)
    _ATTR_GETTERS[type(module)] = entry
    return entry


def _modules_key(root) -> list:
    """Every module under ``root`` (identity, type, attributes, parameters' metadata) in one
    walk; raises _NotReplayable on a hook or a parameter subclass."""
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks
            or _module._global_backward_hooks or _module._global_backward_pre_hooks):
        raise _NotReplayable
    key, stack, seen = [], [root], 0
    append = key.append
    while stack:
        m = stack.pop()
        if m is None:
            append(None)
            continue
        seen += 1
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or seen > _MAX_MODULES):
            raise _NotReplayable
        d = m.__dict__
        entry = _ATTR_GETTERS.get(type(m))
        if entry is None or entry[0] != len(d):
            entry = _attr_getter(m)
        try:
            values = entry[2](d)
        except KeyError:
            entry = _attr_getter(m)
            values = entry[2](d)
        if torch.Tensor in map(type, values):
            # A tensor kept as an attribute (a subclass storing its last output, say): its
            # metadata, which is what the checks read; the key must not keep the tensor (and its
            # autograd graph) alive, and a new one each call would miss every time.
            values = tuple(_tensor_key(v) if type(v) is torch.Tensor else v for v in values)
        append(id(m))
        append(type(m))
        append(entry[1])
        append(values)
        for p in d["_parameters"].values():
            if p is None:
                append(None)
                continue
            if type(p) is not torch.nn.Parameter:
                raise _NotReplayable
            append((p.dtype, p.device, p.shape, p.stride(), p.requires_grad))
        buffers = d["_buffers"]
        if buffers:
            key.extend(_tensor_key(b) for b in buffers.values())
        children = d["_modules"]
        append(tuple(children))  # the slots' names: two children swapped between slots change it
        stack.extend(children.values())
    return key


def signature(layer, tensors, flags) -> tuple | None:
    """The key of a call of ``layer`` on ``tensors`` (inputs and masks, None allowed) with the
    hashable ``flags`` (hints), or None when it cannot be replayed."""
    if not _plain_call():
        return None
    try:
        key = _modules_key(layer)
        key.extend(_tensor_key(t) for t in tensors)
    except _NotReplayable:
        return None
    grad = torch.is_grad_enabled()
    if grad and any(t is not None and t.is_inference() for t in tensors):
        # The checked ops clone inference tensors that autograd would have to save (a LayerNorm
        # with trainable parameters, say); a replay does not.
        return None
    device_type = tensors[0].device.type  # (a plain strided tensor: _tensor_key passed it)
    key.append(flags)
    key.append(grad)
    key.append(sem.autocast_enabled(device_type))
    key.append(torch.is_autocast_enabled())  # CUDA's, which the encoder's torch mimicry reads
    key.append(backends.requested_backend())
    key.append(_triton_interpret_flag())
    key.append(torch.backends.mha.get_fastpath_enabled())  # read by the encoder's torch mimicry
    return tuple(key)


def plan(layer, key):
    """The recorded Lane for ``key``, or None.  None also while an enclosing module records its
    own call: a replay resolves nothing, so the enclosing record would miss this module's ops
    (and its own replay would then fail); the checked call records them for both."""
    if key is None or backends.recording():
        return None
    plans = _PLANS.get(layer)
    if plans is None:
        return None
    try:
        entry = plans.get(key)
    except TypeError:  # an unhashable attribute value: never remembered either
        return None
    return None if entry is None else Lane(*entry)


def remember(layer, key, names) -> None:
    try:
        hash(key)
    except TypeError:
        return
    plans = _PLANS.setdefault(layer, {})
    if len(plans) >= _MAX_PLANS:
        try:
            plans.pop(next(iter(plans)), None)
        except (RuntimeError, StopIteration):  # another thread changed the dict meanwhile
            pass
    plans[key] = (tuple(names), {})

