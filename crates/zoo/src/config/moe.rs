//! Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE,
//! GPT-OSS, GLM-4.5): which blocks route each token to `top_k` of
//! `num_experts` SwiGLU experts, and how, as the transformers config
//! classes read their fields.

use megatrain_tensor::ClampedGlu;
use serde_json::{Value, json};

use super::{Arch, Fields};
use crate::Result;

/// The routed MLP of a family's sparse blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Each expert's MLP width (Mixtral's `intermediate_size`, Qwen3-MoE's
    /// `moe_intermediate_size`).
    pub expert_size: usize,
    /// Whether the top-k routing probabilities are divided by their sum
    /// (Mixtral always; Qwen3-MoE under `norm_topk_prob`).
    pub norm_topk: bool,
    /// Which blocks route (Qwen3-MoE's `decoder_sparse_step` and
    /// `mlp_only_layers`; the others keep a dense MLP of
    /// `intermediate_size`); `None`: every block.
    pub sparse_layers: Option<Vec<bool>>,
    /// The factor of the routers' load-balancing loss added to the loss
    /// (`router_aux_loss_coef` where `output_router_logits` is set, as
    /// transformers adds it); `None`: the loss is the cross-entropy alone.
    pub aux_loss_coef: Option<f64>,
    /// The width of a shared expert, which every token takes beside its
    /// k: Qwen2-MoE's, scaled by `sigmoid(x · shared_expert_gate)`
    /// (`shared_gated`), GLM-4.5's `n_shared_experts` as one MLP, unscaled.
    pub shared_expert: Option<usize>,
    pub shared_gated: bool,
    /// How the router scores and picks the experts.
    pub router: Router,
    /// GPT-OSS's experts: a router with a bias; each expert's gate and up
    /// one product `[C, 2F]` (interleaved, with a bias) through a clamped
    /// SwiGLU, its down product `[F, C]` with a bias. `None`: the other
    /// families' three bias-free `nn.Linear`s an expert.
    pub clamped: Option<ClampedGlu>,
}

/// A router's scoring and choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// DeepSeek-V2's: the softmax over every expert; the k most probable
    /// among the experts of the `topk_groups` best of `groups` equal
    /// groups (a group's merit: its most probable expert; `topk_method`
    /// `greedy` is one group), their probabilities times `scale`
    /// (`routed_scaling_factor`), never renormalised.
    SoftmaxGroups {
        groups: usize,
        topk_groups: usize,
        scale: f64,
    },
    /// The softmax of the scores over every expert, the k most probable
    /// (Mixtral, the Qwen MoEs, OLMoE, GPT-OSS).
    Softmax,
    /// DeepSeek-V3's (GLM-4.5's): sigmoid scores; the choice by the scores
    /// plus a correction bias (`e_score_correction_bias`, a checkpoint
    /// tensor no gradient reaches) among the experts of the `topk_groups`
    /// best of `groups` equal groups (a group's merit: its two best biased
    /// scores); the weights the chosen experts' unbiased scores
    /// (renormalised under `norm_topk`) times `scale`
    /// (`routed_scaling_factor`).
    Sigmoid {
        groups: usize,
        topk_groups: usize,
        scale: f64,
    },
}

impl Moe {
    /// Whether block `layer` routes.
    pub fn routes(&self, layer: usize) -> bool {
        self.sparse_layers
            .as_ref()
            .is_none_or(|s| s.get(layer).copied().unwrap_or(false))
    }

    /// Parameters of one expert (its biases included).
    pub fn expert_params(&self, hidden: usize) -> usize {
        let f = self.expert_size;
        match self.clamped {
            Some(_) => 3 * f * hidden + 2 * f + hidden,
            None => 3 * f * hidden,
        }
    }

