#!/usr/bin/env bash
# The tensor-core kernels without a GPU: Mesa 26's lavapipe has cooperative
# matrices (Debian 12's Mesa 22 has none). This fetches it from Debian 13's
# backports with the Debian 13 runtime it needs (libc, libstdc++, LLVM 19:
# 39 packages, 65 MB, unpacked with dpkg -x; nothing is installed) and
# runs programs under that runtime with MEGATRAIN_LAVAPIPE_COOP=1, so the
# GPU executor uses cooperative matrices on it (crates/gpu/src/context.rs).
# It also brings Debian 13's spirv-val (2025.1), which validates the
# tensor-core variants' SPIR-V where Debian 12's (2023.1) cannot.
#
#   bash tools/lavapipe_coop.sh fetch              # once; idempotent
#   bash tools/lavapipe_coop.sh exec PROGRAM ARGS  # one program under it
#   bash tools/lavapipe_coop.sh test ARGS          # cargo test ARGS, every
#                                                  # test binary under it
#   bash tools/lavapipe_coop.sh spirv-val          # prints the path of a
#                                                  # spirv-val for MEGATRAIN_SPIRV_VAL
# e.g.  bash tools/lavapipe_coop.sh test -p megatrain-gpu --test f16 -- tensor_core
# A program a test spawns (the CLI tests' `megatrain`) runs outside that
# runtime and cannot load this lavapipe: leave those tests out.
#
# LLVM compiles each hardware variant in 7-17 s here (Mesa caches them in
# ~/.cache/mesa_shader_cache): all of them, the README's hardware tier,
# take about 23 minutes on 2 cores from an empty cache.
# Where: $MEGATRAIN_LAVAPIPE_DIR, default ~/.cache/megatrain/lavapipe-coop.
set -euo pipefail
DIR=${MEGATRAIN_LAVAPIPE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/megatrain/lavapipe-coop}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$DIR/root
LIB=$ROOT/usr/lib/x86_64-linux-gnu
# Names what a finished fetch holds; a new one re-fetches older caches.
READY=$DIR/ready-lavapipe-spirv-val

fetch() {
    [ -f "$READY" ] && return 0
    command -v python3 >/dev/null || { echo "lavapipe_coop.sh: fetch needs python3" >&2; exit 1; }
    mkdir -p "$DIR/debs"
    for suite in trixie trixie-backports; do
        curl -fsS "$MIRROR/dists/$suite/main/binary-amd64/Packages.xz" | xz -d >"$DIR/Packages.$suite"
    done
    # mesa-vulkan-drivers from backports, everything it needs from trixie.
    python3 - "$DIR" >"$DIR/files" <<'EOF'
import re, sys
d = sys.argv[1]
def index(suite):
    pk = {}
    for block in open(f"{d}/Packages.{suite}").read().split("\n\n"):
        f = dict(re.findall(r"^([A-Za-z-]+): (.*)$", block, re.M))
        if "Package" in f:
            pk.setdefault(f["Package"], f)
            for p in f.get("Provides", "").split(","):
                if p.strip():
                    pk.setdefault(p.strip().split(" ")[0], f)
    return pk
trixie, bpo = index("trixie"), index("trixie-backports")
skip = {"debconf", "debconf-2.0", "perl-base", "dpkg", "libc-bin"}
todo, seen = ["mesa-vulkan-drivers", "libvulkan1", "spirv-tools"], {}
while todo:
    n = todo.pop()
    if n in seen or n in skip:
        continue
    f = bpo[n] if n == "mesa-vulkan-drivers" else trixie.get(n)
    if f is None:
        sys.exit(f"lavapipe_coop.sh: no package {n} in Debian 13")
    seen[n] = seen[f["Package"]] = f
    for dep in (f.get("Depends", "") + "," + f.get("Pre-Depends", "")).split(","):
        name = dep.split("|")[0].strip().split(" ")[0].split(":")[0]
        if name:
            todo.append(name)
print("\n".join(sorted({f["Filename"] for f in seen.values()})))
EOF
    while read -r f; do
        local deb=$DIR/debs/$(basename "$f")
        if [ ! -f "$deb" ]; then
            curl -fsS -o "$deb.part" "$MIRROR/$f"
            mv "$deb.part" "$deb"
        fi
        dpkg -x "$deb" "$ROOT"
    done <"$DIR/files"
    [ -f "$LIB/libvulkan_lvp.so" ] || { echo "lavapipe_coop.sh: no libvulkan_lvp.so in the packages" >&2; exit 1; }
    mkdir -p "$DIR/bin"
    printf '#!/bin/sh\nexec %s --library-path %s %s "$@"\n' "$ROOT/usr/lib64/ld-linux-x86-64.so.2" "$LIB" \
        "$ROOT/usr/bin/spirv-val" >"$DIR/bin/spirv-val"
    chmod +x "$DIR/bin/spirv-val"
    printf '{"file_format_version": "1.0.1", "ICD": {"library_path": "%s", "api_version": "1.4.0"}}\n' \
        "$LIB/libvulkan_lvp.so" >"$DIR/lvp_icd.json"
    touch "$READY"
}

# Debian 13's loader, lavapipe and nothing else (wgpu's GL backend would
# find Debian 12's llvmpipe too).
run() {
    exec env VK_DRIVER_FILES="$DIR/lvp_icd.json" WGPU_BACKEND=vulkan MEGATRAIN_LAVAPIPE_COOP=1 \
        "$ROOT/usr/lib64/ld-linux-x86-64.so.2" --library-path "$LIB" "$@"
}

case ${1:-} in
fetch) fetch ;;
exec)
    shift
    fetch
    run "$@"
    ;;
spirv-val)
    fetch
    echo "$DIR/bin/spirv-val"
    ;;
test)
    shift
    fetch
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="bash $(realpath "$0") exec" exec cargo test "$@"
    ;;
*)
    echo "usage: lavapipe_coop.sh fetch | exec PROGRAM ARGS | test CARGO-TEST-ARGS | spirv-val" >&2
    exit 2
    ;;
esac
