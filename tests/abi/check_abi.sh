#!/usr/bin/env bash
# libdpar's ABI against the committed baseline, tests/abi/libdpar.abi: every function the baseline exports is still
# exported, with the same parameter and return types, and every type they reach (option structs, dpar_device,
# callbacks' structs, ...) has the same size, members, offsets and member types. Functions may be added; any other
# difference fails, a field appended to a versioned option struct included: that one is compatible by dpar's rules
# (a library reads a caller's struct by its size and version), and is accepted by writing a new baseline, so that
# the commit that appends it shows the new layout in the baseline's diff.
#
# abidiff (libabigail) reads the types from DWARF, so it reads <library with debug info>: libdpar.so built again
# from the same sources and objects with -g (the CMake target dpar_abi). Its exported symbols must be
# <libdpar.so>'s, which is what ships.
#
#   check_abi.sh <library with debug info> <libdpar.so>          compare with the baseline
#   check_abi.sh --write <library with debug info>               write the baseline (review its diff, then commit)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
baseline=$here/libdpar.abi
include=$(cd "$here/../../include" && pwd)
# Only what the exported functions reach, and of that only the types the public headers define: a handle such as
# dpar_engine, defined in src/capi/api.h, is opaque, so that the library's insides may change. (libabigail tells
# public from private by the file's name alone, which is why no name under include/ may be that of a header of
# src/ that defines a type a public one reaches.) The locations are kept, as file names only: abidiff drops a type
# of unknown location as private, and would miss its changes. No path (the build's, the source tree's) and no
# DT_NEEDED (CUDA and MPI, where found, add some): the baseline is the same from any build tree on any machine.
reading=(--headers-dir "$include" --drop-private-types --exported-interfaces-only)
abidw_flags=("${reading[@]}" --no-corpus-path --no-comp-dir-path --short-locs --no-elf-needed --type-id-style hash)

for tool in abidw abidiff nm; do
  if ! command -v "$tool" >/dev/null; then
    echo "skip: $tool is not installed (Debian: abigail-tools, binutils)"
    # Where DPAR_TEST_REQUIRE_DEPS says every dependency was installed (CI), a missing one fails.
    [[ -n ${DPAR_TEST_REQUIRE_DEPS:-} ]] && exit 1
    exit 77
  fi
done

if [[ ${1:-} == --write ]]; then
  [[ $# -eq 2 ]] || { echo "usage: $0 --write <library with debug info>" >&2; exit 2; }
  abidw "${abidw_flags[@]}" --out-file "$baseline" "$2"
  echo "wrote $baseline from $2"
  exit 0
fi
[[ $# -eq 2 ]] || { echo "usage: $0 <library with debug info> <libdpar.so>" >&2; exit 2; }
debug_lib=$1 lib=$2
for f in "$debug_lib" "$lib" "$baseline"; do
  [[ -f $f ]] || { echo "check_abi: no file at $f" >&2; exit 2; }
done

# The library read is the one shipped, less its debug information: the same dynamic symbols, by name and type.
symbols() { nm -D --defined-only "$1" | awk '{print $2, $3}' | sort; }
if ! diff <(symbols "$lib") <(symbols "$debug_lib") >/dev/null; then
  echo "check_abi: $debug_lib does not export what $lib exports (< $lib, > $debug_lib):"
  diff <(symbols "$lib") <(symbols "$debug_lib") || true
  exit 1
fi

# Added functions are not reported (--no-added-syms), so a pure addition exits 0. abidiff's exit status is a set
# of bits: 1 an error, 2 a usage error, 4 an ABI change, 8 an incompatible one (a function removed).
set +e
report=$(abidiff --no-added-syms --headers-dir2 "$include" --drop-private-types --exported-interfaces-only \
        "$baseline" "$debug_lib" 2>&1)
status=$?
set -e
if [[ $status -eq 0 ]]; then
  echo "check_abi: libdpar's ABI is the baseline's (functions may have been added): $(grep -c '<elf-symbol ' \
"$baseline") symbols in tests/abi/libdpar.abi"
  exit 0
fi
echo "$report"
what=()
((status & 1)) && what+=("abidiff failed")
((status & 2)) && what+=("abidiff was misused")
((status & 4)) && what+=("the ABI changed")
((status & 8)) && what+=("incompatibly: something the baseline has is gone")
echo "check_abi: $(IFS=';'; echo "${what[*]}") (abidiff exit status $status)." >&2
if ((status & 4)); then
  echo "check_abi: an intended change (a field appended to a versioned option struct) is recorded with" \
       "tests/abi/check_abi.sh --write <build>/tests/abi/libdpar.so; commit the baseline with it" >&2
fi
exit 1
