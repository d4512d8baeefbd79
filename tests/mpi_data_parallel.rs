//! Data parallel training under `mpirun` on one machine (CPU executor,
//! shared-memory transport only): N ranks × batch b train exactly what one
//! rank with batch N·b trains, with a replicated or a sharded optimizer; a
//! checkpoint saved by some number of ranks resumes with another; ranks
//! started with different settings refuse to start; a killed rank ends the
//! job and leaves the last checkpoint loadable.
//!
//! Needs Open MPI's `mpirun` (the `mpi` feature's CI installs it).
#![cfg(feature = "mpi")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One job at a time: each rank already has the two cores to itself.
static MPI_JOBS: Mutex<()> = Mutex::new(());

// At lr 1e-3 (nanoGPT's) the runs agree to rounding (about 1e-8) over the
// 10 steps; at 3e-3 on this tiny repetitive corpus gpt2-nano's steps
// amplify those rounding differences about 8-fold per step from step 7,
// so a higher rate would test the dynamics' sensitivity, not the reduction.
const LOSS_RTOL: f64 = 1e-6;
const PARAM_RTOL: f64 = 1e-5;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_megatrain")
}

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--oversubscribe",
        "--mca",
        "btl",
        "self,vader",
        "-np",
        &np.to_string(),
    ])
    // CI runs as root; Open MPI refuses that unless told twice.
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    // More ranks than cores: one thread each keeps them from thrashing.
    .env("RAYON_NUM_THREADS", "1");
    c
}

fn check(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn corpus(dir: &Path) -> PathBuf {
    let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n\
                First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\n\
                Resolved. resolved.\n"
        .repeat(20);
    let p = dir.join("corpus.txt");
    std::fs::write(&p, text).unwrap();
    p
}

fn train_args(preset: &str, data: &Path, out: &Path, batch: usize, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--preset",
        preset,
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--seq-len",
        "16",
        "--steps",
        "10",
        "--lr",
        "1e-3",
        "--warmup",
        "2",
        "--eval-every",
        "5",
        "--eval-batches",
        "2",
        "--save-every",
        "0",
        "--device",
        "cpu",
        "--quiet",
        "--batch",
        &batch.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// `train --resume run` up to `steps`, on the CPU, quietly.
fn resume_args(run: &Path, steps: u64) -> Vec<String> {
    [
        "train",
        "--resume",
        run.to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--device",
        "cpu",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run_alone(args: &[String]) -> Output {
    check(
        Command::new(bin())
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .unwrap(),
        "megatrain alone",
    )
}

fn run_mpi(np: usize, args: &[String]) -> Output {
    run_mpi_env(np, args, &[])
}

fn run_mpi_env(np: usize, args: &[String], env: &[(&str, &str)]) -> Output {
    let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = mpirun(np);
    c.envs(env.iter().copied());
    check(c.arg(bin()).args(args).output().unwrap(), "mpirun")
}

/// `(step, loss or val_loss)` of every metrics line that has it.
/// `key`'s value at each step that logged it; `grad_norms/i` is layer i's
/// gradient norm.
fn metric(run: &Path, key: &str) -> Vec<(u64, f64)> {
    let get = |v: &Value| match key.split_once('/') {
        Some((k, i)) => v.get(k)?.get(i.parse::<usize>().ok()?)?.as_f64(),
        None => v.get(key)?.as_f64(),
    };
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()?, get(&v)?)))
        .collect()
}

/// Every f32 tensor of a safetensors file.
fn tensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(_, t)| t.dtype() == safetensors::Dtype::F32)
        .map(|(n, t)| {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, v)
        })
        .collect()
}

fn latest(run: &Path) -> PathBuf {
    let name = std::fs::read_to_string(run.join("latest")).unwrap();
    run.join(name.trim())
}

