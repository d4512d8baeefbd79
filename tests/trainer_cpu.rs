//! The streamed step on the CPU executor against plain whole-model
//! references: same gradients and updates whatever K, accumulation equal to
//! a large batch, exact clipping equal to a reference clip.

use crate::common;

use common::TRAINER_STREAM;
use megatrain::data::Batch;
use megatrain::trainer::{Trainer, TrainerConfig, init_tier, load_tier, load_tier_for_forwards};
use megatrain_adamw::{AdamW, DecayMask, SlabState, SlabUpdate};
use megatrain_tensor::CpuExecutor;
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::{ModelConfig, forward_backward, gpt2_nano, upload_layer};

const SEED: u64 = 1234;

fn trainer(model: &ModelConfig, k: usize, hold: bool, clip: Option<f64>) -> Trainer<CpuExecutor> {
    trainer_with(
        model,
        TrainerConfig {
            checkpoint_every: k,
            grad_clip: clip,
            ..TrainerConfig::default()
        },
        hold,
    )
}

/// K, the last `keep` blocks keeping their activations.
fn trainer_keeping(model: &ModelConfig, k: usize, keep: usize, hold: bool) -> Trainer<CpuExecutor> {
    trainer_with(
        model,
        TrainerConfig {
            checkpoint_every: k,
            keep_activations: keep,
            ..TrainerConfig::default()
        },
        hold,
    )
}

/// `config` with this file's head chunk and AdamW, f32 transport,
/// gradients held where `hold` (for clipping and micro-batches).
fn trainer_with(model: &ModelConfig, config: TrainerConfig, hold: bool) -> Trainer<CpuExecutor> {
    let tier = TierConfig {
        transport: TransportDType::F32,
        hold_grads: hold,
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        chunk_rows: 7,
        adamw: common::adamw(),
        optimizer_queue: 2,
        ..config
    };
    common::trainer(CpuExecutor::new(), model, tier, SEED, config)
}

/// `big`'s rows as `n` micro-batches in order.
fn micro_batches(big: &Batch, n: usize) -> Vec<Batch> {
    let (rows, t) = (big.batch / n, big.seq_len);
    (0..n)
        .map(|i| Batch {
            batch: rows,
            seq_len: t,
            inputs: big.inputs[i * rows * t..(i + 1) * rows * t].to_vec(),
            targets: big.targets[i * rows * t..(i + 1) * rows * t].to_vec(),
            lengths: None,
            docs: None,
        })
        .collect()
}

fn params(t: &Trainer<CpuExecutor>) -> Vec<Vec<f32>> {
    t.tier().layers().iter().map(|s| s.params().to_vec()).collect()
}

/// Per layer: max |a − b| / max |a|, the worst over layers. Element-wise
/// relative error is meaningless for AdamW: where a gradient is at rounding
/// level, m/√v amplifies summation-order differences to a full `lr` step.
fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = x.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64)).max(1e-12);
            let diff = x
                .iter()
                .zip(y)
                .fold(0.0f64, |m, (&u, &v)| m.max((u as f64 - v as f64).abs()));
            diff / scale
        })
        .fold(0.0, f64::max)
}

/// Whole model in memory: forward_backward, then AdamW on every layer
/// (optionally with a clip coefficient), as a plain loop.
fn reference_step(
    model: &ModelConfig,
    weights: &mut [Vec<f32>],
    b: &Batch,
    lr: f32,
    clip: Option<f64>,
) -> f64 {
    let ex = CpuExecutor::new();
    let tables = model.layer_tables();
    let dev: Vec<_> = tables
        .iter()
        .zip(weights.iter())
        .map(|(t, w)| upload_layer(&ex, t, w).unwrap())
        .collect();
    let out = forward_backward(
        model,
        &ex,
        &dev,
        &b.inputs,
        &b.targets,
        (b.batch, b.seq_len, None),
        7,
    )
    .unwrap();
    let mut grads: Vec<Vec<f32>> = tables
        .iter()
        .zip(&out.grads)
        .map(|(t, g)| megatrain_zoo::download_grads(&ex, t, g).unwrap())
        .collect();
    let coef = match clip {
        Some(max) => {
            let norm = grads
                .iter()
                .flatten()
                .map(|&g| g as f64 * g as f64)
                .sum::<f64>()
                .sqrt();
            (max / (norm + 1e-6)).min(1.0) as f32
        }
        None => 1.0,
    };
    let opt = AdamW::new(common::adamw()).unwrap();
    for ((t, w), g) in tables.iter().zip(weights.iter_mut()).zip(grads.iter_mut()) {
        let (mut m, mut v) = (vec![0.0; w.len()], vec![0.0; w.len()]);
        let mask = DecayMask::from_param_table(t);
        let up = SlabUpdate::new(w, g, &mut m, &mut v)
            .decay(&mask)
            .grad_scale(coef);
        opt.step(&mut SlabState::new(), lr, up).unwrap();
    }
    out.loss
}

