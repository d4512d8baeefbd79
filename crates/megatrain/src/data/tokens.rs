//! The ids of a token stream: decoded into memory (`.jsonl`, short texts),
//! or read in place through a memory map from a nanoGPT `.bin` (u16,
//! little-endian) or a text's cached ids (u32, [`super::cache`]). A corpus of billions of tokens then costs page cache, which the
//! kernel can reclaim, instead of 4 bytes a token of the process's own
//! memory beside the host tier (a 9B-token corpus was 36 GB of it).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use megatrain_tier::rss::release_mapped;
use memmap2::Mmap;
use rayon::prelude::*;

use super::Fnv1a;

#[derive(Clone)]
pub struct Tokens(Repr);

#[derive(Clone)]
enum Repr {
    Owned(Vec<u32>),
    /// Ids `range` of the map's little-endian ids of `width` bytes (2, 4);
    /// `flagged`: each u32 word's top bit is not part of the id but a flag
    /// ([`FLAG`]: instruction data's cached ids carry their loss mask so).
    Mapped {
        map: Arc<Mmap>,
        range: Range<usize>,
        width: usize,
        flagged: bool,
    },
}

/// The bit of a flagged stream's words that is not part of the id: set
/// where the loss does not count the token (`.jsonl` prompts).
pub(crate) const FLAG: u32 = 1 << 31;

/// The other bit of a flagged stream's words that is not part of the id:
/// set on the first token of each record (`.jsonl` records), so that a
/// mapped instruction set knows where its records start without a file
/// beside it.
pub(crate) const START: u32 = 1 << 30;

/// The word in `b`, little-endian, of its 2 or 4 bytes.
fn word(b: &[u8]) -> u32 {
    match *b {
        [x, y] => u16::from_le_bytes([x, y]) as u32,
        [x, y, z, w] => u32::from_le_bytes([x, y, z, w]),
        _ => unreachable!("ids are 2 or 4 bytes"),
    }
}

/// The id of the word in `b` (less the flags of a flagged stream).
fn decode(b: &[u8], flagged: bool) -> u32 {
    match flagged {
        true => word(b) & !(FLAG | START),
        false => word(b),
    }
}

/// The ids of a part of a mapped stream, decoded as they are read.
struct Ids<'a> {
    words: std::slice::ChunksExact<'a, u8>,
    flagged: bool,
}

impl Iterator for Ids<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        self.words.next().map(|b| decode(b, self.flagged))
    }
}

/// Tokens per task when a mapped stream is scanned on every core.
const SCAN_PART: usize = 1 << 20;

impl Tokens {
    /// The ids of a whole map, little-endian, of `width` bytes each (2 for
    /// a `.bin`, 4 for a text's cached ids); the map's length is a multiple.
    pub(crate) fn mapped(map: Mmap, width: usize) -> Tokens {
        Self::mapped_as(map, width, false)
    }

    /// A map of u32 words whose top bit is a flag ([`FLAG`]), not part of
    /// the id: read by [`Tokens::flagged`].
    pub(crate) fn mapped_flagged(map: Mmap) -> Tokens {
        Self::mapped_as(map, 4, true)
    }

