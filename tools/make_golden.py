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
not -100), so the references are float64-exact for the stored weights. For
GPT-OSS (whose load-balancing loss transformers also sums in float32) every
op of the forward and backward is checked to stay float64 (Float32Watch);
likewise for GLM-4.5 and DeepSeek-V3, whose (identical) router
transformers runs in float32 (patched to float64 here; the f32 router is
checked to choose the same experts), and for DeepSeek-V2, whose softmax
router and complex-valued RoPE (complex64) transformers runs in float32
(both patched likewise). DeepSeek-V3's and DeepSeek-V2's checkpoints are
also loaded back with from_pretrained and must reproduce the golden bit for
bit. Likewise (watched and reloaded) Qwen3.5, Qwen3.5-MoE and Qwen3-Next,
whose Gated DeltaNet (its gates and the gated delta rule), gated and
zero-centred RMSNorms and RoPE transformers computes in float32: ported to
float64 here, and the ported forward checked against transformers' own;
likewise OLMo Hybrid (its own DeltaNet's projections, gated norm and
float32 RoPE; its q / k / v conv tensors rewritten at their real widths, as
the Hub has them, where transformers' save writes equal thirds) and
Qwen3.5's multimodal class (its text stack's gradients under the text
model's names, its checkpoint with multi-token-prediction tensors
transformers ignores), and Kimi Linear (its Kimi Delta Attention: forget
gate, delta rule with per-key-channel decays and sigmoid-gated norm, all
float32 in transformers; its DeepSeek-V3 router; its dense blocks' MLPs
renamed back to the Hub's `mlp.`, which transformers' save writes as
`block_sparse_moe.`).
The GPT-OSS MXFP4 case stores its experts as OpenAI publishes them (see
MXFP4 below) and also dumps their dequantized weights.

Also writes a small byte-level BPE `tokenizer.json` (trained locally with the
`tokenizers` package, saved through transformers) with expected encodings.
Nothing is downloaded. Usage (from the repository root):

    .venv/bin/python tools/make_golden.py [--out crates/zoo/tests/fixtures] [--only CASE ...]
