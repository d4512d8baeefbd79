//! The Gated DeltaNet of Qwen3.5, Qwen3-Next and OLMo Hybrid: the "linear
//! attention" blocks of their hybrid stacks, beside blocks of full
//! attention (gated by a sigmoid in Qwen's).

use serde_json::{Map, Value, json};

use super::Fields;
use crate::{Arch, Result};

/// The shape of a Gated DeltaNet and which blocks have one.
///
/// A block's input gives (through one product, or OLMo Hybrid's three) the mixed `[q | k | v]` of
/// `key_heads · key_dim` (twice) and `value_heads · value_dim` entries,
/// which a causal depthwise convolution of `conv_kernel` taps (and SiLU)
/// mixes over time; `z` (the output gate), `b` (β's logits) and `a` (the
/// decay's) come from products of their own. Each value head keeps a
/// `key_dim × value_dim` state, read by key head `h / (value_heads /
/// key_heads)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttn {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// Per block: a Gated DeltaNet (`linear_attention`) rather than full
    /// attention.
    pub layers: Vec<bool>,
    /// What the rates `σ(b)` are multiplied by: OLMo Hybrid's
    /// `linear_allow_neg_eigval` lets them reach 2 (the transition's
    /// eigenvalue `1 − β‖k‖²` then reaches −1); 1 elsewhere.
    pub beta_scale: f64,
    /// The epsilon of the norm before the output gate: OLMo Hybrid's is
    /// 1e-5 whatever `rms_norm_eps` says; `None`: the model's.
    pub norm_eps: Option<f64>,
}

impl LinearAttn {
    /// Entries of q, k and of v across their heads.
    pub fn key_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// Whether block `layer` is a Gated DeltaNet.
    pub fn is_linear(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }

    pub(super) fn validate(&self, num_layers: usize) -> std::result::Result<(), String> {
        let positive = [
            ("linear_num_key_heads", self.key_heads),
            ("linear_num_value_heads", self.value_heads),
            ("linear_key_head_dim", self.key_dim),
            ("linear_value_head_dim", self.value_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if !self.value_heads.is_multiple_of(self.key_heads) {
            return Err(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.value_heads, self.key_heads
            ));
        }
        if self.layers.len() != num_layers {
            return Err(format!(
                "layer_types lists {} blocks of num_hidden_layers {num_layers}",
                self.layers.len()
            ));
        }
        Ok(())
    }

    /// The fields transformers' config classes read, into `obj`.
    pub(super) fn write_json(&self, arch: Arch, obj: &mut Map<String, Value>) {
        if arch == Arch::OlmoHybrid {
            obj.insert("linear_allow_neg_eigval".into(), json!(self.beta_scale == 2.0));
        }
        let kind = |l: &bool| if *l { "linear_attention" } else { "full_attention" };
        let kinds = json!(self.layers.iter().map(kind).collect::<Vec<_>>());
        if arch == Arch::KimiLinear {
            obj.insert("linear_num_heads".into(), json!(self.value_heads));
            obj.insert("linear_head_dim".into(), json!(self.value_dim));
            obj.insert("linear_conv_kernel_dim".into(), json!(self.conv_kernel));
            obj.insert("layer_types".into(), kinds);
            return;
        }
        obj.insert("linear_num_key_heads".into(), json!(self.key_heads));
        obj.insert("linear_num_value_heads".into(), json!(self.value_heads));
        obj.insert("linear_key_head_dim".into(), json!(self.key_dim));
        obj.insert("linear_value_head_dim".into(), json!(self.value_dim));
        obj.insert("linear_conv_kernel_dim".into(), json!(self.conv_kernel));
        obj.insert("layer_types".into(), kinds);
    }
}

/// `layer_types` as whether each block is linear (`linear_attention`) or
/// not (`full_attention`).
fn linear_types(f: &Fields, v: &Value) -> Result<Vec<bool>> {
    let list = v
        .as_array()
        .ok_or_else(|| f.bad("layer_types", format!("expected a list, got {v}")))?;
    list.iter()
        .map(|k| match k.as_str() {
            Some("linear_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(f.bad(
                "layer_types",
                format!("{k} is neither \"linear_attention\" nor \"full_attention\""),
            )),
        })
        .collect()
}

