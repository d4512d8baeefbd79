//! `GpuExecutor`'s side of the layer transport: weight slots, gradient
//! downloads in flight, and the per-adapter choice between the transports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use megatrain_tensor::{
    DType, Download, Error, Executor, HostSlice, Landed, Result, Shape, TransportInfo, TransportStats,
    WeightSlot, WeightUpload,
};

use super::{GpuExecutor, GpuOptions};
use crate::GpuError;
use crate::copy_queue::CopyQueue;
use crate::host_import::Region;
use crate::tensor::{GpuTensor, storage_bytes};
use crate::transport::{
    Image, Link, MapState, MappedTransport, PendingRead, ReadbackPool, SideReadback, SlotBuffer,
    StagingTransport, Transport, TransportChoice, copy_pool,
};

/// One weight slot: a buffer laid out for one table, the tensors over it,
/// and the transport that wrote it (slot buffers of the two differ in usage).
struct Slot {
    buffer: SlotBuffer,
    layout: Vec<(Shape, DType)>,
    bytes: u64,
    by: TransportChoice,
    tensors: Vec<GpuTensor>,
    /// Set where the copy queue writes the slot (its buffer was made by it).
    side: Option<SideSlot>,
}

/// The copies out of one registered range: (its offset, the slot's
/// offset, bytes).
type RangeCopies = (Arc<Region>, Vec<(u64, u64, u64)>);

/// A slot buffer the copy queue tracks, until the slot lets it go.
struct SideSlot {
    queue: Arc<CopyQueue>,
    buf: wgpu::Buffer,
}

impl Drop for SideSlot {
    fn drop(&mut self) {
        self.queue.forget(&self.buf);
    }
}

pub(crate) struct TransportState {
    /// The transport in use and why, once decided.
    active: Option<(TransportChoice, TransportInfo)>,
    staging: StagingTransport,
    mapped: MappedTransport,
    slots: HashMap<WeightSlot, Slot>,
    readback: ReadbackPool,
    pending: HashMap<u64, PendingRead>,
    next_ticket: u64,
    stats: TransportStats,
    /// Threads copying into and out of mapped memory, and how many.
    pool: Option<rayon::ThreadPool>,
    copy_threads: usize,
}

impl TransportState {
    pub(crate) fn new(
        opts: &GpuOptions,
        ctx: &Arc<crate::GpuContext>,
        arena: &Arc<crate::arena::Arena>,
    ) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        TransportState {
            active: None,
            staging: StagingTransport::new(
                opts.staging_depth
                    .unwrap_or(crate::transport::DEFAULT_STAGING_DEPTH),
                opts.staging_chunk_bytes
                    .unwrap_or(crate::transport::DEFAULT_STAGING_CHUNK),
            ),
            mapped: MappedTransport,
            slots: HashMap::new(),
            readback: ReadbackPool::new(
                SideReadback::new(ctx, arena),
                opts.download_pieces.unwrap_or(crate::transport::DOWNLOAD_PARTS),
                opts.download_staging == crate::DownloadStaging::Layer,
            ),
            pending: HashMap::new(),
            next_ticket: 0,
            stats: TransportStats::default(),
            pool: None,
            copy_threads: opts.copy_threads.unwrap_or(cores.min(16)).max(1),
        }
    }

    /// The copy threads, started on first use.
    fn pool(&mut self) -> &rayon::ThreadPool {
        let n = self.copy_threads;
        self.pool.get_or_insert_with(|| copy_pool(n))
    }

    fn set_active(
        &mut self,
        c: TransportChoice,
        reason: String,
        measured_ms: Vec<(String, f64)>,
    ) -> TransportInfo {
        let info = TransportInfo {
            name: c.to_string(),
            reason,
            measured_ms,
        };
        self.active = Some((c, info.clone()));
        info
    }

    /// Implementation `c` and the slots, borrowed apart.
    fn transport_and_slots(
        &mut self,
        c: TransportChoice,
    ) -> (&mut dyn Transport, &mut HashMap<WeightSlot, Slot>) {
        let t: &mut dyn Transport = match c {
            TransportChoice::Mapped => &mut self.mapped,
            _ => &mut self.staging,
        };
        (t, &mut self.slots)
    }
}

