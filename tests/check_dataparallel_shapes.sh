#!/usr/bin/env bash
# Runs examples/c/dataparallel_shapes and checks its output against what PyTorch's "Optional: Data Parallelism"
# tutorial prints with torch.nn.DataParallel for the same script: a 5 -> 2 linear model, 100 samples in batches of
# 30, 30, 30 and 10, on 1, 2, 3 and 8 devices. DataParallel scatters a batch with torch.chunk (chunks of ceil(B/n)
# rows; the last may be smaller; trailing devices may get nothing), so replica r sees the r-th chunk.
#
# Replicas print concurrently, so within each "Outside" block the "In Model" lines are compared as a sorted
# multiset; the blocks themselves, and the "Let's use N devices!" headers, must come in order.
# Usage: check_dataparallel_shapes.sh <dataparallel_shapes binary>
set -u -o pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 <dataparallel_shapes binary>" >&2
  exit 2
fi
bin=$1
[[ -x $bin ]] || { echo "check_dataparallel_shapes: $bin is not an executable" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! "$bin" >"$tmp/raw" 2>"$tmp/stderr"; then
  echo "check_dataparallel_shapes: $bin failed:" >&2
  cat "$tmp/stderr" >&2
  exit 1
fi

# What torch.nn.DataParallel gives per (devices, batch): the rows of each replica's chunk, replica 0 first.
# (torch.chunk(30, 8) -> 4,4,4,4,4,4,4,2; torch.chunk(10, 8) -> 2,2,2,2,2; torch.chunk(10, 3) -> 4,4,2.)
chunks() {
  case "$1:$2" in
    1:30) echo 30 ;;
    1:10) echo 10 ;;
    2:30) echo 15 15 ;;
    2:10) echo 5 5 ;;
    3:30) echo 10 10 10 ;;
    3:10) echo 4 4 2 ;;
    8:30) echo 4 4 4 4 4 4 4 2 ;;
    8:10) echo 2 2 2 2 2 ;;
    *) echo "check_dataparallel_shapes: no reference for $1 devices, batch $2" >&2; exit 2 ;;
  esac
}

{
  for devices in 1 2 3 8; do
    echo "Let's use $devices devices!"
    for batch in 30 30 30 10; do
      r=0
      for rows in $(chunks "$devices" "$batch"); do
        printf '\tIn Model (replica %d): input size [%d, 5] output size [%d, 2]\n' "$r" "$rows" "$rows"
        r=$((r + 1))
      done | LC_ALL=C sort
      echo "Outside: input size [$batch, 5] output_size [$batch, 2]"
    done
  done
} >"$tmp/expected"

# Normalise the actual output: sort the "In Model" lines of each block (up to the next "Outside" or header line).
awk '
  function flush() { if (n > 0) { cmd = "LC_ALL=C sort"; for (i = 0; i < n; ++i) print buf[i] | cmd; close(cmd) } n = 0 }
  /^\tIn Model/ { buf[n++] = $0; next }
  { flush(); print }
  END { flush() }
' "$tmp/raw" >"$tmp/actual"

if ! diff -u "$tmp/expected" "$tmp/actual" >"$tmp/diff"; then
  echo "check_dataparallel_shapes: the output differs from torch.nn.DataParallel's (--- expected, +++ actual," \
       "In Model lines sorted per block):" >&2
  cat "$tmp/diff" >&2
  exit 1
fi

# Spot checks of the tutorial's headline numbers, independent of the table above.
n8_30=$(awk '/^Let.s use 8 devices/{on=1} on' "$tmp/raw" | grep -c 'input size \[4, 5\] output size \[4, 2\]')
if [[ $n8_30 -ne 21 ]]; then
  echo "check_dataparallel_shapes: 8 devices: expected 21 chunks of [4, 5] (7 per batch of 30), got $n8_30" >&2
  exit 1
fi
outside=$(grep -c '^Outside: ' "$tmp/raw")
if [[ $outside -ne 16 ]]; then
  echo "check_dataparallel_shapes: expected 16 Outside lines (4 batches x 4 device counts), got $outside" >&2
  exit 1
fi
echo "check_dataparallel_shapes: OK: $(grep -c $'^\tIn Model' "$tmp/raw") replica lines and $outside batches" \
     "match torch.nn.DataParallel"
