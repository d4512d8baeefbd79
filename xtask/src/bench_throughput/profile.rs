//! `--profile`: one more training step after the timed ones with the GPU
//! executor's per-op profiling on (timestamp queries where the adapter has
//! them, else the CPU wall clock from submit to completion), as a table of
//! op, calls, time and share, beside the step's own wall time. Profiling
//! synchronises after every op, so the step is slower than a timed one;
//! the table says where GPU time goes, the gap says how much of the step
//! is not in any op (host overhead, transport waits, the syncs).

use std::fmt::Write;

use megatrain_gpu::{GpuExecutor, TimingSource};
use megatrain_tensor::CpuExecutor;
use serde::{Deserialize, Serialize};

use super::record::Record;

/// One op kind's time over the profiled step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRow {
    pub op: String,
    pub calls: u64,
    pub total_ms: f64,
    pub mean_us: f64,
    /// Of the summed op time.
    pub share: f64,
}

/// The profile of one training step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepProfile {
    /// "gpu timestamps" or "cpu wall clock".
    pub timing: String,
    /// The profiled step's wall time (with a sync after every op).
    pub step_ms: f64,
    /// Sum of every op's time.
    pub ops_ms: f64,
    /// Of the step: time inside weight uploads and gradient downloads.
    pub upload_ms: f64,
    pub download_ms: f64,
    pub optimizer_wait_ms: f64,
    /// Largest total first.
    pub ops: Vec<OpRow>,
    /// `op/kernel`: each dispatch timed in a pass of its own (GPU
    /// timestamps only), largest total first; its share is of their sum.
    #[serde(default)]
    pub kernels: Vec<OpRow>,
}

/// (op, calls, total ns) of each op kind, as the profiler holds them.
pub type RawOps = Vec<(String, u64, u64)>;

/// Executors that can time their ops.
pub trait OpProfiler {
    /// Clears earlier timings and starts recording; false where the
    /// executor cannot profile.
    fn profile_start(&self) -> bool {
        false
    }
    /// Stops recording; the timing source, (op, calls, total ns) rows and
    /// the same of each op's kernels (`op/kernel`, where timed).
    fn profile_stop(&self) -> Option<(String, RawOps, RawOps)> {
        None
    }
}

impl OpProfiler for CpuExecutor {}

impl OpProfiler for GpuExecutor {
    fn profile_start(&self) -> bool {
        // Nothing queued before may be charged to the first profiled op.
        let _ = self.synchronize();
        self.profile().clear();
        self.set_profiling(true);
        true
    }

    fn profile_stop(&self) -> Option<(String, RawOps, RawOps)> {
        self.set_profiling(false);
        let timing = match self.timing_source() {
            TimingSource::GpuTimestamps => "gpu timestamps",
            TimingSource::CpuWallClock => "cpu wall clock",
        };
        let rows = self
            .profile()
            .snapshot()
            .into_iter()
            .map(|(op, t)| (op.to_string(), t.count, t.total_ns))
            .collect();
        let kernels = self
            .profile()
            .kernel_snapshot()
            .into_iter()
            .map(|(k, t)| (k, t.count, t.total_ns))
            .collect();
        Some((timing.into(), rows, kernels))
    }
}

impl StepProfile {
    /// From the profiler's rows and the profiled step's metrics.
    pub fn new(timing: String, rows: RawOps, kernels: RawOps, m: &megatrain::StepMetrics) -> Self {
        let total_ns: u64 = rows.iter().map(|r| r.2).sum();
        StepProfile {
            timing,
            step_ms: m.step_ms,
            ops_ms: total_ns as f64 / 1e6,
            upload_ms: m.upload_ms,
            download_ms: m.download_ms,
            optimizer_wait_ms: m.optimizer_wait_ms,
            ops: op_rows(rows),
            kernels: op_rows(kernels),
        }
    }
}

