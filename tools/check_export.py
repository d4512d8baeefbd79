#!/usr/bin/env python3
"""Loads megatrain-zoo exports with transformers and checks their logits.

Each directory under OUT (written by
`cargo run -p megatrain-zoo --example export_check -- OUT`) holds an HF
checkpoint exported by megatrain and `rust_logits.safetensors` with input ids
and the logits megatrain's CpuExecutor (f32) computed. This script loads the
export with `AutoModelForCausalLM.from_pretrained`, runs it in float64 (same
patches as make_golden.py) and requires

  * transformers(export) vs megatrain logits: relative norm error < 1e-5;
  * transformers(export) vs the golden logits of the original fixture (when
    present): < 1e-12, i.e. the export holds exactly the weights that went in.

Exit status 0 when every directory passes.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from make_golden import patch_float64  # noqa: E402


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    failed = 0
    dirs = sorted(p for p in out.iterdir() if (p / "rust_logits.safetensors").exists())
    if not dirs:
        sys.exit(f"no exports under {out}")
    for d in dirs:
        ref = load_file(d / "rust_logits.safetensors")
        # A mixture of experts' per-expert loop runs in float64 (grouped_mm does not).
        model = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
        )
        # GLM-4.5's router declares its weight and correction bias float32
        # whatever the model's dtype: widened here as make_golden.py does.
        model = model.to(torch.float64)
        model.eval()
        patch_float64(model)
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"].long()).logits
        e_rust = rel(ref["logits"].double(), logits)
        ok = e_rust < 1e-5
        line = f"{d.name:>16}: {type(model).__name__:<20} vs megatrain {e_rust:.1e}"
        if "golden_logits" in ref:
            e_gold = rel(logits, ref["golden_logits"])
            ok &= e_gold < 1e-12
            line += f"  vs golden {e_gold:.1e}"
        print(line + ("" if ok else "  FAILED"))
        failed += not ok
    print(f"{len(dirs) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
