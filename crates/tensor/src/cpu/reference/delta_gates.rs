//! The gated delta rule's gates: the decay
//! `g = −exp(A_log) · softplus(a + dt_bias)` and the write strength
//! `beta = σ(b)`, from the projections `a: [n, h·dk]` and `b: [n, h]`,
//! the decays one a head (dk = 1: Qwen3-Next's, Qwen3.5's) or one a key
//! channel (Kimi Linear's).

use rayon::prelude::*;

use crate::cpu::Real;

/// Elementwise work below this size is not worth waking rayon for.
const CHUNK: usize = 1 << 12;

/// torch's `softplus` threshold: above it the function is `x` itself,
/// as torch computes it (and the gradient 1), so that large inputs match
/// HF's bits rather than a `ln(1 + eˣ)` that rounds to the same value a
/// different way.
const SOFTPLUS_THRESHOLD: f64 = 20.0;

fn sigmoid<F: Real>(x: F) -> F {
    (F::one() + (-x).exp()).recip()
}

fn softplus<F: Real>(x: F) -> F {
    if x > F::from_f64(SOFTPLUS_THRESHOLD) {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// torch's softplus backward: 1 above the threshold, σ(x) at and below.
fn softplus_grad<F: Real>(x: F) -> F {
    if x > F::from_f64(SOFTPLUS_THRESHOLD) {
        F::one()
    } else {
        sigmoid(x)
    }
}

/// `(g, beta)`: `g` `[n, h·dk]` as `a`, `beta` `[n, h]` as `b`; `a_log`,
/// `dt_bias` `[h·dk]`.
pub fn delta_gates<F: Real>(
    a: &[F],
    b: &[F],
    a_log: &[F],
    dt_bias: &[F],
    [n, h, dk]: [usize; 3],
) -> (Vec<F>, Vec<F>) {
    let c = h * dk;
    assert!(a.len() == n * c && b.len() == n * h, "delta_gates: lengths");
    assert!(
        a_log.len() == c && dt_bias.len() == c,
        "delta_gates: [h·dk] parameters"
    );
    let g = a
        .par_iter()
        .with_min_len(CHUNK)
        .enumerate()
        .map(|(j, &a)| -a_log[j % c].exp() * softplus(a + dt_bias[j % c]))
        .collect();
    let beta = b.par_iter().with_min_len(CHUNK).map(|&b| sigmoid(b)).collect();
    (g, beta)
}

/// `(da, db, da_log, ddt_bias)` of [`delta_gates`]: `ddt_bias` the sum
/// of `da` over rows, `da_log` of `dg · g` (∂g/∂A_log = g), both over
/// the rows in order.
pub fn delta_gates_backward<F: Real>(
    a: &[F],
    b: &[F],
    a_log: &[F],
    dt_bias: &[F],
    dg: &[F],
    dbeta: &[F],
    [n, h, dk]: [usize; 3],
) -> (Vec<F>, Vec<F>, Vec<F>, Vec<F>) {
    let c = h * dk;
    assert!(
        a.len() == n * c && dg.len() == a.len() && b.len() == n * h && dbeta.len() == b.len(),
        "delta_gates_backward: lengths"
    );
    assert!(
        a_log.len() == c && dt_bias.len() == c,
        "delta_gates_backward: [h·dk] parameters"
    );
    // (da, dg · g) per element.
    let terms: Vec<(F, F)> = (a, dg)
        .into_par_iter()
        .with_min_len(CHUNK)
        .enumerate()
        .map(|(j, (&a, &dg))| {
            let x = a + dt_bias[j % c];
            let e = -a_log[j % c].exp();
            (dg * e * softplus_grad(x), dg * (e * softplus(x)))
        })
        .collect();
    let db = (b, dbeta)
        .into_par_iter()
        .with_min_len(CHUNK)
        .map(|(&b, &dbeta)| {
            let beta = sigmoid(b);
            dbeta * beta * (F::one() - beta)
        })
        .collect();
    let (mut da_log, mut ddt) = (vec![F::zero(); c], vec![F::zero(); c]);
    for (j, &(da, dgg)) in terms.iter().enumerate() {
        ddt[j % c] = ddt[j % c] + da;
        da_log[j % c] = da_log[j % c] + dgg;
    }
    let da = terms.into_iter().map(|(da, _)| da).collect();
    (da, db, da_log, ddt)
}
