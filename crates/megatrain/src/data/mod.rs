//! Training data: token streams from text, token files (nanoGPT's u16
//! `.bin`, u32 `.u32`) and instruction `.jsonl` (rendered by a chat
//! template), and the batches drawn from them.

mod batch;
mod cache;
mod chat;
mod fnv;
mod jinja;
mod jsonl;
mod load;
mod mask;
mod packing;
mod records;
mod tokens;

pub use batch::{Batch, IGNORE_INDEX, Mix, Sampling, draw_batch, draw_mix_rows, draw_rows};
pub use chat::{ChatTemplate, Headers, JinjaTemplate, Message};
pub use fnv::Fnv1a;
pub use jinja::strftime_utc;
pub use load::{id_width, is_token_file, keep_in_cache, load_tokens, load_tokens_cached, split_validation};
pub use mask::Mask;
pub use packing::{Fit, packed_once, packed_padding_share, packed_rows};
pub use records::{Records, silent_records};
pub use tokens::Tokens;

use std::path::{Path, PathBuf};

/// An I/O error about `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |cause| DataError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

/// A text's ids and the byte offset at which each token starts.
pub type Offsets = (Vec<u32>, Vec<usize>);

/// What the data layer needs of a tokenizer; the zoo's tokenizers are
/// adapted to it by the facade. `Sync`: instruction records are
/// tokenized on every core.
pub trait TextEncoder: Sync {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// `text`'s ids (encoded whole) and the byte offset at which each token
    /// starts, where the tokenizer can say; `None` has a rendered
    /// conversation tokenized part by part instead.
    fn encode_with_offsets(&self, _text: &str) -> Option<Result<Offsets, String>> {
        None
    }
    /// Appended after each instruction example so the model learns to stop.
    fn eos(&self) -> Option<u32>;
    fn vocab_size(&self) -> usize;
    /// What decides the ids `encode` gives (the tokenizer's file, say), for
    /// naming a text's cached ids; `None` caches nothing.
    fn cache_key(&self) -> Option<String> {
        None
    }
}

/// A token stream. `loss_mask[i]` says whether `tokens[i]` is a target the
/// loss counts (false for instruction prompts); `None` counts everything.
/// `records`: where each record of an instruction set starts; where it is
/// given, each row of a batch is one record (`batch.rs`), or as many as
/// fit, or a window of the stream whose records keep to themselves; else
/// a window of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenData {
    pub tokens: Tokens,
    pub loss_mask: Option<Mask>,
    pub records: Option<Records>,
}

impl TokenData {
    /// The stream alone: rows are windows of it, whatever its records.
    pub fn as_stream(self) -> TokenData {
        TokenData {
            records: None,
            ..self
        }
    }

    /// Windows of the stream in which each record keeps to itself, where
    /// there are records ([`Records::windows`]); a stream without records
    /// stays one.
    pub fn windows(self) -> TokenData {
        TokenData {
            records: self.records.map(Records::windows),
            ..self
        }
    }

    /// The stream as documents each ended by id `end` (the last may run to
    /// the stream's end without one), in windows of the stream in which
    /// each document keeps to itself ([`TokenData::windows`]): what a token
    /// file's or a text's documents are, where an end-of-text id separates
    /// them (nanoGPT's and llm.c's prepared corpora, `<|endoftext|>` in a
    /// text). Scans the stream once, on every core.
    pub fn documents_ended_by(self, end: u32) -> TokenData {
        let n = self.len();
        let starts = std::iter::once(0)
            .chain(self.tokens.positions_of(end).into_iter().map(|p| p + 1))
            .filter(|&s| s < n)
            .collect();
        TokenData {
            records: Some(Records::new(starts).windows()),
            ..self
        }
    }

    /// The records where each row holds whole ones (one a row, or packed);
    /// `None` where rows are windows of the stream.
    pub fn row_records(&self) -> Option<&Records> {
        self.records.as_ref().filter(|r| !r.is_windows())
    }

    /// Rows of as many whole records as fit, where there are records,
    /// next fit in the drawn order.
    pub fn packed(self) -> TokenData {
        self.packed_with(Fit::Next)
    }

    /// [`TokenData::packed`] by `fit`.
    pub fn packed_with(self, fit: Fit) -> TokenData {
        TokenData {
            records: self.records.map(|r| r.packed_with(fit)),
            ..self
        }
    }

    /// The rows of `seq_len` tokens one pass over the data gives (one
    /// epoch): a row a record, the rows a pass packs, or the stream's
    /// windows (`seq_len` + 1 tokens each, `seq_len` apart).
    pub fn rows_per_pass(&self, seq_len: usize) -> u64 {
        match self.row_records() {
            Some(r) if r.is_packed() => packed_rows(r, self.len(), seq_len),
            Some(r) => r.len() as u64,
            None => (self.len().saturating_sub(1) / seq_len.max(1)).max(1) as u64,
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    #[error("{path}: no data (the file or directory holds no tokens)")]
    Empty { path: PathBuf },
    #[error("{path}: {len} bytes is not a whole number of little-endian u{bits} tokens")]
    OddBin { path: PathBuf, len: u64, bits: usize },
    #[error("{path}: token {id} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        path: PathBuf,
        id: u32,
        index: usize,
        vocab: usize,
    },
    #[error("{path}:{line}: {detail}")]
    Jsonl {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    /// A chat template that does not compile (its file named first).
    #[error("{0}")]
    Template(String),
    #[error("{path}: tokenizer: {detail}")]
    Tokenize { path: PathBuf, detail: String },
    #[error("{path}: {len} tokens is too short for sequences of {seq_len} (+1 target)")]
    TooShort {
        path: PathBuf,
        len: usize,
        seq_len: usize,
    },
    #[error("validation fraction {0} must be in [0, 1)")]
    BadFraction(f64),
    #[error(
        "one record cannot be split for validation (fraction {0}): rows of whole records need a record on each side; give more records or a validation set of its own"
    )]
    OneRecord(f64),
}
