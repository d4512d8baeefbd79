use std::ops::Range;

use megatrain_tensor::ParamTable;

use crate::{AdamWError, Result};

/// Where in a slab weight decay applies. Matrices and embeddings decay; norm
/// gains and biases do not. Stored as sorted, disjoint, non-empty ranges of
/// decayed elements so the fused loop runs branch-free over each piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecayMask {
    /// Every element decays, whatever the slab length.
    All,
    /// No element decays, whatever the slab length.
    None,
    /// Exactly these ranges decay, in a slab of exactly `len` elements.
    Ranges { len: usize, ranges: Vec<Range<usize>> },
}

impl DecayMask {
    /// Builds a mask from decayed ranges of a `len`-element slab. Ranges may
    /// come in any order and may touch; they must not overlap or run past
    /// `len`. Empty ranges are dropped.
    pub fn from_ranges(len: usize, ranges: impl IntoIterator<Item = Range<usize>>) -> Result<Self> {
        let mut rs: Vec<Range<usize>> = ranges.into_iter().collect();
        for r in &rs {
            if r.start > r.end || r.end > len {
                return Err(AdamWError::DecayRange {
                    start: r.start,
                    end: r.end,
                    len,
                    why: if r.start > r.end {
                        "reversed"
                    } else {
                        "past the end of the slab"
                    },
                });
            }
        }
        rs.retain(|r| !r.is_empty());
        rs.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(rs.len());
        for r in rs {
            match merged.last_mut() {
                Some(last) if r.start < last.end => {
                    return Err(AdamWError::DecayRange {
                        start: r.start,
                        end: r.end,
                        len,
                        why: "overlapping another range",
                    });
                }
                Some(last) if r.start == last.end => last.end = r.end,
                _ => merged.push(r),
            }
        }
        Ok(DecayMask::Ranges { len, ranges: merged })
    }

    /// Builds a mask from one flag per element (true = decay).
    pub fn from_flags(flags: &[bool]) -> Self {
        let mut ranges = Vec::new();
        let mut start = None;
        for (i, &f) in flags.iter().enumerate() {
            match (f, start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    ranges.push(s..i);
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            ranges.push(s..flags.len());
        }
        DecayMask::Ranges {
            len: flags.len(),
            ranges,
        }
    }

    /// The mask of a layer slab laid out by `table`: each parameter decays
    /// when its `decay` flag says so.
    pub fn from_param_table(table: &ParamTable) -> Self {
        let ranges = table.iter().filter(|p| p.decay).map(|p| p.range());
        Self::from_ranges(table.numel(), ranges).expect("ParamTable ranges are consecutive and in bounds")
    }

    /// Whether element `i` decays.
    pub fn decays(&self, i: usize) -> bool {
        match self {
            DecayMask::All => true,
            DecayMask::None => false,
            DecayMask::Ranges { ranges, .. } => {
                let k = ranges.partition_point(|r| r.end <= i);
                ranges.get(k).is_some_and(|r| r.contains(&i))
            }
        }
    }

    pub(crate) fn check_len(&self, slab_len: usize) -> Result<()> {
        match self {
            DecayMask::Ranges { len, .. } if *len != slab_len => Err(AdamWError::DecayMaskLength {
                mask_len: *len,
                slab_len,
            }),
            _ => Ok(()),
        }
    }

    /// Splits `window` (absolute element indices) into consecutive pieces
    /// that are uniformly decayed or not, calling `f(piece, decays)` in order.
    pub(crate) fn for_each_piece(&self, window: Range<usize>, mut f: impl FnMut(Range<usize>, bool)) {
        match self {
            DecayMask::All => f(window, true),
            DecayMask::None => f(window, false),
            DecayMask::Ranges { ranges, .. } => {
                let mut at = window.start;
                let first = ranges.partition_point(|r| r.end <= at);
                for r in &ranges[first..] {
                    if r.start >= window.end {
                        break;
                    }
                    if r.start > at {
                        f(at..r.start, false);
                        at = r.start;
                    }
                    let end = r.end.min(window.end);
                    f(at..end, true);
                    at = end;
                }
                if at < window.end {
                    f(at..window.end, false);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(m: &DecayMask, w: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let mut out = Vec::new();
        m.for_each_piece(w, |r, d| out.push((r, d)));
        out
    }

    #[test]
    fn ranges_are_merged_and_validated() {
        let m = DecayMask::from_ranges(10, [5..7, 0..2, 2..3, 4..4]).unwrap();
        assert_eq!(
            m,
            DecayMask::Ranges {
                len: 10,
                ranges: vec![0..3, 5..7]
            }
        );
        assert!(matches!(
            DecayMask::from_ranges(10, [0..3, 2..4]),
            Err(AdamWError::DecayRange { start: 2, .. })
        ));
        assert!(DecayMask::from_ranges(10, std::iter::once(8..11)).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = DecayMask::from_ranges(10, std::iter::once(5..3));
        assert!(reversed.is_err());
    }

    #[test]
    fn pieces_cover_the_window_in_order() {
        let m = DecayMask::from_ranges(10, [1..3, 5..9]).unwrap();
        assert_eq!(
            pieces(&m, 0..10),
            vec![
                (0..1, false),
                (1..3, true),
                (3..5, false),
                (5..9, true),
                (9..10, false)
            ]
        );
        assert_eq!(pieces(&m, 2..6), vec![(2..3, true), (3..5, false), (5..6, true)]);
        assert_eq!(pieces(&m, 6..8), vec![(6..8, true)]);
        assert_eq!(pieces(&DecayMask::All, 3..4), vec![(3..4, true)]);
    }

    #[test]
    fn flags_and_param_table_agree_with_decays() {
        let flags = [true, true, false, true, false, false, true];
        let m = DecayMask::from_flags(&flags);
        for (i, &f) in flags.iter().enumerate() {
            assert_eq!(m.decays(i), f, "element {i}");
        }
        let mut t = ParamTable::new();
        t.push("w", [2, 3], true).unwrap();
        t.push("b", [3], false).unwrap();
        t.push("e", [4], true).unwrap();
        let m = DecayMask::from_param_table(&t);
        assert_eq!(
            m,
            DecayMask::Ranges {
                len: 13,
                ranges: vec![0..6, 9..13]
            }
        );
        assert!(m.check_len(13).is_ok());
        assert!(m.check_len(12).is_err());
    }
}
