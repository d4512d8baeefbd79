#!/usr/bin/env python3
"""PyTorch's cross-entropy with label smoothing, for megatrain's
`Executor::cross_entropy` (`LossTerms::label_smoothing`).

For a few float64 logits (one row's target ignored, one row of large
logits) and smoothing factors, it writes what
`torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100,
label_smoothing=eps)` gives per row (`reduction="none"`), its mean
(`reduction="mean"`: over the counted rows) and the mean's gradient with
respect to the logits. The Rust test `crates/tensor/tests/loss_golden.rs`
computes the same from `losses` and `uniform_losses` as
(1 − ε)·loss + ε·uniform, and compares `dlogits` at `grad_scale` =
1 / counted rows.

Usage (from the repository root):

    .venv/bin/python tools/make_loss_golden.py   # writes crates/tensor/tests/fixtures/label_smoothing.json
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent.parent / "crates/tensor/tests/fixtures/label_smoothing.json"


def main():
    g = torch.Generator().manual_seed(20261130)
    rows, vocab = 6, 11
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3.0
    logits[4] += 40.0  # large logits: the log-sum-exp must not overflow
    targets = torch.tensor([3, -100, 10, 0, 7, 5])
    cases = []
    # Factors exact in f32, which is how the executor takes them.
    for eps in [0.0, 0.125, 0.375, 1.0]:
        x = logits.clone().requires_grad_(True)
        mean = F.cross_entropy(x, targets, ignore_index=-100, label_smoothing=eps)
        mean.backward()
        per_row = F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=eps, reduction="none")
        cases.append(
            {
                "label_smoothing": eps,
                "per_row": per_row.tolist(),
                "mean": mean.item(),
                "dlogits": x.grad.flatten().tolist(),
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "torch": torch.__version__,
        "rows": rows,
        "vocab": vocab,
        "ignore_index": -100,
        "logits": logits.flatten().tolist(),
        "targets": targets.tolist(),
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
