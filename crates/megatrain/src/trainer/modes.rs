//! Isolated parts of the streamed step, for the overlap measurement of
//! `cargo xtask bench-throughput`: each does only one of the three things a
//! step overlaps, the same amount of it as [`Trainer::step`] does, so
//! `step time ÷ max(compute, transfer, optimizer)` says how close the step
//! comes to the bound set by its slowest part.
//!
//! - [`Trainer::compute_only`]: forward, loss, block recompute (of the
//!   blocks the step does not keep) and backward with every weight already
//!   resident ([`Trainer::resident_weights`]); gradients are made on the
//!   executor and dropped, nothing is uploaded, downloaded or updated.
//! - [`Trainer::transfer_only`]: the step's uploads (embedding, head and
//!   kept blocks once, each other trained block twice) and a download of
//!   every trained layer's gradient bytes, with no compute.
//! - [`Trainer::optimizer_only`]: AdamW over every trained layer's slab
//!   with a gradient buffer, on the calling thread.
//!
//! With `frozen_layers`, each does what the step does: the backward ends
//! at the first trained layer, and frozen layers are neither uploaded
//! again, downloaded nor updated.

use std::time::Instant;

use megatrain_tensor::{Executor, Shape, TensorHandle};
use megatrain_tier::LayerSlab;
use megatrain_zoo::layers::{
    RouterAux, Tied, block_backward, block_forward, embedding_backward, embedding_forward,
    head_forward_backward, sum_losses,
};

use super::update::{Hyper, Part, update_part};
use super::upload::{EMBEDDING_SLOT, HEAD_SLOT, Slots, check_grads, load_layer, upload_layer};
use super::{Falling, Recompute, Result, TrainError, Trainer, layer_chunks, ms};
use crate::data::Batch;

/// Every layer's weights on the executor, uploaded once (table order).
pub struct ResidentWeights<E: Executor> {
    layers: Vec<Vec<E::Tensor>>,
}

