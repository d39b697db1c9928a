#!/usr/bin/env bash
# scripts/check_gpu.sh's own logic, on any machine, with stand-ins for nvidia-smi, ctest and compute-sanitizer on
# PATH: the test and suite stages run the whole suite (the GPU tests, then the rest), in parallel only in the Default
# compute mode, with DPAR_TEST_REQUIRE_GPU set where a GPU is visible; a memcheck the budget cuts short is
# "not reached" (exit 3), not failed. Usage: check_gpu_script.sh <source root>
set -u -o pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
cat > "$work/bin/nvidia-smi" <<'FAKE'
#!/usr/bin/env bash
case "$*" in
  *compute_mode*) echo "$FAKE_COMPUTE_MODE" ;;
  *) echo "Fake GPU, 81559 MiB, 999.99" ;;
esac
FAKE
cat > "$work/bin/ctest" <<'FAKE'
#!/usr/bin/env bash
echo "ctest $* REQUIRE_GPU=${DPAR_TEST_REQUIRE_GPU:-}" >> "$FAKE_CALLS"
echo "100% tests passed, 0 tests failed out of 1"
FAKE
cat > "$work/bin/compute-sanitizer" <<'FAKE'
#!/usr/bin/env bash
sleep 60
FAKE
# The GPU test programs of a build (memcheck runs them): stand-ins that list no tests.
mkdir -p "$work/build/tests"
for t in test_cuda_bf16 test_cuda_norm test_cuda_cudnn test_cuda_kernels test_cuda_engine; do
  printf '#!/usr/bin/env bash\nexit 0\n' > "$work/build/tests/$t"
done
chmod +x "$work/bin/"* "$work/build/tests/"*
status=0
check() {  # check WHAT COMMAND...: the command must succeed
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; status=1; fi
}
run() {  # run MODE BUDGET STAGE...: check_gpu.sh with the stand-ins; its exit status in $rc, its logs in $work/MODE
  rm -f "$work/calls"
  PATH="$work/bin:$PATH" FAKE_COMPUTE_MODE=$1 FAKE_CALLS="$work/calls" DPAR_GPU_CHECK_BUDGET_S=$2 \
    DPAR_GPU_BUILD_DIR="$work/build" \
    bash "$root/scripts/check_gpu.sh" "$work/$1" "${@:3}" > "$work/$1.out" 2>&1
  rc=$?
}

run Exclusive_Process 60 test suite
check "exclusive mode: the summary names it" grep -q "compute mode: Exclusive_Process" "$work/Exclusive_Process/summary.txt"
check "exclusive mode: the GPU tests, then the rest" \
  bash -c "grep -q -- '-L cuda' '$work/calls' && grep -q -- '-LE cuda' '$work/calls'"
check "exclusive mode: no -j" bash -c "! grep -q -- '-j' '$work/calls'"
check "a visible GPU makes a skip a failure" bash -c "! grep -v 'REQUIRE_GPU=1' '$work/calls'"
check "exclusive mode: exit 0" [ "$rc" -eq 0 ]

run Default 60 test suite
check "two files come back: the summary and every log packed" \
  bash -c "[ \"\$(ls '$work/Default' | tr '\n' ' ')\" = 'logs.tar.gz summary.txt ' ] &&
           tar -tzf '$work/Default/logs.tar.gz' | grep -q test-ctest.log"
check "default mode: in parallel" bash -c "[ \$(grep -c -- '-j [48]' '$work/calls') -eq 2 ]"

run Default 6 memcheck
check "memcheck cut by the budget: not reached" grep -q "NOT REACHED" "$work/Default/summary.txt"
check "memcheck cut by the budget: not failed" bash -c "! grep -qE 'FAILED|TIMED OUT' '$work/Default/summary.txt'"
check "memcheck cut by the budget: the program not begun is named" \
  grep -q "test_cuda_engine: not reached" "$work/Default/summary.txt"
check "memcheck cut by the budget: exit 3" [ "$rc" -eq 3 ]

rm "$work/build/tests/"test_cuda_*
run Default 6 memcheck
check "a test program that was not built fails memcheck" grep -q "test_cuda_norm: exit (not built)" \
  "$work/Default/summary.txt"
check "a test program that was not built: exit 1" [ "$rc" -eq 1 ]
[ $status -eq 0 ] || { echo "--- summaries"; cat "$work"/*/summary.txt; }
exit $status
