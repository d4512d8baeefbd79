//! Crash-safe file replacement: write a temporary file in the target's
//! directory, sync it, rename it over the target, sync the directory. A
//! crash at any point leaves either the old file or the new one, plus at
//! worst a stray `.<name>.tmp-*` file that readers never look at.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{IoContext, Result};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Prefix-marked temporary name next to `target`.
pub(crate) fn temp_path(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    target.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// Whether `name` is one of our temporary files.
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(".tmp-")
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Makes a rename or creation in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir).and_then(|d| d.sync_all()).at(dir)?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Syncs `tmp`, renames it to `target` and syncs the directory. Removes
/// `tmp` if any step fails.
pub(crate) fn persist(tmp: &Path, target: &Path) -> Result<()> {
    let res = (|| {
        OpenOptions::new()
            .write(true)
            .open(tmp)
            .and_then(|f| f.sync_all())
            .at(tmp)?;
        std::fs::rename(tmp, target).at(target)?;
        sync_dir(parent_of(target))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    res
}

/// Replaces `target` with `bytes` atomically and durably.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(target);
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .at(&tmp)?;
        f.write_all(bytes).at(&tmp)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    persist(&tmp, target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.txt")]);
        assert!(is_temp_name(
            &temp_path(&p).file_name().unwrap().to_string_lossy()
        ));
    }

    #[test]
    fn failure_names_the_path() {
        let err = write_atomic(Path::new("/nonexistent/dir/f"), b"x").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/dir/.f.tmp-"), "{err}");
    }
}
