"""``python -m benchmarks`` end to end at minimal shapes (the hidden --smoke size).

One subprocess runs every op (imports dominate a run, so one run keeps this file near its
budget) into a temporary folder named by the OUT environment variable, as gpu_suite.sh does;
the tests then check results.json against DESIGN section 8's schema, that every provider's
max_err is within the float64 oracle's reach, and the markdown and plots.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_fast import reference

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import common, models, ops  # noqa: E402

ALL_OPS = ops.OPS + models.MODEL_OPS
# Loose bounds on max |error| vs float64 at the smoke shapes (fp32): the oracle's own bound is
# 2 * max|ref_fp32 - ref64| + 1e-6, a few 1e-6 at these sizes; an order of magnitude of slack
# keeps the test about "the benchmark measured the right thing", not about one kernel's ulps.
MAX_ERR = {op: 1e-4 for op in ops.OPS}
MAX_ERR.update(encoder_layer=1e-4, decoder_layer=1e-4)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(ROOT))
    env.pop("TRANSFORMER_FAST_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--op", "all", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    return proc, out


def _results(run):
    proc, out = run
    path = out / "results.json"
    assert path.exists(), f"no results.json (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(path.read_text())


def test_exits_and_writes_few_files(run):
    proc, out = run
    data = _results(run)
    failed = [r for r in data["rows"] if str(r["shape"].get("note", "")).startswith("failed")]
    # Rows of our own modules may fail while those modules are being written; they must say so
    # (and then the exit status is 1).  Every op row and every baseline row must run.
    assert all(r["provider"].startswith("ours:") for r in failed), failed
    assert proc.returncode == (1 if failed else 0), proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert {"results.json", "results.md", "ops.png", "end_to_end.png"} <= set(files)
    assert len(files) <= 8, files
    assert sum(p.stat().st_size for p in out.iterdir()) < 4e6


def test_meta_schema(run):
    meta = _results(run)["meta"]
    assert tuple(meta) == common.META_KEYS
    assert set(meta["peaks"]) == {"copy_gbps", "matmul_tflops"}
    assert meta["peaks"]["copy_gbps"] > 0 and meta["peaks"]["matmul_tflops"] > 0
    assert meta["torch"] == torch.__version__
    assert meta["device"] and meta["date"] and meta["commit"]


@pytest.mark.parametrize("op", ALL_OPS)
def test_rows_of_each_op(run, op):
    rows = [r for r in _results(run)["rows"] if r["op"] == op]
    assert rows, f"no rows for {op}"
    for r in rows:
        assert tuple(r) == common.ROW_KEYS
        assert r["dtype"] == "float32"
    measured = [r for r in rows if r["median_ms"] is not None]
    providers = {r["provider"] for r in measured}
    if op == "ffn_gemm":  # one GEMM per row: cuBLAS / MKL (torch) against the backends' own
        assert {"torch", "cpu"} <= providers and "reference" not in providers
        assert {r["shape"]["gemm"] for r in measured} == {g[0] for g in ops._ffn_gemms(1, 1, 1)}
        assert {r["shape"]["pass"] for r in measured} == {"fwd"}
    elif op in ops.OPS:
        assert {"reference", "torch"} <= providers
        assert "triton" not in providers  # the interpreter is not a benchmark
        masks = {r["mask"] for r in measured}
        if op in ("scaled_dot_product_attention", "masked_softmax"):
            assert masks == set(ops.ATTENTION_MASKS)
        passes = {r["shape"]["pass"] for r in measured}
        assert passes == ({"fwd"} if op == "attention_with_kv_cache" else {"fwd", "fwd+bwd"})
    else:
        assert {"reference", "torch.nn"} <= providers
        for r in measured:
            assert r["shape"]["tokens_per_s"] > 0
        skipped = {r["provider"]: r["shape"].get("note", "") for r in rows if r["median_ms"] is None}
        assert "not run in the smoke test" in skipped["torch.nn+compile"]
    for r in measured:
        assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["peak_mem_mb"] is None or r["peak_mem_mb"] >= 0
        if r["provider"] in ("reference",):
            assert r["speedup_vs_reference"] == 1.0
        if r["provider"] in ("torch", "torch.nn"):
            assert r["speedup_vs_torch"] == 1.0
        if op in ops.OPS:
            metric = r["tflops"] if r["tflops"] is not None else r["gbps"]
            assert metric is not None and metric > 0
            assert r["pct_peak"] is not None and r["pct_peak"] > 0
    checked = [r for r in measured if r["max_err"] is not None]
    if op in MAX_ERR:
        assert checked, f"{op}: no max_err"
    for r in checked:
        assert isinstance(r["max_err"], float) and math.isfinite(r["max_err"]), r
        assert r["max_err"] <= MAX_ERR.get(op, 1e-4), r


def test_speedups_are_ratios_of_medians(run):
    rows = _results(run)["rows"]
    by_group = {}
    for r in rows:
        if r["median_ms"] is not None:
            by_group.setdefault(common.row_group(r), {})[r["provider"]] = r["median_ms"]
    for r in rows:
        if r["speedup_vs_reference"] is not None:
            ref = by_group[common.row_group(r)]["reference"]
            assert r["speedup_vs_reference"] == pytest.approx(ref / r["median_ms"], rel=1e-3)


def test_markdown_lists_skipped_providers(run):
    _, out = run
    text = (out / "results.md").read_text()
    for op in ALL_OPS:
        assert f"## {op}" in text
    assert "## Providers not run" in text
    assert "not a benchmark" in text  # triton on a CPU, and why


def test_flops_formula():
    """TFLOP/s of an attention row is 4*B*H*L*L*D (halved causal, x2.5 fwd+bwd) over the median."""
    device = torch.device("cpu")
    for case in ops.cases("scaled_dot_product_attention", device, [torch.float32], "smoke"):
        s = case.shape
        dense = 4 * s["B"] * s["H"] * s["L"] ** 2 * s["D"]
        expected = dense * (0.5 if case.mask in ("causal", "bool") else 1) * (2.5 if case.backward else 1)
        assert case.flops == expected
    row = common.make_row("x", "torch", torch.float32, "none", {}, (2.0, 1.0, 3.0), flops=4e9,
                          peaks={"matmul_tflops": 4.0, "copy_gbps": 1.0})
    assert row["tflops"] == pytest.approx(2.0) and row["pct_peak"] == pytest.approx(50.0)  # 4 GFLOP in 2 ms


def test_op_names_match():
    from benchmarks import __main__ as cli

    assert cli.ALL_OPS == ALL_OPS
    assert cli.MODEL_OPS == models.MODEL_OPS
    assert cli.PROVIDERS == ops.PROVIDERS


@pytest.mark.parametrize("argv, message", [
    (["--op", "nope"], "invalid choice"),
    (["--providers", "torch,tritonn"], "unknown tritonn"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--op", "add_layer_norm", "--providers", "ours:cpu"], "ours:cpu name end-to-end providers"),
])
def test_bad_arguments(argv, message):
    """Argument errors answer at once (before torch is imported), naming the argument."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_quick_sweep_of_the_cheap_ops(tmp_path):
    """The --quick shapes (not the smoke ones) through the same checks, for the bandwidth and
    GEMM ops (minutes on a busy CPU: behind -m slow)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--op", "add_layer_norm", "feed_forward", "--quick",
         "--output", str(tmp_path), "--no-plots"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"add_layer_norm", "feed_forward"}
    assert any(r["provider"] == "torch.compile" for r in rows)  # issue 6's peer, target rows
    for r in rows:
        assert tuple(r) == common.ROW_KEYS
        assert r["median_ms"] > 0, r
        if r["shape"].get("p", 0.0) > 0.0:  # dropout rows: each provider has its own mask
            assert r["max_err"] is None and "own mask" in r["shape"]["note"], r
        else:
            assert r["max_err"] is not None and r["max_err"] < 1e-3, r


def test_non_finite_error_is_null_with_a_note():
    row = common.make_row("x", "torch", torch.float32, "none", {"pass": "fwd"}, (1.0, 1.0, 1.0),
                          error=float("nan"))
    assert row["max_err"] is None and "not finite" in row["shape"]["note"]
    json.dumps(row, allow_nan=False)


@pytest.mark.parametrize("op", ["scaled_dot_product_attention", "masked_softmax"])
def test_chunked_float64_reference_matches_the_whole(op, monkeypatch, request):
    """The row-chunked float64 truth (used where an L x L float64 matrix would not fit) equals
    the reference run on the whole input, outputs and gradients, for every mask kind."""
    device = torch.device("cpu")
    monkeypatch.setattr(ops, "_chunk_rows", lambda rows, per_row, dev: 5)  # 16 rows -> 4 chunks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a shared CPU
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    for case in ops.cases(op, device, [torch.float32], "smoke"):
        if not case.backward or case.shape.get("p", 0.0) > 0.0:  # dropout rows: no float64 truth
            continue
        g = ops.Draw(7, device)
        inputs = case.make(g)
        upstream = torch.randn(case.call(inputs, "torch").shape, generator=g.cpu, dtype=torch.float64)
        chunked_outs, chunked_grads = case.ref64(inputs, upstream)
        if op == "masked_softmax":  # the case's call scales the scores; ref64 does too
            scores = inputs["scores"].detach().double().requires_grad_(True)
            out = reference.masked_softmax(scores, inputs.get("mask"), 0.125, case.mask == "causal")
            whole = [out] + list(torch.autograd.grad(out, scores, upstream))
        else:
            whole_outs, whole_grads = ops._default_ref64(case, inputs, upstream)
            whole = whole_outs + whole_grads
        assert len(whole) == len(chunked_outs + chunked_grads)
        for a, b in zip(chunked_outs + chunked_grads, whole):
            torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)


def test_cpu_peak_memory_sees_a_temporary():
    """A call that holds a 64 MB temporary (and returns a small result) peaks at >= 64 MB, also
    after the allocator has recycled such blocks (as it has after timing runs)."""
    def fn():
        tmp = torch.ones(16 << 20)  # 64 MB of fp32, touched
        return tmp[:10].clone()

    for _ in range(3):
        fn()
    peak = common.peak_memory_mb(fn, torch.device("cpu"))
    if peak is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert 60 <= peak < 200, peak


def test_warm_case_calls_the_compiling_providers_forward_and_backward(monkeypatch):
    """--compile-jobs runs ops.warm_case per case in spawned processes (on CUDA by default).
    The compiling providers (triton, torch.compile) do not run on a CPU here, so "torch" stands
    in for them: it must be called once with its backward."""
    calls = []
    real = ops._call
    monkeypatch.setattr(ops, "_call", lambda case, inputs, provider: calls.append(provider) or real(case, inputs, provider))
    monkeypatch.setattr(ops, "COMPILING_PROVIDERS", ("torch",))
    cases = ops.cases("scaled_dot_product_attention", torch.device("cpu"), [torch.float32], "smoke")
    index = next(i for i, c in enumerate(cases) if c.backward)
    line = ops.warm_case("scaled_dot_product_attention", "smoke", "float32", index, ("reference", "torch"), "cpu")
    assert calls == ["torch"] and line.endswith(": torch") and "fwd+bwd" in line


def exit_on_task_1(i):
    if i == 1:
        os._exit(3)
    return f"task {i}"


def test_warm_in_processes_logs_and_survives_a_dead_process(capsys):
    common.warm_in_processes(exit_on_task_1, [(0,), (1,), (2,)], 2)
    err = capsys.readouterr().err
    assert "a process died" in err


def test_tuned_configs_are_recorded_apart_from_the_shape():
    """Triton rows on a GPU carry the configs the autotuner ran (shape["tuned"]): shown in the
    note column, kept out of the shape text and of the speedup grouping."""
    import types

    import triton

    cfg = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
    tuners = {"attention.fwd": types.SimpleNamespace(best_config=cfg),
              "attention.dq": types.SimpleNamespace(best_config=None)}
    assert common.tuned_configs(tuners) == "attention.fwd 128x64 w8 s3"
    shape = {"pass": "fwd", "B": 1, "tuned": "attention.fwd 128x64 w8 s3"}
    assert "tuned" not in common._shape_text(shape)
    a = {"op": "x", "dtype": "bf16", "mask": "none", "shape": shape}
    b = {"op": "x", "dtype": "bf16", "mask": "none", "shape": {"pass": "fwd", "B": 1}}
    assert common.row_group(a) == common.row_group(b)


def test_profile_ops_reports_host_and_device_time(capsys):
    """benchmarks/profile_ops.py (gpu_suite's `profile` step): for each case and provider a line
    with wall and host time per call (and the kernels' device time on a GPU), then the largest
    host ops; a provider that cannot run says why."""
    from benchmarks import profile_ops

    assert profile_ops.main(["--smoke", "--iters", "2", "--op", "feed_forward", "--max-cases", "2",
                             "--providers", "torch,cpu,cuda", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "wall" in ln and "ms/call" in ln]
    assert len(lines) == 4, out  # 2 cases x (torch, cpu)
    for ln in lines:
        wall = float(ln.split("wall")[1].split()[0])
        host = float(ln.split("host")[1].split()[0])
        assert wall > 0 and host > 0
    assert "cuda           skipped: the cuda backend runs on CUDA tensors" in out
    assert any(ln.strip().startswith("host") for ln in out.splitlines())


def test_profile_ops_names_the_python_functions(capsys):
    """--python-top N: the N Python functions with the most own time per call (cProfile), our
    own dispatch among them at these tiny shapes."""
    from benchmarks import profile_ops

    assert profile_ops.main(["--smoke", "--iters", "3", "--op", "feed_forward", "--max-cases", "1",
                             "--providers", "cpu", "--device", "cpu", "--python-top", "40"]) == 0
    py = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("python ")]
    assert 0 < len(py) <= 40
    assert all(float(words[1]) >= 0 and words[2] == "ms" for words in py)
    assert any("feed_forward" in ln[-1] for ln in py), py


def test_profile_model_profiles_the_benchmarks_training_step(capsys):
    """benchmarks/profile_model.py (gpu_suite's `profile_model` step): the benchmark's own
    training step for each provider, a wall / host line and the host ops; an unknown backend is
    skipped with its reason."""
    from benchmarks import profile_model

    assert profile_model.main(["--smoke", "--iters", "2", "--device", "cpu",
                               "--providers", "torch.nn,ours:auto,ours:triton"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if "wall" in ln and "ms/step" in ln}
    assert set(lines) == {"torch.nn", "ours:auto"}, out
    for ln in lines.values():
        assert float(ln.split("wall")[1].split()[0]) > 0 and float(ln.split("host")[1].split()[0]) > 0
    assert any(ln.split()[:2] == ["ours:triton", "skipped:"] and "interpreter" in ln for ln in out.splitlines()), out
    assert any(ln.strip().startswith("host") for ln in out.splitlines())
    # models.py's named ranges: forward, backward and optimizer, for each provider
    phases = [ln.split()[-1] for ln in out.splitlines() if ln.strip().startswith("phase")]
    assert phases == ["train_step.forward", "train_step.backward", "train_step.optimizer"] * 2, out


def test_profile_model_interval_arithmetic():
    """The device's busy time is the union of the kernels' intervals; the idle gaps name the
    kernel that ended before each (overlapping kernels: no gap between them)."""
    from benchmarks.profile_model import busy_union_ms, idle_gaps, kind

    spans = [(0, 1000), (500, 1500), (3000, 3500), (4000, 6000), (4100, 4200)]  # us
    assert busy_union_ms(spans) == pytest.approx(1.5 + 0.5 + 2.0)
    assert idle_gaps(spans) == [(pytest.approx(1.5), 1), (pytest.approx(0.5), 2)]
    assert busy_union_ms([]) == 0.0 and idle_gaps([]) == []
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kind("_attention_fwd_kernel") == "attention"
    assert kind("multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"


def test_sass_loop_mix_reads_the_main_loop():
    """benchmarks/sass_loop_mix.py: the widest backward branch is the loop; its opcodes (predicate
    guards skipped) and the instructions between its barriers / wgmma waits are counted."""
    from benchmarks.sass_loop_mix import report

    listing = "\n".join([
        "\t\tFunction : _Z6kernelv",
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;",
        "        /*0030*/                   FMUL R2, R2, R3 ;",
        "        /*0040*/              @!P0 FADD R2, R2, R3 ;",
        "        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0060*/                   FMUL R4, R2, R3 ;",
        "        /*0070*/               @P1 BRA 0x10 ;",
        "        /*0080*/                   EXIT ;",
        "\t\tFunction : _Z5otherv",
        "        /*0000*/                   EXIT ;",
    ])
    text = report(listing, "kernel")
    assert "loop 0x10-0x70: 7 instructions" in text
    assert "FMUL:2" in text and "FADD:1" in text and "BRA:1" in text and "MOV" not in text
    lines = text.splitlines()
    assert lines[-4].strip().startswith("0 instr, then BAR.SYNC")
    assert lines[-3].strip().startswith("1 instr, then HGMMA")
    assert lines[-2].strip().startswith("3 instr, then WARPGROUP.DEPBAR")
    assert lines[-1].strip() == "3 instr to the loop's end"
    assert report(listing, "other") == "_Z5otherv: no loop"


def test_model_rows_reach_the_caller_as_measured():
    """Each end-to-end row is handed to on_row when it is made (the CLI writes its results files
    then), so a run killed at its time limit keeps the rows measured so far."""
    seen = []
    peaks = {"copy_gbps": 1.0, "matmul_tflops": 1.0}
    rows = models.run("greedy_decode", torch.device("cpu"), torch.float32, "smoke", peaks,
                      lambda *a: None, ["torch.nn", "ours:torch"], on_row=lambda r: seen.append(r["provider"]))
    assert seen and seen == [r["provider"] for r in rows]
    assert {"torch.nn", "ours:torch"} <= set(seen)


@pytest.mark.skipif(torch.version.cuda is None or not any(
    os.path.isfile(os.path.join(d, "nvcc")) for d in os.environ.get("PATH", "").split(os.pathsep)),
    reason="needs nvcc and a CUDA build of torch")
def test_wgmma_kernels_compile_without_spills(tmp_path):
    """benchmarks/ptxas_wgmma.sh compiles the dense wgmma attention kernels for sm_90a; none of
    the default ones spills (a spill in their main loops costs local-memory traffic per tile:
    the run-to-run check of a kernel change that only a GPU could time).  The opt-in dK / dV
    with dQ by atomics (TRANSFORMER_FAST_CUDA_ATOMIC_DQ=1, not yet run on a GPU) at 255
    registers may spill up to 8 bytes (a local load or two per tile; benchmarks/NOTES.md)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "benchmarks" / "ptxas_wgmma.sh"), str(tmp_path / "wg")],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if "_wgmma_dense_kernel" in ln]
    # {fwd x kpm or not, dkdv, dq} x D {64, 128} x causal or not, and dkdv with dQ at D 128
    assert len(rows) == 18, proc.stdout
    for row in rows:
        at = row.index("registers,")
        registers, spilled = int(row[at - 1]), int(row[at + 1])
        assert 0 < registers <= 255 and spilled <= (8 if "dq=1" in row else 0), row


