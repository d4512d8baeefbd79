#!/usr/bin/env python3
"""PyTorch's host<->device copy rate, the peer of `bench transport`.

    python3 benches/torch_copy.py --sizes-mib 16,64,256,1024 --reps 5

Per size: GB/s (1e9 B/s) of `copy_` host->device and device->host from pinned
memory and from pageable memory, and of both directions at once (pinned, two
streams). Medians of --reps after one warm-up. Prints one JSON object; exits 2
with a message on stderr where torch or CUDA is missing.
"""

import argparse
import json
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="16,64,256,1024")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no peer
        print(f"torch not importable: {e}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("torch has no CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    rows = []
    for mib in [int(x) for x in a.sizes_mib.split(",") if x]:
        n = mib << 20
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        d1 = torch.empty(n, dtype=torch.uint8, device=dev)
        d2 = torch.empty(n, dtype=torch.uint8, device=dev)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            with torch.cuda.stream(s1):
                d1.copy_(pinned, non_blocking=True)
            with torch.cuda.stream(s2):
                pinned2.copy_(d2, non_blocking=True)

        r = {"mib": mib}
        r["up_pinned_gbs"] = n / timed(lambda: d1.copy_(pinned, non_blocking=True), a.reps) / 1e9
        r["down_pinned_gbs"] = n / timed(lambda: pinned.copy_(d1, non_blocking=True), a.reps) / 1e9
        r["up_pageable_gbs"] = n / timed(lambda: d1.copy_(pageable), a.reps) / 1e9
        r["down_pageable_gbs"] = n / timed(lambda: pageable.copy_(d1), a.reps) / 1e9
        r["both_pinned_gbs"] = 2 * n / timed(both, a.reps) / 1e9
        rows.append(r)
        del pinned, pinned2, pageable, d1, d2
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "sizes": rows}))


if __name__ == "__main__":
    main()
