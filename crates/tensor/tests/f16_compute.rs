//! `ComputePrecision::F16` on the CPU executor: every matmul operand scaled
//! by a power of two per tensor, rounded to f16, multiplied with f32
//! accumulation and unscaled. Checked against an f64 product of the same
//! scaled and rounded operands, written here independently (its own
//! rounding through `half::f16::from_f64`, its own index arithmetic).

use half::f16;
use megatrain_tensor::testing::{SeededRng, rel_norm_err};
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, CpuTensor, Executor, HostTensor, MatmulNeeds, Transpose,
    f16_scale_exponent,
};

const F32: CpuExecutor = CpuExecutor::new();
const F16: CpuExecutor = CpuExecutor::with_precision(ComputePrecision::F16);
const ALL_T: [Transpose; 4] = [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT];

/// A tensor's values as the f16 operand sees them, in f64, and its exponent.
fn quantize(x: &[f32]) -> (Vec<f64>, i32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = f16_scale_exponent(max);
    let s = 2f64.powi(-e);
    let q = x.iter().map(|&v| f16::from_f64(v as f64 * s).to_f64()).collect();
    (q, e)
}

/// Operand shapes of one case: `lead` batch dims, `m × k` by `k × n`, `b`
/// shared or batched, transposes `t`.
#[derive(Clone, Copy, Debug)]
struct Case<'a> {
    lead: &'a [usize],
    m: usize,
    k: usize,
    n: usize,
    b_batched: bool,
    t: Transpose,
}

impl Case<'_> {
    fn batch(&self) -> usize {
        self.lead.iter().product()
    }
    fn a_shape(&self) -> Vec<usize> {
        let mut s = self.lead.to_vec();
        s.extend(if self.t.a {
            [self.k, self.m]
        } else {
            [self.m, self.k]
        });
        s
    }
    fn b_shape(&self) -> Vec<usize> {
        let mut s = if self.b_batched {
            self.lead.to_vec()
        } else {
            vec![]
        };
        s.extend(if self.t.b {
            [self.n, self.k]
        } else {
            [self.k, self.n]
        });
        s
    }
    fn out_shape(&self) -> Vec<usize> {
        let mut s = self.lead.to_vec();
        s.extend([self.m, self.n]);
        s
    }
    /// Offset of op(a)[bi][i][p] in a.
    fn ai(&self, bi: usize, i: usize, p: usize) -> usize {
        bi * self.m * self.k + if self.t.a { p * self.m + i } else { i * self.k + p }
    }
    /// Offset of op(b)[bi][p][j] in b.
    fn bi(&self, bi: usize, p: usize, j: usize) -> usize {
        let base = if self.b_batched { bi * self.k * self.n } else { 0 };
        base + if self.t.b { j * self.k + p } else { p * self.n + j }
    }
    fn oi(&self, bi: usize, i: usize, j: usize) -> usize {
        (bi * self.m + i) * self.n + j
    }
}

/// Exact products of quantized operands: (forward, da, db) with, for each,
/// the sum of |terms| (the scale of f32 accumulation error).
struct Reference {
    y: Vec<f64>,
    y_abs: Vec<f64>,
    da: Vec<f64>,
    da_abs: Vec<f64>,
    db: Vec<f64>,
    db_abs: Vec<f64>,
}

fn reference(c: &Case, a: &[f32], b: &[f32], dout: &[f32]) -> Reference {
    let ((qa, ea), (qb, eb), (qd, ed)) = (quantize(a), quantize(b), quantize(dout));
    let (sy, sa, sb) = (2f64.powi(ea + eb), 2f64.powi(ed + eb), 2f64.powi(ea + ed));
    let mut r = Reference {
        y: vec![0.0; c.batch() * c.m * c.n],
        y_abs: vec![0.0; c.batch() * c.m * c.n],
        da: vec![0.0; a.len()],
        da_abs: vec![0.0; a.len()],
        db: vec![0.0; b.len()],
        db_abs: vec![0.0; b.len()],
    };
    for bi in 0..c.batch() {
        for i in 0..c.m {
            for j in 0..c.n {
                let o = c.oi(bi, i, j);
                for p in 0..c.k {
                    let (x, w, g) = (qa[c.ai(bi, i, p)], qb[c.bi(bi, p, j)], qd[o]);
                    r.y[o] += x * w * sy;
                    r.y_abs[o] += (x * w * sy).abs();
                    r.da[c.ai(bi, i, p)] += g * w * sa;
                    r.da_abs[c.ai(bi, i, p)] += (g * w * sa).abs();
                    r.db[c.bi(bi, p, j)] += x * g * sb;
                    r.db_abs[c.bi(bi, p, j)] += (x * g * sb).abs();
                }
            }
        }
    }
    r
}

