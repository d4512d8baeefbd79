//! `GpuExecutor`: device tensors, op recording, binding ranges and the
//! implementation of every [`megatrain_tensor::Executor`] op.

mod attention;
mod attention_cached;
mod attention_check;
mod attention_coop;
mod attention_sinks;
mod batch;
mod bind_groups;
mod binding;
mod buffers;
mod clamped_glu;
mod conv1d;
mod delta_gates;
mod delta_rule;
mod delta_rule_cached;
mod docs;
mod elementwise;
mod embed_loss;
mod env;
mod executor_impl;
mod f16_copy;
mod host_work;
mod matmul;
mod matmul_check;
mod matmul_epilogue;
mod matmul_product;
mod maxima;
mod norm;
mod record;
mod rope;
mod transport_impl;

pub use attention::F16Attention;
pub use batch::SubmitStats;
pub use bind_groups::BindGroupStats;
pub use env::{
    DOWNLOAD_STAGING_ENV, DOWNLOADS_ENV, EPILOGUES_ENV, F16_ATTENTION_ENV, F16_ATTENTION_TILES_ENV,
    F16_MATMUL_ENV, F16_MAXIMA_ENV, F16_OPERANDS_ENV,
};
pub use f16_copy::F16Operands;
pub use host_work::HostWork;
pub use matmul::F16Matmul;
pub use matmul_epilogue::Epilogues;
pub use maxima::F16Maxima;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use megatrain_tensor::{DType, Error, Result};

use crate::arena::{Arena, ArenaStats};
use crate::kernels::KernelRegistry;
use crate::profile::{Profiler, TimingSource};
use crate::tensor::GpuTensor;
use crate::{GpuContext, GpuError};
pub(crate) use batch::Submitter;
use bind_groups::BindGroupCache;
pub(crate) use binding::View;
pub(crate) use env::named;
pub(crate) use record::{Op, grid_for};

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
    /// Runs every SIMT product wholly on the checked kernel, without the
    /// 128-tile interior pipelines (for comparing the two).
    pub checked_matmul_only: bool,
    /// Runs the f32 attention on the kernels with one thread per row even
    /// where a row's D could be split over subgroup lanes (for comparing
    /// the two; `GpuContext::attention_lanes`).
    pub one_row_attention: bool,
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
    /// Most pieces a whole download of at least
    /// [`crate::DOWNLOAD_SPLIT_BYTES`] is copied in, each decoded while the
    /// next copies (`None`: [`crate::DOWNLOAD_PARTS`]; 1: one piece, as
    /// before; for comparing the two).
    pub download_pieces: Option<usize>,
    /// Entries in the staging transport's ring (`None`: 4).
    pub staging_depth: Option<usize>,
    /// Largest piece of a layer one staging entry carries; larger layers
    /// go through the ring in pieces (`None`: 32 MiB).
    pub staging_chunk_bytes: Option<u64>,
    /// Threads that copy into and out of mapped memory (`None`: every
    /// core, at most 16).
    pub copy_threads: Option<usize>,
    /// The kernels of attention under the F16 compute precision (`Auto`:
    /// tensor cores where the adapter has cooperative matrices).
    pub f16_attention: F16Attention,
    /// The tensor-core attention's tiles where not the passes' defaults
    /// (for timing them; `Auto`'s check on first use is per context and
    /// head dimension, whatever the tiles).
    pub attention_tiles: crate::AttnTiles,
    /// Most ops recorded into one queue submission (`None`: 256; 1 submits
    /// op by op). Whatever needs the queue (a transfer, a read, a wait)
    /// submits the batch first, so this changes only how often the host
    /// pays for a submission.
    pub batch_ops: Option<usize>,
    /// Scans every f16 matmul operand for its max (and makes its f16 copy)
    /// at each use instead of once per value of its contents (for checking
    /// the remembered maxima and copies).
    pub recompute_operand_maxima: bool,
    /// How the tensor-core kernels take f32 operands (`Copy`: converted once
    /// into f16 copies, rounded to nearest even; `Stage`: converted as each
    /// tile is staged, by the adapter's conversion).
    pub f16_operands: F16Operands,
    /// Whether products fold their outputs' maxima as they store them
    /// (`Fold`) or leave them to the scans (`Scan`, for timing).
    pub f16_maxima: F16Maxima,
    /// Whether the optimizer reads gradient downloads in place (`InPlace`)
    /// or from a copy (`Copy`, for timing).
    pub downloads: crate::Downloads,
    /// Where a layer's gradient chunks are copied from on a device with a
    /// copy queue (`Chunk`: each on its own; `Layer`: one device copy of
    /// the whole layer).
    pub download_staging: crate::DownloadStaging,
    /// Whether uploads from registered host memory are copied by the
    /// device (`Direct`, where it can import host memory; `Auto`: so too,
    /// except on CPU adapters) or always by the CPU through mapped memory
    /// (`Copy`, for timing).
    pub uploads: crate::Uploads,
    /// Rounds Q, K and V into copies before the tensor-core attention too,
    /// as the SIMT kernels need them (for checking that staging rounds
    /// them the same).
    pub copy_attention_operands: bool,
    /// Compiles the kernels with wgpu's runtime checks (index clamps, loop
    /// bounding, division guards): slower, for hunting an index out of
    /// bounds. Also on when `MEGATRAIN_SHADER_CHECKS=1`.
    pub shader_checks: bool,
    /// Builds every tensor-core attention kernel from SPIR-V of our own
    /// (`crate::passthrough`), not only those that need it (subgroup-local
    /// rows): for checking that path on any Vulkan device, emulated variants
    /// included, and for timing it against wgpu's for the same kernel.
    pub own_spirv: bool,
    /// Data parallel ranks whose executors share this device (0 or 1: this
    /// one alone): `tensor_memory` reports its share of the device.
    pub device_ranks: usize,
    /// Which products apply their activation at their store (`All`) and
    /// which leave it to the activation's own kernel (for timing the two).
    pub epilogues: Epilogues,
    /// Runs every tensor-core product with this timing probe in place of
    /// its K loop: **wrong results**, for the matmul bench's
    /// `MEGATRAIN_COOP_PROBE` alone ([`crate::CoopProbe`]), with
    /// `f16_matmul` naming the tile (under `Auto` the default tile's check
    /// fails and the SIMT kernel runs).
    pub coop_probe: Option<crate::CoopProbe>,
    /// Runs the tensor-core attention's kernels with this timing probe:
    /// **wrong results**, for the attention bench's `MEGATRAIN_ATTN_PROBE`
    /// alone ([`crate::AttnProbe`]), with `f16_attention` naming the
    /// tensor-core kernels.
    pub attention_probe: Option<crate::AttnProbe>,
}

