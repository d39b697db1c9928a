#!/usr/bin/env bash
# The Rust Fashion-MNIST example trains exactly as the C one: builds it, then examples/check_same_as_c.sh runs both
# for 2 epochs on 2 CPU devices and compares their per-epoch losses and accuracies (everything but the throughput).
# check_char_gpt_same_as_c.sh does the same for the crate's GPT (src/bin/train_char_gpt.rs).
#   check_same_as_c.sh <cargo> <train_fashion_mnist (C)> <cargo target dir> <libdpar dir>
set -euo pipefail
cargo=$1
c_program=$2
export CARGO_TARGET_DIR=$3 DPAR_LIB_DIR=$4
here=$(cd "$(dirname "$0")" && pwd)
"$cargo" build --release --offline -q --manifest-path "$here/Cargo.toml"
exec "$here/../check_same_as_c.sh" Rust "$c_program" "$CARGO_TARGET_DIR" "$CARGO_TARGET_DIR/release/train_fashion_mnist"
