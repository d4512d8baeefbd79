//! `ModelConfig`: the shape and options of a model, parsed from a Hugging
//! Face `config.json` (transformers v4 and v5 field names) or built by a
//! preset.
//!
//! Shape-defining fields (vocabulary, width, depth, heads, MLP width, and
//! GPT-2's context) are required: a config without them is an error naming
//! the field. Optional fields take the default of the transformers config
//! class, so that a file means here what it means to `transformers`.

mod rope;

use std::path::{Path, PathBuf};

use megatrain_tensor::{AttnMask, Glu, Rope, RopeScaling, SoftCap};
use serde_json::{Map, Value};

use crate::{Result, ZooError};
use rope::{gpt_oss_rope, parse_kinds_rope, parse_rope, parse_rope_with_theta};

mod linear_attn;
mod moe;
mod multimodal;
pub use linear_attn::LinearAttn;
pub use moe::{Moe, Router};
pub(crate) use multimodal::checkpoint_names;

/// Model families and the HF `architectures` entry each one answers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Gpt2,
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Phi-3 and Phi-4: Llama's block with q, k, v and gate, up each
    /// stored as one fused tensor (split and joined at load and export).
    Phi3,
    /// OLMo 2: norms after the attention and the MLP rather than before,
    /// and RMSNorms of the whole q and k projections.
    Olmo2,
    /// OLMo 3: OLMo 2's block, a sliding window on three blocks of four,
    /// and the RoPE scaling on the others only.
    Olmo3,
    /// SmolLM3: Llama's block, no positional encoding at all (NoPE) in
    /// every fourth block.
    SmolLM3,
    /// IBM Granite 3: Llama's block with its four multipliers
    /// ([`Multipliers`]).
    Granite,
    /// StarCoder2: LayerNorms with biases and a GELU MLP (GPT-2's) around
    /// grouped-query attention with RoPE and a sliding window.
    Starcoder2,
    /// GLM-4 (`glm`): Llama's block with q/k/v biases, gate and up stored
    /// as one tensor, and RoPE on half of each head in neighbouring pairs.
    Glm,
    /// GLM-4-0414 (`glm4`): GLM's, with norms after the attention and the
    /// MLP as well as before.
    Glm4,
    /// EXAONE 4: OLMo 2's block with q/k norms per head; a sliding window
    /// on three blocks of four, the fourth without RoPE.
    Exaone4,
    /// Phi-1.5 and Phi-2 (`phi`): attention and a GELU MLP side by side
    /// from one LayerNorm, biases everywhere (the LM head's too), RoPE on
    /// part of each head.
    Phi,
    /// Cohere Command R (`cohere`): Cohere 2's block without the window,
    /// RoPE (in neighbouring pairs) on every block.
    Cohere,
    /// Cohere Command R7B / Command A (`cohere2`): attention and a SwiGLU
    /// MLP side by side from one LayerNorm without bias, a sliding window
    /// with RoPE (in neighbouring pairs) on three blocks of four, the
    /// fourth attending to all without RoPE; logits times `logit_scale`.
    Cohere2,
    /// Gemma 2 (`gemma2`): Gemma 3's block without its q/k norms, the
    /// attention scores and the logits soft-capped (`cap · tanh(x / cap)`,
    /// `attn_logit_softcapping` 50, `final_logit_softcapping` 30), a sliding
    /// window on every other block, one RoPE.
    Gemma2,
    /// Gemma 3 (`gemma3_text`, the text-only checkpoints): Llama's block
    /// with norms after the attention and the MLP as well as before, q/k
    /// norms per head, a GeGLU MLP, RMSNorm gains stored as `1 + weight`'s
    /// weight, embeddings times √hidden, attention scores times
    /// `query_pre_attn_scalar`^−½; a sliding window on five blocks of six,
    /// their RoPE with θ of its own.
    Gemma3,
    /// GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B): two LayerNorms with
    /// biases feeding the attention and the GELU MLP side by side
    /// (`use_parallel_residual`, or one after the other), q/k/v fused head
    /// by head, RoPE on a quarter of each head unless written, untied
    /// `embed_in` / `embed_out`.
    GptNeox,
    /// Mixtral (`mixtral`): Mistral's block with a routed MLP ([`Moe`]),
    /// each token's output the top-k experts' weighted by their router
    /// probabilities renormalised over those k.
    Mixtral,
    /// Qwen3-MoE (`qwen3_moe`): Qwen3's block with a routed MLP ([`Moe`])
    /// on its sparse blocks, the probabilities renormalised under
    /// `norm_topk_prob`.
    Qwen3Moe,
    /// OLMoE (`olmoe`): Llama's block with RMSNorms of the whole q and k
    /// projections (OLMo 2's, before the residual rather than after) and
    /// a routed MLP ([`Moe`]) on every block.
    Olmoe,
    /// Qwen2-MoE (`qwen2_moe`: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block
    /// (q/k/v biases) with a routed MLP ([`Moe`]) beside a shared expert
    /// that every token takes, scaled by a sigmoid gate of its own.
    Qwen2Moe,
    /// GPT-OSS (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): Llama's block with
    /// q/k/v/o biases, a learned sink logit per head in each attention
    /// softmax, a sliding window on every other block, YaRN RoPE, and a
    /// routed MLP ([`Moe`]) whose router and experts have biases and
    /// whose experts' gate and up (one interleaved product) meet in a
    /// clamped SwiGLU.
    GptOss,
    /// GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama's block
    /// with q/k/v biases under `attention_bias`, per-head q/k norms under
    /// `use_qk_norm`, RoPE on half of each head (in halves, not GLM's
    /// pairs), dense MLPs on the first `first_k_dense_replace` blocks and
    /// on the others a routed MLP ([`Moe`]) with DeepSeek-V3's router
    /// (sigmoid scores, a correction bias and groups for the choice, the
    /// weights scaled) and ungated shared experts.
    Glm4Moe,
    /// DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3, DeepSeek-R1, Kimi K2,
    /// Moonlight): multi-head latent attention ([`Mla`]) in Llama's block,
    /// and GLM-4.5's routed MLP (DeepSeek-V3's router, ungated shared
    /// experts, dense first blocks).
    DeepseekV3,
    /// DeepSeek-V2 (`deepseek_v2`: DeepSeek-V2, V2-Lite, V2.5): DeepSeek-V3's
    /// block and latent attention (RoPE always in pairs), its router a
    /// softmax with DeepSeek-V2's group limit and scale
    /// ([`Router::SoftmaxGroups`]).
    DeepseekV2,
    /// Qwen3.5 (`qwen3_5_text`, the text model of Qwen3.5's checkpoints):
    /// Qwen3's block (per-head q/k norms) with every RMSNorm's gain stored
    /// as `1 + w`'s weight, three blocks of four a Gated DeltaNet
    /// ([`LinearAttn`]) and the fourth full attention whose output is gated
    /// by a sigmoid of a second half of q's projection, RoPE on a quarter
    /// of each head.
    Qwen35,
    /// Qwen3.5-MoE (`qwen3_5_moe_text`): Qwen3.5's block with Qwen2-MoE's
    /// routed MLP ([`Moe`]: renormalised top k, a shared expert under a
    /// sigmoid gate) on every block.
    Qwen35Moe,
    /// Qwen3-Next (`qwen3_next`): Qwen3.5-MoE's block (Qwen3.5's came
    /// after it) with the DeltaNet's q, k, v, z and its b, a each stored as
    /// one product, interleaved key head by key head, and Qwen2-MoE's
    /// routed MLP on the blocks `decoder_sparse_step` and
    /// `mlp_only_layers` leave it.
    Qwen3Next,
    /// OLMo Hybrid (`olmo_hybrid`): OLMo 3's blocks (norms after the
    /// sublayers, q/k norms over the whole projections, RoPE unless the
    /// config has no θ) on its `full_attention` blocks, and on the others
    /// a pre-norm Gated DeltaNet ([`LinearAttn`]) with its own q, k, v,
    /// a, b and output-gate products and rates up to 2.
    OlmoHybrid,
    /// Kimi Linear (`kimi_linear`: Kimi-Linear-48B-A3B): Kimi Delta
    /// Attention on its `linear_attention` blocks (a Gated DeltaNet whose
    /// decay is per key channel, from a low-rank forget gate, and whose
    /// output gate is a sigmoid of a low-rank product), DeepSeek-V3's
    /// latent attention without RoPE on the others, and DeepSeek-V3's
    /// routed MLP with shared experts on its `sparse` blocks.
    KimiLinear,
}

