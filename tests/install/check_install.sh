#!/usr/bin/env bash
# Installs dpar from a build tree into a temporary prefix, then builds the quickstart example against it twice:
# with CMake's find_package(dpar) and with pkg-config. Both programs must run.
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -f "$tmp/prefix/include/dpar.h"
cmake -S "$src/tests/install" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
      -DQUICKSTART_SOURCE="$src/examples/c/quickstart.c" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64:${LD_LIBRARY_PATH:-}" "$tmp/consumer/quickstart"
pc=$(ls "$tmp"/prefix/lib*/pkgconfig/dpar.pc)
sed -i "s|^prefix=.*|prefix=$tmp/prefix|" "$pc"
export PKG_CONFIG_PATH=$(dirname "$pc")
cc "$src/examples/c/quickstart.c" $(pkg-config --cflags --libs dpar) -o "$tmp/quickstart_pc"
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64:${LD_LIBRARY_PATH:-}" "$tmp/quickstart_pc"
echo "install: find_package(dpar) and pkg-config both work"