impl<E: Executor> ResidentWeights<E> {
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ComputeOnly {
    pub ms: f64,
    /// The micro-batch's loss sum (as the step computes it).
    pub loss_sum: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferOnly {
    pub ms: f64,
    pub bytes_uploaded: u64,
    pub bytes_downloaded: u64,
}

/// Finishes every chunk of `p` in order: where it landed when the executor
/// can (as the step hands chunks to the optimizer, so no host copy is
/// timed here that the step does not make), else into `staging` (one chunk
/// long); returns the bytes that came down.
fn drain<E: Executor>(ex: &E, mut p: Falling<E::Tensor>, chunk: usize, staging: &mut [f32]) -> Result<u64> {
    let mut bytes = 0;
    while let Some((r, d)) = p.in_flight.pop_front() {
        if let Err(d) = ex.finish_download_in_place(d)? {
            ex.finish_download_range(d, &p.grads, &mut staging[..r.len()])?;
        }
        bytes += 4 * r.len() as u64;
        p.begin_more(ex, chunk)?;
    }
    Ok(bytes)
}

/// A few elements of `t` fetched to the host: waits for every op queued
/// before it on an asynchronous executor, at a negligible transfer.
fn fence<E: Executor>(ex: &E, t: &E::Tensor) -> Result<()> {
    let last = *t.dims().last().unwrap_or(&1);
    let flat = ex.reshape(t, &Shape::new(vec![t.numel() / last.max(1), last]))?;
    let row = ex.slice_rows(&flat, 0, 1)?;
    let mut out = vec![0.0f32; row.numel()];
    ex.download_into(&row, &mut out)?;
    Ok(())
}

impl<E: Executor> Trainer<E> {
    /// Uploads every layer's transport copy once, for [`Trainer::compute_only`].
    /// Holds the whole model on the executor.
    pub fn resident_weights(&self) -> Result<ResidentWeights<E>> {
        self.ensure_settled("the compute-only mode")?;
        let layers = self
            .tier
            .layers()
            .iter()
            .map(|s| upload_layer(&self.ex, s).map(|(w, _)| w))
            .collect::<Result<Vec<_>>>()?;
        Ok(ResidentWeights { layers })
    }

    /// Forward, loss, recompute and backward of one micro-batch with the
    /// step's checkpointing, kept activations and frozen layers, on
    /// resident weights; gradients stay on the executor and are dropped.
    /// The time ends when the executor has finished the backward (the
    /// embedding's, or the first trained block's).
    pub fn compute_only(&self, w: &ResidentWeights<E>, batch: &Batch) -> Result<ComputeOnly> {
        let (ex, cfg, config) = (&self.ex, &self.model, &self.config);
        let n_blocks = cfg.num_layers;
        if w.len() != n_blocks + 2 {
            return Err(TrainError::Config(format!(
                "{} resident layers for a model of {} layers",
                w.len(),
                n_blocks + 2
            )));
        }
        let counted = batch.counted();
        let grad_scale = if counted > 0 { 1.0 / counted as f32 } else { 0.0 };
        let (b, t) = (batch.batch, batch.seq_len);
        let frozen = config.frozen_layers;
        let plan = Recompute::trained_from(
            n_blocks,
            config.checkpoint_every,
            config.keep_activations,
            frozen.saturating_sub(1),
        );
        let start = Instant::now();
        let emb_w = &w.layers[0];
        // The next step's first micro-batch's rows: its dropout too.
        let rows = self.rows(batch, 0)?;
        let mut x = embedding_forward(cfg, ex, emb_w, &batch.inputs, b, t, rows)?;
        let mut checkpoints = Vec::with_capacity(plan.checkpoint_count());
        let mut kept = Vec::with_capacity(plan.kept().len());
        let mut stats = Vec::new();
        let tokens = batch.tokens_mask();
        for i in 0..n_blocks {
            let (y, sv) = block_forward(cfg, ex, i, &w.layers[1 + i], &x, rows)?;
            stats.extend(sv.router_stats(cfg, tokens.as_deref()));
            if plan.keeps(i) {
                kept.push(sv);
            } else if plan.checkpoints(i) {
                checkpoints.push(x);
            }
            x = y;
        }
        let tied = cfg.tie_word_embeddings.then(|| Tied::new(&emb_w[0], frozen == 0));
        let head = head_forward_backward(
            cfg,
            ex,
            &w.layers[n_blocks + 1],
            tied,
            &x,
            &batch.targets,
            grad_scale,
            config.loss_terms(),
            config.chunk_rows,
        )?;
        drop(x);
        let aux = RouterAux::new(cfg, &stats, 1.0, tokens.as_deref());
        let mut dx = head.dx;
        for (i, sv) in plan.kept().zip(kept).rev() {
            dx = block_backward(cfg, ex, i, &w.layers[1 + i], &sv, &dx, aux.as_ref())?.0;
        }
        for (s, e) in plan.groups().rev().map(|g| (g.start, g.end)) {
            let mut h = checkpoints.pop().expect("one checkpoint per block group");
            let mut saved = Vec::with_capacity(e - s);
            for i in s..e {
                let (y, sv) = block_forward(cfg, ex, i, &w.layers[1 + i], &h, rows)?;
                saved.push(sv);
                h = y;
            }
            drop(h);
            for (i, sv) in (s..e).zip(saved).rev() {
                let (d, _grads) = block_backward(cfg, ex, i, &w.layers[1 + i], &sv, &dx, aux.as_ref())?;
                dx = d;
            }
        }
        match frozen {
            0 => {
                let grads =
                    embedding_backward(cfg, ex, emb_w, &batch.inputs, (b, t, rows), &dx, head.tied_grad)?;
                fence(ex, &grads[0])?;
            }
            // The step's backward ends at the first trained block's.
            _ => fence(ex, &dx)?,
        }
        // At the end, as the step reads it.
        let loss_sum = sum_losses(ex, &head.losses)?;
        Ok(ComputeOnly {
            ms: ms(start),
            loss_sum,
        })
    }

    /// The step's bus traffic without its compute: every transport copy up
    /// into the step's slots and in its order (blocks twice, the backward's
    /// a group of K at a time; embedding, head and kept blocks once) and
    /// every layer's fp32 gradient bytes down, pipelined one layer deep like the step's
    /// and in the step's chunks (`transfer_chunk`, `chunks_in_flight` of
    /// a layer at a time), so its host staging is one chunk, not a layer.
    /// Gradients come from executor buffers of the layer's shapes allocated
    /// before the clock starts; each download takes a reshaped handle of
    /// them (a view on the GPU, a copy on the CPU, which has no bus). Where
    /// a step of `tokens` tokens takes only the embedding rows its ids look
    /// up ([`super::TrainerConfig::compact_embedding`]), the embedding moves
    /// as such a step's table does (as many rows as it has tokens), else
    /// whole.
    pub fn transfer_only(&self, tokens: usize) -> Result<TransferOnly> {
        let ex = &self.ex;
        let layers = self.tier.layers();
        let n = layers.len();
        if n < 2 {
            return Err(TrainError::Config(format!(
                "a model needs at least 2 layers, has {n}"
            )));
        }
        let n_blocks = n - 2;
        let k = self.config.checkpoint_every;
        let frozen = self.config.frozen_layers;
        let plan = Recompute::trained_from(
            n_blocks,
            k,
            self.config.keep_activations,
            frozen.saturating_sub(1),
        );
        // One set of gradient-shaped buffers per layer kind: embedding,
        // block (all blocks share shapes) and head.
        let zeros = |slab: &LayerSlab| -> Result<Vec<E::Tensor>> {
            slab.table()
                .iter()
                .map(|p| ex.zeros(&p.shape).map_err(TrainError::from))
                .collect()
        };
        let rows = self.looked_up_rows(tokens);
        let emb_g = match &rows {
            Some(r) => {
                let c = layers[0].numel() / self.model.vocab_size.max(1);
                vec![ex.zeros(&Shape::from(&[r.rows, c][..]))?]
            }
            None => zeros(&layers[0])?,
        };
        let block_g = if n_blocks > 0 {
            zeros(&layers[1])?
        } else {
            Vec::new()
        };
        let head_g = zeros(&layers[n - 1])?;
        let chunk = self.transfer_chunk();
        let (largest, in_flight) = layer_chunks(layers, self.config.chunks_in_flight, chunk);
        let mut staging = vec![0.0f32; largest.min(chunk)];
        let mut out = TransferOnly {
            ms: 0.0,
            bytes_uploaded: 0,
            bytes_downloaded: 0,
        };
        let mut slots = Slots::new(k);
        let mut pending: Option<Falling<E::Tensor>> = None;
        let start = Instant::now();
        let up = |slot, slab: &LayerSlab, out: &mut TransferOnly| -> Result<Vec<E::Tensor>> {
            let (w, bytes) = load_layer(ex, slot, slab)?;
            out.bytes_uploaded += bytes;
            Ok(w)
        };
        let mut down = |layer: usize, g: &[E::Tensor], out: &mut TransferOnly| -> Result<()> {
            let alias = g
                .iter()
                .map(|t| ex.reshape(t, t.shape()))
                .collect::<megatrain_tensor::Result<Vec<_>>>()?;
            let numel = match (layer, &rows) {
                (0, Some(_)) => alias.iter().map(TensorHandle::numel).sum(),
                _ => {
                    check_grads(&layers[layer], &alias)?;
                    layers[layer].numel()
                }
            };
            let mut p = Falling::new(numel, alias, in_flight);
            p.begin_more(ex, chunk)?;
            if let Some(prev) = pending.replace(p) {
                out.bytes_downloaded += drain(ex, prev, chunk, &mut staging)?;
            }
            Ok(())
        };
        // Forward: every layer once (the head's upload is its only one, and
        // so is a kept block's).
        match &rows {
            Some(r) => {
                let (w, bytes) = r.upload(ex, &layers[0])?;
                out.bytes_uploaded += bytes;
                drop(w);
            }
            None => drop(up(EMBEDDING_SLOT, &layers[0], &mut out)?),
        }
        let mut kept = Vec::with_capacity(plan.kept().len());
        for (i, slab) in layers[1..n - 1].iter().enumerate() {
            if plan.keeps(i) {
                kept.push(up(slots.kept(i - plan.kept().start), slab, &mut out)?);
                continue;
            }
            let slot = slots.take()?;
            drop(up(slot, slab, &mut out)?);
            slots.release(slot);
        }
        drop(up(HEAD_SLOT, &layers[n - 1], &mut out)?);
        down(n - 1, &head_g, &mut out)?;
        // Backward, last first: each trained block's gradients down, the
        // kept blocks' on the weights of the forward, the rest uploaded
        // again a group of K at a time; then the embedding's, unless frozen.
        for (i, w) in plan.kept().zip(kept).rev() {
            down(1 + i, &block_g, &mut out)?;
            drop(w);
        }
        for (s, e) in plan.groups().rev().map(|g| (g.start, g.end)) {
            let ws = (s..e)
                .map(|i| {
                    let slot = slots.take()?;
                    Ok((slot, up(slot, &layers[1 + i], &mut out)?))
                })
                .collect::<Result<Vec<_>>>()?;
            for (i, (slot, _)) in (s..e).zip(&ws).rev() {
                down(1 + i, &block_g, &mut out)?;
                slots.release(*slot);
            }
            drop(ws);
        }
        if frozen == 0 {
            down(0, &emb_g, &mut out)?;
        }
        if let Some(prev) = pending.take() {
            out.bytes_downloaded += drain(ex, prev, chunk, &mut staging)?;
        }
        out.ms = ms(start);
        Ok(out)
    }

    /// AdamW over every trained layer's slab (p, m, v and the transport
    /// copy) with a constant gradient, on the calling thread, at learning
    /// rate `lr`. It changes the parameters like a real step.
    pub fn optimizer_only(&mut self, lr: f64) -> Result<f64> {
        self.settle()?;
        let max = self.tier.layers().iter().map(LayerSlab::numel).max().unwrap_or(0);
        let grad = vec![1e-4f32; max];
        let frozen = self.config.frozen_layers;
        let start = Instant::now();
        for slab in self.tier.layers_mut().iter_mut().skip(frozen) {
            let len = slab.numel();
            let h = Hyper {
                adamw: &self.adamw,
                mask: &self.masks[slab.index()],
                lr: lr as f32,
                grad_scale: 1.0,
                grad_sq: None,
            };
            update_part(slab, Part::of(len, Some(&grad[..len]), 0..len), None, h)?;
        }
        Ok(ms(start))
    }
}

#[cfg(test)]
mod tests {
    use megatrain_adamw::AdamWConfig;
    use megatrain_tensor::CpuExecutor;
    use megatrain_tier::{TierConfig, TransportDType};
    use megatrain_zoo::{ModelConfig, gpt2_nano, preset};

    use super::*;
    use crate::data::{Sampling, TokenData, draw_batch};
    use crate::trainer::{TrainerConfig, init_tier};

    fn batch(vocab: u32, b: usize, t: usize) -> Batch {
        let data = TokenData {
            tokens: (0..3000u32).map(|i| (i * 7919 + i / 3) % vocab).collect(),
            loss_mask: None,
            records: None,
        };
        draw_batch(&data, Sampling::Random { seed: 3 }, 0, b, t, "mem".as_ref()).unwrap()
    }

    fn trainer(model: &ModelConfig, k: usize, transport: TransportDType) -> Trainer<CpuExecutor> {
        trainer_keeping(model, k, (0, 0), transport)
    }

    /// K, the last `keep` blocks keeping their activations, the first
    /// `frozen` layers not trained.
    fn trainer_keeping(
        model: &ModelConfig,
        k: usize,
        (keep, frozen): (usize, usize),
        transport: TransportDType,
    ) -> Trainer<CpuExecutor> {
        let tier = init_tier(
            model,
            TierConfig {
                transport,
                ..TierConfig::default()
            },
            7,
        )
        .unwrap();
        let config = TrainerConfig {
            checkpoint_every: k,
            keep_activations: keep,
            frozen_layers: frozen,
            chunk_rows: 5,
            adamw: AdamWConfig::default(),
            ..TrainerConfig::default()
        };
        Trainer::new(CpuExecutor::default(), model.clone(), tier, config).unwrap()
    }

    fn models() -> Vec<ModelConfig> {
        let mut llama = preset("llama-tiny", None).unwrap();
        llama.num_layers = 3;
        vec![llama, gpt2_nano(23)]
    }

    #[test]
    fn compute_only_gives_the_step_loss_and_leaves_the_tier_alone() {
        for model in models() {
            // Frozen: none, the embedding (a tied head's matrix with it),
            // the embedding and the first block.
            for (k, frozen) in [(1, 0), (2, 0), (1, 1), (2, 2)] {
                let b = batch(model.vocab_size as u32, 2, 9);
                let mut tr = trainer_keeping(&model, k, (0, frozen), TransportDType::F32);
                let w = tr.resident_weights().unwrap();
                let before: Vec<f32> = tr.tier().layers()[1].params().to_vec();
                let c = tr.compute_only(&w, &b).unwrap();
                assert_eq!(tr.tier().layers()[1].params(), &before[..]);
                let (eval, counted) = tr.eval_loss(&b).unwrap();
                assert!(
                    (c.loss_sum - eval).abs() < 1e-4 * eval.abs(),
                    "{} vs {eval}",
                    c.loss_sum
                );
                let step = tr.step(std::slice::from_ref(&b), 1e-3).unwrap();
                assert!((step.loss - c.loss_sum / counted as f64).abs() < 1e-5);
                assert!(c.ms > 0.0);
            }
        }
    }

    #[test]
    fn transfer_only_moves_the_bytes_of_a_step() {
        for model in models() {
            for transport in [TransportDType::F32, TransportDType::BF16, TransportDType::F16] {
                // None kept, one kept beside a group, all kept: a kept
                // block's weights cross once. Frozen layers' gradients do
                // not come down, and frozen blocks cross once.
                for (keep, frozen) in [(0, 0), (1, 0), (model.num_layers, 0), (0, 2), (1, 1)] {
                    let what = format!("{transport:?}, {keep} kept, {frozen} frozen");
                    let b = batch(model.vocab_size as u32, 2, 9);
                    let mut tr = trainer_keeping(&model, 2, (keep, frozen), transport);
                    let t = tr.transfer_only(b.inputs.len()).unwrap();
                    let step = tr.step(std::slice::from_ref(&b), 1e-3).unwrap();
                    assert_eq!(t.bytes_uploaded, step.bytes_uploaded, "{what}");
                    assert_eq!(t.bytes_downloaded, step.bytes_downloaded, "{what}");
                    let layers = tr.tier().layers();
                    let mut trained: usize = layers[frozen..].iter().map(LayerSlab::numel).sum();
                    // An untied one-table embedding comes down as a table
                    // of the step's 18 rows (`embedding_rows.rs`).
                    if frozen == 0 && !model.tie_word_embeddings && layers[0].table().len() == 1 {
                        trained = trained - layers[0].numel() + 18 * model.hidden_size;
                    }
                    assert_eq!(t.bytes_downloaded, 4 * trained as u64, "{what}");
                }
            }
        }
    }

    #[test]
    fn optimizer_only_leaves_frozen_layers() {
        let model = &models()[0];
        let mut tr = trainer_keeping(model, 1, (0, 2), TransportDType::BF16);
        let before: Vec<Vec<f32>> = tr.tier().layers().iter().map(|s| s.params().to_vec()).collect();
        tr.optimizer_only(1e-2).unwrap();
        for (slab, old) in tr.tier().layers().iter().zip(&before) {
            let moved = slab.params() != &old[..];
            assert_eq!(moved, slab.index() >= 2, "layer {}", slab.index());
        }
    }

    #[test]
    fn optimizer_only_updates_every_layer_once() {
        let model = &models()[0];
        let mut tr = trainer(model, 1, TransportDType::BF16);
        let before: Vec<Vec<f32>> = tr.tier().layers().iter().map(|s| s.params().to_vec()).collect();
        let t = tr.optimizer_only(1e-2).unwrap();
        assert!(t > 0.0);
        for (slab, old) in tr.tier().layers().iter().zip(&before) {
            // A positive gradient moves every weight down (Adam's first step is ±lr).
            assert!(
                slab.params().iter().zip(old).all(|(p, o)| p < o),
                "layer {}",
                slab.index()
            );
            let wide: Vec<f32> = match slab.transport() {
                megatrain_tier::TransportRef::BF16(t) => t.iter().map(|x| x.to_f32()).collect(),
                megatrain_tier::TransportRef::F16(t) => t.iter().map(|x| x.to_f32()).collect(),
                megatrain_tier::TransportRef::F32(t) => t.to_vec(),
            };
            let close = slab
                .params()
                .iter()
                .zip(&wide)
                .all(|(p, w)| (p - w).abs() <= 1e-2 * p.abs() + 1e-6);
            assert!(close, "transport copy of layer {} not refreshed", slab.index());
        }
    }
}
