//! Updates carried into the next step (`TrainerConfig::carry_layers`)
//! change no result: the same losses every step (each forward runs on
//! every update of the step before) and, once settled, the same
//! parameters and transport copies bit for bit as a run that updates every
//! layer before its step ends; on the CPU executor and on the GPU
//! (lavapipe here), f32 and bf16 transport, tied and untied heads, with
//! gradient accumulation, kept blocks, gradients in chunks, and a learning
//! rate that changes every step (a carried layer takes its own step's).
//! Until settled, the carried layers are one update behind and whatever
//! reads them is refused. The same holds of clipping's updates, which go
//! into the next step's forward (`TrainerConfig::defer_clipped_updates`)
//! against updating every layer after the backward: with a threshold that
//! scales the gradients and one that does not, the same norms too. Carried
//! layers sum their micro-batches on the executor (the tier holds none of
//! their gradients) and take their part of the step's norm there.

use crate::common;

use common::CHUNK_STREAM;
use megatrain::trainer::{CarryOrder, Trainer, TrainerConfig, carried_layers};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::TierConfig;
use megatrain_zoo::ModelConfig;

use common::{CHANGING_LRS as LRS, StepCase as Case, step_cases as cases};

/// The first `n` layers of `model`, as tier indices.
fn first(model: &ModelConfig, n: usize) -> Vec<usize> {
    carried_layers(n, CarryOrder::First, model.num_layers)
}

/// Where micro-batches are summed the tier holds no gradients of the
/// carried layers: they sum theirs on the executor.
fn trainer<E: Executor>(
    ex: E,
    model: &ModelConfig,
    case: Case,
    (carry, order): (usize, CarryOrder),
) -> Trainer<E> {
    let tier = TierConfig {
        transport: case.transport,
        hold_grads: case.micro > 1,
        grads_on_device: carried_layers(carry, order, model.num_layers),
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        transfer_chunk: case.chunk,
        keep_activations: case.keep,
        carry_layers: carry,
        carry_order: order,
        ..common::k2_config(None)
    };
    common::trainer(ex, model, tier, 5, config)
}

struct Run {
    losses: Vec<f64>,
    /// Each step's gradient norm and its layers'.
    norms: Vec<(Option<f64>, Vec<f64>)>,
    /// Parameters before settling, then after.
    before: Vec<Vec<f32>>,
    params: Vec<Vec<f32>>,
    transport: Vec<Vec<u8>>,
}

fn params<E: Executor>(t: &Trainer<E>) -> Vec<Vec<f32>> {
    t.tier().layers().iter().map(|s| s.params().to_vec()).collect()
}

/// `carry` layers' updates are left to the next step each step, the
/// gradients of the layers `on_device` among them on the executor.
fn train<E: Executor>(mut t: Trainer<E>, case: Case, (carry, on_device): (usize, &[usize])) -> Run {
    // A layer on the executor comes down once a step, the others once a
    // micro-batch; it holds no gradients in the tier.
    let numels: Vec<u64> = t.tier().layers().iter().map(|s| s.numel() as u64).collect();
    let on_device_numel: u64 = on_device.iter().map(|&i| numels[i]).sum();
    let bytes = 4 * (numels.iter().sum::<u64>() - on_device_numel) * case.micro as u64 + 4 * on_device_numel;
    for &i in on_device {
        let s = &t.tier().layers()[i];
        assert!(!s.holds_grads(), "layer {} holds gradients", s.index());
    }
    let vocab = t.model().vocab_size;
    // An untied embedding updated by one micro-batch brings down only the
    // gradients of a table of the rows its ids look up
    // (`TrainerConfig::compact_embedding`).
    let emb = &t.tier().layers()[0];
    let rows_alone = case.micro == 1
        && !emb.holds_grads()
        && !on_device.contains(&0)
        && !t.model().tie_word_embeddings
        && emb.table().len() == 1;
    let hidden = t.model().hidden_size as u64;
    let mut losses = Vec::new();
    let mut norms = Vec::new();
    for (step, lr) in LRS.iter().enumerate() {
        let micro = case.micro_batches(vocab, step);
        let m = t.step(&micro, *lr).unwrap();
        assert_eq!(t.carried_layers(), carry, "{case:?}");
        // The first step has nothing carried to apply; the others do.
        assert_eq!(m.carried_ms > 0.0, step > 0 && carry > 0, "step {step}: {m:?}");
        // As many rows as the step has inputs, the ids' first.
        let rows = micro[0].inputs.len().min(vocab) as u64;
        let want = match rows_alone {
            true => bytes - 4 * numels[0] + 4 * rows * hidden,
            false => bytes,
        };
        assert_eq!(m.bytes_downloaded, want, "{case:?}");
        losses.push(m.loss);
        norms.push((m.grad_norm, m.layer_grad_norms));
    }
    let before = params(&t);
    if carry > 0 {
        let batch = CHUNK_STREAM.batch(vocab, 99, 2, 9);
        let err = t.eval_loss(&batch).unwrap_err().to_string();
        assert!(err.contains("carried") && err.contains("settle"), "{err}");
    }
    let took = t.settle().unwrap();
    assert_eq!(t.carried_layers(), 0);
    assert_eq!(took > 0.0, carry > 0);
    assert_eq!(t.settle().unwrap(), 0.0, "settling twice");
    Run {
        losses,
        norms,
        before,
        params: params(&t),
        transport: t
            .tier()
            .layers()
            .iter()
            .map(|s| s.transport().as_bytes().to_vec())
            .collect(),
    }
}

