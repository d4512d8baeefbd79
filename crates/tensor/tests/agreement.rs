//! Property tests over awkward shapes (1, primes, not multiples of 4/8/16):
//! the f32 `CpuExecutor` agrees with the f64 `F64Executor` on the same
//! inputs, and invariants of the loss hold.

use megatrain_tensor::testing::{SeededRng, random_tensor};
use megatrain_tensor::{
    AttnMask, CpuExecutor, CpuTensor, Executor, F64Executor, HostTensor, LossTerms, MatmulNeeds, Rope, Shape,
    SoftCap, TensorHandle, Transpose,
};
use proptest::prelude::*;

const E32: CpuExecutor = CpuExecutor::new();
const E64: F64Executor = F64Executor::new();

fn dim() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1usize, 2, 3, 5, 7, 13, 17])
}

/// `a ≈ b` with `b` the f64 reference: ‖a − b‖ ≤ 1e-5·‖b‖ + 1e-6·√n, the
/// absolute floor covering outputs that are exactly zero in exact arithmetic.
fn agree(what: &str, a: &CpuTensor<f32>, b: &CpuTensor<f64>) -> Result<(), TestCaseError> {
    agree_floor(what, a, b, 1e-6 * (a.numel() as f64).sqrt())
}

/// As [`agree`] for outputs that are sums of `len` products of O(1) terms:
/// rounding grows like √len per element, so the floor does too (cancelling
/// sums make a purely relative bound meaningless).
fn agree_sum(what: &str, a: &CpuTensor<f32>, b: &CpuTensor<f64>, len: usize) -> Result<(), TestCaseError> {
    agree_floor(what, a, b, 1e-6 * ((a.numel() * len.max(1)) as f64).sqrt())
}

/// As [`agree`] with an explicit absolute floor, for outputs that are small
/// differences of large terms (norm input gradients: the terms scale with
/// rstd, which is large when a row is nearly constant).
fn agree_floor(what: &str, a: &CpuTensor<f32>, b: &CpuTensor<f64>, floor: f64) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.shape(), b.shape(), "{}: shapes", what);
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.data().iter().zip(b.data()) {
        num += (x as f64 - y) * (x as f64 - y);
        den += y * y;
    }
    let (num, den) = (num.sqrt(), den.sqrt());
    let bound = 1e-5 * den + floor;
    prop_assert!(
        num <= bound,
        "{}: error {:e} > {:e} (reference norm {:e})",
        what,
        num,
        bound,
        den
    );
    Ok(())
}

