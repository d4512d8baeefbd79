use std::fs;
use std::path::{Path, PathBuf};

use super::jsonl::{ChatTemplate, load_jsonl};
use super::{DataError, TextEncoder, TokenData, Tokens};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |cause| DataError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

/// Loads `path` by its kind: a directory of `.txt` files (sorted by name and
/// concatenated), a `.bin` of little-endian u16 tokens (nanoGPT), a `.jsonl`
/// of alpaca or sharegpt records, or any other file as UTF-8 text.
pub fn load_tokens(
    path: &Path,
    enc: &dyn TextEncoder,
    template: &ChatTemplate,
) -> Result<TokenData, DataError> {
    let data = if path.is_dir() {
        load_text_dir(path, enc)?
    } else {
        match path.extension().and_then(|e| e.to_str()) {
            Some("bin") => load_bin(path)?,
            Some("jsonl") => load_jsonl(path, enc, template)?,
            _ => {
                let text = fs::read_to_string(path).map_err(io(path))?;
                TokenData {
                    tokens: encode(path, &text, enc)?.into(),
                    loss_mask: None,
                }
            }
        }
    };
    if data.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    check_vocab(path, &data.tokens, enc.vocab_size())?;
    data.tokens.expect_scattered_reads();
    Ok(data)
}

fn encode(path: &Path, text: &str, enc: &dyn TextEncoder) -> Result<Vec<u32>, DataError> {
    enc.encode(text).map_err(|detail| DataError::Tokenize {
        path: path.to_path_buf(),
        detail,
    })
}

fn load_text_dir(dir: &Path, enc: &dyn TextEncoder) -> Result<TokenData, DataError> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    let mut tokens = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).map_err(io(f))?;
        tokens.extend(encode(f, &text, enc)?);
    }
    Ok(TokenData {
        tokens: tokens.into(),
        loss_mask: None,
    })
}

/// A `.bin` read in place through a memory map (see [`Tokens`]): like
/// nanoGPT's `np.memmap`, the file must not be truncated or rewritten while
/// a run reads it.
fn load_bin(path: &Path) -> Result<TokenData, DataError> {
    let file = fs::File::open(path).map_err(io(path))?;
    let len = file.metadata().map_err(io(path))?.len();
    if len % 2 != 0 {
        return Err(DataError::OddBin {
            path: path.to_path_buf(),
            len,
        });
    }
    let tokens = if len == 0 {
        Tokens::from(Vec::new())
    } else {
        // SAFETY: the map is read only; the file is the user's data set,
        // which (as documented above) nothing changes while it is read.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
        Tokens::mapped_u16(map)
    };
    Ok(TokenData {
        tokens,
        loss_mask: None,
    })
}

fn check_vocab(path: &Path, tokens: &Tokens, vocab: usize) -> Result<(), DataError> {
    let bound = u32::try_from(vocab).unwrap_or(u32::MAX);
    match tokens.first_at_least(bound) {
        Some(index) => Err(DataError::TokenOutOfRange {
            path: path.to_path_buf(),
            id: tokens.get(index),
            index,
            vocab,
        }),
        None => Ok(()),
    }
}

/// Splits off the last `fraction` of the stream for validation, as nanoGPT
/// does for its character corpus.
pub fn split_validation(data: TokenData, fraction: f64) -> Result<(TokenData, TokenData), DataError> {
    if !(0.0..1.0).contains(&fraction) {
        return Err(DataError::BadFraction(fraction));
    }
    let n_train = data.len() - (data.len() as f64 * fraction) as usize;
    let TokenData {
        mut tokens,
        mut loss_mask,
    } = data;
    let val_tokens = tokens.split_off(n_train);
    let val_mask = loss_mask.as_mut().map(|m| m.split_off(n_train));
    Ok((
        TokenData { tokens, loss_mask },
        TokenData {
            tokens: val_tokens,
            loss_mask: val_mask,
        },
    ))
}
