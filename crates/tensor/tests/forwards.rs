//! Hand-computed cases for the f32 reference executor.

use megatrain_tensor::testing::{random_tensor, rel_norm_err};
use megatrain_tensor::{
    AttnMask, ClampedGlu, CpuExecutor, CpuTensor, DType, Executor, F64Executor, HostTensor, LossTerms, Rope,
    RopeScaling, Shape, SoftCap, TensorHandle, Transpose, bf16,
};

const EX: CpuExecutor = CpuExecutor::new();

fn up(shape: &[usize], data: &[f32]) -> megatrain_tensor::CpuTensor<f32> {
    EX.upload(&HostTensor::from_f32(shape.to_vec(), data.to_vec()).unwrap())
        .unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "element {i}: {x} vs {y}\n{a:?}\n{b:?}");
    }
}

#[test]
fn matmul_2x2_every_transpose_and_bias() {
    // a = [[1,2],[3,4]], b = [[5,6],[7,8]]
    let (a, b) = (up(&[2, 2], &[1., 2., 3., 4.]), up(&[2, 2], &[5., 6., 7., 8.]));
    let bias = up(&[2], &[10., 20.]);
    let cases = [
        (Transpose::NN, [19., 22., 43., 50.]),
        (Transpose::NT, [17., 23., 39., 53.]),
        (Transpose::TN, [26., 30., 38., 44.]),
        (Transpose::TT, [23., 31., 34., 46.]),
    ];
    for (t, want) in cases {
        assert_eq!(EX.matmul(&a, &b, None, t).unwrap().data(), want, "{t:?}");
    }
    assert_eq!(
        EX.matmul(&a, &b, Some(&bias), Transpose::NN).unwrap().data(),
        [29., 42., 53., 70.]
    );
}

#[test]
fn matmul_bf16_b_is_decoded() {
    let a = up(&[1, 2], &[1., 2.]);
    let b32 = HostTensor::from_f32(vec![2, 1], vec![0.5, 3.0]).unwrap();
    let b = EX.upload(&b32.to_dtype(DType::BF16)).unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    assert_eq!(EX.matmul(&a, &b, None, Transpose::NN).unwrap().data(), [6.5]);
    // download keeps the stored dtype
    let back = EX.download(&b).unwrap();
    assert_eq!(back.dtype(), DType::BF16);
    assert_eq!(back.to_f32_vec(), [0.5, 3.0]);
    let _ = bf16::ONE;
}

#[test]
fn batched_matmul_matches_per_batch_products() {
    let a = EX.upload(&random_tensor(1, [3, 4, 5])).unwrap();
    let b = EX.upload(&random_tensor(2, [3, 5, 2])).unwrap();
    let y = EX.matmul(&a, &b, None, Transpose::NN).unwrap();
    assert_eq!(y.dims(), [3, 4, 2]);
    for i in 0..3 {
        let ai = EX
            .slice_rows(&EX.reshape(&a, &Shape::new([12, 5])).unwrap(), 4 * i, 4)
            .unwrap();
        let bi = EX
            .slice_rows(&EX.reshape(&b, &Shape::new([15, 2])).unwrap(), 5 * i, 5)
            .unwrap();
        let yi = EX.matmul(&ai, &bi, None, Transpose::NN).unwrap();
        close(yi.data(), &y.data()[8 * i..8 * (i + 1)], 1e-6);
    }
}

#[test]
fn rmsnorm_of_3_4() {
    let x = up(&[1, 2], &[3., 4.]);
    let w = up(&[2], &[1., 2.]);
    let o = EX.rmsnorm(&x, &w, 0.0).unwrap();
    // mean square 12.5, rms sqrt(12.5)
    let r = 1.0 / 12.5f32.sqrt();
    close(o.rstd.data(), &[r], 1e-7);
    close(o.y.data(), &[3. * r, 8. * r], 1e-6);
    assert!(o.mean.is_none());
}

#[test]
fn layernorm_of_3_4() {
    let x = up(&[1, 2], &[3., 4.]);
    let (w, b) = (up(&[2], &[1., 2.]), up(&[2], &[0.5, -0.5]));
    let o = EX.layernorm(&x, &w, &b, 0.0).unwrap();
    // mean 3.5, var 0.25, rstd 2: x̂ = [-1, 1]
    close(o.mean.unwrap().data(), &[3.5], 0.0);
    close(o.rstd.data(), &[2.0], 1e-6);
    close(o.y.data(), &[-0.5, 1.5], 1e-6);
}

#[test]
fn cross_entropy_of_a_known_row() {
    let logits = up(&[2, 3], &[1., 2., 3., 0., 0., 0.]);
    let o = EX
        .cross_entropy(&logits, &[2, -1], -1, 0.5, LossTerms::NONE)
        .unwrap();
    let z = 1f32.exp() + 2f32.exp() + 3f32.exp();
    let p = [1f32.exp() / z, 2f32.exp() / z, 3f32.exp() / z];
    close(o.losses.data(), &[-(p[2].ln()), 0.0], 1e-6);
    close(
        o.dlogits.data(),
        &[0.5 * p[0], 0.5 * p[1], 0.5 * (p[2] - 1.0), 0., 0., 0.],
        1e-6,
    );
    // uniform logits: loss ln V
    let o = EX
        .cross_entropy(&up(&[1, 4], &[7.; 4]), &[1], -100, 1.0, LossTerms::NONE)
        .unwrap();
    close(o.losses.data(), &[4f32.ln()], 1e-6);
}

