//! `GpuExecutor`: device tensors, op recording, binding ranges and the
//! implementation of every [`megatrain_tensor::Executor`] op.

mod attention;
mod elementwise;
mod embed_loss;
mod executor_impl;
mod matmul;
mod norm;
mod transport_impl;

pub use matmul::F16Matmul;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use megatrain_tensor::{DType, Error, HostData, HostTensor, Result, Shape};
use wgpu::util::DeviceExt;

use crate::arena::{Arena, ArenaStats};
use crate::kernels::{Kernel, KernelRegistry};
use crate::profile::{Profiler, TimingSource};
use crate::tensor::{GpuTensor, storage_bytes};
use crate::{GpuContext, GpuError};

/// Bytes of parameter blocks one op may hold in the shared uniform buffer
/// (256 dispatches at the usual 256-byte alignment).
const UNIFORM_RING_BYTES: u64 = 64 << 10;

/// Options that change how the executor runs, not what it computes.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// Caps the bytes one storage binding may cover below the device limit;
    /// lets tests exercise the multi-range paths on small tensors.
    pub max_binding_bytes: Option<u64>,
    /// Fills every freshly allocated output with NaN so that an element a
    /// kernel forgets to write cannot pass a comparison.
    pub poison_outputs: bool,
    /// Records the time of every op (synchronises after each op).
    pub profile: bool,
    /// Forces the matmul tile (64 or 128) instead of choosing by size.
    pub matmul_tile: Option<u32>,
    /// Most loop iterations one shader invocation may run; work is split over
    /// more dispatches to stay under it. `None`: the adapter's own (llvmpipe
    /// silently ends every loop after 65535 back-edges per invocation; other
    /// drivers have no such cap).
    pub loop_budget: Option<usize>,
    /// How layers move between host and device (`Auto`: by measurement in
    /// `prepare_transport`).
    pub transport: crate::TransportChoice,
    /// The kernels of matmuls under the F16 compute precision (`Auto`:
    /// tensor cores where the adapter has cooperative matrices).
    pub f16_matmul: F16Matmul,
}

pub struct GpuExecutor {
    ctx: Arc<GpuContext>,
    kernels: KernelRegistry,
    arena: Arc<Arena>,
    max_binding: u64,
    align: u64,
    poison: bool,
    matmul_tile: Option<u32>,
    f16_matmul: F16Matmul,
    precision: megatrain_tensor::ComputePrecision,
    pub(crate) loop_budget: usize,
    profiling: AtomicBool,
    profiler: Profiler,
    /// Stand-in for bindings a kernel declares but a call does not use.
    dummy: wgpu::Buffer,
    /// Parameter blocks of one op, rewritten by every op: a queue write is
    /// applied after all earlier submissions, so no op sees another's
    /// parameters as long as write + submit happen under `submit_lock`.
    uniforms: wgpu::Buffer,
    uniform_align: u64,
    submit_lock: std::sync::Mutex<()>,
    timestamps: Option<Timestamps>,
    bind_groups: BindGroupCache,
    transport_choice: crate::TransportChoice,
    transport: std::sync::Mutex<transport_impl::TransportState>,
}

struct Timestamps {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    period_ns: f64,
}

/// A byte range of a buffer bound as one storage binding, and where element 0
/// of the range the kernel wants lies inside it.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    buf: &'a wgpu::Buffer,
    offset: u64,
    size: u64,
    pub elem_off: u32,
}

/// What a bind group binds: equal keys may share one group.
#[derive(PartialEq, Eq, Hash)]
struct GroupKey {
    kernel: Kernel,
    uniform: (u64, u64),
    views: Vec<(wgpu::Buffer, u64, u64)>,
}

/// Most bind groups kept; past it the cache starts over (a workload whose
/// buffers never repeat must not grow it without bound).
const BIND_GROUP_CACHE_MAX: usize = 1 << 14;

/// Bind groups by what they bind, with counts of made and reused groups.
#[derive(Default)]
pub(crate) struct BindGroupCache {
    map: std::sync::Mutex<std::collections::HashMap<GroupKey, wgpu::BindGroup>>,
    made: std::sync::atomic::AtomicU64,
    reused: std::sync::atomic::AtomicU64,
}

