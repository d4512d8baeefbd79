//! `--precision f16` streamed steps on the GPU with each f16 operand's max
//! found once per value (from the maxima the matmul, norm or RoPE that
//! stored it left, or scanned) and remembered with its tensor give the bits of scanning every
//! operand at every use, and scan the expected number of tensors. With f32 weights on the bus, the slots' weights are operands
//! too, reloaded into the same buffers layer after layer: a max kept past
//! a reload would show here. The words the maxima are kept in come from
//! the pool: warm steps allocate nothing on the device.

mod common;

use std::sync::Arc;

use megatrain::trainer::TrainerConfig;
use megatrain_gpu::{F16Matmul, GpuContext, GpuExecutor, GpuOptions};
use megatrain_tensor::{ComputePrecision, Executor};
use megatrain_tier::TransportDType;
use megatrain_zoo::ModelConfig;

struct Run {
    losses: Vec<u64>,
    params: Vec<u32>,
    /// Operand scans of each step.
    scans: Vec<u64>,
    /// Device allocations (pool misses) of each step.
    allocations: Vec<u64>,
}

fn run(
    ctx: &Arc<GpuContext>,
    model: &ModelConfig,
    transport: TransportDType,
    recompute: bool,
    k: usize,
) -> Run {
    let mut ex = GpuExecutor::with_options(
        ctx.clone(),
        GpuOptions {
            f16_matmul: F16Matmul::Simt,
            recompute_operand_maxima: recompute,
            ..Default::default()
        },
    );
    ex.set_compute_precision(ComputePrecision::F16).unwrap();
    let config = TrainerConfig {
        checkpoint_every: k,
        chunk_rows: 32,
        ..TrainerConfig::default()
    };
    let mut tr = common::trainer(ex, model, common::copies(transport), 3, config);
    let (mut losses, mut scans, mut allocations) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..3 {
        let before = tr.executor().operand_max_scans();
        let allocated = tr.executor().memory().allocations;
        let loss = tr
            .step(&[common::GPU_STREAM.batch(model.vocab_size, step, 2, 24)], 1e-3)
            .unwrap()
            .loss;
        losses.push(loss.to_bits());
        scans.push(tr.executor().operand_max_scans() - before);
        allocations.push(tr.executor().memory().allocations - allocated);
    }
    let params = tr
        .tier()
        .layers()
        .iter()
        .flat_map(|l| l.params().iter().map(|x| x.to_bits()))
        .collect();
    Run {
        losses,
        params,
        scans,
        allocations,
    }
}

/// Operand scans of one step of `l` llama blocks and a head of `c` row
/// chunks, `(remembered, rescanned)`.
///
/// Remembered: the outputs of matmuls, norms, RoPE, attention and the
/// cross-entropy come with the maxima their producers stored, so nothing
/// in a block or a head chunk is scanned; only the top block's dy,
/// assembled from the chunks' dx by write_rows, is scanned, once.
///
/// Rescanning, every use scans: a block's forward reads n1.y (q, k, v), a
/// (o), n2.y (gate, up) and s (down), and attention rounds q, k and v: 10
/// uses; its backward reads dy, dgate, dup, dx2, attention's dout, dq, dk
/// and dv in 18 uses (7 products of two, attention of four). Each head
/// chunk: x, then x and dlogits.
///
/// f32 weights (scanned either way): every load is a value (the
/// forward's, and the backward's for the recompute and the backward: 7
/// each), used 7 + 14 times; the head's weight is one value used twice per
/// chunk.
fn expected_scans(l: u64, c: u64, f32_weights: bool) -> (u64, u64) {
    let (mut once, mut every) = (1, l * (2 * 10 + 18) + 3 * c);
    if f32_weights {
        once += l * 2 * 7 + 1;
        every += l * 3 * 7 + 2 * c;
    }
    (once, every)
}

#[test]
fn remembered_maxima_give_the_bits_of_rescanning_and_scan_each_value_once() {
    let Some(ctx) = common::ctx() else { return };
    let model = common::llama_tiny(2);
    // 2 × 24 rows in chunks of 32.
    let chunks = 2;
    for transport in [TransportDType::F32, TransportDType::F16] {
        for k in [1, 2] {
            let cached = run(&ctx, &model, transport, false, k);
            let fresh = run(&ctx, &model, transport, true, k);
            let what = format!("{transport:?} transport, K = {k}");
            eprintln!(
                "{what}: scans per step {:?} (rescanning: {:?})",
                cached.scans, fresh.scans
            );
            assert_eq!(cached.losses, fresh.losses, "{what}: losses");
            assert!(
                cached.params == fresh.params,
                "{what}: parameters after 3 steps differ"
            );
            let (once, every) = expected_scans(2, chunks, transport == TransportDType::F32);
            assert_eq!(cached.scans, [once; 3], "{what}: scans with remembered maxima");
            assert_eq!(fresh.scans, [every; 3], "{what}: scans when rescanning");
            // The remembered words are pooled like any tensor.
            assert_eq!(cached.allocations[1..], [0, 0], "{what}: warm steps allocate");
        }
    }
}