    pub(super) fn validate(&self, layers: usize) -> std::result::Result<(), String> {
        if let Some(c) = self.clamped {
            c.check("swiglu_alpha, swiglu_limit").map_err(|e| e.to_string())?;
        }
        if self.num_experts == 0 || self.expert_size == 0 {
            return Err("a mixture of experts needs experts of positive width".into());
        }
        if self.shared_expert == Some(0) {
            return Err("shared_expert_intermediate_size must be positive".into());
        }
        if let Router::Sigmoid {
            groups,
            topk_groups,
            scale,
        }
        | Router::SoftmaxGroups {
            groups,
            topk_groups,
            scale,
        } = self.router
        {
            if groups == 0
                || !self.num_experts.is_multiple_of(groups)
                || topk_groups == 0
                || topk_groups > groups
            {
                return Err(format!(
                    "n_group {groups} must divide the {} experts, and topk_group {topk_groups} be between 1 and it",
                    self.num_experts
                ));
            }
            if self.top_k > topk_groups * (self.num_experts / groups) {
                return Err(format!(
                    "num_experts_per_tok {} exceeds the {} experts of topk_group {topk_groups} groups",
                    self.top_k,
                    topk_groups * (self.num_experts / groups)
                ));
            }
            if !(scale.is_finite() && scale > 0.0) {
                return Err(format!("routed_scaling_factor {scale} must be a positive number"));
            }
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return Err(format!(
                "num_experts_per_tok {} must be between 1 and the {} experts",
                self.top_k, self.num_experts
            ));
        }
        if let Some(s) = &self.sparse_layers
            && s.len() != layers
        {
            return Err(format!(
                "the sparse blocks list {} blocks of num_hidden_layers {layers}",
                s.len()
            ));
        }
        Ok(())
    }

    /// What DeepSeek's grouped routers (and their families': GLM-4.5's,
    /// Kimi's) write alike: the experts' width, the renormalisation, the
    /// groups, the scale and the shared experts.
    fn insert_grouped(
        &self,
        obj: &mut serde_json::Map<String, Value>,
        groups: usize,
        topk_groups: usize,
        scale: f64,
    ) {
        obj.insert("moe_intermediate_size".into(), json!(self.expert_size));
        obj.insert("norm_topk_prob".into(), json!(self.norm_topk));
        obj.insert("n_group".into(), json!(groups));
        obj.insert("topk_group".into(), json!(topk_groups));
        obj.insert("routed_scaling_factor".into(), json!(scale));
        let width = self.shared_expert.unwrap_or(0);
        obj.insert("n_shared_experts".into(), json!(width / self.expert_size));
    }

    /// The fields [`parse`] reads back to this.
    pub(super) fn write_json(&self, arch: Arch, obj: &mut serde_json::Map<String, Value>) {
        obj.insert("num_experts_per_tok".into(), json!(self.top_k));
        obj.insert("output_router_logits".into(), json!(self.aux_loss_coef.is_some()));
        if let Some(c) = self.aux_loss_coef {
            obj.insert("router_aux_loss_coef".into(), json!(c));
        }
        match arch {
            Arch::Mixtral => {
                obj.insert("num_local_experts".into(), json!(self.num_experts));
                obj.insert("router_jitter_noise".into(), json!(0.0));
            }
            Arch::Olmoe => {
                obj.insert("num_experts".into(), json!(self.num_experts));
                obj.insert("norm_topk_prob".into(), json!(self.norm_topk));
            }
            Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2 => {
                let (Router::Sigmoid {
                    groups,
                    topk_groups,
                    scale,
                }
                | Router::SoftmaxGroups {
                    groups,
                    topk_groups,
                    scale,
                }) = self.router
                else {
                    unreachable!("GLM-4.5's and DeepSeek's routers are DeepSeek's")
                };
                if arch == Arch::DeepseekV2 {
                    let method = if groups > 1 {
                        "group_limited_greedy"
                    } else {
                        "greedy"
                    };
                    obj.insert("topk_method".into(), json!(method));
                }
                obj.insert("n_routed_experts".into(), json!(self.num_experts));
                self.insert_grouped(obj, groups, topk_groups, scale);
                let dense = self
                    .sparse_layers
                    .as_ref()
                    .map_or(0, |s| s.iter().take_while(|&&x| !x).count());
                obj.insert("first_k_dense_replace".into(), json!(dense));
            }
            Arch::KimiLinear => {
                let Router::Sigmoid {
                    groups,
                    topk_groups,
                    scale,
                } = self.router
                else {
                    unreachable!("Kimi Linear's router is DeepSeek-V3's")
                };
                obj.insert("num_local_experts".into(), json!(self.num_experts));
                self.insert_grouped(obj, groups, topk_groups, scale);
                let kinds: Vec<&str> = match &self.sparse_layers {
                    Some(s) => s.iter().map(|&x| if x { "sparse" } else { "dense" }).collect(),
                    None => vec!["sparse"; layers_of(obj)],
                };
                obj.insert("mlp_layer_types".into(), json!(kinds));
            }
            Arch::Qwen35Moe => {
                obj.insert("num_experts".into(), json!(self.num_experts));
                obj.insert("moe_intermediate_size".into(), json!(self.expert_size));
                let w = self.shared_expert.expect("Qwen3.5-MoE's shared expert");
                obj.insert("shared_expert_intermediate_size".into(), json!(w));
            }
            Arch::GptOss => {
                obj.insert("num_local_experts".into(), json!(self.num_experts));
                let c = self.clamped.expect("GPT-OSS's experts are clamped");
                obj.insert("swiglu_alpha".into(), json!(c.alpha));
                obj.insert("swiglu_limit".into(), json!(c.limit));
            }
            _ => {
                if let Some(w) = self.shared_expert {
                    obj.insert("shared_expert_intermediate_size".into(), json!(w));
                }
                obj.insert("num_experts".into(), json!(self.num_experts));
                obj.insert("moe_intermediate_size".into(), json!(self.expert_size));
                obj.insert("norm_topk_prob".into(), json!(self.norm_topk));
                obj.insert("decoder_sparse_step".into(), json!(1));
                let dense: Vec<usize> = match &self.sparse_layers {
                    Some(s) => (0..s.len()).filter(|&i| !s[i]).collect(),
                    None => vec![],
                };
                obj.insert("mlp_only_layers".into(), json!(dense));
            }
        }
    }
}

