//! RoPE fields of a Llama-family `config.json`: the base θ and the scaling,
//! from transformers v4 (`rope_theta`, `rope_scaling`) or v5
//! (`rope_parameters`) spellings, with transformers' defaults filled in
//! (`modeling_rope_utils`: `standardize_rope_params` and the
//! `_compute_*_parameters` functions). A scaling we do not implement is
//! refused by name, never ignored.

use serde_json::{Map, Value};

use megatrain_tensor::RopeScaling;

use super::Fields;
use crate::Result;

/// What the RoPE fields say.
pub(super) struct RopeFields {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// `partial_rotary_factor` where it is written, and the field that says
    /// so.
    pub partial: Option<f64>,
    pub partial_field: String,
}

/// One scaling object (`rope_parameters` or `rope_scaling`), named
/// `field` in errors.
struct Obj<'f, 'a> {
    f: &'f Fields<'a>,
    field: &'static str,
    m: &'a Map<String, Value>,
}

impl Obj<'_, '_> {
    fn num(&self, key: &str) -> Result<Option<f64>> {
        match self.m.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().filter(|x| x.is_finite()).map(Some).ok_or_else(|| {
                self.f.bad(
                    &format!("{}.{key}", self.field),
                    format!("expected a number, got {v}"),
                )
            }),
        }
    }

    /// A number that must be present and positive.
    fn positive(&self, key: &str, value: Option<f64>) -> Result<f64> {
        let name = format!("{}.{key}", self.field);
        match value {
            Some(x) if x > 0.0 => Ok(x),
            Some(x) => Err(self.f.bad(&name, format!("{x} must be positive"))),
            None => Err(self.f.bad(&name, "required by this rope_type")),
        }
    }

    fn req(&self, key: &str) -> Result<f64> {
        self.positive(key, self.num(key)?)
    }

    /// The pretraining context: the top-level field wins where a config
    /// has one (Phi-3's arrangement), then the scaling's own, then
    /// `max_position_embeddings`, as `standardize_rope_params` orders them.
    fn original_max(&self, max_positions: usize) -> Result<f64> {
        let top = self.f.opt_f64("original_max_position_embeddings")?;
        let own = self.num("original_max_position_embeddings")?;
        let key = "original_max_position_embeddings";
        self.positive(key, Some(top.or(own).unwrap_or(max_positions as f64)))
    }
}

/// Reads θ and the scaling of a model whose context is `max_positions`.
/// `phi3`: the scaling is Phi3Config's, which reads `su` and `yarn` as
/// `longrope` and knows no other.
pub(super) fn parse_rope(f: &Fields, max_positions: usize, phi3: bool) -> Result<RopeFields> {
    parse_rope_from(f, max_positions, phi3, 10000.0)
}

/// [`parse_rope`] for a family whose config class has another default θ
/// (SmolLM3Config's is 2000000).
pub(super) fn parse_rope_with_theta(f: &Fields, max_positions: usize, theta: f64) -> Result<RopeFields> {
    parse_rope_from(f, max_positions, false, theta)
}

/// GPT-OSS's: θ 150000, and where neither `rope_scaling` nor
/// `rope_parameters` is written, the YaRN GptOssConfig fills in (factor
/// 32 over a 4096-token original context, betas 32 and 1, untruncated).
pub(super) fn gpt_oss_rope(f: &Fields, max_positions: usize) -> Result<RopeFields> {
    let mut out = parse_rope_with_theta(f, max_positions, 150000.0)?;
    if f.get("rope_scaling").is_none() && f.get("rope_parameters").is_none() {
        let factor: f64 = 32.0;
        out.scaling = RopeScaling::Yarn {
            factor,
            original_max_positions: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            attention_factor: 0.1 * factor.ln() + 1.0,
        };
    }
    Ok(out)
}

