"""Indices that leave a tensor (an outside audit of the kernels' index arithmetic, 2026-11-30,
tenth session; DESIGN section 9: no input makes a kernel read or write out of bounds).

- The fused loss's Triton row kernel read the logits at each target id unchecked: on a GPU,
  where the host check of target values does not run (it would sync), an id outside [0, V)
  gave a silently wrong loss (negative for 10**6) from memory outside the row.  Now a GPU's
  call asserts on the device (as torch's cross entropy does) and the kernel never reads an id
  out of range.
- masked_softmax's Triton kernels multiplied the mask's column index by its column stride in
  int32: a transposed mask with Lq * Lk > 2**31 wrapped (wrong probabilities, or a crash).
"""
from __future__ import annotations

import math

import pytest
import torch

from transformer_fast import _checks, functional as F
from transformer_fast.models import fused_loss, training

from conftest import backend_params, require_backend


def _ce_inputs(dtype=torch.float32, rows=6, vocab=11, width=16):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    hidden = torch.randn(rows, width, generator=g).to(dtype)
    weight = (torch.randn(vocab, width, generator=g) / 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    return hidden, weight, target


@pytest.mark.parametrize("bad", [11, 14, 10**6, -1, -100])
@pytest.mark.parametrize("loss", ["linear_cross_entropy", "label_smoothed_cross_entropy"])
def test_target_out_of_range_asserts_on_the_device_path(monkeypatch, loss, bad):
    """Where host checks are off by default (a GPU), the check runs as a device-side assert; on
    a CPU tensor torch._assert_async raises at once, which is what is observable here."""
    monkeypatch.setattr(_checks, "value_check_mode", lambda device: "device")
    hidden, weight, target = _ce_inputs()
    target[2] = bad
    with pytest.raises(RuntimeError, match=r"class id outside \[0, 11\)"):
        if loss == "linear_cross_entropy":
            fused_loss.linear_cross_entropy(hidden, weight, target, backend="torch")
        else:
            training.label_smoothed_cross_entropy(hidden @ weight.T, target)


def test_ignored_targets_do_not_trip_the_device_assert(monkeypatch):
    monkeypatch.setattr(_checks, "value_check_mode", lambda device: "device")
    hidden, weight, target = _ce_inputs()
    target[1] = -100
    got = fused_loss.linear_cross_entropy(hidden, weight, target, ignore_index=-100, backend="torch")
    want = torch.nn.functional.cross_entropy(hidden @ weight.T, target, label_smoothing=0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_target_out_of_range_is_a_value_error_on_the_host_path():
    hidden, weight, target = _ce_inputs()
    target[0] = 11
    with pytest.raises(ValueError, match=r"target must hold class ids in \[0, 11\); got \[.*, 11\]"):
        fused_loss.linear_cross_entropy(hidden, weight, target)


@pytest.mark.triton
@pytest.mark.parametrize("bad", [11, 10**6, -5])
def test_row_kernel_never_reads_an_id_out_of_range(bad):
    """With every check off (TRANSFORMER_FAST_CHECKS=0), the row kernel gives the row without
    its target term (its logsumexp; gradient softmax) instead of reading outside the row."""
    from transformer_fast.kernels.cross_entropy import cross_entropy_rows

    dev = require_backend("triton")
    hidden, weight, target = _ce_inputs(torch.bfloat16)
    logits = (hidden.float() @ weight.float().T).to(torch.bfloat16).to(dev)
    target = target.to(dev)
    target[3] = bad
    keep = torch.ones_like(target, dtype=torch.bool)
    grad = logits.clone()
    loss = cross_entropy_rows(grad, target, keep, 0.0, True)
    z = logits.double()
    lse = torch.logsumexp(z, dim=1)
    assert math.isclose(loss[3].item(), lse[3].item(), rel_tol=1e-5, abs_tol=1e-5)
    torch.testing.assert_close(grad[3].double(), torch.softmax(z[3], 0), rtol=0, atol=4e-3)
    others = [r for r in range(6) if r != 3]
    want = lse[others] - z[others, target[others]]
    torch.testing.assert_close(loss[others].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params("cpu", "triton", "cuda"))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_softmax_mask_with_a_column_stride_past_int32(backend, kind):
    """A (4, 3) mask whose column stride is 2**30 + 8: the last column's offset, 2**31 + 16, does
    not fit in int32.  The view sits in a ~2 GiB uninitialised buffer of which only the mask's
    12 elements are written (the rest is never touched, so never paged in)."""
    dev = require_backend(backend)
    lq, lk, stride = 4, 3, 2**30 + 8
    dtype = torch.bool if kind == "bool" else torch.float16
    storage = torch.empty((lk - 1) * stride + lq, dtype=dtype, device=dev)
    mask = storage.as_strided((lq, lk), (1, stride))
    if kind == "bool":
        mask.copy_(torch.tensor([[True, True, False]] * lq))
    else:
        mask.copy_(torch.tensor([[0.0, 0.5, float("-inf")]] * lq, dtype=dtype))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    scores = torch.randn(1, 1, lq, lk, generator=g).to(torch.float16).to(dev)  # a float mask has its dtype
    got = F.masked_softmax(scores, mask, backend=backend)
    added = torch.where(mask.cpu(), 0.0, float("-inf")) if kind == "bool" else mask.cpu().float()
    want = torch.softmax(scores.cpu().double() + added.double(), dim=-1)
    assert got[..., 2].abs().max().item() == 0.0
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-3)
