//! What one configuration reports, and the arithmetic behind each number.
//!
//! FLOPs (stated in BENCHMARKS.md):
//! - model FLOPs per step = 6 · N · tokens, N = every parameter (embedding
//!   and head included);
//! - hardware FLOPs per step = model FLOPs + 2 · N_blocks · tokens · R / L
//!   (the forward of the R of L blocks recomputed in backward: all but
//!   those `--keep-activations` keeps) + causal attention:
//!   (3, or 4 where recomputed) · (2 · B · T² · Hq · D) per block (forward, a
//!   backward of twice the forward, and the recompute; 2·B·T²·Hq·D is QKᵀ
//!   and PV at half of the dense count for the causal mask).

use megatrain::StepMetrics;
use megatrain_tensor::TransportInfo;
use megatrain_zoo::{LayerKind, ModelConfig};
use serde::{Deserialize, Serialize};

use super::spec::Spec;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Modes {
    pub compute_only_ms: f64,
    pub transfer_only_ms: f64,
    /// The transfer-only mode's bytes (up and down) ÷ its time, GB/s.
    #[serde(default)]
    pub transfer_only_gb_s: f64,
    pub optimizer_only_ms: f64,
    /// Timed repetitions of each (after one warm-up), median reported.
    pub reps: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub spec: Spec,
    pub device_name: String,
    /// The executor's transport (`default`: it made no choice, e.g. the CPU
    /// executor, whose upload and download are plain copies).
    #[serde(default)]
    pub transport: String,
    /// Why it was chosen.
    #[serde(default)]
    pub transport_reason: String,
    /// Milliseconds per layer (upload, one read on the device, gradient
    /// download) measured for each candidate.
    #[serde(default)]
    pub transport_measured_ms: Vec<(String, f64)>,
    pub arch: String,
    pub n_params: u64,
    pub n_params_blocks: u64,
    pub num_layers: usize,
    pub hidden: usize,
    pub tokens_per_step: u64,
    /// Median over the timed steps.
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub model_flops_per_step: f64,
    pub hardware_flops_per_step: f64,
    pub model_tflops: f64,
    pub hardware_tflops: f64,
    // Step split: means over the timed steps, milliseconds.
    pub forward_ms: f64,
    pub loss_ms: f64,
    pub backward_ms: f64,
    pub optimizer_wait_ms: f64,
    /// The part of `optimizer_wait_ms` after backward
    /// (`StepMetrics::optimizer_tail_ms`).
    #[serde(default)]
    pub optimizer_tail_ms: f64,
    /// The forward's time applying the updates the step before carried
    /// (`StepMetrics::carried_ms`; part of `forward_ms`).
    #[serde(default)]
    pub carried_ms: f64,
    pub upload_ms: f64,
    pub download_ms: f64,
    pub optimizer_busy_ms: f64,
    /// Share of the optimizer's busy time hidden behind the step.
    pub optimizer_hidden: f64,
    pub bytes_uploaded_per_step: u64,
    /// The part of the uploads the device copied from the tier itself
    /// (registered host memory, `MEGATRAIN_UPLOADS=direct`): no host copy.
    #[serde(default)]
    pub bytes_uploaded_direct_per_step: u64,
    pub bytes_downloaded_per_step: u64,
    pub bus_bytes_per_step: u64,
    pub bus_crossings: f64,
    /// Bus bytes the host moved ÷ the time spent moving them (the
    /// executor's transport counters: CPU copies, submits, waits on the
    /// copies themselves, not on compute queued before them); without
    /// counters (the CPU executor), ÷ the time inside upload and download
    /// calls. Direct uploads are left out: no host time goes with them.
    pub bus_gb_s: f64,
    /// Time inside transfer calls spent moving bytes, and waiting for
    /// compute queued before a copy (means over the timed steps, ms).
    #[serde(default)]
    pub bus_ms: f64,
    #[serde(default)]
    pub transfer_wait_compute_ms: f64,
    /// Executor-accounted peak (None where the executor does not account,
    /// e.g. the CPU executor).
    pub device_peak_bytes: Option<u64>,
    /// VmHWM after the timed steps, before the isolated modes.
    pub peak_rss_bytes: u64,
    /// RSS when the process started (runtime, and for the GPU, the driver
    /// not yet loaded).
    pub baseline_rss_bytes: u64,
    pub host_bytes_per_param: f64,
    /// The tier's own RAM (p, m, v, transport) per parameter.
    pub tier_bytes_per_param: f64,
    pub staging_bytes: u64,
    pub modes: Option<Modes>,
    /// Why the isolated modes asked for were not measured (compute-only
    /// holds every layer's copy beside what the step keeps, and may not
    /// fit where the step did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modes_error: Option<String>,
    /// step ÷ max(compute-only, transfer-only, optimizer-only); 1.0 means
    /// every part hidden behind the slowest one.
    pub overlap_efficiency: Option<f64>,
    /// step ÷ (compute + transfer + optimizer); below 1.0 means overlap.
    pub serial_fraction: Option<f64>,
    /// Spill I/O per step (means over the timed steps): bytes each way,
    /// wall time with I/O in flight, the optimizer's wait on the disk.
    #[serde(default)]
    pub spill_read_bytes_per_step: u64,
    #[serde(default)]
    pub spill_written_bytes_per_step: u64,
    #[serde(default)]
    pub spill_disk_ms: f64,
    #[serde(default)]
    pub spill_wait_ms: f64,
    /// Spill bytes ÷ disk-busy time, GB/s.
    #[serde(default)]
    pub spill_gb_s: f64,
    /// The first layer on disk (None: all in RAM) and the parameters on disk.
    #[serde(default)]
    pub first_spilled: Option<usize>,
    #[serde(default)]
    pub spilled_params: u64,
    /// Peak host memory by kind.
    #[serde(default)]
    pub host_peak: Option<HostPeak>,
    /// With --profile: per-op times of one more step.
    #[serde(default)]
    pub profile: Option<super::profile::StepProfile>,
    /// The executor's host work per timed step (GPU executors).
    #[serde(default)]
    pub counters: Option<super::floor::StepCounters>,
    pub loss_first: f64,
    pub loss_last: f64,
    pub steps: Vec<serde_json::Value>,
    /// PyTorch peer results attached by the parent (None: not run).
    pub peer: Option<Vec<serde_json::Value>>,
}

