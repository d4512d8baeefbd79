//! Dropout in the streamed step (`TrainerConfig::dropout`): the step draws
//! the masks the whole-model forward and backward draw for its micro-batch,
//! a recomputed or kept block the same ones (so K and kept blocks change
//! no result), data parallel ranks what one process with their rows draws,
//! the GPU (lavapipe here) what the CPU draws; evaluation never drops; a
//! probability out of range is refused. NEFTune's noise on the embedding
//! (`TrainDropout::neftune`) is drawn the same way and held to the same.

mod common;

use std::sync::Arc;

use common::CHUNK_STREAM;
use megatrain::data::Batch;
use megatrain::dist::DistConfig;
use megatrain::dist::local::local_group;
use megatrain::trainer::{TrainDropout, Trainer, TrainerConfig};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::TierConfig;
use megatrain_zoo::layers::Rows;
use megatrain_zoo::{ModelConfig, forward_backward, upload_layer};

const DROP: TrainDropout = TrainDropout {
    hidden: 0.2,
    attention: 0.1,
    neftune: 0.0,
    seed: 42,
};

/// NEFTune's noise alone, as the paper's runs take it.
const NOISE: TrainDropout = TrainDropout {
    hidden: 0.0,
    attention: 0.0,
    neftune: 5.0,
    seed: 42,
};

fn config(k: usize, keep: usize, dropout: TrainDropout) -> TrainerConfig {
    TrainerConfig {
        checkpoint_every: k,
        keep_activations: keep,
        dropout,
        ..common::k2_config(None)
    }
}

fn trainer<E: Executor>(ex: E, model: &ModelConfig, config: TrainerConfig) -> Trainer<E> {
    common::trainer(ex, model, TierConfig::default(), 5, config)
}

fn batch(model: &ModelConfig, step: u64, rows: usize) -> Batch {
    CHUNK_STREAM.batch(model.vocab_size, step, rows, 9)
}

fn params<E: Executor>(t: &Trainer<E>) -> Vec<Vec<f32>> {
    t.tier().layers().iter().map(|s| s.params().to_vec()).collect()
}

/// Three steps; the losses and the parameters after.
fn train<E: Executor>(mut t: Trainer<E>) -> (Vec<f64>, Vec<Vec<f32>>) {
    let model = t.model().clone();
    let losses = (0..3)
        .map(|s| t.step(&[batch(&model, s, 2)], 3e-3).unwrap().loss)
        .collect();
    (losses, params(&t))
}

fn models() -> [ModelConfig; 3] {
    [
        common::llama_tiny(3),
        common::gpt2_two_blocks(),
        common::zoo_fixture("qwen3_5"),
    ]
}

#[test]
fn recomputed_and_kept_blocks_draw_the_forwards_masks() {
    for (model, drop) in models().into_iter().flat_map(|m| [(m.clone(), DROP), (m, NOISE)]) {
        let n = model.num_layers;
        let what = format!("{:?} neftune {}", model.arch, drop.neftune);
        let (losses, p) = train(trainer(CpuExecutor::new(), &model, config(1, 0, drop)));
        for (k, keep) in [(2, 0), (n, 0), (1, 1), (2, n)] {
            let (l, q) = train(trainer(CpuExecutor::new(), &model, config(k, keep, drop)));
            assert_eq!(l, losses, "{what}: K {k}, {keep} kept");
            assert!(q == p, "{what}: K {k}, {keep} kept: parameters differ");
        }
        let (plain, _) = train(trainer(
            CpuExecutor::new(),
            &model,
            config(1, 0, TrainDropout::default()),
        ));
        assert_ne!(plain, losses, "{what}: dropout changed nothing");
    }
}

/// The first step's loss is the whole model's under the rows of micro-batch
/// 0 of step 0, and a second step's masks are another step's.
#[test]
fn a_step_draws_what_the_whole_model_draws_for_its_micro_batch() {
    for (model, drop) in models().into_iter().flat_map(|m| [(m.clone(), DROP), (m, NOISE)]) {
        let ex = CpuExecutor::new();
        let mut t = trainer(CpuExecutor::new(), &model, config(2, 0, drop));
        let weights: Vec<Vec<_>> = t
            .tier()
            .layers()
            .iter()
            .map(|s| upload_layer(&ex, s.table(), s.params()).unwrap())
            .collect();
        let b = batch(&model, 0, 2);
        let whole = |step: u64| {
            let rows = Rows {
                docs: None,
                dropout: drop.for_micro(step, 0, 0).unwrap(),
            };
            forward_backward(&model, &ex, &weights, &b.inputs, &b.targets, (2, 9, rows), 7)
                .unwrap()
                .loss
        };
        let first = t.step(std::slice::from_ref(&b), 0.0).unwrap().loss;
        assert_eq!(first, whole(0), "{:?}", model.arch);
        assert_ne!(whole(0), whole(1), "{:?}", model.arch);
        assert_eq!(t.next_step(), 1);
    }
}

