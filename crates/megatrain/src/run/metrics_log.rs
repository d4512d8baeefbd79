//! `metrics.jsonl`: one JSON object per step (and one per evaluation that
//! falls on no step), appended and flushed as they come, each with the
//! time it was logged; with `--tensorboard`, the same in a TensorBoard
//! event file beside it.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{Result, RunError};
use super::tensorboard::{self, EventFile};

pub const METRICS_FILE: &str = "metrics.jsonl";

pub struct MetricsLog {
    path: PathBuf,
    file: File,
    /// Every record so far (for the loss plot).
    records: Vec<Value>,
    events: Option<EventFile>,
}

impl MetricsLog {
    /// Opens `run/metrics.jsonl`. When resuming at `keep_until`, lines of
    /// later steps (logged after the checkpoint by a run that was then
    /// stopped) are dropped, so the file reads as one uninterrupted run.
    /// With `tensorboard`, a new event file too, whose start at the first
    /// step this run logs has TensorBoard drop the same from the earlier
    /// files.
    pub fn open(run: &Path, keep_until: Option<u64>, tensorboard: bool) -> Result<Self> {
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
        let events = match tensorboard {
            true => Some(EventFile::create(run, keep_until.map_or(0, |s| s + 1))?),
            false => None,
        };
        Ok(MetricsLog {
            path,
            file,
            records,
            events,
        })
    }

    /// Appends `record`, with `"time"` (seconds since the Unix epoch) where
    /// it has none.
    pub fn append(&mut self, mut record: Value) -> Result<()> {
        if let Some(obj) = record.as_object_mut() {
            obj.entry("time")
                .or_insert_with(|| serde_json::json!(tensorboard::now()));
        }
        let mut line = serde_json::to_string(&record).expect("JSON value");
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(RunError::io(&self.path))?;
        if let Some(events) = &mut self.events {
            events.write_record(&record)?;
        }
        self.records.push(record);
        Ok(())
    }

    pub fn records(&self) -> &[Value] {
        &self.records
    }
}
