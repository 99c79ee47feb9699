#!/bin/bash
# Registers and spills of the sm_90a dense wgmma attention kernels (bf16, head dims 64 / 128,
# causal or not; the forward with and without a key_padding_mask; dK / dV at 128 with dQ by atomics too) in ~40 s without a GPU, instead of the 10-20 minutes of the whole
# csrc/attention_cuda.cu: compiles a unit made of that file's first part (everything up to the
# wgmma kernels' includes) and a table of the kernels' addresses, for sm_90a only, with the
# extension's nvcc flags (torch's COMMON_NVCC_FLAGS and setup.py's): the kernels' code is the
# extension's.  The SASS can then be read with benchmarks/sass_loop_mix.py.
#
#   bash benchmarks/ptxas_wgmma.sh [OUT_PREFIX]     # OUT_PREFIX.cu, .cubin, .ptxas.txt; table on stdout
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/ptxas_wgmma}
py=${PYTHON:-.venv/bin/python}
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
last=$(grep -n '#include "attention_wgmma_dq.cuh"' csrc/attention_cuda.cu | cut -d: -f1)
{
  head -n "$last" csrc/attention_cuda.cu
  cat <<'EOT'
void* wgmma_kernels[] = {
#define TF_WG3(DP, C) (void*)fwd_wgmma_dense_kernel<__nv_bfloat16, DP, C, false>, \
  (void*)fwd_wgmma_dense_kernel<__nv_bfloat16, DP, C, true>, \
  (void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, DP, C>, (void*)dq_wgmma_dense_kernel<__nv_bfloat16, DP, C>,
TF_WG3(64, false) TF_WG3(64, true) TF_WG3(128, false) TF_WG3(128, true)
  (void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, false, true>,
  (void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, true, true>,
};
}  // namespace
void* wgmma_kernel_table() { return wgmma_kernels[0]; }
}  // namespace transformer_fast
EOT
} > "$out.cu"
flags=$(CUDA_HOME="$cuda_home" "$py" - <<'EOT'
import sys, os
from torch.utils import cpp_extension
dirs = [os.path.abspath("csrc")] + cpp_extension.include_paths(device_type="cuda")
for entry in sys.path:  # the nvidia-* wheels' headers, as setup.py adds them
    d = os.path.join(entry, "nvidia/cu13/include")
    if os.path.isdir(d):
        dirs.append(d)
import sysconfig
dirs.append(sysconfig.get_paths()["include"])
print(" ".join(["-I" + d for d in dirs] + cpp_extension.COMMON_NVCC_FLAGS))
EOT
)
# shellcheck disable=SC2086
"$cuda_home/bin/nvcc" -DTF_WITH_CUDA $flags -I"$cuda_home/include" \
  -Xcompiler -fPIC -O3 -std=c++20 -lineinfo \
  -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -gencode=arch=compute_90a,code=sm_90a \
  -cubin "$out.cu" -o "$out.cubin" -Xptxas -v 2> "$out.ptxas.txt"
"$py" - "$out.ptxas.txt" <<'EOT'
import re, sys
name = None
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        name, spill = m.group(1), "?"
        continue
    m = re.search(r"(\d+) bytes spill stores", line)
    if m:
        spill = m.group(1)
    m = re.search(r"Used (\d+) registers", line)
    k = name and re.search(r"(fwd|dkdv|dq)_wgmma_dense_kernelI\w*?(\d+)ELb(\d)E(?:Lb(\d)E)?", name)
    if m and k:
        flag = "dq" if k.group(1) == "dkdv" else "kpm"  # dkdv's fourth argument: kDq (dQ by atomics)
        pad = f" {flag}={k.group(4)}" if k.group(4) is not None else "      "
        print(f"{k.group(1) + '_wgmma_dense_kernel':26s} D{k.group(2):4s} causal={k.group(3)}{pad}  "
              f"{m.group(1)} registers, {spill} bytes spilled")
        name = None
EOT
