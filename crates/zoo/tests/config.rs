//! `config.json` parsing: v4 and v5 field names, defaults, and errors that
//! name the file and the field.

use megatrain_tensor::{AttnMask, RopeScaling, SoftCap};
use megatrain_zoo::{Arch, ModelConfig, Router, ZooError};
use serde_json::{Value, json};

fn parse(v: Value) -> Result<ModelConfig, ZooError> {
    ModelConfig::from_json(v, "dir/config.json")
}

fn llama_v4() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": false,
        "max_position_embeddings": 2048
    })
}

#[test]
fn v4_and_v5_spellings_mean_the_same() {
    let v4 = parse(llama_v4()).unwrap();
    let mut v5 = llama_v4();
    let o = v5.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.remove("torch_dtype");
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": 10000.0}),
    );
    o.insert("dtype".into(), json!("bfloat16"));
    let v5 = parse(v5).unwrap();
    let strip = |mut c: ModelConfig| {
        c.raw = None;
        c
    };
    assert_eq!(strip(v4.clone()), strip(v5));
    assert_eq!(v4.arch, Arch::Llama);
    assert_eq!((v4.num_kv_heads, v4.head_dim), (4, 64));
    assert_eq!(v4.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(v4.param_count(), 1_100_048_384); // TinyLlama-1.1B
}

#[test]
fn rope_theta_inside_rope_parameters_wins_over_default() {
    let mut v = llama_v4();
    v.as_object_mut().unwrap().remove("rope_theta");
    assert_eq!(parse(v.clone()).unwrap().rope_theta, 10000.0);
    v.as_object_mut().unwrap().insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": 5e5}),
    );
    assert_eq!(parse(v).unwrap().rope_theta, 5e5);
}

#[test]
fn unsupported_rope_scaling_is_refused_by_name() {
    for (field, val, named) in [
        (
            "rope_scaling",
            json!({"rope_type": "mrope", "factor": 8.0}),
            "mrope",
        ),
        ("rope_scaling", json!({"type": "su", "factor": 2.0}), "su"),
        (
            "rope_parameters",
            json!({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor",
        ),
    ] {
        let mut v = llama_v4();
        v.as_object_mut().unwrap().insert(field.into(), val);
        let err = parse(v).unwrap_err();
        assert!(matches!(err, ZooError::Unsupported { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(field) && msg.contains(named) && msg.contains("dir/config.json"),
            "{msg}"
        );
    }
}

#[test]
fn rope_scaling_fields_that_cannot_work_are_named() {
    for (val, named) in [
        (
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
            "high_freq_factor",
        ),
        (
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192}),
            "low_freq_factor",
        ),
        (json!({"rope_type": "linear"}), "factor"),
        (json!({"rope_type": "linear", "factor": -2.0}), "factor"),
        (json!({"rope_type": "yarn", "factor": "big"}), "factor"),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "truncate": 1}),
            "truncate",
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}),
            "attention_factor",
        ),
    ] {
        let mut v = llama_v4();
        v["rope_scaling"] = val.clone();
        let msg = bad_msg(v);
        assert!(msg.contains(&format!("rope_scaling.{named}")), "{val}: {msg}");
    }
}

/// Dynamic NTK RoPE: plain frequencies while a forward's positions end
/// within max_position_embeddings (2048 here), a larger base past it, one
/// for each end (transformers' formula; `rope_scaling.rs` checks the numbers
/// against transformers' own).
#[test]
fn dynamic_rope_scales_past_its_context() {
    let mut v = llama_v4();
    v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0});
    let cfg = parse(v).unwrap();
    assert_eq!(
        cfg.rope_scaling,
        RopeScaling::Dynamic {
            factor: 2.0,
            max_positions: 2048.0
        }
    );
    cfg.check_seq_len(8192).unwrap();
    let (theta, d) = (cfg.rope_theta, cfg.head_dim);
    let plain = RopeScaling::None.inv_freq(theta, d, 2048);
    assert_eq!(cfg.rope_scaling.inv_freq(theta, d, 2048), plain);
    let (past, further) = (
        cfg.rope_scaling.inv_freq(theta, d, 2049),
        cfg.rope_scaling.inv_freq(theta, d, 4096),
    );
    // Pair 0 always turns at 1 rad per position; the rest slow down more
    // the further the positions go.
    assert_eq!((past[0], further[0]), (1.0, 1.0));
    assert!(past[5] < plain[5] && further[5] < past[5]);
    assert_ne!(cfg.rope_scaling.key(2048), cfg.rope_scaling.key(2049));
    assert_ne!(cfg.rope_scaling.key(2049), cfg.rope_scaling.key(4096));
    assert_eq!(cfg.rope_scaling.key(100), cfg.rope_scaling.key(2048));
}

#[test]
fn unknown_architecture_and_missing_field_are_named() {
    let mut v = llama_v4();
    v["architectures"] = json!(["FalconForCausalLM"]);
    let msg = parse(v).unwrap_err().to_string();
    assert!(
        msg.contains("FalconForCausalLM") && msg.contains("dir/config.json"),
        "{msg}"
    );

    for field in [
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "architectures",
    ] {
        let mut v = llama_v4();
        v.as_object_mut().unwrap().remove(field);
        let err = parse(v).unwrap_err();
        assert!(matches!(err, ZooError::MissingField { .. }), "{field}: {err:?}");
        assert!(err.to_string().contains(field), "{err}");
    }
}

#[test]
fn bad_values_are_named() {
    let mut v = llama_v4();
    v["num_key_value_heads"] = json!(5);
    let msg = parse(v).unwrap_err().to_string();
    assert!(msg.contains("num_key_value_heads"), "{msg}");
    let mut v = llama_v4();
    v["hidden_size"] = json!("big");
    let msg = parse(v).unwrap_err().to_string();
    assert!(msg.contains("hidden_size") && msg.contains("integer"), "{msg}");
    let mut v = llama_v4();
    v["hidden_act"] = json!("gelu");
    assert!(parse(v).unwrap_err().to_string().contains("hidden_act"));
    let err = ModelConfig::from_json_str("{not json", "x/config.json").unwrap_err();
    assert!(err.to_string().contains("x/config.json"));
    // Values that would train to a NaN loss, refused by name.
    for (field, value) in [
        ("rms_norm_eps", json!(0.0)),
        ("rms_norm_eps", json!(-1e-6)),
        ("rope_theta", json!(-10000.0)),
        ("rope_theta", json!(0)),
    ] {
        let mut v = llama_v4();
        v[field] = value.clone();
        let msg = bad_msg(v);
        assert!(
            msg.contains(&format!("{field} ")) && msg.contains("must be a positive number"),
            "{field} = {value}: {msg}"
        );
    }
    let mut v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 65, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
    });
    v["layer_norm_epsilon"] = json!(-1);
    assert!(bad_msg(v).contains("layer_norm_epsilon -1"));
}