fn check_one_step_matches_reference(model: &ModelConfig) {
    let b = TRAINER_STREAM.batch(model.vocab_size, 0, 2, 11);
    let lr = 1e-3;
    let mut reference: Vec<Vec<f32>> = params(&trainer(model, 1, false, None));
    let ref_loss = reference_step(model, &mut reference, &b, lr, None);
    for k in [1, 2, 3] {
        let mut t = trainer(model, k, false, None);
        let m = t.step(std::slice::from_ref(&b), lr as f64).unwrap();
        assert!(
            (m.loss - ref_loss).abs() <= 1e-6 * ref_loss.abs(),
            "K={k}: loss {} vs reference {ref_loss}",
            m.loss
        );
        let d = max_rel_diff(&params(&t), &reference);
        assert!(d <= 1e-5, "K={k}: params differ from the reference by {d}");
        assert_eq!(m.tokens, 22);
        assert_eq!(m.counted, 22);
    }
}

#[test]
fn llama_streamed_step_matches_whole_model_reference_for_every_k() {
    check_one_step_matches_reference(&common::llama_tiny(3));
}

#[test]
fn gpt2_streamed_step_matches_whole_model_reference_for_every_k() {
    check_one_step_matches_reference(&gpt2_nano(65));
}

/// Qwen3.5's hybrid (Gated DeltaNet and gated attention blocks) and OLMo
/// Hybrid's (Gated DeltaNet and OLMo 3 blocks), recomputed from their
/// checkpoints for every K.
#[test]
fn gated_delta_net_streamed_step_matches_whole_model_reference_for_every_k() {
    check_one_step_matches_reference(&common::zoo_fixture("qwen3_5"));
    check_one_step_matches_reference(&common::zoo_fixture("olmo_hybrid"));
}

/// A mixture of experts streams as any block: routed and dense blocks,
/// recomputed (routing again) for every K.
#[test]
fn moe_streamed_step_matches_whole_model_reference_for_every_k() {
    check_one_step_matches_reference(&common::mixtral_tiny(3));
    check_one_step_matches_reference(&common::qwen3_moe_fixture());
    check_one_step_matches_reference(&common::zoo_fixture("qwen2_moe"));
    check_one_step_matches_reference(&common::zoo_fixture("gpt_oss_aux"));
    check_one_step_matches_reference(&common::zoo_fixture("glm4_moe"));
    check_one_step_matches_reference(&common::zoo_fixture("deepseek_v3"));
    check_one_step_matches_reference(&common::zoo_fixture("deepseek_v2"));
    check_one_step_matches_reference(&common::zoo_fixture("qwen3_5_moe"));
    check_one_step_matches_reference(&common::zoo_fixture("qwen3_next"));
    check_one_step_matches_reference(&common::zoo_fixture("kimi_linear"));
    // With the routers' load-balancing loss, which the streamed step forms
    // from every routed block's forward before the first backward.
    let mut balanced = common::mixtral_tiny(3);
    balanced.moe.as_mut().unwrap().aux_loss_coef = Some(0.05);
    check_one_step_matches_reference(&balanced);
    let mut dense_between = common::qwen3_moe_fixture();
    dense_between.moe.as_mut().unwrap().aux_loss_coef = Some(0.1);
    check_one_step_matches_reference(&dense_between);
}

#[test]
fn checkpoint_interval_does_not_change_training() {
    let model = common::llama_tiny(3);
    let mut runs = Vec::new();
    for k in [1, 3] {
        let mut t = trainer(&model, k, false, None);
        let losses: Vec<f64> = (0..4)
            .map(|s| t.step(&[TRAINER_STREAM.batch(256, s, 2, 9)], 3e-3).unwrap().loss)
            .collect();
        runs.push((losses, params(&t)));
    }
    assert_eq!(
        runs[0].0, runs[1].0,
        "recompute must reproduce the forward exactly"
    );
    assert_eq!(runs[0].1, runs[1].1);
}

/// Keeping the last blocks' weights and activations from the forward
/// instead of uploading and recomputing them changes no bit of training:
/// some blocks kept and the rest in groups (one short), every block kept,
/// with and without micro-batches, and the compute-only mode's loss. The
/// kept blocks cross the bus once a micro-batch where the others cross
/// twice; the gradients come down as before.
#[test]
fn kept_activations_do_not_change_training() {
    for model in [common::llama_tiny(3), gpt2_nano(65), common::mixtral_tiny(3)] {
        let v = model.vocab_size;
        let mut runs = Vec::new();
        for (k, keep) in [(1, 0), (2, 1), (1, 2), (3, 3), (2, 3)] {
            let mut t = trainer_keeping(&model, k, keep, true);
            let mut losses = Vec::new();
            let mut bytes = Vec::new();
            for s in 0..3 {
                let micro = [
                    TRAINER_STREAM.batch(v, 2 * s, 2, 9),
                    TRAINER_STREAM.batch(v, 2 * s + 1, 2, 9),
                ];
                let m = t.step(&micro[..1 + s as usize % 2], 3e-3).unwrap();
                losses.push(m.loss);
                bytes.push((m.bytes_uploaded, m.bytes_downloaded));
            }
            let w = t.resident_weights().unwrap();
            let only = t
                .compute_only(&w, &TRAINER_STREAM.batch(v, 9, 2, 9))
                .unwrap()
                .loss_sum;
            // A kept block's upload saved per micro-batch (blocks share a size).
            let block = 4 * t.tier().layers()[1].numel() as u64;
            let saved: Vec<(u64, u64)> = (0..3u64)
                .map(|s| (keep as u64 * block * (1 + s % 2), 0))
                .collect();
            let bytes: Vec<(u64, u64)> = bytes.iter().zip(&saved).map(|(b, s)| (b.0 + s.0, b.1)).collect();
            runs.push(((k, keep), losses, bytes, params(&t), only));
        }
        let (first, rest) = runs.split_first().unwrap();
        for r in rest {
            assert_eq!(r.1, first.1, "{:?}: losses", r.0);
            assert_eq!(
                r.2, first.2,
                "{:?}: bytes over the bus, kept blocks' second uploads added back",
                r.0
            );
            assert!(r.3 == first.3, "{:?}: parameters differ", r.0);
            assert_eq!(r.4, first.4, "{:?}: compute-only loss", r.0);
        }
    }
}

