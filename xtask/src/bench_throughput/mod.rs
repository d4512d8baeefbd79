//! `cargo xtask bench-throughput`: real training steps of the streamed
//! trainer, per configuration, with the step split, bus bytes, memory, the
//! isolated modes behind the overlap efficiency, and a PyTorch peer where
//! `torch` imports.
//!
//! Each configuration runs in a fresh child process (this binary re-executed
//! with `--child`), so its peak RSS is its own: host bytes per parameter is
//! peak RSS ÷ N.

mod anchor;
mod child;
mod floor;
mod peer;
mod profile;
mod ranks;
mod record;
mod report;
mod spec;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context;
use megatrain::run::{KeepActivations, TransportKnobs};
use megatrain::trainer::CarryOrder;
use megatrain_gpu::TransportChoice;
use record::Record;
use spec::Spec;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Preset(s) to train (repeatable). Default llama-tiny.
    #[arg(long)]
    preset: Vec<String>,
    /// A Hugging Face model directory (config.json + safetensors) instead.
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// Vocabulary size (gpt2-nano needs one; overrides other presets').
    #[arg(long)]
    vocab: Option<usize>,
    /// Override the preset's number of blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the preset's width (heads kept, MLP ratio kept).
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Timed steps (after the warm-up).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Precision(s): f32, bf16, f16 (repeatable; as `megatrain train
    /// --precision`: f16 also computes matmuls on f16 operands). Default f32.
    #[arg(long)]
    precision: Vec<String>,
    /// Device(s): cpu (the CPU executor), gpu (wgpu; lavapipe without a
    /// GPU), gpu-noop (the GPU executor on wgpu's noop backend: no kernel
    /// runs, the step is the host's floor; xtask's default feature
    /// `host-floor`) (repeatable). Default cpu; --quick runs cpu and gpu.
    #[arg(long)]
    device: Vec<String>,
    /// How the GPU moves layers: auto (measured at start), staging or mapped.
    #[arg(long, default_value_t = TransportChoice::Auto)]
    transport: TransportChoice,
    /// K: checkpoint every K blocks.
    #[arg(long, default_value_t = 1)]
    checkpoint_every: usize,
    /// Timed repetitions of each isolated mode (compute-, transfer-,
    /// optimizer-only); 0 skips them.
    #[arg(long, default_value_t = 3)]
    mode_reps: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// The small standard set: llama-tiny and gpt2-nano on cpu and gpu,
    /// plus a 12.6M-parameter deep-narrow streamed run on cpu for host
    /// bytes per parameter.
    #[arg(long)]
    quick: bool,
    /// Vary depth (--sweep-layers) and batch (--sweep-batch) of the first
    /// preset.
    #[arg(long)]
    sweep: bool,
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    sweep_layers: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    sweep_batch: Vec<usize>,
    /// Sweep plot (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write every record as JSON (the sweep defaults to
    /// target/bench-throughput-sweep.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the PyTorch peer.
    #[arg(long)]
    no_peer: bool,
    /// An anchor run of issue 17 (repeatable): tinyllama-8x1024,
    /// tinyllama-16x2048, qwen2.5-7b-8x1024, qwen2.5-7b-16x2048, or all.
    /// Sets the preset, batch and sequence length; device gpu and
    /// precision f16 unless given. On a GPU with bf16/f16 precision the
    /// peer runs in bf16 autocast (in memory where it fits, and streamed).
    #[arg(long, value_parser = parse_anchor, conflicts_with_all = ["quick", "sweep", "model", "preset"])]
    anchor: Vec<String>,
    /// Also run every configuration with this host-tier budget (e.g. 14G):
    /// layers past it spill to --spill-dir. Prints the step-time ratio to
    /// the all-RAM run (skipped where it would not fit in RAM) beside the
    /// disk's sequential bandwidth, measured in the same invocation.
    #[arg(long, value_parser = parse_bytes)]
    host_budget: Option<u64>,
    /// Directory for spill files and the disk probe (default target/bench-spill).
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// RAM for the spill read-ahead / write-behind window (default the trainer's, 384M).
    #[arg(long, value_parser = parse_bytes)]
    spill_window: Option<u64>,
    /// Most gradient bytes (f32) the trainer moves and stages at once
    /// (default the CLI's: 4 bytes per 512 parameters, between 4M and
    /// 32M): larger layers come down in chunks.
    #[arg(long, value_parser = parse_bytes)]
    transfer_chunk: Option<u64>,
    /// Chunks of one layer's gradients whose downloads are in flight at
    /// once (default the trainer's, 0: all of a block's, begun as its
    /// gradients exist); fewer: the host holds less, the device waits more.
    #[arg(long)]
    chunks_in_flight: Option<usize>,
    /// Gradient chunks that may wait for the CPU AdamW before the device
    /// side blocks (default the trainer's, 2): more let the optimizer fall
    /// further behind a layer's backward, each a chunk of host memory (at
    /// least 1).
    #[arg(long)]
    optimizer_queue: Option<usize>,
    /// The first N layers (embedding, then blocks; `all`: every one) leave
    /// their gradients on the device at a step's end, and the next step's
    /// forward runs their AdamW just before loading each (default 0: off);
    /// with --grad-clip the host holds none of theirs.
    #[arg(long, default_value = "0", value_parser = megatrain::run::parse_carry_layers)]
    carry_layers: usize,
    /// Which layers --carry-layers are: `first` (default) or `spread`
    /// (blocks evenly spaced; `megatrain train --carry-order`).
    #[arg(long, default_value = "first")]
    carry_order: CarryOrder,
    /// Train all but the first N layers (embedding, then blocks): the
    /// backward ends at the first trained one (default 0). The modes
    /// (--mode-reps) time the whole model whatever it is.
    #[arg(long, default_value_t = 0)]
    freeze_layers: usize,
    /// Exact global-norm clipping at this threshold (default off): every
    /// gradient held on the host (but --carry-layers'), the step ending
    /// with their norm, and each layer's AdamW in the next step's forward.
    #[arg(long)]
    grad_clip: Option<f64>,
    /// With --grad-clip: every layer's AdamW after the backward instead,
    /// with the device idle (the same results; for comparison).
    #[arg(long, requires = "grad_clip")]
    clip_after_backward: bool,
    /// Dropout on the embedding's and residual branches' outputs (default
    /// 0: off; the step then runs a dropout kernel a branch).
    #[arg(long, default_value = "0")]
    dropout: f64,
    /// Dropout on the attention's probabilities (default 0: off).
    #[arg(long, default_value = "0")]
    attn_dropout: f64,
    /// The last N blocks (`all`, or `auto` as `megatrain train` decides)
    /// keep their weights and activations from forward to backward, which
    /// then uploads and recomputes only the others (default 0: the
    /// streamed step as designed, comparable with earlier rows).
    #[arg(long, default_value = "0")]
    keep_activations: KeepActivations,
    /// The GPU transport knobs, as `megatrain train` takes them.
    #[command(flatten)]
    knobs: TransportKnobs,
    /// After the timed steps, one more with the GPU's per-op profiling on
    /// (timestamp queries): a table of op, calls, time and share beside
    /// the step's wall time, also in --json.
    #[arg(long)]
    profile: bool,
    /// Size of the scratch file that measures the disk's sequential bandwidth.
    #[arg(long, value_parser = parse_bytes, default_value = "2G")]
    disk_probe: u64,
    /// Data parallel scaling: run each configuration alone and as N ranks
    /// under mpirun (CPU executor; needs xtask built with `--features mpi`)
    /// and report the scaling efficiency.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --ranks: shard the optimizer across ranks (ZeRO-1/2).
    #[arg(long)]
    shard_optimizer: bool,
    /// With --ranks: the ranks map one transport copy in /dev/shm, as
    /// `megatrain train` does by default (true | false).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    share_transport: bool,
    /// With --ranks: compute threads of every process (the baseline's too).
    #[arg(long, default_value_t = 1)]
    threads_per_rank: usize,
    /// With --ranks: rounds of (baseline, N ranks), median reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Internal: one process of a --ranks run (JSON).
    #[arg(long, hide = true)]
    rank_child: Option<String>,
    /// Internal: run one configuration (JSON) and print its record.
    #[arg(long, hide = true)]
    child: Option<String>,
}

