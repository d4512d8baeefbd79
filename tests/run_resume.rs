//! Exact resume through the library: N steps in one go equal k steps, a
//! stop, a resume and the rest, bit for bit (parameters and AdamW state),
//! including after a crash that left a half-written checkpoint and metrics
//! lines past the last save.

use std::path::{Path, PathBuf};

use megatrain::run::{
    Every, METRICS_FILE, QuietProgress, Schedule, TrainOptions, latest_checkpoint, prepare, read_train_state,
    train,
};
use serde_json::Value;

pub fn corpus(dir: &Path) -> PathBuf {
    let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n\
                First Citizen:\nYou are all resolved rather to die than to famish?\n"
        .repeat(12);
    let p = dir.join("corpus.txt");
    std::fs::write(&p, text).unwrap();
    p
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
        save_every: Every::Steps(0),
        out: out.to_path_buf(),
        ..TrainOptions::default()
    }
}

fn run(opts: TrainOptions, resume: bool, stop_at: Option<u64>) {
    let mut p = prepare(opts, resume).unwrap();
    train(
        megatrain_tensor::CpuExecutor::new(),
        &mut p,
        stop_at,
        &mut QuietProgress,
    )
    .unwrap();
}

fn ckpt_bytes(run: &Path) -> (Vec<u8>, Vec<u8>) {
    let c = latest_checkpoint(run).unwrap();
    (
        std::fs::read(c.join("model.safetensors")).unwrap(),
        std::fs::read(c.join("optimizer.safetensors")).unwrap(),
    )
}

fn losses(run: &Path) -> Vec<(u64, Option<f64>, Option<f64>)> {
    std::fs::read_to_string(run.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v.get("loss").and_then(Value::as_f64),
                v.get("val_loss").and_then(Value::as_f64),
            )
        })
        .collect()
}

fn check_resume(tweak: impl Fn(&mut TrainOptions)) {
    let tmp = tempfile::tempdir().unwrap();
    check_resume_on(&corpus(tmp.path()), tweak);
}

/// [`check_resume`] on `data`, the runs beside it.
fn check_resume_on(data: &Path, tweak: impl Fn(&mut TrainOptions)) {
    let dir = data.parent().unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let mut oa = options(data, &a);
    tweak(&mut oa);
    let mut ob = oa.clone();
    ob.out = b.clone();
    run(oa, false, None);
    run(ob.clone(), false, Some(3));
    assert_eq!(read_train_state(&latest_checkpoint(&b).unwrap()).unwrap().step, 3);
    run(ob, true, None);
    let (ma, oa_) = ckpt_bytes(&a);
    let (mb, ob_) = ckpt_bytes(&b);
    assert!(ma == mb, "parameters differ after resume");
    assert!(oa_ == ob_, "AdamW state differs after resume");
    assert_eq!(losses(&a), losses(&b), "metrics of the resumed run differ");
    assert_eq!(losses(&a).len(), 7, "eval at 0, then one line per step");
}

#[test]
fn resume_is_bit_exact_overlapped_update() {
    check_resume(|o| o.grad_clip = 0.0);
}

#[test]
fn resume_is_bit_exact_with_clipping_accumulation_and_sequential_data() {
    check_resume(|o| {
        o.grad_clip = 0.5;
        o.grad_accum = 2;
        o.sampling = megatrain::run::SamplingKind::Sequential;
    });
}

/// Dropout's masks are drawn from the step: a resumed run draws the
/// uninterrupted run's (and the masks do change the run).
#[test]
fn resume_is_bit_exact_with_dropout() {
    check_resume(|o| {
        o.dropout = 0.2;
        o.attn_dropout = 0.1;
        o.grad_accum = 2;
    });
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    run(options(&data, &a), false, None);
    run(
        TrainOptions {
            dropout: 0.2,
            ..options(&data, &b)
        },
        false,
        None,
    );
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la[0], lb[0], "evaluation before any step never drops");
    assert_ne!(la[1], lb[1], "dropout changed no loss");
}

