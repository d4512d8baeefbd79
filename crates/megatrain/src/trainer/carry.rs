//! Updates carried into the next step ([`super::TrainerConfig::carry_layers`]).
//!
//! Backward hands the layers over last first, so the embedding and the
//! first blocks, whose gradients come last, are the ones whose AdamW runs
//! after backward while the device idles, and the first ones the next
//! forward needs. A carried layer's gradients stay where the executor made
//! them; the next step's forward brings them down and updates the layer
//! just before it loads it, so the host's AdamW of layer i runs while the
//! device computes the forward of the layers queued since the last carried
//! one, and the bus carries them down while it otherwise carries weights
//! only up. Where a block's AdamW takes longer than its forward, carrying
//! the first layers makes the forward wait for each update; blocks spread
//! over the model ([`super::CarryOrder::Spread`]) with uncarried ones
//! between them are updated while the device runs those. AdamW is elementwise
//! and each layer is updated with its own step's learning rate, so results
//! are those of the step that made the gradients, bit for bit.
//!
//! Clipping ([`super::TrainerConfig::defer_clipped_updates`]) carries every
//! layer's update the same way ([`Deferred`]), from the gradients the tier
//! holds: its updates wait for the norm of all of them, so without this the
//! host's whole AdamW follows the backward with the device idle.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use megatrain_adamw::{AdamW, DecayMask};
use megatrain_tensor::{Download, Executor};
use megatrain_tier::{LayerSlab, SpillWindow};

use super::distributed::{finish_clipped, update_clipped};
use super::handoff::land_chunk;
use super::optimizer::{StagingPool, apply_chunk};
use super::reduce::DistState;
use super::update::Hyper;
use super::{Result, StepMetrics, TrainError, Trainer, ms, spill_window};

/// One layer whose update waits for the next step.
pub(super) struct Carried<T> {
    /// The layer's index in the tier.
    pub index: usize,
    /// Its gradients, where the executor made them (table order), summed
    /// there over the step's micro-batches.
    pub grads: Vec<T>,
    /// The learning rate of the step that made them.
    pub lr: f32,
    /// What the update scales them by: clipping's coefficient, else 1.
    pub coef: f32,
    /// Until the step has its norm: Σ g² of each row of each gradient
    /// ([`Executor::row_dots`]), on the executor.
    pub squares: Option<T>,
}

/// The clipped updates the last step left to the next: every layer from
/// `next` on, in table order, from its held gradient scaled by `coef`, at
/// the learning rate `lr` of the step that made them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deferred {
    pub coef: f32,
    pub lr: f32,
    pub next: usize,
}

impl Deferred {
    /// Applies the deferred updates of every layer up to table index
    /// `through` (all of `slabs` are the tier's layers, in order), taking
    /// them out of `d` once the last is applied. The ops called before are
    /// set running first, so the device computes while the host updates.
    /// Time goes where [`Rising::settle_through`] puts it.
    fn apply_through<E: Executor>(
        d: &mut Option<Deferred>,
        ex: &E,
        through: usize,
        slabs: &mut [LayerSlab],
        a: &Apply<'_>,
        m: &mut StepMetrics,
    ) -> Result<()> {
        let Some(mut left) = d.take_if(|l| l.next <= through) else {
            return Ok(());
        };
        let t = Instant::now();
        ex.flush();
        let end = through.saturating_add(1).min(slabs.len());
        let mut gathers = Vec::new();
        for slab in &mut slabs[left.next..end] {
            let h = a.hyper(slab.index(), left.lr, left.coef);
            let t_opt = Instant::now();
            let done = update_clipped(slab, a.dist, a.window, h);
            let busy = ms(t_opt);
            m.optimizer_ms += busy;
            m.optimizer_wait_ms += busy;
            gathers.extend(done?);
            left.next += 1;
        }
        finish_clipped(gathers, a.dist, m)?;
        if left.next < slabs.len() {
            *d = Some(left);
        }
        m.carried_ms += ms(t);
        Ok(())
    }
}

/// Carried layers coming down in chunks, in table order: at most `limit`
/// chunks in flight at once, across layers, so that the next layer's first
/// chunks are on their way while the forward runs on the layer before.
pub(super) struct Rising<T> {
    /// Clipping's from held gradients (the layers after the carried ones:
    /// each layer is one or the other).
    deferred: Option<Deferred>,
    layers: VecDeque<Layer<T>>,
    in_flight: VecDeque<(usize, Range<usize>, Download<T>)>,
    chunk: usize,
    limit: usize,
}

