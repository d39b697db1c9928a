#!/usr/bin/env bash
# The Rust crates against an installed dpar, found the way Cargo users find a native library:
#   1. installs the build into a temporary prefix (dpar.pc's prefix line rewritten to it, as a packager would);
#   2. two fresh Cargo projects outside the tree, one depending on the crates by path (a copy of bindings/rust) and
#      one by git (a file:// repository of that copy), each with bindings/rust/dpar's README example as its
#      program and the README's build.rs, are built with PKG_CONFIG_PATH alone (no DPAR_LIB_DIR, no dpar checkout
#      around the copies); each program must train, evaluate, save and reload, run without LD_LIBRARY_PATH, and
#      load the prefix's libdpar;
#   3. `cargo package --workspace` packages both crates and verifies them by building the packages (dpar against
#      the packaged dpar-sys), against the same prefix.
#   check_rust_install.sh <cargo> <build dir> <source dir>
set -euo pipefail
cargo=$1 build=$2 src=$3
crates=$src/bindings/rust
example=$crates/dpar/examples/train_evaluate_checkpoint.rs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset DPAR_LIB_DIR LD_LIBRARY_PATH CARGO_TARGET_DIR RUSTFLAGS

# The README shows the example in full: its rust block after "## A complete example" is the file, line for line.
awk '/^## A complete example/ {on = 1} on && /^```$/ && inside {exit} inside {print} on && /^```rust$/ {inside = 1}' \
    "$crates/dpar/README.md" > "$tmp/readme_example.rs"
if ! diff -u "$example" "$tmp/readme_example.rs"; then
  echo "FAIL: bindings/rust/dpar/README.md's complete example differs from $example" >&2
  exit 1
fi

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
pc=$(ls "$tmp"/prefix/lib*/pkgconfig/dpar.pc)
export PKG_CONFIG_PATH=$(dirname "$pc")
libdir=$(realpath "$(pkg-config --variable=libdir dpar)")

# The crates as a user gets them: the files alone (symbolic links followed), nothing built, no dpar tree around.
mkdir -p "$tmp/crates"
tar -C "$crates" --exclude=./target --exclude=./Cargo.lock -chf - . | tar -C "$tmp/crates" -xf -
cp -r "$tmp/crates" "$tmp/repo"
git -C "$tmp/repo" init -q
git -C "$tmp/repo" add -A
git -C "$tmp/repo" -c user.name=dpar -c user.email=dev@dpar.dev commit -qm "dpar's Rust crates"

# A fresh project: the README's example as its program, the README's build.rs for the run path.
#   new_project <dir> <where dpar comes from> <where dpar-sys comes from>   (path = "..." or git = "...")
new_project() {
  mkdir -p "$1/src"
  cp "$example" "$1/src/main.rs"
  cat > "$1/Cargo.toml" <<EOF
[package]
name = "uses_dpar"
version = "0.1.0"
edition = "2021"

[dependencies]
dpar = { $2 }
dpar-sys = { $3 }
EOF
  cat > "$1/build.rs" <<'EOF'
fn main() {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", std::env::var("DEP_DPAR_LIB_DIR").unwrap());
}
EOF
}

# Runs the project's program with nothing set and checks what it printed and which libdpar it loaded.
check_program() {
  local program=$1/target/debug/uses_dpar
  "$program" | tee "$1/out.txt"
  grep -q '^reloaded at step 100: ' "$1/out.txt"
  grep -q '^step 101 ' "$1/out.txt"
  # ldd's whole output first: grep -q stops reading at its match, and pipefail would fail on ldd's SIGPIPE.
  local libs
  libs=$(ldd "$program")
  grep -q "libdpar.so.0 => $libdir/libdpar.so.0" <<<"$libs" ||
    { echo "FAIL: $program does not load $libdir's libdpar:" >&2; echo "$libs" >&2; exit 1; }
}

echo "== by path"
new_project "$tmp/by_path" "path = \"$tmp/crates/dpar\"" "path = \"$tmp/crates/dpar-sys\""
(cd "$tmp/by_path" && "$cargo" build --offline -q)
check_program "$tmp/by_path"

echo "== by git"
new_project "$tmp/by_git" "git = \"file://$tmp/repo\"" "git = \"file://$tmp/repo\""
# Cargo's --offline refuses every git source, file:// included. The project has no registry dependency, so
# without it nothing is downloaded either: the only source cargo reads is the local repository. Its own
# CARGO_HOME keeps the checkout out of the user's.
(cd "$tmp/by_git" && CARGO_HOME=$tmp/cargo_home "$cargo" build -q)
check_program "$tmp/by_git"

echo "== cargo package"
# A CARGO_HOME of its own: cargo verifies the dependent crate against the other's package unpacked under
# CARGO_HOME/registry/src, where an earlier run's package of the same version (from another tree) would be reused.
CARGO_HOME=$tmp/cargo_home_package "$cargo" package --workspace --offline --allow-dirty -q --manifest-path "$crates/Cargo.toml" \
         --target-dir "$build/cargo-package"
for crate in dpar-sys dpar; do
  version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$crates/$crate/Cargo.toml")
  listing=$(tar tzf "$build/cargo-package/package/$crate-$version.crate")
  for f in Cargo.toml build.rs src/lib.rs README.md LICENSE; do
    grep -qx "$crate-$version/$f" <<<"$listing" || { echo "FAIL: $crate's package lacks $f" >&2; exit 1; }
  done
done
echo "rust install: the crates build and run against an installed dpar by path and by git, and both package"
