//! `megatrain plan`.

use std::path::PathBuf;

use clap::Args;
use megatrain::run::{
    BusCover, CLIP_NORM_SHARE, KeepActivations, Machine, PlanInput, Precision, Room, RunError,
    ShareTransport, bus_cover_keeping, disk_estimate, mem_available, most_kept, per_rank, plan,
};
use megatrain::trainer::{CarryOrder, RowsSetting, carried_layers};
use megatrain_tier::{TierConfig, TierError};
use megatrain_zoo::{ModelConfig, preset};

use super::gib;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Hugging Face model directory (only config.json is read).
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    #[arg(long)]
    preset: Option<String>,
    /// Vocabulary of a preset (gpt2-nano needs it; default 65, tinyshakespeare's characters).
    #[arg(long)]
    vocab_size: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// f32 | bf16 | f16 (the transport copy: 4, 2 or 2 bytes a parameter).
    #[arg(long, default_value = "f32")]
    precision: Precision,
    #[arg(long, default_value_t = 1)]
    checkpoint_every: usize,
    /// The last N blocks (or `all`) keep their weights and activations from
    /// forward to backward, as `train --keep-activations`; `auto` (the
    /// default, as `train`'s) decides as a run on a GPU of --device-mem
    /// does, and keeps none without it. With --device-mem the plan also prints the most
    /// that fit in all of it.
    #[arg(long, default_value = "auto")]
    keep_activations: KeepActivations,
    /// The first N layers (or `all`) keep their gradients on the device
    /// into the next step's forward, as `train --carry-layers` (counted
    /// in the device's bytes, and, where gradients are held, not in the
    /// host's; default 0).
    #[arg(long, default_value = "0", value_parser = megatrain::run::parse_carry_layers)]
    carry_layers: usize,
    /// Which layers --carry-layers are, as `train --carry-order`: `first`
    /// (the embedding, then blocks) or `spread` (blocks evenly spaced).
    #[arg(long, default_value = "first")]
    carry_order: CarryOrder,
    /// The first N layers not trained, as `train --freeze-layers`: their
    /// moments (and held gradients) are reserved but never touched, so
    /// not counted as resident. The time estimates count them once over
    /// the bus, forward only and without AdamW.
    #[arg(long, default_value_t = 0)]
    freeze_layers: usize,
    /// Gradient chunks that may wait for the CPU AdamW, as `train
    /// --optimizer-queue` (1-4096): each one chunk of host staging.
    #[arg(long, default_value_t = megatrain::trainer::DEFAULT_OPTIMIZER_QUEUE)]
    optimizer_queue: usize,
    /// Rows of the LM head at once (default: as `train` on a GPU, from the vocabulary).
    #[arg(long)]
    chunk_rows: Option<usize>,
    /// Gradients are held in host memory (with --grad-accum > 1 or --grad-clip > 0).
    #[arg(long)]
    hold_grads: bool,
    /// Host memory to compare with (default: MemAvailable of this machine), e.g. 24G.
    #[arg(long, value_parser = super::parse_bytes)]
    host_mem: Option<u64>,
    /// Data parallel ranks (mpirun -np N) with the optimizer sharded: also
    /// print the host bytes of each rank.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --ranks: the ranks of a machine map one transport copy, as
    /// `train --share-transport` does (auto and true: they do; false).
    #[arg(long, default_value = "auto")]
    share_transport: ShareTransport,
    /// With --ranks: ranks on each machine (default: all on one). Machines
    /// with unequal numbers of ranks hold a copy per rank.
    #[arg(long)]
    ranks_per_machine: Option<usize>,
    /// Device memory to compare with, e.g. 24G (wgpu does not report it).
    #[arg(long, value_parser = super::parse_bytes)]
    device_mem: Option<u64>,
    /// Host RAM for the tier, as in `train` (e.g. 14G): layers past it spill to disk.
    #[arg(long, value_parser = super::parse_bytes)]
    host_budget: Option<u64>,
    /// Disk bandwidth (GB/s, each way) for the spill-time estimate; without it a
    /// 256 MiB scratch file in --spill-dir is written and read to measure it.
    #[arg(long)]
    disk_gbps: Option<f64>,
    /// Where the spill would go, for the measurement (a run puts it in <out>/spill).
    #[arg(long, default_value = ".")]
    spill_dir: PathBuf,
    /// Sustained model TFLOP/s of the GPU, for the batch at which compute
    /// covers the bus (default: the H100 f16 target of the open issues; an
    /// H200 sustained 127 on Qwen2.5-7B's whole step (BENCHMARKS.md, session 47), at
    /// which carrying updates into the forward no longer pays).
    #[arg(long, default_value_t = Machine::H100.gpu_tflops)]
    gpu_tflops: f64,
    /// Host↔device bandwidth each way in GB/s, for the same suggestion
    /// (default: H100 PCIe Gen5 pinned copies).
    #[arg(long, default_value_t = Machine::H100.bus_gbps)]
    bus_gbps: f64,
    /// Parameters the host's AdamW updates per second, in G, for the same
    /// suggestion (default: measured on an H200 machine's 16 cores; the
    /// update is bound by host memory bandwidth, ~30 bytes a parameter).
    #[arg(long, default_value_t = Machine::H100.adamw_gparams)]
    adamw_gparams: f64,
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let model = match (&a.model, &a.preset) {
        (Some(dir), _) => ModelConfig::from_dir(dir)?,
        (None, Some(p)) => {
            let vocab = a.vocab_size.or((p == "gpt2-nano").then_some(65));
            preset(p, vocab)?
        }
        (None, None) => anyhow::bail!("give --model <HF dir> or --preset <name>"),
    };
    let chunk_rows = a.chunk_rows.unwrap_or_else(|| {
        megatrain_zoo::default_chunk_rows(model.vocab_size, megatrain_tensor::DEVICE_LOGITS_CHUNK_BYTES)
    });
    if a.batch == 0 || a.seq_len == 0 || a.checkpoint_every == 0 || chunk_rows == 0 || a.ranks == 0 {
        anyhow::bail!("--batch, --seq-len, --checkpoint-every, --chunk-rows and --ranks must be ≥ 1");
    }
    let carry_layers = megatrain::run::check_carry_layers(a.carry_layers, &model)?;
    megatrain::run::check_freeze_layers(a.freeze_layers, &model)?;
    if a.freeze_layers > 0 && carry_layers > 0 {
        anyhow::bail!(
            "--freeze-layers cannot be used with --carry-layers, which counts from the first layer"
        );
    }
    megatrain::run::check_optimizer_queue(a.optimizer_queue)?;
    if a.carry_order == CarryOrder::Spread && carry_layers > 0 && a.hold_grads {
        anyhow::bail!(
            "--carry-order spread cannot be used with --hold-grads as clipping holds them: every clipped \
             update goes into the next forward anyway (carry the first layers instead)"
        );
    }
    let carried = megatrain::trainer::carried_layers(carry_layers, a.carry_order, model.num_layers);
    let transport = a.precision.transport();
    let mut input = PlanInput {
        batch: a.batch,
        seq_len: a.seq_len,
        checkpoint_every: a.checkpoint_every,
        keep_activations: 0,
        chunk_rows,
        transport,
        hold_grads: a.hold_grads,
        carry_layers,
        carry_order: a.carry_order,
        optimizer_queue: a.optimizer_queue,
        // A spilled embedding takes the whole table: `plan` sees the spill.
        embedding_rows: RowsSetting {
            compact: megatrain::trainer::compact_embedding_from_env()?,
            whole_gradient: a.hold_grads || a.ranks > 1,
            frozen: a.freeze_layers > 0,
            carried: carried.first() == Some(&0),
            spilled: false,
        }
        .applies(&model),
    };
    let room = match a.device_mem {
        Some(m) => Room::Device(m),
        None => Room::Unknown(
            "no --device-mem to size it by; a run sizes it by the GPU's memory, or on the CPU by the host's"
                .into(),
        ),
    };
    let kept = a.keep_activations.resolve(&model, &input, &room)?;
    input.keep_activations = kept.blocks;
    if let Some(g) = a.disk_gbps
        && !(g.is_finite() && g > 0.0)
    {
        anyhow::bail!("--disk-gbps {g}: must be positive");
    }
    for (flag, v) in [
        ("--gpu-tflops", a.gpu_tflops),
        ("--bus-gbps", a.bus_gbps),
        ("--adamw-gparams", a.adamw_gparams),
    ] {
        if !(v.is_finite() && v > 0.0) {
            anyhow::bail!("{flag} {v}: must be positive");
        }
    }
    let machine = Machine {
        gpu_tflops: a.gpu_tflops,
        bus_gbps: a.bus_gbps,
        adamw_gparams: a.adamw_gparams,
    };
    let tier = TierConfig {
        shard: None,
        transport,
        hold_grads: a.hold_grads,
        grads_on_device: carried.clone(),
        ram_budget_bytes: a.host_budget,
        spill_dir: a.host_budget.map(|_| a.spill_dir.clone()),
        shared_transport: None,
    };
    // With ranks, a budget may hold each rank's share but not one
    // process's whole tier: that process is then only noted.
    let one = match plan(&model, &input, &tier) {
        Ok(p) => Some(p),
        Err(RunError::Tier(
            e @ (TierError::TransportOverBudget { .. } | TierError::BudgetExceeded { .. }),
        )) if a.ranks > 1 => {
            println!("one process: {e}");
            None
        }
        Err(e) => return Err(e.into()),
    };
    let one_fits = one.is_some();
    // The device side does not depend on the budget.
    let whole = TierConfig {
        ram_budget_bytes: None,
        spill_dir: None,
        ..tier.clone()
    };
    let p = match one {
        Some(p) => p,
        None => plan(&model, &input, &whole)?,
    };
    // Frozen layers' moments (and held gradients) in RAM: reserved, never
    // touched, so never resident.
    let in_ram = p.host.first_spilled.unwrap_or(usize::MAX).min(a.freeze_layers);
    let frozen = megatrain_tier::plan(&model.layer_tables()[..in_ram], &whole)?;
    let untouched = frozen.ram.moments + frozen.ram.gradients;
    if one_fits {
        println!("host (fp32 weights and AdamW moments, {} transport):", transport);
        println!("{}", p.host);
        if let Some(m) = &model.moe {
            // Every expert is held, moved and updated; a token reads k.
            println!(
                "  {} of the parameters read per token ({} experts, {} a token)",
                model.active_param_count(),
                m.num_experts,
                m.top_k
            );
        }
        println!("  staging    {:>14} (gradients in flight)", gib(p.host_staging));
        println!("  needed     {:>14}", gib(p.host_total()));
        if a.freeze_layers > 0 {
            println!(
                "  frozen     {:>14} of it never touched (--freeze-layers {}: the moments{} of those layers in RAM): {} resident",
                gib(untouched),
                a.freeze_layers,
                if a.hold_grads { " and held gradients" } else { "" },
                gib(p.host_total() - untouched)
            );
        }
        if let Some(first) = p.host.first_spilled {
            let (read, write, how) = match a.disk_gbps {
                Some(g) => (g, g, "given".to_string()),
                None => {
                    let bw = megatrain_tier::measure_disk_bandwidth(&a.spill_dir, 256 << 20)?;
                    (
                        bw.read_gb_s,
                        bw.write_gb_s,
                        format!(
                            "measured on {} with a 256 MiB scratch file{}",
                            a.spill_dir.display(),
                            if bw.direct { ", O_DIRECT" } else { "" }
                        ),
                    )
                }
            };
            let e = disk_estimate(&p.host, read, write);
            println!(
                "disk: layers {first}..{} past --host-budget {}: per step {} read and {} written \
                 (p, m, v{} of every spilled layer)",
                p.host.n_layers,
                gib(a.host_budget.unwrap_or(0)),
                gib(e.read_bytes),
                gib(e.written_bytes),
                if a.hold_grads { ", gradients" } else { "" }
            );
            println!(
                "  at {read:.2} GB/s read, {write:.2} GB/s write ({how}): {:.1} s of disk time per step, \
                 hidden only where the forward and backward take at least as long",
                e.seconds
            );
        }
    }
    if a.ranks > 1 {
        let k = a.ranks_per_machine.unwrap_or(a.ranks);
        if k == 0 || k > a.ranks {
            anyhow::bail!("--ranks-per-machine {k}: must be 1 to --ranks {}", a.ranks);
        }
        let share = a.share_transport != ShareTransport::False;
        let shared = (share && a.ranks.is_multiple_of(k)).then_some(k);
        let r = per_rank(&model, &tier, a.ranks, shared, a.optimizer_queue)?;
        let per = |b: u64| b as f64 / p.host.n_params.max(1) as f64;
        println!(
            "per rank of {} with the optimizer sharded (--shard-optimizer true; the busiest rank):",
            a.ranks
        );
        for (k, v, d) in [
            ("params", r.host.ram.params, r.host.disk.params),
            ("moments", r.host.ram.moments, r.host.disk.moments),
            ("transport", r.host.ram.transport, 0),
            ("gradients", r.host.ram.gradients, r.host.disk.gradients),
            ("staging", r.staging, 0),
            ("total", r.total(), r.host.disk.total()),
        ] {
            println!(
                "  {k:<11}{:>14} {:>7.2} B/param  {:>14} disk",
                gib(v),
                per(v),
                gib(d)
            );
        }
        if let Some(first) = r.host.first_spilled {
            println!(
                "  layers {first}..{} spilled; each rank's spill files hold {}, which it reads and writes \
                 every step (its 1/{} of p, m, v{})",
                r.host.n_layers,
                gib(r.disk_per_step),
                a.ranks,
                if a.hold_grads { ", its gradients whole" } else { "" }
            );
        }
        let machine = match k == a.ranks {
            true => format!("all {k} ranks on one machine"),
            false if k == 1 => "each machine of 1 rank".to_string(),
            false => format!("each machine of {k} ranks"),
        };
        println!(
            "  {machine}: at most {} ({})",
            gib(k as u64 * r.total()),
            match shared {
                Some(k) if k > 1 => {
                    "they map one transport copy, each counting its share; --share-transport false: a copy each"
                }
                _ if share && k > 1 => "machines of unequal ranks: each rank holds a transport copy",
                _ => "each rank holds a whole transport copy",
            }
        );
        println!(
            "  rank 0 while saving a checkpoint: {} more (it gathers one layer's p, m, v whole at a time)",
            gib(r.save_gather)
        );
    }
    let d = &p.device;
    println!(
        "device (batch {} × seq {}, checkpoint every {} blocks, the last {} of {} keeping their weights and activations: {}), \
         estimated:",
        a.batch, a.seq_len, a.checkpoint_every, input.keep_activations, model.num_layers, kept.why
    );
    for (k, v) in [
        ("weights", d.weights),
        ("gradients", d.gradients),
        ("checkpoints", d.checkpoints),
        ("hidden", d.hidden),
        ("recompute", d.recompute),
        ("kept", d.kept),
        ("head", d.head),
        ("f16 copies", d.f16_copies),
        ("downloads", d.download_staging),
        ("carried", d.carried),
        ("total", d.total()),
    ] {
        println!("  {k:<11}{:>14}", gib(v));
    }
    if let Some(r) = p.embedding_rows {
        println!(
            "  (the embedding as the step's looked-up rows alone: a table of {r} of its {} rows; \
             MEGATRAIN_EMBEDDING=whole takes them all)",
            model.vocab_size
        );
    }
    if let Some(c) = bus_cover_keeping(
        &model,
        a.seq_len,
        transport,
        (input.keep_activations, a.freeze_layers),
        machine,
    ) {
        // The embedding's looked-up rows alone, where `train` takes them.
        let c = match p.embedding_rows {
            Some(_) => c.looking_up((a.batch * a.seq_len) as u64),
            None => c,
        };
        let ups = if input.keep_activations == model.num_layers {
            "once"
        } else {
            "twice"
        };
        print_cover(
            &c,
            machine,
            (a.batch, a.seq_len),
            ups,
            (&carried, a.carry_order, a.hold_grads),
            p.host.first_spilled,
        );
    }
    // Held gradients the device could keep instead (`--carry-layers all`).
    let held = p.host.ram.gradients + p.host.disk.gradients;
    let needed = p.host_total() - untouched;
    match a.host_mem.or_else(mem_available) {
        _ if !one_fits => {}
        Some(m) if needed <= m => println!("host: {} needed, {} available: fits", gib(needed), gib(m)),
        Some(m) => println!(
            "host: {} needed, {} available: does NOT fit (use --host-budget to spill to disk{})",
            gib(needed),
            gib(m),
            match held {
                0 => String::new(),
                g => format!(
                    ", or --carry-layers all to keep the {} of held gradients on the device",
                    gib(g)
                ),
            }
        ),
        None => println!("host: available memory unknown (pass --host-mem)"),
    }
    match a.device_mem {
        Some(m) => {
            println!(
                "device: {} needed, {} given: {}",
                gib(d.total()),
                gib(m),
                if d.total() <= m {
                    "fits"
                } else {
                    "does NOT fit (lower --batch or --seq-len)"
                }
            );
            if let Some(n) = most_kept(&model, &input, &whole, m)? {
                println!(
                    "  the last {n} of {} blocks can keep their weights and activations in it (--keep-activations {}): \
                     the backward recomputes {} blocks",
                    model.num_layers,
                    if n == model.num_layers {
                        "all".to_string()
                    } else {
                        n.to_string()
                    },
                    model.num_layers - n
                );
            }
        }
        None => println!("device: compare the total with your GPU's memory (or pass --device-mem)"),
    }
    Ok(())
}