#[test]
fn four_micro_batches_equal_one_batch_of_four() {
    let model = common::llama_tiny(3);
    let big = TRAINER_STREAM.batch(256, 0, 8, 9);
    let micro = micro_batches(&big, 4);
    let mut one = trainer(&model, 1, true, None);
    let mut four = trainer(&model, 2, true, None);
    for _ in 0..3 {
        let a = one.step(std::slice::from_ref(&big), 1e-3).unwrap();
        let b = four.step(&micro, 1e-3).unwrap();
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * a.loss,
            "{} vs {}",
            a.loss,
            b.loss
        );
        assert_eq!(a.tokens, b.tokens);
    }
    let d = max_rel_diff(&params(&one), &params(&four));
    assert!(d <= 1e-4, "accumulated params differ by {d}");
    assert!(
        one.tier()
            .layers()
            .iter()
            .all(|s| s.grads().unwrap().iter().all(|&g| g == 0.0))
    );
}

#[test]
fn exact_clipping_equals_reference_clip() {
    let model = gpt2_nano(65);
    let b = TRAINER_STREAM.batch(65, 3, 2, 13);
    let mut reference = params(&trainer(&model, 1, true, None));
    let ref_loss = reference_step(&model, &mut reference, &b, 1e-3, Some(0.05));
    let mut t = trainer(&model, 2, true, Some(0.05));
    let m = t.step(std::slice::from_ref(&b), 1e-3).unwrap();
    assert!((m.loss - ref_loss).abs() <= 1e-6 * ref_loss);
    let norm = m.grad_norm.expect("clipping reports the norm");
    assert!(norm > 0.05, "the test must actually clip (norm {norm})");
    // The clipped update waits for the next step's forward.
    assert_eq!(t.carried_layers(), model.num_layers + 2);
    t.settle().unwrap();
    let d = max_rel_diff(&params(&t), &reference);
    assert!(d <= 1e-5, "clipped params differ by {d}");
}

#[test]
fn every_step_reports_the_norm_of_its_gradient() {
    // The clipping mode's exact norm (a threshold it never reaches, so the
    // same updates) against the overlapped updates' own sum of squares, with
    // one batch and with micro-batches held and accumulated, for three
    // steps; and none where layers are carried into the next step.
    let model = common::llama_tiny(3);
    let big = TRAINER_STREAM.batch(256, 0, 4, 9);
    let micro = micro_batches(&big, 2);
    let mut exact = trainer(&model, 1, true, Some(1e9));
    let mut one = trainer(&model, 2, false, None);
    let mut held = trainer(&model, 1, true, None);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.max(1e-30);
    for step in 0..3 {
        let e = exact.step(&micro, 1e-3).unwrap();
        let want = e.grad_norm.unwrap();
        // One norm per layer, whose squares add up to the step's.
        assert_eq!(e.layer_grad_norms.len(), model.num_layers + 2);
        let sum: f64 = e.layer_grad_norms.iter().map(|x| x * x).sum();
        assert!(close(sum.sqrt(), want), "{} vs {want}", sum.sqrt());
        for (what, t, batches) in [
            ("one batch", &mut one, std::slice::from_ref(&big)),
            ("held", &mut held, &micro[..]),
        ] {
            let m = t.step(batches, 1e-3).unwrap();
            let got = m.grad_norm.expect("a norm every step");
            assert!(close(got, want), "{what}, step {step}: {got} vs {want}");
            for (l, (a, b)) in m.layer_grad_norms.iter().zip(&e.layer_grad_norms).enumerate() {
                assert!(close(*a, *b), "{what}, step {step}, layer {l}: {a} vs {b}");
            }
        }
    }
    // A step that clips reports the norms before clipping: the same as a
    // step that does not, from the same state.
    let (mut clipped, mut plain) = (
        trainer(&model, 1, true, Some(0.01)),
        trainer(&model, 1, true, None),
    );
    let (c, p) = (
        clipped.step(&micro, 1e-3).unwrap(),
        plain.step(&micro, 1e-3).unwrap(),
    );
    assert!(c.grad_norm.unwrap() > 0.01, "the test must clip");
    assert!(close(c.grad_norm.unwrap(), p.grad_norm.unwrap()));
    for (a, b) in c.layer_grad_norms.iter().zip(&p.layer_grad_norms) {
        assert!(close(*a, *b), "{a} vs {b}");
    }
    let mut carrying = trainer_with(
        &model,
        TrainerConfig {
            carry_layers: 2,
            ..TrainerConfig::default()
        },
        false,
    );
    // A step that carries layers reports their norms too, from the sums
    // the executor took of their gradients: the same gradient as the
    // micro-batches' above.
    let m = carrying.step(std::slice::from_ref(&big), 1e-3).unwrap();
    assert!(close(m.grad_norm.unwrap(), p.grad_norm.unwrap()));
    assert_eq!(m.layer_grad_norms.len(), p.layer_grad_norms.len());
    for (a, b) in m.layer_grad_norms.iter().zip(&p.layer_grad_norms) {
        assert!(close(*a, *b), "{a} vs {b}");
    }
}

