//! Every `megatrain train` setting, with its default. A `--config` TOML
//! file holds the same keys (`seq_len` or `seq-len`); flags override it.

use std::path::{Path, PathBuf};

use megatrain_gpu::TransportChoice;
use megatrain_tensor::ComputePrecision;
use megatrain_tier::TransportDType;
use serde::{Deserialize, Serialize};

use super::error::{Result, RunError};
use super::every::{Every, Passes};
use super::keep::KeepActivations;
use super::knobs::{TransportKnobs, transfer_chunk_elems};
use crate::schedule::ScheduleKind;
use crate::trainer::CarryOrder;

/// Most `--chunks-in-flight`: each is a host buffer of a transfer chunk.
pub const MAX_CHUNKS_IN_FLIGHT: usize = 4096;

/// Most `--optimizer-queue`: each is a host buffer of a transfer chunk.
pub const MAX_OPTIMIZER_QUEUE: usize = 4096;

/// What travels to the executor and what its matmuls compute in; master
/// weights and AdamW moments are fp32 whatever it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 transport, f32 compute.
    #[default]
    F32,
    /// bf16 transport, f32 compute.
    Bf16,
    /// f16 transport; matmul operands f16 (per-tensor power-of-two
    /// scaling), f32 accumulation.
    F16,
}

impl Precision {
    pub fn transport(self) -> TransportDType {
        match self {
            Precision::F32 => TransportDType::F32,
            Precision::Bf16 => TransportDType::BF16,
            Precision::F16 => TransportDType::F16,
        }
    }

    pub fn compute(self) -> ComputePrecision {
        match self {
            Precision::F32 | Precision::Bf16 => ComputePrecision::F32,
            Precision::F16 => ComputePrecision::F16,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// A hardware GPU adapter if there is one, else the CPU (with a warning).
    #[default]
    Auto,
    /// Any GPU adapter, software ones (lavapipe) included.
    Gpu,
    Cpu,
}

/// Whether the ranks of a machine map one transport copy (see
/// `dist::machines`). A config file may also say `true` or `false` as
/// booleans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ShareTransport {
    /// Where it can be done: otherwise (no room in `--shm-dir`, a rank
    /// that cannot open the file, machines with unequal numbers of ranks)
    /// every rank holds a copy, and the run says why at start.
    #[default]
    Auto,
    /// Always: a run where it cannot be done stops with the reason.
    True,
    /// Never: every rank holds a copy.
    False,
}

impl<'de> Deserialize<'de> for ShareTransport {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            Flag(bool),
            Name(String),
        }
        match Given::deserialize(d)? {
            Given::Flag(true) => Ok(ShareTransport::True),
            Given::Flag(false) => Ok(ShareTransport::False),
            Given::Name(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SamplingKind {
    #[default]
    Random,
    Sequential,
}

/// How the rows of a batch are cut from the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RowsKind {
    /// Records for `.jsonl` sources, windows for the others.
    #[default]
    Auto,
    /// Windows of each source's concatenated stream.
    Stream,
    /// One `.jsonl` record a row, from its first token, right-padded.
    Records,
    /// As many whole `.jsonl` records a row as fit, each attending and
    /// counting positions on its own (`Docs`), the row right-padded.
    Packed,
    /// Windows of the concatenated `.jsonl` records, as `Stream`, each
    /// record in a window attending and counting positions on its own
    /// (`Docs`) and its last token predicting nothing
    /// (`Records::windows`): no padding and no record cut short. Of
    /// another source, the documents its end-of-text id ends
    /// (`TrainOptions::doc_end`).
    #[serde(rename = "stream-docs")]
    StreamDocs,
}

impl RowsKind {
    /// Whether rows of the source at `path` are whole records.
    pub fn records_of(self, path: &Path) -> bool {
        let jsonl = !path.is_dir() && path.extension().is_some_and(|e| e == "jsonl");
        match self {
            RowsKind::Auto | RowsKind::Records | RowsKind::Packed | RowsKind::StreamDocs => jsonl,
            RowsKind::Stream => false,
        }
    }

    /// The option's value as `--rows` takes it.
    pub fn name(self) -> &'static str {
        match self {
            RowsKind::Auto => "auto",
            RowsKind::Stream => "stream",
            RowsKind::Records => "records",
            RowsKind::Packed => "packed",
            RowsKind::StreamDocs => "stream-docs",
        }
    }

    /// Whether only `.jsonl` sources (which have records) may be given.
    pub fn needs_records(self) -> bool {
        matches!(self, RowsKind::Records | RowsKind::Packed)
    }
}

fn stream_rows() -> RowsKind {
    RowsKind::Stream
}

/// How `--rows packed` fills a run's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Packing {
    /// The drawn order in windows of 1024 records, each packed best fit
    /// decreasing: far less padding ([`crate::data::Fit::Best`]).
    #[default]
    BestFit,
    /// Each row the next records of the drawn order that fit.
    NextFit,
}