/// Slot kind the calibration uses, out of the way of any caller's kinds.
const CALIBRATION_KIND: usize = usize::MAX;

/// Largest layer the calibration moves (it is a rate, not a rehearsal).
const CALIBRATION_MAX_BYTES: u64 = 64 << 20;

impl GpuExecutor {
    /// The transports' way to the queue. Submits the pending op batch: a
    /// transfer starts with CPU work (filling a staging buffer) that the
    /// device can spend on the ops recorded so far.
    fn link(&self) -> Link<'_> {
        self.flush();
        Link {
            device: &self.ctx.device,
            queue: &self.ctx.queue,
            submitter: &self.submitter,
        }
    }

    fn mapped_supported(&self) -> bool {
        self.ctx
            .features
            .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
    }

    fn check_choice(&self, c: TransportChoice) -> Result<()> {
        if c == TransportChoice::Mapped && !self.mapped_supported() {
            return Err(GpuError::Unsupported {
                op: "transport",
                detail: format!(
                    "the mapped transport needs MAPPABLE_PRIMARY_BUFFERS, which adapter '{}' does not offer; use staging",
                    self.ctx.info.name
                ),
            }
            .into());
        }
        Ok(())
    }

    /// The transport in use, deciding without a measurement if
    /// `prepare_transport` was not called.
    fn resolve_transport(&self, st: &mut TransportState) -> Result<TransportChoice> {
        if let Some((c, _)) = &st.active {
            return Ok(*c);
        }
        let (c, reason) = match self.transport_choice {
            TransportChoice::Auto => (
                TransportChoice::Staging,
                "not measured (prepare_transport was not called); staging works on every adapter".to_string(),
            ),
            c => (c, "set by the caller".to_string()),
        };
        self.check_choice(c)?;
        st.set_active(c, reason, Vec::new());
        Ok(c)
    }

    /// A blocking download of `bytes` bytes of `buf` from `offset` through
    /// the pooled readback buffers.
    pub(super) fn read_pooled(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        let mut st = self.transport.lock().expect("transport poisoned");
        st.readback.read(&self.link(), buf, offset, bytes)
    }

    /// The transport in use, if decided.
    pub fn transport_info(&self) -> Option<TransportInfo> {
        let st = self.transport.lock().expect("transport poisoned");
        st.active
            .as_ref()
            .map(|(_, info)| self.naming_copy_queue(info.clone()))
    }

    /// `info`, saying where the device's own copies run if not on wgpu's
    /// queue, or why the copy queue was let go.
    fn naming_copy_queue(&self, mut info: TransportInfo) -> TransportInfo {
        if let Some((what, _)) = self.ctx.copy_queue() {
            info.reason += &format!("; downloads, and uploads the device copies itself, run on {what}");
        }
        if let Some(why) = self.ctx.copy_queue_refused() {
            info.reason += &format!("; {why}, so every copy runs on wgpu's queue");
        }
        info
    }

    /// Where the time of the transfers went so far (see [`TransportStats`]).
    pub fn transport_stats(&self) -> TransportStats {
        self.transport.lock().expect("transport poisoned").stats
    }

    /// Host-visible bytes the transports hold (upload ring, parked readback buffers).
    pub fn transport_host_bytes(&self) -> u64 {
        let st = self.transport.lock().expect("transport poisoned");
        st.staging.ring_bytes() + st.readback.pooled_bytes()
    }

    pub(crate) fn load_weights_impl(
        &self,
        slot: WeightSlot,
        params: &[WeightUpload<'_>],
    ) -> Result<Vec<GpuTensor>> {
        let mut layout = Vec::with_capacity(params.len());
        let mut offsets = Vec::with_capacity(params.len());
        let mut bytes = 0u64;
        let align = self.align.max(4);
        for p in params {
            p.validate("load_weights")?;
            bytes = bytes.div_ceil(align) * align;
            offsets.push(bytes);
            bytes += storage_bytes(p.dtype, p.shape.numel());
            layout.push((p.shape.clone(), p.dtype));
        }
        let bytes = bytes.max(4);
        if bytes > self.ctx.limits.max_buffer_size {
            return Err(GpuError::Unsupported {
                op: "load_weights",
                detail: format!(
                    "a layer of {bytes} bytes exceeds the device's largest buffer ({} bytes)",
                    self.ctx.limits.max_buffer_size
                ),
            }
            .into());
        }
        let mut st = self.transport.lock().expect("transport poisoned");
        let direct = self.direct_sources(params);
        let any_direct = direct.iter().any(Option::is_some);
        // A slot the device copies into: never a mapped one.
        let choice = match any_direct {
            true => TransportChoice::Staging,
            false => self.resolve_transport(&mut st)?,
        };
        // The copy queue writes it: a buffer of its making.
        let side_queue = self.ctx.copy_queue.as_ref().filter(|_| any_direct);
        let fits = st.slots.get(&slot).is_some_and(|s| {
            s.by == choice
                && s.layout == layout
                && s.bytes == bytes
                && s.side.is_some() == side_queue.is_some()
        });
        if !fits {
            let (t, _) = st.transport_and_slots(choice);
            let (usage, mapped) = (t.slot_usage(), t.slot_mapped_at_creation());
            let made = side_queue.and_then(|q| {
                let raw = q
                    .create_buffer(&self.ctx.device, bytes, "weight slot (copy queue)")
                    .ok()?;
                let side = SideSlot {
                    queue: q.clone(),
                    buf: raw.clone(),
                };
                Some((raw, side))
            });
            let (raw, side) = match made {
                Some((raw, side)) => (raw, Some(side)),
                None => {
                    let desc = wgpu::BufferDescriptor {
                        label: Some("weight slot"),
                        size: bytes,
                        usage,
                        mapped_at_creation: mapped,
                    };
                    let raw = crate::arena::create_buffer_checked(&self.ctx.device, &desc)
                        .ok_or_else(|| self.out_of_memory("weight slot", bytes, None))?;
                    (raw, None)
                }
            };
            let buf = Arc::new(self.arena.adopt(raw));
            let tensors = layout
                .iter()
                .zip(&offsets)
                .map(|((shape, dtype), &offset)| GpuTensor {
                    buf: buf.clone(),
                    offset,
                    shape: shape.clone(),
                    dtype: *dtype,
                    derived: Default::default(),
                })
                .collect();
            let slot_state = Slot {
                buffer: SlotBuffer {
                    buf,
                    map: if mapped {
                        MapState::mapped()
                    } else {
                        MapState::default()
                    },
                    mapped,
                },
                layout,
                bytes,
                by: choice,
                tensors,
                side,
            };
            if st.slots.insert(slot, slot_state).is_some() {
                // Groups over the replaced buffer would keep it alive.
                self.bind_groups.clear();
            }
        }
        if any_direct {
            let s = st.slots.get_mut(&slot).expect("slot just ensured");
            s.buffer.buf.note_write();
            let buf = s.buffer.buf.clone();
            let side = s.side.as_ref().map(|q| q.queue.clone());
            let stats = &mut st.stats;
            self.load_direct(side.as_deref(), params, &offsets, &direct, &buf, stats)?;
            stats.uploads += 1;
            stats.bytes_up += bytes;
            return Ok(st.slots[&slot].tensors.clone());
        }
        let image = Image::new(params, &offsets, bytes);
        st.pool();
        let TransportState {
            staging,
            mapped,
            slots,
            stats,
            pool,
            ..
        } = &mut *st;
        let t: &mut dyn Transport = match choice {
            TransportChoice::Mapped => mapped,
            _ => staging,
        };
        let s = slots.get_mut(&slot).expect("slot just ensured");
        let pool = pool.as_ref().expect("pool just started");
        // New contents under the slot's tensors: their remembered maxima go.
        s.buffer.buf.note_write();
        t.write(&self.link(), &mut s.buffer, &image, pool, stats)?;
        Ok(s.tensors.clone())
    }

    /// For each upload, the registered host range it lies in and its byte
    /// offset there, where the device can copy it as it is: stored as
    /// held (not widened) and 4-byte aligned, the copy granule.
    fn direct_sources(&self, params: &[WeightUpload<'_>]) -> Vec<Option<(Arc<Region>, u64)>> {
        if self.uploads == crate::Uploads::Copy || self.ctx.host_registry.len() == 0 {
            return vec![None; params.len()];
        }
        params
            .iter()
            .map(|p| {
                if p.dtype != p.data.dtype() {
                    return None;
                }
                let b = p.data.as_bytes();
                let at = b.as_ptr() as usize;
                // The copy moves whole words: up to 3 bytes past the end.
                let n = storage_bytes(p.dtype, p.data.len()) as usize;
                let r = self.ctx.host_registry.find(at, at + n)?;
                let off = (at - r.start) as u64;
                off.is_multiple_of(4).then_some((r, off))
            })
            .collect()
    }

    /// Loads a layer the device copies from registered host memory
    /// (`direct[i]`): one copy per tensor, grouped by registered range,
    /// on the copy queue where `side` names it (one submission per range,
    /// after the last kernel that read the slot; the first submission
    /// that uses the slot next waits for it there, not here), else on
    /// wgpu's queue. The tensors that are not there (widened vectors, an
    /// unaligned or unregistered source) go through wgpu's own staging.
    /// All of it lands after the ops recorded before (submitted first
    /// here), which is when the slot's previous weights are done.
    fn load_direct(
        &self,
        side: Option<&CopyQueue>,
        params: &[WeightUpload<'_>],
        offsets: &[u64],
        direct: &[Option<(Arc<Region>, u64)>],
        slot: &Arc<crate::arena::PooledBuffer>,
        stats: &mut TransportStats,
    ) -> Result<()> {
        let t = Instant::now();
        let link = self.link();
        let mut by_region: Vec<RangeCopies> = Vec::new();
        for ((p, &at), src) in params.iter().zip(offsets).zip(direct) {
            let n = storage_bytes(p.dtype, p.data.len());
            match src {
                Some((region, off)) => {
                    stats.bytes_up_direct += p.held_bytes();
                    match by_region.iter_mut().find(|(r, _)| Arc::ptr_eq(r, region)) {
                        Some((_, copies)) => copies.push((*off, at, n)),
                        None => by_region.push((region.clone(), vec![(*off, at, n)])),
                    }
                }
                None => self.write_held(p, slot.buffer(), at),
            }
        }
        match side {
            Some(queue) => {
                for (region, copies) in by_region {
                    let keep: Vec<Arc<dyn std::any::Any + Send + Sync>> = vec![region.clone(), slot.clone()];
                    queue.copy(&region.buffer, slot.buffer(), &copies, false, keep)?;
                }
            }
            None => {
                let mut enc = self.ctx.device.create_command_encoder(&Default::default());
                for (region, copies) in &by_region {
                    for &(off, at, n) in copies {
                        enc.copy_buffer_to_buffer(&region.buffer, off, slot.buffer(), at, n);
                    }
                }
                link.submit_copy(enc, &[slot.buffer()]);
            }
        }
        stats.up_submit_ns += crate::transport::nanos(t.elapsed());
        Ok(())
    }

    /// An upload the device cannot copy as it is (a widened vector, an
    /// unregistered source): through wgpu's own staging, landing before
    /// the next submission's commands.
    fn write_held(&self, p: &WeightUpload<'_>, slot: &wgpu::Buffer, at: u64) {
        let n = storage_bytes(p.dtype, p.data.len());
        let mut held = vec![0u8; n as usize];
        Image::new(std::slice::from_ref(p), &[0], n).write(0, wgpu::WriteOnly::from(&mut held[..]));
        self.ctx.queue.write_buffer(slot, at, &held);
    }

    pub(crate) fn begin_download_impl(&self, tensors: Vec<GpuTensor>) -> Result<Download<GpuTensor>> {
        let mut st = self.transport.lock().expect("transport poisoned");
        let choice = self.resolve_transport(&mut st)?;
        let usage = st.transport_and_slots(choice).0.readback_usage();
        let TransportState { readback, stats, .. } = &mut *st;
        let p = readback.begin(&self.link(), usage, &tensors, stats)?;
        let (id, numel) = (st.next_ticket, p.numel);
        st.next_ticket += 1;
        st.pending.insert(id, p);
        Ok(Download::Ticket { id, numel })
    }

    /// Elements `range` of the concatenation of `tensors` into a readback
    /// buffer of the range's size (never the layer's).
    pub(crate) fn begin_download_range_impl(
        &self,
        tensors: &[GpuTensor],
        range: std::ops::Range<usize>,
    ) -> Result<Download<GpuTensor>> {
        let total: usize = tensors.iter().map(|t| t.numel()).sum();
        if range.start > range.end || range.end > total {
            return Err(Error::shape(
                "begin_download_range",
                format!("elements {range:?} of tensors holding {total}"),
            ));
        }
        let mut st = self.transport.lock().expect("transport poisoned");
        let choice = self.resolve_transport(&mut st)?;
        let usage = st.transport_and_slots(choice).0.readback_usage();
        let TransportState { readback, stats, .. } = &mut *st;
        let p = readback.begin_range(&self.link(), usage, tensors, range, stats)?;
        let (id, numel) = (st.next_ticket, p.numel);
        st.next_ticket += 1;
        st.pending.insert(id, p);
        Ok(Download::Ticket { id, numel })
    }

    pub(crate) fn finish_download_impl(&self, d: Download<GpuTensor>, out: &mut [f32]) -> Result<()> {
        let id = match d {
            Download::Ticket { id, .. } => id,
            // Not started by this executor's begin: plain downloads.
            Download::Tensors(ts) => return megatrain_tensor::download_concat(self, &ts, out),
            Download::Range(r) => {
                return Err(Error::shape(
                    "finish_download",
                    format!("range {r:?} was not begun by this executor"),
                ));
            }
        };
        let mut st = self.transport.lock().expect("transport poisoned");
        let p = st.pending.remove(&id).ok_or_else(|| {
            Error::shape(
                "finish_download",
                format!("ticket {id} is unknown or already finished"),
            )
        })?;
        st.pool();
        let TransportState {
            readback,
            stats,
            pool,
            ..
        } = &mut *st;
        let pool = pool.as_ref().expect("pool just started");
        readback.finish(&self.link(), p, out, pool, stats)
    }

    pub(crate) fn reserve_downloads_impl(&self, elems: usize, count: usize) -> Result<()> {
        let mut st = self.transport.lock().expect("transport poisoned");
        let choice = self.resolve_transport(&mut st)?;
        let usage = st.transport_and_slots(choice).0.readback_usage();
        let bytes = 4 * elems as u64;
        // Every step asks again: no link (which submits the op batch) then.
        if st.readback.is_reserved(usage, bytes, count) {
            return Ok(());
        }
        let TransportState { readback, stats, .. } = &mut *st;
        readback.reserve(&self.link(), usage, bytes, count, stats)
    }

    pub(crate) fn finish_download_in_place_impl(
        &self,
        d: Download<GpuTensor>,
    ) -> Result<std::result::Result<Landed, Download<GpuTensor>>> {
        let Download::Ticket { id, numel } = d else {
            return Ok(Err(d));
        };
        if self.downloads == crate::Downloads::Copy {
            return Ok(Err(d));
        }
        let mut st = self.transport.lock().expect("transport poisoned");
        let Some(p) = st.pending.remove(&id) else {
            return Ok(Err(d));
        };
        let TransportState { readback, stats, .. } = &mut *st;
        Ok(match readback.finish_in_place(&self.link(), p, stats)? {
            Ok(values) => Ok(values),
            Err(p) => {
                st.pending.insert(id, p);
                Err(Download::Ticket { id, numel })
            }
        })
    }

    /// Decides the transport for layers of about `layer_bytes` up and
    /// `grad_bytes` down: the caller's choice, or under `Auto` the lower
    /// measured cost of a layer's crossing with each: the upload until the
    /// device holds it, one kernel pass that reads every weight of the slot
    /// (where the slot's memory lies shows here), and a gradient-sized
    /// download — each the median of 5, summed. Parts are timed apart so
    /// that slow compute (a CPU adapter) does not drown the difference.
    pub(crate) fn prepare_transport_impl(&self, layer_bytes: u64, grad_bytes: u64) -> Result<TransportInfo> {
        Ok(self.naming_copy_queue(self.choose_transport(layer_bytes, grad_bytes)?))
    }

    fn choose_transport(&self, layer_bytes: u64, grad_bytes: u64) -> Result<TransportInfo> {
        let set = |c: TransportChoice, reason: String, measured: Vec<(String, f64)>| {
            let mut st = self.transport.lock().expect("transport poisoned");
            st.set_active(c, reason, measured)
        };
        let fixed = |c: TransportChoice, reason: String| -> Result<TransportInfo> {
            self.check_choice(c)?;
            Ok(set(c, reason, Vec::new()))
        };
        match self.transport_choice {
            TransportChoice::Auto => {}
            c => {
                return fixed(
                    c,
                    "set by the caller (GpuOptions.transport, the CLI's --transport)".into(),
                );
            }
        }
        if !self.mapped_supported() {
            return fixed(
                TransportChoice::Staging,
                "the adapter does not offer MAPPABLE_PRIMARY_BUFFERS".into(),
            );
        }
        let cap = CALIBRATION_MAX_BYTES.min(self.max_binding / 2);
        let w_elems = ((layer_bytes.min(cap) / 4) as usize).max(1);
        let grad_elems = ((grad_bytes.min(cap) / 4) as usize).max(1);
        let w_host = vec![0.0f32; w_elems];
        let w_shape = Shape::new([w_elems]);
        let g = self.zeros_f32([grad_elems])?;
        let mut out = vec![0.0f32; grad_elems];
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        let mut measured = Vec::new();
        let mut parts = Vec::new();
        for c in [TransportChoice::Staging, TransportChoice::Mapped] {
            set(c, "calibrating".into(), Vec::new());
            let (mut up, mut read, mut down) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..6 {
                let slot = WeightSlot {
                    kind: CALIBRATION_KIND,
                    index: rep % 2,
                };
                let t = Instant::now();
                let w = self.load_weights_impl(
                    slot,
                    &[WeightUpload {
                        shape: &w_shape,
                        data: HostSlice::F32(&w_host),
                        dtype: DType::F32,
                    }],
                )?;
                self.synchronize()?;
                let t_up = ms(t);
                let t = Instant::now();
                let y = self.scale(&w[0], 1.0)?;
                self.synchronize()?;
                let t_read = ms(t);
                drop((w, y));
                let t = Instant::now();
                let d = self.begin_download_impl(vec![g.clone()])?;
                self.finish_download_impl(d, &mut out)?;
                if rep > 0 {
                    up.push(t_up);
                    read.push(t_read);
                    down.push(ms(t));
                }
            }
            let (u, r, d) = (median(up), median(read), median(down));
            parts.push(format!("{c} {u:.2} up + {r:.2} read + {d:.2} down"));
            measured.push((c.to_string(), u + r + d));
        }
        {
            // What the calibration made and the step does not use: its
            // slots, the staging ring (remade if staging uploads come), and
            // the parked readback buffers of its whole downloads.
            let mut st = self.transport.lock().expect("transport poisoned");
            st.slots.retain(|s, _| s.kind != CALIBRATION_KIND);
            st.staging.release();
            st.readback.release_parked();
        }
        self.bind_groups.clear();
        let best = if measured[1].1 < measured[0].1 {
            TransportChoice::Mapped
        } else {
            TransportChoice::Staging
        };
        Ok(set(
            best,
            format!(
                "lower measured cost per layer on this adapter ({:.1} MiB up, {:.1} MiB down; ms, medians of 5: {})",
                (w_elems * 4) as f64 / (1u64 << 20) as f64,
                (grad_elems * 4) as f64 / (1u64 << 20) as f64,
                parts.join("; ")
            ),
            measured,
        ))
    }
}
