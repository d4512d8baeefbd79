//! `bench-throughput --ranks N`: data parallel scaling. Each configuration
//! runs once as a plain single process (the baseline) and once as N ranks
//! under `mpirun`, every process with the same threads (one "device" each),
//! with the same per-rank batch; scaling efficiency is the N-rank
//! throughput over N times the baseline's (weak scaling; 1.0 is ideal).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use megatrain::StepMetrics;
use megatrain::data::{Batch, Sampling, TokenData, draw_rows};
use megatrain::dist::{Collective, DistConfig, Shared, share_transport};
use megatrain::trainer::{Trainer, TrainerConfig, transfer_chunk_for};
use megatrain_adamw::AdamWConfig;
use megatrain_tensor::CpuExecutor;
use megatrain_tier::{Shard, rss};
use serde::{Deserialize, Serialize};

use super::child::tier_for;
use super::record::median;
use super::spec::Spec;

const PREFIX: &str = "RANKS_RECORD ";

/// What the parent hands to each process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankSpec {
    pub spec: Spec,
    pub ranks: usize,
    pub shard_optimizer: bool,
    /// With a sharded optimizer: the ranks map one transport copy.
    #[serde(default)]
    pub share_transport: bool,
}

/// Rank 0's view of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankRecord {
    pub ranks: usize,
    pub shard_optimizer: bool,
    /// Tokens of all ranks per step.
    pub tokens_per_step: u64,
    /// Median over the timed steps.
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// Means over the timed steps (rank 0).
    pub comm_ms: f64,
    pub comm_wait_ms: f64,
    pub comm_bytes_per_step: u64,
    /// Rank 0's resident set after the timed steps (peak RSS would count
    /// the whole state that initialisation writes before a sharded rank
    /// hands back the pages it does not own).
    pub rss_bytes: u64,
    /// Rank 0's proportional set size then: its share of the transport
    /// copy the ranks map together, where they do.
    #[serde(default)]
    pub pss_bytes: u64,
    /// The ranks mapped one transport copy (a sharded optimizer's default).
    #[serde(default)]
    pub shared_transport: bool,
    /// Rank 0's gradient staging peak (`Trainer::staging_bytes`): chunks
    /// in flight, bounded by the transfer chunk, not by the largest layer.
    #[serde(default)]
    pub staging_bytes: u64,
    pub loss_last: f64,
}

fn synthetic(vocab: usize, len: usize) -> TokenData {
    TokenData {
        tokens: (0..len as u64)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % vocab as u64) as u32)
            .collect(),
        loss_mask: None,
        records: None,
    }
}

#[cfg(feature = "mpi")]
fn join() -> anyhow::Result<Option<std::sync::Arc<dyn Collective>>> {
    if !megatrain::dist::launched_by_mpi() {
        return Ok(None);
    }
    let comm = megatrain::dist::mpi::MpiComm::init()?.context("MPI initialised twice")?;
    Ok(Some(std::sync::Arc::new(comm)))
}

#[cfg(not(feature = "mpi"))]
fn join() -> anyhow::Result<Option<std::sync::Arc<dyn Collective>>> {
    anyhow::ensure!(
        !megatrain::dist::launched_by_mpi(),
        "xtask was built without MPI: run it with `cargo run --release -p xtask --features mpi --`"
    );
    Ok(None)
}

