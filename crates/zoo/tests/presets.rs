//! Presets: shapes and parameter counts of the benchmark models (without
//! allocating them), seeded initialisation, and that a preset runs.

use megatrain_tensor::CpuExecutor;
use megatrain_zoo::{PRESET_NAMES, forward_backward, init_layer, preset, upload_layer};

#[test]
fn benchmark_shapes_have_the_published_parameter_counts() {
    for (name, params) in [
        ("gpt2-124m", 124_439_808usize),
        ("tinyllama-1.1b", 1_100_048_384),
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-14b", 14_770_033_664),
        ("llama-3-70b", 70_553_706_496),
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.1-8b", 8_030_261_248),
        ("gemma-3-1b", 999_885_952),
        ("gemma-2-2b", 2_614_341_888),
        ("pythia-1b", 1_011_781_632),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("olmoe-1b-7b", 6_919_161_856),
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
        ("gpt-oss-20b", 20_914_757_184),
        ("gpt-oss-120b", 116_829_156_672),
        ("glm-4.5-air", 106_852_251_264),
        ("glm-4.5", 352_797_829_024),
        ("deepseek-v3", 671_026_419_200),
        ("kimi-k2", 1_026_408_232_448),
        ("deepseek-v2-lite", 15_706_484_224),
        // As transformers counts its config classes' default shapes.
        ("qwen3.5-9b", 8_953_803_264),
        ("qwen3.5-35b-a3b", 34_660_610_688),
        ("qwen3-next-80b-a3b", 79_674_391_296),
        ("olmo-hybrid-7b", 7_430_870_688),
        // transformers' 49,133,074,464 and its 26 routers' correction
        // biases (buffers there, checkpoint tensors here).
        ("kimi-linear-48b-a3b", 49_133_074_464 + 26 * 256),
    ] {
        let cfg = preset(name, None).unwrap();
        assert_eq!(cfg.param_count(), params, "{name}");
        assert_eq!(cfg.layer_tables().len(), cfg.num_layers + 2);
        if cfg.moe.is_none() {
            assert_eq!(
                cfg.active_param_count(),
                params,
                "{name}: every parameter is read"
            );
        }
    }
    // What each token reads: the published 12.9 B, 3.3 B, 1.3 B and 2.7 B.
    for (name, active) in [
        ("mixtral-8x7b", 12_879_925_248usize),
        ("qwen3-30b-a3b", 3_353_032_704),
        ("olmoe-1b-7b", 1_282_017_280),
        ("qwen1.5-moe-a2.7b", 2_689_173_504),
        // gpt-oss's published 3.6 B and 5.1 B leave out the embedding
        // table (201088 × 2880), which a token reads one row of.
        ("gpt-oss-20b", 3_608_307_264 + 579_133_440),
        ("gpt-oss-120b", 5_132_849_472 + 579_133_440),
        // GLM-4.5's 12 B and 32 B likewise, rounded down (12.8 B and 32.9 B).
        ("glm-4.5-air", 13_424_129_664),
        ("glm-4.5", 33_632_266_144),
        // DeepSeek-V3's published 671 B and 37 B; Kimi K2's 1 T and 32 B.
        ("deepseek-v3", 37_552_297_472),
        ("kimi-k2", 32_861_500_928),
        // DeepSeek-V2-Lite's 2.4 B leaves out the embedding table (0.21 B).
        ("deepseek-v2-lite", 2_661_150_208),
        // Qwen's A3B: 3.9 B and 3.5 B with the untied embedding and head
        // (0.62 B and 1.02 B), of which a token reads a row.
        ("qwen3-next-80b-a3b", 3_874_929_408),
        ("qwen3.5-35b-a3b", 3_454_988_928),
    ] {
        assert_eq!(preset(name, None).unwrap().active_param_count(), active, "{name}");
    }
}

