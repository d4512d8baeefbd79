//! What the `megatrain` command does, as a library: options, tokenizer
//! choice, run directories and checkpoints, the training loop, metrics,
//! the loss plot, generation and the memory plan.

mod checkpoint;
mod cover;
mod dist_check;
mod encoder;
mod error;
mod evaluate;
mod every;
mod generate;
pub mod interrupt;
mod keep;
mod knobs;
mod metrics_log;
mod options;
mod plan;
mod plan_ranks;
mod plot;
mod prepare;
mod session;
mod sizes;
pub mod tensorboard;

pub use checkpoint::{
    BEST_FILE, CONFIG_FILE, Patience, Pick, STATE_FILE, TrainState, best_checkpoint, chat_template_spec,
    checkpoint_name, latest_checkpoint, note_best, prune_checkpoints, read_train_state, resolve_model_dir,
    save_run_checkpoint,
};
pub use cover::{BusCover, CLIP_NORM_SHARE, Machine, bus_cover, bus_cover_keeping};
pub use encoder::{Encoder, char_vocab, copy_atomic, kind_name};
pub use error::{Result, RunError};
pub use evaluate::{evaluate, evaluate_batches};
pub use every::{Every, Passes};
pub use generate::{
    Decoder, GenerationConfig, LanguageModel, Resident, SampleOptions, generate, generate_samples,
    generate_until, generate_with, pick,
};
pub use keep::{DEVICE_SHARE, HOST_SHARE, KeepActivations, Kept, Room};
pub use knobs::{
    MAX_COPY_THREADS, MAX_STAGING_CHUNK_MIB, MAX_STAGING_DEPTH, MAX_TRANSFER_CHUNK, TransportKnobs,
    transfer_chunk_elems,
};
pub use metrics_log::{METRICS_FILE, MetricsLog};
pub use options::{
    CARRY_ALL, DeviceChoice, MAX_OPTIMIZER_QUEUE, Packing, Precision, RowsKind, SamplingKind, Schedule,
    ShareTransport, TrainOptions, check_carry_layers, check_doc_end, check_freeze_layers,
    check_optimizer_queue, parse_carry_layers,
};
pub use plan::{
    DeviceBytes, DiskEstimate, Plan, PlanInput, disk_estimate, layer_device_bytes, mem_available, most_kept,
    plan,
};
pub use plan_ranks::{RankBytes, per_rank};
pub use plot::{PLOT_FILE, render_svg, write_plot};
pub use prepare::{Prepared, RESUMED_WITH, prepare, stream_docs};
pub use session::{Progress, QuietProgress, Summary, tier_config, tier_params, train, train_with};
pub use sizes::parse_bytes;
