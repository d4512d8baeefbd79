#!/usr/bin/env python3
"""PyTorch's fused CPU AdamW as a peer for `cargo xtask bench-adamw`.

Times one optimizer step on a single flat fp32 parameter of --params elements
(update alone), then the update followed by a bf16 copy of the parameters into
a preallocated buffer (what megatrain's fused pass writes in the same sweep).
Same accounting as the Rust bench: 28 B/param for the update, 30 with the bf16
copy. Best and median of --iters timed steps after 2 warm-up steps.

    /work/main/.venv/bin/python benches/torch_adamw.py --params 100000000 --threads 1 2
"""

import argparse
import json
import statistics
import time

import torch


def timed(fn, iters):
    for _ in range(2):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out), statistics.median(out)


def run(n, threads, iters, fused):
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32) * 0.5 + 0.5)
    p.grad = (torch.rand(n, dtype=torch.float32) - 0.5) * 1e-3
    copy = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=fused)

    def update():
        opt.step()

    def update_bf16():
        opt.step()
        with torch.no_grad():
            copy.copy_(p)

    rows = []
    for name, fn, nbytes in [("update", update, 28), ("update+bf16", update_bf16, 30)]:
        best, med = timed(fn, iters)
        rows.append(
            {
                "variant": name,
                "bytes_per_param": nbytes,
                "ms_best": best * 1e3,
                "ms_median": med * 1e3,
                "params_per_s": n / best,
                "gb_per_s": nbytes * n / best / 1e9,
            }
        )
    return {"threads": threads, "params": n, "fused": fused, "adamw": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--foreach", action="store_true", help="use the foreach (unfused) implementation")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    runs = [run(a.params, t, a.iters, fused=not a.foreach) for t in a.threads]
    if a.json:
        print(json.dumps({"bench": "torch_adamw", "torch": torch.__version__, "runs": runs}, indent=2))
        return
    for r in runs:
        impl = "fused" if r["fused"] else "foreach"
        print(f"torch {torch.__version__} AdamW ({impl}): {r['params']} params, {r['threads']} thread(s)")
        print(f"  {'variant':<14} {'B/par':>5} {'ms best':>9} {'ms med':>9} {'Mparams/s':>11} {'GB/s':>8}")
        for row in r["adamw"]:
            print(
                f"  {row['variant']:<14} {row['bytes_per_param']:>5} {row['ms_best']:>9.1f} "
                f"{row['ms_median']:>9.1f} {row['params_per_s'] / 1e6:>11.0f} {row['gb_per_s']:>8.2f}"
            )


if __name__ == "__main__":
    main()