/// Rows of (name, calls, total ns), largest total first, each with its
/// share of their sum.
fn op_rows(rows: RawOps) -> Vec<OpRow> {
    let total_ns: u64 = rows.iter().map(|r| r.2).sum();
    let mut ops: Vec<OpRow> = rows
        .into_iter()
        .map(|(op, calls, ns)| OpRow {
            op,
            calls,
            total_ms: ns as f64 / 1e6,
            mean_us: ns as f64 / 1e3 / calls.max(1) as f64,
            share: ns as f64 / total_ns.max(1) as f64,
        })
        .collect();
    ops.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms).then(a.op.cmp(&b.op)));
    ops
}

impl StepProfile {
    /// The per-op table, under a heading naming `what` (the config, its
    /// device, precision and shape), and the per-kernel one where kernels
    /// were timed.
    pub fn table(&self, what: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\nper-op profile of one step: {what}, {}\n\n\
             | op | calls | total ms | mean µs | share |\n|---|---|---|---|---|",
            self.timing
        );
        push_rows(&mut s, &self.ops);
        let _ = writeln!(
            s,
            "\nstep {:.1} ms wall (a sync after every op) = ops {:.1} ms + {:.1} ms in no op \
             (host overhead, syncs, transport: uploads {:.1} ms, downloads {:.1} ms, optimizer wait {:.1} ms)",
            self.step_ms,
            self.ops_ms,
            self.step_ms - self.ops_ms,
            self.upload_ms,
            self.download_ms,
            self.optimizer_wait_ms
        );
        if !self.kernels.is_empty() {
            let _ = writeln!(
                s,
                "\nper kernel (each dispatch in a pass of its own, so a little slower than above):\n\n\
                 | op/kernel | calls | total ms | mean µs | share |\n|---|---|---|---|---|"
            );
            push_rows(&mut s, &self.kernels);
        }
        s
    }
}

/// The table rows of `rows` (name, calls, total ms, mean µs, share).
fn push_rows(s: &mut String, rows: &[OpRow]) {
    for o in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.1} | {:.1}% |",
            o.op,
            o.calls,
            o.total_ms,
            o.mean_us,
            100.0 * o.share
        );
    }
}

