//! What one training step reports.

use serde::Serialize;

/// Per-step numbers for the CLI, `metrics.jsonl` and the benchmarks. Times
/// are wall-clock milliseconds on the host; with an asynchronous device a
/// phase's time includes waiting for the work queued before it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Mean loss over the step's counted targets (all micro-batches).
    pub loss: f64,
    /// Input tokens processed (all micro-batches).
    pub tokens: u64,
    /// Targets the loss counted.
    pub counted: u64,
    pub step_ms: f64,
    /// Streaming forward to the last block (checkpointed, no saved state).
    pub forward_ms: f64,
    /// Final norm, LM head and cross-entropy, forward and backward.
    pub loss_ms: f64,
    /// Block recompute and backward, embedding backward.
    pub backward_ms: f64,
    /// Time spent in upload calls (part of the phases above).
    pub upload_ms: f64,
    /// Time spent fetching gradients (part of the phases above).
    pub download_ms: f64,
    /// The part of `upload_ms + download_ms` spent moving bytes: the CPU
    /// copying into and out of mapped memory, submitting copies, waiting
    /// on a copy whose predecessors had finished (the executor's
    /// `TransportStats`; 0 where the executor keeps none).
    pub bus_ms: f64,
    /// The rest of the time in transfer calls: waiting for compute queued
    /// before a copy (a weight slot still read, gradients not yet made).
    pub transfer_wait_compute_ms: f64,
    /// The host waiting for the optimizer: queue full during backward, and
    /// the tail after backward (all of the update in clipping mode), and
    /// the forward running the AdamW of updates the last step carried.
    pub optimizer_wait_ms: f64,
    /// The part of `optimizer_wait_ms` after backward: the optimizer
    /// finishing what it had not caught up with (and the last writes
    /// behind of a spilling tier; all of the update in clipping mode). The
    /// rest is the thread that queues backward blocked on a full queue,
    /// the device idle unless earlier work was queued.
    pub optimizer_tail_ms: f64,
    /// Optimizer busy time (AdamW and gradient accumulation), carried
    /// updates' AdamW included.
    pub optimizer_ms: f64,
    /// The forward's time bringing down and applying the updates the last
    /// step carried (`TrainerConfig::carry_layers`; part of `forward_ms`):
    /// the thread that queues the forward is busy, the device computes
    /// what was queued before.
    pub carried_ms: f64,
    /// 1 − wait / busy: the share of optimizer work hidden behind the device.
    pub optimizer_hidden: f64,
    /// Bytes of weights loaded, counted as the executor holds them: with
    /// bf16 transport, vectors (norm gains, biases) are held as f32 and
    /// count 4 bytes an element.
    pub bytes_uploaded: u64,
    /// The part of `bytes_uploaded` the device copied from the tier itself
    /// (registered host memory): the host spent no time moving it, so it
    /// is left out of [`StepMetrics::bus_gb_s`].
    pub bytes_uploaded_direct: u64,
    pub bytes_downloaded: u64,
    /// Bytes of every layer's transport copy: `bytes_uploaded / transport_bytes`
    /// is the number of times the weights crossed the bus this step (a
    /// little over with bf16 transport, whose vectors count twice their size).
    pub transport_bytes: u64,
    /// Executor-owned memory peak during the step (0 when not accounted).
    pub device_peak_bytes: u64,
    /// Bytes read from and written to spill files (p, m, v of the layers
    /// past the host budget; 12 bytes per spilled parameter each way).
    pub spill_read_bytes: u64,
    pub spill_written_bytes: u64,
    /// Wall time with spill I/O in flight.
    pub spill_disk_ms: f64,
    /// Spill bytes (both ways) ÷ `spill_disk_ms`, GB/s.
    pub spill_gb_s: f64,
    /// The optimizer waiting on the disk: for chunks not yet read ahead,
    /// and for the last writes behind at the end of the step.
    pub spill_wait_ms: f64,
    /// The L2 norm of the step's gradient (summed over its micro-batches
    /// and ranks), before clipping: with clipping, the exact global norm
    /// the coefficient comes from; else Σ g² as the updates applied it
    /// (`megatrain_adamw::StepStats`, in f64 per chunk updated), and for
    /// layers carried into the next step (`carry_layers`) the executor's
    /// sums of their rows' squares (f32 within a row, f64 across).
    pub grad_norm: Option<f64>,
    /// With a z-loss (`TrainerConfig::z_loss`): its mean over the counted
    /// targets, z·lse², beside `loss` (which is the cross-entropy's alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub z_loss: Option<f64>,
    /// With label smoothing ε (`TrainerConfig::label_smoothing`): the mean
    /// over the counted targets of (1 − ε)·cross-entropy + ε·(the
    /// cross-entropy against the uniform target), plus any mixture of
    /// experts' balance loss as in `loss`: what PyTorch's
    /// `cross_entropy(..., label_smoothing=ε)` reports, and what the
    /// gradient is of (with `z_loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smoothed_loss: Option<f64>,
    /// Each layer's share of it (the embedding, the blocks, the head:
    /// the tier's order), as norms; empty where `grad_norm` is `None`.
    #[serde(skip_serializing_if = "Vec::is_empty", rename = "grad_norms")]
    pub layer_grad_norms: Vec<f64>,
    /// A mixture of experts' choices this step, as a hash of the experts
    /// each counted token went to in each routed block of each forward
    /// (`megatrain_zoo::layers::routing_digest`; this rank's tokens only;
    /// `None` where no block routed). Two runs routed every token alike
    /// where it is equal: f16 and f32 runs, or two devices, part where a
    /// token's scores fall the other way between their roundings.
    pub routing: Option<u64>,
    /// Ranks that trained this step together (0 when training alone);
    /// `tokens`, `counted` and `loss` are then those of all ranks.
    pub ranks: u64,
    /// Payload bytes this rank put into collectives (gradients reduced,
    /// transport shards gathered).
    pub comm_bytes: u64,
    /// Time spent starting and waiting on collectives (on the optimizer
    /// worker, mostly hidden behind the device's backward).
    pub comm_ms: f64,
    /// The part of `comm_ms` the step waited on: blocking collectives of
    /// the step itself, and the worker's waits after backward had ended.
    pub comm_wait_ms: f64,
}