impl Packing {
    /// The option's value as `--packing` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Packing::BestFit => "best-fit",
            Packing::NextFit => "next-fit",
        }
    }

    pub fn fit(self) -> crate::data::Fit {
        match self {
            Packing::BestFit => crate::data::Fit::Best,
            Packing::NextFit => crate::data::Fit::Next,
        }
    }
}

fn next_fit() -> Packing {
    Packing::NextFit
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    #[default]
    Cosine,
    Linear,
    Wsd,
    #[serde(rename = "wsd-sqrt")]
    WsdSqrt,
}

impl From<Schedule> for ScheduleKind {
    fn from(s: Schedule) -> Self {
        match s {
            Schedule::Constant => ScheduleKind::Constant,
            Schedule::Cosine => ScheduleKind::Cosine,
            Schedule::Linear => ScheduleKind::Linear,
            Schedule::Wsd => ScheduleKind::Wsd,
            Schedule::WsdSqrt => ScheduleKind::WsdSqrt,
        }
    }
}

macro_rules! parse_lowercase {
    ($t:ty, $what:literal, $($name:literal => $v:expr),+) => {
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    $($name => Ok($v),)+
                    _ => Err(format!(concat!("unknown ", $what, " '{}' (expected {})"), s,
                        [$($name),+].join(", "))),
                }
            }
        }
    };
}
parse_lowercase!(Precision, "precision", "f32" => Precision::F32, "bf16" => Precision::Bf16,
    "f16" => Precision::F16);
parse_lowercase!(DeviceChoice, "device", "auto" => DeviceChoice::Auto, "gpu" => DeviceChoice::Gpu,
    "cpu" => DeviceChoice::Cpu);
parse_lowercase!(SamplingKind, "sampling", "random" => SamplingKind::Random,
    "sequential" => SamplingKind::Sequential);
parse_lowercase!(RowsKind, "rows", "auto" => RowsKind::Auto, "stream" => RowsKind::Stream,
    "records" => RowsKind::Records, "packed" => RowsKind::Packed, "stream-docs" => RowsKind::StreamDocs);
parse_lowercase!(Packing, "packing", "best-fit" => Packing::BestFit, "next-fit" => Packing::NextFit);
parse_lowercase!(Schedule, "schedule", "constant" => Schedule::Constant, "cosine" => Schedule::Cosine,
    "linear" => Schedule::Linear, "wsd" => Schedule::Wsd, "wsd-sqrt" => Schedule::WsdSqrt);
parse_lowercase!(ShareTransport, "share-transport", "auto" => ShareTransport::Auto,
    "true" => ShareTransport::True, "false" => ShareTransport::False);

