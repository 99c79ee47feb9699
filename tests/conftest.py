"""Shared test setup.

Without a GPU, Triton kernels run through the interpreter on CPU tensors: TRITON_INTERPRET must
be set before any @triton.jit decorator runs, so it is set here, before tests import kernels.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformer_fast import backends  # noqa: E402  (after TRITON_INTERPRET)

HAS_CUDA = torch.cuda.is_available()


def backend_device(backend: str) -> str:
    """The device a backend's tests run on here."""
    if backend == "cuda":
        return "cuda"
    if backend == "triton":
        return "cuda" if HAS_CUDA else "cpu"
    return "cpu"


def backend_params(*names: str):
    """pytest params for backends; the cuda one is marked gpu and all skip when unavailable."""
    params = []
    for name in names:
        marks = []
        if name == "cuda":
            marks.append(pytest.mark.gpu)
        if name == "triton":
            marks.append(pytest.mark.triton)
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture
def device_of():
    return backend_device


def require_backend(backend: str) -> str:
    """Skip the test when ``backend`` cannot run here; return its device."""
    device = backend_device(backend)
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    ok, why = backends.available(backend, device)
    if not ok:
        if os.environ.get("CI") and backend in ("cpu", "triton"):
            pytest.fail(f"backend {backend} must be available in CI: {why}")
        pytest.skip(why)
    return device


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
