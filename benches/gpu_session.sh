#!/usr/bin/env bash
# What the open GPU issues (12, 13, 14, 17, 18) still need run on an H100 or
# H200, most important first.
#
# A session drawn for a GPU has 15 minutes of device time, the machine's
# start (1-2 minutes) and every idle second included, and a machine goes
# back 30 s after a call. So the plan is two calls made back to back:
# `first` (about 9 minutes: is the tensor-core attention right there, one
# whole TinyLlama step beside PyTorch on the default tiles, the same step
# with each of two other gradient hand-overs and with every block's
# activations kept, the kernels' rates against the issues' targets and
# sweeps of tiles around the defaults, and the streamed step's parity),
# then at once, on the still-warm machine, `second` (about 4 minutes: the
# Qwen2.5-7B anchor, issue 17's headline, with the hand-over and tiles
# `first` picked, then as the defaults run it where those differ). Session
# 28 spent 531 s holding the machine for `first` (its start included) and
# 110 s for a `second` of one Qwen run; session 38 466 s for a `first` of
# BUDGET=480 (435 s of it running) and 130 s for `second` and `fresh`.
# `checks`, `kernels`, `steps` and `mainjob` are the whole of it, four calls
# of under 10 minutes each, for a session lent more device time. BUDGET=N
# (seconds; first 560, second 250, the others 540) fits a stage to what the
# device tool's `status` says is left: each item gets its own timeout
# inside it, the most important first.
#
# Here (the dev machine), from the repository root (the mainjob stage also
# needs nanoGPT's snapshot: the fetch tool, github:karpathy/nanoGPT, then
# `bash benches/nanogpt_main_job.sh carry /work/.mirror/karpathy+nanoGPT/repo`):
#   bash ../shared/device/pack.sh $(bash benches/gpu_session.sh targets)
# (what `first` and `second` run: 23 MB packed. `targets-checks` packs
# what `checks` runs, 39 MB, which fitted beside the repository's 19 MB
# (29.7 MiB on 2026-12-01: see below);
# `targets-all` packs everything, 49 MB, which does not: over the 64 MiB
# that may travel. Both sets together, `$(bash benches/gpu_session.sh
# targets) $(bash benches/gpu_session.sh targets-checks)`, pack 45.5 MB:
# 65.3 MB with the tree on 2026-11-28, just under 64 MiB, so one pack can
# serve `first`, `second` and a `checks` call.)
# Then the device tool's `run`, carry [".carry", ".gl"], timeout_s 600:
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh first'    # 15-minute lease, call 1
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh second'   # call 2, at once
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh checks'   # correctness on the GPU
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh kernels'  # matmul, attention, bus, submits
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh steps'    # whole streamed steps
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh mainjob'  # README main job vs nanoGPT
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh moe'      # a mixture of experts' step
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh hybrid'   # Qwen3.5's Gated DeltaNet: op and step
#   bash .carry/device.sh sh 'bash benches/gpu_session.sh fresh'    # kernels added since session 28, vs the CPU
# (`hybrid` packs `$(bash benches/gpu_session.sh targets-hybrid)`, `fresh`
# `targets-fresh`: with `targets`, 35 MB on 2026-11-29, one pack for `first`,
# `second` and `fresh`. On 2026-12-01 the tree that travels was 29.7 MiB
# (the zoo's fixtures 24 MiB of it), `targets` packed 25 MB and the two
# sets 38 MB: 67 MiB in all, refused. A pack made between two calls takes
# longer than the 30 s a machine stays warm, so pack the second call's set
# first and set it aside (20.7 MB for `targets-fresh`; every pack has the
# megatrain and xtask binaries `second` runs):
#   bash ../shared/device/pack.sh $(bash benches/gpu_session.sh targets-fresh)
#   rm -rf .carry-fresh && mv .carry .carry-fresh
#   grep -qx /.carry-fresh/ .git/info/exclude || echo /.carry-fresh/ >>.git/info/exclude
#   bash ../shared/device/pack.sh $(bash benches/gpu_session.sh targets)
# then call 2 carries [".carry-fresh", ".gl"] and runs
#   rm -rf .carry && mv .carry-fresh .carry && bash .carry/device.sh sh \
#     'BUDGET=250 bash benches/gpu_session.sh second; BUDGET=110 bash benches/gpu_session.sh fresh'
# (the first call's .carry is still on the warm machine: it goes first).)
# Each stage prints a short summary last (the device tool returns the tail
# of the output) and leaves two files in $OUT: the summary, written as each
# item ends (so a stage cut short still returns what it measured), and a
# tarball of every log and JSON (the tool brings back at most 8 files).
# Record the numbers in BENCHMARKS.md with the machine, the date and these
# commands.
set -uo pipefail
P=/tmp/megatrain-pack
stage=${1:?usage: gpu_session.sh targets|targets-checks|targets-all|targets-hybrid|targets-fresh|first|second|checks|kernels|steps|mainjob|moe|hybrid|fresh}
if [ "$stage" = targets ]; then
    echo coop_layout f16 attention_f16 matmul attention transport gpu_parity
    exit 0
fi
if [ "$stage" = targets-checks ]; then
    echo f16 attention_f16 matmul ops_f64 ops add_norm pipelines batching matmul_into matmul_epilogue \
        operand_maxima gpu_f16_maxima transport_bytes host_import download_range gpu_parity transfer_chunks
    exit 0
fi
if [ "$stage" = targets-hybrid ]; then
    echo ops delta_rule
    exit 0
fi
if [ "$stage" = targets-fresh ]; then
    echo generation_cache kv_cache dropout_training ops ops_f64
    exit 0
fi
if [ "$stage" = targets-all ]; then
    echo coop_layout f16 attention_f16 matmul ops ops_f64 add_norm transport transport_bytes \
        download_range pipelines batching matmul_into matmul_epilogue gpu_parity transfer_chunks attention submit \
        epilogue operand_maxima gpu_f16_maxima host_import delta_rule
    exit 0
