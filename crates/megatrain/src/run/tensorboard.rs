//! TensorBoard event files: `train --tensorboard` writes one beside
//! `metrics.jsonl` as the run goes, and `megatrain tensorboard RUN` writes
//! one from a run's `metrics.jsonl` afterwards; `tensorboard --logdir`
//! reads either (several runs under one directory show as several runs).
//!
//! A file is TFRecords of `tensorflow.Event` protos: the version line
//! first, then a `SessionLog` START at the first step this process logs
//! (TensorBoard drops the events at or past it from the run's earlier
//! files, as `metrics.jsonl` drops the lines past a resumed checkpoint),
//! then one event per `metrics.jsonl` record. The protos are the handful
//! of fields these events use, with TensorBoard's field numbers; the bytes
//! equal TensorBoard's own writer's (`tests/tensorboard.rs`, against a file
//! `tools/make_tensorboard_golden.py` wrote with it).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;
use serde_json::Value;

use super::error::{Result, RunError};

/// What every event file's name holds (TensorBoard lists files by it).
pub const EVENTS_MARK: &str = "tfevents";
const FILE_VERSION: &str = "brain.Event:2";
const WRITER: &str = "megatrain";
/// TensorFlow's `DT_STRING`.
const DT_STRING: i32 = 7;
/// `SessionLog.START`.
const START: i32 = 1;

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    session_log: Option<SessionLog>,
    #[prost(message, optional, tag = "10")]
    source_metadata: Option<SourceMetadata>,
}

#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    #[prost(int32, tag = "1")]
    status: i32,
}

#[derive(Clone, PartialEq, Message)]
struct SourceMetadata {
    #[prost(string, tag = "1")]
    writer: String,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `Summary.Value`: a scalar (`simple_value`) or a tensor with the plugin
/// that shows it (text). The two are a oneof in TensorBoard's proto; one of
/// them is set here.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
}

#[derive(Clone, PartialEq, Message)]
struct TensorProto {
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, Message)]
struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    dim: Vec<Dim>,
}

#[derive(Clone, PartialEq, Message)]
struct Dim {
    #[prost(int64, tag = "1")]
    size: i64,
}

/// What one event says.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// A (re)start at the event's step: TensorBoard forgets what the run's
    /// earlier files logged at or past it.
    Start,
    /// Scalars, by tag.
    Scalars(Vec<(String, f32)>),
    /// A text (the text plugin's `<tag>/text_summary`).
    Text { tag: String, text: String },
}

/// One TFRecord: the length, its masked CRC-32C, the data, its masked
/// CRC-32C (little-endian).
fn tf_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's mask of a CRC-32C (a CRC of data holding CRCs is otherwise
/// weak).
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The record that opens a file, naming its writer.
pub fn version_record(wall_time: f64, writer: &str) -> Vec<u8> {
    let e = Event {
        wall_time,
        file_version: Some(FILE_VERSION.into()),
        source_metadata: Some(SourceMetadata {
            writer: writer.into(),
        }),
        ..Event::default()
    };
    tf_record(&e.encode_to_vec())
}

/// The record of `entry` at `step`.
pub fn entry_record(wall_time: f64, step: u64, entry: &Entry) -> Vec<u8> {
    let mut e = Event {
        wall_time,
        step: i64::try_from(step).unwrap_or(i64::MAX),
        ..Event::default()
    };
    match entry {
        Entry::Start => e.session_log = Some(SessionLog { status: START }),
        Entry::Scalars(values) => {
            let value = values
                .iter()
                .map(|(tag, v)| SummaryValue {
                    tag: tag.clone(),
                    simple_value: Some(*v),
                    ..SummaryValue::default()
                })
                .collect();
            e.summary = Some(Summary { value });
        }
        Entry::Text { tag, text } => {
            let v = SummaryValue {
                tag: format!("{tag}/text_summary"),
                tensor: Some(TensorProto {
                    dtype: DT_STRING,
                    tensor_shape: Some(TensorShape {
                        dim: vec![Dim { size: 1 }],
                    }),
                    string_val: vec![text.as_bytes().to_vec()],
                }),
                metadata: Some(SummaryMetadata {
                    plugin_data: Some(PluginData {
                        plugin_name: "text".into(),
                    }),
                }),
                ..SummaryValue::default()
            };
            e.summary = Some(Summary { value: vec![v] });
        }
    }
    tf_record(&e.encode_to_vec())
}

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The tags of `metrics.jsonl`'s fields that have names of their own; every
/// other number but the step, the routing digest and the time goes under
/// `detail/`.
const TAGS: [(&str, &str); 9] = [
    ("loss", "loss/train"),
    ("val_loss", "loss/val"),
    ("z_loss", "loss/z"),
    ("smoothed_loss", "loss/smoothed"),
    ("lr", "optim/lr"),
    ("grad_norm", "optim/grad_norm"),
    ("tokens_per_s", "throughput/tokens_per_s"),
    ("step_ms", "throughput/step_ms"),
    ("tokens", "throughput/tokens"),
];
const NOT_SCALARS: [&str; 3] = ["step", "routing", "time"];

