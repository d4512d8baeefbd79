//! One configuration, run in this (fresh) process: warm-up and timed
//! training steps, the memory readings, then the isolated modes.

use anyhow::Context;
use megatrain::StepMetrics;
use megatrain::data::{Batch, Sampling, TokenData, draw_batch};
use megatrain::run::{KeepActivations, PlanInput, Precision, Room};
use megatrain::trainer::{Trainer, TrainerConfig, init_tier, load_tier, transfer_chunk_for};
use megatrain_adamw::AdamWConfig;
use megatrain_gpu::{GpuContext, GpuExecutor};
use megatrain_tensor::{CpuExecutor, Executor};
use megatrain_tier::{HostTier, Shard, SharedTransport, TierConfig, WindowConfig, rss};
use megatrain_zoo::{HfCheckpoint, ModelConfig};

use super::floor::{HostCounters, NOOP_DEVICE, StepCounters, noop_context};
use super::profile::{OpProfiler, StepProfile};
use super::record::{HostPeak, Modes, PeakPhases, Phase, Record, median};
use super::spec::Spec;

/// Runs `spec` on the device it names.
pub fn run(spec: &Spec) -> anyhow::Result<Record> {
    // As the `megatrain` binary does: the peak RSS is then live buffers,
    // not freed ones the allocator kept.
    rss::return_large_frees_to_os();
    let baseline_rss = rss::current_rss_bytes().unwrap_or(0);
    match spec.device.as_str() {
        "cpu" => run_on(CpuExecutor::default(), spec, baseline_rss, |_| None, |_| None),
        "gpu" | NOOP_DEVICE => {
            let ctx = match spec.device.as_str() {
                NOOP_DEVICE => noop_context()?,
                _ => GpuContext::new().context("no GPU adapter")?,
            };
            // The arena's peak of live tensor bytes (pool and driver
            // overhead not counted).
            let opts = spec.knobs.gpu_options(spec.transport()?).with_env()?;
            run_on(
                GpuExecutor::with_options(ctx, opts),
                spec,
                baseline_rss,
                |ex| Some(ex.memory().peak_bytes),
                |ex| Some(ex.transport_host_bytes()),
            )
        }
        d => anyhow::bail!("unknown --device {d} (cpu, gpu or {NOOP_DEVICE})"),
    }
}

pub(super) fn precision(spec: &Spec) -> anyhow::Result<Precision> {
    spec.precision
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--precision: {e}"))
}

/// The tier `spec` trains (`shard`: placed for a rank of a sharded
/// optimizer, as `megatrain train` places it, mapping `shared` transport
/// copies where the machine's ranks share them).
pub(super) fn tier_for(
    spec: &Spec,
    model: &ModelConfig,
    shard: Option<Shard>,
    shared: Option<SharedTransport>,
) -> anyhow::Result<HostTier> {
    let config = TierConfig {
        shard,
        transport: precision(spec)?.transport(),
        hold_grads: spec.grad_clip.is_some(),
        grads_on_device: megatrain::trainer::carried_layers(
            spec.carry_layers,
            spec.carry_order,
            model.num_layers,
        ),
        ram_budget_bytes: spec.host_budget,
        spill_dir: spec.host_budget.map(|_| {
            spec.spill_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("megatrain-bench-spill"))
        }),
        shared_transport: shared,
    };
    Ok(match &spec.model_dir {
        Some(dir) => load_tier(&HfCheckpoint::open(dir)?, config)?,
        None => init_tier(model, config, 1234)?,
    })
}

/// A deterministic token stream over the whole vocabulary.
fn batches(spec: &Spec, vocab: usize, n: usize) -> anyhow::Result<Vec<Batch>> {
    let len = (spec.batch * (spec.seq_len + 1)).max(4096);
    let data = TokenData {
        tokens: (0..len as u64)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % vocab as u64) as u32)
            .collect(),
        loss_mask: None,
        records: None,
    };
    (0..n as u64)
        .map(|i| {
            draw_batch(
                &data,
                Sampling::Random { seed: 5 },
                i,
                spec.batch,
                spec.seq_len,
                "synthetic".as_ref(),
            )
            .map_err(Into::into)
        })
        .collect()
}

