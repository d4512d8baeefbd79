#!/usr/bin/env python3
"""Golden reference fixtures for megatrain-zoo, made with Hugging Face transformers.

For every case: build a small random model (float32 weights, stored as f32 or,
for the loader tests, bf16 / f16), save it with `save_pretrained`, then run it
in float64 with eager attention on a fixed batch and dump input ids, targets,
logits, the loss and the gradient of every parameter (under its HF name) to
`golden.safetensors`.

transformers computes RMSNorm, RoPE angles and the eager-attention softmax in
float32 even for a float64 model; those are patched to stay in float64 here,
and the cross-entropy is computed by this script (mean over targets that are
not -100), so the references are float64-exact for the stored weights.

Also writes a small byte-level BPE `tokenizer.json` (trained locally with the
`tokenizers` package, saved through transformers) with expected encodings.
Nothing is downloaded. Usage (from the repository root):

    .venv/bin/python tools/make_golden.py [--out crates/zoo/tests/fixtures]
"""

import argparse
import json
import shutil
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

BATCH = 2

# name: (config class, model class, config kwargs, seq, stored dtype)
CASES = {
    # GPT-2, tied embeddings, Conv1D weights, learned positions.
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(
            vocab_size=97,
            n_embd=48,
            n_layer=2,
            n_head=4,
            n_positions=32,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
        11,
        torch.float32,
    ),
    # Llama, grouped-query attention (6 heads, 2 kv heads), untied.
    "llama_gqa": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        13,
        torch.float32,
    ),
    # Llama, tied, attention and MLP biases, stored bf16.
    "llama_tied_bf16": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=89,
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=5,
            rms_norm_eps=1e-6,
            rope_theta=500000.0,
            max_position_embeddings=64,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
        9,
        torch.bfloat16,
    ),
    # Mistral, GQA, sliding window longer than the sequence, stored f16.
    "mistral_f16": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            vocab_size=83,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        10,
        torch.float16,
    ),
    # Qwen2: q/k/v biases, tied, GQA, head_dim 14.
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=103,
            hidden_size=56,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
        12,
        torch.float32,
    ),
    # Qwen3: q/k RMSNorm, GQA, head_dim 16 != hidden / heads = 12, untied.
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            vocab_size=91,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        7,
        torch.float32,
    ),
}


# Cases whose config.json is rewritten with transformers v4 field names
# (`torch_dtype`, top-level `rope_theta`), so both spellings are covered.
V4_STYLE = {"llama_gqa", "gpt2"}


def to_v4_config(path: Path):
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        assert rope["rope_type"] == "default"
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = None
    cfg["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ---- float64 patches --------------------------------------------------------

_softmax = F.softmax


def _softmax64(input, dim=None, _stacklevel=3, dtype=None):
    if input.dtype == torch.float64 and dtype == torch.float32:
        dtype = torch.float64
    return _softmax(input, dim=dim, dtype=dtype)


def _rmsnorm64(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _rope64(theta, dim):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    return forward


def patch_float64(model):
    """Keeps every computation of `model` in float64 (see module docstring)."""
    torch.nn.functional.softmax = _softmax64
    cfg = model.config
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm"):
            m.forward = types.MethodType(_rmsnorm64, m)
        elif name.endswith("RotaryEmbedding"):
            params = getattr(cfg, "rope_parameters", None) or {}
            theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
            assert params.get("rope_type", "default") == "default"
            dim = m.inv_freq.shape[0] * 2
            m.forward = types.MethodType(_rope64(theta, dim), m)


def randomize(model, gen):
    """Weights with enough spread that every path matters (norm gains and
    biases away from 1 and 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * r)
            else:
                p.copy_(0.1 * r)


def cross_entropy(logits, targets):
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-100, reduction="mean")


def make_case(out: Path, name, cfg_cls, model_cls, kwargs, seq, store_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg_cls(**kwargs, attn_implementation="eager")
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    model = model_cls(cfg).to(torch.float32)
    randomize(model, gen)
    # Round the weights to the stored dtype so that the float64 reference
    # runs on exactly the values in the file.
    model = model.to(store_dtype)
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model.save_pretrained(case_dir, safe_serialization=True)
    for extra in ("generation_config.json",):
        (case_dir / extra).unlink(missing_ok=True)
    if name in V4_STYLE:
        to_v4_config(case_dir / "config.json")

    model = model.to(torch.float64)
    model.eval()
    patch_float64(model)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=gen)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].clone()
    targets[0, 2] = -100
    targets[1, -1] = -100
    logits = model(input_ids=inputs).logits
    loss = cross_entropy(logits, targets)
    loss.backward()

    golden = {
        "input_ids": inputs.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().to(torch.float64).contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for pname, p in model.named_parameters():
        golden["grad." + pname] = p.grad.to(torch.float32).contiguous()
    save_file(golden, case_dir / "golden.safetensors")
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n} params, seq {seq}, loss {loss.item():.6f}, stored {store_dtype}")


TOKENIZER_TEXT = """First Citizen:
Before we proceed any further, hear me speak.
All: Speak, speak.
First Citizen: You are all resolved rather to die than to famish?
All: Resolved. resolved.
First Citizen: First, you know Caius Marcius is chief enemy to the people.
"""

TOKENIZER_SAMPLES = [
    "Hello, world!",
    "First Citizen: speak, speak.",
    "  spaces\tand\nnewlines ",
    "ünïcödé → 東京 🙂",
    "",
]


def make_tokenizer(out: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TOKENIZER_TEXT] * 4, vocab_size=300, min_frequency=2, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    tdir = out / "tokenizer"
    if tdir.exists():
        shutil.rmtree(tdir)
    tok.save_pretrained(tdir)
    for f in list(tdir.iterdir()):
        if f.name != "tokenizer.json":
            f.unlink()
    expected = [
        {"text": s, "ids": tok.encode(s, add_special_tokens=False), "decoded": tok.decode(tok.encode(s, add_special_tokens=False))}
        for s in TOKENIZER_SAMPLES
    ]
    (tdir / "expected.json").write_text(json.dumps({"vocab_size": len(tok), "samples": expected}, ensure_ascii=False, indent=1))
    print(f"tokenizer: vocab {len(tok)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="crates/zoo/tests/fixtures")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for i, (name, (cfg_cls, model_cls, kwargs, seq, dtype)) in enumerate(CASES.items()):
        make_case(out, name, cfg_cls, model_cls, kwargs, seq, dtype, seed=1000 + i)
    make_tokenizer(out)


if __name__ == "__main__":
    main()
