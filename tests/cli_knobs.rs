//! The `megatrain` binary's device knobs and precisions: `train`'s transfer
//! chunk and GPU transport flags are refused out of range (naming the flag
//! and value) and on `--device cpu`, and change no result where accepted;
//! `eval` and `sample` take `--precision` with train's values and meaning.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::cli::{refused, run, s};
use megatrain::data::{ChatTemplate, Sampling, load_tokens};
use megatrain::run::{Encoder, evaluate, resolve_model_dir};
use megatrain::trainer::{Trainer, TrainerConfig, load_tier};
use megatrain_tensor::{ComputePrecision, CpuExecutor, Executor};
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::HfCheckpoint;

fn corpus(dir: &Path) -> PathBuf {
    let p = dir.join("corpus.txt");
    std::fs::write(
        &p,
        "But soft, what light through yonder window breaks?\n".repeat(40),
    )
    .unwrap();
    p
}

/// `train` of gpt2-nano on `data` into `out` on `device`: the flags every
/// run here starts with.
fn nano<'a>(data: &'a Path, out: &'a Path, device: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--preset",
        "gpt2-nano",
        "--data",
        s(data),
        "--out",
        s(out),
        "--device",
        device,
    ]
}

/// Two short steps, no evaluation, quiet: every run here.
const SHORT: [&str; 11] = [
    "--seq-len",
    "16",
    "--batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--eval-every",
    "0",
    "--quiet",
];

fn train(data: &Path, out: &Path, device: &str, extra: &[&str]) -> Output {
    let mut a = nano(data, out, device);
    a.extend_from_slice(&SHORT);
    a.extend_from_slice(extra);
    run(&a)
}

