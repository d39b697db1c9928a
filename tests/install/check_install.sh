#!/usr/bin/env bash
# Installs dpar from a build tree into a temporary prefix, then builds the quickstart example against it twice:
# with CMake's find_package(dpar) and with pkg-config. Both programs must run. Each installed per-topic header
# (include/dpar/) must be the tree's and compile alone.
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
export PKG_CONFIG_PATH=$(dirname "$pc")
cc "$src/examples/c/quickstart.c" $(pkg-config --cflags --libs dpar) -o "$tmp/quickstart_pc"
# The installed dpar.pc finds its prefix from its own place (the tree was configured for another prefix) and gives
# the program a run path to it: no LD_LIBRARY_PATH. A copy of the prefix elsewhere works alike.
env -u LD_LIBRARY_PATH "$tmp/quickstart_pc"
# dpar.h includes the per-topic headers: each is installed under include/dpar/, as in the tree, and compiles alone
# with the flags pkg-config gives.
for h in "$src"/include/dpar/*.h; do
  topic=$(basename "$h")
  cmp "$h" "$tmp/prefix/include/dpar/$topic"
  echo "#include <dpar/$topic>" |
    cc -x c -std=c99 -Wall -Wextra -pedantic -Werror $(pkg-config --cflags dpar) -fsyntax-only -
done
# (ldd's whole output first: grep -q would stop reading early, and pipefail would then fail on ldd's SIGPIPE)
libs=$(env -u LD_LIBRARY_PATH ldd "$tmp/quickstart_pc")
grep -q "$tmp/prefix/.*libdpar.so.0" <<<"$libs"
cp -R "$tmp/prefix" "$tmp/moved"
export PKG_CONFIG_PATH=${PKG_CONFIG_PATH/$tmp\/prefix/$tmp\/moved}
cc "$src/examples/c/quickstart.c" $(pkg-config --cflags --libs dpar) -o "$tmp/quickstart_moved"
libs=$(env -u LD_LIBRARY_PATH ldd "$tmp/quickstart_moved")
grep -q "$tmp/moved/.*libdpar.so.0" <<<"$libs"
env -u LD_LIBRARY_PATH "$tmp/quickstart_moved"
echo "install: find_package(dpar) and pkg-config both work; dpar.pc gives a run path and moves with its prefix"
