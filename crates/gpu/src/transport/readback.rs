//! Downloads through pooled readback buffers. Gradient downloads overlap
//! compute: the layer's gradient tensors are copied into one readback buffer
//! and its mapping is requested at once; the host collects the bytes later,
//! after the device has moved on to the next layer. Single-tensor downloads
//! use the same pool and wait. On a device with a copy queue, range
//! downloads go there instead (`side_readback`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use megatrain_tensor::{DType, Error, Landed, LandedF32, Result, TransportStats};

use super::side_readback::{Landing, SideReadback};
use super::{Copying, Link, MapState, nanos};
use crate::GpuError;
use crate::tensor::GpuTensor;

/// Readback buffers not in use, by (usage, size class).
#[derive(Default)]
pub(crate) struct ReadbackPool {
    free: HashMap<(u32, u64), Vec<wgpu::Buffer>>,
    /// Buffers lent out as [`Landed`] values, and those given back (on
    /// whichever thread dropped them) since the pool last looked.
    lent: Arc<Mutex<Lent>>,
    /// (usage bits, size class, count) of the last [`ReadbackPool::reserve`]:
    /// range downloads of that usage up to the class take a buffer of it.
    reserved: Option<(u32, u64, usize)>,
    /// Where range downloads go on a device with a copy queue.
    side: Option<SideReadback>,
    /// Most pieces of a whole download (`GpuOptions::download_pieces`).
    max_pieces: usize,
    /// `DownloadStaging::Layer`: a layer's chunks come from one copy of the
    /// whole layer made as its first chunk is begun.
    layer_staging: bool,
    /// Those copies, each until its layer's last chunk is begun: the
    /// trainer begins a layer's first chunks before it has begun the last
    /// of the layer before.
    layers: Vec<LayerCopy>,
}

/// Layer copies kept at most (a caller that never begins a layer's last
/// chunk leaves its copy behind; the oldest goes first).
const LAYER_COPIES_KEPT: usize = 3;

/// The whole of a layer's gradients copied on the device
/// (`SideReadback::snapshot`), for its chunks.
struct LayerCopy {
    /// The tensors copied: (buffer, byte offset, elements) of each.
    of: Vec<(wgpu::Buffer, u64, usize)>,
    buf: Arc<crate::arena::PooledBuffer>,
    /// The element the next chunk taken from it starts at: a chunk that
    /// does not continue the last copies the layer afresh.
    next: usize,
}

/// Largest layer copied whole under `DownloadStaging::Layer` (its f32
/// gradients); larger ones (a large vocabulary's embedding or head) come
/// down chunk by chunk as before, so that no device buffer is sized by the
/// vocabulary twice over.
pub const LAYER_COPY_MAX_BYTES: u64 = 1 << 30;

#[derive(Default)]
struct Lent {
    bytes: u64,
    back: Vec<wgpu::Buffer>,
}

/// A readback buffer's f32 values, read in place; unmapped and given back
/// to the pool when dropped.
struct InPlace {
    /// Dropped before the unmap.
    view: Option<wgpu::BufferView>,
    buf: wgpu::Buffer,
    len: usize,
    home: Arc<Mutex<Lent>>,
}

impl LandedF32 for InPlace {
    fn as_f32(&self) -> &[f32] {
        let view = self.view.as_ref().expect("mapped until dropped");
        bytemuck::cast_slice(&view[..4 * self.len])
    }
}

impl Drop for InPlace {
    fn drop(&mut self) {
        self.view = None;
        self.buf.unmap();
        // A poisoned pool (a panic elsewhere) just loses the buffer.
        if let Ok(mut lent) = self.home.lock() {
            lent.bytes -= self.buf.size();
            lent.back.push(self.buf.clone());
        }
    }
}

/// Whole downloads of at least this many bytes are copied in consecutive
/// pieces (at most [`DOWNLOAD_PARTS`], none under [`DOWNLOAD_PIECE_MIN`]),
/// each its own copy and landing, so that the host decodes one piece while
/// the bus carries the next: the time is the copy's plus one piece's
/// decoding, not the two added.
pub const DOWNLOAD_SPLIT_BYTES: u64 = 16 << 20;
pub const DOWNLOAD_PARTS: usize = 8;
/// Smallest piece: each costs a submission and a wait of its own.
pub const DOWNLOAD_PIECE_MIN: u64 = 8 << 20;

