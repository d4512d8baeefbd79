//! Tokenizers: Hugging Face `tokenizer.json` (through the `tokenizers`
//! crate), char-level (vocabulary = the sorted unique characters of a corpus,
//! saved as JSON beside the checkpoint) and byte-level (256 ids).

use std::path::{Path, PathBuf};

use crate::hf_export::write_atomic;
use crate::long_text::{MARGIN, PIECE, encode_in_pieces};
use crate::{Result, ZooError};

/// File name of a char vocabulary inside a checkpoint directory.
pub const CHAR_VOCAB_FILE: &str = "char_vocab.json";
pub const HF_TOKENIZER_FILE: &str = "tokenizer.json";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
}

impl CharTokenizer {
    /// Vocabulary of the sorted unique characters of `corpus`, in one pass
    /// that holds only the characters seen (collecting every character to
    /// sort and dedup held 4 bytes per character of the corpus for as long
    /// as the tokenizer lived: 850 MB for a 212 MB text, all run long).
    pub fn from_corpus(corpus: &str) -> Self {
        let mut ascii = [false; 128];
        let mut other = std::collections::BTreeSet::new();
        for c in corpus.chars() {
            match c.is_ascii() {
                true => ascii[c as usize] = true,
                false => {
                    other.insert(c);
                }
            }
        }
        // Every ASCII character sorts before every other.
        let mut chars: Vec<char> = (0u8..128)
            .filter(|&b| ascii[b as usize])
            .map(char::from)
            .chain(other)
            .collect();
        chars.shrink_to_fit();
        CharTokenizer { chars }
    }

    pub fn from_chars(mut chars: Vec<char>) -> Self {
        chars.sort_unstable();
        chars.dedup();
        chars.shrink_to_fit();
        CharTokenizer { chars }
    }

    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(pos, ch)| {
                self.chars
                    .binary_search(&ch)
                    .map(|i| i as u32)
                    .map_err(|_| ZooError::UnknownChar { ch, pos })
            })
            .collect()
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        ids.iter()
            .enumerate()
            .map(|(pos, &id)| {
                self.chars
                    .get(id as usize)
                    .copied()
                    .ok_or(ZooError::TokenOutOfRange {
                        id,
                        pos,
                        vocab: self.chars.len(),
                    })
            })
            .collect()
    }

    /// Writes `{"type": "char", "chars": [...]}` as `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let chars: Vec<String> = self.chars.iter().map(|c| c.to_string()).collect();
        let v = serde_json::json!({"type": "char", "chars": chars});
        write_atomic(path.as_ref(), serde_json::to_string(&v).expect("json").as_bytes())
    }

    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ZooError::io(path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|cause| ZooError::Json {
            path: path.to_path_buf(),
            cause,
        })?;
        let bad = |detail: String| ZooError::Tokenizer {
            path: path.to_path_buf(),
            detail,
        };
        let list = v
            .get("chars")
            .and_then(|c| c.as_array())
            .ok_or_else(|| bad("expected {\"chars\": [...]}".into()))?;
        let mut chars = Vec::with_capacity(list.len());
        for (i, c) in list.iter().enumerate() {
            let s = c.as_str().unwrap_or("");
            let mut it = s.chars();
            match (it.next(), it.next()) {
                (Some(ch), None) => chars.push(ch),
                _ => return Err(bad(format!("entry {i} ({c}) is not a single character"))),
            }
        }
        let tok = CharTokenizer::from_chars(chars);
        if tok.chars.len() != list.len() {
            return Err(bad("characters are repeated".into()));
        }
        Ok(tok)
    }
}

/// Any of the supported tokenizers.
pub enum Tokenizer {
    Hf {
        path: PathBuf,
        inner: Box<tokenizers::Tokenizer>,
    },
    Char(CharTokenizer),
    /// Each byte of the UTF-8 text is a token.
    Byte,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Hf { path, .. } => write!(f, "Tokenizer::Hf({})", path.display()),
            Tokenizer::Char(c) => write!(f, "Tokenizer::Char({} chars)", c.vocab_size()),
            Tokenizer::Byte => write!(f, "Tokenizer::Byte"),
        }
    }
}