fi
DEST=${OUT:-/tmp/gpu-session}
OUT=/tmp/gpu-session-logs/$stage
rm -rf "$OUT" && mkdir -p "$OUT" "$DEST"
summary=()
# The fastest tensor-core tiles `first`'s sweeps found, for the anchor
# runs after them (in `first`, and in `second` on the same warm machine):
# the swept matmul shape with the best rates at 8192³ and the 7B MLP
# forward (geometric mean) where it beats the default tile's by 5 %, and
# the attention tiles at issue 13's shape (the forward of the swept set
# with the fastest forward, dq and dk/dv of the one with the fastest
# backward) where their forward + backward beats the default tiles' by
# 5 %. Written to $PICKED as exports; each anchor's summary says which ran.
PICKED=/tmp/gpu-session-picked.env
PICK_MATMUL=${PICK_MATMUL:-8192x8192x8192_NN_f32 4096x3584x18944_NT_f16}
PICK_ATTN=${PICK_ATTN:-B4_T2048_Hq32_Hkv8_D128}
pick_tiles() {
    : >"$PICKED"
    # Each f16 row's median in Gelem/s (GFLOP/s) at the PICK_MATMUL
    # shapes, "tile shape rate" a line; a tile's score is the geometric
    # mean of its rates, where it has one at every shape.
    local best
    best=$(awk -v shapes="$PICK_MATMUL" '
        BEGIN {n = split(shapes, want, " ")}
        /^matmul\/f16_/ {id = $1; seen = 0}
        /thrpt:/ && id != "" && !seen {
            for (i = 1; i <= NF; i++) if ($i ~ /^\[/) {v = $(i + 2); u = $(i + 3); break}
            seen = 1
            if (u ~ /%/ || id ~ /_stage_/) next
            f = (u == "Gelem/s") ? 1 : (u == "Melem/s") ? 1e-3 : (u == "Kelem/s") ? 1e-6 : 1e-9
            for (j = 1; j <= n; j++) if (index(id, "_" want[j]) > 0) {
                t = id; sub(/^matmul\/f16_(sweep_)?/, "", t); sub("_" want[j] "$", "", t)
                logs[t] += log(v * f); count[t]++
            }
        }
        END {
            for (t in count) if (count[t] == n && (b == "" || logs[t] > logs[b])) b = t
            d = "coop128x256w16"
            if (b != "" && b != d && count[d] == n && logs[b] - logs[d] > n * log(1.05)) print b
        }' "$OUT/bench-matmul.log" 2>/dev/null)
    [ -n "$best" ] && echo "export MEGATRAIN_F16_MATMUL=$best" >>"$PICKED"
    # "tiles fwd_ms bwd_ms [dq_ms dkv_ms]" of the default ("default") and
    # each swept set, the last two from the set's profiled kernels. Each
    # pass is a kernel of its own: the forward of the set with the fastest
    # forward; dq and dk/dv each of the set whose kernel was fastest, or
    # (where no set has that kernel's time) of the set with the fastest
    # backward. (A set whose dk/dv adds dQ has no dq kernel: in session 47
    # that sent both passes to the fastest backward's set, whose dk/dv was
    # 1.37x slower than another set's.)
    best=$(sed -nE "s/^megatrain f16 (Coop|sweep[0-9]+)_$PICK_ATTN( \(([^)]*)\))?: fwd ([0-9.]+) ms [^,]*, bwd ([0-9.]+) ms(.*)/\3 \4 \5 \6/p" \
        "$OUT/bench-attention.log" 2>/dev/null | awk '
        # The ms after the kernel (its name, then its grid in brackets).
        function kernel(pass,   i, j) {
            for (i = 4; i < NF; i++) if ($i ~ ("^attention_backward/flash_" pass "_"))
                for (j = i + 1; j <= NF; j++) if ($j ~ /^[0-9.]+$/) return $j
            return ""
        }
        $1 ~ /^[0-9.]+$/ {d = $1 + $2; next}
        {
            if (f == "" || $2 < ft) {f = $1; ft = $2}
            if (b == "" || $3 < bt) {b = $1; bt = $3}
            q = kernel("dq"); k = kernel("dkv")
            split($1, parts, ",")
            if (q != "" && (qb == "" || q + 0 < qt)) {qb = parts[2]; qt = q + 0}
            if (k != "" && (kb == "" || k + 0 < kt)) {kb = parts[3]; kt = k + 0}
        }
        END {
            if (f == "" || d <= 0 || ft + bt >= 0.95 * d) exit
            split(f, fp, ","); split(b, bp, ",")
            if (qb == "") qb = bp[2]
            if (kb == "") kb = bp[3]
            print fp[1] "," qb "," kb
        }')
    [ -n "$best" ] && echo "export MEGATRAIN_F16_ATTENTION_TILES=$best" >>"$PICKED"
    note "tiles picked for the anchors: $(if [ -s "$PICKED" ]; then tr '\n' ' ' <"$PICKED"; else echo "none (the defaults)"; fi)"
}

# The fastest of the three gradient hand-overs `first` timed on TinyLlama
# (the defaults: all of a block's chunks in flight and two queued for the
# optimizer; two in flight; 16 queued),
# where it beats the defaults' step by 5 %: appended to $PICKED as the
# bench-throughput flags and environment `second` runs Qwen2.5-7B with.
pick_handoff() {
    local step best
    step() { sed -nE 's/^\| tinyllama-1.1b \| gpu \| f16 \| [^|]+\| [^|]+\| [^|]+\| [^|]+\| [^|]+\| ([0-9.]+) .*/\1/p' "$1" 2>/dev/null | head -1; }
    best=$(
        {
            echo "default $(step "$OUT/anchor-tinyllama.log")"
            echo "two $(step "$OUT/anchor-tinyllama-two.log")"
            echo "queue $(step "$OUT/anchor-tinyllama-queue.log")"
        } | awk 'NF == 2 {ms[$1] = $2} END {
            b = "default"
            for (k in ms) if (ms[k] < ms[b]) b = k
            if (b != "default" && ms["default"] > 0 && ms[b] < 0.95 * ms["default"]) print b}'
    )
    case $best in
    two) echo 'export HANDOFF_FLAGS="--chunks-in-flight 2"' >>"$PICKED" ;;
    queue) echo 'export HANDOFF_FLAGS="--optimizer-queue 16"' >>"$PICKED" ;;
    esac
    note "gradient hand-over picked for qwen: ${best:-the defaults}"
}