/// `device_peak` reads the executor's peak bytes where the trait's
/// `memory_stats` does not report it; `transport_host` the host-visible
/// bytes of its transport buffers (a GPU's upload ring and readback pool).
fn run_on<E: Executor + OpProfiler + HostCounters>(
    mut ex: E,
    spec: &Spec,
    baseline_rss: u64,
    device_peak: impl Fn(&E) -> Option<u64>,
    transport_host: impl Fn(&E) -> Option<u64>,
) -> anyhow::Result<Record> {
    let p = precision(spec)?;
    ex.set_compute_precision(p.compute())
        .with_context(|| format!("--precision {p}"))?;
    let model = spec.model()?;
    // `--carry-layers all` is every layer of this model.
    let spec = &Spec {
        carry_layers: megatrain::run::check_carry_layers(spec.carry_layers, &model)?,
        ..spec.clone()
    };
    let device_name = ex.name();
    let tier = tier_for(spec, &model, None, None)?;
    let tier_report = tier.report();
    let tier_ram = tier_report.ram.total();
    let mut config = TrainerConfig {
        compact_embedding: megatrain::trainer::compact_embedding_from_env()?,
        checkpoint_every: spec.checkpoint_every,
        chunk_rows: megatrain_zoo::default_chunk_rows(model.vocab_size, ex.logits_chunk_bytes()),
        adamw: AdamWConfig::default(),
        transfer_chunk: transfer_chunk_for(model.param_count() as u64),
        ..TrainerConfig::default()
    };
    spec.apply_to_trainer(&mut config)?;
    let input = PlanInput {
        batch: spec.batch,
        seq_len: spec.seq_len,
        checkpoint_every: spec.checkpoint_every,
        keep_activations: 0,
        chunk_rows: config.chunk_rows,
        transport: p.transport(),
        hold_grads: spec.grad_clip.is_some(),
        carry_layers: spec.carry_layers,
        carry_order: spec.carry_order,
        optimizer_queue: config.optimizer_queue,
        embedding_rows: megatrain::trainer::RowsSetting::of(&config, &tier, false).applies(&model),
    };
    let room = Room::of(ex.tensor_memory(), 1, spec.host_budget.is_some());
    let kept = spec.keep_activations.resolve(&model, &input, &room)?;
    config.keep_activations = kept.blocks;
    if spec.keep_activations == KeepActivations::Auto {
        eprintln!(
            "  activations: the last {} of {} blocks kept ({})",
            kept.blocks, model.num_layers, kept.why
        );
    }
    // The record counts FLOPs by the blocks kept, not by how they were named.
    let spec = &Spec {
        keep_activations: KeepActivations::Blocks(kept.blocks),
        ..spec.clone()
    };
    let mut tr = Trainer::new(ex, model.clone(), tier, config)?;
    if let Some(w) = spec.spill_window {
        tr.set_spill_window(WindowConfig::from_bytes(w, 4));
    }
    if let Some(first) = tier_report.first_spilled {
        eprintln!(
            "  [{}] layers {first}..{} on disk ({:.2} GB of p, m, v), {:.2} GB in RAM; window {:.0} MiB",
            spec.label,
            tier_report.n_layers,
            tier_report.disk.total() as f64 / 1e9,
            tier_ram as f64 / 1e9,
            tr.spill_window().bytes() as f64 / (1u64 << 20) as f64
        );
    }
    if let Some(info) = tr.transport_info() {
        eprintln!(
            "  [{}] transport {} ({}): {:?} ms",
            spec.label, info.name, info.reason, info.measured_ms
        );
    }
    // The peak of each part of the run, where the kernel lets the peak be
    // reset: setup (tier, device, transport), the warm-up (the first step
    // compiles every pipeline: a driver's compiler is host memory), and the
    // timed steps.
    let mut phases = PeakPhases::start();
    phases.end(Phase::Setup);
    let all = batches(spec, model.vocab_size, spec.warmup + spec.steps)?;
    let mut steps: Vec<StepMetrics> = Vec::with_capacity(spec.steps);
    let mut counted_from = None;
    for (i, b) in all.iter().enumerate() {
        if i == spec.warmup {
            counted_from = tr.executor().host_counters();
            phases.end(Phase::Warmup);
        }
        let m = tr.step(std::slice::from_ref(b), spec.lr)?;
        // On the noop backend no kernel runs: the loss is whatever the
        // loss buffer held, and says nothing.
        anyhow::ensure!(
            m.loss.is_finite() || spec.device == NOOP_DEVICE,
            "step {i}: loss {}",
            m.loss
        );
        let spill = if m.spill_read_bytes > 0 {
            format!(
                "; spill {:.2} GB read + {:.2} GB written in {:.1} s of disk time ({:.2} GB/s), \
                 optimizer waited {:.1} s",
                m.spill_read_bytes as f64 / 1e9,
                m.spill_written_bytes as f64 / 1e9,
                m.spill_disk_ms / 1e3,
                m.spill_gb_s,
                m.spill_wait_ms / 1e3
            )
        } else {
            String::new()
        };
        eprintln!(
            "  [{}] step {i}{}: {:.1} ms, loss {:.4}{spill}",
            spec.label,
            if i < spec.warmup { " (warm-up)" } else { "" },
            m.step_ms,
            m.loss
        );
        if i >= spec.warmup {
            steps.push(m);
        }
    }
    let counters = counted_from
        .zip(tr.executor().host_counters())
        .map(|(a, b)| StepCounters::between(&a, &b, steps.len()));
    // Before the modes: they hold extra copies (resident weights).
    if spec.warmup >= all.len() {
        phases.end(Phase::Warmup);
    }
    phases.end(Phase::Steps);
    let peak_rss = phases
        .overall()
        .unwrap_or_else(|| rss::peak_rss_bytes().unwrap_or(0));
    let staging = tr.staging_bytes();
    let peak_device = device_peak(tr.executor());
    let host_peak = HostPeak::new(
        peak_rss,
        baseline_rss,
        &tier_report.ram,
        staging,
        transport_host(tr.executor()),
        // The CPU executor's tensors are host memory; a GPU's are not.
        (spec.device == "cpu")
            .then(|| tr.executor().memory_stats().map(|s| s.peak_bytes))
            .flatten(),
    );
    let profile = match spec.profile {
        true => profile_step(&mut tr, &all[0], spec)?,
        false => None,
    };
    // The timed steps are kept where the modes fail (out of device memory:
    // compute-only holds every layer's copy beside what the step keeps).
    let (modes, modes_error) = match spec.mode_reps {
        0 => (None, None),
        _ => match run_modes(&mut tr, &all[0], spec) {
            Ok(m) => (Some(m), None),
            Err(e) => {
                eprintln!("  [{}] isolated modes not measured: {e:#}", spec.label);
                (None, Some(format!("{e:#}")))
            }
        },
    };
    let mut record = Record::new(
        spec,
        &model,
        device_name,
        steps,
        modes,
        peak_rss,
        baseline_rss,
        tier_ram,
        staging,
        tr.transport_info(),
    );
    record.first_spilled = tier_report.first_spilled;
    record.modes_error = modes_error;
    record.profile = profile;
    record.counters = counters;
    record.host_peak = Some(HostPeak {
        phases: phases.recorded(),
        ..host_peak
    });
    record.spilled_params = tier_report.disk.params / 4;
    if record.device_peak_bytes.is_none() {
        record.device_peak_bytes = peak_device.filter(|&p| p > 0);
    }
    Ok(record)
}