#[test]
fn family_specific_fields() {
    // Qwen2: q/k/v biases always, no o bias.
    let mut v = llama_v4();
    v["architectures"] = json!(["Qwen2ForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    assert_eq!(c.sliding_window, None);
    // use_sliding_window puts the window on layers from max_window_layers
    // (default 28) on: none of these 22, or all of them.
    v["use_sliding_window"] = json!(true);
    assert_eq!(parse(v.clone()).unwrap().sliding_window, None);
    v["max_window_layers"] = json!(0);
    assert_eq!(parse(v.clone()).unwrap().sliding_window, Some(4096));
    v["sliding_window"] = json!(64);
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.attn_mask(0), c.attn_mask(21)),
        (AttnMask::sliding(64), AttnMask::sliding(64))
    );
    // From block 1 on.
    v["max_window_layers"] = json!(1);
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.attn_mask(0), c.attn_mask(1)),
        (AttnMask::CAUSAL, AttnMask::sliding(64))
    );
    assert!(!c.slides(0) && c.slides(1) && c.slides(21));
    // layer_types decides where it is written.
    v["layer_types"] = json!(vec!["sliding_attention"; 22]);
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.sliding_window, c.sliding_layers), (Some(64), None));
    let mut mixed = vec!["sliding_attention"; 22];
    mixed[5] = "full_attention";
    v["layer_types"] = json!(mixed);
    let c = parse(v.clone()).unwrap();
    assert!(c.slides(4) && !c.slides(5) && c.slides(6));
    assert_eq!(c.attn_mask(5), AttnMask::CAUSAL);
    v["layer_types"] = json!(vec!["sliding_attention"; 2]);
    assert!(
        parse(v.clone())
            .unwrap_err()
            .to_string()
            .contains("2 entries for num_hidden_layers = 22")
    );
    v["layer_types"] = json!(vec!["chunked_attention"; 22]);
    assert!(
        parse(v.clone())
            .unwrap_err()
            .to_string()
            .contains("chunked_attention")
    );

    // Qwen3: q/k norms, head_dim defaults to 128 (Qwen3Config), explicit wins.
    let mut v = llama_v4();
    v["architectures"] = json!(["Qwen3ForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    assert!(c.qk_norm && !c.qkv_bias);
    assert_eq!(c.head_dim, 128);
    v["head_dim"] = json!(96);
    assert_eq!(parse(v).unwrap().head_dim, 96);

    // Llama attention_bias covers q, k, v and o; mlp_bias the MLP.
    let mut v = llama_v4();
    v["attention_bias"] = json!(true);
    v["mlp_bias"] = json!(true);
    let c = parse(v).unwrap();
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias);

    // Mistral: default window 4096, null means none; sequences past it run
    // under it; a window of 0 is an error that names the field.
    let mut v = llama_v4();
    v["architectures"] = json!(["MistralForCausalLM"]);
    assert_eq!(parse(v.clone()).unwrap().sliding_window, Some(4096));
    v["sliding_window"] = json!(16);
    let c = parse(v.clone()).unwrap();
    assert!(c.check_seq_len(17).is_ok());
    assert_eq!(c.attn_mask(3), AttnMask::sliding(16));
    v["sliding_window"] = json!(0);
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(msg.contains("sliding_window") && msg.contains("0 keys"), "{msg}");
    v["sliding_window"] = Value::Null;
    let c = parse(v).unwrap();
    assert_eq!((c.sliding_window, c.attn_mask(0)), (None, AttnMask::CAUSAL));

    // Phi-3: no window unless one is written (Phi-3-mini-4k: 2047); every
    // RoPE scaling is longrope to transformers, so refused.
    let mut v = llama_v4();
    v["architectures"] = json!(["Phi3ForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.arch, c.sliding_window, c.qkv_bias, c.mlp_bias),
        (Arch::Phi3, None, false, false)
    );
    v["sliding_window"] = json!(2047);
    let c = parse(v.clone()).unwrap();
    assert!(c.check_seq_len(4096).is_ok());
    assert_eq!(c.attn_mask(0), AttnMask::sliding(2047));
    // Phi3Config reads `yarn` and `su` as longrope, and knows no other.
    v["rope_scaling"] = json!({"type": "yarn", "factor": 4.0});
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(
        msg.contains("rope_scaling.short_factor") && msg.contains("required"),
        "{msg}"
    );
    v["rope_scaling"] = json!({"type": "linear", "factor": 4.0});
    let err = parse(v.clone()).unwrap_err();
    assert!(
        matches!(err, ZooError::Unsupported { .. }) && err.to_string().contains("only longrope"),
        "{err}"
    );
    // Factors must cover head_dim / 2 = 32 pairs.
    v["rope_scaling"] =
        json!({"type": "longrope", "short_factor": vec![1.0; 3], "long_factor": vec![1.0; 3]});
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(
        msg.contains("short_factor has 3 factors") && msg.contains("32 pairs"),
        "{msg}"
    );
    // Phi-4-mini's partial rotary factor: int(64 · 0.75) = 48 entries
    // rotate, and LongRoPE's factors cover their 24 pairs.
    v["partial_rotary_factor"] = json!(0.75);
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(
        msg.contains("the 48 rotated entries of each head have 24 pairs"),
        "{msg}"
    );
    v["rope_scaling"] =
        json!({"type": "longrope", "short_factor": vec![1.0; 24], "long_factor": vec![2.0; 24]});
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.rotary_dim, c.rope(0).rotary_dim), (Some(48), Some(48)));
    // transformers v5 writes it inside rope_parameters.
    let mut v5 = v.clone();
    v5.as_object_mut().unwrap().remove("partial_rotary_factor");
    v5["rope_scaling"]["partial_rotary_factor"] = json!(0.75);
    assert_eq!(parse(v5).unwrap().rotary_dim, Some(48));
    // A factor of 1 rotates everything; outside (0, 1] it is named.
    v["rope_scaling"] = Value::Null;
    v["partial_rotary_factor"] = json!(1.0);
    assert_eq!(parse(v.clone()).unwrap().rotary_dim, None);
    v["partial_rotary_factor"] = json!(1.5);
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(
        msg.contains("partial_rotary_factor") && msg.contains("(0, 1]"),
        "{msg}"
    );
    // An odd count of entries cannot rotate in pairs.
    v["partial_rotary_factor"] = json!(0.3);
    let msg = parse(v).unwrap_err().to_string();
    assert!(msg.contains("RoPE rotates 19 of head_dim 64"), "{msg}");
}

#[test]
fn gpt2_fields() {
    let v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "n_inner": null, "activation_function": "gelu_new"
    });
    let c = parse(v.clone()).unwrap();
    assert!(c.tie_word_embeddings);
    assert_eq!(c.intermediate_size, 3072);
    assert_eq!(c.param_count(), 124_439_808);
    assert!(c.check_seq_len(1025).is_err());
    let mut bad = v.clone();
    bad["activation_function"] = json!("relu");
    assert!(bad_msg(bad).contains("activation_function"));
    let mut bad = v;
    bad["scale_attn_by_inverse_layer_idx"] = json!(true);
    assert!(bad_msg(bad).contains("scale_attn_by_inverse_layer_idx"));
}

/// The dropout a config asks transformers for, as megatrain's hidden and
/// attention rates: GPT-2's pdrops, the Llama family's
/// `attention_dropout`, none where a config says nothing.
#[test]
fn dropout_from_a_config() {
    let gpt2 = json!({
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 97, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.05
    });
    assert_eq!(parse(gpt2.clone()).unwrap().hf_dropout(), Ok((0.1, 0.05)));
    let only_resid = with_fields(&gpt2, json!({"embd_pdrop": null}));
    assert_eq!(parse(only_resid).unwrap().hf_dropout(), Ok((0.1, 0.05)));
    let differ = with_fields(&gpt2, json!({"embd_pdrop": 0.2}));
    let err = parse(differ).unwrap().hf_dropout().unwrap_err();
    assert!(err.contains("embd_pdrop 0.2 and resid_pdrop 0.1 differ"), "{err}");
    let text = with_fields(&gpt2, json!({"attn_pdrop": "high"}));
    let err = parse(text).unwrap().hf_dropout().unwrap_err();
    assert!(err.contains("attn_pdrop is \"high\""), "{err}");
    let llama = with_fields(&llama_v4(), json!({"attention_dropout": 0.02}));
    assert_eq!(parse(llama).unwrap().hf_dropout(), Ok((0.0, 0.02)));
    assert_eq!(parse(llama_v4()).unwrap().hf_dropout(), Ok((0.0, 0.0)));
    assert_eq!(megatrain_zoo::gpt2_nano(65).hf_dropout(), Ok((0.0, 0.0)));
}

fn bad_msg(v: Value) -> String {
    parse(v).unwrap_err().to_string()
}

/// `base` with the fields of `extra` written over it.
fn with_fields(base: &Value, extra: Value) -> Value {
    let mut v = base.clone();
    for (k, x) in extra.as_object().unwrap() {
        v.as_object_mut().unwrap().insert(k.clone(), x.clone());
    }
    v
}

#[test]
fn generated_config_parses_back() {
    for name in megatrain_zoo::PRESET_NAMES {
        let c = megatrain_zoo::preset(name, Some(65)).unwrap();
        let back = parse(c.to_hf_json("float32")).unwrap();
        let mut back = back;
        back.raw = None;
        back.dtype = None;
        assert_eq!(back, c, "{name}");
    }
}

/// OLMo 3 as transformers reads it: three blocks of four slide (window 4096
/// unless written), θ 500000 unless written, and the RoPE scaling only on
/// the full-attention blocks, whether written v4-style (one `rope_theta`,
/// `rope_scaling` for the full blocks) or v5-style (`rope_parameters` per
/// block kind).
#[test]
fn olmo3_windows_and_ropes_by_block_kind() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Olmo3ForCausalLM"]);
    v.as_object_mut().unwrap().remove("rope_theta");
    v["num_hidden_layers"] = json!(8);
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.arch, Arch::Olmo3);
    assert!(c.arch.has_post_norms());
    let slides: Vec<bool> = (0..8).map(|i| c.slides(i)).collect();
    assert_eq!(slides, [true, true, true, false, true, true, true, false]);
    assert_eq!(c.attn_mask(0), AttnMask::sliding(4096));
    assert_eq!(c.attn_mask(3), AttnMask::CAUSAL);
    assert_eq!((c.rope(0).theta, c.rope(3).theta), (5e5, 5e5));
    assert_eq!(c.sliding_rope, None);

    // v4: rope_scaling is the full blocks' only.
    v["rope_theta"] = json!(1e6);
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192});
    let c = parse(v.clone()).unwrap();
    assert!(matches!(c.rope(3).scaling, RopeScaling::Yarn { .. }));
    assert_eq!(c.rope(0).scaling, RopeScaling::None);
    assert_eq!((c.rope(0).theta, c.rope(3).theta), (1e6, 1e6));

    // v5: each kind its own; a bad field is named with its kind.
    let o = v.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    v["rope_parameters"] = json!({
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    });
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.rope(3).scaling, RopeScaling::Linear { factor: 2.0 });
    assert_eq!((c.rope(3).theta, c.rope(1).theta), (1e6, 1e4));
    assert_eq!(c.rope(1).scaling, RopeScaling::None);
    v["rope_parameters"]["full_attention"]["factor"] = json!(-1.0);
    let msg = parse(v.clone()).unwrap_err().to_string();
    assert!(msg.contains("rope_parameters.full_attention.factor"), "{msg}");

    // An explicit layer_types and window win.
    v["rope_parameters"]["full_attention"]["factor"] = json!(2.0);
    v["sliding_window"] = json!(512);
    let mut kinds = vec!["full_attention"; 8];
    kinds[2] = "sliding_attention";
    v["layer_types"] = json!(kinds);
    let c = parse(v).unwrap();
    let slides: Vec<bool> = (0..8).map(|i| c.slides(i)).collect();
    assert_eq!(slides, [false, false, true, false, false, false, false, false]);
    assert_eq!(c.attn_mask(2), AttnMask::sliding(512));
}