/// Environment variable that turns on [`GpuOptions::shader_checks`].
pub const SHADER_CHECKS_ENV: &str = "MEGATRAIN_SHADER_CHECKS";

pub struct GpuExecutor {
    ctx: Arc<GpuContext>,
    kernels: KernelRegistry,
    arena: Arc<Arena>,
    max_binding: u64,
    align: u64,
    poison: bool,
    matmul_tile: Option<u32>,
    simt_interior: bool,
    /// Whether the f32 attention may take the lanes kernels.
    attention_lanes: bool,
    f16_matmul: F16Matmul,
    /// `f16_matmul` with `Auto` resolved (`f16_matmul_kernel`).
    f16_matmul_resolved: std::sync::OnceLock<F16Matmul>,
    f16_attention: F16Attention,
    attention_tiles: crate::AttnTiles,
    copy_attention_operands: bool,
    precision: megatrain_tensor::ComputePrecision,
    /// Whether f16 operands' maxima and f16 copies are remembered with
    /// their tensors.
    cache_maxima: bool,
    /// Operand max scans recorded (`operand_max_scans`).
    absmax_scans: std::sync::atomic::AtomicU64,
    /// Bytes those scans read.
    absmax_scan_bytes: std::sync::atomic::AtomicU64,
    /// Products that folded their outputs' maxima as they stored them.
    output_maxima_stored: std::sync::atomic::AtomicU64,
    f16_operands: F16Operands,
    f16_maxima: F16Maxima,
    epilogues: Epilogues,
    coop_probe: Option<crate::CoopProbe>,
    attention_probe: Option<crate::AttnProbe>,
    downloads: crate::Downloads,
    uploads: crate::Uploads,
    /// f16 operand copies recorded (`operand_f16_copies`).
    f16_copies: std::sync::atomic::AtomicU64,
    pub(crate) loop_budget: usize,
    profiling: AtomicBool,
    profiler: Profiler,
    /// Stand-in for bindings a kernel declares but a call does not use.
    dummy: wgpu::Buffer,
    /// The pending op batch and the shared buffer of its parameter blocks:
    /// every submission goes through it.
    submitter: Submitter,
    uniform_align: u64,
    timestamps: Option<Timestamps>,
    bind_groups: BindGroupCache,
    transport_choice: crate::TransportChoice,
    transport: std::sync::Mutex<transport_impl::TransportState>,
    /// RoPE's angle tables, built once per (θ, D).
    rope_tables: rope::RopeTables,
    /// The bounds of the packed documents attention and rope last took.
    docs: docs::DocsCache,
    /// [`GpuOptions::device_ranks`], at least 1.
    device_ranks: usize,
}

