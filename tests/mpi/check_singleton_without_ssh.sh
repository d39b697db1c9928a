#!/usr/bin/env bash
# A program that uses MPI without mpirun, on a machine without ssh or rsh on the PATH, runs as a job of one process:
# Open MPI's default launcher would want one of them to start its run-time daemon and kill the process inside
# MPI_Init_thread; dpar starts a singleton with the isolated launcher instead. Runs PROGRAM ARGS... with a PATH of
# every command of /usr/bin and /bin but ssh, rsh and slogin, and OMPI_MCA_plm unset.
# Usage: check_singleton_without_ssh.sh PROGRAM [ARGS...]
set -euo pipefail
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
for dir in /usr/bin /bin; do  # /bin is /usr/bin on a merged-/usr system: the first link of a name wins
  for f in "$dir"/*; do printf '%s\n' "$f"; done
done | awk -F/ '$NF !~ /^(ssh|rsh|slogin)$/ && !seen[$NF]++' | xargs -d '\n' ln -s -t "$bin"
! PATH=$bin command -v ssh > /dev/null || { echo "ssh is still on the PATH"; exit 1; }
env -u OMPI_MCA_plm PATH="$bin" "$@"
