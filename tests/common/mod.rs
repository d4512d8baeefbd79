//! Setup shared by the top-level integration tests: the GPU context, the
//! synthetic token streams, the small models and the streamed trainer;
//! [`cli`]: the binary as the command-line tests run it.
// Each test binary compiles this module on its own and uses a part of it.
#![allow(dead_code)]

pub mod cli;

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use megatrain::data::{Batch, Sampling, TokenData, draw_rows};
use megatrain::trainer::{Trainer, TrainerConfig, init_tier};
use megatrain_adamw::AdamWConfig;
use megatrain_gpu::GpuContext;
use megatrain_tensor::Executor;
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::{ModelConfig, gpt2_nano, preset};

/// The test binary's GPU context (lavapipe where there is no GPU), opened
/// once; `None` means skip. With `CI=true` a missing adapter fails the
/// test instead of skipping it.
pub fn ctx() -> Option<Arc<GpuContext>> {
    static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    CTX.get_or_init(|| match GpuContext::new() {
        Ok(c) => Some(c),
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but no GPU adapter could be opened (is mesa-vulkan-drivers installed?): {e}")
        }
        Err(e) => {
            eprintln!("skipping: no GPU adapter ({e})");
            None
        }
    })
    .clone()
}

/// A device of the caller's own on [`ctx`]'s adapter, for a test whose
/// kernels lavapipe takes minutes to compile: it compiles a kernel when a
/// submission first runs it, one submission at a time per device, so tests
/// on [`ctx`]'s device compile one after another whatever the test threads.
pub fn own_ctx() -> Option<Arc<GpuContext>> {
    ctx()?;
    Some(GpuContext::new().expect("a second device on the adapter that ctx() opened"))
}

/// A device of its own whose downloads, and uploads from registered host
/// memory, run on a copy queue: a second queue where the device has one,
/// else wgpu's own (lavapipe: the synchronization runs, nothing overlaps).
/// `None` without an adapter or host memory import.
pub fn copy_queue_ctx() -> Option<Arc<GpuContext>> {
    ctx()?;
    let c = GpuContext::with_some_copy_queue().unwrap();
    c.copy_queue().is_some().then_some(c)
}

/// A synthetic corpus, tokens `(i * 7919 + i / div) % vocab` for
/// `i < len`, whose batches are drawn with `Sampling::Random { seed }`.
/// The tests' expected numbers come from these exact streams.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    pub len: u32,
    pub div: u32,
    pub seed: u64,
}

/// The GPU tests' stream (parity, f16 maxima, host floor).
pub const GPU_STREAM: Stream = Stream {
    len: 5000,
    div: 5,
    seed: 5,
};
/// The CPU trainer's and the disk tier's stream.
pub const TRAINER_STREAM: Stream = Stream {
    len: 4000,
    div: 3,
    seed: 9,
};
/// The chunked transfer tests' stream (one process and data parallel).
pub const CHUNK_STREAM: Stream = Stream {
    len: 3000,
    div: 3,
    seed: 11,
};

impl Stream {
    pub fn tokens(self, vocab: usize) -> TokenData {
        TokenData {
            tokens: (0..self.len)
                .map(|i| (i * 7919 + i / self.div) % vocab as u32)
                .collect(),
            loss_mask: None,
            records: None,
        }
    }

    /// Rows `rows` of batch `index` of `batch` rows of `t` tokens.
    pub fn rows(self, vocab: usize, index: u64, batch: usize, rows: Range<usize>, t: usize) -> Batch {
        let sampling = Sampling::Random { seed: self.seed };
        draw_rows(
            &self.tokens(vocab),
            sampling,
            index,
            batch,
            rows,
            t,
            "mem".as_ref(),
        )
        .unwrap()
    }

    /// Batch `index` of `b` rows of `t` tokens.
    pub fn batch(self, vocab: usize, index: u64, b: usize, t: usize) -> Batch {
        self.rows(vocab, index, b, 0..b, t)
    }
}

/// llama-tiny (vocabulary 256) with `layers` blocks.
pub fn llama_tiny(layers: usize) -> ModelConfig {
    let mut c = preset("llama-tiny", None).unwrap();
    c.num_layers = layers;
    c
}

/// mixtral-tiny with `layers` blocks (4 experts, 2 a token).
pub fn mixtral_tiny(layers: usize) -> ModelConfig {
    let mut c = preset("mixtral-tiny", None).unwrap();
    c.num_layers = layers;
    c
}

/// One golden fixture of the zoo per block family (and per RoPE scaling,
/// window and mixture that changes what a block computes).
pub const FAMILIES: [&str; 28] = [
    "gpt2",
    "qwen2",
    "qwen2_window_layers",
    "llama_gqa",
    "llama3_rope",
    "mistral_window",
    "gemma2",
    "gemma3",
    "phi2",
    "phi3_longrope",
    "gpt_neox",
    "olmo2",
    "olmo3",
    "exaone4",
    "starcoder2",
    "cohere2",
    "glm4",
    "granite",
    "smollm3",
    "deepseek_v3",
    "gpt_oss",
    "mixtral",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "kimi_linear",
    "olmo_hybrid",
];