"""

import argparse
import copy
import importlib
import json
import math
import shutil
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Cohere2Config,
    Cohere2ForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma3TextConfig,
    Gemma3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    OlmoHybridConfig,
    OlmoHybridForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

BATCH = 2

# GPT-OSS's SwiGLU clamp for the golden cases (7.0 in the released models):
# low enough for these small models' activations that the gate's upper clamp
# and the up projection's two-sided clamp both bind on a good share of entries
# (make_case prints the shares).
SWIGLU_LIMIT_GPT_OSS = 0.6
SWIGLU_LIMIT_GPT_OSS_MXFP4 = 0.4

# name: (config class, model class, config kwargs, seq, stored dtype)
# A case's seed is 1000 + its place here: append new cases, or every case
# after the new one draws other weights (olmo2's and qwen3_moe_raw's
# committed fixtures were made at an earlier place, seeds 1009 and 1034).
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
    # Llama 3.1's RoPE scaling (`rope_type` llama3) with an original context
    # of 64, so that head_dim 16 has pairs kept, blended and divided.
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        14,
        torch.float32,
    ),
    # Qwen2 with YaRN (factor 4 over an original context of 32): blended
    # frequencies and cos/sin scaled by the attention factor.
    "qwen2_yarn": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=79,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
            ),
            max_position_embeddings=128,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # Phi-3: fused qkv_proj and gate_up_proj, GQA, a sliding window longer
    # than the sequence, untied.
    "phi3": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            vocab_size=87,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            sliding_window=16,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        12,
        torch.float32,
    ),
    # Phi-3.5's LongRoPE over an original context of 8, so a sequence of 12
    # uses the long factors; attention factor from the contexts' ratio.
    "phi3_longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            vocab_size=71,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=128,
            original_max_position_embeddings=8,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.5, 9.0],
            ),
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        12,
        torch.float32,
    ),
    # OLMo 2: norms after attention and MLP, q/k RMSNorm over whole
    # projections, GQA, untied.
    "olmo2": (
        Olmo2Config,
        Olmo2ForCausalLM,
        dict(
            vocab_size=93,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # Mistral with a sliding window of 4 over 11 positions: each query sees
    # only its last 4 keys (kv > q - window), GQA, stored f32.
    "mistral_window": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            vocab_size=79,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            sliding_window=4,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # Qwen2 with use_sliding_window on every layer (max_window_layers = 0),
    # a window of 3 over 10 positions.
    "qwen2_window": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=73,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=0,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
        10,
        torch.float32,
    ),
    # Phi-4-mini's arrangement: a partial rotary factor of 0.75 (12 of each
    # head's 16 entries rotate, the last 4 pass through) under LongRoPE
    # (6 factors, long ones past an original context of 8), and a sliding
    # window of 5 over 12 positions.
    "phi3_partial": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            vocab_size=67,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            partial_rotary_factor=0.75,
            max_position_embeddings=128,
            original_max_position_embeddings=8,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.2, 1.5, 2.0, 2.6, 3.3],
                long_factor=[1.0, 1.7, 3.0, 5.0, 8.0, 12.0],
            ),
            sliding_window=5,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        12,
        torch.float32,
    ),
    # Qwen2 with use_sliding_window from block 1 of 3 on (max_window_layers
    # = 1): block 0 attends to every earlier key, blocks 1 and 2 to 4.
    "qwen2_window_layers": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=71,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # OLMo 3: OLMo 2's block; blocks 0-2 slide (window 3), block 3 attends
    # to all; YaRN (factor 4 over an original context of 4) on block 3
    # only, the sliding blocks' RoPE plain, θ 500000 (Olmo3Config's).
    "olmo3": (
        Olmo3Config,
        Olmo3ForCausalLM,
        dict(
            vocab_size=89,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            sliding_window=3,
            max_position_embeddings=64,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4),
            tie_word_embeddings=False,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # SmolLM3: Llama's block with q/k/v/o biases; block 3 of 4 without
    # RoPE (NoPE), and under use_sliding_window that block slides (window
    # 4); θ 2000000 (SmolLM3Config's); tied embeddings (its default).
    "smollm3": (
        SmolLM3Config,
        SmolLM3ForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=4,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=0,
        ),
        11,
        torch.float32,
    ),
    # Granite 3: Llama's block scaled: embeddings times 12, sublayer
    # outputs times 0.22 into the residual stream, attention scores times
    # 0.15 (not 1/sqrt(12)), logits divided by 8; q/k/v/o biases, tied.
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        dict(
            vocab_size=91,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            attention_bias=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.15,
            logits_scaling=8.0,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # StarCoder2: LayerNorms and every linear with biases, a GELU (tanh)
    # MLP, GQA with RoPE, a sliding window of 5 over 12 positions, tied.
    "starcoder2": (
        Starcoder2Config,
        Starcoder2ForCausalLM,
        dict(
            vocab_size=85,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            norm_epsilon=1e-5,
            rope_theta=100000.0,
            sliding_window=5,
            use_bias=True,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
        12,
        torch.float32,
    ),
    # Llama with dynamic NTK RoPE (factor 2) past its context of 8: 12
    # positions, so the forward's base is the scaled one.
    "llama_dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=77,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=dict(rope_type="dynamic", factor=2.0),
            max_position_embeddings=8,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # GLM-4: q/k/v biases (GlmConfig's default), gate_up_proj fused, RoPE
    # on half of each head (the default factor, not written) in
    # neighbouring pairs; head_dim written (GlmConfig's default is 128).
    "glm": (
        GlmConfig,
        GlmForCausalLM,
        dict(
            vocab_size=81,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            eos_token_id=0,
        ),
        11,
        torch.float32,
    ),
    # GLM-4-0414: GLM's block with norms after the attention and the MLP
    # too; a partial factor of 0.75 written, head_dim 16.
    "glm4": (
        Glm4Config,
        Glm4ForCausalLM,
        dict(
            vocab_size=83,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.75,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # EXAONE 4: OLMo 2's post-norm block with q/k norms per head; blocks
    # 0-2 slide (window 3), block 3 attends to all without RoPE.
    "exaone4": (
        Exaone4Config,
        Exaone4ForCausalLM,
        dict(
            vocab_size=79,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=3,
            sliding_window_pattern=4,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # Phi-2: attention and GELU MLP side by side from one LayerNorm, biases
    # everywhere (the LM head's too), RoPE on part of each head (Phi-2's
    # 0.4; 0.375 here: 6 of 16 entries), GQA.
    "phi2": (
        PhiConfig,
        PhiForCausalLM,
        dict(
            vocab_size=87,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.375,
            layer_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        ),
        12,
        torch.float32,
    ),
    # Cohere 2 (Command R7B): attention and SwiGLU MLP side by side from
    # one LayerNorm without bias; blocks 0-2 slide (window 4) with RoPE in
    # neighbouring pairs, block 3 attends to all without RoPE; logits times
    # 0.25; tied; pad token 0.
    "cohere2": (
        Cohere2Config,
        Cohere2ForCausalLM,
        dict(
            vocab_size=91,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_norm_eps=1e-5,
            rope_theta=10000.0,
            logit_scale=0.25,
            sliding_window=4,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=5,
            eos_token_id=6,
        ),
        11,
        torch.float32,
    ),
    # Cohere Command R: Cohere 2's block on every block with RoPE, no window;
    # logits times 0.5, untied, head_dim written (not hidden / heads).
    "cohere": (
        CohereConfig,
        CohereForCausalLM,
        dict(
            vocab_size=93,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            layer_norm_eps=1e-5,
            rope_theta=10000.0,
            logit_scale=0.5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=5,
            eos_token_id=6,
        ),
        10,
        torch.float32,
    ),
    # Gemma 3 (text): sandwich norms with gains 1 + w, q/k norms per head,
    # GeGLU, embeddings times sqrt(48), scores times 24^-1/2 (not 16's),
    # GQA 4/1 (Gemma 3 1B's); blocks 0, 1, 3 slide (window 4) with RoPE
    # theta 500, block 2 attends to all with theta 10000 scaled linearly by
    # 2; tied; pad token 0.
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=24,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_local_base_freq=500.0,
            rope_scaling=dict(rope_type="linear", factor=2.0),
            sliding_window=4,
            sliding_window_pattern=3,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
        11,
        torch.float32,
    ),
    # Gemma 2: Gemma 3's block without q/k norms; scores soft-capped at 2
    # and logits at 1.5 (their defaults, 50 and 30, would barely bend this
    # small model's), scores times 20^-1/2; blocks 0 and 2 slide (window 4),
    # block 1 attends to all; RoPE theta 500 on every block; GQA 4/2; tied.
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=20,
            rms_norm_eps=1e-6,
            rope_theta=500.0,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=1.5,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
        11,
        torch.float32,
    ),
    # Gemma 3's multimodal class (the 4B, 12B and 27B checkpoints): a text
    # stack like gemma3's (GQA 4/2, blocks 0 and 1 slide, window 4, RoPE
    # theta 300 there) under `language_model.`, beside a one-block vision
    # tower and the projector, which megatrain leaves out. The golden holds
    # text-only logits and the text stack's gradients under Gemma3ForCausalLM's
    # names.
    "gemma3_mm": (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        dict(
            text_config=dict(
                vocab_size=97,
                hidden_size=48,
                intermediate_size=80,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_theta=10000.0,
                rope_local_base_freq=300.0,
                sliding_window=4,
                sliding_window_pattern=3,
                max_position_embeddings=64,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            boi_token_index=94,
            eoi_token_index=95,
            image_token_index=96,
        ),
        9,
        torch.float32,
    ),
    # GPT-NeoX (Pythia): two LayerNorms feeding attention and MLP side by
    # side, q/k/v fused head by head, RoPE on a quarter of each head (4 of
    # 16, theta 500), the exact GELU, biases everywhere, untied; v4 names
    # (rotary_pct, rotary_emb_base) in its config.json.
    "gpt_neox": (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            rotary_emb_base=500.0,
            max_position_embeddings=64,
            layer_norm_eps=1e-5,
            hidden_act="gelu",
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
        10,
        torch.float32,
    ),
    # GPT-NeoX one sublayer after the other, half of each head rotated,
    # the tanh GELU, no attention biases, a tied head.
    "gpt_neox_seq": (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        dict(
            vocab_size=89,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            rotary_pct=0.5,
            max_position_embeddings=64,
            hidden_act="gelu_new",
            use_parallel_residual=False,
            attention_bias=False,
            tie_word_embeddings=True,
        ),
        9,
        torch.float32,
    ),
    # GPT-2 with the exact GELU (`activation_function` `gelu`, as
    # Cerebras-GPT's), an MLP of 80.
    "gpt2_erf": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(
            vocab_size=83,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_inner=80,
            n_positions=64,
            activation_function="gelu",
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # Mixtral: 4 experts, 2 per token renormalised, GQA, untied.
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        13,
        torch.float32,
    ),
    # Qwen3-MoE: 6 experts, 3 per token renormalised, per-head q/k norms,
    # the middle block dense (mlp_only_layers).
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=72,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # Mixtral with more experts than tokens (8, one a token, 2 × 3
    # tokens): at least two experts serve no token and get zero gradients.
    "mixtral_sparse": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            vocab_size=53,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_local_experts=8,
            num_experts_per_tok=1,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        3,
        torch.float32,
    ),
    # OLMoE: RMSNorms of the whole q and k projections, 5 experts, 2 a
    # token, not renormalised; GQA.
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(
            vocab_size=71,
            hidden_size=48,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        ),
        10,
        torch.float32,
    ),
    # Mixtral with the routers' load-balancing loss (output_router_logits)
    # added to the loss.
    "mixtral_aux": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        7,
        torch.float32,
    ),
    # Qwen3-MoE's load-balancing loss over its routed blocks only (the
    # middle one dense), the top k not renormalised.
    "qwen3_moe_aux": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            vocab_size=67,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            output_router_logits=True,
            router_aux_loss_coef=0.1,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        8,
        torch.float32,
    ),
    # Qwen2-MoE: q/k/v biases, 4 experts, 2 a token, beside a shared
    # expert under its sigmoid gate; the last block dense.
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            vocab_size=83,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[2],
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        9,
        torch.float32,
    ),
    # Qwen3-MoE without renormalising the top-k probabilities.
    "qwen3_moe_raw": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
        9,
        torch.float32,
    ),
    # GPT-OSS: q/k/v/o biases, a learned sink per head beside each row of
    # scores, blocks 0 and 2 slide (window 4 over 11 positions), block 1
    # attends to all; YaRN as GPT-OSS ships it (factor 32 over 4096, betas
    # 32 / 1, truncate false, theta 150000), cos/sin of half a head applied
    # to its two halves; the router a linear with bias, top 2 of 4 logits
    # softmaxed; experts fused with gate and up interleaved, biases, and
    # the clamped SwiGLU (alpha 1.702) with a limit low enough that both
    # clamps bind on a good share of entries.
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=SWIGLU_LIMIT_GPT_OSS,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # GPT-OSS with the routers' load-balancing loss (output_router_logits)
    # added to the loss at 0.05.
    "gpt_oss_aux": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            vocab_size=73,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=SWIGLU_LIMIT_GPT_OSS,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # GPT-OSS as OpenAI publishes it: the experts' gate_up_proj and
    # down_proj MXFP4 (`_blocks` / `_scales`, see MXFP4 below) under the
    # hub's quantization_config, everything else f32; the golden also holds
    # the dequantized weights (`dequant.<name>`). Hidden 64 (two MXFP4
    # blocks a row of gate_up_proj), intermediate 32 (one a row of
    # down_proj); 4 heads of 8, so heads × head_dim (32) is not hidden.
    "gpt_oss_mxfp4": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            vocab_size=61,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=SWIGLU_LIMIT_GPT_OSS_MXFP4,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # GLM-4.5 (Glm4MoeForCausalLM): q/k/v biases (o_proj none), per-head
    # q/k RMSNorms, RoPE on the first half of each head (the default 0.5:
    # 8 of 16 entries) in halves, 4 heads of 16 over a hidden 32, GQA 4/2;
    # block 0 dense, blocks 1-2 routed: the router's sigmoid scores plus a
    # random e_score_correction_bias (a buffer in the checkpoint, no
    # gradient) pick 2 of 8 experts within the best 1 of 2 groups (a
    # group's score the sum of its top 2), weighted by the unbiased scores
    # renormalised, times 2.5; a shared expert beside. make_case prints how
    # often the group limit and the bias change the choice and the smallest
    # score gaps it rests on.
    "glm4_moe": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            eos_token_id=0,
        ),
        11,
        torch.float32,
    ),
    # GLM-4.5's MoE without its options: one group, the top 2 of 6 scores
    # not renormalised nor scaled, no q/k norms or biases, every block
    # routed, two shared experts' width beside.
    "glm4_moe_plain": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        dict(
            vocab_size=79,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            attention_bias=False,
            use_qk_norm=False,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            eos_token_id=0,
        ),
        10,
        torch.float32,
    ),
    # DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention: q
    # through a rank-24 bottleneck (q_a_proj, q_a_layernorm, q_b_proj),
    # keys and values from one latent (kv_a_proj_with_mqa: 16 latent
    # entries, kv_a_layernorm, kv_b_proj to each head's 8 key and 6 value
    # entries, v_head_dim 6 != the 12 of q and k) beside a 4-entry RoPE part
    # of the key shared by the 4 heads; RoPE on the last 4 entries of q and
    # k in neighbouring pairs (rope_interleave), scores times 12^-1/2; block
    # 0 dense, blocks 1-2 routed as GLM-4.5's (2 of 8 experts within the
    # best 1 of 2 groups by the sigmoid scores plus the correction bias,
    # renormalised, times 2.5, a shared expert beside).
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            vocab_size=83,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            rope_interleave=True,
            attention_bias=False,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # DeepSeek-V3's attention without the q bottleneck (q_proj, which has
    # no bias) and with biases on kv_a_proj_with_mqa and o_proj; RoPE in
    # halves (rope_interleave false) under DeepSeek's YaRN: factor 4 over
    # an original context of 16, θ 5 so that the 2 pairs of qk_rope_head_dim
    # 4 span the ramp (pair 0 kept, pair 1 blended halfway); mscale 0.707
    # over mscale_all_dim 1.0 scales cos/sin by yarn(4, 0.707) /
    # yarn(4, 1.0) and the scores by 10^-1/2 · yarn(4, 1.0)^2 (yarn(s, m)
    # = 0.1 m ln s + 1); v_head_dim 8 < 10. Every block routed, one group,
    # the top 2 of 6 not renormalised nor scaled, two shared experts' width.
    "deepseek_v3_yarn": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            vocab_size=79,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            rope_interleave=False,
            attention_bias=True,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=5.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=0.707,
                mscale_all_dim=1.0,
            ),
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # DeepSeek-V2 (DeepseekV2ForCausalLM): DeepSeek-V3's multi-head latent
    # attention (q through a rank-24 bottleneck, one 16-entry latent for
    # every head's 8 key and 6 value entries, a 4-entry RoPE part of the key
    # shared by the 4 heads, scores times 12^-1/2) with biases on q_a_proj,
    # kv_a_proj_with_mqa and o_proj (attention_bias; q_b_proj and kv_b_proj
    # have none); RoPE always on neighbouring pairs (2i, 2i+1) (transformers
    # multiplies them as complex numbers). Block 0 dense, blocks 1-2 routed
    # by DeepSeek-V2's router: a softmax over all 8 experts, then
    # group_limited_greedy: of 4 groups of 2 experts the 2 with the largest
    # best probability stay open, the top 3 probabilities within them chosen
    # (with a group's merit its best probability, the top k of all never
    # span more than k groups: topk_group < k for the limit to bind; it
    # changes about half the tokens' choice here), their weights the
    # probabilities times routed_scaling_factor 2.0 (not renormalised: the
    # router ignores norm_topk_prob); two shared experts' width beside.
    "deepseek_v2": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            vocab_size=65,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            attention_bias=True,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # DeepSeek-V2-Lite's shape of it: q_proj (no bias, no bottleneck), no
    # attention biases, every block routed, greedy (the top 2 of 8
    # probabilities, no groups: n_group and topk_group null), weights the
    # probabilities as they are (routed_scaling_factor 1), one shared
    # expert; DeepSeek's YaRN as deepseek_v3_yarn's (factor 4 over an
    # original context of 16, θ 5, mscale 0.707 over mscale_all_dim 1.0:
    # cos/sin times yarn(4, 0.707) / yarn(4, 1.0), scores times
    # 10^-1/2 · yarn(4, 1.0)^2), on neighbouring pairs; v_head_dim 8 < 10.
    "deepseek_v2_lite": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            vocab_size=74,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            attention_bias=False,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
            n_shared_experts=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=5.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=0.707,
                mscale_all_dim=1.0,
            ),
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # Qwen3.5 (Qwen3_5ForCausalLM, the text stack): blocks 0 and 2 Gated
    # DeltaNet ("linear_attention"), 1 and 3 gated full attention. The
    # DeltaNet: in_proj_qkv to q and k (2 key heads of 8) and v (4 value
    # heads of 12, GQA 2 value heads a key head, value dim != key dim), a
    # causal depthwise conv1d (kernel 4 < 12 positions) and SiLU over the
    # three, q and k l2-normalised, q times 8^-1/2; per value head a decay
    # exp(g), g = -exp(A_log) softplus(in_proj_a + dt_bias), and a step
    # beta = sigmoid(in_proj_b); the gated delta rule; per value head the
    # gated RMSNorm (weight, plain gain) times silu(in_proj_z), out_proj.
    # The full attention: q_proj twice as wide (query and a sigmoid output
    # gate per head), per-head q/k RMSNorms, 4 heads of 16, GQA 4/2, RoPE
    # on the first 4 entries (partial_rotary_factor 0.25) in halves (the
    # interleaved M-RoPE with text positions, every axis equal; its
    # mrope_section written as a checkpoint writes it). Every RMSNorm but
    # the gated one zero-centred (gain 1 + w). Untied.
    "qwen3_5": (
        Qwen3_5TextConfig,
        Qwen3_5ForCausalLM,
        dict(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[1, 1, 0],
                mrope_interleaved=True,
            ),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # Qwen3.5-MoE (Qwen3_5MoeForCausalLM, the text stack): qwen3_5's
    # mixers, blocks 0 and 1 Gated DeltaNet (2 key heads of 8, 6 value
    # heads of 6: GQA 3, value dim < key dim), block 2 gated full attention
    # (4 heads of 8, GQA 4/2, RoPE on the first 4 entries: partial factor
    # 0.5); every block's MLP routed: top 2 of 8 experts' softmax
    # probabilities, renormalised, beside a shared expert (24 wide) under
    # its sigmoid gate (shared_expert_gate), as Qwen2-MoE's. Its config has
    # no mlp_only_layers, decoder_sparse_step nor norm_topk_prob (every
    # block routed, the top k always renormalised); output_router_logits
    # left false (no load-balancing loss), as released.
    "qwen3_5_moe": (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        dict(
            vocab_size=87,
            hidden_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                mrope_section=[1, 1, 0],
                mrope_interleaved=True,
            ),
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        11,
        torch.float32,
    ),
    # Qwen3-Next (Qwen3NextForCausalLM): qwen3_5's shapes and mixers (blocks
    # 0 and 2 Gated DeltaNet, 1 and 3 gated full attention, plain RoPE on 4
    # of 16 entries), its DeltaNet's projections fused and interleaved per
    # key head: in_proj_qkvz rows [q (8) | k (8) | v (2 x 12) | z (2 x 12)]
    # for each of the 2 key heads, in_proj_ba rows [b (2) | a (2)] likewise.
    # Block 1 routed (top 2 of 8 experts renormalised, norm_topk_prob, a
    # shared expert under its sigmoid gate), blocks 0 and 2 dense (48 wide)
    # by decoder_sparse_step 2 (routed where (i + 1) % 2 == 0), block 3
    # dense by mlp_only_layers.
    "qwen3_next": (
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        dict(
            vocab_size=85,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # OLMo Hybrid (OlmoHybridForCausalLM): blocks 0 and 2 pre-norm Gated
    # DeltaNet, 1 and 3 OLMo 3's attention block (norms after the attention
    # and the MLP, q/k RMSNorms over the whole projections, 4 heads of 8,
    # GQA 4/2, RoPE θ 10000 on the full-attention blocks only). Its
    # DeltaNet: separate q_proj, k_proj (2 key heads of 8), v_proj (4 value
    # heads of 12), one causal depthwise conv1d (no bias) over [q | k | v]
    # and SiLU; a_proj and dt_bias into the decay as Qwen3.5's; the step
    # beta = 2 sigmoid(b_proj) (linear_allow_neg_eigval: in (0, 2)); the
    # gated RMSNorm o_norm (plain gain, eps 1e-5 whatever rms_norm_eps)
    # times silu(g_proj), o_proj. Every other RMSNorm a plain gain. Untied;
    # pad token 1 (OlmoHybridConfig's 100277 lies outside this vocabulary).
    "olmo_hybrid": (
        OlmoHybridConfig,
        OlmoHybridForCausalLM,
        dict(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=0,
        ),
        11,
        torch.float32,
    ),
    # Qwen3.5's multimodal class (Qwen3_5ForConditionalGeneration, as the
    # Hub's Qwen3.5 checkpoints are): qwen3_5's text stack under
    # `model.language_model.` beside a one-block vision tower and its merger
    # (`model.visual.`), which megatrain leaves out; the checkpoint also
    # holds two multi-token-prediction tensors (`mtp.`, as the Hub's do),
    # which transformers ignores on load (MTP_CASES). The golden holds
    # text-only logits and the text stack's gradients under
    # Qwen3_5ForCausalLM's names.
    "qwen3_5_mm": (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        dict(
            text_config=dict(
                vocab_size=90,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=4,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=10000.0,
                    partial_rotary_factor=0.25,
                    mrope_section=[1, 1, 0],
                    mrope_interleaved=True,
                ),
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
                linear_conv_kernel_dim=4,
                rms_norm_eps=1e-6,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=8,
                intermediate_size=8,
                num_heads=2,
                patch_size=2,
                temporal_patch_size=1,
                spatial_merge_size=1,
                num_position_embeddings=4,
                out_hidden_size=32,
            ),
            image_token_id=89,
            video_token_id=88,
            vision_start_token_id=86,
            vision_end_token_id=87,
            tie_word_embeddings=False,
        ),
        12,
        torch.float32,
    ),
    # Kimi Linear (KimiLinearForCausalLM): blocks 0 and 2 Kimi Delta
    # Attention ("linear_attention"), 1 and 3 DeepSeek's multi-head latent
    # attention without RoPE (NoPE: the qk_rope_head_dim part of the keys,
    # shared by every head, enters the scores unrotated). KDA: separate
    # q_proj, k_proj, v_proj (4 heads of 8 each), one causal depthwise
    # conv1d (no bias) over [q | k | v] and SiLU (the checkpoint's
    # q_conv1d, k_conv1d, v_conv1d, 32 channels each); per key channel a
    # decay exp(g), g = -exp(A_log[head]) softplus(f_b_proj(f_a_proj(x)) +
    # dt_bias) (A_log [1, 1, 4, 1], dt_bias [32]); beta = sigmoid(b_proj);
    # q and k l2-normalised, q times 8^-1/2, the delta rule with the state's
    # rows decayed per key channel; the gated RMSNorm o_norm (plain gain,
    # eps rms_norm_eps) times SIGMOID(g_b_proj(g_a_proj(x))), o_proj. MLA:
    # q_proj (q_lora_rank null), kv_a_proj_with_mqa to a 16-wide latent
    # (kv_a_layernorm, eps 1e-6 whatever rms_norm_eps) and a 4-wide shared
    # key part, kv_b_proj to per-head nope keys (6) and values (8), scores
    # times 10^-1/2. MLPs by mlp_layer_types: blocks 0 and 3 dense (48
    # wide; the Hub's `mlp.*`), 1 and 2 routed (`block_sparse_moe.*`):
    # DeepSeek-V3's sigmoid router (top 2 of 8 within the best 1 of 2
    # groups by the scores plus e_score_correction_bias, weights
    # renormalised, times 2.446) beside one ungated shared expert (16
    # wide), experts w1 / w3 / w2. Untied; no pad token.
    "kimi_linear": (
        KimiLinearConfig,
        KimiLinearForCausalLM,
        dict(
            vocab_size=91,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            attention_bias=False,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
        12,
        torch.float32,
    ),
}

# The cases whose experts are stored MXFP4 (see MXFP4).
MXFP4_CASES = {"gpt_oss_mxfp4"}
# The cases whose checkpoint also holds multi-token-prediction tensors
# (`mtp.`, as the Hub's Qwen3.5 checkpoints do), which transformers ignores
# on load (_keys_to_ignore_on_load_unexpected) and so must megatrain
# (add_mtp_tensors).
MTP_CASES = {"qwen3_5_mm"}

# Model types whose every op of the forward and backward is checked to stay
# float64 (Float32Watch), and those whose saved checkpoint is also reloaded
# (from_pretrained in float64) to reproduce the golden bit for bit.
WATCHED = {
    "gpt_oss",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "olmo_hybrid",
    "qwen3_5",
    "kimi_linear",
}
RELOADED = {
    "deepseek_v3",
    "deepseek_v2",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "olmo_hybrid",
    "qwen3_5",
    "kimi_linear",
}
# Model types with a Gated DeltaNet (or Kimi Linear's KDA), whose float64
# port (_gated_deltanet64, _kda64) make_case checks ran and compares with
# transformers' own forward. ("qwen3_5": Qwen3.5's multimodal class, whose
# text stack is qwen3_5_text's.)
DELTANET_TYPES = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "qwen3_5", "kimi_linear"}


# Cases whose config.json is rewritten with transformers v4 field names
# (`torch_dtype`, top-level `rope_theta`), so both spellings are covered.
V4_STYLE = {"llama_gqa", "gpt2", "gpt_neox"}


def to_v4_config(path: Path):
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters", None)
    if rope is not None and cfg["model_type"] == "gpt_neox":
        # GPTNeoXConfig's own v4 names.
        assert rope["rope_type"] == "default"
        cfg["rotary_emb_base"] = rope["rope_theta"]
        cfg["rotary_pct"] = rope["partial_rotary_factor"]
    elif rope is not None:
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


def _gemma_rmsnorm64(self, x):
    """Gemma's RMSNorm (gain 1 + w) without its cast to float32."""
    var = x.pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + self.eps)) * (1.0 + self.weight)