/// What a `metrics.jsonl` record shows in TensorBoard: its numbers as
/// scalars (named ones first, in the order of `TAGS`, then the rest by name,
/// then each layer's gradient norm) and its sample as a text. A record
/// without a step shows nothing.
pub fn entries(record: &Value) -> Vec<Entry> {
    let Some(obj) = record.as_object() else {
        return Vec::new();
    };
    let number = |v: &Value| v.as_f64().map(|x| x as f32);
    let mut scalars: Vec<(String, f32)> = TAGS
        .iter()
        .filter_map(|(k, tag)| Some((tag.to_string(), number(obj.get(*k)?)?)))
        .collect();
    let mut rest: Vec<(String, f32)> = obj
        .iter()
        .filter(|(k, _)| !NOT_SCALARS.contains(&k.as_str()) && !TAGS.iter().any(|(n, _)| n == k))
        .filter_map(|(k, v)| Some((format!("detail/{k}"), number(v)?)))
        .collect();
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    scalars.append(&mut rest);
    // Each layer's gradient norm, numbered so that the tags sort in order.
    if let Some(norms) = obj.get("grad_norms").and_then(Value::as_array) {
        let each = norms.iter().enumerate();
        scalars.extend(each.filter_map(|(i, v)| Some((format!("grad_norm/layer_{i:03}"), number(v)?))));
    }
    let mut out = Vec::new();
    if !scalars.is_empty() {
        out.push(Entry::Scalars(scalars));
    }
    if let Some(text) = obj.get("sample").and_then(Value::as_str) {
        out.push(Entry::Text {
            tag: "sample".into(),
            text: text.into(),
        });
    }
    out
}

/// An event file being written; each event reaches the file as it is
/// written (TensorBoard shows a run as it goes).
pub struct EventFile {
    path: PathBuf,
    file: File,
}

impl EventFile {
    /// A new file in `dir` (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`,
    /// `n` the first free), its version line written, then a
    /// [`Entry::Start`] at `first_step`.
    pub fn create(dir: &Path, first_step: u64) -> Result<Self> {
        let t = now();
        let host = hostname();
        let mut n = 0;
        let (path, file) = loop {
            let name = format!(
                "events.out.{EVENTS_MARK}.{}.{host}.{}.{n}",
                t as u64,
                std::process::id()
            );
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
                Err(e) => return Err(RunError::io(&path)(e)),
            }
        };
        let mut f = EventFile { path, file };
        f.put(&version_record(t, WRITER))?;
        f.write(t, first_step, &Entry::Start)?;
        Ok(f)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, wall_time: f64, step: u64, entry: &Entry) -> Result<()> {
        self.put(&entry_record(wall_time, step, entry))
    }

    /// Every entry of a `metrics.jsonl` record, at its step and time (`now`
    /// where it has none).
    pub fn write_record(&mut self, record: &Value) -> Result<()> {
        let Some(step) = record.get("step").and_then(Value::as_u64) else {
            return Ok(());
        };
        let t = record.get("time").and_then(Value::as_f64).unwrap_or_else(now);
        for e in entries(record) {
            self.write(t, step, &e)?;
        }
        Ok(())
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .map_err(RunError::io(&self.path))
    }
}

/// The event files directly in `dir`, by name.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(RunError::io(dir))? {
        let e = e.map_err(RunError::io(dir))?;
        let name = e.file_name();
        if name.to_string_lossy().contains(&format!(".{EVENTS_MARK}.")) && e.path().is_file() {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// An event as [`read_events`] gives it back.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadEvent {
    pub wall_time: f64,
    pub step: u64,
    pub entry: Option<Entry>,
}

/// The events of a file, each record's CRCs checked (a file cut short by a
/// kill ends at its last whole record). The version line reads as an event
/// without an entry.
pub fn read_events(path: &Path) -> Result<Vec<ReadEvent>> {
    let bytes = std::fs::read(path).map_err(RunError::io(path))?;
    let bad = |at: usize, what: &str| RunError::file(path, format!("record at byte {at}: {what}"));
    let mut out = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        if u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes")) != masked_crc(len_bytes) {
            return Err(bad(at, "the length's CRC does not match"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let Some(end) = (at + 12).checked_add(len).filter(|e| e + 4 <= bytes.len()) else {
            break;
        };
        let data = &bytes[at + 12..end];
        if u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes")) != masked_crc(data) {
            return Err(bad(at, "the data's CRC does not match"));
        }
        let e = Event::decode(data).map_err(|e| bad(at, &e.to_string()))?;
        let entry = if e.session_log.is_some_and(|l| l.status == START) {
            Some(Entry::Start)
        } else if let Some(s) = e.summary {
            match s.value.first() {
                Some(v) if v.tensor.is_some() => {
                    let t = v.tensor.as_ref().expect("checked");
                    let text = t
                        .string_val
                        .first()
                        .map(|b| String::from_utf8_lossy(b).into_owned());
                    Some(Entry::Text {
                        tag: v.tag.trim_end_matches("/text_summary").to_string(),
                        text: text.unwrap_or_default(),
                    })
                }
                _ => Some(Entry::Scalars(
                    s.value
                        .into_iter()
                        .filter_map(|v| Some((v.tag, v.simple_value?)))
                        .collect(),
                )),
            }
        } else {
            None
        };
        out.push(ReadEvent {
            wall_time: e.wall_time,
            step: e.step.max(0) as u64,
            entry,
        });
        at = end + 4;
    }
    Ok(out)
}

