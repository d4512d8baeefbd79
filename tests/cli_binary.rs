//! The `megatrain` binary: bad inputs are named with a non-zero exit and no
//! panic; SIGKILL between saves loses nothing that a resume cannot redo bit
//! for bit; export, sample, eval and plan run end to end.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::cli::{bin, corpus, refused, repeated, run, s, stdout_of};

#[test]
fn a_message_that_says_its_cause_twice_is_caught() {
    let twice =
        "error: /x.txt: No such file or directory (os error 2): No such file or directory (os error 2)";
    assert_eq!(
        repeated(twice).as_deref(),
        Some("No such file or directory (os error 2)")
    );
    assert_eq!(repeated("error: backend: a: b: a: b").as_deref(), Some("a: b"));
    assert_eq!(repeated("error: --lr -1: must be a finite number ≥ 0"), None);
}

/// `train` says how many passes over the data its steps make, or with
/// `--epochs` how many rows a pass is, and runs the steps the passes take.
#[test]
fn train_counts_passes_over_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    // 1,680 characters, a tenth held out: (1,512 − 1) / 16 = 94 windows.
    let said = |out: &str, extra: &[&str]| {
        let mut a = vec![
            "train",
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--device",
            "cpu",
            "--seq-len",
            "16",
            "--batch",
            "4",
            "--eval-every",
            "0",
            "--out",
        ];
        let dir = t.join(out);
        a.push(s(&dir));
        a.extend_from_slice(extra);
        let o = run(&a);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        err
    };
    let e = said("a", &["--steps", "3"]);
    assert!(e.contains("3 steps (0.13 passes of 94 rows)"), "{e}");
    let e = said("b", &["--epochs", "0.1"]);
    // ⌈0.1 × 94 / 4⌉.
    assert!(
        e.contains("3 steps (--epochs 0.1: a pass is 94 rows)") && e.contains("step 3/3"),
        "{e}"
    );
}