/// The config of the zoo's golden fixture `case`.
pub fn zoo_fixture(case: &str) -> ModelConfig {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures");
    ModelConfig::from_dir(dir.join(case)).unwrap()
}

/// Qwen3-MoE's fixture (6 experts, 3 a token renormalised, the middle
/// of its three blocks dense).
pub fn qwen3_moe_fixture() -> ModelConfig {
    zoo_fixture("qwen3_moe")
}

/// llama-tiny with two heads of 64 (one K/V head), the narrowest head the
/// tensor-core flash attention has.
pub fn llama_head_dim_64(layers: usize) -> ModelConfig {
    let mut c = llama_tiny(layers);
    c.hidden_size = 128;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 64;
    c
}

/// gpt2-nano over 97 symbols with two blocks.
pub fn gpt2_two_blocks() -> ModelConfig {
    let mut c = gpt2_nano(97);
    c.num_layers = 2;
    c
}

/// `model` initialised from `seed` into a tier made by `tier`, streamed
/// through `ex` under `config`.
pub fn trainer<E: Executor>(
    ex: E,
    model: &ModelConfig,
    tier: TierConfig,
    seed: u64,
    config: TrainerConfig,
) -> Trainer<E> {
    let tier = init_tier(model, tier, seed).unwrap();
    Trainer::new(ex, model.clone(), tier, config).unwrap()
}

/// A tier of `transport` copies, all in RAM, holding no gradients.
pub fn copies(transport: TransportDType) -> TierConfig {
    TierConfig {
        transport,
        ..TierConfig::default()
    }
}

/// β2 0.99 and weight decay 0.1, PyTorch's defaults otherwise.
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        beta2: 0.99,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    }
}

/// The chunk and spill tests' settings: K = 2, 7-row head chunks, weight
/// decay 0.1 (AdamW's defaults otherwise), clipping at `clip`.
pub fn k2_config(clip: Option<f64>) -> TrainerConfig {
    TrainerConfig {
        checkpoint_every: 2,
        chunk_rows: 7,
        adamw: AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        },
        grad_clip: clip,
        ..TrainerConfig::default()
    }
}

/// A learning rate that changes every step.
pub const CHANGING_LRS: [f64; 3] = [3e-3, 1e-3, 5e-3];

/// How the steps of a comparison run: the transport, micro-batches per
/// step (more than one sums gradients), blocks kept, gradient elements
/// moved at once.
#[derive(Clone, Copy, Debug)]
pub struct StepCase {
    pub transport: TransportDType,
    pub micro: usize,
    pub keep: usize,
    /// Prime, smaller than every layer, or every layer whole.
    pub chunk: usize,
}

impl StepCase {
    /// Step `step`'s micro-batches of [`CHUNK_STREAM`], 2 rows of 9.
    pub fn micro_batches(&self, vocab: usize, step: usize) -> Vec<Batch> {
        (0..self.micro as u64)
            .map(|k| CHUNK_STREAM.batch(vocab, step as u64 * 10 + k, 2, 9))
            .collect()
    }
}

/// f32 whole layers; bf16 in prime chunks; bf16 over three micro-batches;
/// a block kept, prime chunks.
pub fn step_cases() -> [StepCase; 4] {
    let base = StepCase {
        transport: TransportDType::F32,
        micro: 1,
        keep: 0,
        chunk: usize::MAX / 8,
    };
    [
        base,
        StepCase {
            transport: TransportDType::BF16,
            chunk: 1021,
            ..base
        },
        StepCase {
            transport: TransportDType::BF16,
            micro: 3,
            ..base
        },
        StepCase {
            keep: 1,
            chunk: 1021,
            ..base
        },
    ]
}

/// `Trainer::new` on the CPU executor refuses `config` for `model` (its
/// tier made by `tier`) with an error that holds each of `needles`.
pub fn assert_refused(model: &ModelConfig, tier: TierConfig, config: TrainerConfig, needles: &[&str]) {
    let tier = init_tier(model, tier, 1).unwrap();
    let err = match Trainer::new(megatrain_tensor::CpuExecutor::new(), model.clone(), tier, config) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(err.contains(n), "{err:?} lacks {n:?}");
    }
}

/// A host budget that keeps `model`'s transport copies and the
/// embedding's p, m, v (and gradient, where `hold`) in RAM: every other
/// layer spills.
pub fn spill_all_but_embedding(model: &ModelConfig, transport: TransportDType, hold: bool) -> u64 {
    let tables = model.layer_tables();
    let padded = megatrain_tier::padded_bytes;
    let copies: u64 = tables
        .iter()
        .map(|t| padded(t.numel(), transport.size_in_bytes()))
        .sum();
    copies + if hold { 4 } else { 3 } * padded(tables[0].numel(), 4)
}
