//! `cargo xtask <task>`: repository automation.

use clap::{Parser, Subcommand};

mod bench_adamw;
mod bench_throughput;

#[derive(Parser)]
#[command(name = "xtask", about = "megatrain repository tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Runs what CI runs: fmt check, clippy, tests.
    Ci,
    /// Times the fused CPU AdamW step against a STREAM triad (memory bound).
    BenchAdamw(bench_adamw::Args),
    /// Training throughput, step split, bus, memory and overlap of the streamed trainer.
    BenchThroughput(Box<bench_throughput::Args>),
}

fn run(cmd: &mut std::process::Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "{cmd:?} failed with {status}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::BenchAdamw(args) => bench_adamw::run(args),
        Task::BenchThroughput(args) => bench_throughput::run(*args),
        Task::Ci => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            run(std::process::Command::new(&cargo).args(["fmt", "--all", "--check"]))?;
            run(std::process::Command::new(&cargo).args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))?;
            run(std::process::Command::new(&cargo).args(["test", "--workspace"]))?;
            Ok(())
        }
    }
}
