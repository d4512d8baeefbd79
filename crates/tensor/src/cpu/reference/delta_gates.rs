//! The gated delta rule's per-head gates (Qwen3-Next's, Qwen3.5's):
//! the decay `g = −exp(A_log) · softplus(a + dt_bias)` and the write
//! strength `beta = σ(b)`, from the projections `a`, `b: [n, h]`.

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

/// `(g, beta)`, both `[n, h]` as `a` and `b`; `a_log`, `dt_bias` `[h]`.
pub fn delta_gates<F: Real>(a: &[F], b: &[F], a_log: &[F], dt_bias: &[F], h: usize) -> (Vec<F>, Vec<F>) {
    assert_eq!(a.len(), b.len(), "delta_gates: b length");
    assert!(
        a_log.len() == h && dt_bias.len() == h,
        "delta_gates: [h] parameters"
    );
    let pairs: Vec<(F, F)> = (a, b)
        .into_par_iter()
        .with_min_len(CHUNK)
        .enumerate()
        .map(|(j, (&a, &b))| {
            let hh = j % h;
            (-a_log[hh].exp() * softplus(a + dt_bias[hh]), sigmoid(b))
        })
        .collect();
    pairs.into_iter().unzip()
}

/// `(da, db, da_log, ddt_bias)` of [`delta_gates`]: `ddt_bias[h]` the sum
/// of `da` over rows, `da_log[h]` of `dg · g` (∂g/∂A_log = g), both over
/// the rows in order.
pub fn delta_gates_backward<F: Real>(
    a: &[F],
    b: &[F],
    a_log: &[F],
    dt_bias: &[F],
    dg: &[F],
    dbeta: &[F],
    h: usize,
) -> (Vec<F>, Vec<F>, Vec<F>, Vec<F>) {
    assert!(
        [b.len(), dg.len(), dbeta.len()].iter().all(|&l| l == a.len()),
        "delta_gates_backward: lengths"
    );
    assert!(
        a_log.len() == h && dt_bias.len() == h,
        "delta_gates_backward: [h] parameters"
    );
    // (da, db, dg · g) per element.
    let terms: Vec<(F, F, F)> = (a, b, dg, dbeta)
        .into_par_iter()
        .with_min_len(CHUNK)
        .enumerate()
        .map(|(j, (&a, &b, &dg, &dbeta))| {
            let hh = j % h;
            let x = a + dt_bias[hh];
            let e = -a_log[hh].exp();
            let beta = sigmoid(b);
            (
                dg * e * softplus_grad(x),
                dbeta * beta * (F::one() - beta),
                dg * (e * softplus(x)),
            )
        })
        .collect();
    let (mut da_log, mut ddt) = (vec![F::zero(); h], vec![F::zero(); h]);
    for (j, &(da, _, dgg)) in terms.iter().enumerate() {
        ddt[j % h] = ddt[j % h] + da;
        da_log[j % h] = da_log[j % h] + dgg;
    }
    let (da, db) = terms.into_iter().map(|(da, db, _)| (da, db)).unzip();
    (da, db, da_log, ddt)
}