def inv_freq64(cfg, dim, end=0):
    """The inverse frequencies transformers gives `cfg` (in float32), formed
    in float64: `modeling_rope_utils`' formulas for the rope types megatrain
    implements, ported so the reference keeps every digit. `end`: one past
    the largest position of the forward (LongRoPE picks its factors by it)."""
    p = cfg.rope_parameters
    theta, kind = p["rope_theta"], p.get("rope_type", "default")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "default":
        return inv, 1.0
    if kind == "dynamic":
        # transformers' dynamic NTK, for a forward whose positions end at
        # `end`: a larger base past max_position_embeddings.
        m = cfg.max_position_embeddings
        if end <= m:
            return inv, 1.0
        base = theta * ((p["factor"] * end / m) - (p["factor"] - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
    if kind == "longrope":
        old = p["original_max_position_embeddings"]
        factor = p.get("factor") or cfg.max_position_embeddings / old
        att = p.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
        ext = p["long_factor"] if end > old else p["short_factor"]
        return inv / torch.tensor(ext, dtype=torch.float64), att
    if kind == "linear":
        return inv / p["factor"], 1.0
    if kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old / low, inv / factor, inv)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, blended, out), 1.0
    assert kind == "yarn", kind
    old = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / old

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        m, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, all_dim) if m and all_dim else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr(fast), corr(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp
    return inv / factor * (1 - keep) + inv * keep, att


def _rope64(cfg, dim, interleave=False):
    def forward(self, x, position_ids):
        inv, att = inv_freq64(cfg, dim, int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv
        # Cohere lays the frequencies out pair by pair, everyone else in halves.
        emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleave else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * att).to(x.dtype), (emb.sin() * att).to(x.dtype)

    return forward


def _cohere_ln64(self, x):
    """Cohere's LayerNorm (no bias) without its cast to float32."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return self.weight * ((x - mean) * torch.rsqrt(var + self.variance_epsilon))


def _cohere_rotary64(module):
    """Cohere's (or Cohere 2's) apply_rotary_pos_emb, in `module`, without
    its cast to float32."""

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + module.rotate_half(q) * sin, k * cos + module.rotate_half(k) * sin

    module.apply_rotary_pos_emb = apply


def _router64(self, hidden_states):
    """A MoE router (Mixtral's, Qwen3-MoE's) with its softmax in the
    model's float64 rather than float32; Mixtral always renormalises the
    top k, Qwen3-MoE under norm_topk_prob."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = _softmax(logits, dim=-1, dtype=torch.float64)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def glm4_moe_choose(choice, n_group, topk_group, top_k):
    """GLM-4.5's expert choice (Glm4MoeTopkRouter's) from the biased scores
    [T, E]: the best `topk_group` of `n_group` equal groups of experts
    (a group's score the sum of its best 2), then the best `top_k` experts
    within them. Returns the indices and the scores with the other groups'
    experts at -inf."""
    t, e = choice.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    masked = choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=top_k, dim=-1, sorted=False)[1], masked


