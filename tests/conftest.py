"""Shared test setup.

Without a GPU, Triton kernels run through the interpreter on CPU tensors: TRITON_INTERPRET must
be set before any @triton.jit decorator runs, so it is set here, before tests import kernels.

Random inputs.  Every run draws fresh inputs from one session seed: TF_TEST_SEED when set, else a
new random one, printed in the report header.  Each test seeds torch's, Python's and numpy's
global generators from (session seed, test id), and the oracle's upstream gradients come from
torch's generator, so `TF_TEST_SEED=<seed> pytest <test id>` replays a failure exactly, alone or
in the whole run, with or without xdist.  Hypothesis uses the session seed unless
--hypothesis-seed is given.
"""
import os
import random
import secrets
import zlib

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


def _session_seed() -> int:
    # Set once by the controller process so that xdist workers (which inherit the environment)
    # draw from the same seed.
    if not os.environ.get("TF_TEST_SEED"):
        os.environ["TF_TEST_SEED"] = str(secrets.randbits(31))
    return int(os.environ["TF_TEST_SEED"])


SESSION_SEED = _session_seed()


def pytest_configure(config):
    try:
        from hypothesis import core
    except ImportError:
        return
    if config.getoption("--hypothesis-seed", default=None) is None:
        core.global_force_seed = SESSION_SEED


def pytest_report_header(config):
    return f"transformer_fast test seed: {SESSION_SEED} (TF_TEST_SEED={SESSION_SEED} replays this run's draws)"


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = zlib.crc32(f"{SESSION_SEED}:{request.node.nodeid}".encode())
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny tensors: more only add contention (10x slower on a
    loaded 2-core machine).  Use with pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAILURE_LOG_ENV = "TF_FAILURE_LOG"
SLOW_LOG_ENV = "TF_SLOW_LOG_S"  # with TF_FAILURE_LOG: also log tests slower than this (s)


def pytest_runtest_logreport(report):
    """With TF_FAILURE_LOG=<file>, append each failure's traceback to it as the failure happens
    (once, from the xdist controller): a run killed at its time limit on a lent GPU machine
    keeps the tracebacks that pytest would print only at the end."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    elif report.when == "call" and report.duration >= float(os.environ.get(SLOW_LOG_ENV, "10")):
        # Where a lease's test time goes (pytest's --durations prints only at the end, which a
        # run killed at its limit never reaches).
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"slow test: {report.duration:6.1f} s {report.nodeid}\n")


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.when == "call":
        item.add_report_section("call", "seed", f"TF_TEST_SEED={SESSION_SEED} pytest '{item.nodeid}' replays it")


def _unresolved_fixtures(item) -> list:
    """Fixture names ``item`` asks for that no conftest or module in its scope defines (e.g. a
    shared test imported into a gpu module without the fixture it uses)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [n for n in info.names_closure if n not in info.name2fixturedefs and n != "request"]


FIRST_ENV = "TF_TEST_FIRST"


def pytest_collection_modifyitems(config, items):
    # TF_TEST_FIRST=<nodeid prefix>,...: those tests first, in that order (a stable sort, the same
    # in every xdist worker), e.g. the files a time-limited GPU run did not reach last time.
    first = [p for p in os.environ.get(FIRST_ENV, "").split(",") if p]
    if first:
        items.sort(key=lambda item: next((i for i, p in enumerate(first) if item.nodeid.startswith(p)), len(first)))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # A gpu test whose fixtures do not resolve is left to error here, without a GPU, instead
        # of being skipped until the first GPU run (where 29 such tests errored on 2026-11-26).
        if "gpu" in item.keywords and not _unresolved_fixtures(item):
            item.add_marker(skip_gpu)
