//! TensorBoard event files: the bytes of TensorBoard's own writer
//! (`tools/make_tensorboard_golden.py`), a run's file holding what its
//! `metrics.jsonl` holds (a resume's superseding the lines past its
//! checkpoint, as TensorBoard reads the files), and `megatrain tensorboard`
//! converting a run afterwards.

use crate::common;

use std::path::{Path, PathBuf};

use common::cli::{corpus, refused, run as run_bin, s};
use megatrain::run::tensorboard::{
    Entry, ReadEvent, convert, entry_record, event_files, read_events, version_record,
};
use megatrain::run::{Every, METRICS_FILE, QuietProgress, TrainOptions, latest_checkpoint, prepare, train};
use megatrain_tier::write_latest;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tensorboard")
        .join(name)
}

#[test]
fn events_are_tensorboards_own_bytes() {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap();
    let golden = std::fs::read(fixture("golden.tfevents")).unwrap();
    let mut ours = version_record(
        spec["version_wall_time"].as_f64().unwrap(),
        "tensorboard.summary.writer.event_file_writer",
    );
    let mut wanted = Vec::new();
    for e in spec["events"].as_array().unwrap() {
        let entry = match e["kind"].as_str().unwrap() {
            "start" => Entry::Start,
            "scalars" => Entry::Scalars(
                e["values"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|tv| {
                        let v: f64 = tv[1].as_str().unwrap().parse().unwrap();
                        (tv[0].as_str().unwrap().to_string(), v as f32)
                    })
                    .collect(),
            ),
            "text" => Entry::Text {
                tag: e["tag"].as_str().unwrap().into(),
                text: e["text"].as_str().unwrap().into(),
            },
            k => panic!("unknown kind {k}"),
        };
        let (t, step) = (e["wall_time"].as_f64().unwrap(), e["step"].as_u64().unwrap());
        ours.extend(entry_record(t, step, &entry));
        wanted.push((t, step, entry));
    }
    assert!(ours == golden, "our bytes differ from TensorBoard's writer's");
    // And they read back (NaN compared by its bits).
    let path = std::env::temp_dir().join(format!("megatrain-golden-{}.tfevents", std::process::id()));
    std::fs::write(&path, &golden).unwrap();
    let read = read_events(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(read[0].entry, None);
    assert_eq!(read.len(), wanted.len() + 1);
    for (r, (t, step, entry)) in read[1..].iter().zip(&wanted) {
        assert_eq!((r.wall_time, r.step), (*t, *step));
        assert_eq!(format!("{:?}", r.entry.as_ref().unwrap()), format!("{entry:?}"));
    }
}

#[test]
fn a_file_that_is_not_whole_or_not_true_is_read_up_to_its_end_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let golden = std::fs::read(fixture("golden.tfevents")).unwrap();
    let p = dir.path().join("events.out.tfevents.cut");
    // Cut short inside the last record: the whole records before it.
    let whole = read_events(&fixture("golden.tfevents")).unwrap().len();
    std::fs::write(&p, &golden[..golden.len() - 3]).unwrap();
    assert_eq!(read_events(&p).unwrap().len(), whole - 1);
    // A flipped bit in a record's data is named by the record's offset.
    let mut bad = golden.clone();
    bad[20] ^= 1;
    std::fs::write(&p, &bad).unwrap();
    let e = read_events(&p).unwrap_err().to_string();
    assert!(e.contains("record at byte 0") && e.contains("CRC"), "{e}");
}

fn options(data: &Path, out: &Path) -> TrainOptions {
    TrainOptions {
        preset: Some("gpt2-nano".into()),
        data: vec![data.to_path_buf()],
        seq_len: 16,
        batch: 3,
        steps: 6,
        lr: 3e-3,
        warmup: 2,
        eval_every: Every::Steps(2),
        eval_batches: 2,
        sample_every: Every::Steps(3),
        sample_tokens: 6,
        save_every: Every::Steps(4),
        tensorboard: true,
        out: out.to_path_buf(),
        ..TrainOptions::default()
    }
}

