//! The subcommands; each file parses its flags and calls the library.

mod device;
mod dist;
mod eval;
mod export;
mod plan;
mod printer;
mod progress;
mod sample;
mod tensorboard;
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
    /// Write a TensorBoard event file from a run's metrics.jsonl.
    Tensorboard(tensorboard::TensorboardArgs),
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
        Command::Tensorboard(a) => tensorboard::run(a),
    }
}

pub use megatrain::run::parse_bytes;

/// `--max-shard-size`: a size as [`parse_bytes`] reads it, at least a byte.
pub fn parse_shard_size(s: &str) -> Result<u64, String> {
    match parse_bytes(s)? {
        0 => Err(format!(
            "'{s}' is no room for a shard (give at least 1 byte, e.g. 5GB)"
        )),
        n => Ok(n),
    }
}

pub fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_is_at_least_a_byte() {
        assert_eq!(parse_shard_size("1"), Ok(1));
        assert!(parse_shard_size("0GB").unwrap_err().contains("'0GB'"));
    }
}
