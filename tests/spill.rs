//! The disk tier: a run whose host budget spills most layers equals an
//! all-RAM run bit for bit (the optimizer updates spilled layers through
//! the read-ahead / write-behind window, several layers deep), and a full
//! disk — simulated with RLIMIT_FSIZE in a child process, which works
//! without root — ends the run with a clear error that keeps the previous
//! checkpoint.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::cli::{bin, corpus};
use megatrain::data::Batch;
use megatrain::trainer::{Trainer, TrainerConfig};
use megatrain_tensor::CpuExecutor;
use megatrain_tier::{CHUNK_ALIGN, TierConfig, TransportDType, WindowConfig, padded_bytes};
use megatrain_zoo::ModelConfig;

/// A budget that keeps the transport copies and the first `keep` layers'
/// p/m/v (and gradients) in RAM.
fn budget_keeping(model: &ModelConfig, transport: TransportDType, hold: bool, keep: usize) -> u64 {
    let tables = model.layer_tables();
    let t: u64 = tables
        .iter()
        .map(|t| padded_bytes(t.numel(), transport.size_in_bytes()))
        .sum();
    let per = if hold { 4 } else { 3 };
    t + tables[..keep]
        .iter()
        .map(|t| per * padded_bytes(t.numel(), 4))
        .sum::<u64>()
}

struct Run {
    trainer: Trainer<CpuExecutor>,
    _spill: Option<tempfile::TempDir>,
}

fn run(
    transport: TransportDType,
    hold: bool,
    clip: Option<f64>,
    budget: Option<u64>,
    window: WindowConfig,
    keep: usize,
    defer: bool,
) -> Run {
    let model = common::llama_tiny(8);
    let spill = budget.map(|_| tempfile::tempdir().unwrap());
    let tier_config = TierConfig {
        shard: None,
        transport,
        hold_grads: hold,
        grads_on_device: Vec::new(),
        ram_budget_bytes: budget,
        // A directory that does not exist yet: the tier creates it.
        spill_dir: spill.as_ref().map(|d| d.path().join("spill")),
        shared_transport: None,
    };
    let config = TrainerConfig {
        optimizer_queue: 2,
        keep_activations: keep,
        defer_clipped_updates: defer,
        ..common::k2_config(clip)
    };
    let mut trainer = common::trainer(CpuExecutor::new(), &model, tier_config, 77, config);
    trainer.set_spill_window(window);
    Run {
        trainer,
        _spill: spill,
    }
}

type State = Vec<(Vec<u32>, Vec<u32>, Vec<u32>, Vec<u8>, u64)>;

fn state(t: &Trainer<CpuExecutor>) -> State {
    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    t.tier()
        .layers()
        .iter()
        .map(|s| {
            (
                bits(s.params()),
                bits(s.m()),
                bits(s.v()),
                s.transport().as_bytes().to_vec(),
                s.step(),
            )
        })
        .collect()
}