/// A warmup-stable-decay run: the learning rate each step logged holds at
/// --lr until the cooldown, then falls to --min-lr as 1 − √t; resumed
/// across the turn, bit for bit. A cooldown on another schedule, or
/// longer than the decay, is refused by name.
#[test]
fn a_wsd_run_holds_then_cools_down_and_resumes_exactly() {
    let wsd = |o: &mut TrainOptions| {
        o.schedule = Schedule::WsdSqrt;
        o.cooldown = Some(3);
        o.min_lr = Some(3e-4);
    };
    check_resume(wsd);
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let mut o = options(&data, &tmp.path().join("run"));
    wsd(&mut o);
    run(o.clone(), false, None);
    let lrs: Vec<(u64, f64)> = std::fs::read_to_string(tmp.path().join("run").join(METRICS_FILE))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v.get("lr")?.as_f64()?))
        })
        .collect();
    // Steps 1..=6 ran at the schedule's steps 0..=5: warm-up 2, stable at
    // step 2, the cooldown's steps 3, 4, 5 from the peak to the floor.
    let want = [
        1e-3,
        2e-3,
        3e-3,
        3e-3,
        3e-4 + (1.0 - (1.0f64 / 3.0).sqrt()) * 2.7e-3,
        3e-4 + (1.0 - (2.0f64 / 3.0).sqrt()) * 2.7e-3,
    ];
    assert_eq!(lrs.len(), 6, "{lrs:?}");
    for ((step, lr), w) in lrs.iter().zip(want) {
        assert!((lr - w).abs() < 1e-12, "step {step}: lr {lr}, want {w}");
    }
    for (cooldown, schedule, needle) in [
        (3, Schedule::Cosine, "wsd"),
        (7, Schedule::Wsd, "longer than the 6 steps"),
    ] {
        let bad = TrainOptions {
            cooldown: Some(cooldown),
            schedule,
            ..o.clone()
        };
        let e = prepare(bad, false).expect_err("refused").to_string();
        assert!(
            e.contains(&format!("--cooldown {cooldown}")) && e.contains(needle),
            "{e}"
        );
    }
}

#[test]
fn resume_is_bit_exact_with_bf16_transport() {
    check_resume(|o| o.precision = megatrain::run::Precision::Bf16);
}

#[test]
fn resume_is_bit_exact_with_f16_precision_restored_from_the_run() {
    use megatrain::run::Precision;
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    let mut oa = options(&data, &a);
    oa.precision = Precision::F16;
    let mut ob = oa.clone();
    ob.out = b.clone();
    run(oa.clone(), false, None);
    run(ob, false, Some(3));
    // The resume takes its settings from the run, as `train --resume` does:
    // the precision comes back from the checkpoint, not from a flag.
    let saved = read_train_state(&latest_checkpoint(&b).unwrap()).unwrap().options;
    assert_eq!(saved.precision, Precision::F16);
    run(saved, true, None);
    assert!(
        ckpt_bytes(&a) == ckpt_bytes(&b),
        "parameters or AdamW state differ after resume"
    );
    assert_eq!(losses(&a), losses(&b), "metrics of the resumed run differ");
    // And the precision is applied: the same run in f32 ends elsewhere.
    let mut oc = oa;
    oc.out = c.clone();
    oc.precision = Precision::F32;
    run(oc, false, None);
    assert!(
        ckpt_bytes(&a).0 != ckpt_bytes(&c).0,
        "f16 and f32 runs gave the same parameters"
    );
}

#[test]
fn crash_after_a_save_resumes_from_the_last_complete_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    run(options(&data, &a), false, None);
    run(options(&data, &b), false, Some(4));
    // What a kill during the save of step 6 leaves: a checkpoint directory
    // without checkpoint.json, a torn model file, and metrics lines (one cut
    // short) for steps the checkpoint does not hold.
    let torn = b.join("ckpt-6");
    std::fs::create_dir_all(&torn).unwrap();
    std::fs::write(torn.join("model.safetensors"), b"\x10\x00\x00").unwrap();
    let mut m = std::fs::read_to_string(b.join(METRICS_FILE)).unwrap();
    m.push_str("{\"step\":5,\"loss\":1.0}\n{\"step\":6,\"lo");
    std::fs::write(b.join(METRICS_FILE), m).unwrap();
    assert!(latest_checkpoint(&b).unwrap().ends_with("ckpt-4"));
    run(options(&data, &b), true, None);
    assert!(latest_checkpoint(&b).unwrap().ends_with("ckpt-6"));
    assert!(
        ckpt_bytes(&a) == ckpt_bytes(&b),
        "resumed run differs from the uninterrupted one"
    );
    assert_eq!(losses(&a), losses(&b));
}