/// Compares two runs: losses of the steps both logged (relative `loss_rtol`),
/// and the latest checkpoint's parameters: relative L2 distance over the
/// whole model ≤ `PARAM_RTOL`. (Per tensor would not do: GPT-2's key bias
/// has an exactly zero gradient in exact arithmetic, so Adam turns rounding
/// noise into lr-sized steps there, in any two runs that sum differently.)
fn assert_same_run_within(a: &Path, b: &Path, what: &str, loss_rtol: f64) {
    // The gradient norm catches a wrongly scaled sum, which Adam's update
    // alone would hide (it is nearly scale-invariant). It follows the
    // parameters' rounding drift (see below) more closely than the loss
    // does: 1e-5 at least, far below a factor of the ranks.
    // So do the layers' norms, which a sharded optimizer sums over ranks.
    for key in ["loss", "val_loss", "grad_norm", "grad_norms/0", "grad_norms/1"] {
        let (la, lb) = (metric(a, key), metric(b, key));
        let lb: BTreeMap<u64, f64> = lb.into_iter().collect();
        let rtol = match key.starts_with("grad_norm") {
            true => loss_rtol.max(1e-5),
            false => loss_rtol,
        };
        let mut compared = 0;
        for (step, x) in la {
            if let Some(y) = lb.get(&step) {
                let rel = (x - y).abs() / x.abs().max(1e-12);
                assert!(
                    rel <= rtol,
                    "{what}: {key} at step {step}: {x} vs {y} (rel {rel:.2e})"
                );
                compared += 1;
            }
        }
        assert!(
            compared > 0 || key.starts_with("grad_norm"),
            "{what}: no common {key} steps"
        );
    }
    let (pa, pb) = (
        tensors(&latest(a).join("model.safetensors")),
        tensors(&latest(b).join("model.safetensors")),
    );
    assert_eq!(
        pa.keys().collect::<Vec<_>>(),
        pb.keys().collect::<Vec<_>>(),
        "{what}"
    );
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (name, x) in &pa {
        let y = &pb[name];
        assert_eq!(x.len(), y.len(), "{what}: {name}");
        diff += x
            .iter()
            .zip(y)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>();
        norm += x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
    }
    let rel = (diff / norm).sqrt();
    assert!(
        rel <= PARAM_RTOL,
        "{what}: parameters differ by {rel:.2e} (relative L2)"
    );
}

fn assert_same_run(a: &Path, b: &Path, what: &str) {
    assert_same_run_within(a, b, what, LOSS_RTOL);
}

/// N ranks × batch 2 against one rank × batch 2N, for one model and
/// optimizer mode.
fn ranks_equal_one_rank(preset: &str, np: usize, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    run_alone(&train_args(preset, &data, &one, 2 * np, extra));
    run_mpi(np, &train_args(preset, &data, &many, 2, extra));
    assert_same_run(&one, &many, &format!("{preset}, {np} ranks, {extra:?}"));
    // Each step counts the tokens of all ranks.
    assert_eq!(metric(&many, "step_tokens"), metric(&one, "step_tokens"));
    assert!(metric(&many, "ranks").iter().all(|&(_, r)| r == np as f64));
}

#[test]
fn gpt2_nano_two_and_three_ranks_equal_one_rank() {
    ranks_equal_one_rank("gpt2-nano", 2, &[]);
    ranks_equal_one_rank("gpt2-nano", 3, &[]);
}

#[test]
fn llama_tiny_two_and_three_ranks_equal_one_rank() {
    ranks_equal_one_rank("llama-tiny", 2, &[]);
    ranks_equal_one_rank("llama-tiny", 3, &[]);
}

#[test]
fn sharded_optimizer_equals_one_rank() {
    for (preset, np) in [
        ("gpt2-nano", 2),
        ("gpt2-nano", 3),
        ("llama-tiny", 2),
        ("llama-tiny", 3),
    ] {
        ranks_equal_one_rank(preset, np, &["--shard-optimizer", "true"]);
    }
}

