"""Builds transformer_fast and its extension transformer_fast._C.

The C++ CPU sources (csrc/*.cpp) are always compiled.  The CUDA sources (csrc/*.cu) are added
when torch is a CUDA build and a CUDA toolkit is found.

Environment switches:
  TRANSFORMER_FAST_CUDA=1     require the CUDA part (fail if it cannot be built)
  TRANSFORMER_FAST_CUDA=0     skip the CUDA part
  TRANSFORMER_FAST_NO_EXT=1   skip the extension entirely (pure-Python install)
  TORCH_CUDA_ARCH_LIST        GPU architectures (default "8.0;9.0a": A100 and H100/H200)
  MAX_JOBS                    parallel compile jobs (ninja)

Install against the torch already in the environment:
  pip install --no-build-isolation -e .
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def _find_cuda_home():
    """The toolkit root: the folder whose bin/ holds the real nvcc and include/ holds cuda.h.

    The nvcc first on PATH may be a wrapper script that execs the real one, so torch's guess
    from PATH can land one level too high; follow the wrapper and check for cuda.h.
    """
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        try:  # a shell wrapper: `exec /path/to/nvcc "$@"`
            with open(real, "r", errors="ignore") as f:
                head = f.read(4096)
            for token in head.replace('"', " ").split():
                if token.endswith("/nvcc") and os.path.isfile(token):
                    candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(token))))
        except OSError:
            pass
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True) + ["/usr/local/cuda"]
    for root in candidates:
        if os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
            os.path.join(root, "include", "cuda.h")
        ):
            return root
    return None


def _nvidia_wheel_includes():
    """cuBLAS & co. headers shipped in the nvidia-* wheels (not in the toolkit's include/)."""
    dirs = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cublas/include"):
            path = os.path.join(entry, sub)
            if os.path.isdir(path) and path not in dirs:
                dirs.append(path)
    return dirs


def _cublaslt_link_args(cuda_home):
    """Linker arguments for cuBLASLt (csrc/ffn_cuda.cu).  The library ships in the nvidia-*
    wheels (often only as libcublasLt.so.<major>, without the unversioned name -lcublasLt needs)
    or in the toolkit's lib64; an rpath to its folder lets _C load it without LD_LIBRARY_PATH
    (torch usually has it loaded already)."""
    dirs = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/cublas/lib"):
            dirs.append(os.path.join(entry, sub))
    dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
    for d in dirs:
        if os.path.isfile(os.path.join(d, "libcublasLt.so")):
            return [f"-L{d}", "-lcublasLt", f"-Wl,-rpath,{d}"]
        versioned = sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")))
        if versioned:
            name = os.path.basename(min(versioned, key=len))  # libcublasLt.so.13, not .so.13.x.y
            return [f"-L{d}", f"-l:{name}", f"-Wl,-rpath,{d}"]
    raise RuntimeError("cuBLASLt (libcublasLt.so) not found in the nvidia wheels or the CUDA toolkit")


# An explicit -lstdc++, before the compiler driver's own: a driver that links libstdc++
# statically (-static-libstdc++, as the g++ wrapper in one GPU image did) then finds every symbol
# already resolved by libstdc++.so.6, the copy torch itself uses.  With a static copy inside _C,
# the first TORCH_CHECK message that formatted a shape crashed (SIGSEGV in std::ostream code
# mixing the two copies' locale data) instead of raising.  tests/test_csrc_smoke.py checks that
# _C carries no copy.
SHARED_LIBSTDCXX = ["-lstdc++"]

# A libstdc++ function that a static copy would define in the linked library.
_LIBSTDCXX_PROBE_SYMBOL = "_ZNSo9_M_insertIlEERSoT_"  # std::ostream::_M_insert<long>
_LIBSTDCXX_PROBE_SOURCE = """#include <sstream>
#include <string>
std::string tf_probe(long v) { std::ostringstream s; s << v; return s.str(); }
"""


def _links_a_static_libstdcxx(linker):
    """Whether the link command `linker` (a list, with its -shared) puts a copy of libstdc++ into
    a shared library even when given -lstdc++; None when that cannot be checked here."""
    import subprocess
    import tempfile

    nm = shutil.which("nm")
    if nm is None or not linker or shutil.which(linker[0]) is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_LIBSTDCXX_PROBE_SOURCE)
        try:
            subprocess.run([*linker, "-fPIC", src, "-o", lib, *SHARED_LIBSTDCXX], check=True,
                           capture_output=True, timeout=120)
            out = subprocess.run([nm, "--defined-only", lib], check=True, capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return _LIBSTDCXX_PROBE_SYMBOL in out


def _shared_libstdcxx_driver(linker):
    """The C++ driver to link with: `linker`'s own, or another (g++ / c++ on PATH) where that one
    links libstdc++ statically whatever it is told (the second GPU image's /opt/gcc g++ does, and
    its _C crashed on the first TORCH_CHECK message that formatted a number)."""
    if not _links_a_static_libstdcxx(linker):
        return linker[0]
    own = os.path.realpath(shutil.which(linker[0]))
    for name in ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++"):
        found = shutil.which(name)
        if found is None or os.path.realpath(found) == own:
            continue
        if _links_a_static_libstdcxx([found, *linker[1:]]) is False:
            print(f"transformer_fast: {linker[0]} links a static copy of libstdc++ into shared "
                  f"libraries; linking _C with {found} instead")
            return found
    print(f"transformer_fast: WARNING: {linker[0]} links a static copy of libstdc++ into shared "
          "libraries and no other C++ driver was found; _C may crash on C++ errors")
    return linker[0]


def _build_ext_class(cpp_extension):
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        def build_extensions(self):
            # distutils links C++ with linker_so (or linker_so_cxx) whose driver is replaced by
            # compiler_cxx's: probe that command, and swap the driver in all three if needed.
            cc = self.compiler
            linker = list(getattr(cc, "linker_so_cxx", None) or cc.linker_so)
            if getattr(cc, "compiler_cxx", None):
                linker[0] = cc.compiler_cxx[0]
            driver = _shared_libstdcxx_driver(linker)
            if driver != linker[0]:
                for attr in ("compiler_cxx", "linker_so", "linker_so_cxx"):
                    cmd = getattr(cc, attr, None)
                    if isinstance(cmd, list) and cmd:
                        setattr(cc, attr, [driver, *cmd[1:]])
            super().build_extensions()

    return BuildExt


# The oldest torch the package runs on.  The test suite has run on torch 2.11-2.14 and Triton
# 3.6-3.8 (the README's "Supported:" paragraph); `python -m transformer_fast info` notes others.
TORCH_MIN = (2, 11)


def _minor(version):
    """(major, minor) of a version string such as '2.14.1+cu130'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _extensions():
    """(ext_modules, cmdclass, the torch requirement of what is built)."""
    if _env_flag("TRANSFORMER_FAST_NO_EXT"):
        return [], {}, "torch>={}.{}".format(*TORCH_MIN)
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        # pip's default build isolation runs this file in a fresh environment without the
        # user's torch; adding torch to the build requirements would compile against whichever
        # torch pip picks there, not the one _C is later loaded into.
        raise RuntimeError(
            "transformer_fast: building the extension transformer_fast._C needs torch installed "
            "in the environment that runs the build (it is compiled against that torch). Install "
            "torch first, then `pip install --no-build-isolation .` (pip's build isolation hides "
            "the installed torch), or set TRANSFORMER_FAST_NO_EXT=1 for a pure-Python install "
            f"(reference and torch backends only). Import error: {exc}"
        ) from exc

    built_against = _minor(torch.__version__)
    if built_against < TORCH_MIN:
        raise RuntimeError("transformer_fast needs torch >= {}.{}; this environment has torch {}"
                           .format(*TORCH_MIN, torch.__version__))
    # _C is compiled against this torch: the install must keep it.  A range here would let pip
    # swap the user's torch for one inside the range after building against the installed one
    # (torch 2.15 installed and "<2.15" required: pip built _C for 2.15, then put 2.14 in).
    torch_requirement = "torch=={}.{}.*".format(*built_against)

    want_cuda = _env_flag("TRANSFORMER_FAST_CUDA")
    # TRANSFORMER_FAST_SANITIZE=1: the C++ CPU kernels under AddressSanitizer + UBSan, for
    # scripts/sanitize_cpu.sh (a CPU-only build; python must preload libasan / libubsan).
    sanitize = bool(_env_flag("TRANSFORMER_FAST_SANITIZE"))
    if sanitize and want_cuda:
        raise RuntimeError("TRANSFORMER_FAST_SANITIZE builds the CPU kernels only: "
                           "TRANSFORMER_FAST_CUDA must be unset or 0")
    if sanitize:
        want_cuda = False
    cuda_home = _find_cuda_home() if want_cuda is not False else None
    use_cuda = bool(torch.version.cuda) and cuda_home is not None and want_cuda is not False
    if want_cuda and not use_cuda:
        raise RuntimeError(
            "TRANSFORMER_FAST_CUDA=1 but the CUDA part cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA toolkit={cuda_home!r}"
        )

    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    # -ffp-contract=off: GCC's default (fast) fuses a * b + c into an FMA wherever it likes, so
    # one expression written twice can round differently (add_layer_norm's backward recomputes
    # dy * w in two passes; fused in one and not the other, a width-1 row's gradient came out
    # 3e-5 instead of 0).  The kernels ask for FMAs explicitly (at::vec::fmadd) where they want them.
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off"]
    link_flags = ["-fopenmp"]
    if sanitize:
        cxx_flags = ["-O1", "-g", *cxx_flags[1:], "-fsanitize=address,undefined",
                     "-fno-omit-frame-pointer"]
        link_flags.append("-fsanitize=address,undefined")
    include_dirs = [os.path.join(ROOT, "csrc")]
    define_macros = []

    if use_cuda:
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home  # torch caches its own guess at import time
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        nvcc_flags = [
            "-O3",
            "-std=c++20",
            "--expt-relaxed-constexpr",
            "-lineinfo",
        ]
        ext = cpp_extension.CUDAExtension(
            "transformer_fast._C",
            cpp_sources + cu_sources,
            include_dirs=include_dirs + _nvidia_wheel_includes(),
            define_macros=define_macros + [("TF_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=["-fopenmp"] + SHARED_LIBSTDCXX + _cublaslt_link_args(cuda_home),
        )
    else:
        ext = cpp_extension.CppExtension(
            "transformer_fast._C",
            cpp_sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags + SHARED_LIBSTDCXX,
        )
    print(f"transformer_fast: building _C with CUDA={'yes (' + cuda_home + ')' if use_cuda else 'no'}")
    cmdclass = {"build_ext": _build_ext_class(cpp_extension)}
    return [ext], cmdclass, torch_requirement


ext_modules, cmdclass, torch_requirement = _extensions()

setup(
    name="transformer_fast",
    version="0.1.0",
    description="Fused Triton/CUDA/C++ kernels and drop-in torch.nn Transformer modules",
    python_requires=">=3.11",  # tested on 3.11 / 3.12; `info` notes others
    packages=find_packages(include=["transformer_fast", "transformer_fast.*"])
    + ["transformer_fast.kernels"],
    package_dir={"transformer_fast.kernels": "kernels"},
    install_requires=[torch_requirement, "numpy"],
    extras_require={"triton": ["triton>=3.6"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