fn tensor(shape: Vec<usize>, data: Vec<f32>) -> CpuTensor<f32> {
    F16.upload(&HostTensor::from_f32(shape, data).unwrap()).unwrap()
}

fn random(rng: &mut SeededRng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.uniform() * scale) as f32).collect()
}

/// `got` within f32 accumulation error of `want`: products of two f16
/// values are exact in f32, so only the k-term sums round (and the
/// unscaling, exactly, by a power of two).
fn within_accumulation(what: &str, got: &[f32], want: &[f64], abs: &[f64], k: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(abs).enumerate() {
        let tol = (k as f64 + 2.0) * 2f64.powi(-24) * s + 1e-300;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}[{i}]: {g} vs exact {w} (tolerance {tol:e})"
        );
    }
}

fn check_case(c: &Case, seed: u64, scales: [f64; 3]) {
    let mut rng = SeededRng::new(seed);
    let batch = c.batch();
    let a = random(&mut rng, batch * c.m * c.k, scales[0]);
    let b_len = if c.b_batched { batch } else { 1 } * c.k * c.n;
    let b = random(&mut rng, b_len, scales[1]);
    let dout = random(&mut rng, batch * c.m * c.n, scales[2]);
    let bias = random(&mut rng, c.n, scales[0] * scales[1]);
    let r = reference(c, &a, &b, &dout);
    let (ta, tb) = (tensor(c.a_shape(), a), tensor(c.b_shape(), b));
    let td = tensor(c.out_shape(), dout.clone());
    let tbias = tensor(vec![c.n], bias.clone());

    let y = F16.matmul(&ta, &tb, None, c.t).unwrap();
    within_accumulation(&format!("{c:?} y"), y.data(), &r.y, &r.y_abs, c.k);
    // The bias is added after the product, in f32.
    let yb = F16.matmul(&ta, &tb, Some(&tbias), c.t).unwrap();
    for (i, (&with, &without)) in yb.data().iter().zip(y.data()).enumerate() {
        assert_eq!(with, without + bias[i % c.n], "{c:?} bias at {i}");
    }

    let g = F16.matmul_backward(&ta, &tb, &td, c.t, MatmulNeeds::ALL).unwrap();
    let da = g.da.unwrap();
    let db = g.db.unwrap();
    within_accumulation(&format!("{c:?} da"), da.data(), &r.da, &r.da_abs, c.n);
    // A shared b sums its gradient over the batch too.
    let db_terms = if c.b_batched { c.m } else { batch * c.m };
    within_accumulation(&format!("{c:?} db"), db.data(), &r.db, &r.db_abs, db_terms);
    let mut dbias = vec![0f32; c.n];
    for (i, v) in dout.iter().enumerate() {
        dbias[i % c.n] += v;
    }
    assert_eq!(
        g.dbias.unwrap().data(),
        dbias,
        "{c:?}: dbias is an f32 sum of dout"
    );

    // Only what is asked is computed, and equals the full call.
    let only_db = F16
        .matmul_backward(
            &ta,
            &tb,
            &td,
            c.t,
            MatmulNeeds {
                da: false,
                db: true,
                dbias: false,
            },
        )
        .unwrap();
    assert!(only_db.da.is_none() && only_db.dbias.is_none());
    assert_eq!(only_db.db.unwrap().data(), db.data(), "{c:?}");
}

#[test]
fn every_layout_matches_exact_products_of_the_rounded_operands() {
    let mut seed = 0;
    for t in ALL_T {
        for (lead, b_batched) in [
            (&[][..], false),
            (&[3][..], false),
            (&[2, 3][..], false),
            (&[3][..], true),
        ] {
            for (m, k, n) in [(1, 1, 1), (7, 13, 5), (17, 3, 9), (4, 33, 1)] {
                seed += 1;
                let c = Case {
                    lead,
                    m,
                    k,
                    n,
                    b_batched,
                    t,
                };
                check_case(&c, seed, [1.0, 0.05, 1e-3]);
            }
        }
    }
}

