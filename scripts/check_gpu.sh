#!/usr/bin/env bash
# Every GPU check dpar has, in one command that fits one call on a GPU machine lent for minutes (under 10 minutes
# in all), each log kept where it comes back even when a stage hangs:
#
#   scripts/check_gpu.sh LOGDIR [STAGE...]
#
# Stages, in order (all but racecheck when none is named), what only a GPU can run first:
#   build     configure build-gpu/ (Release, the CUDA backend required) and print the CUDA, cuBLAS, NCCL and
#             DLPack it found, and the cuDNN headers (cuDNN itself is loaded when a
#             convolution first runs); build
#   test      the GPU tests (CTest label "cuda"), each under its own limit (60 s): a hung one is killed and named
#             ("Timeout") while the others go on. With a GPU visible, DPAR_TEST_REQUIRE_GPU=1 makes a GPU test that
#             finds no device fail instead of skipping; a test that still skips (one that needs a second GPU) is
#             listed. In parallel only where the GPU's compute mode is Default: in an exclusive mode a second
#             process cannot open the GPU, so the tests run one at a time
#   fmnist    the C example trains on Fashion-MNIST on cuda for 10 epochs and must reach 88% (a timeline of its
#             first epoch goes to LOGDIR/traces)
#   cnn       the Fashion-MNIST CNN (convolutions through cuDNN, BatchNorm, pooling, a residual block) trains on
#             cuda for 10 epochs and must reach 92%; then 2 replicas on the one GPU with SyncBatchNorm, 2 epochs,
#             84% (the shortened CPU test's bar)
#   bench-cnn the CNN's training step on cuda:0 beside PyTorch's on the same GPU (bench_cnn --device cuda), at
#             batch 128 and 512
#   bench     the GPU training benchmark for the demo MLP at batch 128 and the wide MLP 784-4096-4096-4096-10 at
#             batch 8192: dpar's step beside PyTorch's (plain, DataParallel, DDP of world size 1, CUDA graph, where
#             PyTorch with CUDA is installed) and beside the step's GEMMs in cuBLAS alone, with the ratios
#   memcheck  dpar's own kernel and engine tests under compute-sanitizer memcheck, one process per test with a
#             limit of its own (a test slow or hung under the tool is named, the rest go on); API errors are not reported
#             (dpar checks every API call's status itself, and its tests fail calls on purpose, e.g. the
#             out-of-memory test's 4 TiB allocation). A program the budget left no time for is "not reached"
#   suite     the rest of the suite, whose tests take GPU branches too where a GPU is present (DLPack's cuda
#             tensors, the data loaders on cuda:0), as the test stage runs them; where python3 has PyTorch with
#             CUDA, dpar beside it in both import orders (DPAR_TEST_TORCH_PYTHON: tests/torch/check_torch_guest.sh)
#   fmnist-cpu the same training on the machine's CPU cores, for the wall time beside the GPU's
#   racecheck (only when named) the kernel tests under racecheck: shared-memory hazards in dpar's kernels
#   profile   (only when named) each kernel's GPU time under Nsight Compute (ncu, one metric: the kernel's duration)
#             for the wide MLP at batch 8192 and the CNN at batch 512, summed per kernel by scripts/kernel_times.py:
#             where a step's GPU time goes beyond its GEMMs
#
# The whole check has a budget (DPAR_GPU_CHECK_BUDGET_S, default 540 s); each stage runs under its own limit,
# never past what is left of the budget, and a stage that fails or times out does not stop the next. A stage that
# the budget (not its own limit) cut short, or left no time for, is "NOT REACHED": not a failure, and not a pass.
# LOGDIR/summary.txt has one line per stage (status, seconds, log) after the GPU and its compute mode; it is printed
# last. Every log, JSON and trace is in LOGDIR/logs.tar.gz, refreshed after each stage (two files in all: the GPU
# machines give back at most 8). Exit status: 0 when every stage ran and passed, 1 when one failed (or hit its own limit), 3 when none failed
# but the budget left one not reached.
#
# On the project's GPU machines (../shared/device/README.md), from the project's root:
#   source .gpudeps/on-device.sh && bash scripts/check_gpu.sh "$OUT/gpu"
# after `DEVCARRY_EXTRA_DEBS="ocl-icd-libopencl1 libopenmpi-dev" bash ../shared/device/prepare.sh` on the build
# machine (Debian's oneDNN, dpar's CPU GEMM, needs libOpenCL.so.1; OpenMPI's headers build the multi-process GPU
# tests, which the GPU machine's OpenMPI runtime runs). on-device.sh exports DEVICE_CMAKE_ARGS (where the carried
# oneDNN, zlib, GoogleTest and DLPack are) and DPAR_FASHION_MNIST_DIR.
set -uo pipefail

