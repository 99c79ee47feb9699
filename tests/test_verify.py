"""`python -m transformer_fast verify` machinery: every registered op's cases run and pass on
the backends available here (Triton through the interpreter without a GPU)."""
import pytest
import torch

from transformer_fast import verify

from conftest import require_backend


@pytest.mark.triton
@pytest.mark.parametrize("op", sorted(verify.CASES))
def test_verify_cases_pass_on_triton(op):
    device = require_backend("triton")
    if op == "add_layer_norm" and device == "cpu":
        pytest.skip("covered by tests/test_add_layer_norm.py (65536-wide rows are slow in the interpreter)")
    rows = verify.verify(device, ops=[op], dtypes=[torch.float32], backend_names=["triton"], log=lambda *a: None)
    assert rows and all(r.status == "PASS" for r in rows), [(r.status, r.detail) for r in rows]


def test_a_failure_is_reported_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(verify.functional, "masked_softmax", broken)
    rows = verify.verify("cpu", ops=["masked_softmax"], dtypes=[torch.float32], backend_names=["torch"],
                         log=lambda *a: None)
    assert rows[0].status == "FAIL" and "kernel exploded" in rows[0].detail
