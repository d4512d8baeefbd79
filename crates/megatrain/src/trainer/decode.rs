//! The streamed forward of generation: each layer of the tier loaded into
//! the weight slots as an evaluation loads it, one sequence's next tokens
//! run through it, so a model larger than the device generates too.

use megatrain_tensor::Executor;
use megatrain_zoo::layers::{KvCache, next_logits};

use super::upload::{EMBEDDING_SLOT, HEAD_SLOT, Slots, load_layer};
use super::{Result, Trainer};

impl<E: Executor> Trainer<E> {
    /// Logits `[B, V]` after the last of each row of `ids` (`batch`
    /// sequences of one length), every layer streamed once: with `cache`,
    /// ids that follow the positions it holds (which they join); without,
    /// the whole sequences.
    pub fn streamed_logits(
        &self,
        ids: &[u32],
        batch: usize,
        cache: Option<&mut KvCache<E::Tensor>>,
    ) -> Result<Vec<f32>> {
        self.ensure_settled("generation")?;
        let (ex, cfg, layers) = (&self.ex, &self.model, self.tier.layers());
        let head = cfg.num_layers + 1;
        let mut slots = Slots::new(self.config.checkpoint_every);
        // A block's slot goes back once the next block is asked for: the
        // ops reading it have all been issued by then.
        let mut held = None;
        next_logits(cfg, ex, ids, batch, cache, |l| {
            let slot = match l {
                0 => EMBEDDING_SLOT,
                l if l == head => HEAD_SLOT,
                _ => slots.take()?,
            };
            if let Some(done) = held.take() {
                slots.release(done);
            }
            if (1..head).contains(&l) {
                held = Some(slot);
            }
            Ok(load_layer(ex, slot, &layers[l])?.0)
        })
    }
}
