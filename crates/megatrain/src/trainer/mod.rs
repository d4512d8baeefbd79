//! The streamed training step (ARCHITECTURE.md, "The streamed step").
//!
//! Parameters, moments and transport copies live in the [`HostTier`]; the
//! executor receives one layer at a time:
//!
//! 1. forward: each layer's transport copy is uploaded and run; only the
//!    input of every K-th block (the checkpoints) is kept, and the weights
//!    and saved tensors of the last [`TrainerConfig::keep_activations`]
//!    blocks (`recompute.rs`);
//! 2. loss: final norm, LM head and cross-entropy in chunks of rows, with
//!    its backward at once;
//! 3. backward, last first: each kept block's backward runs on the weights
//!    and activations its forward left; then one group of K blocks at a
//!    time, the group's layers uploaded once, its forward recomputed from
//!    the checkpoint keeping activations, then each layer's backward runs
//!    and its gradients start down to the host at once (finished after the
//!    next layer's backward has been issued);
//! 4. update, overlapped: on the last micro-batch a worker thread runs AdamW
//!    on each layer as its gradients land (and rewrites its transport copy)
//!    while the executor goes on with earlier layers; with
//!    [`TrainerConfig::carry_layers`], some layers' gradients (the first
//!    ones, or blocks spread over the model: [`CarryOrder`]) stay on the
//!    executor and the next step's forward updates each just before it
//!    loads it (`carry.rs`).
//!
//! The embedding weights stay resident from the forward to the embedding
//! backward (a tied head reads them too) and the head runs its backward
//! right after its forward, so those two layers cross the bus once per
//! micro-batch; so do the kept blocks, and every other block crosses twice.
//! An untied embedding's step takes only the rows its ids look up
//! ([`TrainerConfig::compact_embedding`], `embedding_rows.rs`): they alone
//! cross, and the other rows' update runs while the device computes the
//! forward.
//!
//! Layers go into fixed weight slots of the executor (embedding, head, and
//! K + 1 for blocks) so a device reuses their residences; see `Slots` in
//! `upload.rs` for why a load never overwrites weights still in use.
//!
//! Exact global-norm clipping needs every gradient before any update: in
//! that mode gradients are held in the tier, the step ends with their norm,
//! and the next step's forward runs each layer's update just before loading
//! it (`carry.rs`; after the backward instead, reported as optimizer wait,
//! with ranks, a tier that spills, or without
//! [`TrainerConfig::defer_clipped_updates`]). Gradient accumulation also
//! holds gradients; the update overlaps the last micro-batch's backward.

mod carry;
mod config;
mod decode;
mod distributed;
mod embedding_rows;
mod eval;
mod handoff;
mod metrics;
mod modes;
mod norms;
mod optimizer;
mod recompute;
mod reduce;
mod setup;
mod spill_window;
mod update;
mod upload;

use update::{GradSquares, HeldNorms};

use std::borrow::Cow;
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use megatrain_adamw::{AdamW, AdamWError, DecayMask};
use megatrain_tensor::{Executor, Shape, TensorHandle, TransportInfo};
use megatrain_tier::{HostTier, LayerSlab, TierError, WindowConfig};
use megatrain_zoo::layers::{
    HeadOut, RouterAux, Rows, Tied, block_backward, block_forward, embedding_forward, embedding_grads,
    head_forward_backward, routing_digest, sum_losses,
};
use megatrain_zoo::{ModelConfig, ZooError};

