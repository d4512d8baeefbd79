//! The step's gradient norms, and clipping's: the norm of every layer's
//! gradient (held on the host, or for the carried layers summed on the
//! executor), its coefficient, and the updates it scales, now or in the
//! next step's forward.

use std::time::Instant;

use megatrain_adamw::{clip_coefficient, grad_norms_sq};
use megatrain_tensor::{Executor, TensorHandle};
use megatrain_tier::LayerSlab;

use super::carry::{Deferred, describe};
use super::distributed::{engine_err, finish_clipped, update_clipped};
use super::update::Hyper;
use super::{Result, StepMetrics, TrainError, Trainer, ms, spill_window};

impl<E: Executor> Trainer<E> {
    /// Each layer's gradient norm and, without clipping (whose norm is
    /// the exact one it took), the step's, from the squares the updates
    /// summed: every update of the step is done by now, but for the
    /// carried layers', whose squares the executor summed (read here,
    /// once their backward is done). With the optimizer sharded each rank
    /// summed its own range; else every rank updated every element.
    /// Clipping took each layer's norm with the step's (`Trainer::clip`).
    pub(super) fn gradient_norms(&mut self, m: &mut StepMetrics) -> Result<()> {
        if self.config.grad_clip.is_some() {
            return Ok(());
        }
        let mut layers = self.grad_sq.per_layer();
        for (i, sq) in self.carried_squares()? {
            layers[i] = sq;
        }
        if let Some(d) = self.dist.as_ref().filter(|d| d.config.shard_optimizer) {
            let t = Instant::now();
            d.comm()
                .sum_f64(&mut layers)
                .map_err(|e| TrainError::Internal(e.to_string()))?;
            m.comm_ms += ms(t);
            m.comm_wait_ms += ms(t);
        }
        m.grad_norm = Some(layers.iter().sum::<f64>().sqrt());
        m.layer_grad_norms = layers.iter().map(|x| x.sqrt()).collect();
        Ok(())
    }

    /// Clipping mode, after every micro-batch: the norm of each layer's
    /// held gradient and of them all, then AdamW on every layer with the
    /// clip coefficient, here or (where the updates are deferred) in the
    /// next step's forward, layer by layer. Returns the global norm.
    pub(super) fn clip(&mut self, max_norm: f64, lr: f32, m: &mut StepMetrics) -> Result<f64> {
        // The carried layers' squares were summed where their gradients
        // are; the held ones' blocks as the last micro-batch's chunks came
        // in, the rest now (with ranks, whose held gradients are the
        // reduction's sums, all of them now).
        let carry = self.config.carry_layers;
        let carried = self.carried_squares()?;
        if carried.len() != carry || carried.iter().enumerate().any(|(i, c)| c.0 != i) {
            return Err(TrainError::Internal(format!(
                "clipping found carried layers {:?}, not the first {carry}",
                carried.iter().map(|c| c.0).collect::<Vec<_>>()
            )));
        }
        let mut sq: Vec<f64> = carried.into_iter().map(|c| c.1).collect();
        // Frozen layers (never with carried ones) have no gradient.
        sq.extend(std::iter::repeat_n(0.0, self.config.frozen_layers));
        let trained = sq.len();
        fn held(s: &LayerSlab) -> Result<&[f32]> {
            s.grads().ok_or_else(|| {
                TrainError::Internal(format!("layer {}: clipping without held gradients", s.index()))
            })
        }
        match self.dist.as_ref().filter(|d| d.config.shard_optimizer) {
            // A sharded rank holds the summed gradient of its ranges only.
            Some(d) => {
                let own = self.tier.layers()[trained..]
                    .iter()
                    .map(|s| Ok(&held(s)?[d.own(s.index())]))
                    .collect::<Result<Vec<_>>>()?;
                let mut own_sq = grad_norms_sq(&own);
                let t = Instant::now();
                d.comm().sum_f64(&mut own_sq).map_err(engine_err)?;
                m.comm_ms += ms(t);
                sq.extend(own_sq);
            }
            None => {
                for s in &self.tier.layers()[trained..] {
                    sq.push(self.held_norms.finish(s.index(), held(s)?));
                }
            }
        }
        let norm = sq.iter().sum::<f64>().sqrt();
        m.layer_grad_norms = sq.iter().map(|x| x.sqrt()).collect();
        let coef = clip_coefficient(norm, max_norm);
        for c in &mut self.carried {
            c.coef = coef;
        }
        if self.defers_clipped() {
            self.deferred = (trained < self.tier.len()).then_some(Deferred {
                coef,
                lr,
                next: trained,
            });
            return Ok(norm);
        }
        let dist = self.dist.as_ref();
        let window = spill_window::start_forward(&self.tier, dist, self.spill, trained)?;
        let mut gathers = Vec::new();
        for slab in &mut self.tier.layers_mut()[trained..] {
            let h = Hyper {
                adamw: &self.adamw,
                mask: &self.masks[slab.index()],
                lr,
                grad_scale: coef,
                grad_sq: None,
            };
            gathers.extend(update_clipped(slab, dist, window.as_ref(), h)?);
        }
        // A sharded rank's gathers, started together, are waited together.
        finish_clipped(gathers, None, m)?;
        if let Some(w) = window {
            spill_window::record(m, &w.finish()?);
        }
        Ok(norm)
    }

    /// Each carried layer's index and Σ g² (table order), from the rows'
    /// sums the executor took: one download, which waits for the
    /// backward's end (as clipping must; without clipping the next
    /// forward's first update waits for it anyway), each layer's sum then
    /// taken in f64 in row order.
    fn carried_squares(&mut self) -> Result<Vec<(usize, f64)>> {
        self.carried.sort_by_key(|c| c.index);
        if let Some(c) = self.carried.iter().find(|c| c.index >= self.tier.len()) {
            return Err(TrainError::Internal(format!(
                "carried layer {} of {}: {}",
                c.index,
                self.tier.len(),
                describe(&self.carried)
            )));
        }
        let parts = self
            .carried
            .iter_mut()
            .map(|c| {
                c.squares.take().ok_or_else(|| {
                    TrainError::Internal(format!(
                        "carried layer {}: no squares for the step's norm",
                        c.index
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = parts.iter().map(|p| p.numel()).collect();
        let all = match parts.len() {
            0 => return Ok(Vec::new()),
            1 => self.ex.download(&parts[0])?,
            _ => self
                .ex
                .download(&self.ex.concat_last(&parts.iter().collect::<Vec<_>>())?)?,
        };
        let mut rows = all.as_f32()?;
        Ok(lens
            .iter()
            .zip(&self.carried)
            .map(|(&n, c)| {
                let (layer, rest) = rows.split_at(n);
                rows = rest;
                (c.index, layer.iter().map(|&x| x as f64).sum())
            })
            .collect())
    }

    /// Whether clipped updates go into the next step's forward: as asked.
    /// A spilled layer's p, m and v then come through a window that reads
    /// ahead in the forward's order. On ranks each updates, just before
    /// its forward loads a layer, what it updates after a backward: a
    /// replicated rank all of the layer, from the same summed gradient; a
    /// sharded one its range, then the all-gather of the transport copy;
    /// ranks sharing a copy then meet before the load.
    pub(super) fn defers_clipped(&self) -> bool {
        self.config.defer_clipped_updates
    }
}
