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

/// Downloaded f32 values read where the device left them (a mapped
/// readback buffer), from [`crate::Executor::finish_download_in_place`].
/// The buffer goes back to its executor when this is dropped. Reading the
/// values in place saves the host a copy into a buffer of its own: 4 bytes
/// read and 4 written per element, on the host memory the optimizer also
/// runs on.
pub struct Landed(Box<dyn LandedF32>);

/// What an executor hands over in a [`Landed`].
pub trait LandedF32: Send {
    fn as_f32(&self) -> &[f32];
}

impl Landed {
    pub fn new(inner: impl LandedF32 + 'static) -> Self {
        Landed(Box::new(inner))
    }
}

impl std::ops::Deref for Landed {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.0.as_f32()
    }
}

impl std::fmt::Debug for Landed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Landed({} f32)", self.len())
    }
}

/// Host memory an executor reads by itself, from
/// [`crate::Executor::register_host`]: uploads from it are copies the
/// device makes (direct memory access), with no host copy into staging
/// memory first. Dropping it ends the registration and waits until the
/// executor no longer reads the memory; keep it beside the memory and drop
/// it first.
pub struct HostRegistration {
    /// Held only to be dropped.
    _guard: Box<dyn std::any::Any + Send + Sync>,
}

impl HostRegistration {
    /// Wraps whatever ends the executor's registration when dropped.
    pub fn new(guard: impl std::any::Any + Send + Sync) -> Self {
        HostRegistration {
            _guard: Box::new(guard),
        }
    }
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostRegistration")
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

/// Where the time of an executor's transfers went, summed since it was
/// created (callers diff two snapshots). Kept by the transports with a few
/// clock reads per transfer. "Bus" time is the host copying bytes or
/// waiting on a copy whose predecessors on the queue had finished; time
/// waiting on compute queued before a copy is counted apart, so that a
/// step's bus rate is not diluted by the kernels it overlaps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransportStats {
    pub uploads: u64,
    pub bytes_up: u64,
    /// The CPU writing layers into mapped staging or slot memory.
    pub up_fill_ns: u64,
    /// Unmapping, encoding and submitting the copies, requesting remaps.
    pub up_submit_ns: u64,
    /// Waiting for a ring entry (or slot) while the device still ran work
    /// queued before its last copy (compute, not the bus).
    pub up_wait_compute_ns: u64,
    /// Waiting for a ring entry's own copy and remap (the bus).
    pub up_wait_copy_ns: u64,
    pub downloads: u64,
    pub bytes_down: u64,
    /// Encoding and submitting the copies into readback buffers.
    pub down_submit_ns: u64,
    /// Waiting for work queued before a download's copy (compute).
    pub down_wait_compute_ns: u64,
    /// Waiting for the copy itself and the mapping (the bus).
    pub down_wait_copy_ns: u64,
    /// The CPU reading (and widening) mapped readback memory.
    pub down_read_ns: u64,
    /// Downloads handed over where they landed
    /// ([`crate::Executor::finish_download_in_place`]): no host read here,
    /// the optimizer reads the mapped bytes itself.
    pub downloads_in_place: u64,
    /// Host-visible buffers created (staging entries, readback buffers):
    /// constant once warm.
    pub buffers_created: u64,
    /// Bytes of [`TransportStats::bytes_up`] the device copied from
    /// registered host memory itself ([`crate::Executor::register_host`]):
    /// the CPU wrote none of them.
    pub bytes_up_direct: u64,
}

impl TransportStats {
    fn ms(ns: u64) -> f64 {
        ns as f64 / 1e6
    }

    /// Milliseconds the host spent moving upload bytes (fill, submit, copy waits).
    pub fn up_bus_ms(&self) -> f64 {
        Self::ms(self.up_fill_ns + self.up_submit_ns + self.up_wait_copy_ns)
    }

    /// Milliseconds the host spent moving download bytes (submit, copy waits, read).
    pub fn down_bus_ms(&self) -> f64 {
        Self::ms(self.down_submit_ns + self.down_wait_copy_ns + self.down_read_ns)
    }

    /// Milliseconds spent waiting on compute inside transfer calls.
    pub fn wait_compute_ms(&self) -> f64 {
        Self::ms(self.up_wait_compute_ns + self.down_wait_compute_ns)
    }

    /// `self − earlier`, field by field (saturating).
    pub fn since(&self, earlier: &TransportStats) -> TransportStats {
        self.zip(earlier, u64::saturating_sub)
    }

    /// `self + other`, field by field.
    pub fn plus(&self, other: &TransportStats) -> TransportStats {
        self.zip(other, u64::saturating_add)
    }

    fn zip(&self, o: &TransportStats, f: fn(u64, u64) -> u64) -> TransportStats {
        macro_rules! each {
            ($($field:ident),*) => {
                TransportStats { $($field: f(self.$field, o.$field)),* }
            };
        }
        each!(
            uploads,
            bytes_up,
            up_fill_ns,
            up_submit_ns,
            up_wait_compute_ns,
            up_wait_copy_ns,
            downloads,
            bytes_down,
            down_submit_ns,
            down_wait_compute_ns,
            down_wait_copy_ns,
            down_read_ns,
            downloads_in_place,
            buffers_created,
            bytes_up_direct
        )
    }
}