# Whether keeping activations (`first`'s TinyLlama run with
# --keep-activations all) beat the default step by 5 %: then `second` runs
# Qwen2.5-7B keeping as many blocks as `megatrain plan` says fit 85 % of
# this GPU's memory: the plan fell 7 % short of the H200's device peak
# with none kept (15.7 against 16.9 GB at 8×1024, counting two layers'
# gradients); all 28 on an H200 by its estimate (107.3 GiB), 16 on an
# 80 GB H100.
pick_keep() {
    local step mib n
    step() { sed -nE 's/^\| tinyllama-1.1b[^|]*\| gpu \| f16 \| [^|]+\| [^|]+\| [^|]+\| [^|]+\| [^|]+\| ([0-9.]+) .*/\1/p' "$1" 2>/dev/null | head -1; }
    local d k
    d=$(step "$OUT/anchor-tinyllama.log")
    k=$(step "$OUT/anchor-tinyllama-kept.log")
    if [ -z "$d" ] || [ -z "$k" ] || ! awk -v d="$d" -v k="$k" 'BEGIN {exit !(k < 0.95 * d)}'; then
        note "activations kept for qwen: none (tinyllama step kept ${k:-?} ms, default ${d:-?} ms)"
        return
    fi
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
    # Less the model's f16 copy (14,534 MiB): `second`'s run times the
    # isolated modes too, and compute-only holds every layer resident
    # beside the kept blocks (session 47: all 28 kept ran, 111.5 GB at its
    # peak, and its compute-only mode ran out of the H200's memory).
    n=$(megatrain plan --preset qwen2.5-7b --batch 8 --seq-len 1024 --precision f16 --host-mem 1T \
        --device-mem "$((${mib:-0} * 85 / 100 - 14534))M" 2>/dev/null | sed -nE 's/.*the last ([0-9]+) of [0-9]+ blocks can keep.*/\1/p')
    [ -n "$n" ] && [ "$n" -gt 0 ] && echo "export KEEP_FLAGS=\"--keep-activations $n\"" >>"$PICKED"
    note "activations kept for qwen: ${n:-none} of 28 blocks (${mib:-?} MiB on the GPU; tinyllama step kept $k ms, default $d ms)"
}

# The device tool ends a call at 600 s; the stage keeps under BUDGET, and
# the two stages of a 15-minute lease under their share of it.
case $stage in
first) BUDGET=${BUDGET:-560} ;;
second) BUDGET=${BUDGET:-250} ;;
*) BUDGET=${BUDGET:-540} ;;
esac
T0=$SECONDS
: >"$DEST/$stage-summary.txt"

# Keeps a summary line, on disk at once: a stage stopped from outside
# still returns what it finished.
note() {
    summary+=("$1")
    echo "$1" >>"$DEST/$stage-summary.txt"
}

# Keeps a bench-throughput run's result: a heading, its steps as they
# ended (all a run cut short by its timeout leaves), then its two table
# rows (throughput with the peer ratios; split, bus, host B/param and
# overlap), its peers and its host peak by kind.
# The first N rows of the first per-kernel profile table in a
# bench-throughput log (printed as the profiled step ended).
kernel_table() {
    awk -v n="$2" '/^per kernel/ {f = 1; print; next} f && /^\|/ {print; if (++k >= n + 2) exit; next} f && k > 0 {exit}' "$1"
}

rows() {
    note "$1:"
    while IFS= read -r line; do note "  $line"; done < <(
        grep -E '^  \[[^]]*\] (step [0-9]|transport )|^\| [a-z]|^- (peer|host peak)' "$2" | grep -v '^| config' | cut -c1-900
    )
}

# Seconds the next command may run: at most CAP, leaving RESERVE for the
# commands after it (never under 10).
left() {
    local cap=$1 reserve=${2:-0}
    local l=$((BUDGET - (SECONDS - T0) - reserve))
    ((l > cap)) && l=$cap
    ((l < 10)) && l=10
    echo "$l"
}

# Runs a packed test binary (at most $cap seconds, default 300); the
# summary keeps its result line.
t() {
    local name=$1
    shift
    local log="$OUT/test-$name.log"
    timeout "$(left "${cap:-300}")" "$P/test/$name" "$@" >"$log" 2>&1
    local rc=$?
    note "test $name (rc $rc): $(grep -E '^test result' "$log" | tail -1)"
    grep -E 'NOT tested here|FAILED|panicked|flushes f32 subnormals' "$log" | head -5
}