const SUPPORTED: &str = "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                         Qwen3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, \
                         SmolLM3ForCausalLM, GraniteForCausalLM, Starcoder2ForCausalLM, GlmForCausalLM, \
                         Glm4ForCausalLM, Exaone4ForCausalLM, PhiForCausalLM, CohereForCausalLM, \
                         Cohere2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, \
                         GPTNeoXForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, \
                         OlmoeForCausalLM, Qwen2MoeForCausalLM, GptOssForCausalLM, \
                         Glm4MoeForCausalLM, DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, \
                         Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM, \
                         OlmoHybridForCausalLM, KimiLinearForCausalLM";

/// Granite's scalings of a Llama model: the embeddings' output times
/// `embedding`, each block's sublayer outputs times `residual` before they
/// join the residual stream, attention scores times `attention` (instead
/// of 1/√head_dim), and the logits divided by `logits`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Multipliers {
    pub embedding: f64,
    pub residual: f64,
    pub attention: f64,
    pub logits: f64,
}

impl Arch {
    pub const ALL: [Arch; 33] = [
        Arch::Gpt2,
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Phi3,
        Arch::Olmo2,
        Arch::Olmo3,
        Arch::SmolLM3,
        Arch::Granite,
        Arch::Starcoder2,
        Arch::Glm,
        Arch::Glm4,
        Arch::Exaone4,
        Arch::Phi,
        Arch::Cohere,
        Arch::Cohere2,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::GptNeox,
        Arch::Mixtral,
        Arch::Qwen3Moe,
        Arch::Olmoe,
        Arch::Qwen2Moe,
        Arch::GptOss,
        Arch::Glm4Moe,
        Arch::DeepseekV3,
        Arch::DeepseekV2,
        Arch::Qwen35,
        Arch::Qwen35Moe,
        Arch::Qwen3Next,
        Arch::OlmoHybrid,
        Arch::KimiLinear,
    ];