/// The "done:" line's training loss.
fn final_loss(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().find(|l| l.starts_with("done:")).expect("done line");
    line.split("loss ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn bad_knobs_are_named_and_good_ones_change_no_result() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let out = t.join("run");
    let check = |device: &str, extra: &[&str], needles: &[&str]| {
        let mut a = nano(&data, &out, device);
        a.push("--quiet");
        a.extend_from_slice(extra);
        refused(&a, needles);
        assert!(!out.exists(), "a refused run wrote {}", out.display());
    };
    // Range checks come before any adapter is opened: `gpu` needs none here.
    check(
        "gpu",
        &["--transfer-chunk", "0"],
        &["--transfer-chunk 0", "multiple of 4"],
    );
    check(
        "gpu",
        &["--transfer-chunk", "6"],
        &["--transfer-chunk 6", "multiple of 4"],
    );
    check(
        "gpu",
        &["--transfer-chunk", "17G"],
        &["--transfer-chunk 18253611008", "16 GiB"],
    );
    check(
        "gpu",
        &["--transfer-chunk", "lots"],
        &["--transfer-chunk", "lots"],
    );
    check(
        "gpu",
        &["--chunks-in-flight", "5000"],
        &["--chunks-in-flight 5000", "at most 4096"],
    );
    check(
        "gpu",
        &["--optimizer-queue", "0"],
        &["--optimizer-queue 0", "from 1 to 4096"],
    );
    check(
        "gpu",
        &["--optimizer-queue", "5000"],
        &["--optimizer-queue 5000", "from 1 to 4096"],
    );
    check(
        "gpu",
        &["--staging-depth", "0"],
        &["--staging-depth 0", "between 1 and 64"],
    );
    check("gpu", &["--staging-depth", "1000"], &["--staging-depth 1000"]);
    check("gpu", &["--staging-chunk-mib", "0"], &["--staging-chunk-mib 0"]);
    check(
        "gpu",
        &["--staging-chunk-mib", "999999"],
        &["--staging-chunk-mib 999999", "MiB"],
    );
    check("gpu", &["--copy-threads", "0"], &["--copy-threads 0"]);
    check("gpu", &["--copy-threads", "-3"], &["--copy-threads", "-3"]);
    check(
        "gpu",
        &["--batch-ops", "0"],
        &["--batch-ops 0", "between 1 and 65536"],
    );
    check(
        "cpu",
        &["--batch-ops", "8"],
        &["--batch-ops is a GPU transport option"],
    );
    check(
        "cpu",
        &["--staging-depth", "2", "--copy-threads", "4"],
        &[
            "--staging-depth, --copy-threads are GPU transport options",
            "--device cpu",
        ],
    );
    check(
        "cpu",
        &["--staging-chunk-mib", "8"],
        &["--staging-chunk-mib is a GPU transport option"],
    );
    check(
        "cpu",
        &["--seq-len", "16", "--keep-activations", "5"],
        &["--keep-activations 5", "the model has 4 blocks", "`all`"],
    );
    check(
        "cpu",
        &["--keep-activations", "most"],
        &["--keep-activations", "'most'", "`all`"],
    );
    check(
        "cpu",
        &["--carry-layers", "every", "--grad-clip", "1"],
        &[
            "--carry-layers",
            "'every' is neither a number of layers nor 'all'",
        ],
    );
    // 4 MiB keeps the embedding's p, m, v in RAM and spills the rest.
    for (n, carry) in [("all", 6), ("2", 2)] {
        check(
            "cpu",
            &["--seq-len", "16", "--carry-layers", n, "--host-budget", "4M"],
            &[
                &format!("carry_layers ({carry}) reaches layer 1, which the tier spills"),
                "carry at most 1",
            ],
        );
    }
    check(
        "cpu",
        &["--seq-len", "16", "--carry-layers", "7"],
        &["--carry-layers 7", "the model has 6 layers"],
    );
    check(
        "cpu",
        &["--seq-len", "16", "--freeze-layers", "6"],
        &["--freeze-layers 6", "at most 5 (the embedding and the 4 blocks)"],
    );
    check(
        "cpu",
        &["--freeze-layers", "2", "--carry-layers", "1"],
        &["--freeze-layers 2", "cannot be used with --carry-layers"],
    );
    check(
        "cpu",
        &[
            "--carry-layers",
            "2",
            "--carry-order",
            "spread",
            "--grad-clip",
            "1",
        ],
        &["--carry-order spread", "cannot be used with --grad-clip"],
    );
    check(
        "cpu",
        &["--carry-order", "middle"],
        &[
            "--carry-order",
            "unknown carry order 'middle' (expected first or spread)",
        ],
    );
    let toml = t.join("knobs.toml");
    std::fs::write(&toml, "staging-depth = 0\n").unwrap();
    check("gpu", &["--config", s(&toml)], &["--staging-depth 0"]);

    // Gradients coming down 4 KiB at a time train exactly as in one piece.
    let whole = final_loss(&train(&data, &t.join("whole"), "cpu", &[]));
    let chunked = final_loss(&train(
        &data,
        &t.join("chunked"),
        "cpu",
        &["--transfer-chunk", "4K"],
    ));
    assert_eq!(whole, chunked);
    // The first three layers' updates carried into the next step: the same
    // losses, and the last step's updates all in its checkpoint.
    let carried = final_loss(&train(&data, &t.join("carried"), "cpu", &["--carry-layers", "3"]));
    assert_eq!(whole, carried);
    // Two blocks spread over the model's four (the second and the fourth).
    let spread = final_loss(&train(
        &data,
        &t.join("carried-spread"),
        "cpu",
        &["--carry-layers", "2", "--carry-order", "spread"],
    ));
    assert_eq!(whole, spread);
    let all = final_loss(&train(
        &data,
        &t.join("carried-all"),
        "cpu",
        &["--carry-layers", "all"],
    ));
    assert_eq!(whole, all);
    let read = |run: &str, file: &str| std::fs::read(t.join(run).join("ckpt-2").join(file)).unwrap();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        for run in ["carried", "carried-spread", "carried-all"] {
            assert!(
                read("whole", file) == read(run, file),
                "the {run} run's {file} differs"
            );
        }
    }
    // The embedding and the first block frozen: their gradients are not
    // taken (norm 0 in the log), the rest trains.
    let frozen = train(&data, &t.join("frozen"), "cpu", &["--freeze-layers", "2"]);
    assert_ne!(final_loss(&frozen), whole);
    let log = std::fs::read_to_string(t.join("frozen").join("metrics.jsonl")).unwrap();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let norms: Vec<f64> = v["grad_norms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(
            norms[..2] == [0.0, 0.0] && norms[2..].iter().all(|&x| x > 0.0),
            "{line}"
        );
    }
    // Clipping with every layer's gradients on the executor, their norm
    // taken there: where the threshold does not bind, the same training as
    // clipping from gradients held on the host.
    let clip = |run: &str, extra: &[&str]| {
        let mut a = vec!["--grad-clip", "1000", "--grad-accum", "2"];
        a.extend_from_slice(extra);
        final_loss(&train(&data, &t.join(run), "cpu", &a))
    };
    assert_eq!(
        clip("clip-held", &[]),
        clip("clip-carried", &["--carry-layers", "all"])
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            read("clip-held", file) == read("clip-carried", file),
            "the clipping carried run's {file} differs"
        );
    }
    // Every block kept from forward to backward, or the last two: no
    // recompute there, the same training.
    for keep in ["all", "2"] {
        let kept = final_loss(&train(
            &data,
            &t.join(format!("kept-{keep}")),
            "cpu",
            &["--keep-activations", keep],
        ));
        assert_eq!(whole, kept, "--keep-activations {keep}");
    }
}

