//! Multimodal checkpoints whose text model megatrain trains alone: Gemma
//! 3's `Gemma3ForConditionalGeneration` (the 4B, 12B and 27B releases) and
//! Qwen3.5's `Qwen3_5ForConditionalGeneration` and
//! `Qwen3_5MoeForConditionalGeneration` (every Qwen3.5 release). The
//! `config.json` nests the text model's config under `text_config`, which
//! the hub's files may write only in part; the safetensors hold the text
//! stack under `language_model.` (Gemma 3's; `model.language_model.` in
//! some transformers 4.5x saves, and Qwen3.5's) beside a vision tower and a
//! projector.
//!
//! The text config read here is the text model's own (`Gemma3ForCausalLM`),
//! so run checkpoints and exports are that text model: transformers loads
//! them as `Gemma3ForCausalLM`, and the vision tower and projector are in
//! neither (the source checkpoint still has them).

use serde_json::{Map, Value, json};

use super::Fields;
use crate::{Result, ZooError};

/// A multimodal class whose text model loads: its name, the text model's
/// class and model type, and the text config class's defaults for the
/// shape fields a nested config may leave out.
pub(super) type TextOf = (
    &'static str,
    &'static str,
    &'static str,
    &'static [(&'static str, u64)],
);

const TEXT_OF: &[TextOf] = &[
    (
        "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM",
        "gemma3_text",
        &[
            ("vocab_size", 262_208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
        ],
    ),
    (
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        &[
            ("vocab_size", 248_320),
            ("hidden_size", 4096),
            ("intermediate_size", 12288),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 16),
            ("num_key_value_heads", 4),
        ],
    ),
    (
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        &[
            ("vocab_size", 248_320),
            ("hidden_size", 2048),
            ("num_hidden_layers", 40),
            ("num_attention_heads", 16),
            ("num_key_value_heads", 2),
        ],
    ),
];

/// The multimodal class `f` names, if it is one whose text model loads.
pub(super) fn multimodal_class(f: &Fields) -> Option<&'static TextOf> {
    let name = f.get("architectures")?.as_array()?.first()?.as_str()?;
    TEXT_OF.iter().find(|(mm, ..)| *mm == name)
}

/// The text model's config as its own `config.json` would be: `text_config`
/// with the class defaults written out, its class and model type, and the
/// outer config's token ids, dtype and tying where it has none of its own.
pub(super) fn text_config(f: &Fields, &(class, text_class, text_type, defaults): &TextOf) -> Result<Value> {
    let nested = f.get("text_config").ok_or_else(|| ZooError::MissingField {
        path: f.path.to_path_buf(),
        field: "text_config",
    })?;
    let mut text: Map<String, Value> = nested
        .as_object()
        .ok_or_else(|| f.bad("text_config", format!("expected an object, got {nested}")))?
        .clone();
    if let Some(t) = text.get("model_type").and_then(Value::as_str)
        && t != text_type
    {
        return Err(f.unsupported(format!(
            "text_config.model_type '{t}' in a {class} (its text model is {text_type})"
        )));
    }
    for &(field, default) in defaults {
        text.entry(field).or_insert(json!(default));
    }
    for field in [
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "dtype",
        "torch_dtype",
    ] {
        if let (false, Some(v)) = (text.contains_key(field), f.obj.get(field)) {
            text.insert(field.into(), v.clone());
        }
    }
    text.insert("architectures".into(), json!([text_class]));
    text.insert("model_type".into(), json!(text_type));
    Ok(Value::Object(text))
}

/// Where a multimodal checkpoint keeps the text model's tensor `name`
/// (`model.…` or `lm_head.…`), in the order a loader should look.
pub(crate) fn checkpoint_names(name: &str) -> Vec<String> {
    match name.strip_prefix("model.") {
        Some(rest) => vec![
            format!("language_model.model.{rest}"),
            format!("model.language_model.{rest}"),
        ],
        None => vec![format!("language_model.{name}"), name.to_string()],
    }
}
