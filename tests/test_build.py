"""The extension: built and loaded, with the kernels the build promised."""
import os

import pytest
import torch

from transformer_fast import backends

OPS = ["add_layer_norm_fwd", "add_layer_norm_bwd"]


def test_extension_loads_in_ci():
    ok, why = backends.extension_status()
    if not ok and not os.environ.get("CI"):
        pytest.skip(why)
    assert ok, why


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernels_registered(op):
    if not backends.extension_status()[0]:
        pytest.skip("extension not built")
    assert backends.cxx_op_has_kernel(op, "CPU")


@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compiled_when_required(op):
    """CI sets TRANSFORMER_FAST_CUDA=1: the CUDA sources must have compiled and linked."""
    if os.environ.get("TRANSFORMER_FAST_CUDA") != "1" and not torch.cuda.is_available():
        pytest.skip("CUDA part not required here")
    assert backends.cxx_op_has_kernel(op, "CUDA")