#[test]
fn accumulation_and_clipping_across_ranks() {
    let held = ["--grad-accum", "2", "--grad-clip", "0.5"];
    ranks_equal_one_rank("gpt2-nano", 2, &held);
    // Clipping without accumulation: held gradients, one micro-batch.
    ranks_equal_one_rank(
        "gpt2-nano",
        3,
        &["--grad-clip", "0.5", "--shard-optimizer", "true"],
    );
    let sharded = [&held[..], &["--shard-optimizer", "true"]].concat();
    ranks_equal_one_rank("llama-tiny", 3, &sharded);
}

/// Gradients reduced in chunks of 1021 elements (`--transfer-chunk 4084`:
/// smaller than every layer, so chunks straddle the shard boundaries and
/// some ranks own nothing of a chunk) train the bits that whole-layer
/// reductions train (the default chunk is larger than every layer here),
/// replicated and sharded, with held gradients and without.
#[test]
fn chunked_reduction_equals_whole_layers() {
    let held: &[&str] = &["--grad-accum", "2"];
    let clip: &[&str] = &["--grad-clip", "0.5", "--precision", "bf16"];
    for (np, extra) in [(2, &[][..]), (3, held), (2, clip), (3, &[][..])] {
        for shard in ["false", "true"] {
            let dir = tempfile::tempdir().unwrap();
            let data = corpus(dir.path());
            let (whole, chunked) = (dir.path().join("whole"), dir.path().join("chunked"));
            let extra = [extra, &["--shard-optimizer", shard]].concat();
            run_mpi(np, &train_args("llama-tiny", &data, &whole, 2, &extra));
            let small = [&extra[..], &["--transfer-chunk", "4084"]].concat();
            run_mpi(np, &train_args("llama-tiny", &data, &chunked, 2, &small));
            let what = format!("{np} ranks, {extra:?}");
            for key in ["loss", "val_loss"] {
                assert_eq!(metric(&whole, key), metric(&chunked, key), "{what}: {key}");
            }
            // The norm's squares are added per chunk the optimizer updates:
            // in another order, the same to f64 rounding.
            let (a, b) = (metric(&whole, "grad_norm"), metric(&chunked, "grad_norm"));
            assert_eq!(a.len(), b.len(), "{what}: grad_norm");
            for ((sa, x), (sb, y)) in a.iter().zip(&b) {
                assert!(
                    sa == sb && (x - y).abs() <= 1e-12 * x,
                    "{what}: grad_norm at {sa}: {x} vs {y}"
                );
            }
            let (a, b) = (
                tensors(&latest(&whole).join("model.safetensors")),
                tensors(&latest(&chunked).join("model.safetensors")),
            );
            assert!(!a.is_empty() && a == b, "{what}: parameters differ");
        }
    }
}

/// bf16 transport copies are all-gathered as 16-bit words. A rounding-level
/// difference of a master weight can move its bf16 copy by one step
/// (2^-8 relative), so the loss is compared at 1e-4, not 1e-6: a wrong
/// gather would be off by far more.
#[test]
fn sharded_optimizer_gathers_bf16_transport() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    let extra = ["--precision", "bf16", "--shard-optimizer", "true"];
    run_alone(&train_args("llama-tiny", &data, &one, 4, &extra));
    run_mpi(2, &train_args("llama-tiny", &data, &many, 2, &extra));
    assert_same_run_within(&one, &many, "bf16 transport, 2 ranks", 1e-4);
}

/// Masked (instruction) data: ranks count different numbers of targets, and
/// the loss is the mean over all of them, not the mean of rank means.
#[test]
fn unequal_counted_targets_across_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = String::new();
    for i in 0..40 {
        let answer = "yes ".repeat(1 + i % 7);
        lines.push_str(&format!(
            "{{\"instruction\": \"Question {i}: is it so?\", \"input\": \"\", \"output\": \"{answer}\"}}\n"
        ));
    }
    let data = dir.path().join("sft.jsonl");
    std::fs::write(&data, lines).unwrap();
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    // Windows of the stream: rows of 16 tokens from a record's start would
    // end inside its prompt.
    let extra = ["--shard-optimizer", "true", "--rows", "stream"];
    run_alone(&train_args("llama-tiny", &data, &one, 6, &extra));
    run_mpi(3, &train_args("llama-tiny", &data, &many, 2, &extra));
    assert_same_run(&one, &many, "jsonl, 3 ranks");
}

