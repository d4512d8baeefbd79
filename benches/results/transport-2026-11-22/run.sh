#!/bin/bash
set -x
OLD=/work/main/target/before/release/xtask
NEW=/work/main/target/lead/release/xtask
ARGS="--device gpu --batch 4 --seq-len 64 --steps 5 --warmup 2 --mode-reps 3 --no-peer"
for round in 1 2; do
 for p in llama-tiny gpt2-nano; do
  (cd /tmp/before && $OLD bench-throughput --preset $p $ARGS --json /tmp/bt/old-$p-$round.json > /tmp/bt/old-$p-$round.log 2>&1)
  for t in staging mapped; do
   (cd /work/main && $NEW bench-throughput --preset $p $ARGS --transport $t --json /tmp/bt/new-$t-$p-$round.json > /tmp/bt/new-$t-$p-$round.log 2>&1)
  done
 done
done
(cd /work/main && $NEW bench-throughput --preset llama-tiny $ARGS --json /tmp/bt/new-auto-llama-tiny.json > /tmp/bt/new-auto.log 2>&1)
echo finished > /tmp/bt/done
