#!/usr/bin/env bash
# The Go raw layer committed in bindings/go/raw (raw.go, raw_wrap.c) is what scripts/gen_go_raw.sh makes of today's
# dpar.h and dpar.i: regenerates it into a temporary directory and compares. Skips (77) without SWIG, or with a SWIG
# other than the version that wrote the committed files, whose output differs in more than the inputs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
raw=$root/bindings/go/raw
if ! command -v swig >/dev/null; then
  echo "skip: swig is not on the PATH, and the committed Go raw layer cannot be regenerated without it"
  exit 77
fi
committed=$(sed -n 's/^ \* Version \(.*\)$/\1/p' "$raw/raw_wrap.c" | head -n 1)
found=$(swig -version | sed -n 's/^SWIG Version \(.*\)$/\1/p')
if [[ $found != "$committed" ]]; then
  echo "skip: swig is SWIG $found, and the committed Go raw layer was written by SWIG $committed"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/gen_go_raw.sh" "$tmp"
stale=0
for f in raw.go raw_wrap.c; do
  if ! diff -u "$raw/$f" "$tmp/$f" >"$tmp/$f.diff"; then
    echo "bindings/go/raw/$f is not SWIG's output for today's dpar.h and dpar.i (first lines of the difference):"
    head -n 40 "$tmp/$f.diff"
    stale=1
  fi
done
if ((stale)); then
  echo "run scripts/gen_go_raw.sh and commit bindings/go/raw" >&2
  exit 1
fi
echo "bindings/go/raw is SWIG $found's output for today's dpar.h and dpar.i"
