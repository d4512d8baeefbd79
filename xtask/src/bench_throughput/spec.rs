//! One benchmark configuration: what the parent hands to a child process,
//! and how it becomes a model.

use std::path::PathBuf;

use anyhow::{Context, bail, ensure};
use megatrain::run::{KeepActivations, TransportKnobs};
use megatrain::trainer::CarryOrder;
use megatrain_gpu::TransportChoice;
use megatrain_zoo::{HfCheckpoint, ModelConfig, preset};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Spec {
    /// Row label in the tables.
    pub label: String,
    pub preset: Option<String>,
    pub model_dir: Option<PathBuf>,
    pub vocab: Option<usize>,
    pub layers: Option<usize>,
    pub hidden: Option<usize>,
    pub seq_len: usize,
    pub batch: usize,
    pub steps: usize,
    pub warmup: usize,
    /// "f32" or "bf16" (the transport copy; compute is f32 either way).
    pub precision: String,
    /// "cpu" or "gpu".
    pub device: String,
    /// How the GPU moves layers: "auto", "staging" or "mapped" (the CPU
    /// executor has no choice and ignores it).
    #[serde(default = "auto")]
    pub transport: String,
    pub checkpoint_every: usize,
    /// Repetitions of each isolated mode (median taken); 0 skips them.
    pub mode_reps: usize,
    pub lr: f64,
    /// Run the PyTorch peer on this shape (where torch imports).
    pub peer: bool,
    /// RAM budget of the host tier (bytes); layers past it spill.
    #[serde(default)]
    pub host_budget: Option<u64>,
    /// Where spilled layers go (with `host_budget`).
    #[serde(default)]
    pub spill_dir: Option<PathBuf>,
    /// RAM of the spill window (bytes; default the trainer's).
    #[serde(default)]
    pub spill_window: Option<u64>,
    /// Gradient bytes moved at once (default the trainer's).
    #[serde(default)]
    pub transfer_chunk: Option<u64>,
    /// Gradient chunks of a layer in flight at once (default the trainer's).
    #[serde(default)]
    pub chunks_in_flight: Option<usize>,
    /// Gradient chunks that may wait for the optimizer (default the trainer's).
    #[serde(default)]
    pub optimizer_queue: Option<usize>,
    /// How many layers' updates run in the next step's forward
    /// (`TrainerConfig::carry_layers`; default 0).
    #[serde(default)]
    pub carry_layers: usize,
    /// Which layers those are (`TrainerConfig::carry_order`; default the
    /// first).
    #[serde(default)]
    pub carry_order: CarryOrder,
    /// The first layers not trained (`TrainerConfig::frozen_layers`;
    /// default 0).
    #[serde(default)]
    pub freeze_layers: usize,
    /// Exact global-norm clipping at this threshold (gradients held on the
    /// host; `TrainerConfig::grad_clip`).
    #[serde(default)]
    pub grad_clip: Option<f64>,
    /// Clipped updates after the backward, not in the next forward
    /// (`TrainerConfig::defer_clipped_updates` off).
    #[serde(default)]
    pub clip_after_backward: bool,
    /// Dropout on the embedding's and residual branches' outputs, and on
    /// the attention's probabilities (`TrainerConfig::dropout`; default 0).
    #[serde(default)]
    pub dropout: f64,
    #[serde(default)]
    pub attn_dropout: f64,
    /// The last blocks that keep their weights and activations (not uploaded again nor recomputed).
    #[serde(default)]
    pub keep_activations: KeepActivations,
    /// The GPU transport's knobs (default the executor's), flattened.
    #[serde(flatten)]
    pub knobs: TransportKnobs,
    /// One more step after the timed ones with per-op profiling on.
    #[serde(default)]
    pub profile: bool,
}

fn auto() -> String {
    TransportChoice::Auto.to_string()
}

impl Spec {
    /// The gradient hand-over's overrides (transfer chunk, chunks in
    /// flight, optimizer queue, at least 1, layers carried) and the
    /// dropout onto the trainer's `config`.
    pub fn apply_to_trainer(&self, config: &mut megatrain::trainer::TrainerConfig) -> anyhow::Result<()> {
        if let Some(b) = self.transfer_chunk {
            config.transfer_chunk = megatrain::run::transfer_chunk_elems(b)?;
        }
        if let Some(n) = self.chunks_in_flight {
            config.chunks_in_flight = n;
        }
        if let Some(n) = self.optimizer_queue {
            config.optimizer_queue = n.max(1);
        }
        config.carry_layers = self.carry_layers;
        config.carry_order = self.carry_order;
        config.frozen_layers = self.freeze_layers;
        if let Some(c) = self.grad_clip {
            anyhow::ensure!(
                c.is_finite() && c > 0.0,
                "--grad-clip {c}: must be positive and finite"
            );
            config.grad_clip = Some(c);
        }
        config.defer_clipped_updates = !self.clip_after_backward;
        config.dropout = megatrain::trainer::TrainDropout {
            hidden: self.dropout,
            attention: self.attn_dropout,
            neftune: 0.0,
            seed: 0,
        };
        Ok(())
    }