#[test]
fn cross_entropy_is_stable_for_huge_logits() {
    let o = EX
        .cross_entropy(&up(&[1, 3], &[1e30, 0., -1e30]), &[0], -100, 1.0, LossTerms::NONE)
        .unwrap();
    assert_eq!(o.losses.data(), [0.0]);
    assert!(o.dlogits.data().iter().all(|g| g.is_finite()));
}

#[test]
fn rope_at_position_zero_is_identity_and_rotates_later() {
    let x = EX.upload(&random_tensor(3, [1, 1, 2, 4])).unwrap();
    let y = EX.rope(&x, Rope::plain(10000.0, 0)).unwrap();
    assert_eq!(y.data(), x.data());
    // Position 1, D = 2: a single frequency 1, angle 1 rad.
    let x = up(&[1, 2, 1, 2], &[0., 0., 1., 0.]);
    let y = EX.rope(&x, Rope::plain(10000.0, 0)).unwrap();
    close(y.data(), &[0., 0., 1f32.cos(), 1f32.sin()], 1e-7);
    // offset shifts positions: token 0 at offset 1 equals token 1 at offset 0.
    let y1 = EX
        .rope(&up(&[1, 1, 1, 2], &[1., 0.]), Rope::plain(10000.0, 1))
        .unwrap();
    close(y1.data(), &y.data()[2..], 0.0);
    // the backward undoes the forward
    let x = EX.upload(&random_tensor(4, [2, 3, 2, 6])).unwrap();
    let rope = Rope::plain(500.0, 11);
    let back = EX
        .rope_backward(&EX.rope(&x, rope.clone()).unwrap(), rope)
        .unwrap();
    close(back.data(), x.data(), 1e-6);
}

#[test]
fn partial_rope_rotates_the_leading_entries_as_a_head_of_their_size() {
    // Heads of 10 rotating 6: entries 0..6 as a whole head of 6 would turn
    // (frequencies of a 6-wide head), 6..10 untouched.
    let (b, t, h, d, r) = (2, 5, 3, 10, 6);
    let hx = random_tensor(4, [b, t, h, d]);
    let x = hx.to_f32_vec();
    let lead: Vec<f32> = x.chunks(d).flat_map(|row| row[..r].to_vec()).collect();
    let scaling = RopeScaling::Linear { factor: 2.0 };
    let part = Rope {
        rotary_dim: Some(r),
        scaling: scaling.clone(),
        ..Rope::plain(500.0, 3)
    };
    let whole = Rope {
        scaling,
        ..Rope::plain(500.0, 3)
    };
    for inverse in [false, true] {
        let go = |x: &CpuTensor<f32>, rope: Rope| match inverse {
            false => EX.rope(x, rope).unwrap(),
            true => EX.rope_backward(x, rope).unwrap(),
        };
        let y = go(&EX.upload(&hx).unwrap(), part.clone());
        let want = go(&up(&[b, t, h, r], &lead), whole.clone());
        for (row, (yr, xr)) in y.data().chunks(d).zip(x.chunks(d)).enumerate() {
            assert_eq!(&yr[..r], &want.data()[row * r..][..r], "row {row} rotated part");
            assert_eq!(&yr[r..], &xr[r..], "row {row} passed through");
        }
    }
}

#[test]
fn rope_second_frequency_uses_theta() {
    // D = 4: frequencies 1 and theta^(-1/2) = 0.01 for theta = 10000.
    let x = up(
        &[1, 4, 1, 4],
        &[0.; 16]
            .iter()
            .enumerate()
            .map(|(i, _)| if i % 4 == 1 { 1.0 } else { 0.0 })
            .collect::<Vec<_>>(),
    );
    let y = EX.rope(&x, Rope::plain(10000.0, 0)).unwrap();
    let a = 3.0f64 * 0.01;
    close(&y.data()[12..], &[0., a.cos() as f32, 0., a.sin() as f32], 1e-7);
}

#[test]
fn attention_with_one_token_returns_v() {
    let q = EX.upload(&random_tensor(1, [2, 1, 4, 3])).unwrap();
    let k = EX.upload(&random_tensor(2, [2, 1, 2, 3])).unwrap();
    let v = EX.upload(&random_tensor(3, [2, 1, 2, 3])).unwrap();
    let o = EX.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
    let vd = v.data();
    for b in 0..2 {
        for h in 0..4 {
            let g = h / 2;
            close(
                &o.out.data()[(b * 4 + h) * 3..][..3],
                &vd[(b * 2 + g) * 3..][..3],
                0.0,
            );
        }
    }
    assert_eq!(o.lse.dims(), [2, 4, 1]);
}

