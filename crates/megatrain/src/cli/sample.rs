//! `megatrain sample`.

use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use megatrain::data::{ChatTemplate, Message};
use megatrain::run::{
    Decoder, DeviceChoice, Encoder, GenerationConfig, LanguageModel, Pick, Precision, Resident, RunError,
    SampleOptions, TransportKnobs, chat_template_spec, generate_samples, generate_with, layer_device_bytes,
    resolve_model_dir,
};
use megatrain::trainer::{Trainer, TrainerConfig, load_tier_for_forwards};
use megatrain_gpu::TransportChoice;
use megatrain_tensor::{Executor, TensorMemory};
use megatrain_zoo::HfCheckpoint;

use super::device::{self, on_executor};
use super::printer::Printer;

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// HF model directory, run directory (its latest checkpoint) or checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A run's checkpoint at this step, or `best` (the lowest validation
    /// loss), instead of the latest.
    #[arg(long)]
    step: Option<Pick>,
    /// The text to continue (default a newline), or with --chat the
    /// user's message.
    #[arg(long)]
    prompt: Option<String>,
    /// --prompt from this UTF-8 file, whole (a long prompt, a document to
    /// continue).
    #[arg(long, conflicts_with = "prompt")]
    prompt_file: Option<PathBuf>,
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
    /// 0 = greedy [default: 0.8]. The five settings from here to
    /// --repetition-penalty default to what the model's
    /// generation_config.json asks for where it says do_sample (as
    /// transformers' generate reads it), else to the values shown.
    #[arg(long)]
    temperature: Option<f64>,
    /// Sample among the k most likely tokens (0 = all) [default: 200].
    #[arg(long)]
    top_k: Option<usize>,
    /// Then among the fewest of those whose probabilities sum to at least
    /// p (nucleus sampling; 1 = all of them) [default: 1].
    #[arg(long)]
    top_p: Option<f64>,
    /// Then among those at least this share as likely as the most likely
    /// (min-p sampling; 0 = all of them) [default: 0].
    #[arg(long)]
    min_p: Option<f64>,
    /// Divides the logits of ids already in the sequence (the prompt's
    /// too) where positive and multiplies them where negative, before
    /// anything else (greedy included); 1 = none, as transformers'
    /// `repetition_penalty` [default: 1].
    #[arg(long)]
    repetition_penalty: Option<f64>,
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
    /// Where the weights are while generating: uploaded once (false), or
    /// streamed from host memory a layer at a time for every forward, as
    /// training streams them (true: the device holds two blocks, the
    /// embedding, the head and the cache, so a model larger than the
    /// device generates, at one pass over the bus a token); auto streams
    /// where the weights would take more than 80% of a GPU's own memory.
    #[arg(long, default_value = "auto")]
    stream: Stream,
    /// Samples of the prompt, made together: a row each of one batch, so
    /// every forward serves them all (streamed weights cross the bus once
    /// a token for all of them). Sample i is what --seed <seed + i> makes
    /// alone; they print in turn, between lines of dashes.
    #[arg(long, default_value_t = 1, conflicts_with = "interactive")]
    samples: usize,
    /// After each reply, say on standard error how long the prompt took
    /// to its first token and how fast the rest came.
    #[arg(long)]
    timing: bool,
}

/// The line between samples (nanoGPT's `sample.py` prints the same).
const SAMPLE_RULE: &str = "---------------";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Stream {
    Auto,
    True,
    False,
}

/// The share of a GPU's own memory resident weights may take under
/// `--stream auto`; the rest is for the cache and the activations.
const RESIDENT_SHARE: f64 = 0.8;

