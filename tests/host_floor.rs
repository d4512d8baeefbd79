//! The host's work per streamed step, counted on wgpu's noop backend (no
//! kernel runs, so a step costs only the host and these run in
//! milliseconds): ops recorded, queue submissions, waits on the device,
//! and nothing allocated once warm. The budgets are today's counts: a
//! change that records, submits or waits more per step fails here and
//! must say why (BENCHMARKS.md, "Host floor of a streamed step").

use crate::common;

use megatrain::trainer::{Trainer, TrainerConfig};
use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions, HostWork, SubmitStats, TransportChoice};
use megatrain_tensor::{ComputePrecision, Executor};
use megatrain_tier::TransportDType;
use megatrain_zoo::{ModelConfig, default_chunk_rows, preset};

struct Case {
    name: &'static str,
    model: ModelConfig,
    batch: usize,
    seq_len: usize,
    precision: ComputePrecision,
    transport: TransportChoice,
    k: usize,
}

fn trainer(c: &Case) -> Trainer<GpuExecutor> {
    let ctx = GpuContext::host_floor().unwrap();
    let mut ex = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            transport: c.transport,
            ..GpuOptions::default()
        },
    );
    ex.set_compute_precision(c.precision).unwrap();
    let transport = match c.precision {
        ComputePrecision::F16 => TransportDType::F16,
        _ => TransportDType::F32,
    };
    let config = TrainerConfig {
        checkpoint_every: c.k,
        chunk_rows: default_chunk_rows(c.model.vocab_size, ex.logits_chunk_bytes()),
        ..TrainerConfig::default()
    };
    common::trainer(ex, &c.model, common::copies(transport), 3, config)
}

/// Per-step counts of `steps` steps after `warm` warm-up steps.
fn per_step(c: &Case, warm: u64, steps: u64) -> Vec<HostWork> {
    let mut tr = trainer(c);
    let vocab = c.model.vocab_size;
    for i in 0..warm {
        tr.step(&[common::GPU_STREAM.batch(vocab, i, c.batch, c.seq_len)], 1e-3)
            .unwrap();
    }
    (warm..warm + steps)
        .map(|i| {
            let before = tr.executor().host_work();
            tr.step(&[common::GPU_STREAM.batch(vocab, i, c.batch, c.seq_len)], 1e-3)
                .unwrap();
            tr.executor().host_work() - before
        })
        .collect()
}

fn cases() -> Vec<(Case, SubmitStats)> {
    let nano = |precision, transport| Case {
        name: "gpt2-nano, the main job's shape",
        model: preset("gpt2-nano", Some(65)).unwrap(),
        batch: 12,
        seq_len: 64,
        precision,
        transport,
        k: 1,
    };
    // Today's counts per warm step; bind groups, device buffers and
    // transport buffers made per step are always 0 (and uploads and
    // downloads are whatever the step needs: equal every warm step).
    let budget = |[
        ops,
        dispatches,
        passes,
        op_submissions,
        transfer_submissions,
        waits,
    ]: [u64; 6]| SubmitStats {
        ops,
        dispatches,
        passes,
        op_submissions,
        transfer_submissions,
        waits,
    };
    vec![
        (
            nano(ComputePrecision::F32, TransportChoice::Mapped),
            // 230 dispatches since the weight gradients split their sum
            // over the step's 768 rows (`k_parts`: 213 before, one more per
            // product).
            budget([152, 230, 130, 11, 7, 19]),
        ),
        (
            nano(ComputePrecision::F16, TransportChoice::Staging),
            budget([164, 331, 204, 11, 17, 19]),
        ),
        (
            Case {
                name: "llama-tiny, K = 2",
                model: common::llama_tiny(2),
                batch: 4,
                seq_len: 64,
                precision: ComputePrecision::F32,
                transport: TransportChoice::Staging,
                k: 2,
            },
            // 7 op submissions since RoPE's angle tables stay on the device
            // (15 before: each rotation's table upload flushed the batch).
            // 127 dispatches with the weight gradients' split sums (112).
            budget([92, 127, 83, 7, 11, 13]),
        ),
    ]
}