/// On a GPU adapter (lavapipe in CI): the knobs reach the executor and the
/// run trains; a staging chunk past the adapter's largest buffer is named.
#[test]
fn gpu_knobs_train_on_an_adapter() {
    if common::ctx().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let knobs = [
        "--transport",
        "staging",
        "--staging-depth",
        "2",
        "--staging-chunk-mib",
        "1",
        "--copy-threads",
        "2",
        "--batch-ops",
        "3",
        "--transfer-chunk",
        "64K",
        "--chunks-in-flight",
        "1",
        "--optimizer-queue",
        "1",
    ];
    let on_gpu = final_loss(&train(&data, &t.join("gpu"), "gpu", &knobs));
    let on_cpu = final_loss(&train(&data, &t.join("cpu"), "cpu", &[]));
    let (g, c): (f64, f64) = (on_gpu.parse().unwrap(), on_cpu.parse().unwrap());
    assert!((g - c).abs() <= 1e-3 * c, "GPU loss {g} vs CPU {c}");
    refused(
        &[
            "train",
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--out",
            s(&t.join("big")),
            "--device",
            "gpu",
            "--quiet",
            "--seq-len",
            "16",
            "--staging-chunk-mib",
            "4096",
        ],
        &["--staging-chunk-mib 4096", "largest buffer"],
    );
}

fn eval_loss(model: &Path, data: &Path, precision: &str) -> f64 {
    let out = run(&[
        "eval",
        "--model",
        s(model),
        "--data",
        s(data),
        "--device",
        "cpu",
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--precision",
        precision,
    ]);
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{line}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    line.strip_prefix("loss ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {line:?}"))
}

/// `eval --device cpu --seq-len 16 --batch 4` in process: the run's f16
/// transport copy, matmuls in `compute`.
fn reference_eval(run_dir: &Path, data: &Path, compute: ComputePrecision) -> f64 {
    let dir = resolve_model_dir(run_dir, None).unwrap();
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let mut enc = Encoder::from_dir(&dir, Some(&ckpt.config)).unwrap();
    enc.vocab_limit = Some(ckpt.config.vocab_size);
    let tokens = load_tokens(data, &enc, &ChatTemplate::default()).unwrap();
    let tier = load_tier(
        &ckpt,
        TierConfig {
            transport: TransportDType::F16,
            ..TierConfig::default()
        },
    )
    .unwrap();
    let mut ex = CpuExecutor::new();
    ex.set_compute_precision(compute).unwrap();
    let t = Trainer::new(ex, ckpt.config.clone(), tier, TrainerConfig::default()).unwrap();
    let batches = ((tokens.len() - 1) / (4 * 16)).max(1);
    evaluate(&t, &tokens, data, 4, 16, batches, Sampling::Sequential).unwrap()
}

