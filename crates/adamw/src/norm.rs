//! Global gradient norm for the exact clipping mode: every gradient of the
//! model is in host memory, the norm is taken over all of them, and the
//! resulting coefficient is passed to each slab's update as `grad_scale`.

use rayon::prelude::*;

use crate::kernel;

/// Elements of a gradient whose squares are summed together, in order,
/// before the blocks' sums are added.
pub const NORM_BLOCK: usize = 64 * 1024;

/// Σ g² of one slab's gradient block by block ([`NORM_BLOCK`] elements
/// each, the last maybe fewer), each block in f64 in one pass
/// (`kernel::sum_sq`), the blocks' sums then added in order. A norm taken
/// as a gradient arrives in chunks sums each block whose elements have all
/// arrived at once, while they are in cache ([`BlockNorms::note`]), and
/// the others at the end ([`BlockNorms::finish`]): the same bits whatever
/// the chunks, the thread count or how rayon splits the work.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockNorms {
    block: usize,
    numel: usize,
    sums: Vec<Option<f64>>,
}

impl BlockNorms {
    /// Nothing summed yet of a gradient of `numel` elements.
    pub fn new(numel: usize) -> Self {
        Self::with_block(numel, NORM_BLOCK)
    }

    /// The same with blocks of `block` elements (at least 1).
    pub fn with_block(numel: usize, block: usize) -> Self {
        let block = block.max(1);
        BlockNorms {
            block,
            numel,
            sums: vec![None; numel.div_ceil(block)],
        }
    }

    /// Elements `r` of `g`, the whole gradient, are final: every block
    /// that lies in them is summed now (in parallel).
    ///
    /// # Panics
    /// Where `g` is not `numel` long or `r` runs past it.
    pub fn note(&mut self, g: &[f32], r: std::ops::Range<usize>) {
        assert!(
            g.len() == self.numel && r.end <= self.numel,
            "note of {r:?} in {} of {}",
            g.len(),
            self.numel
        );
        let first = r.start.div_ceil(self.block);
        // A block ends at a multiple of `block`, or at the gradient's end.
        let end = match r.end == self.numel {
            true => self.sums.len(),
            false => r.end / self.block,
        };
        if first >= end {
            return;
        }
        let block = self.block;
        let (lo, hi) = (first * block, (end * block).min(self.numel));
        let sums: Vec<f64> = g[lo..hi].par_chunks(block).map(kernel::sum_sq).collect();
        for (s, x) in self.sums[first..end].iter_mut().zip(sums) {
            *s = Some(x);
        }
    }

    /// Σ g² of `g`, the whole gradient: the blocks not summed yet summed
    /// now, then all of them added in order.
    ///
    /// # Panics
    /// Where `g` is not `numel` long.
    pub fn finish(&self, g: &[f32]) -> f64 {
        assert_eq!(g.len(), self.numel, "finish of a gradient of another length");
        let parts: Vec<f64> = g
            .par_chunks(self.block)
            .zip(self.sums.par_iter())
            .map(|(b, s)| s.unwrap_or_else(|| kernel::sum_sq(b)))
            .collect();
        parts.iter().sum()
    }
}

/// Σ g² of each slab, as [`BlockNorms::finish`] takes it with nothing
/// summed before.
pub fn grad_norms_sq(grads: &[&[f32]]) -> Vec<f64> {
    grads.iter().map(|g| BlockNorms::new(g.len()).finish(g)).collect()
}

/// Σ g² over all slabs: [`grad_norms_sq`]'s sums added in slab order.
pub fn grad_norm_sq(grads: &[&[f32]]) -> f64 {
    grad_norms_sq(grads).iter().sum()
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

    /// Blocks summed as chunks arrive, whatever the chunks, give the bits
    /// of summing the whole at the end.
    #[test]
    fn blocks_noted_as_chunks_arrive_sum_to_the_same_bits() {
        let g: Vec<f32> = (0..1000)
            .map(|i| ((i as f32) * 0.71).sin() * (1.0 + (i % 13) as f32))
            .collect();
        for block in [1, 7, 64, 999, 1000, 4096] {
            let whole = BlockNorms::with_block(g.len(), block).finish(&g);
            for chunk in [1, 5, 7, 100, 333, 1000] {
                let mut n = BlockNorms::with_block(g.len(), block);
                let mut at = 0;
                while at < g.len() {
                    let end = (at + chunk).min(g.len());
                    n.note(&g, at..end);
                    at = end;
                }
                // Every block has arrived whole at some point only where
                // chunks are multiples of blocks; the others are summed now.
                let all_noted = chunk % block == 0 || chunk >= g.len();
                assert_eq!(
                    n.sums.iter().all(Option::is_some),
                    all_noted,
                    "block {block} chunk {chunk}"
                );
                assert_eq!(
                    n.finish(&g).to_bits(),
                    whole.to_bits(),
                    "block {block} chunk {chunk}"
                );
            }
            let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
            assert!((whole - want).abs() <= 1e-12 * want);
        }
        // Noting nothing, or everything at once.
        let mut n = BlockNorms::with_block(10, 4);
        n.note(&g[..10], 0..0);
        assert!(n.sums.iter().all(Option::is_none));
        n.note(&g[..10], 3..10);
        assert_eq!(
            n.sums,
            [
                None,
                Some(kernel::sum_sq(&g[4..8])),
                Some(kernel::sum_sq(&g[8..10]))
            ]
        );
    }

    #[test]
    fn norms_do_not_depend_on_the_thread_count() {
        let a: Vec<f32> = (0..1_000_003)
            .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 97) as f32))
            .collect();
        let b: Vec<f32> = (0..70_001).map(|i| ((i as f32) * 1.3).cos()).collect();
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| (grad_norms_sq(&[&a, &b]), grad_norm_sq(&[&a, &b])))
        };
        let (one, total) = on(1);
        for threads in [2, 3, 7] {
            let (many, t) = on(threads);
            assert_eq!(
                many.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{threads} threads"
            );
            assert_eq!(t.to_bits(), total.to_bits());
        }
        assert_eq!(total.to_bits(), (one[0] + one[1]).to_bits());
    }

    #[test]
    fn clip_coefficient_follows_pytorch() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        let c = clip_coefficient(4.0, 1.0);
        assert!((c as f64 - 1.0 / (4.0 + 1e-6)).abs() < 1e-7);
    }
}
