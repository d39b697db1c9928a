#!/usr/bin/env bash
# Every CUDA kernel of dpar declares the block size it is launched with (__launch_bounds__), and fits it in
# registers in a debug (-G) build as in an optimised one. Without the bound, ptxas may give a kernel more registers
# than a block of its threads can have (65,536 per block on every GPU dpar builds for: 64 per thread at 1024
# threads), and every launch of it fails with "too many resources requested for launch"; -G, which keeps every
# variable in its own register, is where that happens first.
#
#   check_cuda_launch_bounds.sh NVCC SOURCE_DIR ARCH [EXTRA NVCC FLAGS...]
#
# Compiles each src/kernels/cuda/*.cu of SOURCE_DIR to PTX (-G, then -O3) and assembles it with ptxas for sm_ARCH,
# reading each kernel's .maxntid from the PTX and its registers from ptxas. Fails, naming the kernel, when a
# kernel has no bound or needs more registers than its bound's block may have.
set -u -o pipefail
if [ $# -lt 3 ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
nvcc=$1 src=$2 arch=$3
shift 3
ptxas=$(dirname "$nvcc")/ptxas
[ -x "$ptxas" ] || ptxas=ptxas
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
kernels=0
for cu in "$src"/src/kernels/cuda/*.cu; do
  base=$(basename "$cu" .cu)
  for mode in -G -O3; do
    ptx="$work/$base$mode.ptx"
    if ! "$nvcc" -ptx "$mode" -arch="compute_$arch" -std=c++17 --fmad=false -I"$src/src" -I"$src/include" "$@" "$cu" -o "$ptx" \
         2>"$work/nvcc.log"; then
      echo "check_cuda_launch_bounds: $base.cu ($mode) does not compile:" >&2
      cat "$work/nvcc.log" >&2
      status=1
      continue
    fi
    ptxas_debug=()
    [ "$mode" = -G ] && ptxas_debug=(-g)
    if ! "$ptxas" -arch="sm_$arch" -v "${ptxas_debug[@]}" "$ptx" -o "$work/$base.cubin" 2>"$work/ptxas.log"; then
      echo "check_cuda_launch_bounds: ptxas failed on $base.cu ($mode):" >&2
      cat "$work/ptxas.log" >&2
      status=1
      continue
    fi
    # entry name -> .maxntid (x*y*z), from the PTX; entry name -> registers, from ptxas.
    report=$(awk '
      FNR == NR {
        if (match($0, /\.entry[ \t]+[A-Za-z0-9_$]+/)) { name = substr($0, RSTART, RLENGTH); sub(/\.entry[ \t]+/, "", name); bound[name] = 0; order[++n] = name; current = name }
        if (current != "" && match($0, /\.maxntid[ \t]+[0-9]+(, *[0-9]+)*(, *[0-9]+)*/)) {
          spec = substr($0, RSTART, RLENGTH); sub(/\.maxntid[ \t]+/, "", spec)
          k = split(spec, d, /, */); t = 1; for (i = 1; i <= k; ++i) t *= d[i]; bound[current] = t
        }
        if (index($0, "{") > 0) current = ""
        next
      }
      /Compiling entry function/ { if (match($0, /'"'"'[^'"'"']+'"'"'/)) { fn = substr($0, RSTART + 1, RLENGTH - 2) } }
      /Used [0-9]+ registers/ { if (fn != "" && match($0, /Used [0-9]+ registers/)) { r = substr($0, RSTART + 5, RLENGTH - 15); regs[fn] = r + 0; fn = "" } }
      END {
        for (i = 1; i <= n; ++i) { e = order[i]; printf "%s %d %d\n", e, bound[e], (e in regs) ? regs[e] : -1 }
      }' "$ptx" "$work/ptxas.log")
    while read -r name threads regs; do
      [ -n "$name" ] || continue
      kernels=$((kernels + 1))
      if [ "$threads" -eq 0 ]; then
        echo "check_cuda_launch_bounds: $base.cu: kernel $name has no __launch_bounds__" >&2
        status=1
      elif [ "$regs" -lt 0 ]; then
        echo "check_cuda_launch_bounds: $base.cu ($mode): ptxas reported no register count for $name" >&2
        status=1
      elif [ $((regs * threads)) -gt 65536 ]; then
        echo "check_cuda_launch_bounds: $base.cu ($mode): $name uses $regs registers x $threads threads > 65536" >&2
        status=1
      else
        printf '%-4s %-12s %4d threads %3d registers  %s\n' "$mode" "$base.cu" "$threads" "$regs" "$name"
      fi
    done <<< "$report"
  done
done
if [ "$kernels" -eq 0 ]; then
  echo "check_cuda_launch_bounds: no kernel found under $src/src/kernels/cuda" >&2
  status=1
fi
exit $status
