//! Page-aligned, zero-initialised element buffers, in RAM or in a
//! memory-mapped spill file, behind one slice interface.
//!
//! RAM buffers are anonymous memory maps, not `std::alloc` allocations:
//! `alloc_zeroed` with a 4096-byte alignment cannot use `calloc` and
//! `memset`s the whole block, touching every page of the moments before the
//! optimizer writes them. An anonymous map is zero-filled by the kernel on
//! first touch, so a page becomes resident exactly once, when it is first
//! written. Disk buffers are shared maps of a sparse file (zero until
//! written) whose name is unlinked right after mapping on Unix, so a crash
//! leaves nothing behind in the spill directory.
//!
//! Disk buffers are preallocated (`posix_fallocate`), so a disk too small
//! for the spill is an error at start ([`crate::TierError::DiskFull`]),
//! never a `SIGBUS` when a dirty page of the map is written back later. The
//! file is opened with `O_DIRECT` where the filesystem allows it: the
//! optimizer's read-ahead / write-behind ([`crate::SpillWindow`]) moves the
//! bytes with positioned reads and writes on it ([`SpillRegion`]), while
//! the map stays the random-access view (initialisation, checkpoints). Linux
//! keeps the two coherent: a direct read first writes back dirty pages of
//! the range, a direct write invalidates the cached ones.
//!
//! No `MADV_HUGEPAGE`: on the development VM (THP `madvise`, defrag
//! `madvise`) it made filling a 300M-parameter tier 2-3x slower (direct
//! compaction on fault), measured with the `tier_rss` example.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{IoContext, Result};
use crate::spill::{SpillRegion, open_spill_file};

/// Alignment (and size granularity) of every buffer.
pub const PAGE: usize = 4096;

/// Element types a buffer may hold: plain data whose all-zero bit pattern is
/// the value 0.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {}
impl Element for f32 {}
impl Element for half::bf16 {}
impl Element for half::f16 {}
impl Element for u8 {}

/// Bytes a buffer of `numel` elements of `elem_size` bytes occupies:
/// rounded up to whole pages, 0 for an empty buffer.
pub const fn padded_bytes(numel: usize, elem_size: usize) -> u64 {
    let b = (numel * elem_size) as u64;
    b.div_ceil(PAGE as u64) * PAGE as u64
}

/// The bytes of a buffer of `numel` elements of `elem_size` bytes whose
/// blocks a spill file reserves for elements `reserve`: the whole pages
/// that hold them, none for an empty range.
pub(crate) fn reserved_span(numel: usize, elem_size: usize, reserve: Range<usize>) -> Range<u64> {
    if reserve.is_empty() {
        return 0..0;
    }
    let page = PAGE as u64;
    let start = (reserve.start * elem_size) as u64 / page * page;
    let end = padded_bytes(reserve.end, elem_size).min(padded_bytes(numel, elem_size));
    start..end
}

/// Where a buffer lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    Ram,
    /// A memory-mapped file created in this directory.
    Disk(PathBuf),
}

/// An owned, page-aligned, zero-initialised buffer of `len` elements.
pub struct AlignedBuf<T: Element> {
    map: Option<MmapMut>,
    len: usize,
    on_disk: bool,
    /// The spill file, for explicit reads and writes (disk buffers only).
    region: Option<SpillRegion>,
    /// The spill file's name where it could not be unlinked at creation.
    #[cfg_attr(unix, allow(dead_code))]
    path: Option<PathBuf>,
    /// A spill file's bytes with blocks reserved (the whole map but for a
    /// sharded rank's file, which holds its range).
    reserved: Option<u64>,
    _elem: std::marker::PhantomData<T>,
}

static SPILL_COUNTER: AtomicU64 = AtomicU64::new(0);

impl<T: Element> AlignedBuf<T> {
    /// A zeroed buffer in RAM.
    pub fn zeroed(len: usize) -> Result<Self> {
        Self::in_ram(len, |bytes| {
            MmapOptions::new().len(bytes).map_anon().at("<anonymous memory>")
        })
    }

    /// A buffer in RAM of `len` elements, its pages mapped by `map` (given
    /// their length; not called for an empty buffer).
    fn in_ram(len: usize, map: impl FnOnce(usize) -> Result<MmapMut>) -> Result<Self> {
        let bytes = Self::bytes_for(len);
        let map = if bytes == 0 { None } else { Some(map(bytes)?) };
        Ok(AlignedBuf {
            map,
            len,
            on_disk: false,
            region: None,
            path: None,
            reserved: None,
            _elem: std::marker::PhantomData,
        })
    }

