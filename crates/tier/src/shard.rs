//! Which part of each layer a rank owns when the optimizer is sharded
//! (ZeRO-1/2), and what that part keeps resident.
//!
//! A layer's flat slab of `n` elements is cut into `size` contiguous ranges
//! whose lengths differ by at most one, whatever `n` is, so no layer size
//! has to be divisible by the number of ranks. A layer spilled to disk is
//! cut on whole pages instead ([`shard_ranges_aligned`]): its rank reads and
//! writes only its own range of the spill files, with direct I/O, which
//! wants page-aligned offsets. [`layer_ranges`] is that rule, the one every
//! rank and the tier's placement use.

use std::ops::Range;

use crate::buf::{PAGE, padded_bytes};

/// This process's place in a sharded optimizer: rank `rank` of `ranks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
}

/// Rank `rank`'s range of `n` elements split over `size` ranks.
pub fn shard_range(n: usize, rank: usize, size: usize) -> Range<usize> {
    let at = |r: usize| ((n as u128 * r as u128) / size as u128) as usize;
    at(rank)..at(rank + 1)
}

/// Every rank's range, in rank order.
pub fn shard_ranges(n: usize, size: usize) -> Vec<Range<usize>> {
    shard_ranges_aligned(n, size, 1)
}

/// Every rank's range, in rank order, each starting on a multiple of
/// `align` elements (the last ends at `n`): the balanced cut of
/// [`shard_range`] with each boundary moved to the nearest multiple, so
/// each length is within `align` of n / size. A layer shorter than `align`
/// per rank leaves some ranks nothing.
pub fn shard_ranges_aligned(n: usize, size: usize, align: usize) -> Vec<Range<usize>> {
    let align = align.max(1);
    let at = |r: usize| {
        let x = shard_range(n, r, size).start;
        ((x + align / 2) / align * align).min(n)
    };
    (0..size)
        .map(|r| at(r)..if r + 1 == size { n } else { at(r + 1) })
        .collect()
}

/// Every rank's range of a layer of `n` elements: on whole pages of f32
/// where the layer is spilled, balanced otherwise.
pub fn layer_ranges(n: usize, spilled: bool, ranks: usize) -> Vec<Range<usize>> {
    match spilled {
        true => shard_ranges_aligned(n, ranks, PAGE / 4),
        false => shard_ranges(n, ranks),
    }
}

/// Resident bytes of one f32 block (p, m or v) of a layer of `n` elements
/// in RAM on the rank with the largest range: its whole pages, plus the one
/// a range boundary can straddle, never more than the whole block.
pub fn resident_block_bytes(n: usize, ranks: usize) -> u64 {
    let whole = padded_bytes(n, 4);
    if ranks <= 1 {
        return whole;
    }
    let own = layer_ranges(n, false, ranks)
        .iter()
        .map(|r| r.len())
        .max()
        .unwrap_or(0);
    if own == 0 {
        return 0;
    }
    (((own * 4).div_ceil(PAGE) as u64 + 1) * PAGE as u64).min(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_slab_in_order_and_balance() {
        for n in [0, 1, 2, 7, 10, 1001] {
            for size in 1..=5 {
                let rs = shard_ranges(n, size);
                assert_eq!(rs[0].start, 0);
                assert_eq!(rs[size - 1].end, n);
                for w in rs.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "n {n} size {size}");
                }
                let (lo, hi) = (
                    rs.iter().map(|r| r.len()).min().unwrap(),
                    rs.iter().map(|r| r.len()).max().unwrap(),
                );
                assert!(hi - lo <= 1, "n {n} size {size}: {rs:?}");
            }
        }
    }

    #[test]
    fn aligned_ranges_cover_the_slab_on_multiples_and_balance() {
        for n in [0, 1, 1023, 1024, 5000, 4096 * 3 + 17, 100_000] {
            for size in 1..=5 {
                let rs = shard_ranges_aligned(n, size, 1024);
                assert_eq!(rs.len(), size);
                assert_eq!(rs[0].start, 0);
                assert_eq!(rs[size - 1].end, n);
                for w in rs.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "n {n} size {size}");
                    assert!(w[0].end % 1024 == 0 || w[0].end == n, "n {n} size {size}: {rs:?}");
                }
                let share = n as f64 / size as f64;
                assert!(
                    rs.iter().all(|r| (r.len() as f64 - share).abs() <= 1024.0 + 1.0),
                    "n {n} size {size}: {rs:?}"
                );
            }
        }
        assert_eq!(shard_ranges_aligned(1001, 3, 1), shard_ranges(1001, 3));
        assert_eq!(layer_ranges(5000, true, 2), shard_ranges_aligned(5000, 2, 1024));
        assert_eq!(layer_ranges(5000, false, 2), shard_ranges(5000, 2));
    }

    #[test]
    fn a_rank_keeps_its_share_of_a_block_resident() {
        let n = 1 << 20;
        assert_eq!(resident_block_bytes(n, 1), 4 << 20);
        assert_eq!(resident_block_bytes(n, 4), (1 << 20) + PAGE as u64);
        // A block of a page or two stays whole.
        assert_eq!(resident_block_bytes(1000, 3), padded_bytes(1000, 4));
        assert_eq!(resident_block_bytes(0, 3), 0);
    }
}
