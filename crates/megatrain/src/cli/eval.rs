//! `megatrain eval`.

use std::path::PathBuf;

use clap::Args;
use megatrain::data::{Sampling, load_tokens, packed_once};
use megatrain::run::{
    DeviceChoice, Encoder, Pick, Precision, RowsKind, RunError, TransportKnobs, chat_template_spec,
    check_doc_end, evaluate, evaluate_batches, resolve_model_dir, stream_docs,
};
use megatrain::trainer::{Trainer, TrainerConfig, load_tier_for_forwards};
use megatrain_gpu::TransportChoice;
use megatrain_tensor::Executor;
use megatrain_zoo::HfCheckpoint;

use super::device::{self, on_executor};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// HF model directory, run directory (its latest checkpoint) or checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A run's checkpoint at this step, or `best` (the lowest validation
    /// loss), instead of the latest.
    #[arg(long)]
    step: Option<Pick>,
    /// Text, directory of .txt, .bin, .u32 or .jsonl (the loss counts responses only).
    #[arg(long)]
    data: PathBuf,
    /// Default: the model's context, at most 256.
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Batches to evaluate (default: the whole data once, in order).
    #[arg(long)]
    batches: Option<usize>,
    /// auto (one record a row for .jsonl, as `train` cuts them) | records |
    /// packed (as many whole records a row as fit, each scoring as it does
    /// alone: the same loss in fewer rows) | stream (windows of the
    /// concatenated tokens) | stream-docs (those windows, each record in
    /// one scoring on its own, as `train --rows stream-docs`).
    #[arg(long, default_value = "auto")]
    rows: RowsKind,
    /// With --rows stream-docs, of a source that is not .jsonl: the id that
    /// ends each document, as `train --doc-end` [default: the tokenizer's
    /// end-of-sequence id].
    #[arg(long)]
    doc_end: Option<u32>,
    /// Tokenizer: default the model directory's; char | byte | path to tokenizer.json.
    #[arg(long)]
    tokenizer: Option<String>,
    /// How .jsonl records become text, as `train --chat-template` (default:
    /// the run's, for a run's checkpoint; else auto).
    #[arg(long)]
    chat_template: Option<String>,
    /// auto | gpu | cpu.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// f32 | bf16 | f16, as `train --precision`: the weights go through
    /// that transport copy; f16 also computes matmuls on f16 operands.
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let dir = resolve_model_dir(&a.model, a.step)?;
    let ckpt = HfCheckpoint::open(&dir)?;
    let cfg = ckpt.config.clone();
    let mut enc = match a.tokenizer.as_deref() {
        None => Encoder::from_dir(&dir, Some(&cfg))?,
        Some(spec) => Encoder::choose(spec, Some(&dir), None, &[&a.data])?,
    };
    enc.vocab_limit = Some(cfg.vocab_size);
    let seq = a.seq_len.unwrap_or(cfg.max_position_embeddings.min(256));
    if seq == 0 || a.batch == 0 {
        return Err(RunError::option("seq-len/--batch", format!("{seq}/{}", a.batch), "must be ≥ 1").into());
    }
    cfg.check_seq_len(seq)
        .map_err(|e| RunError::option("seq-len", seq, e.to_string()))?;
    let spec = chat_template_spec(&dir, a.chat_template.as_deref());
    check_doc_end(a.rows, a.doc_end)?;
    let data = load_tokens(&a.data, &enc, &enc.chat_template(&spec)?)?;
    let records = a.rows.records_of(&a.data);
    let data = match records {
        _ if a.rows == RowsKind::StreamDocs => {
            stream_docs(data, records, a.doc_end, &enc, cfg.vocab_size, &a.data)?
        }
        true => data,
        false if a.rows.needs_records() => {
            return Err(RunError::option(
                "rows",
                a.rows.name(),
                format!("takes .jsonl records; {} holds no records", a.data.display()),
            )
            .into());
        }
        false => data.as_stream(),
    };
    // Packed, every record once in the rows it shares.
    let packed = matches!(a.rows, RowsKind::Packed).then(|| packed_once(&data, a.batch, seq));
    let whole = match (&packed, data.row_records()) {
        (Some(p), _) => p.len(),
        (None, Some(r)) => r.len().div_ceil(a.batch),
        (None, None) => (data.len().saturating_sub(1) / (a.batch * seq)).max(1),
    };
    let batches = a.batches.unwrap_or(whole);
    let exec = device::open(a.device, TransportChoice::Auto, TransportKnobs::default(), true)?;
    let tier = load_tier_for_forwards(&ckpt, a.precision.transport())?;
    // Its pages mapped while loading stay counted until it goes.
    drop(ckpt);
    let loss = on_executor!(exec, ex => {
        let mut ex = ex;
        ex.set_compute_precision(a.precision.compute())
            .map_err(|e| RunError::option("precision", a.precision, e.to_string()))?;
        let t = Trainer::new(ex, cfg.clone(), tier, TrainerConfig::default())?;
        match &packed {
            Some(p) => evaluate_batches(&t, &p[..batches.min(p.len())])?,
            None => evaluate(&t, &data, &a.data, a.batch, seq, batches, Sampling::Sequential)?,
        }
    });
    let rows = match (&packed, data.row_records()) {
        (Some(p), Some(r)) => {
            let rows: usize = p.iter().take(batches).map(|b| b.batch).sum();
            match batches >= p.len() {
                true => format!("{} records packed into {rows} rows", r.len()),
                false => format!("the first {rows} rows of {} records packed", r.len()),
            }
        }
        (_, Some(r)) => format!("{} records, one a row", r.len().min(batches * a.batch)),
        (_, None) if data.records.is_some() => "windows of the stream, each record on its own".into(),
        (_, None) => "windows of the stream".into(),
    };
    println!(
        "loss {loss:.6}  perplexity {:.4}  ({batches} batches of {}×{seq} tokens from {}: {rows})",
        loss.exp(),
        a.batch,
        a.data.display()
    );
    Ok(())
}