/// [`TransportChoice`] as its name (`auto`, `staging`, `mapped`).
mod transport_name {
    use megatrain_gpu::TransportChoice;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &TransportChoice, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(t)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TransportChoice, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Training data as one path (a string, as runs before several sources
/// wrote it, and still for one) or a list of them.
mod data_paths {
    use std::path::PathBuf;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(paths: &[PathBuf], s: S) -> Result<S::Ok, S::Error> {
        match paths {
            [] => s.serialize_none(),
            [one] => one.serialize(s),
            many => many.serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            One(PathBuf),
            Many(Vec<PathBuf>),
        }
        Ok(match Option::<Given>::deserialize(d)? {
            None => Vec::new(),
            Some(Given::One(p)) => vec![p],
            Some(Given::Many(v)) => v,
        })
    }
}

fn alpaca() -> String {
    "alpaca".into()
}

/// The settings of a training run. Defaults follow nanoGPT where it has one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainOptions {
    /// A Hugging Face model directory (`config.json` + safetensors).
    pub model: Option<PathBuf>,
    /// A preset name (random init); see `megatrain plan --help`.
    pub preset: Option<String>,
    /// The training data: one source, or several drawn from by
    /// `data_weights`.
    #[serde(with = "data_paths")]
    pub data: Vec<PathBuf>,
    /// Each source's share of the rows, in the order of `data` (empty: by
    /// their sizes, as if they were one stream).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub data_weights: Vec<f64>,
    pub val_data: Option<PathBuf>,
    /// Share of the end of the training stream held out for validation when
    /// there is no `val_data`.
    pub val_fraction: f64,
    /// `auto` (the model's tokenizer.json; char for gpt2-nano; else byte),
    /// `char`, `byte`, or a path to a `tokenizer.json`.
    pub tokenizer: String,
    /// How `.jsonl` records become text: `auto` (the tokenizer's own chat
    /// template where it ships one, else the Alpaca headers), `alpaca`, or
    /// a path to a Jinja template or a `tokenizer_config.json`. Runs saved
    /// before the option existed rendered with the Alpaca headers.
    #[serde(default = "alpaca")]
    pub chat_template: String,
    /// Vocabulary of a preset (default: the tokenizer's; for `.bin` data
    /// without a tokenizer, the largest token + 1 for gpt2-nano).
    pub vocab_size: Option<usize>,
    pub seq_len: usize,
    pub batch: usize,
    pub grad_accum: usize,
    pub steps: u64,
    /// Passes over the training data: where given, `steps` becomes
    /// ⌈epochs × rows of one pass ÷ rows a step⌉ once the data is read
    /// ([`crate::data::Mix::rows_per_pass`]; the rows a step takes are
    /// `ranks × batch × grad_accum`), so the learning rate schedule ends
    /// with the last pass.
    pub epochs: Option<f64>,
    pub lr: f64,
    /// Default: lr / 10.
    pub min_lr: Option<f64>,
    pub warmup: u64,
    /// Where given, `warmup` becomes ⌈ratio × steps⌉ once the steps are
    /// known (after `epochs`), as transformers' `warmup_ratio`.
    pub warmup_ratio: Option<f64>,
    pub schedule: Schedule,
    /// Step at which the decay reaches min_lr (default: steps).
    pub decay_steps: Option<u64>,
    /// `wsd` and `wsd-sqrt`: the decay's steps, the last before
    /// `decay_steps` (default: a fifth of `decay_steps`); the learning rate
    /// holds at `lr` from the warm-up's end until they begin.
    pub cooldown: Option<u64>,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Exact global-norm clipping; 0 (the default) is off.
    pub grad_clip: f64,
    /// Dropout on the embedding's output and each residual branch's before
    /// it joins the residual stream (nanoGPT's `dropout`, GPT-2's
    /// `embd_pdrop`/`resid_pdrop`), in [0, 0.99]; 0 (the default) is off.
    /// Evaluation and generation never drop. Runs saved before it existed
    /// had none.
    pub dropout: f64,
    /// Dropout on the attention's probabilities (GPT-2's `attn_pdrop`,
    /// transformers' `attention_dropout`), in [0, 0.99]; 0 is off.
    pub attn_dropout: f64,
    /// Take `dropout` and `attn_dropout` from the model's `config.json`
    /// (`ModelConfig::hf_dropout`) when the run starts; the run then
    /// keeps those numbers (and this is false in its saved options).
    pub dropout_from_config: bool,
    /// PaLM's z-loss factor: z·lse² per target (lse its logits'
    /// log-sum-exp) joins the loss the gradient is of, which keeps the
    /// softmax's normaliser near 1 (PaLM 1e-4); logged as `z_loss`. 0 is off.
    pub z_loss: f64,
    /// Label smoothing ε: train against (1 − ε)·onehot + ε/V, as
    /// transformers' `label_smoothing_factor` (`TrainerConfig::
    /// label_smoothing`); logged as `smoothed_loss` beside `loss`, which
    /// stays the plain cross-entropy. 0 is off.
    pub label_smoothing: f64,
    /// NEFTune's α: uniform noise of magnitude α / √(T·C) on the
    /// embedding's lookup in training (`TrainDropout::neftune`), as
    /// transformers' `neftune_noise_alpha`. 0 is off.
    pub neftune_alpha: f64,
    /// The first this many layers (the embedding, then the blocks; at
    /// most all but the head) are not trained
    /// (`TrainerConfig::frozen_layers`). 0: every layer trains.
    pub freeze_layers: usize,
    pub precision: Precision,
    /// K: keep every K-th block input; backward recomputes K blocks.
    pub checkpoint_every: usize,
    /// The last blocks whose weights and activations stay on the executor
    /// from their forward to their backward, which then uploads and
    /// recomputes only the others:
    /// a count, `all`, or `auto` (the default: as many as
    /// `megatrain plan` estimates fit in 80 % of a device's memory or half
    /// of the host's available memory: [`super::DEVICE_SHARE`]). A
    /// device option: it changes no result.
    pub keep_activations: KeepActivations,
    /// Rows of the LM head per chunk; `None` (the default):
    /// [`megatrain_zoo::default_chunk_rows`] of the model's vocabulary and
    /// the executor's memory (larger chunks on a GPU than on the host). A
    /// run saved when the default was a fixed 256 reads back as `Some(256)`
    /// and keeps it on resume.
    pub chunk_rows: Option<usize>,
    pub device: DeviceChoice,
    /// How the GPU moves layers: `auto` (measured at start), `staging` or
    /// `mapped`. A device option: changing it on resume changes no result.
    #[serde(with = "transport_name")]
    pub transport: TransportChoice,
    pub seed: u64,
    pub sampling: SamplingKind,
    /// How a batch's rows are cut: `records` (one `.jsonl` record a row,
    /// from its first token, cut at `seq_len + 1` tokens and right-padded),
    /// `stream` (windows of each source's concatenated tokens), or `auto`
    /// (the default): records for `.jsonl` sources, windows for the
    /// others. Runs saved before the option existed drew windows.
    #[serde(default = "stream_rows")]
    pub rows: RowsKind,
    /// How `rows = packed` fills a row: `best-fit` (the default) or
    /// `next-fit`. Runs saved before the option existed packed next fit.
    #[serde(default = "next_fit")]
    pub packing: Packing,
    /// With `rows = stream-docs`, of a source that is not `.jsonl`: the id
    /// that ends each document (`None`: the tokenizer's end-of-sequence
    /// id).
    pub doc_end: Option<u32>,
    /// The data position is this many micro-batches past `step ·
    /// grad_accum`: resumed from a checkpoint before a loss spike with the
    /// batches around it skipped (PaLM's remedy). Kept by later resumes.
    pub skip_batches: u64,
    /// Evaluate every this many steps or each pass (0: only at the end;
    /// also at the start, unless 0).
    pub eval_every: Every,
    /// Stop once this many evaluations in a row have not gone below the
    /// lowest validation loss so far (0: never); the step it stops at is
    /// saved, and `best` names the lowest.
    pub early_stop: u64,
    pub eval_batches: usize,
    /// Generate a sample every this many steps or each pass, and at the
    /// end (0: never):
    /// `sample_tokens` tokens after `sample_prompt`, through the run's
    /// streamed forward between steps (temperature 0.8, top-k 200, seeded
    /// by the run's seed and the step), printed and logged as `sample`.
    /// Changes no result.
    pub sample_every: Every,
    pub sample_prompt: String,
    pub sample_tokens: usize,
    /// Save a checkpoint every this many steps or each pass (0: only at
    /// the end).
    pub save_every: Every,
    /// Keep only the newest this many checkpoints, removing older ones
    /// after each save (0: keep all). Changes no result.
    pub keep_checkpoints: u64,
    /// Plain progress line every this many steps (off a terminal).
    pub log_every: u64,
    /// Also log to a TensorBoard event file in `out` (what `metrics.jsonl`
    /// holds). Changes no result.
    pub tensorboard: bool,
    pub out: PathBuf,
    /// Host RAM budget for the tier in bytes (spills the rest to `out/spill`).
    pub host_budget: Option<u64>,
    /// RAM for the read-ahead / write-behind window of spilled layers, in
    /// bytes (`None`: the trainer's default, 384 MiB). A device option:
    /// changing it on resume changes no result.
    pub spill_window: Option<u64>,
    /// Most gradient bytes (f32) moved and staged at once (`None`: sized by
    /// the model, `trainer::transfer_chunk_for`). A device option, like the
    /// three below.
    pub transfer_chunk: Option<u64>,
    /// Chunks of a layer's gradients in flight down at once (`None` or 0:
    /// all of a block's, `TrainerConfig::chunks_in_flight`): fewer hold
    /// less host memory and leave the device idle longer. A device option.
    pub chunks_in_flight: Option<usize>,
    /// Gradient chunks that may wait for the CPU AdamW before the backward
    /// waits for it (`None`: `trainer::DEFAULT_OPTIMIZER_QUEUE`): more
    /// hold more host memory and let the optimizer fall further behind.
    /// A device option.
    pub optimizer_queue: Option<usize>,
    /// The first this many layers (the embedding, then the blocks) keep
    /// their gradients on the executor at a step's end; the next step's
    /// forward updates each just before loading it
    /// (`TrainerConfig::carry_layers`). 0: off. A device option: it
    /// changes no result (with clipping, the coefficient within its last
    /// bits).
    pub carry_layers: usize,
    /// Which layers `carry_layers` are: the first ones, or blocks spread
    /// over the model (`TrainerConfig::carry_order`). A device option.
    pub carry_order: CarryOrder,
    /// The GPU transport's knobs, flattened: their keys sit beside the
    /// others in a config file and a run's saved options.
    #[serde(flatten)]
    pub knobs: TransportKnobs,
    /// Data parallel ranks (processes) the run trains with: set from the
    /// launcher's world size, not a flag. `batch` is per rank, so the
    /// global batch is `ranks · batch`.
    pub ranks: usize,
    /// With several ranks, shard p, m, v across them (ZeRO-1/2): each rank
    /// updates 1/ranks of every layer.
    pub shard_optimizer: bool,
    /// With several ranks, those of a machine map one transport copy
    /// instead of holding one each (`dist::machines`). A device option: it
    /// changes no result.
    pub share_transport: ShareTransport,
    /// The memory filesystem the shared transport copies live in.
    pub shm_dir: PathBuf,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            model: None,
            preset: None,
            data: Vec::new(),
            data_weights: Vec::new(),
            val_data: None,
            val_fraction: 0.1,
            tokenizer: "auto".into(),
            chat_template: "auto".into(),
            vocab_size: None,
            seq_len: 256,
            batch: 12,
            grad_accum: 1,
            steps: 5000,
            epochs: None,
            lr: 1e-3,
            min_lr: None,
            warmup: 100,
            warmup_ratio: None,
            schedule: Schedule::Cosine,
            decay_steps: None,
            cooldown: None,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            // Off: exact clipping holds every gradient and moves the update
            // after backward, so it is a mode the user asks for, never a default.
            grad_clip: 0.0,
            dropout: 0.0,
            attn_dropout: 0.0,
            dropout_from_config: false,
            z_loss: 0.0,
            label_smoothing: 0.0,
            neftune_alpha: 0.0,
            freeze_layers: 0,
            precision: Precision::F32,
            checkpoint_every: 1,
            keep_activations: KeepActivations::Auto,
            chunk_rows: None,
            device: DeviceChoice::Auto,
            transport: TransportChoice::Auto,
            seed: 1337,
            sampling: SamplingKind::Random,
            rows: RowsKind::Auto,
            packing: Packing::BestFit,
            doc_end: None,
            skip_batches: 0,
            eval_every: Every::Steps(250),
            early_stop: 0,
            eval_batches: 20,
            sample_every: Every::NEVER,
            sample_prompt: "\n".into(),
            sample_tokens: 200,
            save_every: Every::Steps(500),
            keep_checkpoints: 0,
            log_every: 10,
            tensorboard: false,
            out: PathBuf::from("out"),
            host_budget: None,
            spill_window: None,
            transfer_chunk: None,
            chunks_in_flight: None,
            optimizer_queue: None,
            carry_layers: 0,
            carry_order: CarryOrder::First,
            knobs: TransportKnobs::default(),
            ranks: 1,
            shard_optimizer: false,
            share_transport: ShareTransport::Auto,
            shm_dir: PathBuf::from("/dev/shm"),
        }
    }
}

