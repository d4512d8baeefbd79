#!/usr/bin/env python3
"""Writes a narrow Qwen2-shaped model (config.json + model.safetensors, f32)
into the directory given: head_dim 128 like Qwen2.5-7B's, but 4 layers of
width 512, so a host-floor run (`bench-throughput --device gpu-noop
--model DIR`) has a 7B-like attention geometry at a few MB of weights.
Standard library only; the weights are a repeated N(0, 0.02) pattern (the
noop backend computes nothing with them)."""
import array
import json
import random
import struct
import sys
from pathlib import Path

H, I, L, V, NH, NKV = 512, 1024, 4, 256, 4, 2
HD = H // NH

out = Path(sys.argv[1] if len(sys.argv) > 1 else "narrow-qwen")
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": V,
    "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
    "num_attention_heads": NH, "num_key_value_heads": NKV,
    "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
}, indent=1))

shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
for i in range(L):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
        p + "self_attn.k_proj.weight": (NKV * HD, H), p + "self_attn.k_proj.bias": (NKV * HD,),
        p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.v_proj.bias": (NKV * HD,),
        p + "self_attn.o_proj.weight": (H, H),
        p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
    })
random.seed(0)
pattern = array.array("f", [random.gauss(0, 0.02) for _ in range(1 << 16)])
header, blobs, off = {}, [], 0
for name, shape in shapes.items():
    n = 1
    for d in shape:
        n *= d
    data = (pattern * (n // len(pattern) + 1))[:n] if len(shape) > 1 else array.array("f", [1.0] * n)
    b = data.tobytes()
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + len(b)]}
    off += len(b)
    blobs.append(b)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
with open(out / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for b in blobs:
        f.write(b)
print(f"{out}: {off / 1e6:.1f} MB of f32 weights")