/// RoPE per block kind: the full-attention blocks' and (where they
/// differ) the sliding blocks'. transformers v5 writes `rope_parameters`
/// per block kind (`full_attention`, `sliding_attention`); v4 wrote a
/// `rope_scaling` for the full-attention blocks only, and a `rope_theta`
/// for both (OLMo 3: `sliding_theta` `None`) or for the full-attention
/// blocks only, the sliding blocks' θ in a field of its own
/// (`sliding_theta`: that field and its default; Gemma 3's
/// `rope_local_base_freq`, 10000). `full_theta`: the config class's θ
/// where none is written (Olmo3Config's 500000, Gemma3TextConfig's 1e6).
pub(super) fn parse_kinds_rope(
    f: &Fields,
    max_positions: usize,
    full_theta: f64,
    sliding_theta: Option<(&str, f64)>,
) -> Result<(RopeFields, Option<(f64, RopeScaling)>)> {
    let per_kind = f
        .get("rope_parameters")
        .and_then(Value::as_object)
        .filter(|m| m.contains_key("full_attention") || m.contains_key("sliding_attention"));
    let Some(kinds) = per_kind else {
        let full = parse_rope_from(f, max_positions, false, full_theta)?;
        let theta = match sliding_theta {
            Some((field, default)) => f.opt_f64(field)?.unwrap_or(default),
            None => full.theta,
        };
        let sliding = (theta, RopeScaling::None);
        let differs = sliding.0 != full.theta || full.scaling != RopeScaling::None;
        return Ok((full, Some(sliding).filter(|_| differs)));
    };
    // Each kind's object read as a config whose rope_parameters it is.
    let kind = |name: &str, sliding: bool| -> Result<RopeFields> {
        let mut obj = f.obj.clone();
        obj.remove("rope_scaling");
        match kinds.get(name) {
            Some(v) => obj.insert("rope_parameters".into(), v.clone()),
            None => obj.remove("rope_parameters"),
        };
        let mut default = full_theta;
        if let (true, Some((field, d))) = (sliding, sliding_theta) {
            // The top-level θ is the full-attention blocks'.
            obj.remove("rope_theta");
            default = f.opt_f64(field)?.unwrap_or(d);
        }
        parse_rope_from(
            &Fields {
                obj: &obj,
                path: f.path,
            },
            max_positions,
            false,
            default,
        )
        .map_err(|e| match e {
            crate::ZooError::BadField { path, field, detail } => crate::ZooError::BadField {
                path,
                field: field.replacen("rope_parameters", &format!("rope_parameters.{name}"), 1),
                detail,
            },
            e => e,
        })
    };
    let (full, sliding) = (kind("full_attention", false)?, kind("sliding_attention", true)?);
    if sliding.partial.is_some_and(|p| p < 1.0) {
        return Err(f.unsupported("rope_parameters.sliding_attention with a partial rotary factor"));
    }
    let sliding = (sliding.theta, sliding.scaling);
    let differs = sliding.0 != full.theta || sliding.1 != full.scaling;
    Ok((full, Some(sliding).filter(|_| differs)))
}

fn parse_rope_from(f: &Fields, max_positions: usize, phi3: bool, default_theta: f64) -> Result<RopeFields> {
    let mut theta = f.opt_f64("rope_theta")?;
    // v5's `rope_parameters` wins over v4's `rope_scaling` where both are
    // written, as its `rope_theta` does over the top-level one.
    let mut chosen = None;
    let mut partial: Option<(f64, String)> = None;
    for field in ["rope_scaling", "rope_parameters"] {
        let Some(v) = f.get(field) else { continue };
        let m = v
            .as_object()
            .ok_or_else(|| f.bad(field, format!("expected an object, got {v}")))?;
        let obj = Obj { f, field, m };
        if let Some(t) = obj.num("rope_theta")? {
            theta = Some(t);
        }
        if let Some(p) = obj.num("partial_rotary_factor")? {
            partial = Some((p, format!("{field}.partial_rotary_factor")));
        }
        chosen = Some(obj);
    }
    // As transformers' config classes move it, the top-level factor only
    // where the scaling object has none.
    if let (None, Some(p)) = (&partial, f.opt_f64("partial_rotary_factor")?) {
        partial = Some((p, "partial_rotary_factor".into()));
    }
    if let Some((p, field)) = &partial
        && !(*p > 0.0 && *p <= 1.0)
    {
        return Err(f.bad(field, format!("{p} must be in (0, 1]")));
    }
    let (partial, partial_field) = match partial {
        Some((p, field)) => (Some(p), field),
        None => (None, "partial_rotary_factor".to_string()),
    };
    let theta = theta.unwrap_or(default_theta);
    let mut out = RopeFields {
        theta,
        scaling: RopeScaling::None,
        partial,
        partial_field,
    };
    let Some(o) = chosen else { return Ok(out) };
    let kind =
        o.m.get("rope_type")
            .or_else(|| o.m.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
    let kind = match kind {
        "su" | "yarn" if phi3 => "longrope",
        "default" | "longrope" => kind,
        other if phi3 => {
            return Err(f.unsupported(format!(
                "{} of type '{other}' for a Phi-3 model (Phi3Config knows only longrope)",
                o.field
            )));
        }
        other => other,
    };
    out.scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: o.req("factor")?,
        },
        // transformers' dynamic NTK scales past max_position_embeddings
        // itself (not the original context other types name).
        "dynamic" => RopeScaling::Dynamic {
            factor: o.req("factor")?,
            max_positions: max_positions as f64,
        },
        "llama3" => {
            let (low, high) = (o.req("low_freq_factor")?, o.req("high_freq_factor")?);
            if low >= high {
                let field = format!("{}.low_freq_factor", o.field);
                return Err(f.bad(&field, format!("{low} must be below high_freq_factor {high}")));
            }
            RopeScaling::Llama3 {
                factor: o.req("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions: o.original_max(max_positions)?,
            }
        }
        "yarn" => yarn(&o, max_positions)?,
        "longrope" => long_rope(&o, max_positions)?,
        other => {
            return Err(f.unsupported(format!(
                "{} of type '{other}' (implemented: default, linear, dynamic, llama3, yarn, longrope)",
                o.field
            )));
        }
    };
    Ok(out)
}

