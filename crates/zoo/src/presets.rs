//! Named model shapes. Building a preset allocates no weights: the planner
//! reads sizes from the config and its tables; weights come from
//! [`crate::init_layer`] (seeded) or from a checkpoint.

use megatrain_tensor::RopeScaling;

use crate::config::synthetic_path;
use crate::{Arch, ModelConfig, Result, ZooError};

/// Every preset name [`preset`] knows.
pub const PRESET_NAMES: &[&str] = &[
    "gpt2-nano",
    "gpt2-124m",
    "llama-tiny",
    "tinyllama-1.1b",
    "llama-2-7b",
    "qwen2.5-7b",
    "llama-2-13b",
    "qwen2.5-14b",
    "llama-3-70b",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "gemma-3-1b",
    "gemma-2-2b",
    "pythia-1b",
    "mixtral-tiny",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "olmoe-1b-7b",
    "qwen1.5-moe-a2.7b",
    "gpt-oss-tiny",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "glm-4.5-air",
    "glm-4.5",
    "deepseek-v3-tiny",
    "deepseek-v3",
    "kimi-k2",
    "deepseek-v2-lite",
    "qwen3.5-tiny",
    "qwen3.5-moe-tiny",
    "qwen3.5-9b",
    "qwen3.5-35b-a3b",
    "qwen3-next-80b-a3b",
    "olmo-hybrid-7b",
    "kimi-linear-48b-a3b",
];

/// Llama 3.1's and 3.2's RoPE scaling (their `config.json`'s `rope_scaling`
/// beside the factor).
fn llama31_rope(factor: f64) -> RopeScaling {
    RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 8192.0,
    }
}

fn gpt2(vocab: usize, layers: usize, heads: usize, width: usize, ctx: usize) -> ModelConfig {
    ModelConfig {
        arch: Arch::Gpt2,
        vocab_size: vocab,
        hidden_size: width,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: width / heads,
        intermediate_size: 4 * width,
        max_position_embeddings: ctx,
        norm_eps: 1e-5,
        rope_theta: 0.0,
        rope_scaling: RopeScaling::None,
        rotary_dim: None,
        tie_word_embeddings: true,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        qk_norm: false,
        sliding_window: None,
        sliding_layers: None,
        sliding_rope: None,
        nope_layers: None,
        multipliers: None,
        logit_scale: None,
        query_pre_attn_scalar: None,
        parallel_residual: false,
        exact_gelu: false,
        attn_softcap: None,
        final_softcap: None,
        pad_token_id: None,
        dtype: None,
        raw: None,
        text_of: None,
        moe: None,
        mla: None,
        linear_attn: None,
    }
}

struct LlamaShape {
    arch: Arch,
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    ctx: usize,
    theta: f64,
    eps: f64,
}

fn llama(s: LlamaShape) -> ModelConfig {
    ModelConfig {
        arch: s.arch,
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv,
        head_dim: s.hidden / s.heads,
        intermediate_size: s.inter,
        max_position_embeddings: s.ctx,
        norm_eps: s.eps,
        rope_theta: s.theta,
        rope_scaling: RopeScaling::None,
        rotary_dim: None,
        tie_word_embeddings: false,
        qkv_bias: s.arch == Arch::Qwen2,
        o_bias: false,
        mlp_bias: false,
        qk_norm: s.arch == Arch::Qwen3,
        sliding_window: None,
        sliding_layers: None,
        sliding_rope: None,
        nope_layers: None,
        multipliers: None,
        logit_scale: None,
        query_pre_attn_scalar: None,
        parallel_residual: false,
        exact_gelu: false,
        attn_softcap: None,
        final_softcap: None,
        pad_token_id: None,
        dtype: None,
        raw: None,
        text_of: None,
        moe: None,
        mla: None,
        linear_attn: None,
    }
}

/// Gemma 3 1B (`google/gemma-3-1b-pt`'s config.json, the fields its
/// config class would default written out).
fn gemma3_1b() -> Result<ModelConfig> {
    hf_preset(
        "gemma-3-1b",
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 32768,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "pad_token_id": 0,
            "tie_word_embeddings": true,
        }),
    )
}