#[test]
fn bad_inputs_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let out = t.join("run");
    let base = |extra: &[&str]| {
        let mut v = vec!["train", "--device", "cpu", "--quiet", "--out", s(&out)];
        v.extend_from_slice(extra);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let check = |extra: &[&str], needles: &[&str]| {
        let a = base(extra);
        refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), needles)
    };
    check(
        &["--preset", "gpt2-nano", "--data", "/no/such/file.txt"],
        &["/no/such/file.txt", "No such file"],
    );
    let empty = t.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    check(
        &["--preset", "gpt2-nano", "--data", s(&empty)],
        &["empty.txt: no data"],
    );
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--val-data",
            s(&empty),
        ],
        &["empty.txt: no data"],
    );
    check(&["--preset", "gpt3", "--data", s(&data)], &["gpt3", "gpt2-nano"]);
    check(&["--data", s(&data)], &["--preset"]);
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--seq-len", "4096"],
        &["--seq-len 4096"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--lr", "-1"],
        &["--lr -1"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--beta2", "1.5"],
        &["--beta2 1.5"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--batch", "0"],
        &["--batch 0"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--dropout", "1"],
        &["--dropout 1", "[0, 0.99]"],
    );
    for z in ["-0.001", "2", "NaN"] {
        check(
            &["--preset", "gpt2-nano", "--data", s(&data), "--z-loss", z],
            &[&format!("--z-loss {z}"), "[0, 1]"],
        );
    }
    for e in ["-0.1", "1.5", "NaN"] {
        check(
            &[
                "--preset",
                "gpt2-nano",
                "--data",
                s(&data),
                "--label-smoothing",
                e,
            ],
            &[&format!("--label-smoothing {e}"), "[0, 1]"],
        );
    }
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--steps",
            "5",
            "--epochs",
            "2",
        ],
        &["--steps", "--epochs", "cannot be used with"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--epochs", "0"],
        &["--epochs 0", "positive"],
    );
    for flag in ["--eval-every", "--save-every", "--sample-every"] {
        check(
            &["--preset", "gpt2-nano", "--data", s(&data), flag, "weekly"],
            &[flag, "'weekly'", "`epoch`"],
        );
    }
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--warmup",
            "5",
            "--warmup-ratio",
            "0.1",
        ],
        &["--warmup", "--warmup-ratio", "cannot be used with"],
    );
    for a in ["-1", "inf"] {
        check(
            &["--preset", "gpt2-nano", "--data", s(&data), "--neftune-alpha", a],
            &[&format!("--neftune-alpha {a}"), "finite number ≥ 0"],
        );
    }
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--attn-dropout",
            "-0.1",
        ],
        &["--attn-dropout -0.1", "[0, 0.99]"],
    );
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--lr",
            "1e-3",
            "--min-lr",
            "0.5",
        ],
        &["--min-lr 0.5", "--lr 0.001"],
    );
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--seq-len",
            "32",
            "--host-budget",
            "1K",
        ],
        &["--host-budget 1024", "transport copies", "megatrain plan"],
    );
    check(
        &["--preset", "gpt2-nano", "--data", s(&data), "--precision", "fp8"],
        &["fp8"],
    );
    check(
        &[
            "--preset",
            "gpt2-nano",
            "--data",
            s(&data),
            "--transport",
            "pinned",
        ],
        &["--transport", "unknown transport 'pinned'", "staging", "mapped"],
    );
    let jl = t.join("bad.jsonl");
    std::fs::write(
        &jl,
        "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"a\", \"output\": 3}\n",
    )
    .unwrap();
    check(
        &["--preset", "llama-tiny", "--data", s(&jl)],
        &["bad.jsonl:2", "output"],
    );
    let bin_file = t.join("odd.bin");
    std::fs::write(&bin_file, [1u8, 2, 3]).unwrap();
    check(
        &["--preset", "llama-tiny", "--data", s(&bin_file)],
        &["odd.bin", "u16"],
    );
    let big = t.join("big.bin");
    std::fs::write(&big, [0u8, 0, 0xff, 0xff, 0, 0].repeat(20)).unwrap();
    check(
        &["--preset", "llama-tiny", "--data", s(&big)],
        &["big.bin", "65535", "256"],
    );
    let cfg = t.join("c.toml");
    std::fs::write(&cfg, "preset = \"gpt2-nano\"\nlearning_rate = 3\n").unwrap();
    check(
        &["--config", s(&cfg), "--data", s(&data)],
        &["c.toml", "learning_rate"],
    );
    std::fs::write(&cfg, "preset = \"gpt2-nano\"\ntransport = \"dma\"\n").unwrap();
    check(
        &["--config", s(&cfg), "--data", s(&data)],
        &["c.toml", "unknown transport 'dma'"],
    );
    refused(&["train", "--resume", s(&t.join("nothing"))], &["nothing"]);
    refused(&["sample", "--model", s(&t.join("nothing"))], &["nothing"]);
    refused(
        &[
            "train",
            "--preset",
            "gpt2-nano",
            "--data",
            "a.txt",
            "--data",
            "b.txt",
            "--data-weights",
            "1",
        ],
        &["--data-weights 1", "1 weights for 2"],
    );
    refused(
        &["sample", "--model", s(&t.join("nothing")), "--system", "be brief"],
        &["--chat"],
    );
    refused(
        &["export", "--run", s(t), "--out", s(&t.join("x"))],
        &["not a run directory"],
    );
    // A kernel family, or a download staging, named in the environment
    // that names none (on the GPU, where they are read; lavapipe in CI).
    for (var, value, names) in [
        ("MEGATRAIN_F16_MATMUL", "coop256", &["coop128x256", "simt"][..]),
        ("MEGATRAIN_DOWNLOAD_STAGING", "layers", &["chunk", "layer"][..]),
    ] {
        let out = bin()
            .env(var, value)
            .args(["train", "--device", "gpu", "--quiet", "--out", s(&out)])
            .args([
                "--preset",
                "gpt2-nano",
                "--data",
                s(&data),
                "--steps",
                "1",
                "--seq-len",
                "16",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if !err.contains("no GPU adapter") {
            assert!(!out.status.success() && !err.contains("panicked"), "{err}");
            assert!(err.contains(&format!("{var}=\"{value}\"")), "{err}");
            for n in names {
                assert!(err.contains(n), "'{n}' not in: {err}");
            }
        }
    }
    refused(&["plan", "--preset", "nope"], &["nope"]);
    refused(
        &["plan", "--model", s(&t.join("nothing"))],
        &["nothing/config.json", "No such file"],
    );
    refused(
        &["plan", "--preset", "llama-tiny", "--host-mem", "12 parsecs"],
        &["parsecs"],
    );
    refused(
        &["plan", "--preset", "llama-tiny", "--adamw-gparams", "0"],
        &["--adamw-gparams 0"],
    );
}

/// `plan`'s batch suggestion weighs the host's AdamW beside the bus: for
/// Qwen2.5-7B at the default machine numbers the update, not the bus,
/// decides it, and a host five times as fast leaves it to the bus.
#[test]
fn plan_weighs_the_hosts_adamw() {
    let text = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--preset",
            "qwen2.5-7b",
            "--precision",
            "f16",
            "--batch",
            "8",
        ];
        args.extend_from_slice(extra);
        stdout_of(&args)
    };
    let t = text(&[]);
    assert!(
        t.contains("AdamW-bound") && t.contains("--batch 18 at --seq-len 1024"),
        "{t}"
    );
    // AdamW overlaps only the backward: the forward comes on top of it
    // (7.6 G parameters at 4.2 G/s, 1813.2 ms), and the head's update
    // follows the head's backward; the embedding's other rows than the
    // 8,192 a step looks up are updated beside the forward.
    assert!(
        t.contains("the embedding's 8192 rows a step looks up after the whole backward")
            && t.contains("and AdamW 1813.2 ms beside it: 1750.0 ms) = 2141.8 ms, 3825 tokens/s at best"),
        "{t}"
    );
    // Unless some blocks' AdamW runs in the next forward: six spread over
    // the model make the estimate shortest, AdamW's alone.
    assert!(
        t.contains("carrying the AdamW of 6 blocks spread over the model")
            && t.contains("(--carry-layers 6 --carry-order spread;")
            && t.contains("= 1813.2 ms, 4518 tokens/s at best"),
        "{t}"
    );
    assert!(!t.contains("--grad-clip"), "{t}");
    // Clipping holds every gradient to the backward's end: its AdamW can
    // overlap only the next forward, which it then outlasts; the norm
    // (4/30 of AdamW's 1813.2 ms) overlaps the backward.
    let t = text(&["--hold-grads"]);
    assert!(
        t.contains("with --grad-clip")
            && t.contains("their norm, 241.8 ms, summed beside it")
            && t.contains(
                "forward 1843.0 ms + max(backward 1145.5 ms, norm) = 2988.5 ms, 2741 tokens/s at best"
            )
            && t.contains("(every AdamW after the backward instead: 3350.5 ms)"),
        "{t}"
    );
    assert!(t.contains("18.00 bytes of RAM per parameter"), "{t}");
    let t = text(&["--hold-grads", "--host-mem", "128G"]);
    assert!(
        t.contains("128.67 GiB needed, 128.00 GiB available: does NOT fit")
            && t.contains("or --carry-layers all to keep the 28.37 GiB of held gradients on the device"),
        "{t}"
    );
    // Every layer carried: the device holds the gradients and takes their
    // norm, the host its tier's 14 bytes a parameter.
    let t = text(&["--hold-grads", "--carry-layers", "all"]);
    assert!(
        t.contains("14.00 bytes of RAM per parameter")
            && t.contains("the 30 carried layers' on the device")
            && t.contains("= 2988.5 ms, 2741 tokens/s at best"),
        "{t}"
    );
    let t = text(&["--adamw-gparams", "21"]);
    assert!(
        t.contains("the backward covers it") && t.contains("--batch 7 at --seq-len 1024"),
        "{t}"
    );
    assert!(t.contains("(--carry-layers) would not shorten it"), "{t}");
    // Their gradients on the device, 4 bytes a parameter: the embedding's
    // 545 M and nine blocks' 233 M each.
    let t = text(&["--carry-layers", "10"]);
    let carried = t
        .lines()
        .find(|l| l.trim_start().starts_with("carried"))
        .unwrap_or_default();
    assert!(carried.contains("9.84 GiB"), "{t}");
    assert!(
        t.contains("with --carry-layers 10: forward 917.5 ms") && t.contains("= 2161.1 ms"),
        "{t}"
    );
    // Fourteen blocks spread, every other one: 14 × 233 M gradients on
    // the device.
    let t = text(&["--carry-layers", "14", "--carry-order", "spread"]);
    let carried = t
        .lines()
        .find(|l| l.trim_start().starts_with("carried"))
        .unwrap_or_default();
    assert!(carried.contains("12.15 GiB"), "{t}");
    assert!(
        t.contains("with --carry-layers 14 --carry-order spread: forward 819.6 ms")
            && t.contains("= 2027.6 ms"),
        "{t}"
    );
    let out = run(&[
        "plan",
        "--preset",
        "qwen2.5-7b",
        "--carry-layers",
        "2",
        "--carry-order",
        "spread",
        "--hold-grads",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--carry-order spread cannot be used with --hold-grads"),
        "{err}"
    );
    let out = run(&["plan", "--preset", "qwen2.5-7b", "--carry-layers", "31"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--carry-layers 31") && err.contains("has 30 layers"),
        "{err}"
    );
}

/// Frozen layers' moments are reserved but never touched: `plan` counts
/// them apart and fits the host by what is resident (TinyLlama-1.1B's
/// embedding and first 11 blocks: 550 M parameters, 8 bytes each).
#[test]
fn plan_counts_frozen_layers_moments_apart() {
    let args = |extra: &[&str]| {
        let mut a = vec![
            "plan",
            "--preset",
            "tinyllama-1.1b",
            "--precision",
            "bf16",
            "--host-mem",
            "12G",
        ];
        a.extend_from_slice(extra);
        stdout_of(&a)
    };
    let t = args(&[]);
    assert!(
        t.contains("host: 14.54 GiB needed, 12.00 GiB available: does NOT fit"),
        "{t}"
    );
    let t = args(&["--freeze-layers", "12"]);
    assert!(
        t.contains("4.10 GiB of it never touched (--freeze-layers 12") && t.contains("10.45 GiB resident"),
        "{t}"
    );
    assert!(
        t.contains("host: 10.45 GiB needed, 12.00 GiB available: fits"),
        "{t}"
    );
    // The time estimate is of the frozen step (`cover.rs` tests its
    // numbers), which carries no layer.
    assert!(
        t.contains("the 12 frozen layers' forward alone") && !t.contains("carry"),
        "{t}"
    );
    let out = run(&["plan", "--preset", "tinyllama-1.1b", "--freeze-layers", "24"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--freeze-layers 24") && err.contains("at most 23"),
        "{err}"
    );
}

fn train_args<'a>(data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--preset",
        "gpt2-nano",
        "--data",
        data,
        "--out",
        out,
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--batch",
        "4",
        "--steps",
        steps,
        "--save-every",
        "1",
        "--eval-every",
        "0",
        "--warmup",
        "2",
        "--quiet",
    ]
}

