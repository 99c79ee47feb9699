"""Shared helpers of the module tests (tests/test_modules_*.py, tests/test_swap.py), and tests
that the parity helper itself can fail.

module_parity: DESIGN section 6 for modules.  Torch's module with given weights is the
reference, run in float64 (ref64) and in the low dtype (ref_lp); ours, holding the same
weights (loaded with strict=True from torch's state_dict), runs in the low dtype with poisoned
(NaN-filled) fresh allocations.  Every output and the gradient of every parameter and of the
floating-point inputs under a random upstream gradient must satisfy
max|ours - ref64| <= 2 * max|ref_lp - ref64| + atol(dtype).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from transformer_fast import reference


@pytest.fixture
def one_thread():
    """The module tests run tiny shapes, where intra-op threads only add overhead (and on a
    shared 2-core machine, contention: a 16-wide layer's forward+backward measured 0.13 s with
    the default thread pool, 2 ms with one thread).  Restored afterwards."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


def randomize_(module: torch.nn.Module, g: torch.Generator | None = None, scale: float = 0.5):
    """Overwrite every parameter with fresh random values (biases and LayerNorm affine
    parameters are 0/1 after init: a test with those would not see a bias or gain bug)."""
    g = g or fresh_generator()
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            r = torch.randn(p.shape, generator=g, dtype=torch.float64) * (scale / fan_in**0.5)
            if p.dim() == 1 and fan_in == 1:
                r = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
            p.copy_(r.to(p.dtype))
    return module


def ours_like(torch_module: torch.nn.Module, our_cls, *args, **kwargs):
    """Our module built with the same constructor arguments, holding torch's weights."""
    ours = our_cls(*args, **kwargs)
    ours.load_state_dict(torch_module.state_dict(), strict=True)
    ours.train(torch_module.training)
    return ours