/// Gemma 2 2B (`google/gemma-2-2b`'s config.json, the fields its config
/// class would default written out).
fn gemma2_2b() -> Result<ModelConfig> {
    hf_preset(
        "gemma-2-2b",
        serde_json::json!({
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "pad_token_id": 0,
            "tie_word_embeddings": true,
        }),
    )
}

/// Pythia 1B (`EleutherAI/pythia-1b`'s config.json).
fn pythia_1b() -> Result<ModelConfig> {
    hf_preset(
        "pythia-1b",
        serde_json::json!({
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 8,
            "hidden_act": "gelu",
            "max_position_embeddings": 2048,
            "layer_norm_eps": 1e-5,
            "rotary_emb_base": 10000,
            "rotary_pct": 0.25,
            "use_parallel_residual": true,
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }),
    )
}

/// A small Mixtral (4 experts, 2 a token) for tests and quick runs.
fn mixtral_tiny() -> Result<ModelConfig> {
    hf_preset(
        "mixtral-tiny",
        serde_json::json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": null,
            "tie_word_embeddings": false,
        }),
    )
}

/// Mixtral 8x7B (`mistralai/Mixtral-8x7B-v0.1`'s config.json): 46.7 B
/// parameters, 12.9 B read per token.
fn mixtral_8x7b() -> Result<ModelConfig> {
    hf_preset(
        "mixtral-8x7b",
        serde_json::json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.02,
            "sliding_window": null,
            "tie_word_embeddings": false,
        }),
    )
}

/// Qwen3-30B-A3B (`Qwen/Qwen3-30B-A3B`'s config.json): 30.5 B parameters,
/// 128 experts of which 8 a token, 3.3 B read per token.
fn qwen3_30b_a3b() -> Result<ModelConfig> {
    hf_preset(
        "qwen3-30b-a3b",
        serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "tie_word_embeddings": false,
        }),
    )
}

/// OLMoE-1B-7B (`allenai/OLMoE-1B-7B-0125`'s config.json): 6.9 B
/// parameters, 64 experts of which 8 a token, 1.3 B read per token.
fn olmoe_1b_7b() -> Result<ModelConfig> {
    hf_preset(
        "olmoe-1b-7b",
        serde_json::json!({
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": false,
            "clip_qkv": null,
            "pad_token_id": 1,
            "tie_word_embeddings": false,
        }),
    )
}

/// Qwen1.5-MoE-A2.7B (`Qwen/Qwen1.5-MoE-A2.7B`'s config.json): 14.3 B
/// parameters, 60 experts of which 4 a token beside a shared expert,
/// 2.7 B read per token.
fn qwen15_moe_a27b() -> Result<ModelConfig> {
    hf_preset(
        "qwen1.5-moe-a2.7b",
        serde_json::json!({
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "norm_topk_prob": false,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "tie_word_embeddings": false,
        }),
    )
}

/// GPT-OSS's block at llama-tiny's width, for a quick run: two blocks
/// (the first keeping to a window of 16), four experts of which two a
/// token, the released models' clamp and YaRN.
fn gpt_oss_tiny() -> Result<ModelConfig> {
    hf_preset(
        "gpt-oss-tiny",
        serde_json::json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "sliding_window": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": false,
        }),
    )
}

/// gpt-oss-20b (`layers` 24, `experts` 32: `openai/gpt-oss-20b`'s
/// config.json, 20.9 B parameters, 3.6 B read per token beside the
/// embedding table) and gpt-oss-120b (36 and 128: 116.8 B, 5.1 B).
fn gpt_oss(name: &str, layers: usize, experts: usize) -> Result<ModelConfig> {
    let kinds: Vec<&str> = (0..layers)
        .map(|i| ["sliding_attention", "full_attention"][i % 2])
        .collect();
    hf_preset(
        name,
        serde_json::json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": layers,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "attention_bias": true,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": false,
                "original_max_position_embeddings": 4096,
            },
            "sliding_window": 128,
            "layer_types": kinds,
            "num_local_experts": experts,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": false,
            "pad_token_id": 199999,
            "tie_word_embeddings": false,
        }),
    )
}