pub fn run(mut a: SampleArgs) -> anyhow::Result<()> {
    if let Some(path) = &a.prompt_file {
        let text =
            std::fs::read(path).map_err(|e| anyhow::anyhow!("--prompt-file {}: {e}", path.display()))?;
        let text = String::from_utf8(text)
            .map_err(|e| anyhow::anyhow!("--prompt-file {}: not UTF-8 text ({e})", path.display()))?;
        a.prompt = Some(text);
    }
    let dir = resolve_model_dir(&a.model, a.step)?;
    let w = warpers(&a, &dir)?;
    if !(w.temperature.is_finite() && w.temperature >= 0.0) {
        anyhow::bail!("--temperature {}: must be a finite number ≥ 0", w.temperature);
    }
    if !(w.top_p > 0.0 && w.top_p <= 1.0) {
        anyhow::bail!("--top-p {}: must be in (0, 1]", w.top_p);
    }
    if !(0.0..=1.0).contains(&w.min_p) {
        anyhow::bail!("--min-p {}: must be in [0, 1]", w.min_p);
    }
    if !(w.repetition_penalty.is_finite() && w.repetition_penalty > 0.0) {
        anyhow::bail!(
            "--repetition-penalty {}: must be a finite number > 0",
            w.repetition_penalty
        );
    }
    if a.samples == 0 {
        anyhow::bail!("--samples 0: must be ≥ 1");
    }
    let ckpt = HfCheckpoint::open(&dir)?;
    let enc = Encoder::from_dir(&dir, Some(&ckpt.config))?;
    let stop = match a.chat {
        true => enc.stop_ids(&ckpt.config, &dir)?,
        false => Vec::new(),
    };
    let opts = SampleOptions {
        tokens: a.tokens,
        temperature: w.temperature,
        top_k: w.top_k,
        top_p: w.top_p,
        min_p: w.min_p,
        repetition_penalty: w.repetition_penalty,
        seed: a.seed,
        decodable: enc.tokenizer.vocab_size(),
        kv_cache: a.kv_cache,
    };
    let spec = chat_template_spec(&dir, a.chat_template.as_deref());
    let template = match a.chat {
        true => Some(enc.chat_template(&spec)?),
        false => None,
    };
    let exec = device::open(a.device, TransportChoice::Auto, TransportKnobs::default(), true)?;
    let chat = Chat {
        a: &a,
        enc: &enc,
        template: template.as_ref(),
        spec: &spec,
        opts,
        stop: &stop,
    };
    on_executor!(exec, ex => {
        let mut ex = ex;
        ex.set_compute_precision(a.precision.compute())
            .map_err(|e| RunError::option("precision", a.precision, e.to_string()))?;
        let transport = a.precision.transport();
        let weights: u64 = ckpt.config.layer_tables().iter().map(|t| layer_device_bytes(t, transport)).sum();
        let stream = match (a.stream, ex.tensor_memory()) {
            (Stream::True, _) => true,
            (Stream::False, _) => false,
            (Stream::Auto, TensorMemory::Device(Some(room))) => weights as f64 > RESIDENT_SHARE * room as f64,
            (Stream::Auto, _) => false,
        };
        if stream {
            if a.stream == Stream::Auto {
                eprintln!(
                    "weights: {:.2} GB, over {:.0}% of the device's memory; streaming them from host \
                     memory (one pass over the bus a token; --stream false uploads them once)",
                    weights as f64 / 1e9,
                    RESIDENT_SHARE * 100.0
                );
            }
            let tier = load_tier_for_forwards(&ckpt, transport)?;
            let cfg = ckpt.config.clone();
            // Its pages mapped while loading stay counted until it goes.
            drop(ckpt);
            chat.run(&Trainer::new(ex, cfg, tier, TrainerConfig::default())?)?;
        } else {
            let model = Resident::load_as(&ex, &ckpt, transport)?;
            drop(ckpt);
            chat.run(&model)?;
        }
    });
    Ok(())
}

/// The sampling settings: each flag given, else the model's
/// `generation_config.json` where it says `do_sample` (said on standard
/// error), else the defaults the flags' help shows.
fn warpers(a: &SampleArgs, dir: &Path) -> anyhow::Result<GenerationConfig> {
    let ours = GenerationConfig {
        temperature: 0.8,
        top_k: 200,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };
    let model = GenerationConfig::of_dir(dir)?;
    let base = model.unwrap_or(ours);
    let w = GenerationConfig {
        temperature: a.temperature.unwrap_or(base.temperature),
        top_k: a.top_k.unwrap_or(base.top_k),
        top_p: a.top_p.unwrap_or(base.top_p),
        min_p: a.min_p.unwrap_or(base.min_p),
        repetition_penalty: a.repetition_penalty.unwrap_or(base.repetition_penalty),
    };
    if let Some(g) = model {
        let mut taken = Vec::new();
        let mut say = |given: bool, what: String| {
            if !given {
                taken.push(what);
            }
        };
        say(a.temperature.is_some(), format!("temperature {}", g.temperature));
        if w.temperature > 0.0 {
            say(a.top_k.is_some(), format!("top-k {}", g.top_k));
            say(a.top_p.is_some(), format!("top-p {}", g.top_p));
            say(a.min_p.is_some(), format!("min-p {}", g.min_p));
        }
        say(
            a.repetition_penalty.is_some(),
            format!("repetition penalty {}", g.repetition_penalty),
        );
        if !taken.is_empty() {
            eprintln!(
                "sampling as {} asks: {} (flags override)",
                dir.join("generation_config.json").display(),
                taken.join(", ")
            );
        }
    }
    Ok(w)
}