#[test]
fn eval_and_sample_take_the_precision_of_train() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let run_dir = t.join("run");
    final_loss(&train(&data, &run_dir, "cpu", &[]));

    // The rounding of f16 operands (and of bf16 weights) must show in the
    // loss's 6 printed decimals and stay small.
    let f32_loss = eval_loss(&run_dir, &data, "f32");
    let f16_loss = eval_loss(&run_dir, &data, "f16");
    let bf16_loss = eval_loss(&run_dir, &data, "bf16");
    for (name, l) in [("f16", f16_loss), ("bf16", bf16_loss)] {
        let d = (l - f32_loss).abs();
        assert!(
            d > 0.0,
            "{name} eval loss {l} equals f32's: the precision did not reach the executor"
        );
        assert!(d <= 1e-2 * f32_loss, "{name} eval loss {l} vs f32 {f32_loss}");
    }
    // The CLI's f16 is the CPU reference with f16 weights *and* f16
    // operands; f16 weights alone give another loss.
    let f16_weights_only = reference_eval(&run_dir, &data, ComputePrecision::F32);
    assert_eq!(
        format!("{f16_loss:.6}"),
        format!("{:.6}", reference_eval(&run_dir, &data, ComputePrecision::F16))
    );
    assert_ne!(format!("{f16_loss:.6}"), format!("{f16_weights_only:.6}"));
    refused(
        &[
            "eval",
            "--model",
            s(&run_dir),
            "--data",
            s(&data),
            "--precision",
            "fp8",
        ],
        &["--precision", "fp8", "f16"],
    );

    let sample = |precision: &str| {
        let out = run(&[
            "sample",
            "--model",
            s(&run_dir),
            "--prompt",
            "But soft",
            "--tokens",
            "12",
            "--precision",
            precision,
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    for p in ["f32", "bf16", "f16"] {
        let text = sample(p);
        assert!(
            text.starts_with("But soft") && text.chars().count() >= 20,
            "{p}: {text:?}"
        );
    }
    refused(
        &["sample", "--model", s(&run_dir), "--precision", "f64"],
        &["--precision", "f64", "bf16"],
    );
}

/// With updates carried into the next step, a run that evaluates and
/// samples after every step reads every update: the same validation losses
/// and samples as a run that carries none.
#[test]
fn carried_updates_are_settled_before_evaluating_and_sampling() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let records = |name: &str, extra: &[&str]| {
        let out = t.join(name);
        let mut a = nano(&data, &out, "cpu");
        a.extend_from_slice(&[
            "--seq-len",
            "16",
            "--batch",
            "2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--eval-every",
            "1",
            "--eval-batches",
            "2",
            "--sample-every",
            "2",
            "--sample-tokens",
            "8",
            "--quiet",
        ]);
        a.extend_from_slice(extra);
        let o = run(&a);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["loss"].clone(), v["val_loss"].clone(), v["sample"].clone())
            })
            .collect::<Vec<_>>()
    };
    let plain = records("plain", &[]);
    let carried = records("carried", &["--carry-layers", "6"]);
    assert!(plain.iter().filter(|r| r.1.is_number()).count() >= 3, "{plain:?}");
    assert!(plain.iter().any(|r| r.2.is_string()), "{plain:?}");
    assert_eq!(plain, carried);
}

/// `train` of `hf` (char tokens) on `data` into `out`, two steps, with
/// `extra`.
fn hf_args(hf: &Path, data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let model = [
        "train",
        "--model",
        s(hf),
        "--tokenizer",
        "char",
        "--data",
        s(data),
        "--out",
        s(out),
    ];
    let cpu = ["--device", "cpu"];
    model
        .iter()
        .chain(&cpu)
        .chain(&SHORT)
        .chain(extra)
        .map(|x| x.to_string())
        .collect()
}

fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