#[test]
fn evaluation_never_drops() {
    let model = common::llama_tiny(2);
    let b = batch(&model, 7, 2);
    let off = trainer(CpuExecutor::new(), &model, config(2, 0, TrainDropout::default()));
    for drop in [DROP, NOISE] {
        let on = trainer(CpuExecutor::new(), &model, config(2, 0, drop));
        assert_eq!(on.eval_loss(&b).unwrap(), off.eval_loss(&b).unwrap());
    }
}

#[test]
fn two_ranks_draw_what_one_process_with_their_rows_draws() {
    for drop in [DROP, NOISE] {
        two_ranks_draw_what_one_process_draws(drop);
    }
}

fn two_ranks_draw_what_one_process_draws(drop: TrainDropout) {
    let model = common::llama_tiny(2);
    let steps = 3u64;
    let rank_run = |rank: usize, ranks: usize, comm: Option<megatrain::dist::local::LocalComm>| {
        let mut t = trainer(CpuExecutor::new(), &model, config(2, 0, drop));
        if let Some(c) = comm {
            t.set_distributed(DistConfig {
                comm: Arc::new(c),
                shard_optimizer: false,
                shared: None,
            })
            .unwrap();
        }
        let per = 4 / ranks;
        let losses: Vec<f64> = (0..steps)
            .map(|s| {
                let b = CHUNK_STREAM.rows(model.vocab_size, s, 4, rank * per..(rank + 1) * per, 9);
                t.step(&[b], 3e-3).unwrap().loss
            })
            .collect();
        (losses, params(&t))
    };
    let (alone, p) = rank_run(0, 1, None);
    let runs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = local_group(2)
            .into_iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || rank_run(r, 2, Some(c))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The gradient is summed in another order: the same to rounding.
    for (a, b) in alone.iter().zip(&runs[0].0) {
        assert!((a - b).abs() <= 1e-6 * a.abs(), "loss alone {a}, on ranks {b}");
    }
    let worst = p
        .iter()
        .flatten()
        .zip(runs[0].1.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "parameters differ from one process's by {worst:e}");
}

#[test]
fn gpu_streamed_training_with_dropout_follows_the_cpu() {
    let Some(ctx) = common::ctx() else { return };
    let runs = [
        (common::llama_tiny(3), DROP),
        (common::gpt2_two_blocks(), DROP),
        (common::llama_tiny(3), NOISE),
    ];
    for (model, drop) in runs {
        let (cpu, p) = train(trainer(CpuExecutor::new(), &model, config(2, 0, drop)));
        let (gpu, q) = train(trainer(GpuExecutor::new(ctx.clone()), &model, config(2, 0, drop)));
        for (a, b) in cpu.iter().zip(&gpu) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{:?}: loss CPU {a}, GPU {b}",
                model.arch
            );
        }
        // Per layer, relative to its norm: AdamW's first steps turn a
        // rounding difference in a near-zero gradient into up to 2·lr
        // (1.5e-5 for llama-tiny here, with dropout or without).
        let worst = p
            .iter()
            .zip(&q)
            .map(|(a, b)| rel_norm_err(b, a))
            .fold(0.0, f64::max);
        assert!(worst <= 1e-4, "{:?}: a layer differs by {worst:e}", model.arch);
        let (plain, _) = train(trainer(
            GpuExecutor::new(ctx.clone()),
            &model,
            config(2, 0, TrainDropout::default()),
        ));
        assert!(
            (plain[1] - gpu[1]).abs() > 1e-4,
            "{:?}: dropout changed nothing on the GPU",
            model.arch
        );
    }
}

#[test]
fn a_probability_out_of_range_is_refused() {
    let model = common::llama_tiny(1);
    for (hidden, attention) in [(1.0, 0.0), (0.0, -0.5), (f64::NAN, 0.0)] {
        let tier = megatrain::trainer::init_tier(&model, TierConfig::default(), 1).unwrap();
        let dropout = TrainDropout {
            hidden,
            attention,
            neftune: 0.0,
            seed: 1,
        };
        let err = Trainer::new(CpuExecutor::new(), model.clone(), tier, config(1, 0, dropout))
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("dropout") && err.contains("0.99"), "{err}");
    }
    for neftune in [-1.0, f64::NAN] {
        let tier = megatrain::trainer::init_tier(&model, TierConfig::default(), 1).unwrap();
        let dropout = TrainDropout { neftune, ..NOISE };
        let err = Trainer::new(CpuExecutor::new(), model.clone(), tier, config(1, 0, dropout))
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("NEFTune") && err.contains(&neftune.to_string()),
            "{err}"
        );
    }
}
