//! Transport copies shared by the ranks of one machine.
//!
//! Every rank of data parallel training uploads whole layers, so each used
//! to hold a whole transport copy: N ranks on one machine held N copies
//! (2 B/param each in bf16, beside 12/N of p, m and v with a sharded
//! optimizer). Instead the machine's ranks map one file on a memory
//! filesystem (`/dev/shm`): the copies are held once per machine, and
//! after an update nothing moves between them; each rank writes its own
//! range ([`SharedTransport::writes`]: the range a sharded rank updates, or
//! a replicated rank's share of the layer it updates whole) and a barrier
//! makes the writes visible before the next upload (the trainer's side of
//! it).
//!
//! One rank of the machine creates the file with [`create_shared_transport`]
//! at its full length with every page reserved (so a filesystem too small
//! is an error at start, not a `SIGBUS` at the first write); every rank
//! opens it; once all have, the creator's [`SharedFile`] is dropped and the
//! name goes, so no exit path leaves the file behind after that; each maps
//! it through [`crate::TierConfig::shared_transport`].

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use megatrain_tensor::ParamTable;

use crate::buf::padded_bytes;
use crate::error::{Result, TierError, is_disk_full};
use crate::shard::layer_ranges;
use crate::slab::TransportDType;

/// How this process takes part in a transport copy its machine shares.
#[derive(Debug, Clone)]
pub struct SharedTransport {
    /// The file every rank of the machine maps (its name, for messages,
    /// and for opening it where `file` is not given).
    pub path: PathBuf,
    /// The file, opened while it still had its name: the name goes as soon
    /// as every rank has opened it ([`SharedFile`]), so that a rank that
    /// dies later leaves no file behind.
    pub file: Option<Arc<File>>,
    /// The ranks whose range of every layer this process writes: its own,
    /// and, where the run spans machines, those of the ranks with its local
    /// index on the other machines (it receives them there, or with a
    /// replicated optimizer computes them itself).
    pub writes: Vec<usize>,
    /// Ranks of the run: a layer is cut into this many ranges, as a
    /// sharded optimizer cuts it ([`layer_ranges`]), whichever optimizer
    /// the run has.
    pub ranks: usize,
    /// Ranks on this machine: the budget counts this share of the copies.
    pub local: usize,
}

/// Equal where they map the same file (by name, or by the same open
/// file) the same way.
impl PartialEq for SharedTransport {
    fn eq(&self, o: &Self) -> bool {
        let same_file = match (&self.file, &o.file) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        same_file
            && self.path == o.path
            && self.writes == o.writes
            && self.ranks == o.ranks
            && self.local == o.local
    }
}

impl Eq for SharedTransport {}

impl SharedTransport {
    /// Elements of a layer of `n` elements this process writes, in order:
    /// its [`SharedTransport::writes`] ranks' ranges of the layer as a
    /// sharded optimizer cuts it (`spilled`: on pages).
    pub fn layer_writes(&self, n: usize, spilled: bool) -> Vec<Range<usize>> {
        let all = layer_ranges(n, spilled, self.ranks);
        let mut w: Vec<_> = self.writes.iter().map(|&r| all[r].clone()).collect();
        w.sort_by_key(|r| r.start);
        w
    }
}

/// Each layer's byte offset in the shared file (whole pages each, in
/// layer order) and the file's length.
pub fn shared_layout(tables: &[ParamTable], transport: TransportDType) -> (Vec<u64>, u64) {
    let mut at = 0;
    let offsets = tables
        .iter()
        .map(|t| {
            let o = at;
            at += padded_bytes(t.numel(), transport.size_in_bytes());
            o
        })
        .collect();
    (offsets, at)
}

/// The file a machine's transport copies live in, removed when dropped.
#[derive(Debug)]
pub struct SharedFile {
    path: PathBuf,
}

impl SharedFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // The maps keep the memory; only the name goes.
        let _ = std::fs::remove_file(&self.path);
    }
}

static SHARED_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Shared copies are named `megatrain-transport-<pid>-<nanos>-<n>.shm`,
/// `<pid>` the process that made them.
const SHARED_PREFIX: &str = "megatrain-transport-";

