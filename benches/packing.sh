#!/usr/bin/env bash
# `--rows packed` and `--rows stream-docs` against `--rows records` on the
# same instruction data:
# the same model, batch and --seq-len, a fixed number of steps each (then
# `eval` of the first run both ways), from
# the repository root:
#   bash benches/packing.sh [target/release/megatrain] [--device cpu|gpu] [other train flags]
# PRESET (llama-tiny), SEQ (512), BATCH (8), STEPS (12), EVAL (1) and ROWS
# (records packed stream-docs) set the run.
# The data: Tiny Shakespeare's speeches as alpaca records (instruction: a
# speaker's name; output: the speech), whose lengths vary as an
# instruction set's do. Prints each mode's padding share (as `train` says
# it) and, from the run's metrics.jsonl (the first two steps left out), the
# median step time, the targets the loss counted a step and those a
# second: the step's shapes are the same every way, so the ratio of
# counted targets a second is the speed-up (stream-docs also counts what
# records and packed cut past --seq-len).
set -euo pipefail
BIN=${1:-target/release/megatrain}
shift || true
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
python3 - "$D/speeches.jsonl" <<'PY'
import json, sys
text = open("data/tinyshakespeare.txt", encoding="utf-8").read()
n = 0
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for block in text.split("\n\n"):
        name, _, speech = block.partition(":\n")
        if speech.strip():
            out.write(json.dumps({"instruction": "Speak as " + name.strip(), "input": "", "output": speech.strip()}) + "\n")
            n += 1
print(f"{n} records", file=sys.stderr)
PY
for rows in ${ROWS:-records packed stream-docs}; do
    "$BIN" train --preset "${PRESET:-llama-tiny}" --tokenizer byte --data "$D/speeches.jsonl" --rows $rows \
        --seq-len "${SEQ:-512}" --batch "${BATCH:-8}" --steps "${STEPS:-12}" --eval-every 0 --save-every 0 --log-every 1 \
        --val-fraction 0 --out "$D/run-$rows" "$@" 2> "$D/$rows.log" > /dev/null
    grep -E "records(,| in windows)" "$D/$rows.log" | sed "s/^/$rows: /"
    python3 - "$D/run-$rows/metrics.jsonl" "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_ms"' in l]
rows = rows[2:]
ms = statistics.median(r["step_ms"] for r in rows)
counted = statistics.median(r["counted"] for r in rows)
rate = statistics.median(r["counted"] / r["step_ms"] * 1e3 for r in rows)
print(f"{sys.argv[2]}: median step {ms:.1f} ms, {counted:.0f} counted targets a step, {rate:.0f} a second ({len(rows)} steps)")
PY
done
# `eval` of the same records both ways, on the first run's checkpoint: the
# whole set once, wall time (loading included) and the loss, which must
# agree. EVAL=0 leaves it out.
[ "${EVAL:-1}" = 0 ] && exit 0
for rows in records packed; do
    s=$(date +%s.%N)
    "$BIN" eval --model "$D/run-records" --data "$D/speeches.jsonl" --rows $rows --seq-len "${SEQ:-512}" \
        --batch "${BATCH:-8}" "$@" > "$D/eval-$rows.txt" 2>/dev/null
    e=$(date +%s.%N)
    echo "eval $rows: $(echo "$e - $s" | bc) s, $(cut -d'(' -f1 "$D/eval-$rows.txt")($(sed 's/.*: //; s/)$//' "$D/eval-$rows.txt"))"
done
