//! `F16Matmul::Auto` takes the default tensor-core tile only once it has
//! matched the SIMT f16 kernel on the device, as `F16Attention::Auto` does
//! the tensor-core attention (`attention_check.rs`). Cooperative matrices
//! are an experimental feature of wgpu, and the attention built on them
//! computed garbage on an NVIDIA driver where every software build was
//! right; a product that is wrong trains, with no error, to a wrong model.
//! The check covers what a training step runs: the three layouts of a
//! linear layer's forward and backward (NT, NN, TN) with f16 and f32 B,
//! each on whole tiles and on edges, once per tile and device.

use megatrain_tensor::testing::{random_tensor, rel_norm_err};
use megatrain_tensor::{ComputePrecision, DType, Executor, Transpose};

use super::{F16Matmul, GpuExecutor, GpuOptions};
use crate::CoopTile;

/// Both families round the same f16 operands and differ only in the order
/// of their f32 sums (f16.rs holds each to 1e-3 of the host reference);
/// a wrong kernel is off by order 1.
const TOLERANCE: f64 = 1e-2;

impl GpuExecutor {
    /// Whether tensor-core tile `tile` matched the SIMT kernel on this
    /// device, checked on first asking.
    pub(crate) fn coop_matmul_checked(&self, tile: CoopTile) -> bool {
        self.ctx
            .coop_matmul_checks
            .passed(tile, || self.compare_matmul_families(tile))
    }

    fn compare_matmul_families(&self, tile: CoopTile) -> Result<(), String> {
        let s = tile.shape();
        let (bm, bn, bk) = (s.bm as usize, s.bn as usize, s.bk as usize);
        // Whole tiles (K a multiple of the K step) and edges in every
        // dimension.
        let sizes = [(2 * bm, 2 * bk, 2 * bn), (bm + 7, bk + 5, bn + 9)];
        let cases = [
            (Transpose::NT, DType::F16),
            (Transpose::NN, DType::F16),
            (Transpose::TN, DType::F32),
            (Transpose::NT, DType::F32),
        ];
        let run = |kind: F16Matmul| -> megatrain_tensor::Result<Vec<Vec<f32>>> {
            let mut g = GpuExecutor::with_options(
                self.ctx.clone(),
                GpuOptions {
                    f16_matmul: kind,
                    f16_operands: self.f16_operands,
                    ..GpuOptions::default()
                },
            );
            g.set_compute_precision(ComputePrecision::F16)?;
            let mut out = Vec::new();
            for (i, &(m, k, n)) in sizes.iter().enumerate() {
                for (j, &(t, b_dtype)) in cases.iter().enumerate() {
                    let seed = 10 * (i * cases.len() + j) as u64;
                    let a = random_tensor(seed, if t.a { [k, m] } else { [m, k] });
                    let b = random_tensor(seed + 1, if t.b { [n, k] } else { [k, n] }).to_dtype(b_dtype);
                    let c = g.matmul(&g.upload(&a)?, &g.upload(&b)?, None, t)?;
                    out.push(g.download(&c)?.to_f32_vec());
                }
            }
            Ok(out)
        };
        let failed = |e: megatrain_tensor::Error| format!("the check did not run: {e}");
        let coop = run(F16Matmul::Coop(tile)).map_err(failed)?;
        let simt = run(F16Matmul::Simt).map_err(failed)?;
        let labels = sizes.iter().flat_map(|&(m, k, n)| {
            cases
                .iter()
                .map(move |&(t, dt)| format!("{m}x{k}x{n} {}{} B {dt}", layout(t.a), layout(t.b)))
        });
        agree(&format!("tensor-core tile {}", tile.name()), labels, &coop, &simt)
    }
}

fn layout(transposed: bool) -> char {
    if transposed { 'T' } else { 'N' }
}

/// `Ok` where every product of `coop` is within [`TOLERANCE`] of the same
/// product of `simt`; else the worst, named by its label (NaN fails).
fn agree(
    what: &str,
    labels: impl Iterator<Item = String>,
    coop: &[Vec<f32>],
    simt: &[Vec<f32>],
) -> Result<(), String> {
    let errors: Vec<(String, f64)> = labels
        .zip(coop.iter().zip(simt))
        .map(|(label, (c, s))| (label, rel_norm_err(c, s)))
        .collect();
    let worst = errors
        .iter()
        .find(|e| e.1.is_nan())
        .or_else(|| errors.iter().max_by(|a, b| a.1.total_cmp(&b.1)));
    match worst {
        Some((label, e)) if e.is_nan() || *e > TOLERANCE => Err(format!(
            "{what} is off the SIMT kernel on this device ({label}: relative error {e:.2e}): \
             the SIMT kernel runs instead"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(n: usize) -> impl Iterator<Item = String> {
        (0..n).map(|i| format!("case {i}"))
    }

    #[test]
    fn products_within_rounding_agree() {
        let s = vec![vec![1.0, 2.0, 3.0], vec![-1.0, 0.5, 4.0]];
        let c = vec![vec![1.0, 2.0, 3.0001], vec![-1.0, 0.5, 4.0]];
        assert_eq!(agree("tile", labels(2), &c, &s), Ok(()));
    }

    #[test]
    fn the_worst_product_is_named_and_nan_fails() {
        let s = vec![vec![1.0, 2.0], vec![1.0, 2.0], vec![1.0, 2.0]];
        let c = vec![vec![1.0, 2.1], vec![3.0, -2.0], vec![1.0, 2.0]];
        let e = agree("tile x", labels(3), &c, &s).unwrap_err();
        assert!(e.contains("tile x") && e.contains("case 1"), "{e}");
        let c = vec![vec![1.0, 2.0], vec![f32::NAN, 2.0], vec![5.0, 2.0]];
        let e = agree("tile x", labels(3), &c, &s).unwrap_err();
        assert!(e.contains("case 1") && e.contains("NaN"), "{e}");
    }
}
