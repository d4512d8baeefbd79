//! Documents packed side by side in the rows of a batch. A row of `T`
//! tokens may hold several documents, each a contiguous span; a token
//! attends only to the tokens of its own document before it, and its
//! position (RoPE's angle, GPT-2's learned position) counts from its
//! document's first token. That makes a packed row compute exactly what its
//! documents would, each alone in a row of its own (flash-attention's
//! `varlen` and transformers' `DataCollatorWithFlattening` do the same).

use std::fmt;
use std::sync::Arc;

use crate::{Error, Result};

/// Where the documents of each row of a `[B, T]` batch begin. Cheap to
/// clone: the bounds are shared.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Docs(Arc<Bounds>);

#[derive(PartialEq, Eq, Hash)]
struct Bounds {
    rows: usize,
    t: usize,
    docs: usize,
    /// `[2, B, T]`: each token's document's first position, then one past
    /// its last.
    bounds: Vec<u32>,
}

impl Docs {
    /// `starts[b]` lists where row `b`'s documents begin: 0 first, then
    /// increasing, each below `t`; the last runs to the row's end.
    pub fn new(t: usize, starts: &[Vec<usize>]) -> Result<Docs> {
        let op = "Docs::new";
        if t == 0 || t > u32::MAX as usize / 2 {
            return Err(Error::invalid(op, format!("a row of {t} tokens")));
        }
        let rows = starts.len();
        let mut first = vec![0u32; rows * t];
        let mut end = vec![0u32; rows * t];
        for (b, s) in starts.iter().enumerate() {
            let ordered = s.first() == Some(&0) && s.windows(2).all(|w| w[0] < w[1]);
            if !ordered || s.last().is_some_and(|&l| l >= t) {
                return Err(Error::invalid(
                    op,
                    format!("row {b}'s document starts {s:?} must begin at 0, increase and stay below {t}"),
                ));
            }
            for (n, &a) in s.iter().enumerate() {
                let z = s.get(n + 1).copied().unwrap_or(t);
                first[b * t + a..b * t + z].fill(a as u32);
                end[b * t + a..b * t + z].fill(z as u32);
            }
        }
        first.extend(end);
        Ok(Docs(Arc::new(Bounds {
            rows,
            t,
            docs: starts.iter().map(Vec::len).sum(),
            bounds: first,
        })))
    }

    pub fn rows(&self) -> usize {
        self.0.rows
    }

    pub fn seq_len(&self) -> usize {
        self.0.t
    }

    /// How many documents all rows hold together.
    pub fn count(&self) -> usize {
        self.0.docs
    }

    /// The first position of the document token `i` of row `b` is in.
    pub fn start(&self, b: usize, i: usize) -> usize {
        self.0.bounds[b * self.0.t + i] as usize
    }

    /// One past the last position of that document.
    pub fn end(&self, b: usize, i: usize) -> usize {
        let n = self.0.rows * self.0.t;
        self.0.bounds[n + b * self.0.t + i] as usize
    }

    /// Token `i`'s position within its document.
    pub fn position(&self, b: usize, i: usize) -> usize {
        i - self.start(b, i)
    }

    /// `[2, B, T]` as the GPU kernels read it: every token's
    /// [`start`](Self::start), then every token's [`end`](Self::end).
    pub fn bounds(&self) -> &[u32] {
        &self.0.bounds
    }

    /// Refuses bounds of another batch than `[b, t]`, naming `op`.
    pub fn check(&self, op: &'static str, b: usize, t: usize) -> Result<()> {
        if (self.0.rows, self.0.t) != (b, t) {
            return Err(Error::shape(
                op,
                format!(
                    "documents of a [{}, {}] batch given for a [{b}, {t}] one",
                    self.0.rows, self.0.t
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for Docs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Docs({} in [{}, {}])", self.0.docs, self.0.rows, self.0.t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_of_each_token() {
        let d = Docs::new(5, &[vec![0, 2], vec![0]]).unwrap();
        assert_eq!(
            d.bounds(),
            [0, 0, 2, 2, 2, 0, 0, 0, 0, 0, 2, 2, 5, 5, 5, 5, 5, 5, 5, 5]
        );
        assert_eq!((d.start(0, 3), d.end(0, 1), d.position(0, 4)), (2, 2, 2));
        assert_eq!((d.count(), d.rows(), d.seq_len()), (3, 2, 5));
        assert!(d.check("t", 2, 5).is_ok());
        assert!(
            d.check("t", 2, 6)
                .unwrap_err()
                .to_string()
                .contains("[2, 5] batch")
        );
    }

    #[test]
    fn refuses_starts_out_of_order() {
        for bad in [vec![], vec![1], vec![0, 0], vec![0, 3, 2], vec![0, 5]] {
            let e = Docs::new(5, std::slice::from_ref(&bad)).unwrap_err().to_string();
            assert!(e.contains("row 0's document starts"), "{bad:?}: {e}");
        }
        assert!(Docs::new(0, &[]).is_err());
    }
}
