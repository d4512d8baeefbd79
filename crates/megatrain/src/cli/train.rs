//! `megatrain train`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use megatrain::data::packed_padding_share;
use megatrain::dist::{Collective, DistConfig};
use megatrain::run::{
    DeviceChoice, Every, KeepActivations, Packing, Precision, RowsKind, SamplingKind, Schedule,
    ShareTransport, TrainOptions, TransportKnobs, interrupt, latest_checkpoint, prepare, read_train_state,
    train_with,
};
use megatrain::trainer::CarryOrder;
use megatrain_gpu::TransportChoice;

use super::device::{self, on_executor};
use super::progress::CliProgress;

#[derive(Args, Debug, Default)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// Hugging Face model directory to fine-tune (config.json + safetensors).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Preset to train from scratch: gpt2-nano, gpt2-124m, llama-tiny, tinyllama-1.1b, ...
    #[arg(long)]
    preset: Option<String>,
    /// Text file, directory of .txt, nanoGPT .bin (u16 tokens), .u32 (u32 tokens), or alpaca/sharegpt/chat .jsonl.
    /// Give it several times to train on a mixture (see --data-weights).
    #[arg(long)]
    data: Vec<PathBuf>,
    /// With several --data: each source's share of the rows, e.g. 3,1
    /// (default: by their sizes, as if they were one stream).
    #[arg(long, value_delimiter = ',')]
    data_weights: Option<Vec<f64>>,
    /// Validation data (default: the last --val-fraction of --data).
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// The share of --data held out for validation when no --val-data is given [default: 0.1].
    #[arg(long)]
    val_fraction: Option<f64>,
    /// auto | char | byte | path to tokenizer.json.
    #[arg(long)]
    tokenizer: Option<String>,
    /// How .jsonl records become text: auto (the tokenizer's own chat template
    /// where it ships one, else alpaca) | alpaca | path to a Jinja file or a
    /// tokenizer_config.json [default: auto].
    #[arg(long)]
    chat_template: Option<String>,
    /// A preset's vocabulary (default: the tokenizer's; for nanoGPT .bin data without a
    /// tokenizer, the largest token + 1).
    #[arg(long)]
    vocab_size: Option<usize>,
    /// Tokens per row, T [default: 256].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Rows per micro-batch on each rank, B [default: 12].
    #[arg(long)]
    batch: Option<usize>,
    /// Micro-batches summed into each step (tokens per step: ranks × grad-accum × B × T) [default: 1].
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Optimizer steps of the run; with --resume, where the resumed run ends [default: 5000].
    #[arg(long, conflicts_with = "epochs")]
    steps: Option<u64>,
    /// Instead of --steps: passes over the training data (e.g. 3, or 0.5).
    /// The steps are ⌈E × rows of one pass ÷ rows a step⌉, a pass being a
    /// row a record, the rows --rows packed makes of them, or the stream's
    /// windows of --seq-len, over every --data source; the schedule ends
    /// with the last pass.
    #[arg(long)]
    epochs: Option<f64>,
    /// Peak learning rate, reached after --warmup [default: 1e-3].
    #[arg(long)]
    lr: Option<f64>,
    /// Default lr / 10.
    #[arg(long)]
    min_lr: Option<f64>,
    /// Steps of linear warmup from 0 to --lr [default: 100].
    #[arg(long, conflicts_with = "warmup_ratio")]
    warmup: Option<u64>,
    /// Instead of --warmup: its share of the run's steps, ⌈R × steps⌉
    /// (transformers' warmup_ratio; with --epochs, of the steps the passes
    /// take).
    #[arg(long)]
    warmup_ratio: Option<f64>,
    /// The learning rate after --warmup: cosine (the default) | linear |
    /// constant | wsd (held at --lr, then straight down over the last
    /// --cooldown steps) | wsd-sqrt (the same, its decay shaped 1 − √t).
    #[arg(long)]
    schedule: Option<Schedule>,
    /// Step where the decay reaches min-lr (default: --steps).
    #[arg(long)]
    decay_steps: Option<u64>,
    /// wsd and wsd-sqrt: the decay's steps, the last before --decay-steps
    /// (default: a fifth of them).
    #[arg(long)]
    cooldown: Option<u64>,
    /// AdamW's β1 [default: 0.9].
    #[arg(long)]
    beta1: Option<f64>,
    /// AdamW's β2 [default: 0.95].
    #[arg(long)]
    beta2: Option<f64>,
    /// AdamW's ε [default: 1e-8].
    #[arg(long)]
    eps: Option<f64>,
    /// Applied to matrices and embeddings, not to norm gains or biases.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Dropout on the embedding's output and each residual branch's
    /// (nanoGPT's --dropout; default 0: off). Evaluation and sampling never
    /// drop.
    #[arg(long)]
    dropout: Option<f64>,
    /// Dropout on the attention's probabilities (GPT-2's attn_pdrop;
    /// default 0: off). nanoGPT's --dropout is both this and --dropout.
    #[arg(long)]
    attn_dropout: Option<f64>,
    /// Take --dropout and --attn-dropout from the model's config.json, as
    /// transformers trains it (GPT-2's embd_pdrop/resid_pdrop and
    /// attn_pdrop, the Llama family's attention_dropout); not with either
    /// flag, nor on --resume (a run keeps its rates).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    dropout_from_config: Option<bool>,
    /// PaLM's z-loss: add Z·lse² per target (lse the log-sum-exp of its
    /// logits) to the loss the gradient is of, keeping the softmax's
    /// normaliser near 1 (PaLM: 1e-4); logged as z_loss [default: 0, off].
    #[arg(long)]
    z_loss: Option<f64>,
    /// Label smoothing: train against (1 − E)·onehot + E/V instead of the
    /// one-hot target, as transformers' label_smoothing_factor; the
    /// smoothed mean is logged as smoothed_loss, while loss stays the plain
    /// cross-entropy that evaluation reports [default: 0, off].
    #[arg(long)]
    label_smoothing: Option<f64>,
    /// NEFTune (instruction tuning): add uniform noise of magnitude
    /// A / √(T·C) to the embedding's lookup in training, as transformers'
    /// neftune_noise_alpha (the paper's runs use 5); drawn from the run's
    /// seed like dropout's masks, never in evaluation or sampling
    /// [default: 0, off].
    #[arg(long)]
    neftune_alpha: Option<f64>,
    /// Train all but the first N layers (the embedding, then blocks; at
    /// most all but the head): the backward ends at the first trained
    /// layer, and the frozen ones keep their weights [default: 0]. A tied
    /// head's matrix is the embedding's, frozen with it.
    #[arg(long)]
    freeze_layers: Option<usize>,
    /// Exact global-norm gradient clipping (0 = off, the default; > 0 holds
    /// gradients, on the host or with --carry-layers on the device, and
    /// runs each layer's update in the next step's forward).
    #[arg(long)]
    grad_clip: Option<f64>,
    /// f32 | bf16 | f16: the transport copy (master weights and moments are
    /// always fp32); f16 also computes matmuls on f16 operands (per-tensor
    /// power-of-two scaling, f32 accumulation).
    #[arg(long)]
    precision: Option<Precision>,
    /// Keep every K-th block input; backward recomputes K blocks at a time.
    #[arg(long)]
    checkpoint_every: Option<usize>,
    /// The last N blocks (`all`, or `auto`: as many as `megatrain plan`
    /// estimates fit in 80 % of the GPU's memory, or half the host's
    /// available memory where the tensors live there) keep their weights and
    /// activations from forward to backward, which then uploads and
    /// recomputes only the others: a quarter less of their compute and one
    /// crossing of the bus, for that memory. Changes no result [default:
    /// auto].
    #[arg(long)]
    keep_activations: Option<KeepActivations>,
    /// Rows of the LM head at once (default: at least 256, more while
    /// their logits fit 64 MiB of host memory or 1 GiB of a GPU's; a
    /// 65-token vocabulary runs in one chunk).
    #[arg(long)]
    chunk_rows: Option<usize>,
    /// auto | gpu | cpu.
    #[arg(long)]
    device: Option<DeviceChoice>,
    /// auto | staging | mapped: how the GPU moves layers (auto measures both at start).
    #[arg(long)]
    transport: Option<TransportChoice>,
    /// Most gradient bytes (f32) moved down and staged at once, e.g. 16M
    /// (default 4 bytes per 512 parameters, between 4M and 32M); larger
    /// layers come down in chunks. Changes no result.
    #[arg(long, value_parser = super::parse_bytes)]
    transfer_chunk: Option<u64>,
    /// Chunks of a layer's gradients coming down at once (default 0: all of
    /// a block's, about a block of f32 gradients on the host; 2 holds six
    /// chunks, and the device waits longer). Changes no result.
    #[arg(long)]
    chunks_in_flight: Option<usize>,
    /// Gradient chunks that may wait for the CPU AdamW before the backward
    /// waits for it (default 2; 1-4096): each holds one chunk in host
    /// memory. Where the optimizer is slower than the backward (a 7B model
    /// at 8×1024 tokens: 16 took an H200 step 4 % faster) more let it fall
    /// behind without stalling the GPU. Changes no result.
    #[arg(long)]
    optimizer_queue: Option<usize>,
    /// The first N layers (embedding, then blocks; `all`: every one) keep
    /// their gradients on the device at a step's end, and the next step's
    /// forward runs their AdamW just before loading each, instead of the
    /// device idling while the host finishes the updates after backward
    /// (default 0: off; not with ranks; with --host-budget, only layers
    /// the tier keeps in RAM). Costs their f32
    /// gradients in device memory; with --grad-clip or --grad-accum the
    /// host then holds none of theirs. Changes no result (with --grad-clip,
    /// the coefficient within its last bits: their norm is the device's).
    #[arg(long, value_parser = megatrain::run::parse_carry_layers)]
    carry_layers: Option<usize>,
    /// Which layers --carry-layers are: `first` (the default: the
    /// embedding, then the blocks in order) or `spread` (blocks evenly
    /// spaced, the last one carried and the first not: with 28 blocks and
    /// 14 carried, every other one). Where a block's AdamW takes longer
    /// than its forward, the first layers carried make the forward wait
    /// for each update, while spread blocks are updated as the device runs
    /// the blocks between them (`megatrain plan` prints both). Not with
    /// --grad-clip.
    #[arg(long)]
    carry_order: Option<CarryOrder>,
    #[command(flatten)]
    knobs: TransportKnobs,
    /// Seeds the initial weights of a preset, the random sampling of rows, dropout and samples [default: 1337].
    #[arg(long)]
    seed: Option<u64>,
    /// random | sequential.
    #[arg(long)]
    sampling: Option<SamplingKind>,
    /// How a batch's rows are cut: auto (the default: one record a row for
    /// .jsonl sources, windows of the stream for the others) | records
    /// (every source .jsonl) | packed (every source .jsonl: as many whole
    /// records a row as fit, each attending only to itself) | stream |
    /// stream-docs (windows of the stream, each record of a .jsonl, or
    /// document another source's --doc-end ends, attending only to
    /// itself; no padding, none cut).
    #[arg(long)]
    rows: Option<RowsKind>,
    /// With --rows packed: best-fit (the default: the drawn order in
    /// windows of 1024 records, each packed best fit decreasing, far less
    /// padding) | next-fit (each row the next records that fit).
    #[arg(long)]
    packing: Option<Packing>,
    /// With --rows stream-docs, of a source that is not .jsonl (a token
    /// file, a text): the id that ends each document, as nanoGPT's and
    /// llm.c's prepared corpora put GPT-2's <|endoftext|> (50256) after
    /// each [default: the tokenizer's end-of-sequence id].
    #[arg(long)]
    doc_end: Option<u32>,
    /// Draw the data N micro-batches further on than step × grad-accum:
    /// with --resume from a checkpoint before a loss spike, skips the
    /// batches around it (PaLM's remedy); later resumes keep the offset
    /// [default: 0].
    #[arg(long)]
    skip_batches: Option<u64>,
    /// Evaluate on the validation data at the start, every N steps and at
    /// the end (0: only at the end; `epoch`: in the step that ends each
    /// pass over the training data) [default: 250].
    #[arg(long)]
    eval_every: Option<Every>,
    /// Stop once N evaluations in a row have not lowered the best
    /// validation loss so far, saving that step (`best` names the lowest)
    /// [default: 0, never].
    #[arg(long)]
    early_stop: Option<u64>,
    /// Micro-batches of validation data per evaluation [default: 20].
    #[arg(long)]
    eval_batches: Option<usize>,
    /// Print (and log in metrics.jsonl) a sample every N steps and at the
    /// end: the model writing after --sample-prompt between steps, through
    /// its streamed forward (0: never; `epoch`: in the step that ends each
    /// pass over the training data) [default: 0].
    #[arg(long)]
    sample_every: Option<Every>,
    /// The text samples start from [default: a newline].
    #[arg(long)]
    sample_prompt: Option<String>,
    /// Tokens a sample adds [default: 200].
    #[arg(long)]
    sample_tokens: Option<usize>,
    /// Save a checkpoint every N steps and at the end (0: only at the end;
    /// `epoch`: in the step that ends each pass over the training data)
    /// [default: 500].
    #[arg(long)]
    save_every: Option<Every>,
    /// Keep only the newest N checkpoints, removing older ones after each
    /// save (0: keep all) [default: 0].
    #[arg(long)]
    keep_checkpoints: Option<u64>,
    /// A plain progress line every N steps when the output is not a terminal [default: 10].
    #[arg(long)]
    log_every: Option<u64>,
    /// Also log what metrics.jsonl holds to a TensorBoard event file in
    /// --out (`tensorboard --logdir OUT`); `--tensorboard false` stops it
    /// on a resume.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    tensorboard: Option<bool>,
    /// Run directory (checkpoints, metrics.jsonl, loss.svg).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Under mpirun: each rank updates only its 1/N of every layer's p, m, v
    /// (ZeRO-1/2) instead of all of it (true | false).
    #[arg(long)]
    shard_optimizer: Option<bool>,
    /// Under mpirun: the ranks of a machine map one transport copy (in
    /// --shm-dir) instead of holding one each: auto (where it can be done,
    /// saying why not otherwise), true (or stop), false [default: auto].
    #[arg(long)]
    share_transport: Option<ShareTransport>,
    /// Memory filesystem for the transport copies a machine's ranks share
    /// [default: /dev/shm].
    #[arg(long)]
    shm_dir: Option<PathBuf>,
    /// Host RAM for the tier (e.g. 20G); layers past it spill to <out>/spill.
    #[arg(long, value_parser = super::parse_bytes)]
    host_budget: Option<u64>,
    /// RAM for reading spilled layers ahead of the optimizer and writing
    /// them behind (e.g. 2G; default 384M). Larger hides more of the disk.
    #[arg(long, value_parser = super::parse_bytes)]
    spill_window: Option<u64>,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// TOML file with the same keys (flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// No progress bar; only evaluations, saves and the summary.
    #[arg(long, short)]
    quiet: bool,
}