#[test]
fn attention_is_causal_and_averages_equal_scores() {
    // q = 0 gives equal scores: token t outputs the mean of v[0..=t]; lse = ln(t + 1).
    let q = up(&[1, 3, 1, 2], &[0.; 6]);
    let k = EX.upload(&random_tensor(5, [1, 3, 1, 2])).unwrap();
    let v = up(&[1, 3, 1, 2], &[1., 2., 3., 4., 5., 6.]);
    let o = EX.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
    close(o.out.data(), &[1., 2., 2., 3., 3., 4.], 1e-6);
    close(o.lse.data(), &[0., 2f32.ln(), 3f32.ln()], 1e-6);
}

#[test]
fn sliding_window_averages_only_the_last_keys() {
    // q = 0 again: with a window of 2, token t outputs the mean of v[t-1..=t].
    let q = up(&[1, 4, 1, 1], &[0.; 4]);
    let k = EX.upload(&random_tensor(5, [1, 4, 1, 1])).unwrap();
    let v = up(&[1, 4, 1, 1], &[1., 2., 4., 8.]);
    let o = EX.attention(&q, &k, &v, AttnMask::sliding(2)).unwrap();
    close(o.out.data(), &[1., 1.5, 3., 6.], 1e-6);
    close(o.lse.data(), &[0., 2f32.ln(), 2f32.ln(), 2f32.ln()], 1e-6);
    assert_eq!(o.mask, AttnMask::sliding(2));
    // A window of one key is that key's value.
    let o1 = EX.attention(&q, &k, &v, AttnMask::sliding(1)).unwrap();
    close(o1.out.data(), v.data(), 0.0);
}

#[test]
fn sliding_window_ignores_keys_before_it_and_covers_causal_when_wide() {
    let (b, t, hq, hkv, d, w) = (2, 9, 4, 2, 5, 3);
    let q = EX.upload(&random_tensor(1, [b, t, hq, d])).unwrap();
    let hk = random_tensor(2, [b, t, hkv, d]);
    let hv = random_tensor(3, [b, t, hkv, d]);
    let (k, v) = (EX.upload(&hk).unwrap(), EX.upload(&hv).unwrap());
    let o = EX.attention(&q, &k, &v, AttnMask::sliding(w)).unwrap();
    // Keys 0..=2 changed: only queries up to 2 + w - 1 = 4 may move.
    let bump = |h: &HostTensor| {
        let mut x = h.to_f32_vec();
        for bi in 0..b {
            for j in 0..3 {
                for e in 0..hkv * d {
                    x[(bi * t + j) * hkv * d + e] += 0.75;
                }
            }
        }
        EX.upload(&HostTensor::from_f32(h.shape().dims().to_vec(), x).unwrap())
            .unwrap()
    };
    let o2 = EX
        .attention(&q, &bump(&hk), &bump(&hv), AttnMask::sliding(w))
        .unwrap();
    let row = hq * d;
    for bi in 0..b {
        for ti in 0..t {
            let (a, c) = (
                &o.out.data()[(bi * t + ti) * row..][..row],
                &o2.out.data()[(bi * t + ti) * row..][..row],
            );
            match ti < 3 + w - 1 {
                true => assert!(a != c, "query {ti} sees the changed keys"),
                false => assert_eq!(a, c, "query {ti} is past the window of the changed keys"),
            }
        }
    }
    // A window of at least T keys is plain causal attention, bit for bit.
    let causal = EX.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
    for wide in [t, t + 7] {
        let o = EX.attention(&q, &k, &v, AttnMask::sliding(wide)).unwrap();
        assert_eq!(o.out.data(), causal.out.data());
        assert_eq!(o.lse.data(), causal.lse.data());
    }
}

#[test]
fn activations_known_values() {
    let x = up(&[3], &[0., 1., -1.]);
    let s = |v: f32| 1.0 / (1.0 + (-v).exp());
    let y = EX.swiglu(&x, &up(&[3], &[2., 2., 2.])).unwrap();
    close(y.data(), &[0., 2. * s(1.), -2. * s(-1.)], 1e-6);
    let g = EX.gelu(&x).unwrap();
    let gelu =
        |v: f32| 0.5 * v * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh());
    close(g.data(), &[0., gelu(1.), gelu(-1.)], 1e-6);
    close(&g.data()[1..2], &[0.841192], 1e-5);
    // GeGLU is gelu(gate) · up.
    let y = EX.geglu(&x, &up(&[3], &[2., 3., -0.5])).unwrap();
    close(y.data(), &[0., 3. * gelu(1.), -0.5 * gelu(-1.)], 1e-6);
}

