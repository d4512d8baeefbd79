//! Types of the weight/gradient transport between host and executor.
//!
//! The trainer moves one layer at a time: its weights go into a reusable
//! device residence (a [`WeightSlot`]) and its gradients come back through a
//! download that is started as soon as they exist and finished later, so the
//! executor can go on computing while the bytes travel. Executors without
//! device memory use the provided methods of [`crate::Executor`], for which
//! both are plain copies.

use crate::{DType, Error, HostSlice, Result, Shape};

/// A reusable device residence for one layer's weights. Loading a layer into
/// a slot replaces what the slot held: tensors returned by an earlier load
/// into the same slot then read the new weights. The caller chooses slots
/// so that a slot is never reloaded while its old weights are still needed.
///
/// `kind` separates layers whose tables differ (the trainer uses one kind
/// for the embedding, one for blocks, one for the head); `index` numbers the
/// slots of a kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightSlot {
    pub kind: usize,
    pub index: usize,
}

/// One tensor of a layer, as host data and the dtype the executor should
/// hold it in: equal to the data's dtype, or f32 for bf16/f16 data that is
/// widened on the way (norm gains and biases of a bf16 transport copy).
#[derive(Debug, Clone, Copy)]
pub struct WeightUpload<'a> {
    pub shape: &'a Shape,
    pub data: HostSlice<'a>,
    pub dtype: DType,
}

impl WeightUpload<'_> {
    /// Checks the element count and the dtype pair.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        if self.data.len() != self.shape.numel() {
            return Err(Error::shape(
                op,
                format!(
                    "shape {} holds {} elements, data has {}",
                    self.shape,
                    self.shape.numel(),
                    self.data.len()
                ),
            ));
        }
        if self.dtype != self.data.dtype() && self.dtype != DType::F32 {
            return Err(Error::DType {
                op,
                expected: self.data.dtype(),
                got: self.dtype,
            });
        }
        Ok(())
    }

    /// Bytes the tensor occupies in its held dtype.
    pub fn held_bytes(&self) -> u64 {
        (self.shape.numel() * self.dtype.size_in_bytes()) as u64
    }
}

/// A gradient download in flight: started by
/// [`crate::Executor::begin_download`], completed by
/// [`crate::Executor::finish_download`].
#[derive(Debug)]
pub enum Download<T> {
    /// The tensors themselves, copied out at `finish` (executors whose
    /// tensors already live in host memory).
    Tensors(Vec<T>),
    /// An executor-side ticket for bytes already on their way.
    Ticket { id: u64, numel: usize },
    /// Elements of the concatenation of tensors the caller still holds,
    /// read at [`crate::Executor::finish_download_range`] (executors whose
    /// tensors already live in host memory).
    Range(std::ops::Range<usize>),
}

impl<T> Download<T> {
    /// Whether bytes are travelling (a device copy in flight). The other
    /// kinds are host copies made at finish: deferring them overlaps
    /// nothing and only keeps the tensors alive longer.
    pub fn in_flight(&self) -> bool {
        matches!(self, Download::Ticket { .. })
    }
}

/// How an executor moves layers, and why it chose that way.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportInfo {
    /// The implementation in use (e.g. `staging`, `mapped`, `host`).
    pub name: String,
    /// What decided it: a measurement, a user override, a missing feature.
    pub reason: String,
    /// Milliseconds per layer (upload, one read on the device, gradient
    /// download) measured for each candidate.
    pub measured_ms: Vec<(String, f64)>,
}
