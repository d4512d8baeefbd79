//! `megatrain sample`.

use std::path::PathBuf;

use clap::Args;
use megatrain::run::{
    DeviceChoice, Encoder, Precision, Resident, RunError, SampleOptions, TransportKnobs, generate,
    resolve_model_dir,
};
use megatrain_gpu::TransportChoice;
use megatrain_tensor::Executor;
use megatrain_zoo::HfCheckpoint;

use super::device::{self, on_executor};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// HF model directory, run directory (its latest checkpoint) or checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A run's checkpoint at this step instead of the latest.
    #[arg(long)]
    step: Option<u64>,
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// auto | gpu | cpu.
    #[arg(long, default_value = "cpu")]
    device: DeviceChoice,
    /// f32 | bf16 | f16, as `train --precision`: the weights go through
    /// that transport copy; f16 also computes matmuls on f16 operands.
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

pub fn run(a: SampleArgs) -> anyhow::Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        anyhow::bail!("--temperature {}: must be a finite number ≥ 0", a.temperature);
    }
    let dir = resolve_model_dir(&a.model, a.step)?;
    let ckpt = HfCheckpoint::open(&dir)?;
    let enc = Encoder::from_dir(&dir, Some(&ckpt.config))?;
    let prompt = enc
        .tokenizer
        .encode(&a.prompt)
        .map_err(|e| anyhow::anyhow!("--prompt {:?}: {e}", a.prompt))?;
    let opts = SampleOptions {
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
    };
    let exec = device::open(a.device, TransportChoice::Auto, TransportKnobs::default(), true)?;
    let ids = on_executor!(exec, ex => {
        let mut ex = ex;
        ex.set_compute_precision(a.precision.compute())
            .map_err(|e| RunError::option("precision", a.precision, e.to_string()))?;
        let model = Resident::load_as(&ex, &ckpt, a.precision.transport())?;
        generate(&ex, &model, &prompt, opts)?
    });
    let text = enc.tokenizer.decode(&ids)?;
    println!("{}{}", a.prompt, text);
    Ok(())
}
