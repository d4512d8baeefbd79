//! Writes HF exports for `tools/check_export.py` to load with transformers.
//!
//! For every golden fixture (loaded, then exported as f32; `qwen2` also as
//! bf16) and for the `llama-tiny` and `gpt2-nano` presets (seeded random
//! init), writes `<out>/<name>/` with `config.json`, the safetensors weights
//! and `rust_logits.safetensors`: the input ids and the logits megatrain's
//! `CpuExecutor` computes for them (plus the golden transformers logits for
//! fixtures).
//!
//! cargo run -p megatrain-zoo --example export_check -- <out-dir>

use std::path::{Path, PathBuf};

use megatrain_tensor::{CpuExecutor, DType, ParamTable};
use megatrain_zoo::{
    ExportOptions, ModelConfig, export_hf_dir, forward_logits, init_layer, load_hf_dir, preset,
};
use safetensors::tensor::{Dtype, TensorView};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn le_bytes<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[allow(clippy::too_many_arguments)]
fn write_logits(
    dir: &Path,
    cfg: &ModelConfig,
    tables: &[ParamTable],
    slabs: &[Vec<f32>],
    ids: &[u32],
    batch: usize,
    seq: usize,
    golden: Option<(Vec<usize>, Vec<u8>)>,
) -> AnyResult<()> {
    let ex = CpuExecutor::new();
    let weights: Vec<_> = tables
        .iter()
        .zip(slabs)
        .map(|(t, s)| megatrain_zoo::upload_layer(&ex, t, s))
        .collect::<Result<_, _>>()?;
    let logits = forward_logits(cfg, &ex, &weights, ids, batch, seq)?;
    let logits = logits.data().to_vec();
    let ids_b = le_bytes(ids, |x| (x as i32).to_le_bytes().to_vec());
    let lg_b = le_bytes(&logits, |x| x.to_le_bytes().to_vec());
    let mut views = vec![
        (
            "input_ids".to_string(),
            TensorView::new(Dtype::I32, vec![batch, seq], &ids_b)?,
        ),
        (
            "logits".to_string(),
            TensorView::new(Dtype::F32, vec![batch, seq, cfg.vocab_size], &lg_b)?,
        ),
    ];
    if let Some((shape, bytes)) = &golden {
        views.push((
            "golden_logits".to_string(),
            TensorView::new(Dtype::F64, shape.clone(), bytes)?,
        ));
    }
    safetensors::serialize_to_file(views, None, &dir.join("rust_logits.safetensors"))?;
    Ok(())
}

fn main() -> AnyResult<()> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: export_check <out-dir>")?);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let cases = [
        "gpt2",
        "llama_gqa",
        "llama_tied_bf16",
        "mistral_f16",
        "qwen2",
        "qwen3",
        "phi3",
        "olmo2",
        "mistral_window",
        "qwen2_window_layers",
        "phi3_partial",
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
        "qwen3_5_mm",
        "gpt_neox",
        "gpt_neox_seq",
        "gpt2_erf",
        "mixtral",
        "mixtral_sparse",
        "qwen3_moe",
        "qwen3_moe_raw",
        "olmoe",
        "qwen2_moe",
        "gpt_oss",
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
        "kimi_linear",
    ];
    let mut jobs: Vec<(String, &str, DType)> =
        cases.iter().map(|c| (c.to_string(), *c, DType::F32)).collect();
    jobs.push(("qwen2_bf16".into(), "qwen2", DType::BF16));
    for (name, case, dtype) in jobs {
        let m = load_hf_dir(fixtures.join(case))?;
        let dir = out.join(&name);
        let slabs: Vec<&[f32]> = m.slabs.iter().map(Vec::as_slice).collect();
        let opts = ExportOptions {
            dtype,
            max_shard_bytes: None,
        };
        export_hf_dir(&dir, &m.config, &m.tables, &slabs, opts)?;
        let golden_bytes = std::fs::read(fixtures.join(case).join("golden.safetensors"))?;
        let golden = safetensors::SafeTensors::deserialize(&golden_bytes)?;
        let ids_v = golden.tensor("input_ids")?;
        let (batch, seq) = (ids_v.shape()[0], ids_v.shape()[1]);
        let ids: Vec<u32> = ids_v
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        let gl = golden.tensor("logits")?;
        // The bf16 export rounds f32 weights: compare it with Rust logits of
        // the rounded weights, not with the golden ones.
        let (slabs, golden) = if dtype == DType::F32 {
            (m.slabs.clone(), Some((gl.shape().to_vec(), gl.data().to_vec())))
        } else {
            (load_hf_dir(&dir)?.slabs, None)
        };
        write_logits(&dir, &m.config, &m.tables, &slabs, &ids, batch, seq, golden)?;
        println!("{name}: exported to {}", dir.display());
    }
    for (name, cfg) in [
        ("llama-tiny", preset("llama-tiny", None)?),
        ("gpt2-nano", preset("gpt2-nano", Some(65))?),
        ("mixtral-tiny", preset("mixtral-tiny", None)?),
    ] {
        let tables = cfg.layer_tables();
        let slabs: Vec<Vec<f32>> = (0..cfg.num_layers_total())
            .map(|l| init_layer(&cfg, l, 42))
            .collect::<Result<_, _>>()?;
        let dir = out.join(name);
        let refs: Vec<&[f32]> = slabs.iter().map(Vec::as_slice).collect();
        export_hf_dir(&dir, &cfg, &tables, &refs, ExportOptions::default())?;
        let (batch, seq) = (2, 24);
        let ids: Vec<u32> = (0..batch * seq)
            .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
            .collect();
        write_logits(&dir, &cfg, &tables, &slabs, &ids, batch, seq, None)?;
        println!("{name}: exported to {}", dir.display());
    }
    Ok(())
}
