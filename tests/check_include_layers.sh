#!/usr/bin/env bash
# The layers below the backends never include upward: kernels (src/kernels), communicators (src/comm) and the CUDA
# platform layer (src/platform) include nothing from src/backend/, so that a kernel or a transport builds and is
# reasoned about without knowing which backend drives it. Usage: check_include_layers.sh <source root>
set -u -o pipefail
root=$1
found=$(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"backend/' \
          "$root/src/kernels" "$root/src/comm" "$root/src/platform" 2>/dev/null)
if [ -n "$found" ]; then
  echo "FAIL: files below src/backend/ include it (move what they need down, e.g. into src/platform/):"
  echo "$found"
  exit 1
fi
echo "ok: nothing under src/kernels, src/comm or src/platform includes backend/"