if [ $# -lt 1 ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
# The logs are written in a scratch folder and packed into LOGDIR/logs.tar.gz after every stage, beside a copy of
# summary.txt: the GPU machines give back at most 8 files, and a stage cut short still leaves the ones before it.
logs=$(mktemp -d "${TMPDIR:-/tmp}/dpar-gpu-check.XXXXXX")
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build test fmnist cnn bench bench-cnn memcheck suite fmnist-cpu)

root=$(cd "$(dirname "$0")/.." && pwd)
build=${DPAR_GPU_BUILD_DIR:-$root/build-gpu}  # a test of this script points it elsewhere
budget=${DPAR_GPU_CHECK_BUDGET_S:-540}
command -v compute-sanitizer > /dev/null || PATH="/usr/local/cuda/bin:$PATH"
data=${DPAR_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
summary="$logs/summary.txt"
failed=0 unreached=0
started=$SECONDS

note() { echo "$*" >> "$summary"; echo "$*"; }

# LOGDIR/summary.txt and LOGDIR/logs.tar.gz (every log, JSON and trace so far), replaced whole.
pack() {
  cp "$summary" "$out/summary.txt"
  tar -czf "$out/logs.tar.gz.part" -C "$logs" . && mv "$out/logs.tar.gz.part" "$out/logs.tar.gz"
}

# run_stage NAME CAP COMMAND...: the command with its output in LOGDIR/NAME.log, under min(CAP, what is left of
# the budget) seconds.
run_stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((budget - (SECONDS - started)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    note "$(printf '%-9s %-30s %5d s  %s' "$name" "NOT REACHED (budget spent)" 0 "-")"
    unreached=1
    return
  fi
  local start=$SECONDS status verdict=passed
  echo "== $name (limit $limit s): $name.log in $out/logs.tar.gz"
  timeout --kill-after=10 "$limit" "$@" > "$logs/$name.log" 2>&1
  status=$?
  if { [ $status -eq 124 ] || [ $status -eq 137 ]; } && [ "$limit" -lt "$cap" ]; then
    # The budget ran out, not the stage's own limit: what it did not finish was not reached, not failed.
    verdict="NOT REACHED (budget out at $limit s)"
    unreached=1
  elif [ $status -eq 124 ] || [ $status -eq 137 ]; then
    verdict="TIMED OUT after $limit s"
    failed=1
  elif [ $status -ne 0 ]; then
    verdict="FAILED (exit $status)"
    failed=1
  fi
  note "$(printf '%-9s %-30s %5d s  %s' "$name" "$verdict" "$((SECONDS - start))" "$name.log")"
  # What a reader needs first, without opening the log.
  case $name in
    build) grep -E "^-- dpar: " "$logs/$name.log" | sed 's/^-- /          /' | tee -a "$summary" ;;
    test | suite)
      { grep -E "tests passed|\*\*\*(Timeout|Failed|Exception)|SEGFAULT|Subprocess aborted|Not Run|\(Failed\)" \
          "$logs/$name.log"
        echo "tests skipped: $(grep -c '\*\*\*Skipped' "$logs/$name-ctest.log" 2>/dev/null) (listed in the log)"; } |
        sed 's/^/          /' | tee -a "$summary" ;;
    fmnist | cnn) grep -E "^(dpar|epoch +10|.*accuracy|.*wall)" "$logs/$name.log" | tail -6 | sed 's/^/          /' |
              tee -a "$summary" ;;
    bench-cnn) grep -E "^    (dpar|PyTorch), cuda" "$logs/$name.log" | sed 's/^/      /' | tee -a "$summary" ;;
    profile) grep -E "^(====|[0-9]+ kernel launches)" "$logs/$name.log" | sed 's/^/          /' | tee -a "$summary" ;;
    memcheck | racecheck)
      { grep -E "^== .*(: (exit|timed out|not reached)|passed$)|ERROR SUMMARY: [1-9]" "$logs/$name.log"
        # The programs the stage did not get to (sanitize names each as it starts and as it ends).
        local t
        for t in $(sanitized_tests "$name"); do
          grep -q "^== $t: " "$logs/$name.log" || echo "== $t: not reached"
        done; } | sed 's/^/          /' | tee -a "$summary" ;;
  esac
  pack
}