/// GPT-OSS's clamped SwiGLU clamps the gate above only and the up
/// projection both ways, reading them interleaved from one product; the
/// f64 executor computes with alpha = 1.702 as an f64 (transformers'
/// Python float), in transformers' order, to the bit.
#[test]
fn swiglu_clamped_known_values() {
    let c = ClampedGlu::new(1.702, 7.0, "test").unwrap();
    let (gate, upv) = ([-9.0f32, 0.3, 7.0, 7.5, 12.0], [0.2f32, -8.0, 7.0, -7.0, 30.0]);
    let gu: Vec<f32> = gate.iter().zip(&upv).flat_map(|(&g, &u)| [g, u]).collect();
    let y = EX.swiglu_clamped(&up(&[1, 10], &gu), c).unwrap();
    assert_eq!(y.dims(), [1, 5]);
    let s = |v: f32| 1.0 / (1.0 + (-v).exp());
    let f = |g: f32, u: f32| g * s(1.702 * g) * (u + 1.0);
    let want = [f(-9.0, 0.2), f(0.3, -7.0), f(7.0, 7.0), f(7.0, -7.0), f(7.0, 7.0)];
    close(y.data(), &want, 1e-5);

    let ex = F64Executor::new();
    let gu = ex.upload(&HostTensor::from_f32(vec![10], gu).unwrap()).unwrap();
    let y = ex.swiglu_clamped(&gu, c).unwrap();
    let s = |v: f64| 1.0 / (1.0 + (-v).exp());
    for (i, (&g, &u)) in gate.iter().zip(&upv).enumerate() {
        let (g, u) = ((g as f64).min(7.0), (u as f64).clamp(-7.0, 7.0));
        assert_eq!(y.data()[i], (u + 1.0) * (g * s(g * 1.702)), "element {i}");
    }
    let bad = ClampedGlu {
        alpha: 1.702,
        limit: -1.0,
    };
    assert!(EX.swiglu_clamped(&up(&[2], &[0.0, 0.0]), bad).is_err());
}

/// A sink is one more column of every row's softmax, with no value: the
/// sink attention's output against that softmax written out in f64.
#[test]
fn attention_sinks_is_a_softmax_with_a_sink_column() {
    let (b, t, hq, hkv, d) = (2, 4, 4, 2, 3);
    let q = EX.upload(&random_tensor(61, [b, t, hq, d])).unwrap();
    let k = EX.upload(&random_tensor(62, [b, t, hkv, d])).unwrap();
    let v = EX.upload(&random_tensor(63, [b, t, hkv, d])).unwrap();
    let sinks = up(&[hq], &[-2.0, 0.0, 0.7, 3.0]);
    let fw = EX.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
    let os = EX.attention_sinks(&fw, &sinks).unwrap();
    let (qd, kd, vd) = (q.data(), k.data(), v.data());
    let mut want = vec![0.0f32; os.numel()];
    for (bi, ti, h) in (0..b).flat_map(|bi| (0..t).flat_map(move |ti| (0..hq).map(move |h| (bi, ti, h)))) {
        let (qr, g) = (&qd[((bi * t + ti) * hq + h) * d..][..d], h / (hq / hkv));
        let kv = |x: &[f32], j: usize| x[((bi * t + j) * hkv + g) * d..][..d].to_vec();
        let scores: Vec<f64> = (0..=ti)
            .map(|j| {
                let s: f64 = qr.iter().zip(kv(kd, j)).map(|(&a, b)| a as f64 * b as f64).sum();
                s / (d as f64).sqrt()
            })
            .collect();
        let sink = sinks.data()[h] as f64;
        let z: f64 = scores.iter().map(|s| s.exp()).sum::<f64>() + sink.exp();
        for (j, s) in scores.iter().enumerate() {
            for (e, &vv) in kv(vd, j).iter().enumerate() {
                want[((bi * t + ti) * hq + h) * d + e] += (s.exp() / z * vv as f64) as f32;
            }
        }
    }
    close(os.data(), &want, 1e-6);
}

/// x · Φ(x), Φ the standard normal CDF (values from scipy.stats.norm.cdf).
#[test]
fn gelu_erf_known_values() {
    let x = up(&[5], &[0., 1., -1., 3., -6.]);
    let y = EX.gelu_erf(&x).unwrap();
    close(
        y.data(),
        &[0., 0.841_344_7, -0.158_655_25, 2.995_950_2, -5.9e-9],
        1e-6,
    );
    // The slope Φ(x) + x·φ(x): ½ at 0, 1.0833 at 1.
    let dx = EX
        .gelu_erf_backward(&up(&[2], &[0., 1.]), &up(&[2], &[1., 1.]))
        .unwrap();
    close(dx.data(), &[0.5, 0.841_344_7 + 0.241_970_72], 1e-6);
}

#[test]
fn softcap_known_values() {
    let cap = SoftCap::new(2.0, "test").unwrap();
    let x = up(&[4], &[0., 1., -3., 1e4]);
    let y = EX.softcap(x.clone(), cap).unwrap();
    close(
        y.data(),
        &[0., 2. * 0.5f32.tanh(), 2. * (-1.5f32).tanh(), 2.],
        1e-6,
    );
    // The slope is 1 at 0 and 0 where the cap is reached.
    let dx = EX.softcap_backward(&y, up(&[4], &[3.; 4]), cap).unwrap();
    let t = 0.5f32.tanh();
    close(
        dx.data(),
        &[3., 3. * (1. - t * t), 3. * (1. - 1.5f32.tanh().powi(2)), 0.],
        1e-5,
    );
}