def _glm4_moe_router64(self, hidden_states):
    """GLM-4.5's router in the model's float64 (transformers casts the
    hidden states and the weight to float32): sigmoid scores, the choice
    by the scores plus e_score_correction_bias (glm4_moe_choose), weights
    the chosen unbiased scores, over their sum (+1e-20) under
    norm_topk_prob, times routed_scaling_factor."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    scores = logits.sigmoid()
    idx, _ = glm4_moe_choose(scores + self.e_score_correction_bias, self.num_group, self.topk_group, self.top_k)
    weights = scores.gather(1, idx)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, idx


# GLM-4.5's router, DeepSeek-V3's and Kimi Linear's, the same (all cast to
# float32).
SIGMOID_ROUTERS = ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter", "KimiLinearTopkRouter")
# Routers whose choice glm4_moe_route_report checks and reports on.
REPORTED_ROUTERS = SIGMOID_ROUTERS + ("DeepseekV2TopkRouter",)


def record_glm4_moe_routes(model):
    """Wraps each GLM-4.5 (or DeepSeek-V3, DeepSeek-V2) router (after patch_float64) to keep its input;
    returns [(block name, router, inputs)] for glm4_moe_route_report."""
    routes = []
    for mname, m in model.named_modules():
        if type(m).__name__ in REPORTED_ROUTERS:
            inputs = []
            patched = m.forward

            def forward(hidden_states, patched=patched, inputs=inputs):
                inputs.append(hidden_states.detach())
                return patched(hidden_states)

            m.forward = forward
            routes.append((mname.removesuffix(".mlp.gate"), m, inputs))
    return routes


def glm4_moe_route_report(name, routes):
    """Per routed block: checks the float64 router against transformers'
    own (float32) one (same experts, weights to float32), and reports how
    many tokens' choice the group limit changes (against the top k of all
    biased scores) and the correction bias changes (against the same
    choice from the unbiased scores), and the smallest gaps the choice
    rests on: between a token's k-th and (k+1)-th biased score within its
    groups, and between its topk_group-th and next group score."""
    lines = []
    for block, m, inputs in routes:
        (h,) = inputs
        if type(m).__name__ == "DeepseekV2TopkRouter":
            lines.append(deepseek_v2_route_report(name, block, m, h))
            continue
        with torch.no_grad():
            logits, w, idx = _glm4_moe_router64(m, h)
            _, w32, idx32 = type(m).forward(m, h.to(torch.float32))
            order, order32 = idx.sort(dim=-1), idx32.sort(dim=-1)
            assert torch.equal(order.values, order32.values), f"{name}: f32 router chooses otherwise"
            assert torch.allclose(w.gather(1, order.indices), w32.gather(1, order32.indices).to(w.dtype), rtol=1e-5, atol=1e-6)
            scores = logits.sigmoid()
            choice = scores + m.e_score_correction_bias
            k, g = m.top_k, m.num_group
            per_token = lambda i: [tuple(r) for r in i.sort(dim=-1).values.tolist()]
            ungrouped = per_token(torch.topk(choice, k, dim=-1)[1])
            unbiased = per_token(glm4_moe_choose(scores, g, m.topk_group, k)[0])
            mine = per_token(idx)
            by_group = sum(a != b for a, b in zip(mine, ungrouped))
            by_bias = sum(a != b for a, b in zip(mine, unbiased))
            _, masked = glm4_moe_choose(choice, g, m.topk_group, k)
            top = masked.topk(k + 1, dim=-1)[0]
            gap = float((top[:, k - 1] - top[:, k]).min())
            line = f"{block}: {len(mine)} tokens, group limit changes {by_group}, bias changes {by_bias}, min k/k+1 gap {gap:.3e}"
            if g > m.topk_group:
                t, e = choice.shape
                gs = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1).sort(dim=-1, descending=True).values
                line += f", min group gap {float((gs[:, m.topk_group - 1] - gs[:, m.topk_group]).min()):.3e}"
            lines.append(line)
    for line in lines:
        print(f"  {name}: {line}")


def deepseek_v2_choose(probs, router):
    """DeepSeek-V2's expert choice (DeepseekV2TopkRouter's) from the softmax
    probabilities [T, E]: under "greedy" the top `top_k` of all; under
    "group_limited_greedy" the `topk_group` of `n_group` equal groups with
    the largest best probability stay open, the others' probabilities set
    to 0, then the top `top_k`. Returns the indices and the probabilities
    so masked."""
    if router.topk_method == "greedy":
        return torch.topk(probs, k=router.top_k, dim=-1, sorted=False)[1], probs
    assert router.topk_method == "group_limited_greedy", router.topk_method
    t, e = probs.shape
    g = router.num_group
    group_scores = probs.view(t, g, e // g).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
    masked = probs.masked_fill(~score_mask.bool(), 0.0)
    return torch.topk(masked, k=router.top_k, dim=-1, sorted=False)[1], masked


def _deepseek_v2_router64(self, hidden_states):
    """DeepSeek-V2's router in the model's float64 (transformers casts the
    hidden states and the weight to float32 and softmaxes in float32): a
    softmax over all experts, the choice by deepseek_v2_choose, weights the
    chosen probabilities times routed_scaling_factor (never renormalised)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = _softmax(logits, dim=-1)
    idx, _ = deepseek_v2_choose(probs, self)
    return logits, probs.gather(1, idx) * self.routed_scaling_factor, idx


def deepseek_v2_route_report(name, block, m, h):
    """One routed block of DeepSeek-V2: checks the float64 router against
    transformers' own (float32) one (same experts, weights to float32), and
    reports how many tokens' choice the group limit changes (against the top
    k of all probabilities) and the smallest gaps the choice rests on:
    between a token's k-th and (k+1)-th probability within its open groups
    (absolute, and relative to the k-th), and between its topk_group-th and
    next group score (likewise)."""
    with torch.no_grad():
        logits, w, idx = _deepseek_v2_router64(m, h)
        _, w32, idx32 = type(m).forward(m, h.to(torch.float32))
        order, order32 = idx.sort(dim=-1), idx32.sort(dim=-1)
        assert torch.equal(order.values, order32.values), f"{name}: f32 router chooses otherwise"
        assert torch.allclose(w.gather(1, order.indices), w32.gather(1, order32.indices).to(w.dtype), rtol=1e-5, atol=1e-6)
        probs = _softmax(logits, dim=-1)
        k = m.top_k
        per_token = lambda i: [tuple(r) for r in i.sort(dim=-1).values.tolist()]
        ungrouped = per_token(torch.topk(probs, k, dim=-1)[1])
        mine = per_token(idx)
        by_group = sum(a != b for a, b in zip(mine, ungrouped))
        _, masked = deepseek_v2_choose(probs, m)
        top = masked.topk(k + 1, dim=-1)[0]
        gap = top[:, k - 1] - top[:, k]
        hit = len(set(idx.flatten().tolist()))
        line = (
            f"{block}: {len(mine)} tokens, {m.topk_method}, {hit} of {probs.shape[1]} experts chosen,"
            + (f" group limit changes {by_group}," if m.topk_method == "group_limited_greedy" else "")
            + f" min k/k+1 gap {float(gap.min()):.3e} (relative {float((gap / top[:, k - 1]).min()):.3e})"
        )
        if m.topk_method == "group_limited_greedy":
            t, e = probs.shape
            g = m.num_group
            gs = probs.view(t, g, e // g).max(dim=-1).values.sort(dim=-1, descending=True).values
            ggap = gs[:, m.topk_group - 1] - gs[:, m.topk_group]
            line += (
                f", min group gap {float(ggap.min()):.3e}"
                f" (relative {float((ggap / gs[:, m.topk_group - 1]).min()):.3e})"
            )
    return line


def _deepseek_v2_rope64(cfg, dim):
    """DeepSeek-V2's rotary embedding in float64: transformers returns the
    half-dim angles as complex numbers (torch.polar, complex64) times the
    attention scaling (YaRN's); here complex128 with real part cos θ · att
    and imaginary part sin θ · att."""

    def forward(self, x, position_ids):
        inv, att = inv_freq64(cfg, dim, int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv
        return torch.complex(freqs.cos() * att, freqs.sin() * att)

    return forward


def _deepseek_v2_apply_rotary64(xq, xk, freqs_cis):
    """DeepSeek-V2's apply_rotary_emb without its cast to float32 (complex64):
    each neighbouring pair (x[2i], x[2i+1]) of the RoPE part, taken as the
    complex number x[2i] + i x[2i+1], times freqs_cis[i] (cos + i sin, times
    the attention scaling), written out in real arithmetic."""
    cos, sin = freqs_cis.real.unsqueeze(1), freqs_cis.imag.unsqueeze(1)

    def rotate(x):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    return rotate(xq), rotate(xk)


def _gpt_oss_rope64(cfg, dim):
    """GPT-OSS's rotary embedding in float64: cos and sin of the half-dim
    angles (not duplicated; its apply_rotary_pos_emb rotates the head's two
    halves by them), times the attention scaling (YaRN's)."""

    def forward(self, x, position_ids):
        inv, att = inv_freq64(cfg, dim, int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv
        return (freqs.cos() * att).to(x.dtype), (freqs.sin() * att).to(x.dtype)

    return forward


def _load_balancing64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (Switch Transformer's) in the
    router logits' float64: transformers sums the probabilities in float32.
    E · Σ_e (picks of e / rows) · (Σ_rows p_e / rows), every routed block's
    rows together."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    assert attention_mask is None
    logits = torch.cat(gate_logits, dim=0)
    probs = _softmax(logits, dim=-1)
    _, picked = torch.topk(probs, top_k, dim=-1)
    picks = F.one_hot(picked, num_experts).to(probs.dtype).sum(dim=(0, 1))
    rows = logits.shape[0]
    return num_experts * torch.sum((picks / rows) * (probs.sum(dim=0) / rows))


# Qwen3.5, Qwen3.5-MoE and Qwen3-Next: their zero-centred RMSNorms (gain
# 1 + w, as Gemma's: _gemma_rmsnorm64), the Gated DeltaNet's gated RMSNorm,
# the DeltaNet itself and the (M-)RoPE; OLMo Hybrid's gated RMSNorm and
# DeltaNet (its other RMSNorms plain: _rmsnorm64; its RoPE, which returns
# float32 cos and sin whatever the model's dtype, plain: _rope64).
ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
GATED_NORMS = ("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated", "OlmoHybridRMSNormGated")
GATED_DELTANETS = (
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "Qwen3NextGatedDeltaNet",
    "OlmoHybridGatedDeltaNet",
)
# Kimi Linear's gated RMSNorm (its gate through a sigmoid) and its Kimi
# Delta Attention.
SIGMOID_GATED_NORMS = ("KimiLinearRMSNormGated",)
KDA_DELTANETS = ("KimiLinearDeltaAttention",)
MROPES = ("Qwen3_5TextRotaryEmbedding", "Qwen3_5MoeTextRotaryEmbedding")
# Vision towers' rotary embeddings, which text-only input never reaches
# (left as they are).
VISION_ROPES = ("Qwen3_5VisionRotaryEmbedding",)


def _gated_rmsnorm64(self, x, gate):
    """The Gated DeltaNet's RMSNorm (Qwen3_5RMSNormGated, OLMo Hybrid's
    OlmoHybridRMSNormGated) without its casts
    to float32: w · x / rms(x) (a plain gain), then times silu(gate)."""
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon)) * F.silu(gate)


def _sigmoid_gated_rmsnorm64(self, x, gate):
    """Kimi Linear's KimiLinearRMSNormGated without its casts to float32:
    w · x / rms(x) (a plain gain), then times sigmoid(gate)."""
    assert self.activation == "sigmoid", self.activation
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon)) * torch.sigmoid(gate)


