#!/usr/bin/env bash
# Installs what dpar needs on Debian 12 (bookworm): compilers, CMake, OpenBLAS, zlib, nlohmann-json, GoogleTest,
# OpenMPI, Gloo (an anchor of the all-reduce benchmark), Debian's Fashion-MNIST for the demo, Python (for
# checks that run Python's safetensors and the function-table generator), and clang with its runtime libraries
# (libFuzzer, for the fuzzers of tests/fuzz). Installs only what is missing.
set -euo pipefail
packages=(build-essential cmake pkg-config libopenblas-dev zlib1g-dev nlohmann-json3-dev libgtest-dev
          libopenmpi-dev openmpi-bin libgloo-dev dataset-fashion-mnist python3 python3-venv
          clang libclang-rt-14-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything is installed"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