#[test]
fn spilled_run_equals_all_ram_run_bit_for_bit() {
    let model = common::llama_tiny(8);
    let n_layers = model.layer_tables().len();
    // 32 Ki-element chunks: a block of llama-tiny is two chunks, so a
    // window of 6 chunk sets holds about three layers.
    let window = WindowConfig {
        chunk_elems: CHUNK_ALIGN,
        depth: 6,
    };
    let cases = [
        // (transport, hold, clip, micro-batches, blocks the spilled run
        // keeps from forward to backward: its updates come in the same
        // order, sooner; clipped updates deferred into the next forward,
        // in the RAM run always)
        (TransportDType::F32, false, None, 1, 0, true),
        (TransportDType::BF16, false, None, 1, 0, true),
        (TransportDType::F32, true, None, 2, 0, true),
        (TransportDType::BF16, true, Some(0.05), 1, 0, true),
        (TransportDType::BF16, true, Some(0.05), 1, 0, false),
        (TransportDType::F32, true, Some(0.05), 2, 3, true),
        (TransportDType::BF16, false, None, 1, 8, true),
        (TransportDType::F32, true, None, 2, 3, true),
    ];
    for (transport, hold, clip, micro, keep, defer) in cases {
        let label =
            format!("{transport:?} hold {hold} clip {clip:?} micro {micro} kept {keep} defer {defer}");
        let budget = budget_keeping(&model, transport, hold, 3);
        let mut ram = run(transport, hold, clip, None, window, 0, true);
        let mut disk = run(transport, hold, clip, Some(budget), window, keep, defer);
        // Deferred, a step's spilled updates run in the next one's forward.
        let deferred = clip.is_some() && defer;
        let report = disk.trainer.tier().report();
        let spilled = disk
            .trainer
            .tier()
            .layers()
            .iter()
            .filter(|s| s.is_spilled())
            .count();
        assert_eq!(report.first_spilled, Some(3), "{label}");
        assert!(
            2 * spilled >= n_layers,
            "{label}: only {spilled} of {n_layers} spilled"
        );
        let spilled_bytes: u64 = disk
            .trainer
            .tier()
            .layers()
            .iter()
            .filter(|s| s.is_spilled())
            .map(|s| 3 * padded_bytes(s.numel(), 4))
            .sum();
        for step in 0..3u64 {
            let batches: Vec<Batch> = (0..micro)
                .map(|k| common::TRAINER_STREAM.batch(256, step * 2 + k, 2, 9))
                .collect();
            let a = ram.trainer.step(&batches, 2e-3).unwrap();
            let b = disk.trainer.step(&batches, 2e-3).unwrap();
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{label} step {step}");
            assert_eq!((a.spill_read_bytes, a.spill_written_bytes), (0, 0));
            let moved = if deferred && step == 0 { 0 } else { spilled_bytes };
            assert_eq!(b.spill_read_bytes, moved, "{label} step {step}");
            assert_eq!(b.spill_written_bytes, moved, "{label} step {step}");
            assert_eq!(b.spill_disk_ms > 0.0 && b.spill_gb_s > 0.0, moved > 0, "{label}");
            assert!(b.spill_wait_ms >= 0.0);
            assert_eq!(a.grad_norm.map(f64::to_bits), b.grad_norm.map(f64::to_bits));
        }
        // Clipping leaves its last updates to the next step, unless told
        // to update after the backward: the same bits once settled.
        ram.trainer.settle().unwrap();
        assert_eq!(disk.trainer.carried_layers() > 0, deferred, "{label}");
        disk.trainer.settle().unwrap();
        assert_eq!(disk.trainer.carried_layers(), 0, "{label}");
        assert!(
            state(&ram.trainer) == state(&disk.trainer),
            "{label}: states differ"
        );
        assert!(
            disk.trainer.tier().layers().iter().all(|s| s.step() == 3),
            "{label}"
        );
    }
}

// ---- a full disk, through the binary --------------------------------------

/// Runs `megatrain` with RLIMIT_FSIZE = `limit` bytes (and SIGXFSZ ignored,
/// so writing past it fails with EFBIG instead of killing the process).
fn megatrain_limited(args: &[&str], limit: Option<u64>) -> Output {
    let mut cmd = bin();
    cmd.args(args);
    #[cfg(unix)]
    if let Some(limit) = limit {
        use std::os::unix::process::CommandExt;
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let r = libc::rlimit {
                    rlim_cur: limit as libc::rlim_t,
                    rlim_max: limit as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.output().unwrap()
}

fn train_args<'a>(data: &'a str, out: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "train",
        "--preset",
        "llama-tiny",
        "--data",
        data,
        "--device",
        "cpu",
        "--quiet",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        steps,
        "--save-every",
        "1",
        "--eval-every",
        "0",
        "--out",
        out,
        // Transport copies (~0.5 MB) plus the embedding: the blocks and
        // the head spill.
        "--host-budget",
        "800K",
    ];
    v.extend_from_slice(extra);
    v
}

fn no_spill_files_left(run: &Path) {
    let spill = run.join("spill");
    if spill.exists() {
        let left: Vec<_> = std::fs::read_dir(&spill).unwrap().collect();
        assert!(left.is_empty(), "spill files left: {left:?}");
    }
}