/// `--rows packed`: each rank packs its rows of the global batch as one
/// rank packs all of them (short conversations, about four a row of 64).
#[test]
fn packed_rows_across_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = String::new();
    for i in 0..40 {
        let answer = "yes ".repeat(1 + i % 7);
        lines.push_str(&format!(
            "{{\"messages\": [{{\"role\": \"user\", \"content\": \"Q{i}?\"}}, \
             {{\"role\": \"assistant\", \"content\": \"{answer}\"}}]}}\n"
        ));
    }
    let data = dir.path().join("chat.jsonl");
    std::fs::write(&data, lines).unwrap();
    let template = dir.path().join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )
    .unwrap();
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    let extra = [
        "--rows",
        "packed",
        "--tokenizer",
        "byte",
        "--chat-template",
        template.to_str().unwrap(),
    ];
    let mut alone = train_args("llama-tiny", &data, &one, 4, &extra);
    let mut ranks = train_args("llama-tiny", &data, &many, 2, &extra);
    for a in [&mut alone, &mut ranks] {
        set(a, &[("--seq-len", "64")]);
    }
    run_alone(&alone);
    run_mpi(2, &ranks);
    assert_same_run(&one, &many, "packed rows, 2 ranks");
}

/// 10 steps in one go on one rank; 5 steps on 2 ranks, then the rest on 1
/// rank, and (from a copy of the same checkpoint) on 3 ranks.
#[test]
fn checkpoint_of_two_ranks_resumes_on_one_and_on_three() {
    for shard in ["false", "true"] {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let sched = ["--decay-steps", "10", "--shard-optimizer", shard];
        let whole = dir.path().join("whole");
        run_alone(&train_args("gpt2-nano", &data, &whole, 6, &sched));

        let two = dir.path().join("two");
        let mut first = train_args("gpt2-nano", &data, &two, 3, &sched);
        let at = first.iter().position(|a| a == "--steps").unwrap();
        first[at + 1] = "5".into();
        run_mpi(2, &first);
        let three = dir.path().join("three");
        check(
            Command::new("cp")
                .arg("-r")
                .arg(&two)
                .arg(&three)
                .output()
                .unwrap(),
            "cp",
        );
        let resume = |run: &Path| resume_args(run, 10);
        run_alone(&resume(&two));
        run_mpi(3, &resume(&three));
        assert_same_run(&whole, &two, &format!("2 ranks then 1, shard {shard}"));
        assert_same_run(&whole, &three, &format!("2 ranks then 3, shard {shard}"));

        // 4 ranks cannot share the run's global batch of 6.
        let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
        let out = mpirun(4).arg(bin()).args(resume(&three)).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("--ranks 4: does not divide the run's global batch of 6"),
            "{err}"
        );
    }
}

/// A sharded optimizer over layers spilled to disk (each rank reads and
/// writes only its page-aligned shard of its spill files): 2 ranks train
/// what one process with the global batch trains in RAM, and their
/// checkpoint resumes on 3 ranks, still sharded and spilling.
#[test]
fn sharded_optimizer_over_spilled_layers_equals_one_rank_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let whole = dir.path().join("whole");
    run_alone(&train_args(
        "llama-tiny",
        &data,
        &whole,
        6,
        &["--decay-steps", "10"],
    ));
    // Each rank counts its share of the transport copies its machine's
    // ranks map together (~0.5 MB: 0.26 MB on 2 ranks, 0.17 MB on 3) and of
    // p, m, v: layers 1.. spill on 2 ranks, 2.. on 3 (`megatrain plan
    // --preset llama-tiny --ranks N --host-budget 600K`).
    let spill = [
        "--decay-steps",
        "10",
        "--shard-optimizer",
        "true",
        "--host-budget",
        "600K",
    ];
    let run = dir.path().join("two-then-three");
    let mut first = train_args("llama-tiny", &data, &run, 3, &spill);
    set(&mut first, &[("--steps", "5")]);
    run_mpi(2, &first);
    run_mpi(3, &resume_args(&run, 10));
    assert_same_run(&whole, &run, "sharded over spilled layers, 2 ranks then 3");
    let spilled = metric(&run, "spill_read_bytes");
    assert!(
        spilled.len() == 10 && spilled.iter().all(|&(_, b)| b > 0.0),
        "every step reads its shard of the spill files: {spilled:?}"
    );
    let left = std::fs::read_dir(run.join("spill")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "spill files left behind");
}