#[test]
fn a_z_loss_is_reported_and_joins_the_gradient() {
    // Its mean over the counted targets: the same from one batch as from
    // two micro-batches; it moves the parameters; 0 reports nothing.
    let model = common::llama_tiny(2);
    let big = TRAINER_STREAM.batch(256, 0, 4, 9);
    let micro = micro_batches(&big, 2);
    let with_z = |hold: bool| {
        let config = TrainerConfig {
            z_loss: 1e-2,
            ..TrainerConfig::default()
        };
        trainer_with(&model, config, hold)
    };
    let (mut one, mut two, mut plain) = (with_z(false), with_z(true), trainer(&model, 1, false, None));
    let a = one.step(std::slice::from_ref(&big), 1e-3).unwrap();
    let b = two.step(&micro, 1e-3).unwrap();
    let p = plain.step(std::slice::from_ref(&big), 1e-3).unwrap();
    let (za, zb) = (a.z_loss.unwrap(), b.z_loss.unwrap());
    // lse ≈ ln(256) at init: z·lse² ≈ 0.3.
    assert!(za > 0.1 && (za - zb).abs() <= 1e-6 * za, "{za} vs {zb}");
    assert_eq!(p.z_loss, None);
    assert_eq!(
        a.loss.to_bits(),
        p.loss.to_bits(),
        "the loss is the cross-entropy's alone"
    );
    let d = max_rel_diff(&params(&one), &params(&plain));
    assert!(d > 1e-6, "the z-loss changed no parameter ({d})");
}

#[test]
fn label_smoothing_is_reported_and_joins_the_gradient() {
    // At ε = 1 the target is uniform: the gradient and the smoothed loss
    // do not depend on the targets, while the cross-entropy does. Between,
    // the smoothed loss is (1 − ε)·loss + ε·(ε = 1's), the same from one
    // batch as from two micro-batches; `loss` stays the plain one.
    let model = common::llama_tiny(2);
    let big = TRAINER_STREAM.batch(256, 0, 4, 9);
    let mut shifted = big.clone();
    for t in shifted.targets.iter_mut().filter(|t| **t >= 0) {
        *t = (*t + 7) % 256;
    }
    let smoothing = |eps: f32, hold: bool| {
        let config = TrainerConfig {
            label_smoothing: eps,
            ..TrainerConfig::default()
        };
        trainer_with(&model, config, hold)
    };
    let (mut u1, mut u2) = (smoothing(1.0, false), smoothing(1.0, false));
    let a = u1.step(std::slice::from_ref(&big), 1e-3).unwrap();
    let b = u2.step(std::slice::from_ref(&shifted), 1e-3).unwrap();
    assert_eq!(a.smoothed_loss, b.smoothed_loss);
    assert_ne!(a.loss, b.loss);
    assert_eq!(params(&u1), params(&u2), "ε = 1 trained on the targets");

    let (mut one, mut two, mut plain) = (
        smoothing(0.1, false),
        smoothing(0.1, true),
        trainer(&model, 1, false, None),
    );
    let s1 = one.step(std::slice::from_ref(&big), 1e-3).unwrap();
    let s2 = two.step(&micro_batches(&big, 2), 1e-3).unwrap();
    let p = plain.step(std::slice::from_ref(&big), 1e-3).unwrap();
    assert_eq!(p.smoothed_loss, None);
    assert_eq!(
        s1.loss.to_bits(),
        p.loss.to_bits(),
        "the loss is the cross-entropy's"
    );
    let want = 0.9 * p.loss + 0.1 * a.smoothed_loss.unwrap();
    for s in [s1.smoothed_loss.unwrap(), s2.smoothed_loss.unwrap()] {
        assert!((s - want).abs() <= 1e-6 * want, "{s} vs {want}");
    }
    let d = max_rel_diff(&params(&one), &params(&plain));
    assert!(d > 1e-6, "label smoothing changed no parameter ({d})");
    let bad = TrainerConfig {
        label_smoothing: 1.5,
        ..TrainerConfig::default()
    };
    let tier = init_tier(&model, common::copies(TransportDType::F32), SEED).unwrap();
    let err = Trainer::new(CpuExecutor::new(), model.clone(), tier, bad)
        .err()
        .unwrap();
    assert!(err.to_string().contains("label_smoothing 1.5"), "{err}");
}