/// SmolLM3 as transformers reads it: every fourth block without RoPE
/// (`no_rope_layer_interval`, or `no_rope_layers` as written), under
/// `use_sliding_window` those blocks slide, θ 2000000 and tied embeddings
/// unless written.
#[test]
fn smollm3_nope_blocks_and_their_windows() {
    let mut v = llama_v4();
    v["architectures"] = json!(["SmolLM3ForCausalLM"]);
    v.as_object_mut().unwrap().remove("rope_theta");
    v.as_object_mut().unwrap().remove("tie_word_embeddings");
    v["num_hidden_layers"] = json!(8);
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.arch, c.rope_theta, c.tie_word_embeddings),
        (Arch::SmolLM3, 2e6, true)
    );
    let ropes: Vec<bool> = (0..8).map(|i| c.has_rope(i)).collect();
    assert_eq!(ropes, [true, true, true, false, true, true, true, false]);
    assert!((0..8).all(|i| c.attn_mask(i) == AttnMask::CAUSAL));
    v["no_rope_layer_interval"] = json!(2);
    let c = parse(v.clone()).unwrap();
    assert!(!c.has_rope(1) && c.has_rope(2) && !c.has_rope(3));
    v["no_rope_layers"] = json!([1, 1, 1, 1, 1, 0, 1, 1]);
    v["use_sliding_window"] = json!(true);
    v["sliding_window"] = json!(64);
    let c = parse(v.clone()).unwrap();
    assert!(!c.has_rope(5) && c.has_rope(3));
    assert_eq!(
        (c.attn_mask(5), c.attn_mask(4)),
        (AttnMask::sliding(64), AttnMask::CAUSAL)
    );
    // Every block rotating is no NoPE at all.
    v["no_rope_layers"] = json!(vec![1; 8]);
    assert_eq!(parse(v.clone()).unwrap().nope_layers, None);
    for (bad, named) in [
        (json!([1, 0]), "num_hidden_layers = 8"),
        (json!([1, 2, 1, 1, 1, 1, 1, 1]), "2 is neither"),
    ] {
        v["no_rope_layers"] = bad;
        let msg = parse(v.clone()).unwrap_err().to_string();
        assert!(msg.contains("no_rope_layers") && msg.contains(named), "{msg}");
    }
}

/// Granite's multipliers, each 1 unless written and positive where it is.
#[test]
fn granite_multipliers() {
    let mut v = llama_v4();
    v["architectures"] = json!(["GraniteForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    let ones = megatrain_zoo::Multipliers {
        embedding: 1.0,
        residual: 1.0,
        attention: 1.0,
        logits: 1.0,
    };
    assert_eq!((c.arch, c.multipliers), (Arch::Granite, Some(ones)));
    v["embedding_multiplier"] = json!(12.0);
    v["logits_scaling"] = json!(16);
    let m = parse(v.clone()).unwrap().multipliers.unwrap();
    assert_eq!((m.embedding, m.logits, m.residual), (12.0, 16.0, 1.0));
    v["residual_multiplier"] = json!(-0.2);
    let msg = parse(v).unwrap_err().to_string();
    assert!(
        msg.contains("residual_multiplier") && msg.contains("positive"),
        "{msg}"
    );
    assert_eq!(parse(llama_v4()).unwrap().multipliers, None);
}

/// StarCoder2 as transformers reads it: `use_bias` on every linear layer
/// (default true), `norm_epsilon`, GELU's tanh approximation only, tied
/// embeddings and no window unless written.
#[test]
fn starcoder2_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Starcoder2ForCausalLM"]);
    let o = v.as_object_mut().unwrap();
    o.remove("rms_norm_eps");
    o.remove("tie_word_embeddings");
    let c = parse(v.clone()).unwrap();
    assert!(c.arch.has_layernorm() && c.qkv_bias && c.o_bias && c.mlp_bias);
    assert_eq!(
        (c.norm_eps, c.tie_word_embeddings, c.sliding_window),
        (1e-5, true, None)
    );
    v["use_bias"] = json!(false);
    v["norm_epsilon"] = json!(1e-6);
    v["sliding_window"] = json!(4096);
    let c = parse(v.clone()).unwrap();
    assert!(!c.qkv_bias && !c.mlp_bias);
    assert_eq!((c.norm_eps, c.attn_mask(7)), (1e-6, AttnMask::sliding(4096)));
    v["hidden_act"] = json!("gelu");
    let err = parse(v).unwrap_err();
    assert!(matches!(err, ZooError::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("gelu_pytorch_tanh"), "{err}");
}

/// GLM as transformers reads it: q/k/v biases unless written otherwise,
/// head_dim 128 and half of each head rotated (in neighbouring pairs)
/// unless written; GLM-4-0414 adds the sandwich norms.
#[test]
fn glm_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["GlmForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    assert!(c.qkv_bias && !c.o_bias && !c.mlp_bias && c.arch.is_glm());
    assert_eq!((c.head_dim, c.rotary_dim), (128, Some(64)));
    assert!(c.rope(0).interleaved && !c.arch.has_sandwich_norms());
    v["head_dim"] = json!(64);
    v["partial_rotary_factor"] = json!(1.0);
    v["attention_bias"] = json!(false);
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.rotary_dim, c.qkv_bias), (None, false));
    v["architectures"] = json!(["Glm4ForCausalLM"]);
    let c = parse(v).unwrap();
    assert!(c.arch.has_sandwich_norms());
    let names: Vec<String> = c
        .hf_table(&c.layer_table(1).unwrap())
        .iter()
        .map(|s| s.name.clone())
        .collect();
    for n in [
        "mlp.gate_up_proj.weight",
        "post_self_attn_layernorm.weight",
        "post_mlp_layernorm.weight",
    ] {
        assert!(names.contains(&format!("model.layers.0.{n}")), "{n}: {names:?}");
    }
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.weight".to_string()));
    // Phi-3's partial factor, not Llama's.
    let mut v = llama_v4();
    v["partial_rotary_factor"] = json!(0.5);
    let msg = parse(v).unwrap_err().to_string();
    assert!(
        msg.contains("only to Phi, Phi-3, GLM, GLM-4.5, GPT-NeoX and Qwen3.5"),
        "{msg}"
    );
}

/// EXAONE 4 as transformers reads it: a window (4096 unless written) on
/// all blocks but every `sliding_window_pattern`-th (4 unless written; the
/// letters "LLLG" say the same), those without RoPE; q/k norms per head.
#[test]
fn exaone4_windows_and_nope_blocks() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Exaone4ForCausalLM"]);
    v["num_hidden_layers"] = json!(8);
    let c = parse(v.clone()).unwrap();
    assert!(c.arch.has_post_norms() && c.arch.has_head_qk_norms());
    let kinds: Vec<(bool, bool)> = (0..8).map(|i| (c.slides(i), c.has_rope(i))).collect();
    let (l, g) = ((true, true), (false, false));
    assert_eq!(kinds, [l, l, l, g, l, l, l, g]);
    assert_eq!(c.attn_mask(0), AttnMask::sliding(4096));
    for (pattern, slides) in [
        (json!("LG"), [true, false, true, false, true, false, true, false]),
        (json!(3), [true, true, false, true, true, false, true, true]),
    ] {
        v["sliding_window_pattern"] = pattern;
        let c = parse(v.clone()).unwrap();
        assert_eq!((0..8).map(|i| c.slides(i)).collect::<Vec<_>>(), slides);
        assert!((0..8).all(|i| c.slides(i) == c.has_rope(i)));
    }
    for bad in [json!("LXG"), json!(0)] {
        v["sliding_window_pattern"] = bad;
        assert!(
            parse(v.clone())
                .unwrap_err()
                .to_string()
                .contains("sliding_window_pattern")
        );
    }
    let t = c_table_names(
        &parse({
            let mut v = v.clone();
            v["sliding_window_pattern"] = json!(4);
            v
        })
        .unwrap(),
    );
    assert!(
        t.iter()
            .any(|(n, d)| n.ends_with("q_norm.weight") && *d == vec![64]),
        "{t:?}"
    );
}

fn c_table_names(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    c.layer_table(1)
        .unwrap()
        .iter()
        .map(|s| (s.name.clone(), s.shape.dims().to_vec()))
        .collect()
}

/// Phi-1.5/Phi-2 as transformers reads them: biases everywhere, the LM
/// head's too; half of each head rotated unless written; q/k LayerNorms
/// refused by name.
#[test]
fn phi_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["PhiForCausalLM"]);
    let c = parse(v.clone()).unwrap();
    assert!(c.arch.has_layernorm() && c.arch.has_head_bias() && c.qkv_bias && c.o_bias && c.mlp_bias);
    assert_eq!(c.rotary_dim, Some(32));
    let head = c_table_names(&c).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert!(head.iter().any(|n| n.ends_with("mlp.fc1.bias")), "{head:?}");
    let last = c.layer_table(c.num_layers + 1).unwrap();
    let names: Vec<&str> = last.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.final_layernorm.weight",
            "model.final_layernorm.bias",
            "lm_head.weight",
            "lm_head.bias"
        ]
    );
    v["qk_layernorm"] = json!(true);
    let err = parse(v).unwrap_err();
    assert!(matches!(err, ZooError::Unsupported { .. }) && err.to_string().contains("qk_layernorm"));
}

