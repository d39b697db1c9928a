#!/usr/bin/env bash
# Runs each libFuzzer harness for a bounded time on its seed corpus: tests/fuzz/run.sh BUILD_DIR [SECONDS] [JOBS].
# New inputs go to a scratch copy, so the committed corpus changes only by hand. Fails on any crash, leak,
# timeout or sanitizer report (the input that caused it is kept under BUILD_DIR/fuzz-findings/ and printed).
# Prints each fuzzer's number of executions and coverage. A harness is one process on one core, so JOBS of them
# (default: the machine's cores) run at once, each still for SECONDS of its own.
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=${2:-60}
jobs=${3:-$(nproc)}
here=$(cd "$(dirname "$0")" && pwd)
findings=$build/fuzz-findings
mkdir -p "$findings"
names=(safetensors checkpoint idx idx_gz dlpack graph)

# One harness: its log in BUILD_DIR/fuzz_NAME.log, its one-line summary in BUILD_DIR/fuzz_NAME.summary, its
# exit status 1 on a finding.
fuzz_one() {
  local name=$1 work log result runs cov
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
  fi
  runs=$(grep -o "stat::number_of_executed_units: *[0-9]*" "$log" | grep -o "[0-9]*$" || echo "?")
  cov=$(grep -oE "cov: [0-9]+ ft: [0-9]+" "$log" | tail -1 || true)
  echo "fuzz_$name: $result, $runs executions in ${seconds} s, $cov, corpus $(ls "$work" | wc -l) files" \
    >"$build/fuzz_$name.summary"
  rm -rf "$work"
}

for name in "${names[@]}"; do
  rm -f "$build/fuzz_$name.summary"
  # Wait for a slot: at most `jobs` harnesses at a time.
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$name" &
done
wait || true
# The summaries in a fixed order, each finding's evidence after its line; a harness that left no summary failed.
status=0
for name in "${names[@]}"; do
  if [ ! -f "$build/fuzz_$name.summary" ]; then
    echo "fuzz_$name: FAILED, no summary (see $build/fuzz_$name.log)"
    status=1
  elif ! grep -q ": ok," "$build/fuzz_$name.summary"; then
    cat "$build/fuzz_$name.summary"
    status=1
    grep -E "ERROR|SUMMARY|Test unit written|==[0-9]+==" "$build/fuzz_$name.log" | head -20 || true
  else
    cat "$build/fuzz_$name.summary"
  fi
done
exit $status
