#!/usr/bin/env bash
# A CUDA build links the CUDA runtime (libcudart), never the driver library (libcuda), so that it loads and runs its
# CPU devices on a machine without a driver. Usage: check_cuda_link.sh <binary that uses CUDA> [more binaries...]
# The first binary must need libcudart; none may need libcuda, nor cuBLAS or cuDNN, which dpar loads on first use
# (src/platform/cuda/cublas_library.cpp, cudnn_library.cpp) so that a process that never touches a GPU does not
# load them, and libdpar loads where cuDNN is not installed.
set -u -o pipefail
command -v readelf >/dev/null || { echo "check_cuda_link: readelf is not installed" >&2; exit 2; }
status=0
first=1
for bin in "$@"; do
  needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p')
  echo "$bin needs: $(echo $needed)"
  if echo "$needed" | grep -q '^libcuda\.so'; then
    echo "check_cuda_link: $bin links the driver library libcuda" >&2
    status=1
  fi
  if echo "$needed" | grep -q '^libcublas'; then
    echo "check_cuda_link: $bin links cuBLAS, which dpar loads on first use" >&2
    status=1
  fi
  if echo "$needed" | grep -q '^libcudnn'; then
    echo "check_cuda_link: $bin links cuDNN, which dpar loads on first use" >&2
    status=1
  fi
  if [[ $first -eq 1 ]] && ! echo "$needed" | grep -q '^libcudart\.so'; then
    echo "check_cuda_link: $bin does not link the CUDA runtime libcudart" >&2
    status=1
  fi
  first=0
done
exit $status
