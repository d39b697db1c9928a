#!/usr/bin/env bash
# Checks the exit codes of tests/gtest_main.cpp through tests/skip_codes.cpp: 0 for a pass, 77 (CTest's
# SKIP_RETURN_CODE here) for a skip, and a failure (1) for a test that printed its skip line and then failed.
#   check_skip_codes.sh <skip_codes executable>
set -u
prog=$1
status=0
expect() {
  local want=$1 filter=$2
  "$prog" --gtest_filter="$filter" >/dev/null 2>&1
  local got=$?
  if [ "$got" -ne "$want" ]; then
    echo "FAIL: $filter exited $got, expected $want"
    status=1
  else
    echo "ok: $filter exited $got"
  fi
}
expect 0 'Passes.*'
expect 77 'Skips.*'
expect 1 'SkipThenFail.*'
expect 1 'Skips.*:SkipThenFail.*'
expect 0 'Passes.*:Skips.*'
exit $status