# Runs a packed bench binary (at most $cap seconds, default 420); the
# summary keeps its last lines.
b() {
    local name=$1
    shift
    local log="$OUT/bench-$name${tag:-}.log"
    timeout "$(left "${cap:-420}")" "$P/bench/$name" --bench "$@" >"$log" 2>&1
    note "bench $name (rc $?): see $log"
    # Each criterion row's median throughput (Gelem/s: GFLOP/s for the
    # kernels, GB/s for bytes), and `bench transport`'s GB/s rows, so the
    # summary carries the numbers.
    while IFS= read -r line; do note "  $line"; done < <(
        awk '/^[A-Za-z0-9_]+\/[^ ]+( +time:.*)?$/ {id=$1; done=0}
            /thrpt:/ && !done {for (i = 1; i <= NF; i++) if ($i ~ /^\[/) {
                if ($(i+2) !~ /%/) {print id ": " $(i+2), $(i+3); done=1}; break}}' "$log"
        awk -F'|' '/^\| (staging|mapped|direct) \| [0-9]+ \|/ && NF == 11' "$log"
    )
}

case $stage in
first)
    # A 15-minute lease's first call. Does every tensor-core kernel compute
    # the right thing on this GPU with the default tiles, what a TinyLlama
    # step does on them beside PyTorch, whether two chunks in flight or 16
    # queued for the optimizer beat the default hand-over (issue 17:
    # session 28 found the GPU and the CPU AdamW taking turns with two;
    # session 38 all of a layer's faster), and with what time is left,
    # which tiles around the
    # defaults are faster (issues 12, 13) and does the streamed step match
    # the CPU and float64 here (issue 18.1)? Session 28 measured the
    # sweeps first; the anchors and the hand-over come first now.
    # Whether this driver places a tile declared after small variables on
    # 16 bytes, and loads f32 accumulators back exactly (the attention's
    # rescale of O; the matmuls never do): its garbage on the H200 in
    # session 22.
    cap=20 t coop_layout --nocapture
    grep -E 'products wrong|loaded back' "$OUT/test-coop_layout.log"
    # (The swept shapes' and tiles' own tests are left to `checks`: each
    # is a set of pipelines to compile, and the sweeps below check what
    # they time first; so is `f16`, the matmuls', whose tiles have not
    # changed since it passed there in sessions 28 and 38, 44 s.) The
    # attention's, for its defaults of session 38, never run on NVIDIA as
    # a set (33 s in session 38).
    cap=45 t attention_f16 --nocapture --skip with_swept_tiles
    grep -E 'relative error' "$OUT/test-attention_f16.log" | head -4
    # One whole TinyLlama step beside PyTorch in bf16 autocast (issue 17:
    # ≥ 0.5×), its overlap efficiency (one of each isolated mode), the host
    # peak by kind (issue 18.2: ≤ 14.3 B/param) and a per-op profile, on
    # the default tiles. Session 28: 98 s there; session 38's was stopped at
    # 120 s inside the PyTorch peers.
    timeout "$(left 160)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --mode-reps 1 --profile --json "$OUT/anchor-tinyllama.json" >"$OUT/anchor-tinyllama.log" 2>&1
    rows "tinyllama anchor (rc $?)" "$OUT/anchor-tinyllama.log"
    sed -n '/^per-op profile/,/in no op/p' "$OUT/anchor-tinyllama.log" | head -30
    kernel_table "$OUT/anchor-tinyllama.log" 30
    # The same step with two chunks of a layer in flight (the default until
    # session 38, whose H200 run found all of a block's 16 % faster on
    # TinyLlama and 24 % on Qwen2.5-7B): step time and host peak against
    # the row above.
    timeout "$(left 50)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --mode-reps 0 --no-peer --chunks-in-flight 2 --json "$OUT/anchor-tinyllama-two.json" \
        >"$OUT/anchor-tinyllama-two.log" 2>&1
    rows "tinyllama anchor, two chunks of a layer in flight (rc $?)" "$OUT/anchor-tinyllama-two.log"
    # (Two in flight, each layer's chunks taken from one device copy of the
    # layer, `MEGATRAIN_DOWNLOAD_STAGING=layer`: 1,156 ms in session 38, no
    # faster than two without the copy; no longer timed here.)
    # And with 16 chunks that may wait for the CPU AdamW instead of 2, so
    # that the optimizer may fall a layer behind without the thread that
    # queues the backward waiting on it (session 38: that thread waited
    # 1,854 ms of a 4,844 ms Qwen step on the optimizer's queue): step time
    # and host peak (16 more chunks) against the first row.
    timeout "$(left 50)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --mode-reps 0 --no-peer --optimizer-queue 16 --json "$OUT/anchor-tinyllama-queue.json" \
        >"$OUT/anchor-tinyllama-queue.log" 2>&1
    rows "tinyllama anchor, 16 chunks queued for the optimizer (rc $?)" "$OUT/anchor-tinyllama-queue.log"
    # And keeping every block's weights and activations from its forward to
    # its backward (no recompute: a quarter of the blocks' products and an
    # attention forward a block saved, and the block's second upload;
    # `megatrain plan` estimates 31.9 GiB on the device): step time and
    # device peak against the first row.
    timeout "$(left 50)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --mode-reps 0 --no-peer --keep-activations all --json "$OUT/anchor-tinyllama-kept.json" \
        >"$OUT/anchor-tinyllama-kept.log" 2>&1
    rows "tinyllama anchor, every block's activations kept (rc $?)" "$OUT/anchor-tinyllama-kept.log"
    # The rates against the targets: the f16 tiles at 8192³ and a 7B MLP
    # product (≥ 300 and ≥ 250 TFLOP/s), f32 at 8192³ (≥ 25); flash
    # attention prints every 7B shape's forward and backward (≥ 150 and
    # ≥ 75 TFLOP/s at B4 T2048 32/8 D128) and SDPA's beside them, the
    # criterion rows cut to that shape.
    # Where the default tile's time goes (issue 12: 187 TFLOP/s at 8192³
    # where 300 is asked): the product again with its K loop cut down to
    # the multiply-adds, then with the fragment loads, the barriers and
    # the staging put back in turn (CoopProbe; the rest of the real
    # kernel's time is its global reads). One line, about 15 s (the probes
    # run instead of criterion's rows).
    tag=-probe MEGATRAIN_COOP_PROBE=default cap=40 b matmul
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^megatrain coop probe' "$OUT/bench-matmul-probe.log")
    # The sweep (f16_sweep_ rows) times CoopTile::SWEEP's shapes, around
    # the default; each checked against f32 first. Shorter samples than
    # session 28's (about 2 minutes each there).
    MEGATRAIN_COOP_SWEEP=default cap=90 b matmul \
        '^matmul/(f16_coop128x256w16_8192|f16_coop128x256w16_4096x3584|f16_coop(128|128x256w16)_8192x2048x256|8192x8192|f16_sweep_)' \
        --warm-up-time 0.3 --measurement-time 0.7
    # Where the tensor-core attention's time goes (issue 13: 44.5 and
    # 27.3 TFLOP/s at D = 128 where 150 and 75 are asked, about 18 and 14
    # at TinyLlama's D = 64): the default tiles' forward and backward with
    # each streamed tile's staging taken out, then the softmax (P and dS)
    # too (AttnProbe), per kernel, at both shapes. Six lines.
    tag=-probe MEGATRAIN_ATTN_PROBE=1 cap=60 b attention
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^megatrain attention probe' "$OUT/bench-attention-probe.log")
    # The tensor-core attention's tile sets (AttnTiles::SWEEP: the sweep
    # rows, each set checked first) at issue 13's shape; each set's tiles
    # and both rates into the summary. Session 53's two changes against
    # the defaults, per kernel: set 2's forward is the two-pass softmax
    # (`t`) the default no longer runs, its dq and dk/dv double buffered
    # (`d`); set 3's forward `d`, its backward `d` and `l`.
    # (Session 38: the six sets alone took 117 s at these sample times, and
    # 90 s with the f32 rows beside them reached none; there are seven now.)
    MEGATRAIN_ATTN_SWEEP=default cap=150 b attention \
        '^attention_f16/(fwd_Coop_B4_T2048_Hq32_|(fwd|bwd)_sweep)' \
        --warm-up-time 0.3 --measurement-time 0.7
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^megatrain f16 sweep' "$OUT/bench-attention.log")
    # The same sets at TinyLlama's D = 64, GQA 32/4 (session 47: its
    # attention was 30 % of its step's kernels, on tiles only ever swept at
    # D = 128): informs a default per head dimension, picks nothing.
    tag=-d64 MEGATRAIN_ATTN_SWEEP=default MEGATRAIN_ATTN_SWEEP_SHAPE=B8_T1024_Hq32_Hkv4_D64 cap=60 \
        b attention 'attention_f16/(fwd|bwd)_sweep' --warm-up-time 0.3 --measurement-time 0.7
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^megatrain f16 sweep' "$OUT/bench-attention-d64.log")
    pick_tiles
    pick_handoff
    pick_keep
    # The streamed step against the CPU and float64 (issue 18.1), last
    # (session 28: 16 of 16 in 5.5 s on the H200, with the old tiles).
    cap=30 t gpu_parity --nocapture
    ;;
