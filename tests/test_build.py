"""The extension: built and loaded, with the kernels the build promised."""
import os
import subprocess
import sys
from pathlib import Path

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


def _run_setup_without_torch(*, no_ext):
    """setup.py as pip's default build isolation runs it: in an environment without torch."""
    script = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; "
              "runpy.run_path('setup.py', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMER_FAST_NO_EXT"}
    if no_ext:
        env["TRANSFORMER_FAST_NO_EXT"] = "1"
    return subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=300)


def test_build_without_torch_says_how_to_install():
    """`pip install .` hides the installed torch from setup.py: a message saying what to do, not a
    bare "No module named 'torch'"."""
    proc = _run_setup_without_torch(no_ext=False)
    assert proc.returncode != 0
    assert "--no-build-isolation" in proc.stderr, proc.stderr[-2000:]
    assert "TRANSFORMER_FAST_NO_EXT=1" in proc.stderr


def test_pure_python_build_needs_no_torch():
    proc = _run_setup_without_torch(no_ext=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "transformer_fast"


def _package_tree(tmp_path):
    """A copy of what a source install reads (no build outputs)."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
    for name in ("transformer_fast", "kernels"):
        shutil.copytree(root / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    return root, src


def test_wheel_installs_transformer_fast_alone(tmp_path):
    """A non-editable install: kernels/ goes inside as transformer_fast.kernels, no other top-level
    name (the pure-Python wheel; the extension's build is what the rest of CI covers)."""
    import zipfile

    root, src = _package_tree(tmp_path)
    env = dict(os.environ, TRANSFORMER_FAST_NO_EXT="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("transformer_fast-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"transformer_fast"}, top
    expected = {p.relative_to(root).as_posix() for p in (root / "kernels").glob("*.py")}
    assert {"transformer_fast/" + n for n in expected} <= set(names)
    assert "transformer_fast/modules/transformer.py" in names
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [line for line in archive.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch>=2.11"], requires  # no cap that downgrades torch


def test_built_extension_requires_the_torch_it_was_built_against(tmp_path):
    """_C is compiled against the installed torch: the install keeps that torch's minor version
    (with a range, pip built _C for the user's torch 2.15 and then installed 2.14 over it)."""
    _, src = _package_tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMER_FAST_NO_EXT"}
    env["TRANSFORMER_FAST_CUDA"] = "0"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info"], cwd=src, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    requires = (src / "transformer_fast.egg-info" / "requires.txt").read_text().splitlines()
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert f"torch=={major}.{minor}.*" in requires, requires