/// Two keys with raw scores 0 and 4 (q·k / √1): capped at 1, the second
/// scores tanh(4) instead, so the weights are softmax([0, tanh 4]).
#[test]
fn soft_capped_attention_weighs_the_capped_scores() {
    let q = up(&[1, 2, 1, 1], &[1., 4.]);
    let k = up(&[1, 2, 1, 1], &[0., 1.]);
    let v = up(&[1, 2, 1, 1], &[10., 20.]);
    let mask = AttnMask::CAUSAL.with_softcap(SoftCap::new(1.0, "test").unwrap());
    let o = EX.attention(&q, &k, &v, mask.clone()).unwrap();
    assert_eq!(o.mask, mask);
    let s = 4.0f32.tanh();
    let w = s.exp() / (1.0 + s.exp());
    close(o.out.data(), &[10., 10. * (1. - w) + 20. * w], 1e-5);
    close(&o.lse.data()[1..], &[(1.0 + s.exp()).ln()], 1e-6);
    // Uncapped, the second key would take nearly all the weight.
    let plain = EX.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
    assert!(plain.out.data()[1] > 19.6);
}

#[test]
fn embedding_gathers_and_scatter_accumulates() {
    let table = up(&[3, 2], &[0., 1., 10., 11., 20., 21.]);
    let e = EX.embedding(&[2, 0, 2], &table).unwrap();
    assert_eq!(e.data(), [20., 21., 0., 1., 20., 21.]);
    let mut dt = up(&[3, 2], &[1.; 6]);
    EX.embedding_backward(&[2, 0, 2], &up(&[3, 2], &[1., 2., 3., 4., 5., 6.]), &mut dt)
        .unwrap();
    assert_eq!(dt.data(), [4., 5., 1., 1., 7., 9.]);
    // bf16 tables gather decoded values
    let tb = EX
        .upload(
            &HostTensor::from_f32(vec![2, 1], vec![1.5, -2.0])
                .unwrap()
                .to_dtype(DType::BF16),
        )
        .unwrap();
    assert_eq!(EX.embedding(&[1], &tb).unwrap().data(), [-2.0]);
}

#[test]
fn data_movement_round_trips() {
    let x = EX.upload(&random_tensor(7, [2, 3, 7])).unwrap();
    let parts = EX.split_last(&x, &[2, 0, 5]).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>(),
        [[2, 3, 2], [2, 3, 0], [2, 3, 5]]
    );
    let back = EX.concat_last(&parts.iter().collect::<Vec<_>>()).unwrap();
    assert_eq!(back, x);
    let s = EX.slice_rows(&x, 2, 3).unwrap();
    assert_eq!(s.dims(), [3, 7]);
    assert_eq!(s.data(), &x.data()[14..35]);
    let mut z = EX.zeros(&Shape::new([6, 7])).unwrap();
    EX.write_rows(&mut z, 1, &s).unwrap();
    assert_eq!(&z.data()[7..28], s.data());
    assert!(z.data()[..7].iter().chain(&z.data()[28..]).all(|&v| v == 0.0));
    let r = EX.reshape(&x, &Shape::new([42])).unwrap();
    assert_eq!((r.dims(), r.data()), ([42].as_slice(), x.data()));
    let host = random_tensor(8, [3, 2]);
    assert_eq!(EX.download(&EX.upload(&host).unwrap()).unwrap(), host);
}

#[test]
fn elementwise_ops() {
    let (a, b) = (up(&[2, 2], &[1., 2., 3., 4.]), up(&[2, 2], &[10., 20., 30., 40.]));
    assert_eq!(EX.add(&a, &b).unwrap().data(), [11., 22., 33., 44.]);
    assert_eq!(EX.scale(&a, -2.0).unwrap().data(), [-2., -4., -6., -8.]);
    assert_eq!(EX.add_scalar(&a, 1.5).unwrap().data(), [2.5, 3.5, 4.5, 5.5]);
    let mut acc = a.clone();
    EX.add_assign(&mut acc, &EX.reshape(&b, &Shape::new([4])).unwrap())
        .unwrap();
    assert_eq!(acc.data(), [11., 22., 33., 44.]);
    assert_eq!(acc.dims(), [2, 2]);
}

#[test]
fn f64_and_f32_executors_agree_on_random_inputs() {
    use megatrain_tensor::F64Executor;
    let e64 = F64Executor::new();
    let hq = random_tensor(1, [2, 5, 4, 6]);
    let hk = random_tensor(2, [2, 5, 2, 6]);
    let hv = random_tensor(3, [2, 5, 2, 6]);
    let o32 = EX
        .attention(
            &EX.upload(&hq).unwrap(),
            &EX.upload(&hk).unwrap(),
            &EX.upload(&hv).unwrap(),
            AttnMask::CAUSAL,
        )
        .unwrap();
    let o64 = e64
        .attention(
            &e64.upload(&hq).unwrap(),
            &e64.upload(&hk).unwrap(),
            &e64.upload(&hv).unwrap(),
            AttnMask::CAUSAL,
        )
        .unwrap();
    assert!(rel_norm_err(o32.out.data(), o64.out.data()) < 1e-6);
}