#[test]
fn blocks_cross_twice_embedding_and_head_once() {
    let model = common::llama_tiny(3);
    // The whole embedding table (tests/embedding_rows.rs takes the rows
    // looked up alone).
    let config = TrainerConfig {
        checkpoint_every: 2,
        compact_embedding: false,
        ..TrainerConfig::default()
    };
    let mut t = trainer_with(&model, config, false);
    let m = t.step(&[TRAINER_STREAM.batch(256, 0, 1, 8)], 1e-3).unwrap();
    let sizes: Vec<u64> = t.tier().layers().iter().map(|s| 4 * s.numel() as u64).collect();
    let (emb, head) = (sizes[0], *sizes.last().unwrap());
    let blocks: u64 = sizes[1..sizes.len() - 1].iter().sum();
    assert_eq!(m.transport_bytes, emb + blocks + head);
    assert_eq!(m.bytes_uploaded, emb + 2 * blocks + head);
    assert_eq!(
        m.bytes_downloaded, m.transport_bytes,
        "f32 gradients of every layer come back once"
    );
    assert!(m.bus_crossings() > 1.0 && m.bus_crossings() < 2.0);
}

/// With bf16 transport, matrices cross as bf16 and vectors (norm gains,
/// biases) are held as f32 by the executor: the count is what it holds.
#[test]
fn bf16_transport_counts_the_bytes_the_executor_holds() {
    for model in [common::llama_tiny(3), gpt2_nano(65)] {
        let config = TrainerConfig {
            checkpoint_every: 2,
            compact_embedding: false,
            ..TrainerConfig::default()
        };
        let tier = common::copies(TransportDType::BF16);
        let mut t = common::trainer(CpuExecutor::new(), &model, tier, SEED, config);
        assert!(
            t.transport_info().is_none(),
            "the CPU executor has no transport to choose"
        );
        let m = t
            .step(&[TRAINER_STREAM.batch(model.vocab_size, 0, 1, 8)], 1e-3)
            .unwrap();
        let held: Vec<u64> = model
            .layer_tables()
            .iter()
            .map(|table| {
                table
                    .iter()
                    .map(|p| (if p.narrow { 2 } else { 4 }) * p.numel() as u64)
                    .sum()
            })
            .collect();
        let (emb, head) = (held[0], *held.last().unwrap());
        let blocks: u64 = held[1..held.len() - 1].iter().sum();
        assert_eq!(m.bytes_uploaded, emb + 2 * blocks + head);
        assert_eq!(m.transport_bytes, 2 * t.tier().n_params());
        assert_eq!(m.bytes_downloaded, 4 * t.tier().n_params());
        // Vectors cross at 2 bytes and are held at 4, so a little over the f32 ratio.
        assert!(
            m.bus_crossings() > 1.0 && m.bus_crossings() < 2.1,
            "{}",
            m.bus_crossings()
        );
    }
}

/// f16 compute with the f16 transport copy follows the f32 run within f16
/// rounding over a few steps, and visibly differs from it.
#[test]
fn f16_compute_tracks_f32_over_a_few_steps() {
    use megatrain_tensor::ComputePrecision;
    use megatrain_tensor::testing::rel_norm_err;
    for model in [common::llama_tiny(3), gpt2_nano(65)] {
        let run = |precision: ComputePrecision, transport: TransportDType| {
            let config = TrainerConfig {
                checkpoint_every: 2,
                chunk_rows: 7,
                adamw: common::adamw(),
                ..TrainerConfig::default()
            };
            let ex = CpuExecutor::with_precision(precision);
            let mut t = common::trainer(ex, &model, common::copies(transport), SEED, config);
            let losses: Vec<f64> = (0..3)
                .map(|i| {
                    t.step(&[TRAINER_STREAM.batch(model.vocab_size, i, 2, 9)], 3e-3)
                        .unwrap()
                        .loss
                })
                .collect();
            let params: Vec<f32> = t
                .tier()
                .layers()
                .iter()
                .flat_map(|l| l.params().to_vec())
                .collect();
            (losses, params)
        };
        let (l32, p32) = run(ComputePrecision::F32, TransportDType::F32);
        let (l16, p16) = run(ComputePrecision::F16, TransportDType::F16);
        for (a, b) in l16.iter().zip(&l32) {
            assert!(
                (a - b).abs() <= 2e-3 * b.abs(),
                "{:?}: loss f16 {a} vs f32 {b}",
                model.arch
            );
        }
        assert_ne!(l16, l32, "{:?}: f16 rounding must show in the losses", model.arch);
        // Adam's first steps move each weight by about ±lr whatever the
        // gradient's size, so weights with near-zero gradients may move
        // differently: compare the updates, not the weights.
        let p0: Vec<f32> = init_tier(&model, TierConfig::default(), SEED)
            .unwrap()
            .layers()
            .iter()
            .flat_map(|l| l.params().to_vec())
            .collect();
        let delta = |p: &[f32]| -> Vec<f32> { p.iter().zip(&p0).map(|(a, b)| a - b).collect() };
        let err = rel_norm_err(&delta(&p16), &delta(&p32));
        assert!(
            err > 0.0 && err < 0.05,
            "{:?}: updates differ by {err:e}",
            model.arch
        );
    }
}

