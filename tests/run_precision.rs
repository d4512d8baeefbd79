//! `--precision f16` on an executor that cannot compute in f16: the run
//! ends before anything is allocated or written, with a message that names
//! the precision and the executor. Every GPU computes f16 (on the SIMT
//! kernel where it has no tensor cores), so the executor here is one told
//! to use tensor cores, which an adapter without cooperative matrices
//! refuses.

use crate::common;

use megatrain::run::{Precision, QuietProgress, TrainOptions, prepare, train};
use megatrain_gpu::{CoopTile, F16Matmul, GpuExecutor, GpuOptions};
use megatrain_tensor::{ComputePrecision, Executor};

#[test]
fn an_executor_without_f16_refuses_the_run_before_it_starts() {
    let Some(ctx) = common::ctx() else { return };
    let forced = || {
        GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                f16_matmul: F16Matmul::Coop(CoopTile::Tile128),
                ..GpuOptions::default()
            },
        )
    };
    if forced().set_compute_precision(ComputePrecision::F16).is_ok() {
        eprintln!(
            "skipping: {} has tensor cores, nothing to refuse",
            forced().name()
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("corpus.txt");
    std::fs::write(&data, "To be, or not to be, that is the question.\n".repeat(20)).unwrap();
    let out = tmp.path().join("run");
    let opts = TrainOptions {
        preset: Some("gpt2-nano".into()),
        data: vec![data],
        seq_len: 8,
        batch: 2,
        steps: 2,
        precision: Precision::F16,
        out: out.clone(),
        ..TrainOptions::default()
    };
    let mut p = prepare(opts, false).unwrap();
    let gpu = forced();
    let name = ctx.info.name.clone();
    let err = train(gpu, &mut p, None, &mut QuietProgress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--precision f16"), "{err}");
    assert!(err.contains(&name), "'{name}' not in: {err}");
    assert!(!out.exists(), "the refused run wrote {}", out.display());
}