impl BindGroupCache {
    fn get_or_make(&self, key: GroupKey, make: impl FnOnce() -> wgpu::BindGroup) -> wgpu::BindGroup {
        let mut map = self.map.lock().expect("bind group cache poisoned");
        if let Some(g) = map.get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return g.clone();
        }
        if map.len() >= BIND_GROUP_CACHE_MAX {
            map.clear();
        }
        self.made.fetch_add(1, Ordering::Relaxed);
        let g = make();
        map.insert(key, g.clone());
        g
    }

    /// Drops every group (they keep their buffers alive).
    pub(crate) fn clear(&self) {
        self.map.lock().expect("bind group cache poisoned").clear();
    }

    fn stats(&self) -> BindGroupStats {
        BindGroupStats {
            made: self.made.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            cached: self.map.lock().expect("bind group cache poisoned").len() as u64,
        }
    }
}

/// Bind groups created and reused since the executor was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BindGroupStats {
    pub made: u64,
    pub reused: u64,
    pub cached: u64,
}

enum Cmd {
    Dispatch {
        pipeline: Arc<crate::kernels::Pipeline>,
        group: wgpu::BindGroup,
        grid: [u32; 3],
    },
    Copy {
        src: wgpu::Buffer,
        src_off: u64,
        dst: wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    },
    Clear {
        buf: wgpu::Buffer,
        bytes: u64,
    },
}

/// The commands of one op, submitted together by [`Op::finish`].
pub(crate) struct Op<'e> {
    ex: &'e GpuExecutor,
    name: &'static str,
    cmds: Vec<Cmd>,
    /// Parameter blocks destined for `GpuExecutor::uniforms`.
    params: Vec<u8>,
    /// Temporaries the recorded commands read: they must not go back to the
    /// pool (and be rewritten by a later upload) before the op is submitted.
    keep: Vec<GpuTensor>,
}

impl<'e> Op<'e> {
    pub fn keep(&mut self, t: GpuTensor) {
        self.keep.push(t);
    }

