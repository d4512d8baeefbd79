//! The [`Trainer`]'s data parallel side outside the per-chunk pipeline
//! (which is in `reduce.rs`): joining a communicator, the global target
//! count, a clipped layer's update on a rank, and gathering sharded state
//! for a checkpoint.

use std::time::Instant;

use megatrain_tensor::Executor;
use megatrain_tier::{AlignedBuf, Gathered, HostTier, LayerSlab, Shard, SpillWindow, TierError};

use super::reduce::{DistState, Gather};
use super::update::{Hyper, Part, update_part};
use super::{Result, StepMetrics, TrainError, Trainer, ms};
use crate::dist::DistConfig;

pub(super) fn engine_err(e: crate::dist::DistError) -> TrainError {
    TrainError::Internal(e.to_string())
}

impl<E: Executor> Trainer<E> {
    /// Trains as one rank of `dist`: from the next step on, gradients are
    /// summed across ranks chunk by chunk (and, with a sharded optimizer,
    /// this rank updates only its 1/N of every layer). Every rank must hold
    /// the same parameters and optimizer state when this is called.
    pub fn set_distributed(&mut self, dist: DistConfig) -> Result<()> {
        if dist.comm.size() == 0 || dist.comm.rank() >= dist.comm.size() {
            return Err(TrainError::Config(format!(
                "rank {} of {} ranks",
                dist.comm.rank(),
                dist.comm.size()
            )));
        }
        if self.config.carry_layers > 0 {
            return Err(TrainError::Config(format!(
                "carry_layers ({}) cannot be used with data parallel ranks, whose updates wait for each layer's reduction",
                self.config.carry_layers
            )));
        }
        // A tier placed for a sharded rank holds only that rank's share
        // of its RAM layers.
        let (rank, ranks) = (dist.comm.rank(), dist.comm.size());
        if let Some(sh) = self.tier.config().shard
            && (!dist.shard_optimizer || sh != (Shard { rank, ranks }))
        {
            return Err(TrainError::Config(format!(
                "the host tier was placed for rank {} of {} with a sharded optimizer, \
                 but this trainer is rank {rank} of {ranks} with the optimizer {}",
                sh.rank,
                sh.ranks,
                if dist.shard_optimizer {
                    "sharded"
                } else {
                    "replicated"
                }
            )));
        }
        let shares = self.tier.config().shared_transport.is_some();
        if let Some(m) = &dist.shared {
            if !shares {
                return Err(TrainError::Config(
                    "ranks share transport copies only over a tier that maps them \
                     (TierConfig::shared_transport)"
                        .into(),
                ));
            }
            // Every rank of the machine has written its ranges of the copies
            // (loading wrote them): the first upload sees the whole copy.
            m.node.barrier().map_err(engine_err)?;
        } else if shares {
            return Err(TrainError::Config(
                "the tier maps transport copies shared by a machine's ranks, but the trainer \
                 was not told which ranks (DistConfig::shared)"
                    .into(),
            ));
        }
        self.dist = Some(DistState::new(dist, self.tier.layers()));
        self.release_unowned()
    }

    /// Where a machine's ranks share their transport copies: waits until
    /// every one of them has written its ranges of this step's update, so
    /// that the next upload (on any of them) reads the whole update.
    /// Clipped updates deferred into the next forward meet there, layer by
    /// layer, instead ([`finish_clipped`]).
    pub(super) fn settle_shared_copies(&self, m: &mut StepMetrics) -> Result<()> {
        let Some(machines) = self.dist.as_ref().and_then(|d| d.config.shared.as_ref()) else {
            return Ok(());
        };
        if self.deferred.is_some() {
            return Ok(());
        }
        let t = Instant::now();
        machines.node.barrier().map_err(engine_err)?;
        m.comm_ms += ms(t);
        m.comm_wait_ms += ms(t);
        Ok(())
    }

