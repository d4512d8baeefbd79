//! Per-op timing. With `TIMESTAMP_QUERY` the GPU time of each op's passes is
//! measured by timestamp queries; without it the wall time from submit to
//! completion is used (and the report says so). Profiling synchronises after
//! every op, so it is off unless asked for.

use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimingSource {
    GpuTimestamps,
    CpuWallClock,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct OpTiming {
    pub count: u64,
    pub total_ns: u64,
}

#[derive(Default)]
pub struct Profiler {
    entries: Mutex<BTreeMap<&'static str, OpTiming>>,
    /// `op/kernel` of each dispatch, where its pass was timed alone.
    kernels: Mutex<BTreeMap<String, OpTiming>>,
}

impl Profiler {
    pub fn record(&self, op: &'static str, ns: u64) {
        let mut e = self.entries.lock().expect("profiler poisoned");
        let t = e.entry(op).or_default();
        t.count += 1;
        t.total_ns += ns;
    }

    /// One dispatch of `kernel` (`Kernel::profile_name`) within `op`.
    pub fn record_kernel(&self, op: &'static str, kernel: &str, ns: u64) {
        let mut e = self.kernels.lock().expect("profiler poisoned");
        let t = e.entry(format!("{op}/{kernel}")).or_default();
        t.count += 1;
        t.total_ns += ns;
    }

    pub fn snapshot(&self) -> Vec<(&'static str, OpTiming)> {
        let e = self.entries.lock().expect("profiler poisoned");
        e.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// `op/kernel` rows: each dispatch's own pass, timed by timestamp
    /// queries (empty without them: the wall clock times whole ops).
    pub fn kernel_snapshot(&self) -> Vec<(String, OpTiming)> {
        let e = self.kernels.lock().expect("profiler poisoned");
        e.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    pub fn clear(&self) {
        self.entries.lock().expect("profiler poisoned").clear();
        self.kernels.lock().expect("profiler poisoned").clear();
    }

    /// A table of time per op kind, largest first.
    pub fn report(&self, source: TimingSource) -> String {
        let mut rows = self.snapshot();
        rows.sort_by_key(|(_, t)| std::cmp::Reverse(t.total_ns));
        let total: u64 = rows.iter().map(|(_, t)| t.total_ns).sum();
        let mut s = format!(
            "per-op time ({}):\n{:<22} {:>8} {:>12} {:>12} {:>7}\n",
            match source {
                TimingSource::GpuTimestamps => "GPU timestamp queries",
                TimingSource::CpuWallClock => "timestamps unavailable: CPU wall clock, submit to completion",
            },
            "op",
            "calls",
            "total ms",
            "mean us",
            "share"
        );
        for (name, t) in rows {
            s += &format!(
                "{:<22} {:>8} {:>12.3} {:>12.1} {:>6.1}%\n",
                name,
                t.count,
                t.total_ns as f64 / 1e6,
                t.total_ns as f64 / 1e3 / t.count.max(1) as f64,
                100.0 * t.total_ns as f64 / total.max(1) as f64
            );
        }
        s
    }
}