#[test]
fn bad_configurations_are_refused() {
    let model = common::llama_tiny(3);
    let tier = || init_tier(&model, TierConfig::default(), 1).unwrap();
    let ex = CpuExecutor::new;
    let zero_k = TrainerConfig {
        checkpoint_every: 0,
        ..TrainerConfig::default()
    };
    assert!(Trainer::new(ex(), model.clone(), tier(), zero_k).is_err());
    let clip_without_grads = TrainerConfig {
        grad_clip: Some(1.0),
        ..TrainerConfig::default()
    };
    let err = Trainer::new(ex(), model.clone(), tier(), clip_without_grads)
        .err()
        .unwrap();
    assert!(err.to_string().contains("hold"), "{err}");
    let too_many_kept = TrainerConfig {
        keep_activations: 4,
        ..TrainerConfig::default()
    };
    let err = Trainer::new(ex(), model.clone(), tier(), too_many_kept)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("keep_activations (4)") && err.to_string().contains("3 blocks"),
        "{err}"
    );
    let mut other = model.clone();
    other.num_layers = 2;
    assert!(Trainer::new(ex(), other, tier(), TrainerConfig::default()).is_err());
    let mut t = Trainer::new(ex(), model.clone(), tier(), TrainerConfig::default()).unwrap();
    let two = [
        TRAINER_STREAM.batch(256, 0, 1, 8),
        TRAINER_STREAM.batch(256, 1, 1, 8),
    ];
    let err = t.step(&two, 1e-3).unwrap_err();
    assert!(err.to_string().contains("micro-batches"), "{err}");
    let mut bad = TRAINER_STREAM.batch(256, 0, 1, 8);
    bad.inputs[3] = 999;
    let err = t.step(&[bad], 1e-3).unwrap_err();
    assert!(err.to_string().contains("999"), "{err}");
}

/// Evaluating many batches streams each layer once per group of batches,
/// and gives each batch's loss exactly as evaluating it alone: groups of
/// one, of two with a remainder, of all, and larger than all.
#[test]
fn evaluation_in_groups_equals_batch_by_batch() {
    for model in [common::llama_tiny(3), gpt2_nano(61)] {
        let tr = trainer(&model, 2, false, None);
        let batches: Vec<Batch> = (0..5)
            .map(|i| TRAINER_STREAM.batch(model.vocab_size, i, 2, 11))
            .collect();
        let alone: Vec<(f64, usize)> = batches.iter().map(|b| tr.eval_loss(b).unwrap()).collect();
        for group in [1, 2, 5, 9] {
            let grouped = tr.eval_losses_in_groups(&batches, group).unwrap();
            assert_eq!(grouped, alone, "{:?}: groups of {group}", model.arch);
        }
        assert_eq!(tr.eval_losses(&batches).unwrap(), alone);
    }
}

/// Rows of whole records (`--rows records`) are right-padded: attention,
/// the causal convolution and the delta rule look only back, so a record
/// scores in a padded row as it scores alone in a row of its own length,
/// and the padding's ignored targets add nothing.
#[test]
fn a_record_scores_the_same_padded_as_alone() {
    use megatrain::data::{IGNORE_INDEX, Mask, Records, Sampling, TokenData, draw_batch};
    let lens = [5usize, 9, 13];
    for model in [
        common::llama_tiny(3),
        gpt2_nano(61),
        common::zoo_fixture("qwen3_5"),
        common::mixtral_tiny(3),
    ] {
        let v = model.vocab_size as u32;
        let total: usize = lens.iter().sum();
        let ids: Vec<u32> = (0..total as u32).map(|i| (i * 7919 + 13) % v).collect();
        // The first two tokens of each record are its prompt.
        let mut starts = vec![0];
        for l in &lens[..2] {
            starts.push(starts.last().unwrap() + l);
        }
        let counted: Vec<bool> = (0..total)
            .map(|i| !starts.iter().any(|&s| i == s || i == s + 1))
            .collect();
        let data = TokenData {
            tokens: ids.clone().into(),
            loss_mask: Some(Mask::from(counted.clone())),
            records: Some(Records::new(starts.clone())),
        };
        let tr = trainer(&model, 2, false, None);
        let padded = draw_batch(&data, Sampling::Sequential, 0, 3, 16, "mem".as_ref()).unwrap();
        let (sum, n) = tr.eval_loss(&padded).unwrap();
        let (mut sum_alone, mut n_alone) = (0.0, 0);
        for (&s, &l) in starts.iter().zip(&lens) {
            let alone = Batch {
                batch: 1,
                seq_len: l - 1,
                inputs: ids[s..s + l - 1].to_vec(),
                targets: (s + 1..s + l)
                    .map(|i| if counted[i] { ids[i] as i32 } else { IGNORE_INDEX })
                    .collect(),
                lengths: None,
                docs: None,
            };
            let (a, c) = tr.eval_loss(&alone).unwrap();
            sum_alone += a;
            n_alone += c;
        }
        assert_eq!(n, n_alone, "{:?}", model.arch);
        // Each record's first target is its prompt's, and its last token has none.
        assert_eq!(n, total - 2 * lens.len(), "{:?}", model.arch);
        let rel = (sum - sum_alone).abs() / sum_alone.abs();
        assert!(
            rel < 1e-5,
            "{:?}: padded {sum} alone {sum_alone} ({rel:e})",
            model.arch
        );
    }
}