#[test]
fn every_preset_builds_and_unknown_is_named() {
    for name in PRESET_NAMES {
        preset(name, Some(65)).unwrap();
    }
    assert!(preset("gpt2-nano", None).is_err());
    let msg = preset("gpt5", None).unwrap_err().to_string();
    assert!(msg.contains("gpt5") && msg.contains("llama-tiny"), "{msg}");
    let nano = preset("gpt2-nano", Some(65)).unwrap();
    assert_eq!(
        (
            nano.num_layers,
            nano.num_heads,
            nano.hidden_size,
            nano.max_position_embeddings
        ),
        (4, 4, 128, 64)
    );
}

#[test]
fn init_is_seeded_and_follows_gpt2() {
    let cfg = preset("gpt2-nano", Some(65)).unwrap();
    let a = init_layer(&cfg, 1, 7).unwrap();
    assert_eq!(a, init_layer(&cfg, 1, 7).unwrap());
    assert_ne!(a, init_layer(&cfg, 1, 8).unwrap());
    assert_ne!(a, init_layer(&cfg, 2, 7).unwrap());
    let t = cfg.layer_table(1).unwrap();
    let std = |name: &str| {
        let s = &a[t.get(name).unwrap().range()];
        let n = s.len() as f64;
        let mean = s.iter().map(|&x| x as f64).sum::<f64>() / n;
        (s.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
    };
    let fc = std("transformer.h.0.mlp.c_fc.weight");
    let proj = std("transformer.h.0.mlp.c_proj.weight");
    assert!((fc - 0.02).abs() < 0.001, "{fc}");
    let want = 0.02 / (2.0 * 4.0f64).sqrt();
    assert!((proj - want).abs() < 0.0005, "{proj} vs {want}");
    let ln = &a[t.get("transformer.h.0.ln_1.weight").unwrap().range()];
    assert!(ln.iter().all(|&x| x == 1.0));
    let b = &a[t.get("transformer.h.0.attn.c_attn.bias").unwrap().range()];
    assert!(b.iter().all(|&x| x == 0.0));
}

#[test]
fn random_llama_tiny_starts_near_uniform_loss() {
    let cfg = preset("llama-tiny", None).unwrap();
    let ex = CpuExecutor::new();
    let tables = cfg.layer_tables();
    let weights: Vec<_> = (0..cfg.num_layers_total())
        .map(|l| upload_layer(&ex, &tables[l], &init_layer(&cfg, l, 1).unwrap()).unwrap())
        .collect();
    let (b, t) = (2, 16);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 37 % 256) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|i| (i * 11 % 256) as i32).collect();
    let out = forward_backward(&cfg, &ex, &weights, &ids, &targets, (b, t, None), 8).unwrap();
    let uniform = (256f64).ln();
    assert!(
        (out.loss - uniform).abs() < 0.05,
        "{} vs ln 256 = {uniform}",
        out.loss
    );
}

/// Qwen3.5's Gated DeltaNet starts as transformers starts it: `dt_bias`
/// and the gated norm's gain (stored as itself) one, `A_log` the log of a
/// draw from U(0.01, 16), and the zero-centred norms' weights zero (gain 1).
#[test]
fn qwen35_init_follows_transformers() {
    let cfg = preset("qwen3.5-tiny", None).unwrap();
    let t = cfg.layer_table(1).unwrap();
    let a = init_layer(&cfg, 1, 7).unwrap();
    let get = |name: &str| &a[t.get(&format!("model.layers.0.{name}")).unwrap().range()];
    assert!(get("linear_attn.dt_bias").iter().all(|&x| x == 1.0));
    assert!(get("linear_attn.norm.weight").iter().all(|&x| x == 1.0));
    assert!(get("input_layernorm.weight").iter().all(|&x| x == 0.0));
    let a_log = get("linear_attn.A_log");
    let (lo, hi) = (0.01f32.ln(), 16.0f32.ln());
    assert!(a_log.iter().all(|&x| (lo..hi).contains(&x)), "{a_log:?}");
    assert!(a_log.windows(2).any(|w| w[0] != w[1]), "{a_log:?}");
    let conv = get("linear_attn.conv1d.weight");
    assert!(conv.iter().any(|&x| x != 0.0) && conv.iter().all(|&x| x.abs() < 0.2));
}
