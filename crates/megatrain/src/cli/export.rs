//! `megatrain export`: a run's checkpoint as a Hugging Face directory.

use std::path::PathBuf;

use clap::Args;
use megatrain::run::{CONFIG_FILE, copy_atomic, resolve_model_dir};
use megatrain_tier::MODEL_FILE;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Run directory.
    #[arg(long)]
    run: PathBuf,
    /// Checkpoint step (default: the latest).
    #[arg(long)]
    step: Option<u64>,
    /// Output directory (created; files in it are replaced).
    #[arg(long)]
    out: PathBuf,
}

/// Files of a checkpoint that make up the HF model (the rest is optimizer
/// and run state).
const HF_FILES: &[&str] = &[
    CONFIG_FILE,
    MODEL_FILE,
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
    // The weights go last: a directory with a config but no weights does
    // not load, so an interrupted export is never mistaken for a model.
    let mut files: Vec<&str> = HF_FILES
        .iter()
        .copied()
        .filter(|f| dir.join(f).exists())
        .collect();
    files.sort_by_key(|f| *f == MODEL_FILE);
    for f in files {
        copy_atomic(&dir.join(f), &a.out.join(f))?;
    }
    println!("exported {} to {}", dir.display(), a.out.display());
    Ok(())
}
