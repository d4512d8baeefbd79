//! Global gradient norm for the exact clipping mode: every gradient of the
//! model is in host memory, the norm is taken over all of them, and the
//! resulting coefficient is passed to each slab's update as `grad_scale`.

use rayon::prelude::*;

use crate::kernel;

const NORM_CHUNK: usize = 64 * 1024;

/// Σ g² over all slabs, accumulated in f64 (chunk partial sums are exact to
/// f64 rounding, so the result does not depend on the thread count beyond
/// the last few bits of an f64).
pub fn grad_norm_sq(grads: &[&[f32]]) -> f64 {
    grads
        .par_iter()
        .map(|g| g.par_chunks(NORM_CHUNK).map(kernel::sum_sq).sum::<f64>())
        .sum()
}

/// The L2 norm over all slabs together. NaN or infinity when a gradient is
/// not finite; the trainer decides what to do then.
pub fn global_grad_norm(grads: &[&[f32]]) -> f64 {
    grad_norm_sq(grads).sqrt()
}

/// PyTorch's `clip_grad_norm_` coefficient: `max_norm / (total_norm + 1e-6)`,
/// capped at 1. Pass it as [`crate::SlabUpdate::grad_scale`].
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f32 {
    (max_norm / (total_norm + 1e-6)).min(1.0) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_matches_a_sequential_f64_sum() {
        let a: Vec<f32> = (0..200_003).map(|i| ((i as f32) * 0.013).sin()).collect();
        let b: Vec<f32> = (0..7).map(|i| i as f32 - 3.0).collect();
        let empty: Vec<f32> = Vec::new();
        let want: f64 = a.iter().chain(&b).map(|&x| (x as f64) * (x as f64)).sum();
        let got = grad_norm_sq(&[&a, &empty, &b]);
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        assert!((global_grad_norm(&[&a, &b]) - want.sqrt()).abs() <= 1e-12 * want.sqrt());
        assert_eq!(grad_norm_sq(&[]), 0.0);
        assert!(global_grad_norm(&[&[1.0, f32::NAN]]).is_nan());
    }

    #[test]
    fn clip_coefficient_follows_pytorch() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        let c = clip_coefficient(4.0, 1.0);
        assert!((c as f64 - 1.0 / (4.0 + 1e-6)).abs() < 1e-7);
    }
}