/// A machine's ranks map one transport copy (the default): they train the
/// bits that ranks holding a copy each train, on one machine and split
/// into two machines of two ranks (sharded, the ranks with the same index
/// all-gather between them; replicated, each writes its peers' ranges),
/// and leave no file behind in `--shm-dir`. A `--shm-dir` that cannot
/// hold the file ends every rank with an error that names it where sharing
/// was asked for, and otherwise each holds a copy and says why.
#[test]
fn ranks_sharing_one_transport_copy_train_as_ranks_holding_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let sharded = ["--shard-optimizer", "true", "--precision", "bf16"];
    let replicated = ["--shard-optimizer", "false", "--precision", "bf16"];
    for (np, per, mode) in [(2, "2", sharded), (4, "2", sharded), (4, "2", replicated)] {
        let (own, shared) = (
            dir.path().join(format!("own{np}{}", mode[1])),
            dir.path().join(format!("shared{np}{}", mode[1])),
        );
        let mut a = train_args("llama-tiny", &data, &own, 2, &mode);
        a.extend(["--share-transport", "false"].map(String::from));
        run_mpi(np, &a);
        let mut b = train_args("llama-tiny", &data, &shared, 2, &mode);
        b.extend(["--shm-dir", shm.to_str().unwrap()].map(String::from));
        run_mpi_env(np, &b, &[("MEGATRAIN_RANKS_PER_MACHINE", per)]);
        let what = format!("{np} ranks, machines of {per}, {mode:?}");
        for key in ["loss", "val_loss"] {
            assert_eq!(metric(&own, key), metric(&shared, key), "{what}: {key}");
        }
        let (x, y) = (
            tensors(&latest(&own).join("model.safetensors")),
            tensors(&latest(&shared).join("model.safetensors")),
        );
        assert!(!x.is_empty() && x == y, "{what}: parameters differ");
        assert_eq!(
            std::fs::read_dir(&shm).unwrap().count(),
            0,
            "{what}: a file left in --shm-dir"
        );
    }
    // A --shm-dir that cannot hold the file: asked for, the ranks stop and
    // name it; by default they hold a copy each, train the same, and say why.
    let missing = dir.path().join("no-such-shm");
    let job = |out: &str, share: &str| {
        let mut c = train_args("llama-tiny", &data, &dir.path().join(out), 2, &sharded);
        c.retain(|a| a != "--quiet");
        c.extend(["--shm-dir", missing.to_str().unwrap(), "--share-transport", share].map(String::from));
        let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
        mpirun(2).arg(bin()).args(&c).output().unwrap()
    };
    let out = job("refused", "true");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--shm-dir") && err.contains(missing.to_str().unwrap()),
        "{err}"
    );
    let out = job("fell-back", "auto");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("transport copies: one per rank (") && err.contains(missing.to_str().unwrap()),
        "{err}"
    );
    let fell_back = dir.path().join("fell-back");
    assert_eq!(
        metric(&dir.path().join("own2true"), "loss"),
        metric(&fell_back, "loss")
    );
}

