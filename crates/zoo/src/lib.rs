//! megatrain-zoo: model families as code ([`Arch`]: GPT-2, the Llama
//! family, OLMo, Phi, GLM, Cohere, Gemma, GPT-NeoX, and the mixtures of
//! experts Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE), Hugging Face
//! checkpoint import/export, tokenizers and presets.
//!
//! - [`ModelConfig`]: parsed from `config.json` (v4 and v5 field names) or a
//!   [`preset`]; [`ModelConfig::layer_tables`] gives one
//!   [`ParamTable`](megatrain_tensor::ParamTable) per layer with HF names:
//!   layer 0 embedding, `1..=num_layers` blocks, last = final norm + head
//!   (without `lm_head.weight` when tied). Nothing is allocated.
//! - [`layers`]: each layer's forward and backward against
//!   [`Executor`](megatrain_tensor::Executor), weights and gradients in table
//!   order.
//! - [`HfCheckpoint`] (one layer at a time, memory-mapped) / [`load_hf_dir`],
//!   and [`export_hf_dir`]: per-layer fp32 slabs in and out of HF
//!   safetensors directories; [`reshard_safetensors`]: a checkpoint's file
//!   as one, narrowed and sharded a tensor at a time.
//! - [`Tokenizer`]: HF `tokenizer.json`, char-level, byte-level.
//! - [`init_layer`]: seeded random initialisation, one layer at a time.
//!
//! A streamed step, as [`forward_backward`] does it with everything resident:
//!
//! ```text
//! x0 = embedding_forward(cfg, ex, w[0], ids, B, T, docs)   // docs: documents packed in rows, or None
//! x(i+1), saved_i = block_forward(cfg, ex, i, w[i+1], x(i), docs)   // drop saved_i to checkpoint
//! head = head_forward_backward(cfg, ex, w[L+1], tied.then(w[0][0]), x(L), targets,
//!                              1/counted_targets_of_step, loss_terms, chunk_rows)
//! dx = head.dx;  for i in rev: (re-run block_forward if saved_i was dropped)
//!     dx, g[i+1] = block_backward(cfg, ex, i, w[i+1], saved_i, dx, aux)   // aux: MoE balance loss
//! g[0] = embedding_backward(cfg, ex, w[0], ids, (B, T, docs), dx, head.tied_grad)
//! ```

mod config;
mod error;
mod hf_export;
mod hf_load;
mod init;
pub mod layers;
mod long_text;
mod model;
mod mxfp4;
mod presets;
mod tables;
mod tokenizer;

pub use config::{Arch, LinearAttn, Mla, ModelConfig, Moe, Multipliers, Router};
pub use error::{Result, ZooError};
pub use hf_export::{ExportOptions, export_hf_dir, hf_dtype, narrow_safetensors, reshard_safetensors};
pub use hf_load::{HfCheckpoint, INDEX_FILE, LoadedModel, SINGLE_FILE, load_hf_dir};
pub use init::{INIT_STD, init_layer, init_layer_into};
pub use layers::default_chunk_rows;
pub use model::{StepOut, download_grads, forward_backward, forward_logits, upload_layer};
pub use presets::{PRESET_NAMES, gpt2_nano, preset};
pub use tables::LayerKind;
pub use tokenizer::{CHAR_VOCAB_FILE, CharTokenizer, HF_TOKENIZER_FILE, Tokenizer};
