//! Rows of whole records: where an instruction set's records start, and
//! the row of a batch that holds one of them.
//!
//! A window of the concatenated stream starts anywhere in a conversation
//! and runs on into the next one, whose tokens then attend to the last.
//! One record a row, from its first token, right-padded, is what a
//! fine-tuning run usually wants (transformers' and TRL's unpacked
//! default). Padding needs no attention mask: attention is causal, so no
//! token of the record sees the padding after it, and the padding's
//! targets are ignored.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::TokenData;
use super::batch::{Batch, IGNORE_INDEX, Sampling, splitmix64};
use super::packing::{Cursor, Fit};

/// Where each record of a stream starts: ascending, the first at 0; and
/// whether rows take one record each, as many as fit (packed, with the
/// walk that finds a row's records, `packing.rs`), or are windows of the
/// stream in which each record keeps to itself (`windows`).
#[derive(Clone)]
pub struct Records {
    starts: Arc<[usize]>,
    packed: Option<(Fit, Arc<Mutex<Cursor>>)>,
    windows: bool,
}

impl fmt::Debug for Records {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.fit() {
            Some(Fit::Next) => ", packed next fit",
            Some(Fit::Best) => ", packed best fit",
            None if self.windows => ", windows",
            None => "",
        };
        write!(f, "Records({} records{how})", self.len())
    }
}

impl PartialEq for Records {
    fn eq(&self, other: &Records) -> bool {
        self.starts == other.starts && self.fit() == other.fit() && self.windows == other.windows
    }
}

impl Eq for Records {}

impl Records {
    /// Records starting at `starts` (ascending, the first at 0; empty for
    /// an empty stream), one a row.
    pub fn new(starts: Vec<usize>) -> Records {
        assert!(
            starts.first().is_none_or(|&s| s == 0) && starts.windows(2).all(|w| w[0] < w[1]),
            "record starts ascend from 0"
        );
        Records {
            starts: starts.into(),
            packed: None,
            windows: false,
        }
    }

    /// The same records as windows of the stream: rows start anywhere and
    /// span records, as a stream's do, but each record in a row attends
    /// to its own tokens alone and counts positions from its first (the
    /// batch's `Docs`), and its last token predicts nothing (Llama 3's
    /// document mask; Megatron's reset attention mask and position ids).
    pub fn windows(self) -> Records {
        Records {
            packed: None,
            windows: true,
            ..self
        }
    }

    /// Whether rows are windows of the stream ([`Records::windows`]).
    pub fn is_windows(&self) -> bool {
        self.windows
    }

    /// The same records, as many a row as fit, next fit in the drawn
    /// order.
    pub fn packed(self) -> Records {
        self.packed_with(Fit::Next)
    }

    /// The same records, as many a row as fit, packed by `fit`.
    pub fn packed_with(self, fit: Fit) -> Records {
        Records {
            packed: Some((fit, Arc::default())),
            windows: false,
            ..self
        }
    }

    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// How the rows are packed, where they are.
    pub fn fit(&self) -> Option<Fit> {
        self.packed.as_ref().map(|(f, _)| *f)
    }

    /// The walk over the record order of packed rows.
    pub(super) fn cursor(&self) -> Option<&Mutex<Cursor>> {
        self.packed.as_ref().map(|(_, c)| &**c)
    }