/// Checkpoint `step` of runs `a` and `b` holds the same bytes of weights
/// and of AdamW state.
fn assert_same_weights_and_moments(a: &Path, b: &Path, step: u64, what: &str) {
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(a.join(format!("ckpt-{step}")).join(f)).unwrap();
        let y = std::fs::read(b.join(format!("ckpt-{step}")).join(f)).unwrap();
        assert!(x == y, "{f} differs {what}");
    }
}

fn latest_step(run: &Path) -> Option<u64> {
    let name = std::fs::read_to_string(run.join("latest")).ok()?;
    name.trim().strip_prefix("ckpt-")?.parse().ok()
}

#[test]
fn sigkill_between_saves_then_resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let (a, b) = (t.join("a"), t.join("b"));
    let steps = "40";
    let out = run(&train_args(s(&data), s(&a), steps));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let mut child = bin().args(train_args(s(&data), s(&b), steps)).spawn().unwrap();
    let t0 = Instant::now();
    while latest_step(&b).unwrap_or(0) < 3 && t0.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let killed_at = latest_step(&b).expect("a checkpoint before the kill");
    eprintln!("killed with latest = ckpt-{killed_at}");
    let out = run(&["train", "--resume", s(&b), "--quiet"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(latest_step(&b), Some(40));
    assert_same_weights_and_moments(&a, &b, 40, &format!("after kill at {killed_at} and resume"));
    let steps_logged = |r: &Path| {
        std::fs::read_to_string(r.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(steps_logged(&b), (1..=40).collect::<Vec<_>>());
    assert_eq!(steps_logged(&a), steps_logged(&b));

    // The finished run exports, samples and evaluates.
    let hf = t.join("hf");
    let out = run(&["export", "--run", s(&a), "--out", s(&hf)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["config.json", "model.safetensors", "char_vocab.json"] {
        assert!(hf.join(f).exists(), "{f}");
    }
    assert!(!hf.join("optimizer.safetensors").exists());
    // 20 tokens after "O Romeo" from `model`, with `more` flags.
    let romeo = |model: &Path, more: &[&str]| {
        let mut args = vec![
            "sample",
            "--model",
            s(model),
            "--prompt",
            "O Romeo",
            "--tokens",
            "20",
        ];
        args.extend_from_slice(more);
        let out = run(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (text, _) = romeo(&hf, &["--seed", "3"]);
    assert!(
        text.starts_with("O Romeo") && text.chars().count() >= 27,
        "{text:?}"
    );
    // A char vocabulary cannot spell the Alpaca headers a chat prompt is
    // rendered with: refused, naming the rendering.
    refused(
        &[
            "sample",
            "--model",
            s(&hf),
            "--prompt",
            "O Romeo",
            "--chat",
            "--tokens",
            "2",
        ],
        &["rendered by the chat template", "### Instruction"],
    );
    // The run directory's checkpoint, its layers streamed from host memory
    // for every token, samples as the export uploaded once.
    let (again, _) = romeo(&a, &["--seed", "3", "--stream", "true"]);
    assert_eq!(again, text, "run dir streamed and export resident sample alike");
    // Three samples made together: the second is --seed 4's alone.
    let (three, _) = romeo(&hf, &["--seed", "3", "--samples", "3"]);
    let parts: Vec<&str> = three.split("---------------\n").collect();
    assert_eq!(parts.len(), 3, "{three:?}");
    assert_eq!(parts[0], text, "the first sample is --seed 3's");
    assert_eq!(
        parts[1],
        romeo(&hf, &["--seed", "4"]).0,
        "the second sample is --seed 4's"
    );
    refused(&["sample", "--model", s(&hf), "--samples", "0"], &["--samples 0"]);
    // --prompt-file reads the prompt; --timing says how long it took on
    // standard error and changes nothing printed.
    let (greedy, _) = romeo(&hf, &["--temperature", "0"]);
    std::fs::write(t.join("prompt.txt"), "O Romeo").unwrap();
    let from_file = run(&[
        "sample",
        "--model",
        s(&hf),
        "--prompt-file",
        s(&t.join("prompt.txt")),
        "--tokens",
        "20",
        "--temperature",
        "0",
    ]);
    assert_eq!(
        String::from_utf8(from_file.stdout).unwrap(),
        greedy,
        "--prompt-file as --prompt"
    );
    std::fs::write(t.join("bad.txt"), [0xff, 0xfe, 0x41]).unwrap();
    refused(
        &[
            "sample",
            "--model",
            s(&hf),
            "--prompt-file",
            s(&t.join("bad.txt")),
        ],
        &["bad.txt", "UTF-8"],
    );
    refused(
        &[
            "sample",
            "--model",
            s(&hf),
            "--prompt-file",
            s(&t.join("none.txt")),
        ],
        &["none.txt"],
    );
    let (timed, said) = romeo(&hf, &["--temperature", "0", "--timing"]);
    assert_eq!(timed, greedy, "--timing changes nothing printed");
    assert!(
        said.contains("prompt of 7 tokens: first token after") && said.contains("19 more"),
        "{said}"
    );
    // A model's generation_config.json that says do_sample sets what the
    // flags leave: greedy here, so the text is --temperature 0's; flags
    // still override it.
    let config = hf.join("generation_config.json");
    std::fs::write(&config, r#"{"do_sample": false, "eos_token_id": 0}"#).unwrap();
    let (asked, said) = romeo(&hf, &[]);
    assert_eq!(asked, greedy, "greedy as the model asks");
    assert!(said.contains("temperature 0"), "{said}");
    let (flagged, _) = romeo(&hf, &["--seed", "3", "--temperature", "0.8", "--top-k", "200"]);
    assert_eq!(flagged, text, "flags override the file");
    std::fs::write(&config, r#"{"do_sample": true, "top_p": 0}"#).unwrap();
    refused(
        &["sample", "--model", s(&hf)],
        &["generation_config.json", "top_p"],
    );
    std::fs::remove_file(&config).unwrap();
    refused(&["sample", "--model", s(&hf), "--min-p", "1.5"], &["--min-p 1.5"]);
    refused(
        &["sample", "--model", s(&hf), "--repetition-penalty", "0"],
        &["--repetition-penalty 0"],
    );
    let out = run(&[
        "eval",
        "--model",
        s(&a),
        "--data",
        s(&data),
        "--device",
        "cpu",
        "--seq-len",
        "32",
    ]);
    let line = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success() && line.starts_with("loss ") && line.contains("perplexity"),
        "{line}"
    );

    // One flipped bit in the data of a checkpoint's file (the last byte
    // belongs to a tensor) is refused by everything that reads it, naming
    // the file, and the checkpoint stays where it was.
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let path = a.join("ckpt-40").join(f);
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let needles = [s(&path), "CRC-32"];
        refused(
            &["train", "--resume", s(&a), "--steps", "41", "--quiet"],
            &needles,
        );
        if f == "model.safetensors" {
            refused(&["export", "--run", s(&a), "--out", s(&t.join("hf2"))], &needles);
            refused(&["sample", "--model", s(&a), "--tokens", "2"], &needles);
            let eval = ["eval", "--model", s(&a), "--data", s(&data), "--device", "cpu"];
            refused(&eval, &needles);
        }
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
    }
    assert_eq!(latest_step(&a), Some(40));
    assert!(!t.join("hf2").join("model.safetensors").exists());
}

/// A run of `steps` that saves only at its end.
fn unsaved_args<'a>(data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut v = train_args(data, out, steps);
    let at = v.iter().position(|a| *a == "--save-every").unwrap();
    v[at + 1] = "0";
    v
}

#[cfg(unix)]
#[test]
fn sigterm_saves_the_step_under_way_and_the_run_resumes_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let (a, b) = (t.join("a"), t.join("b"));
    let steps = "400";
    let out = run(&unsaved_args(s(&data), s(&a), steps));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let child = bin()
        .args(unsaved_args(s(&data), s(&b), steps))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let logged = |r: &Path| std::fs::read_to_string(r.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    let t0 = Instant::now();
    while logged(&b) < 5 && t0.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: a plain kill(2) of the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{err}");
    let stopped = latest_step(&b).expect("a checkpoint of the step under way");
    assert!((5..400).contains(&stopped), "stopped at {stopped}");
    assert!(
        err.contains(&format!("interrupted by SIGTERM after step {stopped}")) && err.contains("--resume"),
        "{err}"
    );

    let out = run(&["train", "--resume", s(&b), "--quiet"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_same_weights_and_moments(&a, &b, 400, &format!("after SIGTERM at {stopped} and resume"));
}

#[test]
fn keep_checkpoints_removes_older_ones_after_each_save() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let a = t.join("a");
    let ckpts = |run: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(run)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("ckpt"))
            .collect();
        v.sort();
        v
    };
    let mut args = train_args(s(&data), s(&a), "5");
    args.extend(["--keep-checkpoints", "2"]);
    let out = run(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(ckpts(&a), ["ckpt-4", "ckpt-5"]);
    // A resume may change it (it changes no result) and prunes by the new
    // number.
    let out = run(&[
        "train",
        "--resume",
        s(&a),
        "--steps",
        "7",
        "--keep-checkpoints",
        "1",
        "--quiet",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("keep_checkpoints"), "{err}");
    assert_eq!(ckpts(&a), ["ckpt-7"]);
    assert_eq!(latest_step(&a), Some(7));
}

#[test]
fn the_best_checkpoint_is_kept_and_picked_by_step_best() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let a = t.join("a");
    let mut args = train_args(s(&data), s(&a), "6");
    // Evaluate and save every 2 steps instead of every 0 and 1.
    for (flag, v) in [("--eval-every", "2"), ("--save-every", "2")] {
        let at = args.iter().position(|x| *x == flag).unwrap();
        args[at + 1] = v;
    }
    args.extend(["--eval-batches", "2", "--keep-checkpoints", "1", "--lr", "0.03"]);
    let out = run(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The lowest validation loss of the saved steps (2, 4, 6; not step 0).
    let log = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let (step, v) = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["step"].as_u64().unwrap() > 0)
        .filter_map(|r| Some((r["step"].as_u64()?, r.get("val_loss")?.as_f64()?)))
        .fold((0, f64::INFINITY), |b, x| if x.1 < b.1 { x } else { b });
    let best = format!("ckpt-{step}");
    assert_eq!(std::fs::read_to_string(a.join("best")).unwrap().trim(), best);
    assert!(a.join(&best).is_dir() && a.join("ckpt-6").is_dir());
    let said = String::from_utf8_lossy(&out.stdout);
    if step != 6 {
        assert!(
            said.contains(&format!(
                "best {} (validation loss {v:.4})",
                a.join(&best).display()
            )),
            "{said}"
        );
    }
    let e = t.join("e");
    let out = run(&["export", "--run", s(&a), "--step", "best", "--out", s(&e)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        std::fs::read(e.join("model.safetensors")).unwrap(),
        std::fs::read(a.join(&best).join("model.safetensors")).unwrap()
    );
    // A run's last step is evaluated (`--eval-every 0` evaluates only it),
    // so it is a candidate; a run from before `best` has none.
    let b = t.join("b");
    let out = run(&train_args(s(&data), s(&b), "2"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(b.join("best")).unwrap().trim(), "ckpt-2");
    std::fs::remove_file(b.join("best")).unwrap();
    refused(
        &[
            "export",
            "--run",
            s(&b),
            "--step",
            "best",
            "--out",
            s(&t.join("f")),
        ],
        &["has no 'best' checkpoint", "--eval-every"],
    );
    refused(
        &[
            "export",
            "--run",
            s(&b),
            "--step",
            "newest",
            "--out",
            s(&t.join("f")),
        ],
        &["'newest' is neither a step nor 'best'"],
    );
}

#[test]
fn early_stop_ends_the_run_after_evaluations_without_a_new_best() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let a = t.join("a");
    let mut args = train_args(s(&data), s(&a), "20");
    for (flag, v) in [("--eval-every", "2"), ("--save-every", "10")] {
        let at = args.iter().position(|x| *x == flag).unwrap();
        args[at + 1] = v;
    }
    // The schedule's length given, so that a run of fewer steps (below)
    // follows the same learning rates.
    args.extend([
        "--eval-batches",
        "2",
        "--lr",
        "0.03",
        "--early-stop",
        "2",
        "--decay-steps",
        "20",
    ]);
    let out = run(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Where the logged validation losses say it stops: the second
    // evaluation in a row not below the lowest so far.
    let log = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let vals: Vec<(u64, f64)> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_u64()?, r.get("val_loss")?.as_f64()?)))
        .collect();
    let (mut best, mut since, mut stop) = (f64::INFINITY, 0, None);
    for &(step, v) in &vals {
        if v < best {
            (best, since) = (v, 0);
        } else {
            since += 1;
        }
        if since >= 2 {
            stop = Some(step);
            break;
        }
    }
    let stop = stop.expect("these settings must stop early: the validation loss rises after step 2");
    assert_eq!(vals.last().unwrap().0, stop, "{vals:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!(
            "stopped early at step {stop}: 2 evaluations without a validation loss below {best:.4}"
        )),
        "{said}"
    );
    // The step it stopped at is saved, with the count a resume goes on from.
    assert_eq!(latest_step(&a), Some(stop));
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(a.join(format!("ckpt-{stop}")).join("checkpoint.json")).unwrap(),
    )
    .unwrap();
    let patience = &meta["extra"]["train_state"]["patience"];
    assert_eq!(
        (patience["best"].as_f64(), patience["since"].as_u64()),
        (Some(best), Some(2))
    );
    // A run stopped before it and resumed stops at the same step: the
    // count goes on from the checkpoint.
    let c = t.join("c");
    let first: Vec<&str> = args.iter().map(|&x| if x == s(&a) { s(&c) } else { x }).collect();
    let at = first.iter().position(|x| *x == "--steps").unwrap() + 1;
    let before = (stop - 2).to_string();
    let mut first = first.clone();
    first[at] = &before;
    let out = run(&first);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["train", "--resume", s(&c), "--steps", "20", "--quiet"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("stopped early at step {stop}")));
    assert_eq!(latest_step(&c), Some(stop));
    let b = t.join("b");
    let mut no_eval = train_args(s(&data), s(&b), "4");
    no_eval.extend(["--early-stop", "3"]);
    refused(&no_eval, &["--early-stop 3", "give --eval-every too"]);
}

/// `plan` for TinyLlama on 4 ranks, the disk's speed given.
const PLAN_4_RANKS: [&str; 7] = [
    "plan",
    "--preset",
    "tinyllama-1.1b",
    "--ranks",
    "4",
    "--disk-gbps",
    "1",
];

/// `megatrain plan … | head -1`: the reader stops, and the plan ends as
/// other tools do (SIGPIPE), never with a panic in `println!`.
#[cfg(unix)]
#[test]
fn plan_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    // A pipe whose reader is gone before the plan starts.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = common::cli::bin()
        .args(PLAN_4_RANKS)
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}: {err}");
}

