//! The [`Trainer`]'s data parallel side outside the per-chunk pipeline
//! (which is in `reduce.rs`): joining a communicator, the global target
//! count, clipping with a sharded optimizer, gathering sharded state for
//! a checkpoint, and the update of a rank's part of a layer.

use std::ops::Range;
use std::time::Instant;

use megatrain_adamw::{AdamW, DecayMask, SlabState, SlabUpdate, Transport, clip_coefficient, grad_norm_sq};
use megatrain_tensor::Executor;
use megatrain_tier::{LayerSlab, TransportMut};

use super::optimizer::sub_mask;
use super::reduce::DistState;
use super::{Result, StepMetrics, TrainError, Trainer, ms};
use crate::dist::{DistConfig, Elem};

fn engine_err(e: crate::dist::DistError) -> TrainError {
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
        if dist.shard_optimizer && self.tier.has_spill() {
            // A rank's shard would be read and written in place through the
            // spill files' maps, racing the spill window's own I/O.
            return Err(TrainError::Config(
                "a sharded optimizer with layers spilled to disk (--host-budget) is not supported yet: \
                 raise --host-budget or train with --shard-optimizer false"
                    .into(),
            ));
        }
        let numels: Vec<usize> = self.tier.layers().iter().map(|s| s.numel()).collect();
        self.dist = Some(DistState::new(dist, &numels));
        self.release_unowned()
    }

    /// With a sharded optimizer, hands the pages of p, m and v outside this
    /// rank's ranges back to the kernel: what makes host memory per rank
    /// 12/N bytes per parameter plus the transport copy. Call after
    /// [`Trainer::gather_state`] has made them resident on rank 0.
    pub fn release_unowned(&mut self) -> Result<()> {
        let Some(d) = &self.dist else { return Ok(()) };
        if d.config.shard_optimizer {
            for slab in self.tier.layers_mut() {
                slab.release_outside(d.own(slab.index()))?;
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

    /// Clipping mode with a sharded optimizer: each rank holds the summed
    /// gradient of its ranges only, so the squared norm is summed across
    /// ranks; then each rank updates its ranges and the transport copies
    /// are all-gathered (started together, waited together).
    pub(super) fn clip_and_update_sharded(
        &mut self,
        max_norm: f64,
        lr: f32,
        m: &mut StepMetrics,
    ) -> Result<f64> {
        let d = self.dist.as_ref().expect("sharded clipping needs a communicator");
        let own: Vec<&[f32]> = self
            .tier
            .layers()
            .iter()
            .map(|s| {
                s.grads()
                    .map(|g| &g[d.own(s.index())])
                    .ok_or_else(|| TrainError::Internal(format!("layer {}: no held gradient", s.index())))
            })
            .collect::<Result<_>>()?;
        let t = Instant::now();
        let mut sq = [grad_norm_sq(&own)];
        d.comm().sum_f64(&mut sq).map_err(engine_err)?;
        m.comm_ms += ms(t);
        let norm = sq[0].sqrt();
        let coef = clip_coefficient(norm, max_norm);
        let mut ops = Vec::with_capacity(self.tier.len());
        for slab in self.tier.layers_mut() {
            let i = slab.index();
            let (own, all) = (d.own(i), 0..slab.numel());
            let (base, elem) =
                update_range(slab, None, own, all, true, &self.adamw, &self.masks[i], lr, coef)?;
            // SAFETY: the transport copies are not touched until every
            // operation in `ops` has been waited on below (or dropped, which
            // waits), before this function returns.
            let op = unsafe { d.comm().start_all_gather(base, elem, &d.ranges[i]) }.map_err(engine_err)?;
            m.comm_bytes += (elem.size() * d.own(i).len()) as u64;
            ops.push(op);
        }
        let t = Instant::now();
        for op in ops {
            op.wait().map_err(engine_err)?;
        }
        m.comm_ms += ms(t);
        Ok(norm)
    }

    /// With a sharded optimizer, brings every rank's range of p, m and v to
    /// rank 0, so rank 0's tier holds the whole state (for a checkpoint).
    /// Other ranks' tiers are unchanged. A no-op otherwise. Parameters
    /// outside a rank's ranges are stale (or released) on every other rank:
    /// only the transport copies are whole everywhere.
    pub fn gather_state(&mut self) -> Result<()> {
        let Some(d) = &self.dist else { return Ok(()) };
        if !d.config.shard_optimizer {
            return Ok(());
        }
        for slab in self.tier.layers_mut() {
            let ranges = &d.ranges[slab.index()];
            let parts = slab.parts_mut();
            for buf in [parts.params, parts.m, parts.v] {
                d.comm().gather_f32_to_root(buf, ranges).map_err(engine_err)?;
            }
        }
        Ok(())
    }
}

/// The transport copy's range `r` (of the elements `t` covers) as the
/// optimizer writes it, and `t`'s first element as the gather moves it.
fn transport_parts(t: TransportMut<'_>, r: Range<usize>) -> (Transport<'_>, *mut u8, Elem) {
    match t {
        TransportMut::F32(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::F32(&mut t[r]), p, Elem::F32)
        }
        TransportMut::BF16(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::Bf16(&mut t[r]), p, Elem::U16)
        }
        TransportMut::F16(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::F16(&mut t[r]), p, Elem::U16)
        }
    }
}

