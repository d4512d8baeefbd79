//! Small helpers for tests across the workspace: seeded random data without
//! a `rand` dependency, error norms and central finite differences.

use crate::{CpuTensor, HostTensor, Shape, TensorHandle};

/// A tiny deterministic generator (SplitMix64): same seed, same numbers on
/// every platform.
#[derive(Debug, Clone)]
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`, 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `n` values uniform in `[-1, 1)` as f64.
pub fn random_f64(seed: u64, n: usize) -> Vec<f64> {
    let mut r = SeededRng::new(seed);
    (0..n).map(|_| r.uniform()).collect()
}

/// `n` values uniform in `[-1, 1)` as f32 (the f32 roundings of
/// [`random_f64`] with the same seed).
pub fn random_f32(seed: u64, n: usize) -> Vec<f32> {
    random_f64(seed, n).into_iter().map(|x| x as f32).collect()
}

/// An f32 host tensor of `shape` filled by [`random_f32`].
pub fn random_tensor(seed: u64, shape: impl Into<Shape>) -> HostTensor {
    let shape = shape.into();
    let data = random_f32(seed, shape.numel());
    HostTensor::from_f32(shape, data).expect("length matches shape")
}

/// `‖a − b‖ / max(‖b‖, tiny)`: the error of `a` relative to reference `b`.
/// Panics if the lengths differ (a test bug, not a numerical result).
pub fn rel_norm_err<A: Copy + Into<f64>, B: Copy + Into<f64>>(a: &[A], b: &[B]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_norm_err: lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y): (f64, f64) = (x.into(), y.into());
        num += (x - y) * (x - y);
        den += y * y;
    }
    num.sqrt() / den.sqrt().max(1e-300)
}

/// The Euclidean norm, in f64.
pub fn norm<A: Copy + Into<f64>>(a: &[A]) -> f64 {
    a.iter().map(|&x| x.into() * x.into()).sum::<f64>().sqrt()
}

/// [`rel_norm_err`], except where `b` vanishes beside `scale` (its norm
/// below `vanishing · scale`): there both sides hold only rounding (a
/// gradient the model makes exactly 0), and the error is `‖a − b‖ / scale`.
pub fn rel_norm_err_or_scaled<A: Copy + Into<f64>, B: Copy + Into<f64>>(
    a: &[A],
    b: &[B],
    scale: f64,
    vanishing: f64,
) -> f64 {
    if norm(b) >= vanishing * scale {
        return rel_norm_err(a, b);
    }
    assert_eq!(a.len(), b.len(), "rel_norm_err_or_scaled: lengths differ");
    let diff: Vec<f64> = a.iter().zip(b).map(|(&x, &y)| x.into() - y.into()).collect();
    norm(&diff) / scale
}

/// Central differences `(f(x + h eᵢ) − f(x − h eᵢ)) / 2h` for every `i`.
pub fn finite_diff(x: &[f64], h: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + h;
            let fp = f(&xp);
            xp[i] = x[i] - h;
            let fm = f(&xp);
            xp[i] = x[i];
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Checks `analytic[i]` against central finite differences (step 1e-5) of
/// the scalar `f` with respect to input `i`, every other input held fixed:
/// a relative error under 1e-7, or a panic naming `name` and the input.
pub fn grad_check(
    name: &str,
    inputs: &[CpuTensor<f64>],
    analytic: &[&[f64]],
    f: impl Fn(&[CpuTensor<f64>]) -> f64,
) {
    assert_eq!(inputs.len(), analytic.len());
    for (i, an) in analytic.iter().enumerate() {
        let shape = inputs[i].shape().clone();
        let num = finite_diff(inputs[i].data(), 1e-5, |x| {
            let mut ins = inputs.to_vec();
            ins[i] = CpuTensor::from_vec(shape.clone(), x.to_vec()).unwrap();
            f(&ins)
        });
        let err = rel_norm_err(an, &num);
        assert!(
            err < 1e-7,
            "{name}: input {i}: relative error {err:e}\nanalytic {an:?}\nnumeric {num:?}"
        );
    }
}

/// `Σ a·b` in f64: the scalar objective `⟨output, cotangent⟩` of gradient checks.
pub fn dot<A: Copy + Into<f64>, B: Copy + Into<f64>>(a: &[A], b: &[B]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    a.iter().zip(b).map(|(&x, &y)| x.into() * y.into()).sum()
}

/// q (scaled), k (unit rows), v, g (log-decays < 0: one a head, or one a
/// key channel) and beta in (0, 1) of a `[b, t, hk, hv, dk, dv]` rule.
pub fn delta_rule_inputs(
    seed: u64,
    [b, t, hk, hv, dk, dv]: [usize; 6],
    per_channel: bool,
) -> [CpuTensor<f64>; 5] {
    type T = CpuTensor<f64>;
    let unit_rows = |seed, scale: f64| {
        let mut x = random_f64(seed, b * t * hk * dk);
        for row in x.chunks_mut(dk) {
            let n = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            row.iter_mut().for_each(|v| *v *= scale / n);
        }
        T::from_vec(vec![b, t, hk, dk], x).unwrap()
    };
    let decays = if per_channel { dk } else { 1 };
    let g: Vec<f64> = random_f64(seed + 3, b * t * hv * decays)
        .iter()
        .map(|u| -(1.0 + (2.0 * u).exp()).ln())
        .collect();
    let beta: Vec<f64> = random_f64(seed + 4, b * t * hv)
        .iter()
        .map(|u| 1.0 / (1.0 + (-3.0 * u).exp()))
        .collect();
    let g_shape = match per_channel {
        true => vec![b, t, hv, dk],
        false => vec![b, t, hv],
    };
    [
        unit_rows(seed, 1.0 / (dk as f64).sqrt()),
        unit_rows(seed + 1, 1.0),
        T::from_vec(vec![b, t, hv, dv], random_f64(seed + 2, b * t * hv * dv)).unwrap(),
        T::from_vec(g_shape, g).unwrap(),
        T::from_vec(vec![b, t, hv], beta).unwrap(),
    ]
}