/// Cohere 2 as transformers reads it: head_dim hidden / heads whatever is
/// written, a window (4096 unless written) on all blocks but every
/// `sliding_window_pattern`-th, those without RoPE, RoPE in neighbouring
/// pairs, logits times `logit_scale` (0.0625 unless written), tied, its
/// LayerNorms without bias.
#[test]
fn cohere2_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Cohere2ForCausalLM"]);
    v["head_dim"] = json!(999);
    v.as_object_mut().unwrap().remove("tie_word_embeddings");
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.head_dim, c.logit_scale, c.logits_factor()),
        (64, Some(0.0625), Some(0.0625))
    );
    assert!(c.tie_word_embeddings && c.arch.has_layernorm() && !c.arch.norm_has_bias());
    assert!(c.rope(0).interleaved && c.has_rope(0) && !c.has_rope(3));
    assert_eq!(
        (c.attn_mask(2), c.attn_mask(3)),
        (AttnMask::sliding(4096), AttnMask::CAUSAL)
    );
    let names: Vec<String> = c_table_names(&c).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "model.layers.0.input_layernorm.weight");
    assert!(!names.iter().any(|n| n.contains("post_attention")), "{names:?}");
    v["logit_scale"] = json!(-1.0);
    assert!(parse(v.clone()).unwrap_err().to_string().contains("logit_scale"));
    // Command R: the same block, RoPE everywhere, no window, head_dim as
    // written; Command R+'s per-head q/k LayerNorms refused by name.
    v["architectures"] = json!(["CohereForCausalLM"]);
    v["logit_scale"] = json!(0.5);
    v["head_dim"] = json!(32);
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (c.head_dim, c.logits_factor(), c.sliding_window),
        (32, Some(0.5), None)
    );
    assert!((0..22).all(|i| c.has_rope(i)) && c.rope(0).interleaved);
    v["use_qk_norm"] = json!(true);
    let err = parse(v).unwrap_err();
    assert!(matches!(err, ZooError::Unsupported { .. }) && err.to_string().contains("use_qk_norm"));
}

/// EleutherAI/pythia-160m's config.json as its v4 checkpoint writes it.
fn pythia_v4() -> Value {
    json!({
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "gelu",
        "hidden_size": 768,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
        "tie_word_embeddings": false,
        "torch_dtype": "float16",
        "transformers_version": "4.24.0",
        "use_cache": true,
        "use_parallel_residual": true,
        "vocab_size": 50304
    })
}

/// GPT-NeoX as transformers reads it: v4's `rotary_emb_base` and
/// `rotary_pct` (0.25 unless written) or v5's `rope_parameters`, the exact
/// GELU under `gelu`, biases unless `attention_bias` is false (the MLP's
/// always), untied, LayerNorms with biases, `use_parallel_residual`.
#[test]
fn gpt_neox_fields() {
    let c = parse(pythia_v4()).unwrap();
    assert_eq!(c.arch, Arch::GptNeox);
    assert_eq!(
        (c.head_dim, c.num_kv_heads, c.rotary_dim, c.rope_theta),
        (64, 12, Some(16), 10000.0)
    );
    assert!(c.exact_gelu && c.parallel_residual && !c.tie_word_embeddings);
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias && c.arch.norm_has_bias());
    // Pythia-160m's published count.
    assert_eq!(c.param_count(), 162_322_944);
    let names: Vec<String> = c_table_names(&c).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"gpt_neox.layers.0.attention.query_key_value.weight".to_string()));
    assert_eq!(
        c.layer_table(13).unwrap().iter().last().unwrap().name,
        "embed_out.weight"
    );

    let mut v = pythia_v4();
    for k in [
        "rotary_pct",
        "rotary_emb_base",
        "use_parallel_residual",
        "hidden_act",
    ] {
        v.as_object_mut().unwrap().remove(k);
    }
    v["attention_bias"] = json!(false);
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.rotary_dim, c.rope_theta), (Some(16), 10000.0));
    assert!(c.exact_gelu && c.parallel_residual && !c.qkv_bias && !c.o_bias && c.mlp_bias);
    // v5's spelling wins over v4's.
    v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5});
    v["rotary_pct"] = json!(0.25);
    v["hidden_act"] = json!("gelu_new");
    v["use_parallel_residual"] = json!(false);
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.rotary_dim, c.rope_theta), (Some(32), 500.0));
    assert!(!c.exact_gelu && !c.parallel_residual);
    // Written back, the config parses to itself.
    let mut generated = c.clone();
    generated.raw = None;
    let back = parse(generated.to_hf_json("float32")).unwrap();
    assert_eq!(
        (back.rotary_dim, back.rope_theta, back.exact_gelu),
        (Some(32), 500.0, false)
    );
    assert!(!back.parallel_residual && !back.qkv_bias);

    for (field, value) in [
        ("rotary_pct", json!(0.0)),
        ("rotary_pct", json!(1.5)),
        ("hidden_act", json!("relu")),
    ] {
        let mut bad = pythia_v4();
        bad[field] = value;
        let err = parse(bad).unwrap_err().to_string();
        assert!(err.contains(field.split('_').next().unwrap()), "{field}: {err}");
    }
}

fn cap(c: f32) -> SoftCap {
    SoftCap::new(c, "test").unwrap()
}

/// Gemma 2 as transformers reads it: Gemma 3's defaults where they share
/// them, but 8192 positions, one RoPE (θ 10000), every other block sliding
/// from the first, no q/k norms, and scores and logits soft-capped (50 and
/// 30) unless written (null: not at all).
#[test]
fn gemma2_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Gemma2ForCausalLM"]);
    v["model_type"] = json!("gemma2");
    v["num_hidden_layers"] = json!(5);
    let o = v.as_object_mut().unwrap();
    for k in [
        "rope_theta",
        "tie_word_embeddings",
        "max_position_embeddings",
        "pad_token_id",
    ] {
        o.remove(k);
    }
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (
            c.head_dim,
            c.rope_theta,
            c.max_position_embeddings,
            c.pad_token_id
        ),
        (256, 10000.0, 8192, Some(0))
    );
    assert!(c.tie_word_embeddings && !c.qk_norm && c.arch.has_sandwich_norms());
    assert_eq!(
        (c.arch.glu(), c.arch.norm_gain_offset()),
        (megatrain_tensor::Glu::Gelu, Some(1.0))
    );
    assert_eq!(
        (c.attn_softcap, c.final_softcap),
        (Some(cap(50.0)), Some(cap(30.0)))
    );
    let capped = |m: AttnMask| m.with_softcap(cap(50.0));
    assert_eq!(
        (0..5).map(|i| c.attn_mask(i)).collect::<Vec<_>>(),
        [
            capped(AttnMask::sliding(4096)),
            capped(AttnMask::CAUSAL),
            capped(AttnMask::sliding(4096)),
            capped(AttnMask::CAUSAL),
            capped(AttnMask::sliding(4096)),
        ]
    );
    assert!((0..5).all(|i| c.rope(i).theta == 10000.0));
    assert_eq!(c.q_factor(), None);
    assert_eq!(c.embedding_factor(), Some(2048f64.sqrt() as f32 as f64));
    let names: Vec<String> = c_table_names(&c).into_iter().map(|(n, _)| n).collect();
    assert!(!names.iter().any(|n| n.contains("q_norm")), "{names:?}");
    assert!(names.contains(&"model.layers.0.post_feedforward_layernorm.weight".to_string()));

    v["attn_logit_softcapping"] = Value::Null;
    v["final_logit_softcapping"] = json!(12.5);
    v["query_pre_attn_scalar"] = json!(144);
    let c = parse(v.clone()).unwrap();
    assert_eq!((c.attn_softcap, c.final_softcap), (None, Some(cap(12.5))));
    assert_eq!(c.attn_mask(0), AttnMask::sliding(4096));
    assert!((c.q_factor().unwrap() - (256.0f64 / 144.0).sqrt()).abs() < 1e-15);

    for (field, value) in [
        ("attn_logit_softcapping", json!(0.0)),
        ("final_logit_softcapping", json!(-30.0)),
        ("attn_logit_softcapping", json!("50")),
    ] {
        let mut bad = v.clone();
        bad[field] = value;
        let err = parse(bad).unwrap_err();
        assert!(
            matches!(err, ZooError::BadField { .. }) && err.to_string().contains(field),
            "{field}: {err}"
        );
    }
    let mut bad = v.clone();
    bad["use_bidirectional_attention"] = json!(true);
    assert!(matches!(parse(bad).unwrap_err(), ZooError::Unsupported { .. }));
}

/// google/gemma-3-4b-pt's config.json (vision_config cut short): the text
/// model's config nested, most of its shape left to Gemma3TextConfig's
/// defaults; the token ids and dtype outside it.
fn gemma3_4b_multimodal() -> Value {
    json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}
    })
}