/// One more step with per-op profiling on (None where the executor has no
/// profiler: the CPU's).
fn profile_step<E: Executor + OpProfiler>(
    tr: &mut Trainer<E>,
    batch: &Batch,
    spec: &Spec,
) -> anyhow::Result<Option<StepProfile>> {
    if !tr.executor().profile_start() {
        eprintln!(
            "  [{}] --profile: the {} executor has no per-op profile",
            spec.label, spec.device
        );
        return Ok(None);
    }
    let m = tr.step(std::slice::from_ref(batch), spec.lr);
    let rows = tr.executor().profile_stop();
    let m = m?;
    eprintln!(
        "  [{}] profiled step: {:.1} ms, loss {:.4}",
        spec.label, m.step_ms, m.loss
    );
    let profile = rows.map(|(timing, rows, kernels)| StepProfile::new(timing, rows, kernels, &m));
    // At once too, not only in the report at the end: a run stopped later
    // (a session's time cap, in the modes or the peers) still shows it.
    if let Some(p) = &profile {
        eprint!(
            "{}",
            p.table(&format!(
                "{} on {} ({}, B×T {}×{}; as it ran)",
                spec.label, spec.device, spec.precision, spec.batch, spec.seq_len
            ))
        );
    }
    Ok(profile)
}

