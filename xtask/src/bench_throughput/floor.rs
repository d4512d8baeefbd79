//! What the host does per step on the GPU executor (ops recorded, queue
//! submissions, waits, bind groups and buffers made), and `--device
//! gpu-noop`: the same executor on wgpu's noop backend (xtask's default
//! feature `host-floor`), where no kernel runs and a step costs only
//! the host's part of it: the floor under every GPU step.

use std::fmt::Write;
use std::sync::Arc;

use megatrain_gpu::{GpuContext, GpuExecutor, HostWork};
use megatrain_tensor::CpuExecutor;
use serde::{Deserialize, Serialize};

use super::record::Record;

/// The device name of a host-floor run.
pub const NOOP_DEVICE: &str = "gpu-noop";

/// What the host floor is, printed with every table that has one.
pub const MEANING: &str = "gpu-noop: wgpu's noop backend, NO KERNEL RAN (results are garbage). \
     The step time is the host floor of a GPU step: our recording, wgpu-core's validation and \
     tracking, bind groups, submits, maps, the transport's host copies (and the device-side \
     copies and clears, done in host memory on this backend), the CPU AdamW and the trainer's \
     bookkeeping.";

/// A noop device with an H100's limits, or why there is none.
pub fn noop_context() -> anyhow::Result<Arc<GpuContext>> {
    #[cfg(feature = "host-floor")]
    {
        Ok(GpuContext::host_floor()?)
    }
    #[cfg(not(feature = "host-floor"))]
    {
        anyhow::bail!(
            "--device {NOOP_DEVICE} needs wgpu's noop backend: build xtask with its default feature \
             host-floor (cargo run --release -p xtask --features host-floor -- bench-throughput ...)"
        )
    }
}

/// CPU time (user + system) of every thread of this process so far, ms:
/// unlike the wall clock, not stretched by other processes on a shared
/// machine (though it counts the spinning of idle pool threads).
pub fn process_cpu_ms() -> f64 {
    // SAFETY: getrusage writes only the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(u.ru_utime) + ms(u.ru_stime)
}

/// The process's CPU time and the executor's host work, since each began.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    pub cpu_ms: f64,
    pub work: HostWork,
}

/// Executors that count their host work.
pub trait HostCounters {
    fn host_counters(&self) -> Option<Snapshot> {
        None
    }
}

impl HostCounters for CpuExecutor {}

impl HostCounters for GpuExecutor {
    fn host_counters(&self) -> Option<Snapshot> {
        Some(Snapshot {
            cpu_ms: process_cpu_ms(),
            work: self.host_work(),
        })
    }
}

/// Per timed step: means of the counters over the timed steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepCounters {
    /// CPU time of the whole process (every thread) per step, ms.
    #[serde(default)]
    pub cpu_ms: f64,
    pub ops: f64,
    /// Compute dispatches, and the compute passes holding them.
    #[serde(default)]
    pub dispatches: f64,
    #[serde(default)]
    pub passes: f64,
    pub op_submissions: f64,
    pub transfer_submissions: f64,
    /// Times the host blocked on the device (polls that wait, buffer maps).
    pub waits: f64,
    pub bind_groups_made: f64,
    pub device_allocations: f64,
    pub host_buffers_created: f64,
    pub uploads: f64,
    pub downloads: f64,
    /// Under F16: operand max scans and the MB they read, outputs whose
    /// maxima their producers stored instead, f16 operand copies.
    #[serde(default)]
    pub max_scans: f64,
    #[serde(default)]
    pub max_scan_mb: f64,
    #[serde(default)]
    pub maxima_stored: f64,
    #[serde(default)]
    pub f16_copies: f64,
}

impl StepCounters {
    pub fn between(a: &Snapshot, b: &Snapshot, steps: usize) -> Self {
        let n = steps.max(1) as f64;
        let w = b.work - a.work;
        let d = |x: u64| x as f64 / n;
        StepCounters {
            cpu_ms: (b.cpu_ms - a.cpu_ms) / n,
            ops: d(w.submit.ops),
            dispatches: d(w.submit.dispatches),
            passes: d(w.submit.passes),
            op_submissions: d(w.submit.op_submissions),
            transfer_submissions: d(w.submit.transfer_submissions),
            waits: d(w.submit.waits),
            bind_groups_made: d(w.bind_groups_made),
            device_allocations: d(w.device_allocations),
            host_buffers_created: d(w.host_buffers_made),
            uploads: d(w.uploads),
            downloads: d(w.downloads),
            max_scans: d(w.operand_max_scans),
            max_scan_mb: d(w.operand_max_scan_bytes) / 1e6,
            maxima_stored: d(w.output_maxima_stored),
            f16_copies: d(w.operand_f16_copies),
        }
    }
}