/// One key and one value dimension, two steps, by hand: t = 0 writes
/// δ = β₀v₀ = 2 into the empty state (o = 0.5 · 2); t = 1 halves it to 1,
/// reads m = 1 back, writes δ = 0.25 (2 − 1) on top (o = 2 · 1.25).
#[test]
fn gated_delta_rule_two_steps_by_hand() {
    let d = [1, 2, 1, 1];
    let (q, k, v) = (up(&d, &[0.5, 2.0]), up(&d, &[1.0, 1.0]), up(&d, &[4.0, 2.0]));
    let (g, beta) = (up(&[1, 2, 1], &[0.0, 0.5f32.ln()]), up(&[1, 2, 1], &[0.5, 0.25]));
    let fw = EX.gated_delta_rule(&q, &k, &v, &g, &beta, None).unwrap();
    close(fw.out.data(), &[1.0, 2.5], 1e-6);
    assert_eq!(
        (fw.saved.dims(), fw.saved.data()),
        (&[1, 1, 1, 1, 1][..], &[0.0][..])
    );
}

/// transformers' `torch_recurrent_gated_delta_rule` (without its l2 norm
/// and query scale) transcribed in f64 with its repeat_interleave of the
/// key heads: the f32 executor's output, and its checkpoints against the
/// states the transcription passes at every chunk start.
#[test]
fn gated_delta_rule_is_transformers_recurrence() {
    let (b, t, hk, hv, dk, dv) = (2, 70, 2, 4, 5, 3);
    let chunk = megatrain_tensor::DELTA_RULE_CHUNK;
    let q = EX.upload(&random_tensor(71, [b, t, hk, dk])).unwrap();
    // |k|² ≤ 0.8 and β < 0.9 keep the recurrence contracting, so that f32
    // and f64 stay close over 70 steps.
    let k = EX
        .scale(&EX.upload(&random_tensor(72, [b, t, hk, dk])).unwrap(), 0.4)
        .unwrap();
    let v = EX.upload(&random_tensor(73, [b, t, hv, dv])).unwrap();
    let g = EX.upload(&random_tensor(74, [b, t, hv])).unwrap();
    let beta = EX.upload(&random_tensor(75, [b, t, hv])).unwrap();
    let g = EX.add_scalar(&EX.scale(&g, 0.5).unwrap(), -0.5).unwrap();
    let beta = EX.add_scalar(&EX.scale(&beta, 0.4).unwrap(), 0.5).unwrap();
    let fw = EX.gated_delta_rule(&q, &k, &v, &g, &beta, None).unwrap();
    let f = |x: &CpuTensor<f32>, i: usize| x.data()[i] as f64;
    let nc = t.div_ceil(chunk);
    let (mut want, mut saved) = (vec![0.0f32; b * t * hv * dv], vec![0.0f32; b * hv * nc * dk * dv]);
    for (bi, h) in (0..b).flat_map(|bi| (0..hv).map(move |h| (bi, h))) {
        let kh = h / (hv / hk);
        let mut state = vec![vec![0.0f64; dv]; dk];
        for ti in 0..t {
            if ti % chunk == 0 {
                for (i, row) in state.iter().enumerate() {
                    for (j, &s) in row.iter().enumerate() {
                        saved[(((bi * hv + h) * nc + ti / chunk) * dk + i) * dv + j] = s as f32;
                    }
                }
            }
            let (kq, vo, gb) = (
                ((bi * t + ti) * hk + kh) * dk,
                ((bi * t + ti) * hv + h) * dv,
                (bi * t + ti) * hv + h,
            );
            let (q_t, k_t) = (|i| f(&q, kq + i), |i| f(&k, kq + i));
            let (g_t, beta_t) = (f(&g, gb).exp(), f(&beta, gb));
            state.iter_mut().flatten().for_each(|s| *s *= g_t);
            let kv_mem: Vec<f64> = (0..dv)
                .map(|j| (0..dk).map(|i| state[i][j] * k_t(i)).sum())
                .collect();
            let delta: Vec<f64> = (0..dv).map(|j| (f(&v, vo + j) - kv_mem[j]) * beta_t).collect();
            for (i, row) in state.iter_mut().enumerate() {
                row.iter_mut().zip(&delta).for_each(|(s, d)| *s += k_t(i) * d);
            }
            for j in 0..dv {
                want[vo + j] = (0..dk).map(|i| state[i][j] * q_t(i)).sum::<f64>() as f32;
            }
        }
    }
    assert_eq!(fw.saved.dims(), [b, hv, nc, dk, dv]);
    assert!(
        rel_norm_err(fw.out.data(), &want) < 1e-6,
        "{}",
        rel_norm_err(fw.out.data(), &want)
    );
    assert!(rel_norm_err(fw.saved.data(), &saved) < 1e-6);
}