/// `--dropout-from-config` trains with the rates a model's `config.json`
/// gives transformers (GPT-2's pdrops here), says which, and keeps them
/// in the run's options; refused beside a rate of its own, on a config
/// whose rates megatrain cannot follow (naming the file) and on resume.
#[test]
fn dropout_is_taken_from_the_models_config() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let model = megatrain_zoo::gpt2_nano(65);
    let tables = model.layer_tables();
    let slabs: Vec<Vec<f32>> = tables
        .iter()
        .map(|t| (0..t.numel()).map(|i| ((i % 13) as f32 - 6.0) * 1e-3).collect())
        .collect();
    let hf = t.join("hf");
    let refs: Vec<&[f32]> = slabs.iter().map(Vec::as_slice).collect();
    megatrain_zoo::export_hf_dir(&hf, &model, &tables, &refs, Default::default()).unwrap();
    let config = hf.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    v["resid_pdrop"] = 0.1.into();
    v["embd_pdrop"] = 0.1.into();
    v["attn_pdrop"] = 0.05.into();
    std::fs::write(&config, v.to_string()).unwrap();
    let (out, named) = (t.join("run"), t.join("named"));
    refused(
        &strs(&hf_args(
            &hf,
            &data,
            &out,
            &["--dropout-from-config", "--dropout", "0.2"],
        )),
        &["--dropout-from-config", "without --dropout (0.2)"],
    );
    let o = run(&strs(&hf_args(&hf, &data, &out, &["--dropout-from-config"])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let state = std::fs::read_to_string(out.join("ckpt-2").join("train_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    let opts = &state["options"];
    assert_eq!(
        (opts["dropout"].as_f64(), opts["attn_dropout"].as_f64()),
        (Some(0.1), Some(0.05)),
        "{opts}"
    );
    assert_eq!(opts["dropout_from_config"], false);
    // Against a run with the rates named: the same losses.
    let o = run(&strs(&hf_args(
        &hf,
        &data,
        &named,
        &["--dropout", "0.1", "--attn-dropout", "0.05"],
    )));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let losses = |dir: &Path| {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&out), losses(&named));
    refused(
        &[
            "train",
            "--resume",
            s(&out),
            "--steps",
            "3",
            "--dropout-from-config",
            "--quiet",
        ],
        &["--dropout-from-config", "not on --resume"],
    );
    v["embd_pdrop"] = 0.2.into();
    std::fs::write(&config, v.to_string()).unwrap();
    refused(
        &strs(&hf_args(&hf, &data, &t.join("other"), &["--dropout-from-config"])),
        &["config.json", "embd_pdrop 0.2 and resid_pdrop 0.1 differ"],
    );
}

/// `MEGATRAIN_EMBEDDING`: an untied embedding's step on the rows its ids
/// look up (`rows`, the default) or on the whole table (`whole`) saves the
/// same checkpoint byte for byte; another value is refused by name before
/// the run writes anything.
#[test]
fn the_embeddings_rows_alone_train_as_the_whole_table_through_the_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let train = |out: &str, embedding: &str| {
        let out = t.join(out);
        let mut a = vec![
            "train",
            "--preset",
            "llama-tiny",
            "--data",
            s(&data),
            "--out",
            s(&out),
            "--device",
            "cpu",
        ];
        a.extend_from_slice(&SHORT);
        common::cli::bin()
            .args(&a)
            .env(megatrain::trainer::EMBEDDING_ENV, embedding)
            .output()
            .unwrap()
    };
    let rows = final_loss(&train("rows", "rows"));
    let whole = final_loss(&train("whole", "whole"));
    assert_eq!(rows, whole);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let read = |run: &str| std::fs::read(t.join(run).join("ckpt-2").join(file)).unwrap();
        assert!(read("rows") == read("whole"), "{file} differs");
    }
    let out = train("bogus", "columns");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("MEGATRAIN_EMBEDDING=columns: expected rows or whole"),
        "{err}"
    );
    assert!(!t.join("bogus").join("ckpt-2").exists());
}