/// `ups`: how often a block's transport copy goes up ("once" where every
/// block is kept from forward to backward); `hold`: gradients are held
/// (the step as clipping runs it is printed too); `first_spilled`: the
/// first layer a `--host-budget` spills, past which nothing is carried.
fn print_cover(
    c: &BusCover,
    m: Machine,
    (batch, seq_len): (usize, usize),
    ups: &str,
    (carried_set, order, hold): (&[usize], CarryOrder, bool),
    first_spilled: Option<usize>,
) {
    let carry = carried_set.len();
    let ms = |s: f64| s * 1e3;
    println!(
        "compute vs bus and the host's AdamW, assuming {} TFLOP/s sustained, {} GB/s each way and \
         {} G parameters/s of AdamW (--gpu-tflops, --bus-gbps, --adamw-gparams):",
        m.gpu_tflops, m.bus_gbps, m.adamw_gparams
    );
    println!(
        "  per block and step: {} over the bus ({:.2} ms: transport copy up {ups}, f32 gradients down); \
         {:.3} GFLOP per token ({:.3} µs)",
        gib(c.block_bus_bytes),
        ms(c.block_bus_s(m)),
        c.block_flops_per_token / 1e9,
        c.block_compute_s(m, 1) * 1e6
    );
    println!(
        "  compute covers the bus from {} tokens per step, and a block's backward its AdamW ({:.2} ms) \
         from {}: --batch {} at --seq-len {seq_len}",
        c.tokens_to_cover,
        ms(c.block_adamw_s(m)),
        c.tokens_to_cover_adamw,
        c.batch_to_cover
    );
    let tokens = (batch * seq_len) as u64;
    let (compute, bus) = (c.block_compute_s(m, tokens), c.block_bus_s(m));
    let (backward, adamw) = (c.block_backward_s(m, tokens), c.block_adamw_s(m));
    println!(
        "  at --batch {batch} ({tokens} tokens): per block {:.2} ms of compute vs {:.2} ms of bus: {}",
        ms(compute),
        ms(bus),
        if compute >= bus {
            "compute-bound".to_string()
        } else {
            format!("bus-bound (compute covers {:.0}% of it)", 100.0 * compute / bus)
        }
    );
    println!(
        "  and {:.2} ms of backward vs {:.2} ms of AdamW: {}",
        ms(backward),
        ms(adamw),
        if backward >= adamw {
            "the backward covers it".to_string()
        } else {
            format!(
                "AdamW-bound (the backward covers {:.0}% of it)",
                100.0 * backward / adamw
            )
        }
    );
    let step = c
        .step_compute_s(m, tokens)
        .max(c.step_bus_s(m))
        .max(c.step_adamw_s(m));
    let frozen = match c.frozen {
        0 => String::new(),
        n => format!("; the {n} frozen layers' forward alone, once over the bus and no AdamW"),
    };
    println!(
        "  whole step: {:.1} ms of compute (model FLOPs, 6 per parameter + causal attention or the Gated DeltaNet{frozen}), \
         {:.1} ms of bus, {:.1} ms of AdamW, {:.0} tokens/s if the largest is all it takes",
        ms(c.step_compute_s(m, tokens)),
        ms(c.step_bus_s(m)),
        ms(c.step_adamw_s(m)),
        tokens as f64 / step
    );
    let recomputed = if c.step_recompute_flops_per_token > 0.0 {
        " with its recompute"
    } else {
        ""
    };
    let embedding = match c.embedding_rows {
        Some(rows) => format!(
            "the embedding's {rows} rows a step looks up after the whole backward, its others' beside the forward"
        ),
        None => "the embedding's after the whole backward".to_string(),
    };
    println!(
        "  in order (a layer's AdamW needs its gradients, and every update ends before the next step's \
         forward, so AdamW overlaps only the backward: the head's after its backward, {embedding}): \
         forward {:.1} ms + (backward {:.1} ms{recomputed}, and AdamW {:.1} ms beside it: \
         {:.1} ms) = {:.1} ms, {:.0} tokens/s at best",
        ms(c.step_forward_s(m, tokens)),
        ms(c.step_backward_s(m, tokens)),
        ms(c.step_adamw_s(m)),
        ms(c.backward_updating(m, tokens, &[])),
        ms(c.step_ordered_s(m, tokens)),
        tokens as f64 / c.step_ordered_s(m, tokens)
    );
    let flag = |n: usize, o: CarryOrder| match o {
        CarryOrder::First => format!("--carry-layers {n}"),
        o => format!("--carry-layers {n} --carry-order {o}"),
    };
    let carried = |set: &[usize]| {
        let (step, forward) = c.step_carrying_s(m, tokens, set);
        format!(
            "forward {:.1} ms + the backward with the other layers' AdamW {:.1} ms = {:.1} ms, {:.0} tokens/s at best",
            ms(forward),
            ms(c.backward_updating(m, tokens, set)),
            ms(step),
            tokens as f64 / step
        )
    };
    let limit = first_spilled.unwrap_or(usize::MAX);
    if carried_set.last().is_some_and(|&l| l >= limit) {
        println!(
            "  {} reaches layer {limit}, which --host-budget spills: train refuses it \
             (at most {limit} of the first layers, those before the first spilled one)",
            flag(carry, order)
        );
    } else if carry > 0 {
        println!("  with {}: {}", flag(carry, order), carried(carried_set));
    }
    if hold {
        let (step, forward) = c.step_clipping_s(m, tokens, true, carry);
        let held = c.step_params - c.carried_params(carried_set);
        let (which, device) = match carry {
            0 => ("every gradient".to_string(), String::new()),
            _ => (
                "the gradients of the layers not carried".to_string(),
                format!(", the {carry} carried layers' on the device"),
            ),
        };
        println!(
            "  with --grad-clip ({which} held to the backward's end, their norm, {:.1} ms, summed beside it{device}): \
             each layer's AdamW in the next step's forward, forward {:.1} ms + max(backward {:.1} ms, norm) \
             = {:.1} ms, {:.0} tokens/s at best (every AdamW after the backward instead: {:.1} ms)",
            ms(CLIP_NORM_SHARE * held as f64 / (m.adamw_gparams * 1e9)),
            ms(forward),
            ms(c.step_backward_s(m, tokens)),
            ms(step),
            tokens as f64 / step,
            ms(c.step_clipping_s(m, tokens, false, carry).0)
        );
    }
    // Clipping carries only the first layers (the trainer refuses others).
    match c.best_carry(m, tokens, limit, !hold) {
        // Not beside frozen layers (the trainer refuses it).
        _ if c.frozen > 0 => {}
        (0, ..) if limit == 0 => {
            println!(
                "  nothing can be carried into the next step's forward: --host-budget spills the first layer"
            )
        }
        (0, ..) => println!(
            "  carrying layers' AdamW into the next step's forward (--carry-layers) would not shorten it"
        ),
        (best, o, _) => {
            let which = match o {
                CarryOrder::First => format!("the first {best} layers"),
                _ => format!("{best} blocks spread over the model"),
            };
            println!(
                "  carrying the AdamW of {which} into the next step's forward ({}; each carried block's forward \
                 waits for its update): {}",
                flag(best, o),
                carried(&carried_layers(best, o, c.blocks))
            )
        }
    }
}