/// Peak host memory by kind, bytes: the tier's reserved blocks (fixed
/// once allocated), the peaks of the trainer's and executor's own byte
/// counters, the RSS at start, and what the measured peak RSS (VmHWM)
/// leaves over. Counters peak at different moments of a step, so their
/// sum can pass the RSS peak: `other` is then negative.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostPeak {
    pub peak_rss: u64,
    pub tier_params: u64,
    /// AdamW m and v.
    pub tier_moments: u64,
    pub tier_transport: u64,
    pub tier_held_grads: u64,
    /// The trainer's gradient staging pool, most bytes at once.
    pub staging_pool: u64,
    /// Host-visible transport buffers of the executor (a GPU's upload
    /// ring and parked readback buffers) after the steps; `None` for the
    /// CPU executor, which has none.
    pub transport_buffers: Option<u64>,
    /// Peak bytes of the executor's tensors where they are host memory
    /// (the CPU executor); `None` where they live on a device.
    pub executor_tensors: Option<u64>,
    /// RSS when the process started.
    pub baseline: u64,
    /// `peak_rss` minus every figure above.
    pub other: i64,
    /// The peak of each part of the run (`None` where the peak could not
    /// be reset between them); `peak_rss` is the largest.
    #[serde(default)]
    pub phases: Option<PhasePeaks>,
}

/// The parts of a bench run whose RSS peaks are told apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Phase {
    /// Model, tier and trainer made: the device opened, the transport
    /// prepared.
    Setup,
    /// The warm-up steps (the first compiles every pipeline).
    Warmup,
    /// The timed steps.
    Steps,
}

/// Peak RSS of each [`Phase`], bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhasePeaks {
    pub setup: u64,
    pub warmup: u64,
    pub steps: u64,
}

/// Measures [`PhasePeaks`]: each [`PeakPhases::end`] reads the peak since
/// the last and resets it (`rss::reset_peak_rss`, Linux).
pub struct PeakPhases {
    peaks: PhasePeaks,
    ok: bool,
}

impl PeakPhases {
    pub fn start() -> PeakPhases {
        PeakPhases {
            peaks: PhasePeaks::default(),
            ok: megatrain_tier::rss::peak_rss_bytes().is_some(),
        }
    }

    pub fn end(&mut self, phase: Phase) {
        let peak = megatrain_tier::rss::peak_rss_bytes().unwrap_or(0);
        match phase {
            Phase::Setup => self.peaks.setup = peak,
            Phase::Warmup => self.peaks.warmup = peak,
            Phase::Steps => self.peaks.steps = peak,
        }
        self.ok &= megatrain_tier::rss::reset_peak_rss();
    }

    /// The peaks, where every reset worked.
    pub fn recorded(&self) -> Option<PhasePeaks> {
        self.ok.then_some(self.peaks)
    }

    /// The whole run's peak, the largest phase's: right even where a reset
    /// failed (the next phase's reading then covers both), `None` where
    /// the peak cannot be read.
    pub fn overall(&self) -> Option<u64> {
        let p = self.peaks;
        Some(p.setup.max(p.warmup).max(p.steps)).filter(|&m| m > 0)
    }
}

