"""Ahead-of-time compilation of every Triton kernel of the package for sm_90 (no GPU needed).

Runs ``python -m transformer_fast.kernels.compile_check --quick`` in a subprocess (the check needs
TRITON_INTERPRET=0 when the kernels are imported, which this test process may not have): the
launchers are called on meta tensors with their kernels recorded, and each recorded launch is
compiled with the specialisation a real launch gets (tt.divisibility 16 on pointers and on
integers divisible by 16), through Triton's bundled ptxas.  The full matrix (all dtypes, head
dims and autotune configs) is run by ``compile_check`` without ``--quick`` on the GPU machines.
"""
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.triton


def test_all_kernels_compile_for_sm90_quick():
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no bundled ptxas")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_fast.kernels.compile_check", "--arch", "90", "--quick"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n".join(l for l in out.splitlines() if l.startswith("FAIL"))[-8000:] + out[-4000:]
    assert " 0 failed" in proc.stdout
    for kernel in ("_fwd_kernel", "_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
                   "_attn_bwd_delta_kernel", "_decode_fwd_kernel", "_decode_combine_kernel",
                   "_kv_append_kernel", "_fwd_fused_kernel", "_fwd_apply_kernel", "_bwd_fused_kernel",
                   "_bwd_apply_kernel"):
        assert f"ok   {kernel} " in proc.stdout, f"{kernel} was not compiled"