def test_graph_rows_can_be_named_alone():
    """`--providers ours:triton+cuda_graph` asks for the CUDA-graph decoding rows without the
    eager ones (a GPU run's minutes go to the rows that matter)."""
    from benchmarks import __main__ as cli

    args = cli.parse_args(["--providers", "torch.nn,ours:triton+cuda_graph"])
    runner = models.Runner(torch.device("cpu"), torch.float32, "smoke", {}, set(),
                           providers=args.providers.split(","))
    assert runner.wanted("ours:triton+cuda_graph") and runner.wanted("torch.nn")
    assert not runner.wanted("ours:triton") and not runner.wanted("ours:torch+cuda_graph")
    assert not runner.wanted("torch.nn+compile")


def test_ops_run_in_the_order_given(tmp_path):
    """--op's order is the order of the run (a time-limited GPU run names what matters most
    first): an end-to-end op named first comes before an op's cases."""
    from benchmarks import __main__ as cli

    assert cli.main(["--smoke", "--op", "greedy_decode", "add_layer_norm", "--providers", "torch,ours:auto",
                     "--device", "cpu", "--no-plots", "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    ops_in_order = list(dict.fromkeys(r["op"] for r in rows))
    assert ops_in_order == ["greedy_decode", "add_layer_norm"], ops_in_order
    # ours:auto, what a user gets without choosing a backend, is an end-to-end row of its own
    auto = [r for r in rows if r["provider"] == "ours:auto"]
    assert auto and all(r["median_ms"] for r in auto), auto


def test_match_keeps_the_cases_named(tmp_path):
    """--match TEXT...: per-op cases whose 'op shape mask pass' contains any TEXT (a
    time-limited GPU run measures its longest shapes first); other ops' cases drop out."""
    from benchmarks import __main__ as cli

    assert cli.main(["--smoke", "--op", "add_layer_norm", "scaled_dot_product_attention", "--providers", "torch",
                     "--match", "causal fwd+bwd", "key_padding fwd", "--device", "cpu", "--no-plots",
                     "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    seen = {(r["op"], r["mask"], r["shape"]["pass"]) for r in rows}
    assert seen == {("scaled_dot_product_attention", "causal", "fwd+bwd"),
                    ("scaled_dot_product_attention", "key_padding", "fwd"),
                    ("scaled_dot_product_attention", "key_padding", "fwd+bwd")}, seen


def test_match_of_nothing_fails_and_the_command_line_is_recorded_quoted(tmp_path):
    """A --match that keeps no case exits 2 (as `verify` with nothing to verify), not 0 with an
    empty table; results.md records the command line shell-quoted, so that it can be pasted
    back (a --match of 'causal fwd+bwd' is one argument)."""
    from benchmarks import __main__ as cli

    common = ["--smoke", "--op", "add_layer_norm", "--providers", "torch", "--device", "cpu", "--no-plots"]
    assert cli.main([*common, "--match", "zzz", "--output", str(tmp_path / "none")]) == 2
    assert cli.main([*common, "--match", "N=32 none fwd+bwd", "--output", str(tmp_path / "some")]) == 0
    assert "--match 'N=32 none fwd+bwd'" in (tmp_path / "some" / "results.md").read_text()
    with pytest.raises(SystemExit) as refused:
        cli.main([*common, "--compile-jobs", "-3"])
    assert refused.value.code == 2


def test_swap_rows_time_torch_models_with_our_layers(tmp_path, monkeypatch):
    """ours:auto+swap: torch.nn's own model after transformer_fast.swap() (the drop-in use),
    timed in the training step and inference beside torch.nn."""
    import transformer_fast
    from benchmarks import __main__ as cli

    swapped = []
    real_swap = transformer_fast.swap
    monkeypatch.setattr(transformer_fast, "swap", lambda m: swapped.append(real_swap(m)) or swapped[-1])
    assert cli.main(["--smoke", "--op", "train_step", "inference", "--providers", "torch.nn,ours:auto+swap",
                     "--device", "cpu", "--no-plots", "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    timed = {(r["op"], r["provider"]) for r in rows if r["median_ms"]}
    assert timed == {(op, p) for op in ("train_step", "inference") for p in ("torch.nn", "ours:auto+swap")}, rows
    assert len(swapped) == 2 and all(report.swapped for report in swapped), swapped


def test_quick_gpu_timing_of_slow_calls_makes_four_calls(monkeypatch):
    """--quick on a GPU: a call of 100 ms or more (whole-model decoding) runs a warm-up and
    three timed calls (do_bench would add 5 estimating calls and a warm-up: 11 in all)."""
    import time

    from benchmarks import common

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.11)

    median, low, high, timer = common.time_gpu(fn, quick=True)
    assert len(calls) == 4 and timer == "wall clock, 3 calls"
    assert 100 <= low <= median <= high < 1000


def test_train_step_memory_reports_each_model(capsys):
    from benchmarks import train_step_memory

    peaks = train_step_memory.main(["--tiny", "--batch", "2", "--dtype", "float32"])
    assert set(peaks) == {"torch.nn", "ours:cpu+logits", "ours:cpu"}
    assert all(v > 0 for v in peaks.values())
    out = capsys.readouterr().out
    assert "ratios to torch.nn" in out and "ours:cpu+logits" in out


def test_plot_results_draws_a_committed_runs_plots(run, tmp_path):
    """benchmarks/plot_results.py draws ops.png / end_to_end.png from a folder's results*.json
    (the GPU calls skip plots): rows of two calls' files together."""
    import shutil

    from benchmarks import plot_results

    data = _results(run)
    folder = tmp_path / "run"
    folder.mkdir()
    per_op = [r for r in data["rows"] if r["op"] in ops.OPS]
    end_to_end = [r for r in data["rows"] if r["op"] not in ops.OPS]
    (folder / "results.json").write_text(json.dumps(dict(data, rows=per_op)))
    (folder / "results_call2.json").write_text(json.dumps(dict(data, rows=end_to_end)))
    written = plot_results.plot_folder(folder)
    assert sorted(p.name for p in written) == ["end_to_end.png", "ops.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert plot_results.main([str(tmp_path / "missing")]) == 2
    shutil.rmtree(folder)


def test_ffn_rows_say_which_triton_gemm_ran(monkeypatch):
    """Under "auto" a TMA failure falls back to the pointer kernel for the process with a warning
    only: a GPU row of the FFN ops names the kernel it timed (and the failure), so that the
    pointer kernel's speed never passes for the TMA kernel's."""
    import types

    from benchmarks import ops
    from transformer_fast.kernels import ffn as triton_ffn

    case = types.SimpleNamespace(op="ffn_gemm")
    cuda = types.SimpleNamespace(type="cuda")
    launch = (8, 8, 8, triton_ffn.EPI_FWD, 0, False, torch.bfloat16, False, "tma", None)
    monkeypatch.setattr(triton_ffn, "_RECENT_LAUNCHES", [launch])
    monkeypatch.setattr(triton_ffn, "_TMA_FAILED", [])
    assert ops._gemm_kernel_note(case, "triton", cuda) == "gemm: tma"
    monkeypatch.setattr(triton_ffn, "_RECENT_LAUNCHES", [launch[:8] + ("pointer", None)])
    monkeypatch.setattr(triton_ffn, "_TMA_FAILED", ["CompilationError: out of resources"])
    assert ops._gemm_kernel_note(case, "triton", cuda) == (
        "gemm: pointer (the TMA kernel failed: CompilationError: out of resources)")
    assert ops._gemm_kernel_note(case, "torch", cuda) is None
    assert ops._gemm_kernel_note(case, "triton", torch.device("cpu")) is None
    assert ops._gemm_kernel_note(types.SimpleNamespace(op="add_layer_norm"), "triton", cuda) is None


def test_triton_host_time_runs_the_compiled_launch_path_without_a_gpu():
    """benchmarks/triton_host_time.py: Triton's real launch path (kernels compiled for sm_90,
    the autotuner's key, our launchers and layers) against a stand-in driver, on this CPU: a
    line per case with its host time, its launch count and the part in JITFunction.run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "benchmarks/triton_host_time.py", "--case", "add_layer_norm", "feed_forward",
         "--calls", "2", "--rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        words = line.rsplit(None, 3)
        if len(words) == 4 and words[2].isdigit():
            rows[words[0]] = (float(words[1]), int(words[2]), float(words[3]))
    launches = {name: row[1] for name, row in rows.items()}
    assert launches == {"add_layer_norm": 1, "add_layer_norm fwd+bwd": 2, "feed_forward": 2,
                        "feed_forward fwd+bwd": 7}, proc.stdout
    assert all(us > 0 for us, _, _ in rows.values()), proc.stdout
