"""`python -m transformer_fast verify` machinery: every registered op's cases run and pass on
the backends available here (Triton through the interpreter without a GPU)."""
import pytest
import torch

from transformer_fast import verify

from conftest import require_backend


@pytest.mark.triton
@pytest.mark.parametrize("op", sorted(verify.CASES))
def test_verify_cases_pass_on_triton(op):
    device = require_backend("triton")
    if op == "add_layer_norm" and device == "cpu":
        pytest.skip("covered by tests/test_add_layer_norm.py (65536-wide rows are slow in the interpreter)")
    rows = verify.verify(device, ops=[op], dtypes=[torch.float32], backend_names=["triton"], log=lambda *a: None)
    assert rows and all(r.status == "PASS" for r in rows), [(r.status, r.detail) for r in rows]


def test_a_failure_is_reported_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(verify.functional, "masked_softmax", broken)
    rows = verify.verify("cpu", ops=["masked_softmax"], dtypes=[torch.float32], backend_names=["torch"],
                         log=lambda *a: None)
    assert rows[0].status == "FAIL" and "kernel exploded" in rows[0].detail


_MASKED_SOFTMAX = verify.functional.masked_softmax  # the op itself, whatever a test patches


def _masked_softmax_refusing(monkeypatch, refused_width, error):
    """verify's masked_softmax: cases with rows of ``refused_width`` raise "cannot run these
    inputs" (a backend refusing them); the others return the op's result plus ``error``."""
    from transformer_fast import backends

    def stand_in(scores, *args, **kwargs):
        if scores.shape[-1] == refused_width:
            raise backends.BackendError("masked_softmax: cannot run these inputs: stand-in")
        return _MASKED_SOFTMAX(scores, *args, **kwargs) + error

    monkeypatch.setattr(verify.functional, "masked_softmax", stand_in)
    (row,) = verify.verify("cpu", ops=["masked_softmax"], dtypes=[torch.float32], backend_names=["cpu"],
                           log=lambda *a: None)
    return row


def _cli_exit_code():
    from transformer_fast.__main__ import main

    return main(["verify", "--device", "cpu", "--op", "masked_softmax", "--backend", "cpu",
                 "--dtype", "float32"])


def test_a_failure_is_not_hidden_by_a_later_skip(monkeypatch):
    """A row whose first cases fail the oracle and whose last case is unsupported stays FAIL,
    and the command exits 1 (the skip used to overwrite the failure: SKIP, exit 0)."""
    row = _masked_softmax_refusing(monkeypatch, 1000, 1e-3)  # the last cases refused
    assert row.status == "FAIL" and "skipped: masked_softmax: cannot run" in row.detail, row
    assert _cli_exit_code() == 1


def test_an_unsupported_case_does_not_end_its_row(monkeypatch):
    """An early case a backend refuses is counted as skipped; the row's later cases still run,
    and their failure fails the run (the row used to stop at the skip: SKIP, exit 0)."""
    row = _masked_softmax_refusing(monkeypatch, 1, 1e-3)  # the first cases refused
    n_cases = len(list(verify.CASES["masked_softmax"]("cpu", torch.float32)))
    assert row.status == "FAIL" and row.cases > 0, row
    assert "4 cases skipped: masked_softmax: cannot run" in row.detail, row.detail
    assert row.cases == n_cases - 4
    assert _cli_exit_code() == 1

    row = _masked_softmax_refusing(monkeypatch, 1, 0.0)
    assert row.status == "PASS" and row.cases == n_cases - 4 and "4 cases skipped" in row.detail, row


def test_an_error_spanning_lines_keeps_the_table_rows(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("at 12:4:\n    acc += tl.dot(a, b)\n    ^\nincompatible | fp32 vs bf16")

    monkeypatch.setattr(verify.functional, "masked_softmax", broken)
    rows = verify.verify("cpu", ops=["masked_softmax"], dtypes=[torch.float32], backend_names=["torch"],
                         log=lambda *a: None)
    lines = verify.markdown_table(rows).splitlines()
    assert len(lines) == 3, lines
    assert all(line.replace("\\|", "").count("|") == 9 for line in lines), lines


def test_peer_rows_alone_are_a_verification(monkeypatch, capsys):
    """Rows of the peer (torch) outside the bound are informational: a run of them alone exits
    0 with its table, not 2 ("nothing was verified" is for a run where no case ran)."""
    from transformer_fast.__main__ import main

    original = verify.functional.masked_softmax
    monkeypatch.setattr(verify.functional, "masked_softmax",
                        lambda *args, **kwargs: original(*args, **kwargs) + 1e-3)
    assert main(["verify", "--device", "cpu", "--op", "masked_softmax", "--backend", "torch",
                 "--dtype", "float32"]) == 0
    assert "PEER-OUTSIDE" in capsys.readouterr().out


def test_parallel_rows_equal_serial_rows():
    """--jobs runs the cases in spawned processes; each case seeds its own draws, so the rows
    (errors included) are those of a serial run with the same seed."""
    kw = dict(ops=["masked_softmax", "add_layer_norm"], dtypes=[torch.float32, torch.bfloat16],
              backend_names=["torch", "cpu"], log=lambda *a: None, seed=int(torch.randint(0, 2**31, ())))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' share; torch's CPU reductions depend on the count
    try:
        serial = verify.verify("cpu", jobs=1, **kw)
        parallel = verify.verify("cpu", jobs=2, **kw)
    finally:
        torch.set_num_threads(threads)
    assert [r.status for r in serial].count("PASS") >= 2
    fields = lambda rows: [(r.op, r.backend, r.dtype, r.status, r.cases, r.ratio, r.worst, r.detail) for r in rows]
    assert fields(parallel) == fields(serial)


def crash_on_task_2(*task):
    """A stand-in for verify._run_case whose task 2 kills its process (as a segfault would)."""
    import os

    if task[0] == 2:
        os._exit(3)
    return ("ok", [task[0]]), 0.0


def test_a_process_that_dies_fails_its_case_only():
    done = {}
    verify._run_pool([(i,) for i in range(5)], 2, lambda t, outcome, s: done.update({t[0]: outcome}),
                     fn=crash_on_task_2)
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert done[2][0] == "fail" and "died" in done[2][1]
    assert all(done[i] == ("ok", [i]) for i in (0, 1, 3, 4))


def test_cli_jobs(capsys):
    from transformer_fast.__main__ import main

    assert main(["verify", "--device", "cpu", "--op", "masked_softmax", "--backend", "torch",
                 "--dtype", "float32", "--jobs", "2", "--seed", "7"]) == 0
    assert "| masked_softmax | torch | float32 | PASS | 9 |" in capsys.readouterr().out