/// `a` and `b` within `tol` of the larger.
fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs())
}

/// Against updating every layer in its step: `carries` layers in each
/// order given.
fn check<E: Executor>(make: impl Fn() -> E, model: &ModelConfig, carries: &[(usize, CarryOrder)]) {
    for case in cases() {
        let what = format!("{:?} tied {} {case:?}", model.arch, model.tie_word_embeddings);
        let plain = train(
            trainer(make(), model, case, (0, CarryOrder::First)),
            case,
            (0, &[]),
        );
        assert!(
            plain.losses.iter().all(|l| l.is_finite()),
            "{what}: {:?}",
            plain.losses
        );
        for &(carry, order) in carries {
            let set = carried_layers(carry, order, model.num_layers);
            let what = format!("{what}, {order}");
            let run = train(trainer(make(), model, case, (carry, order)), case, (carry, &set));
            assert_eq!(plain.losses, run.losses, "{what}, carry {carry}: losses");
            assert!(
                plain.params == run.params,
                "{what}, carry {carry}: parameters differ"
            );
            assert!(
                plain.transport == run.transport,
                "{what}, carry {carry}: transport copies differ"
            );
            // The carried layers' norms are the executor's sums, the
            // others' the same.
            for (step, ((a, la), (b, lb))) in plain.norms.iter().zip(&run.norms).enumerate() {
                let (a, b) = (a.expect("a norm"), b.expect("a norm"));
                assert!(
                    close(a, b, 1e-6),
                    "{what}, carry {carry}: step {step}'s norm {a} vs {b}"
                );
                for (i, (x, y)) in la.iter().zip(lb).enumerate() {
                    assert!(
                        close(*x, *y, 1e-5),
                        "{what}, carry {carry}: step {step} layer {i}: {x} vs {y}"
                    );
                }
                for i in (0..la.len()).filter(|i| !set.contains(i)) {
                    assert_eq!(la[i], lb[i], "{what}, carry {carry}: step {step} layer {i}");
                }
            }
            // Before settling, exactly the carried layers lagged.
            for (i, (a, b)) in plain.params.iter().zip(&run.before).enumerate() {
                assert_eq!(
                    a == b,
                    !set.contains(&i),
                    "{what}, carry {carry}: layer {i} before settling"
                );
            }
        }
    }
}

/// A trainer that clips at `max_norm`, its updates deferred or not, the
/// first `carry` layers' gradients kept on the executor.
fn clipping<E: Executor>(
    ex: E,
    model: &ModelConfig,
    case: Case,
    max_norm: f64,
    (defer, carry): (bool, usize),
) -> Trainer<E> {
    let tier = TierConfig {
        transport: case.transport,
        hold_grads: true,
        grads_on_device: first(model, carry),
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        transfer_chunk: case.chunk,
        keep_activations: case.keep,
        grad_clip: Some(max_norm),
        defer_clipped_updates: defer,
        carry_layers: carry,
        ..common::k2_config(None)
    };
    common::trainer(ex, model, tier, 5, config)
}

