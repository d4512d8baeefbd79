//! Moving one layer between the tier and the executor.
//!
//! Streamed layers go into fixed weight slots ([`Slots`]) so that an
//! executor with device memory reuses one residence per slot instead of
//! allocating per upload; gradients come back through a download that is
//! finished one layer later ([`Pending`]).

use megatrain_tensor::{DType, Download, Executor, HostSlice, TensorHandle, WeightSlot, WeightUpload};
use megatrain_tier::{LayerSlab, TransportRef};

use super::TrainError;

/// The embedding's slot: loaded once per micro-batch, it stays needed until
/// the embedding backward (a tied head reads it too).
pub(super) const EMBEDDING_SLOT: WeightSlot = WeightSlot { kind: 0, index: 0 };
/// The head's slot: its backward runs right after its forward.
pub(super) const HEAD_SLOT: WeightSlot = WeightSlot { kind: 2, index: 0 };
const BLOCK_KIND: usize = 1;

/// Block slots: a ring of K + 1 indexed by a running count of block loads.
/// A backward group loads K consecutive blocks, which land in distinct
/// slots, and the next load goes to the one slot the group does not hold;
/// in the forward, consecutive blocks alternate slots (double buffering),
/// so a load never overwrites the weights the executor is computing with.
#[derive(Debug)]
pub(super) struct Slots {
    ring: usize,
    loads: usize,
}

impl Slots {
    pub fn new(checkpoint_every: usize) -> Self {
        Slots {
            ring: checkpoint_every + 1,
            loads: 0,
        }
    }

    /// The slot for the next block load.
    pub fn next_block(&mut self) -> WeightSlot {
        let index = self.loads % self.ring;
        self.loads += 1;
        WeightSlot {
            kind: BLOCK_KIND,
            index,
        }
    }
}

/// A layer's transport copy as uploads, one per table entry, borrowing the
/// slab. With bf16 transport, matrices (matmul operands and embedding
/// tables, the only operands executors read as bf16) stay bf16; vectors
/// (norm gains, biases) travel as bf16 and are held as f32, widened by the
/// executor.
pub fn weight_uploads(slab: &LayerSlab) -> Vec<WeightUpload<'_>> {
    slab.table()
        .iter()
        .map(|p| {
            let r = p.range();
            let (data, dtype) = match slab.transport() {
                TransportRef::F32(all) => (HostSlice::F32(&all[r]), DType::F32),
                TransportRef::BF16(all) if p.shape.rank() >= 2 => (HostSlice::BF16(&all[r]), DType::BF16),
                TransportRef::BF16(all) => (HostSlice::BF16(&all[r]), DType::F32),
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
    let mut out = Vec::with_capacity(uploads.len());
    for u in &uploads {
        let t = if u.dtype == u.data.dtype() {
            ex.upload_slice(u.shape, u.data)?
        } else {
            let mut wide = vec![0.0f32; u.data.len()];
            u.data.widen_into(&mut wide);
            ex.upload_slice(u.shape, HostSlice::F32(&wide))?
        };
        out.push(t);
    }
    Ok((out, held_bytes(&uploads)))
}

/// A layer's gradient download in flight, with the slab it belongs to.
pub(super) struct Pending<S, T> {
    pub slab: S,
    pub download: Download<T>,
}

/// Starts bringing a layer's gradients (table order) back; returns the
/// download and its f32 byte count.
pub fn begin_grads<E: Executor>(
    ex: &E,
    slab: &LayerSlab,
    grads: Vec<E::Tensor>,
) -> Result<(Download<E::Tensor>, u64), TrainError> {
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
    // The table's offsets are consecutive, so the download's concatenation
    // in table order is the slab layout.
    Ok((ex.begin_download(grads)?, 4 * table.numel() as u64))
}

#[cfg(test)]
mod tests {
    use megatrain_tier::{HostTier, TierConfig, TransportDType};
    use megatrain_zoo::gpt2_nano;

    use super::*;

    /// (block, slot index) of each load.
    type Loads = Vec<(usize, usize)>;

    /// The step's block loads for `n` blocks: the forward's, then each
    /// backward group's (last group first).
    fn step_loads(n: usize, k: usize) -> (Loads, Vec<Loads>) {
        let mut slots = Slots::new(k);
        let forward = (0..n).map(|i| (i, slots.next_block().index)).collect();
        let groups = (0..n.div_ceil(k))
            .rev()
            .map(|g| {
                (g * k..((g + 1) * k).min(n))
                    .map(|i| (i, slots.next_block().index))
                    .collect()
            })
            .collect();
        (forward, groups)
    }

    #[test]
    fn a_backward_group_holds_distinct_slots_and_the_next_load_spares_it() {
        for n in 1..9 {
            for k in 1..5 {
                let (forward, groups) = step_loads(n, k);
                assert!(forward.iter().all(|&(_, s)| s <= k));
                // Double buffering: a forward load never replaces the block
                // just run.
                for w in forward.windows(2) {
                    assert_ne!(w[0].1, w[1].1, "n {n} k {k}");
                }
                for (gi, g) in groups.iter().enumerate() {
                    let mut used: Vec<usize> = g.iter().map(|&(_, s)| s).collect();
                    used.sort_unstable();
                    used.dedup();
                    assert_eq!(used.len(), g.len(), "n {n} k {k}: group {g:?}");
                    // The next group's first load, issued while this
                    // group's last backward (its first block) may still run.
                    if let Some(next) = groups.get(gi + 1) {
                        assert_ne!(next[0].1, g[0].1, "n {n} k {k}");
                    }
                }
                // The first group's loads spare the last forward block's slot.
                if let (Some(g), Some(&(_, last))) = (groups.first(), forward.last()) {
                    assert_ne!(g[0].1, last, "n {n} k {k}");
                }
            }
        }
    }

    #[test]
    fn bf16_uploads_keep_matrices_packed_and_widen_vectors() {
        let model = gpt2_nano(65);
        let config = TierConfig {
            transport: TransportDType::BF16,
            ..TierConfig::default()
        };
        let tier = HostTier::new(model.layer_tables(), config).unwrap();
        let block = &tier.layers()[1];
        let ups = weight_uploads(block);
        assert_eq!(ups.len(), block.table().len());
        for (u, p) in ups.iter().zip(block.table().iter()) {
            assert_eq!(u.data.dtype(), DType::BF16, "{}", p.name);
            let want = if p.shape.rank() >= 2 {
                DType::BF16
            } else {
                DType::F32
            };
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
            .map(|p| (if p.shape.rank() >= 2 { 2 } else { 4 }) * p.numel() as u64)
            .sum();
        assert_eq!(held_bytes(&ups), expect);
    }
}