    fn mapped_as(map: Mmap, width: usize, flagged: bool) -> Tokens {
        assert!(
            matches!(width, 2 | 4) && map.len().is_multiple_of(width),
            "whole ids"
        );
        // Read whole first (the vocabulary check): ahead of the reads.
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Sequential);
        let range = 0..map.len() / width;
        Tokens(Repr::Mapped {
            map: Arc::new(map),
            range,
            width,
            flagged,
        })
    }

    /// The ids of a map's part, as its bytes (one id every `width`).
    fn bytes<'a>(map: &'a Mmap, range: &Range<usize>, width: usize) -> &'a [u8] {
        &map[width * range.start..width * range.end]
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Owned(v) => v.len(),
            Repr::Mapped { range, .. } => range.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Says that from now on the ids are read a window at a time at
    /// scattered offsets (batches): a mapped stream then reads from the
    /// disk only the pages a window needs, not the kernel's read-ahead.
    pub fn expect_scattered_reads(&self) {
        #[cfg(unix)]
        if let Repr::Mapped { map, .. } = &self.0 {
            let _ = map.advise(memmap2::Advice::Random);
        }
    }

    /// Hands the pages of ids `start..start + len` (wrapping at the end)
    /// of a mapped stream back once a batch has copied them, with the
    /// 64 KiB-aligned block around them: Linux maps that much of the cached
    /// file around each fault (`fault_around_bytes`), so without this every
    /// row left ≈ 64 KiB in the resident set: 214 MB more peak RSS after
    /// 3,600 rows of a 1 GB `.bin` (BENCHMARKS.md), growing all run long.
    pub fn release_window(&self, start: usize, len: usize) {
        let Repr::Mapped {
            map, range, width, ..
        } = &self.0
        else {
            return;
        };
        let n = range.len();
        let start = start % n.max(1);
        let end = start + len.min(n);
        let byte = |id: usize| width * (range.start + id);
        release_around(map, byte(start), byte(end.min(n)));
        if end > n {
            release_around(map, byte(0), byte(end - n));
        }
    }

    /// Whether the ids are read in place from a file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped { .. })
    }

    /// Id `i`; panics past the end, like a slice.
    pub fn get(&self, i: usize) -> u32 {
        match &self.0 {
            Repr::Owned(v) => v[i],
            Repr::Mapped {
                map,
                range,
                width,
                flagged,
            } => decode(Self::at(map, range, *width, i), *flagged),
        }
    }

    /// The bytes of word `i` of a map's part.
    fn at<'a>(map: &'a Mmap, range: &Range<usize>, width: usize, i: usize) -> &'a [u8] {
        assert!(i < range.len(), "token {i} of {}", range.len());
        let at = width * (range.start + i);
        &map[at..at + width]
    }

    /// Whether token `i` carries the flag ([`FLAG`]): never for a stream
    /// that is not flagged. Panics past the end, like a slice.
    pub(crate) fn flagged(&self, i: usize) -> bool {
        match &self.0 {
            Repr::Mapped {
                map,
                range,
                flagged: true,
                ..
            } => word(Self::at(map, range, 4, i)) & FLAG != 0,
            _ => {
                assert!(i < self.len(), "token {i} of {}", self.len());
                false
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Where the records of a flagged stream start (the words with
    /// [`START`]), ascending, on every core; `None` for a stream that is
    /// not flagged.
    pub(crate) fn record_starts(&self) -> Option<Vec<usize>> {
        let Repr::Mapped {
            map,
            range,
            flagged: true,
            ..
        } = &self.0
        else {
            return None;
        };
        let parts: Vec<Vec<usize>> = Self::bytes(map, range, 4)
            .par_chunks(4 * SCAN_PART)
            .enumerate()
            .map(|(part, bytes)| {
                let starts = bytes
                    .chunks_exact(4)
                    .enumerate()
                    .filter(|(_, b)| word(b) & START != 0)
                    .map(|(i, _)| part * SCAN_PART + i)
                    .collect();
                release_mapped(map, bytes);
                starts
            })
            .collect();
        Some(parts.concat())
    }

    /// Every index whose id is `id`, ascending, on every core (a mapped
    /// stream's pages handed back as each part is read).
    pub fn positions_of(&self, id: u32) -> Vec<usize> {
        let parts: Vec<Vec<usize>> = match &self.0 {
            Repr::Owned(v) => v
                .par_chunks(SCAN_PART)
                .enumerate()
                .map(|(part, ids)| {
                    let found = ids.iter().enumerate().filter(|&(_, &t)| t == id);
                    found.map(|(i, _)| part * SCAN_PART + i).collect()
                })
                .collect(),
            Repr::Mapped { .. } => self
                .scan_mapped(|part, ids| {
                    let found = ids.enumerate().filter(|&(_, t)| t == id);
                    found.map(|(i, _)| part * SCAN_PART + i).collect()
                })
                .expect("a mapped stream")
                .collect(),
        };
        parts.concat()
    }

    pub fn to_vec(&self) -> Vec<u32> {
        match &self.0 {
            Repr::Owned(v) => v.clone(),
            Repr::Mapped { .. } => self.iter().collect(),
        }
    }

    /// Keeps ids `..at` and returns `at..` (as `Vec::split_off`); a mapped
    /// stream's two parts share the map.
    pub fn split_off(&mut self, at: usize) -> Tokens {
        match &mut self.0 {
            Repr::Owned(v) => Tokens(Repr::Owned(v.split_off(at))),
            Repr::Mapped {
                map,
                range,
                width,
                flagged,
            } => {
                assert!(at <= range.len(), "split at {at} of {}", range.len());
                let mid = range.start + at;
                let tail = mid..range.end;
                range.end = mid;
                Tokens(Repr::Mapped {
                    map: Arc::clone(map),
                    range: tail,
                    width: *width,
                    flagged: *flagged,
                })
            }
        }
    }

    /// The index of the first id ≥ `bound`, on every core for a mapped
    /// stream (one read of the file, whose pages leave the resident set
    /// again as each part is scanned: a run touches only what it samples).
    pub fn first_at_least(&self, bound: u32) -> Option<usize> {
        match &self.0 {
            Repr::Owned(v) => v.iter().position(|&t| t >= bound),
            Repr::Mapped { .. } => self
                .scan_mapped(|part, mut ids| ids.position(|t| t >= bound).map(|i| part * SCAN_PART + i))?
                .find_map_first(|found| found),
        }
    }

    /// A mapped stream's ids in parts of `SCAN_PART`, on every core: `f` of
    /// each part's index and ids, the part's pages handed back once `f` has
    /// read them. `None` for ids held in memory.
    fn scan_mapped<'a, R: Send + 'a>(
        &'a self,
        f: impl Fn(usize, Ids<'_>) -> R + Sync + Send + 'a,
    ) -> Option<impl IndexedParallelIterator<Item = R> + 'a> {
        let Repr::Mapped {
            map,
            range,
            width,
            flagged,
        } = &self.0
        else {
            return None;
        };
        let (width, flagged) = (*width, *flagged);
        Some(
            Self::bytes(map, range, width)
                .par_chunks(width * SCAN_PART)
                .enumerate()
                .map(move |(part, bytes)| {
                    let ids = Ids {
                        words: bytes.chunks_exact(width),
                        flagged,
                    };
                    let r = f(part, ids);
                    release_mapped(map, bytes);
                    r
                }),
        )
    }
}

impl Tokens {
    /// FNV-1a of each part of `SCAN_PART` ids, on every core (a mapped
    /// stream's pages handed back as each part is read), then FNV-1a over
    /// those: equal for equal ids, whether owned or mapped.
    pub fn fingerprint(&self) -> u64 {
        let parts: Vec<u64> = match &self.0 {
            Repr::Owned(v) => v
                .par_chunks(SCAN_PART)
                .map(|ids| Fnv1a::of(ids.iter().map(|&t| t as u64)))
                .collect(),
            Repr::Mapped { .. } => self
                .scan_mapped(|_, ids| Fnv1a::of(ids.map(u64::from)))
                .expect("a mapped stream")
                .collect(),
        };
        Fnv1a::of(parts)
    }
}

/// The most Linux maps on one fault in a file mapping, aligned in the
/// address space: `fault_around_bytes` (64 KiB) of small pages, but a whole
/// large folio where the page cache holds one, up to a PMD (2 MiB on
/// x86-64). A file just written (a text's cached ids) sits in large folios
/// on ext4 from Linux 6.x: with 64 KiB blocks the resident set of a fresh
/// run grew by 8 MB a step (600 MB after 170 steps, kernel 6.18).
const FAULT_AROUND: usize = 2 << 20;

/// [`release_mapped`] of bytes `from..to` of `map` widened to the
/// [`FAULT_AROUND`] blocks that hold them.
fn release_around(map: &Mmap, from: usize, to: usize) {
    let base = map.as_ptr() as usize;
    let lo = ((base + from) & !(FAULT_AROUND - 1)).max(base) - base;
    let hi = ((base + to).next_multiple_of(FAULT_AROUND) - base).min(map.len());
    release_mapped(map, &map[lo..hi]);
}

impl From<Vec<u32>> for Tokens {
    fn from(v: Vec<u32>) -> Self {
        Tokens(Repr::Owned(v))
    }
}

impl FromIterator<u32> for Tokens {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        Tokens(Repr::Owned(iter.into_iter().collect()))
    }
}

impl PartialEq for Tokens {
    fn eq(&self, other: &Tokens) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Tokens {}

impl PartialEq<Vec<u32>> for Tokens {
    fn eq(&self, other: &Vec<u32>) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().copied())
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 64;
        let kind = if self.is_mapped() { "mapped" } else { "owned" };
        write!(f, "Tokens({kind}, {} ids: ", self.len())?;
        f.debug_list().entries(self.iter().take(SHOWN)).finish()?;
        if self.len() > SHOWN {
            write!(f, " …")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(ids: &[u16]) -> (tempfile::NamedTempFile, Tokens) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::io::Write::write_all(&mut f, &bytes).unwrap();
        // SAFETY: a file of this test's own, not changed while mapped.
        let map = unsafe { Mmap::map(f.as_file()) }.unwrap();
        (f, Tokens::mapped(map, 2))
    }

    #[test]
    fn a_mapped_stream_reads_as_the_owned_one_and_splits_alike() {
        let ids: Vec<u16> = (0..1000u32).map(|i| (i * 7919 % 65536) as u16).collect();
        let (_f, mut m) = mapped(&ids);
        let mut o: Tokens = ids.iter().map(|&t| t as u32).collect();
        assert!(m.is_mapped() && !o.is_mapped());
        assert_eq!(m, o);
        assert_eq!(m.get(999), 999 * 7919 % 65536);
        let (mt, ot) = (m.split_off(900), o.split_off(900));
        assert_eq!((m.len(), mt.len()), (900, 100));
        assert!(mt.is_mapped());
        assert_eq!((&m, &mt), (&o, &ot));
        assert_eq!(mt.to_vec(), ot.to_vec());
        assert_eq!(mt.get(0), ids[900] as u32);
    }

    #[test]
    fn the_first_id_past_a_bound_is_found_across_parts() {
        let mut ids = vec![3u16; 2 * SCAN_PART + 10];
        ids[SCAN_PART + 5] = 300;
        ids[2 * SCAN_PART + 1] = 400;
        let (_f, mut m) = mapped(&ids);
        let o: Tokens = ids.iter().map(|&t| t as u32).collect();
        for t in [&m, &o] {
            assert_eq!(t.first_at_least(256), Some(SCAN_PART + 5));
            assert_eq!(t.first_at_least(301), Some(2 * SCAN_PART + 1));
            assert_eq!(t.first_at_least(401), None);
        }
        let tail = m.split_off(SCAN_PART + 6);
        assert_eq!(tail.first_at_least(256), Some(SCAN_PART - 5));
    }

    #[test]
    fn the_fingerprint_is_of_the_ids_alone() {
        let ids: Vec<u16> = (0..SCAN_PART as u32 + 77).map(|i| (i % 50_000) as u16).collect();
        let (_f, m) = mapped(&ids);
        let mut o: Tokens = ids.iter().map(|&t| t as u32).collect();
        assert_eq!(m.fingerprint(), o.fingerprint());
        let one = o.fingerprint();
        o = o
            .iter()
            .enumerate()
            .map(|(i, t)| if i == SCAN_PART + 3 { t + 1 } else { t })
            .collect();
        assert_ne!(o.fingerprint(), one);
        let mut short = m.clone();
        short.split_off(ids.len() - 1);
        assert_ne!(short.fingerprint(), one);
    }

    #[test]
    fn released_windows_read_back_the_same() {
        let ids: Vec<u16> = (0..100_000u32).map(|i| (i * 31 % 65521) as u16).collect();
        let (_f, m) = mapped(&ids);
        for (start, len) in [
            (0, 10),
            (40_000, 33_000),
            (99_990, 30),
            (150_000, 5),
            (7, 100_000),
        ] {
            m.release_window(start, len);
            assert!(ids.iter().enumerate().all(|(i, &t)| m.get(i) == t as u32));
        }
        let o: Tokens = ids.iter().map(|&t| t as u32).collect();
        o.release_window(3, 4);
        assert_eq!(o, m);
    }

    #[test]
    #[should_panic(expected = "token 5 of 5")]
    fn reading_past_the_end_panics_as_a_slice_does() {
        let (_f, m) = mapped(&[1, 2, 3, 4, 5]);
        m.get(5);
    }
}
