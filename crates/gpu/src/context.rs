//! The wgpu instance, adapter, device and queue, chosen once per process.

use std::sync::Arc;

use crate::GpuError;
use crate::copy_queue::{CopyQueue, CopyQueueChoice};

/// Optional features used when the adapter has them.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::SUBGROUP_BARRIER)
    .union(wgpu::Features::PASSTHROUGH_SHADERS)
    .union(wgpu::Features::SHADER_FLOAT32_ATOMIC)
    .union(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);

/// What the tensor-core kernels need of a device.
const COOP_FEATURES: wgpu::Features =
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16);

/// Environment variable that picks an adapter by a substring of its name.
pub const ADAPTER_ENV: &str = "MEGATRAIN_ADAPTER";

/// `MEGATRAIN_LAVAPIPE_COOP=1`: run the tensor-core kernels on Mesa's
/// lavapipe (Mesa 26 has cooperative matrices), for testing them without a
/// GPU. lavapipe lists only 8x8x8 fragments, 8-lane subgroups and 32 KiB of
/// workgroup memory, but it lowers fragments of any size, allocates what a
/// shader declares, and each 8-lane subgroup of a kernel's 32 computes the
/// whole subgroup's fragments (the kernels use no subgroup operations), so
/// the kernels run as written, every hardware variant included. Honoured
/// only on CPU adapters whose subgroup width divides 32.
pub const LAVAPIPE_COOP_ENV: &str = "MEGATRAIN_LAVAPIPE_COOP";

/// `MEGATRAIN_ADAPTER=noop`: wgpu's noop backend (feature `host-floor`),
/// which runs no kernel; for measuring the host's share of a step only.
pub const NOOP_ADAPTER: &str = "noop";

#[derive(Debug, Clone)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
}

impl std::fmt::Display for AdapterReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}, {}, driver {} {})",
            self.name, self.backend, self.device_type, self.driver, self.driver_info
        )
    }
}

pub struct GpuContext {
    pub adapter: wgpu::Adapter,
    /// Whether the device was opened with cooperative matrices (16x16x16
    /// f16 x f16 -> f32, subgroups of exactly 32): the tensor-core kernels.
    coop: bool,
    /// Opened under [`LAVAPIPE_COOP_ENV`].
    lavapipe_coop: bool,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: AdapterReport,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
    /// Whether host memory can be imported (`VK_EXT_external_memory_host`).
    pub(crate) host_import: Option<crate::host_import::HostImport>,
    /// The host ranges imported so far.
    pub(crate) host_registry: crate::host_import::Registry,
    /// Where uploads from those ranges are copied, if not on `queue`
    /// (`crate::copy_queue`). It holds a clone of `device`.
    pub(crate) copy_queue: Option<Arc<CopyQueue>>,
    /// Why the copy queue `auto` picked was let go as the device opened.
    copy_queue_refused: Option<String>,
    /// The tensor-core attention's check against the SIMT kernels on this
    /// device, per head dimension (`exec/attention_check.rs`).
    pub(crate) coop_attention_checks: crate::device_checks::DeviceChecks<usize>,
    /// Whether each tensor-core matmul tile matched the SIMT kernel on this
    /// device (`exec/matmul_check.rs`).
    pub(crate) coop_matmul_checks: crate::device_checks::DeviceChecks<crate::CoopTile>,
    /// The adapter's smallest subgroup (0 where it has no subgroup
    /// operations, or did not say).
    subgroup_min: u32,
    /// How many adapters of its kind this one was picked among by rank
    /// (`with_adapter_choice`): the ranks of a machine take them in turn.
    /// 1 where it was named, or is the only one.
    pub peers: usize,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// What the tensor-core kernels need of an adapter: cooperative matrices
/// and f16 in shaders, a 16x16x16 f16 x f16 -> f32 configuration, subgroups
/// of exactly 32 lanes (a kernel's subgroup is lanes 32i..32i+31 of its
/// workgroup) and the workgroup memory of the largest tile.
fn tensor_cores_usable(adapter: &wgpu::Adapter, info: &wgpu::AdapterInfo, limits: &wgpu::Limits) -> bool {
    if !adapter.features().contains(COOP_FEATURES) {
        return false;
    }
    let f16_16 = adapter.cooperative_matrix_properties().iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    f16_16
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && limits.max_compute_workgroup_storage_size >= crate::coop::WORKGROUP_BYTES_MAX
}

/// Whether [`LAVAPIPE_COOP_ENV`] asks for the tensor-core kernels on a CPU
/// implementation of cooperative matrices; an error where `adapter` is not
/// one (so a test run that asked for them cannot quietly run without).
fn lavapipe_coop(adapter: &wgpu::Adapter, info: &wgpu::AdapterInfo) -> Result<bool, GpuError> {
    if !std::env::var(LAVAPIPE_COOP_ENV).is_ok_and(|v| v == "1") {
        return Ok(false);
    }
    let width = info.subgroup_max_size;
    let detail = if info.device_type != wgpu::DeviceType::Cpu {
        format!("a {:?} device, not a CPU one", info.device_type)
    } else if !adapter.features().contains(COOP_FEATURES) {
        "no cooperative matrices or f16 (Mesa 26's lavapipe has them: tools/lavapipe_coop.sh)".into()
    } else if info.subgroup_min_size != width || width == 0 || 32 % width != 0 {
        format!(
            "subgroups of {}..{} lanes, not one width dividing 32",
            info.subgroup_min_size, width
        )
    } else {
        return Ok(true);
    };
    Err(GpuError::LavapipeCoop {
        adapter: info.name.clone(),
        detail,
    })
}

impl GpuContext {
    /// Picks an adapter (the `MEGATRAIN_ADAPTER` name substring if set, else
    /// discrete > integrated > virtual > CPU) and opens a device with the
    /// adapter's own limits and the optional features it has.
    pub fn new() -> Result<Arc<Self>, GpuError> {
        let wanted = std::env::var(ADAPTER_ENV).ok().filter(|s| !s.is_empty());
        Self::with_adapter_filter(wanted.as_deref())
    }

