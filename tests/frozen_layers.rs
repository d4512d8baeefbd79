//! Frozen layers (`TrainerConfig::frozen_layers`): the backward ends at the
//! first trained layer, and the frozen ones keep their weights, moments
//! and step counts. The trained layers get exactly the training of a run
//! that trains every layer but puts the frozen ones back after each step:
//! the same losses and the same parameters, bit for bit, on the CPU
//! executor and on the GPU (lavapipe here), tied and untied heads, with
//! kept blocks, gradient accumulation and chunks. No frozen layer's
//! gradient crosses the bus, and the frozen blocks are not uploaded again
//! for the backward.

use crate::common;

use common::CHUNK_STREAM;
use megatrain::trainer::{StepMetrics, Trainer, TrainerConfig};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::TierConfig;
use megatrain_zoo::ModelConfig;

use common::{CHANGING_LRS as LRS, StepCase as Case, step_cases};

/// Whole layers; over micro-batches in bf16; a block kept, in chunks.
fn cases() -> [Case; 3] {
    let c = step_cases();
    [c[0], c[2], c[3]]
}

fn trainer<E: Executor>(
    ex: E,
    model: &ModelConfig,
    case: Case,
    frozen: usize,
    clip: Option<f64>,
) -> Trainer<E> {
    let tier = TierConfig {
        transport: case.transport,
        hold_grads: case.micro > 1 || clip.is_some(),
        ..TierConfig::default()
    };
    trainer_on(ex, model, (case, tier), frozen, clip)
}

fn trainer_on<E: Executor>(
    ex: E,
    model: &ModelConfig,
    (case, tier): (Case, TierConfig),
    frozen: usize,
    clip: Option<f64>,
) -> Trainer<E> {
    let config = TrainerConfig {
        transfer_chunk: case.chunk,
        keep_activations: case.keep,
        frozen_layers: frozen,
        // The reference puts layers back after each step: its updates
        // must all be done by then.
        defer_clipped_updates: false,
        // Whole tables up and down, a frozen embedding's as a trained
        // one's (tests/embedding_rows.rs takes the rows looked up alone).
        compact_embedding: false,
        ..common::k2_config(clip)
    };
    common::trainer(ex, model, tier, 5, config)
}

struct Run {
    losses: Vec<f64>,
    metrics: Vec<StepMetrics>,
    params: Vec<Vec<f32>>,
    transport: Vec<Vec<u8>>,
    steps: Vec<u64>,
}

/// Three steps; after each, the first `restore` layers are put back as
/// they were at the start (parameters, moments, step count and transport
/// copy).
fn train<E: Executor>(mut t: Trainer<E>, case: Case, restore: usize) -> Run {
    let vocab = t.model().vocab_size;
    let start: Vec<Vec<f32>> = t.tier().layers()[..restore]
        .iter()
        .map(|s| s.params().to_vec())
        .collect();
    let mut losses = Vec::new();
    let mut metrics = Vec::new();
    for (step, lr) in LRS.iter().enumerate() {
        let micro = case.micro_batches(vocab, step);
        let m = t.step(&micro, *lr).unwrap();
        losses.push(m.loss);
        metrics.push(m);
        for (slab, p) in t.tier_mut().layers_mut().iter_mut().zip(&start) {
            slab.params_mut().copy_from_slice(p);
            slab.m_mut().fill(0.0);
            slab.v_mut().fill(0.0);
            slab.set_step(0);
            slab.refresh_transport();
        }
    }
    let layers = t.tier().layers();
    Run {
        losses,
        metrics,
        params: layers.iter().map(|s| s.params().to_vec()).collect(),
        transport: layers.iter().map(|s| s.transport().as_bytes().to_vec()).collect(),
        steps: layers.iter().map(|s| s.step()).collect(),
    }
}

fn check<E: Executor>(make: impl Fn() -> E, model: &ModelConfig, cases: &[Case], frozen: &[usize]) {
    let start = trainer(make(), model, cases[0], 0, None);
    let initial: Vec<Vec<f32>> = start
        .tier()
        .layers()
        .iter()
        .map(|s| s.params().to_vec())
        .collect();
    drop(start);
    for &case in cases {
        for &f in frozen {
            let what = format!(
                "{:?} tied {} {case:?} frozen {f}",
                model.arch, model.tie_word_embeddings
            );
            let reference = train(trainer(make(), model, case, 0, None), case, f);
            let run = train(trainer(make(), model, case, f, None), case, 0);
            assert_eq!(reference.losses, run.losses, "{what}: losses");
            assert!(reference.params == run.params, "{what}: parameters differ");
            assert!(
                reference.transport == run.transport,
                "{what}: transport copies differ"
            );
            assert_eq!(reference.steps, run.steps, "{what}: step counts");
            // Frozen: as they started, never stepped.
            assert!(run.params[..f] == initial[..f], "{what}: a frozen layer moved");
            assert!(run.steps[..f].iter().all(|&s| s == 0), "{what}: {:?}", run.steps);
            assert!(run.steps[f..].iter().all(|&s| s == 3), "{what}: {:?}", run.steps);
            let numels: Vec<u64> = initial.iter().map(|p| p.len() as u64).collect();
            let trained: u64 = numels[f..].iter().sum();
            for (step, (m, r)) in run.metrics.iter().zip(&reference.metrics).enumerate() {
                // Only the trained layers' gradients come down.
                assert_eq!(
                    m.bytes_downloaded,
                    4 * trained * case.micro as u64,
                    "{what}: step {step}"
                );
                // A frozen block is not uploaded again for the backward (the
                // embedding never is).
                match f {
                    1 => assert_eq!(m.bytes_uploaded, r.bytes_uploaded, "{what}: step {step}"),
                    _ => assert!(m.bytes_uploaded < r.bytes_uploaded, "{what}: step {step}"),
                }
                // The trained layers' norms are the reference's; the frozen
                // ones have none.
                assert_eq!(
                    m.layer_grad_norms[f..],
                    r.layer_grad_norms[f..],
                    "{what}: step {step}"
                );
                assert!(
                    m.layer_grad_norms[..f].iter().all(|&x| x == 0.0),
                    "{what}: step {step}"
                );
                let whole = m.layer_grad_norms.iter().map(|x| x * x).sum::<f64>().sqrt();
                let norm = m.grad_norm.expect("a norm");
                assert!((whole - norm).abs() <= 1e-12 * norm, "{what}: {whole} vs {norm}");
            }
        }
    }
}

