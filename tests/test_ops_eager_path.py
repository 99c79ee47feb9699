"""transformer_fast.ops.call: an eager call with nothing to differentiate runs the custom op's
implementation directly (no custom-op dispatch); anything else goes through the op."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from transformer_fast import functional as F
from transformer_fast.ops import decode, layer_norm

from conftest import require_backend


def _ln_inputs(requires_grad=False):
    x, r = torch.randn(5, 24), torch.randn(5, 24)
    w, b = torch.rand(24) + 0.5, torch.randn(24)
    return [t.requires_grad_(requires_grad) for t in (x, r, w, b)]


def _refuse(*args, **kwargs):
    raise AssertionError("the custom op was dispatched")


def test_inference_call_skips_the_custom_op(monkeypatch):
    require_backend("cpu")
    x, r, w, b = _ln_inputs()
    expected = F.add_layer_norm(x, r, w, b, backend="cpu")
    monkeypatch.setattr(layer_norm, "add_layer_norm_fwd", _refuse)
    assert torch.equal(F.add_layer_norm(x, r, w, b, backend="cpu"), expected)  # nothing needs grad
    xg, rg, wg, bg = _ln_inputs(requires_grad=True)
    with torch.no_grad():
        F.add_layer_norm(xg, rg, wg, bg, backend="cpu")
    with torch.inference_mode():
        F.add_layer_norm(x, r, w, b, backend="cpu")
    with pytest.raises(AssertionError, match="dispatched"):  # autograd needs the op
        F.add_layer_norm(xg, rg, wg, bg, backend="cpu")


def test_direct_and_dispatched_calls_agree():
    require_backend("cpu")
    x, r, w, b = _ln_inputs(requires_grad=True)
    with torch.no_grad():
        direct = F.add_layer_norm(x, r, w, b, backend="cpu", prenorm=True)
    dispatched = F.add_layer_norm(x, r, w, b, backend="cpu", prenorm=True)
    for a, c in zip(direct, dispatched):
        assert torch.equal(a, c.detach())


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_the_custom_op():
    """Op counters, FakeTensorMode and tracers run under a dispatch mode: they get the op."""
    require_backend("cpu")
    x, r, w, b = _ln_inputs()
    with _Recorder() as rec:
        F.add_layer_norm(x, r, w, b, backend="cpu")
    assert any("transformer_fast.add_layer_norm_fwd" in name for name in rec.ops), rec.ops


def test_direct_kv_cache_call_bumps_the_caches_versions(monkeypatch):
    require_backend("cpu")
    q = torch.randn(2, 2, 1, 16)
    k_cache, v_cache = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    seqlens = torch.tensor([0, 3], dtype=torch.int32)
    before = (k_cache._version, v_cache._version)
    monkeypatch.setattr(decode, "attention_with_kv_cache_op", _refuse)
    F.attention_with_kv_cache(q, k_cache, v_cache, seqlens, q.clone(), q.clone(), backend="cpu")
    assert k_cache._version > before[0] and v_cache._version > before[1]
    assert torch.equal(k_cache[0, :, 0], q[0, :, 0]) and torch.equal(k_cache[1, :, 3], q[1, :, 0])