/// Once warm, every step does the same host work, within today's budget,
/// and makes nothing: no bind group (the embedding backward's index
/// upload no longer depends on how many distinct tokens a batch has), no
/// device buffer, no staging or readback buffer.
#[test]
fn warm_steps_stay_within_the_host_work_budget() {
    for (c, budget) in cases() {
        let steps = per_step(&c, 3, 4);
        let what = format!("{} ({:?}, {})", c.name, c.precision, c.transport);
        eprintln!("{what}: per warm step {:?}", steps[0]);
        assert!(
            steps.iter().all(|s| *s == steps[0]),
            "{what}: steps differ: {steps:?}"
        );
        let s = steps[0];
        assert_eq!(
            (s.bind_groups_made, s.device_allocations, s.host_buffers_made),
            (0, 0, 0),
            "{what}: (bind groups, device buffers, transport buffers) made per warm step"
        );
        let w = s.submit;
        let over: Vec<String> = [
            ("ops", w.ops, budget.ops),
            ("dispatches", w.dispatches, budget.dispatches),
            ("compute passes", w.passes, budget.passes),
            ("op submissions", w.op_submissions, budget.op_submissions),
            (
                "transfer submissions",
                w.transfer_submissions,
                budget.transfer_submissions,
            ),
            ("waits", w.waits, budget.waits),
        ]
        .into_iter()
        .filter(|(_, got, max)| got > max)
        .map(|(name, got, max)| format!("{name} {got} > {max}"))
        .collect();
        assert!(over.is_empty(), "{what}: per step {}", over.join(", "));
    }
}

/// The optimizer reads each gradient chunk where it landed and gives its
/// buffer back when it is done, at its own pace: however many chunks it
/// lets queue (1 or 4), with chunks smaller than every layer (dozens per
/// layer, a short tail each), the readback buffers are the ones reserved
/// at the first step (3 more for a queue 3 longer: none made on demand)
/// and all a warm step needs, every chunk is read in place, and no staging
/// buffer is taken.
#[test]
fn gradients_read_in_place_make_no_buffer_once_warm() {
    let model = common::llama_tiny(2);
    let mut made = Vec::new();
    for queue in [1, 4] {
        let ex = GpuExecutor::with_options(
            GpuContext::host_floor().unwrap(),
            GpuOptions {
                transport: TransportChoice::Staging,
                ..GpuOptions::default()
            },
        );
        let config = TrainerConfig {
            optimizer_queue: queue,
            transfer_chunk: 1021,
            ..TrainerConfig::default()
        };
        let mut tr = common::trainer(ex, &model, common::copies(TransportDType::F32), 3, config);
        let start = tr.executor().transport_stats();
        let step = |tr: &mut Trainer<GpuExecutor>, i| {
            tr.step(&[common::GPU_STREAM.batch(model.vocab_size, i, 2, 16)], 1e-3)
                .unwrap();
        };
        step(&mut tr, 0);
        step(&mut tr, 1);
        let before = tr.executor().transport_stats();
        for i in 2..6 {
            step(&mut tr, i);
        }
        let d = tr.executor().transport_stats().since(&before);
        made.push(tr.executor().transport_stats().since(&start).buffers_created);
        assert_eq!(
            d.buffers_created, 0,
            "queue {queue}: buffers made once warm: {d:?}"
        );
        // Dozens of chunks a layer: the blocks' and the head's (the
        // embedding's looked-up rows come down whole).
        assert!(d.downloads > 4 * 100, "queue {queue}: {d:?}");
        assert_eq!(d.downloads_in_place, d.downloads, "queue {queue}: {d:?}");
        assert_eq!(tr.staging_bytes(), 0, "queue {queue}");
    }
    assert_eq!(
        made[1],
        made[0] + 3,
        "host buffers made with queues 1 and 4: {made:?}"
    );
}

/// Ranks that share a device each report their part of it, so that
/// `--keep-activations auto` sizes each rank's kept blocks by its part.
#[test]
fn ranks_sharing_a_device_report_their_share_of_it() {
    use megatrain_tensor::TensorMemory;
    let memory = |device_ranks| {
        GpuExecutor::with_options(
            GpuContext::host_floor().unwrap(),
            GpuOptions {
                device_ranks,
                ..GpuOptions::default()
            },
        )
        .tensor_memory()
    };
    let TensorMemory::Device(Some(whole)) = memory(0) else {
        panic!("the host floor stands for a GPU");
    };
    assert_eq!(memory(1), TensorMemory::Device(Some(whole)));
    assert_eq!(memory(4), TensorMemory::Device(Some(whole / 4)));
}
