//! A text's or an instruction set's token ids kept beside the run, so that
//! a restart or a resume maps them instead of tokenizing the corpus again,
//! and the run holds them as page cache rather than 4 bytes a token of its
//! own memory.
//!
//! A cached file is named by a hash of what made it: the data's files
//! (path, length, modification time), the tokenizer
//! ([`TextEncoder::cache_key`]) and, for `.jsonl`, the chat template. A
//! change of any gives another name, and the files of the same data under
//! other names are removed as a new one is written. The ids are u32,
//! little-endian (`.u32`); an instruction set's carry its loss mask in
//! each word's top bit (`.u32m`, see [`FLAG`]). Each is written to a
//! temporary file, synced and renamed, so a file under a cache name is
//! always whole.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::tokens::{FLAG, START};
use super::{ChatTemplate, DataError, Fnv1a, Mask, Records, TextEncoder, TokenData, Tokens, io};

/// A text's ids.
const EXT: &str = "u32";
/// An instruction set's ids, each word's top bit set where the loss does
/// not count the token.
const EXT_MASKED: &str = "u32m";

/// The files a text source reads: itself, or a directory's `.txt` files.
pub(super) fn text_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = fs::read_dir(path)
        .map_err(io(path))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    Ok(files)
}

/// What a cached file holds: a text's ids, or an instruction set's, which
/// the chat template shapes too.
#[derive(Clone, Copy)]
enum Kind<'a> {
    Text,
    Records(&'a ChatTemplate),
}

impl Kind<'_> {
    fn ext(self) -> &'static str {
        match self {
            Kind::Text => EXT,
            Kind::Records(_) => EXT_MASKED,
        }
    }
}

