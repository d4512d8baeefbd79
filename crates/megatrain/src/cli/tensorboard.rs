//! `megatrain tensorboard`: a TensorBoard event file from a run's
//! `metrics.jsonl` (for a run trained without `--tensorboard`).

use std::path::PathBuf;

use clap::Args;
use megatrain::run::tensorboard::convert;

#[derive(Args, Debug)]
pub struct TensorboardArgs {
    /// Run directory (holds metrics.jsonl).
    #[arg(long)]
    run: PathBuf,
    /// Directory for the event file (created) [default: the run directory].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: TensorboardArgs) -> anyhow::Result<()> {
    let out = a.out.as_ref().unwrap_or(&a.run);
    let c = convert(&a.run, out)?;
    println!(
        "wrote {} ({} records, steps {}..{}); view it with: tensorboard --logdir {}",
        c.path.display(),
        c.records,
        c.steps.0,
        c.steps.1,
        out.display()
    );
    Ok(())
}