/// One download in flight.
pub(crate) struct PendingRead {
    at: At,
    /// (dtype, elements, byte offset) of each tensor, in order.
    layout: Vec<(DType, usize, u64)>,
    bytes: u64,
    /// Elements of the whole download (this piece and `rest`).
    pub numel: usize,
    /// The download's later pieces, in order (a large download begun
    /// whole), still copying while this one is decoded.
    rest: Vec<PendingRead>,
}

/// Where a download lands.
enum At {
    /// A readback buffer wgpu copies into and maps.
    Mapped {
        buf: wgpu::Buffer,
        map: MapState,
        copy: Copying,
    },
    /// Host memory the copy queue copies into.
    Side(Landing),
}

impl ReadbackPool {
    /// A pool whose range downloads go through `side` where given, and
    /// whose large whole downloads travel in up to `max_pieces` pieces;
    /// with `layer_staging`, a layer's chunks come from one device copy of
    /// the layer (where `side` is given).
    pub fn new(side: Option<SideReadback>, max_pieces: usize, layer_staging: bool) -> Self {
        ReadbackPool {
            side,
            max_pieces,
            layer_staging,
            ..Default::default()
        }
    }

    /// Lets the parked readback buffers go (remade when a download needs
    /// one): after the transport's calibration its gradient-sized whole
    /// downloads leave some that the step's chunked downloads (the copy
    /// queue's, or the reserved class) never take.
    pub fn release_parked(&mut self) {
        self.free.clear();
    }

    /// Host-visible bytes the pool owns: parked, or lent out as
    /// [`Landed`] values.
    pub fn pooled_bytes(&self) -> u64 {
        let lent = self.lent.lock().expect("readback pool poisoned");
        let back: u64 = lent.back.iter().map(|b| b.size()).sum();
        let side = self.side.as_ref().map_or(0, SideReadback::host_bytes);
        self.free.values().flatten().map(|b| b.size()).sum::<u64>() + lent.bytes + back + side
    }

    /// Waits for `p` to land, counting the time as the download's.
    fn wait(&self, link: &Link<'_>, p: &PendingRead, stats: &mut TransportStats) -> Result<()> {
        match &p.at {
            At::Mapped { map, copy, .. } => link.wait_copy(
                copy,
                map,
                &mut stats.down_wait_compute_ns,
                &mut stats.down_wait_copy_ns,
            ),
            At::Side(l) => self
                .side
                .as_ref()
                .expect("a side landing has its pool")
                .wait(l, stats),
        }
    }

    /// Makes `count` buffers of `usage` for downloads of up to `bytes`
    /// each, and serves every smaller range download from them: chunks,
    /// small layers and a layer's tail then share one size class whose
    /// buffers exist before a step needs them. Buffers lent as [`Landed`]
    /// values stay out while the optimizer reads them, so how many are out
    /// at once depends on its pace; made up front, enough of them keep a
    /// warm step from making any. Call it only where
    /// [`ReadbackPool::is_reserved`] says it is not the last one asked.
    pub fn reserve(
        &mut self,
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        bytes: u64,
        count: usize,
        stats: &mut TransportStats,
    ) -> Result<()> {
        let class = crate::arena::size_class(bytes.max(4));
        self.reserved = Some((usage.bits(), class, count));
        if let Some(side) = &mut self.side {
            return side.reserve(class, count, stats);
        }
        let free = self.free.get(&(usage.bits(), class)).map_or(0, Vec::len);
        for _ in free..count {
            let b = Self::make(link, usage, class, stats)?;
            self.recycle(b);
        }
        Ok(())
    }

    /// Whether [`ReadbackPool::reserve`] was last asked for the same.
    pub fn is_reserved(&self, usage: wgpu::BufferUsages, bytes: u64, count: usize) -> bool {
        self.reserved == Some((usage.bits(), crate::arena::size_class(bytes.max(4)), count))
    }

    /// Bytes a range download of `bytes` takes a buffer of.
    fn reserved_class(&self, usage: wgpu::BufferUsages, bytes: u64) -> u64 {
        match self.reserved {
            Some((u, class, _)) if u == usage.bits() && bytes <= class => class,
            _ => bytes,
        }
    }

