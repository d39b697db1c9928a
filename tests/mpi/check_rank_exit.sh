#!/usr/bin/env bash
# A rank that exits in the middle of a run, without MPI_Finalize: every other rank must get an error (TIMEOUT, or
# COMMUNICATION if MPI notices first) from its next collective within the 1 s timeout, instead of hanging.
#
#   check_rank_exit.sh MPIEXEC TEST_MPI_COMM [NP=3]
#
# mpirun's own status is nonzero after such an exit, so this checks the survivors' lines instead. By default mpirun
# kills the whole job as soon as a rank exits without MPI_Finalize; --enable-recovery keeps the survivors alive, so
# that they show what dpar does on a launcher that does not kill them.
set -u
mpiexec=$1
prog=$2
np=${3:-3}
out=$(timeout 120 "$mpiexec" --oversubscribe --mca btl self,vader --enable-recovery -np "$np" "$prog" --rank-exit 2>&1)
status=$?
printf '%s\n' "$out"
echo "(mpirun's status: $status)"
if [ "$status" -eq 124 ]; then
  echo "FAIL: the run did not end within 120 s"
  exit 1
fi
failed=0
for ((r = 0; r < np; ++r)); do
  [ "$r" -eq 1 ] && continue
  if ! grep -q "^rank $r: SURVIVOR OK" <<<"$out"; then
    echo "FAIL: rank $r did not report SURVIVOR OK"
    failed=1
  fi
done
if ! grep -q "rank 1 did not arrive" <<<"$out"; then
  echo "FAIL: no survivor named rank 1 as the rank that did not arrive"
  failed=1
fi
[ "$failed" -eq 0 ] && echo "PASS: the survivors got their error within the timeout"
exit "$failed"
