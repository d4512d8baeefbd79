//! Moving layers between host memory and the device (ARCHITECTURE.md,
//! "Moving bytes with wgpu").

use std::str::FromStr;

/// Which transport implementation moves weights and gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Measure both on this adapter and keep the faster.
    #[default]
    Auto,
    /// A ring of mapped staging buffers plus buffer copies.
    Staging,
    /// Weight slots the CPU writes through a mapping
    /// (`MAPPABLE_PRIMARY_BUFFERS`), double-buffered.
    Mapped,
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "staging" => Ok(TransportChoice::Staging),
            "mapped" => Ok(TransportChoice::Mapped),
            other => Err(format!(
                "unknown transport '{other}' (expected auto, staging or mapped)"
            )),
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Staging => "staging",
            TransportChoice::Mapped => "mapped",
        })
    }
}

/// How gradient downloads reach the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Downloads {
    /// f32 values read where they landed, in the mapped readback buffer.
    #[default]
    InPlace,
    /// Copied out of the readback buffer into the caller's (for timing the
    /// copy that `InPlace` saves).
    Copy,
}

impl std::fmt::Display for Downloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Downloads::InPlace => "in_place",
            Downloads::Copy => "copy",
        })
    }
}

/// Where the chunks of a layer's gradient download are taken from, on a
/// device with a copy queue (`MEGATRAIN_DOWNLOAD_STAGING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DownloadStaging {
    /// Each chunk copied on wgpu's queue into a staging buffer as it is
    /// begun, then to the host on the copy queue: a chunk begun after the
    /// next layer's backward was queued waits for that backward.
    #[default]
    Chunk,
    /// The whole layer copied on wgpu's queue (at the device memory's
    /// speed) as its first chunk is begun, each chunk then to the host on
    /// the copy queue alone, whenever it is begun: device memory for two
    /// or three layers' f32 gradients (up to `LAYER_COPY_MAX_BYTES` a
    /// layer) instead of host memory for their chunks. Chunks begun in
    /// order, each continuing the last, hold the values the tensors had
    /// when the first was begun (the trainer's gradients, which nothing
    /// writes after their backward); any other chunk copies anew.
    Layer,
}

impl std::fmt::Display for DownloadStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DownloadStaging::Chunk => "chunk",
            DownloadStaging::Layer => "layer",
        })
    }
}

mod image;
mod mapped;
mod readback;
mod side_readback;
mod staging;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use megatrain_tensor::{Result, TransportStats};

use crate::GpuError;
use crate::arena::PooledBuffer;

pub(crate) use image::Image;
pub(crate) use mapped::MappedTransport;
pub use readback::{DOWNLOAD_PARTS, DOWNLOAD_PIECE_MIN, DOWNLOAD_SPLIT_BYTES, LAYER_COPY_MAX_BYTES};
pub(crate) use readback::{PendingRead, ReadbackPool};
pub(crate) use side_readback::SideReadback;
pub use side_readback::staging_bytes as download_staging_bytes;
pub(crate) use staging::{
    DEFAULT_CHUNK as DEFAULT_STAGING_CHUNK, DEFAULT_DEPTH as DEFAULT_STAGING_DEPTH, StagingTransport,
};

/// What the transports need of the executor: the device, the queue, and
/// the executor's op batch, which every submission and wait puts on the
/// queue first so that a transfer lands after the ops recorded before it.
pub(crate) struct Link<'a> {
    pub device: &'a wgpu::Device,
    pub queue: &'a wgpu::Queue,
    pub submitter: &'a crate::exec::Submitter,
}

