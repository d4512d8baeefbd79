//! Everything a run needs before its first step, checked: options (and a
//! resumed run's), tokenizer, model, data sources and their validation
//! split, each bad one an error that names it.

use std::path::{Path, PathBuf};

use megatrain_zoo::{ModelConfig, preset};
use serde_json::Value;

use super::checkpoint::{TrainState, latest_checkpoint, read_train_state};
use super::encoder::Encoder;
use super::error::{Result, RunError};
use super::knobs::TransportKnobs;
use super::options::{RowsKind, TrainOptions};
use super::session::TOKENS_DIR;
use crate::data::{ChatTemplate, Mix, TokenData, load_tokens_cached, split_validation};

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
    /// The rows of `opts.seq_len` one pass over `train` gives (an epoch;
    /// [`Mix::rows_per_pass`], a walk over packed records, done once).
    pub rows_per_pass: u64,
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
pub fn prepare(mut opts: TrainOptions, resume: bool) -> Result<Prepared> {
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
                    "epochs",
                    "out",
                    "keep_checkpoints",
                    "transport",
                    "ranks",
                    "spill_window",
                    "transfer_chunk",
                    "chunks_in_flight",
                    "carry_layers",
                    "carry_order",
                    "optimizer_queue",
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
    opts.carry_layers = super::options::check_carry_layers(opts.carry_layers, &model)?;
    super::options::check_freeze_layers(opts.freeze_layers, &model)?;
    if opts.dropout_from_config {
        let (hidden, attention) = config_dropout(&model, resume.is_some(), opts.model.as_deref())?;
        (opts.dropout, opts.attn_dropout, opts.dropout_from_config) = (hidden, attention, false);
        warnings.push(format!(
            "dropout from the model's config.json: {hidden} on the embedding's output and each residual \
             branch (--dropout), {attention} on the attention's probabilities (--attn-dropout)"
        ));
    }
    encoder.vocab_limit = Some(model.vocab_size);
    if !opts.sample_every.is_never() {
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
            (records, RowsKind::StreamDocs) => {
                stream_docs(d, records, opts.doc_end, &encoder, model.vocab_size, path)?
            }
            (true, _) => d,
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
    let seq_len = opts.seq_len;
    let rows_per_pass = train.rows_per_pass(seq_len);
    opts.resolve_steps(rows_per_pass)?;
    if opts.warmup >= opts.steps && opts.lr > 0.0 {
        warnings.push(format!(
            "--warmup {} is not shorter than the run's {} steps: the learning rate rises for the whole run \
             and never reaches --lr {} (give a shorter --warmup, or --warmup-ratio)",
            opts.warmup, opts.steps, opts.lr
        ));
    }
    Ok(Prepared {
        rows_per_pass,
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

fn model_name(o: &TrainOptions) -> String {
    match (&o.model, &o.preset) {
        (Some(m), _) => format!("--model {}", m.display()),
        (None, Some(p)) => format!("--preset {p}"),
        (None, None) => "no model".into(),
    }
}

/// `d`, loaded from `path`, in windows of `--rows stream-docs`: its
/// `records` where it has them, else the documents that `given`
/// (`--doc-end`), or the tokenizer's end-of-sequence id, ends; refused
/// where there is neither or the id is past the vocabulary of `vocab`.
pub fn stream_docs(
    d: TokenData,
    records: bool,
    given: Option<u32>,
    encoder: &Encoder,
    vocab: usize,
    path: &Path,
) -> Result<TokenData> {
    if records {
        return Ok(d.windows());
    }
    let end = document_end(given, encoder, vocab, path)?;
    Ok(d.as_stream().documents_ended_by(end))
}

/// The id that ends each document of `path`, a source without records:
/// `given`, else the tokenizer's end-of-sequence id.
fn document_end(given: Option<u32>, encoder: &Encoder, vocab: usize, path: &Path) -> Result<u32> {
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

/// The ids of `--sample-prompt`, refused where they are none or the
/// tokenizer cannot spell it (checked before the run starts).
pub(super) fn sample_prompt(encoder: &Encoder, opts: &TrainOptions) -> Result<Vec<u32>> {
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

/// `--dropout-from-config`'s rates, from the `config.json` in `dir` (a
/// fresh run's model; none on `resume`, whose run keeps its rates).
fn config_dropout(model: &ModelConfig, resume: bool, dir: Option<&Path>) -> Result<(f64, f64)> {
    if resume {
        return Err(RunError::option(
            "dropout-from-config",
            true,
            "a resumed run keeps its dropout (name --dropout and --attn-dropout to change it)",
        ));
    }
    let file = || {
        dir.map_or("the preset's generated config".into(), |d| {
            d.join("config.json").display().to_string()
        })
    };
    let (hidden, attention) = model
        .hf_dropout()
        .map_err(|e| RunError::option("dropout-from-config", true, format!("{}: {e}", file())))?;
    for (key, p) in [("hidden", hidden), ("attention", attention)] {
        if !(0.0..=megatrain_tensor::MAX_DROPOUT).contains(&p) {
            return Err(RunError::option(
                "dropout-from-config",
                true,
                format!(
                    "{}: its {key} dropout {p} is outside [0, {}]",
                    file(),
                    megatrain_tensor::MAX_DROPOUT
                ),
            ));
        }
    }
    Ok((hidden, attention))
}
