//! Drawing (input, target) batches from a token stream.
//!
//! Batches are a pure function of (data, sampling, batch index): a resumed
//! run needs only the step number to draw exactly what it would have drawn,
//! so no RNG state has to be checkpointed for the data.

use super::{DataError, TokenData};

/// Target value the loss ignores (the PyTorch and Hugging Face convention).
pub const IGNORE_INDEX: i32 = -100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampling {
    /// Sequence b of batch g starts at token (g·B + b)·T, wrapping at the end.
    Sequential,
    /// Uniform start offsets from a seeded counter-based generator.
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
}

impl Batch {
    /// Targets the loss counts.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// SplitMix64: a well-mixed 64-bit hash, enough for picking offsets.
fn splitmix64(mut z: u64) -> u64 {
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
    assert!(rows.end <= batch, "rows {rows:?} of a batch of {batch}");
    let n = data.len();
    if n < seq_len + 1 {
        return Err(DataError::TooShort {
            path: name.to_path_buf(),
            len: n,
            seq_len,
        });
    }
    let mut inputs = Vec::with_capacity(rows.len() * seq_len);
    let mut targets = Vec::with_capacity(rows.len() * seq_len);
    for b in rows.start as u64..rows.end as u64 {
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
            inputs.push(data.tokens.get(at));
            let counted = data.loss_mask.as_ref().is_none_or(|m| m.get(next));
            targets.push(if counted {
                data.tokens.get(next) as i32
            } else {
                IGNORE_INDEX
            });
        }
        data.tokens.release_window(start, seq_len + 1);
    }
    Ok(Batch {
        batch: rows.len(),
        seq_len,
        inputs,
        targets,
    })
}