fn models() -> Vec<ModelConfig> {
    let mut tied = common::gpt2_two_blocks();
    tied.tie_word_embeddings = true;
    vec![common::llama_tiny(3), tied]
}

#[test]
fn cpu_frozen_layers_train_the_others_as_if_put_back() {
    for model in models() {
        let all_but_head = model.num_layers + 1;
        check(CpuExecutor::new, &model, &cases(), &[1, 2, all_but_head]);
    }
}

#[test]
fn gpu_frozen_layers_train_the_others_as_if_put_back() {
    let Some(ctx) = common::ctx() else { return };
    let c = cases();
    let model = common::llama_tiny(3);
    check(|| GpuExecutor::new(ctx.clone()), &model, &[c[1], c[2]], &[2]);
    let mut tied = common::gpt2_two_blocks();
    tied.tie_word_embeddings = true;
    check(|| GpuExecutor::new(ctx.clone()), &tied, &[c[0]], &[1]);
}

/// Clipping's norm is the trained layers' alone: at the first step (the
/// same parameters everywhere), the reference's trained layers' norms.
#[test]
fn clipping_takes_the_norm_of_the_trained_layers() {
    let model = common::llama_tiny(3);
    let case = cases()[0];
    let vocab = model.vocab_size;
    let batch = CHUNK_STREAM.batch(vocab, 0, 2, 9);
    let mut all = trainer(CpuExecutor::new(), &model, case, 0, Some(1e9));
    let r = all.step(std::slice::from_ref(&batch), 1e-3).unwrap();
    for (f, defer) in [(2, false), (2, true), (4, true)] {
        let tier = TierConfig {
            hold_grads: true,
            ..TierConfig::default()
        };
        let config = TrainerConfig {
            frozen_layers: f,
            defer_clipped_updates: defer,
            ..common::k2_config(Some(0.01))
        };
        let mut t = common::trainer(CpuExecutor::new(), &model, tier, 5, config);
        let m = t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
        let want = r.layer_grad_norms[f..].iter().map(|x| x * x).sum::<f64>().sqrt();
        let got = m.grad_norm.unwrap();
        assert!((got - want).abs() <= 1e-12 * want, "frozen {f}: {got} vs {want}");
        assert!(m.layer_grad_norms[..f].iter().all(|&x| x == 0.0));
        assert_eq!(t.carried_layers(), if defer { 5 - f } else { 0 });
        t.settle().unwrap();
        let steps: Vec<u64> = t.tier().layers().iter().map(|s| s.step()).collect();
        assert!(
            steps[..f].iter().all(|&s| s == 0) && steps[f..].iter().all(|&s| s == 1),
            "frozen {f}: {steps:?}"
        );
    }
}

/// Over a tier that spills every layer but the embedding: the same bits
/// as in RAM, with a frozen layer among the spilled ones (the spill
/// window skips it), clipping or not.
#[test]
fn frozen_layers_over_a_tier_that_spills() {
    let model = common::llama_tiny(3);
    let case = cases()[1];
    for clip in [None, Some(0.05)] {
        let hold = case.micro > 1 || clip.is_some();
        let dir = tempfile::tempdir().unwrap();
        let spilling = TierConfig {
            transport: case.transport,
            hold_grads: hold,
            ram_budget_bytes: Some(common::spill_all_but_embedding(&model, case.transport, hold)),
            spill_dir: Some(dir.path().to_path_buf()),
            ..TierConfig::default()
        };
        let ram = train(trainer(CpuExecutor::new(), &model, case, 2, clip), case, 0);
        let t = trainer_on(CpuExecutor::new(), &model, (case, spilling), 2, clip);
        assert!(t.tier().layers()[1].is_spilled());
        let spilled = train(t, case, 0);
        assert_eq!(ram.losses, spilled.losses, "clip {clip:?}");
        assert!(ram.params == spilled.params, "clip {clip:?}: parameters differ");
        assert_eq!(ram.steps, spilled.steps, "clip {clip:?}");
    }
}

#[test]
fn freezing_is_refused_where_it_cannot_run() {
    let model = common::llama_tiny(2);
    let refused =
        |config, needles: &[&str]| common::assert_refused(&model, TierConfig::default(), config, needles);
    refused(
        TrainerConfig {
            frozen_layers: 4,
            ..TrainerConfig::default()
        },
        &["frozen_layers (4)", "none of the model's 4 layers", "head"],
    );
    refused(
        TrainerConfig {
            frozen_layers: 1,
            carry_layers: 1,
            ..TrainerConfig::default()
        },
        &["frozen_layers (1)", "carry_layers (1)"],
    );
}
