//! The training loop behind `megatrain train`: on what `prepare.rs` made
//! ready (options, tokenizer, model, data, resume state), run steps with
//! evaluation (`evaluate.rs`), metrics, plot and checkpoints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use megatrain_adamw::AdamWConfig;
use megatrain_tensor::{Executor, TransportInfo};
use megatrain_tier::{HostTier, Shard, TierConfig, load_checkpoint};
use megatrain_zoo::HfCheckpoint;
use serde_json::{Value, json};

use super::checkpoint::{
    Patience, TrainState, best_checkpoint, note_best, prune_checkpoints, save_run_checkpoint,
};
use super::error::{Result, RunError};
use super::evaluate::evaluate_split;
use super::every::Every;
use super::generate::{SampleOptions, generate};
use super::keep::Room;
use super::metrics_log::MetricsLog;
use super::options::{SamplingKind, ShareTransport, TrainOptions};
use super::plan::PlanInput;
use super::plot::write_plot;
use super::prepare::{Prepared, sample_prompt};
use crate::data::{Sampling, draw_mix_rows, keep_in_cache};
use crate::dist::{DistConfig, Shared, share_transport};
use crate::trainer::{RowsSetting, StepMetrics, Trainer, TrainerConfig, init_tier, load_tier, new_tier};

/// Mixed into the seed for validation batches, so they differ from the
/// training batches of the same index.
const EVAL_SEED_MIX: u64 = 0x5EED_0E7A_1000_0001;

/// What the loop reports as it goes (a progress bar, plain lines, nothing).
pub trait Progress {
    /// The executor's transport choice, where it made one (once, at start).
    fn transport(&mut self, _info: &TransportInfo) {}
    /// On several ranks (once, at start): how many
    /// ranks of this machine map one transport copy, and in which
    /// directory; or, where each holds its own although sharing was asked
    /// for, why.
    fn shared_transport(&mut self, _shared: Result<(usize, &Path), &str>) {}
    /// How many of the model's blocks keep their weights and activations
    /// from forward to backward (`--keep-activations`), and why (once, at
    /// start).
    fn activations(&mut self, _kept: usize, _blocks: usize, _why: &str) {}
    fn begin(&mut self, _start: u64, _total: u64) {}
    fn step(&mut self, _record: &Value) {}
    fn eval(&mut self, _step: u64, _val_loss: f64) {}
    /// What the model wrote at `step` (`--sample-every`), its prompt first.
    fn sample(&mut self, _step: u64, _text: &str) {}
    fn saved(&mut self, _step: u64, _dir: &Path) {}
    fn finish(&mut self) {}
}

pub struct QuietProgress;
impl Progress for QuietProgress {}

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub step: u64,
    pub loss: Option<f64>,
    pub val_loss: Option<f64>,
    pub tokens: u64,
    pub train_s: f64,
    pub checkpoint: Option<PathBuf>,
    /// The signal that ended the run early, at `step`, with a checkpoint
    /// of it ([`super::interrupt`]).
    pub interrupted: Option<i32>,
    /// The checkpoint `best` names (the lowest validation loss of those
    /// saved at an evaluation) and that loss.
    pub best: Option<(PathBuf, f64)>,
    /// Where `--early-stop` ended the run: the lowest validation loss and
    /// the evaluations since it.
    pub stopped_early: Option<Patience>,
}

/// A fresh run's ids (and instruction masks), tokenized before its run
/// directory existed, written there and mapped (a resume's were mapped by
/// [`prepare`]).
fn keep_ids(p: &mut Prepared) -> Result<()> {
    let dir = p.opts.out.join(TOKENS_DIR);
    let (enc, t) = (&p.encoder, &p.template);
    let tails = p.opts.val_data.is_none();
    for (i, (path, train)) in p.opts.data.iter().zip(&mut p.train.parts).enumerate() {
        match p.val.as_mut().filter(|_| tails) {
            // The validation split is the source's tail.
            Some(v) => keep_in_cache(path, enc, t, &dir, &mut [train, &mut v.parts[i]])?,
            None => keep_in_cache(path, enc, t, &dir, &mut [train])?,
        }
    }
    if let (Some(vp), Some(v), false) = (&p.opts.val_data, &mut p.val, tails) {
        keep_in_cache(vp, enc, t, &dir, &mut [&mut v.parts[0]])?;
    }
    Ok(())
}

