//! A signal that arrives while a step computes skips that step's
//! evaluation and goes straight to its checkpoint: a cloud machine's notice
//! before it is taken back may not leave time for both. Its own test
//! binary: the signal is the process's.

use std::path::Path;

use megatrain::run::{Every, Progress, TrainOptions, interrupt, prepare, train};
use megatrain_tensor::CpuExecutor;
use serde_json::Value;

/// Raises SIGTERM as step `at` is reported, so that it is pending through
/// the next step.
struct RaiseAfter(u64);

impl Progress for RaiseAfter {
    fn step(&mut self, record: &Value) {
        if record["step"].as_u64() == Some(self.0) {
            // SAFETY: raise(3) on this process; the handler only stores to
            // an atomic.
            assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        }
    }
}

fn records(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[cfg(unix)]
#[test]
fn a_signal_during_a_step_skips_its_evaluation_and_saves_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("corpus.txt");
    std::fs::write(
        &data,
        "All the world's a stage, and all the men and women merely players.\n".repeat(40),
    )
    .unwrap();
    let out = tmp.path().join("run");
    let opts = TrainOptions {
        preset: Some("gpt2-nano".into()),
        data: vec![data],
        seq_len: 16,
        batch: 2,
        steps: 10,
        warmup: 1,
        eval_every: Every::Steps(1),
        eval_batches: 2,
        save_every: Every::Steps(0),
        out: out.clone(),
        ..TrainOptions::default()
    };
    interrupt::install();
    let mut p = prepare(opts, false).unwrap();
    let summary = train(CpuExecutor::new(), &mut p, None, &mut RaiseAfter(2)).unwrap();
    assert_eq!((summary.step, summary.interrupted), (3, Some(libc::SIGTERM)));
    let recs: Vec<Value> = records(&out)
        .into_iter()
        .filter(|r| r.get("loss").is_some())
        .collect();
    assert_eq!(recs.len(), 3);
    // Steps 1 and 2 were evaluated (every step is due); step 3, under way
    // when the signal came, was saved without it.
    assert!(recs[..2].iter().all(|r| r.get("val_loss").is_some()), "{recs:?}");
    assert!(recs[2].get("val_loss").is_none(), "{:?}", recs[2]);
    assert_eq!(summary.checkpoint, Some(out.join("ckpt-3")));
    assert!(out.join("ckpt-3").join("checkpoint.json").exists());
}
