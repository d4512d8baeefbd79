#!/usr/bin/env bash
# The README's main job against karpathy/nanoGPT itself, on the same GPU in
# the same run (issue 17: megatrain at least as fast, val <= 1.90).
#
# Here (the dev machine), once per session, with nanoGPT's snapshot fetched
# (the agent's fetch tool: github:karpathy/nanoGPT -> /work/.mirror/...):
#   bash benches/nanogpt_main_job.sh carry /work/.mirror/karpathy+nanoGPT/repo
# copies nanoGPT's train.py, model.py, configurator.py and its
# shakespeare-char config into .carry/nanogpt (git-ignored, travels with
# carry [".carry", ".gl"]). Then on the GPU machine, after pack.sh:
#   bash .carry/device.sh sh 'bash benches/nanogpt_main_job.sh run'
# Prints wall time and final validation loss of each run, then the ratios.
# nanoGPT runs its README's CPU command with --device=cuda: --compile=False,
# its default bf16 autocast, and again in float32; megatrain runs the
# README's command with --device gpu in f32 and f16.
#
# DROPOUT=0.2 runs both with that dropout (nanoGPT's --dropout; megatrain's
# --dropout and --attn-dropout, which together are nanoGPT's), DEVICE=cpu
# runs nanoGPT in float32 and megatrain in f32 on the CPU only (megatrain
# from PATH: target/release here), TIMEOUT the seconds a run may take
# (default 280). On the dev machine, with torch and numpy in python3:
#   DEVICE=cpu DROPOUT=0.2 TIMEOUT=1500 bash benches/nanogpt_main_job.sh run
set -uo pipefail
DROPOUT=${DROPOUT:-0.0}
DEVICE=${DEVICE:-gpu}
TIMEOUT=${TIMEOUT:-280}
case $DEVICE in
gpu) torch_device=cuda ;;
cpu) torch_device=cpu ;;
*)
    echo "DEVICE must be gpu or cpu, not $DEVICE" >&2
    exit 2
    ;;
esac
stage=${1:?usage: nanogpt_main_job.sh carry NANOGPT_CHECKOUT | run}
case $stage in
carry)
    src=${2:?the nanoGPT checkout (a git dir or a work tree)}
    dst=.carry/nanogpt
    rm -rf "$dst" && mkdir -p "$dst/config"
    for f in train.py model.py configurator.py config/train_shakespeare_char.py LICENSE; do
        if [ -d "$src/.git" ] || [ ! -e "$src/$f" ]; then
            git --git-dir="$src" show "HEAD:$f" >"$dst/$f" 2>/dev/null ||
                git -C "$src" show "HEAD:$f" >"$dst/$f" || exit 1
        else
            cp "$src/$f" "$dst/$f"
        fi
    done
    echo "nanoGPT ($(git --git-dir="$src" rev-parse --short HEAD 2>/dev/null || echo 'work tree')) in $dst"
    exit 0
    ;;
run) ;;
*)
    echo "unknown stage: $stage" >&2
    exit 2
    ;;
esac

OUT=${OUT:-/tmp/nanogpt-main-job}
mkdir -p "$OUT"
work=/tmp/nanogpt-work
rm -rf "$work" && cp -r .carry/nanogpt "$work" || exit 1
mkdir -p "$work/data/shakespeare_char"
# nanoGPT's prepare.py, without its download: characters sorted, ids as
# uint16, the first 90% train and the rest validation.
python3 - "$work/data/shakespeare_char" data/tinyshakespeare.txt <<'EOF'
import os, pickle, sys
import numpy as np
out, corpus = sys.argv[1], sys.argv[2]
data = open(corpus).read()
chars = sorted(set(data))
stoi = {c: i for i, c in enumerate(chars)}
n = len(data)
for name, part in (("train", data[: int(n * 0.9)]), ("val", data[int(n * 0.9):])):
    np.array([stoi[c] for c in part], dtype=np.uint16).tofile(os.path.join(out, f"{name}.bin"))
pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi},
            open(os.path.join(out, "meta.pkl"), "wb"))
print(f"shakespeare_char: {n} characters, vocabulary {len(chars)}")
EOF

summary=()
# Runs "$@" in directory $2, timed; the log goes to $OUT/$1.log, the wall
# seconds to $wall.
timed() {
    local name=$1 dir=$2
    shift 2
    local t0 t1 rc
    t0=$(date +%s.%N)
    (cd "$dir" && timeout "$TIMEOUT" "$@") >"$OUT/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    wall=$(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }")
    echo "$name: rc $rc, wall $wall s"
}

nanogpt() {
    local name=$1
    shift
    timed "$name" "$work" python3 train.py config/train_shakespeare_char.py --device="$torch_device" \
        --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 \
        --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 \
        --dropout="$DROPOUT" --out_dir="$work/out-$name" "$@"
    local val
    val=$(grep -E '^step 2000:' "$OUT/$name.log" | sed 's/.*val loss //')
    summary+=("$name: wall $wall s, val ${val:-?}")
}

megatrain_job() {
    local name=$1
    shift
    rm -rf "/tmp/runs-$name"
    timed "$name" . megatrain train --preset gpt2-nano --data data/tinyshakespeare.txt \
        --out "/tmp/runs-$name" --device "$DEVICE" --seq-len 64 --batch 12 --steps 2000 --lr 1e-3 \
        --min-lr 1e-4 --warmup 100 --beta2 0.99 --weight-decay 0.1 --grad-clip 1.0 \
        --eval-every 250 --eval-batches 20 --dropout "$DROPOUT" --attn-dropout "$DROPOUT" "$@"
    local val
    val=$(grep -E 'step 2000: validation loss' "$OUT/$name.log" | sed 's/.*validation loss //' | tail -1)
    summary+=("$name: wall $wall s, val ${val:-?}")
}

if [ "$DEVICE" = cpu ]; then
    python3 -c 'import torch; print("torch", torch.__version__, "on the CPU")'
    nanogpt nanogpt-fp32 --dtype=float32
    megatrain_job megatrain-f32
    echo "== main job on the CPU, dropout $DROPOUT (logs in $OUT)"
    for line in "${summary[@]}"; do echo "$line"; done
    exit 0
fi
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
nanogpt nanogpt-bf16
nanogpt nanogpt-fp32 --dtype=float32
megatrain_job megatrain-f32
# The default keeps every block from forward to backward here (`auto`: the
# model is tiny); the streamed step as it was, recomputing every block, for
# the difference (24 % fewer ops a step kept, on the noop backend).
megatrain_job megatrain-f32-recomputed --keep-activations 0
megatrain_job megatrain-f16 --precision f16
megatrain_job megatrain-f32-unbatched --batch-ops 1
echo "== main job (logs in $OUT)"
for line in "${summary[@]}"; do echo "$line"; done
