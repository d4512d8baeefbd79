//! What a [`super::Trainer`] is set up with, and the transfer chunk a run
//! takes where none is named.

use megatrain_adamw::AdamWConfig;
use megatrain_tensor::{LossTerms, mix64};
use megatrain_zoo::layers::Dropouts;

/// Gradient chunks that may wait for the CPU AdamW by default. More let
/// the optimizer fall behind the backward without the thread that queues
/// it waiting (`train --optimizer-queue`): on an H200, 16 took a
/// Qwen2.5-7B step keeping every block from 3,067 to 2,939 ms for 0.06
/// B/param of host memory, and did nothing for TinyLlama-1.1B, whose
/// optimizer keeps up (BENCHMARKS.md, session 47).
pub const DEFAULT_OPTIMIZER_QUEUE: usize = 2;

#[derive(Debug, Clone, PartialEq)]
pub struct TrainerConfig {
    /// K: keep the input of every K-th block during the forward; backward
    /// recomputes K blocks at a time from it.
    pub checkpoint_every: usize,
    /// Rows of the LM head processed at once (logits are `chunk_rows × V`).
    pub chunk_rows: usize,
    pub adamw: AdamWConfig,
    /// Exact global-norm clipping threshold; `None` is off. Needs a tier
    /// that holds gradients.
    pub grad_clip: Option<f64>,
    /// Optimizer jobs that may wait in the queue before the device side
    /// blocks (each holds one chunk of gradients in host memory;
    /// [`DEFAULT_OPTIMIZER_QUEUE`] by default).
    pub optimizer_queue: usize,
    /// Most gradient elements moved, staged and handed to the optimizer at
    /// once: layers larger than this (the embedding and head of a large
    /// vocabulary, and big blocks) come down in chunks of this size, so
    /// host staging and the executor's readback buffers are sized by it
    /// rather than by the largest layer. Results do not depend on it.
    pub transfer_chunk: usize,
    /// Chunks of one layer's gradients whose downloads are in flight at
    /// once (0, the default: all of a block's, begun as soon as its
    /// gradients exist; the embedding's and head's as many at a time).
    /// With a few, the host holds a few chunks, but a chunk begun after
    /// the next layer's backward was queued waits for that backward, and
    /// the rest of the layer comes down while the device idles (session
    /// 28's H200 profile); with a block's, the layer crosses during the
    /// next layer's backward, and the host holds a block of f32 gradients
    /// and a few chunks. On the H200 all of a layer's in flight took
    /// TinyLlama-1.1B's step from 1,129 to 952 ms and Qwen2.5-7B's from
    /// 6,016 to 4,844 ms (BENCHMARKS.md, session 38). Results do not
    /// depend on it.
    pub chunks_in_flight: usize,
    /// The last this many blocks keep their weights and what their forward
    /// saved on the executor until their backward, which then neither
    /// uploads nor recomputes them (at most the model's blocks;
    /// `recompute.rs`). Costs that memory on the executor, saves a quarter
    /// of their FLOPs and one of their two crossings of the bus. Results
    /// do not depend on it.
    pub keep_activations: usize,
    /// This many layers (the first ones, the embedding, then the blocks in
    /// order, or blocks spread over the model: [`CarryOrder`], at most
    /// all of them) leave their gradients on the executor
    /// at the end of the step, and the next step's forward brings each
    /// down and runs its AdamW just before loading it (`carry.rs`): the
    /// host's AdamW of the layers whose gradients come last overlaps the
    /// device's forward of the layers before them instead of following
    /// the backward with the device idle. Costs their f32 gradients in
    /// executor memory between steps. Until [`Trainer::settle`](super::Trainer::settle) (which a
    /// checkpoint save runs), those layers' parameters are one update
    /// behind, an evaluation or generation is refused, and a trainer
    /// dropped unsettled drops the update. Results do not depend on it.
    /// Their gradients stay on the executor for the whole step: summed
    /// there over micro-batches (brought down once, not once each), and,
    /// with clipping, their part of the norm taken there (`row_dots`), so
    /// the tier needs no gradient block for them
    /// ([`megatrain_tier::TierConfig::grads_on_device`]): with clipping and
    /// every layer carried, the host holds 4 bytes a parameter less, and
    /// the executor as many more. That norm is summed in another order
    /// than the held gradients' (f32 within a row): the clip coefficient
    /// can differ in its last bits. Not with data parallel ranks, nor
    /// past the layers a spilling tier keeps in RAM (a carried layer is
    /// updated in place); with clipping, only the first layers.
    pub carry_layers: usize,
    /// Which layers `carry_layers` are ([`carried_layers`]).
    pub carry_order: CarryOrder,
    /// An untied embedding table's step takes only the rows its token ids
    /// look up (`embedding_rows.rs`): those rows go up as a table of their
    /// own and their gradients alone come down, and the other rows' AdamW
    /// (from a gradient of zeros) runs while the device computes the
    /// forward rather than after the whole backward. Where the step's one
    /// micro-batch updates the embedding from the gradients of its
    /// lookups: not with gradients held (accumulation, clipping), carried,
    /// frozen, spilled or reduced across ranks, nor a tied head. On by
    /// default; results do not depend on it (the gradient norm it reports
    /// is summed over fewer zeros: within its last bits).
    pub compact_embedding: bool,
    /// The first this many layers (the embedding, then the blocks in
    /// order; at most all but the head) are not trained: the backward
    /// ends at the first trained layer (no frozen block is uploaded,
    /// recomputed or differentiated, and none of their gradients crosses
    /// the bus), and their parameters, moments and step counts stay as
    /// they are (their moments and any held gradients are never touched,
    /// so never resident). A tied head's matrix is the embedding's, frozen
    /// with it. Not with `carry_layers`.
    pub frozen_layers: usize,
    /// With clipping, whose updates need the norm of every gradient and so
    /// cannot overlap the backward: the step ends once it has the norm,
    /// and the next step's forward runs each layer's AdamW, from its held
    /// gradient (or, for the `carry_layers`, from the executor's), just
    /// before loading it (`carry.rs`), so the host's AdamW
    /// overlaps the device's forward instead of following the backward
    /// with the device idle. As with `carry_layers`, the parameters are
    /// one update behind until [`Trainer::settle`](super::Trainer::settle).
    /// `false` updates every layer before the step returns. A spilled
    /// layer's p, m and v are read ahead in the forward's order; on ranks
    /// a sharded one updates its range and all-gathers the layer's
    /// transport copy before the load, and ranks sharing their copies meet
    /// there. Results do not depend on it.
    pub defer_clipped_updates: bool,
    /// Dropout in the step's forwards (none by default; evaluation and
    /// generation never drop).
    pub dropout: TrainDropout,
    /// PaLM's z-loss factor z: z·lse² per counted target (lse the
    /// log-sum-exp of its logits) joins the loss the gradient is of, the
    /// mean reported as `StepMetrics::z_loss`. 0 is off.
    pub z_loss: f32,
    /// Label smoothing ε in [0, 1]: the gradient is of the cross-entropy
    /// against (1 − ε)·onehot + ε/V, whose mean is reported as
    /// `StepMetrics::smoothed_loss` (`loss` stays the cross-entropy
    /// against the target, comparable with evaluation's). 0 is off.
    pub label_smoothing: f32,
}

