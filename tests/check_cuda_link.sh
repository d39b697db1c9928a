#!/usr/bin/env bash
# libdpar is a guest in processes that bring their own CUDA libraries (PyTorch's wheels carry libcudart.so.13,
# libnccl.so.2, libcublas.so.13, libcudnn.so.9): a library it named as a load-time dependency would be mapped under
# the soname theirs has, and a framework loaded after dpar would bind to it. So no binary given here may need any
# CUDA library: not the runtime (linked statically), not NCCL, cuBLAS or cuDNN (loaded on first use:
# src/platform/cuda/*_library.cpp), nor the driver library libcuda (reached through the runtime).
#   check_cuda_link.sh [--runtime-inside] <binary> [more binaries...]
# --runtime-inside: the first binary must also carry the CUDA runtime itself (a CUDA build's libdpar).
set -u -o pipefail
command -v readelf >/dev/null || { echo "check_cuda_link: readelf is not installed" >&2; exit 2; }
runtime_inside=0
if [[ ${1:-} == --runtime-inside ]]; then
  runtime_inside=1
  shift
fi
[[ $# -gt 0 ]] || { echo "usage: check_cuda_link.sh [--runtime-inside] <binary>..." >&2; exit 2; }
status=0
first=1
for bin in "$@"; do
  needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p')
  echo "$bin needs: $(echo $needed)"
  pinned=$(echo "$needed" | grep -E '^(libcudart|libnccl|libcublas|libcudnn|libcuda)([._]|$)')
  if [[ -n $pinned ]]; then
    echo "check_cuda_link: $bin names CUDA libraries as load-time dependencies: $(echo $pinned)" >&2
    status=1
  fi
  if [[ $first -eq 1 && $runtime_inside -eq 1 ]]; then
    # The static runtime's entry points, local to the library (its version script exports dpar_* alone).
    if readelf -sW "$bin" | awk '$8 == "cudaGetDeviceCount" && $5 == "LOCAL"' | grep -q .; then
      echo "$bin carries the CUDA runtime (cudaGetDeviceCount, local)"
    else
      echo "check_cuda_link: $bin does not carry the CUDA runtime (no local cudaGetDeviceCount in its symbols)" >&2
      status=1
    fi
  fi
  first=0
done
exit $status