#[cfg(unix)]
#[test]
fn the_cli_spills_and_a_full_disk_is_a_clear_error_that_keeps_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let out = tmp.path().join("run");
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());

    // No room even for the spill files: refused at start, before training.
    let r = megatrain_limited(&train_args(d, o, "2", &[]), Some(64 << 10));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("disk is full"), "{err}");
    assert!(err.contains("megatrain-spill-"), "names the spill file: {err}");
    // Nothing is left: the run directory it made (and the spill
    // directory in it) go again.
    assert!(!out.exists(), "a refused run left {}", out.display());

    // Step 1 with room: the spill directory is created, a checkpoint saved.
    let r = megatrain_limited(&train_args(d, o, "1", &[]), None);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let ckpt1 = out.join("ckpt-1");
    let model1 = std::fs::read(ckpt1.join("model.safetensors")).unwrap();
    let optim1 = std::fs::read(ckpt1.join("optimizer.safetensors")).unwrap();
    no_spill_files_left(&out);

    // Resume with room for the spill files (≤ 200 KB each) but not for a
    // checkpoint file (the model file alone is ~530 KB): step 2 trains,
    // its checkpoint fails, and the run stops with a clear error.
    let limit = 300 << 10;
    assert!(model1.len() as u64 > limit);
    let r = megatrain_limited(&["train", "--resume", o, "--steps", "2", "--quiet"], Some(limit));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "saving past the limit must fail");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("disk is full"), "{err}");
    assert!(err.contains("ckpt-2"), "{err}");
    assert!(
        err.contains("'latest' still names") && err.contains("ckpt-1"),
        "{err}"
    );
    // The previous checkpoint stands, unchanged, and is still the latest;
    // the failed one is gone.
    assert_eq!(
        std::fs::read_to_string(out.join("latest")).unwrap().trim(),
        "ckpt-1"
    );
    assert_eq!(std::fs::read(ckpt1.join("model.safetensors")).unwrap(), model1);
    assert_eq!(
        std::fs::read(ckpt1.join("optimizer.safetensors")).unwrap(),
        optim1
    );
    assert!(!out.join("ckpt-2").exists());
    no_spill_files_left(&out);

    // With room again the run resumes from it and finishes.
    let r = megatrain_limited(&["train", "--resume", o, "--steps", "2", "--quiet"], None);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("ckpt-2").join("checkpoint.json").exists());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(last["spill_read_bytes"].as_u64().unwrap() > 0, "{last}");
    assert_eq!(last["spill_read_bytes"], last["spill_written_bytes"]);
}

#[test]
fn plan_estimates_the_disk_time_of_a_step() {
    // llama-2-7b, bf16: 12.55 GiB of transport copies, so a 14G budget
    // keeps a little p/m/v in RAM and spills most layers.
    let out = megatrain_limited(
        &[
            "plan",
            "--preset",
            "llama-2-7b",
            "--precision",
            "bf16",
            "--host-budget",
            "14G",
            "--disk-gbps",
            "2",
            "--carry-layers",
            "3",
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().find(|l| l.starts_with("disk: layers")).expect(&text);
    assert!(
        line.contains("layers 0..34 past --host-budget 14.00 GiB"),
        "{line}"
    );
    // Carried layers must be in RAM: none here, as `train` would say.
    assert!(
        text.contains("--carry-layers 3 reaches layer 0, which --host-budget spills: train refuses it"),
        "{text}"
    );
    assert!(text.contains("nothing can be carried"), "{text}");
    let time = text
        .lines()
        .find(|l| l.contains("of disk time per step"))
        .expect(&text);
    assert!(time.contains("2.00 GB/s read, 2.00 GB/s write (given)"), "{time}");
    // Seconds = 2 × spilled bytes / 2 GB/s: about 77 GB each way here.
    let secs: f64 = time
        .split("): ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect(time);
    assert!((60.0..90.0).contains(&secs), "{time}");
    let bad = megatrain_limited(
        &[
            "plan",
            "--preset",
            "llama-tiny",
            "--host-budget",
            "1M",
            "--disk-gbps",
            "0",
        ],
        None,
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--disk-gbps 0"));
}

/// `--spill-window` changes how much is read ahead, never the result: a
/// run with the smallest window (two chunks) ends with the same bytes as
/// one with the default; a window smaller than that is refused, named.
#[cfg(unix)]
#[test]
fn the_spill_window_flag_changes_no_result_and_a_tiny_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let d = data.to_str().unwrap();
    let model_after = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let r = megatrain_limited(&train_args(d, out.to_str().unwrap(), "2", extra), None);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        std::fs::read(out.join("ckpt-2").join("model.safetensors")).unwrap()
    };
    let min = (2 * 12 * megatrain_tier::CHUNK_ALIGN).to_string();
    assert_eq!(
        model_after("default", &[]),
        model_after("small", &["--spill-window", &min])
    );

    let out = tmp.path().join("tiny");
    let r = megatrain_limited(
        &train_args(d, out.to_str().unwrap(), "2", &["--spill-window", "100K"]),
        None,
    );
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(err.contains("spill-window") && err.contains("102400"), "{err}");
    assert!(!out.join("latest").exists());
}