    /// A zeroed buffer backed by a new file in `dir` with all its blocks
    /// reserved; `label` goes into the file name to make stray files
    /// recognisable.
    pub fn zeroed_on_disk(len: usize, dir: &Path, label: &str) -> Result<Self> {
        Self::zeroed_on_disk_reserving(len, dir, label, 0..len)
    }

    /// [`AlignedBuf::zeroed_on_disk`] with blocks reserved for the pages of
    /// elements `reserve` only: the rest is a hole, which must never be
    /// written through the map (a full disk would then raise SIGBUS).
    pub fn zeroed_on_disk_reserving(
        len: usize,
        dir: &Path,
        label: &str,
        reserve: std::ops::Range<usize>,
    ) -> Result<Self> {
        let bytes = Self::bytes_for(len);
        if bytes == 0 {
            let mut b = Self::zeroed(0)?;
            b.on_disk = true;
            return Ok(b);
        }
        let n = SPILL_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("megatrain-spill-{}-{n}-{label}.bin", std::process::id()));
        let reserve = reserved_span(len, size_of::<T>(), reserve);
        let reserved = reserve.end - reserve.start;
        let (file, direct) = open_spill_file(&path, bytes as u64, reserve)?;
        // SAFETY: the file was just created by us with `create_new` and (on
        // Unix) is unlinked below, so no other process can change its size
        // or contents under the map.
        let map = unsafe { MmapOptions::new().len(bytes).map_mut(&file) };
        let map = match map {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e).at(&path);
            }
        };
        let region = SpillRegion::new(Arc::new(file), path.clone(), bytes as u64, direct);
        #[cfg(unix)]
        let path = {
            std::fs::remove_file(&path).at(&path)?;
            None
        };
        #[cfg(not(unix))]
        let path = Some(path);
        Ok(AlignedBuf {
            map: Some(map),
            len,
            on_disk: true,
            region: Some(region),
            path,
            reserved: Some(reserved),
            _elem: std::marker::PhantomData,
        })
    }

    /// A buffer of `len` elements mapped from bytes `offset..` of `file`,
    /// a file other processes map too (a machine's shared transport
    /// copies, [`crate::shared`]): its contents are the file's, and RAM
    /// (the file lives on a memory filesystem), counted as reserved here.
    pub fn shared(len: usize, file: &std::fs::File, offset: u64, path: &Path) -> Result<Self> {
        Self::in_ram(len, |bytes| {
            // SAFETY: the file keeps its length while mapped (every process
            // maps it whole-length-checked and none truncates it), and each
            // process writes only its own ranges of it (the trainer's rule),
            // so no reference made through this map sees a write it does
            // not order with a barrier first.
            unsafe { MmapOptions::new().offset(offset).len(bytes).map_mut(file) }.at(path)
        })
    }

    pub fn new(len: usize, backing: &Backing, label: &str) -> Result<Self> {
        Self::new_reserving(len, backing, label, 0..len)
    }

    /// [`AlignedBuf::new`], reserving only elements `reserve` of a file
    /// (see [`AlignedBuf::zeroed_on_disk_reserving`]; RAM is reserved by
    /// touching it, so it is the same there).
    pub fn new_reserving(
        len: usize,
        backing: &Backing,
        label: &str,
        reserve: std::ops::Range<usize>,
    ) -> Result<Self> {
        match backing {
            Backing::Ram => Self::zeroed(len),
            Backing::Disk(dir) => Self::zeroed_on_disk_reserving(len, dir, label, reserve),
        }
    }

    fn bytes_for(len: usize) -> usize {
        padded_bytes(len, size_of::<T>()) as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_on_disk(&self) -> bool {
        self.on_disk
    }

    /// The spill file behind a disk buffer (`None` in RAM or when empty).
    pub fn spill_region(&self) -> Option<&SpillRegion> {
        self.region.as_ref()
    }

    /// Reserves blocks for the whole of a spill file that holds a range
    /// only, so that it may be written anywhere (a no-op in RAM).
    pub fn reserve_all(&mut self) -> Result<()> {
        if let Some(r) = &self.region {
            r.reserve_all()?;
            self.reserved = Some(r.bytes());
        }
        Ok(())
    }

    /// Bytes reserved (whole pages), which is what the memory report counts.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
            .unwrap_or_else(|| self.map.as_ref().map_or(0, |m| m.len() as u64))
    }

    pub fn as_slice(&self) -> &[T] {
        match &self.map {
            Some(m) => bytemuck::cast_slice(&m[..self.len * size_of::<T>()]),
            None => &[],
        }
    }

    /// Every byte of the mapping: the elements, then zeros to the end of
    /// the last page (page-aligned start and length).
    pub fn pages(&self) -> &[u8] {
        self.map.as_ref().map_or(&[], |m| &m[..])
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        match &mut self.map {
            Some(m) => bytemuck::cast_slice_mut(&mut m[..self.len * size_of::<T>()]),
            None => &mut [],
        }
    }

    /// Elements `r`, made from the map's pointer: no reference to the rest
    /// of the buffer is created, so elements outside `r` may meanwhile be
    /// read or written through a pointer another thread holds (a
    /// collective in flight on another chunk of the same layer).
    pub fn range_mut(&mut self, r: std::ops::Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range {r:?} of a buffer of {}",
            self.len
        );
        match &mut self.map {
            // SAFETY: the map holds `len` elements of `T` (page-aligned, so
            // aligned for `T`), `r` lies inside them, and the slice borrows
            // `self` mutably for its lifetime, so no other reference made
            // through this buffer can overlap it.
            Some(m) => unsafe {
                std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<T>().add(r.start), r.len())
            },
            None => &mut [],
        }
    }

    /// Raw bytes of the elements (native endianness).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }

    /// Writes dirty pages of a disk-backed buffer to its file; a no-op in RAM.
    /// Spill files are scratch space, so this is only useful to bound the
    /// amount of dirty page cache, never for durability.
    pub fn flush(&self) -> Result<()> {
        match &self.map {
            Some(m) if self.on_disk => m.flush().at("<spill file>"),
            _ => Ok(()),
        }
    }
}

