"""Regressions from the ninth outside audit (autocast and dtypes against torch, 2026-11-30)."""
import pytest
import torch
import torch.nn.functional as F

from transformer_fast import functional as TF


@pytest.mark.parametrize("autocast_dtype, mask_dtype", [(torch.bfloat16, torch.float16),
                                                        (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "cpu", "reference", "torch"])
def test_sdpa_takes_a_mask_of_the_other_16_bit_dtype_under_autocast(autocast_dtype, mask_dtype, query_dtype,
                                                                    backend):
    """torch's SDPA under autocast casts a float attn_mask to the autocast dtype, whatever its
    16-bit dtype (ours refused an fp16 mask under bf16 autocast)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 16).to(query_dtype) for _ in range(3))
    mask = torch.randn(4, 4).to(mask_dtype)
    with torch.autocast("cpu", dtype=autocast_dtype):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        padded = TF.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.randn(1, 4).to(mask_dtype),
                                                 backend=backend)
    assert got.dtype == want.dtype == padded.dtype == autocast_dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