#[test]
fn rounding_is_visible_against_the_f32_path() {
    let c = Case {
        lead: &[2],
        m: 19,
        k: 37,
        n: 11,
        b_batched: false,
        t: Transpose::NT,
    };
    let mut rng = SeededRng::new(7);
    let a = tensor(c.a_shape(), random(&mut rng, 2 * 19 * 37, 1.0));
    let b = tensor(c.b_shape(), random(&mut rng, 37 * 11, 1.0));
    let d = tensor(c.out_shape(), random(&mut rng, 2 * 19 * 11, 1.0));
    let y16 = F16.matmul(&a, &b, None, c.t).unwrap();
    let y32 = F32.matmul(&a, &b, None, c.t).unwrap();
    let err = rel_norm_err(y16.data(), y32.data());
    // f16 keeps 11 significant bits: a relative error near 2^-12 per
    // operand, well above f32's 2^-24, well below anything that trains badly.
    assert!(
        (1e-5..2e-3).contains(&err),
        "forward: f16 vs f32 relative error {err:e}"
    );
    let g16 = F16.matmul_backward(&a, &b, &d, c.t, MatmulNeeds::ALL).unwrap();
    let g32 = F32.matmul_backward(&a, &b, &d, c.t, MatmulNeeds::ALL).unwrap();
    for (what, x, y) in [
        ("da", g16.da.unwrap(), g32.da.unwrap()),
        ("db", g16.db.unwrap(), g32.db.unwrap()),
    ] {
        let err = rel_norm_err(x.data(), y.data());
        assert!(
            (1e-5..2e-3).contains(&err),
            "{what}: f16 vs f32 relative error {err:e}"
        );
    }
    assert_eq!(g16.dbias.unwrap().data(), g32.dbias.unwrap().data());
}

/// Operands far outside f16's range (65504 at the top, 6.1e-5 the smallest
/// normal) still give finite products within f16 rounding of the exact
/// ones. Without the scaling, |x| ~ 1e6 rounds to infinity and |x| ~ 1e-6
/// to subnormals with a few bits left (or zero).
#[test]
fn scaling_keeps_huge_and_tiny_operands_accurate() {
    let c = Case {
        lead: &[2],
        m: 5,
        k: 23,
        n: 7,
        b_batched: true,
        t: Transpose::TN,
    };
    for (seed, scales) in [
        (11, [1e6, 1.0, 1.0]),
        (12, [1e-6, 1.0, 1.0]),
        (13, [1.0, 3e5, 1e-7]),
        (14, [1e-6, 1e-6, 1e6]),
        (15, [1e6, 1e6, 1e-6]),
    ] {
        let mut rng = SeededRng::new(seed);
        let a = random(&mut rng, 2 * 5 * 23, scales[0]);
        let b = random(&mut rng, 2 * 23 * 7, scales[1]);
        let d = random(&mut rng, 2 * 5 * 7, scales[2]);
        let (ta, tb, td) = (
            tensor(c.a_shape(), a.clone()),
            tensor(c.b_shape(), b.clone()),
            tensor(c.out_shape(), d.clone()),
        );
        let y = F16.matmul(&ta, &tb, None, c.t).unwrap();
        let g = F16.matmul_backward(&ta, &tb, &td, c.t, MatmulNeeds::ALL).unwrap();
        let exact = reference_unrounded(&c, &a, &b, &d);
        for (what, got, (want, abs)) in [
            ("y", y.data(), exact.0),
            ("da", g.da.as_ref().unwrap().data(), exact.1),
            ("db", g.db.as_ref().unwrap().data(), exact.2),
        ] {
            for (i, ((&x, &w), &s)) in got.iter().zip(&want).zip(&abs).enumerate() {
                assert!(x.is_finite(), "scales {scales:?} {what}[{i}] = {x}");
                // Each operand is within 2^-11 relative after rounding
                // (margin for the f32 sums).
                let tol = 1.01 * 2f64.powi(-10) * s;
                assert!(
                    (x as f64 - w).abs() <= tol,
                    "scales {scales:?} {what}[{i}]: {x} vs exact {w} (tolerance {tol:e})"
                );
            }
        }
    }
}

