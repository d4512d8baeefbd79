//! Generation over a cache gives what running the whole sequence again
//! gives, for every block family of the zoo's golden fixtures: the logits
//! after each step (a prompt, single tokens, several at once), through
//! windows, soft caps, sinks, latent attention, GPT-2's learned positions,
//! LongRoPE's switch of factors past its original context (where the cache
//! is filled again) and the Gated DeltaNet's convolution and state; the
//! tokens `generate` picks, greedy and sampled, with the cache and without,
//! past the context too; and the GPU's cached logits against the CPU's.
//! The same holds with the weights streamed from a host tier (every
//! family, f32 and bf16 transport), and for several sequences in one
//! cache, a row each (`generate_samples`: sample i is seed + i's alone).

mod common;

use megatrain::run::{
    Decoder, LanguageModel, Resident, SampleOptions, generate, generate_samples, generate_until,
};
use megatrain::trainer::{Trainer, TrainerConfig, load_tier};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{Executor, F64Executor};
use megatrain_tier::{TierConfig, TransportDType};
use megatrain_zoo::HfCheckpoint;
use megatrain_zoo::layers::KvCache;

fn fixture(case: &str) -> HfCheckpoint {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures");
    HfCheckpoint::open(dir.join(case)).unwrap()
}

/// Ids of a 14-token sequence, and the new tokens each cached step takes.
fn sequence(vocab: usize) -> (Vec<u32>, [usize; 8]) {
    let ids = (0..14).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    (ids, [5, 1, 1, 1, 1, 3, 1, 1])
}

/// `ckpt`'s model streamed from a host tier through a `transport` copy,
/// its blocks taking turns in `checkpoint_every + 1` weight slots.
fn streamed<E: Executor>(
    ex: E,
    ckpt: &HfCheckpoint,
    transport: TransportDType,
    checkpoint_every: usize,
) -> Trainer<E> {
    let tier = load_tier(
        ckpt,
        TierConfig {
            transport,
            ..TierConfig::default()
        },
    )
    .unwrap();
    let config = TrainerConfig {
        checkpoint_every,
        ..TrainerConfig::default()
    };
    Trainer::new(ex, ckpt.config.clone(), tier, config).unwrap()
}

fn max_rel(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &x| m.max((x as f64).abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()))
        / scale
}

/// The logits after each step of `steps` through a cache of `model`,
/// against `want(n)`, the logits of the whole first n tokens.
fn cached_steps_match<E: Executor>(
    model: &impl LanguageModel<E>,
    want: impl Fn(&[u32]) -> Vec<f32>,
    tol: f64,
    case: &str,
) {
    let cfg = model.config();
    let (ids, steps) = sequence(cfg.vocab_size);
    let mut cache = KvCache::new(cfg, ids.len()).unwrap();
    let (mut cached, mut end) = (0, 0);
    let mut refills = 0;
    for n in steps {
        end += n;
        if !cache.ready_for(cfg, end) {
            cached = 0;
            refills += 1;
        }
        let got = model.logits(&ids[cached..end], 1, Some(&mut cache)).unwrap();
        cached = end;
        assert_eq!(cache.len(), end, "{case}");
        let err = max_rel(&got, &want(&ids[..end]));
        assert!(
            err <= tol,
            "{case}: logits after {end} tokens differ by {err} (bound {tol})"
        );
    }
    // LongRoPE's factors switch past its original context of 8.
    assert_eq!(refills, usize::from(case == "phi3_longrope"), "{case}: refills");
}

#[test]
fn cached_logits_are_the_whole_sequence_logits() {
    let ex = F64Executor::new();
    for case in common::FAMILIES {
        let ckpt = fixture(case);
        let model = Resident::load(&ex, &ckpt).unwrap();
        cached_steps_match(&model, |ids| model.logits(ids, 1, None).unwrap(), 1e-9, case);
    }
}