/// transformers' `recurrent_kimi_delta_attention` (Kimi Linear's KDA,
/// without its l2 norm; its query scale 1/√Dk applied to q before the op)
/// transcribed in f64: g `[B, T, H, Dk]` decays row i of each head's state
/// by `exp(g[i])`, Hk = Hv. The f32 executor's output, and its checkpoints
/// against the states the transcription passes at every chunk start.
#[test]
fn gated_delta_rule_per_channel_decay_is_transformers_kda() {
    let (b, t, h, dk, dv) = (2, 70, 3, 5, 3);
    let chunk = megatrain_tensor::DELTA_RULE_CHUNK;
    let q = EX.upload(&random_tensor(81, [b, t, h, dk])).unwrap();
    // As above, |k|² ≤ 0.8 and β < 0.9; the decays in (e^−1.5, e^−0.5).
    let k = EX
        .scale(&EX.upload(&random_tensor(82, [b, t, h, dk])).unwrap(), 0.4)
        .unwrap();
    let v = EX.upload(&random_tensor(83, [b, t, h, dv])).unwrap();
    let g = EX.upload(&random_tensor(84, [b, t, h, dk])).unwrap();
    let beta = EX.upload(&random_tensor(85, [b, t, h])).unwrap();
    let g = EX.add_scalar(&EX.scale(&g, 0.5).unwrap(), -1.0).unwrap();
    let beta = EX.add_scalar(&EX.scale(&beta, 0.4).unwrap(), 0.5).unwrap();
    let scale = 1.0 / (dk as f64).sqrt();
    let qs = EX.scale(&q, scale).unwrap();
    let fw = EX.gated_delta_rule(&qs, &k, &v, &g, &beta, None).unwrap();
    let f = |x: &CpuTensor<f32>, i: usize| x.data()[i] as f64;
    let nc = t.div_ceil(chunk);
    let (mut want, mut saved) = (vec![0.0f32; b * t * h * dv], vec![0.0f32; b * h * nc * dk * dv]);
    // last_recurrent_state [B, H, Dk, Dv], zero.
    let mut state = vec![0.0f64; b * h * dk * dv];
    let st = |bi: usize, hi: usize, i: usize, j: usize| ((bi * h + hi) * dk + i) * dv + j;
    for i in 0..t {
        if i % chunk == 0 {
            for (e, &s) in state.iter().enumerate() {
                let (bh, ij) = (e / (dk * dv), e % (dk * dv));
                saved[(bh * nc + i / chunk) * dk * dv + ij] = s as f32;
            }
        }
        for (bi, hi) in (0..b).flat_map(|bi| (0..h).map(move |hi| (bi, hi))) {
            let at = (bi * t + i) * h + hi;
            // q_i = query[:, i] · scale; k_i; v_i; g_i = g[:, i][..., None].exp(); b_i.
            let q_i = |x| f(&q, at * dk + x) * scale;
            let k_i = |x| f(&k, at * dk + x);
            let v_i = |y| f(&v, at * dv + y);
            let g_i = |x| f(&g, at * dk + x).exp();
            let b_i = f(&beta, at);
            // last_recurrent_state = last_recurrent_state * g_i
            for x in 0..dk {
                for y in 0..dv {
                    state[st(bi, hi, x, y)] *= g_i(x);
                }
            }
            // kv_mem = (last_recurrent_state * k_i[..., None]).sum(dim=-2)
            let kv_mem: Vec<f64> = (0..dv)
                .map(|y| (0..dk).map(|x| state[st(bi, hi, x, y)] * k_i(x)).sum())
                .collect();
            // delta = (v_i - kv_mem) * b_i
            let delta: Vec<f64> = (0..dv).map(|y| (v_i(y) - kv_mem[y]) * b_i).collect();
            // last_recurrent_state += k_i.unsqueeze(-1) * delta.unsqueeze(-2)
            for x in 0..dk {
                for y in 0..dv {
                    state[st(bi, hi, x, y)] += k_i(x) * delta[y];
                }
            }
            // core_attn_out[:, i] = (last_recurrent_state * q_i.unsqueeze(-1)).sum(dim=-2)
            for y in 0..dv {
                want[at * dv + y] = (0..dk).map(|x| state[st(bi, hi, x, y)] * q_i(x)).sum::<f64>() as f32;
            }
        }
    }
    assert_eq!(fw.saved.dims(), [b, h, nc, dk, dv]);
    let err = rel_norm_err(fw.out.data(), &want);
    assert!(err < 1e-6, "{err}");
    let err = rel_norm_err(fw.saved.data(), &saved);
    assert!(err < 1e-6, "{err}");
}