second)
    # A 15-minute lease's second call, made at once on the warm machine:
    # Qwen2.5-7B at 8×1024 tokens (issue 17: ≥ 3,000 tokens/s, host ≤ 14.5
    # B/param, overlap efficiency ≤ 1.1). No peer: PyTorch cannot hold it
    # on one GPU, and its streamed pattern would need the host memory again.
    # On the tiles `first`'s sweeps picked, where it ran on this machine.
    # shellcheck disable=SC1090
    if [ -s "$PICKED" ]; then
        . "$PICKED"
        note "tiles: $(tr '\n' ' ' <"$PICKED")"
    fi
    # First with the gradient hand-over `first` picked on TinyLlama, where
    # one beat the defaults (session 28's profile: 1,306 tokens/s, step
    # 6.27 s ≈ compute-only 3.77 + optimizer busy 2.41, the two taking
    # turns), with the three isolated modes; then as the defaults run it
    # with what time is left.
    # With blocks kept the CPU AdamW is slower than the backward's kernels:
    # 16 chunks queued for it took session 47's kept step from 3,067 to
    # 2,939 ms (TinyLlama's optimizer keeps up, so its runs cannot pick it).
    if [ -n "${KEEP_FLAGS:-}" ] && [[ "${HANDOFF_FLAGS:-}" != *--optimizer-queue* ]]; then
        HANDOFF_FLAGS="${HANDOFF_FLAGS:-} --optimizer-queue 16"
    fi
    # The host's AdamW, which the 7B step waits for (session 47: ~30
    # B/param at ~120 GB/s): against the machine's triad, the f16 copy
    # with streaming stores (the default since session 48) and plain ones.
    timeout "$(left 40)" xtask bench-adamw --params 400000000 --threads 8 --threads 16 --iters 5 \
        >"$OUT/bench-adamw.log" 2>&1
    note "bench-adamw (rc $?):"
    while IFS= read -r line; do note "  $line"; done <"$OUT/bench-adamw.log"
    # shellcheck disable=SC2086
    # The default run after it is kept time for only where something was
    # picked (session 28: 110 s for one Qwen run, step 0's 55.5 s in it).
    reserve=0
    [ -n "${HANDOFF_FLAGS:-}${MEGATRAIN_DOWNLOAD_STAGING:-}${KEEP_FLAGS:-}" ] && reserve=100
    timeout "$(left 400 $reserve)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 \
        --mode-reps 1 --no-peer --profile ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-} --json "$OUT/anchor-qwen.json" >"$OUT/anchor-qwen.log" 2>&1
    rows "qwen anchor (rc $?; hand-over: ${HANDOFF_FLAGS:-} ${MEGATRAIN_DOWNLOAD_STAGING:+MEGATRAIN_DOWNLOAD_STAGING=$MEGATRAIN_DOWNLOAD_STAGING}; ${KEEP_FLAGS:-no activations kept})" "$OUT/anchor-qwen.log"
    # Its per-kernel profile (one more step, printed as it ends): which
    # products and passes the 7B step's compute goes to.
    kernel_table "$OUT/anchor-qwen.log" 30
    # Where blocks are kept the backward's AdamW is what the step waits
    # for (session 47: 731 ms with 16 queued): every other block's update
    # carried into the next forward, which runs the blocks between them
    # meanwhile (`--carry-order spread`; 13 GB more of the device's
    # memory for their f32 gradients). Its "fwd ms (carried)" says what the
    # forward took on, "opt wait ms" what the backward no longer waits.
    if [ -n "${KEEP_FLAGS:-}" ]; then
        # The embedding's looked-up rows alone are the default since
        # session 48 (59 MB up, 117 MB down and ~130 ms of AdamW off the
        # step's end for Qwen2.5-7B, by the plan): the whole table, as
        # before, for the same run's ratio.
        # shellcheck disable=SC2086
        MEGATRAIN_EMBEDDING=whole timeout "$(left 100)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 \
            --steps 3 --warmup 1 --mode-reps 0 --no-peer ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-} \
            --json "$OUT/anchor-qwen-whole.json" >"$OUT/anchor-qwen-whole.log" 2>&1
        rows "qwen anchor, MEGATRAIN_EMBEDDING=whole (rc $?; ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-})" "$OUT/anchor-qwen-whole.log"
        # The backward's SwiGLU as the product and its own kernel (session
        # 47's profile: the fused down-projection backward 12.9 ms a layer,
        # twice a plain product of its size; its store now loads the
        # epilogue's operands before the fragment goes out, session 49).
        # shellcheck disable=SC2086
        MEGATRAIN_EPILOGUES=forward timeout "$(left 100)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 \
            --steps 3 --warmup 1 --mode-reps 0 --no-peer ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-} \
            --json "$OUT/anchor-qwen-unfused.json" >"$OUT/anchor-qwen-unfused.log" 2>&1
        rows "qwen anchor, MEGATRAIN_EPILOGUES=forward (rc $?; ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-})" "$OUT/anchor-qwen-unfused.log"
        # shellcheck disable=SC2086
        timeout "$(left 130)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 3 --warmup 1 \
            --mode-reps 0 --no-peer ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-} --carry-layers 14 --carry-order spread \
            --json "$OUT/anchor-qwen-spread.json" >"$OUT/anchor-qwen-spread.log" 2>&1
        rows "qwen anchor, --carry-layers 14 --carry-order spread (rc $?; ${HANDOFF_FLAGS:-} ${KEEP_FLAGS:-})" "$OUT/anchor-qwen-spread.log"
    fi
    if [ -n "${HANDOFF_FLAGS:-}${MEGATRAIN_DOWNLOAD_STAGING:-}${KEEP_FLAGS:-}" ]; then
        unset HANDOFF_FLAGS MEGATRAIN_DOWNLOAD_STAGING KEEP_FLAGS
        timeout "$(left 130)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 \
            --mode-reps 0 --no-peer --json "$OUT/anchor-qwen-default.json" >"$OUT/anchor-qwen-default.log" 2>&1
        rows "qwen anchor, the default hand-over (rc $?)" "$OUT/anchor-qwen-default.log"
    else
        # Nothing picked: TinyLlama's optimizer (254 ms of a 729 ms step in
        # session 38) never fills its queue, so its A/B cannot say what a
        # deeper queue does where the optimizer waits (Qwen: 1,854 ms of
        # 4,844). The bench's "opt wait ms (after bwd)" column says how
        # much of the wait was the queue full during backward.
        # First, every other block's AdamW carried into the next step's
        # forward, which runs the blocks between them meanwhile (the first
        # 15 layers carried made session 47's step 3,365 ms against 3,067:
        # the forward waited for each update); its "fwd ms (carried)"
        # column says what the forward took on.
        timeout "$(left 130)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 \
            --mode-reps 0 --no-peer --carry-layers 14 --carry-order spread \
            --json "$OUT/anchor-qwen-carry.json" >"$OUT/anchor-qwen-carry.log" 2>&1
        rows "qwen anchor, --carry-layers 14 --carry-order spread (rc $?)" "$OUT/anchor-qwen-carry.log"
        timeout "$(left 130)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 \
            --mode-reps 0 --no-peer --optimizer-queue 16 --json "$OUT/anchor-qwen-queue.json" >"$OUT/anchor-qwen-queue.log" 2>&1
        rows "qwen anchor, --optimizer-queue 16 (rc $?)" "$OUT/anchor-qwen-queue.log"
    fi
    ;;