    /// Hands `p`'s values over where they landed, once its copy is done,
    /// when every tensor in it is f32 (so the mapped bytes are the values,
    /// in order) and the mapping is 4-byte aligned; otherwise `p` comes
    /// back for [`ReadbackPool::finish`].
    pub fn finish_in_place(
        &mut self,
        link: &Link<'_>,
        p: PendingRead,
        stats: &mut TransportStats,
    ) -> Result<std::result::Result<Landed, PendingRead>> {
        // A download in pieces lands in several buffers: not one slice.
        if !p.rest.is_empty() || p.layout.iter().any(|&(dtype, _, _)| dtype != DType::F32) {
            return Ok(Err(p));
        }
        self.wait(link, &p, stats)?;
        debug_assert_eq!(p.bytes, 4 * p.numel as u64, "f32 pieces skip nothing");
        let (buf, map, copy) = match p.at {
            At::Side(l) => {
                stats.downloads_in_place += 1;
                let side = self.side.as_ref().expect("a side landing has its pool");
                return Ok(Ok(side.lend(l, p.numel)));
            }
            At::Mapped { buf, map, copy } => (buf, map, copy),
        };
        let view = buf
            .get_mapped_range(0..p.bytes.max(4))
            .map_err(|e| GpuError::Map(e.to_string()))?;
        if view.as_ptr().align_offset(align_of::<f32>()) != 0 {
            drop(view);
            let at = At::Mapped { buf, map, copy };
            return Ok(Err(PendingRead { at, ..p }));
        }
        stats.downloads_in_place += 1;
        self.lent.lock().expect("readback pool poisoned").bytes += buf.size();
        Ok(Ok(Landed::new(InPlace {
            view: Some(view),
            buf,
            len: p.numel,
            home: Arc::clone(&self.lent),
        })))
    }

    /// Copies `tensors` into a readback buffer of `usage` and starts mapping it.
    pub fn begin(
        &mut self,
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        tensors: &[GpuTensor],
        stats: &mut TransportStats,
    ) -> Result<PendingRead> {
        let total: usize = tensors.iter().map(|t| t.numel()).sum();
        let bytes: u64 = tensors
            .iter()
            .map(|t| (t.numel() * t.dtype.size_in_bytes()) as u64)
            .sum();
        let pieces = (bytes / DOWNLOAD_PIECE_MIN).clamp(1, self.max_pieces.max(1) as u64) as usize;
        if bytes < DOWNLOAD_SPLIT_BYTES || pieces < 2 {
            return self.begin_range(link, usage, tensors, 0..total, stats);
        }
        let step = total.div_ceil(pieces);
        let mut parts = Vec::with_capacity(pieces);
        for s in (0..total).step_by(step) {
            parts.push(self.begin_range(link, usage, tensors, s..(s + step).min(total), stats)?);
        }
        let mut head = parts.remove(0);
        head.numel = total;
        head.rest = parts;
        Ok(head)
    }

    /// Waits for `p`, widens its tensors to f32 into `out` on `pool`'s
    /// threads and recycles the buffer (also when `out` has the wrong
    /// length, which is an error); piece by piece where `p` has several,
    /// each decoded while the later ones still copy.
    pub fn finish(
        &mut self,
        link: &Link<'_>,
        mut p: PendingRead,
        out: &mut [f32],
        pool: &rayon::ThreadPool,
        stats: &mut TransportStats,
    ) -> Result<()> {
        if p.rest.is_empty() {
            return self.finish_piece(link, p, out, pool, stats);
        }
        let rest = std::mem::take(&mut p.rest);
        let total = p.numel;
        p.numel -= rest.iter().map(|r| r.numel).sum::<usize>();
        let mut result = match out.len() == total {
            true => Ok(()),
            false => Err(Error::shape(
                "finish_download",
                format!("{total} elements into a destination of {}", out.len()),
            )),
        };
        // Every piece lands and goes back to the pool, also after an error.
        let mut left = if result.is_ok() { out } else { &mut [][..] };
        for piece in std::iter::once(p).chain(rest) {
            let n = if result.is_ok() { piece.numel } else { 0 };
            let (here, later) = std::mem::take(&mut left).split_at_mut(n);
            left = later;
            let r = match result.is_ok() {
                true => self.finish_piece(link, piece, here, pool, stats),
                false => self.finish_piece(link, piece, &mut [], pool, stats).or(Ok(())),
            };
            result = result.and(r);
        }
        result
    }