/// `--timing`'s line: the prompt's forward to the first token, and the
/// tokens a second after it.
fn timing(prompt: usize, tokens: usize, first: Option<Duration>, all: Duration) -> String {
    let Some(first) = first else {
        return format!(
            "prompt of {prompt} tokens: no token in {:.3} s",
            all.as_secs_f64()
        );
    };
    let rest = (all - first).as_secs_f64();
    let rate = match tokens > 1 && rest > 0.0 {
        true => format!("{:.2} tokens/s", (tokens - 1) as f64 / rest),
        false => "-".into(),
    };
    format!(
        "prompt of {prompt} tokens: first token after {:.3} s; {} more in {rest:.3} s ({rate})",
        first.as_secs_f64(),
        tokens - 1
    )
}

/// What a generation or a conversation needs besides the model.
struct Chat<'a> {
    a: &'a SampleArgs,
    enc: &'a Encoder,
    template: Option<&'a ChatTemplate>,
    spec: &'a str,
    opts: SampleOptions,
    stop: &'a [u32],
}

impl Chat<'_> {
    fn run<E: Executor>(&self, model: &impl LanguageModel<E>) -> anyhow::Result<()> {
        let (a, enc) = (self.a, self.enc);
        let mut messages: Vec<Message> = a.system.iter().map(|s| message("system", s)).collect();
        // The ids of `user`: the conversation so far, which it joins, with
        // --chat; else the text to continue.
        let prompt_of = |messages: &mut Vec<Message>, user: &str| -> anyhow::Result<Vec<u32>> {
            let text = match self.template {
                Some(t) => {
                    messages.push(message("user", user));
                    t.generation_prompt(messages)
                        .map_err(|e| RunError::option("chat-template", self.spec, e))?
                }
                None => user.to_string(),
            };
            enc.tokenizer.encode(&text).map_err(|e| match a.chat {
                true => anyhow::anyhow!("--prompt {user:?} rendered by the chat template ({text:?}): {e}"),
                false => anyhow::anyhow!("--prompt {user:?}: {e}"),
            })
        };
        // The reply to `user`, shown as it comes (after `head`); with
        // --chat it joins the conversation, and the cache keeps what the
        // next turn's prompt shares with it.
        let mut decoder = Decoder::new(model.config(), a.kv_cache)?;
        let mut turn = |user: &str, head: &str| -> anyhow::Result<()> {
            let prompt = prompt_of(&mut messages, user)?;
            let mut printer = Printer::new(enc, std::io::stdout().lock(), head);
            let start = Instant::now();
            let mut first = None;
            let ids = generate_with(model, &mut decoder, &prompt, self.opts, self.stop, &mut |ids| {
                first.get_or_insert_with(|| start.elapsed());
                printer.update(ids)
            })?;
            let reply = enc.tokenizer.decode(&ids)?;
            printer.finish(&reply)?;
            if a.timing {
                eprintln!("{}", timing(prompt.len(), ids.len(), first, start.elapsed()));
            }
            if a.chat {
                messages.push(message("assistant", &reply));
            }
            Ok(())
        };
        if !a.interactive {
            let user = a.prompt.as_deref().unwrap_or("\n");
            let head = match a.chat {
                true => "",
                false => user,
            };
            if a.samples == 1 {
                return turn(user, head);
            }
            let prompt = prompt_of(&mut messages, user)?;
            let start = Instant::now();
            let samples = generate_samples(model, &prompt, a.samples, self.opts, self.stop)?;
            let took = start.elapsed();
            for (i, ids) in samples.iter().enumerate() {
                if i > 0 {
                    println!("{SAMPLE_RULE}");
                }
                println!("{head}{}", enc.tokenizer.decode(ids)?);
            }
            if a.timing {
                let longest = samples.iter().map(Vec::len).max().unwrap_or(0);
                eprintln!(
                    "{} samples of up to {longest} tokens after a prompt of {}: {:.3} s",
                    a.samples,
                    prompt.len(),
                    took.as_secs_f64()
                );
            }
            return Ok(());
        }
        let mut answer = |user: &str| turn(user, "");
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
        Ok(())
    }
}

fn message(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}
