//! CRC-32s of checkpoint tensors. `checkpoint.json` keeps one per tensor of
//! each file, `"crc32": {file: {tensor: "89abcdef"}}`, computed from the
//! slabs as they are saved. Loading checks each one as it copies the tensor
//! (the data is read once, not twice), and [`verify_checkpoint_file`]
//! checks a file on its own before something else reads it (an export, a
//! sample). Without them a flipped bit in a checkpoint's f32 data loads as
//! a plausible wrong weight, or as a NaN some steps later.
//!
//! A slice of 1 MiB is hashed per task and the CRCs are combined in order,
//! so a tensor of any size is hashed on every core.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crc32fast::Hasher;
use rayon::prelude::*;
use serde_json::Value;

use crate::checkpoint::{StFile, read_meta};
use crate::error::{Result, TierError};

/// Per file, per tensor.
pub(crate) type Crc32Table = BTreeMap<String, BTreeMap<String, u32>>;

/// The key of the table in `checkpoint.json`.
pub(crate) const KEY: &str = "crc32";

/// Bytes per task.
const PART: usize = 1 << 20;

fn hasher_of(bytes: &[u8]) -> Hasher {
    let mut h = Hasher::new();
    h.update(bytes);
    h
}

fn join(mut a: Hasher, b: Hasher) -> Hasher {
    a.combine(&b);
    a
}

/// The hasher of `bytes`, on every core for more than a part.
fn hashed(bytes: &[u8]) -> Hasher {
    if bytes.len() <= PART {
        return hasher_of(bytes);
    }
    bytes
        .par_chunks(PART)
        .map(hasher_of)
        .reduce_with(join)
        .expect("more than one part")
}

/// The CRC-32 (IEEE) of `bytes`.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    if bytes.len() <= PART {
        return crc32fast::hash(bytes);
    }
    hashed(bytes).finalize()
}

