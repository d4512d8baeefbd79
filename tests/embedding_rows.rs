//! An untied embedding's step on the rows its token ids look up
//! (`TrainerConfig::compact_embedding`): the same losses, parameters, step
//! counts and transport copies bit for bit as a step over the whole table,
//! on the CPU executor and on the GPU (lavapipe here), f32, bf16 and f16
//! transport, prime chunks, a kept block, a pad token among the ids and
//! runs of consecutive ids; the gradient norms within their last bits
//! (summed over fewer zeros); the table's bytes cross the bus for the
//! looked-up rows only. Where the step cannot take them (a tied head,
//! micro-batches summed, an id past the vocabulary), it takes the whole
//! table, as before.

use crate::common;

use common::{CHANGING_LRS as LRS, CHUNK_STREAM, StepCase};
use megatrain::data::Batch;
use megatrain::trainer::{Trainer, TrainerConfig};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::ModelConfig;

struct Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<Vec<u32>>,
    moments: Vec<(Vec<u32>, Vec<u32>)>,
    transport: Vec<Vec<u8>>,
    steps: Vec<u64>,
    down: Vec<u64>,
    up: Vec<u64>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|y| y.to_bits()).collect()
}

/// Step `step`'s micro-batches, one of them with ids in runs (0, 1, 2 and
/// the vocabulary's last three) and the pad token where the model has one.
fn batches(model: &ModelConfig, case: StepCase, step: usize) -> Vec<Batch> {
    let vocab = model.vocab_size;
    let mut micro = case.micro_batches(vocab, step);
    if step == 1 {
        let ids = [0, 1, 2, vocab as u32 - 3, vocab as u32 - 2, vocab as u32 - 1];
        micro[0].inputs[..ids.len()].copy_from_slice(&ids);
        if let Some(p) = model.pad_token_id {
            micro[0].inputs[8] = p as u32;
        }
    }
    micro
}

fn train<E: Executor>(ex: E, model: &ModelConfig, case: StepCase, compact: bool) -> Run {
    let tier = TierConfig {
        transport: case.transport,
        hold_grads: case.micro > 1,
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        transfer_chunk: case.chunk,
        keep_activations: case.keep,
        compact_embedding: compact,
        ..common::k2_config(None)
    };
    let mut t: Trainer<E> = common::trainer(ex, model, tier, 5, config);
    let mut run = Run {
        losses: Vec::new(),
        norms: Vec::new(),
        params: Vec::new(),
        moments: Vec::new(),
        transport: Vec::new(),
        steps: Vec::new(),
        down: Vec::new(),
        up: Vec::new(),
    };
    for (step, lr) in LRS.iter().enumerate() {
        let m = t.step(&batches(model, case, step), *lr).unwrap();
        run.losses.push(m.loss);
        run.norms.push(m.grad_norm.expect("a norm"));
        run.down.push(m.bytes_downloaded);
        run.up.push(m.bytes_uploaded);
    }
    for s in t.tier().layers() {
        run.params.push(bits(s.params()));
        run.moments.push((bits(s.m()), bits(s.v())));
        run.transport.push(s.transport().as_bytes().to_vec());
        run.steps.push(s.step());
    }
    run
}

fn cases() -> Vec<StepCase> {
    let mut v = common::step_cases().to_vec();
    v.push(StepCase {
        transport: TransportDType::F16,
        chunk: 1021,
        ..v[0]
    });
    v
}

fn check<E: Executor>(make: impl Fn() -> E, model: &ModelConfig, cases: &[StepCase]) {
    // The embedding's gradient bytes: the whole table's, or as many rows'
    // as a step has inputs.
    let c = model.hidden_size as u64;
    let v = model.vocab_size as u64;
    for &case in cases {
        let what = format!("{:?} tied {} {case:?}", model.arch, model.tie_word_embeddings);
        let whole = train(make(), model, case, false);
        let rows = train(make(), model, case, true);
        assert_eq!(whole.losses, rows.losses, "{what}: losses");
        assert!(whole.params == rows.params, "{what}: parameters differ");
        assert!(whole.moments == rows.moments, "{what}: moments differ");
        assert!(
            whole.transport == rows.transport,
            "{what}: transport copies differ"
        );
        assert_eq!(whole.steps, rows.steps, "{what}: step counts");
        assert!(rows.steps.iter().all(|&s| s == LRS.len() as u64), "{what}");
        for (a, b) in whole.norms.iter().zip(&rows.norms) {
            assert!((a - b).abs() <= 1e-12 * a, "{what}: norms {a} vs {b}");
        }
        let taken = case.micro == 1 && !model.tie_word_embeddings;
        for step in 0..LRS.len() {
            // As many rows as a micro-batch has inputs, the ids' first.
            let table = (batches(model, case, step)[0].inputs.len() as u64).min(v);
            let saved_down = match taken {
                true => 4 * (v - table) * c,
                false => 0,
            };
            assert_eq!(
                whole.down[step] - rows.down[step],
                saved_down,
                "{what}: step {step}'s gradient bytes"
            );
            assert!(
                (whole.up[step] > rows.up[step]) == taken,
                "{what}: step {step} uploaded {} then {}",
                whole.up[step],
                rows.up[step]
            );
        }
    }
}

#[test]
fn cpu_rows_looked_up_train_as_the_whole_table() {
    let mut model = common::llama_tiny(3);
    check(CpuExecutor::new, &model, &cases());
    // A pad token among the ids: its row takes no gradient from the lookup.
    model.pad_token_id = Some(7);
    check(CpuExecutor::new, &model, &cases()[..1]);
    // A tied head reads the whole table: the step takes all of it.
    model.tie_word_embeddings = true;
    check(CpuExecutor::new, &model, &cases()[..1]);
}

#[test]
fn gpu_rows_looked_up_train_as_the_whole_table() {
    let Some(ctx) = common::ctx() else { return };
    let mut model = common::llama_tiny(2);
    model.pad_token_id = Some(7);
    let c = cases();
    check(|| GpuExecutor::new(ctx.clone()), &model, &[c[0], c[3], c[4]]);
}

/// An id past the vocabulary is named by the lookup, as the whole table's
/// forward names it.
#[test]
fn an_id_past_the_vocabulary_is_named() {
    let model = common::llama_tiny(2);
    let mut t = common::trainer(
        CpuExecutor::new(),
        &model,
        TierConfig::default(),
        5,
        TrainerConfig::default(),
    );
    let mut b = CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9);
    b.inputs[3] = model.vocab_size as u32;
    let err = t.step(&[b], 1e-3).unwrap_err().to_string();
    assert!(err.contains("256") && err.contains("token"), "{err}");
}