    pub fn len(&self) -> usize {
        self.starts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// The tokens of record `r` of a stream of `total` tokens.
    pub fn span(&self, r: usize, total: usize) -> Range<usize> {
        self.starts[r]..self.starts.get(r + 1).copied().unwrap_or(total)
    }

    /// Records of a stream of `total` tokens longer than `n` tokens.
    pub fn longer_than(&self, n: usize, total: usize) -> usize {
        (0..self.len()).filter(|&r| self.span(r, total).len() > n).count()
    }

    /// The share of a row of `seq_len` inputs that is padding, on average
    /// over the records of a stream of `total` tokens (each is drawn as
    /// often as the others).
    pub fn padding_share(&self, total: usize, seq_len: usize) -> f64 {
        let pad: usize = (0..self.len())
            .map(|r| seq_len.saturating_sub(self.span(r, total).len()))
            .sum();
        pad as f64 / (self.len() * seq_len).max(1) as f64
    }

    /// The records before token `at` and those from it (rebased to 0);
    /// `at` is a record's start or the stream's end.
    pub(super) fn split_at(&self, at: usize) -> (Records, Records) {
        let k = self.starts.partition_point(|&s| s < at);
        let tail = self.starts[k..].iter().map(|s| s - at).collect();
        let (head, tail) = (Records::new(self.starts[..k].to_vec()), Records::new(tail));
        match (self.fit(), self.windows) {
            (Some(fit), _) => (head.packed_with(fit), tail.packed_with(fit)),
            (None, true) => (head.windows(), tail.windows()),
            (None, false) => (head, tail),
        }
    }
}

/// Records of `data` whose row (their first `seq_len + 1` tokens) holds
/// no target the loss counts: a response that starts past the row.
pub fn silent_records(data: &TokenData, seq_len: usize) -> usize {
    let Some(records) = data.row_records() else {
        return 0;
    };
    (0..records.len())
        .filter(|&r| {
            let span = records.span(r, data.len());
            let n = span.len().min(seq_len + 1);
            !(span.start + 1..span.start + n).any(|i| data.loss_mask.as_ref().is_none_or(|m| m.get(i)))
        })
        .count()
}

/// Mixed into the seed of the records' order, so that it and a stream's
/// offsets under the same seed are independent draws.
const ORDER_SALT: u64 = 0x7265_636f_7264_7321;

/// Position `pos` of a seeded permutation of `0..n`: a 4-round Feistel
/// network on the smallest even number of bits that holds `n − 1`,
/// walked until it lands below `n` (fewer than 4 rounds on average). A
/// pure function, so a resumed run needs no state to continue the order.
fn permute(pos: u64, n: u64, key: u64) -> u64 {
    debug_assert!(pos < n);
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2).max(1);
    let mask = (1u64 << half) - 1;
    let mut x = pos;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = splitmix64(key ^ (round << 56) ^ r) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

/// The record row `g` of the whole run (batch number · batch + row) holds:
/// in order, or in a fresh seeded order each pass over the records (every
/// record once a pass, as an epoch-shuffling loader gives them).
pub(crate) fn record_of(sampling: Sampling, g: u64, n: u64) -> u64 {
    match sampling {
        Sampling::Sequential => g % n,
        Sampling::Random { seed } => {
            let pass = g / n;
            permute(g % n, n, splitmix64(seed ^ ORDER_SALT ^ splitmix64(pass)))
        }
    }
}

/// Appends the row of the run's row `g` (batch number · batch + row) to
/// `out`: one record from its first token, cut at `seq_len + 1` tokens,
/// then padding (id 0, target ignored). Returns the row's tokens before
/// its padding.
pub(super) fn push_record_row(
    data: &TokenData,
    records: &Records,
    sampling: Sampling,
    g: u64,
    seq_len: usize,
    out: &mut Batch,
) -> usize {
    let r = record_of(sampling, g, records.len() as u64) as usize;
    let n = push_record(data, records.span(r, data.len()), seq_len, out);
    pad(out, seq_len - n);
    n
}

/// Appends the record of tokens `span` to `out` in `room` inputs, cut at
/// `room + 1` tokens: its tokens as inputs, each the next one's target
/// where the mask counts it. The record's last token has no target: what
/// follows it is another record. Returns the inputs it took.
pub(super) fn push_record(data: &TokenData, span: Range<usize>, room: usize, out: &mut Batch) -> usize {
    let n = span.len().min(room + 1);
    let inputs = n.min(room);
    for i in 0..inputs {
        let at = span.start + i;
        out.inputs.push(data.tokens.get(at));
        let counted = i + 1 < n && data.loss_mask.as_ref().is_none_or(|m| m.get(at + 1));
        out.targets.push(match counted {
            true => data.tokens.get(at + 1) as i32,
            false => IGNORE_INDEX,
        });
    }
    data.tokens.release_window(span.start, n);
    inputs
}

/// Appends `n` tokens of padding (id 0, target ignored) to `out`.
pub(super) fn pad(out: &mut Batch, n: usize) {
    out.inputs.extend(std::iter::repeat_n(0, n));
    out.targets.extend(std::iter::repeat_n(IGNORE_INDEX, n));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_a_bijection_for_every_size() {
        for n in [1u64, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097] {
            for key in [0u64, 1, 0xdead_beef] {
                let mut seen = vec![false; n as usize];
                for pos in 0..n {
                    let x = permute(pos, n, key) as usize;
                    assert!(!seen[x], "n {n} key {key}: {x} twice");
                    seen[x] = true;
                }
            }
        }
    }

    #[test]
    fn each_pass_visits_every_record_once_in_a_new_order() {
        let n = 50u64;
        let s = Sampling::Random { seed: 7 };
        let pass = |p: u64| (0..n).map(|i| record_of(s, p * n + i, n)).collect::<Vec<_>>();
        let (a, b) = (pass(0), pass(1));
        for p in [&a, &b] {
            let mut sorted = p.clone();
            sorted.sort();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        }
        assert_ne!(a, b, "a new order each pass");
        assert_ne!(a, (0..n).collect::<Vec<_>>(), "shuffled");
        assert_eq!(record_of(Sampling::Sequential, 53, n), 3);
    }

    #[test]
    fn split_at_a_start_rebases_the_tail() {
        let r = Records::new(vec![0, 3, 7, 12]);
        let (a, b) = r.split_at(7);
        assert_eq!(a.starts(), &[0, 3]);
        assert_eq!(b.starts(), &[0, 5]);
        assert_eq!(r.span(3, 20), 12..20);
        assert_eq!(r.longer_than(4, 20), 2);
        // Rows of 6: 3, 2, 1 and 0 of them padding.
        assert_eq!(r.padding_share(20, 6), 6.0 / 24.0);
    }
}