fn sampling(opts: &TrainOptions) -> Sampling {
    match opts.sampling {
        SamplingKind::Sequential => Sampling::Sequential,
        SamplingKind::Random => Sampling::Random { seed: opts.seed },
    }
}

/// A tier that does not fit `--host-budget`, said as a refusal of the flag
/// (`copies`: why each rank holds a transport copy of its own where the
/// machine's ranks were to share one).
fn over_budget(e: RunError, opts: &TrainOptions, copies: Option<&str>) -> RunError {
    use crate::trainer::TrainError;
    use megatrain_tier::TierError::{BudgetExceeded, TransportOverBudget};
    match (&e, opts.host_budget) {
        (
            RunError::Tier(t @ (BudgetExceeded { .. } | TransportOverBudget { .. }))
            | RunError::Train(TrainError::Tier(t @ (BudgetExceeded { .. } | TransportOverBudget { .. }))),
            Some(budget),
        ) => RunError::option(
            "host-budget",
            budget,
            match copies {
                None => format!("{t} (`megatrain plan` with the same flags shows what fits)"),
                Some(why) => format!(
                    "{t}: each rank holds a transport copy of its own, as its machine's ranks could \
                     not share one ({why})"
                ),
            },
        ),
        _ => e,
    }
}

/// A shared transport copy that could not be made, naming `--shm-dir`.
fn shm_error(e: RunError, opts: &TrainOptions) -> RunError {
    match e {
        RunError::Tier(megatrain_tier::TierError::Io { cause, .. }) => RunError::option(
            "shm-dir",
            opts.shm_dir.display(),
            format!(
                "{cause}: the ranks of a machine share their transport copies there; give a \
                 memory filesystem they can all write, or --share-transport auto|false"
            ),
        ),
        e => e,
    }
}

/// The run directory, made here where it did not exist: a run refused
/// before it wrote anything (its tier over the budget, a carried layer the
/// tier spills) leaves no empty directory behind, nor the empty `spill`
/// directory in it. Only empty directories are removed, and only by the
/// lead rank (ranks may race to make it).
struct MadeDir(Option<PathBuf>);

impl MadeDir {
    fn new(out: &Path, lead: bool) -> Result<Self> {
        let made = lead && !out.exists();
        std::fs::create_dir_all(out).map_err(RunError::io(out))?;
        Ok(MadeDir(made.then(|| out.to_path_buf())))
    }
}

impl Drop for MadeDir {
    fn drop(&mut self) {
        if let Some(out) = &self.0 {
            let _ = std::fs::remove_dir(out.join("spill"));
            let _ = std::fs::remove_dir(out);
        }
    }
}

/// The tier of rank `rank` of the run of a model of `blocks` blocks (a
/// sharded optimizer's rank keeps its share of p, m, v, and the budget
/// counts that share).
pub fn tier_config(opts: &TrainOptions, rank: usize, blocks: usize) -> TierConfig {
    TierConfig {
        transport: opts.precision.transport(),
        hold_grads: opts.grad_accum > 1 || opts.grad_clip > 0.0,
        // Carried layers' gradients stay on the device, summed there.
        grads_on_device: crate::trainer::carried_layers(opts.carry_layers, opts.carry_order, blocks),
        ram_budget_bytes: opts.host_budget,
        spill_dir: opts.host_budget.map(|_| opts.out.join("spill")),
        shard: (opts.shard_optimizer && opts.ranks > 1).then_some(Shard {
            rank,
            ranks: opts.ranks,
        }),
        shared_transport: None,
    }
}