/// Clipping's updates deferred into the next forward change no result, at
/// a threshold that scales every step's gradients (0.05) and one that
/// scales none.
fn check_clipped<E: Executor>(make: impl Fn() -> E, model: &ModelConfig, cases: &[Case]) {
    let layers = model.num_layers + 2;
    for &case in cases {
        for max_norm in [0.05, 1e3] {
            let what = format!(
                "{:?} tied {} {case:?} max_norm {max_norm}",
                model.arch, model.tie_word_embeddings
            );
            let after = train(
                clipping(make(), model, case, max_norm, (false, 0)),
                case,
                (0, &[]),
            );
            let run = train(
                clipping(make(), model, case, max_norm, (true, 0)),
                case,
                (layers, &[]),
            );
            assert_eq!(after.losses, run.losses, "{what}: losses");
            assert_eq!(after.norms, run.norms, "{what}: gradient norms");
            assert!(after.params == run.params, "{what}: parameters differ");
            assert!(
                after.transport == run.transport,
                "{what}: transport copies differ"
            );
            assert!(
                after.params.iter().zip(&run.before).all(|(a, b)| a != b),
                "{what}: a layer was not one update behind before settling"
            );
            for (step, (norm, per_layer)) in run.norms.iter().enumerate() {
                let norm = norm.expect("clipping reports the norm it took");
                // The threshold binds at 0.05 and not at 1e3.
                assert_eq!(
                    norm > max_norm,
                    max_norm < 1.0,
                    "{what}: step {step}'s norm {norm}"
                );
                assert_eq!(per_layer.len(), layers);
                let whole = per_layer.iter().map(|x| x * x).sum::<f64>().sqrt();
                assert!((whole - norm).abs() <= 1e-12 * norm, "{what}: {whole} vs {norm}");
            }
        }
    }
}

/// Clipping with the first `carries` layers' gradients on the executor
/// (summed there over micro-batches, their part of the norm taken there
/// in f32 row sums) against clipping from gradients all held in the tier:
/// where the threshold does not bind the same bits; where it does, norms
/// within the row sums' rounding and a clip coefficient that may differ
/// in its last bits, so parameters within 1e-6.
fn check_clipped_on_device<E: Executor>(
    make: impl Fn() -> E,
    model: &ModelConfig,
    cases: &[Case],
    carries: &[usize],
) {
    let layers = model.num_layers + 2;
    for &case in cases {
        for max_norm in [0.05, 1e3] {
            let held = train(
                clipping(make(), model, case, max_norm, (true, 0)),
                case,
                (layers, &[]),
            );
            for &carry in carries {
                let what = format!(
                    "{:?} tied {} {case:?} max_norm {max_norm} carry {carry}",
                    model.arch, model.tie_word_embeddings
                );
                let run = train(
                    clipping(make(), model, case, max_norm, (true, carry)),
                    case,
                    (layers, &first(model, carry)),
                );
                for (step, ((a, la), (b, lb))) in held.norms.iter().zip(&run.norms).enumerate() {
                    let (a, b) = (a.expect("a norm"), b.expect("a norm"));
                    assert!(close(a, b, 1e-6), "{what}: step {step}'s norm {a} vs {b}");
                    assert_eq!(la.len(), lb.len(), "{what}");
                    for (i, (x, y)) in la.iter().zip(lb).enumerate() {
                        assert!(close(*x, *y, 1e-5), "{what}: step {step} layer {i}: {x} vs {y}");
                    }
                    // The held layers' norms are the same sums of the
                    // same gradients, until a coefficient moved.
                    if step == 0 || max_norm > 1.0 {
                        assert_eq!(la[carry..], lb[carry..], "{what}: step {step}");
                    }
                }
                assert!(
                    run.params.iter().zip(&run.before).all(|(a, b)| a != b),
                    "{what}: a layer was not one update behind before settling"
                );
                if max_norm > 1.0 {
                    assert_eq!(held.losses, run.losses, "{what}: losses");
                    assert!(held.params == run.params, "{what}: parameters differ");
                    assert!(held.transport == run.transport, "{what}: transport copies differ");
                    continue;
                }
                for (a, b) in held.losses.iter().zip(&run.losses) {
                    assert!(close(*a, *b, 1e-6), "{what}: losses {a} vs {b}");
                }
                for (i, (a, b)) in held.params.iter().zip(&run.params).enumerate() {
                    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                    assert!(worst <= 1e-6, "{what}: layer {i}'s parameters differ by {worst}");
                }
            }
        }
    }
}

