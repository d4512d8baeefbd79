//! Which part of each layer a rank owns when the optimizer is sharded.
//!
//! A layer's flat slab of `n` elements is cut into `size` contiguous ranges
//! that differ in length by at most one, whatever `n` is, so no layer size
//! has to be divisible by the number of ranks. AdamW is element-wise, so an
//! update of a range is exactly the update of the whole slab restricted to
//! it; the one per-element input that depends on the position, the decay
//! mask, is cut to the range.
//!
//! A layer spilled to disk is cut on whole pages instead
//! ([`shard_ranges_aligned`]): its rank reads and writes only its own range
//! of the spill files, with direct I/O, which wants page-aligned offsets.

use std::ops::Range;

use megatrain_adamw::DecayMask;

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

/// The decay mask of `range` of a slab whose mask is `mask`.
pub fn shard_mask(mask: &DecayMask, range: &Range<usize>) -> DecayMask {
    match mask {
        DecayMask::All => DecayMask::All,
        DecayMask::None => DecayMask::None,
        DecayMask::Ranges { ranges, .. } => {
            let cut = ranges.iter().filter_map(|r| {
                let (s, e) = (r.start.max(range.start), r.end.min(range.end));
                (s < e).then(|| s - range.start..e - range.start)
            });
            DecayMask::from_ranges(range.len(), cut).expect("a cut of disjoint in-bounds ranges")
        }
    }
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
    }

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

    #[test]
    fn mask_cut_agrees_with_the_whole_mask() {
        let mask = DecayMask::from_ranges(20, [2..5, 8..9, 12..20]).unwrap();
        for size in 1..=6 {
            for r in shard_ranges(20, size) {
                let cut = shard_mask(&mask, &r);
                for (i, g) in r.clone().enumerate() {
                    assert_eq!(cut.decays(i), mask.decays(g), "range {r:?} element {g}");
                }
                if let DecayMask::Ranges { len, .. } = cut {
                    assert_eq!(len, r.len());
                }
            }
        }
        assert_eq!(shard_mask(&DecayMask::All, &(3..7)), DecayMask::All);
    }
}
