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


# The GPU machines run Triton 3.6 (TOOLCHAIN.md), CI and this venv 3.8: scripts/test.sh installs
# Triton 3.6 beside the venv's (pip --target, no dependencies) so that the kernels are also
# compiled by the Triton that will run them on a GPU.
TRITON36_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "triton36")


def _compile_quick(env, triton_dir):
    ptxas = os.path.join(triton_dir, "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no bundled ptxas")
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_fast.kernels.compile_check", "--arch", "90", "--quick", "--resources"],
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
    # Exact fp32 attention at head dims past 128 has its own config lists, whose first configs
    # compile without register spills on both Tritons (the shared fp32 list's spilled up to
    # 2112 bytes a thread there: benchmarks/NOTES.md, twenty-ninth session).
    wide = [l for l in proc.stdout.splitlines() if "_attn_" in l and " attention fp32 D=256 " in l]
    assert len(wide) == 6, wide
    spilled = [l for l in wide if "spill_stack=0 " not in l]
    assert not spilled, spilled
    return proc.stdout


def test_all_kernels_compile_for_sm90_quick():
    _compile_quick(dict(os.environ, TRITON_INTERPRET="0"), os.path.dirname(triton.__file__))


def test_all_kernels_compile_for_sm90_quick_triton36():
    if not os.path.isdir(os.path.join(TRITON36_DIR, "triton")):
        if os.environ.get("CI"):
            pytest.fail(f"Triton 3.6 is not installed in {TRITON36_DIR} (scripts/test.sh installs it)")
        pytest.skip(f"Triton 3.6 is not installed in {TRITON36_DIR} (scripts/test.sh installs it)")
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(filter(None, [TRITON36_DIR, os.environ.get("PYTHONPATH")])))
    stdout = _compile_quick(env, os.path.join(TRITON36_DIR, "triton"))
    assert "triton 3.6." in stdout, stdout[-2000:]