/// The cache file in `dir` of the ids of `path` (whose data is `files`)
/// under `enc`, or `None` where the tokenizer gives no key.
fn cache_file(
    path: &Path,
    files: &[PathBuf],
    enc: &dyn TextEncoder,
    dir: &Path,
    kind: Kind,
) -> Result<Option<PathBuf>, DataError> {
    let Some(key) = enc.cache_key() else {
        return Ok(None);
    };
    let mut h = Fnv1a::default();
    // Each field ends with a separator word, so that ("ab", "c") and
    // ("a", "bc") differ.
    let mut eat = |bytes: &[u8]| {
        h.bytes(bytes);
        h.word(0xff);
    };
    eat(key.as_bytes());
    if let Kind::Records(t) = kind {
        for part in t.key_parts() {
            eat(part.as_bytes());
        }
        // Files written before the records' starts were kept have
        // another name, and are replaced as the first run reads the data.
        eat(b"record starts");
    }
    for f in files {
        let meta = fs::metadata(f).map_err(io(f))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        eat(f.to_string_lossy().as_bytes());
        eat(&meta.len().to_le_bytes());
        eat(&mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
    }
    Ok(Some(dir.join(format!(
        "{}-{:016x}.{}",
        stem(path),
        h.finish(),
        kind.ext()
    ))))
}

fn stem(path: &Path) -> String {
    let name = path
        .file_name()
        .map_or("data".into(), |n| n.to_string_lossy().into_owned());
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Whether `name` is `<stem>-<16 hex digits>.<ext>`.
fn is_cache_of(name: &str, stem: &str, ext: &str) -> bool {
    name.strip_prefix(stem)
        .and_then(|r| r.strip_prefix('-'))
        .and_then(|r| r.strip_suffix(&format!(".{ext}")))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn map(path: &Path, kind: Kind) -> Result<Tokens, DataError> {
    let file = fs::File::open(path).map_err(io(path))?;
    // SAFETY: a cache file is only ever replaced by rename, never changed
    // in place, so the mapped bytes do not change under the map.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
    Ok(match kind {
        Kind::Text => Tokens::mapped(map, 4),
        Kind::Records(_) => Tokens::mapped_flagged(map),
    })
}

/// Whether `file` holds whole words (a cache file that is there at all).
fn is_whole(file: &Path) -> bool {
    fs::metadata(file).is_ok_and(|m| m.len() > 0 && m.len().is_multiple_of(4))
}

/// The ids of the text at `path` (its `files`): mapped from `dir` where an
/// earlier run cached them, else from `tokenize` and then written there
/// and mapped.
pub(super) fn cached_text(
    path: &Path,
    files: &[PathBuf],
    enc: &dyn TextEncoder,
    dir: &Path,
    tokenize: impl FnOnce() -> Result<Vec<u32>, DataError>,
) -> Result<Tokens, DataError> {
    let Some(file) = cache_file(path, files, enc, dir, Kind::Text)? else {
        return tokenize().map(Tokens::from);
    };
    if is_whole(&file) {
        return map(&file, Kind::Text);
    }
    let ids = tokenize()?;
    if ids.is_empty() {
        return Ok(Tokens::from(ids));
    }
    let ids = Tokens::from(ids);
    store(path, &file, dir, Kind::Text, &mut ids.iter())
}

/// The ids and loss mask of the instruction set at `path` under `enc` and
/// template `t`: mapped from `dir` where an earlier run cached them, else
/// from `tokenize` and then written there and mapped.
pub(super) fn cached_records(
    path: &Path,
    enc: &dyn TextEncoder,
    t: &ChatTemplate,
    dir: &Path,
    tokenize: impl FnOnce() -> Result<TokenData, DataError>,
) -> Result<TokenData, DataError> {
    let kind = Kind::Records(t);
    let Some(file) = cache_file(path, &[path.to_path_buf()], enc, dir, kind)? else {
        return tokenize();
    };
    if is_whole(&file) {
        return Ok(masked(map(&file, kind)?));
    }
    let data = tokenize()?;
    if data.is_empty() || !fits_flag(&data) {
        return Ok(data);
    }
    let ids = store(path, &file, dir, kind, &mut words(&[&data]))?;
    Ok(masked(ids))
}

/// A flagged stream's ids with the mask and the records' starts its flags
/// carry.
fn masked(ids: Tokens) -> TokenData {
    TokenData {
        loss_mask: Some(Mask::in_ids(ids.clone())),
        records: ids.record_starts().map(Records::new),
        tokens: ids,
    }
}

/// Whether every id leaves the flag bits free (any real vocabulary does;
/// one that does not is not cached, and the vocabulary check names it).
fn fits_flag(d: &TokenData) -> bool {
    d.tokens.first_at_least(START).is_none()
}

/// The words of `parts` one after the other: each id, flagged where the
/// loss does not count it and where a record starts.
fn words<'a>(parts: &'a [&'a TokenData]) -> impl Iterator<Item = u32> + 'a {
    parts.iter().flat_map(|p| {
        let mut starts = p
            .records
            .as_ref()
            .map_or(&[][..], Records::starts)
            .iter()
            .peekable();
        p.tokens.iter().enumerate().map(move |(i, id)| {
            let counted = p.loss_mask.as_ref().is_none_or(|m| m.get(i));
            let start = starts.next_if_eq(&&i).is_some();
            id | if counted { 0 } else { FLAG } | if start { START } else { 0 }
        })
    })
}

/// The ids of a text already in memory (`parts`, in order: the whole
/// text's, or a validation split's two parts), written to `dir` under the
/// name [`cached_text`] reads, and mapped from there: the same ids, each
/// part a range of the map. `None` where the tokenizer gives no key.
pub(super) fn keep_text(
    path: &Path,
    enc: &dyn TextEncoder,
    dir: &Path,
    parts: &[&Tokens],
) -> Result<Option<Vec<Tokens>>, DataError> {
    let files = text_files(path)?;
    let Some(file) = cache_file(path, &files, enc, dir, Kind::Text)? else {
        return Ok(None);
    };
    let whole = store(
        path,
        &file,
        dir,
        Kind::Text,
        &mut parts.iter().flat_map(|p| p.iter()),
    )?;
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    Ok(Some(cut(whole, &lens)))
}

/// An instruction set's ids and masks already in memory (`parts`, in
/// order), written to `dir` under the name [`cached_records`] reads, and
/// mapped from there: the same ids and masks, each part a range of the
/// map. `None` where the tokenizer gives no key or an id takes the flag
/// bit.
pub(super) fn keep_records(
    path: &Path,
    enc: &dyn TextEncoder,
    t: &ChatTemplate,
    dir: &Path,
    parts: &[&TokenData],
) -> Result<Option<Vec<TokenData>>, DataError> {
    let kind = Kind::Records(t);
    let Some(file) = cache_file(path, &[path.to_path_buf()], enc, dir, kind)? else {
        return Ok(None);
    };
    if !parts.iter().all(|p| fits_flag(p)) {
        return Ok(None);
    }
    let whole = store(path, &file, dir, kind, &mut words(parts))?;
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    Ok(Some(cut(whole, &lens).into_iter().map(masked).collect()))
}

/// `whole` cut into consecutive parts of `lens` ids (they sum to its length).
fn cut(mut whole: Tokens, lens: &[usize]) -> Vec<Tokens> {
    let mut out = Vec::with_capacity(lens.len());
    for &n in &lens[..lens.len().saturating_sub(1)] {
        let rest = whole.split_off(n);
        out.push(whole);
        whole = rest;
    }
    out.push(whole);
    out
}

/// Writes `words` as `file` (a temporary file, synced, then renamed),
/// removes the same data's files under older keys, and maps the new one.
fn store(
    path: &Path,
    file: &Path,
    dir: &Path,
    kind: Kind,
    words: &mut dyn Iterator<Item = u32>,
) -> Result<Tokens, DataError> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    let name = file
        .file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut f = fs::File::create(&tmp)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut f);
        for word in words {
            w.write_all(&word.to_le_bytes())?;
        }
        w.flush()?;
        drop(w);
        f.sync_all()?;
        fs::rename(&tmp, file)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io(file)(e));
    }
    // The same data under an older key (another tokenizer, an edited file).
    let stem = stem(path);
    for e in fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n != name && is_cache_of(&n, &stem, kind.ext()) {
            let _ = fs::remove_file(e.path());
        }
    }
    map(file, kind)
}
