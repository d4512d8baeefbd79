//! Generation over a cache gives what running the whole sequence again
//! gives, for every block family of the zoo's golden fixtures: the logits
//! after each step (a prompt, single tokens, several at once), through
//! windows, soft caps, sinks, latent attention, GPT-2's learned positions,
//! LongRoPE's switch of factors past its original context (where the cache
//! is filled again) and the Gated DeltaNet's convolution and state; the
//! tokens `generate` picks, greedy and sampled, with the cache and without,
//! past the context too; and the GPU's cached logits against the CPU's.

mod common;

use megatrain::run::{Decoder, Resident, SampleOptions, generate};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{Executor, F64Executor};
use megatrain_zoo::HfCheckpoint;
use megatrain_zoo::layers::KvCache;

fn fixture(case: &str) -> HfCheckpoint {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/zoo/tests/fixtures");
    HfCheckpoint::open(dir.join(case)).unwrap()
}

const FAMILIES: [&str; 27] = [
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
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "kimi_linear",
    "olmo_hybrid",
];

/// Ids of a 14-token sequence, and the new tokens each cached step takes.
fn sequence(vocab: usize) -> (Vec<u32>, [usize; 8]) {
    let ids = (0..14).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    (ids, [5, 1, 1, 1, 1, 3, 1, 1])
}

fn max_rel(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &x| m.max((x as f64).abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()))
        / scale
}

/// The logits after each step of `steps` through a cache on `ex`, against
/// `want(n)`, the logits of the whole first n tokens.
fn cached_steps_match<E: Executor>(
    ex: &E,
    ckpt: &HfCheckpoint,
    want: impl Fn(&[u32]) -> Vec<f32>,
    tol: f64,
    case: &str,
) {
    let model = Resident::load(ex, ckpt).unwrap();
    let cfg = &ckpt.config;
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
        let got = model
            .next_logits_cached(ex, &mut cache, &ids[cached..end])
            .unwrap();
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
    for case in FAMILIES {
        let ckpt = fixture(case);
        let whole = Resident::load(&ex, &ckpt).unwrap();
        cached_steps_match(&ex, &ckpt, |ids| whole.next_logits(&ex, ids).unwrap(), 1e-9, case);
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
                    seed: 5,
                    decodable: 0,
                    kv_cache: true,
                };
                let with = generate(&ex, &model, &prompt, opts).unwrap();
                let without = generate(
                    &ex,
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

#[test]
fn gpu_cached_logits_match_the_cpu() {
    let Some(ctx) = common::ctx() else { return };
    let gpu = GpuExecutor::new(ctx);
    let cpu = F64Executor::new();
    for case in [
        "gpt2",
        "llama_gqa",
        "mistral_window",
        "gemma2",
        "gpt_oss",
        "deepseek_v3",
        "phi3_longrope",
        "qwen3_5",
        "kimi_linear",
    ] {
        let ckpt = fixture(case);
        let whole = Resident::load(&cpu, &ckpt).unwrap();
        cached_steps_match(
            &gpu,
            &ckpt,
            |ids| whole.next_logits(&cpu, ids).unwrap(),
            1e-4,
            case,
        );
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
        let mut decoder = Decoder::new(&model, true).unwrap();
        let turns: Vec<&[u32]> = vec![&ids[..20], &ids[..45], &other, &other, &ids[..30], &ids[..150]];
        for (turn, prompt) in turns.into_iter().enumerate() {
            let got = decoder.next_logits(&ex, &model, prompt).unwrap();
            let want = model.next_logits(&ex, prompt).unwrap();
            let err = max_rel(&got, &want);
            assert!(
                err <= 1e-9,
                "{case}: turn {turn} ({} ids) differs by {err}",
                prompt.len()
            );
        }
    }
}
