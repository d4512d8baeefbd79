//! The training loop behind `megatrain train`: prepare (options, tokenizer,
//! model, data, resume state), then run steps with evaluation, metrics,
//! plot and checkpoints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use megatrain_adamw::AdamWConfig;
use megatrain_tensor::{Executor, TransportInfo};
use megatrain_tier::{HostTier, Shard, TierConfig, load_checkpoint};
use megatrain_zoo::{HfCheckpoint, ModelConfig, preset};
use serde_json::{Value, json};

use super::checkpoint::{
    Patience, TrainState, best_checkpoint, latest_checkpoint, note_best, prune_checkpoints, read_train_state,
    save_run_checkpoint,
};
use super::encoder::Encoder;
use super::error::{Result, RunError};
use super::generate::{SampleOptions, generate};
use super::keep::Room;
use super::knobs::TransportKnobs;
use super::metrics_log::MetricsLog;
use super::options::{RowsKind, SamplingKind, ShareTransport, TrainOptions};
use super::plan::PlanInput;
use super::plot::write_plot;
use crate::data::{
    Batch, ChatTemplate, Mix, Sampling, TokenData, draw_mix_rows, draw_rows, keep_in_cache,
    load_tokens_cached, split_validation,
};
use crate::dist::{Collective, DistConfig, Shared, share_transport};
use crate::trainer::{StepMetrics, Trainer, TrainerConfig, init_tier, load_tier, new_tier};

/// Mixed into the seed for validation batches, so they differ from the
/// training batches of the same index.
const EVAL_SEED_MIX: u64 = 0x5EED_0E7A_1000_0001;

/// Everything a run needs before the first allocation of the tier.
#[derive(Debug)]
pub struct Prepared {
    pub opts: TrainOptions,
    pub model: ModelConfig,
    pub encoder: Encoder,
    /// How `.jsonl` records become text (`opts.chat_template` resolved).
    pub template: ChatTemplate,
    /// The training sources, drawn from by weight.
    pub train: Mix,
    /// The validation set: `--val-data`, or each source's tail.
    pub val: Option<Mix>,
    /// Names of `train`'s and `val`'s parts, for errors.
    pub train_names: Vec<PathBuf>,
    pub val_names: Vec<PathBuf>,
    /// The checkpoint to resume from and its state.
    pub resume: Option<(PathBuf, TrainState)>,
    /// What the user should read before the run: settings that differ
    /// from the resumed run's, a checkpoint's parts left out, records cut
    /// to a row.
    pub warnings: Vec<String>,
}

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

fn option_diffs(old: &TrainOptions, new: &TrainOptions) -> Vec<String> {
    let (a, b) = (
        serde_json::to_value(old).expect("options serialise"),
        serde_json::to_value(new).expect("options serialise"),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return Vec::new();
    };
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v} in the run, {} now", b.get(k).unwrap_or(&Value::Null)))
        .collect()
}

/// What begins a warning of a setting a resumed run changes.
pub const RESUMED_WITH: &str = "resuming with a changed setting: ";

