//! Seeded random initialisation, one layer at a time.
//!
//! Matrices and embeddings are drawn from N(0, 0.02²) (HF's
//! `initializer_range`), as are GPT-OSS's attention sinks; biases are
//! zero and norm gains one (Gemma's weights zero: its gains are `1 + w`).
//! GPT-2 scales its residual projections (`attn.c_proj`, `mlp.c_proj`) by
//! 1/sqrt(2·n_layer), as GPT-2 and nanoGPT do.
//!
//! Every tensor is drawn in chunks of `CHUNK` elements, each chunk from its
//! own generator seeded by (seed, layer, tensor, chunk): the result depends on
//! nothing but those numbers (not on thread count), and large layers fill in
//! parallel.

use megatrain_tensor::ParamTable;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal, Uniform};
use rayon::prelude::*;

use crate::{ModelConfig, Result};

const CHUNK: usize = 1 << 16;
pub const INIT_STD: f32 = 0.02;

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser: decorrelates neighbouring seeds.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The standard deviation a parameter is drawn with, or `None` for a
/// constant (`Some(0)` never occurs).
fn init_of(cfg: &ModelConfig, name: &str, decay: bool) -> Init {
    // Qwen3.5's Gated DeltaNet, as transformers initialises it: the
    // decays' `dt_bias` one, `A_log` the log of U(0.01, 16) (kept off 0 so
    // that log A is finite), its gated norm's gain (stored as itself) one;
    // OLMo Hybrid's and Kimi Linear's `dt_bias` (fla's) softplus⁻¹ of a
    // step drawn log-uniformly from [0.001, 0.1] (at least 1e-4), Kimi's
    // `A_log` the log of U(1, 16); their `o_norm` one as any gain.
    let fla = matches!(cfg.arch, crate::Arch::OlmoHybrid | crate::Arch::KimiLinear);
    if name.ends_with(".dt_bias") && fla {
        return Init::InvSoftplusLogUniform(0.001, 0.1, 1e-4);
    }
    if name.ends_with(".A_log") && cfg.arch == crate::Arch::KimiLinear {
        return Init::LogUniform(1.0, 16.0);
    }
    if name.ends_with(".dt_bias") || name.ends_with("linear_attn.norm.weight") {
        return Init::Const(1.0);
    }
    if name.ends_with(".A_log") {
        return Init::LogUniform(0.01, 16.0);
    }
    // GPT-OSS's experts' biases are `gate_up_proj_bias`, `down_proj_bias`.
    if name.ends_with(".bias") || name.ends_with("_bias") {
        Init::Const(0.0)
    } else if name.ends_with(".sinks") {
        // GPT-OSS's sink logits, drawn as transformers draws them.
        Init::Normal(INIT_STD)
    } else if !decay {
        Init::Const(1.0 - cfg.arch.norm_gain_offset().unwrap_or(0.0) as f32)
    } else if cfg.arch.is_gpt2() && name.ends_with("c_proj.weight") {
        Init::Normal(INIT_STD / (2.0 * cfg.num_layers as f32).sqrt())
    } else {
        Init::Normal(INIT_STD)
    }
}

enum Init {
    Const(f32),
    Normal(f32),
    /// The log of a uniform draw from `[lo, hi)`.
    LogUniform(f32, f32),
    /// `softplus⁻¹(dt)` of `dt = max(exp(U(ln lo, ln hi)), floor)`.
    InvSoftplusLogUniform(f32, f32, f32),
}

/// Fills `slab` (laid out by `table`, the table of `layer`) with the layer's
/// seeded initial values.
pub fn init_layer_into(
    cfg: &ModelConfig,
    table: &ParamTable,
    layer: usize,
    seed: u64,
    slab: &mut [f32],
) -> Result<()> {
    if slab.len() != table.numel() {
        return Err(crate::ZooError::invalid(
            "init_layer",
            format!(
                "slab holds {} elements, layer {layer} needs {}",
                slab.len(),
                table.numel()
            ),
        ));
    }
    for (ti, spec) in table.iter().enumerate() {
        let dst = &mut slab[spec.range()];
        match init_of(cfg, &spec.name, spec.decay) {
            Init::Const(c) => dst.fill(c),
            Init::Normal(std) => {
                let normal = Normal::new(0.0f32, std).expect("positive std");
                fill_seeded(dst, seed, layer, ti, |rng| normal.sample(rng));
            }
            Init::LogUniform(lo, hi) => {
                let uniform = Uniform::new(lo, hi).expect("an interval");
                fill_seeded(dst, seed, layer, ti, |rng| uniform.sample(rng).ln());
            }
            Init::InvSoftplusLogUniform(lo, hi, floor) => {
                let uniform = Uniform::new(lo.ln(), hi.ln()).expect("an interval");
                fill_seeded(dst, seed, layer, ti, |rng| {
                    let dt = uniform.sample(rng).exp().max(floor);
                    dt + (-(-dt).exp_m1()).ln()
                });
            }
        }
    }
    Ok(())
}

/// Fills `dst` (tensor `ti` of `layer`) with draws of `draw`, chunk by
/// chunk in parallel, each chunk from its own generator.
fn fill_seeded(
    dst: &mut [f32],
    seed: u64,
    layer: usize,
    ti: usize,
    draw: impl Fn(&mut StdRng) -> f32 + Sync,
) {
    let base = mix(mix(mix(seed) ^ layer as u64) ^ ti as u64);
    dst.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, chunk)| {
        let mut rng = StdRng::seed_from_u64(mix(base ^ ci as u64));
        chunk.iter_mut().for_each(|x| *x = draw(&mut rng));
    });
}

/// The seeded initial slab of one layer.
pub fn init_layer(cfg: &ModelConfig, layer: usize, seed: u64) -> Result<Vec<f32>> {
    let table = cfg.layer_table(layer)?;
    let mut slab = vec![0.0; table.numel()];
    init_layer_into(cfg, &table, layer, seed, &mut slab)?;
    Ok(slab)
}