#[test]
fn resume_refuses_another_model_and_a_fresh_run_refuses_a_used_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let a = tmp.path().join("a");
    run(options(&data, &a), false, Some(2));
    let err = prepare(options(&data, &a), false).unwrap_err().to_string();
    assert!(err.contains("--out") && err.contains("--resume"), "{err}");
    let mut other = options(&data, &a);
    other.preset = Some("llama-tiny".into());
    let err = prepare(other, true).unwrap_err().to_string();
    assert!(err.contains("gpt2-nano") && err.contains("llama-tiny"), "{err}");
    let mut changed = options(&data, &a);
    changed.lr = 1e-4;
    changed.transport = megatrain_gpu::TransportChoice::Mapped;
    changed.transfer_chunk = Some(64 << 10);
    let p = prepare(changed, true).unwrap();
    assert!(
        p.warnings.iter().any(|w| w
            .strip_prefix(megatrain::run::RESUMED_WITH)
            .is_some_and(|w| w.starts_with("lr:"))),
        "{:?}",
        p.warnings
    );
    // Device options: they change no result, so resuming with them is silent.
    assert!(
        !p.warnings
            .iter()
            .any(|w| w.contains("transport:") || w.contains("transfer_chunk:")),
        "{:?}",
        p.warnings
    );
}

/// `chunk_rows` left to the default resolves from the vocabulary (the
/// README main job's 12 × 64 rows of gpt2-nano in one chunk) and resumes
/// silently; a run saved when the default was a fixed 256 reads back as
/// 256, so resuming it changes nothing.
#[test]
fn default_chunk_rows_resolve_from_the_vocabulary_and_old_runs_keep_256() {
    let main = TrainOptions {
        seq_len: 64,
        batch: 12,
        ..TrainOptions::default()
    };
    assert_eq!(main.chunk_rows, None);
    let nano = megatrain_zoo::preset("gpt2-nano", Some(65)).unwrap();
    let host = megatrain_tensor::HOST_LOGITS_CHUNK_BYTES;
    assert!(main.chunk_rows(nano.vocab_size, host) >= main.batch * main.seq_len);
    let qwen = megatrain_zoo::preset("qwen2.5-7b", None).unwrap();
    assert_eq!(main.chunk_rows(qwen.vocab_size, host), 256);
    assert_eq!(
        main.chunk_rows(qwen.vocab_size, megatrain_tensor::DEVICE_LOGITS_CHUNK_BYTES),
        1664
    );
    let explicit = TrainOptions {
        chunk_rows: Some(7),
        ..TrainOptions::default()
    };
    assert_eq!(explicit.chunk_rows(nano.vocab_size, host), 7);

    let mut old = serde_json::to_value(TrainOptions::default()).unwrap();
    old["chunk_rows"] = 256.into();
    let old: TrainOptions = serde_json::from_value(old).unwrap();
    assert_eq!(old.chunk_rows, Some(256));

    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let (auto, fixed) = (tmp.path().join("auto"), tmp.path().join("fixed"));
    run(options(&data, &auto), false, Some(2));
    let saved = read_train_state(&latest_checkpoint(&auto).unwrap()).unwrap();
    assert_eq!(saved.options.chunk_rows, None);
    let p = prepare(options(&data, &auto), true).unwrap();
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    let with_256 = |out: &Path| TrainOptions {
        chunk_rows: Some(256),
        ..options(&data, out)
    };
    run(with_256(&fixed), false, Some(2));
    let saved = read_train_state(&latest_checkpoint(&fixed).unwrap()).unwrap();
    assert_eq!(saved.options.chunk_rows, Some(256));
    assert!(prepare(saved.options, true).unwrap().warnings.is_empty());
}