/// The Gated DeltaNet of a Qwen3.5, Qwen3-Next or OLMo Hybrid config
/// (their classes' defaults): `layer_types`, or else every fourth block
/// full attention (Qwen's `full_attention_interval`, 4; OLMo Hybrid's
/// blocks 3, 7, .., the last where that names none) and the others linear.
/// OLMo Hybrid's heads default to the attention's count, Dk to ¾ of the
/// width over them and Dv to twice Dk; it wants a block of each kind.
pub(super) fn parse(f: &Fields, arch: Arch, layers: usize) -> Result<LinearAttn> {
    if arch == Arch::KimiLinear {
        return parse_kimi(f, layers);
    }
    let olmo = arch == Arch::OlmoHybrid;
    let kinds = match f.get("layer_types") {
        Some(v) => linear_types(f, v)?,
        None if olmo => {
            let mut k: Vec<bool> = (0..layers).map(|i| i % 4 != 3).collect();
            if k.iter().all(|&x| x)
                && let Some(last) = k.last_mut()
            {
                *last = false;
            }
            k
        }
        None => {
            let every = f.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(f.bad("full_attention_interval", "must be positive"));
            }
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if olmo && (kinds.iter().all(|&x| x) || kinds.iter().all(|&x| !x)) {
        return Err(f.bad(
            "layer_types",
            "OLMo Hybrid wants at least one linear_attention and one full_attention block",
        ));
    }
    let (key_heads, value_heads, key_dim, value_dim) = match olmo {
        true => {
            let heads = f.req_usize("num_attention_heads")?;
            let hk = f.opt_usize("linear_num_key_heads")?.unwrap_or(heads);
            let hv = f.opt_usize("linear_num_value_heads")?.unwrap_or(heads);
            let hidden = f.req_usize("hidden_size")?;
            let dk = match f.opt_usize("linear_key_head_dim")? {
                Some(d) => d,
                None => (0.75 * hidden as f64 / hk.max(1) as f64) as usize,
            };
            (
                hk,
                hv,
                dk,
                f.opt_usize("linear_value_head_dim")?.unwrap_or(2 * dk),
            )
        }
        false => (
            f.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            f.opt_usize("linear_num_value_heads")?.unwrap_or(32),
            f.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            f.opt_usize("linear_value_head_dim")?.unwrap_or(128),
        ),
    };
    let neg_eigval = olmo && f.opt_bool("linear_allow_neg_eigval")?.unwrap_or(true);
    Ok(LinearAttn {
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        conv_kernel: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        layers: kinds,
        beta_scale: if neg_eigval { 2.0 } else { 1.0 },
        norm_eps: olmo.then_some(1e-5),
    })
}

/// Kimi Linear's Kimi Delta Attention as KimiLinearConfig reads it: as
/// many key as value heads, one head width, from transformers' fields or
/// the checkpoint's `linear_attn_config` (`num_heads`, `head_dim`,
/// `short_conv_kernel_size`, and the 1-based `full_attn_layers` and
/// `kda_layers`); without either, block i > 0 with i % 4 = 0 attends.
fn parse_kimi(f: &Fields, layers: usize) -> Result<LinearAttn> {
    let sub = f.get("linear_attn_config").and_then(Value::as_object);
    let sub_usize = |key: &str| {
        sub.and_then(|m| m.get(key))
            .and_then(Value::as_u64)
            .map(|x| x as usize)
    };
    let heads = sub_usize("num_heads")
        .or(f.opt_usize("linear_num_heads")?)
        .unwrap_or(32);
    let dim = sub_usize("head_dim")
        .or(f.opt_usize("linear_head_dim")?)
        .unwrap_or(128);
    let taps = sub_usize("short_conv_kernel_size")
        .or(f.opt_usize("linear_conv_kernel_dim")?)
        .unwrap_or(4);
    let listed = |key: &str| -> Option<Vec<usize>> {
        sub?.get(key)?
            .as_array()?
            .iter()
            .map(|x| x.as_u64().map(|x| x as usize))
            .collect()
    };
    let kinds = match (
        f.get("layer_types"),
        listed("full_attn_layers"),
        listed("kda_layers"),
    ) {
        (Some(v), ..) => linear_types(f, v)?,
        (None, Some(full), Some(kda)) => {
            let mut kinds: Vec<Option<bool>> = vec![None; layers];
            for (list, linear) in [(full, false), (kda, true)] {
                for l in list {
                    let slot = l.checked_sub(1).and_then(|i| kinds.get_mut(i)).ok_or_else(|| {
                        f.bad(
                            "linear_attn_config",
                            format!("block {l} (1-based) of a model of num_hidden_layers {layers}"),
                        )
                    })?;
                    *slot = Some(linear);
                }
            }
            kinds
                .into_iter()
                .enumerate()
                .map(|(i, k)| {
                    k.ok_or_else(|| {
                        f.bad(
                            "linear_attn_config",
                            format!(
                                "block {} (1-based) is in neither full_attn_layers nor kda_layers",
                                i + 1
                            ),
                        )
                    })
                })
                .collect::<Result<Vec<bool>>>()?
        }
        _ => (0..layers).map(|i| !(i > 0 && i % 4 == 0)).collect(),
    };
    Ok(LinearAttn {
        key_heads: heads,
        value_heads: heads,
        key_dim: dim,
        value_dim: dim,
        conv_kernel: taps,
        layers: kinds,
        beta_scale: 1.0,
        norm_eps: None,
    })
}