impl<T: Element> AlignedBuf<T> {
    /// Drops a disk-backed buffer's pages from this process's resident set
    /// (no-op in RAM). The data stays in the page cache and the file and is
    /// faulted back in on the next access; the kernel writes dirty pages
    /// back and reclaims them under memory pressure. Without this, a spilled
    /// layer touched by the optimizer stays resident as file pages and
    /// counts towards RSS like RAM would.
    pub fn evict(&mut self) -> Result<()> {
        #[cfg(unix)]
        if let (Some(m), true) = (&self.map, self.on_disk) {
            // SAFETY: `&mut self` guarantees no outstanding borrows of the
            // contents, and for a shared file mapping MADV_DONTNEED only
            // unmaps pages: their contents survive in the page cache / file.
            unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) }.at("<spill file>")?;
        }
        Ok(())
    }
}

impl<T: Element> AlignedBuf<T> {
    /// Hands the whole pages inside elements `range` back to the kernel
    /// (a data parallel rank that owns only a shard of a layer's state does
    /// not keep the rest resident). Their contents become unspecified: zero
    /// in RAM, the file's in a spill map. Elements outside `range` that
    /// share a page with it are kept.
    pub fn release(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let size = size_of::<T>();
        let start = (range.start * size).div_ceil(PAGE) * PAGE;
        // The block's last page is whole in the map (its tail is padding).
        let end = match range.end >= self.len {
            true => Self::bytes_for(self.len),
            false => (range.end * size) / PAGE * PAGE,
        };
        #[cfg(unix)]
        if let (Some(m), true) = (&self.map, start < end) {
            // SAFETY: `&mut self` guarantees no outstanding borrows of the
            // contents; the caller declared them unspecified.
            unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) }
                .at("<tier buffer>")?;
        }
        Ok(())
    }
}

impl<T: Element> std::ops::Deref for AlignedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Element> std::ops::DerefMut for AlignedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T: Element> std::fmt::Debug for AlignedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .field("on_disk", &self.on_disk)
            .finish()
    }
}

