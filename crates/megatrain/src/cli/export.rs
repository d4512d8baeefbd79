//! `megatrain export`: a run's checkpoint as a Hugging Face directory.

use std::path::PathBuf;

use clap::Args;
use megatrain::run::{CONFIG_FILE, Pick, copy_atomic, resolve_model_dir};
use megatrain_tensor::DType;
use megatrain_tier::MODEL_FILE;
use megatrain_zoo::{INDEX_FILE, ModelConfig, hf_dtype, reshard_safetensors};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Run directory.
    #[arg(long)]
    run: PathBuf,
    /// A run's checkpoint at this step, or `best` (the lowest validation
    /// loss), instead of the latest.
    #[arg(long)]
    step: Option<Pick>,
    /// Output directory (created; files in it are replaced).
    #[arg(long)]
    out: PathBuf,
    /// The weights' dtype: f32 (the checkpoint's own, copied) | bf16 | f16
    /// (rounded to nearest even: half the bytes, as models are published).
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Most bytes of weights per file, e.g. 5GB, 2GiB (default: one
    /// file): shards `model-00001-of-0000N.safetensors` and their index,
    /// as the Hub publishes large models.
    #[arg(long, value_parser = super::parse_shard_size)]
    max_shard_size: Option<u64>,
}

/// Files of a checkpoint that make up the HF model beside its weights (the
/// rest is optimizer and run state).
const HF_FILES: &[&str] = &[
    CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "char_vocab.json",
];

pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    if !a.run.join(megatrain_tier::LATEST_FILE).exists() {
        anyhow::bail!("--run {}: not a run directory (no 'latest')", a.run.display());
    }
    let dir = resolve_model_dir(&a.run, a.step)?;
    std::fs::create_dir_all(&a.out).map_err(|e| anyhow::anyhow!("--out {}: {e}", a.out.display()))?;
    let files: Vec<&str> = HF_FILES
        .iter()
        .copied()
        .filter(|f| dir.join(f).exists())
        .collect();
    for f in &files {
        let (from, to) = (dir.join(f), a.out.join(f));
        if *f == CONFIG_FILE && a.dtype != DType::F32 {
            let json = ModelConfig::from_dir(&dir)?.to_hf_json(hf_dtype(a.dtype));
            let text = serde_json::to_string_pretty(&json).expect("json");
            megatrain_tier::atomic::write_atomic(&to, text.as_bytes())?;
        } else {
            copy_atomic(&from, &to)?;
        }
    }
    // The weights go last: a directory with a config but no weights does
    // not load, so an interrupted export is never mistaken for a model.
    let weights = reshard_safetensors(&dir.join(MODEL_FILE), &a.out, a.dtype, a.max_shard_size)?;
    let held = match weights.len() {
        1 => MODEL_FILE.to_string(),
        n => format!("{} shards and {INDEX_FILE}", n - 1),
    };
    println!(
        "exported {} to {}: {} files ({} weights in {held})",
        dir.display(),
        a.out.display(),
        files.len() + weights.len(),
        hf_dtype(a.dtype)
    );
    Ok(())
}