struct Layer<T> {
    index: usize,
    lr: f32,
    coef: f32,
    grads: Vec<T>,
    numel: usize,
    /// First element whose download has not begun.
    next: usize,
}

/// What applying carried updates needs besides the layers.
pub(super) struct Apply<'a> {
    pub adamw: &'a AdamW,
    pub masks: &'a [DecayMask],
    pub pool: &'a StagingPool,
    /// The ranks, whose clipped updates end in an all-gather (sharded) or
    /// a meeting (shared copies) before the layer's load.
    pub dist: Option<&'a DistState>,
    /// Where the deferred updates of spilled layers read and write their
    /// p, m and v: a window over them in table order
    /// ([`super::spill_window::start_forward`]).
    pub window: Option<&'a SpillWindow>,
}

impl Apply<'_> {
    /// The update of layer `index` at learning rate `lr`, its gradient
    /// scaled by `grad_scale`.
    fn hyper(&self, index: usize, lr: f32, grad_scale: f32) -> Hyper<'_> {
        Hyper {
            adamw: self.adamw,
            mask: &self.masks[index],
            lr,
            grad_scale,
            grad_sq: None,
        }
    }
}

impl<T> Rising<T> {
    /// `carried` in any order; `chunk` elements a download, `limit` in
    /// flight at once.
    /// (`Handoff::push` checked each layer's gradients against its table
    /// when it kept them.)
    pub(super) fn new(
        mut carried: Vec<Carried<T>>,
        deferred: Option<Deferred>,
        layers: &[LayerSlab],
        chunk: usize,
        limit: usize,
    ) -> Result<Self> {
        carried.sort_by_key(|c| c.index);
        let layers = carried
            .into_iter()
            .map(|c| {
                let slab = layers.get(c.index).ok_or_else(|| {
                    TrainError::Internal(format!(
                        "a carried update for layer {} of {}",
                        c.index,
                        layers.len()
                    ))
                })?;
                Ok(Layer {
                    index: c.index,
                    lr: c.lr,
                    coef: c.coef,
                    numel: slab.numel(),
                    grads: c.grads,
                    next: 0,
                })
            })
            .collect::<Result<VecDeque<_>>>()?;
        Ok(Rising {
            deferred,
            layers,
            in_flight: VecDeque::new(),
            chunk: chunk.max(1),
            limit: limit.max(1),
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.layers.is_empty() && self.deferred.is_none()
    }

    /// Begins downloads up to the limit, the first layers' first.
    pub(super) fn begin_more<E: Executor<Tensor = T>>(&mut self, ex: &E) -> Result<()> {
        for layer in self.layers.iter_mut() {
            while layer.next < layer.numel && self.in_flight.len() < self.limit {
                let r = layer.next..(layer.next + self.chunk).min(layer.numel);
                let d = ex.begin_download_range(&layer.grads, r.clone())?;
                layer.next = r.end;
                self.in_flight.push_back((layer.index, r, d));
            }
            if self.in_flight.len() >= self.limit {
                break;
            }
        }
        Ok(())
    }

    /// Brings down and applies every carried layer up to table index
    /// `through` (first the deferred clipped updates up to it), keeping
    /// downloads of the later ones in flight. Time goes
    /// to `m.carried_ms`; the AdamW part of it to `m.optimizer_ms` and, as
    /// the thread that queues the forward is the one running it, to
    /// `m.optimizer_wait_ms` (none of it counts as hidden).
    pub(super) fn settle_through<E: Executor<Tensor = T>>(
        &mut self,
        ex: &E,
        through: usize,
        slabs: &mut [LayerSlab],
        a: &Apply<'_>,
        m: &mut StepMetrics,
    ) -> Result<()> {
        Deferred::apply_through(&mut self.deferred, ex, through, slabs, a, m)?;
        if self.layers.front().is_none_or(|l| l.index > through) {
            return Ok(());
        }
        let t = Instant::now();
        // The forward's ops queued since the last update run while the
        // host runs this one (blocks spread with uncarried ones between
        // them are updated while the device computes those).
        ex.flush();
        while self.layers.front().is_some_and(|l| l.index <= through) {
            if self.in_flight.is_empty() {
                self.begin_more(ex)?;
            }
            let (index, r, d) = self
                .in_flight
                .pop_front()
                .ok_or_else(|| TrainError::Internal("a carried layer with nothing to bring down".into()))?;
            let (lr, coef, numel, grads) = {
                let layer = self.layers.front().expect("checked above");
                if index != layer.index {
                    return Err(TrainError::Internal(format!(
                        "a chunk of carried layer {index} came before layer {}'s",
                        layer.index
                    )));
                }
                let t_down = Instant::now();
                let grads = land_chunk(ex, a.pool, d, &layer.grads, r.len());
                m.download_ms += ms(t_down);
                (layer.lr, layer.coef, layer.numel, grads?)
            };
            self.begin_more(ex)?;
            let slab = slabs
                .get_mut(index)
                .ok_or_else(|| TrainError::Internal(format!("no layer {index} to update")))?;
            let h = a.hyper(index, lr, coef);
            let t_opt = Instant::now();
            let done = apply_chunk(slab, r.clone(), &grads, true, None, h);
            let busy = ms(t_opt);
            m.optimizer_ms += busy;
            m.optimizer_wait_ms += busy;
            grads.release(a.pool);
            done?;
            if r.end == numel {
                // Its gradients go back to the executor's pool here.
                self.layers.pop_front();
            }
        }
        m.carried_ms += ms(t);
        Ok(())
    }
}

/// Layer indices in table order, for errors that name what is carried.
pub(super) fn describe<T>(carried: &[Carried<T>]) -> String {
    let mut ix: Vec<usize> = carried.iter().map(|c| c.index).collect();
    ix.sort_unstable();
    format!("{} layers ({ix:?})", ix.len())
}

impl<E: Executor> Trainer<E> {
    /// Layers whose update the last step left to the next.
    pub fn carried_layers(&self) -> usize {
        self.carried.len() + self.deferred.map_or(0, |d| self.tier.len() - d.next)
    }

    /// What is carried, for errors that name it.
    pub(super) fn describe_carried(&self) -> String {
        match self.deferred {
            // The carried layers, where there are any, are the ones before.
            Some(d) => {
                let first = d.next - self.carried.len().min(d.next);
                format!(
                    "{} layers ({first}..{}, clipped)",
                    self.carried_layers(),
                    self.tier.len()
                )
            }
            None => describe(&self.carried),
        }
    }

    /// Applies the updates the last step left to the next
    /// ([`super::TrainerConfig::carry_layers`], and clipping's,
    /// [`super::TrainerConfig::defer_clipped_updates`]): brings those layers'
    /// gradients down (or reads the held ones) and runs their AdamW, so the
    /// tier holds every layer as of the last step. A no-op when nothing is
    /// carried. Returns the time taken, in milliseconds.
    pub fn settle(&mut self) -> Result<f64> {
        if self.carried_layers() == 0 {
            return Ok(0.0);
        }
        let t = Instant::now();
        let chunk = self.transfer_chunk();
        let in_flight = self.reserve_gradient_downloads(chunk)?;
        let carried = std::mem::take(&mut self.carried);
        let deferred = self.deferred.take();
        let window = spill_window::start_deferred(&self.tier, self.dist.as_ref(), self.spill, deferred)?;
        let mut rising = Rising::new(carried, deferred, self.tier.layers(), chunk, in_flight)?;
        let apply = Apply {
            adamw: &self.adamw,
            masks: &self.masks,
            pool: &self.pool,
            dist: self.dist.as_ref(),
            window: window.as_ref(),
        };
        let mut m = StepMetrics::default();
        rising.settle_through(&self.ex, usize::MAX, self.tier.layers_mut(), &apply, &mut m)?;
        if let Some(w) = window {
            w.finish()?;
        }
        Ok(ms(t))
    }

    /// Refuses `what` while updates are carried: it would read parameters
    /// one update behind.
    pub(super) fn ensure_settled(&self, what: &str) -> Result<()> {
        match self.carried_layers() {
            0 => Ok(()),
            _ => Err(TrainError::Config(format!(
                "{what} reads the parameters, but the updates of {} are carried into the next step: call Trainer::settle first",
                self.describe_carried()
            ))),
        }
    }
}
