//! Every data format through `prepare` + `train`, options from TOML, the
//! plan arithmetic against hand-computed numbers, generation and the files
//! a run directory holds.

use std::path::{Path, PathBuf};

use megatrain::run::{
    Every, PlanInput, QuietProgress, Resident, SampleOptions, Schedule, ShareTransport, TrainOptions,
    generate, latest_checkpoint, most_kept, pick, plan, prepare, train,
};
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::{HfCheckpoint, preset};
use rand::SeedableRng;

fn small(data: PathBuf, out: &Path, preset: &str) -> TrainOptions {
    TrainOptions {
        preset: Some(preset.into()),
        data: vec![data],
        seq_len: 8,
        batch: 2,
        steps: 2,
        eval_every: Every::Steps(1),
        eval_batches: 1,
        val_fraction: 0.2,
        out: out.to_path_buf(),
        ..TrainOptions::default()
    }
}

/// A fresh run of `opts` on the CPU, to its end.
fn trained(opts: TrainOptions) -> megatrain::run::Summary {
    train_prepared(&mut prepare(opts, false).unwrap())
}

fn train_prepared(p: &mut megatrain::run::Prepared) -> megatrain::run::Summary {
    train(megatrain_tensor::CpuExecutor::new(), p, None, &mut QuietProgress).unwrap()
}

/// `a.jsonl` in `dir`: 20 Alpaca records (one row each).
fn alpaca_records(dir: &Path) -> PathBuf {
    let path = dir.join("a.jsonl");
    let record = r#"{"instruction": "Say hi", "input": "", "output": "hi"}
"#;
    std::fs::write(&path, record.repeat(20)).unwrap();
    path
}

fn train_ok(opts: TrainOptions) -> megatrain::run::Summary {
    let s = trained(opts);
    assert_eq!(s.step, 2);
    assert!(s.loss.unwrap().is_finite());
    s
}

#[test]
fn text_file_directory_and_bin_train() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let text = "to be, or not to be: that is the question.\n".repeat(8);
    std::fs::write(t.join("a.txt"), &text).unwrap();
    let dir = t.join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("1.txt"), &text).unwrap();
    std::fs::write(dir.join("2.txt"), text.to_uppercase()).unwrap();
    std::fs::write(dir.join("skip.md"), "ignored ~~~").unwrap();
    let s = train_ok(small(t.join("a.txt"), &t.join("r1"), "gpt2-nano"));
    assert!(s.val_loss.unwrap().is_finite());
    // A fresh run's text ids went to its run directory (the next resume
    // maps them); a token file's did not.
    let cached = |run: &str| std::fs::read_dir(t.join(run).join("tokens")).map_or(0, |d| d.count());
    assert_eq!(cached("r1"), 1);
    let p = prepare(small(dir.clone(), &t.join("r2"), "gpt2-nano"), false).unwrap();
    assert_eq!(p.model.vocab_size, {
        let mut c: Vec<char> = (text.clone() + &text.to_uppercase()).chars().collect();
        c.sort();
        c.dedup();
        c.len()
    });
    train_ok(small(dir, &t.join("r2b"), "gpt2-nano"));
    // nanoGPT .bin: u16 little-endian ids; the vocabulary comes from the flag.
    let ids: Vec<u8> = (0..400u16).flat_map(|i| (i % 50).to_le_bytes()).collect();
    std::fs::write(t.join("train.bin"), ids).unwrap();
    let mut o = small(t.join("train.bin"), &t.join("r3"), "gpt2-nano");
    o.vocab_size = Some(50);
    let p = prepare(o.clone(), false).unwrap();
    assert_eq!(p.model.vocab_size, 50);
    assert_eq!(p.train.len() + p.val.as_ref().unwrap().len(), 400);
    train_ok(o);
    assert_eq!(cached("r3"), 0);
    // The same ids as u32: the same run.
    let ids: Vec<u8> = (0..400u32).flat_map(|i| (i % 50).to_le_bytes()).collect();
    std::fs::write(t.join("train.u32"), ids).unwrap();
    let mut o = small(t.join("train.u32"), &t.join("r3b"), "gpt2-nano");
    o.vocab_size = Some(50);
    let q = prepare(o.clone(), false).unwrap();
    assert_eq!(q.train.parts[0].tokens, p.train.parts[0].tokens);
    assert_eq!(
        q.val.as_ref().unwrap().parts[0].tokens,
        p.val.as_ref().unwrap().parts[0].tokens
    );
    train_ok(o);
    // Llama with byte tokens over the same text.
    train_ok(small(t.join("a.txt"), &t.join("r4"), "llama-tiny"));
}

#[test]
fn alpaca_and_sharegpt_count_only_responses() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let alpaca = r#"{"instruction": "Say hi", "input": "", "output": "hi"}
{"instruction": "Add", "input": "1+1", "output": "2"}
"#
    .repeat(6);
    let share = r#"{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hello."}]}
