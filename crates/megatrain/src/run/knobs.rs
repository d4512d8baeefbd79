//! Device knobs: how layers and gradients move, never what is computed.
//! Shared by `megatrain train` and `cargo xtask bench-throughput`, so both
//! accept and refuse the same values with the same words.

use megatrain_gpu::{GpuOptions, TransportChoice};
use serde::{Deserialize, Serialize};

use super::error::{Result, RunError};

/// Most staging ring entries: each holds a mapped chunk of host memory,
/// and past a few dozen the copy engine is already busy.
pub const MAX_STAGING_DEPTH: usize = 64;
/// Largest staging entry, MiB (a single buffer; the adapter's own
/// `max_buffer_size` is checked again when the executor opens).
pub const MAX_STAGING_CHUNK_MIB: u64 = 4096;
/// Most copy threads: far past any machine's cores.
pub const MAX_COPY_THREADS: usize = 1024;
/// Most ops in one queue submission: past a few thousand a batch only
/// delays the device's start.
pub const MAX_BATCH_OPS: usize = 65536;
/// Largest gradient transfer chunk, bytes: a chunk is staged whole on the
/// host and in the executor's readback buffers.
pub const MAX_TRANSFER_CHUNK: u64 = 16 << 30;

/// The GPU transport's knobs (`None`: the executor's default): one set of
/// flags, flattened into `megatrain train` and `cargo xtask
/// bench-throughput`, and one set of keys in a run's options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct TransportKnobs {
    /// GPU only: entries in the staging transport's ring (default 4, 1..=64).
    #[arg(long)]
    #[serde(default)]
    pub staging_depth: Option<usize>,
    /// GPU only: largest piece of a layer one staging entry carries, MiB
    /// (default 32, 1..=4096).
    #[arg(long)]
    #[serde(default)]
    pub staging_chunk_mib: Option<u64>,
    /// GPU only: threads copying into and out of mapped memory (default:
    /// the cores, at most 16).
    #[arg(long)]
    #[serde(default)]
    pub copy_threads: Option<usize>,
    /// GPU only: most ops recorded into one queue submission (default 256,
    /// 1..=65536; 1 submits op by op).
    #[arg(long)]
    #[serde(default)]
    pub batch_ops: Option<usize>,
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
    flag: &str,
    v: Option<T>,
    lo: T,
    hi: T,
    unit: &str,
) -> Result<()> {
    match v {
        Some(v) if v < lo || v > hi => Err(RunError::option(
            flag,
            v,
            format!("must be between {lo} and {hi}{unit}"),
        )),
        _ => Ok(()),
    }
}

impl TransportKnobs {
    /// These knobs with every one set in `over` taken from it (flags over
    /// a config file over a resumed run's options).
    pub fn overridden_by(self, over: TransportKnobs) -> TransportKnobs {
        TransportKnobs {
            staging_depth: over.staging_depth.or(self.staging_depth),
            staging_chunk_mib: over.staging_chunk_mib.or(self.staging_chunk_mib),
            copy_threads: over.copy_threads.or(self.copy_threads),
            batch_ops: over.batch_ops.or(self.batch_ops),
        }
    }

    /// The option keys of the knobs (device options: changing one on
    /// resume changes no result).
    pub const KEYS: [&'static str; 4] = ["staging_depth", "staging_chunk_mib", "copy_threads", "batch_ops"];

    pub fn is_set(&self) -> bool {
        *self != TransportKnobs::default()
    }

    /// The flags that are set, as the user wrote them.
    pub fn flags_set(&self) -> Vec<&'static str> {
        [
            ("--staging-depth", self.staging_depth.is_some()),
            ("--staging-chunk-mib", self.staging_chunk_mib.is_some()),
            ("--copy-threads", self.copy_threads.is_some()),
            ("--batch-ops", self.batch_ops.is_some()),
        ]
        .into_iter()
        .filter_map(|(f, on)| on.then_some(f))
        .collect()
    }

    /// Refuses 0 and absurd values, naming the flag and the value.
    pub fn validate(&self) -> Result<()> {
        in_range(
            "staging-depth",
            self.staging_depth,
            1,
            MAX_STAGING_DEPTH,
            " entries",
        )?;
        in_range(
            "staging-chunk-mib",
            self.staging_chunk_mib,
            1,
            MAX_STAGING_CHUNK_MIB,
            " MiB",
        )?;
        in_range("copy-threads", self.copy_threads, 1, MAX_COPY_THREADS, " threads")?;
        in_range("batch-ops", self.batch_ops, 1, MAX_BATCH_OPS, " ops")
    }

    /// Refuses the knobs on an executor without a transport (the CPU).
    pub fn refuse_on_cpu(&self) -> Result<()> {
        let set = self.flags_set();
        if set.is_empty() {
            return Ok(());
        }
        Err(RunError::Config(format!(
            "{} {} GPU transport option{}, but --device cpu moves no layers through a transport \
             (leave {} out, or use --device gpu)",
            set.join(", "),
            if set.len() == 1 { "is a" } else { "are" },
            if set.len() == 1 { "" } else { "s" },
            if set.len() == 1 { "it" } else { "them" },
        )))
    }