    /// With a sharded optimizer, hands the pages of p, m and v outside this
    /// rank's ranges back to the kernel: what makes host memory per rank
    /// 12/N bytes per parameter plus the transport copy. A spilled layer's
    /// pages all go (its shard is read through the spill window, and what
    /// was written through its maps stays in the file). Call after
    /// [`Trainer::gather_state`] has made them resident on rank 0.
    pub fn release_unowned(&mut self) -> Result<()> {
        let Some(d) = &self.dist else { return Ok(()) };
        if d.config.shard_optimizer {
            for slab in self.tier.layers_mut() {
                match slab.is_spilled() {
                    true => slab.evict()?,
                    false => slab.release_outside(d.own(slab.index()))?,
                }
            }
        }
        Ok(())
    }

    pub fn distributed(&self) -> Option<&DistConfig> {
        self.dist.as_ref().map(|d| &d.config)
    }

    /// Targets counted by every rank together (the loss's denominator).
    pub(super) fn global_counted(&self, local: usize) -> Result<usize> {
        match &self.dist {
            None => Ok(local),
            Some(d) => {
                // f64 sums of integers below 2^53 are exact.
                let mut x = [local as f64];
                d.comm().sum_f64(&mut x).map_err(engine_err)?;
                Ok(x[0] as usize)
            }
        }
    }

    /// With a sharded optimizer, brings every rank's range of p, m and v to
    /// rank 0, so rank 0's tier holds the whole state (to compare ranks'
    /// results; a checkpoint gathers one layer at a time instead, see
    /// [`Trainer::save_on_rank0`]). Rank 0's spill files then hold whole
    /// layers. Other ranks' tiers are unchanged. Otherwise no gather.
    /// Parameters outside a rank's ranges are stale (or released) on every
    /// other rank: only the transport copies are whole everywhere. Updates
    /// carried into the next step are applied first ([`Trainer::settle`]).
    pub fn gather_state(&mut self) -> Result<()> {
        self.settle()?;
        let Some(d) = &self.dist else { return Ok(()) };
        if !d.config.shard_optimizer {
            return Ok(());
        }
        let root = d.config.comm.rank() == 0;
        for slab in self.tier.layers_mut() {
            if root {
                slab.reserve_all()?;
            }
            gather_layer(d, slab)?;
            // A spilled layer's pages go back at once (what rank 0 received
            // is in the page cache, and its spill file, for the save).
            slab.evict()?;
        }
        Ok(())
    }

    /// A checkpoint written by rank 0 through `save`, which gets the tier
    /// and a hook to call on each layer, in order, just before writing it
    /// ([`megatrain_tier::save_checkpoint_gathered`]): with a sharded
    /// optimizer the hook brings the layer's p, m and v whole to rank 0,
    /// into the slab, or for a spilled layer (whose files hold rank 0's
    /// range only) into RAM buffers it returns; so rank 0 holds one layer
    /// whole at a time, not the model, and writes nothing outside its range
    /// of its spill files. The other ranks take part in the same gathers
    /// and return `None`. Rank 0 makes every gather the others make even
    /// when `save` writes nothing (the checkpoint exists already) or stops
    /// early. Updates carried into the next step are applied first
    /// ([`Trainer::settle`]).
    pub fn save_on_rank0<R, Err: From<TrainError>>(
        &mut self,
        save: impl FnOnce(
            &mut HostTier,
            &mut dyn FnMut(&mut LayerSlab) -> megatrain_tier::Result<Option<Gathered>>,
        ) -> std::result::Result<R, Err>,
    ) -> std::result::Result<Option<R>, Err> {
        self.settle()?;
        let rank = self.dist.as_ref().map_or(0, |d| d.config.comm.rank());
        let sharded = self.dist.as_ref().is_some_and(|d| d.config.shard_optimizer);
        if rank != 0 {
            self.gather_state()?;
            return Ok(None);
        }
        let Trainer { tier, dist, .. } = self;
        let Some(d) = dist.as_ref().filter(|_| sharded) else {
            return save(tier, &mut |_| Ok(None)).map(Some);
        };
        let mut next = 0;
        let saved = save(tier, &mut |slab| {
            let layer = slab.index();
            if layer != next {
                return Err(TierError::Gather {
                    layer,
                    detail: format!("asked for out of order (layer {next} is next)"),
                });
            }
            next += 1;
            gather_for_save(d, slab).map_err(|e| TierError::Gather {
                layer,
                detail: e.to_string(),
            })
        });
        for slab in &mut tier.layers_mut()[next..] {
            gather_for_save(d, slab)?;
            slab.settle().map_err(TrainError::from)?;
        }
        saved.map(Some)
    }
}

