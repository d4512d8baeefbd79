//! Moving one layer between the tier and the executor.

use megatrain_tensor::{Executor, HostSlice, ParamTable};
use megatrain_tier::{LayerSlab, TransportRef};

use super::TrainError;

/// Uploads a layer's transport copy, one tensor per table entry. With bf16
/// transport, matrices (matmul operands and embedding tables, the only
/// operands executors read as bf16) travel packed; vectors (norm gains,
/// biases) are widened on the host — they are a negligible share of the
/// bytes and every executor reads them as f32. Returns the tensors and the
/// bytes that crossed.
pub fn upload_layer<E: Executor>(ex: &E, slab: &LayerSlab) -> Result<(Vec<E::Tensor>, u64), TrainError> {
    let mut bytes = 0u64;
    let mut out = Vec::with_capacity(slab.table().len());
    for p in slab.table().iter() {
        let r = p.range();
        let t = match slab.transport() {
            TransportRef::F32(all) => {
                bytes += 4 * p.numel() as u64;
                ex.upload_slice(&p.shape, HostSlice::F32(&all[r]))?
            }
            TransportRef::BF16(all) if p.shape.rank() >= 2 => {
                bytes += 2 * p.numel() as u64;
                ex.upload_slice(&p.shape, HostSlice::BF16(&all[r]))?
            }
            TransportRef::BF16(all) => {
                bytes += 2 * p.numel() as u64;
                let wide: Vec<f32> = all[r].iter().map(|x| x.to_f32()).collect();
                ex.upload_slice(&p.shape, HostSlice::F32(&wide))?
            }
        };
        out.push(t);
    }
    Ok((out, bytes))
}

/// Fetches a layer's gradients (table order) into `dst`, laid out by the table.
pub fn download_grads<E: Executor>(
    ex: &E,
    table: &ParamTable,
    grads: &[E::Tensor],
    dst: &mut [f32],
) -> Result<u64, TrainError> {
    if grads.len() != table.len() || dst.len() != table.numel() {
        return Err(TrainError::Internal(format!(
            "{} gradients into {} elements for a table of {} tensors, {} elements",
            grads.len(),
            dst.len(),
            table.len(),
            table.numel()
        )));
    }
    for (p, g) in table.iter().zip(grads) {
        ex.download_into(g, &mut dst[p.range()])?;
    }
    Ok(4 * table.numel() as u64)
}
