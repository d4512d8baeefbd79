#!/usr/bin/env python3
"""PyTorch peer for `cargo xtask bench-throughput`.

Trains the same model shape (Llama family or GPT-2) with the same batch,
sequence length and AdamW as the Rust benchmark, in two ways:

  memory    the whole model and its AdamW state on the device; one
            forward, loss.backward(), optimizer.step() (the usual PyTorch loop);
  streamed  MegaTrain style: fp32 master parameters and AdamW state on the
            CPU; each layer is copied to the device for the forward (only
            layer inputs are kept), copied again for the backward where its
            forward is recomputed and its gradients are sent back to the CPU,
            and the CPU AdamW runs after the whole backward.

The device is CUDA when torch sees a GPU, else the CPU (then "streamed" copies
CPU->CPU and measures the cost of the pattern, not of a bus).

With "autocast": "bf16" every forward (and recompute) runs under
torch.autocast(bfloat16): PyTorch's usual mixed precision, fp32 master
weights and AdamW state as before. A mode that cannot fit (fp32 weights,
gradients and both moments, 16 bytes a parameter, on the device for
"memory", in host RAM for "streamed") is not run and says so.

Usage: torch_peer.py '<json spec>'   prints one JSON object per mode.
Spec keys: arch ("llama"|"gpt2"), vocab, hidden, layers, heads, kv_heads,
head_dim, inter, eps, theta, tie, qkv_bias, batch, seq, steps, warmup, lr,
modes (list), autocast (null or "bf16").
"""

import contextlib
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaBlock(nn.Module):
    def __init__(s, c):
        super().__init__()
        h, d = c["hidden"], c["head_dim"]
        s.nh, s.nkv, s.d, s.eps, s.theta = c["heads"], c["kv_heads"], d, c["eps"], c["theta"]
        s.ln1 = nn.Parameter(torch.ones(h))
        s.q = nn.Linear(h, s.nh * d, bias=c["qkv_bias"])
        s.k = nn.Linear(h, s.nkv * d, bias=c["qkv_bias"])
        s.v = nn.Linear(h, s.nkv * d, bias=c["qkv_bias"])
        s.o = nn.Linear(s.nh * d, h, bias=False)
        s.ln2 = nn.Parameter(torch.ones(h))
        s.gate = nn.Linear(h, c["inter"], bias=False)
        s.up = nn.Linear(h, c["inter"], bias=False)
        s.down = nn.Linear(c["inter"], h, bias=False)

    def rope(s, x):  # x: [B, H, T, D], half-split rotate_half layout
        t, d = x.shape[2], s.d
        inv = 1.0 / (s.theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        f = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(s, x):
        b, t, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), s.ln1, s.eps)
        q = s.rope(s.q(h).view(b, t, s.nh, s.d).transpose(1, 2))
        k = s.rope(s.k(h).view(b, t, s.nkv, s.d).transpose(1, 2))
        v = s.v(h).view(b, t, s.nkv, s.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.nkv != s.nh)
        x = x + s.o(a.transpose(1, 2).reshape(b, t, s.nh * s.d))
        h = F.rms_norm(x, (x.shape[-1],), s.ln2, s.eps)
        return x + s.down(F.silu(s.gate(h)) * s.up(h))


