//! The subcommands; each file parses its flags and calls the library.

mod device;
mod dist;
mod eval;
mod export;
mod plan;
mod progress;
mod sample;
mod train;

use clap::{Parser, Subcommand};
pub use train::Interrupted;

#[derive(Parser, Debug)]
#[command(
    name = "megatrain",
    version,
    about = "Full-precision LLM training on one GPU: fp32 weights and AdamW states in host memory, \
             layers streamed through the device"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train (or fine-tune) a model; writes checkpoints, metrics.jsonl and loss.svg to --out.
    Train(Box<train::TrainArgs>),
    /// Generate text from a model or a run's checkpoint.
    Sample(sample::SampleArgs),
    /// Loss and perplexity of a model on a data set.
    Eval(eval::EvalArgs),
    /// Copy a run's checkpoint out as a Hugging Face model directory.
    Export(export::ExportArgs),
    /// Host and device bytes a training run needs, and whether it fits.
    Plan(plan::PlanArgs),
}

/// Whether the subcommand writes its results to stdout for a reader that
/// may stop early (`megatrain plan … | head`): one that then ends the way
/// other command-line tools do, by SIGPIPE, not with a panic in `println!`.
/// Training keeps Rust's ignored SIGPIPE: under MPI its ranks talk over
/// sockets, where a closed peer must be an error, not a signal.
pub fn prints_for_a_pipe(cli: &Cli) -> bool {
    !matches!(cli.command, Command::Train(_))
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Sample(a) => sample::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Export(a) => export::run(a),
        Command::Plan(a) => plan::run(a),
    }
}

/// `24G`, `1.5GiB`, `800M`, `1024` (bytes); K/M/G/T are powers of 1024.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 24G, 512M, 1073741824)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit '{other}' in '{s}' (use K, M, G or T)")),
    };
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("'{s}' is not a size"));
    }
    Ok((n * mult as f64) as u64)
}

pub fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}