macro_rules! overlay {
    ($opts:ident, $args:ident, $($f:ident),+ $(,)?) => {
        $(if let Some(v) = $args.$f.clone() { $opts.$f = v; })+
    };
}
macro_rules! overlay_opt {
    ($opts:ident, $args:ident, $($f:ident),+ $(,)?) => {
        $(if let Some(v) = $args.$f.clone() { $opts.$f = Some(v); })+
    };
}

/// Options: the resumed run's (or the defaults), then the config file,
/// then the flags.
pub fn options(a: &TrainArgs) -> anyhow::Result<TrainOptions> {
    let mut o = match &a.resume {
        Some(run) => read_train_state(&latest_checkpoint(run)?)?.options,
        None => TrainOptions::default(),
    };
    if let Some(path) = &a.config {
        let text = std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?;
        o = o.overlay_toml(&text, path)?;
    }
    overlay_opt!(
        o,
        a,
        model,
        preset,
        epochs,
        warmup_ratio,
        val_data,
        vocab_size,
        min_lr,
        decay_steps,
        cooldown,
        host_budget,
        spill_window,
        transfer_chunk,
        chunks_in_flight,
        optimizer_queue,
        chunk_rows,
        doc_end
    );
    if !a.data.is_empty() {
        o.data = a.data.clone();
    }
    // --steps on a run (or a config file) that counted epochs counts steps.
    if a.steps.is_some() {
        o.epochs = None;
    }
    if a.warmup.is_some() {
        o.warmup_ratio = None;
    }
    overlay!(
        o,
        a,
        data_weights,
        val_fraction,
        tokenizer,
        chat_template,
        seq_len,
        batch,
        grad_accum,
        steps,
        lr,
        warmup,
        schedule,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_clip,
        dropout,
        attn_dropout,
        dropout_from_config,
        z_loss,
        label_smoothing,
        neftune_alpha,
        freeze_layers,
        precision,
        checkpoint_every,
        keep_activations,
        device,
        transport,
        seed,
        sampling,
        rows,
        packing,
        eval_every,
        skip_batches,
        early_stop,
        eval_batches,
        sample_every,
        sample_prompt,
        sample_tokens,
        save_every,
        keep_checkpoints,
        carry_layers,
        carry_order,
        log_every,
        tensorboard,
        out,
        shard_optimizer,
        share_transport,
        shm_dir,
    );
    o.knobs = o.knobs.overridden_by(a.knobs);
    if let Some(run) = &a.resume {
        o.out = run.clone();
    }
    Ok(o)
}

