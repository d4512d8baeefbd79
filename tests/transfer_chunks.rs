//! Moving gradients in chunks changes no result: the same losses and
//! parameters, bit for bit, whether every layer comes down whole or in
//! chunks of an awkward size (smaller than every layer, not a divisor of
//! any), on the CPU executor and on the GPU (lavapipe here), f32 and bf16
//! transport, tied and untied heads, with gradient accumulation and with
//! exact clipping; nor does how many chunks of a layer are in flight at
//! once (the default's few, or all of the layer's). Also: the staging pool
//! is sized by the chunk.

mod common;

use common::CHUNK_STREAM;
use megatrain::data::Batch;
use megatrain::trainer::{Trainer, TrainerConfig};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::ModelConfig;

/// Smaller than every layer of the test models, and prime.
const CHUNK: usize = 1021;
/// Larger than every layer: each comes down whole.
const WHOLE: usize = usize::MAX / 8;

/// llama-tiny and gpt2-nano with two blocks each, heads tied or not.
fn models(tied: bool) -> [ModelConfig; 2] {
    [common::llama_tiny(2), common::gpt2_two_blocks()].map(|mut c| {
        c.tie_word_embeddings = tied;
        c
    })
}

#[derive(Clone, Copy, Debug)]
struct Case {
    transport: TransportDType,
    /// Micro-batches per step (more than one holds gradients).
    micro: usize,
    clip: Option<f64>,
}

fn trainer<E: Executor>(ex: E, model: &ModelConfig, case: Case, chunk: usize) -> Trainer<E> {
    trainer_in_flight(ex, model, case, chunk, TrainerConfig::default().chunks_in_flight)
}

fn trainer_in_flight<E: Executor>(
    ex: E,
    model: &ModelConfig,
    case: Case,
    chunk: usize,
    chunks_in_flight: usize,
) -> Trainer<E> {
    let tier = TierConfig {
        transport: case.transport,
        hold_grads: case.micro > 1 || case.clip.is_some(),
        ..TierConfig::default()
    };
    let config = TrainerConfig {
        transfer_chunk: chunk,
        chunks_in_flight,
        ..common::k2_config(case.clip)
    };
    common::trainer(ex, model, tier, 5, config)
}

/// Losses of 3 steps and the parameters (and transport copies) after.
fn train<E: Executor>(mut t: Trainer<E>, case: Case) -> (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<u8>>) {
    let vocab = t.model().vocab_size;
    let mut losses = Vec::new();
    for step in 0..3u64 {
        let micro: Vec<Batch> = (0..case.micro as u64)
            .map(|k| CHUNK_STREAM.batch(vocab, step * 10 + k, 2, 9))
            .collect();
        let m = t.step(&micro, 3e-3).unwrap();
        // The wait after backward is part of the whole wait; in clipping
        // mode it holds the whole update.
        assert!(m.optimizer_tail_ms <= m.optimizer_wait_ms, "{m:?}");
        assert!(case.clip.is_none() || m.optimizer_tail_ms > 0.0, "{m:?}");
        losses.push(m.loss);
    }
    let layers = t.tier().layers();
    (
        losses,
        layers.iter().map(|s| s.params().to_vec()).collect(),
        layers.iter().map(|s| s.transport().as_bytes().to_vec()).collect(),
    )
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for transport in [TransportDType::F32, TransportDType::BF16] {
        v.push(Case {
            transport,
            micro: 1,
            clip: None,
        });
    }
    v.push(Case {
        transport: TransportDType::BF16,
        micro: 3,
        clip: None,
    });
    v.push(Case {
        transport: TransportDType::F32,
        micro: 2,
        clip: Some(0.05),
    });
    v
}

fn check<E: Executor>(make: impl Fn() -> E, model: &ModelConfig) {
    for case in cases() {
        let whole = train(trainer(make(), model, case, WHOLE), case);
        // Two chunks of a layer in flight, and (the default) every chunk of
        // a block's size begun as the layer's gradients exist.
        let chunked = train(trainer_in_flight(make(), model, case, CHUNK, 2), case);
        let all_begun = train(trainer_in_flight(make(), model, case, CHUNK, 0), case);
        let what = format!("{:?} tied {} {case:?}", model.arch, model.tie_word_embeddings);
        assert!(whole.0.iter().all(|l| l.is_finite()), "{what}: {:?}", whole.0);
        for (how, run) in [("chunked", &chunked), ("all chunks in flight", &all_begun)] {
            assert_eq!(whole.0, run.0, "{what}, {how}: losses");
            assert!(whole.1 == run.1, "{what}, {how}: parameters differ");
            assert!(whole.2 == run.2, "{what}, {how}: transport copies differ");
        }
    }
}