/// One process of a run (under `mpirun` for N > 1). Returns rank 0's record.
pub fn child(rs: &RankSpec) -> anyhow::Result<Option<RankRecord>> {
    let comm = join()?;
    let (rank, ranks) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    anyhow::ensure!(
        ranks == rs.ranks,
        "{} ranks started for a run of {}",
        ranks,
        rs.ranks
    );
    let spec = &rs.spec;
    anyhow::ensure!(
        spec.device == "cpu",
        "--ranks runs the CPU executor only (one rank per GPU is future work)"
    );
    let model = spec.model()?;
    let shard = (rs.shard_optimizer && comm.is_some()).then_some(Shard { rank, ranks });
    // The machine's ranks map one transport copy, as `train` does by
    // default.
    let sharing = match &comm {
        Some(c) if rs.share_transport => {
            let transport = super::child::precision(spec)?.transport();
            match share_transport(
                &**c,
                Path::new("/dev/shm"),
                &model.layer_tables(),
                transport,
                false,
            )? {
                Shared::Yes(s) => Some(s),
                Shared::No(why) => {
                    if rank == 0 {
                        eprintln!("  transport copies: one per rank ({why})");
                    }
                    None
                }
            }
        }
        _ => None,
    };
    let tier = tier_for(spec, &model, shard, sharing.as_ref().map(|s| s.tier.clone()))?;
    let mut config = TrainerConfig {
        checkpoint_every: spec.checkpoint_every,
        chunk_rows: megatrain_zoo::default_chunk_rows(
            model.vocab_size,
            megatrain_tensor::HOST_LOGITS_CHUNK_BYTES,
        ),
        adamw: AdamWConfig::default(),
        transfer_chunk: transfer_chunk_for(model.param_count() as u64),
        ..TrainerConfig::default()
    };
    spec.apply_to_trainer(&mut config)?;
    // `auto` keeps none here: the ranks share this machine's memory.
    config.keep_activations = spec.keep_activations.blocks(model.num_layers)?;
    let mut tr = Trainer::new(CpuExecutor::default(), model.clone(), tier, config)?;
    if let Some(c) = comm.clone() {
        tr.set_distributed(DistConfig {
            comm: c,
            shard_optimizer: rs.shard_optimizer,
            shared: sharing.as_ref().map(|s| s.machines.clone()),
        })?;
    }
    let shared_transport = sharing.is_some();
    let global = spec.batch * ranks;
    let data = synthetic(model.vocab_size, (global * (spec.seq_len + 1)).max(4096));
    let rows = rank * spec.batch..(rank + 1) * spec.batch;
    let mut steps: Vec<StepMetrics> = Vec::new();
    for i in 0..(spec.warmup + spec.steps) as u64 {
        let b: Batch = draw_rows(
            &data,
            Sampling::Random { seed: 5 },
            i,
            global,
            rows.clone(),
            spec.seq_len,
            "synthetic".as_ref(),
        )?;
        let m = tr.step(std::slice::from_ref(&b), spec.lr)?;
        anyhow::ensure!(m.loss.is_finite(), "step {i}: loss {}", m.loss);
        if rank == 0 {
            eprintln!(
                "  [{} × {ranks}] step {i}: {:.1} ms, comm {:.1} ms (waited {:.1}), loss {:.4}",
                spec.label, m.step_ms, m.comm_ms, m.comm_wait_ms, m.loss
            );
        }
        if i >= spec.warmup as u64 {
            steps.push(m);
        }
    }
    if rank != 0 {
        return Ok(None);
    }
    let n = steps.len().max(1) as f64;
    let step_ms = median(&steps.iter().map(|m| m.step_ms).collect::<Vec<_>>());
    let tokens = (global * spec.seq_len) as u64;
    Ok(Some(RankRecord {
        ranks,
        shard_optimizer: rs.shard_optimizer,
        tokens_per_step: tokens,
        step_ms,
        tokens_per_s: tokens as f64 / (step_ms / 1e3),
        comm_ms: steps.iter().map(|m| m.comm_ms).sum::<f64>() / n,
        comm_wait_ms: steps.iter().map(|m| m.comm_wait_ms).sum::<f64>() / n,
        comm_bytes_per_step: steps.last().map_or(0, |m| m.comm_bytes),
        rss_bytes: rss::current_rss_bytes().unwrap_or(0),
        pss_bytes: rss::current_pss_bytes().unwrap_or(0),
        shared_transport,
        staging_bytes: tr.staging_bytes(),
        loss_last: steps.last().map_or(f64::NAN, |m| m.loss),
    }))
}

