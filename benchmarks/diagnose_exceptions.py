"""Does a C++ error raised inside transformer_fast._C reach Python as a RuntimeError?

On the first GPU run (H200, 2026-11-26) three tests that pass bad arguments to the CUDA ops
(add_layer_norm, attention, masked_softmax) killed their pytest worker with SIGSEGV instead of
raising: the TORCH_CHECK fired, and the process died while the error was being thrown.  This
script triggers the same argument check once on the CPU op and once on the CUDA op, each in a
child process, prints how each child ended, and for a child killed by a signal reruns it under
cuda-gdb (the lent machines have no gdb) for a native backtrace.  It also prints the compilers
the extension was built with, since a host compiler other than torch's is the first suspect.

    python benchmarks/diagnose_exceptions.py          # exit status 1 if any child crashed
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

# The first check of test_csrc_smoke.py::test_bad_arguments_name_the_argument: a residual of the
# wrong shape.  Prints RAISED when the RuntimeError names the argument.
SNIPPET = """
import torch, transformer_fast._C
x = torch.randn(4, 8, device={device!r})
try:
    torch.ops.transformer_fast_C.add_layer_norm_fwd(x, torch.randn(4, 9, device={device!r}), None, None,
                                                    1e-5, 0.0, None, False)
    print("NO ERROR")
except RuntimeError as e:
    print("RAISED", "residual" in str(e))
"""


def _run(cmd: list[str], timeout: float = 120) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired:
        return -999, "timed out"


def _build_facts() -> None:
    for var in ("CC", "CXX", "CUDAHOSTCXX"):
        print(f"{var}={os.environ.get(var, '')}")
    for cc in {os.environ.get("CXX", ""), "c++", "g++", "/usr/bin/g++", "/opt/gcc/bin/g++"} - {""}:
        path = shutil.which(cc)
        if path:
            rc, out = _run([path, "--version"], 30)
            print(f"{cc} -> {path}: {out.splitlines()[0] if out else rc}")
    import transformer_fast._C as ext

    so = ext.__file__
    rc, out = _run(["ldd", so], 30)
    print("\n".join(line for line in out.splitlines() if any(k in line for k in ("stdc++", "gcc_s", "gomp", "c10"))))
    rc, out = _run(["strings", "-a", so], 60)
    print("compilers in", os.path.basename(so), sorted({line for line in out.splitlines() if line.startswith("GCC:")}))
    import torch

    print("torch built with:", torch.__config__.show().splitlines()[1:4])


def main() -> int:
    _build_facts()
    import torch

    print("TORCH_* in the environment:", {k: v for k, v in os.environ.items() if k.startswith("TORCH_")})
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    crashed = False
    for device in devices:
        code = SNIPPET.format(device=device)
        rc, out = _run([sys.executable, "-c", code])
        print(f"--- {device}: exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}")
        if rc < 0 or rc == 139:
            crashed = True
            # Whether the C++ backtrace torch attaches to the error is involved: libtorch_python
            # symbolizes it for the Python message when TORCH_SHOW_CPP_STACKTRACES is set.
            for var, value in (("TORCH_SHOW_CPP_STACKTRACES", "0"), ("TORCH_SHOW_CPP_STACKTRACES", "1"),
                               ("TORCH_DISABLE_ADDR2LINE", "1")):
                env = dict(os.environ, **{var: value})
                p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
                last = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
                print(f"--- {device} with {var}={value}: exit {p.returncode}: {last[0]}")
            gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
            if gdb:
                limit = float(os.environ.get("DIAG_GDB_TIMEOUT", "300"))
                rc2, bt = _run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", code], limit)
                print("\n".join(bt.splitlines()[-60:]))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
