#!/bin/bash
OLD=/work/main/target/before/release/xtask
NEW=/work/main/target/lead/release/xtask
A1="--preset gpt2-nano --vocab 65 --device gpu --batch 4 --seq-len 64 --steps 4 --warmup 1 --mode-reps 2 --no-peer"
A2="--preset llama-tiny --layers 8 --hidden 512 --device gpu --precision bf16 --batch 1 --seq-len 16 --steps 5 --warmup 2 --mode-reps 3 --no-peer"
for round in 1 2; do
 for cfg in 1 2; do
  if [ $cfg = 1 ]; then A=$A1; n=gpt2; else A=$A2; n=wide; fi
  (cd /tmp/before && $OLD bench-throughput $A --json /tmp/bt/r2-old-$n-$round.json > /tmp/bt/r2-old-$n-$round.log 2>&1)
  for t in staging mapped; do
   (cd /work/main && $NEW bench-throughput $A --transport $t --json /tmp/bt/r2-$t-$n-$round.json > /tmp/bt/r2-$t-$n-$round.log 2>&1)
  done
 done
done
(cd /work/main && $NEW bench-throughput $A2 --json /tmp/bt/r2-auto-wide.json > /tmp/bt/r2-auto-wide.log 2>&1)
echo finished > /tmp/bt/done2
