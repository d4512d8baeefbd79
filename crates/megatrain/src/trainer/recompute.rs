//! Which blocks the backward recomputes, and which it finds kept from the
//! forward.
//!
//! The backward of a block reads what its forward saved (norm outputs,
//! q/k/v, the attention's statistics, the MLP's pre-activations): many
//! times the block's input (24× for Qwen2.5-7B). Keeping all of it for
//! every block is what a framework with the whole model resident does; a
//! streamed step keeps only every K-th block input (a checkpoint), uploads
//! each group of K blocks again and recomputes its forward before its
//! backward: a second forward (2 FLOPs a parameter a token, a quarter of
//! the step's products) and a second crossing of the bus. Where device
//! memory holds more than that, the last `keep` blocks keep their weights
//! and what their forward saved until their backward, which neither
//! uploads nor recomputes them. The last ones, because the backward
//! reaches them first: their memory is freed first, before any group is
//! recomputed, so the peak is the larger of the two, not their sum.
//! Results do not depend on the split: a recomputed forward is the same
//! ops on the same inputs, and a kept block's weights are the transport
//! copy the backward would upload (the optimizer rewrites it only once
//! the block's gradients are in).

use std::ops::Range;

/// The split of a model's blocks between kept and recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recompute {
    n_blocks: usize,
    k: usize,
    /// The first block the backward reaches (the blocks before it are
    /// frozen: [`super::TrainerConfig::frozen_layers`]).
    from: usize,
    /// The first block whose forward's saved tensors are kept.
    kept_from: usize,
}

impl Recompute {
    /// `n_blocks` blocks, checkpoints every `k` (≥ 1), the last `keep`
    /// (at most `n_blocks`) kept.
    pub fn new(n_blocks: usize, k: usize, keep: usize) -> Self {
        Self::trained_from(n_blocks, k, keep, 0)
    }

    /// [`Recompute::new`] for a backward that ends at block `from` (at
    /// most `n_blocks`: none): the blocks before it keep nothing, and the
    /// groups start at it.
    pub fn trained_from(n_blocks: usize, k: usize, keep: usize, from: usize) -> Self {
        let from = from.min(n_blocks);
        Recompute {
            n_blocks,
            k: k.max(1),
            from,
            kept_from: (n_blocks - keep.min(n_blocks)).max(from),
        }
    }

    /// Whether block `i` keeps what its forward saved.
    pub fn keeps(&self, i: usize) -> bool {
        i >= self.kept_from
    }

    /// Whether block `i`'s input is kept as a checkpoint.
    pub fn checkpoints(&self, i: usize) -> bool {
        (self.from..self.kept_from).contains(&i) && (i - self.from).is_multiple_of(self.k)
    }

    /// The blocks whose saved tensors are kept.
    pub fn kept(&self) -> Range<usize> {
        self.kept_from..self.n_blocks
    }

    /// How many checkpoints the forward keeps: one per recomputed group.
    pub fn checkpoint_count(&self) -> usize {
        (self.kept_from - self.from).div_ceil(self.k)
    }

    /// The recomputed groups of at most K blocks, first to last (the
    /// backward walks them last first), each starting at a checkpoint.
    pub fn groups(&self) -> impl DoubleEndedIterator<Item = Range<usize>> + use<> {
        let (k, from, end) = (self.k, self.from, self.kept_from);
        (0..self.checkpoint_count()).map(move |g| from + g * k..(from + (g + 1) * k).min(end))
    }

    /// The most blocks recomputed at once (0 when every block is kept).
    pub fn group_len(&self) -> usize {
        self.k.min(self.kept_from - self.from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_blocks_are_the_last_and_the_rest_group_from_checkpoints() {
        let r = Recompute::new(7, 3, 2);
        assert_eq!(r.kept(), 5..7);
        assert_eq!(r.groups().collect::<Vec<_>>(), vec![0..3, 3..5]);
        assert_eq!(r.checkpoint_count(), 2);
        let cps: Vec<usize> = (0..7).filter(|&i| r.checkpoints(i)).collect();
        assert_eq!(cps, vec![0, 3]);
        assert!((0..5).all(|i| !r.keeps(i)) && (5..7).all(|i| r.keeps(i)));
        assert_eq!(r.group_len(), 3);
        // Every block is either kept or in exactly one group.
        let mut seen: Vec<usize> = r.groups().flatten().chain(r.kept()).collect();
        seen.sort();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
    }

    #[test]
    fn nothing_kept_is_the_checkpointed_step_and_everything_kept_recomputes_nothing() {
        let none = Recompute::new(5, 2, 0);
        assert_eq!(none.kept(), 5..5);
        assert_eq!(none.groups().collect::<Vec<_>>(), vec![0..2, 2..4, 4..5]);
        assert_eq!(none.group_len(), 2);
        let all = Recompute::new(5, 2, 5);
        assert_eq!(all.kept(), 0..5);
        assert_eq!(all.groups().count(), 0);
        assert_eq!((all.checkpoint_count(), all.group_len()), (0, 0));
        assert!((0..5).all(|i| !all.checkpoints(i)));
        // More than the model's blocks keeps them all.
        assert_eq!(Recompute::new(5, 2, 9), all);
        assert_eq!(Recompute::new(0, 1, 3).groups().count(), 0);
    }

    #[test]
    fn a_backward_that_ends_early_groups_from_where_it_ends() {
        let r = Recompute::trained_from(8, 3, 1, 2);
        assert_eq!(r.kept(), 7..8);
        assert_eq!(r.groups().collect::<Vec<_>>(), vec![2..5, 5..7]);
        let cps: Vec<usize> = (0..8).filter(|&i| r.checkpoints(i)).collect();
        assert_eq!(cps, vec![2, 5]);
        assert_eq!((r.checkpoint_count(), r.group_len()), (2, 3));
        // Keeping more than the trained blocks keeps only them.
        let r = Recompute::trained_from(8, 3, 8, 6);
        assert_eq!(r.kept(), 6..8);
        assert_eq!((r.checkpoint_count(), r.group_len()), (0, 0));
        assert!((0..6).all(|i| !r.keeps(i) && !r.checkpoints(i)));
        // No block trained: nothing kept, no group.
        let r = Recompute::trained_from(4, 2, 1, 9);
        assert_eq!((r.kept(), r.groups().count()), (4..4, 0));
        assert_eq!(Recompute::trained_from(7, 3, 2, 0), Recompute::new(7, 3, 2));
    }
}
