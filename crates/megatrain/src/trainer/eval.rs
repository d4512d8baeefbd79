//! Forward-only losses: every layer streamed once per group of batches.

use megatrain_tensor::Executor;
use megatrain_zoo::layers::{block_forward, embedding_forward, head_loss};

use super::upload::{EMBEDDING_SLOT, HEAD_SLOT, Slots, load_layer};
use super::{Result, Trainer};
use crate::data::Batch;

impl<E: Executor> Trainer<E> {
    /// Forward-only loss of a batch: `(loss_sum, counted targets)`.
    pub fn eval_loss(&self, batch: &Batch) -> Result<(f64, usize)> {
        Ok(self.eval_losses(std::slice::from_ref(batch))?[0])
    }

    /// Forward-only losses of `batches`, each `(loss_sum, counted targets)`
    /// exactly as [`Trainer::eval_loss`] gives it: the same ops on each
    /// batch, but every layer streamed once per group of batches instead of
    /// once per batch, so an evaluation of N batches moves the model over
    /// the bus N / group times, not N times. A group holds as many
    /// activations (`[B, T, C]` per batch) as a training step holds
    /// checkpoints (one per K blocks), so with evaluation batches of the
    /// training batch's shape evaluating peaks no higher than training.
    pub fn eval_losses(&self, batches: &[Batch]) -> Result<Vec<(f64, usize)>> {
        let group = self.model.num_layers.div_ceil(self.config.checkpoint_every);
        self.eval_losses_in_groups(batches, group)
    }

    /// [`Trainer::eval_losses`] with groups of `group` batches (at least one).
    pub fn eval_losses_in_groups(&self, batches: &[Batch], group: usize) -> Result<Vec<(f64, usize)>> {
        self.ensure_settled("an evaluation")?;
        let mut out = Vec::with_capacity(batches.len());
        for now in batches.chunks(group.max(1)) {
            out.extend(self.eval_group(now)?);
        }
        Ok(out)
    }

    fn eval_group(&self, batches: &[Batch]) -> Result<Vec<(f64, usize)>> {
        let (ex, cfg, layers) = (&self.ex, &self.model, self.tier.layers());
        let n = cfg.num_layers;
        let mut slots = Slots::new(self.config.checkpoint_every);
        let (emb_w, _) = load_layer(ex, EMBEDDING_SLOT, &layers[0])?;
        let mut xs = batches
            .iter()
            .map(|b| embedding_forward(cfg, ex, &emb_w, &b.inputs, b.batch, b.seq_len, b.docs.as_ref()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (i, slab) in layers[1..=n].iter().enumerate() {
            let slot = slots.take()?;
            let (w, _) = load_layer(ex, slot, slab)?;
            for (x, b) in xs.iter_mut().zip(batches) {
                *x = block_forward(cfg, ex, i, &w, x, b.docs.as_ref())?.0;
            }
            slots.release(slot);
        }
        let (head_w, _) = load_layer(ex, HEAD_SLOT, &layers[n + 1])?;
        let tied = cfg.tie_word_embeddings.then(|| &emb_w[0]);
        let mut out = Vec::with_capacity(batches.len());
        for (b, x) in batches.iter().zip(&xs) {
            out.push(head_loss(
                cfg,
                ex,
                &head_w,
                tied,
                x,
                &b.targets,
                self.config.chunk_rows,
            )?);
        }
        Ok(out)
    }
}