    pub fn with_adapter_filter(wanted: Option<&str>) -> Result<Arc<Self>, GpuError> {
        Self::with_adapter_choice(wanted, 0)
    }

    /// Like [`GpuContext::with_adapter_filter`], but without a name takes
    /// the `nth` (modulo their number) of the adapters of the best kind:
    /// data parallel ranks on one machine pass their local rank so each
    /// gets its own GPU.
    pub fn with_adapter_choice(wanted: Option<&str>, nth: usize) -> Result<Arc<Self>, GpuError> {
        Self::choose(wanted, nth, CopyQueueChoice::from_env()?)
    }

    /// [`GpuContext::new`] with the copy queue chosen by the caller
    /// instead of [`crate::COPY_QUEUE_ENV`].
    pub fn with_copy_queue(copy: CopyQueueChoice) -> Result<Arc<Self>, GpuError> {
        let wanted = std::env::var(ADAPTER_ENV).ok().filter(|s| !s.is_empty());
        Self::choose(wanted.as_deref(), 0, copy)
    }

    /// A device whose copies run on a copy queue however many queues it
    /// has: its own second one where it offers one (`Auto`), else wgpu's
    /// queue (`Shared`), for tests that must run the copy queue's
    /// bookkeeping on a device with one queue. `copy_queue()` is `None`
    /// only where the device imports no host memory.
    pub fn with_some_copy_queue() -> Result<Arc<Self>, GpuError> {
        let own = Self::with_copy_queue(CopyQueueChoice::Auto)?;
        match own.copy_queue {
            Some(_) => Ok(own),
            None => Self::with_copy_queue(CopyQueueChoice::Shared),
        }
    }

