#!/usr/bin/env bash
# dpar as a guest in a PyTorch process, in both orders: PyTorch's libraries loaded first, or dpar first. A libdpar
# that named libnccl.so.2 or libcudart.so.13 as load-time dependencies mapped the CUDA toolkit's under the sonames
# PyTorch's have, and `import dpar; import torch` then failed ("libtorch_cuda.so: undefined symbol: ncclCommResume").
#
#   check_torch_guest.sh python <work directory> <package sources> [<built extension's directory>]
#       dpar's Python package (bindings/python/dpar with the extension this build made) and `import torch`, in
#       each order (tests/torch/import_orders.py), tensors exchanged by DLPack
#   check_torch_guest.sh dlopen <work directory> <libdpar.so.0> <dlopen_beside_torch>
#       a C host that dlopen()s libdpar and PyTorch's libraries (tests/torch/torch_side.cpp, built here against
#       PyTorch's headers), in each order, tensors exchanged by DLPack
#
# PyTorch comes from $DPAR_TEST_TORCH_PYTHON (else $DPAR_TEST_TORCH_PYTHON_CONFIGURED, the CMake variable of that
# name): a Python with a CUDA build of PyTorch, e.g. a virtual environment outside the tree made by
# `python3 -m venv ~/torch-venv && ~/torch-venv/bin/pip install torch numpy` (several GB with its nvidia-* wheels).
# Without one, or with a CPU build of PyTorch, the test skips (77) saying so, also where DPAR_TEST_REQUIRE_DEPS is
# set: CI does not install that multi-GB dependency. One that is named but cannot import torch fails.
set -u -o pipefail
mode=${1:-}
here=$(cd "$(dirname "$0")" && pwd)
python=${DPAR_TEST_TORCH_PYTHON:-${DPAR_TEST_TORCH_PYTHON_CONFIGURED:-}}
skip() {
  echo "SKIP: $*"
  exit 77
}
if [[ -z $python ]]; then
  skip "no PyTorch to run beside: set DPAR_TEST_TORCH_PYTHON (environment or CMake variable) to a Python with a" \
       "CUDA build of PyTorch, e.g. a virtual environment outside the tree with \`pip install torch numpy\`"
fi
# Where PyTorch is (its package directory), whether it is a CUDA build, its version; from a neutral directory, so
# that nothing here shadows a module it imports.
if ! info=$(cd / && "$python" -c '
import os, sysconfig, torch
print(os.path.dirname(os.path.realpath(torch.__file__)))
print(torch.version.cuda or "")
print(torch.__version__)
print(sysconfig.get_config_var("EXT_SUFFIX"))' 2>&1); then
  echo "FAIL: DPAR_TEST_TORCH_PYTHON=$python cannot import torch:"
  echo "$info" | tail -5
  exit 1
fi
torch_dir=$(sed -n 1p <<<"$info")
torch_cuda=$(sed -n 2p <<<"$info")
torch_version=$(sed -n 3p <<<"$info")
ext_suffix=$(sed -n 4p <<<"$info")
[[ -n $torch_cuda ]] || skip "PyTorch $torch_version of $python is a CPU build: dpar's guest tests need a CUDA build"
site_packages=$(dirname "$torch_dir")
echo "PyTorch $torch_version (CUDA $torch_cuda) in $torch_dir"

status=0
case $mode in
  python)
    work=$2 sources=$3 extension_dir=${4:-}
    [[ -n $extension_dir ]] || skip "this build has no Python extension (DPAR_BUILD_PYTHON; swig and Python's headers)"
    extension=$(ls "$extension_dir"/_raw*.so 2>/dev/null | head -1)
    [[ -n $extension ]] || { echo "FAIL: no _raw*.so in $extension_dir"; exit 1; }
    [[ $extension == *"$ext_suffix" ]] ||
      skip "the extension $(basename "$extension") was built for another Python than $python ($ext_suffix):" \
           "configure with DPAR_TEST_PYTHON of the same version"
    rm -rf "$work/package"
    mkdir -p "$work/package/dpar"
    cp "$sources"/dpar/* "$work/package/dpar/"
    cp "$extension" "$extension_dir"/raw.py "$work/package/dpar/"
    for order in dpar-first torch-first; do
      echo "--- python, $order"
      (cd "$work" && PYTHONPATH=$work/package "$python" "$here/import_orders.py" "$order") || status=1
    done
    ;;
  dlopen)
    work=$2 libdpar=$3 host=$4
    side=$work/torch_side.so
    # Built once per PyTorch and source: PyTorch's headers need C++20 and take a while.
    stamp="$torch_dir $torch_version $(stat -c %Y "$here/torch_side.cpp")"
    if [[ ! -f $side || $(cat "$side.stamp" 2>/dev/null) != "$stamp" ]]; then
      mkdir -p "$work"
      echo "building $side against $torch_dir"
      # PyTorch's headers need C++20 as clang or a recent GCC reads it (GCC 12 refuses some of 2.15's): clang++
      # where there is one, unless $CXX says otherwise.
      cxx=${CXX:-$(command -v clang++ || echo c++)}
      if ! "$cxx" -std=c++20 -O1 -fPIC -shared -w -I"$torch_dir/include" "$here/torch_side.cpp" -o "$side.tmp" \
             -L"$torch_dir/lib" -Wl,--no-as-needed -ltorch_cuda -ltorch_cpu -lc10 -Wl,--as-needed \
             -Wl,-rpath,"$torch_dir/lib" >"$work/torch_side.log" 2>&1; then
        tail -5 "$work/torch_side.log"
        skip "$cxx could not build PyTorch $torch_version's headers (tests/torch/torch_side.cpp; the whole log:" \
             "$work/torch_side.log): set CXX to a C++20 compiler they accept (clang++, or GCC 13 or later)"
      fi
      mv "$side.tmp" "$side"
      echo "$stamp" >"$side.stamp"
    fi
    for order in dpar-first torch-first; do
      echo "--- dlopen, $order"
      "$host" "$order" "$libdpar" "$side" "$site_packages" || status=1
    done
    ;;
  *)
    echo "usage: check_torch_guest.sh python|dlopen ..." >&2
    exit 2
    ;;
esac
exit $status
