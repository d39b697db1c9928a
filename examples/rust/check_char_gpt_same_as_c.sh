#!/usr/bin/env bash
# The Rust GPT trains exactly as the C one: builds it, runs both with a short configuration on 2 CPU devices (words
# of CHAR_GPT_ARGS replace it where set) and compares their loss lines (everything but the throughput and the time),
# the sampled text and the checkpoints, byte for byte.
#   check_char_gpt_same_as_c.sh <cargo> <train_char_gpt (C)> <cargo target dir> <libdpar dir>
set -euo pipefail
cargo=$1
c_program=$2
export CARGO_TARGET_DIR=$3 DPAR_LIB_DIR=$4
here=$(cd "$(dirname "$0")" && pwd)
"$cargo" build --release --offline -q --manifest-path "$here/Cargo.toml" --bin train_char_gpt
scratch=$CARGO_TARGET_DIR/char_gpt_same_as_c
mkdir -p "$scratch"
args=(--device cpu --devices 2 --steps 20 --eval-every 10 --block 32 --layers 1 --embd 32 --heads 2 --batch-size 8
      --sample 40 --eval-batches 2)
[ -z "${CHAR_GPT_ARGS:-}" ] || read -r -a args <<<"$CHAR_GPT_ARGS"
"$CARGO_TARGET_DIR/release/train_char_gpt" "${args[@]}" --checkpoint "$scratch/rust.safetensors" >"$scratch/rust.txt"
"$c_program" "${args[@]}" --checkpoint "$scratch/c.safetensors" >"$scratch/c.txt"
# The step lines without the tokens/s and seconds, then what follows the sampling header.
results() { sed -n -e 's/^\(step .* val loss [0-9.]*\) .*/\1/p' -e '/^---- /,$p' "$1"; }
rust=$(results "$scratch/rust.txt")
c=$(results "$scratch/c.txt")
echo "Rust:"; echo "$rust"; echo "C:"; echo "$c"
[[ $(grep -c '^step' <<<"$rust") -gt 0 && $rust == "$c" ]] ||
  { echo "the Rust GPT does not train (or sample) as the C one" >&2; exit 1; }
cmp "$scratch/rust.safetensors" "$scratch/c.safetensors" ||
  { echo "the Rust GPT's checkpoint differs from the C one's" >&2; exit 1; }
echo "same losses, samples and checkpoint"