impl Tokenizer {
    /// Loads an HF `tokenizer.json`. Nothing is fetched from a network.
    pub fn from_hf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ZooError::Tokenizer {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        Ok(Tokenizer::Hf {
            path: path.to_path_buf(),
            inner: Box::new(inner),
        })
    }

    /// The tokenizer saved in a checkpoint directory: `tokenizer.json`, else
    /// `char_vocab.json`; `None` when there is neither.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let hf = dir.join(HF_TOKENIZER_FILE);
        if hf.exists() {
            return Self::from_hf_file(hf).map(Some);
        }
        let ch = dir.join(CHAR_VOCAB_FILE);
        if ch.exists() {
            return CharTokenizer::load(ch).map(|c| Some(Tokenizer::Char(c)));
        }
        Ok(None)
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Hf { inner, .. } => inner.get_vocab_size(true),
            Tokenizer::Char(c) => c.vocab_size(),
            Tokenizer::Byte => 256,
        }
    }

    /// Token ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Hf { path, inner } => {
                let err = |e: tokenizers::Error| ZooError::Tokenizer {
                    path: path.clone(),
                    detail: format!("encode: {e}"),
                };
                let pieces = if text.len() > 2 * PIECE {
                    encode_in_pieces(text, PIECE, MARGIN, |s| {
                        let e = inner.encode(s, false)?;
                        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
                    })
                    .map_err(err)?
                } else {
                    None
                };
                match pieces {
                    Some(ids) => Ok(ids),
                    None => inner
                        .encode(text, false)
                        .map(|e| e.get_ids().to_vec())
                        .map_err(err),
                }
            }
            Tokenizer::Char(c) => c.encode(text),
            Tokenizer::Byte => Ok(text.bytes().map(u32::from).collect()),
        }
    }

    /// Token ids of `text` (as [`Self::encode`], in one piece) and the byte
    /// offset in `text` at which each token starts: what tells which
    /// tokens of a rendered conversation lie in which of its parts.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>)> {
        match self {
            Tokenizer::Hf { path, inner } => {
                let e = inner.encode(text, false).map_err(|e| ZooError::Tokenizer {
                    path: path.clone(),
                    detail: format!("encode: {e}"),
                })?;
                let starts = e.get_offsets().iter().map(|o| o.0).collect();
                Ok((e.get_ids().to_vec(), starts))
            }
            Tokenizer::Char(c) => Ok((c.encode(text)?, text.char_indices().map(|(i, _)| i).collect())),
            Tokenizer::Byte => Ok((text.bytes().map(u32::from).collect(), (0..text.len()).collect())),
        }
    }

    /// Text of `ids`; byte-level decoding replaces invalid UTF-8 with U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Hf { path, inner } => inner.decode(ids, false).map_err(|e| ZooError::Tokenizer {
                path: path.clone(),
                detail: format!("decode: {e}"),
            }),
            Tokenizer::Char(c) => c.decode(ids),
            Tokenizer::Byte => {
                let bytes = ids
                    .iter()
                    .enumerate()
                    .map(|(pos, &id)| {
                        u8::try_from(id).map_err(|_| ZooError::TokenOutOfRange { id, pos, vocab: 256 })
                    })
                    .collect::<Result<Vec<u8>>>()?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vocabulary of a corpus is its sorted unique characters, ASCII
    /// and not, held in a vector of their number (not of the corpus's).
    #[test]
    fn a_char_vocabulary_holds_only_its_characters() {
        let corpus = "zébre, Ωmega! ab\n日本 zz".repeat(50_000);
        let tok = CharTokenizer::from_corpus(&corpus);
        let mut want: Vec<char> = corpus.chars().collect();
        want.sort_unstable();
        want.dedup();
        assert_eq!(tok.chars, want);
        // Bounded by the vocabulary, not the corpus's 1.2M characters.
        assert!(tok.chars.capacity() < 256, "{}", tok.chars.capacity());
        let again = CharTokenizer::from_chars(corpus.chars().collect());
        assert!(again == tok && again.chars.capacity() < 256);
        assert!(CharTokenizer::from_corpus("").chars.is_empty());
    }
}
