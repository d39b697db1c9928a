#!/usr/bin/env bash
# The Rust example trains exactly as the C one: builds it, runs both for 2 epochs on 2 CPU devices, and compares
# their per-epoch losses and accuracies (everything but the throughput).
#   check_same_as_c.sh <cargo> <train_fashion_mnist (C)> <cargo target dir> <libdpar dir>
set -euo pipefail
cargo=$1
c_program=$2
export CARGO_TARGET_DIR=$3 DPAR_LIB_DIR=$4
here=$(cd "$(dirname "$0")" && pwd)
"$cargo" build --release --offline -q --manifest-path "$here/Cargo.toml"
strip_speed() { grep '^epoch' | sed 's/ *[0-9]* samples\/s$//'; }
rust=$("$CARGO_TARGET_DIR/release/train_fashion_mnist" --device cpu --devices 2 --epochs 2 --min-accuracy 85 | strip_speed)
c=$("$c_program" --device cpu --devices 2 --epochs 2 --checkpoint "$CARGO_TARGET_DIR/fashion_mnist_c.safetensors" | strip_speed)
echo "Rust:"; echo "$rust"; echo "C:"; echo "$c"
[[ -n $rust && $rust == "$c" ]] || { echo "the Rust example does not train as the C one" >&2; exit 1; }
