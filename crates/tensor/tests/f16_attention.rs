//! Attention under `ComputePrecision::F16` on the CPU executor: Q, K, V (and
//! dO) each scaled by a power of two, rounded to f16 and scaled back, then
//! f32 attention. Checked against an f64 attention of the same rounded
//! operands written here independently (its own rounding through
//! `half::f16::from_f64`, its own loops over the full T×T matrix).

use half::f16;
use megatrain_tensor::testing::{SeededRng, rel_norm_err};
use megatrain_tensor::{AttnMask, ComputePrecision, CpuExecutor, Executor, HostTensor, f16_scale_exponent};

const F32: CpuExecutor = CpuExecutor::new();
const F16: CpuExecutor = CpuExecutor::with_precision(ComputePrecision::F16);

/// A tensor as the f16 operand carries it, back at its own magnitude, f64.
fn quantize(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = 2f64.powi(f16_scale_exponent(max));
    x.iter()
        .map(|&v| f16::from_f64(v as f64 / s).to_f64() * s)
        .collect()
}

#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// Keys a query sees; 0: all up to it.
    window: usize,
}

impl Dims {
    fn q(&self, b: usize, t: usize, h: usize) -> usize {
        ((b * self.t + t) * self.hq + h) * self.d
    }
    fn kv(&self, b: usize, t: usize, h: usize) -> usize {
        ((b * self.t + t) * self.hkv + h / (self.hq / self.hkv)) * self.d
    }
}

