//! Per-layer parameter tables with Hugging Face names and shapes.
//!
//! Layer 0 is the embedding (`wte`, plus `wpe` for GPT-2), layers
//! `1..=num_layers` are decoder blocks, the last layer is the final norm and
//! the LM head. Weights keep their HF layout: `nn.Linear` is `[out, in]`
//! (read with `Transpose::NT`), GPT-2's `Conv1D` is `[in, out]` (read with
//! `Transpose::NN`), so import and export never transpose.
//!
//! The order of a table is the order in which layer code receives its
//! weights and returns its gradients.

use megatrain_tensor::ParamTable;

use crate::{Arch, ModelConfig, Moe, Result, Router};

/// What a layer index of a model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Embedding,
    /// Decoder block with its 0-based index (HF's `layers.{i}` / `h.{i}`).
    Block(usize),
    Head,
}

impl ModelConfig {
    pub fn layer_kind(&self, layer: usize) -> Option<LayerKind> {
        match layer {
            0 => Some(LayerKind::Embedding),
            l if l <= self.num_layers => Some(LayerKind::Block(l - 1)),
            l if l == self.num_layers + 1 => Some(LayerKind::Head),
            _ => None,
        }
    }

    /// HF name of the token embedding, which a tied head reads as its weight.
    pub fn embedding_name(&self) -> &'static str {
        match self.arch {
            Arch::Gpt2 => "transformer.wte.weight",
            Arch::GptNeox => "gpt_neox.embed_in.weight",
            _ => "model.embed_tokens.weight",
        }
    }

    /// The tables of every layer, in layer order. Allocates no weights.
    pub fn layer_tables(&self) -> Vec<ParamTable> {
        (0..self.num_layers_total())
            .map(|l| self.layer_table(l).expect("layer index in range"))
            .collect()
    }

    pub fn layer_table(&self, layer: usize) -> Result<ParamTable> {
        let kind = self.layer_kind(layer).ok_or_else(|| {
            crate::ZooError::invalid(
                "layer_table",
                format!(
                    "layer {layer} out of range (model has {})",
                    self.num_layers_total()
                ),
            )
        })?;
        let mut t = ParamTable::new();
        let (v, c) = (self.vocab_size, self.hidden_size);
        match (kind, self.arch) {
            (LayerKind::Embedding, Arch::Gpt2) => {
                t.push("transformer.wte.weight", [v, c], true)?;
                t.push("transformer.wpe.weight", [self.max_position_embeddings, c], true)?;
            }
            (LayerKind::Embedding, _) => {
                t.push(self.embedding_name(), [v, c], true)?;
            }
            (LayerKind::Block(i), Arch::Gpt2) => {
                let p = format!("transformer.h.{i}");
                let f = self.intermediate_size;
                t.push(format!("{p}.ln_1.weight"), [c], false)?;
                t.push(format!("{p}.ln_1.bias"), [c], false)?;
                t.push(format!("{p}.attn.c_attn.weight"), [c, 3 * c], true)?;
                t.push(format!("{p}.attn.c_attn.bias"), [3 * c], false)?;
                t.push(format!("{p}.attn.c_proj.weight"), [c, c], true)?;
                t.push(format!("{p}.attn.c_proj.bias"), [c], false)?;
                t.push(format!("{p}.ln_2.weight"), [c], false)?;
                t.push(format!("{p}.ln_2.bias"), [c], false)?;
                t.push(format!("{p}.mlp.c_fc.weight"), [c, f], true)?;
                t.push(format!("{p}.mlp.c_fc.bias"), [f], false)?;
                t.push(format!("{p}.mlp.c_proj.weight"), [f, c], true)?;
                t.push(format!("{p}.mlp.c_proj.bias"), [c], false)?;
            }
            // OLMo Hybrid's checkpoints name the norms before the token
            // mixer and before the MLP so (transformers renames them on
            // load), in its attention blocks too.
            (LayerKind::Block(i), Arch::OlmoHybrid) if self.is_linear_block(i) => {
                let p = format!("model.layers.{i}");
                t.push(format!("{p}.attention_layer_norm.weight"), [c], false)?;
                self.push_qwen35_mixer(&mut t, &p, i)?;
                t.push(format!("{p}.feedforward_layer_norm.weight"), [c], false)?;
                self.push_mlp(&mut t, &p, i)?;
            }
            (LayerKind::Block(i), Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4 | Arch::OlmoHybrid) => {
                let p = format!("model.layers.{i}");
                let (q, kv, f) = (self.q_dim(), self.kv_dim(), self.intermediate_size);
                for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    t.push(format!("{p}.self_attn.{name}.weight"), [rows, c], true)?;
                    if self.qkv_bias {
                        t.push(format!("{p}.self_attn.{name}.bias"), [rows], false)?;
                    }
                }
                t.push(format!("{p}.self_attn.o_proj.weight"), [c, q], true)?;
                if self.o_bias {
                    t.push(format!("{p}.self_attn.o_proj.bias"), [c], false)?;
                }
                let (qn, kn) = match self.arch.has_head_qk_norms() {
                    true => (self.head_dim, self.head_dim),
                    false => (q, kv),
                };
                t.push(format!("{p}.self_attn.q_norm.weight"), [qn], false)?;
                t.push(format!("{p}.self_attn.k_norm.weight"), [kn], false)?;
                let post_attn = match self.arch {
                    Arch::OlmoHybrid => "feedforward_layer_norm",
                    _ => "post_attention_layernorm",
                };
                t.push(format!("{p}.{post_attn}.weight"), [c], false)?;
                t.push(format!("{p}.mlp.gate_proj.weight"), [f, c], true)?;
                t.push(format!("{p}.mlp.up_proj.weight"), [f, c], true)?;
                t.push(format!("{p}.mlp.down_proj.weight"), [c, f], true)?;
                t.push(format!("{p}.post_feedforward_layernorm.weight"), [c], false)?;
            }
            (LayerKind::Block(i), Arch::Starcoder2) => {
                let p = format!("model.layers.{i}");
                let (q, kv, f) = (self.q_dim(), self.kv_dim(), self.intermediate_size);
                let bias = self.qkv_bias;
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                t.push(format!("{p}.input_layernorm.bias"), [c], false)?;
                let linears = [
                    ("self_attn.q_proj", [q, c]),
                    ("self_attn.k_proj", [kv, c]),
                    ("self_attn.v_proj", [kv, c]),
                    ("self_attn.o_proj", [c, q]),
                ];
                for (name, shape) in linears {
                    t.push(format!("{p}.{name}.weight"), shape, true)?;
                    if bias {
                        t.push(format!("{p}.{name}.bias"), [shape[0]], false)?;
                    }
                }
                t.push(format!("{p}.post_attention_layernorm.weight"), [c], false)?;
                t.push(format!("{p}.post_attention_layernorm.bias"), [c], false)?;
                for (name, shape) in [("mlp.c_fc", [f, c]), ("mlp.c_proj", [c, f])] {
                    t.push(format!("{p}.{name}.weight"), shape, true)?;
                    if bias {
                        t.push(format!("{p}.{name}.bias"), [shape[0]], false)?;
                    }
                }
            }
            (LayerKind::Block(i), Arch::Cohere | Arch::Cohere2) => {
                let p = format!("model.layers.{i}");
                let (q, kv, f) = (self.q_dim(), self.kv_dim(), self.intermediate_size);
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                let linears = [
                    ("self_attn.q_proj", [q, c]),
                    ("self_attn.k_proj", [kv, c]),
                    ("self_attn.v_proj", [kv, c]),
                    ("self_attn.o_proj", [c, q]),
                ];
                for (name, shape) in linears {
                    t.push(format!("{p}.{name}.weight"), shape, true)?;
                    if self.qkv_bias {
                        t.push(format!("{p}.{name}.bias"), [shape[0]], false)?;
                    }
                }
                for (name, shape) in [("gate_proj", [f, c]), ("up_proj", [f, c]), ("down_proj", [c, f])] {
                    t.push(format!("{p}.mlp.{name}.weight"), shape, true)?;
                }
            }
            (LayerKind::Block(i), Arch::GptNeox) => {
                // In block_neox's Layout order.
                let p = format!("gpt_neox.layers.{i}");
                let f = self.intermediate_size;
                for norm in ["input_layernorm", "post_attention_layernorm"] {
                    t.push(format!("{p}.{norm}.weight"), [c], false)?;
                    t.push(format!("{p}.{norm}.bias"), [c], false)?;
                }
                let linears = [
                    ("attention.query_key_value", [3 * c, c], self.qkv_bias),
                    ("attention.dense", [c, c], self.o_bias),
                    ("mlp.dense_h_to_4h", [f, c], true),
                    ("mlp.dense_4h_to_h", [c, f], true),
                ];
                for (name, shape, bias) in linears {
                    t.push(format!("{p}.{name}.weight"), shape, true)?;
                    if bias {
                        t.push(format!("{p}.{name}.bias"), [shape[0]], false)?;
                    }
                }
            }
            (LayerKind::Block(i), Arch::Phi) => {
                let p = format!("model.layers.{i}");
                let (q, kv, f) = (self.q_dim(), self.kv_dim(), self.intermediate_size);
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                t.push(format!("{p}.input_layernorm.bias"), [c], false)?;
                let linears = [
                    ("self_attn.q_proj", [q, c]),
                    ("self_attn.k_proj", [kv, c]),
                    ("self_attn.v_proj", [kv, c]),
                    ("self_attn.dense", [c, q]),
                    ("mlp.fc1", [f, c]),
                    ("mlp.fc2", [c, f]),
                ];
                for (name, shape) in linears {
                    t.push(format!("{p}.{name}.weight"), shape, true)?;
                    t.push(format!("{p}.{name}.bias"), [shape[0]], false)?;
                }
            }
            (LayerKind::Block(i), Arch::KimiLinear) if self.is_linear_block(i) => {
                let p = format!("model.layers.{i}");
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                self.push_kda(&mut t, &p)?;
                t.push(format!("{p}.post_attention_layernorm.weight"), [c], false)?;
                self.push_mlp(&mut t, &p, i)?;
            }
            (LayerKind::Block(i), Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::KimiLinear) => {
                let p = format!("model.layers.{i}");
                self.push_mla(&mut t, &p)?;
                t.push(format!("{p}.post_attention_layernorm.weight"), [c], false)?;
                self.push_mlp(&mut t, &p, i)?;
            }
            (LayerKind::Block(i), Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next) => {
                let p = format!("model.layers.{i}");
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                self.push_qwen35_mixer(&mut t, &p, i)?;
                t.push(format!("{p}.post_attention_layernorm.weight"), [c], false)?;
                self.push_mlp(&mut t, &p, i)?;
            }
            (LayerKind::Block(i), _) => {
                let p = format!("model.layers.{i}");
                let (q, kv, d) = (self.q_dim(), self.kv_dim(), self.head_dim);
                t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
                t.push(format!("{p}.self_attn.q_proj.weight"), [q, c], true)?;
                if self.qkv_bias {
                    t.push(format!("{p}.self_attn.q_proj.bias"), [q], false)?;
                }
                t.push(format!("{p}.self_attn.k_proj.weight"), [kv, c], true)?;
                if self.qkv_bias {
                    t.push(format!("{p}.self_attn.k_proj.bias"), [kv], false)?;
                }
                t.push(format!("{p}.self_attn.v_proj.weight"), [kv, c], true)?;
                if self.qkv_bias {
                    t.push(format!("{p}.self_attn.v_proj.bias"), [kv], false)?;
                }
                t.push(format!("{p}.self_attn.o_proj.weight"), [c, q], true)?;
                if self.o_bias {
                    t.push(format!("{p}.self_attn.o_proj.bias"), [c], false)?;
                }
                if self.arch.has_attention_sinks() {
                    t.push(format!("{p}.self_attn.sinks"), [self.num_heads], false)?;
                }
                if self.qk_norm {
                    let (qn, kn) = match self.arch.has_full_qk_norms() {
                        true => (q, kv),
                        false => (d, d),
                    };
                    t.push(format!("{p}.self_attn.q_norm.weight"), [qn], false)?;
                    t.push(format!("{p}.self_attn.k_norm.weight"), [kn], false)?;
                }
                let sandwich = self.arch.has_sandwich_norms();
                // The norms after the attention, before the MLP and after it.
                let [post_attn, pre_mlp, post_mlp] = match self.arch {
                    Arch::Gemma2 | Arch::Gemma3 => [
                        "post_attention_layernorm",
                        "pre_feedforward_layernorm",
                        "post_feedforward_layernorm",
                    ],
                    _ => [
                        "post_self_attn_layernorm",
                        "post_attention_layernorm",
                        "post_mlp_layernorm",
                    ],
                };
                if sandwich {
                    t.push(format!("{p}.{post_attn}.weight"), [c], false)?;
                }
                t.push(format!("{p}.{pre_mlp}.weight"), [c], false)?;
                self.push_mlp(&mut t, &p, i)?;
                if sandwich {
                    t.push(format!("{p}.{post_mlp}.weight"), [c], false)?;
                }
            }
            (LayerKind::Head, Arch::Phi) => {
                t.push("model.final_layernorm.weight", [c], false)?;
                t.push("model.final_layernorm.bias", [c], false)?;
                if !self.tie_word_embeddings {
                    t.push("lm_head.weight", [v, c], true)?;
                }
                t.push("lm_head.bias", [v], false)?;
            }
            (LayerKind::Head, Arch::Starcoder2) => {
                t.push("model.norm.weight", [c], false)?;
                t.push("model.norm.bias", [c], false)?;
                if !self.tie_word_embeddings {
                    t.push("lm_head.weight", [v, c], true)?;
                }
            }
            (LayerKind::Head, Arch::GptNeox) => {
                t.push("gpt_neox.final_layer_norm.weight", [c], false)?;
                t.push("gpt_neox.final_layer_norm.bias", [c], false)?;
                if !self.tie_word_embeddings {
                    t.push("embed_out.weight", [v, c], true)?;
                }
            }
            (LayerKind::Head, Arch::Gpt2) => {
                t.push("transformer.ln_f.weight", [c], false)?;
                t.push("transformer.ln_f.bias", [c], false)?;
                if !self.tie_word_embeddings {
                    t.push("lm_head.weight", [v, c], true)?;
                }
            }
            (LayerKind::Head, _) => {
                t.push("model.norm.weight", [c], false)?;
                if !self.tie_word_embeddings {
                    t.push("lm_head.weight", [v, c], true)?;
                }
            }
        }
        Ok(t)
    }

    /// Block `i`'s MLP under `p`: routed where the model's experts route
    /// it, else the dense gate, up and down of `intermediate_size`.
    fn push_mlp(&self, t: &mut ParamTable, p: &str, i: usize) -> Result<()> {
        if let Some(moe) = self.moe.as_ref().filter(|m| m.routes(i)) {
            return self.push_experts(t, p, moe);
        }
        let (c, f) = (self.hidden_size, self.intermediate_size);
        for (name, shape) in [("gate_proj", [f, c]), ("up_proj", [f, c]), ("down_proj", [c, f])] {
            t.push(format!("{p}.mlp.{name}.weight"), shape, true)?;
            if self.mlp_bias {
                t.push(format!("{p}.mlp.{name}.bias"), [shape[0]], false)?;
            }
        }
        Ok(())
    }

    /// DeepSeek-V3's input norm and latent attention under `p`, in
    /// `block_mla`'s layout order: q's low-rank pair and its norm (or one
    /// `q_proj`), the latent's projection with the shared rotated key
    /// beside it, the latent's norm, its expansion to every head's k and v,
    /// and o. `attention_bias` biases q_a, kv_a and o.
    fn push_mla(&self, t: &mut ParamTable, p: &str) -> Result<()> {
        let m = self.mla.expect("DeepSeek-V3's attention is latent");
        let (c, h, qk, kv) = (self.hidden_size, self.num_heads, m.qk_head_dim(), m.kv_lora_rank);
        let a = format!("{p}.self_attn");
        let linear = |t: &mut ParamTable, name: &str, shape: [usize; 2], bias: bool| -> Result<()> {
            t.push(format!("{a}.{name}.weight"), shape, true)?;
            if bias {
                t.push(format!("{a}.{name}.bias"), [shape[0]], false)?;
            }
            Ok(())
        };
        t.push(format!("{p}.input_layernorm.weight"), [c], false)?;
        match m.q_lora_rank {
            Some(r) => {
                linear(t, "q_a_proj", [r, c], self.qkv_bias)?;
                t.push(format!("{a}.q_a_layernorm.weight"), [r], false)?;
                linear(t, "q_b_proj", [h * qk, r], false)?;
            }
            None => linear(t, "q_proj", [h * qk, c], false)?,
        }
        linear(t, "kv_a_proj_with_mqa", [kv + m.qk_rope, c], self.qkv_bias)?;
        t.push(format!("{a}.kv_a_layernorm.weight"), [kv], false)?;
        linear(t, "kv_b_proj", [h * (m.qk_nope + m.v_head_dim), kv], false)?;
        linear(t, "o_proj", [c, h * m.v_head_dim], self.o_bias)
    }

    /// Qwen3.5's token mixer of block `i` under `p`, in `block_qwen35`'s
    /// layout order: a Gated DeltaNet's products of the mixed q/k/v, of
    /// `z`, `b` and `a` (Qwen3-Next's of q/k/v/z and of b/a; OLMo Hybrid's
    /// of q, k, v, the gate, b and a apart), its convolution `[channels, 1, taps]` (as
    /// `nn.Conv1d` stores it), `dt_bias`, `A_log`, its gated norm and its
    /// output product; or the gated attention's q (each head's query and
    /// gate side by side, twice `q_dim` rows), k, v, o and per-head q/k
    /// norms.
    fn push_qwen35_mixer(&self, t: &mut ParamTable, p: &str, i: usize) -> Result<()> {
        let c = self.hidden_size;
        let linear = |t: &mut ParamTable, name: String, shape: [usize; 2], bias: bool| -> Result<()> {
            t.push(format!("{name}.weight"), shape, true)?;
            if bias {
                t.push(format!("{name}.bias"), [shape[0]], false)?;
            }
            Ok(())
        };
        match self.linear_attn.as_ref().filter(|l| l.is_linear(i)) {
            Some(l) => {
                let a = format!("{p}.linear_attn");
                let (mixed, vw, hv) = (l.conv_channels(), l.value_width(), l.value_heads);
                if self.arch == Arch::OlmoHybrid {
                    let kw = l.key_width();
                    for (name, rows) in [("q_proj", kw), ("k_proj", kw), ("v_proj", vw), ("g_proj", vw)] {
                        linear(t, format!("{a}.{name}"), [rows, c], false)?;
                    }
                    linear(t, format!("{a}.b_proj"), [hv, c], false)?;
                    linear(t, format!("{a}.a_proj"), [hv, c], false)?;
                } else if self.arch == Arch::Qwen3Next {
                    linear(t, format!("{a}.in_proj_qkvz"), [mixed + vw, c], false)?;
                    linear(t, format!("{a}.in_proj_ba"), [2 * hv, c], false)?;
                } else {
                    linear(t, format!("{a}.in_proj_qkv"), [mixed, c], false)?;
                    linear(t, format!("{a}.in_proj_z"), [vw, c], false)?;
                    linear(t, format!("{a}.in_proj_b"), [hv, c], false)?;
                    linear(t, format!("{a}.in_proj_a"), [hv, c], false)?;
                }
                match self.arch {
                    // OLMo Hybrid's checkpoints hold q's, k's and v's
                    // pieces of the convolution apart.
                    Arch::OlmoHybrid => {
                        let kw = l.key_width();
                        for (name, rows) in [("q_conv1d", kw), ("k_conv1d", kw), ("v_conv1d", vw)] {
                            t.push_f32(format!("{a}.{name}.weight"), [rows, 1, l.conv_kernel], true)?;
                        }
                    }
                    _ => {
                        t.push_f32(format!("{a}.conv1d.weight"), [mixed, 1, l.conv_kernel], true)?;
                    }
                }
                t.push(format!("{a}.dt_bias"), [hv], false)?;
                t.push(format!("{a}.A_log"), [hv], false)?;
                let (norm, out) = match self.arch {
                    Arch::OlmoHybrid => ("o_norm", "o_proj"),
                    _ => ("norm", "out_proj"),
                };
                t.push(format!("{a}.{norm}.weight"), [l.value_dim], false)?;
                linear(t, format!("{a}.{out}"), [c, vw], false)?;
            }
            None => {
                let a = format!("{p}.self_attn");
                let (q, kv, d, bias) = (self.q_dim(), self.kv_dim(), self.head_dim, self.qkv_bias);
                linear(t, format!("{a}.q_proj"), [2 * q, c], bias)?;
                linear(t, format!("{a}.k_proj"), [kv, c], bias)?;
                linear(t, format!("{a}.v_proj"), [kv, c], bias)?;
                linear(t, format!("{a}.o_proj"), [c, q], self.o_bias)?;
                t.push(format!("{a}.q_norm.weight"), [d], false)?;
                t.push(format!("{a}.k_norm.weight"), [d], false)?;
            }
        }
        Ok(())
    }

    /// Kimi Linear's delta attention under `p`, in `block_kimi`'s layout
    /// order and its checkpoints' names (`self_attn.`): q, k, v and their
    /// pieces of the convolution, the forget gate's low-rank pair
    /// `f_a`/`f_b` with its per-channel `dt_bias` and per-head `A_log`
    /// (`[1, 1, H, 1]` as stored), β's `b_proj`, the output gate's
    /// low-rank pair `g_a`/`g_b`, its norm and `o_proj`.
    fn push_kda(&self, t: &mut ParamTable, p: &str) -> Result<()> {
        let l = self.linear_attn.as_ref().expect("Kimi Linear's delta attention");
        let (c, h, d) = (self.hidden_size, l.value_heads, l.value_dim);
        let a = format!("{p}.self_attn");
        for name in ["q_proj", "k_proj", "v_proj"] {
            t.push(format!("{a}.{name}.weight"), [h * d, c], true)?;
        }
        for name in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            t.push_f32(format!("{a}.{name}.weight"), [h * d, 1, l.conv_kernel], true)?;
        }
        t.push(format!("{a}.f_a_proj.weight"), [d, c], true)?;
        t.push(format!("{a}.f_b_proj.weight"), [h * d, d], true)?;
        t.push(format!("{a}.dt_bias"), [h * d], false)?;
        t.push_f32(format!("{a}.A_log"), [1, 1, h, 1], false)?;
        t.push(format!("{a}.b_proj.weight"), [h, c], true)?;
        t.push(format!("{a}.g_a_proj.weight"), [d, c], true)?;
        t.push(format!("{a}.g_b_proj.weight"), [h * d, d], true)?;
        t.push(format!("{a}.o_norm.weight"), [d], false)?;
        t.push(format!("{a}.o_proj.weight"), [c, h * d], true)?;
        Ok(())
    }

    /// A routed MLP's router `[E, C]` (and DeepSeek-V3's correction bias
    /// `[E]`), then each expert's gate and up `[F, C]` and down `[C, F]`
    /// (then a shared expert, with Qwen2-MoE's gate `[1, C]`), under the
    /// checkpoints' per-expert names
    /// (transformers 5 holds them fused in memory and writes them apart).
    fn push_experts(&self, t: &mut ParamTable, p: &str, moe: &Moe) -> Result<()> {
        let (c, f) = (self.hidden_size, moe.expert_size);
        if moe.clamped.is_some() {
            return self.push_clamped_experts(t, p, moe);
        }
        let (mlp, [gate, up, down]) = match self.arch {
            Arch::Mixtral | Arch::KimiLinear => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        t.push(format!("{p}.{mlp}.gate.weight"), [moe.num_experts, c], true)?;
        if let Router::Sigmoid { .. } = moe.router {
            t.push(
                format!("{p}.{mlp}.gate.e_score_correction_bias"),
                [moe.num_experts],
                false,
            )?;
        }
        for e in 0..moe.num_experts {
            let x = format!("{p}.{mlp}.experts.{e}");
            t.push(format!("{x}.{gate}.weight"), [f, c], true)?;
            t.push(format!("{x}.{up}.weight"), [f, c], true)?;
            t.push(format!("{x}.{down}.weight"), [c, f], true)?;
        }
        if let Some(s) = moe.shared_expert {
            // Qwen2-MoE's gated `shared_expert`, GLM-4.5's `shared_experts`.
            let x = match moe.shared_gated {
                true => format!("{p}.{mlp}.shared_expert"),
                false => format!("{p}.{mlp}.shared_experts"),
            };
            t.push(format!("{x}.gate_proj.weight"), [s, c], true)?;
            t.push(format!("{x}.up_proj.weight"), [s, c], true)?;
            t.push(format!("{x}.down_proj.weight"), [c, s], true)?;
            if moe.shared_gated {
                t.push(format!("{p}.{mlp}.shared_expert_gate.weight"), [1, c], true)?;
            }
        }
        Ok(())
    }

    /// GPT-OSS's router `[E, C]` and its bias, then the experts one kind
    /// of tensor at a time: every expert's interleaved gate/up `[C, 2F]`,
    /// their biases `[2F]`, their downs `[F, C]` and their biases `[C]`
    /// (each kind's E entries are consecutive, so that the checkpoint's
    /// tensor of them all, `[E, ..]`, is their concatenation: `hf_table`).
    /// The products read `x @ w` (`Transpose::NN`), as the checkpoint
    /// stores them.
    fn push_clamped_experts(&self, t: &mut ParamTable, p: &str, moe: &Moe) -> Result<()> {
        let (c, f, n) = (self.hidden_size, moe.expert_size, moe.num_experts);
        t.push(format!("{p}.mlp.router.weight"), [n, c], true)?;
        t.push(format!("{p}.mlp.router.bias"), [n], false)?;
        let kinds: [(&str, &[usize], bool); 4] = [
            ("gate_up_proj", &[c, 2 * f], true),
            ("gate_up_proj_bias", &[2 * f], false),
            ("down_proj", &[f, c], true),
            ("down_proj_bias", &[c], false),
        ];
        for (kind, shape, decay) in kinds {
            for e in 0..n {
                t.push(format!("{p}.mlp.experts.{e}.{kind}"), shape.to_vec(), decay)?;
            }
        }
        Ok(())
    }

    /// The tensors of `table` (a layer's) as Hugging Face checkpoints
    /// store them, over the same slab: the table itself, except that
    /// Phi-3's fused `qkv_proj` and `gate_up_proj` (GLM's `gate_up_proj`)
    /// join the consecutive q, k, v and gate, up entries (rows of an `[out, in]` matrix are
    /// contiguous, so the fused tensor is exactly their concatenation), and
    /// GPT-OSS's experts are stacked one tensor a kind (`stacked_experts`).
    /// Loading, exporting and run checkpoints go through this.
    pub fn hf_table(&self, table: &ParamTable) -> ParamTable {
        if self.arch == Arch::GptOss {
            return self.stacked_experts(table);
        }
        let specs = table.iter().as_slice();
        // (the parts' names, in table order; the fused tensor's name)
        let qkv: (&[&str], &str) = (
            &[
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ],
            "self_attn.qkv_proj.weight",
        );
        let gate_up: (&[&str], &str) = (
            &["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            "mlp.gate_up_proj.weight",
        );
        let fusions: &[(&[&str], &str)] = match self.arch {
            Arch::Phi3 => &[qkv, gate_up],
            // GLM stores q, k and v (with their biases) apart.
            Arch::Glm | Arch::Glm4 => &[gate_up],
            _ => return table.clone(),
        };
        let mut out = ParamTable::new();
        let mut i = 0;
        while i < specs.len() {
            let fusion = fusions.iter().find_map(|&(names, fused)| {
                let prefix = specs[i].name.strip_suffix(names[0])?;
                let parts = &specs[i..i + names.len()];
                let named = parts
                    .iter()
                    .zip(names)
                    .all(|(s, n)| s.name == format!("{prefix}{n}"));
                assert!(named, "{names:?} are consecutive in a {:?} table", self.arch);
                Some((format!("{prefix}{fused}"), parts))
            });
            let (name, parts) = fusion.unwrap_or((specs[i].name.clone(), &specs[i..=i]));
            let rows = parts.iter().map(|s| s.shape.dims()[0]).sum();
            let mut shape = parts[0].shape.dims().to_vec();
            shape[0] = rows;
            out.push(name, shape, parts[0].decay)
                .expect("the table's names are unique, and so are the fused ones");
            i += parts.len();
        }
        debug_assert_eq!(out.numel(), table.numel());
        out
    }

    /// GPT-OSS's [`Self::hf_table`]: each run of E per-expert entries
    /// (`..mlp.experts.{e}.{kind}`, e = 0, 1, ..) becomes the checkpoint's
    /// `..mlp.experts.{kind}` of shape `[E, ..]`.
    fn stacked_experts(&self, table: &ParamTable) -> ParamTable {
        let specs = table.iter().as_slice();
        let mut out = ParamTable::new();
        let mut i = 0;
        while i < specs.len() {
            let dims = specs[i].shape.dims();
            let (name, shape, run) = match specs[i].name.split_once(".mlp.experts.0.") {
                Some((prefix, kind)) => {
                    let run = specs[i..]
                        .iter()
                        .enumerate()
                        .take_while(|(e, s)| s.name == format!("{prefix}.mlp.experts.{e}.{kind}"))
                        .count();
                    let shape = [&[run], dims].concat();
                    (format!("{prefix}.mlp.experts.{kind}"), shape, run)
                }
                None => (specs[i].name.clone(), dims.to_vec(), 1),
            };
            out.push(name, shape, specs[i].decay)
                .expect("the table's names are unique, and so are the stacked ones");
            i += run;
        }
        debug_assert_eq!(out.numel(), table.numel());
        out
    }

    /// Model FLOPs per token of block `layer`'s token mixing beyond its
    /// products' 6 a parameter, forward and backward, at `seq` tokens:
    /// causal attention's 6·q_dim·T (the two T×T products over the T/2
    /// keys a query sees on average), or a Gated DeltaNet's 21·Dk·Dv a
    /// value head (decaying, reading, writing and reading out its Dk×Dv
    /// state, 7 a state entry, a token at a time; the backward twice the
    /// forward).
    pub fn mixer_flops_per_token(&self, layer: usize, seq: usize) -> f64 {
        match self.linear_attn.as_ref().filter(|l| l.is_linear(layer)) {
            Some(l) => 21.0 * (l.value_heads * l.key_dim * l.value_dim) as f64,
            None => 6.0 * self.q_dim() as f64 * seq as f64,
        }
    }

    /// [`Self::hf_table`] of every layer.
    pub fn hf_tables(&self) -> Vec<ParamTable> {
        self.layer_tables().iter().map(|t| self.hf_table(t)).collect()
    }

    /// Parameters of the whole model (a tied head counted once).
    pub fn param_count(&self) -> usize {
        (0..self.num_layers_total())
            .map(|l| self.layer_table(l).expect("in range").numel())
            .sum()
    }

    /// Parameters of layer `layer` that one token's products do not read:
    /// the experts of a routed block that the token is not sent to (a
    /// mixture of experts' FLOPs per token count the table's numel less
    /// these); 0 for every other layer. From the config alone, so a
    /// caller holding the tables builds none.
    pub fn unread_params_of(&self, layer: usize) -> usize {
        match (self.layer_kind(layer), &self.moe) {
            (Some(LayerKind::Block(i)), Some(moe)) if moe.routes(i) => {
                (moe.num_experts - moe.top_k) * moe.expert_params(self.hidden_size)
            }
            _ => 0,
        }
    }

    /// Parameters one token's products read: [`Self::param_count`] less
    /// [`Self::unread_params_of`] every layer.
    pub fn active_param_count(&self) -> usize {
        let unread: usize = (0..self.num_layers_total())
            .map(|l| self.unread_params_of(l))
            .sum();
        self.param_count() - unread
    }
}