impl StepMetrics {
    /// Bytes the host moved both ways ÷ the time spent moving them, GB/s;
    /// without the executor's transport counters, ÷ the time inside
    /// transfer calls. Uploads the device copied from the tier by itself
    /// are not counted: no host time goes with them (transfer-only mode's
    /// wall-clock rate covers them).
    pub fn bus_gb_s(&self) -> f64 {
        let ms = if self.bus_ms > 0.0 {
            self.bus_ms
        } else {
            self.upload_ms + self.download_ms
        };
        if ms > 0.0 {
            (self.bytes_uploaded - self.bytes_uploaded_direct + self.bytes_downloaded) as f64
                / (ms / 1e3)
                / 1e9
        } else {
            0.0
        }
    }

    /// Upload crossings per step (≈ 2 with one micro-batch).
    pub fn bus_crossings(&self) -> f64 {
        if self.transport_bytes == 0 {
            0.0
        } else {
            self.bytes_uploaded as f64 / self.transport_bytes as f64
        }
    }
}

/// A step's losses summed over its counted targets (and micro-batches,
/// then ranks), before `StepMetrics` takes their means.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct LossSums {
    /// −log p(target).
    pub cross_entropy: f64,
    /// A mixture of experts' balance loss, already a mean per forward.
    pub aux: f64,
    /// z·lse².
    pub z: f64,
    /// The cross-entropy against the uniform target (label smoothing).
    pub uniform: f64,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.cross_entropy += o.cross_entropy;
        self.aux += o.aux;
        self.z += o.z;
        self.uniform += o.uniform;
    }

    /// In the order `from_array` reads, for one all-reduce across ranks.
    pub fn to_array(self) -> [f64; 4] {
        [self.cross_entropy, self.aux, self.z, self.uniform]
    }

    pub fn from_array([cross_entropy, aux, z, uniform]: [f64; 4]) -> Self {
        LossSums {
            cross_entropy,
            aux,
            z,
            uniform,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LossSums;

    #[test]
    fn loss_sums_cross_ranks_term_by_term() {
        let a = LossSums {
            cross_entropy: 1.0,
            aux: 2.0,
            z: 3.0,
            uniform: 4.0,
        };
        let b = LossSums::from_array([10.0, 20.0, 30.0, 40.0]);
        // What a sum across two ranks of `to_array` gives.
        let mut x = a.to_array();
        x.iter_mut().zip(b.to_array()).for_each(|(x, y)| *x += y);
        let mut added = a;
        added.add(&b);
        assert_eq!(LossSums::from_array(x), added);
        assert_eq!(added.uniform, 44.0);
        assert_eq!(added.cross_entropy, 11.0);
    }
}