/// Under `output_router_logits`, a step on rows of records padded past
/// their ends equals a step on the same records unpadded: the routers'
/// load-balancing loss averages over the records' tokens only, and the
/// padding's probabilities take none of its gradient (as transformers
/// leaves out what an attention mask masks). Counted over the padding
/// too, the same step differs.
#[test]
fn padding_is_left_out_of_the_routers_load_balancing_loss() {
    use megatrain::data::{Mask, Records, Sampling, TokenData, draw_batch};
    let mut model = common::mixtral_tiny(2);
    model.moe.as_mut().unwrap().aux_loss_coef = Some(0.5);
    let (len, n) = (9usize, 3usize);
    let v = model.vocab_size as u32;
    let ids: Vec<u32> = (0..(len * n) as u32).map(|i| (i * 7919 + 5) % v).collect();
    let data = TokenData {
        tokens: ids.into(),
        loss_mask: Some(Mask::from(vec![true; len * n])),
        records: Some(Records::new((0..n).map(|r| r * len).collect())),
    };
    let draw = |t| draw_batch(&data, Sampling::Sequential, 0, n, t, "mem".as_ref()).unwrap();
    // Rows of exactly the records' length, and rows padded by 7.
    let (exact, padded) = (draw(len), draw(len + 7));
    assert_eq!(
        (exact.lengths.as_ref(), padded.lengths.as_deref()),
        (None, Some(&[len; 3][..]))
    );
    let step = |b: &Batch| {
        let mut tr = trainer(&model, 1, false, None);
        let loss = tr.step(std::slice::from_ref(b), 1e-2).unwrap().loss;
        (loss, params(&tr))
    };
    let (l_exact, p_exact) = step(&exact);
    let (l_padded, p_padded) = step(&padded);
    let diff = max_rel_diff(&p_exact, &p_padded);
    assert!(
        (l_exact - l_padded).abs() < 1e-6 * l_exact.abs(),
        "loss {l_exact} {l_padded}"
    );
    assert!(diff < 1e-5, "parameters differ by {diff:e}");
    let unmasked = Batch {
        lengths: None,
        ..padded.clone()
    };
    let (l_unmasked, p_unmasked) = step(&unmasked);
    let counted_padding = max_rel_diff(&p_exact, &p_unmasked);
    assert!(
        counted_padding > 100.0 * diff.max(1e-9) || (l_unmasked - l_exact).abs() > 1e-4,
        "the padding should move the routers: {counted_padding:e} against {diff:e}"
    );
}

/// Records of `lens` tokens each, one after another, ids spread over
/// `model`'s vocabulary, each record's first two tokens its prompt (not
/// counted); and their total length.
fn records_of(model: &ModelConfig, lens: &[usize]) -> (megatrain::data::TokenData, usize) {
    use megatrain::data::{Mask, Records, TokenData};
    let v = model.vocab_size as u32;
    let total: usize = lens.iter().sum();
    let ids: Vec<u32> = (0..total as u32).map(|i| (i * 7919 + 13) % v).collect();
    let starts: Vec<usize> = lens.iter().scan(0, |s, l| (*s, *s += l).0.into()).collect();
    let counted: Vec<bool> = (0..total)
        .map(|i| !starts.iter().any(|&s| i == s || i == s + 1))
        .collect();
    let data = TokenData {
        tokens: ids.into(),
        loss_mask: Some(Mask::from(counted)),
        records: Some(Records::new(starts)),
    };
    (data, total)
}

/// A step on `rows` (records sharing rows, kept apart by its documents)
/// gives the loss and parameters of one on `alone` (the same records one a
/// row); without the documents it would not.
fn steps_as_alone(model: &ModelConfig, rows: &Batch, alone: &Batch) {
    let step = |b: &Batch| {
        let mut tr = trainer(model, 2, false, None);
        let loss = tr.step(std::slice::from_ref(b), 1e-2).unwrap().loss;
        (loss, params(&tr))
    };
    let ((lr, pr), (la, pa)) = (step(rows), step(alone));
    let diff = max_rel_diff(&pr, &pa);
    assert!(
        (lr - la).abs() < 1e-6 * la.abs(),
        "{:?}: loss {lr} {la}",
        model.arch
    );
    assert!(diff < 1e-5, "{:?}: parameters differ by {diff:e}", model.arch);
    let leaky = Batch {
        docs: None,
        ..rows.clone()
    };
    let (ll, _) = step(&leaky);
    assert!(
        (ll - la).abs() > 1e-5 * la.abs(),
        "{:?}: the test can tell",
        model.arch
    );
}

