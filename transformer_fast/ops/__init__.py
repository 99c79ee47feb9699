"""torch.library custom ops: each fused op's autograd formula and fake (meta) kernel.

Each op file defines its implementation as a plain function (``_<op>_impl``), makes it the
custom op, and registers the op's autograd formula and fake kernel.  The custom op is what
torch.compile, torch.export, jit tracing, dispatch modes and functorch see.  An eager call runs
the same implementation and the same autograd formula without the custom op's Python dispatch
(see ``call``): the results are the same, bit for bit.
"""
from __future__ import annotations

from typing import Callable

import torch


def call(op, impl: Callable, *args, mutated: tuple = (), autograd: type | None = None):
    """Run the custom op ``op`` (implemented by ``impl``) on ``args``.

    The custom op's Python dispatch (autograd wrapper, dynamo-disable frame, redispatch) costs
    ~15 us a call forward and as much backward: most of a KV-cached decoding step's time at small
    batch, and a training step's at small shapes (benchmarks/NOTES.md).  So a plain eager call
    skips it: with nothing to differentiate it runs ``impl`` directly; with an input that
    requires grad it runs ``autograd`` (the ``eager_autograd`` Function of the op's own formula)
    when given (its setup_context-style twin under torch.func transforms).  Under
    torch.compile/export/jit tracing, a dispatch or torch-function mode (FakeTensorMode,
    profilers and op counters), vmap without grad, or with tensor subclasses, the call goes
    through the op.  ``mutated`` are the tensors the op writes in place: their
    version counters are bumped as the op would.
    """
    if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
        # torch.func.grad & co. need a setup_context-style Function (the custom op's own
        # autograd does not support them); vmap alone goes through the op.
        if autograd is None and not mutated:  # a backward op, called from a formula above
            return impl(*args)
        if autograd is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return autograd.functorch.apply(*args)
        return op(*args)
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state()):
        return op(*args)
    grad = torch.is_grad_enabled()
    needs_grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return op(*args)
            needs_grad = needs_grad or (grad and a.requires_grad)
    if needs_grad:
        return op(*args) if autograd is None else autograd.apply(*args)
    out = impl(*args)
    for t in mutated:
        torch.autograd.graph.increment_version(t)
    return out


def own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own when it is a view (of a kernel's 2-D output, or a permuted
    allocation): the same storage, sizes and strides, no copy.  A multi-output custom op or
    autograd.Function whose output is a view forbids in-place changes of it, where the outputs
    of torch's own ops (F.layer_norm, SDPA, linear) allow them (``layer(x).add_(1)``)."""
    if t._base is None:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def own_reshaped(t: torch.Tensor, shape) -> torch.Tensor:
    """``own(t.view(shape))`` for a contiguous kernel output ``t`` (a 2-D (rows, N) result
    given back in its input's shape), in one step: no intermediate view (~2 us a call)."""
    if not t.is_contiguous():
        return own(t.view(shape))
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape, strides[::-1])


def eager_autograd(impl: Callable, setup_context: Callable, backward: Callable) -> type:
    """A torch.autograd.Function running ``impl`` with the autograd formula registered on the
    custom op (its ``setup_context`` and ``backward``), for eager calls that need grad.  Old-style
    ``forward(ctx, *args)``: the setup_context style binds arguments through inspect.signature
    on every call (~15 us)."""

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):  # differentiable under create_graph: see recomputed_grads
            return backward(ctx, *grads)

    class FunctorchFunction(torch.autograd.Function):
        """The same formula in the setup_context style that torch.func transforms require."""

        generate_vmap_rule = True

        @staticmethod
        def forward(*args):
            return impl(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    EagerFunction.__name__ = EagerFunction.__qualname__ = f"Eager{impl.__name__}"
    FunctorchFunction.__name__ = FunctorchFunction.__qualname__ = f"Functorch{impl.__name__}"
    EagerFunction.functorch = FunctorchFunction
    return EagerFunction


def recording_backward() -> bool:
    """Whether autograd records this backward for a second derivative (create_graph=True: the
    engine runs backward formulas with grad mode on).  Our kernels' backward passes are not
    differentiable, so the formulas then take recomputed_grads instead."""
    return torch.is_grad_enabled()


def half_to_float(*tensors):
    """fp16 / bf16 tensors as float32 (a differentiable cast; others unchanged): the recomputed
    formulas run in fp32 as the kernels do."""
    return tuple(t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)
                 else t for t in tensors)


def recomputed_grads(forward: Callable, inputs: tuple, grad_outputs: tuple) -> list:
    """The backward of a fused op when autograd records it (create_graph=True): the op's
    reference formula (transformer_fast.reference, differentiable torch ops) re-run on the saved
    inputs and differentiated with create_graph, so the gradients are themselves differentiable
    (torch.nn's double backward: gradient penalties, Hessian-vector products).  Slow, and only
    on this path; a plain backward runs the kernels.  ``forward(*inputs)`` returns the outputs
    that ``grad_outputs`` belong to (None: no gradient from that output).  One gradient, or None,
    per input."""
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result = [None] * len(inputs)
    if not wanted:
        return result
    with torch.enable_grad():
        # Differentiate with respect to fresh aliases, not the inputs themselves: one input may
        # be computed from another (a pre-LN residual add: the sublayer output depends on the
        # residual), and autograd.grad with respect to that other would also count the path
        # through the first.  The aliases keep the result differentiable in the inputs.
        local = list(inputs)
        for i in wanted:
            local[i] = inputs[i].view_as(inputs[i])
        outs = forward(*local)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        if not pairs:
            return result
        grads = torch.autograd.grad([o for o, _ in pairs], [local[i] for i in wanted],
                                    [g for _, g in pairs], create_graph=True, allow_unused=True)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result
