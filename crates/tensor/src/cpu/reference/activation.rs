//! SwiGLU (plain and GPT-OSS's clamped one), GeGLU, GELU (the tanh
//! approximation and the exact, erf one) and the soft cap, elementwise.

use rayon::prelude::*;

use crate::cpu::Real;

/// Elementwise work below this size is not worth waking rayon for.
const CHUNK: usize = 1 << 12;

fn sigmoid<F: Real>(x: F) -> F {
    (F::one() + (-x).exp()).recip()
}

fn map2<F: Real>(a: &[F], b: &[F], f: impl Fn(F, F) -> F + Sync) -> Vec<F> {
    assert_eq!(a.len(), b.len(), "elementwise: lengths");
    let mut y = vec![F::zero(); a.len()];
    y.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .zip(b.par_chunks(CHUNK))
        .for_each(|((y, a), b)| {
            y.iter_mut().zip(a).zip(b).for_each(|((y, &a), &b)| *y = f(a, b));
        });
    y
}

/// `silu(gate) · up`.
pub fn swiglu<F: Real>(gate: &[F], up: &[F]) -> Vec<F> {
    map2(gate, up, |g, u| g * sigmoid(g) * u)
}

/// Returns `(dgate, dup)` of [`swiglu`].
pub fn swiglu_backward<F: Real>(gate: &[F], up: &[F], dy: &[F]) -> (Vec<F>, Vec<F>) {
    assert_eq!(dy.len(), gate.len(), "swiglu_backward: dy length");
    let gu: Vec<(F, F)> = gate.iter().copied().zip(up.iter().copied()).collect();
    let pairs: Vec<(F, F)> = gu
        .par_iter()
        .zip(dy.par_iter())
        .with_min_len(CHUNK)
        .map(|(&(g, u), &dy)| {
            let s = sigmoid(g);
            let dsilu = s * (F::one() + g * (F::one() - s));
            (dy * u * dsilu, dy * g * s)
        })
        .collect();
    pairs.into_iter().unzip()
}

/// The clamps of GPT-OSS's SwiGLU, `(min(gate, limit), clamp(up, ±limit))`,
/// written as comparisons so that a NaN passes through as torch's `clamp`
/// lets it (`F::min` would drop it).
fn clamped<F: Real>(gate: F, up: F, limit: F) -> (F, F) {
    let g = if gate > limit { limit } else { gate };
    let u = if up > limit {
        limit
    } else if up < -limit {
        -limit
    } else {
        up
    };
    (g, u)
}

/// GPT-OSS's clamped SwiGLU, `(u + 1) · (g · σ(g · alpha))` of the clamped
/// gate and up of `gate_up`, interleaved (gate at 2i, up at 2i + 1): one
/// output a pair.
pub fn swiglu_clamped<F: Real>(gate_up: &[F], alpha: F, limit: F) -> Vec<F> {
    assert!(gate_up.len().is_multiple_of(2), "swiglu_clamped: gate_up pairs");
    gate_up
        .par_chunks_exact(2)
        .with_min_len(CHUNK)
        .map(|p| {
            let (g, u) = clamped(p[0], p[1], limit);
            (u + F::one()) * (g * sigmoid(g * alpha))
        })
        .collect()
}

/// The gradient of `gate_up` of [`swiglu_clamped`], interleaved as it is:
/// zero where a clamp bound its input, the bounds themselves passing it.
pub fn swiglu_clamped_backward<F: Real>(gate_up: &[F], dy: &[F], alpha: F, limit: F) -> Vec<F> {
    assert_eq!(gate_up.len(), 2 * dy.len(), "swiglu_clamped_backward: dy length");
    let mut out = vec![F::zero(); gate_up.len()];
    out.par_chunks_exact_mut(2)
        .with_min_len(CHUNK)
        .zip(gate_up.par_chunks_exact(2).zip(dy.par_iter()))
        .for_each(|(o, (p, &dy))| {
            let (gate, up) = (p[0], p[1]);
            let (g, u) = clamped(gate, up, limit);
            let s = sigmoid(g * alpha);
            let dglu = s + alpha * g * s * (F::one() - s);
            o[0] = if gate <= limit {
                dy * (u + F::one()) * dglu
            } else {
                F::zero()
            };
            o[1] = if up >= -limit && up <= limit {
                dy * g * s
            } else {
                F::zero()
            };
        });
    out
}

fn gelu_consts<F: Real>() -> (F, F) {
    (
        F::from_f64((2.0 / std::f64::consts::PI).sqrt()),
        F::from_f64(0.044715),
    )
}

/// `0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 x³)))` (GPT-2 `gelu_new`).
pub fn gelu<F: Real>(x: &[F]) -> Vec<F> {
    let (c, a) = gelu_consts::<F>();
    let half = F::from_f64(0.5);
    map2(x, x, |x, _| {
        half * x * (F::one() + (c * (x + a * x * x * x)).tanh())
    })
}

