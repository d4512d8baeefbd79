//! Drawing (input, target) batches from a token stream.
//!
//! Batches are a pure function of (data, sampling, batch index): a resumed
//! run needs only the step number to draw exactly what it would have drawn,
//! so no RNG state has to be checkpointed for the data.

use megatrain_tensor::Docs;

use super::packing::push_packed_row;
use super::records::{Records, pad, push_record_row};
use super::{DataError, TokenData};

/// Target value the loss ignores (the PyTorch and Hugging Face convention).
pub const IGNORE_INDEX: i32 = -100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sampling {
    /// Sequence b of batch g starts at token (g·B + b)·T, wrapping at the
    /// end; rows of records take record g·B + b, wrapping.
    Sequential,
    /// Uniform start offsets from a seeded counter-based generator; rows of
    /// records take every record once a pass, in a seeded order each pass.
    Random { seed: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    /// `[batch · seq_len]`, row-major.
    pub inputs: Vec<u32>,
    /// `[batch · seq_len]`; `IGNORE_INDEX` where the loss does not count.
    pub targets: Vec<i32>,
    /// Each row's tokens before its padding, where a row of records is
    /// padded (`None`: no row is).
    pub lengths: Option<Vec<usize>>,
    /// The records packed in each row, where rows hold several (`None`:
    /// each row is one sequence).
    pub docs: Option<Docs>,
}

impl Batch {
    /// Targets the loss counts.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }

    /// `[batch · seq_len]`: which tokens are the data's rather than
    /// padding (`None`: every one is).
    pub fn tokens_mask(&self) -> Option<Vec<bool>> {
        let lengths = self.lengths.as_ref()?;
        Some(
            lengths
                .iter()
                .flat_map(|&n| (0..self.seq_len).map(move |i| i < n))
                .collect(),
        )
    }
}

/// SplitMix64: a well-mixed 64-bit hash, enough for picking offsets.
pub(super) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Draws batch number `index` (the global micro-batch count: step ·
/// grad_accum + micro) of `batch` sequences of `seq_len` tokens.
pub fn draw_batch(
    data: &TokenData,
    sampling: Sampling,
    index: u64,
    batch: usize,
    seq_len: usize,
    name: &std::path::Path,
) -> Result<Batch, DataError> {
    draw_rows(data, sampling, index, batch, 0..batch, seq_len, name)
}

/// Rows `rows` of batch number `index` of `batch` sequences: with data
/// parallel training, rank r of N draws rows r·b..(r+1)·b of the global
/// batch of N·b, so N ranks see exactly what one rank with N·b would.
pub fn draw_rows(
    data: &TokenData,
    sampling: Sampling,
    index: u64,
    batch: usize,
    rows: std::ops::Range<usize>,
    seq_len: usize,
    name: &std::path::Path,
) -> Result<Batch, DataError> {
    let (parts, names) = (std::slice::from_ref(data), std::slice::from_ref(&name));
    draw_parts(parts, names, |_| 0, sampling, index, batch, rows, seq_len)
}

/// Rows `rows` of batch number `index`, row `b` drawn from
/// `parts[part_of(b)]` (`names[i]` names part `i` in errors).
#[allow(clippy::too_many_arguments)]
fn draw_parts<N: AsRef<std::path::Path>>(
    parts: &[TokenData],
    names: &[N],
    part_of: impl Fn(u64) -> usize,
    sampling: Sampling,
    index: u64,
    batch: usize,
    rows: std::ops::Range<usize>,
    seq_len: usize,
) -> Result<Batch, DataError> {
    assert!(rows.end <= batch, "rows {rows:?} of a batch of {batch}");
    for (part, name) in parts.iter().zip(names) {
        // A row of a record is padded: any record will do.
        let short = match part.row_records() {
            Some(r) => r.is_empty(),
            None => part.len() < seq_len + 1,
        };
        if short {
            return Err(DataError::TooShort {
                path: name.as_ref().to_path_buf(),
                len: part.len(),
                seq_len,
            });
        }
    }
    let mut out = Batch::empty(rows.len(), seq_len);
    let mut done = Vec::with_capacity(rows.len());
    for b in rows.start as u64..rows.end as u64 {
        let part = &parts[part_of(b)];
        let g = index * batch as u64 + b;
        let (n, at) = match &part.records {
            Some(r) if r.is_windows() => {
                let start = push_row(part, sampling, index, batch, b, seq_len, &mut out);
                (
                    seq_len,
                    keep_records_apart(part.len(), r, start, seq_len, &mut out),
                )
            }
            Some(r) => match r.cursor() {
                Some(c) => {
                    let (n, at) = push_packed_row(part, r, c, sampling, g, seq_len, &mut out);
                    pad(&mut out, seq_len - n);
                    (n, at)
                }
                None => (push_record_row(part, r, sampling, g, seq_len, &mut out), vec![0]),
            },
            None => {
                push_row(part, sampling, index, batch, b, seq_len, &mut out);
                (seq_len, vec![0])
            }
        };
        done.push((n, at));
    }
    out.finish_rows(done);
    Ok(out)
}

impl Batch {
    /// A batch of `batch` rows of `seq_len` with no row in it yet.
    pub(super) fn empty(batch: usize, seq_len: usize) -> Batch {
        Batch {
            batch,
            seq_len,
            inputs: Vec::with_capacity(batch * seq_len),
            targets: Vec::with_capacity(batch * seq_len),
            lengths: None,
            docs: None,
        }
    }

    /// Notes each row's tokens before its padding and where its records
    /// start, `(used, starts)` a row, once every row is in.
    pub(super) fn finish_rows(&mut self, rows: Vec<(usize, Vec<usize>)>) {
        let (lengths, starts): (Vec<usize>, Vec<Vec<usize>>) = rows.into_iter().unzip();
        self.lengths = lengths.iter().any(|&n| n < self.seq_len).then_some(lengths);
        if starts.iter().any(|s| s.len() > 1) {
            self.docs =
                Some(Docs::new(self.seq_len, &starts).expect("packed records start in order within the row"));
        }
    }
}

/// The row `out` ends with, a window of `seq_len` tokens from position
/// `start` of a stream of `n` tokens (wrapping at its end) whose records
/// are `records`, made one in which each record keeps to itself: the
/// target of a record's last token (the next record's first) is ignored.
/// Returns where the row's records start (0 first), for its `Docs`.
fn keep_records_apart(
    n: usize,
    records: &Records,
    start: usize,
    seq_len: usize,
    out: &mut Batch,
) -> Vec<usize> {
    let row = out.targets.len() - seq_len;
    let mut at = vec![0];
    // `k`: a record starts at the row's k-th token (1 ≤ k ≤ seq_len; at
    // seq_len, only the row's last target crosses into it).
    let mut mark = |k: usize| {
        out.targets[row + k - 1] = IGNORE_INDEX;
        if k < seq_len {
            at.push(k);
        }
    };
    let starts = records.starts();
    let end = start + seq_len;
    for &s in &starts[starts.partition_point(|&s| s <= start)..] {
        if s > end {
            break;
        }
        mark(s - start);
    }
    // Past the stream's end the window goes on from its first token.
    if end >= n {
        for &s in starts {
            if s + n > end {
                break;
            }
            mark(s + n - start);
        }
    }
    at
}

/// Appends row `b` of batch number `index` to `out` (`data` holds more
/// than `seq_len` tokens). Returns where in the stream it starts.
fn push_row(
    data: &TokenData,
    sampling: Sampling,
    index: u64,
    batch: usize,
    b: u64,
    seq_len: usize,
    out: &mut Batch,
) -> usize {
    let n = data.len();
    let start = match sampling {
        Sampling::Sequential => ((index * batch as u64 + b) * seq_len as u64 % n as u64) as usize,
        Sampling::Random { seed } => {
            let h = splitmix64(seed ^ splitmix64(index.wrapping_mul(0x1_0000_0001).wrapping_add(b)));
            (h % (n - seq_len) as u64) as usize
        }
    };
    for i in 0..seq_len {
        let at = (start + i) % n;
        let next = (start + i + 1) % n;
        out.inputs.push(data.tokens.get(at));
        let counted = data.loss_mask.as_ref().is_none_or(|m| m.get(next));
        out.targets.push(if counted {
            data.tokens.get(next) as i32
        } else {
            IGNORE_INDEX
        });
    }
    data.tokens.release_window(start, seq_len + 1);
    start
}

/// Several token streams drawn from by weight: each row of a batch comes
/// whole from one of them, picked by a hash of the seed, the batch number
/// and the row, so a mixture is as reproducible as one stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Mix {
    pub parts: Vec<TokenData>,
    /// Each part's share of the rows (positive; need not sum to 1).
    pub weights: Vec<f64>,
}

impl Mix {
    /// One stream alone.
    pub fn one(data: TokenData) -> Mix {
        Mix {
            parts: vec![data],
            weights: vec![1.0],
        }
    }

    /// Tokens of every part.
    pub fn len(&self) -> usize {
        self.parts.iter().map(TokenData::len).sum()
    }

    /// The rows one pass over every part gives ([`TokenData::rows_per_pass`]),
    /// summed whatever the weights.
    pub fn rows_per_pass(&self, seq_len: usize) -> u64 {
        self.parts.iter().map(|p| p.rows_per_pass(seq_len)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The part row `b` of batch number `index` is drawn from.
    pub fn part_of(&self, seed: u64, index: u64, b: u64) -> usize {
        let total: f64 = self.weights.iter().sum();
        let h = splitmix64(seed ^ MIX_SALT ^ splitmix64(index.wrapping_mul(0x1_0000_0001).wrapping_add(b)));
        // 53 bits: an f64 in [0, 1).
        let u = (h >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        for (i, w) in self.weights.iter().enumerate() {
            acc += w;
            if u < acc {
                return i;
            }
        }
        self.weights.len() - 1
    }
}

/// Mixed into the seed for picking a row's part, so the pick and the
/// offset within the part are independent draws.
const MIX_SALT: u64 = 0x6d69_7874_7572_6573;

/// [`draw_rows`] from a mixture (`names[i]` names part `i` in errors):
/// with one part, exactly what [`draw_rows`] draws from it.
#[allow(clippy::too_many_arguments)]
pub fn draw_mix_rows(
    mix: &Mix,
    sampling: Sampling,
    index: u64,
    batch: usize,
    rows: std::ops::Range<usize>,
    seq_len: usize,
    names: &[std::path::PathBuf],
) -> Result<Batch, DataError> {
    if let [one] = mix.parts.as_slice() {
        return draw_rows(one, sampling, index, batch, rows, seq_len, &names[0]);
    }
    let Sampling::Random { seed } = sampling else {
        panic!("a mixture draws random rows (validated with the options)");
    };
    let part_of = |b| mix.part_of(seed, index, b);
    draw_parts(&mix.parts, names, part_of, sampling, index, batch, rows, seq_len)
}