fn long_rope(o: &Obj, max_positions: usize) -> Result<RopeScaling> {
    let original = o.original_max(max_positions)?;
    let list = |key: &str| -> Result<std::sync::Arc<[f64]>> {
        let name = format!("{}.{key}", o.field);
        let v =
            o.m.get(key)
                .ok_or_else(|| o.f.bad(&name, "required by this rope_type"))?;
        let xs = v
            .as_array()
            .ok_or_else(|| o.f.bad(&name, format!("expected a list of numbers, got {v}")))?;
        xs.iter()
            .map(|x| match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f),
                _ => Err(o.f.bad(&name, format!("{x} is not a positive number"))),
            })
            .collect::<Result<Vec<f64>>>()
            .map(Into::into)
    };
    let (short, long) = (list("short_factor")?, list("long_factor")?);
    let factor = o.num("factor")?.unwrap_or(max_positions as f64 / original);
    let attention_factor = match o.num("attention_factor")? {
        Some(a) => o.positive("attention_factor", Some(a))?,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / original.ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope {
        short,
        long,
        original_max_positions: original,
        attention_factor,
    })
}

fn yarn(o: &Obj, max_positions: usize) -> Result<RopeScaling> {
    let original = o.original_max(max_positions)?;
    // DeepSeek-V3 leaves `factor` null: the ratio of the two contexts.
    let factor = o.positive(
        "factor",
        Some(o.num("factor")?.unwrap_or(max_positions as f64 / original)),
    )?;
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match o.num("attention_factor")? {
        Some(a) => o.positive("attention_factor", Some(a))?,
        None => match (o.num("mscale")?, o.num("mscale_all_dim")?) {
            // transformers tests both for truth: a 0 counts as absent.
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        },
    };
    let truncate = match o.m.get("truncate").filter(|v| !v.is_null()) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| {
            o.f.bad(
                &format!("{}.truncate", o.field),
                format!("expected a boolean, got {v}"),
            )
        })?,
    };
    // `or`: transformers reads `beta_fast or 32`, so a 0 means the default.
    let beta = |key: &str, default: f64| -> Result<f64> {
        let b = o.num(key)?.filter(|&b| b != 0.0).unwrap_or(default);
        o.positive(key, Some(b))
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_positions: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        truncate,
        attention_factor,
    })
}

/// The v4 `rope_scaling` object of `scaling`, for a generated
/// `config.json` (presets'; a parsed config writes back its own fields);
/// `None` for plain RoPE.
pub(super) fn scaling_json(scaling: &RopeScaling) -> Option<Value> {
    use serde_json::json;
    // Contexts are whole numbers of tokens in every config.json.
    let positions = |p: f64| json!(p as u64);
    Some(match *scaling {
        RopeScaling::None => return None,
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Dynamic { factor, .. } => json!({"rope_type": "dynamic", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": positions(original_max_positions),
        }),
        RopeScaling::Yarn {
            factor,
            original_max_positions,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
        } => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": positions(original_max_positions),
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "truncate": truncate,
            "attention_factor": attention_factor,
        }),
        RopeScaling::LongRope {
            ref short,
            ref long,
            original_max_positions,
            attention_factor,
        } => json!({
            "rope_type": "longrope",
            "short_factor": &short[..],
            "long_factor": &long[..],
            "original_max_position_embeddings": positions(original_max_positions),
            "attention_factor": attention_factor,
        }),
    })
}
