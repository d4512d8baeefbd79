//! The validation loss of a run: mean cross-entropy over batches drawn
//! the same way at every evaluation, through the trainer's streamed
//! forward, split across data parallel ranks.

use std::path::Path;

use megatrain_tensor::Executor;

use super::error::Result;
use crate::data::{Batch, Sampling, TokenData, draw_rows};
use crate::dist::Collective;
use crate::trainer::Trainer;

/// Mean loss over `batches` validation batches (the same batches at every
/// evaluation, drawn from `seed`), with the trainer's streamed forward.
/// Rows of records in order count each record once: the batch that reaches
/// the last record holds no more rows than are left.
pub fn evaluate<E: Executor>(
    trainer: &Trainer<E>,
    data: &TokenData,
    name: &Path,
    batch: usize,
    seq_len: usize,
    batches: usize,
    sampling: Sampling,
) -> Result<f64> {
    let left = |i: u64| match (data.row_records(), sampling) {
        (Some(r), Sampling::Sequential) => r.len().saturating_sub(i as usize * batch).max(1),
        _ => batch,
    };
    let draw = |i, rows: std::ops::Range<usize>| {
        let rows = rows.start..rows.end.min(left(i));
        draw_rows(data, sampling, i, batch, rows, seq_len, name)
    };
    evaluate_split(trainer, draw, batch, batches, None)
}

/// [`evaluate`] of the rows `draw` gives (batch number, rows of it), split
/// across the ranks of `comm` when given: each evaluates its rows of the
/// global batch `batch` and the sums are added, so N ranks report what one
/// rank with the global batch would.
pub(super) fn evaluate_split<E: Executor>(
    trainer: &Trainer<E>,
    draw: impl Fn(u64, std::ops::Range<usize>) -> std::result::Result<Batch, crate::data::DataError>,
    batch: usize,
    batches: usize,
    comm: Option<&dyn Collective>,
) -> Result<f64> {
    let (rank, ranks) = comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let per = batch / ranks;
    let rows = rank * per..(rank + 1) * per;
    let drawn = (0..batches as u64)
        .map(|i| draw(i, rows.clone()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut x = loss_sums(trainer, &drawn)?;
    if let Some(comm) = comm {
        comm.sum_f64(&mut x)?;
    }
    Ok(mean_loss(x))
}

/// The mean loss over the targets `batches` count (NaN where they count
/// none), as [`evaluate`] reports it, of batches drawn by the caller.
pub fn evaluate_batches<E: Executor>(trainer: &Trainer<E>, batches: &[Batch]) -> Result<f64> {
    Ok(mean_loss(loss_sums(trainer, batches)?))
}

/// The summed losses of `batches` and the targets they count.
fn loss_sums<E: Executor>(trainer: &Trainer<E>, batches: &[Batch]) -> Result<[f64; 2]> {
    let mut x = [0.0, 0.0];
    for (s, c) in trainer.eval_losses(batches)? {
        x[0] += s;
        x[1] += c as f64;
    }
    Ok(x)
}

fn mean_loss([sum, count]: [f64; 2]) -> f64 {
    if count > 0.0 { sum / count } else { f64::NAN }
}