/// The multimodal class loads as its text model: Gemma3TextConfig's
/// defaults fill what `text_config` leaves out (vocabulary 262208, 8/4
/// heads), and it is written back as that text model.
#[test]
fn gemma3_multimodal_reads_its_text_config() {
    let c = parse(gemma3_4b_multimodal()).unwrap();
    assert_eq!(
        (c.arch, c.text_of),
        (Arch::Gemma3, Some("Gemma3ForConditionalGeneration"))
    );
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (262208, 2560, 34, 8, 4, 256)
    );
    // The language model of Gemma 3 4B.
    assert_eq!(c.param_count(), 3_880_263_168);
    assert_eq!(c.rope(5).scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!((c.rope(0).theta, c.rope(0).scaling), (10000.0, RopeScaling::None));
    assert_eq!(
        (c.attn_mask(0), c.attn_mask(5)),
        (AttnMask::sliding(1024), AttnMask::CAUSAL)
    );
    assert!(c.tie_word_embeddings);
    assert_eq!((c.dtype.as_deref(), c.pad_token_id), (Some("bfloat16"), Some(0)));
    let out = c.to_hf_json("float32");
    assert_eq!(
        (&out["architectures"], &out["model_type"], &out["eos_token_id"]),
        (
            &json!(["Gemma3ForCausalLM"]),
            &json!("gemma3_text"),
            &json!([1, 106])
        )
    );
    assert!(out.get("vision_config").is_none() && out.get("text_config").is_none());
    let back = parse(out).unwrap();
    assert_eq!((back.text_of, back.param_count()), (None, c.param_count()));

    let mut v = gemma3_4b_multimodal();
    v["text_config"]["model_type"] = json!("llama");
    let err = parse(v).unwrap_err();
    assert!(
        matches!(err, ZooError::Unsupported { .. }) && err.to_string().contains("llama"),
        "{err}"
    );
    let mut v = gemma3_4b_multimodal();
    v.as_object_mut().unwrap().remove("text_config");
    let err = parse(v).unwrap_err();
    assert!(
        matches!(
            err,
            ZooError::MissingField {
                field: "text_config",
                ..
            }
        ),
        "{err}"
    );
    let mut v = gemma3_4b_multimodal();
    v["text_config"]["num_hidden_layers"] = json!(0);
    assert!(parse(v).unwrap_err().to_string().contains("num_hidden_layers"));
}

/// Gemma 3 as transformers reads it: head_dim 256, θ 1e6 on the full
/// blocks and `rope_local_base_freq` (10000) on the sliding ones, five of
/// six blocks sliding (window 4096), `rope_scaling` on the full blocks
/// only, scores times `query_pre_attn_scalar`^−½ (256), embeddings times
/// √hidden, tied, pad token 0 where none is written; its norm names, GeGLU,
/// gains 1 + w; logits soft-capped only where written, scores never.
/// Bidirectional attention is refused.
#[test]
fn gemma3_fields() {
    let mut v = llama_v4();
    v["architectures"] = json!(["Gemma3ForCausalLM"]);
    v["model_type"] = json!("gemma3_text");
    v["num_hidden_layers"] = json!(12);
    v["vocab_size"] = json!(262144);
    let o = v.as_object_mut().unwrap();
    for k in ["rope_theta", "tie_word_embeddings", "max_position_embeddings"] {
        o.remove(k);
    }
    let c = parse(v.clone()).unwrap();
    assert_eq!(
        (
            c.head_dim,
            c.rope_theta,
            c.max_position_embeddings,
            c.pad_token_id
        ),
        (256, 1e6, 131072, Some(0))
    );
    assert!(c.tie_word_embeddings && c.qk_norm && c.arch.has_sandwich_norms());
    assert_eq!(
        (c.arch.glu(), c.arch.norm_gain_offset()),
        (megatrain_tensor::Glu::Gelu, Some(1.0))
    );
    assert_eq!(c.rope(0).theta, 10000.0);
    assert_eq!(c.rope(5).theta, 1e6);
    assert_eq!(
        (c.attn_mask(4), c.attn_mask(5), c.attn_mask(11)),
        (AttnMask::sliding(4096), AttnMask::CAUSAL, AttnMask::CAUSAL)
    );
    // Scores times 256^-1/2 = head_dim's: q is left as it is.
    assert_eq!(c.q_factor(), None);
    assert_eq!(c.embedding_factor(), Some(2048f64.sqrt() as f32 as f64));
    let names: Vec<String> = c_table_names(&c).into_iter().map(|(n, _)| n).collect();
    for norm in [
        "input_layernorm",
        "self_attn.q_norm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ] {
        assert!(
            names.contains(&format!("model.layers.0.{norm}.weight")),
            "{norm}: {names:?}"
        );
    }

    // v4's spelling: rope_theta and rope_scaling are the full blocks'.
    v["rope_theta"] = json!(500000.0);
    v["rope_local_base_freq"] = json!(20000.0);
    v["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
    v["query_pre_attn_scalar"] = json!(168);
    v["head_dim"] = json!(128);
    v["pad_token_id"] = Value::Null;
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.rope(5).theta, 500000.0);
    assert_eq!(c.rope(5).scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!((c.rope(0).theta, c.rope(0).scaling), (20000.0, RopeScaling::None));
    assert!((c.q_factor().unwrap() - (128.0f64 / 168.0).sqrt()).abs() < 1e-15);
    assert_eq!(c.pad_token_id, None);
    // v5's: one rope_parameters per block kind.
    let o = v.as_object_mut().unwrap();
    for k in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
        o.remove(k);
    }
    v["rope_parameters"] = json!({
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
    });
    let v5 = parse(v.clone()).unwrap();
    assert_eq!((v5.rope(5), v5.rope(0)), (c.rope(5), c.rope(0)));

    assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
    let mut capped = v.clone();
    capped["final_logit_softcapping"] = json!(30.0);
    capped["attn_logit_softcapping"] = json!(50.0);
    let capped = parse(capped).unwrap();
    assert_eq!(capped.final_softcap, Some(cap(30.0)));
    assert_eq!((capped.attn_softcap, capped.attn_mask(0).softcap), (None, None));

    for (field, value) in [
        ("use_bidirectional_attention", json!(true)),
        ("hidden_activation", json!("gelu")),
    ] {
        let mut bad = v.clone();
        bad[field] = value;
        let err = parse(bad).unwrap_err();
        assert!(
            matches!(err, ZooError::Unsupported { .. })
                && err.to_string().contains(field.split('_').next().unwrap()),
            "{field}: {err}"
        );
    }
    v["query_pre_attn_scalar"] = json!(0);
    assert!(
        parse(v)
            .unwrap_err()
            .to_string()
            .contains("query_pre_attn_scalar")
    );
}

/// Where a config omits `pad_token_id`, its class's default id is the
/// embedding row transformers freezes; an explicit null freezes none.
#[test]
fn absent_pad_token_ids_take_the_class_default() {
    for (arch, id) in [
        ("Olmo2ForCausalLM", Some(1)),
        ("CohereForCausalLM", Some(0)),
        ("Phi3ForCausalLM", Some(32000)),
        ("LlamaForCausalLM", None),
        // Past this vocabulary of 32000: nothing to freeze.
        ("SmolLM3ForCausalLM", None),
    ] {
        let mut v = llama_v4();
        v["architectures"] = json!([arch]);
        v["vocab_size"] = json!(32064);
        assert_eq!(parse(v.clone()).unwrap().pad_token_id, id, "{arch}");
        v["pad_token_id"] = Value::Null;
        assert_eq!(parse(v).unwrap().pad_token_id, None, "{arch}");
    }
}