/// `--rows packed`: a batch whose rows hold several records each steps as
/// the same records one a row, right-padded: the same loss over the same
/// counted targets and the same parameters after the step (the routers'
/// load-balancing loss included: both leave only the padding out; Qwen3.5's
/// convolution and delta rule restarting at each record). The batch holds
/// half the rows.
#[test]
fn packed_rows_step_as_the_same_records_one_a_row() {
    use megatrain::data::{Sampling, TokenData, draw_batch};
    // Rows of 16 take records {0, 1} (14 tokens) and {2, 3} (12): record 0
    // again would not fit after them.
    let lens = [5usize, 9, 4, 8];
    let mut moe = common::mixtral_tiny(2);
    moe.moe.as_mut().unwrap().aux_loss_coef = Some(0.5);
    for model in [
        common::llama_tiny(3),
        gpt2_nano(61),
        moe,
        common::zoo_fixture("qwen3_5"),
    ] {
        let (data, total) = records_of(&model, &lens);
        let draw =
            |d: &TokenData, rows| draw_batch(d, Sampling::Sequential, 0, rows, 16, "mem".as_ref()).unwrap();
        let (packed, alone) = (draw(&data.clone().packed(), 2), draw(&data, 4));
        assert_eq!(packed.lengths.as_deref(), Some(&[14, 12][..]));
        assert!(packed.docs.is_some() && alone.docs.is_none());
        assert_eq!(packed.counted(), alone.counted());
        assert_eq!(packed.counted(), total - 2 * lens.len());
        steps_as_alone(&model, &packed, &alone);
    }
}

/// `--rows stream-docs`: windows of the stream, each record in a window on
/// its own, step as the records one a row where the windows cut no record
/// but at a window's end: rows of 13 over records of 5, 9, 4 and 8 tokens
/// hold {0, 1 up to its last token} and {1's last token, 2, 3}, the window
/// wrapping to the stream's start for its last target. Same loss over the
/// same counted targets, same parameters; a record's last token predicts
/// nothing, and without the documents the records would read each other.
#[test]
fn stream_windows_of_records_step_as_the_records_one_a_row() {
    use megatrain::data::{Sampling, draw_batch};
    let lens = [5usize, 9, 4, 8];
    for model in [
        common::llama_tiny(3),
        gpt2_nano(61),
        common::zoo_fixture("qwen3_5"),
    ] {
        let (data, _) = records_of(&model, &lens);
        let windows = draw_batch(
            &data.clone().windows(),
            Sampling::Sequential,
            0,
            2,
            13,
            "mem".as_ref(),
        )
        .unwrap();
        let alone = draw_batch(&data, Sampling::Sequential, 0, 4, 16, "mem".as_ref()).unwrap();
        assert_eq!(windows.lengths, None, "no padding");
        let docs = windows.docs.clone().expect("records share the windows");
        assert_eq!(
            docs,
            megatrain_tensor::Docs::new(13, &[vec![0, 5], vec![0, 1, 5]]).unwrap()
        );
        // Each record's last token (positions 4; 13, 17, 25 of the stream)
        // predicts nothing.
        for (row, pos) in [(0, 4), (1, 0), (1, 4), (1, 12)] {
            assert_eq!(
                windows.targets[row * 13 + pos],
                megatrain::data::IGNORE_INDEX,
                "row {row} at {pos}"
            );
        }
        assert_eq!(windows.counted(), alone.counted());
        steps_as_alone(&model, &windows, &alone);
    }
}

/// Every family of the zoo's fixtures trains through a bf16 and an f16
/// copy: tensors of rank ≥ 2 that only f32 ops read (a Gated DeltaNet's
/// convolution kernels `[C, 1, K]`, Kimi's `A_log` stored `[1, 1, H, 1]`)
/// are widened on load like vectors, and the step's loss is the forward's
/// on the same weights.
#[test]
fn every_family_trains_through_sixteen_bit_copies() {
    for case in common::FAMILIES {
        for transport in [TransportDType::BF16, TransportDType::F16] {
            let model = common::zoo_fixture(case);
            let config = TrainerConfig {
                checkpoint_every: 2,
                ..TrainerConfig::default()
            };
            let tier = common::copies(transport);
            let mut t = common::trainer(CpuExecutor::new(), &model, tier, SEED, config);
            let batch = TRAINER_STREAM.batch(model.vocab_size, 0, 2, 8);
            let (sum, count) = t.eval_loss(&batch).unwrap();
            let m = t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
            let want = sum / count as f64;
            assert!(
                (m.loss - want).abs() <= 1e-6 * want.abs(),
                "{case} {transport:?}: step loss {} against the forward's {want}",
                m.loss
            );
        }
    }
}

/// A tier loaded for forwards (its params handed back once each copy is
/// written) evaluates as the whole tier does, and refuses to step.
#[test]
fn a_tier_loaded_for_forwards_evaluates_and_refuses_a_step() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures/llama_gqa");
    let ckpt = megatrain_zoo::HfCheckpoint::open(&dir).unwrap();
    let model = ckpt.config.clone();
    let batch = TRAINER_STREAM.batch(model.vocab_size, 0, 2, 8);
    for transport in [TransportDType::F32, TransportDType::BF16] {
        let trainer =
            |tier| Trainer::new(CpuExecutor::new(), model.clone(), tier, TrainerConfig::default()).unwrap();
        let whole = trainer(load_tier(&ckpt, common::copies(transport)).unwrap());
        let mut light = trainer(load_tier_for_forwards(&ckpt, transport).unwrap());
        assert!(light.tier().is_transport_only());
        assert_eq!(light.eval_loss(&batch).unwrap(), whole.eval_loss(&batch).unwrap());
        let err = light.step(std::slice::from_ref(&batch), 1e-3).unwrap_err();
        assert!(err.to_string().contains("transport copies"), "{err}");
    }
}
