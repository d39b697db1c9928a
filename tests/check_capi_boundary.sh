#!/usr/bin/env bash
# Only src/capi/ knows that a C caller exists: no other file under src/ includes dpar.h or dpar/*.h, nor names
# anything they declare (a status such as DPAR_ERR_IO, a type such as dpar_status, a function such as
# dpar_engine_abort), not even in a comment or a message. The core has its own codes (common/status.h, DType,
# DeviceKind, Fault) and src/capi/codes.h converts. The names are read from the public headers themselves (their
# code, not their comments), so a name added to dpar.h is checked too. Usage: check_capi_boundary.sh <source root>
set -u -o pipefail
root=$1
names=$(mktemp)
trap 'rm -f "$names"' EXIT

# Every dpar_/DPAR_ identifier in the public headers' code, comments stripped.
perl -0777 -ne 's{/\*.*?\*/}{}gs; s{//[^\n]*}{}g; print "$1\n" while /\b((?:dpar|DPAR)_\w+)\b/g' \
  "$root/include/dpar.h" "$root"/include/dpar/*.h | sort -u >"$names"
for expected in DPAR_OK DPAR_ERR_INTERNAL dpar_status DPAR_F32 DPAR_DEVICE_CPU DPAR_FAULT_NONE dpar_engine_create; do
  if ! grep -qx "$expected" "$names"; then
    echo "FAIL: $expected was not found in include/dpar.h or include/dpar/*.h: this check reads them wrongly"
    exit 1
  fi
done

core_files() { find "$root/src" -path "$root/src/capi" -prune -o -type f -print; }

includes=$(core_files | xargs grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](dpar\.h|dpar/)' 2>/dev/null)
uses=$(core_files | xargs grep -nwF -f "$names" 2>/dev/null)
if [ -n "$includes" ] || [ -n "$uses" ]; then
  echo "FAIL: files under src/ outside src/capi/ know the C API (use the core's codes: common/status.h, DType,"
  echo "DeviceKind, Fault; src/capi/codes.h converts):"
  [ -n "$includes" ] && echo "$includes"
  [ -n "$uses" ] && echo "$uses"
  exit 1
fi
echo "ok: nothing under src/ outside src/capi/ includes dpar.h or names one of its $(wc -l <"$names") C names"