/// Prints rank 0's record for the parent.
pub fn child_main(json: &str) -> anyhow::Result<()> {
    let rs: RankSpec = serde_json::from_str(json).context("--rank-child spec")?;
    if let Some(r) = child(&rs)? {
        println!("{PREFIX}{}", serde_json::to_string(&r)?);
    }
    Ok(())
}

fn launch(rs: &RankSpec, threads: usize) -> anyhow::Result<RankRecord> {
    let exe = std::env::current_exe()?;
    let json = serde_json::to_string(rs)?;
    let mut cmd = if rs.ranks == 1 {
        Command::new(&exe)
    } else {
        let mut c = Command::new("mpirun");
        // No core binding: each rank's threads go where the OS puts them,
        // as the single-process baseline's do.
        c.args([
            "--bind-to",
            "none",
            "--oversubscribe",
            "-np",
            &rs.ranks.to_string(),
        ])
        .arg(&exe);
        c
    };
    let out = cmd
        .args(["bench-throughput", "--rank-child", &json])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("starting mpirun (Open MPI's openmpi-bin)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().rev().find_map(|l| l.strip_prefix(PREFIX)) {
        Some(l) if out.status.success() => Ok(serde_json::from_str(l)?),
        _ => anyhow::bail!("{} ranks: exited with {}\n{stdout}", rs.ranks, out.status),
    }
}

/// The scaling table for every spec. The baseline and the N-rank run take
/// turns for `rounds` rounds (so a change in machine load hits both alike);
/// each row is the round with the median throughput.
pub fn run(
    specs: &[Spec],
    ranks: usize,
    shard: bool,
    share: bool,
    threads: usize,
    rounds: usize,
) -> anyhow::Result<String> {
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(ranks >= 2, "--ranks {ranks}: give at least 2 for a scaling run");
    let mut table = String::from(
        "| config | ranks | optimizer | global batch | step ms | tokens/s | comm ms | comm waited ms | comm MB/step | RSS rank 0 | PSS rank 0 | staging rank 0 | efficiency |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in specs {
        let mut spec = s.clone();
        (spec.mode_reps, spec.peer) = (0, false);
        let mut runs: [Vec<RankRecord>; 2] = [Vec::new(), Vec::new()];
        for round in 0..rounds {
            for (k, n) in [1, ranks].into_iter().enumerate() {
                let rs = RankSpec {
                    spec: spec.clone(),
                    ranks: n,
                    shard_optimizer: shard && n > 1,
                    share_transport: share && n > 1,
                };
                eprintln!(
                    "== {} on {n} rank(s), round {} of {rounds} ==",
                    spec.label,
                    round + 1
                );
                runs[k].push(launch(&rs, threads)?);
                // Let the machine settle between runs.
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        let rows: Vec<RankRecord> = runs
            .into_iter()
            .map(|mut v| {
                v.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
                v.swap_remove(v.len() / 2)
            })
            .collect();
        let base = rows[0].tokens_per_s;
        for r in &rows {
            table += &format!(
                "| {} | {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1} MiB | {:.1} MiB | {:.2} MiB | {:.3} |\n",
                spec.label,
                r.ranks,
                if r.ranks == 1 {
                    "alone"
                } else {
                    match (r.shard_optimizer, r.shared_transport) {
                        (true, true) => "sharded, one copy",
                        (true, false) => "sharded",
                        (false, true) => "replicated, one copy",
                        (false, false) => "replicated",
                    }
                },
                r.tokens_per_step / spec.seq_len as u64,
                r.step_ms,
                r.tokens_per_s,
                r.comm_ms,
                r.comm_wait_ms,
                r.comm_bytes_per_step as f64 / 1e6,
                r.rss_bytes as f64 / (1 << 20) as f64,
                r.pss_bytes as f64 / (1 << 20) as f64,
                r.staging_bytes as f64 / (1 << 20) as f64,
                r.tokens_per_s / (r.ranks as f64 * base),
            );
        }
    }
    Ok(table)
}