class Gpt2Block(nn.Module):
    def __init__(s, c):
        super().__init__()
        h = c["hidden"]
        s.nh, s.d = c["heads"], c["head_dim"]
        s.ln1 = nn.LayerNorm(h, eps=c["eps"])
        s.qkv = nn.Linear(h, 3 * h)
        s.o = nn.Linear(h, h)
        s.ln2 = nn.LayerNorm(h, eps=c["eps"])
        s.fc = nn.Linear(h, c["inter"])
        s.proj = nn.Linear(c["inter"], h)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, s.nh, s.d).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.o(a.transpose(1, 2).reshape(b, t, h))
        return x + s.proj(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class Embedding(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.tok = nn.Embedding(c["vocab"], c["hidden"])
        s.pos = nn.Embedding(c["seq"], c["hidden"]) if c["arch"] == "gpt2" else None

    def forward(s, ids):
        x = s.tok(ids)
        if s.pos is not None:
            x = x + s.pos(torch.arange(ids.shape[1], device=ids.device))
        return x


class Head(nn.Module):
    """Final norm and LM head; with tied embeddings the table is passed in."""

    def __init__(s, c):
        super().__init__()
        h = c["hidden"]
        s.norm = nn.LayerNorm(h, eps=c["eps"]) if c["arch"] == "gpt2" else None
        s.gain = None if c["arch"] == "gpt2" else nn.Parameter(torch.ones(h))
        s.eps = c["eps"]
        s.lm = None if c["tie"] else nn.Linear(h, c["vocab"], bias=False)

    def forward(s, x, targets, table=None):
        x = s.norm(x) if s.norm is not None else F.rms_norm(x, (x.shape[-1],), s.gain, s.eps)
        logits = x @ table.t() if s.lm is None else s.lm(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(c):
    block = Gpt2Block if c["arch"] == "gpt2" else LlamaBlock
    torch.manual_seed(0)
    layers = [Embedding(c)] + [block(c) for _ in range(c["layers"])] + [Head(c)]
    for m in layers:
        for p in m.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
    return layers


def autocast(c, dev):
    if c.get("autocast") == "bf16":
        return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    if c.get("autocast") not in (None, "fp32"):
        raise ValueError(f"autocast {c['autocast']!r}: null or bf16")
    return contextlib.nullcontext()


def count_params(c):
    """Parameters of the model, without allocating it."""
    with torch.device("meta"):
        return sum(p.numel() for m in build(c) for p in m.parameters())


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def does_not_fit(mode, n, dev):
    """Why `mode` cannot hold n parameters' fp32 p, g, m and v, or None."""
    need = 16 * n
    if mode == "memory" and dev.type == "cuda":
        have, where = torch.cuda.get_device_properties(dev).total_memory, "device memory"
    else:
        have, where = mem_available_bytes(), "available host RAM"
    if have is not None and need > 0.9 * have:
        return f"does not fit: {need / 2**30:.1f} GiB of fp32 weights, gradients and AdamW moments, {have / 2**30:.1f} GiB of {where}"
    return None


def adamw(params, c, **kw):
    return torch.optim.AdamW(params, lr=c["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_memory(c, dev, batches):
    layers = [m.to(dev) for m in build(c)]
    emb, blocks, head = layers[0], layers[1:-1], layers[-1]
    params = [p for m in layers for p in m.parameters()]
    opt = adamw(params, c)
    table = emb.tok.weight if c["tie"] else None

    def step(ids, tg):
        with autocast(c, dev):
            x = emb(ids)
            for b in blocks:
                x = b(x)
            loss = head(x, tg, table)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return time_steps(c, dev, batches, step), sum(p.numel() for p in params)


def run_streamed(c, dev, batches):
    """CPU masters, one device copy per layer kind, recompute in backward."""
    cpu = build(c)
    n_params = sum(p.numel() for m in cpu for p in m.parameters())
    pin = dev.type == "cuda"
    if pin:
        for m in cpu:
            for p in m.parameters():
                p.data = p.data.pin_memory()
    opt = adamw([p for m in cpu for p in m.parameters()], c, foreach=True)
    # Device-side templates: weights are copied into them per layer.
    slots = {}

    def slot(i):
        kind = 0 if i == 0 else (2 if i == len(cpu) - 1 else 1)
        if kind not in slots:
            slots[kind] = build_one(c, i, cpu).to(dev)
        dst = slots[kind]
        for d, s in zip(dst.parameters(), cpu[i].parameters()):
            d.data.copy_(s.data, non_blocking=True)
        return dst

    def grads_home(i, m):
        for d, s in zip(m.parameters(), cpu[i].parameters()):
            g = d.grad.detach().to("cpu", non_blocking=False)
            s.grad = g if s.grad is None else s.grad + g
            d.grad = None

    def step(ids, tg):
        n = len(cpu)
        tied = c["tie"]
        with torch.no_grad(), autocast(c, dev):
            inputs = []
            x = slot(0)(ids)
            for i in range(1, n - 1):
                inputs.append(x)
                x = slot(i)(x)
        # Head (and the tied table's gradient through it).
        xh = x.detach().requires_grad_(True)
        h = slot(n - 1)
        if tied:
            table = cpu[0].tok.weight.detach().to(dev).requires_grad_(True)
        else:
            table = None
        with autocast(c, dev):
            loss = h(xh, tg, table)
        loss.backward()
        grads_home(n - 1, h)
        tied_grad = table.grad if tied else None
        dx = xh.grad
        for i in range(n - 2, 0, -1):
            b = slot(i)
            xi = inputs.pop().detach().requires_grad_(True)
            with autocast(c, dev):
                y = b(xi)  # recompute
            y.backward(dx)
            dx = xi.grad
            grads_home(i, b)
        e = slot(0)
        with autocast(c, dev):
            x = e(ids)
        x.backward(dx)
        if tied_grad is not None:
            e.tok.weight.grad += tied_grad
        grads_home(0, e)
        sync(dev)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return time_steps(c, dev, batches, step), n_params


def build_one(c, i, cpu):
    block = Gpt2Block if c["arch"] == "gpt2" else LlamaBlock
    if i == 0:
        return Embedding(c)
    if i == len(cpu) - 1:
        return Head(c)
    return block(c)


def time_steps(c, dev, batches, step):
    times, losses = [], []
    for k, (ids, tg) in enumerate(batches):
        sync(dev)
        t = time.perf_counter()
        losses.append(step(ids.to(dev), tg.to(dev)))
        sync(dev)
        if k >= c["warmup"]:
            times.append(time.perf_counter() - t)
    times.sort()
    return {"step_ms_median": 1e3 * times[len(times) // 2], "step_ms_all": [1e3 * t for t in times], "loss": losses}


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def main():
    c = json.loads(sys.argv[1])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    n_steps = c["warmup"] + c["steps"]
    batches = []
    for _ in range(n_steps):
        seq = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    runners = {"memory": run_memory, "streamed": run_streamed}
    device = str(dev) if dev.type == "cpu" else torch.cuda.get_device_name()
    for mode in c["modes"]:
        head = {"mode": mode, "device": device, "autocast": c.get("autocast")}
        n = count_params(c)
        why = does_not_fit(mode, n, dev)
        if why is not None:
            print(json.dumps({**head, "n_params": n, "error": why}), flush=True)
            continue
        try:
            r, n = runners[mode](c, dev, batches)
        except torch.cuda.OutOfMemoryError as e:
            print(json.dumps({**head, "n_params": n, "error": f"out of device memory: {e}"[:300]}), flush=True)
            continue
        tokens = c["batch"] * c["seq"]
        out = {
            **head,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "n_params": n,
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / (r["step_ms_median"] / 1e3),
            "peak_rss_bytes": peak_rss_bytes(),
            "device_peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None,
            **r,
        }
        if not all(math.isfinite(x) for x in r["loss"]):
            out["error"] = "non-finite loss"
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