def _cast(value, dtype, memo=None):
    """Floating tensors to ``dtype`` (the same input object -> the same cast object, so that
    self-attention's ``query is key is value`` survives the cast)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        if memo is None:
            return value.detach().to(dtype)
        if id(value) not in memo:
            memo[id(value)] = value.detach().to(dtype).clone()
        return memo[id(value)]
    return value


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def _run(module, args, kwargs, dtype, grad_inputs, upstream, poison=False):
    m = module.to(dtype)
    memo = {}
    a = [_cast(x, dtype, memo) for x in args]
    k = {n: _cast(v, dtype, memo) for n, v in kwargs.items()}
    leaves = {}
    for i in grad_inputs:
        t = a[i] if isinstance(i, int) else k[i]
        t.requires_grad_(True)
        if not any(t is other for other in leaves.values()):
            leaves[f"grad input {i}"] = t
    params = {f"grad {n}": p for n, p in m.named_parameters() if p.requires_grad}
    if poison:
        with reference.poisoned_outputs():
            outs = _flatten(m(*a, **k))
    else:
        outs = _flatten(m(*a, **k))
    everything = {**params, **leaves}
    diff = [o for o in outs if o.requires_grad]
    grads = {}
    if diff and everything:
        if poison:
            with reference.poisoned_outputs():
                got = torch.autograd.grad(diff, list(everything.values()),
                                          [u.to(o.dtype) for u, o in zip(upstream, diff)],
                                          allow_unused=True)
        else:
            got = torch.autograd.grad(diff, list(everything.values()),
                                      [u.to(o.dtype) for u, o in zip(upstream, diff)],
                                      allow_unused=True)
        for (name, leaf), gr in zip(everything.items(), got):
            grads[name] = gr if gr is not None else torch.zeros_like(leaf)
    return outs, grads


class _no_fastpath:
    def __enter__(self):
        self.was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self.was)
        return False


def module_parity(torch_module, our_module, args, kwargs=None, dtype=torch.float32,
                  grad_inputs=(), atol=None, grads=True):
    """Oracle results (list of reference.OracleResult) for ours vs torch's module (outputs, and
    with ``grads`` the gradients of every parameter and of the inputs in ``grad_inputs``)."""
    kwargs = kwargs or {}
    ref64_mod = copy.deepcopy(torch_module)
    reflp_mod = copy.deepcopy(torch_module)
    ours = copy.deepcopy(our_module)
    with torch.no_grad(), _no_fastpath():
        probe = _flatten(copy.deepcopy(torch_module).double()(
            *[_cast(x, torch.float64) for x in args],
            **{n: _cast(v, torch.float64) for n, v in kwargs.items()},
        ))
    g = fresh_generator()
    # On the outputs' device: autograd.grad refuses CPU grad_outputs for CUDA outputs
    # ("invalid gradient at index 0 - expected device cuda:0 but got cpu").
    upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device) for o in probe]
    if not grads:
        for m in (ref64_mod, reflp_mod, ours):
            m.requires_grad_(False)
        grad_inputs = ()
    # torch's reference is its standard path: the inference fast path (taken without grads)
    # is another implementation, with NaN for some mask mixes and zeros at padded positions.
    with _no_fastpath():
        out64, grads64 = _run(ref64_mod, args, kwargs, torch.float64, grad_inputs, upstream)
        outlp, gradslp = _run(reflp_mod, args, kwargs, dtype, grad_inputs, upstream)
    out, grads = _run(ours, args, kwargs, dtype, grad_inputs, upstream, poison=True)
    if len(out) != len(out64):
        raise AssertionError(f"ours returned {len(out)} tensors, torch {len(out64)}")
    def compare(name, o, lp, r64):
        return reference.oracle_compare(name, o, lp, r64, dtype, _scaled_atol(r64, dtype, atol))

    results = []
    for i, (o, lp, r64) in enumerate(zip(out, outlp, out64)):
        if o.dtype != lp.dtype:
            raise AssertionError(f"output {i}: dtype {o.dtype} != torch's {lp.dtype}")
        results.append(compare(f"out[{i}]", o, lp, r64))
    if set(grads) != set(grads64):
        raise AssertionError(f"gradients {sorted(grads)} != torch's {sorted(grads64)}")
    for name in grads64:
        results.append(compare(name, grads[name], gradslp[name], grads64[name]))
    return results


def _scaled_atol(ref64, dtype, atol=None):
    """DESIGN 6's atol is the floor of one rounding for O(1) values.  A module's parameter
    gradients are sums over every row (|g| of several units), where one bf16 rounding alone is
    ~|g| * 2^-9 and exceeds the absolute atol; ours and torch's low-precision results then
    differ by roundings of that size that the 2x factor cannot absorb when torch happens to
    round closer.  So the floor scales with the reference's magnitude: atol * max(1, max|ref|)
    (unchanged for O(1) tensors)."""
    base = reference.ATOL[dtype] if atol is None else atol
    scale = float(ref64.detach().abs().max()) if ref64.numel() else 1.0
    return base * max(1.0, scale)


def relu_grads_checkable(activation, dtype) -> bool:
    """ReLU's derivative jumps at 0: in low precision a pre-activation within rounding of 0 may
    land on either side in two correct computations (ours and torch's bf16 differ by rounding
    upstream of the FFN), which changes dW1, db1 and every upstream gradient by O(1) terms.  So
    with relu, low-precision gradients are not comparable; they are checked in fp32, and in bf16
    with the smooth activations (gelu, tanh-gelu, tanh)."""
    is_relu = activation in ("relu", F.relu) or isinstance(activation, torch.nn.ReLU)
    return dtype in (torch.float32, torch.float64) or not is_relu


def assert_parity(torch_module, our_module, args, kwargs=None, dtype=torch.float32,
                  grad_inputs=(), context="", grads=True):
    results = module_parity(torch_module, our_module, args, kwargs, dtype, grad_inputs, grads=grads)
    reference.assert_oracle(results, context)
    return results


# --------------------------------------------------------------------------------------------
# The helper must be able to fail


def test_parity_helper_catches_a_wrong_weight():
    import transformer_fast.modules as M

    t = randomize_(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    ours = ours_like(t, M.TransformerEncoderLayer, 16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    assert_parity(t, ours, (x,), grad_inputs=(0,))  # same weights: passes
    with torch.no_grad():
        ours.linear2.bias[3] += 1e-3
    results = module_parity(t, ours, (x,), grad_inputs=(0,))
    assert not all(r.ok for r in results)
    with pytest.raises(AssertionError, match="oracle failed"):
        reference.assert_oracle(results)


def test_parity_helper_catches_a_wrong_gradient():
    """A module whose forward matches but whose backward is wrong fails on the gradients."""

    class Wrong(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y.detach() + (y - y.detach()) * 1.01  # value exact, gradient 1% off

    t = torch.nn.Sequential()
    t.add_module("lin", torch.nn.Linear(8, 8))
    randomize_(t)

    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    ref = Ref()
    ref.load_state_dict(t.state_dict())
    wrong = Wrong()
    wrong.load_state_dict(t.state_dict())
    results = module_parity(ref, wrong, (torch.randn(4, 8),))
    names = {r.name for r in results if not r.ok}
    assert "out[0]" not in names and "grad lin.weight" in names
