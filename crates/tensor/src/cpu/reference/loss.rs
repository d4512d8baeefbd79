//! Softmax cross-entropy per row, with its logit gradient in the same pass.

use rayon::prelude::*;

use crate::cpu::Real;
use crate::{Error, Result};

/// Per-row results of [`cross_entropy`], each `[n]` but `dlogits`.
pub struct CeRows<F> {
    pub losses: Vec<F>,
    /// `[n, v]`.
    pub dlogits: Vec<F>,
    /// z·lse².
    pub z_losses: Vec<F>,
    /// lse − mean(logits): the cross-entropy against the uniform target.
    pub uniform: Vec<F>,
}

/// Softmax cross-entropy of `logits: [n, v]`, `n = targets.len()`. A row
/// whose target is `ignore_index` has every result 0 and a zero gradient
/// row; any other target outside `[0, v)` is an error naming it. With z the
/// z-loss factor, ε the label smoothing and lse the row's log-sum-exp,
/// `dlogits = grad_scale · ((1 + 2z·lse)·softmax − (1 − ε)·onehot − ε/v)`,
/// the gradient of `(1 − ε)·loss + ε·uniform + z_loss`.
pub fn cross_entropy<F: Real>(
    logits: &[F],
    targets: &[i32],
    v: usize,
    ignore_index: i32,
    grad_scale: F,
    (z, eps): (F, F),
) -> Result<CeRows<F>> {
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
    let mut z_losses = vec![F::zero(); n];
    let mut uniform = vec![F::zero(); n];
    let mut dlogits = vec![F::zero(); n * v];
    if v == 0 {
        return Ok(CeRows {
            losses,
            dlogits,
            z_losses,
            uniform,
        });
    }
    let two = F::one() + F::one();
    let vf = F::from_f64(v as f64);
    let (hot, flat) = (grad_scale * (F::one() - eps), grad_scale * (eps / vf));
    dlogits
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .zip(losses.par_iter_mut().zip(z_losses.par_iter_mut()))
        .zip(uniform.par_iter_mut().zip(targets.par_iter()))
        .for_each(|(((dr, xr), (loss, zl)), (un, &tg))| {
            if tg == ignore_index {
                return;
            }
            let mx = xr.iter().fold(F::neg_infinity(), |m, &x| m.max(x));
            let sum: F = xr.iter().map(|&x| (x - mx).exp()).sum();
            let lse = mx + sum.ln();
            let tg = tg as usize;
            *loss = lse - xr[tg];
            *zl = z * lse * lse;
            if eps != F::zero() {
                *un = lse - xr.iter().copied().sum::<F>() / vf;
            }
            let k = grad_scale * (F::one() + two * z * lse);
            for (d, &x) in dr.iter_mut().zip(xr) {
                *d = k * (x - lse).exp() - flat;
            }
            dr[tg] = dr[tg] - hot;
        });
    Ok(CeRows {
        losses,
        dlogits,
        z_losses,
        uniform,
    })
}