struct Grads {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Causal attention (in a sliding window where `window` > 0) and its
/// gradients in f64 through the full probability matrix of each (batch, head).
fn reference(n: Dims, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> Grads {
    let sc = 1.0 / (n.d as f64).sqrt();
    let mut g = Grads {
        out: vec![0.0; q.len()],
        lse: vec![0.0; n.b * n.hq * n.t],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for b in 0..n.b {
        for h in 0..n.hq {
            for i in 0..n.t {
                let qi = &q[n.q(b, i, h)..][..n.d];
                // transformers' sliding window: kv > q - window.
                let keys: Vec<usize> = (0..=i).filter(|&j| n.window == 0 || j + n.window > i).collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| dot(qi, &k[n.kv(b, j, h)..][..n.d]) * sc)
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let lse = m + l.ln();
                g.lse[(b * n.hq + h) * n.t + i] = lse;
                let p: Vec<f64> = s.iter().map(|x| (x - lse).exp()).collect();
                for (&j, &pj) in keys.iter().zip(&p) {
                    for e in 0..n.d {
                        g.out[n.q(b, i, h) + e] += pj * v[n.kv(b, j, h) + e];
                    }
                }
                let go = &dout[n.q(b, i, h)..][..n.d];
                let dp: Vec<f64> = keys
                    .iter()
                    .map(|&j| dot(go, &v[n.kv(b, j, h)..][..n.d]))
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (x, &j) in keys.iter().enumerate() {
                    let ds = p[x] * (dp[x] - delta) * sc;
                    for e in 0..n.d {
                        g.dq[n.q(b, i, h) + e] += ds * k[n.kv(b, j, h) + e];
                        g.dk[n.kv(b, j, h) + e] += ds * q[n.q(b, i, h) + e];
                        g.dv[n.kv(b, j, h) + e] += p[x] * go[e];
                    }
                }
            }
        }
    }
    g
}

fn random(rng: &mut SeededRng, len: usize, scale: f64) -> Vec<f32> {
    (0..len).map(|_| (rng.uniform() * scale) as f32).collect()
}

/// Runs `ex`'s attention forward and backward on the given operands.
fn run(ex: &CpuExecutor, n: Dims, x: [&[f32]; 4]) -> [Vec<f32>; 5] {
    let t = |shape: Vec<usize>, v: &[f32]| {
        ex.upload(&HostTensor::from_f32(shape, v.to_vec()).unwrap())
            .unwrap()
    };
    let (qs, ks) = (vec![n.b, n.t, n.hq, n.d], vec![n.b, n.t, n.hkv, n.d]);
    let (q, k, v, dout) = (t(qs.clone(), x[0]), t(ks.clone(), x[1]), t(ks, x[2]), t(qs, x[3]));
    let mask = match n.window {
        0 => AttnMask::CAUSAL,
        w => AttnMask::sliding(w),
    };
    let f = ex.attention(&q, &k, &v, mask).unwrap();
    let g = ex.attention_backward(&q, &k, &v, &f, &dout).unwrap();
    [&f.out, &f.lse, &g.dq, &g.dk, &g.dv].map(|t| t.data().to_vec())
}

fn check(n: Dims, seed: u64, scales: [f64; 4]) {
    let mut rng = SeededRng::new(seed);
    let lens = [n.hq, n.hkv, n.hkv, n.hq].map(|h| n.b * n.t * h * n.d);
    let x: Vec<Vec<f32>> = (0..4).map(|i| random(&mut rng, lens[i], scales[i])).collect();
    let got = run(&F16, n, [&x[0], &x[1], &x[2], &x[3]]);
    let r = reference(
        n,
        &quantize(&x[0]),
        &quantize(&x[1]),
        &quantize(&x[2]),
        &quantize(&x[3]),
    );
    let want = [&r.out, &r.lse, &r.dq, &r.dk, &r.dv];
    for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"].iter().zip(got.iter().zip(want)) {
        let e = rel_norm_err(g, w);
        assert!(e < 2e-5, "{n:?} scales {scales:?}: {name} rel err {e:e}");
    }
    // The same operands unrounded (the f32 path) differ visibly.
    let f32_out = run(&F32, n, [&x[0], &x[1], &x[2], &x[3]]);
    let e = rel_norm_err(&f32_out[0], &r.out);
    assert!(e > 2e-5, "{n:?}: f16 rounding invisible ({e:e})");
}

#[test]
fn f16_attention_is_f32_attention_of_the_rounded_operands() {
    // T not a multiple of any tile, T = 1, GQA 6/2, D = 80, B > 1.
    let cases = [
        Dims {
            b: 2,
            t: 13,
            hq: 6,
            hkv: 2,
            d: 80,
            window: 0,
        },
        Dims {
            b: 1,
            t: 1,
            hq: 4,
            hkv: 1,
            d: 64,
            window: 0,
        },
        Dims {
            b: 1,
            t: 37,
            hq: 8,
            hkv: 1,
            d: 16,
            window: 0,
        },
        Dims {
            b: 3,
            t: 5,
            hq: 2,
            hkv: 2,
            d: 24,
            window: 0,
        },
    ];
    for (i, n) in cases.into_iter().enumerate() {
        check(n, 7 + i as u64, [1.0, 1.0, 1.0, 1.0]);
    }
}

#[test]
fn f16_attention_in_a_sliding_window() {
    for (i, (t, window)) in [(13, 4), (37, 1), (9, 8)].into_iter().enumerate() {
        let n = Dims {
            b: 2,
            t,
            hq: 6,
            hkv: 2,
            d: 24,
            window,
        };
        check(n, 20 + i as u64, [1.0, 1.0, 1.0, 1.0]);
    }
}

#[test]
fn each_operand_is_scaled_on_its_own() {
    // Magnitudes far outside f16's range, different per operand: only the
    // per-tensor power-of-two scale keeps them representable.
    let n = Dims {
        b: 1,
        t: 9,
        hq: 2,
        hkv: 1,
        d: 32,
        window: 0,
    };
    check(n, 3, [1e-6, 3e5, 1e-9, 1e7]);
    check(n, 4, [2e4, 1e-5, 6e6, 1e-12]);
}

#[test]
fn f32_attention_is_unchanged() {
    let n = Dims {
        b: 1,
        t: 11,
        hq: 3,
        hkv: 1,
        d: 8,
        window: 0,
    };
    let mut rng = SeededRng::new(11);
    let lens = [n.hq, n.hkv, n.hkv, n.hq].map(|h| n.b * n.t * h * n.d);
    let x: Vec<Vec<f32>> = (0..4).map(|i| random(&mut rng, lens[i], 1.0)).collect();
    let got = run(&F32, n, [&x[0], &x[1], &x[2], &x[3]]);
    let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let r = reference(n, &wide(&x[0]), &wide(&x[1]), &wide(&x[2]), &wide(&x[3]));
    for (g, w) in got.iter().zip([&r.out, &r.lse, &r.dq, &r.dk, &r.dv]) {
        assert!(rel_norm_err(g, w) < 1e-5);
    }
}