/// Loads and checks everything: a bad option, file, line or value is an
/// error that names it. With `resume`, the model and tokenizer come from
/// the run's latest checkpoint and `opts` must name the same model.
pub fn prepare(opts: TrainOptions, resume: bool) -> Result<Prepared> {
    opts.validate()?;
    let data_paths = opts.data.clone();
    let mut warnings = Vec::new();
    let (model, mut encoder, resume) = if resume {
        let ckpt = latest_checkpoint(&opts.out)?;
        let state = read_train_state(&ckpt)?;
        if (&state.options.model, &state.options.preset) != (&opts.model, &opts.preset) {
            return Err(RunError::Config(format!(
                "{}: the run trains {} but this command names {}",
                opts.out.display(),
                model_name(&state.options),
                model_name(&opts)
            )));
        }
        for key in ["vocab_size", "tokenizer"] {
            let (a, b) = (
                serde_json::to_value(&state.options).expect("ser")[key].clone(),
                serde_json::to_value(&opts).expect("ser")[key].clone(),
            );
            if a != b {
                return Err(RunError::option(
                    &key.replace('_', "-"),
                    b,
                    format!("the run was started with {a}; the model's shape cannot change on resume"),
                ));
            }
        }
        warnings = option_diffs(&state.options, &opts)
            .into_iter()
            // A device option (like `transport`) changes no result, nor
            // does another number of ranks with the same global batch.
            .filter(|w| {
                let key = w.split(':').next().unwrap_or_default();
                ![
                    "steps",
                    "out",
                    "keep_checkpoints",
                    "transport",
                    "ranks",
                    "spill_window",
                    "transfer_chunk",
                    "chunks_in_flight",
                    "carry_layers",
                    "keep_activations",
                    "share_transport",
                    "shm_dir",
                    "tensorboard",
                    "early_stop",
                ]
                .iter()
                .chain(&TransportKnobs::KEYS)
                .any(|k| *k == key)
            })
            .filter(|w| !w.starts_with("batch:") || state.options.global_batch() != opts.global_batch())
            .map(|w| format!("{RESUMED_WITH}{w}"))
            .collect();
        let model = ModelConfig::from_dir(&ckpt)?;
        let encoder = Encoder::from_dir(&ckpt, Some(&model))?;
        if encoder.kind() != state.tokenizer {
            return Err(RunError::file(
                &ckpt,
                format!("tokenizer files are missing (the run used '{}')", state.tokenizer),
            ));
        }
        (model, encoder, Some((ckpt, state)))
    } else {
        if opts.out.join(megatrain_tier::LATEST_FILE).exists() {
            return Err(RunError::option(
                "out",
                opts.out.display(),
                "already holds a run; continue it with --resume, or pick another --out",
            ));
        }
        let mut corpora: Vec<&Path> = data_paths.iter().map(PathBuf::as_path).collect();
        corpora.extend(opts.val_data.as_deref());
        let encoder = Encoder::choose(
            &opts.tokenizer,
            opts.model.as_deref(),
            opts.preset.as_deref(),
            &corpora,
        )?;
        let model = match (&opts.model, &opts.preset) {
            (Some(dir), _) => {
                let m = ModelConfig::from_dir(dir)?;
                if let Some(v) = opts.vocab_size
                    && v != m.vocab_size
                {
                    return Err(RunError::option(
                        "vocab-size",
                        v,
                        format!(
                            "{} has vocab_size {}; it cannot change",
                            dir.display(),
                            m.vocab_size
                        ),
                    ));
                }
                if let Some(class) = m.text_of {
                    warnings.push(format!(
                        "{} is a {class}: its text model trains alone (the vision tower and projector are not loaded), and checkpoints and exports hold that text model ({})",
                        dir.display(),
                        m.arch.hf_architecture()
                    ));
                }
                m
            }
            (None, Some(name)) => {
                let vocab = opts.vocab_size.or(match encoder.kind() {
                    "byte" if name == "gpt2-nano" => Some(256),
                    "byte" => None,
                    _ => Some(encoder.tokenizer.vocab_size()),
                });
                preset(name, vocab)?
            }
            (None, None) => unreachable!("validated"),
        };
        (model, encoder, None)
    };
    // Token files (.bin, .u32) hold ids already: the tokenizer only
    // decodes samples, so only text must fit the model's vocabulary.
    let is_bin = crate::data::is_token_file;
    let encodes_text =
        data_paths.iter().any(|d| !is_bin(d)) || opts.val_data.as_deref().is_some_and(|v| !is_bin(v));
    if encodes_text && encoder.tokenizer.vocab_size() > model.vocab_size {
        return Err(RunError::option(
            "tokenizer",
            &opts.tokenizer,
            format!(
                "has {} tokens, more than the model's vocabulary of {}",
                encoder.tokenizer.vocab_size(),
                model.vocab_size
            ),
        ));
    }
    model
        .check_seq_len(opts.seq_len)
        .map_err(|e| RunError::option("seq-len", opts.seq_len, e.to_string()))?;
    opts.keep_activations.blocks(model.num_layers)?;
    super::options::check_carry_layers(opts.carry_layers, &model)?;
    encoder.vocab_limit = Some(model.vocab_size);
    if opts.sample_every > 0 {
        sample_prompt(&encoder, &opts)?;
    }

    let template = encoder.chat_template(&opts.chat_template)?;
    // A text's ids are cached in the run directory, once it exists (a run
    // refused before it starts writes nothing): the next resume maps them.
    let cache = opts.out.is_dir().then(|| opts.out.join(TOKENS_DIR));
    // Rows of whole records where the option gives them to the source.
    let load = |path: &Path| {
        let d = load_tokens_cached(path, &encoder, &template, cache.as_deref())?;
        Ok::<_, RunError>(match (opts.rows.records_of(path), opts.rows) {
            (true, RowsKind::Packed) => d.packed_with(opts.packing.fit()),
            (true, RowsKind::StreamDocs) => d.windows(),
            (true, _) => d,
            (false, RowsKind::StreamDocs) => {
                let end = document_end(opts.doc_end, &encoder, model.vocab_size, path)?;
                d.as_stream().documents_ended_by(end)
            }
            (false, _) => d.as_stream(),
        })
    };
    // Each source, and its tail for validation where there is no
    // validation set of its own.
    let (mut train, mut val, mut train_names, mut val_names) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for path in &data_paths {
        let all = load(path)?;
        if opts.val_data.is_none() && opts.val_fraction > 0.0 {
            let (t, v) =
                split_validation(all, opts.val_fraction).map_err(|e| RunError::file(path, e.to_string()))?;
            train.push(t);
            val.push(v);
            val_names.push(PathBuf::from(format!(
                "{} (last {}%)",
                path.display(),
                opts.val_fraction * 100.0
            )));
        } else {
            train.push(all);
        }
        train_names.push(path.clone());
    }
    if let Some(vp) = &opts.val_data {
        val.push(load(vp)?);
        val_names.push(vp.clone());
    }
    let need = opts.seq_len + 1;
    let n_train = train.len();
    for (i, (d, name)) in train
        .iter()
        .zip(&train_names)
        .chain(val.iter().zip(&val_names))
        .enumerate()
    {
        if let Some(r) = d.row_records() {
            let cut = r.longer_than(need, d.len());
            if cut > 0 {
                warnings.push(format!(
                    "{}: {cut} of {} records are longer than --seq-len {} + 1 tokens: each is cut to its first {need} (--rows {})",
                    name.display(),
                    r.len(),
                    opts.seq_len,
                    opts.rows.name()
                ));
            }
            let silent = crate::data::silent_records(d, opts.seq_len);
            let why = format!(
                "{silent} of {} records have no token the loss counts in their first {need} (their responses start later)",
                r.len()
            );
            if silent > 0 && silent == r.len() && i < n_train {
                return Err(RunError::file(
                    name,
                    format!(
                        "{why}: a run on them would learn nothing; raise --seq-len or give --rows stream"
                    ),
                ));
            }
            if silent > 0 {
                warnings.push(format!("{}: {why}: their rows teach nothing", name.display()));
            }
        }
        // A row of a record is padded: a record of any length will do.
        let short = d.row_records().map_or(d.len() < need, |r| r.is_empty());
        if short {
            return Err(crate::data::DataError::TooShort {
                path: name.clone(),
                len: d.len(),
                seq_len: opts.seq_len,
            }
            .into());
        }
    }
    // Rows by the given weights, else by the parts' sizes (as one stream
    // would give them; `--val-data` is one part, whatever the weights).
    let weights = |parts: &[TokenData]| match opts.data_weights.as_slice() {
        given if given.len() == parts.len() => given.to_vec(),
        _ => parts.iter().map(|d| d.len() as f64).collect(),
    };
    let val = (!val.is_empty()).then(|| Mix {
        weights: weights(&val),
        parts: val,
    });
    let train = Mix {
        weights: weights(&train),
        parts: train,
    };
    Ok(Prepared {
        train_names,
        opts,
        model,
        encoder,
        template,
        train,
        val,
        val_names,
        resume,
        warnings,
    })
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

fn model_name(o: &TrainOptions) -> String {
    match (&o.model, &o.preset) {
        (Some(m), _) => format!("--model {}", m.display()),
        (None, Some(p)) => format!("--preset {p}"),
        (None, None) => "no model".into(),
    }
}

fn sampling(opts: &TrainOptions) -> Sampling {
    match opts.sampling {
        SamplingKind::Sequential => Sampling::Sequential,
        SamplingKind::Random => Sampling::Random { seed: opts.seed },
    }
}

/// Mean loss over `batches` validation batches (the same batches at every
/// evaluation, drawn from `seed`), with the trainer's streamed forward.
/// Rows of records in order count each record once: the batch that reaches
/// the last record holds no more rows than are left.
pub fn evaluate<E: Executor>(
    trainer: &Trainer<E>,
    data: &TokenData,
    name: &Path,
    batch: usize,
    seq_len: usize,
    batches: usize,
    sampling: Sampling,
) -> Result<f64> {
    let left = |i: u64| match (data.row_records(), sampling) {
        (Some(r), Sampling::Sequential) => r.len().saturating_sub(i as usize * batch).max(1),
        _ => batch,
    };
    let draw = |i, rows: std::ops::Range<usize>| {
        let rows = rows.start..rows.end.min(left(i));
        draw_rows(data, sampling, i, batch, rows, seq_len, name)
    };
    evaluate_split(trainer, draw, batch, batches, None)
}

/// [`evaluate`] of the rows `draw` gives (batch number, rows of it), split
/// across the ranks of `comm` when given: each evaluates its rows of the
/// global batch `batch` and the sums are added, so N ranks report what one
/// rank with the global batch would.
fn evaluate_split<E: Executor>(
    trainer: &Trainer<E>,
    draw: impl Fn(u64, std::ops::Range<usize>) -> std::result::Result<Batch, crate::data::DataError>,
    batch: usize,
    batches: usize,
    comm: Option<&dyn Collective>,
) -> Result<f64> {
    let (rank, ranks) = comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let per = batch / ranks;
    let rows = rank * per..(rank + 1) * per;
    let drawn = (0..batches as u64)
        .map(|i| draw(i, rows.clone()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut x = loss_sums(trainer, &drawn)?;
    if let Some(comm) = comm {
        comm.sum_f64(&mut x)?;
    }
    Ok(mean_loss(x))
}

/// The mean loss over the targets `batches` count (NaN where they count
/// none), as [`evaluate`] reports it, of batches drawn by the caller.
pub fn evaluate_batches<E: Executor>(trainer: &Trainer<E>, batches: &[Batch]) -> Result<f64> {
    Ok(mean_loss(loss_sums(trainer, batches)?))
}

/// The summed losses of `batches` and the targets they count.
fn loss_sums<E: Executor>(trainer: &Trainer<E>, batches: &[Batch]) -> Result<[f64; 2]> {
    let mut x = [0.0, 0.0];
    for (s, c) in trainer.eval_losses(batches)? {
        x[0] += s;
        x[1] += c as f64;
    }
    Ok(x)
}

fn mean_loss([sum, count]: [f64; 2]) -> f64 {
    if count > 0.0 { sum / count } else { f64::NAN }
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

/// The tier of rank `rank` of the run (a sharded optimizer's rank keeps
/// its share of p, m, v, and the budget counts that share).
pub fn tier_config(opts: &TrainOptions, rank: usize) -> TierConfig {
    TierConfig {
        transport: opts.precision.transport(),
        hold_grads: opts.grad_accum > 1 || opts.grad_clip > 0.0,
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
    std::fs::create_dir_all(out).map_err(RunError::io(out))?;
    let mut tcfg = tier_config(opts, rank);
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
        },
        &Room::of(ex.tensor_memory(), opts.ranks, opts.host_budget.is_some()),
    )?;
    let config = TrainerConfig {
        checkpoint_every: opts.checkpoint_every,
        chunk_rows,
        adamw: AdamWConfig {
            beta1: opts.beta1 as f32,
            beta2: opts.beta2 as f32,
            eps: opts.eps as f32,
            weight_decay: opts.weight_decay as f32,
        },
        grad_clip: (opts.grad_clip > 0.0).then_some(opts.grad_clip),
        optimizer_queue: 2,
        transfer_chunk: match opts.transfer_chunk {
            Some(b) => super::knobs::transfer_chunk_elems(b)?,
            None => crate::trainer::transfer_chunk_for(p.model.param_count() as u64),
        },
        chunks_in_flight: opts
            .chunks_in_flight
            .unwrap_or(TrainerConfig::default().chunks_in_flight),
        keep_activations: kept.blocks,
        carry_layers: opts.carry_layers,
        defer_clipped_updates: true,
        dropout: crate::trainer::TrainDropout {
            hidden: opts.dropout,
            attention: opts.attn_dropout,
            seed: opts.seed,
        },
        z_loss: opts.z_loss as f32,
    };
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
    progress.begin(start, opts.steps);
    let t0 = Instant::now();
    if start == 0
        && opts.eval_every > 0
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
        let due = |every: u64| (every > 0 && step.is_multiple_of(every)) || step == opts.steps;
        // A signal that came during the step skips its evaluation: the
        // checkpoint comes first (a machine's notice before it is taken back
        // may not leave time for both). One during the evaluation is seen
        // right after it.
        summary.interrupted = interrupted(dist.as_ref())?;
        let reads = summary.interrupted.is_none()
            && ((due(opts.eval_every) && p.val.is_some())
                || (lead && opts.sample_every > 0 && due(opts.sample_every)));
        if finite && (reads || step == end) {
            // The evaluation and the sample read every layer's parameters;
            // the run's last step leaves none of its updates behind.
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
        if lead && finite && summary.interrupted.is_none() && opts.sample_every > 0 && due(opts.sample_every)
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

/// The ids of `--sample-prompt`, refused where they are none or the
/// tokenizer cannot spell it (checked before the run starts).
/// The id that ends each document of `path`, a source without records, in
/// windows of `--rows stream-docs`: `given` (`--doc-end`), else the
/// tokenizer's end-of-sequence id; refused where there is neither or it is
/// past the vocabulary of `vocab`.
pub fn document_end(given: Option<u32>, encoder: &Encoder, vocab: usize, path: &Path) -> Result<u32> {
    use crate::data::TextEncoder;
    let id = given.or_else(|| encoder.eos()).ok_or_else(|| {
        RunError::file(
            path,
            "--rows stream-docs: no records here, and the tokenizer has no end-of-sequence id to end \
             documents: name the id that ends each with --doc-end ID",
        )
    })?;
    if id as usize >= vocab {
        return Err(RunError::option(
            "doc-end",
            id,
            format!("is past the model's vocabulary of {vocab}"),
        ));
    }
    Ok(id)
}

fn sample_prompt(encoder: &Encoder, opts: &TrainOptions) -> Result<Vec<u32>> {
    let bad = |why: String| RunError::option("sample-prompt", format!("{:?}", opts.sample_prompt), why);
    let ids = encoder
        .tokenizer
        .encode(&opts.sample_prompt)
        .map_err(|e| bad(e.to_string()))?;
    match ids.is_empty() {
        true => Err(bad("encodes to no tokens; give some text".into())),
        false => Ok(ids),
    }
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
