"""Regressions from the tenth outside audit (DESIGN.md's surfaces besides the numerics, 2026-11-30)."""
import subprocess
import sys

import pytest
import torch

import transformer_fast as tf
from transformer_fast import backends


def _sdpa_inputs(**overrides):
    inputs = dict(query=torch.randn(1, 1, 4, 16), key=torch.randn(1, 1, 4, 16), value=torch.randn(1, 1, 4, 16),
                  attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  key_padding_mask=None)
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize("backend", ["cpu", "triton", "torch", "reference"])
@pytest.mark.parametrize("bad", ["1-D query", "string query", "list"])
def test_not_supported_reasons_answers_a_list_for_malformed_inputs(backend, bad):
    """DESIGN 3: every backend answers not_supported_reasons: a list, also for inputs the op
    would reject (it raised IndexError / AttributeError)."""
    if bad == "list":
        inputs = [torch.randn(4)]
    else:
        q = torch.randn(16) if bad == "1-D query" else "abc"
        inputs = _sdpa_inputs(query=q, key=torch.randn(16), value=torch.randn(16))
    reasons = tf.not_supported_reasons(backend, "scaled_dot_product_attention", inputs)
    assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)
    if bad == "list":
        assert reasons and "mapping" in reasons[0]


def test_use_backend_is_reusable_and_checked_when_made():
    cm = tf.use_backend("reference")
    for _ in range(2):  # a second `with` on the same object works, as torch.no_grad()'s
        with cm:
            assert backends.requested_backend() == "reference"
        assert backends.requested_backend() == "auto"
    with pytest.raises(ValueError, match="use_backend"):
        tf.use_backend("nope")

    @tf.use_backend("torch")
    def inside():
        return backends.requested_backend()

    assert inside() == inside() == "torch"


def test_triton_interpret_set_after_import_is_a_reason():
    """Triton fixes its interpreter mode at import: TRITON_INTERPRET set later gave a Triton
    error from inside the kernels; now the backend says why it cannot run."""
    code = (
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import transformer_fast as tf\n"
        "from transformer_fast import functional as F\n"
        "x = torch.randn(2, 8)\n"
        "reasons = tf.not_supported_reasons('triton', 'add_layer_norm', dict(x=x, residual=x, weight=None, bias=None))\n"
        "assert reasons and 'after Triton was imported' in reasons[0], reasons\n"
        "try:\n"
        "    F.add_layer_norm(x, x, None, None, backend='triton')\n"
        "except tf.BackendError as e:\n"
        "    assert 'after Triton was imported' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no BackendError')\n"
        "assert F.add_layer_norm(x, x, None, None).shape == x.shape  # auto takes another backend\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