/// Age past which a copy whose creator is gone is taken for abandoned:
/// longer than the machine's ranks take to open a new one and unlink it.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the shared copies in `dir` that a run killed while creating
/// them left behind (their name is unlinked once every rank has opened
/// them, so only a kill in between leaves one): files named by a process
/// that no longer exists, older than a minute. A memory filesystem would
/// hold their pages until the machine restarts. Linux only (`/proc`).
fn remove_abandoned(dir: &Path) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SHARED_PREFIX))
            .filter(|n| n.ends_with(".shm"))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_AFTER));
        if old && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Creates, in `dir`, the zeroed file of every layer's transport copy, its
/// pages all reserved (after removing copies abandoned there by killed
/// runs).
pub fn create_shared_transport(
    dir: &Path,
    tables: &[ParamTable],
    transport: TransportDType,
) -> Result<SharedFile> {
    remove_abandoned(dir);
    let (_, bytes) = shared_layout(tables, transport);
    let n = SHARED_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = dir.join(format!("{SHARED_PREFIX}{}-{nanos}-{n}.shm", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| TierError::io(&path, e))?;
    let shared = SharedFile { path };
    let full = |cause| TierError::SharedFull {
        path: shared.path.clone(),
        needed: bytes,
        cause,
    };
    file.set_len(bytes).map_err(|e| match is_disk_full(&e) {
        true => full(e),
        false => TierError::io(&shared.path, e),
    })?;
    crate::spill::reserve_blocks(&file, 0..bytes).map_err(|e| match is_disk_full(&e) {
        true => full(e),
        false => TierError::io(&shared.path, e),
    })?;
    Ok(shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(sizes: &[usize]) -> Vec<ParamTable> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let mut t = ParamTable::new();
                t.push(format!("w{i}"), vec![n], true).unwrap();
                t
            })
            .collect()
    }

    #[test]
    fn layers_sit_on_pages_in_order() {
        let t = tables(&[1, 2048, 2049, 0, 5]);
        let (at, len) = shared_layout(&t, TransportDType::BF16);
        assert_eq!(at, [0, 4096, 8192, 16384, 16384]);
        assert_eq!(len, 20480);
        let (at, len) = shared_layout(&t, TransportDType::F32);
        assert_eq!(at, [0, 4096, 12288, 24576, 24576]);
        assert_eq!(len, 28672);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn copies_abandoned_by_killed_runs_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, age_s: u64| {
            let p = dir.path().join(name);
            let f = std::fs::File::create(&p).unwrap();
            let t = std::time::SystemTime::now() - std::time::Duration::from_secs(age_s);
            f.set_modified(t).unwrap();
            p
        };
        // pid 4194305 is past Linux's largest (2^22).
        let dead_old = file("megatrain-transport-4194305-1-0.shm", 3600);
        let dead_new = file("megatrain-transport-4194305-2-0.shm", 0);
        let alive = file(
            &format!("megatrain-transport-{}-3-0.shm", std::process::id()),
            3600,
        );
        let other = file("megatrain-transport-notes.txt", 3600);
        let f = create_shared_transport(dir.path(), &tables(&[8]), TransportDType::BF16).unwrap();
        assert!(!dead_old.exists(), "a dead run's old copy is removed");
        assert!(dead_new.exists() && alive.exists() && other.exists());
        assert!(f.path().exists());
    }

    #[test]
    fn the_file_is_whole_and_goes_with_its_guard() {
        let dir = tempfile::tempdir().unwrap();
        let t = tables(&[3000, 70]);
        let f = create_shared_transport(dir.path(), &t, TransportDType::BF16).unwrap();
        assert_eq!(std::fs::metadata(f.path()).unwrap().len(), 12288);
        let path = f.path().to_path_buf();
        drop(f);
        assert!(!path.exists());
        let err =
            create_shared_transport(Path::new("/nonexistent/shm"), &t, TransportDType::BF16).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/shm"), "{err}");
    }

    #[test]
    fn a_process_writes_its_ranks_ranges_in_order() {
        let s = SharedTransport {
            path: PathBuf::new(),
            file: None,
            writes: vec![3, 1],
            ranks: 4,
            local: 2,
        };
        assert_eq!(s.layer_writes(100, false), [25..50, 75..100]);
        assert_eq!(s.layer_writes(5000, true), [1024..2048, 4096..5000]);
    }
}