#[test]
fn plan_reports_host_and_device_bytes() {
    let out = run(&[
        "plan",
        "--preset",
        "llama-tiny",
        "--seq-len",
        "8",
        "--batch",
        "2",
        "--host-mem",
        "1G",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("bytes of RAM per parameter") && text.contains("recompute"),
        "{text}"
    );
    assert!(text.contains("1.00 GiB available: fits"), "{text}");
    let out = run(&["plan", "--preset", "llama-2-7b", "--host-mem", "24G"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("does NOT fit"), "{text}");
    // A mixture of experts holds every expert; a token reads k of them.
    let out = run(&["plan", "--preset", "olmoe-1b-7b", "--host-mem", "1T"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("6919161856 parameters")
            && text.contains("1282017280 of the parameters read per token (64 experts, 8 a token)"),
        "{text}"
    );
    // An f16 transport copy costs what a bf16 one does: 2 bytes a parameter.
    let per_param = |precision: &str| {
        let out = run(&["plan", "--preset", "llama-tiny", "--precision", precision]);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(&format!("{precision} transport")), "{text}");
        text.lines()
            .find(|l| l.contains("bytes of RAM per parameter"))
            .unwrap()
            .to_string()
    };
    assert_eq!(per_param("f16"), per_param("bf16"));
    assert_ne!(per_param("f16"), per_param("f32"));
    // Ranks with a budget: each rank counts its share of p, m, v, so a
    // budget that spills a whole tier (8 GiB of TinyLlama's 16) holds the
    // sharded one in RAM, and a smaller one spills fewer layers.
    let args = PLAN_4_RANKS;
    let text = String::from_utf8(run(&args).stdout).unwrap();
    assert!(
        text.contains("the busiest rank):") && !text.contains("spilled"),
        "{text}"
    );
    let text = String::from_utf8(run(&[&args[..], &["--host-budget", "8G"]].concat()).stdout).unwrap();
    let sharded = text.split("per rank of 4").nth(1).unwrap();
    assert!(text.contains("layers 7.. spilled to disk"), "{text}");
    assert!(!sharded.contains("spilled"), "{text}");
    assert!(sharded.contains("rank 0 while saving a checkpoint"), "{text}");
    // A copy per rank (f32 copies: 4 B a parameter).
    let own = ["--host-budget", "6G", "--share-transport", "false"];
    let text = String::from_utf8(run(&[&args[..], &own].concat()).stdout).unwrap();
    let sharded = text.split("per rank of 4").nth(1).unwrap();
    assert!(
        sharded.contains("layers 14..24 spilled") && sharded.contains("its 1/4 of p, m, v"),
        "{text}"
    );
    // The machine's ranks mapping one copy, each counting a quarter of it:
    // a budget below the copies, which one process cannot take, holds
    // layers ..15 of each rank.
    let out = run(&[&args[..], &["--host-budget", "3G"]].concat());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    let (one, sharded) = text.split_once("per rank of 4").unwrap();
    assert!(one.contains("one process: transport copies alone need"), "{text}");
    assert!(
        sharded.contains("layers 15..24 spilled") && sharded.contains("they map one transport copy"),
        "{text}"
    );
    assert!(!sharded.contains("host:"), "{text}");
    // Machines of 2 ranks: each counts half of its machine's copy.
    let two = ["--ranks-per-machine", "2", "--host-budget", "3G"];
    let text = String::from_utf8(run(&[&args[..], &two].concat()).stdout).unwrap();
    assert!(text.contains("each machine of 2 ranks: at most"), "{text}");
    assert!(
        text.contains("transport        2.05 GiB    2.00 B/param"),
        "{text}"
    );
}

/// GLM-4.5's router correction bias (a checkpoint tensor transformers
/// keeps as a buffer) takes no gradient: a run from the fixture's
/// checkpoint saves it exactly as loaded, while the router beside it
/// learns.
#[test]
fn a_routers_correction_bias_is_kept_as_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let out = dir.path().join("run");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/glm4_moe");
    let args = [
        "train",
        "--model",
        s(&model),
        "--tokenizer",
        "char",
        "--data",
        s(&data),
        "--out",
        s(&out),
        "--device",
        "cpu",
        "--seq-len",
        "8",
        "--batch",
        "2",
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--quiet",
    ];
    let r = run(&args);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let read = |p: &Path| std::fs::read(p).unwrap();
    let (before, after) = (
        read(&model.join("model.safetensors")),
        read(&out.join("ckpt-3/model.safetensors")),
    );
    let (before, after) = (
        safetensors::SafeTensors::deserialize(&before).unwrap(),
        safetensors::SafeTensors::deserialize(&after).unwrap(),
    );
    for block in [1, 2] {
        let bias = format!("model.layers.{block}.mlp.gate.e_score_correction_bias");
        let router = format!("model.layers.{block}.mlp.gate.weight");
        let (b0, b1) = (before.tensor(&bias).unwrap(), after.tensor(&bias).unwrap());
        assert_eq!(b0.data(), b1.data(), "{bias} moved");
        assert!(b0.data().iter().any(|&x| x != 0), "{bias} is not all zeros");
        assert_ne!(
            before.tensor(&router).unwrap().data(),
            after.tensor(&router).unwrap().data(),
            "{router} did not learn"
        );
    }
}

/// `--rows stream-docs` through the binary: `train` says how its records
/// sit in windows of the stream, `eval` scores those windows with each
/// record on its own (not as `--rows stream` does, where they read each
/// other); a text's documents are those `--doc-end` ends, and without an
/// id to end them (the byte tokenizer has no end of sequence) the text is
/// refused by name.
#[test]
fn windows_of_records_through_the_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let lines: String = (0..40)
        .map(|i| format!("{{\"text\": \"{}\"}}\n", "to be or not ".repeat(i % 4 + 1)))
        .collect();
    let data = t.join("docs.jsonl");
    std::fs::write(&data, lines).unwrap();
    let run_dir = t.join("run");
    let train_with = |data: &Path, out: &Path, more: &[&str]| {
        let args = [
            "train",
            "--preset",
            "llama-tiny",
            "--tokenizer",
            "byte",
            "--data",
            s(data),
            "--rows",
            "stream-docs",
            "--seq-len",
            "64",
            "--batch",
            "2",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--device",
            "cpu",
            "--out",
            s(out),
        ];
        run(&[&args[..], more].concat())
    };
    let train = |data: &Path, out: &Path| train_with(data, out, &[]);
    let out = train(&data, &run_dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("docs.jsonl: 36 records in windows of the stream, each on its own: no padding"),
        "{err}"
    );
    let eval = |rows: &str| {
        let out = run(&[
            "eval",
            "--model",
            s(&run_dir),
            "--data",
            s(&data),
            "--device",
            "cpu",
            "--seq-len",
            "64",
            "--rows",
            rows,
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let (docs, stream) = (eval("stream-docs"), eval("stream"));
    assert!(
        docs.contains("windows of the stream, each record on its own"),
        "{docs}"
    );
    assert!(stream.contains("windows of the stream)"), "{stream}");
    let loss = |l: &str| l.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap();
    assert_ne!(loss(&docs), loss(&stream));
    let text = t.join("plain.txt");
    std::fs::write(&text, "to be or not to be\n".repeat(50)).unwrap();
    let out = train(&text, &t.join("refused"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("plain.txt: --rows stream-docs")
            && err.contains("--doc-end ID"),
        "{err}"
    );
    let out = train_with(&text, &t.join("lines"), &["--doc-end", "10"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = train_with(&text, &t.join("past"), &["--doc-end", "300"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--doc-end 300") && err.contains("vocabulary of 256"),
        "{err}"
    );
    let other = t.join("other");
    let out = run(&[
        "train",
        "--preset",
        "llama-tiny",
        "--tokenizer",
        "byte",
        "--data",
        s(&text),
        "--rows",
        "stream",
        "--doc-end",
        "10",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--out",
        s(&other),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not of --rows stream"),
        "{err}"
    );
}

/// `.jsonl` through the binary: `train` says how its rows of records are
/// cut and padded, `eval` scores each record once and says so (on the run
/// and on its bf16 export, in one file or in shards), and both refuse
/// `--rows records` for a source without records, naming it.
#[test]
fn rows_of_records_and_a_bf16_export_through_the_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let mut lines = String::new();
    for i in 0..30 {
        lines += &format!(
            "{{\"instruction\": \"Count to {}\", \"input\": \"\", \"output\": \"{}\"}}\n",
            i % 5 + 1,
            "ok ".repeat(i % 5 + 1)
        );
    }
    let data = t.join("sft.jsonl");
    std::fs::write(&data, lines).unwrap();
    let run_dir = t.join("run");
    let out = run(&[
        "train",
        "--preset",
        "llama-tiny",
        "--tokenizer",
        "byte",
        "--data",
        s(&data),
        "--seq-len",
        "96",
        "--batch",
        "4",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--device",
        "cpu",
        "--out",
        s(&run_dir),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("sft.jsonl: 28 records, one a row") && err.contains("padding"),
        "{err}"
    );
    // `eval` of the records on the CPU at the run's --seq-len: its line.
    let eval = |model: &Path, more: &[&str]| {
        let args = [
            &["eval", "--model", s(model), "--data", s(&data)][..],
            &["--device", "cpu", "--seq-len", "96"],
            more,
        ];
        let out = run(&args.concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let loss = |l: &str| l.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap();
    let line = eval(&run_dir, &[]);
    assert!(line.contains("30 records, one a row"), "{line}");
    // Packed, the same records score the same in fewer rows.
    let packed = eval(&run_dir, &["--rows", "packed"]);
    let rows: usize = packed
        .split("packed into ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("{packed}"));
    assert!(packed.contains("30 records packed into") && rows < 30, "{packed}");
    let (a, b) = (loss(&line), loss(&packed));
    assert!((a - b).abs() <= 1e-5 * a.abs(), "one a row {a}, packed {b}");
    // Exported in bf16, as models are published: half the weights' bytes,
    // the config says so, and it scores the records as the run does.
    let exp = t.join("exp");
    let export = |out: &Path, extra: &[&str]| {
        let args = [&["export", "--run", s(&run_dir), "--out", s(out)][..], extra].concat();
        let out = run(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    export(&exp, &["--dtype", "bf16"]);
    let config = std::fs::read_to_string(exp.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");
    let size = |d: &Path| std::fs::metadata(d.join("model.safetensors")).unwrap().len();
    let ckpt = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("ckpt-"))
        .unwrap();
    assert!(
        size(&exp) * 2 < size(&ckpt) + 4096,
        "{} against {}",
        size(&exp),
        size(&ckpt)
    );
    let bf16_line = eval(&exp, &[]);
    assert!(
        (loss(&bf16_line) - loss(&line)).abs() < 1e-2,
        "{bf16_line} against {line}"
    );
    // In shards of at most 100 kB, as the Hub publishes large models: the
    // index names each, counts their bytes, and the shards score and
    // sample as the one bf16 file does.
    let sharded = t.join("sharded");
    let said = export(&sharded, &["--dtype", "bf16", "--max-shard-size", "100KB"]);
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(shards.len() >= 2, "{index}");
    assert!(
        said.contains(&format!(
            "{} shards and model.safetensors.index.json",
            shards.len()
        )),
        "{said}"
    );
    let mut total = 0;
    for f in &shards {
        let bytes = std::fs::read(sharded.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let data: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
        assert!(data <= 100_000, "{f}: {data} bytes");
        assert!(
            st.tensors()
                .iter()
                .all(|(_, v)| v.dtype() == safetensors::Dtype::BF16)
        );
        total += data;
    }
    assert_eq!(index["metadata"]["total_size"], total);
    assert!(!sharded.join("model.safetensors").exists());
    assert_eq!(eval(&sharded, &[]), bf16_line);
    let sample = |model: &Path| {
        let out = run(&[
            "sample",
            "--model",
            s(model),
            "--prompt",
            "Count to 3",
            "--tokens",
            "12",
            "--seed",
            "5",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = sample(&sharded);
    assert!(text.starts_with("Count to 3"), "{text:?}");
    assert_eq!(text, sample(&exp));
    // Over it in one f32 file, the checkpoint's own: no shard or index
    // is left to be read instead.
    let said = export(&sharded, &[]);
    assert!(said.contains("(float32 weights in model.safetensors)"), "{said}");
    let mut left: Vec<String> = std::fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.contains("safetensors"))
        .collect();
    left.sort();
    assert_eq!(left, ["model.safetensors"]);
    let latest = std::fs::read_to_string(run_dir.join("latest")).unwrap();
    assert_eq!(
        std::fs::read(sharded.join("model.safetensors")).unwrap(),
        std::fs::read(run_dir.join(latest.trim()).join("model.safetensors")).unwrap()
    );
    for (size, needle) in [
        ("0", "no room for a shard"),
        ("5XB", "unknown size unit"),
        ("lots", "not a size"),
        ("20000000TB", "more than"),
    ] {
        let args = [
            "export",
            "--run",
            s(&run_dir),
            "--out",
            s(&exp),
            "--max-shard-size",
            size,
        ];
        refused(&args, &["--max-shard-size", &format!("'{size}'"), needle]);
    }
    refused(
        &[
            "export",
            "--run",
            s(&run_dir),
            "--out",
            s(&exp),
            "--dtype",
            "int8",
        ],
        &["int8", "f32, bf16 or f16"],
    );
    let text = corpus(t);
    refused(
        &[
            "eval",
            "--model",
            s(&run_dir),
            "--data",
            s(&text),
            "--device",
            "cpu",
            "--rows",
            "records",
        ],
        &["--rows records", "holds no records"],
    );
    refused(
        &[
            "train",
            "--preset",
            "llama-tiny",
            "--tokenizer",
            "byte",
            "--data",
            s(&text),
            "--rows",
            "records",
            "--device",
            "cpu",
            "--out",
            s(&t.join("other")),
        ],
        &["--rows records", "holds no records"],
    );
}

/// `sample --chat --interactive`: the reply to --prompt, then one to each
/// non-blank line of standard input, each to the conversation so far; the
/// cache keeps what the turns share, and the replies are the same without
/// it. `--interactive` needs `--chat`.
#[test]
fn a_conversation_through_the_binary() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path();
    let data = corpus(t);
    let run_dir = t.join("run");
    let out = run(&[
        "train",
        "--preset",
        "llama-tiny",
        "--tokenizer",
        "byte",
        "--data",
        s(&data),
        "--out",
        s(&run_dir),
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--quiet",
        "--sample-every",
        "1",
        "--sample-prompt",
        "Hello",
        "--sample-tokens",
        "5",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The run wrote a sample after each step, even quiet.
    let said = String::from_utf8_lossy(&out.stderr);
    for step in 1..=2 {
        assert!(said.contains(&format!("step {step}: sample:\nHello")), "{said}");
    }
    let chat = |cache: &str| {
        let mut child = bin()
            .args(["sample", "--model", s(&run_dir), "--chat", "--interactive"])
            .args(["--system", "Be brief.", "--prompt", "Hello", "--tokens", "12"])
            .args(["--temperature", "0", "--kv-cache", cache])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"Who are you?\n\n  \nWhere is Romeo?\n").unwrap();
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let with = chat("true");
    assert!(
        with.iter().filter(|&&b| b == b'\n').count() >= 3,
        "three replies: {with:?}"
    );
    assert_eq!(with, chat("false"), "the replies with the cache and without");
    refused(&["sample", "--model", s(&run_dir), "--interactive"], &["--chat"]);
}
