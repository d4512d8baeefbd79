//! Moving one layer between the tier and the executor.
//!
//! Streamed layers go into fixed weight slots ([`Slots`]) so that an
//! executor with device memory reuses one residence per slot instead of
//! allocating per upload; gradients come back through a download that is
//! finished one layer later (`Handoff` in `handoff.rs`).

use std::collections::VecDeque;

use megatrain_tensor::{
    DType, Executor, HostSlice, ParamTable, TensorHandle, WeightSlot, WeightUpload, upload_weight,
};
use megatrain_tier::{LayerSlab, TransportRef};

use super::TrainError;

/// The embedding's slot: loaded once per micro-batch, it stays needed until
/// the embedding backward (a tied head reads it too).
pub(super) const EMBEDDING_SLOT: WeightSlot = WeightSlot { kind: 0, index: 0 };
/// The head's slot: its backward runs right after its forward.
pub(super) const HEAD_SLOT: WeightSlot = WeightSlot { kind: 2, index: 0 };
const BLOCK_KIND: usize = 1;

/// Block slots: K + 1 of them, each load taking the slot released longest
/// ago. A block's slot is released once the last op reading its weights
/// has been issued (its forward, or in backward its backward).
///
/// In the forward this is a ring indexed by the count of loads: consecutive
/// blocks alternate slots (double buffering). A backward group holds K
/// distinct slots; the next group's first load takes the one slot the group
/// did not hold, and its later loads take the group's slots in the order
/// their backwards were issued, never the slot of the backward issued last.
/// A transport that writes a slot in place (and so waits until the device
/// is done reading it) then waits for an earlier backward while the last
/// one still runs, instead of draining the device once per group, as a
/// plain ring would (its second load would reuse the first-loaded block's
/// slot, whose backward is the group's last).
#[derive(Debug)]
pub(super) struct Slots {
    free: VecDeque<usize>,
    /// K + 1: the slots taken in turn.
    turns: usize,
}

impl Slots {
    pub fn new(checkpoint_every: usize) -> Self {
        Slots {
            free: (0..=checkpoint_every).collect(),
            turns: checkpoint_every + 1,
        }
    }

    /// The slot for the next block load.
    pub fn take(&mut self) -> Result<WeightSlot, TrainError> {
        let index = self
            .free
            .pop_front()
            .ok_or_else(|| TrainError::Internal("every block slot is in use".into()))?;
        Ok(WeightSlot {
            kind: BLOCK_KIND,
            index,
        })
    }

    /// The slot of the `j`-th kept block (`recompute.rs`): its own, past
    /// the K + 1 the others take turns in, since its weights stay from its
    /// forward to its backward.
    pub fn kept(&self, j: usize) -> WeightSlot {
        WeightSlot {
            kind: BLOCK_KIND,
            index: self.turns + j,
        }
    }

    /// Hands `slot` back once the last op reading its weights was issued.
    pub fn release(&mut self, slot: WeightSlot) {
        debug_assert!(slot.kind == BLOCK_KIND && !self.free.contains(&slot.index));
        self.free.push_back(slot.index);
    }
}

/// A layer's transport copy as uploads, one per table entry, borrowing the
/// slab. With bf16 or f16 transport, matrices (matmul operands and
/// embedding tables, the only operands executors read in 16 bits:
/// [`ParamSpec::narrow`](megatrain_tensor::ParamSpec::narrow)) stay 16-bit;
/// the rest (norm gains, biases, convolution kernels) travel as 16-bit and
/// are held as f32, widened by the executor.
pub fn weight_uploads(slab: &LayerSlab) -> Vec<WeightUpload<'_>> {
    uploads_of(slab.table(), slab.transport())
}

/// [`weight_uploads`] of a transport copy held outside a tier (matrices
/// stay 16-bit, vectors are widened to f32 on load).
pub fn uploads_of<'a>(table: &'a ParamTable, transport: TransportRef<'a>) -> Vec<WeightUpload<'a>> {
    table
        .iter()
        .map(|p| {
            let r = p.range();
            let (data, dtype) = match transport {
                TransportRef::F32(all) => (HostSlice::F32(&all[r]), DType::F32),
                TransportRef::BF16(all) if p.narrow => (HostSlice::BF16(&all[r]), DType::BF16),
                TransportRef::BF16(all) => (HostSlice::BF16(&all[r]), DType::F32),
                TransportRef::F16(all) if p.narrow => (HostSlice::F16(&all[r]), DType::F16),
                TransportRef::F16(all) => (HostSlice::F16(&all[r]), DType::F32),
            };
            WeightUpload {
                shape: &p.shape,
                data,
                dtype,
            }
        })
        .collect()
}