fn train_run(opts: TrainOptions, resume: bool) {
    let mut p = prepare(opts, resume).unwrap();
    train(
        megatrain_tensor::CpuExecutor::new(),
        &mut p,
        None,
        &mut QuietProgress,
    )
    .unwrap();
}

/// What TensorBoard shows of a run directory's event files: read in name
/// order, a start at step S dropping what was read at or past S.
fn shown(run: &Path) -> Vec<ReadEvent> {
    let mut out: Vec<ReadEvent> = Vec::new();
    for f in event_files(run).unwrap() {
        for e in read_events(&f).unwrap() {
            match e.entry {
                Some(Entry::Start) => out.retain(|x| x.step < e.step),
                Some(_) => out.push(e),
                None => {}
            }
        }
    }
    out
}

/// Per step, the train and validation losses and the sample of
/// `metrics.jsonl`, as f32 where TensorBoard holds f32.
type Logged = Vec<(u64, Option<f32>, Option<f32>, Option<String>)>;

fn from_metrics(run: &Path) -> Logged {
    std::fs::read_to_string(run.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            assert!(v["time"].as_f64().unwrap() > 1.7e9, "{v}");
            (
                v["step"].as_u64().unwrap(),
                v.get("loss").and_then(Value::as_f64).map(|x| x as f32),
                v.get("val_loss").and_then(Value::as_f64).map(|x| x as f32),
                v.get("sample").and_then(Value::as_str).map(String::from),
            )
        })
        .collect()
}

fn from_events(events: &[ReadEvent]) -> Logged {
    let mut out: Logged = Vec::new();
    for e in events {
        if out.last().is_none_or(|l| l.0 != e.step) {
            out.push((e.step, None, None, None));
        }
        let row = out.last_mut().unwrap();
        match e.entry.as_ref().unwrap() {
            Entry::Scalars(v) => {
                let get = |tag: &str| v.iter().find(|(t, _)| t == tag).map(|(_, x)| *x);
                row.1 = get("loss/train");
                row.2 = get("loss/val");
            }
            Entry::Text { tag, text } => {
                assert_eq!(tag, "sample");
                row.3 = Some(text.clone());
            }
            Entry::Start => unreachable!(),
        }
    }
    out
}

#[test]
fn a_run_logs_what_metrics_jsonl_holds_and_a_resume_supersedes_the_steps_past_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let run = tmp.path().join("run");
    train_run(options(&data, &run), false);
    let logged = from_metrics(&run);
    assert_eq!(logged.len(), 7, "{logged:?}");
    assert!(
        logged[3].3.is_some() && logged[6].3.is_some(),
        "samples at 3 and 6"
    );
    assert_eq!(from_events(&shown(&run)), logged);
    let first = event_files(&run).unwrap();
    assert_eq!(first.len(), 1);
    let events = read_events(&first[0]).unwrap();
    assert_eq!(events[1].entry, Some(Entry::Start));
    assert_eq!(events[1].step, 0);

    // As if the run had been killed while saving step 6: its checkpoint
    // gone, its steps 5 and 6 logged. The resume logs them again.
    std::fs::remove_dir_all(run.join("ckpt-6")).unwrap();
    write_latest(&run, "ckpt-4").unwrap();
    assert!(latest_checkpoint(&run).unwrap().ends_with("ckpt-4"));
    let mut o = options(&data, &run);
    o.steps = 8;
    train_run(o, true);
    let files = event_files(&run).unwrap();
    assert_eq!(files.len(), 2);
    let second = read_events(files.iter().find(|f| **f != first[0]).unwrap()).unwrap();
    assert_eq!((second[1].entry.clone(), second[1].step), (Some(Entry::Start), 5));
    let logged = from_metrics(&run);
    assert_eq!(logged.len(), 9);
    assert_eq!(from_events(&shown(&run)), logged);
    // Without the starts' dropping, steps 5 and 6 would show twice.
    let all: usize = files
        .iter()
        .map(|f| read_events(f).unwrap().iter().filter(|e| e.step == 5).count())
        .sum();
    assert!(all > 2, "{all}");
}