def gated_delta_rule64(q, k, v, g, beta):
    """The gated delta rule (transformers' torch_chunk_gated_delta_rule with
    use_qk_l2norm_in_kernel, which casts to float32) in the inputs' float64,
    in its recurrent form (the same function as the chunked one). q, k
    [B, L, Hk, Dk], v [B, L, Hv, Dv], g and beta [B, L, Hv]; each key head
    serves Hv / Hk consecutive value heads. q and k l2-normalised (eps 1e-6
    inside the root), q times Dk^-1/2; per value head a state S [Dk, Dv]
    from zeros, at each position t: S = exp(g_t) S; δ = beta_t (v_t - Sᵀ k_t);
    S = S + k_t δᵀ; o_t = Sᵀ q_t. Returns o [B, L, Hv, Dv]. Kimi Linear's
    KDA (its recurrent_kimi_delta_attention / chunk_kimi_delta_attention,
    which cast to float32 likewise): g [B, L, H, Dk], a decay per key
    channel, S = diag(exp(g_t)) S (row i of S times exp(g_t[i])), the rest
    the same (Hk = Hv; its l2norm x / sqrt(Σx² + 1e-6), the same number)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, l, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=v.dtype)
    out = []
    for t in range(l):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, D]
        decay = g[:, t].exp()
        # Per head [B, H], or per key channel [B, H, Dk] (KDA's).
        state = state * (decay[..., None, None] if decay.ndim == 2 else decay[..., None])
        kv_mem = (state * k_t[..., None]).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, t, :, None]
        state = state + k_t[..., None] * delta[..., None, :]
        out.append((state * q_t[..., None]).sum(dim=-2))
    return torch.stack(out, dim=1)


def _gated_deltanet64(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Qwen3.5's (or Qwen3.5-MoE's, Qwen3-Next's, OLMo Hybrid's) Gated
    DeltaNet over a whole prompt in float64: transformers computes the gates
    from A_log and in_proj_a cast to float32 (`.float()`) and the delta rule
    in float32. Qwen3-Next's in_proj_qkvz / in_proj_ba (interleaved per key
    head) split by the module's own fix_query_key_value_ordering. OLMo
    Hybrid's: separate q_proj, k_proj, v_proj (concatenated for the conv),
    a_proj, b_proj and the gate g_proj; beta = 2 sigmoid(b) under
    allow_neg_eigval; its gated norm o_norm, its output o_proj. Counts its runs in
    `_float64_runs` (make_case checks that every one ran) and keeps its
    decays exp(g) in `_decays` (make_case reports their spread)."""
    if cache is not None:
        # A fresh prompt: no conv or recurrent state to start from (the
        # golden's forward keeps none for later).
        assert cache.get_conv_state(self.layer_idx) is None and cache.get_recurrent_state(self.layer_idx) is None
    module = importlib.import_module(type(self).__module__)
    hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
    bsz, seq, _ = hidden_states.shape
    if hasattr(self, "in_proj_qkvz"):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([x.reshape(bsz, seq, -1) for x in (q, k, v)], dim=-1)
    elif hasattr(self, "g_proj"):
        # OLMo Hybrid's.
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        z = self.g_proj(hidden_states).reshape(bsz, seq, -1, self.head_v_dim)
        b, a = self.b_proj(hidden_states), self.a_proj(hidden_states)
    else:
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(bsz, seq, -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    # The causal depthwise convolution over [q | k | v] (each channel's last
    # kernel-size positions, zeros before the first), then SiLU.
    assert self.activation == "silu", self.activation
    conv = F.conv1d(
        mixed.transpose(1, 2),
        self.conv1d.weight,
        self.conv1d.bias,
        padding=self.conv_kernel_size - 1,
        groups=self.conv_dim,
    )[:, :, :seq]
    mixed = F.silu(conv).transpose(1, 2)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(bsz, seq, -1, self.head_k_dim)
    k = k.reshape(bsz, seq, -1, self.head_k_dim)
    v = v.reshape(bsz, seq, -1, self.head_v_dim)
    beta = b.sigmoid()
    if getattr(self, "allow_neg_eigval", False):
        # OLMo Hybrid's linear_allow_neg_eigval: steps in (0, 2).
        beta = beta * 2.0
    # softplus with torch's default beta 1, threshold 20.
    g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
    out = gated_delta_rule64(q, k, v, g, beta)
    norm, out_proj = (self.o_norm, self.o_proj) if hasattr(self, "o_norm") else (self.norm, self.out_proj)
    out = norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    self._float64_runs = getattr(self, "_float64_runs", 0) + 1
    self._decays = g.detach().exp()
    return out_proj(out.reshape(bsz, seq, -1))


def _kda64(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Kimi Linear's Kimi Delta Attention (KimiLinearDeltaAttention) over a
    whole prompt in float64: transformers computes its forget gate from
    f_b_proj(f_a_proj(x)) and dt_bias cast to float32 (`.float()`), the
    delta rule in float32 and its gated norm in float32. Separate q_proj,
    k_proj, v_proj (concatenated for the causal depthwise conv and SiLU);
    per key channel g = -exp(A_log) softplus(f_b_proj(f_a_proj(x)) +
    dt_bias) (A_log [1, 1, H, 1], one rate a head; transformers' softplus
    with its threshold of 20, as F.softplus's); beta = sigmoid(b_proj(x));
    the delta rule with per-channel decays (gated_delta_rule64); o_norm
    (sigmoid-gated) times g_b_proj(g_a_proj(x)), o_proj. Counts its runs in
    `_float64_runs` and keeps its decays exp(g) in `_decays`, as
    _gated_deltanet64."""
    if cache is not None:
        # A fresh prompt: no conv or recurrent state to start from.
        assert cache.get_conv_state(self.layer_idx) is None and cache.get_recurrent_state(self.layer_idx) is None
    module = importlib.import_module(type(self).__module__)
    hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
    bsz, seq, _ = hidden_states.shape
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    assert self.activation == "silu", self.activation
    conv = F.conv1d(
        mixed.transpose(1, 2),
        self.conv1d.weight,
        self.conv1d.bias,
        padding=self.conv_kernel_size - 1,
        groups=self.conv_dim,
    )[:, :, :seq]
    mixed = F.silu(conv).transpose(1, 2)
    q, k, v = (x.reshape(bsz, seq, -1, self.head_dim) for x in torch.split(mixed, [self.qkv_dim] * 3, dim=-1))
    fg = self.forget_gate
    f = fg.f_b_proj(fg.f_a_proj(hidden_states)) + fg.dt_bias.view(1, 1, -1)
    g = -fg.A_log.exp() * F.softplus(f.view(bsz, seq, -1, self.head_dim))
    beta = self.b_proj(hidden_states).sigmoid()
    out = gated_delta_rule64(q, k, v, g, beta)
    gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(bsz, seq, -1, self.head_dim)
    out = self.o_norm(out, gate).reshape(bsz, seq, -1)
    self._float64_runs = getattr(self, "_float64_runs", 0) + 1
    self._decays = g.detach().exp()
    return self.o_proj(out)


def _mrope64(cfg, dim):
    """Qwen3.5's text rotary embedding in float64. Its position_ids are
    [3, B, L] (temporal, height, width), the frequencies taken from the
    three axes interleaved (mrope_section); with text positions every axis
    is the same, and that reduces to plain RoPE on the first `dim` entries
    of each head, cos/sin of the half-dim angles laid out in halves."""

    def forward(self, x, position_ids):
        assert position_ids.ndim == 3 and position_ids.shape[0] == 3, position_ids.shape
        assert torch.equal(position_ids, position_ids[:1].expand_as(position_ids)), "not text positions"
        inv, att = inv_freq64(cfg, dim)
        freqs = position_ids[0][..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * att).to(x.dtype), (emb.sin() * att).to(x.dtype)

    return forward


def expert_grads(pname, grad, saved_names):
    """transformers 5 holds a MoE block's experts fused (`experts.gate_up_proj`
    [E, 2F, C] in gate, up order; `experts.down_proj` [E, C, F]) and writes
    them per expert: the gradient under the names the checkpoint has. A
    checkpoint that holds them fused (GPT-OSS's, or its MXFP4 `_blocks` /
    `_scales`) gets the gradient under the fused name as it is."""
    if pname in saved_names or pname + "_blocks" in saved_names:
        return {pname: grad}
    prefix, kind = pname.rsplit(".", 1)
    mlp = prefix.removesuffix(".experts")
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    mixtral = mlp.replace(".mlp", ".block_sparse_moe") + ".experts.0.w1.weight" in saved_names
    if mixtral:
        mlp = mlp.replace(".mlp", ".block_sparse_moe")
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    else:
        names = {v: v for v in names.values()}
    out = {}
    for e in range(grad.shape[0]):
        if kind == "gate_up_proj":
            f = grad.shape[1] // 2
            out[f"{mlp}.experts.{e}.{names['gate_proj']}.weight"] = grad[e, :f]
            out[f"{mlp}.experts.{e}.{names['up_proj']}.weight"] = grad[e, f:]
        else:
            assert kind == "down_proj", pname
            out[f"{mlp}.experts.{e}.{names['down_proj']}.weight"] = grad[e]
    return out


def patch_float64(model):
    """Keeps every computation of `model` in float64 (see module docstring)."""
    torch.nn.functional.softmax = _softmax64
    # A multimodal model's RoPE reads its text config.
    cfg = model.config.get_text_config()
    if cfg.model_type == "gpt_oss":
        # GPT-OSS's router softmaxes its top k in the logits' dtype (float64
        # here) and its eager attention its scores with the sinks likewise;
        # only the load-balancing loss leaves float64.
        importlib.import_module(type(model).__module__).load_balancing_loss_func = _load_balancing64
    for m in model.modules():
        name = type(m).__name__
        if name in ("Gemma2RMSNorm", "Gemma3RMSNorm") + ZERO_CENTRED_NORMS:
            m.forward = types.MethodType(_gemma_rmsnorm64, m)
        elif name in GATED_NORMS:
            m.forward = types.MethodType(_gated_rmsnorm64, m)
        elif name in SIGMOID_GATED_NORMS:
            m.forward = types.MethodType(_sigmoid_gated_rmsnorm64, m)
        elif name in GATED_DELTANETS:
            m.forward = types.MethodType(_gated_deltanet64, m)
        elif name in KDA_DELTANETS:
            m.forward = types.MethodType(_kda64, m)
        elif name in ("Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding"):
            # sqrt(hidden) as a float32 model holds it (the buffer takes
            # the dtype the model is built in; a float32 build here,
            # float64 when from_pretrained builds in float64).
            with torch.no_grad():
                m.embed_scale.copy_(torch.tensor(m.scalar_embed_scale, dtype=torch.float32))
        elif name.endswith("RMSNorm"):
            m.forward = types.MethodType(_rmsnorm64, m)
        elif name in (
            "MixtralTopKRouter",
            "Qwen3MoeTopKRouter",
            "OlmoeTopKRouter",
            "Qwen2MoeTopKRouter",
            "Qwen3_5MoeTopKRouter",
            "Qwen3NextTopKRouter",
        ):
            m.forward = types.MethodType(_router64, m)
        elif name in SIGMOID_ROUTERS:
            m.forward = types.MethodType(_glm4_moe_router64, m)
        elif name == "DeepseekV2TopkRouter":
            m.forward = types.MethodType(_deepseek_v2_router64, m)
        elif name in ("CohereLayerNorm", "Cohere2LayerNorm"):
            m.forward = types.MethodType(_cohere_ln64, m)
        elif name == "GptOssRotaryEmbedding":
            dim = m.inv_freq.shape[0] * 2
            inv, att = inv_freq64(cfg, dim)
            assert torch.allclose(inv, m.inv_freq.to(torch.float64), rtol=1e-6, atol=0), (inv, m.inv_freq)
            assert abs(att - m.attention_scaling) < 1e-12, (att, m.attention_scaling)
            m.forward = types.MethodType(_gpt_oss_rope64(cfg, dim), m)
        elif name in VISION_ROPES:
            continue
        elif name in MROPES:
            dim = m.inv_freq.shape[0] * 2
            inv, att = inv_freq64(cfg, dim)
            assert torch.allclose(inv, m.inv_freq.to(torch.float64), rtol=1e-6, atol=0), (inv, m.inv_freq)
            assert abs(att - m.attention_scaling) < 1e-12, (att, m.attention_scaling)
            # The port against transformers' own (float32) cos and sin, over
            # text positions (every axis the same) past the case's.
            pos = torch.arange(32).view(1, 1, -1).expand(3, 2, -1)
            x = torch.zeros(1, dtype=torch.float64)
            ours = _mrope64(cfg, dim)(m, x, pos)
            theirs = type(m).forward(m, x, pos)
            for a, b in zip(ours, theirs):
                assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6), (a, b)
            m.forward = types.MethodType(_mrope64(cfg, dim), m)
        elif name == "DeepseekV2RotaryEmbedding":
            dim = m.inv_freq.shape[0] * 2
            inv, att = inv_freq64(cfg, dim)
            assert torch.allclose(inv, m.inv_freq.to(torch.float64), rtol=1e-6, atol=0), (inv, m.inv_freq)
            assert abs(att - m.attention_scaling) < 1e-12, (att, m.attention_scaling)
            m.forward = types.MethodType(_deepseek_v2_rope64(cfg, dim), m)
            importlib.import_module(type(m).__module__).apply_rotary_emb = _deepseek_v2_apply_rotary64
        elif name.endswith("RotaryEmbedding") and hasattr(m, "rope_type") and isinstance(m.rope_type, dict):
            # OLMo 3, Gemma 3: one set of frequencies per block kind.
            kinds = {}
            for kind in m.layer_types:
                kcfg = types.SimpleNamespace(
                    rope_parameters=cfg.rope_parameters[kind],
                    max_position_embeddings=cfg.max_position_embeddings,
                )
                dim = getattr(m, f"{kind}_inv_freq").shape[0] * 2
                inv, att = inv_freq64(kcfg, dim)
                assert torch.allclose(inv, getattr(m, f"{kind}_inv_freq").to(torch.float64), rtol=1e-6, atol=0)
                assert abs(att - getattr(m, f"{kind}_attention_scaling")) < 1e-12
                kinds[kind] = _rope64(kcfg, dim)
            m.forward = types.MethodType(
                lambda self, x, position_ids, layer_type: kinds[layer_type](self, x, position_ids), m
            )
        elif name.endswith("RotaryEmbedding"):
            dim = m.inv_freq.shape[0] * 2
            inv, att = inv_freq64(cfg, dim)
            # The port must give transformers' own numbers, to its float32.
            assert torch.allclose(inv, m.inv_freq.to(torch.float64), rtol=1e-6, atol=0), (inv, m.inv_freq)
            assert abs(att - m.attention_scaling) < 1e-12, (att, m.attention_scaling)
            interleave = name in ("CohereRotaryEmbedding", "Cohere2RotaryEmbedding")
            if interleave:
                _cohere_rotary64(importlib.import_module(type(m).__module__))
            m.forward = types.MethodType(_rope64(cfg, dim, interleave), m)


# ---- MXFP4 (GPT-OSS's published expert format) ------------------------------
#
# As transformers defines it (integrations/mxfp4.py: FP4_VALUES and
# convert_moe_packed_tensors, which Mxfp4Dequantize runs on load) and as
# openai/gpt-oss-20b stores it. An expert weight the model holds as
# W [E, K, N] (used as x @ W[e]: K inputs, N outputs; `experts.gate_up_proj`
# [E, H, 2I], `experts.down_proj` [E, I, H]) is stored as two uint8 tensors
# over its TRANSPOSE [E, N, K], cut along K into blocks of 32:
#
#   <name>_scales  uint8 [E, N, K/32]       one E8M0 exponent per block:
#                                           the block's factor is 2^(s - 127)
#   <name>_blocks  uint8 [E, N, K/32, 16]   the block's 32 values, two a byte:
#                                           byte j holds value 2j in its LOW
#                                           nibble (b & 0x0F) and value 2j+1
#                                           in its HIGH nibble (b >> 4)
#
# Each nibble is an FP4 e2m1 code (bit 3 the sign, bits 2-1 the exponent,
# bit 0 the mantissa), FP4_VALUES[code]:
#
#   code   0    1    2    3    4    5    6    7
#   value +0.0 +0.5 +1.0 +1.5 +2.0 +3.0 +4.0 +6.0
#   code   8    9    10   11   12   13   14   15
#   value -0.0 -0.5 -1.0 -1.5 -2.0 -3.0 -4.0 -6.0
#
# so, with b = blocks[e, n, k // 32, (k % 32) // 2] and
# c = b & 0x0F if k is even else b >> 4:
#
#   W[e, k, n] = FP4_VALUES[c] * 2^(scales[e, n, k // 32] - 127)
#
# (transformers: ldexp of the table value by the int32 s - 127, in the
# parameter's dtype, then the [E, N, K] result transposed to [E, K, N]).
# Every such value is exact in float32 (and bf16). The config.json carries
# the hub's quantization_config (MXFP4_QUANTIZATION_CONFIG); the checkpoint
# keeps every other tensor, the experts' biases included, unquantized.

MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}

FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_dequant_reference(blocks, scales):
    """The layout above, element by element as written (a check of that
    description against transformers' own dequantization)."""
    e_, n_, g_, _ = blocks.shape
    k_ = g_ * 32
    k = torch.arange(k_)
    b = blocks[:, :, k // 32, (k % 32) // 2].to(torch.int64)  # [E, N, K]
    code = torch.where(k % 2 == 0, b & 0x0F, b >> 4)
    value = torch.tensor(FP4_E2M1, dtype=torch.float64)[code]
    factor = torch.pow(2.0, scales[:, :, k // 32].to(torch.float64) - 127)
    return (value * factor).transpose(1, 2).to(torch.float32)


def mxfp4_experts(model, gen):
    """Random MXFP4 experts: random codes (every byte uniform: both nibbles
    over all 16 codes) and scales 2^-8 … 2^-5 (weights up to 0.19, the
    spread of the other cases' 0.1 · randn), the float
    weights made by transformers' own dequantization and put in the model.
    Returns {fused name: (blocks, scales, weight)}."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if not pname.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                continue
            e, k, n = p.shape
            assert k % 32 == 0, (pname, p.shape)
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(127 - 8, 127 - 5 + 1, (e, n, k // 32), generator=gen).to(torch.uint8)
            w = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert w.shape == p.shape and w.dtype == torch.float32, (pname, w.shape, p.shape)
            assert torch.equal(w, mxfp4_dequant_reference(blocks, scales)), pname
            p.copy_(w)
            packed[pname] = (blocks, scales, w.clone())
    return packed


def write_mxfp4_checkpoint(case_dir: Path, packed):
    """Rewrites a saved checkpoint the way OpenAI publishes GPT-OSS: each
    fused expert weight replaced by its `_blocks` and `_scales`, the hub's
    quantization_config in config.json."""
    from safetensors import safe_open

    path = case_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for pname, (blocks, scales, w) in packed.items():
        assert torch.equal(tensors.pop(pname), w), pname
        tensors[pname + "_blocks"] = blocks.contiguous()
        tensors[pname + "_scales"] = scales.contiguous()
    save_file(tensors, path, metadata=meta)
    cfg_path = case_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def add_mtp_tensors(case_dir: Path, hidden, gen):
    """Adds to a saved checkpoint two tensors named and shaped as the Hub's
    Qwen3.5 multi-token-prediction weights (random, f32): `mtp.fc.weight`
    [hidden, 2 hidden] and `mtp.layers.0.input_layernorm.weight` [hidden].
    Returns their names."""
    from safetensors import safe_open

    path = case_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    mtp = {
        "mtp.fc.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen, dtype=torch.float32),
        "mtp.layers.0.input_layernorm.weight": 0.2 * torch.randn(hidden, generator=gen, dtype=torch.float32),
    }
    assert not tensors.keys() & mtp.keys()
    tensors.update(mtp)
    save_file(tensors, path, metadata=meta)
    return sorted(mtp)


def olmo_hybrid_conv_widths(deltanet):
    """OLMo Hybrid's conv channels over [q | k | v]: [key heads x key dim,
    the same, value heads x value dim]."""
    sizes = [deltanet.key_dim, deltanet.key_dim, deltanet.value_dim]
    assert sum(sizes) == deltanet.conv1d.weight.shape[0], sizes
    return sizes


def write_olmo_hybrid_convs(case_dir: Path, model):
    """Rewrites a saved OLMo Hybrid checkpoint's linear_attn.{q,k,v}_conv1d
    at the real widths. transformers (5.24) concatenates the three on load
    (its conversion mapping's Concatenate(dim=0)) and on save reverses that
    with Chunk, equal thirds of the channels (27 / 27 / 26 of 80 here), not
    the q / k / v widths the Hub's checkpoints have (16 / 16 / 48 here) and
    megatrain expects: the in-memory conv [C, 1, K] cut at [key_dim,
    key_dim, value_dim] rows instead. Every other tensor as transformers
    wrote it. Returns the conv tensors' shapes by name."""
    from safetensors import safe_open

    path = case_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    shapes = {}
    for mname, m in model.named_modules():
        if type(m).__name__ != "OlmoHybridGatedDeltaNet":
            continue
        stem = f"{mname}."
        names = [f"{stem}{x}_conv1d.weight" for x in "qkv"]
        assert all(n in tensors for n in names) and f"{stem}conv1d.weight" not in tensors, mname
        w = m.conv1d.weight.detach()
        assert torch.equal(torch.cat([tensors[n] for n in names]), w), mname
        for n, piece in zip(names, w.split(olmo_hybrid_conv_widths(m), dim=0)):
            assert piece.dtype == tensors[n].dtype, n
            tensors[n] = piece.contiguous().clone()
            shapes[n] = list(piece.shape)
    assert shapes, "no OLMo Hybrid DeltaNet"
    save_file(tensors, path, metadata=meta)
    return shapes


def kimi_linear_conv_widths(kda):
    """Kimi Linear's conv channels over [q | k | v]: heads x head dim each
    (its q, k and v share the head count and width)."""
    sizes = [kda.qkv_dim] * 3
    assert sum(sizes) == kda.conv1d.weight.shape[0], sizes
    return sizes


def write_kimi_linear_checkpoint(case_dir: Path, model):
    """Checks and rewrites a saved Kimi Linear checkpoint as the Hub's are.
    transformers (5.24) renames `block_sparse_moe.` to `mlp.` on load and
    reverses that on save for every block, so its dense blocks' MLPs come
    out as `block_sparse_moe.{gate,up,down}_proj`, where the Hub's
    checkpoints (and Moonshot's modeling code: `self.mlp` below
    first_k_dense_replace, `self.block_sparse_moe` from it) have
    `mlp.{gate,up,down}_proj`: renamed back here (transformers loads both).
    Its q / k / v conv tensors, which save writes as equal thirds of the
    stacked conv, are checked to be the real widths (heads x head dim
    each, equal here). Every other tensor as transformers wrote it.
    Returns the renamed tensors' names (old, new) and the conv tensors'
    shapes by name."""
    from safetensors import safe_open

    path = case_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    renamed, shapes = [], {}
    for mname, m in model.named_modules():
        kind = type(m).__name__
        if kind == "KimiLinearDeltaAttention":
            stem = f"{mname}."
            names = [f"{stem}{x}_conv1d.weight" for x in "qkv"]
            assert all(n in tensors for n in names) and f"{stem}conv1d.weight" not in tensors, mname
            w = m.conv1d.weight.detach()
            for n, piece in zip(names, w.split(kimi_linear_conv_widths(m), dim=0)):
                assert torch.equal(tensors[n], piece), n
                shapes[n] = list(tensors[n].shape)
        elif kind == "KimiLinearMLP" and mname.endswith(".mlp"):
            # A dense block's MLP (not a routed block's shared_experts).
            for proj in ("gate_proj", "up_proj", "down_proj"):
                old = f"{mname.removesuffix('.mlp')}.block_sparse_moe.{proj}.weight"
                new = f"{mname}.{proj}.weight"
                assert old in tensors and new not in tensors, (old, new)
                assert torch.equal(tensors[old], getattr(m, proj).weight.detach()), old
                tensors[new] = tensors.pop(old)
                renamed.append((old, new))
    assert shapes and renamed, "no Kimi Linear KDA or dense MLP"
    save_file(tensors, path, metadata=meta)
    return renamed, shapes


def check_mxfp4_load(case_dir: Path, model_cls, model, packed):
    """transformers loads the MXFP4 checkpoint (dequantizing on CPU) into
    exactly the weights the golden ran on."""
    from transformers import Mxfp4Config

    loaded = model_cls.from_pretrained(
        case_dir, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    ours = dict(model.named_parameters())
    theirs = dict(loaded.named_parameters())
    assert ours.keys() == theirs.keys(), ours.keys() ^ theirs.keys()
    for pname, p in theirs.items():
        assert p.dtype == torch.float32 and torch.equal(p, ours[pname]), pname
    for pname, (_, _, w) in packed.items():
        assert torch.equal(theirs[pname], w), pname


# ---- float64 check and SwiGLU clamp shares ----------------------------------


LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex32)


class Float32Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op (forward or backward) whose result holds a float32,
    float16 or bfloat16 tensor (or a complex one of those, as DeepSeek-V2's
    RoPE makes): none may be left in a float64 reference."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION for t in leaves):
            self.ops.add(str(func))
        return out


def count_swiglu_clamps(model):
    """Wraps GPT-OSS's experts' clamped SwiGLU to count, over the forward,
    how many gate entries exceed the limit and how many up entries lie
    outside ±limit. Returns the running counts [gate over, up out, total]."""
    counts = [0, 0, 0]
    for m in model.modules():
        if type(m).__name__ == "GptOssExperts":
            original = m._apply_gate

            def apply(gate_up, m=m, original=original):
                with torch.no_grad():
                    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                    counts[0] += int((gate > m.limit).sum())
                    counts[1] += int((up.abs() > m.limit).sum())
                    counts[2] += gate.numel()
                return original(gate_up)

            m._apply_gate = apply
    return counts


def randomize(model, gen):
    """Weights with enough spread that every path matters (norm gains and
    biases away from 1 and 0)."""
    # Routers that score experts by a sigmoid (GLM-4.5's, beside their
    # e_score_correction_bias).
    sigmoid_routers = {
        n.removesuffix("e_score_correction_bias") + "weight"
        for n, _ in model.named_buffers()
        if n.endswith("e_score_correction_bias")
    }
    # DeepSeek-V2's routers, whose weights are the chosen softmax
    # probabilities themselves (not renormalised over the top k).
    unnormalised_routers = {
        n + ".weight" for n, m in model.named_modules() if type(m).__name__ == "DeepseekV2TopkRouter"
    }
    # Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's zero-centred RMSNorms (gain
    # 1 + w).
    zero_centred = {n + ".weight" for n, m in model.named_modules() if type(m).__name__ in ZERO_CENTRED_NORMS}
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name in zero_centred:
                # Gains 1 + w around 1 (w as the other cases' 1-D gains less 1).
                p.copy_(0.2 * r)
            elif name.endswith(("linear_attn.A_log", "self_attn.forget_gate.A_log")):
                # The Gated DeltaNet's decay rate per value head, A = exp(A_log)
                # in g = -A softplus(a + dt_bias) (Kimi Linear's KDA: per head,
                # over each key channel's softplus): A uniform in (0.1, 1.5), so
                # that the decays exp(g) spread over (0, 1) (make_case prints
                # their spread), neither all near 1 (A_log as a 1-D gain,
                # 1 + 0.2 randn, has A near e and most decays near 0) nor 0.
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                p.copy_(torch.log(0.1 + 1.4 * u))
            elif name.endswith(("linear_attn.dt_bias", "self_attn.forget_gate.dt_bias")):
                # Its bias inside the softplus, around 0 (KDA's: one a key
                # channel).
                p.copy_(r)
            elif name.endswith(("linear_attn.conv1d.weight", "self_attn.conv1d.weight")):
                # The causal depthwise convolution's taps [C, 1, kernel]: 4
                # taps times 0.5 randn keep the scale of its input into the
                # SiLU (0.1 randn would shrink it fivefold into SiLU's
                # linear part).
                p.copy_(0.5 * r)
            elif name.endswith(("linear_attn.norm.weight", "linear_attn.o_norm.weight", "self_attn.o_norm.weight")):
                # The gated RMSNorm's gain (plain, not 1 + w): as any 1-D gain.
                p.copy_(1.0 + 0.2 * r)
            elif name in unnormalised_routers:
                # Logits around ±2 (hidden 32): every chosen probability
                # large enough to matter (full randn leaves some tokens' k-th
                # near 1e-7, and their weight is that probability), the
                # choices still clear of rounding (make_case prints the gaps).
                p.copy_(0.3 * r)
            elif name in sigmoid_routers:
                # Logits around ±2 (hidden 32-48): sigmoid scores spread over
                # (0, 1), few saturated (full randn saturates a third and
                # leaves their gradients near zero), still clear apart.
                p.copy_(0.3 * r)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")):
                # A MoE router: scores far enough apart that the choice of
                # experts is clear of rounding.
                p.copy_(r)
            elif name.endswith("self_attn.sinks"):
                # GPT-OSS's attention sinks (logits beside each row of
                # scores): around 0, some heads' large enough to matter.
                p.copy_(0.5 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * r)
            else:
                p.copy_(0.1 * r)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # GLM-4.5's correction of the router's scores for the choice
                # of experts (a buffer the checkpoint holds): large enough
                # to change some choices.
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def cross_entropy(logits, targets):
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-100, reduction="mean")


def golden_grads(model, cfg, saved_names):
    """{"grad." + checkpoint name: f32 gradient} of a model after backward.
    `saved_names`: the checkpoint's tensors' shapes by name."""
    grads = {}
    for pname, p in model.named_parameters():
        if pname.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            for n, g in expert_grads(pname, p.grad, saved_names).items():
                grads["grad." + n] = g.to(torch.float32).contiguous()
            continue
        if cfg.model_type == "olmo_hybrid" and pname.endswith(".linear_attn.conv1d.weight"):
            # OLMo Hybrid's conv over [q | k | v], which the checkpoint holds
            # as q_conv1d, k_conv1d and v_conv1d (transformers concatenates
            # them on load): the gradient cut at the real q / k / v widths,
            # as write_olmo_hybrid_convs rewrites the saved file.
            stem = pname.removesuffix("conv1d.weight")
            names = [f"{stem}{x}_conv1d.weight" for x in "qkv"]
            sizes = olmo_hybrid_conv_widths(model.get_submodule(pname.removesuffix(".conv1d.weight")))
            assert pname not in saved_names, pname
            assert [saved_names[n][0] for n in names] == sizes, (pname, sizes)
            for n, g in zip(names, p.grad.split(sizes, dim=0)):
                grads["grad." + n] = g.to(torch.float32).contiguous()
            continue
        if cfg.model_type == "kimi_linear" and pname.endswith(".self_attn.conv1d.weight"):
            # Kimi Linear's conv over [q | k | v], which the checkpoint
            # holds as q_conv1d, k_conv1d and v_conv1d (heads x head dim
            # each, as saved: write_kimi_linear_checkpoint checks them).
            stem = pname.removesuffix("conv1d.weight")
            names = [f"{stem}{x}_conv1d.weight" for x in "qkv"]
            sizes = kimi_linear_conv_widths(model.get_submodule(pname.removesuffix(".conv1d.weight")))
            assert pname not in saved_names, pname
            assert [saved_names[n][0] for n in names] == sizes, (pname, sizes)
            for n, g in zip(names, p.grad.split(sizes, dim=0)):
                grads["grad." + n] = g.to(torch.float32).contiguous()
            continue
        if cfg.model_type == "kimi_linear":
            # transformers' renaming on save (its conversion mapping's
            # WeightRenaming, reversed): the KDA's forget gate's tensors
            # directly under self_attn (f_a_proj, f_b_proj, dt_bias, A_log).
            pname = pname.replace(".self_attn.forget_gate.", ".self_attn.")
        if cfg.model_type == "olmo_hybrid":
            # transformers' renaming on save (its conversion mapping's
            # WeightRenaming, reversed): every block's post_attention_layernorm
            # (the DeltaNet blocks' pre-MLP norm, the attention blocks' norm
            # after the attention) as feedforward_layer_norm, the DeltaNet
            # blocks' input_layernorm as attention_layer_norm.
            pname = pname.replace(".input_layernorm.", ".attention_layer_norm.")
            pname = pname.replace(".post_attention_layernorm.", ".feedforward_layer_norm.")
        if ".mlp.gate.weight" in pname and pname.replace(".mlp.", ".block_sparse_moe.") in saved_names:
            pname = pname.replace(".mlp.", ".block_sparse_moe.")
        elif cfg.model_type == "kimi_linear" and pname not in saved_names and ".mlp." in pname:
            # A routed block's router and shared expert, saved under
            # block_sparse_moe (its dense blocks' MLPs stay mlp.: see
            # write_kimi_linear_checkpoint).
            pname = pname.replace(".mlp.", ".block_sparse_moe.")
        if pname.startswith("model.language_model."):
            # A multimodal model's text stack, under the text model's names.
            pname = "model." + pname.removeprefix("model.language_model.")
        elif pname == "lm_head.weight" and cfg.model_type == "gpt_neox":
            # transformers 5 renames GPT-NeoX's head on load, and back on save.
            pname = "embed_out.weight"
        elif p.grad is None:
            # Its vision tower and projector (Gemma 3's; Qwen3.5's tower
            # with its merger), which text never reaches.
            assert pname.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")), pname
            continue
        grads["grad." + pname] = p.grad.to(torch.float32).contiguous()
    for bname, b in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):
            # A checkpoint tensor no gradient reaches: zeros, so that every
            # tensor of the checkpoint has one.
            if cfg.model_type == "kimi_linear":
                bname = bname.replace(".mlp.", ".block_sparse_moe.")
            assert bname in saved_names, bname
            grads["grad." + bname] = torch.zeros(b.shape, dtype=torch.float32)
    return grads


def check_reload(name, case_dir: Path, model_cls, golden, saved_names):
    """The saved checkpoint, loaded back by from_pretrained in float64 (as
    check_export.py loads an export) and run the same way, reproduces the
    golden's logits, loss and gradients bit for bit; transformers reports no
    checkpoint tensor it did not use and no parameter it did not load."""
    model, info = model_cls.from_pretrained(
        case_dir,
        dtype=torch.float64,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{name}: reload: {problems}"
    # The router's weight and correction bias load float32 whatever the
    # dtype (_keep_in_fp32_modules_strict): widened as make_case widens them.
    model = model.to(torch.float64)
    model.eval()
    patch_float64(model)
    logits = model(input_ids=golden["input_ids"].long()).logits
    loss = cross_entropy(logits, golden["targets"].long())
    loss.backward()
    assert torch.equal(logits.detach(), golden["logits"]), f"{name}: reload: logits differ"
    assert torch.equal(loss.detach().reshape(1), golden["loss"]), f"{name}: reload: loss differs"
    grads = golden_grads(model, model.config, saved_names)
    assert grads.keys() == {k for k in golden if k.startswith("grad.")}, f"{name}: reload: gradient names differ"
    for k, g in grads.items():
        assert torch.equal(g, golden[k]), f"{name}: reload: {k} differs"
    print(f"  {name}: reload reproduces logits, loss and {len(grads)} gradients exactly")


def make_case(out: Path, name, cfg_cls, model_cls, kwargs, seq, store_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg_cls(**kwargs, attn_implementation="eager")
    if "experts" in " ".join(kwargs):
        # The per-expert loop, which runs in float64 (grouped_mm does not).
        cfg._experts_implementation = "eager"
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    model = model_cls(cfg).to(torch.float32)
    randomize(model, gen)
    packed = mxfp4_experts(model, gen) if name in MXFP4_CASES else {}
    # RoPE's inverse frequencies as transformers forms them (float32), which
    # the conversions below would round to a bf16 / f16 stored dtype:
    # patch_float64 checks its float64 port against these.
    inv_freqs = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
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
    if packed:
        write_mxfp4_checkpoint(case_dir, packed)
        check_mxfp4_load(case_dir, model_cls, model, packed)
    if cfg.model_type == "olmo_hybrid":
        shapes = write_olmo_hybrid_convs(case_dir, model)
        seen = {(n.rsplit(".", 2)[1], tuple(s)) for n, s in shapes.items()}
        seen = sorted(seen, key=lambda x: "qkv".index(x[0][0]))
        print(f"  {name}: conv tensors rewritten at the real widths: {', '.join(f'{n} {list(s)}' for n, s in seen)}")
    if cfg.model_type == "kimi_linear":
        renamed, shapes = write_kimi_linear_checkpoint(case_dir, model)
        print(f"  {name}: dense MLPs renamed as the Hub has them: {', '.join(f'{a} -> {b}' for a, b in renamed)}")
        print(f"  {name}: conv tensors at the real widths: {', '.join(f'{n} {s}' for n, s in shapes.items())}")
    if name in MTP_CASES:
        added = add_mtp_tensors(case_dir, cfg.get_text_config().hidden_size, gen)
        print(f"  {name}: added to model.safetensors (transformers ignores them): {', '.join(added)}")

    model = model.to(torch.float64)
    for n, b in inv_freqs.items():
        model.get_buffer(n).copy_(b)
    model.eval()
    # transformers' own forward (float32 inside), to check the float64 ports
    # against.
    unpatched = copy.deepcopy(model) if cfg.model_type in DELTANET_TYPES else None
    patch_float64(model)
    # GPT-OSS, GLM-4.5, DeepSeek-V3, DeepSeek-V2, Qwen3.5, Qwen3.5-MoE,
    # Qwen3-Next: every op of the forward and backward checked to stay
    # float64.
    watch = Float32Watch() if cfg.model_type in WATCHED else None
    clamps = count_swiglu_clamps(model)
    routes = record_glm4_moe_routes(model)
    ids = torch.randint(0, cfg.get_text_config().vocab_size, (BATCH, seq + 1), generator=gen)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].clone()
    targets[0, 2] = -100
    targets[1, -1] = -100
    if unpatched is not None:
        with torch.no_grad():
            theirs = unpatched(input_ids=inputs).logits
        del unpatched
    if watch is not None:
        watch.__enter__()
    out = model(input_ids=inputs)
    logits = out.logits
    loss = cross_entropy(logits, targets)
    if getattr(cfg, "output_router_logits", False):
        # transformers' own loss adds the routers' load-balancing loss so.
        loss = loss + cfg.router_aux_loss_coef * out.aux_loss
    loss.backward()
    if watch is not None:
        watch.__exit__(None, None, None)
        assert not watch.ops, f"{name}: ops outside float64: {sorted(watch.ops)}"
    if cfg.model_type in DELTANET_TYPES:
        deltanets = [m for m in model.modules() if type(m).__name__ in GATED_DELTANETS + KDA_DELTANETS]
        assert deltanets and all(m._float64_runs == 1 for m in deltanets), f"{name}: the float64 DeltaNet did not run"
        # The ports (float64) agree with transformers' own forward (float32
        # inside) to its rounding.
        err = float((logits.detach() - theirs).abs().max() / theirs.abs().max())
        assert err < 1e-5, f"{name}: float64 logits differ from transformers' by {err:.3e} (relative to the largest)"
        decays = torch.cat([m._decays.flatten() for m in deltanets])
        q = torch.quantile(decays, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=decays.dtype)).tolist()
        print(
            f"  {name}: logits within {err:.1e} of transformers' own (float32 inside);"
            f" decays exp(g) min / 10% / median / 90% / max {' / '.join(f'{x:.3f}' for x in q)}"
        )

    golden = {
        "input_ids": inputs.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().to(torch.float64).contiguous(),
        "loss": loss.detach().reshape(1),
    }
    from safetensors import safe_open

    with safe_open(case_dir / "model.safetensors", "pt") as f:
        # Each checkpoint tensor's shape, by name.
        saved_names = {k: f.get_slice(k).get_shape() for k in f.keys()}
    for pname, (_, _, w) in packed.items():
        # The experts' weights as transformers dequantizes them.
        golden["dequant." + pname] = w.contiguous()
    golden.update(golden_grads(model, cfg, saved_names))
    # The checkpoint's tensors under the text model's names (a multimodal
    # checkpoint holds its text stack under `model.language_model.`, or
    # under `language_model.model.` as transformers writes Gemma 3's), less
    # those megatrain leaves out: a vision tower and its projector or
    # merger, and multi-token-prediction weights.
    left_out = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    left_out += ("model.visual.", "mtp.")
    text_names = {
        "model." + n.split(".", 2)[2] if n.startswith(("model.language_model.", "language_model.model.")) else n
        for n in saved_names
        if not n.startswith(left_out)
    }
    if cfg.model_type in ("glm4_moe", "deepseek_v3", "deepseek_v2") or cfg.model_type in DELTANET_TYPES:
        lacking = sorted(text_names - {k[5:] for k in golden if k.startswith("grad.")})
        assert not lacking, f"{name}: checkpoint tensors without a gradient: {lacking}"
    missing = [
        k
        for k in golden
        if k.startswith("grad.")
        and k[5:] not in text_names
        and k[5:] + "_blocks" not in saved_names
        and k[5:] != "lm_head.weight"
    ]
    assert not missing, f"{name}: gradients under names the checkpoint lacks: {missing}"
    save_file(golden, case_dir / "golden.safetensors")
    if cfg.model_type in RELOADED:
        check_reload(name, case_dir, model_cls, golden, saved_names)
    n = sum(p.numel() for p in model.parameters())
    extra = ""
    if clamps[2]:
        extra = (
            f", SwiGLU clamps bind on {100 * clamps[0] / clamps[2]:.1f}% of gate and"
            f" {100 * clamps[1] / clamps[2]:.1f}% of up entries (of {clamps[2]})"
        )
    print(f"{name}: {n} params, seq {seq}, loss {loss.item():.6f}, stored {store_dtype}{extra}")
    glm4_moe_route_report(name, routes)


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


# Configs (as a config.json writes them) whose RoPE scaling transformers
# computes for `rope_scaling.json`: released models' own fields and each
# optional knob of the formulas, in v4 (`rope_scaling`, `type`) and v5
# (`rope_parameters`) spellings.
LLAMA_32_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=500000.0,
    rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
)
QWEN25_7B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    max_position_embeddings=32768, rope_theta=1000000.0,
)
PHI35 = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.02 * i for i in range(48)],
                      long_factor=[1.0 + 0.9 * i for i in range(48)]),
)
ROPE_SCALINGS = {
    "llama-3.2-1b": LLAMA_32_1B,
    "llama-3.1-8b": {**LLAMA_32_1B, "hidden_size": 4096, "num_attention_heads": 32,
                     "rope_scaling": {**LLAMA_32_1B["rope_scaling"], "factor": 8.0}},
    "llama3-v5": {**{k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_theta", "rope_scaling")},
                  "rope_parameters": {**LLAMA_32_1B["rope_scaling"], "rope_theta": 500000.0}},
    "linear-v4-type": {**LLAMA_32_1B, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "dynamic": {**LLAMA_32_1B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    # Past max_position_embeddings: the base a forward ending there gets.
    "dynamic-past": {**LLAMA_32_1B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "end": 200000},
    "dynamic-far-past": {**LLAMA_32_1B, "rope_scaling": {"rope_type": "dynamic", "factor": 3.5},
                         "end": 1000000},
    "qwen2.5-7b-yarn": {**QWEN25_7B, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}},
    "yarn-mscale": {**QWEN25_7B, "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                  "mscale_all_dim": 1.0,
                                                  "original_max_position_embeddings": 4096}},
    "yarn-knobs": {**QWEN25_7B, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                    "attention_factor": 0.9, "beta_fast": 16.0, "beta_slow": 2.0,
                                                    "truncate": False, "original_max_position_embeddings": 2048}},
    "yarn-no-original": {**QWEN25_7B, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    "yarn-top-level-original": {**QWEN25_7B, "original_max_position_embeddings": 8192,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 4096}},
    # Phi-3.5-mini's shape and arrangement (top-level original context,
    # `type: longrope`, no factor), within and past the original context.
    "phi3.5-longrope-short": {**PHI35, "end": 4096},
    "phi3.5-longrope-long": {**PHI35, "end": 4097},
    # Phi-3's older `su` (transformers 5 needs the original context inside).
    "phi3-su": {
        **PHI35,
        "rope_scaling": {**PHI35["rope_scaling"], "type": "su", "original_max_position_embeddings": 4096},
        "end": 9000,
    },
}