    /// [`ReadbackPool::finish`] of one piece.
    fn finish_piece(
        &mut self,
        link: &Link<'_>,
        p: PendingRead,
        out: &mut [f32],
        pool: &rayon::ThreadPool,
        stats: &mut TransportStats,
    ) -> Result<()> {
        self.wait(link, &p, stats)?;
        let t = Instant::now();
        let result = if out.len() != p.numel {
            Err(Error::shape(
                "finish_download",
                format!("{} elements into a destination of {}", p.numel, out.len()),
            ))
        } else {
            Self::decode(&p, out, pool)
        };
        stats.down_read_ns += nanos(t.elapsed());
        match p.at {
            At::Mapped { buf, .. } => {
                buf.unmap();
                self.recycle(buf);
            }
            At::Side(l) => self
                .side
                .as_mut()
                .expect("a side landing has its pool")
                .recycle(l),
        }
        result
    }

    /// Copies `bytes` bytes of `buf` from `offset` to the host and waits for
    /// them (the blocking download of one tensor).
    pub fn read(&mut self, link: &Link<'_>, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        let rb = self.take(
            link,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            bytes,
            &mut TransportStats::default(),
        )?;
        let mut enc = link.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, offset, &rb, 0, bytes);
        let copy = link.submit(enc, &[buf]);
        let map = MapState::default();
        map.map(&rb, wgpu::MapMode::Read, bytes);
        // On an error the buffer is dropped, never pooled half-mapped.
        link.wait_for(&copy)?;
        link.wait_map(&map)?;
        let out = rb
            .get_mapped_range(0..bytes)
            .map_err(|e| GpuError::Map(e.to_string()))?
            .to_vec();
        rb.unmap();
        self.recycle(rb);
        Ok(out)
    }

    /// A free buffer of `usage` holding at least `bytes`, pooled by size class.
    fn take(
        &mut self,
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        bytes: u64,
        stats: &mut TransportStats,
    ) -> Result<wgpu::Buffer> {
        let back = std::mem::take(&mut self.lent.lock().expect("readback pool poisoned").back);
        for b in back {
            self.recycle(b);
        }
        let class = crate::arena::size_class(bytes.max(4));
        self.free
            .get_mut(&(usage.bits(), class))
            .and_then(Vec::pop)
            .map_or_else(|| Self::make(link, usage, class, stats), Ok)
    }

    fn make(
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        class: u64,
        stats: &mut TransportStats,
    ) -> Result<wgpu::Buffer> {
        stats.buffers_created += 1;
        link.create_buffer(
            "readback buffer",
            &wgpu::BufferDescriptor {
                label: Some("readback"),
                size: class,
                usage,
                mapped_at_creation: false,
            },
        )
    }

    fn recycle(&mut self, buf: wgpu::Buffer) {
        self.free
            .entry((buf.usage().bits(), buf.size()))
            .or_default()
            .push(buf);
    }

    fn decode(p: &PendingRead, out: &mut [f32], pool: &rayon::ThreadPool) -> Result<()> {
        match &p.at {
            At::Mapped { buf, .. } => {
                let view = buf
                    .get_mapped_range(0..p.bytes.max(4))
                    .map_err(|e| GpuError::Map(e.to_string()))?;
                super::image::read_par(pool, &view, &p.layout, out);
            }
            At::Side(l) => super::image::read_par(pool, &l.bytes()[..p.bytes as usize], &p.layout, out),
        }
        Ok(())
    }
}