/// Three sequences of one length through one cache of `model`, a row
/// each: every row's logits after each step are `want` of that sequence
/// alone (its keys and values, convolution inputs and state kept apart
/// from the others').
fn batched_rows_match<E: Executor>(
    model: &impl LanguageModel<E>,
    want: impl Fn(&[u32]) -> Vec<f32>,
    tol: f64,
    case: &str,
) {
    let cfg = model.config();
    let vocab = cfg.vocab_size;
    let rows: Vec<Vec<u32>> = (0..3)
        .map(|r| {
            (0..14)
                .map(|i| ((i * 7919 + 13 + r * 101) % vocab) as u32)
                .collect()
        })
        .collect();
    let mut cache = KvCache::new(cfg, 14).unwrap();
    let (mut cached, mut end) = (0, 0);
    for n in sequence(vocab).1 {
        end += n;
        if !cache.ready_for(cfg, end) {
            cached = 0;
        }
        let ids: Vec<u32> = rows.iter().flat_map(|r| r[cached..end].iter().copied()).collect();
        let got = model.logits(&ids, 3, Some(&mut cache)).unwrap();
        cached = end;
        for (r, row) in rows.iter().enumerate() {
            let err = max_rel(&got[r * vocab..(r + 1) * vocab], &want(&row[..end]));
            assert!(err <= tol, "{case}: row {r} after {end} tokens differs by {err}");
        }
    }
}

#[test]
fn a_batched_cache_keeps_each_row_to_itself() {
    let ex = F64Executor::new();
    for case in common::FAMILIES {
        let ckpt = fixture(case);
        let model = Resident::load(&ex, &ckpt).unwrap();
        batched_rows_match(&model, |ids| model.logits(ids, 1, None).unwrap(), 1e-9, case);
    }
}

/// The same on the GPU (its cached attention and delta rule over rows of
/// their own) against the CPU.
#[test]
fn gpu_batched_cache_matches_the_cpu() {
    gpu_against_cpu(
        &[
            "gpt2",
            "llama_gqa",
            "gemma2",
            "deepseek_v3",
            "qwen3_5",
            "kimi_linear",
        ],
        |model, whole, case| batched_rows_match(model, whole, 1e-4, case),
    );
}

/// `generate_samples` makes its samples as a batch, resident or streamed,
/// and sample i is the single generation with seed + i: past GPT-2's
/// context too, and with a stop id that ends one row before the others.
#[test]
fn samples_made_together_are_each_seed_alone() {
    for case in ["gpt2", "llama_gqa", "gemma2", "qwen3_5", "phi3_longrope"] {
        let ckpt = fixture(case);
        let ex = F64Executor::new();
        let resident = Resident::load(&ex, &ckpt).unwrap();
        let stream = streamed(F64Executor::new(), &ckpt, TransportDType::F32, 1);
        let vocab = ckpt.config.vocab_size;
        let prompt: Vec<u32> = (0..26).map(|i| ((i * 31 + 7) % vocab) as u32).collect();
        for kv_cache in [true, false] {
            let opts = SampleOptions {
                tokens: 10,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                repetition_penalty: 1.0,
                seed: 11,
                decodable: 0,
                kv_cache,
            };
            let alone = |i: u64, stop: &[u32]| {
                let o = SampleOptions { seed: 11 + i, ..opts };
                generate_until(&resident, &prompt, o, stop).unwrap()
            };
            let want: Vec<Vec<u32>> = (0..4).map(|i| alone(i, &[])).collect();
            assert!(want.iter().any(|w| w != &want[0]), "{case}: the seeds differ");
            let got = generate_samples(&resident, &prompt, 4, opts, &[]).unwrap();
            assert_eq!(got, want, "{case}, cache {kv_cache}: resident");
            let got = generate_samples(&stream, &prompt, 4, opts, &[]).unwrap();
            assert_eq!(got, want, "{case}, cache {kv_cache}: streamed");
            // Sample 2's fourth token stops it there; the others run on
            // unless they meet it too.
            let stop = [want[2][3]];
            let want: Vec<Vec<u32>> = (0..4).map(|i| alone(i, &stop)).collect();
            assert!(want[2].len() <= 3, "{case}");
            let got = generate_samples(&resident, &prompt, 4, opts, &stop).unwrap();
            assert_eq!(got, want, "{case}, cache {kv_cache}: stopped");
        }
    }
}