"#
    .repeat(6);
    std::fs::write(t.join("a.jsonl"), alpaca).unwrap();
    std::fs::write(t.join("s.jsonl"), share).unwrap();
    for (f, out) in [("a.jsonl", "ra"), ("s.jsonl", "rs")] {
        for preset in ["gpt2-nano", "llama-tiny"] {
            // Windows of the stream: the subject is the mask, and rows of 8
            // tokens from a record's start would end inside its prompt.
            let o = TrainOptions {
                rows: megatrain::run::RowsKind::Stream,
                ..small(t.join(f), &t.join(format!("{out}-{preset}")), preset)
            };
            let p = prepare(o.clone(), false).unwrap();
            let mask = p.train.parts[0].loss_mask.as_ref().unwrap();
            let counted = mask.iter().filter(|&m| m).count();
            assert!(
                counted > 0 && counted < mask.len() / 2,
                "{f}: {counted} of {}",
                mask.len()
            );
            train_ok(o);
        }
    }
}

/// `epochs` sets the steps from one pass over the training data: a row a
/// record, the packed rows of a pass, or the stream's windows; over every
/// source; rows a step counted over ranks and micro-batches.
#[test]
fn epochs_and_a_warmup_ratio_count_the_steps_of_passes_over_the_data() {
    use megatrain::run::RowsKind;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    alpaca_records(t);
    let text = "to be, or not to be: that is the question.\n".repeat(40);
    std::fs::write(t.join("b.txt"), &text).unwrap();
    let opts = |data: &str, rows: RowsKind, epochs: f64, out: &str| TrainOptions {
        rows,
        epochs: Some(epochs),
        val_fraction: 0.0,
        seq_len: 512,
        ..small(t.join(data), &t.join(out), "llama-tiny")
    };
    // 20 records one a row, batch 2: 10 steps a pass; a warmup ratio is
    // of the passes' steps (transformers' ⌈ratio × steps⌉).
    let o = TrainOptions {
        warmup_ratio: Some(0.05),
        ..opts("a.jsonl", RowsKind::Records, 3.0, "r1")
    };
    let p = prepare(o, false).unwrap();
    assert_eq!(p.train.rows_per_pass(512), 20);
    assert_eq!((p.opts.steps, p.opts.warmup), (30, 2));
    let long_warmup =
        |p: &megatrain::run::Prepared| p.warnings.iter().any(|w| w.contains("is not shorter than"));
    assert!(!long_warmup(&p), "{:?}", p.warnings);
    // And of --steps without epochs.
    let o = TrainOptions {
        epochs: None,
        steps: 7,
        warmup_ratio: Some(0.5),
        ..opts("a.jsonl", RowsKind::Records, 1.0, "r1b")
    };
    assert_eq!(prepare(o, false).unwrap().opts.warmup, 4);
    for bad in [1.0, -0.1, f64::NAN] {
        let o = TrainOptions {
            warmup_ratio: Some(bad),
            ..opts("a.jsonl", RowsKind::Records, 1.0, "r1c")
        };
        let e = prepare(o, false).err().unwrap().to_string();
        assert!(e.contains("--warmup-ratio") && e.contains("[0, 1)"), "{e}");
    }
    let p = prepare(opts("a.jsonl", RowsKind::Records, 0.25, "r2"), false).unwrap();
    assert_eq!(p.opts.steps, 3, "⌈0.25 × 20 / 2⌉");
    // The default warmup outlasts so short a run: said.
    let said = p
        .warnings
        .iter()
        .find(|w| w.contains("is not shorter than"))
        .expect("a warning");
    assert!(
        said.contains("--warmup 100") && said.contains("3 steps") && said.contains("--warmup-ratio"),
        "{said}"
    );
    // Packed: several records a row, so fewer rows and steps a pass.
    let p = prepare(opts("a.jsonl", RowsKind::Packed, 1.0, "r3"), false).unwrap();
    let rows = p.train.rows_per_pass(512);
    assert!(rows > 0 && rows < 20, "{rows}");
    assert_eq!(p.opts.steps, rows.div_ceil(2));
    // Windows of a stream of n tokens: (n − 1) / T rows (3 here); with 2
    // micro-batches a step, twice the rows a step.
    let o = TrainOptions {
        grad_accum: 2,
        ..opts("b.txt", RowsKind::Stream, 2.0, "r4")
    };
    let p = prepare(o, false).unwrap();
    let n = p.train.len() as u64;
    assert_eq!(p.train.rows_per_pass(512), (n - 1) / 512);
    assert_eq!(p.opts.steps, (2 * ((n - 1) / 512)).div_ceil(4).max(1));
    // Both sources: their passes add up.
    let o = TrainOptions {
        data: vec![t.join("a.jsonl"), t.join("b.txt")],
        rows: RowsKind::Auto,
        ..opts("a.jsonl", RowsKind::Auto, 1.0, "r5")
    };
    let p = prepare(o, false).unwrap();
    assert_eq!(p.train.rows_per_pass(512), 20 + (n - 1) / 512);
    // A cooldown longer than the passes' steps is refused as for --steps.
    let o = TrainOptions {
        schedule: Schedule::Wsd,
        cooldown: Some(50),
        ..opts("a.jsonl", RowsKind::Records, 1.0, "r6")
    };
    let e = prepare(o, false).err().unwrap().to_string();
    assert!(e.contains("--cooldown 50") && e.contains("10 steps"), "{e}");
    for bad in [0.0, -1.0, f64::NAN] {
        let e = prepare(opts("a.jsonl", RowsKind::Records, bad, "r7"), false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--epochs") && e.contains("positive"), "{e}");
    }
    // It trains to the end of its passes.
    train_ok_steps(
        TrainOptions {
            eval_every: Every::Steps(0),
            ..opts("a.jsonl", RowsKind::Records, 0.4, "r8")
        },
        4,
    );
}

/// `--eval-every epoch`, `--save-every epoch` and `--sample-every epoch`:
/// an evaluation at the start, then an evaluation, a checkpoint and a
/// sample in the step each pass ends in, and all three at the end.
#[test]
fn epoch_evaluates_and_saves_where_each_pass_ends() {
    use megatrain::run::RowsKind;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = alpaca_records(t);
    let run = t.join("r");
    let o = TrainOptions {
        rows: RowsKind::Records,
        epochs: Some(2.5),
        val_fraction: 0.2,
        seq_len: 64,
        batch: 3,
        eval_every: Every::Epoch,
        save_every: Every::Epoch,
        sample_every: Every::Epoch,
        sample_tokens: 3,
        ..small(data, &run, "llama-tiny")
    };
    let mut p = prepare(o, false).unwrap();
    // 16 records a pass, 3 a step: 14 steps; passes end in steps 6 (rows
    // 16..18) and 11 (31..33).
    assert_eq!((p.rows_per_pass, p.opts.steps), (16, 14));
    train_prepared(&mut p);
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let steps_with = |key: &str| -> Vec<u64> {
        log.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v.get(key).is_some())
            .map(|v| v["step"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(steps_with("val_loss"), [0, 6, 11, 14]);
    assert_eq!(steps_with("sample"), [6, 11, 14]);
    let mut saved: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ckpt-"))
        .collect();
    saved.sort_by_key(|n| n[5..].parse::<u64>().unwrap());
    assert_eq!(saved, ["ckpt-6", "ckpt-11", "ckpt-14"]);
}

#[test]
fn toml_config_is_overridden_by_later_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("c.toml");
    let text = "preset = \"gpt2-nano\"\nseq-len = 32\nbatch_size_typo = 1\n";
    let err = TrainOptions::default()
        .overlay_toml(text, &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("c.toml") && err.contains("batch_size_typo"), "{err}");
    let o = TrainOptions::default()
        .overlay_toml("seq-len = 32\nlr = 0.01\nschedule = \"constant\"\n", &path)
        .unwrap();
    assert_eq!((o.seq_len, o.lr, o.batch), (32, 0.01, 12));
    let err = TrainOptions::default()
        .overlay_toml("schedule = \"wsd_sqrt\"\n", &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("wsd_sqrt"), "{err}");
    let o = TrainOptions::default()
        .overlay_toml(
            "schedule = \"wsd-sqrt\"\ncooldown = 40\ntensorboard = true\n",
            &path,
        )
        .unwrap();
    assert_eq!(
        (o.schedule, o.cooldown, o.tensorboard),
        (Schedule::WsdSqrt, Some(40), true)
    );
    let o = TrainOptions::default()
        .overlay_toml("transport = \"staging\"\n", &path)
        .unwrap();
    assert_eq!(o.transport, megatrain_gpu::TransportChoice::Staging);
    assert_eq!(
        TrainOptions::default().transport,
        megatrain_gpu::TransportChoice::Auto
    );
    // `share-transport`: a name, or a boolean for true and false.
    for (text, want) in [
        ("share-transport = \"auto\"\n", ShareTransport::Auto),
        ("share-transport = true\n", ShareTransport::True),
        ("share-transport = \"false\"\n", ShareTransport::False),
        ("share_transport = false\n", ShareTransport::False),
    ] {
        let o = TrainOptions::default().overlay_toml(text, &path).unwrap();
        assert_eq!(o.share_transport, want, "{text}");
    }
    assert_eq!(TrainOptions::default().share_transport, ShareTransport::Auto);
    let err = TrainOptions::default()
        .overlay_toml("share-transport = \"yes\"\n", &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown share-transport 'yes'"), "{err}");
    let err = TrainOptions::default()
        .overlay_toml("transport = \"dma\"\n", &path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("c.toml") && err.contains("unknown transport 'dma'"),
        "{err}"
    );
}

#[test]
fn plan_arithmetic_matches_hand_computation() {
    // llama-tiny: V 256, C 64, I 176, 2 blocks, 4 heads (q 64), 2 kv heads (kv 32), untied.
    // Layers: embedding 256·64 = 16384; block: 2 norms (128) + q,o 2·4096 + k,v 2·2048
    // + gate,up,down 3·11264 = 46208 (46080 in matrices); head: norm 64 + 16384 = 16448.
    let m = preset("llama-tiny", None).unwrap();
    let input = PlanInput {
        batch: 2,
        seq_len: 8,
        checkpoint_every: 1,
        keep_activations: 0,
        chunk_rows: 256,
        transport: TransportDType::F32,
        hold_grads: false,
        carry_layers: 0,
        carry_order: Default::default(),
        optimizer_queue: megatrain::trainer::DEFAULT_OPTIMIZER_QUEUE,
        embedding_rows: false,
    };
    let p = plan(&m, &input, &TierConfig::default()).unwrap();
    assert_eq!(p.host.n_params, 16384 + 2 * 46208 + 16448);
    // Chunks of at most 8 Mi elements, here the whole block: a block's (one)
    // in flight down, the optimizer queue's two, the one it reads and the
    // one being sent (a GPU's readback buffers, read in place).
    assert_eq!(p.host_staging, 5 * 4 * 46208);
    let d = p.device;
    assert_eq!(d.weights, 65536 + 65792 + 2 * 46208 * 4);
    // Two neighbouring layers' gradients: the two blocks'.
    assert_eq!(d.gradients, 4 * 2 * 46208);
    assert_eq!(d.checkpoints, 2 * (2 * 8 * 64 * 4));
    assert_eq!(d.hidden, 2 * (2 * 8 * 64 * 4));
    // 4·B·T·(6C + 2q + 2kv + 3I) + 4·B·H·T·2 = 4·16·1104 + 512.
    assert_eq!(d.recompute, 70656 + 512);
    assert_eq!(d.head, 2 * 16 * 256 * 4);
    // A copy queue's download staging: a buffer for each chunk the host
    // holds, of the chunk's size class (184832 bytes rounded to a quarter of
    // a power of two).
    assert_eq!(d.download_staging, 5 * 196_608);
    assert_eq!(
        d.total(),
        500992 + 2 * 184832 + 8192 + 8192 + 71168 + 32768 + 983_040
    );
    // bf16 transport halves the matrices only; K = 2 holds one checkpoint
    // and recomputes two blocks.
    let bf = PlanInput {
        transport: TransportDType::BF16,
        checkpoint_every: 2,
        ..input
    };
    let tier = TierConfig {
        transport: TransportDType::BF16,
        ..TierConfig::default()
    };
    let q = plan(&m, &bf, &tier).unwrap();
    assert_eq!(
        q.device.weights,
        16384 * 2 + (64 * 4 + 16384 * 2) + 2 * 2 * (46080 * 2 + 128 * 4)
    );
    assert_eq!(q.device.checkpoints, 2 * 8 * 64 * 4);
    assert_eq!(q.device.recompute, 2 * 71168);
    assert_eq!((d.f16_copies, q.device.f16_copies), (0, 0));
    // f16 transport computes in f16: the tensor-core kernels' f16 copies of
    // the K blocks' matmul inputs, 2·B·T·(2C + q + I) bytes each, and (in
    // the head's line) of the head chunk's logit gradient, 2·rows·V.
    let f = PlanInput {
        transport: TransportDType::F16,
        ..bf
    };
    let h = plan(&m, &f, &TierConfig::default()).unwrap();
    assert_eq!(h.device.f16_copies, 2 * (2 * 16 * (128 + 64 + 176)));
    assert_eq!(h.device.head, d.head + 2 * 16 * 256);
    // Blocks that keep their activations: their weights (a slot each) and
    // saved tensors (and f16 copies) from the forward on, no checkpoint,
    // and a group to recompute only where some block is not kept.
    let keep = |keep_activations, transport| {
        let i = PlanInput {
            keep_activations,
            transport,
            ..input
        };
        plan(&m, &i, &TierConfig::default()).unwrap().device
    };
    let one = keep(1, TransportDType::F32);
    let block = 4 * 46208;
    assert_eq!(
        (one.kept, one.recompute, one.checkpoints),
        (block + 71168, 71168, 2 * 8 * 64 * 4)
    );
    let all = keep(2, TransportDType::F32);
    assert_eq!(
        (all.kept, all.recompute, all.checkpoints),
        (2 * (block + 71168), 0, 0)
    );
    assert_eq!(
        all.total(),
        d.total() - d.recompute - d.checkpoints + 2 * (block + 71168)
    );
    // The kept blocks are freed before a group is recomputed: the larger of
    // the two counts, not both.
    assert_eq!(one.total(), d.total() - 2 * 8 * 64 * 4 - 71168 + block + 71168);
    let all_f16 = keep(2, TransportDType::F16);
    assert_eq!(
        all_f16.kept,
        2 * ((46080 * 2 + 128 * 4) + 71168 + 2 * 16 * (128 + 64 + 176))
    );
    assert_eq!(all_f16.f16_copies, 0);
    // `plan --device-mem` picks the most kept blocks that fit.
    let most = |mem| most_kept(&m, &input, &TierConfig::default(), mem).unwrap();
    assert!(one.total() < all.total());
    assert_eq!(most(all.total()), Some(2));
    assert_eq!(most(all.total() - 1), Some(1));
    assert_eq!(most(one.total()), Some(1));
    assert_eq!(most(d.total()), Some(0));
    assert_eq!(most(d.total() - 1), None);
    // Host: 14 bytes per parameter with bf16 transport (plus page padding).
    let per = q.host.ram.total() as f64 / q.host.n_params as f64;
    assert!((14.0..15.0).contains(&per), "{per}");
    assert!(p.host.ram.total() as f64 / p.host.n_params as f64 >= 16.0);
}

/// `a.txt` in `dir`: four lines of "abc" over and over, which a few
/// dozen steps learn.
fn abc_text(dir: &Path) {
    std::fs::write(dir.join("a.txt"), ("abc".repeat(14) + "\n").repeat(4)).unwrap();
}

/// `sample_every` prints what the model writes between steps without
/// changing the run: the same losses step for step as a run without it,
/// samples at the steps it names and at the end, and the last one what
/// the final checkpoint generates with the same settings.
#[test]
fn a_run_samples_as_it_learns_and_trains_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    abc_text(t);
    let run = |name: &str, sample_every| {
        let mut o = small(t.join("a.txt"), &t.join(name), "gpt2-nano");
        o.steps = 60;
        o.lr = 1e-2;
        o.warmup = 2;
        o.eval_every = Every::Steps(20);
        o.sample_every = Every::Steps(sample_every);
        o.sample_prompt = "ab".into();
        o.sample_tokens = 10;
        train_ok_steps(o, 60);
        let log = std::fs::read_to_string(t.join(name).join("metrics.jsonl")).unwrap();
        log.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let (plain, sampled) = (run("plain", 0), run("sampled", 25));
    let field = |recs: &[serde_json::Value], key: &str| -> Vec<(u64, serde_json::Value)> {
        recs.iter()
            .filter_map(|r| Some((r["step"].as_u64()?, r.get(key)?.clone())))
            .collect()
    };
    assert_eq!(field(&plain, "loss").len(), 60);
    assert_eq!(field(&plain, "loss"), field(&sampled, "loss"), "the same losses");
    assert_eq!(field(&plain, "val_loss"), field(&sampled, "val_loss"));
    let samples = field(&sampled, "sample");
    let steps: Vec<u64> = samples.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [25, 50, 60], "every 25 steps and at the end");
    assert!(field(&plain, "sample").is_empty());
    let last = samples[2].1.as_str().unwrap();
    let hf = HfCheckpoint::open(latest_checkpoint(&t.join("sampled")).unwrap()).unwrap();
    let ex = megatrain_tensor::CpuExecutor::new();
    let model = Resident::load(&ex, &hf).unwrap();
    let enc =
        megatrain::run::Encoder::from_dir(&latest_checkpoint(&t.join("sampled")).unwrap(), None).unwrap();
    let opts = SampleOptions {
        tokens: 10,
        temperature: 0.8,
        top_k: 200,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        seed: TrainOptions::default().seed + 60,
        decodable: enc.tokenizer.vocab_size(),
        kv_cache: true,
    };
    let ids = generate(&model, &enc.tokenizer.encode("ab").unwrap(), opts).unwrap();
    assert_eq!(last, format!("ab{}", enc.tokenizer.decode(&ids).unwrap()));
    // A prompt the run's tokenizer cannot spell is refused before it starts.
    let mut o = small(t.join("a.txt"), &t.join("refused"), "gpt2-nano");
    o.sample_every = Every::Steps(10);
    o.sample_prompt = "xyz".into();
    let Err(err) = prepare(o, false) else {
        panic!("a prompt of characters the vocabulary lacks is refused")
    };
    assert!(err.to_string().contains("--sample-prompt"), "{err}");
}

#[test]
fn run_directory_checkpoint_loads_as_hf_and_samples_deterministically() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    abc_text(t);
    let mut o = small(t.join("a.txt"), &t.join("run"), "gpt2-nano");
    o.steps = 80;
    o.lr = 1e-2;
    o.warmup = 2;
    o.eval_every = Every::Steps(10);
    train_ok_steps(o, 80);
    let run = t.join("run");
    for f in ["metrics.jsonl", "loss.svg", "latest"] {
        assert!(run.join(f).exists(), "{f}");
    }
    let svg = std::fs::read_to_string(run.join("loss.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("validation"));
    let ckpt = latest_checkpoint(&run).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "char_vocab.json",
        "train_state.json",
    ] {
        assert!(ckpt.join(f).exists(), "{f}");
    }
    let hf = HfCheckpoint::open(&ckpt).unwrap();
    let ex = megatrain_tensor::CpuExecutor::new();
    let model = Resident::load(&ex, &hf).unwrap();
    let greedy = SampleOptions {
        tokens: 12,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        seed: 1,
        decodable: 0,
        kv_cache: true,
    };
    let enc = megatrain::run::Encoder::from_dir(&ckpt, None).unwrap();
    let prompt = enc.tokenizer.encode("abc").unwrap();
    let out = generate(&model, &prompt, greedy).unwrap();
    assert_eq!(
        enc.tokenizer.decode(&out).unwrap(),
        "abcabcabcabc",
        "80 steps learn 'abc'"
    );
    let warm = SampleOptions {
        temperature: 1.0,
        top_k: 2,
        seed: 7,
        ..greedy
    };
    let x = generate(&model, &prompt, warm).unwrap();
    assert_eq!(x, generate(&model, &prompt, warm).unwrap(), "seeded");
    let uncached = SampleOptions {
        kv_cache: false,
        ..warm
    };
    assert_eq!(
        x,
        generate(&model, &prompt, uncached).unwrap(),
        "cached as uncached"
    );
    assert!(generate(&model, &[], greedy).is_err());
    // Only ids the tokenizer decodes are picked.
    for opts in [greedy, warm] {
        let only = SampleOptions { decodable: 2, ..opts };
        assert!(generate(&model, &prompt, only).unwrap().iter().all(|&t| t < 2));
    }
    // A stop id ends the reply before it.
    let c = enc.tokenizer.encode("c").unwrap();
    let until = megatrain::run::generate_until(&model, &prompt, greedy, &c).unwrap();
    assert_eq!(enc.tokenizer.decode(&until).unwrap(), "ab");
}

fn train_ok_steps(opts: TrainOptions, steps: u64) {
    assert_eq!(trained(opts).step, steps);
}

fn warm(temperature: f64, top_k: usize, top_p: f64, min_p: f64) -> SampleOptions {
    SampleOptions {
        tokens: 1,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty: 1.0,
        seed: 0,
        decodable: 0,
        kv_cache: true,
    }
}

#[test]
fn top_k_top_p_min_p_and_temperature_pick_from_the_right_set() {
    let logits = [0.0f32, 5.0, 4.9, -3.0];
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut seen = |o: SampleOptions| -> std::collections::BTreeSet<u32> {
        (0..2000).map(|_| pick(&logits, &o, &mut rng)).collect()
    };
    assert_eq!(seen(warm(0.0, 0, 1.0, 0.0)), [1].into());
    assert_eq!(seen(warm(1.0, 2, 1.0, 0.0)), [1, 2].into());
    assert_eq!(
        seen(warm(5.0, 0, 1.0, 0.0)),
        [0, 1, 2, 3].into(),
        "a high temperature reaches every token"
    );
    // At temperature 1 token 1 alone has p = 0.52, with token 2 0.99.
    assert_eq!(seen(warm(1.0, 0, 0.5, 0.0)), [1].into());
    assert_eq!(seen(warm(1.0, 0, 0.9, 0.0)), [1, 2].into());
    // At 5 the sums in order are 0.39, 0.78, 0.92, 1: top-p 0.9 leaves out
    // token 3, and top-k 2 comes first.
    assert_eq!(seen(warm(5.0, 0, 0.9, 0.0)), [0, 1, 2].into());
    assert_eq!(seen(warm(5.0, 2, 0.9, 0.0)), [1, 2].into());
    // At 5, tokens 2, 0 and 3 are 0.98, 0.37 and 0.20 times as likely as
    // token 1: min-p 0.3 keeps three, 0.99 token 1 alone.
    assert_eq!(seen(warm(5.0, 0, 1.0, 0.3)), [0, 1, 2].into());
    assert_eq!(seen(warm(5.0, 0, 1.0, 0.99)), [1].into());
    assert_eq!(seen(warm(5.0, 0, 0.9, 0.5)), [1, 2].into(), "after top-p");
}

/// The penalty divides the logits of the ids seen (once each, however
/// often seen) where positive and multiplies them where negative, greedy
/// included, and leaves the others.
#[test]
fn the_repetition_penalty_lowers_the_ids_already_seen() {
    let logits = [0.0f32, 5.0, 4.9, -3.0];
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let greedy = |penalty| SampleOptions {
        repetition_penalty: penalty,
        ..warm(0.0, 0, 1.0, 0.0)
    };
    assert_eq!(greedy(1.0).choose(&logits, &[1, 1], &mut rng), 1);
    // 5 / 1.03 = 4.85 < 4.9, whichever number of times 1 was seen.
    assert_eq!(greedy(1.03).choose(&logits, &[1], &mut rng), 2);
    assert_eq!(greedy(1.03).choose(&logits, &[1, 1, 1, 1], &mut rng), 2);
    // 5 / 1.01 = 4.95 is still the most likely.
    assert_eq!(greedy(1.01).choose(&logits, &[1, 1, 1, 1], &mut rng), 1);
    // A negative logit is multiplied: -1 · 3 falls below -2.
    let negative = [-1.0f32, -2.0];
    assert_eq!(greedy(1.0).choose(&negative, &[0], &mut rng), 0);
    assert_eq!(greedy(3.0).choose(&negative, &[0], &mut rng), 1);
    // Only decodable ids are picked; a seen id past them is passed over.
    let only = SampleOptions {
        decodable: 2,
        ..greedy(1.03)
    };
    assert_eq!(only.choose(&logits, &[1, 3], &mut rng), 1);
    assert_eq!(only.choose(&[0.0, -1.0, 9.0], &[1, 2], &mut rng), 0);
}

/// `generation_config.json` as transformers' generate reads it: nothing
/// where it does not say `do_sample`, greedy where it says false, and
/// transformers' defaults for the keys a sampling one leaves out; a value
/// out of range is refused naming the file and key.
#[test]
fn a_models_generation_config_gives_its_sampling_settings() {
    use megatrain::run::GenerationConfig;
    let dir = tempfile::tempdir().unwrap();
    let of = |text: Option<&str>| {
        let path = dir.path().join("generation_config.json");
        let _ = std::fs::remove_file(&path);
        if let Some(t) = text {
            std::fs::write(&path, t).unwrap();
        }
        GenerationConfig::of_dir(dir.path())
    };
    assert_eq!(of(None).unwrap(), None);
    assert_eq!(of(Some(r#"{"eos_token_id": 2}"#)).unwrap(), None);
    let hf = |temperature, top_k, top_p, min_p, repetition_penalty| GenerationConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
    };
    assert_eq!(
        of(Some(r#"{"do_sample": false}"#)).unwrap(),
        Some(hf(0.0, 50, 1.0, 0.0, 1.0))
    );
    assert_eq!(
        of(Some(r#"{"do_sample": true}"#)).unwrap(),
        Some(hf(1.0, 50, 1.0, 0.0, 1.0))
    );
    let qwen =
        r#"{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}"#;
    assert_eq!(of(Some(qwen)).unwrap(), Some(hf(0.7, 20, 0.8, 0.0, 1.05)));
    for bad in [
        r#"{"do_sample": true, "top_p": 0}"#,
        r#"{"do_sample": "yes"}"#,
        r#"{"do_sample": true, "temperature": -1}"#,
        "{",
    ] {
        let err = of(Some(bad)).unwrap_err().to_string();
        assert!(err.contains("generation_config.json"), "{bad}: {err}");
    }
}

/// The llama_gqa fixture of the zoo: a small random HF Llama (vocab 101).
fn hf_fixture(tmp: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/llama_gqa");
    let dst = tmp.join("hf_llama");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    dst
}

#[test]
fn fine_tunes_a_hugging_face_model_and_refuses_a_tokenizer_too_large_for_it() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let hf = hf_fixture(t);
    let ids: Vec<u8> = (0..600u16).flat_map(|i| ((i * 7) % 101).to_le_bytes()).collect();
    std::fs::write(t.join("d.bin"), ids).unwrap();
    let opts = TrainOptions {
        model: Some(hf.clone()),
        preset: None,
        ..small(t.join("d.bin"), &t.join("ft"), "")
    };
    let mut p = prepare(opts.clone(), false).unwrap();
    assert_eq!(p.model.vocab_size, 101);
    let before = HfCheckpoint::open(&hf).unwrap().read_layer(1).unwrap().1;
    let s = train(
        megatrain_tensor::CpuExecutor::new(),
        &mut p,
        None,
        &mut QuietProgress,
    )
    .unwrap();
    let after = HfCheckpoint::open(s.checkpoint.unwrap()).unwrap();
    assert_eq!(after.config.vocab_size, 101);
    let moved = after.read_layer(1).unwrap().1;
    assert_eq!(moved.len(), before.len());
    assert!(moved != before, "training changed the loaded weights");
    // The fixture's BPE tokenizer has 300 tokens: text cannot fit vocab 101.
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/tokenizer/tokenizer.json"),
        hf.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(t.join("a.txt"), "hello world ".repeat(50)).unwrap();
    let text = TrainOptions {
        data: vec![t.join("a.txt")],
        out: t.join("ft2"),
        ..opts
    };
    let err = prepare(text, false).unwrap_err().to_string();
    assert!(err.contains("300") && err.contains("101"), "{err}");
}

/// A multimodal checkpoint (Gemma 3's; Qwen3.5's, with multi-token
/// prediction tensors the text model does not have) trains as its text
/// model: prepare says so, and the run's checkpoint is that text model
/// (no vision tower) with the trained weights.
#[test]
fn fine_tunes_the_text_model_of_a_multimodal_checkpoint() {
    for (case, mm, text, vocab) in [
        (
            "gemma3_mm",
            "Gemma3ForConditionalGeneration",
            "Gemma3ForCausalLM",
            97u16,
        ),
        (
            "qwen3_5_mm",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5ForCausalLM",
            90,
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("crates/zoo/tests/fixtures")
            .join(case);
        let ids: Vec<u8> = (0..600u16)
            .flat_map(|i| ((i * 7) % vocab).to_le_bytes())
            .collect();
        std::fs::write(t.join("d.bin"), ids).unwrap();
        let opts = TrainOptions {
            model: Some(src.clone()),
            preset: None,
            ..small(t.join("d.bin"), &t.join("ft"), "")
        };
        let mut p = prepare(opts, false).unwrap();
        assert!(
            p.warnings.iter().any(|w| w.contains(mm) && w.contains(text)),
            "{case}: {:?}",
            p.warnings
        );
        let s = train(
            megatrain_tensor::CpuExecutor::new(),
            &mut p,
            None,
            &mut QuietProgress,
        )
        .unwrap();
        let after = HfCheckpoint::open(s.checkpoint.unwrap()).unwrap();
        assert_eq!(after.config.text_of, None);
        assert_eq!(after.config.raw.as_ref().unwrap()["architectures"][0], text);
        let before = HfCheckpoint::open(&src).unwrap().read_layer(2).unwrap().1;
        let moved = after.read_layer(2).unwrap().1;
        assert_eq!(moved.len(), before.len());
        assert!(moved != before, "{case}: training changed the loaded weights");
    }
}

/// `--rows`: a `.jsonl` source gives one record a row by default (its
/// validation split between records, a long record's cut said by name),
/// `stream` gives windows of it, `records` refuses a source without
/// records by name, `packed` packs them (a model with linear-attention
/// blocks too), the run keeps the option for `--resume`, and a
/// state saved before the option existed drew windows.
#[test]
fn jsonl_rows_are_whole_records_unless_asked_for_windows() {
    use megatrain::data::Fit;
    use megatrain::run::{Packing, RowsKind, latest_checkpoint, read_train_state};
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let mut lines = String::new();
    for i in 0..12 {
        let answer = "long answer ".repeat(i % 4);
        lines += &format!("{{\"instruction\": \"Q{i}\", \"input\": \"\", \"output\": \"A{answer}\"}}\n");
    }
    std::fs::write(t.join("a.jsonl"), lines).unwrap();
    std::fs::write(t.join("b.txt"), "plain text ".repeat(40)).unwrap();
    let mut o = small(t.join("a.jsonl"), &t.join("run"), "llama-tiny");
    o.tokenizer = "byte".into();
    o.seq_len = 48;
    let p = prepare(o.clone(), false).unwrap();
    let (train_part, val) = (&p.train.parts[0], &p.val.as_ref().unwrap().parts[0]);
    let (tr, vr) = (
        train_part.records.as_ref().unwrap(),
        val.records.as_ref().unwrap(),
    );
    assert_eq!(tr.len() + vr.len(), 12, "every record on one side");
    // Records with three long answers run past 49 tokens: said, with the file.
    let cut = p
        .warnings
        .iter()
        .find(|w| w.contains("longer than --seq-len"))
        .unwrap();
    assert!(cut.contains("a.jsonl"), "{cut}");
    assert!(matches!(o.rows, RowsKind::Auto));
    trained(o.clone());
    let state = read_train_state(&latest_checkpoint(&t.join("run")).unwrap()).unwrap();
    assert_eq!(state.options.rows, RowsKind::Auto);

    let stream = TrainOptions {
        rows: RowsKind::Stream,
        out: t.join("run-stream"),
        ..o.clone()
    };
    let p = prepare(stream, false).unwrap();
    assert!(p.train.parts[0].records.is_none());

    let packed = TrainOptions {
        rows: RowsKind::Packed,
        out: t.join("run-packed"),
        ..o.clone()
    };
    let p = prepare(packed.clone(), false).unwrap();
    assert_eq!(p.train.parts[0].records.as_ref().unwrap().fit(), Some(Fit::Best));
    let next = TrainOptions {
        packing: Packing::NextFit,
        ..packed.clone()
    };
    let q = prepare(next, false).unwrap();
    assert_eq!(q.train.parts[0].records.as_ref().unwrap().fit(), Some(Fit::Next));
    assert!(
        p.val.as_ref().unwrap().parts[0]
            .records
            .as_ref()
            .unwrap()
            .is_packed()
    );
    let s = trained(packed);
    assert!(s.loss.is_some_and(f64::is_finite) && s.val_loss.is_some_and(f64::is_finite));
    let state = read_train_state(&latest_checkpoint(&t.join("run-packed")).unwrap()).unwrap();
    assert_eq!(state.options.rows, RowsKind::Packed);
    // Gated DeltaNet blocks restart their convolution and state at each
    // record (crates/zoo/tests/packing.rs checks them against records alone).
    let s = trained(TrainOptions {
        rows: RowsKind::Packed,
        preset: Some("qwen3.5-tiny".into()),
        out: t.join("run-packed-linear"),
        ..o.clone()
    });
    assert!(s.loss.is_some_and(f64::is_finite) && s.val_loss.is_some_and(f64::is_finite));

    let err = prepare(
        TrainOptions {
            rows: RowsKind::Records,
            data: vec![t.join("a.jsonl"), t.join("b.txt")],
            out: t.join("run-bad"),
            ..o.clone()
        },
        false,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("--rows") && err.contains("b.txt"), "{err}");
    // Rows too short to reach any response: refused, naming the file.
    let short = TrainOptions {
        seq_len: 12,
        out: t.join("run-short"),
        ..o.clone()
    };
    let err = prepare(short, false).err().unwrap().to_string();
    assert!(err.contains("a.jsonl") && err.contains("learn nothing"), "{err}");
    assert_eq!("records".parse::<RowsKind>().unwrap(), RowsKind::Records);
    assert!(
        "windows"
            .parse::<RowsKind>()
            .unwrap_err()
            .contains("auto, stream, records, packed")
    );
    let old: TrainOptions = serde_json::from_value(serde_json::json!({"tokenizer": "byte"})).unwrap();
    assert_eq!(old.rows, RowsKind::Stream);
    // A state saved before --packing existed packed next fit; a new run
    // packs best fit, and a config file may ask for either.
    assert_eq!(old.packing, Packing::NextFit);
    assert_eq!(TrainOptions::default().packing, Packing::BestFit);
    let toml = TrainOptions::from_toml_str("packing = \"next-fit\"", Path::new("c.toml")).unwrap();
    assert_eq!(toml.packing, Packing::NextFit);
    assert!(
        "first-fit"
            .parse::<Packing>()
            .unwrap_err()
            .contains("best-fit, next-fit")
    );
}