/// The per-op table of every profiled record.
pub fn tables(records: &[Record]) -> String {
    let mut s = String::new();
    for r in records {
        let Some(p) = &r.profile else { continue };
        s.push_str(&p.table(&format!(
            "{} on {} ({}, B×T {}×{})",
            r.spec.label, r.device_name, r.spec.precision, r.spec.batch, r.spec.seq_len
        )));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_throughput::child;
    use crate::bench_throughput::spec::{Spec, test_spec};

    fn spec(device: &str, layers: usize) -> Spec {
        Spec {
            label: format!("llama-tiny L{layers}"),
            layers: Some(layers),
            hidden: None,
            seq_len: 16,
            batch: 2,
            steps: 1,
            warmup: 0,
            device: device.into(),
            profile: true,
            ..test_spec()
        }
    }

    /// The ops one streamed step of a Llama model with `l` blocks issues
    /// (K = 1, a loss head of one chunk): every block's forward runs twice
    /// (forward, recompute in backward) and its backward once.
    fn llama_step_calls(l: u64) -> Vec<(&'static str, u64)> {
        vec![
            // q, k, v, o, gate, down per block forward; the head.
            ("matmul", 2 * 6 * l + 1),
            // up with SwiGLU applied at its store.
            ("matmul_swiglu", 2 * l),
            // Down's backward, its input gradient through SwiGLU's backward
            // at the store.
            ("matmul_backward_swiglu", l),
            // q, k, v, o, gate, up per block; the head.
            ("matmul_backward", 6 * l + 1),
            ("attention", 2 * l),
            ("attention_backward", l),
            // q and k.
            ("rope", 2 * 2 * l),
            ("rope_backward", 2 * l),
            // Fused into the products above.
            ("swiglu", 0),
            ("swiglu_backward", 0),
            // The input norm of each block, and the final norm.
            ("rmsnorm", 2 * l + 1),
            ("rmsnorm_backward", 1),
            // Attention's residual add fused into the MLP's norm.
            ("add_rmsnorm", 2 * l),
            // Each norm's backward fused with its residual gradient.
            ("add_rmsnorm_backward", 2 * l),
            // The MLP's residual add.
            ("add", 2 * l),
            // None: k's and v's input gradients are added into q's, and
            // up's into gate's, by the products' accumulating store.
            ("add_assign", 0),
            ("cross_entropy", 1),
            ("embedding", 1),
            ("embedding_backward", 1),
        ]
    }

    fn calls(p: &StepProfile, op: &str) -> u64 {
        p.ops.iter().find(|r| r.op == op).map_or(0, |r| r.calls)
    }

    #[test]
    fn the_profile_lists_every_op_of_a_llama_step_with_its_calls() {
        if let Err(e) = megatrain_gpu::GpuContext::new() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but no GPU adapter: {e}"
            );
            eprintln!("skipping: no GPU adapter ({e})");
            return;
        }
        for l in [2, 3] {
            let r = child::run(&spec("gpu", l)).unwrap();
            let p = r.profile.as_ref().expect("a GPU step has a profile");
            for (op, n) in llama_step_calls(l as u64) {
                assert_eq!(calls(p, op), n, "{op} with {l} blocks: {:?}", p.ops);
            }
            assert!(
                p.ops.iter().all(|o| o.calls > 0 && o.total_ms > 0.0),
                "{:?}",
                p.ops
            );
            let shares: f64 = p.ops.iter().map(|o| o.share).sum();
            assert!((shares - 1.0).abs() < 1e-9, "{shares}");
            assert!(
                p.ops_ms > 0.0 && p.ops_ms <= p.step_ms,
                "{} of {}",
                p.ops_ms,
                p.step_ms
            );
            assert!(p.ops.windows(2).all(|w| w[0].total_ms >= w[1].total_ms));
            // The profiled step comes after the timed ones, not among them.
            assert_eq!(r.steps.len(), 1);
            let table = tables(std::slice::from_ref(&r));
            assert!(
                table.contains("| op | calls | total ms | mean µs | share |"),
                "{table}"
            );
            assert!(
                table.contains(&format!("| attention_backward | {l} |")),
                "{table}"
            );
            assert!(table.contains("in no op"), "{table}");
            let json = serde_json::to_value(&r).unwrap();
            assert_eq!(json["profile"]["ops"][0]["op"], p.ops[0].op.as_str());
            // With timestamps each dispatch is timed in its own pass: an
            // op's kernels take at least its calls, their time fits within
            // the op's (first pass's start to last's end), and the
            // attention's backward shows its passes apart.
            if p.timing == "gpu timestamps" {
                for o in &p.ops {
                    let mine: Vec<&OpRow> = p
                        .kernels
                        .iter()
                        .filter(|k| k.op.split_once('/').is_some_and(|(op, _)| op == o.op))
                        .collect();
                    // Ops of copies or clears alone (`zeros`) dispatch nothing.
                    if mine.is_empty() {
                        continue;
                    }
                    let calls: u64 = mine.iter().map(|k| k.calls).sum();
                    let ms: f64 = mine.iter().map(|k| k.total_ms).sum();
                    assert!(calls >= o.calls, "{}: {mine:?}", o.op);
                    assert!(
                        ms <= o.total_ms * (1.0 + 1e-9) + 1e-6,
                        "{}: {ms} of {}",
                        o.op,
                        o.total_ms
                    );
                }
                let attn: Vec<&str> = p
                    .kernels
                    .iter()
                    .filter_map(|k| k.op.strip_prefix("attention_backward/"))
                    .collect();
                assert!(attn.len() >= 2, "{attn:?}");
                assert!(table.contains("| op/kernel | calls |"), "{table}");
            }
        }
    }

    #[test]
    fn the_cpu_executor_has_no_profile() {
        let r = child::run(&spec("cpu", 1)).unwrap();
        assert!(r.profile.is_none());
        assert_eq!(tables(&[r]), "");
    }
}
