//! `cargo xtask <task>`: repository automation.

use clap::{Parser, Subcommand};

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
}

fn run(cmd: &mut std::process::Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "{cmd:?} failed with {status}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
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