#[test]
fn cpu_clipped_updates_with_gradients_on_the_executor() {
    for model in models() {
        let all = model.num_layers + 2;
        check_clipped_on_device(CpuExecutor::new, &model, &[cases()[0], cases()[2]], &[2, all]);
    }
}

#[test]
fn gpu_clipped_updates_with_gradients_on_the_executor() {
    let Some(ctx) = common::ctx() else { return };
    let c = cases();
    let model = common::llama_tiny(3);
    check_clipped_on_device(
        || GpuExecutor::new(ctx.clone()),
        &model,
        &[c[1], c[2]],
        &[model.num_layers + 2],
    );
    let mut tied = common::gpt2_two_blocks();
    tied.tie_word_embeddings = true;
    check_clipped_on_device(|| GpuExecutor::new(ctx.clone()), &tied, &[c[0]], &[1]);
}

#[test]
fn cpu_clipped_updates_deferred_change_no_result() {
    for model in models() {
        check_clipped(CpuExecutor::new, &model, &cases());
    }
}

#[test]
fn gpu_clipped_updates_deferred_change_no_result() {
    let Some(ctx) = common::ctx() else { return };
    let c = cases();
    check_clipped(
        || GpuExecutor::new(ctx.clone()),
        &common::llama_tiny(3),
        &[c[1], c[2]],
    );
    let mut tied = common::gpt2_two_blocks();
    tied.tie_word_embeddings = true;
    check_clipped(|| GpuExecutor::new(ctx.clone()), &tied, &[c[0]]);
}

/// Clipping's norm is summed block by block as the last micro-batch's
/// chunks come in, the blocks no chunk held whole at the end: the same
/// bits whatever the chunks (whole layers: every block as it comes; 1021
/// or 4099 elements: some or none before the end).
#[test]
fn clipping_norms_do_not_depend_on_the_chunks() {
    let model = common::llama_tiny(3);
    let c = cases()[0];
    let runs: Vec<Run> = [c.chunk, 1021, 4099]
        .into_iter()
        .map(|chunk| {
            let case = Case { chunk, micro: 2, ..c };
            let layers = model.num_layers + 2;
            train(
                clipping(CpuExecutor::new(), &model, case, 0.05, (true, 0)),
                case,
                (layers, &[]),
            )
        })
        .collect();
    for r in &runs[1..] {
        assert_eq!(r.norms, runs[0].norms);
        assert_eq!(r.losses, runs[0].losses);
        assert!(r.params == runs[0].params);
    }
}

/// A save applies the clipped updates left to the next step, and the
/// tier is not handed out for writing before.
#[test]
fn saving_applies_deferred_clipped_updates() {
    let model = common::llama_tiny(2);
    let mut t = clipping(CpuExecutor::new(), &model, cases()[0], 0.05, (true, 0));
    let batch = CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9);
    t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
    assert_eq!(t.carried_layers(), 4);
    let err = t.eval_loss(&batch).unwrap_err().to_string();
    assert!(err.contains("4 layers (0..4, clipped)"), "{err}");
    let steps = steps_at_save(&mut t);
    assert_eq!(steps, [1, 1, 1, 1]);
    assert_eq!(t.carried_layers(), 0);
    let _ = t.tier_mut();
}

/// llama-tiny with three blocks and gpt2-nano with two, heads tied or not.
fn models() -> Vec<ModelConfig> {
    let mut v = Vec::new();
    for tied in [false, true] {
        for mut c in [common::llama_tiny(3), common::gpt2_two_blocks()] {
            c.tie_word_embeddings = tied;
            v.push(c);
        }
    }
    v
}

