//! Read-only file maps (checkpoints, token files) that a pass reads once.

/// Lets the kernel drop `bytes`, a part of the read-only file `map`, from
/// the resident set: they stay in the page cache, and a later read maps
/// them again. For a map of a file nothing modifies (a checkpoint, a data
/// set), so that a pass over it leaves at most a part's pages resident.
pub fn release_mapped(map: &memmap2::Mmap, bytes: &[u8]) {
    #[cfg(unix)]
    {
        let off = bytes.as_ptr() as usize - map.as_ptr() as usize;
        // SAFETY: a read-only map of a file that is not modified: after
        // DONTNEED a later access re-reads the same bytes from the file.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, bytes.len()) };
    }
    #[cfg(not(unix))]
    let _ = (map, bytes);
}