/// Under an MPI launcher: one rank of a data parallel run. A failure on any
/// rank ends every rank (MPI abort), so none waits in a collective for a
/// rank that is gone; the last checkpoint stays the current one.
pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let Some(comm) = super::dist::join()? else {
        return run_on(a, None);
    };
    let (rank, size) = (comm.rank(), comm.size());
    match run_on(a, Some(comm.clone())) {
        Ok(()) => Ok(()),
        // Every rank stopped after the same step; rank 0 saved it.
        Err(e) if e.is::<Interrupted>() => Err(e),
        Err(e) => {
            eprintln!("error: rank {rank} of {size}: {e:#}");
            comm.abort(1)
        }
    }
}

fn run_on(mut a: TrainArgs, comm: Option<Arc<dyn Collective>>) -> anyhow::Result<()> {
    let (rank, ranks) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    // Only rank 0 talks; the others report errors.
    a.quiet |= rank != 0;
    let opts = options(&a)?;
    // A fresh run's --batch is per rank; a resumed run keeps its global
    // batch unless --batch is given.
    let batch_given = a.resume.is_none() || a.batch.is_some();
    let opts = opts.on_ranks(ranks, batch_given)?;
    let mut p = prepare(opts, a.resume.is_some())?;
    if !a.quiet {
        for w in &p.warnings {
            eprintln!("warning: {w}");
        }
    }
    let o = &p.opts.clone();
    let n_params: usize = p.model.layer_tables().iter().map(|t| t.numel()).sum();
    // A mixture of experts: how many, how many a token, what it reads.
    let experts = p.model.moe.as_ref().map_or(String::new(), |m| {
        format!(
            ", {} experts, {} a token: {:.2}M read per token",
            m.num_experts,
            m.top_k,
            p.model.active_param_count() as f64 / 1e6
        )
    });
    if !a.quiet {
        eprintln!(
            "model: {} ({:?}, {} layers, width {}, vocab {}, {:.2}M parameters{experts}); tokenizer: {}",
            o.model
                .as_ref()
                .map(|m| m.display().to_string())
                .or(o.preset.clone())
                .unwrap_or_default(),
            p.model.arch,
            p.model.num_layers,
            p.model.hidden_size,
            p.model.vocab_size,
            n_params as f64 / 1e6,
            p.encoder.kind()
        );
        if ranks > 1 {
            eprintln!(
                "data parallel: {ranks} ranks × batch {} = global batch {}; optimizer {}",
                o.batch,
                o.global_batch(),
                if o.shard_optimizer {
                    "sharded (each rank owns 1/N of p, m, v)"
                } else {
                    "replicated"
                }
            );
        }
        let pass = p.rows_per_pass;
        let epochs = match o.epochs {
            Some(e) => format!(" (--epochs {e}: a pass is {pass} rows)"),
            None => {
                let rows = o.steps as f64 * (o.global_batch() * o.grad_accum) as f64;
                format!(" ({:.2} passes of {pass} rows)", rows / pass.max(1) as f64)
            }
        };
        eprintln!(
            "data: {} train tokens{}; {} step{}{epochs} of {}×{}×{} tokens per rank; run directory {}",
            p.train.len(),
            p.val
                .as_ref()
                .map(|v| format!(", {} validation tokens", v.len()))
                .unwrap_or_default(),
            o.steps,
            if o.steps == 1 { "" } else { "s" },
            o.grad_accum,
            o.batch,
            o.seq_len,
            o.out.display()
        );
        for (name, part) in p.train_names.iter().zip(&p.train.parts) {
            match &part.records {
                Some(r) if r.is_packed() => eprintln!(
                    "  {}: {} records, as many a row as fit ({}): {:.0}% of the rows is padding (one a row: {:.0}%)",
                    name.display(),
                    r.len(),
                    o.packing.name(),
                    100.0 * packed_padding_share(r, part.len(), o.seq_len),
                    100.0 * r.padding_share(part.len(), o.seq_len)
                ),
                Some(r) if r.is_windows() => eprintln!(
                    "  {}: {} records in windows of the stream, each on its own: no padding, {:.1} records a row on average",
                    name.display(),
                    r.len(),
                    (r.len() * o.seq_len) as f64 / part.len().max(1) as f64
                ),
                Some(r) => eprintln!(
                    "  {}: {} records, one a row: {:.0}% of a row is padding on average (--rows packed packs them)",
                    name.display(),
                    r.len(),
                    100.0 * r.padding_share(part.len(), o.seq_len)
                ),
                None => {}
            }
        }
        if p.train.parts.len() > 1 {
            let total: f64 = p.train.weights.iter().sum();
            for ((name, part), w) in p.train_names.iter().zip(&p.train.parts).zip(&p.train.weights) {
                eprintln!(
                    "  {}: {} train tokens, {:.1}% of the rows",
                    name.display(),
                    part.len(),
                    100.0 * w / total
                );
            }
        }
        if let Some((ckpt, s)) = &p.resume {
            eprintln!("resuming from {} (step {})", ckpt.display(), s.step);
        }
    }
    let exec = device::open(o.device, o.transport, o.knobs, a.quiet)?;
    let mut progress = CliProgress::new(o.steps, o.log_every, a.quiet);
    let dist = comm.map(|comm| DistConfig {
        comm,
        shard_optimizer: o.shard_optimizer,
        shared: None,
    });
    interrupt::install();
    let summary = on_executor!(exec, ex => train_with(ex, &mut p, None, &mut progress, dist))?;
    if let Some(signal) = summary.interrupted {
        if rank == 0 {
            eprintln!(
                "interrupted by {} after step {}: checkpoint {}; continue with `megatrain train --resume {}`",
                interrupt::signal_name(signal),
                summary.step,
                summary
                    .checkpoint
                    .as_ref()
                    .map_or("none".into(), |c| c.display().to_string()),
                o.out.display()
            );
        }
        return Err(Interrupted(signal).into());
    }
    if rank != 0 {
        return Ok(());
    }
    let val = summary
        .val_loss
        .map(|v| format!(", validation loss {v:.4}"))
        .unwrap_or_default();
    if let Some(p) = summary.stopped_early {
        println!(
            "stopped early at step {}: {} evaluations without a validation loss below {:.4} (--early-stop {})",
            summary.step, p.since, p.best, o.early_stop
        );
    }
    let best = match &summary.best {
        Some((dir, v)) if summary.checkpoint.as_ref() != Some(dir) => {
            format!("; best {} (validation loss {v:.4})", dir.display())
        }
        _ => String::new(),
    };
    println!(
        "done: step {}, loss {}{val}, {} tokens in {:.1} s; checkpoint {}{best}",
        summary.step,
        summary
            .loss
            .map(|l| format!("{l:.4}"))
            .unwrap_or_else(|| "-".into()),
        summary.tokens,
        summary.train_s,
        summary
            .checkpoint
            .map(|c| c.display().to_string())
            .unwrap_or_else(|| "none".into())
    );
    Ok(())
}

/// A run a signal ended after saving its last step: the process exits with
/// 128 + the signal, as a shell reports a process the signal ended.
#[derive(Debug)]
pub struct Interrupted(pub i32);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", interrupt::signal_name(self.0))
    }
}

impl std::error::Error for Interrupted {}