#[test]
fn ranks_with_different_settings_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let out = dir.path().join("run");
    let a = train_args("gpt2-nano", &data, &out, 2, &[]);
    let mut b = a.clone();
    let at = b.iter().position(|x| x == "--lr").unwrap();
    b[at + 1] = "2e-3".into();
    let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let res = mpirun(1)
        .arg(bin())
        .args(&a)
        .arg(":")
        .args(["-np", "1", bin()])
        .args(&b)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("rank 1 was started with settings different from rank 0's: options.lr: 0.001 on rank 0, 0.002 on rank 1"),
        "{err}"
    );
    // Nothing ran: no step was logged and no checkpoint written.
    assert!(!out.join("metrics.jsonl").exists() && !out.join("latest").exists());
}

/// Gives each flag `k` of `args` the value `v`.
fn set(args: &mut [String], flags: &[(&str, &str)]) {
    for (k, v) in flags {
        let at = args.iter().position(|a| a == k).unwrap();
        args[at + 1] = v.to_string();
    }
}

/// Rank `rank`'s process among `mpirun`'s children.
fn rank_pid(mpirun: u32, rank: usize) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = stat.rsplit(')').next().unwrap_or("");
        let ppid: Option<u32> = after.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        if ppid != Some(mpirun) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        if env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn a_killed_rank_ends_the_job_and_the_last_checkpoint_stays_valid() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let run = dir.path().join("run");
    let mut args = train_args("gpt2-nano", &data, &run, 2, &["--shard-optimizer", "true"]);
    set(
        &mut args,
        &[
            ("--steps", "100000"),
            ("--save-every", "1"),
            ("--eval-every", "0"),
        ],
    );
    let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let mut job = mpirun(2)
        .arg(bin())
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !run.join("latest").exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "no checkpoint within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Rank 0 writes the checkpoints: kill it while it keeps saving.
    std::thread::sleep(Duration::from_millis(300));
    let pid = rank_pid(job.id(), 0).expect("rank 0 among mpirun's children");
    let killed = Instant::now();
    check(
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .output()
            .unwrap(),
        "kill",
    );
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the job still runs 30 s after a rank was killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(job.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("signal 9"),
        "mpirun should name the killed rank's signal: {err}"
    );
    assert!(rank_pid(job.id(), 1).is_none(), "rank 1 outlived the job");

    // The checkpoint `latest` names is complete: one more step from it runs.
    let before = latest(&run);
    let step: u64 = before.file_name().unwrap().to_str().unwrap()["ckpt-".len()..]
        .parse()
        .unwrap();
    check(
        Command::new(bin())
            .args(resume_args(&run, step + 1))
            .output()
            .unwrap(),
        "resume after the kill",
    );
    assert_eq!(latest(&run), run.join(format!("ckpt-{}", step + 1)));
}

#[test]
fn sigterm_to_one_rank_stops_all_after_the_same_step_with_a_checkpoint_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let run = dir.path().join("run");
    let mut args = train_args("gpt2-nano", &data, &run, 2, &[]);
    set(
        &mut args,
        &[
            ("--steps", "100000"),
            ("--save-every", "0"),
            ("--eval-every", "0"),
        ],
    );
    let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let job = mpirun(2)
        .arg(bin())
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let logged = || std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    while logged() < 3 {
        assert!(t.elapsed() < Duration::from_secs(60), "no steps within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Rank 1 alone hears it; rank 0, which saves, learns it in the step's
    // agreement.
    let pid = rank_pid(job.id(), 1).expect("rank 1 among mpirun's children");
    check(
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .output()
            .unwrap(),
        "kill",
    );
    let out = job.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let last = metric(&run, "loss").last().unwrap().0;
    assert_eq!(latest(&run), run.join(format!("ckpt-{last}")), "{err}");
    assert!(
        err.contains(&format!("interrupted by SIGTERM after step {last}")),
        "{err}"
    );
    assert!(
        !err.contains("MPI_ABORT"),
        "the ranks stopped together, not by abort: {err}"
    );
}