/// Fills `dst` from the little-endian f32s of `src` and returns the hasher
/// of `src`, each slice hashed while it is in cache for the copy.
fn copy_hashed(src: &[u8], dst: &mut [f32]) -> Hasher {
    let conv = |s: &[u8], d: &mut [f32]| {
        for (d, b) in d.iter_mut().zip(s.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        hasher_of(s)
    };
    if src.len() <= PART {
        return conv(src, dst);
    }
    dst.par_chunks_mut(PART / 4)
        .zip(src.par_chunks(PART))
        .map(|(d, s)| conv(s, d))
        .reduce_with(join)
        .expect("more than one part")
}

/// Fills `dst` from the little-endian f32s of `src` and returns the CRC-32
/// of `src`, each slice hashed while it is in cache for the copy.
pub(crate) fn copy_le_f32(src: &[u8], dst: &mut [f32]) -> u32 {
    copy_hashed(src, dst).finalize()
}

/// The CRC-32 of all of `src` (little-endian f32), copying only its
/// elements `keep` into the same places of `dst` (a sharded rank's part of
/// a tensor): the part is hashed as it is copied, the rest on its own.
pub(crate) fn copy_le_f32_part(src: &[u8], dst: &mut [f32], keep: std::ops::Range<usize>) -> u32 {
    let (a, b) = (4 * keep.start, 4 * keep.end);
    let part = copy_hashed(&src[a..b], &mut dst[keep]);
    join(join(hashed(&src[..a]), part), hashed(&src[b..])).finalize()
}

pub(crate) fn to_json(table: &Crc32Table) -> Value {
    table
        .iter()
        .map(|(file, tensors)| {
            let t = tensors
                .iter()
                .map(|(name, crc)| (name.clone(), Value::String(format!("{crc:08x}"))))
                .collect();
            (file.clone(), Value::Object(t))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The table of a `checkpoint.json`; `None` where it has none (written
/// before checkpoints had CRCs).
pub(crate) fn from_json(meta: &Value) -> std::result::Result<Option<Crc32Table>, String> {
    let Some(v) = meta.get(KEY) else {
        return Ok(None);
    };
    let bad = || format!("'{KEY}' is not {{file: {{tensor: \"8 hex digits\"}}}}");
    let mut table = Crc32Table::new();
    for (file, tensors) in v.as_object().ok_or_else(bad)? {
        let mut t = BTreeMap::new();
        for (name, crc) in tensors.as_object().ok_or_else(bad)? {
            let crc = crc
                .as_str()
                .filter(|s| s.len() == 8)
                .and_then(|s| u32::from_str_radix(s, 16).ok())
                .ok_or_else(|| format!("'{KEY}' of {file} '{name}': {crc} is not 8 hex digits"))?;
            t.insert(name.clone(), crc);
        }
        table.insert(file.clone(), t);
    }
    Ok(Some(table))
}

/// The CRCs `checkpoint.json` gives for the tensors of `file`, every one of
/// `names` among them; `None` for a checkpoint without CRCs.
pub(crate) fn expected<'a>(
    table: Option<&Crc32Table>,
    meta_path: &Path,
    file: &str,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<Option<HashMap<String, u32>>> {
    let Some(table) = table else {
        return Ok(None);
    };
    let missing = |what: String| TierError::Meta {
        file: meta_path.to_path_buf(),
        detail: format!("'{KEY}' has no entry for {what}"),
    };
    let of_file = table.get(file).ok_or_else(|| missing(file.to_string()))?;
    names
        .into_iter()
        .map(|n| match of_file.get(n) {
            Some(&crc) => Ok((n.to_string(), crc)),
            None => Err(missing(format!("{file} '{n}'"))),
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// The error of a tensor whose bytes do not have the CRC written with them.
pub(crate) fn mismatch(path: &Path, tensor: &str, want: u32, got: u32) -> TierError {
    TierError::Corrupt {
        file: path.to_path_buf(),
        tensor: Some(tensor.to_string()),
        detail: format!(
            "its bytes have CRC-32 {got:08x}, checkpoint.json says {want:08x}: the file changed \
             after it was written (a disk or copy fault)"
        ),
    }
}

/// Checks every tensor of `file` (`model.safetensors`, say) in the
/// checkpoint `dir` against its CRC, and that the file holds no tensor the
/// table does not name. A checkpoint written without CRCs passes unread.
pub fn verify_checkpoint_file(dir: &Path, file: &str) -> Result<()> {
    let (_, table) = read_meta(dir)?;
    let Some(table) = table else {
        return Ok(());
    };
    let meta_path = dir.join(crate::checkpoint::META_FILE);
    let st_file = StFile::open(dir.join(file))?;
    let st = st_file.parse()?;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort_unstable();
    let want = expected(Some(&table), &meta_path, file, names.iter().map(String::as_str))?
        .expect("a table was given");
    if let Some(n) = table[file].keys().find(|n| !want.contains_key(*n)) {
        return Err(TierError::MissingTensor {
            file: st_file.path.clone(),
            tensor: n.clone(),
        });
    }
    for name in &names {
        let data = st.tensor(name).expect("listed by the file").data();
        let got = crc32(data);
        st_file.release(data);
        if got != want[name] {
            return Err(mismatch(&st_file.path, name, want[name], got));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i * 2654435761usize) >> 13) as u8).collect()
    }

    #[test]
    fn parts_hashed_apart_give_the_crc_of_the_whole() {
        for n in [0, 1, 4, PART, PART + 4, 3 * PART + 1028] {
            let b = bytes(n);
            assert_eq!(crc32(&b), crc32fast::hash(&b), "{n} bytes");
        }
    }

    #[test]
    fn the_copy_is_exact_and_hashes_what_it_copied() {
        for floats in [0, 7, PART / 4, PART / 4 + 3, 5 * PART / 4 + 1] {
            let b = bytes(4 * floats);
            let mut dst = vec![0f32; floats];
            assert_eq!(copy_le_f32(&b, &mut dst), crc32fast::hash(&b), "{floats} floats");
            for (d, s) in dst.iter().zip(b.chunks_exact(4)) {
                assert_eq!(d.to_bits(), u32::from_le_bytes(s.try_into().unwrap()));
            }
        }
    }

    #[test]
    fn a_part_is_copied_alone_and_the_crc_is_of_the_whole() {
        let floats = 5 * PART / 4 + 1;
        let b = bytes(4 * floats);
        for keep in [
            0..0,
            0..floats,
            3..floats - 2,
            PART / 4 - 1..PART / 4 + 5,
            floats..floats,
        ] {
            let mut dst = vec![-1f32; floats];
            let crc = copy_le_f32_part(&b, &mut dst, keep.clone());
            assert_eq!(crc, crc32fast::hash(&b), "{keep:?}");
            for (i, (d, s)) in dst.iter().zip(b.chunks_exact(4)).enumerate() {
                let want = match keep.contains(&i) {
                    true => u32::from_le_bytes(s.try_into().unwrap()),
                    false => (-1f32).to_bits(),
                };
                assert_eq!(d.to_bits(), want, "{keep:?} element {i}");
            }
        }
    }

    #[test]
    fn the_table_round_trips_through_json_and_bad_entries_are_named() {
        let mut t = Crc32Table::new();
        t.entry("model.safetensors".into())
            .or_default()
            .extend([("a".to_string(), 0u32), ("b".to_string(), 0xdead_beef)]);
        let meta = serde_json::json!({ KEY: to_json(&t) });
        assert_eq!(from_json(&meta).unwrap(), Some(t));
        assert_eq!(from_json(&serde_json::json!({})).unwrap(), None);
        let bad = serde_json::json!({ KEY: {"model.safetensors": {"a": "xyz"}} });
        let err = from_json(&bad).unwrap_err();
        assert!(
            err.contains("model.safetensors 'a'") && err.contains("xyz"),
            "{err}"
        );
    }
}