stage_build() {
  # DEVICE_CMAKE_ARGS is a list of -D flags; it is split on purpose. The GPU tests get a 60 s limit each. CMake's
  # "dpar: " lines name the CUDA, cuBLAS, NCCL and DLPack it found.
  # A development package unpacked for this machine may link to a runtime library of another version than the
  # machine's own: Debian 12's libz.so points at /lib/x86_64-linux-gnu/libz.so.1.2.13 by absolute path, which a
  # machine with another zlib lacks, and CMake would then find no zlib. Where that link dangles, the machine's own
  # libz.so.1 is linked instead (same ABI; the carried headers are zlib 1.2.13's).
  #
  # MPI: the GPU machines have OpenMPI's runtime (mpirun, libmpi.so.40) but neither its headers nor its compiler
  # wrapper. With Debian's headers carried (libopenmpi-dev, OpenMPI 4.1, the same libmpi.so.40 ABI), CMake is
  # pointed at them and at the machine's own libmpi, so that the multi-process GPU tests (the transport each
  # process pair takes, and the fallback through host memory when processes share a GPU) build and run.
  # If that configuration or its build fails, the check goes on without MPI rather than without a build.
  local extra=() mpi=() prefix
  for prefix in $(echo "${DEVICE_CMAKE_ARGS:-}" | sed -n 's/.*-DCMAKE_PREFIX_PATH=\([^ ]*\).*/\1/p' | tr ';' ' '); do
    local zlib="$prefix/lib/x86_64-linux-gnu/libz.so" runtime
    if [ -L "$zlib" ] && [ ! -e "$zlib" ]; then
      runtime=$(ldconfig -p 2>/dev/null | awk '$1 == "libz.so.1" && /x86-64/ {print $NF; exit}')
      [ -n "$runtime" ] && extra+=(-DZLIB_LIBRARY="$runtime") && echo "-- zlib: $zlib dangles; linking $runtime"
    fi
    local mpi_include="$prefix/lib/x86_64-linux-gnu/openmpi/include" libmpi
    if [ -f "$mpi_include/mpi.h" ] && ! command -v mpicc > /dev/null; then
      libmpi=$(ldconfig -p 2>/dev/null | awk '$1 == "libmpi.so.40" && /x86-64/ {print $NF; exit}')
      if [ -n "$libmpi" ]; then
        mpi=(-DMPI_SKIP_COMPILER_WRAPPER=ON -DMPI_C_HEADER_DIR="$mpi_include" -DMPI_C_LIB_NAMES=mpi
             -DMPI_mpi_LIBRARY="$libmpi")
        echo "-- MPI: the carried headers ($mpi_include) with this machine's $libmpi"
      fi
    fi
  done
  configure() {
    # shellcheck disable=SC2086
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDPAR_WITH_CUDA=ON -DDPAR_CUDA_TEST_TIMEOUT=60 \
      ${DEVICE_CMAKE_ARGS:-} "${extra[@]}" "$@"
  }
  without_mpi() {
    echo "-- $1 with the carried MPI headers: again without MPI (the multi-process GPU tests will be missing)"
    rm -rf "$build"
    mpi=()
    configure -DDPAR_WITH_MPI=OFF
  }
  if ! configure "${mpi[@]}"; then
    [ ${#mpi[@]} -gt 0 ] || return 1
    without_mpi "configuring failed" || return 1
  fi
  # The libraries found must load here: Debian's oneDNN needs libOpenCL.so.1 (ocl-icd-libopencl1), which a
  # machine with only NVIDIA's driver may lack. Said now, before minutes of building end in a link error.
  local lib missing
  for lib in $(sed -n 's/^\(DNNL_LIBRARY\|NCCL_LIBRARY\):FILEPATH=//p' "$build/CMakeCache.txt"); do
    missing=$(ldd "$lib" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
    if [ -n "$missing" ]; then
      echo "-- $lib needs $missing which this machine lacks (carry it: DEVCARRY_EXTRA_DEBS=" \
           "\"ocl-icd-libopencl1 libopenmpi-dev\" bash ../shared/device/prepare.sh)"
      return 1
    fi
  done
  if ! cmake --build "$build" -j "$(nproc)"; then
    [ ${#mpi[@]} -gt 0 ] || return 1
    without_mpi "the build failed" && cmake --build "$build" -j "$(nproc)"
  fi
}

stage_test() {
  local status=0 jobs=()
  # Exclusive_Process or Prohibited: one process at a time can use the GPU, so one test at a time.
  [ "$compute_mode" = Default ] && jobs=(-j 4)
  echo "compute mode: ${compute_mode:-unknown}; ctest ${jobs[*]:-(one test at a time)}"
  # With a GPU visible, a GPU test that finds none has found a fault (tests/require_gpu.h).
  [ -n "$compute_mode" ] && export DPAR_TEST_REQUIRE_GPU=1
  ctest --test-dir "$build" -L cuda "${jobs[@]}" --output-on-failure > "$logs/test-ctest.log" 2>&1 || status=1
  cat "$logs/test-ctest.log"
  skipped "$logs/test-ctest.log"
  return $status
}

# The rest of the suite, whose tests take GPU branches too where a GPU is present: last, because the build
# machine and CI run it as well, and a GPU's minutes go first to what only a GPU can run.
stage_suite() {
  local status=0 jobs=()
  [ "$compute_mode" = Default ] && jobs=(-j 8)
  echo "compute mode: ${compute_mode:-unknown}; ctest ${jobs[*]:-(one test at a time)}"
  [ -n "$compute_mode" ] && export DPAR_TEST_REQUIRE_GPU=1
  # dpar beside the machine's PyTorch (CUDA tensors by DLPack, NCCL found both ways), unless one was named already.
  if [ -z "${DPAR_TEST_TORCH_PYTHON:-}" ] &&
     python3 -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    export DPAR_TEST_TORCH_PYTHON=$(command -v python3)
  fi
  ctest --test-dir "$build" -LE cuda "${jobs[@]}" --output-on-failure > "$logs/suite-ctest.log" 2>&1 || status=1
  cat "$logs/suite-ctest.log"
  skipped "$logs/suite-ctest.log"
  return $status
}

# CTest counts a test that printed [  SKIPPED ] as skipped: on a GPU machine each is listed, with why.
skipped() {
  echo "== tests that skipped here (each says why in its output above):"
  grep -E "\*\*\*Skipped|Skipped$" "$1" || echo "   none"
}

stage_fmnist() {
  mkdir -p "$logs/traces"
  local start=$SECONDS
  "$build/examples/c/train_fashion_mnist" --device cuda --data "$data" --epochs 10 --min-accuracy 88 \
    --trace "$logs/traces/fmnist-epoch1.json" || return 1
  echo "wall time, 10 epochs on cuda: $((SECONDS - start)) s"
}

stage_cnn() {
  local start=$SECONDS status=0
  "$build/examples/c/train_fashion_mnist_cnn" --device cuda --data "$data" --epochs 10 --min-accuracy 92 || status=1
  echo "wall time, 10 epochs of the CNN on cuda: $((SECONDS - start)) s"
  start=$SECONDS
  "$build/examples/c/train_fashion_mnist_cnn" --device cuda --devices 2 --sync-batchnorm --data "$data" --epochs 2 \
    --steps-per-epoch 100 --min-accuracy 84 || status=1
  echo "wall time, 2 short epochs, 2 replicas on cuda:0 with SyncBatchNorm: $((SECONDS - start)) s"
  # Two processes sharing the GPU (their SyncBatchNorm sums through MPI), when MPI was built.
  if command -v mpirun > /dev/null && grep -q "^DPAR_HAVE_MPI:INTERNAL=ON\|^DPAR_WITH_MPI:BOOL=ON" "$build/CMakeCache.txt"; then
    start=$SECONDS
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe --mca btl self,vader -np 2 \
      "$build/examples/c/train_fashion_mnist_cnn" --device cuda --sync-batchnorm --data "$data" --epochs 2 \
      --steps-per-epoch 100 --min-accuracy 84 || status=1
    echo "wall time, 2 short epochs over 2 processes on cuda:0 with SyncBatchNorm: $((SECONDS - start)) s"
  fi
  return $status
}

stage_bench_cnn() {
  local status=0 batch
  for batch in 128 512; do
    echo "==== the Fashion-MNIST CNN, batch $batch"
    "$build/bench/bench_cnn" --device cuda --batch "$batch" --rounds 2 --seconds 1 || status=1
  done
  return $status
}

# The same training on this machine's CPU cores, for the wall time beside the GPU's.
stage_fmnist_cpu() {
  local start=$SECONDS
  "$build/examples/c/train_fashion_mnist" --device cpu --data "$data" --epochs 10 --min-accuracy 88 || return 1
  echo "wall time, 10 epochs on the CPU ($(nproc) cores): $((SECONDS - start)) s"
}

stage_bench() {
  local status=0 torch_ok=0
  python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && torch_ok=1
  [ $torch_ok -eq 1 ] || echo "torch_anchor.py: no PyTorch with CUDA here; dpar's figures and cuBLAS alone"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || true
  for config in "demo 128" "wide 8192"; do
    set -- $config
    local model=$1 batch=$2 tag="$1-$2"
    echo "==== $model MLP, batch $batch"
    "$build/bench/bench_cuda_gemms" --only "$model" --batches "$batch" --json "$logs/gemms-$tag.json" || status=1
    if [ $torch_ok -eq 1 ]; then
      python3 "$root/bench/torch_anchor.py" --only "$model" --batches "$batch" --steps 30 --blocks 3 \
        --json "$logs/torch-$tag.json" || status=1
    fi
    local anchors=()
    [ -s "$logs/torch-$tag.json" ] && anchors+=(--torch "$logs/torch-$tag.json")
    [ -s "$logs/gemms-$tag.json" ] && anchors+=(--gemms "$logs/gemms-$tag.json")
    mkdir -p "$logs/traces"
    "$build/bench/bench_cuda_train" --only "$model" --batches "$batch" --steps 30 --blocks 3 \
      --json "$logs/dpar-$tag.json" --trace "$logs/traces" "${anchors[@]}" || status=1
  done
  return $status
}

# Each kernel's GPU time (ncu, one pass per kernel), summed per kernel name: a few steps of each program, the first
# launches included (the same kernels every step).
stage_profile() {
  local status=0 ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [ -x "$ncu" ] || { echo "no ncu (Nsight Compute) on this machine"; return 1; }
  echo "==== wide MLP, batch 8192: 2 steps after 10 warm-up steps"
  "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --launch-skip 200 --launch-count 300 \
    "$build/bench/bench_cuda_train" --only wide --batches 8192 --steps 2 --blocks 1 > "$logs/profile-wide.csv" 2>&1 ||
    status=1
  python3 "$root/scripts/kernel_times.py" "$logs/profile-wide.csv" || status=1
  echo "==== the Fashion-MNIST CNN, batch 512"
  "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --launch-skip 300 --launch-count 400 \
    "$build/bench/bench_cnn" --device cuda --batch 512 --rounds 1 --seconds 0.1 --torch /nonexistent \
    > "$logs/profile-cnn.csv" 2>&1 || status=1
  python3 "$root/scripts/kernel_times.py" "$logs/profile-cnn.csv" || status=1
  return $status
}

# The programs `sanitize TOOL` runs, in order.
sanitized_tests() {
  # DPAR_GPU_SANITIZE_PROGRAMS (a list of test programs) replaces the list below, e.g. to go on where a cut-short
  # run stopped. The newest kernels first: the budget may cut the list short.
  if [ -n "${DPAR_GPU_SANITIZE_PROGRAMS:-}" ]; then
    echo "$DPAR_GPU_SANITIZE_PROGRAMS"
    return
  fi
  if [ "$1" = racecheck ]; then
    echo test_cuda_norm test_cuda_cudnn test_cuda_kernels
  else
    echo test_cuda_bf16 test_cuda_norm test_cuda_cudnn test_cuda_kernels test_cuda_engine
  fi
}

# sanitize TOOL: dpar's own kernel and engine tests under compute-sanitizer; a report or a failed test fails it.
# Each test runs as a process of its own under a limit of its own (60 s), so that one slow or hung under the tool
# is named and the others still run. Each program's start and end are logged ("== PROGRAM: ..."), so that one the
# budget cut off can be named.
sanitize() {
  local tool=$1 status=0 t rc one tests
  for t in $(sanitized_tests "$tool"); do
    if [ ! -x "$build/tests/$t" ]; then  # the build stage failed, or the program is not in this tree
      echo "== $t: exit (not built)"
      status=1
      continue
    fi
    echo "== compute-sanitizer --tool $tool $t"
    tests=$("$build/tests/$t" --gtest_list_tests 2>/dev/null |
            awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
    if [ -z "$tests" ]; then  # no list (the program did not start): run it whole
      compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 "$build/tests/$t"
      rc=$?
    else
      rc=0
      for one in $tests; do
        timeout --kill-after=5 60 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
          "$build/tests/$t" --gtest_filter="$one" > "$logs/$tool-$t-one.log" 2>&1
        local r=$?
        grep -E "ERROR SUMMARY|FAILED|Invalid|=========  " "$logs/$tool-$t-one.log" | head -40
        # A host-only test (no CUDA call) ends before the tool instruments anything, which it reports as exit 255.
        if [ $r -eq 255 ] && grep -q "terminated before first instrumented API call" "$logs/$tool-$t-one.log" &&
           grep -q "^\[  PASSED  \] 1 test" "$logs/$tool-$t-one.log"; then
          r=0
        fi
        case $r in
          0) echo "== $t $one: passed" ;;
          124 | 137) echo "== $t $one: timed out (60 s)"; rc=1 ;;
          *) echo "== $t $one: exit $r"; cat "$logs/$tool-$t-one.log" | tail -30; rc=1 ;;
        esac
      done
      rm -f "$logs/$tool-$t-one.log"
    fi
    if [ "$rc" -eq 0 ]; then echo "== $t: passed"; else echo "== $t: exit $rc"; status=1; fi
  done
  return $status
}

: > "$summary"
# The first GPU's compute mode (Default, Exclusive_Process, Prohibited); empty where nvidia-smi sees no GPU.
compute_mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '[:space:]')
{
  echo "dpar GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo 'NO GPU VISIBLE (nvidia-smi): the GPU tests and benchmarks below skip, and a skip is not a pass'
  if [ -n "$compute_mode" ]; then
    echo "compute mode: $compute_mode ($([ "$compute_mode" = Default ] && echo "tests in parallel" ||
      echo "one process at a time: tests run serially"))"
  fi
} | tee -a "$summary"
export root build data logs compute_mode
export -f stage_build stage_test stage_suite skipped stage_fmnist stage_fmnist_cpu stage_bench stage_cnn \
  stage_bench_cnn stage_profile sanitize sanitized_tests