#[test]
fn cpu_carried_updates_change_no_result() {
    for model in models() {
        let all = model.num_layers + 2;
        let spread = |n| (n, CarryOrder::Spread);
        let first = |n| (n, CarryOrder::First);
        check(
            CpuExecutor::new,
            &model,
            &[first(1), first(2), first(all), spread(1), spread(all - 1)],
        );
    }
    // Four blocks, two spread: the second and the fourth (tier 2 and 4),
    // each after one that is not carried.
    let model = common::llama_tiny(4);
    assert_eq!(carried_layers(2, CarryOrder::Spread, 4), [2, 4]);
    check(CpuExecutor::new, &model, &[(2, CarryOrder::Spread)]);
}

#[test]
fn carried_layers_are_the_first_or_blocks_spread() {
    let f = |n, o| carried_layers(n, o, 28);
    assert_eq!(f(3, CarryOrder::First), [0, 1, 2]);
    assert_eq!(f(usize::MAX, CarryOrder::First), (0..30).collect::<Vec<_>>());
    assert_eq!(f(0, CarryOrder::Spread), Vec::<usize>::new());
    assert_eq!(f(1, CarryOrder::Spread), [28]);
    assert_eq!(
        f(14, CarryOrder::Spread),
        (1..=14).map(|j| 2 * j).collect::<Vec<_>>()
    );
    assert_eq!(f(10, CarryOrder::Spread), [3, 6, 9, 12, 14, 17, 20, 23, 26, 28]);
    assert_eq!(f(28, CarryOrder::Spread), (1..=28).collect::<Vec<_>>());
    assert_eq!(f(29, CarryOrder::Spread), (0..=28).collect::<Vec<_>>());
    assert_eq!(f(30, CarryOrder::Spread), f(usize::MAX, CarryOrder::First));
    for n in 0..=30 {
        let v = f(n, CarryOrder::Spread);
        assert_eq!(v.len(), n);
        assert!(v.windows(2).all(|w| w[0] < w[1]), "{n}: {v:?}");
    }
}

#[test]
fn gpu_carried_updates_change_no_result() {
    let Some(ctx) = common::ctx() else { return };
    let model = common::llama_tiny(3);
    check(
        || GpuExecutor::new(ctx.clone()),
        &model,
        &[
            (2, CarryOrder::First),
            (model.num_layers + 2, CarryOrder::First),
            (1, CarryOrder::Spread),
        ],
    );
    // A tied head reads the embedding the forward updated first.
    let mut tied = common::gpt2_two_blocks();
    tied.tie_word_embeddings = true;
    check(|| GpuExecutor::new(ctx.clone()), &tied, &[(1, CarryOrder::First)]);
}

/// Downloads and uploads on a copy queue (where a GPU has one; lavapipe
/// runs the synchronization without a second queue): a carried layer's
/// chunks come down there while the forward's kernels are queued.
#[test]
fn gpu_carried_updates_change_no_result_over_a_copy_queue() {
    let Some(ctx) = common::copy_queue_ctx() else {
        return;
    };
    let model = common::llama_tiny(3);
    check(
        || GpuExecutor::new(ctx.clone()),
        &model,
        &[(3, CarryOrder::First)],
    );
}

/// Each layer's step count as a save (which settles first) sees it.
fn steps_at_save<E: Executor>(t: &mut Trainer<E>) -> Vec<u64> {
    t.save_on_rank0(|tier, _| {
        Ok::<_, megatrain::trainer::TrainError>(tier.layers().iter().map(|s| s.step()).collect::<Vec<_>>())
    })
    .unwrap()
    .unwrap()
}

/// A save settles what is carried: the checkpoint holds every update.
#[test]
fn saving_applies_what_is_carried() {
    let model = common::llama_tiny(2);
    let case = cases()[0];
    let mut t = trainer(CpuExecutor::new(), &model, case, (3, CarryOrder::First));
    let batch = CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9);
    t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
    assert_eq!(t.carried_layers(), 3);
    let steps = steps_at_save(&mut t);
    assert!(
        steps.iter().all(|&s| s == 1),
        "layer steps at the save: {steps:?}"
    );
    assert_eq!(t.carried_layers(), 0);
}

