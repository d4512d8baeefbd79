//! `megatrain sample`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use megatrain::data::Message;
use megatrain::run::{
    Decoder, DeviceChoice, Encoder, Precision, Resident, RunError, SampleOptions, TransportKnobs,
    chat_template_spec, generate_with, resolve_model_dir,
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
    /// The text to continue (default a newline), or with --chat the
    /// user's message.
    #[arg(long)]
    prompt: Option<String>,
    /// Take --prompt as a user's message: render it with the chat template
    /// and print the model's reply, which ends at an end-of-turn id.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: a conversation. After the reply to --prompt (where
    /// given), each line of standard input is the user's next message,
    /// answered with the conversation so far, until the input ends; the
    /// cache keeps what the turns share, so a turn runs only its new tokens.
    #[arg(long, requires = "chat")]
    interactive: bool,
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
    /// Then among the fewest of those whose probabilities sum to at least
    /// p (nucleus sampling; 1 = all of them).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// auto | gpu | cpu.
    #[arg(long, default_value = "cpu")]
    device: DeviceChoice,
    /// f32 | bf16 | f16, as `train --precision`: the weights go through
    /// that transport copy; f16 also computes matmuls on f16 operands.
    #[arg(long, default_value = "f32")]
    precision: Precision,
    /// Keep what each block needs of the positions so far (keys and
    /// values, a Gated DeltaNet's state) for the next token (true), or
    /// re-run every position for every token (false: slower, for
    /// comparison).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    kv_cache: bool,
}

pub fn run(a: SampleArgs) -> anyhow::Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        anyhow::bail!("--temperature {}: must be a finite number ≥ 0", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        anyhow::bail!("--top-p {}: must be in (0, 1]", a.top_p);
    }
    let dir = resolve_model_dir(&a.model, a.step)?;
    let ckpt = HfCheckpoint::open(&dir)?;
    let enc = Encoder::from_dir(&dir, Some(&ckpt.config))?;
    let stop = match a.chat {
        true => enc.stop_ids(&ckpt.config, &dir)?,
        false => Vec::new(),
    };
    let opts = SampleOptions {
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        decodable: enc.tokenizer.vocab_size(),
        kv_cache: a.kv_cache,
    };
    let spec = chat_template_spec(&dir, a.chat_template.as_deref());
    let template = match a.chat {
        true => Some(enc.chat_template(&spec)?),
        false => None,
    };
    let mut messages: Vec<Message> = a.system.iter().map(|s| message("system", s)).collect();
    let exec = device::open(a.device, TransportChoice::Auto, TransportKnobs::default(), true)?;
    on_executor!(exec, ex => {
        let mut ex = ex;
        ex.set_compute_precision(a.precision.compute())
            .map_err(|e| RunError::option("precision", a.precision, e.to_string()))?;
        let model = Resident::load_as(&ex, &ckpt, a.precision.transport())?;
        let mut decoder = Decoder::new(&model, a.kv_cache)?;
        // The reply to `user`: to the conversation so far, which it joins,
        // with --chat; else the continuation of the text.
        let mut turn = |user: &str| -> anyhow::Result<String> {
            let text = match &template {
                Some(t) => {
                    messages.push(message("user", user));
                    t.generation_prompt(&messages)
                        .map_err(|e| RunError::option("chat-template", &spec, e))?
                }
                None => user.to_string(),
            };
            let prompt = enc.tokenizer.encode(&text).map_err(|e| match a.chat {
                true => anyhow::anyhow!("--prompt {user:?} rendered by the chat template ({text:?}): {e}"),
                false => anyhow::anyhow!("--prompt {user:?}: {e}"),
            })?;
            let ids = generate_with(&ex, &model, &mut decoder, &prompt, opts, &stop)?;
            let reply = enc.tokenizer.decode(&ids)?;
            if a.chat {
                messages.push(message("assistant", &reply));
            }
            Ok(reply)
        };
        if !a.interactive {
            let user = a.prompt.as_deref().unwrap_or("\n");
            let reply = turn(user)?;
            match a.chat {
                true => println!("{reply}"),
                false => println!("{user}{reply}"),
            }
            return Ok(());
        }
        let mut answer = |user: &str| -> anyhow::Result<()> {
            println!("{}", turn(user)?);
            Ok(std::io::stdout().flush()?)
        };
        if let Some(p) = &a.prompt {
            answer(p)?;
        }
        let stdin = std::io::stdin();
        let ask = || {
            if stdin.is_terminal() {
                eprint!("> ");
            }
        };
        ask();
        for line in stdin.lock().lines() {
            let line = line.map_err(|e| anyhow::anyhow!("standard input: {e}"))?;
            if !line.trim().is_empty() {
                answer(line.trim_end())?;
            }
            ask();
        }
    });
    Ok(())
}

fn message(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}
