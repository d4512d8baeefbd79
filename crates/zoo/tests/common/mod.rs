//! Shared helpers of the zoo's integration tests: reading the golden files
//! written by `tools/make_golden.py`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;

pub const CASES: &[&str] = &[
    "gpt2",
    "llama_gqa",
    "llama_tied_bf16",
    "mistral_f16",
    "qwen2",
    "qwen3",
    "llama3_rope",
    "qwen2_yarn",
    "phi3",
    "olmo2",
    "phi3_longrope",
    "mistral_window",
    "qwen2_window",
    "phi3_partial",
    "qwen2_window_layers",
    "olmo3",
    "smollm3",
    "granite",
    "starcoder2",
    "llama_dynamic",
    "glm",
    "glm4",
    "exaone4",
    "phi2",
    "cohere2",
    "cohere",
    "gemma3",
    "gemma2",
    "gemma3_mm",
    "gpt_neox",
    "gpt_neox_seq",
    "gpt2_erf",
    "mixtral",
    "qwen3_moe",
    "qwen3_moe_raw",
    "mixtral_sparse",
    "olmoe",
    "mixtral_aux",
    "qwen3_moe_aux",
    "qwen2_moe",
    "gpt_oss",
    "gpt_oss_aux",
    "gpt_oss_mxfp4",
    "glm4_moe",
    "glm4_moe_plain",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "deepseek_v2",
    "deepseek_v2_lite",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "olmo_hybrid",
    "qwen3_5_mm",
    "kimi_linear",
];

pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(case)
}

/// A golden tensor widened to f64, with its shape.
#[derive(Debug, Clone)]
pub struct Golden {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

pub fn read_golden(case: &str) -> HashMap<String, Golden> {
    let path = fixture(case).join("golden.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("golden file parses");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let d = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::I32 => d
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("unexpected dtype {other:?} for {name}"),
            };
            (
                name,
                Golden {
                    shape: view.shape().to_vec(),
                    values,
                },
            )
        })
        .collect()
}