/// AdamW on elements `r` of `slab` (possibly none: this rank's shard may
/// miss a chunk) with their summed gradient (`grad`, or the held
/// gradient's when `None`); `mask` is the whole layer's. Zeroes the held
/// gradient's elements `zero` (which hold `r`) for the next step. `ends`:
/// this is the layer's last update of the step, so its step count (bias
/// correction) moves on, by one whatever the number of chunks. Touches
/// only elements `zero` (no reference to the rest of the layer, where
/// other chunks' collectives may be in flight) and returns the transport
/// copy's pointer at element `zero.start`.
#[allow(clippy::too_many_arguments)]
pub(super) fn update_range(
    slab: &mut LayerSlab,
    grad: Option<&mut [f32]>,
    r: Range<usize>,
    zero: Range<usize>,
    ends: bool,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<(*mut u8, Elem), TrainError> {
    let index = slab.index();
    if r.start < zero.start || r.end > zero.end || zero.end > slab.numel() {
        return Err(TrainError::Internal(format!(
            "layer {index}: update of {r:?} outside {zero:?} (of {})",
            slab.numel()
        )));
    }
    let sub;
    let mask = if r == (0..slab.numel()) {
        mask
    } else {
        sub = sub_mask(mask, r.clone())?;
        &sub
    };
    // `r` within the elements `zero` the slices cover.
    let rel = r.start - zero.start..r.end - zero.start;
    let base = {
        let parts = slab.parts_in(zero);
        let mut held = parts.grads;
        let (transport, base, elem) = transport_parts(parts.transport, rel.clone());
        if !r.is_empty() {
            let grad = match (grad, held.as_deref_mut()) {
                (Some(g), _) => g,
                (None, Some(h)) => &mut h[rel.clone()],
                (None, None) => {
                    return Err(TrainError::Internal(format!(
                        "layer {index}: no gradient to apply"
                    )));
                }
            };
            let update = SlabUpdate::new(
                &mut parts.params[rel.clone()],
                grad,
                &mut parts.m[rel.clone()],
                &mut parts.v[rel],
            )
            .decay(mask)
            .transport(transport)
            .grad_scale(grad_scale);
            // Every chunk of a step at the layer's step count: the count
            // moves once, below.
            adamw.step(&mut SlabState::at_step(*parts.step), lr, update)?;
        }
        if ends {
            *parts.step += 1;
        }
        if let Some(h) = held {
            h.fill(0.0);
        }
        (base, elem)
    };
    if ends {
        slab.evict()?;
    }
    Ok(base)
}