    pub fn dispatch(&mut self, k: Kernel, params: &[u32], views: &[View<'_>], grid: [u32; 3]) {
        let ex = self.ex;
        let pipeline = ex.kernels.get(&ex.ctx.device, k);
        debug_assert_eq!(pipeline.bindings.len(), views.len(), "{:?} binding count", k);
        let mut bytes: Vec<u8> = bytemuck::cast_slice(params).to_vec();
        bytes.resize(bytes.len().div_ceil(16).max(1) * 16, 0);
        let offset = (self.params.len() as u64).div_ceil(ex.uniform_align) * ex.uniform_align;
        let own;
        let (ubuf, uoff) = if offset + bytes.len() as u64 <= UNIFORM_RING_BYTES {
            self.params.resize(offset as usize, 0);
            self.params.extend_from_slice(&bytes);
            (&ex.uniforms, offset)
        } else {
            // More dispatches than the shared block holds: a buffer of its own.
            own = ex
                .ctx
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: &bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            (&own, 0)
        };
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: ubuf,
                offset: uoff,
                size: wgpu::BufferSize::new(bytes.len() as u64),
            }),
        }];
        for (b, v) in pipeline.bindings.iter().zip(views) {
            entries.push(wgpu::BindGroupEntry {
                binding: *b,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: v.buf,
                    offset: v.offset,
                    size: wgpu::BufferSize::new(v.size),
                }),
            });
        }
        let make = || {
            ex.ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(pipeline.entry),
                layout: &pipeline.layout,
                entries: &entries,
            })
        };
        // Parameter blocks of the shared buffer sit at the same offsets every
        // time an op runs, and weight slots and pooled activations are the
        // same buffers every step: so after the first step every group is
        // found here and nothing is created per layer per step.
        let group = if std::ptr::eq(ubuf, &ex.uniforms) {
            let key = GroupKey {
                kernel: k,
                uniform: (uoff, bytes.len() as u64),
                views: views.iter().map(|v| (v.buf.clone(), v.offset, v.size)).collect(),
            };
            ex.bind_groups.get_or_make(key, make)
        } else {
            make()
        };
        if grid.iter().all(|&g| g > 0) {
            self.cmds.push(Cmd::Dispatch {
                pipeline,
                group,
                grid,
            });
        }
    }

    pub fn copy(&mut self, src: &wgpu::Buffer, src_off: u64, dst: &wgpu::Buffer, dst_off: u64, bytes: u64) {
        if bytes > 0 {
            self.cmds.push(Cmd::Copy {
                src: src.clone(),
                src_off,
                dst: dst.clone(),
                dst_off,
                bytes,
            });
        }
    }

    pub fn clear(&mut self, buf: &wgpu::Buffer, bytes: u64) {
        if bytes > 0 {
            self.cmds.push(Cmd::Clear {
                buf: buf.clone(),
                bytes,
            });
        }
    }

    pub fn finish(self) -> Result<()> {
        let ex = self.ex;
        let profile = ex.profiling.load(Ordering::Relaxed);
        let ts = if profile { ex.timestamps.as_ref() } else { None };
        let n_dispatch_runs = count_pass_runs(&self.cmds);
        let mut enc = ex.ctx.device.create_command_encoder(&Default::default());
        let mut cmds = self.cmds.into_iter().peekable();
        let mut run = 0;
        while let Some(cmd) = cmds.next() {
            match cmd {
                Cmd::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    bytes,
                } => enc.copy_buffer_to_buffer(&src, src_off, &dst, dst_off, bytes),
                Cmd::Clear { buf, bytes } => enc.clear_buffer(&buf, 0, Some(bytes)),
                Cmd::Dispatch {
                    pipeline,
                    group,
                    grid,
                } => {
                    let timestamp_writes = ts.map(|t| wgpu::ComputePassTimestampWrites {
                        query_set: &t.set,
                        beginning_of_pass_write_index: (run == 0).then_some(0),
                        end_of_pass_write_index: (run + 1 == n_dispatch_runs).then_some(1),
                    });
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some(self.name),
                        timestamp_writes,
                    });
                    pass.set_pipeline(&pipeline.pipeline);
                    pass.set_bind_group(0, &group, &[]);
                    pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                    while let Some(Cmd::Dispatch { .. }) = cmds.peek() {
                        if let Some(Cmd::Dispatch {
                            pipeline,
                            group,
                            grid,
                        }) = cmds.next()
                        {
                            pass.set_pipeline(&pipeline.pipeline);
                            pass.set_bind_group(0, &group, &[]);
                            pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                        }
                    }
                    run += 1;
                }
            }
        }
        let use_ts = ts.filter(|_| n_dispatch_runs > 0);
        if let Some(t) = use_ts {
            enc.resolve_query_set(&t.set, 0..2, &t.resolve, 0);
            enc.copy_buffer_to_buffer(&t.resolve, 0, &t.read, 0, 16);
        }
        let start = Instant::now();
        {
            let _guard = ex.submit_lock.lock().expect("submit lock poisoned");
            if !self.params.is_empty() {
                ex.ctx.queue.write_buffer(&ex.uniforms, 0, &self.params);
            }
            ex.ctx.queue.submit([enc.finish()]);
        }
        drop(self.keep);
        if profile {
            ex.ctx.wait()?;
            let wall = start.elapsed().as_nanos() as u64;
            let ns = match use_ts {
                Some(t) => {
                    let words = ex.read_buffer(&t.read, 0, 16)?;
                    let v: Vec<u64> = bytemuck::pod_collect_to_vec(&words);
                    (v[1].saturating_sub(v[0]) as f64 * t.period_ns) as u64
                }
                None => wall,
            };
            ex.profiler.record(self.name, ns);
        }
        Ok(())
    }
}

fn count_pass_runs(cmds: &[Cmd]) -> usize {
    let mut runs = 0;
    let mut prev_dispatch = false;
    for c in cmds {
        let d = matches!(c, Cmd::Dispatch { .. });
        if d && !prev_dispatch {
            runs += 1;
        }
        prev_dispatch = d;
    }
    runs
}

/// Workgroup grid for `n` workgroups: 2-D when one dimension is not enough
/// (kernels rebuild the linear id from `num_workgroups`).
pub(crate) fn grid_for(n: usize) -> [u32; 3] {
    const MAX: usize = 65535;
    if n <= MAX {
        [n as u32, 1, 1]
    } else {
        [MAX as u32, n.div_ceil(MAX) as u32, 1]
    }
}

pub(crate) fn f(x: f32) -> u32 {
    x.to_bits()
}

pub(crate) fn u(x: usize) -> u32 {
    x as u32
}

pub(crate) fn need_f32(op: &'static str, t: &GpuTensor) -> Result<()> {
    if t.dtype != DType::F32 {
        return Err(Error::DType {
            op,
            expected: DType::F32,
            got: t.dtype,
        });
    }
    Ok(())
}

