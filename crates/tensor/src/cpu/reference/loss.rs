//! Softmax cross-entropy per row, with its logit gradient in the same pass.

use rayon::prelude::*;

use crate::cpu::Real;
use crate::{Error, Result};

/// Returns `(losses [n], dlogits [n, v])` for `logits: [n, v]`, `n =
/// targets.len()`. A row whose target is `ignore_index` has loss 0 and a
/// zero gradient row; any other target outside `[0, v)` is an error naming
/// it. `dlogits = grad_scale · (softmax − onehot)`.
pub fn cross_entropy<F: Real>(
    logits: &[F],
    targets: &[i32],
    v: usize,
    ignore_index: i32,
    grad_scale: F,
) -> Result<(Vec<F>, Vec<F>)> {
    let n = targets.len();
    assert_eq!(logits.len(), n * v, "cross_entropy: logits length");
    if let Some((row, &tg)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &tg)| tg != ignore_index && (tg < 0 || tg as usize >= v))
    {
        return Err(Error::invalid(
            "cross_entropy",
            format!(
                "target {tg} at row {row} is outside the vocabulary of {v} (ignore_index is {ignore_index})"
            ),
        ));
    }
    let mut losses = vec![F::zero(); n];
    let mut dlogits = vec![F::zero(); n * v];
    if v == 0 {
        return Ok((losses, dlogits));
    }
    dlogits
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .zip(losses.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|(((dr, xr), loss), &tg)| {
            if tg == ignore_index {
                return;
            }
            let mx = xr.iter().fold(F::neg_infinity(), |m, &x| m.max(x));
            let sum: F = xr.iter().map(|&x| (x - mx).exp()).sum();
            let lse = mx + sum.ln();
            let tg = tg as usize;
            *loss = lse - xr[tg];
            for (d, &x) in dr.iter_mut().zip(xr) {
                *d = grad_scale * (x - lse).exp();
            }
            dr[tg] = dr[tg] - grad_scale;
        });
    Ok((losses, dlogits))
}
