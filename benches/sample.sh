#!/usr/bin/env bash
# `megatrain sample` two ways on the same model, prompt and tokens, from
# the repository root:
#   bash benches/sample.sh [target/release/megatrain] [--device cpu|gpu] [other sample flags]
# COMPARE=cache (the default): with the cache of keys and values and
# without it; COMPARE=stream: the weights uploaded once and streamed from
# host memory for every forward (both with the cache); COMPARE=samples:
# one sample against SAMPLES (4) made together as a batch.
# PRESET (gpt2-124m), PROMPT_CHARS (256: the first characters of Tiny
# Shakespeare, a token each under the byte tokenizer), TOKENS (64) and
# REPS (3) set the run. The model is the preset's random initialisation
# after one step (a run of 1 step): the time of a token does not depend
# on the weights.
# Greedy, so both ways must print the same text (checked; with
# COMPARE=samples, every sample is the greedy one). Prints each
# way's median wall time of REPS runs and the ratio; the load of the
# model is in both.
set -euo pipefail
BIN=${1:-target/release/megatrain}
shift || true
PRESET=${PRESET:-gpt2-124m}
PROMPT_CHARS=${PROMPT_CHARS:-256}
TOKENS=${TOKENS:-64}
REPS=${REPS:-3}
case ${COMPARE:-cache} in
    cache) FLAG=--kv-cache; WAYS=(true false) ;;
    stream) FLAG=--stream; WAYS=(false true) ;;
    samples) FLAG=--samples; WAYS=(1 "${SAMPLES:-4}") ;;
    *) echo "COMPARE=$COMPARE: cache or stream"; exit 2 ;;
esac
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
"$BIN" train --preset "$PRESET" --data data/tinyshakespeare.txt --tokenizer byte --out "$D/run" \
    --steps 1 --seq-len 64 --batch 1 >"$D/train.log" 2>&1 || { cat "$D/train.log"; exit 1; }
PROMPT=$(head -c "$PROMPT_CHARS" data/tinyshakespeare.txt)
median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
for way in "${WAYS[@]}"; do
    : >"$D/times-$way"
    for _ in $(seq "$REPS"); do
        s=$(date +%s.%N)
        "$BIN" sample --model "$D/run" --prompt "$PROMPT" --tokens "$TOKENS" --temperature 0 \
            "$FLAG" "$way" "$@" >"$D/out-$way"
        e=$(date +%s.%N)
        echo "$e - $s" | bc >>"$D/times-$way"
    done
done
# Both ways print the same text (with --samples, the first sample).
first_of() { awk '/^---------------$/ {exit} {print}' "$1"; }
cmp -s <(first_of "$D/out-${WAYS[0]}") <(first_of "$D/out-${WAYS[1]}") ||
    { echo "the samples with $FLAG ${WAYS[0]} and ${WAYS[1]} differ"; exit 1; }
first=$(median <"$D/times-${WAYS[0]}")
second=$(median <"$D/times-${WAYS[1]}")
echo "$PRESET, prompt of $PROMPT_CHARS tokens, $TOKENS new, greedy, median of $REPS:"
echo "  $FLAG ${WAYS[0]}: $first s"
echo "  $FLAG ${WAYS[1]}: $second s"
echo "  ratio: $(echo "scale=2; $second / $first" | bc)x"
