"""The C++ CPU kernels draw dropout masks with AVX-512F (16 Philox blocks = 64 elements at a time)
where the CPU has it and with AVX2 (8 blocks) otherwise (csrc/dropout_cpu.h, chosen at run time),
with a scalar loop for the elements before the first multiple of 4 and the tail.  Both must
give transformer_fast.philox's mask bit for bit; TRANSFORMER_FAST_CPU_NO_AVX512=1 forces the
AVX2 path, so on an AVX-512 machine each path is checked in its own process (the choice is made
once per process).
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformer_fast._C")

SCRIPT = r"""
import torch
from transformer_fast import philox
ops = torch.ops.transformer_fast_C
# Row widths around the 16- and 8-lane steps, so every path (16, 8, scalar tail) covers elements.
for rows, cols in [(3, 7), (5, 16), (4, 37), (3, 66), (2, 1000), (1, 4099)]:
    for p in (0.1, 0.5):
        rng = torch.tensor([0x123456789AB, 0xFEDCBA98765], dtype=torch.int64)
        x = torch.randn(rows, 1).abs() + 1.0
        w = torch.ones(cols, 1)
        y, _ = ops.ffn_linear_fwd(x, w, None, "none", p, rng, False, False)  # (rows, cols), > 0 kept
        keep = philox.dropout_keep_mask(rng, (rows, cols), p)
        assert torch.equal(y != 0, keep), (rows, cols, p, (y != 0).ne(keep).sum().item())
        assert torch.allclose(y[keep], (x.expand(rows, cols) / (1 - p))[keep])
# The generator itself at element indices no tensor here can reach: the block counter's low word
# wraps inside a vector (indices just below 2^34 and 2^35), and near 2^63; every start modulo 4
# and lengths around the 64- and 32-element steps.
import numpy as np
seed, offset = [v & (2**64 - 1) for v in rng.tolist()]
p = 0.3
for first in (0, 1, 2, 3, 2**34 - 7, 2**34 - 64 - 2, 2**35 - 33, 2**63 - 200):
    for n in (0, 1, 3, 31, 32, 33, 63, 64, 65, 97, 200):
        got = ops.dropout_factors(rng, first, n, p)
        words = philox.philox_words(seed, offset, np.arange(first, first + n, dtype=np.uint64))
        want = torch.from_numpy(words >= philox.dropout_threshold(p)).float() * np.float32(1 / (1 - p))
        assert torch.equal(got, want), (first, n)
print("ok")
"""


@pytest.mark.parametrize("force_avx2", [False, True], ids=["auto_isa", "avx2"])
def test_cpu_dropout_mask_matches_philox(force_avx2):
    env = dict(os.environ)
    env.pop("TRANSFORMER_FAST_CPU_NO_AVX512", None)
    if force_avx2:
        env["TRANSFORMER_FAST_CPU_NO_AVX512"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]