for stage in "${stages[@]}"; do
  case $stage in
    build) run_stage build 180 bash -c stage_build ;;
    test) run_stage test 300 bash -c stage_test ;;
    fmnist) run_stage fmnist 90 bash -c stage_fmnist ;;
    bench) run_stage bench 120 bash -c stage_bench ;;
    cnn) run_stage cnn 120 bash -c stage_cnn ;;
    bench-cnn) run_stage bench-cnn 90 bash -c stage_bench_cnn ;;
    profile) run_stage profile 240 bash -c stage_profile ;;
    memcheck | racecheck) run_stage "$stage" 240 bash -c "sanitize $stage" ;;
    suite) run_stage suite 300 bash -c stage_suite ;;
    fmnist-cpu) run_stage fmnist-cpu 120 bash -c stage_fmnist_cpu ;;
    *) note "unknown stage '$stage' (build test fmnist cnn bench bench-cnn memcheck suite fmnist-cpu racecheck profile)"
       failed=1 ;;
  esac
done
note "total: $((SECONDS - started)) s of a $budget s budget"
pack
echo
echo "==== summary ($out/summary.txt; every log in $out/logs.tar.gz)"
cat "$summary"
[ $failed -eq 0 ] || exit 1
[ $unreached -eq 0 ] || exit 3
exit 0
