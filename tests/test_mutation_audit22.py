"""From the twenty-second outside audit (mutation testing of the C++ CPU kernels, csrc/*.cpp;
2026-11-30, eleventh session; 25 of 27 mutants caught): the two survivors, each killed here
(checked both ways in a private build):

- add_layer_norm's CPU backward reduces dweight / dbias over per-thread row groups; the suite
  runs with one thread, so the cross-group reduction never ran (dropping the last group's share
  passed every test);
- the KV-cache CPU kernel's single leftover row of a tile of >= 16 packed query rows (an odd
  count: an MHA prefill chunk of 17 tokens, a GQA group of 3 x 7 tokens) was never reached.
"""
import pytest
import torch

from transformer_fast import functional as F
from conftest import require_backend


def _threads(n):
    class _T:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)
        def __exit__(self, *a):
            torch.set_num_threads(self.old)
    return _T()


def test_cpu_add_layer_norm_param_grads_with_several_threads():
    """dweight / dbias are reduced over per-thread row groups: with one thread (as the suite runs)
    there is one group, so the cross-group reduction never runs."""
    require_backend("cpu")
    g = torch.Generator().manual_seed(0)
    m, n = 37, 24
    x = torch.randn(m, n, generator=g, dtype=torch.float64)
    r = torch.randn(m, n, generator=g, dtype=torch.float64)
    w = (1 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    b = torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (x, r, w, b)]
    torch.nn.functional.layer_norm(ref_in[0] + ref_in[1], (n,), ref_in[2], ref_in[3]).backward(dy)
    with _threads(2):
        ins = [t.float().requires_grad_() for t in (x, r, w, b)]
        F.add_layer_norm(*ins, backend="cpu").backward(dy.float())
    for got, want, name in zip(ins, ref_in, "x r w b".split()):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("h,hkv,l_new", [(1, 1, 17), (3, 1, 7)])
def test_cpu_kv_cache_odd_tile_of_many_rows(h, hkv, l_new):
    """A tile of >= 16 packed query rows with an odd count (MHA prefill chunk of 17 tokens; GQA
    group 3 x 7 tokens = 21 rows) takes block_scores_t's single leftover-row loop, which no case of
    test_decode_cxx / test_triton_decode reaches (their many-row tiles are all even)."""
    require_backend("cpu")
    g = torch.Generator().manual_seed(1)
    B, L_max, D = 2, 40, 32
    q = torch.randn(B, h, l_new, D, generator=g)
    kc = torch.randn(B, hkv, L_max, D, generator=g)
    vc = torch.randn(B, hkv, L_max, D, generator=g)
    kn = torch.randn(B, hkv, l_new, D, generator=g)
    vn = torch.randn(B, hkv, l_new, D, generator=g)
    seq = torch.tensor([5, 20], dtype=torch.int32)
    outs = []
    for backend in ("cpu", "reference"):
        k, v = kc.clone(), vc.clone()
        outs.append(F.attention_with_kv_cache(q, k, v, seq, kn, vn, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