#[test]
fn generation_picks_the_same_tokens_with_the_cache_and_without() {
    let ex = F64Executor::new();
    // GPT-2's 32 positions are passed by the second prompt, whose window
    // then slides.
    for case in [
        "llama_gqa",
        "gemma2",
        "deepseek_v3",
        "gpt2",
        "phi3_longrope",
        "qwen3_5",
    ] {
        let ckpt = fixture(case);
        let model = Resident::load(&ex, &ckpt).unwrap();
        let vocab = ckpt.config.vocab_size;
        for len in [3, 26] {
            let prompt: Vec<u32> = (0..len).map(|i| ((i * 31 + 7) % vocab) as u32).collect();
            for (temperature, top_k, top_p) in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)] {
                let opts = SampleOptions {
                    tokens: 12,
                    temperature,
                    top_k,
                    top_p,
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                    seed: 5,
                    decodable: 0,
                    kv_cache: true,
                };
                let with = generate(&model, &prompt, opts).unwrap();
                let without = generate(
                    &model,
                    &prompt,
                    SampleOptions {
                        kv_cache: false,
                        ..opts
                    },
                )
                .unwrap();
                assert_eq!(with.len(), 12, "{case}");
                assert_eq!(
                    with, without,
                    "{case}: prompt of {len}, temperature {temperature}"
                );
            }
        }
    }
}

/// For every family, the streamed forward (every layer loaded from the
/// tier into the weight slots for each step) gives the resident model's
/// logits bit for bit, through the cache and without it, with f32 and bf16
/// transport, and picks the same tokens.
#[test]
fn streamed_generation_is_the_resident_generation() {
    for (i, case) in common::FAMILIES.into_iter().enumerate() {
        // Blocks take turns in two, three or four weight slots.
        let k = 1 + i % 3;
        let ckpt = fixture(case);
        for transport in [TransportDType::F32, TransportDType::BF16] {
            let ex = F64Executor::new();
            let resident = Resident::load_as(&ex, &ckpt, transport).unwrap();
            let stream = streamed(F64Executor::new(), &ckpt, transport, k);
            cached_steps_match(&stream, |ids| resident.logits(ids, 1, None).unwrap(), 0.0, case);
            let (ids, _) = sequence(ckpt.config.vocab_size);
            assert_eq!(
                stream.logits(&ids, 1, None).unwrap(),
                resident.logits(&ids, 1, None).unwrap(),
                "{case} {transport:?}: uncached"
            );
            let opts = SampleOptions {
                tokens: 10,
                temperature: 0.9,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                repetition_penalty: 1.0,
                seed: 3,
                decodable: 0,
                kv_cache: true,
            };
            // Past GPT-2's 32 positions the window slides.
            let prompt: Vec<u32> = ids.iter().cycle().take(26).copied().collect();
            assert_eq!(
                generate(&stream, &prompt, opts).unwrap(),
                generate(&resident, &prompt, opts).unwrap(),
                "{case} {transport:?}: tokens"
            );
        }
    }
}