fresh)
    # The kernels added since the last GPU session's checks (session 28:
    # the gated delta rule and its small ops, attention within packed
    # documents, the cached attention and delta rule of generation; session
    # 41: dropout), never run on NVIDIA: against the CPU there, shortest first, for a lease's
    # last minutes (issue 18.1: the whole suite green on NVIDIA).
    cap=40 t generation_cache
    cap=60 t kv_cache gpu
    # Dropout (session 41): the streamed step on the GPU against the CPU's
    # (the tensor-core attention's dropout runs in `first`'s attention_f16).
    cap=30 t dropout_training gpu
    cap=120 t ops
    cap=60 t ops_f64
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
    # matmul: f32 interior vs checked_ rows, f16 SIMT and the four
    # tensor-core tiles at 4096³, 8192³ and the 7B MLP shapes, and the
    # swept shapes (f16_sweep_) at 8192³ and a 7B MLP forward (targets:
    # ≥ 300 TFLOP/s at 8192³, ≥ 250 at the 7B shapes, f32 ≥ 25); the
    # f16_coop256x128_stage_ rows convert f32 operands as they stage them
    # instead of reading f16 copies (MEGATRAIN_F16_OPERANDS: which to keep),
    # and f16_copy_ rows time making a copy.
    MEGATRAIN_COOP_SWEEP=default b matmul --warm-up-time 1 --measurement-time 2
    # Flash attention f16 at the 7B shapes with torch SDPA beside it
    # (targets at B4 T2048 32/8 D128: ≥ 150 forward, ≥ 75 backward).
    MEGATRAIN_ATTN_SWEEP=default b attention attention_f16 --warm-up-time 1 --measurement-time 2
    # The same sets at TinyLlama's shape (D = 64, GQA 8/1): AttnTiles is one
    # set for every head dimension, chosen at D = 128; this says whether
    # D = 64 wants others (its anchor's env can name them).
    tag=-d64 MEGATRAIN_ATTN_SWEEP=default MEGATRAIN_ATTN_SWEEP_SHAPE=B8_T1024_Hq32_Hkv4_D64 \
        b attention 'attention_f16/(fwd|bwd)_sweep' --warm-up-time 1 --measurement-time 2
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^megatrain f16 sweep' "$OUT/bench-attention-d64.log")
    # The bus: GB/s up, down, both per size and transport, where the time
    # goes, PyTorch's pinned copy_, and whether a copy overlaps a kernel.
    b transport --reps 5 --overlap
    tag=-depth8 b transport --reps 5 --sizes 64,256,1024 --no-torch --depth 8 --chunk-mib 16
    tag=-one-piece b transport --reps 5 --no-torch --download-pieces 1
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
    note "gpt2-nano profile (rc $?): $(grep -E '^step .* wall' "$OUT/profile-gpt2-nano.log" | tail -1)"
    # The same shape's host floor on this machine's CPU (wgpu's noop
    # backend: no kernel runs; BENCHMARKS.md, "Host floor of a streamed step").
    timeout "$(left 30)" xtask bench-throughput --preset gpt2-nano --vocab 65 --device gpu-noop \
        --precision f32 --batch 12 --seq-len 64 --steps 100 --warmup 5 --mode-reps 0 --no-peer \
        --json "$OUT/floor-gpt2-nano.json" >"$OUT/floor-gpt2-nano.log" 2>&1
    note "gpt2-nano host floor (rc $?): $(grep -A4 '^Host work' "$OUT/floor-gpt2-nano.log" | tail -1)"
    timeout "$(left 260 200)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --profile --json "$OUT/anchor-tinyllama.json" >"$OUT/anchor-tinyllama.log" 2>&1
    rows "tinyllama anchor (rc $?)" "$OUT/anchor-tinyllama.log"
    timeout "$(left 400 60)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 1 --no-peer \
        --json "$OUT/anchor-qwen.json" >"$OUT/anchor-qwen.log" 2>&1
    rows "qwen anchor (rc $?)" "$OUT/anchor-qwen.log"
    # TinyLlama again with every output's max left to an absmax scan
    # instead of folded by the products (the f16 table beside the step
    # time says what was scanned): what the fold saves.
    MEGATRAIN_F16_MAXIMA=scan timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-scan.json" \
        >"$OUT/anchor-tinyllama-scan.log" 2>&1
    note "tinyllama anchor, maxima scanned (rc $?): $(grep -E '^\| tinyllama' "$OUT/anchor-tinyllama-scan.log" | head -1)"
    # And with the gradients copied out of the readback buffers before
    # the optimizer reads them (the default reads them in place): what the
    # copy cost the host, beside the step time.
    MEGATRAIN_DOWNLOADS=copy timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-copy.json" \
        >"$OUT/anchor-tinyllama-copy.log" 2>&1
    note "tinyllama anchor, downloads copied (rc $?): $(grep -E '^\| tinyllama' "$OUT/anchor-tinyllama-copy.log" | head -1)"
    # And with every upload copied by the host through mapped memory (the
    # default has the device copy each layer from the registered tier).
    MEGATRAIN_UPLOADS=copy timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-upcopy.json" \
        >"$OUT/anchor-tinyllama-upcopy.log" 2>&1
    note "tinyllama anchor, uploads copied by the host (rc $?): $(grep -E '^\| tinyllama' "$OUT/anchor-tinyllama-upcopy.log" | head -1)"
    # And with the device's copies (uploads from the tier, gradient
    # downloads) on wgpu's queue instead of the copy queue (the default
    # where the device has a second queue): what running the bus beside
    # the kernels saves.
    MEGATRAIN_COPY_QUEUE=off timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 \
        --steps 3 --warmup 1 --no-peer --json "$OUT/anchor-tinyllama-onequeue.json" \
        >"$OUT/anchor-tinyllama-onequeue.log" 2>&1
    note "tinyllama anchor, copies on wgpu's queue (rc $?): $(grep -E '^\| tinyllama' "$OUT/anchor-tinyllama-onequeue.log" | head -1)"
    # And with 32 MiB transfer chunks, the default before it was sized by
    # the model (8.6 MB here): what the 4x more chunks cost a step, beside
    # the host peak they save (0.18 B/param by arithmetic).
    timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --no-peer --transfer-chunk 32M --json "$OUT/anchor-tinyllama-chunk32.json" \
        >"$OUT/anchor-tinyllama-chunk32.log" 2>&1
    note "tinyllama anchor, 32 MiB transfer chunks (rc $?): $(grep -E '^\| tinyllama' "$OUT/anchor-tinyllama-chunk32.log" | head -1)"
    # Clipping (`--grad-clip 1`, nanoGPT's and most recipes' setting):
    # every gradient held to the backward's end, then each layer's AdamW
    # in the next step's forward (the default since session 43) against
    # every AdamW after the backward, the device idle (`megatrain plan
    # --hold-grads` estimates 439.0 against 494.4 ms at 300 TFLOP/s): step
    # time, "fwd ms (carried)" and "opt wait ms (after bwd)" of each. Then
    # with every layer's gradients kept on the GPU (`--carry-layers all`,
    # session 44: the norm summed there, the host at the tier's 14 bytes a
    # parameter instead of 18): the host peak per parameter beside the step.
    for how in deferred after device; do
        flag=; [ "$how" = after ] && flag=--clip-after-backward
        [ "$how" = device ] && flag="--carry-layers all"
        timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 2 \
            --no-peer --mode-reps 0 --grad-clip 1 $flag --json "$OUT/anchor-tinyllama-clip-$how.json" \
            >"$OUT/anchor-tinyllama-clip-$how.log" 2>&1
        rows "tinyllama anchor, --grad-clip 1 $how (rc $?)" "$OUT/anchor-tinyllama-clip-$how.log"
    done
    # TinyLlama with its embedding and first 11 blocks frozen
    # (`--freeze-layers 12`, session 44): the backward ends at block 11,
    # so half the blocks are neither uploaded again, recomputed nor
    # differentiated; step, "bwd ms" and bus MB beside the anchor's.
    timeout "$(left 60)" xtask bench-throughput --anchor tinyllama-8x1024 --steps 3 --warmup 1 \
        --no-peer --mode-reps 0 --freeze-layers 12 --json "$OUT/anchor-tinyllama-frozen.json" \
        >"$OUT/anchor-tinyllama-frozen.log" 2>&1
    rows "tinyllama anchor, --freeze-layers 12 (rc $?)" "$OUT/anchor-tinyllama-frozen.log"
    # Qwen2.5-7B clipped: held on the host it needs 18 bytes a parameter,
    # 137 GB, past this machine's 128 GiB; its gradients on the H200
    # (30.5 GB there) leave the host the tier's 107 GB.
    timeout "$(left 150 60)" xtask bench-throughput --anchor qwen2.5-7b-8x1024 --steps 2 --warmup 2 \
        --no-peer --mode-reps 0 --grad-clip 1 --carry-layers all --json "$OUT/anchor-qwen-clip-device.json" \
        >"$OUT/anchor-qwen-clip-device.log" 2>&1
    rows "qwen anchor, --grad-clip 1 --carry-layers all (rc $?)" "$OUT/anchor-qwen-clip-device.log"
    # TinyLlama on instruction records (Tiny Shakespeare's speeches), one a
    # row against packed (`--rows packed`; BENCHMARKS.md, "records packed
    # into rows"): the counted targets a second each way, the packed
    # attention skipping the other records' tiles.
    PRESET=tinyllama-1.1b SEQ=2048 BATCH=4 STEPS=6 EVAL=0 timeout "$(left 90)" bash benches/packing.sh megatrain \
        --device gpu --precision f16 >"$OUT/packing.log" 2>&1
    note "packed rows (rc $?): $(grep -E '^(records|packed): median' "$OUT/packing.log" | tr '\n' ' ')"
    # `sample` with its cache of keys and values and without (BENCHMARKS.md,
    # "Generation"; measured on the CPU only): the cached step's one row of
    # attention a head over the cache, on the GPU.
    PRESET=gpt2-124m PROMPT_CHARS=512 TOKENS=128 REPS=1 timeout "$(left 60)" bash benches/sample.sh megatrain \
        --device gpu --timing >"$OUT/sample.log" 2>&1
    note "sample, cache and none (rc $?): $(grep -E '^  (--kv-cache|ratio)' "$OUT/sample.log" | tr -s ' ' | tr '\n' ' ')"
    # `sample --stream true` against the weights uploaded once: every
    # forward loads each layer from host memory, so a token costs one
    # pass of the model over the bus (BENCHMARKS.md, "Generation").
    COMPARE=stream PRESET=gpt2-124m PROMPT_CHARS=512 TOKENS=128 REPS=1 timeout "$(left 45)" \
        bash benches/sample.sh megatrain --device gpu --timing >"$OUT/sample-stream.log" 2>&1
    note "sample, resident and streamed (rc $?): $(grep -E '^  (--stream|ratio)' "$OUT/sample-stream.log" | tr -s ' ' | tr '\n' ' ')"
    # Four samples as a batch against one (`--samples 4`).
    COMPARE=samples PRESET=gpt2-124m PROMPT_CHARS=512 TOKENS=128 REPS=1 timeout "$(left 45)" \
        bash benches/sample.sh megatrain --device gpu --timing >"$OUT/sample-samples.log" 2>&1
    note "sample, one and four together (rc $?): $(grep -E '^  (--samples|ratio)' "$OUT/sample-samples.log" | tr -s ' ' | tr '\n' ' ')"
    for f in "$OUT"/profile-gpt2-nano.log "$OUT"/anchor-tinyllama.log; do
        echo "-- per-op profile in $f"
        sed -n '/^per-op profile/,/in no op/p' "$f" | head -45
    done
    ;;
