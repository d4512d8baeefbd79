//! RoPE scaling read from a `config.json` gives transformers' frequencies:
//! `fixtures/rope_scaling.json` holds, for released models' fields and each
//! optional knob of the formulas (v4 and v5 spellings), the inverse
//! frequencies and attention factor transformers' rotary embedding computes
//! (`tools/make_golden.py`). transformers forms them in f32, we in f64.

use megatrain_zoo::ModelConfig;
use serde_json::Value;

#[test]
fn every_config_gives_the_frequencies_transformers_computes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rope_scaling.json");
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = cases.as_object().unwrap();
    assert!(cases.len() >= 13);
    for (name, case) in cases {
        let cfg =
            ModelConfig::from_json(case["config"].clone(), name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<f64> = serde_json::from_value(case["inv_freq"].clone()).unwrap();
        let end = case["end"].as_u64().unwrap_or(1) as usize;
        let got = cfg.rope_scaling.inv_freq(cfg.rope_theta, cfg.head_dim, end);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // f32 rounding of transformers' own arithmetic, a few ulps.
            assert!(
                ((g - w) / w).abs() < 1e-6,
                "{name}: pair {i}: {g} vs transformers' {w}"
            );
        }
        let att = case["attention_factor"].as_f64().unwrap();
        let got = cfg.rope_scaling.attention_factor();
        assert!(
            (got - att).abs() < 1e-12,
            "{name}: attention factor {got} vs {att}"
        );
    }
}

#[test]
fn released_configs_read_as_their_rope_type() {
    use megatrain_tensor::RopeScaling;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rope_scaling.json");
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let parse = |name: &str| ModelConfig::from_json(cases[name]["config"].clone(), name).unwrap();
    let llama = parse("llama-3.2-1b");
    assert_eq!(
        llama.rope_scaling,
        RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192.0
        }
    );
    assert_eq!(llama.rope_theta, 500000.0);
    assert_eq!(parse("llama3-v5").rope_scaling, llama.rope_scaling);
    assert!(matches!(
        parse("qwen2.5-7b-yarn").rope_scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            truncate: true,
            ..
        }
    ));
    assert!(matches!(
        parse("yarn-top-level-original").rope_scaling,
        RopeScaling::Yarn {
            original_max_positions: 8192.0,
            ..
        }
    ));
    assert_eq!(
        parse("dynamic").rope_scaling,
        RopeScaling::Dynamic {
            factor: 2.0,
            max_positions: 131072.0
        }
    );
}