/// The short convolution against its definition written out with an
/// explicit left padding of K − 1 zeros per sequence (HF's `Conv1d`
/// with `padding = K − 1`, cut to the first T outputs), in f64.
#[test]
fn causal_conv1d_silu_known_values() {
    let silu = |v: f64| v / (1.0 + (-v).exp());
    for (seed, [b, t, c, k]) in [(601u64, [2, 5, 3, 4]), (611, [2, 2, 2, 4]), (621, [1, 3, 2, 1])] {
        let x = random_tensor(seed, [b, t, c]);
        let w = random_tensor(seed + 1, [c, k]);
        let (xd, wd) = (x.to_f32_vec(), w.to_f32_vec());
        let mut want = Vec::new();
        for bi in 0..b {
            // [K − 1 zeros, then x[bi]], per channel.
            let padded: Vec<Vec<f64>> = (0..c)
                .map(|ci| {
                    let mut p = vec![0.0; k - 1];
                    p.extend((0..t).map(|ti| xd[(bi * t + ti) * c + ci] as f64));
                    p
                })
                .collect();
            for ti in 0..t {
                for ci in 0..c {
                    let z: f64 = (0..k).map(|i| wd[ci * k + i] as f64 * padded[ci][ti + i]).sum();
                    want.push(silu(z) as f32);
                }
            }
        }
        let y = EX
            .causal_conv1d_silu(&EX.upload(&x).unwrap(), &EX.upload(&w).unwrap(), None)
            .unwrap();
        assert_eq!(y.dims(), [b, t, c]);
        close(y.data(), &want, 1e-6);
    }
    // One sequence, one channel, taps [1, 2]: y = silu(x[t−1] + 2 x[t]).
    let y = EX
        .causal_conv1d_silu(
            &up(&[1, 3, 1], &[1.0, -1.0, 0.5]),
            &up(&[1, 2], &[1.0, 2.0]),
            None,
        )
        .unwrap();
    let s = |v: f32| v / (1.0 + (-v).exp());
    close(y.data(), &[s(2.0), s(-1.0), s(0.0)], 1e-7);
}

/// `g = −exp(A_log) · softplus(a + dt_bias)` with A_log = ln 2, and
/// `a + dt_bias` at 0, at torch's threshold 20 (still ln(1 + e²⁰)), past it
/// (x itself: 25 gives −50 exactly) and far below; `beta = σ(b)`; the
/// same decays per key channel beside a rate per head.
#[test]
fn delta_gates_known_values() {
    let ln2 = std::f64::consts::LN_2;
    let ex = F64Executor::new();
    let t64 = |shape: &[usize], d: &[f64]| {
        megatrain_tensor::CpuTensor::<f64>::from_vec(shape.to_vec(), d.to_vec()).unwrap()
    };
    let a = t64(&[2, 2], &[-1.0, 19.0, 24.0, -31.0]);
    let b = t64(&[2, 2], &[0.0, 2.0, -3.0, 40.0]);
    let (a_log, dt_bias) = (t64(&[2], &[ln2, 0.0]), t64(&[2], &[1.0, 1.0]));
    let (g, beta) = ex.delta_gates(&a, &b, &a_log, &dt_bias).unwrap();
    let want_g = [
        -2.0 * 2f64.ln(),
        -(20f64.exp().ln_1p()),
        -50.0,
        -((-30f64).exp().ln_1p()),
    ];
    for (i, (&got, want)) in g.data().iter().zip(want_g).enumerate() {
        assert!((got - want).abs() <= 1e-15 * want.abs(), "g {i}: {got} vs {want}");
    }
    assert_eq!(g.data()[2], -50.0, "past the threshold softplus is x itself");
    let s = |v: f64| 1.0 / (1.0 + (-v).exp());
    assert_eq!(beta.data(), [0.5, s(2.0), s(-3.0), s(40.0)]);
    // Per key channel: a's row of two heads' two channels, the parameters
    // one a channel, gives the same decays, and a rate per head.
    let per_channel = ex.delta_gates(
        &t64(&[1, 2, 2], a.data()),
        &t64(&[1, 2], &[0.0, 2.0]),
        &t64(&[4], &[ln2, 0.0, ln2, 0.0]),
        &t64(&[4], &[1.0; 4]),
    );
    let (gc, betac) = per_channel.unwrap();
    assert_eq!((gc.dims(), gc.data()), (&[1, 2, 2][..], g.data()));
    assert_eq!((betac.dims(), betac.data()), (&[1, 2][..], &[0.5, s(2.0)][..]));
    // The f32 executor agrees.
    let f = |x: &megatrain_tensor::CpuTensor<f64>| {
        up(x.dims(), &x.data().iter().map(|&v| v as f32).collect::<Vec<_>>())
    };
    let (g32, b32) = EX.delta_gates(&f(&a), &f(&b), &f(&a_log), &f(&dt_bias)).unwrap();
    let (wg, wb): (Vec<f32>, Vec<f32>) = (
        want_g.iter().map(|&v| v as f32).collect(),
        beta.data().iter().map(|&v| v as f32).collect(),
    );
    close(g32.data(), &wg, 1e-5);
    close(b32.data(), &wb, 1e-7);
}

#[test]
fn sigmoid_mul_known_values() {
    let y = EX
        .sigmoid_mul(
            &up(&[2, 2], &[0.0, 2.0, -2.0, 30.0]),
            &up(&[2, 2], &[3.0, 1.0, 1.0, -4.0]),
        )
        .unwrap();
    let s = |v: f32| 1.0 / (1.0 + (-v).exp());
    close(y.data(), &[1.5, s(2.0), s(-2.0), -4.0], 1e-7);
}