moe)
    # A mixture of experts at the anchor batch (BENCHMARKS.md, "mixtures
    # of experts"; never timed on a GPU): OLMoE-1B-7B, 6.9 B parameters
    # (90.5 GiB of host memory), 64 experts of which 8 a token, f16,
    # profiled: how much of its step is the experts' many small products
    # and the host's wait for each routed block's scores.
    timeout "$(left 480)" xtask bench-throughput --preset olmoe-1b-7b --device gpu --precision f16 \
        --batch 8 --seq-len 1024 --steps 2 --warmup 1 --mode-reps 0 --no-peer --profile \
        --json "$OUT/moe-olmoe.json" >"$OUT/moe-olmoe.log" 2>&1
    rows "olmoe-1b-7b 8x1024 f16 (rc $?)" "$OUT/moe-olmoe.log"
    echo "-- per-op profile in $OUT/moe-olmoe.log"
    sed -n '/^per-op profile/,/in no op/p' "$OUT/moe-olmoe.log" | head -45
    ;;
hybrid)
    # Qwen3.5's and Qwen3-Next's Gated DeltaNet, never run on a GPU: its
    # kernels against the CPU there (the realistic Dk = Dv = 128 that
    # lavapipe's bindings refuse), the rule's SIMT kernels' rates at the
    # 9B's heads (7·Dk·Dv FLOPs a value head a token forward, twice that
    # backward), then a whole Qwen3.5-9B step (8.95 B parameters, 117 GiB
    # of host memory by `megatrain plan`) at the anchor batch, f16,
    # profiled: how much of it the delta rule takes beside the products.
    cap=60 t ops --nocapture gated_delta causal_conv1d delta_gates sigmoid_mul
    cap=90 b delta_rule --warm-up-time 1 --measurement-time 2
    timeout "$(left 360)" xtask bench-throughput --preset qwen3.5-9b --device gpu --precision f16 \
        --batch 8 --seq-len 1024 --steps 2 --warmup 1 --mode-reps 0 --no-peer --profile \
        --json "$OUT/hybrid-qwen35-9b.json" >"$OUT/hybrid-qwen35-9b.log" 2>&1
    rows "qwen3.5-9b 8x1024 f16 (rc $?)" "$OUT/hybrid-qwen35-9b.log"
    echo "-- per-op profile in $OUT/hybrid-qwen35-9b.log"
    sed -n '/^per-op profile/,/in no op/p' "$OUT/hybrid-qwen35-9b.log" | head -45
    ;;
mainjob)
    # The README's main job on this GPU against karpathy/nanoGPT in the
    # same run (issue 17: at least as fast, val <= 1.90).
    OUT=$OUT timeout "$(left 540)" bash benches/nanogpt_main_job.sh run | tee "$OUT/mainjob.log"
    rc=${PIPESTATUS[0]}
    note "main job (rc $rc): $(sed -n '/^== main job/,$p' "$OUT/mainjob.log" | tail -6 | tr '\n' ';')"
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
    # criterion's row names (alone on their line) and rates; the bus
    # table's rows (transport | MiB | upload | download | …).
    grep -E '^[a-z0-9_]+/[^ ]+$|TFLOP/s|GB/s|thrpt|overlap|^\| (staging|mapped|direct) \| [0-9]' "$f" | tail -40
done
{
    echo "== $stage summary"
    for line in "${summary[@]}"; do echo "$line"; done
} >"$DEST/$stage-summary.txt"
tar -czf "$DEST/$stage-logs.tar.gz" -C "$OUT" .
echo "(logs: $DEST/$stage-logs.tar.gz)"