/// The same host data on both executors.
fn both(seed: u64, shape: &[usize]) -> (CpuTensor<f32>, CpuTensor<f64>) {
    let h = random_tensor(seed, shape.to_vec());
    (E32.upload(&h).unwrap(), E64.upload(&h).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn matmul_fwd_bwd(
        (batch, m, k, n) in (dim(), dim(), dim(), dim()),
        ta in any::<bool>(), tb in any::<bool>(), b_batched in any::<bool>(), bias in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let t = Transpose { a: ta, b: tb };
        let ad = if ta { [batch, k, m] } else { [batch, m, k] };
        let bd: Vec<usize> = match (b_batched, tb) {
            (true, true) => vec![batch, n, k],
            (true, false) => vec![batch, k, n],
            (false, true) => vec![n, k],
            (false, false) => vec![k, n],
        };
        let (a32, a64) = both(seed, &ad);
        let (b32, b64) = both(seed + 1, &bd);
        let (c32, c64) = both(seed + 2, &[n]);
        let y32 = E32.matmul(&a32, &b32, bias.then_some(&c32), t).unwrap();
        let y64 = E64.matmul(&a64, &b64, bias.then_some(&c64), t).unwrap();
        agree_sum("matmul", &y32, &y64, k)?;
        let (d32, d64) = both(seed + 3, &[batch, m, n]);
        let g32 = E32.matmul_backward(&a32, &b32, &d32, t, MatmulNeeds::ALL).unwrap();
        let g64 = E64.matmul_backward(&a64, &b64, &d64, t, MatmulNeeds::ALL).unwrap();
        agree_sum("da", g32.da.as_ref().unwrap(), g64.da.as_ref().unwrap(), n)?;
        agree_sum("db", g32.db.as_ref().unwrap(), g64.db.as_ref().unwrap(), batch * m)?;
        agree_sum("dbias", g32.dbias.as_ref().unwrap(), g64.dbias.as_ref().unwrap(), batch * m)?;
    }

    #[test]
    fn norms_fwd_bwd(rows in dim(), c in dim(), seed in 0u64..1000) {
        let (x32, x64) = both(seed, &[rows, c]);
        let (w32, w64) = both(seed + 1, &[c]);
        let (b32, b64) = both(seed + 2, &[c]);
        let (dy32, dy64) = both(seed + 3, &[rows, c]);
        let max = |v: &[f64]| v.iter().fold(0.0f64, |m, &x| m.max(x.abs()));
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let (r32, r64) = (E32.rmsnorm(&x32, &w32, 1e-5).unwrap(), E64.rmsnorm(&x64, &w64, 1e-5).unwrap());
        agree("rmsnorm y", &r32.y, &r64.y)?;
        agree("rmsnorm rstd", &r32.rstd, &r64.rstd)?;
        let g32 = E32.rmsnorm_backward(&x32, &w32, &r32.rstd, &dy32).unwrap();
        let g64 = E64.rmsnorm_backward(&x64, &w64, &r64.rstd, &dy64).unwrap();
        // Magnitude of the terms whose difference dx is: rstd · |dy| · |w|.
        let terms = |rstd: &[f64]| 1e-6 * max(rstd) * max(w64.data()) * norm(dy64.data());
        agree_floor("rmsnorm dx", &g32.dx, &g64.dx, terms(r64.rstd.data()))?;
        agree_sum("rmsnorm dw", &g32.dw, &g64.dw, rows)?;
        let l32 = E32.layernorm(&x32, &w32, &b32, 1e-5).unwrap();
        let l64 = E64.layernorm(&x64, &w64, &b64, 1e-5).unwrap();
        // x̂ = (x − mean)·rstd loses ~ulp(x)·rstd in f32 when a row is nearly constant.
        let xhat_floor = 1e-6 * max(l64.rstd.data());
        agree_floor("layernorm y", &l32.y, &l64.y, xhat_floor * max(w64.data()) * ((rows * c) as f64).sqrt())?;
        let g32 = E32.layernorm_backward(&x32, &w32, l32.mean.as_ref().unwrap(), &l32.rstd, &dy32).unwrap();
        let g64 = E64.layernorm_backward(&x64, &w64, l64.mean.as_ref().unwrap(), &l64.rstd, &dy64).unwrap();
        // ... and x̂'s own rounding (ulp(x)·rstd) enters dx multiplied by rstd again.
        let ln_dx_floor = terms(l64.rstd.data()) * (1.0 + max(l64.rstd.data()) * max(x64.data()));
        agree_floor("layernorm dx", &g32.dx, &g64.dx, ln_dx_floor)?;
        agree_floor("layernorm dw", &g32.dw, &g64.dw, xhat_floor * norm(dy64.data()))?;
        agree_sum("layernorm db", g32.db.as_ref().unwrap(), g64.db.as_ref().unwrap(), rows)?;
    }

    #[test]
    fn rope_fwd_bwd(b in dim(), t in dim(), h in dim(), half in dim(), pass in 0usize..3, offset in 0usize..5000,
                    seed in 0u64..1000) {
        // `pass` entries after the rotated ones go through unrotated.
        let rope = Rope { rotary_dim: (pass > 0).then_some(2 * half), interleaved: seed % 2 == 1, ..Rope::plain(10000.0, offset) };
        let (x32, x64) = both(seed, &[b, t, h, 2 * half + pass]);
        agree("rope", &E32.rope(&x32, rope.clone()).unwrap(), &E64.rope(&x64, rope.clone()).unwrap())?;
        agree("rope_backward", &E32.rope_backward(&x32, rope.clone()).unwrap(), &E64.rope_backward(&x64, rope.clone()).unwrap())?;
    }

    #[test]
    fn attention_fwd_bwd(
        b in 1usize..3, t in dim(), hkv in 1usize..4, group in 1usize..4, d in dim(), window in 0usize..6,
        cap in prop::sample::select(vec![0.0f32, 0.2, 1.0, 50.0]), seed in 0u64..1000,
    ) {
        let hq = hkv * group;
        let mask = match window {
            0 => AttnMask::CAUSAL,
            w => AttnMask::sliding(w),
        };
        let mask = match cap {
            0.0 => mask,
            c => mask.with_softcap(SoftCap::new(c, "test").unwrap()),
        };
        let (q32, q64) = both(seed, &[b, t, hq, d]);
        let (k32, k64) = both(seed + 1, &[b, t, hkv, d]);
        let (v32, v64) = both(seed + 2, &[b, t, hkv, d]);
        let (o32, o64) = (E32.attention(&q32, &k32, &v32, mask.clone()).unwrap(), E64.attention(&q64, &k64, &v64, mask).unwrap());
        agree("attention out", &o32.out, &o64.out)?;
        agree("attention lse", &o32.lse, &o64.lse)?;
        let (d32, d64) = both(seed + 3, &[b, t, hq, d]);
        let g32 = E32.attention_backward(&q32, &k32, &v32, &o32, &d32).unwrap();
        let g64 = E64.attention_backward(&q64, &k64, &v64, &o64, &d64).unwrap();
        agree("dq", &g32.dq, &g64.dq)?;
        agree_sum("dk", &g32.dk, &g64.dk, t * group)?;
        agree_sum("dv", &g32.dv, &g64.dv, t * group)?;
    }

    #[test]
    fn activations(rows in dim(), c in dim(), seed in 0u64..1000) {
        let (g32, g64) = both(seed, &[rows, c]);
        let (u32_, u64_) = both(seed + 1, &[rows, c]);
        let (d32, d64) = both(seed + 2, &[rows, c]);
        agree("swiglu", &E32.swiglu(&g32, &u32_).unwrap(), &E64.swiglu(&g64, &u64_).unwrap())?;
        let (a32, b32) = E32.swiglu_backward(&g32, &u32_, &d32).unwrap();
        let (a64, b64) = E64.swiglu_backward(&g64, &u64_, &d64).unwrap();
        agree("swiglu dgate", &a32, &a64)?;
        agree("swiglu dup", &b32, &b64)?;
        agree("geglu", &E32.geglu(&g32, &u32_).unwrap(), &E64.geglu(&g64, &u64_).unwrap())?;
        let (a32, b32) = E32.geglu_backward(&g32, &u32_, &d32).unwrap();
        let (a64, b64) = E64.geglu_backward(&g64, &u64_, &d64).unwrap();
        agree("geglu dgate", &a32, &a64)?;
        agree("geglu dup", &b32, &b64)?;
        agree("gelu", &E32.gelu(&g32).unwrap(), &E64.gelu(&g64).unwrap())?;
        agree("gelu dx", &E32.gelu_backward(&g32, &d32).unwrap(), &E64.gelu_backward(&g64, &d64).unwrap())?;
        agree("gelu_erf", &E32.gelu_erf(&g32).unwrap(), &E64.gelu_erf(&g64).unwrap())?;
        agree("gelu_erf dx", &E32.gelu_erf_backward(&g32, &d32).unwrap(), &E64.gelu_erf_backward(&g64, &d64).unwrap())?;
        let cap = SoftCap::new(0.7, "test").unwrap();
        let (y32, y64) = (E32.softcap(g32.clone(), cap).unwrap(), E64.softcap(g64.clone(), cap).unwrap());
        agree("softcap", &y32, &y64)?;
        agree("softcap dx", &E32.softcap_backward(&y32, d32.clone(), cap).unwrap(), &E64.softcap_backward(&y64, d64.clone(), cap).unwrap())?;
    }

    #[test]
    fn cross_entropy_agrees_and_invariants_hold(
        n in dim(), v in dim(), spread in 0.1f32..30.0, seed in 0u64..1000,
    ) {
        let mut rng = SeededRng::new(seed);
        let logits: Vec<f32> = (0..n * v).map(|_| spread * rng.uniform() as f32).collect();
        let targets: Vec<i32> =
            (0..n).map(|_| if rng.below(4) == 0 { -100 } else { rng.below(v as u64) as i32 }).collect();
        let counted = targets.iter().filter(|&&t| t != -100).count().max(1);
        let scale = 1.0 / counted as f32;
        let h = HostTensor::from_f32(vec![n, v], logits).unwrap();
        let o32 = E32.cross_entropy(&E32.upload(&h).unwrap(), &targets, -100, scale, LossTerms::NONE).unwrap();
        let o64 = E64.cross_entropy(&E64.upload(&h).unwrap(), &targets, -100, scale, LossTerms::NONE).unwrap();
        agree("losses", &o32.losses, &o64.losses)?;
        agree("dlogits", &o32.dlogits, &o64.dlogits)?;
        for (row, &tg) in targets.iter().enumerate() {
            let loss = o32.losses.data()[row];
            let drow = &o32.dlogits.data()[row * v..(row + 1) * v];
            if tg == -100 {
                prop_assert!(loss == 0.0 && drow.iter().all(|&g| g == 0.0));
            } else {
                prop_assert!(loss >= 0.0, "row {} loss {}", row, loss);
                let s: f32 = drow.iter().sum();
                // softmax sums to 1 up to a few ulp per term
                let tol = 4.0 * f32::EPSILON * (v as f32 + 1.0) * scale;
                prop_assert!(s.abs() <= tol, "row {} gradient sums to {} (tolerance {})", row, s, tol);
                prop_assert!(drow[tg as usize] <= 0.0);
            }
        }
    }

    #[test]
    fn layout_round_trips(rows in dim(), a in 0usize..6, b in dim(), start in 0usize..20, seed in 0u64..1000) {
        let (x, _) = both(seed, &[rows, a + b]);
        let parts = E32.split_last(&x, &[a, b]).unwrap();
        prop_assert_eq!(&E32.concat_last(&[&parts[0], &parts[1]]).unwrap(), &x);
        let start = start % rows;
        let len = rows - start;
        let s = E32.slice_rows(&x, start, len).unwrap();
        let mut z = E32.zeros(&Shape::new([rows, a + b])).unwrap();
        E32.write_rows(&mut z, start, &s).unwrap();
        prop_assert_eq!(&z.data()[start * (a + b)..], &x.data()[start * (a + b)..]);
    }
}