    pub fn hf_architecture(self) -> &'static str {
        match self {
            Arch::Gpt2 => "GPT2LMHeadModel",
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Phi3 => "Phi3ForCausalLM",
            Arch::Olmo2 => "Olmo2ForCausalLM",
            Arch::Olmo3 => "Olmo3ForCausalLM",
            Arch::SmolLM3 => "SmolLM3ForCausalLM",
            Arch::Granite => "GraniteForCausalLM",
            Arch::Starcoder2 => "Starcoder2ForCausalLM",
            Arch::Glm => "GlmForCausalLM",
            Arch::Glm4 => "Glm4ForCausalLM",
            Arch::Exaone4 => "Exaone4ForCausalLM",
            Arch::Phi => "PhiForCausalLM",
            Arch::Cohere => "CohereForCausalLM",
            Arch::Cohere2 => "Cohere2ForCausalLM",
            Arch::Gemma2 => "Gemma2ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::GptNeox => "GPTNeoXForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Olmoe => "OlmoeForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
            Arch::GptOss => "GptOssForCausalLM",
            Arch::Glm4Moe => "Glm4MoeForCausalLM",
            Arch::DeepseekV3 => "DeepseekV3ForCausalLM",
            Arch::DeepseekV2 => "DeepseekV2ForCausalLM",
            Arch::Qwen35 => "Qwen3_5ForCausalLM",
            Arch::Qwen35Moe => "Qwen3_5MoeForCausalLM",
            Arch::Qwen3Next => "Qwen3NextForCausalLM",
            Arch::OlmoHybrid => "OlmoHybridForCausalLM",
            Arch::KimiLinear => "KimiLinearForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
            Arch::Olmo2 => "olmo2",
            Arch::Olmo3 => "olmo3",
            Arch::SmolLM3 => "smollm3",
            Arch::Granite => "granite",
            Arch::Starcoder2 => "starcoder2",
            Arch::Glm => "glm",
            Arch::Glm4 => "glm4",
            Arch::Exaone4 => "exaone4",
            Arch::Phi => "phi",
            Arch::Cohere => "cohere",
            Arch::Cohere2 => "cohere2",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3_text",
            Arch::GptNeox => "gpt_neox",
            Arch::Mixtral => "mixtral",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Olmoe => "olmoe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::GptOss => "gpt_oss",
            Arch::Glm4Moe => "glm4_moe",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::DeepseekV2 => "deepseek_v2",
            Arch::Qwen35 => "qwen3_5_text",
            Arch::Qwen35Moe => "qwen3_5_moe_text",
            Arch::Qwen3Next => "qwen3_next",
            Arch::OlmoHybrid => "olmo_hybrid",
            Arch::KimiLinear => "kimi_linear",
        }
    }

    pub fn from_hf_architecture(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.hf_architecture() == name)
    }

    /// GPT-2 (LayerNorm, GELU, learned positions) versus the Llama family
    /// (RMSNorm, RoPE, SwiGLU).
    pub fn is_gpt2(self) -> bool {
        self == Arch::Gpt2
    }

    /// LayerNorms (with biases but for Cohere's) rather than RMSNorms.
    pub fn has_layernorm(self) -> bool {
        matches!(
            self,
            Arch::Gpt2 | Arch::Starcoder2 | Arch::Phi | Arch::Cohere | Arch::Cohere2 | Arch::GptNeox
        )
    }

    /// Cohere's: attention and MLP side by side from one LayerNorm without
    /// bias.
    pub fn is_cohere(self) -> bool {
        matches!(self, Arch::Cohere | Arch::Cohere2)
    }

    /// Whether its LayerNorms have biases (Cohere's have none).
    pub fn norm_has_bias(self) -> bool {
        self.has_layernorm() && !self.is_cohere()
    }

    /// RoPE on neighbouring pairs (2i, 2i+1): GLM's and Cohere's.
    pub fn interleaved_rope(self) -> bool {
        self.is_glm() || self.is_cohere()
    }

    /// An LM head with a bias (Phi-2's).
    pub fn has_head_bias(self) -> bool {
        self == Arch::Phi
    }

    /// GLM's: RoPE on neighbouring pairs, gate and up stored as one tensor.
    pub fn is_glm(self) -> bool {
        matches!(self, Arch::Glm | Arch::Glm4)
    }

    /// Gemma 2's and Gemma 3's: GeGLU, gains stored as `gain − 1`,
    /// sandwich norms, √hidden embeddings, `query_pre_attn_scalar`.
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// GLM-4-0414's and Gemma's Llama block with norms after the
    /// attention and the MLP (on their outputs, before the residual adds)
    /// as well as before.
    pub fn has_sandwich_norms(self) -> bool {
        self == Arch::Glm4 || self.is_gemma()
    }

    /// What its RMSNorms add to their stored weights to get their gains:
    /// Gemma's and Qwen3.5's store `gain − 1` (`x̂ · (1 + w)`); Qwen3.5's
    /// Gated DeltaNet's own norm (`linear_attn.norm`) stores its gain.
    pub fn norm_gain_offset(self) -> Option<f64> {
        (self.is_gemma() || self.is_qwen35()).then_some(1.0)
    }

    /// Qwen3.5's and Qwen3-Next's hybrid stack: Gated DeltaNet blocks
    /// ([`LinearAttn`]) beside full attention gated by a sigmoid.
    pub fn is_qwen35(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next)
    }

    /// The activation gating its GLU MLP's up projection (GeGLU for Gemma,
    /// SwiGLU for the rest of the Llama family).
    pub fn glu(self) -> Glu {
        match self.is_gemma() {
            true => Glu::Gelu,
            false => Glu::Silu,
        }
    }

    /// OLMo's block: norms after the sublayers, q/k norms over the whole
    /// projections (OLMo Hybrid's attention blocks').
    pub fn has_post_norms(self) -> bool {
        matches!(self, Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4 | Arch::OlmoHybrid)
    }

    /// Blocks that may be Gated DeltaNets ([`LinearAttn`]): Qwen3.5's,
    /// Qwen3-Next's, OLMo Hybrid's and Kimi Linear's.
    pub fn has_linear_attn(self) -> bool {
        self.is_qwen35() || matches!(self, Arch::OlmoHybrid | Arch::KimiLinear)
    }

    /// EXAONE 4's q/k norms over each head rather than (OLMo's) the whole
    /// projection.
    pub fn has_head_qk_norms(self) -> bool {
        self == Arch::Exaone4
    }

    /// OLMoE's Llama block with q/k norms over the whole projections
    /// (the Llama family's others norm each head).
    pub fn has_full_qk_norms(self) -> bool {
        self == Arch::Olmoe
    }

    /// DeepSeek-V2's and V3's multi-head latent attention ([`Mla`]).
    pub fn has_mla(self) -> bool {
        matches!(self, Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::KimiLinear)
    }

    /// GPT-OSS's learned logit per query head (`self_attn.sinks`), which
    /// joins every row of its attention's softmax without a value.
    pub fn has_attention_sinks(self) -> bool {
        self == Arch::GptOss
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Decoder blocks.
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    /// LayerNorm / RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base (unused by GPT-2).
    pub rope_theta: f64,
    /// RoPE frequency scaling (`rope_type` llama3, yarn, linear, longrope,
    /// dynamic).
    pub rope_scaling: RopeScaling,
    /// Leading entries of each head that RoPE rotates (Phi-3's
    /// `partial_rotary_factor`: Phi-4-mini's 0.75 rotates 96 of 128), the
    /// rest passed through; `None`: all of them.
    pub rotary_dim: Option<usize>,
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v projections (Qwen2; Llama/Qwen3 `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the attention output projection (Llama/Qwen3 `attention_bias`).
    pub o_bias: bool,
    /// Biases on gate/up/down (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Keys each query attends to, itself included, on the layers that
    /// slide (Mistral's and Phi-3's `sliding_window`, Qwen's under
    /// `use_sliding_window`, OLMo 3's); `None`: all before it, everywhere.
    pub sliding_window: Option<usize>,
    /// Which blocks the window applies to (`layer_types`' `sliding_attention`
    /// entries, Qwen's from `max_window_layers` on); `None`: every block.
    pub sliding_layers: Option<Vec<bool>>,
    /// θ and scaling of the sliding blocks' RoPE where it differs from the
    /// others' (OLMo 3 scales only its full-attention blocks' RoPE).
    pub sliding_rope: Option<(f64, RopeScaling)>,
    /// Blocks whose attention has no positional encoding (SmolLM3's NoPE
    /// blocks); `None`: every block rotates q and k.
    pub nope_layers: Option<Vec<bool>>,
    /// Granite's scalings; `None` for every other family.
    pub multipliers: Option<Multipliers>,
    /// Cohere's factor on the logits.
    pub logit_scale: Option<f64>,
    /// Gemma's: attention scores are scaled by its −½ power instead of
    /// head_dim's.
    pub query_pre_attn_scalar: Option<f64>,
    /// GPT-NeoX's `use_parallel_residual`: the MLP (after a norm of its own)
    /// reads the block's input beside the attention rather than after it.
    /// Phi's and Cohere's side-by-side blocks are their architectures'.
    pub parallel_residual: bool,
    /// A GELU MLP's exact, erf GELU (GPT-NeoX's `hidden_act` `gelu`) rather
    /// than the tanh approximation.
    pub exact_gelu: bool,
    /// Gemma 2's `attn_logit_softcapping`: every block's scaled attention
    /// scores become `cap · tanh(s / cap)`.
    pub attn_softcap: Option<SoftCap>,
    /// Gemma's `final_logit_softcapping`: the logits become
    /// `cap · tanh(z / cap)` (after any other factor on them).
    pub final_softcap: Option<SoftCap>,
    /// The token whose embedding row the lookup gives no gradient:
    /// transformers builds every family's but GPT-2's embedding as
    /// `nn.Embedding(padding_idx = pad_token_id)`.
    pub pad_token_id: Option<usize>,
    /// `torch_dtype` / `dtype` as written in the file (informational).
    pub dtype: Option<String>,
    /// The parsed `config.json`, written back (with its dtype updated) on
    /// export so that fields we do not model survive the round trip.
    pub raw: Option<Value>,
    /// The multimodal class (`Gemma3ForConditionalGeneration`) whose text
    /// model this is: read from its checkpoint's `language_model.` tensors,
    /// written (in run checkpoints and exports) as the text model alone.
    pub text_of: Option<&'static str>,
    /// The routed MLP of Mixtral's and Qwen3-MoE's sparse blocks; `None`:
    /// every block's MLP is dense.
    pub moe: Option<Moe>,
    /// DeepSeek-V3's multi-head latent attention; `None`: q, k, v and o
    /// projections.
    pub mla: Option<Mla>,
    /// Qwen3.5's Gated DeltaNet and the blocks that have one; `None`:
    /// every block attends.
    pub linear_attn: Option<LinearAttn>,
}

/// DeepSeek-V3's multi-head latent attention: q through a low-rank
/// projection and its RMSNorm (`q_lora_rank`; or one `q_proj`), k and v
/// of each head from one latent of `kv_lora_rank` (after its RMSNorm),
/// each head's q and k `qk_nope` entries without position and `qk_rope`
/// rotated ones, the latter of k shared by every head and computed beside
/// the latent; values of `v_head_dim`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mla {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
    /// RoPE on neighbouring pairs (`rope_interleave`) rather than halves.
    pub rope_interleave: bool,
    /// YaRN's `mscale_all_dim` (0: none), which scales the scores.
    pub mscale_all_dim: f64,
}

impl Mla {
    /// Entries of each head's q and k.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }

    /// The scores' scale under `scaling` (the model's RoPE scaling), as
    /// transformers' `yarn_apply_mscale` forms it: `qk_head_dim^−½`, times
    /// `(0.1 · mscale_all_dim · ln factor + 1)²` where YaRN scales the RoPE.
    pub fn softmax_scale(&self, scaling: &RopeScaling) -> f64 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        match scaling {
            RopeScaling::Yarn { factor, .. } if self.mscale_all_dim != 0.0 && *factor > 1.0 => {
                let m = 0.1 * self.mscale_all_dim * factor.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn bad(&self, field: &str, detail: impl Into<String>) -> ZooError {
        ZooError::BadField {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            detail: detail.into(),
        }
    }

    fn usize_of(&self, field: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.bad(field, format!("expected a non-negative integer, got {v}")))
    }

    fn req_usize(&self, field: &'static str) -> Result<usize> {
        match self.get(field) {
            Some(v) => {
                let x = self.usize_of(field, v)?;
                if x == 0 {
                    return Err(self.bad(field, "must be positive"));
                }
                Ok(x)
            }
            None => Err(ZooError::MissingField {
                path: self.path.to_path_buf(),
                field,
            }),
        }
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        self.get(field).map(|v| self.usize_of(field, v)).transpose()
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        self.get(field)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.bad(field, format!("expected a number, got {v}")))
            })
            .transpose()
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        self.get(field)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.bad(field, format!("expected a boolean, got {v}")))
            })
            .transpose()
    }

    fn opt_str(&self, field: &str) -> Result<Option<&'a str>> {
        self.get(field)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.bad(field, format!("expected a string, got {v}")))
            })
            .transpose()
    }

    fn unsupported(&self, detail: impl Into<String>) -> ZooError {
        ZooError::Unsupported {
            path: self.path.to_path_buf(),
            detail: detail.into(),
        }
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("config.json"))
    }

    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ZooError::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses config text; `path` is only used to name the source in errors.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let value: Value = serde_json::from_str(text).map_err(|cause| ZooError::Json {
            path: path.to_path_buf(),
            cause,
        })?;
        Self::from_json(value, path)
    }

    pub fn from_json(value: Value, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let obj = value.as_object().ok_or_else(|| ZooError::BadField {
            path: path.to_path_buf(),
            field: "<root>".into(),
            detail: "expected a JSON object".into(),
        })?;
        let f = Fields { obj, path };
        if let Some(mm) = multimodal::multimodal_class(&f) {
            let mut cfg = Self::from_json(multimodal::text_config(&f, mm)?, path)?;
            cfg.text_of = Some(mm.0);
            return Ok(cfg);
        }
        let arch = parse_arch(&f)?;
        let dtype = match f.opt_str("dtype")? {
            Some(s) => Some(s.to_string()),
            None => f.opt_str("torch_dtype")?.map(str::to_string),
        };
        let mut cfg = if arch.is_gpt2() {
            parse_gpt2(&f)?
        } else {
            parse_llama_family(&f, arch)?
        };
        cfg.dtype = dtype;
        cfg.raw = Some(value.clone());
        cfg.validate().map_err(|detail| f.bad("<shape>", detail))?;
        Ok(cfg)
    }

    /// Structural consistency of the numbers (heads divide, sizes positive).
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        // A zero or negative epsilon divides by zero in the norms, and a
        // RoPE base ≤ 0 gives NaN angles: both show only as a NaN loss.
        let eps_name = match self.arch {
            Arch::Gpt2 => "layer_norm_epsilon",
            Arch::Phi | Arch::Cohere | Arch::Cohere2 | Arch::GptNeox => "layer_norm_eps",
            Arch::Starcoder2 => "norm_epsilon",
            _ => "rms_norm_eps",
        };
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(format!("{eps_name} {} must be a positive number", self.norm_eps));
        }
        let rope_ok = self.rope_theta.is_finite() && self.rope_theta > 0.0;
        if !self.arch.is_gpt2() && !rope_ok {
            return Err(format!(
                "rope_theta {} must be a positive number",
                self.rope_theta
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.arch.is_gpt2() && !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        for (name, per_block) in [
            ("sliding_layers", &self.sliding_layers),
            ("nope_layers", &self.nope_layers),
        ] {
            if let Some(v) = per_block
                && v.len() != self.num_layers
            {
                return Err(format!(
                    "{name} lists {} blocks of num_hidden_layers {}",
                    v.len(),
                    self.num_layers
                ));
            }
        }
        let rotated = self.rotary_dim.unwrap_or(self.head_dim);
        if let Some(r) = self.rotary_dim
            && (r == 0 || r > self.head_dim || !r.is_multiple_of(2))
        {
            return Err(format!(
                "RoPE rotates {r} of head_dim {}: it must rotate an even, positive number of entries at most head_dim",
                self.head_dim
            ));
        }
        if let RopeScaling::LongRope { short, long, .. } = &self.rope_scaling {
            let pairs = rotated / 2;
            for (name, factors) in [("short_factor", short), ("long_factor", long)] {
                if factors.len() != pairs {
                    return Err(format!(
                        "rope_scaling {name} has {} factors; the {rotated} rotated entries of each head have {pairs} pairs",
                        factors.len(),
                    ));
                }
            }
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.num_layers)?;
        }
        if let Some(l) = &self.linear_attn {
            l.validate(self.num_layers)?;
        }
        if self.arch.is_gpt2() && self.head_dim * self.num_heads != self.hidden_size {
            return Err(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.hidden_size, self.num_heads
            ));
        }
        Ok(())
    }

    /// Layers of the streamed model: embedding, the blocks, final norm + head.
    pub fn num_layers_total(&self) -> usize {
        self.num_layers + 2
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Whether a sequence of `seq` tokens can be run exactly.
    pub fn check_seq_len(&self, seq: usize) -> Result<()> {
        if self.arch.is_gpt2() && seq > self.max_position_embeddings {
            return Err(ZooError::invalid(
                "sequence length",
                format!(
                    "{seq} tokens exceed GPT-2's n_positions = {}",
                    self.max_position_embeddings
                ),
            ));
        }
        Ok(())
    }

    /// Whether block `layer`'s attention keeps to the sliding window.
    pub fn slides(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && self
                .sliding_layers
                .as_ref()
                .is_none_or(|s| s.get(layer).copied().unwrap_or(false))
    }

    /// Whether block `layer` is a Gated DeltaNet ([`LinearAttn`]).
    pub fn is_linear_block(&self, layer: usize) -> bool {
        self.linear_attn.as_ref().is_some_and(|l| l.is_linear(layer))
    }

    /// Whether block `layer` rotates q and k at all.
    pub fn has_rope(&self, layer: usize) -> bool {
        self.nope_layers
            .as_ref()
            .is_none_or(|n| !n.get(layer).copied().unwrap_or(false))
    }

    /// The rotary embedding of block `layer`, from position 0 (which it
    /// applies where [`ModelConfig::has_rope`]).
    pub fn rope(&self, layer: usize) -> Rope {
        let (theta, scaling) = match &self.sliding_rope {
            Some((theta, scaling)) if self.slides(layer) => (*theta, scaling.clone()),
            _ => (self.rope_theta, self.rope_scaling.clone()),
        };
        Rope {
            theta,
            offset: 0,
            scaling,
            rotary_dim: self.rotary_dim,
            interleaved: self.arch.interleaved_rope(),
            docs: None,
        }
    }

    /// What the logits are multiplied by (Granite divides them by its
    /// `logits_scaling`, Cohere multiplies them by its `logit_scale`).
    pub fn logits_factor(&self) -> Option<f64> {
        match (self.multipliers, self.logit_scale) {
            (Some(m), _) => Some(1.0 / m.logits),
            (None, s) => s,
        }
    }

    /// What the embeddings' output is multiplied by: Granite's
    /// `embedding_multiplier`; Gemma's √hidden, rounded to f32 as
    /// transformers' buffer holds it.
    pub fn embedding_factor(&self) -> Option<f64> {
        match (self.multipliers, self.arch) {
            (Some(m), _) => Some(m.embedding),
            (None, a) if a.is_gemma() => Some((self.hidden_size as f64).sqrt() as f32 as f64),
            _ => None,
        }
    }

    /// The dropout its `config.json` asks transformers to train with, as
    /// megatrain's two: `(hidden, attention)`. Hidden is GPT-2's and
    /// Phi-3's `embd_pdrop` and `resid_pdrop` (on the embedding's output
    /// and each residual branch), which must agree where both are given;
    /// attention is `attn_pdrop` (GPT-2) or `attention_dropout`. Keys a
    /// config lacks are 0 (the Llama family has no hidden dropout); a
    /// model without a parsed config has none. The error names the key.
    pub fn hf_dropout(&self) -> std::result::Result<(f64, f64), String> {
        let Some(raw) = &self.raw else {
            return Ok((0.0, 0.0));
        };
        let num = |key: &str| -> std::result::Result<Option<f64>, String> {
            match raw.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("{key} is {v}, not a number")),
            }
        };
        let hidden = match (num("embd_pdrop")?, num("resid_pdrop")?) {
            (Some(e), Some(r)) if e != r => {
                return Err(format!(
                    "embd_pdrop {e} and resid_pdrop {r} differ, and megatrain drops both with one rate"
                ));
            }
            (e, r) => e.or(r).unwrap_or(0.0),
        };
        let attention = match num("attn_pdrop")? {
            Some(a) => a,
            None => num("attention_dropout")?.unwrap_or(0.0),
        };
        Ok((hidden, attention))
    }

    /// What q is multiplied by so that the attention op's 1/√head_dim
    /// scales the scores as the family does: Granite's
    /// `attention_multiplier`, Gemma's `query_pre_attn_scalar`^−½.
    pub fn q_factor(&self) -> Option<f64> {
        let d = self.head_dim as f64;
        match (self.multipliers, self.query_pre_attn_scalar) {
            (Some(m), _) => Some(m.attention * d.sqrt()),
            (None, Some(s)) if s != d => Some((d / s).sqrt()),
            _ => None,
        }
    }

    /// The attention mask of block `layer`, its scores soft-capped where
    /// the family caps them.
    pub fn attn_mask(&self, layer: usize) -> AttnMask {
        AttnMask {
            window: self.sliding_window.filter(|_| self.slides(layer)),
            softcap: self.attn_softcap,
            docs: None,
            dropout: None,
        }
    }

    /// The HF `config.json` for this model, with `torch_dtype`/`dtype` set to
    /// `dtype` ("float32", "bfloat16", "float16"). A parsed config keeps every
    /// original field.
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let mut v = match &self.raw {
            Some(raw) => raw.clone(),
            None => self.generated_json(),
        };
        let obj = v.as_object_mut().expect("config is an object");
        // Tensors are written unquantized (GPT-OSS's MXFP4 experts too).
        obj.remove("quantization_config");
        let mut set = false;
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), Value::from(dtype));
                set = true;
            }
        }
        if !set {
            obj.insert("torch_dtype".into(), Value::from(dtype));
        }
        v
    }

    fn generated_json(&self) -> Value {
        use serde_json::json;
        let mut v = if self.arch.is_gpt2() {
            json!({
                "n_embd": self.hidden_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_positions": self.max_position_embeddings,
                "n_inner": self.intermediate_size,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": if self.exact_gelu { "gelu" } else { "gelu_new" },
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
            })
        } else {
            json!({
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                "hidden_act": "silu",
                "attention_dropout": 0.0,
            })
        };
        let obj = v.as_object_mut().expect("object");
        if let Some(scaling) = rope::scaling_json(&self.rope_scaling) {
            obj.insert("rope_scaling".into(), scaling);
        }
        obj.insert("architectures".into(), json!([self.arch.hf_architecture()]));
        obj.insert("model_type".into(), json!(self.arch.model_type()));
        obj.insert("vocab_size".into(), json!(self.vocab_size));
        obj.insert("tie_word_embeddings".into(), json!(self.tie_word_embeddings));
        obj.insert("initializer_range".into(), json!(0.02));
        if !self.arch.is_gpt2() {
            // Written, so that no config class's default id applies.
            obj.insert("pad_token_id".into(), json!(self.pad_token_id));
        }
        match self.arch {
            Arch::Gpt2 => {
                // GPT2Config defaults to token 50256, which a char vocabulary lacks.
                let special = (self.vocab_size > 50256).then_some(50256);
                obj.insert("bos_token_id".into(), json!(special));
                obj.insert("eos_token_id".into(), json!(special));
            }
            Arch::Llama | Arch::SmolLM3 | Arch::Granite => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("mlp_bias".into(), json!(self.mlp_bias));
                if let Some(m) = &self.multipliers {
                    obj.insert("embedding_multiplier".into(), json!(m.embedding));
                    obj.insert("residual_multiplier".into(), json!(m.residual));
                    obj.insert("attention_multiplier".into(), json!(m.attention));
                    obj.insert("logits_scaling".into(), json!(m.logits));
                }
                if let Some(nope) = &self.nope_layers {
                    let uses_rope: Vec<u8> = nope.iter().map(|&n| u8::from(!n)).collect();
                    obj.insert("no_rope_layers".into(), json!(uses_rope));
                }
            }
            Arch::Glm | Arch::Glm4 => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
            }
            Arch::Olmoe => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("clip_qkv".into(), json!(null));
            }
            Arch::OlmoHybrid => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                if self.nope_layers.is_some() {
                    obj.insert(
                        "rope_parameters".into(),
                        json!({"rope_type": "default", "rope_theta": null}),
                    );
                }
            }
            Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4 => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                if self.arch != Arch::Olmo2 {
                    obj.insert("sliding_window".into(), json!(self.sliding_window));
                }
            }
            Arch::Mistral | Arch::Phi3 | Arch::Mixtral => {
                obj.insert("sliding_window".into(), json!(self.sliding_window));
            }
            Arch::GptOss => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("sliding_window".into(), json!(self.sliding_window));
            }
            Arch::Glm4Moe => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("use_qk_norm".into(), json!(self.qk_norm));
            }
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::KimiLinear => {
                let m = self.mla.expect("DeepSeek's attention is latent");
                // DeepseekV3Config's head_dim is the rotated part's, set by itself.
                obj.remove("head_dim");
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("q_lora_rank".into(), json!(m.q_lora_rank));
                obj.insert("kv_lora_rank".into(), json!(m.kv_lora_rank));
                obj.insert("qk_nope_head_dim".into(), json!(m.qk_nope));
                obj.insert("qk_rope_head_dim".into(), json!(m.qk_rope));
                obj.insert("v_head_dim".into(), json!(m.v_head_dim));
                if self.arch == Arch::DeepseekV3 {
                    obj.insert("rope_interleave".into(), json!(m.rope_interleave));
                }
                if let Some(r) = obj.get_mut("rope_scaling").and_then(Value::as_object_mut) {
                    r.insert("mscale_all_dim".into(), json!(m.mscale_all_dim));
                }
            }
            Arch::Cohere | Arch::Cohere2 => {
                obj.insert("layer_norm_eps".into(), json!(self.norm_eps));
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("logit_scale".into(), json!(self.logit_scale));
                if self.arch == Arch::Cohere2 {
                    obj.insert("sliding_window".into(), json!(self.sliding_window));
                }
            }
            Arch::Phi => {
                obj.insert("layer_norm_eps".into(), json!(self.norm_eps));
                obj.insert("hidden_act".into(), json!("gelu_new"));
            }
            Arch::GptNeox => {
                obj.remove("num_key_value_heads");
                obj.remove("head_dim");
                obj.insert("layer_norm_eps".into(), json!(self.norm_eps));
                let act = if self.exact_gelu { "gelu" } else { "gelu_new" };
                obj.insert("hidden_act".into(), json!(act));
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("use_parallel_residual".into(), json!(self.parallel_residual));
                // GPTNeoXConfig's own names for θ and the rotated share.
                obj.insert("rotary_emb_base".into(), json!(self.rope_theta));
                let pct = self.rotary_dim.map_or(1.0, |r| r as f64 / self.head_dim as f64);
                obj.insert("rotary_pct".into(), json!(pct));
            }
            Arch::Gemma2 | Arch::Gemma3 => {
                obj.remove("hidden_act");
                obj.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("sliding_window".into(), json!(self.sliding_window));
                obj.insert("query_pre_attn_scalar".into(), json!(self.query_pre_attn_scalar));
                // Written even where absent (null), so that no class
                // default applies on the way back.
                let cap = |c: Option<SoftCap>| json!(c.map(|c| c.get()));
                obj.insert("final_logit_softcapping".into(), cap(self.final_softcap));
                if self.arch == Arch::Gemma2 {
                    obj.insert("attn_logit_softcapping".into(), cap(self.attn_softcap));
                } else {
                    let local = self.sliding_rope.as_ref().map_or(self.rope_theta, |r| r.0);
                    obj.insert("rope_local_base_freq".into(), json!(local));
                }
            }
            Arch::Starcoder2 => {
                obj.insert("sliding_window".into(), json!(self.sliding_window));
                obj.insert("use_bias".into(), json!(self.qkv_bias));
                obj.insert("norm_epsilon".into(), json!(self.norm_eps));
                obj.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
            }
            Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                if self.arch == Arch::Qwen35Moe {
                    obj.remove("intermediate_size");
                }
            }
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe => {
                match self.arch {
                    Arch::Qwen2 => {}
                    Arch::Qwen2Moe => {
                        obj.insert("qkv_bias".into(), json!(self.qkv_bias));
                    }
                    _ => {
                        obj.insert("attention_bias".into(), json!(self.qkv_bias));
                    }
                }
                obj.insert("use_sliding_window".into(), json!(self.sliding_window.is_some()));
                if let Some(w) = self.sliding_window {
                    obj.insert("sliding_window".into(), json!(w));
                    obj.insert("max_window_layers".into(), json!(0));
                }
            }
        }
        // Written wherever a head rotates in part, and for Phi and GLM,
        // whose config classes default to 0.5.
        if self.rotary_dim.is_some()
            || matches!(self.arch, Arch::Phi | Arch::Glm4Moe)
            || self.arch.is_glm()
            || self.arch.is_qwen35()
        {
            let factor = self.rotary_dim.map_or(1.0, |r| r as f64 / self.head_dim as f64);
            obj.insert("partial_rotary_factor".into(), json!(factor));
        }
        if let Some(moe) = &self.moe {
            moe.write_json(self.arch, obj);
        }
        if let Some(l) = &self.linear_attn {
            l.write_json(self.arch, obj);
        }
        if let Some(sliding) = &self.sliding_layers {
            let kind = |s: &bool| if *s { "sliding_attention" } else { "full_attention" };
            obj.insert(
                "layer_types".into(),
                json!(sliding.iter().map(kind).collect::<Vec<_>>()),
            );
        }
        v
    }
}

fn parse_arch(f: &Fields) -> Result<Arch> {
    let archs = f.get("architectures").ok_or_else(|| ZooError::MissingField {
        path: f.path.to_path_buf(),
        field: "architectures",
    })?;
    let list = archs
        .as_array()
        .ok_or_else(|| f.bad("architectures", format!("expected a list, got {archs}")))?;
    let name = match list.as_slice() {
        [one] => one
            .as_str()
            .ok_or_else(|| f.bad("architectures", format!("expected a string, got {one}")))?,
        _ => {
            return Err(f.bad(
                "architectures",
                format!("expected exactly one entry, got {archs}"),
            ));
        }
    };
    Arch::from_hf_architecture(name).ok_or_else(|| ZooError::UnknownArchitecture {
        path: f.path.to_path_buf(),
        name: name.to_string(),
        supported: SUPPORTED,
    })
}

fn parse_gpt2(f: &Fields) -> Result<ModelConfig> {
    let hidden = f.req_usize("n_embd")?;
    let heads = f.req_usize("n_head")?;
    if hidden % heads != 0 {
        return Err(f.bad("n_embd", format!("{hidden} is not a multiple of n_head {heads}")));
    }
    let act = f.opt_str("activation_function")?.unwrap_or("gelu_new");
    // `gelu` is the exact GELU (Cerebras-GPT's), the others its tanh
    // approximation.
    if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" | "gelu") {
        return Err(f.unsupported(format!(
            "activation_function '{act}' (implemented: gelu, gelu_new, gelu_pytorch_tanh, gelu_fast)"
        )));
    }
    for (field, bad_value, default) in [
        ("scale_attn_weights", false, true),
        ("scale_attn_by_inverse_layer_idx", true, false),
        ("add_cross_attention", true, false),
    ] {
        if f.opt_bool(field)?.unwrap_or(default) == bad_value {
            return Err(f.unsupported(format!("{field} = {bad_value}")));
        }
    }
    Ok(ModelConfig {
        arch: Arch::Gpt2,
        vocab_size: f.req_usize("vocab_size")?,
        hidden_size: hidden,
        num_layers: f.req_usize("n_layer")?,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: hidden / heads,
        intermediate_size: f.opt_usize("n_inner")?.unwrap_or(4 * hidden),
        max_position_embeddings: f.req_usize("n_positions")?,
        norm_eps: f.opt_f64("layer_norm_epsilon")?.unwrap_or(1e-5),
        rope_theta: 0.0,
        rope_scaling: RopeScaling::None,
        rotary_dim: None,
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
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
        exact_gelu: act == "gelu",
        attn_softcap: None,
        final_softcap: None,
        pad_token_id: None,
        dtype: None,
        raw: None,
        text_of: None,
        moe: None,
        mla: None,
        linear_attn: None,
    })
}

fn parse_llama_family(f: &Fields, arch: Arch) -> Result<ModelConfig> {
    let hidden = f.req_usize("hidden_size")?;
    let heads = f.req_usize("num_attention_heads")?;
    // DeepSeek-V3's latent attention has a k and v for every head.
    let kv_heads = match arch {
        Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::KimiLinear => heads,
        _ => f.opt_usize("num_key_value_heads")?.unwrap_or(heads),
    };
    let head_dim = match f.opt_usize("head_dim")? {
        // Cohere2Config sets hidden / heads whatever is written.
        _ if arch == Arch::Cohere2 && hidden % heads == 0 => hidden / heads,
        // DeepSeek-V3's q and k heads (its `head_dim` is the rotated part's).
        _ if arch.has_mla() => {
            f.opt_usize("qk_nope_head_dim")?.unwrap_or(128) + f.opt_usize("qk_rope_head_dim")?.unwrap_or(64)
        }
        Some(d) => d,
        // Qwen3Config's and GlmConfig's default head_dim is 128, not
        // hidden / heads; Gemma2Config's and Gemma3TextConfig's 256.
        None if matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm | Arch::Glm4) => 128,
        None if arch.is_gemma() || arch.is_qwen35() => 256,
        None if arch == Arch::GptOss => 64,
        None => {
            if hidden % heads != 0 {
                return Err(f.bad(
                    "hidden_size",
                    format!(
                        "{hidden} is not a multiple of num_attention_heads {heads} and head_dim is absent"
                    ),
                ));
            }
            hidden / heads
        }
    };
    // StarCoder2's MLP is GELU's tanh approximation (our gelu), every
    // other family's SwiGLU.
    let (act, implemented) = match arch {
        Arch::Starcoder2 => (
            f.opt_str("hidden_act")?.unwrap_or("gelu_pytorch_tanh"),
            ["gelu_pytorch_tanh", "gelu_new"].as_slice(),
        ),
        Arch::Phi => (
            f.opt_str("hidden_act")?.unwrap_or("gelu_new"),
            ["gelu_new", "gelu_pytorch_tanh"].as_slice(),
        ),
        // GPTNeoXConfig's `gelu` is the exact GELU, the others its tanh
        // approximation.
        Arch::GptNeox => (
            f.opt_str("hidden_act")?.unwrap_or("gelu"),
            ["gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"].as_slice(),
        ),
        // Gemma's configs name it hidden_activation.
        Arch::Gemma2 | Arch::Gemma3 => (
            f.opt_str("hidden_activation")?.unwrap_or("gelu_pytorch_tanh"),
            ["gelu_pytorch_tanh", "gelu_new"].as_slice(),
        ),
        _ => (f.opt_str("hidden_act")?.unwrap_or("silu"), ["silu"].as_slice()),
    };
    if arch.is_gemma() && f.opt_bool("use_bidirectional_attention")?.unwrap_or(false) {
        return Err(f.unsupported("use_bidirectional_attention = true (megatrain trains causal models)"));
    }
    if let Some(q) = f.get("quantization_config") {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
        // GPT-OSS's published MXFP4 experts are widened to f32 at load
        // (`mxfp4.rs`); a trainer of f32 master weights has no use for
        // any other quantized format.
        if !(arch == Arch::GptOss && method == "mxfp4") {
            return Err(f.unsupported(format!(
                "quantization_config with quant_method '{method}' (megatrain loads unquantized checkpoints, and GPT-OSS's MXFP4 experts)"
            )));
        }
    }
    if arch == Arch::Olmoe && f.get("clip_qkv").is_some() {
        return Err(
            f.unsupported("clip_qkv (OLMoE's clamp of q, k and v; the released checkpoints have none)")
        );
    }
    if !implemented.contains(&act) {
        return Err(f.unsupported(format!(
            "hidden_act '{act}' (implemented for {arch:?}: {})",
            implemented.join(", ")
        )));
    }
    let default_positions = match arch {
        Arch::Mistral | Arch::Mixtral => 4096 * 32,
        Arch::OlmoHybrid => 65536,
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::SmolLM3 => 32768,
        Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next => 32768,
        Arch::Starcoder2 | Arch::Phi3 | Arch::Olmoe | Arch::DeepseekV3 => 4096,
        Arch::Cohere | Arch::Cohere2 | Arch::Gemma2 => 8192,
        Arch::Glm | Arch::Glm4 | Arch::Gemma3 | Arch::GptOss | Arch::Glm4Moe => 131072,
        _ => 2048,
    };
    let max_positions = match f.opt_usize("max_position_embeddings")? {
        Some(p) => p,
        // KimiLinearConfig's own name for it.
        None if arch == Arch::KimiLinear => f.opt_usize("model_max_length")?.unwrap_or(1 << 20),
        None => default_positions,
    };
    let (rope, sliding_rope) = match arch {
        Arch::Olmo3 => parse_kinds_rope(f, max_positions, 500000.0, None)?,
        // Gemma3TextConfig: θ 1e6 on the full-attention blocks, the sliding
        // blocks' `rope_local_base_freq` (10000) in a v4 config.
        Arch::Gemma3 => parse_kinds_rope(f, max_positions, 1e6, Some(("rope_local_base_freq", 10000.0)))?,
        Arch::SmolLM3 => (parse_rope_with_theta(f, max_positions, 2e6)?, None),
        // GPTNeoXConfig's v4 name for θ.
        Arch::GptNeox => {
            let base = f.opt_f64("rotary_emb_base")?.unwrap_or(10000.0);
            (parse_rope_with_theta(f, max_positions, base)?, None)
        }
        Arch::GptOss => (gpt_oss_rope(f, max_positions)?, None),
        _ => (parse_rope(f, max_positions, arch == Arch::Phi3)?, None),
    };
    // transformers rotates int(head_dim · factor) entries; only Phi-3's
    // and GLM's attention split q and k around them (Llama's would fail to
    // broadcast). GlmConfig's factor is 0.5 unless written.
    let partial = match (
        rope.partial,
        arch.is_glm() || matches!(arch, Arch::Phi | Arch::Glm4Moe),
    ) {
        (Some(p), _) => Some(p),
        // GlmConfig's, PhiConfig's and Glm4MoeConfig's factor unless written.
        (None, true) => Some(0.5),
        // GPTNeoXConfig's, under its v4 name `rotary_pct`, 0.25 unless written.
        (None, false) if arch == Arch::GptNeox => match f.opt_f64("rotary_pct")?.unwrap_or(0.25) {
            p if p > 0.0 && p <= 1.0 => Some(p),
            p => return Err(f.bad("rotary_pct", format!("{p} must be in (0, 1]"))),
        },
        // Qwen3.5's config classes' default.
        (None, false) if arch.is_qwen35() => Some(0.25),
        (None, false) => None,
    };
    let rotary_dim = match partial.filter(|&p| p < 1.0) {
        None => None,
        Some(p)
            if matches!(arch, Arch::Phi3 | Arch::Phi | Arch::GptNeox | Arch::Glm4Moe)
                || arch.is_glm()
                || arch.is_qwen35() =>
        {
            Some((head_dim as f64 * p) as usize)
        }
        Some(p) => {
            return Err(f.unsupported(format!(
                "{} = {p} for {arch:?} (transformers applies a partial rotary factor only to Phi, Phi-3, GLM, GLM-4.5, GPT-NeoX and Qwen3.5 here)",
                rope.partial_field
            )));
        }
    };
    let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
    let (qkv_bias, o_bias, mlp_bias) = match arch {
        Arch::Llama | Arch::SmolLM3 | Arch::Granite => (
            attention_bias,
            attention_bias,
            f.opt_bool("mlp_bias")?.unwrap_or(false),
        ),
        Arch::Qwen3
        | Arch::Qwen3Moe
        | Arch::Olmo2
        | Arch::Olmo3
        | Arch::Gemma2
        | Arch::Gemma3
        | Arch::Olmoe
        | Arch::Qwen35
        | Arch::Qwen35Moe
        | Arch::Qwen3Next
        | Arch::OlmoHybrid
        | Arch::KimiLinear => (attention_bias, attention_bias, false),
        Arch::Exaone4 => (false, false, false),
        Arch::Qwen2 => (true, false, false),
        // Qwen2MoeConfig's qkv_bias (true unless written).
        Arch::Qwen2Moe => (f.opt_bool("qkv_bias")?.unwrap_or(true), false, false),
        Arch::GptOss => {
            let b = f.opt_bool("attention_bias")?.unwrap_or(true);
            (b, b, false)
        }
        // Glm4MoeConfig's attention_bias is q, k and v's (o_proj has none).
        Arch::Glm4Moe => (attention_bias, false, false),
        // DeepSeek-V3's: q_a_proj's and kv_a_proj_with_mqa's, and o_proj's.
        Arch::DeepseekV2 | Arch::DeepseekV3 => {
            if f.opt_bool("mlp_bias")?.unwrap_or(false) {
                return Err(f.unsupported("mlp_bias = true for DeepSeek-V2 (its released models have none)"));
            }
            (attention_bias, attention_bias, false)
        }
        // GlmConfig's attention_bias (true unless written) is q, k and v's.
        Arch::Glm | Arch::Glm4 => (f.opt_bool("attention_bias")?.unwrap_or(true), false, false),
        Arch::Starcoder2 => {
            let b = f.opt_bool("use_bias")?.unwrap_or(true);
            (b, b, b)
        }
        Arch::Cohere | Arch::Cohere2 => {
            if f.opt_bool("use_qk_norm")?.unwrap_or(false) {
                return Err(f.unsupported("use_qk_norm = true (per-head q/k LayerNorms of Command R+)"));
            }
            (attention_bias, attention_bias, false)
        }
        Arch::Phi => {
            if f.opt_bool("qk_layernorm")?.unwrap_or(false) {
                return Err(f.unsupported("qk_layernorm = true"));
            }
            (true, true, true)
        }
        // GPTNeoXConfig's attention_bias (true unless written) is the
        // fused projection's and `dense`'s; the MLP's are always there.
        Arch::GptNeox => {
            let b = f.opt_bool("attention_bias")?.unwrap_or(true);
            (b, b, true)
        }
        _ => (false, false, false),
    };
    let layers = f.req_usize("num_hidden_layers")?;
    // SmolLM3's windows follow its NoPE blocks; EXAONE 4's and Cohere 2's
    // full-attention blocks, where others slide, rotate nothing.
    let smollm3_nope = parse_nope_layers(f, arch, layers)?;
    let (sliding_window, sliding_layers) = parse_sliding_window(f, arch, layers, smollm3_nope.as_deref())?;
    let nope_layers = match arch {
        Arch::Exaone4 | Arch::Cohere2 => sliding_layers.as_ref().map(|s| s.iter().map(|&x| !x).collect()),
        // Kimi Linear's latent attention rotates nothing.
        Arch::KimiLinear => Some(vec![true; layers]),
        // OLMo Hybrid builds no rotary embedding where its θ is null.
        Arch::OlmoHybrid
            if f.get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .is_some_and(Value::is_null) =>
        {
            Some(vec![true; layers])
        }
        _ => smollm3_nope,
    };
    Ok(ModelConfig {
        arch,
        vocab_size: f.req_usize("vocab_size")?,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        intermediate_size: match arch {
            // Qwen3_5MoeTextConfig has no dense MLP, and no width for one.
            Arch::Qwen35Moe => match f.opt_usize("intermediate_size")? {
                Some(w) => w,
                None => f.opt_usize("moe_intermediate_size")?.unwrap_or(512),
            },
            _ => f.req_usize("intermediate_size")?,
        },
        max_position_embeddings: max_positions,
        norm_eps: match arch {
            Arch::Starcoder2 => f.opt_f64("norm_epsilon")?.unwrap_or(1e-5),
            Arch::Phi | Arch::Cohere | Arch::Cohere2 | Arch::GptNeox => {
                f.opt_f64("layer_norm_eps")?.unwrap_or(1e-5)
            }
            Arch::Glm | Arch::Glm4 => f.opt_f64("rms_norm_eps")?.unwrap_or(1.5625e-7),
            Arch::GptOss | Arch::Glm4Moe | Arch::KimiLinear => f.opt_f64("rms_norm_eps")?.unwrap_or(1e-5),
            _ => f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
        },
        rope_theta: rope.theta,
        rope_scaling: rope.scaling,
        rotary_dim,
        // SmolLM3Config and Starcoder2Config tie them unless told otherwise.
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(
            matches!(arch, Arch::SmolLM3 | Arch::Starcoder2) || arch.is_cohere() || arch.is_gemma(),
        ),
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Olmoe)
            || arch.is_qwen35()
            || (arch == Arch::Glm4Moe && f.opt_bool("use_qk_norm")?.unwrap_or(false)),
        sliding_window,
        sliding_layers,
        sliding_rope,
        nope_layers,
        multipliers: parse_multipliers(f, arch)?,
        logit_scale: match arch.is_cohere() {
            true => match f.opt_f64("logit_scale")?.unwrap_or(0.0625) {
                s if s.is_finite() && s > 0.0 => Some(s),
                s => return Err(f.bad("logit_scale", format!("{s} must be positive"))),
            },
            false => None,
        },
        query_pre_attn_scalar: match arch {
            Arch::Gemma2 | Arch::Gemma3 => match f.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0) {
                s if s.is_finite() && s > 0.0 => Some(s),
                s => return Err(f.bad("query_pre_attn_scalar", format!("{s} must be positive"))),
            },
            _ => None,
        },
        // Gemma2Config caps both unless written (null: not at all);
        // Gemma3TextConfig caps the logits only where written, and no
        // Gemma 3 attention in transformers reads `attn_logit_softcapping`.
        attn_softcap: match arch {
            Arch::Gemma2 => softcap(f, "attn_logit_softcapping", 50.0)?,
            _ => None,
        },
        final_softcap: match arch {
            Arch::Gemma2 => softcap(f, "final_logit_softcapping", 30.0)?,
            Arch::Gemma3 => f
                .get("final_logit_softcapping")
                .map(|_| softcap(f, "final_logit_softcapping", 0.0))
                .transpose()?
                .flatten(),
            _ => None,
        },
        parallel_residual: arch == Arch::GptNeox && f.opt_bool("use_parallel_residual")?.unwrap_or(true),
        exact_gelu: act == "gelu",
        pad_token_id: padding_idx(f, arch)?,
        dtype: None,
        raw: None,
        text_of: None,
        moe: moe::parse(f, arch, layers)?,
        mla: match arch {
            a if a.has_mla() => Some(parse_mla(f, arch)?),
            _ => None,
        },
        linear_attn: arch
            .has_linear_attn()
            .then(|| linear_attn::parse(f, arch, layers))
            .transpose()?,
    })
}

/// DeepSeek's attention fields (DeepseekV3Config's and DeepseekV2Config's
/// defaults; V2 rotates in pairs always).
fn parse_mla(f: &Fields, arch: Arch) -> Result<Mla> {
    let q_lora_rank = match f.obj.get("q_lora_rank") {
        // KimiLinearConfig's q has no low-rank pair unless written.
        None if arch == Arch::KimiLinear => None,
        None => Some(1536),
        Some(Value::Null) => None,
        Some(_) => Some(f.req_usize("q_lora_rank")?),
    };
    let nope = f.opt_usize("qk_nope_head_dim")?.unwrap_or(128);
    let rope = f.opt_usize("qk_rope_head_dim")?.unwrap_or(64);
    if rope == 0 || !rope.is_multiple_of(2) {
        return Err(f.bad(
            "qk_rope_head_dim",
            format!("{rope} must be even and positive for RoPE"),
        ));
    }
    // v5's rope_parameters over v4's rope_scaling, as parse_rope reads them.
    let mscale_all_dim = ["rope_parameters", "rope_scaling"]
        .iter()
        .filter_map(|k| f.get(k)?.get("mscale_all_dim")?.as_f64())
        .next()
        .unwrap_or(0.0);
    Ok(Mla {
        q_lora_rank,
        kv_lora_rank: f.opt_usize("kv_lora_rank")?.unwrap_or(512),
        qk_nope: nope,
        qk_rope: rope,
        v_head_dim: f.opt_usize("v_head_dim")?.unwrap_or(128),
        rope_interleave: arch == Arch::DeepseekV2
            || (arch == Arch::DeepseekV3 && f.opt_bool("rope_interleave")?.unwrap_or(true)),
        mscale_all_dim,
    })
}

/// A soft cap as transformers reads it: `default` where the field is
/// absent, none where it is null.
fn softcap(f: &Fields, field: &'static str, default: f64) -> Result<Option<SoftCap>> {
    let cap = match f.obj.get(field) {
        None => default,
        Some(Value::Null) => return Ok(None),
        Some(_) => f.opt_f64(field)?.expect("present and not null"),
    };
    match cap.is_finite() && cap > 0.0 {
        true => Ok(Some(
            SoftCap::new(cap as f32, field).map_err(|e| f.bad(field, e.to_string()))?,
        )),
        false => Err(f.bad(field, format!("{cap} must be a positive number"))),
    }
}

/// The sliding window and the blocks that keep to it (`None`: all), as
/// transformers reads the config: MistralConfig defaults `sliding_window`
/// to 4096, null meaning none; Phi3Config has none unless written
/// (Phi-3-mini-4k's is 2047); Qwen's applies only under
/// `use_sliding_window`, to the blocks from `max_window_layers` on. An
/// explicit `layer_types` list decides which blocks slide.
fn parse_sliding_window(
    f: &Fields,
    arch: Arch,
    layers: usize,
    nope: Option<&[bool]>,
) -> Result<(Option<usize>, Option<Vec<bool>>)> {
    let window = |default: Option<usize>| -> Result<Option<usize>> {
        let w = match f.obj.get("sliding_window") {
            None => default,
            Some(Value::Null) => None,
            Some(v) => Some(f.usize_of("sliding_window", v)?),
        };
        if w == Some(0) {
            return Err(f.bad(
                "sliding_window",
                "a window of 0 keys leaves a query nothing to attend to",
            ));
        }
        Ok(w)
    };
    let (w, mut sliding) = match arch {
        Arch::Mistral => (window(Some(4096))?, vec![true; layers]),
        Arch::Phi3 | Arch::Starcoder2 | Arch::Mixtral => (window(None)?, vec![true; layers]),
        // Olmo3Config: three blocks of four slide, the fourth attends to all.
        Arch::Olmo3 => (
            window(Some(4096))?,
            (0..layers).map(|i| (i + 1) % 4 != 0).collect(),
        ),
        // Exaone4Config: `sliding_window_pattern` N (default 4) slides all
        // but every N-th block; written as letters ("LLLG"), L slides.
        Arch::Exaone4 | Arch::Cohere2 => (window(Some(4096))?, sliding_pattern(f, layers, 4)?),
        // Gemma3TextConfig: five blocks of six slide; Gemma2Config: every
        // other, from the first.
        Arch::Gemma3 => (window(Some(4096))?, sliding_pattern(f, layers, 6)?),
        Arch::Gemma2 => (window(Some(4096))?, sliding_pattern(f, layers, 2)?),
        // GptOssConfig: every other block, from the first, keeps to 128.
        Arch::GptOss => (window(Some(128))?, (0..layers).map(|i| i % 2 == 0).collect()),
        // SmolLM3Config: under use_sliding_window, its NoPE blocks slide.
        Arch::SmolLM3 => match f.opt_bool("use_sliding_window")?.unwrap_or(false) {
            true => (
                window(None)?,
                (0..layers).map(|i| nope.is_some_and(|n| n[i])).collect(),
            ),
            false => (None, vec![false; layers]),
        },
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe => {
            match f.opt_bool("use_sliding_window")?.unwrap_or(false) {
                true => {
                    let from = f.opt_usize("max_window_layers")?.unwrap_or(28);
                    (window(Some(4096))?, (0..layers).map(|i| i >= from).collect())
                }
                false => (None, vec![false; layers]),
            }
        }
        // Qwen3.5's and OLMo Hybrid's layer_types say which blocks are
        // Gated DeltaNets (`linear_attn.rs`); none slides.
        a if a.has_linear_attn() => return Ok((None, None)),
        _ => (None, vec![false; layers]),
    };
    if let Some(types) = f.get("layer_types").and_then(Value::as_array) {
        if types.len() != layers {
            return Err(f.bad(
                "layer_types",
                format!("{} entries for num_hidden_layers = {layers}", types.len()),
            ));
        }
        sliding = types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(false),
                Some("sliding_attention") => Ok(true),
                _ => Err(f.unsupported(format!(
                    "layer_types entry {t} (full_attention and sliding_attention are implemented)"
                ))),
            })
            .collect::<Result<_>>()?;
    }
    Ok(
        match (w, sliding.iter().all(|&s| s), sliding.iter().any(|&s| s)) {
            (None, ..) | (_, _, false) => (None, None),
            (Some(w), true, _) => (Some(w), None),
            (Some(w), false, true) => (Some(w), Some(sliding)),
        },
    )
}

/// The embedding row `nn.Embedding(padding_idx = pad_token_id)` freezes:
/// a negative id counts from the end, as PyTorch counts it; one past the
/// vocabulary (which PyTorch would refuse) freezes nothing. Where the
/// field is absent (not null), the config class's default.
fn padding_idx(f: &Fields, arch: Arch) -> Result<Option<usize>> {
    let vocab = f.req_usize("vocab_size")?;
    let default = match arch {
        Arch::Cohere | Arch::Cohere2 | Arch::Gemma2 | Arch::Gemma3 => Some(0),
        Arch::Olmo2 | Arch::Olmo3 | Arch::Olmoe => Some(1),
        Arch::Phi3 => Some(32000),
        Arch::SmolLM3 => Some(128004),
        Arch::Glm | Arch::Glm4 => Some(151329),
        Arch::OlmoHybrid => Some(100277),
        Arch::KimiLinear => Some(163839),
        _ => None,
    };
    let Some(v) = f.get("pad_token_id") else {
        let absent = !f.obj.contains_key("pad_token_id");
        return Ok(default.filter(|&p| absent && p < vocab));
    };
    let p = v
        .as_i64()
        .ok_or_else(|| f.bad("pad_token_id", format!("expected an integer, got {v}")))?;
    let p = match p >= 0 {
        true => Some(p as usize),
        false => vocab.checked_sub(p.unsigned_abs() as usize),
    };
    Ok(p.filter(|&p| p < vocab))
}

/// Granite's four scalings (GraniteConfig defaults each to 1).
fn parse_multipliers(f: &Fields, arch: Arch) -> Result<Option<Multipliers>> {
    if arch != Arch::Granite {
        return Ok(None);
    }
    let read = |field: &str| -> Result<f64> {
        match f.opt_f64(field)?.unwrap_or(1.0) {
            x if x.is_finite() && x > 0.0 => Ok(x),
            x => Err(f.bad(field, format!("{x} must be positive"))),
        }
    };
    Ok(Some(Multipliers {
        embedding: read("embedding_multiplier")?,
        residual: read("residual_multiplier")?,
        attention: read("attention_multiplier")?,
        logits: read("logits_scaling")?,
    }))
}

/// EXAONE 4's, Cohere 2's and Gemma 3's sliding blocks from
/// `sliding_window_pattern` (every `default`-th block attends to all
/// unless written).
fn sliding_pattern(f: &Fields, layers: usize, default: usize) -> Result<Vec<bool>> {
    let field = "sliding_window_pattern";
    match f.get(field) {
        None => Ok((0..layers).map(|i| (i + 1) % default != 0).collect()),
        Some(Value::String(s)) if !s.is_empty() && s.chars().all(|c| c == 'L' || c == 'G') => {
            let kinds: Vec<bool> = s.chars().map(|c| c == 'L').collect();
            Ok((0..layers).map(|i| kinds[i % kinds.len()]).collect())
        }
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok((0..layers).map(|i| !(i as u64 + 1).is_multiple_of(n)).collect()),
            _ => Err(f.bad(
                field,
                format!("expected a positive integer or letters L and G, got {v}"),
            )),
        },
    }
}

/// SmolLM3's blocks without RoPE (`no_rope_layers`, 1 where a block
/// rotates; by default every `no_rope_layer_interval`-th, 4th, has none);
/// `None` for every other family, and where every block rotates.
fn parse_nope_layers(f: &Fields, arch: Arch, layers: usize) -> Result<Option<Vec<bool>>> {
    if arch != Arch::SmolLM3 {
        return Ok(None);
    }
    let nope: Vec<bool> = match f.get("no_rope_layers") {
        Some(v) => {
            let list = v.as_array().filter(|l| l.len() == layers).ok_or_else(|| {
                f.bad(
                    "no_rope_layers",
                    format!("expected a list of num_hidden_layers = {layers} 0s and 1s, got {v}"),
                )
            })?;
            list.iter()
                .map(|x| match x.as_u64() {
                    Some(0) => Ok(true),
                    Some(1) => Ok(false),
                    _ => Err(f.bad("no_rope_layers", format!("{x} is neither 0 nor 1"))),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let every = f.opt_usize("no_rope_layer_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(f.bad("no_rope_layer_interval", "must be positive"));
            }
            (0..layers).map(|i| (i + 1) % every == 0).collect()
        }
    };
    Ok(Some(nope).filter(|n| n.iter().any(|&x| x)))
}

/// A path for configs that never came from a file.
pub(crate) fn synthetic_path(name: &str) -> PathBuf {
    PathBuf::from(format!("<preset {name}>"))
}