/// `dx` of [`gelu`].
pub fn gelu_backward<F: Real>(x: &[F], dy: &[F]) -> Vec<F> {
    let (c, a) = gelu_consts::<F>();
    let (half, three) = (F::from_f64(0.5), F::from_f64(3.0));
    map2(x, dy, |x, dy| {
        let th = (c * (x + a * x * x * x)).tanh();
        let du = c * (F::one() + three * a * x * x);
        dy * (half * (F::one() + th) + half * x * (F::one() - th * th) * du)
    })
}

/// `gelu(gate) · up` (Gemma's MLP: `gelu_pytorch_tanh`, [`gelu`]'s
/// approximation).
pub fn geglu<F: Real>(gate: &[F], up: &[F]) -> Vec<F> {
    let (c, a) = gelu_consts::<F>();
    let half = F::from_f64(0.5);
    map2(gate, up, |g, u| {
        half * g * (F::one() + (c * (g + a * g * g * g)).tanh()) * u
    })
}

/// Returns `(dgate, dup)` of [`geglu`].
pub fn geglu_backward<F: Real>(gate: &[F], up: &[F], dy: &[F]) -> (Vec<F>, Vec<F>) {
    assert_eq!(dy.len(), gate.len(), "geglu_backward: dy length");
    assert_eq!(up.len(), gate.len(), "geglu_backward: up length");
    let (c, a) = gelu_consts::<F>();
    let (half, three) = (F::from_f64(0.5), F::from_f64(3.0));
    let pairs: Vec<(F, F)> = (gate, up, dy)
        .into_par_iter()
        .with_min_len(CHUNK)
        .map(|(&g, &u, &dy)| {
            let th = (c * (g + a * g * g * g)).tanh();
            let du = c * (F::one() + three * a * g * g);
            let dgelu = half * (F::one() + th) + half * g * (F::one() - th * th) * du;
            (dy * u * dgelu, dy * half * g * (F::one() + th))
        })
        .collect();
    pairs.into_iter().unzip()
}

/// `cap · tanh(x / cap)`, the soft cap of one value (the attention's
/// scores take it too).
pub(crate) fn capped<F: Real>(x: F, cap: F) -> F {
    cap * (x / cap).tanh()
}

/// The soft cap's derivative at the capped `y`: `1 − (y / cap)²`.
pub(crate) fn capped_slope<F: Real>(y: F, cap: F) -> F {
    F::one() - (y / cap) * (y / cap)
}

/// `x ← cap · tanh(x / cap)` (Gemma's final logit soft-capping).
pub fn softcap<F: Real>(x: &mut [F], cap: F) {
    x.par_chunks_mut(CHUNK)
        .for_each(|c| c.iter_mut().for_each(|x| *x = capped(*x, cap)));
}

/// `dy ← dx` of [`softcap`] from its output `y`: `dy · (1 − (y / cap)²)`.
pub fn softcap_backward<F: Real>(y: &[F], dy: &mut [F], cap: F) {
    assert_eq!(y.len(), dy.len(), "softcap_backward: lengths");
    dy.par_chunks_mut(CHUNK)
        .zip(y.par_chunks(CHUNK))
        .for_each(|(d, y)| {
            d.iter_mut()
                .zip(y)
                .for_each(|(d, &y)| *d = *d * capped_slope(y, cap))
        });
}

/// `0.5 · x · (1 + erf(x / √2))`, the exact GELU (`hidden_act` `gelu`:
/// GPT-NeoX's, Pythia's).
pub fn gelu_erf<F: Real>(x: &[F]) -> Vec<F> {
    let (half, r2) = (F::from_f64(0.5), F::from_f64(std::f64::consts::FRAC_1_SQRT_2));
    map2(x, x, |x, _| half * x * (F::one() + (x * r2).erf()))
}

/// `dx` of [`gelu_erf`]: `dy · (Φ(x) + x · φ(x))`.
pub fn gelu_erf_backward<F: Real>(x: &[F], dy: &[F]) -> Vec<F> {
    let (half, r2) = (F::from_f64(0.5), F::from_f64(std::f64::consts::FRAC_1_SQRT_2));
    // 1/√(2π).
    let pdf = F::from_f64(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
    map2(x, dy, |x, dy| {
        let cdf = half * (F::one() + (x * r2).erf());
        dy * (cdf + x * pdf * (-half * x * x).exp())
    })
}

/// `x · σ(gate)` (Qwen3-Next's gated attention output).
pub fn sigmoid_mul<F: Real>(gate: &[F], x: &[F]) -> Vec<F> {
    map2(gate, x, |g, x| x * sigmoid(g))
}

/// Returns `(dgate, dx)` of [`sigmoid_mul`].
pub fn sigmoid_mul_backward<F: Real>(gate: &[F], x: &[F], dy: &[F]) -> (Vec<F>, Vec<F>) {
    assert_eq!(dy.len(), gate.len(), "sigmoid_mul_backward: dy length");
    assert_eq!(x.len(), gate.len(), "sigmoid_mul_backward: x length");
    let pairs: Vec<(F, F)> = (gate, x, dy)
        .into_par_iter()
        .with_min_len(CHUNK)
        .map(|(&g, &x, &dy)| {
            let s = sigmoid(g);
            (dy * x * s * (F::one() - s), dy * s)
        })
        .collect();
    pairs.into_iter().unzip()
}
