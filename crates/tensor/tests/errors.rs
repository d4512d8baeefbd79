//! Bad input gives typed errors naming the op and the culprit, never a panic.

use megatrain_tensor::testing::random_tensor;
use megatrain_tensor::{
    AttnMask, ClampedGlu, CpuExecutor, CpuTensor, DType, Error, Executor, HostTensor, LossTerms, MatmulNeeds,
    Rope, Shape, SoftCap, Transpose,
};

const EX: CpuExecutor = CpuExecutor::new();

fn r(seed: u64, shape: &[usize]) -> CpuTensor<f32> {
    EX.upload(&random_tensor(seed, shape.to_vec())).unwrap()
}

fn shape_err<T: std::fmt::Debug>(res: megatrain_tensor::Result<T>, op: &str) -> String {
    match res {
        Err(e @ Error::Shape { op: o, .. }) if o == op => e.to_string(),
        other => panic!("expected a shape error from {op}, got {other:?}"),
    }
}

#[test]
fn matmul_shape_errors() {
    let a = r(1, &[2, 3]);
    let msg = shape_err(EX.matmul(&a, &r(2, &[4, 5]), None, Transpose::NN), "matmul");
    assert!(msg.contains("[2, 3]") && msg.contains("[4, 5]"), "{msg}");
    shape_err(
        EX.matmul(&r(1, &[3]), &r(2, &[3, 5]), None, Transpose::NN),
        "matmul",
    );
    shape_err(
        EX.matmul(&a, &r(2, &[3, 5]), Some(&r(3, &[4])), Transpose::NN),
        "matmul",
    );
    // batched b must share a's leading dims
    shape_err(
        EX.matmul(&r(1, &[2, 2, 3]), &r(2, &[3, 3, 5]), None, Transpose::NN),
        "matmul",
    );
    shape_err(
        EX.matmul(&r(1, &[2, 2, 3]), &r(2, &[1, 2, 3, 5]), None, Transpose::NN),
        "matmul",
    );
    // transposes change which dims must agree
    assert!(EX.matmul(&a, &r(2, &[5, 3]), None, Transpose::NT).is_ok());
    shape_err(EX.matmul(&a, &r(2, &[3, 5]), None, Transpose::NT), "matmul");
    shape_err(
        EX.matmul_backward(
            &a,
            &r(2, &[3, 5]),
            &r(3, &[2, 4]),
            Transpose::NN,
            MatmulNeeds::ALL,
        ),
        "matmul_backward",
    );
}

#[test]
fn norm_shape_errors() {
    let x = r(1, &[2, 4]);
    shape_err(EX.rmsnorm(&x, &r(2, &[3]), 1e-5), "rmsnorm");
    shape_err(EX.layernorm(&x, &r(2, &[4]), &r(3, &[5]), 1e-5), "layernorm");
    shape_err(EX.rmsnorm(&r(1, &[2, 0]), &r(2, &[0]), 1e-5), "rmsnorm");
    let o = EX.rmsnorm(&x, &r(2, &[4]), 1e-5).unwrap();
    shape_err(
        EX.rmsnorm_backward(&x, &r(2, &[4]), &r(3, &[3]), &x),
        "rmsnorm_backward",
    );
    shape_err(
        EX.rmsnorm_backward(&x, &r(2, &[4]), &o.rstd, &r(3, &[4, 2])),
        "rmsnorm_backward",
    );
}

#[test]
fn fused_add_norm_shape_errors() {
    let (x, w, b) = (r(1, &[2, 4]), r(2, &[4]), r(3, &[4]));
    let msg = shape_err(EX.add_rmsnorm(&x, &r(4, &[2, 5]), &w, 1e-5), "add_rmsnorm");
    assert!(msg.contains("[2, 5]"), "{msg}");
    shape_err(EX.add_rmsnorm(&x, &x, &r(5, &[3]), 1e-5), "add_rmsnorm");
    shape_err(
        EX.add_layernorm(&x, &r(4, &[4, 2]), &w, &b, 1e-5),
        "add_layernorm",
    );
    shape_err(EX.add_layernorm(&x, &x, &w, &r(6, &[5]), 1e-5), "add_layernorm");
    let o = EX.add_rmsnorm(&x, &x, &w, 1e-5).unwrap();
    let msg = shape_err(
        EX.add_rmsnorm_backward(&o.h, &w, &o.norm.rstd, &x, &r(7, &[4, 2])),
        "add_rmsnorm_backward",
    );
    assert!(msg.contains("[4, 2]"), "{msg}");
    shape_err(
        EX.add_rmsnorm_backward(&o.h, &w, &r(8, &[3]), &x, &x),
        "add_rmsnorm_backward",
    );
    let o = EX.add_layernorm(&x, &x, &w, &b, 1e-5).unwrap();
    let mean = o.norm.mean.as_ref().unwrap();
    shape_err(
        EX.add_layernorm_backward(&o.h, &w, mean, &o.norm.rstd, &x, &r(9, &[8])),
        "add_layernorm_backward",
    );
    shape_err(
        EX.add_layernorm_backward(&o.h, &w, &r(10, &[5]), &o.norm.rstd, &x, &x),
        "add_layernorm_backward",
    );
}

