#!/usr/bin/env bash
# The Go module as a user outside this tree gets it: dpar installed into a temporary prefix, bindings/go copied to a
# temporary directory, and a new module that requires dpar.dev/go with a replace directive to the copy. It builds
# offline (GOPROXY=off), with a build cache of its own, and with nothing on the PATH but go, the C compiler and
# pkg-config (no SWIG: the raw layer's generated files are committed); pkg-config finds the installed dpar.pc. The
# new module's main.go is the complete example of bindings/go/README.md, which must be examples/checkpoint/main.go
# word for word: it trains, evaluates, saves and reloads a checkpoint. Then the copy's own tests pass.
#   check_go_module.sh <build dir> <source dir> <go> <pkg-config>
set -euo pipefail
build=$1 src=$2 go=$3 pkgconfig=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
pc=$(ls "$tmp"/prefix/lib*/pkgconfig/dpar.pc)

mkdir -p "$tmp/src" "$tmp/bin"
cp -R "$src/bindings/go" "$tmp/src/dpar-go"
if find "$tmp/src/dpar-go" -name '*.swig' -o -name '*.swigcxx' | grep .; then
  echo "the Go module has a file that go build would run SWIG on" >&2
  exit 1
fi
for tool in gcc cc as ld; do ln -s "$(command -v "$tool")" "$tmp/bin/$tool"; done
ln -s "$go" "$tmp/bin/go"
ln -s "$pkgconfig" "$tmp/bin/pkg-config"

mkdir "$tmp/src/user"
cat >"$tmp/src/user/go.mod" <<MOD
module example.com/user

go 1.19

require dpar.dev/go v0.6.0

replace dpar.dev/go => ../dpar-go
MOD
# The README's complete example: the go block that is a whole program.
awk '/^```go$/ { block = ""; inside = 1; next }
     /^```$/ && inside { inside = 0; if (block ~ /\npackage main\n/ || block ~ /^package main\n/) { printf "%s", block; exit } next }
     inside { block = block $0 "\n" }' "$src/bindings/go/README.md" >"$tmp/src/user/main.go"
if ! diff -u "$src/bindings/go/examples/checkpoint/main.go" "$tmp/src/user/main.go"; then
  echo "bindings/go/README.md's example is not bindings/go/examples/checkpoint/main.go" >&2
  exit 1
fi

# Nothing but PKG_CONFIG_PATH: the installed dpar.pc gives the program its run path to the prefix's lib directory.
# The PATH has no ssh: a test run without mpirun (NewMPIComm) starts MPI as a singleton, which dpar starts with Open
# MPI's isolated launcher (tests/mpi/check_singleton_without_ssh.sh).
libdir=$(realpath "$(PKG_CONFIG_PATH=$(dirname "$pc") "$pkgconfig" --variable=libdir dpar)")
user_env=(env -i PATH="$tmp/bin" HOME="$tmp/home" GOPATH="$tmp/gopath" GOCACHE="$tmp/gocache" GOPROXY=off
          GOFLAGS= PKG_CONFIG_PATH="$(dirname "$pc")")
out=$(cd "$tmp/src/user" && "${user_env[@]}" go run .)
echo "$out"
grep -q "^first step's loss: [0-9.]*$" <<<"$out"
grep -q '^accuracy: 100%$' <<<"$out"
grep -q '^reloaded at step 100, predicts the same: true$' <<<"$out"
# The user's binary runs against the installed library.
(cd "$tmp/src/user" && "${user_env[@]}" go build -o "$tmp/user-program" .)
loaded=$(ldd "$tmp/user-program" | sed -n 's/^\s*libdpar\.so\.0 => \(\S*\) .*/\1/p')
test "$(realpath "$loaded")" = "$(realpath "$libdir/libdpar.so.0")"

(cd "$tmp/src/dpar-go" && "${user_env[@]}" go test ./...)
echo "go: the module copied to $tmp/src/dpar-go builds and trains against dpar installed in $tmp/prefix"
