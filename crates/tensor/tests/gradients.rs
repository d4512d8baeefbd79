//! Every backward of the reference executor against central finite
//! differences, computed in f64 through the same code path (`F64Executor`).
//! The scalar objective is Σ output · cotangent with a random cotangent.

use megatrain_tensor::testing::{dot, grad_check, random_f64, rel_norm_err};
use megatrain_tensor::{
    AttentionOut, AttnMask, ClampedGlu, CpuTensor, Dropout, Executor, F64Executor, LossTerms, MatmulNeeds,
    Rope, RopeScaling, Shape, SoftCap, TensorHandle, Transpose,
};

type T = CpuTensor<f64>;
const EX: F64Executor = F64Executor::new();

fn rand_t(seed: u64, shape: &[usize]) -> T {
    T::from_vec(shape.to_vec(), random_f64(seed, Shape::from(shape).numel())).unwrap()
}

fn t(shape: &[usize], data: &[f64]) -> T {
    T::from_vec(shape.to_vec(), data.to_vec()).unwrap()
}

#[test]
fn matmul_all_transposes_bias_and_batching() {
    let (m, k, n) = (3, 4, 5);
    let mut seed = 100;
    for t in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT] {
        for lead in [vec![], vec![2usize]] {
            for b_batched in [false, true] {
                if lead.is_empty() && b_batched {
                    continue;
                }
                for with_bias in [false, true] {
                    seed += 10;
                    let mut ad = lead.clone();
                    ad.extend(if t.a { [k, m] } else { [m, k] });
                    let mut bd = if b_batched { lead.clone() } else { vec![] };
                    bd.extend(if t.b { [n, k] } else { [k, n] });
                    let (a, b, bias) = (rand_t(seed, &ad), rand_t(seed + 1, &bd), rand_t(seed + 2, &[n]));
                    let y = EX.matmul(&a, &b, with_bias.then_some(&bias), t).unwrap();
                    let cot = rand_t(seed + 3, y.dims());
                    let g = EX.matmul_backward(&a, &b, &cot, t, MatmulNeeds::ALL).unwrap();
                    let (da, db, dbias) = (g.da.unwrap(), g.db.unwrap(), g.dbias.unwrap());
                    assert_eq!((da.shape(), db.shape()), (a.shape(), b.shape()));
                    let name = format!("matmul {t:?} lead {lead:?} b_batched {b_batched} bias {with_bias}");
                    let f = |x: &[T]| {
                        let bias = if with_bias { Some(&x[2]) } else { None };
                        dot(EX.matmul(&x[0], &x[1], bias, t).unwrap().data(), cot.data())
                    };
                    if with_bias {
                        grad_check(&name, &[a, b, bias], &[da.data(), db.data(), dbias.data()], f);
                    } else {
                        grad_check(&name, &[a, b], &[da.data(), db.data()], f);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_backward_produces_only_what_is_needed() {
    let (a, b) = (rand_t(1, &[2, 3]), rand_t(2, &[3, 4]));
    let dout = rand_t(3, &[2, 4]);
    let needs = MatmulNeeds {
        da: false,
        db: true,
        dbias: false,
    };
    let g = EX.matmul_backward(&a, &b, &dout, Transpose::NN, needs).unwrap();
    assert!(g.da.is_none() && g.db.is_some() && g.dbias.is_none());
}

#[test]
fn rmsnorm_backward() {
    let (x, w) = (rand_t(1, &[2, 3, 7]), rand_t(2, &[7]));
    let fw = EX.rmsnorm(&x, &w, 1e-5).unwrap();
    let cot = rand_t(3, &[2, 3, 7]);
    let g = EX.rmsnorm_backward(&x, &w, &fw.rstd, &cot).unwrap();
    assert!(g.db.is_none());
    grad_check("rmsnorm", &[x, w], &[g.dx.data(), g.dw.data()], |i| {
        dot(EX.rmsnorm(&i[0], &i[1], 1e-5).unwrap().y.data(), cot.data())
    });
}

#[test]
fn layernorm_backward() {
    let (x, w, b) = (rand_t(4, &[5, 6]), rand_t(5, &[6]), rand_t(6, &[6]));
    let fw = EX.layernorm(&x, &w, &b, 1e-5).unwrap();
    let cot = rand_t(7, &[5, 6]);
    let g = EX
        .layernorm_backward(&x, &w, fw.mean.as_ref().unwrap(), &fw.rstd, &cot)
        .unwrap();
    grad_check(
        "layernorm",
        &[x, w, b],
        &[g.dx.data(), g.dw.data(), g.db.as_ref().unwrap().data()],
        |i| {
            dot(
                EX.layernorm(&i[0], &i[1], &i[2], 1e-5).unwrap().y.data(),
                cot.data(),
            )
        },
    );
}

/// The fused residual add + norm: `x` and `r` both reach `h = x + r`, which
/// feeds the norm and flows on; the objective reads both outputs, so the
/// stream's gradient `dh` (the cotangent of `h`) enters the backward.
#[test]
fn add_rmsnorm_backward() {
    let (x, r, w) = (rand_t(11, &[2, 3, 7]), rand_t(12, &[2, 3, 7]), rand_t(13, &[7]));
    let fw = EX.add_rmsnorm(&x, &r, &w, 1e-5).unwrap();
    let (cot_y, cot_h) = (rand_t(14, &[2, 3, 7]), rand_t(15, &[2, 3, 7]));
    let g = EX
        .add_rmsnorm_backward(&fw.h, &w, &fw.norm.rstd, &cot_y, &cot_h)
        .unwrap();
    assert!(g.db.is_none());
    let f = |i: &[T]| {
        let o = EX.add_rmsnorm(&i[0], &i[1], &i[2], 1e-5).unwrap();
        dot(o.norm.y.data(), cot_y.data()) + dot(o.h.data(), cot_h.data())
    };
    grad_check(
        "add_rmsnorm",
        &[x, r, w],
        &[g.dx.data(), g.dx.data(), g.dw.data()],
        f,
    );
}

#[test]
fn add_layernorm_backward() {
    let (x, r) = (rand_t(21, &[5, 6]), rand_t(22, &[5, 6]));
    let (w, b) = (rand_t(23, &[6]), rand_t(24, &[6]));
    let fw = EX.add_layernorm(&x, &r, &w, &b, 1e-5).unwrap();
    let (cot_y, cot_h) = (rand_t(25, &[5, 6]), rand_t(26, &[5, 6]));
    let g = EX
        .add_layernorm_backward(
            &fw.h,
            &w,
            fw.norm.mean.as_ref().unwrap(),
            &fw.norm.rstd,
            &cot_y,
            &cot_h,
        )
        .unwrap();
    let f = |i: &[T]| {
        let o = EX.add_layernorm(&i[0], &i[1], &i[2], &i[3], 1e-5).unwrap();
        dot(o.norm.y.data(), cot_y.data()) + dot(o.h.data(), cot_h.data())
    };
    grad_check(
        "add_layernorm",
        &[x, r, w, b],
        &[
            g.dx.data(),
            g.dx.data(),
            g.dw.data(),
            g.db.as_ref().unwrap().data(),
        ],
        f,
    );
}

#[test]
fn rope_backward_with_offset() {
    // YaRN's attention factor makes the map a rotation times a gain: its
    // backward is the rotation back times the same gain.
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_positions: 16.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.25,
    };
    for (scaling, rotary_dim, interleaved) in [
        (RopeScaling::None, None, false),
        (yarn.clone(), None, false),
        (yarn.clone(), Some(4), false),
        (yarn, Some(4), true),
    ] {
        let rope = Rope {
            scaling,
            rotary_dim,
            interleaved,
            ..Rope::plain(10000.0, 7)
        };
        let x = rand_t(8, &[2, 3, 2, 6]);
        let cot = rand_t(9, &[2, 3, 2, 6]);
        let dx = EX.rope_backward(&cot, rope.clone()).unwrap();
        grad_check("rope", &[x], &[dx.data()], |i| {
            dot(EX.rope(&i[0], rope.clone()).unwrap().data(), cot.data())
        });
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_check(b: usize, tt: usize, hq: usize, hkv: usize, d: usize, mask: AttnMask, seed: u64) {
    let q = rand_t(seed, &[b, tt, hq, d]);
    let k = rand_t(seed + 1, &[b, tt, hkv, d]);
    let v = rand_t(seed + 2, &[b, tt, hkv, d]);
    let fw = EX.attention(&q, &k, &v, mask.clone()).unwrap();
    let cot = rand_t(seed + 3, &[b, tt, hq, d]);
    let g = EX.attention_backward(&q, &k, &v, &fw, &cot).unwrap();
    let name = format!("attention b{b} t{tt} hq{hq} hkv{hkv} d{d} {mask:?}");
    grad_check(&name, &[q, k, v], &[g.dq.data(), g.dk.data(), g.dv.data()], |i| {
        dot(
            EX.attention(&i[0], &i[1], &i[2], mask.clone())
                .unwrap()
                .out
                .data(),
            cot.data(),
        )
    });
}

#[test]
fn attention_backward_mha_and_gqa() {
    attention_check(2, 5, 2, 2, 3, AttnMask::CAUSAL, 10);
    attention_check(1, 4, 4, 2, 4, AttnMask::CAUSAL, 20);
    attention_check(2, 3, 4, 1, 2, AttnMask::CAUSAL, 30);
}

#[test]
fn attention_backward_in_a_sliding_window() {
    attention_check(2, 7, 2, 2, 3, AttnMask::sliding(3), 40);
    attention_check(1, 6, 4, 2, 4, AttnMask::sliding(1), 50);
    attention_check(1, 5, 6, 2, 3, AttnMask::sliding(2), 60);
}

/// Caps small enough that tanh bends most scores (inputs are in [-1, 1]).
#[test]
fn attention_backward_with_soft_capped_scores() {
    let cap = |c| SoftCap::new(c, "test").unwrap();
    attention_check(2, 5, 2, 2, 3, AttnMask::CAUSAL.with_softcap(cap(0.3)), 70);
    attention_check(1, 6, 4, 2, 4, AttnMask::sliding(3).with_softcap(cap(0.5)), 80);
    attention_check(1, 4, 4, 1, 2, AttnMask::CAUSAL.with_softcap(cap(50.0)), 90);
}

/// Dropout of the probabilities: its backward (dP and dV's weights taken
/// by the mask, delta as it was) is the gradient of the same mask's forward,
/// with GQA, in a window, soft-capped and with sinks.
#[test]
fn attention_backward_with_dropout() {
    let drop = |p: f64, key: u64| Dropout::new(p, key, "test").unwrap();
    let cap = SoftCap::new(0.5, "test").unwrap();
    attention_check(2, 5, 2, 2, 3, AttnMask::CAUSAL.with_dropout(drop(0.3, 1)), 100);
    attention_check(
        1,
        6,
        4,
        2,
        4,
        AttnMask::sliding(3).with_dropout(drop(0.5, 2)),
        110,
    );
    let capped = AttnMask::CAUSAL
        .with_softcap(cap)
        .with_dropout(drop(0.2, 3).map(|d| d.at_batch_row(7)));
    attention_check(2, 4, 4, 1, 2, capped, 120);
}

/// Dropout is linear and its own adjoint: the same mask on the output's
/// gradient is the input's, at every rank it takes.
#[test]
fn dropout_backward() {
    for (seed, shape) in [
        (950, vec![1usize, 1]),
        (960, vec![4, 3]),
        (970, vec![2, 3, 5]),
        (980, vec![2, 2, 3, 4]),
    ] {
        let d = Dropout::new(0.4, seed, "test").unwrap().unwrap().at_batch_row(2);
        let (x, cot) = (rand_t(seed, &shape), rand_t(seed + 1, &shape));
        let dx = EX.dropout(&cot, &d).unwrap();
        grad_check("dropout", &[x], &[dx.data()], |i| {
            dot(EX.dropout(&i[0], &d).unwrap().data(), cot.data())
        });
    }
    let msg = EX
        .dropout(
            &rand_t(990, &[4]),
            &Dropout::new(0.5, 1, "test").unwrap().unwrap(),
        )
        .unwrap_err();
    assert!(msg.to_string().contains("dropout"), "{msg}");
}

#[test]
fn gelu_erf_backward() {
    let x = t(
        &[2, 8],
        &random_f64(9, 16).iter().map(|v| 4.0 * v).collect::<Vec<_>>(),
    );
    let cot = rand_t(10, &[2, 8]);
    let dx = EX.gelu_erf_backward(&x, &cot).unwrap();
    grad_check("gelu_erf", &[x], &[dx.data()], |i| {
        dot(EX.gelu_erf(&i[0]).unwrap().data(), cot.data())
    });
}

#[test]
fn softcap_backward() {
    // Inputs over [-4, 4] against a cap of 1.5: the flat tails and the middle.
    let x = t(
        &[2, 8],
        &random_f64(7, 16).iter().map(|v| 4.0 * v).collect::<Vec<_>>(),
    );
    let cap = SoftCap::new(1.5, "test").unwrap();
    let cot = rand_t(8, &[2, 8]);
    let y = EX.softcap(x.clone(), cap).unwrap();
    let dx = EX.softcap_backward(&y, cot.clone(), cap).unwrap();
    grad_check("softcap", &[x], &[dx.data()], |i| {
        dot(EX.softcap(i[0].clone(), cap).unwrap().data(), cot.data())
    });
}

#[test]
fn swiglu_backward() {
    let (g, u) = (rand_t(1, &[3, 5]), rand_t(2, &[3, 5]));
    let cot = rand_t(3, &[3, 5]);
    let (dg, du) = EX.swiglu_backward(&g, &u, &cot).unwrap();
    grad_check("swiglu", &[g, u], &[dg.data(), du.data()], |i| {
        dot(EX.swiglu(&i[0], &i[1]).unwrap().data(), cot.data())
    });
}

/// `n` values uniform in ±`scale` from `seed`.
fn scaled(seed: u64, n: usize, scale: f64) -> Vec<f64> {
    random_f64(seed, n).into_iter().map(|v| scale * v).collect()
}

/// [`scaled`], each value moved off the clamps' kinks at `±limit` (by more
/// than the differences' step reaches), so that the finite differences
/// see one side of each.
fn off_kinks(seed: u64, n: usize, scale: f64, limit: f64) -> Vec<f64> {
    scaled(seed, n, scale)
        .into_iter()
        .map(|x| {
            if (x.abs() - limit).abs() < 1e-2 {
                x + 5e-2
            } else {
                x
            }
        })
        .collect()
}

/// `gate` and `up` interleaved as GPT-OSS's one gate/up product holds them.
fn interleave(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter().zip(up).flat_map(|(&g, &u)| [g, u]).collect()
}

/// GPT-OSS's constants (alpha 1.702, limit 7) with inputs over ±10, and a
/// limit of 0.5 with inputs over ±1: in both, elements on each side of
/// every clamp.
#[test]
fn swiglu_clamped_backward() {
    for (seed, alpha, limit, scale) in [(11, 1.702, 7.0, 10.0), (21, 0.9, 0.5, 1.0)] {
        let c = ClampedGlu::new(alpha, limit, "test").unwrap();
        let g = off_kinks(seed, 21, scale, limit);
        let u = off_kinks(seed + 1, 21, scale, limit);
        let (above, outside) = (
            g.iter().filter(|&&x| x > limit).count(),
            u.iter().filter(|&&x| x.abs() > limit).count(),
        );
        assert!(above > 0 && outside > 0, "the clamps are not exercised");
        let gu = t(&[3, 14], &interleave(&g, &u));
        let cot = rand_t(seed + 2, &[3, 7]);
        let d = EX.swiglu_clamped_backward(&gu, &cot, c).unwrap();
        assert_eq!(d.dims(), [3, 14]);
        grad_check(&format!("swiglu_clamped {c:?}"), &[gu], &[d.data()], |i| {
            dot(EX.swiglu_clamped(&i[0], c).unwrap().data(), cot.data())
        });
    }
}

/// At the clamps' bounds themselves the gradient passes (torch's `clamp`
/// backward, `min ≤ x ≤ max`), just past them it stops.
#[test]
fn swiglu_clamped_bounds_pass_the_gradient() {
    let c = ClampedGlu::new(1.702, 7.0, "test").unwrap();
    let past = 7.0f64.next_up();
    let gu = t(
        &[4, 2],
        &interleave(&[7.0, past, 0.5, 0.5], &[0.5, 0.5, 7.0, -7.0]),
    );
    let dy = t(&[4, 1], &[1.0; 4]);
    let d = EX.swiglu_clamped_backward(&gu, &dy, c).unwrap();
    let (dg, du): (Vec<f64>, Vec<f64>) = d.data().chunks(2).map(|p| (p[0], p[1])).unzip();
    let s = |x: f64| 1.0 / (1.0 + (-1.702 * x).exp());
    let dglu = |x: f64| s(x) + 1.702 * x * s(x) * (1.0 - s(x));
    assert_eq!(dg[..2], [1.5 * dglu(7.0), 0.0]);
    assert!((dg[2] - 8.0 * dglu(0.5)).abs() < 1e-15);
    assert!((dg[3] + 6.0 * dglu(0.5)).abs() < 1e-15);
    for (i, x) in [(0, 7.0), (1, 7.0), (2, 0.5), (3, 0.5)] {
        assert!((du[i] - x * s(x)).abs() < 1e-15, "dup {i}");
    }
    let beyond = t(
        &[1, 4],
        &interleave(&[0.5; 2], &[7.0f64.next_up(), -7.0f64.next_up()]),
    );
    let d = EX
        .swiglu_clamped_backward(&beyond, &t(&[1, 2], &[1.0; 2]), c)
        .unwrap();
    assert_eq!((d.data()[1], d.data()[3]), (0.0, 0.0));
}

/// The sink op alone: its first gradient is `∂/∂out` with `lse` held
/// fixed, its second `∂/∂sinks`, of Σ c · O_s. Sinks over ±3 put σ
/// anywhere in (0, 1).
#[test]
fn attention_sinks_backward_alone() {
    for (seed, [b, tt, hq, d]) in [(31, [2, 5, 3, 4]), (41, [1, 1, 2, 3])] {
        let o = rand_t(seed, &[b, tt, hq, d]);
        let lse = t(&[b, hq, tt], &scaled(seed + 1, b * hq * tt, 2.0));
        let sinks = t(&[hq], &scaled(seed + 2, hq, 3.0));
        let cot = rand_t(seed + 3, &[b, tt, hq, d]);
        let fwd = |o: &T, sinks: &T| {
            let f = AttentionOut {
                out: o.clone(),
                lse: lse.clone(),
                mask: AttnMask::CAUSAL,
            };
            EX.attention_sinks(&f, sinks).unwrap()
        };
        let os = fwd(&o, &sinks);
        let (dout, dsinks) = EX.attention_sinks_backward(&os, &lse, &sinks, &cot).unwrap();
        assert_eq!((dout.dims(), dsinks.dims()), (o.dims(), &[hq][..]));
        grad_check(
            "attention_sinks",
            &[o, sinks],
            &[dout.data(), dsinks.data()],
            |i| dot(fwd(&i[0], &i[1]).data(), cot.data()),
        );
    }
}

/// The sink attention end to end, as GPT-OSS's layer forms it: `attention`
/// then `attention_sinks`; backward `attention_sinks_backward`, then
/// `attention_backward` of `AttentionOut { out: O_s, lse, mask }` with its
/// `σ · dO_s`. dq, dk, dv and dsinks against finite differences of q, k, v
/// and the sinks; MHA, GQA, a sliding window and a soft cap.
#[test]
fn attention_with_sinks_end_to_end() {
    let cap = SoftCap::new(0.5, "test").unwrap();
    for (seed, (b, tt, hq, hkv, d), mask) in [
        (50, (2, 5, 2, 2, 3), AttnMask::CAUSAL),
        (60, (1, 6, 4, 2, 4), AttnMask::sliding(3)),
        (70, (1, 4, 4, 1, 2), AttnMask::CAUSAL.with_softcap(cap)),
        (80, (2, 1, 2, 1, 3), AttnMask::CAUSAL),
        (
            90,
            (2, 5, 4, 2, 3),
            AttnMask::CAUSAL.with_dropout(Dropout::new(0.3, 9, "test").unwrap()),
        ),
    ] {
        let q = rand_t(seed, &[b, tt, hq, d]);
        let k = rand_t(seed + 1, &[b, tt, hkv, d]);
        let v = rand_t(seed + 2, &[b, tt, hkv, d]);
        let sinks = t(&[hq], &scaled(seed + 3, hq, 2.0));
        let cot = rand_t(seed + 4, &[b, tt, hq, d]);
        let forward = |i: &[T]| {
            let fw = EX.attention(&i[0], &i[1], &i[2], mask.clone()).unwrap();
            let os = EX.attention_sinks(&fw, &i[3]).unwrap();
            AttentionOut { out: os, ..fw }
        };
        let fw = forward(&[q.clone(), k.clone(), v.clone(), sinks.clone()]);
        let (dout, dsinks) = EX
            .attention_sinks_backward(&fw.out, &fw.lse, &sinks, &cot)
            .unwrap();
        let g = EX.attention_backward(&q, &k, &v, &fw, &dout).unwrap();
        let name = format!("sink attention b{b} t{tt} hq{hq} hkv{hkv} d{d} {mask:?}");
        grad_check(
            &name,
            &[q, k, v, sinks],
            &[g.dq.data(), g.dk.data(), g.dv.data(), dsinks.data()],
            |i| dot(forward(i).out.data(), cot.data()),
        );
    }
}

#[test]
fn geglu_backward() {
    let (g, u) = (rand_t(4, &[3, 5]), rand_t(5, &[3, 5]));
    let cot = rand_t(6, &[3, 5]);
    let (dg, du) = EX.geglu_backward(&g, &u, &cot).unwrap();
    grad_check("geglu", &[g, u], &[dg.data(), du.data()], |i| {
        dot(EX.geglu(&i[0], &i[1]).unwrap().data(), cot.data())
    });
}

#[test]
fn gelu_backward() {
    // Spread inputs over [-4, 4] to cover both tails.
    let x = t(
        &[2, 8],
        &random_f64(4, 16).iter().map(|v| 4.0 * v).collect::<Vec<_>>(),
    );
    let cot = rand_t(5, &[2, 8]);
    let dx = EX.gelu_backward(&x, &cot).unwrap();
    grad_check("gelu", &[x], &[dx.data()], |i| {
        dot(EX.gelu(&i[0]).unwrap().data(), cot.data())
    });
}

#[test]
fn embedding_backward_is_the_gradient_of_the_gather() {
    let ids = [3u32, 0, 3, 4, 1, 3];
    let table = rand_t(6, &[5, 4]);
    let cot = rand_t(7, &[ids.len(), 4]);
    // Accumulates: starting from a nonzero dtable adds the gradient to it.
    let start = rand_t(8, &[5, 4]);
    let mut dtable = start.clone();
    EX.embedding_backward(&ids, &cot, &mut dtable).unwrap();
    let grad: Vec<f64> = dtable
        .data()
        .iter()
        .zip(start.data())
        .map(|(a, b)| a - b)
        .collect();
    grad_check("embedding", &[table], &[&grad], |i| {
        dot(EX.embedding(&ids, &i[0]).unwrap().data(), cot.data())
    });
}

#[test]
fn cross_entropy_gradient_with_ignored_rows() {
    let logits = t(
        &[4, 6],
        &random_f64(9, 24).iter().map(|v| 3.0 * v).collect::<Vec<_>>(),
    );
    let targets = [2, -100, 5, 0];
    let scale = 1.0 / 3.0;
    let out = EX
        .cross_entropy(&logits, &targets, -100, scale as f32, LossTerms::NONE)
        .unwrap();
    let scale = scale as f32 as f64;
    // Objective: the scaled mean loss; its gradient is exactly dlogits.
    grad_check("cross_entropy", &[logits], &[out.dlogits.data()], |i| {
        scale
            * EX.cross_entropy(&i[0], &targets, -100, 1.0, LossTerms::NONE)
                .unwrap()
                .losses
                .data()
                .iter()
                .sum::<f64>()
    });
    assert_eq!(out.losses.data()[1], 0.0);
    assert!(out.dlogits.data()[6..12].iter().all(|&g| g == 0.0));
}

/// With a z-loss, dlogits is the gradient of the scaled sum of the
/// cross-entropy and z·lse², and `z_losses` holds z·lse² per row (0 where
/// ignored); the cross-entropy itself is unchanged.
#[test]
fn cross_entropy_z_loss_gradient() {
    let logits = t(
        &[4, 6],
        &random_f64(19, 24)
            .iter()
            .map(|v| 3.0 * v + 2.0)
            .collect::<Vec<_>>(),
    );
    let targets = [2, -100, 5, 0];
    let (scale, z) = (1.0 / 3.0, 0.05f32);
    let out = EX
        .cross_entropy(&logits, &targets, -100, scale as f32, LossTerms::z(z))
        .unwrap();
    let plain = EX
        .cross_entropy(&logits, &targets, -100, scale as f32, LossTerms::NONE)
        .unwrap();
    assert_eq!(out.losses.data(), plain.losses.data());
    assert!(plain.z_losses.is_none());
    let zl = out.z_losses.as_ref().unwrap().data();
    let row = |r: usize| &logits.data()[6 * r..6 * r + 6];
    let lse = |x: &[f64]| x.iter().map(|v| v.exp()).sum::<f64>().ln();
    for r in [0, 2, 3] {
        let want = z as f64 * lse(row(r)).powi(2);
        assert!(
            (zl[r] - want).abs() <= 1e-12 * want,
            "row {r}: {} vs {want}",
            zl[r]
        );
    }
    assert_eq!(zl[1], 0.0);
    let scale = scale as f32 as f64;
    grad_check(
        "cross_entropy z-loss",
        std::slice::from_ref(&logits),
        &[out.dlogits.data()],
        |i| {
            let o = EX
                .cross_entropy(&i[0], &targets, -100, 1.0, LossTerms::z(z))
                .unwrap();
            let zsum: f64 = o.z_losses.unwrap().data().iter().sum();
            scale * (o.losses.data().iter().sum::<f64>() + zsum)
        },
    );
    for bad in [f32::NAN, -0.5] {
        let err = EX
            .cross_entropy(&logits, &targets, -100, 1.0, LossTerms::z(bad))
            .unwrap_err();
        assert!(err.to_string().contains(&format!("z_loss {bad}")), "{err}");
    }
}

/// With label smoothing ε (and a z-loss beside it), dlogits is the gradient
/// of the scaled sum of (1 − ε)·cross-entropy + ε·uniform + z·lse², and
/// `uniform_losses` holds lse − mean(logits) per row (0 where ignored); the
/// cross-entropy and the z terms are those of the run without smoothing.
#[test]
fn cross_entropy_label_smoothing_gradient() {
    let logits = t(
        &[4, 7],
        &random_f64(29, 28)
            .iter()
            .map(|v| 4.0 * v - 1.0)
            .collect::<Vec<_>>(),
    );
    let targets = [6, -100, 0, 3];
    let scale = 1.0 / 3.0;
    for terms in [
        LossTerms::smoothing(0.1),
        LossTerms {
            z_loss: 0.02,
            label_smoothing: 0.35,
        },
        LossTerms::smoothing(1.0),
    ] {
        let eps = terms.label_smoothing as f64;
        let out = EX
            .cross_entropy(&logits, &targets, -100, scale as f32, terms)
            .unwrap();
        let plain = EX
            .cross_entropy(&logits, &targets, -100, scale as f32, LossTerms::z(terms.z_loss))
            .unwrap();
        assert_eq!(out.losses.data(), plain.losses.data());
        assert_eq!(
            out.z_losses.as_ref().map(|z| z.data().to_vec()),
            plain.z_losses.as_ref().map(|z| z.data().to_vec())
        );
        assert!(plain.uniform_losses.is_none());
        let un = out.uniform_losses.as_ref().unwrap().data();
        for r in [0, 2, 3] {
            let x = &logits.data()[7 * r..7 * r + 7];
            let lse = x.iter().map(|v| v.exp()).sum::<f64>().ln();
            let want = x.iter().map(|v| lse - v).sum::<f64>() / 7.0;
            assert!(
                (un[r] - want).abs() <= 1e-12 * want.abs(),
                "row {r}: {} vs {want}",
                un[r]
            );
        }
        assert_eq!(un[1], 0.0);
        assert!(out.dlogits.data()[7..14].iter().all(|&g| g == 0.0));
        let scale = scale as f32 as f64;
        grad_check(
            "cross_entropy label smoothing",
            std::slice::from_ref(&logits),
            &[out.dlogits.data()],
            |i| {
                let o = EX.cross_entropy(&i[0], &targets, -100, 1.0, terms).unwrap();
                let sum = |t: Option<&T>| t.map_or(0.0, |t| t.data().iter().sum::<f64>());
                scale
                    * ((1.0 - eps) * sum(Some(&o.losses))
                        + eps * sum(o.uniform_losses.as_ref())
                        + sum(o.z_losses.as_ref()))
            },
        );
    }
    for bad in [-0.1, 1.5, f32::NAN] {
        let err = EX
            .cross_entropy(&logits, &targets, -100, 1.0, LossTerms::smoothing(bad))
            .unwrap_err();
        assert!(
            err.to_string().contains(&format!("label_smoothing {bad}")),
            "{err}"
        );
    }
}

/// `scale_rows(x, w)`'s gradients are `scale_rows(dy, w)` towards x and
/// `row_dots(dy, x)` towards w (how a mixture of experts' backward forms
/// them); `row_dots(a, b)`'s are `scale_rows(b, dy)` and `scale_rows(a, dy)`.
#[test]
fn scale_rows_and_row_dots() {
    for (seed, shape) in [(900, vec![1usize, 1]), (910, vec![4, 3]), (920, vec![2, 3, 5])] {
        let rows = shape[..shape.len() - 1].iter().product::<usize>();
        let x = rand_t(seed, &shape);
        let w = rand_t(seed + 1, &[rows]);
        let cot = rand_t(seed + 2, &shape);
        let dx = EX.scale_rows(&cot, w.data()).unwrap();
        let dw = EX.row_dots(&cot, &x).unwrap();
        grad_check(
            "scale_rows",
            &[x.clone(), w.clone()],
            &[dx.data(), dw.data()],
            |ins| dot(EX.scale_rows(&ins[0], ins[1].data()).unwrap().data(), cot.data()),
        );
        let b = rand_t(seed + 3, &shape);
        let cot = rand_t(seed + 4, &[rows]);
        let da = EX.scale_rows(&b, cot.data()).unwrap();
        let db = EX.scale_rows(&x, cot.data()).unwrap();
        grad_check(
            "row_dots",
            &[x.clone(), b.clone()],
            &[da.data(), db.data()],
            |ins| dot(EX.row_dots(&ins[0], &ins[1]).unwrap().data(), cot.data()),
        );
    }
    // A weight per row, and operands of one shape, or an error naming them.
    let x = rand_t(930, &[3, 4]);
    let msg = EX.scale_rows(&x, &[1.0, 2.0]).unwrap_err().to_string();
    assert!(msg.contains("scale_rows") && msg.contains("3 rows"), "{msg}");
    let msg = EX.row_dots(&x, &rand_t(931, &[4, 3])).unwrap_err().to_string();
    assert!(msg.contains("row_dots"), "{msg}");
    assert_eq!(
        EX.row_dots(&rand_t(932, &[0, 4]), &rand_t(933, &[0, 4]))
            .unwrap()
            .dims(),
        [0]
    );
}

/// The gated delta rule's operands as Qwen3-Next's layer feeds them:
/// l2-normalised keys, queries normalised and scaled by 1/√Dk, β in (0, 1)
/// (a sigmoid), g < 0 (a negated softplus).
fn delta_rule_inputs(seed: u64, [b, tt, hk, hv, dk, dv]: [usize; 6]) -> [T; 5] {
    let unit_rows = |seed, scale: f64| {
        let mut x = random_f64(seed, b * tt * hk * dk);
        for row in x.chunks_mut(dk) {
            let n = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            row.iter_mut().for_each(|v| *v *= scale / n);
        }
        t(&[b, tt, hk, dk], &x)
    };
    let heads = b * tt * hv;
    let g: Vec<f64> = random_f64(seed + 3, heads)
        .iter()
        .map(|u| -(1.0 + (2.0 * u).exp()).ln())
        .collect();
    let beta: Vec<f64> = random_f64(seed + 4, heads)
        .iter()
        .map(|u| 1.0 / (1.0 + (-3.0 * u).exp()))
        .collect();
    [
        unit_rows(seed, 1.0 / (dk as f64).sqrt()),
        unit_rows(seed + 1, 1.0),
        rand_t(seed + 2, &[b, tt, hv, dv]),
        t(&[b, tt, hv], &g),
        t(&[b, tt, hv], &beta),
    ]
}

/// [`delta_rule_inputs`] with g per key channel, `[B, T, Hv, Dk]` (Kimi
/// Linear's KDA, whose gate is a negated softplus per channel too).
fn kda_inputs(seed: u64, dims @ [b, tt, _, hv, dk, _]: [usize; 6]) -> [T; 5] {
    let [q, k, v, _, beta] = delta_rule_inputs(seed, dims);
    let g: Vec<f64> = random_f64(seed + 6, b * tt * hv * dk)
        .iter()
        .map(|u| -(1.0 + (2.0 * u).exp()).ln())
        .collect();
    [q, k, v, t(&[b, tt, hv, dk], &g), beta]
}

/// All five gradients of the gated delta rule against finite differences:
/// GQA (two value heads a key head) across a chunk boundary at a length
/// no multiple of the chunk, a single step, one head, Dk ≠ Dv.
#[test]
fn gated_delta_rule_backward() {
    for (seed, dims) in [
        (90, [1, 70, 1, 2, 3, 2]),
        (100, [2, 1, 2, 4, 4, 3]),
        (110, [2, 5, 1, 1, 2, 3]),
    ] {
        delta_rule_grad_check(seed, dims, delta_rule_inputs(seed, dims));
    }
}

/// The same with a decay per key channel (g `[B, T, Hv, Dk]`, Kimi
/// Linear's KDA), dg of g's shape: GQA across a chunk boundary (Kimi has
/// Hk = Hv, the op does not ask it), a single step, Dk ≠ Dv both ways.
#[test]
fn gated_delta_rule_backward_per_channel_decay() {
    for (seed, dims) in [
        (120, [1, 70, 1, 2, 3, 2]),
        (130, [2, 1, 2, 4, 4, 3]),
        (140, [2, 5, 1, 1, 2, 3]),
        (150, [1, 6, 2, 2, 3, 1]),
    ] {
        delta_rule_grad_check(seed, dims, kda_inputs(seed, dims));
    }
}

/// Per-channel decays that all equal their head's decay are that decay:
/// the same output and checkpoints bit for bit, and dg summed over the
/// channels is the per-head dg.
#[test]
fn gated_delta_rule_equal_channel_decays_are_the_head_decay() {
    let dims @ [b, tt, _, hv, dk, _] = [2, 70, 1, 2, 3, 2];
    let x = delta_rule_inputs(160, dims);
    let spread: Vec<f64> = x[3].data().iter().flat_map(|&g| [g; 3]).collect();
    assert_eq!(dk, 3);
    let g = t(&[b, tt, hv, dk], &spread);
    let cot = rand_t(165, &[b, tt, hv, 2]);
    let one = EX
        .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
        .unwrap();
    let per = EX.gated_delta_rule(&x[0], &x[1], &x[2], &g, &x[4], None).unwrap();
    assert_eq!(one.out.data(), per.out.data());
    assert_eq!(one.saved.data(), per.saved.data());
    let go = EX
        .gated_delta_rule_backward(&x[0], &x[1], &x[2], &x[3], &x[4], &one, &cot)
        .unwrap();
    let gp = EX
        .gated_delta_rule_backward(&x[0], &x[1], &x[2], &g, &x[4], &per, &cot)
        .unwrap();
    assert_eq!(gp.dg.dims(), [b, tt, hv, dk]);
    for (a, b) in [
        (&go.dq, &gp.dq),
        (&go.dk, &gp.dk),
        (&go.dv, &gp.dv),
        (&go.dbeta, &gp.dbeta),
    ] {
        assert!(rel_norm_err(a.data(), b.data()) < 1e-12);
    }
    let summed: Vec<f64> = gp.dg.data().chunks(dk).map(|c| c.iter().sum()).collect();
    assert!(rel_norm_err(go.dg.data(), &summed) < 1e-12);
}

fn delta_rule_grad_check(seed: u64, dims: [usize; 6], x: [T; 5]) {
    let fwd = EX
        .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
        .unwrap();
    let cot = rand_t(seed + 5, fwd.out.dims());
    let gr = EX
        .gated_delta_rule_backward(&x[0], &x[1], &x[2], &x[3], &x[4], &fwd, &cot)
        .unwrap();
    let grads = [&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta];
    for (gd, xi) in grads.iter().zip(&x) {
        assert_eq!(gd.shape(), xi.shape());
    }
    grad_check(
        &format!(
            "gated_delta_rule [b, t, hk, hv, dk, dv] = {dims:?}, g {}",
            x[3].shape()
        ),
        &x,
        &grads.map(|g| g.data()),
        |i| {
            let o = EX
                .gated_delta_rule(&i[0], &i[1], &i[2], &i[3], &i[4], None)
                .unwrap();
            dot(o.out.data(), cot.data())
        },
    );
}

/// The short convolution at the Qwen3-Next width of K = 4 with T above,
/// below and at 1 (every output then reads the left padding), and K = 1
/// (a per-channel scale before SiLU); two sequences each, so that the
/// second's first positions must not read the first's last ones. Inputs
/// over ±2 put SiLU's curvature to work.
#[test]
fn causal_conv1d_silu_backward() {
    for (seed, [b, tt, c, k]) in [
        (501, [2, 6, 3, 4]),
        (511, [2, 3, 3, 4]),
        (521, [2, 1, 2, 4]),
        (531, [2, 4, 3, 1]),
    ] {
        let x = t(&[b, tt, c], &scaled(seed, b * tt * c, 2.0));
        let w = rand_t(seed + 1, &[c, k]);
        let cot = rand_t(seed + 2, &[b, tt, c]);
        let (dx, dw) = EX.causal_conv1d_silu_backward(&x, &w, &cot, None).unwrap();
        assert_eq!((dx.dims(), dw.dims()), (x.dims(), w.dims()));
        grad_check(
            &format!("causal_conv1d_silu [{b}, {tt}, {c}] K {k}"),
            &[x, w],
            &[dx.data(), dw.data()],
            |i| {
                dot(
                    EX.causal_conv1d_silu(&i[0], &i[1], None).unwrap().data(),
                    cot.data(),
                )
            },
        );
    }
}

/// The gates with `a + dt_bias` on both sides of softplus's threshold 20
/// (kept 0.01 off it, past the differences' reach) and well below 0,
/// for `[N, H]` and for `[B, T, H]` read as rows, and with the decays per
/// key channel (`a` `[.., H, Dk]`, Dk 1 too) beside a rate per head
/// (`b` `[.., H]`).
#[test]
fn delta_gates_backward() {
    let dts = [0.5, 18.0, -3.0, 21.0, -1.0, 19.5];
    for (seed, a_dims, b_dims) in [
        (541, vec![5, 4], vec![5, 4]),
        (551, vec![2, 3, 4], vec![2, 3, 4]),
        (571, vec![2, 3, 2, 3], vec![2, 3, 2]),
        (581, vec![3, 4, 1], vec![3, 4]),
    ] {
        let n: usize = b_dims[..b_dims.len() - 1].iter().product();
        let c = a_dims.iter().product::<usize>() / n;
        let dt = &dts[..c];
        let av: Vec<f64> = scaled(seed, n * c, 3.0)
            .into_iter()
            .enumerate()
            .map(|(j, a)| {
                let x = a + dt[j % c];
                if (x - 20.0).abs() < 1e-2 { a + 5e-2 } else { a }
            })
            .collect();
        let xs: Vec<f64> = av.iter().enumerate().map(|(j, a)| a + dt[j % c]).collect();
        assert!(
            xs.iter().any(|&x| x > 20.0)
                && xs.iter().any(|&x| (0.0..20.0).contains(&x))
                && xs.iter().any(|&x| x < 0.0),
            "the threshold is not straddled: {xs:?}"
        );
        let a = t(&a_dims, &av);
        let b = t(&b_dims, &scaled(seed + 1, b_dims.iter().product(), 4.0));
        let a_log = t(&[c], &scaled(seed + 2, c, 1.0));
        let dt_bias = t(&[c], dt);
        let (cg, cb) = (rand_t(seed + 3, &a_dims), rand_t(seed + 4, &b_dims));
        let (da, db, da_log, ddt) = EX
            .delta_gates_backward(&a, &b, &a_log, &dt_bias, &cg, &cb)
            .unwrap();
        assert_eq!((da.dims(), db.dims()), (&a_dims[..], &b_dims[..]));
        assert_eq!((da_log.dims(), ddt.dims()), (&[c][..], &[c][..]));
        grad_check(
            &format!("delta_gates a {a_dims:?} b {b_dims:?}"),
            &[a, b, a_log, dt_bias],
            &[da.data(), db.data(), da_log.data(), ddt.data()],
            |i| {
                let (g, beta) = EX.delta_gates(&i[0], &i[1], &i[2], &i[3]).unwrap();
                dot(g.data(), cg.data()) + dot(beta.data(), cb.data())
            },
        );
    }
}

#[test]
fn sigmoid_mul_backward() {
    let g = t(&[3, 5], &scaled(561, 15, 4.0));
    let x = rand_t(562, &[3, 5]);
    let cot = rand_t(563, &[3, 5]);
    let (dg, dx) = EX.sigmoid_mul_backward(&g, &x, &cot).unwrap();
    grad_check("sigmoid_mul", &[g, x], &[dg.data(), dx.data()], |i| {
        dot(EX.sigmoid_mul(&i[0], &i[1]).unwrap().data(), cot.data())
    });
}