/// Bytes a layer occupies on the executor once loaded (widened vectors
/// count 4 bytes an element).
pub fn held_bytes(uploads: &[WeightUpload<'_>]) -> u64 {
    uploads.iter().map(WeightUpload::held_bytes).sum()
}

/// Loads a layer's transport copy into `slot`. Returns the tensors (table
/// order) and the bytes held.
pub fn load_layer<E: Executor>(
    ex: &E,
    slot: WeightSlot,
    slab: &LayerSlab,
) -> Result<(Vec<E::Tensor>, u64), TrainError> {
    let uploads = weight_uploads(slab);
    let w = ex.load_weights(slot, &uploads)?;
    Ok((w, held_bytes(&uploads)))
}

/// Uploads a layer into fresh executor tensors of its own, outside the slot
/// scheme: for holding a whole model at once ([`super::Trainer::resident_weights`]).
/// Same dtypes as [`load_layer`]; vectors of a bf16 copy are widened here.
pub fn upload_layer<E: Executor>(ex: &E, slab: &LayerSlab) -> Result<(Vec<E::Tensor>, u64), TrainError> {
    let uploads = weight_uploads(slab);
    let out = uploads
        .iter()
        .map(|u| upload_weight(ex, u))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((out, held_bytes(&uploads)))
}

/// Checks that `grads` match the slab's table (count and elements);
/// returns their f32 byte count.
pub(super) fn check_grads<T: TensorHandle>(slab: &LayerSlab, grads: &[T]) -> Result<u64, TrainError> {
    let table = slab.table();
    let numel: usize = grads.iter().map(|g| g.numel()).sum();
    if grads.len() != table.len() || numel != table.numel() {
        return Err(TrainError::Internal(format!(
            "layer {}: {} gradients of {numel} elements for a table of {} tensors, {} elements",
            slab.index(),
            grads.len(),
            table.len(),
            table.numel()
        )));
    }
    Ok(4 * table.numel() as u64)
}

#[cfg(test)]
mod tests {
    use megatrain_tier::{HostTier, TierConfig, TransportDType};
    use megatrain_zoo::gpt2_nano;

    use super::*;

    /// Plays the step's block loads for `n` blocks and K = `k`: the
    /// forward (take, run, release), then each backward group, last first
    /// (take K, recompute, then backward and release in reverse). Checks
    /// that no load takes a slot still held and returns, for each backward
    /// load after a group's first, how many backwards were issued after the
    /// one that released its slot (0: the most recent).
    fn play(n: usize, k: usize) -> Vec<usize> {
        let mut slots = Slots::new(k);
        let mut held = std::collections::HashSet::new();
        let take = |slots: &mut Slots, held: &mut std::collections::HashSet<usize>| {
            let s = slots.take().unwrap();
            assert!(held.insert(s.index), "n {n} k {k}: slot {} taken twice", s.index);
            s
        };
        let mut previous = None;
        for _ in 0..n {
            let s = take(&mut slots, &mut held);
            assert_ne!(Some(s.index), previous, "forward must alternate slots");
            previous = Some(s.index);
            slots.release(s);
            held.remove(&s.index);
        }
        // Slot index -> backward count when it was released.
        let mut released_at = std::collections::HashMap::new();
        let mut backwards = 0usize;
        let mut ages = Vec::new();
        for g in (0..n.div_ceil(k)).rev() {
            let group: Vec<WeightSlot> = (g * k..((g + 1) * k).min(n))
                .map(|_| take(&mut slots, &mut held))
                .collect();
            for (j, s) in group.iter().enumerate() {
                if j > 0
                    && let Some(&at) = released_at.get(&s.index)
                {
                    ages.push(backwards - at);
                }
            }
            for s in group.into_iter().rev() {
                backwards += 1;
                released_at.insert(s.index, backwards);
                slots.release(s);
                held.remove(&s.index);
            }
        }
        ages
    }

    #[test]
    fn block_loads_never_take_a_held_slot_nor_the_last_backwards() {
        for n in 1..10 {
            for k in 1..5 {
                let ages = play(n, k);
                assert!(ages.iter().all(|&a| a >= 1), "n {n} k {k}: {ages:?}");
            }
        }
        // K = 2, 4 blocks: the second group's second load reuses the slot of
        // the first group's first backward, one backward before the last.
        assert_eq!(play(4, 2), [1]);
    }

    #[test]
    fn sixteen_bit_uploads_keep_matrices_packed_and_widen_vectors() {
        let model = gpt2_nano(65);
        for (transport, dtype) in [
            (TransportDType::BF16, DType::BF16),
            (TransportDType::F16, DType::F16),
        ] {
            let config = TierConfig {
                transport,
                ..TierConfig::default()
            };
            let tier = HostTier::new(model.layer_tables(), config).unwrap();
            let block = &tier.layers()[1];
            let ups = weight_uploads(block);
            assert_eq!(ups.len(), block.table().len());
            for (u, p) in ups.iter().zip(block.table().iter()) {
                assert_eq!(u.data.dtype(), dtype, "{}", p.name);
                let want = if p.narrow { dtype } else { DType::F32 };
                assert_eq!(u.dtype, want, "{}", p.name);
                u.validate("test").unwrap();
            }
            assert!(
                ups.iter().any(|u| u.dtype == DType::F32),
                "gpt2 blocks have vectors"
            );
            let expect: u64 = block
                .table()
                .iter()
                .map(|p| (if p.narrow { 2 } else { 4 }) * p.numel() as u64)
                .sum();
            assert_eq!(held_bytes(&ups), expect);
        }
    }
}
