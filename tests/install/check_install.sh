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
# the program a run path to it: no LD_LIBRARY_PATH names the prefix, and ldd below shows libdpar found there. A copy
# of the prefix elsewhere works alike. The caller's own LD_LIBRARY_PATH stays: where dpar's dependencies live
# outside the system's paths (oneDNN unpacked under a prefix of its own on the GPU machines), it is what finds them,
# not libdpar.
# Entries that hold a libdpar of their own (a build tree) are dropped, so that only the run path can find dpar's.
LD_LIBRARY_PATH=$(tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}" | while read -r d; do
  if [ -n "$d" ] && [ ! -e "$d/libdpar.so.0" ]; then printf '%s:' "$d"; fi; done)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH%:}
"$tmp/quickstart_pc"
# dpar.h includes the per-topic headers: each is installed under include/dpar/, as in the tree, and compiles alone
# with the flags pkg-config gives.
for h in "$src"/include/dpar/*.h; do
  topic=$(basename "$h")
  cmp "$h" "$tmp/prefix/include/dpar/$topic"
  echo "#include <dpar/$topic>" |
    cc -x c -std=c99 -Wall -Wextra -pedantic -Werror $(pkg-config --cflags dpar) -fsyntax-only -
done
# (ldd's whole output first: grep -q would stop reading early, and pipefail would then fail on ldd's SIGPIPE)
libs=$(ldd "$tmp/quickstart_pc")
grep -q "$tmp/prefix/.*libdpar.so.0" <<<"$libs"
cp -R "$tmp/prefix" "$tmp/moved"
export PKG_CONFIG_PATH=${PKG_CONFIG_PATH/$tmp\/prefix/$tmp\/moved}
cc "$src/examples/c/quickstart.c" $(pkg-config --cflags --libs dpar) -o "$tmp/quickstart_moved"
libs=$(ldd "$tmp/quickstart_moved")
grep -q "$tmp/moved/.*libdpar.so.0" <<<"$libs"
"$tmp/quickstart_moved"
echo "install: find_package(dpar) and pkg-config both work; dpar.pc gives a run path and moves with its prefix"
