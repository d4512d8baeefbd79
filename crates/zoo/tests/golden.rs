//! Every architecture, loaded from its HF fixture directory, against the
//! float64 transformers reference of `tools/make_golden.py`: logits, loss and
//! the gradient of every parameter.

use crate::common;

use common::{CASES, Golden, fixture, read_golden};
use megatrain_tensor::cpu::{CpuTensor, Real, RefExecutor};
use megatrain_tensor::testing::{norm, rel_norm_err, rel_norm_err_or_scaled};
use megatrain_tensor::{CpuExecutor, F64Executor, TensorHandle};
use megatrain_zoo::{Arch, ModelConfig, Router, forward_backward, forward_logits, load_hf_dir, upload_layer};

struct Tol {
    loss: f64,
    grad: f64,
    logits: f64,
}

/// Runs one case on a reference executor; returns the worst errors seen.
fn check_case<F: Real>(case: &str, ex: &RefExecutor<F>, tol: &Tol, chunk_rows: usize) -> (f64, f64, f64) {
    let model = load_hf_dir(fixture(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
    let golden = read_golden(case);
    let g = |name: &str| -> &Golden {
        golden
            .get(name)
            .unwrap_or_else(|| panic!("{case}: golden lacks {name}"))
    };
    let ids_g = g("input_ids");
    let (batch, seq) = (ids_g.shape[0], ids_g.shape[1]);
    let ids: Vec<u32> = ids_g.values.iter().map(|&v| v as u32).collect();
    let targets: Vec<i32> = g("targets").values.iter().map(|&v| v as i32).collect();

    let cfg = &model.config;
    let weights: Vec<Vec<CpuTensor<F>>> = model
        .tables
        .iter()
        .zip(&model.slabs)
        .map(|(t, s)| upload_layer(ex, t, s).unwrap())
        .collect();

    let logits = forward_logits(cfg, ex, &weights, &ids, batch, seq).unwrap();
    assert_eq!(logits.dims(), [batch, seq, cfg.vocab_size]);
    let got: Vec<f64> = logits.data().iter().map(|x| x.widen()).collect();
    let logits_err = rel_norm_err(&got, &g("logits").values);
    assert!(logits_err < tol.logits, "{case}: logits rel err {logits_err:e}");

    let out = forward_backward(cfg, ex, &weights, &ids, &targets, (batch, seq, None), chunk_rows).unwrap();
    let want_loss = g("loss").values[0];
    let loss_err = ((out.loss - want_loss) / want_loss).abs();
    assert!(
        loss_err < tol.loss,
        "{case}: loss {} vs {want_loss}: rel err {loss_err:e}",
        out.loss
    );
    assert_eq!(out.counted, targets.iter().filter(|&&t| t != -100).count());

    let mut worst = 0.0f64;
    let mut seen = 0;
    // The scale a gradient's error is measured against where its own
    // vanishes: a block without RoPE (SmolLM3's NoPE) adds k's bias to every
    // key's score of a query alike, which the softmax cancels, so that
    // gradient is exactly 0 and both sides hold only rounding.
    let largest = golden
        .iter()
        .filter(|(k, _)| k.starts_with("grad."))
        .map(|(_, g)| norm(&g.values))
        .fold(0.0, f64::max);
    for (table, grads) in model.tables.iter().zip(&out.grads) {
        assert_eq!(table.len(), grads.len());
        // The layer's gradient as one slab, read by the checkpoint's
        // tensors (Phi-3's fused ones span several entries).
        let mut slab = vec![0.0f64; table.numel()];
        for (spec, grad) in table.iter().zip(grads) {
            for (o, x) in slab[spec.range()].iter_mut().zip(grad.data()) {
                *o = x.widen();
            }
        }
        for spec in cfg.hf_table(table).iter() {
            let want = g(&format!("grad.{}", spec.name));
            assert_eq!(want.shape, spec.shape.dims(), "{case}: {}", spec.name);
            let got = &slab[spec.range()];
            let err = rel_norm_err_or_scaled(got, &want.values, largest, 1e-9);
            assert!(
                err < tol.grad,
                "{case}: grad of {} rel norm err {err:e}",
                spec.name
            );
            worst = worst.max(err);
            seen += 1;
        }
    }
    let n_golden = golden.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(seen, n_golden, "{case}: every HF parameter has a gradient here");
    (loss_err, worst, logits_err)
}

#[test]
fn golden_f32_cpu_executor() {
    let tol = Tol {
        // The issue asks for 1e-5 (loss) and 1e-4 (gradients); we see ~1e-8
        // and ~3e-6, so hold a tighter line with a 10x margin.
        loss: 1e-6,
        grad: 3e-5,
        logits: 5e-6,
    };
    for case in CASES {
        let (l, g, lg) = check_case(case, &CpuExecutor::new(), &tol, 5);
        eprintln!("{case:>16} f32: loss {l:.1e}  worst grad {g:.1e}  logits {lg:.1e}");
    }
}

/// The same code in f64: agreement to the precision of the golden files
/// (gradients stored as f32, per-row losses downloaded as f32).
#[test]
fn golden_f64_executor_is_tighter() {
    let tol = Tol {
        loss: 1e-7,
        grad: 3e-7,
        logits: 1e-9,
    };
    // A routed block's scores come down to the host, and their gradient
    // goes back up, as f32 (the routing weights themselves as f64): the
    // mixture-of-experts cases agree to f32's precision there, not f64's.
    let routed = Tol {
        loss: 1e-7,
        grad: 1e-6,
        logits: 1e-7,
    };
    // OLMo Hybrid's gated norm's ε (1e-5, its own) is of the order of its
    // inputs' mean squares here (2.9e-6 at the least), and ε reaches every
    // executor as f32 (9.99999975e-6): its logits agree to 1.6e-9.
    let f32_eps = Tol {
        loss: 1e-7,
        grad: 3e-7,
        logits: 5e-9,
    };
    for case in CASES {
        let cfg = ModelConfig::from_dir(fixture(case)).expect("config");
        let tol = match (cfg.moe.is_some(), cfg.arch) {
            (true, _) => &routed,
            (false, Arch::OlmoHybrid) => &f32_eps,
            _ => &tol,
        };
        let (l, g, lg) = check_case(case, &F64Executor::new(), tol, 7);
        eprintln!("{case:>16} f64: loss {l:.1e}  worst grad {g:.1e}  logits {lg:.1e}");
    }
}

/// The window cases would fail the golden comparison without their window
/// (and OLMo 3's with YaRN on every block, SmolLM3's with RoPE on every
/// block, Granite's without its multipliers, the mixtures of experts
/// without their load-balancing loss or the renormalisation of their top
/// k): each changes the loss well
/// past the tolerances above. (phi3_partial's partial rotation needs no
/// such check: its 6 LongRoPE factors cover only the 12 rotated entries'
/// pairs, and would not load for all 16.)
#[test]
fn the_window_cases_depend_on_their_window() {
    fn window(c: &mut ModelConfig) -> bool {
        c.sliding_window.take().is_some()
    }
    fn sliding_rope(c: &mut ModelConfig) -> bool {
        c.sliding_rope.take().is_some()
    }
    type Drop = fn(&mut ModelConfig) -> bool;
    fn rope_everywhere(c: &mut ModelConfig) -> bool {
        c.nope_layers.take().is_some()
    }
    fn unscaled(c: &mut ModelConfig) -> bool {
        c.multipliers.take().is_some()
    }
    fn plain_rope(c: &mut ModelConfig) -> bool {
        std::mem::take(&mut c.rope_scaling) != megatrain_tensor::RopeScaling::None
    }
    fn unscaled_logits(c: &mut ModelConfig) -> bool {
        c.logit_scale.take().is_some()
    }
    fn head_dim_scores(c: &mut ModelConfig) -> bool {
        c.query_pre_attn_scalar.take().is_some()
    }
    fn uncapped_scores(c: &mut ModelConfig) -> bool {
        c.attn_softcap.take().is_some()
    }
    fn uncapped_logits(c: &mut ModelConfig) -> bool {
        c.final_softcap.take().is_some()
    }
    fn unbalanced(c: &mut ModelConfig) -> bool {
        c.moe.as_mut().is_some_and(|m| m.aux_loss_coef.take().is_some())
    }
    fn unnormalised(c: &mut ModelConfig) -> bool {
        c.moe.as_mut().is_some_and(|m| std::mem::take(&mut m.norm_topk))
    }
    fn unclamped(c: &mut ModelConfig) -> bool {
        let clamp = c.moe.as_mut().and_then(|m| m.clamped.as_mut());
        clamp.map(|k| k.limit = 1e30).is_some()
    }
    fn ungrouped(c: &mut ModelConfig) -> bool {
        match c.moe.as_mut().map(|m| &mut m.router) {
            Some(
                Router::Sigmoid {
                    groups, topk_groups, ..
                }
                | Router::SoftmaxGroups {
                    groups, topk_groups, ..
                },
            ) if *groups > 1 => {
                (*groups, *topk_groups) = (1, 1);
                true
            }
            _ => false,
        }
    }
    fn unscaled_routes(c: &mut ModelConfig) -> bool {
        match c.moe.as_mut().map(|m| &mut m.router) {
            Some(Router::Sigmoid { scale, .. } | Router::SoftmaxGroups { scale, .. }) if *scale != 1.0 => {
                *scale = 1.0;
                true
            }
            _ => false,
        }
    }
    fn unscaled_scores(c: &mut ModelConfig) -> bool {
        c.mla
            .as_mut()
            .is_some_and(|m| std::mem::take(&mut m.mscale_all_dim) != 0.0)
    }
    fn rope_in_halves(c: &mut ModelConfig) -> bool {
        c.mla
            .as_mut()
            .is_some_and(|m| std::mem::take(&mut m.rope_interleave))
    }
    fn rates_below_one(c: &mut ModelConfig) -> bool {
        c.linear_attn
            .as_mut()
            .is_some_and(|l| std::mem::replace(&mut l.beta_scale, 1.0) != 1.0)
    }
    fn model_gate_norm_eps(c: &mut ModelConfig) -> bool {
        c.linear_attn
            .as_mut()
            .is_some_and(|l| l.norm_eps.take().is_some())
    }
    fn rope_everywhere_in_full(c: &mut ModelConfig) -> bool {
        // Qwen3.5 rotating all of each head rather than a quarter.
        c.rotary_dim.take().is_some()
    }
    fn rotated_latents(c: &mut ModelConfig) -> bool {
        // Kimi Linear's latent attention rotating its shared key part.
        c.nope_layers.take().is_some()
    }
    let cases: [(&str, Drop); 47] = [
        ("mistral_window", window),
        ("qwen2_window", window),
        ("phi3_partial", window),
        ("qwen2_window_layers", window),
        ("olmo3", window),
        ("olmo3", sliding_rope),
        ("smollm3", window),
        ("smollm3", rope_everywhere),
        ("granite", unscaled),
        ("starcoder2", window),
        ("llama_dynamic", plain_rope),
        ("exaone4", window),
        ("exaone4", rope_everywhere),
        ("cohere2", window),
        ("cohere2", rope_everywhere),
        ("cohere2", unscaled_logits),
        ("cohere", unscaled_logits),
        ("gemma3", window),
        ("gemma3", sliding_rope),
        ("gemma3", head_dim_scores),
        ("gemma2", window),
        ("gemma2", head_dim_scores),
        ("gemma2", uncapped_scores),
        ("gemma2", uncapped_logits),
        ("mixtral_aux", unbalanced),
        ("qwen3_moe_aux", unbalanced),
        ("mixtral", unnormalised),
        ("gpt_oss", window),
        ("gpt_oss", unclamped),
        ("gpt_oss", unnormalised),
        ("gpt_oss_aux", unbalanced),
        ("gpt_oss_mxfp4", unclamped),
        ("glm4_moe", ungrouped),
        ("glm4_moe", unscaled_routes),
        ("glm4_moe", unnormalised),
        ("deepseek_v3", rope_in_halves),
        ("deepseek_v3", ungrouped),
        ("deepseek_v3_yarn", unscaled_scores),
        ("deepseek_v3_yarn", plain_rope),
        ("deepseek_v2", ungrouped),
        ("deepseek_v2", unscaled_routes),
        ("olmo_hybrid", rates_below_one),
        ("olmo_hybrid", model_gate_norm_eps),
        ("qwen3_5", rope_everywhere_in_full),
        ("qwen3_5_moe", unnormalised),
        ("kimi_linear", rotated_latents),
        ("kimi_linear", ungrouped),
    ];
    for (case, drop) in cases {
        let golden = read_golden(case);
        let mut model = load_hf_dir(fixture(case)).unwrap();
        assert!(drop(&mut model.config), "{case}");
        let err = loss_err(&golden, &model);
        assert!(err > 1e-4, "{case}: the loss without it is off by only {err:e}");
    }
}

/// The loss of fixture `case` with every tensor whose name ends with
/// `suffix` set to `value`, and how far it then misses the golden loss;
/// `count` such tensors must be found.
fn loss_err_with(case: &str, suffix: &str, value: f32, count: usize) -> f64 {
    let golden = read_golden(case);
    let mut model = load_hf_dir(fixture(case)).unwrap();
    let mut found = 0;
    for (table, slab) in model.tables.iter().zip(&mut model.slabs) {
        for spec in table.iter().filter(|s| s.name.ends_with(suffix)) {
            slab[spec.range()].fill(value);
            found += 1;
        }
    }
    assert_eq!(found, count, "{case}: tensors ending {suffix}");
    loss_err(&golden, &model)
}

/// How far `model`'s f64 loss on `golden`'s batch misses its loss.
fn loss_err(golden: &std::collections::HashMap<String, Golden>, model: &megatrain_zoo::LoadedModel) -> f64 {
    let ex = F64Executor::new();
    let ids_g = &golden["input_ids"];
    let ids: Vec<u32> = ids_g.values.iter().map(|&v| v as u32).collect();
    let targets: Vec<i32> = golden["targets"].values.iter().map(|&v| v as i32).collect();
    let weights: Vec<Vec<_>> = model
        .tables
        .iter()
        .zip(&model.slabs)
        .map(|(t, s)| upload_layer(&ex, t, s).unwrap())
        .collect();
    let (batch, seq) = (ids_g.shape[0], ids_g.shape[1]);
    let out = forward_backward(
        &model.config,
        &ex,
        &weights,
        &ids,
        &targets,
        (batch, seq, None),
        7,
    )
    .unwrap();
    let want = golden["loss"].values[0];
    ((out.loss - want) / want).abs()
}

/// GPT-OSS's sinks and GLM-4.5's correction bias matter to their golden
/// cases: with every sink at −10⁴ (σ(lse − sink) = 1, a plain softmax), or
/// the correction bias at 0, the loss misses by far more than the
/// tolerances above.
#[test]
fn the_sinks_and_the_correction_bias_matter() {
    for (case, suffix, value, count) in [
        ("gpt_oss", ".sinks", -1e4, 3),
        ("gpt_oss_mxfp4", ".sinks", -1e4, 2),
        ("glm4_moe", ".e_score_correction_bias", 0.0, 2),
        ("glm4_moe_plain", ".e_score_correction_bias", 0.0, 2),
        ("deepseek_v3", ".e_score_correction_bias", 0.0, 2),
    ] {
        let err = loss_err_with(case, suffix, value, count);
        assert!(
            err > 1e-4,
            "{case}: the loss with {suffix} at {value} is off by only {err:e}"
        );
    }
}

/// The published MXFP4 experts widen to exactly transformers' own
/// dequantization (`convert_moe_packed_tensors`), stored by the fixture
/// script beside the gradients.
#[test]
fn mxfp4_experts_widen_as_transformers_dequantizes_them() {
    let case = "gpt_oss_mxfp4";
    let golden = read_golden(case);
    let model = load_hf_dir(fixture(case)).unwrap();
    let mut seen = 0;
    for (table, slab) in model.tables.iter().zip(&model.slabs) {
        for spec in model.config.hf_table(table).iter() {
            let Some(want) = golden.get(&format!("dequant.{}", spec.name)) else {
                continue;
            };
            assert_eq!(want.shape, spec.shape.dims(), "{}", spec.name);
            let got = &slab[spec.range()];
            let same = got.iter().zip(&want.values).all(|(&g, &w)| g as f64 == w);
            assert!(same, "{}: widened values differ from transformers'", spec.name);
            seen += 1;
        }
    }
    let dequant = golden.keys().filter(|k| k.starts_with("dequant.")).count();
    assert_eq!((seen, dequant), (4, 4), "two blocks' gate_up and down");
}

/// Every family the zoo loads has a golden case above.
/// The exact-GELU cases tell the erf GELU from its tanh approximation:
/// with the approximation their float64 logits miss the golden ones by far
/// more than `golden_f64_executor_is_tighter` allows (1e-9).
#[test]
fn the_exact_gelu_cases_depend_on_the_erf() {
    for case in ["gpt_neox", "gpt2_erf"] {
        let golden = read_golden(case);
        let mut model = load_hf_dir(fixture(case)).unwrap();
        assert!(std::mem::take(&mut model.config.exact_gelu), "{case}");
        let ex = F64Executor::new();
        let ids_g = &golden["input_ids"];
        let ids: Vec<u32> = ids_g.values.iter().map(|&v| v as u32).collect();
        let weights: Vec<Vec<_>> = model
            .tables
            .iter()
            .zip(&model.slabs)
            .map(|(t, s)| upload_layer(&ex, t, s).unwrap())
            .collect();
        let logits =
            forward_logits(&model.config, &ex, &weights, &ids, ids_g.shape[0], ids_g.shape[1]).unwrap();
        let err = rel_norm_err(logits.data(), &golden["logits"].values);
        assert!(
            err > 1e-6,
            "{case}: the tanh GELU's logits are off by only {err:e}"
        );
    }
}

#[test]
fn every_architecture_has_a_golden_case() {
    let covered: Vec<Arch> = CASES
        .iter()
        .map(|case| ModelConfig::from_dir(fixture(case)).unwrap().arch)
        .collect();
    for arch in Arch::ALL {
        assert!(
            covered.contains(&arch),
            "{arch:?} has no golden fixture (tools/make_golden.py)"
        );
    }
}