/// One row per record that counted its host work (GPU executors); empty
/// where none did.
pub fn table(records: &[Record]) -> String {
    let rows: Vec<_> = records
        .iter()
        .filter_map(|r| r.counters.as_ref().map(|c| (r, c)))
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "\nHost work per step (means over the timed steps; step ms is the median):\n\n\
         | config | device | prec | step ms | min..max ms | CPU ms (all threads) | ops | dispatches | passes | op submits | transfer submits | \
         waits | uploads | downloads | bind groups made | device allocs | host buffers made |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (r, c) in &rows {
        let ms: Vec<f64> = r.steps.iter().filter_map(|v| v["step_ms"].as_f64()).collect();
        let lo = ms.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ms.iter().copied().fold(0.0, f64::max);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.2}..{:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
            r.spec.label,
            r.spec.device,
            r.spec.precision,
            r.step_ms,
            lo,
            hi,
            c.cpu_ms,
            c.ops,
            c.dispatches,
            c.passes,
            c.op_submissions,
            c.transfer_submissions,
            c.waits,
            c.uploads,
            c.downloads,
            c.bind_groups_made,
            c.device_allocations,
            c.host_buffers_created,
        );
    }
    let f16: Vec<_> = rows
        .iter()
        .filter(|(_, c)| c.max_scans + c.maxima_stored + c.f16_copies > 0.0)
        .collect();
    if !f16.is_empty() {
        s.push_str(
            "\nf16 operands per step (max scans read whole tensors; folded maxima come with \
             the ops that stored them):\n\n\
             | config | device | max scans | MB scanned | outputs with folded maxima | f16 copies |\n\
             |---|---|---|---|---|---|\n",
        );
        for (r, c) in f16 {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.1} | {:.0} | {:.0} |",
                r.spec.label, r.spec.device, c.max_scans, c.max_scan_mb, c.maxima_stored, c.f16_copies
            );
        }
    }
    if rows.iter().any(|(r, _)| r.spec.device == NOOP_DEVICE) {
        let _ = writeln!(s, "\n{MEANING}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_throughput::child;
    use crate::bench_throughput::spec::{Spec, test_spec};

    fn spec() -> Spec {
        Spec {
            label: "floor".into(),
            layers: Some(1),
            hidden: None,
            seq_len: 8,
            batch: 2,
            device: NOOP_DEVICE.into(),
            ..test_spec()
        }
    }

    #[cfg(not(feature = "host-floor"))]
    #[test]
    fn without_the_feature_gpu_noop_says_how_to_get_it() {
        let err = format!("{:#}", child::run(&spec()).unwrap_err());
        assert!(err.contains("--features host-floor"), "{err}");
    }

    #[cfg(feature = "host-floor")]
    #[test]
    fn a_noop_run_counts_its_host_work_and_says_no_kernel_ran() {
        let r = child::run(&spec()).unwrap();
        assert!(r.device_name.contains("noop"), "{}", r.device_name);
        let c = r.counters.clone().unwrap();
        assert!(c.ops > 10.0 && c.op_submissions >= 1.0 && c.waits >= 1.0, "{c:?}");
        assert_eq!((c.bind_groups_made, c.device_allocations), (0.0, 0.0), "{c:?}");
        assert!(c.cpu_ms > 0.0, "{c:?}");
        let t = table(&[r]);
        assert!(
            t.contains("| floor | gpu-noop |") && t.contains("NO KERNEL RAN"),
            "{t}"
        );
    }

    /// Under F16 the outputs of a Llama block's products, norms and RoPE
    /// come with the maxima their producers stored: the 7 products'
    /// outputs and SwiGLU's s (forward, and again in the recompute: 16),
    /// the 7 input-gradient products' and dup (8), the two norm outputs
    /// (forward and recompute: 4), the two norm backwards' dx (2), q and k
    /// after RoPE (4), dq and dk through its backward (2), and attention's
    /// output (forward and recompute: 2) and dv (1): 39 per layer, and
    /// nothing in a layer is scanned.
    #[cfg(feature = "host-floor")]
    #[test]
    fn f16_producers_store_their_outputs_maxima_and_no_layer_is_scanned() {
        let per_step = |layers| {
            let s = Spec {
                layers: Some(layers),
                precision: "f16".into(),
                ..spec()
            };
            child::run(&s).unwrap().counters.unwrap()
        };
        let (one, two) = (per_step(1), per_step(2));
        let per_layer = (
            two.maxima_stored - one.maxima_stored,
            two.max_scans - one.max_scans,
        );
        assert_eq!(per_layer, (39.0, 0.0), "{one:?}\n{two:?}");
        let t = table(&[child::run(&Spec {
            precision: "f16".into(),
            ..spec()
        })
        .unwrap()]);
        assert!(t.contains("| outputs with folded maxima |"), "{t}");
    }

    #[test]
    fn the_cpu_executor_has_no_host_work_table() {
        let r = child::run(&Spec {
            device: "cpu".into(),
            ..spec()
        })
        .unwrap();
        assert!(r.counters.is_none());
        assert_eq!(table(&[r]), "");
    }
}
