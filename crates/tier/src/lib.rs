//! megatrain-tier: the host-memory tier.
//!
//! One [`LayerSlab`] per layer holds, laid out by the layer's
//! [`ParamTable`](megatrain_tensor::ParamTable):
//!
//! - fp32 parameters (the master weights),
//! - fp32 AdamW `m` and `v`,
//! - the transport copy that is uploaded to the GPU, bf16, f16 or f32
//!   ([`TransportDType`]), rewritten from the params after each update,
//! - an fp32 gradient block only when [`TierConfig::hold_grads`] is set
//!   (and the layer's gradients do not stay on the device,
//!   [`TierConfig::grads_on_device`]).
//!
//! Every block is an [`AlignedBuf`]: page-aligned, allocated once, zeroed by
//! the kernel on first touch (anonymous memory maps rather than
//! `alloc_zeroed`, which `memset`s page-aligned blocks and so touches every
//! page twice). Host bytes per parameter are therefore p 4 + m 4 + v 4 +
//! transport 2 or 4 (+ 4 with held gradients), plus at most one page per
//! block of padding; [`MemoryReport`] counts them exactly by kind.
//!
//! A RAM budget ([`TierConfig::ram_budget_bytes`]) decides placement: layers
//! keep p/m/v in RAM in order until the next one would not fit; it and all
//! later layers map theirs from sparse files in [`TierConfig::spill_dir`].
//! Transport copies always stay in RAM because every forward and backward
//! reads them, whereas the optimizer touches p/m/v once per step,
//! sequentially. [`plan`] computes the same report without allocating.
//! Spilled blocks are also shared file maps, the random-access view that
//! initialisation and checkpoints use: once touched they are resident file
//! pages until [`LayerSlab::evict`] hands them back to the page cache.
//! Training never touches them through the map (the window moves them), so
//! peak RSS stays at the budget plus the window. Saving a spilled tier
//! faults its pages in again (they are clean, reclaimable file pages);
//! loading evicts as it goes.
//!
//! With a sharded optimizer ([`TierConfig::shard`]) a rank keeps only its
//! range of each RAM layer's p, m and v resident ([`shard`] says which):
//! the budget counts the largest rank's share of them, loading hands the
//! rest of each layer back as soon as the layer is written
//! ([`LayerSlab::settle`]), and a spilled layer's rank moves only its range
//! through the window. Its spill files reserve blocks for its range only
//! and nothing writes outside it ([`LayerSlab::fill_params`] stages a
//! layer's parameters in RAM for the transport copy; rank 0 gathers a
//! spilled layer for a checkpoint into RAM, [`Gathered`]). The ranks of one
//! machine can also map one set of transport copies from a file on a memory
//! filesystem ([`TierConfig::shared_transport`], [`shared`]): each writes
//! only its ranks' ranges of it and counts its share against the budget.
//!
//! Measured with `cargo run --release -p megatrain-tier --example tier_rss`:
//! a fully touched 300M-parameter tier with bf16 transport peaks at 14.00
//! bytes of RSS per parameter (loading a checkpoint into it: 14.18, one
//! tensor's file pages at a time).
//!
//! Spilled p/m/v are preallocated at creation (a disk too small is an
//! error before training, [`TierError::DiskFull`]) and moved once per step
//! by [`SpillWindow`]: read ahead of the optimizer in the backward's order
//! and written behind it, in chunks through a bounded set of RAM buffers,
//! with `O_DIRECT` positioned I/O where the filesystem has it. The spill
//! directory is created if missing; spill files are unlinked at creation,
//! so no exit path (a panic, a kill) leaves one behind.
//!
//! Checkpoints ([`save_checkpoint`], [`load_checkpoint`]) are a directory
//! of `model.safetensors` (every parameter under its HF name, f32),
//! `optimizer.safetensors` (`<param>.exp_avg`, `<param>.exp_avg_sq`, and
//! the u64 per-layer step counts `megatrain.layer_steps`) and
//! `checkpoint.json` (counts plus the trainer's `extra` JSON; written last,
//! so its absence marks an incomplete checkpoint). Each file is written
//! atomically (temp file in the same directory, fsync, rename, directory
//! fsync) straight from the slabs; a run directory's `latest` file names
//! the current checkpoint ([`write_latest`], [`read_latest`]). Loading
//! validates every tensor's presence, dtype and shape before writing
//! anything into the tier, and each tensor's CRC-32 (kept in
//! `checkpoint.json`) as it copies it; [`verify_checkpoint_file`] checks
//! one file's CRCs alone. [`rss`] reads the process's current
//! and peak resident set size for the bytes-per-parameter measurement.

pub mod atomic;
mod buf;
mod checkpoint;
mod crc;
mod error;
mod report;
pub mod rss;
pub mod shard;
pub mod shared;
mod slab;
mod spill;
mod stream;
mod tier;

pub use buf::{AlignedBuf, Backing, Element, PAGE, padded_bytes};
pub use checkpoint::{
    CheckpointMeta, Gathered, LATEST_FILE, META_FILE, MODEL_FILE, OPTIMIZER_FILE, STEPS_TENSOR, exp_avg_name,
    exp_avg_sq_name, load_checkpoint, read_checkpoint_meta, read_latest, read_pointer, save_checkpoint,
    save_checkpoint_gathered, write_latest, write_pointer,
};
pub use crc::verify_checkpoint_file;
pub use error::{Result, TierError, is_disk_full};
pub use report::{BytesByKind, MemoryReport};
pub use shard::Shard;
pub use shared::{SharedFile, SharedTransport, create_shared_transport};
pub use slab::{
    LayerSlab, SlabMut, Transport, TransportDType, TransportMut, TransportRef, refresh_transport,
};
pub use spill::{
    CHUNK_ALIGN, Chunk, DiskBandwidth, SpillRegion, SpillStats, SpillWindow, SpilledLayer, WindowConfig,
    measure_disk_bandwidth,
};
pub use tier::{HostTier, TierConfig, plan};
