"""benchmarks/gpu_suite.sh runs on a lent GPU machine only a few times; these checks run it here
(no GPU) so a broken script is caught before a lease is spent on it: step selection by exact
name or 'prefix*', per-step budgets, and the steps that need no GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def _run_suite(tmp_path, steps: str, **env):
    out = tmp_path / "out"
    full = dict(os.environ, PYTHON=sys.executable, OUT=str(out), STEPS=steps, TRANSFORMER_FAST_COMMIT="test")
    full.update(env)
    proc = subprocess.run(["bash", str(SUITE)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    summary = (out / "summary.txt").read_text()
    return proc, summary, out


def test_script_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "ncu_kernels.sh")], check=True)


def test_ncu_step_without_ncu(tmp_path):
    # Where ncu is missing the step says so and passes (the next steps still run).
    path = ":".join(p for p in os.environ.get("PATH", "").split(":") if not (Path(p) / "ncu").exists())
    proc, summary, out = _run_suite(tmp_path, "ncu_kernels", PATH=path)
    assert summary.split()[0] == "ncu_kernels" and "rc=0" in summary, summary + proc.stdout[-2000:]
    assert "ncu not found" in (out / "logs.txt").read_text()


def test_exact_step_names_and_the_exceptions_diagnostic(tmp_path):
    proc, summary, out = _run_suite(tmp_path, "info exceptions")
    steps = [line.split()[0] for line in summary.splitlines()]
    assert steps == ["info", "exceptions"], summary
    assert all("rc=0" in line for line in summary.splitlines()), summary + proc.stdout[-2000:]
    logs = (out / "logs.txt").read_text()
    assert "--- cpu: exit 0: RAISED True" in logs  # a C++ error reaches Python as RuntimeError
    assert (out / "meta.json").is_file()


def test_prefix_star_and_step_budget(tmp_path):
    # "verify" alone must not select verify_mma_sync (once verify_wgmma) (it did by prefix once, and ate a lease); a
    # word ending in '*' selects by prefix.  The diagnostic takes seconds: a 1 s budget kills it.
    proc, summary, _ = _run_suite(tmp_path, "exc*", STEP_TIMEOUT_exceptions="1")
    lines = summary.splitlines()
    assert [line.split()[0] for line in lines] == ["exceptions"], summary
    assert "rc=124" in lines[0], summary
    assert proc.returncode != 0


def _sanitize_case_names(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sanitize_kernels.py"), "--backend", "cpu",
                           "--device", "cpu", "--verbose", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.splitlines()[:-1]


def test_sanitize_kernels_shards_cover_every_case_once():
    """gpu_suite.sh compiles the Triton sanitizer cases in 16 shards first (--shard i/n): the
    shards together must be exactly the whole run."""
    whole = _sanitize_case_names()
    shards = [_sanitize_case_names("--shard", f"{i}/3") for i in range(3)]
    assert len(whole) > 50 and all(shards)
    assert sorted(sum(shards, [])) == sorted(whole)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sanitize_kernels.py"), "--shard", "3/3"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--shard" in bad.stderr


def test_failure_log_gets_failures_and_slow_tests(tmp_path, monkeypatch):
    """TF_FAILURE_LOG (set by gpu_suite.sh) receives each failure's traceback and each test
    slower than TF_SLOW_LOG_S as they happen, from the controller only."""
    import types

    import conftest

    log = tmp_path / "log.txt"
    monkeypatch.setenv("TF_FAILURE_LOG", str(log))
    monkeypatch.setenv("TF_SLOW_LOG_S", "5")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    rep = lambda **kw: types.SimpleNamespace(**{"nodeid": "t::x", "when": "call", "failed": False,
                                                "duration": 0.1, "longreprtext": "", **kw})
    conftest.pytest_runtest_logreport(rep(failed=True, longreprtext="AssertionError: boom"))
    conftest.pytest_runtest_logreport(rep(nodeid="t::slow", duration=7.25))
    conftest.pytest_runtest_logreport(rep(nodeid="t::fast", duration=1.0))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_runtest_logreport(rep(nodeid="t::worker", duration=70.0))
    text = log.read_text()
    assert "=== t::x (call)\nAssertionError: boom" in text
    assert "slow test:    7.2 s t::slow" in text or "slow test:    7.3 s t::slow" in text
    assert "t::fast" not in text and "t::worker" not in text


def test_cuda_attention_harness_builds_from_the_current_csrc():
    """benchmarks/cuda_attn (gpu_suite's cuda_attn step) extracts the forward kernels and
    AttentionParams from csrc/ at build time: it must still build when csrc changes, or the next
    lease loses the step.  Compiles for sm_90a with nvcc (no GPU needed)."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "cuda_attn" / "build.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ptxas = (ROOT / "benchmarks" / "cuda_attn" / "ptxas.txt").read_text()
    for kernel in ("fwd_kernel", "fwd_wgmma_kernel", "fwd_dense_kernel", "fwd_wgmma_dense_kernel"):
        assert kernel in ptxas, kernel


def test_recheck_list_names_existing_tests():
    """Every node id in benchmarks/gpu_recheck.txt is collected (a renamed test or a parameter
    added since would otherwise vanish from the recheck step unnoticed: pytest would stop with
    'not found' and run none of them)."""
    ids = [line.strip() for line in (ROOT / "benchmarks" / "gpu_recheck.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    assert ids
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider",
                           *ids], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("has_filter", [True, False], ids=["kernel_name", "older_sanitizer"])
def test_racecheck_checks_our_kernels_only(tmp_path, has_filter):
    # Unfiltered, racecheck also instruments every PyTorch kernel the cases launch (runs 4 and 5
    # killed it before its first report): where compute-sanitizer has --kernel-name, the racecheck
    # steps pass a filter on our namespace, and only them; an older one runs them unfiltered.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    help_line = "  --kernel-name arg   filter" if has_filter else "  --tool arg   the tool"
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(f"#!/usr/bin/env bash\n"
                    f"if [ \"$1\" = --help ]; then echo '{help_line}'; exit 0; fi\n"
                    f"echo \"$*\" >> '{calls}'\n")
    fake.chmod(0o755)
    steps = "sanitizer_memcheck sanitizer_racecheck sanitizer_sdpa_racecheck sanitizer_mma_sync_racecheck"
    proc, summary, _ = _run_suite(tmp_path, steps, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    assert all("rc=0" in line for line in summary.splitlines()), summary + proc.stdout[-2000:]
    lines = calls.read_text().splitlines()
    assert len(lines) == 4, lines
    for line in lines:
        filtered = "--kernel-name kns=transformer_fast" in line
        assert filtered == (has_filter and "--tool racecheck" in line), line


@pytest.mark.parametrize("failing_shard", [None, 2])
def test_triton_sanitizer_steps_run_in_shards(tmp_path, failing_shard):
    # Each Triton sanitizer step runs SANITIZER_SHARDS sanitized processes side by side (one
    # process got through add_layer_norm alone in run 6's 80 s of memcheck), every case once over
    # all shards, each line prefixed with its shard; the step fails if any shard does.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "compute-sanitizer"
    fail = "" if failing_shard is None else f"case \"$*\" in *'--shard {failing_shard}/'*) exit 1;; esac\n"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"echo \"$*\" >> '{calls}'\n"
                    "echo \"ran $*\"\n" + fail)
    fake.chmod(0o755)
    py = bin_dir / "python3"  # the cases' warm-up and the sanitized runs: no GPU needed here
    py.write_text("#!/usr/bin/env bash\nexit 0\n")
    py.chmod(0o755)
    proc, summary, out = _run_suite(tmp_path, "sanitizer_memcheck_triton", SANITIZER_SHARDS="3",
                                    PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", PYTHON=str(py))
    lines = [line for line in calls.read_text().splitlines() if "--tool" in line]  # (not --help)
    assert sorted(line.split("--shard ")[1] for line in lines) == ["0/3", "1/3", "2/3"], lines
    assert all(line.startswith("--tool memcheck --error-exitcode 1 ") for line in lines), lines
    logs = (out / "logs.txt").read_text()
    assert all(f"[{i}] ran " in logs for i in range(3)), logs[-2000:]
    assert (summary.split()[1] == "rc=0") == (failing_shard is None), summary