/// `rows` (the default) or `whole`: whether an untied embedding's step
/// takes only the rows its ids look up or the whole table
/// ([`TrainerConfig::compact_embedding`]), for timing the two on one
/// machine (no value changes).
pub const EMBEDDING_ENV: &str = "MEGATRAIN_EMBEDDING";

/// [`TrainerConfig::compact_embedding`] as [`EMBEDDING_ENV`] says (on where
/// unset); another value is refused by name.
pub fn compact_embedding_from_env() -> Result<bool, super::TrainError> {
    match std::env::var(EMBEDDING_ENV).as_deref() {
        Err(_) | Ok("rows") => Ok(true),
        Ok("whole") => Ok(false),
        Ok(other) => Err(super::TrainError::Config(format!(
            "{EMBEDDING_ENV}={other}: expected rows or whole"
        ))),
    }
}

/// Which layers [`TrainerConfig::carry_layers`] carries.
///
/// The next forward runs the carried updates one after another on the
/// thread that queues it, each just before its layer is loaded, so the
/// device computes the layers queued since the update before while the
/// host runs the next. Where a block's AdamW takes longer than its
/// forward (Qwen2.5-7B at 8×1024 tokens on the H200 machine: 58 ms of
/// host memory traffic against ~31 ms of kernels), the first layers
/// carried one after another leave the device idle for each update, while
/// blocks with uncarried ones between them are updated while the device
/// runs those: the forward then takes about as long as before, and the
/// backward's optimizer has the carried blocks' AdamW less to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CarryOrder {
    /// The first layers: the embedding, then the blocks in order, then the
    /// head (what clipping's deferred updates and a spilling tier's RAM
    /// prefix go with).
    #[default]
    First,
    /// Blocks evenly spaced over the model, the last block carried and
    /// the first one not; past every block, the embedding, then the head.
    Spread,
}

impl CarryOrder {
    pub fn name(self) -> &'static str {
        match self {
            CarryOrder::First => "first",
            CarryOrder::Spread => "spread",
        }
    }
}

impl std::fmt::Display for CarryOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CarryOrder {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "first" => Ok(CarryOrder::First),
            "spread" => Ok(CarryOrder::Spread),
            other => Err(format!(
                "unknown carry order '{other}' (expected first or spread)"
            )),
        }
    }
}

