#!/usr/bin/env bash
# An example in another language trains exactly as the C one: runs both for 2 epochs on 2 CPU devices and compares
# their per-epoch losses and accuracies (everything but the throughput).
#   check_same_as_c.sh <language> <train_fashion_mnist (C)> <scratch dir> <command of the example...>
# The example's command gets --device cpu --devices 2 --epochs 2 --min-accuracy 85 appended, and both get the words
# of SAME_AS_C_ARGS too where it is set (the CNN: "--model cnn --steps-per-epoch 60", with --min-accuracy 80).
set -euo pipefail
language=$1
c_program=$2
scratch=$3
shift 3
mkdir -p "$scratch"
strip_speed() { grep '^epoch' | sed 's/ *[0-9]* samples\/s$//'; }
read -r -a extra <<<"${SAME_AS_C_ARGS:-}"
min=85
[ ${#extra[@]} -eq 0 ] || min=80
other=$("$@" --device cpu --devices 2 --epochs 2 --min-accuracy "$min" "${extra[@]}" | strip_speed)
c=$("$c_program" --device cpu --devices 2 --epochs 2 --checkpoint "$scratch/fashion_mnist_c.safetensors" "${extra[@]}" |
    strip_speed)
echo "$language:"; echo "$other"; echo "C:"; echo "$c"
[[ -n $other && $other == "$c" ]] || { echo "the $language example does not train as the C one" >&2; exit 1; }
