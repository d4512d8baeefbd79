//! A text's token ids kept beside the run, so that a restart or a resume
//! maps them instead of tokenizing the corpus again, and the run holds them
//! as page cache rather than 4 bytes a token of its own memory.
//!
//! A cached file is named by a hash of what made it: the text's files
//! (path, length, modification time) and the tokenizer
//! ([`TextEncoder::cache_key`]). A change of either gives another name, and
//! the files of the same data under other names are removed as a new one
//! is written. The ids are u32, little-endian, written to a temporary file,
//! synced and renamed, so a file under a cache name is always whole.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::{DataError, Fnv1a, TextEncoder, Tokens, io};

const EXT: &str = "u32";

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

/// The cache file in `dir` of the ids of `path` (whose text is `files`)
/// under `enc`, or `None` where the tokenizer gives no key.
fn cache_file(
    path: &Path,
    files: &[PathBuf],
    enc: &dyn TextEncoder,
    dir: &Path,
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
        "{}-{:016x}.{EXT}",
        stem(path),
        h.finish()
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

/// Whether `name` is `<stem>-<16 hex digits>.u32`.
fn is_cache_of(name: &str, stem: &str) -> bool {
    name.strip_prefix(stem)
        .and_then(|r| r.strip_prefix('-'))
        .and_then(|r| r.strip_suffix(&format!(".{EXT}")))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn map(path: &Path) -> Result<Tokens, DataError> {
    let file = fs::File::open(path).map_err(io(path))?;
    // SAFETY: a cache file is only ever replaced by rename, never changed
    // in place, so the mapped bytes do not change under the map.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
    Ok(Tokens::mapped(map, 4))
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
    let Some(file) = cache_file(path, files, enc, dir)? else {
        return tokenize().map(Tokens::from);
    };
    if fs::metadata(&file).is_ok_and(|m| m.len() > 0 && m.len().is_multiple_of(4)) {
        return map(&file);
    }
    let ids = tokenize()?;
    if ids.is_empty() {
        return Ok(Tokens::from(ids));
    }
    store(path, &file, dir, &[&Tokens::from(ids)])
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
    let Some(file) = cache_file(path, &files, enc, dir)? else {
        return Ok(None);
    };
    let mut whole = store(path, &file, dir, parts)?;
    let mut out = Vec::with_capacity(parts.len());
    for p in &parts[..parts.len() - 1] {
        let rest = whole.split_off(p.len());
        out.push(whole);
        whole = rest;
    }
    out.push(whole);
    Ok(Some(out))
}

/// Writes `parts` one after the other as `file` (a temporary file, synced,
/// then renamed), removes the same text's files under older keys, and maps
/// the new one.
fn store(path: &Path, file: &Path, dir: &Path, parts: &[&Tokens]) -> Result<Tokens, DataError> {
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
        for id in parts.iter().flat_map(|p| p.iter()) {
            w.write_all(&id.to_le_bytes())?;
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
        if n != name && is_cache_of(&n, &stem) {
            let _ = fs::remove_file(e.path());
        }
    }
    map(file)
}