    /// Refuses a staging chunk larger than one buffer of the adapter.
    pub fn check_adapter(&self, max_buffer_size: u64) -> Result<()> {
        match self.staging_chunk_mib {
            Some(m) if m << 20 > max_buffer_size => Err(RunError::option(
                "staging-chunk-mib",
                m,
                format!(
                    "larger than the adapter's largest buffer ({} MiB)",
                    max_buffer_size >> 20
                ),
            )),
            _ => Ok(()),
        }
    }

    /// GPU executor options with these knobs and `transport`.
    pub fn gpu_options(&self, transport: TransportChoice) -> GpuOptions {
        GpuOptions {
            transport,
            staging_depth: self.staging_depth,
            staging_chunk_bytes: self.staging_chunk_mib.map(|m| m << 20),
            copy_threads: self.copy_threads,
            batch_ops: self.batch_ops,
            ..GpuOptions::default()
        }
    }
}

/// `--transfer-chunk` in bytes of f32 gradients as elements (the trainer's
/// unit): positive, whole elements, at most [`MAX_TRANSFER_CHUNK`].
pub fn transfer_chunk_elems(bytes: u64) -> Result<usize> {
    if bytes == 0 || !bytes.is_multiple_of(4) || bytes > MAX_TRANSFER_CHUNK {
        return Err(RunError::option(
            "transfer-chunk",
            bytes,
            format!(
                "must be a positive multiple of 4 bytes (whole f32 gradients), at most {} GiB",
                MAX_TRANSFER_CHUNK >> 30
            ),
        ));
    }
    usize::try_from(bytes / 4)
        .map_err(|_| RunError::option("transfer-chunk", bytes, "too large for this machine"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_flag() {
        let k = |d, c, t| TransportKnobs {
            staging_depth: d,
            staging_chunk_mib: c,
            copy_threads: t,
            batch_ops: None,
        };
        assert!(k(Some(1), Some(1), Some(1)).validate().is_ok());
        assert!(k(None, None, None).validate().is_ok());
        for (knobs, needle) in [
            (k(Some(0), None, None), "--staging-depth 0"),
            (k(Some(65), None, None), "--staging-depth 65"),
            (k(None, Some(0), None), "--staging-chunk-mib 0"),
            (k(None, Some(1 << 20), None), "--staging-chunk-mib 1048576"),
            (k(None, None, Some(0)), "--copy-threads 0"),
            (k(None, None, Some(100_000)), "--copy-threads 100000"),
        ] {
            let e = knobs.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        let e = k(None, Some(512), None)
            .check_adapter(256 << 20)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--staging-chunk-mib 512") && e.contains("256 MiB"),
            "{e}"
        );
        let e = k(Some(2), None, Some(3)).refuse_on_cpu().unwrap_err().to_string();
        assert!(
            e.contains("--staging-depth, --copy-threads are") && e.contains("--device cpu"),
            "{e}"
        );
        assert!(k(None, None, None).refuse_on_cpu().is_ok());
    }

    #[test]
    fn transfer_chunk_is_whole_f32_elements() {
        assert_eq!(transfer_chunk_elems(16 << 20).unwrap(), 4 << 20);
        assert_eq!(transfer_chunk_elems(4).unwrap(), 1);
        for bad in [0, 6, (16 << 30) + 4] {
            let e = transfer_chunk_elems(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("--transfer-chunk {bad}")), "{e}");
        }
    }

    #[test]
    fn knobs_reach_the_gpu_options() {
        let o = TransportKnobs {
            staging_depth: Some(8),
            staging_chunk_mib: Some(16),
            copy_threads: Some(3),
            batch_ops: Some(5),
        }
        .gpu_options(TransportChoice::Staging);
        assert_eq!(o.staging_depth, Some(8));
        assert_eq!(o.staging_chunk_bytes, Some(16 << 20));
        assert_eq!(o.copy_threads, Some(3));
        assert_eq!(o.batch_ops, Some(5));
        assert_eq!(o.transport, TransportChoice::Staging);
    }

    #[test]
    fn flags_override_the_file_which_overrides_the_run() {
        let run = TransportKnobs {
            staging_depth: Some(2),
            copy_threads: Some(5),
            ..TransportKnobs::default()
        };
        let flags = TransportKnobs {
            copy_threads: Some(7),
            batch_ops: Some(1),
            ..TransportKnobs::default()
        };
        let k = run.overridden_by(flags);
        assert_eq!(
            (k.staging_depth, k.staging_chunk_mib, k.copy_threads, k.batch_ops),
            (Some(2), None, Some(7), Some(1))
        );
    }

    #[test]
    fn the_knobs_are_top_level_keys_of_a_runs_options() {
        use crate::run::TrainOptions;
        let dir = std::env::temp_dir();
        let o = TrainOptions::default()
            .overlay_toml("staging-depth = 3\nbatch-ops = 9\n", &dir.join("knobs.toml"))
            .unwrap();
        assert_eq!((o.knobs.staging_depth, o.knobs.batch_ops), (Some(3), Some(9)));
        let json = serde_json::to_value(&o).unwrap();
        for key in TransportKnobs::KEYS {
            assert!(json.get(key).is_some(), "{key} not top level in {json}");
        }
        // Options saved before `batch_ops` existed still load.
        let mut old = json.clone();
        old.as_object_mut().unwrap().remove("batch_ops");
        let back: TrainOptions = serde_json::from_value(old).unwrap();
        assert_eq!(back.knobs.batch_ops, None);
        assert_eq!(back.knobs.staging_depth, Some(3));
    }
}