#[test]
fn mixture_of_experts_fields() {
    let mixtral = |extra: Value| {
        let mut v = llama_v4();
        let o = v.as_object_mut().unwrap();
        o.insert("architectures".into(), json!(["MixtralForCausalLM"]));
        o.insert("model_type".into(), json!("mixtral"));
        for (k, x) in extra.as_object().unwrap() {
            o.insert(k.clone(), x.clone());
        }
        v
    };
    // MixtralConfig's defaults: 8 experts, 2 a token, renormalised, on
    // every block, each as wide as intermediate_size; no window.
    let c = parse(mixtral(json!({}))).unwrap();
    assert_eq!(c.arch, Arch::Mixtral);
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.expert_size, m.norm_topk),
        (8, 2, 5632, true)
    );
    assert!(m.sparse_layers.is_none() && (0..22).all(|i| m.routes(i)));
    assert_eq!(c.sliding_window, None);
    // transformers' alias for the count, and a conflict between the two.
    let c = parse(mixtral(json!({"num_experts": 4}))).unwrap();
    assert_eq!(c.moe.unwrap().num_experts, 4);
    let msg = bad_msg(mixtral(json!({"num_experts": 4, "num_local_experts": 8})));
    assert!(msg.contains("num_local_experts") && msg.contains("4"), "{msg}");

    // What changes training beyond the loss is refused, named.
    for (extra, needle) in [
        (json!({"router_jitter_noise": 0.01}), "router_jitter_noise"),
        (json!({"num_experts_per_tok": 9}), "num_experts_per_tok"),
        (
            json!({"output_router_logits": true, "router_aux_loss_coef": -1.0}),
            "router_aux_loss_coef",
        ),
    ] {
        let msg = bad_msg(mixtral(extra));
        assert!(
            msg.contains(needle) && msg.contains("dir/config.json"),
            "{needle}: {msg}"
        );
    }

    // The load-balancing loss only under output_router_logits, with the
    // class's coefficient unless written (OLMoE's below).
    assert_eq!(
        parse(mixtral(json!({}))).unwrap().moe.unwrap().aux_loss_coef,
        None
    );
    let only = parse(mixtral(json!({"router_aux_loss_coef": 0.02}))).unwrap();
    assert_eq!(only.moe.unwrap().aux_loss_coef, None);
    let on = parse(mixtral(json!({"output_router_logits": true}))).unwrap();
    assert_eq!(on.moe.as_ref().unwrap().aux_loss_coef, Some(0.001));
    let back = parse(on.to_hf_json("float32")).unwrap();
    assert_eq!(back.moe, on.moe);
    let on = parse(mixtral(
        json!({"output_router_logits": true, "router_aux_loss_coef": 0.02}),
    ))
    .unwrap();
    assert_eq!(on.moe.unwrap().aux_loss_coef, Some(0.02));

    let qwen = |extra: Value| {
        let mut v = json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 1000,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        });
        for (k, x) in extra.as_object().unwrap() {
            v.as_object_mut().unwrap().insert(k.clone(), x.clone());
        }
        v
    };
    // Qwen3MoeConfig's defaults: 128 experts of 768, 8 a token, not
    // renormalised; head_dim 128 and per-head q/k norms as Qwen3's.
    let c = parse(qwen(json!({}))).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.expert_size, m.norm_topk),
        (128, 8, 768, false)
    );
    assert!(c.qk_norm && c.head_dim == 128 && m.sparse_layers.is_none());
    // Every second block routes, but for block 3 (mlp_only_layers); a dense
    // block's table is the dense MLP's.
    let c = parse(qwen(
        json!({"decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 4,
        "num_experts_per_tok": 2}),
    ))
    .unwrap();
    let m = c.moe.clone().unwrap();
    let routes: Vec<bool> = (0..6).map(|i| m.routes(i)).collect();
    assert_eq!(routes, [false, true, false, false, false, true]);
    let names = |layer: usize| -> Vec<String> {
        c.layer_table(layer + 1)
            .unwrap()
            .iter()
            .map(|p| p.name.clone())
            .collect()
    };
    assert!(names(0).contains(&"model.layers.0.mlp.gate_proj.weight".to_string()));
    assert!(names(1).contains(&"model.layers.1.mlp.gate.weight".to_string()));
    assert!(names(1).contains(&"model.layers.1.mlp.experts.3.down_proj.weight".to_string()));
    assert!(!names(1).iter().any(|n| n.ends_with("mlp.gate_proj.weight")));
    // No experts, or no block that routes: a dense model.
    assert!(parse(qwen(json!({"num_experts": 0}))).unwrap().moe.is_none());
    assert!(
        parse(qwen(json!({"decoder_sparse_step": 7})))
            .unwrap()
            .moe
            .is_none()
    );
    let msg = bad_msg(qwen(json!({"mlp_only_layers": [6]})));
    assert!(
        msg.contains("mlp_only_layers") && msg.contains("block 6"),
        "{msg}"
    );
    // Written back, a config reads as itself.
    let back = parse(c.to_hf_json("float32")).unwrap();
    assert_eq!(back.moe, c.moe);
    // OLMoE: its norms of q and k span the whole projections; clip_qkv
    // (a clamp none of its releases has) is refused.
    let olmoe = json!({
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    });
    let c = parse(olmoe.clone()).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.expert_size, m.norm_topk),
        (64, 8, 128, false)
    );
    assert_eq!(c.pad_token_id, Some(1));
    let t = c.layer_table(1).unwrap();
    assert_eq!(
        t.get("model.layers.0.self_attn.q_norm.weight")
            .unwrap()
            .shape
            .dims(),
        [256]
    );
    assert_eq!(
        t.get("model.layers.0.self_attn.k_norm.weight")
            .unwrap()
            .shape
            .dims(),
        [128]
    );
    let mut on = olmoe.clone();
    on.as_object_mut()
        .unwrap()
        .insert("output_router_logits".into(), json!(true));
    assert_eq!(parse(on).unwrap().moe.unwrap().aux_loss_coef, Some(0.01));
    let mut clipped = olmoe;
    clipped
        .as_object_mut()
        .unwrap()
        .insert("clip_qkv".into(), json!(8.0));
    assert!(bad_msg(clipped).contains("clip_qkv"));
    // Qwen2-MoE: q/k/v biases unless qkv_bias is false, Qwen2MoeConfig's
    // defaults, and the shared expert with its gate after the experts.
    let q2 = json!({
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    });
    let c = parse(q2.clone()).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_size,
            m.norm_topk,
            m.shared_expert
        ),
        (60, 4, 1408, false, Some(5632))
    );
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    let names: Vec<String> = c.layer_table(1).unwrap().iter().map(|p| p.name.clone()).collect();
    let tail = &names[names.len() - 4..];
    assert_eq!(
        tail,
        [
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
            "model.layers.0.mlp.shared_expert.down_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
        ]
    );
    let mut unbiased = q2;
    unbiased
        .as_object_mut()
        .unwrap()
        .insert("qkv_bias".into(), json!(false));
    let back = parse(parse(unbiased).unwrap().to_hf_json("float32")).unwrap();
    assert!(!back.qkv_bias && back.moe.unwrap().shared_expert == Some(5632));
    for name in [
        "mixtral-tiny",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "olmoe-1b-7b",
        "qwen1.5-moe-a2.7b",
        "gpt-oss-20b",
    ] {
        let p = megatrain_zoo::preset(name, None).unwrap();
        let back = parse(p.to_hf_json("float32")).unwrap();
        assert_eq!((back.arch, &back.moe), (p.arch, &p.moe), "{name}");
        assert_eq!(back.param_count(), p.param_count(), "{name}");
    }
}

/// GPT-OSS as GptOssConfig reads it: with nothing but the shape written,
/// q/k/v/o biases, a window of 128 on every other block from the first,
/// YaRN (factor 32 over 4096, untruncated) at θ 150000, 128 experts of
/// which 4 a token, renormalised, each clamped at 7 with α 1.702; the
/// router's and experts' biases and the sinks in the table, each kind's
/// experts stacked in the checkpoint. Its MXFP4 quantization is the only
/// `quantization_config` read; any other is refused, named.
#[test]
fn gpt_oss_fields() {
    let g = json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    });
    let c = parse(g.clone()).unwrap();
    assert_eq!(c.arch, Arch::GptOss);
    assert!(c.arch.has_attention_sinks());
    assert!(c.qkv_bias && c.o_bias && !c.mlp_bias && !c.qk_norm && !c.tie_word_embeddings);
    assert_eq!((c.head_dim, c.norm_eps, c.rope_theta), (64, 1e-5, 150000.0));
    assert_eq!(c.max_position_embeddings, 131072);
    assert_eq!(c.sliding_window, Some(128));
    assert_eq!(c.sliding_layers, Some(vec![true, false, true]));
    match c.rope_scaling {
        RopeScaling::Yarn {
            factor,
            original_max_positions,
            truncate,
            attention_factor,
            ..
        } => {
            assert_eq!((factor, original_max_positions, truncate), (32.0, 4096.0, false));
            assert!((attention_factor - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-15);
        }
        ref other => panic!("GptOssConfig's default RoPE is YaRN, not {other:?}"),
    }
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_size,
            m.norm_topk,
            m.aux_loss_coef
        ),
        (128, 4, 32, true, None)
    );
    let clamp = m.clamped.unwrap();
    assert_eq!((clamp.alpha, clamp.limit), (1.702, 7.0));
    assert_eq!(m.expert_params(64), 3 * 32 * 64 + 2 * 32 + 64);

    let table = c.layer_table(1).unwrap();
    let names: Vec<&str> = table.iter().map(|p| p.name.as_str()).collect();
    for n in [
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.router.bias",
        "model.layers.0.mlp.experts.127.down_proj_bias",
    ] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    let hf = c.hf_table(&table);
    let shapes: Vec<(String, Vec<usize>)> = hf
        .iter()
        .map(|p| (p.name.clone(), p.shape.dims().to_vec()))
        .collect();
    for (n, dims) in [
        ("model.layers.0.self_attn.sinks", vec![4]),
        ("model.layers.0.mlp.router.weight", vec![128, 64]),
        ("model.layers.0.mlp.experts.gate_up_proj", vec![128, 64, 64]),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", vec![128, 64]),
        ("model.layers.0.mlp.experts.down_proj", vec![128, 32, 64]),
        ("model.layers.0.mlp.experts.down_proj_bias", vec![128, 64]),
    ] {
        assert!(
            shapes.contains(&(n.to_string(), dims.clone())),
            "{n} {dims:?} in {shapes:?}"
        );
    }
    assert_eq!(hf.numel(), table.numel());
    assert!(!hf.iter().any(|p| p.name.contains("experts.0.")));

    // The Hub's alias for k, a conflict named; the clamp's constants.
    let with = |extra: Value| with_fields(&g, extra);
    let c = parse(with(json!({"experts_per_token": 2, "swiglu_limit": 3.5}))).unwrap();
    let m = c.moe.unwrap();
    assert_eq!((m.top_k, m.clamped.unwrap().limit), (2, 3.5));
    let msg = bad_msg(with(json!({"experts_per_token": 2, "num_experts_per_tok": 4})));
    assert!(msg.contains("num_experts_per_tok"), "{msg}");
    assert!(bad_msg(with(json!({"swiglu_limit": 0.0}))).contains("swiglu_limit"));

    let mx = json!({"quantization_config": {"quant_method": "mxfp4"}});
    let c = parse(with(mx)).unwrap();
    assert!(
        c.to_hf_json("float32").get("quantization_config").is_none(),
        "an export writes its tensors unquantized"
    );
    let msg = bad_msg(with(
        json!({"quantization_config": {"quant_method": "bitsandbytes"}}),
    ));
    assert!(
        msg.contains("bitsandbytes") && msg.contains("dir/config.json"),
        "{msg}"
    );
    let mut llama = llama_v4();
    llama
        .as_object_mut()
        .unwrap()
        .insert("quantization_config".into(), json!({"quant_method": "mxfp4"}));
    assert!(bad_msg(llama).contains("quantization_config"));
}