fn run_modes<E: Executor>(tr: &mut Trainer<E>, batch: &Batch, spec: &Spec) -> anyhow::Result<Modes> {
    let reps = spec.mode_reps;
    let mut transfer = Vec::with_capacity(reps);
    let mut transfer_bytes = 0;
    for _ in 0..=reps {
        let t = tr.transfer_only(spec.batch * spec.seq_len)?;
        transfer_bytes = t.bytes_uploaded + t.bytes_downloaded;
        transfer.push(t.ms);
    }
    let mut optimizer = Vec::with_capacity(reps);
    for _ in 0..=reps {
        optimizer.push(tr.optimizer_only(spec.lr)?);
    }
    let w = tr.resident_weights()?;
    let mut compute = Vec::with_capacity(reps);
    for _ in 0..=reps {
        compute.push(tr.compute_only(&w, batch)?.ms);
    }
    // The first run of each is a warm-up.
    let tail = |v: Vec<f64>| median(&v[1..]);
    let transfer_ms = tail(transfer);
    Ok(Modes {
        compute_only_ms: tail(compute),
        transfer_only_ms: transfer_ms,
        transfer_only_gb_s: if transfer_ms > 0.0 {
            transfer_bytes as f64 / (transfer_ms / 1e3) / 1e9
        } else {
            0.0
        },
        optimizer_only_ms: tail(optimizer),
        reps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_throughput::report;
    use crate::bench_throughput::spec::test_spec;

    #[test]
    fn a_tiny_cpu_run_fills_every_field_and_round_trips() {
        let spec = Spec {
            label: "tiny".into(),
            layers: Some(2),
            hidden: None,
            seq_len: 8,
            batch: 2,
            steps: 2,
            precision: "bf16".into(),
            transport: "mapped".into(),
            mode_reps: 1,
            ..test_spec()
        };
        let r = run(&spec).unwrap();
        assert_eq!(r.steps.len(), 2);
        assert_eq!(r.tokens_per_step, 16);
        assert!(r.tokens_per_s > 0.0 && r.model_tflops > 0.0);
        assert!(r.hardware_tflops > r.model_tflops);
        assert!(r.forward_ms > 0.0 && r.backward_ms > 0.0 && r.loss_ms > 0.0);
        // bf16 transport: 2 bytes up per matrix element and crossing (4 per
        // vector element, held as f32), 4 down; of the embedding, a table
        // of as many rows as the step has tokens (16 of 256), unless
        // MEGATRAIN_EMBEDDING=whole.
        let m = spec.model().unwrap();
        let table = (m.vocab_size * m.hidden_size) as u64;
        let rows = match megatrain::trainer::compact_embedding_from_env().unwrap() {
            true => 16 * m.hidden_size as u64,
            false => table,
        };
        assert_eq!(r.bytes_downloaded_per_step, 4 * (r.n_params - table + rows));
        assert!(
            r.bus_crossings > 1.5 && r.bus_crossings < 2.3,
            "{}",
            r.bus_crossings
        );
        assert!(r.peak_rss_bytes > 0 && r.host_bytes_per_param > 14.0);
        // Linux lets the peak be reset: the phases are told apart, and the
        // run's peak is the largest of them.
        if cfg!(target_os = "linux") {
            let p = r.host_peak.as_ref().unwrap().phases.expect("phases on Linux");
            assert!(p.setup > 0 && p.warmup > 0 && p.steps > 0, "{p:?}");
            assert_eq!(r.peak_rss_bytes, p.setup.max(p.warmup).max(p.steps));
            let text = report::tables(std::slice::from_ref(&r), &[]);
            assert!(text.contains("host peak by phase tiny"), "{text}");
        }
        let m = r.modes.as_ref().unwrap();
        assert!(m.compute_only_ms > 0.0 && m.transfer_only_ms > 0.0 && m.optimizer_only_ms > 0.0);
        // The mode moves what the step moved.
        let moved = (r.bytes_uploaded_per_step + r.bytes_downloaded_per_step) as f64;
        let want = moved / (m.transfer_only_ms / 1e3) / 1e9;
        assert!(
            (m.transfer_only_gb_s - want).abs() <= 1e-9 * want,
            "{} vs {want}",
            m.transfer_only_gb_s
        );
        assert!(r.overlap_efficiency.unwrap() > 0.0);
        // The CPU executor has no transport to choose: the fields say so.
        let json: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(json["transport"], "default");
        assert_eq!(json["transport_measured_ms"], serde_json::json!([]));
        assert_eq!(json["spec"]["transport"], "mapped");
        let back: Record = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.n_params, r.n_params);
        let table = report::tables(&[back], &[]);
        assert!(table.contains("| tiny | cpu | bf16 |"), "{table}");
    }

    /// Carried updates: every timed step applies the step before's in its
    /// forward, and the modes after the steps run on settled parameters.
    #[test]
    fn a_run_that_carries_updates_reports_them_and_runs_its_modes() {
        let spec = Spec {
            label: "carried".into(),
            layers: Some(2),
            hidden: None,
            seq_len: 8,
            batch: 2,
            steps: 2,
            mode_reps: 1,
            profile: true,
            carry_layers: 3,
            ..test_spec()
        };
        let r = run(&spec).unwrap();
        assert!(
            r.carried_ms > 0.0 && r.carried_ms < r.forward_ms,
            "{} {}",
            r.carried_ms,
            r.forward_ms
        );
        assert!(r.modes.as_ref().unwrap().compute_only_ms > 0.0);
        let table = report::tables(std::slice::from_ref(&r), &[]);
        assert!(
            table.contains(&format!(
                "| carried | cpu | {:.1} ({:.1}) |",
                r.forward_ms, r.carried_ms
            )),
            "{table}"
        );
    }

    /// `--grad-clip`: the clipped updates run in the next step's forward
    /// (the step's tail is the norm alone), or after the backward with
    /// `--clip-after-backward`, to the same losses.
    #[test]
    fn clipping_runs_its_updates_in_the_next_forward() {
        let spec = Spec {
            label: "clipped".into(),
            layers: Some(2),
            hidden: None,
            seq_len: 8,
            batch: 2,
            steps: 3,
            // The modes after the steps settle what the last one left.
            mode_reps: 1,
            grad_clip: Some(0.05),
            ..test_spec()
        };
        let deferred = run(&spec).unwrap();
        let after = run(&Spec {
            clip_after_backward: true,
            ..spec.clone()
        })
        .unwrap();
        assert_eq!(deferred.loss_first, after.loss_first);
        assert_eq!(deferred.loss_last, after.loss_last);
        assert!(deferred.carried_ms > 0.0 && after.carried_ms == 0.0);
        assert!(after.optimizer_tail_ms > 0.0);
        let err = run(&Spec {
            grad_clip: Some(-1.0),
            ..spec
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("--grad-clip -1"), "{err:#}");
    }

    /// `--dropout` and `--attn-dropout` reach the trainer: the same run
    /// with them starts from another loss; out of range is refused.
    #[test]
    fn dropout_reaches_the_step() {
        let spec = Spec {
            label: "dropout".into(),
            layers: Some(2),
            hidden: None,
            seq_len: 8,
            batch: 2,
            steps: 1,
            ..test_spec()
        };
        let plain = run(&spec).unwrap();
        let dropped = run(&Spec {
            dropout: 0.2,
            attn_dropout: 0.1,
            ..spec.clone()
        })
        .unwrap();
        assert!(dropped.loss_first.is_finite() && dropped.loss_first != plain.loss_first);
        let err = run(&Spec { dropout: 1.0, ..spec }).unwrap_err();
        assert!(format!("{err:#}").contains("dropout"), "{err:#}");
    }

    #[test]
    fn f16_runs_on_the_cpu_and_an_unknown_precision_is_named() {
        let spec = Spec {
            label: "tiny-f16".into(),
            layers: Some(1),
            hidden: None,
            seq_len: 8,
            batch: 2,
            steps: 1,
            precision: "f16".into(),
            ..test_spec()
        };
        let r = run(&spec).unwrap();
        assert!(r.device_name.contains("f16"), "{}", r.device_name);
        // f16 transport moves the bytes bf16 does: 2 per matrix element.
        let bf16 = run(&Spec {
            precision: "bf16".into(),
            ..spec.clone()
        })
        .unwrap();
        assert_eq!(r.bytes_uploaded_per_step, bf16.bytes_uploaded_per_step);
        let bad = Spec {
            precision: "fp8".into(),
            ..spec
        };
        let err = run(&bad).unwrap_err().to_string();
        assert!(err.contains("fp8") && err.contains("f16"), "{err}");
    }

    #[test]
    fn a_hugging_face_directory_trains_with_its_weights() {
        let model = megatrain_zoo::preset("llama-tiny", None).unwrap();
        let tables = model.layer_tables();
        let slabs: Vec<Vec<f32>> = (0..tables.len())
            .map(|l| megatrain_zoo::init_layer(&model, l, 3).unwrap())
            .collect();
        let refs: Vec<&[f32]> = slabs.iter().map(Vec::as_slice).collect();
        let dir = std::env::temp_dir().join(format!("bench-throughput-hf-{}", std::process::id()));
        megatrain_zoo::export_hf_dir(&dir, &model, &tables, &refs, Default::default()).unwrap();
        let spec = Spec {
            label: "hf".into(),
            preset: None,
            model_dir: Some(dir.clone()),
            layers: None,
            hidden: None,
            seq_len: 8,
            batch: 1,
            steps: 1,
            warmup: 0,
            ..test_spec()
        };
        let r = run(&spec);
        let _ = std::fs::remove_dir_all(&dir);
        let r = r.unwrap();
        assert_eq!(r.n_params as usize, model.param_count());
        assert!(r.modes.is_none() && r.overlap_efficiency.is_none());
        // Overrides do not apply to a checkpoint.
        let bad = Spec {
            layers: Some(3),
            model_dir: Some("/nonexistent".into()),
            ..spec
        };
        assert!(bad.model().unwrap_err().to_string().contains("--layers"));
    }
}