/// A Phi-3 model (the zoo's fixture: fused `qkv_proj` and `gate_up_proj`)
/// resumes exactly, and its checkpoints hold the tensors transformers
/// saved, by the same names and shapes, so they load as Phi-3 again.
#[test]
fn a_phi3_run_resumes_exactly_and_saves_the_tensors_transformers_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/phi3");
    let ids: Vec<u8> = (0..900u16)
        .flat_map(|i| ((i * 13 + i / 7) % 87).to_le_bytes())
        .collect();
    std::fs::write(t.join("d.bin"), ids).unwrap();
    let (a, b) = (t.join("a"), t.join("b"));
    let oa = TrainOptions {
        model: Some(fixture.clone()),
        preset: None,
        data: vec![t.join("d.bin")],
        ..options(&t.join("d.bin"), &a)
    };
    let ob = TrainOptions {
        out: b.clone(),
        ..oa.clone()
    };
    run(oa, false, None);
    run(ob.clone(), false, Some(3));
    run(ob, true, None);
    assert!(ckpt_bytes(&a) == ckpt_bytes(&b), "the resumed Phi-3 run differs");
    let names = |file: &Path| {
        let bytes = std::fs::read(file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec()))
            .collect();
        v.sort();
        v
    };
    let saved = latest_checkpoint(&a).unwrap();
    assert_eq!(
        names(&saved.join("model.safetensors")),
        names(&fixture.join("model.safetensors"))
    );
    let loaded = megatrain_zoo::load_hf_dir(&saved).unwrap();
    assert_eq!(loaded.config.arch, megatrain_zoo::Arch::Phi3);
}

/// Two sources drawn 1:3: each keeps its own validation tail, the run
/// resumes bit for bit, and settings that cannot work are refused by name.
#[test]
fn a_mixture_of_sources_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let first = corpus(t);
    let second = t.join("second.txt");
    std::fs::write(&second, "ALL: Speak, speak! We are resolved.\n".repeat(30)).unwrap();
    let (a, b) = (t.join("a"), t.join("b"));
    let oa = TrainOptions {
        data: vec![first.clone(), second.clone()],
        data_weights: vec![1.0, 3.0],
        ..options(&first, &a)
    };
    let p = prepare(oa.clone(), false).unwrap();
    assert_eq!(
        (p.train.parts.len(), p.train.weights.clone()),
        (2, vec![1.0, 3.0])
    );
    let val = p.val.as_ref().unwrap();
    assert_eq!(val.parts.len(), 2, "each source keeps its tail for validation");
    assert!(p.val_names[1].to_string_lossy().contains("second.txt (last 10%)"));
    let ob = TrainOptions {
        out: b.clone(),
        ..oa.clone()
    };
    run(oa.clone(), false, None);
    run(ob.clone(), false, Some(3));
    run(ob, true, None);
    assert!(ckpt_bytes(&a) == ckpt_bytes(&b), "the resumed mixture differs");
    assert_eq!(losses(&a), losses(&b));
    let state = read_train_state(&latest_checkpoint(&a).unwrap()).unwrap();
    assert_eq!(state.options.data, [first.clone(), second.clone()]);
    // One source is still written as one path, as before several existed.
    let one = TrainOptions {
        data: vec![first.clone()],
        ..TrainOptions::default()
    };
    let v = serde_json::to_value(&one).unwrap();
    assert_eq!(v["data"], serde_json::json!(first));
    assert!(v.get("data_weights").is_none());
    let back: TrainOptions = serde_json::from_value(v).unwrap();
    assert_eq!(back.data, vec![first.clone()]);
    // Refused: weights that do not match the sources, or are not positive,
    // and reading several sources in order.
    let refused = |o: TrainOptions, needle: &str| {
        let err = match prepare(o, false) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{err}");
    };
    let fresh = |tweak: &dyn Fn(&mut TrainOptions)| {
        let mut o = TrainOptions {
            out: t.join("c"),
            ..oa.clone()
        };
        tweak(&mut o);
        o
    };
    refused(
        fresh(&|o| o.data_weights = vec![1.0]),
        "--data-weights 1: gives 1 weights for 2",
    );
    refused(fresh(&|o| o.data_weights = vec![1.0, 0.0]), "positive");
    refused(
        fresh(&|o| o.sampling = megatrain::run::SamplingKind::Sequential),
        "several --data sources",
    );
}