/// GLM-4.5 as Glm4MoeConfig reads it: 128 experts of which 8 a token
/// behind DeepSeek-V3's router (one group, no scale unless written), one
/// ungated shared expert, the first block dense; RoPE on half of each head
/// in halves; q/k/v biases and q/k norms only where written; the router's
/// correction bias in the table; `output_router_logits` adds nothing, as
/// in transformers. A group count that does not divide the experts, or
/// leaves too few of them open, is refused.
#[test]
fn glm4_moe_fields() {
    let g = json!({
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    });
    let c = parse(g.clone()).unwrap();
    assert_eq!(c.arch, Arch::Glm4Moe);
    assert!(!c.qkv_bias && !c.o_bias && !c.qk_norm && !c.tie_word_embeddings);
    assert_eq!((c.rotary_dim, c.norm_eps), (Some(8), 1e-5));
    assert!(!c.rope(1).interleaved);
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_size,
            m.norm_topk,
            m.aux_loss_coef
        ),
        (128, 8, 1408, true, None)
    );
    assert_eq!((m.shared_expert, m.shared_gated), (Some(1408), false));
    assert_eq!(
        m.router,
        Router::Sigmoid {
            groups: 1,
            topk_groups: 1,
            scale: 1.0
        }
    );
    assert!(!m.routes(0) && m.routes(1) && m.routes(2));
    let names: Vec<String> = c.layer_table(2).unwrap().iter().map(|p| p.name.clone()).collect();
    for n in [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.127.down_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
    ] {
        assert!(names.contains(&n.to_string()), "{n}");
    }
    assert!(!names.iter().any(|n| n.contains("shared_expert_gate")));

    let with = |extra: Value| with_fields(&g, extra);
    let c = parse(with(json!({
        "attention_bias": true, "use_qk_norm": true, "n_routed_experts": 16, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 2,
        "first_k_dense_replace": 0, "output_router_logits": true,
    })))
    .unwrap();
    assert!(c.qkv_bias && !c.o_bias && c.qk_norm);
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.shared_expert,
            m.sparse_layers.clone(),
            m.aux_loss_coef
        ),
        (16, Some(2816), None, None)
    );
    let back = parse(c.to_hf_json("float32")).unwrap();
    assert_eq!((back.moe, back.qk_norm, back.rotary_dim), (c.moe, true, Some(8)));
    for (extra, needle) in [
        (json!({"n_group": 3}), "n_group"),
        (
            json!({"n_group": 4, "topk_group": 1, "n_routed_experts": 16, "num_experts_per_tok": 5}),
            "num_experts_per_tok",
        ),
        (json!({"routed_scaling_factor": 0.0}), "routed_scaling_factor"),
    ] {
        let msg = bad_msg(with(extra));
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
}

/// DeepSeek-V3 and V2 as their config classes read them: the latent
/// attention's widths (q and k heads of nope + rope, all heads keyed),
/// q's low-rank pair unless `q_lora_rank` is null, YaRN's `mscale_all_dim`
/// on the scores' scale; V3's sigmoid router (8 groups, 4 open, ×2.5, the
/// first 3 blocks dense), V2's softmax one by `topk_method`, its k
/// required, an unknown method refused.
#[test]
fn deepseek_fields() {
    let v3 = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
    });
    let c = parse(v3.clone()).unwrap();
    assert_eq!(c.arch, Arch::DeepseekV3);
    assert_eq!(
        (c.head_dim, c.num_kv_heads, c.max_position_embeddings),
        (192, 4, 4096)
    );
    let m = c.mla.unwrap();
    assert_eq!(
        (
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope,
            m.qk_rope,
            m.v_head_dim,
            m.rope_interleave
        ),
        (Some(1536), 512, 128, 64, 128, true)
    );
    assert!((m.softmax_scale(&c.rope_scaling) - 192f64.powf(-0.5)).abs() < 1e-15);
    let moe = c.moe.unwrap();
    assert_eq!(
        (
            moe.num_experts,
            moe.top_k,
            moe.expert_size,
            moe.shared_expert,
            moe.shared_gated
        ),
        (256, 8, 2048, Some(2048), false)
    );
    assert_eq!(
        moe.router,
        Router::Sigmoid {
            groups: 8,
            topk_groups: 4,
            scale: 2.5
        }
    );
    assert!(!moe.routes(2) && moe.routes(3));

    let with = with_fields;
    let yarn = json!({"rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0}, "q_lora_rank": null, "rope_interleave": false});
    let c = parse(with(&v3, yarn)).unwrap();
    let m = c.mla.unwrap();
    assert_eq!((m.q_lora_rank, m.rope_interleave), (None, false));
    let mscale = 0.1 * 40f64.ln() + 1.0;
    let want = 192f64.powf(-0.5) * mscale * mscale;
    assert!((m.softmax_scale(&c.rope_scaling) - want).abs() < 1e-15);
    let names: Vec<String> = c.layer_table(4).unwrap().iter().map(|p| p.name.clone()).collect();
    assert!(names.contains(&"model.layers.3.self_attn.q_proj.weight".to_string()));
    assert!(!names.iter().any(|n| n.contains("q_a_proj")));
    let back = parse(c.to_hf_json("float32")).unwrap();
    assert_eq!((back.mla, back.moe), (c.mla, c.moe));

    let v2 = with(
        &v3,
        json!({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "num_experts_per_tok": 6, "rope_interleave": false}),
    );
    let c = parse(v2.clone()).unwrap();
    let (m, moe) = (c.mla.unwrap(), c.moe.unwrap());
    assert!(
        m.rope_interleave,
        "DeepSeek-V2 rotates in pairs whatever is written"
    );
    assert_eq!(
        (
            moe.num_experts,
            moe.top_k,
            moe.expert_size,
            moe.shared_expert,
            moe.norm_topk
        ),
        (64, 6, 1407, Some(2814), false)
    );
    assert_eq!(
        moe.router,
        Router::SoftmaxGroups {
            groups: 1,
            topk_groups: 1,
            scale: 1.0
        }
    );
    assert!(moe.routes(0), "no dense block unless first_k_dense_replace says");
    let grouped = json!({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
        "routed_scaling_factor": 16.0});
    let c = parse(with(&v2, grouped)).unwrap();
    assert_eq!(
        c.moe.as_ref().unwrap().router,
        Router::SoftmaxGroups {
            groups: 8,
            topk_groups: 3,
            scale: 16.0
        }
    );
    let back = parse(c.to_hf_json("float32")).unwrap();
    assert_eq!(back.moe, c.moe);
    assert!(bad_msg(with(&v2, json!({"topk_method": "noaux_tc"}))).contains("noaux_tc"));
    let mut no_k = v2;
    no_k.as_object_mut().unwrap().remove("num_experts_per_tok");
    assert!(bad_msg(no_k).contains("num_experts_per_tok"));
}

/// A Qwen3.5 text config as the Hub's `text_config` writes one (v5 names,
/// interleaved M-RoPE's fields, which text alone reduces to plain RoPE).
fn qwen35_text() -> Value {
    json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": true
        },
        "tie_word_embeddings": false
    })
}

#[test]
fn qwen35_fields() {
    let c = parse(qwen35_text()).unwrap();
    assert_eq!(c.arch, Arch::Qwen35);
    assert_eq!((c.head_dim, c.rotary_dim, c.rope_theta), (256, Some(64), 1e7));
    assert!(c.qk_norm && !c.qkv_bias && !c.tie_word_embeddings);
    assert_eq!(c.arch.norm_gain_offset(), Some(1.0));
    let l = c.linear_attn.clone().unwrap();
    // Qwen3_5TextConfig's layer_types: every fourth block full attention.
    let kinds: Vec<bool> = (0..8).map(|i| l.is_linear(i)).collect();
    assert_eq!(kinds, [true, true, true, false, true, true, true, false]);
    assert_eq!((l.conv_channels(), l.value_width()), (2 * 2048 + 4096, 4096));
    // The gated attention's q projection gives a gate beside each query.
    let t = c.layer_table(4).unwrap();
    assert_eq!(
        t.get("model.layers.3.self_attn.q_proj.weight")
            .unwrap()
            .shape
            .dims(),
        [8192, 4096]
    );
    let t = c.layer_table(1).unwrap();
    let dims = |n: &str| {
        t.get(&format!("model.layers.0.linear_attn.{n}"))
            .unwrap()
            .shape
            .dims()
            .to_vec()
    };
    assert_eq!(dims("conv1d.weight"), [8192, 1, 4]);
    assert_eq!(dims("in_proj_qkv.weight"), [8192, 4096]);
    assert_eq!(
        (dims("A_log"), dims("dt_bias"), dims("norm.weight")),
        (vec![32], vec![32], vec![128])
    );
    // Round trip through the written config.
    let mut back = ModelConfig::from_json(c.to_hf_json("float32"), "x/config.json").unwrap();
    back.raw = None;
    let mut c2 = c.clone();
    (c2.raw, c2.dtype) = (None, Some("float32".into()));
    assert_eq!(back, c2);
    let mut generated = c.clone();
    (generated.raw, generated.dtype) = (None, None);
    let mut again = ModelConfig::from_json(generated.to_hf_json("float32"), "x/config.json").unwrap();
    (again.raw, again.dtype) = (None, None);
    assert_eq!(again, generated);

    // An explicit interval, and the refusals.
    let mut v = qwen35_text();
    v["full_attention_interval"] = json!(2);
    let l = parse(v).unwrap().linear_attn.unwrap();
    assert_eq!(
        (0..4).map(|i| l.is_linear(i)).collect::<Vec<_>>(),
        [true, false, true, false]
    );
    for (field, value, says) in [
        (
            "layer_types",
            json!(["linear_attention", "sliding_attention"]),
            "sliding_attention",
        ),
        ("layer_types", json!(["full_attention"]), "lists 1 blocks"),
        (
            "linear_num_value_heads",
            json!(24),
            "not a multiple of linear_num_key_heads 16",
        ),
        (
            "linear_conv_kernel_dim",
            json!(0),
            "linear_conv_kernel_dim must be positive",
        ),
    ] {
        let mut v = qwen35_text();
        v[field] = value;
        let msg = parse(v).unwrap_err().to_string();
        assert!(
            msg.contains(says) && msg.contains("dir/config.json"),
            "{field}: {msg}"
        );
    }
}

