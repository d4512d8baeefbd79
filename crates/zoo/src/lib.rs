//! megatrain-zoo: model families as code (GPT-2, Llama, Mistral, Qwen2,
//! Qwen3), Hugging Face checkpoint import/export, tokenizers and presets.
//!
//! - [`ModelConfig`]: parsed from `config.json` or a [`preset`].
//! - [`ModelConfig::layer_tables`]: one [`ParamTable`](megatrain_tensor::ParamTable)
//!   per layer (embedding, blocks, final norm + head) with HF names.
//! - [`layers`]: each layer's forward and backward against
//!   [`Executor`](megatrain_tensor::Executor).
//! - [`HfCheckpoint`] / [`load_hf_dir`] and [`export_hf_dir`]: per-layer fp32
//!   slabs in and out of HF safetensors directories.
//! - [`Tokenizer`]: HF `tokenizer.json`, char-level, byte-level.
//! - [`init_layer`]: seeded random initialisation.

mod config;
mod error;
mod hf_export;
mod hf_load;
mod init;
pub mod layers;
mod model;
mod presets;
mod tables;
mod tokenizer;

pub use config::{Arch, ModelConfig};
pub use error::{Result, ZooError};
pub use hf_export::{ExportOptions, export_hf_dir};
pub use hf_load::{HfCheckpoint, INDEX_FILE, LoadedModel, SINGLE_FILE, load_hf_dir};
pub use init::{INIT_STD, init_layer, init_layer_into};
pub use model::{StepOut, download_grads, forward_backward, forward_logits, upload_layer};
pub use presets::{PRESET_NAMES, gpt2_nano, preset};
pub use tables::LayerKind;
pub use tokenizer::{CHAR_VOCAB_FILE, CharTokenizer, HF_TOKENIZER_FILE, Tokenizer};
