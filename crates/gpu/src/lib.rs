//! megatrain-gpu: the wgpu context, the WGSL kernel registry, the device
//! buffer arena and [`GpuExecutor`], which implements every op of
//! [`megatrain_tensor::Executor`] on the GPU. See ARCHITECTURE.md.

mod arena;
mod context;
mod coop;
mod coop_attention;
mod coop_attention_tile;
mod coop_tile;
mod copy_queue;
mod device_checks;
mod device_memory;
pub mod diagnose;
mod error;
mod exec;
#[cfg(feature = "host-floor")]
mod host_floor;
mod host_import;
mod kernels;
mod passthrough;
mod profile;
mod simt;
mod tensor;
mod transport;

pub use arena::ArenaStats;
pub use context::{ADAPTER_ENV, AdapterReport, GpuContext, LAVAPIPE_COOP_ENV, NOOP_ADAPTER};
pub use coop::{CoopMatmul, CoopProbe, CoopTile, KLoop, TileShape};
pub use coop_attention::{AttnPass, AttnProbe, AttnTile, AttnTiles, CoopAttention};
pub use copy_queue::{COPY_QUEUE_ENV, CopyQueueChoice, CopyQueueStats};
pub use error::GpuError;
pub use exec::{
    BindGroupStats, DOWNLOAD_STAGING_ENV, DOWNLOADS_ENV, EPILOGUES_ENV, Epilogues, F16_ATTENTION_ENV,
    F16_ATTENTION_TILES_ENV, F16_MATMUL_ENV, F16_MAXIMA_ENV, F16_OPERANDS_ENV, F16Attention, F16Matmul,
    F16Maxima, F16Operands, GpuExecutor, GpuOptions, HostWork, SHADER_CHECKS_ENV, SubmitStats,
};
#[cfg(feature = "host-floor")]
pub use host_floor::{HOST_FLOOR_ADAPTER, h100_limits};
pub use host_import::{UPLOADS_ENV, Uploads};
pub use kernels::{ATTN_HEAD_DIMS, ATTN_MAX_HEAD_DIM, AttnHeadDim, Kernel};
pub use profile::{OpTiming, TimingSource};
pub use tensor::GpuTensor;
pub use transport::{
    DOWNLOAD_PARTS, DOWNLOAD_PIECE_MIN, DOWNLOAD_SPLIT_BYTES, DownloadStaging, Downloads,
    LAYER_COPY_MAX_BYTES, TransportChoice, download_staging_bytes,
};