impl Link<'_> {
    /// A buffer of the transport's own (`what`, for the error), or the
    /// error that names it where the device is out of memory.
    pub fn create_buffer(
        &self,
        what: &'static str,
        desc: &wgpu::BufferDescriptor<'_>,
    ) -> Result<wgpu::Buffer> {
        crate::arena::create_buffer_checked(self.device, desc).ok_or_else(|| {
            crate::GpuError::TransportOutOfMemory {
                what,
                bytes: desc.size,
            }
            .into()
        })
    }

    /// Submits `enc`, whose commands use the buffers `uses`.
    pub fn submit(&self, enc: wgpu::CommandEncoder, uses: &[&wgpu::Buffer]) -> wgpu::SubmissionIndex {
        self.submitter
            .submit_after_batch(self.queue, [enc.finish()], uses)
    }

    /// Submits a copy (using the buffers `uses`) after an empty submission
    /// that marks the end of the work queued before it, so a later wait
    /// can tell compute from copy.
    pub fn submit_copy(&self, enc: wgpu::CommandEncoder, uses: &[&wgpu::Buffer]) -> Copying {
        let cmd = enc.finish();
        let mut b = self.submitter.lock();
        self.submitter.flush_locked(&mut b, self.queue);
        let before = self.submitter.submit_mark(self.queue);
        let copy = self.submitter.submit_transfer_locked(self.queue, cmd, uses);
        Copying { before, copy }
    }

    /// Submits the pending op batch: a wait or a mapping covers submitted
    /// work only, and an op still being recorded would never finish.
    pub fn flush(&self) {
        self.submitter.flush(self.queue);
    }

    /// Waits for `c`: the work queued before it counts into `compute_ns`,
    /// the copy itself (and the mapping `map` it gates) into `copy_ns`.
    pub fn wait_copy(
        &self,
        c: &Copying,
        map: &MapState,
        compute_ns: &mut u64,
        copy_ns: &mut u64,
    ) -> Result<()> {
        let t = Instant::now();
        if map.get() == MapState::PENDING {
            self.wait_for(&c.before)?;
        }
        let t2 = Instant::now();
        *compute_ns += nanos(t2 - t);
        if map.get() == MapState::PENDING {
            self.wait_for(&c.copy)?;
        }
        self.wait_map(map)?;
        *copy_ns += nanos(t2.elapsed());
        Ok(())
    }

    /// Blocks until submission `idx` has finished and its callbacks ran.
    pub fn wait_for(&self, idx: &wgpu::SubmissionIndex) -> Result<()> {
        self.flush();
        self.submitter.note_wait();
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(idx.clone()),
                timeout: None,
            })
            .map(|_| ())
            .map_err(|e| GpuError::Poll(e.to_string()).into())
    }

    /// Polls (sleeping briefly in between, so a shared CPU is left to the
    /// driver and the optimizer) until `state` leaves `PENDING`. For maps
    /// whose gating submission is not known.
    pub fn wait_map(&self, state: &MapState) -> Result<()> {
        self.flush();
        self.submitter.note_wait();
        let mut nap = Duration::from_micros(20);
        loop {
            match state.get() {
                MapState::PENDING => {}
                MapState::FAILED => {
                    return Err(GpuError::Map("the driver refused a buffer mapping".into()).into());
                }
                _ => return Ok(()),
            }
            self.device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| GpuError::Poll(e.to_string()))?;
            if state.get() != MapState::PENDING {
                continue;
            }
            std::thread::sleep(nap);
            // At most 100 us: a small model waits for many short maps per
            // step, and a longer nap would overshoot each by up to its length.
            nap = (nap * 2).min(Duration::from_micros(100));
        }
    }
}

pub(crate) fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// A copy on the queue and the mark just before it.
pub(crate) struct Copying {
    pub before: wgpu::SubmissionIndex,
    pub copy: wgpu::SubmissionIndex,
}

/// The threads that copy into and out of mapped memory: a pool of the
/// transport's own, so a copy never queues behind the optimizer's chunks
/// on rayon's global pool.
pub(crate) fn copy_pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("megatrain-copy-{i}"))
        .build()
        .expect("spawning the transport's copy threads")
}

/// Where a buffer's mapping stands, set by the `map_async` callback.
#[derive(Clone, Default)]
pub(crate) struct MapState(Arc<AtomicU8>);

impl MapState {
    pub const PENDING: u8 = 0;
    pub const MAPPED: u8 = 1;
    pub const FAILED: u8 = 2;

    pub fn mapped() -> Self {
        let s = MapState::default();
        s.0.store(Self::MAPPED, Ordering::Release);
        s
    }

    pub fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }

    /// Starts mapping `bytes` bytes of `buf` from 0.
    pub fn map(&self, buf: &wgpu::Buffer, mode: wgpu::MapMode, bytes: u64) {
        self.0.store(Self::PENDING, Ordering::Release);
        let s = self.0.clone();
        buf.map_async(mode, 0..bytes, move |r| {
            s.store(
                if r.is_ok() { Self::MAPPED } else { Self::FAILED },
                Ordering::Release,
            );
        });
    }
}

/// A weight slot's one device buffer, and whether the CPU holds it mapped.
pub(crate) struct SlotBuffer {
    pub buf: Arc<PooledBuffer>,
    pub map: MapState,
    pub mapped: bool,
}

/// The two ways a layer's transport copy reaches its weight slot (and its
/// gradients come back); [`crate::GpuExecutor`] keeps one of each and uses
/// the one chosen for the adapter.
pub(crate) trait Transport: Send {
    /// Usage of the weight slot buffers this transport writes.
    fn slot_usage(&self) -> wgpu::BufferUsages;
    /// Whether a fresh slot buffer should start mapped.
    fn slot_mapped_at_creation(&self) -> bool;
    /// Writes `image` to the start of `slot`, copying on `pool`'s threads,
    /// and adds where the time went to `stats`.
    fn write(
        &mut self,
        link: &Link<'_>,
        slot: &mut SlotBuffer,
        image: &Image<'_>,
        pool: &rayon::ThreadPool,
        stats: &mut TransportStats,
    ) -> Result<()>;
    /// Usage of the buffers gradients are read back through.
    fn readback_usage(&self) -> wgpu::BufferUsages;
}