impl HostPeak {
    pub fn new(
        peak_rss: u64,
        baseline: u64,
        tier: &megatrain_tier::BytesByKind,
        staging_pool: u64,
        transport_buffers: Option<u64>,
        executor_tensors: Option<u64>,
    ) -> HostPeak {
        let counted = tier.total()
            + staging_pool
            + transport_buffers.unwrap_or(0)
            + executor_tensors.unwrap_or(0)
            + baseline;
        HostPeak {
            peak_rss,
            tier_params: tier.params,
            tier_moments: tier.moments,
            tier_transport: tier.transport,
            tier_held_grads: tier.gradients,
            staging_pool,
            transport_buffers,
            executor_tensors,
            baseline,
            other: peak_rss as i64 - counted as i64,
            phases: None,
        }
    }

    /// `(kind, bytes)` for the report, the tier's kinds first.
    pub fn kinds(&self) -> Vec<(&'static str, i64)> {
        let mut v = vec![
            ("tier p", self.tier_params as i64),
            ("tier m+v", self.tier_moments as i64),
            ("tier transport", self.tier_transport as i64),
            ("tier held grads", self.tier_held_grads as i64),
            ("staging pool", self.staging_pool as i64),
        ];
        if let Some(b) = self.transport_buffers {
            v.push(("transport buffers", b as i64));
        }
        if let Some(b) = self.executor_tensors {
            v.push(("executor tensors", b as i64));
        }
        v.push(("process at start", self.baseline as i64));
        v.push(("other", self.other));
        v
    }
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

fn mean(steps: &[StepMetrics], f: impl Fn(&StepMetrics) -> f64) -> f64 {
    if steps.is_empty() {
        0.0
    } else {
        steps.iter().map(f).sum::<f64>() / steps.len() as f64
    }
}

/// Model and hardware FLOPs of one step (see the module docs), with
/// `recomputed` of the model's blocks recomputed in backward.
pub fn flops(
    model: &ModelConfig,
    n_params: u64,
    n_blocks: u64,
    (batch, seq): (usize, usize),
    recomputed: usize,
) -> (f64, f64) {
    let tokens = (batch * seq) as f64;
    let model_flops = 6.0 * n_params as f64 * tokens;
    let attn_fwd = 2.0 * batch as f64 * (seq * seq) as f64 * (model.num_heads * model.head_dim) as f64;
    let share = recomputed as f64 / model.num_layers.max(1) as f64;
    let blocks = model.num_layers as f64;
    let hw =
        model_flops + 2.0 * n_blocks as f64 * tokens * share + (3.0 * blocks + recomputed as f64) * attn_fwd;
    (model_flops, hw)
}

impl Record {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &Spec,
        model: &ModelConfig,
        device_name: String,
        steps: Vec<StepMetrics>,
        modes: Option<Modes>,
        peak_rss: u64,
        baseline_rss: u64,
        tier_ram: u64,
        staging: u64,
        transport: Option<&TransportInfo>,
    ) -> Record {
        let tables = model.layer_tables();
        let n_params: u64 = tables.iter().map(|t| t.numel() as u64).sum();
        let blocks =
            || (0..tables.len()).filter(|&l| matches!(model.layer_kind(l), Some(LayerKind::Block(_))));
        let n_blocks: u64 = blocks().map(|l| tables[l].numel() as u64).sum();
        // A mixture of experts' FLOPs count the experts a token is sent to.
        let unread = |l: usize| model.unread_params_of(l) as u64;
        let active = n_params - (0..tables.len()).map(unread).sum::<u64>();
        let active_blocks = n_blocks - blocks().map(unread).sum::<u64>();
        let tokens = spec.tokens_per_step();
        let step_ms = median(&steps.iter().map(|m| m.step_ms).collect::<Vec<_>>());
        let secs = step_ms / 1e3;
        let kept = spec.keep_activations.blocks(model.num_layers).unwrap_or(0);
        let recomputed = model.num_layers - kept;
        let (model_flops, hw_flops) = flops(
            model,
            active,
            active_blocks,
            (spec.batch, spec.seq_len),
            recomputed,
        );
        let up = mean(&steps, |m| m.bytes_uploaded as f64) as u64;
        let down = mean(&steps, |m| m.bytes_downloaded as f64) as u64;
        let direct = mean(&steps, |m| m.bytes_uploaded_direct as f64) as u64;
        let bus_ms = mean(&steps, |m| {
            if m.bus_ms > 0.0 {
                m.bus_ms
            } else {
                m.upload_ms + m.download_ms
            }
        });
        let device_peak = steps.iter().map(|m| m.device_peak_bytes).max().filter(|&p| p > 0);
        let overlap = modes.as_ref().map(|m| {
            let bound = m.compute_only_ms.max(m.transfer_only_ms).max(m.optimizer_only_ms);
            let serial = m.compute_only_ms + m.transfer_only_ms + m.optimizer_only_ms;
            (step_ms / bound, step_ms / serial)
        });
        Record {
            spec: spec.clone(),
            device_name,
            transport: transport.map_or_else(|| "default".into(), |t| t.name.clone()),
            transport_reason: transport.map(|t| t.reason.clone()).unwrap_or_default(),
            transport_measured_ms: transport.map(|t| t.measured_ms.clone()).unwrap_or_default(),
            arch: format!("{:?}", model.arch),
            n_params,
            n_params_blocks: n_blocks,
            num_layers: model.num_layers,
            hidden: model.hidden_size,
            tokens_per_step: tokens,
            step_ms,
            tokens_per_s: tokens as f64 / secs,
            model_flops_per_step: model_flops,
            hardware_flops_per_step: hw_flops,
            model_tflops: model_flops / secs / 1e12,
            hardware_tflops: hw_flops / secs / 1e12,
            forward_ms: mean(&steps, |m| m.forward_ms),
            loss_ms: mean(&steps, |m| m.loss_ms),
            backward_ms: mean(&steps, |m| m.backward_ms),
            optimizer_wait_ms: mean(&steps, |m| m.optimizer_wait_ms),
            optimizer_tail_ms: mean(&steps, |m| m.optimizer_tail_ms),
            carried_ms: mean(&steps, |m| m.carried_ms),
            upload_ms: mean(&steps, |m| m.upload_ms),
            download_ms: mean(&steps, |m| m.download_ms),
            optimizer_busy_ms: mean(&steps, |m| m.optimizer_ms),
            optimizer_hidden: mean(&steps, |m| m.optimizer_hidden),
            bytes_uploaded_per_step: up,
            bytes_uploaded_direct_per_step: direct,
            bytes_downloaded_per_step: down,
            bus_bytes_per_step: up + down,
            bus_crossings: mean(&steps, StepMetrics::bus_crossings),
            bus_gb_s: if bus_ms > 0.0 {
                (up - direct.min(up) + down) as f64 / (bus_ms / 1e3) / 1e9
            } else {
                0.0
            },
            bus_ms,
            transfer_wait_compute_ms: mean(&steps, |m| m.transfer_wait_compute_ms),
            device_peak_bytes: device_peak,
            peak_rss_bytes: peak_rss,
            baseline_rss_bytes: baseline_rss,
            host_bytes_per_param: peak_rss as f64 / n_params as f64,
            tier_bytes_per_param: tier_ram as f64 / n_params as f64,
            staging_bytes: staging,
            modes,
            modes_error: None,
            overlap_efficiency: overlap.map(|o| o.0),
            serial_fraction: overlap.map(|o| o.1),
            spill_read_bytes_per_step: mean(&steps, |m| m.spill_read_bytes as f64) as u64,
            spill_written_bytes_per_step: mean(&steps, |m| m.spill_written_bytes as f64) as u64,
            spill_disk_ms: mean(&steps, |m| m.spill_disk_ms),
            spill_wait_ms: mean(&steps, |m| m.spill_wait_ms),
            spill_gb_s: {
                let ms = mean(&steps, |m| m.spill_disk_ms);
                let b = mean(&steps, |m| (m.spill_read_bytes + m.spill_written_bytes) as f64);
                if ms > 0.0 { b / (ms / 1e3) / 1e9 } else { 0.0 }
            },
            first_spilled: None,
            spilled_params: 0,
            host_peak: None,
            profile: None,
            counters: None,
            loss_first: steps.first().map_or(f64::NAN, |m| m.loss),
            loss_last: steps.last().map_or(f64::NAN, |m| m.loss),
            steps: steps
                .iter()
                .map(|m| serde_json::to_value(m).unwrap_or_default())
                .collect(),
            peer: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatrain_zoo::preset;

    #[test]
    fn flops_follow_the_stated_formulas() {
        let m = preset("llama-tiny", None).unwrap();
        let l = m.num_layers;
        let (model, hw) = flops(&m, 1000, 600, (2, 8), l);
        assert_eq!(model, 6.0 * 1000.0 * 16.0);
        let attn = 2.0 * 2.0 * 64.0 * (m.num_heads * m.head_dim) as f64;
        assert_eq!(hw, model + 2.0 * 600.0 * 16.0 + 4.0 * attn * l as f64);
        // Every block kept: no recompute, attention three times the forward.
        let (_, kept) = flops(&m, 1000, 600, (2, 8), 0);
        assert_eq!(kept, model + 3.0 * attn * l as f64);
        // One of two blocks kept: half the blocks' recompute.
        assert_eq!(l, 2);
        let (_, half) = flops(&m, 1000, 600, (2, 8), 1);
        assert_eq!(half, model + 600.0 * 16.0 + 7.0 * attn);
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