#[test]
fn qwen35_multimodal_and_moe_read_their_text_configs() {
    let mm = json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
        },
        "vision_config": {"model_type": "qwen3_5_moe_vision"}
    });
    let c = parse(mm).unwrap();
    assert_eq!(
        (c.arch, c.text_of),
        (Arch::Qwen35Moe, Some("Qwen3_5MoeForConditionalGeneration"))
    );
    let moe = c.moe.clone().unwrap();
    assert_eq!((moe.num_experts, moe.top_k, moe.expert_size), (256, 8, 512));
    assert!(moe.norm_topk && moe.shared_gated && moe.shared_expert == Some(512));
    assert!((0..40).all(|i| moe.routes(i)));
    assert_eq!(
        c.linear_attn
            .as_ref()
            .unwrap()
            .layers
            .iter()
            .filter(|&&x| !x)
            .count(),
        10
    );
    // The text model's config as written: no dense MLP width.
    let json = c.to_hf_json("bfloat16");
    assert_eq!(json["architectures"], json!(["Qwen3_5MoeForCausalLM"]));
}

#[test]
fn olmo_hybrid_fields() {
    let v = json!({
        "architectures": ["OlmoHybridForCausalLM"],
        "model_type": "olmo_hybrid",
        "vocab_size": 100352,
        "hidden_size": 3840,
        "intermediate_size": 11008,
        "num_hidden_layers": 6,
        "num_attention_heads": 30
    });
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.arch, Arch::OlmoHybrid);
    assert!(c.arch.has_post_norms() && c.arch.has_linear_attn() && c.arch.norm_gain_offset().is_none());
    assert_eq!(
        (c.num_kv_heads, c.head_dim, c.pad_token_id),
        (30, 128, Some(100277))
    );
    let l = c.linear_attn.clone().unwrap();
    // OlmoHybridConfig's defaults: the attention's heads, Dk ¾ of the
    // width over them, Dv twice that, blocks 3, 7, .. full attention.
    assert_eq!(
        (l.key_heads, l.value_heads, l.key_dim, l.value_dim),
        (30, 30, 96, 192)
    );
    assert_eq!((l.beta_scale, l.norm_eps), (2.0, Some(1e-5)));
    let kinds: Vec<bool> = (0..6).map(|i| l.is_linear(i)).collect();
    assert_eq!(kinds, [true, true, true, false, true, true]);
    assert!(c.nope_layers.is_none());
    // A linear block's table is a pre-norm DeltaNet's, an attention
    // block's OLMo 3's.
    let names = |b: usize| -> Vec<String> {
        c.layer_table(b + 1)
            .unwrap()
            .iter()
            .map(|p| p.name.clone())
            .collect()
    };
    assert!(names(0).contains(&"model.layers.0.linear_attn.g_proj.weight".to_string()));
    assert!(names(0).contains(&"model.layers.0.attention_layer_norm.weight".to_string()));
    assert!(names(0).contains(&"model.layers.0.linear_attn.v_conv1d.weight".to_string()));
    assert!(names(3).contains(&"model.layers.3.feedforward_layer_norm.weight".to_string()));
    assert!(names(3).contains(&"model.layers.3.post_feedforward_layernorm.weight".to_string()));
    // Written back as read; NoPE where θ is null; the refusals.
    let mut generated = c.clone();
    (generated.raw, generated.dtype) = (None, None);
    let mut again = ModelConfig::from_json(generated.to_hf_json("float32"), "x/config.json").unwrap();
    (again.raw, again.dtype) = (None, None);
    assert_eq!(again, generated);
    let mut w = v.clone();
    w["rope_parameters"] = json!({"rope_type": "default", "rope_theta": null});
    w["linear_allow_neg_eigval"] = json!(false);
    let nope = parse(w).unwrap();
    assert_eq!(nope.nope_layers, Some(vec![true; 6]));
    assert_eq!(nope.linear_attn.as_ref().unwrap().beta_scale, 1.0);
    let mut generated = nope.clone();
    (generated.raw, generated.dtype) = (None, None);
    let mut again = ModelConfig::from_json(generated.to_hf_json("float32"), "x/config.json").unwrap();
    (again.raw, again.dtype) = (None, None);
    assert_eq!(again, generated);
    for kinds in [
        json!(vec!["linear_attention"; 6]),
        json!(vec!["full_attention"; 6]),
    ] {
        let mut w = v.clone();
        w["layer_types"] = kinds;
        let msg = parse(w).unwrap_err().to_string();
        assert!(
            msg.contains("at least one linear_attention and one full_attention"),
            "{msg}"
        );
    }
}

/// Kimi Linear as its checkpoints' config.json writes it: its own names
/// for transformers' fields (`num_experts`, `num_expert_group`,
/// `moe_renormalize`, `model_max_length`) and the delta attention's shape
/// and blocks under `linear_attn_config` (1-based).
#[test]
fn kimi_linear_fields() {
    let v = json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": null,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_expert_group": 1,
        "num_shared_experts": 1,
        "moe_renormalize": true,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "model_max_length": 1048576,
        "linear_attn_config": {
            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
            "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]
        }
    });
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.arch, Arch::KimiLinear);
    assert_eq!(
        (c.max_position_embeddings, c.norm_eps, c.pad_token_id),
        (1 << 20, 1e-5, Some(163839))
    );
    assert_eq!(c.nope_layers, Some(vec![true; 8]));
    let m = c.mla.unwrap();
    assert_eq!(
        (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim(), m.v_head_dim),
        (None, 512, 192, 128)
    );
    let l = c.linear_attn.clone().unwrap();
    assert_eq!(
        (l.key_heads, l.value_heads, l.key_dim, l.conv_kernel),
        (32, 32, 128, 4)
    );
    let kinds: Vec<bool> = (0..8).map(|i| l.is_linear(i)).collect();
    assert_eq!(kinds, [true, true, true, false, true, true, true, false]);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_expert),
        (256, 8, 1024, Some(1024))
    );
    assert!(!moe.routes(0) && moe.routes(1) && moe.norm_topk && !moe.shared_gated);
    assert_eq!(
        moe.router,
        Router::Sigmoid {
            groups: 1,
            topk_groups: 1,
            scale: 2.446
        }
    );
    let names: Vec<String> = c.layer_table(1).unwrap().iter().map(|p| p.name.clone()).collect();
    for n in [
        "self_attn.f_b_proj.weight",
        "self_attn.A_log",
        "self_attn.v_conv1d.weight",
        "mlp.up_proj.weight",
    ] {
        assert!(names.contains(&format!("model.layers.0.{n}")), "{n}: {names:?}");
    }
    let names: Vec<String> = c.layer_table(4).unwrap().iter().map(|p| p.name.clone()).collect();
    for n in [
        "self_attn.kv_b_proj.weight",
        "block_sparse_moe.experts.7.w3.weight",
        "block_sparse_moe.gate.e_score_correction_bias",
    ] {
        assert!(names.contains(&format!("model.layers.3.{n}")), "{n}: {names:?}");
    }
    // Written with transformers' names, read back the same.
    let mut generated = c.clone();
    (generated.raw, generated.dtype) = (None, None);
    let mut again = ModelConfig::from_json(generated.to_hf_json("float32"), "x/config.json").unwrap();
    (again.raw, again.dtype) = (None, None);
    assert_eq!(again, generated);
    // KimiLinearConfig's defaults without linear_attn_config: block i > 0
    // with i % 4 = 0 attends.
    let mut w = v.clone();
    w.as_object_mut().unwrap().remove("linear_attn_config");
    let l = parse(w).unwrap().linear_attn.unwrap();
    assert_eq!(
        (0..6).map(|i| l.is_linear(i)).collect::<Vec<_>>(),
        [true, true, true, true, false, true]
    );
    let mut w = v;
    w["linear_attn_config"]["kda_layers"] = json!([1, 2, 3, 5, 6]);
    let msg = parse(w).unwrap_err().to_string();
    assert!(msg.contains("block 7 (1-based) is in neither"), "{msg}");
}