impl<T: Element> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        // Unmap before removing the file (required on Windows).
        self.map.take();
        self.region.take();
        #[cfg(not(unix))]
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn page_aligned_zeroed_and_padded() {
        for len in [1usize, 7, 1023, 1024, 1025, 5000] {
            let mut b = AlignedBuf::<f32>::zeroed(len).unwrap();
            assert_eq!(b.as_ptr() as usize % PAGE, 0, "len {len}");
            assert!(b.iter().all(|&x| x.to_bits() == 0));
            assert_eq!(b.reserved_bytes(), padded_bytes(len, 4));
            assert_eq!(b.reserved_bytes() % PAGE as u64, 0);
            assert!(b.reserved_bytes() >= 4 * len as u64);
            b[len - 1] = 3.5;
            assert_eq!(b.as_slice()[len - 1], 3.5);
            let h = AlignedBuf::<bf16>::zeroed(len).unwrap();
            assert_eq!(h.as_ptr() as usize % PAGE, 0);
            assert_eq!(h.reserved_bytes(), padded_bytes(len, 2));
        }
        let e = AlignedBuf::<f32>::zeroed(0).unwrap();
        assert!(e.is_empty());
        assert_eq!(e.reserved_bytes(), 0);
        assert_eq!(padded_bytes(1024, 4), 4096);
        assert_eq!(padded_bytes(1025, 4), 8192);
    }

    #[test]
    fn a_range_is_those_elements_of_the_whole() {
        let dir = tempfile::tempdir().unwrap();
        let ram = AlignedBuf::<f32>::zeroed(5000).unwrap();
        let disk = AlignedBuf::<f32>::zeroed_on_disk(5000, dir.path(), "range").unwrap();
        for mut b in [ram, disk] {
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as f32;
            }
            for r in [0..0, 0..5000, 1023..1025, 4999..5000, 17..17] {
                let s = b.range_mut(r.clone());
                assert_eq!(s.len(), r.len());
                assert!(s.iter().zip(r.clone()).all(|(&x, i)| x == i as f32), "{r:?}");
                s.iter_mut().for_each(|x| *x = -1.0);
                // Only `r` was written.
                assert!(
                    b.iter().enumerate().all(|(i, &x)| (x == -1.0) == r.contains(&i)),
                    "{r:?}"
                );
                b.range_mut(r.clone())
                    .iter_mut()
                    .zip(r.clone())
                    .for_each(|(x, i)| *x = i as f32);
            }
        }
        let mut e = AlignedBuf::<f32>::zeroed(0).unwrap();
        assert!(e.range_mut(0..0).is_empty());
    }

    #[test]
    #[should_panic(expected = "range 10..12 of a buffer of 11")]
    fn a_range_past_the_end_panics() {
        AlignedBuf::<f32>::zeroed(11).unwrap().range_mut(10..12);
    }

    #[test]
    fn disk_buffer_is_zeroed_writable_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = AlignedBuf::<f32>::zeroed_on_disk(3001, dir.path(), "test").unwrap();
        assert!(b.is_on_disk());
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        assert!(b.iter().all(|&x| x == 0.0));
        for (i, x) in b.iter_mut().enumerate() {
            *x = i as f32;
        }
        b.flush().unwrap();
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
        #[cfg(unix)]
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        drop(b);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn missing_spill_dir_names_the_path() {
        let err =
            AlignedBuf::<f32>::zeroed_on_disk(10, Path::new("/nonexistent/megatrain"), "x").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/megatrain"), "{err}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn evicting_a_spilled_buffer_keeps_data_and_frees_rss() {
        let dir = tempfile::tempdir().unwrap();
        let len = 16 << 20; // 64 MiB of f32
        let mut b = AlignedBuf::<f32>::zeroed_on_disk(len, dir.path(), "evict").unwrap();
        for (i, x) in b.iter_mut().enumerate() {
            *x = i as f32;
        }
        let touched = crate::rss::current_rss_bytes().unwrap();
        b.evict().unwrap();
        let evicted = crate::rss::current_rss_bytes().unwrap();
        assert!(
            touched.saturating_sub(evicted) > 48 << 20,
            "rss {touched} -> {evicted}"
        );
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
        let mut r = AlignedBuf::<f32>::zeroed(10).unwrap();
        r[3] = 1.0;
        r.evict().unwrap();
        assert_eq!(r[3], 1.0);
    }

    /// A fresh buffer must not be resident: its pages are touched only when
    /// the trainer writes them (the 14 B/param budget depends on it).
    #[cfg(target_os = "linux")]
    #[test]
    fn zeroed_allocation_does_not_touch_pages() {
        let len = 64 << 20; // 256 MiB of f32
        let before = crate::rss::current_rss_bytes().unwrap();
        let b = AlignedBuf::<f32>::zeroed(len).unwrap();
        let after = crate::rss::current_rss_bytes().unwrap();
        assert_eq!(b.len(), len);
        // Other tests run concurrently and allocate a little; 256 MiB touched
        // would dwarf that.
        assert!(
            after.saturating_sub(before) < 32 << 20,
            "rss grew {}",
            after - before
        );
    }
}