#[test]
fn rope_errors() {
    let msg = shape_err(EX.rope(&r(1, &[1, 2, 3, 5]), Rope::plain(1e4, 0)), "rope");
    assert!(msg.contains("5"), "{msg}");
    shape_err(EX.rope(&r(1, &[2, 3, 4]), Rope::plain(1e4, 0)), "rope");
    shape_err(
        EX.rope_backward(&r(1, &[1, 1, 1, 3]), Rope::plain(1e4, 0)),
        "rope_backward",
    );
    // A partial rotation needs an even count within the head.
    for bad in [3, 10] {
        let rope = Rope {
            rotary_dim: Some(bad),
            ..Rope::plain(1e4, 0)
        };
        let msg = shape_err(EX.rope(&r(1, &[1, 2, 3, 8]), rope), "rope");
        assert!(msg.contains(&format!("rotary_dim {bad} of head dim 8")), "{msg}");
    }
    // An odd head passes its last entry through.
    let rope = Rope {
        rotary_dim: Some(4),
        ..Rope::plain(1e4, 0)
    };
    assert!(EX.rope(&r(1, &[1, 2, 3, 5]), rope).is_ok());
}

#[test]
fn attention_errors() {
    let q = r(1, &[1, 3, 3, 4]);
    let kv = r(2, &[1, 3, 2, 4]);
    shape_err(EX.attention(&q, &kv, &kv, AttnMask::CAUSAL), "attention"); // 3 heads over 2
    shape_err(
        EX.attention(
            &r(1, &[1, 3, 2, 4]),
            &r(2, &[1, 3, 2, 5]),
            &r(3, &[1, 3, 2, 5]),
            AttnMask::CAUSAL,
        ),
        "attention",
    );
    shape_err(
        EX.attention(&r(1, &[1, 3, 2, 4]), &kv, &r(3, &[1, 2, 2, 4]), AttnMask::CAUSAL),
        "attention",
    );
    shape_err(
        EX.attention(
            &r(1, &[1, 3, 2, 4]),
            &r(2, &[1, 3, 0, 4]),
            &r(3, &[1, 3, 0, 4]),
            AttnMask::CAUSAL,
        ),
        "attention",
    );
    let q = r(1, &[1, 3, 2, 4]);
    let mut fw = EX.attention(&q, &kv, &kv, AttnMask::CAUSAL).unwrap();
    fw.lse = r(4, &[1, 3, 2]);
    shape_err(EX.attention_backward(&q, &kv, &kv, &fw, &q), "attention_backward");
    let e = EX
        .attention(&q, &kv, &kv, AttnMask::sliding(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention") && e.contains("window of 0"), "{e}");
}

#[test]
fn attention_sinks_errors() {
    let (q, kv) = (r(1, &[2, 3, 4, 5]), r(2, &[2, 3, 2, 5]));
    let fw = EX.attention(&q, &kv, &kv, AttnMask::CAUSAL).unwrap();
    let msg = shape_err(EX.attention_sinks(&fw, &r(3, &[2])), "attention_sinks");
    assert!(msg.contains("sinks [2]") && msg.contains("[4]"), "{msg}");
    let bad = megatrain_tensor::AttentionOut {
        out: r(4, &[2, 3, 4, 5]),
        lse: r(5, &[2, 3, 4]),
        mask: AttnMask::CAUSAL,
    };
    let msg = shape_err(EX.attention_sinks(&bad, &r(3, &[4])), "attention_sinks");
    assert!(
        msg.contains("lse [2, 3, 4]") && msg.contains("[2, 4, 3]"),
        "{msg}"
    );
    let flat = megatrain_tensor::AttentionOut {
        out: r(4, &[6, 4, 5]),
        ..bad
    };
    shape_err(EX.attention_sinks(&flat, &r(3, &[4])), "attention_sinks");
    let op = "attention_sinks_backward";
    let sinks = r(3, &[4]);
    let msg = shape_err(
        EX.attention_sinks_backward(&fw.out, &fw.lse, &sinks, &r(6, &[2, 3, 4, 4])),
        op,
    );
    assert!(msg.contains("dout [2, 3, 4, 4]"), "{msg}");
    shape_err(EX.attention_sinks_backward(&fw.out, &fw.out, &sinks, &fw.out), op);
    shape_err(
        EX.attention_sinks_backward(&fw.out, &fw.lse, &r(3, &[1, 4]), &fw.out),
        op,
    );
    assert!(
        EX.attention_sinks_backward(&fw.out, &fw.lse, &sinks, &fw.out)
            .is_ok()
    );
}

#[test]
fn clamped_glu_constants_must_be_positive_and_finite() {
    for (alpha, limit) in [(0.0, 7.0), (1.702, -1.0), (f64::NAN, 7.0), (1.702, f64::INFINITY)] {
        let e = ClampedGlu::new(alpha, limit, "config.json swiglu_limit")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("swiglu_limit") && e.contains(&limit.to_string()),
            "{e}"
        );
    }
    let c = ClampedGlu::new(1.702, 7.0, "test").unwrap();
    let msg = shape_err(EX.swiglu_clamped(&r(1, &[2, 3]), c), "swiglu_clamped");
    assert!(msg.contains("[2, 3]") && msg.contains("interleaved"), "{msg}");
    let msg = shape_err(
        EX.swiglu_clamped_backward(&r(1, &[2, 6]), &r(3, &[2, 6]), c),
        "swiglu_clamped_backward",
    );
    assert!(msg.contains("[2, 3]") && msg.contains("[2, 6]"), "{msg}");
}

#[test]
fn soft_caps_must_be_positive_and_finite() {
    for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = SoftCap::new(cap, "config.json attn_logit_softcapping")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("attn_logit_softcapping") && e.contains(&cap.to_string()),
            "{e}"
        );
    }
    let cap = SoftCap::new(30.0, "test").unwrap();
    shape_err(
        EX.softcap_backward(&r(1, &[2, 3]), r(2, &[3, 2]), cap),
        "softcap_backward",
    );
}

