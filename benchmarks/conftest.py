"""pytest setup for the pytest-benchmark microbenchmarks (``pytest benchmarks/ --benchmark-only``).

Plain ``pytest`` runs tests/ only (pyproject's testpaths), so these never run in the test
suite.  Unlike tests/conftest.py this does NOT set TRITON_INTERPRET: the interpreter is not a
benchmark, so the triton provider runs only on a GPU and is skipped on a CPU.
"""
import pytest

pytest.importorskip("pytest_benchmark")
