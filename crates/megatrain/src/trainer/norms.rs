//! The step's gradient norms, and clipping's: the norm of every layer's
//! gradient (held on the host, or for the carried layers summed on the
//! executor), its coefficient, and the updates it scales, now or in the
//! next step's forward.

use std::time::Instant;

use megatrain_adamw::clip_coefficient;
use megatrain_tensor::{Executor, TensorHandle};

use super::carry::{Deferred, describe};
use super::update::{Hyper, Part, update_part};
use super::{Result, StepMetrics, TrainError, Trainer, ms, spill_window};

impl<E: Executor> Trainer<E> {
    /// Each layer's gradient norm and, without clipping (whose norm is
    /// the exact one it took), the step's, from the squares the updates
    /// summed: every update of the step is done by now, but for the
    /// carried layers', whose squares the executor summed (read here,
    /// once their backward is done). With the optimizer sharded each rank
    /// summed its own range; else every rank updated every element.
    /// Clipping over a whole held gradient took each layer's norm with the
    /// step's (`Trainer::clip`).
    pub(super) fn gradient_norms(&mut self, m: &mut StepMetrics) -> Result<()> {
        let sharded = self.dist.as_ref().is_some_and(|d| d.config.shard_optimizer);
        if self.config.grad_clip.is_some() && !sharded {
            return Ok(());
        }
        let mut layers = self.grad_sq.per_layer();
        let carried = self.carried_squares()?;
        layers[..carried.len()].copy_from_slice(&carried);
        // A sharded clipping step's updates applied coef · g.
        if let (Some(max_norm), Some(norm)) = (self.config.grad_clip, m.grad_norm) {
            let coef = clip_coefficient(norm, max_norm) as f64;
            layers.iter_mut().for_each(|x| *x /= coef * coef);
        }
        if let Some(d) = self.dist.as_ref().filter(|d| d.config.shard_optimizer) {
            let t = Instant::now();
            d.comm()
                .sum_f64(&mut layers)
                .map_err(|e| TrainError::Internal(e.to_string()))?;
            m.comm_ms += ms(t);
            m.comm_wait_ms += ms(t);
        }
        if self.config.grad_clip.is_none() {
            m.grad_norm = Some(layers.iter().sum::<f64>().sqrt());
        }
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
        let mut sq = self.carried_squares()?;
        if sq.len() != carry {
            return Err(TrainError::Internal(format!(
                "clipping found {} of the {carry} carried layers",
                sq.len()
            )));
        }
        // Frozen layers (never with carried ones) have no gradient.
        sq.extend(std::iter::repeat_n(0.0, self.config.frozen_layers));
        let trained = sq.len();
        for s in &self.tier.layers()[trained..] {
            let g = s.grads().ok_or_else(|| {
                TrainError::Internal(format!("layer {}: clipping without held gradients", s.index()))
            })?;
            sq.push(self.held_norms.finish(s.index(), g));
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
        let window = spill_window::start_forward(&self.tier, self.dist.as_ref(), self.spill, trained)?;
        for slab in &mut self.tier.layers_mut()[trained..] {
            let h = Hyper {
                adamw: &self.adamw,
                mask: &self.masks[slab.index()],
                lr,
                grad_scale: coef,
                grad_sq: None,
            };
            let all = Part::of(slab.numel(), None, 0..slab.numel());
            update_part(slab, all, window.as_ref(), h)?;
        }
        if let Some(w) = window {
            spill_window::record(m, &w.finish()?);
        }
        Ok(norm)
    }

    /// Σ g² of each carried layer (table order: they are the first
    /// layers), from the rows' sums the executor took: one download, which
    /// waits for the backward's end (as clipping must; without clipping
    /// the next forward's first update waits for it anyway), each layer's
    /// sum then taken in f64 in row order.
    fn carried_squares(&mut self) -> Result<Vec<f64>> {
        self.carried.sort_by_key(|c| c.index);
        if self.carried.iter().enumerate().any(|(i, c)| c.index != i) {
            return Err(TrainError::Internal(format!(
                "the carried layers are {}, not the first {}",
                describe(&self.carried),
                self.carried.len()
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
            .map(|&n| {
                let (layer, rest) = rows.split_at(n);
                rows = rest;
                layer.iter().map(|&x| x as f64).sum()
            })
            .collect())
    }

    /// Whether clipped updates go into the next step's forward: asked for,
    /// a tier in RAM, and one process or replicated ranks that each hold
    /// their transport copies (every rank then updates every layer from
    /// the same summed gradients, just before its own forward loads it; a
    /// sharded rank's update ends in an all-gather, and ranks sharing a
    /// copy would need to meet before each layer's load).
    pub(super) fn defers_clipped(&self) -> bool {
        let ranks_allow = self
            .dist
            .as_ref()
            .is_none_or(|d| !d.config.shard_optimizer && d.config.shared.is_none());
        self.config.defer_clipped_updates && ranks_allow && !self.tier.has_spill()
    }
}