#[test]
fn cpu_chunks_change_no_result() {
    for tied in [false, true] {
        for model in models(tied) {
            check(CpuExecutor::new, &model);
        }
    }
}

#[test]
fn gpu_chunks_change_no_result() {
    let Some(ctx) = common::ctx() else { return };
    for tied in [false, true] {
        for model in models(tied) {
            check(|| GpuExecutor::new(ctx.clone()), &model);
        }
    }
}

/// The same where downloads go through the copy queue's staging ring
/// (`side_readback`; on lavapipe the queue is wgpu's own, the
/// synchronization all there): with all of a layer's chunks in flight the
/// ring holds more buffers than its fewest, each reused only once the copy
/// queue has read it. And with each layer's chunks taken from one device
/// copy of the layer (`DownloadStaging::Layer`).
#[test]
fn gpu_chunks_change_no_result_on_the_copy_queue() {
    if common::ctx().is_none() {
        return;
    }
    let ctx = megatrain_gpu::GpuContext::with_some_copy_queue().unwrap();
    if ctx.copy_queue().is_none() {
        eprintln!("no copy queue (no host memory import): NOT tested here");
        return;
    }
    for model in models(false) {
        check(|| GpuExecutor::new(ctx.clone()), &model);
        let layer = megatrain_gpu::GpuOptions {
            download_staging: megatrain_gpu::DownloadStaging::Layer,
            ..Default::default()
        };
        check(|| GpuExecutor::with_options(ctx.clone(), layer.clone()), &model);
    }
}

/// The pool holds chunk-sized buffers only: the one being filled, those
/// queued for the optimizer, the one it works on, never a whole layer.
#[test]
fn staging_is_sized_by_the_chunk() {
    let case = Case {
        transport: TransportDType::BF16,
        micro: 1,
        clip: None,
    };
    let [model, _] = models(false);
    let largest = model.layer_tables().iter().map(|t| t.numel()).max().unwrap();
    assert!(largest > 4 * CHUNK, "the test needs layers of several chunks");
    let mut t = trainer(CpuExecutor::new(), &model, case, CHUNK);
    t.step(&[CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9)], 1e-3)
        .unwrap();
    let queue = TrainerConfig::default().optimizer_queue;
    let bound = 4 * CHUNK as u64 * (queue as u64 + 2);
    assert!(
        t.staging_bytes() > 0 && t.staging_bytes() <= bound,
        "staging peak {} B, bound {bound} B (a whole layer is {} B)",
        t.staging_bytes(),
        4 * largest
    );
}

/// `transfer_only` (bench-throughput's bus measurement) moves a step's
/// bytes, in the step's chunks: every chunk of every layer is begun and
/// finished (a missed one would leave a download unfinished on the GPU).
/// `check` looks at the executor after the transfers.
fn transfer_only_moves_a_steps_bytes<E: Executor>(make: impl Fn() -> E, check: impl Fn(&E)) {
    let case = Case {
        transport: TransportDType::BF16,
        micro: 1,
        clip: None,
    };
    let [model, _] = models(false);
    // (chunk, chunks of a layer in flight): the default's few, and all.
    for (chunk, in_flight) in [(CHUNK, 2), (WHOLE, 2), (CHUNK, 0)] {
        let mut t = trainer_in_flight(make(), &model, case, chunk, in_flight);
        // A step of 2 × 9 tokens: the embedding's table of 18 rows.
        let moved = t.transfer_only(18).unwrap();
        check(t.executor());
        let step = t
            .step(&[CHUNK_STREAM.batch(model.vocab_size, 0, 2, 9)], 1e-3)
            .unwrap();
        assert_eq!(
            moved.bytes_downloaded, step.bytes_downloaded,
            "chunk {chunk}, {in_flight}"
        );
        assert_eq!(
            moved.bytes_uploaded, step.bytes_uploaded,
            "chunk {chunk}, {in_flight}"
        );
        assert!(moved.ms > 0.0);
    }
}

#[test]
fn cpu_transfer_only_moves_a_steps_bytes_in_chunks() {
    transfer_only_moves_a_steps_bytes(CpuExecutor::new, |_| {});
}

#[test]
fn gpu_transfer_only_moves_a_steps_bytes_in_chunks() {
    let Some(ctx) = common::ctx() else { return };
    // Read where they landed, as the step's are: the bus time has no host
    // copy in it that the step does not make.
    transfer_only_moves_a_steps_bytes(
        || GpuExecutor::new(ctx.clone()),
        |g| assert!(g.transport_stats().downloads_in_place > 0),
    );
}