    /// The GPU transport this spec asks for.
    pub fn transport(&self) -> anyhow::Result<TransportChoice> {
        self.transport
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--transport: {e}"))
    }

    /// The model this spec trains (weights come later: seeded or the checkpoint's).
    pub fn model(&self) -> anyhow::Result<ModelConfig> {
        let mut cfg = match (&self.preset, &self.model_dir) {
            (Some(p), None) => preset(p, self.vocab).with_context(|| format!("preset {p}"))?,
            (None, Some(dir)) => {
                ensure!(
                    self.vocab.is_none() && self.layers.is_none() && self.hidden.is_none(),
                    "--vocab/--layers/--hidden do not apply to --model {}",
                    dir.display()
                );
                HfCheckpoint::open(dir)
                    .with_context(|| format!("model directory {}", dir.display()))?
                    .config
            }
            _ => bail!("a configuration needs exactly one of --preset and --model"),
        };
        if let Some(l) = self.layers {
            ensure!(l > 0, "--layers must be positive");
            cfg.num_layers = l;
        }
        if let Some(h) = self.hidden {
            let heads = cfg.num_heads;
            ensure!(
                h > 0 && h % heads == 0 && (h / heads) % 2 == 0,
                "--hidden {h} must be a positive multiple of 2 × the {heads} heads"
            );
            // Keep the MLP ratio of the preset; round to a multiple of 8.
            let ratio = cfg.intermediate_size as f64 / cfg.hidden_size as f64;
            cfg.intermediate_size = ((ratio * h as f64 / 8.0).round() as usize * 8).max(8);
            cfg.hidden_size = h;
            cfg.head_dim = h / heads;
        }
        cfg.max_position_embeddings = cfg.max_position_embeddings.max(self.seq_len);
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("configuration {}: {e}", self.label))?;
        cfg.check_seq_len(self.seq_len)?;
        Ok(cfg)
    }

    /// The PyTorch peer's autocast: bf16 beside our GPU runs with 16-bit
    /// precision (PyTorch's usual mixed precision, the fair peer of f16
    /// tensor-core matmuls); fp32 elsewhere.
    pub fn peer_autocast(&self) -> Option<&'static str> {
        (self.device == "gpu" && self.precision != "f32").then_some("bf16")
    }

    pub fn tokens_per_step(&self) -> u64 {
        (self.batch * self.seq_len) as u64
    }
}

/// A small CPU configuration for tests; each test overrides what it needs.
#[cfg(test)]
pub(crate) fn test_spec() -> Spec {
    Spec {
        label: "t".into(),
        preset: Some("llama-tiny".into()),
        model_dir: None,
        vocab: None,
        layers: Some(16),
        hidden: Some(256),
        seq_len: 64,
        batch: 4,
        steps: 2,
        warmup: 1,
        precision: "f32".into(),
        device: "cpu".into(),
        transport: "auto".into(),
        checkpoint_every: 1,
        mode_reps: 0,
        lr: 1e-3,
        peer: false,
        host_budget: None,
        spill_dir: None,
        spill_window: None,
        transfer_chunk: None,
        chunks_in_flight: None,
        optimizer_queue: None,
        carry_layers: 0,
        carry_order: CarryOrder::First,
        freeze_layers: 0,
        grad_clip: None,
        clip_after_backward: false,
        dropout: 0.0,
        attn_dropout: 0.0,
        keep_activations: KeepActivations::NONE,
        knobs: TransportKnobs::default(),
        profile: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        test_spec()
    }

    #[test]
    fn overrides_reshape_the_preset() {
        let cfg = spec().model().unwrap();
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.head_dim), (16, 256, 64));
        // llama-tiny's 176 / 64 ratio, rounded to a multiple of 8.
        assert_eq!(cfg.intermediate_size, 704);
    }

    #[test]
    fn bad_overrides_are_named() {
        let mut s = spec();
        s.hidden = Some(30);
        assert!(s.model().unwrap_err().to_string().contains("--hidden 30"));
        s.hidden = None;
        s.preset = None;
        assert!(s.model().is_err());
        s.transport = "pinned".into();
        assert!(
            s.transport()
                .unwrap_err()
                .to_string()
                .contains("unknown transport 'pinned'")
        );
    }
}