/// Each of `cases` resident on the GPU, checked by `check` against the
/// CPU's (f64) logits of the whole sequence.
fn gpu_against_cpu(
    cases: &[&str],
    check: impl Fn(&Resident<'_, GpuExecutor>, &dyn Fn(&[u32]) -> Vec<f32>, &str),
) {
    let Some(ctx) = common::ctx() else { return };
    let gpu = GpuExecutor::new(ctx);
    let cpu = F64Executor::new();
    for &case in cases {
        let ckpt = fixture(case);
        let whole = Resident::load(&cpu, &ckpt).unwrap();
        let model = Resident::load(&gpu, &ckpt).unwrap();
        check(&model, &|ids| whole.logits(ids, 1, None).unwrap(), case);
    }
}

#[test]
fn gpu_cached_logits_match_the_cpu() {
    gpu_against_cpu(
        &[
            "gpt2",
            "llama_gqa",
            "mistral_window",
            "gemma2",
            "gpt_oss",
            "deepseek_v3",
            "phi3_longrope",
            "qwen3_5",
            "kimi_linear",
        ],
        |model, whole, case| cached_steps_match(model, whole, 1e-4, case),
    );
}

/// With f16 compute on the GPU (f16 copies, products on f16 operands), the
/// cached steps follow the whole sequence run the same way: the cached
/// attention and delta rule compute in f32 where the whole-sequence ones
/// round their operands to f16, so they agree to f16's precision, not
/// bit for bit.
#[test]
fn gpu_f16_cached_logits_follow_the_uncached() {
    let Some(ctx) = common::ctx() else { return };
    let mut gpu = GpuExecutor::new(ctx);
    if gpu
        .set_compute_precision(megatrain_tensor::ComputePrecision::F16)
        .is_err()
    {
        eprintln!("skipping: {} computes no f16", gpu.name());
        return;
    }
    for case in ["llama_gqa", "gemma2", "qwen3_5"] {
        let ckpt = fixture(case);
        let model = Resident::load_as(&gpu, &ckpt, TransportDType::F16).unwrap();
        cached_steps_match(&model, |ids| model.logits(ids, 1, None).unwrap(), 5e-3, case);
    }
}

/// Every family streamed from the host on the GPU through a bf16 copy (its
/// weight slots refilled for every step: matrices held bf16, the rest
/// widened) as resident on the CPU with the same bf16-rounded weights.
#[test]
fn gpu_streamed_logits_match_the_cpu() {
    let Some(ctx) = common::ctx() else { return };
    let cpu = F64Executor::new();
    for (i, case) in common::FAMILIES.into_iter().enumerate() {
        let ckpt = fixture(case);
        let whole = Resident::load_as(&cpu, &ckpt, TransportDType::BF16).unwrap();
        let model = streamed(
            GpuExecutor::new(ctx.clone()),
            &ckpt,
            TransportDType::BF16,
            1 + i % 2,
        );
        cached_steps_match(&model, |ids| whole.logits(ids, 1, None).unwrap(), 1e-4, case);
    }
}

/// A chat's turns through one [`Decoder`]: a prompt, a longer one that
/// starts with it (only the new ids run), a shorter one that leaves it
/// part way (an attention model's cache is cut back to what they share; a
/// Gated DeltaNet's state cannot be, so it runs the whole prompt again),
/// the same ids again, and ids past the 64 positions the keys and values
/// are first made for (their buffers grow). Each turn's logits are the
/// whole sequence's.
#[test]
fn a_decoder_reuses_what_its_cache_shares_with_the_next_prompt() {
    let ex = F64Executor::new();
    for case in ["llama_gqa", "gemma2", "qwen3_5"] {
        let mut ckpt = fixture(case);
        ckpt.config.max_position_embeddings = 300;
        let model = Resident::load(&ex, &ckpt).unwrap();
        let vocab = ckpt.config.vocab_size;
        let ids: Vec<u32> = (0..150).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let mut other = ids[..30].to_vec();
        other.extend((0..10).map(|i| ((i * 31 + 5) % vocab) as u32));
        let mut decoder = Decoder::new(&ckpt.config, true).unwrap();
        let turns: Vec<&[u32]> = vec![&ids[..20], &ids[..45], &other, &other, &ids[..30], &ids[..150]];
        for (turn, prompt) in turns.into_iter().enumerate() {
            let got = decoder.next_logits(&model, prompt).unwrap();
            let want = model.logits(prompt, 1, None).unwrap();
            let err = max_rel(&got, &want);
            assert!(
                err <= 1e-9,
                "{case}: turn {turn} ({} ids) differs by {err}",
                prompt.len()
            );
        }
    }
}