pub(crate) fn same_shape(op: &'static str, a: &GpuTensor, b: &GpuTensor) -> Result<()> {
    if a.shape != b.shape {
        return Err(Error::shape(op, format!("{} vs {}", a.shape, b.shape)));
    }
    Ok(())
}

impl GpuExecutor {
    /// Opens the adapter `GpuContext::new` picks (honouring `MEGATRAIN_ADAPTER`).
    pub fn from_env() -> std::result::Result<Self, GpuError> {
        Ok(Self::new(GpuContext::new()?))
    }

    pub fn new(ctx: Arc<GpuContext>) -> Self {
        Self::with_options(ctx, GpuOptions::default())
    }

    pub fn with_options(ctx: Arc<GpuContext>, opts: GpuOptions) -> Self {
        let device_max = ctx.max_binding_bytes();
        // Bindings are multiples of 4 bytes; keep the cap one too.
        let max_binding = opts.max_binding_bytes.map_or(device_max, |m| m.min(device_max)) & !3;
        let align = ctx.limits.min_storage_buffer_offset_alignment as u64;
        let dummy = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 256,
            usage: crate::arena::USAGE,
            mapped_at_creation: false,
        });
        let timestamps = ctx.has_timestamps().then(|| Timestamps {
            set: ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("op timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            }),
            resolve: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamp resolve"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            read: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamp read"),
                size: 16,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            period_ns: ctx.queue.get_timestamp_period() as f64,
        });
        let uniforms = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("op parameters"),
            size: UNIFORM_RING_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        GpuExecutor {
            uniforms,
            uniform_align: ctx.limits.min_uniform_buffer_offset_alignment as u64,
            submit_lock: std::sync::Mutex::new(()),
            arena: Arena::new(ctx.device.clone()),
            kernels: KernelRegistry::default(),
            max_binding,
            align,
            poison: opts.poison_outputs,
            matmul_tile: opts.matmul_tile,
            f16_matmul: opts.f16_matmul,
            precision: Default::default(),
            loop_budget: opts.loop_budget.unwrap_or_else(|| {
                let info = &ctx.info;
                if info.driver.contains("llvmpipe") || info.name.contains("llvmpipe") {
                    50_000
                } else {
                    usize::MAX
                }
            }),
            profiling: AtomicBool::new(opts.profile),
            profiler: Profiler::default(),
            dummy,
            timestamps,
            bind_groups: BindGroupCache::default(),
            transport_choice: opts.transport,
            transport: Default::default(),
            ctx,
        }
    }

    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    pub fn memory(&self) -> ArenaStats {
        self.arena.stats()
    }

    pub fn reset_peak_memory(&self) {
        self.arena.reset_peak();
    }

    /// Releases pooled (unused) device buffers.
    pub fn trim_pool(&self) {
        // Cached bind groups hold their buffers: drop them first.
        self.bind_groups.clear();
        self.arena.trim();
    }

    pub fn bind_group_stats(&self) -> BindGroupStats {
        self.bind_groups.stats()
    }

    /// Compiles every kernel now rather than on first use.
    pub fn warm_up(&self) {
        self.kernels.warm_all(&self.ctx.device);
    }

    pub fn max_binding_bytes(&self) -> u64 {
        self.max_binding
    }

    pub fn set_profiling(&self, on: bool) {
        self.profiling.store(on, Ordering::Relaxed);
    }

    pub fn timing_source(&self) -> TimingSource {
        if self.timestamps.is_some() {
            TimingSource::GpuTimestamps
        } else {
            TimingSource::CpuWallClock
        }
    }

    pub fn profile(&self) -> &Profiler {
        &self.profiler
    }

    pub fn profile_report(&self) -> String {
        self.profiler.report(self.timing_source())
    }

    /// Blocks until every submitted op has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.wait()?)
    }

    pub(crate) fn op(&self, name: &'static str) -> Op<'_> {
        Op {
            ex: self,
            name,
            cmds: Vec::new(),
            params: Vec::new(),
            keep: Vec::new(),
        }
    }

    /// An uninitialised tensor (NaN-filled when poisoning is on).
    pub(crate) fn alloc(&self, shape: Shape, dtype: DType) -> Result<GpuTensor> {
        let bytes = storage_bytes(dtype, shape.numel());
        let max = self.ctx.limits.max_buffer_size;
        if bytes > max {
            return Err(GpuError::Unsupported {
                op: "alloc",
                detail: format!("a {dtype} tensor of shape {shape} needs {bytes} bytes; the device's largest buffer is {max}"),
            }
            .into());
        }
        let buf = self.arena.alloc(bytes);
        if self.poison && bytes > 0 {
            let nan = vec![f32::NAN; (bytes / 4) as usize];
            self.ctx
                .queue
                .write_buffer(buf.buffer(), 0, bytemuck::cast_slice(&nan));
        }
        Ok(GpuTensor {
            buf: Arc::new(buf),
            offset: 0,
            shape,
            dtype,
        })
    }

    pub(crate) fn alloc_f32(&self, shape: impl Into<Shape>) -> Result<GpuTensor> {
        self.alloc(shape.into(), DType::F32)
    }

    pub(crate) fn zeros_f32(&self, shape: impl Into<Shape>) -> Result<GpuTensor> {
        let t = self.alloc(shape.into(), DType::F32)?;
        let mut op = self.op("zeros");
        op.clear(t.buffer(), t.byte_len());
        op.finish()?;
        Ok(t)
    }

    /// A device buffer for host-side index data (ids, targets, offsets).
    pub(crate) fn upload_words(&self, words: &[u32]) -> Result<GpuTensor> {
        let n = words.len().max(1);
        let t = self.alloc(Shape::new([n]), DType::F32)?;
        if !words.is_empty() {
            self.ctx
                .queue
                .write_buffer(t.buffer(), 0, bytemuck::cast_slice(words));
        }
        Ok(t)
    }

    pub(crate) fn upload_host(&self, h: &HostTensor) -> Result<GpuTensor> {
        self.upload_bytes(h.shape(), h.dtype(), h.data().as_bytes())
    }

    /// Writes host bytes (in `dtype`'s layout) straight into a new tensor.
    pub(crate) fn upload_bytes(&self, shape: &Shape, dtype: DType, bytes: &[u8]) -> Result<GpuTensor> {
        if bytes.len() != shape.numel() * dtype.size_in_bytes() {
            return Err(Error::shape(
                "upload",
                format!(
                    "shape {shape} of {dtype} needs {} bytes, got {}",
                    shape.numel() * dtype.size_in_bytes(),
                    bytes.len()
                ),
            ));
        }
        let t = self.alloc(shape.clone(), dtype)?;
        if !bytes.is_empty() {
            if bytes.len().is_multiple_of(4) {
                self.ctx.queue.write_buffer(t.buffer(), 0, bytes);
            } else {
                let mut padded = bytes.to_vec();
                padded.resize(bytes.len().div_ceil(4) * 4, 0);
                self.ctx.queue.write_buffer(t.buffer(), 0, &padded);
            }
        }
        Ok(t)
    }

    /// Copies `bytes` bytes of `buf` from `offset` (MAP_READ or not) back to the host.
    pub(crate) fn read_buffer(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        if !buf.usage().contains(wgpu::BufferUsages::MAP_READ) {
            // Through the pooled readback buffers: the trainer downloads
            // every gradient of every step.
            return self.read_pooled(buf, offset, bytes);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        buf.map_async(wgpu::MapMode::Read, offset..offset + bytes, move |r| {
            let _ = tx.send(r);
        });
        self.ctx.wait()?;
        rx.recv()
            .map_err(|e| GpuError::Map(e.to_string()))?
            .map_err(|e| GpuError::Map(e.to_string()))?;
        let out = buf
            .get_mapped_range(offset..offset + bytes)
            .map_err(|e| GpuError::Map(e.to_string()))?
            .to_vec();
        buf.unmap();
        Ok(out)
    }

    /// Downloads `t` widened to f32 into `out` without a host tensor between.
    pub(crate) fn download_into_f32(&self, t: &GpuTensor, out: &mut [f32]) -> Result<()> {
        if out.len() != t.numel() {
            return Err(Error::shape(
                "download_into",
                format!(
                    "tensor {} has {} elements, destination {}",
                    t.shape,
                    t.numel(),
                    out.len()
                ),
            ));
        }
        let bytes = self.read_buffer(t.buffer(), t.offset, t.byte_len())?;
        crate::tensor::widen_bytes(t.dtype, &bytes, out);
        Ok(())
    }

    pub(crate) fn download_host(&self, t: &GpuTensor) -> Result<HostTensor> {
        let bytes = self.read_buffer(t.buffer(), t.offset, t.byte_len())?;
        let n = t.numel();
        let data = match t.dtype {
            DType::F32 => HostData::F32(bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)),
            DType::BF16 => {
                let all: Vec<half::bf16> = bytes
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                HostData::BF16(all[..n].to_vec())
            }
            DType::F16 => {
                let all: Vec<half::f16> = bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                HostData::F16(all[..n].to_vec())
            }
        };
        HostTensor::new(t.shape.clone(), data)
    }

    /// Binds elements `start..start+count` of `t` (in its dtype's units).
    pub(crate) fn view<'a>(&self, t: &'a GpuTensor, start: usize, count: usize) -> Result<View<'a>> {
        let esize = t.dtype.size_in_bytes();
        debug_assert_eq!(
            t.offset % self.align,
            0,
            "slot tensors start on the binding alignment"
        );
        // Slot tensors sit at an aligned offset in a shared buffer: compute
        // the range as if the tensor began the buffer, then shift it.
        let v = self.view_buf(t.buffer(), esize, start, count, t.buf.class_bytes() - t.offset)?;
        Ok(View {
            offset: v.offset + t.offset,
            ..v
        })
    }

    pub(crate) fn full<'a>(&self, t: &'a GpuTensor) -> Result<View<'a>> {
        self.view(t, 0, t.numel())
    }

    fn view_buf<'a>(
        &self,
        buf: &'a wgpu::Buffer,
        esize: usize,
        start: usize,
        count: usize,
        buf_bytes: u64,
    ) -> Result<View<'a>> {
        let start_b = (start * esize) as u64;
        let end_b = (((start + count) * esize) as u64).div_ceil(4) * 4;
        let offset = start_b - start_b % self.align;
        let size = (end_b - offset).max(4).min(buf_bytes - offset);
        if size > self.max_binding {
            return Err(GpuError::Unsupported {
                op: "bind",
                detail: format!(
                    "a range of {size} bytes exceeds the storage binding limit of {} bytes",
                    self.max_binding
                ),
            }
            .into());
        }
        Ok(View {
            buf,
            offset,
            size,
            elem_off: (start - (offset as usize) / esize) as u32,
        })
    }

    pub(crate) fn dummy(&self) -> View<'_> {
        View {
            buf: &self.dummy,
            offset: 0,
            size: 256,
            elem_off: 0,
        }
    }

    /// Splits `rows` rows into chunks such that each operand, `row_elems[i]`
    /// f32 elements per row, fits one binding (with room for the alignment).
    pub(crate) fn row_chunks(&self, rows: usize, row_elems: &[usize]) -> Result<Vec<(usize, usize)>> {
        let widest = row_elems.iter().copied().max().unwrap_or(1).max(1) as u64 * 4;
        let room = self.max_binding.saturating_sub(self.align);
        let per = (room / widest) as usize;
        if per == 0 {
            return Err(GpuError::Unsupported {
                op: "bind",
                detail: format!(
                    "one row of {widest} bytes exceeds the storage binding limit of {} bytes",
                    self.max_binding
                ),
            }
            .into());
        }
        let mut out = Vec::new();
        let mut r = 0;
        while r < rows {
            let n = per.min(rows - r);
            out.push((r, n));
            r += n;
        }
        if out.is_empty() {
            out.push((0, 0));
        }
        Ok(out)
    }

    /// `row_chunks`, further split so that a kernel looping over the rows of
    /// its chunk stays within the loop budget.
    pub(crate) fn loop_chunks(&self, rows: usize, row_elems: &[usize]) -> Result<Vec<(usize, usize)>> {
        let cap = self.loop_budget.saturating_sub(64).max(1);
        let mut out = Vec::new();
        for (r0, n) in self.row_chunks(rows, row_elems)? {
            if n == 0 {
                out.push((r0, 0));
            }
            let mut r = r0;
            while r < r0 + n {
                let m = cap.min(r0 + n - r);
                out.push((r, m));
                r += m;
            }
        }
        Ok(out)
    }

    /// A private copy of `t` when its buffer is shared, so that an in-place op
    /// does not show through other handles.
    pub(crate) fn make_unique(&self, t: &mut GpuTensor) -> Result<()> {
        if Arc::strong_count(&t.buf) > 1 {
            let fresh = self.alloc(t.shape.clone(), t.dtype)?;
            let mut op = self.op("copy");
            op.copy(t.buffer(), t.offset, fresh.buffer(), 0, t.byte_len());
            op.finish()?;
            *t = fresh;
        }
        Ok(())
    }
}