struct Timestamps {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    period_ns: f64,
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

/// `(rows, width)` of `t` read as rows of its last dimension, the leading
/// dimensions flattened (no rows where the last dimension is 0), as the
/// CPU reference counts them for `scale_rows` and `row_dots`.
pub(crate) fn rows_and_width(t: &GpuTensor) -> (usize, usize) {
    let c = t.dims().last().copied().unwrap_or(0);
    (t.numel().checked_div(c).unwrap_or(0), c)
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
        let arena = Arena::new(ctx.device.clone());
        let timestamps = ctx.has_timestamps().then(|| Timestamps {
            set: ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("op timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * record::MAX_TIMED_PASSES as u32,
            }),
            resolve: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamp resolve"),
                size: 16 * record::MAX_TIMED_PASSES as u64,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            read: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamp read"),
                size: 16 * record::MAX_TIMED_PASSES as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            period_ns: ctx.queue.get_timestamp_period() as f64,
        });
        GpuExecutor {
            submitter: Submitter::new(
                &ctx.device,
                opts.batch_ops.unwrap_or(batch::DEFAULT_BATCH_OPS),
                ctx.copy_queue.clone(),
            ),
            uniform_align: ctx.limits.min_uniform_buffer_offset_alignment as u64,
            arena: arena.clone(),
            kernels: KernelRegistry::new(
                opts.shader_checks || std::env::var(SHADER_CHECKS_ENV).is_ok_and(|v| v == "1"),
                opts.own_spirv,
            ),
            max_binding,
            align,
            poison: opts.poison_outputs,
            matmul_tile: opts.matmul_tile,
            simt_interior: !opts.checked_matmul_only,
            attention_lanes: !opts.one_row_attention,
            f16_matmul: opts.f16_matmul,
            f16_matmul_resolved: Default::default(),
            f16_attention: opts.f16_attention,
            attention_tiles: opts.attention_tiles,
            copy_attention_operands: opts.copy_attention_operands,
            precision: Default::default(),
            cache_maxima: !opts.recompute_operand_maxima,
            absmax_scans: Default::default(),
            absmax_scan_bytes: Default::default(),
            output_maxima_stored: Default::default(),
            f16_operands: opts.f16_operands,
            f16_maxima: opts.f16_maxima,
            epilogues: opts.epilogues,
            coop_probe: opts.coop_probe,
            attention_probe: opts.attention_probe,
            downloads: opts.downloads,
            uploads: opts.uploads,
            f16_copies: Default::default(),
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
            transport: std::sync::Mutex::new(transport_impl::TransportState::new(&opts, &ctx, &arena)),
            rope_tables: Default::default(),
            docs: Default::default(),
            device_ranks: opts.device_ranks.max(1),
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

    /// The next `n` new device buffers are refused as if the device were
    /// out of memory (`Arena::fail_next_allocations`): for tests of what
    /// a full device does, which no software adapter fills.
    #[doc(hidden)]
    pub fn fail_next_allocations(&self, n: u64) {
        self.arena.fail_next_allocations(n);
    }

    /// Releases pooled (unused) device buffers.
    pub fn trim_pool(&self) {
        // Ops recorded but not yet submitted may still use a buffer the
        // pool holds (a tensor dropped after its op was recorded); wgpu
        // keeps a destroyed buffer alive for work already submitted, not
        // for work submitted after.
        self.flush();
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

    /// Submits the ops recorded so far and blocks until every op has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.flush();
        self.submitter.note_wait();
        Ok(self.ctx.wait()?)
    }

    /// Puts the ops recorded so far on the queue without waiting for them.
    pub fn flush(&self) {
        self.submitter.flush(&self.ctx.queue);
    }

    /// Ops recorded and queue submissions made so far.
    pub fn submit_stats(&self) -> SubmitStats {
        self.submitter.stats()
    }
}