/// Exact products of the operands as given (no rounding): (value, sum of
/// |terms|) for y, da and db.
#[allow(clippy::type_complexity)]
fn reference_unrounded(
    c: &Case,
    a: &[f32],
    b: &[f32],
    d: &[f32],
) -> ((Vec<f64>, Vec<f64>), (Vec<f64>, Vec<f64>), (Vec<f64>, Vec<f64>)) {
    let mut y = (vec![0.0; d.len()], vec![0.0; d.len()]);
    let mut da = (vec![0.0; a.len()], vec![0.0; a.len()]);
    let mut db = (vec![0.0; b.len()], vec![0.0; b.len()]);
    for bi in 0..c.batch() {
        for i in 0..c.m {
            for j in 0..c.n {
                let o = c.oi(bi, i, j);
                for p in 0..c.k {
                    let (x, w, g) = (a[c.ai(bi, i, p)] as f64, b[c.bi(bi, p, j)] as f64, d[o] as f64);
                    y.0[o] += x * w;
                    y.1[o] += (x * w).abs();
                    da.0[c.ai(bi, i, p)] += g * w;
                    da.1[c.ai(bi, i, p)] += (g * w).abs();
                    db.0[c.bi(bi, p, j)] += x * g;
                    db.1[c.bi(bi, p, j)] += (x * g).abs();
                }
            }
        }
    }
    (y, da, db)
}

#[test]
fn the_scale_is_per_tensor_across_the_batch() {
    // Batch 0 holds values ~1e4, batch 1 values ~1e-6: one exponent for the
    // whole tensor (0 here) leaves batch 1 on the f16 subnormal grid
    // (steps of 2^-24), so its product is coarser than a per-batch scale
    // would give; the GPU must do the same.
    let a_vals = [1e4f32, -2e4, 3e4, 1.2345e-6, -2.3456e-6, 3.4567e-6];
    let a = tensor(vec![2, 1, 3], a_vals.to_vec());
    let b = tensor(vec![3, 1], vec![1.0, 1.0, 1.0]);
    let y = F16.matmul(&a, &b, None, Transpose::NN).unwrap();
    let (q, _) = quantize(&a_vals);
    let (qb, _) = quantize(&[1.0, 1.0, 1.0]);
    let eb = f16_scale_exponent(1.0);
    let ea = f16_scale_exponent(3e4);
    let want1: f64 = (3..6).map(|i| q[i] * qb[i - 3]).sum::<f64>() * 2f64.powi(ea + eb);
    assert_eq!(y.data()[1] as f64, want1);
    let per_batch = F16
        .matmul(&tensor(vec![1, 3], a_vals[3..].to_vec()), &b, None, Transpose::NN)
        .unwrap();
    assert_ne!(
        y.data()[1],
        per_batch.data()[0],
        "per-tensor differs from per-batch"
    );
}

#[test]
fn non_finite_operands_propagate_as_in_f32() {
    let a = tensor(vec![2, 2], vec![1.0, f32::NAN, 2.0, 3.0]);
    let b = tensor(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let y = F16.matmul(&a, &b, None, Transpose::NN).unwrap();
    assert!(y.data()[0].is_nan() && y.data()[1].is_nan());
    assert_eq!(&y.data()[2..], [11.0, 16.0]);
    let inf = tensor(vec![1, 2], vec![f32::INFINITY, 1.0]);
    let y = F16.matmul(&inf, &b, None, Transpose::NN).unwrap();
    assert_eq!(y.data(), [f32::INFINITY, f32::INFINITY]);
}

#[test]
fn precision_is_set_and_reported() {
    let mut ex = CpuExecutor::new();
    assert_eq!(ex.compute_precision(), ComputePrecision::F32);
    ex.set_compute_precision(ComputePrecision::F16).unwrap();
    assert_eq!(ex.compute_precision(), ComputePrecision::F16);
    assert!(ex.name().contains("f16"), "{}", ex.name());
    let a = tensor(vec![1, 2], vec![1.0 + 2f32.powi(-12), 1.0]);
    let b = tensor(vec![2, 1], vec![1.0, 1.0]);
    // 1 + 2^-12 rounds to 1 in f16, not in f32.
    assert_eq!(ex.matmul(&a, &b, None, Transpose::NN).unwrap().data(), [2.0]);
    ex.set_compute_precision(ComputePrecision::F32).unwrap();
    assert!(!ex.name().contains("f16"));
    assert_eq!(
        ex.matmul(&a, &b, None, Transpose::NN).unwrap().data(),
        [2.0 + 2f32.powi(-12)]
    );
}