/// Runs the prepared training on `ex` until `opts.steps` (or `stop_at`,
/// which stops early without changing the schedule: resuming later gives
/// the same result as never stopping).
pub fn train<E: Executor>(
    ex: E,
    p: &mut Prepared,
    stop_at: Option<u64>,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    train_with(ex, p, stop_at, progress, None)
}

/// [`train`] as one rank of data parallel training when `dist` is given
/// (`p.opts.ranks` must be its size). Every rank checks that the others
/// were started with the same settings, model and data before the first
/// step; each draws its rows of every batch; rank 0 alone writes metrics,
/// plots and checkpoints (with a sharded optimizer it gathers the state
/// first). `progress` hears only rank 0's steps. Once the run has
/// started, a text's ids held in `p` move to the run directory and are
/// mapped from there ([`keep_in_cache`]).
pub fn train_with<E: Executor>(
    mut ex: E,
    p: &mut Prepared,
    stop_at: Option<u64>,
    progress: &mut dyn Progress,
    dist: Option<DistConfig>,
) -> Result<Summary> {
    let opts = &p.opts.clone();
    // Before anything is allocated or written: an executor that cannot
    // compute in the asked precision ends the run here, naming itself.
    ex.set_compute_precision(opts.precision.compute())
        .map_err(|e| RunError::option("precision", opts.precision, format!("{e}")))?;
    let out = &opts.out;
    let (rank, ranks) = dist.as_ref().map_or((0, 1), |d| (d.comm.rank(), d.comm.size()));
    if ranks != opts.ranks {
        return Err(RunError::option(
            "ranks",
            opts.ranks,
            format!("the run is set for {} ranks but {ranks} were started", opts.ranks),
        ));
    }
    if let Some(d) = &dist {
        super::dist_check::same_everywhere(&*d.comm, p)?;
    }
    let lead = rank == 0;
    // Dropped after the tier and the trainer (declared before them).
    let _made = MadeDir::new(out, lead)?;
    let mut tcfg = tier_config(opts, rank, p.model.num_layers);
    // Before the tier: a machine's ranks map the copies one of them makes
    // (opened by all, its name gone, before this goes on).
    let shared = match &dist {
        Some(d) if d.comm.size() > 1 && opts.share_transport != ShareTransport::False => {
            let required = opts.share_transport == ShareTransport::True;
            let tables = p.model.layer_tables();
            Some(
                share_transport(&*d.comm, &opts.shm_dir, &tables, tcfg.transport, required)
                    .map_err(|e| shm_error(e, opts))?,
            )
        }
        _ => None,
    };
    let (sharing, shared_note) = match shared {
        Some(Shared::Yes(s)) => {
            let note = Ok((s.machines.node.size(), opts.shm_dir.clone()));
            (Some(s), Some(note))
        }
        Some(Shared::No(why)) => (None, Some(Err(why))),
        None => (None, None),
    };
    tcfg.shared_transport = sharing.as_ref().map(|s| s.tier.clone());
    // The plan that sizes `--keep-activations auto` holds gradients as the tier does.
    let hold_grads = tcfg.hold_grads;
    let why_own = match &shared_note {
        Some(Err(why)) => Some(why.as_str()),
        _ => None,
    };
    let tier = match (&p.resume, &opts.model) {
        (Some((ckpt, _)), _) => {
            let mut tier = new_tier(&p.model, tcfg).map_err(|e| over_budget(e.into(), opts, why_own))?;
            load_checkpoint(ckpt, &mut tier)?;
            tier
        }
        (None, Some(dir)) => {
            load_tier(&HfCheckpoint::open(dir)?, tcfg).map_err(|e| over_budget(e.into(), opts, why_own))?
        }
        (None, None) => {
            init_tier(&p.model, tcfg, opts.seed).map_err(|e| over_budget(e.into(), opts, why_own))?
        }
    };
    let chunk_rows = opts.chunk_rows(p.model.vocab_size, ex.logits_chunk_bytes());
    let optimizer_queue = opts
        .optimizer_queue
        .unwrap_or(crate::trainer::DEFAULT_OPTIMIZER_QUEUE);
    let mut config = TrainerConfig {
        checkpoint_every: opts.checkpoint_every,
        chunk_rows,
        adamw: AdamWConfig {
            beta1: opts.beta1 as f32,
            beta2: opts.beta2 as f32,
            eps: opts.eps as f32,
            weight_decay: opts.weight_decay as f32,
        },
        grad_clip: (opts.grad_clip > 0.0).then_some(opts.grad_clip),
        optimizer_queue,
        transfer_chunk: match opts.transfer_chunk {
            Some(b) => super::knobs::transfer_chunk_elems(b)?,
            None => crate::trainer::transfer_chunk_for(p.model.param_count() as u64),
        },
        chunks_in_flight: opts
            .chunks_in_flight
            .unwrap_or(TrainerConfig::default().chunks_in_flight),
        keep_activations: 0,
        carry_layers: opts.carry_layers,
        carry_order: opts.carry_order,
        compact_embedding: crate::trainer::compact_embedding_from_env()?,
        frozen_layers: opts.freeze_layers,
        defer_clipped_updates: true,
        dropout: crate::trainer::TrainDropout {
            hidden: opts.dropout,
            attention: opts.attn_dropout,
            neftune: opts.neftune_alpha,
            seed: opts.seed,
        },
        z_loss: opts.z_loss as f32,
        label_smoothing: opts.label_smoothing as f32,
    };
    let kept = opts.keep_activations.resolve(
        &p.model,
        &PlanInput {
            batch: opts.batch,
            seq_len: opts.seq_len,
            checkpoint_every: opts.checkpoint_every,
            keep_activations: 0,
            chunk_rows,
            transport: opts.precision.transport(),
            hold_grads,
            carry_layers: opts.carry_layers,
            carry_order: opts.carry_order,
            optimizer_queue,
            embedding_rows: RowsSetting::of(&config, &tier, dist.is_some()).applies(&p.model),
        },
        &Room::of(ex.tensor_memory(), opts.ranks, opts.host_budget.is_some()),
    )?;
    config.keep_activations = kept.blocks;
    let mut trainer = Trainer::new(ex, p.model.clone(), tier, config)?;
    if let Some(w) = opts.spill_window {
        trainer.set_spill_window(megatrain_tier::WindowConfig::from_bytes(w, 4));
    }
    if let Some(d) = dist.clone() {
        trainer.set_distributed(DistConfig {
            shard_optimizer: opts.shard_optimizer,
            shared: sharing.as_ref().map(|s| s.machines.clone()),
            ..d
        })?;
    }
    keep_ids(p)?;
    let mut quiet = QuietProgress;
    let progress: &mut dyn Progress = if lead { progress } else { &mut quiet };
    if let Some(info) = trainer.transport_info() {
        progress.transport(info);
    }
    progress.activations(kept.blocks, p.model.num_layers, &kept.why);
    if let Some(n) = &shared_note {
        progress.shared_transport(n.as_ref().map(|(k, d)| (*k, d.as_path())).map_err(|e| e.as_str()));
    }

    let (start, mut tokens, prior_s) = match &p.resume {
        Some((_, s)) => (s.step, s.tokens, s.train_s),
        None => (0, 0, 0.0),
    };
    let mut log = if lead {
        Some(MetricsLog::open(
            out,
            p.resume.as_ref().map(|(_, s)| s.step),
            opts.tensorboard,
        )?)
    } else {
        None
    };
    let schedule = opts.schedule();
    let draw = sampling(opts);
    let eval_sampling = Sampling::Random {
        seed: opts.seed ^ EVAL_SEED_MIX,
    };
    let eval = |t: &Trainer<E>| -> Result<Option<f64>> {
        let Some(v) = &p.val else { return Ok(None) };
        let (batch, seq) = (opts.global_batch(), opts.seq_len);
        let draw = |i, rows| draw_mix_rows(v, eval_sampling, i, batch, rows, seq, &p.val_names);
        evaluate_split(t, draw, batch, opts.eval_batches, dist.as_ref().map(|d| &*d.comm)).map(Some)
    };
    let end = stop_at.unwrap_or(opts.steps).min(opts.steps);
    let mut summary = Summary {
        step: start,
        loss: None,
        val_loss: None,
        tokens,
        train_s: prior_s,
        checkpoint: p.resume.as_ref().map(|(c, _)| c.clone()),
        interrupted: None,
        best: None,
        stopped_early: None,
    };
    let mut patience = p.resume.as_ref().and_then(|(_, s)| s.patience);
    if opts.early_stop > 0 && p.val.is_none() {
        return Err(RunError::option(
            "early-stop",
            opts.early_stop,
            "counts validation losses, and this run has no validation data",
        ));
    }
    // Where `epoch` falls (--eval-every, --save-every, --sample-every).
    let passes = opts.passes(p.rows_per_pass);
    progress.begin(start, opts.steps);
    let t0 = Instant::now();
    if start == 0
        && !opts.eval_every.is_never()
        && let Some(v) = eval(&trainer)?
    {
        if let Some(log) = &mut log {
            log.append(json!({"step": 0, "tokens": 0, "val_loss": v}))?;
        }
        progress.eval(0, v);
        summary.val_loss = Some(v);
        patience = Patience::after(patience, v);
    }
    let ga = opts.grad_accum as u64;
    // Step s draws its dropout masks from s, resumed or not.
    trainer.set_next_step(start);
    for s in start..end {
        let rows = rank * opts.batch..(rank + 1) * opts.batch;
        let micro = (0..ga)
            .map(|m| {
                draw_mix_rows(
                    &p.train,
                    draw,
                    s * ga + m + opts.skip_batches,
                    opts.global_batch(),
                    rows.clone(),
                    opts.seq_len,
                    &p.train_names,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let lr = schedule.at(s);
        let m = trainer.step(&micro, lr)?;
        let step = s + 1;
        tokens += m.tokens;
        let mut rec = serde_json::to_value(&m).expect("metrics serialise");
        let obj = rec.as_object_mut().expect("metrics are an object");
        obj.insert("step".into(), json!(step));
        obj.insert("lr".into(), json!(lr));
        obj.insert("step_tokens".into(), json!(m.tokens));
        obj.insert("tokens".into(), json!(tokens));
        let tps = if m.step_ms > 0.0 {
            m.tokens as f64 / (m.step_ms / 1e3)
        } else {
            0.0
        };
        obj.insert("tokens_per_s".into(), json!(tps));
        obj.insert("elapsed_s".into(), json!(prior_s + t0.elapsed().as_secs_f64()));
        obj.insert("bus_crossings".into(), json!(m.bus_crossings()));
        let diverged = diverged(&m, p.model.num_layers);
        let finite = diverged.is_none();
        let due = |every: Every| every.due(step, passes) || step == opts.steps;
        // A signal that came during the step skips its evaluation: the
        // checkpoint comes first (a machine's notice before it is taken back
        // may not leave time for both). One during the evaluation is seen
        // right after it.
        summary.interrupted = interrupted(dist.as_ref())?;
        let reads = summary.interrupted.is_none()
            && ((due(opts.eval_every) && p.val.is_some())
                || (!opts.sample_every.is_never() && due(opts.sample_every)));
        if finite && (reads || step == end) {
            // The evaluation and the sample read every layer's parameters;
            // the run's last step leaves none of its updates behind. Every
            // rank settles, also for rank 0's sample: a sharded rank's
            // deferred updates end in an all-gather.
            trainer.settle()?;
        }
        let mut evaluated = None;
        if finite && summary.interrupted.is_none() && due(opts.eval_every) && p.val.is_some() {
            let v = eval(&trainer)?.unwrap_or(f64::NAN);
            obj.insert("val_loss".into(), json!(v));
            evaluated = Some(v);
            patience = Patience::after(patience, v);
            // The same on every rank: the loss is the ranks' sum.
            if opts.early_stop > 0 && patience.is_some_and(|p| p.since >= opts.early_stop) {
                summary.stopped_early = patience;
            }
            summary.interrupted = interrupted(dist.as_ref())?;
        }
        let mut sampled = None;
        if lead
            && finite
            && summary.interrupted.is_none()
            && !opts.sample_every.is_never()
            && due(opts.sample_every)
        {
            let text = sample_at(&trainer, p, step)?;
            obj.insert("sample".into(), json!(text));
            sampled = Some(text);
        }
        if let Some(log) = &mut log {
            log.append(rec.clone())?;
        }
        progress.step(&rec);
        if let Some(text) = sampled {
            progress.sample(step, &text);
        }
        summary.step = step;
        summary.loss = Some(m.loss);
        summary.tokens = tokens;
        if let Some(what) = diverged {
            return Err(RunError::Config(format!(
                "{what} at step {step}: training diverged (try a lower --lr or --grad-clip 1); \
                 the last good checkpoint is kept"
            )));
        }
        if let Some(v) = evaluated {
            summary.val_loss = Some(v);
            progress.eval(step, v);
            if let Some(log) = &log {
                write_plot(out, log.records())?;
            }
        }
        summary.train_s = prior_s + t0.elapsed().as_secs_f64();
        let early = summary.stopped_early.is_some();
        if due(opts.save_every) || Some(step) == stop_at || summary.interrupted.is_some() || early {
            let mut state = TrainState::new(step, tokens, summary.train_s, p.encoder.kind(), opts);
            state.val_loss = evaluated;
            state.patience = patience;
            let saved = trainer.save_on_rank0(|tier, gather| {
                save_run_checkpoint(out, tier, gather, &p.model, &p.encoder, &state)
            })?;
            match saved {
                Some(dir) => {
                    // Before pruning: the best so far is never pruned.
                    if let Some(v) = evaluated {
                        note_best(out, &dir, v)?;
                    }
                    if opts.keep_checkpoints > 0 {
                        prune_checkpoints(out, opts.keep_checkpoints)?;
                    }
                    progress.saved(step, &dir);
                    summary.checkpoint = Some(dir);
                }
                None => summary.checkpoint = Some(out.join(super::checkpoint::checkpoint_name(step))),
            }
            trainer.release_unowned()?;
        }
        if summary.interrupted.is_some() || early {
            break;
        }
    }
    if let Some(log) = &log {
        write_plot(out, log.records())?;
    }
    summary.train_s = prior_s + t0.elapsed().as_secs_f64();
    if lead {
        // A `best` the user removed is no reason to fail a finished run.
        summary.best = best_checkpoint(out).ok().flatten();
    }
    progress.finish();
    Ok(summary)
}

/// What went non-finite in a step, if anything: the loss, else the first
/// layer whose gradient did (a gradient that overflowed under a finite
/// loss; its update has made the layer's parameters non-finite too), else
/// the norm of the whole. Layers are the tier's: the embedding, `blocks`
/// blocks, the head.
fn diverged(m: &StepMetrics, blocks: usize) -> Option<String> {
    if !m.loss.is_finite() {
        return Some(format!("the loss is {}", m.loss));
    }
    let norm = m.grad_norm.filter(|n| !n.is_finite())?;
    let layer = m.layer_grad_norms.iter().position(|n| !n.is_finite());
    Some(match layer {
        Some(0) => format!(
            "the embedding's gradient norm is {} (the loss {:.4})",
            m.layer_grad_norms[0], m.loss
        ),
        Some(l) if l <= blocks => format!(
            "the gradient norm of block {} is {} (the loss {:.4})",
            l - 1,
            m.layer_grad_norms[l],
            m.loss
        ),
        Some(l) => format!(
            "the head's gradient norm is {} (the loss {:.4})",
            m.layer_grad_norms[l], m.loss
        ),
        None => format!("the gradient norm is {norm} (the loss {:.4})", m.loss),
    })
}

/// `--sample-every`'s sample at `step`: the prompt and what the model
/// writes after it, generated through the trainer's streamed forward from
/// the transport copies the step just wrote (nothing the next step reads
/// changes).
fn sample_at<E: Executor>(trainer: &Trainer<E>, p: &Prepared, step: u64) -> Result<String> {
    let opts = &p.opts;
    let prompt = sample_prompt(&p.encoder, opts)?;
    let sampling = SampleOptions {
        tokens: opts.sample_tokens,
        temperature: 0.8,
        top_k: 200,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        seed: opts.seed.wrapping_add(step),
        decodable: p.encoder.tokenizer.vocab_size(),
        kv_cache: true,
    };
    let ids = generate(trainer, &prompt, sampling)?;
    Ok(format!(
        "{}{}",
        opts.sample_prompt,
        p.encoder.tokenizer.decode(&ids)?
    ))
}

/// Whether a signal asked the run to stop ([`super::interrupt`]), decided
/// by every rank together so that all stop after the same step.
fn interrupted(dist: Option<&DistConfig>) -> Result<Option<i32>> {
    let local = super::interrupt::requested();
    let Some(d) = dist else { return Ok(local) };
    let mut x = [local.is_some() as u8 as f64, local.unwrap_or(0) as f64];
    d.comm.sum_f64(&mut x)?;
    Ok((x[0] > 0.0).then(|| local.unwrap_or((x[1] / x[0]).round() as i32)))
}

/// Where a run keeps its texts' token ids (`data/cache.rs`).
pub const TOKENS_DIR: &str = "tokens";

/// Parameters of every layer, for comparing runs bit for bit.
pub fn tier_params(tier: &HostTier) -> Vec<Vec<f32>> {
    tier.layers().iter().map(|s| s.params().to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_diverged_is_named_by_layer() {
        let m = |loss: f64, norms: &[f64]| StepMetrics {
            loss,
            grad_norm: Some(norms.iter().map(|x| x * x).sum::<f64>().sqrt()),
            layer_grad_norms: norms.to_vec(),
            ..StepMetrics::default()
        };
        assert_eq!(diverged(&m(2.0, &[1.0, 2.0, 3.0, 4.0]), 2), None);
        assert_eq!(
            diverged(&m(f64::NAN, &[1.0, 2.0, 3.0, 4.0]), 2).unwrap(),
            "the loss is NaN"
        );
        let inf = f64::INFINITY;
        assert_eq!(
            diverged(&m(2.0, &[inf, 2.0, 3.0, 4.0]), 2).unwrap(),
            "the embedding's gradient norm is inf (the loss 2.0000)"
        );
        assert_eq!(
            diverged(&m(2.0, &[1.0, 2.0, f64::NAN, inf]), 2).unwrap(),
            "the gradient norm of block 1 is NaN (the loss 2.0000)"
        );
        assert_eq!(
            diverged(&m(2.0, &[1.0, 2.0, 3.0, inf]), 2).unwrap(),
            "the head's gradient norm is inf (the loss 2.0000)"
        );
        // A norm with no layers' beside it.
        let clipped = StepMetrics {
            loss: 2.0,
            grad_norm: Some(inf),
            ..StepMetrics::default()
        };
        assert_eq!(
            diverged(&clipped, 2).unwrap(),
            "the gradient norm is inf (the loss 2.0000)"
        );
    }
}
