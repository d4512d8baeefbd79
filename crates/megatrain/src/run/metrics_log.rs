//! `metrics.jsonl`: one JSON object per step (and one per evaluation that
//! falls on no step), appended and flushed as they come.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{Result, RunError};

pub const METRICS_FILE: &str = "metrics.jsonl";

pub struct MetricsLog {
    path: PathBuf,
    file: File,
    /// Every record so far (for the loss plot).
    records: Vec<Value>,
}

impl MetricsLog {
    /// Opens `run/metrics.jsonl`. When resuming at `keep_until`, lines of
    /// later steps (logged after the checkpoint by a run that was then
    /// stopped) are dropped, so the file reads as one uninterrupted run.
    pub fn open(run: &Path, keep_until: Option<u64>) -> Result<Self> {
        let path = run.join(METRICS_FILE);
        let mut records = Vec::new();
        if let Some(last) = keep_until
            && path.exists()
        {
            let text = std::fs::read_to_string(&path).map_err(RunError::io(&path))?;
            let mut kept = String::new();
            for line in text.lines() {
                // A line cut short by a kill is not JSON; drop it.
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                if v.get("step").and_then(Value::as_u64).is_some_and(|s| s <= last) {
                    kept.push_str(line);
                    kept.push('\n');
                    records.push(v);
                }
            }
            megatrain_tier::atomic::write_atomic(&path, kept.as_bytes())?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .truncate(false)
            .open(&path)
            .map_err(RunError::io(&path))?;
        if keep_until.is_none() {
            file.set_len(0).map_err(RunError::io(&path))?;
        }
        Ok(MetricsLog { path, file, records })
    }

    pub fn append(&mut self, record: Value) -> Result<()> {
        let mut line = serde_json::to_string(&record).expect("JSON value");
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(RunError::io(&self.path))?;
        self.records.push(record);
        Ok(())
    }

    pub fn records(&self) -> &[Value] {
        &self.records
    }
}
