#!/usr/bin/env bash
# The layers of src/ include only downward:
#  - kernels (src/kernels), communicators (src/comm) and the CUDA platform layer (src/platform) include nothing
#    from src/backend/, so that a kernel or a transport builds and is reasoned about without knowing which backend
#    drives it;
#  - src/common/, the bottom, includes only src/common/ (and the system's and third parties' headers);
#  - the reducer (src/reducer) reaches communication through the replica set (src/collectives), never a
#    communicator of src/comm/.
# Usage: check_include_layers.sh <source root>
set -u -o pipefail
root=$1

for dir in kernels comm platform common reducer; do
  if [ ! -d "$root/src/$dir" ]; then
    echo "FAIL: $root/src/$dir is not a directory: this check looks in the wrong place"
    exit 1
  fi
done

# The #include lines of the files under $1 (file:line:text) whose header matches the extended regular expression
# $2, which starts with the opening " or <.
includes() { grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*$2" "$1" 2>/dev/null; }

failed=0
report() {  # report <what is wrong> <the offending lines>
  [ -z "$2" ] && return
  echo "FAIL: $1:"
  echo "$2"
  failed=1
}

report "files below src/backend/ include it (move what they need down, e.g. into src/platform/)" \
  "$(includes "$root/src/kernels" '"backend/'; includes "$root/src/comm" '"backend/';
     includes "$root/src/platform" '"backend/')"

# Every directory of src/ but common/, as an alternation: a <dir/...> include names one as well as a "dir/..." one.
others=$(find "$root/src" -mindepth 1 -maxdepth 1 -type d ! -name common -printf '%f\n' | sort | paste -sd'|')
report "files of src/common/ include from outside it (move what they need into common/, or invert the dependency)" \
  "$(includes "$root/src/common" '"' | grep -vE 'include[[:space:]]*"common/';
     includes "$root/src/common" "<($others)/")"

report "files of src/reducer/ include a communicator (reach communication through collectives/replica_set.h)" \
  "$(includes "$root/src/reducer" '[<"]comm/')"

[ "$failed" = 0 ] || exit 1
echo "ok: nothing under src/kernels, src/comm or src/platform includes backend/; src/common/ includes only common/;" \
  "src/reducer/ includes nothing from comm/"
