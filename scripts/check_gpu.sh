#!/usr/bin/env bash
# Runs every check dpar has for a GPU, on a machine with one, and keeps each check's log:
#
#   scripts/check_gpu.sh LOGDIR [STAGE...]
#
# Stages, in order (all of them when none is named):
#   build     configure and build build-gpu/ (Release, the CUDA backend required: DPAR_WITH_CUDA=ON)
#   test      every CTest test, the CUDA ones included (CTest lists the ones that skipped)
#   fmnist    the C example trains on Fashion-MNIST over cuda devices for 10 epochs and must reach 88% (and writes
#             a timeline of its first epoch to LOGDIR/traces)
#   bench     bench_cuda_gemms, torch_anchor.py (where PyTorch is), bench_cuda_train with both anchors (and a
#             timeline of each configuration's step in LOGDIR/traces, for ui.perfetto.dev)
#   memcheck  the CUDA test binaries under compute-sanitizer --tool memcheck
#   racecheck the kernel tests under --tool racecheck (shared-memory hazards: dpar's own kernels are all there; the
#             other binaries add cuBLAS's kernels, which racecheck slows down most, and no kernel of dpar's)
#
# Each stage has its own time limit (DPAR_GPU_STAGE_LIMIT_S, default 280 s; under a sanitizer each binary has its
# own, DPAR_GPU_SANITIZER_LIMIT_S, default 300 s) so that one hang cannot eat a whole lease; a stage that fails does
# not stop the next. On a machine lent for a few minutes per command, run memcheck alone, or lower its limit.
# LOGDIR/summary.txt has one line per stage: its status, its seconds and its log. The exit status is 0 only when
# every stage run passed.
#
# On the project's GPU machines (../shared/device/README.md) source .gpudeps/on-device.sh first: it exports
# DEVICE_CMAKE_ARGS (where the carried OpenBLAS, zlib and GoogleTest are) and DPAR_FASHION_MNIST_DIR.
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
logs=$(mkdir -p "$1" && cd "$1" && pwd)
shift
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build test fmnist bench memcheck racecheck)

root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-gpu"
limit=${DPAR_GPU_STAGE_LIMIT_S:-280}
sanitizer_limit=${DPAR_GPU_SANITIZER_LIMIT_S:-300}
command -v compute-sanitizer > /dev/null || PATH="/usr/local/cuda/bin:$PATH"
data=${DPAR_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
summary="$logs/summary.txt"
failed=0

note() { echo "$*" | tee -a "$summary"; }

# run_stage NAME LIMIT COMMAND...: runs the command with its output in LOGDIR/NAME.log, under a time limit (0: the
# command bounds its own parts).
run_stage() {
  local name=$1 stage_limit=$2
  shift 2
  local start=$SECONDS status
  if [ "$stage_limit" -gt 0 ]; then
    timeout --kill-after=10 "$stage_limit" "$@" > "$logs/$name.log" 2>&1
  else
    "$@" > "$logs/$name.log" 2>&1
  fi
  status=$?
  local took=$((SECONDS - start)) verdict=passed
  if [ $status -eq 124 ] || [ $status -eq 137 ]; then
    verdict="TIMED OUT after ${stage_limit} s"
  elif [ $status -ne 0 ]; then
    verdict="FAILED (exit $status)"
  fi
  [ "$verdict" = passed ] || failed=1
  note "$(printf '%-10s %-28s %5d s  %s' "$name" "$verdict" "$took" "$logs/$name.log")"
}

stage_build() {
  # DEVICE_CMAKE_ARGS is a list of -D flags; it is split on purpose.
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDPAR_WITH_CUDA=ON ${DEVICE_CMAKE_ARGS:-} &&
    cmake --build "$build" -j "$(nproc)"
}

stage_test() {
  # A GPU test that skips here is a finding: CTest lists the skipped ones at the end (the CUDA tests' skips are
  # CTest skips: tests/CMakeLists.txt); the binary itself prints why.
  cd "$build" && ctest -j "$(nproc)" --timeout 200 --output-on-failure
}

stage_fmnist() {
  mkdir -p "$logs/traces"
  "$build/examples/c/train_fashion_mnist" --device cuda --data "$data" --epochs 10 --min-accuracy 88 \
    --trace "$logs/traces/fmnist-epoch1.json"
}

stage_bench() {
  local status=0
  "$build/bench/bench_cuda_gemms" --json "$logs/gemms.json" || status=1
  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    python3 "$root/bench/torch_anchor.py" --json "$logs/torch.json" || status=1
  else
    echo "torch_anchor.py: no PyTorch with CUDA here; dpar's figures alone"
  fi
  local anchors=()
  [ -s "$logs/torch.json" ] && anchors+=(--torch "$logs/torch.json")
  [ -s "$logs/gemms.json" ] && anchors+=(--gemms "$logs/gemms.json")
  local loader=()
  [ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ] && loader=(--data "$data")
  mkdir -p "$logs/traces"
  "$build/bench/bench_cuda_train" --json "$logs/dpar.json" --trace "$logs/traces" "${anchors[@]}" "${loader[@]}" ||
    status=1
  return $status
}

# sanitize TOOL: each CUDA test binary under compute-sanitizer; a report or a failed test fails the stage.
sanitize() {
  local cuda_tests=(test_cuda_kernels test_cuda_comm test_cuda_engine test_cuda_capi)
  [ "$1" = racecheck ] && cuda_tests=(test_cuda_kernels)
  local tool=$1 status=0 each=$sanitizer_limit
  for t in "${cuda_tests[@]}"; do
    echo "== compute-sanitizer --tool $tool $t (limit ${each} s)"
    timeout --kill-after=10 "$each" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      "$build/tests/$t" || { echo "== $t: exit $?"; status=1; }
  done
  return $status
}

: > "$summary"
note "dpar GPU checks, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
  echo 'NO GPU VISIBLE (nvidia-smi): the CUDA tests and benchmarks below skip, and a skip is not a pass')"
export root build data logs limit sanitizer_limit
export -f stage_build stage_test stage_fmnist stage_bench sanitize
for stage in "${stages[@]}"; do
  case $stage in
    build | test | fmnist | bench) run_stage "$stage" "$limit" bash -c "stage_$stage" ;;
    memcheck | racecheck) run_stage "$stage" 0 bash -c "sanitize $stage" ;;
    *) note "unknown stage '$stage' (build test fmnist bench memcheck racecheck)"; failed=1 ;;
  esac
done
exit $failed