/// The tier indices (ascending) of the `n` layers `order` carries in a
/// model of `blocks` blocks (tier layer 0 is the embedding, block i is
/// layer 1 + i, the head is layer `blocks + 1`); `n` past every layer is
/// all of them. [`CarryOrder::Spread`] takes block `blocks − ⌊j·blocks/n⌋`
/// (tier index) for j < n while `n` ≤ `blocks`: with 28 blocks and 14
/// carried, every other block from the second on (tier 2, 4, …, 28).
pub fn carried_layers(n: usize, order: CarryOrder, blocks: usize) -> Vec<usize> {
    let layers = blocks + 2;
    let n = n.min(layers);
    match order {
        CarryOrder::First => (0..n).collect(),
        CarryOrder::Spread if n <= blocks => {
            let mut v: Vec<usize> = (0..n).map(|j| blocks - j * blocks / n).collect();
            v.reverse();
            v
        }
        CarryOrder::Spread => {
            // Every block, then the embedding, then the head.
            let mut v: Vec<usize> = (0..=blocks).collect();
            if n == layers {
                v.push(blocks + 1);
            }
            v
        }
    }
}

/// Dropout in training: `hidden` on the embedding's output and each
/// residual branch's (GPT-2's `embd_pdrop` and `resid_pdrop`, nanoGPT's
/// `dropout`), `attention` on the attention's probabilities (`attn_pdrop`,
/// transformers' `attention_dropout`). The masks of micro-batch k of step
/// s are drawn from `(seed, s, k)` and each row's index in the step's
/// global batch, so a recomputed forward draws its forward's, a resumed
/// run draws what the uninterrupted one did, and N data parallel ranks
/// draw what one rank with N times the rows would. `neftune`, NEFTune's α
/// (transformers' `neftune_noise_alpha`), adds uniform noise of magnitude
/// α / √(T·C) to the embedding's lookup, drawn the same way
/// (`megatrain_zoo::layers::Dropouts::with_noise`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TrainDropout {
    pub hidden: f64,
    pub attention: f64,
    pub neftune: f64,
    pub seed: u64,
}

impl TrainDropout {
    /// The dropout of micro-batch `micro` of step `step`, for rows that
    /// begin at row `row0` of the step's global batch; `None` where off.
    /// A probability outside `[0, 0.99]`, or α negative or not finite, is
    /// refused by name.
    pub fn for_micro(&self, step: u64, micro: usize, row0: usize) -> megatrain_zoo::Result<Option<Dropouts>> {
        let key = mix64(&[self.seed, step, micro as u64]);
        let d = Dropouts::with_noise(self.hidden, self.attention, self.neftune, key)?;
        Ok(d.map(|d| d.at_batch_row(row0)))
    }
}

/// Default [`TrainerConfig::transfer_chunk`]: 8 Mi elements, 32 MiB of f32
/// gradients (the spill window's chunk, so its chunks line up), and the
/// most [`transfer_chunk_for`] gives.
pub const DEFAULT_TRANSFER_CHUNK: usize = 8 << 20;

/// The transfer chunk (elements) a run of `params` parameters takes where
/// none is named (`megatrain train`, `plan`, `bench-throughput`): 1/512 of
/// the parameters, between 1 Mi and [`DEFAULT_TRANSFER_CHUNK`] (4 and 32
/// MiB of f32). The host holds a block's chunks and four more
/// (`gradient_chunks_held` on a GPU): about a block of f32 gradients,
/// whatever the vocabulary (0.20 B/param for TinyLlama-1.1B, 0.14 for
/// Qwen2.5-7B); smaller chunks would only round a block's up by less.
/// Changes no result.
pub fn transfer_chunk_for(params: u64) -> usize {
    let floor = (DEFAULT_TRANSFER_CHUNK / 8) as u64;
    (params / 512).clamp(floor, DEFAULT_TRANSFER_CHUNK as u64) as usize
}

/// A transfer chunk of `chunk` elements where layers spill: rounded up to
/// whole chunks of the spill window (`window` elements), since a spilled
/// layer's update reads the window chunk by chunk.
pub(crate) fn spill_aligned(chunk: usize, window: usize) -> usize {
    chunk.div_ceil(window.max(1)) * window.max(1)
}

impl TrainerConfig {
    /// What the head's cross-entropy adds to the loss the gradient is of.
    pub fn loss_terms(&self) -> LossTerms {
        LossTerms {
            z_loss: self.z_loss,
            label_smoothing: self.label_smoothing,
        }
    }
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            checkpoint_every: 1,
            chunk_rows: 256,
            adamw: AdamWConfig::default(),
            grad_clip: None,
            optimizer_queue: DEFAULT_OPTIMIZER_QUEUE,
            transfer_chunk: DEFAULT_TRANSFER_CHUNK,
            chunks_in_flight: 0,
            keep_activations: 0,
            carry_layers: 0,
            carry_order: CarryOrder::First,
            compact_embedding: true,
            frozen_layers: 0,
            defer_clipped_updates: true,
            dropout: TrainDropout::default(),
            z_loss: 0.0,
            label_smoothing: 0.0,
        }
    }
}