    fn choose(wanted: Option<&str>, nth: usize, copy: CopyQueueChoice) -> Result<Arc<Self>, GpuError> {
        if wanted.is_some_and(|w| w.eq_ignore_ascii_case(NOOP_ADAPTER)) {
            return Self::noop_by_name();
        }
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        if adapters.is_empty() {
            return Err(GpuError::NoAdapter {
                diagnosis: crate::diagnose::diagnose(&crate::diagnose::Probe::from_env()),
            });
        }
        let mut peers = 1;
        let adapter = match wanted {
            Some(w) => {
                let lw = w.to_lowercase();
                let found = adapters
                    .iter()
                    .position(|a| a.get_info().name.to_lowercase().contains(&lw));
                match found {
                    Some(i) => adapters.into_iter().nth(i).expect("index from position"),
                    None => {
                        let available = adapters
                            .iter()
                            .map(|a| format!("'{}'", a.get_info().name))
                            .collect::<Vec<_>>()
                            .join(", ");
                        return Err(GpuError::AdapterNotFound {
                            wanted: w.to_string(),
                            available,
                        });
                    }
                }
            }
            None => {
                // Vulkan first among equals: it is where the features we want live.
                let key = |a: &wgpu::Adapter| {
                    let i = a.get_info();
                    (rank(i.device_type), i.backend != wgpu::Backend::Vulkan)
                };
                // The noop backend (compiled in only by the `host-floor`
                // feature, enabled only by an explicit instance option or
                // WGPU_NOOP_BACKEND=1) runs no kernel: never a default.
                let real: Vec<wgpu::Adapter> = adapters
                    .into_iter()
                    .filter(|a| a.get_info().backend != wgpu::Backend::Noop)
                    .collect();
                let Some(best) = real.iter().map(key).min() else {
                    return Err(GpuError::NoAdapter {
                        diagnosis: crate::diagnose::diagnose(&crate::diagnose::Probe::from_env()),
                    });
                };
                let mut same: Vec<wgpu::Adapter> = real.into_iter().filter(|a| key(a) == best).collect();
                peers = same.len();
                let pick = nth % same.len();
                same.swap_remove(pick)
            }
        };
        let mut ctx = Self::open(adapter, copy)?;
        Arc::get_mut(&mut ctx)
            .expect("opened just now, held nowhere else")
            .peers = peers;
        Ok(ctx)
    }

    #[cfg(feature = "host-floor")]
    fn noop_by_name() -> Result<Arc<Self>, GpuError> {
        Self::host_floor()
    }

    #[cfg(not(feature = "host-floor"))]
    fn noop_by_name() -> Result<Arc<Self>, GpuError> {
        Err(GpuError::AdapterNotFound {
            wanted: NOOP_ADAPTER.into(),
            available: "none: the noop adapter needs megatrain-gpu built with the `host-floor` feature"
                .into(),
        })
    }

