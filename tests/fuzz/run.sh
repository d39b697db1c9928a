#!/usr/bin/env bash
# Runs each libFuzzer harness for a bounded time on its seed corpus: tests/fuzz/run.sh BUILD_DIR [SECONDS].
# New inputs go to a scratch copy, so the committed corpus changes only by hand. Fails on any crash, leak,
# timeout or sanitizer report (the input that caused it is kept under BUILD_DIR/fuzz-findings/ and printed).
# Prints each fuzzer's number of executions and coverage.
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
findings=$build/fuzz-findings
mkdir -p "$findings"
status=0
for name in safetensors checkpoint idx idx_gz dlpack graph; do
  work=$(mktemp -d)
  cp "$here/corpus/$name/"* "$work/"
  log=$build/fuzz_$name.log
  # -rss_limit_mb: a reader that allocates beyond what a file can justify is a finding too.
  # -timeout: one input taking over 10 s is a finding (a hang).
  if "$build/tests/fuzz/fuzz_$name" "$work" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
       -max_len=65536 -print_final_stats=1 -artifact_prefix="$findings/${name}-" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
    grep -E "ERROR|SUMMARY|Test unit written|==[0-9]+==" "$log" | head -20 || true
  fi
  runs=$(grep -o "stat::number_of_executed_units: *[0-9]*" "$log" | grep -o "[0-9]*$" || echo "?")
  cov=$(grep -oE "cov: [0-9]+ ft: [0-9]+" "$log" | tail -1 || true)
  echo "fuzz_$name: $result, $runs executions in ${seconds} s, $cov, corpus $(ls "$work" | wc -l) files"
  rm -rf "$work"
done
exit $status
