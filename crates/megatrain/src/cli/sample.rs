//! `megatrain sample`.

use std::path::PathBuf;

use clap::Args;
use megatrain::data::Message;
use megatrain::run::{
    DeviceChoice, Encoder, Precision, Resident, RunError, SampleOptions, TransportKnobs, chat_template_spec,
    generate_until, resolve_model_dir,
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
    /// Take --prompt as a user's message: render it with the chat template
    /// and print the model's reply, which ends at an end-of-turn id.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: the template, as `train --chat-template` (default: the
    /// run's, for a run's checkpoint; else auto).
    #[arg(long, requires = "chat")]
    chat_template: Option<String>,
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
    /// Keep each block's keys and values for the next token (true), or
    /// re-run every position for every token (false: slower, for
    /// comparison). Models with linear-attention blocks always re-run.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    kv_cache: bool,
}

pub fn run(a: SampleArgs) -> anyhow::Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        anyhow::bail!("--temperature {}: must be a finite number ≥ 0", a.temperature);
    }
    let dir = resolve_model_dir(&a.model, a.step)?;
    let ckpt = HfCheckpoint::open(&dir)?;
    let enc = Encoder::from_dir(&dir, Some(&ckpt.config))?;
    let text = match a.chat {
        true => chat_prompt(&a, &enc, &dir)?,
        false => a.prompt.clone(),
    };
    let stop = match a.chat {
        true => enc.stop_ids(&ckpt.config, &dir)?,
        false => Vec::new(),
    };
    let prompt = enc.tokenizer.encode(&text).map_err(|e| match a.chat {
        true => anyhow::anyhow!(
            "--prompt {:?} rendered by the chat template ({text:?}): {e}",
            a.prompt
        ),
        false => anyhow::anyhow!("--prompt {:?}: {e}", a.prompt),
    })?;
    let opts = SampleOptions {
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        decodable: enc.tokenizer.vocab_size(),
        kv_cache: a.kv_cache,
    };
    let exec = device::open(a.device, TransportChoice::Auto, TransportKnobs::default(), true)?;
    let ids = on_executor!(exec, ex => {
        let mut ex = ex;
        ex.set_compute_precision(a.precision.compute())
            .map_err(|e| RunError::option("precision", a.precision, e.to_string()))?;
        let model = Resident::load_as(&ex, &ckpt, a.precision.transport())?;
        generate_until(&ex, &model, &prompt, opts, &stop)?
    });
    let reply = enc.tokenizer.decode(&ids)?;
    match a.chat {
        true => println!("{reply}"),
        false => println!("{}{}", a.prompt, reply),
    }
    Ok(())
}

/// The chat template's generation prompt for `--system` and `--prompt`.
fn chat_prompt(a: &SampleArgs, enc: &Encoder, dir: &std::path::Path) -> anyhow::Result<String> {
    let spec = chat_template_spec(dir, a.chat_template.as_deref());
    let message = |role: &str, content: &str| Message {
        role: role.into(),
        content: content.into(),
    };
    let mut messages: Vec<Message> = a.system.iter().map(|s| message("system", s)).collect();
    messages.push(message("user", &a.prompt));
    enc.chat_template(&spec)?
        .generation_prompt(&messages)
        .map_err(|e| RunError::option("chat-template", &spec, e).into())
}
