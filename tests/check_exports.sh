#!/usr/bin/env bash
# Checks libdpar.so's ABI surface against the public headers (the per-topic headers that dpar.h includes, and
# dpar_api.h):
#  - the SONAME is libdpar.so.0;
#  - every dynamic symbol the library defines starts with dpar_ (the version node DPAR_0 of the version script is
#    not a symbol of the API and is the only exception);
#  - every function declared DPAR_API in the headers given is exported as a function, and every exported dpar_
#    symbol is declared in one of them.
# Usage: check_exports.sh <libdpar.so> <header>... Prints every problem and exits 1 if there is any.
set -u -o pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 <libdpar.so> <header>..." >&2
  exit 2
fi
lib=$1
headers=("${@:2}")
header=${headers[*]}
for tool in readelf nm; do
  command -v "$tool" >/dev/null || { echo "check_exports: $tool is not installed" >&2; exit 2; }
done
[[ -f $lib ]] || { echo "check_exports: no library at $lib" >&2; exit 2; }
for h in "${headers[@]}"; do
  [[ -f $h ]] || { echo "check_exports: no header at $h" >&2; exit 2; }
done

problems=0
problem() {
  echo "check_exports: $*" >&2
  problems=$((problems + 1))
}

# 1. SONAME.
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
if [[ $soname != "libdpar.so.0" ]]; then
  problem "SONAME is '${soname:-<none>}', expected 'libdpar.so.0'"
fi

# 2. Defined dynamic symbols. Version definitions (other than the BASE one, the SONAME) appear as absolute
# symbols, e.g. "0000000000000000 A DPAR_0": they are not part of the API and are skipped.
mapfile -t version_nodes < <(readelf -V --wide "$lib" |
  sed -n '/\.gnu\.version_d/,/^$/{/Flags: BASE/d;s/.*Name: \([^[:space:]]*\).*/\1/p}')
is_version_node() {
  local n
  for n in "${version_nodes[@]}"; do [[ $n == "$1" ]] && return 0; done
  return 1
}

declare -A exported=()      # name -> nm type letter
if ! nm_out=$(nm -D --defined-only "$lib"); then
  problem "nm -D --defined-only $lib failed"
  nm_out=""
fi
while read -r _addr type name; do
  [[ -z ${name:-} ]] && continue
  name=${name%%@*}  # strip @@DPAR_0 / @DPAR_0
  if [[ $type == A ]] && is_version_node "$name"; then continue; fi
  if [[ $name != dpar_* ]]; then
    problem "exports '$name' (type $type), which does not start with dpar_"
    continue
  fi
  exported[$name]=$type
done <<<"$nm_out"

if [[ ${#exported[@]} -eq 0 ]]; then
  problem "the library exports no dpar_ symbol at all"
fi

# 3. Functions declared in the header: "DPAR_API <return type> dpar_name(". A declaration's name and its '('
# are on the DPAR_API line in the headers; the preprocessor definitions of DPAR_API itself are skipped.
mapfile -t declared < <(grep -hE '^[[:space:]]*DPAR_API[[:space:]]' "${headers[@]}" |
  grep -oE '\bdpar_[A-Za-z0-9_]+[[:space:]]*\(' | sed -E 's/[[:space:]]*\($//' | sort -u)
if [[ ${#declared[@]} -eq 0 ]]; then
  problem "found no DPAR_API function declaration in $header"
fi
# Every DPAR_API line must have yielded one name: a declaration this script cannot read is a problem too.
api_lines=$(cat "${headers[@]}" | grep -cE '^[[:space:]]*DPAR_API[[:space:]]')
if [[ $api_lines -ne ${#declared[@]} ]]; then
  problem "$header has $api_lines DPAR_API declarations but $((${#declared[@]})) distinct dpar_ function names" \
          "were read from them (a duplicate, or a declaration whose name is not on its DPAR_API line)"
fi

declare -A in_header=()
for f in "${declared[@]}"; do
  in_header[$f]=1
  if [[ -z ${exported[$f]:-} ]]; then
    problem "'$f' is declared in $header but not exported by $(basename "$lib")"
  elif [[ ${exported[$f]} != T ]]; then
    problem "'$f' is exported as a symbol of type ${exported[$f]}, not as a function (T)"
  fi
done
for s in "${!exported[@]}"; do
  if [[ -z ${in_header[$s]:-} ]]; then
    problem "'$s' is exported by $(basename "$lib") but not declared in $header"
  fi
done

if [[ $problems -ne 0 ]]; then
  echo "check_exports: $problems problem(s) in $lib" >&2
  exit 1
fi
echo "check_exports: OK: SONAME $soname, ${#declared[@]} functions declared and exported, nothing else exported"
exit 0