fn normalize_keys(v: &mut toml::Value) {
    if let toml::Value::Table(t) = v {
        let entries: Vec<(String, toml::Value)> = std::mem::take(t).into_iter().collect();
        for (k, mut v) in entries {
            normalize_keys(&mut v);
            t.insert(k.replace('-', "_"), v);
        }
    }
}

impl TrainOptions {
    /// Options from a TOML file; keys may use `-` or `_`. Relative paths in
    /// the file are relative to the working directory, like flags.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(RunError::io(path))?;
        Self::from_toml_str(&text, path)
    }

    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self> {
        let mut v: toml::Value =
            toml::from_str(text).map_err(|e| RunError::file(path, format!("invalid TOML: {e}")))?;
        normalize_keys(&mut v);
        v.try_into()
            .map_err(|e: toml::de::Error| RunError::file(path, e.message().to_string()))
    }

    /// These options with the keys set in a TOML text replacing theirs
    /// (keys the text leaves out keep their current values).
    pub fn overlay_toml(&self, text: &str, path: &Path) -> Result<Self> {
        let mut file: toml::Value =
            toml::from_str(text).map_err(|e| RunError::file(path, format!("invalid TOML: {e}")))?;
        normalize_keys(&mut file);
        let mut base = toml::Value::try_from(self).map_err(|e| RunError::Config(e.to_string()))?;
        if let (toml::Value::Table(b), toml::Value::Table(f)) = (&mut base, file) {
            b.extend(f);
        }
        base.try_into()
            .map_err(|e: toml::de::Error| RunError::file(path, e.message().to_string()))
    }

    /// Rows of the LM head per chunk for a vocabulary of `vocab` tokens on
    /// an executor whose chunk may hold `logits_bytes` of logits
    /// ([`megatrain_tensor::Executor::logits_chunk_bytes`]).
    pub fn chunk_rows(&self, vocab: usize, logits_bytes: usize) -> usize {
        self.chunk_rows
            .unwrap_or_else(|| megatrain_zoo::default_chunk_rows(vocab, logits_bytes))
    }

    pub fn min_lr(&self) -> f64 {
        self.min_lr.unwrap_or(self.lr / 10.0)
    }

    pub fn decay_steps(&self) -> u64 {
        self.decay_steps.unwrap_or(self.steps)
    }

    /// `steps` from `epochs` passes over data whose one pass is
    /// `rows_per_pass` rows, where `epochs` is given, then `warmup` from
    /// `warmup_ratio`, where given; the cooldown checked against them.
    pub fn resolve_steps(&mut self, rows_per_pass: u64) -> Result<()> {
        if let Some(e) = self.epochs {
            self.steps = self.steps_for_epochs(e, rows_per_pass);
        }
        if let Some(r) = self.warmup_ratio {
            self.warmup = (r * self.steps as f64).ceil() as u64;
        }
        self.check_cooldown()
    }

    /// A cooldown no longer than the steps to `decay_steps`.
    pub fn check_cooldown(&self) -> Result<()> {
        match self.cooldown {
            Some(c) if c > self.decay_steps() => Err(RunError::option(
                "cooldown",
                c,
                format!("is longer than the {} steps to --decay-steps", self.decay_steps()),
            )),
            _ => Ok(()),
        }
    }

    /// The steps of `epochs` passes over data whose one pass is
    /// `rows_per_pass` rows: at least 1.
    pub fn steps_for_epochs(&self, epochs: f64, rows_per_pass: u64) -> u64 {
        let per_step = self.passes(rows_per_pass).rows_per_step as f64;
        ((epochs * rows_per_pass as f64 / per_step).ceil() as u64).max(1)
    }

    /// This run's steps against passes of `rows_per_pass` rows.
    pub fn passes(&self, rows_per_pass: u64) -> Passes {
        Passes {
            rows_per_step: (self.global_batch() * self.grad_accum) as u64,
            rows_per_pass,
        }
    }

    pub fn schedule(&self) -> crate::schedule::LrSchedule {
        crate::schedule::LrSchedule {
            kind: self.schedule.into(),
            lr: self.lr,
            min_lr: self.min_lr(),
            warmup: self.warmup,
            decay_steps: self.decay_steps(),
            cooldown: self.cooldown.unwrap_or(self.decay_steps() / 5),
        }
    }

    /// The batch of all ranks together.
    pub fn global_batch(&self) -> usize {
        self.ranks * self.batch
    }

    /// These options on `ranks` ranks. A resumed run keeps its global batch
    /// (so it continues the same run with another number of ranks) unless
    /// `batch_given` (the user named a per-rank batch): then the per-rank
    /// batch is the global one divided by `ranks`, which must divide it.
    pub fn on_ranks(mut self, ranks: usize, batch_given: bool) -> Result<Self> {
        if ranks == 0 {
            return Err(RunError::option("ranks", ranks, "must be at least 1"));
        }
        if !batch_given && ranks != self.ranks {
            let global = self.global_batch();
            if !global.is_multiple_of(ranks) {
                return Err(RunError::option(
                    "ranks",
                    ranks,
                    format!(
                        "does not divide the run's global batch of {global} ({} ranks × --batch {}); \
                         resume with a number of ranks that divides {global}, or give --batch per rank",
                        self.ranks, self.batch
                    ),
                ));
            }
            self.batch = global / ranks;
        }
        self.ranks = ranks;
        Ok(self)
    }

    /// Refuses settings that cannot run, naming the option and its value.
    pub fn validate(&self) -> Result<()> {
        let positive = |name: &str, v: u64| {
            if v == 0 {
                Err(RunError::option(name, v, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive("seq-len", self.seq_len as u64)?;
        positive("batch", self.batch as u64)?;
        positive("grad-accum", self.grad_accum as u64)?;
        positive("checkpoint-every", self.checkpoint_every as u64)?;
        if let Some(rows) = self.chunk_rows {
            positive("chunk-rows", rows as u64)?;
        }
        positive("eval-batches", self.eval_batches as u64)?;
        if self.early_stop > 0 && self.eval_every.is_never() {
            return Err(RunError::option(
                "early-stop",
                self.early_stop,
                "counts evaluations: give --eval-every too",
            ));
        }
        if !self.sample_every.is_never() {
            positive("sample-tokens", self.sample_tokens as u64)?;
        }
        positive("log-every", self.log_every)?;
        positive("ranks", self.ranks as u64)?;
        if let Some(e) = self.epochs.filter(|e| !(e.is_finite() && *e > 0.0)) {
            return Err(RunError::option("epochs", e, "must be a positive number"));
        }
        if let Some(r) = self.warmup_ratio.filter(|r| !(0.0..1.0).contains(r)) {
            return Err(RunError::option("warmup-ratio", r, "must be in [0, 1)"));
        }
        if let Some(w) = self.spill_window {
            // Two chunk sets of the smallest chunk the window reads.
            let min = 2 * 12 * megatrain_tier::CHUNK_ALIGN as u64;
            if w < min {
                return Err(RunError::option(
                    "spill-window",
                    w,
                    format!("must be at least {min} bytes (two chunks of p, m and v)"),
                ));
            }
        }
        if let Some(b) = self.transfer_chunk {
            transfer_chunk_elems(b)?;
        }
        if let Some(n) = self.chunks_in_flight.filter(|&n| n > MAX_CHUNKS_IN_FLIGHT) {
            return Err(RunError::option(
                "chunks-in-flight",
                n,
                format!("must be at most {MAX_CHUNKS_IN_FLIGHT} (0: all of a block's chunks)"),
            ));
        }
        if let Some(n) = self.optimizer_queue {
            check_optimizer_queue(n)?;
        }
        if self.freeze_layers > 0 && self.carry_layers > 0 {
            return Err(RunError::option(
                "freeze-layers",
                self.freeze_layers,
                "cannot be used with --carry-layers, which counts from the first layer",
            ));
        }
        if self.carry_order == CarryOrder::Spread && self.carry_layers > 0 && self.grad_clip > 0.0 {
            return Err(RunError::option(
                "carry-order",
                "spread",
                "cannot be used with --grad-clip, whose updates all wait for the step's norm and go into the \
                 next forward anyway (carry the first layers to keep their gradients on the device)",
            ));
        }
        // With --host-budget the trainer refuses a carried layer the tier
        // spills, naming the first one (the placement is known only then).
        if self.carry_layers > 0 && self.ranks > 1 {
            let n = match self.carry_layers {
                CARRY_ALL => "all".to_string(),
                n => n.to_string(),
            };
            return Err(RunError::option(
                "carry-layers",
                n,
                "cannot be used with data parallel ranks, whose updates wait for each layer's reduction",
            ));
        }
        let knobs = self.knobs;
        knobs.validate()?;
        if self.device == DeviceChoice::Cpu {
            knobs.refuse_on_cpu()?;
        }
        let finite_nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(RunError::option(name, v, "must be a finite number ≥ 0"))
            }
        };
        finite_nonneg("lr", self.lr)?;
        finite_nonneg("min-lr", self.min_lr())?;
        if self.min_lr() > self.lr {
            return Err(RunError::option(
                "min-lr",
                self.min_lr(),
                format!(
                    "is above --lr {}: the schedule decays from --lr down to --min-lr",
                    self.lr
                ),
            ));
        }
        if let Some(c) = self.cooldown
            && !matches!(self.schedule, Schedule::Wsd | Schedule::WsdSqrt)
        {
            return Err(RunError::option(
                "cooldown",
                c,
                "is the wsd schedules' decay: give --schedule wsd or wsd-sqrt",
            ));
        }
        // With --epochs the steps are known once the data is read
        // (`prepare` checks then).
        if self.epochs.is_none() || self.decay_steps.is_some() {
            self.check_cooldown()?;
        }
        finite_nonneg("weight-decay", self.weight_decay)?;
        finite_nonneg("grad-clip", self.grad_clip)?;
        if !(self.z_loss.is_finite() && (0.0..=1.0).contains(&self.z_loss)) {
            return Err(RunError::option(
                "z-loss",
                self.z_loss,
                "must be in [0, 1] (PaLM uses 1e-4)",
            ));
        }
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return Err(RunError::option(
                "label-smoothing",
                self.label_smoothing,
                "must be in [0, 1] (0.1 is the common choice)",
            ));
        }
        finite_nonneg("neftune-alpha", self.neftune_alpha)?;
        if self.dropout_from_config && (self.dropout > 0.0 || self.attn_dropout > 0.0) {
            return Err(RunError::option(
                "dropout-from-config",
                true,
                format!(
                    "takes both rates from the model's config.json as a run starts: give it without --dropout ({}) \
                     and --attn-dropout ({}), and not on --resume (a run keeps its rates)",
                    self.dropout, self.attn_dropout
                ),
            ));
        }
        for (name, p) in [("dropout", self.dropout), ("attn-dropout", self.attn_dropout)] {
            if !(0.0..=megatrain_tensor::MAX_DROPOUT).contains(&p) {
                return Err(RunError::option(
                    name,
                    p,
                    format!("must be in [0, {}]", megatrain_tensor::MAX_DROPOUT),
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(RunError::option("eps", self.eps, "must be positive"));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(RunError::option(name, b, "must be in [0, 1)"));
            }
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(RunError::option(
                "val-fraction",
                self.val_fraction,
                "must be in [0, 1)",
            ));
        }
        match (&self.model, &self.preset) {
            (Some(_), Some(_)) => Err(RunError::Config(
                "give either --model or --preset, not both".into(),
            )),
            (None, None) => Err(RunError::Config(
                "no model: give --model <HF dir> or --preset <name>".into(),
            )),
            _ => Ok(()),
        }?;
        if self.data.is_empty() {
            return Err(RunError::Config("no training data: give --data <path>".into()));
        }
        let weights = self
            .data_weights
            .iter()
            .map(|w| format!("{w}"))
            .collect::<Vec<_>>()
            .join(",");
        if !self.data_weights.is_empty() && self.data_weights.len() != self.data.len() {
            return Err(RunError::option(
                "data-weights",
                &weights,
                format!(
                    "gives {} weights for {} --data sources",
                    self.data_weights.len(),
                    self.data.len()
                ),
            ));
        }
        if self.data_weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
            return Err(RunError::option(
                "data-weights",
                &weights,
                "every weight must be a positive number",
            ));
        }
        if self.rows.needs_records()
            && let Some(other) = self
                .data
                .iter()
                .chain(&self.val_data)
                .find(|p| !self.rows.records_of(p))
        {
            return Err(RunError::option(
                "rows",
                self.rows.name(),
                format!(
                    "takes .jsonl records; {} holds no records (give --rows stream or auto)",
                    other.display()
                ),
            ));
        }
        check_doc_end(self.rows, self.doc_end)?;
        if self.data.len() > 1 && self.sampling == SamplingKind::Sequential {
            return Err(RunError::option(
                "sampling",
                "sequential",
                "reads one stream in order; several --data sources are drawn from at random",
            ));
        }
        Ok(())
    }
}

/// Refuses `--doc-end` (`doc_end`) with any `--rows` but stream-docs,
/// whose documents it ends.
pub fn check_doc_end(rows: RowsKind, doc_end: Option<u32>) -> Result<()> {
    match doc_end.filter(|_| rows != RowsKind::StreamDocs) {
        Some(id) => Err(RunError::option(
            "doc-end",
            id,
            format!(
                "ends the documents of --rows stream-docs, not of --rows {}",
                rows.name()
            ),
        )),
        None => Ok(()),
    }
}

/// `--optimizer-queue N` (`train` and `plan`): 1 to [`MAX_OPTIMIZER_QUEUE`].
pub fn check_optimizer_queue(n: usize) -> Result<()> {
    match (1..=MAX_OPTIMIZER_QUEUE).contains(&n) {
        true => Ok(()),
        false => Err(RunError::option(
            "optimizer-queue",
            n,
            format!("must be from 1 to {MAX_OPTIMIZER_QUEUE}"),
        )),
    }
}

/// Refuses `--freeze-layers n` that leaves `model` nothing to train but
/// part of the head, naming the count: at most the embedding and every
/// block.
pub fn check_freeze_layers(n: usize, model: &megatrain_zoo::ModelConfig) -> Result<()> {
    match n > model.num_layers + 1 {
        true => Err(RunError::option(
            "freeze-layers",
            n,
            format!(
                "at most {} (the embedding and the {} blocks): the head trains",
                model.num_layers + 1,
                model.num_layers
            ),
        )),
        false => Ok(()),
    }
}

/// `--carry-layers all`: every layer of the model, whatever their number
/// ([`check_carry_layers`] resolves it).
pub const CARRY_ALL: usize = usize::MAX;

/// Parses `--carry-layers`: a number of layers, or `all` ([`CARRY_ALL`]).
pub fn parse_carry_layers(s: &str) -> std::result::Result<usize, String> {
    match s {
        "all" => Ok(CARRY_ALL),
        _ => s
            .parse()
            .map_err(|_| format!("'{s}' is neither a number of layers nor 'all'")),
    }
}

/// `--carry-layers n` for `model`: [`CARRY_ALL`] is all its layers (the
/// embedding, its blocks and the head); past them it is refused, naming
/// both. `train` and `plan` check it before anything is made.
pub fn check_carry_layers(n: usize, model: &megatrain_zoo::ModelConfig) -> Result<usize> {
    let layers = model.num_layers + 2;
    match n {
        CARRY_ALL => Ok(layers),
        n if n > layers => Err(RunError::option(
            "carry-layers",
            n,
            format!(
                "the model has {layers} layers (the embedding, {} blocks, the head)",
                model.num_layers
            ),
        )),
        n => Ok(n),
    }
}