def make_rope_scaling(out: Path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    classes = {
        "llama": (LlamaConfig, LlamaRotaryEmbedding),
        "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
        "phi3": (Phi3Config, Phi3RotaryEmbedding),
    }
    cases = {}
    for name, given in ROPE_SCALINGS.items():
        fields = {k: v for k, v in given.items() if k != "end"}
        cfg_cls, emb_cls = classes[fields["model_type"]]
        kwargs = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
        cfg = cfg_cls(**json.loads(json.dumps(kwargs)))
        emb = emb_cls(config=cfg)
        inv, att = emb.inv_freq, emb.attention_scaling
        if "end" in given:
            # The frequencies of a forward whose positions end there (what
            # transformers' dynamic update computes for LongRoPE).
            inv, att = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, None, given["end"])
        cases[name] = {
            "config": fields,
            "end": given.get("end"),
            "inv_freq": inv.tolist(),
            "attention_factor": float(att),
        }
    (out / "rope_scaling.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"rope_scaling: {len(cases)} configs")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="crates/zoo/tests/fixtures")
    ap.add_argument("--only", nargs="+", metavar="CASE", help="write only these cases (or 'tokenizer', 'rope_scaling')")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    wanted = lambda name: args.only is None or name in args.only
    for i, (name, (cfg_cls, model_cls, kwargs, seq, dtype)) in enumerate(CASES.items()):
        if wanted(name):
            make_case(out, name, cfg_cls, model_cls, kwargs, seq, dtype, seed=1000 + i)
    if wanted("tokenizer"):
        make_tokenizer(out)
    if wanted("rope_scaling"):
        make_rope_scaling(out)


if __name__ == "__main__":
    main()
