"""torch.library custom ops: each fused op's autograd formula and fake (meta) kernel."""
from __future__ import annotations

from typing import Callable

import torch


def call(op, impl: Callable, *args, mutated: tuple = ()):
    """Run the custom op ``op`` (implemented by ``impl``) on ``args``.

    An eager call with nothing to differentiate runs ``impl`` directly: the custom op's Python
    dispatch (autograd wrapper, dynamo-disable frame, redispatch) costs ~15 us a call, which is
    most of a KV-cached decoding step's time at small batch (benchmarks/NOTES.md).  Under
    torch.compile/export tracing, a dispatch or torch-function mode (FakeTensorMode, profilers
    and op counters), functorch transforms, tensor subclasses, or with an input that requires
    grad while grad is enabled, the call goes through the op as usual.  ``mutated`` are the
    tensors the op writes in place: their version counters are bumped as the op would.
    """
    if not _plain_eager(args):
        return op(*args)
    out = impl(*args)
    for t in mutated:
        torch.autograd.graph.increment_version(t)
    return out


def _plain_eager(args) -> bool:
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return False
            if grad and a.requires_grad:
                return False
    return True