/// Partial downloads: a chunk of a layer, so that readback buffers are
/// sized by the chunk, not by the largest layer.
impl ReadbackPool {
    /// Copies elements `range` of the concatenation of `tensors` into a
    /// readback buffer of `usage` and starts mapping it. Copies move whole
    /// 4-byte words: a cut inside a 16-bit tensor copies one element more,
    /// skipped when decoding.
    pub fn begin_range(
        &mut self,
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        tensors: &[GpuTensor],
        range: std::ops::Range<usize>,
        stats: &mut TransportStats,
    ) -> Result<PendingRead> {
        let t0 = Instant::now();
        // (tensor, source byte offset, bytes to copy, skipped leading bytes, elements).
        let mut pieces = Vec::new();
        let mut start = 0;
        for t in tensors {
            let (lo, hi) = (range.start.max(start), range.end.min(start + t.numel()));
            if lo < hi {
                let size = t.dtype.size_in_bytes() as u64;
                let a = t.offset + (lo - start) as u64 * size;
                let b = t.offset + (hi - start) as u64 * size;
                let (a4, b4) = (a / 4 * 4, b.div_ceil(4) * 4);
                pieces.push((t, a4, b4 - a4, a - a4, hi - lo));
            }
            start += t.numel();
        }
        let mut layout = Vec::with_capacity(pieces.len());
        let mut bytes = 0u64;
        for &(t, _, len, skip, n) in &pieces {
            layout.push((t.dtype, n, bytes + skip));
            bytes += len;
        }
        let class = self.reserved_class(usage, bytes);
        let total: usize = tensors.iter().map(GpuTensor::numel).sum();
        let all_f32 = tensors.iter().all(|t| t.dtype == DType::F32);
        if let Some(side) = &mut self.side {
            let host_class = crate::arena::size_class(class.max(4));
            let l = if self.layer_staging
                && all_f32
                && range.len() < total
                && 4 * total as u64 <= LAYER_COPY_MAX_BYTES
            {
                let of: Vec<_> = tensors
                    .iter()
                    .map(|t| (t.buffer().clone(), t.offset, t.numel()))
                    .collect();
                let known = self.layers.iter().position(|l| l.of == of);
                let at = match known {
                    // Only the chunk that continues the last one reads the
                    // copy: any other (a first chunk, new gradients in the
                    // buffers of an earlier step's) copies the layer afresh.
                    Some(i) if range.start > 0 && self.layers[i].next == range.start => i,
                    _ => {
                        if let Some(i) = known {
                            self.layers.remove(i);
                        }
                        if self.layers.len() == LAYER_COPIES_KEPT {
                            self.layers.remove(0);
                        }
                        let whole: Vec<_> = tensors
                            .iter()
                            .map(|t| (t.buffer(), t.offset, 4 * t.numel() as u64))
                            .collect();
                        let buf = side.snapshot(link, &whole)?;
                        self.layers.push(LayerCopy { of, buf, next: 0 });
                        self.layers.len() - 1
                    }
                };
                self.layers[at].next = range.end;
                let copy = self.layers[at].buf.clone();
                let l = side.begin_from(&copy, 4 * range.start as u64, bytes, host_class, stats)?;
                if range.end == total {
                    self.layers.remove(at);
                }
                l
            } else {
                let pieces: Vec<_> = pieces
                    .iter()
                    .map(|&(t, from, len, _, _)| (t.buffer(), from, len))
                    .collect();
                side.begin(link, &pieces, host_class, stats)?
            };
            stats.down_submit_ns += nanos(t0.elapsed());
            stats.downloads += 1;
            stats.bytes_down += bytes;
            return Ok(PendingRead {
                at: At::Side(l),
                numel: range.len(),
                layout,
                bytes,
                rest: Vec::new(),
            });
        }
        let buf = self.take(link, usage, class, stats)?;
        let mut enc = link.device.create_command_encoder(&Default::default());
        let mut at = 0;
        for &(t, from, len, _, _) in &pieces {
            enc.copy_buffer_to_buffer(t.buffer(), from, &buf, at, len);
            at += len;
        }
        let sources: Vec<&wgpu::Buffer> = pieces.iter().map(|p| p.0.buffer()).collect();
        let copy = link.submit_copy(enc, &sources);
        let map = MapState::default();
        map.map(&buf, wgpu::MapMode::Read, bytes.max(4));
        stats.down_submit_ns += nanos(t0.elapsed());
        stats.downloads += 1;
        stats.bytes_down += bytes;
        Ok(PendingRead {
            at: At::Mapped { buf, map, copy },
            numel: range.len(),
            layout,
            bytes,
            rest: Vec::new(),
        })
    }
}
