#!/usr/bin/env bash
# Installs what dpar needs on Debian 12 (bookworm): compilers, CMake, oneDNN (the CPU GEMM, which picks its kernels
# from the CPU's feature bits; bench/results/cpu_gemm_providers.md), zlib, nlohmann-json, GoogleTest,
# OpenMPI, Gloo (an anchor of the all-reduce benchmark), Debian's Fashion-MNIST for the demo and its fortunes (the
# character-level GPT's text), Python (for
# checks that run Python's safetensors and the function-table generator), DLPack's header, what the bindings
# build with: SWIG (Python's and Go's raw layers), Python's headers, Go, and Debian's cargo when no cargo is on the
# PATH (rustup's is used where present), and clang with its runtime libraries (libFuzzer, for the fuzzers of
# tests/fuzz), and abigail-tools (abidiff, the ABI check of tests/abi). Installs only what is missing.
set -euo pipefail
packages=(build-essential cmake pkg-config libdnnl-dev zlib1g-dev nlohmann-json3-dev libgtest-dev
          libopenmpi-dev openmpi-bin libgloo-dev dataset-fashion-mnist fortunes fortunes-min python3 python3-venv python3-dev
          libdlpack-dev swig golang-go clang libclang-rt-14-dev abigail-tools)
if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  packages+=(cargo)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: every apt package is installed"
else
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A Python environment for the tests (build-pyenv/ at the top of the tree, which CMake hands to the tests that
# need it): safetensors checks checkpoints, numpy tests the Python binding, scikit-build-core builds its wheel,
# tree-sitter-julia parses the Julia package. From PyPI; the tests that need them skip without it.
pyenv="$(cd "$(dirname "$0")/.." && pwd)/build-pyenv"
pypackages=(numpy safetensors setuptools wheel tree-sitter tree-sitter-julia "scikit-build-core>=1.0")
if ! "$pyenv/bin/python" -c "import numpy, safetensors, setuptools, wheel, tree_sitter, tree_sitter_julia
import scikit_build_core; assert int(scikit_build_core.__version__.split('.')[0]) >= 1" 2>/dev/null; then
  if python3 -m venv "$pyenv" >/dev/null 2>&1 &&
     "$pyenv/bin/python" -m pip install -q "${pypackages[@]}" >/dev/null 2>&1; then
    echo "install-deps: $pyenv has ${pypackages[*]}"
  else
    echo "install-deps: note: could not make $pyenv (no PyPI?); the Python-based tests will skip"
  fi
fi
# The wheel of build-pyenv's numpy, for the fresh virtual environment of the Python wheel's test, which installs
# offline (bindings/python/check_wheel.sh).
if [ -x "$pyenv/bin/python" ] && ! compgen -G "$pyenv/wheelhouse/numpy-*.whl" >/dev/null; then
  numpy_version=$("$pyenv/bin/python" -c "import numpy; print(numpy.__version__)" 2>/dev/null || true)
  if [ -n "$numpy_version" ] && "$pyenv/bin/python" -m pip download -q --no-deps --only-binary=:all: \
       -d "$pyenv/wheelhouse" "numpy==$numpy_version" >/dev/null 2>&1; then
    echo "install-deps: $pyenv/wheelhouse has numpy $numpy_version's wheel"
  else
    echo "install-deps: note: could not download numpy's wheel (no PyPI?); the Python wheel's test will skip"
  fi
fi