const RECORD_PREFIX: &str = "RECORD ";

/// `14G`, `512M`, `1024` (bytes; K/M/G/T are powers of 1024).
/// A size as `megatrain`'s flags read it ([`megatrain::run::parse_bytes`]),
/// more than nothing.
fn parse_bytes(s: &str) -> Result<u64, String> {
    match megatrain::run::parse_bytes(s)? {
        0 => Err(format!("'{s}' must be positive")),
        n => Ok(n),
    }
}

fn parse_anchor(s: &str) -> Result<String, String> {
    anchor::select(s).map(|_| s.to_string())
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn base_spec(a: &Args, label: String, device: &str, precision: &str) -> Spec {
    let label = match a.keep_activations {
        KeepActivations::Blocks(0) => label,
        k => format!("{label} keep {k}"),
    };
    Spec {
        label,
        preset: None,
        model_dir: a.model.clone(),
        vocab: a.vocab,
        layers: a.layers,
        hidden: a.hidden,
        seq_len: a.seq_len,
        batch: a.batch,
        steps: a.steps,
        warmup: a.warmup,
        precision: precision.into(),
        device: device.into(),
        transport: a.transport.to_string(),
        checkpoint_every: a.checkpoint_every,
        mode_reps: a.mode_reps,
        lr: a.lr,
        // A peer beside a step that runs no kernel compares nothing.
        peer: device != floor::NOOP_DEVICE,
        host_budget: None,
        spill_dir: None,
        spill_window: a.spill_window,
        transfer_chunk: a.transfer_chunk,
        chunks_in_flight: a.chunks_in_flight,
        optimizer_queue: a.optimizer_queue,
        carry_layers: a.carry_layers,
        carry_order: a.carry_order,
        freeze_layers: a.freeze_layers,
        grad_clip: a.grad_clip,
        clip_after_backward: a.clip_after_backward,
        dropout: a.dropout,
        attn_dropout: a.attn_dropout,
        keep_activations: a.keep_activations,
        knobs: a.knobs,
        profile: a.profile,
    }
}

/// With --host-budget: each configuration all in RAM, then with the budget.
fn with_budget(a: &Args, specs: Vec<Spec>) -> Vec<Spec> {
    let Some(budget) = a.host_budget else {
        return specs;
    };
    let dir = spill_dir(a);
    specs
        .into_iter()
        .flat_map(|s| {
            let mut b = s.clone();
            b.label = format!("{} @{}", s.label, gib(budget));
            b.host_budget = Some(budget);
            b.spill_dir = Some(dir.clone());
            b.peer = false;
            [s, b]
        })
        .collect()
}

fn spill_dir(a: &Args) -> PathBuf {
    a.spill_dir
        .clone()
        .unwrap_or_else(|| root().join("target/bench-spill"))
}

fn gib(b: u64) -> String {
    format!("{:.1}G", b as f64 / (1u64 << 30) as f64)
}

/// Why an all-RAM run of `spec` would not fit in this machine's RAM, if so.
fn ram_leg_does_not_fit(spec: &Spec) -> Option<String> {
    let model = spec.model().ok()?;
    let transport = if spec.precision == "bf16" {
        megatrain_tier::TransportDType::BF16
    } else {
        megatrain_tier::TransportDType::F32
    };
    let cfg = megatrain_tier::TierConfig {
        transport,
        ..megatrain_tier::TierConfig::default()
    };
    let need = megatrain_tier::plan(&model.layer_tables(), &cfg)
        .ok()?
        .ram
        .total();
    let avail = megatrain::run::mem_available()?;
    (need > avail * 9 / 10).then(|| {
        format!(
            "all in RAM it needs {} of tier, {} available: not run",
            gib(need),
            gib(avail)
        )
    })
}

fn or_default(v: &[String], d: &[&str]) -> Vec<String> {
    if v.is_empty() {
        d.iter().map(|s| s.to_string()).collect()
    } else {
        v.to_vec()
    }
}

/// The anchor runs the flags ask for, each on every device and precision.
fn anchor_specs(a: &Args) -> Vec<Spec> {
    let mut out = Vec::new();
    let anchors = a
        .anchor
        .iter()
        .flat_map(|n| anchor::select(n).expect("checked by clap"));
    for anchor in anchors {
        let mut label = anchor.preset.to_string();
        if let Some(l) = a.layers {
            label += &format!(" L{l}");
        }
        for d in &or_default(&a.device, &["gpu"]) {
            for p in &or_default(&a.precision, &["f16"]) {
                let mut s = base_spec(a, label.clone(), d, p);
                s.preset = Some(anchor.preset.into());
                (s.batch, s.seq_len) = (anchor.batch, anchor.seq_len);
                out.push(s);
            }
        }
    }
    out
}

/// The configurations the flags ask for.
fn specs(a: &Args) -> Vec<Spec> {
    if !a.anchor.is_empty() {
        return anchor_specs(a);
    }
    let precisions = or_default(&a.precision, &["f32"]);
    let mut out = Vec::new();
    if a.quick {
        let devices = or_default(&a.device, &["cpu", "gpu"]);
        for (name, vocab) in [("llama-tiny", None), ("gpt2-nano", Some(65))] {
            for d in &devices {
                for p in &precisions {
                    let mut s = base_spec(a, name.into(), d, p);
                    s.preset = Some(name.into());
                    s.vocab = vocab;
                    s.layers = None;
                    s.hidden = None;
                    out.push(s);
                }
            }
        }
        if devices.iter().any(|d| d == "cpu") {
            // Large enough that the tier dominates the process's RSS.
            let mut s = base_spec(a, "deep-narrow-16x256".into(), "cpu", "bf16");
            s.preset = Some("llama-tiny".into());
            (s.layers, s.hidden, s.vocab) = (Some(16), Some(256), None);
            (s.steps, s.mode_reps, s.peer) = (2, a.mode_reps.min(2), false);
            out.push(s);
        }
        return out;
    }
    let devices = or_default(&a.device, &["cpu"]);
    let presets: Vec<Option<String>> = if a.model.is_some() {
        vec![None]
    } else {
        or_default(&a.preset, &["llama-tiny"])
            .into_iter()
            .map(Some)
            .collect()
    };
    for preset in presets {
        let mut label = preset.clone().unwrap_or_else(|| {
            a.model
                .as_ref()
                .and_then(|d| d.file_name())
                .map_or("model".into(), |n| n.to_string_lossy().into_owned())
        });
        if let Some(h) = a.hidden {
            label += &format!(" H{h}");
        }
        if let (Some(l), false) = (a.layers, a.sweep) {
            label += &format!(" L{l}");
        }
        if a.sweep {
            for &layers in &a.sweep_layers {
                for &batch in &a.sweep_batch {
                    for d in &devices {
                        let mut s = base_spec(a, format!("{label} L{layers} B{batch}"), d, &precisions[0]);
                        (s.preset, s.layers, s.batch) = (preset.clone(), Some(layers), batch);
                        out.push(s);
                    }
                }
            }
            break;
        }
        for d in &devices {
            for p in &precisions {
                let mut s = base_spec(a, label.clone(), d, p);
                s.preset = preset.clone();
                out.push(s);
            }
        }
    }
    out
}

/// The device knobs, refused as `megatrain train` refuses them; the GPU's
/// only where some configuration runs on one.
fn check_knobs(specs: &[Spec]) -> anyhow::Result<()> {
    let s = &specs[0];
    if let Some(b) = s.transfer_chunk {
        megatrain::run::transfer_chunk_elems(b)?;
    }
    s.knobs.validate()?;
    if specs.iter().all(|s| s.device == "cpu") {
        s.knobs.refuse_on_cpu()?;
    }
    Ok(())
}

/// Runs `spec` in a fresh process of this binary.
fn run_child(spec: &Spec) -> anyhow::Result<Record> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .args(["bench-throughput", "--child", &serde_json::to_string(spec)?])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find_map(|l| l.strip_prefix(RECORD_PREFIX));
    match line {
        Some(l) if out.status.success() => Ok(serde_json::from_str(l)?),
        _ => anyhow::bail!(
            "{}",
            stdout
                .lines()
                .rev()
                .find(|l| l.starts_with("ERROR "))
                .map_or_else(
                    || format!("child exited with {}", out.status),
                    |l| l[6..].to_string()
                )
        ),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(json) = &a.child {
        let spec: Spec = serde_json::from_str(json).context("--child spec")?;
        return match child::run(&spec) {
            Ok(r) => {
                println!("{RECORD_PREFIX}{}", serde_json::to_string(&r)?);
                Ok(())
            }
            Err(e) => {
                println!("ERROR {e:#}");
                Err(e)
            }
        };
    }
    if let Some(json) = &a.rank_child {
        return ranks::child_main(json);
    }
    let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    let root = root();
    let specs = with_budget(&a, specs(&a));
    anyhow::ensure!(!specs.is_empty(), "no configuration to run");
    check_knobs(&specs)?;
    for s in &specs {
        s.model().with_context(|| format!("configuration {}", s.label))?;
    }
    if a.ranks > 1 {
        println!(
            "{}",
            ranks::run(
                &specs,
                a.ranks,
                a.shard_optimizer,
                a.share_transport,
                a.threads_per_rank,
                a.rounds,
            )?
        );
        return Ok(());
    }
    let py = if a.no_peer || a.sweep {
        Err("not requested".to_string())
    } else {
        peer::available(&root)
    };
    if let Err(why) = &py {
        eprintln!("peer: unavailable ({why})");
    }
    let t0 = std::time::Instant::now();
    let mut records = Vec::new();
    let mut failures = Vec::new();
    let mut peers: HashMap<String, Vec<serde_json::Value>> = HashMap::new();
    for s in &specs {
        eprintln!(
            "== {} on {} ({}, transport {}) ==",
            s.label, s.device, s.precision, s.transport
        );
        if a.host_budget.is_some()
            && s.host_budget.is_none()
            && let Some(why) = ram_leg_does_not_fit(s)
        {
            eprintln!("  {why}");
            failures.push((format!("{} on {}", s.label, s.device), why));
            continue;
        }
        match run_child(s) {
            Ok(mut r) => {
                // One peer run per model shape; it pairs with the rows of
                // the matching device kind.
                let key = format!("{} {}x{} {:?}", s.label, s.batch, s.seq_len, s.peer_autocast());
                if let (Ok(py), true) = (&py, s.peer) {
                    let p = peers
                        .entry(key)
                        .or_insert_with(|| peer::run(&root, py, s, &s.model().expect("checked above")));
                    r.peer = Some(p.clone());
                }
                records.push(r);
            }
            Err(e) => {
                eprintln!("  {} on {}: {e:#}", s.label, s.device);
                failures.push((format!("{} on {}", s.label, s.device), format!("{e:#}")));
            }
        }
    }
    eprintln!("total {:.1} s", t0.elapsed().as_secs_f64());
    if a.sweep {
        println!("{}", report::sweep_table(&records));
        if let Some(svg) = &a.svg {
            std::fs::write(svg, report::sweep_svg(&records)).with_context(|| svg.display().to_string())?;
            eprintln!("wrote {}", svg.display());
        }
    } else {
        println!("{}", report::tables(&records, &failures));
        print!("{}", floor::table(&records));
        print!("{}", profile::tables(&records));
    }
    if a.host_budget.is_some() {
        let dir = spill_dir(&a);
        eprintln!(
            "disk: sequential bandwidth on {} ({} scratch file)",
            dir.display(),
            gib(a.disk_probe)
        );
        match megatrain_tier::measure_disk_bandwidth(&dir, a.disk_probe) {
            Ok(bw) => println!("{}", report::spill_table(&records, &bw)),
            Err(e) => println!("disk probe failed: {e}"),
        }
    }
    let json = a
        .json
        .clone()
        .or_else(|| a.sweep.then(|| root.join("target/bench-throughput-sweep.json")));
    if let Some(path) = json {
        let doc = report::json(&records, &failures, &command);
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| path.display().to_string())?;
        eprintln!("wrote {}", path.display());
    }
    anyhow::ensure!(!records.is_empty(), "every configuration failed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(flags: &[&str]) -> Args {
        Cli::parse_from(std::iter::once("x").chain(flags.iter().copied())).args
    }

    #[test]
    fn quick_covers_both_devices_and_a_streamed_memory_run() {
        let s = specs(&parse(&["--quick"]));
        assert_eq!(s.len(), 5);
        assert!(s.iter().any(|s| s.device == "gpu"));
        let big = s.last().unwrap();
        assert_eq!((big.device.as_str(), big.precision.as_str()), ("cpu", "bf16"));
        assert!(big.model().unwrap().param_count() > 10_000_000);
        for s in &s {
            s.model().unwrap();
        }
    }

    #[test]
    fn transport_reaches_every_spec() {
        assert!(specs(&parse(&["--quick"])).iter().all(|s| s.transport == "auto"));
        let s = specs(&parse(&["--device", "gpu", "--transport", "mapped"]));
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].transport().unwrap(), TransportChoice::Mapped);
        let bad = Cli::try_parse_from(["x", "--transport", "pinned"]).err().unwrap();
        assert!(bad.to_string().contains("unknown transport 'pinned'"), "{bad}");
    }

    #[test]
    fn transport_knobs_reach_every_spec_and_bad_ones_are_named() {
        let flags = [
            "--device",
            "gpu",
            "--staging-depth",
            "8",
            "--staging-chunk-mib",
            "16",
        ];
        let s = specs(&parse(
            &[&flags[..], &["--copy-threads", "3", "--profile"]].concat(),
        ));
        let o = s[0].knobs.gpu_options(TransportChoice::Auto);
        assert_eq!(
            (o.staging_depth, o.staging_chunk_bytes, o.copy_threads),
            (Some(8), Some(16 << 20), Some(3))
        );
        assert!(s[0].profile);
        check_knobs(&s).unwrap();
        for (flags, needle) in [
            (
                &["--device", "gpu", "--staging-depth", "0"][..],
                "--staging-depth 0",
            ),
            (
                &["--device", "gpu", "--transfer-chunk", "6"],
                "--transfer-chunk 6",
            ),
            (&["--copy-threads", "2"], "--device cpu"),
        ] {
            let e = check_knobs(&specs(&parse(flags))).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn host_budget_pairs_each_configuration_with_a_spilled_twin() {
        let s = specs(&parse(&["--preset", "llama-tiny", "--host-budget", "1.5G"]));
        let s = with_budget(&parse(&["--host-budget", "1.5G", "--spill-dir", "/tmp/x"]), s);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].host_budget, s[0].label.as_str()), (None, "llama-tiny"));
        assert_eq!(s[1].host_budget, Some(3 << 29));
        assert_eq!(s[1].label, "llama-tiny @1.5G");
        assert_eq!(s[1].spill_dir.as_deref(), Some(Path::new("/tmp/x")));
        assert_eq!(parse_bytes("384M"), Ok(384 << 20));
        assert!(parse_bytes("0").is_err() && parse_bytes("3X").is_err());
    }

    #[test]
    fn anchors_set_model_batch_and_gpu_f16_unless_given() {
        let s = specs(&parse(&[
            "--anchor",
            "tinyllama-8x1024",
            "--anchor",
            "qwen2.5-7b-16x2048",
        ]));
        let got: Vec<(&str, usize, usize, &str, &str)> = s
            .iter()
            .map(|s| {
                (
                    s.preset.as_deref().unwrap(),
                    s.batch,
                    s.seq_len,
                    s.device.as_str(),
                    s.precision.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("tinyllama-1.1b", 8, 1024, "gpu", "f16"),
                ("qwen2.5-7b", 16, 2048, "gpu", "f16")
            ]
        );
        assert!(s.iter().all(|s| s.peer && s.peer_autocast() == Some("bf16")));
        for s in &s {
            s.model().unwrap();
        }
        // All four; devices, precisions and a depth override multiply them.
        let s = specs(&parse(&[
            "--anchor",
            "all",
            "--device",
            "cpu",
            "--device",
            "gpu",
            "--precision",
            "f32",
            "--layers",
            "2",
        ]));
        assert_eq!(s.len(), 8);
        assert!(
            s.iter()
                .all(|s| s.precision == "f32" && s.peer_autocast().is_none())
        );
        assert!(
            s.iter()
                .all(|s| s.label.ends_with(" L2") && s.model().unwrap().num_layers == 2)
        );
        let bad = Cli::try_parse_from(["x", "--anchor", "gpt-5"]).err().unwrap();
        assert!(bad.to_string().contains("unknown anchor 'gpt-5'"), "{bad}");
        assert!(Cli::try_parse_from(["x", "--anchor", "all", "--quick"]).is_err());
    }

    #[test]
    fn sweep_varies_depth_and_batch() {
        let s = specs(&parse(&[
            "--sweep",
            "--sweep-layers",
            "2,4",
            "--sweep-batch",
            "1,3",
        ]));
        let got: Vec<(Option<usize>, usize)> = s.iter().map(|s| (s.layers, s.batch)).collect();
        assert_eq!(got, [(Some(2), 1), (Some(2), 3), (Some(4), 1), (Some(4), 3)]);
    }
}
