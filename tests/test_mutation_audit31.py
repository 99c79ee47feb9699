"""From the thirty-first outside audit (mutation testing of the CUDA kernels through the CPU
emulation, second round; 2026-11-30, thirteenth session): mutants that no test caught, each
killed here (the test passes on the code and fails on the mutant, checked both ways):

- the dense forward with GQA mapping heads by h % Hkv (no oracle test ran it with groups);
- delta_kernel (Lk > 128) reading O with dO's strides (packed q/k/v give O in (B, L, H, D));
- add_layer_norm's loop forward writing the prenorm sum with the residual's row stride;
  the long-row dweight column kernel ignoring dropout;
- the FFN's scalar-path bias gradient summing 16-bit-rounded values (killed by
  test_ffn_cuda_emulated.py's N 63 case); the bias gradient of a dy whose rows are longer than N
  read with N as the row stride;
- the decode kernel loading V only up to D columns (Dv > D never ran);
- the decode kernel's fp32 path rounding its double score to fp32, or the splits' log-sum-exp
  to fp32 before the combine (the large-logit draws of test_decode_cuda_emulated.py stayed
  under the oracle's bound with either; these draws go 1.27x / 1.17x / 1.04x past it).
"""
import pytest
import torch

from test_attention_cpu import cuda_emulation, _run_emulated, _run_dense_emulated  # noqa: F401
from test_decode_cxx import cuda_emulation as decode_emulation  # noqa: F401
from test_decode_cxx import check as kv_check, fresh_seed, to_device, make_case, forced_splits
from _functional_helpers import assert_kv_cache_on_oracle, very_large_logit_kv_cases
import test_add_layer_norm_cuda_emulated as ln_emu
from test_add_layer_norm_cuda_emulated import emu, as_cuda_backend as ln_backend  # noqa: F401  (ln_backend needs `emu`)
from test_ffn_cuda_emulated import emu as ffn_emulation  # noqa: F401


# -- attention (csrc/attention_dense_fwd.cuh, attention_cuda.cu) --------------------------------

def test_dense_forward_gqa_emulated(cuda_emulation):
    """fwd_dense_kernel with GQA groups of 2 over 2 kv heads (h // group, not h % Hkv): the quick
    dense cases have Hkv 1 or H == Hkv, where both maps agree; the backward-only GQA checks run
    their forward on fwd_kernel."""
    _run_dense_emulated(cuda_emulation, (1, 4, 2, 70, 67, 64, torch.bfloat16, "causal", 0.0))


def test_delta_kernel_reads_out_through_its_own_strides_emulated(cuda_emulation):
    """Lk > kExactDeltaMaxLk (delta_kernel, delta from the stored O) with q/k/v packed views: O
    comes back in q's (B, L, H, D) order while dO is (B, H, L, D) contiguous, so O must be read
    with O's strides (every quick case with Lk > 128 has both contiguous)."""
    _run_emulated(cuda_emulation, (1, 2, 2, 130, 130, 64, torch.bfloat16, "packed", 0.0))


# -- add_layer_norm (csrc/add_layer_norm_cuda.cu) -------------------------------------------------

def test_prenorm_on_the_loop_forward_with_strided_rows(ln_backend):
    """fwd_loop_kernel (scalar rows > 8192) with prenorm: the residual sum h is written as an
    (M, N) contiguous output whatever the residual's row stride ("mixed": residual (m, n + 2)[:, 1:]).
    No default-run case has prenorm on the loop forward."""
    assert ln_backend.paths(9000, 1)[0] == 1
    ln_emu._check(2, 9000, torch.float32, prenorm=True, layout="mixed")


def test_dweight_of_the_column_kernel_with_dropout(ln_backend):
    """bwd_dwdb_cols_kernel (the long-row backward's dweight partials) with dropout: h carries
    dropout(x).  The default cases with the loop backward have no weight with dropout."""
    assert ln_backend.paths(4099, 1)[3] == 1
    ln_emu._check(3, 4099, torch.float16, affine="both", dropout_p=0.2, layout="mixed")


# -- ffn (csrc/ffn_cuda.cu) -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_wgrad_bias_gradient_of_a_strided_dy(ffn_emulation, dtype):
    """linear_wgrad's db (colsum_partial_kernel) of a dy whose rows are longer than N (a slice of a
    wider gradient, e.g. from torch.cat's backward): the bits of the contiguous dy's."""
    emu = ffn_emulation
    emu.set_fused_epilogues(False)  # fp32: the column sum instead of the BGRADB epilogue
    try:
        g = torch.Generator().manual_seed(5)
        dy = torch.randn(37, 40, generator=g).to(dtype)[:, 3:27]
        x = torch.randn(37, 16, generator=g).to(dtype)
        got = emu.linear_wgrad(dy, x, True, False)
        want = emu.linear_wgrad(dy.contiguous(), x, True, False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[1].double(), dy.double().sum(0), atol=1e-2, rtol=1e-2)
    finally:
        emu.set_fused_epilogues(True)


# -- decode (csrc/decode_cuda.cu) -----------------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 2])
def test_value_head_dim_above_the_key_head_dim_emulated(decode_emulation, splits):
    """Dv > D (the emulated cases have Dv < D only): V's columns D..Dv-1 are read too."""
    seed = fresh_seed()
    inputs = to_device(make_case(1, 4, 2, 2, 40, 32, torch.float32, [20], True, Dv=72, seed=seed), "cpu")
    kv_check(decode_emulation.kv_fwd, *inputs, splits=splits, context=f"Dv > D seed {seed}")


@pytest.mark.parametrize("seed,logit_std,splits", [(5022, 30.0, 1), (5011, 300.0, 2), (5015, 30.0, 2)])
def test_fp32_scores_and_split_lse_stay_double_emulated(decode_emulation, seed, logit_std, splits):
    """Draws (4 heads on 1 kv head, 128 keys) found by scanning 30 seeds per logit scale: the
    kernel is at 0.2-0.35x of the oracle's bound on them; a score rounded to fp32 after its double
    dot goes 1.27x (5022) / 1.17x (5011) past it, split lse rounded to fp32 1.04x (5015)."""
    def run(q, kc, vc, lens, kn, vn):
        with forced_splits(splits):
            return decode_emulation.kv_fwd(q, kc, vc, lens, kn, vn, q.shape[-1] ** -0.5)

    case = next(very_large_logit_kv_cases([seed], heads=4, kv_heads=1, logit_std=logit_std))
    assert_kv_cache_on_oracle(run, case, f"seed {seed}")