/// GLM-4.5-Air (`zai-org/GLM-4.5-Air`'s config.json: 106.9 B parameters,
/// 12.8 B read per token beside the embedding table; its multi-token
/// prediction layer, which transformers does not load, left out) and
/// GLM-4.5 (`zai-org/GLM-4.5`'s: 352.8 B, 32.9 B).
fn glm45(name: &str, air: bool) -> Result<ModelConfig> {
    let (hidden, layers, dense, inter, experts_width, experts, qk_norm, scale) = match air {
        true => (4096, 46, 1, 10944, 1408, 128, false, 1.0),
        false => (5120, 92, 3, 12288, 1536, 160, true, 2.5),
    };
    hf_preset(
        name,
        serde_json::json!({
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "moe_intermediate_size": experts_width,
            "num_hidden_layers": layers,
            "first_k_dense_replace": dense,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": true,
            "use_qk_norm": qk_norm,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "n_routed_experts": experts,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": scale,
            "tie_word_embeddings": false,
        }),
    )
}

/// DeepSeek-V3's block at llama-tiny's width, for a quick run: latent
/// attention (q through a rank-32 pair, a latent of 32, heads of 16 + 8
/// with values of 16), the first block dense, then 8 experts in 2 groups
/// of which one is open, 2 a token, and a shared expert.
fn deepseek_v3_tiny() -> Result<ModelConfig> {
    hf_preset(
        "deepseek-v3-tiny",
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "max_position_embeddings": 4096,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "tie_word_embeddings": false,
        }),
    )
}

/// DeepSeek-V3 (`deepseek-ai/DeepSeek-V3`'s config.json, DeepSeek-R1's
/// too: 671 B parameters, 37 B read per token; its multi-token prediction
/// layer, which transformers does not load, left out) and Kimi K2
/// (`moonshotai/Kimi-K2-Instruct`'s: 1.03 T, 33 B).
fn deepseek_v3(name: &str, kimi: bool) -> Result<ModelConfig> {
    let (vocab, heads, experts, dense, groups, scale, theta, factor, ctx) = match kimi {
        false => (129280, 128, 256, 3, (8, 4), 2.5, 10000.0, 40.0, 163840),
        true => (163840, 64, 384, 1, (1, 1), 2.827, 50000.0, 32.0, 131072),
    };
    hf_preset(
        name,
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": vocab,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": dense,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "attention_bias": false,
            "max_position_embeddings": ctx,
            "rms_norm_eps": 1e-6,
            "rope_theta": theta,
            "rope_scaling": {
                "type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "n_routed_experts": experts,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "n_group": groups.0,
            "topk_group": groups.1,
            "norm_topk_prob": true,
            "routed_scaling_factor": scale,
            "tie_word_embeddings": false,
        }),
    )
}

/// DeepSeek-V2-Lite (`deepseek-ai/DeepSeek-V2-Lite`'s config.json:
/// 15.7 B parameters, 2.7 B read per token counting the embedding table's
/// 0.2 B).
fn deepseek_v2_lite() -> Result<ModelConfig> {
    hf_preset(
        "deepseek-v2-lite",
        serde_json::json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": null,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": false,
        }),
    )
}

/// Qwen3.5's hybrid block at llama-tiny's width, for a quick run: three
/// Gated DeltaNet blocks (2 key heads read by 4 value heads, heads of 16)
/// then one of gated full attention (4 heads of 16 over 2 kv heads, RoPE
/// on a quarter of each); the MoE variant routes every block among 8
/// experts, 2 a token, beside a gated shared expert.
fn qwen35_tiny(name: &str, moe: bool) -> Result<ModelConfig> {
    let mut v = serde_json::json!({
        "architectures": [if moe { "Qwen3_5MoeForCausalLM" } else { "Qwen3_5ForCausalLM" }],
        "model_type": if moe { "qwen3_5_moe_text" } else { "qwen3_5_text" },
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": false,
    });
    if moe {
        let obj = v.as_object_mut().expect("an object");
        obj.remove("intermediate_size");
        obj.insert("num_experts".into(), serde_json::json!(8));
        obj.insert("num_experts_per_tok".into(), serde_json::json!(2));
        obj.insert("moe_intermediate_size".into(), serde_json::json!(32));
        obj.insert("shared_expert_intermediate_size".into(), serde_json::json!(48));
    }
    hf_preset(name, v)
}

/// Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B: the shapes their
/// transformers config classes default to (8.95 B, 34.7 B and 79.7 B
/// parameters), with θ 10⁷ and a 262,144-token context, Qwen's published
/// figures for these releases (the classes default to 10⁴ and 32,768).
fn qwen35(name: &str, arch: Arch) -> Result<ModelConfig> {
    let mut v = qwen35_shape(arch);
    for (field, value) in [
        ("architectures", serde_json::json!([arch.hf_architecture()])),
        ("model_type", serde_json::json!(arch.model_type())),
        ("max_position_embeddings", serde_json::json!(262144)),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
        ),
        ("tie_word_embeddings", serde_json::json!(false)),
    ] {
        v.insert(field.into(), value);
    }
    hf_preset(name, serde_json::Value::Object(v))
}

/// The shape fields of [`qwen35`]'s presets (each config class's defaults).
fn qwen35_shape(arch: Arch) -> serde_json::Map<String, serde_json::Value> {
    let v = match arch {
        Arch::Qwen35 => serde_json::json!({
            "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
        }),
        Arch::Qwen35Moe => serde_json::json!({
            "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        }),
        _ => serde_json::json!({
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": true,
        }),
    };
    v.as_object().expect("an object").clone()
}

/// OLMo Hybrid 7B and Kimi Linear 48B-A3B as their transformers config
/// classes default to (7.43 B and 49.1 B parameters, as transformers
/// counts them, Kimi's routers' correction biases besides): OLMo Hybrid's full attention on every fourth block, Kimi
/// Linear's on blocks 4, 8, .. 24 of 27 (its checkpoints' own
/// `linear_attn_config` may place them otherwise).
fn class_defaults(name: &str, arch: Arch) -> Result<ModelConfig> {
    let shape = match arch {
        Arch::OlmoHybrid => serde_json::json!({
            "vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 30, "max_position_embeddings": 65536,
        }),
        _ => serde_json::json!({
            "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 27, "num_attention_heads": 32,
        }),
    };
    let mut v = shape.as_object().expect("an object").clone();
    v.insert(
        "architectures".into(),
        serde_json::json!([arch.hf_architecture()]),
    );
    v.insert("model_type".into(), serde_json::json!(arch.model_type()));
    hf_preset(name, serde_json::Value::Object(v))
}

/// A preset read from an HF config as a checkpoint's would be, with no
/// file behind it.
fn hf_preset(name: &str, v: serde_json::Value) -> Result<ModelConfig> {
    let mut cfg = ModelConfig::from_json(v, synthetic_path(name))?;
    // Written from the fields (like every preset's), not from this literal.
    cfg.raw = None;
    Ok(cfg)
}

/// The nanoGPT shakespeare-char CPU configuration (4 layers, 4 heads, width
/// 128, context 64) over a char vocabulary of `vocab` symbols.
pub fn gpt2_nano(vocab: usize) -> ModelConfig {
    gpt2(vocab, 4, 4, 128, 64)
}

/// A preset by name. `vocab` overrides the vocabulary size; `gpt2-nano` needs
/// it (its vocabulary is the corpus's characters). The benchmark shapes
/// (TinyLlama and larger) are the real models' tensor shapes and RoPE:
/// `llama-3-70b` is Llama 3 (8k context, plain RoPE), `llama-3.2-1b` and
/// `llama-3.1-8b` carry Llama 3.1's frequency scaling.
pub fn preset(name: &str, vocab: Option<usize>) -> Result<ModelConfig> {
    use Arch::*;
    let l = |arch, vocab, hidden, inter, layers, heads, kv, ctx, theta, eps| {
        llama(LlamaShape {
            arch,
            vocab,
            hidden,
            inter,
            layers,
            heads,
            kv,
            ctx,
            theta,
            eps,
        })
    };
    let mut cfg = match name {
        "gpt2-nano" => {
            let v = vocab.ok_or_else(|| {
                ZooError::invalid(
                    "preset gpt2-nano",
                    "needs the vocabulary size of its char tokenizer",
                )
            })?;
            gpt2_nano(v)
        }
        "gpt2-124m" => gpt2(50257, 12, 12, 768, 1024),
        "llama-tiny" => l(Llama, 256, 64, 176, 2, 4, 2, 256, 10000.0, 1e-5),
        "tinyllama-1.1b" => l(Llama, 32000, 2048, 5632, 22, 32, 4, 2048, 10000.0, 1e-5),
        "llama-2-7b" => l(Llama, 32000, 4096, 11008, 32, 32, 32, 4096, 10000.0, 1e-5),
        "qwen2.5-7b" => l(Qwen2, 152064, 3584, 18944, 28, 28, 4, 32768, 1e6, 1e-6),
        "llama-2-13b" => l(Llama, 32000, 5120, 13824, 40, 40, 40, 4096, 10000.0, 1e-5),
        "qwen2.5-14b" => l(Qwen2, 152064, 5120, 13824, 48, 40, 8, 32768, 1e6, 1e-5),
        "llama-3-70b" => l(Llama, 128256, 8192, 28672, 80, 64, 8, 8192, 500000.0, 1e-5),
        "llama-3.2-1b" => ModelConfig {
            tie_word_embeddings: true,
            rope_scaling: llama31_rope(32.0),
            ..l(Llama, 128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, 1e-5)
        },
        "llama-3.1-8b" => ModelConfig {
            rope_scaling: llama31_rope(8.0),
            ..l(Llama, 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0, 1e-5)
        },
        "gemma-3-1b" => gemma3_1b()?,
        "gemma-2-2b" => gemma2_2b()?,
        "pythia-1b" => pythia_1b()?,
        "mixtral-tiny" => mixtral_tiny()?,
        "mixtral-8x7b" => mixtral_8x7b()?,
        "qwen3-30b-a3b" => qwen3_30b_a3b()?,
        "olmoe-1b-7b" => olmoe_1b_7b()?,
        "qwen1.5-moe-a2.7b" => qwen15_moe_a27b()?,
        "gpt-oss-tiny" => gpt_oss_tiny()?,
        "gpt-oss-20b" => gpt_oss(name, 24, 32)?,
        "gpt-oss-120b" => gpt_oss(name, 36, 128)?,
        "glm-4.5-air" => glm45(name, true)?,
        "glm-4.5" => glm45(name, false)?,
        "deepseek-v3-tiny" => deepseek_v3_tiny()?,
        "deepseek-v3" => deepseek_v3(name, false)?,
        "kimi-k2" => deepseek_v3(name, true)?,
        "deepseek-v2-lite" => deepseek_v2_lite()?,
        "qwen3.5-tiny" => qwen35_tiny(name, false)?,
        "qwen3.5-moe-tiny" => qwen35_tiny(name, true)?,
        "qwen3.5-9b" => qwen35(name, Arch::Qwen35)?,
        "qwen3.5-35b-a3b" => qwen35(name, Arch::Qwen35Moe)?,
        "qwen3-next-80b-a3b" => qwen35(name, Arch::Qwen3Next)?,
        "olmo-hybrid-7b" => class_defaults(name, Arch::OlmoHybrid)?,
        "kimi-linear-48b-a3b" => class_defaults(name, Arch::KimiLinear)?,
        _ => {
            return Err(ZooError::UnknownPreset {
                name: name.to_string(),
                known: PRESET_NAMES.join(", "),
            });
        }
    };
    if let Some(v) = vocab {
        cfg.vocab_size = v;
        // A padding id past the new vocabulary freezes nothing (as a
        // config's would: `padding_idx`).
        cfg.pad_token_id = cfg.pad_token_id.filter(|&p| p < v);
    }
    cfg.validate().map_err(|detail| ZooError::BadField {
        path: synthetic_path(name),
        field: "vocab_size".into(),
        detail,
    })?;
    Ok(cfg)
}