/// `num_hidden_layers` as a generated config holds it.
fn layers_of(obj: &serde_json::Map<String, Value>) -> usize {
    obj.get("num_hidden_layers").and_then(Value::as_u64).unwrap_or(0) as usize
}

/// The routed MLP of a Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GPT-OSS or GLM-4.5 config
/// (`None` for the other families, and for one with no experts or no
/// sparse block). What transformers does only while training beyond the loss
/// (router jitter) is refused rather than left out.
pub(super) fn parse(f: &Fields, arch: Arch, layers: usize) -> Result<Option<Moe>> {
    let (num_experts, top_k, expert_size, norm_topk, sparse) = match arch {
        Arch::Mixtral => {
            let jitter = f.opt_f64("router_jitter_noise")?.unwrap_or(0.0);
            if jitter != 0.0 {
                return Err(f.unsupported(format!(
                    "router_jitter_noise = {jitter} (megatrain routes without jitter)"
                )));
            }
            (
                experts(f, "num_local_experts", "num_experts")?.unwrap_or(8),
                f.opt_usize("num_experts_per_tok")?.unwrap_or(2),
                f.req_usize("intermediate_size")?,
                true,
                None,
            )
        }
        // GptOssConfig; the Hub's files also say `experts_per_token`.
        Arch::GptOss => (
            experts(f, "num_local_experts", "num_experts")?.unwrap_or(128),
            experts(f, "num_experts_per_tok", "experts_per_token")?.unwrap_or(4),
            f.req_usize("intermediate_size")?,
            true,
            None,
        ),
        // Glm4MoeConfig and DeepseekV3Config: the first
        // `first_k_dense_replace` blocks dense.
        Arch::Glm4Moe | Arch::DeepseekV3 => {
            let v3 = arch == Arch::DeepseekV3;
            let dense = f
                .opt_usize("first_k_dense_replace")?
                .unwrap_or(if v3 { 3 } else { 1 });
            (
                experts(f, "n_routed_experts", "num_local_experts")?.unwrap_or(if v3 { 256 } else { 128 }),
                f.opt_usize("num_experts_per_tok")?.unwrap_or(8),
                f.opt_usize("moe_intermediate_size")?
                    .unwrap_or(if v3 { 2048 } else { 1408 }),
                f.opt_bool("norm_topk_prob")?.unwrap_or(true),
                Some((0..layers).map(|i| i >= dense).collect()),
            )
        }
        // KimiLinearConfig (its own names beside transformers'): the blocks
        // `mlp_layer_types` says `sparse` route, else all but the first
        // `first_k_dense_replace` (1).
        Arch::KimiLinear => {
            let sparse = match f.get("mlp_layer_types") {
                Some(v) => v
                    .as_array()
                    .filter(|l| l.len() == layers)
                    .and_then(|l| {
                        l.iter()
                            .map(|k| match k.as_str() {
                                Some("sparse") => Some(true),
                                Some("dense") => Some(false),
                                _ => None,
                            })
                            .collect::<Option<Vec<bool>>>()
                    })
                    .ok_or_else(|| {
                        f.bad(
                            "mlp_layer_types",
                            format!(
                                "expected num_hidden_layers = {layers} of \"dense\" or \"sparse\", got {v}"
                            ),
                        )
                    })?,
                None => {
                    let dense = f.opt_usize("first_k_dense_replace")?.unwrap_or(1);
                    (0..layers).map(|i| i >= dense).collect()
                }
            };
            (
                experts(f, "num_local_experts", "num_experts")?.unwrap_or(256),
                experts(f, "num_experts_per_tok", "num_experts_per_token")?.unwrap_or(8),
                f.opt_usize("moe_intermediate_size")?.unwrap_or(1024),
                match f.opt_bool("norm_topk_prob")? {
                    Some(b) => b,
                    None => f.opt_bool("moe_renormalize")?.unwrap_or(true),
                },
                Some(sparse),
            )
        }
        // DeepseekV2Config: k has no default; its router never renormalises.
        Arch::DeepseekV2 => {
            let dense = f.opt_usize("first_k_dense_replace")?.unwrap_or(0);
            (
                experts(f, "n_routed_experts", "num_local_experts")?.unwrap_or(64),
                f.req_usize("num_experts_per_tok")?,
                f.opt_usize("moe_intermediate_size")?.unwrap_or(1407),
                false,
                Some((0..layers).map(|i| i >= dense).collect()),
            )
        }
        Arch::Olmoe => (
            experts(f, "num_experts", "num_local_experts")?.unwrap_or(64),
            f.opt_usize("num_experts_per_tok")?.unwrap_or(8),
            f.req_usize("intermediate_size")?,
            f.opt_bool("norm_topk_prob")?.unwrap_or(false),
            None,
        ),
        Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::Qwen3Next => {
            let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(f.bad("decoder_sparse_step", "must be positive"));
            }
            let dense = match f.get("mlp_only_layers") {
                None => vec![],
                Some(v) => v
                    .as_array()
                    .and_then(|l| l.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                    .ok_or_else(|| {
                        f.bad(
                            "mlp_only_layers",
                            format!("expected a list of block indices, got {v}"),
                        )
                    })?,
            };
            if let Some(&i) = dense.iter().find(|&&i| i >= layers) {
                return Err(f.bad(
                    "mlp_only_layers",
                    format!("block {i} of a model of num_hidden_layers {layers}"),
                ));
            }
            let sparse: Vec<bool> = (0..layers)
                .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                .collect();
            // Qwen2MoeConfig's, Qwen3NextConfig's and Qwen3MoeConfig's defaults.
            let (experts_n, k, width, norm) = match arch {
                Arch::Qwen2Moe => (60, 4, 1408, false),
                Arch::Qwen3Next => (512, 10, 512, true),
                _ => (128, 8, 768, false),
            };
            (
                experts(f, "num_experts", "num_local_experts")?.unwrap_or(experts_n),
                f.opt_usize("num_experts_per_tok")?.unwrap_or(k),
                f.opt_usize("moe_intermediate_size")?.unwrap_or(width),
                f.opt_bool("norm_topk_prob")?.unwrap_or(norm),
                Some(sparse),
            )
        }
        // Qwen3_5MoeTextConfig's: every block routed, the top k always
        // renormalised.
        Arch::Qwen35Moe => (
            experts(f, "num_experts", "num_local_experts")?.unwrap_or(256),
            f.opt_usize("num_experts_per_tok")?.unwrap_or(8),
            f.opt_usize("moe_intermediate_size")?.unwrap_or(512),
            true,
            None,
        ),
        _ => return Ok(None),
    };
    // transformers adds the routers' load-balancing loss only under
    // output_router_logits; the config classes' coefficients unless written.
    // (Glm4MoeForCausalLM and DeepseekV3ForCausalLM add none whatever it says.)
    let sigmoid = matches!(
        arch,
        Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2 | Arch::KimiLinear
    );
    let aux_loss_coef = match f.opt_bool("output_router_logits")?.unwrap_or(false) && !sigmoid {
        true => {
            let default = if arch == Arch::Olmoe { 0.01 } else { 0.001 };
            match f.opt_f64("router_aux_loss_coef")?.unwrap_or(default) {
                c if c.is_finite() && c >= 0.0 => Some(c),
                c => return Err(f.bad("router_aux_loss_coef", format!("{c} must be a number ≥ 0"))),
            }
        }
        false => None,
    };
    if num_experts == 0 || sparse.as_ref().is_some_and(|s| !s.iter().any(|&x| x)) {
        return Ok(None);
    }
    let sparse_layers = sparse.filter(|s| !s.iter().all(|&x| x));
    Ok(Some(Moe {
        num_experts,
        top_k,
        expert_size,
        norm_topk,
        sparse_layers,
        aux_loss_coef,
        shared_expert: match arch {
            Arch::Qwen2Moe => Some(f.opt_usize("shared_expert_intermediate_size")?.unwrap_or(5632)),
            Arch::Qwen35Moe | Arch::Qwen3Next => {
                Some(f.opt_usize("shared_expert_intermediate_size")?.unwrap_or(512))
            }
            Arch::KimiLinear => match experts(f, "n_shared_experts", "num_shared_experts")?.unwrap_or(1) {
                0 => None,
                n => Some(n * expert_size),
            },
            Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2 => match f
                .opt_usize("n_shared_experts")?
                .unwrap_or(if arch == Arch::DeepseekV2 { 2 } else { 1 })
            {
                0 => None,
                n => Some(n * expert_size),
            },
            _ => None,
        },
        shared_gated: matches!(arch, Arch::Qwen2Moe | Arch::Qwen35Moe | Arch::Qwen3Next),
        router: match (arch, arch == Arch::DeepseekV3) {
            (Arch::Glm4Moe | Arch::DeepseekV3, v3) => Router::Sigmoid {
                groups: f.opt_usize("n_group")?.unwrap_or(if v3 { 8 } else { 1 }),
                topk_groups: f.opt_usize("topk_group")?.unwrap_or(if v3 { 4 } else { 1 }),
                scale: f
                    .opt_f64("routed_scaling_factor")?
                    .unwrap_or(if v3 { 2.5 } else { 1.0 }),
            },
            (Arch::KimiLinear, _) => Router::Sigmoid {
                groups: experts(f, "n_group", "num_expert_group")?.unwrap_or(1),
                topk_groups: f.opt_usize("topk_group")?.unwrap_or(1),
                scale: f.opt_f64("routed_scaling_factor")?.unwrap_or(2.446),
            },
            (Arch::DeepseekV2, _) => {
                let scale = f.opt_f64("routed_scaling_factor")?.unwrap_or(1.0);
                match f.opt_str("topk_method")?.unwrap_or("greedy") {
                    "greedy" => Router::SoftmaxGroups {
                        groups: 1,
                        topk_groups: 1,
                        scale,
                    },
                    "group_limited_greedy" => Router::SoftmaxGroups {
                        groups: f.req_usize("n_group")?,
                        topk_groups: f.req_usize("topk_group")?,
                        scale,
                    },
                    other => {
                        return Err(f.unsupported(format!(
                            "topk_method '{other}' (implemented: greedy, group_limited_greedy)"
                        )));
                    }
                }
            }
            _ => Router::Softmax,
        },
        clamped: match arch {
            Arch::GptOss => Some(ClampedGlu {
                alpha: f.opt_f64("swiglu_alpha")?.unwrap_or(1.702),
                limit: f.opt_f64("swiglu_limit")?.unwrap_or(7.0),
            }),
            _ => None,
        },
    }))
}

/// A count under the family's own name or the other one, which its config
/// class maps onto it (transformers 5 writes Qwen3-MoE's expert count as
/// `num_local_experts`; the Hub's files say `num_experts`).
fn experts(f: &Fields, own: &str, alias: &str) -> Result<Option<usize>> {
    match (f.opt_usize(own)?, f.opt_usize(alias)?) {
        (Some(a), Some(b)) if a != b => Err(f.bad(own, format!("{a} experts, but {alias} says {b}"))),
        (a, b) => Ok(a.or(b)),
    }
}