use crate::data::Batch;
use carry::{Apply, Carried, Deferred, Rising};
pub use embedding_rows::RowsSetting;
use handoff::{Falling, Handoff, layer_chunks};
pub(crate) use handoff::{chunks_in_flight, gradient_chunks_held};
use metrics::LossSums;
pub use metrics::StepMetrics;
pub use modes::{ComputeOnly, ResidentWeights, TransferOnly};
pub use optimizer::StagingPool;
use optimizer::{Job, Shared, worker};
pub(crate) use recompute::Recompute;
use reduce::{DistState, WorkerReport, dist_worker};
pub use setup::{init_tier, load_tier, load_tier_for_forwards, new_tier};
use update::Hyper;
use upload::{EMBEDDING_SLOT, HEAD_SLOT, Slots};
pub use upload::{held_bytes, load_layer, upload_layer, uploads_of, weight_uploads};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Tensor(#[from] megatrain_tensor::Error),
    #[error(transparent)]
    Zoo(#[from] ZooError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error(transparent)]
    AdamW(#[from] AdamWError),
    #[error("invalid training configuration: {0}")]
    Config(String),
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

pub(crate) use config::spill_aligned;
pub use config::{
    CarryOrder, DEFAULT_OPTIMIZER_QUEUE, DEFAULT_TRANSFER_CHUNK, EMBEDDING_ENV, TrainDropout, TrainerConfig,
    carried_layers, compact_embedding_from_env, transfer_chunk_for,
};

/// Streams a model held in a [`HostTier`] through an [`Executor`].
pub struct Trainer<E: Executor> {
    ex: E,
    model: ModelConfig,
    tier: HostTier,
    config: TrainerConfig,
    adamw: AdamW,
    masks: Vec<DecayMask>,
    pool: StagingPool,
    transport: Option<TransportInfo>,
    /// Read-ahead / write-behind window for spilled layers.
    spill: WindowConfig,
    /// Data parallel training (`None`: this process trains alone).
    dist: Option<DistState>,
    /// The layers whose updates each step leaves to the next
    /// ([`TrainerConfig::carry_layers`], [`carried_layers`]; ascending).
    carry_set: Vec<usize>,
    /// Updates the last step left to the next (`carry.rs`).
    carried: Vec<Carried<E::Tensor>>,
    /// The clipped updates the last step left to the next (`carry.rs`).
    deferred: Option<Deferred>,
    /// The index of the next step, which its dropout masks are drawn from.
    next_step: u64,
    /// The squares of the gradients the step's updates applied.
    grad_sq: GradSquares,
    /// The squares of the held gradients, for clipping's norm.
    held_norms: HeldNorms,
}

/// Lets the executor read each layer's transport copy by itself (uploads
/// become copies the device makes; see [`Executor::register_host`]).
/// Layers already registered (a tier handed on from another trainer) keep
/// their registration.
fn register_transport_copies<E: Executor>(ex: &E, tier: &mut HostTier) -> Result<()> {
    for slab in tier.layers_mut().iter_mut().filter(|s| !s.is_registered()) {
        // SAFETY: the slab keeps the registration and drops it before its
        // transport copy (`LayerSlab::keep_registration`). The step writes
        // a layer's transport copy (AdamW, or the data parallel all-gather)
        // only once that layer's gradients have landed, and they are
        // computed after every load of the layer in the step; an update
        // carried into the next step (`carry.rs`) writes it there before
        // that step loads the layer, once the gradients, and so every load
        // of the step before, are done. Where a
        // machine's ranks share the copy, another rank writes its range
        // of a layer once the reduction of that layer's gradients, which
        // needs this rank's, is in, and the step ends with a barrier of
        // them all. The spill
        // window never moves a transport copy (they stay in RAM); outside
        // a step every load has completed (the step and the evaluation end
        // with a finished download).
        if let Some(r) = unsafe { ex.register_host(slab.transport_pages()) }? {
            slab.keep_registration(r);
        }
    }
    Ok(())
}

/// Where a micro-batch stands in its step.
#[derive(Debug, Clone, Copy)]
struct Micro {
    /// The step's first: its forward applies what the last step carried.
    first: bool,
    /// The step's last.
    last: bool,
    /// Its gradients are applied as they come (the last, without
    /// clipping); else summed.
    update: bool,
}

/// Milliseconds since `t`.
fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl<E: Executor> Trainer<E> {
    /// `tier` must hold the model's layers in order (as laid out by
    /// `model.layer_tables()`), with parameters already initialised or
    /// loaded and transport copies refreshed.
    pub fn new(ex: E, model: ModelConfig, tier: HostTier, config: TrainerConfig) -> Result<Self> {
        if config.checkpoint_every == 0
            || config.chunk_rows == 0
            || config.optimizer_queue == 0
            || config.transfer_chunk == 0
        {
            return Err(TrainError::Config(format!(
                "checkpoint_every ({}), chunk_rows ({}), optimizer_queue ({}) and transfer_chunk ({}) must be positive",
                config.checkpoint_every, config.chunk_rows, config.optimizer_queue, config.transfer_chunk
            )));
        }
        if config.keep_activations > model.num_layers {
            return Err(TrainError::Config(format!(
                "keep_activations ({}) is more than the model's {} blocks",
                config.keep_activations, model.num_layers
            )));
        }
        config
            .loss_terms()
            .check()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        if let Some(c) = config.grad_clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(TrainError::Config(format!(
                    "grad_clip {c} must be positive and finite"
                )));
            }
            if !tier.config().hold_grads && config.carry_layers < tier.len() {
                return Err(TrainError::Config(
                    "exact gradient clipping needs a tier that holds gradients (hold_grads) of the layers not carried"
                        .into(),
                ));
            }
        }
        let carry_set = carried_layers(config.carry_layers, config.carry_order, model.num_layers);
        let on_device = &tier.config().grads_on_device;
        if tier.config().hold_grads
            && let Some(i) = on_device.iter().find(|i| carry_set.binary_search(i).is_err())
        {
            return Err(TrainError::Config(format!(
                "the tier holds no gradients of layer {i} (grads_on_device {on_device:?}), which is not carried \
                 (carry_layers {}, {}: {carry_set:?}); only carried layers' gradients stay on the executor",
                config.carry_layers, config.carry_order
            )));
        }
        if config.frozen_layers > 0 {
            let why = match () {
                _ if config.frozen_layers >= tier.len() => Some(format!(
                    "leaves none of the model's {} layers to train (the head at least must be)",
                    tier.len()
                )),
                _ if config.carry_layers > 0 => Some(format!(
                    "cannot be used with carry_layers ({}), which counts from the first layer",
                    config.carry_layers
                )),
                _ => None,
            };
            if let Some(why) = why {
                return Err(TrainError::Config(format!(
                    "frozen_layers ({}) {why}",
                    config.frozen_layers
                )));
            }
        }
        if config.carry_layers > 0 {
            if config.carry_layers > tier.len() {
                return Err(TrainError::Config(format!(
                    "carry_layers ({}) is more than the model's {} layers",
                    config.carry_layers,
                    tier.len()
                )));
            }
            // A carried layer is updated from the executor's gradients in
            // the next forward, in place: its p, m and v must be in RAM.
            if let Some(s) = carry_set
                .iter()
                .map(|&i| &tier.layers()[i])
                .find(|s| s.is_spilled())
            {
                let first = tier
                    .layers()
                    .iter()
                    .position(|s| s.is_spilled())
                    .unwrap_or(s.index());
                let order = match config.carry_order {
                    CarryOrder::First => String::new(),
                    o => format!(", {o}"),
                };
                return Err(TrainError::Config(format!(
                    "carry_layers ({}{order}) reaches layer {}, which the tier spills to disk: carry at most {first} \
                     of the first layers (those before the first spilled one), or give the tier more RAM",
                    config.carry_layers,
                    s.index(),
                )));
            }
            // Clipping's norm and deferred updates take the carried layers
            // as the first ones (`norms.rs`).
            if config.grad_clip.is_some() && config.carry_order != CarryOrder::First {
                return Err(TrainError::Config(format!(
                    "carry_layers ({}, {}) cannot be used with grad_clip: every clipped update waits for the \
                     step's norm and goes into the next forward anyway; carry the first layers (to keep their \
                     gradients on the executor) or none",
                    config.carry_layers, config.carry_order
                )));
            }
        }
        config
            .dropout
            .for_micro(0, 0, 0)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let tables = model.layer_tables();
        if tables.len() != tier.len() || tables.iter().zip(tier.layers()).any(|(t, s)| t != s.table()) {
            return Err(TrainError::Config(format!(
                "the tier's {} layers do not match the model's {} layer tables",
                tier.len(),
                tables.len()
            )));
        }
        let masks = tables.iter().map(DecayMask::from_param_table).collect();
        // Sized by what crosses at once: the largest layer up to a chunk.
        let chunk_bytes = 4 * config.transfer_chunk as u64;
        let layer_bytes = tier
            .layers()
            .iter()
            .map(|s| held_bytes(&weight_uploads(s)))
            .max()
            .unwrap_or(0)
            .min(chunk_bytes);
        let grad_bytes = tier
            .layers()
            .iter()
            .map(|s| 4 * s.numel() as u64)
            .max()
            .unwrap_or(0)
            .min(chunk_bytes);
        let mut transport = ex.prepare_transport(layer_bytes, grad_bytes)?;
        let mut tier = tier;
        register_transport_copies(&ex, &mut tier)?;
        let registered = tier.layers().iter().filter(|s| s.is_registered()).count();
        if let Some(t) = transport.as_mut().filter(|_| registered > 0) {
            t.reason.push_str(&format!(
                "; the device copies the uploads of {registered} of {} layers from the tier itself (registered host memory)",
                tier.len()
            ));
        }
        Ok(Trainer {
            adamw: AdamW::new(config.adamw)?,
            ex,
            model,
            tier,
            config,
            masks,
            pool: StagingPool::default(),
            transport,
            spill: WindowConfig::default(),
            dist: None,
            carry_set,
            carried: Vec::new(),
            deferred: None,
            next_step: 0,
            grad_sq: GradSquares::default(),
            held_norms: HeldNorms::default(),
        })
    }

    /// The index of the next step (0 for a new trainer): its dropout masks
    /// are drawn from it ([`TrainDropout`]). A run resumed at step `s`
    /// sets `s`, so that it draws what the uninterrupted run did.
    pub fn set_next_step(&mut self, step: u64) {
        self.next_step = step;
    }

    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The rows of micro-batch `k` of the next step as its forwards run
    /// them: its documents and its dropout (rank r's rows begin at row r·b
    /// of the step's global batch, as its data does).
    pub(super) fn rows<'a>(&self, batch: &'a Batch, k: usize) -> Result<Rows<'a>> {
        let rank = self.dist.as_ref().map_or(0, |d| d.comm().rank());
        let dropout = self
            .config
            .dropout
            .for_micro(self.next_step, k, rank * batch.batch)?;
        Ok(Rows {
            docs: batch.docs.as_ref(),
            dropout,
        })
    }

    /// The RAM window through which spilled layers are updated (default
    /// [`WindowConfig::default`]).
    pub fn set_spill_window(&mut self, config: WindowConfig) {
        self.spill = config;
    }

    pub fn spill_window(&self) -> WindowConfig {
        self.spill
    }

    pub fn executor(&self) -> &E {
        &self.ex
    }

    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The tier. With updates carried ([`TrainerConfig::carry_layers`], or
    /// every layer's after a clipping step,
    /// [`TrainerConfig::defer_clipped_updates`]), the carried layers'
    /// parameters, moments and transport copies are one update behind until
    /// [`Trainer::settle`].
    pub fn tier(&self) -> &HostTier {
        &self.tier
    }

    /// Mutable tier access (checkpoint loading); transport copies must be
    /// refreshed after parameters change (where a machine's ranks share
    /// them, every rank refreshes its ranges, and the ranks must meet at a
    /// collective before any of them uploads again: a step's own barrier
    /// comes only at its end). Layers put in through it are not registered
    /// with the executor: their uploads are copied by the host.
    ///
    /// # Panics
    /// Where updates are carried ([`Trainer::carried_layers`]): settle
    /// them first, or they would be applied over what is put in.
    pub fn tier_mut(&mut self) -> &mut HostTier {
        assert!(
            self.carried_layers() == 0,
            "Trainer::tier_mut with the updates of {} carried: call Trainer::settle first",
            self.describe_carried()
        );
        &mut self.tier
    }

    /// How the executor moves layers and why, where it had a choice.
    pub fn transport_info(&self) -> Option<&TransportInfo> {
        self.transport.as_ref()
    }

    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// Most host bytes the gradient staging buffers held at once.
    pub fn staging_bytes(&self) -> u64 {
        self.pool.peak_bytes()
    }

    /// Gradient elements moved at once: [`TrainerConfig::transfer_chunk`],
    /// rounded up to whole chunks of the spill window where layers spill
    /// (their updates read the window chunk by chunk).
    fn transfer_chunk(&self) -> usize {
        let c = self.config.transfer_chunk;
        match self.tier.has_spill() {
            true => spill_aligned(c, self.spill.chunk_elems),
            false => c,
        }
    }

    /// Makes sure the executor holds the readback buffers gradients of
    /// `chunk` elements land in: the chunks of a layer in flight, those
    /// queued for the optimizer and a few more. Returns the chunks of a
    /// layer in flight.
    fn reserve_gradient_downloads(&self, chunk: usize) -> Result<usize> {
        let (largest, in_flight) = layer_chunks(self.tier.layers(), self.config.chunks_in_flight, chunk);
        self.ex.reserve_downloads(
            chunk.min(largest),
            gradient_chunks_held(self.config.optimizer_queue, self.dist.is_some(), in_flight),
        )?;
        Ok(in_flight)
    }

    /// One optimizer step over `micro` micro-batches at learning rate `lr`.
    /// Where updates are carried ([`TrainerConfig::carry_layers`], and
    /// clipping's, [`TrainerConfig::defer_clipped_updates`]), it first
    /// applies those the last step left, as its forward reaches each layer;
    /// a step that fails drops any it had not applied yet.
    pub fn step(&mut self, micro: &[Batch], lr: f64) -> Result<StepMetrics> {
        let t_step = Instant::now();
        if micro.is_empty() {
            return Err(TrainError::Config("a step needs at least one micro-batch".into()));
        }
        if self.tier.is_transport_only() {
            return Err(TrainError::Config(
                "a step needs the tier's fp32 parameters; this one keeps only its transport copies".into(),
            ));
        }
        // Carried layers sum their micro-batches on the executor.
        let holds = self.tier.config().hold_grads || self.config.carry_layers == self.tier.len();
        if micro.len() > 1 && !holds {
            return Err(TrainError::Config(format!(
                "{} micro-batches need a tier that holds gradients (hold_grads)",
                micro.len()
            )));
        }
        let local_counted: usize = micro.iter().map(Batch::counted).sum();
        let t_count = Instant::now();
        let counted = self.global_counted(local_counted)?;
        let count_ms = ms(t_count);
        let grad_scale = if counted > 0 { 1.0 / counted as f32 } else { 0.0 };
        let mut m = StepMetrics {
            transport_bytes: self
                .tier
                .layers()
                .iter()
                .map(|s| s.transport().as_bytes().len() as u64)
                .sum(),
            ..StepMetrics::default()
        };
        self.ex.reset_peak_memory();
        let bus_before = self.ex.transport_stats();
        m.comm_ms += count_ms;
        m.comm_wait_ms += count_ms;
        let mut sums = LossSums::default();
        self.grad_sq.reset(self.tier.layers().len());
        if self.config.grad_clip.is_some() {
            self.held_norms
                .reset(self.tier.layers().iter().map(LayerSlab::numel));
        }
        // A mixture of experts' load-balancing loss is each forward's, as
        // transformers computes it, averaged over the step's micro-batches
        // on every rank.
        let ranks = self.dist.as_ref().map_or(1, |d| d.comm().size());
        let aux_weight = 1.0 / (micro.len() * ranks) as f64;
        for (k, batch) in micro.iter().enumerate() {
            let last = k + 1 == micro.len();
            let update = last && self.config.grad_clip.is_none();
            let rows = self.rows(batch, k)?;
            let s = self.micro_batch(
                (batch, rows),
                (grad_scale, aux_weight),
                Micro {
                    first: k == 0,
                    last,
                    update,
                },
                lr as f32,
                &mut m,
            )?;
            sums.add(&s);
            m.tokens += (batch.batch * batch.seq_len) as u64;
        }
        if let Some(d) = &self.dist {
            let t = Instant::now();
            let mut x = sums.to_array();
            d.comm()
                .sum_f64(&mut x)
                .map_err(|e| TrainError::Internal(e.to_string()))?;
            sums = LossSums::from_array(x);
            // Every rank draws batches of the same shape.
            m.tokens *= d.comm().size() as u64;
            m.ranks = d.comm().size() as u64;
            m.comm_ms += ms(t);
            m.comm_wait_ms += ms(t);
        }
        if let Some(max_norm) = self.config.grad_clip {
            let t = Instant::now();
            let norm = self.clip(max_norm, lr as f32, &mut m)?;
            let busy = ms(t);
            m.optimizer_ms += busy;
            m.optimizer_wait_ms += busy;
            m.optimizer_tail_ms += busy;
            m.grad_norm = Some(norm);
        }
        self.gradient_norms(&mut m)?;
        self.settle_shared_copies(&mut m)?;
        m.counted = counted as u64;
        let mean = |sum: f64| if counted > 0 { sum / counted as f64 } else { 0.0 };
        m.loss = mean(sums.cross_entropy) + sums.aux;
        if self.config.z_loss > 0.0 && counted > 0 {
            m.z_loss = Some(mean(sums.z));
        }
        let eps = self.config.label_smoothing as f64;
        if eps > 0.0 {
            let ce = (1.0 - eps) * sums.cross_entropy + eps * sums.uniform;
            m.smoothed_loss = Some(mean(ce) + sums.aux);
        }
        m.optimizer_hidden = if m.optimizer_ms > 0.0 {
            (1.0 - m.optimizer_wait_ms / m.optimizer_ms).clamp(0.0, 1.0)
        } else {
            0.0
        };
        m.device_peak_bytes = self.ex.memory_stats().map_or(0, |s| s.peak_bytes);
        if let (Some(a), Some(b)) = (bus_before, self.ex.transport_stats()) {
            let d = b.since(&a);
            m.bus_ms = d.up_bus_ms() + d.down_bus_ms();
            m.bytes_uploaded_direct = d.bytes_up_direct;
            m.transfer_wait_compute_ms = d.wait_compute_ms();
        }
        m.step_ms = ms(t_step);
        self.next_step += 1;
        Ok(m)
    }

    /// Forward, loss and backward of one micro-batch; gradients go to the
    /// optimizer worker (accumulated, and applied when `update`). The
    /// cross-entropy's gradient is scaled by `grad_scale`, the routers'
    /// load-balancing loss (where the model adds one) by `aux_weight`.
    /// Returns the micro-batch's cross-entropy sum and its weighted
    /// load-balancing loss.
    fn micro_batch(
        &mut self,
        (batch, rows): (&Batch, Rows<'_>),
        (grad_scale, aux_weight): (f32, f64),
        Micro { first, last, update }: Micro,
        lr: f32,
        m: &mut StepMetrics,
    ) -> Result<LossSums> {
        let chunk = self.transfer_chunk();
        let in_flight = self.reserve_gradient_downloads(chunk)?;
        // The embedding's rows alone, where its one micro-batch updates it
        // from its lookups (`embedding_rows.rs`).
        let step_rows = (first && update).then(|| self.step_rows(&batch.inputs)).flatten();
        let Trainer {
            ex,
            model: cfg,
            tier,
            config,
            adamw,
            masks,
            pool,
            transport: _,
            spill,
            dist,
            carry_set,
            carried,
            deferred,
            next_step: _,
            grad_sq,
            held_norms,
        } = self;
        let dist = dist.as_ref();
        let ex: &E = ex;
        let (adamw, masks, pool): (&AdamW, &[DecayMask], &StagingPool) = (adamw, masks, pool);
        let (b, t) = (batch.batch, batch.seq_len);
        let n_blocks = cfg.num_layers;
        let k = config.checkpoint_every;
        // Tier layer 0 is the embedding: block i is layer 1 + i.
        let frozen = config.frozen_layers;
        let plan = Recompute::trained_from(n_blocks, k, config.keep_activations, frozen.saturating_sub(1));
        // Read-ahead starts now, so the forward hides the first reads.
        let window = match update {
            true => spill_window::start_backward(tier, dist, *spill, config.frozen_layers)?,
            false => None,
        };
        let shared = Shared {
            adamw,
            masks,
            lr,
            pool,
            window: window.as_ref(),
            grad_sq,
            held_norms: (last && config.grad_clip.is_some() && dist.is_none()).then_some(&*held_norms),
        };
        let emb_cfg = match &step_rows {
            Some(r) => Cow::Owned(r.model(cfg)),
            None => Cow::Borrowed(cfg),
        };
        let ids: &[u32] = step_rows.as_ref().map_or(&batch.inputs, |r| &r.remapped);
        let emb_hyper = Hyper {
            adamw,
            mask: &masks[0],
            lr,
            grad_scale: 1.0,
            grad_sq: Some(&*grad_sq),
        };
        let (tx, rx) = sync_channel::<Job<'_>>(config.optimizer_queue);
        // The last step's carried updates (and clipped ones), applied as
        // the forward of the step's first micro-batch reaches each layer;
        // their first downloads begin now. After it, what is carried is
        // this step's sums so far.
        let (from_last_step, so_far) = match first {
            true => (std::mem::take(carried), Vec::new()),
            false => (Vec::new(), std::mem::take(carried)),
        };
        // Spilled layers' clipped updates read ahead in the forward's order.
        let deferred = deferred.take();
        let ahead = spill_window::start_deferred(tier, dist, *spill, deferred)?;
        let mut rising = Rising::new(from_last_step, deferred, tier.layers(), chunk, in_flight)?;
        rising.begin_more(ex)?;
        let apply = Apply {
            adamw,
            masks,
            pool,
            dist,
            window: ahead.as_ref(),
        };

        let loss = std::thread::scope(|scope| -> Result<LossSums> {
            let opt = scope.spawn(move || match dist {
                Some(d) => dist_worker(rx, shared, d, last),
                None => worker(rx, shared).map(|busy_ms| WorkerReport {
                    busy_ms,
                    ..WorkerReport::default()
                }),
            });
            let mut h = Handoff::new(ex, tx, pool, update, (chunk, in_flight), tier.layers_mut())
                .carrying(carry_set, lr, so_far, last);
            let mut slots = Slots::new(k);
            let load = |slot, slab: &LayerSlab, m: &mut StepMetrics| -> Result<Vec<E::Tensor>> {
                let t = Instant::now();
                let (w, bytes) = load_layer(ex, slot, slab)?;
                m.upload_ms += ms(t);
                m.bytes_uploaded += bytes;
                Ok(w)
            };

            // 1. Forward, keeping the input of every K-th recomputed
            // block and what the kept blocks saved.
            let t_fwd = Instant::now();
            rising.settle_through(ex, 0, h.remaining, &apply, m)?;
            let emb_w = match &step_rows {
                Some(r) => {
                    let t = Instant::now();
                    let (w, bytes) = r.upload(ex, &h.remaining[0])?;
                    m.upload_ms += ms(t);
                    m.bytes_uploaded += bytes;
                    vec![w]
                }
                None => load(EMBEDDING_SLOT, &h.remaining[0], m)?,
            };
            let mut x = embedding_forward(&emb_cfg, ex, &emb_w, ids, b, t, rows)?;
            // The embedding backward reads only the tables' shapes: unless a
            // tied head reads them, free them now (on an executor whose
            // tensors are host memory they are the vocabulary's size; a
            // device slot keeps its buffer either way).
            let emb_shapes: Vec<Shape> = emb_w.iter().map(|w| w.shape().clone()).collect();
            let emb_w = if cfg.tie_word_embeddings {
                emb_w
            } else {
                drop(emb_w);
                Vec::new()
            };
            // The routers' load-balancing loss leaves padding out.
            let tokens = batch.tokens_mask();
            let mut checkpoints = Vec::with_capacity(plan.checkpoint_count());
            let mut kept = Vec::with_capacity(plan.kept().len());
            let mut stats = Vec::new();
            for i in 0..n_blocks {
                let keeps = plan.keeps(i);
                let slot = match keeps {
                    true => slots.kept(i - plan.kept().start),
                    false => slots.take()?,
                };
                rising.settle_through(ex, 1 + i, h.remaining, &apply, m)?;
                let w = load(slot, &h.remaining[1 + i], m)?;
                let (y, sv) = block_forward(cfg, ex, i, &w, &x, rows)?;
                stats.extend(sv.router_stats(cfg, tokens.as_deref()));
                if keeps {
                    kept.push((w, sv));
                } else {
                    slots.release(slot);
                    if plan.checkpoints(i) {
                        checkpoints.push(x);
                    }
                }
                x = y;
            }
            m.forward_ms += ms(t_fwd);
            let aux = RouterAux::new(cfg, &stats, aux_weight, tokens.as_deref());
            m.routing = routing_digest(m.routing, &stats);

            // 2. Loss and its backward.
            let t_loss = Instant::now();
            rising.settle_through(ex, n_blocks + 1, h.remaining, &apply, m)?;
            if !rising.is_empty() {
                return Err(TrainError::Internal(
                    "a carried update outlived the forward".into(),
                ));
            }
            let head_w = load(HEAD_SLOT, &h.remaining[n_blocks + 1], m)?;
            let tied = cfg.tie_word_embeddings.then(|| Tied::new(&emb_w[0], frozen == 0));
            let head = head_forward_backward(
                cfg,
                ex,
                &head_w,
                tied,
                &x,
                &batch.targets,
                grad_scale,
                config.loss_terms(),
                config.chunk_rows,
            )?;
            drop((x, head_w));
            let HeadOut {
                losses,
                z_losses,
                uniform_losses,
                mut dx,
                grads,
                tied_grad,
                ..
            } = head;
            h.push(grads, m)?;
            m.loss_ms += ms(t_loss);
            // The rows no token looked up: their AdamW needs no gradient,
            // and the device has the forward and the head to run meanwhile.
            if let Some(r) = &step_rows {
                ex.flush();
                let t = Instant::now();
                r.update_untouched(&mut h.remaining[0], &emb_hyper)?;
                m.optimizer_ms += ms(t);
            }

            // 3. Backward, last block first: the kept blocks on the weights
            // and activations their forward left, then the rest K at a
            // time, each group uploaded again and its forward recomputed
            // from its checkpoint. A group's K blocks sit in distinct
            // slots; each is released once its backward is issued.
            let t_bwd = Instant::now();
            for (i, (w, sv)) in plan.kept().zip(kept).rev() {
                let (d, grads) = block_backward(cfg, ex, i, &w, &sv, &dx, aux.as_ref())?;
                drop((w, sv));
                dx = d;
                h.push(grads, m)?;
            }
            for (s, e) in plan.groups().rev().map(|g| (g.start, g.end)) {
                let ws = (s..e)
                    .map(|i| {
                        let slot = slots.take()?;
                        Ok((slot, load(slot, &h.remaining[1 + i], m)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut x = checkpoints.pop().expect("one checkpoint per block group");
                let mut saved = Vec::with_capacity(e - s);
                for (i, (_, w)) in (s..e).zip(&ws) {
                    let (y, sv) = block_forward(cfg, ex, i, w, &x, rows)?;
                    saved.push(sv);
                    x = y;
                }
                drop(x);
                for (i, ((slot, w), sv)) in (s..e).zip(ws.iter().zip(saved)).rev() {
                    let (d, grads) = block_backward(cfg, ex, i, w, &sv, &dx, aux.as_ref())?;
                    slots.release(*slot);
                    drop(sv);
                    dx = d;
                    h.push(grads, m)?;
                }
            }
            // A frozen embedding's gradient (a tied head's too) goes
            // nowhere.
            let mut looked_up = None;
            if frozen == 0 {
                let grads = embedding_grads(&emb_cfg, ex, &emb_shapes, ids, (b, t, rows), &dx, tied_grad)?;
                match step_rows {
                    Some(_) => looked_up = Some(grads),
                    None => h.push(grads, m)?,
                }
            }
            drop((dx, emb_w));
            h.flush(m)?;
            // The looked-up rows' gradients, after the other layers'.
            if let (Some(r), Some(g)) = (&step_rows, looked_up) {
                let t = Instant::now();
                let g = match &g[..] {
                    [g] => ex.download(g)?,
                    _ => {
                        return Err(TrainError::Internal(
                            "the embedding's rows: not one gradient".into(),
                        ));
                    }
                };
                m.download_ms += ms(t);
                m.bytes_downloaded += 4 * g.numel() as u64;
                let t = Instant::now();
                r.update_touched(&mut h.remaining[0], g.as_f32()?, &emb_hyper)?;
                let busy = ms(t);
                m.optimizer_ms += busy;
                m.optimizer_wait_ms += busy;
            }
            let sums = LossSums {
                cross_entropy: sum_losses(ex, &losses)?,
                aux: aux.map_or(0.0, |a| a.loss),
                z: sum_losses(ex, &z_losses)?,
                uniform: sum_losses(ex, &uniform_losses)?,
            };
            m.backward_ms += ms(t_bwd);

            // 4. The optimizer's tail.
            let host_copies = h.host_copies;
            *carried = std::mem::take(&mut h.carried);
            drop(h);
            let t_wait = Instant::now();
            let rep = opt
                .join()
                .map_err(|_| TrainError::Internal("optimizer worker panicked".into()))??;
            // Where gradients were host copies, the executor's tensors share
            // this RAM and peak in the next forward and head (the embedding
            // and head, the vocabulary's size): free the staging buffers
            // until then. A device keeps them, and its transfers stay
            // allocation-free.
            if host_copies {
                pool.release();
            }
            // One reading for both: two would make the tail longer than
            // the wait it is part of.
            let waited = ms(t_wait);
            m.optimizer_wait_ms += waited;
            m.optimizer_tail_ms += waited;
            m.optimizer_ms += rep.busy_ms;
            m.comm_ms += rep.comm_ms;
            m.comm_bytes += rep.comm_bytes;
            m.comm_wait_ms += rep.waited_after(t_wait);
            Ok(sums)
        });

        // The last writes behind: the host waits for them (the next step
        // reads these files). The deferred updates' window wrote behind
        // the forward, and has had the backward's time.
        for w in [ahead, window].into_iter().flatten() {
            if loss.is_err() {
                break;
            }
            let t = Instant::now();
            spill_window::record(m, &w.finish()?);
            let waited = ms(t);
            m.optimizer_wait_ms += waited;
            m.optimizer_tail_ms += waited;
        }
        loss
    }
}