/// The first batch (3 rows of 64, drawn as a run seeded 1 draws them) of a
/// run on `data` with options `tweak`ed, prepared in `dir`.
fn first_batch(data: &Path, dir: &Path, tweak: impl Fn(&mut TrainOptions)) -> megatrain::data::Batch {
    let mut o = options(data, dir);
    tweak(&mut o);
    let p = prepare(o, false).unwrap();
    let rows = megatrain::data::Sampling::Random { seed: 1 };
    megatrain::data::draw_batch(&p.train.parts[0], rows, 0, 3, 64, "mem".as_ref()).unwrap()
}

/// `--rows packed` resumes bit for bit: which records a packed row holds
/// depends on every record before it, and a resumed run finds them by
/// walking the record order afresh (the seeded order of several passes:
/// rows of 64 hold about four of these 30 short conversations).
#[test]
fn packed_rows_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let mut lines = String::new();
    for i in 0..30 {
        let answer = "la ".repeat(i % 5);
        lines += &format!(
            "{{\"messages\": [{{\"role\": \"user\", \"content\": \"Q{i}?\"}}, \
             {{\"role\": \"assistant\", \"content\": \"A {answer}.\"}}]}}\n"
        );
    }
    let data = t.join("chat.jsonl");
    std::fs::write(&data, lines).unwrap();
    let template = t.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )
    .unwrap();
    let tweak = |o: &mut TrainOptions| {
        o.rows = megatrain::run::RowsKind::Packed;
        o.tokenizer = "byte".into();
        o.chat_template = template.display().to_string();
        o.seq_len = 64;
    };
    let batch = first_batch(&data, &t.join("probe"), tweak);
    assert!(
        batch.docs.as_ref().is_some_and(|d| d.count() >= 9),
        "{:?}",
        batch.docs
    );
    check_resume_on(&data, tweak);
}

/// `--rows stream-docs` resumes bit for bit, and its rows hold several
/// records, each on its own (documents of `{"text": ...}` records, rows
/// of 64 over records of 9 to 41 bytes and the end of sequence).
#[test]
fn windows_of_records_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let lines: String = (0..40)
        .map(|i| format!("{{\"text\": \"{}\"}}\n", "to be, or not ".repeat(i % 3 + 1)))
        .collect();
    let data = t.join("docs.jsonl");
    std::fs::write(&data, lines).unwrap();
    let tweak = |o: &mut TrainOptions| {
        o.rows = megatrain::run::RowsKind::StreamDocs;
        o.tokenizer = "byte".into();
        o.seq_len = 64;
    };
    let batch = first_batch(&data, &t.join("probe"), tweak);
    assert_eq!(batch.lengths, None, "no padding");
    assert!(
        batch.docs.as_ref().is_some_and(|d| d.count() >= 6),
        "{:?}",
        batch.docs
    );
    check_resume_on(&data, tweak);
}

/// `skip_batches`: a run resumed with batches skipped draws batch
/// `step · grad_accum + N` from then on, through later resumes the same as
/// in one resume to the end (the CLI's resume keeps the run's saved value
/// unless given another); unskipped, it trains otherwise.
#[test]
fn skipped_batches_stay_skipped_through_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    let run_to = |dir: &Path, steps: u64, skip: u64| {
        let mut o = options(&data, dir);
        o.steps = steps;
        o.skip_batches = skip;
        o.save_every = Every::Steps(2);
        // One schedule whatever the steps of each part.
        o.decay_steps = Some(8);
        o
    };
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    for dir in [&a, &b, &c] {
        run(run_to(dir, 4, 0), false, None);
    }
    run(run_to(&a, 8, 3), true, None);
    run(run_to(&b, 6, 3), true, None);
    run(run_to(&b, 8, 3), true, None);
    run(run_to(&c, 8, 0), true, None);
    assert!(ckpt_bytes(&a) == ckpt_bytes(&b), "the offset was not kept");
    assert!(ckpt_bytes(&a) != ckpt_bytes(&c), "skipping changed no batch");
    let state = read_train_state(&latest_checkpoint(&a).unwrap()).unwrap();
    assert_eq!((state.step, state.data_position), (8, 8 + 3));
}
