#!/usr/bin/env python3
"""PyTorch's fused attention on the shapes of `cargo bench -p megatrain-gpu
--bench attention` (f16 rows): torch.nn.functional.scaled_dot_product_attention,
f16, causal, CUDA, grouped-query heads. Prints TFLOP/s forward and backward
with the bench's FLOP counts (causal: forward 4·B·Hq·D·T(T+1)/2, backward
2.5x that), so the two can be compared in one run.

Usage: python3 benches/torch_sdpa.py [--iters N]
Exits 0 with a message when torch or CUDA is missing.
"""

import argparse
import sys

SHAPES = [
    # (B, T, Hq, Hkv, D): Llama-7B-like GQA (Qwen-7B) and Qwen2.5-7B.
    (4, 1024, 32, 8, 128),
    (4, 2048, 32, 8, 128),
    (4, 4096, 32, 8, 128),
    (4, 1024, 28, 4, 128),
    (4, 2048, 28, 4, 128),
    (4, 4096, 28, 4, 128),
]


def flops_fwd(b, t, hq, d):
    return 4 * b * hq * d * t * (t + 1) // 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"torch_sdpa: torch not importable ({e}); skipped")
        return 0
    if not torch.cuda.is_available():
        print("torch_sdpa: torch has no CUDA device; skipped")
        return 0
    dev = torch.device("cuda")
    print(f"torch_sdpa: torch {torch.__version__} on {torch.cuda.get_device_name(dev)}")

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.iters):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        return times[len(times) // 2]

    for b, t, hq, hkv, d in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, hq, t, d, device=dev, dtype=torch.float16, generator=g, requires_grad=True)
        k = torch.randn(b, hkv, t, d, device=dev, dtype=torch.float16, generator=g, requires_grad=True)
        v = torch.randn(b, hkv, t, d, device=dev, dtype=torch.float16, generator=g, requires_grad=True)
        dout = torch.randn(b, hq, t, d, device=dev, dtype=torch.float16, generator=g)
        try:
            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            fwd()
        except TypeError:
            # torch < 2.5: no enable_gqa; the heads are expanded outside the timing.
            rep = hq // hkv
            ke = k.detach().repeat_interleave(rep, dim=1).requires_grad_(True)
            ve = v.detach().repeat_interleave(rep, dim=1).requires_grad_(True)

            def fwd():
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        def fwd_only():
            with torch.no_grad():
                fwd()

        def fwd_bwd():
            o = fwd()
            o.backward(dout)

        tf = timed(fwd_only)
        tfb = timed(fwd_bwd)
        tb = max(tfb - tf, 1e-9)
        fl = flops_fwd(b, t, hq, d)
        name = f"B{b}_T{t}_Hq{hq}_Hkv{hkv}_D{d}"
        print(
            f"torch_sdpa f16 {name}: fwd {tf * 1e3:.3f} ms {fl / tf / 1e12:.1f} TFLOP/s, "
            f"bwd {tb * 1e3:.3f} ms {2.5 * fl / tb / 1e12:.1f} TFLOP/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