/// What [`convert`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Converted {
    pub path: PathBuf,
    pub records: usize,
    /// The first and last steps.
    pub steps: (u64, u64),
}

/// An event file in `out` from `run`'s `metrics.jsonl`, refused where
/// `out` already holds one (TensorBoard would show both) or the log has no
/// record. A record without `"time"` (runs before megatrain logged it)
/// takes the file's modification time less its `elapsed_s` behind the
/// last record's. A last line cut short by a kill is skipped, as a resume
/// does; any other line that is not JSON is refused by its number.
pub fn convert(run: &Path, out: &Path) -> Result<Converted> {
    let metrics = run.join(super::METRICS_FILE);
    let text = std::fs::read_to_string(&metrics).map_err(RunError::io(&metrics))?;
    let lines: Vec<&str> = text.lines().collect();
    let mut records = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.get("step").and_then(Value::as_u64).is_some() => records.push(v),
            Ok(_) => {
                return Err(RunError::file(
                    &metrics,
                    format!("line {}: a record without a step", i + 1),
                ));
            }
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => return Err(RunError::file(&metrics, format!("line {}: {e}", i + 1))),
        }
    }
    let (Some(first), Some(last)) = (records.first(), records.last()) else {
        return Err(RunError::file(&metrics, "no records to convert"));
    };
    let steps = (
        first["step"].as_u64().unwrap_or(0),
        last["step"].as_u64().unwrap_or(0),
    );
    let modified = std::fs::metadata(&metrics)
        .and_then(|m| m.modified())
        .map_err(RunError::io(&metrics))?;
    let modified = modified
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let elapsed = |r: &Value| r.get("elapsed_s").and_then(Value::as_f64);
    let last_elapsed = records.iter().rev().find_map(elapsed).unwrap_or(0.0);
    std::fs::create_dir_all(out).map_err(RunError::io(out))?;
    if let Some(existing) = event_files(out)?.first() {
        return Err(RunError::file(
            existing,
            "a TensorBoard event file is already here (TensorBoard would show both): remove it, or give another --out",
        ));
    }
    let mut f = EventFile::create(out, steps.0)?;
    for r in &mut records {
        if r.get("time").is_none() {
            let t = modified - last_elapsed + elapsed(r).unwrap_or(0.0);
            r.as_object_mut()
                .expect("a record with a step is an object")
                .insert("time".into(), serde_json::json!(t));
        }
        f.write_record(r)?;
    }
    Ok(Converted {
        path: f.path().to_path_buf(),
        records: records.len(),
        steps,
    })
}

/// The machine's name for file names (TensorBoard's writers put it there
/// too), `localhost` where it has none; characters a file name should not
/// hold become `_`.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname writes at
    // most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if rc != 0 || name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn crc32c_and_its_mask_match_known_values() {
        // RFC 3720's CRC-32C of 32 zero bytes, and of "123456789".
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // TFRecord's mask of it: rotated right by 15, plus 0xa282ead8.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn a_record_is_named_scalars_then_the_rest_and_its_sample() {
        let r = json!({"step": 5, "loss": 2.5, "lr": 1e-3, "tokens": 100, "step_ms": 3.0,
            "routing": 99, "time": 1.0, "zeta": 1, "alpha": 2, "sample": "hi", "grad_norm": null,
            "grad_norms": [0.5, 0.25]});
        let e = entries(&r);
        let want_scalars = vec![
            ("loss/train".to_string(), 2.5f32),
            ("optim/lr".into(), 1e-3),
            ("throughput/step_ms".into(), 3.0),
            ("throughput/tokens".into(), 100.0),
            ("detail/alpha".into(), 2.0),
            ("detail/zeta".into(), 1.0),
            ("grad_norm/layer_000".into(), 0.5),
            ("grad_norm/layer_001".into(), 0.25),
        ];
        assert_eq!(
            e,
            vec![
                Entry::Scalars(want_scalars),
                Entry::Text {
                    tag: "sample".into(),
                    text: "hi".into()
                }
            ]
        );
        assert!(entries(&json!({"step": 0, "note": "x"})).is_empty());
    }
}