#[test]
fn carrying_is_refused_where_it_cannot_run() {
    let model = common::llama_tiny(2);
    let holding = TierConfig {
        hold_grads: true,
        ..TierConfig::default()
    };
    let refused = |config, needles: &[&str]| common::assert_refused(&model, holding.clone(), config, needles);
    refused(
        TrainerConfig {
            carry_layers: 5,
            ..TrainerConfig::default()
        },
        &["carry_layers (5)", "4 layers"],
    );
    // A tier without gradients of layers that are not carried.
    let without_grads = |on_device: usize| TierConfig {
        grads_on_device: first(&model, on_device),
        ..holding.clone()
    };
    let config = TrainerConfig {
        carry_layers: 1,
        grad_clip: Some(1.0),
        ..TrainerConfig::default()
    };
    common::assert_refused(
        &model,
        without_grads(2),
        config.clone(),
        &[
            "no gradients of layer 1 (grads_on_device [0, 1])",
            "not carried",
            "first: [0]",
        ],
    );
    let tier = megatrain::trainer::init_tier(&model, without_grads(1), 1).unwrap();
    Trainer::new(CpuExecutor::new(), model.clone(), tier, config.clone()).unwrap();
    // Clipping's norm takes the carried layers as the first ones.
    let spread = TierConfig {
        grads_on_device: carried_layers(1, CarryOrder::Spread, model.num_layers),
        ..holding.clone()
    };
    common::assert_refused(
        &model,
        spread,
        TrainerConfig {
            carry_order: CarryOrder::Spread,
            ..config
        },
        &["carry_layers (1, spread) cannot be used with grad_clip"],
    );
}

/// A tier that spills every layer but the embedding: carrying the
/// embedding (in RAM) beside the spill window changes no result, with and
/// without clipping (whose spilled updates are deferred too) and held
/// micro-batches; carrying a spilled layer is refused, naming it.
#[test]
fn carrying_beside_a_spilling_tier_changes_no_result() {
    use megatrain_tier::TransportDType;
    let model = common::llama_tiny(2);
    let transport = TransportDType::BF16;
    for (clip, micro) in [(None, 1), (None, 2), (Some(0.05), 1), (Some(0.05), 2)] {
        let hold = clip.is_some() || micro > 1;
        let run = |carry: usize, spill: Option<&std::path::Path>| {
            let tier = TierConfig {
                transport,
                hold_grads: hold,
                grads_on_device: first(&model, carry),
                ram_budget_bytes: spill.map(|_| common::spill_all_but_embedding(&model, transport, hold)),
                spill_dir: spill.map(|d| d.join("spill")),
                ..TierConfig::default()
            };
            let config = TrainerConfig {
                carry_layers: carry,
                ..common::k2_config(clip)
            };
            let mut t = common::trainer(CpuExecutor::new(), &model, tier, 5, config);
            assert_eq!(t.tier().has_spill(), spill.is_some());
            let mut losses = Vec::new();
            for (step, lr) in LRS.iter().enumerate() {
                let batches: Vec<_> = (0..micro)
                    .map(|k| CHUNK_STREAM.batch(model.vocab_size, (step * 2 + k) as u64, 2, 9))
                    .collect();
                losses.push(t.step(&batches, *lr).unwrap().loss);
                assert!(t.carried_layers() >= carry);
            }
            t.settle().unwrap();
            (losses, params(&t))
        };
        let dir = tempfile::tempdir().unwrap();
        let plain = run(0, None);
        let carried = run(1, Some(dir.path()));
        assert_eq!(plain.0, carried.0, "clip {clip:?} micro {micro}: losses");
        assert!(
            plain.1 == carried.1,
            "clip {clip:?} micro {micro}: parameters differ"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let tier = TierConfig {
        transport,
        grads_on_device: first(&model, 2),
        ram_budget_bytes: Some(common::spill_all_but_embedding(&model, transport, false)),
        spill_dir: Some(dir.path().join("spill")),
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        carry_layers: 2,
        ..TrainerConfig::default()
    };
    common::assert_refused(
        &model,
        tier,
        config,
        &[
            "carry_layers (2) reaches layer 1",
            "spills to disk",
            "carry at most 1",
        ],
    );
}

#[test]
#[should_panic(expected = "call Trainer::settle first")]
fn the_tier_is_not_handed_out_for_writing_while_updates_are_carried() {
    let model = common::llama_tiny(2);
    let mut t = trainer(CpuExecutor::new(), &model, cases()[0], (1, CarryOrder::First));
    let batch = CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9);
    t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
    let _ = t.tier_mut();
}