    /// Opens a device on `adapter` with its own limits and the optional
    /// features it has (cooperative matrices where the tensor-core kernels
    /// can use them).
    pub(crate) fn open(adapter: wgpu::Adapter, copy: CopyQueueChoice) -> Result<Arc<Self>, GpuError> {
        let ai = adapter.get_info();
        let info = AdapterReport {
            name: ai.name.clone(),
            backend: format!("{:?}", ai.backend),
            device_type: format!("{:?}", ai.device_type),
            driver: ai.driver.clone(),
            driver_info: ai.driver_info.clone(),
        };
        let mut features = adapter.features() & WANTED_FEATURES;
        let limits = adapter.limits();
        let lavapipe_coop = lavapipe_coop(&adapter, &ai)?;
        let coop = lavapipe_coop || tensor_cores_usable(&adapter, &ai, &limits);
        if coop {
            features |= COOP_FEATURES;
        }
        // What the kernels assume: 16 KiB of workgroup memory (attention),
        // the storage bindings of the widest kernel, 256-thread workgroups.
        let short = [
            (
                "max_compute_workgroup_storage_size",
                limits.max_compute_workgroup_storage_size,
                16384,
            ),
            (
                "max_storage_buffers_per_shader_stage",
                limits.max_storage_buffers_per_shader_stage,
                crate::kernels::STORAGE_BINDINGS_MAX,
            ),
            (
                "max_compute_invocations_per_workgroup",
                limits.max_compute_invocations_per_workgroup,
                256,
            ),
        ]
        .into_iter()
        .filter(|(_, have, need)| have < need)
        .map(|(name, have, need)| format!("{name} is {have}, need {need}"))
        .collect::<Vec<_>>();
        if !short.is_empty() {
            return Err(GpuError::Limits {
                adapter: info.name.clone(),
                detail: short.join("; "),
            });
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("megatrain"),
            required_features: features,
            required_limits: limits.clone(),
            // SAFETY: experimental features are enabled only for cooperative
            // matrices, which only the tensor-core kernels use; every variant
            // of them is compiled by naga in CI (tests/coop_naga.rs) and
            // checked against the host reference where an adapter has them.
            experimental_features: if coop {
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        // Only `copy` turns the import off here; the executor's options
        // refuse a value that names no setting (`GpuOptions::with_env`).
        let copy_uploads = std::env::var(crate::host_import::UPLOADS_ENV)
            .is_ok_and(|v| v.parse::<crate::Uploads>() == Ok(crate::Uploads::Copy));
        let opened = match copy_uploads {
            true => None,
            false => crate::host_import::open_device(&adapter, &desc, copy),
        };
        let (device, queue, host_import, copy_queue) = match opened {
            Some((device, queue, import, copy_queue)) => {
                (device, queue, Some(import), copy_queue.map(Arc::new))
            }
            None => {
                let (device, queue) = pollster::block_on(adapter.request_device(&desc)).map_err(|cause| {
                    GpuError::RequestDevice {
                        adapter: info.name.clone(),
                        cause,
                    }
                })?;
                (device, queue, None, None)
            }
        };
        let ctx = Arc::new(GpuContext {
            coop,
            lavapipe_coop,
            adapter,
            device,
            queue,
            info,
            features,
            limits,
            host_import,
            host_registry: Default::default(),
            copy_queue,
            copy_queue_refused: None,
            coop_attention_checks: Default::default(),
            coop_matmul_checks: Default::default(),
            subgroup_min: if features.contains(wgpu::Features::SUBGROUP) {
                ai.subgroup_min_size
            } else {
                0
            },
            peers: 1,
        });
        match ctx.copy_queue.is_some() {
            true => ctx.checked_copy_queue(copy, |c| {
                crate::copy_queue::round_trip(c, crate::copy_queue::CHECK_BOUND)
            }),
            false => Ok(ctx),
        }
    }

    /// The context as opened where its copy queue passes `check` (one
    /// round trip through both queues, `copy_queue::round_trip`). Where
    /// it fails, a queue `auto` picked is let go: the device is opened
    /// again without one (a stalled copy may hold wgpu's queue too, behind
    /// the submission that waits for it), with the reason kept for the
    /// transport's report ([`GpuContext::copy_queue_refused`]); a `shared`
    /// queue, asked for by name, is an error.
    pub(crate) fn checked_copy_queue(
        self: Arc<Self>,
        copy: CopyQueueChoice,
        check: impl FnOnce(&Arc<Self>) -> Result<(), crate::copy_queue::Failed>,
    ) -> Result<Arc<Self>, GpuError> {
        let failed = match check(&self) {
            Ok(()) => return Ok(self),
            Err(f) => f,
        };
        let what = self.copy_queue.as_ref().map(|q| q.describe()).unwrap_or_default();
        let reason = format!("the copy queue ({what}) failed its check as the device opened: {failed}");
        if copy == CopyQueueChoice::Shared {
            return Err(GpuError::Unsupported {
                op: "copy queue",
                detail: reason,
            });
        }
        let mut without = Self::open(self.adapter.clone(), CopyQueueChoice::Off)?;
        Arc::get_mut(&mut without)
            .expect("opened just now, held nowhere else")
            .copy_queue_refused = Some(reason);
        if let crate::copy_queue::Failed::Stalled(_) = failed {
            // Its queues may still copy into memory the check gave them.
            std::mem::forget(self);
        }
        Ok(without)
    }

    /// Whether the f32 attention can split a row of head dimension `d` over
    /// four subgroup lanes (`attention_lanes.wgsl`): subgroup operations in
    /// subgroups of at least 4, and the kernels' workgroup memory.
    pub fn attention_lanes(&self, d: usize) -> bool {
        crate::kernels::attn_lanes_fit(d)
            && self.subgroup_min >= 4
            && self.limits.max_compute_workgroup_storage_size >= crate::kernels::attn_lanes_workgroup_bytes(d)
    }

    /// Tensor-core matmuls are available (see `tensor_cores_usable`).
    pub fn has_cooperative_matrix(&self) -> bool {
        self.coop
    }

    /// Whether the tensor-core attention's rows may synchronise within
    /// their subgroup (`AttnTile::local`): subgroup barriers, SPIR-V of
    /// our own (`crate::passthrough`), and subgroups that are the kernels'
    /// 32 lanes (`tensor_cores_usable` asks that of hardware; lavapipe's
    /// are 8 lanes, each computing a whole 32-lane subgroup's fragments).
    pub fn has_subgroup_local_rows(&self) -> bool {
        self.coop
            && !self.lavapipe_coop
            && self.has_own_spirv()
            && self
                .features
                .contains(wgpu::Features::SUBGROUP | wgpu::Features::SUBGROUP_BARRIER)
    }

    /// Whether kernels may be built from SPIR-V of our own
    /// (`crate::passthrough`): a Vulkan device with passthrough shaders.
    pub fn has_own_spirv(&self) -> bool {
        self.adapter.get_info().backend == wgpu::Backend::Vulkan
            && self.features.contains(wgpu::Features::PASSTHROUGH_SHADERS)
    }

    /// Whether the tensor-core kernels run on lavapipe ([`LAVAPIPE_COOP_ENV`]).
    pub fn is_lavapipe_coop(&self) -> bool {
        self.lavapipe_coop
    }

    /// Workgroup memory a kernel may declare: the adapter's limit, or the
    /// tensor-core kernels' largest under [`LAVAPIPE_COOP_ENV`].
    pub fn workgroup_bytes(&self) -> u32 {
        let have = self.limits.max_compute_workgroup_storage_size;
        if self.lavapipe_coop {
            have.max(crate::coop::WORKGROUP_BYTES_MAX)
        } else {
            have
        }
    }

    /// Whether this device runs no kernel: wgpu's noop backend, opened by
    /// `GpuContext::host_floor` (feature `host-floor`) to measure the host.
    pub fn is_host_floor(&self) -> bool {
        self.adapter.get_info().backend == wgpu::Backend::Noop
    }

    /// Whether the device reads registered host memory itself
    /// ([`crate::GpuExecutor`]'s `register_host`).
    pub fn can_import_host_memory(&self) -> bool {
        self.host_import.is_some()
    }

    /// Host ranges registered with the device now (each layer's transport
    /// copy while a trainer holds it).
    pub fn registered_host_ranges(&self) -> usize {
        self.host_registry.len()
    }

    pub fn has_timestamps(&self) -> bool {
        self.features.contains(wgpu::Features::TIMESTAMP_QUERY)
    }

    /// Largest byte range one storage binding may cover.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// The device's copy queue (`MEGATRAIN_COPY_QUEUE`): what it is and
    /// whether its copies run beside the kernels; `None` where uploads
    /// from registered host memory go on wgpu's queue.
    pub fn copy_queue(&self) -> Option<(String, bool)> {
        self.copy_queue.as_ref().map(|q| (q.describe(), q.overlaps()))
    }

    /// Why the device's copies run on wgpu's queue although `auto` found
    /// a second queue: it failed its check as the device opened.
    pub fn copy_queue_refused(&self) -> Option<&str> {
        self.copy_queue_refused.as_deref()
    }

    /// Head dimensions whose tensor-core attention `F16Attention::Auto`
    /// let go on this device, and why: it did not match the SIMT kernels
    /// when first asked for (`GpuExecutor::coop_attention_kernel`).
    pub fn coop_attention_refused(&self) -> Vec<(usize, String)> {
        self.coop_attention_checks.refused()
    }

    /// Tensor-core matmul tiles `F16Matmul::Auto` let go on this device,
    /// and why: they did not match the SIMT kernel when first asked for
    /// (`GpuExecutor::f16_matmul_kernel`).
    pub fn coop_matmul_refused(&self) -> Vec<(String, String)> {
        let refused = self.coop_matmul_checks.refused();
        refused.into_iter().map(|(t, why)| (t.name(), why)).collect()
    }

    /// What the copy queue did so far, where there is one.
    pub fn copy_queue_stats(&self) -> Option<crate::CopyQueueStats> {
        self.copy_queue.as_ref().map(|q| q.stats())
    }

    /// Blocks until all submitted work is done, the copy queue's included.
    pub fn wait(&self) -> Result<(), GpuError> {
        if let Some(q) = &self.copy_queue {
            q.wait_idle()?;
        }
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| GpuError::Poll(e.to_string()))
    }
}