#[test]
fn a_run_without_tensorboard_converts_afterwards_once() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let run = tmp.path().join("run");
    let mut o = options(&data, &run);
    o.tensorboard = false;
    train_run(o, false);
    assert!(event_files(&run).unwrap().is_empty());
    let logged = from_metrics(&run);
    let c = convert(&run, &run).unwrap();
    assert_eq!((c.records, c.steps), (7, (0, 6)));
    assert_eq!(from_events(&shown(&run)), logged);
    // Each event at its record's time.
    let times: Vec<f64> = std::fs::read_to_string(run.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["time"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let read = read_events(&c.path).unwrap();
    let mut at: Vec<f64> = read[2..].iter().map(|e| e.wall_time).collect();
    at.dedup();
    assert_eq!(at, times);
    let e = convert(&run, &run).unwrap_err().to_string();
    assert!(
        e.contains("already here") && e.contains(&*c.path.to_string_lossy()),
        "{e}"
    );

    // A log from before records had their time: times from the file's,
    // spaced as the records' elapsed_s. A last line cut short is skipped;
    // a bad line elsewhere is named.
    let old = tmp.path().join("old");
    std::fs::create_dir_all(&old).unwrap();
    let lines = "{\"step\":0,\"tokens\":0,\"val_loss\":4.0}\n{\"step\":1,\"loss\":3.5,\"elapsed_s\":1.0}\n\
                 {\"step\":2,\"loss\":3.0,\"elapsed_s\":3.5}\n{\"step\":3,\"lo";
    std::fs::write(old.join(METRICS_FILE), lines).unwrap();
    let c = convert(&old, &tmp.path().join("tb")).unwrap();
    assert_eq!((c.records, c.steps), (3, (0, 2)));
    let read = read_events(&c.path).unwrap();
    let t: Vec<f64> = read[2..].iter().map(|e| e.wall_time).collect();
    assert!(
        (t[2] - t[1] - 2.5).abs() < 1e-6 && (t[1] - t[0] - 1.0).abs() < 1e-6,
        "{t:?}"
    );
    std::fs::write(old.join(METRICS_FILE), "{\"step\":0}\nnot json\n{\"step\":1}\n").unwrap();
    let e = convert(&old, &tmp.path().join("tb2")).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl: line 2"), "{e}");
    std::fs::write(old.join(METRICS_FILE), "").unwrap();
    let e = convert(&old, &tmp.path().join("tb3")).unwrap_err().to_string();
    assert!(e.contains("no records"), "{e}");
}

#[test]
fn the_binary_writes_and_converts_event_files() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let a = t.join("a");
    let args = [
        "train",
        "--preset",
        "gpt2-nano",
        "--data",
        s(&data),
        "--out",
        s(&a),
        "--device",
        "cpu",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--quiet",
        "--tensorboard",
        "--z-loss",
        "1e-4",
        "--label-smoothing",
        "0.1",
    ];
    let out = run_bin(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(event_files(&a).unwrap().len(), 1);
    assert_eq!(from_events(&shown(&a)), from_metrics(&a));
    // The z-loss and the smoothed loss are logged beside the loss, and
    // shown under their own tags.
    let log = std::fs::read_to_string(a.join(METRICS_FILE)).unwrap();
    for (key, tag) in [("z_loss", "loss/z"), ("smoothed_loss", "loss/smoothed")] {
        let z: Vec<f64> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).unwrap()[key].as_f64())
            .collect();
        assert!(z.len() == 3 && z.iter().all(|&x| x > 0.0), "{key}: {z:?}");
        let shown_z = shown(&a)
            .iter()
            .filter(|e| matches!(&e.entry, Some(Entry::Scalars(v)) if v.iter().any(|(t, _)| t == tag)))
            .count();
        assert_eq!(shown_z, 3, "{tag}");
    }
    refused(&["tensorboard", "--run", s(&a)], &["already here", "tfevents"]);
    refused(
        &["tensorboard", "--run", s(&t.join("nothing"))],
        &["nothing/metrics.jsonl", "No such file"],
    );
    let out = run_bin(&["tensorboard", "--run", s(&a), "--out", s(&t.join("tb"))]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("3 records, steps 1..3"),
        "{said}"
    );
    assert_eq!(from_events(&shown(&t.join("tb"))), from_metrics(&a));
}