/// Rank 0's gather of one layer for a checkpoint: into the slab, or where
/// its spill files hold rank 0's range only, into RAM buffers (rank 0's
/// range copied from the slab, the others' received).
fn gather_for_save(d: &DistState, slab: &mut LayerSlab) -> Result<Option<Gathered>> {
    let n = slab.numel();
    if slab.reserved() == (0..n) {
        gather_layer(d, slab)?;
        return Ok(None);
    }
    let own = slab.own();
    let ranges = &d.ranges[slab.index()];
    let whole = || AlignedBuf::<f32>::zeroed(n).map_err(TrainError::from);
    let mut g = Gathered {
        params: whole()?,
        m: whole()?,
        v: whole()?,
    };
    for (dst, src) in [
        (&mut g.params, slab.params()),
        (&mut g.m, slab.m()),
        (&mut g.v, slab.v()),
    ] {
        dst[own.clone()].copy_from_slice(&src[own.clone()]);
        d.comm().gather_f32_to_root(dst, ranges).map_err(engine_err)?;
    }
    Ok(Some(g))
}

/// Rank 0's side of bringing every rank's range of a layer's p, m and v to
/// it, or another rank's side of sending its own.
fn gather_layer(d: &DistState, slab: &mut LayerSlab) -> Result<()> {
    let ranges = &d.ranges[slab.index()];
    let parts = slab.parts_mut();
    for buf in [parts.params, parts.m, parts.v] {
        d.comm().gather_f32_to_root(buf, ranges).map_err(engine_err)?;
    }
    Ok(())
}

/// A clipped update of one whole layer from its held gradient. With a
/// sharded optimizer it is this rank's range of it (the stale sums around
/// the range zeroed), and the all-gather of the layer's transport copy is
/// started and returned: wait on it ([`finish_clipped`]) before the copy
/// is read or written again.
pub(super) fn update_clipped(
    slab: &mut LayerSlab,
    d: Option<&DistState>,
    window: Option<&SpillWindow>,
    h: Hyper<'_>,
) -> Result<Option<Gather>> {
    let numel = slab.numel();
    let Some(d) = d.filter(|d| d.config.shard_optimizer) else {
        update_part(slab, Part::of(numel, None, 0..numel), window, h)?;
        return Ok(None);
    };
    let i = slab.index();
    let part = Part {
        grad: None,
        r: d.own(i),
        zero: 0..numel,
        ends: true,
    };
    let (base, elem) = update_part(slab, part, window, h)?;
    // SAFETY: the caller waits on the gather (or drops it, which waits)
    // before it touches the transport copy again.
    unsafe { d.gather_transport(base, elem, &d.ranges[i]) }
}

/// Waits on the all-gathers [`update_clipped`] started; then, with `meet`
/// where a machine's ranks share their transport copies, until each of
/// them has written its ranges of the updates, so that an upload on any of
/// them reads them whole (after a backward, the step's end meets instead:
/// `Trainer::settle_shared_copies`).
pub(super) fn finish_clipped(
    gathers: Vec<Gather>,
    meet: Option<&DistState>,
    m: &mut StepMetrics,
) -> Result<()> {
    let t = Instant::now();
    for (op, bytes) in gathers {
        m.comm_bytes += bytes;
        op.wait().map_err(engine_err)?;
    }
    if let Some(machines) = meet.and_then(|d| d.config.shared.as_ref()) {
        machines.node.barrier().map_err(engine_err)?;
    }
    m.comm_ms += ms(t);
    Ok(())
}