#[test]
fn token_out_of_range_names_id_and_position() {
    let table = r(1, &[5, 2]);
    match EX.embedding(&[0, 4, 5, 1], &table) {
        Err(Error::TokenOutOfRange {
            id: 5,
            pos: 2,
            vocab: 5,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let mut dt = EX.zeros(&Shape::new([5, 2])).unwrap();
    let before = dt.clone();
    let err = EX
        .embedding_backward(&[1, 9], &r(2, &[2, 2]), &mut dt)
        .unwrap_err();
    assert!(err.to_string().contains("token id 9 at position 1"), "{err}");
    assert_eq!(dt, before, "nothing is written when an id is bad");
    shape_err(
        EX.embedding_backward(&[1], &r(2, &[2, 2]), &mut dt),
        "embedding_backward",
    );
    shape_err(EX.embedding(&[0], &r(1, &[10])), "embedding");
}

#[test]
fn bad_target_is_named() {
    let logits = r(1, &[3, 4]);
    let err = EX
        .cross_entropy(&logits, &[0, 4, 1], -100, 1.0, LossTerms::NONE)
        .unwrap_err();
    assert!(
        matches!(err, Error::Invalid { .. }) && err.to_string().contains("target 4 at row 1"),
        "{err}"
    );
    let err = EX
        .cross_entropy(&logits, &[0, -3, 1], -100, 1.0, LossTerms::NONE)
        .unwrap_err();
    assert!(err.to_string().contains("target -3"), "{err}");
    shape_err(
        EX.cross_entropy(&logits, &[0, 1], -100, 1.0, LossTerms::NONE),
        "cross_entropy",
    );
}

#[test]
fn data_movement_errors() {
    let x = r(1, &[4, 3]);
    shape_err(EX.slice_rows(&x, 3, 2), "slice_rows");
    shape_err(EX.slice_rows(&x, usize::MAX, 2), "slice_rows");
    let mut d = x.clone();
    shape_err(EX.write_rows(&mut d, 3, &r(2, &[2, 3])), "write_rows");
    shape_err(EX.write_rows(&mut d, 0, &r(2, &[2, 4])), "write_rows");
    shape_err(EX.split_last(&x, &[1, 1]), "split_last");
    shape_err(EX.concat_last(&[&x, &r(2, &[3, 3])]), "concat_last");
    shape_err(EX.concat_last(&[]), "concat_last");
    shape_err(EX.reshape(&x, &Shape::new([5, 2])), "reshape");
    shape_err(EX.add(&x, &r(2, &[3, 4])), "add");
    shape_err(EX.add_assign(&mut d, &r(2, &[13])), "add_assign");
    shape_err(EX.swiglu(&x, &r(2, &[3, 4])), "swiglu");
    shape_err(EX.geglu(&x, &r(2, &[3, 4])), "geglu");
    shape_err(EX.geglu_backward(&x, &x, &r(2, &[3, 4])), "geglu_backward");
    shape_err(EX.gelu_backward(&x, &r(2, &[3, 4])), "gelu_backward");
}

#[test]
fn bf16_is_refused_where_f32_is_required() {
    let h = HostTensor::from_f32(vec![2, 2], vec![1.0; 4])
        .unwrap()
        .to_dtype(DType::BF16);
    let xb = EX.upload(&h).unwrap();
    let x = r(1, &[2, 2]);
    assert!(matches!(
        EX.add(&x, &xb),
        Err(Error::DType {
            op: "add",
            got: DType::BF16,
            ..
        })
    ));
    assert!(matches!(
        EX.matmul(&xb, &x, None, Transpose::NN),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        EX.write_rows(&mut x.clone(), 0, &xb),
        Err(Error::DType { .. })
    ));
    assert!(EX.matmul(&x, &xb, None, Transpose::NN).is_ok());
}

#[test]
fn gated_delta_rule_errors() {
    let op = "gated_delta_rule";
    let (q, v, g) = (r(1, &[2, 3, 2, 4]), r(2, &[2, 3, 4, 5]), r(3, &[2, 3, 4]));
    let ok = EX.gated_delta_rule(&q, &q, &v, &g, &g, None).unwrap();
    let msg = shape_err(EX.gated_delta_rule(&r(1, &[6, 2, 4]), &q, &v, &g, &g, None), op);
    assert!(
        msg.contains("[6, 2, 4]") && msg.contains("[B, T, Hk, Dk]"),
        "{msg}"
    );
    let msg = shape_err(
        EX.gated_delta_rule(&q, &r(1, &[2, 3, 2, 5]), &v, &g, &g, None),
        op,
    );
    assert!(msg.contains("k [2, 3, 2, 5]"), "{msg}");
    let msg = shape_err(
        EX.gated_delta_rule(&q, &q, &r(2, &[2, 4, 4, 5]), &g, &g, None),
        op,
    );
    assert!(msg.contains("B and T"), "{msg}");
    let msg = shape_err(
        EX.gated_delta_rule(&q, &q, &r(2, &[2, 3, 3, 5]), &g, &g, None),
        op,
    );
    assert!(msg.contains("Hv = 3") && msg.contains("Hk = 2"), "{msg}");
    let msg = shape_err(EX.gated_delta_rule(&q, &q, &v, &r(3, &[2, 3, 2]), &g, None), op);
    assert!(msg.contains("g must be [2, 3, 4]"), "{msg}");
    let msg = shape_err(EX.gated_delta_rule(&q, &q, &v, &g, &r(3, &[6, 4]), None), op);
    assert!(msg.contains("beta must be [2, 3, 4]"), "{msg}");
    let e = EX.gated_delta_rule(&r(1, &[2, 3, 2, 0]), &r(1, &[2, 3, 2, 0]), &v, &g, &g, None);
    assert!(
        matches!(
            e,
            Err(Error::Invalid {
                op: "gated_delta_rule",
                ..
            })
        ),
        "{e:?}"
    );
    let op = "gated_delta_rule_backward";
    let msg = shape_err(EX.gated_delta_rule_backward(&q, &q, &v, &g, &g, &ok, &g), op);
    assert!(
        msg.contains("dout [2, 3, 4]") && msg.contains("[2, 3, 4, 5]"),
        "{msg}"
    );
    let short = megatrain_tensor::DeltaRuleOut {
        out: ok.out.clone(),
        saved: r(4, &[2, 4, 1, 4, 4]),
        docs: None,
    };
    let msg = shape_err(EX.gated_delta_rule_backward(&q, &q, &v, &g, &g, &short, &v), op);
    assert!(
        msg.contains("saved [2, 4, 1, 4, 4]") && msg.contains("[2, 4, 1, 4, 5]"),
        "{msg}"
    );
    let wrong_out = megatrain_tensor::DeltaRuleOut {
        out: g.clone(),
        saved: ok.saved.clone(),
        docs: None,
    };
    shape_err(
        EX.gated_delta_rule_backward(&q, &q, &v, &g, &g, &wrong_out, &v),
        op,
    );
    assert!(EX.gated_delta_rule_backward(&q, &q, &v, &g, &g, &ok, &v).is_ok());
}

/// g is `[B, T, Hv]` or, a decay per key channel, `[B, T, Hv, Dk]`; any
/// other shape is refused naming both, and dg takes g's shape.
#[test]
fn gated_delta_rule_refuses_other_decay_shapes() {
    let op = "gated_delta_rule";
    let (q, v, beta) = (r(1, &[2, 3, 2, 4]), r(2, &[2, 3, 4, 5]), r(3, &[2, 3, 4]));
    let g = r(5, &[2, 3, 4, 4]);
    let ok = EX.gated_delta_rule(&q, &q, &v, &g, &beta, None).unwrap();
    let gr = EX
        .gated_delta_rule_backward(&q, &q, &v, &g, &beta, &ok, &v)
        .unwrap();
    assert_eq!(megatrain_tensor::TensorHandle::dims(&gr.dg), [2, 3, 4, 4]);
    for bad in [
        &[2, 3, 4, 5][..],
        &[2, 3, 2, 4],
        &[2, 3, 4, 4, 1],
        &[2, 3, 16],
        &[2, 3, 4, 1],
    ] {
        let g = r(6, bad);
        let msg = shape_err(EX.gated_delta_rule(&q, &q, &v, &g, &beta, None), op);
        assert!(
            msg.contains("g must be [2, 3, 4] (a decay per value head) or [2, 3, 4, 4] (per key channel)"),
            "{msg}"
        );
        let msg = shape_err(
            EX.gated_delta_rule_backward(&q, &q, &v, &g, &beta, &ok, &v),
            "gated_delta_rule_backward",
        );
        assert!(msg.contains("or [2, 3, 4, 4]"), "{msg}");
    }
    // beta stays one per value head and step.
    let msg = shape_err(EX.gated_delta_rule(&q, &q, &v, &g, &g, None), op);
    assert!(msg.contains("beta must be [2, 3, 4]"), "{msg}");
}

#[test]
fn causal_conv1d_silu_errors() {
    let op = "causal_conv1d_silu";
    let (x, w) = (r(1, &[2, 5, 3]), r(2, &[3, 4]));
    let msg = shape_err(EX.causal_conv1d_silu(&r(1, &[10, 3]), &w, None), op);
    assert!(msg.contains("x [10, 3]") && msg.contains("[B, T, C]"), "{msg}");
    let msg = shape_err(EX.causal_conv1d_silu(&x, &r(2, &[4, 4]), None), op);
    assert!(msg.contains("w [4, 4]") && msg.contains("[2, 5, 3]"), "{msg}");
    let msg = shape_err(EX.causal_conv1d_silu(&x, &r(2, &[3, 0]), None), op);
    assert!(msg.contains("w [3, 0]") && msg.contains("K ≥ 1"), "{msg}");
    shape_err(EX.causal_conv1d_silu(&x, &r(2, &[12]), None), op);
    let op = "causal_conv1d_silu_backward";
    let msg = shape_err(
        EX.causal_conv1d_silu_backward(&x, &w, &r(3, &[2, 4, 3]), None),
        op,
    );
    assert!(msg.contains("dy [2, 4, 3]") && msg.contains("[2, 5, 3]"), "{msg}");
    shape_err(
        EX.causal_conv1d_silu_backward(&x, &r(2, &[3, 4, 1]), &x, None),
        op,
    );
    assert!(EX.causal_conv1d_silu_backward(&x, &w, &x, None).is_ok());
}

#[test]
fn delta_gates_errors() {
    let op = "delta_gates";
    let (a, h1) = (r(1, &[5, 4]), r(2, &[4]));
    let msg = shape_err(EX.delta_gates(&a, &r(3, &[5, 3]), &h1, &h1), op);
    assert!(msg.contains("b [5, 3]") && msg.contains("[5, 4]"), "{msg}");
    let msg = shape_err(EX.delta_gates(&a, &a, &r(4, &[3]), &h1), op);
    assert!(msg.contains("a_log [3]") && msg.contains("[4]"), "{msg}");
    let msg = shape_err(EX.delta_gates(&a, &a, &h1, &r(4, &[1, 4])), op);
    assert!(msg.contains("dt_bias [1, 4]"), "{msg}");
    shape_err(
        EX.delta_gates(&r(1, &[5, 0]), &r(1, &[5, 0]), &r(2, &[0]), &r(2, &[0])),
        op,
    );
    let op = "delta_gates_backward";
    let msg = shape_err(EX.delta_gates_backward(&a, &a, &h1, &h1, &r(5, &[4, 5]), &a), op);
    assert!(msg.contains("dg [4, 5]") && msg.contains("[5, 4]"), "{msg}");
    let msg = shape_err(EX.delta_gates_backward(&a, &a, &h1, &h1, &a, &r(5, &[20])), op);
    assert!(msg.contains("dbeta [20]"), "{msg}");
    assert!(EX.delta_gates_backward(&a, &a, &h1, &h1, &a, &a).is_ok());

    // Decays per key channel: a [5, 3, 4] with b [5, 3], parameters [12].
    let op = "delta_gates";
    let (ac, bc, c1) = (r(6, &[5, 3, 4]), r(7, &[5, 3]), r(8, &[12]));
    assert!(EX.delta_gates(&ac, &bc, &c1, &c1).is_ok());
    let msg = shape_err(EX.delta_gates(&ac, &r(7, &[5, 4]), &c1, &c1), op);
    assert!(msg.contains("b [5, 4]") && msg.contains("[5, 3, 4]"), "{msg}");
    let msg = shape_err(EX.delta_gates(&ac, &bc, &r(9, &[3]), &c1), op);
    assert!(
        msg.contains("a_log [3]") && msg.contains("[12], one per channel"),
        "{msg}"
    );
    let msg = shape_err(EX.delta_gates(&ac, &bc, &c1, &r(9, &[3, 4])), op);
    assert!(msg.contains("dt_bias [3, 4]") && msg.contains("[12]"), "{msg}");
    let msg = shape_err(
        EX.delta_gates(&r(1, &[5, 3, 0]), &bc, &r(2, &[0]), &r(2, &[0])),
        op,
    );
    assert!(msg.contains("a [5, 3, 0]") && msg.contains("Dk ≥ 1"), "{msg}");
    let msg = shape_err(EX.delta_gates(&r(1, &[5, 0, 4]), &r(1, &[5, 0]), &h1, &h1), op);
    assert!(msg.contains("b [5, 0]") && msg.contains("H ≥ 1"), "{msg}");
    let op = "delta_gates_backward";
    let msg = shape_err(EX.delta_gates_backward(&ac, &bc, &c1, &c1, &ac, &ac), op);
    assert!(
        msg.contains("dbeta [5, 3, 4]") && msg.contains("b's shape [5, 3]"),
        "{msg}"
    );
    let msg = shape_err(EX.delta_gates_backward(&ac, &bc, &c1, &c1, &bc, &bc), op);
    assert!(msg.contains("dg [5, 3]") && msg.contains("[5, 3, 4]"), "{msg}");
    assert!(EX.delta_gates_backward(&ac, &bc, &c1, &c1, &ac, &bc).is_ok());
}

#[test]
fn sigmoid_mul_errors() {
    let (g, x) = (r(1, &[2, 3]), r(2, &[3, 2]));
    let msg = shape_err(EX.sigmoid_mul(&g, &x), "sigmoid_mul");
    assert!(msg.contains("x [3, 2]") && msg.contains("[2, 3]"), "{msg}");
    let op = "sigmoid_mul_backward";
    shape_err(EX.sigmoid_mul_backward(&g, &x, &g), op);
    let msg = shape_err(EX.sigmoid_mul_backward(&g, &g, &r(3, &[6])), op);
    assert!(msg.contains("dy [6]"), "{msg}");
}
