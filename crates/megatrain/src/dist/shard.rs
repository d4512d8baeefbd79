//! The collective side of a sharded optimizer's ranges (which rank owns
//! what is [`megatrain_tier::shard`]): every rank's part of a chunk. AdamW
//! is element-wise, so an update of a range is exactly the update of the
//! whole slab restricted to it; the one per-element input that depends on
//! the position, the decay mask, is cut to the range by the trainer
//! (`trainer/optimizer.rs::part_mask`).

use std::ops::Range;

pub use megatrain_tier::shard::{shard_range, shard_ranges, shard_ranges_aligned};

/// Every rank's part of elements `chunk` of a layer cut by `ranges` (every
/// rank's range, in rank order, covering the layer): each range ∩ `chunk`,
/// re-based to `chunk.start`. The parts cover `0..chunk.len()` in rank
/// order; a rank whose range misses the chunk gets an empty part at the
/// place the order puts it, so the counts and offsets of a collective over
/// the chunk can be read straight off them.
pub fn chunk_ranges(ranges: &[Range<usize>], chunk: &Range<usize>) -> Vec<Range<usize>> {
    let cut = |x: usize| x.clamp(chunk.start, chunk.end) - chunk.start;
    ranges.iter().map(|r| cut(r.start)..cut(r.end)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_parts_tile_the_chunk_and_agree_with_the_ranges() {
        for n in [0, 1, 5, 97, 1021] {
            for size in 1..=4 {
                let rs = shard_ranges(n, size);
                for len in [1, 2, 7, 64, 2000] {
                    let mut start = 0;
                    while start < n || (n == 0 && start == 0) {
                        let chunk = start..(start + len).min(n);
                        let parts = chunk_ranges(&rs, &chunk);
                        assert_eq!(parts[0].start, 0);
                        assert_eq!(parts[size - 1].end, chunk.len());
                        for w in parts.windows(2) {
                            assert_eq!(w[0].end, w[1].start, "n {n} size {size} chunk {chunk:?}");
                        }
                        for (k, p) in parts.iter().enumerate() {
                            for i in 0..chunk.len() {
                                let g = chunk.start + i;
                                assert_eq!(p.contains(&i), rs[k].contains(&g), "rank {k} element {g}");
                            }
                        }
                        if n == 0 {
                            break;
                        }
                        start = chunk.end;
                    }
                }
            }
        }
    }
}
