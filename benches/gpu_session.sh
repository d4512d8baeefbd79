#!/usr/bin/env bash
# What the open GPU issues (12, 13, 14, 17, 18) still need run on an H100 or
# H200, as four device-tool calls of under 10 minutes each, most important
# first, so one session's 30 minutes of device time answers all of it.
#
# Here (the dev machine), from the repository root (the first line needs
# nanoGPT's snapshot: the fetch tool, github:karpathy/nanoGPT):
#   bash benches/nanogpt_main_job.sh carry /work/.mirror/karpathy+nanoGPT/repo
#   bash ../shared/device/pack.sh $(bash benches/gpu_session.sh targets)
# Then the device tool's `run`, carry [".carry", ".gl"], one call per stage:
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh checks'   # correctness on the GPU
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh kernels'  # matmul, attention, bus, submits
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh steps'    # whole streamed steps
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh mainjob'  # README main job vs nanoGPT
# Each stage prints a short summary last (the device tool returns the tail
# of the output) and leaves two files in $OUT: the summary and a tarball of
# every log and JSON (the tool brings back at most 8 files). Record the
# numbers in BENCHMARKS.md with the machine, the date and these commands.
set -uo pipefail
P=/tmp/megatrain-pack
stage=${1:?usage: gpu_session.sh targets|checks|kernels|steps|mainjob}
DEST=${OUT:-/tmp/gpu-session}
OUT=/tmp/gpu-session-logs/$stage
rm -rf "$OUT" && mkdir -p "$OUT" "$DEST"
summary=()
# The device tool ends a call at 600 s; the stage keeps under BUDGET.
BUDGET=${BUDGET:-540}
T0=$SECONDS

# Seconds the next command may run: at most CAP, leaving RESERVE for the
# commands after it (never under 10).
left() {
    local cap=$1 reserve=${2:-0}
    local l=$((BUDGET - (SECONDS - T0) - reserve))
    ((l > cap)) && l=$cap
    ((l < 10)) && l=10
    echo "$l"
}

# Runs a packed test binary; the summary keeps its result line.
t() {
    local name=$1
    shift
    local log="$OUT/test-$name.log"
    timeout "$(left 300)" "$P/test/$name" "$@" >"$log" 2>&1
    local rc=$?
    summary+=("test $name (rc $rc): $(grep -E '^test result' "$log" | tail -1)")
    grep -E 'NOT tested here|FAILED|panicked|flushes f32 subnormals' "$log" | head -5
}

# Runs a packed bench binary; the summary keeps its last lines.
b() {
    local name=$1
    shift
    local log="$OUT/bench-$name.log"
    timeout "$(left 420)" "$P/bench/$name" --bench "$@" >"$log" 2>&1
    summary+=("bench $name (rc $?): see $log")
}

case $stage in
targets)
    echo f16 attention_f16 matmul ops ops_f64 add_norm transport transport_bytes \
        download_range pipelines batching matmul_into matmul_epilogue gpu_parity transfer_chunks attention submit \
        epilogue operand_maxima gpu_f16_maxima host_import
    exit 0
    ;;
checks)
    # Tensor-core matmul and flash attention against the host references
    # (these print "NOT tested here" only where cooperative matrices are
    # missing), the SIMT interior pipelines, every op against f64 (issue
    # 18.1: was the H100's parity failure rounding?), transports, parity.
    t f16 --nocapture
    t attention_f16
    t matmul
    t ops_f64 --nocapture
    t ops
    t add_norm
    t pipelines
    t batching
    t matmul_into
    t matmul_epilogue
    t operand_maxima
    t gpu_f16_maxima --nocapture
    t transport_bytes
    # Uploads from registered host memory, on the copy queue (a second
    # queue of the device's: the first place it runs beside the kernels).
    t host_import --nocapture
    t download_range
    t gpu_parity --nocapture
    t transfer_chunks
    ;;
kernels)
    # matmul: f32 interior vs checked_ rows, f16 SIMT and the three
    # tensor-core tiles at 4096³, 8192³ and the 7B MLP shapes (targets:
    # ≥ 300 TFLOP/s at 8192³, ≥ 250 at the 7B shapes, f32 ≥ 25); the
    # f16_coop128_stage_ rows convert f32 operands as they stage them
    # instead of reading f16 copies (MEGATRAIN_F16_OPERANDS: which to keep),
    # and f16_copy_ rows time making a copy.
    b matmul --warm-up-time 1 --measurement-time 2
    # Flash attention f16 at the 7B shapes with torch SDPA beside it
    # (targets at B4 T2048 32/8 D128: ≥ 150 forward, ≥ 75 backward).
    b attention attention_f16 --warm-up-time 1 --measurement-time 2
    # The bus: GB/s up, down, both per size and transport, where the time
    # goes, PyTorch's pinned copy_, and whether a copy overlaps a kernel.
    b transport --reps 5 --overlap
    b transport --reps 5 --sizes 64,256,1024 --no-torch --depth 8 --chunk-mib 16
    # Per-op cost of small ops submitted one by one and in batches.
    b submit --reps 9
    # The MLP's products with the activation at their store against the
    # product + standalone activation (GPT-2, TinyLlama, Qwen2.5-7B MLPs).
    b epilogue --warm-up-time 1 --measurement-time 2
    ;;
