use std::fs;
use std::path::{Path, PathBuf};

use super::cache::{cached_records, cached_text, keep_records, keep_text, text_files};
use super::chat::ChatTemplate;
use super::jsonl::load_jsonl;
use super::{DataError, Records, TextEncoder, TokenData, Tokens, io};

/// Loads `path` by its kind: a directory of `.txt` files (sorted by name and
/// concatenated), a `.bin` of little-endian u16 tokens (nanoGPT), a `.u32`
/// of little-endian u32 tokens (vocabularies past 65,536), a `.jsonl` of
/// alpaca or sharegpt records, or any other file as UTF-8 text.
pub fn load_tokens(
    path: &Path,
    enc: &dyn TextEncoder,
    template: &ChatTemplate,
) -> Result<TokenData, DataError> {
    load_tokens_cached(path, enc, template, None)
}

/// [`load_tokens`], with a text's ids (a file or a directory of `.txt`) or
/// an instruction set's ids and loss mask kept in `cache` and mapped from
/// there by the next run that loads the same data with the same tokenizer
/// (and template; see `data/cache.rs`).
pub fn load_tokens_cached(
    path: &Path,
    enc: &dyn TextEncoder,
    template: &ChatTemplate,
    cache: Option<&Path>,
) -> Result<TokenData, DataError> {
    let ext = path.extension().and_then(|e| e.to_str());
    let data = match ext {
        Some(ext) if !path.is_dir() && id_width(ext).is_some() => {
            load_ids(path, id_width(ext).expect("a token file"))?
        }
        Some("jsonl") if !path.is_dir() => match cache {
            Some(dir) => cached_records(path, enc, template, dir, || load_jsonl(path, enc, template))?,
            None => load_jsonl(path, enc, template)?,
        },
        _ => {
            let files = text_files(path)?;
            let tokenize = || encode_text(&files, enc);
            TokenData {
                tokens: match cache {
                    Some(dir) => cached_text(path, &files, enc, dir, tokenize)?,
                    None => tokenize()?.into(),
                },
                loss_mask: None,
                records: None,
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

/// A text's ids or an instruction set's ids and masks held in memory
/// (`parts`: the whole data's, or a validation split's two parts in order)
/// moved to `cache` as [`load_tokens_cached`] keeps them, and mapped from
/// there. A fresh run calls this once its run directory exists, so that it
/// holds them as page cache rather than 4 bytes a token of its own memory,
/// and its first resume maps them. Token files, data mapped already and
/// tokenizers with no cache key are left as they are.
pub fn keep_in_cache(
    path: &Path,
    enc: &dyn TextEncoder,
    template: &ChatTemplate,
    cache: &Path,
    parts: &mut [&mut TokenData],
) -> Result<(), DataError> {
    let jsonl = !path.is_dir() && path.extension().is_some_and(|e| e == "jsonl");
    let in_memory = parts.iter().all(|p| !p.tokens.is_mapped());
    if is_token_file(path) || !in_memory || parts.is_empty() {
        return Ok(());
    }
    let held: Vec<&TokenData> = parts.iter().map(|p| &**p).collect();
    let mapped = match jsonl {
        true => keep_records(path, enc, template, cache, &held)?,
        false if held.iter().all(|p| p.loss_mask.is_none()) => {
            let ids: Vec<&Tokens> = held.iter().map(|p| &p.tokens).collect();
            keep_text(path, enc, cache, &ids)?.map(|ts| {
                ts.into_iter()
                    .map(|tokens| TokenData {
                        tokens,
                        loss_mask: None,
                        records: None,
                    })
                    .collect()
            })
        }
        false => None,
    };
    for (p, d) in parts.iter_mut().zip(mapped.into_iter().flatten()) {
        d.tokens.expect_scattered_reads();
        // The same tokens: the records start where they did.
        **p = TokenData {
            records: p.records.take(),
            ..d
        };
    }
    Ok(())
}

fn encode(path: &Path, text: &str, enc: &dyn TextEncoder) -> Result<Vec<u32>, DataError> {
    enc.encode(text).map_err(|detail| DataError::Tokenize {
        path: path.to_path_buf(),
        detail,
    })
}

/// The ids of text `files`, one after the other.
fn encode_text(files: &[PathBuf], enc: &dyn TextEncoder) -> Result<Vec<u32>, DataError> {
    let mut tokens = Vec::new();
    for f in files {
        let text = fs::read_to_string(f).map_err(io(f))?;
        let ids = encode(f, &text, enc)?;
        drop(text);
        // The first file's ids are moved, not copied: one text's ids in
        // memory at a time, not two.
        match tokens.is_empty() {
            true => tokens = ids,
            false => tokens.extend(ids),
        }
    }
    Ok(tokens)
}

/// Whether `path` is a token file (`.bin`, `.u32`): ids, not text.
pub fn is_token_file(path: &Path) -> bool {
    !path.is_dir()
        && path
            .extension()
            .and_then(|e| e.to_str())
            .and_then(id_width)
            .is_some()
}

/// Bytes per id of a token file with extension `ext` (`.bin`: nanoGPT's
/// u16; `.u32`), or `None` for other files.
pub fn id_width(ext: &str) -> Option<usize> {
    match ext {
        "bin" => Some(2),
        "u32" => Some(4),
        _ => None,
    }
}

/// A token file of little-endian ids of `width` bytes, read in place
/// through a memory map (see [`Tokens`]): like nanoGPT's `np.memmap`, the
/// file must not be truncated or rewritten while a run reads it.
fn load_ids(path: &Path, width: usize) -> Result<TokenData, DataError> {
    let file = fs::File::open(path).map_err(io(path))?;
    let len = file.metadata().map_err(io(path))?.len();
    if !len.is_multiple_of(width as u64) {
        return Err(DataError::OddBin {
            path: path.to_path_buf(),
            len,
            bits: 8 * width,
        });
    }
    let tokens = if len == 0 {
        Tokens::from(Vec::new())
    } else {
        // SAFETY: the map is read only; the file is the user's data set,
        // which (as documented above) nothing changes while it is read.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
        Tokens::mapped(map, width)
    };
    Ok(TokenData {
        tokens,
        loss_mask: None,
        records: None,
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
/// does for its character corpus. An instruction set is split between
/// records: validation takes the records that start in that last fraction
/// (at least the last record), training the rest; so are the documents of
/// windows (`Records::windows`), but one document alone is split where the
/// fraction falls, each part then a document.
pub fn split_validation(data: TokenData, fraction: f64) -> Result<(TokenData, TokenData), DataError> {
    if !(0.0..1.0).contains(&fraction) {
        return Err(DataError::BadFraction(fraction));
    }
    let mut n_train = data.len() - (data.len() as f64 * fraction) as usize;
    let mut one_document = false;
    if let Some(r) = &data.records
        && fraction > 0.0
    {
        let starts = r.starts();
        one_document = starts.len() < 2 && r.is_windows();
        if starts.len() < 2 && !one_document {
            return Err(DataError::OneRecord(fraction));
        }
        if !one_document {
            let k = starts.partition_point(|&s| s < n_train).min(starts.len() - 1);
            n_train = starts[k];
        }
    }
    let TokenData {
        mut tokens,
        mut loss_mask,
        records,
    } = data;
    let val_tokens = tokens.split_off(n_train);
    let val_mask = loss_mask.as_mut().map(|m| m.split_off(n_train));
    let whole = || Records::new(vec![0]).windows();
    let (records, val_records) = match records {
        Some(_) if one_document => (Some(whole()), Some(whole())),
        Some(r) => {
            let (t, v) = r.split_at(n_train);
            (Some(t), Some(v))
        }
        None => (None, None),
    };
    Ok((
        TokenData {
            tokens,
            loss_mask,
            records,
        },
        TokenData {
            tokens: val_tokens,
            loss_mask: val_mask,
            records: val_records,
        },
    ))
}