steps)
    # Per-op GPU profiles (--profile: one more step with timestamp
    # queries; issue 17's "where the next bottleneck is") of the README's
    # main job shape first (per-op overhead decides it against nanoGPT),
    # then TinyLlama at the anchor batch with the bf16-autocast PyTorch
    # peer and the host peak by kind (≤ 14.3 B/param), profiled too, then
    # Qwen2.5-7B's anchor with whatever is left of the stage's budget.
    timeout "$(left 60)" xtask bench-throughput --preset gpt2-nano --vocab 65 --device gpu \
        --precision f32 --batch 12 --seq-len 64 --steps 5 --warmup 2 --mode-reps 0 --no-peer \
        --profile --json "$OUT/profile-gpt2-nano.json" >"$OUT/profile-gpt2-nano.log" 2>&1
    summary+=("gpt2-nano profile (rc $?): $(grep -E '^step .* wall' "$OUT/profile-gpt2-nano.log" | tail -1)")
    # The same shape's host floor on this machine's CPU (wgpu's noop
    # backend: no kernel runs; BENCHMARKS.md, "Host floor of a streamed step").
    timeout "$(left 30)" xtask bench-throughput --preset gpt2-nano --vocab 65 --device gpu-noop \
        --precision f32 --batch 12 --seq-len 64 --steps 100 --warmup 5 --mode-reps 0 --no-peer \
        --json "$OUT/floor-gpt2-nano.json" >"$OUT/floor-gpt2-nano.log" 2>&1
    summary+=("gpt2-nano host floor (rc $?): $(grep -A4 '^Host work' "$OUT/floor-gpt2-nano.log" | tail -1)")
    timeout "$(left 260 200)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --profile --json "$OUT/anchor-tinyllama.json" >"$OUT/anchor-tinyllama.log" 2>&1
    summary+=("tinyllama anchor (rc $?): $(grep -E 'tokens/s|host peak|^step .* wall' "$OUT/anchor-tinyllama.log" | tail -4 | tr '\n' ' ')")
    timeout "$(left 400 60)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 --no-peer \
        --json "$OUT/anchor-qwen.json" >"$OUT/anchor-qwen.log" 2>&1
    summary+=("qwen anchor (rc $?): $(grep -E 'tokens/s|host peak' "$OUT/anchor-qwen.log" | tail -3 | tr '\n' ' ')")
    # TinyLlama again with every output's max left to an absmax scan
    # instead of folded by the products (the f16 table beside the step
    # time says what was scanned): what the fold saves.
    MEGATRAIN_F16_MAXIMA=scan timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-scan.json" \
        >"$OUT/anchor-tinyllama-scan.log" 2>&1
    summary+=("tinyllama anchor, maxima scanned (rc $?): $(grep -E 'tokens/s' "$OUT/anchor-tinyllama-scan.log" | tail -1)")
    # And with the gradients copied out of the readback buffers before
    # the optimizer reads them (the default reads them in place): what the
    # copy cost the host, beside the step time.
    MEGATRAIN_DOWNLOADS=copy timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-copy.json" \
        >"$OUT/anchor-tinyllama-copy.log" 2>&1
    summary+=("tinyllama anchor, downloads copied (rc $?): $(grep -E 'tokens/s' "$OUT/anchor-tinyllama-copy.log" | tail -1)")
    # And with every upload copied by the host through mapped memory (the
    # default has the device copy each layer from the registered tier).
    MEGATRAIN_UPLOADS=copy timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-upcopy.json" \
        >"$OUT/anchor-tinyllama-upcopy.log" 2>&1
    summary+=("tinyllama anchor, uploads copied by the host (rc $?): $(grep -E 'tokens/s' "$OUT/anchor-tinyllama-upcopy.log" | tail -1)")
    # And with the device's copies (uploads from the tier, gradient
    # downloads) on wgpu's queue instead of the copy queue (the default
    # where the device has a second queue): what running the bus beside
    # the kernels saves.
    MEGATRAIN_COPY_QUEUE=off timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-onequeue.json" \
        >"$OUT/anchor-tinyllama-onequeue.log" 2>&1
    summary+=("tinyllama anchor, copies on wgpu's queue (rc $?): $(grep -E 'tokens/s' "$OUT/anchor-tinyllama-onequeue.log" | tail -1)")
    for f in "$OUT"/profile-gpt2-nano.log "$OUT"/anchor-tinyllama.log; do
        echo "-- per-op profile in $f"
        sed -n '/^per-op profile/,/in no op/p' "$f" | head -45
    done
    ;;
mainjob)
    # The README's main job on this GPU against karpathy/nanoGPT in the
    # same run (issue 17: at least as fast, val <= 1.90).
    OUT=$OUT timeout "$(left 540)" bash benches/nanogpt_main_job.sh run | tee "$OUT/mainjob.log"
    rc=${PIPESTATUS[0]}
    summary+=("main job (rc $rc): $(sed -n '/^== main job/,$p' "$OUT/mainjob.log" | tail -6 | tr '\n' ';')")
    ;;
*)
    echo "unknown stage: $stage" >&2
    exit 2
    ;;
esac

echo "== $stage summary (logs in $OUT)"
for line in "${summary[@]}"; do echo "$line"; done
for f in "$OUT"/bench-*.log; do
    [ -e "$f" ] || continue
    echo "-- $f"
    grep -E 'TFLOP/s|GB/s|thrpt|overlap' "$f" | tail -25
done
{
    echo "== $stage summary"
    for line in "${summary[@]}"; do echo "$line"; done
} >"$DEST/$stage-summary.txt"
tar -czf "$DEST/$stage-logs.tar.gz" -C "$OUT" .
echo "(logs: $DEST/$stage-logs.tar.gz)"
